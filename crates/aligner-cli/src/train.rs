//! Training commands: `aligner sft` and `aligner rm`.

use std::path::{Path, PathBuf};

use aligner_core::adapter::{LoraStore, RewardLoraStore};
use aligner_core::model::LoraSpec;
use aligner_core::reward::RewardModel;
use aligner_core::rm::{RewardModelStore, RewardObjective, RmConfig, load_pairs};
use aligner_core::sft::{CausalLmStore, SftConfig, SftObjective, load_sft_examples};
use aligner_core::train::{
    DataSection, ModelSection, RunSummary, TrainSection, Trainer, load_config, to_toml,
};
use aligner_core::train::{ModelStore, Objective};
use aligner_core::{CausalLm, Device, LlamaConfig, LoadedModel, TextTokenizer};
use anyhow::{Context, Result, bail};
use burn::module::Module;
use clap::Args;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Options every training command takes.
#[derive(Args, Clone)]
pub struct TrainArgs {
    /// TOML configuration (default: the embedded default run).
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Override any key of the configuration, e.g. `--set train.max_steps=20`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub(crate) sets: Vec<String>,
    /// Run folder.
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its newest checkpoint, with its config.toml.
    #[arg(long, value_name = "RUN_DIR", conflicts_with = "config")]
    pub(crate) resume: Option<PathBuf>,
    /// Stop after this many optimizer steps as if interrupted (checkpoints stay resumable).
    #[arg(long, hide = true)]
    pub(crate) stop_after: Option<usize>,
}

impl TrainArgs {
    /// A command's embedded default run into `out` (a step another command runs first).
    pub(crate) fn defaults_into(out: PathBuf) -> Self {
        Self {
            config: None,
            sets: Vec::new(),
            out: Some(out),
            resume: None,
            stop_after: None,
        }
    }
}

/// The resolved configuration and run folder of a command.
pub(crate) fn prepare<T: Serialize + DeserializeOwned + Default>(
    args: &TrainArgs,
    command: &str,
) -> Result<(T, PathBuf)> {
    prepare_with(args, command, &T::default())
}

/// [`prepare`] from explicit defaults (commands whose steps default differently).
pub(crate) fn prepare_with<T: Serialize + DeserializeOwned>(
    args: &TrainArgs,
    command: &str,
    defaults: &T,
) -> Result<(T, PathBuf)> {
    let (config_file, out) = match &args.resume {
        Some(run) => (Some(run.join("config.toml")), run.clone()),
        None => (
            args.config.clone(),
            args.out
                .clone()
                .unwrap_or_else(|| PathBuf::from("runs").join(command)),
        ),
    };
    let config: T = load_config(defaults, config_file.as_deref(), &args.sets)?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating run folder {}", out.display()))?;
    aligner_core::checkpoint::write_atomic(&out.join("config.toml"), to_toml(&config)?.as_bytes())?;
    Ok((config, out))
}

pub(crate) fn model_dir(model: &ModelSection) -> Result<PathBuf> {
    crate::model_dir(model.path.clone())
}

fn require(path: &Option<PathBuf>, key: &str) -> Result<PathBuf> {
    path.clone().with_context(|| format!("{key} is not set"))
}

/// Attaches LoRA adapters to a policy when `[model]` asks for them, and returns how its run
/// folder saves and loads it.
pub(crate) fn policy_store(
    model: &mut CausalLm,
    section: &ModelSection,
    llama: &LlamaConfig,
    dir: &Path,
    device: &Device,
) -> Box<dyn ModelStore<CausalLm>> {
    match lora_spec(section) {
        Some(spec) => {
            let adapted = model.attach_lora(&spec, device);
            let (trainable, total) = aligner_core::adapter::parameter_split(model);
            tracing::info!(adapted_layers = adapted, trainable, total, "LoRA");
            Box::new(LoraStore {
                config: llama.clone(),
                base_dir: dir.to_path_buf(),
                spec,
            })
        }
        None => Box::new(CausalLmStore {
            config: llama.clone(),
            tokenizer_dir: dir.to_path_buf(),
        }),
    }
}

