//! The tensor-parallel ops on two and three ranks, each a thread of this process joined by an
//! in-process group, against the ops they stand for in one piece: values, and gradients of a
//! random weighting of the outputs with respect to every input (each rank's block of a split
//! weight's gradient is the block of the whole gradient; a whole input's gradient is whole on
//! every rank).

use std::ops::Range;

use aligner_parallel::comm::Threads;
use aligner_parallel::tensor::{Group, TensorSplit, tp_copy, tp_gather, tp_reduce, vocab_parallel_logprobs};
use aligner_parallel::{shard_range, token_logprobs_from_hidden};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};

/// `n` values in [-1, 1) from a linear congruential stream seeded by `seed`.
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn leaf<const D: usize>(values: &[f32], dims: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::<D>::from_data(TensorData::new(values.to_vec(), dims), device).require_grad()
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(diff < 1e-5, "{what}: {diff}");
}

/// The columns `cols` of a row-major `[rows, n]` matrix.
fn columns(values: &[f32], n: usize, cols: Range<usize>) -> Vec<f32> {
    values
        .chunks_exact(n)
        .flat_map(|row| row[cols.clone()].to_vec())
        .collect()
}

/// The token log-probabilities over a vocabulary split 4 + 3 (and 3 + 2 + 2), soft-capped or
/// not: the log-probs, the hidden states' whole gradient and each block of the projection's.
#[test]
fn vocab_parallel_logprobs_match_the_whole_vocabulary() {
    let (b, s, d, vocab) = (2, 3, 4, 7);
    let hidden = random(b * s * d, 1);
    let weight = random(d * vocab, 2);
    let weighting = random(b * s, 3);
    let targets: Vec<i64> = vec![0, 6, 3, 4, 2, 5];
    for softcap in [None, Some(0.7)] {
        let device = Device::flex().autodiff();
        let (h, w) = (
            leaf(&hidden, [b, s, d], &device),
            leaf(&weight, [d, vocab], &device),
        );
        let t = Tensor::<2, Int>::from_data(TensorData::new(targets.clone(), [b, s]), &device);
        let mix = Tensor::<2>::from_data(TensorData::new(weighting.clone(), [b, s]), &device);
        let want = token_logprobs_from_hidden(h.clone(), w.clone(), t, 2, softcap);
        let grads = (want.clone() * mix).sum().backward();
        let want = values(want);
        let (want_dh, want_dw) = (values(h.grad(&grads).unwrap()), values(w.grad(&grads).unwrap()));
        for size in [2, 3] {
            Threads::run(size, |rank, comm| {
                let device = Device::flex().autodiff();
                let own = shard_range(vocab, rank, size);
                let h = leaf(&hidden, [b, s, d], &device);
                let w = leaf(&columns(&weight, vocab, own.clone()), [d, own.len()], &device);
                let t = Tensor::<2, Int>::from_data(TensorData::new(targets.clone(), [b, s]), &device);
                let mix = Tensor::<2>::from_data(TensorData::new(weighting.clone(), [b, s]), &device);
                let group = Group(comm);
                let got = vocab_parallel_logprobs(h.clone(), w.clone(), t, own.clone(), 2, softcap, &group);
                let grads = (got.clone() * mix).sum().backward();
                assert_close(&values(got), &want, "log-probs");
                assert_close(&values(h.grad(&grads).unwrap()), &want_dh, "hidden's gradient");
                let dw = values(w.grad(&grads).unwrap());
                assert_close(&dw, &columns(&want_dw, vocab, own), "the block's gradient");
            });
        }
    }
}

/// A column-parallel layer, ReLU, and a row-parallel layer (Megatron's MLP): `f` before the
/// first, `g` after the second. The output, the input's whole gradient, and each weight's
/// block of the gradient.
#[test]
fn a_column_then_row_parallel_pair_matches_the_whole_layers() {
    let (n, d, f) = (5, 4, 7);
    let x = random(n * d, 4);
    let w1 = random(d * f, 5);
    let w2 = random(f * d, 6);
    let weighting = random(n * d, 7);
    let device = Device::flex().autodiff();
    let (xt, a, b) = (
        leaf(&x, [n, d], &device),
        leaf(&w1, [d, f], &device),
        leaf(&w2, [f, d], &device),
    );
    let mix = Tensor::<2>::from_data(TensorData::new(weighting.clone(), [n, d]), &device);
    let want = relu(xt.clone().matmul(a.clone())).matmul(b.clone());
    let grads = (want.clone() * mix).sum().backward();
    let want = values(want);
    let (want_dx, want_da, want_db) = (
        values(xt.grad(&grads).unwrap()),
        values(a.grad(&grads).unwrap()),
        values(b.grad(&grads).unwrap()),
    );
    for size in [2, 3] {
        Threads::run(size, |rank, comm| {
            let device = Device::flex().autodiff();
            let own = shard_range(f, rank, size);
            let xt = leaf(&x, [n, d], &device);
            let a = leaf(&columns(&w1, f, own.clone()), [d, own.len()], &device);
            let rows = w2[own.start * d..own.end * d].to_vec();
            let b = leaf(&rows, [own.len(), d], &device);
            let mix = Tensor::<2>::from_data(TensorData::new(weighting.clone(), [n, d]), &device);
            let group = Group(comm);
            let hidden = relu(tp_copy(xt.clone(), &group).matmul(a.clone()));
            let got = tp_reduce(hidden.matmul(b.clone()), &group);
            let grads = (got.clone() * mix).sum().backward();
            assert_close(&values(got), &want, "output");
            assert_close(&values(xt.grad(&grads).unwrap()), &want_dx, "input's gradient");
            assert_close(
                &values(a.grad(&grads).unwrap()),
                &columns(&want_da, f, own.clone()),
                "column block's gradient",
            );
            assert_close(
                &values(b.grad(&grads).unwrap()),
                &want_db[own.start * d..own.end * d],
                "row block's gradient",
            );
        });
    }
}

/// A split weight gathered whole (the fallback for uses that do not split): the whole value,
/// and each rank's block of its gradient.
#[test]
fn a_gathered_block_is_the_whole_weight_and_keeps_its_block_of_the_gradient() {
    let (rows, cols) = (3, 5);
    let w = random(rows * cols, 8);
    let weighting = random(rows * cols, 9);
    let want_grad: Vec<f32> = weighting.iter().zip(&w).map(|(m, v)| m * 2.0 * v).collect();
    Threads::run(2, |rank, comm| {
        let device = Device::flex().autodiff();
        let split = TensorSplit {
            dims: vec![rows, cols],
            axis: 1,
            group: Group(comm),
        };
        let own = split.own_range();
        assert_eq!(own, shard_range(cols, rank, 2));
        let block = leaf(&columns(&w, cols, own.clone()), [rows, own.len()], &device);
        let whole = tp_gather(block.clone(), split);
        let mix = Tensor::<2>::from_data(TensorData::new(weighting.clone(), [rows, cols]), &device);
        let grads = (whole.clone().powi_scalar(2) * mix).sum().backward();
        assert_close(&values(whole), &w, "whole weight");
        assert_close(
            &values(block.grad(&grads).unwrap()),
            &columns(&want_grad, cols, own),
            "block's gradient",
        );
    });
}
