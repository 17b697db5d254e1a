//! `aligner ppo`: RLHF with PPO on the engine, the reward model and a critic (in this process,
//! or `aligner serve critic` when `ppo.critic_url` is set).

use std::path::{Path, PathBuf};

use aligner_core::data::{PromptRow, read_jsonl};
use aligner_core::reward::RewardModel;
use aligner_core::rm::RewardModelStore;
use aligner_core::{Device, LlamaConfig, LoadedModel, TextTokenizer};
use aligner_ppo::rejection::{RejectionSampling, RsConfig};
use aligner_ppo::{CriticClient, CriticWorker, LocalCritic, PpoConfig, PpoRunner, RewardModelSection};
use anyhow::{Context, Result};

use crate::train::{TrainArgs, model_dir, policy_store, prepare};

/// Prompt ids of a `{"prompt": ...}` file, rendered with the tokenizer's chat template when
/// prompts are messages.
pub fn load_prompts(path: &Path, tokenizer: &TextTokenizer) -> Result<Vec<Vec<u32>>> {
    read_jsonl::<PromptRow>(path)?
        .iter()
        .map(|row| Ok(tokenizer.encode(&row.prompt.render(tokenizer)?, true)?))
        .collect()
}

/// The reward model folder: the configured one, or one trained now on the shipped preference
/// pairs into `<run>/reward_model` (kept for resumes and later runs).
fn reward_model_dir(section: &RewardModelSection, out: &Path, device: &Device) -> Result<PathBuf> {
    if let Some(path) = &section.path {
        return Ok(path.clone());
    }
    let run = out.join("reward_model");
    let final_dir = run.join("final");
    if !final_dir.join("config.json").exists() {
        tracing::info!(run = %run.display(), "no reward_model.path: training one on the shipped preference pairs");
        crate::train::rm(TrainArgs::defaults_into(run), device)?;
    }
    Ok(final_dir)
}

/// Loads a reward model folder with its labels' store.
pub fn load_reward_model(dir: &Path, device: &Device) -> Result<(RewardModel, RewardModelStore)> {
    let config = LlamaConfig::from_file(&dir.join("config.json"))
        .with_context(|| format!("reading {}", dir.join("config.json").display()))?;
    let model = RewardModel::load(dir, &config, 1, device)
        .with_context(|| format!("loading reward model {}", dir.display()))?;
    let store = RewardModelStore {
        labels: vec!["reward".to_string()],
        config,
        tokenizer_dir: dir.to_path_buf(),
    };
    Ok((model, store))
}

pub fn ppo(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, out): (PpoConfig, _) = prepare(&args, "ppo")?;
    let rm_dir = reward_model_dir(&config.reward_model, &out, device)?;
    let dir = model_dir(&config.model)?;
    let lm =
        LoadedModel::from_dir(&dir, device).with_context(|| format!("loading model {}", dir.display()))?;
    let train_path = config.data.train.clone().context("data.train is not set")?;
    let train_prompts = load_prompts(&train_path, &lm.tokenizer)?;
    let eval_prompts = match config
        .data
        .validation
        .as_ref()
        .filter(|p| !p.as_os_str().is_empty())
    {
        Some(path) => load_prompts(path, &lm.tokenizer)?,
        None => Vec::new(),
    };
    let (reward, store) = load_reward_model(&rm_dir, device)?;
    let combined = config.ppo.combine_rm_and_critic;
    let critic: Box<dyn CriticClient> = match &config.ppo.critic_url {
        Some(url) => Box::new(aligner_ppo::server::RemoteCritic::connect(
            url,
            config.ppo.critic_retry_seconds,
            &out.join("checkpoints"),
        )?),
        None => Box::new(LocalCritic::spawn(CriticWorker::new(
            reward.clone(),
            combined.then(|| reward.clone()),
            store,
            device,
        ))),
    };
    let mut model = lm.model;
    let actor_store = policy_store(&mut model, &config.model, &lm.config, &dir, device);
    tracing::info!(
        train_prompts = train_prompts.len(),
        eval_prompts = eval_prompts.len(),
        reward_model = %rm_dir.display(),
        critic = config.ppo.critic_url.as_deref().unwrap_or("in process"),
        "PPO"
    );
    let runner = PpoRunner {
        config: &config,
        llama: &lm.config,
        tokenizer: &lm.tokenizer,
        train_prompts: &train_prompts,
        eval_prompts: &eval_prompts,
        store: actor_store.as_ref(),
        out_dir: &out,
        device: device.clone(),
        local_reward: (!combined).then_some(reward),
        stop_after: args.stop_after,
    };
    let summary = runner.run(model, critic.as_ref(), args.resume.is_some())?;
    let table = summary.mean_times.table();
    aligner_core::checkpoint::write_atomic(&out.join("timing.md"), table.as_bytes())?;
    println!("{table}");
    tracing::info!(
        steps = summary.steps,
        eval_reward_before = ?summary.initial_eval_reward,
        eval_reward_after = ?summary.final_eval_reward,
        run = %out.display(),
        "finished; policy in {}",
        summary.final_dir.display()
    );
    Ok(())
}

