//! Per-token rewards, advantages and returns: the arithmetic of a PPO step on host vectors.
//!
//! Each function works on one response (a slice of per-token values), so the hand-computed
//! tests below read like the formulas.

use serde::{Deserialize, Serialize};

/// How the per-token KL between policy and reference is estimated from the sampled token's
/// log-probs (`log π`, `log π_ref`); see Schulman, "Approximating KL divergence".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `log π − log π_ref` (unbiased, can be negative).
    #[default]
    K1,
    /// `|log π − log π_ref|`.
    Absolute,
    /// `(r − 1) − log r` with `r = π_ref / π` (unbiased, never negative).
    K3,
}

/// The KL estimate of each token.
pub fn kl_per_token(logp: &[f32], ref_logp: &[f32], estimator: KlEstimator) -> Vec<f32> {
    logp.iter()
        .zip(ref_logp)
        .map(|(&lp, &lr)| {
            let d = lp - lr;
            match estimator {
                KlEstimator::K1 => d,
                KlEstimator::Absolute => d.abs(),
                KlEstimator::K3 => (-d).exp() - 1.0 + d,
            }
        })
        .collect()
}

/// Per-token rewards: `−kl_coef · kl_t` everywhere, plus the sequence `score` on the last token.
pub fn token_rewards(score: f32, kl: &[f32], kl_coef: f32) -> Vec<f32> {
    let mut rewards: Vec<f32> = kl.iter().map(|k| -kl_coef * k).collect();
    if let Some(last) = rewards.last_mut() {
        *last += score;
    }
    rewards
}

/// Generalised advantage estimation over one response:
/// `δ_t = r_t + γ V_{t+1} − V_t` (`V` after the last token is 0),
/// `A_t = δ_t + γλ A_{t+1}`, returns `A_t + V_t`.
pub fn gae(rewards: &[f32], values: &[f32], gamma: f32, lam: f32) -> (Vec<f32>, Vec<f32>) {
    let n = rewards.len();
    let mut advantages = vec![0.0; n];
    let mut next_value = 0.0;
    let mut running = 0.0;
    for t in (0..n).rev() {
        let delta = rewards[t] + gamma * next_value - values[t];
        running = delta + gamma * lam * running;
        advantages[t] = running;
        next_value = values[t];
    }
    let returns = advantages.iter().zip(values).map(|(a, v)| a + v).collect();
    (advantages, returns)
}

/// Truncated importance sampling's per-token weights, `min(π_trainer(y_t) / π_engine(y_t),
/// cap)` from the two log-probs: how much more likely the trainer finds each sampled token
/// than the engine that sampled it, capped so a token the engine drew unluckily cannot blow
/// the update up.
pub fn truncated_is_weights(trainer: &[f32], engine: &[f32], cap: f32) -> Vec<f32> {
    trainer
        .iter()
        .zip(engine)
        .map(|(&t, &e)| (t - e).exp().min(cap))
        .collect()
}

/// `gae` (per-token rewards from the KL and values in, advantages and returns out) over the
/// model's own tokens of a multi-turn episode: the environment's tokens (`observed`) are
/// skipped, so each model token's next state is the next model token's, and their entries
/// are 0 (masked from the losses).
pub fn gae_over_own_tokens(
    observed: &[bool],
    gae: impl Fn(&[f32], &[f32]) -> (Vec<f32>, Vec<f32>),
    kl: &[f32],
    values: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let own: Vec<usize> = (0..kl.len())
        .filter(|&j| !observed.get(j).copied().unwrap_or(false))
        .collect();
    let pick = |x: &[f32]| own.iter().map(|&j| x[j]).collect::<Vec<f32>>();
    let (advantages, returns) = gae(&pick(kl), &pick(values));
    let place = |x: Vec<f32>| {
        let mut out = vec![0.0; kl.len()];
        for (&j, value) in own.iter().zip(x) {
            out[j] = value;
        }
        out
    };
    (place(advantages), place(returns))
}

/// Shifts and scales every value of `rows` (all tokens of all responses together) to mean 0
/// and standard deviation 1, as PPO whitens advantages over a rollout batch.
pub fn whiten(rows: &mut [Vec<f32>]) {
    let n: usize = rows.iter().map(Vec::len).sum();
    if n < 2 {
        return;
    }
    let mean = rows.iter().flatten().map(|&x| x as f64).sum::<f64>() / n as f64;
    let var = rows
        .iter()
        .flatten()
        .map(|&x| (x as f64 - mean).powi(2))
        .sum::<f64>()
        / (n - 1) as f64;
    let scale = 1.0 / (var.sqrt() + 1e-8);
    for x in rows.iter_mut().flatten() {
        *x = ((*x as f64 - mean) * scale) as f32;
    }
}

