//! # aligner-simpo
//!
//! Three reference-free preference losses as a variant crate: each implements aligner-loss's
//! [`PreferenceLoss`], parses its own `dpo.params` into a typed struct, and [`register`] adds it
//! to a [`LossRegistry`] by name; nothing inside aligner-loss or aligner-dpo changes, and this
//! crate compiles no model or engine (aligner-dpo trains with it: see `examples/simpo.rs`).
//! None needs a reference model, so no reference pass runs.
//!
//! - `simpo` ([`SimPo`], Meng et al., 2024): `−log σ(β(π̄_c − π̄_r) − γ)` on per-token averaged
//!   policy log-probs. Knobs: `dpo.beta` (SimPO's paper uses 2.0–2.5) and `dpo.params.gamma`
//!   (the target margin γ, default 0.5; [`SimPoParams`]).
//! - `cpo` ([`Cpo`]): `−log σ(β(π_c − π_r))` on summed log-probs; add `dpo.sft_weight` for CPO's
//!   NLL term. No `dpo.params`.
//! - `orpo` ([`Orpo`]): ORPO's odds-ratio term `λ·−log σ(log odds(p̄_c) − log odds(p̄_r))`,
//!   `p̄` the exp of the averaged log-prob and λ = `dpo.beta`; with `dpo.sft_weight = 1` it is
//!   ORPO. No `dpo.params`.
//!
//! A misspelt key (`dpo.params.gama`) or a key given to `cpo`/`orpo` is an error naming it.

use aligner_loss::{LossError, LossRegistry, LossSpec, NoParams, PreferenceBatch, PreferenceLoss};
use burn::tensor::Tensor;
use burn::tensor::activation::log_sigmoid;
use serde::Deserialize;

/// The SimPO loss per pair.
pub fn simpo_loss(chosen_avg: Tensor<1>, rejected_avg: Tensor<1>, beta: f64, gamma: f64) -> Tensor<1> {
    log_sigmoid((chosen_avg - rejected_avg).mul_scalar(beta).sub_scalar(gamma)).neg()
}

/// `dpo.params` of `simpo`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimPoParams {
    /// Target reward margin γ.
    pub gamma: f64,
}

impl Default for SimPoParams {
    /// γ = 0.5, within the paper's 0.3–1.6 range for its β.
    fn default() -> Self {
        Self { gamma: 0.5 }
    }
}

/// SimPO with its β and γ.
pub struct SimPo {
    pub beta: f64,
    pub gamma: f64,
}

impl SimPo {
    /// From `[dpo]`: β from `dpo.beta`, γ from `dpo.params.gamma`.
    pub fn from_spec(spec: &LossSpec<'_>) -> Result<Self, LossError> {
        let params: SimPoParams = spec.params("simpo")?;
        Ok(Self {
            beta: spec.beta,
            gamma: params.gamma,
        })
    }
}

impl PreferenceLoss for SimPo {
    fn name(&self) -> &str {
        "simpo"
    }

    fn beta(&self) -> f64 {
        self.beta
    }

    fn uses_reference(&self) -> bool {
        false
    }

    fn loss(&self, b: &PreferenceBatch) -> Result<Tensor<1>, LossError> {
        let chosen = b.policy_chosen.clone() / b.chosen_tokens.clone();
        let rejected = b.policy_rejected.clone() / b.rejected_tokens.clone();
        Ok(simpo_loss(chosen, rejected, self.beta, self.gamma))
    }
}

/// CPO's preference term: `−log σ(β(π_c − π_r))` on summed policy log-probs.
pub struct Cpo {
    pub beta: f64,
}

impl Cpo {
    /// From `[dpo]`: β from `dpo.beta`; it takes no `dpo.params`.
    pub fn from_spec(spec: &LossSpec<'_>) -> Result<Self, LossError> {
        spec.params::<NoParams>("cpo")?;
        Ok(Self { beta: spec.beta })
    }
}

impl PreferenceLoss for Cpo {
    fn name(&self) -> &str {
        "cpo"
    }

    fn beta(&self) -> f64 {
        self.beta
    }

    fn uses_reference(&self) -> bool {
        false
    }

    fn loss(&self, b: &PreferenceBatch) -> Result<Tensor<1>, LossError> {
        let z = b.policy_chosen.clone() - b.policy_rejected.clone();
        Ok(log_sigmoid(z.mul_scalar(self.beta)).neg())
    }
}

/// `log(p / (1 − p))` of `p = exp(avg_logp)`, stable for log-probs below 0.
fn log_odds(avg_logp: Tensor<1>) -> Tensor<1> {
    avg_logp.clone() - avg_logp.exp().neg().log1p()
}

/// ORPO's odds-ratio term, scaled by λ (`beta`, from `dpo.beta`).
pub struct Orpo {
    pub beta: f64,
}

