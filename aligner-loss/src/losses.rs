//! The DPO family as pure functions of per-pair margins. `delta` is the log-ratio margin
//! `(π_c − r_c) − (π_r − r_r)`; `beta` the KL strength.

use burn::tensor::Tensor;
use burn::tensor::activation::{log_sigmoid, relu};

/// DPO (sigmoid) with conservative label smoothing `ε`:
/// `−(1−ε)·log σ(βΔ) − ε·log σ(−βΔ)`; `ε = 0` is plain DPO.
pub fn sigmoid_loss(delta: Tensor<1>, beta: f64, label_smoothing: f64) -> Tensor<1> {
    let z = delta.mul_scalar(beta);
    log_sigmoid(z.clone()).mul_scalar(-(1.0 - label_smoothing))
        - log_sigmoid(z.neg()).mul_scalar(label_smoothing)
}

/// IPO: `(Δ̄ − 1/(2β))²` on length-averaged log-ratios.
pub fn ipo_loss(delta_averaged: Tensor<1>, beta: f64) -> Tensor<1> {
    delta_averaged.sub_scalar(1.0 / (2.0 * beta)).square()
}

/// Hinge (SLiC): `relu(1 − βΔ)`.
pub fn hinge_loss(delta: Tensor<1>, beta: f64) -> Tensor<1> {
    relu(delta.mul_scalar(-beta).add_scalar(1.0))
}

/// Robust DPO with label-noise rate `ε`: `(−(1−ε)·log σ(βΔ) + ε·log σ(−βΔ)) / (1 − 2ε)`.
pub fn robust_loss(delta: Tensor<1>, beta: f64, eps: f64) -> Tensor<1> {
    let z = delta.mul_scalar(beta);
    (log_sigmoid(z.clone()).mul_scalar(-(1.0 - eps)) + log_sigmoid(z.neg()).mul_scalar(eps))
        .div_scalar(1.0 - 2.0 * eps)
}

/// Reward-aware RPO, squared distance: `(βΔ − g)²` with `g` the scaled reward margin.
pub fn rpo_sq_loss(delta: Tensor<1>, beta: f64, reward_margin: Tensor<1>) -> Tensor<1> {
    (delta.mul_scalar(beta) - reward_margin).square()
}

/// Bernoulli log-probabilities `(log σ(x), log σ(−x))`.
fn bernoulli(x: Tensor<1>) -> (Tensor<1>, Tensor<1>) {
    (log_sigmoid(x.clone()), log_sigmoid(x.neg()))
}

/// Reward-aware RPO, backward KL: `KL(Bern(σ(g)) ‖ Bern(σ(βΔ)))`.
pub fn rpo_bwd_kl_loss(delta: Tensor<1>, beta: f64, reward_margin: Tensor<1>) -> Tensor<1> {
    let (lb_c, lb_r) = bernoulli(delta.mul_scalar(beta));
    let (la_c, la_r) = bernoulli(reward_margin);
    la_c.clone().exp() * (la_c - lb_c) + la_r.clone().exp() * (la_r - lb_r)
}

/// Reward-aware RPO, forward KL: `KL(Bern(σ(βΔ)) ‖ Bern(σ(g)))`.
pub fn rpo_fwd_kl_loss(delta: Tensor<1>, beta: f64, reward_margin: Tensor<1>) -> Tensor<1> {
    let (lb_c, lb_r) = bernoulli(delta.mul_scalar(beta));
    let (la_c, la_r) = bernoulli(reward_margin);
    lb_c.clone().exp() * (lb_c - la_c) + lb_r.clone().exp() * (lb_r - la_r)
}

