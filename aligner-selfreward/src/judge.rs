//! LLM-as-a-judge: a response scored by the model itself through a judge prompt, as the
//! expected score under the model's probabilities over the score tokens (more informative on a
//! small model than the one score it would write), and how far such scores agree with labels.

use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::{CausalLm, CoreError, TextTokenizer};

/// The judge prompt and its score range.
#[derive(Debug, Clone, PartialEq)]
pub struct Judge {
    /// Text with `{prompt}` and `{response}` in it; the score follows it.
    pub template: String,
    /// Scores `min..=max`, each written as `" {score}"` after the template.
    pub min: u32,
    pub max: u32,
}

impl Judge {
    /// The judge prompt for one answer.
    pub fn prompt(&self, prompt: &str, response: &str) -> String {
        self.template
            .replace("{prompt}", prompt)
            .replace("{response}", response)
    }

    /// The judge's answer for `score` (what EFT data trains it to write).
    pub fn answer(score: u32) -> String {
        format!(" {score}")
    }

    /// The scores `min..=max` in order.
    pub fn scores(&self) -> Vec<u32> {
        (self.min..=self.max).collect()
    }

    /// The expected score of each `(prompt, response)`: `Σ s · p(s)` with `p` the model's
    /// probabilities of the score answers, normalised over them.
    pub fn expected_scores(
        &self,
        model: &CausalLm,
        tokenizer: &TextTokenizer,
        answers: &[(&str, &str)],
        batch_size: usize,
    ) -> Result<Vec<f64>, CoreError> {
        let scores: Vec<f64> = self.scores().into_iter().map(f64::from).collect();
        let distributions = self.score_distributions(model, tokenizer, answers, batch_size)?;
        Ok(distributions
            .iter()
            .map(|p| p.iter().zip(&scores).map(|(p, s)| p * s).sum())
            .collect())
    }

    /// The judge's probability of each score `min..=max` for each `(prompt, response)`: the
    /// model's probabilities of the score answers, normalised over them.
    pub fn score_distributions(
        &self,
        model: &CausalLm,
        tokenizer: &TextTokenizer,
        answers: &[(&str, &str)],
        batch_size: usize,
    ) -> Result<Vec<Vec<f64>>, CoreError> {
        let scores = self.scores();
        let mut sequences = Vec::with_capacity(answers.len() * scores.len());
        for (prompt, response) in answers {
            let judged = self.prompt(prompt, response);
            for &s in &scores {
                sequences.push(ScoredSequence::encode(tokenizer, &judged, &Self::answer(s))?);
            }
        }
        let logprobs = response_logprobs(model, &sequences, batch_size)?;
        Ok(logprobs
            .chunks(scores.len())
            .map(|lp| softmax(&lp.iter().map(|l| l.total()).collect::<Vec<_>>()))
            .collect())
    }
}

