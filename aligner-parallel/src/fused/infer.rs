//! Kernels of the CPU inference path (aligner-gen's host runner): a batch is a list of token
//! rows, each belonging to one sequence (a KV-cache row) at one position, so a decode step
//! (one token per sequence) and a prefill (every prompt token) are the same call. Keys and
//! values are read where they lie in the cache — no per-step views or copies, no padding, no
//! mask: each row attends to its own sequence's positions up to its own.

use rayon::prelude::*;

use super::host::{exp_sum_shifted, fast_exp, max_of, rms_norm_row, simd_fn, swiglu_forward_rows};

/// Rows below this many elements run on one thread (a rayon split costs more than the work).
const PARALLEL_ELEMENTS: usize = 1 << 15;

/// RMS norm of each `w.len()`-wide row of `x` into `out`: `x · w / √(mean(x²) + eps)`.
pub fn rms_norm_into(out: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let d = w.len().max(1);
    assert_eq!(out.len(), x.len(), "rms norm output");
    if x.len() < PARALLEL_ELEMENTS {
        for (y, x) in out.chunks_mut(d).zip(x.chunks(d)) {
            rms_norm_row(y, x, w, eps);
        }
    } else {
        out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(y, x)| {
            rms_norm_row(y, x, w, eps);
        });
    }
}

/// `out[r] = silu(gate[r]) · up[r]` for rows `gate_up[r] = [gate (ff) | up (ff)]`.
pub fn swiglu_into(out: &mut [f32], gate_up: &[f32], ff: usize) {
    gated_rows(out, gate_up, ff, swiglu_forward_rows);
}

/// `out[r] = gelu_tanh(gate[r]) · up[r]` (GeGLU with PyTorch's tanh-approximated GELU,
/// Gemma's MLP) for rows `gate_up[r] = [gate (ff) | up (ff)]`.
pub fn geglu_into(out: &mut [f32], gate_up: &[f32], ff: usize) {
    // √(2/π), as PyTorch's `gelu(approximate="tanh")` has it.
    const K: f32 = 0.797_884_6;
    gated_rows(out, gate_up, ff, |o, gate, up| {
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            let inner = K * (g + 0.044_715 * g * g * g);
            *o = 0.5 * g * (1.0 + inner.tanh()) * u;
        }
    });
}

/// `row(out[r], gate[r], up[r])` for every row of `gate_up` (`[gate (ff) | up (ff)]`), on
/// several threads when the rows are large enough.
fn gated_rows(out: &mut [f32], gate_up: &[f32], ff: usize, row: impl Fn(&mut [f32], &[f32], &[f32]) + Sync) {
    assert_eq!(out.len() * 2, gate_up.len(), "gated MLP operands");
    let rows = |(o, gu): (&mut [f32], &[f32])| {
        let (gate, up) = gu.split_at(ff);
        row(o, gate, up);
    };
    if out.len() < PARALLEL_ELEMENTS {
        out.chunks_mut(ff).zip(gate_up.chunks(2 * ff)).for_each(rows);
    } else {
        out.par_chunks_mut(ff)
            .zip(gate_up.par_chunks(2 * ff))
            .for_each(rows);
    }
}

/// Rotary embedding in Hugging Face's `rotate_half` layout, in place: in each row of `x`
/// (stride `row_stride`), the `heads` heads of width `dim` starting at `offset` turn by their
/// row's angles (`cos`, `sin`: `[rows, r / 2]`, `r ≤ dim`): `(a, b) → (a·cos − b·sin,
/// b·cos + a·sin)` for the pairs `(i, i + r/2)`; a head's dimensions past `r` (Phi-3's
/// partial rotary factor) pass through.
pub fn rope_rows(
    x: &mut [f32],
    row_stride: usize,
    offset: usize,
    heads: usize,
    dim: usize,
    cos: &[f32],
    sin: &[f32],
) {
    // The rotated width: the whole head, or (partial rotary) the leading part the angles cover.
    let rows = (x.len() / row_stride).max(1);
    let half = cos.len() / rows;
    assert!(2 * half <= dim, "rope angles wider than the heads");
    for ((row, cos), sin) in x
        .chunks_mut(row_stride)
        .zip(cos.chunks(half))
        .zip(sin.chunks(half))
    {
        for head in row[offset..offset + heads * dim].chunks_mut(dim) {
            let (a, b) = head[..2 * half].split_at_mut(half);
            for (((a, b), &c), &s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
                let (x1, x2) = (*a, *b);
                *a = x1 * c - x2 * s;
                *b = x2 * c + x1 * s;
            }
        }
    }
}

