//! The options every training command takes, and what the command line does around a run:
//! the configuration (embedded defaults, then `--config`, then `--set`), the run folder, and the
//! summary printed at the end. The runs themselves are the method crates' entry points.

use std::path::{Path, PathBuf};

use aligner_core::Device;
use aligner_core::run::RunDir;
use aligner_core::train::{ConfigChange, MovedKey, RunSummary, config_changes, load_config_moved};
use anyhow::{Result, bail};
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
    /// Clear the `--out` folder when it already holds a run (without it, such a folder is
    /// refused rather than mixed with the new run).
    #[arg(long, conflicts_with = "resume")]
    pub(crate) overwrite: bool,
    /// With `--resume`: accept `--set` values that change what the run was trained with; each
    /// change is recorded in RUN_DIR/config_changes.jsonl (without it they are refused).
    #[arg(long, requires = "resume")]
    pub(crate) allow_change: bool,
    /// Stop after this many optimizer steps as if interrupted (checkpoints stay resumable).
    #[arg(long, hide = true)]
    pub(crate) stop_after: Option<usize>,
    /// Abort (as if killed: no checkpoint, no cleanup) after this many optimizer steps, on the
    /// last rank; for tests of resume after a crash.
    #[arg(long, hide = true)]
    pub(crate) abort_after: Option<usize>,
}

/// The resolved configuration and run folder of a command whose defaults are `T::default()`.
pub(crate) fn prepare<T: Serialize + DeserializeOwned + Default>(
    args: &TrainArgs,
    command: &str,
) -> Result<(T, RunDir)> {
    prepare_with(args, command, &T::default())
}

/// [`prepare`] from explicit defaults (commands whose steps default differently). A resumed
/// run takes its own `config.toml` (a `--set` that changes it needs `--allow-change`); a new
/// one goes to `--out` or `runs/<command>`.
pub(crate) fn prepare_with<T: Serialize + DeserializeOwned>(
    args: &TrainArgs,
    command: &str,
    defaults: &T,
) -> Result<(T, RunDir)> {
    let Some(dir) = &args.resume else {
        let out = args
            .out
            .clone()
            .unwrap_or_else(|| PathBuf::from("runs").join(command));
        let config: T = load_config_moved(defaults, args.config.as_deref(), &args.sets, moved_keys(command))?;
        aligner_core::parallel::check_same_config(aligner_parallel::world().as_ref(), &config)?;
        let run = RunDir::new(out).overwrite(args.overwrite);
        return Ok((
            config,
            run.stop_after(args.stop_after).abort_after(args.abort_after),
        ));
    };
    let recorded_file = dir.join("config.toml");
    if !recorded_file.exists() {
        bail!(
            "--resume {}: no config.toml there (is it a run folder?)",
            dir.display()
        );
    }
    let moved = moved_keys(command);
    let recorded: T = load_config_moved(defaults, Some(&recorded_file), &[], moved)?;
    let config: T = load_config_moved(defaults, Some(&recorded_file), &args.sets, moved)?;
    aligner_core::parallel::check_same_config(aligner_parallel::world().as_ref(), &config)?;
    let changes = config_changes(&recorded, &config)?;
    if !changes.is_empty() {
        let listed: Vec<String> = changes.iter().map(ToString::to_string).collect();
        if !args.allow_change {
            bail!(
                "--resume {}: --set changes what the run was trained with ({}); pass --allow-change \
                 to continue with the change (it is recorded in config_changes.jsonl), or leave the --set out",
                dir.display(),
                listed.join("; ")
            );
        }
        tracing::warn!(changes = %listed.join("; "), "--allow-change: the resumed run continues with changed settings");
    }
    let mut run = RunDir::resuming(dir)
        .stop_after(args.stop_after)
        .abort_after(args.abort_after);
    if !changes.is_empty() {
        run = run.recording_changes(changes_row(&changes));
    }
    Ok((config, run))
}

/// The keys of `command`'s configuration that moved (the loop's settings of PPO, online DPO
/// and SPIN went to `[train]`): given, they are refused naming their new place.
fn moved_keys(command: &str) -> &'static [MovedKey] {
    match command {
        "ppo" => aligner_ppo::MOVED_KEYS,
        "online-dpo" => aligner_dpo::online::MOVED_KEYS,
        "spin" => aligner_spin::MOVED_KEYS,
        "cai" => aligner_selfreward::cai::MOVED_KEYS,
        _ => &[],
    }
}

/// The line `config_changes.jsonl` gets when the resume starts: when, and which keys changed
/// how.
fn changes_row(changes: &[ConfigChange]) -> serde_json::Value {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    serde_json::json!({ "resumed_at_unix_seconds": seconds, "changes": changes })
}

/// `name v` pairs of a metrics map, numbers printed as numbers, in the map's order.
pub(crate) fn format_metrics(metrics: &serde_json::Map<String, serde_json::Value>) -> String {
    metrics
        .iter()
        .map(|(k, v)| match v.as_f64() {
            Some(x) => format!("{k} {}", format_number(x)),
            None => format!("{k} {v}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A number at four or five significant digits (integers as they are, tiny ones as 1.234e-7).
pub(crate) fn format_number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{x:.0}")
    } else if x.abs() < 1e-3 {
        format!("{x:.3e}")
    } else {
        format!("{}", format!("{x:.4e}").parse::<f64>().unwrap_or(x))
    }
}

/// `name before -> after` for each final validation metric (just `name after` without a
/// validation before training).
fn metric_changes(
    initial: Option<&serde_json::Map<String, serde_json::Value>>,
    last: &serde_json::Map<String, serde_json::Value>,
) -> String {
    last.iter()
        .map(|(k, v)| {
            let after = v.as_f64().map_or_else(|| v.to_string(), format_number);
            match initial.and_then(|i| i.get(k)).and_then(|b| b.as_f64()) {
                Some(before) => format!("{k} {} -> {after}", format_number(before)),
                None => format!("{k} {after}"),
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The one line a training command ends with (stdout): what was written where, and the
/// validation before and after.
pub(crate) fn report(command: &str, summary: &RunSummary, run: &Path) {
    if let Some(initial) = &summary.initial_eval {
        tracing::info!("validation before training: {}", format_metrics(initial));
    }
    let kept = std::fs::read_to_string(run.join(aligner_core::train::FINAL_STEP))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["step"].as_u64());
    let step = match kept {
        Some(step) if step as usize != summary.steps => format!(" (the best validation's, step {step})"),
        _ => String::new(),
    };
    say!(
        "{command}: {} steps; run in {}, model in {}{step}; {}",
        summary.steps,
        run.display(),
        summary.final_dir.display(),
        metric_changes(summary.initial_eval.as_ref(), &summary.final_eval)
    );
}

pub fn sft(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "sft")?;
    report(
        "sft",
        &aligner_core::sft::train(&config, &run, device)?,
        run.path(),
    );
    Ok(())
}

pub fn rm(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "rm")?;
    report("rm", &aligner_core::rm::train(&config, &run, device)?, run.path());
    Ok(())
}

pub fn dpo(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "dpo")?;
    let summary = aligner_dpo::train(&config, &crate::registry::registry(), &run, device)?;
    report("dpo", &summary, run.path());
    Ok(())
}

pub fn distill(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare::<aligner_distill::DistillConfig>(&args, "distill")?;
    report(
        "distill",
        &aligner_distill::train(&config, &run, device)?,
        run.path(),
    );
    Ok(())
}

#[cfg(feature = "kto")]
pub fn kto(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "kto")?;
    report("kto", &aligner_kto::train(&config, &run, device)?, run.path());
    Ok(())
}
