//! `train.sharding = "full"` (ZeRO stage 3): each rank keeps its block of rows of every
//! parameter, trainable or frozen; the model's ops gather a whole weight while they use it and
//! reduce-scatter its gradient in the backward (`aligner_parallel::shard`), so the gradients
//! a step hands the optimizer are already this rank's rows, and AdamW's moments follow.

use std::sync::Arc;

use aligner_parallel::Communicator;
use aligner_parallel::shard::{ShardSpec, register, shard_id, spec_of, whole_id};
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Device, Tensor, TensorData};

use crate::error::{CoreError, Result};

/// `model` with each parameter replaced by this rank's rows of it (registered, so the model's
/// ops gather it where they use it): the trainable ones and the frozen ones (LoRA's base,
/// which the ops gather without reducing a gradient). A trainable parameter with fewer rows
/// than ranks is refused; a frozen one stays whole.
pub fn shard_parameters<M: Module>(model: M, comm: Arc<dyn Communicator>) -> Result<M> {
    struct Shard {
        comm: Arc<dyn Communicator>,
        refused: Option<String>,
    }
    impl ModuleMapper for Shard {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let value = param.val();
            if spec_of(param.id.val(), &value.dims()).is_some() {
                return param;
            }
            let trainable = value.is_require_grad();
            let dims = value.dims().to_vec();
            let world = self.comm.world_size();
            if dims[0] < world {
                // A frozen tensor this small stays whole; a trainable one cannot.
                if trainable {
                    self.refused.get_or_insert(format!(
                        "train.sharding = \"full\": a parameter of shape {dims:?} has fewer rows than \
                         the {world} ranks it would be split over; use \"gradients\" or fewer ranks"
                    ));
                }
                return param;
            }
            let spec = ShardSpec {
                dims: dims.clone(),
                comm: self.comm.clone(),
            };
            let rows = spec.rows(self.comm.rank());
            let row: usize = dims[1..].iter().product();
            let shard_dims = spec.shard_dims();
            // The shard carries an id of its own (see `shard_id`).
            let id = shard_id(param.id.val());
            register(id, spec);
            let (_, tensor, mapper) = param.consume();
            Param::from_mapped_value(ParamId::from(id), tensor, mapper).map(|tensor| {
                let device = tensor.device();
                let values = host_values(tensor);
                let own = values[rows.start * row..rows.end * row].to_vec();
                drop(values);
                leaf(own, shard_dims, &device, trainable)
            })
        }
    }
    let mut shard = Shard { comm, refused: None };
    let model = model.map(&mut shard);
    match shard.refused {
        Some(why) => Err(CoreError::Invalid(why)),
        None => Ok(model),
    }
}

/// A copy of `model` with every sharded parameter whole again (a collective: every rank
/// calls it and gets the same model). Evaluation and the final save use it.
pub fn gather_parameters<M: Module>(model: &M) -> M {
    gather(model, None).0
}

/// [`gather_parameters`] received by rank 0 of the ranks alone (a checkpoint's writer): every
/// rank sends its rows of each parameter in turn, and the others keep nothing of the rest, so
/// no rank but rank 0 ever holds more than its shard and one parameter. `None` on the others.
pub fn gather_parameters_to_root<M: Module>(model: &M) -> Option<M> {
    let (model, received) = gather(model, Some(0));
    received.then_some(model)
}

/// `model` with its sharded parameters gathered whole on every rank (`root` None) or on
/// `root` alone, and whether this rank received them (the others keep their shards).
fn gather<M: Module>(model: &M, root: Option<usize>) -> (M, bool) {
    struct Gather {
        root: Option<usize>,
        received: bool,
    }
    impl ModuleMapper for Gather {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let value = param.val();
            let Some(spec) = spec_of(param.id.val(), &value.dims()) else {
                return param;
            };
            let trainable = value.is_require_grad();
            let own = host_values(value);
            let whole = match self.root {
                None => Some(spec.gather_values(&own)),
                Some(root) => spec.gather_values_to(&own, root),
            };
            drop(own);
            let Some(whole) = whole else {
                self.received = false;
                return param;
            };
            let (id, tensor, mapper) = param.consume();
            let id = ParamId::from(whole_id(id.val()));
            Param::from_mapped_value(id, tensor, mapper)
                .map(|tensor| leaf(whole, spec.dims.clone(), &tensor.device(), trainable))
        }
    }
    let mut gather = Gather { root, received: true };
    let model = model.clone().map(&mut gather);
    (model, gather.received)
}

/// A parameter's values, row-major f32.
pub(crate) fn host_values<const D: usize>(tensor: Tensor<D>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default()
}

/// `values` of shape `dims` as a parameter's tensor on `device`, tracking its gradient when it
/// is `trainable`.
pub(crate) fn leaf<const D: usize>(
    values: Vec<f32>,
    dims: Vec<usize>,
    device: &Device,
    trainable: bool,
) -> Tensor<D> {
    let dims: [usize; D] = dims.try_into().unwrap_or_else(|_| unreachable!("rank D"));
    let tensor = Tensor::<D>::from_data(TensorData::new(values, dims), device);
    if trainable { tensor.require_grad() } else { tensor }
}
