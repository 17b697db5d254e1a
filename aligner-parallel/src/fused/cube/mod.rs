//! The fused ops on Burn's Cube backend (wgpu, CUDA): [`kernels`] in CubeCL, launched on the
//! tensors' own device, and their backward passes as autodiff nodes of `Autodiff<Cube>`.
//!
//! - token log-probs: the chunk's logits come from Burn's matmul; one kernel takes each row's
//!   logsumexp and target log-prob, and only the `[rows]` logsumexp is kept. The backward
//!   recomputes the chunk's logits, turns them in place into `grad · (onehot − softmax)` and
//!   multiplies back, so no `[rows, vocab]` tensor outlives the op.
//! - RMS norm: one kernel per direction, each row reduced in shared memory; the forward keeps
//!   `1/rms` per row for the backward.
//! - SwiGLU: one elementwise kernel forward, one computing both input gradients.
//! - Rotary embedding: one elementwise kernel; its backward is the same kernel applying the
//!   transposed rotation.
//! - Attention: flash-attention-style kernels ([`attention`]): tiles of keys in shared memory,
//!   an online softmax per query row, GQA without repeating the KV heads, the logsumexp kept
//!   for a backward of two kernels (per query row; per key row). [`FusedOps::fused_attention`]
//!   (the host's mask form) still works, through the host.

pub mod attention;
pub mod filter;
pub mod kernels;

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::backend::{
    Autodiff, Cube, DType, IntDType, TensorMetadata, tensor::FloatTensor, tensor::IntTensor,
};
use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;
use cubecl::server::CubeCountSelection;

use super::FusedOps;
use kernels::ROW_THREADS;

/// A new contiguous tensor on `like`'s device.
fn empty(like: &CubeTensor, shape: impl Into<Shape>, dtype: DType) -> CubeTensor {
    empty_device_dtype(like.client.clone(), like.device.clone(), shape.into(), dtype)
}

/// One cube of [`ROW_THREADS`] units per row.
fn per_row(like: &CubeTensor, rows: usize) -> (CubeCount, CubeDim) {
    (
        CubeCountSelection::new(&like.client, rows as u32).cube_count(),
        CubeDim::new_1d(ROW_THREADS),
    )
}

/// One unit per element.
fn per_element(like: &CubeTensor, elements: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&like.client, elements);
    (calculate_cube_count_elemwise(&like.client, elements, dim), dim)
}

fn last_dim(t: &CubeTensor) -> (usize, usize) {
    let shape = t.shape();
    let width = shape[shape.num_dims() - 1];
    (t.shape().num_elements() / width.max(1), width)
}

/// Targets as contiguous i32, the kernels' index type.
fn targets_i32(targets: CubeTensor) -> CubeTensor {
    into_contiguous(Cube::int_cast(targets, IntDType::I32))
}

/// `silu(gate) · up`.
pub fn swiglu_forward(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
    let (gate, up) = (into_contiguous(gate), into_contiguous(up));
    let out = empty(&gate, gate.shape(), gate.dtype);
    let (count, dim) = per_element(&gate, out.shape().num_elements());
    let dtype = dtype_to_storage_type(gate.dtype);
    kernels::swiglu_forward::launch(
        &gate.client.clone(),
        count,
        dim,
        gate.into_buffer_arg(),
        up.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        dtype,
    );
    out
}

/// `(d_gate, d_up)` of [`swiglu_forward`] for the output gradient `dy`.
pub fn swiglu_backward(gate: CubeTensor, up: CubeTensor, dy: CubeTensor) -> (CubeTensor, CubeTensor) {
    let (gate, up, dy) = (into_contiguous(gate), into_contiguous(up), into_contiguous(dy));
    let d_gate = empty(&gate, gate.shape(), gate.dtype);
    let d_up = empty(&gate, gate.shape(), gate.dtype);
    let (count, dim) = per_element(&gate, d_gate.shape().num_elements());
    let dtype = dtype_to_storage_type(gate.dtype);
    kernels::swiglu_backward::launch(
        &gate.client.clone(),
        count,
        dim,
        gate.into_buffer_arg(),
        up.into_buffer_arg(),
        dy.into_buffer_arg(),
        d_gate.clone().into_buffer_arg(),
        d_up.clone().into_buffer_arg(),
        dtype,
    );
    (d_gate, d_up)
}

