//! # aligner-core
//!
//! The model and (soon) the trainer of aligner: a Llama-family decoder on Burn that loads and
//! saves Hugging Face checkpoints and matches transformers numerically, its tokenizer and chat
//! templates, and sequence log-probabilities.
//!
//! ```no_run
//! use aligner_core::{Device, LoadedModel};
//! let device = Device::flex();
//! let lm = LoadedModel::from_dir("assets/stories260K".as_ref(), &device).unwrap();
//! let ids = lm.tokenizer.encode("Once upon a time", true).unwrap();
//! println!("{} tokens, {} parameters", ids.len(), lm.parameter_count());
//! ```

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod llama2c;
pub mod model;
pub mod score;
pub mod tokenizer;

use std::path::{Path, PathBuf};

pub use burn::tensor::Device;
pub use config::LlamaConfig;
pub use error::{CoreError, Result};
pub use model::CausalLm;
pub use tokenizer::{ChatMessage, TextTokenizer};

/// The folder of the shipped default model, inside the repository.
pub fn default_model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/stories260K")
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
        let config = LlamaConfig::from_file(&dir.join("config.json"))?;
        let model = checkpoint::load_causal_lm(dir, &config, device)?;
        let tokenizer = TextTokenizer::from_dir(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            model,
            tokenizer,
        })
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
