//! Online DPO (Guo et al., 2024, "Direct Language Model Alignment from Online AI Feedback";
//! TRL's `OnlineDPOTrainer`): each step the current policy answers a batch of prompts twice, a
//! reward (a reward model or any `[[reward]]` function) picks the chosen and rejected answer of
//! each pair (ties are skipped), and one DPO step follows, the start model as the reference.
//!
//! Sampling goes through aligner-gen's engine, refit in place to the policy's weights before
//! each step; the loss is `[dpo]`'s (any registered preference loss), computed by the same
//! [`DpoObjective`] the offline runs use.

use std::path::PathBuf;

use aligner_core::data::EncodedPrompt;
use aligner_core::rm::RmConfig;
use aligner_core::run::{RunDir, data_files};
use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::start::{LoadedRewardModel, load_model_split, policy_store};
use aligner_core::train::{
    CheckpointLayout, DataSection, EpochOrder, LoopSettings, Method, ModelEval, ModelSection, MovedKey,
    Objective, Optimizer, Stepped, TrainSection, learning_rate, non_finite, run_loop, sum_metrics_by_name,
};
use aligner_core::{CausalLm, CoreError, Device};
use aligner_gen::env::{Environment, EnvironmentSection, Episode, EpisodeStats};
use aligner_gen::reward::ModelReward;
use aligner_gen::{
    Engine, EngineOptions, GenerationRequest, RewardInput, RewardSpecs, Rewards, SamplingParams,
};
use aligner_parallel::shard_range;
use burn::module::Module;
use burn::optim::GradientsParams;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::objective::{DpoExample, DpoObjective, DpoSection};
use crate::{DpoError, LossRegistry};

/// The file an online-DPO checkpoint writes last.
pub const ONLINE_STATE: &str = "online_dpo_state.json";

/// `[online]`: what each step samples (its loop is `[train]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OnlineSection {
    /// Prompts per step (two answers each).
    pub prompts_per_step: usize,
    pub max_new_tokens: usize,
    pub temperature: f32,
    /// Held-out prompts scored at each evaluation (every `train.eval_every` steps; 0 = all).
    pub eval_prompts: usize,
    /// Engine rows decoded together.
    pub slots: usize,
}

impl Default for OnlineSection {
    fn default() -> Self {
        Self {
            prompts_per_step: 32,
            max_new_tokens: 48,
            temperature: 1.0,
            eval_prompts: 64,
            slots: 64,
        }
    }
}

/// The keys that moved from `[online]` to `[train]`, the loop's section in every method.
pub const MOVED_KEYS: &[MovedKey] = &[
    ("online.steps", "train.max_steps"),
    ("online.lr", "train.lr"),
    ("online.max_grad_norm", "train.max_grad_norm"),
    ("online.eval_every", "train.eval_every"),
    ("online.save_every", "train.save_every"),
    ("online.seed", "train.seed"),
    ("online.tensorboard", "train.tensorboard"),
];

/// `[train]` of the default online-DPO run: 24 steps at a constant 3e-4, evaluations and
/// checkpoints every 8.
pub fn default_train() -> TrainSection {
    TrainSection {
        max_steps: 24,
        lr: 3e-4,
        eval_every: 8,
        save_every: 8,
        seed: 0,
        ..TrainSection::default()
    }
}

/// Refuses `[train]` keys online DPO has no use for (it samples `online.prompts_per_step`
/// prompts a step, in one process), naming them; `section` names the loop's section.
pub fn check_train(train: &TrainSection, section: &str) -> Result<(), DpoError> {
    train.check()?;
    train.check_unused(
        section,
        &default_train(),
        "online DPO",
        &[
            (
                "batch_size",
                "a step answers online.prompts_per_step prompts twice",
            ),
            ("grad_accum", "each step is one update on its pairs"),
            (
                "eval_examples",
                "held-out prompts per evaluation are online.eval_prompts",
            ),
            ("sharding", "online DPO runs in one process"),
        ],
    )?;
    Ok(())
}

/// `[reward_model]` of online DPO: used when no `[[reward]]` is given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct OnlineRewardModel {
    /// HF sequence-classifier folder; empty = train one on the shipped preference pairs first.
    pub path: Option<PathBuf>,
}

