//! DPO of the shipped model on the shipped preference pairs, through the library alone (what a
//! downstream crate writes): `cargo run --release -p aligner-dpo --example dpo [RUN_DIR]`.

use aligner_core::{Device, run::RunDir};
use aligner_dpo::{LossRegistry, objective::DpoConfig};

fn main() -> Result<(), aligner_dpo::DpoError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-dpo".into());
    let mut config = DpoConfig::default();
    config.train.max_steps = 20; // a short run; the default is one epoch
    let summary = aligner_dpo::train(
        &config,
        &LossRegistry::with_builtin(),
        &RunDir::new(&out),
        &Device::flex(),
    )?;
    println!(
        "DPO: held-out {:?}; policy in {}",
        summary.final_eval,
        summary.final_dir.display()
    );
    Ok(())
}
