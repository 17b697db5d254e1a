//! Master weights of a half-precision run. Its checkpoints save the model in bf16 / f16, as HF
//! saves a model loaded in that type, and the f32 weights training continues from beside them
//! in `master.safetensors` (keyed by parameter id), so a resumed run continues exactly where
//! it stopped rather than from rounded weights.

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use safetensors::SafeTensors;

use crate::checkpoint::{PendingTensor, pending_param, write_pending_safetensors};
use crate::config::Precision;
use crate::error::{CoreError, Result};
use crate::store::ModelStore;

/// The file of a checkpoint folder holding the f32 master weights.
pub const MASTER_WEIGHTS: &str = "master.safetensors";

/// Saves `model` through `store` into `dir` and, when the store rounds the weights to half
/// precision, its f32 master weights beside them ([`MASTER_WEIGHTS`]).
pub fn save_with_masters<M: Module>(store: &dyn ModelStore<M>, model: &M, dir: &Path) -> Result<()> {
    store.save(model, dir)?;
    if store.precision() != Precision::F32 {
        save_master_weights(model, &dir.join(MASTER_WEIGHTS))?;
    }
    Ok(())
}

/// Loads what [`save_with_masters`] wrote: the model folder, its weights replaced by the master
/// weights where `dir` has them.
pub fn load_with_masters<M: Module>(
    store: &dyn ModelStore<M>,
    dir: &Path,
    device: &burn::tensor::Device,
) -> Result<M> {
    let model = store.load(dir, device)?;
    let masters = dir.join(MASTER_WEIGHTS);
    if masters.exists() {
        load_master_weights(model, &masters)
    } else {
        Ok(model)
    }
}

/// Writes every float parameter of `model` in f32 to `path`, named by parameter id, each
/// read as the file reaches it (gathered whole when the ranks hold it in parts, see
/// [`crate::checkpoint::PartsSource`]).
pub fn save_master_weights<M: Module>(model: &M, path: &Path) -> Result<()> {
    struct Collect(Vec<PendingTensor<'static>>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let (mut pending, whole_id) = pending_param(String::new(), param, false);
            pending.name = ParamId::from(whole_id).to_string();
            self.0.push(pending);
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    write_pending_safetensors(path, collect.0, Precision::F32)
}

/// `model` with every float parameter replaced by its f32 value saved in `path` by
/// [`save_master_weights`]; a parameter the file lacks, or holds in another shape, is an
/// error naming the file.
pub fn load_master_weights<M: Module>(model: M, path: &Path) -> Result<M> {
    let bytes = std::fs::read(path).map_err(|e| CoreError::io(path, e))?;
    let bad = |message: String| CoreError::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let parsed = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut values: HashMap<String, (Vec<usize>, Vec<f32>)> = HashMap::new();
    for (name, view) in parsed.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(bad(format!(
                "tensor {name:?} is {:?}, master weights are F32",
                view.dtype()
            )));
        }
        let data = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        values.insert(name, (view.shape().to_vec(), data));
    }
    struct Replace {
        values: HashMap<String, (Vec<usize>, Vec<f32>)>,
        problem: Option<String>,
    }
    impl ModuleMapper for Replace {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let id = param.id.to_string();
            let Some((shape, data)) = self.values.remove(&id) else {
                self.problem
                    .get_or_insert(format!("no tensor for parameter {id}"));
                return param;
            };
            let problem = &mut self.problem;
            param.map(|old| {
                if shape != old.dims() {
                    problem.get_or_insert(format!(
                        "parameter {id} is {:?} in the model and {shape:?} in the file",
                        old.dims()
                    ));
                    return old;
                }
                let fresh = Tensor::<D>::from_data(TensorData::new(data, shape), &old.device());
                if old.is_require_grad() {
                    fresh.require_grad()
                } else {
                    fresh
                }
            })
        }
    }
    let mut replace = Replace {
        values,
        problem: None,
    };
    let model = model.map(&mut replace);
    match replace.problem {
        Some(problem) => Err(bad(format!("master weights: {problem}"))),
        None => Ok(model),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LlamaConfig;
    use crate::model::CausalLm;
    use burn::tensor::Device;

    fn values(model: &CausalLm) -> Vec<f32> {
        crate::checkpoint::hf_tensors(model)
            .into_iter()
            .flat_map(|(_, _, v)| v)
            .collect()
    }

    #[test]
    fn master_weights_come_back_exactly_and_only_onto_the_same_parameters() {
        let device = Device::flex();
        let config = LlamaConfig::llama(32, 16, 1, 2, 1, 24);
        let saved = CausalLm::new(&config, &device);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MASTER_WEIGHTS);
        save_master_weights(&saved, &path).unwrap();
        // The same parameters (ids) holding other values take the saved ones back, bit for bit.
        let zeroed = saved.clone().map(&mut Zero);
        assert_ne!(values(&zeroed), values(&saved));
        let restored = load_master_weights(zeroed, &path).unwrap();
        assert_eq!(values(&restored), values(&saved));
        // Another model's parameters (fresh ids) are refused, naming the file.
        let other = CausalLm::new(&config, &device);
        let err = load_master_weights(other, &path).unwrap_err().to_string();
        assert!(
            err.contains(MASTER_WEIGHTS) && err.contains("no tensor for parameter"),
            "{err}"
        );
    }

    struct Zero;
    impl ModuleMapper for Zero {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| t.zeros_like())
        }
    }
}
