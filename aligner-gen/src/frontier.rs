//! Where a policy stands on the reward–KL frontier: it samples held-out prompts with the
//! engine, then measures the reward of those samples (when a reward is given), their KL to a
//! reference (the mean of log π(y) − log π_ref(y) over the policy's own samples, per response
//! and per token), the reference's per-token NLL of them (fluency), and distinct-1/2, length
//! and the EOS fraction. Reward alone is never the figure: a reward bought with broken text
//! shows up here as KL and NLL.
//!
//! `aligner eval` prints one [`Summary`]; the training loops of the policy methods log the
//! same figures every validation (`eval_frontier/...` in `metrics.jsonl`) through
//! [`Frontier`], so a run traces its own path on the frontier.

use std::path::{Path, PathBuf};

use aligner_core::data::{EncodedPrompt, load_prompts};
use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::train::{ModelEval, Range, check_value};
use aligner_core::{CausalLm, CoreError, Device, LlamaConfig, TextTokenizer};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::reward::{FunctionReward, ModelReward, Reward, RewardInput};
use crate::{Engine, EngineOptions, GenerationRequest, SamplingParams, StopReason};

/// `[frontier]`: the reward–KL evaluation a policy method runs at every validation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FrontierSection {
    /// `{"prompt": ...}` JSON Lines to sample; empty = no frontier evaluation.
    pub prompts: Option<PathBuf>,
    /// The first N prompts are used; 0 = all.
    pub max_prompts: usize,
    pub samples_per_prompt: usize,
    pub max_new_tokens: usize,
    pub temperature: f32,
    /// Sample i draws with seed + i (the same draws at every evaluation).
    pub seed: u64,
    /// A reward model folder (`aligner rm`'s `final/`) that scores the samples.
    pub reward_model: Option<PathBuf>,
    /// A built-in reward function that scores the samples (see [`RewardFunction`]).
    pub reward_function: Option<RewardFunction>,
}

impl Default for FrontierSection {
    fn default() -> Self {
        Self {
            prompts: None,
            max_prompts: 0,
            samples_per_prompt: 1,
            max_new_tokens: 48,
            temperature: 1.0,
            seed: 0,
            reward_model: None,
            reward_function: None,
        }
    }
}

impl FrontierSection {
    /// The embedded defaults' evaluation: 32 of the shipped task's held-out prompts, scored by
    /// the task's own sentiment lexicon.
    pub fn shipped() -> Self {
        Self {
            prompts: Some(aligner_core::default_data_dir().join("test.prompts.jsonl")),
            max_prompts: 32,
            reward_function: Some(RewardFunction::TinystoriesSentiment),
            ..Self::default()
        }
    }

    /// Whether an evaluation is configured (a prompts file that is not `""`).
    pub fn enabled(&self) -> bool {
        self.prompts.as_ref().is_some_and(|p| !p.as_os_str().is_empty())
    }

    /// The sampling settings, checked, naming the key.
    pub fn options(&self) -> crate::Result<FrontierOptions> {
        if self.samples_per_prompt == 0 {
            return Err(
                CoreError::Invalid("frontier.samples_per_prompt = 0: must be at least 1".into()).into(),
            );
        }
        if self.max_new_tokens == 0 {
            return Err(CoreError::Invalid("frontier.max_new_tokens = 0: must be at least 1".into()).into());
        }
        check_value(
            "frontier.temperature",
            self.temperature as f64,
            Range::NonNegative,
        )?;
        Ok(FrontierOptions {
            samples_per_prompt: self.samples_per_prompt,
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            seed: self.seed,
        })
    }

    /// The evaluator of this section against a run's start model `lm` (its weights as they
    /// are now: load it before adapters are attached or training starts).
    pub fn for_start_model(
        &self,
        lm: &aligner_core::LoadedModel,
        device: &Device,
    ) -> crate::Result<Option<Frontier>> {
        if !self.enabled() {
            return Ok(None);
        }
        let reference = Reference {
            model: lm.model.clone(),
            config: lm.config.clone(),
            tokenizer: lm.tokenizer.clone(),
        };
        self.build(reference, device)
    }

