//! `aligner ppo`, `aligner rs` and `aligner spin`: the online methods, each one call into its
//! crate, and what they print.

use aligner_core::Device;
use anyhow::Result;

use crate::train::{TrainArgs, prepare};

pub fn ppo(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "ppo")?;
    let summary = aligner_ppo::train(&config, &run, device)?;
    println!("{}", summary.mean_times.table());
    tracing::info!(
        steps = summary.steps,
        eval_reward_before = ?summary.initial_eval_reward,
        eval_reward_after = ?summary.final_eval_reward,
        run = %run.path().display(),
        "finished; policy in {}",
        summary.final_dir.display()
    );
    Ok(())
}

/// `aligner rs`: best-of-n rejection sampling rounds.
pub fn rs(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare::<aligner_ppo::rejection::RsConfig>(&args, "rs")?;
    for r in aligner_ppo::rejection_sampling(&config, &run, device)? {
        println!(
            "round {}: held-out reward {:.3} -> {:.3}; kept {} best of {} (mean reward {:.3} of all samples, {:.3} kept)",
            r.round,
            r.eval_reward_before,
            r.eval_reward_after,
            r.kept,
            config.rs.n,
            r.sample_reward,
            r.kept_reward
        );
    }
    Ok(())
}

/// `aligner spin`: self-play fine-tuning iterations.
pub fn spin(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "spin")?;
    for r in aligner_spin::train(&config, &crate::registry::registry(), &run, device)? {
        println!(
            "iteration {}: reference margin of ground truth over its own answers {:.3} ({:.4} per token)",
            r.iteration, r.margin, r.margin_per_token
        );
    }
    Ok(())
}
