//! `aligner ppo` configuration: `[model]` (the actor, from an SFT model; LoRA), `[reward_model]`,
//! `[data]` (prompt files) and `[ppo]`.

use std::path::PathBuf;

use aligner_core::train::{DataSection, ModelSection};
use serde::{Deserialize, Serialize};

use crate::advantages::{Advantage, KlEstimator};

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

/// `[ppo]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoSection {
    /// Rollout-and-update steps.
    pub steps: usize,
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
    pub clip_eps: f64,
    pub value_clip_eps: f64,
    /// Weight of the entropy bonus (0 = off); computed exactly from the response positions'
    /// full distributions.
    pub entropy_coef: f64,
    pub actor_lr: f64,
    pub critic_lr: f64,
    pub max_grad_norm: f64,
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
    pub eval_every: usize,
    /// Held-out prompts scored at each evaluation (0 = all).
    pub eval_prompts: usize,
    pub save_every: usize,
    pub seed: u64,
    /// Recompute the actor's activations in its backward pass instead of keeping them (as
    /// `train.activation_checkpointing` does for the trainer's methods): less memory for the
    /// actor's update, more time.
    pub activation_checkpointing: bool,
    /// Keep the frozen reference in host memory and score it on the CPU backend, leaving the
    /// accelerator's memory to the actor (NeMo-Aligner offloads its reference the same way;
    /// the rollout's reference log-probs are then computed on the CPU).
    pub offload_reference: bool,
    /// Write TensorBoard event files to `<run>/tb/` (every scalar of metrics.jsonl, the
    /// timing breakdown included).
    pub tensorboard: bool,
}

impl PpoSection {
    /// The autodiff device the actor trains on (with gradient checkpointing when asked).
    pub fn actor_device(&self, device: &aligner_core::Device) -> aligner_core::Device {
        let train = device.clone().autodiff();
        if self.activation_checkpointing {
            train.gradient_checkpointing()
        } else {
            train
        }
    }
}

impl PpoSection {
    /// Refuses settings PPO cannot run with, naming the key.
    pub fn check(&self) -> Result<(), aligner_core::CoreError> {
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
            ("ppo.actor_lr", self.actor_lr, Positive),
            ("ppo.critic_lr", self.critic_lr, Positive),
            ("ppo.max_grad_norm", self.max_grad_norm, NonNegative),
            ("ppo.critic_retry_seconds", self.critic_retry_seconds, NonNegative),
        ])?;
        aligner_core::train::check_counts(&[
            ("ppo.steps", self.steps),
            ("ppo.rollout_prompts", self.rollout_prompts),
            ("ppo.samples_per_prompt", self.samples_per_prompt),
            ("ppo.max_new_tokens", self.max_new_tokens),
            ("ppo.epochs", self.epochs),
            ("ppo.mini_batch", self.mini_batch),
        ])
    }
}

impl Default for PpoSection {
    fn default() -> Self {
        Self {
            steps: 24,
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
            value_clip_eps: 0.2,
            entropy_coef: 0.0,
            actor_lr: 3e-4,
            critic_lr: 3e-4,
            max_grad_norm: 1.0,
            non_eos: NonEos::Keep,
            non_eos_penalty: -1.0,
            critic_url: None,
            combine_rm_and_critic: true,
            critic_retry_seconds: 30.0,
            activation_checkpointing: false,
            offload_reference: false,
            tensorboard: true,
            slots: 64,
            workers: 1,
            eval_every: 6,
            eval_prompts: 64,
            save_every: 6,
            seed: 0,
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
    pub ppo: PpoSection,
    /// The reward–KL figures of the actor's own samples, at every validation.
    pub frontier: aligner_gen::FrontierSection,
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            model: ModelSection::default(),
            reward_model: RewardModelSection::default(),
            data: DataSection::shipped("train.prompts.jsonl", "test.prompts.jsonl"),
            ppo: PpoSection::default(),
            frontier: aligner_gen::FrontierSection::shipped(),
        }
    }
}
