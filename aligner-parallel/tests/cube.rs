//! aligner's CubeCL kernels on a wgpu device (Mesa's lavapipe in CI) against the same maths
//! composed from Burn ops on that device: values, and gradients of a random weighting of the
//! outputs with respect to every input, on ragged shapes (row widths below, between and above
//! the kernels' 128 units per row) and with padding targets.
//!
//! Run with `cargo test -p aligner-parallel --features wgpu --test cube` (or `--features cuda`;
//! `ALIGNER_TEST_DEVICE=cuda:0`, `wgpu` or `wgpu:cpu` picks the device).

use aligner_parallel::{
    cube_kernels_available, fused_available, fused_rms_norm, fused_rope, fused_swiglu, fused_token_logprobs,
};
use burn::tensor::activation::{log_softmax, silu};
use burn::tensor::{Device, Distribution, Int, Tensor};

/// The device under test, as autodiff: `ALIGNER_TEST_DEVICE`, else wgpu's default adapter
/// (in a build with `wgpu`), else CUDA device 0.
fn gpu() -> Device {
    let name = std::env::var("ALIGNER_TEST_DEVICE").unwrap_or_default();
    let device = match name.as_str() {
        #[cfg(feature = "wgpu")]
        "" | "wgpu" => Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "wgpu")]
        "wgpu:cpu" => Device::wgpu(burn::tensor::DeviceKind::Cpu),
        #[cfg(feature = "cuda")]
        cuda if cuda.is_empty() || cuda.starts_with("cuda") => Device::cuda(
            cuda.strip_prefix("cuda:")
                .and_then(|i| i.parse::<usize>().ok())
                .unwrap_or(0),
        ),
        other => panic!("ALIGNER_TEST_DEVICE={other:?} is not a device of this build"),
    };
    device.autodiff()
}

fn normal<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 values")
}

fn assert_close<const D: usize>(got: Tensor<D>, want: Tensor<D>, tol: f32, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let (g, w) = (values(got), values(want));
    let worst = g
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= tol, "{what}: max |difference| {worst} (tolerance {tol})");
}

/// The same tensor on the GPU and on the CPU, from one set of values.
fn both<const D: usize>(shape: [usize; D], gpu: &Device) -> (Tensor<D>, Tensor<D>) {
    let cpu = normal(shape, &Device::flex().autodiff());
    (Tensor::from_data(cpu.to_data(), gpu), cpu)
}

#[test]
fn kernels_are_chosen_on_cube_devices_only() {
    let device = gpu();
    assert!(cube_kernels_available(&device));
    assert!(!fused_available(&device));
    assert!(!cube_kernels_available(&Device::flex()));
}

#[test]
fn swiglu_values_and_gradients_match_composed_ops() {
    let device = gpu();
    device.seed(3);
    let gate = normal([3, 5, 37], &device);
    let up = normal([3, 5, 37], &device);
    let weights = normal([3, 5, 37], &device);
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
        (
            out,
            g.grad(&grads).expect("gate grad"),
            u.grad(&grads).expect("up grad"),
        )
    };
    let (out_k, dg_k, du_k) = run(true);
    let (out_c, dg_c, du_c) = run(false);
    assert_close(out_k, out_c, 1e-5, "swiglu");
    assert_close(dg_k, dg_c, 1e-4, "d gate");
    assert_close(du_k, du_c, 1e-4, "d up");
}

#[test]
fn rope_values_and_gradients_match_composed_ops() {
    let device = gpu();
    device.seed(7);
    // Angles per sequence, and one set shared by the batch.
    for angle_batch in [2, 1] {
        let x = normal([2, 3, 5, 8], &device);
        let angles = normal([angle_batch, 1, 5, 8], &device);
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        let weights = normal([2, 3, 5, 8], &device);
        let run = |fused: bool| {
            let xs = x.clone().detach().require_grad();
            let out = if fused {
                fused_rope(xs.clone(), cos.clone(), sin.clone())
            } else {
                let first = xs.clone().narrow(3, 0, 4);
                let second = xs.clone().narrow(3, 4, 4);
                xs.clone() * cos.clone() + Tensor::cat(vec![second.neg(), first], 3) * sin.clone()
            };
            let grads = (out.clone() * weights.clone()).sum().backward();
            (out, xs.grad(&grads).expect("x grad"))
        };
        let (out_k, dx_k) = run(true);
        let (out_c, dx_c) = run(false);
        assert_close(out_k, out_c, 1e-5, &format!("rope, angle batch {angle_batch}"));
        assert_close(dx_k, dx_c, 1e-5, &format!("d x, angle batch {angle_batch}"));
    }
}

