//! Fully sharded parameters (ZeRO stage 3): each rank keeps a block of rows of every
//! trainable parameter, and the whole tensor exists only while an op uses it.
//!
//! A sharded parameter is a tensor of its rank's rows ([`ShardSpec::rows`], the first
//! `rows % world` ranks holding one more) registered under its parameter id with the whole
//! shape ([`register`]). A model reads it through [`spec_of`], and computes with three
//! differentiable ops ([`ShardOps`], a Burn backend extension on every backend):
//!
//! - [`shard_matmul`]: `x · W`, the whole `W` all-gathered for the product and dropped; the
//!   backward gathers it again for `dx` and reduce-scatters `dW`, so a layer's whole weight
//!   lives only inside its forward and its backward (the linear layers: most of a model);
//! - [`shard_embedding`]: the rows of `W` that `indices` pick, `W` gathered and dropped the
//!   same way (its backward needs only the shape);
//! - [`shard_gather`]: the whole tensor, kept by whatever uses it until its backward, which
//!   reduce-scatters the gradient (norm weights, biases, the tied output projection).
//!
//! Every reduce-scatter sums the ranks' gradients and hands each rank the rows it owns, as
//! soon as the backward reaches the op: a whole gradient never outlives its op. Each op is a
//! collective, so every rank must run the same forward passes and backward passes; the
//! backward runs ops in the same order on every rank because their graphs are the same.
//! [`shard_gather`] takes an `anchor` (the activation it is used with) only to be placed in the
//! backward right after its user rather than at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

#[cfg(feature = "cube")]
use burn::backend::Cube;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{
    Autodiff, Backend, Flex, TensorMetadata, backend_extension, tensor::FloatTensor, tensor::IntTensor,
};
use burn::tensor::{Int, Tensor, TensorData};

use crate::comm::{Communicator, shard_range};
use crate::registry::Registry;

/// How one parameter is split: its whole shape, split by rows (the first axis) over the
/// ranks of `comm`.
#[derive(Clone)]
pub struct ShardSpec {
    /// The whole tensor's shape.
    pub dims: Vec<usize>,
    pub comm: Arc<dyn Communicator>,
}

impl std::fmt::Debug for ShardSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ShardSpec {{ dims: {:?}, world: {} }}",
            self.dims,
            self.comm.world_size()
        )
    }
}

impl ShardSpec {
    /// The rows of the whole tensor rank `rank` keeps.
    pub fn rows(&self, rank: usize) -> std::ops::Range<usize> {
        shard_range(self.dims[0], rank, self.comm.world_size())
    }

    /// Elements in one row (the product of the shape after the first axis).
    fn row_len(&self) -> usize {
        self.dims[1..].iter().product()
    }

    /// This rank's shape.
    pub fn shard_dims(&self) -> Vec<usize> {
        let mut dims = self.dims.clone();
        dims[0] = self.rows(self.comm.rank()).len();
        dims
    }

    /// The whole tensor's values from this rank's (`own`, row-major f32): an all-gather.
    pub fn gather_values(&self, own: &[f32]) -> Vec<f32> {
        crate::comm::all_gather_f32(self.comm.as_ref(), own)
            .unwrap_or_else(|e| panic!("gathering a sharded parameter {:?}: {e}", self.dims))
            .concat()
    }

    /// [`ShardSpec::gather_values`] received by rank `root` alone (`None` on the others).
    pub fn gather_values_to(&self, own: &[f32], root: usize) -> Option<Vec<f32>> {
        crate::comm::gather_f32(self.comm.as_ref(), own, root)
            .unwrap_or_else(|e| panic!("gathering a sharded parameter {:?}: {e}", self.dims))
            .map(|parts| parts.concat())
    }

    /// This rank's rows of the sum over the ranks of `whole` (each rank's gradient of the
    /// whole tensor): a reduce-scatter.
    pub fn reduce_scatter_values(&self, whole: &[f32]) -> Vec<f32> {
        let world = self.comm.world_size();
        let row = self.row_len();
        let block = self.rows(0).len() * row;
        let mut send = vec![0.0f32; block * world];
        for rank in 0..world {
            let rows = self.rows(rank);
            let part = &whole[rows.start * row..rows.end * row];
            send[rank * block..rank * block + part.len()].copy_from_slice(part);
        }
        let mut recv = vec![0.0f32; block];
        self.comm
            .reduce_scatter(&send, &mut recv)
            .unwrap_or_else(|e| panic!("reduce-scattering a sharded gradient {:?}: {e}", self.dims));
        recv.truncate(self.rows(self.comm.rank()).len() * row);
        recv
    }
}

static SHARDED: Registry<ShardSpec> = Registry::new();
static KEEP_GATHERED: AtomicBool = AtomicBool::new(false);

