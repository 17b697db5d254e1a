//! `aligner eval`: where a policy stands on the reward–KL frontier. It samples the held-out
//! prompts with the engine, then reports the reward of those samples (when a reward model is
//! given), their KL to the reference (the mean of log π(y) − log π_ref(y) over the policy's own
//! samples, per response and per token), the reference's per-token NLL of them (fluency), and
//! distinct-1/2, length and the EOS fraction. Reward alone is never the figure.

use std::path::{Path, PathBuf};

use aligner_core::data::load_prompts;
use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::{Device, LoadedModel};
use aligner_gen::{Engine, EngineOptions, GenerationRequest, SamplingParams, StopReason};
use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;
use serde_json::json;

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
    #[arg(long, default_value_t = 1)]
    samples_per_prompt: usize,
    #[arg(long, default_value_t = 48)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample i draws with seed + i.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Folder for `summary.json` and `samples.jsonl` (the summary goes to stdout as well).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The figures of one evaluation (`summary.json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub model: PathBuf,
    pub reference: PathBuf,
    pub samples: usize,
    /// Mean reward and its standard error (absent without `--reward`).
    pub reward: Option<f64>,
    pub reward_stderr: Option<f64>,
    /// Mean of log π(y) − log π_ref(y) over the samples, in nats per response, and per token.
    pub kl_per_response: f64,
    pub kl_per_token: f64,
    /// The reference's negative log-likelihood of the samples, in nats per token.
    pub reference_nll_per_token: f64,
    pub distinct_1: f64,
    pub distinct_2: f64,
    /// Mean response length in tokens, and the share of samples that ended with EOS.
    pub mean_tokens: f64,
    pub eos_fraction: f64,
}

/// One sample's figures (`samples.jsonl`).
#[derive(Debug, Clone, PartialEq, Serialize)]
struct Sample {
    prompt_line: usize,
    response: String,
    tokens: usize,
    eos: bool,
    policy_logprob: f64,
    reference_logprob: f64,
    reward: Option<f64>,
}

/// Distinct n-grams over all the samples' whitespace words divided by all n-grams (0 when
/// there are none): how varied the text is.
pub fn distinct_n(texts: &[&str], n: usize) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0usize;
    for text in texts {
        let words: Vec<&str> = text.split_whitespace().collect();
        for gram in words.windows(n) {
            seen.insert(gram.to_vec());
            total += 1;
        }
    }
    match total {
        0 => 0.0,
        _ => seen.len() as f64 / total as f64,
    }
}

/// Mean and standard error of the mean.
pub fn mean_and_stderr(values: &[f64]) -> (f64, f64) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, (var / n).sqrt())
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
    if args.samples_per_prompt == 0 {
        bail!("--samples-per-prompt must be at least 1");
    }
    let model_dir = aligner_core::model_dir_or_default(args.model.as_deref())?;
    let reference_dir = match &args.reference {
        Some(dir) => dir.clone(),
        None => default_reference(&model_dir)?,
    };
    let prompts_file = args
        .prompts
        .clone()
        .unwrap_or_else(|| aligner_core::default_data_dir().join("test.prompts.jsonl"));
    let policy = LoadedModel::from_dir(&model_dir, device)
        .with_context(|| format!("loading model {}", model_dir.display()))?;
    let reference = LoadedModel::from_dir(&reference_dir, device)
        .with_context(|| format!("loading reference {}", reference_dir.display()))?;
    let prompts = load_prompts(
        &prompts_file,
        &policy.tokenizer,
        policy.config.max_position_embeddings,
    )?;
    let n = args.samples_per_prompt;
    let requests: Vec<GenerationRequest> = (0..prompts.len() * n)
        .map(|i| GenerationRequest {
            prompt_ids: prompts[i / n].ids.clone(),
            params: SamplingParams {
                temperature: args.temperature,
                seed: args.seed.wrapping_add(i as u64),
                max_new_tokens: args.max_new_tokens,
                ..SamplingParams::default()
            },
            guidance: None,
        })
        .collect();
    if let Err(bad) = requests[0].params.check() {
        bail!("--{}: {bad}", bad.field.replace('_', "-"));
    }
    let mut engine = Engine::for_model(&policy, EngineOptions::default());
    let generations = engine.generate(&requests)?;
    // The reference's log-probs of the very tokens the policy drew.
    let sequences: Vec<ScoredSequence> = requests
        .iter()
        .zip(&generations)
        .map(|(r, g)| ScoredSequence {
            ids: r.prompt_ids.iter().chain(&g.token_ids).copied().collect(),
            prompt_len: r.prompt_ids.len(),
        })
        .collect();
    let reference_lp = response_logprobs(&reference.model, &sequences, 16)?;
    let rewards = match &args.reward {
        Some(dir) => Some(rewards_of(dir, &sequences, device)?),
        None => None,
    };
    let mut samples = Vec::with_capacity(generations.len());
    for (i, (g, r)) in generations.iter().zip(&reference_lp).enumerate() {
        samples.push(Sample {
            prompt_line: prompts[i / n].line,
            response: policy
                .tokenizer
                .decode_continuation(&requests[i].prompt_ids, &g.token_ids)?,
            tokens: g.token_ids.len(),
            eos: g.stop_reason == StopReason::Eos,
            policy_logprob: g.token_logprobs.iter().map(|&v| v as f64).sum(),
            reference_logprob: r.total(),
            reward: rewards.as_ref().map(|rw| rw[i]),
        });
    }
    let summary = summarize(&samples, &model_dir, &reference_dir);
    let line = serde_json::to_string(&summary)?;
    println!("{line}");
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out).with_context(|| format!("cannot write {}", out.display()))?;
        aligner_core::checkpoint::write_atomic(&out.join("summary.json"), format!("{line}\n").as_bytes())?;
        let rows: Vec<serde_json::Value> = samples.iter().map(|s| json!(s)).collect();
        aligner_core::data::write_jsonl(&out.join("samples.jsonl"), &rows)?;
    }
    Ok(())
}