/// Where one layer's keys and values lie. Both are `[cache rows, kv_heads, …]` blocks of
/// `dim · capacity` values per head, laid out for the loop that reads them:
/// - keys `[dim, capacity]`: each dimension's positions in a run, so the scores `q · k` are
///   computed a vector of positions at a time (over positions, which are many, rather than
///   head dimensions: 8 on a small model);
/// - values `[capacity, dim]`: a position's value row in a run, so the output `Σ p · v` adds
///   whole rows, with no sum across vector lanes at the end.
#[derive(Debug, Clone, Copy)]
pub struct CacheLayout {
    pub kv_heads: usize,
    pub capacity: usize,
    pub dim: usize,
}

impl CacheLayout {
    /// Offset of KV head `head` of cache row `row`: its `dim · capacity` values.
    pub fn head(&self, row: usize, head: usize) -> usize {
        (row * self.kv_heads + head) * self.dim * self.capacity
    }

    /// Writes one position's key `x` (`dim` values) of `head` in `row`.
    pub fn write_key(&self, keys: &mut [f32], row: usize, head: usize, pos: usize, x: &[f32]) {
        let base = self.head(row, head) + pos;
        for (d, &v) in x.iter().enumerate() {
            keys[base + d * self.capacity] = v;
        }
    }

    /// Writes one position's value `x` (`dim` values) of `head` in `row`.
    pub fn write_value(&self, values: &mut [f32], row: usize, head: usize, pos: usize, x: &[f32]) {
        let base = self.head(row, head) + pos * self.dim;
        values[base..base + self.dim].copy_from_slice(x);
    }

    /// Where the first `len` positions of row `row` lie in a `buffer` laid out as `self`:
    /// `(start, length)` runs — for keys one per head and dimension, for values one per head.
    /// Two layouts differing only in capacity list their runs in the same order with the same
    /// lengths, so zipping them copies a row from one to the other.
    pub fn runs(
        &self,
        buffer: CacheBuffer,
        row: usize,
        len: usize,
    ) -> impl Iterator<Item = (usize, usize)> + '_ {
        let per_head = match buffer {
            CacheBuffer::Keys => self.dim,
            CacheBuffer::Values => 1,
        };
        (0..self.kv_heads).flat_map(move |h| {
            (0..per_head).map(move |d| match buffer {
                CacheBuffer::Keys => (self.head(row, h) + d * self.capacity, len),
                CacheBuffer::Values => (self.head(row, h), len * self.dim),
            })
        })
    }
}

/// The two buffers of a layer's cache, which [`CacheLayout`] lays out differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheBuffer {
    Keys,
    Values,
}

/// `x ← cap · tanh(x / cap)` for every value (Gemma's soft-cap, on scores or logits).
#[inline]
pub fn soft_cap_in_place(values: &mut [f32], cap: f32) {
    for x in values {
        *x = cap * (*x / cap).tanh();
    }
}

/// How a layer turns query·key products into attention scores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scoring {
    /// The factor on `q·k` (`head_dim^-½`, Gemma's `query_pre_attn_scalar^-½`).
    pub scale: f32,
    /// A sliding window (Mistral's, Gemma's local layers): a token sees itself and the
    /// `window - 1` positions before it.
    pub window: Option<usize>,
    /// Gemma 2's soft-cap: scores become `cap · tanh(score / cap)`.
    pub softcap: Option<f32>,
}

impl Scoring {
    /// `head_dim^-½`, every earlier position, no cap.
    pub fn plain(dim: usize) -> Self {
        Self {
            scale: 1.0 / (dim as f32).sqrt(),
            window: None,
            softcap: None,
        }
    }
}

