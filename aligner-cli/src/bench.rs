//! `aligner bench`: speed tables on the shipped model and a random ~16M-parameter Llama (or,
//! asked for by name, a random Qwen2.5-0.5B-shaped or ~1.1B Llama model, or any model folder).

use std::time::Instant;

use aligner_core::config::Precision;
use aligner_core::train::{Checkpointing, Sharding, TrainSection};
use aligner_core::{CausalLm, Device, LlamaConfig, LoadedModel, model::parameter_count};
use aligner_gen::{Engine, EngineOptions, GenerationRequest, SamplingParams, WorkerPool};
use anyhow::Result;
use burn::tensor::{Distribution, Int, Tensor};
use clap::Subcommand;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchCommand,
    /// Only the models whose name contains this (`stories260K`, `random-16M`); `random-0.5B`
    /// (Qwen2.5-0.5B's shape) and `random-1B` are built only when named exactly.
    #[arg(long, global = true, default_value = "")]
    only: String,
    /// Benchmark this Hugging Face model folder (any family aligner loads) instead of the
    /// built-in models.
    #[arg(long, global = true)]
    model: Option<std::path::PathBuf>,
    /// What the models compute in: f32, or bf16 / f16 on GPU devices (f32 master weights
    /// when training).
    #[arg(long, global = true, default_value = "f32", value_parser = crate::parse_precision)]
    dtype: Precision,
    /// Attention on GPU devices: aligner's flash-attention kernels (`kernel`) or Burn's
    /// composed ops (`burn`), to measure one against the other.
    #[arg(long, global = true, default_value = "kernel", value_parser = ["kernel", "burn"])]
    attention: String,
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Forward-pass tokens/s (batch × seq tokens per pass).
    Forward {
        #[arg(long, value_parser = at_least_one, default_value_t = 8)]
        batch: usize,
        #[arg(long, value_parser = at_least_one, default_value_t = 128)]
        seq: usize,
        /// Timed passes after one warm-up pass.
        #[arg(long, value_parser = at_least_one, default_value_t = 5)]
        iters: usize,
    },
    /// SFT training tokens/s (forward + backward + AdamW step) at batch × seq tokens per step.
    /// Under `mpirun -np N` the batch is split over the ranks (batch / N each) and the
    /// gradients are all-reduced every step; the table adds the all-reduce's time and bytes.
    Train {
        #[arg(long, value_parser = at_least_one, default_value_t = 8)]
        batch: usize,
        #[arg(long, value_parser = at_least_one, default_value_t = 128)]
        seq: usize,
        /// Timed steps after one warm-up step.
        #[arg(long, value_parser = at_least_one, default_value_t = 5)]
        steps: usize,
        /// Recompute activations in the backward (`train.activation_checkpointing`): `layers`
        /// (the flag alone) reruns each decoder layer from its input, `balanced` is Burn's
        /// strategy.
        #[arg(long, default_value = "off", num_args = 0..=1, default_missing_value = "layers",
              value_parser = Checkpointing::parse)]
        activation_checkpointing: Checkpointing,
        /// What each rank keeps only its share of under `mpirun` (`train.sharding`: none,
        /// optimizer, gradients, full).
        #[arg(long, default_value = "none", value_parser = parse_sharding)]
        sharding: Sharding,
        /// With `--sharding full`: keep each layer's gathered weight for its backward
        /// (`train.keep_gathered`).
        #[arg(long)]
        keep_gathered: bool,
        /// Gradient buckets of this many MiB summed while the backward pass goes on, with
        /// sharding none or optimizer (`train.bucket_mb`; 0 = after the backward): the table
        /// adds the seconds of the sums that overlapped the backward.
        #[arg(long, default_value_t = aligner_core::train::config::DEFAULT_BUCKET_MB)]
        bucket_mb: f64,
        /// Ranks per tensor group under `mpirun` (`parallel.tensor`): each holds a block of
        /// every layer; `--batch` is split over the `ranks / tensor` groups.
        #[arg(long, value_parser = at_least_one, default_value_t = 1)]
        tensor: usize,
        /// The device's peak dense TFLOP/s (990 for an H200 in bf16): adds model FLOPs
        /// utilisation (6 · params + attention, per token) to the table.
        #[arg(long)]
        peak_tflops: Option<f64>,
    },
    /// DPO step time (policy forward + backward + AdamW on chosen and rejected; reference
    /// log-probs are cached before training, so they cost nothing per step).
    Dpo {
        /// Preference pairs per step.
        #[arg(long, value_parser = at_least_one, default_value_t = 8)]
        pairs: usize,
        #[arg(long, value_parser = at_least_one, default_value_t = 128)]
        seq: usize,
        #[arg(long, value_parser = at_least_one, default_value_t = 5)]
        steps: usize,
        /// As `train --activation-checkpointing`.
        #[arg(long, default_value = "off", num_args = 0..=1, default_missing_value = "layers",
              value_parser = Checkpointing::parse)]
        activation_checkpointing: Checkpointing,
    },
    /// An RL update's step time over a rollout whose responses differ in length (single-turn
    /// answers that stop early, multi-turn episodes), padded (prompts and responses each to the
    /// longest) against packed into rows (`ppo.pack_sequences`): the token slots computed, the
    /// share that is padding and ms per step (the policy's log-probs of the response tokens,
    /// backward, AdamW).
    Rollout {
        /// Sequences per step.
        #[arg(long, value_parser = at_least_one, default_value_t = 32)]
        sequences: usize,
        /// Prompt tokens of each sequence.
        #[arg(long, value_parser = at_least_one, default_value_t = 32)]
        prompt: usize,
        /// Response lengths are spread evenly from `min_response` to `max_response` tokens.
        #[arg(long, value_parser = at_least_one, default_value_t = 8)]
        min_response: usize,
        #[arg(long, value_parser = at_least_one, default_value_t = 224)]
        max_response: usize,
        #[arg(long, value_parser = at_least_one, default_value_t = 5)]
        steps: usize,
    },
    /// Multi-turn episodes on the shipped model (or `--model`) in an environment that takes
    /// time to answer: run in lock step (every turn of the batch decoded, then every turn
    /// answered) against in flight (each episode's next turn starts when its own answer comes,
    /// the others decoding meanwhile). Each turn's answer takes between 0 and twice
    /// `latency_ms` (fixed per episode and turn); the turns of one batch are answered side by
    /// side, as an endpoint or a tool would.
    Episodes {
        #[arg(long, value_parser = at_least_one, default_value_t = 64)]
        episodes: usize,
        /// Model turns per episode.
        #[arg(long, value_parser = at_least_one, default_value_t = 4)]
        turns: usize,
        /// New tokens per turn at most (sampled, so turns end at different lengths).
        #[arg(long, value_parser = at_least_one, default_value_t = 24)]
        new_tokens: usize,
        #[arg(long, default_value_t = 20)]
        latency_ms: u64,
        /// Engine slots (sequences decoded together).
        #[arg(long, value_parser = at_least_one, default_value_t = 64)]
        slots: usize,
    },
    /// Generation tokens/s for `prompts` prompts × `new_tokens` at several batch sizes.
    Generate {
        #[arg(long, value_parser = at_least_one, default_value_t = 64)]
        prompts: usize,
        #[arg(long, value_parser = at_least_one, default_value_t = 128)]
        new_tokens: usize,
        /// Engine slots (sequences decoded together).
        #[arg(long, value_parser = at_least_one, value_delimiter = ',', default_value = "1,8,64")]
        batch_sizes: Vec<usize>,
        /// Engine workers sharing the queue.
        #[arg(long, value_parser = at_least_one, default_value_t = 1)]
        workers: usize,
    },
}

