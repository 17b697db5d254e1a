//! The host forward pass: tokens → next-token logits, writing keys and values into the cache.
//!
//! Sequences are independent until the output projection, so the decoder layers run on
//! groups of whole sequences in parallel (one group per core), each group on its own rows of
//! the cache; inside a group every product covers all of its tokens. The output projection
//! then runs once over every picked token, its column panels split between the cores (its
//! weights are the largest matrix and are read once rather than once per group).

use aligner_core::config::Activation;
use aligner_parallel::fused::host::matmul;
use aligner_parallel::fused::infer::{
    CacheLayout, cached_attention, geglu_into, rms_norm_into, rope_rows, soft_cap_in_place, swiglu_into,
};
use rayon::prelude::*;

use super::host::{HostCache, HostFfn, HostLayer, HostMlp, HostMoe, HostNorm, HostWeights};
use aligner_core::model::top_k_rows;

/// Fewest tokens worth a group of their own (below it, one thread does all).
const MIN_GROUP_TOKENS: usize = 8;

/// One group's rows of the cache: per layer, the keys and values of cache rows
/// `first_row..` (as many as the slices hold).
struct CacheRows<'a> {
    keys: Vec<&'a mut [f32]>,
    values: Vec<&'a mut [f32]>,
    first_row: usize,
    layout: CacheLayout,
}

/// Runs `tokens` through the model: token `t` is at position `rows[t].1` of cache row
/// `rows[t].0`, whose earlier positions are already in `cache`; tokens come grouped by row, in
/// increasing row order. Writes every token's keys and values and returns the logits
/// (`[picked.len(), vocab]`) of the tokens `picked` (increasing), in `logits`' allocation.
pub(crate) fn forward(
    w: &HostWeights,
    cache: &mut HostCache,
    tokens: &[u32],
    rows: &[(usize, usize)],
    picked: &[usize],
    mut logits: Vec<f32>,
) -> Vec<f32> {
    debug_assert!(rows.windows(2).all(|p| p[0].0 <= p[1].0), "tokens grouped by row");
    debug_assert!(picked.windows(2).all(|p| p[0] < p[1]), "picked tokens in order");
    let groups = token_groups(rows, rayon::current_num_threads());
    let parts = split_cache(cache, rows, &groups);
    // LongRoPE: the long factors once this call's positions reach past the original context,
    // as transformers picks them per forward call (over the whole batch).
    let last = rows.iter().map(|&(_, pos)| pos).max().unwrap_or(0);
    let long = w
        .long_inv_freq
        .as_ref()
        .is_some_and(|(_, original)| last + 1 > *original);
    let hidden: Vec<Vec<f32>> = parts
        .into_par_iter()
        .zip(groups.par_iter())
        .map(|(mut part, range)| {
            let first = range.start;
            let local: Vec<usize> = picked
                .iter()
                .filter(|&&t| range.contains(&t))
                .map(|&t| t - first)
                .collect();
            trunk(
                w,
                &mut part,
                &tokens[range.clone()],
                &rows[range.clone()],
                &local,
                long,
            )
        })
        .collect();
    let last: Vec<f32> = hidden.concat();
    let mut normed = vec![0.0; last.len()];
    rms_norm_into(&mut normed, &last, &w.norm.scale, w.norm.eps);
    // Every entry is overwritten: a recycled buffer needs no clearing.
    logits.resize(picked.len() * w.vocab, 0.0);
    w.head.left_product(&mut logits, &normed, picked.len());
    if let Some(cap) = w.final_softcap {
        soft_cap_in_place(&mut logits, cap);
    }
    logits
}

/// Token ranges of about equal size, each made of whole rows: at most `threads` of them.
fn token_groups(rows: &[(usize, usize)], threads: usize) -> Vec<std::ops::Range<usize>> {
    let n = rows.len();
    let count = (n / MIN_GROUP_TOKENS).clamp(1, threads.max(1));
    let mut groups = Vec::with_capacity(count);
    let mut start = 0;
    for g in 1..=count {
        let mut end = if g == count { n } else { (n * g / count).max(start) };
        // Move the cut to the next row boundary.
        while end > 0 && end < n && rows[end].0 == rows[end - 1].0 {
            end += 1;
        }
        if end > start {
            groups.push(start..end);
            start = end;
        }
    }
    groups
}

