//! Hugging Face checkpoint folders in and out: `config.json`, `model.safetensors` (or shards
//! listed in `model.safetensors.index.json`) and the tokenizer files beside them.
//!
//! Tensor names are HF's (`model.layers.N.self_attn.q_proj.weight`, ...). Linear weights are
//! `[out, in]` on disk and `[in, out]` in Burn; the conversion is a transpose both ways, so a
//! save/load round trip is bit-identical. F32, F16 and BF16 files load (into f32); saves are F32.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aligner_parallel::Communicator;
use aligner_parallel::tensor::{Group, TensorSplit, register};

use burn::module::Param;
use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};

use crate::config::{LlamaConfig, Precision};
use crate::error::{CoreError, Result};
use crate::model::{CausalLm, DecoderLayer, LlamaModel, RmsNorm, named_param};

/// Files copied along with the weights when a model folder is saved.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
];

/// One tensor-holding part of a model, under its HF name prefix.
pub enum Slot<'a> {
    Linear(&'a mut Linear),
    Norm(&'a mut RmsNorm),
    Embedding(&'a mut Embedding),
}

/// The parts of a decoder trunk with their HF name prefixes, in file order.
pub fn trunk_slots(model: &mut LlamaModel) -> Vec<(String, Slot<'_>)> {
    let mut out = vec![(
        "model.embed_tokens".to_string(),
        Slot::Embedding(&mut model.embed_tokens),
    )];
    for (i, layer) in model.layers.iter_mut().enumerate() {
        let p = format!("model.layers.{i}");
        let names = layer.norm_names();
        let DecoderLayer {
            attn_norm_in,
            self_attn: attn,
            attn_norm_out,
            mlp_norm_in,
            mlp,
            mlp_norm_out,
        } = layer;
        let norms = [attn_norm_in, attn_norm_out, mlp_norm_in, mlp_norm_out];
        for (name, norm) in names.into_iter().zip(norms) {
            if let Some(norm) = norm.as_mut() {
                out.push((format!("{p}.{name}"), Slot::Norm(norm)));
            }
        }
        for (name, proj) in attn.projection_names().iter().zip(attn.qkv.iter_mut()) {
            out.push((format!("{p}.self_attn.{name}"), Slot::Linear(&mut proj.base)));
        }
        out.push((
            format!("{p}.self_attn.o_proj"),
            Slot::Linear(&mut attn.o_proj.base),
        ));
        if let Some(norm) = attn.q_norm.as_mut() {
            out.push((format!("{p}.self_attn.q_norm"), Slot::Norm(norm)));
        }
        if let Some(norm) = attn.k_norm.as_mut() {
            out.push((format!("{p}.self_attn.k_norm"), Slot::Norm(norm)));
        }
        let parts = mlp.named_parts_mut();
        if let Some((name, router)) = parts.router {
            out.push((format!("{p}.{name}"), Slot::Linear(router)));
        }
        for (name, proj) in parts.projections {
            out.push((format!("{p}.{name}"), Slot::Linear(&mut proj.base)));
        }
    }
    out.push(("model.norm".to_string(), Slot::Norm(&mut model.norm)));
    out
}

/// Every part of a causal LM: the trunk, then `lm_head` when untied.
fn slots(model: &mut CausalLm) -> Vec<(String, Slot<'_>)> {
    let mut out = trunk_slots(&mut model.model);
    if let Some(head) = model.lm_head.as_mut() {
        out.push(("lm_head".to_string(), Slot::Linear(head)));
    }
    out
}

/// Gives every weight of `model` the id of its HF name, as loading a checkpoint does (a model
/// built in memory, e.g. randomly initialised, has ids of its own): what tensor parallel finds
/// the weights it splits by, and what optimizer state saved against a checkpoint re-attaches to.
pub fn name_parameters(model: &mut CausalLm) {
    fn rename<const D: usize>(param: &mut Param<Tensor<D>>, name: &str) {
        *param = named_param(name, param.val());
    }
    for (prefix, slot) in slots(model) {
        let weight = format!("{prefix}.weight");
        match slot {
            Slot::Linear(linear) => {
                rename(&mut linear.weight, &weight);
                if let Some(bias) = linear.bias.as_mut() {
                    rename(bias, &format!("{prefix}.bias"));
                }
            }
            Slot::Norm(norm) => rename(&mut norm.gamma, &weight),
            Slot::Embedding(embedding) => rename(&mut embedding.weight, &weight),
        }
    }
}

/// The tensors whose rows are the vocabulary's ids.
const VOCABULARY_TENSORS: [&str; 2] = ["model.embed_tokens.weight", "lm_head.weight"];

/// The safetensors files of a folder, memory-mapped (a 0.5B model's 2 GB are not copied into
/// memory before each tensor is converted), and which file holds each tensor.
struct TensorFiles {
    dir: PathBuf,
    files: Vec<(PathBuf, memmap2::Mmap)>,
    index: HashMap<String, usize>,
    /// Read the vocabulary's tensors (the embedding and the output projection) as their
    /// first rows where the files hold more (see [`load_causal_lm_split_first_rows`]).
    first_vocab_rows: bool,
}

impl TensorFiles {
    fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let names: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| CoreError::io(&index_path, e))?;
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|source| CoreError::Json {
                path: index_path.clone(),
                source,
            })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| CoreError::Config {
                    path: index_path.clone(),
                    message: "no \"weight_map\" object".into(),
                })?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            shards.sort();
            shards.dedup();
            shards
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for name in names {
            let path = dir.join(&name);
            let file = std::fs::File::open(&path).map_err(|e| CoreError::io(&path, e))?;
            // SAFETY: the map is only read, while the folder is loaded; a checkpoint replaced
            // meanwhile is renamed over (checkpoint::write_atomic), which leaves this inode's
            // pages as they were.
            let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| CoreError::io(&path, e))?;
            let parsed = SafeTensors::deserialize(&bytes).map_err(|e| CoreError::Safetensors {
                path: path.clone(),
                message: e.to_string(),
            })?;
            for tensor in parsed.names() {
                index.insert(tensor.to_string(), files.len());
            }
            files.push((path, bytes));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            index,
            first_vocab_rows: false,
        })
    }

    fn names(&self) -> HashSet<&str> {
        self.index.keys().map(String::as_str).collect()
    }

    /// The tensor `name` as f32, checked against `expected` (HF layout).
    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        self.read_block(name, expected, None)
    }

    /// The tensor `name` as f32, checked against `expected` (HF layout); with `block` =
    /// `(axis, range)`, only that block of it along that axis (a tensor group's rank's part:
    /// the other ranks' values are never decoded).
    fn read_block(
        &self,
        name: &str,
        expected: &[usize],
        block: Option<(usize, std::ops::Range<usize>)>,
    ) -> Result<Vec<f32>> {
        let file = *self.index.get(name).ok_or_else(|| CoreError::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
        })?;
        let (path, bytes) = &self.files[file];
        let parsed = SafeTensors::deserialize(bytes).map_err(|e| CoreError::Safetensors {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let view = parsed.tensor(name).map_err(|e| CoreError::Safetensors {
            path: path.clone(),
            message: format!("tensor {name:?}: {e}"),
        })?;
        let shape = view.shape();
        // A vocabulary read as its first rows: the block (or the rows) taken from the whole
        // tensor of the file. HF keeps both tensors `[vocab, hidden]`.
        let (expected, block) = match block {
            _ if self.first_vocab_rows
                && VOCABULARY_TENSORS.contains(&name)
                && shape.len() == 2
                && shape[1..] == expected[1..]
                && shape[0] > expected[0] =>
            {
                let rows = expected[0];
                (shape, Some(block.unwrap_or((0, 0..rows))))
            }
            block => (expected, block),
        };
        if shape != expected {
            return Err(CoreError::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                found: shape.to_vec(),
            });
        }
        let values = match block {
            None => decode_f32(name, view.dtype(), view.data())?,
            Some((axis, range)) => {
                let size = view.data().len() / expected.iter().product::<usize>().max(1);
                let inner: usize = expected[axis + 1..].iter().product();
                let outer: usize = expected[..axis].iter().product();
                let n = expected[axis];
                let mut values = Vec::with_capacity(outer * range.len() * inner);
                for o in 0..outer {
                    let from = (o * n + range.start) * inner * size;
                    let to = (o * n + range.end) * inner * size;
                    values.extend(decode_f32(name, view.dtype(), &view.data()[from..to])?);
                }
                values
            }
        };
        // Copied out: the file's pages of this tensor leave memory (a 0.5B model's 2 GB of
        // pages would otherwise count beside its loaded weights until the folder is closed).
        let offset = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
        // SAFETY: the map is read-only and backed by the file, never written: dropped pages
        // are read from the file again if touched, with the same contents.
        let _ = unsafe {
            bytes.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, view.data().len())
        };
        // A diverged run's weights: refused here rather than trained or sampled from.
        if let Some(at) = values.iter().position(|v| !v.is_finite()) {
            return Err(CoreError::Safetensors {
                path: path.clone(),
                message: format!(
                    "tensor {name:?} holds {} at index {at}: the weights are not finite",
                    values[at]
                ),
            });
        }
        Ok(values)
    }
}

