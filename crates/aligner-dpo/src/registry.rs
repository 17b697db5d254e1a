//! Preference losses by name: the built-in family, and variants registered by other crates.

use std::collections::BTreeMap;

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::losses::{
    hinge_loss, ipo_loss, robust_loss, rpo_bwd_kl_loss, rpo_fwd_kl_loss, rpo_sq_loss, sigmoid_loss,
};
use crate::{DpoError, PreferenceBatch, PreferenceLoss};

/// The `[dpo]` knobs a loss may read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossParams {
    /// KL strength β.
    pub beta: f64,
    /// Conservative DPO ε (`dpo`), label-noise rate (`robust`).
    pub label_smoothing: f64,
    /// Scale of ground-truth reward margins (`rpo_*`).
    pub gt_reward_scale: f64,
    /// Use per-token-averaged log-probs in the margin (IPO always does).
    pub average_log_probs: bool,
    /// Knobs of losses registered by other crates (`dpo.params.gamma = 0.5`, ...).
    pub extra: BTreeMap<String, f64>,
}

impl Default for LossParams {
    fn default() -> Self {
        Self {
            beta: 0.1,
            label_smoothing: 0.0,
            gt_reward_scale: 1.0,
            average_log_probs: false,
            extra: BTreeMap::new(),
        }
    }
}

/// Builds a loss from the parameters.
pub type LossConstructor = fn(&LossParams) -> Box<dyn PreferenceLoss>;

/// Loss constructors by name.
pub struct LossRegistry {
    entries: BTreeMap<String, LossConstructor>,
}

/// A built-in loss: its name and the function of the batch it computes.
struct Builtin {
    name: &'static str,
    params: LossParams,
    compute: fn(&PreferenceBatch, &LossParams, &str) -> Result<Tensor<1>, DpoError>,
}

impl PreferenceLoss for Builtin {
    fn name(&self) -> &str {
        self.name
    }

    fn loss(&self, batch: &PreferenceBatch) -> Result<Tensor<1>, DpoError> {
        (self.compute)(batch, &self.params, self.name)
    }
}

macro_rules! builtin {
    ($name:literal, $compute:expr) => {
        (
            $name,
            (|params: &LossParams| {
                Box::new(Builtin {
                    name: $name,
                    params: params.clone(),
                    compute: $compute,
                }) as Box<dyn PreferenceLoss>
            }) as LossConstructor,
        )
    };
}

impl Default for LossRegistry {
    fn default() -> Self {
        Self::with_builtin()
    }
}

impl LossRegistry {
    /// An empty registry.
    pub fn empty() -> Self {
        Self {
            entries: BTreeMap::new(),
        }
    }

    /// `dpo`, `ipo`, `hinge`, `robust`, `rpo_sq`, `rpo_bwd_kl`, `rpo_fwd_kl`.
    pub fn with_builtin() -> Self {
        let mut registry = Self::empty();
        let builtins: [(&str, LossConstructor); 7] = [
            builtin!("dpo", |b, p, _| Ok(sigmoid_loss(
                b.logratio_margin(p.average_log_probs),
                p.beta,
                p.label_smoothing
            ))),
            builtin!("ipo", |b, p, _| Ok(ipo_loss(b.logratio_margin(true), p.beta))),
            builtin!("hinge", |b, p, _| Ok(hinge_loss(
                b.logratio_margin(p.average_log_probs),
                p.beta
            ))),
            builtin!("robust", |b, p, _| {
                if !(0.0..0.5).contains(&p.label_smoothing) {
                    return Err(DpoError::Invalid(
                        "robust needs 0 <= dpo.label_smoothing < 0.5".into(),
                    ));
                }
                Ok(robust_loss(
                    b.logratio_margin(p.average_log_probs),
                    p.beta,
                    p.label_smoothing,
                ))
            }),
            builtin!("rpo_sq", |b, p, n| Ok(rpo_sq_loss(
                b.logratio_margin(p.average_log_probs),
                p.beta,
                b.reward_margin(p.gt_reward_scale, n)?
            ))),
            builtin!("rpo_bwd_kl", |b, p, n| Ok(rpo_bwd_kl_loss(
                b.logratio_margin(p.average_log_probs),
                p.beta,
                b.reward_margin(p.gt_reward_scale, n)?
            ))),
            builtin!("rpo_fwd_kl", |b, p, n| Ok(rpo_fwd_kl_loss(
                b.logratio_margin(p.average_log_probs),
                p.beta,
                b.reward_margin(p.gt_reward_scale, n)?
            ))),
        ];
        for (name, constructor) in builtins {
            registry.register(name, constructor);
        }
        registry
    }

    /// Adds (or replaces) a loss under `name`.
    pub fn register(&mut self, name: &str, constructor: LossConstructor) {
        self.entries.insert(name.to_string(), constructor);
    }

