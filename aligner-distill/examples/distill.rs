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
    let after = |key: &str| summary.final_eval.get(key).and_then(|v| v.as_f64());
    let before = |key: &str| {
        let eval = summary.initial_eval.as_ref();
        eval.and_then(|e| e.get(key)).and_then(|v| v.as_f64())
    };
    for key in [
        "eval_reverse_kl",
        "eval_frontier/tinystories_sentiment",
        "eval_frontier/kl",
    ] {
        println!("distill: {key} {:?} -> {:?}", before(key), after(key));
    }
    println!("student in {}", summary.final_dir.display());
    Ok(())
}
