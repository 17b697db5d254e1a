//! The training loop every alignment method shares.
//!
//! A method supplies an [`Objective`] (a micro-batch of examples in, a loss and named metrics
//! out); [`Trainer`] owns the rest: data order, gradient accumulation, global-norm clipping,
//! AdamW with decoupled weight decay, the learning-rate schedule, validation, `metrics.jsonl`,
//! checkpoints written atomically, exact resume, a progress bar and the final plot.

pub mod config;
pub mod grads;
pub mod metrics;
pub mod schedule;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams};
use burn::tensor::{Bytes, Device, Tensor};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use config::{DataSection, ModelSection, TrainSection, load_config, to_toml};
pub use metrics::{MetricsLog, plot_metrics};
pub use schedule::{Schedule, learning_rate};

use crate::error::{CoreError, Result};

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

/// Saves and loads the trained model in the run folder's formats.
pub trait ModelStore<M> {
    /// Writes `model` as an HF folder into `dir`.
    fn save(&self, model: &M, dir: &Path) -> Result<()>;
    /// Loads a model saved by [`ModelStore::save`].
    fn load(&self, dir: &Path, device: &Device) -> Result<M>;
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
    pub out_dir: &'a Path,
    /// The device training runs on (autodiff is enabled on it by the trainer).
    pub device: Device,
    /// Stop after this many steps as if killed (for tests of resume); `None` runs to the end.
    pub stop_after: Option<usize>,
}

impl<M: Module + 'static, O: Objective<M>> Trainer<'_, M, O> {
    fn micro_batches_per_epoch(&self) -> usize {
        self.train.len().div_ceil(self.config.batch_size.max(1))
    }

    /// Optimiser steps of the whole run.
    pub fn total_steps(&self) -> usize {
        if self.config.max_steps > 0 {
            self.config.max_steps
        } else {
            (self.micro_batches_per_epoch() * self.config.epochs.max(1))
                .div_ceil(self.config.grad_accum.max(1))
        }
    }

