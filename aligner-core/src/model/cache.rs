//! The key/value cache used while decoding: allocated once, written in place.
//!
//! Rows are sequences (or engine slots); positions along the third axis are written from a
//! shared cursor (`len`). A forward pass over fewer rows than the cache holds uses the first
//! rows only, so an engine can shrink its decode batch without reallocating. The slot
//! operations (`copy_row_block`, `move_row`, `shift_left`) let a continuous-batching engine
//! put a new sequence into a freed row and keep the cursor inside the buffers.

use std::ops::Range;

use burn::tensor::{Device, Tensor};

use crate::config::LlamaConfig;

/// Keys and values of one layer: `[rows, kv_heads, capacity, head_dim]`, filled up to `len`.
/// Attention reads the positions from `window` on.
#[derive(Debug, Clone)]
pub struct LayerCache {
    keys: Tensor<4>,
    values: Tensor<4>,
    len: usize,
    window: usize,
}

/// Moving a buffer out before `slice_assign` lets the backend write in place.
fn assign(buffer: &mut Tensor<4>, slot: [Range<usize>; 4], value: Tensor<4>) {
    let placeholder = Tensor::empty([0, 0, 0, 0], &value.device());
    *buffer = std::mem::replace(buffer, placeholder).slice_assign(slot, value);
}

impl LayerCache {
    /// Writes `k, v: [batch, kv_heads, new, head_dim]` into the first `batch` rows after the
    /// cached positions and returns those rows' keys and values from the window start on.
    pub fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let [batch, kv_heads, new, head_dim] = k.dims();
        let [rows, _, capacity, _] = self.keys.dims();
        let end = self.len + new;
        assert!(
            end <= capacity && batch <= rows,
            "KV cache overflow: {batch} rows × {end} positions into {rows} × {capacity}"
        );
        let slot = [0..batch, 0..kv_heads, self.len..end, 0..head_dim];
        assign(&mut self.keys, slot.clone(), k);
        assign(&mut self.values, slot, v);
        self.len = end;
        let view = |t: &Tensor<4>| {
            let t = t.clone().narrow(2, self.window, end - self.window);
            if batch < rows { t.narrow(0, 0, batch) } else { t }
        };
        (view(&self.keys), view(&self.values))
    }

    fn for_each_buffer(&mut self, mut f: impl FnMut(&mut Tensor<4>)) {
        f(&mut self.keys);
        f(&mut self.values);
    }
}

/// One [`LayerCache`] per decoder layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
}

impl KvCache {
    /// Zeroed buffers for `rows` sequences of at most `capacity` positions, in the type the
    /// model computes in (`config.precision`).
    pub fn new(config: &LlamaConfig, rows: usize, capacity: usize, device: &Device) -> Self {
        let shape = [rows, config.num_kv_heads(), capacity, config.head_dim()];
        let dtype = config.precision.float_dtype();
        let zeros = || Tensor::<4>::zeros(shape, device).cast(dtype);
        let layer = || LayerCache {
            keys: zeros(),
            values: zeros(),
            len: 0,
            window: 0,
        };
        Self {
            layers: (0..config.num_hidden_layers).map(|_| layer()).collect(),
        }
    }

