//! The inference kernels (aligner-gen's host path) against the same maths composed from Burn
//! ops, each on its own: RMS norm, SwiGLU, GeGLU, rotate-half RoPE, the row reductions of sampling,
//! and ragged grouped-query attention over a KV cache.

use aligner_parallel::fused::infer::{
    CacheLayout, LANES, Scoring, cached_attention, geglu_into, log_sum_exp, rms_norm_into, rope_rows,
    row_max, scaled_exp_sum, swiglu_into,
};
use burn::tensor::activation::{gelu_approximate, silu, softmax};
use burn::tensor::{Device, Tensor, TensorData};

/// Deterministic values in [-2, 2).
fn filled(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn tensor<const D: usize>(values: &[f32], shape: [usize; D]) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values.to_vec(), shape), &Device::flex())
}

fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().expect("f32 tensor")
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
        .fold(0.0f32, |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) });
    assert!(worst < tol, "{what}: max difference {worst} (tolerance {tol})");
}

#[test]
fn rms_norm_rows_match_composed_ops() {
    let (rows, d, eps) = (37, 48, 1e-5);
    let x = filled(rows * d, 1);
    let w = filled(d, 2);
    let mut got = vec![0.0; x.len()];
    rms_norm_into(&mut got, &x, &w, eps);
    let xt = tensor(&x, [rows, d]);
    let rms = (xt.clone().powi_scalar(2).mean_dim(1) + eps).sqrt();
    let want = xt / rms * tensor(&w, [1, d]);
    assert_close(&got, &host(want), 1e-5, "rms norm");
}

#[test]
fn swiglu_rows_match_composed_ops() {
    let (rows, ff) = (29, 40);
    let gate_up = filled(rows * 2 * ff, 3);
    let mut got = vec![0.0; rows * ff];
    swiglu_into(&mut got, &gate_up, ff);
    let both = tensor(&gate_up, [rows, 2 * ff]);
    let want = silu(both.clone().slice([0..rows, 0..ff])) * both.slice([0..rows, ff..2 * ff]);
    assert_close(&got, &host(want), 1e-5, "swiglu");
}

#[test]
fn geglu_rows_match_composed_ops() {
    let (rows, ff) = (29, 40);
    let gate_up = filled(rows * 2 * ff, 4);
    let mut got = vec![0.0; rows * ff];
    geglu_into(&mut got, &gate_up, ff);
    let both = tensor(&gate_up, [rows, 2 * ff]);
    let want = gelu_approximate(both.clone().slice([0..rows, 0..ff])) * both.slice([0..rows, ff..2 * ff]);
    assert_close(&got, &host(want), 1e-5, "geglu");
}

#[test]
fn rope_rotates_half_like_composed_ops() {
    // Rows of [other (5) | 3 heads of 8]: only the heads turn; all of each head, or (Phi-3's
    // partial rotary factor) its first 4 dimensions.
    for rotary in [8, 4] {
        check_rope(rotary);
    }
}

fn check_rope(rotary: usize) {
    let (rows, heads, dim, offset, stride) = (6, 3, 8, 5, 5 + 3 * 8);
    let half = rotary / 2;
    let x = filled(rows * stride, 4);
    let angles: Vec<f32> = (0..rows * half).map(|i| i as f32 * 0.37).collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let mut got = x.clone();
    rope_rows(&mut got, stride, offset, heads, dim, &cos, &sin);

    let all = tensor(&x, [rows, stride]);
    let h = all
        .clone()
        .slice([0..rows, offset..stride])
        .reshape([rows, heads, dim]);
    let (a, b) = (
        h.clone().slice([0..rows, 0..heads, 0..half]),
        h.clone().slice([0..rows, 0..heads, half..rotary]),
    );
    let rotated = Tensor::cat(vec![b.neg(), a], 2);
    let full = |t: &[f32]| {
        let t = tensor(t, [rows, 1, half]);
        Tensor::cat(vec![t.clone(), t], 2)
    };
    let turned = h.clone().slice([0..rows, 0..heads, 0..rotary]) * full(&cos) + rotated * full(&sin);
    let turned = Tensor::cat(vec![turned, h.slice([0..rows, 0..heads, rotary..dim])], 2);
    let want = Tensor::cat(
        vec![
            all.slice([0..rows, 0..offset]),
            turned.reshape([rows, heads * dim]),
        ],
        1,
    );
    assert_close(&got, &host(want), 1e-5, &format!("rope over {rotary} of {dim}"));
}