/// A count of the benchmark (tokens, steps, batch, slots): 0 is refused, naming the flag.
fn at_least_one(value: &str) -> std::result::Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `--sharding`'s value, as `train.sharding` spells it.
fn parse_sharding(value: &str) -> std::result::Result<Sharding, String> {
    // As `train.sharding` reads it (serde's names), like `--dtype`.
    serde_json::from_value(serde_json::Value::String(value.to_string()))
        .map_err(|_| format!("{value:?}: expected none, optimizer or gradients"))
}

/// The ~16M-parameter Llama of the benchmarks: hidden 256, 4 layers, 4 heads, 2 KV heads,
/// FFN 688, GPT-2's vocabulary of 50257, tied embeddings.
pub fn random_16m_config() -> LlamaConfig {
    let mut config = LlamaConfig::llama(50257, 256, 4, 4, 2, 688);
    config.tie_word_embeddings = Some(true);
    config
}

/// A random ~1.1B-parameter Llama for GPU benchmarks (TinyLlama's shape: hidden 2048, 22
/// layers, 32 heads, 4 KV heads, FFN 5632, vocabulary 32000); built only when asked for by
/// name (`--only random-1B`).
pub fn random_1b_config() -> LlamaConfig {
    LlamaConfig::llama(32000, 2048, 22, 32, 4, 5632)
}

