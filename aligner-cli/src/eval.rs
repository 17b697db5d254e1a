//! `aligner eval`: where a policy stands on the reward–KL frontier (aligner-gen's
//! [`Frontier`]): reward of its own samples on held-out prompts against their KL to the
//! reference, with the reference's NLL of them, distinct-n, length and EOS. `--plot` draws
//! several evaluations (and training runs' paths) on one chart.

use std::path::{Path, PathBuf};

use aligner_core::Device;
use aligner_gen::Reward;
use aligner_gen::frontier::{FrontierOptions, Reference, RewardFunction};
use aligner_gen::reward::{FunctionReward, ModelReward};
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

pub fn run(args: EvalArgs, device: &Device) -> Result<()> {
    if !args.plot.is_empty() {
        let dir = args.out.clone().unwrap_or_else(|| PathBuf::from("."));
        let inputs: Vec<&Path> = args.plot.iter().map(PathBuf::as_path).collect();
        crate::output::check_folder("--out", &dir, &["frontier.svg"], &inputs, args.overwrite)?;
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot write {}", dir.display()))?;
        let path = dir.join("frontier.svg");
        let series = args
            .plot
            .iter()
            .map(|p| aligner_gen::frontier::frontier_series(p))
            .collect::<Result<Vec<_>, _>>()?;
        if series.iter().all(|s| s.points.is_empty()) {
            bail!("nothing to plot: no frontier points in {:?}", args.plot);
        }
        aligner_gen::frontier::plot_frontier(&series, &path)?;
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
        // The run's start model when `--model` is a run's `final/`, else the shipped model.
        None => match aligner_core::run::start_model_of(&model_dir)? {
            Some(start) => start,
            None => aligner_core::default_model_dir()?,
        },
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
            ModelReward::from_dir("reward", dir, device)
                .with_context(|| format!("loading reward model {}", dir.display()))?
                .boxed(),
        );
    }
    if let Some(function) = args.reward_fn {
        rewards.push(FunctionReward(function).boxed());
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