    /// [`FrontierSection::for_start_model`] on rank 0 of `run`, which alone measures the
    /// frontier (`None` on the other ranks, which then hold no start model for it): for a
    /// trainer that validates through `aligner_core::train::Trainer`, whose ranks agree on
    /// whether rank 0 measures it.
    pub fn for_start_model_on_rank_0(
        &self,
        lm: &aligner_core::LoadedModel,
        run: &aligner_core::run::RunDir,
        device: &Device,
    ) -> crate::Result<Option<Frontier>> {
        match run.is_writer() {
            true => self.for_start_model(lm, device),
            false => Ok(None),
        }
    }

    /// [`FrontierSection::for_start_model`] for a run whose start model `lm` was read from
    /// `[model]` (`section`) and may be split over the tensor group of `run`: the frontier
    /// samples from and scores against the whole start model, loaded whole for it then. Rank
    /// 0 alone measures the frontier, so only it holds the start model for it (`None` on the
    /// other ranks: a fully sharded or split run keeps no whole copy there).
    pub fn for_split_start_model(
        &self,
        lm: &aligner_core::LoadedModel,
        section: &aligner_core::train::ModelSection,
        run: &aligner_core::run::RunDir,
        device: &Device,
    ) -> crate::Result<Option<Frontier>> {
        match run.tensor_group() {
            Some(_) if self.enabled() && run.is_writer() => {
                self.for_start_model(&aligner_core::start::load_model(section, device)?, device)
            }
            _ => self.for_start_model_on_rank_0(lm, run, device),
        }
    }

    /// The evaluator of this section against `reference` (None when no prompts file is set):
    /// the prompts are read and the reward model loaded now, so a bad file stops the run
    /// before it trains.
    pub fn build(&self, reference: Reference, device: &Device) -> crate::Result<Option<Frontier>> {
        let Some(path) = self.prompts.as_ref().filter(|_| self.enabled()) else {
            return Ok(None);
        };
        let options = self.options()?;
        aligner_core::train::check_new_tokens(
            &[("frontier.max_new_tokens", self.max_new_tokens)],
            &reference.config,
        )?;
        let mut prompts = load_prompts(
            path,
            &reference.tokenizer,
            reference.config.max_position_embeddings,
        )?;
        if self.max_prompts > 0 {
            prompts.truncate(self.max_prompts);
        }
        let mut rewards = Vec::new();
        if let Some(dir) = &self.reward_model {
            rewards.push(ModelReward::from_dir("reward", dir, device)?.boxed());
        }
        if let Some(function) = self.reward_function {
            rewards.push(FunctionReward(function).boxed());
        }
        Ok(Some(Frontier {
            reference,
            prompts,
            rewards,
            options,
        }))
    }
}

/// How the samples are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FrontierOptions {
    pub samples_per_prompt: usize,
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub seed: u64,
}

impl Default for FrontierOptions {
    fn default() -> Self {
        Self {
            samples_per_prompt: 1,
            max_new_tokens: 48,
            temperature: 1.0,
            seed: 0,
        }
    }
}

/// A built-in reward function of a response's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardFunction {
    /// The shipped tinystories_sentiment task's score (assets/tinystories_sentiment/SOURCE.txt):
    /// positive minus negative words of a fixed lexicon, words being lower-cased runs of
    /// `[a-z']`.
    TinystoriesSentiment,
}

impl RewardFunction {
    /// Every function by its configuration name.
    pub const ALL: [(&'static str, RewardFunction); 1] =
        [("tinystories_sentiment", RewardFunction::TinystoriesSentiment)];

    /// The function named `name` (as in `frontier.reward_function`).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
    }

    pub fn name(self) -> &'static str {
        match self {
            RewardFunction::TinystoriesSentiment => "tinystories_sentiment",
        }
    }

