//! The CPU kernels behind the fused ops: plain row-major `f32` slices, rayon across rows or
//! heads, the `gemm` crate for the vocabulary projection.

use rayon::prelude::*;

/// Defines `fn $name(..)` that runs `$body` compiled for AVX-512 or AVX2+FMA when the CPU has
/// them (checked at run time, cached by std), else for the baseline target: the row loops
/// below are written to vectorise, and the default x86-64 target gives them 4-wide SSE only.
macro_rules! simd_fn {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:ident) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v4($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v3($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features `v4` is compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: as above, for `v3`.
                    return unsafe { v3($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

simd_fn!(
    /// Turns a row of logits into its softmax in place; returns `(logsumexp, log p(target))`.
    fn log_softmax_row(row: &mut [f32], target: Option<usize>) -> (f32, f32) = log_softmax_row_body
);

#[inline(always)]
fn log_softmax_row_body(row: &mut [f32], target: Option<usize>) -> (f32, f32) {
    let max = max_of(row);
    let picked = target.map(|t| row[t]);
    let sum = exp_sum_shifted(row, max);
    let lse = max + sum.ln();
    let inv = 1.0 / sum;
    for x in row.iter_mut() {
        *x *= inv;
    }
    (lse, picked.map_or(0.0, |x| x - lse))
}

simd_fn!(
    /// `x ← e^(x − shift)`.
    fn exp_shifted_row(row: &mut [f32], shift: f32) = exp_shifted_row_body
);

/// `x ← e^(x − shift)` and the sum of the results, in one pass: rows are often
/// vocabulary-wide, so passes cost memory bandwidth more than arithmetic.
#[inline(always)]
pub(crate) fn exp_sum_shifted(xs: &mut [f32], shift: f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(chunk.iter_mut()) {
            *x = fast_exp(*x - shift);
            *l += *x;
        }
    }
    let mut rest = 0.0f32;
    for x in chunks.into_remainder() {
        *x = fast_exp(*x - shift);
        rest += *x;
    }
    lanes.iter().sum::<f32>() + rest
}

#[inline(always)]
fn exp_shifted_row_body(row: &mut [f32], shift: f32) {
    for x in row.iter_mut() {
        *x -= shift;
    }
    exp_in_place(row);
}

simd_fn!(
    /// Softmax row `p` → `grad · (onehot(target) − p)`; all zero for a padding target.
    fn softmax_grad_row(row: &mut [f32], grad: f32, target: Option<usize>) = softmax_grad_row_body
);

#[inline(always)]
fn softmax_grad_row_body(row: &mut [f32], grad: f32, target: Option<usize>) {
    match target {
        Some(t) => {
            for x in row.iter_mut() {
                *x *= -grad;
            }
            row[t] += grad;
        }
        None => row.fill(0.0),
    }
}

/// `e^x` for a whole slice, in place: Cody–Waite range reduction and a degree-6 polynomial,
/// branch-free so the loop vectorises (libm's scalar `expf` was a sixth of a training step).
/// Relative error below 5e-7 for x in [-87, 88]; below that the result is 0.
#[inline(always)]
pub fn exp_in_place(xs: &mut [f32]) {
    for x in xs {
        *x = fast_exp(*x);
    }
}

#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and removing 1.5·2²³ rounds to the nearest integer without a libm call.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.0);
    let rounded = x * LOG2E + ROUND;
    let n = rounded - ROUND;
    // The integer `n` is also the low mantissa bits of `rounded`: reading it from the bits
    // keeps the loop vectorised (`n as i32` is a saturating conversion that LLVM emits one
    // lane at a time).
    let n_int = (rounded.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.666_666_7e-1
                    + r * (4.166_579_6e-2 + r * (8.333_452e-3 + r * (1.393_859e-3 + r * 1.987_569e-4))))));
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    // Below e^-87 the value is a denormal: flush it to zero so masked scores vanish exactly.
    if x <= -87.3 { 0.0 } else { p * scale }
}