#[test]
fn rms_norm_values_and_gradients_match_composed_ops() {
    let device = gpu();
    device.seed(5);
    // Widths below, at and above the 128 units each row's cube has.
    for width in [48, 128, 301] {
        let x = normal([2, 7, width], &device);
        let gamma = normal([width], &device);
        let weights = normal([2, 7, width], &device);
        let eps = 1e-5;
        let run = |fused: bool| {
            let (xs, g) = (
                x.clone().detach().require_grad(),
                gamma.clone().detach().require_grad(),
            );
            let out = if fused {
                fused_rms_norm(xs.clone(), g.clone(), eps)
            } else {
                let ms = xs.clone().powi_scalar(2).mean_dim(2);
                xs.clone() / (ms + eps).sqrt() * g.clone().reshape([1, 1, width])
            };
            let grads = (out.clone() * weights.clone()).sum().backward();
            (
                out,
                xs.grad(&grads).expect("x grad"),
                g.grad(&grads).expect("gamma grad"),
            )
        };
        let (out_k, dx_k, dg_k) = run(true);
        let (out_c, dx_c, dg_c) = run(false);
        assert_close(out_k, out_c, 1e-5, &format!("rms norm, width {width}"));
        assert_close(dx_k, dx_c, 1e-4, &format!("d x, width {width}"));
        assert_close(dg_k, dg_c, 1e-4, &format!("d gamma, width {width}"));
    }
}

#[test]
fn token_logprobs_values_and_gradients_match_composed_ops() {
    let device = gpu();
    device.seed(11);
    // A vocabulary that is not a multiple of the 128 units, one row a padding target.
    let (n, d, v) = (37, 16, 301);
    let hidden = normal([n, d], &device);
    let weight = normal([d, v], &device);
    let mut ids: Vec<i64> = (0..n as i64).map(|i| (i * 37 + 11) % v as i64).collect();
    ids[4] = -100;
    let targets = Tensor::<1, Int>::from_data(burn::tensor::TensorData::new(ids.clone(), [n]), &device);
    let weights = normal([n], &device);
    let kept = Tensor::<1>::from_data(
        burn::tensor::TensorData::new(
            ids.iter().map(|&t| if t < 0 { 0.0f32 } else { 1.0 }).collect(),
            [n],
        ),
        &device,
    );
    let safe = targets.clone().clamp_min(0);
    let run = |fused: bool| {
        let (h, w) = (
            hidden.clone().detach().require_grad(),
            weight.clone().detach().require_grad(),
        );
        let out = if fused {
            fused_token_logprobs(h.clone(), w.clone(), targets.clone())
        } else {
            log_softmax(h.clone().matmul(w.clone()), 1)
                .gather(1, safe.clone().reshape([n, 1]))
                .reshape([n])
                * kept.clone()
        };
        let grads = (out.clone() * weights.clone()).sum().backward();
        (
            out,
            h.grad(&grads).expect("hidden grad"),
            w.grad(&grads).expect("weight grad"),
        )
    };
    let (out_k, dh_k, dw_k) = run(true);
    let (out_c, dh_c, dw_c) = run(false);
    assert_eq!(values(out_k.clone())[4], 0.0, "a padding target scores 0");
    assert_close(out_k, out_c, 1e-4, "log-probs");
    assert_close(dh_k, dh_c, 1e-4, "d hidden");
    assert_close(dw_k, dw_c, 1e-4, "d weight");
}

#[test]
fn kernels_on_the_gpu_match_the_cpu_fused_ops() {
    let device = gpu();
    let (x_g, x_c) = both([4, 9, 64], &device);
    let (gamma_g, gamma_c) = both([64], &device);
    let on = |x: Tensor<3>, gamma: Tensor<1>| {
        let x = x.require_grad();
        let y = fused_rms_norm(x.clone(), gamma, 1e-6);
        let grads = (y.clone() * y.clone()).sum().backward();
        let dx = x.grad(&grads).expect("x grad");
        (values(y), values(dx))
    };
    let (y_g, dx_g) = on(x_g, gamma_g);
    let (y_c, dx_c) = on(x_c, gamma_c);
    let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
    assert!(
        worst(&y_g, &y_c) < 1e-5,
        "rms norm values, gpu vs cpu: {}",
        worst(&y_g, &y_c)
    );
    assert!(
        worst(&dx_g, &dx_c) < 1e-4,
        "rms norm grads, gpu vs cpu: {}",
        worst(&dx_g, &dx_c)
    );
}

