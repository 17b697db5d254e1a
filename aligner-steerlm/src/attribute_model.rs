//! SteerLM step 1 and 2: the attribute prediction model (a multi-output regression head on the
//! decoder trunk, masked MSE so missing attributes cost nothing) and annotation with it.

use std::collections::BTreeMap;
use std::path::Path;

use aligner_core::data::{Prompt, load_examples};
use aligner_core::reward::RewardModel;
use aligner_core::rm::masked_mse;
use aligner_core::score::pad_right;
use aligner_core::train::{EvalSum, Objective, StepOutput};
use aligner_core::{CoreError, TextTokenizer};
use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::conditioning::bucket;
use crate::error::Result;

/// `{"prompt", "response", "attributes": {"name": 0..4, ...}}`; an attribute may be missing or
/// `null` (not rated).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttributeRow {
    pub prompt: Prompt,
    pub response: String,
    #[serde(default)]
    pub attributes: BTreeMap<String, Option<f64>>,
}

/// A tokenized row with one target (and a 0/1 mask: rated or not) per configured attribute.
#[derive(Debug, Clone, PartialEq)]
pub struct AttributeExample {
    pub ids: Vec<u32>,
    pub targets: Vec<f32>,
    pub mask: Vec<f32>,
}

/// Reads an attribute file; an attribute name outside `names` is an error naming the line.
pub fn load_attribute_rows(path: &Path, names: &[String]) -> Result<Vec<AttributeRow>> {
    let check = |row: &AttributeRow| match row.attributes.keys().find(|k| !names.contains(k)) {
        Some(unknown) => Err(CoreError::Invalid(format!(
            "unknown attribute {unknown:?} (configured: {})",
            names.join(", ")
        ))),
        None => Ok(row.clone()),
    };
    Ok(load_examples(path, check)?)
}

/// The ids the attribute model reads: prompt and response as one text, truncated.
pub fn row_ids(row: &AttributeRow, tokenizer: &TextTokenizer, max_len: usize) -> Result<Vec<u32>> {
    let prompt = row.prompt.render(tokenizer)?;
    let mut ids = tokenizer.encode(&format!("{prompt}{}", row.response), true)?;
    ids.truncate(max_len.max(1));
    Ok(ids)
}

pub fn attribute_examples(
    rows: &[AttributeRow],
    names: &[String],
    tokenizer: &TextTokenizer,
    max_len: usize,
) -> Result<Vec<AttributeExample>> {
    rows.iter()
        .map(|row| {
            let values: Vec<Option<f64>> = names
                .iter()
                .map(|n| row.attributes.get(n).copied().flatten())
                .collect();
            Ok(AttributeExample {
                ids: row_ids(row, tokenizer, max_len)?,
                targets: values.iter().map(|v| v.unwrap_or(0.0) as f32).collect(),
                mask: values.iter().map(|v| v.is_some() as u8 as f32).collect(),
            })
        })
        .collect()
}

fn matrix(rows: Vec<&[f32]>, device: &Device) -> Tensor<2> {
    let (n, k) = (rows.len(), rows.first().map_or(0, |r| r.len()));
    Tensor::from_data(TensorData::new(rows.concat(), [n, k]), device)
}

fn predictions(model: &RewardModel, batch: &[&AttributeExample]) -> Tensor<2> {
    let device = model.score.weight.device();
    let rows: Vec<&[u32]> = batch.iter().map(|e| e.ids.as_slice()).collect();
    let lengths: Vec<usize> = rows.iter().map(|r| r.len()).collect();
    let valid = aligner_core::score::right_padding_valid(&rows);
    aligner_core::model::with_valid_tokens(valid, || model.forward(pad_right(&rows, 0, &device), &lengths))
}

/// Masked MSE regression on every configured attribute.
pub struct AttributeObjective {
    pub names: Vec<String>,
}

impl Objective<RewardModel> for AttributeObjective {
    type Example = AttributeExample;

