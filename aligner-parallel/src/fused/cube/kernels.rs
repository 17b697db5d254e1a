//! The `#[cube]` kernels behind [`super`]: written once in CubeCL, compiled at run time for
//! the device's runtime (SPIR-V / WGSL on wgpu, PTX on CUDA).
//!
//! Buffers are contiguous and row-major. Every float kernel takes its element type at launch
//! (`#[define(F)]`), so one kernel serves f32, f16 and bf16; reductions accumulate in f32.
//! Row kernels give one cube to each row and reduce across the cube through shared memory.

use cubecl::prelude::*;

/// Units per cube in the row kernels (a power of two: the reduction halves it).
pub const ROW_THREADS: u32 = 128;

/// Sum (or maximum) of `value` over the cube's units; every unit gets the result.
#[cube]
pub fn cube_reduce(value: f32, #[comptime] threads: usize, #[comptime] take_max: bool) -> f32 {
    let mut shared = Shared::<[f32]>::new_slice(threads);
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    let mut stride = CUBE_DIM as usize / 2;
    while stride > 0 {
        if unit < stride {
            let mine = shared[unit];
            let other = shared[unit + stride];
            let combined = if take_max { mine.max(other) } else { mine + other };
            shared[unit] = combined;
        }
        sync_cube();
        stride /= 2;
    }
    shared[0]
}

/// The largest of the `width` values from `base` (in f32), every unit of the cube getting it.
#[cube]
pub fn row_max<F: Float>(values: &[F], base: usize, width: usize) -> f32 {
    let mut local = f32::new(-3.0e38);
    for i in range_stepped(UNIT_POS as usize, width, CUBE_DIM as usize) {
        local = local.max(f32::cast_from(values[base + i]));
    }
    cube_reduce(local, ROW_THREADS as usize, true)
}

/// Per row of `logits: [rows, vocab]`: `lse = logsumexp(row)` and `out = row[target] - lse`,
/// both f32 whatever the logits' type.
#[cube(launch)]
pub fn logprob_rows<F: Float>(
    logits: &[F],
    targets: &[i32],
    out: &mut [f32],
    lse: &mut [f32],
    vocab: usize,
    rows: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let threads = CUBE_DIM as usize;
    let base = row * vocab;
    let max_logit = row_max(logits, base, vocab);
    let mut local_sum = f32::new(0.0);
    for i in range_stepped(unit, vocab, threads) {
        local_sum += (f32::cast_from(logits[base + i]) - max_logit).exp();
    }
    let total = cube_reduce(local_sum, ROW_THREADS as usize, false);
    if unit == 0 {
        let row_lse = max_logit + total.ln();
        lse[row] = row_lse;
        // A target outside the vocabulary (−100 for padding) scores 0 and gets no gradient.
        let target = targets[row];
        if target >= 0 && usize::cast_from(target) < vocab {
            out[row] = f32::cast_from(logits[base + usize::cast_from(target)]) - row_lse;
        } else {
            out[row] = f32::new(0.0);
        }
    }
}

/// In place, per element of `logits: [rows, vocab]`: the gradient of `out[row]` scaled by
/// `grad[row]`, `grad · (onehot(target) − softmax)` (0 for a padding target).
#[cube(launch)]
pub fn logprob_grad<F: Float>(
    logits: &mut [F],
    targets: &[i32],
    lse: &[f32],
    grad: &[f32],
    vocab: usize,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= logits.len() {
        terminate!();
    }
    let row = pos / vocab;
    let target = targets[row];
    let mut d = f32::new(0.0);
    if target >= 0 && usize::cast_from(target) < vocab {
        let g = grad[row];
        d = -g * (f32::cast_from(logits[pos]) - lse[row]).exp();
        if pos - row * vocab == usize::cast_from(target) {
            d += g;
        }
    }
    logits[pos] = F::cast_from(d);
}

/// Per row of `x: [rows, width]`: `y = x · gamma / √(mean(x²) + eps)`, and `inv = 1/√(…)`.
#[cube(launch)]
pub fn rms_norm_rows<F: Float>(
    x: &[F],
    gamma: &[F],
    y: &mut [F],
    inv: &mut [f32],
    width: usize,
    rows: usize,
    eps: f32,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let threads = CUBE_DIM as usize;
    let base = row * width;
    let mut local = f32::new(0.0);
    for i in range_stepped(unit, width, threads) {
        let v = f32::cast_from(x[base + i]);
        local += v * v;
    }
    let total = cube_reduce(local, ROW_THREADS as usize, false);
    let r = (total / f32::cast_from(width) + eps).inverse_sqrt();
    for i in range_stepped(unit, width, threads) {
        y[base + i] = F::cast_from(f32::cast_from(x[base + i]) * r * f32::cast_from(gamma[i]));
    }
    if unit == 0 {
        inv[row] = r;
    }
}

