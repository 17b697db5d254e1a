//! The CPU forward pass of the engine: the model's weights copied once into plain row-major
//! buffers (query, key and value projections side by side, gate and up side by side, the
//! output projection contiguous), a KV cache of `f32` rows, and aligner-parallel's inference
//! kernels between `gemm` products.
//!
//! On a small model a decode step is hundreds of tiny ops; through Burn each one allocates,
//! dispatches and (for the cache views) copies, which costs more than its arithmetic. Here a
//! step is seven matrix products per layer over every running sequence at once, with
//! attention reading each sequence's keys where they lie. Every row keeps its own length, so
//! prompts need no padding and a freed row takes a new prompt without moving the others.

use std::sync::Arc;

use aligner_core::config::RopeScaling;
use aligner_core::{CausalLm, LlamaConfig, model::inverse_frequencies};
use aligner_parallel::fused::host::matmul;
use aligner_parallel::fused::infer::{CacheLayout, cached_attention, rms_norm_into, rope_rows, swiglu_into};
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

/// One decoder layer as host buffers (`x · W` layout).
#[derive(Clone)]
struct HostLayer {
    attn_norm: Vec<f32>,
    /// `[hidden, (heads + 2·kv_heads)·head_dim]`: query, key, value columns.
    qkv: Vec<f32>,
    qkv_bias: Option<Vec<f32>>,
    o: Vec<f32>,
    o_bias: Option<Vec<f32>>,
    mlp_norm: Vec<f32>,
    /// `[hidden, 2·ffn]`: gate, up columns.
    gate_up: Vec<f32>,
    gate_up_bias: Option<Vec<f32>>,
    down: Vec<f32>,
    down_bias: Option<Vec<f32>>,
}

/// The weights of a model as the host forward pass reads them.
#[derive(Clone)]
pub(crate) struct HostWeights {
    embed: Vec<f32>,
    layers: Vec<HostLayer>,
    norm: Vec<f32>,
    /// `[hidden, vocab]`, contiguous (the transposed embeddings when tied).
    head: Vec<f32>,
    inv_freq: Vec<f32>,
    eps: Vec<f32>,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
}

impl HostWeights {
    /// Copies `model`'s weights (LoRA adapters, when enabled, folded in).
    pub(crate) fn new(model: &CausalLm, config: &LlamaConfig) -> Self {
        let m = &model.model;
        let layers = m
            .layers
            .iter()
            .map(|layer| {
                let (a, p) = (&layer.self_attn, &layer.mlp);
                let (qkv, qkv_bias) =
                    side_by_side(&[a.q_proj.merged(), a.k_proj.merged(), a.v_proj.merged()]);
                let (gate_up, gate_up_bias) = side_by_side(&[p.gate_proj.merged(), p.up_proj.merged()]);
                let (o, o_bias) = side_by_side(&[a.o_proj.merged()]);
                let (down, down_bias) = side_by_side(&[p.down_proj.merged()]);
                HostLayer {
                    attn_norm: values(layer.input_layernorm.gamma.val()),
                    qkv,
                    qkv_bias,
                    o,
                    o_bias,
                    mlp_norm: values(layer.post_attention_layernorm.gamma.val()),
                    gate_up,
                    gate_up_bias,
                    down,
                    down_bias,
                }
            })
            .collect();
        let theta = config.rope_theta_value().unwrap_or(10000.0);
        let scaling = config.rope_scaling_kind().unwrap_or(RopeScaling::Default);
        let mut eps: Vec<f32> = m
            .layers
            .iter()
            .flat_map(|l| {
                [
                    l.input_layernorm.epsilon as f32,
                    l.post_attention_layernorm.epsilon as f32,
                ]
            })
            .collect();
        eps.push(m.norm.epsilon as f32);
        Self {
            embed: values(m.embed_tokens.weight.val()),
            layers,
            norm: values(m.norm.gamma.val()),
            head: values(model.output_weight()),
            inv_freq: inverse_frequencies(config.head_dim(), theta, &scaling),
            eps,
            hidden: config.hidden_size,
            heads: config.num_attention_heads,
            kv_heads: config.num_kv_heads(),
            head_dim: config.head_dim(),
            ffn: config.intermediate_size,
            vocab: config.vocab_size,
        }
    }

