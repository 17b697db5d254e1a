//! `parallel.tensor = T` (Megatron-style tensor parallel): each rank of a tensor group keeps a
//! block of every large weight, found by the parameter's HF name:
//!
//! | weight (Burn's `[in, out]` layout) | split along |
//! |---|---|
//! | `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj` (and their biases) | the output (columns): heads and KV heads, the MLP's width |
//! | `o_proj`, `down_proj` | the input (rows); their biases stay whole |
//! | LoRA on a column-parallel layer | `lora_B`'s columns (`lora_A` whole) |
//! | LoRA on a row-parallel layer | `lora_A`'s rows (`lora_B` whole) |
//! | `embed_tokens` | the vocabulary (rows) |
//! | `lm_head` | the vocabulary (columns) |
//!
//! Norms, a reward model's score head and everything else stay whole on every rank: their
//! gradients come out whole and equal on the group's ranks, because the ops between the blocks
//! (`aligner_parallel::tensor`) sum what each rank has a part of.

use std::collections::BTreeMap;
use std::sync::Arc;

use aligner_parallel::Communicator;
use aligner_parallel::tensor::{Group, TensorSplit, register, registered, split_of};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::Tensor;

use super::full::{host_values, leaf};
use crate::error::{CoreError, Result};
use crate::model::param_name;

/// The axis parameter `name` is split along (`None`: it stays whole), or why the model cannot
/// be split.
pub(crate) fn split_axis(name: &str) -> std::result::Result<Option<usize>, String> {
    const FUSED: [&str; 2] = ["qkv_proj", "gate_up_proj"];
    if let Some(fused) = FUSED.iter().find(|f| name.contains(*f)) {
        return Err(format!(
            "parallel.tensor: fused projections ({fused}, Phi-3) are not split yet; use parallel.tensor = 1"
        ));
    }
    let layer = |names: &[&str]| names.iter().any(|n| name.contains(&format!(".{n}.")));
    // Each expert of a mixture is an MLP split as the dense one (Mixtral names its gate, up
    // and down `w1`, `w3` and `w2`); the router (`mlp.gate`, `block_sparse_moe.gate`) stays
    // whole, so every rank of a group routes each token to the same experts.
    let expert = name.contains(".experts.");
    let column =
        layer(&["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]) || (expert && layer(&["w1", "w3"]));
    let row = layer(&["o_proj", "down_proj"]) || (expert && layer(&["w2"]));
    Ok(match name.rsplit_once('.').map(|(head, _)| head) {
        _ if name == "model.embed_tokens.weight" => Some(0),
        _ if name == "lm_head.weight" => Some(1),
        Some(head) if column && head.ends_with("lora_A") => None,
        Some(head) if column && head.ends_with("lora_B") => Some(1),
        Some(head) if row && head.ends_with("lora_A") => Some(0),
        Some(head) if row && head.ends_with("lora_B") => None,
        _ if column && name.ends_with(".weight") => Some(1),
        _ if column && name.ends_with(".bias") => Some(0),
        _ if row && name.ends_with(".weight") => Some(0),
        _ => None,
    })
}

/// `model` with each large weight replaced by this rank's block of it (registered, so the
/// model's layers compute their part and combine it over `group`). Refused, naming
/// `parallel.tensor`, for a model it cannot split: fused projections, OLMo 2's norm
/// over the whole query projection, or a split axis smaller than the group.
pub fn split_parameters<M: Module>(model: M, group: Arc<dyn Communicator>) -> Result<M> {
    if group.world_size() == 1 {
        return Ok(model);
    }
    // Shapes by name first: a query norm as wide as the whole projection cannot be split.
    struct Shapes(BTreeMap<String, Vec<usize>>);
    impl ModuleVisitor for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(name) = param_name(param.id.val()) {
                // A weight read as its block is checked by its whole shape.
                let dims = match registered(param.id.val()) {
                    Some(split) => split.dims,
                    None => param.val().dims().to_vec(),
                };
                self.0.insert(name, dims);
            }
        }
    }
    let mut shapes = Shapes(BTreeMap::new());
    model.visit(&mut shapes);
    let size = group.world_size();
    for (name, dims) in &shapes.0 {
        for norm in ["q_norm", "k_norm"] {
            let Some(prefix) = name.strip_suffix(&format!("{norm}.weight")) else {
                continue;
            };
            let proj = format!("{prefix}{}_proj.weight", &norm[..1]);
            if shapes
                .0
                .get(&proj)
                .is_some_and(|p| p.get(1) == dims.first() && dims[0] > 0)
            {
                return Err(CoreError::Invalid(format!(
                    "parallel.tensor: {name} normalises the whole projection (OLMo 2), which \
                     tensor parallel would split; use parallel.tensor = 1"
                )));
            }
        }
        if let Some(axis) = split_axis(name).map_err(CoreError::Invalid)?
            && dims[axis] < size
        {
            return Err(CoreError::Invalid(format!(
                "parallel.tensor = {size}: {name} has {} along the axis it is split on",
                dims[axis]
            )));
        }
    }

    struct Split(Group, usize);
    impl ModuleMapper for Split {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let id = param.id.val();
            let Some(axis) = param_name(id).and_then(|name| split_axis(&name).ok().flatten()) else {
                return param;
            };
            self.1 += 1;
            let value = param.val();
            if split_of(id, &value.dims()).is_some() {
                return param;
            }
            let split = TensorSplit {
                dims: value.dims().to_vec(),
                axis,
                group: self.0.clone(),
            };
            register(id, split.clone());
            let trainable = value.is_require_grad();
            param.map(|tensor| {
                let device = tensor.device();
                let own = split.block_values(&host_values(tensor), self.0.0.rank());
                leaf(own, split.local_dims(), &device, trainable)
            })
        }
    }
    let mut split = Split(Group(group), 0);
    let model = model.map(&mut split);
    if split.1 == 0 {
        // Its weights do not carry their HF names (a model built in memory): nothing to split
        // by, and every rank would hold the whole model.
        return Err(CoreError::Invalid(
            "parallel.tensor: none of this model's weights is named as a checkpoint names it \
             (aligner_core::checkpoint::name_parameters names a model built in memory)"
                .into(),
        ));
    }
    tracing::info!(
        parameters = split.1,
        ranks = size,
        "tensor parallel: split the weights over the group"
    );
    Ok(model)
}