/// Grouped-query attention of token rows over a KV cache: token `t` (query `q[t]`, `heads`
/// heads of `layout.dim`, at column `q_offset` of rows of stride `q_stride`) belongs to cache
/// row `rows[t].0` at position `rows[t].1` and attends to that row's positions `0..=pos`
/// (which must be written), or under `scoring`'s sliding window to
/// `pos + 1 - window ..= pos` only. Query head `h` reads KV head `h / (heads / kv_heads)`.
/// Output: `out[t]` = `heads · dim` values.
#[allow(clippy::too_many_arguments)]
pub fn cached_attention(
    out: &mut [f32],
    q: &[f32],
    q_stride: usize,
    q_offset: usize,
    keys: &[f32],
    values: &[f32],
    rows: &[(usize, usize)],
    heads: usize,
    layout: CacheLayout,
    scoring: Scoring,
) {
    let Scoring {
        scale,
        window,
        softcap,
    } = scoring;
    let window = window.unwrap_or(usize::MAX).max(1);
    let width = heads * layout.dim;
    assert_eq!(out.len(), rows.len() * width, "attention output");
    assert_eq!(q.len(), rows.len() * q_stride, "attention queries");
    let task = |(t, out): (usize, &mut [f32])| {
        let mut scores = Vec::new();
        let q = &q[t * q_stride + q_offset..][..width];
        let (row, pos) = rows[t];
        attend_row(
            out,
            q,
            keys,
            values,
            row,
            pos,
            heads,
            layout,
            scale,
            window,
            softcap,
            &mut scores,
        );
    };
    // Work per token grows with its position; small batches stay on this thread.
    let work: usize = rows.iter().map(|&(_, pos)| pos + 1).sum::<usize>() * width;
    if work < PARALLEL_ELEMENTS {
        out.chunks_mut(width).enumerate().for_each(task);
    } else {
        out.par_chunks_mut(width).enumerate().for_each(task);
    }
}

simd_fn!(
    /// One token's attention, every head: scores, softmax, weighted sum of values.
    fn attend_row(out: &mut [f32], q: &[f32], keys: &[f32], values: &[f32], row: usize, pos: usize, heads: usize, layout: CacheLayout, scale: f32, window: usize, softcap: Option<f32>, scores: &mut Vec<f32>) = attend_row_body
);

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_row_body(
    out: &mut [f32],
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    row: usize,
    pos: usize,
    heads: usize,
    layout: CacheLayout,
    scale: f32,
    window: usize,
    softcap: Option<f32>,
    scores: &mut Vec<f32>,
) {
    let (dim, cap) = (layout.dim, layout.capacity);
    let groups = heads / layout.kv_heads;
    let n = pos + 1;
    // Positions before the window get probability 0 (their scores are computed, then hidden).
    let first = n.saturating_sub(window);
    // Scores on whole vectors of positions when the capacity allows (the engine rounds it
    // up): the positions past `n` get probability 0, and the loops end in no scalar remainder.
    let width = (n.div_ceil(LANES) * LANES).min(cap);
    let whole = width / LANES * LANES;
    // Four vectors of positions at a time while there are (four independent sums in flight),
    // then one at a time.
    let quads = whole / (4 * LANES) * (4 * LANES);
    scores.resize(width, 0.0);
    for (h, (o, qh)) in out.chunks_mut(dim).zip(q.chunks(dim)).enumerate() {
        let base = layout.head(row, h / groups);
        score_vectors::<4>(&mut scores[..quads], qh, keys, base, cap, scale);
        score_vectors::<1>(&mut scores[quads..whole], qh, keys, base + quads, cap, scale);
        for (p, s) in scores.iter_mut().enumerate().skip(whole) {
            let dot: f32 = qh
                .iter()
                .enumerate()
                .map(|(d, &qd)| qd * keys[base + d * cap + p])
                .sum();
            *s = dot * scale;
        }
        if let Some(cap) = softcap {
            soft_cap_in_place(&mut scores[first..n], cap);
        }
        scores[n..].fill(f32::NEG_INFINITY);
        scores[..first].fill(f32::NEG_INFINITY);
        let max = max_of(&scores[..n]);
        let inv = 1.0 / exp_sum_shifted(scores, max);
        // The row's own positions only: past them the probabilities are 0, but whatever an
        // earlier occupant left there (a diverged sequence's NaN) would not be cancelled.
        weighted_rows(o, &scores[..n], &values[base..][..n * dim]);
        for o in o.iter_mut() {
            *o *= inv;
        }
    }
}

