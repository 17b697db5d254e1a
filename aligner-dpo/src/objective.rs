//! The DPO trainer objective: policy log-probs of both sides, reference log-probs computed once
//! before training and cached in the run folder, any registered preference loss.

use std::path::Path;

use aligner_core::data::{Completion, Prompt};
use aligner_core::score::{ScoredSequence, cached_reference_logprobs, sequence_logprobs};
use aligner_core::train::{
    DataSection, EvalSum, ModelSection, Objective, Range, StepOutput, TrainSection, check_values,
};
use aligner_core::{CausalLm, CoreError, TextTokenizer};
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::{DpoError, LossRegistry, LossSpec, PreferenceBatch, PreferenceLoss, implicit_rewards};

/// A preference line, in any of TRL's forms (text, conversational, implicit prompt: see
/// [`aligner_core::data::render_pair`]); rewards are optional (reward-aware losses need them).
#[derive(Debug, Clone, Deserialize)]
pub struct DpoRow {
    #[serde(default)]
    pub prompt: Option<Prompt>,
    pub chosen: Completion,
    pub rejected: Completion,
    #[serde(default)]
    pub chosen_reward: Option<f32>,
    #[serde(default)]
    pub rejected_reward: Option<f32>,
}

/// A tokenized pair with its reference log-probs.
#[derive(Debug, Clone, PartialEq)]
pub struct DpoExample {
    pub chosen: ScoredSequence,
    pub rejected: ScoredSequence,
    pub reference: Option<(f32, f32)>,
    pub rewards: Option<(f32, f32)>,
}

/// `[dpo]`: the loss and its knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoSection {
    /// A registered loss name: dpo, ipo, hinge, robust, rpo_sq, rpo_bwd_kl, rpo_fwd_kl, ...
    pub loss: String,
    pub beta: f64,
    pub label_smoothing: f64,
    pub gt_reward_scale: f64,
    pub average_log_probs: bool,
    /// RPO: weight of the chosen response's per-token NLL added to the loss.
    pub sft_weight: f64,
    /// The loss's own keys, e.g. SimPO's `gamma`; each loss parses them into its typed struct.
    pub params: toml::Table,
}

impl Default for DpoSection {
    fn default() -> Self {
        let p = LossSpec::default();
        Self {
            loss: "dpo".into(),
            beta: p.beta,
            label_smoothing: p.label_smoothing,
            gt_reward_scale: p.gt_reward_scale,
            average_log_probs: p.average_log_probs,
            sft_weight: 0.0,
            params: Default::default(),
        }
    }
}

impl DpoSection {
    /// What the loss is built from: these knobs and `params`, borrowed.
    pub fn spec(&self) -> LossSpec<'_> {
        LossSpec {
            beta: self.beta,
            label_smoothing: self.label_smoothing,
            gt_reward_scale: self.gt_reward_scale,
            average_log_probs: self.average_log_probs,
            params: &self.params,
        }
    }

    /// Sets `dpo.params.<key>` from Rust: numbers, booleans and strings convert, so a caller
    /// needs no `toml` of its own (`config.dpo.set_param("gamma", 0.5)` for SimPO's γ).
    pub fn set_param(&mut self, key: &str, value: impl Into<toml::Value>) -> &mut Self {
        self.params.insert(key.to_string(), value.into());
        self
    }

    /// The loss `loss` names, from `registry`; an error for an unknown name or bad `params`.
    pub fn build_loss(&self, registry: &LossRegistry) -> Result<Box<dyn PreferenceLoss>, DpoError> {
        self.check()?;
        Ok(registry.build(&self.loss, &self.spec())?)
    }

    /// Refuses knobs no loss can train with, naming the key.
    pub fn check(&self) -> Result<(), CoreError> {
        check_values(&[
            ("dpo.beta", self.beta, Range::Positive),
            ("dpo.label_smoothing", self.label_smoothing, Range::Fraction),
            ("dpo.gt_reward_scale", self.gt_reward_scale, Range::NonNegative),
            ("dpo.sft_weight", self.sft_weight, Range::NonNegative),
        ])
    }
}

/// `aligner dpo` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoConfig {
    pub model: ModelSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub dpo: DpoSection,
    /// The reward–KL figures of the policy's own samples, at every validation.
    pub frontier: aligner_gen::FrontierSection,
    pub parallel: aligner_core::train::ParallelSection,
}

