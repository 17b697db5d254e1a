//! The rollout engine: one KV cache of `slots` rows, continuous batching, refit in place.
//!
//! Every cache row holds one running sequence. When a sequence finishes, the last row moves
//! into its place, so running rows are always the first ones and a decode step is one forward
//! pass over exactly those rows; the next queued prompt is prefilled into the freed row at
//! once, without waiting for the batch. The forward pass itself (and how the cache is laid
//! out) is the runner's: Burn's model on any device, or host kernels on the CPU.

use std::time::{Duration, Instant};

use aligner_core::{CausalLm, LlamaConfig, LoadedModel, TextTokenizer};
use burn::module::Module;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{GenError, Result};
use crate::options::{EngineStats, ForwardPath};
use crate::runner::{Logits, ParkedRow, Runner};
use crate::sampling::{
    DeviceRow, SamplingParams, device_uniform, guided_logits, log_prob, sample, sample_on_device,
};

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
    /// Classifier-free guidance against a negative prompt (two cache rows per request).
    pub guidance: Option<Guidance>,
}

impl GenerationRequest {
    /// Each prompt `n` times, in order, request `i` drawing with `params.seed + i`: its own
    /// random stream, so a sample does not depend on what else is in the batch.
    pub fn repeated<'a>(
        prompts: impl IntoIterator<Item = &'a [u32]>,
        n: usize,
        params: &SamplingParams,
    ) -> Vec<Self> {
        prompts
            .into_iter()
            .flat_map(|ids| std::iter::repeat_n(ids, n))
            .enumerate()
            .map(|(i, ids)| Self {
                prompt_ids: ids.to_vec(),
                params: SamplingParams {
                    seed: params.seed.wrapping_add(i as u64),
                    ..params.clone()
                },
                guidance: None,
            })
            .collect()
    }
}

impl Generation {
    /// `request`'s prompt with these generated tokens, as a sequence to score (the response
    /// being the generated tokens): how a reference or reward model scores a policy's samples.
    pub fn scored(&self, request: &GenerationRequest) -> aligner_core::score::ScoredSequence {
        aligner_core::score::ScoredSequence {
            ids: request
                .prompt_ids
                .iter()
                .chain(&self.token_ids)
                .copied()
                .collect(),
            prompt_len: request.prompt_ids.len(),
            observed: Vec::new(),
        }
    }
}

impl GenerationRequest {
    /// A request without guidance.
    pub fn new(prompt_ids: Vec<u32>, params: SamplingParams) -> Self {
        Self {
            prompt_ids,
            params,
            guidance: None,
        }
    }
}

/// Classifier-free guidance of one request ([`crate::sampling::guided_logits`]): the negative
/// prompt runs in a cache row of its own, fed the tokens the request samples, and each token
/// is drawn from `scale · (log p(·|prompt) − log p(·|negative)) + log p(·|negative)`. SteerLM
/// uses it to strengthen the asked attributes (the negative prompt: the same prompt without
/// them, or with other values).
#[derive(Debug, Clone, PartialEq)]
pub struct Guidance {
    pub negative_prompt_ids: Vec<u32>,
    pub scale: f32,
}

/// What one request produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Positions per cache row; by default sized by the first run (prompt + response, plus
    /// slack on the Burn path) and grown only when a later run needs more.
    pub cache_len: Option<usize>,
    pub path: ForwardPath,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            slots: 64,
            cache_len: None,
            path: ForwardPath::Auto,
        }
    }
}

/// A generation engine over one model: its weights, KV cache, EOS ids and (for stop strings)
/// tokenizer.
pub struct Engine {
    /// The model's parameter count: what a refit must bring.
    params: usize,
    /// Positions the model's RoPE covers.
    max_positions: usize,
    config: LlamaConfig,
    tokenizer: Option<TextTokenizer>,
    eos_ids: Vec<u32>,
    options: EngineOptions,
    runner: Runner,
    stats: EngineStats,
    /// Finished sequences kept for a continuing request ([`SamplingParams::keep_cache`]): the
    /// tokens whose keys and values are cached, and those keys and values. They live until
    /// the end of the next `generate` call, and no refit outlives them.
    parked: Vec<(Vec<u32>, ParkedRow)>,
}