/// RMS norm backward per row: `dx = r·γ·dy − x·r³·Σ(γ·dy·x)/width`, and each row's share of
/// the weight gradient, `dy·x·r` (summed over rows by the caller).
#[cube(launch)]
pub fn rms_norm_grad_rows<F: Float>(
    x: &[F],
    gamma: &[F],
    inv: &[f32],
    dy: &[F],
    dx: &mut [F],
    dgamma_rows: &mut [f32],
    width: usize,
    rows: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let threads = CUBE_DIM as usize;
    let base = row * width;
    let r = inv[row];
    let mut local = f32::new(0.0);
    for i in range_stepped(unit, width, threads) {
        local += f32::cast_from(gamma[i]) * f32::cast_from(dy[base + i]) * f32::cast_from(x[base + i]);
    }
    let total = cube_reduce(local, ROW_THREADS as usize, false);
    let c = total * r * r * r / f32::cast_from(width);
    for i in range_stepped(unit, width, threads) {
        let xv = f32::cast_from(x[base + i]);
        let g = f32::cast_from(dy[base + i]);
        dx[base + i] = F::cast_from(r * f32::cast_from(gamma[i]) * g - xv * c);
        dgamma_rows[base + i] = g * xv * r;
    }
}

/// `out = silu(gate) · up`, elementwise.
#[cube(launch)]
pub fn swiglu_forward<F: Float>(gate: &[F], up: &[F], out: &mut [F], #[define(F)] _dtype: ElemType) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let g = f32::cast_from(gate[pos]);
    let sigmoid = 1.0 / (1.0 + (-g).exp());
    out[pos] = F::cast_from(g * sigmoid * f32::cast_from(up[pos]));
}

/// SwiGLU backward: `d_gate = dy·up·σ(g)·(1 + g·(1 − σ(g)))`, `d_up = dy·g·σ(g)`.
#[cube(launch)]
pub fn swiglu_backward<F: Float>(
    gate: &[F],
    up: &[F],
    dy: &[F],
    d_gate: &mut [F],
    d_up: &mut [F],
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= d_gate.len() {
        terminate!();
    }
    let g = f32::cast_from(gate[pos]);
    let u = f32::cast_from(up[pos]);
    let grad = f32::cast_from(dy[pos]);
    let sigmoid = 1.0 / (1.0 + (-g).exp());
    d_gate[pos] = F::cast_from(grad * u * sigmoid * (1.0 + g * (1.0 - sigmoid)));
    d_up[pos] = F::cast_from(grad * g * sigmoid);
}

/// Rotary embedding (rotate-half convention) of `x: [batch, heads, seq, dim]` by the angles'
/// `cos, sin: [angle_batch, 1, seq, dim]` (`angle_batch` 1 or `batch`):
/// `y = x·cos + rotate_half(x)·sin`, `rotate_half(x) = [−x₂, x₁]`. With `transpose` it applies
/// the transposed map, which is the backward: `dx = dy·cos + rotate_halfᵀ(dy·sin)`.
#[cube(launch)]
pub fn rope<F: Float>(
    x: &[F],
    cos: &[F],
    sin: &[F],
    out: &mut [F],
    dim: usize,
    heads: usize,
    seq: usize,
    angle_batch: usize,
    #[comptime] transpose: bool,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let d = pos % dim;
    let s = (pos / dim) % seq;
    let b = pos / (dim * seq * heads);
    let mut angle_row = b;
    if angle_batch == 1 {
        angle_row = 0;
    }
    let a = (angle_row * seq + s) * dim + d;
    let half = dim / 2;
    let value = f32::cast_from(x[pos]) * f32::cast_from(cos[a]);
    if transpose {
        // rotate_halfᵀ(z)_j = z_{j+half} for j < half, −z_{j−half} after.
        if d < half {
            out[pos] = F::cast_from(value + f32::cast_from(x[pos + half]) * f32::cast_from(sin[a + half]));
        } else {
            out[pos] = F::cast_from(value - f32::cast_from(x[pos - half]) * f32::cast_from(sin[a - half]));
        }
    } else if d < half {
        out[pos] = F::cast_from(value - f32::cast_from(x[pos + half]) * f32::cast_from(sin[a]));
    } else {
        out[pos] = F::cast_from(value + f32::cast_from(x[pos - half]) * f32::cast_from(sin[a]));
    }
}