/// Critic-free baselines over groups of `group` consecutive samples of the same prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Advantage {
    /// GAE on the critic's values.
    #[default]
    Gae,
    /// GRPO: `(r − mean(group)) / (std(group) + ε)`.
    Grpo,
    /// RLOO: `r − mean(other samples of the group)`.
    Rloo,
    /// Dr. GRPO (Liu et al., 2025): `r − mean(group)`, without GRPO's division by the group's
    /// standard deviation (which up-weights prompts that are nearly always right or wrong).
    /// Pair it with `ppo.loss_agg = "seq-mean-token-sum-norm"` for its length-unbiased loss.
    DrGrpo,
    /// REINFORCE++ (Hu, 2025): the KL penalty in each token's reward, the reward-to-go as the
    /// advantage, normalised over the whole batch (no critic, no group baseline).
    ReinforcePp,
}

impl Advantage {
    /// Whether the advantage needs a critic's values.
    pub fn needs_critic(self) -> bool {
        self == Advantage::Gae
    }

    /// Whether the advantage compares samples of the same prompt (so needs several of them).
    pub fn needs_groups(self) -> bool {
        matches!(self, Advantage::Grpo | Advantage::Rloo | Advantage::DrGrpo)
    }
}

/// Why a step's samples would teach the policy nothing, or `None` when they carry a signal:
/// no sample left to train on (`kept` is 0), one reward for every sample, or, for the group
/// advantages, one reward within every group of `group` samples, which makes every advantage
/// 0. `scores` are the step's rewards (after shaping), `group` samples per prompt in a row.
pub fn missing_signal(scores: &[f32], kept: usize, group: usize, mode: Advantage) -> Option<String> {
    let alike = |s: &[f32]| s.iter().all(|&x| x == s[0]);
    if scores.is_empty() || kept == 0 {
        return Some(
            "no sample was left to train on (dynamic sampling dropped every group, or no \
             response ended with EOS under ppo.non_eos = \"exclude\")"
                .into(),
        );
    }
    if alike(scores) {
        return Some(format!(
            "every sample's reward was {}: a constant reward teaches nothing (are the reward's \
             weights all 0, or does it answer the same for every sample?)",
            scores[0]
        ));
    }
    if mode.needs_groups() && scores.chunks(group.max(1)).all(alike) {
        return Some(format!(
            "the {group} samples of each prompt had the same reward, so every group advantage \
             was 0 (identical samples, e.g. at ppo.temperature = 0, or prompts every sample \
             gets right or wrong)"
        ));
    }
    None
}

/// Sequence-level advantages of `scores` under a group baseline (`Gae` and `ReinforcePp` are
/// not one: they return the scores unchanged). `scores.len()` must be a multiple of `group`.
pub fn group_advantages(scores: &[f32], group: usize, mode: Advantage) -> Vec<f32> {
    let group = group.max(1);
    let mut out = Vec::with_capacity(scores.len());
    for chunk in scores.chunks(group) {
        let k = chunk.len() as f32;
        let sum: f32 = chunk.iter().sum();
        let mean = sum / k;
        match mode {
            Advantage::Gae => out.extend_from_slice(chunk),
            Advantage::Grpo => {
                let std = if chunk.len() > 1 {
                    (chunk.iter().map(|r| (r - mean).powi(2)).sum::<f32>() / (k - 1.0)).sqrt()
                } else {
                    0.0
                };
                out.extend(chunk.iter().map(|r| (r - mean) / (std + 1e-6)));
            }
            Advantage::Rloo if chunk.len() > 1 => {
                out.extend(chunk.iter().map(|r| r - (sum - r) / (k - 1.0)));
            }
            Advantage::Rloo => out.extend(chunk.iter().map(|_| 0.0)),
            Advantage::DrGrpo => out.extend(chunk.iter().map(|r| r - mean)),
            Advantage::ReinforcePp => out.extend_from_slice(chunk),
        }
    }
    out
}

/// REINFORCE++ advantages: per-token rewards (`−kl_coef · kl_t`, the score added on the last
/// token), their discounted reward-to-go, whitened over every token of the batch.
pub fn reinforce_pp(scores: &[f32], kls: &[Vec<f32>], kl_coef: f32, gamma: f32) -> Vec<Vec<f32>> {
    let mut rows: Vec<Vec<f32>> = scores
        .iter()
        .zip(kls)
        .map(|(&s, kl)| {
            let rewards = token_rewards(s, kl, kl_coef);
            // GAE with no values and λ = 1 is the discounted reward-to-go.
            gae(&rewards, &vec![0.0; rewards.len()], gamma, 1.0).0
        })
        .collect();
    whiten(&mut rows);
    rows
}