impl Default for DpoConfig {
    /// The embedded default: the shipped model on the shipped tinystories_sentiment pairs.
    fn default() -> Self {
        Self {
            model: ModelSection::default(),
            data: DataSection::shipped("train.pref.jsonl", "test.pref.jsonl"),
            // Measured here: lr 1e-3 over two epochs raises the sentiment score most but the
            // samples degrade (chosen log-probs fall 3×); 3e-4 for one epoch keeps them fluent.
            train: TrainSection {
                lr: 3e-4,
                ..TrainSection::embedded_default(1)
            },
            dpo: DpoSection::default(),
            frontier: aligner_gen::FrontierSection::shipped(),
            parallel: Default::default(),
        }
    }
}

/// Tokenizes a preference file by the scoring convention, naming the first bad line.
pub fn load_dpo_examples(
    path: &Path,
    tokenizer: &TextTokenizer,
    max_len: usize,
) -> Result<Vec<DpoExample>, CoreError> {
    aligner_core::data::load_examples(path, |row: &DpoRow| dpo_example(row, tokenizer, max_len))
}

/// Tokenizes one preference row (prompt + each response by the scoring convention).
pub fn dpo_example(row: &DpoRow, tokenizer: &TextTokenizer, max_len: usize) -> Result<DpoExample, CoreError> {
    let pair = aligner_core::data::render_pair(row.prompt.as_ref(), &row.chosen, &row.rejected, tokenizer)?;
    let encode = |response: &str| -> Result<ScoredSequence, CoreError> {
        let mut seq = ScoredSequence::encode(tokenizer, &pair.prompt, response)?;
        seq.truncate(max_len)?;
        Ok(seq)
    };
    Ok(DpoExample {
        chosen: encode(&pair.chosen).map_err(|e| CoreError::Invalid(format!("chosen: {e}")))?,
        rejected: encode(&pair.rejected).map_err(|e| CoreError::Invalid(format!("rejected: {e}")))?,
        reference: None,
        rewards: row.chosen_reward.zip(row.rejected_reward),
    })
}

/// Fills in reference log-probs: read from `cache` when it matches, else computed with
/// `reference` (batched; each data-parallel rank scores its shard) and written there, so a
/// resumed run reuses them.
pub fn attach_reference(
    examples: &mut [DpoExample],
    reference: &CausalLm,
    cache: &Path,
    batch_size: usize,
    comm: &dyn aligner_core::Communicator,
) -> Result<(), CoreError> {
    let seqs: Vec<ScoredSequence> = examples
        .iter()
        .flat_map(|e| [e.chosen.clone(), e.rejected.clone()])
        .collect();
    let values = cached_reference_logprobs(&seqs, reference, cache, batch_size, comm)?;
    for (e, pair) in examples.iter_mut().zip(values.chunks(2)) {
        e.reference = Some((pair[0], pair[1]));
    }
    Ok(())
}

/// DPO-family training with any [`PreferenceLoss`].
pub struct DpoObjective {
    /// The preference loss; its β also scales the logged implicit rewards.
    pub loss: Box<dyn PreferenceLoss>,
    pub sft_weight: f64,
}

struct Forward {
    batch: PreferenceBatch,
    loss: Tensor<1>,
    chosen_counts: Tensor<1>,
}

impl DpoObjective {
    fn forward(&self, model: &CausalLm, examples: &[&DpoExample]) -> aligner_core::Result<Forward> {
        let device = model.model.embed_tokens.weight.device();
        let b = examples.len();
        let seqs: Vec<&ScoredSequence> = examples
            .iter()
            .map(|e| &e.chosen)
            .chain(examples.iter().map(|e| &e.rejected))
            .collect();
        let (sums, counts) = sequence_logprobs(model, &seqs);
        let floats = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), &device);
        let reference: Vec<(f32, f32)> = examples
            .iter()
            .map(|e| e.reference.unwrap_or((0.0, 0.0)))
            .collect();
        let rewards: Option<Vec<(f32, f32)>> = examples.iter().map(|e| e.rewards).collect();
        let chosen_counts = floats(counts[..b].to_vec());
        let batch = PreferenceBatch {
            policy_chosen: sums.clone().narrow(0, 0, b),
            policy_rejected: sums.narrow(0, b, b),
            reference_chosen: floats(reference.iter().map(|r| r.0).collect()),
            reference_rejected: floats(reference.iter().map(|r| r.1).collect()),
            chosen_tokens: chosen_counts.clone(),
            rejected_tokens: floats(counts[b..].to_vec()),
            chosen_reward: rewards.as_ref().map(|r| floats(r.iter().map(|x| x.0).collect())),
            rejected_reward: rewards.as_ref().map(|r| floats(r.iter().map(|x| x.1).collect())),
        };
        let loss = self
            .loss
            .loss(&batch)
            .map_err(|e| CoreError::Invalid(e.to_string()))?;
        Ok(Forward {
            batch,
            loss,
            chosen_counts,
        })
    }

    /// Per-pair values of the logged metrics.
    fn pair_metrics(&self, f: &Forward) -> Vec<(&'static str, Vec<f32>)> {
        let b = &f.batch;
        let beta = self.loss.beta();
        let host = |t: Tensor<1>| t.detach().into_data().try_to_vec::<f32>().unwrap_or_default();
        let rc = host(implicit_rewards(
            b.policy_chosen.clone(),
            b.reference_chosen.clone(),
            beta,
        ));
        let rr = host(implicit_rewards(
            b.policy_rejected.clone(),
            b.reference_rejected.clone(),
            beta,
        ));
        let margin: Vec<f32> = rc.iter().zip(&rr).map(|(c, r)| c - r).collect();
        let accuracy = margin.iter().map(|m| (*m > 0.0) as u8 as f32).collect();
        vec![
            ("rewards/chosen", rc),
            ("rewards/rejected", rr),
            ("rewards/margin", margin),
            ("rewards/accuracy", accuracy),
            ("logps/chosen", host(b.policy_chosen.clone())),
            ("logps/rejected", host(b.policy_rejected.clone())),
        ]
    }
}

