//! The fused ops against the same maths composed from Burn ops: values, and gradients of a
//! random weighting of the outputs with respect to every input.

use aligner_parallel::{fused_attention, fused_available, fused_token_logprobs};
use burn::tensor::activation::log_softmax;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Distribution, Int, Tensor, TensorData, Tolerance};

fn normal<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

fn assert_close<const D: usize>(got: Tensor<D>, want: Tensor<D>, tol: f32, what: &str) {
    let (got, want) = (got.into_data(), want.into_data());
    let g: Vec<f32> = got.try_to_vec::<f32>().unwrap();
    let w: Vec<f32> = want.try_to_vec::<f32>().unwrap();
    let worst = g
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < tol, "{what}: max |difference| {worst} (tolerance {tol})");
    got.assert_approx_eq::<f32>(&want, Tolerance::absolute(tol as f64));
}

#[test]
fn fused_ops_run_on_flex() {
    assert!(fused_available(&Device::flex()));
    assert!(fused_available(&Device::flex().autodiff()));
}

/// One block of rows, and rows over several blocks (the weight's gradient summed over them);
/// a weight of its own, and a tied embedding's transpose (read in place).
#[test]
fn token_logprobs_values_and_gradients_match_composed_ops() {
    for n in [37, 2 * aligner_parallel::fused::host::LOGIT_BLOCK_ROWS + 13] {
        for tied in [false, true] {
            token_logprobs_match_composed_ops(n, tied);
        }
    }
}

/// A large vocabulary takes fewer rows per block of logits: 256 MB at most.
#[test]
fn logit_blocks_stay_within_their_budget() {
    use aligner_parallel::fused::host::{LOGIT_BLOCK_ROWS, logit_block_rows};
    assert_eq!(logit_block_rows(151_936), 441);
    assert_eq!(logit_block_rows(512), LOGIT_BLOCK_ROWS);
    assert_eq!(logit_block_rows(1 << 30), 1);
}

/// The backward recomputing the softmax block by block (rows too many to keep) gives the
/// gradients of the kept softmax.
#[test]
fn token_logprobs_backward_recomputes_what_it_did_not_keep() {
    use aligner_parallel::fused::host::{
        SoftmaxRows, WeightRef, token_logprobs_backward, token_logprobs_forward,
    };
    let (n, d, v) = (2 * aligner_parallel::fused::host::LOGIT_BLOCK_ROWS + 5, 8, 97);
    let values = |len: usize, salt: usize| -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + salt) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    };
    let (hidden, weight, grad) = (values(n * d, 1), values(d * v, 2), values(n, 3));
    let targets: Vec<i64> = (0..n).map(|i| ((i * 31) % v) as i64).collect();
    let (_, kept) = token_logprobs_forward(&hidden, WeightRef::rows(&weight), &targets, (d, v), true);
    assert!(kept.probs.is_some());
    let recomputed = SoftmaxRows {
        lse: kept.lse.clone(),
        probs: None,
    };
    let (dh_kept, dw_kept) =
        token_logprobs_backward(&hidden, WeightRef::rows(&weight), &targets, kept, &grad, d, v);
    let (dh, dw) = token_logprobs_backward(
        &hidden,
        WeightRef::rows(&weight),
        &targets,
        recomputed,
        &grad,
        d,
        v,
    );
    let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(worst(&dh, &dh_kept) < 1e-5 && worst(&dw, &dw_kept) < 1e-4);
    assert!(dw.iter().any(|&x| x != 0.0));
}

