//! The constitution: the principles a Constitutional AI run critiques, revises and judges by,
//! read from TOML, and the prompts its templates make.
//!
//! ```toml
//! critique_template = "{prompt}{response}\n\nCritique request: {critique_request}\nCritique:"
//! revision_template = "... {critique} ... {revision_request}\nRevision:"
//!
//! [[principles]]
//! name = "kind"
//! critique_request = "Point out what is unkind, sad or scary in the story."
//! revision_request = "Rewrite the story so that everyone is kind and happy."
//! feedback = "Which story is kinder and happier?"
//!
//! [[examples]]          # optional few-shot examples, put before each critique and revision
//! prompt = "..."
//! response = "..."
//! critique = "..."
//! revision = "..."
//! ```

use std::path::{Path, PathBuf};

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::SelfRewardError as CaiError;

/// The constitution the shipped task runs with when `cai.constitution` is not set.
pub const STORIES: &str = include_str!("stories_constitution.toml");

/// Principles, templates and few-shot examples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Constitution {
    /// The critique prompt: `{prompt}`, `{response}`, `{critique_request}`; the critique follows.
    #[serde(default = "default_critique_template")]
    pub critique_template: String,
    /// The revision prompt: the critique prompt's fields and `{critique}`, `{revision_request}`;
    /// the revised response follows.
    #[serde(default = "default_revision_template")]
    pub revision_template: String,
    pub principles: Vec<Principle>,
    #[serde(default)]
    pub examples: Vec<Example>,
}

/// One principle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Principle {
    pub name: String,
    pub critique_request: String,
    pub revision_request: String,
    /// The comparison question the feedback model answers (`{principle}` in its template).
    pub feedback: String,
}

/// A worked critique and revision shown before each prompt (few-shot).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Example {
    pub prompt: String,
    pub response: String,
    pub critique: String,
    pub revision: String,
    /// The principle whose requests the example shows; none: the principle being applied.
    #[serde(default)]
    pub principle: Option<String>,
}

fn default_critique_template() -> String {
    "{prompt}{response}\n\nCritique request: {critique_request}\nCritique:".into()
}

fn default_revision_template() -> String {
    "{prompt}{response}\n\nCritique request: {critique_request}\nCritique:{critique}\n\nRevision request: {revision_request}\nRevision:".into()
}

const CRITIQUE_FIELDS: [&str; 3] = ["prompt", "response", "critique_request"];
const REVISION_FIELDS: [&str; 5] = [
    "prompt",
    "response",
    "critique_request",
    "critique",
    "revision_request",
];

