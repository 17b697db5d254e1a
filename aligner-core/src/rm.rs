//! Reward-model training: Bradley–Terry loss on chosen/rejected pairs, and masked MSE for a
//! multi-output regression head (SteerLM's attribute model).

use std::path::Path;

use burn::tensor::activation::log_sigmoid;
use burn::tensor::{Device, Tensor};
use serde::Deserialize;

use crate::data::{Completion, Prompt};
use crate::error::Result;
use crate::reward::RewardModel;
use crate::run::{RunDir, data_files};
use crate::score::pad_right;
use crate::start::{head_store, load_head_model_split};
pub use crate::store::RewardModelStore;
use crate::tokenizer::TextTokenizer;
use crate::train::{EvalSum, Objective, RunSummary, StepOutput, fit};

/// A preference line: `{"prompt", "chosen", "rejected"}`, in any of TRL's forms (see
/// [`crate::data::render_pair`]), optionally with a soft label `"chosen_probability"`: how
/// likely the labeller holds `chosen` the better one (Constitutional AI's AI labels; 1 when
/// absent).
#[derive(Debug, Clone, Deserialize)]
pub struct PreferenceRow {
    #[serde(default)]
    pub prompt: Option<Prompt>,
    pub chosen: Completion,
    pub rejected: Completion,
    #[serde(default)]
    pub chosen_probability: Option<f64>,
}

/// A tokenized preference pair (`encode(prompt + response)`, truncated) and the probability
/// that `chosen` is preferred.
#[derive(Debug, Clone, PartialEq)]
pub struct PairExample {
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
    pub target: f32,
}

impl PairExample {
    pub fn from_row(row: &PreferenceRow, tokenizer: &TextTokenizer, max_len: usize) -> Result<Self> {
        let pair = crate::data::render_pair(row.prompt.as_ref(), &row.chosen, &row.rejected, tokenizer)?;
        let encode = |response: &str| -> Result<Vec<u32>> {
            let mut ids = tokenizer.encode(&format!("{}{response}", pair.prompt), true)?;
            ids.truncate(max_len.max(1));
            Ok(ids)
        };
        let target = row.chosen_probability.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&target) {
            return Err(crate::CoreError::Invalid(format!(
                "chosen_probability {target} is not a probability (0 to 1)"
            )));
        }
        Ok(Self {
            chosen: encode(&pair.chosen)?,
            rejected: encode(&pair.rejected)?,
            target: target as f32,
        })
    }
}

/// Tokenizes a preference file, naming the first bad line.
pub fn load_pairs(path: &Path, tokenizer: &TextTokenizer, max_len: usize) -> Result<Vec<PairExample>> {
    crate::data::load_examples(path, |row: &PreferenceRow| {
        PairExample::from_row(row, tokenizer, max_len)
    })
}

/// Bradley–Terry loss `-log σ(r_c - r_r)` per pair.
pub fn bradley_terry_loss(chosen: Tensor<1>, rejected: Tensor<1>) -> Tensor<1> {
    log_sigmoid(chosen - rejected).neg()
}

/// Bradley–Terry loss on soft labels: the cross-entropy `-(p log σ(m) + (1 - p) log σ(-m))`,
/// `m = r_c - r_r`, `p` the probability that `chosen` is preferred (`p = 1`: the plain loss).
pub fn soft_bradley_terry_loss(chosen: Tensor<1>, rejected: Tensor<1>, target: Tensor<1>) -> Tensor<1> {
    let margin = chosen - rejected;
    let ones = target.ones_like();
    (target.clone() * log_sigmoid(margin.clone()) + (ones - target) * log_sigmoid(margin.neg())).neg()
}

fn targets(batch: &[&PairExample], device: &Device) -> Tensor<1> {
    let t: Vec<f32> = batch.iter().map(|p| p.target).collect();
    Tensor::<1>::from_floats(t.as_slice(), device)
}

/// Masked mean squared error: `Σ mask·(pred - target)² / Σ mask`.
pub fn masked_mse(pred: Tensor<2>, target: Tensor<2>, mask: Tensor<2>) -> Tensor<1> {
    let count = mask.clone().sum().clamp_min(1.0);
    ((pred - target).square() * mask).sum() / count
}

