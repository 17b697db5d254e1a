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
    /// Ranks per tensor group under `mpirun` (as `parallel.tensor`): each holds a block of
    /// every layer of the model; the rows are split over the groups (under `mpirun` without
    /// it, over the ranks).
    #[arg(long, default_value_t = 1)]
    tensor: usize,
}

/// The ranks the rows are split over, and the model split over this rank's tensor group.
pub(crate) fn placed<M: burn::module::Module>(
    model: M,
    config: &aligner_core::LlamaConfig,
    tensor: usize,
) -> Result<(M, std::sync::Arc<dyn aligner_parallel::Communicator>)> {
    let world = aligner_parallel::world();
    if tensor <= 1 {
        return Ok((model, world));
    }
    aligner_core::train::check_tensor_heads(config, tensor, &format!("--tensor {tensor}"))?;
    let grid = aligner_parallel::Grid::split(world.as_ref(), tensor)
        .map_err(|e| anyhow::anyhow!("--tensor {tensor}: {e}"))?;
    let model = aligner_core::train::tensor::split_parameters(model, grid.tensor)
        .with_context(|| format!("--tensor {tensor}"))?;
    Ok((model, grid.data))
}

/// The causal LM of `dir` loaded for this rank, and the ranks the rows are split over: under
/// `--tensor T`, the tensor groups are formed first and each rank reads only its blocks of
/// the split weights (no rank holds the whole model, even while loading).
pub(crate) fn load_placed(
    dir: &std::path::Path,
    device: &Device,
    tensor: usize,
) -> Result<(LoadedModel, std::sync::Arc<dyn aligner_parallel::Communicator>)> {
    let world = aligner_parallel::world();
    let loading = || format!("loading model {}", dir.display());
    if tensor <= 1 {
        return Ok((LoadedModel::from_dir(dir, device).with_context(loading)?, world));
    }
    let config = aligner_core::LlamaConfig::from_file(&dir.join("config.json"))?;
    aligner_core::train::check_tensor_heads(&config, tensor, &format!("--tensor {tensor}"))?;
    let grid = aligner_parallel::Grid::split(world.as_ref(), tensor)
        .map_err(|e| anyhow::anyhow!("--tensor {tensor}: {e}"))?;
    let lm = LoadedModel::from_dir_split(dir, device, &grid.tensor)
        .with_context(loading)
        .with_context(|| format!("--tensor {tensor}"))?;
    Ok((lm, grid.data))
}

/// `rows` scored `batch` at a time by `score`, split over the ranks of `comm` (the results in
/// order on every rank), with a progress bar.
fn score_split<T>(
    comm: &dyn aligner_parallel::Communicator,
    rows: &[T],
    batch: usize,
    score: impl Fn(&[T]) -> Result<Vec<serde_json::Value>>,
) -> Result<Vec<serde_json::Value>> {
    let bar = aligner_core::run::progress_bar(
        rows.len() as u64,
        "{bar:30} {pos}/{len} sequences [{elapsed} < {eta}]",
    );
    let out = aligner_core::parallel::map_sharded(comm, rows, |mine| {
        let mut out = Vec::with_capacity(mine.len());
        for chunk in mine.chunks(batch.max(1)) {
            out.extend(score(chunk)?);
            bar.inc(chunk.len() as u64);
        }
        Ok::<_, anyhow::Error>(out)
    })?;
    bar.finish_and_clear();
    Ok(out)
}

/// Writes the scores (rank 0 of a run under `mpirun`).
fn write_scores(out: Option<&std::path::Path>, rows: &[serde_json::Value]) -> Result<()> {
    match aligner_parallel::world().is_root() {
        true => crate::write_jsonl(out, rows),
        false => Ok(()),
    }
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
    let (lm, comm) = load_placed(&dir, device, args.tensor)?;
    let seqs = scored_rows(&args.data, &lm.tokenizer, &lm.config)?;
    let model = lm.model;
    let out = score_split(comm.as_ref(), &seqs, args.batch_size, |chunk| {
        Ok(chunk
            .iter()
            .zip(response_logprobs(&model, chunk, chunk.len())?)
            .map(|(seq, lp)| json!({"logprob": lp.total(), "n_tokens": seq.n_response_tokens()}))
            .collect())
    })?;
    write_scores(args.out.as_deref(), &out)
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
    let (model, comm) = placed(model, config, args.tensor)?;
    let out = score_split(comm.as_ref(), &rows, args.batch_size, |chunk| {
        let ids: Vec<&[u32]> = chunk.iter().map(|s| s.ids.as_slice()).collect();
        Ok(model
            .score_rows(&ids, ids.len())?
            .into_iter()
            .map(|row| {
                if outputs == 1 {
                    json!({"reward": row[0]})
                } else {
                    let attrs: serde_json::Map<String, serde_json::Value> = labels
                        .iter()
                        .zip(row)
                        .map(|(l, v)| (l.clone(), json!(v)))
                        .collect();
                    json!({"attributes": attrs})
                }
            })
            .collect())
    })?;
    write_scores(args.out.as_deref(), &out)
}