/// `softmax(logprobs)`: probabilities normalised over the given options.
pub fn softmax(logprobs: &[f64]) -> Vec<f64> {
    let top = logprobs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = logprobs.iter().map(|l| (l - top).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// The probability that an answer whose score is drawn from `a` beats one drawn from `b`
/// (both over the same ascending scores), an equal draw counting half:
/// `Σ_{i>j} a_i b_j + ½ Σ_i a_i b_i`. `P(a, b) + P(b, a) = 1`.
pub fn probability_better(a: &[f64], b: &[f64]) -> f64 {
    let mut p = 0.0;
    let mut b_below = 0.0;
    for (ai, bi) in a.iter().zip(b) {
        p += ai * (b_below + 0.5 * bi);
        b_below += bi;
    }
    p
}

/// `Σ s · softmax(logprobs)_s`.
pub fn expected_score(scores: &[u32], logprobs: &[f64]) -> f64 {
    scores
        .iter()
        .zip(softmax(logprobs))
        .map(|(&s, p)| s as f64 * p)
        .sum()
}

/// Pairwise agreement of `predicted` with `labels` within groups (the answers of one prompt):
/// of the pairs whose labels differ, the share the prediction orders the same way (a tie in
/// the prediction counts half). 0.5 is chance. `None` when no pair's labels differ.
pub fn pairwise_agreement(groups: &[(Vec<f64>, Vec<f64>)]) -> Option<f64> {
    let (mut agree, mut pairs) = (0.0, 0usize);
    for (predicted, labels) in groups {
        for i in 0..labels.len() {
            for j in i + 1..labels.len() {
                if labels[i] == labels[j] {
                    continue;
                }
                pairs += 1;
                let p = predicted[i] - predicted[j];
                let l = labels[i] - labels[j];
                if p == 0.0 {
                    agree += 0.5;
                } else if (p > 0.0) == (l > 0.0) {
                    agree += 1.0;
                }
            }
        }
    }
    (pairs > 0).then(|| agree / pairs as f64)
}

/// The best and worst candidate of a group by score (`(best, worst)` indices), `None` when they
/// are within `min_gap` (a tie: no preference to learn).
pub fn best_and_worst(scores: &[f64], min_gap: f64) -> Option<(usize, usize)> {
    let best = (0..scores.len()).max_by(|&a, &b| scores[a].total_cmp(&scores[b]))?;
    let worst = (0..scores.len()).min_by(|&a, &b| scores[a].total_cmp(&scores[b]))?;
    (scores[best] - scores[worst] > min_gap).then_some((best, worst))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_score_by_hand() {
        // p ∝ (1, 1, 2) over scores (0, 1, 2): (0 + 1 + 4) / 4 = 1.25.
        let lp = [0.0, 0.0, 2f64.ln()];
        assert!((expected_score(&[0, 1, 2], &lp) - 1.25).abs() < 1e-12);
        // Shifting every log-prob changes nothing.
        let shifted: Vec<f64> = lp.iter().map(|l| l - 30.0).collect();
        assert!((expected_score(&[0, 1, 2], &shifted) - 1.25).abs() < 1e-12);
    }

    #[test]
    fn probability_better_by_hand() {
        // a = (0.5, 0.5), b = (0.25, 0.75) over scores (0, 1):
        // a wins only as 1 over 0: 0.5·0.25 = 0.125; ties 0.5·0.25 + 0.5·0.75 = 0.5, half: 0.25.
        let (a, b) = ([0.5, 0.5], [0.25, 0.75]);
        assert!((probability_better(&a, &b) - 0.375).abs() < 1e-12);
        assert!((probability_better(&a, &b) + probability_better(&b, &a) - 1.0).abs() < 1e-12);
        // Certain scores: the higher wins, equal ones are a coin.
        assert_eq!(probability_better(&[0.0, 0.0, 1.0], &[0.0, 1.0, 0.0]), 1.0);
        assert_eq!(probability_better(&[0.0, 1.0, 0.0], &[0.0, 1.0, 0.0]), 0.5);
        assert!((softmax(&[0.0, 3f64.ln()])[1] - 0.75).abs() < 1e-12);
    }

    #[test]
    fn agreement_by_hand() {
        // Labels (0, 2, 1): pairs (0,1), (0,2), (1,2) all differ. Predicted (0.1, 0.5, 0.7):
        // (0,1) right, (0,2) right, (1,2) wrong → 2/3. A second group with equal labels adds none.
        let groups = vec![
            (vec![0.1, 0.5, 0.7], vec![0.0, 2.0, 1.0]),
            (vec![1.0, 0.0], vec![3.0, 3.0]),
        ];
        assert!((pairwise_agreement(&groups).unwrap() - 2.0 / 3.0).abs() < 1e-12);
        // A tie in the prediction is half right.
        assert_eq!(pairwise_agreement(&[(vec![1.0, 1.0], vec![0.0, 1.0])]), Some(0.5));
        assert_eq!(pairwise_agreement(&[(vec![1.0, 0.0], vec![1.0, 1.0])]), None);
    }

    #[test]
    fn pairs_are_best_against_worst_and_ties_are_skipped() {
        assert_eq!(best_and_worst(&[1.0, 3.5, 0.5, 2.0], 0.1), Some((1, 2)));
        assert_eq!(best_and_worst(&[2.0, 2.05], 0.1), None);
        assert_eq!(best_and_worst(&[], 0.1), None);
    }

    #[test]
    fn the_template_takes_prompt_and_response() {
        let judge = Judge {
            template: "{prompt}{response}\nScore:".into(),
            min: 0,
            max: 4,
        };
        assert_eq!(judge.prompt("Once.", " Then."), "Once. Then.\nScore:");
        assert_eq!(Judge::answer(3), " 3");
    }
}
