//! SPIN on the shipped model and SFT data, through the library alone: one self-play iteration
//! (the model answers the prompts, DPO prefers the data's answers):
//! `cargo run --release -p aligner-spin --example spin [RUN_DIR]`.

use aligner_core::{Device, run::RunDir};
use aligner_dpo::LossRegistry;
use aligner_spin::SpinConfig;

fn main() -> Result<(), aligner_spin::SpinError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-spin".into());
    let mut config = SpinConfig::default();
    (config.spin.iterations, config.train.max_steps) = (1, 20); // the default: 2 iterations of an epoch
    for r in aligner_spin::train(
        &config,
        &LossRegistry::with_builtin(),
        &RunDir::new(&out),
        &Device::flex(),
    )? {
        println!(
            "iteration {}: reference margin of the data over its own answers {:.3}",
            r.iteration, r.margin
        );
    }
    Ok(())
}
