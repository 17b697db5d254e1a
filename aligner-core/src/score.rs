//! Sequence log-probabilities of responses given prompts (`aligner score`, and every
//! preference method's reference pass).
//!
//! Convention (as in `shared/reference`): `ids = encode(prompt + response)` with BOS; the
//! response tokens are `ids[len(encode(prompt))..]`; the log-prob sums theirs.

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::error::{CoreError, Result};
use crate::model::CausalLm;
use crate::tokenizer::TextTokenizer;

/// A tokenized prompt + response pair.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredSequence {
    /// `encode(prompt + response)` with special tokens.
    pub ids: Vec<u32>,
    /// Number of leading ids that belong to the prompt.
    pub prompt_len: usize,
    /// Which response tokens (`ids[prompt_len + j]`) an environment wrote in a multi-turn
    /// episode: masked from every log-prob sum, as they are not the model's. Empty: none.
    pub observed: Vec<bool>,
}

impl ScoredSequence {
    /// Tokenizes a pair by the reference convention.
    pub fn encode(tokenizer: &TextTokenizer, prompt: &str, response: &str) -> Result<Self> {
        let ids = tokenizer.encode(&format!("{prompt}{response}"), true)?;
        let prompt_len = tokenizer.encode(prompt, true)?.len().min(ids.len());
        Ok(Self {
            ids,
            prompt_len,
            observed: Vec::new(),
        })
    }

    /// Whether the token at `t` (`t ≥ max(prompt_len, 1)`) counts in the response's log-prob:
    /// the model's own, not an observation.
    pub fn scores(&self, t: usize) -> bool {
        !t.checked_sub(self.prompt_len)
            .and_then(|j| self.observed.get(j))
            .copied()
            .unwrap_or(false)
    }

    /// Keeps the first `max_len` tokens; an error when that cuts away every response token
    /// (a prompt of `max_len` tokens or more), which would train on nothing. An empty response
    /// scores the prompt's last token, as it always has (a model's own empty answer in SPIN).
    pub fn truncate(&mut self, max_len: usize) -> Result<()> {
        let had_response = self.ids.len() > self.prompt_len.max(1);
        self.ids.truncate(max_len.max(2));
        if had_response && self.prompt_len.max(1) >= self.ids.len() {
            return Err(CoreError::Invalid(format!(
                "no response token is left within data.max_seq_len = {max_len}: the prompt alone is {} tokens \
                 (raise data.max_seq_len, or shorten or drop the row)",
                self.prompt_len
            )));
        }
        self.prompt_len = self.prompt_len.min(self.ids.len() - 1);
        self.observed.truncate(self.ids.len() - self.prompt_len);
        Ok(())
    }

    /// Number of response tokens that are scored (the first token has no context).
    pub fn n_response_tokens(&self) -> usize {
        let first = self.prompt_len.max(1).min(self.ids.len());
        (first..self.ids.len()).filter(|&t| self.scores(t)).count()
    }
}

/// Per-token log-probs of the response tokens of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseLogprobs {
    pub token_logprobs: Vec<f32>,
}

impl ResponseLogprobs {
    /// Sum of the response tokens' log-probs.
    pub fn total(&self) -> f64 {
        self.token_logprobs.iter().map(|&v| v as f64).sum()
    }
}

/// Right-pads `rows` with `pad` into a `[batch, max_len]` tensor.
pub fn pad_right(rows: &[&[u32]], pad: u32, device: &Device) -> Tensor<2, Int> {
    let max_len = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let mut flat = Vec::with_capacity(rows.len() * max_len);
    for row in rows {
        flat.extend(row.iter().map(|&t| t as i64));
        flat.extend(std::iter::repeat_n(pad as i64, max_len - row.len()));
    }
    Tensor::from_data(TensorData::new(flat, [rows.len(), max_len]), device)
}

/// Which entries of [`pad_right`]`(rows)` are tokens of a row (`false`: padding), row by row.
pub fn right_padding_valid(rows: &[&[u32]]) -> Vec<bool> {
    let width = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    rows.iter()
        .flat_map(|r| (0..width).map(move |t| t < r.len()))
        .collect()
}