/// `aligner rs`: best-of-n rejection sampling rounds.
pub fn rs(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, out): (RsConfig, _) = prepare(&args, "rs")?;
    let rm_dir = reward_model_dir(&config.reward_model, &out, device)?;
    let (reward, _) = load_reward_model(&rm_dir, device)?;
    let dir = model_dir(&config.model)?;
    let lm =
        LoadedModel::from_dir(&dir, device).with_context(|| format!("loading model {}", dir.display()))?;
    let render = |path: &Path| -> Result<Vec<String>> {
        read_jsonl::<PromptRow>(path)?
            .iter()
            .map(|r| Ok(r.prompt.render(&lm.tokenizer)?))
            .collect()
    };
    let train_prompts = render(&config.data.train.clone().context("data.train is not set")?)?;
    let eval_prompts = match config
        .data
        .validation
        .as_ref()
        .filter(|p| !p.as_os_str().is_empty())
    {
        Some(p) => render(p)?,
        None => Vec::new(),
    };
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &dir, device);
    let run = RejectionSampling {
        config: &config,
        llama: &lm.config,
        tokenizer: &lm.tokenizer,
        store: store.as_ref(),
        reward: &reward,
        train_prompts: &train_prompts,
        eval_prompts: &eval_prompts,
        out_dir: &out,
        device: device.clone(),
    };
    let reports = run.run(model)?;
    for r in &reports {
        println!(
            "round {}: held-out reward {:.3} -> {:.3}; kept {} best of {} (mean reward {:.3} of all samples, {:.3} kept)",
            r.round,
            r.eval_reward_before,
            r.eval_reward_after,
            r.kept,
            config.rs.n,
            r.sample_reward,
            r.kept_reward
        );
    }
    Ok(())
}

/// `aligner spin`: self-play fine-tuning iterations.
pub fn spin(args: TrainArgs, device: &Device) -> Result<()> {
    use aligner_spin::{Spin, SpinConfig};
    let (config, out): (SpinConfig, _) = prepare(&args, "spin")?;
    let dir = model_dir(&config.model)?;
    let lm =
        LoadedModel::from_dir(&dir, device).with_context(|| format!("loading model {}", dir.display()))?;
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &dir, device);
    let spin = Spin {
        config: &config,
        llama: &lm.config,
        tokenizer: &lm.tokenizer,
        store: store.as_ref(),
        out_dir: &out,
        device: device.clone(),
    };
    for r in spin.run(model)? {
        println!(
            "iteration {}: reference margin of ground truth over its own answers {:.3} ({:.4} per token)",
            r.iteration, r.margin, r.margin_per_token
        );
    }
    Ok(())
}
