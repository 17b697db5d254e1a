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
//!    `aligner generate --attributes positivity:4` steers it at inference;
//! 4. **bootstrap** — the conditioned model samples over a grid of settings, the attribute model
//!    labels the samples, and conditioned SFT runs again on them ([`bootstrap()`]).
//!
//! Each step is a library call in [`steps`] (what `aligner steerlm ...` runs):
//! [`train_attributes`], [`annotate()`], [`train_conditioned`], [`bootstrap()`], with each
//! step's defaults from `SteerConfig::attributes_defaults()` / `sft_defaults()` /
//! `bootstrap_defaults()`.

pub mod attribute_model;
pub mod bootstrap;
pub mod conditioning;
mod error;
pub mod steps;

pub use attribute_model::{AttributeExample, AttributeObjective, AttributeRow};
pub use bootstrap::BootstrapSection;
pub use conditioning::{Conditioning, SETTINGS_FILE};
pub use error::{Result, SteerError};
pub use steps::{AttributeModel, annotate, bootstrap, train_attributes, train_conditioned};

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
    /// Oversampling of rare attribute values in the training split.
    pub balance: BalanceSection,
    /// `bootstrap` only: what the conditioned model samples.
    pub bootstrap: BootstrapSection,
    /// Tensor groups (`parallel.tensor`): the attribute model and conditioned SFT train on
    /// them, each rank reading and training its blocks of the model.
    pub parallel: aligner_core::train::ParallelSection,
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
        // The steps run 500–1,900 steps: validating and saving every 25 (the short methods'
        // cadence) took 100 of the `sft` step's 265 s and left 76 checkpoints (233 MB).
        train.eval_every = 100;
        train.save_every = 100;
        Self {
            model: ModelSection::default(),
            data: DataSection::shipped("train.steer.jsonl", "test.steer.jsonl"),
            train,
            steerlm: Conditioning::default(),
            balance: BalanceSection::default(),
            bootstrap: BootstrapSection::default(),
            parallel: Default::default(),
        }
    }
}

/// Oversampling of rare attribute values (`[balance]`), training split only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BalanceSection {
    /// Attributes whose rare values are repeated; empty = no oversampling.
    pub attributes: Vec<String>,
    /// Most copies of one row.
    pub max_factor: usize,
}

impl Default for BalanceSection {
    fn default() -> Self {
        Self {
            attributes: Vec::new(),
            max_factor: 8,
        }
    }
}

/// `rows` with each row repeated so that rare values of the balanced attributes weigh more:
/// a row whose value `v` of attribute `a` occurs `count(a, v)` times gets
/// `round(max_v count(a, v) / count(a, v))` copies (the largest over the attributes, at most
/// `max_factor`). Conditioning on a value the data barely has (18 rows of positivity 0 in the
/// shipped 2,500) is otherwise not learned at all.
pub fn balanced(rows: &[AttributeRow], balance: &BalanceSection) -> Vec<AttributeRow> {
    use std::collections::HashMap;
    let value = |row: &AttributeRow, name: &str| {
        row.attributes
            .get(name)
            .copied()
            .flatten()
            .map(|v| v.round() as i64)
    };
    let mut counts: HashMap<(&str, i64), usize> = HashMap::new();
    for row in rows {
        for name in &balance.attributes {
            if let Some(v) = value(row, name) {
                *counts.entry((name.as_str(), v)).or_default() += 1;
            }
        }
    }
    // The count of each attribute's most common value.
    let mut most: HashMap<&str, usize> = HashMap::new();
    for (&(name, _), &count) in &counts {
        let m = most.entry(name).or_default();
        *m = (*m).max(count);
    }
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let copies = balance
            .attributes
            .iter()
            .filter_map(|name| {
                let v = value(row, name)?;
                Some((most[name.as_str()] as f64 / counts[&(name.as_str(), v)] as f64).round() as usize)
            })
            .max()
            .unwrap_or(1)
            .clamp(1, balance.max_factor.max(1));
        out.extend(std::iter::repeat_n(row.clone(), copies));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(positivity: Option<f64>) -> AttributeRow {
        AttributeRow {
            prompt: Prompt::Text("p".into()),
            response: format!("{positivity:?}"),
            attributes: [("positivity".to_string(), positivity)].into_iter().collect(),
        }
    }

    #[test]
    fn rare_values_are_repeated_up_to_the_cap() {
        // 12 rows of 2, 4 of 3, 1 of 0, 1 unrated.
        let mut rows: Vec<AttributeRow> = (0..12).map(|_| row(Some(2.0))).collect();
        rows.extend((0..4).map(|_| row(Some(3.0))));
        rows.push(row(Some(0.0)));
        rows.push(row(None));
        let balance = BalanceSection {
            attributes: vec!["positivity".into()],
            max_factor: 8,
        };
        let out = balanced(&rows, &balance);
        let count = |v: Option<f64>| out.iter().filter(|r| r.attributes["positivity"] == v).count();
        assert_eq!(count(Some(2.0)), 12);
        assert_eq!(count(Some(3.0)), 12); // 4 × round(12 / 4)
        assert_eq!(count(Some(0.0)), 8); // 12 / 1 capped at 8
        assert_eq!(count(None), 1);
        // No attributes: the rows as they are.
        assert_eq!(balanced(&rows, &BalanceSection::default()), rows);
    }
}
