//! The rollout engine: one KV cache of `slots` rows, continuous batching, refit in place.
//!
//! Every cache row holds one running sequence. All rows share one write cursor; a sequence
//! occupies the positions from its `start` to the cursor, and the attention mask hides
//! everything before its start (stale keys of the row's earlier occupants, left padding). When
//! a sequence finishes, the last row moves into its place, so running rows are always the first
//! ones and a decode step is one forward pass over exactly those rows; the next queued prompt
//! is prefilled and copied into the freed row at once, without waiting for the batch. When the
//! cursor reaches the end of the buffers, every row shifts left by the positions no running
//! sequence uses any more.

use std::time::{Duration, Instant};

use aligner_core::model::{KvCache, left_padded_layout};
use aligner_core::{CausalLm, LlamaConfig, LoadedModel, TextTokenizer};
use burn::module::Module;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{GenError, Result};
use crate::sampling::{SamplingParams, sample};

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an end-of-sequence token (kept in the output).
    Eos,
    /// The response contains one of the request's stop strings.
    StopString,
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// The model's context (`max_position_embeddings`) is full.
    ContextFull,
}

/// One prompt to complete.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
}

/// What one request produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub token_ids: Vec<u32>,
    /// Log-prob of each generated token under the model (before temperature and filtering).
    pub token_logprobs: Vec<f32>,
    pub stop_reason: StopReason,
}

/// How an engine is sized.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOptions {
    /// Sequences decoded together (rows of the KV cache).
    pub slots: usize,
    /// Positions per cache row; by default sized by the first run (prompt + response + slack)
    /// and grown only when a later run needs more.
    pub cache_len: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            slots: 64,
            cache_len: None,
        }
    }
}

/// Counters of what an engine has done since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Batched forward passes of one token per running row.
    pub decode_steps: usize,
    /// Forward passes over newly admitted prompts.
    pub prefills: usize,
    /// Prompts admitted while other sequences were running (continuous batching).
    pub admitted_mid_batch: usize,
    /// Times the rows shifted left to make room at the end of the cache.
    pub shifts: usize,
    /// Cache (re)allocations.
    pub allocations: usize,
}

/// A generation engine over one model: its weights, KV cache, EOS ids and (for stop strings)
/// tokenizer.
pub struct Engine {
    model: CausalLm,
    config: LlamaConfig,
    tokenizer: Option<TextTokenizer>,
    eos_ids: Vec<u32>,
    options: EngineOptions,
    cache: Option<KvCache>,
    device: Device,
    stats: EngineStats,
    /// The output projection `[hidden, vocab]` laid out contiguously (with tied embeddings it is
    /// otherwise a transposed view, which the logits GEMM would re-pack every step).
    head: Tensor<2>,
}

/// The output projection as one contiguous buffer.
fn packed_head(model: &CausalLm, device: &Device) -> Tensor<2> {
    Tensor::from_data(model.output_weight().into_data(), device)
}

/// A running sequence in a cache row.
struct Slot {
    request: usize,
    rng: ChaCha8Rng,
    out: Generation,
    /// First cache position of the sequence (its prompt's first token).
    start: usize,
    /// Position (RoPE index) the last sampled token takes when it is fed back.
    next_pos: usize,
}

impl Engine {
    /// An engine on `model`'s current weights (as [`Engine::refit`] takes them: autodiff state
    /// dropped, LoRA adapters merged).
    pub fn new(
        model: CausalLm,
        config: LlamaConfig,
        tokenizer: Option<TextTokenizer>,
        options: EngineOptions,
    ) -> Self {
        let model = inference_weights(&model);
        let eos_ids = match &tokenizer {
            Some(t) if !t.eos_ids().is_empty() => t.eos_ids().to_vec(),
            _ => config.eos_token_ids(),
        };
        let device = model.model.embed_tokens.weight.device();
        let cache = options
            .cache_len
            .map(|len| KvCache::new(&config, options.slots.max(1), len, &device));
        Self {
            config,
            tokenizer,
            eos_ids,
            options,
            stats: EngineStats {
                allocations: cache.is_some() as usize,
                ..EngineStats::default()
            },
            head: packed_head(&model, &device),
            model,
            cache,
            device,
        }
    }

    /// An engine for a loaded model folder (the weights are shared, not copied).
    pub fn for_model(lm: &LoadedModel, options: EngineOptions) -> Self {
        Self::new(
            lm.model.clone(),
            lm.config.clone(),
            Some(lm.tokenizer.clone()),
            options,
        )
    }