/// `aligner online-dpo` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OnlineDpoConfig {
    pub model: ModelSection,
    pub reward_model: OnlineRewardModel,
    /// Prompt files (`{"prompt", ...fields a reward reads}`): train and held-out.
    pub data: DataSection,
    /// The preference loss (any registered one) and β.
    pub dpo: DpoSection,
    /// The loop: steps (`max_steps`, or `epochs` over the prompts), learning rate and
    /// schedule, clipping, evaluations, checkpoints, seed, TensorBoard.
    pub train: TrainSection,
    /// Sampling: prompts per step, answer length, temperature, held-out prompts.
    pub online: OnlineSection,
    /// Rewards as functions; empty: the reward model.
    #[serde(skip_serializing_if = "RewardSpecs::is_empty")]
    pub reward: RewardSpecs,
    pub frontier: aligner_gen::FrontierSection,
    /// `[environment]`: each answer a multi-turn episode (an environment's replies or tool
    /// results between the model's turns), scored by its turn rewards plus any `[[reward]]`;
    /// the pair's observations are masked from the DPO log-probs.
    #[serde(skip_serializing_if = "environment_is_off")]
    pub environment: aligner_gen::env::EnvironmentSection,
    /// Tensor groups (`parallel.tensor`): the policy and the reference split over each group,
    /// whose ranks sample the same answers together (the engine split the same way) and train
    /// on them as one process would.
    pub parallel: aligner_core::train::ParallelSection,
}

fn environment_is_off(section: &aligner_gen::env::EnvironmentSection) -> bool {
    !section.enabled()
}

impl Default for OnlineDpoConfig {
    fn default() -> Self {
        Self {
            model: ModelSection::default(),
            reward_model: OnlineRewardModel::default(),
            data: DataSection::shipped("train.prompts.jsonl", "test.prompts.jsonl"),
            dpo: DpoSection::default(),
            train: default_train(),
            online: OnlineSection::default(),
            reward: RewardSpecs::default(),
            frontier: aligner_gen::FrontierSection::shipped(),
            environment: aligner_gen::env::EnvironmentSection::default(),
            parallel: Default::default(),
        }
    }
}

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct OnlineDpoSummary {
    pub steps: usize,
    pub final_dir: PathBuf,
    pub initial_eval_reward: Option<f64>,
    pub final_eval_reward: Option<f64>,
}

/// A step's pairs: which of each prompt's two answers the reward prefers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preference {
    /// Index of the chosen answer in its pair (0 or 1).
    pub chosen: usize,
}

/// The pair `(a, b)`'s preference by reward, `None` for a tie (no signal to learn from).
pub fn prefer(a: f64, b: f64) -> Option<Preference> {
    if (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs())) {
        None
    } else {
        Some(Preference {
            chosen: if a > b { 0 } else { 1 },
        })
    }
}

