//! # aligner-dpo
//!
//! Direct preference optimisation: the DPO objective on the shared trainer and
//! [`train()`], and online DPO on the engine and any reward ([`online::train`]). The losses —
//! one trait ([`PreferenceLoss`]), a registry by name ([`LossRegistry`]) and the DPO family as
//! pure functions on per-sequence log-probabilities — live in `aligner-loss` and are
//! re-exported here; a new variant is a crate of its own on `aligner-loss` (see its docs).
//!
//! Every loss sees a [`PreferenceBatch`]: the policy's and the reference's summed response
//! log-probs for the chosen and rejected sides, the response lengths (so length-normalised
//! losses can average), and optional ground-truth rewards (reward-aware losses).
//!
//! Each loss is built from a [`LossSpec`]: `[dpo]`'s shared knobs (β, label smoothing, reward
//! scale, averaging) and the `dpo.params` table, which the loss parses into its own typed struct,
//! so a misspelt key (`dpo.params.gama`) is an error rather than a silent default. The built-ins
//! take no `dpo.params`. A built loss reports its β ([`PreferenceLoss::beta`]), which the
//! objective's implicit-reward metrics use, so β is read from one place.
//!
//! ## A whole run
//! [`train()`] is `aligner dpo` as a library call: the typed configuration, the registry of
//! losses, a run folder and a device in, the run's summary out. A downstream crate trains DPO on
//! the shipped model and data with:
//!
//! ```no_run
//! use aligner_dpo::{Device, LossRegistry, RunDir, objective::DpoConfig};
//!
//! let config = DpoConfig::default(); // or aligner_core::train::load_config(...) from TOML
//! let summary = aligner_dpo::train(&config, &LossRegistry::with_builtin(), &RunDir::new("runs/dpo"), &Device::flex())?;
//! println!("{} steps; validation {:?}", summary.steps, summary.final_eval);
//! # Ok::<(), aligner_dpo::DpoError>(())
//! ```

pub mod objective;
pub mod online;
pub mod train;

pub use aligner_core::{Device, run::RunDir};
pub use aligner_loss::{
    LossConstructor, LossError, LossRegistry, LossSpec, NoParams, PreferenceBatch, PreferenceLoss,
    hinge_loss, implicit_rewards, ipo_loss, robust_loss, rpo_bwd_kl_loss, rpo_fwd_kl_loss, rpo_sq_loss,
    sigmoid_loss,
};
pub use train::train;

/// What went wrong in a DPO run: its loss, its data, its model or its rewards.
#[derive(Debug, thiserror::Error)]
pub enum DpoError {
    #[error(transparent)]
    Loss(#[from] LossError),
    #[error(transparent)]
    Core(#[from] aligner_core::CoreError),
    #[error(transparent)]
    Gen(#[from] aligner_gen::GenError),
    #[error(transparent)]
    Reward(#[from] aligner_gen::RewardError),
    #[error("{0}")]
    Invalid(String),
}