impl Constitution {
    /// The constitution in `path` (`None`: the shipped stories constitution), checked.
    pub fn load(path: Option<&Path>) -> Result<Self, CaiError> {
        let (text, origin) = match path {
            Some(path) => (
                std::fs::read_to_string(path).map_err(|e| CaiError::Constitution {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?,
                path.to_path_buf(),
            ),
            None => (
                STORIES.to_string(),
                PathBuf::from("<shipped stories constitution>"),
            ),
        };
        let bad = |message: String| CaiError::Constitution {
            path: origin.clone(),
            message,
        };
        let constitution: Constitution = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        constitution.check().map_err(bad)?;
        Ok(constitution)
    }

    /// Every template has its fields, there is a principle, names are unique and examples name
    /// principles that exist.
    pub fn check(&self) -> Result<(), String> {
        for (key, template, fields) in [
            ("critique_template", &self.critique_template, &CRITIQUE_FIELDS[..]),
            ("revision_template", &self.revision_template, &REVISION_FIELDS[..]),
        ] {
            aligner_core::train::check_template(key, template, fields, fields).map_err(|e| e.to_string())?;
        }
        if self.principles.is_empty() {
            return Err("no [[principles]]: a constitution needs at least one".into());
        }
        for (i, p) in self.principles.iter().enumerate() {
            if p.name.trim().is_empty() {
                return Err(format!("principles[{i}].name is empty"));
            }
            if self.principles[..i].iter().any(|q| q.name == p.name) {
                return Err(format!("principles[{i}].name {:?} is used twice", p.name));
            }
        }
        for (i, e) in self.examples.iter().enumerate() {
            if let Some(name) = &e.principle
                && self.principle(name).is_none()
            {
                return Err(format!("examples[{i}].principle {name:?} is not a principle"));
            }
        }
        Ok(())
    }

    pub fn principle(&self, name: &str) -> Option<&Principle> {
        self.principles.iter().find(|p| p.name == name)
    }

    /// A principle drawn uniformly.
    pub fn sample(&self, rng: &mut impl Rng) -> &Principle {
        &self.principles[rng.random_range(0..self.principles.len())]
    }

    /// The critique prompt for `response` to `prompt` under `principle`, after the examples.
    pub fn critique_prompt(&self, principle: &Principle, prompt: &str, response: &str) -> String {
        let mut text = String::new();
        for e in &self.examples {
            let p = self.example_principle(e, principle);
            text += &fill_critique(&self.critique_template, p, &e.prompt, &e.response);
            text += &e.critique;
            text += "\n\n";
        }
        text + &fill_critique(&self.critique_template, principle, prompt, response)
    }

    /// The revision prompt, the critique written.
    pub fn revision_prompt(
        &self,
        principle: &Principle,
        prompt: &str,
        response: &str,
        critique: &str,
    ) -> String {
        let mut text = String::new();
        for e in &self.examples {
            let p = self.example_principle(e, principle);
            text += &fill_revision(&self.revision_template, p, &e.prompt, &e.response, &e.critique);
            text += &e.revision;
            text += "\n\n";
        }
        text + &fill_revision(&self.revision_template, principle, prompt, response, critique)
    }

    fn example_principle<'a>(&'a self, e: &Example, applied: &'a Principle) -> &'a Principle {
        e.principle
            .as_deref()
            .and_then(|name| self.principle(name))
            .unwrap_or(applied)
    }
}

fn fill_critique(template: &str, principle: &Principle, prompt: &str, response: &str) -> String {
    // The response last: its text may itself hold something that looks like a field.
    template
        .replace("{critique_request}", &principle.critique_request)
        .replace("{prompt}", prompt)
        .replace("{response}", response)
}

fn fill_revision(
    template: &str,
    principle: &Principle,
    prompt: &str,
    response: &str,
    critique: &str,
) -> String {
    template
        .replace("{critique_request}", &principle.critique_request)
        .replace("{revision_request}", &principle.revision_request)
        .replace("{prompt}", prompt)
        .replace("{critique}", critique)
        .replace("{response}", response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_constitution_loads() {
        let c = Constitution::load(None).unwrap();
        assert!(c.principles.len() >= 3, "{c:?}");
        assert!(!c.examples.is_empty());
    }

    #[test]
    fn prompts_are_what_the_templates_say() {
        let c = Constitution {
            critique_template: "{prompt}|{response}|C: {critique_request}|".into(),
            revision_template: "{prompt}|{response}|C: {critique_request}|{critique}|R: {revision_request}|"
                .into(),
            principles: vec![Principle {
                name: "kind".into(),
                critique_request: "what is unkind?".into(),
                revision_request: "make it kind".into(),
                feedback: "kinder?".into(),
            }],
            examples: vec![Example {
                prompt: "P0".into(),
                response: "R0".into(),
                critique: "c0".into(),
                revision: "v0".into(),
                principle: None,
            }],
        };
        c.check().unwrap();
        let p = &c.principles[0];
        assert_eq!(
            c.critique_prompt(p, "P", "R"),
            "P0|R0|C: what is unkind?|c0\n\nP|R|C: what is unkind?|"
        );
        assert_eq!(
            c.revision_prompt(p, "P", "R", "c"),
            "P0|R0|C: what is unkind?|c0|R: make it kind|v0\n\nP|R|C: what is unkind?|c|R: make it kind|"
        );
    }

    #[test]
    fn bad_constitutions_are_refused_naming_the_key() {
        let dir = std::env::temp_dir().join(format!("aligner-constitution-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        let cases = [
            ("principles = []", "at least one"),
            (
                "critique_template = \"{prompt}\"\n[[principles]]\nname = \"a\"\ncritique_request = \"\"\nrevision_request = \"\"\nfeedback = \"\"",
                "critique_template must contain {response}",
            ),
            (
                "[[principles]]\nname = \"a\"\ncritique_request = \"\"\nrevision_request = \"\"\nfeedback = \"\"\n[[principles]]\nname = \"a\"\ncritique_request = \"\"\nrevision_request = \"\"\nfeedback = \"\"",
                "principles[1].name \"a\" is used twice",
            ),
            (
                "[[principles]]\nname = \"a\"\ncritique_request = \"\"\nrevision_request = \"\"\nfeedback = \"\"\ncolour = 1",
                "colour",
            ),
        ];
        for (text, expected) in cases {
            std::fs::write(&path, text).unwrap();
            let err = Constitution::load(Some(&path)).unwrap_err().to_string();
            assert!(err.contains("c.toml") && err.contains(expected), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
