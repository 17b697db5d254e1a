//! The CPU forward pass of the engine: the model's weights copied once into plain row-major
//! buffers (query, key and value projections side by side, gate and up side by side, the
//! output projection in column panels), a KV cache of `f32` rows, and aligner-parallel's
//! inference kernels between `gemm` products.
//!
//! On a small model a decode step is hundreds of tiny ops; through Burn each one allocates,
//! dispatches and (for the cache views) copies, which costs more than its arithmetic. Here a
//! step is seven matrix products per layer over every running sequence at once, with
//! attention reading each sequence's keys where they lie. Every row keeps its own length, so
//! prompts need no padding and a freed row takes a new prompt without moving the others.

use std::sync::Arc;

use aligner_core::config::{Activation, RopeScaling};
use aligner_core::model::{FeedForward, Mlp, RmsNorm, inverse_frequencies, long_context_frequencies};
use aligner_core::{CausalLm, LlamaConfig};
use aligner_parallel::fused::infer::{CacheBuffer, CacheLayout, Scoring};
use aligner_parallel::fused::panels::{ColumnPanels, DEFAULT_PANEL_WIDTH};
use burn::nn::Linear;
use burn::tensor::Tensor;

use crate::error::{GenError, Result};

/// A tensor's values on the host.
fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 weights")
}

/// `[d_in, d_out]` weights of several linear layers side by side: `[d_in, Σ d_out]`, and their
/// biases likewise (`None` when none has one).
fn side_by_side(layers: &[Linear]) -> (Vec<f32>, Option<Vec<f32>>) {
    let parts: Vec<(Vec<f32>, usize)> = layers
        .iter()
        .map(|l| (values(l.weight.val()), l.weight.dims()[1]))
        .collect();
    let d_in = layers[0].weight.dims()[0];
    let mut joined = Vec::with_capacity(parts.iter().map(|(w, _)| w.len()).sum());
    for i in 0..d_in {
        for (w, out) in &parts {
            joined.extend_from_slice(&w[i * out..(i + 1) * out]);
        }
    }
    let bias = layers.iter().any(|l| l.bias.is_some()).then(|| {
        layers
            .iter()
            .flat_map(|l| match &l.bias {
                Some(b) => values(b.val()),
                None => vec![0.0; l.weight.dims()[1]],
            })
            .collect()
    });
    (joined, bias)
}

/// Columns per panel of the output projection: [`DEFAULT_PANEL_WIDTH`] at most, and few enough
/// that a small vocabulary still gives every core a panel.
fn head_panel_width(vocab: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    vocab
        .div_ceil(threads)
        .next_multiple_of(16)
        .min(DEFAULT_PANEL_WIDTH)
}

/// An RMSNorm as the host applies it: its scale (`w`, or Gemma's `1 + w`) and ε.
#[derive(Clone)]
pub(super) struct HostNorm {
    pub(super) scale: Vec<f32>,
    pub(super) eps: f32,
}

impl HostNorm {
    fn new(norm: &RmsNorm) -> Self {
        Self {
            scale: values(norm.scale()),
            eps: norm.epsilon as f32,
        }
    }
}

/// One decoder layer as host buffers (`x · W` layout).
#[derive(Clone)]
pub(super) struct HostLayer {
    /// The norms on attention's and the MLP's inputs (Llama, Gemma) and outputs (OLMo 2,
    /// Gemma).
    pub(super) attn_in: Option<HostNorm>,
    pub(super) attn_out: Option<HostNorm>,
    pub(super) mlp_in: Option<HostNorm>,
    pub(super) mlp_out: Option<HostNorm>,
    /// `[hidden, (heads + 2·kv_heads)·head_dim]`: query, key, value columns.
    pub(super) qkv: Vec<f32>,
    pub(super) qkv_bias: Option<Vec<f32>>,
    /// RMSNorms of the queries and keys before RoPE: per head (Qwen3, Gemma 3: one head
    /// wide) or over the whole projections (OLMo 2).
    pub(super) q_norm: Option<HostNorm>,
    pub(super) k_norm: Option<HostNorm>,
    /// Score scale, sliding window and soft-cap.
    pub(super) scoring: Scoring,
    /// Gemma 3's sliding-window layers rotate with the local RoPE base.
    pub(super) local_rope: bool,
    pub(super) o: Vec<f32>,
    pub(super) o_bias: Option<Vec<f32>>,
    pub(super) ffn: HostFfn,
}

