//! Rewards as functions: what scores a sampled response in online RL (PPO, the GRPO family,
//! rejection sampling, online DPO).
//!
//! A [`Reward`] takes a batch of [`RewardInput`]s — the prompt and response (text and ids),
//! why the response stopped, and the other fields of the prompt's row (`"answer"`, a target
//! word, ...) — and returns one score each. Implementations:
//! - [`ModelReward`]: a reward model's first output (what PPO used alone before);
//! - [`CommandReward`]: a persistent external process (`reward.command = ["python3", "verify.py"]`)
//!   reading JSON Lines requests on stdin and writing one score per line on stdout;
//! - [`HttpReward`]: a JSON POST to `reward.url`, retried with back-off;
//! - [`RuleReward`]: built-in rules (regex / exact / contains against a field of the row or a
//!   fixed pattern, a length target, a penalty for responses cut before EOS) and
//!   [`FunctionReward`], the built-in text functions (the shipped task's lexicon);
//! - [`Rewards`]: several of them with weights (`[[reward]]` tables), itself a [`Reward`].
//!
//! A reward that cannot score (a crashed or silent process, a reply that is not a finite
//! number, an endpoint that keeps failing) is an error naming it: nothing is ever scored 0 in
//! its place.

mod command;
pub(crate) mod http;
mod rules;
mod spec;

use serde_json::{Map, Value};

use aligner_core::reward::RewardModel;

pub use command::CommandReward;
pub use http::HttpReward;
pub use rules::{FunctionReward, Rule, RuleReward};
pub use spec::{RewardSpec, RewardSpecs};

use crate::StopReason;

/// One sample to score.
#[derive(Debug, Clone, Copy)]
pub struct RewardInput<'a> {
    /// The prompt as the model saw it (chat template applied).
    pub prompt: &'a str,
    /// The response's text (the generated tokens decoded, EOS left out).
    pub response: &'a str,
    pub prompt_ids: &'a [u32],
    pub response_ids: &'a [u32],
    pub stop_reason: StopReason,
    /// The prompt row's other fields (everything but `prompt`).
    pub fields: &'a Map<String, Value>,
}

impl RewardInput<'_> {
    /// The JSON request external rewards receive:
    /// `{"prompt", "response", "stop_reason", "response_tokens", "metadata": {row fields}}`.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "prompt": self.prompt,
            "response": self.response,
            "stop_reason": self.stop_reason,
            "response_tokens": self.response_ids.len(),
            "metadata": self.fields,
        })
    }
}

/// Something that scores samples. `score` returns one finite score per input, in order, or an
/// error that names the reward.
pub trait Reward: Send + Sync {
    /// The name its figures are logged under (`reward/<name>`).
    fn name(&self) -> &str;
    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RewardError>;

    /// This reward behind a pointer, as [`Rewards`] and the frontier hold them.
    fn boxed(self) -> Box<dyn Reward>
    where
        Self: Sized + 'static,
    {
        Box::new(self)
    }
}

/// Why a reward could not score a batch.
#[derive(Debug, thiserror::Error)]
#[error("reward {name:?}: {message}")]
pub struct RewardError {
    /// The reward's name (its `[[reward]]` table's `name`, or what it was built from).
    pub name: String,
    pub message: String,
}

impl RewardError {
    pub fn new(name: &str, message: impl Into<String>) -> Self {
        Self {
            name: name.to_string(),
            message: message.into(),
        }
    }
}

/// A reward model's first output on the prompt + response ids.
pub struct ModelReward {
    name: String,
    model: RewardModel,
    batch_size: usize,
}

impl ModelReward {
    pub fn new(name: impl Into<String>, model: RewardModel, batch_size: usize) -> Self {
        Self {
            name: name.into(),
            model,
            batch_size,
        }
    }

    /// The reward model in `dir` (`aligner rm`'s `final/`; a folder without a score head is
    /// refused naming it), scoring 16 sequences a batch.
    pub fn from_dir(
        name: impl Into<String>,
        dir: &std::path::Path,
        device: &aligner_core::Device,
    ) -> crate::Result<Self> {
        let loaded = aligner_core::start::LoadedRewardModel::from_dir(dir, device)?;
        Ok(Self::new(name, loaded.model, 16))
    }
}

impl Reward for ModelReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RewardError> {
        let rows: Vec<Vec<u32>> = batch
            .iter()
            .map(|i| [i.prompt_ids, i.response_ids].concat())
            .collect();
        let rows: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
        let scores = self
            .model
            .score_rows(&rows, self.batch_size)
            .map_err(|e| RewardError::new(&self.name, e.to_string()))?;
        Ok(scores.iter().map(|r| r[0] as f64).collect())
    }
}

/// Weighted rewards: the score is `Σ weight · score`; [`Rewards::score_parts`] also returns
/// each part's own scores for logging.
#[derive(Default)]
pub struct Rewards {
    parts: Vec<(f64, Box<dyn Reward>)>,
}

/// A batch's combined scores and each part's own.
pub struct ScoredParts {
    pub total: Vec<f64>,
    /// `(name, scores)` of each part, in configuration order.
    pub parts: Vec<(String, Vec<f64>)>,
}

