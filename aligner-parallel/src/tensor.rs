//! Tensor parallel (Megatron-style): the ranks of a tensor group each keep a block of every
//! large weight and compute their part of each layer, the activations between the parts
//! combined by collectives over the group.
//!
//! A split parameter is a tensor of its rank's block along one axis ([`TensorSplit`]: the
//! first `n % T` ranks holding one more) registered under its parameter id with the whole
//! shape ([`register`]); a model finds it with [`split_of`]. Three differentiable ops
//! ([`TensorParallelOps`], a Burn backend extension on every backend) connect the blocks:
//!
//! - [`tp_copy`] (Megatron's `f`): the identity forward; the backward sums the gradient over the
//!   group. It stands before a column-parallel layer (`x · W[:, block]`), whose input every rank
//!   holds whole but whose gradient each rank has only a part of.
//! - [`tp_reduce`] (`g`): sums over the group forward; the identity backward. It ends a
//!   row-parallel layer (`x[:, block] · W[block, :]`), each rank's product a part of the sum.
//! - [`tp_gather`]: the whole parameter, the backward keeping this rank's block of the gradient
//!   (every rank computes the same with it, so each has the whole gradient); for uses that do
//!   not split (the fallback, correct at the memory of the whole weight).
//!
//! [`vocab_parallel_logprobs`] is the token log-probabilities over a vocabulary split across
//! the group: each rank computes the logits of its block of the vocabulary only, and the
//! log-sum-exp and the target's logit are summed over the group.
//!
//! Every op is a collective over the group: its ranks must run the same forward and backward
//! passes, as the ranks of one tensor group do (they see the same examples).

use std::ops::Range;
use std::sync::Arc;

#[cfg(feature = "cube")]
use burn::backend::Cube;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Backend, Flex, TensorMetadata, backend_extension, tensor::FloatTensor};
use burn::tensor::{Int, Tensor, TensorData};

use crate::comm::{Communicator, ReduceOp, shard_range};
use crate::registry::Registry;

/// A tensor group, as the ops carry it.
#[derive(Clone)]
pub struct Group(pub Arc<dyn Communicator>);

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Group {{ rank: {}, size: {} }}",
            self.0.rank(),
            self.0.world_size()
        )
    }
}

/// How one parameter is split over a tensor group: its whole shape, split along `axis`.
#[derive(Clone, Debug)]
pub struct TensorSplit {
    /// The whole tensor's shape.
    pub dims: Vec<usize>,
    pub axis: usize,
    pub group: Group,
}

impl TensorSplit {
    fn size(&self) -> usize {
        self.group.0.world_size()
    }

    /// The indices along [`TensorSplit::axis`] that rank `rank` keeps.
    pub fn range(&self, rank: usize) -> Range<usize> {
        shard_range(self.dims[self.axis], rank, self.size())
    }

    /// This rank's indices along the axis.
    pub fn own_range(&self) -> Range<usize> {
        self.range(self.group.0.rank())
    }

    /// The shape of rank `rank`'s block.
    pub fn block_dims(&self, rank: usize) -> Vec<usize> {
        let mut dims = self.dims.clone();
        dims[self.axis] = self.range(rank).len();
        dims
    }

    /// This rank's block's shape.
    pub fn local_dims(&self) -> Vec<usize> {
        self.block_dims(self.group.0.rank())
    }

    /// Rank `rank`'s block of the whole tensor's values (row-major).
    pub fn block_values(&self, whole: &[f32], rank: usize) -> Vec<f32> {
        take_block(whole, &self.dims, self.axis, self.range(rank))
    }

    /// The whole tensor's values from this rank's block (an all-gather over the group).
    pub fn gather_values(&self, own: &[f32]) -> Vec<f32> {
        let parts = crate::comm::all_gather_f32(self.group.0.as_ref(), own)
            .unwrap_or_else(|e| panic!("gathering a tensor-parallel parameter {:?}: {e}", self.dims));
        join_blocks(&parts, &self.dims, self.axis)
    }

    /// [`TensorSplit::gather_values`] received by the group's rank `root` alone (`None` on
    /// the others, which send their block and keep nothing).
    pub fn gather_values_to(&self, own: &[f32], root: usize) -> Option<Vec<f32>> {
        crate::comm::gather_f32(self.group.0.as_ref(), own, root)
            .unwrap_or_else(|e| panic!("gathering a tensor-parallel parameter {:?}: {e}", self.dims))
            .map(|parts| join_blocks(&parts, &self.dims, self.axis))
    }
}

