//! Preference losses by name: the built-in family, and variants registered by other crates.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use burn::tensor::Tensor;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::losses::{
    hinge_loss, ipo_loss, robust_loss, rpo_bwd_kl_loss, rpo_fwd_kl_loss, rpo_sq_loss, sigmoid_loss,
};
use crate::{LossError, PreferenceBatch, PreferenceLoss};

/// What a loss is built from: `[dpo]`'s shared knobs and the variant's own `dpo.params` table.
#[derive(Debug, Clone, Copy)]
pub struct LossSpec<'a> {
    /// KL strength β.
    pub beta: f64,
    /// Conservative DPO ε (`dpo`), label-noise rate (`robust`).
    pub label_smoothing: f64,
    /// Scale of ground-truth reward margins (`rpo_*`).
    pub gt_reward_scale: f64,
    /// Use per-token-averaged log-probs in the margin (IPO always does).
    pub average_log_probs: bool,
    /// `dpo.params`: the variant's own keys, parsed by it into its own typed struct.
    pub params: &'a toml::Table,
}

/// The `dpo.params` of a spec that has none; static so [`LossSpec::with_beta`] borrows nothing.
static NO_PARAMS_TABLE: LazyLock<toml::Table> = LazyLock::new(toml::Table::new);

/// A variant's `dpo.params` when it takes none: any key there is an error, not silently ignored.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

impl Default for LossSpec<'_> {
    /// `[dpo]`'s defaults: β = 0.1, no smoothing, reward scale 1, summed log-probs, no params.
    fn default() -> Self {
        LossSpec::with_beta(0.1)
    }
}

impl LossSpec<'_> {
    /// A spec with every knob at its default, `beta` as given and no params (for callers that
    /// fix the loss themselves, such as SPIN and benchmarks, and for tests).
    pub fn with_beta(beta: f64) -> LossSpec<'static> {
        LossSpec {
            beta,
            label_smoothing: 0.0,
            gt_reward_scale: 1.0,
            average_log_probs: false,
            params: &NO_PARAMS_TABLE,
        }
    }

    /// The variant's parameters as its typed struct `T` (a `#[serde(deny_unknown_fields, default)]`
    /// struct); an unknown or mistyped key is an error naming `dpo.params.<key>` and the loss.
    pub fn params<T: DeserializeOwned>(&self, loss: &str) -> Result<T, LossError> {
        self.params.clone().try_into().map_err(|whole: toml::de::Error| {
            // Serde's message does not always name the key (type errors don't), so blame the first
            // key that fails on its own; with `default` structs that is the offending one.
            let culprit = self.params.iter().find_map(|(key, value)| {
                let single: toml::Table = [(key.clone(), value.clone())].into_iter().collect();
                single
                    .try_into::<T>()
                    .err()
                    .map(|e| (format!("dpo.params.{key}"), e))
            });
            let (field, error) = culprit.unwrap_or_else(|| ("dpo.params".into(), whole));
            LossError::BadParams {
                loss: loss.to_string(),
                field,
                message: error.message().to_string(),
            }
        })
    }
}

