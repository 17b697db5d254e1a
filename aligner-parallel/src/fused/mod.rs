//! Fused CPU ops with their own backward passes: the vocabulary projection + log-softmax +
//! gather of [`fused_token_logprobs`], the grouped-query attention of [`fused_attention`], the
//! SwiGLU of [`fused_swiglu`] and the RMS norm of [`fused_rms_norm`].
//!
//! Composed from Burn tensor ops, each of these is a dozen autodiff nodes: exp, max, sub, sum,
//! log, gather, mask and div, each allocating a full-size temporary and recomputing `exp` in its
//! backward. Here each is one node whose forward keeps just what the backward needs (the
//! softmax rows, or per-row `logsumexp` for attention) and whose backward is written out by
//! hand. They are a Burn backend extension ([`FusedOps`]) implemented for the Flex CPU backend
//! and for autodiff over it; [`fused_available`] tells callers when to use them, and other
//! devices keep the composed ops.

mod autodiff;
#[cfg(feature = "cube")]
pub mod cube;
pub mod filter;
pub mod host;
pub mod infer;
pub mod panels;

use std::sync::Arc;

use burn::backend::{
    Backend, Flex, TensorMetadata, backend_extension, tensor::FloatTensor, tensor::IntTensor,
};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

pub use host::AttentionShape;

/// Fused ops of aligner, as a Burn backend extension: Flex, Cube (wgpu and CUDA, with the
/// `wgpu` / `cuda` features; see [`cube`]) and autodiff over each.
///
/// The default bodies compute on the host; the autodiff implementations add the backward.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait FusedOps: Backend {
    /// `log softmax(hidden · weight)[target]` per row: `hidden: [n, d]`, `weight: [d, vocab]`,
    /// `targets: [n]` → `[n]`.
    fn fused_token_logprobs(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let device = hidden.device();
        let (h, [_, d]) = host_floats::<Self, 2>(hidden);
        let (w, [_, v]) = host_floats::<Self, 2>(weight);
        let t = host_ints::<Self>(targets);
        let n = t.len();
        let (out, _) = host::token_logprobs_forward(&h, host::WeightRef::rows(&w), &t, (d, v), false);
        Self::float_from_data(TensorData::new(out, [n]), &device)
    }

    /// `softmax(q·kᵀ·scale, mask)·v` with `q: [b, heads, s, dim]`, `k, v: [b, kv_heads, keys,
    /// dim]`; `mask` is `[b, s, keys]` (`true` = hidden) or `None` for causal attention aligned
    /// to the last key.
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: Option<Arc<Vec<bool>>>,
        scale: f32,
    ) -> FloatTensor<Self> {
        let device = q.device();
        let (q, qs) = host_floats::<Self, 4>(q);
        let (k, ks) = host_floats::<Self, 4>(k);
        let (v, _) = host_floats::<Self, 4>(v);
        let shape = attention_shape(qs, ks);
        let (out, _) = host::attention_forward(&q, &k, &v, mask.as_deref().map(Vec::as_slice), shape, scale);
        Self::float_from_data(TensorData::new(out, qs), &device)
    }

    /// [`FusedOps::fused_attention`], causal, aligned to the last key. The Cube backends run
    /// their flash-attention kernels; the default computes on the host.
    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        Self::fused_attention(q, k, v, None, scale)
    }

    /// [`FusedOps::fused_attention`] with the mask as a tensor on the device: `hidden` is
    /// `[b, s, keys]`, nonzero = hidden. The Cube backends run their flash-attention kernels;
    /// the default reads the mask back and computes on the host.
    fn fused_masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        let (hidden, _) = host_floats::<Self, 3>(hidden);
        let mask = hidden.iter().map(|&h| h != 0.0).collect();
        Self::fused_attention(q, k, v, Some(Arc::new(mask)), scale)
    }

    /// `silu(gate) · up` elementwise (tensors of one shape): the SwiGLU of a Llama MLP.
    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let device = gate.device();
        let ((g, dims), (u, _)) = (host_values::<Self>(gate), host_values::<Self>(up));
        Self::float_from_data(TensorData::new(host::swiglu_forward(&g, &u), dims), &device)
    }

    /// Rotary embedding (rotate-half): `x · cos + rotate_half(x) · sin` with `x: [b, heads, s,
    /// dim]` and `cos, sin: [b or 1, 1, s, dim]`, differentiable in `x` (the angles are
    /// constants). The default body composes the backend's own ops, so autodiff over any
    /// backend differentiates it; the Cube backend runs a kernel.
    fn fused_rope(x: FloatTensor<Self>, cos: FloatTensor<Self>, sin: FloatTensor<Self>) -> FloatTensor<Self> {
        composed_rope::<Self>(x, cos, sin)
    }

    /// Sampling weights of `logits: [rows, vocab]` after each row's temperature, top-k and
    /// top-p, with `params: [rows, 3]` holding `1/temperature`, `top_k` (0 = off) and `top_p`
    /// (1 = off): `exp((l − max) · inv_t)` for the tokens kept, 0 for the others, f32
    /// ([`filter`]). `with_top_k` / `with_top_p`: whether any row uses the filter (a kernel
    /// leaves out the searches no row needs). The Cube backends run one kernel; the default
    /// computes on the host. Not differentiable.
    fn fused_sampling_weights(
        logits: FloatTensor<Self>,
        params: FloatTensor<Self>,
        with_top_k: bool,
        with_top_p: bool,
    ) -> FloatTensor<Self> {
        let _ = (with_top_k, with_top_p);
        let device = logits.device();
        let (logits, [rows, vocab]) = host_floats::<Self, 2>(logits);
        let (params, _) = host_floats::<Self, 2>(params);
        let weights = filter::sampling_weights(&logits, &params, vocab);
        Self::float_from_data(TensorData::new(weights, [rows, vocab]), &device)
    }

    /// RMS normalisation over the last axis: `x · gamma / √(mean(x²) + eps)`.
    fn fused_rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        let device = x.device();
        let ((x, dims), (w, _)) = (host_values::<Self>(x), host_values::<Self>(gamma));
        let (y, _) = host::rms_norm_forward(&x, &w, eps);
        Self::float_from_data(TensorData::new(y, dims), &device)
    }
}

