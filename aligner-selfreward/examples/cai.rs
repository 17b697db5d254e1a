//! Constitutional AI on the shipped model and data through the library alone:
//! `cargo run --release -p aligner-selfreward --example cai [RUN_DIR]`.

use aligner_core::{Device, run::RunDir};
use aligner_selfreward::cai::{CaiConfig, RlMethod};

fn main() -> Result<(), aligner_selfreward::SelfRewardError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-cai".into());
    // A short run: 64 prompts, DPO on the AI labels.
    let mut config = CaiConfig::default();
    config.cai.max_prompts = 64;
    config.cai.rl = RlMethod::Dpo;
    config.judge.max_steps = 60;
    let reports = aligner_selfreward::cai::train(
        &config,
        &aligner_dpo::LossRegistry::with_builtin(),
        &RunDir::new(&out),
        &Device::flex(),
    )?;
    for r in &reports {
        println!(
            "{}: AI label agreement {:?}, lexicon {:?}",
            r.stage,
            r.ai_label_agreement,
            r.frontier.get("eval_frontier/tinystories_sentiment")
        );
    }
    Ok(())
}