/// Rewards of the chosen and rejected sides of `batch` (one forward pass over both).
fn pair_rewards(model: &RewardModel, batch: &[&PairExample], device: &Device) -> (Tensor<1>, Tensor<1>) {
    let mut rows: Vec<&[u32]> = batch.iter().map(|p| p.chosen.as_slice()).collect();
    rows.extend(batch.iter().map(|p| p.rejected.as_slice()));
    let lengths: Vec<usize> = rows.iter().map(|r| r.len()).collect();
    let tokens = pad_right(&rows, 0, device);
    let valid = crate::score::right_padding_valid(&rows);
    let rewards = crate::model::with_valid_tokens(valid, || model.forward(tokens, &lengths));
    let b = batch.len();
    let r = rewards.narrow(1, 0, 1).reshape([2 * b]);
    (r.clone().narrow(0, 0, b), r.narrow(0, b, b))
}

/// The Bradley–Terry objective.
pub struct RewardObjective;

impl Objective<RewardModel> for RewardObjective {
    type Example = PairExample;

    fn step(&self, model: &RewardModel, batch: &[&PairExample]) -> Result<StepOutput> {
        let device = model.score.weight.device();
        let (c, r) = pair_rewards(model, batch, &device);
        let margin: Vec<f32> = (c.clone() - r.clone())
            .detach()
            .into_data()
            .try_to_vec()
            .unwrap_or_default();
        let accuracy = margin.iter().filter(|&&m| m > 0.0).count() as f64 / margin.len().max(1) as f64;
        let mean_margin = margin.iter().map(|&m| m as f64).sum::<f64>() / margin.len().max(1) as f64;
        let loss = soft_bradley_terry_loss(c, r, targets(batch, &device)).mean();
        Ok(StepOutput {
            loss,
            metrics: vec![("accuracy".into(), accuracy), ("margin".into(), mean_margin)],
            tokens: batch.iter().map(|p| p.chosen.len() + p.rejected.len()).sum(),
        })
    }

    fn evaluate(&self, model: &RewardModel, batch: &[&PairExample]) -> Result<Vec<EvalSum>> {
        let device = model.score.weight.device();
        let (c, r) = pair_rewards(model, batch, &device);
        let loss: f64 = soft_bradley_terry_loss(c.clone(), r.clone(), targets(batch, &device))
            .sum()
            .into_scalar::<f32>() as f64;
        let margin: Vec<f32> = (c - r).into_data().try_to_vec().unwrap_or_default();
        let n = margin.len() as f64;
        Ok(vec![
            EvalSum {
                name: "loss".into(),
                sum: loss,
                weight: n,
            },
            EvalSum {
                name: "accuracy".into(),
                sum: margin.iter().filter(|&&m| m > 0.0).count() as f64,
                weight: n,
            },
            EvalSum {
                name: "margin".into(),
                sum: margin.iter().map(|&m| m as f64).sum(),
                weight: n,
            },
        ])
    }