/// The block `range` along `axis` of `values`, a row-major tensor of shape `dims`.
pub fn take_block(values: &[f32], dims: &[usize], axis: usize, range: Range<usize>) -> Vec<f32> {
    let inner: usize = dims[axis + 1..].iter().product();
    let outer: usize = dims[..axis].iter().product();
    let (n, len) = (dims[axis], range.len());
    let mut out = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        let at = (o * n + range.start) * inner;
        out.extend_from_slice(&values[at..at + len * inner]);
    }
    out
}

/// The whole tensor of shape `dims` from its blocks along `axis`, in rank order (the inverse
/// of [`take_block`] over consecutive ranges).
pub fn join_blocks(parts: &[Vec<f32>], dims: &[usize], axis: usize) -> Vec<f32> {
    let inner: usize = dims[axis + 1..].iter().product();
    let outer: usize = dims[..axis].iter().product();
    let lens: Vec<usize> = parts
        .iter()
        .map(|p| p.len().checked_div(outer * inner).unwrap_or(0))
        .collect();
    let mut out = Vec::with_capacity(dims.iter().product());
    for o in 0..outer {
        for (part, len) in parts.iter().zip(&lens) {
            out.extend_from_slice(&part[o * len * inner..(o + 1) * len * inner]);
        }
    }
    out
}

static SPLIT: Registry<TensorSplit> = Registry::new();

/// Registers the parameter `id` as split as `split` says (a tensor-parallel trainer does, for
/// each split parameter).
pub fn register(id: u64, split: TensorSplit) {
    SPLIT.insert(id, split);
}

/// Whether this process trains a tensor-parallel model (some parameter is registered).
pub fn active() -> bool {
    SPLIT.is_active()
}

/// Forgets every registered parameter (the trainer that registered them is done).
pub fn clear() {
    SPLIT.clear();
}

/// The split of parameter `id` when `dims`, its tensor's shape, is this rank's block; `None`
/// for anything else (a whole tensor under the same id: a gathered copy, a reference model).
pub fn split_of(id: u64, dims: &[usize]) -> Option<TensorSplit> {
    SPLIT.get(id, |split| split.dims != dims && split.local_dims() == dims)
}

/// The registered split of parameter `id`, whatever its tensor's shape.
pub fn registered(id: u64) -> Option<TensorSplit> {
    SPLIT.get(id, |_| true)
}

/// The collectives between a tensor group's parts, as a Burn backend extension: the default
/// bodies compute without gradients on any backend; autodiff over any backend adds the
/// backward.
#[backend_extension(Flex, Cube: cfg(feature = "cube"), Autodiff)]
pub trait TensorParallelOps: Backend {
    /// `x` (Megatron's `f`: the backward sums the gradient over the group).
    fn tp_copy(x: FloatTensor<Self>, group: Group) -> FloatTensor<Self> {
        let _ = group;
        x
    }

    /// `x` summed over the group (Megatron's `g`: the backward is the identity).
    fn tp_reduce(x: FloatTensor<Self>, group: Group) -> FloatTensor<Self> {
        all_reduce::<Self>(x, &group, ReduceOp::Sum)
    }

    /// The whole parameter of the block `block` (the backward keeps this rank's block).
    fn tp_gather(block: FloatTensor<Self>, split: TensorSplit) -> FloatTensor<Self> {
        gather::<Self>(block, &split)
    }
}

impl TensorParallelOps for Flex {}

#[cfg(feature = "cube")]
impl TensorParallelOps for Cube {}

/// `x` combined over the group by `op`, on `x`'s device, in `x`'s type.
fn all_reduce<B: Backend>(x: FloatTensor<B>, group: &Group, op: ReduceOp) -> FloatTensor<B> {
    let (device, dtype) = (x.device(), x.dtype());
    let (mut values, dims) = crate::fused::host_values::<B>(x);
    group
        .0
        .all_reduce(&mut values, op)
        .unwrap_or_else(|e| panic!("tensor parallel: all-reduce of {dims:?}: {e}"));
    let out = B::float_from_data(TensorData::new(values, dims), &device);
    B::float_cast(out, dtype.into())
}

/// The whole tensor of `block` on its device (f32).
fn gather<B: Backend>(block: FloatTensor<B>, split: &TensorSplit) -> FloatTensor<B> {
    let device = block.device();
    let (own, _) = crate::fused::host_values::<B>(block);
    let whole = split.gather_values(&own);
    B::float_from_data(TensorData::new(whole, split.dims.clone()), &device)
}

#[derive(Debug)]
struct Copy;

impl<B: Backend> Backward<B, 1> for Copy {
    type State = Group;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = parent {
            grads.register::<B>(node.id, all_reduce::<B>(grad, &ops.state, ReduceOp::Sum));
        }
    }
}

#[derive(Debug)]
struct Reduce;

