//! SimPO through aligner-dpo's run with this crate's losses registered, through the library
//! alone: `cargo run --release -p aligner-simpo --example simpo [RUN_DIR]`.

use aligner_dpo::{Device, LossRegistry, RunDir, objective::DpoConfig};

fn main() -> Result<(), aligner_dpo::DpoError> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-simpo".into());
    let mut registry = LossRegistry::with_builtin();
    aligner_simpo::register(&mut registry);
    let mut config = DpoConfig::default();
    config.dpo.loss = "simpo".into();
    config.dpo.beta = 2.0;
    config.dpo.set_param("gamma", 0.5);
    config.train.max_steps = 20; // a short run; the default is one epoch
    let summary = aligner_dpo::train(&config, &registry, &RunDir::new(&out), &Device::flex())?;
    println!(
        "SimPO: held-out {:?}; policy in {}",
        summary.final_eval,
        summary.final_dir.display()
    );
    Ok(())
}
