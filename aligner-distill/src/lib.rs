//! # aligner-distill
//!
//! Knowledge distillation: a student (`[model]`) learns a teacher's (`distill.teacher`)
//! next-token distributions, on the response tokens of a dataset (`{"prompt", "response"}` or
//! `{"messages"}` rows, as `aligner sft` reads them) or on its own answers to the dataset's
//! prompts. Three modes (`distill.mode`):
//!
//! - `gkd` (Agarwal et al., 2024; TRL's `GKDTrainer`): a share `distill.lambda` of each batch
//!   is the student's own answers (the engine, refit to its weights each step), the rest the
//!   data's; the loss is [`generalized_jsd`] with `distill.beta` over the whole vocabulary.
//! - `on_policy` (NeMo-RL's and verl's on-policy distillation): the student answers every
//!   prompt, the teacher scores the sampled tokens, and the per-token reverse KL is minimised
//!   as a dense reward through GRPO's clipped loss ([`aligner_loss::policy::policy_loss`]): each
//!   token's reward is `log π_T(y_t) − log π_old(y_t)` (the engine's log-probs are the
//!   behaviour policy), its advantage [`reverse_kl_advantages`], with `[ppo]`'s clip ranges,
//!   importance ratio and loss aggregation; the engine/trainer log-prob mismatch is logged.
//! - `supervised` (Hinton et al., 2015; TRL's and NeMo's supervised KD) minimises, per
//!   response token of the data,
//!
//! ```text
//! loss = (1 − α) · τ² · KL(p_teacher^τ ‖ p_student^τ) + α · NLL_student(data)
//! ```
//!
//! with `p^τ = softmax(logits / τ)` (`distill.temperature`) and `α` = `distill.alpha`. The
//! loss is [`forward_kl`] on the two models' logits, one visible function; the loop is
//! aligner-core's (resume, LoRA students, data parallel, checkpoints as for every method), and
//! each validation logs the held-out forward and reverse KL to the teacher per response token
//! (`eval_kl`, `eval_reverse_kl`) beside the student's NLL of the data (`eval_nll`) and, with
//! `[frontier]`, the reward–KL figures of its own samples against the start model.
//!
//! `distill.teacher_weight` λ < 1 makes the target the geometric mixture of the start model
//! and the teacher (logits `λ·z_T + (1 − λ)·z_start`: for a DPO teacher, the policy DPO would
//! reach at β/λ), which keeps most of the teacher's reward at a lower KL to the start;
//! `distill.top_k` caches the teacher's top-k log-probs once for `supervised` ([`top_k`]).
//!
//! In tensor groups (`parallel.tensor`) every loss runs over the vocabulary split across the
//! group: [`forward_kl_over`], [`generalized_jsd_over`], [`reverse_kl_over`] and
//! [`forward_kl_top_k_over`] take the logits of each rank's block of the vocabulary and a
//! [`Vocabulary::Split`], and equal the one-process losses (values and gradients).
//!
//! Teacher and student may differ in size and depth but must share a tokenizer (refused
//! naming both folders otherwise). Without `distill.teacher`, the default `aligner dpo` run is
//! trained first into `<run>/teacher` and distilled into the start model. [`train`] is
//! `aligner distill` as a library call.

pub mod top_k;

use std::cell::RefCell;
use std::path::PathBuf;

use aligner_core::run::{RunDir, data_files};
use aligner_core::score::pad_right;
use aligner_core::sft::{SftExample, load_sft_examples, trained_mask};
use aligner_core::start::{folder_and_grid, load_for_run, policy_store};
use aligner_core::train::{
    DataSection, EvalSum, ModelSection, Objective, RunSummary, StepOutput, TrainSection,
};
use aligner_core::{CausalLm, CoreError, Device, LlamaConfig, LoadedModel, TextTokenizer};
use aligner_gen::{Engine, EngineOptions, GenerationRequest, SamplingParams};
use aligner_loss::policy::{ImportanceRatio, LossAgg, PolicyLossOptions, logprob_mismatch, policy_loss};
use aligner_parallel::vocab::Vocabulary;
use burn::tensor::{Distribution, Int, Tensor};
use serde::{Deserialize, Serialize};

pub use top_k::{TeacherTopK, forward_kl_top_k, forward_kl_top_k_over};

/// What can stop a distillation run.
#[derive(Debug, thiserror::Error)]
pub enum DistillError {
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error(transparent)]
    Gen(#[from] aligner_gen::GenError),
    #[error(transparent)]
    Dpo(#[from] aligner_dpo::DpoError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = DistillError> = std::result::Result<T, E>;

/// How the student learns from the teacher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DistillMode {
    /// The forward KL from the teacher's distributions to the student's on the dataset's
    /// response tokens (teacher forcing), mixed with the data's NLL by `alpha`.
    #[default]
    Supervised,
    /// Generalized knowledge distillation (Agarwal et al., 2024; TRL's `GKDTrainer`): a
    /// fraction `lambda` of each batch is answered by the student itself (the engine, refit
    /// to its weights), the rest keeps the data's responses, and the loss is the generalized
    /// Jensen–Shannon divergence with `beta` (0 = forward KL, 1 = reverse KL) over the whole
    /// vocabulary at each response token.
    Gkd,
    /// On-policy distillation (NeMo-RL's and verl's): the student answers every prompt, the
    /// teacher scores the sampled tokens, and the per-token reverse KL `log π_S(y_t) − log
    /// π_T(y_t)` is minimised as a dense reward, by its policy gradient.
    OnPolicy,
}

/// `[distill]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistillSection {
    /// The teacher's HF folder; empty = the default `aligner dpo` run, trained first into
    /// `<run>/teacher`.
    pub teacher: Option<PathBuf>,
    pub mode: DistillMode,
    /// Weight of the data's NLL: `(1 − alpha) · τ² · KL + alpha · NLL` (0 = the teacher alone).
    pub alpha: f64,
    /// Softmax temperature τ of both distributions in the KL term (its gradients are scaled by
    /// τ², so the term keeps its size as τ changes).
    pub temperature: f64,
    /// `gkd`: the share of each batch the student answers itself (0 = supervised on the
    /// generalized JSD, 1 = on-policy).
    pub lambda: f64,
    /// `gkd`: the generalized JSD's interpolation (0 = forward KL, 1 = reverse KL).
    pub beta: f64,
    /// `gkd` / `on_policy`: the student's answers, at most this many tokens...
    pub max_new_tokens: usize,
    /// ... sampled at this temperature.
    pub sample_temperature: f32,
    /// Engine rows decoded together.
    pub slots: usize,
    /// `supervised`: learn from the teacher's `top_k` most likely next tokens (renormalised
    /// over them), computed once over the training data and cached in the run folder
    /// (`teacher_top_k_train.safetensors`, keyed by the teacher's weights, the data and these
    /// settings) instead of running the teacher every step; 0 = the whole vocabulary, the
    /// teacher every step. Validation always measures against the whole distribution.
    pub top_k: usize,
    /// λ in (0, 1]: the student learns the geometric mixture `p_start^(1−λ) · p_teacher^λ`
    /// (logits `λ·z_teacher + (1 − λ)·z_start`, the start model's) instead of the teacher
    /// itself (1). For a teacher aligned by DPO from the same start (`π_T ∝ π_start ·
    /// exp(r/β)`) the mixture is the policy DPO would reach at β/λ: λ < 1 buys most of the
    /// teacher's reward at a smaller KL to the start.
    pub teacher_weight: f64,
    /// `on_policy`, as `ppo.clip_eps`: the ratio `π / π_old` to the engine's (the behaviour
    /// policy's) log-probs may fall to `1 − clip_eps`...
    pub clip_eps: f64,
    /// ... and rise to `1 + clip_eps_high` (DAPO's clip-higher; empty = `clip_eps`).
    pub clip_eps_high: Option<f64>,
    /// `on_policy`, as `ppo.importance_ratio`: per token, or GSPO's per sequence.
    pub importance_ratio: ImportanceRatio,
    /// `on_policy`, as `ppo.loss_agg`: how the per-token losses of a batch are averaged.
    pub loss_agg: LossAgg,
    /// `on_policy`: the discount of later tokens' rewards in each token's advantage, `A_t =
    /// Σ_{k≥t} γ^(k−t) r_k` with `r_k = log π_T(y_k) − log π_old(y_k)`; 0 (NeMo-RL's and
    /// Tinker's choice) makes each token's advantage its own reward, 1 the reverse KL of the
    /// rest of the answer.
    pub gamma: f64,
}