/// A random model of Qwen2.5-0.5B's shape (494M parameters: hidden 896, 24 layers, 14 heads,
/// 2 KV heads, FFN 4864, q/k/v biases, a 151,936-token vocabulary, tied embeddings); built only
/// when asked for by name (`--only random-0.5B`). `tools/real_size.py make` writes the same
/// shape with transformers.
pub fn random_05b_config() -> LlamaConfig {
    let mut config = LlamaConfig::llama(151_936, 896, 24, 14, 2, 4864);
    config.model_type = "qwen2".into();
    config.architectures = Some(vec!["Qwen2ForCausalLM".into()]);
    config.tie_word_embeddings = Some(true);
    config.rope_theta = Some(1_000_000.0);
    config.rms_norm_eps = 1e-6;
    config
}

/// Which benchmark models: a folder, or those whose name contains `only`, computing in
/// `precision`.
pub struct Selection {
    only: String,
    model: Option<std::path::PathBuf>,
    precision: Precision,
}

/// The selected benchmark models; the others are not built.
fn models(device: &Device, selection: &Selection) -> Result<Vec<(String, LlamaConfig, CausalLm)>> {
    let built = match &selection.model {
        Some(dir) => {
            let loaded = LoadedModel::from_dir(dir, device)?;
            let name = dir
                .file_name()
                .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
            vec![(name, loaded.config, loaded.model)]
        }
        None => models_f32(device, &selection.only)?,
    };
    built
        .into_iter()
        .map(|(name, mut config, mut model)| {
            aligner_core::model::compute_in(selection.precision, &mut config, &mut model.model, device)
                .map_err(|e| anyhow::anyhow!("--dtype: {e}"))?;
            Ok((name, config, model))
        })
        .collect()
}

fn models_f32(device: &Device, only: &str) -> Result<Vec<(String, LlamaConfig, CausalLm)>> {
    let mut out = Vec::new();
    if "stories260K".contains(only) {
        let shipped = LoadedModel::from_dir(&aligner_core::default_model_dir()?, device)?;
        out.push(("stories260K".to_string(), shipped.config, shipped.model));
    }
    if "random-16M".contains(only) {
        let config = random_16m_config();
        device.seed(0);
        let mut random = CausalLm::new(&config, device);
        aligner_core::checkpoint::name_parameters(&mut random);
        out.push(("random-16M".to_string(), config, random));
    }
    if only == "random-0.5B" {
        let config = random_05b_config();
        device.seed(0);
        let mut random = CausalLm::new(&config, device);
        aligner_core::checkpoint::name_parameters(&mut random);
        out.push(("random-0.5B".to_string(), config, random));
    }
    if only == "random-1B" {
        let config = random_1b_config();
        device.seed(0);
        let random = CausalLm::new(&config, device);
        out.push(("random-1B".to_string(), config, random));
    }
    if out.is_empty() {
        anyhow::bail!(
            "--only {only:?} names no benchmark model: stories260K, random-16M (a part of either \
             name selects it), random-0.5B or random-1B (named exactly), or --model DIR"
        );
    }
    Ok(out)
}