/// `c = a·b` (or `c += a·b` when `accumulate`) for row-major `a: [m, k]`, `b: [k, n]`,
/// `c: [m, n]`; `a_t` / `b_t` read `a` as `[k, m]` / `b` as `[n, k]` transposed instead. Large
/// products use every core.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    n: usize,
    k: usize,
    a_t: bool,
    b_t: bool,
    accumulate: bool,
) {
    let parallel = m * n * k >= 1 << 21;
    matmul_with(c, a, b, (m, n, k), (a_t, b_t), accumulate, parallel);
}

/// [`matmul`] on one thread, for products inside an already parallel loop.
pub(crate) fn matmul_serial(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    mnk: (usize, usize, usize),
    t: (bool, bool),
    accumulate: bool,
) {
    matmul_with(c, a, b, mnk, t, accumulate, false);
}

fn matmul_with(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    (m, n, k): (usize, usize, usize),
    (a_t, b_t): (bool, bool),
    accumulate: bool,
    parallel: bool,
) {
    assert_eq!(c.len(), m * n, "matmul output");
    assert_eq!(a.len(), m * k, "matmul lhs");
    assert_eq!(b.len(), k * n, "matmul rhs");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    // (column stride, row stride) of each operand as stored.
    let (a_cs, a_rs) = if a_t { (m as isize, 1) } else { (1, k as isize) };
    let (b_cs, b_rs) = if b_t { (k as isize, 1) } else { (1, n as isize) };
    let parallelism = if parallel {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above bound every index the strides reach; `c` does not alias `a`/`b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Rows of a log-softmax pass kept between forward and backward: each row's `logsumexp`, and
/// the softmax itself when it fits the memory budget (else the backward recomputes it).
pub struct SoftmaxRows {
    pub lse: Vec<f32>,
    pub probs: Option<Vec<f32>>,
}

/// Softmax rows are kept for the backward when a block of [`LOGIT_BLOCK_ROWS`] of them fits this
/// many floats (256 MB), and recomputed there otherwise.
pub const KEEP_PROBS_LIMIT: usize = 1 << 26;

/// An output projection `[d, v]` as the host kernels read it: row-major, or (`transposed`) the
/// row-major `[v, d]` it is the transpose of (a tied embedding), read in place.
#[derive(Debug, Clone, Copy)]
pub struct WeightRef<'a> {
    pub values: &'a [f32],
    pub transposed: bool,
}

impl<'a> WeightRef<'a> {
    /// A row-major `[d, v]` weight.
    pub fn rows(values: &'a [f32]) -> Self {
        Self {
            values,
            transposed: false,
        }
    }
}

/// Rows of logits computed at once by [`token_logprobs_forward`] and its backward at most: one
/// `[rows, vocab]` block at a time, whatever the number of rows.
pub const LOGIT_BLOCK_ROWS: usize = crate::logprob::DEFAULT_CHUNK_TOKENS;

/// Values of one block of logits at most (256 MB): a large vocabulary takes fewer rows at once
/// (441 of Qwen2.5's 151,936-wide rows), since the block is live beside the activations when
/// the backward starts.
pub const LOGIT_BLOCK_VALUES: usize = 1 << 26;

/// Rows per block of logits for a vocabulary of `v`.
pub fn logit_block_rows(v: usize) -> usize {
    (LOGIT_BLOCK_VALUES / v.max(1)).clamp(1, LOGIT_BLOCK_ROWS)
}

/// Log-probabilities of `targets` under `softmax(hidden · weight)`.
///
/// `hidden: [n, d]`, `weight: [d, v]`; a target outside `0..v` (padding) gets log-prob 0 and no
/// gradient. The logits are computed [`logit_block_rows`] at a time, so one call serves
/// every row with a single copy of the weight and no `[n, v]` tensor beyond the kept softmax
/// (kept for a backward, `for_backward`, when the vocabulary is narrow enough:
/// [`KEEP_PROBS_LIMIT`]).
pub fn token_logprobs_forward(
    hidden: &[f32],
    weight: WeightRef<'_>,
    targets: &[i64],
    (d, v): (usize, usize),
    for_backward: bool,
) -> (Vec<f32>, SoftmaxRows) {
    let n = targets.len();
    let mut lse = vec![0.0f32; n];
    let mut out = vec![0.0f32; n];
    // A vocabulary whose 1,024-row block fits the limit keeps its softmax for the backward
    // (the 16M benchmark's 50k words: the backward then skips a product as wide as the
    // forward's); a wider one (Qwen's 152k) recomputes it block by block.
    let keep = for_backward && v * LOGIT_BLOCK_ROWS <= KEEP_PROBS_LIMIT;
    // Kept, the logits are computed in their place in the kept softmax; else in one block.
    let mut kept = keep.then(|| vec![0.0f32; n * v]);
    let rows = logit_block_rows(v);
    let mut block = match keep {
        true => Vec::new(),
        false => vec![0.0f32; n.min(rows) * v],
    };
    for start in (0..n).step_by(rows) {
        let end = (start + rows).min(n);
        let logits = match kept.as_mut() {
            Some(kept) => &mut kept[start * v..end * v],
            None => &mut block[..(end - start) * v],
        };
        let (w, w_t) = (weight.values, weight.transposed);
        matmul(
            logits,
            &hidden[start * d..end * d],
            w,
            end - start,
            v,
            d,
            false,
            w_t,
            false,
        );
        logits
            .par_chunks_mut(v.max(1))
            .zip(lse[start..end].par_iter_mut())
            .zip(out[start..end].par_iter_mut())
            .zip(targets[start..end].par_iter())
            .for_each(|(((row, lse), out), &target)| {
                (*lse, *out) = log_softmax_row(row, valid(target, v));
            });
    }
    (out, SoftmaxRows { lse, probs: kept })
}

/// Gradients of [`token_logprobs_forward`] for the upstream gradient `grad: [n]`:
/// `(d hidden [n, d], d weight [d, v])`, with `d logits = grad · (onehot(target) − softmax)`,
/// [`logit_block_rows`] at a time (the weight's gradient summed over the blocks in place).
pub fn token_logprobs_backward(
    hidden: &[f32],
    weight: WeightRef<'_>,
    targets: &[i64],
    rows: SoftmaxRows,
    grad: &[f32],
    d: usize,
    v: usize,
) -> (Vec<f32>, Vec<f32>) {
    let n = targets.len();
    let (w, w_t) = (weight.values, weight.transposed);
    let mut d_hidden = vec![0.0f32; n * d];
    let mut d_weight = vec![0.0f32; d * v];
    let mut probs = rows.probs;
    // Softmax rows recomputed block by block when they were not kept.
    let mut block = match probs {
        Some(_) => Vec::new(),
        None => vec![0.0f32; n.min(logit_block_rows(v)) * v],
    };
    let block_rows = logit_block_rows(v);
    for start in (0..n).step_by(block_rows) {
        let end = (start + block_rows).min(n);
        let m = end - start;
        let h = &hidden[start * d..end * d];
        let g = match probs.as_mut() {
            Some(probs) => &mut probs[start * v..end * v],
            None => {
                let logits = &mut block[..m * v];
                matmul(logits, h, w, m, v, d, false, w_t, false);
                logits
                    .par_chunks_mut(v.max(1))
                    .zip(rows.lse[start..end].par_iter())
                    .for_each(|(row, &lse)| exp_shifted_row(row, lse));
                logits
            }
        };
        g.par_chunks_mut(v.max(1))
            .zip(grad[start..end].par_iter())
            .zip(targets[start..end].par_iter())
            .for_each(|((row, &gi), &target)| softmax_grad_row(row, gi, valid(target, v)));
        matmul(
            &mut d_hidden[start * d..end * d],
            g,
            w,
            m,
            d,
            v,
            false,
            !w_t,
            false,
        );
        matmul(&mut d_weight, h, g, d, v, m, true, false, start > 0);
    }
    (d_hidden, d_weight)
}

simd_fn!(
    /// `out = silu(gate) · up` elementwise (the SwiGLU of a Llama MLP), `silu(x) = x·σ(x)`.
    pub(crate) fn swiglu_forward_rows(out: &mut [f32], gate: &[f32], up: &[f32]) = swiglu_forward_body
);

#[inline(always)]
fn swiglu_forward_body(out: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + fast_exp(-g)) * u;
    }
}

simd_fn!(
    /// Gradients of [`swiglu_forward_rows`] for `grad`, written over `d_gate` and `d_up`:
    /// `d up = grad · silu(g)`, `d gate = grad · u · σ(g)·(1 + g·(1 − σ(g)))`.
    fn swiglu_backward_rows(d_gate: &mut [f32], d_up: &mut [f32], gate: &[f32], up: &[f32], grad: &[f32]) = swiglu_backward_body
);

#[inline(always)]
fn swiglu_backward_body(d_gate: &mut [f32], d_up: &mut [f32], gate: &[f32], up: &[f32], grad: &[f32]) {
    for ((((dg, du), &g), &u), &dy) in d_gate.iter_mut().zip(d_up.iter_mut()).zip(gate).zip(up).zip(grad) {
        let sig = 1.0 / (1.0 + fast_exp(-g));
        *du = dy * g * sig;
        *dg = dy * u * sig * (1.0 + g * (1.0 - sig));
    }
}

/// Elements per parallel task of the elementwise ops.
const ELEMENT_CHUNK: usize = 1 << 14;

/// `silu(gate) · up` over whole tensors, in parallel chunks.
pub fn swiglu_forward(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "swiglu operands");
    let mut out = vec![0.0f32; gate.len()];
    out.par_chunks_mut(ELEMENT_CHUNK)
        .zip(gate.par_chunks(ELEMENT_CHUNK))
        .zip(up.par_chunks(ELEMENT_CHUNK))
        .for_each(|((o, g), u)| swiglu_forward_rows(o, g, u));
    out
}

/// `(d gate, d up)` of [`swiglu_forward`] for `grad`.
pub fn swiglu_backward(gate: &[f32], up: &[f32], grad: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut d_gate = vec![0.0f32; gate.len()];
    let mut d_up = vec![0.0f32; gate.len()];
    d_gate
        .par_chunks_mut(ELEMENT_CHUNK)
        .zip(d_up.par_chunks_mut(ELEMENT_CHUNK))
        .zip(gate.par_chunks(ELEMENT_CHUNK).zip(up.par_chunks(ELEMENT_CHUNK)))
        .zip(grad.par_chunks(ELEMENT_CHUNK))
        .for_each(|(((dg, du), (g, u)), dy)| swiglu_backward_rows(dg, du, g, u, dy));
    (d_gate, d_up)
}

simd_fn!(
    /// One row of RMS normalisation: `y = x · w / √(mean(x²) + eps)`; returns `1/√(mean(x²) + eps)`.
    pub(crate) fn rms_norm_row(y: &mut [f32], x: &[f32], w: &[f32], eps: f32) -> f32 = rms_norm_row_body
);

#[inline(always)]
fn rms_norm_row_body(y: &mut [f32], x: &[f32], w: &[f32], eps: f32) -> f32 {
    let mut squares = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for chunk in chunks {
        for (s, &v) in squares.iter_mut().zip(chunk) {
            *s += v * v;
        }
    }
    let mean = (squares.iter().sum::<f32>() + rest) / x.len() as f32;
    let r = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in y.iter_mut().zip(x).zip(w) {
        *o = v * r * g;
    }
    r
}

simd_fn!(
    /// One row of the RMS-norm backward: `dx = r·(dy·w − x̂·mean(dy·w·x̂))` with `x̂ = x·r`,
    /// and `dw += dy·x̂`.
    fn rms_norm_grad_row(dx: &mut [f32], dw: &mut [f32], x: &[f32], w: &[f32], dy: &[f32], r: f32) = rms_norm_grad_row_body
);

#[inline(always)]
fn rms_norm_grad_row_body(dx: &mut [f32], dw: &mut [f32], x: &[f32], w: &[f32], dy: &[f32], r: f32) {
    let mut dots = [0.0f32; LANES];
    let n = x.len();
    let full = n - n % LANES;
    for ((xs, ws), gs) in x[..full]
        .chunks_exact(LANES)
        .zip(w[..full].chunks_exact(LANES))
        .zip(dy[..full].chunks_exact(LANES))
    {
        for (((acc, &xv), &wv), &gv) in dots.iter_mut().zip(xs).zip(ws).zip(gs) {
            *acc += gv * wv * xv;
        }
    }
    let rest: f32 = x[full..]
        .iter()
        .zip(&w[full..])
        .zip(&dy[full..])
        .map(|((xv, wv), gv)| gv * wv * xv)
        .sum();
    let c = (dots.iter().sum::<f32>() + rest) * r * r / n as f32;
    for ((((dxv, dwv), &xv), &wv), &gv) in dx.iter_mut().zip(dw.iter_mut()).zip(x).zip(w).zip(dy) {
        *dxv = r * (gv * wv - xv * c);
        *dwv += gv * xv * r;
    }
}

/// RMS norm over the last axis of `x: [rows, d]` with weight `w: [d]`: `(y, 1/rms per row)`.
pub fn rms_norm_forward(x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let d = w.len().max(1);
    let mut y = vec![0.0f32; x.len()];
    let mut inv = vec![0.0f32; x.len() / d];
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .zip(inv.par_iter_mut())
        .for_each(|((y, x), r)| *r = rms_norm_row(y, x, w, eps));
    (y, inv)
}

/// `(dx, dw)` of [`rms_norm_forward`] for `dy`; `dw` is summed over rows per thread, then reduced.
pub fn rms_norm_backward(x: &[f32], w: &[f32], inv: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let d = w.len().max(1);
    let mut dx = vec![0.0f32; x.len()];
    let rows_per_task = (ELEMENT_CHUNK / d).max(1);
    let dw = dx
        .par_chunks_mut(d * rows_per_task)
        .zip(x.par_chunks(d * rows_per_task))
        .zip(dy.par_chunks(d * rows_per_task))
        .zip(inv.par_chunks(rows_per_task))
        .map(|(((dx, x), dy), inv)| {
            let mut dw = vec![0.0f32; d];
            for (((dx, x), dy), &r) in dx.chunks_mut(d).zip(x.chunks(d)).zip(dy.chunks(d)).zip(inv) {
                rms_norm_grad_row(dx, &mut dw, x, w, dy, r);
            }
            dw
        })
        .reduce(
            || vec![0.0f32; d],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(b) {
                    *x += y;
                }
                a
            },
        );
    (dx, dw)
}

fn valid(target: i64, v: usize) -> Option<usize> {
    usize::try_from(target).ok().filter(|&t| t < v)
}

/// Shapes of one attention call: `q: [batch, heads, queries, dim]`,
/// `k, v: [batch, kv_heads, keys, dim]`; query head `h` reads KV head `h / (heads / kv_heads)`.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub queries: usize,
    pub keys: usize,
    pub dim: usize,
}

impl AttentionShape {
    fn groups(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Keys `0..end` of query `i` that can be visible, and the mask row if any: causal rows
    /// stop at the diagonal, so the work above it is skipped.
    #[inline(always)]
    fn row<'m>(&self, mask: Option<&'m [bool]>, b: usize, i: usize) -> (usize, Option<&'m [bool]>) {
        match mask {
            Some(m) => (
                self.keys,
                Some(&m[(b * self.queries + i) * self.keys..][..self.keys]),
            ),
            None => ((i + 1 + self.keys - self.queries).min(self.keys), None),
        }
    }
}

/// `x · scale − shift`, or `-inf` where `mask` hides the key; the unmasked loop has no
/// branch so it vectorises.
#[inline(always)]
fn scale_masked(xs: &mut [f32], mask: Option<&[bool]>, scale: f32, shift: f32) {
    match mask {
        Some(mask) => {
            for (x, &hidden) in xs.iter_mut().zip(mask) {
                *x = if hidden {
                    f32::NEG_INFINITY
                } else {
                    *x * scale - shift
                };
            }
        }
        None => {
            for x in xs.iter_mut() {
                *x = *x * scale - shift;
            }
        }
    }
}

/// Lanes of the reductions below: independent accumulators let the compiler keep them in
/// vector registers (a single running max or sum must stay in order).
const LANES: usize = 16;

#[inline(always)]
pub(crate) fn max_of(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for chunk in chunks {
        for (l, &x) in lanes.iter_mut().zip(chunk) {
            *l = l.max(x);
        }
    }
    lanes.into_iter().fold(rest, f32::max)
}

#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

simd_fn!(
    /// Per-row softmax of `scores · scale` over the visible keys, in place (hidden keys get
    /// 0); returns the row's `logsumexp`, `-inf` when it sees no key.
    pub(crate) fn softmax_row(scores: &mut [f32], visible: usize, mask: Option<&[bool]>, scale: f32) -> f32 = softmax_row_body
);

simd_fn!(
    /// One query row of the attention backward: `p` (the row's scores on entry) becomes the
    /// recomputed probabilities and `ds` (`dO·vᵀ` on entry) the score gradient
    /// `p · (ds − delta) · scale`; keys from `visible` on are zero in both.
    fn attention_grad_row(p: &mut [f32], ds: &mut [f32], visible: usize, mask: Option<&[bool]>, scale: f32, lse: f32, delta: f32) = attention_grad_row_body
);

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attention_grad_row_body(
    p: &mut [f32],
    ds: &mut [f32],
    visible: usize,
    mask: Option<&[bool]>,
    scale: f32,
    lse: f32,
    delta: f32,
) {
    let (p_head, p_tail) = p.split_at_mut(visible);
    let (ds_head, ds_tail) = ds.split_at_mut(visible);
    p_tail.fill(0.0);
    ds_tail.fill(0.0);
    // One pass: p = e^(s·scale − lse), ds = p·(ds − delta)·scale.
    match mask {
        None => {
            for (p, d) in p_head.iter_mut().zip(ds_head.iter_mut()) {
                *p = fast_exp(*p * scale - lse);
                *d = *p * (*d - delta) * scale;
            }
        }
        Some(mask) => {
            for ((p, d), &hidden) in p_head.iter_mut().zip(ds_head.iter_mut()).zip(mask) {
                *p = if hidden { 0.0 } else { fast_exp(*p * scale - lse) };
                *d = *p * (*d - delta) * scale;
            }
        }
    }
}

#[inline(always)]
fn softmax_row_body(scores: &mut [f32], visible: usize, mask: Option<&[bool]>, scale: f32) -> f32 {
    let (head, tail) = scores.split_at_mut(visible);
    tail.fill(0.0);
    scale_masked(head, mask, scale, 0.0);
    let max = max_of(head);
    if max == f32::NEG_INFINITY {
        head.fill(0.0);
        return f32::NEG_INFINITY;
    }
    let sum = exp_sum_shifted(head, max);
    let inv = 1.0 / sum;
    for x in head.iter_mut() {
        *x *= inv;
    }
    max + sum.ln()
}

/// `softmax(q·kᵀ·scale, masked)·v` and each query row's `logsumexp` (`-inf` when the row
/// sees no key; its output is then 0). Per (batch, head): two small GEMMs around a row softmax.
pub fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<&[bool]>,
    s: AttentionShape,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let (dim, groups, keys) = (s.dim, s.groups(), s.keys);
    let head_block = s.queries * dim;
    let mut out = vec![0.0f32; s.batch * s.heads * head_block];
    let mut lse = vec![f32::NEG_INFINITY; s.batch * s.heads * s.queries];
    out.par_chunks_mut(head_block.max(1))
        .zip(lse.par_chunks_mut(s.queries.max(1)))
        .enumerate()
        .for_each(|(bh, (out, lse))| {
            let b = bh / s.heads;
            let kv = (b * s.kv_heads + (bh % s.heads) / groups) * keys * dim;
            let (kg, vg) = (&k[kv..][..keys * dim], &v[kv..][..keys * dim]);
            let qh = &q[bh * head_block..][..head_block];
            let mut probs = vec![0.0f32; s.queries * keys];
            matmul_serial(&mut probs, qh, kg, (s.queries, keys, dim), (false, true), false);
            for (i, row) in probs.chunks_mut(keys).enumerate() {
                let (visible, mask_row) = s.row(mask, b, i);
                lse[i] = softmax_row(row, visible, mask_row, scale);
            }
            matmul_serial(out, &probs, vg, (s.queries, dim, keys), (false, false), false);
        });
    (out, lse)
}

/// Gradients of [`attention_forward`] for `grad` (shaped like its output): `(dq, dk, dv)`.
/// Probabilities are recomputed from `lse`; work is split by (batch, KV head) so each task
/// owns the key and value gradients it accumulates over its query heads.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    grad: &[f32],
    mask: Option<&[bool]>,
    s: AttentionShape,
    scale: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (dim, groups, keys, queries) = (s.dim, s.groups(), s.keys, s.queries);
    let kv_block = keys * dim;
    let head_block = queries * dim;
    let mut dq = vec![0.0f32; q.len()];
    let mut dk = vec![0.0f32; k.len()];
    let mut dv = vec![0.0f32; v.len()];
    dq.par_chunks_mut((groups * head_block).max(1))
        .zip(dk.par_chunks_mut(kv_block.max(1)))
        .zip(dv.par_chunks_mut(kv_block.max(1)))
        .enumerate()
        .for_each(|(bkv, ((dq, dk), dv))| {
            let b = bkv / s.kv_heads;
            let (kg, vg) = (&k[bkv * kv_block..][..kv_block], &v[bkv * kv_block..][..kv_block]);
            let mut probs = vec![0.0f32; queries * keys];
            let mut dscores = vec![0.0f32; queries * keys];
            for g in 0..groups {
                let bh = bkv * groups + g;
                let range = bh * head_block..(bh + 1) * head_block;
                let (qh, oh, doh) = (&q[range.clone()], &out[range.clone()], &grad[range]);
                matmul_serial(&mut probs, qh, kg, (queries, keys, dim), (false, true), false);
                matmul_serial(&mut dscores, doh, vg, (queries, keys, dim), (false, true), false);
                for (i, (p_row, ds_row)) in probs.chunks_mut(keys).zip(dscores.chunks_mut(keys)).enumerate() {
                    let lse_i = lse[bh * queries + i];
                    let (visible, mask_row) = s.row(mask, b, i);
                    if lse_i == f32::NEG_INFINITY {
                        p_row.fill(0.0);
                        ds_row.fill(0.0);
                        continue;
                    }
                    let delta = dot(&doh[i * dim..][..dim], &oh[i * dim..][..dim]);
                    attention_grad_row(p_row, ds_row, visible, mask_row, scale, lse_i, delta);
                }
                let dqh = &mut dq[g * head_block..][..head_block];
                matmul_serial(dqh, &dscores, kg, (queries, dim, keys), (false, false), false);
                matmul_serial(dk, &dscores, qh, (keys, dim, queries), (true, false), true);
                matmul_serial(dv, &probs, doh, (keys, dim, queries), (true, false), true);
            }
        });
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        let mut worst = 0.0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let rel = (fast_exp(x) - x.exp()).abs() / x.exp();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(fast_exp(-1000.0), 0.0);
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(0.0), 1.0);
    }

    #[test]
    fn matmul_transposes_agree() {
        let (m, n, k) = (3, 4, 5);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| 1.0 - i as f32 * 0.25).collect();
        let naive: Vec<f32> = (0..m * n)
            .map(|ij| (0..k).map(|t| a[ij / n * k + t] * b[t * n + ij % n]).sum())
            .collect();
        let transpose = |x: &[f32], r: usize, c: usize| -> Vec<f32> {
            (0..r * c).map(|ij| x[(ij % r) * c + ij / r]).collect()
        };
        for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
            let a_in = if a_t { transpose(&a, m, k) } else { a.clone() };
            let b_in = if b_t { transpose(&b, k, n) } else { b.clone() };
            let mut c = vec![1.0; m * n];
            matmul(&mut c, &a_in, &b_in, m, n, k, a_t, b_t, true);
            for (got, want) in c.iter().zip(&naive) {
                assert!((got - want - 1.0).abs() < 1e-4, "{a_t} {b_t}: {got} vs {want}");
            }
        }
    }
}
