//! AI feedback (RLAIF): the probability that one answer follows a principle better than
//! another, from a feedback model's token probabilities.
//!
//! Two ways to ask:
//! - `pairwise` (Bai et al.'s multiple choice, for an instruction-tuned feedback model): both
//!   answers in one prompt with the principle's question, the model's probabilities of the two
//!   option strings normalised over them; asked in both orders and averaged, so a preference
//!   for the first position cancels out.
//! - `pointwise` (for a judge trained on scores, such as the shipped task's EFT judge): each
//!   answer scored alone, `P(a beats b)` from the two score distributions
//!   ([`probability_better`]).

use std::path::PathBuf;

use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::{CausalLm, CoreError, TextTokenizer};
use serde::{Deserialize, Serialize};

use crate::judge::{Judge, probability_better, softmax};

/// How the feedback model is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FeedbackMode {
    Pointwise,
    Pairwise,
}

/// `[feedback]`: the model that labels the policy's answer pairs, and how it is asked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FeedbackSection {
    /// A HF model folder; none: the policy after the supervised stage (or, with `eft`, the start
    /// model fine-tuned as a judge).
    pub model: Option<PathBuf>,
    pub mode: FeedbackMode,
    /// `pointwise`: `{prompt}`, `{response}` and optionally `{principle}` (the principle's
    /// `feedback` question); the score `" {score_min}"`..`" {score_max}"` follows.
    pub template: String,
    pub score_min: u32,
    pub score_max: u32,
    /// `pairwise`: `{prompt}`, `{response_a}`, `{response_b}`, `{principle}`; one of
    /// `options` follows (the first names answer a).
    pub pairwise_template: String,
    pub options: [String; 2],
    /// Labelled answers (`{"prompt", "response", "attributes": {label: score}}`): when set, the
    /// feedback model is first fine-tuned on them as judge prompts answered with the score
    /// (pointwise only), and judges `eft_validation` after.
    pub eft: Option<PathBuf>,
    pub eft_validation: Option<PathBuf>,
    pub eft_label: String,
    /// Sequences per forward pass.
    pub batch_size: usize,
}

impl Default for FeedbackSection {
    fn default() -> Self {
        let dir = aligner_core::default_data_dir();
        Self {
            model: None,
            mode: FeedbackMode::Pointwise,
            template: "{prompt}{response}\nHow happy is this story, 0 to 4? Score:".into(),
            score_min: 0,
            score_max: 4,
            pairwise_template: "Consider this story opening: {prompt}\n{principle}\n(A){response_a}\n(B){response_b}\nThe answer is:".into(),
            options: [" (A)".into(), " (B)".into()],
            eft: Some(dir.join("train.steer.jsonl")),
            eft_validation: Some(dir.join("test.steer.jsonl")),
            eft_label: "positivity".into(),
            batch_size: 64,
        }
    }
}

impl FeedbackSection {
    /// The templates have their fields; a judge is trained only for pointwise feedback.
    pub fn check(&self) -> Result<(), String> {
        match self.mode {
            FeedbackMode::Pointwise => {
                aligner_core::train::check_template(
                    "feedback.template",
                    &self.template,
                    &["prompt", "response"],
                    &["prompt", "response", "principle"],
                )
                .map_err(|e| e.to_string())?;
                if self.score_max <= self.score_min {
                    return Err("feedback.score_max must be above feedback.score_min".into());
                }
            }
            FeedbackMode::Pairwise => {
                let fields = ["prompt", "response_a", "response_b", "principle"];
                aligner_core::train::check_template(
                    "feedback.pairwise_template",
                    &self.pairwise_template,
                    &fields,
                    &fields,
                )
                .map_err(|e| e.to_string())?;
                if self.options[0] == self.options[1] || self.options.iter().any(|o| o.is_empty()) {
                    return Err("feedback.options must be two different, non-empty strings".into());
                }
                if given(&self.eft).is_some() {
                    return Err(
                        "feedback.eft trains a pointwise judge: set feedback.mode = \"pointwise\" or leave feedback.eft unset"
                            .into(),
                    );
                }
            }
        }
        Ok(())
    }

