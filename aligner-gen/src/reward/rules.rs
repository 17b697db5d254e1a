//! Built-in rewards: rules on the response against a field of the prompt's row or a fixed
//! pattern, a length target, a penalty for responses cut before EOS, and the built-in text
//! functions.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Reward, RewardError, RewardInput};
use crate::StopReason;
use crate::frontier::RewardFunction;

/// A rule's kind (`rule = "..."` in a `[[reward]]` table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// 1 when the response contains the target (a field of the row, or `pattern`) as a whole
    /// word or phrase (case-insensitive; any of them when the field is a list), else 0.
    Contains,
    /// 1 when the trimmed response equals the trimmed target, else 0.
    Exact,
    /// 1 when the regular expression (`pattern`, or a field of the row) matches anywhere in
    /// the response, else 0.
    Regex,
    /// `−|tokens − target| / target`: 0 at the target length, lower either side.
    Length,
    /// `penalty` (default −1) when the response did not end by itself (EOS or a stop string),
    /// else 0.
    Stop,
}

/// Where a rule's target comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// The value of this field of the prompt's row.
    Field(String),
    /// A fixed string.
    Fixed(String),
}

/// A built-in rule.
pub struct RuleReward {
    name: String,
    rule: Rule,
    target: Option<Target>,
    length: usize,
    penalty: f64,
}

impl RuleReward {
    /// `contains` / `exact` / `regex` against `target`.
    pub fn matching(name: impl Into<String>, rule: Rule, target: Target) -> Result<Self, RewardError> {
        let name = name.into();
        if let (Rule::Regex, Target::Fixed(pattern)) = (rule, &target) {
            regex::Regex::new(pattern).map_err(|e| RewardError::new(&name, format!("pattern: {e}")))?;
        }
        Ok(Self {
            name,
            rule,
            target: Some(target),
            length: 0,
            penalty: 0.0,
        })
    }

    /// `length`: 0 at `target` tokens.
    pub fn length(name: impl Into<String>, target: usize) -> Self {
        Self {
            name: name.into(),
            rule: Rule::Length,
            target: None,
            length: target.max(1),
            penalty: 0.0,
        }
    }

    /// `stop`: `penalty` for a response cut by the token limit or the context.
    pub fn stop(name: impl Into<String>, penalty: f64) -> Self {
        Self {
            name: name.into(),
            rule: Rule::Stop,
            target: None,
            length: 0,
            penalty,
        }
    }

    /// The target strings of one sample (a field may hold one string or a list of them).
    fn targets(&self, input: &RewardInput<'_>) -> Result<Vec<String>, RewardError> {
        match &self.target {
            Some(Target::Fixed(s)) => Ok(vec![s.clone()]),
            Some(Target::Field(field)) => match input.fields.get(field) {
                Some(Value::String(s)) => Ok(vec![s.clone()]),
                Some(Value::Array(items)) if items.iter().all(Value::is_string) => Ok(items
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()),
                Some(Value::Number(n)) => Ok(vec![n.to_string()]),
                Some(other) => Err(RewardError::new(
                    &self.name,
                    format!("field {field:?} of a prompt row is {other}, not a string or a list of strings"),
                )),
                None => Err(RewardError::new(
                    &self.name,
                    format!(
                        "a prompt row has no field {field:?} (prompt {})",
                        super::shown(input.prompt, 60)
                    ),
                )),
            },
            None => Ok(Vec::new()),
        }
    }

    fn score_one(&self, input: &RewardInput<'_>) -> Result<f64, RewardError> {
        let hit = |b: bool| if b { 1.0 } else { 0.0 };
        Ok(match self.rule {
            Rule::Contains => hit(self
                .targets(input)?
                .iter()
                .any(|t| contains_phrase(input.response, t))),
            Rule::Exact => hit(self
                .targets(input)?
                .iter()
                .any(|t| t.trim() == input.response.trim())),
            Rule::Regex => {
                let mut any = false;
                for pattern in self.targets(input)? {
                    let re = regex::Regex::new(&pattern)
                        .map_err(|e| RewardError::new(&self.name, format!("pattern {pattern:?}: {e}")))?;
                    any |= re.is_match(input.response);
                }
                hit(any)
            }
            Rule::Length => {
                let n = input.response_ids.len() as f64;
                -(n - self.length as f64).abs() / self.length as f64
            }
            Rule::Stop => match input.stop_reason {
                StopReason::Eos | StopReason::StopString => 0.0,
                StopReason::MaxTokens | StopReason::ContextFull => self.penalty,
            },
        })
    }
}