    /// The registered names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// The loss called `name`, built with `params`.
    pub fn build(&self, name: &str, params: &LossParams) -> Result<Box<dyn PreferenceLoss>, DpoError> {
        let constructor = self.entries.get(name).ok_or_else(|| DpoError::UnknownLoss {
            name: name.to_string(),
            known: self.names().join(", "),
        })?;
        Ok(constructor(params))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::implicit_rewards;
    use burn::tensor::Device;

    fn batch(device: &Device, pc: f32, pr: f32, rc: f32, rr: f32) -> PreferenceBatch {
        let t = |v: f32| Tensor::<1>::from_floats([v], device);
        // Policy log-probs are leaves whose gradients the tests read (on autodiff devices).
        let leaf = |v: f32| {
            if device.is_autodiff() {
                t(v).require_grad()
            } else {
                t(v)
            }
        };
        PreferenceBatch {
            policy_chosen: leaf(pc),
            policy_rejected: leaf(pr),
            reference_chosen: t(rc),
            reference_rejected: t(rr),
            chosen_tokens: t(4.0),
            rejected_tokens: t(2.0),
            chosen_reward: Some(t(3.0)),
            rejected_reward: Some(t(1.0)),
        }
    }

    #[test]
    fn dpo_is_log_two_with_zero_rewards_when_policy_equals_reference() {
        let device = Device::flex();
        let b = batch(&device, -12.0, -7.0, -12.0, -7.0);
        let loss: f32 = LossRegistry::with_builtin()
            .build("dpo", &LossParams::default())
            .unwrap()
            .loss(&b)
            .unwrap()
            .into_scalar();
        assert!((loss as f64 - 2f64.ln()).abs() < 1e-6);
        let reward: f32 =
            implicit_rewards(b.policy_chosen.clone(), b.reference_chosen.clone(), 0.1).into_scalar();
        assert_eq!(reward, 0.0);
    }

    #[test]
    fn every_builtin_raises_chosen_and_lowers_rejected() {
        let device = Device::flex().autodiff();
        let registry = LossRegistry::with_builtin();
        let params = LossParams {
            label_smoothing: 0.1,
            ..LossParams::default()
        };
        for name in registry.names() {
            let b = batch(&device, -10.0, -8.0, -10.0, -8.0);
            let loss = registry.build(name, &params).unwrap().loss(&b).unwrap();
            let grads = loss.sum().backward();
            let gc: f32 = b.policy_chosen.grad(&grads).unwrap().into_scalar();
            let gr: f32 = b.policy_rejected.grad(&grads).unwrap().into_scalar();
            assert!(gc < 0.0 && gr > 0.0, "{name}: d/dchosen {gc}, d/drejected {gr}");
        }
    }

    #[test]
    fn averaged_margins_divide_by_response_length() {
        let device = Device::flex();
        let b = batch(&device, -8.0, -6.0, -12.0, -8.0);
        // chosen: (−8+12)/4 = 1; rejected: (−6+8)/2 = 1 → averaged margin 0; summed margin 2.
        assert_eq!(b.logratio_margin(true).into_scalar::<f32>(), 0.0);
        assert_eq!(b.logratio_margin(false).into_scalar::<f32>(), 2.0);
        // IPO uses the averaged margin: (0 − 1/(2·0.1))² = 25.
        let ipo: f32 = LossRegistry::with_builtin()
            .build("ipo", &LossParams::default())
            .unwrap()
            .loss(&b)
            .unwrap()
            .into_scalar();
        assert!((ipo - 25.0).abs() < 1e-4);
    }

    #[test]
    fn unknown_names_and_missing_rewards_are_errors() {
        let registry = LossRegistry::with_builtin();
        let err = registry
            .build("dpoo", &LossParams::default())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("dpoo") && err.contains("ipo"), "{err}");
        let device = Device::flex();
        let mut b = batch(&device, -1.0, -1.0, -1.0, -1.0);
        b.chosen_reward = None;
        let err = registry
            .build("rpo_sq", &LossParams::default())
            .unwrap()
            .loss(&b)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("chosen_reward"), "{err}");
    }

    #[test]
    fn a_crate_can_register_its_own_variant() {
        struct Margin;
        impl PreferenceLoss for Margin {
            fn name(&self) -> &str {
                "margin"
            }
            fn uses_reference(&self) -> bool {
                false
            }
            fn loss(&self, b: &PreferenceBatch) -> Result<Tensor<1>, DpoError> {
                Ok((b.policy_rejected.clone() - b.policy_chosen.clone()).exp())
            }
        }
        let mut registry = LossRegistry::with_builtin();
        registry.register("margin", |_| Box::new(Margin));
        let loss = registry.build("margin", &LossParams::default()).unwrap();
        assert!(!loss.uses_reference());
        let value: f32 = loss
            .loss(&batch(&Device::flex(), -2.0, -2.0, 0.0, 0.0))
            .unwrap()
            .into_scalar();
        assert_eq!(value, 1.0);
    }
}
