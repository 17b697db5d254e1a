//! Several engines fed from one queue.
//!
//! Each worker (a thread now; a device later) runs its own [`Engine`] with its own KV cache on
//! shared weights and takes the next prompt whenever one of its rows frees up, so a worker
//! that draws short responses ends up serving more prompts — NeMo-Aligner's dynamic load
//! balancing, without a coordinator.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use aligner_core::CausalLm;

use crate::engine::{
    Engine, Generation, GenerationRequest, RequestFeed, SliceFeed, inference_weights, validate,
};
use crate::error::{GenError, Result};

/// What one worker did in a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerReport {
    pub prompts: usize,
    pub tokens: usize,
    pub seconds: f64,
}

/// What a pool run did, worker by worker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolReport {
    pub workers: Vec<WorkerReport>,
    pub seconds: f64,
}

impl PoolReport {
    /// Generated tokens over all workers.
    pub fn tokens(&self) -> usize {
        self.workers.iter().map(|w| w.tokens).sum()
    }
}

/// Engines sharing one queue of prompts.
pub struct WorkerPool {
    engines: Vec<Engine>,
}

impl WorkerPool {
    /// `workers` engines: `engine` and replicas of it on the same weights.
    pub fn new(engine: Engine, workers: usize) -> Self {
        // A tensor group's ranks must run the same passes in the same order, which workers
        // taking prompts as their rows free up would not: one worker there.
        let workers = match engine.in_tensor_group() {
            true if workers > 1 => {
                tracing::warn!(
                    workers,
                    "a model split over a tensor group generates with one worker"
                );
                1
            }
            _ => workers,
        };
        let mut engines = Vec::with_capacity(workers.max(1));
        for _ in 1..workers.max(1) {
            engines.push(engine.replica());
        }
        engines.insert(0, engine);
        Self { engines }
    }

    pub fn workers(&self) -> usize {
        self.engines.len()
    }

    /// Whether the engines' model is split over a tensor group (see
    /// [`Engine::in_tensor_group`]).
    pub fn in_tensor_group(&self) -> bool {
        self.engines.first().is_some_and(Engine::in_tensor_group)
    }

    /// Every worker takes `model`'s current weights (merged once, shared by all).
    pub fn refit(&mut self, model: &CausalLm) -> Result<Duration> {
        let start = Instant::now();
        let (first, rest) = self.engines.split_first_mut().expect("a pool has a worker");
        first.take_weights(inference_weights(model))?;
        for engine in rest {
            engine.share_weights(first)?;
        }
        Ok(start.elapsed())
    }

    /// Completes every request (outputs in request order) and reports each worker's share.
    pub fn generate(
        &mut self,
        requests: &[GenerationRequest],
        progress: &(dyn Fn(&Generation) + Sync),
    ) -> Result<(Vec<Generation>, PoolReport)> {
        let Some(first) = self.engines.first() else {
            return Ok((Vec::new(), PoolReport::default()));
        };
        validate(requests, first.max_positions())?;
        let results: Mutex<Vec<Option<Generation>>> = Mutex::new(vec![None; requests.len()]);
        let report = self.serve(&SliceFeed::new(requests), &|i, generation| {
            progress(&generation);
            results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(generation);
            Ok(())
        })?;
        let outputs = results
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .into_iter()
            .map(|g| g.expect("every request finishes"))
            .collect();
        Ok((outputs, report))
    }

    /// Every worker serves `feed` ([`Engine::serve`]) until it has no more, handing each
    /// finished sequence to `done` with its key; reports each worker's share.
    pub fn serve(
        &mut self,
        feed: &dyn RequestFeed,
        done: &(dyn Fn(usize, Generation) -> Result<()> + Sync),
    ) -> Result<PoolReport> {
        let start = Instant::now();
        let reports = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .engines
                .iter_mut()
                .map(|engine| {
                    scope.spawn(move || -> Result<WorkerReport> {
                        let begun = Instant::now();
                        let mut report = WorkerReport::default();
                        engine.serve(feed, &mut |i, generation| {
                            report.prompts += 1;
                            report.tokens += generation.token_ids.len();
                            done(i, generation)
                        })?;
                        report.seconds = begun.elapsed().as_secs_f64();
                        Ok(report)
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(w, h)| h.join().map_err(|_| GenError::WorkerPanicked(w))?)
                .collect::<Result<Vec<_>>>()
        })?;
        Ok(PoolReport {
            workers: reports,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}
