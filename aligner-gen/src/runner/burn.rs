//! The engine's forward pass through the Burn model, for any device (the CPU uses the host
//! path of `host.rs` instead, unless asked for this one).
//!
//! All cache rows share one write cursor; a sequence occupies the positions from its `start`
//! to the cursor, and the attention mask hides everything before its start (stale keys of the
//! row's earlier occupants, left padding). A new prompt is prefilled in a scratch cache and
//! copied into its row so that it ends at the cursor; a prompt that continues a kept sequence
//! starts that scratch row from the kept keys and values. When the cursor reaches the end of the
//! buffers, every row shifts left by the positions no running sequence uses any more.

use aligner_core::model::{KvCache, default_positions, left_padded_layout, with_weights_in};
use aligner_core::{CausalLm, LlamaConfig};
use aligner_parallel::tensor::{Group, TensorSplit, tp_gather};
use burn::tensor::{Bool, Device, FloatDType, Int, Tensor, TensorData};

use crate::options::EngineStats;

pub(crate) struct BurnRunner {
    pub(crate) model: CausalLm,
    /// The output projection `[hidden, vocab]` laid out contiguously (with tied embeddings it
    /// is otherwise a transposed view, which the logits GEMM would re-pack every step); under
    /// tensor parallel this rank's block of the vocabulary.
    head: Tensor<2>,
    /// Under tensor parallel: the tensor group and the whole vocabulary, whose logits each
    /// pass gathers from the ranks' blocks.
    vocab_split: Option<(Group, usize)>,
    /// The shape of the KV cache (under tensor parallel, this rank's heads).
    config: LlamaConfig,
    device: Device,
    pub(crate) cache: Option<KvCache>,
    /// First cache position of each running row's sequence.
    starts: Vec<usize>,
    /// The longest prompt of the run: the cursor never goes below it.
    prompt_width: usize,
}

fn packed_head(model: &CausalLm, device: &Device) -> Tensor<2> {
    // A split model's own block: the whole projection never exists on one rank.
    let weight = match model.output_block() {
        Some((block, _)) => block,
        None => model.output_weight(),
    };
    let dtype = FloatDType::from(weight.dtype());
    Tensor::<2>::from_data(weight.into_data(), device).cast(dtype)
}

/// Under tensor parallel, the group and the whole vocabulary the logits are gathered over.
fn vocab_split(model: &CausalLm) -> Option<(Group, usize)> {
    model
        .output_block()
        .map(|(_, split)| (split.group.clone(), split.dims[split.axis]))
}

/// The cache's shape: a split model's rank holds its share of the heads.
fn cache_config(model: &CausalLm, config: &LlamaConfig) -> LlamaConfig {
    match model.tensor_group() {
        Some(group) => config.heads_of_tensor_rank(group.0.world_size()),
        None => config.clone(),
    }
}

/// The model with its weights stored in the type it computes in: a half-precision model is
/// cast once here instead of at every use.
fn in_compute_type(model: CausalLm) -> CausalLm {
    let precision = model.model.precision;
    with_weights_in(model, precision)
}

impl BurnRunner {
    pub(crate) fn new(model: CausalLm, mut config: LlamaConfig, device: Device) -> Self {
        let model = in_compute_type(model);
        // The KV cache holds keys and values in the compute type.
        config.precision = model.model.precision;
        let config = cache_config(&model, &config);
        Self {
            head: packed_head(&model, &device),
            vocab_split: vocab_split(&model),
            model,
            config,
            device,
            cache: None,
            starts: Vec::new(),
            prompt_width: 0,
        }
    }

    /// Whether the model is split over a tensor group.
    pub(crate) fn in_tensor_group(&self) -> bool {
        self.vocab_split.is_some()
    }

    /// The same weights, no cache.
    pub(crate) fn replica(&self) -> Self {
        Self {
            model: self.model.clone(),
            head: self.head.clone(),
            vocab_split: self.vocab_split.clone(),
            config: self.config.clone(),
            device: self.device.clone(),
            cache: None,
            starts: Vec::new(),
            prompt_width: 0,
        }
    }

    pub(crate) fn take_weights(&mut self, model: CausalLm) {
        use burn::module::Module;
        self.model = in_compute_type(model.to_device(&self.device));
        self.config.precision = self.model.model.precision;
        self.head = packed_head(&self.model, &self.device);
        self.vocab_split = vocab_split(&self.model);
    }

    /// Allocates (or grows) the cache for `rows` rows of `needed` positions and puts the
    /// cursor after the longest prompt.
    pub(crate) fn reserve(&mut self, rows: usize, prompt_width: usize, span: usize, stats: &mut EngineStats) {
        // Slack beyond one sequence's span: how far the cursor runs between two shifts.
        let needed = span + (span / 4).max(16);
        let mut cache = match self.cache.take() {
            Some(cache) if cache.capacity() >= needed => cache,
            Some(cache) => {
                tracing::debug!(from = cache.capacity(), to = needed, "growing the KV cache");
                stats.allocations += 1;
                cache.with_capacity(needed)
            }
            None => {
                stats.allocations += 1;
                KvCache::new(&self.config, rows, needed, &self.device)
            }
        };
        cache.set_len(prompt_width);
        self.cache = Some(cache);
        self.starts.clear();
        self.prompt_width = prompt_width;
    }

