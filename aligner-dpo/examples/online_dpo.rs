//! Online DPO of the shipped model through the library alone, its reward a function (the
//! shipped task's lexicon) rather than a reward model:
//! `cargo run --release -p aligner-dpo --example online_dpo [RUN_DIR]`.

use aligner_core::{Device, run::RunDir};
use aligner_dpo::LossRegistry;
use aligner_dpo::online::OnlineDpoConfig;
use aligner_gen::{RewardSpec, RewardSpecs};

fn main() -> Result<(), aligner_dpo::DpoError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-online-dpo".into());
    let mut config = OnlineDpoConfig::default();
    config.train.max_steps = 8; // a short run; the default is 24
    config.reward = RewardSpecs(vec![RewardSpec::function("tinystories_sentiment")]);
    let summary = aligner_dpo::online::train(
        &config,
        &LossRegistry::with_builtin(),
        &RunDir::new(&out),
        &Device::flex(),
    )?;
    println!(
        "online DPO: held-out reward {:?} -> {:?}; policy in {}",
        summary.initial_eval_reward,
        summary.final_eval_reward,
        summary.final_dir.display()
    );
    Ok(())
}
