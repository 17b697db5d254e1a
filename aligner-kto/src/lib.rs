//! # aligner-kto
//!
//! KTO (Ethayarajh et al., 2024) on unpaired data `{"prompt", "completion", "label"}`: with
//! `ρ = log π(y|x) − log π_ref(y|x)` and `z₀` the batch KL estimate from mismatched
//! prompt/completion pairs (detached, clamped at 0), a desirable completion costs
//! `1 − σ(β(ρ − z₀))` and an undesirable one `1 − σ(β(z₀ − ρ))`, weighted by
//! `kto.desirable_weight` / `kto.undesirable_weight`. Reference log-probs are computed once and
//! cached in the run folder (aligner-core's reference cache); the trainer is aligner-core's.
//! [`train`] is `aligner kto` as a library call.

use std::path::Path;

use aligner_core::Device;
use aligner_core::data::Prompt;
use aligner_core::run::{RunDir, data_files};
use aligner_core::score::{ScoredSequence, cached_reference_logprobs, sequence_logprobs};
use aligner_core::start::{load_model_split, policy_store};
use aligner_core::train::{
    DataSection, EvalSum, ModelSection, Objective, RunSummary, StepOutput, TrainSection,
};
use aligner_core::{CausalLm, CoreError, TextTokenizer};
use burn::tensor::activation::sigmoid;
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// The per-example KTO loss. `rho`: policy − reference log-ratio of each completion; `z0`:
/// the detached KL estimate; `desirable[i]` the label.
pub fn kto_loss(
    rho: Tensor<1>,
    z0: f64,
    desirable: &[bool],
    beta: f64,
    desirable_weight: f64,
    undesirable_weight: f64,
) -> Tensor<1> {
    let device = rho.device();
    let n = desirable.len();
    let sign: Vec<f32> = desirable.iter().map(|&d| if d { 1.0 } else { -1.0 }).collect();
    let weight: Vec<f32> = desirable
        .iter()
        .map(|&d| if d { desirable_weight } else { undesirable_weight } as f32)
        .collect();
    let sign = Tensor::<1>::from_data(TensorData::new(sign, [n]), &device);
    let weight = Tensor::<1>::from_data(TensorData::new(weight, [n]), &device);
    // Desirable: 1 − σ(β(ρ − z₀)); undesirable: 1 − σ(β(z₀ − ρ)) = 1 − σ(−β(ρ − z₀)).
    let value = sigmoid(rho.sub_scalar(z0).mul_scalar(beta) * sign)
        .neg()
        .add_scalar(1.0);
    value * weight
}

/// The KL estimate `max(0, mean(ρ_mismatched))`, as a plain number (no gradient).
pub fn kl_estimate(rho_mismatched: Tensor<1>) -> f64 {
    (rho_mismatched.detach().mean().into_scalar::<f32>() as f64).max(0.0)
}

/// A KTO line.
#[derive(Debug, Clone, Deserialize)]
pub struct KtoRow {
    pub prompt: Prompt,
    /// Text, or (TRL's conversational form) the messages that follow the prompt.
    pub completion: aligner_core::data::Completion,
    pub label: bool,
}

/// A tokenized example: its completion, a mismatched completion (the next example's, in file
/// order) for the KL estimate, and reference log-probs of both.
#[derive(Debug, Clone, PartialEq)]
pub struct KtoExample {
    pub matched: ScoredSequence,
    pub mismatched: ScoredSequence,
    pub desirable: bool,
    pub reference: (f32, f32),
}

/// `[kto]` knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KtoSection {
    pub beta: f64,
    pub desirable_weight: f64,
    pub undesirable_weight: f64,
}

impl Default for KtoSection {
    fn default() -> Self {
        Self {
            beta: 0.1,
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
        }
    }
}

/// `aligner kto` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KtoConfig {
    pub model: ModelSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub kto: KtoSection,
    /// The reward–KL figures of the policy's own samples, at every validation.
    pub frontier: aligner_gen::FrontierSection,
    /// Tensor groups (`parallel.tensor`): each rank trains its blocks of the policy.
    pub parallel: aligner_core::train::ParallelSection,
}

