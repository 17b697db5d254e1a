//! The backward passes of the fused ops: one autodiff node per op, its state the host buffers
//! the hand-written gradient needs.

use std::sync::Arc;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::{Autodiff, Backend, Flex, TensorMetadata, tensor::FloatTensor, tensor::IntTensor};
use burn::tensor::{DType, TensorData};

use super::host::{self, AttentionShape, SoftmaxRows};
use super::{FusedOps, attention_shape, host_floats, host_ints, host_values};

/// Registers a gradient computed on the host for `node`, when that input tracks one.
fn register<B: Backend>(
    grads: &mut Gradients,
    node: Option<NodeId>,
    values: Vec<f32>,
    dims: Vec<usize>,
    device: &B::Device,
) {
    if let Some(id) = node {
        grads.register::<B>(id, B::float_from_data(TensorData::new(values, dims), device));
    }
}

/// The output projection `[d, v]` the token log-probs read: the tensor itself when its f32
/// buffer holds exactly it, row-major or as the transpose of a row-major `[v, d]` (a tied
/// embedding) — read in place, not copied (a 0.5B model's is 545 MB) — else a copy.
#[derive(Clone)]
enum HostWeight {
    InPlace { tensor: FlexTensor, transposed: bool },
    Copied(Vec<f32>),
}

impl HostWeight {
    fn new(tensor: FlexTensor) -> (Self, [usize; 2]) {
        let dims = tensor.layout().shape().to_vec();
        let [d, v] = dims[..] else {
            panic!("a token log-prob weight is [d, vocab], not {dims:?}")
        };
        let layout = tensor.layout();
        let whole = tensor.dtype() == DType::F32
            && layout.start_offset() == 0
            && tensor.bytes().len() == d * v * std::mem::size_of::<f32>();
        let transposed = match layout.strides() {
            [row, 1] if *row == v as isize => Some(false),
            [1, column] if *column == d as isize => Some(true),
            _ => None,
        };
        let weight = match (whole, transposed) {
            (true, Some(transposed)) => HostWeight::InPlace { tensor, transposed },
            _ => HostWeight::Copied(host_floats::<Flex, 2>(tensor).0),
        };
        (weight, [d, v])
    }

    fn view(&self) -> host::WeightRef<'_> {
        match self {
            HostWeight::InPlace { tensor, transposed } => host::WeightRef {
                values: tensor.storage::<f32>(),
                transposed: *transposed,
            },
            HostWeight::Copied(values) => host::WeightRef::rows(values),
        }
    }
}

/// What the token log-prob backward keeps: inputs, targets and the softmax rows.
struct LogprobState {
    hidden: Vec<f32>,
    weight: HostWeight,
    targets: Vec<i64>,
    rows: SoftmaxRows,
    d: usize,
    v: usize,
}

impl std::fmt::Debug for LogprobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LogprobState {{ rows: {}, d: {}, v: {} }}",
            self.targets.len(),
            self.d,
            self.v
        )
    }
}

#[derive(Debug)]
struct TokenLogprobs;

impl<B: Backend> Backward<B, 2> for TokenLogprobs {
    type State = Arc<LogprobState>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [hidden_node, weight_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let device = grad.device();
        let (g, _) = host_floats::<B, 1>(grad);
        let state = Arc::try_unwrap(ops.state).unwrap_or_else(|shared| LogprobState {
            hidden: shared.hidden.clone(),
            weight: shared.weight.clone(),
            targets: shared.targets.clone(),
            rows: SoftmaxRows {
                lse: shared.rows.lse.clone(),
                probs: shared.rows.probs.clone(),
            },
            d: shared.d,
            v: shared.v,
        });
        let (n, d, v) = (state.targets.len(), state.d, state.v);
        let (d_hidden, d_weight) = host::token_logprobs_backward(
            &state.hidden,
            state.weight.view(),
            &state.targets,
            state.rows,
            &g,
            d,
            v,
        );
        register::<B>(grads, hidden_node.map(|n| n.id), d_hidden, vec![n, d], &device);
        register::<B>(grads, weight_node.map(|n| n.id), d_weight, vec![d, v], &device);
    }
}

/// What the attention backward keeps: inputs, output, per-row logsumexp and the mask.
struct AttentionState {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    out: Vec<f32>,
    lse: Vec<f32>,
    mask: Option<Arc<Vec<bool>>>,
    shape: AttentionShape,
    scale: f32,
}

impl std::fmt::Debug for AttentionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AttentionState {{ {:?} }}", self.shape)
    }
}

#[derive(Debug)]
struct Attention;

impl<B: Backend> Backward<B, 3> for Attention {
    type State = Arc<AttentionState>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [q_node, k_node, v_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let device = grad.device();
        let (g, _) = host_floats::<B, 4>(grad);
        let s = &ops.state;
        let sh = s.shape;
        let (dq, dk, dv) = host::attention_backward(
            &s.q,
            &s.k,
            &s.v,
            &s.out,
            &s.lse,
            &g,
            s.mask.as_deref().map(Vec::as_slice),
            sh,
            s.scale,
        );
        let q_dims = [sh.batch, sh.heads, sh.queries, sh.dim];
        let kv_dims = [sh.batch, sh.kv_heads, sh.keys, sh.dim];
        for (node, values, dims) in [(q_node, dq, q_dims), (k_node, dk, kv_dims), (v_node, dv, kv_dims)] {
            register::<B>(grads, node.map(|n| n.id), values, dims.to_vec(), &device);
        }
    }
}

