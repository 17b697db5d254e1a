//! The training loop every alignment method shares.
//!
//! A method supplies an [`Objective`] (a micro-batch of examples in, a loss and named metrics
//! out); [`Trainer`] owns the rest: data order, gradient accumulation, global-norm clipping,
//! AdamW with decoupled weight decay, the learning-rate schedule, validation, `metrics.jsonl`,
//! checkpoints written atomically, exact resume, a progress bar and the final plot.
//!
//! Data parallel: every rank of the run's process group walks the same global order and takes
//! its shard of each global batch (`train.batch_size` per rank). Each rank's loss is weighted
//! by its share of the batch's [`Objective::loss_weight`], and the gradients are summed across
//! ranks at one point per step (in [`Optimizer::step`]), so N ranks with batch b
//! train as one process with batch N·b: the same clipping (the norm of the reduced
//! gradients), schedule, validation (sharded, then summed) and metrics.

pub mod config;
pub mod driver;
pub mod full;
pub mod grads;
pub mod master;
pub mod metrics;
pub mod order;
pub mod schedule;
mod stream;
pub mod tensor;
pub mod tensorboard;

use std::path::Path;
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsAccumulator, ModuleOptimizer};
use burn::tensor::{Bytes, Device, Tensor};
use serde_json::{Map, Value};

pub use config::{
    BestMode, Checkpointing, ConfigChange, DataSection, ModelSection, MovedKey, ParallelSection, Range,
    Sharding, TrainSection, check_counts, check_new_tokens, check_template, check_tensor_heads, check_value,
    check_values, config_changes, load_config, load_config_moved, to_toml,
};
pub use driver::{
    BEST_DIR, CheckpointLayout, FINAL_STEP, FinalStep, LoopSettings, LoopState, Method, Optimizer,
    ReturnedModel, RunSummary, Stepped, check_layout, non_finite, optimizer_shard, run_loop,
};
pub use metrics::{MetricsLog, plot_metrics, plot_runs};
pub use order::{EpochOrder, mini_batches};
pub use schedule::{Schedule, learning_rate};

pub use crate::store::ModelStore;

use crate::error::{CoreError, Result};
use crate::model::recompute::{self, LayerRecompute};
use crate::run::RunDir;
use aligner_parallel::shard_range;

/// The file a trainer checkpoint writes last (its presence marks the checkpoint complete).
pub const TRAINER_STATE: &str = "trainer_state.json";

/// AdamW with decoupled weight decay and ε `epsilon` (`train.adam_epsilon`), as every
/// trainer of aligner uses it.
pub fn adamw(weight_decay: f64, epsilon: f64) -> ModuleOptimizer {
    AdamWConfig::new()
        .with_weight_decay(weight_decay as f32)
        .with_epsilon(epsilon as f32)
        .init()
}

/// Writes an optimiser's state (moments and step counts) to `path`.
pub fn save_optimizer(optim: &ModuleOptimizer, path: &Path) -> Result<()> {
    // Streamed, a tensor at a time, to a scratch file renamed into place: encoding the whole
    // state in memory first held it twice more (the 0.5B model's checkpoint at 16.9 GB).
    optim
        .save(path)
        .map_err(|e| CoreError::Invalid(format!("{}: optimizer state: {e:?}", path.display())))
}

/// `optim` with the state saved in `path` by [`save_optimizer`].
pub fn load_optimizer(optim: ModuleOptimizer, path: &Path) -> Result<ModuleOptimizer> {
    let bytes = std::fs::read(path).map_err(|e| CoreError::io(path, e))?;
    optim
        .from_bytes(Bytes::from_bytes_vec(bytes))
        .map_err(|e| CoreError::Invalid(format!("{}: optimizer state: {e:?}", path.display())))
}

