//! # aligner-ppo
//!
//! RLHF with PPO, as NeMo-Aligner runs it: an actor (the policy, trained from an SFT model), a
//! reference (the frozen start policy, or the LoRA base with adapters off), a critic (a value
//! head started from the reward model, trained) and a reward model (frozen). The critic and the
//! reward model answer the actor asynchronously — on a thread of the same process by default,
//! or from `aligner serve critic` over gRPC — so their work overlaps the actor's.
//!
//! The arithmetic is in pure functions: [`advantages`] (KL estimators, per-token rewards, GAE,
//! whitening, the GRPO family's advantages: GRPO, RLOO, Dr. GRPO, REINFORCE++, DAPO's dynamic
//! sampling filter and overlong shaping) and [`losses`] (the clipped policy and value losses,
//! decoupled clip ranges, GSPO's sequence ratio, the loss aggregations). Rewards are
//! [`Reward`]s: a reward model, an external command, an HTTP endpoint, rules, weighted sums. [`runner::PpoRunner`] is the loop; [`critic`] holds the critic's roles;
//! [`rejection`] is best-of-n rejection sampling on the same roles. [`train()`] and
//! [`rejection_sampling`] are the whole runs (what `aligner ppo` and `aligner rs` call):
//!
//! ```no_run
//! use aligner_core::run::RunDir;
//! let summary = aligner_ppo::train(&Default::default(), &RunDir::new("runs/ppo"), &aligner_core::Device::flex()).unwrap();
//! println!("held-out reward {:?} -> {:?}", summary.initial_eval_reward, summary.final_eval_reward);
//! ```

pub mod advantages;
pub mod config;
pub mod critic;
mod error;
pub mod losses;
pub mod rejection;
pub mod rollout;
pub mod runner;
mod sampler;
pub mod server;
mod timing;
pub mod train;

/// Rewards as functions (the `Reward` trait and its implementations) live in aligner-gen, beside
/// the engine, so every online method (PPO, rejection sampling, online DPO, self-rewarding)
/// shares them; re-exported here for PPO's users.
pub use aligner_gen::reward::{
    CommandReward, FunctionReward, HttpReward, ModelReward, Reward, RewardError, RewardInput, RewardSpec,
    RewardSpecs, Rewards, RuleReward,
};
pub use config::{MOVED_KEYS, NonEos, PpoConfig, PpoSection, RewardModelSection};
pub use critic::{CriticClient, CriticSettings, CriticWorker, LocalCritic};
pub use error::{PpoError, Result};
pub use runner::{PpoRunner, PpoSummary, StepTimes};
pub use train::{rejection_sampling, train};