impl DistillSection {
    /// `on_policy`'s settings of GRPO's clipped policy loss.
    pub fn policy_loss(&self) -> PolicyLossOptions {
        PolicyLossOptions {
            clip_low: self.clip_eps,
            clip_high: self.clip_eps_high.unwrap_or(self.clip_eps),
            ratio: self.importance_ratio,
            agg: self.loss_agg,
            max_tokens: self.max_new_tokens,
        }
    }
}

impl Default for DistillSection {
    fn default() -> Self {
        Self {
            teacher: None,
            mode: DistillMode::Supervised,
            alpha: 0.0,
            temperature: 1.0,
            lambda: 0.5,
            beta: 0.5,
            max_new_tokens: 48,
            sample_temperature: 1.0,
            slots: 64,
            top_k: 0,
            teacher_weight: 1.0,
            clip_eps: 0.2,
            clip_eps_high: None,
            importance_ratio: ImportanceRatio::Token,
            loss_agg: LossAgg::TokenMean,
            gamma: 0.0,
        }
    }
}

/// `aligner distill` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistillConfig {
    /// The student (LoRA when `lora_rank > 0`).
    pub model: ModelSection,
    /// Prompt/response or chat rows; the response tokens are distilled.
    pub data: DataSection,
    pub train: TrainSection,
    pub distill: DistillSection,
    /// The reward–KL figures of the student's own samples (KL to the start model) at every
    /// validation.
    pub frontier: aligner_gen::FrontierSection,
    /// Tensor groups (`parallel.tensor`): the student, the teacher (and the start model of a
    /// mixture target) split over each group, whose ranks compute the same rows together.
    pub parallel: aligner_core::train::ParallelSection,
}

impl Default for DistillConfig {
    /// The shipped model learns the default DPO run's distributions on the shipped SFT data.
    fn default() -> Self {
        Self {
            model: ModelSection::default(),
            data: DataSection::shipped("train.sft.jsonl", "test.sft.jsonl"),
            // Measured from the default DPO run (104 held-out prompts × 3): at lr 3e-4 every
            // mode ends nearer the teacher (reverse KL per token 0.006 supervised, 0.008 GKD,
            // 0.019 on-policy) than at 1e-3 (0.030, 0.028, 0.133), at the teacher's reward.
            train: TrainSection {
                lr: 3e-4,
                ..TrainSection::embedded_default(2)
            },
            distill: DistillSection::default(),
            frontier: aligner_gen::FrontierSection::shipped(),
            parallel: Default::default(),
        }
    }
}

/// Per-position forward KL from the teacher's next-token distribution to the student's, both
/// at temperature `temperature`: `Σ_v p_T(v) (log p_T(v) − log p_S(v))`, `[batch, seq, vocab]`
/// logits → `[batch, seq]`. Gradients flow into `student_logits` only when `teacher_logits`
/// carries none (the teacher is frozen).
pub fn forward_kl(teacher_logits: Tensor<3>, student_logits: Tensor<3>, temperature: f64) -> Tensor<2> {
    forward_kl_over(&Vocabulary::Whole, teacher_logits, student_logits, temperature)
}

/// [`forward_kl`] of logits over `vocabulary`: the whole vocabulary's, or in a tensor group
/// each rank's block of it (the sum over the vocabulary taken over the group).
pub fn forward_kl_over(
    vocabulary: &Vocabulary,
    teacher_logits: Tensor<3>,
    student_logits: Tensor<3>,
    temperature: f64,
) -> Tensor<2> {
    let [b, s, _] = student_logits.dims();
    let teacher = vocabulary.log_softmax(teacher_logits.div_scalar(temperature));
    let student = vocabulary.log_softmax(student_logits.div_scalar(temperature));
    vocabulary
        .sum(teacher.clone().exp() * (teacher - student))
        .reshape([b, s])
}

/// On-policy distillation's advantages of one answer's tokens: each token's reward is the
/// negative reverse KL of the token it sampled, `r_t = log π_T(y_t) − log π_old(y_t)` (the
/// engine's log-prob is the behaviour policy's), and `A_t = Σ_{k≥t} γ^(k−t) r_k`.
pub fn reverse_kl_advantages(behaviour: &[f32], teacher: &[f32], gamma: f64) -> Vec<f32> {
    let mut ahead = 0.0f64;
    let mut out: Vec<f32> = behaviour
        .iter()
        .zip(teacher)
        .rev()
        .map(|(&old, &t)| {
            ahead = (t - old) as f64 + gamma * ahead;
            ahead as f32
        })
        .collect();
    out.reverse();
    out
}

/// Per-position generalized Jensen–Shannon divergence (Agarwal et al.) at temperature
/// `temperature`, `[batch, seq]`: with `M = β p_T + (1 − β) p_S`,
/// `β KL(p_T ‖ M) + (1 − β) KL(p_S ‖ M)`; `β = 0` is the forward KL `KL(p_T ‖ p_S)` and `β = 1`
/// the reverse `KL(p_S ‖ p_T)` (the ends, where the mixture would make it vanish, as TRL's GKD
/// takes them).
pub fn generalized_jsd(
    teacher_logits: Tensor<3>,
    student_logits: Tensor<3>,
    beta: f64,
    temperature: f64,
) -> Tensor<2> {
    generalized_jsd_over(
        &Vocabulary::Whole,
        teacher_logits,
        student_logits,
        beta,
        temperature,
    )
}

/// [`generalized_jsd`] of logits over `vocabulary` (see [`forward_kl_over`]).
pub fn generalized_jsd_over(
    vocabulary: &Vocabulary,
    teacher_logits: Tensor<3>,
    student_logits: Tensor<3>,
    beta: f64,
    temperature: f64,
) -> Tensor<2> {
    if beta <= 0.0 {
        return forward_kl_over(vocabulary, teacher_logits, student_logits, temperature);
    }
    if beta >= 1.0 {
        return forward_kl_over(vocabulary, student_logits, teacher_logits, temperature);
    }
    let [b, s, _] = student_logits.dims();
    let teacher = vocabulary.log_softmax(teacher_logits.div_scalar(temperature));
    let student = vocabulary.log_softmax(student_logits.div_scalar(temperature));
    // log M, as a log-sum-exp of the two weighted log-probabilities.
    let (a, c) = (
        teacher.clone().add_scalar(beta.ln()),
        student.clone().add_scalar((1.0 - beta).ln()),
    );
    let top = a.clone().max_pair(c.clone());
    let mixture = top.clone() + ((a - top.clone()).exp() + (c - top).exp()).log();
    let kl_teacher = vocabulary.sum(teacher.clone().exp() * (teacher - mixture.clone()));
    let kl_student = vocabulary.sum(student.clone().exp() * (student - mixture));
    (kl_teacher.mul_scalar(beta) + kl_student.mul_scalar(1.0 - beta)).reshape([b, s])
}

