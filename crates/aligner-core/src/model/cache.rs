//! The key/value cache used while decoding: allocated once, written in place.

use burn::tensor::{Device, Tensor};

use crate::config::LlamaConfig;

/// Keys and values of one layer: `[batch, kv_heads, capacity, head_dim]`, filled up to `len`.
#[derive(Debug, Clone)]
pub struct LayerCache {
    keys: Tensor<4>,
    values: Tensor<4>,
    len: usize,
}

impl LayerCache {
    /// Writes `k, v: [batch, kv_heads, new, head_dim]` after the cached positions and returns
    /// every key and value so far.
    pub fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> (Tensor<4>, Tensor<4>) {
        let [batch, kv_heads, new, head_dim] = k.dims();
        let end = self.len + new;
        let capacity = self.keys.dims()[2];
        assert!(
            end <= capacity,
            "KV cache overflow: {end} positions, capacity {capacity}"
        );
        let slot = [0..batch, 0..kv_heads, self.len..end, 0..head_dim];
        let device = k.device();
        let placeholder = || Tensor::empty([0, 0, 0, 0], &device);
        // Moving the buffers out lets the backend write in place instead of copying.
        self.keys = std::mem::replace(&mut self.keys, placeholder()).slice_assign(slot.clone(), k);
        self.values = std::mem::replace(&mut self.values, placeholder()).slice_assign(slot, v);
        self.len = end;
        (
            self.keys.clone().narrow(2, 0, end),
            self.values.clone().narrow(2, 0, end),
        )
    }
}

/// One [`LayerCache`] per decoder layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
}

impl KvCache {
    /// Zeroed buffers for `batch` sequences of at most `capacity` positions.
    pub fn new(config: &LlamaConfig, batch: usize, capacity: usize, device: &Device) -> Self {
        let shape = [batch, config.num_kv_heads(), capacity, config.head_dim()];
        let layer = || LayerCache {
            keys: Tensor::zeros(shape, device),
            values: Tensor::zeros(shape, device),
            len: 0,
        };
        Self {
            layers: (0..config.num_hidden_layers).map(|_| layer()).collect(),
        }
    }

    /// Positions cached so far.
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
}

impl KvCache {
    /// Keeps only the batch rows `rows` (in that order), dropping finished sequences.
    pub fn retain_rows(&mut self, rows: &[usize]) {
        let Some(first) = self.layers.first() else {
            return;
        };
        let device = first.keys.device();
        let index = Tensor::<1, burn::tensor::Int>::from_data(
            burn::tensor::TensorData::new(rows.iter().map(|&r| r as i64).collect::<Vec<_>>(), [rows.len()]),
            &device,
        );
        for layer in &mut self.layers {
            layer.keys = layer.keys.clone().select(0, index.clone());
            layer.values = layer.values.clone().select(0, index.clone());
        }
    }
}
