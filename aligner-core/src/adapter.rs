//! LoRA adapters in PEFT's format: `adapter_model.safetensors`
//! (`base_model.model.<layer>.lora_A.weight` `[r, in]`, `lora_B.weight` `[out, r]`) and
//! `adapter_config.json`; merging an adapter into its base.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Tensor, TensorData};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{
    load_causal_lm, save_causal_lm, save_causal_lm_merged, write_json, write_safetensors,
};
use crate::config::LlamaConfig;
use crate::error::{CoreError, Result};
use crate::model::named_param;
use crate::model::{CausalLm, LlamaModel, LoraSpec, projections};
use crate::reward::RewardModel;
use crate::store::ModelStore;

const PREFIX: &str = "base_model.model.";

/// Where a LoRA run keeps its PEFT adapter inside `final/` and each checkpoint. The folder
/// itself holds the merged model: with the adapter files beside it, transformers (with peft
/// installed) would load the merged weights and apply the adapter a second time.
pub const ADAPTER_DIR: &str = "adapter";

/// The fields of PEFT's `adapter_config.json` that aligner writes and reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterConfig {
    pub peft_type: String,
    pub task_type: String,
    pub r: usize,
    pub lora_alpha: f64,
    pub lora_dropout: f64,
    pub target_modules: Vec<String>,
    pub bias: String,
    pub fan_in_fan_out: bool,
    pub inference_mode: bool,
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modules_to_save: Option<Vec<String>>,
}

impl AdapterConfig {
    pub fn new(spec: &LoraSpec, base: Option<&Path>) -> Self {
        Self {
            peft_type: "LORA".into(),
            task_type: "CAUSAL_LM".into(),
            r: spec.rank,
            lora_alpha: spec.alpha,
            lora_dropout: spec.dropout,
            target_modules: spec.targets.clone(),
            bias: "none".into(),
            fan_in_fan_out: false,
            inference_mode: true,
            base_model_name_or_path: base.map(|p| p.display().to_string()),
            modules_to_save: None,
        }
    }

    pub fn spec(&self) -> LoraSpec {
        LoraSpec {
            rank: self.r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            targets: self.target_modules.clone(),
        }
    }
}

/// The adapter tensors of `model` under PEFT names and layout.
pub fn adapter_tensors(model: &CausalLm) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    trunk_adapter_tensors(&model.model)
}

/// The adapter tensors of a decoder trunk under PEFT names and layout.
pub fn trunk_adapter_tensors(trunk: &LlamaModel) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut trunk = trunk.clone();
    let mut out = Vec::new();
    for (name, layer) in projections(&mut trunk) {
        if let Some(lora) = &layer.lora {
            out.push(whole_linear(format!("{PREFIX}{name}.lora_A.weight"), &lora.a));
            out.push(whole_linear(format!("{PREFIX}{name}.lora_B.weight"), &lora.b));
        }
    }
    out
}

/// A linear weight under `name` in HF's layout (`[out, in]`), whole: gathered from the ranks
/// where they hold it in parts.
fn whole_linear(name: String, weight: &burn::module::Param<Tensor<2>>) -> (String, Vec<usize>, Vec<f32>) {
    let pending = crate::checkpoint::pending_param(name, weight, true).0;
    let values = pending.values();
    (pending.name, pending.shape, values)
}

/// Writes `adapter_model.safetensors` and `adapter_config.json` into `dir`.
pub fn save_adapter(model: &CausalLm, spec: &LoraSpec, base: Option<&Path>, dir: &Path) -> Result<()> {
    write_adapter(adapter_tensors(model), AdapterConfig::new(spec, base), dir)
}

fn write_adapter(
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    config: AdapterConfig,
    dir: &Path,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| CoreError::cannot_write(dir, e))?;
    write_safetensors(&dir.join("adapter_model.safetensors"), &tensors)?;
    write_json(&dir.join("adapter_config.json"), &config)
}

/// Reads `adapter_config.json` of an adapter folder.
pub fn read_adapter_config(dir: &Path) -> Result<AdapterConfig> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| CoreError::io(&path, e))?;
    let config: AdapterConfig = serde_json::from_str(&text).map_err(|source| CoreError::Json {
        path: path.clone(),
        source,
    })?;
    if config.peft_type != "LORA" {
        return Err(CoreError::Config {
            path,
            message: format!("peft_type {:?} is not supported (LORA)", config.peft_type),
        });
    }
    Ok(config)
}

/// Attaches the adapter of `dir` to `model` (freezing the rest), with its trained factors.
pub fn load_adapter(model: &mut CausalLm, dir: &Path, device: &Device) -> Result<LoraSpec> {
    let spec = read_adapter_config(dir)?.spec();
    model.attach_lora(&spec, device);
    let file = AdapterFile::open(dir)?;
    file.fill(&mut model.model, device)?;
    Ok(spec)
}

/// The tensors of an `adapter_model.safetensors`.
struct AdapterFile {
    dir: PathBuf,
    bytes: Vec<u8>,
}

impl AdapterFile {
    fn open(dir: &Path) -> Result<Self> {
        let path = dir.join("adapter_model.safetensors");
        let bytes = std::fs::read(&path).map_err(|e| CoreError::io(&path, e))?;
        SafeTensors::deserialize(&bytes).map_err(|e| CoreError::Safetensors {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            bytes,
        })
    }