/// Per-position reverse KL `Σ_v p_S(v) (log p_S(v) − log p_T(v))` (temperature 1): what the
/// student puts where the teacher does not, `[batch, seq]`.
pub fn reverse_kl(teacher_logits: Tensor<3>, student_logits: Tensor<3>) -> Tensor<2> {
    reverse_kl_over(&Vocabulary::Whole, teacher_logits, student_logits)
}

/// [`reverse_kl`] of logits over `vocabulary` (see [`forward_kl_over`]).
pub fn reverse_kl_over(
    vocabulary: &Vocabulary,
    teacher_logits: Tensor<3>,
    student_logits: Tensor<3>,
) -> Tensor<2> {
    forward_kl_over(vocabulary, student_logits, teacher_logits, 1.0)
}

/// The distillation objective on tokenized SFT examples: its mode's loss, with the student's
/// own answers drawn inside the step for `gkd` and `on_policy`.
pub struct DistillObjective {
    /// The frozen teacher (on the inference device; its logits move to the student's).
    pub teacher: CausalLm,
    /// With `distill.teacher_weight` λ < 1: the frozen start model and λ.
    pub start: Option<(CausalLm, f64)>,
    pub section: DistillSection,
    /// The logits compared: the first `vocab` of each model's (the smaller `vocab_size` of
    /// the two, which holds every token id of the shared tokenizer).
    pub vocab: usize,
    /// The student's configuration and tokenizer, for its generation engine.
    pub student: LlamaConfig,
    pub tokenizer: TextTokenizer,
    /// The engine the student answers with, made at its first use and refit each step.
    pub engine: RefCell<Option<Engine>>,
    /// `supervised` with `distill.top_k`: the teacher's cached top-k log-probs.
    pub top_k: Option<TeacherTopK>,
}

/// Positions per chunk when the target's distributions are compared with the student's: the
/// target's logits exist a chunk of rows at a time, so `[batch, seq, vocab]` logits never
/// exist for both models at once.
pub const CHUNK_POSITIONS: usize = 1024;

/// One of the student's own answers: the example it trains on (the prompt, then the answer's
/// tokens as the trained ones) and the engine's log-prob of each answer token.
struct Answer {
    example: SftExample,
    behaviour: Vec<f32>,
}

/// The values of `x` (`[batch, width − 1]`, position t predicting token t + 1) at each row's
/// trained tokens, in order.
fn answer_columns(x: Tensor<2>, rows: &[&SftExample]) -> Vec<Vec<f32>> {
    let [_, positions] = x.dims();
    let values: Vec<f32> = x.into_data().convert::<f32>().try_to_vec().unwrap_or_default();
    rows.iter()
        .enumerate()
        .map(|(i, e)| {
            (1..e.ids.len())
                .filter(|&t| e.trained[t])
                .map(|t| values[i * positions + t - 1])
                .collect()
        })
        .collect()
}

/// The inverse of [`answer_columns`]: each row's values at the positions predicting its
/// trained tokens, zero elsewhere, `[batch, width − 1]`.
fn placed(
    values: &[impl AsRef<[f32]>],
    rows: &[&SftExample],
    dims: [usize; 2],
    device: &Device,
) -> Tensor<2> {
    let [b, positions] = dims;
    let mut out = vec![0f32; b * positions];
    for (i, (e, row)) in rows.iter().zip(values).enumerate() {
        let targets = (1..e.ids.len()).filter(|&t| e.trained[t]);
        for (t, &v) in targets.zip(row.as_ref()) {
            out[i * positions + t - 1] = v;
        }
    }
    Tensor::from_data(burn::tensor::TensorData::new(out, [b, positions]), device)
}

/// A batch as the losses see it: the student's logits (`[batch, seq − 1, vocab]`, position t
/// predicting token t + 1), the target's hidden states (projected to logits a chunk at a
/// time), the tokens predicted and the distilled positions.
struct Logits {
    /// The teacher's and, for a mixture, the start model's last hidden states at the
    /// predicting positions (on the teacher's device); None when the step reads the cached
    /// top-k instead.
    target: Option<(Tensor<3>, Option<Tensor<3>>)>,
    /// The student's logits over `vocabulary`.
    student: Tensor<3>,
    /// The vocabulary the logits are over: the `vocab` both models share, or in a tensor
    /// group whose ranks hold the same blocks of both models' vocabulary, this rank's block.
    vocabulary: Vocabulary,
    targets: Tensor<2, Int>,
    mask: Tensor<2>,
    n: usize,
}

/// One chunk of rows: the target's logits and, for a mixture, the teacher's own (on the
/// student's device), the student's logits and the tokens they predict.
struct Chunk {
    target: Tensor<3>,
    teacher: Option<Tensor<3>>,
    student: Tensor<3>,
    vocabulary: Vocabulary,
    targets: Tensor<2, Int>,
}

impl Chunk {
    /// Log-probabilities of the predicted tokens under `logits`, `[rows, seq − 1]`.
    fn token_logprobs(&self, logits: Tensor<3>) -> Tensor<2> {
        token_logprobs(&self.vocabulary, logits, self.targets.clone())
    }
}