    /// The example order of epoch `epoch`: a permutation seeded by `(seed, epoch)`, so any
    /// position can be recomputed on resume.
    fn epoch_order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.train.len()).collect();
        if self.config.shuffle {
            let mut rng =
                ChaCha8Rng::seed_from_u64(self.config.seed ^ (epoch as u64).wrapping_mul(0x9e37_79b9));
            order.shuffle(&mut rng);
        }
        order
    }

    /// Example indices of micro-batch `k` (counting across epochs). `cached` holds the order of
    /// the epoch last used, so an epoch is shuffled once, not once per micro-batch.
    fn micro_batch(&self, k: usize, cached: &mut Option<(usize, Vec<usize>)>) -> Vec<usize> {
        let per_epoch = self.micro_batches_per_epoch().max(1);
        let (epoch, index) = (k / per_epoch, k % per_epoch);
        if cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
            *cached = Some((epoch, self.epoch_order(epoch)));
        }
        let order = &cached.as_ref().expect("set above").1;
        let b = self.config.batch_size.max(1);
        order[index * b..((index + 1) * b).min(order.len())].to_vec()
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

    /// The newest complete checkpoint under `out_dir/checkpoints`.
    pub fn latest_checkpoint(out_dir: &Path) -> Option<(usize, PathBuf)> {
        let entries = std::fs::read_dir(out_dir.join("checkpoints")).ok()?;
        entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let step = name.strip_prefix("step-")?.parse::<usize>().ok()?;
                e.path()
                    .join("trainer_state.json")
                    .exists()
                    .then(|| (step, e.path()))
            })
            .max_by_key(|(s, _)| *s)
    }

    fn save_checkpoint(
        &self,
        model: &M,
        optim: &burn::optim::ModuleOptimizer,
        state: &TrainerState,
    ) -> Result<()> {
        let dir = self.out_dir.join("checkpoints");
        let final_dir = dir.join(format!("step-{}", state.step));
        let tmp = dir.join(format!(".tmp-step-{}", state.step));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| CoreError::io(&tmp, e))?;
        self.store.save(&model.valid(), &tmp)?;
        let bytes = optim
            .into_bytes()
            .map_err(|e| CoreError::Invalid(format!("optimizer state: {e:?}")))?;
        crate::checkpoint::write_atomic(&tmp.join("optimizer.bin"), &bytes)?;
        let json = serde_json::to_string_pretty(state).expect("state serialises");
        crate::checkpoint::write_atomic(&tmp.join("trainer_state.json"), json.as_bytes())?;
        let _ = std::fs::remove_dir_all(&final_dir);
        // The rename is the commit point: a killed save leaves only a `.tmp-` folder.
        std::fs::rename(&tmp, &final_dir).map_err(|e| CoreError::io(&final_dir, e))
    }

    /// Trains `model` (or resumes from the newest checkpoint when `resume`), writing the run
    /// folder, and returns the summary. The trained model is saved in `out_dir/final`.
    pub fn run(&self, model: M, resume: bool) -> Result<(M, RunSummary)> {
        let total = self.total_steps();
        let cfg = self.config;
        let train_device = self.device.clone().autodiff();
        let mut optim = AdamWConfig::new()
            .with_weight_decay(cfg.weight_decay as f32)
            .with_epsilon(1e-8)
            .init();
        let (mut model, start) = match resume.then(|| Self::latest_checkpoint(self.out_dir)).flatten() {
            Some((step, dir)) => {
                let model = self.store.load(&dir, &train_device)?.train();
                let bytes = std::fs::read(dir.join("optimizer.bin")).map_err(|e| CoreError::io(&dir, e))?;
                optim = optim
                    .from_bytes(Bytes::from_bytes_vec(bytes))
                    .map_err(|e| CoreError::Invalid(format!("{}: optimizer state: {e:?}", dir.display())))?;
                tracing::info!(step, dir = %dir.display(), "resuming");
                (model, step)
            }
            None if resume => {
                return Err(CoreError::Invalid(format!(
                    "--resume: no checkpoint in {}",
                    self.out_dir.join("checkpoints").display()
                )));
            }
            None => (model.fork(&train_device).train(), 0),
        };
        let log = MetricsLog::open(self.out_dir, resume.then_some(start))?;
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

        let bar = progress_bar(total as u64);
        bar.set_position(start as u64);
        let started = Instant::now();
        let mut tokens_seen = 0usize;
        let accum = cfg.grad_accum.max(1);
        let mut order = None;
        for step in start..total {
            if self.stop_after.is_some_and(|s| step >= s) {
                bar.abandon();
                return Ok((model, self.summary(step, initial_eval, Map::new())));
            }
            // Step randomness (dropout) depends only on the seed and the step.
            train_device.seed(cfg.seed.wrapping_add(step as u64));
            let mut accumulator = GradientsAccumulator::<M>::new();
            let mut loss_sum = 0.0;
            let mut metric_sums: Vec<(String, f64)> = Vec::new();
            for micro in 0..accum {
                let indices = self.micro_batch(step * accum + micro, &mut order);
                let batch: Vec<&O::Example> = indices.iter().map(|&i| &self.train[i]).collect();
                let out = self.objective.step(&model, &batch)?;
                let loss_value = out.loss.clone().into_scalar::<f32>() as f64;
                if !loss_value.is_finite() {
                    bar.abandon();
                    return Err(CoreError::Invalid(format!(
                        "loss is {loss_value} at step {}; stopping. The last good checkpoint is kept in {}",
                        step + 1,
                        self.out_dir.join("checkpoints").display()
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
        let final_dir = self.out_dir.join("final");
        self.store.save(&model.valid(), &final_dir)?;
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
        plot_metrics(&rows, &key_refs, &self.out_dir.join("metrics.svg"))?;
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
            final_dir: self.out_dir.join("final"),
            initial_eval,
            final_eval,
        }
    }
}

fn progress_bar(total: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("step {pos}/{len} {bar:30} {msg} [{elapsed} < {eta}]")
    {
        bar.set_style(style);
    }
    bar
}
