//! Grouped-query self-attention with rotary embeddings and an optional KV cache; query/key
//! norms (Qwen3's and Gemma 3's per head, OLMo 2's over the whole projection), a sliding window
//! (Mistral, Qwen, Gemma), Gemma's query pre-scale and Gemma 2's score soft-capping where the
//! config asks for them.

use burn::module::Module;
use burn::nn::LinearConfig;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Int, Tensor};

use super::cache::LayerCache;
use super::lora::LoraLinear;
use super::norm::RmsNorm;
use super::rope::RotaryAngles;
use crate::config::{LlamaConfig, QkNorm};

/// `softmax(QKᵀ/√d + mask)·V` over `n_heads` query heads sharing `n_kv_heads` key/value heads.
#[derive(Module, Debug)]
pub struct Attention {
    /// The query, key and value projections: `q_proj`, `k_proj`, `v_proj`, or Phi-3's one
    /// `qkv_proj` whose output columns are the queries, keys and values in turn (see
    /// [`Attention::projection_names`]).
    pub qkv: Vec<LoraLinear>,
    pub o_proj: LoraLinear,
    /// RMSNorm of the queries / keys before RoPE: over each head (Qwen3's `q_norm` / `k_norm`,
    /// `head_dim` weights) or over the whole projection (OLMo 2's).
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Sliding window: a query sees itself and the `window - 1` keys before it.
    #[module(skip)]
    pub window: Option<usize>,
    /// A factor on the queries that turns the kernels' `head_dim^-½` score scale into the
    /// config's (Gemma's `query_pre_attn_scalar^-½`); `None` when they agree.
    #[module(skip)]
    pub query_scale: Option<f64>,
    /// Gemma 2's `attn_logit_softcapping`: scores become `cap · tanh(score / cap)`.
    #[module(skip)]
    pub softcap: Option<f64>,
}

impl Attention {
    /// Layer `index`'s attention (its sliding window, if any, comes from the config).
    pub fn new(config: &LlamaConfig, index: usize, device: &Device) -> Self {
        let hidden = config.hidden_size;
        let head_dim = config.head_dim();
        let (n_heads, n_kv_heads) = (config.num_attention_heads, config.num_kv_heads());
        let qkv_bias = config.qkv_bias();
        let proj =
            |d_in, d_out, bias| LoraLinear::from(LinearConfig::new(d_in, d_out).with_bias(bias).init(device));
        let qk_norm = |heads: usize| {
            let width = match config.qk_norm() {
                QkNorm::None => return None,
                QkNorm::PerHead => head_dim,
                QkNorm::Whole => heads * head_dim,
            };
            Some(super::layer::rms_norm(config, width, device))
        };
        let (q_width, kv_width) = (n_heads * head_dim, n_kv_heads * head_dim);
        let qkv = if config.fused_projections() {
            vec![proj(hidden, q_width + 2 * kv_width, qkv_bias)]
        } else {
            vec![
                proj(hidden, q_width, qkv_bias),
                proj(hidden, kv_width, qkv_bias),
                proj(hidden, kv_width, qkv_bias),
            ]
        };
        Self {
            qkv,
            o_proj: proj(n_heads * head_dim, hidden, config.o_bias()),
            q_norm: qk_norm(n_heads),
            k_norm: qk_norm(n_kv_heads),
            n_heads,
            n_kv_heads,
            head_dim,
            window: config
                .attention_windows()
                .ok()
                .and_then(|w| w.get(index).copied().flatten()),
            query_scale: config.attention_scale().ok().and_then(|scale| {
                let factor = scale * (head_dim as f64).sqrt();
                ((factor - 1.0).abs() > 1e-12).then_some(factor)
            }),
            softcap: config.attention_softcap().ok().flatten(),
        }
    }

