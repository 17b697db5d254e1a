//! SteerLM step 4, bootstrapping: the conditioned model samples responses, the attribute model
//! labels them, and conditioned SFT runs again on the labelled samples.
//!
//! The paper samples at the highest quality setting; here the samples are drawn over a grid of
//! settings (every combination of [`BootstrapSection::grid`]; a grid of one setting is the
//! paper's). The asked values only spread the samples: each is trained on the values the
//! attribute model reads in it. A value the human data barely has (positivity 0: 18 of the
//! shipped 2,500 rows) is then learned from the hundreds of samples that turn out to have it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use aligner_core::TextTokenizer;
use aligner_core::data::Prompt;
use aligner_gen::{Engine, GenerationRequest, SamplingParams};
use serde::{Deserialize, Serialize};

use crate::attribute_model::AttributeRow;
use crate::conditioning::{Conditioning, MAX_VALUE, bucket};
use crate::error::{Result, SteerError};

/// `[bootstrap]`: what `aligner steerlm bootstrap` samples and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BootstrapSection {
    /// The attribute model that labels the samples; unset: one is trained into
    /// `<run>/attributes` with the `attributes` step's defaults.
    pub attribute_model: Option<PathBuf>,
    /// `{"prompt"}` JSON Lines; every prompt is sampled once per setting.
    pub prompts: PathBuf,
    /// Values asked for while sampling, per attribute; every combination is one setting.
    /// Attributes not named are left out of the conditioning string.
    pub grid: BTreeMap<String, Vec<u8>>,
    pub max_new_tokens: usize,
    pub temperature: f32,
    /// Sample `i` draws from its own stream, seeded `seed + i`.
    pub seed: u64,
    /// Train on `data.train` as well as on the labelled samples.
    pub keep_data: bool,
}

impl Default for BootstrapSection {
    fn default() -> Self {
        let values = |v: &[u8]| v.to_vec();
        Self {
            attribute_model: None,
            prompts: aligner_core::default_data_dir().join("train.prompts.jsonl"),
            grid: [
                ("positivity".to_string(), values(&[0, 1, 2, 3, 4])),
                ("verbosity".to_string(), values(&[0, 1, 2])),
                ("dialogue".to_string(), values(&[0])),
            ]
            .into_iter()
            .collect(),
            // The length of the shipped data's responses.
            max_new_tokens: 48,
            temperature: 1.0,
            seed: 0,
            keep_data: true,
        }
    }
}

/// Every combination of the grid's values. A name the model is not conditioned on, a value
/// above 4 or an empty list is an error naming it.
pub fn settings(
    grid: &BTreeMap<String, Vec<u8>>,
    conditioning: &Conditioning,
) -> Result<Vec<BTreeMap<String, f64>>> {
    let mut out = vec![BTreeMap::new()];
    for (name, values) in grid {
        if !conditioning.attributes.contains(name) {
            return Err(SteerError::UnknownAttribute {
                name: format!("bootstrap.grid.{name}"),
                known: conditioning.attributes.join(", "),
            });
        }
        if values.is_empty() {
            return Err(SteerError::BadConditioning(format!(
                "bootstrap.grid.{name} lists no values"
            )));
        }
        if let Some(v) = values.iter().find(|&&v| v > MAX_VALUE) {
            return Err(SteerError::BadConditioning(format!(
                "bootstrap.grid.{name}: {v} is above {MAX_VALUE}"
            )));
        }
        out = out
            .into_iter()
            .flat_map(|setting| {
                values.iter().map(move |&v| {
                    let mut next = setting.clone();
                    next.insert(name.clone(), v as f64);
                    next
                })
            })
            .collect();
    }
    Ok(out)
}