/// Mutable views of the cache rows each token group writes (disjoint, since groups hold
/// whole rows in increasing order).
fn split_cache<'a>(
    cache: &'a mut HostCache,
    rows: &[(usize, usize)],
    groups: &[std::ops::Range<usize>],
) -> Vec<CacheRows<'a>> {
    let layout = cache.layout;
    let row_size = layout.head(1, 0);
    let spans: Vec<(usize, usize)> = groups
        .iter()
        .map(|g| (rows[g.start].0, rows[g.end - 1].0 + 1))
        .collect();
    let mut parts: Vec<CacheRows<'a>> = spans
        .iter()
        .map(|&(first_row, _)| CacheRows {
            keys: Vec::new(),
            values: Vec::new(),
            first_row,
            layout,
        })
        .collect();
    let split = |buffer: &'a mut Vec<f32>| -> Vec<&'a mut [f32]> {
        let mut rest: &'a mut [f32] = buffer.as_mut_slice();
        let mut at = 0;
        let mut out = Vec::with_capacity(spans.len());
        for &(first, end) in &spans {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut((first - at) * row_size);
            let (mine, tail) = tail.split_at_mut((end - first) * row_size);
            out.push(mine);
            rest = tail;
            at = end;
        }
        out
    };
    for buffer in cache.keys.iter_mut() {
        for (part, slice) in parts.iter_mut().zip(split(buffer)) {
            part.keys.push(slice);
        }
    }
    for buffer in cache.values.iter_mut() {
        for (part, slice) in parts.iter_mut().zip(split(buffer)) {
            part.values.push(slice);
        }
    }
    parts
}

/// The decoder layers over one group of tokens; returns the final hidden states (before the
/// last norm) of the tokens `picked`.
fn trunk(
    w: &HostWeights,
    cache: &mut CacheRows,
    tokens: &[u32],
    rows: &[(usize, usize)],
    picked: &[usize],
    long: bool,
) -> Vec<f32> {
    let n = tokens.len();
    let d = w.hidden;
    let mut x = Vec::with_capacity(n * d);
    for &t in tokens {
        w.embed_into(t as usize, &mut x);
    }
    if let Some(scale) = w.embed_scale {
        x.iter_mut().for_each(|v| *v *= scale);
    }
    // Rows relative to the group's first cache row.
    let local: Vec<(usize, usize)> = rows.iter().map(|&(r, p)| (r - cache.first_row, p)).collect();
    let mut scratch = Scratch::new(w, n);
    scratch.angles(w, rows, long);
    for (i, layer) in w.layers.iter().enumerate() {
        layer_forward(w, i, layer, &mut x, cache, &local, &mut scratch);
    }
    let mut out = Vec::with_capacity(picked.len() * d);
    for &t in picked {
        out.extend_from_slice(&x[t * d..][..d]);
    }
    out
}

/// Buffers reused across the layers of one group.
struct Scratch {
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Gemma 3's sliding-window layers: the angles of the local RoPE base.
    cos_local: Vec<f32>,
    sin_local: Vec<f32>,
    /// One row's query or key heads, for the in-place per-head norm.
    head: Vec<f32>,
    /// OLMo 2, Gemma: a block's output before its norm.
    out: Vec<f32>,
}

impl Scratch {
    fn new(w: &HostWeights, n: usize) -> Self {
        let q_width = w.heads * w.head_dim;
        let qkv_width = q_width + 2 * w.kv_heads * w.head_dim;
        Self {
            normed: vec![0.0; n * w.hidden],
            qkv: vec![0.0; n * qkv_width],
            attn: vec![0.0; n * q_width],
            gate_up: vec![0.0; n * 2 * w.ffn],
            act: vec![0.0; n * w.ffn],
            cos: Vec::new(),
            sin: Vec::new(),
            cos_local: Vec::new(),
            sin_local: Vec::new(),
            head: Vec::new(),
            out: Vec::new(),
        }
    }

    /// Rotary angles as transformers computes them: float32 position × float32 frequency.
    fn angles(&mut self, w: &HostWeights, rows: &[(usize, usize)], long: bool) {
        let factor = w.rope_factor;
        let fill = |inv_freq: &[f32], cos: &mut Vec<f32>, sin: &mut Vec<f32>| {
            for &(_, pos) in rows {
                for &f in inv_freq {
                    let angle = pos as f32 * f;
                    cos.push(angle.cos() * factor);
                    sin.push(angle.sin() * factor);
                }
            }
        };
        let inv_freq = match &w.long_inv_freq {
            Some((frequencies, _)) if long => frequencies,
            _ => &w.inv_freq,
        };
        fill(inv_freq, &mut self.cos, &mut self.sin);
        if let Some(local) = &w.local_inv_freq {
            fill(local, &mut self.cos_local, &mut self.sin_local);
        }
    }
}

