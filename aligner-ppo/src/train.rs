//! `aligner ppo` and `aligner rs` as library calls: a typed configuration, a run folder and a
//! device in, the run's summary out. Everything the run needs is made here: the reward model
//! (trained first into `<run>/reward_model` when `reward_model.path` is not set and a reward
//! model is needed), the rewards (`[[reward]]`), the actor with LoRA when configured, the
//! critic (a thread of this process, or `ppo.critic_url`'s server; GAE only), the prompts.

use std::path::{Path, PathBuf};

use aligner_core::config::Precision;
use aligner_core::data::EncodedPrompt;
use aligner_core::rm::RmConfig;
use aligner_core::run::{RunDir, data_files};
use aligner_core::start::{LoadedRewardModel, load_model, load_model_split, policy_store};
use aligner_core::{CoreError, Device};
use aligner_gen::reward::ModelReward;
use aligner_gen::{RewardSpecs, Rewards};

use crate::config::{PpoConfig, RewardModelSection};
use crate::critic::{CriticClient, CriticWorker, LocalCritic, reward_model, single_output};
use crate::error::Result;
use crate::rejection::{RejectionSampling, RoundReport, RsConfig};
use crate::runner::{PpoRunner, PpoSummary};

/// Refuses prompt rows that lack a field the rewards read, naming the file and line.
pub fn check_reward_fields(specs: &RewardSpecs, path: &Path, prompts: &[EncodedPrompt]) -> Result<()> {
    for field in specs.fields_needed() {
        if let Some(p) = prompts.iter().find(|p| !p.fields.contains_key(&field)) {
            return Err(CoreError::Data(aligner_core::data::DataError {
                path: path.to_path_buf(),
                line: p.line,
                message: format!("no field {field:?}, which the reward reads"),
            })
            .into());
        }
    }
    Ok(())
}

/// The train and validation prompts of `data` with their rows' fields, each row checked to fit
/// the model's context and to carry every field the rewards read.
fn prompt_files(
    data: &aligner_core::train::DataSection,
    lm: &aligner_core::LoadedModel,
    rewards: &RewardSpecs,
) -> Result<(Vec<EncodedPrompt>, Vec<EncodedPrompt>)> {
    data_files(data)?.load(|path, _| {
        let prompts =
            aligner_core::data::load_prompts(path, &lm.tokenizer, lm.config.max_position_embeddings)?;
        check_reward_fields(rewards, path, &prompts)?;
        Ok::<_, crate::PpoError>(prompts)
    })
}