/// Whether `phrase` occurs in `text` as whole words, ignoring case: "happy" is in "So happy!"
/// but not in "unhappy".
pub fn contains_phrase(text: &str, phrase: &str) -> bool {
    let words = |s: &str| -> Vec<String> {
        s.to_lowercase()
            .split(|c: char| !(c.is_alphanumeric() || c == '\''))
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect()
    };
    let (text, phrase) = (words(text), words(phrase));
    !phrase.is_empty() && text.windows(phrase.len()).any(|w| w == phrase.as_slice())
}

impl Reward for RuleReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RewardError> {
        batch.iter().map(|i| self.score_one(i)).collect()
    }
}

/// A built-in function of the response's text (`function = "tinystories_sentiment"`).
pub struct FunctionReward(pub RewardFunction);

impl Reward for FunctionReward {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RewardError> {
        Ok(batch.iter().map(|i| self.0.score(i.response)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::tests::inputs;
    use serde_json::{Map, json};

    fn fields(pairs: Value) -> Map<String, Value> {
        pairs.as_object().cloned().unwrap()
    }

    #[test]
    fn contains_matches_whole_words_from_the_rows_field() {
        let row = fields(json!({"word": "happy"}));
        let rule = RuleReward::matching("w", Rule::Contains, Target::Field("word".into())).unwrap();
        let got = rule
            .score(&inputs(
                &["She was Happy.", "He was unhappy", "happy-go-lucky"],
                &row,
            ))
            .unwrap();
        assert_eq!(got, vec![1.0, 0.0, 1.0]);
        let any = fields(json!({"word": ["dog", "big cat"]}));
        let got = rule
            .score(&inputs(&["A big  cat!", "a cat", "Dog"], &any))
            .unwrap();
        assert_eq!(got, vec![1.0, 0.0, 1.0]);
        assert!(!contains_phrase("anything", ""));
    }

    #[test]
    fn exact_and_regex_by_hand() {
        let row = fields(json!({"answer": 42, "re": "^The (cat|dog)"}));
        let exact = RuleReward::matching("e", Rule::Exact, Target::Field("answer".into())).unwrap();
        assert_eq!(
            exact.score(&inputs(&[" 42\n", "42.0"], &row)).unwrap(),
            vec![1.0, 0.0]
        );
        let re = RuleReward::matching("r", Rule::Regex, Target::Field("re".into())).unwrap();
        assert_eq!(
            re.score(&inputs(&["The dog ran", "A dog"], &row)).unwrap(),
            vec![1.0, 0.0]
        );
        let fixed = RuleReward::matching("f", Rule::Regex, Target::Fixed(r"\d+".into())).unwrap();
        assert_eq!(
            fixed.score(&inputs(&["7 cats", "no"], &row)).unwrap(),
            vec![1.0, 0.0]
        );
        let bad = RuleReward::matching("bad", Rule::Regex, Target::Fixed("(".into()));
        assert!(bad.err().unwrap().to_string().contains("\"bad\": pattern"));
    }

    #[test]
    fn a_missing_field_is_an_error_naming_it() {
        let rule = RuleReward::matching("w", Rule::Contains, Target::Field("word".into())).unwrap();
        let e = rule.score(&inputs(&["x"], &Map::new())).unwrap_err().to_string();
        assert!(
            e.contains("no field \"word\"") && e.contains("Once upon a time"),
            "{e}"
        );
        let row = fields(json!({"word": {"a": 1}}));
        assert!(rule.score(&inputs(&["x"], &row)).is_err());
    }

    #[test]
    fn length_and_stop_by_hand() {
        let row = Map::new();
        let mut batch = inputs(&["a", "b"], &row);
        // 3 response tokens against a target of 4: −1/4; of 2: −1/2.
        assert_eq!(
            RuleReward::length("l", 4).score(&batch[..1]).unwrap(),
            vec![-0.25]
        );
        assert_eq!(RuleReward::length("l", 2).score(&batch[..1]).unwrap(), vec![-0.5]);
        batch[1].stop_reason = StopReason::MaxTokens;
        assert_eq!(
            RuleReward::stop("s", -2.0).score(&batch).unwrap(),
            vec![0.0, -2.0]
        );
    }
}
