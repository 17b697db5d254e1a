//! `aligner ppo` configuration: `[model]` (the actor, from an SFT model; LoRA), `[reward_model]`,
//! `[data]` (prompt files), `[train]` (the loop, as in every method), `[ppo]` (rollouts,
//! advantages, losses, the critic) and `[[reward]]` (rewards as functions).

use std::path::PathBuf;

use aligner_core::train::{DataSection, ModelSection, MovedKey, TrainSection};
use serde::{Deserialize, Serialize};

use crate::advantages::{Advantage, KlEstimator};
use crate::losses::{ImportanceRatio, LossAgg, PolicyLossOptions};

/// `[reward_model]`: the frozen reward model, which also starts the critic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RewardModelSection {
    /// HF sequence-classifier folder; empty = train one on the shipped preference data first.
    pub path: Option<PathBuf>,
}

/// What happens to responses that never produced EOS (cut by the token limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NonEos {
    /// Trained on like any other.
    #[default]
    Keep,
    /// Left out of the policy and value updates.
    Exclude,
    /// Their reward gets `non_eos_penalty` added.
    Penalize,
}

/// `[ppo]`: what a step samples and how it updates (its loop is `[train]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoSection {
    /// Prompts per rollout.
    pub rollout_prompts: usize,
    /// Responses per prompt (GRPO / RLOO need at least 2).
    pub samples_per_prompt: usize,
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub kl_coef: f32,
    pub kl_estimator: KlEstimator,
    pub gamma: f32,
    pub lam: f32,
    pub advantage: Advantage,
    pub whiten_advantages: bool,
    /// Passes over each rollout.
    pub epochs: usize,
    pub mini_batch: usize,
    /// The policy ratio's clip range below 1 (and above it, unless `clip_eps_high` is set).
    pub clip_eps: f64,
    /// DAPO's clip-higher: the range above 1 (e.g. 0.28 with `clip_eps` 0.2), so unlikely
    /// tokens with positive advantages can gain more (against entropy collapse).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_eps_high: Option<f64>,
    /// Token ratios (PPO, GRPO) or one length-normalised ratio per sequence (GSPO).
    pub importance_ratio: ImportanceRatio,
    /// How per-token policy losses are averaged (`token-mean`, `seq-mean-token-sum`,
    /// `seq-mean-token-mean`, `seq-mean-token-sum-norm`).
    pub loss_agg: LossAgg,
    /// DAPO's dynamic sampling: groups whose samples all score the same are dropped and more
    /// prompts drawn to refill the batch (group advantages only).
    pub dynamic_sampling: bool,
    /// How many extra draws of `rollout_prompts` prompts a step may make to refill its batch.
    pub dynamic_sampling_max_draws: usize,
    /// Steps in a row whose samples carry no learning signal (a constant reward, every group
    /// alike under a group advantage, nothing left to train on) after which the run stops
    /// with an error saying why; each such step warns at once. 0 = never stop.
    pub stop_after_flat_steps: usize,
    /// DAPO's overlong reward shaping: responses longer than `max_new_tokens −
    /// overlong_buffer` tokens lose up to `overlong_penalty` linearly (0 = off).
    pub overlong_buffer: usize,
    pub overlong_penalty: f32,
    /// Truncated importance sampling (verl's and TRL's fix of the rollout/trainer mismatch):
    /// when > 0, the actor recomputes the sampled tokens' log-probs before its update and the
    /// clipped loss takes those as `π_old`, each token's advantage weighted by
    /// `min(π_old / π_engine, tis_cap)` (the engine's log-probs are the behaviour policy), so
    /// an engine that computes differently (half precision, another kernel) does not bias
    /// the update. 0 = off: the engine's log-probs are `π_old` themselves.
    pub tis_cap: f64,
    /// The actor's and the reference's passes over a rollout pack its sequences into rows
    /// (first-fit, positions restarting, attention kept inside each sequence) instead of
    /// left-padding prompts and right-padding responses to the longest of each (false):
    /// responses of different lengths (multi-turn episodes above all) waste no compute on
    /// padding. The log-probs are the padded layout's (tested to 1e-4); the critic's pass is
    /// padded.
    pub pack_sequences: bool,
    pub value_clip_eps: f64,
    /// Weight of the entropy bonus (0 = off); computed exactly from the response positions'
    /// full distributions.
    pub entropy_coef: f64,
    pub critic_lr: f64,
    pub non_eos: NonEos,
    pub non_eos_penalty: f32,
    /// `http://host:port` of `aligner serve critic`; empty = the critic runs in this process.
    pub critic_url: Option<String>,
    /// One server (or thread) holds the reward model and the critic.
    pub combine_rm_and_critic: bool,
    /// How long the actor keeps retrying an unreachable critic before it stops.
    pub critic_retry_seconds: f64,
    /// Engine rows and workers for rollouts.
    pub slots: usize,
    pub workers: usize,
    /// Held-out prompts scored at each evaluation (every `train.eval_every` steps; 0 = all).
    pub eval_prompts: usize,
    /// One-step-off asynchronous RL: the next step's samples are drawn (and scored) on a
    /// second thread from the weights this step starts with, while it trains; each step
    /// trains on samples one update old (`behaviour_lag` 1 in metrics.jsonl), the clipped
    /// ratio taken against the log-probs of the weights that drew them. One process only.
    pub one_step_off: bool,
    /// With `parallel.tensor`: the engine holds this rank's blocks of the actor and its group
    /// generates together, no rank holding the whole model (true); false gathers the whole
    /// actor on every rank for its own engine each step (the samples one process draws, to
    /// the bit, for the memory of a whole copy a rank: the engines' sums run in another order
    /// on the blocks, and AdamW's first steps turn such differences of the behaviour
    /// log-probs into updates of up to `train.lr` where a gradient nearly cancels).
    pub split_engine: bool,
    /// Keep the frozen reference in host memory and score it on the CPU backend, leaving the
    /// accelerator's memory to the actor (NeMo-Aligner offloads its reference the same way;
    /// the rollout's reference log-probs are then computed on the CPU).
    pub offload_reference: bool,
    /// Keep the frozen reward model in host memory and score it on the CPU backend: beside
    /// the actor, or beside the critic when the roles are combined (the critic itself trains
    /// on the device). The rollout's rewards are then computed on the CPU.
    pub offload_reward_model: bool,
}

