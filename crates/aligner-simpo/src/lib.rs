//! # aligner-simpo
//!
//! SimPO (Meng et al., 2024) as a variant crate: `−log σ(β(π̄_c − π̄_r) − γ)` on per-token
//! averaged policy log-probs, with no reference model. It implements aligner-dpo's
//! [`PreferenceLoss`] and registers itself by name; nothing inside aligner-dpo changes.
//! Knobs: `dpo.beta` (SimPO's paper uses 2.0–2.5) and `dpo.params.gamma` (the target margin).

use aligner_dpo::{DpoError, LossParams, LossRegistry, PreferenceBatch, PreferenceLoss};
use burn::tensor::Tensor;
use burn::tensor::activation::log_sigmoid;

/// The SimPO loss per pair.
pub fn simpo_loss(chosen_avg: Tensor<1>, rejected_avg: Tensor<1>, beta: f64, gamma: f64) -> Tensor<1> {
    log_sigmoid((chosen_avg - rejected_avg).mul_scalar(beta).sub_scalar(gamma)).neg()
}

/// SimPO with its β and γ.
pub struct SimPo {
    pub beta: f64,
    pub gamma: f64,
}

impl PreferenceLoss for SimPo {
    fn name(&self) -> &str {
        "simpo"
    }

    fn uses_reference(&self) -> bool {
        false
    }

    fn loss(&self, b: &PreferenceBatch) -> Result<Tensor<1>, DpoError> {
        let chosen = b.policy_chosen.clone() / b.chosen_tokens.clone();
        let rejected = b.policy_rejected.clone() / b.rejected_tokens.clone();
        Ok(simpo_loss(chosen, rejected, self.beta, self.gamma))
    }
}

/// Adds `simpo` to a registry.
pub fn register(registry: &mut LossRegistry) {
    registry.register("simpo", |p: &LossParams| {
        Box::new(SimPo {
            beta: p.beta,
            gamma: p.extra.get("gamma").copied().unwrap_or(0.5),
        })
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    #[test]
    fn simpo_matches_hand_values_and_ignores_the_reference() {
        let device = Device::flex().autodiff();
        let t = |v: f32| Tensor::<1>::from_floats([v], &device);
        let batch = PreferenceBatch {
            policy_chosen: t(-4.0).require_grad(),
            policy_rejected: t(-9.0).require_grad(),
            reference_chosen: t(123.0),
            reference_rejected: t(-77.0),
            chosen_tokens: t(4.0),
            rejected_tokens: t(3.0),
            chosen_reward: None,
            rejected_reward: None,
        };
        let mut registry = LossRegistry::with_builtin();
        register(&mut registry);
        let mut params = LossParams {
            beta: 2.0,
            ..LossParams::default()
        };
        params.extra.insert("gamma".into(), 1.0);
        let loss = registry.build("simpo", &params).unwrap();
        assert!(!loss.uses_reference());
        let value = loss.loss(&batch).unwrap();
        // π̄_c = −1, π̄_r = −3: β·2 − γ = 3 → log(1 + e^−3).
        let got: f32 = value.clone().into_scalar();
        assert!((got as f64 - (1.0 + (-3.0f64).exp()).ln()).abs() < 1e-6);
        let grads = value.sum().backward();
        let gc: f32 = batch.policy_chosen.grad(&grads).unwrap().into_scalar();
        let gr: f32 = batch.policy_rejected.grad(&grads).unwrap().into_scalar();
        assert!(gc < 0.0 && gr > 0.0);
    }
}
