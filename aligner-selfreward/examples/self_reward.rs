//! Self-rewarding iterations on the shipped model and data through the library alone:
//! `cargo run --release -p aligner-selfreward --example self_reward [RUN_DIR]`.

use aligner_core::{Device, run::RunDir};

fn main() -> Result<(), aligner_selfreward::SelfRewardError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-self-reward".into());
    let mut config = aligner_selfreward::SelfRewardConfig::default();
    // A short run: one iteration on 64 prompts after a short IFT + EFT fine-tuning (the full
    // one is two epochs, 386 steps).
    config.self_reward.iterations = 1;
    config.self_reward.max_prompts = 64;
    config.sft.max_steps = 100;
    let reports = aligner_selfreward::train(
        &config,
        &aligner_dpo::LossRegistry::with_builtin(),
        &RunDir::new(&out),
        &Device::flex(),
    )?;
    for r in &reports {
        println!(
            "iteration {}: judge agreement {:?}, {} pairs",
            r.iteration, r.judge_agreement, r.pairs
        );
    }
    Ok(())
}