/// Rotary embedding of `x: [batch, heads, seq, dim]` by `cos, sin: [1 or batch, 1, seq, dim]`
/// ([`kernels::rope`]); `transpose` applies the backward map to an output gradient.
pub fn rope(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, transpose: bool) -> CubeTensor {
    let (x, cos, sin) = (into_contiguous(x), into_contiguous(cos), into_contiguous(sin));
    let shape = x.shape();
    let (heads, seq, dim) = (shape[1], shape[2], shape[3]);
    let angle_batch = cos.shape()[0];
    let out = empty(&x, x.shape(), x.dtype);
    let (count, cube_dim) = per_element(&x, out.shape().num_elements());
    let dtype = dtype_to_storage_type(x.dtype);
    kernels::rope::launch(
        &x.client.clone(),
        count,
        cube_dim,
        x.into_buffer_arg(),
        cos.into_buffer_arg(),
        sin.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        dim,
        heads,
        seq,
        angle_batch,
        transpose,
        dtype,
    );
    out
}

/// Sampling weights of `logits: [rows, vocab]` under `params: [rows, 3]` ([`filter`]), f32;
/// the searches of a filter no row uses are left out.
pub fn sampling_weights(
    logits: CubeTensor,
    params: CubeTensor,
    with_top_k: bool,
    with_top_p: bool,
) -> CubeTensor {
    let logits = into_contiguous(logits);
    let params = into_contiguous(Cube::float_cast(params, burn::tensor::FloatDType::F32));
    let (rows, vocab) = last_dim(&logits);
    let weights = empty(&logits, [rows, vocab], DType::F32);
    let (count, dim) = per_row(&logits, rows);
    let dtype = dtype_to_storage_type(logits.dtype);
    filter::sampling_weights::launch(
        &logits.client.clone(),
        count,
        dim,
        logits.into_buffer_arg(),
        params.into_buffer_arg(),
        weights.clone().into_buffer_arg(),
        vocab,
        rows,
        with_top_k,
        with_top_p,
        usize::BITS - vocab.leading_zeros(),
        dtype,
    );
    weights
}

/// RMS norm over the last axis: `(y, inv)` with `inv: [rows]` f32, each row's `1/rms`.
pub fn rms_norm_forward(x: CubeTensor, gamma: CubeTensor, eps: f32) -> (CubeTensor, CubeTensor) {
    let (x, gamma) = (into_contiguous(x), into_contiguous(gamma));
    let (rows, width) = last_dim(&x);
    let y = empty(&x, x.shape(), x.dtype);
    let inv = empty(&x, [rows], DType::F32);
    let (count, dim) = per_row(&x, rows);
    let dtype = dtype_to_storage_type(x.dtype);
    kernels::rms_norm_rows::launch(
        &x.client.clone(),
        count,
        dim,
        x.into_buffer_arg(),
        gamma.into_buffer_arg(),
        y.clone().into_buffer_arg(),
        inv.clone().into_buffer_arg(),
        width,
        rows,
        eps,
        dtype,
    );
    (y, inv)
}