/// Response log-probs of `sequences`, `batch_size` at a time (right-padded).
pub fn response_logprobs(
    model: &CausalLm,
    sequences: &[ScoredSequence],
    batch_size: usize,
) -> Result<Vec<ResponseLogprobs>> {
    let device = model.model.embed_tokens.weight.device();
    let mut out = Vec::with_capacity(sequences.len());
    for batch in sequences.chunks(batch_size.max(1)) {
        if let Some(short) = batch.iter().find(|s| s.ids.len() < 2) {
            return Err(CoreError::Invalid(format!(
                "a sequence of {} token(s) has nothing to score",
                short.ids.len()
            )));
        }
        let rows: Vec<&[u32]> = batch.iter().map(|s| s.ids.as_slice()).collect();
        let tokens = pad_right(&rows, 0, &device);
        let [b, width] = tokens.dims();
        let logprobs: Vec<f32> = model
            .token_logprobs(tokens)
            .into_data()
            .try_to_vec()
            .map_err(|e| CoreError::Invalid(format!("{e:?}")))?;
        for (i, seq) in batch.iter().enumerate().take(b) {
            let row = &logprobs[i * (width - 1)..(i + 1) * (width - 1)];
            // Entry t-1 is log p(ids[t] | ids[..t]).
            let first = seq.prompt_len.max(1);
            // An observation's token counts 0 (it is not the model's).
            out.push(ResponseLogprobs {
                token_logprobs: (first..seq.ids.len())
                    .map(|t| if seq.scores(t) { row[t - 1] } else { 0.0 })
                    .collect(),
            });
        }
    }
    Ok(out)
}

/// Summed response log-probs `[rows]` (with gradients when `model` is on an autodiff device)
/// and response token counts of `seqs` under `model`: the policy side of every preference loss.
pub fn sequence_logprobs(model: &CausalLm, seqs: &[&ScoredSequence]) -> (Tensor<1>, Vec<f32>) {
    let device = model.model.embed_tokens.weight.device();
    let rows: Vec<&[u32]> = seqs.iter().map(|s| s.ids.as_slice()).collect();
    let tokens = pad_right(&rows, 0, &device);
    let [n, width] = tokens.dims();
    let mut mask = vec![0f32; n * (width - 1)];
    let mut counts = Vec::with_capacity(n);
    for (i, s) in seqs.iter().enumerate() {
        let first = s.prompt_len.max(1);
        for t in (first..s.ids.len()).filter(|&t| s.scores(t)) {
            mask[i * (width - 1) + t - 1] = 1.0;
        }
        counts.push(s.n_response_tokens().max(1) as f32);
    }
    let mask = Tensor::<2>::from_data(TensorData::new(mask, [n, width - 1]), &device);
    let logprobs =
        crate::model::with_valid_tokens(right_padding_valid(&rows), || model.token_logprobs(tokens));
    let sums = (logprobs * mask).sum_dim(1).reshape([n]);
    (sums, counts)
}