/// A micro-batch's loss and what to log about it.
pub struct StepOutput {
    /// Scalar loss, mean over the micro-batch; gradients flow from it.
    pub loss: Tensor<1>,
    /// Named metrics of the micro-batch (averaged over the micro-batches of a step).
    pub metrics: Vec<(String, f64)>,
    /// Tokens processed (for tokens/s).
    pub tokens: usize,
}

/// `out` with a mixture of experts' load-balancing term (see
/// [`crate::model::with_router_loss`]) added to its loss and logged as `router_aux_loss`, as
/// transformers adds it.
pub fn with_router_term(mut out: StepOutput, router_loss: Option<Tensor<1>>) -> StepOutput {
    if let Some(term) = router_loss {
        let value = term.clone().into_scalar::<f32>() as f64;
        out.metrics.push(("router_aux_loss".into(), value));
        out.loss = out.loss + term;
    }
    out
}

/// A validation metric as a sum and a weight, so batches combine into an exact mean.
pub struct EvalSum {
    pub name: String,
    pub sum: f64,
    pub weight: f64,
}

/// What a method trains for.
pub trait Objective<M: Module> {
    type Example;

    /// Forward pass and loss of a micro-batch (on an autodiff device).
    fn step(&self, model: &M, batch: &[&Self::Example]) -> Result<StepOutput>;

    /// Validation sums of a batch (no gradients).
    fn evaluate(&self, model: &M, batch: &[&Self::Example]) -> Result<Vec<EvalSum>>;

    /// What a micro-batch's loss is the mean over (examples by default; SFT counts the trained
    /// tokens): data-parallel ranks weigh their gradients and metrics by their share of it, so
    /// that a batch split over ranks gives the loss of the whole batch.
    fn loss_weight(&self, batch: &[&Self::Example]) -> f64 {
        batch.len() as f64
    }

    /// Metrics drawn in the run's plot besides the loss.
    fn plot_keys(&self) -> Vec<String> {
        Vec::new()
    }

    /// Sums a loss needs over the whole micro-batch rather than one rank's shard of it (KTO's
    /// KL baseline z0, a mean over the batch): in a data-parallel run every rank computes them
    /// on its shard (an empty one too, giving the same number of zeros), they are summed over
    /// the ranks, and [`Objective::step_with_totals`] takes the totals. None by default.
    fn batch_sums(&self, _model: &M, _batch: &[&Self::Example]) -> Result<Vec<f64>> {
        Ok(Vec::new())
    }

    /// [`Objective::step`] given the whole micro-batch's [`Objective::batch_sums`] (only called
    /// in data-parallel runs, for objectives that have such sums).
    fn step_with_totals(&self, model: &M, batch: &[&Self::Example], _totals: &[f64]) -> Result<StepOutput> {
        self.step(model, batch)
    }
}

/// Figures a method measures on the model itself at every validation, beside its
/// objective's sums (the reward–KL frontier of the policy's own samples: aligner-gen's
/// `Frontier`). Only rank 0 measures them, the rank that writes the metrics.
pub trait ModelEval<M> {
    /// Named figures of `model` (logged as they are named, e.g. `eval_frontier/kl`).
    fn evaluate(&self, model: &M) -> Result<Map<String, Value>>;
}

/// A whole trainer run: `model` trained on `objective` over `data` (training and validation
/// examples) with `config`'s loop, into `run`; the summary out (the trained model is in
/// `final/`). Every method built on the shared trainer ends its run with this.
pub fn fit<M: Module + 'static, O: Objective<M>>(
    model: M,
    objective: &O,
    data: (&[O::Example], &[O::Example]),
    store: &dyn ModelStore<M>,
    config: &TrainSection,
    run: &RunDir,
    device: &Device,
) -> Result<RunSummary> {
    fit_evaluated(model, objective, data, store, config, run, device, None)
}

