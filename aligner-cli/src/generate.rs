//! `aligner generate`.

use std::path::PathBuf;
use std::time::Instant;

use std::collections::BTreeMap;

use aligner_core::Device;
use aligner_core::data::{Prompt, read_jsonl_numbered};
use aligner_gen::{Engine, EngineOptions, GenerationRequest, SamplingParams, WorkerPool};
use aligner_steerlm::Conditioning;
use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

#[derive(Args)]
pub struct GenerateArgs {
    /// HF model folder (default: the shipped stories260K).
    #[arg(long)]
    model: Option<PathBuf>,
    /// One prompt.
    #[arg(long, conflicts_with = "prompts")]
    prompt: Option<String>,
    /// JSON Lines file of {"prompt": ...}.
    #[arg(long)]
    prompts: Option<PathBuf>,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Prompt i samples with seed + i, so its output does not depend on the batch.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop once the response contains this text (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Sequences decoded together per worker (KV-cache rows; a finished row takes the next
    /// prompt at once).
    #[arg(long, alias = "slots", default_value_t = 64)]
    batch_size: usize,
    /// Engine workers sharing the prompt queue.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// SteerLM steering, e.g. `positivity:4,verbosity:2`: applied with the model folder's
    /// template (`steerlm.json`). A prompts file may give `"attributes"` per line instead.
    #[arg(long)]
    attributes: Option<String>,
    /// Classifier-free guidance of the steering: each token is drawn from
    /// `s · (log p(·|steered) − log p(·|negative)) + log p(·|negative)`, where the negative
    /// prompt is the steered one with `--negative-attributes` in place of those values. 1 = off;
    /// above 1 pushes the named attributes further toward the asked values.
    #[arg(long, default_value_t = 1.0)]
    guidance_scale: f32,
    /// The values `--guidance-scale` steers away from, e.g. `positivity:2` (the rest as asked;
    /// a prompts file may give `"negative_attributes"` per line).
    #[arg(long)]
    negative_attributes: Option<String>,
    /// JSON Lines output, one line per prompt in input order; stdout text otherwise.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace `--out` when it exists.
    #[arg(long)]
    overwrite: bool,
    /// What the model computes in: f32, or bf16 / f16 on GPU devices.
    #[arg(long, default_value = "f32", value_parser = crate::parse_precision)]
    pub dtype: aligner_core::config::Precision,
    /// Ranks per tensor group under `mpirun` (as `parallel.tensor`): each holds a block of
    /// every layer (its heads, its share of the MLP and of the vocabulary) and the group
    /// decodes together, one worker per rank; the prompts are split over the groups (under
    /// `mpirun` without it, over the ranks).
    #[arg(long, default_value_t = 1)]
    tensor: usize,
}

/// A prompt line, optionally with SteerLM attributes.
#[derive(serde::Deserialize)]
struct SteeredPrompt {
    prompt: Prompt,
    #[serde(default)]
    attributes: Option<BTreeMap<String, f64>>,
    #[serde(default)]
    negative_attributes: Option<BTreeMap<String, f64>>,
}

/// The sampling flags as the engine takes them, for prompt `i` (seed + i).
fn sampling_params(args: &GenerateArgs, i: usize) -> SamplingParams {
    SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed.wrapping_add(i as u64),
        max_new_tokens: args.max_new_tokens,
        stop_strings: args.stop.clone(),
        keep_cache: false,
    }
}

/// Refuses flag values no run can use, naming the flag, before anything is loaded; the
/// sampling values by the engine's own rules ([`SamplingParams::check`]).
fn check_flags(args: &GenerateArgs) -> Result<()> {
    if let Err(bad) = sampling_params(args, 0).check() {
        bail!(
            "--{} {}: must be {}",
            bad.field.replace('_', "-"),
            bad.value,
            bad.rule
        );
    }
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if args.workers == 0 {
        bail!("--workers 0: must be at least 1");
    }
    Ok(())
}

pub fn run(args: GenerateArgs, device: &Device) -> Result<()> {
    check_flags(&args)?;
    let dir = aligner_core::model_dir_or_default(args.model.as_deref())?;
    if let Some(out) = &args.out {
        let inputs: Vec<&std::path::Path> = [Some(dir.as_path()), args.prompts.as_deref()]
            .into_iter()
            .flatten()
            .collect();
        crate::output::check_file("--out", out, &inputs, args.overwrite)?;
    }
    if args.tensor > 1 && args.workers > 1 {
        bail!(
            "--workers {} with --tensor {}: a tensor group's ranks decode in lock step, with one worker each",
            args.workers,
            args.tensor
        );
    }
    // Under `mpirun`: the model split over this rank's tensor group (`--tensor`, each rank
    // reading only its blocks), and the ranks (or groups) the prompts are split over.
    let (lm, comm) = crate::score::load_placed(&dir, device, args.tensor)?;
    let lm = lm
        .in_precision(args.dtype, device)
        .map_err(|e| anyhow::anyhow!("--dtype: {e}"))?;
    aligner_core::train::check_new_tokens(&[("--max-new-tokens", args.max_new_tokens)], &lm.config)?;
    // Each prompt with the line of the prompts file it came from (1 for --prompt).
    let (rows, lines): (Vec<SteeredPrompt>, Vec<usize>) = match (&args.prompt, &args.prompts) {
        (Some(text), None) => (
            vec![SteeredPrompt {
                prompt: Prompt::Text(text.clone()),
                attributes: None,
                negative_attributes: None,
            }],
            vec![1],
        ),
        (None, Some(path)) => {
            let numbered = read_jsonl_numbered::<SteeredPrompt>(path)?;
            let lines = numbered.iter().map(|(line, _)| *line).collect();
            (numbered.into_iter().map(|(_, row)| row).collect(), lines)
        }
        (None, None) => bail!("give --prompt TEXT or --prompts FILE.jsonl"),
        (Some(_), Some(_)) => unreachable!("clap rejects both"),
    };
    let steered = args.attributes.is_some() || rows.iter().any(|r| r.attributes.is_some());
    let conditioning = match steered {
        true => Some(Conditioning::load(&dir)?),
        false => None,
    };
    let guided = args.guidance_scale != 1.0;
    if guided && !steered {
        bail!(
            "--guidance-scale strengthens SteerLM steering: give --attributes (or \"attributes\" in the prompts file)"
        );
    }
    if !args.guidance_scale.is_finite() || args.guidance_scale < 0.0 {
        bail!(
            "--guidance-scale must be a number of at least 0, not {}",
            args.guidance_scale
        );
    }
    if args.negative_attributes.is_some() && !guided {
        bail!("--negative-attributes only serves --guidance-scale (give one other than 1)");
    }
    let parse = |text: &Option<String>, flag: &str| -> Result<_> {
        Ok(match (&conditioning, text) {
            (Some(c), Some(text)) => Some(c.parse(text).with_context(|| flag.to_string())?),
            _ => None,
        })
    };
    let given = parse(&args.attributes, "--attributes")?;
    let given_negative = parse(&args.negative_attributes, "--negative-attributes")?;
    // Each prompt as steered and, when guided, against its negative form (`negative_values`;
    // against the prompt without attributes the samples garble: token log-prob -1.73 against
    // -1.10). `texts` are the prompts as the model sees them.
    let source = args.prompts.clone().unwrap_or_else(|| "--prompt".into());
    let mut texts: Vec<String> = Vec::with_capacity(rows.len());
    let mut requests: Vec<GenerationRequest> = Vec::with_capacity(rows.len());
    for (i, (row, &line)) in rows.iter().zip(&lines).enumerate() {
        let text = row.prompt.render(&lm.tokenizer)?;
        let values = row.attributes.as_ref().or(given.as_ref());
        let params = sampling_params(&args, i);
        let request = match (&conditioning, values) {
            (Some(c), Some(values)) => {
                let guidance = match guided {
                    false => None,
                    true => {
                        let Some(negative) = row.negative_attributes.as_ref().or(given_negative.as_ref())
                        else {
                            bail!(
                                "{}:{line}: --guidance-scale needs --negative-attributes (or \"negative_attributes\" on the line)",
                                source.display()
                            );
                        };
                        Some((negative, args.guidance_scale))
                    }
                };
                texts.push(c.apply(&text, values)?);
                c.request(&lm.tokenizer, &text, values, guidance, params)?
            }
            _ if guided => bail!(
                "{}:{line}: --guidance-scale needs the prompt's attributes",
                source.display()
            ),
            _ => {
                let prompt_ids = lm.tokenizer.encode(&text, true)?;
                texts.push(text);
                GenerationRequest {
                    prompt_ids,
                    params,
                    guidance: None,
                }
            }
        };
        let context = lm.config.max_position_embeddings;
        aligner_core::data::check_fits(&source, line, "prompt", request.prompt_ids.len(), context, 1)?;
        requests.push(request);
    }
    let prompts: Vec<&Prompt> = rows.iter().map(|r| &r.prompt).collect();

    // The model moves into the engine: on the CPU its weights are then held once.
    let engine = Engine::new(
        lm.model,
        lm.config.clone(),
        Some(lm.tokenizer.clone()),
        EngineOptions {
            slots: args.batch_size,
            cache_len: None,
            ..EngineOptions::default()
        },
    );
    let mut pool = WorkerPool::new(engine, args.workers);
    let bar = aligner_core::run::progress_bar(
        requests.len() as u64,
        "{bar:30} {pos}/{len} prompts {msg} [{elapsed} < {eta}]",
    );
    let start = Instant::now();
    let generated = std::sync::atomic::AtomicUsize::new(0);
    let progress = |g: &aligner_gen::Generation| {
        let total =
            generated.fetch_add(g.token_ids.len(), std::sync::atomic::Ordering::Relaxed) + g.token_ids.len();
        bar.inc(1);
        bar.set_message(format!(
            "{:.0} tokens/s",
            total as f64 / start.elapsed().as_secs_f64()
        ));
    };
    // Each rank (group) its share, in prompt order; every prompt samples with its own seed,
    // so who generates it does not change it.
    let mut report = aligner_gen::PoolReport::default();
    let outputs = aligner_core::parallel::map_sharded(comm.as_ref(), &requests, |mine| {
        let (outputs, done) = pool.generate(mine, &progress)?;
        report = done;
        Ok::<_, anyhow::Error>(outputs)
    })?;
    bar.finish_and_clear();
    tracing::info!(
        prompts = outputs.len(),
        tokens = report.tokens(),
        tokens_per_s = format!("{:.0}", report.tokens() as f64 / report.seconds),
        "generated"
    );
    for (w, worker) in report.workers.iter().enumerate() {
        tracing::info!(
            worker = w,
            prompts = worker.prompts,
            tokens = worker.tokens,
            "worker"
        );
    }

    // The world's rank 0 alone prints or writes.
    let printer = aligner_parallel::world().is_root();
    let mut rows = Vec::with_capacity(outputs.len());
    for (((prompt, text), request), out) in prompts.iter().zip(&texts).zip(&requests).zip(&outputs) {
        let response = lm
            .tokenizer
            .decode_continuation(&request.prompt_ids, &out.token_ids)?;
        match &args.out {
            Some(_) => rows.push(json!({
                "prompt": prompt,
                "response": response,
                "token_ids": out.token_ids,
                "token_logprobs": out.token_logprobs,
                "stop_reason": out.stop_reason,
            })),
            None if printer => println!("{text}{response}\n"),
            None => {}
        }
    }
    if let Some(path) = &args.out
        && printer
    {
        crate::write_jsonl(Some(path), &rows)?;
    }
    Ok(())
}