/// A running sequence in a cache row.
struct Slot {
    /// Index of the request among those this run took.
    request: usize,
    /// The feed's key of the request.
    key: usize,
    rng: ChaCha8Rng,
    out: Generation,
    /// Position (RoPE index) the last sampled token takes when it is fed back.
    next_pos: usize,
    /// The row of the other half of a guided request (kept up to date as rows move).
    partner: Option<usize>,
    /// This row runs a guided request's negative prompt: it takes its partner's tokens and
    /// reports nothing.
    negative: bool,
}

impl Slot {
    fn new(request: usize, key: usize, params: &SamplingParams, prompt_len: usize) -> Self {
        Self {
            request,
            key,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            out: Generation {
                token_ids: Vec::new(),
                token_logprobs: Vec::new(),
                stop_reason: StopReason::MaxTokens,
            },
            next_pos: prompt_len,
            partner: None,
            negative: false,
        }
    }
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
        let max_positions = model.model.rope.max_positions();
        let weights = inference_weights(&model);
        // Counted as a refit brings them: LoRA adapters folded in.
        let params = weights.num_params();
        // The caller's reference goes now: the runner's copy may then be the only one.
        drop(model);
        let eos_ids = match &tokenizer {
            Some(t) if !t.eos_ids().is_empty() => t.eos_ids().to_vec(),
            _ => config.eos_token_ids(),
        };
        let runner = Runner::new(weights, &config, options.path);
        let mut engine = Self {
            config,
            tokenizer,
            eos_ids,
            options,
            stats: EngineStats::default(),
            params,
            max_positions,
            runner,
            parked: Vec::new(),
        };
        if let Some(len) = engine.options.cache_len {
            let slots = engine.slots();
            engine.runner.reserve(slots, 0, len, &mut engine.stats);
        }
        engine
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

