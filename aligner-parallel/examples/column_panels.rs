//! The output projection of a 16M-parameter Llama (`[64, 256] · [256, 50257]`, a batch-64
//! decode step's logits) as one row-major product and as column panels of several widths.
//!
//! `cargo run --release -p aligner-parallel --example column_panels`

use std::time::Instant;

use aligner_parallel::fused::host::matmul;
use aligner_parallel::fused::panels::ColumnPanels;

const ROUNDS: usize = 20;

fn filled(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104_729) % 1999) as f32 / 999.5 - 1.0)
        .collect()
}

/// Mean seconds of `f` over [`ROUNDS`] runs after one warm-up run.
fn timed(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    for _ in 0..ROUNDS {
        f();
    }
    start.elapsed().as_secs_f64() / ROUNDS as f64
}

fn main() {
    let (m, k, n) = (64, 256, 50_257);
    let a = filled(m * k, 1);
    let w = filled(k * n, 2);
    let flop = 2.0 * (m * k * n) as f64;
    let mut want = vec![0.0; m * n];
    let mut got = vec![0.0; m * n];
    println!("| layout | ms | GFLOP/s | max difference |");
    println!("|---|---:|---:|---:|");
    let seconds = timed(|| matmul(&mut want, &a, &w, m, n, k, false, false, false));
    println!(
        "| row-major [k, n] | {:.2} | {:.0} | 0 |",
        seconds * 1e3,
        flop / seconds / 1e9
    );
    for width in [512, 1024, 2048, 4096] {
        let panels = ColumnPanels::from_row_major(&w, k, n, width);
        let seconds = timed(|| panels.left_product(&mut got, &a, m));
        let diff = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        println!(
            "| panels of {width} | {:.2} | {:.0} | {diff:e} |",
            seconds * 1e3,
            flop / seconds / 1e9
        );
    }
}