fn decode_f32(name: &str, dtype: Dtype, data: &[u8]) -> Result<Vec<f32>> {
    let pairs = || data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
    Ok(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => pairs().map(|b| half::f16::from_bits(b).to_f32()).collect(),
        Dtype::BF16 => pairs().map(|b| half::bf16::from_bits(b).to_f32()).collect(),
        other => {
            return Err(CoreError::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

/// Loads the weights of a HF folder into a model built for `config`.
pub fn load_causal_lm(dir: &Path, config: &LlamaConfig, device: &Device) -> Result<CausalLm> {
    let mut model = CausalLm::new(config, device);
    load_slots(dir, config, slots(&mut model), device)?;
    Ok(model)
}

/// [`load_causal_lm`] for a rank of tensor group `group` (`parallel.tensor`): each weight
/// tensor parallel splits (`train::tensor`) is read as this rank's block of it alone and
/// registered as split, so no rank ever holds the whole model. Refused, naming
/// `parallel.tensor`, for what tensor parallel cannot split.
pub fn load_causal_lm_split(
    dir: &Path,
    config: &LlamaConfig,
    device: &Device,
    group: &Arc<dyn Communicator>,
) -> Result<CausalLm> {
    load_causal_lm_split_in(dir, config, device, group, false)
}

/// [`load_causal_lm_split`] of a model whose files hold more vocabulary rows than `config`'s
/// `vocab_size`: the embedding and the output projection are read as their first
/// `vocab_size` rows (a distillation teacher whose vocabulary is padded past the ids its
/// student shares, cut to the student's so their blocks line up).
pub fn load_causal_lm_split_first_rows(
    dir: &Path,
    config: &LlamaConfig,
    device: &Device,
    group: &Arc<dyn Communicator>,
) -> Result<CausalLm> {
    load_causal_lm_split_in(dir, config, device, group, true)
}

fn load_causal_lm_split_in(
    dir: &Path,
    config: &LlamaConfig,
    device: &Device,
    group: &Arc<dyn Communicator>,
    first_vocab_rows: bool,
) -> Result<CausalLm> {
    let mut model = CausalLm::new(config, device);
    check_splittable(config)?;
    let split = load_slots_in(
        dir,
        config,
        slots(&mut model),
        device,
        Some(group),
        first_vocab_rows,
    )?;
    tracing::info!(
        parameters = split,
        ranks = group.world_size(),
        "tensor parallel: read this rank's blocks of the split weights"
    );
    Ok(model)
}

/// Fills `slots` from the safetensors of `dir`; tensors the slots do not use are logged.
pub fn load_slots(
    dir: &Path,
    config: &LlamaConfig,
    slots: Vec<(String, Slot<'_>)>,
    device: &Device,
) -> Result<()> {
    load_slots_in(dir, config, slots, device, None, false).map(drop)
}

/// [`load_slots`] for a rank of tensor group `group`: the weights tensor parallel splits are
/// read as this rank's blocks alone (and registered as split), the rest whole; returns how
/// many were split. Refused, naming `parallel.tensor`, for a model whose norms tensor
/// parallel would cut (OLMo 2's q_norm).
pub fn load_slots_split(
    dir: &Path,
    config: &LlamaConfig,
    slots: Vec<(String, Slot<'_>)>,
    device: &Device,
    group: &Arc<dyn Communicator>,
) -> Result<usize> {
    check_splittable(config)?;
    load_slots_in(dir, config, slots, device, Some(group), false)
}

/// Refused, naming `parallel.tensor`, for a model whose norms tensor parallel would cut
/// (OLMo 2's q_norm).
fn check_splittable(config: &LlamaConfig) -> Result<()> {
    if config.qk_norm() == crate::config::QkNorm::Whole {
        return Err(CoreError::Invalid(
            "parallel.tensor: this model's q_norm normalises the whole projection (OLMo 2), \
             which tensor parallel would split; use parallel.tensor = 1"
                .into(),
        ));
    }
    Ok(())
}

/// The tensor `name` of Burn shape `dims` (`transposed`: `[out, in]` on disk), whole, or,
/// in tensor group `group`, this rank's block of it when tensor parallel splits it.
fn load_param<const D: usize>(
    files: &TensorFiles,
    name: &str,
    dims: [usize; D],
    transposed: bool,
    group: Option<&Arc<dyn Communicator>>,
    device: &Device,
) -> Result<Param<Tensor<D>>> {
    let on_disk = |mut d: [usize; D]| {
        if transposed {
            d.reverse();
        }
        d
    };
    let axis = match group {
        Some(_) => crate::train::tensor::split_axis(name).map_err(CoreError::Invalid)?,
        None => None,
    };
    let split = match (axis, group) {
        (Some(axis), Some(group)) => {
            if dims[axis] < group.world_size() {
                return Err(CoreError::Invalid(format!(
                    "parallel.tensor = {}: {name} has {} along the axis it is split on",
                    group.world_size(),
                    dims[axis]
                )));
            }
            Some(TensorSplit {
                dims: dims.to_vec(),
                axis,
                group: Group(group.clone()),
            })
        }
        _ => None,
    };
    // The whole tensor, or this rank's block of it (read as a block: the rest is not decoded).
    let mut shape = on_disk(dims);
    let values = match &split {
        None => files.read(name, &shape)?,
        Some(split) => {
            let range = split.own_range();
            let disk_axis = if transposed {
                D - 1 - split.axis
            } else {
                split.axis
            };
            let values = files.read_block(name, &shape, Some((disk_axis, range.clone())))?;
            shape[disk_axis] = range.len();
            values
        }
    };
    let tensor = Tensor::<D>::from_data(TensorData::new(values, shape), device);
    let tensor = match transposed {
        true => tensor.transpose(),
        false => tensor,
    };
    let param = named_param(name, tensor);
    if let Some(split) = split {
        register(param.id.val(), split);
    }
    Ok(param)
}

fn load_slots_in(
    dir: &Path,
    config: &LlamaConfig,
    slots: Vec<(String, Slot<'_>)>,
    device: &Device,
    group: Option<&Arc<dyn Communicator>>,
    first_vocab_rows: bool,
) -> Result<usize> {
    let files = TensorFiles {
        first_vocab_rows,
        ..TensorFiles::open(dir)?
    };
    let mut used = HashSet::new();
    for (prefix, slot) in slots {
        let name = format!("{prefix}.weight");
        match slot {
            Slot::Linear(linear) => {
                // The shapes without making the layer's random initial weights.
                let dims: [usize; 2] = linear.weight.lazy_shape().dims();
                linear.weight = load_param(&files, &name, dims, true, group, device)?;
                used.insert(name);
                if linear.bias.is_some() {
                    let name = format!("{prefix}.bias");
                    linear.bias = Some(load_param(&files, &name, [dims[1]], false, group, device)?);
                    used.insert(name);
                }
            }
            Slot::Norm(norm) => {
                let dims: [usize; 1] = norm.gamma.lazy_shape().dims();
                norm.gamma = load_param(&files, &name, dims, false, group, device)?;
                used.insert(name);
            }
            Slot::Embedding(embedding) => {
                let dims: [usize; 2] = embedding.weight.lazy_shape().dims();
                embedding.weight = load_param(&files, &name, dims, false, group, device)?;
                used.insert(name);
            }
        }
    }
    let unused: Vec<&str> = files
        .names()
        .into_iter()
        .filter(|n| !used.contains(*n) && !is_ignorable(n, config))
        .collect();
    if !unused.is_empty() {
        tracing::warn!(dir = %dir.display(), tensors = ?unused, "checkpoint tensors not used by the model");
    }
    // The weights read as this rank's blocks.
    Ok(match group {
        Some(_) => used
            .iter()
            .filter(|name| matches!(crate::train::tensor::split_axis(name), Ok(Some(_))))
            .count(),
        None => 0,
    })
}

/// Tensors some checkpoints carry that carry no information for us.
fn is_ignorable(name: &str, config: &LlamaConfig) -> bool {
    name.ends_with("rotary_emb.inv_freq") || (config.tied_embeddings() && name == "lm_head.weight")
}

/// The model's tensors under HF names and layout, as `(name, shape, f32 values)`.
pub fn hf_tensors(model: &CausalLm) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut model = model.clone();
    slot_tensors(slots(&mut model))
}

/// A tensor to write: its HF name and shape, and its f32 values, read only when it is
/// written (so a model's tensors are converted one at a time, not all before the first).
pub struct PendingTensor<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    values: Box<dyn Fn() -> Vec<f32> + 'a>,
}

impl<'a> PendingTensor<'a> {
    pub fn new(name: String, shape: Vec<usize>, values: impl Fn() -> Vec<f32> + 'a) -> Self {
        Self {
            name,
            shape,
            values: Box::new(values),
        }
    }

    /// The values, row-major.
    pub fn values(&self) -> Vec<f32> {
        (self.values)()
    }
}

/// Where a save reads the parameters that the ranks hold in parts (a fully sharded model's
/// rows, a tensor group's blocks), one at a time as the file reaches them: set around a save
/// on the writer by [`with_parts_source`], so a save never needs the whole model gathered
/// first (the trainer's loop answers the requests on the other ranks).
pub trait PartsSource {
    /// The whole shape of parameter `id`, and the id the whole parameter carries, when this
    /// rank's tensor of shape `dims` is a part of it (`None`: the tensor is whole).
    fn whole_of(&self, id: u64, dims: &[usize]) -> Option<(Vec<usize>, u64)>;
    /// The whole values (row-major) of parameter `id` from this rank's part `own`, of shape
    /// `dims`: a collective the other ranks holding parts answer.
    fn gather(&self, id: u64, dims: &[usize], own: &[f32]) -> Vec<f32>;
}

thread_local! {
    static PARTS: std::cell::RefCell<Option<std::rc::Rc<dyn PartsSource>>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `save` with `source` giving the whole values of the parameters held in parts: the
/// model folders and master weights it writes read them through it, a tensor at a time.
pub fn with_parts_source<R>(source: std::rc::Rc<dyn PartsSource>, save: impl FnOnce() -> R) -> R {
    struct Restore(Option<std::rc::Rc<dyn PartsSource>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            PARTS.with(|p| *p.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(PARTS.with(|p| p.borrow_mut().replace(source)));
    save()
}

fn parts_source() -> Option<std::rc::Rc<dyn PartsSource>> {
    PARTS.with(|p| p.borrow().clone())
}

/// A parameter as a save sees it: its whole shape, the whole parameter's id, and a reader of
/// its whole values (row-major f32), gathered from the ranks when they hold it in parts (see
/// [`PartsSource`]) each time it is called.
struct WholeParam {
    dims: Vec<usize>,
    id: u64,
    read: Box<dyn Fn() -> Vec<f32>>,
}

fn whole_param<const D: usize>(param: &Param<Tensor<D>>) -> WholeParam {
    let tensor = param.val();
    let id = param.id.val();
    let dims = tensor.dims().to_vec();
    let source = parts_source();
    let whole = source.as_ref().and_then(|s| s.whole_of(id, &dims));
    let whole_id = whole.as_ref().map_or(id, |(_, whole_id)| *whole_id);
    let whole_dims = whole.map(|(dims, _)| dims);
    let read = Box::new({
        let dims = dims.clone();
        let gathered = whole_dims.is_some();
        move || {
            let own = tensor
                .clone()
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .expect("model tensors are floats");
            match (&source, gathered) {
                (Some(source), true) => source.gather(id, &dims, &own),
                _ => own,
            }
        }
    });
    WholeParam {
        dims: whole_dims.unwrap_or(dims),
        id: whole_id,
        read,
    }
}

/// A parameter to write under `name` (`transposed`: a linear weight, `[out, in]` on disk): its
/// whole shape now, its whole values when the writer reads them (gathered from the ranks
/// when they hold it in parts, see [`PartsSource`]), and the id of the whole parameter.
pub fn pending_param<const D: usize>(
    name: String,
    param: &Param<Tensor<D>>,
    transposed: bool,
) -> (PendingTensor<'static>, u64) {
    let WholeParam { dims, id, read } = whole_param(param);
    let mut shape = dims.clone();
    if transposed {
        shape.reverse();
    }
    let pending = PendingTensor::new(name, shape, move || match transposed {
        true => transpose(&read(), dims[0], dims[1]),
        false => read(),
    });
    (pending, id)
}

/// A LoRA adapter to fold into the linear weight it adapts as the weight is written.
pub struct Fold {
    pub a: Param<Tensor<2>>,
    pub b: Param<Tensor<2>>,
    /// `alpha / rank`.
    pub scale: f64,
}

/// The linear weight `weight` (`[in, out]`) with `fold`'s update `scale · A·B` added, to write
/// under `name` in HF's layout: each factor read whole when the writer reaches it, the sum
/// made on the host, so a model held in parts is merged a layer at a time.
fn pending_merged(name: String, weight: &Param<Tensor<2>>, fold: &Fold) -> PendingTensor<'static> {
    let (weight, a, b) = (whole_param(weight), whole_param(&fold.a), whole_param(&fold.b));
    let scale = fold.scale;
    let shape = vec![weight.dims[1], weight.dims[0]];
    PendingTensor::new(name, shape, move || {
        let device = Device::flex();
        let factor = |p: &WholeParam| {
            let dims: [usize; 2] = [p.dims[0], p.dims[1]];
            Tensor::<2>::from_data(TensorData::new((p.read)(), dims), &device)
        };
        let delta = factor(&a).matmul(factor(&b)).mul_scalar(scale);
        let mut merged = (weight.read)();
        let delta = delta.into_data().try_to_vec::<f32>().expect("f32");
        for (w, d) in merged.iter_mut().zip(delta) {
            *w += d;
        }
        transpose(&merged, weight.dims[0], weight.dims[1])
    })
}

/// The `cols × rows` transpose of a row-major `rows × cols` matrix.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for (r, row) in values.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (c, &v) in row.iter().enumerate() {
            out[c * rows + r] = v;
        }
    }
    out
}

/// The tensors of `slots` under HF names and layout, each read when it is written.
pub fn pending_slot_tensors(slots: Vec<(String, Slot<'_>)>) -> Vec<PendingTensor<'static>> {
    pending_slot_tensors_folding(slots, &HashMap::new())
}

/// [`pending_slot_tensors`] with the adapters of `folds` (by the linear layer's HF prefix)
/// folded into the weights they adapt.
pub fn pending_slot_tensors_folding(
    slots: Vec<(String, Slot<'_>)>,
    folds: &HashMap<String, Fold>,
) -> Vec<PendingTensor<'static>> {
    let mut out = Vec::new();
    for (prefix, slot) in slots {
        let weight = format!("{prefix}.weight");
        match slot {
            Slot::Linear(linear) => {
                out.push(match folds.get(&prefix) {
                    Some(fold) => pending_merged(weight, &linear.weight, fold),
                    None => pending_param(weight, &linear.weight, true).0,
                });
                if let Some(bias) = &linear.bias {
                    out.push(pending_param(format!("{prefix}.bias"), bias, false).0);
                }
            }
            Slot::Norm(norm) => out.push(pending_param(weight, &norm.gamma, false).0),
            Slot::Embedding(embedding) => out.push(pending_param(weight, &embedding.weight, false).0),
        }
    }
    out
}

/// The tensors of `slots` under HF names and layout.
pub fn slot_tensors(slots: Vec<(String, Slot<'_>)>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    pending_slot_tensors(slots)
        .into_iter()
        .map(|t| {
            let values = t.values();
            (t.name, t.shape, values)
        })
        .collect()
}

/// Writes `tensors` as one F32 safetensors file, via a temporary name and a rename.
pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Result<()> {
    write_safetensors_as(path, tensors, Precision::F32)
}

/// Writes `tensors` as one safetensors file of `precision` (f32 values rounded to nearest),
/// via a temporary name and a rename.
pub fn write_safetensors_as(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    precision: Precision,
) -> Result<()> {
    let pending = tensors
        .iter()
        .map(|(name, shape, values)| PendingTensor::new(name.clone(), shape.clone(), move || values.clone()))
        .collect();
    write_pending_safetensors(path, pending, precision)
}

/// [`write_safetensors_as`] of tensors read as they are written: each is read and encoded when
/// the writer reaches it, so the file's bytes never exist in memory at once (a 0.5B model's
/// save held three copies of its 2 GB before).
pub fn write_pending_safetensors(
    path: &Path,
    tensors: Vec<PendingTensor<'_>>,
    precision: Precision,
) -> Result<()> {
    /// One tensor, encoded in `precision` only when the writer asks for its bytes.
    struct Encoded<'a, 'b> {
        tensor: &'a PendingTensor<'b>,
        precision: Precision,
    }
    impl safetensors::View for Encoded<'_, '_> {
        fn dtype(&self) -> Dtype {
            match self.precision {
                Precision::F32 => Dtype::F32,
                Precision::Bf16 => Dtype::BF16,
                Precision::F16 => Dtype::F16,
            }
        }
        fn shape(&self) -> &[usize] {
            &self.tensor.shape
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            let values = self.tensor.values();
            let values = values.iter();
            std::borrow::Cow::Owned(match self.precision {
                Precision::F32 => values.flat_map(|v| v.to_le_bytes()).collect(),
                Precision::Bf16 => values
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect(),
                Precision::F16 => values
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
            })
        }
        fn data_len(&self) -> usize {
            self.tensor.shape.iter().product::<usize>() * self.dtype().bitsize() / 8
        }
    }
    let bad = |message: String| CoreError::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let views = tensors
        .iter()
        .map(|tensor| (tensor.name.as_str(), Encoded { tensor, precision }));
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    let written = safetensors::serialize_to_file(views, Some(metadata), &tmp)
        .map_err(|e| match e {
            safetensors::SafeTensorError::IoError(io) => CoreError::cannot_write(&tmp, io),
            other => bad(other.to_string()),
        })
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| CoreError::cannot_write(path, e)));
    if written.is_err() {
        // A full disk leaves a partial temporary file: it is removed, the old file stays.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Writes `data` to `path` through a temporary file in the same folder and a rename, so a
/// reader never sees a half-written file.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    let written = std::fs::write(&tmp, data)
        .map_err(|e| CoreError::cannot_write(&tmp, e))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| CoreError::cannot_write(path, e)));
    if written.is_err() {
        // A full disk leaves a partial temporary file: it is removed, the old file stays.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Writes `value` as pretty-printed JSON to `path`, atomically ([`write_atomic`]).
/// Reads the JSON file `path` (errors name it).
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| CoreError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| CoreError::Json {
        path: path.to_path_buf(),
        source,
    })
}

pub fn write_json<T: serde::Serialize + ?Sized>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|source| CoreError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    write_atomic(path, text.as_bytes())
}

/// Saves `model` as a HF folder: `config.json`, `model.safetensors`, and the tokenizer files
/// of `tokenizer_from` when given.
pub fn save_causal_lm(
    model: &CausalLm,
    config: &LlamaConfig,
    dir: &Path,
    tokenizer_from: Option<&Path>,
) -> Result<()> {
    save_causal_lm_with(model, config, dir, tokenizer_from, &HashMap::new())
}

fn save_causal_lm_with(
    model: &CausalLm,
    config: &LlamaConfig,
    dir: &Path,
    tokenizer_from: Option<&Path>,
    folds: &HashMap<String, Fold>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| CoreError::cannot_write(dir, e))?;
    let mut config = config.clone();
    if config.architectures.is_none() {
        config.architectures = Some(vec![default_architecture(&config.model_type).into()]);
    }
    // Saved in the type the model computes in, as HF saves a model loaded in it.
    let precision = model.model.precision;
    config
        .extra
        .insert("torch_dtype".into(), precision.torch_dtype().into());
    let mut model = model.clone();
    write_pending_safetensors(
        &dir.join("model.safetensors"),
        pending_slot_tensors_folding(slots(&mut model), folds),
        precision,
    )?;
    write_atomic(&dir.join("config.json"), config.to_json_string().as_bytes())?;
    if let Some(src) = tokenizer_from {
        copy_tokenizer_files(src, dir)?;
    }
    Ok(())
}

/// [`save_causal_lm`] of `model` with its enabled LoRA adapters folded into the weights (as
/// `model.merged()` would save), each layer merged as the file reaches it: a model the ranks
/// hold in parts is saved without being gathered whole first.
pub fn save_causal_lm_merged(
    model: &CausalLm,
    config: &LlamaConfig,
    dir: &Path,
    tokenizer_from: Option<&Path>,
) -> Result<()> {
    let folds = lora_folds(&model.model);
    save_causal_lm_with(model, config, dir, tokenizer_from, &folds)
}

/// The enabled LoRA adapters of `trunk` by the HF prefix of the linear layer each adapts: what
/// [`pending_slot_tensors_folding`] folds into the weights as the file reaches them.
pub fn lora_folds(trunk: &crate::model::LlamaModel) -> HashMap<String, Fold> {
    let mut trunk = trunk.clone();
    crate::model::projections(&mut trunk)
        .into_iter()
        .filter(|(_, layer)| layer.adapter_enabled)
        .filter_map(|(name, layer)| {
            let lora = layer.lora.as_ref()?;
            Some((
                name,
                Fold {
                    a: lora.a.clone(),
                    b: lora.b.clone(),
                    scale: lora.scale,
                },
            ))
        })
        .collect()
}

/// Copies the tokenizer and generation files that exist in `src` to `dst`.
pub fn copy_tokenizer_files(src: &Path, dst: &Path) -> Result<()> {
    if src == dst {
        return Ok(());
    }
    for name in TOKENIZER_FILES {
        let from = src.join(name);
        if from.exists() {
            let data = std::fs::read(&from).map_err(|e| CoreError::io(&from, e))?;
            write_atomic(&dst.join(name), &data)?;
        }
    }
    Ok(())
}

fn default_architecture(model_type: &str) -> &'static str {
    match model_type {
        "qwen2" => "Qwen2ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "olmo2" => "Olmo2ForCausalLM",
        "gemma2" => "Gemma2ForCausalLM",
        "gemma3_text" => "Gemma3ForCausalLM",
        "phi3" => "Phi3ForCausalLM",
        "mistral" => "MistralForCausalLM",
        "mixtral" => "MixtralForCausalLM",
        "qwen3_moe" => "Qwen3MoeForCausalLM",
        _ => "LlamaForCausalLM",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Pretends every parameter is the first half of a whole one of twice its rows (the other
    /// half equal to it), counting the gathers.
    struct Doubled {
        gathers: Cell<usize>,
    }

    impl PartsSource for Doubled {
        fn whole_of(&self, id: u64, dims: &[usize]) -> Option<(Vec<usize>, u64)> {
            let mut whole = dims.to_vec();
            whole[0] *= 2;
            Some((whole, id ^ 1))
        }

        fn gather(&self, _: u64, _: &[usize], own: &[f32]) -> Vec<f32> {
            self.gathers.set(self.gathers.get() + 1);
            [own, own].concat()
        }
    }

    fn read(path: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
        let bytes = std::fs::read(path).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        file.tensors()
            .into_iter()
            .map(|(name, view)| {
                let values = view
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                (name, (view.shape().to_vec(), values))
            })
            .collect()
    }

    #[test]
    fn a_save_reads_the_parameters_held_in_parts_whole_one_at_a_time() {
        let device = Device::flex();
        let config = LlamaConfig::llama(32, 8, 1, 2, 1, 12);
        let model = CausalLm::new(&config, &device);
        let own = hf_tensors(&model);
        let dir = tempfile::tempdir().unwrap();
        let source = std::rc::Rc::new(Doubled {
            gathers: Cell::new(0),
        });
        with_parts_source(source.clone(), || {
            save_causal_lm(&model, &config, dir.path(), None).unwrap();
            crate::train::master::save_master_weights(&model, &dir.path().join("master.safetensors"))
                .unwrap();
        });
        let saved = read(&dir.path().join("model.safetensors"));
        assert_eq!(saved.len(), own.len());
        for (name, shape, values) in &own {
            let (whole_shape, whole) = &saved[name];
            // Burn's first axis doubled: a linear weight's second axis on disk ([out, in]).
            let linear = name.ends_with("proj.weight") || name == "lm_head.weight";
            let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
            match linear {
                true => {
                    assert_eq!(whole_shape, &vec![rows, 2 * cols], "{name}");
                    for r in 0..rows {
                        let row = &whole[r * 2 * cols..(r + 1) * 2 * cols];
                        let expected = &values[r * cols..(r + 1) * cols];
                        assert_eq!(&row[..cols], expected, "{name}");
                        assert_eq!(&row[cols..], expected, "{name}");
                    }
                }
                false => {
                    let mut doubled = shape.clone();
                    doubled[0] *= 2;
                    assert_eq!(whole_shape, &doubled, "{name}");
                    assert_eq!(whole, &[values.as_slice(), values.as_slice()].concat(), "{name}");
                }
            }
        }
        // The master weights carry the whole parameters' ids and shapes.
        let masters = read(&dir.path().join("master.safetensors"));
        struct Ids(Vec<(u64, Vec<usize>)>);
        impl burn::module::ModuleVisitor for Ids {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0.push((param.id.val(), param.val().dims().to_vec()));
            }
        }
        let mut ids = Ids(Vec::new());
        burn::module::Module::visit(&model, &mut ids);
        for (id, mut dims) in ids.0 {
            dims[0] *= 2;
            let name = burn::module::ParamId::from(id ^ 1).to_string();
            assert_eq!(masters[&name].0, dims, "{name}");
        }
        // One gather per tensor of each file, none left over after the saves.
        assert_eq!(source.gathers.get(), own.len() + masters.len());
        assert!(parts_source().is_none());
    }

    #[test]
    fn a_transpose_swaps_rows_and_columns() {
        assert_eq!(
            transpose(&[1., 2., 3., 4., 5., 6.], 2, 3),
            vec![1., 4., 2., 5., 3., 6.]
        );
    }
}
