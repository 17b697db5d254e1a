//! RLHF with PPO on the shipped model, through the library alone: a reward model first (short),
//! then PPO against it with the critic on a thread of this process:
//! `cargo run --release -p aligner-ppo --example ppo [RUN_DIR]`.

use aligner_core::rm::RmConfig;
use aligner_core::{Device, run::RunDir};
use aligner_ppo::PpoConfig;

fn main() -> Result<(), aligner_ppo::PpoError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-ppo".into());
    let device = Device::flex();
    let mut rm = RmConfig::default();
    rm.train.max_steps = 40;
    let reward_model = aligner_core::rm::train(&rm, &RunDir::new(format!("{out}/reward_model")), &device)?;
    let mut config = PpoConfig::default();
    config.reward_model.path = Some(reward_model.final_dir);
    (config.train.max_steps, config.train.eval_every) = (4, 4);
    config.ppo.rollout_prompts = 16;
    let summary = aligner_ppo::train(&config, &RunDir::new(&out), &device)?;
    println!("{}", summary.mean_times.table());
    println!(
        "PPO: held-out reward {:?} -> {:?}",
        summary.initial_eval_reward, summary.final_eval_reward
    );
    Ok(())
}
