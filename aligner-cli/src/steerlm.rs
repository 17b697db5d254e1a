//! `aligner steerlm attributes|annotate|sft|bootstrap`: SteerLM's steps, each one call into
//! aligner-steerlm.

use std::path::PathBuf;

use aligner_core::Device;
use aligner_steerlm::SteerConfig;
use anyhow::Result;
use clap::{Args, Subcommand};

use crate::train::{TrainArgs, prepare_with, report};

#[derive(Subcommand)]
pub enum SteerCommand {
    /// Step 1: train the attribute prediction model (multi-output regression, masked MSE).
    Attributes(TrainArgs),
    /// Step 2: label prompt/response data with an attribute model.
    Annotate(AnnotateArgs),
    /// Step 3: attribute-conditioned SFT.
    Sft(TrainArgs),
    /// Step 4: the conditioned model samples over a grid of settings, the attribute model
    /// labels the samples, and conditioned SFT continues on them.
    Bootstrap(TrainArgs),
}

#[derive(Args)]
pub struct AnnotateArgs {
    /// Attribute model folder (from `aligner steerlm attributes`).
    #[arg(long)]
    model: PathBuf,
    /// `{"prompt", "response"}` JSON Lines.
    #[arg(long)]
    data: PathBuf,
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
}

pub fn run(cmd: SteerCommand, device: &Device) -> Result<()> {
    let (args, name, defaults, step): (TrainArgs, &str, SteerConfig, Step) = match cmd {
        SteerCommand::Annotate(args) => {
            let (rows, names) =
                aligner_steerlm::annotate(&args.model, &args.data, &args.out, args.batch_size, device)?;
            tracing::info!(rows = rows.len(), attributes = ?names, out = %args.out.display(), "annotated");
            return Ok(());
        }
        SteerCommand::Attributes(args) => (
            args,
            "steerlm-attributes",
            SteerConfig::attributes_defaults(),
            aligner_steerlm::train_attributes,
        ),
        SteerCommand::Sft(args) => (
            args,
            "steerlm-sft",
            SteerConfig::sft_defaults(),
            aligner_steerlm::train_conditioned,
        ),
        SteerCommand::Bootstrap(args) => (
            args,
            "steerlm-bootstrap",
            SteerConfig::bootstrap_defaults(),
            aligner_steerlm::bootstrap,
        ),
    };
    let (config, run) = prepare_with(&args, name, &defaults)?;
    report(&name.replace('-', " "), &step(&config, &run, device)?, run.path());
    Ok(())
}

/// A training step of SteerLM.
type Step = fn(
    &SteerConfig,
    &aligner_core::run::RunDir,
    &Device,
) -> aligner_steerlm::Result<aligner_core::train::RunSummary>;
