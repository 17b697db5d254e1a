//! Memory-lean token log-probabilities: `log_softmax(logits)[target]` without the full
//! log-softmax tensor.

use burn::tensor::{Int, Tensor};

/// Number of `(batch, position)` rows whose vocabulary row is materialised at once.
///
/// 1024 rows × 50k vocab × 4 bytes is 200 MB for the chunk's logits; small vocabularies cost
/// nothing either way.
pub const DEFAULT_CHUNK_TOKENS: usize = 1024;

/// Log-probability of `targets` under `softmax(logits)` along the last axis.
///
/// * `logits`: `[batch, seq, vocab]`
/// * `targets`: `[batch, seq]` token ids in `0..vocab`
/// * returns `[batch, seq]`
///
/// Rows are processed `chunk_tokens` at a time; each chunk computes `x[t] - logsumexp(x)` with
/// the max subtracted for stability, so at most one chunk's `exp` temporary exists at a time.
/// Differentiable with respect to `logits`.
pub fn token_logprobs(logits: Tensor<3>, targets: Tensor<2, Int>, chunk_tokens: usize) -> Tensor<2> {
    let [batch, seq, vocab] = logits.dims();
    let rows = batch * seq;
    let flat = logits.reshape([rows, vocab]);
    let flat_targets = targets.reshape([rows, 1]);
    let out = chunked_rows(rows, chunk_tokens, |start, end| {
        let chunk = flat.clone().slice([start..end, 0..vocab]);
        let ids = flat_targets.clone().slice([start..end, 0..1]);
        gathered_log_softmax(chunk, ids)
    });
    out.reshape([batch, seq])
}

/// Log-probability of `targets` under `softmax(hidden · weight)`, without the full logits.
///
/// * `hidden`: `[batch, seq, d_model]` final hidden states
/// * `weight`: `[d_model, vocab]` output projection (a Burn-layout linear weight)
/// * `targets`: `[batch, seq]`
/// * returns `[batch, seq]`
///
/// The projection itself is chunked too, so neither `[batch, seq, vocab]` logits nor their
/// log-softmax are ever materialised at once. Differentiable with respect to `hidden` and
/// `weight`. The weight is cast to the hidden states' type (f32 master weights under half
/// precision activations) and the log-probs come out in f32. On the Flex CPU backend every row
/// goes through one [`crate::fused_token_logprobs`] node, which computes its logits
/// [`crate::fused::host::logit_block_rows`] rows at a time; on Cube devices (wgpu, CUDA) each
/// chunk of `chunk_tokens` rows is one such node (hand-written backwards); elsewhere, and under
/// a `softcap` (Gemma's `final_logit_softcapping`: logits become `cap · tanh(logit / cap)`), it
/// is composed from Burn ops.
pub fn token_logprobs_from_hidden(
    hidden: Tensor<3>,
    weight: Tensor<2>,
    targets: Tensor<2, Int>,
    chunk_tokens: usize,
    softcap: Option<f64>,
) -> Tensor<2> {
    let [batch, seq, d_model] = hidden.dims();
    let rows = batch * seq;
    // Half-precision activations meet the f32 master weight in their own type.
    let weight = weight.cast(burn::tensor::FloatDType::from(hidden.dtype()));
    let flat = hidden.reshape([rows, d_model]);
    let flat_targets = targets.reshape([rows, 1]);
    let device = flat.device();
    // On the CPU one fused node takes every row (its logits computed a block of rows at a
    // time): one copy of the weight for the backward, however many rows.
    if softcap.is_none() && crate::fused_available(&device) {
        let out = crate::fused_token_logprobs(flat, weight, flat_targets.reshape([rows]));
        return out.reshape([batch, seq]).cast(burn::tensor::FloatDType::F32);
    }
    let fused = softcap.is_none() && crate::cube_kernels_available(&device);
    let out = chunked_rows(rows, chunk_tokens, |start, end| {
        let chunk = flat.clone().slice([start..end, 0..d_model]);
        let ids = flat_targets.clone().slice([start..end, 0..1]);
        if fused {
            let len = end - start;
            crate::fused_token_logprobs(chunk, weight.clone(), ids.reshape([len])).reshape([len, 1])
        } else {
            // The log-softmax in f32 whatever the compute type (a no-op cast in f32).
            let logits = chunk.matmul(weight.clone()).cast(burn::tensor::FloatDType::F32);
            gathered_log_softmax(soft_cap(logits, softcap), ids)
        }
    });
    // The kernels' log-probs are f32 whatever the compute type; the composed ones follow it.
    out.reshape([batch, seq]).cast(burn::tensor::FloatDType::F32)
}

/// `cap · tanh(x / cap)` under a soft-cap (Gemma's logits), `x` itself without one.
pub fn soft_cap<const D: usize>(x: Tensor<D>, cap: Option<f64>) -> Tensor<D> {
    match cap {
        Some(cap) => x.div_scalar(cap).tanh().mul_scalar(cap),
        None => x,
    }
}

/// Runs `f(start, end)` over consecutive row ranges and concatenates the `[rows, 1]` results.
fn chunked_rows(rows: usize, chunk_tokens: usize, mut f: impl FnMut(usize, usize) -> Tensor<2>) -> Tensor<2> {
    let chunk = chunk_tokens.max(1);
    let pieces: Vec<Tensor<2>> = (0..rows)
        .step_by(chunk)
        .map(|start| f(start, (start + chunk).min(rows)))
        .collect();
    if pieces.len() == 1 {
        pieces.into_iter().next().expect("one piece")
    } else {
        Tensor::cat(pieces, 0)
    }
}

