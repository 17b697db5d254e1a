//! `[[reward]]`: rewards as configuration. One table (`reward.command = [...]`) or a list of
//! tables (`[[reward]]`, weights summed); each names exactly one source.

use std::path::PathBuf;
use std::time::Duration;

use aligner_core::Device;
use aligner_core::start::LoadedRewardModel;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use super::{
    CommandReward, FunctionReward, HttpReward, ModelReward, Reward, RewardError, Rewards, Rule, RuleReward,
    rules::Target,
};
use crate::frontier::RewardFunction;

/// One reward's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardSpec {
    /// What its figures are logged as (`reward/<name>`); by default from its source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its weight in the sum of all rewards.
    #[serde(default = "one")]
    pub weight: f64,
    // Sources: exactly one of these.
    /// A reward model folder (HF sequence classifier).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<PathBuf>,
    /// A program and its arguments, kept running, JSON Lines in and out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// An HTTP endpoint taking a JSON POST per batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// A built-in function of the text (`tinystories_sentiment`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
    /// A built-in rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<Rule>,
    // Rule settings.
    /// The prompt row's field holding the target (contains / exact / regex).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// A fixed target instead of a field (contains / exact / regex).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// The length rule's target, in response tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<usize>,
    /// The stop rule's score for a response cut before it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub penalty: Option<f64>,
    // Process and endpoint settings.
    /// How long a batch may take (command, url).
    #[serde(default = "sixty")]
    pub timeout_seconds: f64,
    /// Further attempts at a failed batch (a new process, or the POST again after a back-off)
    /// before the run stops.
    #[serde(default)]
    pub retries: usize,
    /// Sequences a reward model scores at once.
    #[serde(default = "sixteen")]
    pub batch_size: usize,
}

/// The longest `timeout_seconds` accepted: a week.
pub const MAX_TIMEOUT_SECONDS: f64 = 604_800.0;

fn one() -> f64 {
    1.0
}
fn sixty() -> f64 {
    60.0
}
fn sixteen() -> usize {
    16
}

impl RewardSpec {
    /// A reward model as the one reward.
    pub fn model(path: PathBuf) -> Self {
        Self {
            model: Some(path),
            ..Self::empty()
        }
    }

    /// A built-in function (`tinystories_sentiment`) as the one reward.
    pub fn function(name: &str) -> Self {
        Self {
            function: Some(name.to_string()),
            ..Self::empty()
        }
    }

    fn empty() -> Self {
        Self {
            name: None,
            weight: 1.0,
            model: None,
            command: None,
            url: None,
            function: None,
            rule: None,
            field: None,
            pattern: None,
            target: None,
            penalty: None,
            timeout_seconds: 60.0,
            retries: 0,
            batch_size: 16,
        }
    }