    /// Prefills `prompts` into the next free rows and returns their last-position logits (on
    /// the device), in order. A prompt given a kept sequence (`reused[j]`) starts from that
    /// sequence's keys and values; the others run together, left-padded, from scratch.
    pub(crate) fn prefill(
        &mut self,
        prompts: &[&[u32]],
        reused: &[Option<&KvCache>],
        stats: &mut EngineStats,
    ) -> Tensor<2> {
        let (continued, fresh): (Vec<usize>, Vec<usize>) =
            (0..prompts.len()).partition(|&j| reused.get(j).is_some_and(Option::is_some));
        // Each group's scratch cache and logits; `place[j]`: prompt j's group and row in it.
        let mut groups = Vec::new();
        let mut place = vec![(0, 0); prompts.len()];
        for (members, is_continued) in [(fresh, false), (continued, true)] {
            if members.is_empty() {
                continue;
            }
            let texts: Vec<&[u32]> = members.iter().map(|&j| prompts[j]).collect();
            let (scratch, logits) = if is_continued {
                let kept: Vec<&KvCache> = members.iter().filter_map(|&j| reused[j]).collect();
                self.encode_continued(&texts, &kept, stats)
            } else {
                self.encode(&texts)
            };
            for (r, &j) in members.iter().enumerate() {
                place[j] = (groups.len(), r);
            }
            groups.push((scratch, logits));
        }
        let cache = self.cache.as_mut().expect("reserve comes first");
        for (prompt, &(group, r)) in prompts.iter().zip(&place) {
            cache.copy_row_block(&groups[group].0, r, self.starts.len());
            self.starts.push(cache.len() - prompt.len());
        }
        if groups.len() == 1 {
            return groups.pop().map(|(_, logits)| logits).expect("one group");
        }
        // Both groups: their logits back in the prompts' order.
        let first = groups[0].1.dims()[0];
        let order: Vec<i64> = place
            .iter()
            .map(|&(group, r)| (if group == 0 { r } else { first + r }) as i64)
            .collect();
        let order = Tensor::<1, Int>::from_data(TensorData::new(order, [prompts.len()]), &self.device);
        Tensor::cat(groups.into_iter().map(|(_, logits)| logits).collect(), 0).select(0, order)
    }

    /// Row `row`'s first `len` cached positions (its sequence), copied out for a request that
    /// continues it.
    pub(crate) fn park(&self, row: usize, len: usize) -> KvCache {
        let cache = self.cache.as_ref().expect("a running row has a cache");
        let start = self.starts[row];
        debug_assert_eq!(start + len, cache.len(), "a row's sequence ends at the cursor");
        let mut block = KvCache::new(&self.config, 1, len, &self.device);
        block.copy_positions(cache, row, start..start + len, 0, 0);
        block.set_len(len);
        block
    }