impl Default for KtoConfig {
    /// The shipped model on the shipped tinystories_sentiment KTO data.
    fn default() -> Self {
        Self {
            model: ModelSection::default(),
            data: DataSection::shipped("train.kto.jsonl", "test.kto.jsonl"),
            train: TrainSection {
                lr: 3e-4,
                ..TrainSection::embedded_default(1)
            },
            kto: KtoSection::default(),
            frontier: aligner_gen::FrontierSection::shipped(),
            parallel: Default::default(),
        }
    }
}

/// Tokenizes a KTO file and attaches cached reference log-probs (`cache`). A line that cannot
/// be used is an error naming the file and line.
pub fn load_kto_examples(
    path: &Path,
    tokenizer: &TextTokenizer,
    max_len: usize,
    reference: &CausalLm,
    cache: &Path,
    batch_size: usize,
    comm: &dyn aligner_core::Communicator,
) -> Result<Vec<KtoExample>, CoreError> {
    let rows = aligner_core::data::read_jsonl_numbered::<KtoRow>(path)?;
    let at_line = |line: usize, e: CoreError| {
        CoreError::Data(aligner_core::data::DataError {
            path: path.to_path_buf(),
            line,
            message: e.to_string(),
        })
    };
    let prompts: Vec<String> = rows
        .iter()
        .map(|(line, r)| r.prompt.render(tokenizer).map_err(|e| at_line(*line, e)))
        .collect::<Result<_, _>>()?;
    // Row i's prompt with completion `c` (its own, or the next row's for the KL estimate).
    let encode = |i: usize, c: &aligner_core::data::Completion| -> Result<ScoredSequence, CoreError> {
        let completion = c.render_after(&rows[i].1.prompt, &prompts[i], tokenizer)?;
        let mut seq = ScoredSequence::encode(tokenizer, &prompts[i], &completion)?;
        seq.truncate(max_len)?;
        Ok(seq)
    };
    let n = rows.len();
    let mut seqs = Vec::with_capacity(2 * n);
    for i in 0..n {
        let line = rows[i].0;
        seqs.push(encode(i, &rows[i].1.completion).map_err(|e| at_line(line, e))?);
        seqs.push(encode(i, &rows[(i + 1) % n].1.completion).map_err(|e| at_line(line, e))?);
    }
    let reference_values = cached_reference_logprobs(&seqs, reference, cache, batch_size, comm)?;
    Ok(rows
        .iter()
        .enumerate()
        .map(|(i, (_, row))| KtoExample {
            matched: seqs[2 * i].clone(),
            mismatched: seqs[2 * i + 1].clone(),
            desirable: row.label,
            reference: (reference_values[2 * i], reference_values[2 * i + 1]),
        })
        .collect())
}

/// A KTO run: the policy of `[model]` (LoRA adapters when configured) trained on `data.train`'s
/// unpaired completions into `run`; the start model is the reference, its log-probs cached in
/// the run folder (`reference_train.jsonl`, `reference_validation.jsonl`).
pub fn train(config: &KtoConfig, run: &RunDir, device: &Device) -> Result<RunSummary, CoreError> {
    let kto = &config.kto;
    aligner_core::train::check_values(&[
        ("kto.beta", kto.beta, aligner_core::train::Range::Positive),
        (
            "kto.desirable_weight",
            kto.desirable_weight,
            aligner_core::train::Range::Positive,
        ),
        (
            "kto.undesirable_weight",
            kto.undesirable_weight,
            aligner_core::train::Range::Positive,
        ),
    ])?;
    run.start(config)?;
    let files = data_files(&config.data)?;
    // In tensor groups, each rank reads only its blocks of the weights; the reference
    // log-probs are computed on the blocks, each group a share of the examples.
    let (lm, run) = load_model_split(&config.model, &config.parallel, run, device)?;
    let run = &run;
    let frontier = config
        .frontier
        .for_split_start_model(&lm, &config.model, run, device)?;
    let batch = config.train.batch_size.max(1) * 2;
    let max_len = config.data.max_len(&lm.config)?;
    let (train, validation) = files.load(|path, split| {
        let cache = run.join(format!("reference_{}.jsonl", split.name()));
        load_kto_examples(path, &lm.tokenizer, max_len, &lm.model, &cache, batch, run.comm())
    })?;
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device)?;
    tracing::info!(train = train.len(), validation = validation.len(), "KTO");

    let objective = KtoObjective {
        params: config.kto.clone(),
    };
    aligner_core::train::fit_evaluated(
        model,
        &objective,
        (&train, &validation),
        store.as_ref(),
        &config.train,
        run,
        device,
        frontier
            .as_ref()
            .map(|f| f as &dyn aligner_core::train::ModelEval<_>),
    )
}

