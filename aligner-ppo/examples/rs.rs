//! Rejection sampling (best-of-n) on the shipped model, through the library alone: a reward
//! model first (short), then one round of sampling, scoring and SFT on the best:
//! `cargo run --release -p aligner-ppo --example rs [RUN_DIR]`.

use aligner_core::rm::RmConfig;
use aligner_core::{Device, run::RunDir};
use aligner_ppo::rejection::RsConfig;

fn main() -> Result<(), aligner_ppo::PpoError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-rs".into());
    let device = Device::flex();
    let mut rm = RmConfig::default();
    rm.train.max_steps = 40;
    let reward_model = aligner_core::rm::train(&rm, &RunDir::new(format!("{out}/reward_model")), &device)?;
    let mut config = RsConfig::default();
    config.reward_model.path = Some(reward_model.final_dir);
    (config.rs.rounds, config.rs.eval_prompts) = (1, 64);
    for round in aligner_ppo::rejection_sampling(&config, &RunDir::new(&out), &device)? {
        println!(
            "round {}: held-out reward {:.3} -> {:.3}",
            round.round, round.eval_reward_before, round.eval_reward_after
        );
    }
    Ok(())
}