/// The LoRA settings of `[model]`, when `lora_rank > 0`.
pub(crate) fn lora_spec(model: &ModelSection) -> Option<LoraSpec> {
    (model.lora_rank > 0).then(|| LoraSpec {
        rank: model.lora_rank,
        alpha: model.lora_alpha,
        dropout: model.lora_dropout,
        targets: model.lora_targets.clone(),
    })
}

/// Where and how a command's training runs: its options, run folder and device.
pub(crate) struct Run<'a> {
    pub(crate) args: &'a TrainArgs,
    pub(crate) out: &'a Path,
    pub(crate) device: &'a Device,
}

impl Run<'_> {
    /// Trains (or resumes) `model` on `objective` and logs the validation before and after.
    pub(crate) fn fit<M: Module + 'static, O: Objective<M>>(
        &self,
        config: &TrainSection,
        objective: &O,
        store: &dyn ModelStore<M>,
        train: &[O::Example],
        validation: &[O::Example],
        model: M,
    ) -> Result<()> {
        let trainer = Trainer {
            config,
            objective,
            store,
            train,
            validation,
            out_dir: self.out,
            device: self.device.clone(),
            stop_after: self.args.stop_after,
        };
        let (_, summary) = trainer.run(model, self.args.resume.is_some())?;
        report(&summary, self.out);
        Ok(())
    }
}

fn report(summary: &RunSummary, out: &Path) {
    if let Some(initial) = &summary.initial_eval {
        tracing::info!(?initial, "validation before training");
    }
    tracing::info!(steps = summary.steps, eval = ?summary.final_eval, run = %out.display(), "finished; model in {}", summary.final_dir.display());
}

pub(crate) fn trainer_parts(data: &DataSection, train: &TrainSection) -> Result<(PathBuf, Option<PathBuf>)> {
    if train.batch_size == 0 || train.grad_accum == 0 {
        bail!("train.batch_size and train.grad_accum must be at least 1");
    }
    // An empty validation path (`--set data.validation=''`) turns validation off.
    let validation = data.validation.clone().filter(|p| !p.as_os_str().is_empty());
    Ok((require(&data.train, "data.train")?, validation))
}

pub fn sft(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, out): (SftConfig, _) = prepare(&args, "sft")?;
    let (train_path, val_path) = trainer_parts(&config.data, &config.train)?;
    let dir = model_dir(&config.model)?;
    let lm =
        LoadedModel::from_dir(&dir, device).with_context(|| format!("loading model {}", dir.display()))?;
    let mut train = load_sft_examples(&train_path, &lm.tokenizer, config.data.max_seq_len)?;
    if config.sft.packing {
        let sequences = train.len();
        train = aligner_core::sft::pack_examples(train, config.data.max_seq_len);
        tracing::info!(sequences, rows = train.len(), "packed");
    }
    let validation = match &val_path {
        Some(p) => load_sft_examples(p, &lm.tokenizer, config.data.max_seq_len)?,
        None => Vec::new(),
    };
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &dir, device);
    tracing::info!(train = train.len(), validation = validation.len(), "SFT");
    let run = Run {
        args: &args,
        out: &out,
        device,
    };
    run.fit(
        &config.train,
        &SftObjective,
        store.as_ref(),
        &train,
        &validation,
        model,
    )
}

pub fn rm(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, out): (RmConfig, _) = prepare(&args, "rm")?;
    let (train_path, val_path) = trainer_parts(&config.data, &config.train)?;
    let dir = model_dir(&config.model)?;
    let llama = LlamaConfig::from_file(&dir.join("config.json"))?;
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let mut model = aligner_core::reward::RewardModel::load(&dir, &llama, 1, device)
        .with_context(|| format!("loading model {}", dir.display()))?;
    let train = load_pairs(&train_path, &tokenizer, config.data.max_seq_len)?;
    let validation = match &val_path {
        Some(p) => load_pairs(p, &tokenizer, config.data.max_seq_len)?,
        None => Vec::new(),
    };
    tracing::info!(train = train.len(), validation = validation.len(), "reward model");
    let labels = vec!["reward".to_string()];
    let store: Box<dyn ModelStore<RewardModel>> = match lora_spec(&config.model) {
        Some(spec) => {
            let adapted = model.model.attach_lora(&spec, device);
            tracing::info!(
                adapted_layers = adapted,
                "LoRA on the trunk; the score head trains in full"
            );
            Box::new(RewardLoraStore {
                config: llama,
                labels,
                base_dir: dir.clone(),
                spec,
            })
        }
        None => Box::new(RewardModelStore {
            config: llama,
            labels,
            tokenizer_dir: dir.clone(),
        }),
    };
    let run = Run {
        args: &args,
        out: &out,
        device,
    };
    run.fit(
        &config.train,
        &RewardObjective,
        store.as_ref(),
        &train,
        &validation,
        model,
    )
}

