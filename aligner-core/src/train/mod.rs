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
//! ranks at one point per step ([`grads::all_reduce_gradients`]), so N ranks with batch b
//! train as one process with batch N·b: the same clipping (the norm of the reduced
//! gradients), schedule, validation (sharded, then summed) and metrics.

pub mod config;
pub mod grads;
pub mod master;
pub mod metrics;
pub mod order;
pub mod schedule;
pub mod tensorboard;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::{Bytes, Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use config::{
    BestMode, ConfigChange, DataSection, ModelSection, Range, TrainSection, check_counts, check_new_tokens,
    check_value, check_values, config_changes, load_config, to_toml,
};
pub use metrics::{MetricsLog, plot_metrics, plot_runs};
pub use order::{EpochOrder, mini_batches};
pub use schedule::{Schedule, learning_rate};

pub use crate::store::ModelStore;

use crate::error::{CoreError, Result};
use crate::run::{RunDir, progress_bar};
use aligner_parallel::shard_range;

/// The file a trainer checkpoint writes last (its presence marks the checkpoint complete).
pub const TRAINER_STATE: &str = "trainer_state.json";

/// AdamW with decoupled weight decay, as every trainer of aligner uses it.
pub fn adamw(weight_decay: f64) -> ModuleOptimizer {
    AdamWConfig::new()
        .with_weight_decay(weight_decay as f32)
        .with_epsilon(1e-8)
        .init()
}

/// Writes an optimiser's state (moments and step counts) to `path`.
pub fn save_optimizer(optim: &ModuleOptimizer, path: &Path) -> Result<()> {
    let bytes = optim
        .into_bytes()
        .map_err(|e| CoreError::Invalid(format!("optimizer state: {e:?}")))?;
    crate::checkpoint::write_atomic(path, &bytes)
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
    Ok(trainer.run(model)?.1)
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

/// Position of a run, stored with each checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimiser steps completed.
    pub step: usize,
    pub total_steps: usize,
    /// The seed the data order and step randomness derive from.
    pub seed: u64,
    /// Ranks the optimiser state was sharded over (`optimizer-rank-R.bin`); 0 = one
    /// `optimizer.bin`.
    #[serde(default)]
    pub optimizer_shards: usize,
}

/// The end of a run.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub steps: usize,
    pub final_dir: PathBuf,
    /// Validation metrics before training (absent when resumed) and at the end.
    pub initial_eval: Option<Map<String, Value>>,
    pub final_eval: Map<String, Value>,
}

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
    /// Examples per micro-batch over all ranks.
    fn global_batch(&self) -> usize {
        self.config.batch_size.max(1) * self.run.comm().world_size()
    }

    /// Optimiser steps of the whole run.
    pub fn total_steps(&self) -> usize {
        if self.config.max_steps > 0 {
            self.config.max_steps
        } else {
            let per_epoch = self.train.len().div_ceil(self.global_batch());
            (per_epoch * self.config.epochs.max(1)).div_ceil(self.config.grad_accum.max(1))
        }
    }

    fn evaluate(&self, model: &M) -> Result<Map<String, Value>> {
        let model = model.valid();
        let limit = match self.config.eval_examples {
            0 => self.validation.len(),
            n => n.min(self.validation.len()),
        };
        let comm = self.run.comm();
        let (rank, world) = (comm.rank(), comm.world_size());
        let mut totals: Vec<(String, f64, f64)> = Vec::new();
        let refs: Vec<&O::Example> = self.validation[..limit].iter().collect();
        // Batches go to the ranks in turn; the sums are added up across ranks.
        for (k, batch) in refs.chunks(self.config.batch_size.max(1)).enumerate() {
            if k % world != rank {
                continue;
            }
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
        if let Some(extra) = self.model_eval.filter(|_| rank == 0) {
            out.extend(extra.evaluate(&model)?);
        }
        Ok(out)
    }

    /// Whether there is anything to validate.
    fn validates(&self) -> bool {
        !self.validation.is_empty() || self.model_eval.is_some()
    }

    fn save_checkpoint(&self, model: &M, optim: &ModuleOptimizer, state: &TrainerState) -> Result<()> {
        // A sharded optimiser's state comes to rank 0 from every rank.
        let shards = if state.optimizer_shards > 0 {
            let bytes = optim
                .into_bytes()
                .map_err(|e| CoreError::Invalid(format!("optimizer state: {e:?}")))?;
            self.run.comm().all_gather(&bytes)?
        } else {
            Vec::new()
        };
        self.run.save_checkpoint(state.step, |tmp| {
            // A half-precision model folder rounds the weights; training resumes from the
            // master weights saved beside it.
            master::save_with_masters(self.store, &model.valid(), tmp)?;
            if shards.is_empty() {
                save_optimizer(optim, &tmp.join("optimizer.bin"))?;
            }
            for (rank, bytes) in shards.iter().enumerate() {
                crate::checkpoint::write_atomic(&tmp.join(optimizer_shard(rank)), bytes)?;
            }
            crate::checkpoint::write_json(&tmp.join(TRAINER_STATE), state)
        })?;
        Ok(())
    }

    /// Every rank's weights checksum against rank 0's after `step`.
    fn check_in_sync(&self, model: &M, step: usize) -> Result<()> {
        let sums = crate::parallel::gather(self.run.comm(), &grads::weights_checksum(model))?;
        if let Some(rank) = first_out_of_sync(&sums) {
            return Err(CoreError::Invalid(format!(
                "data parallel: rank {rank}'s weights differ from rank 0's after step {step} \
                 (checksums {:?} and {:?}); the ranks no longer train one model",
                sums[rank], sums[0]
            )));
        }
        Ok(())
    }

    /// Trains `model` (or, when the run is resumed, continues from its newest checkpoint),
    /// writing the run folder, and returns the summary. The trained model is saved in `final/`.
    pub fn run(&self, model: M) -> Result<(M, RunSummary)> {
        self.config.check()?;
        let total = self.total_steps();
        let cfg = self.config;
        let comm = self.run.comm();
        let (rank, world) = (comm.rank(), comm.world_size());
        let shards = if cfg.shard_optimizer && world > 1 {
            world
        } else {
            0
        };
        let train_device = cfg.autodiff_device(&self.device);
        let mut optim = adamw(cfg.weight_decay);
        self.run.prepare_checkpoints()?;
        let (mut model, start) = match self.run.resume_point(TRAINER_STATE)? {
            Some((step, dir)) => {
                let model = master::load_with_masters(self.store, &dir, &train_device)?.train();
                let state: TrainerState = crate::checkpoint::read_json(&dir.join(TRAINER_STATE))?;
                if state.optimizer_shards != shards {
                    return Err(CoreError::Invalid(format!(
                        "--resume: {} holds the optimizer sharded over {} ranks, this run has {} \
                         (train.shard_optimizer = {}, {world} ranks): resume with the same setting and world size",
                        dir.display(),
                        state.optimizer_shards,
                        shards,
                        cfg.shard_optimizer
                    )));
                }
                let file = if shards > 0 {
                    optimizer_shard(rank)
                } else {
                    "optimizer.bin".into()
                };
                optim = load_optimizer(optim, &dir.join(file))?;
                tracing::info!(step, dir = %dir.display(), "resuming");
                (model, step)
            }
            None => (model.fork(&train_device).train(), 0),
        };
        let owners = (shards > 0).then(|| grads::optimizer_owners(&model, world));
        let log = MetricsLog::for_run_with_tensorboard(
            self.run,
            self.run.is_resumed().then_some(start),
            cfg.tensorboard,
        )?;
        let initial_eval = if start == 0 && self.validates() {
            let eval = self.evaluate(&model)?;
            let mut row = Map::new();
            row.insert("step".into(), 0.into());
            row.extend(eval.clone());
            log.write(&row)?;
            self.keep_if_best(&model, 0, &eval)?;
            // As metrics.jsonl holds it (and `final_eval` is read from there): text summaries
            // go to TensorBoard only.
            Some(
                eval.into_iter()
                    .filter(|(k, _)| !k.starts_with(metrics::TEXT_PREFIX))
                    .collect(),
            )
        } else {
            None
        };

        let bar = progress_bar(
            total as u64,
            "step {pos}/{len} {bar:30} {msg} [{elapsed} < {eta}]",
        );
        bar.set_position(start as u64);
        let started = Instant::now();
        let mut tokens_seen = 0usize;
        let accum = cfg.grad_accum.max(1);
        let mut order = EpochOrder::new(self.train.len(), cfg.shuffle, cfg.seed);
        let global_batch = self.global_batch();
        for step in start..total {
            if self.run.stops_at(step) {
                bar.abandon();
                return Ok((model, self.summary(step, initial_eval, Map::new())));
            }
            // Step randomness (dropout) depends only on the seed and the step.
            train_device.seed(cfg.seed.wrapping_add(step as u64));
            let mut accumulator = GradientsAccumulator::<M>::new();
            let mut loss_sum = 0.0;
            let mut metric_sums: Vec<(String, f64)> = Vec::new();
            for micro in 0..accum {
                let indices = order.batch(step * accum + micro, global_batch);
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
                if batch.is_empty() {
                    continue;
                }
                let out = match totals.is_empty() {
                    true => self.objective.step(&model, &batch)?,
                    false => self.objective.step_with_totals(&model, &batch, &totals)?,
                };
                let loss_value = out.loss.clone().into_scalar::<f32>() as f64;
                if world == 1 && !loss_value.is_finite() {
                    bar.abandon();
                    return Err(self.non_finite(loss_value, step));
                }
                loss_sum += share * loss_value;
                tokens_seen += out.tokens;
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
                accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
            }
            let mut grads = accumulator.grads();
            if world > 1 {
                // The one synchronisation point of a step: gradients, then the step's loss and
                // metrics (so every rank stops together on a non-finite loss).
                grads::all_reduce_gradients(&model, &mut grads, 1.0, comm)?;
                let step_sums = (loss_sum, tokens_seen, metric_sums);
                let all = crate::parallel::gather(comm, &step_sums)?;
                loss_sum = all.iter().map(|s| s.0).sum();
                tokens_seen = all.iter().map(|s| s.1).sum();
                let by_rank: Vec<Vec<(String, f64, f64)>> = all
                    .into_iter()
                    .map(|s| s.2.into_iter().map(|(name, v)| (name, v, 0.0)).collect())
                    .collect();
                metric_sums = sum_by_name(by_rank)
                    .into_iter()
                    .map(|(name, v, _)| (name, v))
                    .collect();
                if !loss_sum.is_finite() {
                    bar.abandon();
                    return Err(self.non_finite(loss_sum, step));
                }
            }
            let grad_norm = grads::clip_grad_norm(&model, &mut grads, cfg.max_grad_norm);
            let lr = learning_rate(cfg.schedule, cfg.lr, step, cfg.warmup_steps, total);
            model = match &owners {
                None => optim.step(lr, model, grads),
                Some(owners) => {
                    // ZeRO stage 1: each rank updates (and keeps moments for) its parameters.
                    grads::keep_owned_gradients(&model, &mut grads, owners, rank);
                    let updated = optim.step(lr, model, grads);
                    grads::broadcast_owned_parameters(updated, owners, comm)?
                }
            };
            if world > 1
                && (step + 1 == total || (cfg.sync_check_every > 0 && (step + 1) % cfg.sync_check_every == 0))
            {
                self.check_in_sync(&model, step + 1)?;
            }

            let done = step + 1;
            let loss = loss_sum / accum as f64;
            let tokens_per_s = tokens_seen as f64 / started.elapsed().as_secs_f64().max(1e-9);
            bar.set_position(done as u64);
            bar.set_message(format!("loss {loss:.4} · {tokens_per_s:.0} tok/s"));
            let eval_now =
                self.validates() && (done == total || (cfg.eval_every > 0 && done % cfg.eval_every == 0));
            if done % cfg.log_every.max(1) == 0 || eval_now || done == total {
                let mut row = Map::new();
                row.insert("step".into(), done.into());
                row.insert("loss".into(), loss.into());
                row.insert("lr".into(), lr.into());
                row.insert("grad_norm".into(), grad_norm.into());
                for (name, v) in &metric_sums {
                    row.insert(name.clone(), (v / accum as f64).into());
                }
                if eval_now {
                    let eval = self.evaluate(&model)?;
                    self.keep_if_best(&model, done, &eval)?;
                    row.extend(eval);
                }
                log.write(&row)?;
            }
            if cfg.save_every > 0 && done % cfg.save_every == 0 && done < total {
                let state = TrainerState {
                    step: done,
                    total_steps: total,
                    seed: cfg.seed,
                    optimizer_shards: shards,
                };
                self.save_checkpoint(&model, &optim, &state)?;
            }
        }
        bar.finish_and_clear();
        let mut keys = vec!["loss".to_string()];
        keys.extend(self.objective.plot_keys());
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut final_eval = Map::new();
        self.run.write_shared(|| {
            let rows = log.rows()?;
            final_eval = last_eval(&rows);
            match self.best()? {
                Some(best) => {
                    // `final/` is the best validation's model, and says so.
                    let kept = self.store.load(&self.run.join(BEST_DIR), &self.device)?;
                    self.store.save(&kept, &self.run.final_dir())?;
                    crate::checkpoint::write_json(&self.run.join(FINAL_STEP), &best)?;
                    tracing::info!(step = best.step, metric = %best.metric, value = best.value, "final/ is the best validation's model");
                    if let Some(row) = rows.iter().find(|r| r.get("step").and_then(Value::as_u64) == Some(best.step as u64)) {
                        final_eval = last_eval(std::slice::from_ref(row));
                    }
                }
                None => {
                    self.store.save(&model.valid(), &self.run.final_dir())?;
                    let last = serde_json::json!({ "step": total });
                    crate::checkpoint::write_json(&self.run.join(FINAL_STEP), &last)?;
                }
            }
            plot_metrics(&rows, &key_refs, &self.run.join("metrics.svg"))
        })?;
        let final_eval = self.run.agree(&final_eval)?;
        Ok((model, self.summary(total, initial_eval, final_eval)))
    }

    /// The best validation kept so far (`best/best.json`), when `train.keep_best` is set.
    fn best(&self) -> Result<Option<FinalStep>> {
        if self.config.keep_best.is_none() {
            return Ok(None);
        }
        let path = self.run.join(BEST_DIR).join(BEST_FILE);
        match path.exists() {
            true => Ok(Some(crate::checkpoint::read_json(&path)?)),
            false => Ok(None),
        }
    }

    /// Saves `model` as `best/` when its validation `eval` improves on the kept one by
    /// `train.keep_best` (written to a temporary folder, then renamed over the old one).
    fn keep_if_best(&self, model: &M, step: usize, eval: &Map<String, Value>) -> Result<()> {
        let Some(key) = &self.config.keep_best else {
            return Ok(());
        };
        self.run.write_shared(|| {
            let value = eval.get(key).and_then(Value::as_f64).ok_or_else(|| {
                let known: Vec<&str> = eval.keys().map(String::as_str).collect();
                CoreError::Invalid(format!(
                    "train.keep_best = {key:?}: the validation reports no such metric (it reports {})",
                    known.join(", ")
                ))
            })?;
            if !value.is_finite() {
                return Ok(());
            }
            if let Some(best) = self.best()?
                && !self.config.keep_best_mode.improves(value, best.value)
            {
                return Ok(());
            }
            let dir = self.run.join(BEST_DIR);
            let tmp = self.run.join(".tmp-best");
            let _ = std::fs::remove_dir_all(&tmp);
            std::fs::create_dir_all(&tmp).map_err(|e| CoreError::cannot_write(&tmp, e))?;
            self.store.save(&model.valid(), &tmp)?;
            let best = FinalStep {
                step,
                metric: key.clone(),
                value,
            };
            crate::checkpoint::write_json(&tmp.join(BEST_FILE), &best)?;
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::rename(&tmp, &dir).map_err(|e| CoreError::cannot_write(&dir, e))?;
            tracing::info!(step, metric = %key, value, "best validation so far");
            Ok(())
        })
    }

    fn non_finite(&self, loss: f64, step: usize) -> CoreError {
        let kept = match self.run.latest_checkpoint(TRAINER_STATE) {
            Some((at, dir)) => format!("the last checkpoint, from step {at}, is {}", dir.display()),
            None => "no checkpoint was written yet".to_string(),
        };
        CoreError::Invalid(format!("loss is {loss} at step {}; stopping: {kept}", step + 1))
    }

    fn summary(
        &self,
        steps: usize,
        initial_eval: Option<Map<String, Value>>,
        final_eval: Map<String, Value>,
    ) -> RunSummary {
        RunSummary {
            steps,
            final_dir: self.run.final_dir(),
            initial_eval,
            final_eval,
        }
    }
}