/// An online-DPO run: the policy of `[model]` (LoRA when configured) trained into `run`.
pub fn train(
    config: &OnlineDpoConfig,
    registry: &LossRegistry,
    run: &RunDir,
    device: &Device,
) -> Result<OnlineDpoSummary, DpoError> {
    let loss = config.dpo.build_loss(registry)?;
    config.reward.check()?;
    let on = &config.online;
    aligner_core::train::check_counts(&[
        ("online.prompts_per_step", on.prompts_per_step),
        ("online.max_new_tokens", on.max_new_tokens),
    ])?;
    aligner_core::train::check_value(
        "online.temperature",
        on.temperature,
        aligner_core::train::Range::NonNegative,
    )?;
    check_train(&config.train, "train")?;
    if config.parallel.tensor > 1 && config.environment.enabled() {
        // Refused before a reward model is trained for it.
        return Err(DpoError::Invalid(
            "[environment] with parallel.tensor > 1: online DPO's episodes run on each rank of a \
             tensor group, which must then decode in lock step with environments that may answer \
             differently; use parallel.tensor = 1 (data-parallel ranks run episodes), or GRPO \
             (aligner ppo), whose episodes in tensor groups are answered on rank 0 alone"
                .into(),
        ));
    }
    config.reward.check_unused_model(
        config.reward_model.path.as_deref(),
        "online DPO has no other use for it",
    )?;
    let env = config.environment.build()?;
    run.start_with_steps(config, &["reward_model"])?;
    let rewards = if env.is_some() && config.reward.is_empty() {
        // The environment's rewards alone: no reward model.
        Rewards::new(Vec::new())
    } else if config.reward.is_empty() {
        let dir = match &config.reward_model.path {
            Some(path) => path.clone(),
            None => run.earlier_step("reward_model", "config.json", |rm_run| {
                aligner_core::rm::train(&RmConfig::default(), rm_run, device).map(drop)
            })?,
        };
        let model = LoadedRewardModel::from_dir(&dir, device)?.model;
        Rewards::new(vec![(1.0, Box::new(ModelReward::new("reward", model, 32)))])
    } else {
        config.reward.build(device)?
    };
    // In tensor groups (formed here, once the reward model is ready) each rank reads only its
    // blocks of the policy; the reference is a copy of those blocks.
    let (mut lm, grid) = load_model_split(&config.model, &config.parallel, run, device)?;
    let run = &grid;
    if let Some(tools) = config.environment.tools_json() {
        lm.tokenizer = lm.tokenizer.with_tools(tools);
    }
    aligner_core::train::check_new_tokens(&[("online.max_new_tokens", on.max_new_tokens)], &lm.config)?;
    // Rank 0 alone measures the frontier; the other ranks learn whether it does, to send it
    // their blocks of the policy.
    let frontier = config
        .frontier
        .for_split_start_model(&lm, &config.model, run, device)?;
    let frontier_anywhere = run.agree(&frontier.is_some())?;
    let context = lm.config.max_position_embeddings;
    let (train_prompts, eval_prompts) = data_files(&config.data)?
        .load(|path, _| aligner_core::data::load_prompts(path, &lm.tokenizer, context))?;
    if train_prompts.is_empty() {
        return Err(DpoError::Invalid("no training prompts".into()));
    }
    // The start model is the reference (with LoRA: the base, which the adapters start from).
    let reference = lm.model.clone();
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device)?;
    let objective = DpoObjective {
        loss,
        sft_weight: config.dpo.sft_weight,
    };
    let eval_limit = match on.eval_prompts {
        0 => eval_prompts.len(),
        n => n.min(eval_prompts.len()),
    };
    let mut step = OnlineStep {
        sampler: Sampler {
            config: on,
            tokenizer: &lm.tokenizer,
            rewards: &rewards,
            env: env.as_deref(),
            environment: &config.environment,
        },
        llama: &lm.config,
        train: &config.train,
        steps: config
            .train
            .sampling_steps(train_prompts.len(), on.prompts_per_step),
        objective,
        reference,
        train_prompts: &train_prompts,
        eval_set: eval_prompts[..eval_limit].iter().collect(),
        frontier: frontier.as_ref(),
        frontier_anywhere,
        run,
        engine: None,
        last: None,
    };
    let layout = CheckpointLayout {
        state: ONLINE_STATE,
        model: "policy",
        optimizer: "optimizer.bin",
    };
    let settings = LoopSettings {
        layout,
        label: "online-dpo step",
        ..LoopSettings::from_train(&config.train, step.steps)
    };
    let train_device = config.train.autodiff_device(device);
    let (_, summary) = run_loop(&mut step, model, store.as_ref(), &settings, run, &train_device)?;
    Ok(OnlineDpoSummary {
        steps: summary.steps,
        final_dir: summary.final_dir,
        initial_eval_reward: summary
            .initial_eval
            .and_then(|eval| eval.get("eval_reward").and_then(Value::as_f64)),
        final_eval_reward: step.last,
    })
}