impl PpoSection {
    /// Where the frozen reward model scores: the host's CPU backend with
    /// `offload_reward_model`, else `device`.
    pub fn reward_device(&self, device: &aligner_core::Device) -> aligner_core::Device {
        if self.offload_reward_model {
            aligner_core::Device::flex()
        } else {
            device.clone()
        }
    }
}

impl PpoSection {
    /// The policy loss's settings.
    pub fn policy_loss(&self) -> PolicyLossOptions {
        PolicyLossOptions {
            clip_low: self.clip_eps,
            clip_high: self.clip_eps_high.unwrap_or(self.clip_eps),
            ratio: self.importance_ratio,
            agg: self.loss_agg,
            max_tokens: self.max_new_tokens,
        }
    }

    /// Refuses settings PPO cannot run with, naming the key.
    pub fn check(&self) -> Result<(), aligner_core::CoreError> {
        let invalid = |m: String| Err(aligner_core::CoreError::Invalid(m));
        if !(self.tis_cap.is_finite() && self.tis_cap >= 0.0) {
            return invalid(format!(
                "ppo.tis_cap = {}: the largest importance weight, a number ≥ 1 (0 = off)",
                self.tis_cap
            ));
        }
        if self.advantage.needs_groups() && self.samples_per_prompt < 2 {
            return invalid(format!(
                "ppo.advantage = {:?} compares samples of one prompt: set ppo.samples_per_prompt to at least 2",
                self.advantage
            ));
        }
        if self.dynamic_sampling && !self.advantage.needs_groups() {
            return invalid(
                "ppo.dynamic_sampling drops groups whose samples score alike: it needs a group advantage \
                 (ppo.advantage = \"grpo\", \"dr_grpo\" or \"rloo\")"
                    .into(),
            );
        }
        if self.overlong_buffer > self.max_new_tokens {
            return invalid(format!(
                "ppo.overlong_buffer = {} is longer than ppo.max_new_tokens = {}",
                self.overlong_buffer, self.max_new_tokens
            ));
        }
        if let Some(high) = self.clip_eps_high {
            aligner_core::train::check_value(
                "ppo.clip_eps_high",
                high,
                aligner_core::train::Range::Positive,
            )?;
            if high < self.clip_eps {
                return invalid(format!(
                    "ppo.clip_eps_high = {high} is below ppo.clip_eps = {}: clip-higher widens the \
                     upper clip range, so it must be at least ppo.clip_eps",
                    self.clip_eps
                ));
            }
        }
        if let Some(url) = &self.critic_url {
            if !self.advantage.needs_critic() {
                return invalid(format!(
                    "ppo.critic_url is set but ppo.advantage = {} uses no critic: leave it out \
                     (or use ppo.advantage = \"gae\")",
                    serde_json::to_string(&self.advantage).unwrap_or_default()
                ));
            }
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return invalid(format!(
                    "ppo.critic_url = {url:?} has no scheme: write it as http://HOST:PORT (e.g. \
                     http://localhost:5557)"
                ));
            }
        }
        // Beyond this a deadline overflows the clock; no critic is waited for a week.
        if self.critic_retry_seconds > 604_800.0 {
            return invalid(format!(
                "ppo.critic_retry_seconds = {} is more than a week (604800 s)",
                self.critic_retry_seconds
            ));
        }
        aligner_core::train::check_value(
            "ppo.overlong_penalty",
            self.overlong_penalty,
            aligner_core::train::Range::NonNegative,
        )?;
        use aligner_core::train::Range::{Fraction, NonNegative, OpenFraction, Positive};
        aligner_core::train::check_values(&[
            ("ppo.temperature", self.temperature.into(), NonNegative),
            ("ppo.top_p", self.top_p.into(), OpenFraction),
            ("ppo.kl_coef", self.kl_coef.into(), NonNegative),
            ("ppo.gamma", self.gamma.into(), Fraction),
            ("ppo.lam", self.lam.into(), Fraction),
            ("ppo.clip_eps", self.clip_eps, Positive),
            ("ppo.value_clip_eps", self.value_clip_eps, NonNegative),
            ("ppo.entropy_coef", self.entropy_coef, NonNegative),
            ("ppo.critic_lr", self.critic_lr, Positive),
            ("ppo.critic_retry_seconds", self.critic_retry_seconds, NonNegative),
        ])?;
        aligner_core::train::check_counts(&[
            ("ppo.rollout_prompts", self.rollout_prompts),
            ("ppo.samples_per_prompt", self.samples_per_prompt),
            ("ppo.max_new_tokens", self.max_new_tokens),
            ("ppo.epochs", self.epochs),
            ("ppo.mini_batch", self.mini_batch),
            ("ppo.slots", self.slots),
            ("ppo.workers", self.workers),
        ])
    }
}