/// [`fit`] with the figures of `model_eval` logged at every validation.
#[allow(clippy::too_many_arguments)]
pub fn fit_evaluated<M: Module + 'static, O: Objective<M>>(
    model: M,
    objective: &O,
    data: (&[O::Example], &[O::Example]),
    store: &dyn ModelStore<M>,
    config: &TrainSection,
    run: &RunDir,
    device: &Device,
    model_eval: Option<&dyn ModelEval<M>>,
) -> Result<RunSummary> {
    let trainer = Trainer {
        config,
        objective,
        store,
        train: data.0,
        validation: data.1,
        run,
        device: device.clone(),
        model_eval,
    };
    trainer.train(model)
}

/// The element-wise sum of every rank's sums.
fn sum_elementwise(by_rank: Vec<Vec<f64>>) -> Vec<f64> {
    let mut total = vec![0.0; by_rank.first().map_or(0, Vec::len)];
    for sums in by_rank {
        for (t, v) in total.iter_mut().zip(sums) {
            *t += v;
        }
    }
    total
}

/// Position of an offline trainer's run, stored with each checkpoint.
pub type TrainerState = LoopState;

/// Runs an [`Objective`] over training examples.
pub struct Trainer<'a, M: Module, O: Objective<M>> {
    pub config: &'a TrainSection,
    pub objective: &'a O,
    pub store: &'a dyn ModelStore<M>,
    pub train: &'a [O::Example],
    pub validation: &'a [O::Example],
    /// The run folder: a new run, or one resumed from its newest checkpoint.
    pub run: &'a RunDir,
    /// The device training runs on (autodiff is enabled on it by the trainer).
    pub device: Device,
    /// Figures measured on the model at every validation besides the objective's.
    pub model_eval: Option<&'a dyn ModelEval<M>>,
}

impl<M: Module + 'static, O: Objective<M>> Trainer<'_, M, O> {
    /// Optimiser steps of the whole run.
    pub fn total_steps(&self) -> usize {
        self.config
            .total_steps(self.train.len(), self.run.comm().world_size())
    }

    /// Trains `model` (or, when the run is resumed, continues from its newest checkpoint),
    /// writing the run folder, and returns the summary. The trained model is saved in `final/`.
    pub fn train(&self, model: M) -> Result<RunSummary> {
        Ok(self.train_keeping(model, ReturnedModel::Nothing)?.1)
    }

    /// [`Trainer::train`], and the trained model back (gathered whole on every rank when the
    /// ranks hold it in parts: fully sharded or split over tensor groups).
    pub fn run(&self, model: M) -> Result<(M, RunSummary)> {
        self.run_returning(model, ReturnedModel::Whole)
    }

    /// [`Trainer::run`] with the model handed back as the ranks hold it: in tensor groups each
    /// rank's blocks, never gathered whole (what a caller that trains or generates with it
    /// again in the same groups takes).
    pub fn run_in_blocks(&self, model: M) -> Result<(M, RunSummary)> {
        self.run_returning(model, ReturnedModel::AsHeld)
    }

    fn run_returning(&self, model: M, returned: ReturnedModel) -> Result<(M, RunSummary)> {
        let (model, summary) = self.train_keeping(model, returned)?;
        let model =
            model.ok_or_else(|| CoreError::Invalid("the training loop handed back no model".into()))?;
        Ok((model, summary))
    }

    /// The shared loop on this trainer's step; the model back as `returns_model` asks.
    fn train_keeping(&self, model: M, returns_model: ReturnedModel) -> Result<(Option<M>, RunSummary)> {
        self.config.check()?;
        let total = self.total_steps();
        let train_device = self.config.autodiff_device(&self.device);
        let mut step = ObjectiveStep::new(
            self.config,
            self.objective,
            self.train,
            self.run,
            total,
            &train_device,
        )
        .validated_on(self.validation, self.model_eval)
        .model_eval_anywhere(self.run.agree(&self.model_eval.is_some())?);
        let settings = LoopSettings {
            returns_model,
            ..LoopSettings::from_train(self.config, total)
        };
        run_loop(&mut step, model, self.store, &settings, self.run, &train_device)
    }
}

