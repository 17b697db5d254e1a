//! The engine's forward passes: through the Burn model on any device ([`burn`]), or through
//! host kernels on the CPU ([`host`]). Both keep a KV cache of `slots` rows, allocated once;
//! running sequences always occupy the first rows.

mod burn;
mod forward;
mod host;

use std::sync::Arc;

use aligner_core::{CausalLm, LlamaConfig};
use aligner_parallel::fused::infer::LANES;

use self::burn::BurnRunner;
use self::forward::forward;
use self::host::{HostCache, HostParked, HostRunner, HostWeights};
use crate::error::{GenError, Result};
use crate::options::{EngineStats, ForwardPath};

/// Most tokens the host path prefills in one pass.
const PREFILL_TOKENS: usize = 4096;

/// The next-token logits of a pass, `[rows × vocab]`: on the host (the host path), or left on
/// the device (the Burn path), where plain sampling draws without copying them back.
pub(crate) enum Logits {
    Host(Vec<f32>),
    Device(Box<::burn::tensor::Tensor<2>>),
}

impl Logits {
    /// The logits on the host (copied back from the device when they are there).
    pub(crate) fn into_host(self) -> Vec<f32> {
        match self {
            Logits::Host(values) => values,
            Logits::Device(t) => (*t)
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("logits are floats"),
        }
    }
}

/// A finished sequence's cached keys and values (every layer, its first positions), kept for
/// a request that continues it: host buffers, or one row of a KV cache on the Burn path's
/// device.
pub(crate) enum ParkedRow {
    Host(HostParked),
    Device(aligner_core::model::KvCache),
}

pub(crate) enum Runner {
    Burn(Box<BurnRunner>),
    Host(HostRunner),
}

impl Runner {
    pub(crate) fn new(model: CausalLm, config: &LlamaConfig, path: ForwardPath) -> Self {
        let device = model.model.embed_tokens.weight.device();
        // A model split over a tensor group runs its split layers through Burn (the host
        // kernels take whole layers).
        let split = model.tensor_group().is_some();
        let host = match path {
            _ if split => false,
            ForwardPath::Auto => aligner_parallel::fused_available(&device),
            ForwardPath::Burn => false,
            ForwardPath::Host => true,
        };
        if host {
            Runner::Host(HostRunner {
                weights: Arc::new(HostWeights::new(model, config)),
                cache: None,
                spare: Vec::new(),
            })
        } else {
            Runner::Burn(Box::new(BurnRunner::new(model, config.clone(), device)))
        }
    }

    /// Whether the model is split over a tensor group.
    pub(crate) fn in_tensor_group(&self) -> bool {
        matches!(self, Runner::Burn(b) if b.in_tensor_group())
    }

    /// Which forward pass this is.
    pub(crate) fn path(&self) -> ForwardPath {
        match self {
            Runner::Burn(_) => ForwardPath::Burn,
            Runner::Host(_) => ForwardPath::Host,
        }
    }

    /// The same weights (shared), no cache.
    pub(crate) fn replica(&self) -> Self {
        match self {
            Runner::Burn(b) => Runner::Burn(Box::new(b.replica())),
            Runner::Host(h) => Runner::Host(HostRunner {
                weights: h.weights.clone(),
                cache: None,
                spare: Vec::new(),
            }),
        }
    }

    /// Takes `model`'s weights (already in inference form). The host path's copies are made
    /// for this refit, so they replace the old set (moved in, not copied again); replicas that
    /// shared the old set keep it until they share the new one.
    pub(crate) fn take_weights(&mut self, model: &CausalLm, config: &LlamaConfig) -> Result<()> {
        match self {
            Runner::Burn(b) => b.take_weights(model.clone()),
            Runner::Host(h) => {
                let fresh = HostWeights::new(model.clone(), config);
                h.weights.check_same_shape(&fresh)?;
                h.weights = Arc::new(fresh);
            }
        }
        Ok(())
    }

    /// Uses `other`'s weights (a worker pool refits once and shares).
    pub(crate) fn share_weights(&mut self, other: &Runner) -> Result<()> {
        match (self, other) {
            (Runner::Burn(b), Runner::Burn(o)) => b.take_weights(o.model.clone()),
            (Runner::Host(h), Runner::Host(o)) => h.weights = o.weights.clone(),
            _ => return Err(GenError::MixedForwardPaths),
        }
        Ok(())
    }

    /// Positions per cache row (0 before the cache is allocated).
    pub(crate) fn cache_len(&self) -> usize {
        match self {
            Runner::Burn(b) => b.cache.as_ref().map_or(0, |c| c.capacity()),
            Runner::Host(h) => h.cache.as_ref().map_or(0, HostCache::capacity),
        }
    }

    /// Makes the cache ready for a run of `rows` rows whose prompts are at most
    /// `prompt_width` tokens and whose sequences span at most `span` positions.
    pub(crate) fn reserve(&mut self, rows: usize, prompt_width: usize, span: usize, stats: &mut EngineStats) {
        match self {
            Runner::Burn(b) => b.reserve(rows, prompt_width, span, stats),
            Runner::Host(h) => {
                // Whole vectors of positions for the attention kernel.
                let span = span.div_ceil(LANES) * LANES;
                // No sequence outlives a run, so a cache too short for this one is replaced,
                // not copied.
                let mut cache = match h.cache.take() {
                    Some(cache) if cache.capacity() >= span => cache,
                    old => {
                        if let Some(old) = old {
                            tracing::debug!(from = old.capacity(), to = span, "growing the KV cache");
                        }
                        stats.allocations += 1;
                        HostCache::new(&h.weights, rows, span)
                    }
                };
                cache.lens.clear();
                h.cache = Some(cache);
            }
        }
    }

