//! Causal grouped-query attention as flash-attention-style CubeCL kernels: each cube takes
//! [`UNITS`] query rows of one (batch, head), walks the keys in tiles (32 keys; [`tile_rows`]) staged in
//! shared memory, and keeps a running maximum, normaliser and weighted sum per row (online
//! softmax), so neither the `[queries, keys]` scores nor the KV heads repeated per query head
//! ever exist. The forward keeps each row's logsumexp (f32); the backward recomputes the
//! probabilities from it in two kernels without atomics: one per query row for `dq` (and
//! `Δ = rowsum(dO ∘ O)`), one per key row for `dk` and `dv`, summing over the query heads that
//! share the KV head. Everything accumulates in f32 whatever the tensors' type.
//!
//! Keys are aligned to the end (query `i` of `s` sees keys `..= i + keys − s`), as for a
//! prompt or a decode step after a KV cache; a mask `[batch, s, keys]` (1 = hidden) replaces
//! that rule where rows are left-padded or packed.

// Kernel code: `usize::div_ceil` has no CubeCL expansion, so blocks are counted by hand.
#![allow(clippy::manual_div_ceil)]

use cubecl::prelude::*;

/// Query (or key) rows per cube, one unit each.
pub const UNITS: usize = 64;

/// Keys (or queries) staged in shared memory at a time for heads of width `dim`: 32, fewer
/// for wide heads, so that a kernel's staged tiles (two of `dim` floats per row, plus two
/// floats per row in the backward) stay within 32 KiB, the least a Vulkan or Metal device
/// offers per cube (lavapipe's limit; CUDA's default is 48 KiB).
pub fn tile_rows(dim: usize) -> usize {
    (8000 / (2 * dim + 2)).clamp(1, 32)
}

/// Whether key `kk` is visible to query `qi` of batch row `batch`.
#[cube]
fn visible(
    hidden: &[f32],
    batch: usize,
    qi: usize,
    kk: usize,
    queries: usize,
    keys: usize,
    #[comptime] masked: bool,
) -> bool {
    let mut seen = kk + queries <= qi + keys;
    if masked {
        seen = hidden[(batch * queries + qi) * keys + kk] == 0.0;
    }
    seen
}

/// How many keys (from the first) the cube of query rows `first..first + UNITS` reads:
/// causal rows see no key past their last row's; masked rows may see any.
#[cube]
fn keys_seen(first: usize, queries: usize, keys: usize, #[comptime] masked: bool) -> usize {
    let mut end = keys;
    if !masked {
        let mut last = first + UNITS;
        if last > queries {
            last = queries;
        }
        end = last + keys - queries;
    }
    end
}

/// `out = softmax(q·kᵀ·scale)·v` per query row, and the row's logsumexp (0 for a row that
/// sees no key, whose output is 0). `q, out: [b, heads, queries, dim]`,
/// `k, v: [b, kv_heads, keys, dim]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<F: Float>(
    q: &[F],
    k: &[F],
    v: &[F],
    hidden: &[f32],
    out: &mut [F],
    lse: &mut [f32],
    heads: usize,
    kv_heads: usize,
    queries: usize,
    keys: usize,
    cubes: usize,
    scale: f32,
    #[comptime] dim: usize,
    #[comptime] tile: usize,
    #[comptime] tile_len: usize,
    #[comptime] masked: bool,
    #[define(F)] _dtype: ElemType,
) {
    if CUBE_POS >= cubes {
        terminate!();
    }
    let blocks = (queries + UNITS - 1) / UNITS;
    let bh = CUBE_POS / blocks;
    let first = (CUBE_POS % blocks) * UNITS;
    let batch = bh / heads;
    let group = (bh % heads) / (heads / kv_heads);
    let unit = UNIT_POS as usize;
    let qi = first + unit;
    let valid = qi < queries;
    let q_base = (bh * queries + qi) * dim;
    let kv_base = (batch * kv_heads + group) * keys * dim;

    let mut q_row = Array::<f32>::new(dim);
    let mut acc = Array::<f32>::new(dim);
    for d in 0..dim {
        let mut x = f32::new(0.0);
        if valid {
            x = f32::cast_from(q[q_base + d]) * scale;
        }
        q_row[d] = x;
        acc[d] = f32::new(0.0);
    }
    let mut k_tile = Shared::<[f32]>::new_slice(tile_len);
    let mut v_tile = Shared::<[f32]>::new_slice(tile_len);
    let mut max = f32::new(-3.0e38);
    let mut norm = f32::new(0.0);
    let key_end = keys_seen(first, queries, keys, masked);
    let mut start = 0usize;
    while start < key_end {
        let mut n = key_end - start;
        if n > tile {
            n = tile;
        }
        for i in range_stepped(unit, n * dim, UNITS) {
            k_tile[i] = f32::cast_from(k[kv_base + start * dim + i]);
            v_tile[i] = f32::cast_from(v[kv_base + start * dim + i]);
        }
        sync_cube();
        if valid {
            for j in 0..n {
                if visible(hidden, batch, qi, start + j, queries, keys, masked) {
                    let mut s = f32::new(0.0);
                    for d in 0..dim {
                        s += q_row[d] * k_tile[j * dim + d];
                    }
                    let new_max = max.max(s);
                    let correction = (max - new_max).exp();
                    let p = (s - new_max).exp();
                    norm = norm * correction + p;
                    for d in 0..dim {
                        acc[d] = acc[d] * correction + p * v_tile[j * dim + d];
                    }
                    max = new_max;
                }
            }
        }
        sync_cube();
        start += tile;
    }
    if valid {
        let mut inv = f32::new(0.0);
        let mut row_lse = f32::new(0.0);
        if norm > 0.0 {
            inv = 1.0 / norm;
            row_lse = max + norm.ln();
        }
        for d in 0..dim {
            out[q_base + d] = F::cast_from(acc[d] * inv);
        }
        lse[bh * queries + qi] = row_lse;
    }
}

