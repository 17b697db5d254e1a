//! `aligner eval`: where a policy stands on the reward–KL frontier (aligner-gen's
//! [`Frontier`]): reward of its own samples on held-out prompts against their KL to the
//! reference, with the reference's NLL of them, distinct-n, length and EOS. `--plot` draws
//! several evaluations (and training runs' paths) on one chart.

use std::path::{Path, PathBuf};

use aligner_core::Device;
use aligner_gen::frontier::{FrontierOptions, Reference, RewardFunction, SampleReward};
use aligner_gen::{Frontier, FrontierSection};
use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};

#[derive(Args)]
pub struct EvalArgs {
    /// The policy's HF folder (a run's `final/`; default: the shipped model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// `{"prompt": ...}` JSON Lines (default: the shipped held-out prompts).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// The reference the KL is measured against (default: the start model recorded in the run
    /// folder above `--model`, else the shipped model).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// A reward model folder (`aligner rm`'s `final/`) that scores the samples.
    #[arg(long)]
    reward: Option<PathBuf>,
    /// A built-in reward function that scores the samples: `tinystories_sentiment` (the
    /// shipped task's lexicon).
    #[arg(long, value_parser = parse_reward_function)]
    reward_fn: Option<RewardFunction>,
    #[arg(long, default_value_t = 1)]
    samples_per_prompt: usize,
    #[arg(long, default_value_t = 48)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample i draws with seed + i.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Folder for `summary.json` and `samples.jsonl` (the summary goes to stdout as well);
    /// with `--plot`, the folder of `frontier.svg` (default: the current folder).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Draw the reward–KL points of earlier evaluations (`--out` folders of `aligner eval`, or
    /// their summary.json) and the paths of training runs (folders with `eval_frontier/...`
    /// in metrics.jsonl) on one SVG, instead of evaluating.
    #[arg(long, num_args = 1.., value_name = "RUN")]
    plot: Vec<PathBuf>,
    /// Replace the files of an earlier evaluation in `--out`.
    #[arg(long)]
    overwrite: bool,
}

fn parse_reward_function(name: &str) -> Result<RewardFunction, String> {
    RewardFunction::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = RewardFunction::ALL.iter().map(|(n, _)| *n).collect();
        format!("unknown reward function {name:?}; known: {}", known.join(", "))
    })
}

/// The reference a policy folder is measured against: the run's start model when `model` is
/// a run's `final/` with a recorded `model.path`, else the shipped model.
fn default_reference(model: &Path) -> Result<PathBuf> {
    let config = model.parent().map(|run| run.join("config.toml"));
    if let Some(config) = config.filter(|c| c.exists()) {
        let text =
            std::fs::read_to_string(&config).with_context(|| format!("reading {}", config.display()))?;
        let table: toml::Table = toml::from_str(&text).with_context(|| format!("{}", config.display()))?;
        if let Some(path) = table
            .get("model")
            .and_then(|m| m.get("path"))
            .and_then(|p| p.as_str())
        {
            return Ok(PathBuf::from(path));
        }
    }
    Ok(aligner_core::default_model_dir()?)
}

pub fn run(args: EvalArgs, device: &Device) -> Result<()> {
    if !args.plot.is_empty() {
        let dir = args.out.clone().unwrap_or_else(|| PathBuf::from("."));
        let inputs: Vec<&Path> = args.plot.iter().map(PathBuf::as_path).collect();
        crate::output::check_folder("--out", &dir, &["frontier.svg"], &inputs, args.overwrite)?;
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot write {}", dir.display()))?;
        let path = dir.join("frontier.svg");
        plot_frontier(&args.plot, &path)?;
        println!("{}", path.display());
        return Ok(());
    }
    let section = FrontierSection {
        prompts: Some(
            args.prompts
                .clone()
                .unwrap_or_else(|| aligner_core::default_data_dir().join("test.prompts.jsonl")),
        ),
        samples_per_prompt: args.samples_per_prompt,
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        seed: args.seed,
        ..FrontierSection::default()
    };
    let options: FrontierOptions = section
        .options()
        .map_err(|e| anyhow::anyhow!("{}", e.to_string().replace("frontier.", "--").replace('_', "-")))?;
    let model_dir = aligner_core::model_dir_or_default(args.model.as_deref())?;
    let reference_dir = match &args.reference {
        Some(dir) => dir.clone(),
        None => default_reference(&model_dir)?,
    };
    if let Some(out) = &args.out {
        let inputs: Vec<&Path> = [
            Some(model_dir.as_path()),
            Some(reference_dir.as_path()),
            section.prompts.as_deref(),
            args.reward.as_deref(),
        ]
        .into_iter()
        .flatten()
        .collect();
        crate::output::check_folder(
            "--out",
            out,
            &["summary.json", "samples.jsonl"],
            &inputs,
            args.overwrite,
        )?;
    }
    let policy = aligner_core::LoadedModel::from_dir(&model_dir, device)
        .with_context(|| format!("loading model {}", model_dir.display()))?;
    aligner_core::train::check_new_tokens(&[("--max-new-tokens", args.max_new_tokens)], &policy.config)?;
    let reference = aligner_core::LoadedModel::from_dir(&reference_dir, device)
        .with_context(|| format!("loading reference {}", reference_dir.display()))?;
    let mut rewards = Vec::new();
    if let Some(dir) = &args.reward {
        rewards.push(
            SampleReward::model_dir(dir, device)
                .with_context(|| format!("loading reward model {}", dir.display()))?,
        );
    }
    if let Some(function) = args.reward_fn {
        rewards.push(SampleReward::Function(function));
    }
    let prompts_file = section.prompts.clone().expect("set above");
    let prompts = aligner_core::data::load_prompts(
        &prompts_file,
        &policy.tokenizer,
        policy.config.max_position_embeddings,
    )?;
    // The policy's tokenizer decodes its samples; the reference must share its vocabulary.
    let frontier = Frontier {
        reference: Reference {
            model: reference.model,
            config: policy.config.clone(),
            tokenizer: policy.tokenizer.clone(),
        },
        prompts,
        rewards,
        options,
    };
    let (summary, samples) = frontier.evaluate(&policy.model)?;
    let mut line = serde_json::to_value(&summary)?;
    line["model"] = json!(model_dir);
    line["reference"] = json!(reference_dir);
    let line = serde_json::to_string(&line)?;
    println!("{line}");
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out).with_context(|| format!("cannot write {}", out.display()))?;
        aligner_core::checkpoint::write_atomic(&out.join("summary.json"), format!("{line}\n").as_bytes())?;
        let rows: Vec<Value> = samples.iter().map(|s| json!(s)).collect();
        aligner_core::data::write_jsonl(&out.join("samples.jsonl"), &rows)?;
    }
    Ok(())
}

