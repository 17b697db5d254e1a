//! `aligner plot RUN... [--keys K,...] [--out FILE.svg]`: several runs' metrics on one SVG,
//! one panel per metric and one line per run — comparing runs without TensorBoard.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Map, Value};

#[derive(Args)]
pub struct PlotArgs {
    /// Run folders (each with a metrics.jsonl).
    #[arg(required = true, num_args = 1..)]
    runs: Vec<PathBuf>,
    /// The metrics to draw, comma-separated (default: `loss` and every validation metric the
    /// runs log, `eval_*`).
    #[arg(long, value_delimiter = ',')]
    keys: Vec<String>,
    /// The SVG to write.
    #[arg(long, default_value = "runs.svg")]
    out: PathBuf,
    /// Replace `--out` when it exists.
    #[arg(long)]
    overwrite: bool,
}

pub fn run(args: PlotArgs) -> Result<()> {
    let mut runs: Vec<(String, Vec<Map<String, Value>>)> = Vec::new();
    for dir in &args.runs {
        let file = dir.join("metrics.jsonl");
        let rows: Vec<Map<String, Value>> = aligner_core::data::read_jsonl(&file)
            .with_context(|| format!("{}: not a run folder", dir.display()))?;
        let label = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| dir.display().to_string());
        runs.push((label, rows));
    }
    let keys: Vec<String> = match args.keys.is_empty() {
        false => args.keys.clone(),
        true => {
            let mut keys = vec!["loss".to_string()];
            for (_, rows) in &runs {
                for key in rows
                    .iter()
                    .flat_map(|r| r.iter())
                    .filter(|(k, v)| k.starts_with("eval_") && v.is_number())
                    .map(|(k, _)| k)
                {
                    if !keys.contains(key) {
                        keys.push(key.clone());
                    }
                }
            }
            keys
        }
    };
    let present = |k: &String| {
        runs.iter()
            .any(|(_, rows)| rows.iter().any(|r| r.get(k).is_some_and(Value::is_number)))
    };
    if let Some(missing) = keys.iter().find(|k| !present(k)) {
        bail!("--keys: no run logs {missing:?}");
    }
    let inputs: Vec<&std::path::Path> = args.runs.iter().map(PathBuf::as_path).collect();
    crate::output::check_file("--out", &args.out, &inputs, args.overwrite)?;
    let refs: Vec<(&str, &[Map<String, Value>])> =
        runs.iter().map(|(l, r)| (l.as_str(), r.as_slice())).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    aligner_core::train::plot_runs(&refs, &key_refs, &args.out)?;
    println!("{}", args.out.display());
    Ok(())
}