    /// The engine kept in `slot`, holding `model`'s current weights: built on first use (with
    /// `options`), refit in place afterwards (cache and buffers kept) — how a method that
    /// generates every round or step (SPIN, rejection sampling, online DPO, distillation's own
    /// answers) keeps one engine. A model split over a tensor group builds an engine split the
    /// same way, so the first use must come once the trainer has split every parameter (LoRA's
    /// factors too). Also returns the refit time (`None` when the engine was built).
    pub fn refit_or_build<'a>(
        slot: &'a mut Option<Engine>,
        model: &CausalLm,
        config: &LlamaConfig,
        tokenizer: Option<&TextTokenizer>,
        options: EngineOptions,
    ) -> Result<(&'a mut Engine, Option<Duration>)> {
        let refit = match slot {
            Some(engine) => Some(engine.refit(model)?),
            None => {
                *slot = Some(Self::new(
                    model.clone(),
                    config.clone(),
                    tokenizer.cloned(),
                    options,
                ));
                None
            }
        };
        Ok((slot.as_mut().expect("just filled"), refit))
    }

    /// Replaces the end-of-sequence ids (empty: never stop at EOS).
    pub fn with_eos_ids(mut self, eos_ids: Vec<u32>) -> Self {
        self.eos_ids = eos_ids;
        self
    }

    /// Another engine on the same weights with its own (not yet allocated) cache.
    pub fn replica(&self) -> Self {
        Self {
            params: self.params,
            max_positions: self.max_positions,
            config: self.config.clone(),
            tokenizer: self.tokenizer.clone(),
            eos_ids: self.eos_ids.clone(),
            options: EngineOptions {
                cache_len: None,
                ..self.options.clone()
            },
            runner: self.runner.replica(),
            stats: EngineStats::default(),
            parked: Vec::new(),
        }
    }

    /// Whether the engine's model is split over a tensor group (`parallel.tensor`): every
    /// rank of the group must then run the same requests together, each pass a collective.
    pub fn in_tensor_group(&self) -> bool {
        self.runner.in_tensor_group()
    }

    /// The forward pass the engine runs ([`ForwardPath::Burn`] or [`ForwardPath::Host`]).
    pub fn path(&self) -> ForwardPath {
        self.runner.path()
    }

    /// Positions the model's RoPE covers (the longest sequence a request may reach).
    pub fn max_positions(&self) -> usize {
        self.max_positions
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
        self.runner.cache_len()
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
        let (have, got) = (self.params, model.num_params());
        if have != got {
            return Err(GenError::RefitMismatch { have, got });
        }
        self.runner.take_weights(&model, &self.config)?;
        // Keys and values of the old weights.
        self.parked.clear();
        Ok(())
    }

    /// Takes `other`'s current weights (shared, not copied).
    pub(crate) fn share_weights(&mut self, other: &Engine) -> Result<()> {
        self.runner.share_weights(&other.runner)?;
        self.max_positions = other.max_positions;
        self.parked.clear();
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
        validate(requests, self.max_positions)?;
        let mut done: Vec<Option<Generation>> = vec![None; requests.len()];
        self.serve(&SliceFeed::new(requests), &mut |i, g| {
            progress(&g);
            done[i] = Some(g);
            Ok(())
        })?;
        Ok(done
            .into_iter()
            .map(|g| g.expect("every request finishes"))
            .collect())
    }

    /// Runs the requests `feed` hands out until it has no more, starting each as soon as a
    /// row is free (and the feed has it ready), and giving each finished sequence to `done`
    /// with the key the feed gave it. Several engines may share one feed: whoever has a free
    /// row takes the next request.
    pub fn serve(
        &mut self,
        feed: &dyn RequestFeed,
        done: &mut dyn FnMut(usize, Generation) -> Result<()>,
    ) -> Result<()> {
        let served = self.serve_rows(feed, done);
        if served.is_err() {
            feed.close();
        }
        served
    }

    fn serve_rows(
        &mut self,
        feed: &dyn RequestFeed,
        done: &mut dyn FnMut(usize, Generation) -> Result<()>,
    ) -> Result<()> {
        let FeedBounds {
            prompt_width,
            span,
            guided,
        } = feed.bounds();
        let slots = self.slots();
        // A guided request takes two rows, admitted together.
        let rows_per_request = if guided { 2 } else { 1 };
        if rows_per_request > slots {
            return Err(GenError::GuidanceNeedsTwoSlots);
        }
        self.runner.reserve(slots, prompt_width, span, &mut self.stats);
        let max_positions = self.max_positions;
        // The requests taken so far (a slot's `request` indexes them) and the feed's keys.
        let mut requests: Vec<GenerationRequest> = Vec::new();
        let mut keys: Vec<usize> = Vec::new();
        let mut active: Vec<Slot> = Vec::new();
        let reencode_at = self.reencode_at();
        // What the last call kept: taken by the requests that continue it, dropped after.
        let mut kept = std::mem::take(&mut self.parked);
        loop {
            // Start whatever is ready, waiting for a request only when no row is running.
            loop {
                let mut new = Vec::new();
                let mut new_rows = 0;
                while active.len() + new_rows + rows_per_request <= slots {
                    let wait = active.is_empty() && new.is_empty();
                    let Some((key, request)) = feed.next(wait)? else {
                        break;
                    };
                    // Named by the feed's key (a slice's index), as `validate` names them.
                    validate_one(key, &request, max_positions)?;
                    if request.guidance.is_some() && !guided {
                        return Err(GenError::GuidanceNeedsTwoSlots);
                    }
                    new_rows += 1 + usize::from(request.guidance.is_some());
                    new.push(requests.len());
                    requests.push(request);
                    keys.push(key);
                }
                if new.is_empty() {
                    break;
                }
                let first_row = active.len();
                self.stats.prefills += 1;
                if first_row > 0 {
                    self.stats.admitted_mid_batch += new.len();
                }
                let mut prompts: Vec<&[u32]> = Vec::with_capacity(new_rows);
                let mut reused: Vec<Option<ParkedRow>> = Vec::with_capacity(new_rows);
                for &i in &new {
                    let request = &requests[i];
                    let row = active.len();
                    prompts.push(&request.prompt_ids);
                    // What the last call or this one kept of a sequence this prompt continues.
                    let parked = take_continued(&mut kept, &request.prompt_ids)
                        .or_else(|| take_continued(&mut self.parked, &request.prompt_ids));
                    reused.push(parked);
                    active.push(Slot::new(i, keys[i], &request.params, request.prompt_ids.len()));
                    if let Some(guidance) = &request.guidance {
                        prompts.push(&guidance.negative_prompt_ids);
                        reused.push(None);
                        active[row].partner = Some(row + 1);
                        let mut negative =
                            Slot::new(i, keys[i], &request.params, guidance.negative_prompt_ids.len());
                        negative.partner = Some(row);
                        negative.negative = true;
                        active.push(negative);
                    }
                }
                let logits = self.runner.prefill(&prompts, &reused, &mut self.stats);
                self.sample_rows(logits, first_row, &requests, &mut active, max_positions, done)?;
            }
            if active.is_empty() {
                break;
            }
            self.stats.decode_steps += 1;
            let tokens: Vec<u32> = active
                .iter()
                .map(|s| *s.out.token_ids.last().expect("a running row has sampled"))
                .collect();
            let positions: Vec<usize> = active.iter().map(|s| s.next_pos).collect();
            // LongRoPE (Phi-3): a sequence whose next token first reaches past the original
            // context is computed again whole, with the long factors, as transformers'
            // generation does.
            let reencode: Vec<(usize, Vec<u32>)> = match reencode_at {
                Some(original) => active
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.next_pos == original)
                    .map(|(row, s)| {
                        let request = &requests[s.request];
                        let prompt = match (&request.guidance, s.negative) {
                            (Some(g), true) => &g.negative_prompt_ids,
                            _ => &request.prompt_ids,
                        };
                        (row, [prompt.as_slice(), &s.out.token_ids].concat())
                    })
                    .collect(),
                None => Vec::new(),
            };
            let logits = self
                .runner
                .decode(&tokens, &positions, &reencode, &mut self.stats);
            for slot in active.iter_mut() {
                slot.next_pos += 1;
            }
            self.sample_rows(logits, 0, &requests, &mut active, max_positions, done)?;
        }
        Ok(())
    }

    /// Samples the next token of rows `first_row..` from `logits` (one row of logits each),
    /// finishes the sequences that stop, and closes the gaps they leave. Logits left on the
    /// device are drawn from there (temperature, top-k, top-p and guidance included); host
    /// logits are drawn on the host.
    #[allow(clippy::too_many_arguments)]
    fn sample_rows(
        &mut self,
        logits: Logits,
        first_row: usize,
        requests: &[GenerationRequest],
        active: &mut Vec<Slot>,
        max_positions: usize,
        done: &mut dyn FnMut(usize, Generation) -> Result<()>,
    ) -> Result<()> {
        let draws: Vec<Option<(usize, f32)>> = match logits {
            Logits::Device(logits) => {
                let rows = &mut active[first_row..];
                let device_rows: Vec<DeviceRow> = rows
                    .iter_mut()
                    .map(|slot| {
                        let request = &requests[slot.request];
                        // A guided request's negative row draws nothing and takes no uniform.
                        let uniform = match slot.negative {
                            true => 0.0,
                            false => device_uniform(&request.params, &mut slot.rng),
                        };
                        let guidance = match (slot.negative, slot.partner, &request.guidance) {
                            (false, Some(partner), Some(g)) => Some((partner - first_row, g.scale)),
                            _ => None,
                        };
                        DeviceRow {
                            params: &request.params,
                            uniform,
                            guidance,
                        }
                    })
                    .collect();
                let negative: Vec<bool> = rows.iter().map(|slot| slot.negative).collect();
                sample_on_device(*logits, &device_rows)
                    .into_iter()
                    .zip(negative)
                    .map(|(draw, negative)| (!negative).then_some(draw))
                    .collect()
            }
            logits => {
                let logits = logits.into_host();
                let draws = self.host_draws(&logits, first_row, requests, active);
                self.runner.recycle(logits);
                draws
            }
        };
        self.finish_rows(draws, first_row, requests, active, max_positions, done)
    }

    /// Each row's draw from host logits (`None` for a guided request's negative row).
    fn host_draws(
        &self,
        logits: &[f32],
        first_row: usize,
        requests: &[GenerationRequest],
        active: &mut [Slot],
    ) -> Vec<Option<(usize, f32)>> {
        use rayon::prelude::*;
        let vocab = self.config.vocab_size;
        let row_logits = |row: usize| &logits[(row - first_row) * vocab..(row - first_row + 1) * vocab];
        // Rows sample in parallel, each from its own stream; a guided request's row draws from
        // the guided distribution (its negative row, admitted with it, draws nothing).
        active[first_row..]
            .par_iter_mut()
            .enumerate()
            .map(|(j, slot)| {
                let own = row_logits(first_row + j);
                let request = &requests[slot.request];
                match (slot.negative, slot.partner, &request.guidance) {
                    (true, _, _) => None,
                    (false, Some(partner), Some(guidance)) => {
                        let guided = guided_logits(own, row_logits(partner), guidance.scale);
                        let (token, _) = sample(&guided, &request.params, &mut slot.rng);
                        Some((token, log_prob(own, token)))
                    }
                    _ => Some(sample(own, &request.params, &mut slot.rng)),
                }
            })
            .collect()
    }

    /// Appends each row's draw, finishes the sequences that stop, and closes their gaps.
    #[allow(clippy::too_many_arguments)]
    fn finish_rows(
        &mut self,
        draws: Vec<Option<(usize, f32)>>,
        first_row: usize,
        requests: &[GenerationRequest],
        active: &mut Vec<Slot>,
        max_positions: usize,
        done: &mut dyn FnMut(usize, Generation) -> Result<()>,
    ) -> Result<()> {
        for (j, draw) in draws.iter().enumerate() {
            let row = first_row + j;
            let (token, logprob) = match draw {
                Some(d) => *d,
                None => {
                    let partner = active[row].partner.expect("a negative row has its request's row");
                    (draws[partner - first_row].expect("a request's row draws").0, 0.0)
                }
            };
            active[row].out.token_ids.push(token as u32);
            active[row].out.token_logprobs.push(logprob);
        }
        let mut finished = Vec::new();
        for row in first_row..active.len() {
            let slot = &active[row];
            if slot.negative {
                continue;
            }
            let request = &requests[slot.request];
            let token = *slot.out.token_ids.last().expect("just sampled");
            let context_full = std::iter::once(row)
                .chain(slot.partner)
                .any(|r| active[r].next_pos >= max_positions);
            let stop = if self.eos_ids.contains(&token) {
                Some(StopReason::Eos)
            } else if self.hit_stop_string(&request.prompt_ids, &slot.out.token_ids, &request.params)? {
                Some(StopReason::StopString)
            } else if slot.out.token_ids.len() >= request.params.max_new_tokens {
                Some(StopReason::MaxTokens)
            } else if context_full {
                Some(StopReason::ContextFull)
            } else {
                None
            };
            if let Some(reason) = stop {
                finished.extend(std::iter::once(row).chain(slot.partner));
                active[row].out.stop_reason = reason;
            }
        }
        finished.sort_unstable();
        // Highest row first: the last row fills each gap, and it is never a finished one.
        for &row in finished.iter().rev() {
            let slot = &active[row];
            let request = &requests[slot.request];
            // A sequence another request will continue: its cached positions (the prompt and
            // every sampled token but the last, which was never fed) are kept. Not across
            // LongRoPE's switch of factors, which recomputes a sequence whole.
            if request.params.keep_cache
                && request.guidance.is_none()
                && self.reencode_at().is_none()
                && let Some(parked) = self.runner.park(row, slot.next_pos)
            {
                let mut tokens = request.prompt_ids.clone();
                tokens.extend(&slot.out.token_ids);
                tokens.truncate(slot.next_pos);
                self.parked.push((tokens, parked));
            }
            self.runner.remove_row(row);
            let slot = active.swap_remove(row);
            if let Some(partner) = active.get(row).and_then(|moved| moved.partner) {
                active[partner].partner = Some(row);
            }
            if !slot.negative {
                done(slot.key, slot.out)?;
            }
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

impl Engine {
    /// LongRoPE's original context (Phi-3): the position at which a sequence is computed again
    /// whole ([`Runner::decode`]); `None` for every other model.
    fn reencode_at(&self) -> Option<usize> {
        match self.config.rope_scaling_kind() {
            Ok(aligner_core::config::RopeScaling::LongRope {
                original_max_position_embeddings,
                ..
            }) => Some(original_max_position_embeddings),
            _ => None,
        }
    }
}

/// The sizes a feed's requests stay within: the cache is laid out for them before the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeedBounds {
    /// Tokens of the longest prompt (negative prompts included).
    pub prompt_width: usize,
    /// Positions the longest sequence spans (its prompt and every new token).
    pub span: usize,
    /// Whether any request carries guidance (two rows each).
    pub guided: bool,
}

impl FeedBounds {
    /// The bounds of a known list of requests.
    pub fn of(requests: &[GenerationRequest]) -> Self {
        let prompt_width = requests
            .iter()
            .flat_map(|r| {
                std::iter::once(&r.prompt_ids).chain(r.guidance.as_ref().map(|g| &g.negative_prompt_ids))
            })
            .map(|ids| ids.len())
            .max()
            .unwrap_or(0);
        let longest = requests
            .iter()
            .map(|r| r.params.max_new_tokens)
            .max()
            .unwrap_or(0);
        Self {
            prompt_width,
            span: prompt_width + longest,
            guided: requests.iter().any(|r| r.guidance.is_some()),
        }
    }
}

/// Where a running engine takes its requests from ([`Engine::serve`]): a list known in
/// advance, or requests that become ready while others run (the next turn of an episode
/// whose environment has answered). Shared by the engines of a pool.
pub trait RequestFeed: Sync {
    /// What every request will stay within.
    fn bounds(&self) -> FeedBounds;

    /// The next request to start, with the key its output is handed back under. With `wait`
    /// (no row is running) it waits until one is ready and `None` means none will come;
    /// without, `None` means none is ready now.
    fn next(&self, wait: bool) -> Result<Option<(usize, GenerationRequest)>>;

    /// An engine serving this feed failed: nothing more will be taken (a feed that waits for
    /// requests stops waiting).
    fn close(&self) {}
}

/// The requests of a slice, each taken once, keyed by their index.
pub(crate) struct SliceFeed<'a> {
    requests: &'a [GenerationRequest],
    bounds: FeedBounds,
    queue: std::sync::atomic::AtomicUsize,
}

