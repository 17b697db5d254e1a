//! The training loop every alignment method shares.
//!
//! A method supplies an [`Objective`] (a micro-batch of examples in, a loss and named metrics
//! out); [`Trainer`] owns the rest: data order, gradient accumulation, global-norm clipping,
//! AdamW with decoupled weight decay, the learning-rate schedule, validation, `metrics.jsonl`,
//! checkpoints written atomically, exact resume, a progress bar and the final plot.

pub mod config;
pub mod grads;
pub mod metrics;
pub mod order;
pub mod schedule;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::{Bytes, Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use config::{DataSection, ModelSection, TrainSection, load_config, to_toml};
pub use metrics::{MetricsLog, plot_metrics};
pub use order::{EpochOrder, mini_batches};
pub use schedule::{Schedule, learning_rate};

pub use crate::store::ModelStore;

use crate::error::{CoreError, Result};
use crate::run::{RunDir, progress_bar};

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

    /// Metrics drawn in the run's plot besides the loss.
    fn plot_keys(&self) -> Vec<String> {
        Vec::new()
    }
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
    let trainer = Trainer {
        config,
        objective,
        store,
        train: data.0,
        validation: data.1,
        run,
        device: device.clone(),
    };
    Ok(trainer.run(model)?.1)
}

/// Position of a run, stored with each checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimiser steps completed.
    pub step: usize,
    pub total_steps: usize,
    /// The seed the data order and step randomness derive from.
    pub seed: u64,
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
}

impl<M: Module + 'static, O: Objective<M>> Trainer<'_, M, O> {
    /// Optimiser steps of the whole run.
    pub fn total_steps(&self) -> usize {
        if self.config.max_steps > 0 {
            self.config.max_steps
        } else {
            let per_epoch = self.train.len().div_ceil(self.config.batch_size.max(1));
            (per_epoch * self.config.epochs.max(1)).div_ceil(self.config.grad_accum.max(1))
        }
    }

    fn evaluate(&self, model: &M) -> Result<Map<String, Value>> {
        let model = model.valid();
        let limit = match self.config.eval_examples {
            0 => self.validation.len(),
            n => n.min(self.validation.len()),
        };
        let mut totals: Vec<(String, f64, f64)> = Vec::new();
        let refs: Vec<&O::Example> = self.validation[..limit].iter().collect();
        for batch in refs.chunks(self.config.batch_size.max(1)) {
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
        Ok(totals
            .into_iter()
            .map(|(name, sum, weight)| (format!("eval_{name}"), Value::from(sum / weight.max(1e-12))))
            .collect())
    }

    fn save_checkpoint(&self, model: &M, optim: &ModuleOptimizer, state: &TrainerState) -> Result<()> {
        self.run.save_checkpoint(state.step, |tmp| {
            self.store.save(&model.valid(), tmp)?;
            save_optimizer(optim, &tmp.join("optimizer.bin"))?;
            crate::checkpoint::write_json(&tmp.join(TRAINER_STATE), state)
        })?;
        Ok(())
    }

    /// Trains `model` (or, when the run is resumed, continues from its newest checkpoint),
    /// writing the run folder, and returns the summary. The trained model is saved in `final/`.
    pub fn run(&self, model: M) -> Result<(M, RunSummary)> {
        self.config.check()?;
        let total = self.total_steps();
        let cfg = self.config;
        let train_device = self.device.clone().autodiff();
        let mut optim = adamw(cfg.weight_decay);
        let (mut model, start) = match self.run.resume_point(TRAINER_STATE)? {
            Some((step, dir)) => {
                let model = self.store.load(&dir, &train_device)?.train();
                optim = load_optimizer(optim, &dir.join("optimizer.bin"))?;
                tracing::info!(step, dir = %dir.display(), "resuming");
                (model, step)
            }
            None => (model.fork(&train_device).train(), 0),
        };
        let log = MetricsLog::open(self.run.path(), self.run.is_resumed().then_some(start))?;
        let initial_eval = if start == 0 && !self.validation.is_empty() {
            let eval = self.evaluate(&model)?;
            let mut row = Map::new();
            row.insert("step".into(), 0.into());
            row.extend(eval.clone());
            log.write(&row)?;
            Some(eval)
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
        let batch_size = cfg.batch_size.max(1);
        for step in start..total {
            if self.run.stops_after().is_some_and(|s| step >= s) {
                bar.abandon();
                return Ok((model, self.summary(step, initial_eval, Map::new())));
            }
            // Step randomness (dropout) depends only on the seed and the step.
            train_device.seed(cfg.seed.wrapping_add(step as u64));
            let mut accumulator = GradientsAccumulator::<M>::new();
            let mut loss_sum = 0.0;
            let mut metric_sums: Vec<(String, f64)> = Vec::new();
            for micro in 0..accum {
                let indices = order.batch(step * accum + micro, batch_size);
                let batch: Vec<&O::Example> = indices.iter().map(|&i| &self.train[i]).collect();
                let out = self.objective.step(&model, &batch)?;
                let loss_value = out.loss.clone().into_scalar::<f32>() as f64;
                if !loss_value.is_finite() {
                    bar.abandon();
                    return Err(CoreError::Invalid(format!(
                        "loss is {loss_value} at step {}; stopping. The last good checkpoint is kept in {}",
                        step + 1,
                        self.run.checkpoints().display()
                    )));
                }
                loss_sum += loss_value;
                tokens_seen += out.tokens;
                for (name, v) in out.metrics {
                    match metric_sums.iter_mut().find(|m| m.0 == name) {
                        Some(m) => m.1 += v,
                        None => metric_sums.push((name, v)),
                    }
                }
                let grads = out.loss.div_scalar(accum as f64).backward();
                accumulator.accumulate(&model, GradientsParams::from_grads(grads, &model));
            }
            let mut grads = accumulator.grads();
            let grad_norm = grads::clip_grad_norm(&model, &mut grads, cfg.max_grad_norm);
            let lr = learning_rate(cfg.schedule, cfg.lr, step, cfg.warmup_steps, total);
            model = optim.step(lr, model, grads);

            let done = step + 1;
            let loss = loss_sum / accum as f64;
            let tokens_per_s = tokens_seen as f64 / started.elapsed().as_secs_f64().max(1e-9);
            bar.set_position(done as u64);
            bar.set_message(format!("loss {loss:.4} · {tokens_per_s:.0} tok/s"));
            let eval_now = !self.validation.is_empty()
                && (done == total || (cfg.eval_every > 0 && done % cfg.eval_every == 0));
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
                    row.extend(self.evaluate(&model)?);
                }
                log.write(&row)?;
            }
            if cfg.save_every > 0 && done % cfg.save_every == 0 && done < total {
                let state = TrainerState {
                    step: done,
                    total_steps: total,
                    seed: cfg.seed,
                };
                self.save_checkpoint(&model, &optim, &state)?;
            }
        }
        bar.finish_and_clear();
        self.store.save(&model.valid(), &self.run.final_dir())?;
        let rows = log.rows()?;
        let final_eval = rows
            .iter()
            .rev()
            .find(|r| r.keys().any(|k| k.starts_with("eval_")))
            .map(|r| {
                r.iter()
                    .filter(|(k, _)| k.starts_with("eval_"))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let mut keys = vec!["loss".to_string()];
        keys.extend(self.objective.plot_keys());
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        plot_metrics(&rows, &key_refs, &self.run.join("metrics.svg"))?;
        Ok((model, self.summary(total, initial_eval, final_eval)))
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