    /// HF's names of [`Attention::qkv`]'s projections, in order.
    pub fn projection_names(&self) -> &'static [&'static str] {
        if self.qkv.len() == 1 {
            &["qkv_proj"]
        } else {
            &["q_proj", "k_proj", "v_proj"]
        }
    }

    /// The queries, keys and values of `x`, `[batch, seq, heads · head_dim]` each.
    fn project(&self, x: Tensor<3>) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
        let (q_width, kv_width) = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim);
        match self.qkv.as_slice() {
            [fused] => {
                let y = fused.forward(x);
                (
                    y.clone().narrow(2, 0, q_width),
                    y.clone().narrow(2, q_width, kv_width),
                    y.narrow(2, q_width + kv_width, kv_width),
                )
            }
            [q, k, v] => (q.forward(x.clone()), k.forward(x.clone()), v.forward(x)),
            other => unreachable!("{} q/k/v projections", other.len()),
        }
    }

    /// `x: [batch, seq, hidden]` → `[batch, seq, hidden]`.
    ///
    /// `mask` (`[batch, 1, seq, keys]`, `true` = masked out) is needed only when keys must be
    /// hidden beyond causality (left padding); without it attention is causal, aligned to the
    /// last key, which is exact for right-padded batches and for decoding with a cache.
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RotaryAngles,
        mask: Option<&Tensor<4, Bool>>,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let [batch, seq, _] = x.dims();
        let device = x.device();
        let (q, k, v) = self.project(x);
        // This rank's heads: all of them, or under tensor parallel its block of them.
        let (n_heads, n_kv_heads) = (q.dims()[2] / self.head_dim, k.dims()[2] / self.head_dim);
        let group = match self.qkv.as_slice() {
            [q_proj, ..] => super::tensor_split(&q_proj.base.weight).map(|split| split.group),
            [] => None,
        };
        let heads = |mut h: Tensor<3>, n: usize, norm: Option<&RmsNorm>| {
            let hd = self.head_dim;
            if let Some(norm) = norm {
                h = if norm.width() == hd {
                    // Each head normalised on its own: [batch, seq·heads, head_dim].
                    let per_head = h.reshape([batch, seq * n, hd]);
                    super::layer::norm_in_group(norm, per_head, group.as_ref()).reshape([batch, seq, n * hd])
                } else {
                    super::layer::norm(norm, h)
                };
            }
            h.reshape([batch, seq, n, hd]).swap_dims(1, 2)
        };
        let mut q = rope.apply(heads(q, n_heads, self.q_norm.as_ref()));
        if let Some(factor) = self.query_scale {
            q = q.mul_scalar(factor);
        }
        let k = rope.apply(heads(k, n_kv_heads, self.k_norm.as_ref()));
        let v = heads(v, n_kv_heads, None);
        let (k, v) = match cache {
            Some(cache) => cache.append(k, v),
            None => (k, v),
        };
        let windowed = self
            .window
            .and_then(|w| window_mask(batch, seq, k.dims()[2], w, mask, &device));
        let out = self.attend(q, k, v, windowed.as_ref().or(mask));
        let out = out.swap_dims(1, 2).reshape([batch, seq, n_heads * self.head_dim]);
        self.o_proj.forward(out)
    }

    fn attend(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Option<&Tensor<4, Bool>>) -> Tensor<4> {
        let [batch, _, seq, _] = q.dims();
        let keys = k.dims()[2];
        let options = AttentionModuleOptions {
            scale: None,
            softcap: self.softcap,
            is_causal: mask.is_none(),
        };
        // aligner's kernels do not soft-cap: capped models take Burn's attention (composed
        // ops under autodiff, Flex's kernel in inference).
        let capped = self.softcap.is_some();
        // Training on CPU: aligner's fused op (one autodiff node, hand-written backward).
        if !capped && q.is_autodiff() && aligner_parallel::fused_available(&q.device()) {
            return aligner_parallel::fused_attention(q, k, v, mask);
        }
        // GPUs: aligner's flash-attention kernels (KV heads shared, no score matrix; the mask
        // stays on the device), training and inference alike.
        if !capped && aligner_parallel::flash_attention_available(&q.device()) {
            return aligner_parallel::flash_attention(q, k, v, mask);
        }
        // Flex's inference kernel shares KV heads itself and broadcasts the mask; Burn's
        // generic attention (Cube devices when asked for it) needs both materialised to full
        // size.
        let flex_inference = !q.is_autodiff() && aligner_parallel::fused_available(&q.device());
        let (k, v, mask) = if !flex_inference {
            let full = [batch, q.dims()[1], seq, keys];
            (
                self.repeat_kv(k),
                self.repeat_kv(v),
                mask.map(|m| m.clone().expand(full)),
            )
        } else {
            (k, v, mask.cloned())
        };
        attention(q, k, v, mask, None, options)
    }

    /// `[b, kv_heads, s, d]` → `[b, heads, s, d]`, each KV head serving consecutive query heads.
    fn repeat_kv(&self, x: Tensor<4>) -> Tensor<4> {
        // The ratio of all heads is that of any rank's block of them.
        let groups = self.n_heads / self.n_kv_heads;
        if groups == 1 {
            return x;
        }
        let [b, kv, s, d] = x.dims();
        x.unsqueeze_dim::<5>(2)
            .expand([b, kv, groups, s, d])
            .reshape([b, kv * groups, s, d])
    }
}

/// The attention mask (`true` = hidden) of `seq` queries, the last of `keys` positions, under a
/// sliding `window`, combined with `mask` (causal when none): `None` when the window hides no
/// key (every query is within `window` of key 0). Positions are cache indices, as transformers
/// counts them.
fn window_mask(
    batch: usize,
    seq: usize,
    keys: usize,
    window: usize,
    mask: Option<&Tensor<4, Bool>>,
    device: &Device,
) -> Option<Tensor<4, Bool>> {
    if keys <= window {
        return None;
    }
    let first = (keys - seq) as i64;
    let q = Tensor::<1, Int>::arange(first..keys as i64, device).reshape([seq, 1]);
    let k = Tensor::<1, Int>::arange(0..keys as i64, device).reshape([1, keys]);
    let diff = q.expand([seq, keys]) - k.expand([seq, keys]);
    // Hidden: a future key (q - k < 0) or one `window` or more behind.
    let hidden = diff
        .clone()
        .lower_elem(0)
        .bool_or(diff.greater_equal_elem(window as i64))
        .reshape([1, 1, seq, keys])
        .expand([batch, 1, seq, keys]);
    Some(match mask {
        Some(m) => hidden.bool_or(m.clone()),
        None => hidden,
    })
}