pub fn dpo(args: TrainArgs, device: &Device) -> Result<()> {
    use aligner_dpo::LossRegistry;
    use aligner_dpo::objective::{DpoConfig, DpoObjective, attach_reference, load_dpo_examples};

    let (config, out): (DpoConfig, _) = prepare(&args, "dpo")?;
    let (train_path, val_path) = trainer_parts(&config.data, &config.train)?;
    #[allow(unused_mut)] // variant crates register only when their feature is on
    let mut registry = LossRegistry::with_builtin();
    #[cfg(feature = "simpo")]
    aligner_simpo::register(&mut registry);
    let loss = registry.build(&config.dpo.loss, &config.dpo.loss_params())?;
    let dir = model_dir(&config.model)?;
    let lm =
        LoadedModel::from_dir(&dir, device).with_context(|| format!("loading model {}", dir.display()))?;
    let mut train = load_dpo_examples(&train_path, &lm.tokenizer, config.data.max_seq_len)?;
    let mut validation = match &val_path {
        Some(p) => load_dpo_examples(p, &lm.tokenizer, config.data.max_seq_len)?,
        None => Vec::new(),
    };
    if loss.uses_reference() {
        // The start model is the reference (with LoRA: the base, since adapters start at zero).
        // Its log-probs are computed once and cached in the run folder for resumes.
        let batch = config.train.batch_size.max(1) * 2;
        attach_reference(&mut train, &lm.model, &out.join("reference_train.jsonl"), batch)?;
        attach_reference(
            &mut validation,
            &lm.model,
            &out.join("reference_validation.jsonl"),
            batch,
        )?;
    }
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &dir, device);
    tracing::info!(
        train = train.len(),
        validation = validation.len(),
        loss = loss.name(),
        "DPO"
    );
    let objective = DpoObjective {
        loss,
        beta: config.dpo.beta,
        sft_weight: config.dpo.sft_weight,
    };
    let run = Run {
        args: &args,
        out: &out,
        device,
    };
    run.fit(
        &config.train,
        &objective,
        store.as_ref(),
        &train,
        &validation,
        model,
    )
}

#[cfg(feature = "kto")]
pub fn kto(args: TrainArgs, device: &Device) -> Result<()> {
    use aligner_kto::{KtoConfig, KtoObjective, load_kto_examples};

    let (config, out): (KtoConfig, _) = prepare(&args, "kto")?;
    let (train_path, val_path) = trainer_parts(&config.data, &config.train)?;
    let dir = model_dir(&config.model)?;
    let lm =
        LoadedModel::from_dir(&dir, device).with_context(|| format!("loading model {}", dir.display()))?;
    // The start model is the reference; its log-probs are cached in the run folder.
    let batch = config.train.batch_size.max(1) * 2;
    let load = |path: &Path, cache: &str| {
        let max_len = config.data.max_seq_len;
        load_kto_examples(path, &lm.tokenizer, max_len, &lm.model, &out.join(cache), batch)
    };
    let train = load(&train_path, "reference_train.jsonl")?;
    let validation = match &val_path {
        Some(p) => load(p, "reference_validation.jsonl")?,
        None => Vec::new(),
    };
    let mut model = lm.model.clone();
    let store = policy_store(&mut model, &config.model, &lm.config, &dir, device);
    tracing::info!(train = train.len(), validation = validation.len(), "KTO");
    let objective = KtoObjective {
        params: config.kto.clone(),
    };
    let run = Run {
        args: &args,
        out: &out,
        device,
    };
    run.fit(
        &config.train,
        &objective,
        store.as_ref(),
        &train,
        &validation,
        model,
    )
}
