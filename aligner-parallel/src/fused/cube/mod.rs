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
//! - Attention: the model composes Burn's ops on Cube devices (Burn's matmuls are autotuned
//!   there); [`FusedOps::fused_attention`] still works, through the host.

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
    let dx = empty(&x, x.shape(), x.dtype);
    let rows_share = empty(&x, [rows, width], x.dtype);
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
    (dx, d_gamma)
}

/// `log softmax(hidden · weight)[target]` per row, and each row's logsumexp (f32).
pub fn token_logprobs_forward(
    hidden: CubeTensor,
    weight: CubeTensor,
    targets: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let logits = into_contiguous(Cube::float_matmul(hidden, weight));
    let (rows, vocab) = last_dim(&logits);
    let targets = targets_i32(targets);
    let out = empty(&logits, [rows], logits.dtype);
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
    let grad = into_contiguous(grad);
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

impl FusedOps for Cube {
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
