//! What a run starts from: the model of `[model]`, and how the run saves it — full weights, or
//! LoRA adapters when `model.lora_rank > 0` — for policies and for models with a head (reward
//! and attribute models); and trained reward-model folders loaded with their output names.

use std::path::{Path, PathBuf};

use crate::LoadedModel;
use crate::adapter::{LoraStore, RewardLoraStore};
use crate::config::{LlamaConfig, Precision};
use crate::error::{CoreError, Result};
use crate::model::{CausalLm, LlamaModel, LoraSpec};
use crate::reward::{RewardModel, labels_of};
use crate::store::{CausalLmStore, ModelStore, RewardModelStore};
use crate::tokenizer::TextTokenizer;
use crate::train::config::ModelSection;
use burn::tensor::Device;

/// The model folder of `[model]`: `model.path`, or the shipped default.
pub fn model_dir(section: &ModelSection) -> Result<PathBuf> {
    crate::model_dir_or_default(section.path.as_deref())
}

/// `[model]`'s `config.json` alone, without the weights: what settings that depend on the
/// model are checked against before a run trains anything (an earlier step included).
pub fn model_config(section: &ModelSection) -> Result<LlamaConfig> {
    LlamaConfig::from_file(&model_dir(section)?.join("config.json"))
}

/// The model a run starts from: `[model]`'s folder loaded (configuration, weights, tokenizer),
/// computing in `model.dtype`.
pub fn load_model(section: &ModelSection, device: &Device) -> Result<LoadedModel> {
    LoadedModel::from_dir(&model_dir(section)?, device)?.in_precision(section.dtype, device)
}

/// [`load_model`] for a run whose ranks form tensor groups of `parallel.tensor` (formed here:
/// a collective): each rank reads only its blocks of the weights tensor parallel splits, so
/// no rank holds the whole model. Returns the model and the run in its `data × tensor` grid
/// (`run` itself, and the whole model, when `parallel.tensor` is 1).
pub fn load_model_split(
    section: &ModelSection,
    parallel: &crate::train::ParallelSection,
    run: &crate::run::RunDir,
    device: &Device,
) -> Result<(LoadedModel, crate::run::RunDir)> {
    let (dir, grid) = folder_and_grid(section, parallel, run)?;
    let lm = load_for_run(&dir, &grid, device)?;
    Ok((lm.in_precision(section.dtype, device)?, grid))
}

/// The causal LM of the folder `dir` as this rank of `run` holds it: its blocks of the split
/// weights in a tensor group, the whole model without one.
pub fn load_for_run(dir: &Path, run: &crate::run::RunDir, device: &Device) -> Result<LoadedModel> {
    match run.tensor_group() {
        Some(group) => LoadedModel::from_dir_split(dir, device, &group),
        None => LoadedModel::from_dir(dir, device),
    }
}

/// `[model]`'s folder, and `run` in the tensor groups of `parallel` (a collective; refused,
/// naming the key, where the model cannot be split). [`load_model_split`] is this and
/// [`load_for_run`]; a run that reads another split model first (a distillation teacher,
/// [`crate::train::tensor::with_own_ids`]) calls the two itself.
pub fn folder_and_grid(
    section: &ModelSection,
    parallel: &crate::train::ParallelSection,
    run: &crate::run::RunDir,
) -> Result<(PathBuf, crate::run::RunDir)> {
    let dir = model_dir(section)?;
    let config = LlamaConfig::from_file(&dir.join("config.json"))?;
    let grid = parallel.grid(run, section, &config)?;
    Ok((dir, grid))
}

/// [`load_model_split`] for a model with a head of one output per label (reward and attribute
/// models): the trunk of `[model]`'s folder, each rank of a tensor group reading only its
/// blocks of it; the head stays whole.
pub fn load_head_model_split(
    section: &ModelSection,
    labels: &[String],
    parallel: &crate::train::ParallelSection,
    run: &crate::run::RunDir,
    device: &Device,
) -> Result<(LoadedRewardModel, crate::run::RunDir)> {
    let (dir, grid) = folder_and_grid(section, parallel, run)?;
    let start = match grid.tensor_group() {
        Some(group) => LoadedRewardModel::with_labels_split(&dir, labels, device, &group)?,
        None => LoadedRewardModel::with_labels(&dir, labels, device)?,
    };
    Ok((start.in_precision(section.dtype, device)?, grid))
}