/// `(dx, d_gamma)` of [`rms_norm_forward`] for the output gradient `dy`.
pub fn rms_norm_backward(
    x: CubeTensor,
    gamma: CubeTensor,
    inv: CubeTensor,
    dy: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let (x, gamma, dy) = (into_contiguous(x), into_contiguous(gamma), into_contiguous(dy));
    let (rows, width) = last_dim(&x);
    let gamma_dtype = gamma.dtype.into();
    let dx = empty(&x, x.shape(), x.dtype);
    // Each row's share of dγ in f32, summed over the rows in f32.
    let rows_share = empty(&x, [rows, width], DType::F32);
    let (count, dim) = per_row(&x, rows);
    let dtype = dtype_to_storage_type(x.dtype);
    kernels::rms_norm_grad_rows::launch(
        &x.client.clone(),
        count,
        dim,
        x.into_buffer_arg(),
        gamma.into_buffer_arg(),
        inv.into_buffer_arg(),
        dy.into_buffer_arg(),
        dx.clone().into_buffer_arg(),
        rows_share.clone().into_buffer_arg(),
        width,
        rows,
        dtype,
    );
    let d_gamma = Cube::float_reshape(Cube::float_sum_dim(rows_share, 0), Shape::new([width]));
    let d_gamma = Cube::float_cast(d_gamma, gamma_dtype);
    (dx, d_gamma)
}

/// `log softmax(hidden · weight)[target]` per row, and each row's logsumexp, both f32 (the
/// logits are in the inputs' type; the reduction is f32).
pub fn token_logprobs_forward(
    hidden: CubeTensor,
    weight: CubeTensor,
    targets: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let logits = into_contiguous(Cube::float_matmul(hidden, weight));
    let (rows, vocab) = last_dim(&logits);
    let targets = targets_i32(targets);
    let out = empty(&logits, [rows], DType::F32);
    let lse = empty(&logits, [rows], DType::F32);
    let (count, dim) = per_row(&logits, rows);
    let dtype = dtype_to_storage_type(logits.dtype);
    kernels::logprob_rows::launch(
        &logits.client.clone(),
        count,
        dim,
        logits.into_buffer_arg(),
        targets.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        lse.clone().into_buffer_arg(),
        vocab,
        rows,
        dtype,
    );
    (out, lse)
}

/// `(d_hidden, d_weight)` of [`token_logprobs_forward`] for the output gradient `grad: [rows]`;
/// the logits are recomputed, then overwritten by their gradient.
pub fn token_logprobs_backward(
    hidden: CubeTensor,
    weight: CubeTensor,
    targets: CubeTensor,
    lse: CubeTensor,
    grad: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let logits = into_contiguous(Cube::float_matmul(hidden.clone(), weight.clone()));
    let (_, vocab) = last_dim(&logits);
    let targets = targets_i32(targets);
    let grad = into_contiguous(Cube::float_cast(grad, burn::tensor::FloatDType::F32));
    let (count, dim) = per_element(&logits, logits.shape().num_elements());
    let dtype = dtype_to_storage_type(logits.dtype);
    kernels::logprob_grad::launch(
        &logits.client.clone(),
        count,
        dim,
        logits.clone().into_buffer_arg(),
        targets.into_buffer_arg(),
        lse.into_buffer_arg(),
        grad.into_buffer_arg(),
        vocab,
        dtype,
    );
    let d_logits = logits;
    let d_hidden = Cube::float_matmul(d_logits.clone(), Cube::float_transpose(weight));
    let d_weight = Cube::float_matmul(Cube::float_transpose(hidden), d_logits);
    (d_hidden, d_weight)
}

/// `(heads, kv_heads, queries, keys, dim)` of `q: [b, heads, queries, dim]` and
/// `k: [b, kv_heads, keys, dim]`.
fn attention_dims(q: &CubeTensor, k: &CubeTensor) -> (usize, usize, usize, usize, usize) {
    let (qs, ks) = (q.shape(), k.shape());
    let (heads, kv_heads) = (qs[1], ks[1]);
    assert!(
        kv_heads > 0 && heads.is_multiple_of(kv_heads),
        "query heads {heads} must be a multiple of KV heads {kv_heads}"
    );
    assert!(qs[2] <= ks[2], "{} queries attend to only {} keys", qs[2], ks[2]);
    (heads, kv_heads, qs[2], ks[2], qs[3])
}