/// A copy of `model` with every split parameter whole again (a collective over the group:
/// its ranks call it together and get the same model). The final save, `keep_best`, the
/// frontier and PPO/GRPO's engines use it.
pub fn gather_parameters<M: Module>(model: &M) -> M {
    gather(model, None).0
}

/// [`gather_parameters`] received by the group's rank 0 alone (a checkpoint's writer): the
/// others send their blocks of each parameter in turn and keep nothing, so none of them ever
/// holds more than its blocks and one parameter. `None` on the other ranks.
pub fn gather_parameters_to_root<M: Module>(model: &M) -> Option<M> {
    let (model, received) = gather(model, Some(0));
    received.then_some(model)
}

/// `model`, read split over a tensor group, with parameter ids of its own (each derived from
/// its id and `salt`), its splits registered under them. Parameters are named by their HF
/// names, and a split is registered by id: a second split model whose weights carry the
/// trained model's names (a distillation teacher) must take ids of its own, before the model
/// with the names is read (whose registrations would otherwise be overwritten by its own).
pub fn with_own_ids<M: Module>(model: M, salt: u64) -> M {
    struct OwnIds(u64);
    impl ModuleMapper for OwnIds {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let old = param.id.val();
            let new = old.rotate_left(29) ^ self.0;
            let (_, value, mapper) = param.consume();
            if let Some(split) = split_of(old, &value.dims()) {
                register(new, split);
            }
            Param::from_mapped_value(burn::module::ParamId::from(new), value, mapper)
        }
    }
    model.map(&mut OwnIds(salt))
}

