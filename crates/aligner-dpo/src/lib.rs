//! # aligner-dpo
//!
//! Direct preference optimisation and its family as pure functions on per-sequence
//! log-probabilities, behind one trait ([`PreferenceLoss`]) and a registry by name
//! ([`LossRegistry`]).
//!
//! Every loss sees a [`PreferenceBatch`]: the policy's and the reference's summed response
//! log-probs for the chosen and rejected sides, the response lengths (so length-normalised
//! losses can average), and optional ground-truth rewards (reward-aware losses).
//!
//! ## Adding a variant as a new crate
//! 1. Depend on `aligner-dpo`; write a struct implementing [`PreferenceLoss`] (its `loss`
//!    returns the per-pair loss from a [`PreferenceBatch`]; set `uses_reference` to `false` for
//!    reference-free losses so no reference pass runs).
//! 2. Expose `pub fn register(registry: &mut LossRegistry)` that calls
//!    `registry.register("name", |params| Box::new(MyLoss { .. }))`.
//! 3. In `aligner-cli`, add the crate behind a cargo feature and call its `register` where the
//!    registry is built. Nothing inside `aligner-dpo` changes.

mod losses;
pub mod objective;
mod registry;

pub use losses::{
    hinge_loss, implicit_rewards, ipo_loss, robust_loss, rpo_bwd_kl_loss, rpo_fwd_kl_loss, rpo_sq_loss,
    sigmoid_loss,
};
pub use registry::{LossParams, LossRegistry};

use burn::tensor::Tensor;

/// What went wrong choosing or applying a loss.
#[derive(Debug, thiserror::Error)]
pub enum DpoError {
    #[error("unknown preference loss {name:?}; known: {known}")]
    UnknownLoss { name: String, known: String },
    #[error("loss {0:?} needs chosen_reward and rejected_reward in the data")]
    NeedsRewards(String),
    #[error("{0}")]
    Invalid(String),
}

/// Per-pair inputs of a preference loss, each `[pairs]`.
#[derive(Debug, Clone)]
pub struct PreferenceBatch {
    /// Σ log π(chosen | prompt) over response tokens.
    pub policy_chosen: Tensor<1>,
    pub policy_rejected: Tensor<1>,
    /// The same under the frozen reference (no gradient).
    pub reference_chosen: Tensor<1>,
    pub reference_rejected: Tensor<1>,
    /// Response token counts (as floats), for length-normalised losses.
    pub chosen_tokens: Tensor<1>,
    pub rejected_tokens: Tensor<1>,
    /// Ground-truth rewards when the data carries them.
    pub chosen_reward: Option<Tensor<1>>,
    pub rejected_reward: Option<Tensor<1>>,
}

impl PreferenceBatch {
    /// `Δ = (π_c − r_c) − (π_r − r_r)`, on summed or per-token-averaged log-probs.
    pub fn logratio_margin(&self, averaged: bool) -> Tensor<1> {
        let (c, r) = self.logratios(averaged);
        c - r
    }

    /// `(π_c − r_c, π_r − r_r)`, summed or per-token-averaged.
    pub fn logratios(&self, averaged: bool) -> (Tensor<1>, Tensor<1>) {
        let c = self.policy_chosen.clone() - self.reference_chosen.clone();
        let r = self.policy_rejected.clone() - self.reference_rejected.clone();
        if averaged {
            (c / self.chosen_tokens.clone(), r / self.rejected_tokens.clone())
        } else {
            (c, r)
        }
    }

    /// `gt_scale · (reward_c − reward_r)`, for the reward-aware losses.
    pub fn reward_margin(&self, gt_scale: f64, loss: &str) -> Result<Tensor<1>, DpoError> {
        match (&self.chosen_reward, &self.rejected_reward) {
            (Some(c), Some(r)) => Ok((c.clone() - r.clone()).mul_scalar(gt_scale)),
            _ => Err(DpoError::NeedsRewards(loss.to_string())),
        }
    }
}

/// A preference loss: per-pair loss values from a batch.
pub trait PreferenceLoss: Send + Sync {
    /// The registry name.
    fn name(&self) -> &str;
    /// Whether reference log-probs are needed (false for reference-free losses such as SimPO).
    fn uses_reference(&self) -> bool {
        true
    }
    /// Loss per pair, `[pairs]`; the trainer averages it.
    fn loss(&self, batch: &PreferenceBatch) -> Result<Tensor<1>, DpoError>;
}