impl FusedOps for Flex {}

/// [`FusedOps::fused_rope`] from the backend's slice, concatenation and arithmetic ops.
fn composed_rope<B: Backend>(x: FloatTensor<B>, cos: FloatTensor<B>, sin: FloatTensor<B>) -> FloatTensor<B> {
    use burn::tensor::Slice;
    let dim = x.shape()[3];
    let half = dim / 2;
    let all = Slice {
        start: 0,
        end: None,
        step: 1,
    };
    let part = |start: usize, end: usize| Slice {
        start: start as isize,
        end: Some(end as isize),
        step: 1,
    };
    let first = B::float_slice(x.clone(), &[all, all, all, part(0, half)]);
    let second = B::float_slice(x.clone(), &[all, all, all, part(half, dim)]);
    let rotated = B::float_cat(vec![B::float_neg(second), first], 3);
    B::float_add(B::float_mul(x, cos), B::float_mul(rotated, sin))
}

/// Whether all the fused ops, attention included, run natively on `device` (the Flex CPU
/// backend, with or without autodiff).
pub fn fused_available(device: &Device) -> bool {
    // Devices print as `Flex` or `Autodiff { .. Flex .. }`; the enum is behind cargo features
    // that vary by build, so its name is the stable thing to test.
    format!("{device:?}").contains("Flex")
}

/// Whether `device` is one of Burn's Cube devices (wgpu, CUDA), where the token log-probs,
/// RMS norm and SwiGLU run as aligner's CubeCL kernels ([`cube`]).
pub fn cube_kernels_available(device: &Device) -> bool {
    cfg!(feature = "cube") && format!("{device:?}").contains("Cube(")
}

/// [`FusedOps::fused_token_logprobs`] on tensors: `hidden: [n, d]`, `weight: [d, vocab]`,
/// `targets: [n]` → `[n]`, differentiable in `hidden` and `weight`.
pub fn fused_token_logprobs(hidden: Tensor<2>, weight: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    use burn::backend::Dispatch;
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_token_logprobs(
        hidden.into_dispatch(),
        weight.into_dispatch(),
        targets.into_dispatch(),
    ))
}

/// [`FusedOps::fused_swiglu`] on tensors: `silu(gate) · up`, differentiable in both.
pub fn fused_swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    use burn::backend::Dispatch;
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

/// [`FusedOps::fused_rms_norm`] on tensors: `x: [.., d]`, `gamma: [d]`; differentiable in both.
pub fn fused_rms_norm<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, eps: f64) -> Tensor<D> {
    use burn::backend::Dispatch;
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_rms_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        eps as f32,
    ))
}

/// [`FusedOps::fused_rope`] on tensors: `x: [b, heads, s, dim]`, `cos, sin: [b or 1, 1, s,
/// dim]`; differentiable in `x`.
pub fn fused_rope(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Tensor<4> {
    use burn::backend::Dispatch;
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_rope(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
    ))
}

/// [`FusedOps::fused_attention`] on tensors, scale `1/√dim`; `mask` is `[b, 1, s, keys]` as
/// the model builds it (`true` = hidden). Differentiable in `q`, `k` and `v`.
pub fn fused_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<&Tensor<4, Bool>>,
) -> Tensor<4> {
    use burn::backend::Dispatch;
    let scale = 1.0 / (q.dims()[3] as f32).sqrt();
    let mask = mask.map(|m| {
        let values: Vec<bool> = m
            .to_data()
            .convert::<bool>()
            .try_into_vec::<bool>()
            .expect("a bool mask reads back as bools");
        Arc::new(values)
    });
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        mask,
        scale,
    ))
}