/// `x[target] - logsumexp(x)` for each row of `x: [rows, vocab]`, `targets: [rows, 1]`.
fn gathered_log_softmax(x: Tensor<2>, targets: Tensor<2, Int>) -> Tensor<2> {
    // The max only shifts for stability; detaching it keeps the gradient exact and cheaper.
    let max = x.clone().detach().max_dim(1);
    let shifted = x - max;
    let lse = shifted.clone().exp().sum_dim(1).log();
    shifted.gather(1, targets) - lse
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, Tolerance, activation::log_softmax};

    fn full_reference(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<2> {
        let [b, s, _] = logits.dims();
        log_softmax(logits, 2)
            .gather(2, targets.reshape([b, s, 1]))
            .reshape([b, s])
    }

    fn random_case(device: &Device, b: usize, s: usize, v: usize) -> (Tensor<3>, Tensor<2, Int>) {
        device.seed(7);
        let logits = Tensor::<3>::random([b, s, v], Distribution::Normal(0.0, 3.0), device);
        let targets = Tensor::<2, Int>::random([b, s], Distribution::Uniform(0.0, v as f64), device);
        (logits, targets)
    }

    #[test]
    fn chunked_equals_full_log_softmax_for_every_chunk_size() {
        let device = Device::flex();
        let (logits, targets) = random_case(&device, 3, 7, 50);
        let expected = full_reference(logits.clone(), targets.clone());
        for chunk in [1, 2, 5, 21, 1000] {
            let got = token_logprobs(logits.clone(), targets.clone(), chunk);
            got.into_data()
                .assert_approx_eq::<f32>(&expected.to_data(), Tolerance::absolute(1e-5));
        }
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let device = Device::flex();
        let logits = Tensor::<3>::from_floats([[[1000.0, 0.0, -1000.0]]], &device);
        let targets = Tensor::<2, Int>::from_ints([[0]], &device);
        let got: Vec<f32> = token_logprobs(logits, targets, 4)
            .into_data()
            .try_to_vec()
            .unwrap();
        assert!(
            got[0].abs() < 1e-6,
            "log p of the dominant token should be 0, got {}",
            got[0]
        );
    }

    #[test]
    fn from_hidden_equals_projection_then_log_softmax() {
        let device = Device::flex();
        device.seed(3);
        let hidden = Tensor::<3>::random([2, 5, 8], Distribution::Normal(0.0, 1.0), &device);
        let weight = Tensor::<2>::random([8, 30], Distribution::Normal(0.0, 1.0), &device);
        let targets = Tensor::<2, Int>::random([2, 5], Distribution::Uniform(0.0, 30.0), &device);
        let logits = hidden.clone().matmul(weight.clone().unsqueeze());
        let expected = full_reference(logits, targets.clone());
        let got = token_logprobs_from_hidden(hidden.clone(), weight.clone(), targets.clone(), 3, None);
        got.into_data()
            .assert_approx_eq::<f32>(&expected.to_data(), Tolerance::absolute(1e-5));
        // Soft-capped: the cap applied to the full logits, then the log-softmax.
        let logits = hidden.clone().matmul(weight.clone().unsqueeze());
        let expected = full_reference(logits.div_scalar(2.5).tanh().mul_scalar(2.5), targets.clone());
        let got = token_logprobs_from_hidden(hidden, weight, targets, 3, Some(2.5));
        got.into_data()
            .assert_approx_eq::<f32>(&expected.to_data(), Tolerance::absolute(1e-5));
    }

    #[test]
    fn gradients_match_full_log_softmax() {
        let device = Device::flex().autodiff();
        let (logits, targets) = random_case(&device, 2, 6, 40);
        let weights = Tensor::<2>::random([2, 6], Distribution::Normal(0.0, 1.0), &device);

        let a = logits.clone().detach().require_grad();
        let loss_a = (token_logprobs(a.clone(), targets.clone(), 4) * weights.clone()).sum();
        let grad_a = a.grad(&loss_a.backward()).expect("grad");

        let b = logits.detach().require_grad();
        let loss_b = (full_reference(b.clone(), targets) * weights).sum();
        let grad_b = b.grad(&loss_b.backward()).expect("grad");

        grad_a
            .into_data()
            .assert_approx_eq::<f32>(&grad_b.to_data(), Tolerance::absolute(1e-5));
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let device = Device::flex().autodiff();
        let logits = Tensor::<3>::from_floats([[[0.3, -1.2, 2.0, 0.5]]], &device).require_grad();
        let targets = Tensor::<2, Int>::from_ints([[2]], &device);
        let loss = token_logprobs(logits.clone(), targets.clone(), 1).sum();
        let grad: Vec<f32> = logits
            .grad(&loss.backward())
            .expect("grad")
            .into_data()
            .try_to_vec()
            .unwrap();

        let base = [0.3f32, -1.2, 2.0, 0.5];
        let eps = 1e-2f32;
        let plain = Device::flex();
        let eval = |x: [f32; 4]| -> f32 {
            let t = Tensor::<3>::from_floats([[x]], &plain);
            token_logprobs(t, Tensor::<2, Int>::from_ints([[2]], &plain), 1).into_scalar::<f32>()
        };
        for i in 0..4 {
            let mut up = base;
            let mut down = base;
            up[i] += eps;
            down[i] -= eps;
            let numeric = (eval(up) - eval(down)) / (2.0 * eps);
            assert!(
                (numeric - grad[i]).abs() < 1e-3,
                "d/dx{i}: numeric {numeric} vs autodiff {}",
                grad[i]
            );
        }
    }
}