/// Summed response log-probs of `seqs` under the frozen `reference`, one per line of `cache`:
/// read back when the file was computed from the same reference weights and sequences (its
/// [`crate::cache`] key; a resumed run), else computed `batch_size` at a time and written
/// there. The reference side of DPO, KTO and SPIN.
///
/// Data parallel: rank 0 reads the cache; otherwise each rank scores its shard of `seqs`, the
/// shards are gathered on every rank and rank 0 writes the one cache.
pub fn cached_reference_logprobs(
    seqs: &[ScoredSequence],
    reference: &CausalLm,
    cache: &std::path::Path,
    batch_size: usize,
    comm: &dyn aligner_parallel::Communicator,
) -> Result<Vec<f32>> {
    // The cache is read and written by the world's rank 0 alone, and what it read is shared
    // with every rank: in tensor groups `comm` (the data-parallel ranks) has a root in each
    // group, whose ranks must compute (or not) together.
    let world = aligner_parallel::world();
    let key = world.is_root().then(|| {
        let sequences: Vec<(&[u32], usize)> = seqs.iter().map(|s| (s.ids.as_slice(), s.prompt_len)).collect();
        crate::cache::CacheKey::builder("reference log-probs")
            .weights(reference)
            .value(&sequences)
            .finish()
    });
    let cached = key.as_ref().and_then(|key| {
        let text = crate::cache::read_fresh(cache, key)?;
        let values: Vec<f32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        (values.len() == seqs.len()).then_some(values)
    });
    if let Some(values) = crate::parallel::broadcast_from_root(world.as_ref(), &cached)? {
        return Ok(values);
    }
    let values: Vec<f32> = crate::parallel::map_sharded(comm, seqs, |mine| {
        Ok::<_, CoreError>(
            response_logprobs(reference, mine, batch_size)?
                .iter()
                .map(|lp| lp.total() as f32)
                .collect(),
        )
    })?;
    if let Some(key) = &key {
        let text: String = values.iter().map(|v| format!("{v}\n")).collect();
        crate::cache::write(cache, key, &text)?;
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_that_leaves_no_response_token_is_an_error() {
        let seq = || ScoredSequence {
            ids: (0..10).collect(),
            prompt_len: 6,
            observed: Vec::new(),
        };
        let mut kept = seq();
        kept.truncate(8).unwrap();
        assert_eq!(
            (kept.ids.len(), kept.prompt_len, kept.n_response_tokens()),
            (8, 6, 2)
        );
        let err = seq().truncate(6).unwrap_err().to_string();
        assert!(
            err.contains("data.max_seq_len = 6") && err.contains("prompt alone is 6 tokens"),
            "{err}"
        );
        // An empty response keeps scoring the prompt's last token (a model's own empty answer).
        let mut empty = ScoredSequence {
            ids: (0..6).collect(),
            prompt_len: 6,
            observed: Vec::new(),
        };
        empty.truncate(4).unwrap();
        assert_eq!((empty.ids.len(), empty.prompt_len), (4, 3));
    }

    /// A multi-turn episode's observation tokens count in no log-prob: the summed log-probs
    /// (with gradients or not) and the token counts are the model's own tokens' only, equal to
    /// the plain sequence's sums less the observations' log-probs; truncation cuts the marks.
    #[test]
    fn observation_tokens_are_left_out_of_every_logprob() {
        let device = Device::flex();
        let lm = crate::LoadedModel::from_dir(&crate::default_model_dir().unwrap(), &device).unwrap();
        let plain = ScoredSequence {
            ids: vec![1, 403, 407, 261, 378, 17, 80, 341, 29, 11, 90, 33],
            prompt_len: 4,
            observed: Vec::new(),
        };
        // Response tokens 2..5 are an environment's reply.
        let mut episode = plain.clone();
        episode.observed = vec![false, false, true, true, true, false, false, false];
        let per_token = &response_logprobs(&lm.model, std::slice::from_ref(&plain), 4).unwrap()[0];
        let observed: f64 = per_token.token_logprobs[2..5].iter().map(|&v| v as f64).sum();
        let masked = &response_logprobs(&lm.model, std::slice::from_ref(&episode), 4).unwrap()[0];
        assert!((masked.total() - (per_token.total() - observed)).abs() < 1e-4);
        assert!(masked.token_logprobs[2..5].iter().all(|&v| v == 0.0));
        let (sums, counts) = sequence_logprobs(&lm.model, &[&plain, &episode]);
        let sums: Vec<f32> = sums.into_data().try_to_vec().unwrap();
        assert!(((sums[1] - sums[0]) as f64 + observed).abs() < 1e-4, "{sums:?}");
        assert_eq!(counts, vec![8.0, 5.0]);
        assert_eq!(episode.n_response_tokens(), 5);
        episode.truncate(7).unwrap();
        assert_eq!((episode.observed.len(), episode.n_response_tokens()), (3, 2));
    }
}