    /// The name it logs under.
    pub fn display_name(&self) -> String {
        if let Some(name) = &self.name {
            return name.clone();
        }
        if self.model.is_some() {
            "reward_model".into()
        } else if let Some(argv) = &self.command {
            // The script's file stem: `["python3", "verify.py"]` → "verify".
            argv.iter()
                .rev()
                .find(|a| !a.starts_with('-'))
                .and_then(|a| std::path::Path::new(a).file_stem())
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "command".into())
        } else if self.url.is_some() {
            "http".into()
        } else if let Some(f) = &self.function {
            f.clone()
        } else if let Some(rule) = self.rule {
            match (&self.field, rule) {
                (Some(field), _) => format!("{}_{field}", rule_name(rule)),
                (None, rule) => rule_name(rule).into(),
            }
        } else {
            "reward".into()
        }
    }

    /// The row fields this reward reads (checked against the prompt files before a run).
    pub fn fields_needed(&self) -> Vec<String> {
        match (self.rule, &self.field) {
            (Some(Rule::Contains | Rule::Exact | Rule::Regex), Some(f)) => vec![f.clone()],
            _ => Vec::new(),
        }
    }

    /// Refuses an incomplete or contradictory table, naming `key` (`reward[1]`).
    pub fn check(&self, key: &str) -> Result<(), RewardError> {
        let bad = |m: String| RewardError::new(key, m);
        let sources = [
            ("model", self.model.is_some()),
            ("command", self.command.is_some()),
            ("url", self.url.is_some()),
            ("function", self.function.is_some()),
            ("rule", self.rule.is_some()),
        ];
        let set: Vec<&str> = sources.iter().filter(|(_, s)| *s).map(|(n, _)| *n).collect();
        if set.len() != 1 {
            return Err(bad(format!(
                "{key} needs exactly one of model, command, url, function, rule (it has {})",
                if set.is_empty() {
                    "none".into()
                } else {
                    set.join(", ")
                }
            )));
        }
        if !self.weight.is_finite() {
            return Err(bad(format!(
                "{key}.weight = {} is not a finite number",
                self.weight
            )));
        }
        if !(self.timeout_seconds.is_finite() && self.timeout_seconds > 0.0) {
            return Err(bad(format!(
                "{key}.timeout_seconds = {} must be above 0",
                self.timeout_seconds
            )));
        }
        // Beyond this a deadline overflows the clock; no batch should wait a week.
        if self.timeout_seconds > MAX_TIMEOUT_SECONDS {
            return Err(bad(format!(
                "{key}.timeout_seconds = {} is more than a week ({MAX_TIMEOUT_SECONDS} s)",
                self.timeout_seconds
            )));
        }
        if self.batch_size == 0 {
            return Err(bad(format!("{key}.batch_size = 0: must be at least 1")));
        }
        if self.name.as_deref().is_some_and(|n| n.trim().is_empty()) {
            return Err(bad(format!(
                "{key}.name is empty: give a name, or leave it out for one from the source"
            )));
        }
        if self.pattern.as_deref().is_some_and(str::is_empty) {
            return Err(bad(format!(
                "{key}.pattern is empty: it would match every response"
            )));
        }
        if self.field.as_deref().is_some_and(|f| f.trim().is_empty()) {
            return Err(bad(format!(
                "{key}.field is empty: name a field of the prompt rows"
            )));
        }
        // Settings the source or rule never reads are refused rather than silently ignored.
        let source = set[0];
        let rule = self.rule.map(rule_name);
        let unused = [
            (
                "field",
                self.field.is_some(),
                matches!(rule, Some("contains" | "exact" | "regex")),
            ),
            (
                "pattern",
                self.pattern.is_some(),
                matches!(rule, Some("contains" | "exact" | "regex")),
            ),
            ("target", self.target.is_some(), rule == Some("length")),
            ("penalty", self.penalty.is_some(), rule == Some("stop")),
            ("retries", self.retries > 0, matches!(source, "command" | "url")),
            ("batch_size", self.batch_size != sixteen(), source == "model"),
        ];
        if let Some((setting, ..)) = unused.iter().find(|(_, given, used)| *given && !*used) {
            let what = match rule {
                Some(rule) => format!("rule {rule:?}"),
                None => format!("a {source} reward"),
            };
            return Err(bad(format!(
                "{key}.{setting} is set but {what} does not use it: leave it out"
            )));
        }
        if let Some(url) = self.url.as_deref()
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(bad(format!(
                "{key}.url = {url:?} has no scheme: write it as http://HOST:PORT/PATH"
            )));
        }
        if self.command.as_ref().is_some_and(Vec::is_empty) {
            return Err(bad(format!(
                "{key}.command is empty: give the program and its arguments"
            )));
        }
        if let Some(f) = &self.function
            && RewardFunction::from_name(f).is_none()
        {
            let known: Vec<&str> = RewardFunction::ALL.iter().map(|(n, _)| *n).collect();
            return Err(bad(format!("{key}.function = {f:?}: not one of {known:?}")));
        }
        match self.rule {
            Some(rule @ (Rule::Contains | Rule::Exact | Rule::Regex))
                if self.field.is_some() == self.pattern.is_some() =>
            {
                return Err(bad(format!(
                    "{key}: rule {:?} needs one of field (a prompt row's field) or pattern",
                    rule_name(rule)
                )));
            }
            Some(Rule::Length) if self.target.is_none_or(|t| t == 0) => {
                return Err(bad(format!(
                    "{key}: rule \"length\" needs target (tokens, at least 1)"
                )));
            }
            _ => {}
        }
        Ok(())
    }

    /// The reward this table describes.
    pub fn build(&self, key: &str, device: &Device) -> Result<Box<dyn Reward>, RewardError> {
        self.check(key)?;
        let name = self.display_name();
        let timeout = Duration::from_secs_f64(self.timeout_seconds);
        if let Some(path) = &self.model {
            let loaded = LoadedRewardModel::from_dir(path, device)
                .map_err(|e| RewardError::new(&name, e.to_string()))?;
            return Ok(Box::new(ModelReward::new(name, loaded.model, self.batch_size)));
        }
        if let Some(argv) = &self.command {
            return Ok(Box::new(CommandReward::new(
                name,
                argv.clone(),
                timeout,
                self.retries,
            )));
        }
        if let Some(url) = &self.url {
            return Ok(Box::new(HttpReward::new(name, url, timeout, self.retries)));
        }
        if let Some(f) = self.function.as_deref().and_then(RewardFunction::from_name) {
            return Ok(Box::new(FunctionReward(f)));
        }
        let target = match (&self.field, &self.pattern) {
            (Some(f), _) => Target::Field(f.clone()),
            (None, Some(p)) => Target::Fixed(p.clone()),
            (None, None) => Target::Fixed(String::new()),
        };
        Ok(match self.rule {
            Some(Rule::Length) => Box::new(RuleReward::length(name, self.target.unwrap_or(1))),
            Some(Rule::Stop) => Box::new(RuleReward::stop(name, self.penalty.unwrap_or(-1.0))),
            Some(rule) => Box::new(RuleReward::matching(name, rule, target)?),
            None => return Err(RewardError::new(key, "no source")),
        })
    }
}