impl<'a> SliceFeed<'a> {
    pub(crate) fn new(requests: &'a [GenerationRequest]) -> Self {
        Self {
            requests,
            bounds: FeedBounds::of(requests),
            queue: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

impl RequestFeed for SliceFeed<'_> {
    fn bounds(&self) -> FeedBounds {
        self.bounds
    }

    fn next(&self, _wait: bool) -> Result<Option<(usize, GenerationRequest)>> {
        let i = self.queue.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.requests.get(i).map(|r| (i, r.clone())))
    }
}

/// Takes from `kept` the longest kept sequence `prompt` continues (strictly longer than it).
fn take_continued(kept: &mut Vec<(Vec<u32>, ParkedRow)>, prompt: &[u32]) -> Option<ParkedRow> {
    let k = kept
        .iter()
        .enumerate()
        .filter(|(_, (tokens, _))| tokens.len() < prompt.len() && prompt.starts_with(tokens))
        .max_by_key(|(_, (tokens, _))| tokens.len())
        .map(|(k, _)| k)?;
    Some(kept.swap_remove(k).1)
}

/// The weights as an inference engine runs them: no autodiff, LoRA merged.
pub(crate) fn inference_weights(model: &CausalLm) -> CausalLm {
    let plain = model.valid();
    let has_adapters = plain.model.layers.iter().any(|layer| {
        let a = &layer.self_attn;
        let mlps = layer.mlp.mlps();
        a.qkv
            .iter()
            .chain([&a.o_proj])
            .chain(mlps.iter().flat_map(|m| m.gate_up.iter().chain([&m.down_proj])))
            .any(|p| p.lora.is_some())
    });
    if has_adapters { plain.merged() } else { plain }
}

/// Rejects requests no engine can run.
pub(crate) fn validate(requests: &[GenerationRequest], max_positions: usize) -> Result<()> {
    for (i, r) in requests.iter().enumerate() {
        validate_one(i, r, max_positions)?;
    }
    Ok(())
}

/// Rejects request `i` when no engine can run it.
fn validate_one(i: usize, r: &GenerationRequest, max_positions: usize) -> Result<()> {
    r.params.check().map_err(|bad| GenError::BadSampling {
        request: i,
        why: bad.to_string(),
    })?;
    if let Some(scale) = r.guidance.as_ref().map(|g| g.scale)
        && !(scale.is_finite() && scale >= 0.0)
    {
        return Err(GenError::BadGuidanceScale { request: i, scale });
    }
    let negative = r.guidance.as_ref().map(|g| &g.negative_prompt_ids);
    for ids in std::iter::once(&r.prompt_ids).chain(negative) {
        if ids.is_empty() {
            return Err(GenError::EmptyPrompt(i));
        }
        if ids.len() >= max_positions {
            return Err(GenError::PromptTooLong {
                tokens: ids.len(),
                max: max_positions,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_requests_keep_prompt_order_and_seed_each_draw() {
        let params = SamplingParams {
            seed: 10,
            max_new_tokens: 7,
            ..SamplingParams::default()
        };
        let (a, b) = ([1u32, 2], [3u32]);
        let requests = GenerationRequest::repeated([&a[..], &b[..]], 2, &params);
        let prompts: Vec<&[u32]> = requests.iter().map(|r| r.prompt_ids.as_slice()).collect();
        assert_eq!(prompts, [&a[..], &a[..], &b[..], &b[..]]);
        let seeds: Vec<u64> = requests.iter().map(|r| r.params.seed).collect();
        assert_eq!(seeds, [10, 11, 12, 13]);
        assert!(
            requests
                .iter()
                .all(|r| r.params.max_new_tokens == 7 && r.guidance.is_none())
        );
    }
}
