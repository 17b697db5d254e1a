//! How a run saves and loads the model it trains: the [`ModelStore`] trait and the full-weight
//! stores (the LoRA stores are in [`crate::adapter`]).

use std::path::{Path, PathBuf};

use burn::tensor::Device;

use crate::checkpoint::{load_causal_lm, save_causal_lm};
use crate::config::{LlamaConfig, Precision};
use crate::error::Result;
use crate::model::CausalLm;
use crate::reward::RewardModel;

/// Saves and loads the trained model in the run folder's formats.
pub trait ModelStore<M> {
    /// Writes `model` as an HF folder into `dir`.
    fn save(&self, model: &M, dir: &Path) -> Result<()>;
    /// Loads a model saved by [`ModelStore::save`].
    fn load(&self, dir: &Path, device: &Device) -> Result<M>;
    /// The type the saved model folder holds the weights in (f32 unless the stored model
    /// computes in half precision; adapters are saved in f32).
    fn precision(&self) -> Precision {
        Precision::F32
    }
    /// Whether [`ModelStore::save`] reads the model's parameters one at a time as it writes
    /// them, so that a model the ranks hold in parts is saved without being gathered whole
    /// first (see [`crate::checkpoint::PartsSource`]); a store that computes new weights from
    /// the model before writing (LoRA's merged weights) does not.
    fn reads_parameters(&self) -> bool {
        false
    }
}

/// Saves and loads causal LMs as HF folders, copying the tokenizer of the base folder.
pub struct CausalLmStore {
    pub config: LlamaConfig,
    pub tokenizer_dir: PathBuf,
}

impl ModelStore<CausalLm> for CausalLmStore {
    fn save(&self, model: &CausalLm, dir: &Path) -> Result<()> {
        save_causal_lm(model, &self.config, dir, Some(&self.tokenizer_dir))
    }

    fn load(&self, dir: &Path, device: &Device) -> Result<CausalLm> {
        load_causal_lm(dir, &self.config, device)
    }

    fn precision(&self) -> Precision {
        self.config.precision
    }

    fn reads_parameters(&self) -> bool {
        true
    }
}

/// Saves and loads reward models as HF sequence-classifier folders.
pub struct RewardModelStore {
    pub config: LlamaConfig,
    pub labels: Vec<String>,
    pub tokenizer_dir: PathBuf,
}

impl ModelStore<RewardModel> for RewardModelStore {
    fn save(&self, model: &RewardModel, dir: &Path) -> Result<()> {
        model.save(&self.config, &self.labels, dir, Some(&self.tokenizer_dir))
    }

    fn load(&self, dir: &Path, device: &Device) -> Result<RewardModel> {
        let config = crate::reward::sequence_classification_config(&self.config, &self.labels);
        RewardModel::load(dir, &config, self.labels.len(), device)
    }

    fn precision(&self) -> Precision {
        self.config.precision
    }

    fn reads_parameters(&self) -> bool {
        true
    }
}