impl<B: Backend> Backward<B, 1> for Reduce {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = parent {
            grads.register::<B>(node.id, grad);
        }
    }
}

#[derive(Debug)]
struct Gather;

impl<B: Backend> Backward<B, 1> for Gather {
    type State = TensorSplit;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = parent {
            let device = grad.device();
            let (whole, _) = crate::fused::host_values::<B>(grad);
            let split = &ops.state;
            let own = split.block_values(&whole, split.group.0.rank());
            let own = B::float_from_data(TensorData::new(own, split.local_dims()), &device);
            grads.register::<B>(node.id, own);
        }
    }
}

impl<B: Backend + TensorParallelOps, C: CheckpointStrategy> TensorParallelOps for Autodiff<B, C> {
    fn tp_copy(x: FloatTensor<Self>, group: Group) -> FloatTensor<Self> {
        let nodes = [x.node()];
        let y = x.into_primitive();
        match Copy.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(group, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn tp_reduce(x: FloatTensor<Self>, group: Group) -> FloatTensor<Self> {
        let nodes = [x.node()];
        let y = all_reduce::<B>(x.into_primitive(), &group, ReduceOp::Sum);
        match Reduce.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn tp_gather(block: FloatTensor<Self>, split: TensorSplit) -> FloatTensor<Self> {
        let nodes = [block.node()];
        let whole = gather::<B>(block.into_primitive(), &split);
        match Gather.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(split, whole),
            OpsKind::UnTracked(prep) => prep.finish(whole),
        }
    }
}

/// [`TensorParallelOps::tp_copy`] on tensors.
pub fn tp_copy<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    use burn::backend::Dispatch;
    if group.0.world_size() == 1 {
        return x;
    }
    Tensor::from_dispatch(<Dispatch as TensorParallelOps>::tp_copy(
        x.into_dispatch(),
        group.clone(),
    ))
}

/// [`TensorParallelOps::tp_reduce`] on tensors.
pub fn tp_reduce<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    use burn::backend::Dispatch;
    if group.0.world_size() == 1 {
        return x;
    }
    Tensor::from_dispatch(<Dispatch as TensorParallelOps>::tp_reduce(
        x.into_dispatch(),
        group.clone(),
    ))
}

/// [`TensorParallelOps::tp_gather`] on tensors.
pub fn tp_gather<const D: usize>(block: Tensor<D>, split: TensorSplit) -> Tensor<D> {
    use burn::backend::Dispatch;
    Tensor::from_dispatch(<Dispatch as TensorParallelOps>::tp_gather(
        block.into_dispatch(),
        split,
    ))
}

/// `log p(targets)` `[batch, seq]` of the next-token distributions of `hidden: [batch, seq, d]`
/// under the output projection `weight: [d, vocab]` whose columns `vocab` (a block of the
/// whole vocabulary) this rank holds: the logits of the block only, the log-sum-exp and the
/// target's logit summed over the group, `chunk_tokens` positions at a time; under a final
/// soft-cap when `softcap` is set. In f32 whatever the compute type. Differentiable.
pub fn vocab_parallel_logprobs(
    hidden: Tensor<3>,
    weight: Tensor<2>,
    targets: Tensor<2, Int>,
    vocab: Range<usize>,
    chunk_tokens: usize,
    softcap: Option<f64>,
    group: &Group,
) -> Tensor<2> {
    let [batch, seq, d] = hidden.dims();
    let n = batch * seq;
    let weight = weight.cast(burn::tensor::FloatDType::from(hidden.dtype()));
    // Every rank's logits need the whole hidden state's gradient: summed over the group.
    let hidden = tp_copy(hidden.reshape([n, d]), group);
    let targets = targets.reshape([n]);
    let chunk = chunk_tokens.max(1);
    let mut out = Vec::with_capacity(n.div_ceil(chunk));
    for start in (0..n).step_by(chunk) {
        let len = chunk.min(n - start);
        let logits = hidden
            .clone()
            .narrow(0, start, len)
            .matmul(weight.clone())
            .cast(burn::tensor::FloatDType::F32);
        let logits = crate::logprob::soft_cap(logits, softcap);
        // Used once, after the group's sum: its gradient needs no sum over the group.
        let lse = crate::vocab::group_log_sum_exp(logits.clone(), group);
        // The target's logit, from the rank whose block holds it (0 elsewhere).
        let t = targets.clone().narrow(0, start, len).reshape([len, 1]);
        let (index, inside) = crate::vocab::block_index(t, &vocab);
        let picked = logits.gather(1, index) * inside;
        let picked = tp_reduce(picked, group);
        out.push(picked - lse);
    }
    Tensor::cat(out, 0).reshape([batch, seq])
}
