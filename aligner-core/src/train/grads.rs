//! Global gradient-norm clipping across every parameter, as `torch.nn.utils.clip_grad_norm_`,
//! and the data-parallel side of a step: gradients summed over ranks in buckets, the weights'
//! checksum, and the sharded optimiser's parameter ownership.

use aligner_parallel::{CommError, Communicator, ReduceOp};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};

struct SquaredNorm<'a> {
    grads: &'a GradientsParams,
    parts: Vec<Tensor<1>>,
    /// Only the parameters whose ids it accepts count (all of them when `None`).
    only: Option<&'a dyn Fn(u64) -> bool>,
}

impl ModuleVisitor for SquaredNorm<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.only.is_some_and(|only| !only(param.id.val())) {
            return;
        }
        if let Some(g) = self.grads.get::<D>(param.id) {
            self.parts.push(g.square().sum());
        }
    }
}

struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
}

impl ModuleVisitor for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.remove::<D>(param.id) {
            self.grads.register::<D>(param.id, g.mul_scalar(self.factor));
        }
    }
}

/// The sum of the squares of all gradients of `module`'s parameters.
pub fn squared_grad_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    squared_grad_norm_of(module, grads, None)
}

/// [`squared_grad_norm`] over the parameters whose ids `only` accepts.
pub fn squared_grad_norm_of<M: Module>(
    module: &M,
    grads: &GradientsParams,
    only: Option<&dyn Fn(u64) -> bool>,
) -> f64 {
    let mut visitor = SquaredNorm {
        grads,
        parts: Vec::new(),
        only,
    };
    module.visit(&mut visitor);
    if visitor.parts.is_empty() {
        return 0.0;
    }
    Tensor::cat(visitor.parts, 0).sum().into_scalar::<f32>() as f64
}

/// The L2 norm of all gradients of `module`'s parameters.
pub fn global_grad_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    // The square root in f32, as the norm has always been taken.
    (squared_grad_norm(module, grads) as f32).sqrt() as f64
}

/// Scales all gradients of global norm `norm` down to `max_norm` when they are longer
/// (no-op for `max_norm <= 0`).
pub fn scale_to_norm<M: Module>(module: &M, grads: &mut GradientsParams, norm: f64, max_norm: f64) {
    if max_norm > 0.0 && norm > max_norm {
        let mut scale = Scale {
            grads,
            factor: max_norm / (norm + 1e-6),
        };
        module.visit(&mut scale);
    }
}

/// Scales all gradients so their global norm is at most `max_norm` (no-op for `max_norm <= 0`).
/// Returns the norm before clipping.
pub fn clip_grad_norm<M: Module>(module: &M, grads: &mut GradientsParams, max_norm: f64) -> f64 {
    let norm = global_grad_norm(module, grads);
    scale_to_norm(module, grads, norm, max_norm);
    norm
}

/// Elements per all-reduce bucket (16 MiB of f32): large enough to amortise latency, small
/// enough that the copy in and out stays in cache-sized pieces.
pub const BUCKET_ELEMENTS: usize = 1 << 22;

/// Copies gradients (scaled) into a flat buffer: the values of every trainable parameter in
/// visit order (zeros where this rank has none), then one presence flag per parameter.
struct Flatten<'a> {
    grads: &'a GradientsParams,
    scale: f32,
    values: Vec<f32>,
    present: Vec<f32>,
}

impl ModuleVisitor for Flatten<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let n = value.shape().num_elements();
        match self.grads.get::<D>(param.id) {
            Some(g) => {
                let start = self.values.len();
                extend_with_values(&mut self.values, g);
                if self.scale != 1.0 {
                    self.values[start..].iter_mut().for_each(|x| *x *= self.scale);
                }
                self.present.push(1.0);
            }
            None => {
                self.values.extend(std::iter::repeat_n(0.0, n));
                self.present.push(0.0);
            }
        }
    }
}