pub fn run(args: BenchArgs, device: &Device) -> Result<()> {
    aligner_parallel::use_burn_attention(args.attention == "burn");
    // Refused before any table header is printed.
    args.dtype
        .check_device(device)
        .map_err(|e| anyhow::anyhow!("--dtype: {e}"))?;
    let only = &Selection {
        only: args.only,
        model: args.model,
        precision: args.dtype,
    };
    match args.what {
        BenchCommand::Forward { batch, seq, iters } => forward(device, only, batch, seq, iters),
        BenchCommand::Train {
            batch,
            seq,
            steps,
            activation_checkpointing,
            sharding,
            keep_gathered,
            bucket_mb,
            tensor,
            peak_tflops,
        } => train(
            device,
            only,
            (batch, seq, steps),
            TrainSection {
                activation_checkpointing,
                sharding,
                keep_gathered,
                bucket_mb,
                ..TrainSection::default()
            },
            tensor,
            peak_tflops,
        ),
        BenchCommand::Dpo {
            pairs,
            seq,
            steps,
            activation_checkpointing,
        } => dpo(device, only, (pairs, seq, steps), activation_checkpointing),
        BenchCommand::Rollout {
            sequences,
            prompt,
            min_response,
            max_response,
            steps,
        } => rollout(
            device,
            only,
            sequences,
            prompt,
            (min_response, max_response),
            steps,
        ),
        BenchCommand::Generate {
            prompts,
            new_tokens,
            batch_sizes,
            workers,
        } => generate(device, only, prompts, new_tokens, &batch_sizes, workers),
        BenchCommand::Episodes {
            episodes,
            turns,
            new_tokens,
            latency_ms,
            slots,
        } => crate::bench_episodes::run(
            device,
            only.model.as_deref(),
            crate::bench_episodes::Shape {
                episodes,
                turns,
                new_tokens,
                latency: std::time::Duration::from_millis(latency_ms),
                slots,
            },
        ),
    }
}

fn forward(device: &Device, only: &Selection, batch: usize, seq: usize, iters: usize) -> Result<()> {
    println!("| model | params | batch × seq | ms / forward | tokens/s |");
    println!("|---|---:|---:|---:|---:|");
    for (name, config, model) in models(device, only)? {
        let tokens = Tensor::<2, Int>::random(
            [batch, seq],
            Distribution::Uniform(0.0, config.vocab_size as f64),
            device,
        );
        let pass = || -> Result<()> {
            model
                .forward(tokens.clone())
                .into_data()
                .try_to_vec::<f32>()
                .map_err(|e| anyhow::anyhow!("{e:?}"))?;
            Ok(())
        };
        pass()?;
        let start = Instant::now();
        for _ in 0..iters.max(1) {
            pass()?;
        }
        let per = start.elapsed().as_secs_f64() / iters.max(1) as f64;
        println!(
            "| {name} | {} | {batch} × {seq} | {:.1} | {:.0} |",
            parameter_count(&model),
            per * 1e3,
            (batch * seq) as f64 / per
        );
    }
    Ok(())
}