/// `x += out(attn(in(x)))`, then `x += out(mlp(in(x)))` for one decoder layer, each `in` /
/// `out` norm where the layer has it (Llama: inputs; OLMo 2: outputs; Gemma: both).
fn layer_forward(
    w: &HostWeights,
    i: usize,
    layer: &HostLayer,
    x: &mut [f32],
    cache: &mut CacheRows,
    rows: &[(usize, usize)],
    s: &mut Scratch,
) {
    let (n, d, hd) = (rows.len(), w.hidden, w.head_dim);
    let (q_width, kv_width) = (w.heads * hd, w.kv_heads * hd);
    let qkv_width = q_width + 2 * kv_width;
    block_input(&mut s.normed, x, layer.attn_in.as_ref());
    matmul(
        &mut s.qkv, &s.normed, &layer.qkv, n, qkv_width, d, false, false, false,
    );
    add_bias(&mut s.qkv, &layer.qkv_bias);
    // Qwen3, Gemma 3 (each head) and OLMo 2 (the whole projection): queries and keys
    // normalised before RoPE.
    norm_heads(&mut s.qkv, qkv_width, 0, q_width, &layer.q_norm, &mut s.head);
    norm_heads(
        &mut s.qkv,
        qkv_width,
        q_width,
        kv_width,
        &layer.k_norm,
        &mut s.head,
    );
    let (cos, sin) = if layer.local_rope {
        (&s.cos_local, &s.sin_local)
    } else {
        (&s.cos, &s.sin)
    };
    rope_rows(&mut s.qkv, qkv_width, 0, w.heads, hd, cos, sin);
    rope_rows(&mut s.qkv, qkv_width, q_width, w.kv_heads, hd, cos, sin);
    let layout = cache.layout;
    let (keys, values) = (&mut *cache.keys[i], &mut *cache.values[i]);
    for (qkv, &(row, pos)) in s.qkv.chunks(qkv_width).zip(rows) {
        let (k, v) = qkv[q_width..].split_at(kv_width);
        for (h, (kh, vh)) in k.chunks(hd).zip(v.chunks(hd)).enumerate() {
            layout.write_key(keys, row, h, pos, kh);
            layout.write_value(values, row, h, pos, vh);
        }
    }
    cached_attention(
        &mut s.attn,
        &s.qkv,
        qkv_width,
        0,
        keys,
        values,
        rows,
        w.heads,
        layout,
        layer.scoring,
    );
    let attn_out = layer.attn_out.as_ref();
    residual(
        x,
        &s.attn,
        &layer.o,
        &layer.o_bias,
        attn_out,
        q_width,
        &mut s.out,
        &mut s.normed,
    );
    block_input(&mut s.normed, x, layer.mlp_in.as_ref());
    match &layer.ffn {
        HostFfn::Dense(mlp) => {
            gated(w, mlp, &s.normed, n, &mut s.gate_up, &mut s.act);
            let mlp_out = layer.mlp_out.as_ref();
            let act = &s.act[..n * mlp.width];
            residual(
                x,
                act,
                &mlp.down,
                &mlp.down_bias,
                mlp_out,
                mlp.width,
                &mut s.out,
                &mut s.normed,
            );
        }
        HostFfn::Sparse(moe) => experts_forward(w, moe, x, n, s),
    }
}

/// `act = act_fn(gate) ⊙ up` of `input: [n, hidden]` through `mlp`'s gate and up columns.
fn gated(w: &HostWeights, mlp: &HostMlp, input: &[f32], n: usize, gate_up: &mut [f32], act: &mut [f32]) {
    let (d, f) = (w.hidden, mlp.width);
    let (gate_up, act) = (&mut gate_up[..n * 2 * f], &mut act[..n * f]);
    matmul(gate_up, input, &mlp.gate_up, n, 2 * f, d, false, false, false);
    add_bias(gate_up, &mlp.gate_up_bias);
    match w.activation {
        Activation::Silu => swiglu_into(act, gate_up, f),
        Activation::GeluTanh => geglu_into(act, gate_up, f),
    }
}