/// The rewards of a run: the `[[reward]]` tables, or, without any, the reward model in
/// `rm_dir` computing in `precision` (`None` when the critic's process holds it: PPO with
/// combined roles).
pub fn run_rewards(
    specs: &RewardSpecs,
    rm_dir: Option<&Path>,
    device: &Device,
    precision: Precision,
) -> Result<Option<Rewards>> {
    if !specs.is_empty() {
        return Ok(Some(specs.build(device)?));
    }
    Ok(match rm_dir {
        Some(dir) => {
            let model = reward_model(dir, device, precision)?;
            Some(Rewards::new(vec![(
                1.0,
                Box::new(ModelReward::new("reward", model, 32)),
            )]))
        }
        None => None,
    })
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
    config.check()?;
    config.reward.check()?;
    let needs_critic = config.ppo.advantage.needs_critic();
    let env = config.environment.build()?;
    // The environment's rewards alone: no reward model scores.
    let env_only = env.is_some() && config.reward.is_empty();
    if config.parallel.tensor <= 1 && !config.ppo.split_engine {
        return Err(crate::PpoError::Invalid(
            "ppo.split_engine = false chooses how tensor groups generate, but parallel.tensor is 1".into(),
        ));
    }
    if !needs_critic {
        config.reward.check_unused_model(
            config.reward_model.path.as_deref(),
            "this advantage has no critic to start from it",
        )?;
    }
    aligner_core::train::check_new_tokens(
        &[("ppo.max_new_tokens", config.ppo.max_new_tokens)],
        &aligner_core::start::model_config(&config.model)?,
    )?;
    // A finished `reward_model` step in the folder is this run's input.
    run.start_with_steps(config, &["reward_model"])?;
    // The critic's process scores with the reward model when the roles are combined and no
    // reward functions are configured; otherwise the actor scores.
    let combined = config.ppo.combine_rm_and_critic && needs_critic && config.reward.is_empty() && !env_only;
    let reward_device = config.ppo.reward_device(device);
    // The critic and the reward model compute in the actor's type, but on the host (an
    // offloaded reward model), which computes in f32.
    let precision = config.model.dtype;
    let reward_precision = match config.ppo.offload_reward_model {
        true => Precision::F32,
        false => precision,
    };
    // `[[reward]]` tables are built (their models loaded and checked) before a reward model
    // is trained, so a bad one is refused in a second, not after the training.
    let spec_rewards = run_rewards(&config.reward, None, &reward_device, reward_precision)?;
    // A reward model is needed to score (no `[[reward]]`) or to start the critic (GAE).
    let rm_dir = ((config.reward.is_empty() && !env_only) || needs_critic)
        .then(|| reward_model_dir(&config.reward_model, run, device))
        .transpose()?;
    // In tensor groups (formed here, once the reward model is ready) each rank reads only its
    // blocks of the actor; the reference is a copy of those blocks.
    let (mut lm, grid) = load_model_split(&config.model, &config.parallel, run, device)?;
    // Declared tools are rendered into the chat prompts (the template's `tools`).
    if let Some(tools) = config.environment.tools_json() {
        lm.tokenizer = lm.tokenizer.with_tools(tools);
    }
    let frontier = config
        .frontier
        .for_split_start_model(&lm, &config.model, &grid, device)?;
    let (train_prompts, eval_prompts) = prompt_files(&config.data, &lm, &config.reward)?;
    let rewards = match spec_rewards {
        Some(rewards) => Some(rewards),
        None if env_only => None,
        None => run_rewards(
            &config.reward,
            rm_dir.as_deref().filter(|_| !combined),
            &reward_device,
            reward_precision,
        )?,
    };
    // Data parallel: rank 0 alone talks to the critic (server or in process) and shares its
    // replies with the other ranks.
    let critic: Option<Box<dyn CriticClient>> = match (&config.ppo.critic_url, &rm_dir) {
        _ if !run.is_writer() || !needs_critic => None,
        (Some(url), _) => Some(Box::new(crate::server::RemoteCritic::connect(
            url,
            config.ppo.critic_retry_seconds,
            &run.checkpoints(),
        )?)),
        // The critic starts from the reward model (NeMo-Aligner's choice).
        (None, Some(rm_dir)) => {
            let reward_folder =
                LoadedRewardModel::from_dir(rm_dir, device)?.in_precision(precision, device)?;
            let store = reward_folder.store();
            let reward = single_output(reward_folder)?;
            // The frozen reward model beside the critic: the critic's starting weights, or a
            // copy in host memory when it is offloaded.
            let beside = match (combined, config.ppo.offload_reward_model) {
                (false, _) => None,
                (true, false) => Some(reward.clone()),
                (true, true) => Some(reward_model(rm_dir, &reward_device, reward_precision)?),
            };
            Some(Box::new(LocalCritic::spawn(CriticWorker::new(
                reward, beside, store, device,
            ))))
        }
        (None, None) => None,
    };
    let mut model = lm.model;
    let actor_store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device)?;
    tracing::info!(
        train_prompts = train_prompts.len(),
        eval_prompts = eval_prompts.len(),
        reward = %rewards.as_ref().map(|r| r.names().join(" + ")).unwrap_or_else(|| "reward model beside the critic".into()),
        critic = if needs_critic { config.ppo.critic_url.as_deref().unwrap_or("in process") } else { "none" },
        "PPO"
    );
    let run = &grid;
    let runner = PpoRunner {
        config,
        llama: &lm.config,
        tokenizer: &lm.tokenizer,
        train_prompts: &train_prompts,
        eval_prompts: &eval_prompts,
        store: actor_store.as_ref(),
        run,
        device: device.clone(),
        reward: rewards.as_ref(),
        frontier: frontier.as_ref(),
        env: env.as_deref(),
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
    config.reward.check()?;
    config.reward.check_unused_model(
        config.reward_model.path.as_deref(),
        "rejection sampling has no other use for it",
    )?;
    aligner_core::train::check_value(
        "rs.kl_coef",
        config.rs.kl_coef,
        aligner_core::train::Range::NonNegative,
    )?;
    // Checked before a reward model is trained or a round's samples are drawn.
    let start = aligner_core::start::model_config(&config.model)?;
    config.data.max_len(&start)?;
    aligner_core::train::check_new_tokens(&[("rs.max_new_tokens", config.rs.max_new_tokens)], &start)?;
    let env = config.environment.build()?;
    if env.is_some() && config.rs.kl_coef > 0.0 {
        return Err(crate::PpoError::Invalid(format!(
            "rs.kl_coef = {} weighs each sample's log-ratio to the start model; with [environment] \
             the episodes' observations are not the model's to weigh: set rs.kl_coef = 0",
            config.rs.kl_coef
        )));
    }
    // The environment's rewards alone: no reward model scores.
    let env_only = env.is_some() && config.reward.is_empty();
    // A finished `reward_model` step in the folder is this run's input.
    run.start_with_steps(config, &["reward_model"])?;
    let rm_dir = (config.reward.is_empty() && !env_only)
        .then(|| reward_model_dir(&config.reward_model, run, device))
        .transpose()?;
    let reward = run_rewards(&config.reward, rm_dir.as_deref(), device, config.model.dtype)?;
    if reward.is_none() && !env_only {
        return Err(crate::PpoError::Invalid(
            "rejection sampling needs a reward".into(),
        ));
    }
    let mut lm = load_model(&config.model, device)?;
    if let Some(tools) = config.environment.tools_json() {
        lm.tokenizer = lm.tokenizer.with_tools(tools);
    }
    let (train_prompts, eval_prompts) = prompt_files(&config.data, &lm, &config.reward)?;
    let frontier = config.frontier.for_start_model(&lm, device)?;
    // Each round's SFT trains in tensor groups (formed here, refused naming the key where the
    // model cannot be split); the samples are drawn over every rank with the whole model.
    let grid = config.parallel.grid(run, &config.model, &lm.config)?;
    // With LoRA the start model is the base the adapters sit on; a copy keeps it either way.
    let reference = lm.model.clone();
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device)?;
    let sampling = RejectionSampling {
        config,
        llama: &lm.config,
        tokenizer: &lm.tokenizer,
        store: store.as_ref(),
        reward: reward.as_ref(),
        env: env.as_deref(),
        train_prompts: &train_prompts,
        eval_prompts: &eval_prompts,
        run,
        grid: &grid,
        device: device.clone(),
        reference: Some(&reference),
        frontier: frontier.as_ref(),
    };
    sampling.run(model)
}