/// A gated MLP as host buffers.
#[derive(Clone)]
pub(super) struct HostMlp {
    /// `[hidden, 2·width]`: gate, up columns.
    pub(super) gate_up: Vec<f32>,
    pub(super) gate_up_bias: Option<Vec<f32>>,
    /// `[width, hidden]`.
    pub(super) down: Vec<f32>,
    pub(super) down_bias: Option<Vec<f32>>,
    pub(super) width: usize,
}

impl HostMlp {
    fn new(mlp: &Mlp) -> Self {
        // Fused (Phi-3) or side by side, the columns are gate, then up.
        let merged: Vec<Linear> = mlp.gate_up.iter().map(|p| p.merged()).collect();
        let (gate_up, gate_up_bias) = side_by_side(&merged);
        let (down, down_bias) = side_by_side(&[mlp.down_proj.merged()]);
        let width = mlp.down_proj.base.weight.dims()[0];
        Self {
            gate_up,
            gate_up_bias,
            down,
            down_bias,
            width,
        }
    }

    fn len(&self) -> usize {
        self.gate_up.len() + self.down.len()
    }
}

/// A layer's feed-forward block on the host: one MLP, or a router and its experts.
#[derive(Clone)]
pub(super) enum HostFfn {
    Dense(HostMlp),
    Sparse(HostMoe),
}

/// A mixture of experts on the host.
#[derive(Clone)]
pub(super) struct HostMoe {
    /// `[hidden, experts]`.
    pub(super) router: Vec<f32>,
    pub(super) experts: Vec<HostMlp>,
    pub(super) top_k: usize,
    pub(super) normalize_top_k: bool,
}

impl HostFfn {
    fn new(block: &FeedForward) -> Self {
        match block {
            FeedForward::Dense(mlp) => HostFfn::Dense(HostMlp::new(mlp)),
            FeedForward::Sparse(moe) => HostFfn::Sparse(HostMoe {
                router: values(moe.router.weight.val()),
                experts: moe.experts.iter().map(HostMlp::new).collect(),
                top_k: moe.top_k,
                normalize_top_k: moe.normalize_top_k,
            }),
        }
    }

    fn len(&self) -> usize {
        match self {
            HostFfn::Dense(mlp) => mlp.len(),
            HostFfn::Sparse(moe) => moe.router.len() + moe.experts.iter().map(HostMlp::len).sum::<usize>(),
        }
    }

    /// The widest hidden layer of the block's MLPs.
    pub(super) fn width(&self) -> usize {
        match self {
            HostFfn::Dense(mlp) => mlp.width,
            HostFfn::Sparse(moe) => moe.experts.iter().map(|e| e.width).max().unwrap_or(0),
        }
    }
}

/// The weights of a model as the host forward pass reads them.
#[derive(Clone)]
pub(crate) struct HostWeights {
    /// The token embeddings `[vocab, hidden]`; `None` when tied to the output projection
    /// ([`HostWeights::embed_into`] reads `head` then).
    pub(super) embed: Option<Vec<f32>>,
    /// Gemma's `√hidden` on the embeddings.
    pub(super) embed_scale: Option<f32>,
    pub(super) layers: Vec<HostLayer>,
    pub(super) norm: HostNorm,
    /// `[hidden, vocab]` (the transposed embeddings when tied), in column panels: the largest
    /// product of a step, read far faster that way than with a vocabulary-wide stride.
    pub(super) head: ColumnPanels,
    /// Gemma's final soft-cap on the logits.
    pub(super) final_softcap: Option<f32>,
    pub(super) inv_freq: Vec<f32>,
    /// LongRoPE (Phi-3): the frequencies of a forward call whose positions reach past the
    /// original context (the given length), and the factor on cos and sin.
    pub(super) long_inv_freq: Option<(Vec<f32>, usize)>,
    pub(super) rope_factor: f32,
    /// Gemma 3: the inverse frequencies of the sliding-window layers.
    pub(super) local_inv_freq: Option<Vec<f32>>,
    pub(super) activation: Activation,
    pub(super) hidden: usize,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    /// The widest MLP hidden layer (the scratch buffers' width).
    pub(super) ffn: usize,
    pub(super) vocab: usize,
}