fn token_logprobs_match_composed_ops(n: usize, tied: bool) {
    let device = Device::flex().autodiff();
    device.seed(11);
    let (d, v) = (16, 301);
    let hidden = normal([n, d], &device);
    // Tied: the parameter is the `[v, d]` embedding, the op reads its transpose.
    let weight = match tied {
        false => normal([d, v], &device),
        true => normal([v, d], &device),
    };
    let targets = Tensor::<1, Int>::random([n], Distribution::Uniform(0.0, v as f64), &device);
    let weights = normal([n], &device);

    let run = |fused: bool| {
        let h = hidden.clone().detach().require_grad();
        let w = weight.clone().detach().require_grad();
        let projection = if tied { w.clone().transpose() } else { w.clone() };
        let out = if fused {
            fused_token_logprobs(h.clone(), projection, targets.clone())
        } else {
            // The full log-softmax from Burn ops (token_logprobs_from_hidden is fused on Flex).
            log_softmax(h.clone().matmul(projection), 1)
                .gather(1, targets.clone().reshape([n, 1]))
                .reshape([n])
        };
        let grads = (out.clone() * weights.clone()).sum().backward();
        (out, h.grad(&grads).unwrap(), w.grad(&grads).unwrap())
    };
    let (out_f, dh_f, dw_f) = run(true);
    let (out_c, dh_c, dw_c) = run(false);
    assert_close(out_f, out_c, 1e-4, "log-probs");
    assert_close(dh_f, dh_c, 1e-4, "d hidden");
    // Summed over n rows: the float noise grows with them.
    assert_close(dw_f, dw_c, 1e-4 * (n as f32 / 37.0).sqrt().max(1.0), "d weight");
}

#[test]
fn token_logprobs_padding_target_is_zero_with_no_gradient() {
    let device = Device::flex().autodiff();
    let hidden = Tensor::<2>::from_floats([[1.0, -2.0], [0.5, 0.25]], &device).require_grad();
    let weight = Tensor::<2>::from_floats([[0.1, 0.2, 0.3], [0.3, -0.2, 0.1]], &device);
    let targets = Tensor::<1, Int>::from_ints([-100, 1], &device);
    let out = fused_token_logprobs(hidden.clone(), weight, targets);
    let values: Vec<f32> = out.clone().into_data().try_to_vec::<f32>().unwrap();
    assert_eq!(values[0], 0.0);
    assert!(values[1] < 0.0);
    let grad: Vec<f32> = hidden
        .grad(&out.sum().backward())
        .unwrap()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    assert_eq!(&grad[..2], &[0.0, 0.0]);
    assert!(grad[2..].iter().any(|&g| g != 0.0));
}

/// Burn's own attention on full-size (repeated) KV heads, the path autodiff used before.
fn composed_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Option<Tensor<4, Bool>>) -> Tensor<4> {
    let [b, heads, s, _] = q.dims();
    let [_, kv, keys, dim] = k.dims();
    let repeat = |x: Tensor<4>| {
        x.unsqueeze_dim::<5>(2)
            .expand([b, kv, heads / kv, keys, dim])
            .reshape([b, heads, keys, dim])
    };
    let options = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: mask.is_none(),
    };
    let mask = mask.map(|m| m.expand([b, heads, s, keys]));
    attention(q, repeat(k), repeat(v), mask, None, options)
}

fn check_attention(
    b: usize,
    heads: usize,
    kv: usize,
    s: usize,
    keys: usize,
    dim: usize,
    mask: Option<Vec<bool>>,
) {
    let device = Device::flex().autodiff();
    device.seed((b * 7 + heads + keys) as u64);
    let q = normal([b, heads, s, dim], &device);
    let k = normal([b, kv, keys, dim], &device);
    let v = normal([b, kv, keys, dim], &device);
    let weights = normal([b, heads, s, dim], &device);
    let mask = mask.map(|m| Tensor::<4, Bool>::from_data(TensorData::new(m, [b, 1, s, keys]), &device));

    let run = |fused: bool| {
        let (q, k, v) = (
            q.clone().detach().require_grad(),
            k.clone().detach().require_grad(),
            v.clone().detach().require_grad(),
        );
        let out = if fused {
            fused_attention(q.clone(), k.clone(), v.clone(), mask.as_ref())
        } else {
            composed_attention(q.clone(), k.clone(), v.clone(), mask.clone())
        };
        let grads = (out.clone() * weights.clone()).sum().backward();
        (
            out,
            q.grad(&grads).unwrap(),
            k.grad(&grads).unwrap(),
            v.grad(&grads).unwrap(),
        )
    };
    let (o_f, dq_f, dk_f, dv_f) = run(true);
    let (o_c, dq_c, dk_c, dv_c) = run(false);
    assert_close(o_f, o_c, 1e-4, "attention output");
    assert_close(dq_f, dq_c, 1e-4, "dq");
    assert_close(dk_f, dk_c, 1e-4, "dk");
    assert_close(dv_f, dv_c, 1e-4, "dv");
}

