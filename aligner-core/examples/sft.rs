//! Supervised fine-tuning of the shipped model on the shipped SFT data through the library
//! alone: `cargo run --release -p aligner-core --example sft [RUN_DIR]`.

use aligner_core::run::RunDir;
use aligner_core::sft::SftConfig;
use aligner_core::{Device, Result};

fn main() -> Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-sft".into());
    let mut config = SftConfig::default();
    config.train.max_steps = 20; // a short run; the default is two epochs
    let summary = aligner_core::sft::train(&config, &RunDir::new(&out), &Device::flex())?;
    let before = summary.initial_eval.as_ref().and_then(|e| e["eval_nll"].as_f64());
    let after = summary.final_eval["eval_nll"].as_f64();
    println!(
        "SFT: held-out NLL {before:?} -> {after:?}; model in {}",
        summary.final_dir.display()
    );
    Ok(())
}