/// The kernels in half precision as the model runs them under `model.dtype = "f16"`: f32
/// leaves (the master weights) cast to f16 at use, the kernel in f16 with f32 reductions, the
/// gradients cast back to the f32 leaves. Values and gradients equal the f32 composed ops
/// within f16's rounding (relative to each tensor's scale), and the token log-probs come out
/// in f32.
#[test]
fn kernels_in_f16_match_the_f32_composed_ops() {
    use burn::tensor::FloatDType;
    let device = gpu();
    if !device.supports_dtype(FloatDType::F16) {
        panic!("this device has no f16 (lavapipe and every CUDA GPU do)");
    }
    device.seed(23);
    let half = |t: Tensor<2>| t.cast(FloatDType::F16);
    let close = |got: Tensor<2>, want: Tensor<2>, what: &str| {
        let scale = values(want.clone())
            .iter()
            .fold(0.0f32, |m, v| m.max(v.abs()))
            .max(1e-3);
        assert_close(got.cast(FloatDType::F32), want, 4e-3 * scale, what);
    };
    // Leaves in f32; `fused` runs the kernel on their f16 casts.
    let (rows, width, vocab) = (37, 96, 301);
    let x = normal([rows, width], &device);
    let gamma = normal([1, width], &device);
    let w = normal([width, vocab], &device).mul_scalar(0.1);
    let up = normal([rows, width], &device);
    let mut ids: Vec<i64> = (0..rows as i64).map(|i| (i * 53 + 7) % vocab as i64).collect();
    ids[3] = -100;
    let targets = Tensor::<1, Int>::from_data(burn::tensor::TensorData::new(ids.clone(), [rows]), &device);
    let kept = Tensor::<2>::from_data(
        burn::tensor::TensorData::new(
            ids.iter().map(|&t| f32::from(t >= 0)).collect::<Vec<_>>(),
            [rows, 1],
        ),
        &device,
    );
    let weights = normal([rows, 1], &device);
    let run = |fused: bool| {
        let leaves = [x.clone(), gamma.clone(), w.clone(), up.clone()].map(|t| t.detach().require_grad());
        let [xs, g, ws, us] = leaves.clone();
        let (normed, gated, logprobs) = if fused {
            let normed = fused_rms_norm(half(xs).unsqueeze_dim::<3>(0), half(g).reshape([width]), 1e-5)
                .reshape([rows, width]);
            let gated = fused_swiglu(normed.clone().unsqueeze_dim::<3>(0), half(us).unsqueeze_dim(0))
                .reshape([rows, width]);
            let logprobs = fused_token_logprobs(gated.clone(), half(ws), targets.clone()).reshape([rows, 1]);
            assert_eq!(logprobs.dtype(), burn::tensor::DType::F32, "log-probs in f32");
            (normed, gated, logprobs)
        } else {
            let ms = xs.clone().powi_scalar(2).mean_dim(1);
            let normed = xs / (ms + 1e-5).sqrt() * g;
            let gated = silu(normed.clone()) * us;
            let safe = targets.clone().clamp_min(0).reshape([rows, 1]);
            let logprobs = log_softmax(gated.clone().matmul(ws), 1).gather(1, safe) * kept.clone();
            (normed, gated, logprobs)
        };
        let grads = (logprobs.clone() * weights.clone()).sum().backward();
        let [dx, dg, dw, du] = leaves.map(|t| t.grad(&grads).expect("a leaf's gradient"));
        (normed, gated, logprobs, [dx, dg, dw, du])
    };
    let (n_k, g_k, l_k, d_k) = run(true);
    let (n_c, g_c, l_c, d_c) = run(false);
    assert_eq!(values(l_k.clone())[3], 0.0, "a padding target scores 0");
    close(n_k, n_c, "rms norm in f16");
    close(g_k, g_c, "swiglu in f16");
    close(l_k, l_c, "token log-probs from f16");
    for ((got, want), name) in d_k
        .into_iter()
        .zip(d_c)
        .zip(["d x", "d gamma", "d weight", "d up"])
    {
        assert_eq!(
            got.dtype(),
            burn::tensor::DType::F32,
            "{name}: the master gradient is f32"
        );
        close(got, want, name);
    }
}

