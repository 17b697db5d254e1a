//! One decode step's attention for 64 sequences at lengths 8..136 (the engine benchmark's
//! shapes) on the two benchmark models' head layouts.
//!
//! `cargo run --release -p aligner-parallel --example cached_attention`

use std::time::Instant;

use aligner_parallel::fused::infer::{CacheLayout, Scoring, cached_attention};

fn filled(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104_729) % 1999) as f32 / 999.5 - 1.0)
        .collect()
}

fn main() {
    println!("| model | heads / kv heads × dim | µs per step (64 rows) |");
    println!("|---|---|---:|");
    for (name, heads, kv_heads, dim) in [("stories260K", 8, 4, 8), ("random-16M", 4, 2, 64)] {
        let (rows, capacity) = (64, 144);
        let layout = CacheLayout {
            kv_heads,
            capacity,
            dim,
        };
        let size = rows * kv_heads * dim * capacity;
        let (keys, values) = (filled(size, 1), filled(size, 2));
        let q = filled(rows * heads * dim, 3);
        let mut out = vec![0.0; rows * heads * dim];
        let mut total = 0.0;
        let mut steps = 0;
        for round in 0..20 {
            for len in 8..136 {
                // Ragged: row r sits a few positions behind the others.
                let at: Vec<(usize, usize)> = (0..rows).map(|r| (r, (len - r % 8).max(1))).collect();
                let start = Instant::now();
                cached_attention(
                    &mut out,
                    &q,
                    heads * dim,
                    0,
                    &keys,
                    &values,
                    &at,
                    heads,
                    layout,
                    Scoring::plain(dim),
                );
                if round > 0 {
                    total += start.elapsed().as_secs_f64();
                    steps += 1;
                }
            }
        }
        println!(
            "| {name} | {heads} / {kv_heads} × {dim} | {:.1} |",
            total / steps as f64 * 1e6
        );
    }
}
