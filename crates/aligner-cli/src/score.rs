//! `aligner score`.

use std::path::PathBuf;

use aligner_core::data::{PromptResponseRow, read_jsonl};
use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::{Device, LoadedModel};
use anyhow::{Context, Result};
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
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
}

pub fn run(args: ScoreArgs, device: &Device) -> Result<()> {
    let dir = crate::model_dir(args.model.clone())?;
    let lm =
        LoadedModel::from_dir(&dir, device).with_context(|| format!("loading model {}", dir.display()))?;
    let rows = read_jsonl::<PromptResponseRow>(&args.data)?;
    let seqs: Vec<ScoredSequence> = rows
        .iter()
        .map(|r| ScoredSequence::encode(&lm.tokenizer, &r.prompt.render(&lm.tokenizer)?, &r.response))
        .collect::<Result<_, _>>()?;
    let bar = crate::progress(
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
