//! A reward model from the shipped model on the shipped preference pairs, through the library
//! alone: `cargo run --release -p aligner-core --example rm [RUN_DIR]`.

use aligner_core::rm::RmConfig;
use aligner_core::run::RunDir;
use aligner_core::{Device, Result};

fn main() -> Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-rm".into());
    let mut config = RmConfig::default();
    config.train.max_steps = 40; // a short run; the default is three epochs
    let summary = aligner_core::rm::train(&config, &RunDir::new(&out), &Device::flex())?;
    println!(
        "reward model: held-out accuracy {:?}; model in {}",
        summary.final_eval["eval_accuracy"].as_f64(),
        summary.final_dir.display()
    );
    Ok(())
}