    /// The reward of one response.
    pub fn score(self, response: &str) -> f64 {
        match self {
            RewardFunction::TinystoriesSentiment => sentiment_lexicon(response) as f64,
        }
    }
}

const POSITIVE: &[&str] = &[
    "happy",
    "happily",
    "smiled",
    "smile",
    "smiles",
    "laughed",
    "laugh",
    "fun",
    "love",
    "loved",
    "loves",
    "friend",
    "friends",
    "good",
    "great",
    "kind",
    "nice",
    "hug",
    "hugged",
    "play",
    "played",
    "together",
    "yay",
    "glad",
    "enjoy",
    "enjoyed",
    "best",
    "beautiful",
    "proud",
    "excited",
    "thank",
    "thanked",
];
const NEGATIVE: &[&str] = &[
    "sad", "sadly", "cried", "cry", "crying", "scared", "angry", "mad", "hurt", "bad", "upset", "lost",
    "alone", "broke", "broken", "afraid", "fear", "tears", "mean", "never", "sorry", "ouch", "pain", "sick",
];

/// The tinystories_sentiment score of `text`: positive minus negative lexicon words.
pub fn sentiment_lexicon(text: &str) -> i64 {
    let lower = text.to_lowercase();
    lower
        .split(|c: char| !(c.is_ascii_lowercase() || c == '\''))
        .filter(|w| !w.is_empty())
        .map(|w| POSITIVE.contains(&w) as i64 - NEGATIVE.contains(&w) as i64)
        .sum()
}

/// The model the KL and the NLL are measured against, with its tokenizer.
pub struct Reference {
    pub model: CausalLm,
    pub config: LlamaConfig,
    pub tokenizer: TextTokenizer,
}

/// One sample's figures (`samples.jsonl`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    pub prompt_line: usize,
    pub response: String,
    pub tokens: usize,
    pub eos: bool,
    pub policy_logprob: f64,
    pub reference_logprob: f64,
    /// Each reward's score, by name.
    pub rewards: Map<String, Value>,
}

/// The figures of one evaluation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub samples: usize,
    /// The first reward's mean and standard error (absent without a reward).
    pub reward: Option<f64>,
    pub reward_stderr: Option<f64>,
    /// Every reward's mean, by name.
    pub rewards: Map<String, Value>,
    /// Mean of log π(y) − log π_ref(y) over the samples, in nats per response, and per token.
    pub kl_per_response: f64,
    pub kl_per_token: f64,
    /// The reference's negative log-likelihood of the samples, in nats per token.
    pub reference_nll_per_token: f64,
    pub distinct_1: f64,
    pub distinct_2: f64,
    /// Mean response length in tokens, and the share of samples that ended with EOS.
    pub mean_tokens: f64,
    pub eos_fraction: f64,
}

impl Summary {
    /// The figures as `eval_frontier/<name>` metrics.
    pub fn metrics(&self) -> Map<String, Value> {
        let mut out = Map::new();
        let mut put = |name: &str, v: f64| {
            out.insert(format!("eval_frontier/{name}"), v.into());
        };
        put("kl", self.kl_per_response);
        put("kl_per_token", self.kl_per_token);
        put("nll", self.reference_nll_per_token);
        put("distinct_2", self.distinct_2);
        put("tokens", self.mean_tokens);
        put("eos", self.eos_fraction);
        for (name, v) in &self.rewards {
            if let Some(v) = v.as_f64() {
                put(name, v);
            }
        }
        out
    }
}

/// A frontier evaluation: held-out prompts, a reference and the rewards, ready to measure any
/// policy of the reference's vocabulary.
pub struct Frontier {
    pub reference: Reference,
    pub prompts: Vec<EncodedPrompt>,
    /// What scores the samples (a reward model is logged as `reward`, a function by its
    /// name).
    pub rewards: Vec<Box<dyn Reward>>,
    pub options: FrontierOptions,
}