/// An offline objective's step, as [`Trainer`] runs it in the shared loop (and `aligner bench`
/// times it): the step's micro-batches in the run's data order, each rank its shard of each,
/// their gradients accumulated, summed over ranks, then one optimizer step at the
/// schedule's learning rate.
pub struct ObjectiveStep<'a, M: Module, O: Objective<M>> {
    config: &'a TrainSection,
    objective: &'a O,
    train: &'a [O::Example],
    validation: &'a [O::Example],
    model_eval: Option<&'a dyn ModelEval<M>>,
    /// Whether some rank measures a `model_eval` (see [`ObjectiveStep::model_eval_anywhere`]).
    model_eval_anywhere: bool,
    run: &'a RunDir,
    /// The autodiff device the model trains on.
    device: Device,
    order: EpochOrder,
    /// Steps of the whole run (the schedule's length).
    total: usize,
    started: Instant,
    tokens_seen: usize,
}

impl<'a, M: Module, O: Objective<M>> ObjectiveStep<'a, M, O> {
    /// Steps over `train` with `config`'s batch, accumulation, order and schedule of `total`
    /// steps, on `run`'s ranks, for a model on the autodiff device `device`.
    pub fn new(
        config: &'a TrainSection,
        objective: &'a O,
        train: &'a [O::Example],
        run: &'a RunDir,
        total: usize,
        device: &Device,
    ) -> Self {
        Self {
            config,
            objective,
            train,
            validation: &[],
            model_eval: None,
            model_eval_anywhere: false,
            run,
            device: device.clone(),
            order: EpochOrder::new(train.len(), config.shuffle, config.seed),
            total,
            started: Instant::now(),
            tokens_seen: 0,
        }
    }

    /// Evaluates on `validation` (and `model_eval`'s figures) at the loop's evaluations.
    pub fn validated_on(
        mut self,
        validation: &'a [O::Example],
        model_eval: Option<&'a dyn ModelEval<M>>,
    ) -> Self {
        self.validation = validation;
        self.model_eval = model_eval;
        self.model_eval_anywhere = model_eval.is_some();
        self
    }

    /// Whether some rank measures `model_eval` (rank 0, where the others were given none):
    /// every rank then validates and takes part in gathering the model to it.
    pub fn model_eval_anywhere(mut self, anywhere: bool) -> Self {
        self.model_eval_anywhere = anywhere;
        self
    }
}

