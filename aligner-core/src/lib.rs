//! # aligner-core
//!
//! The model and (soon) the trainer of aligner: a Llama-family decoder on Burn that loads and
//! saves Hugging Face checkpoints and matches transformers numerically, its tokenizer and chat
//! templates, and sequence log-probabilities.
//!
//! ```no_run
//! use aligner_core::{Device, LoadedModel};
//! let device = Device::flex();
//! let lm = LoadedModel::from_dir(&aligner_core::default_model_dir().unwrap(), &device).unwrap();
//! let ids = lm.tokenizer.encode("Once upon a time", true).unwrap();
//! println!("{} tokens, {} parameters", ids.len(), lm.parameter_count());
//! ```

pub mod adapter;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod llama2c;
pub mod model;
pub mod parallel;
pub mod plan;
pub mod reward;
pub mod rm;
pub mod run;
pub mod score;
pub mod sft;
pub mod start;
pub mod store;
pub mod tokenizer;
pub mod train;

use std::path::{Path, PathBuf};

pub use aligner_parallel::Communicator;
pub use burn::tensor::Device;
pub use config::LlamaConfig;
pub use error::{CoreError, Result};
pub use model::CausalLm;
pub use tokenizer::{ChatMessage, TextTokenizer};

/// The folder of the shipped default model ([`aligner_assets`]): that package's folder when
/// its files are on disk, else the embedded copy written once to a folder under the system's
/// temp dir.
pub fn default_model_dir() -> Result<PathBuf> {
    if let Some(dir) = aligner_assets::model_dir() {
        return Ok(dir);
    }
    let dir = std::env::temp_dir().join(concat!("aligner-stories260K-", env!("CARGO_PKG_VERSION")));
    write_files(&dir, aligner_assets::MODEL)?;
    Ok(dir)
}

/// `dir`, or the shipped default model's folder when none is given.
pub fn model_dir_or_default(dir: Option<&Path>) -> Result<PathBuf> {
    match dir {
        Some(dir) => Ok(dir.to_path_buf()),
        None => default_model_dir(),
    }
}

/// The shipped sample data of the embedded defaults (tinystories_sentiment, in
/// [`aligner_assets`]): that package's folder when its files are on disk, else the embedded
/// copy written once to a folder under the system's temp dir — so an installed binary trains
/// on its defaults from any folder.
pub fn default_data_dir() -> PathBuf {
    if let Some(dir) = aligner_assets::sentiment_dir() {
        return dir;
    }
    let dir = std::env::temp_dir().join(concat!(
        "aligner-tinystories_sentiment-",
        env!("CARGO_PKG_VERSION")
    ));
    // A failure here surfaces as the data file's own "cannot read" error, naming it.
    if let Err(e) = write_embedded_data(&dir) {
        tracing::warn!(error = %e, "cannot write the embedded default data");
    }
    dir
}

/// Writes the embedded default data into `dir` (files already there with the same bytes are
/// left alone).
pub fn write_embedded_data(dir: &Path) -> Result<()> {
    write_files(dir, aligner_assets::SENTIMENT)
}

/// Writes `files` into `dir`, leaving alone those already there with the same bytes.
fn write_files(dir: &Path, files: aligner_assets::Files) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| CoreError::cannot_write(dir, e))?;
    for (name, bytes) in files {
        let path = dir.join(name);
        let fresh = std::fs::read(&path).map(|b| b == *bytes).unwrap_or(false);
        if !fresh {
            checkpoint::write_atomic(&path, bytes)?;
        }
    }
    Ok(())
}

/// A model folder loaded into memory: configuration, weights and tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    pub dir: PathBuf,
    pub config: LlamaConfig,
    pub model: CausalLm,
    pub tokenizer: TextTokenizer,
}

impl LoadedModel {
    /// Loads `config.json`, the safetensors weights and `tokenizer.json` of `dir`.
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self> {
        Self::from_dir_in(dir, device, None, None)
    }

    /// [`LoadedModel::from_dir`] for a rank of tensor group `group` (`parallel.tensor`): the
    /// weights tensor parallel splits are read as this rank's blocks alone
    /// ([`checkpoint::load_causal_lm_split`]), so a model larger than one rank's memory
    /// loads across its group.
    pub fn from_dir_split(
        dir: &Path,
        device: &Device,
        group: &std::sync::Arc<dyn aligner_parallel::Communicator>,
    ) -> Result<Self> {
        Self::from_dir_in(dir, device, Some(group), None)
    }

    /// [`LoadedModel::from_dir_split`] with the vocabulary cut to its first `vocab` ids where
    /// the model has more ([`checkpoint::load_causal_lm_split_first_rows`]): a distillation
    /// teacher whose vocabulary is padded past the ids it shares with its student, so that
    /// the two split their vocabularies into the same blocks.
    pub fn from_dir_split_first_rows(
        dir: &Path,
        device: &Device,
        group: &std::sync::Arc<dyn aligner_parallel::Communicator>,
        vocab: usize,
    ) -> Result<Self> {
        Self::from_dir_in(dir, device, Some(group), Some(vocab))
    }