/// `model` whole on the writer of `run` (world rank 0) alone, `None` on the other ranks: in
/// tensor groups the writer's group sends it their blocks of each parameter in turn (a
/// collective for that group; the other groups take no part), otherwise `model` itself. What
/// the writer alone computes on (the frontier's samples) without a whole copy on every rank.
pub fn whole_on_writer<'m, M: Module>(
    model: &'m M,
    run: &crate::run::RunDir,
) -> Option<std::borrow::Cow<'m, M>> {
    super::stream::SaveParts::of(run, false, run.tensor_group().is_some()).whole_on_writer(model, run)
}

/// `model` with its split parameters gathered whole on every rank (`root` None) or on `root`
/// alone, and whether this rank received them (the others keep their blocks).
fn gather<M: Module>(model: &M, root: Option<usize>) -> (M, bool) {
    struct Gather {
        root: Option<usize>,
        received: bool,
    }
    impl ModuleMapper for Gather {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let value = param.val();
            let Some(split) = split_of(param.id.val(), &value.dims()) else {
                return param;
            };
            let trainable = value.is_require_grad();
            let own = host_values(value);
            let whole = match self.root {
                None => Some(split.gather_values(&own)),
                Some(root) => split.gather_values_to(&own, root),
            };
            drop(own);
            let Some(whole) = whole else {
                self.received = false;
                return param;
            };
            param.map(|tensor| leaf(whole, split.dims.clone(), &tensor.device(), trainable))
        }
    }
    let mut gather = Gather { root, received: true };
    let model = model.clone().map(&mut gather);
    (model, gather.received)
}

/// Whether parameter `id` is split over the group (its gradient's square counts once per
/// block); the others are whole and equal on every rank of the group.
pub fn is_split(id: u64) -> bool {
    registered(id).is_some()
}

/// One tensor of an optimizer state: name, type, shape, parameter id and bytes.
type StateTensor = (
    String,
    burn::tensor::DType,
    Vec<usize>,
    Option<u64>,
    burn::tensor::Bytes,
);

/// The tensors of an optimizer state (burnpack bytes, as AdamW saves them) in the file's
/// order, with its scalars and metadata.
struct StateParts {
    tensors: Vec<StateTensor>,
    scalars: Vec<(String, burn_pack::Scalar)>,
    metadata: Vec<(String, String)>,
}

/// A scratch file, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `adam`'s state saved to the scratch file `scratch` (streamed) and read back lazily: each
/// tensor's bytes are read from the file when used, so the state is never held a second time
/// (AdamW's in-memory encoding would hold it twice more while it is made). The file goes when
/// the returned guard does.
fn saved_state(
    adam: &burn::optim::ModuleOptimizer,
    scratch: std::path::PathBuf,
) -> Result<(StateParts, Scratch)> {
    let scratch = Scratch(scratch);
    super::save_optimizer(adam, &scratch.0)?;
    let bad =
        |e: burn_pack::Error| CoreError::Invalid(format!("{}: optimizer state: {e:?}", scratch.0.display()));
    let reader = burn_pack::Reader::from_file_exact(&scratch.0).map_err(bad)?;
    Ok((state_parts(reader)?, scratch))
}