/// Attention composed from Burn ops: KV heads repeated, scores, `mask` (`true` = hidden) or
/// the causal rule aligned to the last key, softmax, values.
fn composed_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, burn::tensor::Bool>>,
) -> Tensor<4> {
    let [b, heads, s, d] = q.dims();
    let [_, kv, keys, _] = k.dims();
    let groups = heads / kv;
    let repeat = |t: Tensor<4>| {
        t.unsqueeze_dim::<5>(2)
            .expand([b, kv, groups, keys, d])
            .reshape([b, heads, keys, d])
    };
    let (k, v) = (repeat(k), repeat(v));
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(1.0 / (d as f32).sqrt());
    let hidden = match mask {
        Some(m) => m.expand([b, heads, s, keys]),
        None => {
            let rows: Vec<bool> = (0..s)
                .flat_map(|i| (0..keys).map(move |j| j + s > i + keys))
                .collect();
            Tensor::<4, burn::tensor::Bool>::from_data(
                burn::tensor::TensorData::new(rows, [1, 1, s, keys]),
                &scores.device(),
            )
            .expand([b, heads, s, keys])
        }
    };
    let scores = scores.mask_fill(hidden, -1.0e9);
    burn::tensor::activation::softmax(scores, 3).matmul(v)
}

/// The flash-attention kernels (forward, and the two backward kernels) against the composed
/// ops: GQA, head widths 8, 64 and 256 (narrower tiles), query rows fewer and more than a cube's 64 units, keys
/// across several 32-key tiles, causal prompts, a decode step (fewer queries than keys), and
/// left-padding masks (rows whose first keys are hidden).
#[test]
fn flash_attention_values_and_gradients_match_composed_ops() {
    use aligner_parallel::flash_attention;
    let device = gpu();
    device.seed(31);
    // (batch, heads, kv_heads, queries, keys, dim, masked)
    let cases = [
        (2, 4, 2, 5, 5, 8, false),
        (1, 2, 1, 70, 70, 16, false),
        (2, 4, 4, 3, 41, 8, false),
        (2, 6, 2, 33, 33, 64, true),
        (3, 2, 1, 1, 37, 8, true),
        // A head of 256: 15-key tiles.
        (1, 2, 1, 20, 40, 256, false),
    ];
    for (b, heads, kv, s, keys, d, masked) in cases {
        let what = format!("b {b} heads {heads}/{kv} queries {s} keys {keys} dim {d} masked {masked}");
        let q = normal([b, heads, s, d], &device);
        let k = normal([b, kv, keys, d], &device);
        let v = normal([b, kv, keys, d], &device);
        let weights = normal([b, heads, s, d], &device);
        // Row r hides its first 2r keys (left padding) but a query's own key (as the model's
        // padding queries keep theirs, so no row sees nothing), and keys after its own.
        let mask = masked.then(|| {
            let hidden: Vec<bool> = (0..b)
                .flat_map(|r| {
                    (0..s).flat_map(move |i| {
                        (0..keys).map(move |j| (j < 2 * r && j + s != i + keys) || j + s > i + keys)
                    })
                })
                .collect();
            Tensor::<4, burn::tensor::Bool>::from_data(
                burn::tensor::TensorData::new(hidden, [b, 1, s, keys]),
                &device,
            )
        });
        let run = |kernel: bool| {
            let [qs, ks, vs] = [q.clone(), k.clone(), v.clone()].map(|t| t.detach().require_grad());
            let out = if kernel {
                flash_attention(qs.clone(), ks.clone(), vs.clone(), mask.as_ref())
            } else {
                composed_attention(qs.clone(), ks.clone(), vs.clone(), mask.clone())
            };
            let grads = (out.clone() * weights.clone()).sum().backward();
            let grad = |t: &Tensor<4>| t.grad(&grads).expect("an input's gradient");
            (out.clone(), grad(&qs), grad(&ks), grad(&vs))
        };
        let (o_k, dq_k, dk_k, dv_k) = run(true);
        let (o_c, dq_c, dk_c, dv_c) = run(false);
        assert_close(o_k, o_c, 1e-5, &format!("attention, {what}"));
        assert_close(dq_k, dq_c, 1e-4, &format!("d q, {what}"));
        assert_close(dk_k, dk_c, 1e-4, &format!("d k, {what}"));
        assert_close(dv_k, dv_c, 1e-4, &format!("d v, {what}"));
    }
}