fn generate(
    device: &Device,
    only: &Selection,
    prompts: usize,
    new_tokens: usize,
    batch_sizes: &[usize],
    workers: usize,
) -> Result<()> {
    println!(
        "| model | batch | workers | prompts × new tokens | seconds | tokens/s | ms / step (per-token latency) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (name, config, model) in models(device, only)? {
        // Fixed 8-token prompts of arbitrary ids; EOS is ignored so every sequence runs to length.
        let requests: Vec<GenerationRequest> = (0..prompts)
            .map(|i| GenerationRequest {
                prompt_ids: (0..8)
                    .map(|t| 1 + ((i * 31 + t * 17) % (config.vocab_size - 1)) as u32)
                    .collect(),
                params: SamplingParams {
                    seed: i as u64,
                    max_new_tokens: new_tokens,
                    ..SamplingParams::default()
                },
                guidance: None,
            })
            .collect();
        let mut model = Some(model);
        for (i, &batch) in batch_sizes.iter().enumerate() {
            let options = EngineOptions {
                slots: batch.max(1),
                cache_len: None,
                ..EngineOptions::default()
            };
            // The last engine takes the model itself: on the CPU its weights are then held once.
            let weights = match i + 1 == batch_sizes.len() {
                true => model.take(),
                false => model.clone(),
            }
            .ok_or_else(|| anyhow::anyhow!("no model left for batch size {batch}"))?;
            let engine = Engine::new(weights, config.clone(), None, options).with_eos_ids(vec![]);
            let mut pool = WorkerPool::new(engine, workers.max(1));
            let (_, report) = pool.generate(&requests, &|_| {})?;
            let secs = report.seconds;
            // Decode steps each sequence waited through: its tokens, in rounds of `batch` rows.
            let steps = prompts.div_ceil(batch.max(1) * workers.max(1)) * new_tokens;
            println!(
                "| {name} | {batch} | {workers} | {prompts} × {new_tokens} | {secs:.2} | {:.0} | {:.2} |",
                report.tokens() as f64 / secs,
                secs / steps as f64 * 1e3
            );
        }
    }
    Ok(())
}

/// Seconds per optimiser step of `objective` on `batch` (every rank's examples: each rank
/// takes its shard), after one warm-up step, for `model` moved to an autodiff device: the
/// step the trainers run ([`aligner_core::train::ObjectiveStep`]: forward, backward, the
/// data-parallel gradient sum, clipping, AdamW).
fn seconds_per_step<O: aligner_core::train::Objective<CausalLm>>(
    model: CausalLm,
    device: &Device,
    objective: &O,
    batch: &[O::Example],
    steps: usize,
    activation_checkpointing: Checkpointing,
) -> Result<f64> {
    let train = TrainSection {
        activation_checkpointing,
        ..TrainSection::default()
    };
    seconds_per_step_on(
        model,
        &train.autodiff_device(device),
        &train,
        1,
        objective,
        batch,
        steps,
    )
    .map(|timed| timed.seconds)
}

/// What [`seconds_per_step_on`] measured.
struct TimedSteps {
    seconds: f64,
    /// The overlapped gradient sums of the timed steps (with `train.bucket_mb` over ranks).
    overlap: Option<aligner_parallel::overlap::OverlapStats>,
}