/// DPO's implicit rewards `β·(π − r)` of one side.
pub fn implicit_rewards(policy: Tensor<1>, reference: Tensor<1>, beta: f64) -> Tensor<1> {
    (policy - reference).mul_scalar(beta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn t(values: &[f32]) -> Tensor<1> {
        Tensor::<1>::from_floats(values, &Device::flex())
    }

    fn close(got: Tensor<1>, want: &[f64]) {
        let got: Vec<f32> = got.into_data().try_to_vec().unwrap();
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-5, "{g} vs {w}");
        }
    }

    fn ln_sigmoid(x: f64) -> f64 {
        -(1.0 + (-x).exp()).ln()
    }

    #[test]
    fn sigmoid_matches_hand_values() {
        // β = 0.5: βΔ = 1, 0, −2.
        close(
            sigmoid_loss(t(&[2.0, 0.0, -4.0]), 0.5, 0.0),
            &[-ln_sigmoid(1.0), 2f64.ln(), -ln_sigmoid(-2.0)],
        );
        // Conservative DPO, ε = 0.1, βΔ = 1.
        close(
            sigmoid_loss(t(&[2.0]), 0.5, 0.1),
            &[-0.9 * ln_sigmoid(1.0) - 0.1 * ln_sigmoid(-1.0)],
        );
    }

    #[test]
    fn ipo_hinge_robust_match_hand_values() {
        close(ipo_loss(t(&[1.0, 0.0]), 0.5), &[0.0, 1.0]);
        close(ipo_loss(t(&[3.0]), 0.25), &[1.0]);
        close(hinge_loss(t(&[1.0, 4.0, -2.0]), 0.5), &[0.5, 0.0, 2.0]);
        let want = (-(0.8) * ln_sigmoid(1.0) + 0.2 * ln_sigmoid(-1.0)) / 0.6;
        close(robust_loss(t(&[2.0]), 0.5, 0.2), &[want]);
        // ε = 0 is plain DPO.
        close(robust_loss(t(&[2.0]), 0.5, 0.0), &[-ln_sigmoid(1.0)]);
    }

    #[test]
    fn reward_aware_losses_match_hand_values() {
        // βΔ = 1, g = 0.5.
        close(rpo_sq_loss(t(&[2.0]), 0.5, t(&[0.5])), &[0.25]);
        let (b, a) = (1.0f64, 0.5f64);
        let (lbc, lbr, lac, lar) = (ln_sigmoid(b), ln_sigmoid(-b), ln_sigmoid(a), ln_sigmoid(-a));
        close(
            rpo_bwd_kl_loss(t(&[2.0]), 0.5, t(&[0.5])),
            &[lac.exp() * (lac - lbc) + lar.exp() * (lar - lbr)],
        );
        close(
            rpo_fwd_kl_loss(t(&[2.0]), 0.5, t(&[0.5])),
            &[lbc.exp() * (lbc - lac) + lbr.exp() * (lbr - lar)],
        );
        // Matching margins give zero KL.
        close(rpo_bwd_kl_loss(t(&[2.0]), 0.5, t(&[1.0])), &[0.0]);
        close(rpo_fwd_kl_loss(t(&[2.0]), 0.5, t(&[1.0])), &[0.0]);
    }

    #[test]
    fn every_margin_loss_pushes_the_margin_up_when_it_is_small() {
        let device = Device::flex().autodiff();
        type LossFn = Box<dyn Fn(Tensor<1>) -> Tensor<1>>;
        let losses: Vec<(&str, LossFn)> = vec![
            ("dpo", Box::new(|d| sigmoid_loss(d, 0.1, 0.0))),
            ("cdpo", Box::new(|d| sigmoid_loss(d, 0.1, 0.1))),
            ("ipo", Box::new(|d| ipo_loss(d, 0.1))),
            ("hinge", Box::new(|d| hinge_loss(d, 0.1))),
            ("robust", Box::new(|d| robust_loss(d, 0.1, 0.1))),
            (
                "rpo_sq",
                Box::new(|d| {
                    rpo_sq_loss(
                        d,
                        0.1,
                        Tensor::<1>::from_floats([2.0], &Device::flex().autodiff()),
                    )
                }),
            ),
            (
                "rpo_bwd_kl",
                Box::new(|d| {
                    rpo_bwd_kl_loss(
                        d,
                        0.1,
                        Tensor::<1>::from_floats([2.0], &Device::flex().autodiff()),
                    )
                }),
            ),
            (
                "rpo_fwd_kl",
                Box::new(|d| {
                    rpo_fwd_kl_loss(
                        d,
                        0.1,
                        Tensor::<1>::from_floats([2.0], &Device::flex().autodiff()),
                    )
                }),
            ),
        ];
        for (name, f) in losses {
            let delta = Tensor::<1>::from_floats([0.0], &device).require_grad();
            let grads = f(delta.clone()).sum().backward();
            let g = delta.grad(&grads).unwrap().into_scalar::<f32>();
            assert!(
                g < 0.0,
                "{name}: d loss / d margin = {g} should be negative at margin 0"
            );
        }
    }
}