    /// Tensor `PREFIX + name` in PEFT layout `[rows, cols]`, returned transposed (Burn layout).
    fn read(&self, name: &str, rows: usize, cols: usize, device: &Device) -> Result<Tensor<2>> {
        let file = SafeTensors::deserialize(&self.bytes).map_err(|e| CoreError::Safetensors {
            path: self.dir.join("adapter_model.safetensors"),
            message: e.to_string(),
        })?;
        let view = file
            .tensor(&format!("{PREFIX}{name}"))
            .map_err(|_| CoreError::MissingTensor {
                name: format!("{PREFIX}{name}"),
                dir: self.dir.clone(),
            })?;
        if view.shape() != [rows, cols] {
            return Err(CoreError::ShapeMismatch {
                name: name.to_string(),
                expected: vec![rows, cols],
                found: view.shape().to_vec(),
            });
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Tensor::<2>::from_data(TensorData::new(values, [rows, cols]), device).transpose())
    }

    /// Fills the attached adapters of `trunk` with the file's factors.
    fn fill(&self, trunk: &mut LlamaModel, device: &Device) -> Result<()> {
        for (name, layer) in projections(trunk) {
            if let Some(lora) = layer.lora.as_mut() {
                let [d_in, r] = lora.a.dims();
                let [_, d_out] = lora.b.dims();
                let (a, b) = (format!("{name}.lora_A.weight"), format!("{name}.lora_B.weight"));
                lora.a = named_param(&a, self.read(&a, r, d_in, device)?);
                lora.b = named_param(&b, self.read(&b, d_out, r, device)?);
            }
        }
        Ok(())
    }
}

/// Merges the adapter in `adapter_dir` into the model in `base_dir` (default: the adapter
/// config's `base_model_name_or_path`) and saves a plain HF folder to `out`.
pub fn merge_adapter(adapter_dir: &Path, base_dir: Option<&Path>, out: &Path, device: &Device) -> Result<()> {
    let config = read_adapter_config(adapter_dir)?;
    let base: PathBuf = match (base_dir, &config.base_model_name_or_path) {
        (Some(b), _) => b.to_path_buf(),
        (None, Some(b)) => PathBuf::from(b),
        (None, None) => {
            return Err(CoreError::Invalid(format!(
                "{}: no base_model_name_or_path; give the base model folder",
                adapter_dir.display()
            )));
        }
    };
    let llama = LlamaConfig::from_file(&base.join("config.json"))?;
    let mut model = load_causal_lm(&base, &llama, device)?;
    load_adapter(&mut model, adapter_dir, device)?;
    save_causal_lm(&model.merged(), &llama, out, Some(&base))
}

/// The run-folder store of a LoRA run: each checkpoint and `final/` hold the merged model and,
/// in [`ADAPTER_DIR`], the PEFT adapter; loading rebuilds base + adapter.
pub struct LoraStore {
    pub config: LlamaConfig,
    pub base_dir: PathBuf,
    pub spec: LoraSpec,
}

impl ModelStore<CausalLm> for LoraStore {
    fn save(&self, model: &CausalLm, dir: &Path) -> Result<()> {
        save_causal_lm_merged(model, &self.config, dir, Some(&self.base_dir))?;
        save_adapter(model, &self.spec, Some(&self.base_dir), &dir.join(ADAPTER_DIR))
    }

    /// The adapters are folded into each weight as the file reaches it.
    fn reads_parameters(&self) -> bool {
        true
    }

    fn load(&self, dir: &Path, device: &Device) -> Result<CausalLm> {
        let mut model = load_causal_lm(&self.base_dir, &self.config, device)?;
        load_adapter(&mut model, &dir.join(ADAPTER_DIR), device)?;
        Ok(model)
    }
}

/// Counts trainable (adapter) and total parameters.
pub fn parameter_split(model: &CausalLm) -> (usize, usize) {
    let adapters: usize = adapter_tensors(model)
        .iter()
        .map(|(_, s, _)| s.iter().product::<usize>())
        .sum();
    let total = crate::model::parameter_count(model);
    (adapters, total)
}

/// The run-folder store of a LoRA reward model: adapters on the trunk, the score head trained
/// in full (PEFT's `modules_to_save = ["score"]`); each save holds the PEFT adapter and the
/// merged sequence classifier.
pub struct RewardLoraStore {
    pub config: LlamaConfig,
    pub labels: Vec<String>,
    pub base_dir: PathBuf,
    pub spec: LoraSpec,
}

impl ModelStore<RewardModel> for RewardLoraStore {
    fn save(&self, model: &RewardModel, dir: &Path) -> Result<()> {
        let folds = crate::checkpoint::lora_folds(&model.model);
        model.save_folding(&self.config, &self.labels, dir, Some(&self.base_dir), &folds)?;
        let mut tensors = trunk_adapter_tensors(&model.model);
        tensors.push(whole_linear(format!("{PREFIX}score.weight"), &model.score.weight));
        let mut config = AdapterConfig::new(&self.spec, Some(&self.base_dir));
        config.task_type = "SEQ_CLS".into();
        config.modules_to_save = Some(vec!["score".into()]);
        write_adapter(tensors, config, &dir.join(ADAPTER_DIR))
    }

    /// The adapters are folded into each weight as the file reaches it, and the head and the
    /// adapter factors are read whole one at a time.
    fn reads_parameters(&self) -> bool {
        true
    }

    fn load(&self, dir: &Path, device: &Device) -> Result<RewardModel> {
        let mut model = RewardModel::load(&self.base_dir, &self.config, self.labels.len(), device)?;
        model.model.attach_lora(&self.spec, device);
        let file = AdapterFile::open(&dir.join(ADAPTER_DIR))?;
        file.fill(&mut model.model, device)?;
        let [hidden, outputs] = model.score.weight.dims();
        model.score.weight = named_param(
            "score.weight",
            file.read("score.weight", outputs, hidden, device)?,
        );
        Ok(model)
    }
}