/// Scores of the positions `scores` covers (whole groups of `V` vectors), keys of one head
/// from `at` on: each group summed over the head's dimensions in registers (a pass over all
/// positions per dimension would load and store the scores each time), then scaled.
#[inline(always)]
fn score_vectors<const V: usize>(
    scores: &mut [f32],
    q: &[f32],
    keys: &[f32],
    at: usize,
    cap: usize,
    scale: f32,
) {
    for (c, chunk) in scores.chunks_exact_mut(V * LANES).enumerate() {
        let mut acc = [[0.0f32; LANES]; V];
        for (d, &qd) in q.iter().enumerate() {
            let first = at + d * cap + c * V * LANES;
            for (j, acc) in acc.iter_mut().enumerate() {
                for (a, &k) in acc.iter_mut().zip(vector(&keys[first + j * LANES..])) {
                    *a += qd * k;
                }
            }
        }
        for (s, a) in chunk.iter_mut().zip(acc.as_flattened()) {
            *s = a * scale;
        }
    }
}

/// `out = Σ_p weights[p] · rows[p]` for `weights.len()` consecutive rows of `out.len()`
/// values, with the usual head widths unrolled so that the sums stay in registers.
#[inline(always)]
fn weighted_rows(out: &mut [f32], weights: &[f32], rows: &[f32]) {
    match out.len() {
        8 => weighted_rows_of::<8>(out, weights, rows),
        16 => weighted_rows_of::<16>(out, weights, rows),
        32 => weighted_rows_of::<32>(out, weights, rows),
        64 => weighted_rows_of::<64>(out, weights, rows),
        128 => weighted_rows_of::<128>(out, weights, rows),
        dim => {
            out.fill(0.0);
            for (&w, row) in weights.iter().zip(rows.chunks_exact(dim)) {
                for (o, &v) in out.iter_mut().zip(row) {
                    *o += w * v;
                }
            }
        }
    }
}

/// [`weighted_rows`] for rows of `D` values: four rows at a time into four sums (four
/// independent chains of adds in flight), added up at the end.
#[inline(always)]
fn weighted_rows_of<const D: usize>(out: &mut [f32], weights: &[f32], rows: &[f32]) {
    let mut acc = [[0.0f32; D]; 4];
    let quads = weights.len() / 4 * 4;
    for (w, r) in weights[..quads].chunks_exact(4).zip(rows.chunks_exact(4 * D)) {
        for (j, acc) in acc.iter_mut().enumerate() {
            let row: &[f32; D] = r[j * D..(j + 1) * D].try_into().expect("D values");
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += w[j] * v;
            }
        }
    }
    for (&w, row) in weights[quads..].iter().zip(rows[quads * D..].chunks_exact(D)) {
        for (a, &v) in acc[0].iter_mut().zip(row) {
            *a += w * v;
        }
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
    }
}

/// The first [`LANES`] values of `xs` as a fixed-size vector (which keeps loops over it in
/// registers).
#[inline(always)]
fn vector(xs: &[f32]) -> &[f32; LANES] {
    xs[..LANES].try_into().expect("LANES values")
}

/// Lanes of the vector loops here (independent accumulators, so the loops vectorise); cache
/// capacities that are a multiple of it let attention run on whole vectors.
pub const LANES: usize = 16;

simd_fn!(
    /// `Σ e^((x − max)·inv_t)` over a row, without writing it (the normaliser of sampling at
    /// temperature `1 / inv_t`).
    pub fn scaled_exp_sum(xs: &[f32], max: f32, inv_t: f32) -> f32 = scaled_exp_sum_body
);

#[inline(always)]
fn scaled_exp_sum_body(xs: &[f32], max: f32, inv_t: f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest: f32 = chunks
        .remainder()
        .iter()
        .map(|&x| fast_exp((x - max) * inv_t))
        .sum();
    for chunk in chunks {
        for (l, &x) in lanes.iter_mut().zip(chunk) {
            *l += fast_exp((x - max) * inv_t);
        }
    }
    lanes.iter().sum::<f32>() + rest
}

simd_fn!(
    /// `log Σ e^x` of a row, without writing it.
    pub fn log_sum_exp(xs: &[f32]) -> f32 = log_sum_exp_body
);

#[inline(always)]
fn log_sum_exp_body(xs: &[f32]) -> f32 {
    let max = max_of(xs);
    if max == f32::NEG_INFINITY {
        return max;
    }
    max + scaled_exp_sum_body(xs, max, 1.0).ln()
}

simd_fn!(
    /// The largest value of a row (`-inf` when empty).
    pub fn row_max(xs: &[f32]) -> f32 = max_of
);
