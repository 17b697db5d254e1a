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

    /// The response tokens the model wrote (the ones the losses are means over).
    pub fn own_tokens(&self) -> usize {
        self.response_ids.len() - self.observed.iter().filter(|&&o| o).count()
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
    /// `[batch · (P + T)]`: which tokens are not padding.
    pub valid: Vec<bool>,
}

impl Layout {
    pub fn new(seqs: &[Sequence], device: &Device) -> Self {
        let (p, t) = padded_widths(seqs);
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
        let valid = valid.concat();
        Self {
            tokens: Tensor::from_data(TensorData::new(flat, [seqs.len(), width]), device),
            positions,
            mask,
            response_mask: Tensor::from_data(TensorData::new(response_mask, [seqs.len(), t]), device),
            prompt_width: p,
            response_width: t,
            lengths: seqs.iter().map(|s| s.response_ids.len()).collect(),
            valid,
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

/// Which sequences share each training row when they are packed: first-fit, longest first,
/// into rows of `capacity` tokens (a longer sequence gets a row of its own). Each row lists
/// its sequences in order.
pub fn pack_rows(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut rows: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in order {
        match rows.iter_mut().find(|(used, _)| used + lengths[i] <= capacity) {
            Some((used, members)) => {
                *used += lengths[i];
                members.push(i);
            }
            None => rows.push((lengths[i], vec![i])),
        }
    }
    rows.into_iter().map(|(_, members)| members).collect()
}

/// The prompt width `P` and response width `T` (at least 1) of [`Layout`]: the longest of each.
fn padded_widths(seqs: &[Sequence]) -> (usize, usize) {
    let p = seqs.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(0);
    let t = seqs.iter().map(|s| s.response_ids.len()).max().unwrap_or(0);
    (p, t.max(1))
}

/// Each sequence's whole length, prompt and response.
fn sequence_lengths(seqs: &[Sequence]) -> Vec<usize> {
    seqs.iter()
        .map(|s| s.prompt_ids.len() + s.response_ids.len())
        .collect()
}

/// [`Packed`]'s rows of sequences of `lengths` (each at least as long as the longest sequence)
/// and their width: the fullest row's, at least 2 so there is a position to predict from.
fn packing(lengths: &[usize]) -> (Vec<Vec<usize>>, usize) {
    let capacity = lengths.iter().copied().max().unwrap_or(1).max(1);
    let rows = pack_rows(lengths, capacity);
    let width = rows
        .iter()
        .map(|r| r.iter().map(|&i| lengths[i]).sum::<usize>())
        .max()
        .unwrap_or(1)
        .max(2);
    (rows, width)
}

/// The share of a pass's token slots that are padding, `(padded, packed)`, over `seqs` taken
/// `chunk` at a time: [`Layout`]'s (prompts and responses each padded to the longest) and
/// [`Packed`]'s (rows as wide as the fullest).
pub fn padding_fractions(seqs: &[Sequence], chunk: usize) -> (f64, f64) {
    let (mut real, mut padded, mut packed) = (0usize, 0usize, 0usize);
    for part in seqs.chunks(chunk.max(1)) {
        let lengths = sequence_lengths(part);
        let (p, t) = padded_widths(part);
        real += lengths.iter().sum::<usize>();
        padded += part.len() * (p + t);
        let (rows, width) = packing(&lengths);
        packed += rows.len() * width;
    }
    let share = |slots: usize| 1.0 - real as f64 / slots.max(1) as f64;
    (share(padded), share(packed))
}

/// Sequences packed into rows (positions restarting and attention kept inside each
/// sequence), with the map from the rows' shifted per-position values back to the padded
/// `[batch, T]` response layout of [`Layout`]: what the forward pass sees instead of padding.
pub struct Packed {
    pub tokens: Tensor<2, Int>,
    pub positions: Tensor<2, Int>,
    pub mask: Tensor<4, Bool>,
    /// `[batch · T]`: for response token `j` of sequence `b`, the flat index into the rows'
    /// `[rows · (width − 1)]` shifted values that predicts it; padding points one past the
    /// end (a zero appended there).
    gather: Tensor<1, Int>,
    batch: usize,
    response_width: usize,
    /// Tokens in the rows (real and padding), and real ones.
    pub slots: usize,
    pub real: usize,
    /// `[rows · width]`: which tokens are a sequence's (not padding).
    pub valid: Vec<bool>,
}

impl Packed {
    /// `seqs` packed into rows of at least the longest sequence's length.
    pub fn new(seqs: &[Sequence], device: &Device) -> Self {
        let lengths = sequence_lengths(seqs);
        let (rows, width) = packing(&lengths);
        let (_, t) = padded_widths(seqs);
        let end = (rows.len() * (width - 1)) as i64;
        let mut flat = vec![0i64; rows.len() * width];
        let mut segments = vec![vec![None; width]; rows.len()];
        let mut gather = vec![end; seqs.len() * t];
        for (r, members) in rows.iter().enumerate() {
            let mut offset = 0;
            for &i in members {
                let s = &seqs[i];
                for (k, &token) in s.prompt_ids.iter().chain(&s.response_ids).enumerate() {
                    flat[r * width + offset + k] = token as i64;
                    segments[r][offset + k] = Some(i);
                }
                for j in 0..s.response_ids.len() {
                    let column = offset + s.prompt_ids.len() + j - 1;
                    gather[i * t + j] = (r * (width - 1) + column) as i64;
                }
                offset += lengths[i];
            }
        }
        let (positions, mask) = aligner_core::model::packed_layout(&segments, device);
        let valid = segments.iter().flatten().map(Option::is_some).collect();
        Self {
            tokens: Tensor::from_data(TensorData::new(flat, [rows.len(), width]), device),
            positions,
            mask,
            gather: Tensor::from_data(TensorData::new(gather, [seqs.len() * t]), device),
            batch: seqs.len(),
            response_width: t,
            slots: rows.len() * width,
            real: lengths.iter().sum(),
            valid,
        }
    }

    /// `[rows, width − 1]` shifted values (position t predicting token t + 1) → `[batch, T]`
    /// per response token, as [`Layout::response_columns`] gives them (0 on padding).
    pub fn response_columns(&self, x: Tensor<2>) -> Tensor<2> {
        let [rows, w] = x.dims();
        let flat = Tensor::cat(
            vec![x.reshape([rows * w]), Tensor::zeros([1], &self.gather.device())],
            0,
        );
        flat.select(0, self.gather.clone())
            .reshape([self.batch, self.response_width])
    }

    /// `[rows, width − 1, d]` states at the predicting positions → `[batch, T, d]`.
    pub fn response_states(&self, x: Tensor<3>) -> Tensor<3> {
        let [rows, w, d] = x.dims();
        let flat = Tensor::cat(
            vec![
                x.reshape([rows * w, d]),
                Tensor::zeros([1, d], &self.gather.device()),
            ],
            0,
        );
        flat.select(0, self.gather.clone())
            .reshape([self.batch, self.response_width, d])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pack_first_fit_longest_first() {
        assert_eq!(
            pack_rows(&[5, 3, 2, 4, 1], 6),
            vec![vec![0, 4], vec![3, 2], vec![1]]
        );
        assert_eq!(pack_rows(&[7], 6), vec![vec![0]]);
    }

    /// Packed rows give the padded layout's per-token log-probs of the shipped model.
    #[test]
    fn packed_log_probs_are_the_padded_ones() {
        let device = Device::flex();
        let model = aligner_core::LoadedModel::from_dir(&aligner_core::default_model_dir().unwrap(), &device)
            .unwrap()
            .model;
        let seqs: Vec<Sequence> = [(3usize, 5usize), (6, 2), (2, 7), (4, 1)]
            .iter()
            .enumerate()
            .map(|(n, &(p, r))| Sequence {
                prompt_ids: std::iter::once(1)
                    .chain((0..p as u32 - 1).map(|k| 20 + k + n as u32))
                    .collect(),
                response_ids: (0..r as u32).map(|k| 100 + 7 * k + n as u32).collect(),
                observed: Vec::new(),
            })
            .collect();
        let layout = Layout::new(&seqs, &device);
        let padded = layout.response_columns(model.token_logprobs_with(
            layout.tokens.clone(),
            &layout.positions,
            Some(&layout.mask),
        ));
        let packed = Packed::new(&seqs, &device);
        assert!(packed.slots < seqs.len() * (layout.prompt_width + layout.response_width));
        // Both layouts mark their real tokens (what the load-balancing loss counts).
        let real: usize = seqs
            .iter()
            .map(|s| s.prompt_ids.len() + s.response_ids.len())
            .sum();
        assert_eq!(packed.valid.iter().filter(|&&v| v).count(), real);
        assert_eq!(packed.valid.len(), packed.slots);
        assert_eq!(layout.valid.iter().filter(|&&v| v).count(), real);
        assert_eq!(layout.valid.len(), layout.tokens.dims().iter().product::<usize>());
        let lp = packed.response_columns(model.token_logprobs_with(
            packed.tokens.clone(),
            &packed.positions,
            Some(&packed.mask),
        ));
        let (a, b) = (layout.ragged(padded), layout.ragged(lp));
        for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
            assert!((x - y).abs() < 1e-4, "{a:?} against {b:?}");
        }
        assert_eq!(a.iter().flatten().count(), 15);
    }

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