impl<M: Module, O: Objective<M>> Method<M> for ObjectiveStep<'_, M, O> {
    type Error = CoreError;

    fn step(&mut self, step: usize, model: M, optim: &mut Optimizer<'_>) -> Result<Stepped<M>> {
        let cfg = self.config;
        let comm = self.run.comm();
        let (rank, world) = (comm.rank(), comm.world_size());
        // Step randomness (dropout) depends only on the seed and the step.
        self.device.seed(cfg.seed.wrapping_add(step as u64));
        let accum = cfg.grad_accum.max(1);
        let global_batch = cfg.batch_size.max(1) * world;
        let mut accumulator = GradientsAccumulator::<M>::new();
        let mut loss_sum = 0.0;
        let mut tokens = 0usize;
        let mut metric_sums: Vec<(String, f64)> = Vec::new();
        let _recompute = LayerRecompute::arm(cfg.activation_checkpointing == Checkpointing::Layers);
        for micro in 0..accum {
            optim.begin_pass(&model, micro + 1 == accum)?;
            let indices = self.order.batch(step * accum + micro, global_batch);
            let shard = |r: usize| -> Vec<&O::Example> {
                indices[shard_range(indices.len(), r, world)]
                    .iter()
                    .map(|&i| &self.train[i])
                    .collect()
            };
            let batch = shard(rank);
            // This rank's share of what the whole micro-batch's loss is a mean over.
            let share = if world == 1 {
                1.0
            } else {
                let total: f64 = (0..world).map(|r| self.objective.loss_weight(&shard(r))).sum();
                self.objective.loss_weight(&batch) / total.max(1e-12)
            };
            // Every rank takes part, its shard empty or not, so the sum is never waited for
            // in vain.
            let totals = match world {
                1 => Vec::new(),
                _ => {
                    let mine = self.objective.batch_sums(&model, &batch)?;
                    match mine.is_empty() {
                        true => mine,
                        false => sum_elementwise(crate::parallel::gather(comm, &mine)?),
                    }
                }
            };
            // Fully sharded, each pass gathers and reduce-scatters with the other ranks': a rank
            // whose shard is empty still runs one, on the micro-batch's first example, at
            // weight 0 (its `share`), adding nothing.
            let idle = batch.is_empty();
            let batch = match idle && optim.full() {
                true => vec![&self.train[indices[0]]],
                false if idle => continue,
                false => batch,
            };
            let (out, router_loss) = crate::model::with_router_loss(|| match totals.is_empty() {
                true => self.objective.step(&model, &batch),
                false => self.objective.step_with_totals(&model, &batch, &totals),
            });
            let out = with_router_term(out?, router_loss);
            let loss_value = out.loss.clone().into_scalar::<f32>() as f64;
            if world == 1 && !loss_value.is_finite() {
                return Err(non_finite(self.run, "loss", loss_value, step, TRAINER_STATE));
            }
            loss_sum += share * loss_value;
            if !idle {
                tokens += out.tokens;
            }
            for (name, v) in out.metrics {
                match metric_sums.iter_mut().find(|m| m.0 == name) {
                    Some(m) => m.1 += share * v,
                    None => metric_sums.push((name, share * v)),
                }
            }
            let mut loss = out.loss.div_scalar(accum as f64);
            if world > 1 {
                loss = loss.mul_scalar(share);
            }
            accumulator.accumulate(&model, recompute::gradients(loss, &model));
        }
        let grads = accumulator.grads();
        if world > 1 {
            // The step's loss and metrics, gathered first (so every rank stops together on a
            // non-finite loss); the optimizer's step then sums the gradients.
            let all = crate::parallel::gather(comm, &(loss_sum, tokens, metric_sums))?;
            loss_sum = all.iter().map(|s| s.0).sum();
            tokens = all.iter().map(|s| s.1).sum();
            metric_sums = sum_metrics_by_name(all.into_iter().map(|s| s.2));
            if !loss_sum.is_finite() {
                return Err(non_finite(self.run, "loss", loss_sum, step, TRAINER_STATE));
            }
        }
        let lr = learning_rate(cfg.schedule, cfg.lr, step, cfg.warmup_steps, self.total);
        let (model, grad_norm) = optim.step(lr, model, grads)?;
        self.tokens_seen += tokens;
        let loss = loss_sum / accum as f64;
        let tokens_per_s = self.tokens_seen as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
        let mut row = Map::new();
        row.insert("loss".into(), loss.into());
        row.insert("lr".into(), lr.into());
        row.insert("grad_norm".into(), grad_norm.into());
        for (name, v) in &metric_sums {
            row.insert(name.clone(), (v / accum as f64).into());
        }
        Ok(Stepped {
            model,
            row,
            message: format!("loss {loss:.4} · {tokens_per_s:.0} tok/s"),
        })
    }

    fn shards_fully(&self) -> bool {
        true
    }

    fn splits_tensors(&self) -> bool {
        true
    }

    /// The objective's sums run on the model in parts; the frontier's samples on the whole
    /// model gathered to the writer alone.
    fn evaluates_in_parts(&self) -> bool {
        true
    }

    fn validates(&self) -> bool {
        !self.validation.is_empty() || self.model_eval_anywhere
    }

    /// The objective's validation sums over the validation examples (sharded over the
    /// ranks, then summed), as means, and `model_eval`'s figures (rank 0).
    fn evaluate(&mut self, model: &M) -> Result<Map<String, Value>> {
        let model = model.valid();
        let limit = match self.config.eval_examples {
            0 => self.validation.len(),
            n => n.min(self.validation.len()),
        };
        let comm = self.run.comm();
        let (rank, world) = (comm.rank(), comm.world_size());
        let mut totals: Vec<(String, f64, f64)> = Vec::new();
        let refs: Vec<&O::Example> = self.validation[..limit].iter().collect();
        // Batches go to the ranks in turn; the sums are added up across ranks. Fully sharded,
        // each pass is a collective: a rank short of a batch in the last round evaluates the
        // first one again and discards its sums, so every rank runs as many passes.
        let batches: Vec<&[&O::Example]> = refs.chunks(self.config.batch_size.max(1)).collect();
        let full = world > 1 && self.config.sharding == config::Sharding::Full;
        let split = self.run.tensor_group().is_some();
        for round in 0..batches.len().div_ceil(world) {
            let Some(batch) = batches.get(round * world + rank) else {
                if full {
                    self.objective.evaluate(&model, batches[0])?;
                }
                continue;
            };
            for s in self.objective.evaluate(&model, batch)? {
                match totals.iter_mut().find(|t| t.0 == s.name) {
                    Some(t) => {
                        t.1 += s.sum;
                        t.2 += s.weight;
                    }
                    None => totals.push((s.name, s.sum, s.weight)),
                }
            }
        }
        if world > 1 {
            totals = sum_by_name(crate::parallel::gather(comm, &totals)?);
        }
        let mut out: Map<String, Value> = totals
            .into_iter()
            .map(|(name, sum, weight)| (format!("eval_{name}"), Value::from(sum / weight.max(1e-12))))
            .collect();
        // Rank 0 of the world (not of each tensor index's data-parallel ranks) measures them,
        // on the whole model: gathered to it alone when the ranks hold it in parts.
        if self.model_eval_anywhere {
            let whole = stream::SaveParts::of(self.run, full, split).whole_on_writer(&model, self.run);
            if let (Some(whole), Some(extra)) = (whole, self.model_eval) {
                out.extend(extra.evaluate(&whole)?);
            }
        }
        Ok(out)
    }

    fn plot_keys(&self) -> Vec<String> {
        let mut keys = vec!["loss".to_string()];
        keys.extend(self.objective.plot_keys());
        keys
    }
}