/// The KTO trainer objective.
pub struct KtoObjective {
    pub params: KtoSection,
}

impl KtoObjective {
    /// The loss of `batch` with its own KL baseline (one process, or validation).
    fn forward(&self, model: &CausalLm, batch: &[&KtoExample]) -> (Tensor<1>, Tensor<1>, f64) {
        self.forward_with(model, batch, None)
    }

    /// The mismatched completions' policy − reference log-ratios of `batch`: their sum and
    /// count, from which the KL baseline z0 is the clamped mean (summed over ranks first in a
    /// data-parallel run, so every rank uses the whole batch's z0, as TRL gathers it).
    fn mismatched_sums(&self, model: &CausalLm, batch: &[&KtoExample]) -> [f64; 2] {
        if batch.is_empty() {
            return [0.0, 0.0];
        }
        let seqs: Vec<&ScoredSequence> = batch.iter().map(|e| &e.mismatched).collect();
        let (sums, _) = sequence_logprobs(model, &seqs);
        let policy: Vec<f32> = sums.detach().into_data().try_to_vec().unwrap_or_default();
        let sum: f64 = policy
            .iter()
            .zip(batch)
            .map(|(p, e)| (*p - e.reference.1) as f64)
            .sum();
        [sum, batch.len() as f64]
    }

    /// The loss of `batch`; `z0` is the KL baseline when it is given (the whole micro-batch's
    /// over all ranks), else the batch's own.
    fn forward_with(
        &self,
        model: &CausalLm,
        batch: &[&KtoExample],
        z0: Option<f64>,
    ) -> (Tensor<1>, Tensor<1>, f64) {
        let device = model.model.embed_tokens.weight.device();
        let b = batch.len();
        let seqs: Vec<&ScoredSequence> = batch
            .iter()
            .map(|e| &e.matched)
            .chain(batch.iter().map(|e| &e.mismatched))
            .collect();
        let (sums, _) = sequence_logprobs(model, &seqs);
        let reference = |f: fn(&KtoExample) -> f32| {
            let v: Vec<f32> = batch.iter().map(|e| f(e)).collect();
            Tensor::<1>::from_data(TensorData::new(v, [b]), &device)
        };
        let rho = sums.clone().narrow(0, 0, b) - reference(|e| e.reference.0);
        let z0 = z0.unwrap_or_else(|| kl_estimate(sums.narrow(0, b, b) - reference(|e| e.reference.1)));
        let labels: Vec<bool> = batch.iter().map(|e| e.desirable).collect();
        let p = &self.params;
        let loss = kto_loss(
            rho.clone(),
            z0,
            &labels,
            p.beta,
            p.desirable_weight,
            p.undesirable_weight,
        );
        (loss, rho, z0)
    }

    fn reward_metrics(&self, rho: Tensor<1>, batch: &[&KtoExample]) -> Vec<(String, f64, f64)> {
        let rho: Vec<f32> = rho.detach().into_data().try_to_vec().unwrap_or_default();
        let mut out = Vec::new();
        for (name, want) in [("rewards/chosen", true), ("rewards/rejected", false)] {
            let picked: Vec<f64> = rho
                .iter()
                .zip(batch)
                .filter(|(_, e)| e.desirable == want)
                .map(|(r, _)| *r as f64 * self.params.beta)
                .collect();
            out.push((name.to_string(), picked.iter().sum(), picked.len() as f64));
        }
        out
    }
}