/// The LoRA settings of `[model]`, when `lora_rank > 0`.
pub fn lora_spec(section: &ModelSection) -> Option<LoraSpec> {
    (section.lora_rank > 0).then(|| LoraSpec {
        rank: section.lora_rank,
        alpha: section.lora_alpha,
        dropout: section.lora_dropout,
        targets: section.lora_targets.clone(),
    })
}

/// Refuses LoRA settings `model` cannot train with, naming the key: a dropout outside [0, 1),
/// an alpha that is not a positive number, targets that name none of its projections (a run
/// would train nothing), and a rank above the narrowest adapted projection's width (a LoRA of
/// that width already updates it in full).
pub fn check_lora(spec: &LoraSpec, model: &LlamaModel) -> Result<()> {
    use crate::train::config::{Range, check_values};
    let invalid = |message: String| Err(CoreError::Invalid(message));
    check_values(&[
        ("model.lora_dropout", spec.dropout, Range::DropoutRate),
        ("model.lora_alpha", spec.alpha, Range::Positive),
    ])?;
    let mut model = model.clone();
    let projections: Vec<(String, [usize; 2])> = crate::model::projections(&mut model)
        .into_iter()
        .map(|(name, layer)| (name, layer.whole_dims()))
        .collect();
    let adapted: Vec<&(String, [usize; 2])> =
        projections.iter().filter(|(name, _)| spec.adapts(name)).collect();
    if adapted.is_empty() {
        let short = |name: &str| name.rsplit('.').next().unwrap_or_default().to_string();
        let mut names: Vec<String> = projections.iter().map(|(name, _)| short(name)).collect();
        names.sort();
        names.dedup();
        return invalid(format!(
            "model.lora_targets = {:?} names none of the model's projections ({}): LoRA would train nothing",
            spec.targets,
            names.join(", ")
        ));
    }
    if let Some((name, [d_in, d_out])) = adapted.iter().min_by_key(|(_, [i, o])| (*i).min(*o))
        && spec.rank > (*d_in).min(*d_out)
    {
        let width = (*d_in).min(*d_out);
        return invalid(format!(
            "model.lora_rank = {} is above the width of the projections it adapts (the narrowest, \
             {name}, is {d_in} × {d_out}): a rank of {width} already updates it in full; set \
             model.lora_rank to at most {width}, or 0 for full fine-tuning",
            spec.rank
        ));
    }
    Ok(())
}