/// Appends a tensor's values as f32 (one copy when they already are f32, as gradients and
/// weights are).
fn extend_with_values<const D: usize>(out: &mut Vec<f32>, tensor: Tensor<D>) {
    let data = tensor.into_data();
    match data.as_slice::<f32>() {
        Ok(slice) => out.extend_from_slice(slice),
        Err(_) => out.extend(data.iter::<f32>()),
    }
}

/// Puts the reduced flat buffer back as gradients (only where some rank had one).
struct Unflatten<'a> {
    grads: &'a mut GradientsParams,
    values: &'a [f32],
    present: &'a [f32],
    offset: usize,
    index: usize,
}

impl ModuleVisitor for Unflatten<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let shape = value.shape();
        let n = shape.num_elements();
        let slice = &self.values[self.offset..self.offset + n];
        if self.present[self.index] > 0.0 {
            let device = value.device().inner();
            let grad = Tensor::<D>::from_data(TensorData::new(slice.to_vec(), shape), &device);
            self.grads.remove::<D>(param.id);
            self.grads.register::<D>(param.id, grad);
        }
        self.offset += n;
        self.index += 1;
    }
}

/// Sums `scale` × each rank's gradients over the ranks of `comm`, in buckets of
/// [`BUCKET_ELEMENTS`] (one all-reduce each), so every rank ends with the same gradients. A
/// parameter only some ranks have a gradient for gets the sum of those.
pub fn all_reduce_gradients<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    scale: f32,
    comm: &dyn Communicator,
) -> std::result::Result<(), CommError> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut flat = Flatten {
        grads,
        scale,
        values: Vec::new(),
        present: Vec::new(),
    };
    module.visit(&mut flat);
    let (mut values, mut present) = (flat.values, flat.present);
    for bucket in values.chunks_mut(BUCKET_ELEMENTS) {
        comm.all_reduce(bucket, ReduceOp::Sum)?;
    }
    comm.all_reduce(&mut present, ReduceOp::Sum)?;
    let mut back = Unflatten {
        grads,
        values: &values,
        present: &present,
        offset: 0,
        index: 0,
    };
    module.visit(&mut back);
    Ok(())
}

/// Each trainable parameter's id and number of values, in visit order: what a data-parallel
/// step synchronises.
pub fn trainable_params<M: Module>(module: &M) -> Vec<(u64, usize)> {
    struct Params(Vec<(u64, usize)>);
    impl ModuleVisitor for Params {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if value.is_require_grad() {
                self.0.push((param.id.val(), value.shape().num_elements()));
            }
        }
    }
    let mut params = Params(Vec::new());
    module.visit(&mut params);
    params.0
}

/// Takes every trainable parameter's gradient out of `grads`, in visit order, as f32 values
/// (`None` where there is none).
pub fn take_gradients<M: Module>(module: &M, grads: &mut GradientsParams) -> Vec<Option<Vec<f32>>> {
    let mut take = TakeAll {
        grads,
        taken: Vec::new(),
    };
    module.visit(&mut take);
    take.taken.into_iter().map(|(_, g)| g).collect()
}

/// Registers `values` (each trainable parameter's gradient in visit order, as from
/// [`take_gradients`]) in `grads`, replacing what is there; `None` leaves a parameter without.
pub fn put_gradients<M: Module>(module: &M, grads: &mut GradientsParams, values: Vec<Option<Vec<f32>>>) {
    struct Put<'a> {
        grads: &'a mut GradientsParams,
        values: std::vec::IntoIter<Option<Vec<f32>>>,
    }
    impl ModuleVisitor for Put<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            if !value.is_require_grad() {
                return;
            }
            self.grads.remove::<D>(param.id);
            if let Some(Some(values)) = self.values.next() {
                let device = value.device().inner();
                let grad = Tensor::<D>::from_data(TensorData::new(values, value.shape()), &device);
                self.grads.register::<D>(param.id, grad);
            }
        }
    }
    module.visit(&mut Put {
        grads,
        values: values.into_iter(),
    });
}

/// Takes each trainable parameter's gradient out of `grads` as f32 values, in visit order
/// (`None` where this rank has none); each tensor is freed as it is copied.
struct TakeAll<'a> {
    grads: &'a mut GradientsParams,
    taken: Vec<(usize, Option<Vec<f32>>)>,
}