impl Objective<CausalLm> for DpoObjective {
    type Example = DpoExample;

    fn step(&self, model: &CausalLm, batch: &[&DpoExample]) -> aligner_core::Result<StepOutput> {
        let f = self.forward(model, batch)?;
        let mut loss = f.loss.clone().mean();
        if self.sft_weight > 0.0 {
            let nll = (f.batch.policy_chosen.clone() / f.chosen_counts.clone())
                .mean()
                .neg();
            loss = loss + nll.mul_scalar(self.sft_weight);
        }
        let metrics = self
            .pair_metrics(&f)
            .into_iter()
            .map(|(n, v)| {
                (
                    n.to_string(),
                    v.iter().map(|x| *x as f64).sum::<f64>() / v.len().max(1) as f64,
                )
            })
            .collect();
        let tokens = batch
            .iter()
            .map(|e| e.chosen.ids.len() + e.rejected.ids.len())
            .sum();
        Ok(StepOutput {
            loss,
            metrics,
            tokens,
        })
    }

    fn evaluate(&self, model: &CausalLm, batch: &[&DpoExample]) -> aligner_core::Result<Vec<EvalSum>> {
        let f = self.forward(model, batch)?;
        let loss: f64 = f.loss.clone().sum().into_scalar::<f32>() as f64;
        let mut out = vec![EvalSum {
            name: "loss".into(),
            sum: loss,
            weight: batch.len() as f64,
        }];
        for (name, values) in self.pair_metrics(&f) {
            out.push(EvalSum {
                name: name.into(),
                sum: values.iter().map(|x| *x as f64).sum(),
                weight: values.len() as f64,
            });
        }
        Ok(out)
    }

    fn plot_keys(&self) -> Vec<String> {
        vec!["rewards/margin".into(), "eval_rewards/accuracy".into()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Tensor;

    /// A variant with one parameter, as a crate of its own would register it.
    struct Shifted {
        shift: f64,
    }

    impl PreferenceLoss for Shifted {
        fn name(&self) -> &str {
            "shifted"
        }
        fn beta(&self) -> f64 {
            self.shift
        }
        fn loss(&self, b: &crate::PreferenceBatch) -> Result<Tensor<1>, crate::LossError> {
            Ok(b.logratio_margin(false).add_scalar(self.shift))
        }
    }

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct ShiftParams {
        shift: f64,
    }

    #[test]
    fn params_set_from_rust_reach_the_variant_and_a_misspelt_one_is_named() {
        let mut registry = LossRegistry::with_builtin();
        registry.register("shifted", |spec| {
            let p: ShiftParams = spec.params("shifted")?;
            Ok(Box::new(Shifted { shift: p.shift }))
        });
        let mut dpo = DpoSection {
            loss: "shifted".into(),
            ..DpoSection::default()
        };
        dpo.set_param("shift", 0.25);
        assert_eq!(dpo.build_loss(&registry).unwrap().beta(), 0.25);

        dpo.params.clear();
        dpo.set_param("shfit", 0.25);
        let err = dpo.build_loss(&registry).err().unwrap().to_string();
        assert!(err.contains("dpo.params.shfit"), "{err}");
        // A built-in takes no params: one set from Rust is refused, not ignored.
        let mut plain = DpoSection::default();
        plain.set_param("gamma", 0.5);
        let err = plain.build_loss(&registry).err().unwrap().to_string();
        assert!(err.contains("dpo.params.gamma"), "{err}");
    }
}