#[test]
fn causal_attention_matches_composed_ops() {
    // Multi-head, grouped-query (2 query heads per KV head) and multi-query.
    check_attention(2, 4, 4, 9, 9, 8, None);
    check_attention(3, 4, 2, 7, 7, 16, None);
    check_attention(1, 6, 1, 5, 5, 4, None);
}

#[test]
fn causal_attention_with_more_keys_than_queries_aligns_to_the_last_key() {
    check_attention(2, 4, 2, 3, 8, 8, None);
}

#[test]
fn masked_attention_matches_composed_ops() {
    // Left padding: row 0 starts at key 3, row 1 at key 0; each query sees itself.
    let (b, s) = (2, 6);
    let starts = [3, 0];
    let mut mask = Vec::new();
    for start in starts {
        for q in 0..s {
            mask.extend((0..s).map(|k| k > q || (k < start && k != q)));
        }
    }
    assert!(b * s * s == mask.len());
    check_attention(b, 4, 2, s, s, 8, Some(mask));
}

#[test]
fn swiglu_values_and_gradients_match_composed_ops() {
    use aligner_parallel::fused_swiglu;
    use burn::tensor::activation::silu;
    let device = Device::flex().autodiff();
    device.seed(5);
    // Larger than one parallel chunk, with a ragged end; values reach the exp clamp.
    let shape = [3, 7001, 3];
    let gate = normal(shape, &device) * 6.0;
    let up = normal(shape, &device);
    let weights = normal(shape, &device);
    let run = |fused: bool| {
        let (g, u) = (
            gate.clone().detach().require_grad(),
            up.clone().detach().require_grad(),
        );
        let out = if fused {
            fused_swiglu(g.clone(), u.clone())
        } else {
            silu(g.clone()) * u.clone()
        };
        let grads = (out.clone() * weights.clone()).sum().backward();
        (out, g.grad(&grads).unwrap(), u.grad(&grads).unwrap())
    };
    let (o_f, dg_f, du_f) = run(true);
    let (o_c, dg_c, du_c) = run(false);
    assert_close(o_f, o_c, 1e-4, "swiglu");
    assert_close(dg_f, dg_c, 1e-4, "d gate");
    assert_close(du_f, du_c, 1e-4, "d up");
}

#[test]
fn rms_norm_values_and_gradients_match_burn() {
    use aligner_parallel::fused_rms_norm;
    use burn::nn::RmsNormConfig;
    let device = Device::flex().autodiff();
    device.seed(9);
    // 37 features: two 16-lane blocks and a ragged end; rows span several parallel tasks.
    let shape = [4, 1100, 37];
    let x = normal(shape, &device) * 3.0;
    let gamma = normal([37], &device);
    let weights = normal(shape, &device);
    let run = |fused: bool| {
        let x = x.clone().detach().require_grad();
        let g = gamma.clone().detach().require_grad();
        let out = if fused {
            fused_rms_norm(x.clone(), g.clone(), 1e-5)
        } else {
            let mut norm = RmsNormConfig::new(37).with_epsilon(1e-5).init(&device);
            norm.gamma = burn::module::Param::from_tensor(g.clone());
            norm.forward(x.clone())
        };
        let grads = (out.clone() * weights.clone()).sum().backward();
        let dg = if fused { g.grad(&grads) } else { None };
        (out, x.grad(&grads).unwrap(), dg)
    };
    let (o_f, dx_f, dg_f) = run(true);
    let (o_c, dx_c, _) = run(false);
    assert_close(o_f, o_c, 1e-4, "rms norm");
    assert_close(dx_f, dx_c, 1e-4, "dx");
    // d gamma = Σ over rows of dy · x̂, from the composed normalisation.
    let x_hat = {
        let x = x.clone().detach();
        let rms = (x.clone().square().mean_dim(2) + 1e-5).sqrt();
        x / rms
    };
    let dg_want = (weights.detach() * x_hat).sum_dim(0).sum_dim(1).reshape([37]);
    assert_close(dg_f.unwrap(), dg_want, 2e-2, "d gamma (sum over 4400 rows)");
}