/// Whether a linear layer keeps its gathered weight from its forward to its backward
/// ([`shard_gather`]) instead of gathering it again there ([`shard_matmul`]):
/// `train.keep_gathered`, one all-gather a step instead of two for the memory of the whole
/// weights through the step.
pub fn keep_gathered(keep: bool) {
    KEEP_GATHERED.store(keep, Ordering::Relaxed);
}

/// [`keep_gathered`]'s setting.
pub fn keeps_gathered() -> bool {
    KEEP_GATHERED.load(Ordering::Relaxed)
}

/// Registers the shard that carries `id` ([`shard_id`]) as split as `spec` says (a fully
/// sharded trainer does, for each parameter).
pub fn register(id: u64, spec: ShardSpec) {
    SHARDED.insert(id, spec);
}

/// Whether this process trains a fully sharded model (some parameter is registered).
pub fn active() -> bool {
    SHARDED.is_active()
}

/// Forgets every registered parameter (the trainer that registered them is done) and the
/// [`keep_gathered`] setting.
pub fn clear() {
    keep_gathered(false);
    SHARDED.clear();
}

/// The id a parameter's shard carries: its whole tensor's id with a fixed mask, so no other
/// model (a reference, a reward model or a teacher named as the trained one) is taken for a
/// shard, and the whole tensor's id comes back the same way ([`whole_id`]).
pub fn shard_id(id: u64) -> u64 {
    id ^ SHARD_ID_MASK
}

/// The whole tensor's id of a shard's ([`shard_id`] is its own inverse).
pub fn whole_id(id: u64) -> u64 {
    id ^ SHARD_ID_MASK
}

/// `SHARDED!` in ASCII.
const SHARD_ID_MASK: u64 = 0x5348_4152_4445_4421;

/// The split of the parameter whose shard carries `id` when `dims`, its tensor's shape, is
/// this rank's shard; `None` for anything else.
pub fn spec_of(id: u64, dims: &[usize]) -> Option<ShardSpec> {
    SHARDED.get(id, |spec| spec.dims != dims && spec.shard_dims() == dims)
}

/// Ops on sharded parameters, as a Burn backend extension: the default bodies compute without
/// gradients on any backend; autodiff over any backend adds the backward.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait ShardOps: Backend {
    /// The whole tensor of the sharded `shard`; `anchor` only orders the backward.
    fn shard_gather(
        shard: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        spec: ShardSpec,
    ) -> FloatTensor<Self> {
        let _ = anchor;
        gather::<Self>(shard, &spec)
    }

    /// `x · W`, `x: [n, in]`, `W: [in, out]` sharded as `shard`.
    fn shard_matmul(x: FloatTensor<Self>, shard: FloatTensor<Self>, spec: ShardSpec) -> FloatTensor<Self> {
        let w = gather::<Self>(shard, &spec);
        let w = Self::float_cast(w, x.dtype().into());
        Self::float_matmul(x, w)
    }

    /// The rows `indices: [b, s]` of the embedding table `W: [vocab, d]` sharded as `shard`.
    fn shard_embedding(
        shard: FloatTensor<Self>,
        indices: IntTensor<Self>,
        spec: ShardSpec,
    ) -> FloatTensor<Self> {
        let w = gather::<Self>(shard, &spec);
        Self::embedding(w, indices)
    }
}

impl ShardOps for Flex {}

#[cfg(feature = "cube")]
impl ShardOps for Cube {}

/// The whole tensor of `shard` on its device (f32).
fn gather<B: Backend>(shard: FloatTensor<B>, spec: &ShardSpec) -> FloatTensor<B> {
    let device = shard.device();
    let (own, _) = crate::fused::host_values::<B>(shard);
    let whole = spec.gather_values(&own);
    B::float_from_data(TensorData::new(whole, spec.dims.clone()), &device)
}

/// Reduce-scatters `grad`, the whole tensor's gradient, and registers this rank's rows for
/// the shard's node.
fn register_shard_grad<B: Backend>(
    grads: &mut Gradients,
    node: Option<burn::backend::autodiff::NodeId>,
    grad: FloatTensor<B>,
    spec: &ShardSpec,
) {
    let device = grad.device();
    let (whole, _) = crate::fused::host_values::<B>(grad);
    let own = spec.reduce_scatter_values(&whole);
    drop(whole);
    if let Some(id) = node {
        grads.register::<B>(
            id,
            B::float_from_data(TensorData::new(own, spec.shard_dims()), &device),
        );
    }
}

#[derive(Debug)]
struct Gather;

impl<B: Backend> Backward<B, 2> for Gather {
    type State = ShardSpec;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [shard, _anchor] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = shard {
            register_shard_grad::<B>(grads, Some(node.id), grad, &ops.state);
        }
    }
}