/// [`seconds_per_step`] on a given autodiff device (with or without gradient checkpointing).
fn seconds_per_step_on<O: aligner_core::train::Objective<CausalLm>>(
    model: CausalLm,
    train_device: &Device,
    train: &TrainSection,
    tensor: usize,
    objective: &O,
    batch: &[O::Example],
    steps: usize,
) -> Result<TimedSteps> {
    use aligner_core::train::{Method, ObjectiveStep, Optimizer};

    // The step reads the run folder only to name a checkpoint on a non-finite loss.
    let run = aligner_core::run::RunDir::new(std::env::temp_dir().join("aligner-bench"))
        .in_tensor_groups(tensor)?;
    let ranks = run.comm().world_size();
    aligner_core::train::check_layout(train.sharding, ranks, tensor > 1)?;
    let config = TrainSection {
        batch_size: batch.len().div_ceil(ranks),
        shuffle: false,
        ..train.clone()
    };
    let total = steps.max(1) + 1;
    let mut step = ObjectiveStep::new(&config, objective, batch, &run, total, train_device);
    let mut optim = Optimizer::new(
        config.weight_decay,
        config.adam_epsilon,
        config.max_grad_norm,
        config.sharding,
        run.comm(),
    )
    .with_tensor_group(run.tensor_group())
    .with_overlap(aligner_core::train::config::bucket_elements(config.bucket_mb));
    let mut model = aligner_core::train::config::to_train_device(model, train_device);
    config.check()?;
    if optim.full() {
        model = aligner_core::train::full::shard_parameters(model, run.comm_handle())?;
        aligner_parallel::shard::keep_gathered(config.keep_gathered);
    }
    if let Some(group) = run.tensor_group() {
        model = aligner_core::train::tensor::split_parameters(model, group)?;
    }
    model = step.step(0, model, &mut optim)?.model;
    let warm = optim.overlap_stats();
    let start = Instant::now();
    for k in 1..total {
        model = step.step(k, model, &mut optim)?.model;
    }
    let seconds = start.elapsed().as_secs_f64() / (total - 1) as f64;
    aligner_parallel::shard::clear();
    aligner_parallel::tensor::clear();
    let overlap = optim
        .overlap_stats()
        .zip(warm)
        .map(|(now, warm)| now.since(&warm));
    Ok(TimedSteps { seconds, overlap })
}

/// `len` token ids of a fixed pseudo-random pattern for `salt`.
fn synthetic_ids(salt: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|t| 1 + ((salt * 131 + t * 37) % (vocab - 1)) as u32)
        .collect()
}

/// The process's peak resident memory in MB (Linux `VmHWM`), when known.
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Model FLOPs per trained token: 6 per parameter (forward and backward) plus attention's
/// 12 · layers · seq · hidden (PaLM's accounting).
fn flops_per_token(config: &LlamaConfig, params: usize, seq: usize) -> f64 {
    6.0 * params as f64 + 12.0 * (config.num_hidden_layers * seq * config.hidden_size) as f64
}