    fn plot_keys(&self) -> Vec<String> {
        vec!["accuracy".into(), "eval_accuracy".into()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    #[test]
    fn bradley_terry_matches_hand_values() {
        let device = Device::flex();
        let c = Tensor::<1>::from_floats([1.0, 0.0, -2.0], &device);
        let r = Tensor::<1>::from_floats([0.0, 0.0, 1.0], &device);
        let got: Vec<f32> = bradley_terry_loss(c, r).into_data().try_to_vec().unwrap();
        // -log σ(1) = log(1 + e^-1); -log σ(0) = log 2; -log σ(-3) = log(1 + e^3).
        let want = [
            (1.0f64 + (-1.0f64).exp()).ln(),
            2f64.ln(),
            (1.0 + 3f64.exp()).ln(),
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6);
        }
    }

    #[test]
    fn bradley_terry_gradient_pushes_chosen_up() {
        let device = Device::flex().autodiff();
        let c = Tensor::<1>::from_floats([0.5], &device).require_grad();
        let r = Tensor::<1>::from_floats([0.5], &device).require_grad();
        let grads = bradley_terry_loss(c.clone(), r.clone()).sum().backward();
        let gc = c.grad(&grads).unwrap().into_scalar::<f32>();
        let gr = r.grad(&grads).unwrap().into_scalar::<f32>();
        assert!((gc + 0.5).abs() < 1e-6 && (gr - 0.5).abs() < 1e-6, "{gc} {gr}");
    }

    #[test]
    fn soft_labels_by_hand() {
        let device = Device::flex();
        let c = Tensor::<1>::from_floats([1.0, 1.0, 0.5], &device);
        let r = Tensor::<1>::from_floats([0.0, 0.0, 0.5], &device);
        let p = Tensor::<1>::from_floats([1.0, 0.75, 0.3], &device);
        let got: Vec<f32> = soft_bradley_terry_loss(c, r, p).into_data().try_to_vec().unwrap();
        let softplus = |x: f64| (1.0 + x.exp()).ln();
        // p = 1: the plain loss; p = 0.75 at margin 1: 0.75·softplus(-1) + 0.25·softplus(1);
        // margin 0: log 2 whatever p.
        let want = [
            softplus(-1.0),
            0.75 * softplus(-1.0) + 0.25 * softplus(1.0),
            2f64.ln(),
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{got:?} {want:?}");
        }
    }

    #[test]
    fn soft_label_gradient_vanishes_at_the_labelled_margin() {
        // d/dm of the soft loss is σ(m) - p: zero where σ(m) = p.
        let device = Device::flex().autodiff();
        let m = 0.75f32.ln() - 0.25f32.ln();
        let c = Tensor::<1>::from_floats([m], &device).require_grad();
        let r = Tensor::<1>::from_floats([0.0], &device);
        let p = Tensor::<1>::from_floats([0.75], &device);
        let grads = soft_bradley_terry_loss(c.clone(), r, p).sum().backward();
        let g = c.grad(&grads).unwrap().into_scalar::<f32>();
        assert!(g.abs() < 1e-6, "{g}");
    }

    #[test]
    fn masked_mse_ignores_missing_targets() {
        let device = Device::flex();
        let pred = Tensor::<2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &device);
        let target = Tensor::<2>::from_floats([[0.0, 0.0], [3.0, 100.0]], &device);
        let mask = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 1.0, 1.0, 0.0], [2, 2]), &device);
        // (1 + 4 + 0) / 3
        let v = masked_mse(pred, target, mask).into_scalar::<f32>();
        assert!((v - 5.0 / 3.0).abs() < 1e-6);
    }
}

/// `aligner rm` configuration: the shared sections.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmConfig {
    pub model: crate::train::ModelSection,
    pub data: crate::train::DataSection,
    pub train: crate::train::TrainSection,
    pub parallel: crate::train::ParallelSection,
}

impl Default for RmConfig {
    /// The embedded default: a reward model from the shipped model on the shipped
    /// tinystories_sentiment preference pairs.
    fn default() -> Self {
        Self {
            model: Default::default(),
            data: crate::train::DataSection::shipped("train.pref.jsonl", "test.pref.jsonl"),
            train: crate::train::TrainSection::embedded_default(3),
            parallel: Default::default(),
        }
    }
}

/// A reward model, the whole run: the trunk of `[model]` with a scalar head (LoRA on the trunk
/// when `model.lora_rank > 0`) trained with the Bradley–Terry loss on `data.train`'s pairs,
/// validated on `data.validation`, saved as `LlamaForSequenceClassification` into `run`.
pub fn train(config: &RmConfig, run: &RunDir, device: &Device) -> Result<RunSummary> {
    run.start(config)?;
    let files = data_files(&config.data)?;
    // The tensor groups form first, so that each rank reads only its blocks of the trunk.
    let (start, run) =
        load_head_model_split(&config.model, &["reward".into()], &config.parallel, run, device)?;
    let run = &run;
    let max_len = config.data.max_len(&start.config)?;
    let (train, validation) = files.load(|path, _| load_pairs(path, &start.tokenizer, max_len))?;
    tracing::info!(train = train.len(), validation = validation.len(), "reward model");
    let mut model = start.model;
    let store = head_store(
        &mut model,
        &config.model,
        &start.config,
        &start.labels,
        &start.dir,
        device,
    )?;
    fit(
        model,
        &RewardObjective,
        (&train, &validation),
        store.as_ref(),
        &config.train,
        run,
        device,
    )
}