/// What the SwiGLU backward keeps: both inputs.
struct SwigluState {
    gate: Vec<f32>,
    up: Vec<f32>,
    dims: Vec<usize>,
}

impl std::fmt::Debug for SwigluState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SwigluState {{ {:?} }}", self.dims)
    }
}

#[derive(Debug)]
struct Swiglu;

impl<B: Backend> Backward<B, 2> for Swiglu {
    type State = Arc<SwigluState>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [gate_node, up_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let device = grad.device();
        let (g, _) = host_values::<B>(grad);
        let s = &ops.state;
        let (d_gate, d_up) = host::swiglu_backward(&s.gate, &s.up, &g);
        register::<B>(grads, gate_node.map(|n| n.id), d_gate, s.dims.clone(), &device);
        register::<B>(grads, up_node.map(|n| n.id), d_up, s.dims.clone(), &device);
    }
}

/// What the RMS-norm backward keeps: input, weight and each row's `1/rms`.
struct RmsNormState {
    x: Vec<f32>,
    w: Vec<f32>,
    inv: Vec<f32>,
    dims: Vec<usize>,
}

impl std::fmt::Debug for RmsNormState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RmsNormState {{ {:?} }}", self.dims)
    }
}

#[derive(Debug)]
struct RmsNorm;

impl<B: Backend> Backward<B, 2> for RmsNorm {
    type State = Arc<RmsNormState>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, w_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let device = grad.device();
        let (dy, _) = host_values::<B>(grad);
        let s = &ops.state;
        let (dx, dw) = host::rms_norm_backward(&s.x, &s.w, &s.inv, &dy);
        register::<B>(grads, x_node.map(|n| n.id), dx, s.dims.clone(), &device);
        register::<B>(grads, w_node.map(|n| n.id), dw, vec![s.w.len()], &device);
    }
}

impl<C: CheckpointStrategy> FusedOps for Autodiff<Flex, C> {
    fn fused_rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        let nodes = [x.node(), gamma.node()];
        let device = x.primitive().device();
        let (xs, dims) = host_values::<Flex>(x.into_primitive());
        let (w, _) = host_values::<Flex>(gamma.into_primitive());
        let (y, inv) = host::rms_norm_forward(&xs, &w, eps);
        let y = Flex::float_from_data(TensorData::new(y, dims.clone()), &device);
        match RmsNorm.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(Arc::new(RmsNormState { x: xs, w, inv, dims }), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn fused_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [gate.node(), up.node()];
        let device = gate.primitive().device();
        let (g, dims) = host_values::<Flex>(gate.into_primitive());
        let (u, _) = host_values::<Flex>(up.into_primitive());
        let out = host::swiglu_forward(&g, &u);
        let out = Flex::float_from_data(TensorData::new(out, dims.clone()), &device);
        match Swiglu.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(Arc::new(SwigluState { gate: g, up: u, dims }), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn fused_token_logprobs(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let nodes = [hidden.node(), weight.node()];
        let device = hidden.primitive().device();
        let (h, [_, d]) = host_floats::<Flex, 2>(hidden.into_primitive());
        let (w, [_, v]) = HostWeight::new(weight.into_primitive());
        let t = host_ints::<Flex>(targets);
        let n = t.len();
        let output = |out: Vec<f32>| Flex::float_from_data(TensorData::new(out, [n]), &device);
        match TokenLogprobs.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, rows) = host::token_logprobs_forward(&h, w.view(), &t, (d, v), true);
                let state = LogprobState {
                    hidden: h,
                    weight: w,
                    targets: t,
                    rows,
                    d,
                    v,
                };
                prep.finish(Arc::new(state), output(out))
            }
            OpsKind::UnTracked(prep) => prep.finish(output(
                host::token_logprobs_forward(&h, w.view(), &t, (d, v), false).0,
            )),
        }
    }

    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: Option<Arc<Vec<bool>>>,
        scale: f32,
    ) -> FloatTensor<Self> {
        host_attention::<Flex, C>(q, k, v, mask, scale)
    }
}

/// Attention through the host with its hand-written backward, for autodiff over any backend
/// `B`: the Flex path, and on Cube devices a correct (if slow, copying through the host)
/// implementation for callers that ask for it; the model composes Burn's ops there.
pub(super) fn host_attention<B: Backend, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    mask: Option<Arc<Vec<bool>>>,
    scale: f32,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes = [q.node(), k.node(), v.node()];
    let device = q.primitive().device();
    let (q, q_dims) = host_floats::<B, 4>(q.into_primitive());
    let (k, k_dims) = host_floats::<B, 4>(k.into_primitive());
    let (v, _) = host_floats::<B, 4>(v.into_primitive());
    let shape = attention_shape(q_dims, k_dims);
    let (out, lse) = host::attention_forward(&q, &k, &v, mask.as_deref().map(Vec::as_slice), shape, scale);
    let output = |values: Vec<f32>| B::float_from_data(TensorData::new(values, q_dims), &device);
    match Attention.prepare::<C>(nodes).compute_bound().stateful() {
        // The backward needs the output on the host too, so only then is it copied.
        OpsKind::Tracked(prep) => {
            let tensor = output(out.clone());
            let state = AttentionState {
                q,
                k,
                v,
                out,
                lse,
                mask,
                shape,
                scale,
            };
            prep.finish(Arc::new(state), tensor)
        }
        OpsKind::UnTracked(prep) => prep.finish(output(out)),
    }
}