/// The sampling-weights kernel against the host's sort-based filters
/// ([`aligner_parallel::fused::filter`]) on the same logits: temperature alone, top-k (with
/// ties at the k-th logit), top-p (with ties at the threshold, which go in index order), both,
/// and a top-p small enough to keep one token; rows of −∞, vocabularies below, between and
/// above the kernel's 128 units, and logits in f16. The kept tokens are the same, their
/// weights within 1e-5.
#[test]
fn sampling_weights_match_the_host_filters() {
    use aligner_parallel::fused::filter::sampling_weights as host_weights;
    use aligner_parallel::fused::sampling_weights;
    use burn::tensor::{DType, TensorData};
    let device = gpu();
    let settings: [(f32, f32, f32); 8] = [
        (1.0, 0.0, 1.0),
        (0.7, 5.0, 1.0),
        (1.0, 0.0, 0.9),
        (1.4, 12.0, 0.6),
        (1.0, 1.0, 1.0),
        (1.0, 0.0, 0.001),
        (2.0, 3.0, 0.3),
        (1.0, 0.0, 0.5),
    ];
    for (vocab, half) in [
        (37, false),
        (128, false),
        (301, false),
        (1000, false),
        (301, true),
    ] {
        let rows = settings.len() * 2;
        let mut logits: Vec<f32> = values(normal([rows, vocab], &Device::flex()))
            .iter()
            .map(|x| x * 2.0)
            .collect();
        for r in 0..rows {
            for i in (r % 7..vocab).step_by(13) {
                // Ties: several tokens share a logit at the top of the row's range.
                logits[r * vocab + i] = 2.5;
            }
            for i in (3..vocab).step_by(29) {
                logits[r * vocab + i] = f32::NEG_INFINITY;
            }
        }
        // A row of equal logits, and a row with every token ruled out but one.
        logits[7 * vocab..8 * vocab].fill(0.5);
        logits[vocab..2 * vocab].fill(f32::NEG_INFINITY);
        logits[vocab + 4] = 1.0;
        if half {
            logits = logits
                .iter()
                .map(|&x| burn::tensor::f16::from_f32(x).to_f32())
                .collect();
        }
        // The whole batch's settings, then only temperatures (the kernel without its searches),
        // only top-k, and only top-p.
        let batches: [&dyn Fn(usize) -> (f32, f32, f32); 4] = [
            &|r| settings[r % settings.len()],
            &|r| (settings[r % settings.len()].0, 0.0, 1.0),
            &|r| (1.0, [3.0, 0.0, 12.0][r % 3], 1.0),
            &|r| (1.3, 0.0, [0.9, 1.0, 0.4][r % 3]),
        ];
        for (b, setting) in batches.iter().enumerate() {
            let params: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    let (inv_t, k, p) = setting(r);
                    [inv_t, k, p]
                })
                .collect();
            let expected = host_weights(&logits, &params, vocab);
            let mut on_gpu = Tensor::<2>::from_data(TensorData::new(logits.clone(), [rows, vocab]), &device);
            if half {
                on_gpu = on_gpu.cast(DType::F16);
            }
            let got = values(sampling_weights(on_gpu, &params));
            for r in 0..rows {
                let (g, e) = (
                    &got[r * vocab..(r + 1) * vocab],
                    &expected[r * vocab..(r + 1) * vocab],
                );
                let kept = |w: &[f32]| w.iter().map(|&x| x > 0.0).collect::<Vec<_>>();
                assert_eq!(
                    kept(g),
                    kept(e),
                    "vocab {vocab} batch {b} row {r} {:?}",
                    setting(r)
                );
                let worst = g.iter().zip(e).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(worst <= 1e-5, "vocab {vocab} batch {b} row {r}: {worst}");
            }
        }
    }
}
