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
use aligner_gen::{Engine, SamplingParams};
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
    /// Classifier-free guidance while sampling (1 = off): each setting is pushed away from
    /// itself with `negative`'s values in place, which spreads the samples further toward
    /// the grid's ends.
    pub guidance_scale: f32,
    /// The values guidance steers away from, e.g. `positivity = 2`.
    pub negative: BTreeMap<String, u8>,
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
            guidance_scale: 1.0,
            negative: BTreeMap::new(),
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
        check_values(name, values, "bootstrap.grid", conditioning)?;
        if values.is_empty() {
            return Err(SteerError::BadConditioning(format!(
                "bootstrap.grid.{name} lists no values"
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

/// A name the model is not conditioned on or a value above 4 under `key` is an error naming it.
fn check_values(name: &str, values: &[u8], key: &str, conditioning: &Conditioning) -> Result<()> {
    if !conditioning.attributes.iter().any(|a| a == name) {
        return Err(SteerError::UnknownAttribute {
            name: format!("{key}.{name}"),
            known: conditioning.attributes.join(", "),
        });
    }
    if let Some(v) = values.iter().find(|&&v| v > MAX_VALUE) {
        return Err(SteerError::BadConditioning(format!(
            "{key}.{name}: {v} is above {MAX_VALUE}"
        )));
    }
    Ok(())
}

/// The values sampling is guided away from (`bootstrap.negative`), or `None` without
/// guidance; a guidance scale without them, an unknown name or a value above 4 is an error
/// naming the key.
pub fn guidance_negative(
    section: &BootstrapSection,
    conditioning: &Conditioning,
) -> Result<Option<BTreeMap<String, f64>>> {
    if section.guidance_scale == 1.0 {
        return Ok(None);
    }
    if !section.guidance_scale.is_finite() || section.guidance_scale < 0.0 {
        return Err(SteerError::BadConditioning(format!(
            "bootstrap.guidance_scale must be at least 0, not {}",
            section.guidance_scale
        )));
    }
    if section.negative.is_empty() {
        return Err(SteerError::BadConditioning(
            "bootstrap.guidance_scale needs bootstrap.negative (the values to steer away from)".into(),
        ));
    }
    let mut negative = BTreeMap::new();
    for (name, &v) in &section.negative {
        check_values(name, &[v], "bootstrap.negative", conditioning)?;
        negative.insert(name.clone(), v as f64);
    }
    Ok(Some(negative))
}

/// One response per prompt and setting (prompt-major), each prompt conditioned on its setting
/// by the model's own template. The rows carry the plain prompt and no attributes yet: the
/// attribute model labels them.
#[allow(clippy::too_many_arguments)] // the sampling inputs, the progress hook and the process group
pub fn sample(
    engine: &mut Engine,
    tokenizer: &TextTokenizer,
    conditioning: &Conditioning,
    prompts: &[Prompt],
    settings: &[BTreeMap<String, f64>],
    section: &BootstrapSection,
    progress: &dyn Fn(),
    comm: &dyn aligner_core::Communicator,
) -> Result<Vec<AttributeRow>> {
    let negative = guidance_negative(section, conditioning)?;
    let mut requests = Vec::with_capacity(prompts.len() * settings.len());
    for prompt in prompts {
        let text = prompt.render(tokenizer)?;
        for setting in settings {
            let params = SamplingParams {
                temperature: section.temperature,
                seed: section.seed.wrapping_add(requests.len() as u64),
                max_new_tokens: section.max_new_tokens,
                ..SamplingParams::default()
            };
            let guidance = negative.as_ref().map(|n| (n, section.guidance_scale));
            requests.push(conditioning.request(tokenizer, &text, setting, guidance, params)?);
        }
    }
    // Data parallel: the ranks' engines take the requests a batch at a time.
    let chunk = engine.slots().max(1);
    let (generated, _) = aligner_core::parallel::map_balanced(comm, requests.len(), chunk, |range| {
        Ok::<_, crate::error::SteerError>(engine.generate_with(&requests[range], &|_| progress())?)
    })?;
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
    fn guidance_takes_checked_negative_values() {
        let conditioning = Conditioning::default();
        let mut section = BootstrapSection::default();
        assert_eq!(guidance_negative(&section, &conditioning).unwrap(), None);
        section.guidance_scale = 2.0;
        let err = guidance_negative(&section, &conditioning)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bootstrap.negative"), "{err}");
        section.negative = [("positivity".to_string(), 2)].into_iter().collect();
        let negative = guidance_negative(&section, &conditioning).unwrap().unwrap();
        assert_eq!(negative, [("positivity".to_string(), 2.0)].into_iter().collect());
        section.negative = [("humour".to_string(), 2)].into_iter().collect();
        let err = guidance_negative(&section, &conditioning)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bootstrap.negative.humour"), "{err}");
        section.negative = [("positivity".to_string(), 5)].into_iter().collect();
        let err = guidance_negative(&section, &conditioning)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bootstrap.negative.positivity: 5"), "{err}");
    }

    /// On the shipped model, greedily: at scale 0 each setting samples as the setting with the
    /// negative values in place does unguided (the negative prompt is the setting overlaid
    /// with them, same seed per request), and a scale above 1 changes the samples.
    #[test]
    fn guided_sampling_steers_each_setting_away_from_its_negative() {
        use aligner_core::{Device, LoadedModel};
        use aligner_gen::{EngineOptions, ForwardPath};

        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/stories260K");
        let lm = LoadedModel::from_dir(&dir, &Device::flex()).unwrap();
        let mut engine = Engine::for_model(
            &lm,
            EngineOptions {
                slots: 4,
                cache_len: None,
                path: ForwardPath::Host,
            },
        );
        let conditioning = Conditioning::default();
        let prompts = ["Once upon a time, a cat", "Tom found a box"].map(|p| Prompt::Text(p.into()));
        let at = |values: &[u8]| -> Vec<BTreeMap<String, f64>> {
            values
                .iter()
                .map(|&v| [("positivity".to_string(), v as f64)].into())
                .collect()
        };
        let mut section = BootstrapSection {
            temperature: 0.0,
            max_new_tokens: 12,
            negative: [("positivity".to_string(), 2)].into(),
            ..BootstrapSection::default()
        };
        let mut run = |settings: &[BTreeMap<String, f64>], section: &BootstrapSection| -> Vec<String> {
            sample(
                &mut engine,
                &lm.tokenizer,
                &conditioning,
                &prompts,
                settings,
                section,
                &|| {},
                aligner_core::parallel::world().as_ref(),
            )
            .unwrap()
            .into_iter()
            .map(|row| row.response)
            .collect()
        };
        let plain = run(&at(&[0, 4]), &section);
        let at_negative = run(&at(&[2, 2]), &section);
        assert_ne!(
            plain, at_negative,
            "the conditioning string changes greedy samples"
        );
        section.guidance_scale = 0.0;
        assert_eq!(run(&at(&[0, 4]), &section), at_negative);
        section.guidance_scale = 3.0;
        assert_ne!(run(&at(&[0, 4]), &section), plain);
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
