//! `aligner score`.

use std::path::PathBuf;

use aligner_core::data::{PromptResponseRow, read_jsonl_numbered};
use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::{Device, LoadedModel};
use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

#[derive(Args)]
pub struct ScoreArgs {
    /// HF model folder (default: the shipped stories260K).
    #[arg(long)]
    model: Option<PathBuf>,
    /// JSON Lines of {"prompt", "response"}.
    #[arg(long)]
    data: PathBuf,
    /// JSON Lines output (stdout otherwise): {"logprob", "n_tokens"} per input line.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace `--out` when it exists.
    #[arg(long)]
    overwrite: bool,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
}

pub fn run(args: ScoreArgs, device: &Device) -> Result<()> {
    let dir = aligner_core::model_dir_or_default(args.model.as_deref())?;
    if let Some(out) = &args.out {
        crate::output::check_file("--out", out, &[&dir, &args.data], args.overwrite)?;
    }
    let config = aligner_core::LlamaConfig::from_file(&dir.join("config.json"))?;
    let is_classifier = config
        .architectures
        .iter()
        .flatten()
        .any(|a| a.ends_with("ForSequenceClassification"));
    if is_classifier {
        return score_rewards(&args, &dir, &config, device);
    }
    let lm =
        LoadedModel::from_dir(&dir, device).with_context(|| format!("loading model {}", dir.display()))?;
    let seqs = scored_rows(&args.data, &lm.tokenizer, &lm.config)?;
    let bar = aligner_core::run::progress_bar(
        seqs.len() as u64,
        "{bar:30} {pos}/{len} sequences [{elapsed} < {eta}]",
    );
    let mut out = Vec::with_capacity(seqs.len());
    for chunk in seqs.chunks(args.batch_size.max(1)) {
        for (seq, lp) in chunk
            .iter()
            .zip(response_logprobs(&lm.model, chunk, chunk.len())?)
        {
            out.push(json!({"logprob": lp.total(), "n_tokens": seq.n_response_tokens()}));
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    crate::write_jsonl(args.out.as_deref(), &out)
}

/// Every line of `path` tokenized by the scoring convention (the prompt as the model sees it,
/// then the response); a line with nothing to score, or longer than the model's context, is an
/// error naming the file and line.
fn scored_rows(
    path: &std::path::Path,
    tokenizer: &aligner_core::TextTokenizer,
    config: &aligner_core::LlamaConfig,
) -> Result<Vec<ScoredSequence>> {
    let context = config.max_position_embeddings;
    read_jsonl_numbered::<PromptResponseRow>(path)?
        .into_iter()
        .map(|(line, row)| {
            let prompt = row.prompt.render(tokenizer)?;
            if prompt.is_empty() && row.response.is_empty() {
                bail!(
                    "{}:{line}: the prompt and the response are empty: nothing to score",
                    path.display()
                );
            }
            let seq = ScoredSequence::encode(tokenizer, &prompt, &row.response)?;
            // The whole sequence is scored, so it must fit in the context (not just leave room).
            let tokens = seq.ids.len();
            aligner_core::data::check_fits(path, line, "prompt with its response", tokens, context, 0)?;
            Ok(seq)
        })
        .collect()
}

/// Rewards (one output) or attributes (several) of a sequence-classifier folder.
fn score_rewards(
    args: &ScoreArgs,
    dir: &std::path::Path,
    config: &aligner_core::LlamaConfig,
    device: &Device,
) -> Result<()> {
    let labels = aligner_core::reward::labels_of(config);
    let outputs = labels.len().max(1);
    let model = aligner_core::reward::RewardModel::load(dir, config, outputs, device)
        .with_context(|| format!("loading reward model {}", dir.display()))?;
    let tokenizer = aligner_core::TextTokenizer::from_dir(dir)?;
    let rows = scored_rows(&args.data, &tokenizer, config)?;
    let mut out = Vec::with_capacity(rows.len());
    let bar = aligner_core::run::progress_bar(
        rows.len() as u64,
        "{bar:30} {pos}/{len} sequences [{elapsed} < {eta}]",
    );
    for chunk in rows.chunks(args.batch_size.max(1)) {
        let ids: Vec<&[u32]> = chunk.iter().map(|s| s.ids.as_slice()).collect();
        for row in model.score_rows(&ids, ids.len())? {
            out.push(if outputs == 1 {
                json!({"reward": row[0]})
            } else {
                let attrs: serde_json::Map<String, serde_json::Value> = labels
                    .iter()
                    .zip(row)
                    .map(|(l, v)| (l.clone(), json!(v)))
                    .collect();
                json!({"attributes": attrs})
            });
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    crate::write_jsonl(args.out.as_deref(), &out)
}