/// Online DPO's step in the shared loop: sample two answers per prompt from the current
/// policy, let the reward pick, one DPO step on the pairs.
struct OnlineStep<'a> {
    /// Draws and scores the answers (`[online]`'s settings in `sampler.config`).
    sampler: Sampler<'a>,
    llama: &'a aligner_core::LlamaConfig,
    /// The loop's settings (`[train]`): seed, learning rate and its schedule.
    train: &'a TrainSection,
    /// Steps of the whole run.
    steps: usize,
    objective: DpoObjective,
    /// The start model (with LoRA: the base, which the adapters start from).
    reference: CausalLm,
    train_prompts: &'a [EncodedPrompt],
    eval_set: Vec<&'a EncodedPrompt>,
    /// Measured on rank 0 alone ([`OnlineStep::frontier_anywhere`] on every rank).
    frontier: Option<&'a aligner_gen::Frontier>,
    /// Whether rank 0 measures the frontier: in a tensor group its ranks send it their blocks.
    frontier_anywhere: bool,
    run: &'a RunDir,
    /// The generation engine, built at its first use ([`engine_on`]).
    engine: Option<Engine>,
    /// The last evaluation's reward in this process.
    last: Option<f64>,
}

/// The generation engine in `slot`, on `policy`'s weights ([`Engine::refit_or_build`]): built
/// at its first use, which in a tensor group comes once the loop has split every parameter
/// (LoRA's factors after `begin`), so the engine holds this rank's blocks and the group decodes
/// together; refit in place after.
fn engine_on<'e>(
    slot: &'e mut Option<Engine>,
    policy: &CausalLm,
    llama: &aligner_core::LlamaConfig,
    sampler: &Sampler<'_>,
) -> Result<&'e mut Engine, DpoError> {
    let options = EngineOptions {
        slots: sampler.config.slots,
        ..EngineOptions::default()
    };
    Ok(Engine::refit_or_build(slot, policy, llama, Some(sampler.tokenizer), options)?.0)
}

