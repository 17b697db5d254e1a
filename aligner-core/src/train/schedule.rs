//! Learning-rate schedules: warm-up, then constant, linear decay or cosine decay.

use serde::{Deserialize, Serialize};

/// The shape of the learning rate after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    #[default]
    Constant,
    Linear,
    Cosine,
}

/// Learning rate at optimiser step `step` (0-based) of `total` steps: linear warm-up from
/// `peak / warmup` to `peak` over `warmup` steps, then the schedule's decay to 0 at `total`
/// (transformers' `get_*_schedule_with_warmup`).
pub fn learning_rate(schedule: Schedule, peak: f64, step: usize, warmup: usize, total: usize) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let decay_steps = total.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / decay_steps).min(1.0);
    match schedule {
        Schedule::Constant => peak,
        Schedule::Linear => peak * (1.0 - progress),
        Schedule::Cosine => peak * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_rises_linearly_to_the_peak() {
        let lrs: Vec<f64> = (0..4)
            .map(|s| learning_rate(Schedule::Constant, 1.0, s, 4, 10))
            .collect();
        assert_eq!(lrs, vec![0.25, 0.5, 0.75, 1.0]);
        assert_eq!(learning_rate(Schedule::Constant, 1.0, 9, 4, 10), 1.0);
    }

    #[test]
    fn linear_and_cosine_decay_to_zero() {
        // 2 warm-up steps, then 8 decay steps.
        assert_eq!(learning_rate(Schedule::Linear, 2.0, 2, 2, 10), 2.0);
        assert_eq!(learning_rate(Schedule::Linear, 2.0, 6, 2, 10), 1.0);
        assert!((learning_rate(Schedule::Cosine, 2.0, 6, 2, 10) - 1.0).abs() < 1e-12);
        assert!(
            (learning_rate(Schedule::Cosine, 2.0, 4, 2, 10) - (1.0 + (std::f64::consts::PI / 4.0).cos()))
                .abs()
                < 1e-12
        );
        assert_eq!(learning_rate(Schedule::Linear, 2.0, 10, 2, 10), 0.0);
    }
}