/// Named metrics of several ranks (each a share of the whole batch's) added up by name, in
/// order of first appearance.
pub fn sum_metrics_by_name(parts: impl IntoIterator<Item = Vec<(String, f64)>>) -> Vec<(String, f64)> {
    let triples = parts
        .into_iter()
        .map(|part| part.into_iter().map(|(name, v)| (name, v, 0.0)).collect())
        .collect();
    sum_by_name(triples)
        .into_iter()
        .map(|(name, v, _)| (name, v))
        .collect()
}

/// `(name, sum, weight)` triples of several ranks added up by name, in order of first
/// appearance.
fn sum_by_name(parts: Vec<Vec<(String, f64, f64)>>) -> Vec<(String, f64, f64)> {
    let mut out: Vec<(String, f64, f64)> = Vec::new();
    for (name, sum, weight) in parts.into_iter().flatten() {
        match out.iter_mut().find(|t| t.0 == name) {
            Some(t) => {
                t.1 += sum;
                t.2 += weight;
            }
            None => out.push((name, sum, weight)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_add_up_by_name() {
        let parts = vec![
            vec![("nll".to_string(), 3.0, 2.0)],
            vec![],
            vec![("acc".to_string(), 1.0, 1.0), ("nll".to_string(), 1.0, 2.0)],
        ];
        assert_eq!(
            sum_by_name(parts),
            vec![("nll".to_string(), 4.0, 4.0), ("acc".to_string(), 1.0, 1.0)]
        );
    }
}