impl Frontier {
    /// Samples the prompts from `policy` and measures the samples.
    pub fn evaluate(&self, policy: &CausalLm) -> crate::Result<(Summary, Vec<Sample>)> {
        let n = self.options.samples_per_prompt.max(1);
        let requests: Vec<GenerationRequest> = (0..self.prompts.len() * n)
            .map(|i| GenerationRequest {
                prompt_ids: self.prompts[i / n].ids.clone(),
                params: SamplingParams {
                    temperature: self.options.temperature,
                    seed: self.options.seed.wrapping_add(i as u64),
                    max_new_tokens: self.options.max_new_tokens,
                    ..SamplingParams::default()
                },
                guidance: None,
            })
            .collect();
        let mut engine = Engine::new(
            policy.clone(),
            self.reference.config.clone(),
            Some(self.reference.tokenizer.clone()),
            EngineOptions::default(),
        );
        let generations = engine.generate(&requests)?;
        // The reference's log-probs of the very tokens the policy drew.
        let sequences: Vec<ScoredSequence> = requests
            .iter()
            .zip(&generations)
            .map(|(r, g)| g.scored(r))
            .collect();
        let reference_lp = response_logprobs(&self.reference.model, &sequences, 16)?;
        let responses = requests
            .iter()
            .zip(&generations)
            .map(|(r, g)| {
                self.reference
                    .tokenizer
                    .decode_continuation(&r.prompt_ids, &g.token_ids)
            })
            .collect::<aligner_core::Result<Vec<String>>>()?;
        let inputs: Vec<RewardInput<'_>> = requests
            .iter()
            .zip(&generations)
            .zip(&responses)
            .enumerate()
            .map(|(i, ((r, g), response))| {
                let prompt = &self.prompts[i / n];
                RewardInput {
                    prompt: &prompt.text,
                    response,
                    prompt_ids: &r.prompt_ids,
                    response_ids: &g.token_ids,
                    stop_reason: g.stop_reason,
                    fields: &prompt.fields,
                }
            })
            .collect();
        let scores = self
            .rewards
            .iter()
            .map(|r| r.score(&inputs))
            .collect::<Result<Vec<Vec<f64>>, _>>()?;
        let samples: Vec<Sample> = generations
            .iter()
            .zip(&reference_lp)
            .zip(responses)
            .enumerate()
            .map(|(i, ((g, r), response))| Sample {
                prompt_line: self.prompts[i / n].line,
                response,
                tokens: g.token_ids.len(),
                eos: g.stop_reason == StopReason::Eos,
                policy_logprob: g.token_logprobs.iter().map(|&v| v as f64).sum(),
                reference_logprob: r.total(),
                rewards: self
                    .rewards
                    .iter()
                    .zip(&scores)
                    .map(|(reward, s)| (reward.name().to_string(), s[i].into()))
                    .collect(),
            })
            .collect();
        let names: Vec<&str> = self.rewards.iter().map(|r| r.name()).collect();
        Ok((summarize(&samples, &names), samples))
    }
}

impl ModelEval<CausalLm> for Frontier {
    fn evaluate(&self, model: &CausalLm) -> aligner_core::Result<Map<String, Value>> {
        let (summary, samples) = Frontier::evaluate(self, model)?;
        let mut metrics = summary.metrics();
        // A few samples as text for TensorBoard (metrics.jsonl leaves `text/` keys out).
        let shown: Vec<String> = samples
            .iter()
            .take(3)
            .map(|s| {
                let prompt = self
                    .prompts
                    .iter()
                    .find(|p| p.line == s.prompt_line)
                    .map_or("", |p| p.text.as_str());
                format!("**{}**{}", prompt.trim_end(), s.response)
            })
            .collect();
        metrics.insert(
            format!(
                "{}eval_frontier/samples",
                aligner_core::train::metrics::TEXT_PREFIX
            ),
            shown.join("\n\n").into(),
        );
        Ok(metrics)
    }
}

/// A labelled path on the reward–KL plane: one point for an evaluation, one per validation
/// for a training run.
#[derive(Debug, Clone, PartialEq)]
pub struct FrontierSeries {
    pub label: String,
    /// `(KL per response, reward)`.
    pub points: Vec<(f64, f64)>,
}

