//! Distillation through the library alone: the default DPO run (trained first into
//! `RUN_DIR/teacher`) distilled into the shipped start model on the shipped SFT data:
//! `cargo run --release -p aligner-distill --example distill [RUN_DIR]`.

use aligner_core::{Device, run::RunDir};
use aligner_distill::DistillConfig;

fn main() -> Result<(), aligner_distill::DistillError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-distill".into());
    let mut config = DistillConfig::default();
    config.train.max_steps = 20; // a short run; the default is two epochs
    let summary = aligner_distill::train(&config, &RunDir::new(&out), &Device::flex())?;
    println!(
        "distill: held-out {:?} -> {:?}; student in {}",
        summary.initial_eval,
        summary.final_eval,
        summary.final_dir.display()
    );
    Ok(())
}