/// Backward, per query row: `Δ = rowsum(dO ∘ O)` (kept for [`attention_backward_kv`]) and
/// `dq = scale · Σ_j p_ij (dO_i·v_j − Δ_i) k_j`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_q<F: Float>(
    q: &[F],
    k: &[F],
    v: &[F],
    hidden: &[f32],
    out: &[F],
    d_out: &[F],
    lse: &[f32],
    dq: &mut [F],
    delta: &mut [f32],
    heads: usize,
    kv_heads: usize,
    queries: usize,
    keys: usize,
    cubes: usize,
    scale: f32,
    #[comptime] dim: usize,
    #[comptime] tile: usize,
    #[comptime] tile_len: usize,
    #[comptime] masked: bool,
    #[define(F)] _dtype: ElemType,
) {
    if CUBE_POS >= cubes {
        terminate!();
    }
    let blocks = (queries + UNITS - 1) / UNITS;
    let bh = CUBE_POS / blocks;
    let first = (CUBE_POS % blocks) * UNITS;
    let batch = bh / heads;
    let group = (bh % heads) / (heads / kv_heads);
    let unit = UNIT_POS as usize;
    let qi = first + unit;
    let valid = qi < queries;
    let row = bh * queries + qi;
    let q_base = row * dim;
    let kv_base = (batch * kv_heads + group) * keys * dim;

    let mut q_row = Array::<f32>::new(dim);
    let mut do_row = Array::<f32>::new(dim);
    let mut acc = Array::<f32>::new(dim);
    let mut row_delta = f32::new(0.0);
    let mut row_lse = f32::new(0.0);
    for d in 0..dim {
        let mut x = f32::new(0.0);
        let mut g = f32::new(0.0);
        if valid {
            x = f32::cast_from(q[q_base + d]) * scale;
            g = f32::cast_from(d_out[q_base + d]);
            row_delta += g * f32::cast_from(out[q_base + d]);
        }
        q_row[d] = x;
        do_row[d] = g;
        acc[d] = f32::new(0.0);
    }
    if valid {
        delta[row] = row_delta;
        row_lse = lse[row];
    }
    let mut k_tile = Shared::<[f32]>::new_slice(tile_len);
    let mut v_tile = Shared::<[f32]>::new_slice(tile_len);
    let key_end = keys_seen(first, queries, keys, masked);
    let mut start = 0usize;
    while start < key_end {
        let mut n = key_end - start;
        if n > tile {
            n = tile;
        }
        for i in range_stepped(unit, n * dim, UNITS) {
            k_tile[i] = f32::cast_from(k[kv_base + start * dim + i]);
            v_tile[i] = f32::cast_from(v[kv_base + start * dim + i]);
        }
        sync_cube();
        if valid {
            for j in 0..n {
                if visible(hidden, batch, qi, start + j, queries, keys, masked) {
                    let mut s = f32::new(0.0);
                    let mut dp = f32::new(0.0);
                    for d in 0..dim {
                        s += q_row[d] * k_tile[j * dim + d];
                        dp += do_row[d] * v_tile[j * dim + d];
                    }
                    let ds = (s - row_lse).exp() * (dp - row_delta);
                    for d in 0..dim {
                        acc[d] += ds * k_tile[j * dim + d];
                    }
                }
            }
        }
        sync_cube();
        start += tile;
    }
    if valid {
        for d in 0..dim {
            dq[q_base + d] = F::cast_from(acc[d] * scale);
        }
    }
}