impl Default for PpoSection {
    fn default() -> Self {
        Self {
            rollout_prompts: 32,
            samples_per_prompt: 1,
            max_new_tokens: 48,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            kl_coef: 0.05,
            kl_estimator: KlEstimator::K1,
            gamma: 1.0,
            lam: 0.95,
            advantage: Advantage::Gae,
            whiten_advantages: true,
            epochs: 2,
            mini_batch: 16,
            clip_eps: 0.2,
            clip_eps_high: None,
            importance_ratio: ImportanceRatio::Token,
            loss_agg: LossAgg::TokenMean,
            dynamic_sampling: false,
            dynamic_sampling_max_draws: 3,
            stop_after_flat_steps: 4,
            overlong_buffer: 0,
            overlong_penalty: 1.0,
            tis_cap: 0.0,
            pack_sequences: true,
            value_clip_eps: 0.2,
            entropy_coef: 0.0,
            critic_lr: 3e-4,
            non_eos: NonEos::Keep,
            non_eos_penalty: -1.0,
            critic_url: None,
            combine_rm_and_critic: true,
            critic_retry_seconds: 30.0,
            offload_reference: false,
            offload_reward_model: false,
            one_step_off: false,
            split_engine: true,
            slots: 64,
            workers: 1,
            eval_prompts: 64,
        }
    }
}