/// The `eval_frontier/...` figures that are not rewards.
const FIGURES: [&str; 6] = ["kl", "kl_per_token", "nll", "distinct_2", "tokens", "eos"];

/// A point when both coordinates are finite numbers.
fn frontier_point(kl: Option<f64>, reward: Option<f64>) -> Option<(f64, f64)> {
    Some((kl?, reward?)).filter(|(k, r)| k.is_finite() && r.is_finite())
}

/// What `path` holds on the reward–KL plane, labelled by its name: an evaluation
/// (`aligner eval`'s `summary.json`, or the folder of one) or a training run's path (a folder
/// whose `metrics.jsonl` has `eval_frontier/...` figures). Anything else is an error naming
/// the file and what it lacks.
pub fn frontier_series(path: &Path) -> crate::Result<FrontierSeries> {
    let label = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let bad = |message: String| CoreError::Invalid(message).into();
    let summary = match path.is_dir() {
        true => path.join("summary.json"),
        false => path.to_path_buf(),
    };
    if summary.is_file() {
        let text = std::fs::read_to_string(&summary).map_err(|e| CoreError::io(&summary, e))?;
        let value: Value = serde_json::from_str(text.trim())
            .map_err(|e| CoreError::Invalid(format!("{}: {e}", summary.display())))?;
        let point =
            frontier_point(value["kl_per_response"].as_f64(), value["reward"].as_f64()).ok_or_else(|| {
                bad(format!(
                    "{}: no reward and kl_per_response (evaluate with --reward or --reward-fn)",
                    summary.display()
                ))
            })?;
        return Ok(FrontierSeries {
            label,
            points: vec![point],
        });
    }
    let metrics = path.join("metrics.jsonl");
    if !metrics.is_file() {
        return Err(bad(format!(
            "{}: neither an evaluation (summary.json) nor a run (metrics.jsonl)",
            path.display()
        )));
    }
    let rows: Vec<Map<String, Value>> = aligner_core::data::read_jsonl(&metrics)?;
    let reward_key = rows
        .iter()
        .flat_map(|r| r.keys())
        .find(|k| k.starts_with("eval_frontier/") && !FIGURES.contains(&&k["eval_frontier/".len()..]))
        .cloned()
        .ok_or_else(|| {
            bad(format!(
                "{}: no eval_frontier reward (was [frontier] set?)",
                metrics.display()
            ))
        })?;
    let points = rows
        .iter()
        .filter_map(|r| frontier_point(r.get("eval_frontier/kl")?.as_f64(), r.get(&reward_key)?.as_f64()))
        .collect();
    Ok(FrontierSeries { label, points })
}

/// Draws `series` on one reward-against-KL chart, an SVG at `path`.
pub fn plot_frontier(series: &[FrontierSeries], path: &Path) -> crate::Result<()> {
    let lines: Vec<(&str, &[(f64, f64)])> = series
        .iter()
        .map(|s| (s.label.as_str(), s.points.as_slice()))
        .collect();
    aligner_core::train::metrics::plot_points(
        &lines,
        (
            "reward against KL to the reference",
            "KL(π ‖ π_ref), nats per response",
            "reward",
        ),
        path,
    )?;
    Ok(())
}

/// Distinct n-grams over all the samples' whitespace words divided by all n-grams (0 when
/// there are none): how varied the text is.
pub fn distinct_n(texts: &[&str], n: usize) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0usize;
    for text in texts {
        let words: Vec<&str> = text.split_whitespace().collect();
        for gram in words.windows(n) {
            seen.insert(gram.to_vec());
            total += 1;
        }
    }
    match total {
        0 => 0.0,
        _ => seen.len() as f64 / total as f64,
    }
}

/// Mean and standard error of the mean.
pub fn mean_and_stderr(values: &[f64]) -> (f64, f64) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, (var / n).sqrt())
}