/// One response per prompt and setting (prompt-major), each prompt conditioned on its setting
/// by the model's own template. The rows carry the plain prompt and no attributes yet: the
/// attribute model labels them.
pub fn sample(
    engine: &mut Engine,
    tokenizer: &TextTokenizer,
    conditioning: &Conditioning,
    prompts: &[Prompt],
    settings: &[BTreeMap<String, f64>],
    section: &BootstrapSection,
    progress: &dyn Fn(),
) -> Result<Vec<AttributeRow>> {
    let mut requests = Vec::with_capacity(prompts.len() * settings.len());
    for prompt in prompts {
        let text = prompt.render(tokenizer)?;
        for setting in settings {
            requests.push(GenerationRequest {
                prompt_ids: tokenizer.encode(&conditioning.apply(&text, setting)?, true)?,
                params: SamplingParams {
                    temperature: section.temperature,
                    seed: section.seed.wrapping_add(requests.len() as u64),
                    max_new_tokens: section.max_new_tokens,
                    ..SamplingParams::default()
                },
                guidance: None,
            });
        }
    }
    let generated = engine.generate_with(&requests, &|_| progress())?;
    let mut rows = Vec::with_capacity(generated.len());
    for ((request, out), prompt) in requests.iter().zip(&generated).zip(
        prompts
            .iter()
            .flat_map(|p| std::iter::repeat_n(p, settings.len())),
    ) {
        rows.push(AttributeRow {
            prompt: prompt.clone(),
            response: tokenizer.decode_continuation(&request.prompt_ids, &out.token_ids)?,
            attributes: BTreeMap::new(),
        });
    }
    Ok(rows)
}

/// How many rows have each value of each attribute: `name -> [count of 0, ..., count of 4]`.
pub fn value_counts(rows: &[AttributeRow]) -> BTreeMap<String, [usize; MAX_VALUE as usize + 1]> {
    let mut counts: BTreeMap<String, [usize; MAX_VALUE as usize + 1]> = BTreeMap::new();
    for row in rows {
        for (name, value) in &row.attributes {
            if let Some(v) = value {
                counts.entry(name.clone()).or_default()[bucket(*v) as usize] += 1;
            }
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(entries: &[(&str, &[u8])]) -> BTreeMap<String, Vec<u8>> {
        entries.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect()
    }

    #[test]
    fn settings_are_every_combination_of_the_grid() {
        let conditioning = Conditioning::default();
        let all = settings(
            &grid(&[("positivity", &[0, 4]), ("verbosity", &[1, 2, 3])]),
            &conditioning,
        )
        .unwrap();
        assert_eq!(all.len(), 6);
        let strings: Vec<String> = all.iter().map(|s| conditioning.format(s).unwrap()).collect();
        for expected in ["verbosity:1,positivity:0", "verbosity:3,positivity:4"] {
            assert!(strings.contains(&expected.to_string()), "{strings:?}");
        }
        // No grid: one setting, the unconditioned string.
        assert_eq!(
            settings(&BTreeMap::new(), &conditioning).unwrap(),
            vec![BTreeMap::new()]
        );
    }

    #[test]
    fn bad_grids_name_the_key() {
        let conditioning = Conditioning::default();
        let err = settings(&grid(&[("humour", &[1])]), &conditioning)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bootstrap.grid.humour") && err.contains("positivity"),
            "{err}"
        );
        let err = settings(&grid(&[("positivity", &[2, 7])]), &conditioning)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bootstrap.grid.positivity") && err.contains("above 4"),
            "{err}"
        );
        let err = settings(&grid(&[("verbosity", &[])]), &conditioning)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bootstrap.grid.verbosity"), "{err}");
    }

    #[test]
    fn value_counts_bucket_each_attribute() {
        let row = |p: Option<f64>, v: f64| AttributeRow {
            prompt: Prompt::Text("p".into()),
            response: "r".into(),
            attributes: [("positivity".to_string(), p), ("verbosity".to_string(), Some(v))]
                .into_iter()
                .collect(),
        };
        let counts = value_counts(&[row(Some(0.0), 1.0), row(Some(4.0), 1.0), row(None, 2.0)]);
        assert_eq!(counts["positivity"], [1, 0, 0, 0, 1]);
        assert_eq!(counts["verbosity"], [0, 2, 1, 0, 0]);
    }
}