/// The whole `aligner ppo` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoConfig {
    pub model: ModelSection,
    pub reward_model: RewardModelSection,
    pub data: DataSection,
    /// The loop: steps (`max_steps`, or `epochs` over the prompts), the actor's learning rate
    /// and schedule, clipping, evaluations, checkpoints, seed, activation checkpointing,
    /// TensorBoard. Rollouts are `ppo.rollout_prompts` prompts, updates `ppo.mini_batch`
    /// sequences, so `batch_size`, `grad_accum` and `eval_examples` are refused.
    pub train: TrainSection,
    pub ppo: PpoSection,
    /// Rewards as functions: one `[reward]` table or several `[[reward]]` tables (a reward
    /// model, `command`, `url`, `function` or `rule`), summed with their weights. Empty: the
    /// reward model of `[reward_model]`.
    #[serde(skip_serializing_if = "aligner_gen::RewardSpecs::is_empty")]
    pub reward: aligner_gen::RewardSpecs,
    /// The reward–KL figures of the actor's own samples, at every validation.
    pub frontier: aligner_gen::FrontierSection,
    /// Multi-turn episodes in an environment (a program, an endpoint or tools); off unless
    /// set. With it and no `[reward]`, the environment's rewards are the only ones.
    #[serde(skip_serializing_if = "environment_is_off")]
    pub environment: aligner_gen::env::EnvironmentSection,
    /// Tensor groups (`parallel.tensor`): the actor split over each group (not with an
    /// environment).
    pub parallel: aligner_core::train::ParallelSection,
}

fn environment_is_off(section: &aligner_gen::env::EnvironmentSection) -> bool {
    !section.enabled()
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            model: ModelSection::default(),
            reward_model: RewardModelSection::default(),
            data: DataSection::shipped("train.prompts.jsonl", "test.prompts.jsonl"),
            train: PpoConfig::default_train(),
            ppo: PpoSection::default(),
            reward: aligner_gen::RewardSpecs::default(),
            frontier: aligner_gen::FrontierSection::shipped(),
            environment: aligner_gen::env::EnvironmentSection::default(),
            parallel: Default::default(),
        }
    }
}

/// The keys that moved from `[ppo]` to `[train]`, the loop's section in every method.
pub const MOVED_KEYS: &[MovedKey] = &[
    ("ppo.steps", "train.max_steps"),
    ("ppo.actor_lr", "train.lr"),
    ("ppo.max_grad_norm", "train.max_grad_norm"),
    ("ppo.eval_every", "train.eval_every"),
    ("ppo.save_every", "train.save_every"),
    ("ppo.seed", "train.seed"),
    ("ppo.activation_checkpointing", "train.activation_checkpointing"),
    ("ppo.tensorboard", "train.tensorboard"),
];

impl PpoConfig {
    /// `[train]` of the default run: 24 steps at a constant 3e-4, evaluations and checkpoints
    /// every 6.
    pub fn default_train() -> TrainSection {
        TrainSection {
            max_steps: 24,
            lr: 3e-4,
            eval_every: 6,
            save_every: 6,
            seed: 0,
            ..TrainSection::default()
        }
    }

    /// Steps of the run over `prompts` training prompts: `train.max_steps`, or `train.epochs`
    /// passes over them, `ppo.rollout_prompts` a step.
    pub fn total_steps(&self, prompts: usize) -> usize {
        self.train.sampling_steps(prompts, self.ppo.rollout_prompts)
    }

    /// Refuses what PPO cannot run with, naming the key: [`PpoSection::check`], `[train]`'s
    /// ranges, and `[train]` keys PPO has no use for.
    pub fn check(&self) -> Result<(), aligner_core::CoreError> {
        self.ppo.check()?;
        self.train.check()?;
        self.train.check_unused(
            "train",
            &Self::default_train(),
            "ppo",
            &[
                (
                    "batch_size",
                    "a step samples ppo.rollout_prompts prompts and updates in ppo.mini_batch sequences",
                ),
                ("grad_accum", "each update is one ppo.mini_batch"),
                (
                    "eval_examples",
                    "held-out prompts per evaluation are ppo.eval_prompts",
                ),
            ],
        )
    }
}