    /// Replaces the end-of-sequence ids (empty: never stop at EOS).
    pub fn with_eos_ids(mut self, eos_ids: Vec<u32>) -> Self {
        self.eos_ids = eos_ids;
        self
    }

    /// Another engine on the same weights with its own (not yet allocated) cache.
    pub fn replica(&self) -> Self {
        Self {
            model: self.model.clone(),
            config: self.config.clone(),
            tokenizer: self.tokenizer.clone(),
            eos_ids: self.eos_ids.clone(),
            options: EngineOptions {
                cache_len: None,
                ..self.options.clone()
            },
            cache: None,
            device: self.device.clone(),
            stats: EngineStats::default(),
            head: self.head.clone(),
        }
    }

    /// The weights the engine generates with.
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// What the engine has done so far.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Rows of the KV cache.
    pub fn slots(&self) -> usize {
        self.options.slots.max(1)
    }

    /// Positions per cache row (0 before the cache is allocated).
    pub fn cache_len(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::capacity)
    }

    /// Takes `model`'s current weights (a training model included: its autodiff state is
    /// dropped; LoRA adapters are folded into the base) without touching the cache, and
    /// returns how long it took.
    pub fn refit(&mut self, model: &CausalLm) -> Result<Duration> {
        let start = Instant::now();
        let model = inference_weights(model);
        self.take_weights(model)?;
        Ok(start.elapsed())
    }

    pub(crate) fn take_weights(&mut self, model: CausalLm) -> Result<()> {
        let (have, got) = (self.model.num_params(), model.num_params());
        if have != got {
            return Err(GenError::RefitMismatch { have, got });
        }
        self.model = model.to_device(&self.device);
        self.head = packed_head(&self.model, &self.device);
        Ok(())
    }

    /// Completes every request; outputs are in request order.
    pub fn generate(&mut self, requests: &[GenerationRequest]) -> Result<Vec<Generation>> {
        self.generate_with(requests, &|_| {})
    }

    /// [`Engine::generate`], calling `progress` as each sequence finishes.
    pub fn generate_with(
        &mut self,
        requests: &[GenerationRequest],
        progress: &dyn Fn(&Generation),
    ) -> Result<Vec<Generation>> {
        validate(requests, self.model.model.rope.max_positions())?;
        let queue = std::sync::atomic::AtomicUsize::new(0);
        let mut done: Vec<Option<Generation>> = vec![None; requests.len()];
        self.serve(requests, &queue, &mut |i, g| {
            progress(&g);
            done[i] = Some(g);
        })?;
        Ok(done
            .into_iter()
            .map(|g| g.expect("every request finishes"))
            .collect())
    }

    /// Runs until `queue` (the index of the next request to take) passes the end of
    /// `requests`, giving each finished sequence to `done`. Several engines may share one
    /// queue: whoever has a free row takes the next prompt.
    pub(crate) fn serve(
        &mut self,
        requests: &[GenerationRequest],
        queue: &std::sync::atomic::AtomicUsize,
        done: &mut dyn FnMut(usize, Generation),
    ) -> Result<()> {
        let next = || {
            let i = queue.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            (i < requests.len()).then_some(i)
        };
        let prompt_width = requests.iter().map(|r| r.prompt_ids.len()).max().unwrap_or(0);
        let mut cache = self.take_cache(requests, prompt_width);
        // The cursor never goes below the longest prompt, so any prompt fits before it.
        cache.set_len(prompt_width);
        let max_positions = self.model.model.rope.max_positions();
        let mut active: Vec<Slot> = Vec::new();
        let mut exhausted = false;
        loop {
            while !exhausted && active.len() < self.slots() {
                let mut new = Vec::new();
                while active.len() + new.len() < self.slots() {
                    match next() {
                        Some(i) => new.push(i),
                        None => {
                            exhausted = true;
                            break;
                        }
                    }
                }
                if new.is_empty() {
                    break;
                }
                let first_row = active.len();
                self.stats.prefills += 1;
                if first_row > 0 {
                    self.stats.admitted_mid_batch += new.len();
                }
                let logits = self.prefill(&new, requests, &mut cache, &mut active);
                self.sample_rows(
                    &logits,
                    first_row,
                    requests,
                    &mut active,
                    &mut cache,
                    max_positions,
                    done,
                )?;
            }
            if active.is_empty() {
                break;
            }
            if cache.len() == cache.capacity() {
                let shift = active
                    .iter()
                    .map(|s| s.start)
                    .min()
                    .unwrap_or(0)
                    .min(cache.len() - prompt_width);
                cache.shift_left(shift);
                self.stats.shifts += 1;
                for slot in &mut active {
                    slot.start -= shift;
                }
            }
            self.stats.decode_steps += 1;
            let logits = self.decode(&mut active, &mut cache);
            self.sample_rows(&logits, 0, requests, &mut active, &mut cache, max_positions, done)?;
        }
        self.cache = Some(cache);
        Ok(())
    }

    /// The engine's cache, allocated (once) or grown to fit a run over `requests`.
    fn take_cache(&mut self, requests: &[GenerationRequest], prompt_width: usize) -> KvCache {
        let longest = requests
            .iter()
            .map(|r| r.params.max_new_tokens)
            .max()
            .unwrap_or(0);
        let span = prompt_width + longest;
        // Slack beyond one sequence's span: how far the cursor runs between two shifts.
        let needed = span + (span / 4).max(16);
        match self.cache.take() {
            Some(cache) if cache.capacity() >= needed => cache,
            Some(cache) => {
                tracing::debug!(from = cache.capacity(), to = needed, "growing the KV cache");
                self.stats.allocations += 1;
                cache.with_capacity(needed)
            }
            None => {
                self.stats.allocations += 1;
                KvCache::new(&self.config, self.slots(), needed, &self.device)
            }
        }
    }

    /// Prefills the requests `new` together (left-padded) into a scratch cache, copies each
    /// into the next free row, and returns their last-position logits.
    fn prefill(
        &self,
        new: &[usize],
        requests: &[GenerationRequest],
        cache: &mut KvCache,
        active: &mut Vec<Slot>,
    ) -> Vec<f32> {
        let width = new
            .iter()
            .map(|&i| requests[i].prompt_ids.len())
            .max()
            .unwrap_or(0);
        let mut scratch = KvCache::new(&self.config, new.len(), width, &self.device);
        let mut flat = Vec::with_capacity(new.len() * width);
        let mut valid = Vec::with_capacity(new.len());
        for &i in new {
            let prompt = &requests[i].prompt_ids;
            let pad = width - prompt.len();
            flat.extend(std::iter::repeat_n(0i64, pad));
            flat.extend(prompt.iter().map(|&t| t as i64));
            valid.push((0..width).map(|t| t >= pad).collect::<Vec<bool>>());
        }
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(flat, [new.len(), width]), &self.device);
        let (positions, mask) = if valid.iter().all(|row| row.iter().all(|&v| v)) {
            (aligner_core::model::default_positions(&tokens), None)
        } else {
            let (p, m) = left_padded_layout(&valid, width, &self.device);
            (p, Some(m))
        };
        let logits = self.last_logits(tokens, &positions, mask.as_ref(), &mut scratch);
        for (j, &i) in new.iter().enumerate() {
            let row = active.len();
            cache.copy_row_block(&scratch, j, row);
            let prompt_len = requests[i].prompt_ids.len();
            active.push(Slot {
                request: i,
                rng: ChaCha8Rng::seed_from_u64(requests[i].params.seed),
                out: Generation {
                    token_ids: Vec::new(),
                    token_logprobs: Vec::new(),
                    stop_reason: StopReason::MaxTokens,
                },
                start: cache.len() - prompt_len,
                next_pos: prompt_len,
            });
        }
        logits
    }

    /// Feeds every running row its last token; returns the logits of the next one.
    fn decode(&self, active: &mut [Slot], cache: &mut KvCache) -> Vec<f32> {
        let rows = active.len();
        let last: Vec<i64> = active
            .iter()
            .map(|s| *s.out.token_ids.last().expect("a running row has sampled") as i64)
            .collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(last, [rows, 1]), &self.device);
        let positions: Vec<i64> = active.iter().map(|s| s.next_pos as i64).collect();
        let positions = Tensor::<2, Int>::from_data(TensorData::new(positions, [rows, 1]), &self.device);
        // Attention reads from the earliest running sequence's start; when every row starts
        // there, nothing is left to hide and the causal default (faster kernel) is exact.
        let window = active.iter().map(|s| s.start).min().unwrap_or(0);
        cache.set_window_start(window);
        let keys = cache.len() + 1 - window;
        let mask = active.iter().any(|s| s.start > window).then(|| {
            let hidden: Vec<bool> = active
                .iter()
                .flat_map(|s| (0..keys).map(move |k| k + window < s.start))
                .collect();
            Tensor::<4, Bool>::from_data(TensorData::new(hidden, [rows, 1, 1, keys]), &self.device)
        });
        let logits = self.last_logits(tokens, &positions, mask.as_ref(), cache);
        cache.set_window_start(0);
        for slot in active.iter_mut() {
            slot.next_pos += 1;
        }
        logits
    }

    /// One forward pass; the last position's logits as `[rows × vocab]` on the host.
    fn last_logits(
        &self,
        tokens: Tensor<2, Int>,
        positions: &Tensor<2, Int>,
        mask: Option<&Tensor<4, Bool>>,
        cache: &mut KvCache,
    ) -> Vec<f32> {
        let [rows, new] = tokens.dims();
        let hidden = self.model.model.forward(tokens, positions, mask, Some(cache));
        let [_, _, d] = hidden.dims();
        let last = hidden.narrow(1, new - 1, 1).reshape([rows, d]);
        last.matmul(self.head.clone())
            .into_data()
            .try_to_vec::<f32>()
            .expect("logits are f32")
    }

    /// Samples the next token of rows `first_row..` from `logits` (one row of logits each),
    /// finishes the sequences that stop, and closes the gaps they leave.
    #[allow(clippy::too_many_arguments)]
    fn sample_rows(
        &self,
        logits: &[f32],
        first_row: usize,
        requests: &[GenerationRequest],
        active: &mut Vec<Slot>,
        cache: &mut KvCache,
        max_positions: usize,
        done: &mut dyn FnMut(usize, Generation),
    ) -> Result<()> {
        use rayon::prelude::*;
        let vocab = self.config.vocab_size;
        // Rows sample in parallel, each from its own stream.
        let draws: Vec<(usize, f32)> = active[first_row..]
            .par_iter_mut()
            .zip(logits.par_chunks(vocab))
            .map(|(slot, row_logits)| sample(row_logits, &requests[slot.request].params, &mut slot.rng))
            .collect();
        let mut finished = Vec::new();
        for ((j, slot), (token, logprob)) in active[first_row..].iter_mut().enumerate().zip(draws) {
            let request = &requests[slot.request];
            slot.out.token_ids.push(token as u32);
            slot.out.token_logprobs.push(logprob);
            let stop = if self.eos_ids.contains(&(token as u32)) {
                Some(StopReason::Eos)
            } else if self.hit_stop_string(&request.prompt_ids, &slot.out.token_ids, &request.params)? {
                Some(StopReason::StopString)
            } else if slot.out.token_ids.len() >= request.params.max_new_tokens {
                Some(StopReason::MaxTokens)
            } else if slot.next_pos >= max_positions {
                Some(StopReason::ContextFull)
            } else {
                None
            };
            if let Some(reason) = stop {
                slot.out.stop_reason = reason;
                finished.push(first_row + j);
            }
        }
        // Highest row first: the last row fills each gap, and it is never a finished one.
        for &row in finished.iter().rev() {
            let last = active.len() - 1;
            if row != last {
                cache.move_row(last, row);
            }
            let slot = active.swap_remove(row);
            done(slot.request, slot.out);
        }
        Ok(())
    }

    fn hit_stop_string(&self, prompt: &[u32], ids: &[u32], params: &SamplingParams) -> Result<bool> {
        if params.stop_strings.is_empty() {
            return Ok(false);
        }
        let Some(tokenizer) = &self.tokenizer else {
            return Err(GenError::StopStringsNeedTokenizer);
        };
        let text = tokenizer.decode_continuation(prompt, ids)?;
        Ok(params.stop_strings.iter().any(|s| text.contains(s.as_str())))
    }
}

/// The weights as an inference engine runs them: no autodiff, LoRA merged.
pub(crate) fn inference_weights(model: &CausalLm) -> CausalLm {
    let plain = model.valid();
    let has_adapters = plain.model.layers.iter().any(|layer| {
        let (a, m) = (&layer.self_attn, &layer.mlp);
        [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ]
        .iter()
        .any(|p| p.lora.is_some())
    });
    if has_adapters { plain.merged() } else { plain }
}

/// Rejects requests no engine can run.
pub(crate) fn validate(requests: &[GenerationRequest], max_positions: usize) -> Result<()> {
    for (i, r) in requests.iter().enumerate() {
        if r.prompt_ids.is_empty() {
            return Err(GenError::EmptyPrompt(i));
        }
        if r.prompt_ids.len() >= max_positions {
            return Err(GenError::PromptTooLong {
                tokens: r.prompt_ids.len(),
                max: max_positions,
            });
        }
    }
    Ok(())
}
