//! PPO's clipped objectives on `[batch, tokens]` tensors with a 0/1 mask of real tokens, and
//! the GRPO family's variations on them: decoupled clip ranges (DAPO), a sequence-level
//! importance ratio (GSPO) and the ways per-token losses are averaged ([`LossAgg`]).

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// How per-token losses become one number (`ppo.loss_agg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum LossAgg {
    /// The mean over every response token of the batch: long responses weigh more per sequence
    /// (DAPO's token-level loss; PPO's usual form).
    #[default]
    TokenMean,
    /// The mean over sequences of each one's token sum.
    SeqMeanTokenSum,
    /// The mean over sequences of each one's token mean (GRPO's original form, which weighs
    /// each token of a short response more).
    SeqMeanTokenMean,
    /// The mean over sequences of each one's token sum divided by the token limit, a constant
    /// (Dr. GRPO: no length normalisation, so no length bias).
    SeqMeanTokenSumNorm,
}

/// Which importance ratio the clipped objective uses (`ppo.importance_ratio`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceRatio {
    /// `π(y_t) / π_old(y_t)` for each token (PPO, GRPO, DAPO).
    #[default]
    Token,
    /// GSPO (Zheng et al., 2025): one ratio per sequence, `exp(mean_t log π/π_old)` (the
    /// length-normalised sequence likelihood ratio), clipped as a whole.
    Sequence,
}

/// The settings of [`policy_loss`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyLossOptions {
    /// The ratio may fall to `1 − clip_low`...
    pub clip_low: f64,
    /// ... and rise to `1 + clip_high` (DAPO's clip-higher: `clip_high > clip_low`).
    pub clip_high: f64,
    pub ratio: ImportanceRatio,
    pub agg: LossAgg,
    /// The token limit (`ppo.max_new_tokens`), for `SeqMeanTokenSumNorm`.
    pub max_tokens: usize,
}

impl PolicyLossOptions {
    /// PPO's: symmetric clip, token ratios, token mean.
    pub fn ppo(clip_eps: f64) -> Self {
        Self {
            clip_low: clip_eps,
            clip_high: clip_eps,
            ratio: ImportanceRatio::Token,
            agg: LossAgg::TokenMean,
            max_tokens: 1,
        }
    }
}

/// `x` (`[batch, tokens]`, zero where `mask` is) aggregated as `agg` says.
pub fn aggregate(x: Tensor<2>, mask: &Tensor<2>, agg: LossAgg, max_tokens: usize) -> Tensor<1> {
    let masked = x * mask.clone();
    match agg {
        LossAgg::TokenMean => masked.sum().div(mask.clone().sum().clamp_min(1.0)),
        LossAgg::SeqMeanTokenSum => masked.sum_dim(1).mean().reshape([1]),
        LossAgg::SeqMeanTokenMean => masked
            .sum_dim(1)
            .div(mask.clone().sum_dim(1).clamp_min(1.0))
            .mean()
            .reshape([1]),
        LossAgg::SeqMeanTokenSumNorm => masked
            .sum_dim(1)
            .mean()
            .div_scalar(max_tokens.max(1) as f64)
            .reshape([1]),
    }
}

/// What the clipped policy loss reports besides itself.
pub struct PolicyLoss {
    pub loss: Tensor<1>,
    /// Fraction of tokens whose ratio was clipped.
    pub clip_fraction: f64,
    /// Mean `old − new` log-prob (a cheap KL(old‖new) estimate) over the tokens.
    pub approx_kl: f64,
}

fn masked_mean(x: Tensor<2>, mask: &Tensor<2>) -> Tensor<1> {
    (x * mask.clone()).sum().div(mask.clone().sum().clamp_min(1.0))
}

/// `−mean min(ρ A, clip(ρ, 1 − ε, 1 + ε) A)` with `ρ = exp(logp − old_logp)`.
pub fn clipped_policy_loss(
    logp: Tensor<2>,
    old_logp: Tensor<2>,
    advantages: Tensor<2>,
    mask: &Tensor<2>,
    clip_eps: f64,
) -> PolicyLoss {
    policy_loss(
        logp,
        old_logp,
        advantages,
        mask,
        &PolicyLossOptions::ppo(clip_eps),
    )
}