/// Backward, per key row of a KV head, over every query row of the query heads sharing it:
/// `dv_j = Σ_i p_ij dO_i` and `dk_j = scale · Σ_i p_ij (dO_i·v_j − Δ_i) q_i`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_kv<F: Float>(
    q: &[F],
    k: &[F],
    v: &[F],
    hidden: &[f32],
    d_out: &[F],
    lse: &[f32],
    delta: &[f32],
    dk: &mut [F],
    dv: &mut [F],
    heads: usize,
    kv_heads: usize,
    queries: usize,
    keys: usize,
    cubes: usize,
    scale: f32,
    #[comptime] dim: usize,
    #[comptime] tile: usize,
    #[comptime] tile_len: usize,
    #[comptime] masked: bool,
    #[define(F)] _dtype: ElemType,
) {
    if CUBE_POS >= cubes {
        terminate!();
    }
    let blocks = (keys + UNITS - 1) / UNITS;
    let bg = CUBE_POS / blocks;
    let first = (CUBE_POS % blocks) * UNITS;
    let batch = bg / kv_heads;
    let group = bg % kv_heads;
    let groups = heads / kv_heads;
    let unit = UNIT_POS as usize;
    let kk = first + unit;
    let valid = kk < keys;
    let k_base = (bg * keys + kk) * dim;

    let mut k_row = Array::<f32>::new(dim);
    let mut v_row = Array::<f32>::new(dim);
    let mut dk_acc = Array::<f32>::new(dim);
    let mut dv_acc = Array::<f32>::new(dim);
    for d in 0..dim {
        let mut x = f32::new(0.0);
        let mut y = f32::new(0.0);
        if valid {
            x = f32::cast_from(k[k_base + d]) * scale;
            y = f32::cast_from(v[k_base + d]);
        }
        k_row[d] = x;
        v_row[d] = y;
        dk_acc[d] = f32::new(0.0);
        dv_acc[d] = f32::new(0.0);
    }
    let mut q_tile = Shared::<[f32]>::new_slice(tile_len);
    let mut do_tile = Shared::<[f32]>::new_slice(tile_len);
    let mut lse_tile = Shared::<[f32]>::new_slice(tile);
    let mut delta_tile = Shared::<[f32]>::new_slice(tile);
    // Causal: no query before the one that first sees this cube's first key.
    let mut query_start = 0usize;
    if !masked && first + queries > keys {
        query_start = first + queries - keys;
    }
    for h in 0..groups {
        let bh = batch * heads + group * groups + h;
        let mut start = query_start;
        while start < queries {
            let mut n = queries - start;
            if n > tile {
                n = tile;
            }
            let base = (bh * queries + start) * dim;
            for i in range_stepped(unit, n * dim, UNITS) {
                q_tile[i] = f32::cast_from(q[base + i]);
                do_tile[i] = f32::cast_from(d_out[base + i]);
            }
            for i in range_stepped(unit, n, UNITS) {
                lse_tile[i] = lse[bh * queries + start + i];
                delta_tile[i] = delta[bh * queries + start + i];
            }
            sync_cube();
            if valid {
                for i in 0..n {
                    if visible(hidden, batch, start + i, kk, queries, keys, masked) {
                        let mut s = f32::new(0.0);
                        let mut dp = f32::new(0.0);
                        for d in 0..dim {
                            s += q_tile[i * dim + d] * k_row[d];
                            dp += do_tile[i * dim + d] * v_row[d];
                        }
                        let p = (s - lse_tile[i]).exp();
                        let ds = p * (dp - delta_tile[i]);
                        for d in 0..dim {
                            dv_acc[d] += p * do_tile[i * dim + d];
                            dk_acc[d] += ds * q_tile[i * dim + d];
                        }
                    }
                }
            }
            sync_cube();
            start += tile;
        }
    }
    if valid {
        for d in 0..dim {
            dk[k_base + d] = F::cast_from(dk_acc[d] * scale);
            dv[k_base + d] = F::cast_from(dv_acc[d]);
        }
    }
}