/// Log-probabilities of `targets` under `logits` over `vocabulary` (`[b, s, vocab]` →
/// `[b, s]`).
fn token_logprobs(vocabulary: &Vocabulary, logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<2> {
    let [b, s, _] = logits.dims();
    vocabulary
        .pick(vocabulary.log_softmax(logits), targets.reshape([b, s, 1]))
        .reshape([b, s])
}

impl Logits {
    /// Mean over the distilled positions.
    fn mean(&self, x: Tensor<2>) -> Tensor<1> {
        (x * self.mask.clone()).sum().div_scalar(self.n.max(1) as f64)
    }

    /// Sum over the distilled positions.
    fn sum(&self, x: Tensor<2>) -> f64 {
        (x * self.mask.clone()).sum().into_scalar::<f32>() as f64
    }

    /// Log-probabilities of the predicted tokens under the student, `[batch, seq − 1]`.
    fn student_logprobs(&self) -> Tensor<2> {
        token_logprobs(&self.vocabulary, self.student.clone(), self.targets.clone())
    }

    /// `measure` of each chunk of rows (`[rows, seq − 1]` per value), the chunks' values
    /// joined back into `[batch, seq − 1]`: the target's logits of a chunk are made from its
    /// hidden states and dropped before the next.
    fn per_position(
        &self,
        objective: &DistillObjective,
        measure: impl Fn(&Chunk) -> Vec<Tensor<2>>,
    ) -> Vec<Tensor<2>> {
        let [b, s, _] = self.student.dims();
        let (teacher, start) = self
            .target
            .as_ref()
            .expect("the target's hidden states are computed whenever its top-k cache is not used");
        let device = self.student.device();
        let rows = (CHUNK_POSITIONS / s.max(1)).max(1);
        let mut parts: Vec<Vec<Tensor<2>>> = Vec::new();
        for first in (0..b).step_by(rows) {
            let range = first..(first + rows).min(b);
            let hidden = |h: &Tensor<3>| {
                let [_, _, d] = h.dims();
                h.clone().slice([range.clone(), 0..s, 0..d])
            };
            let (target, alone) =
                objective.target_from_hidden(hidden(teacher), start.as_ref().map(hidden), &self.vocabulary);
            let chunk = Chunk {
                target: target.to_device(&device),
                teacher: alone.map(|t| t.to_device(&device)),
                student: self.student.clone().slice([range.clone(), 0..s]),
                vocabulary: self.vocabulary.clone(),
                targets: self.targets.clone().slice([range.clone(), 0..s]),
            };
            parts.push(measure(&chunk));
        }
        let count = parts.first().map_or(0, Vec::len);
        (0..count)
            .map(|i| Tensor::cat(parts.iter().map(|p| p[i].clone()).collect(), 0))
            .collect()
    }
}

impl DistillObjective {
    /// The target's logits of the teacher's (and the start model's) hidden states: the
    /// teacher's, or `λ·z_teacher + (1 − λ)·z_start`, with the teacher's own beside a mixture.
    /// Over `vocabulary` ([`DistillObjective::logits_over`]).
    fn target_from_hidden(
        &self,
        teacher: Tensor<3>,
        start: Option<Tensor<3>>,
        vocabulary: &Vocabulary,
    ) -> (Tensor<3>, Option<Tensor<3>>) {
        let teacher_logits = self.logits_over(&self.teacher, teacher, vocabulary);
        match (&self.start, start) {
            (Some((model, weight)), Some(hidden)) => {
                let start_logits = self.logits_over(model, hidden, vocabulary);
                let target =
                    teacher_logits.clone().mul_scalar(*weight) + start_logits.mul_scalar(1.0 - weight);
                (target, Some(teacher_logits))
            }
            _ => (teacher_logits, None),
        }
    }

    /// The teacher's (and the start model's) last hidden states at the predicting positions
    /// of `tokens` (`[batch, width − 1, d]`, on the teacher's device).
    fn target_hidden(&self, tokens: Tensor<2, Int>) -> (Tensor<3>, Option<Tensor<3>>) {
        let positions = aligner_core::model::default_positions(&tokens);
        let [b, width] = tokens.dims();
        let last = |h: Tensor<3>| {
            let [_, _, d] = h.dims();
            h.slice([0..b, 0..width - 1, 0..d])
        };
        let teacher = last(self.teacher.model.forward(tokens.clone(), &positions, None, None));
        let start = self
            .start
            .as_ref()
            .map(|(model, _)| last(model.model.forward(tokens, &positions, None, None)));
        (teacher, start)
    }

    /// The target's logits on `tokens` (`[batch, width − 1, vocab]`, on the teacher's device):
    /// the teacher's, or `λ·z_teacher + (1 − λ)·z_start`; with the teacher's own beside a
    /// mixture.
    pub fn target_logits(&self, tokens: Tensor<2, Int>) -> (Tensor<3>, Option<Tensor<3>>) {
        self.target_logits_over(tokens, &Vocabulary::Whole)
    }

    /// [`DistillObjective::target_logits`] over `vocabulary` ([`DistillObjective::vocabulary`]
    /// of the student): the whole shared vocabulary, or this rank's block of it.
    pub fn target_logits_over(
        &self,
        tokens: Tensor<2, Int>,
        vocabulary: &Vocabulary,
    ) -> (Tensor<3>, Option<Tensor<3>>) {
        let (teacher, start) = self.target_hidden(tokens);
        self.target_from_hidden(teacher, start, vocabulary)
    }

    /// `model`'s logits of `hidden` over `vocabulary`: this rank's block of it when it is
    /// split ([`DistillObjective::vocabulary`]), else the first `vocab` (the ids both models
    /// share) of the whole vocabulary's.
    fn logits_over(&self, model: &CausalLm, hidden: Tensor<3>, vocabulary: &Vocabulary) -> Tensor<3> {
        match vocabulary {
            Vocabulary::Split { .. } => model.own_logits_from_hidden(hidden).0,
            Vocabulary::Whole => {
                let logits = model.logits_from_hidden(hidden);
                let [b, s, _] = logits.dims();
                logits.slice([0..b, 0..s, 0..self.vocab])
            }
        }
    }

    /// The vocabulary the losses on `model` (the student) run over. Split across its tensor
    /// group when the student, the teacher and a mixture's start model hold the same block of
    /// one vocabulary, the `vocab` compared: each rank computes its block's logits alone, and
    /// no rank holds a whole row of the vocabulary (a teacher whose vocabulary is padded past
    /// the student's is read as its first rows, so it splits alike). Whole otherwise: one
    /// process, or a student whose vocabulary is padded past the teacher's, compared with
    /// the output projections gathered.
    pub fn vocabulary(&self, model: &CausalLm) -> Vocabulary {
        let block = |m: &CausalLm| {
            m.output_block()
                .map(|(_, split)| (split.own_range(), split.dims[split.axis], split.group))
        };
        let Some((range, whole, group)) = block(model) else {
            return Vocabulary::Whole;
        };
        let same = |m: &CausalLm| block(m).is_some_and(|(r, w, _)| r == range && w == whole);
        if whole == self.vocab && same(&self.teacher) && self.start.iter().all(|(m, _)| same(m)) {
            Vocabulary::Split { group, block: range }
        } else {
            Vocabulary::Whole
        }
    }

    /// The frozen target's hidden states (unless `with_teacher` is false) and the student's
    /// logits (on `model`'s device) on `batch`.
    fn logits(&self, model: &CausalLm, batch: &[&SftExample], with_teacher: bool) -> Logits {
        let device = model.model.embed_tokens.weight.device();
        let rows: Vec<&[u32]> = batch.iter().map(|e| e.ids.as_slice()).collect();
        let tokens = pad_right(&rows, 0, &device);
        let [b, width] = tokens.dims();
        let (mask, n) = trained_mask(batch, width, false, &device);
        let teacher_device = self.teacher.model.embed_tokens.weight.device();
        let target = with_teacher.then(|| self.target_hidden(tokens.clone().to_device(&teacher_device)));
        let valid = aligner_core::score::right_padding_valid(&rows);
        let vocabulary = self.vocabulary(model);
        let student = aligner_core::model::with_valid_tokens(valid, || {
            let positions = aligner_core::model::default_positions(&tokens);
            let hidden = model.model.forward(tokens.clone(), &positions, None, None);
            self.logits_over(model, hidden, &vocabulary)
        })
        .slice([0..b, 0..width - 1]);
        Logits {
            target,
            student,
            vocabulary,
            targets: tokens.slice([0..b, 1..width]),
            mask,
            n,
        }
    }

    /// The student's own answers to the prompts of `examples` (each example's tokens before
    /// its first trained one), drawn by the engine refit to `model`. The seeds come from the
    /// device's generator, which the loop seeds from `train.seed` and the step: a resumed run
    /// draws what the uninterrupted one did.
    fn answers(&self, model: &CausalLm, examples: &[&SftExample]) -> Result<Vec<Answer>> {
        if examples.is_empty() {
            return Ok(Vec::new());
        }
        let device = model.model.embed_tokens.weight.device();
        let draw = Tensor::<1>::random([1], Distribution::Uniform(0.0, 1.0), &device).into_scalar::<f32>();
        let base = (draw as f64 * u32::MAX as f64) as u64;
        let mut slot = self.engine.borrow_mut();
        let options = EngineOptions {
            slots: self.section.slots,
            ..EngineOptions::default()
        };
        let (engine, _) =
            Engine::refit_or_build(&mut slot, model, &self.student, Some(&self.tokenizer), options)?;
        let prompts: Vec<&[u32]> = examples
            .iter()
            .map(|e| {
                let start = e.trained.iter().position(|&t| t).unwrap_or(e.ids.len());
                &e.ids[..start.max(1)]
            })
            .collect();
        let requests: Vec<GenerationRequest> = prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                GenerationRequest::new(
                    prompt.to_vec(),
                    SamplingParams {
                        temperature: self.section.sample_temperature,
                        seed: base.wrapping_mul(1_000_003).wrapping_add(i as u64),
                        max_new_tokens: self.section.max_new_tokens,
                        ..SamplingParams::default()
                    },
                )
            })
            .collect();
        let outputs = engine.generate(&requests)?;
        Ok(prompts
            .iter()
            .zip(outputs)
            .map(|(prompt, out)| {
                let mut ids = prompt.to_vec();
                let mut trained = vec![false; ids.len()];
                ids.extend(&out.token_ids);
                trained.resize(ids.len(), true);
                Answer {
                    example: SftExample {
                        ids,
                        trained,
                        starts: Vec::new(),
                        end: Vec::new(),
                    },
                    behaviour: out.token_logprobs,
                }
            })
            .collect())
    }
}