fn train(
    device: &Device,
    only: &Selection,
    (batch, seq, steps): (usize, usize, usize),
    train_config: TrainSection,
    tensor: usize,
    peak_tflops: Option<f64>,
) -> Result<()> {
    use aligner_core::sft::{SftExample, SftObjective};

    let comm = aligner_parallel::world();
    let ranks = comm.world_size();
    let groups = ranks / tensor.max(1);
    if !batch.is_multiple_of(groups.max(1)) {
        anyhow::bail!("--batch {batch} does not split evenly over {groups} data-parallel groups");
    }
    if comm.is_root() {
        println!(
            "| model | params | ranks × threads | batch × seq | activation checkpointing | sharding | ms / step | steps/s | tokens/s | MFU | reduce ms / step | overlapped ms / step | buckets sent in the backward | reduce MB / step | peak RSS MB (largest rank) |"
        );
        println!("|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    }
    for (name, config, model) in models(device, only)? {
        // The global batch (each rank trains on its shard of it).
        let examples: Vec<SftExample> = (0..batch)
            .map(|b| SftExample {
                ids: synthetic_ids(b, seq, config.vocab_size),
                trained: (0..seq).map(|t| t > 0).collect(),
                starts: vec![0],
                end: Vec::new(),
            })
            .collect();
        let params = parameter_count(&model);
        let before = comm.traffic();
        let train_device = train_config.autodiff_device(device);
        let timed_steps = seconds_per_step_on(
            model,
            &train_device,
            &train_config,
            tensor,
            &SftObjective,
            &examples,
            steps,
        )?;
        let per = timed_steps.seconds;
        let after = comm.traffic();
        let tokens_per_s = (batch * seq) as f64 / per;
        let mfu = peak_tflops
            .map(|peak| {
                format!(
                    "{:.1}%",
                    100.0 * tokens_per_s * flops_per_token(&config, params, seq) / (peak * 1e12)
                )
            })
            .unwrap_or_else(|| "–".into());
        // Every rank's peak; the largest is what a device must hold.
        let peaks = aligner_core::parallel::gather(comm.as_ref(), &peak_rss_mb())?;
        let rss = peaks
            .into_iter()
            .flatten()
            .reduce(f64::max)
            .map(|mb| format!("{mb:.0}"))
            .unwrap_or_else(|| "–".into());
        // The warm-up step's all-reduce is counted too.
        let timed = (steps.max(1) + 1) as f64;
        let mut reduce_ms = (after.seconds - before.seconds) / timed * 1e3;
        let mut reduce_mb = (after.bytes - before.bytes) as f64 / timed / 1e6;
        // The buckets go over a communicator of their own, counted by the overlap.
        let (overlapped, buckets) = match timed_steps.overlap.filter(|o| o.steps > 0) {
            Some(o) => {
                let n = o.steps as f64;
                reduce_ms += o.comm_seconds / n * 1e3;
                reduce_mb += o.bytes as f64 / n / 1e6;
                (
                    format!("{:.1}", o.overlapped_seconds() / n * 1e3),
                    format!("{} of {}", o.early_buckets / o.steps, o.buckets / o.steps),
                )
            }
            None => ("–".to_string(), "–".to_string()),
        };
        let threads = rayon::current_num_threads();
        if comm.is_root() {
            println!(
                "| {name} | {params} | {ranks} × {threads} | {batch} × {seq} | {} | {} | {:.1} | {:.2} | {:.0} | {mfu} | {reduce_ms:.1} | {overlapped} | {buckets} | {reduce_mb:.1} | {rss} |",
                train_config.activation_checkpointing.name(),
                match (train_config.keep_gathered, tensor) {
                    (true, _) => format!("{} (kept)", train_config.sharding.name()),
                    (false, 1) => train_config.sharding.name().to_string(),
                    (false, t) => format!("{}, tensor {t}", train_config.sharding.name()),
                },
                per * 1e3,
                1.0 / per,
                tokens_per_s,
            );
        }
    }
    Ok(())
}

/// The policy-gradient shape of an RL update (every response token's log-prob, advantage 1)
/// over a padded or a packed layout.
struct RolloutObjective {
    packed: bool,
}

impl RolloutObjective {
    /// The response tokens' mean negative log-prob.
    fn nll(&self, model: &CausalLm, batch: &[&aligner_ppo::rollout::Sequence]) -> Tensor<1> {
        use aligner_ppo::rollout::{Layout, Packed};
        let device = model.model.embed_tokens.weight.device();
        let seqs: Vec<_> = batch.iter().map(|s| (*s).clone()).collect();
        let layout = Layout::new(&seqs, &device);
        let lp = if self.packed {
            let p = Packed::new(&seqs, &device);
            p.response_columns(model.token_logprobs_with(p.tokens.clone(), &p.positions, Some(&p.mask)))
        } else {
            layout.response_columns(model.token_logprobs_with(
                layout.tokens.clone(),
                &layout.positions,
                Some(&layout.mask),
            ))
        };
        aligner_ppo::losses::masked_token_mean(lp, &layout.response_mask).neg()
    }
}

impl aligner_core::train::Objective<CausalLm> for RolloutObjective {
    type Example = aligner_ppo::rollout::Sequence;

    fn step(
        &self,
        model: &CausalLm,
        batch: &[&Self::Example],
    ) -> aligner_core::Result<aligner_core::train::StepOutput> {
        Ok(aligner_core::train::StepOutput {
            loss: self.nll(model, batch),
            metrics: Vec::new(),
            tokens: batch
                .iter()
                .map(|s| s.prompt_ids.len() + s.response_ids.len())
                .sum(),
        })
    }

    fn evaluate(
        &self,
        model: &CausalLm,
        batch: &[&Self::Example],
    ) -> aligner_core::Result<Vec<aligner_core::train::EvalSum>> {
        Ok(vec![aligner_core::train::EvalSum {
            name: "nll".into(),
            sum: self.nll(model, batch).into_scalar::<f32>() as f64 * batch.len() as f64,
            weight: batch.len() as f64,
        }])
    }
}

fn rollout(
    device: &Device,
    only: &Selection,
    sequences: usize,
    prompt: usize,
    (min_response, max_response): (usize, usize),
    steps: usize,
) -> Result<()> {
    use aligner_ppo::rollout::{Sequence, padding_fractions};
    println!("| model | layout | sequences (response tokens) | token slots | padding | ms / step |");
    println!("|---|---|---:|---:|---:|---:|");
    for (name, config, model) in models(device, only)? {
        let span = max_response.saturating_sub(min_response);
        let seqs: Vec<Sequence> = (0..sequences)
            .map(|i| {
                let response = min_response + span * i / sequences.saturating_sub(1).max(1);
                let ids = synthetic_ids(i, prompt.max(1) + response, config.vocab_size);
                Sequence {
                    prompt_ids: ids[..prompt.max(1)].to_vec(),
                    response_ids: ids[prompt.max(1)..].to_vec(),
                    observed: Vec::new(),
                }
            })
            .collect();
        let real: usize = seqs
            .iter()
            .map(|s| s.prompt_ids.len() + s.response_ids.len())
            .sum();
        let (padded, packed) = padding_fractions(&seqs, sequences);
        for (label, pack, padding) in [("padded", false, padded), ("packed", true, packed)] {
            let per = seconds_per_step(
                model.clone(),
                device,
                &RolloutObjective { packed: pack },
                &seqs,
                steps,
                Checkpointing::Off,
            )?;
            let slots = (real as f64 / (1.0 - padding)).round();
            println!(
                "| {name} | {label} | {sequences} ({min_response}–{max_response}) | {slots:.0} | {:.0}% | {:.1} |",
                padding * 100.0,
                per * 1e3
            );
        }
    }
    Ok(())
}

fn dpo(
    device: &Device,
    only: &Selection,
    (pairs, seq, steps): (usize, usize, usize),
    activation_checkpointing: Checkpointing,
) -> Result<()> {
    use aligner_core::score::ScoredSequence;
    use aligner_dpo::LossSpec;
    use aligner_dpo::objective::{DpoExample, DpoObjective};

    println!(
        "| model | params | pairs × seq | activation checkpointing | ms / step | pairs/s | peak RSS MB |"
    );
    println!("|---|---:|---:|---|---:|---:|---:|");
    for (name, config, model) in models(device, only)? {
        let seq_of = |salt: usize| ScoredSequence {
            ids: synthetic_ids(salt, seq, config.vocab_size),
            prompt_len: seq / 4,
            observed: Vec::new(),
        };
        let examples: Vec<DpoExample> = (0..pairs)
            .map(|i| DpoExample {
                chosen: seq_of(2 * i),
                rejected: seq_of(2 * i + 1),
                reference: Some((-100.0, -100.0)),
                rewards: None,
            })
            .collect();
        let objective = DpoObjective {
            loss: crate::registry::registry().build("dpo", &LossSpec::default())?,
            sft_weight: 0.0,
        };
        let params = parameter_count(&model);
        let per = seconds_per_step(
            model,
            device,
            &objective,
            &examples,
            steps,
            activation_checkpointing,
        )?;
        let rss = peak_rss_mb()
            .map(|mb| format!("{mb:.0}"))
            .unwrap_or_else(|| "–".into());
        println!(
            "| {name} | {params} | {pairs} × {seq} | {} | {:.1} | {:.1} | {rss} |",
            activation_checkpointing.name(),
            per * 1e3,
            pairs as f64 / per
        );
    }
    Ok(())
}