/// The reward model's score of each sequence (its first output).
fn rewards_of(dir: &Path, sequences: &[ScoredSequence], device: &Device) -> Result<Vec<f64>> {
    let reward = aligner_core::start::LoadedRewardModel::from_dir(dir, device)
        .with_context(|| format!("loading reward model {}", dir.display()))?;
    let rows: Vec<&[u32]> = sequences.iter().map(|s| s.ids.as_slice()).collect();
    Ok(reward
        .model
        .score_rows(&rows, 16)?
        .iter()
        .map(|row| row[0] as f64)
        .collect())
}

fn summarize(samples: &[Sample], model: &Path, reference: &Path) -> Summary {
    let count = samples.len().max(1) as f64;
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let kl_total: f64 = samples
        .iter()
        .map(|s| s.policy_logprob - s.reference_logprob)
        .sum();
    let reference_total: f64 = samples.iter().map(|s| s.reference_logprob).sum();
    let rewards: Option<Vec<f64>> = samples.iter().map(|s| s.reward).collect();
    let (reward, reward_stderr) = match rewards {
        Some(values) if !values.is_empty() => {
            let (mean, stderr) = mean_and_stderr(&values);
            (Some(mean), Some(stderr))
        }
        _ => (None, None),
    };
    let texts: Vec<&str> = samples.iter().map(|s| s.response.as_str()).collect();
    Summary {
        model: model.to_path_buf(),
        reference: reference.to_path_buf(),
        samples: samples.len(),
        reward,
        reward_stderr,
        kl_per_response: kl_total / count,
        kl_per_token: kl_total / tokens.max(1) as f64,
        reference_nll_per_token: -reference_total / tokens.max(1) as f64,
        distinct_1: distinct_n(&texts, 1),
        distinct_2: distinct_n(&texts, 2),
        mean_tokens: tokens as f64 / count,
        eos_fraction: samples.iter().filter(|s| s.eos).count() as f64 / count,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_n_counts_unique_ngrams_over_all_samples() {
        assert_eq!(distinct_n(&["a b a b"], 1), 0.5);
        // Bigrams: (a b) (b a) (a b) | (a b): 2 unique of 4.
        assert_eq!(distinct_n(&["a b a b", "a b"], 2), 0.5);
        assert_eq!(distinct_n(&["a"], 2), 0.0);
    }

    #[test]
    fn mean_and_stderr_by_hand() {
        let (mean, stderr) = mean_and_stderr(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(mean, 2.5);
        // Sample variance 5/3, over n = 4.
        assert!((stderr - (5.0f64 / 3.0 / 4.0).sqrt()).abs() < 1e-12);
    }
}