/// The mask as the kernels read it: f32 `[b, queries, keys]` (1 = hidden), or one unused
/// value when attention is causal.
fn mask_buffer(like: &CubeTensor, hidden: Option<CubeTensor>) -> CubeTensor {
    match hidden {
        Some(h) => into_contiguous(Cube::float_cast(h, burn::tensor::FloatDType::F32)),
        None => empty(like, [1], DType::F32),
    }
}

/// Flash attention forward ([`attention::attention_forward`]): `(out, lse)`, `lse` f32 per
/// query row.
pub fn attention_forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    hidden: Option<CubeTensor>,
    scale: f32,
) -> (CubeTensor, CubeTensor) {
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let (heads, kv_heads, queries, keys, dim) = attention_dims(&q, &k);
    let batch = q.shape()[0];
    let masked = hidden.is_some();
    let hidden = mask_buffer(&q, hidden);
    let out = empty(&q, q.shape(), q.dtype);
    let lse = empty(&q, [batch * heads * queries], DType::F32);
    let cubes = batch * heads * queries.div_ceil(attention::UNITS);
    let (count, cube_dim) = attention_launch(&q, cubes);
    let dtype = dtype_to_storage_type(q.dtype);
    attention::attention_forward::launch(
        &q.client.clone(),
        count,
        cube_dim,
        q.into_buffer_arg(),
        k.into_buffer_arg(),
        v.into_buffer_arg(),
        hidden.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        lse.clone().into_buffer_arg(),
        heads,
        kv_heads,
        queries,
        keys,
        cubes,
        scale,
        dim,
        attention::tile_rows(dim),
        attention::tile_rows(dim) * dim,
        masked,
        dtype,
    );
    (out, lse)
}

fn attention_launch(like: &CubeTensor, cubes: usize) -> (CubeCount, CubeDim) {
    (
        CubeCountSelection::new(&like.client, cubes as u32).cube_count(),
        CubeDim::new_1d(attention::UNITS as u32),
    )
}

/// `(dq, dk, dv)` of [`attention_forward`] for the output gradient `d_out`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    hidden: Option<CubeTensor>,
    out: CubeTensor,
    lse: CubeTensor,
    d_out: CubeTensor,
    scale: f32,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let d_out = into_contiguous(Cube::float_cast(d_out, q.dtype.into()));
    let (heads, kv_heads, queries, keys, dim) = attention_dims(&q, &k);
    let batch = q.shape()[0];
    let masked = hidden.is_some();
    let hidden = mask_buffer(&q, hidden);
    let dtype = dtype_to_storage_type(q.dtype);
    let dq = empty(&q, q.shape(), q.dtype);
    let delta = empty(&q, [batch * heads * queries], DType::F32);
    let cubes = batch * heads * queries.div_ceil(attention::UNITS);
    let (count, cube_dim) = attention_launch(&q, cubes);
    attention::attention_backward_q::launch(
        &q.client.clone(),
        count,
        cube_dim,
        q.clone().into_buffer_arg(),
        k.clone().into_buffer_arg(),
        v.clone().into_buffer_arg(),
        hidden.clone().into_buffer_arg(),
        into_contiguous(out).into_buffer_arg(),
        d_out.clone().into_buffer_arg(),
        lse.clone().into_buffer_arg(),
        dq.clone().into_buffer_arg(),
        delta.clone().into_buffer_arg(),
        heads,
        kv_heads,
        queries,
        keys,
        cubes,
        scale,
        dim,
        attention::tile_rows(dim),
        attention::tile_rows(dim) * dim,
        masked,
        dtype,
    );
    let dk = empty(&k, k.shape(), k.dtype);
    let dv = empty(&v, v.shape(), v.dtype);
    let cubes = batch * kv_heads * keys.div_ceil(attention::UNITS);
    let (count, cube_dim) = attention_launch(&q, cubes);
    attention::attention_backward_kv::launch(
        &q.client.clone(),
        count,
        cube_dim,
        q.into_buffer_arg(),
        k.into_buffer_arg(),
        v.into_buffer_arg(),
        hidden.into_buffer_arg(),
        d_out.into_buffer_arg(),
        lse.into_buffer_arg(),
        delta.into_buffer_arg(),
        dk.clone().into_buffer_arg(),
        dv.clone().into_buffer_arg(),
        heads,
        kv_heads,
        queries,
        keys,
        cubes,
        scale,
        dim,
        attention::tile_rows(dim),
        attention::tile_rows(dim) * dim,
        masked,
        dtype,
    );
    (dq, dk, dv)
}

