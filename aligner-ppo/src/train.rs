//! `aligner ppo` and `aligner rs` as library calls: a typed configuration, a run folder and a
//! device in, the run's summary out. Everything the run needs is made here: the reward model
//! (trained first into `<run>/reward_model` when `reward_model.path` is not set), the actor
//! with LoRA when configured, the critic (a thread of this process, or `ppo.critic_url`'s
//! server), the prompts.

use std::path::{Path, PathBuf};

use aligner_core::rm::RmConfig;
use aligner_core::run::{RunDir, data_files};
use aligner_core::start::{LoadedRewardModel, load_model, policy_store};
use aligner_core::{Device, TextTokenizer};

use crate::config::{PpoConfig, RewardModelSection};
use crate::critic::{CriticClient, CriticWorker, LocalCritic, single_output};
use crate::error::Result;
use crate::rejection::{RejectionSampling, RoundReport, RsConfig};
use crate::runner::{PpoRunner, PpoSummary};

/// Prompt ids of a `{"prompt": ...}` file (messages rendered with the tokenizer's chat template).
pub fn load_prompts(path: &Path, tokenizer: &TextTokenizer, context: usize) -> Result<Vec<Vec<u32>>> {
    Ok(aligner_core::data::load_prompts(path, tokenizer, context)?
        .into_iter()
        .map(|p| p.ids)
        .collect())
}

/// The prompt texts of a `{"prompt": ...}` file, as the model sees them (each checked to fit
/// in `context` tokens).
pub fn render_prompts(path: &Path, tokenizer: &TextTokenizer, context: usize) -> Result<Vec<String>> {
    Ok(aligner_core::data::load_prompts(path, tokenizer, context)?
        .into_iter()
        .map(|p| p.text)
        .collect())
}

/// The reward model folder: the configured one, or one trained now with `aligner rm`'s
/// defaults (the shipped preference pairs) into `<run>/reward_model`, kept for resumes.
pub fn reward_model_dir(section: &RewardModelSection, run: &RunDir, device: &Device) -> Result<PathBuf> {
    if let Some(path) = &section.path {
        return Ok(path.clone());
    }
    // No reward_model.path: one is trained on the shipped preference pairs.
    Ok(run.earlier_step("reward_model", "config.json", |rm_run| {
        aligner_core::rm::train(&RmConfig::default(), rm_run, device).map(drop)
    })?)
}

/// A PPO run: the actor of `[model]` against the reward model, with the critic in this process
/// or at `ppo.critic_url`. The mean time breakdown is written to `<run>/timing.md`.
pub fn train(config: &PpoConfig, run: &RunDir, device: &Device) -> Result<PpoSummary> {
    config.ppo.check()?;
    // A finished `reward_model` step in the folder is this run's input.
    run.start_with_steps(config, &["reward_model"])?;
    let rm_dir = reward_model_dir(&config.reward_model, run, device)?;
    let lm = load_model(&config.model, device)?;
    let frontier = config.frontier.for_start_model(&lm, device)?;
    let (train_prompts, eval_prompts) = data_files(&config.data)?
        .load(|path, _| load_prompts(path, &lm.tokenizer, lm.config.max_position_embeddings))?;
    let reward_folder = LoadedRewardModel::from_dir(&rm_dir, device)?;
    let store = reward_folder.store();
    let reward = single_output(reward_folder)?;
    let combined = config.ppo.combine_rm_and_critic;
    // Data parallel: rank 0 alone talks to the critic (server or in process) and shares its
    // replies with the other ranks.
    let critic: Option<Box<dyn CriticClient>> = match &config.ppo.critic_url {
        _ if !run.is_writer() => None,
        Some(url) => Some(Box::new(crate::server::RemoteCritic::connect(
            url,
            config.ppo.critic_retry_seconds,
            &run.checkpoints(),
        )?)),
        // The critic starts from the reward model (NeMo-Aligner's choice).
        None => Some(Box::new(LocalCritic::spawn(CriticWorker::new(
            reward.clone(),
            combined.then(|| reward.clone()),
            store,
            device,
        )))),
    };
    let mut model = lm.model;
    let actor_store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device);
    tracing::info!(
        train_prompts = train_prompts.len(),
        eval_prompts = eval_prompts.len(),
        reward_model = %rm_dir.display(),
        critic = config.ppo.critic_url.as_deref().unwrap_or("in process"),
        "PPO"
    );
    let runner = PpoRunner {
        config,
        llama: &lm.config,
        tokenizer: &lm.tokenizer,
        train_prompts: &train_prompts,
        eval_prompts: &eval_prompts,
        store: actor_store.as_ref(),
        run,
        device: device.clone(),
        local_reward: (!combined).then_some(reward),
        frontier: frontier.as_ref(),
    };
    let summary = runner.run(model, critic.as_deref())?;
    run.write_shared(|| {
        aligner_core::checkpoint::write_atomic(&run.join("timing.md"), summary.mean_times.table().as_bytes())
    })?;
    Ok(summary)
}

/// Rejection sampling (best-of-n) rounds: samples of the policy of `[model]` scored by the
/// reward model, the best kept, SFT on them; `<run>/rs.jsonl` records each round.
pub fn rejection_sampling(config: &RsConfig, run: &RunDir, device: &Device) -> Result<Vec<RoundReport>> {
    aligner_core::train::check_value(
        "rs.temperature",
        config.rs.temperature,
        aligner_core::train::Range::NonNegative,
    )?;
    aligner_core::train::check_counts(&[
        ("rs.rounds", config.rs.rounds),
        ("rs.n", config.rs.n),
        ("rs.max_new_tokens", config.rs.max_new_tokens),
    ])?;
    // A finished `reward_model` step in the folder is this run's input.
    run.start_with_steps(config, &["reward_model"])?;
    let rm_dir = reward_model_dir(&config.reward_model, run, device)?;
    let reward = single_output(LoadedRewardModel::from_dir(&rm_dir, device)?)?;
    let lm = load_model(&config.model, device)?;
    // Checked before the first round's samples are drawn.
    config.data.max_len(&lm.config)?;
    aligner_core::train::check_value(
        "rs.kl_coef",
        config.rs.kl_coef,
        aligner_core::train::Range::NonNegative,
    )?;
    let (train_prompts, eval_prompts) = data_files(&config.data)?
        .load(|path, _| render_prompts(path, &lm.tokenizer, lm.config.max_position_embeddings))?;
    let frontier = config.frontier.for_start_model(&lm, device)?;
    // With LoRA the start model is the base the adapters sit on; a copy keeps it either way.
    let reference = lm.model.clone();
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device);
    let sampling = RejectionSampling {
        config,
        llama: &lm.config,
        tokenizer: &lm.tokenizer,
        store: store.as_ref(),
        reward: &reward,
        train_prompts: &train_prompts,
        eval_prompts: &eval_prompts,
        run,
        device: device.clone(),
        reference: Some(&reference),
        frontier: frontier.as_ref(),
    };
    sampling.run(model)
}