impl ModuleVisitor for TakeAll<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let n = value.shape().num_elements();
        let grad = self.grads.remove::<D>(param.id).map(|g| {
            let mut values = Vec::with_capacity(n);
            extend_with_values(&mut values, g);
            values
        });
        self.taken.push((n, grad));
    }
}

/// Puts this rank's summed share back as gradients: `values` holds the parameters `rank`
/// owns, in visit order (only those some rank had a gradient for are registered).
struct UnflattenOwned<'a> {
    grads: &'a mut GradientsParams,
    values: &'a [f32],
    present: &'a [f32],
    owners: &'a [usize],
    rank: usize,
    offset: usize,
    index: usize,
}

impl ModuleVisitor for UnflattenOwned<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let index = self.index;
        self.index += 1;
        if self.owners.get(index) != Some(&self.rank) {
            return;
        }
        let shape = value.shape();
        let n = shape.num_elements();
        let slice = &self.values[self.offset..self.offset + n];
        self.offset += n;
        if self.present[index] > 0.0 {
            let device = value.device().inner();
            let grad = Tensor::<D>::from_data(TensorData::new(slice.to_vec(), shape), &device);
            self.grads.register::<D>(param.id, grad);
        }
    }
}

/// ZeRO stage 2's synchronisation: sums every rank's gradients over the ranks of `comm`, but
/// each rank receives (and keeps) only the sums of the parameters it owns (`owners`, from
/// [`optimizer_owners`]); the other gradients leave `grads`. The gradients are laid out owner
/// by owner and reduce-scattered in rounds of at most [`BUCKET_ELEMENTS`] elements, each
/// rank's block of a round padded to the longest; each gradient tensor is freed as soon as it
/// is copied out.
pub fn reduce_scatter_gradients<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    owners: &[usize],
    comm: &dyn Communicator,
) -> std::result::Result<(), CommError> {
    let (world, rank) = (comm.world_size(), comm.rank());
    let mut take = TakeAll {
        grads,
        taken: Vec::new(),
    };
    module.visit(&mut take);
    let taken = take.taken;
    if owners.len() != taken.len() || owners.iter().any(|&o| o >= world) {
        return Err(CommError::Failed(format!(
            "reduce-scatter: {} owners for {} parameters over {world} ranks",
            owners.len(),
            taken.len()
        )));
    }
    let mut present: Vec<f32> = taken.iter().map(|(_, g)| f32::from(g.is_some() as u8)).collect();
    // Each owner's segment: its parameters' values in visit order (zeros where absent).
    let mut segments: Vec<Vec<f32>> = vec![Vec::new(); world];
    for ((n, grad), &owner) in taken.into_iter().zip(owners) {
        match grad {
            Some(values) => segments[owner].extend_from_slice(&values),
            None => segments[owner].extend(std::iter::repeat_n(0.0, n)),
        }
    }
    let longest = segments.iter().map(Vec::len).max().unwrap_or(0);
    // Each rank's block of a round: a bucket's share, or the longest segment when shorter
    // (padding costs traffic: the blocks are as long as the longest rank's).
    let block = (BUCKET_ELEMENTS / world).min(longest).max(1);
    let mut mine = vec![0.0f32; segments[rank].len()];
    let mut send = vec![0.0f32; block * world];
    let mut recv = vec![0.0f32; block];
    for start in (0..longest).step_by(block) {
        for (r, segment) in segments.iter().enumerate() {
            let part = &mut send[r * block..(r + 1) * block];
            part.fill(0.0);
            if start < segment.len() {
                let end = (start + block).min(segment.len());
                part[..end - start].copy_from_slice(&segment[start..end]);
            }
        }
        comm.reduce_scatter(&send, &mut recv)?;
        if start < mine.len() {
            let end = (start + block).min(mine.len());
            mine[start..end].copy_from_slice(&recv[..end - start]);
        }
    }
    drop(segments);
    comm.all_reduce(&mut present, ReduceOp::Sum)?;
    let mut back = UnflattenOwned {
        grads,
        values: &mine,
        present: &present,
        owners,
        rank,
        offset: 0,
        index: 0,
    };
    module.visit(&mut back);
    Ok(())
}