impl FusedOps for Cube {
    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        attention_forward(q, k, v, None, scale).0
    }

    fn fused_masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        attention_forward(q, k, v, Some(hidden), scale).0
    }

    fn fused_token_logprobs(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        token_logprobs_forward(hidden, weight, targets).0
    }

    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu_forward(gate, up)
    }

    fn fused_rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        rms_norm_forward(x, gamma, eps).0
    }

    fn fused_rope(x: FloatTensor<Self>, cos: FloatTensor<Self>, sin: FloatTensor<Self>) -> FloatTensor<Self> {
        rope(x, cos, sin, false)
    }

    fn fused_sampling_weights(
        logits: FloatTensor<Self>,
        params: FloatTensor<Self>,
        with_top_k: bool,
        with_top_p: bool,
    ) -> FloatTensor<Self> {
        sampling_weights(logits, params, with_top_k, with_top_p)
    }
}

/// Registers `grad` for `node`, when that input tracks one.
fn register(grads: &mut Gradients, node: Option<burn::backend::autodiff::NodeId>, grad: CubeTensor) {
    if let Some(id) = node {
        grads.register::<Cube>(id, grad);
    }
}

#[derive(Debug)]
struct TokenLogprobs;

impl Backward<Cube, 2> for TokenLogprobs {
    /// hidden, weight, targets, logsumexp.
    type State = (CubeTensor, CubeTensor, CubeTensor, CubeTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [hidden_node, weight_node] = ops.parents;
        let grad = grads.consume::<Cube>(&ops.node);
        let (hidden, weight, targets, lse) = ops.state;
        let (d_hidden, d_weight) = token_logprobs_backward(hidden, weight, targets, lse, grad);
        register(grads, hidden_node.map(|n| n.id), d_hidden);
        register(grads, weight_node.map(|n| n.id), d_weight);
    }
}

#[derive(Debug)]
struct FlashAttention;

impl Backward<Cube, 3> for FlashAttention {
    /// q, k, v, the mask (when not causal), out, logsumexp, scale.
    type State = (
        CubeTensor,
        CubeTensor,
        CubeTensor,
        Option<CubeTensor>,
        CubeTensor,
        CubeTensor,
        f32,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [q_node, k_node, v_node] = ops.parents;
        let d_out = grads.consume::<Cube>(&ops.node);
        let (q, k, v, hidden, out, lse, scale) = ops.state;
        let (dq, dk, dv) = attention_backward(q, k, v, hidden, out, lse, d_out, scale);
        register(grads, q_node.map(|n| n.id), dq);
        register(grads, k_node.map(|n| n.id), dk);
        register(grads, v_node.map(|n| n.id), dv);
    }
}