impl Objective<CausalLm> for DistillObjective {
    type Example = SftExample;

    fn step(&self, model: &CausalLm, batch: &[&SftExample]) -> aligner_core::Result<StepOutput> {
        let section = &self.section;
        // The student answers the first `own` prompts of the batch itself.
        let own = match section.mode {
            DistillMode::Supervised => 0,
            DistillMode::Gkd => (section.lambda * batch.len() as f64).round() as usize,
            DistillMode::OnPolicy => batch.len(),
        };
        let answers = self
            .answers(model, &batch[..own])
            .map_err(|e| CoreError::Invalid(format!("the student's answers: {e}")))?;
        let rows: Vec<&SftExample> = answers
            .iter()
            .map(|a| &a.example)
            .chain(batch[own..].iter().copied())
            .collect();
        let cached = self
            .top_k
            .as_ref()
            .filter(|_| section.mode == DistillMode::Supervised);
        let l = self.logits(model, &rows, cached.is_none());
        let scalar = |x: Tensor<1>| x.into_scalar::<f32>() as f64;
        let t2 = section.temperature * section.temperature;
        let (loss, mut metrics) = match section.mode {
            DistillMode::Supervised => {
                let per_position = match cached {
                    Some(top) => {
                        let [_, positions, _] = l.student.dims();
                        let (ids, logprobs) = top
                            .batch(&rows, positions + 1, &l.mask.device())
                            .map_err(|e| CoreError::Invalid(e.to_string()))?;
                        forward_kl_top_k_over(
                            &l.vocabulary,
                            ids,
                            logprobs,
                            l.student.clone(),
                            section.temperature,
                        )
                    }
                    None => l
                        .per_position(self, |c| {
                            vec![forward_kl_over(
                                &c.vocabulary,
                                c.target.clone(),
                                c.student.clone(),
                                section.temperature,
                            )]
                        })
                        .remove(0),
                };
                let kl = l.mean(per_position);
                let nll = l.mean(l.student_logprobs().neg());
                let loss =
                    kl.clone().mul_scalar((1.0 - section.alpha) * t2) + nll.clone().mul_scalar(section.alpha);
                (
                    loss,
                    vec![("kl".to_string(), scalar(kl)), ("nll".into(), scalar(nll))],
                )
            }
            DistillMode::Gkd => {
                let jsd = l.mean(
                    l.per_position(self, |c| {
                        vec![generalized_jsd_over(
                            &c.vocabulary,
                            c.target.clone(),
                            c.student.clone(),
                            section.beta,
                            section.temperature,
                        )]
                    })
                    .remove(0),
                );
                (jsd.clone().mul_scalar(t2), vec![("jsd".to_string(), scalar(jsd))])
            }
            DistillMode::OnPolicy => {
                let student = l.student_logprobs();
                let teacher = l
                    .per_position(self, |c| vec![c.token_logprobs(c.target.clone())])
                    .remove(0);
                // The engine's log-probs of its own tokens are the behaviour policy: each
                // token's reward −(log π_old − log π_T) and the clipped ratio π / π_old are
                // GRPO's, so the update is a policy-gradient step on the reverse KL.
                let [b, positions] = student.dims();
                let device = student.device();
                let behaviour: Vec<&[f32]> = answers.iter().map(|a| a.behaviour.as_slice()).collect();
                let teacher_rows = answer_columns(teacher, &rows);
                let advantages: Vec<Vec<f32>> = behaviour
                    .iter()
                    .zip(&teacher_rows)
                    .map(|(old, teacher)| reverse_kl_advantages(old, teacher, section.gamma))
                    .collect();
                let old = placed(&behaviour, &rows, [b, positions], &device);
                let trainer_rows = answer_columns(student.clone().detach(), &rows);
                let out = policy_loss(
                    student,
                    old,
                    placed(&advantages, &rows, [b, positions], &device),
                    &l.mask,
                    &section.policy_loss(),
                );
                let mismatch = logprob_mismatch(&behaviour, &trainer_rows);
                let reverse_kl: f64 = behaviour
                    .iter()
                    .zip(&teacher_rows)
                    .flat_map(|(o, t)| o.iter().zip(t.iter()).map(|(o, t)| (o - t) as f64))
                    .sum::<f64>()
                    / l.n.max(1) as f64;
                (
                    out.loss,
                    vec![
                        ("reverse_kl".to_string(), reverse_kl),
                        ("clip_fraction".into(), out.clip_fraction),
                        ("logprob_mismatch".into(), mismatch.mean),
                        ("logprob_mismatch_max".into(), mismatch.max),
                    ],
                )
            }
        };
        if own > 0 {
            let tokens: usize = answers.iter().map(|a| a.example.n_trained()).sum();
            metrics.push(("own_answer_tokens".into(), tokens as f64 / own as f64));
        }
        Ok(StepOutput {
            loss,
            metrics,
            tokens: rows.iter().map(|e| e.ids.len()).sum(),
        })
    }

    /// Supervised: a mean over distilled tokens. With the student's own answers (whose
    /// lengths the data does not know) a mean over examples.
    fn loss_weight(&self, batch: &[&SftExample]) -> f64 {
        match self.section.mode {
            DistillMode::Supervised => batch.iter().map(|e| e.n_trained()).sum::<usize>() as f64,
            DistillMode::Gkd | DistillMode::OnPolicy => batch.len() as f64,
        }
    }