    /// Copies running row `row`'s first `len` cached positions out.
    pub(crate) fn park(&self, row: usize, len: usize) -> Option<ParkedRow> {
        match self {
            Runner::Burn(b) => Some(ParkedRow::Device(b.park(row, len))),
            Runner::Host(h) => h.cache.as_ref().map(|c| ParkedRow::Host(c.park(row, len))),
        }
    }

    /// Puts `prompts` into the next free rows; returns each one's next-token logits. A prompt
    /// given a parked row (`reused[j]`) starts from its cached positions and computes only the
    /// rest.
    pub(crate) fn prefill(
        &mut self,
        prompts: &[&[u32]],
        reused: &[Option<ParkedRow>],
        stats: &mut EngineStats,
    ) -> Logits {
        match self {
            Runner::Burn(b) => {
                let kept: Vec<Option<&aligner_core::model::KvCache>> = reused
                    .iter()
                    .map(|r| match r {
                        Some(ParkedRow::Device(cache)) => Some(cache),
                        _ => None,
                    })
                    .collect();
                Logits::Device(Box::new(b.prefill(prompts, &kept, stats)))
            }
            Runner::Host(h) => {
                let cache = h.cache.as_mut().expect("reserve comes first");
                // The first pass's buffer holds the result; later passes append to it.
                let mut logits: Option<Vec<f32>> = None;
                // Whole prompts, at most PREFILL_TOKENS per pass (one longer prompt goes
                // alone): activations grow with the tokens of a pass.
                let mut rest = prompts;
                while !rest.is_empty() {
                    let mut take = 1;
                    let mut total = rest[0].len();
                    while take < rest.len() && total + rest[take].len() <= PREFILL_TOKENS {
                        total += rest[take].len();
                        take += 1;
                    }
                    let (mut tokens, mut rows, mut picked) = (Vec::new(), Vec::new(), Vec::new());
                    let done = prompts.len() - rest.len();
                    for (j, prompt) in rest[..take].iter().enumerate() {
                        let row = cache.lens.len();
                        cache.lens.push(prompt.len());
                        let from = match reused.get(done + j).and_then(Option::as_ref) {
                            Some(ParkedRow::Host(parked)) => {
                                cache.restore(row, parked);
                                stats.reused_positions += parked.len;
                                parked.len
                            }
                            _ => 0,
                        };
                        tokens.extend_from_slice(&prompt[from..]);
                        rows.extend((from..prompt.len()).map(|pos| (row, pos)));
                        picked.push(tokens.len() - 1);
                    }
                    let part = forward(
                        &h.weights,
                        cache,
                        &tokens,
                        &rows,
                        &picked,
                        std::mem::take(&mut h.spare),
                    );
                    match &mut logits {
                        None => logits = Some(part),
                        Some(all) => {
                            all.extend_from_slice(&part);
                            h.spare = part;
                        }
                    }
                    rest = &rest[take..];
                }
                Logits::Host(logits.unwrap_or_default())
            }
        }
    }

    /// Feeds running row `r` its token `tokens[r]` at position `positions[r]`; returns the
    /// logits of the next tokens.
    ///
    /// The rows of `reencode` (row, its whole sequence ending with that token) are computed
    /// whole instead, their cached keys and values replaced: what transformers does for
    /// LongRoPE (Phi-3) when a sequence first reaches past the original context, since every
    /// position then rotates with the long factors.
    pub(crate) fn decode(
        &mut self,
        tokens: &[u32],
        positions: &[usize],
        reencode: &[(usize, Vec<u32>)],
        stats: &mut EngineStats,
    ) -> Logits {
        match self {
            Runner::Burn(b) => Logits::Device(Box::new(b.decode(tokens, positions, reencode, stats))),
            Runner::Host(h) => {
                let cache = h.cache.as_mut().expect("reserve comes first");
                debug_assert!(positions.iter().zip(&cache.lens).all(|(p, l)| p == l));
                let (mut fed, mut rows, mut picked) = (Vec::new(), Vec::new(), Vec::new());
                for (row, (&token, &pos)) in tokens.iter().zip(positions).enumerate() {
                    match reencode.iter().find(|(r, _)| *r == row) {
                        Some((_, sequence)) => {
                            fed.extend_from_slice(sequence);
                            rows.extend((0..sequence.len()).map(|p| (row, p)));
                        }
                        None => {
                            fed.push(token);
                            rows.push((row, pos));
                        }
                    }
                    picked.push(fed.len() - 1);
                }
                let logits = forward(
                    &h.weights,
                    cache,
                    &fed,
                    &rows,
                    &picked,
                    std::mem::take(&mut h.spare),
                );
                for len in &mut cache.lens {
                    *len += 1;
                }
                Logits::Host(logits)
            }
        }
    }

    /// Takes back a logits buffer this runner returned, for the next pass.
    pub(crate) fn recycle(&mut self, logits: Vec<f32>) {
        if let Runner::Host(h) = self {
            h.spare = logits;
        }
    }

    /// Row `row` is done; the last running row moves into its place.
    pub(crate) fn remove_row(&mut self, row: usize) {
        match self {
            Runner::Burn(b) => b.remove_row(row),
            Runner::Host(h) => {
                let cache = h.cache.as_mut().expect("a running row has a cache");
                let last = cache.lens.len() - 1;
                if row != last {
                    cache.move_row(last, row);
                }
                cache.lens.pop();
            }
        }
    }
}