    /// `prompts` that continue kept sequences (`kept[j]`, a prefix of `prompts[j]`), right-aligned
    /// in a scratch cache: each one's kept keys and values are put back and only the last
    /// `rest` positions run, `rest` being the most new tokens of any of them. A prompt whose
    /// kept part covers less than the others' recomputes the difference (the same keys and
    /// values), so that all of them run as one batch.
    fn encode_continued(
        &self,
        prompts: &[&[u32]],
        kept: &[&KvCache],
        stats: &mut EngineStats,
    ) -> (KvCache, Tensor<2>) {
        let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        let rest = prompts
            .iter()
            .zip(kept)
            .map(|(p, k)| p.len() - k.len().min(p.len()))
            .max()
            .unwrap_or(0)
            .max(1);
        let mut scratch = KvCache::new(&self.config, prompts.len(), width, &self.device);
        let mut flat = Vec::with_capacity(prompts.len() * rest);
        let mut valid = Vec::with_capacity(prompts.len());
        for (j, (prompt, kept)) in prompts.iter().zip(kept).enumerate() {
            let begin = width - prompt.len();
            let reuse = prompt.len().saturating_sub(rest).min(kept.len());
            if reuse > 0 {
                scratch.copy_positions(kept, 0, 0..reuse, j, begin);
                stats.reused_positions += reuse;
            }
            // The queries: the row's positions `width - rest ..` (padding before its start).
            flat.extend(
                (width - rest..width).map(|at| at.checked_sub(begin).map_or(0, |i| prompt[i] as i64)),
            );
            valid.push((0..width).map(|k| k >= begin).collect::<Vec<bool>>());
        }
        scratch.set_len(width - rest);
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(flat, [prompts.len(), rest]), &self.device);
        let (positions, mask) = left_padded_layout(&valid, rest, &self.device);
        let logits = self.last_logits(tokens, &positions, Some(&mask), &mut scratch);
        (scratch, logits)
    }

    /// `prompts` (whole sequences) run together, left-padded, through a scratch cache of their
    /// own: the cache and their last-position logits.
    fn encode(&self, prompts: &[&[u32]]) -> (KvCache, Tensor<2>) {
        let width = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
        let mut scratch = KvCache::new(&self.config, prompts.len(), width, &self.device);
        let mut flat = Vec::with_capacity(prompts.len() * width);
        let mut valid = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            let pad = width - prompt.len();
            flat.extend(std::iter::repeat_n(0i64, pad));
            flat.extend(prompt.iter().map(|&t| t as i64));
            valid.push((0..width).map(|t| t >= pad).collect::<Vec<bool>>());
        }
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(flat, [prompts.len(), width]), &self.device);
        let (positions, mask) = if valid.iter().all(|row| row.iter().all(|&v| v)) {
            (default_positions(&tokens), None)
        } else {
            let (p, m) = left_padded_layout(&valid, width, &self.device);
            (p, Some(m))
        };
        let logits = self.last_logits(tokens, &positions, mask.as_ref(), &mut scratch);
        (scratch, logits)
    }

    /// Recomputes rows `(row, sequence)` whole (the sequence ends with the token just fed),
    /// replacing their cached keys and values and their rows of `logits`: LongRoPE's switch
    /// to its long factors ([`crate::runner::Runner::decode`]).
    fn reencode(&mut self, rows: &[(usize, Vec<u32>)], mut logits: Tensor<2>) -> Tensor<2> {
        if rows.is_empty() {
            return logits;
        }
        let sequences: Vec<&[u32]> = rows.iter().map(|(_, s)| s.as_slice()).collect();
        let (scratch, fresh) = self.encode(&sequences);
        let cache = self.cache.as_mut().expect("reserve comes first");
        let vocab = logits.dims()[1];
        for (j, (row, _)) in rows.iter().enumerate() {
            cache.copy_row_block(&scratch, j, *row);
            let line = fresh.clone().narrow(0, j, 1);
            logits = logits.slice_assign([*row..*row + 1, 0..vocab], line);
        }
        logits
    }

    /// Feeds every running row its last token at its position; returns the next logits.
    pub(crate) fn decode(
        &mut self,
        tokens: &[u32],
        positions: &[usize],
        reencode: &[(usize, Vec<u32>)],
        stats: &mut EngineStats,
    ) -> Tensor<2> {
        let mut cache = self.cache.take().expect("reserve comes first");
        if cache.len() == cache.capacity() {
            let shift = self
                .starts
                .iter()
                .copied()
                .min()
                .unwrap_or(0)
                .min(cache.len() - self.prompt_width);
            cache.shift_left(shift);
            stats.shifts += 1;
            for start in &mut self.starts {
                *start -= shift;
            }
        }
        let rows = tokens.len();
        let column = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [rows, 1]), &self.device);
        let tokens = column(tokens.iter().map(|&t| t as i64).collect());
        let positions = column(positions.iter().map(|&p| p as i64).collect());
        // Attention reads from the earliest running sequence's start; when every row starts
        // there, nothing is left to hide and the causal default (faster kernel) is exact.
        let window = self.starts.iter().copied().min().unwrap_or(0);
        cache.set_window_start(window);
        let keys = cache.len() + 1 - window;
        let mask = self.starts.iter().any(|&s| s > window).then(|| {
            let hidden: Vec<bool> = self
                .starts
                .iter()
                .flat_map(|&s| (0..keys).map(move |k| k + window < s))
                .collect();
            Tensor::<4, Bool>::from_data(TensorData::new(hidden, [rows, 1, 1, keys]), &self.device)
        });
        let logits = self.last_logits(tokens, &positions, mask.as_ref(), &mut cache);
        cache.set_window_start(0);
        self.cache = Some(cache);
        self.reencode(reencode, logits)
    }

    /// Row `row` is done; the last running row moves into its place.
    pub(crate) fn remove_row(&mut self, row: usize) {
        let last = self.starts.len() - 1;
        if row != last {
            self.cache
                .as_mut()
                .expect("a running row has a cache")
                .move_row(last, row);
        }
        self.starts.swap_remove(row);
    }

    /// One forward pass; the last position's logits `[rows, vocab]` in f32, on the device.
    fn last_logits(
        &self,
        tokens: Tensor<2, Int>,
        positions: &Tensor<2, Int>,
        mask: Option<&Tensor<4, Bool>>,
        cache: &mut KvCache,
    ) -> Tensor<2> {
        let [rows, new] = tokens.dims();
        let hidden = self.model.model.forward(tokens, positions, mask, Some(cache));
        let [_, _, d] = hidden.dims();
        let last = hidden.narrow(1, new - 1, 1).reshape([rows, d]);
        let mut logits = last.matmul(self.head.clone()).cast(FloatDType::F32);
        if let Some((group, vocab)) = &self.vocab_split {
            // Every rank of the group gets the whole rows, so all of them draw the same tokens
            // and run the same next pass.
            let split = TensorSplit {
                dims: vec![rows, *vocab],
                axis: 1,
                group: group.clone(),
            };
            logits = tp_gather(logits, split);
        }
        self.model.cap_logits(logits)
    }
}