/// A fingerprint of every float parameter of `module` (sum and sum of squares): equal on ranks
/// whose weights are equal.
pub fn weights_checksum<M: Module>(module: &M) -> [f64; 2] {
    struct Sums([f64; 2]);
    impl ModuleVisitor for Sums {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let mut values = Vec::new();
            extend_with_values(&mut values, param.val());
            for x in values {
                self.0[0] += x as f64;
                self.0[1] += (x as f64) * (x as f64);
            }
        }
    }
    let mut sums = Sums([0.0; 2]);
    module.visit(&mut sums);
    sums.0
}

/// The ids of the trainable parameters of a module, in visit order.
pub fn trainable_ids<M: Module>(module: &M) -> Vec<u64> {
    trainable_params(module).into_iter().map(|(id, _)| id).collect()
}

/// Which rank owns each trainable parameter when the optimiser is sharded (ZeRO stage 1):
/// parameters in visit order, each to the rank with the fewest elements so far.
pub fn optimizer_owners<M: Module>(module: &M, world: usize) -> Vec<usize> {
    let mut load = vec![0usize; world.max(1)];
    trainable_params(module)
        .into_iter()
        .map(|(_, n)| {
            let rank = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            load[rank] += n;
            rank
        })
        .collect()
}

/// Keeps only the gradients of the parameters `rank` owns (the optimiser then updates only
/// those, and keeps moments only for those).
pub fn keep_owned_gradients<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    owners: &[usize],
    rank: usize,
) {
    struct Drop<'a> {
        grads: &'a mut GradientsParams,
        owners: &'a [usize],
        rank: usize,
        index: usize,
    }
    impl ModuleVisitor for Drop<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.val().is_require_grad() {
                return;
            }
            if self.owners.get(self.index) != Some(&self.rank) {
                self.grads.remove::<D>(param.id);
            }
            self.index += 1;
        }
    }
    module.visit(&mut Drop {
        grads,
        owners,
        rank,
        index: 0,
    });
}

/// Every trainable parameter broadcast from the rank that owns it (after a sharded optimiser
/// step), one parameter at a time in visit order, as its raw bytes: what a rank holds beyond
/// its weights while they arrive is one parameter's copy, not its whole share.
pub fn broadcast_owned_parameters<M: Module>(
    module: M,
    owners: &[usize],
    comm: &dyn Communicator,
) -> std::result::Result<M, CommError> {
    struct Exchange<'a> {
        owners: &'a [usize],
        comm: &'a dyn Communicator,
        index: usize,
        failed: Option<CommError>,
    }
    impl ModuleMapper for Exchange<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !param.val().is_require_grad() || self.failed.is_some() {
                return param;
            }
            let owner = self.owners.get(self.index).copied().unwrap_or(0);
            self.index += 1;
            let (comm, failed) = (self.comm, &mut self.failed);
            if comm.rank() == owner {
                let mut bytes = param.val().into_data().as_bytes().to_vec();
                if let Err(e) = comm.broadcast(&mut bytes, owner) {
                    *failed = Some(e);
                }
                return param;
            }
            param.map(|tensor| {
                let mut bytes = Vec::new();
                if let Err(e) = comm.broadcast(&mut bytes, owner) {
                    *failed = Some(e);
                    return tensor;
                }
                let (shape, dtype, device) = (tensor.shape(), tensor.dtype(), tensor.device());
                drop(tensor);
                let data = TensorData::from_bytes_vec(bytes, shape, dtype);
                Tensor::<D>::from_data(data, &device).require_grad()
            })
        }
    }
    let mut exchange = Exchange {
        owners,
        comm,
        index: 0,
        failed: None,
    };
    let module = module.map(&mut exchange);
    match exchange.failed {
        Some(e) => Err(e),
        None => Ok(module),
    }
}