#[derive(Debug)]
struct Matmul;

impl<B: Backend> Backward<B, 2> for Matmul {
    type State = (FloatTensor<B>, FloatTensor<B>, ShardSpec);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, shard_node] = ops.parents;
        let (x, shard, spec) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        // Gathered again: the whole weight was dropped after the forward.
        let w = B::float_cast(gather::<B>(shard, &spec), x.dtype().into());
        if let Some(node) = x_node {
            let dx = B::float_matmul(grad.clone(), B::float_transpose(w));
            grads.register::<B>(node.id, dx);
        }
        // A frozen weight (LoRA's base) has no gradient to reduce: the same on every rank.
        if let Some(node) = shard_node {
            let dw = B::float_matmul(B::float_transpose(x), grad);
            register_shard_grad::<B>(grads, Some(node.id), dw, &spec);
        }
    }
}

#[derive(Debug)]
struct Embedding;

impl<B: Backend> Backward<B, 1> for Embedding {
    type State = (IntTensor<B>, ShardSpec);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [shard_node] = ops.parents;
        let (indices, spec) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let device = grad.device();
        let (g, _) = crate::fused::host_values::<B>(grad);
        let rows = crate::fused::host_ints::<B>(indices);
        let d = spec.row_len();
        let mut whole = vec![0.0f32; spec.dims.iter().product()];
        for (k, &row) in rows.iter().enumerate() {
            let (src, dst) = (&g[k * d..(k + 1) * d], row as usize * d);
            for (w, v) in whole[dst..dst + d].iter_mut().zip(src) {
                *w += v;
            }
        }
        let whole = B::float_from_data(TensorData::new(whole, spec.dims.clone()), &device);
        register_shard_grad::<B>(grads, shard_node.map(|n| n.id), whole, &spec);
    }
}

impl<B: Backend + ShardOps, C: CheckpointStrategy> ShardOps for Autodiff<B, C> {
    fn shard_gather(
        shard: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        spec: ShardSpec,
    ) -> FloatTensor<Self> {
        let nodes = [shard.node(), anchor.node()];
        let whole = gather::<B>(shard.into_primitive(), &spec);
        match Gather.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(spec, whole),
            OpsKind::UnTracked(prep) => prep.finish(whole),
        }
    }

    fn shard_matmul(x: FloatTensor<Self>, shard: FloatTensor<Self>, spec: ShardSpec) -> FloatTensor<Self> {
        let nodes = [x.node(), shard.node()];
        let (x, shard) = (x.into_primitive(), shard.into_primitive());
        let w = B::float_cast(gather::<B>(shard.clone(), &spec), x.dtype().into());
        let y = B::float_matmul(x.clone(), w);
        match Matmul.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x, shard, spec), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn shard_embedding(
        shard: FloatTensor<Self>,
        indices: IntTensor<Self>,
        spec: ShardSpec,
    ) -> FloatTensor<Self> {
        let nodes = [shard.node()];
        let w = gather::<B>(shard.into_primitive(), &spec);
        let y = B::embedding(w, indices.clone());
        match Embedding.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((indices, spec), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

/// [`ShardOps::shard_gather`] on tensors: the whole parameter of `shard`, differentiable;
/// `anchor` (the activation it is used with) places its backward right after its user's.
pub fn shard_gather<const D: usize, const E: usize>(
    shard: Tensor<D>,
    anchor: &Tensor<E>,
    spec: ShardSpec,
) -> Tensor<D> {
    use burn::backend::Dispatch;
    Tensor::from_dispatch(<Dispatch as ShardOps>::shard_gather(
        shard.into_dispatch(),
        anchor.clone().into_dispatch(),
        spec,
    ))
}

/// [`ShardOps::shard_matmul`] on tensors: `x: [n, in]` times the sharded `[in, out]` weight.
pub fn shard_matmul(x: Tensor<2>, shard: Tensor<2>, spec: ShardSpec) -> Tensor<2> {
    use burn::backend::Dispatch;
    Tensor::from_dispatch(<Dispatch as ShardOps>::shard_matmul(
        x.into_dispatch(),
        shard.into_dispatch(),
        spec,
    ))
}

/// [`ShardOps::shard_embedding`] on tensors: rows `indices: [b, s]` of the sharded `[vocab, d]`
/// table, `[b, s, d]`.
pub fn shard_embedding(shard: Tensor<2>, indices: Tensor<2, Int>, spec: ShardSpec) -> Tensor<3> {
    use burn::backend::Dispatch;
    Tensor::from_dispatch(<Dispatch as ShardOps>::shard_embedding(
        shard.into_dispatch(),
        indices.into_dispatch(),
        spec,
    ))
}