impl HostWeights {
    /// Copies `model`'s weights (LoRA adapters, when enabled, folded in), letting go of each
    /// layer's tensors once copied: where the engine holds the only reference (a model loaded
    /// for generation), the weights are never held twice.
    pub(crate) fn new(model: CausalLm, config: &LlamaConfig) -> Self {
        let CausalLm {
            model: mut m,
            lm_head,
            final_softcap,
        } = model;
        let head_dim = config.head_dim();
        let scale = config.attention_scale().unwrap_or(1.0 / (head_dim as f64).sqrt()) as f32;
        let activation = m
            .layers
            .first()
            .and_then(|l| l.mlp.mlps().first().map(|mlp| mlp.activation))
            .unwrap_or(Activation::Silu);
        let layers: Vec<HostLayer> = std::mem::take(&mut m.layers)
            .into_iter()
            .map(|layer| {
                let a = &layer.self_attn;
                // Fused (Phi-3) or side by side, the columns are q, k, v.
                let merged: Vec<Linear> = a.qkv.iter().map(|p| p.merged()).collect();
                let (qkv, qkv_bias) = side_by_side(&merged);
                let (o, o_bias) = side_by_side(&[a.o_proj.merged()]);
                let norm = |n: &Option<RmsNorm>| n.as_ref().map(HostNorm::new);
                HostLayer {
                    attn_in: norm(&layer.attn_norm_in),
                    attn_out: norm(&layer.attn_norm_out),
                    mlp_in: norm(&layer.mlp_norm_in),
                    mlp_out: norm(&layer.mlp_norm_out),
                    qkv,
                    qkv_bias,
                    q_norm: norm(&a.q_norm),
                    k_norm: norm(&a.k_norm),
                    scoring: Scoring {
                        scale,
                        window: a.window,
                        softcap: a.softcap.map(|c| c as f32),
                    },
                    local_rope: m.rotates_locally(&layer),
                    o,
                    o_bias,
                    ffn: HostFfn::new(&layer.mlp),
                }
            })
            .collect();
        // The scratch buffers' width: the widest MLP of any layer.
        let ffn = layers
            .iter()
            .map(|l: &HostLayer| l.ffn.width())
            .max()
            .unwrap_or(0);
        let theta = config.rope_theta_value().unwrap_or(10000.0);
        let scaling = config.rope_scaling_kind().unwrap_or(RopeScaling::Default);
        // The leading dimensions of each head that RoPE turns (Phi-3's partial rotary factor).
        let rotary_dim = config.rotary_dim().unwrap_or(head_dim);
        let local_inv_freq = config
            .local_rope()
            .ok()
            .flatten()
            .map(|(theta, scaling)| inverse_frequencies(rotary_dim, theta, &scaling));
        let long = long_context_frequencies(rotary_dim, theta, &scaling);
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let width = head_panel_width(vocab);
        let (norm, embed_scale) = (HostNorm::new(&m.norm), m.embedding_scale.map(|s| s as f32));
        // Taken out of the model, not cloned: where the engine holds the only reference, its
        // values are the tensor's own buffer, not a copy.
        let embedding = values(m.embed_tokens.weight.into_value());
        // A tied embedding table becomes the output projection's panels in its own buffer
        // (held once); the lookup reads its rows there.
        let (embed, head) = match lm_head {
            Some(head) => (
                Some(embedding),
                ColumnPanels::from_row_major(&values(head.weight.into_value()), hidden, vocab, width),
            ),
            None => (
                None,
                ColumnPanels::from_transpose(embedding, hidden, vocab, width),
            ),
        };
        Self {
            embed,
            embed_scale,
            layers,
            norm,
            head,
            final_softcap: final_softcap.map(|c| c as f32),
            inv_freq: inverse_frequencies(rotary_dim, theta, &scaling),
            rope_factor: long.as_ref().map_or(1.0, |l| l.2 as f32),
            long_inv_freq: long.map(|(freq, original, _)| (freq, original)),
            local_inv_freq,
            activation,
            hidden,
            heads: config.num_attention_heads,
            kv_heads: config.num_kv_heads(),
            head_dim,
            ffn,
            vocab,
        }
    }

    /// Appends token `t`'s embedding (`hidden` values) to `x`.
    pub(super) fn embed_into(&self, t: usize, x: &mut Vec<f32>) {
        match &self.embed {
            Some(embed) => x.extend_from_slice(&embed[t * self.hidden..][..self.hidden]),
            None => self.head.column_into(t, x),
        }
    }