fn rule_name(rule: Rule) -> &'static str {
    match rule {
        Rule::Contains => "contains",
        Rule::Exact => "exact",
        Rule::Regex => "regex",
        Rule::Length => "length",
        Rule::Stop => "stop",
    }
}

/// `reward`: one table or a list of `[[reward]]` tables (empty: the method's default reward).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RewardSpecs(pub Vec<RewardSpec>);

impl RewardSpecs {
    /// Refuses a reward model folder given beside these rewards (`reward_model.path`) when
    /// they score the samples and the method has no other use for it (`why_unused`, in the
    /// method's words), instead of ignoring it.
    pub fn check_unused_model(
        &self,
        model: Option<&std::path::Path>,
        why_unused: &str,
    ) -> Result<(), RewardError> {
        match model.filter(|_| !self.is_empty()) {
            Some(path) => Err(RewardError::new(
                "reward_model.path",
                format!(
                    "{} is set beside [reward], which scores the samples; {why_unused}: leave \
                     reward_model.path out, or give the model as a [[reward]] table (model = ...)",
                    path.display()
                ),
            )),
            None => Ok(()),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The weighted sum of every table's reward; the keys in messages are `reward` for a
    /// single table and `reward[i]` in a list.
    pub fn build(&self, device: &Device) -> Result<Rewards, RewardError> {
        let mut parts = Vec::with_capacity(self.0.len());
        for (i, spec) in self.0.iter().enumerate() {
            parts.push((spec.weight, spec.build(&self.key(i), device)?));
        }
        // Two parts under one name would log over each other.
        let names: Vec<String> = self.0.iter().map(RewardSpec::display_name).collect();
        if let Some((i, n)) = names.iter().enumerate().find(|(i, n)| names[..*i].contains(n)) {
            return Err(RewardError::new(
                &self.key(i),
                format!("two rewards are named {n:?}: give one a `name`"),
            ));
        }
        Ok(Rewards::new(parts))
    }

    /// Every check of [`RewardSpec::check`], without starting anything.
    pub fn check(&self) -> Result<(), RewardError> {
        self.0
            .iter()
            .enumerate()
            .try_for_each(|(i, s)| s.check(&self.key(i)))
    }

    fn key(&self, i: usize) -> String {
        if self.0.len() == 1 {
            "reward".into()
        } else {
            format!("reward[{i}]")
        }
    }

    /// The row fields the rewards read.
    pub fn fields_needed(&self) -> Vec<String> {
        let mut out: Vec<String> = self.0.iter().flat_map(RewardSpec::fields_needed).collect();
        out.dedup();
        out
    }
}

impl Serialize for RewardSpecs {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => one.serialize(serializer),
            many => many.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for RewardSpecs {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OneOrMany;
        impl<'de> Visitor<'de> for OneOrMany {
            type Value = RewardSpecs;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a [reward] table or a list of [[reward]] tables")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RewardSpecs, A::Error> {
                Ok(RewardSpecs(vec![RewardSpec::deserialize(
                    de::value::MapAccessDeserializer::new(map),
                )?]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<RewardSpecs, A::Error> {
                Ok(RewardSpecs(Vec::deserialize(
                    de::value::SeqAccessDeserializer::new(seq),
                )?))
            }
        }
        deserializer.deserialize_any(OneOrMany)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, Serialize, PartialEq)]
    struct Doc {
        #[serde(default, skip_serializing_if = "RewardSpecs::is_empty")]
        reward: RewardSpecs,
    }

    #[test]
    fn one_table_or_a_list_of_tables() {
        let one: Doc = toml::from_str("[reward]\ncommand = [\"python3\", \"tools/verify.py\"]\n").unwrap();
        assert_eq!(one.reward.0.len(), 1);
        assert_eq!(one.reward.0[0].display_name(), "verify");
        let many: Doc = toml::from_str(
            "[[reward]]\nrule = \"contains\"\nfield = \"word\"\n[[reward]]\nrule = \"stop\"\nweight = 0.5\n",
        )
        .unwrap();
        assert_eq!(many.reward.0.len(), 2);
        assert_eq!(many.reward.0[0].display_name(), "contains_word");
        assert_eq!(many.reward.0[1].weight, 0.5);
        // What is written to config.toml reads back the same.
        for doc in [one, many] {
            let text = toml::to_string(&doc).unwrap();
            assert_eq!(toml::from_str::<Doc>(&text).unwrap(), doc, "{text}");
        }
        let none: Doc = toml::from_str("").unwrap();
        assert!(none.reward.is_empty() && toml::to_string(&none).unwrap().is_empty());
    }

    #[test]
    fn a_table_is_checked_naming_its_key() {
        let check = |text: &str| {
            let doc: Doc = toml::from_str(text).unwrap();
            doc.reward.check().unwrap_err().to_string()
        };
        let e = check("[reward]\nweight = 2.0\n");
        assert!(
            e.contains("reward needs exactly one of") && e.contains("none"),
            "{e}"
        );
        let e = check("[[reward]]\nrule = \"stop\"\n[[reward]]\nrule = \"contains\"\nurl = \"http://x\"\n");
        assert!(
            e.contains("reward[1] needs exactly one") && e.contains("url, rule"),
            "{e}"
        );
        let e = check("[reward]\nrule = \"length\"\n");
        assert!(e.contains("needs target"), "{e}");
        let e = check("[reward]\nrule = \"exact\"\n");
        assert!(e.contains("needs one of field"), "{e}");
        let e = check("[reward]\nfunction = \"sentiment\"\n");
        assert!(e.contains("reward.function = \"sentiment\""), "{e}");
        let e = check("[reward]\ncommand = []\n");
        assert!(e.contains("reward.command is empty"), "{e}");
        // Values out of range, and settings the source or rule would ignore.
        for (text, says) in [
            (
                "command = [\"v\"]\ntimeout_seconds = 1e30",
                "reward.timeout_seconds = 1000000000000000000000000000000 is more than a week",
            ),
            ("model = \"rm\"\nbatch_size = 0", "reward.batch_size = 0"),
            ("rule = \"stop\"\nname = \" \"", "reward.name is empty"),
            ("rule = \"contains\"\npattern = \"\"", "reward.pattern is empty"),
            ("rule = \"regex\"\nfield = \"\"", "reward.field is empty"),
            (
                "rule = \"length\"\ntarget = 4\npattern = \"x\"",
                "reward.pattern is set but rule \"length\" does not use it",
            ),
            (
                "rule = \"contains\"\nfield = \"a\"\ntarget = 4",
                "reward.target is set but rule \"contains\"",
            ),
            (
                "rule = \"exact\"\nfield = \"a\"\npenalty = -2.0",
                "reward.penalty is set but rule \"exact\"",
            ),
            (
                "function = \"tinystories_sentiment\"\nretries = 2",
                "reward.retries is set but a function reward",
            ),
            (
                "url = \"http://x\"\nbatch_size = 4",
                "reward.batch_size is set but a url reward",
            ),
            (
                "model = \"rm\"\npenalty = 1.0",
                "reward.penalty is set but a model reward",
            ),
            (
                "url = \"localhost:8000/score\"",
                "reward.url = \"localhost:8000/score\" has no scheme",
            ),
        ] {
            let e = check(&format!("[reward]\n{text}\n"));
            assert!(e.contains(says), "{text}: {e}");
        }
        let unknown = toml::from_str::<Doc>("[reward]\nrule = \"stop\"\nwieght = 1\n").unwrap_err();
        assert!(unknown.to_string().contains("wieght"), "{unknown}");
    }

    #[test]
    fn two_parts_with_one_name_are_refused() {
        let doc: Doc = toml::from_str("[[reward]]\nrule = \"stop\"\n[[reward]]\nrule = \"stop\"\n").unwrap();
        let e = doc.reward.build(&Device::flex()).err().unwrap().to_string();
        assert!(
            e.contains("reward[1]") && e.contains("two rewards are named \"stop\""),
            "{e}"
        );
    }
}
