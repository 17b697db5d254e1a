//! Where a PPO step's time goes.

use serde::{Deserialize, Serialize};

/// Seconds of each part of a step, the way NeMo-Aligner's paper (Table 1) breaks a PPO step
/// down.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimes {
    pub refit: f64,
    pub generation: f64,
    pub logprobs: f64,
    pub critic_wait: f64,
    pub train: f64,
    pub total: f64,
    /// The critic's own compute (inference + training), overlapped with the actor's work.
    pub critic_compute: f64,
}

impl StepTimes {
    pub(crate) fn add(&mut self, other: &StepTimes) {
        self.refit += other.refit;
        self.generation += other.generation;
        self.logprobs += other.logprobs;
        self.critic_wait += other.critic_wait;
        self.train += other.train;
        self.total += other.total;
        self.critic_compute += other.critic_compute;
    }

    /// The mean over `steps` steps.
    pub fn mean(&self, steps: usize) -> StepTimes {
        let n = steps.max(1) as f64;
        StepTimes {
            refit: self.refit / n,
            generation: self.generation / n,
            logprobs: self.logprobs / n,
            critic_wait: self.critic_wait / n,
            train: self.train / n,
            total: self.total / n,
            critic_compute: self.critic_compute / n,
        }
    }

    /// A markdown table of the mean seconds per step and each part's share.
    pub fn table(&self) -> String {
        let rows = [
            ("generation", self.generation),
            ("log-probs (reference)", self.logprobs),
            ("refit", self.refit),
            ("critic wait", self.critic_wait),
            ("actor training", self.train),
            ("total", self.total),
            ("(critic compute, overlapped)", self.critic_compute),
        ];
        let mut out = String::from("| part of a step | seconds | share |\n|---|---:|---:|\n");
        for (name, secs) in rows {
            out.push_str(&format!(
                "| {name} | {secs:.3} | {:.0}% |\n",
                100.0 * secs / self.total.max(1e-9)
            ));
        }
        out
    }
}
