//! KTO of the shipped model on the shipped unpaired completions, through the library alone:
//! `cargo run --release -p aligner-kto --example kto [RUN_DIR]`.

use aligner_core::{CoreError, Device, run::RunDir};
use aligner_kto::KtoConfig;

fn main() -> Result<(), CoreError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-kto".into());
    let mut config = KtoConfig::default();
    config.train.max_steps = 20; // a short run; the default is one epoch
    let summary = aligner_kto::train(&config, &RunDir::new(&out), &Device::flex())?;
    println!(
        "KTO: held-out {:?}; policy in {}",
        summary.final_eval,
        summary.final_dir.display()
    );
    Ok(())
}