    /// On the held-out data's responses, per token: `kl` (forward, at the loss's
    /// temperature), `reverse_kl` (at 1), the student's `nll` of the data and, as `aligner
    /// sft` reports it, `nll_response` without the appended EOS (a teacher that never ends
    /// there teaches the student not to either).
    fn evaluate(&self, model: &CausalLm, batch: &[&SftExample]) -> aligner_core::Result<Vec<EvalSum>> {
        let l = self.logits(model, batch, true);
        let temperature = self.section.temperature;
        let mut measured = l.per_position(self, |c| {
            let vocabulary = &c.vocabulary;
            let mut values = vec![
                forward_kl_over(vocabulary, c.target.clone(), c.student.clone(), temperature),
                reverse_kl_over(vocabulary, c.target.clone(), c.student.clone()),
            ];
            if let Some(teacher) = &c.teacher {
                // With a mixture target: how far the student is from the teacher itself.
                values.push(reverse_kl_over(vocabulary, teacher.clone(), c.student.clone()));
            }
            values
        });
        let nll = l.student_logprobs().neg();
        let [_, positions] = l.mask.dims();
        let (response, n_response) = trained_mask(batch, positions + 1, true, &l.mask.device());
        let (forward, reverse) = (measured.remove(0), measured.remove(0));
        let mut named = vec![("kl", forward), ("reverse_kl", reverse), ("nll", nll.clone())];
        if let Some(teacher) = measured.pop() {
            named.push(("reverse_kl_teacher", teacher));
        }
        let mut sums: Vec<EvalSum> = named
            .into_iter()
            .map(|(name, x)| EvalSum {
                name: name.into(),
                sum: l.sum(x),
                weight: l.n as f64,
            })
            .collect();
        sums.push(EvalSum {
            name: "nll_response".into(),
            sum: (nll * response).sum().into_scalar::<f32>() as f64,
            weight: n_response as f64,
        });
        Ok(sums)
    }

    fn plot_keys(&self) -> Vec<String> {
        ["eval_kl", "eval_reverse_kl", "eval_nll"]
            .map(String::from)
            .to_vec()
    }
}

/// Refuses a teacher whose tokenizer is not the student's, naming both folders: the KL
/// compares distributions over the same token ids. Their `vocab_size`s may differ (a family's
/// sizes pad the same tokenizer differently: Qwen2.5-7B has 152,064 rows, 0.5B 151,936); the
/// loader has checked that every token id is below both.
pub fn check_same_tokenizer(teacher: &LoadedModel, student: &LoadedModel) -> Result<()> {
    const PROBE: &str = "Once upon a time, a little girl named Lily found a shiny key. 123 ünïcödé!";
    let differs = |why: String| {
        Err(DistillError::Invalid(format!(
            "distill.teacher {} and the student {} do not share a tokenizer ({why}): \
             distillation compares their distributions token by token",
            teacher.dir.display(),
            student.dir.display()
        )))
    };
    let (t, s) = (
        teacher.tokenizer.encode(PROBE, true)?,
        student.tokenizer.encode(PROBE, true)?,
    );
    if t != s || teacher.tokenizer.eos_ids() != student.tokenizer.eos_ids() {
        return differs("they encode the same text differently".into());
    }
    Ok(())
}