    fn from_dir_in(
        dir: &Path,
        device: &Device,
        group: Option<&std::sync::Arc<dyn aligner_parallel::Communicator>>,
        first_rows: Option<usize>,
    ) -> Result<Self> {
        let mut config = LlamaConfig::from_file(&dir.join("config.json"))?;
        let split = group.is_some_and(|g| g.world_size() > 1);
        let first_rows = first_rows.filter(|&rows| split && rows < config.vocab_size);
        if let Some(rows) = first_rows {
            config.vocab_size = rows;
        }
        let tokenizer = TextTokenizer::from_dir(dir)?;
        // A tokenizer with ids past the embedding table makes every later step index out of
        // it; refuse the pair here, before the weights are read.
        if let Some(max) = tokenizer.max_token_id()
            && max as usize >= config.vocab_size
        {
            return Err(CoreError::Tokenizer {
                path: dir.join("tokenizer.json"),
                message: format!(
                    "token id {max} is outside the model's vocabulary of {} (vocab_size in {}): \
                     this tokenizer does not belong to this model",
                    config.vocab_size,
                    dir.join("config.json").display()
                ),
            });
        }
        let model = match group {
            Some(group) if group.world_size() > 1 => {
                crate::train::check_tensor_heads(
                    &config,
                    group.world_size(),
                    &format!("parallel.tensor = {}", group.world_size()),
                )?;
                match first_rows {
                    Some(_) => checkpoint::load_causal_lm_split_first_rows(dir, &config, device, group)?,
                    None => checkpoint::load_causal_lm_split(dir, &config, device, group)?,
                }
            }
            _ => checkpoint::load_causal_lm(dir, &config, device)?,
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            model,
            tokenizer,
        })
    }

    /// The same model computing in `precision` (refused, naming `model.dtype`, where the
    /// device cannot); runs built from its configuration save in that type.
    pub fn in_precision(mut self, precision: config::Precision, device: &Device) -> Result<Self> {
        crate::model::compute_in(precision, &mut self.config, &mut self.model.model, device)?;
        Ok(self)
    }

    /// A shallower model made of the decoder layers `keep` (indices, in the order given),
    /// with the embeddings, final norm and head as they are: a student initialised from a
    /// teacher's layers (DistilBERT keeps every other one). Per-layer configuration
    /// (`layer_types`) follows the kept layers.
    pub fn with_layers(mut self, keep: &[usize]) -> Result<Self> {
        let count = self.model.model.layers.len();
        if keep.is_empty() {
            return Err(CoreError::Invalid("keep at least one decoder layer".into()));
        }
        if let Some(&bad) = keep.iter().find(|&&i| i >= count) {
            return Err(CoreError::Invalid(format!(
                "layer {bad} does not exist: {} has {count} decoder layers (0 to {})",
                self.dir.display(),
                count - 1
            )));
        }
        let layers = std::mem::take(&mut self.model.model.layers);
        self.model.model.layers = keep.iter().map(|&i| layers[i].clone()).collect();
        self.config.num_hidden_layers = keep.len();
        if let Some(serde_json::Value::Array(types)) = self.config.extra.get("layer_types").cloned() {
            let kept: Vec<serde_json::Value> = keep.iter().filter_map(|&i| types.get(i).cloned()).collect();
            self.config
                .extra
                .insert("layer_types".into(), serde_json::Value::Array(kept));
        }
        Ok(self)
    }

    /// Saves the model as a HF folder (tokenizer files copied from the source folder).
    pub fn save(&self, dir: &Path) -> Result<()> {
        checkpoint::save_causal_lm(&self.model, &self.config, dir, Some(&self.dir))
    }

    /// Number of parameters.
    pub fn parameter_count(&self) -> usize {
        model::parameter_count(&self.model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_data_is_the_shipped_data() {
        let dir = tempfile::tempdir().unwrap();
        write_embedded_data(dir.path()).unwrap();
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tinystories_sentiment");
        for (name, _) in aligner_assets::SENTIMENT {
            let written = std::fs::read(dir.path().join(name)).unwrap();
            assert_eq!(written, std::fs::read(shipped.join(name)).unwrap(), "{name}");
        }
        // Every file a default names is there.
        for name in [
            "train.sft.jsonl",
            "test.prompts.jsonl",
            "train.steer.jsonl",
            "test.kto.jsonl",
        ] {
            assert!(dir.path().join(name).exists(), "{name}");
        }
    }

    /// A student made of some of a model's layers has exactly those layers' weights, in the
    /// order asked, and a configuration that says how many; missing layers are refused.
    #[test]
    fn a_model_keeps_the_layers_it_is_asked_for() {
        let device = Device::flex();
        let dir = default_model_dir().unwrap();
        let weights = |lm: &LoadedModel, i: usize| {
            lm.model.model.layers[i].mlp.mlps()[0]
                .down_proj
                .base
                .weight
                .val()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        };
        let full = LoadedModel::from_dir(&dir, &device).unwrap();
        let (first, last) = (weights(&full, 0), weights(&full, 4));
        let kept = LoadedModel::from_dir(&dir, &device)
            .unwrap()
            .with_layers(&[4, 0])
            .unwrap();
        assert_eq!(kept.config.num_hidden_layers, 2);
        assert_eq!((weights(&kept, 0), weights(&kept, 1)), (last, first));
        let err = LoadedModel::from_dir(&dir, &device)
            .unwrap()
            .with_layers(&[0, 5])
            .unwrap_err();
        assert!(err.to_string().contains("layer 5 does not exist"), "{err}");
        assert!(
            LoadedModel::from_dir(&dir, &device)
                .unwrap()
                .with_layers(&[])
                .is_err()
        );
    }
}