    fn step(&self, model: &RewardModel, batch: &[&AttributeExample]) -> aligner_core::Result<StepOutput> {
        let device = model.score.weight.device();
        let pred = predictions(model, batch);
        let targets = matrix(batch.iter().map(|e| e.targets.as_slice()).collect(), &device);
        let mask = matrix(batch.iter().map(|e| e.mask.as_slice()).collect(), &device);
        Ok(StepOutput {
            loss: masked_mse(pred, targets, mask),
            metrics: Vec::new(),
            tokens: batch.iter().map(|e| e.ids.len()).sum(),
        })
    }

    /// The loss is a mean over rated attributes.
    fn loss_weight(&self, batch: &[&AttributeExample]) -> f64 {
        batch
            .iter()
            .map(|e| e.mask.iter().map(|&m| m as f64).sum::<f64>())
            .sum()
    }

    /// Per attribute: mean absolute error and exact-bucket accuracy over rated examples.
    fn evaluate(
        &self,
        model: &RewardModel,
        batch: &[&AttributeExample],
    ) -> aligner_core::Result<Vec<EvalSum>> {
        let k = self.names.len();
        let pred: Vec<f32> = predictions(model, batch)
            .into_data()
            .try_to_vec()
            .unwrap_or_default();
        let mut sums = vec![(0.0, 0.0, 0.0, 0.0); k];
        for (i, e) in batch.iter().enumerate() {
            for j in 0..k {
                if e.mask[j] > 0.0 {
                    let (p, t) = (pred[i * k + j] as f64, e.targets[j] as f64);
                    sums[j].0 += (p - t).powi(2);
                    sums[j].1 += (p - t).abs();
                    sums[j].2 += (bucket(p) as f64 == t) as u8 as f64;
                    sums[j].3 += 1.0;
                }
            }
        }
        let mut out = vec![EvalSum {
            name: "loss".into(),
            sum: sums.iter().map(|s| s.0).sum(),
            weight: sums.iter().map(|s| s.3).sum(),
        }];
        for (name, s) in self.names.iter().zip(sums) {
            out.push(EvalSum {
                name: format!("mae_{name}"),
                sum: s.1,
                weight: s.3,
            });
            out.push(EvalSum {
                name: format!("bucket_accuracy_{name}"),
                sum: s.2,
                weight: s.3,
            });
        }
        Ok(out)
    }

    fn plot_keys(&self) -> Vec<String> {
        let mut keys = vec!["eval_loss".to_string()];
        keys.extend(self.names.iter().map(|n| format!("eval_mae_{n}")));
        keys
    }
}

/// Predicted attributes `[rows][attributes]` of id sequences, in batches.
pub fn predict(
    model: &RewardModel,
    ids: &[Vec<u32>],
    batch: usize,
    progress: &dyn Fn(usize),
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(batch.max(1)) {
        let examples: Vec<AttributeExample> = chunk
            .iter()
            .map(|ids| AttributeExample {
                ids: ids.clone(),
                targets: Vec::new(),
                mask: Vec::new(),
            })
            .collect();
        let refs: Vec<&AttributeExample> = examples.iter().collect();
        let pred: Vec<f32> = predictions(model, &refs)
            .into_data()
            .try_to_vec()
            .map_err(|e| CoreError::Invalid(format!("{e:?}")))?;
        let k = model.outputs();
        out.extend(pred.chunks(k).map(<[f32]>::to_vec));
        progress(chunk.len());
    }
    Ok(out)
}

/// `rows` labelled by an attribute model: each of `names` (the model's outputs, in order)
/// predicted, rounded and clamped to 0..4; earlier attributes are replaced.
pub fn annotate(
    model: &RewardModel,
    names: &[String],
    rows: &[AttributeRow],
    tokenizer: &TextTokenizer,
    max_len: usize,
    batch: usize,
    progress: &dyn Fn(usize),
) -> Result<Vec<AttributeRow>> {
    let ids = rows
        .iter()
        .map(|r| row_ids(r, tokenizer, max_len))
        .collect::<Result<Vec<_>>>()?;
    let predictions = predict(model, &ids, batch, progress)?;
    Ok(rows
        .iter()
        .zip(predictions)
        .map(|(row, pred)| AttributeRow {
            attributes: names
                .iter()
                .zip(pred)
                .map(|(n, v)| (n.clone(), Some(bucket(v as f64) as f64)))
                .collect(),
            ..row.clone()
        })
        .collect())
}