impl Orpo {
    /// From `[dpo]`: λ from `dpo.beta`; it takes no `dpo.params`.
    pub fn from_spec(spec: &LossSpec<'_>) -> Result<Self, LossError> {
        spec.params::<NoParams>("orpo")?;
        Ok(Self { beta: spec.beta })
    }
}

impl PreferenceLoss for Orpo {
    fn name(&self) -> &str {
        "orpo"
    }

    fn beta(&self) -> f64 {
        self.beta
    }

    fn uses_reference(&self) -> bool {
        false
    }

    fn loss(&self, b: &PreferenceBatch) -> Result<Tensor<1>, LossError> {
        let avg = |lp: &Tensor<1>, n: &Tensor<1>| log_odds(lp.clone() / n.clone());
        let z = avg(&b.policy_chosen, &b.chosen_tokens) - avg(&b.policy_rejected, &b.rejected_tokens);
        Ok(log_sigmoid(z).neg().mul_scalar(self.beta))
    }
}

/// Adds `simpo`, `cpo` and `orpo` to a registry.
pub fn register(registry: &mut LossRegistry) {
    registry.register("simpo", |spec| Ok(Box::new(SimPo::from_spec(spec)?)));
    registry.register("cpo", |spec| Ok(Box::new(Cpo::from_spec(spec)?)));
    registry.register("orpo", |spec| Ok(Box::new(Orpo::from_spec(spec)?)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn registry() -> LossRegistry {
        let mut registry = LossRegistry::with_builtin();
        register(&mut registry);
        registry
    }

    fn table(text: &str) -> toml::Table {
        text.parse().expect("test TOML parses")
    }

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
        let registry = registry();
        let params = table("gamma = 1.0");
        let spec = LossSpec {
            params: &params,
            ..LossSpec::with_beta(2.0)
        };
        let loss = registry.build("simpo", &spec).unwrap();
        assert!(!loss.uses_reference());
        assert_eq!(loss.beta(), 2.0);
        let value = loss.loss(&batch).unwrap();
        // π̄_c = −1, π̄_r = −3: β·2 − γ = 3 → log(1 + e^−3).
        let got: f32 = value.clone().into_scalar();
        assert!((got as f64 - (1.0 + (-3.0f64).exp()).ln()).abs() < 1e-6);
        let grads = value.sum().backward();
        let gc: f32 = batch.policy_chosen.grad(&grads).unwrap().into_scalar();
        let gr: f32 = batch.policy_rejected.grad(&grads).unwrap().into_scalar();
        assert!(gc < 0.0 && gr > 0.0);

        // CPO: −log σ(β(π_c − π_r)) = log(1 + e^{−2·5}); ORPO: λ·−log σ(log odds_c − log odds_r).
        let plain = LossSpec::with_beta(2.0);
        let cpo = registry.build("cpo", &plain).unwrap();
        assert!(!cpo.uses_reference());
        assert_eq!(cpo.beta(), 2.0);
        let cpo: f32 = cpo.loss(&batch).unwrap().into_scalar();
        assert!((cpo as f64 - (1.0 + (-10.0f64).exp()).ln()).abs() < 1e-6);
        let odds = |avg: f64| avg - (1.0 - avg.exp()).ln();
        let want = 2.0 * (1.0 + (-(odds(-1.0) - odds(-3.0))).exp()).ln();
        let orpo = registry.build("orpo", &plain).unwrap();
        assert!(!orpo.uses_reference());
        assert_eq!(orpo.beta(), 2.0);
        let orpo: f32 = orpo.loss(&batch).unwrap().into_scalar();
        assert!((orpo as f64 - want).abs() < 1e-5, "{orpo} vs {want}");
    }

    #[test]
    fn simpo_reads_gamma_and_rejects_a_misspelt_key() {
        let build = |text: &str| {
            let params = table(text);
            SimPo::from_spec(&LossSpec {
                params: &params,
                ..LossSpec::with_beta(2.0)
            })
        };
        assert_eq!(build("").unwrap().gamma, 0.5);
        assert_eq!(build("gamma = 1.0").unwrap().gamma, 1.0);
        // An integer from the command line (`dpo.params.gamma=1`) is still a float γ.
        assert_eq!(build("gamma = 1").unwrap().gamma, 1.0);
        let err = build("gama = 1.0").err().unwrap().to_string();
        assert!(
            err.contains("dpo.params.gama") && err.contains("\"simpo\"") && err.contains("`gamma`"),
            "{err}"
        );
        let err = build("gamma = \"big\"").err().unwrap().to_string();
        assert!(err.contains("dpo.params.gamma"), "{err}");
    }

    #[test]
    fn cpo_and_orpo_take_no_params() {
        let registry = registry();
        let params = table("gamma = 1.0");
        let spec = LossSpec {
            params: &params,
            ..LossSpec::default()
        };
        for name in ["cpo", "orpo"] {
            let err = registry.build(name, &spec).err().unwrap().to_string();
            assert!(
                err.contains("dpo.params.gamma") && err.contains(&format!("{name:?}")),
                "{name}: {err}"
            );
        }
    }
}