    /// Overwrites these buffers with `other`'s (same architecture), keeping the allocations.
    pub(crate) fn copy_from(&mut self, other: &HostWeights) -> Result<()> {
        let size = |w: &HostWeights| {
            w.embed.len()
                + w.head.len()
                + w.layers
                    .iter()
                    .map(|l| l.qkv.len() + l.o.len() + l.gate_up.len() + l.down.len())
                    .sum::<usize>()
        };
        let (have, got) = (size(self), size(other));
        if have != got || self.layers.len() != other.layers.len() {
            return Err(GenError::RefitMismatch { have, got });
        }
        self.clone_from(other);
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

/// Keys and values of every layer, `[rows, kv_heads, capacity, head_dim]` each, and how many
/// positions of each row are written.
pub(crate) struct HostCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    /// Written positions of each running row (rows past its end are free).
    pub(crate) lens: Vec<usize>,
    rows: usize,
    capacity: usize,
    layout: CacheLayout,
}

impl HostCache {
    pub(crate) fn new(weights: &HostWeights, rows: usize, capacity: usize) -> Self {
        let layout = weights.layout(capacity);
        let size = rows * layout.kv_heads * capacity * layout.dim;
        Self {
            keys: (0..weights.layers.len()).map(|_| vec![0.0; size]).collect(),
            values: (0..weights.layers.len()).map(|_| vec![0.0; size]).collect(),
            lens: Vec::with_capacity(rows),
            rows,
            capacity,
            layout,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The same cache with room for `capacity` positions per row (written ones kept).
    pub(crate) fn grown(&self, capacity: usize) -> Self {
        let mut grown = Self {
            keys: Vec::new(),
            values: Vec::new(),
            lens: self.lens.clone(),
            rows: self.rows,
            capacity,
            layout: CacheLayout {
                capacity,
                ..self.layout
            },
        };
        let (old, new) = (self.layout, grown.layout);
        let regrid = |buffers: &[Vec<f32>]| -> Vec<Vec<f32>> {
            buffers
                .iter()
                .map(|b| {
                    let mut out = vec![0.0; self.rows * new.kv_heads * capacity * new.dim];
                    for (row, &len) in self.lens.iter().enumerate() {
                        old.copy_row(b, row, &new, &mut out, row, len);
                    }
                    out
                })
                .collect()
        };
        grown.keys = regrid(&self.keys);
        grown.values = regrid(&self.values);
        grown
    }

    /// Copies row `from`'s written positions over row `to`.
    pub(crate) fn move_row(&mut self, from: usize, to: usize) {
        let (layout, len) = (self.layout, self.lens[from]);
        for buffer in self.keys.iter_mut().chain(self.values.iter_mut()) {
            for h in 0..layout.kv_heads {
                for d in 0..layout.dim {
                    let at = |row| layout.head(row, h) + d * layout.capacity;
                    buffer.copy_within(at(from)..at(from) + len, at(to));
                }
            }
        }
        self.lens[to] = self.lens[from];
    }
}

/// Scratch buffers of one forward pass.
struct Activations {
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
}

fn add_bias(rows: &mut [f32], bias: &Option<Vec<f32>>) {
    if let Some(b) = bias {
        for row in rows.chunks_mut(b.len()) {
            for (x, &y) in row.iter_mut().zip(b) {
                *x += y;
            }
        }
    }
}

/// Runs `tokens` through the model: token `t` is at position `rows[t].1` of cache row
/// `rows[t].0`, whose earlier positions are already in `cache`. Writes every token's keys and
/// values, and returns the logits (`[picked.len(), vocab]`) of the tokens `picked`.
pub(crate) fn forward(
    w: &HostWeights,
    cache: &mut HostCache,
    tokens: &[u32],
    rows: &[(usize, usize)],
    picked: &[usize],
) -> Vec<f32> {
    let n = tokens.len();
    let (d, hd, ffn) = (w.hidden, w.head_dim, w.ffn);
    let (q_width, kv_width) = (w.heads * hd, w.kv_heads * hd);
    let qkv_width = q_width + 2 * kv_width;
    let mut a = Activations {
        x: Vec::with_capacity(n * d),
        normed: vec![0.0; n * d],
        qkv: vec![0.0; n * qkv_width],
        attn: vec![0.0; n * q_width],
        gate_up: vec![0.0; n * 2 * ffn],
        act: vec![0.0; n * ffn],
    };
    for &t in tokens {
        a.x.extend_from_slice(&w.embed[t as usize * d..][..d]);
    }
    // Angles as transformers computes them: float32 position × float32 frequency.
    let half = hd / 2;
    let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
    for &(_, pos) in rows {
        for &f in &w.inv_freq {
            let angle = pos as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let layout = cache.layout;
    let scale = 1.0 / (hd as f32).sqrt();
    for (i, layer) in w.layers.iter().enumerate() {
        rms_norm_into(&mut a.normed, &a.x, &layer.attn_norm, w.eps[2 * i]);
        matmul(
            &mut a.qkv, &a.normed, &layer.qkv, n, qkv_width, d, false, false, false,
        );
        add_bias(&mut a.qkv, &layer.qkv_bias);
        rope_rows(&mut a.qkv, qkv_width, 0, w.heads, hd, &cos, &sin);
        rope_rows(&mut a.qkv, qkv_width, q_width, w.kv_heads, hd, &cos, &sin);
        let (keys, values) = (&mut cache.keys[i], &mut cache.values[i]);
        for (qkv, &(row, pos)) in a.qkv.chunks(qkv_width).zip(rows) {
            let (k, v) = qkv[q_width..].split_at(kv_width);
            for (h, (kh, vh)) in k.chunks(hd).zip(v.chunks(hd)).enumerate() {
                layout.write(keys, row, h, pos, kh);
                layout.write(values, row, h, pos, vh);
            }
        }
        cached_attention(
            &mut a.attn,
            &a.qkv,
            qkv_width,
            0,
            keys,
            values,
            rows,
            w.heads,
            layout,
            scale,
        );
        add_bias_then_project(&mut a.x, &a.attn, &layer.o, &layer.o_bias, n, d, q_width);
        rms_norm_into(&mut a.normed, &a.x, &layer.mlp_norm, w.eps[2 * i + 1]);
        matmul(
            &mut a.gate_up,
            &a.normed,
            &layer.gate_up,
            n,
            2 * ffn,
            d,
            false,
            false,
            false,
        );
        add_bias(&mut a.gate_up, &layer.gate_up_bias);
        swiglu_into(&mut a.act, &a.gate_up, ffn);
        add_bias_then_project(&mut a.x, &a.act, &layer.down, &layer.down_bias, n, d, ffn);
    }
    let mut last = Vec::with_capacity(picked.len() * d);
    for &t in picked {
        last.extend_from_slice(&a.x[t * d..][..d]);
    }
    let mut normed = vec![0.0; last.len()];
    rms_norm_into(&mut normed, &last, &w.norm, w.eps[2 * w.layers.len()]);
    let mut logits = vec![0.0; picked.len() * w.vocab];
    matmul(
        &mut logits,
        &normed,
        &w.head,
        picked.len(),
        w.vocab,
        d,
        false,
        false,
        false,
    );
    logits
}

/// The residual update `x += input · weight + bias` (`input: [n, k]`, `weight: [k, d]`).
fn add_bias_then_project(
    x: &mut [f32],
    input: &[f32],
    weight: &[f32],
    bias: &Option<Vec<f32>>,
    n: usize,
    d: usize,
    k: usize,
) {
    add_bias(x, bias);
    matmul(x, input, weight, n, d, k, false, false, true);
}

/// Shared weights and a cache: what the engine's host path holds.
pub(crate) struct HostRunner {
    pub(crate) weights: Arc<HostWeights>,
    pub(crate) cache: Option<HostCache>,
}