    /// The pointwise judge under the principle question `principle`.
    pub fn judge(&self, principle: &str) -> Judge {
        Judge {
            template: self.template.replace("{principle}", principle),
            min: self.score_min,
            max: self.score_max,
        }
    }

    /// `P(a better than b)` for each pair, as configured.
    pub fn label(
        &self,
        model: &CausalLm,
        tokenizer: &TextTokenizer,
        pairs: &[FeedbackPair<'_>],
    ) -> Result<Vec<f64>, CoreError> {
        match self.mode {
            FeedbackMode::Pointwise => self.pointwise(model, tokenizer, pairs),
            FeedbackMode::Pairwise => self.pairwise(model, tokenizer, pairs),
        }
    }

    fn pointwise(
        &self,
        model: &CausalLm,
        tokenizer: &TextTokenizer,
        pairs: &[FeedbackPair<'_>],
    ) -> Result<Vec<f64>, CoreError> {
        // One judge per principle question; the answers of all pairs under it in one pass.
        let mut labels = vec![0.0; pairs.len()];
        let mut questions: Vec<&str> = pairs.iter().map(|p| p.principle).collect();
        questions.sort_unstable();
        questions.dedup();
        for question in questions {
            let judge = self.judge(question);
            let which: Vec<usize> = (0..pairs.len())
                .filter(|&i| pairs[i].principle == question)
                .collect();
            let answers: Vec<(&str, &str)> = which
                .iter()
                .flat_map(|&i| [(pairs[i].prompt, pairs[i].a), (pairs[i].prompt, pairs[i].b)])
                .collect();
            let dists = judge.score_distributions(model, tokenizer, &answers, self.batch_size)?;
            for (&i, d) in which.iter().zip(dists.chunks(2)) {
                labels[i] = probability_better(&d[0], &d[1]);
            }
        }
        Ok(labels)
    }

    /// The multiple-choice prompt with `first` as (A) and `second` as (B).
    pub fn pairwise_prompt(&self, pair: &FeedbackPair<'_>, first: &str, second: &str) -> String {
        self.pairwise_template
            .replace("{principle}", pair.principle)
            .replace("{prompt}", pair.prompt)
            .replace("{response_a}", first)
            .replace("{response_b}", second)
    }

    fn pairwise(
        &self,
        model: &CausalLm,
        tokenizer: &TextTokenizer,
        pairs: &[FeedbackPair<'_>],
    ) -> Result<Vec<f64>, CoreError> {
        let mut sequences = Vec::with_capacity(pairs.len() * 4);
        for pair in pairs {
            for (first, second) in [(pair.a, pair.b), (pair.b, pair.a)] {
                let prompt = self.pairwise_prompt(pair, first, second);
                for option in &self.options {
                    sequences.push(ScoredSequence::encode(tokenizer, &prompt, option)?);
                }
            }
        }
        let logprobs = response_logprobs(model, &sequences, self.batch_size)?;
        Ok(logprobs
            .chunks(4)
            .map(|lp| {
                let ab = softmax(&[lp[0].total(), lp[1].total()])[0];
                let ba = softmax(&[lp[2].total(), lp[3].total()])[0];
                order_debiased(ab, ba)
            })
            .collect())
    }
}

/// A path key's value, `None` when unset or empty (`--set feedback.eft=''` turns it off).
pub fn given(path: &Option<PathBuf>) -> Option<&PathBuf> {
    path.as_ref().filter(|p| !p.as_os_str().is_empty())
}

/// Two answers to one prompt and the principle question they are compared under.
#[derive(Debug, Clone, Copy)]
pub struct FeedbackPair<'a> {
    pub prompt: &'a str,
    pub a: &'a str,
    pub b: &'a str,
    pub principle: &'a str,
}

/// `P(a better)` from the first-option probability asked with a first (`ab`) and with b first
/// (`ba`): the mean of the two readings, so a bias to either position cancels.
pub fn order_debiased(ab: f64, ba: f64) -> f64 {
    (ab + (1.0 - ba)) / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_bias_cancels() {
        // A model that always says "(A)" with 0.8 has no preference between the answers.
        assert!((order_debiased(0.8, 0.8) - 0.5).abs() < 1e-12);
        // One that prefers a in both orders: 0.9 as (A), 0.3 for b as (A) → (0.9 + 0.7) / 2.
        assert!((order_debiased(0.9, 0.3) - 0.8).abs() < 1e-12);
    }

    #[test]
    fn bad_sections_are_refused_naming_the_key() {
        let mut s = FeedbackSection {
            template: "{prompt} Score:".into(),
            ..FeedbackSection::default()
        };
        assert!(
            s.check()
                .unwrap_err()
                .contains("feedback.template must contain {response}")
        );
        s = FeedbackSection {
            mode: FeedbackMode::Pairwise,
            ..FeedbackSection::default()
        };
        assert!(s.check().unwrap_err().contains("feedback.eft"));
        s.eft = None;
        s.check().unwrap();
        s.options = [" A".into(), " A".into()];
        assert!(s.check().unwrap_err().contains("feedback.options"));
    }

    /// On the shipped model: pairwise labels are probabilities, swapping the answers turns
    /// p into 1 - p, and they are the mean of the two orders' option probabilities computed
    /// by hand; pointwise labels are the judge's score distributions compared.
    #[test]
    fn labels_on_the_shipped_model() {
        let device = aligner_core::Device::flex();
        let lm = aligner_core::LoadedModel::from_dir(&aligner_core::default_model_dir().unwrap(), &device)
            .unwrap();
        let (prompt, a, b) = (
            "Once upon a time, there was a little dog.",
            " The dog was happy and played with his friends.",
            " The dog was sad and alone.",
        );
        let pair = FeedbackPair {
            prompt,
            a,
            b,
            principle: "Which story is happier?",
        };
        let swapped = FeedbackPair { a: b, b: a, ..pair };
        let section = FeedbackSection {
            mode: FeedbackMode::Pairwise,
            eft: None,
            ..FeedbackSection::default()
        };
        let p = section.label(&lm.model, &lm.tokenizer, &[pair, swapped]).unwrap();
        assert!(
            p[0] > 0.0 && p[0] < 1.0 && (p[0] + p[1] - 1.0).abs() < 1e-9,
            "{p:?}"
        );
        let option_p = |first: &str, second: &str| {
            let text = section.pairwise_prompt(&pair, first, second);
            let seqs: Vec<ScoredSequence> = section
                .options
                .iter()
                .map(|o| ScoredSequence::encode(&lm.tokenizer, &text, o).unwrap())
                .collect();
            let lp = response_logprobs(&lm.model, &seqs, 2).unwrap();
            let (x, y) = (lp[0].total().exp(), lp[1].total().exp());
            x / (x + y)
        };
        let by_hand = (option_p(a, b) + 1.0 - option_p(b, a)) / 2.0;
        assert!((p[0] - by_hand).abs() < 1e-6, "{} {by_hand}", p[0]);

        let pointwise = FeedbackSection::default();
        let q = pointwise
            .label(&lm.model, &lm.tokenizer, &[pair, swapped])
            .unwrap();
        let judge = pointwise.judge(pair.principle);
        let d = judge
            .score_distributions(&lm.model, &lm.tokenizer, &[(prompt, a), (prompt, b)], 2)
            .unwrap();
        assert!((q[0] - probability_better(&d[0], &d[1])).abs() < 1e-9);
        assert!((q[0] + q[1] - 1.0).abs() < 1e-9, "{q:?}");
    }
}