/// `−agg min(ρ A, clip(ρ, 1 − ε_low, 1 + ε_high) A)`, with `ρ` per token or per sequence and
/// the aggregation of [`PolicyLossOptions`].
pub fn policy_loss(
    logp: Tensor<2>,
    old_logp: Tensor<2>,
    advantages: Tensor<2>,
    mask: &Tensor<2>,
    options: &PolicyLossOptions,
) -> PolicyLoss {
    let log_ratio = logp - old_logp;
    let ratio = match options.ratio {
        ImportanceRatio::Token => log_ratio.clone().exp(),
        ImportanceRatio::Sequence => {
            let [_, tokens] = log_ratio.dims();
            let per_sequence = (log_ratio.clone() * mask.clone())
                .sum_dim(1)
                .div(mask.clone().sum_dim(1).clamp_min(1.0));
            per_sequence.exp().repeat_dim(1, tokens)
        }
    };
    let unclipped = ratio.clone() * advantages.clone();
    let clipped = ratio.clamp(1.0 - options.clip_low, 1.0 + options.clip_high) * advantages;
    let loss = aggregate(
        unclipped.clone().min_pair(clipped.clone()).neg(),
        mask,
        options.agg,
        options.max_tokens,
    );
    let was_clipped = unclipped.greater(clipped).float();
    let clip_fraction = masked_mean(was_clipped, mask).into_scalar::<f32>() as f64;
    let approx_kl = masked_mean(log_ratio.detach().neg(), mask).into_scalar::<f32>() as f64;
    PolicyLoss {
        loss,
        clip_fraction,
        approx_kl,
    }
}

/// How far the rollout engine's log-probs of its sampled tokens are from the trainer's
/// recomputed ones (verl's and TRL's "rollout/trainer mismatch"): the mean and the largest
/// `|log π_engine(y_t) − log π_trainer(y_t)|` over the tokens. Near 0 when both run the same
/// weights at the same precision; a half-precision engine against f32 training shows here.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LogprobMismatch {
    pub mean: f64,
    pub max: f64,
}

/// [`LogprobMismatch`] of `engine` against `trainer`, row by row over the tokens they share.
pub fn logprob_mismatch(engine: &[impl AsRef<[f32]>], trainer: &[impl AsRef<[f32]>]) -> LogprobMismatch {
    let (mut sum, mut max, mut n) = (0.0f64, 0.0f64, 0usize);
    for (e, t) in engine.iter().zip(trainer) {
        for (a, b) in e.as_ref().iter().zip(t.as_ref()) {
            let gap = (*a as f64 - *b as f64).abs();
            sum += gap;
            max = max.max(gap);
            n += 1;
        }
    }
    LogprobMismatch {
        mean: sum / n.max(1) as f64,
        max,
    }
}

/// `½ mean max((V − R)², (clip(V, V_old ± ε) − R)²)`: the critic may not move a value more
/// than `clip_eps` from the one it predicted at rollout time without paying for it.
pub fn clipped_value_loss(
    values: Tensor<2>,
    old_values: Tensor<2>,
    returns: Tensor<2>,
    mask: &Tensor<2>,
    clip_eps: f64,
) -> Tensor<1> {
    let clipped = old_values.clone() + (values.clone() - old_values).clamp(-clip_eps, clip_eps);
    let plain = (values - returns.clone()).powi_scalar(2);
    let clipped = (clipped - returns).powi_scalar(2);
    masked_mean(plain.max_pair(clipped), mask).mul_scalar(0.5)
}

/// Entropy `−Σ p log p` of each position's distribution, `[batch, seq, vocab]` logits →
/// `[batch, seq]`.
pub fn entropy(logits: Tensor<3>) -> Tensor<2> {
    let [b, s, _] = logits.dims();
    let log_p = burn::tensor::activation::log_softmax(logits, 2);
    (log_p.clone().exp() * log_p).sum_dim(2).neg().reshape([b, s])
}