impl Objective<CausalLm> for KtoObjective {
    type Example = KtoExample;

    fn step(&self, model: &CausalLm, batch: &[&KtoExample]) -> aligner_core::Result<StepOutput> {
        self.step_at(model, batch, None)
    }

    fn batch_sums(&self, model: &CausalLm, batch: &[&KtoExample]) -> aligner_core::Result<Vec<f64>> {
        Ok(self.mismatched_sums(model, batch).to_vec())
    }

    fn step_with_totals(
        &self,
        model: &CausalLm,
        batch: &[&KtoExample],
        totals: &[f64],
    ) -> aligner_core::Result<StepOutput> {
        let z0 = (totals[0] / totals[1].max(1.0)).max(0.0);
        self.step_at(model, batch, Some(z0))
    }

    fn evaluate(&self, model: &CausalLm, batch: &[&KtoExample]) -> aligner_core::Result<Vec<EvalSum>> {
        let (loss, rho, _) = self.forward(model, batch);
        let mut out = vec![EvalSum {
            name: "loss".into(),
            sum: loss.sum().into_scalar::<f32>() as f64,
            weight: batch.len() as f64,
        }];
        for (name, sum, weight) in self.reward_metrics(rho, batch) {
            out.push(EvalSum { name, sum, weight });
        }
        Ok(out)
    }

    fn plot_keys(&self) -> Vec<String> {
        vec!["kl".into(), "eval_loss".into()]
    }
}

impl KtoObjective {
    /// A training step of `batch` at the KL baseline `z0` (its own when `None`).
    fn step_at(
        &self,
        model: &CausalLm,
        batch: &[&KtoExample],
        z0: Option<f64>,
    ) -> aligner_core::Result<StepOutput> {
        let (loss, rho, z0) = self.forward_with(model, batch, z0);
        let mut metrics = vec![("kl".to_string(), z0)];
        for (name, sum, n) in self.reward_metrics(rho, batch) {
            if n > 0.0 {
                metrics.push((name, sum / n));
            }
        }
        let tokens = batch
            .iter()
            .map(|e| e.matched.ids.len() + e.mismatched.ids.len())
            .sum();
        Ok(StepOutput {
            loss: loss.mean(),
            metrics,
            tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn sig(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }

    #[test]
    fn kto_matches_hand_values() {
        let device = Device::flex();
        let rho = Tensor::<1>::from_floats([2.0, 2.0, -1.0], &device);
        let got: Vec<f32> = kto_loss(rho, 0.5, &[true, false, false], 0.5, 1.0, 2.0)
            .into_data()
            .try_to_vec()
            .unwrap();
        let want = [
            1.0 - sig(0.5 * 1.5),
            2.0 * (1.0 - sig(0.5 * -1.5)),
            2.0 * (1.0 - sig(0.5 * 1.5)),
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{g} vs {w}");
        }
    }

    #[test]
    fn kl_estimate_is_clamped_at_zero() {
        let device = Device::flex();
        assert_eq!(kl_estimate(Tensor::<1>::from_floats([-1.0, -3.0], &device)), 0.0);
        assert!((kl_estimate(Tensor::<1>::from_floats([1.0, 2.0], &device)) - 1.5).abs() < 1e-6);
    }

    #[test]
    fn gradients_raise_desirable_and_lower_undesirable() {
        let device = Device::flex().autodiff();
        let rho = Tensor::<1>::from_floats([0.0, 0.0], &device).require_grad();
        let grads = kto_loss(rho.clone(), 0.0, &[true, false], 0.1, 1.0, 1.0)
            .sum()
            .backward();
        let g: Vec<f32> = rho.grad(&grads).unwrap().into_data().try_to_vec().unwrap();
        assert!(g[0] < 0.0 && g[1] > 0.0, "{g:?}");
    }
}
