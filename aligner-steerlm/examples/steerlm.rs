//! SteerLM's four steps on the shipped model and attribute data, through the library alone
//! (short runs): the attribute model, annotation, conditioned SFT, and bootstrapping on the
//! model's own labelled samples: `cargo run --release -p aligner-steerlm --example steerlm [RUN_DIR]`.

use aligner_core::{Device, run::RunDir};
use aligner_steerlm::SteerConfig;

fn main() -> aligner_steerlm::Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/example-steerlm".into());
    let device = Device::flex();
    let mut attributes = SteerConfig::attributes_defaults();
    attributes.train.max_steps = 30;
    let labeller =
        aligner_steerlm::train_attributes(&attributes, &RunDir::new(format!("{out}/attributes")), &device)?;
    let test = aligner_core::default_data_dir().join("test.sft.jsonl");
    let annotated = std::path::PathBuf::from(format!("{out}/annotated.jsonl"));
    let (rows, names) = aligner_steerlm::annotate(&labeller.final_dir, &test, &annotated, 32, &device)?;
    println!("annotated {} rows with {names:?}", rows.len());
    let mut sft = SteerConfig::sft_defaults();
    sft.train.max_steps = 30;
    let conditioned = aligner_steerlm::train_conditioned(&sft, &RunDir::new(format!("{out}/sft")), &device)?;
    let mut bootstrap = SteerConfig::bootstrap_defaults();
    bootstrap.model.path = Some(conditioned.final_dir);
    bootstrap.bootstrap.attribute_model = Some(labeller.final_dir);
    bootstrap.bootstrap.grid = [("positivity".to_string(), vec![0, 4])].into_iter().collect();
    bootstrap.train.max_steps = 10;
    let summary = aligner_steerlm::bootstrap(&bootstrap, &RunDir::new(format!("{out}/bootstrap")), &device)?;
    println!("bootstrapped model in {}", summary.final_dir.display());
    Ok(())
}