    /// Positions written so far (the cursor the next forward pass writes at).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len)
    }

    /// True before the first forward pass.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions the buffers can hold.
    pub fn capacity(&self) -> usize {
        self.layers.first().map_or(0, |l| l.keys.dims()[2])
    }

    /// Rows (sequences) the buffers can hold.
    pub fn rows(&self) -> usize {
        self.layers.first().map_or(0, |l| l.keys.dims()[0])
    }

    /// Moves the cursor. Positions before it that no sequence wrote hold stale values, which
    /// callers hide with the attention mask.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity(),
            "cursor {len} past capacity {}",
            self.capacity()
        );
        for layer in &mut self.layers {
            layer.len = len;
        }
    }

    /// Makes attention read positions `start..` only (the keys before it belong to no running
    /// sequence), so the next forward pass sees `len + new - start` keys.
    pub fn set_window_start(&mut self, start: usize) {
        assert!(
            start <= self.len(),
            "window start {start} past cursor {}",
            self.len()
        );
        for layer in &mut self.layers {
            layer.window = start;
        }
    }

    /// Copies every written position of `src`'s row `src_row` into row `dst_row` so that it
    /// ends just before this cache's cursor (the block lands at `len - src.len() .. len`).
    pub fn copy_row_block(&mut self, src: &KvCache, src_row: usize, dst_row: usize) {
        let (block, end) = (src.len(), self.len());
        assert!(
            block <= end,
            "a {block}-position block does not fit before cursor {end}"
        );
        self.copy_positions(src, src_row, 0..block, dst_row, end - block);
    }

    /// Copies positions `from` of `src`'s row `src_row` into row `dst_row` from position `at`
    /// on (the cursor does not move): to keep a finished sequence's keys and values, or to put
    /// them back for a request that continues it.
    pub fn copy_positions(
        &mut self,
        src: &KvCache,
        src_row: usize,
        from: Range<usize>,
        dst_row: usize,
        at: usize,
    ) {
        let n = from.len();
        assert!(
            at + n <= self.capacity() && from.end <= src.capacity(),
            "positions {from:?} do not fit at {at}..{} of {}",
            at + n,
            self.capacity()
        );
        for (dst, src) in self.layers.iter_mut().zip(&src.layers) {
            let [_, heads, _, dim] = dst.keys.dims();
            let slot = [dst_row..dst_row + 1, 0..heads, at..at + n, 0..dim];
            // A narrowed view, consumed by the write: nothing keeps a reference to the source
            // buffer, which its own in-place writes need.
            let take = |t: &Tensor<4>| t.clone().narrow(0, src_row, 1).narrow(2, from.start, n);
            assign(&mut dst.keys, slot.clone(), take(&src.keys));
            assign(&mut dst.values, slot, take(&src.values));
        }
    }

    /// Copies row `from` over row `to` (written positions only).
    pub fn move_row(&mut self, from: usize, to: usize) {
        let len = self.len();
        for layer in &mut self.layers {
            layer.for_each_buffer(|buffer| {
                let [_, heads, _, dim] = buffer.dims();
                let row = buffer.clone().narrow(0, from, 1).narrow(2, 0, len);
                assign(buffer, [to..to + 1, 0..heads, 0..len, 0..dim], row);
            });
        }
    }

    /// Drops the first `n` positions of every row, moving the rest to the front; the cursor
    /// moves back by `n`.
    pub fn shift_left(&mut self, n: usize) {
        let len = self.len();
        assert!(n <= len, "cannot drop {n} of {len} positions");
        if n == 0 {
            return;
        }
        for layer in &mut self.layers {
            layer.for_each_buffer(|buffer| {
                let [rows, heads, _, dim] = buffer.dims();
                let kept = buffer.clone().narrow(2, n, len - n);
                assign(buffer, [0..rows, 0..heads, 0..len - n, 0..dim], kept);
            });
            layer.len = len - n;
            layer.window = layer.window.saturating_sub(n);
        }
    }

    /// A cache with the same rows and `capacity` positions holding this one's written
    /// positions (to grow the buffers when a run needs more room).
    pub fn with_capacity(&self, capacity: usize) -> Self {
        let len = self.len();
        assert!(
            len <= capacity,
            "{len} written positions do not fit in {capacity}"
        );
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                let grow = |t: &Tensor<4>| {
                    let [rows, heads, _, dim] = t.dims();
                    let fresh = Tensor::<4>::zeros([rows, heads, capacity, dim], &t.device())
                        .cast(burn::tensor::FloatDType::from(t.dtype()));
                    fresh.slice_assign([0..rows, 0..heads, 0..len, 0..dim], t.clone().narrow(2, 0, len))
                };
                LayerCache {
                    keys: grow(&layer.keys),
                    values: grow(&layer.values),
                    len,
                    window: layer.window,
                }
            })
            .collect();
        Self { layers }
    }
}