impl Rewards {
    pub fn new(parts: Vec<(f64, Box<dyn Reward>)>) -> Self {
        Self { parts }
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The names of the parts, in order.
    pub fn names(&self) -> Vec<&str> {
        self.parts.iter().map(|(_, r)| r.name()).collect()
    }

    pub fn score_parts(&self, batch: &[RewardInput<'_>]) -> Result<ScoredParts, RewardError> {
        let mut total = vec![0.0; batch.len()];
        let mut parts = Vec::with_capacity(self.parts.len());
        for (weight, reward) in &self.parts {
            let scores = reward.score(batch)?;
            check_scores(reward.name(), &scores, batch.len())?;
            for (t, s) in total.iter_mut().zip(&scores) {
                *t += weight * s;
            }
            parts.push((reward.name().to_string(), scores));
        }
        Ok(ScoredParts { total, parts })
    }
}

impl Reward for Rewards {
    fn name(&self) -> &str {
        match self.parts.as_slice() {
            [(_, only)] => only.name(),
            _ => "reward",
        }
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RewardError> {
        Ok(self.score_parts(batch)?.total)
    }
}

/// One finite score per input, or an error naming the reward.
pub fn check_scores(name: &str, scores: &[f64], expected: usize) -> Result<(), RewardError> {
    if scores.len() != expected {
        return Err(RewardError::new(
            name,
            format!("returned {} scores for {expected} samples", scores.len()),
        ));
    }
    if let Some((i, s)) = scores.iter().enumerate().find(|(_, s)| !s.is_finite()) {
        return Err(RewardError::new(
            name,
            format!("score {i} of the batch is {s}, not a finite number"),
        ));
    }
    Ok(())
}

/// A score from one line of a reward's reply: a JSON number, or an object with a numeric
/// `score` (or `reward`) field.
pub(crate) fn parse_score(value: &Value) -> Option<f64> {
    match value {
        Value::Number(n) => n.as_f64(),
        Value::Object(o) => o.get("score").or_else(|| o.get("reward")).and_then(Value::as_f64),
        _ => None,
    }
    .filter(|s| s.is_finite())
}

/// `text` cut to `max` characters for an error message.
pub(crate) fn shown(text: &str, max: usize) -> String {
    let mut out: String = text.chars().take(max).collect();
    if text.chars().count() > max {
        out.push('…');
    }
    format!("{out:?}")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Inputs over `responses` with the given row fields, all ended by EOS.
    pub fn inputs<'a>(responses: &'a [&'a str], fields: &'a Map<String, Value>) -> Vec<RewardInput<'a>> {
        responses
            .iter()
            .map(|r| RewardInput {
                prompt: "Once upon a time",
                response: r,
                prompt_ids: &[1, 2],
                response_ids: &[3, 4, 5],
                stop_reason: StopReason::Eos,
                fields,
            })
            .collect()
    }

    struct Fixed(&'static str, Vec<f64>);
    impl Reward for Fixed {
        fn name(&self) -> &str {
            self.0
        }
        fn score(&self, _: &[RewardInput<'_>]) -> Result<Vec<f64>, RewardError> {
            Ok(self.1.clone())
        }
    }

    #[test]
    fn weighted_rewards_sum_their_parts() {
        let rewards = Rewards::new(vec![
            (1.0, Box::new(Fixed("a", vec![1.0, 2.0]))),
            (-0.5, Box::new(Fixed("b", vec![4.0, 0.0]))),
        ]);
        let fields = Map::new();
        let scored = rewards.score_parts(&inputs(&["x", "y"], &fields)).unwrap();
        assert_eq!(scored.total, vec![-1.0, 2.0]);
        assert_eq!(scored.parts[1], ("b".to_string(), vec![4.0, 0.0]));
        assert_eq!(rewards.name(), "reward");
    }

    #[test]
    fn a_part_with_too_few_or_non_finite_scores_is_an_error_naming_it() {
        let fields = Map::new();
        let batch = inputs(&["x", "y"], &fields);
        let short = Rewards::new(vec![(1.0, Box::new(Fixed("short", vec![1.0])))]);
        let e = short.score(&batch).unwrap_err().to_string();
        assert!(e.contains("\"short\"") && e.contains("1 scores for 2"), "{e}");
        let nan = Rewards::new(vec![(1.0, Box::new(Fixed("nan", vec![1.0, f64::NAN])))]);
        let e = nan.score(&batch).unwrap_err().to_string();
        assert!(e.contains("\"nan\"") && e.contains("score 1"), "{e}");
    }

    #[test]
    fn scores_parse_from_numbers_and_objects_only() {
        let p = |s: &str| parse_score(&serde_json::from_str(s).unwrap());
        assert_eq!(p("1.5"), Some(1.5));
        assert_eq!(p(r#"{"score": -2}"#), Some(-2.0));
        assert_eq!(p(r#"{"reward": 3}"#), Some(3.0));
        assert_eq!(p(r#""1.0""#), None);
        assert_eq!(p(r#"{"value": 1}"#), None);
        assert_eq!(p("null"), None);
    }
}