/// DAPO's overlong reward shaping: 0 up to `max_tokens − buffer` tokens, then falling
/// linearly to `−penalty` at `max_tokens` (and below it past that).
pub fn overlong_penalty(tokens: usize, max_tokens: usize, buffer: usize, penalty: f32) -> f32 {
    if buffer == 0 {
        return 0.0;
    }
    let free = max_tokens.saturating_sub(buffer);
    if tokens <= free {
        0.0
    } else {
        -penalty * (tokens - free) as f32 / buffer as f32
    }
}

/// DAPO's dynamic sampling filter: for each group of `group` consecutive samples, whether its
/// scores differ (a group whose samples all score the same has zero advantage everywhere and
/// teaches nothing).
pub fn informative_groups(scores: &[f32], group: usize) -> Vec<bool> {
    scores
        .chunks(group.max(1))
        .map(|g| g.iter().any(|&s| (s - g[0]).abs() > 1e-6))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn kl_estimators_by_hand() {
        let (lp, lr) = ([-1.0f32, -2.0], [-1.5f32, -1.0]);
        close(&kl_per_token(&lp, &lr, KlEstimator::K1), &[0.5, -1.0]);
        close(&kl_per_token(&lp, &lr, KlEstimator::Absolute), &[0.5, 1.0]);
        // k3 = e^{-d} - 1 + d: d = 0.5 → 0.1065307; d = -1 → e - 2 = 0.7182818.
        close(
            &kl_per_token(&lp, &lr, KlEstimator::K3),
            &[0.106_530_7, 0.718_281_8],
        );
    }

    #[test]
    fn rewards_put_the_score_on_the_last_token() {
        close(&token_rewards(2.0, &[0.5, -1.0, 0.0], 0.1), &[-0.05, 0.1, 2.0]);
    }

    #[test]
    fn truncated_is_weights_by_hand() {
        // e^{0.1} = 1.10517, e^{-0.5} = 0.60653, e^{2} = 7.389 capped at 2.
        let w = truncated_is_weights(&[-1.0, -2.0, -0.5], &[-1.1, -1.5, -2.5], 2.0);
        let want = [1.105_171, 0.606_531, 2.0];
        for (a, b) in w.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{w:?}");
        }
        assert_eq!(truncated_is_weights(&[-0.3], &[-0.3], 2.0), vec![1.0]);
    }

    /// With observations between the model's tokens, GAE runs over the model's tokens as if
    /// the observations were not there, and leaves them at 0.
    #[test]
    fn gae_skips_observation_tokens() {
        let kl = [0.1f32, 9.0, 9.0, 0.2, 0.3];
        let values = [0.5f32, 7.0, 7.0, 0.4, 0.2];
        let observed = [false, true, true, false, false];
        let run = |kl: &[f32], v: &[f32]| gae(&token_rewards(1.0, kl, 0.1), v, 0.9, 0.8);
        let (adv, ret) = gae_over_own_tokens(&observed, run, &kl, &values);
        let (want_adv, want_ret) = run(&[0.1, 0.2, 0.3], &[0.5, 0.4, 0.2]);
        assert_eq!(adv, vec![want_adv[0], 0.0, 0.0, want_adv[1], want_adv[2]]);
        assert_eq!(ret, vec![want_ret[0], 0.0, 0.0, want_ret[1], want_ret[2]]);
        // Without observations it is GAE itself.
        assert_eq!(gae_over_own_tokens(&[], run, &kl, &values), run(&kl, &values));
    }

    #[test]
    fn gae_by_hand() {
        // γ = 0.9, λ = 0.8, r = [0, 0, 1], V = [0.5, 0.4, 0.3]
        // δ2 = 1 − 0.3 = 0.7;           A2 = 0.7
        // δ1 = 0 + 0.9·0.3 − 0.4 = −0.13; A1 = −0.13 + 0.72·0.7 = 0.374
        // δ0 = 0 + 0.9·0.4 − 0.5 = −0.14; A0 = −0.14 + 0.72·0.374 = 0.12928
        let (adv, ret) = gae(&[0.0, 0.0, 1.0], &[0.5, 0.4, 0.3], 0.9, 0.8);
        close(&adv, &[0.12928, 0.374, 0.7]);
        close(&ret, &[0.62928, 0.774, 1.0]);
        // λ = 1, γ = 1: advantages are reward-to-go minus the value.
        let (adv, _) = gae(&[1.0, 2.0], &[0.5, 0.5], 1.0, 1.0);
        close(&adv, &[2.5, 1.5]);
    }

    #[test]
    fn whitening_gives_zero_mean_unit_std() {
        let mut rows = vec![vec![1.0, 2.0], vec![3.0, 4.0, 5.0]];
        whiten(&mut rows);
        // mean 3, sample std √2.5
        let s = 2.5f32.sqrt();
        close(&rows[0], &[-2.0 / s, -1.0 / s]);
        close(&rows[1], &[0.0, 1.0 / s, 2.0 / s]);
    }

    #[test]
    fn group_baselines_by_hand() {
        let scores = [1.0, 3.0, 2.0, 2.0];
        // RLOO: 1 − 3, 3 − 1; 2 − 2, 2 − 2
        close(
            &group_advantages(&scores, 2, Advantage::Rloo),
            &[-2.0, 2.0, 0.0, 0.0],
        );
        // GRPO: group (1, 3): mean 2, std √2 → ∓1/√2; (2, 2): 0
        let g = group_advantages(&scores, 2, Advantage::Grpo);
        close(&g, &[-0.707_106_2, 0.707_106_2, 0.0, 0.0]);
        close(&group_advantages(&scores, 2, Advantage::Gae), &scores);
        // Dr. GRPO: the same centring without the division: (1, 3) → ∓1.
        close(
            &group_advantages(&scores, 2, Advantage::DrGrpo),
            &[-1.0, 1.0, 0.0, 0.0],
        );
        // Groups of 3 and 1 (a batch cut short): (1, 3, 2) → mean 2, std 1.
        close(
            &group_advantages(&[1.0, 3.0, 2.0, 5.0], 3, Advantage::Grpo),
            &[-1.0, 1.0, 0.0, 0.0],
        );
    }

    #[test]
    fn reinforce_pp_by_hand() {
        // Scores 1 and 0; KL per token [0.5, 0] and [1]; β = 0.2, γ = 1.
        // Token rewards: [−0.1, 1.0] and [−0.2]; reward-to-go [0.9, 1.0] and [−0.2].
        // Whitened over the 3 tokens: mean 17/30, sample std √(Σ(x−m)²/2).
        let adv = reinforce_pp(&[1.0, 0.0], &[vec![0.5, 0.0], vec![1.0]], 0.2, 1.0);
        let raw = [0.9f64, 1.0, -0.2];
        let m = raw.iter().sum::<f64>() / 3.0;
        let sd = (raw.iter().map(|x| (x - m).powi(2)).sum::<f64>() / 2.0).sqrt();
        let want: Vec<f32> = raw.iter().map(|x| ((x - m) / sd) as f32).collect();
        close(&adv[0], &want[..2]);
        close(&adv[1], &want[2..]);
    }

    #[test]
    fn overlong_shaping_by_hand() {
        // max 48, buffer 8: free up to 40; 44 tokens → −0.5·1.0; 48 → −1.
        assert_eq!(overlong_penalty(40, 48, 8, 1.0), 0.0);
        assert_eq!(overlong_penalty(44, 48, 8, 1.0), -0.5);
        assert_eq!(overlong_penalty(48, 48, 8, 2.0), -2.0);
        assert_eq!(overlong_penalty(48, 48, 0, 1.0), 0.0);
    }

    #[test]
    fn a_step_without_signal_says_why() {
        use Advantage::*;
        // Rewards that differ within a group carry a signal under every advantage.
        for mode in [Gae, Grpo, Rloo, DrGrpo, ReinforcePp] {
            assert_eq!(
                missing_signal(&[1.0, 0.0, 0.0, 0.0], 4, 2, mode),
                None,
                "{mode:?}"
            );
        }
        // One reward for every sample: nothing to learn, whatever the advantage.
        for mode in [Gae, Grpo, ReinforcePp] {
            let why = missing_signal(&[0.5; 4], 4, 2, mode).unwrap();
            assert!(why.contains("every sample's reward was 0.5"), "{why}");
        }
        // Alike within each group but not across them: only the group advantages lose it.
        let by_prompt = [1.0, 1.0, 0.0, 0.0];
        let why = missing_signal(&by_prompt, 4, 2, Grpo).unwrap();
        assert!(why.contains("the 2 samples of each prompt"), "{why}");
        assert!(missing_signal(&by_prompt, 4, 2, Rloo).is_some());
        assert_eq!(missing_signal(&by_prompt, 4, 2, Gae), None);
        assert_eq!(missing_signal(&by_prompt, 4, 2, ReinforcePp), None);
        // Nothing kept (every group dropped, or every response cut off and excluded).
        assert!(
            missing_signal(&[], 0, 2, Grpo)
                .unwrap()
                .contains("no sample was left")
        );
        assert!(
            missing_signal(&[1.0, 0.0], 0, 1, Gae)
                .unwrap()
                .contains("no sample was left")
        );
    }

    #[test]
    fn dynamic_sampling_keeps_groups_whose_scores_differ() {
        assert_eq!(
            informative_groups(&[1.0, 1.0, 0.0, 1.0, 0.0, 0.0], 2),
            vec![false, true, false]
        );
    }
}