fn state_parts(reader: burn_pack::Reader) -> Result<StateParts> {
    let bad = |e: burn_pack::Error| CoreError::Invalid(format!("optimizer state: {e:?}"));
    let scalars = reader.scalars().iter().map(|(k, v)| (k.clone(), *v)).collect();
    let metadata = reader
        .metadata()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let tensors = reader
        .into_tensors()
        .map_err(bad)?
        .into_iter()
        .map(|tensor| {
            let (name, dtype, shape, id, bytes) = tensor.into_parts().map_err(bad)?;
            Ok((name, dtype, shape.to_vec(), id, bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(StateParts {
        tensors,
        scalars,
        metadata,
    })
}

/// On a rank of the writer's tensor group other than the writer (its rank 0): sends the
/// writer this rank's block of each split parameter's moments, one tensor at a time in the
/// order of the file, as [`write_gathered_optimizer_state`] receives them. The state is
/// staged in the file `scratch` meanwhile (removed after; a killed run's is removed by the
/// next run in the folder).
pub fn send_optimizer_blocks(adam: &burn::optim::ModuleOptimizer, scratch: &std::path::Path) -> Result<()> {
    if let Some(dir) = scratch.parent() {
        std::fs::create_dir_all(dir).map_err(|e| CoreError::cannot_write(dir, e))?;
    }
    let (parts, _scratch) = saved_state(adam, scratch.to_path_buf())?;
    for (_, dtype, shape, id, bytes) in parts.tensors {
        if let Some(split) = id.and_then(|id| split_of(id, &shape)) {
            split.gather_values_to(&floats(&bytes, dtype)?, 0);
        }
    }
    Ok(())
}

/// Writes into `path`, on the writer (the group's rank 0), the optimizer state of the whole
/// model from `own`, its own state: each split parameter's moments are gathered from the
/// group's blocks (sent by [`send_optimizer_blocks`]) as the file reaches them, joined and
/// dropped once written. The writer holds its own state and one joined tensor, never the
/// other ranks' states beside it; the file (streamed to a scratch file renamed into place)
/// is what one process training the model would save, which any layout loads.
pub fn write_gathered_optimizer_state(
    adam: &burn::optim::ModuleOptimizer,
    path: &std::path::Path,
) -> Result<()> {
    let (parts, _scratch) = saved_state(adam, path.with_extension("own.tmp"))?;
    let tensors = parts
        .tensors
        .into_iter()
        .map(
            |(name, dtype, shape, id, bytes)| match id.and_then(|id| split_of(id, &shape)) {
                Some(split) => {
                    let len = split.dims.iter().product::<usize>() * 4;
                    let dims = split.dims.clone();
                    burn_pack::Tensor::deferred(name, burn::tensor::DType::F32, dims, id, len, move || {
                        let block = floats(&bytes, dtype)
                            .map_err(|e| burn_pack::Error::ValidationError(e.to_string()))?;
                        let whole = split.gather_values_to(&block, 0).ok_or_else(|| {
                            burn_pack::Error::ValidationError(
                                "only the group's rank 0 writes the optimizer state".into(),
                            )
                        })?;
                        Ok(burn::tensor::Bytes::from_bytes_vec(f32_bytes(&whole)))
                    })
                }
                None => burn_pack::Tensor::new(name, dtype, shape, id, bytes),
            },
        )
        .collect();
    let mut writer = burn_pack::Writer::new(tensors).auto_extension(false);
    for (key, value) in &parts.scalars {
        writer = writer.with_scalar(key, *value);
    }
    for (key, value) in &parts.metadata {
        writer = writer.with_metadata(key, value);
    }
    writer
        .write_to_file(path)
        .map_err(|e| CoreError::Invalid(format!("{}: optimizer state: {e:?}", path.display())))
}

/// This rank's optimizer state out of `bytes`, a whole model's (as [`write_joined_optimizer_state`]
/// or one process saves it): each split parameter's moments cut to this rank's block.
pub fn split_optimizer_state(bytes: Vec<u8>) -> Result<Vec<u8>> {
    let bad = |e: burn_pack::Error| CoreError::Invalid(format!("optimizer state: {e:?}"));
    let reader = burn_pack::Reader::from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes)).map_err(bad)?;
    let scalars: Vec<(String, burn_pack::Scalar)> =
        reader.scalars().iter().map(|(k, v)| (k.clone(), *v)).collect();
    let metadata: Vec<(String, String)> = reader
        .metadata()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut out = Vec::new();
    for tensor in reader.into_tensors().map_err(bad)? {
        let (name, dtype, shape, id, bytes) = tensor.into_parts().map_err(bad)?;
        let tensor = match id.and_then(registered) {
            Some(split) if shape.to_vec() == split.dims => {
                let own = split.block_values(&floats(&bytes, dtype)?, split.group.0.rank());
                burn_pack::Tensor::new(
                    name,
                    burn::tensor::DType::F32,
                    split.local_dims(),
                    id,
                    burn::tensor::Bytes::from_bytes_vec(f32_bytes(&own)),
                )
            }
            _ => burn_pack::Tensor::new(
                name,
                dtype,
                shape.to_vec(),
                id,
                burn::tensor::Bytes::from_bytes_vec(bytes.to_vec()),
            ),
        };
        out.push(tensor);
    }
    pack(out, &scalars, &metadata)
}

fn pack(
    tensors: Vec<burn_pack::Tensor>,
    scalars: &[(String, burn_pack::Scalar)],
    metadata: &[(String, String)],
) -> Result<Vec<u8>> {
    let mut writer = burn_pack::Writer::new(tensors);
    for (key, value) in scalars {
        writer = writer.with_scalar(key, *value);
    }
    for (key, value) in metadata {
        writer = writer.with_metadata(key, value);
    }
    Ok(writer
        .into_bytes()
        .map_err(|e| CoreError::Invalid(format!("optimizer state: {e:?}")))?
        .to_vec())
}

/// A moment's values as f32 (they are stored in f32; f64 is read too).
fn floats(bytes: &[u8], dtype: burn::tensor::DType) -> Result<Vec<f32>> {
    match dtype {
        burn::tensor::DType::F32 => Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()),
        burn::tensor::DType::F64 => Ok(bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f32)
            .collect()),
        other => Err(CoreError::Invalid(format!(
            "optimizer state: a split parameter's moment in {other:?}"
        ))),
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_split_as_megatron_does() {
        let axis = |n: &str| split_axis(n).unwrap();
        assert_eq!(axis("model.layers.0.self_attn.q_proj.weight"), Some(1));
        assert_eq!(axis("model.layers.0.self_attn.q_proj.bias"), Some(0));
        assert_eq!(axis("model.layers.3.mlp.up_proj.weight"), Some(1));
        assert_eq!(axis("model.layers.0.self_attn.o_proj.weight"), Some(0));
        assert_eq!(axis("model.layers.0.self_attn.o_proj.bias"), None);
        assert_eq!(axis("model.layers.0.mlp.down_proj.weight"), Some(0));
        assert_eq!(axis("model.layers.0.self_attn.q_proj.lora_A.weight"), None);
        assert_eq!(axis("model.layers.0.self_attn.q_proj.lora_B.weight"), Some(1));
        assert_eq!(axis("model.layers.0.mlp.down_proj.lora_A.weight"), Some(0));
        assert_eq!(axis("model.layers.0.mlp.down_proj.lora_B.weight"), None);
        assert_eq!(axis("model.embed_tokens.weight"), Some(0));
        assert_eq!(axis("lm_head.weight"), Some(1));
        assert_eq!(axis("model.layers.0.input_layernorm.weight"), None);
        assert_eq!(axis("model.norm.weight"), None);
        assert_eq!(axis("score.weight"), None);
        assert!(split_axis("model.layers.0.self_attn.qkv_proj.weight").is_err());
        assert_eq!(axis("model.layers.0.mlp.experts.1.up_proj.weight"), Some(1));
        assert_eq!(axis("model.layers.0.mlp.experts.1.down_proj.weight"), Some(0));
        assert_eq!(axis("model.layers.0.mlp.gate.weight"), None);
        assert_eq!(
            axis("model.layers.1.block_sparse_moe.experts.0.w1.weight"),
            Some(1)
        );
        assert_eq!(
            axis("model.layers.1.block_sparse_moe.experts.0.w3.weight"),
            Some(1)
        );
        assert_eq!(
            axis("model.layers.1.block_sparse_moe.experts.0.w2.weight"),
            Some(0)
        );
        assert_eq!(
            axis("model.layers.1.block_sparse_moe.experts.0.w2.lora_B.weight"),
            None
        );
        assert_eq!(axis("model.layers.1.block_sparse_moe.gate.weight"), None);
    }
}