/// Builds a loss from the spec; an error for params it does not take or knobs out of range.
pub type LossConstructor = fn(&LossSpec<'_>) -> Result<Box<dyn PreferenceLoss>, LossError>;

/// Loss constructors by name.
pub struct LossRegistry {
    entries: BTreeMap<String, LossConstructor>,
}

/// A built-in loss: its name, the `[dpo]` knobs it was built with and the function it computes.
struct Builtin {
    name: &'static str,
    beta: f64,
    label_smoothing: f64,
    gt_reward_scale: f64,
    average_log_probs: bool,
    compute: fn(&Builtin, &PreferenceBatch) -> Result<Tensor<1>, LossError>,
}

impl Builtin {
    /// Checks that `dpo.params` is empty (built-ins take none) and the knobs are in range, and
    /// copies the shared knobs.
    fn build(
        name: &'static str,
        spec: &LossSpec<'_>,
        check: fn(&LossSpec<'_>) -> Result<(), LossError>,
        compute: fn(&Builtin, &PreferenceBatch) -> Result<Tensor<1>, LossError>,
    ) -> Result<Box<dyn PreferenceLoss>, LossError> {
        spec.params::<NoParams>(name)?;
        check(spec)?;
        Ok(Box::new(Builtin {
            name,
            beta: spec.beta,
            label_smoothing: spec.label_smoothing,
            gt_reward_scale: spec.gt_reward_scale,
            average_log_probs: spec.average_log_probs,
            compute,
        }))
    }

    /// The log-ratio margin, summed or averaged as `dpo.average_log_probs` says.
    fn margin(&self, b: &PreferenceBatch) -> Tensor<1> {
        b.logratio_margin(self.average_log_probs)
    }

    /// The scaled ground-truth reward margin (an error when the data has no rewards).
    fn reward_margin(&self, b: &PreferenceBatch) -> Result<Tensor<1>, LossError> {
        b.reward_margin(self.gt_reward_scale, self.name)
    }
}

impl PreferenceLoss for Builtin {
    fn name(&self) -> &str {
        self.name
    }

    fn beta(&self) -> f64 {
        self.beta
    }

    fn loss(&self, batch: &PreferenceBatch) -> Result<Tensor<1>, LossError> {
        (self.compute)(self, batch)
    }
}

/// Any knobs will do.
fn any_knobs(_: &LossSpec<'_>) -> Result<(), LossError> {
    Ok(())
}

/// Robust DPO divides by `1 − 2ε`, so ε must stay below one half.
fn robust_knobs(spec: &LossSpec<'_>) -> Result<(), LossError> {
    if (0.0..0.5).contains(&spec.label_smoothing) {
        Ok(())
    } else {
        Err(LossError::Invalid(
            "robust needs 0 <= dpo.label_smoothing < 0.5".into(),
        ))
    }
}

macro_rules! builtin {
    ($name:literal, $compute:expr) => {
        builtin!($name, $compute, any_knobs)
    };
    ($name:literal, $compute:expr, $check:expr) => {
        (
            $name,
            (|spec: &LossSpec<'_>| Builtin::build($name, spec, $check, $compute)) as LossConstructor,
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
            builtin!("dpo", |l, b| Ok(sigmoid_loss(
                l.margin(b),
                l.beta,
                l.label_smoothing
            ))),
            builtin!("ipo", |l, b| Ok(ipo_loss(b.logratio_margin(true), l.beta))),
            builtin!("hinge", |l, b| Ok(hinge_loss(l.margin(b), l.beta))),
            builtin!(
                "robust",
                |l, b| Ok(robust_loss(l.margin(b), l.beta, l.label_smoothing)),
                robust_knobs
            ),
            builtin!("rpo_sq", |l, b| Ok(rpo_sq_loss(
                l.margin(b),
                l.beta,
                l.reward_margin(b)?
            ))),
            builtin!("rpo_bwd_kl", |l, b| Ok(rpo_bwd_kl_loss(
                l.margin(b),
                l.beta,
                l.reward_margin(b)?
            ))),
            builtin!("rpo_fwd_kl", |l, b| Ok(rpo_fwd_kl_loss(
                l.margin(b),
                l.beta,
                l.reward_margin(b)?
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

    /// The loss called `name`, built from `spec` (which it checks: unknown params are errors).
    pub fn build(&self, name: &str, spec: &LossSpec<'_>) -> Result<Box<dyn PreferenceLoss>, LossError> {
        let constructor = self.entries.get(name).ok_or_else(|| LossError::UnknownLoss {
            name: name.to_string(),
            known: self.names().join(", "),
        })?;
        constructor(spec)
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

    fn table(text: &str) -> toml::Table {
        text.parse().expect("test TOML parses")
    }

    #[test]
    fn dpo_is_log_two_with_zero_rewards_when_policy_equals_reference() {
        let device = Device::flex();
        let b = batch(&device, -12.0, -7.0, -12.0, -7.0);
        let loss: f32 = LossRegistry::with_builtin()
            .build("dpo", &LossSpec::default())
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
        let spec = LossSpec {
            label_smoothing: 0.1,
            ..LossSpec::default()
        };
        for name in registry.names() {
            let b = batch(&device, -10.0, -8.0, -10.0, -8.0);
            let loss = registry.build(name, &spec).unwrap().loss(&b).unwrap();
            let grads = loss.sum().backward();
            let gc: f32 = b.policy_chosen.grad(&grads).unwrap().into_scalar();
            let gr: f32 = b.policy_rejected.grad(&grads).unwrap().into_scalar();
            assert!(gc < 0.0 && gr > 0.0, "{name}: d/dchosen {gc}, d/drejected {gr}");
        }
    }

    #[test]
    fn a_built_loss_reports_the_beta_of_its_spec() {
        let registry = LossRegistry::with_builtin();
        for name in registry.names() {
            let loss = registry.build(name, &LossSpec::with_beta(0.37)).unwrap();
            assert_eq!(loss.beta(), 0.37, "{name}");
        }
        // β reaches the math too: hinge relu(1 − βΔ) with Δ = 2 is 1 − 2β.
        let b = batch(&Device::flex(), -8.0, -6.0, -12.0, -8.0);
        let hinge: f32 = registry
            .build("hinge", &LossSpec::with_beta(0.25))
            .unwrap()
            .loss(&b)
            .unwrap()
            .into_scalar();
        assert!((hinge - 0.5).abs() < 1e-6, "{hinge}");
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
            .build("ipo", &LossSpec::default())
            .unwrap()
            .loss(&b)
            .unwrap()
            .into_scalar();
        assert!((ipo - 25.0).abs() < 1e-4);
    }

    #[test]
    fn unknown_names_missing_rewards_and_bad_knobs_are_errors() {
        let registry = LossRegistry::with_builtin();
        let err = registry
            .build("dpoo", &LossSpec::default())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("dpoo") && err.contains("ipo"), "{err}");
        let device = Device::flex();
        let mut b = batch(&device, -1.0, -1.0, -1.0, -1.0);
        b.chosen_reward = None;
        let err = registry
            .build("rpo_sq", &LossSpec::default())
            .unwrap()
            .loss(&b)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("chosen_reward"), "{err}");
        let smoothing = LossSpec {
            label_smoothing: 0.5,
            ..LossSpec::default()
        };
        let err = registry.build("robust", &smoothing).err().unwrap().to_string();
        assert!(err.contains("label_smoothing"), "{err}");
    }

    #[test]
    fn builtins_take_no_params_so_any_key_is_an_error_naming_it() {
        let registry = LossRegistry::with_builtin();
        let params = table("gama = 1.0");
        let spec = LossSpec {
            params: &params,
            ..LossSpec::default()
        };
        for name in registry.names() {
            let err = registry.build(name, &spec).err().unwrap();
            assert!(matches!(err, LossError::BadParams { .. }), "{name}: {err}");
            let err = err.to_string();
            assert!(
                err.contains("dpo.params.gama") && err.contains(&format!("{name:?}")),
                "{name}: {err}"
            );
        }
    }

    #[test]
    fn typed_params_name_the_unknown_or_mistyped_key() {
        #[derive(Debug, Deserialize, PartialEq)]
        #[serde(deny_unknown_fields, default)]
        struct Knobs {
            gamma: f64,
            steps: u32,
        }
        impl Default for Knobs {
            fn default() -> Self {
                Self { gamma: 0.5, steps: 1 }
            }
        }
        let parse = |text: &str| {
            let params = table(text);
            LossSpec {
                params: &params,
                ..LossSpec::default()
            }
            .params::<Knobs>("mine")
        };
        assert_eq!(parse("").unwrap(), Knobs::default());
        // An integer where a float is expected is fine (`dpo.params.gamma=1` on the command line).
        assert_eq!(parse("gamma = 1").unwrap(), Knobs { gamma: 1.0, steps: 1 });
        let err = parse("gamma = 1.0\ngama = 2.0").unwrap_err().to_string();
        assert!(
            err.contains("dpo.params.gama") && err.contains("\"mine\"") && err.contains("`gamma`"),
            "{err}"
        );
        let err = parse("steps = 2\ngamma = \"high\"").unwrap_err().to_string();
        assert!(
            err.contains("dpo.params.gamma") && err.contains("string"),
            "{err}"
        );
    }

    #[test]
    fn a_crate_can_register_its_own_variant() {
        struct Margin;
        impl PreferenceLoss for Margin {
            fn name(&self) -> &str {
                "margin"
            }
            fn beta(&self) -> f64 {
                1.0
            }
            fn uses_reference(&self) -> bool {
                false
            }
            fn loss(&self, b: &PreferenceBatch) -> Result<Tensor<1>, LossError> {
                Ok((b.policy_rejected.clone() - b.policy_chosen.clone()).exp())
            }
        }
        let mut registry = LossRegistry::with_builtin();
        registry.register("margin", |spec| {
            spec.params::<NoParams>("margin")?;
            Ok(Box::new(Margin))
        });
        let loss = registry.build("margin", &LossSpec::default()).unwrap();
        assert!(!loss.uses_reference());
        let value: f32 = loss
            .loss(&batch(&Device::flex(), -2.0, -2.0, 0.0, 0.0))
            .unwrap()
            .into_scalar();
        assert_eq!(value, 1.0);
    }
}