/// Attaches LoRA adapters to a policy loaded from `dir` when `[model]` asks for them (refused
/// by [`check_lora`] where the model cannot take them), and returns how the run folder saves
/// and loads it (adapters, or the full weights).
pub fn policy_store(
    model: &mut CausalLm,
    section: &ModelSection,
    llama: &LlamaConfig,
    dir: &Path,
    device: &Device,
) -> Result<Box<dyn ModelStore<CausalLm>>> {
    Ok(match lora_spec(section) {
        Some(spec) => {
            // Saved adapters name the projections as the model does (Phi-3's fused ones).
            let spec = spec.for_model(&model.model);
            check_lora(&spec, &model.model)?;
            let adapted = model.attach_lora(&spec, device);
            let (trainable, total) = crate::adapter::parameter_split(model);
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
    })
}

/// [`policy_store`] for a model with a scalar or multi-output head (reward and attribute
/// models): with LoRA the trunk gets adapters and the head trains in full.
pub fn head_store(
    model: &mut RewardModel,
    section: &ModelSection,
    llama: &LlamaConfig,
    labels: &[String],
    dir: &Path,
    device: &Device,
) -> Result<Box<dyn ModelStore<RewardModel>>> {
    Ok(match lora_spec(section) {
        Some(spec) => {
            let spec = spec.for_model(&model.model);
            check_lora(&spec, &model.model)?;
            let adapted = model.model.attach_lora(&spec, device);
            tracing::info!(
                adapted_layers = adapted,
                "LoRA on the trunk; the head trains in full"
            );
            Box::new(RewardLoraStore {
                config: llama.clone(),
                labels: labels.to_vec(),
                base_dir: dir.to_path_buf(),
                spec,
            })
        }
        None => Box::new(RewardModelStore {
            config: llama.clone(),
            labels: labels.to_vec(),
            tokenizer_dir: dir.to_path_buf(),
        }),
    })
}

/// A trained reward or attribute model folder: the model, its output names in order (from
/// `id2label`; one output called `reward` when the folder names none), its tokenizer.
pub struct LoadedRewardModel {
    pub dir: PathBuf,
    pub config: LlamaConfig,
    pub labels: Vec<String>,
    pub model: RewardModel,
    pub tokenizer: TextTokenizer,
}

impl LoadedRewardModel {
    /// The same model computing in `precision` (refused, naming `model.dtype`, where the
    /// device cannot); its stores save in that type.
    pub fn in_precision(mut self, precision: Precision, device: &Device) -> Result<Self> {
        crate::model::compute_in(precision, &mut self.config, &mut self.model.model, device)?;
        Ok(self)
    }

    /// The trained reward or attribute model of the folder `dir`: refused, naming the folder,
    /// when it is not a sequence classifier (a causal LM's folder has no trained head, and a
    /// fresh one would score every sample 0).
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self> {
        let config = LlamaConfig::from_file(&dir.join("config.json"))?;
        if !config.is_sequence_classifier() {
            let architectures = match &config.architectures {
                Some(names) if !names.is_empty() => names.join(", "),
                _ => format!("no architectures (model_type {:?})", config.model_type),
            };
            return Err(CoreError::NotARewardModel {
                dir: dir.to_path_buf(),
                architectures,
            });
        }
        Self::starting_from(dir, device)
    }

    /// A scalar-headed model to train further from the folder `dir`: a sequence classifier
    /// with its head and labels, or a causal LM's trunk under a fresh zero head (a PPO
    /// critic may start from either).
    pub fn starting_from(dir: &Path, device: &Device) -> Result<Self> {
        let config = LlamaConfig::from_file(&dir.join("config.json"))?;
        let mut labels = labels_of(&config);
        if labels.is_empty() {
            labels = vec!["reward".to_string()];
        }
        Self::load(dir, config, labels, device, None)
    }

    /// The trunk of the model folder `dir` (a causal LM or a classifier) under a head of one
    /// output per label: where training a reward or attribute model starts.
    pub fn with_labels(dir: &Path, labels: &[String], device: &Device) -> Result<Self> {
        let config = LlamaConfig::from_file(&dir.join("config.json"))?;
        Self::load(dir, config, labels.to_vec(), device, None)
    }

    /// [`LoadedRewardModel::with_labels`] for a rank of the tensor group `group`: it reads
    /// only its blocks of the trunk's split weights (see [`load_model_split`]).
    pub fn with_labels_split(
        dir: &Path,
        labels: &[String],
        device: &Device,
        group: &std::sync::Arc<dyn aligner_parallel::Communicator>,
    ) -> Result<Self> {
        let config = LlamaConfig::from_file(&dir.join("config.json"))?;
        Self::load(dir, config, labels.to_vec(), device, Some(group))
    }

    fn load(
        dir: &Path,
        config: LlamaConfig,
        labels: Vec<String>,
        device: &Device,
        group: Option<&std::sync::Arc<dyn aligner_parallel::Communicator>>,
    ) -> Result<Self> {
        let model = RewardModel::load_in(dir, &config, labels.len(), device, group)?;
        let tokenizer = TextTokenizer::from_dir(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            labels,
            model,
            tokenizer,
        })
    }

    /// How the model is saved (the critic PPO starts from it keeps its format).
    pub fn store(&self) -> RewardModelStore {
        RewardModelStore {
            config: self.config.clone(),
            labels: self.labels.clone(),
            tokenizer_dir: self.dir.clone(),
        }
    }
}