/// The summary of `samples`, the rewards in the order of `reward_names`.
pub fn summarize(samples: &[Sample], reward_names: &[&str]) -> Summary {
    let count = samples.len().max(1) as f64;
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let kl_total: f64 = samples
        .iter()
        .map(|s| s.policy_logprob - s.reference_logprob)
        .sum();
    let reference_total: f64 = samples.iter().map(|s| s.reference_logprob).sum();
    let mut rewards = Map::new();
    let mut first = None;
    for name in reward_names {
        let values: Vec<f64> = samples
            .iter()
            .filter_map(|s| s.rewards.get(*name).and_then(Value::as_f64))
            .collect();
        if values.is_empty() {
            continue;
        }
        let (mean, stderr) = mean_and_stderr(&values);
        first.get_or_insert((mean, stderr));
        rewards.insert(name.to_string(), mean.into());
    }
    let texts: Vec<&str> = samples.iter().map(|s| s.response.as_str()).collect();
    Summary {
        samples: samples.len(),
        reward: first.map(|f| f.0),
        reward_stderr: first.map(|f| f.1),
        rewards,
        kl_per_response: kl_total / count,
        kl_per_token: kl_total / tokens.max(1) as f64,
        reference_nll_per_token: -reference_total / tokens.max(1) as f64,
        distinct_1: distinct_n(&texts, 1),
        distinct_2: distinct_n(&texts, 2),
        mean_tokens: tokens as f64 / count,
        eos_fraction: samples.iter().filter(|s| s.eos).count() as f64 / count,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_n_counts_unique_ngrams_over_all_samples() {
        assert_eq!(distinct_n(&["a b a b"], 1), 0.5);
        // Bigrams: (a b) (b a) (a b) | (a b): 2 unique of 4.
        assert_eq!(distinct_n(&["a b a b", "a b"], 2), 0.5);
        assert_eq!(distinct_n(&["a"], 2), 0.0);
    }

    #[test]
    fn mean_and_stderr_by_hand() {
        let (mean, stderr) = mean_and_stderr(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(mean, 2.5);
        // Sample variance 5/3, over n = 4.
        assert!((stderr - (5.0f64 / 3.0 / 4.0).sqrt()).abs() < 1e-12);
    }

    #[test]
    fn the_lexicon_counts_whole_lowercased_words() {
        // happy, smiled, friends (+3); sad (−1); "Happy!" counts, "unhappy" and "sadness" do not.
        assert_eq!(
            sentiment_lexicon("Tom was happy. He smiled at his friends, then sad."),
            2
        );
        assert_eq!(sentiment_lexicon("Happy! unhappy sadness"), 1);
        assert_eq!(sentiment_lexicon("never never"), -2);
        assert_eq!(sentiment_lexicon(""), 0);
    }

    #[test]
    fn summary_by_hand() {
        let sample = |tokens, eos, policy, reference, reward: f64, text: &str| Sample {
            prompt_line: 1,
            response: text.into(),
            tokens,
            eos,
            policy_logprob: policy,
            reference_logprob: reference,
            rewards: [("r".to_string(), Value::from(reward))].into_iter().collect(),
        };
        let samples = [
            sample(2, true, -2.0, -3.0, 1.0, "a b"),
            sample(4, false, -4.0, -8.0, 3.0, "a c"),
        ];
        let s = summarize(&samples, &["r"]);
        // KL: (1 + 4) / 2 per response, 5 / 6 per token; NLL 11 / 6.
        assert_eq!(s.kl_per_response, 2.5);
        assert!((s.kl_per_token - 5.0 / 6.0).abs() < 1e-12);
        assert!((s.reference_nll_per_token - 11.0 / 6.0).abs() < 1e-12);
        assert_eq!((s.reward, s.reward_stderr), (Some(2.0), Some(1.0)));
        assert_eq!((s.mean_tokens, s.eos_fraction), (3.0, 0.5));
        assert_eq!(s.distinct_1, 0.75);
        assert_eq!(s.metrics()["eval_frontier/r"], 2.0);
    }
}