/// The folder `train.keep_best` keeps the best model in, and the file naming its step.
pub const BEST_DIR: &str = "best";
const BEST_FILE: &str = "best.json";
/// The run-folder file saying which step `final/` holds.
pub const FINAL_STEP: &str = "final_step.json";

/// The step of the model kept by `train.keep_best`, with its `metric` and `value`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinalStep {
    pub step: usize,
    pub metric: String,
    pub value: f64,
}

/// The first rank whose weights checksum differs from rank 0's (ranks apply the same reduced
/// gradients, so their weights are equal bit for bit unless something went wrong).
fn first_out_of_sync(sums: &[[f64; 2]]) -> Option<usize> {
    sums.iter().position(|s| s != &sums[0])
}

/// The file rank `rank`'s share of a sharded optimiser state is saved in.
pub fn optimizer_shard(rank: usize) -> String {
    format!("optimizer-rank-{rank}.bin")
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

/// The validation metrics of the last row that has any.
fn last_eval(rows: &[Map<String, Value>]) -> Map<String, Value> {
    rows.iter()
        .rev()
        .find(|r| r.keys().any(|k| k.starts_with("eval_")))
        .map(|r| {
            r.iter()
                .filter(|(k, _)| k.starts_with("eval_"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drifting_ranks_are_found_and_metrics_add_up_by_name() {
        assert_eq!(first_out_of_sync(&[[1.0, 2.0], [1.0, 2.0]]), None);
        assert_eq!(
            first_out_of_sync(&[[1.0, 2.0], [1.0, 2.0], [1.0, 2.000001]]),
            Some(2)
        );
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