#[test]
fn row_reductions_match_composed_ops() {
    for n in [1, 15, 16, 17, 50_257] {
        let x = filled(n, 5 + n as u64);
        let t = tensor(&x, [n]);
        let max = row_max(&x);
        assert_eq!(max, host(t.clone().max())[0], "max of {n}");
        let lse = host((t.clone() - max).exp().sum().log() + max)[0];
        assert_close(&[log_sum_exp(&x)], &[lse], 1e-5, "log-sum-exp");
        let inv_t = 1.0 / 0.7;
        let sum = host(((t - max) * inv_t).exp().sum())[0];
        assert_close(&[scaled_exp_sum(&x, max, inv_t)], &[sum], 1e-5, "scaled exp sum");
    }
    assert_eq!(row_max(&[]), f32::NEG_INFINITY);
    assert_eq!(log_sum_exp(&[]), f32::NEG_INFINITY);
}

/// Cached attention of ragged token rows — one prompt's tokens at several positions, decode
/// tokens of other cache rows at their own lengths — against softmax(q·Kᵀ·scale)·V composed
/// from Burn ops over each token's own positions. Everything past a row's length is poisoned
/// with NaN and infinities (what a diverged earlier occupant could leave): it must not leak.
/// Head widths with an unrolled path (8, 64) and without (12); capacities of whole vectors
/// and not; rows short of four vectors of positions and one past them (70); no window, and
/// sliding windows of 1, 7 and 40 positions (each token then sees only its last ones); the
/// plain score scale and another one with a soft-cap (Gemma 2's).
#[test]
fn cached_attention_matches_composed_ops_and_ignores_stale_positions() {
    for window in [None, Some(1), Some(7), Some(40)] {
        for (heads, kv_heads, dim, capacity) in [(4, 2, 8, 5 * LANES), (2, 1, 12, 5 * LANES), (2, 2, 64, 75)]
        {
            let plain = Scoring {
                window,
                ..Scoring::plain(dim)
            };
            check_cached_attention(heads, kv_heads, dim, capacity, plain);
            let capped = Scoring {
                scale: 0.7,
                window,
                softcap: Some(1.5),
            };
            check_cached_attention(heads, kv_heads, dim, capacity, capped);
        }
    }
}

fn check_cached_attention(heads: usize, kv_heads: usize, dim: usize, capacity: usize, scoring: Scoring) {
    let window = scoring.window;
    let cache_rows = 5;
    let layout = CacheLayout {
        kv_heads,
        capacity,
        dim,
    };
    let size = cache_rows * kv_heads * dim * capacity;
    let mut keys = filled(size, 6);
    let mut values = filled(size, 7);
    // (cache row, position) of each token: a prefill of row 2 (positions 0..5), decodes of
    // rows 0, 3, 1 and 4 at lengths that end inside and on a vector boundary.
    let rows: Vec<(usize, usize)> = (0..5)
        .map(|p| (2, p))
        .chain([(0, 20), (3, 15), (1, 31), (4, 70)])
        .collect();
    let written = |row: usize| {
        rows.iter()
            .filter(|r| r.0 == row)
            .map(|r| r.1 + 1)
            .max()
            .unwrap_or(0)
    };
    for row in 0..cache_rows {
        for h in 0..kv_heads {
            for pos in written(row)..capacity {
                let (a, b) = if pos % 2 == 0 {
                    (f32::NAN, f32::INFINITY)
                } else {
                    (f32::INFINITY, f32::NAN)
                };
                layout.write_key(&mut keys, row, h, pos, &vec![a; dim]);
                layout.write_value(&mut values, row, h, pos, &vec![b; dim]);
            }
        }
    }
    let (extra, stride) = (3, 3 + heads * dim);
    let q = filled(rows.len() * stride, 8);
    let mut got = vec![0.0; rows.len() * heads * dim];
    cached_attention(
        &mut got, &q, stride, extra, &keys, &values, &rows, heads, layout, scoring,
    );

    let mut want = Vec::new();
    for (t, &(row, pos)) in rows.iter().enumerate() {
        for h in 0..heads {
            let base = layout.head(row, h / (heads / kv_heads));
            // The positions this token sees, `first..=pos`: keys [dim, n], values [n, dim].
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let n = pos + 1 - first;
            let lanes: Vec<f32> = (0..dim)
                .flat_map(|d| keys[base + d * capacity + first..][..n].to_vec())
                .collect();
            let k = tensor(&lanes, [dim, n]);
            let v = tensor(&values[base + first * dim..][..n * dim], [n, dim]);
            let qh = tensor(&q[t * stride + extra + h * dim..][..dim], [1, dim]);
            let scores = qh.matmul(k) * scoring.scale;
            let scores = match scoring.softcap {
                Some(cap) => scores.div_scalar(cap).tanh().mul_scalar(cap),
                None => scores,
            };
            let probs = softmax(scores, 1);
            want.extend(host(probs.matmul(v)));
        }
    }
    assert!(
        got.iter().all(|v| v.is_finite()),
        "dim {dim}: stale positions leaked into the output"
    );
    assert_close(
        &got,
        &want,
        1e-5,
        &format!("cached attention, dim {dim}, capacity {capacity}, {scoring:?}"),
    );
}
