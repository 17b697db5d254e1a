//! Distributions over a vocabulary that is held whole, or split over a tensor group: each rank
//! of the group holds the logits of its block of the vocabulary only ([`Vocabulary::Split`]).
//!
//! The ops read as their one-piece counterparts. A split log-softmax subtracts the group's
//! log-sum-exp, and a sum over the vocabulary sums the block, then the group's blocks. In the
//! split case, a loss built from them has the gradient it has over the whole vocabulary: the
//! log-sum-exp is summed over the group ([`tp_reduce`], Megatron's `g`), then it enters each
//! rank's block through [`tp_copy`] (`f`). So the gradient each rank's block puts on it is
//! summed over the group before it reaches the logits.

use std::ops::Range;

use burn::tensor::{Int, Tensor, TensorData};

use crate::comm::ReduceOp;
use crate::tensor::{Group, tp_copy, tp_reduce};

/// Where a distribution's logits (the last axis) live.
#[derive(Clone, Debug, Default)]
pub enum Vocabulary {
    /// Every token's logit, in this process.
    #[default]
    Whole,
    /// This rank's block `block` of the vocabulary's indices; the other blocks are on the
    /// other ranks of `group`, which run the same ops together.
    Split { group: Group, block: Range<usize> },
}

impl Vocabulary {
    /// The log-softmax over the whole vocabulary of `logits` (the last axis): all of it, or
    /// this rank's block of it.
    pub fn log_softmax<const D: usize>(&self, logits: Tensor<D>) -> Tensor<D> {
        let last = D - 1;
        let Vocabulary::Split { group, .. } = self else {
            return burn::tensor::activation::log_softmax(logits, last);
        };
        logits.clone() - tp_copy(group_log_sum_exp(logits, group), group)
    }

    /// `x` summed over the vocabulary (the last axis, kept with size 1): over every token's
    /// values, this rank's block then the group's.
    pub fn sum<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let summed = x.sum_dim(D - 1);
        match self {
            Vocabulary::Whole => summed,
            Vocabulary::Split { group, .. } => tp_reduce(summed, group),
        }
    }

    /// The values of `x` (per token of the vocabulary on the last axis) at the token ids `ids`
    /// (indices into the whole vocabulary, on the same last axis): what `x.gather(last, ids)`
    /// gives over the whole vocabulary. Split, each id's value comes from the rank whose block
    /// holds it (0 elsewhere) and the group sums them.
    pub fn pick<const D: usize>(&self, x: Tensor<D>, ids: Tensor<D, Int>) -> Tensor<D> {
        let last = D - 1;
        let Vocabulary::Split { group, block } = self else {
            return x.gather(last, ids);
        };
        let (index, inside) = block_index(ids, block);
        tp_reduce(x.gather(last, index) * inside, group)
    }
}

/// The log-sum-exp over the whole vocabulary of this rank's block of `logits` (the last axis,
/// kept with size 1), the same on every rank of `group`: the blocks' sums of exponentials
/// summed over the group ([`tp_reduce`]), shifted by the group's largest logit (a constant,
/// so it carries no gradient).
pub fn group_log_sum_exp<const D: usize>(logits: Tensor<D>, group: &Group) -> Tensor<D> {
    let last = D - 1;
    let max = logits.clone().detach().max_dim(last);
    let dims = max.dims();
    let device = max.device();
    let mut values: Vec<f32> = max.into_data().convert::<f32>().try_to_vec().unwrap_or_default();
    group
        .0
        .all_reduce(&mut values, ReduceOp::Max)
        .unwrap_or_else(|e| panic!("tensor parallel: the logits' maximum: {e}"));
    let max = Tensor::<D>::from_data(TensorData::new(values, dims), &device);
    let sum = tp_reduce((logits - max.clone()).exp().sum_dim(last), group);
    sum.log() + max
}

/// Where the token ids `ids` (of the whole vocabulary) fall in the block `block` a rank holds:
/// each id's index in the block (clamped into it for the ids outside), and 1 for the ids
/// inside, 0 for the others. A split lookup or pick takes `index` and multiplies by `inside`,
/// so each id's value comes from the one rank whose block holds it.
pub fn block_index<const D: usize>(ids: Tensor<D, Int>, block: &Range<usize>) -> (Tensor<D, Int>, Tensor<D>) {
    let shifted = ids.sub_scalar(block.start as i64);
    let inside = shifted
        .clone()
        .greater_equal_elem(0)
        .bool_and(shifted.clone().lower_elem(block.len() as i64));
    let index = shifted.clamp(0, block.len().saturating_sub(1) as i64);
    (index, inside.float())
}

impl Vocabulary {
    /// The `k` largest values of `x` over the whole vocabulary (the last axis) and their token
    /// ids, largest first, as `x.topk_with_indices(k, last)` gives them. Split, each rank
    /// offers its block's largest and every rank keeps the `k` largest of the group's offers.
    /// Not differentiable (for caches).
    pub fn top_k<const D: usize>(&self, x: Tensor<D>, k: usize) -> (Tensor<D>, Tensor<D, Int>) {
        let last = D - 1;
        let Vocabulary::Split { group, block } = self else {
            return x.topk_with_indices(k, last);
        };
        let device = x.device();
        let mut dims = x.dims();
        let offered = k.min(block.len());
        let (values, ids) = x.detach().topk_with_indices(offered, last);
        let values: Vec<f32> = values
            .into_data()
            .convert::<f32>()
            .try_to_vec()
            .unwrap_or_default();
        let ids: Vec<i64> = ids.into_data().convert::<i64>().try_to_vec().unwrap_or_default();
        // One message per rank: its offers as (value, whole-vocabulary id) pairs, row by row.
        let mut bytes = Vec::with_capacity(values.len() * 12);
        for (v, id) in values.iter().zip(&ids) {
            bytes.extend_from_slice(&v.to_le_bytes());
            bytes.extend_from_slice(&(id + block.start as i64).to_le_bytes());
        }
        let parts = group
            .0
            .all_gather(&bytes)
            .unwrap_or_else(|e| panic!("vocabulary split over a tensor group: the top {k}: {e}"));
        let offers: Vec<Vec<(f32, i64)>> = parts
            .iter()
            .map(|part| {
                part.chunks_exact(12)
                    .map(|c| {
                        let value = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        let id = i64::from_le_bytes([c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11]]);
                        (value, id)
                    })
                    .collect()
            })
            .collect();
        let rows = values.len() / offered.max(1);
        let (mut top_values, mut top_ids) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
        for row in 0..rows {
            let mut candidates: Vec<(f32, i64)> = offers
                .iter()
                .flat_map(|rank| {
                    let per_row = rank.len() / rows.max(1);
                    rank[row * per_row..(row + 1) * per_row].iter().copied()
                })
                .collect();
            // Largest first; equal values by id, as one process's blocks come in id order.
            candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            for &(value, id) in candidates.iter().take(k) {
                top_values.push(value);
                top_ids.push(id);
            }
        }
        dims[last] = k;
        (
            Tensor::from_data(TensorData::new(top_values, dims), &device),
            Tensor::from_data(TensorData::new(top_ids, dims), &device),
        )
    }
}