    /// An error unless `other` has this model's architecture (what a refit may take).
    pub(crate) fn check_same_shape(&self, other: &HostWeights) -> Result<()> {
        let size = |w: &HostWeights| {
            w.embed.as_ref().map_or(0, Vec::len)
                + w.head.len()
                + w.layers
                    .iter()
                    .map(|l| l.qkv.len() + l.o.len() + l.ffn.len())
                    .sum::<usize>()
        };
        let (have, got) = (size(self), size(other));
        if have != got || self.layers.len() != other.layers.len() {
            return Err(GenError::RefitMismatch { have, got });
        }
        Ok(())
    }

    fn layout(&self, capacity: usize) -> CacheLayout {
        CacheLayout {
            kv_heads: self.kv_heads,
            capacity,
            dim: self.head_dim,
        }
    }
}

/// Keys and values of every layer (laid out as [`CacheLayout`] says), and how many
/// positions of each row are written.
pub(crate) struct HostCache {
    pub(super) keys: Vec<Vec<f32>>,
    pub(super) values: Vec<Vec<f32>>,
    /// Written positions of each running row (rows past its end are free).
    pub(crate) lens: Vec<usize>,
    pub(super) layout: CacheLayout,
}

impl HostCache {
    pub(crate) fn new(weights: &HostWeights, rows: usize, capacity: usize) -> Self {
        let layout = weights.layout(capacity);
        let size = rows * layout.kv_heads * capacity * layout.dim;
        Self {
            keys: (0..weights.layers.len()).map(|_| vec![0.0; size]).collect(),
            values: (0..weights.layers.len()).map(|_| vec![0.0; size]).collect(),
            lens: Vec::with_capacity(rows),
            layout,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.layout.capacity
    }

    /// Row `row`'s first `len` positions of every layer, copied out.
    pub(crate) fn park(&self, row: usize, len: usize) -> HostParked {
        let copy = |buffers: &[Vec<f32>], kind| -> Vec<Vec<f32>> {
            buffers
                .iter()
                .map(|buffer| {
                    let mut out = Vec::new();
                    for (start, n) in self.layout.runs(kind, row, len) {
                        out.extend_from_slice(&buffer[start..start + n]);
                    }
                    out
                })
                .collect()
        };
        HostParked {
            keys: copy(&self.keys, CacheBuffer::Keys),
            values: copy(&self.values, CacheBuffer::Values),
            len,
        }
    }

    /// Writes `parked`'s positions into row `row` (its first `parked.len` positions).
    pub(crate) fn restore(&mut self, row: usize, parked: &HostParked) {
        let layout = self.layout;
        for (buffers, saved, kind) in [
            (&mut self.keys, &parked.keys, CacheBuffer::Keys),
            (&mut self.values, &parked.values, CacheBuffer::Values),
        ] {
            for (buffer, saved) in buffers.iter_mut().zip(saved) {
                let mut at = 0;
                for (start, n) in layout.runs(kind, row, parked.len) {
                    buffer[start..start + n].copy_from_slice(&saved[at..at + n]);
                    at += n;
                }
            }
        }
    }

    /// Copies row `from`'s written positions over row `to`.
    pub(crate) fn move_row(&mut self, from: usize, to: usize) {
        let (layout, len) = (self.layout, self.lens[from]);
        for (buffers, kind) in [
            (&mut self.keys, CacheBuffer::Keys),
            (&mut self.values, CacheBuffer::Values),
        ] {
            for buffer in buffers.iter_mut() {
                for ((src, n), (dst, _)) in layout.runs(kind, from, len).zip(layout.runs(kind, to, len)) {
                    buffer.copy_within(src..src + n, dst);
                }
            }
        }
        self.lens[to] = self.lens[from];
    }
}

/// A finished sequence's cached keys and values (every layer, its first `len` positions),
/// kept for a request that continues it.
pub(crate) struct HostParked {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    pub(crate) len: usize,
}

/// Shared weights and a cache: what the engine's host path holds.
pub(crate) struct HostRunner {
    pub(crate) weights: Arc<HostWeights>,
    pub(crate) cache: Option<HostCache>,
    /// The last logits buffer, handed back after sampling (on a 50k vocabulary a decode
    /// step's logits are megabytes: allocating them anew faulted in fresh pages every step).
    pub(crate) spare: Vec<f32>,
}
