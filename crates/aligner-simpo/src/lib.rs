//! # aligner-simpo
//!
//! SimPO (Meng et al., 2024) as a variant crate: `−log σ(β(π̄_c − π̄_r) − γ)` on per-token
//! averaged policy log-probs, with no reference model. It implements aligner-dpo's
//! [`PreferenceLoss`] and registers itself by name; nothing inside aligner-dpo changes.
//! Knobs: `dpo.beta` (SimPO's paper uses 2.0–2.5) and `dpo.params.gamma` (the target margin).
//!
//! Two more reference-free losses fit the same trait: `cpo` (−log σ(β(π_c − π_r)); add
//! `dpo.sft_weight` for CPO's NLL term) and `orpo`'s odds-ratio term
//! (−log σ(log odds(p̄_c) − log odds(p̄_r)), p̄ = exp of the averaged log-prob, scaled by `dpo.beta`
//! as ORPO's λ; with `dpo.sft_weight = 1` it is ORPO).

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

/// `log(p / (1 − p))` of `p = exp(avg_logp)`, stable for log-probs below 0.
fn log_odds(avg_logp: Tensor<1>) -> Tensor<1> {
    avg_logp.clone() - avg_logp.exp().neg().log1p()
}

/// CPO (`cpo`) and ORPO's odds-ratio term (`orpo`), both reference-free.
pub struct RefFree {
    pub name: &'static str,
    pub beta: f64,
}

impl PreferenceLoss for RefFree {
    fn name(&self) -> &str {
        self.name
    }

    fn uses_reference(&self) -> bool {
        false
    }

    fn loss(&self, b: &PreferenceBatch) -> Result<Tensor<1>, DpoError> {
        let z = if self.name == "orpo" {
            let avg = |lp: &Tensor<1>, n: &Tensor<1>| log_odds(lp.clone() / n.clone());
            avg(&b.policy_chosen, &b.chosen_tokens) - avg(&b.policy_rejected, &b.rejected_tokens)
        } else {
            b.policy_chosen.clone() - b.policy_rejected.clone()
        };
        let scale = if self.name == "orpo" { 1.0 } else { self.beta };
        let term = log_sigmoid(z.mul_scalar(scale)).neg();
        Ok(if self.name == "orpo" {
            term.mul_scalar(self.beta)
        } else {
            term
        })
    }
}

/// Adds `simpo`, `cpo` and `orpo` to a registry.
pub fn register(registry: &mut LossRegistry) {
    registry.register("simpo", |p: &LossParams| {
        Box::new(SimPo {
            beta: p.beta,
            gamma: p.extra.get("gamma").copied().unwrap_or(0.5),
        })
    });
    registry.register("cpo", |p| {
        Box::new(RefFree {
            name: "cpo",
            beta: p.beta,
        })
    });
    registry.register("orpo", |p| {
        Box::new(RefFree {
            name: "orpo",
            beta: p.beta,
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

        // CPO: −log σ(β(π_c − π_r)) = log(1 + e^{−2·5}); ORPO: λ·−log σ(log odds_c − log odds_r).
        let cpo: f32 = registry
            .build("cpo", &params)
            .unwrap()
            .loss(&batch)
            .unwrap()
            .into_scalar();
        assert!((cpo as f64 - (1.0 + (-10.0f64).exp()).ln()).abs() < 1e-6);
        let odds = |avg: f64| avg - (1.0 - avg.exp()).ln();
        let want = 2.0 * (1.0 + (-(odds(-1.0) - odds(-3.0))).exp()).ln();
        let orpo: f32 = registry
            .build("orpo", &params)
            .unwrap()
            .loss(&batch)
            .unwrap()
            .into_scalar();
        assert!((orpo as f64 - want).abs() < 1e-5, "{orpo} vs {want}");
    }
}