/// A distillation run: the student of `[model]` (LoRA when configured) learns the teacher's
/// distributions on `data.train`, validated on `data.validation`, into `run` (or continued
/// there when it is resumed).
pub fn train(config: &DistillConfig, run: &RunDir, device: &Device) -> Result<RunSummary> {
    let section = &config.distill;
    use aligner_core::train::{Range, check_values};
    check_values(&[
        ("distill.alpha", section.alpha, Range::Fraction),
        ("distill.temperature", section.temperature, Range::Positive),
    ])?;
    if !(section.teacher_weight > 0.0 && section.teacher_weight <= 1.0) {
        return Err(DistillError::Invalid(format!(
            "distill.teacher_weight = {}: must be in (0, 1] (1 = the teacher itself)",
            section.teacher_weight
        )));
    }
    check_values(&[
        ("distill.lambda", section.lambda, Range::Fraction),
        ("distill.beta", section.beta, Range::Fraction),
        (
            "distill.sample_temperature",
            section.sample_temperature.into(),
            Range::NonNegative,
        ),
    ])?;
    aligner_core::train::check_counts(&[
        ("distill.max_new_tokens", section.max_new_tokens),
        ("distill.slots", section.slots),
    ])?;
    let mode = serde_json::to_string(&section.mode).unwrap_or_default();
    if section.alpha > 0.0 && section.mode != DistillMode::Supervised {
        return Err(DistillError::Invalid(format!(
            "distill.alpha = {} mixes the data's NLL into supervised distillation; distill.mode = {mode} \
             trains on the student's own answers, whose NLL teaches nothing: leave it at 0",
            section.alpha
        )));
    }
    if section.top_k > 0 && section.mode != DistillMode::Supervised {
        return Err(DistillError::Invalid(format!(
            "distill.top_k = {} caches the teacher on the data's responses; distill.mode = {mode} \
             distils on the student's own answers, which change every step: leave it at 0",
            section.top_k
        )));
    }
    if section.mode == DistillMode::OnPolicy && section.temperature != 1.0 {
        return Err(DistillError::Invalid(format!(
            "distill.temperature = {} softens the KL over the vocabulary; distill.mode = \"on_policy\" \
             scores the sampled tokens themselves: leave it at 1 (distill.sample_temperature sets the \
             sampling's)",
            section.temperature
        )));
    }
    check_values(&[
        ("distill.clip_eps", section.clip_eps, Range::Positive),
        ("distill.gamma", section.gamma, Range::Fraction),
    ])?;
    if let Some(high) = section.clip_eps_high {
        check_values(&[("distill.clip_eps_high", high, Range::Positive)])?;
    }
    let unset = DistillSection::default();
    let policy_keys_set = section.clip_eps != unset.clip_eps
        || section.clip_eps_high.is_some()
        || section.importance_ratio != unset.importance_ratio
        || section.loss_agg != unset.loss_agg
        || section.gamma != unset.gamma;
    if section.mode != DistillMode::OnPolicy && policy_keys_set {
        return Err(DistillError::Invalid(format!(
            "distill.clip_eps, clip_eps_high, importance_ratio, loss_agg and gamma shape the policy \
             gradient of distill.mode = \"on_policy\"; distill.mode = {mode} learns the teacher's whole \
             distributions: leave them unset"
        )));
    }
    config.train.check()?;
    run.start_with_steps(config, &["teacher"])?;
    let teacher_dir = match &section.teacher {
        Some(dir) => dir.clone(),
        None => run.earlier_step("teacher", "config.json", |teacher_run| {
            let registry = aligner_dpo::LossRegistry::with_builtin();
            aligner_dpo::train(
                &aligner_dpo::objective::DpoConfig::default(),
                &registry,
                teacher_run,
                device,
            )
            .map(drop)
        })?,
    };
    // In tensor groups (formed here, once a default teacher is trained) each rank reads only
    // its blocks of the student and of the teacher, whose heads the groups must divide too
    // (refused by its loader, named here).
    // The teacher's weights carry the student's names: it takes ids of its own, read first.
    let (student_dir, grid) = folder_and_grid(&config.model, &config.parallel, run)?;
    let run = &grid;
    let in_teacher =
        |e: CoreError| DistillError::Invalid(format!("distill.teacher {}: {e}", teacher_dir.display()));
    // A teacher whose vocabulary is padded past the student's (Qwen2.5-7B's 152,064 rows
    // against 0.5B's 151,936) is read as its first rows, the ids the two share: the two then
    // split the vocabulary into the same blocks. The rows past them are ids the shared
    // tokenizer never makes, which the losses leave out anyway.
    let mut teacher = match run.tensor_group() {
        Some(group) => {
            let student_vocab = LlamaConfig::from_file(&student_dir.join("config.json"))?.vocab_size;
            LoadedModel::from_dir_split_first_rows(&teacher_dir, device, &group, student_vocab)
        }
        None => load_for_run(&teacher_dir, run, device),
    }
    .map_err(in_teacher)?;
    if run.tensor_group().is_some() {
        teacher.model = aligner_core::train::tensor::with_own_ids(teacher.model, 0x7eac_4e55_0000_0001);
    }
    let student = load_for_run(&student_dir, run, device)?.in_precision(config.model.dtype, device)?;
    check_same_tokenizer(&teacher, &student)?;
    let frontier = config
        .frontier
        .for_split_start_model(&student, &config.model, run, device)?;
    let max_len = config.data.max_len(&student.config)?;
    let (train, validation) =
        data_files(&config.data)?.load(|path, _| load_sft_examples(path, &student.tokenizer, max_len))?;
    // The start model, frozen, when the target mixes it in (taken before training moves it).
    let start = (section.teacher_weight < 1.0).then(|| (student.model.clone(), section.teacher_weight));
    let mut model = student.model;
    let store = policy_store(&mut model, &config.model, &student.config, &student.dir, device)?;
    tracing::info!(
        teacher = %teacher_dir.display(),
        train = train.len(),
        validation = validation.len(),
        "distillation"
    );
    let vocab = teacher.config.vocab_size.min(student.config.vocab_size);
    if section.top_k > vocab {
        return Err(DistillError::Invalid(format!(
            "distill.top_k = {} is more than the {vocab} tokens the two models share",
            section.top_k
        )));
    }
    let mut objective = DistillObjective {
        top_k: None,
        start,
        vocab,
        teacher: teacher.model,
        section: section.clone(),
        student: student.config.clone(),
        tokenizer: student.tokenizer.clone(),
        engine: RefCell::new(None),
    };
    if run.tensor_group().is_some() {
        let whole = match objective.vocabulary(&model) {
            Vocabulary::Split { .. } => "split across the tensor group",
            Vocabulary::Whole => "whole (the output projections gathered)",
        };
        tracing::info!(vocab, "distillation: the losses run over the vocabulary {whole}");
    }
    if section.top_k > 0 {
        let k = section.top_k;
        let mut key = aligner_core::cache::CacheKey::builder("distill-teacher-top-k")
            .weights(&objective.teacher)
            .value(&(
                k,
                section.temperature.to_bits(),
                vocab,
                section.teacher_weight.to_bits(),
            ));
        if let Some((start, _)) = &objective.start {
            key = key.weights(start);
        }
        let key = key
            .value(&train.iter().map(|e| e.ids.as_slice()).collect::<Vec<_>>())
            .finish();
        let file = run.join(top_k::TOP_K_FILE);
        let fresh = run.agree(&aligner_core::cache::is_fresh(&file, &key))?;
        let world = run.world();
        // Data rank 0 computes it: rank 0, or in tensor groups the writer's group together.
        let cache = TeacherTopK::load_or_compute(
            &file,
            fresh,
            run.comm().rank() == 0,
            run.is_writer(),
            &key,
            || Ok(world.barrier().map_err(CoreError::from)?),
            || {
                let device = objective.teacher.model.embed_tokens.weight.device();
                let vocabulary = objective.vocabulary(&model);
                TeacherTopK::compute(
                    |tokens| {
                        (
                            objective.target_logits_over(tokens, &vocabulary).0,
                            vocabulary.clone(),
                        )
                    },
                    &device,
                    &train,
                    k,
                    section.temperature,
                )
            },
        )?;
        objective.top_k = Some(cache);
    }
    Ok(aligner_core::train::fit_evaluated(
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
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    fn logits(values: &[f32], vocab: usize) -> Tensor<3> {
        Tensor::from_data(
            TensorData::new(values.to_vec(), [1, values.len() / vocab, vocab]),
            &Device::flex(),
        )
    }

    /// `softmax(x / tau)` in f64, by hand.
    fn softmax(x: &[f32], tau: f64) -> Vec<f64> {
        let z: f64 = x.iter().map(|&v| (v as f64 / tau).exp()).sum();
        x.iter().map(|&v| (v as f64 / tau).exp() / z).collect()
    }

    /// KL(p ‖ q) by hand for two 3-token distributions, at τ = 1 and τ = 2.
    #[test]
    fn forward_kl_by_hand() {
        let teacher = [2.0f32, 0.0, -1.0];
        let student = [0.5f32, 0.5, 0.0];
        let by_hand = |tau: f64| {
            let (p, q) = (softmax(&teacher, tau), softmax(&student, tau));
            p.iter().zip(&q).map(|(p, q)| p * (p / q).ln()).sum::<f64>()
        };
        for tau in [1.0, 2.0] {
            let kl = forward_kl(logits(&teacher, 3), logits(&student, 3), tau)
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            assert!(
                (kl[0] as f64 - by_hand(tau)).abs() < 1e-6,
                "{kl:?} against {}",
                by_hand(tau)
            );
        }
        // Zero for equal distributions (shifted logits), and the reverse is the swapped one.
        let same = forward_kl(logits(&teacher, 3), logits(&[3.0, 1.0, 0.0], 3), 1.0).into_scalar::<f32>();
        assert!(same.abs() < 1e-6, "{same}");
        let reverse = reverse_kl(logits(&teacher, 3), logits(&student, 3)).into_scalar::<f32>();
        let swapped = forward_kl(logits(&student, 3), logits(&teacher, 3), 1.0).into_scalar::<f32>();
        assert_eq!(reverse, swapped);
    }

    /// The top-k KL by hand: the teacher's two most likely of four tokens, renormalised,
    /// against the student's full softmax at τ = 2; with every token it is the forward KL.
    #[test]
    fn top_k_kl_by_hand_and_with_the_whole_vocabulary() {
        let teacher = [1.5f32, -0.5, 0.0, 0.7];
        let student = [0.2f32, 0.4, -1.0, 0.0];
        let tau = 2.0;
        let (p, q) = (softmax(&teacher, tau), softmax(&student, tau));
        let ids = |v: &[i64]| {
            Tensor::<3, Int>::from_data(TensorData::new(v.to_vec(), [1, 1, v.len()]), &Device::flex())
        };
        let teacher_logprobs = |ids: &[usize]| {
            logits(
                &ids.iter().map(|&i| p[i].ln() as f32).collect::<Vec<_>>(),
                ids.len(),
            )
        };
        // Tokens 0 and 3 are the teacher's top two.
        let z = p[0] + p[3];
        let want = [0, 3]
            .iter()
            .map(|&i| (p[i] / z) * ((p[i] / z) / q[i]).ln())
            .sum::<f64>();
        let got = forward_kl_top_k(ids(&[0, 3]), teacher_logprobs(&[0, 3]), logits(&student, 4), tau)
            .into_scalar::<f32>() as f64;
        assert!((got - want).abs() < 1e-6, "{got} against {want}");
        let all = forward_kl_top_k(
            ids(&[0, 1, 2, 3]),
            teacher_logprobs(&[0, 1, 2, 3]),
            logits(&student, 4),
            tau,
        )
        .into_scalar::<f32>();
        let full = forward_kl(logits(&teacher, 4), logits(&student, 4), tau).into_scalar::<f32>();
        assert!((all - full).abs() < 1e-6, "{all} against {full}");
    }

    /// The generalized JSD by hand at β = 0.3 and τ = 1.5; its ends are the forward and the
    /// reverse KL.
    #[test]
    fn generalized_jsd_by_hand_and_at_its_ends() {
        let teacher = [1.5f32, -0.5, 0.0, 0.7];
        let student = [0.2f32, 0.4, -1.0, 0.0];
        let (beta, tau) = (0.3, 1.5);
        let (p, q) = (softmax(&teacher, tau), softmax(&student, tau));
        let m: Vec<f64> = p
            .iter()
            .zip(&q)
            .map(|(p, q)| beta * p + (1.0 - beta) * q)
            .collect();
        let kl = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(a, b)| a * (a / b).ln()).sum::<f64>();
        let want = beta * kl(&p, &m) + (1.0 - beta) * kl(&q, &m);
        let got =
            generalized_jsd(logits(&teacher, 4), logits(&student, 4), beta, tau).into_scalar::<f32>() as f64;
        assert!((got - want).abs() < 1e-6, "{got} against {want}");
        let at = |beta: f64| {
            generalized_jsd(logits(&teacher, 4), logits(&student, 4), beta, tau).into_scalar::<f32>()
        };
        assert_eq!(
            at(0.0),
            forward_kl(logits(&teacher, 4), logits(&student, 4), tau).into_scalar::<f32>()
        );
        assert_eq!(
            at(1.0),
            forward_kl(logits(&student, 4), logits(&teacher, 4), tau).into_scalar::<f32>()
        );
        // Zero for one distribution, whatever β.
        let same = generalized_jsd(logits(&teacher, 4), logits(&teacher, 4), 0.5, 1.0).into_scalar::<f32>();
        assert!(same.abs() < 1e-6, "{same}");
    }

    /// `A_t = Σ_{k≥t} γ^(k−t) (log π_T − log π_old)` by hand at γ = 0, ½ and 1.
    #[test]
    fn reverse_kl_advantages_by_hand() {
        let old = [-1.0f32, -2.0, -0.5];
        let teacher = [-1.5f32, -1.0, -0.5];
        // Rewards −0.5, 1.0, 0.0.
        assert_eq!(reverse_kl_advantages(&old, &teacher, 0.0), vec![-0.5, 1.0, 0.0]);
        assert_eq!(reverse_kl_advantages(&old, &teacher, 0.5), vec![0.0, 1.0, 0.0]);
        assert_eq!(reverse_kl_advantages(&old, &teacher, 1.0), vec![0.5, 1.0, 0.0]);
        assert!(reverse_kl_advantages(&[], &[], 1.0).is_empty());
    }

    /// On-policy, GRPO's clipped loss with the reverse-KL advantages (γ = 0, token mean) has
    /// the gradient of the reverse KL's REINFORCE estimator `mean((log π_S − log π_T) · log
    /// π_S)`: at ratio 1 nothing is clipped and `∇ = −mean(A_t ∇ log π_S(y_t))`.
    #[test]
    fn on_policy_loss_is_the_reverse_kl_policy_gradient() {
        let device = Device::flex().autodiff();
        let student_logits = [0.3f32, -0.2, 0.9, 0.0, 1.2, -1.0, 0.4, 0.1, -0.3, 0.8, 0.2, -0.6];
        let teacher =
            Tensor::<2>::from_data(TensorData::new(vec![-1.2f32, -0.4, -2.0, -0.9], [2, 2]), &device);
        let targets = Tensor::<2, Int>::from_data(TensorData::new(vec![2i64, 0, 1, 2], [2, 2]), &device);
        let mask = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 1.0, 1.0, 0.0], [2, 2]), &device);
        let grad_of = |grpo: bool| {
            let logits = Tensor::<3>::from_data(TensorData::new(student_logits.to_vec(), [2, 2, 3]), &device)
                .require_grad();
            let lp = token_logprobs(&Vocabulary::Whole, logits.clone(), targets.clone());
            let loss = if grpo {
                let old = lp.clone().detach();
                let advantages = (teacher.clone() - old.clone()) * mask.clone();
                let options = DistillSection::default().policy_loss();
                policy_loss(lp, old, advantages, &mask, &options).loss
            } else {
                ((lp.clone().detach() - teacher.clone()) * lp * mask.clone())
                    .sum()
                    .div_scalar(3.0)
            };
            let grads = loss.backward();
            logits
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        };
        let (grpo, reinforce) = (grad_of(true), grad_of(false));
        assert!(grpo.iter().any(|g| g.abs() > 1e-3), "{grpo:?}");
        for (a, b) in grpo.iter().zip(&reinforce) {
            assert!((a - b).abs() < 1e-6, "{grpo:?} against {reinforce:?}");
        }
    }

    /// The answer tokens' columns of a `[batch, width − 1]` tensor and back.
    #[test]
    fn answer_columns_and_placed_invert_each_other() {
        let example = |ids: Vec<u32>, first: usize| SftExample {
            trained: (0..ids.len()).map(|t| t >= first).collect(),
            ids,
            starts: Vec::new(),
            end: Vec::new(),
        };
        let (a, b) = (example(vec![1, 5, 6, 7], 2), example(vec![1, 2, 3], 1));
        let rows = [&a, &b];
        let device = Device::flex();
        let x = Tensor::<2>::from_data(
            TensorData::new(vec![0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0], [2, 3]),
            &device,
        );
        let columns = answer_columns(x, &rows);
        assert_eq!(columns, vec![vec![1.0, 2.0], vec![3.0, 4.0]]);
        let back = placed(&columns, &rows, [2, 3], &device)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        assert_eq!(back, vec![0.0, 1.0, 2.0, 3.0, 4.0, 0.0]);
    }

    /// The gradient of the KL with respect to the student's logits is `(q − p) / τ` per
    /// position (softmax cross-entropy), checked against the analytic form.
    #[test]
    fn forward_kl_gradient_is_q_minus_p_over_tau() {
        let device = Device::flex().autodiff();
        let teacher = [1.0f32, -0.5, 0.25, 2.0];
        let student = [0.0f32, 0.3, -0.2, 0.1];
        let tau = 2.0;
        let t = Tensor::<3>::from_data(TensorData::new(teacher.to_vec(), [1, 1, 4]), &device);
        let s = Tensor::<3>::from_data(TensorData::new(student.to_vec(), [1, 1, 4]), &device).require_grad();
        let kl = forward_kl(t, s.clone(), tau).sum();
        let grads = kl.backward();
        let g = s.grad(&grads).unwrap().into_data().try_to_vec::<f32>().unwrap();
        let (p, q) = (softmax(&teacher, tau), softmax(&student, tau));
        for i in 0..4 {
            let want = (q[i] - p[i]) / tau;
            assert!((g[i] as f64 - want).abs() < 1e-6, "{i}: {} against {want}", g[i]);
        }
    }
}
