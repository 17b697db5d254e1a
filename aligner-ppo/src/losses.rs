//! PPO's clipped objectives on `[batch, tokens]` tensors with a 0/1 mask of real tokens.

use burn::tensor::Tensor;

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
    let log_ratio = logp - old_logp;
    let ratio = log_ratio.clone().exp();
    let unclipped = ratio.clone() * advantages.clone();
    let clipped = ratio.clone().clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages;
    let loss = masked_mean(unclipped.clone().min_pair(clipped.clone()).neg(), mask);
    let was_clipped = unclipped.greater(clipped).float();
    let clip_fraction = masked_mean(was_clipped, mask).into_scalar::<f32>() as f64;
    let approx_kl = masked_mean(log_ratio.detach().neg(), mask).into_scalar::<f32>() as f64;
    PolicyLoss {
        loss,
        clip_fraction,
        approx_kl,
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
