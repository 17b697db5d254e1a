//! Batched generation with a KV cache.
//!
//! Prompts are left-padded into one batch and prefilled together; then every step decodes one
//! token for each unfinished sequence. Finished sequences leave the batch (their cache rows
//! are dropped), so a batch gets cheaper as it drains.

use aligner_core::model::{KvCache, left_padded_layout};
use aligner_core::{CausalLm, LlamaConfig, TextTokenizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
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

/// Generates with one model: its weights, configuration, EOS ids and (for stop strings) its
/// tokenizer.
pub struct Generator<'a> {
    model: &'a CausalLm,
    config: &'a LlamaConfig,
    tokenizer: Option<&'a TextTokenizer>,
    eos_ids: Vec<u32>,
}

struct Active {
    request: usize,
    rng: ChaCha8Rng,
    out: Generation,
    last: u32,
}

impl<'a> Generator<'a> {
    pub fn new(model: &'a CausalLm, config: &'a LlamaConfig, tokenizer: Option<&'a TextTokenizer>) -> Self {
        let eos_ids = match tokenizer {
            Some(t) if !t.eos_ids().is_empty() => t.eos_ids().to_vec(),
            _ => config.eos_token_ids(),
        };
        Self {
            model,
            config,
            tokenizer,
            eos_ids,
        }
    }

    /// Replaces the end-of-sequence ids (empty: never stop at EOS).
    pub fn with_eos_ids(mut self, eos_ids: Vec<u32>) -> Self {
        self.eos_ids = eos_ids;
        self
    }

    /// Completes every request in one batch; outputs are in request order.
    pub fn generate(&self, requests: &[GenerationRequest]) -> Result<Vec<Generation>> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(i) = requests.iter().position(|r| r.prompt_ids.is_empty()) {
            return Err(GenError::EmptyPrompt(i));
        }
        let device = self.model.model.embed_tokens.weight.device();
        let max_positions = self.model.model.rope.max_positions();
        let prompt_width = requests.iter().map(|r| r.prompt_ids.len()).max().unwrap_or(0);
        if prompt_width >= max_positions {
            return Err(GenError::PromptTooLong {
                tokens: prompt_width,
                max: max_positions,
            });
        }
        let longest = requests
            .iter()
            .map(|r| r.params.max_new_tokens)
            .max()
            .unwrap_or(0);
        let capacity = (prompt_width + longest).min(max_positions);
        let mut cache = KvCache::new(self.config, requests.len(), capacity, &device);

        // Prefill: left-padded prompts.
        let mut valid: Vec<Vec<bool>> = Vec::with_capacity(requests.len());
        let mut flat = Vec::with_capacity(requests.len() * prompt_width);
        for r in requests {
            let pad = prompt_width - r.prompt_ids.len();
            flat.extend(std::iter::repeat_n(0i64, pad));
            flat.extend(r.prompt_ids.iter().map(|&t| t as i64));
            valid.push((0..prompt_width).map(|i| i >= pad).collect());
        }
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(flat, [requests.len(), prompt_width]), &device);
        let mut logits = self.step(tokens, &valid, &mut cache, &device);

        let mut active: Vec<Active> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| Active {
                request: i,
                rng: ChaCha8Rng::seed_from_u64(r.params.seed),
                out: Generation {
                    token_ids: Vec::new(),
                    token_logprobs: Vec::new(),
                    stop_reason: StopReason::MaxTokens,
                },
                last: 0,
            })
            .collect();
        let mut done: Vec<Option<Generation>> = vec![None; requests.len()];
        loop {
            let vocab = logits.len() / active.len();
            let mut keep = Vec::with_capacity(active.len());
            for (row, seq) in active.iter_mut().enumerate() {
                let params = &requests[seq.request].params;
                let (token, logprob) = sample(&logits[row * vocab..(row + 1) * vocab], params, &mut seq.rng);
                seq.out.token_ids.push(token as u32);
                seq.out.token_logprobs.push(logprob);
                seq.last = token as u32;
                let stop = if self.eos_ids.contains(&(token as u32)) {
                    Some(StopReason::Eos)
                } else if self.hit_stop_string(
                    &requests[seq.request].prompt_ids,
                    &seq.out.token_ids,
                    &params.stop_strings,
                )? {
                    Some(StopReason::StopString)
                } else if seq.out.token_ids.len() >= params.max_new_tokens {
                    Some(StopReason::MaxTokens)
                } else if cache.len() >= capacity {
                    Some(StopReason::ContextFull)
                } else {
                    None
                };
                match stop {
                    Some(reason) => seq.out.stop_reason = reason,
                    None => keep.push(row),
                }
            }
            if keep.len() < active.len() {
                let mut rows: Vec<Option<Active>> = active.into_iter().map(Some).collect();
                let mut kept = Vec::with_capacity(keep.len());
                for (row, slot) in rows.iter_mut().enumerate() {
                    let seq = slot.take().expect("each row once");
                    if keep.contains(&row) {
                        kept.push(seq);
                    } else {
                        done[seq.request] = Some(seq.out);
                    }
                }
                active = kept;
                if active.is_empty() {
                    break;
                }
                cache.retain_rows(&keep);
                valid = keep.iter().map(|&r| valid[r].clone()).collect();
            }
            for v in valid.iter_mut() {
                v.push(true);
            }
            let next: Vec<i64> = active.iter().map(|s| s.last as i64).collect();
            let tokens = Tensor::<2, Int>::from_data(TensorData::new(next, [active.len(), 1]), &device);
            logits = self.step(tokens, &valid, &mut cache, &device);
        }
        Ok(done
            .into_iter()
            .map(|g| g.expect("every request finishes"))
            .collect())
    }

    /// One forward pass of `tokens` after the cache; returns the last position's logits as
    /// `[rows × vocab]` on the host.
    fn step(
        &self,
        tokens: Tensor<2, Int>,
        valid: &[Vec<bool>],
        cache: &mut KvCache,
        device: &Device,
    ) -> Vec<f32> {
        let [batch, new] = tokens.dims();
        let padded = valid.iter().any(|row| row.iter().any(|v| !v));
        let (positions, mask) = if padded {
            let (p, m) = left_padded_layout(valid, new, device);
            (p, Some(m))
        } else {
            let start = cache.len() as i64;
            let p = Tensor::<1, Int>::arange(start..start + new as i64, device)
                .unsqueeze_dim::<2>(0)
                .expand([batch, new]);
            (p, None)
        };
        let hidden = self
            .model
            .model
            .forward(tokens, &positions, mask.as_ref(), Some(cache));
        let [_, _, d] = hidden.dims();
        let last = hidden.narrow(1, new - 1, 1).reshape([batch, 1, d]);
        self.model
            .logits_from_hidden(last)
            .into_data()
            .try_to_vec::<f32>()
            .expect("logits are f32")
    }

    fn hit_stop_string(&self, prompt: &[u32], ids: &[u32], stops: &[String]) -> Result<bool> {
        if stops.is_empty() {
            return Ok(false);
        }
        let Some(tokenizer) = self.tokenizer else {
            return Err(GenError::StopStringsNeedTokenizer);
        };
        let text = tokenizer.decode_continuation(prompt, ids)?;
        Ok(stops.iter().any(|s| text.contains(s.as_str())))
    }
}
