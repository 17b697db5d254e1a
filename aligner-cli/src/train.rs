//! The options every training command takes, and what the command line does around a run:
//! the configuration (embedded defaults, then `--config`, then `--set`), the run folder, and the
//! summary printed at the end. The runs themselves are the method crates' entry points.

use std::path::{Path, PathBuf};

use aligner_core::Device;
use aligner_core::run::RunDir;
use aligner_core::train::{RunSummary, load_config};
use anyhow::Result;
use clap::Args;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Options every training command takes.
#[derive(Args, Clone)]
pub struct TrainArgs {
    /// TOML configuration (default: the embedded default run).
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Override any key of the configuration, e.g. `--set train.max_steps=20`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub(crate) sets: Vec<String>,
    /// Run folder.
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its newest checkpoint, with its config.toml.
    #[arg(long, value_name = "RUN_DIR", conflicts_with = "config")]
    pub(crate) resume: Option<PathBuf>,
    /// Stop after this many optimizer steps as if interrupted (checkpoints stay resumable).
    #[arg(long, hide = true)]
    pub(crate) stop_after: Option<usize>,
}

/// The resolved configuration and run folder of a command whose defaults are `T::default()`.
pub(crate) fn prepare<T: Serialize + DeserializeOwned + Default>(
    args: &TrainArgs,
    command: &str,
) -> Result<(T, RunDir)> {
    prepare_with(args, command, &T::default())
}

/// [`prepare`] from explicit defaults (commands whose steps default differently). A resumed
/// run takes its own `config.toml`; a new one goes to `--out` or `runs/<command>`.
pub(crate) fn prepare_with<T: Serialize + DeserializeOwned>(
    args: &TrainArgs,
    command: &str,
    defaults: &T,
) -> Result<(T, RunDir)> {
    let (config_file, run) = match &args.resume {
        Some(dir) => (Some(dir.join("config.toml")), RunDir::resuming(dir)),
        None => (
            args.config.clone(),
            RunDir::new(
                args.out
                    .clone()
                    .unwrap_or_else(|| PathBuf::from("runs").join(command)),
            ),
        ),
    };
    let config: T = load_config(defaults, config_file.as_deref(), &args.sets)?;
    Ok((config, run.stop_after(args.stop_after)))
}

/// Logs the validation before and after a trainer run, and where its model is.
pub(crate) fn report(summary: &RunSummary, run: &Path) {
    if let Some(initial) = &summary.initial_eval {
        tracing::info!(?initial, "validation before training");
    }
    tracing::info!(steps = summary.steps, eval = ?summary.final_eval, run = %run.display(), "finished; model in {}", summary.final_dir.display());
}

pub fn sft(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "sft")?;
    report(&aligner_core::sft::train(&config, &run, device)?, run.path());
    Ok(())
}

pub fn rm(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "rm")?;
    report(&aligner_core::rm::train(&config, &run, device)?, run.path());
    Ok(())
}

pub fn dpo(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "dpo")?;
    let summary = aligner_dpo::train(&config, &crate::registry::registry(), &run, device)?;
    report(&summary, run.path());
    Ok(())
}

#[cfg(feature = "kto")]
pub fn kto(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "kto")?;
    report(&aligner_kto::train(&config, &run, device)?, run.path());
    Ok(())
}