impl Method<CausalLm> for OnlineStep<'_> {
    type Error = DpoError;

    fn splits_tensors(&self) -> bool {
        true
    }

    fn evaluates_in_parts(&self) -> bool {
        true
    }

    fn step(
        &mut self,
        step: usize,
        policy: CausalLm,
        optim: &mut Optimizer<'_>,
    ) -> Result<Stepped<CausalLm>, DpoError> {
        let on = self.sampler.config;
        let train = self.train;
        let prompts: Vec<&EncodedPrompt> =
            EpochOrder::new(self.train_prompts.len(), train.shuffle, train.seed)
                .with_epoch_seed(|seed, epoch| seed.wrapping_add(epoch as u64))
                .items(step * on.prompts_per_step, on.prompts_per_step)
                .into_iter()
                .map(|i| &self.train_prompts[i])
                .collect();
        let seed = train
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(step as u64 * 100_000);
        let engine = engine_on(&mut self.engine, &policy, self.llama, &self.sampler)?;
        let Drawn {
            sequences: sampled,
            scores,
            episodes: stats,
        } = self.sampler.sample(engine, &prompts, 2, seed, self.run)?;
        let mut examples = Vec::new();
        for (pair, s) in sampled.chunks(2).zip(scores.chunks(2)) {
            if let Some(p) = prefer(s[0], s[1]) {
                let (c, r) = (p.chosen, 1 - p.chosen);
                examples.push(DpoExample {
                    chosen: pair[c].clone(),
                    rejected: pair[r].clone(),
                    reference: None,
                    rewards: Some((s[c] as f32, s[r] as f32)),
                });
            }
        }
        let mut row = Map::new();
        if let Some(stats) = stats {
            row.extend(stats.metrics());
        }
        row.insert("reward".into(), mean(&scores).into());
        row.insert("pairs".into(), examples.len().into());
        let lr = learning_rate(train.schedule, train.lr, step, train.warmup_steps, self.steps);
        row.insert("lr".into(), lr.into());
        let mut policy = policy;
        if !examples.is_empty() {
            // Every rank drew the same pairs; each trains on its share, its loss weighted by
            // the share's part of the pairs, and the optimizer sums the gradients.
            let comm = self.run.comm();
            let total = examples.len();
            let mine = shard_range(total, comm.rank(), comm.world_size());
            let share = mine.len() as f64 / total as f64;
            let mut examples = examples[mine].to_vec();
            optim.begin_pass(&policy, true)?;
            let mut grads = GradientsParams::new();
            let mut sums = (0.0, Vec::new());
            let _recompute = aligner_core::model::recompute::LayerRecompute::arm(
                train.activation_checkpointing == aligner_core::train::Checkpointing::Layers,
            );
            if !examples.is_empty() {
                if self.objective.loss.uses_reference() {
                    let seqs: Vec<ScoredSequence> = examples
                        .iter()
                        .flat_map(|e| [e.chosen.clone(), e.rejected.clone()])
                        .collect();
                    let lp = response_logprobs(&self.reference, &seqs, 32)?;
                    for (e, pair) in examples.iter_mut().zip(lp.chunks(2)) {
                        e.reference = Some((pair[0].total() as f32, pair[1].total() as f32));
                    }
                }
                let batch: Vec<&DpoExample> = examples.iter().collect();
                let (out, router_loss) =
                    aligner_core::model::with_router_loss(|| self.objective.step(&policy, &batch));
                let out = aligner_core::train::with_router_term(out?, router_loss);
                let value = out.loss.clone().into_scalar::<f32>() as f64;
                sums.0 = share * value;
                sums.1 = out.metrics.into_iter().map(|(k, v)| (k, share * v)).collect();
                let loss = match comm.world_size() {
                    1 => out.loss,
                    _ => out.loss.mul_scalar(share),
                };
                grads = aligner_core::model::recompute::gradients(loss, &policy);
            }
            // The loss and metrics of the whole batch, on every rank (so all stop together on a
            // non-finite loss).
            let (value, metrics) = match comm.world_size() {
                1 => sums,
                _ => {
                    let parts = aligner_core::parallel::gather(comm, &sums)?;
                    let value = parts.iter().map(|p| p.0).sum();
                    (value, sum_metrics_by_name(parts.into_iter().map(|p| p.1)))
                }
            };
            if !value.is_finite() {
                return Err(non_finite(self.run, "online DPO loss", value, step, ONLINE_STATE).into());
            }
            let (updated, norm) = optim.step(lr, policy, grads)?;
            policy = updated;
            row.insert("loss".into(), value.into());
            row.insert("grad_norm".into(), norm.into());
            for (k, v) in metrics {
                row.insert(k, v.into());
            }
        }
        Ok(Stepped {
            model: policy,
            row,
            message: format!("reward {:.3}", mean(&scores)),
        })
    }

    fn validates(&self) -> bool {
        true
    }

    fn evaluate(&mut self, policy: &CausalLm) -> Result<Map<String, Value>, DpoError> {
        let mut out = Map::new();
        if !self.eval_set.is_empty() {
            let engine = engine_on(&mut self.engine, policy, self.llama, &self.sampler)?;
            let scores = self
                .sampler
                .sample(engine, &self.eval_set, 1, 0xe7a1, self.run)?
                .scores;
            out.insert("eval_reward".into(), mean(&scores).into());
            self.last = Some(mean(&scores));
        }
        // Rank 0 measures the frontier (it writes the log) on the whole policy, which a tensor
        // group gathers to it alone.
        if self.frontier_anywhere {
            let whole = aligner_core::train::tensor::whole_on_writer(policy, self.run);
            if let (Some(whole), Some(frontier)) = (whole, self.frontier) {
                out.extend(ModelEval::evaluate(frontier, &whole.valid())?);
            }
        }
        Ok(out)
    }

    fn plot_keys(&self) -> Vec<String> {
        ["reward", "eval_reward", "loss"].map(String::from).to_vec()
    }
}

/// Draws answers from the engine (or episodes, with an environment) and scores them.
struct Sampler<'a> {
    config: &'a OnlineSection,
    tokenizer: &'a aligner_core::TextTokenizer,
    /// `[[reward]]` functions or the reward model; none when an environment's rewards are the
    /// only ones.
    rewards: &'a Rewards,
    env: Option<&'a dyn Environment>,
    environment: &'a EnvironmentSection,
}

