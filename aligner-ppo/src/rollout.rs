//! Rollout sequences and their tensor layout.
//!
//! A batch is laid out as `[pad… prompt | response …pad]`: prompts left-padded to the longest
//! one (`P` columns), responses right-padded to the longest one (`T` columns). Response token
//! `j` of every row then sits in column `P + j`, its log-prob in column `P − 1 + j` of the
//! shifted log-probs, and the critic's value for it (the state before it) at position `P − 1 + j`,
//! so every per-token quantity is one `narrow` away.

use aligner_core::model::left_padded_layout;
use aligner_gen::{Generation, GenerationRequest};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// One prompt and the response sampled for it (for a multi-turn episode, everything after
/// the prompt: the model's turns and the environment's observations).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    /// `true` on the response tokens the environment wrote (masked from every loss and from
    /// the KL); empty when every response token is the model's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub observed: Vec<bool>,
}

impl Sequence {
    /// Each request's prompt with the response generated for it.
    pub fn from_generations(requests: &[GenerationRequest], generations: &[Generation]) -> Vec<Self> {
        requests
            .iter()
            .zip(generations)
            .map(|(r, g)| Self {
                prompt_ids: r.prompt_ids.clone(),
                response_ids: g.token_ids.clone(),
                observed: Vec::new(),
            })
            .collect()
    }

    /// Whether response token `j` is the environment's.
    pub fn is_observed(&self, j: usize) -> bool {
        self.observed.get(j).copied().unwrap_or(false)
    }
}

/// Tensors of a batch of sequences in the layout above.
pub struct Layout {
    pub tokens: Tensor<2, Int>,
    pub positions: Tensor<2, Int>,
    pub mask: Tensor<4, Bool>,
    /// `[batch, T]`: 1 on the model's own response tokens (not padding, not observations).
    pub response_mask: Tensor<2>,
    /// `P`, the prompt width.
    pub prompt_width: usize,
    /// `T`, the response width.
    pub response_width: usize,
    pub lengths: Vec<usize>,
}

impl Layout {
    pub fn new(seqs: &[Sequence], device: &Device) -> Self {
        let p = seqs.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(0);
        let t = seqs
            .iter()
            .map(|s| s.response_ids.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let width = p + t;
        let mut flat = Vec::with_capacity(seqs.len() * width);
        let mut valid = Vec::with_capacity(seqs.len());
        let mut response_mask = Vec::with_capacity(seqs.len() * t);
        for s in seqs {
            let pad = p - s.prompt_ids.len();
            let tail = t - s.response_ids.len();
            flat.extend(std::iter::repeat_n(0i64, pad));
            flat.extend(s.prompt_ids.iter().chain(&s.response_ids).map(|&x| x as i64));
            flat.extend(std::iter::repeat_n(0i64, tail));
            let mut row = vec![false; pad];
            row.extend(std::iter::repeat_n(
                true,
                s.prompt_ids.len() + s.response_ids.len(),
            ));
            row.extend(std::iter::repeat_n(false, tail));
            valid.push(row);
            response_mask
                .extend((0..t).map(|j| (j < s.response_ids.len() && !s.is_observed(j)) as u8 as f32));
        }
        let (positions, mask) = left_padded_layout(&valid, width, device);
        Self {
            tokens: Tensor::from_data(TensorData::new(flat, [seqs.len(), width]), device),
            positions,
            mask,
            response_mask: Tensor::from_data(TensorData::new(response_mask, [seqs.len(), t]), device),
            prompt_width: p,
            response_width: t,
            lengths: seqs.iter().map(|s| s.response_ids.len()).collect(),
        }
    }

    /// Per-response-token columns of `[batch, P + T − 1]` shifted log-probs or of
    /// `[batch, P + T]` per-position values: `[batch, T]`.
    pub fn response_columns(&self, x: Tensor<2>) -> Tensor<2> {
        x.narrow(1, self.prompt_width - 1, self.response_width)
    }

    /// `[batch, T]` host rows cut to each response's length.
    pub fn ragged(&self, x: Tensor<2>) -> Vec<Vec<f32>> {
        let t = self.response_width;
        let flat: Vec<f32> = x.into_data().try_to_vec::<f32>().unwrap_or_default();
        self.lengths
            .iter()
            .enumerate()
            .map(|(i, &len)| flat[i * t..i * t + len].to_vec())
            .collect()
    }

    /// Ragged per-token host rows as a zero-padded `[batch, T]` tensor.
    pub fn padded(&self, rows: &[Vec<f32>], device: &Device) -> Tensor<2> {
        let t = self.response_width;
        let mut flat = vec![0.0f32; rows.len() * t];
        for (i, row) in rows.iter().enumerate() {
            flat[i * t..i * t + row.len()].copy_from_slice(row);
        }
        Tensor::from_data(TensorData::new(flat, [rows.len(), t]), device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The response mask covers the model's own tokens: not the padding, not the environment's.
    #[test]
    fn observations_are_outside_the_response_mask() {
        let seqs = [
            Sequence {
                prompt_ids: vec![1, 5],
                response_ids: vec![7, 8, 9, 10],
                observed: vec![false, true, true, false],
            },
            Sequence {
                prompt_ids: vec![1],
                response_ids: vec![4, 2],
                observed: Vec::new(),
            },
        ];
        let layout = Layout::new(&seqs, &Device::flex());
        let mask = layout.response_mask.into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(mask, vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
    }
}
