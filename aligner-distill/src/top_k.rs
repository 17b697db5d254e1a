//! Supervised distillation from the teacher's cached top-k log-probs (`distill.top_k`): the
//! teacher runs once over the training data, its `k` most likely next tokens and their
//! log-probs at each position are kept in the run folder (keyed by the teacher's weights, the
//! data and the settings, like the reference log-probs), and every later step and epoch reads
//! them instead of running the teacher again.

use std::collections::HashMap;
use std::path::Path;

use aligner_core::cache::{self, CacheKey};
use aligner_core::score::pad_right;
use aligner_core::sft::SftExample;
use aligner_core::{CoreError, Device};
use aligner_parallel::vocab::Vocabulary;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use safetensors::tensor::{Dtype, TensorView};

use crate::{DistillError, Result};

/// The file of the cache in the run folder.
pub const TOP_K_FILE: &str = "teacher_top_k_train.safetensors";

/// Per-position forward KL from the teacher's top-k distribution (its `k` most likely tokens,
/// renormalised over them) to the student's at temperature `temperature`:
/// `Σ_i p̃_T(i) (log p̃_T(i) − log p_S(v_i))`, with `teacher_ids` / `teacher_logprobs`
/// `[batch, seq, k]` and `student_logits` `[batch, seq, vocab]` → `[batch, seq]`. With `k` the
/// whole vocabulary it is [`crate::forward_kl`].
pub fn forward_kl_top_k(
    teacher_ids: Tensor<3, Int>,
    teacher_logprobs: Tensor<3>,
    student_logits: Tensor<3>,
    temperature: f64,
) -> Tensor<2> {
    forward_kl_top_k_over(
        &Vocabulary::Whole,
        teacher_ids,
        teacher_logprobs,
        student_logits,
        temperature,
    )
}

/// [`forward_kl_top_k`] with the student's logits over `vocabulary` (the whole vocabulary,
/// or this rank's block of it in a tensor group); the teacher's top-k are whole on every rank.
pub fn forward_kl_top_k_over(
    vocabulary: &Vocabulary,
    teacher_ids: Tensor<3, Int>,
    teacher_logprobs: Tensor<3>,
    student_logits: Tensor<3>,
    temperature: f64,
) -> Tensor<2> {
    let [b, s, _] = student_logits.dims();
    let teacher = log_softmax(teacher_logprobs, 2);
    let student = vocabulary.pick(
        vocabulary.log_softmax(student_logits.div_scalar(temperature)),
        teacher_ids,
    );
    (teacher.clone().exp() * (teacher - student))
        .sum_dim(2)
        .reshape([b, s])
}

/// The teacher's top-k next tokens of every training example: for an example of `L` tokens,
/// `L − 1` positions of `k` ids and log-probs (at the loss's temperature).
pub struct TeacherTopK {
    pub k: usize,
    /// Row of each example's first position, by its tokens.
    rows: HashMap<Vec<u32>, usize>,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
}

impl TeacherTopK {
    /// Runs `target` (the target's logits, `[batch, width − 1, vocab]`, of right-padded tokens
    /// on `device`, over the vocabulary it names: whole, or in a tensor group this rank's
    /// block of it) over `examples`, 16 at a time.
    pub fn compute(
        target: impl Fn(Tensor<2, Int>) -> (Tensor<3>, Vocabulary),
        device: &Device,
        examples: &[SftExample],
        k: usize,
        temperature: f64,
    ) -> Self {
        let mut out = Self {
            k,
            rows: HashMap::new(),
            ids: Vec::new(),
            logprobs: Vec::new(),
        };
        for chunk in examples.chunks(16) {
            let rows: Vec<&[u32]> = chunk.iter().map(|e| e.ids.as_slice()).collect();
            let tokens = pad_right(&rows, 0, device);
            let [_, width] = tokens.dims();
            let (logits, vocabulary) = target(tokens);
            let logprobs = vocabulary.log_softmax(logits.div_scalar(temperature));
            let (values, indices) = vocabulary.top_k(logprobs, k);
            let values: Vec<f32> = values.into_data().iter::<f32>().collect();
            let indices: Vec<u32> = indices.into_data().iter::<i64>().map(|i| i as u32).collect();
            for (i, e) in chunk.iter().enumerate() {
                out.rows.entry(e.ids.clone()).or_insert(out.ids.len() / k);
                let start = i * (width - 1) * k;
                let end = start + e.ids.len().saturating_sub(1) * k;
                out.ids.extend_from_slice(&indices[start..end]);
                out.logprobs.extend_from_slice(&values[start..end]);
            }
        }
        out
    }

