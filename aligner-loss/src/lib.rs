//! # aligner-loss
//!
//! Preference losses as pure functions on per-sequence log-probabilities, behind one trait
//! ([`PreferenceLoss`]) and a registry by name ([`LossRegistry`]): the DPO family built in
//! (sigmoid, hinge, IPO, conservative/robust DPO, RPO's three forms, BCO-style reward-aware
//! losses), and any variant a crate of its own registers. It depends on Burn's tensors alone,
//! so a variant crate (like `aligner-simpo`) compiles no model, engine or trainer;
//! `aligner-dpo` trains with whatever the registry holds and re-exports all of this.
//!
//! [`policy`] holds the policy-gradient side: PPO's clipped objective with the GRPO family's
//! variations (decoupled clip ranges, sequence-level ratios, the loss aggregations), the clipped
//! value loss and the entropy, on `[batch, tokens]` log-probs. `aligner-ppo` trains with them and
//! `aligner-distill`'s on-policy mode minimises the reverse KL to its teacher through them.
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
//! ## Adding a variant as a new crate
//! A variant lives in its own top-level crate (like `aligner-simpo/`); nothing inside
//! `aligner-loss` or `aligner-dpo` changes. The files it touches:
//!
//! 1. `aligner-mine/Cargo.toml`: depend on `aligner-loss`, `burn` and `serde`, all
//!    `.workspace = true`.
//! 2. `aligner-mine/src/lib.rs`: a loss struct implementing [`PreferenceLoss`] (`loss` returns the
//!    per-pair loss of a [`PreferenceBatch`]; `beta` the β it was built with; `uses_reference`
//!    `false` for reference-free losses, so no reference pass runs), a typed params struct with
//!    `#[serde(deny_unknown_fields, default)]` for its `dpo.params` keys ([`NoParams`] if it takes
//!    none), and `pub fn register(registry: &mut LossRegistry)`:
//!
//!    ```
//!    use aligner_loss::{LossError, LossRegistry, LossSpec, PreferenceBatch, PreferenceLoss};
//!    use burn::tensor::Tensor;
//!    use burn::tensor::activation::log_sigmoid;
//!    use serde::Deserialize;
//!
//!    /// `dpo.params` of `margin_dpo`.
//!    #[derive(Deserialize)]
//!    #[serde(deny_unknown_fields, default)]
//!    pub struct MarginParams {
//!        /// Target margin subtracted from βΔ.
//!        pub margin: f64,
//!    }
//!
//!    impl Default for MarginParams {
//!        fn default() -> Self {
//!            Self { margin: 0.0 }
//!        }
//!    }
//!
//!    /// DPO with a target margin: `−log σ(βΔ − m)`.
//!    pub struct MarginDpo {
//!        pub beta: f64,
//!        pub margin: f64,
//!    }
//!
//!    impl PreferenceLoss for MarginDpo {
//!        fn name(&self) -> &str {
//!            "margin_dpo"
//!        }
//!        fn beta(&self) -> f64 {
//!            self.beta
//!        }
//!        fn loss(&self, b: &PreferenceBatch) -> Result<Tensor<1>, LossError> {
//!            let z = b.logratio_margin(false).mul_scalar(self.beta).sub_scalar(self.margin);
//!            Ok(log_sigmoid(z).neg())
//!        }
//!    }
//!
//!    /// Adds `margin_dpo` to a registry.
//!    pub fn register(registry: &mut LossRegistry) {
//!        registry.register("margin_dpo", |spec| {
//!            let params: MarginParams = spec.params("margin_dpo")?;
//!            Ok(Box::new(MarginDpo { beta: spec.beta, margin: params.margin }))
//!        });
//!    }
//!    # let mut registry = LossRegistry::with_builtin();
//!    # register(&mut registry);
//!    # let params: toml::Table = "margin = 1.0".parse().unwrap();
//!    # let spec = LossSpec { params: &params, ..LossSpec::with_beta(0.2) };
//!    # assert_eq!(registry.build("margin_dpo", &spec).unwrap().beta(), 0.2);
//!    # let typo: toml::Table = "margn = 1.0".parse().unwrap();
//!    # let spec = LossSpec { params: &typo, ..LossSpec::default() };
//!    # let err = registry.build("margin_dpo", &spec).err().unwrap().to_string();
//!    # assert!(err.contains("dpo.params.margn"), "{err}");
//!    ```
//! 3. The workspace root `Cargo.toml`: add `"aligner-mine"` to `members` and
//!    `aligner-mine = { path = "aligner-mine", version = "0.1.0" }` to `[workspace.dependencies]`.
//! 4. `aligner-cli/Cargo.toml`: `aligner-mine = { workspace = true, optional = true }` under
//!    `[dependencies]` and a feature `mine = ["dep:aligner-mine"]` (in `default` if it ships on).
//! 5. `aligner-cli/src/registry.rs`: one line, `#[cfg(feature = "mine")]
//!    aligner_mine::register(&mut registry);`, in the function that builds the registry every
//!    command uses.
//!
//! Then `dpo.loss = "margin_dpo"` with `dpo.params.margin = 1.0` trains with it.

mod losses;
pub mod policy;
mod registry;

pub use losses::{
    hinge_loss, implicit_rewards, ipo_loss, robust_loss, rpo_bwd_kl_loss, rpo_fwd_kl_loss, rpo_sq_loss,
    sigmoid_loss,
};
pub use registry::{LossConstructor, LossRegistry, LossSpec, NoParams};

use burn::tensor::Tensor;

/// What went wrong choosing or applying a loss.
#[derive(Debug, thiserror::Error)]
pub enum LossError {
    #[error("unknown preference loss {name:?}; known: {known}")]
    UnknownLoss { name: String, known: String },
    #[error("loss {0:?} needs chosen_reward and rejected_reward in the data")]
    NeedsRewards(String),
    /// `dpo.params` the loss does not take or of the wrong type; `field` is `dpo.params.<key>`
    /// (or `dpo.params` when no one key is to blame).
    #[error("{field} for loss {loss:?}: {message}")]
    BadParams {
        loss: String,
        field: String,
        message: String,
    },
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
    pub fn reward_margin(&self, gt_scale: f64, loss: &str) -> Result<Tensor<1>, LossError> {
        match (&self.chosen_reward, &self.rejected_reward) {
            (Some(c), Some(r)) => Ok((c.clone() - r.clone()).mul_scalar(gt_scale)),
            _ => Err(LossError::NeedsRewards(loss.to_string())),
        }
    }
}

/// A preference loss: per-pair loss values from a batch.
pub trait PreferenceLoss: Send + Sync {
    /// The registry name.
    fn name(&self) -> &str;
    /// The β it was built with; the objective's implicit rewards `β·(π − r)` read it from here.
    fn beta(&self) -> f64;
    /// Whether reference log-probs are needed (false for reference-free losses such as SimPO).
    fn uses_reference(&self) -> bool {
        true
    }
    /// Loss per pair, `[pairs]`; the trainer averages it.
    fn loss(&self, batch: &PreferenceBatch) -> Result<Tensor<1>, LossError>;
}