/// The flash-attention forward as an autodiff node of `Autodiff<Cube>`.
fn tracked_attention<C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<Cube, C>>,
    k: FloatTensor<Autodiff<Cube, C>>,
    v: FloatTensor<Autodiff<Cube, C>>,
    hidden: Option<CubeTensor>,
    scale: f32,
) -> FloatTensor<Autodiff<Cube, C>> {
    let nodes = [q.node(), k.node(), v.node()];
    let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
    let (out, lse) = attention_forward(q.clone(), k.clone(), v.clone(), hidden.clone(), scale);
    match FlashAttention.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((q, k, v, hidden, out.clone(), lse, scale), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

#[derive(Debug)]
struct RmsNorm;

impl Backward<Cube, 2> for RmsNorm {
    /// x, gamma, 1/rms per row.
    type State = (CubeTensor, CubeTensor, CubeTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, gamma_node] = ops.parents;
        let dy = grads.consume::<Cube>(&ops.node);
        let (x, gamma, inv) = ops.state;
        let (dx, d_gamma) = rms_norm_backward(x, gamma, inv, dy);
        register(grads, x_node.map(|n| n.id), dx);
        register(grads, gamma_node.map(|n| n.id), d_gamma);
    }
}

#[derive(Debug)]
struct Swiglu;

impl Backward<Cube, 2> for Swiglu {
    /// gate, up.
    type State = (CubeTensor, CubeTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [gate_node, up_node] = ops.parents;
        let dy = grads.consume::<Cube>(&ops.node);
        let (gate, up) = ops.state;
        let (d_gate, d_up) = swiglu_backward(gate, up, dy);
        register(grads, gate_node.map(|n| n.id), d_gate);
        register(grads, up_node.map(|n| n.id), d_up);
    }
}

#[derive(Debug)]
struct Rope;

impl Backward<Cube, 1> for Rope {
    /// cos, sin (constants).
    type State = (CubeTensor, CubeTensor);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node] = ops.parents;
        let dy = grads.consume::<Cube>(&ops.node);
        let (cos, sin) = ops.state;
        register(grads, x_node.map(|n| n.id), rope(dy, cos, sin, true));
    }
}

impl<C: CheckpointStrategy> FusedOps for Autodiff<Cube, C> {
    fn fused_sampling_weights(
        logits: FloatTensor<Self>,
        params: FloatTensor<Self>,
        with_top_k: bool,
        with_top_p: bool,
    ) -> FloatTensor<Self> {
        // Sampling is not differentiated: the weights are a constant of the graph.
        use burn::backend::AutodiffBackend;
        Self::from_inner(sampling_weights(
            Self::inner(logits),
            Self::inner(params),
            with_top_k,
            with_top_p,
        ))
    }

    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        tracked_attention::<C>(q, k, v, None, scale)
    }

    fn fused_masked_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        hidden: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        tracked_attention::<C>(q, k, v, Some(hidden.into_primitive()), scale)
    }

    fn fused_rope(x: FloatTensor<Self>, cos: FloatTensor<Self>, sin: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [x.node()];
        let (x, cos, sin) = (x.into_primitive(), cos.into_primitive(), sin.into_primitive());
        let out = rope(x, cos.clone(), sin.clone(), false);
        match Rope.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((cos, sin), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn fused_token_logprobs(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let nodes = [hidden.node(), weight.node()];
        let (hidden, weight) = (hidden.into_primitive(), weight.into_primitive());
        // Cast once: the backward reuses the i32 targets (a no-op cast there).
        let targets = targets_i32(targets);
        let (out, lse) = token_logprobs_forward(hidden.clone(), weight.clone(), targets.clone());
        match TokenLogprobs.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((hidden, weight, targets, lse), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [gate.node(), up.node()];
        let (gate, up) = (gate.into_primitive(), up.into_primitive());
        let out = swiglu_forward(gate.clone(), up.clone());
        match Swiglu.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((gate, up), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn fused_rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        let nodes = [x.node(), gamma.node()];
        let (x, gamma) = (x.into_primitive(), gamma.into_primitive());
        let (y, inv) = rms_norm_forward(x.clone(), gamma.clone(), eps);
        match RmsNorm.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x, gamma, inv), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: Option<Arc<Vec<bool>>>,
        scale: f32,
    ) -> FloatTensor<Self> {
        super::autodiff::host_attention::<Cube, C>(q, k, v, mask, scale)
    }
}