/// Mean over real tokens of a `[batch, tokens]` quantity.
pub fn masked_token_mean(x: Tensor<2>, mask: &Tensor<2>) -> Tensor<1> {
    masked_mean(x, mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn t(rows: &[[f32; 2]]) -> Tensor<2> {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        Tensor::from_data(TensorData::new(flat, [rows.len(), 2]), &Device::flex())
    }

    #[test]
    fn logprob_mismatch_by_hand() {
        // Gaps 0.1, 0.3 and 0.0 (the trainer's third value of row 2 has no engine token).
        let engine = vec![vec![-1.0f32, -2.0], vec![-0.5]];
        let trainer = vec![vec![-1.1f32, -1.7], vec![-0.5, -3.0]];
        let m = logprob_mismatch(&engine, &trainer);
        assert!((m.mean - 0.4 / 3.0).abs() < 1e-6, "{m:?}");
        assert!((m.max - 0.3).abs() < 1e-6, "{m:?}");
        let none: Vec<Vec<f32>> = Vec::new();
        assert_eq!(logprob_mismatch(&none, &none), LogprobMismatch::default());
    }

    #[test]
    fn policy_loss_by_hand() {
        // Token 1: ratio e^{0.5} = 1.6487, A = 1 → min(1.6487, 1.2) = 1.2 (clipped).
        // Token 2: ratio e^{-0.1} = 0.9048, A = −2 → min(−1.8097, −1.8097)... clip keeps 0.9048
        //          (inside [0.8, 1.2]) → −1.8097.
        // Token 3: masked out. Loss = −(1.2 − 1.8097) / 2 = 0.30484.
        let logp = t(&[[-0.5, -1.1], [-1.0, 0.0]]);
        let old = t(&[[-1.0, -1.0], [-1.0, 0.0]]);
        let adv = t(&[[1.0, -2.0], [5.0, 0.0]]);
        let mask = t(&[[1.0, 1.0], [0.0, 0.0]]);
        let out = clipped_policy_loss(logp, old, adv, &mask, 0.2);
        let loss = out.loss.into_scalar::<f32>();
        assert!((loss - 0.304_837_4).abs() < 1e-5, "{loss}");
        assert!((out.clip_fraction - 0.5).abs() < 1e-9);
        // approx KL = mean(old − new) = ((−1 + 0.5) + (−1 + 1.1)) / 2 = −0.2
        assert!((out.approx_kl + 0.2).abs() < 1e-6);
    }

    #[test]
    fn loss_aggregations_by_hand() {
        // Row 1: tokens 1, 2, 3 (all real); row 2: 4 and a masked 100.
        let x = Tensor::<2>::from_data(
            TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0, 100.0, 0.0], [2, 3]),
            &Device::flex(),
        );
        let mask = Tensor::<2>::from_data(
            TensorData::new(vec![1.0f32, 1.0, 1.0, 1.0, 0.0, 0.0], [2, 3]),
            &Device::flex(),
        );
        let agg = |a: LossAgg| aggregate(x.clone(), &mask, a, 8).into_scalar::<f32>();
        // token mean: 10 / 4; sequence means of sums: (6 + 4) / 2;
        // of means: (2 + 4) / 2; of sums over the limit 8: 5 / 8.
        assert!((agg(LossAgg::TokenMean) - 2.5).abs() < 1e-6);
        assert!((agg(LossAgg::SeqMeanTokenSum) - 5.0).abs() < 1e-6);
        assert!((agg(LossAgg::SeqMeanTokenMean) - 3.0).abs() < 1e-6);
        assert!((agg(LossAgg::SeqMeanTokenSumNorm) - 0.625).abs() < 1e-6);
    }

    #[test]
    fn clip_higher_lets_positive_advantages_rise_further() {
        // ratio e^{0.25} = 1.2840, A = 1: symmetric ε 0.2 clips it to 1.2; ε_high 0.28 keeps
        // 1.28; ratio e^{-0.25} = 0.7788 with A = −1 clips at 1 − ε_low = 0.8 either way.
        let logp = t(&[[-0.75, -1.25]]);
        let old = t(&[[-1.0, -1.0]]);
        let adv = t(&[[1.0, -1.0]]);
        let mask = t(&[[1.0, 1.0]]);
        let run = |high: f64| {
            let options = PolicyLossOptions {
                clip_high: high,
                ..PolicyLossOptions::ppo(0.2)
            };
            policy_loss(logp.clone(), old.clone(), adv.clone(), &mask, &options)
                .loss
                .into_scalar::<f32>()
        };
        assert!((run(0.2) - (-(1.2 - 0.8) / 2.0)).abs() < 1e-5);
        assert!((run(0.28) - (-(1.28 - 0.8) / 2.0)).abs() < 1e-5);
    }

    #[test]
    fn sequence_ratio_by_hand() {
        // Row 1: log-ratios 0.1 and −0.3 → mean −0.1, ratio e^{-0.1} = 0.904837 on both
        // tokens; A = 2 → inside [1 − 0.2, 1 + 0.2], objective 1.809675 per token.
        // Row 2: one token, log-ratio 0.5 → ratio 1.6487, A = 1 → clipped to 1.2.
        // Sequence mean of token means: −(1.809675 + 1.2) / 2 = −1.5048374.
        let logp = t(&[[-0.9, -1.3], [-0.5, 0.0]]);
        let old = t(&[[-1.0, -1.0], [-1.0, 0.0]]);
        let adv = t(&[[2.0, 2.0], [1.0, 0.0]]);
        let mask = t(&[[1.0, 1.0], [1.0, 0.0]]);
        let options = PolicyLossOptions {
            ratio: ImportanceRatio::Sequence,
            agg: LossAgg::SeqMeanTokenMean,
            ..PolicyLossOptions::ppo(0.2)
        };
        let out = policy_loss(logp, old, adv, &mask, &options);
        assert!((out.loss.into_scalar::<f32>() + 1.504_837_4).abs() < 1e-5);
        // One of three tokens was clipped.
        assert!((out.clip_fraction - 1.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn sequence_ratio_gradient_is_the_mean_token_gradient_times_the_ratio() {
        // d/d logp_t of −ρ A with ρ = exp(mean(logp − old)) is −ρ A / T for each real token.
        let device = Device::flex().autodiff();
        let logp =
            Tensor::<2>::from_data(TensorData::new(vec![-0.9f32, -1.3], [1, 2]), &device).require_grad();
        let old = Tensor::<2>::from_data(TensorData::new(vec![-1.0f32, -1.0], [1, 2]), &device);
        let adv = Tensor::<2>::from_data(TensorData::new(vec![0.5f32, 0.5], [1, 2]), &device);
        let mask = Tensor::<2>::ones([1, 2], &device);
        let options = PolicyLossOptions {
            ratio: ImportanceRatio::Sequence,
            agg: LossAgg::SeqMeanTokenMean,
            ..PolicyLossOptions::ppo(0.2)
        };
        let grads = policy_loss(logp.clone(), old, adv, &mask, &options)
            .loss
            .backward();
        let g = logp
            .grad(&grads)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let want = -(-0.1f32).exp() * 0.5 / 2.0;
        assert!((g[0] - want).abs() < 1e-6 && (g[1] - want).abs() < 1e-6, "{g:?}");
    }

    #[test]
    fn negative_advantage_clips_below() {
        // ratio e^{-0.5} = 0.6065, A = −1: unclipped −0.6065, clipped 0.8·(−1) = −0.8;
        // min = −0.8 → loss 0.8, clipped.
        let out = clipped_policy_loss(
            t(&[[-1.5, 0.0]]),
            t(&[[-1.0, 0.0]]),
            t(&[[-1.0, 0.0]]),
            &t(&[[1.0, 0.0]]),
            0.2,
        );
        assert!((out.loss.into_scalar::<f32>() - 0.8).abs() < 1e-6);
        assert!((out.clip_fraction - 1.0).abs() < 1e-9);
    }

    #[test]
    fn entropy_by_hand() {
        // Uniform over 4: ln 4. Logits (0, ln 3): p = (1/4, 3/4) → −(¼ ln ¼ + ¾ ln ¾) = 0.562335.
        let logits = Tensor::<3>::from_data(
            TensorData::new(vec![0.0f32, 0.0, 0.0, 0.0, 0.0, 3f32.ln(), -1e9, -1e9], [1, 2, 4]),
            &Device::flex(),
        );
        let h: Vec<f32> = entropy(logits).into_data().try_to_vec().unwrap();
        assert!(
            (h[0] - 4f32.ln()).abs() < 1e-5 && (h[1] - 0.562_335).abs() < 1e-5,
            "{h:?}"
        );
    }

    #[test]
    fn value_loss_by_hand() {
        // Token 1: V = 1.0, V_old = 0.5, R = 2 → clipped V = 0.7; max((1−2)², (0.7−2)²) = 1.69.
        // Token 2: V = 0.1, V_old = 0.0, R = −1 → clipped V = 0.1; (1.1)² = 1.21.
        // ½ · mean = ½ · 1.45 = 0.725.
        let loss = clipped_value_loss(
            t(&[[1.0, 0.1]]),
            t(&[[0.5, 0.0]]),
            t(&[[2.0, -1.0]]),
            &t(&[[1.0, 1.0]]),
            0.2,
        );
        assert!((loss.into_scalar::<f32>() - 0.725).abs() < 1e-6);
    }

    #[test]
    fn policy_gradient_pushes_up_positive_advantages() {
        let device = Device::flex().autodiff();
        let logp =
            Tensor::<2>::from_data(TensorData::new(vec![-1.0f32, -1.0], [1, 2]), &device).require_grad();
        let old = Tensor::<2>::from_data(TensorData::new(vec![-1.0f32, -1.0], [1, 2]), &device);
        let adv = Tensor::<2>::from_data(TensorData::new(vec![2.0f32, -1.0], [1, 2]), &device);
        let mask = Tensor::<2>::ones([1, 2], &device);
        let out = clipped_policy_loss(logp.clone(), old, adv, &mask, 0.2);
        let grads = out.loss.backward();
        let g = logp
            .grad(&grads)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        // d(−mean ρA)/d logp at ρ = 1: −A/2.
        assert!((g[0] + 1.0).abs() < 1e-6 && (g[1] - 0.5).abs() < 1e-6, "{g:?}");
    }
}