/// Attention through the device's own kernels (flash attention on Cube devices), scale
/// `1/√dim`: causal aligned to the last key without `mask`, else `mask: [b, 1, s, keys]`
/// (`true` = hidden) stays on the device. Differentiable in `q`, `k` and `v`.
pub fn flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<&Tensor<4, Bool>>,
) -> Tensor<4> {
    use burn::backend::Dispatch;
    let scale = 1.0 / (q.dims()[3] as f32).sqrt();
    let out = match mask {
        None => <Dispatch as FusedOps>::fused_causal_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            scale,
        ),
        Some(mask) => {
            let [b, _, s, keys] = mask.dims();
            let hidden = mask.clone().reshape([b, s, keys]).float();
            <Dispatch as FusedOps>::fused_masked_attention(
                q.into_dispatch(),
                k.into_dispatch(),
                v.into_dispatch(),
                hidden.into_dispatch(),
                scale,
            )
        }
    };
    Tensor::from_dispatch(out)
}

/// [`FusedOps::fused_sampling_weights`] on tensors: `logits: [rows, vocab]`, `params: [rows,
/// 3]` (`1/temperature`, `top_k`, `top_p` per row, as `params_host` holds them) → f32 weights
/// `[rows, vocab]`.
pub fn sampling_weights(logits: Tensor<2>, params_host: &[f32]) -> Tensor<2> {
    use burn::backend::Dispatch;
    let [rows, vocab] = logits.dims();
    let rows_params = || params_host.chunks(filter::FILTER_PARAMS);
    let with_top_k = rows_params().any(|p| p[1] >= 1.0 && (p[1] as usize) < vocab);
    let with_top_p = rows_params().any(|p| p[2] < 1.0);
    let params = Tensor::<2>::from_data(
        TensorData::new(params_host.to_vec(), [rows, filter::FILTER_PARAMS]),
        &logits.device(),
    );
    Tensor::from_dispatch(<Dispatch as FusedOps>::fused_sampling_weights(
        logits.into_dispatch(),
        params.into_dispatch(),
        with_top_k,
        with_top_p,
    ))
}

static BURN_ATTENTION: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes the model use Burn's composed attention on Cube devices instead of aligner's
/// flash-attention kernels (`aligner bench --attention burn`, to measure one against the
/// other on a GPU).
pub fn use_burn_attention(yes: bool) {
    BURN_ATTENTION.store(yes, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the model runs aligner's flash-attention kernels on `device` (a Cube device,
/// unless [`use_burn_attention`] asked for Burn's).
pub fn flash_attention_available(device: &Device) -> bool {
    cube_kernels_available(device) && !BURN_ATTENTION.load(std::sync::atomic::Ordering::Relaxed)
}

fn attention_shape(q: [usize; 4], k: [usize; 4]) -> AttentionShape {
    assert!(
        k[1] > 0 && q[1].is_multiple_of(k[1]),
        "query heads {} must be a multiple of KV heads {}",
        q[1],
        k[1]
    );
    AttentionShape {
        batch: q[0],
        heads: q[1],
        kv_heads: k[1],
        queries: q[2],
        keys: k[2],
        dim: q[3],
    }
}

/// Waits for a backend future; CPU backends resolve at once.
fn ready<T>(future: impl std::future::Future<Output = T>) -> T {
    let mut future = std::pin::pin!(future);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(value) = future.as_mut().poll(&mut cx) {
            return value;
        }
        std::thread::yield_now();
    }
}

/// A float tensor's values in row-major order, and its shape.
pub(crate) fn host_values<B: Backend>(tensor: FloatTensor<B>) -> (Vec<f32>, Vec<usize>) {
    let data = ready(B::float_into_data(tensor)).expect("reading a CPU tensor cannot fail");
    let dims = data.shape().to_vec();
    let values = data
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 after convert");
    (values, dims)
}

/// [`host_values`] of a tensor of known rank `D`.
fn host_floats<B: Backend, const D: usize>(tensor: FloatTensor<B>) -> (Vec<f32>, [usize; D]) {
    let (values, dims) = host_values::<B>(tensor);
    let dims = dims
        .try_into()
        .unwrap_or_else(|_| panic!("expected a tensor of rank {D}"));
    (values, dims)
}

pub(crate) fn host_ints<B: Backend>(tensor: IntTensor<B>) -> Vec<i64> {
    let data = ready(B::int_into_data(tensor)).expect("reading a CPU tensor cannot fail");
    data.convert::<i64>()
        .try_into_vec::<i64>()
        .expect("i64 after convert")
}