/// `x += Σ_k p_k · expert_k(normed)` for each of the `n` rows: the router's softmax in f32, each
/// token's `top_k` experts (their probabilities renormalised when the model says so), each
/// expert run once on the rows routed to it. (Mixtral and Qwen3-MoE have no output norms.)
fn experts_forward(w: &HostWeights, moe: &HostMoe, x: &mut [f32], n: usize, s: &mut Scratch) {
    let (d, e, k) = (w.hidden, moe.experts.len(), moe.top_k);
    let mut probs = vec![0.0f32; n * e];
    matmul(&mut probs, &s.normed, &moe.router, n, e, d, false, false, false);
    for row in probs.chunks_mut(e) {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for p in row.iter_mut() {
            *p = (*p - max).exp();
            sum += *p;
        }
        row.iter_mut().for_each(|p| *p /= sum);
    }
    let chosen = top_k_rows(&probs, e, k);
    let weight = |slot: usize| {
        let (t, p) = (slot / k, probs[slot / k * e + chosen[slot]]);
        if moe.normalize_top_k {
            p / chosen[t * k..(t + 1) * k]
                .iter()
                .map(|&c| probs[t * e + c])
                .sum::<f32>()
        } else {
            p
        }
    };
    let mut routed: Vec<Vec<usize>> = vec![Vec::new(); e];
    for (slot, &expert) in chosen.iter().enumerate() {
        routed[expert].push(slot);
    }
    let mut input = Vec::new();
    let mut out = Vec::new();
    for (expert, slots) in moe.experts.iter().zip(&routed) {
        if slots.is_empty() {
            continue;
        }
        let m = slots.len();
        input.clear();
        for &slot in slots {
            input.extend_from_slice(&s.normed[slot / k * d..][..d]);
        }
        gated(w, expert, &input, m, &mut s.gate_up, &mut s.act);
        out.clear();
        out.resize(m * d, 0.0);
        project_into(
            &mut out,
            &s.act[..m * expert.width],
            &expert.down,
            &expert.down_bias,
            m,
            d,
            expert.width,
        );
        for (row, &slot) in out.chunks(d).zip(slots) {
            let p = weight(slot);
            for (x, y) in x[slot / k * d..][..d].iter_mut().zip(row) {
                *x += p * y;
            }
        }
    }
}

/// A block's input: `x` normalised, or `x` itself where the block has no input norm.
fn block_input(normed: &mut [f32], x: &[f32], norm: Option<&HostNorm>) {
    match norm {
        Some(norm) => rms_norm_into(normed, x, &norm.scale, norm.eps),
        None => normed.copy_from_slice(x),
    }
}

/// The residual update `x += input · weight + bias` (`input: [n, k]`), or with an output norm
/// `x += norm(input · weight + bias)` through the scratch buffers `out` and `normed`.
#[allow(clippy::too_many_arguments)]
fn residual(
    x: &mut [f32],
    input: &[f32],
    weight: &[f32],
    bias: &Option<Vec<f32>>,
    norm: Option<&HostNorm>,
    k: usize,
    out: &mut Vec<f32>,
    normed: &mut [f32],
) {
    let d = weight.len() / k;
    let n = x.len() / d;
    let Some(norm) = norm else {
        project_into(x, input, weight, bias, n, d, k);
        return;
    };
    out.clear();
    out.resize(n * d, 0.0);
    project_into(out, input, weight, bias, n, d, k);
    rms_norm_into(normed, out, &norm.scale, norm.eps);
    for (x, y) in x.iter_mut().zip(normed.iter()) {
        *x += y;
    }
}

/// RMSNorm (weights `norm`: one head wide, or the whole width) of the columns
/// `offset..offset + width` of each row of `rows` (`stride` values per row); nothing without
/// weights.
fn norm_heads(
    rows: &mut [f32],
    stride: usize,
    offset: usize,
    width: usize,
    norm: &Option<HostNorm>,
    tmp: &mut Vec<f32>,
) {
    let Some(norm) = norm else { return };
    for row in rows.chunks_mut(stride) {
        let heads = &mut row[offset..offset + width];
        tmp.clear();
        tmp.extend_from_slice(heads);
        rms_norm_into(heads, tmp, &norm.scale, norm.eps);
    }
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

/// The residual update `x += input · weight + bias` (`input: [n, k]`, `weight: [k, d]`).
fn project_into(
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

#[cfg(test)]
mod tests {
    use super::token_groups;

    #[test]
    fn groups_hold_whole_rows() {
        // Row 0 has 10 tokens, row 1 has 3, row 2 has 9.
        let rows: Vec<(usize, usize)> = [(0, 10), (1, 3), (2, 9)]
            .iter()
            .flat_map(|&(r, n)| (0..n).map(move |p| (r, p)))
            .collect();
        let groups = token_groups(&rows, 2);
        assert_eq!(groups, vec![0..13, 13..22]);
        // One row per token (decoding): an even split.
        let decode: Vec<(usize, usize)> = (0..64).map(|r| (r, 40)).collect();
        assert_eq!(token_groups(&decode, 2), vec![0..32, 32..64]);
        // Too few tokens for two groups.
        assert_eq!(token_groups(&decode[..9], 2), vec![0..9]);
        // A single long row stays whole.
        let one: Vec<(usize, usize)> = (0..50).map(|p| (0, p)).collect();
        assert_eq!(token_groups(&one, 2), vec![0..50]);
    }
}
