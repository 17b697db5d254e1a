//! Where a PPO step's time goes.

use serde::{Deserialize, Serialize};

/// Seconds of each part of a step, the way NeMo-Aligner's paper (Table 1) breaks a PPO step
/// down.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimes {
    pub refit: f64,
    pub generation: f64,
    /// Scoring the samples with the reward functions held by the actor (a command, an
    /// endpoint, rules, a reward model beside the actor).
    #[serde(default)]
    pub reward: f64,
    pub logprobs: f64,
    pub critic_wait: f64,
    pub train: f64,
    pub total: f64,
    /// One-step-off: the seconds the next step's samples took to draw (and score) on their
    /// own thread, overlapped with this step's training.
    #[serde(default)]
    pub generation_overlapped: f64,
    /// The critic's own compute (inference + training), overlapped with the actor's work.
    pub critic_compute: f64,
    /// Data parallel: each rank's generation seconds (empty with one process).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub generation_per_rank: Vec<f64>,
}

impl StepTimes {
    pub(crate) fn add(&mut self, other: &StepTimes) {
        self.refit += other.refit;
        self.generation += other.generation;
        self.reward += other.reward;
        self.logprobs += other.logprobs;
        self.critic_wait += other.critic_wait;
        self.train += other.train;
        self.total += other.total;
        self.critic_compute += other.critic_compute;
        self.generation_overlapped += other.generation_overlapped;
        self.generation_per_rank.resize(
            other
                .generation_per_rank
                .len()
                .max(self.generation_per_rank.len()),
            0.0,
        );
        for (total, t) in self
            .generation_per_rank
            .iter_mut()
            .zip(&other.generation_per_rank)
        {
            *total += t;
        }
    }

    /// Slowest minus fastest rank's generation seconds (0 with one process).
    pub fn generation_imbalance(&self) -> f64 {
        let max = self
            .generation_per_rank
            .iter()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        let min = self
            .generation_per_rank
            .iter()
            .cloned()
            .fold(f64::INFINITY, f64::min);
        if self.generation_per_rank.is_empty() {
            0.0
        } else {
            max - min
        }
    }

    /// The mean over `steps` steps.
    pub fn mean(&self, steps: usize) -> StepTimes {
        let n = steps.max(1) as f64;
        StepTimes {
            refit: self.refit / n,
            generation: self.generation / n,
            reward: self.reward / n,
            logprobs: self.logprobs / n,
            critic_wait: self.critic_wait / n,
            train: self.train / n,
            total: self.total / n,
            critic_compute: self.critic_compute / n,
            generation_overlapped: self.generation_overlapped / n,
            generation_per_rank: self.generation_per_rank.iter().map(|t| t / n).collect(),
        }
    }

    /// A markdown table of the mean seconds per step and each part's share.
    pub fn table(&self) -> String {
        let rows = [
            ("generation", self.generation),
            ("reward functions", self.reward),
            ("log-probs (reference)", self.logprobs),
            ("refit", self.refit),
            ("critic wait", self.critic_wait),
            ("actor training", self.train),
            ("total", self.total),
            ("(critic compute, overlapped)", self.critic_compute),
            (
                "(next step's samples, overlapped: one-step-off)",
                self.generation_overlapped,
            ),
        ];
        let mut out = String::from("| part of a step | seconds | share |\n|---|---:|---:|\n");
        for (name, secs) in rows {
            out.push_str(&format!(
                "| {name} | {secs:.3} | {:.0}% |\n",
                100.0 * secs / self.total.max(1e-9)
            ));
        }
        if !self.generation_per_rank.is_empty() {
            out.push_str("\n| rank | generation seconds |\n|---:|---:|\n");
            for (rank, secs) in self.generation_per_rank.iter().enumerate() {
                out.push_str(&format!("| {rank} | {secs:.3} |\n"));
            }
            out.push_str(&format!(
                "\nGeneration imbalance (slowest − fastest rank): {:.3} s per step.\n",
                self.generation_imbalance()
            ));
        }
        out
    }
}