/// A labelled series of (KL per response, reward) points: one point for an evaluation, a
/// path for a training run.
struct Series {
    label: String,
    points: Vec<(f64, f64)>,
}

/// The reward of a summary or metrics row: the first reward it names.
fn frontier_point(kl: Option<f64>, reward: Option<f64>) -> Option<(f64, f64)> {
    Some((kl?, reward?)).filter(|(k, r)| k.is_finite() && r.is_finite())
}

/// What `path` holds: an evaluation (`summary.json`, or a folder of one) or a training run
/// (a folder whose `metrics.jsonl` has `eval_frontier/...` figures).
fn read_series(path: &Path) -> Result<Series> {
    let label = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let summary = match path.is_dir() {
        true => path.join("summary.json"),
        false => path.to_path_buf(),
    };
    if summary.is_file() {
        let text =
            std::fs::read_to_string(&summary).with_context(|| format!("reading {}", summary.display()))?;
        let value: Value =
            serde_json::from_str(text.trim()).with_context(|| format!("{}", summary.display()))?;
        let point = frontier_point(value["kl_per_response"].as_f64(), value["reward"].as_f64())
            .with_context(|| {
                format!(
                    "{}: no reward and kl_per_response (evaluate with --reward or --reward-fn)",
                    summary.display()
                )
            })?;
        return Ok(Series {
            label,
            points: vec![point],
        });
    }
    let metrics = path.join("metrics.jsonl");
    if !metrics.is_file() {
        bail!(
            "{}: neither an evaluation (summary.json) nor a run (metrics.jsonl)",
            path.display()
        );
    }
    let rows: Vec<serde_json::Map<String, Value>> = aligner_core::data::read_jsonl(&metrics)?;
    let reward_key = rows
        .iter()
        .flat_map(|r| r.keys())
        .find(|k| k.starts_with("eval_frontier/") && !FIGURES.contains(&&k["eval_frontier/".len()..]))
        .cloned()
        .with_context(|| {
            format!(
                "{}: no eval_frontier reward (was [frontier] set?)",
                metrics.display()
            )
        })?;
    let points = rows
        .iter()
        .filter_map(|r| frontier_point(r.get("eval_frontier/kl")?.as_f64(), r.get(&reward_key)?.as_f64()))
        .collect();
    Ok(Series { label, points })
}

/// The `eval_frontier/...` figures that are not rewards.
const FIGURES: [&str; 6] = ["kl", "kl_per_token", "nll", "distinct_2", "tokens", "eos"];

/// Draws every series on one reward-against-KL chart at `path`.
fn plot_frontier(inputs: &[PathBuf], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let series: Vec<Series> = inputs.iter().map(|p| read_series(p)).collect::<Result<_>>()?;
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).collect();
    if all.is_empty() {
        bail!("nothing to plot: no frontier points in {inputs:?}");
    }
    let (x1, y0, y1) = all.iter().fold((0.0f64, f64::MAX, f64::MIN), |(x, a, b), p| {
        (x.max(p.0), a.min(p.1), b.max(p.1))
    });
    let pad = ((y1 - y0) * 0.1).max(0.1);
    let err = |e: String| anyhow::anyhow!("plot {}: {e}", path.display());
    let root = SVGBackend::new(path, (800, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let x_min = all.iter().map(|p| p.0).fold(0.0f64, f64::min);
    let mut chart = ChartBuilder::on(&root)
        .caption("reward against KL to the reference", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(x_min..(x1 * 1.1).max(x_min + 1.0), (y0 - pad)..(y1 + pad))
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("KL(π ‖ π_ref), nats per response")
        .y_desc("reward")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        if s.points.len() > 1 {
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?;
        }
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(e.to_string()))?
            .label(s.label.clone())
            .legend(move |(x, y)| Circle::new((x, y), 4, color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}