    /// The batch's top-k ids and log-probs, `[batch, width − 1, k]` (positions past an
    /// example's end are zeros; the loss's mask leaves them out).
    pub fn batch(
        &self,
        batch: &[&SftExample],
        width: usize,
        device: &Device,
    ) -> Result<(Tensor<3, Int>, Tensor<3>)> {
        let (b, k, positions) = (batch.len(), self.k, width - 1);
        let mut ids = vec![0i64; b * positions * k];
        let mut logprobs = vec![0f32; b * positions * k];
        for (i, e) in batch.iter().enumerate() {
            let row = *self.rows.get(&e.ids).ok_or_else(|| {
                DistillError::Invalid(
                    "distill.top_k: an example of the batch is not in the teacher's cache (the data \
                     changed since it was computed?)"
                        .into(),
                )
            })?;
            let n = e.ids.len().saturating_sub(1) * k;
            let (from, to) = (row * k, i * positions * k);
            for j in 0..n {
                ids[to + j] = self.ids[from + j] as i64;
                logprobs[to + j] = self.logprobs[from + j];
            }
        }
        Ok((
            Tensor::from_data(TensorData::new(ids, [b, positions, k]), device),
            Tensor::from_data(TensorData::new(logprobs, [b, positions, k]), device),
        ))
    }

    /// The cache as a safetensors file: `ids` and `logprobs` `[positions, k]`, and each
    /// example's tokens with its first row (`tokens`, `lengths`, `rows`).
    fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut examples: Vec<(&Vec<u32>, &usize)> = self.rows.iter().collect();
        examples.sort_by_key(|(_, row)| **row);
        let tokens: Vec<u32> = examples.iter().flat_map(|(ids, _)| ids.iter().copied()).collect();
        let lengths: Vec<u32> = examples.iter().map(|(ids, _)| ids.len() as u32).collect();
        let rows: Vec<u32> = examples.iter().map(|(_, row)| **row as u32).collect();
        let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let floats: Vec<u8> = self.logprobs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let (ids, tokens, lengths, rows) = (le(&self.ids), le(&tokens), le(&lengths), le(&rows));
        let positions = self.ids.len() / self.k.max(1);
        fn view(dtype: Dtype, shape: Vec<usize>, data: &[u8]) -> Result<TensorView<'_>> {
            TensorView::new(dtype, shape, data)
                .map_err(|e| DistillError::Invalid(format!("top-k cache: {e}")))
        }
        let tensors = vec![
            ("ids", view(Dtype::U32, vec![positions, self.k], &ids)?),
            ("logprobs", view(Dtype::F32, vec![positions, self.k], &floats)?),
            ("tokens", view(Dtype::U32, vec![tokens.len() / 4], &tokens)?),
            ("lengths", view(Dtype::U32, vec![lengths.len() / 4], &lengths)?),
            ("rows", view(Dtype::U32, vec![rows.len() / 4], &rows)?),
        ];
        safetensors::serialize(tensors, None).map_err(|e| DistillError::Invalid(format!("top-k cache: {e}")))
    }

    fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |what: String| DistillError::Invalid(format!("{}: {what}", path.display()));
        let file = safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        let u32s = |name: &str| -> Result<Vec<u32>> {
            let t = file.tensor(name).map_err(|e| bad(e.to_string()))?;
            Ok(t.data()
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let ids_view = file.tensor("ids").map_err(|e| bad(e.to_string()))?;
        let k = ids_view.shape().get(1).copied().unwrap_or(0);
        let logprobs: Vec<f32> = file
            .tensor("logprobs")
            .map_err(|e| bad(e.to_string()))?
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let (tokens, lengths, rows) = (u32s("tokens")?, u32s("lengths")?, u32s("rows")?);
        let mut map = HashMap::new();
        let mut at = 0usize;
        for (&len, &row) in lengths.iter().zip(&rows) {
            let end = at + len as usize;
            let example = tokens
                .get(at..end)
                .ok_or_else(|| bad("tokens shorter than lengths".into()))?;
            map.insert(example.to_vec(), row as usize);
            at = end;
        }
        Ok(Self {
            k,
            rows: map,
            ids: u32s("ids")?,
            logprobs,
        })
    }

    /// The cache of `run_file` when its key is `key` (`fresh`, which the ranks agreed on),
    /// else computed by `compute` on the ranks that `compute_here` (rank 0, or in tensor
    /// groups the writer's whole group, whose ranks compute the teacher together) and written
    /// by the one that `writes`: the other ranks wait for it at `barrier` and read it.
    pub fn load_or_compute(
        run_file: &Path,
        fresh: bool,
        compute_here: bool,
        writes: bool,
        key: &CacheKey,
        barrier: impl Fn() -> Result<()>,
        compute: impl FnOnce() -> Self,
    ) -> Result<Self> {
        // A rank that computed it keeps it; only a rank that did not reads the file.
        let computed = match compute_here && !fresh {
            true => {
                let top = compute();
                if writes {
                    let bytes = top.to_bytes()?;
                    cache::write_with(run_file, key, |path| {
                        aligner_core::checkpoint::write_atomic(path, &bytes).map_err(DistillError::from)
                    })?;
                    tracing::info!(cache = %run_file.display(), k = top.k, "cached the teacher's top-k log-probs");
                }
                Some(top)
            }
            false => None,
        };
        barrier()?;
        match computed {
            Some(top) => Ok(top),
            None => {
                let bytes = std::fs::read(run_file).map_err(|e| CoreError::io(run_file, e))?;
                Self::from_bytes(&bytes, run_file)
            }
        }
    }
}