impl Sampler<'_> {
    /// `n` answers per prompt (in prompt order) as scored sequences (an episode's
    /// observations marked), their rewards, and the episodes' statistics. Over data-parallel
    /// ranks each draws and scores its share of the prompts, and every rank gets them all:
    /// each answer's seed is its place in the whole batch, so the answers are one process's.
    /// A tensor group's ranks draw their share together (the engine split over the group) and
    /// train on its rank 0's answers and scores, to the bit.
    fn sample(
        &self,
        engine: &mut Engine,
        prompts: &[&EncodedPrompt],
        n: usize,
        seed: u64,
        run: &RunDir,
    ) -> Result<Drawn, DpoError> {
        let comm = run.comm();
        let params = SamplingParams {
            temperature: self.config.temperature,
            seed,
            max_new_tokens: self.config.max_new_tokens,
            ..SamplingParams::default()
        };
        let requests = GenerationRequest::repeated(prompts.iter().map(|p| p.ids.as_slice()), n, &params);
        let mine = shard_range(prompts.len(), comm.rank(), comm.world_size());
        let first = mine.start * n;
        let own = &requests[first..mine.end * n];
        let (outputs, episodes) = match self.env {
            None => (engine.generate(own)?, None),
            Some(env) => {
                let episodes = self.environment.run(
                    env,
                    engine,
                    self.tokenizer,
                    own,
                    |i| prompts[(first + i) / n],
                    seed.wrapping_add(first as u64),
                    self.config.max_new_tokens,
                )?;
                let outputs = episodes.iter().map(|e| e.generation.clone()).collect();
                (outputs, Some(episodes))
            }
        };
        let texts: Vec<String> = own
            .iter()
            .zip(&outputs)
            .map(|(r, o)| self.tokenizer.decode_continuation(&r.prompt_ids, &o.token_ids))
            .collect::<Result<_, CoreError>>()?;
        let inputs: Vec<RewardInput<'_>> = outputs
            .iter()
            .enumerate()
            .map(|(i, o)| {
                let p = prompts[(first + i) / n];
                RewardInput {
                    prompt: &p.text,
                    response: &texts[i],
                    prompt_ids: &p.ids,
                    response_ids: &o.token_ids,
                    stop_reason: o.stop_reason,
                    fields: &p.fields,
                }
            })
            .collect();
        let mut scores = match self.rewards.is_empty() {
            true => vec![0.0; inputs.len()],
            false => self.rewards.score_parts(&inputs)?.total,
        };
        if let Some(episodes) = &episodes {
            for (score, e) in scores.iter_mut().zip(episodes) {
                *score += self.environment.reward_of(e);
            }
        }
        let drawn = match run.tensor_group() {
            Some(group) => {
                aligner_core::parallel::broadcast_from_root(group.as_ref(), &(outputs, scores, episodes))?
            }
            None => (outputs, scores, episodes),
        };
        let (outputs, scores, episodes) = match comm.world_size() {
            1 => drawn,
            _ => {
                let parts = aligner_core::parallel::gather(comm, &drawn)?;
                let mut all = (Vec::new(), Vec::new(), None::<Vec<Episode>>);
                for (outputs, scores, episodes) in parts {
                    all.0.extend(outputs);
                    all.1.extend(scores);
                    if let Some(episodes) = episodes {
                        all.2.get_or_insert_with(Vec::new).extend(episodes);
                    }
                }
                all
            }
        };
        let mut sequences: Vec<ScoredSequence> =
            requests.iter().zip(&outputs).map(|(r, o)| o.scored(r)).collect();
        let stats = episodes.map(|episodes| {
            for (seq, e) in sequences.iter_mut().zip(&episodes) {
                seq.observed = e.observed.clone();
            }
            EpisodeStats::of(&episodes)
        });
        Ok(Drawn {
            sequences,
            scores,
            episodes: stats,
        })
    }
}

/// What [`Sampler::sample`] drew.
struct Drawn {
    sequences: Vec<ScoredSequence>,
    scores: Vec<f64>,
    /// The episodes' statistics, with an environment.
    episodes: Option<EpisodeStats>,
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_higher_reward_is_chosen_and_ties_are_skipped() {
        assert_eq!(prefer(1.0, 0.0), Some(Preference { chosen: 0 }));
        assert_eq!(prefer(-2.0, 0.5), Some(Preference { chosen: 1 }));
        assert_eq!(prefer(1.0, 1.0), None);
        assert_eq!(prefer(0.0, 0.0), None);
    }
}
