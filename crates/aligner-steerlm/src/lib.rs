//! # aligner-steerlm
//!
//! SteerLM (Dong et al., 2023) in three steps, each a small layer over aligner-core:
//!
//! 1. **attributes** — an attribute prediction model: the decoder trunk with a multi-output
//!    regression head ([`aligner_core::reward::RewardModel`]), trained with masked MSE
//!    ([`AttributeObjective`]) so unrated attributes cost nothing;
//! 2. **annotate** — that model labels prompt/response data (rounded, clamped to 0..4);
//! 3. **sft** — attribute-conditioned SFT: the conditioning string `name:value,...` in a fixed
//!    order is placed between prompt and response by a template ([`Conditioning`]), the loss is
//!    on the response only, and the template is saved with the model (`steerlm.json`) so that
//!    `aligner generate --attributes positivity:4` steers it at inference.

pub mod attribute_model;
pub mod conditioning;
mod error;

pub use attribute_model::{AttributeExample, AttributeObjective, AttributeRow};
pub use conditioning::{Conditioning, SETTINGS_FILE};
pub use error::{Result, SteerError};

use aligner_core::data::Prompt;
use aligner_core::sft::SftRow;
use aligner_core::train::{DataSection, ModelSection, TrainSection};
use serde::{Deserialize, Serialize};

/// The SFT rows of attribute-conditioned training: each prompt extended by the template with
/// the row's own attributes.
pub fn conditioned_rows(
    rows: &[AttributeRow],
    conditioning: &Conditioning,
    tokenizer: &aligner_core::TextTokenizer,
) -> Result<Vec<SftRow>> {
    rows.iter()
        .map(|row| {
            let values = row
                .attributes
                .iter()
                .filter_map(|(k, v)| v.map(|v| (k.clone(), v)))
                .collect();
            Ok(SftRow::PromptResponse {
                prompt: Prompt::Text(conditioning.apply(&row.prompt.render(tokenizer)?, &values)?),
                response: row.response.clone(),
            })
        })
        .collect()
}

/// `aligner steerlm attributes|sft` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SteerConfig {
    pub model: ModelSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub steerlm: Conditioning,
}

impl Default for SteerConfig {
    fn default() -> Self {
        Self::for_step(1, 2e-3)
    }
}

impl SteerConfig {
    /// Defaults of a step: the shipped attribute data and a training length that suits it.
    pub fn for_step(epochs: usize, lr: f64) -> Self {
        let mut train = TrainSection::embedded_default(epochs);
        train.lr = lr;
        Self {
            model: ModelSection::default(),
            data: DataSection::shipped("train.steer.jsonl", "test.steer.jsonl"),
            train,
            steerlm: Conditioning::default(),
        }
    }
}
