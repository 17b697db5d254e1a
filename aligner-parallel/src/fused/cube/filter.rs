//! The sampling weights after temperature, top-k and top-p ([`crate::fused::filter`]) as one
//! CubeCL kernel: one cube per row, no sort and no copy of the row.
//!
//! Both filters are thresholds on the logits' order, found by a bitwise search over the
//! logits' bits mapped to order-preserving `u32` keys: from the highest bit down, a bit is
//! kept when the row still satisfies the condition with it set (a count for top-k, a mass
//! for top-p), so 32 reductions over the row give the exact threshold. Equal logits at the
//! top-p threshold are removed in index order, which a second search over indices places.

use cubecl::prelude::*;

use super::kernels::{ROW_THREADS, cube_reduce, row_max};

/// Sum (or maximum) over the cube's units, every unit getting the result; unlike a bare
/// shared-memory reduction it can be called again at once (the loops below do, 32 times).
#[cube]
fn cube_total(value: f32, #[comptime] take_max: bool) -> f32 {
    let total = cube_reduce(value, ROW_THREADS as usize, take_max);
    // Nobody overwrites the result before every unit has read it.
    sync_cube();
    total
}

/// The logit's bits as a `u32` in the same order as the floats (negatives reversed below
/// the positives).
#[cube]
fn order_key(x: f32) -> u32 {
    let bits = u32::reinterpret(x);
    let sign = 1u32 << 31;
    select(bits >= sign, !bits, bits | sign)
}

/// Per row of `logits: [rows, vocab]` with `params: [rows, 3]` (`1/temperature`, `top_k`,
/// `top_p`): `weights = exp((l − max) · inv_t)` for the tokens the filters keep, 0 for the
/// others. `with_top_k` / `with_top_p` say whether any row of the batch uses the filter (the
/// searches are compiled in only then); `index_bits` covers the indices of a row.
///
/// Every barrier is reached by the whole cube whatever a row's settings (rows that do not
/// filter run the searches and ignore the result), as WGSL's uniformity rules require on
/// Metal and DX12.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn sampling_weights<F: Float>(
    logits: &[F],
    params: &[f32],
    weights: &mut [f32],
    vocab: usize,
    rows: usize,
    #[comptime] with_top_k: bool,
    #[comptime] with_top_p: bool,
    #[comptime] index_bits: u32,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let threads = CUBE_DIM as usize;
    let base = row * vocab;
    let inv_t = params[row * 3];
    let top_k = params[row * 3 + 1];
    let top_p = params[row * 3 + 2];

    let max = row_max(logits, base, vocab);

    // Top-k: the largest key that at least k logits reach is the k-th largest logit's.
    let mut kth = 0u32;
    if with_top_k {
        let mut found = 0u32;
        for bit in 0..32u32 {
            let candidate = found | (1u32 << (31 - bit));
            let mut count = f32::new(0.0);
            for i in range_stepped(unit, vocab, threads) {
                if order_key(f32::cast_from(logits[base + i])) >= candidate {
                    count += 1.0;
                }
            }
            if cube_total(count, false) >= top_k {
                found = candidate;
            }
        }
        if top_k >= 1.0 && top_k < f32::cast_from(vocab) {
            kth = found;
        }
    }

    let mut local_sum = f32::new(0.0);
    for i in range_stepped(unit, vocab, threads) {
        let l = f32::cast_from(logits[base + i]);
        let mut w = f32::new(0.0);
        if order_key(l) >= kth {
            w = ((l - max) * inv_t).exp();
        }
        weights[base + i] = w;
        local_sum += w;
    }
    let total = cube_total(local_sum, false);

    if with_top_p {
        let cut = (1.0 - top_p) * total;
        // The largest key below which the mass is at most the cut: every token under it goes.
        let mut threshold = 0u32;
        for bit in 0..32u32 {
            let candidate = threshold | (1u32 << (31 - bit));
            let mut mass = f32::new(0.0);
            for i in range_stepped(unit, vocab, threads) {
                if order_key(f32::cast_from(logits[base + i])) < candidate {
                    mass += weights[base + i];
                }
            }
            if cube_total(mass, false) <= cut {
                threshold = candidate;
            }
        }
        // The tokens at the threshold share one weight; the first of them in index order go
        // while the mass removed stays within the cut, and at least one stays.
        let mut local_below = f32::new(0.0);
        let mut local_ties = f32::new(0.0);
        let mut local_tie_weight = f32::new(0.0);
        for i in range_stepped(unit, vocab, threads) {
            let key = order_key(f32::cast_from(logits[base + i]));
            if key < threshold {
                local_below += weights[base + i];
            } else if key == threshold {
                local_ties += 1.0;
                local_tie_weight = local_tie_weight.max(weights[base + i]);
            }
        }
        let below = cube_total(local_below, false);
        let ties = cube_total(local_ties, false);
        let tie_weight = cube_total(local_tie_weight, true);
        let mut removed_ties = f32::new(0.0);
        if tie_weight > 0.0 {
            removed_ties = ((cut - below) / tie_weight)
                .floor()
                .max(0.0)
                .min((ties - 1.0).max(0.0));
        }
        // The index of the first tie that stays: the largest bound with at most
        // `removed_ties` ties before it (the first tie itself when none goes).
        let mut first_kept = 0u32;
        for bit in 0..index_bits {
            let candidate = first_kept | (1u32 << (index_bits - 1 - bit));
            let mut before = f32::new(0.0);
            for i in range_stepped(unit, vocab, threads) {
                if i < usize::cast_from(candidate) && order_key(f32::cast_from(logits[base + i])) == threshold
                {
                    before += 1.0;
                }
            }
            if cube_total(before, false) <= removed_ties {
                first_kept = candidate;
            }
        }
        if top_p < 1.0 {
            for i in range_stepped(unit, vocab, threads) {
                let key = order_key(f32::cast_from(logits[base + i]));
                if key < threshold || (key == threshold && i < usize::cast_from(first_kept)) {
                    weights[base + i] = f32::new(0.0);
                }
            }
        }
    }
}
