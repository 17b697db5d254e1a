//! Rotary position embeddings exactly as Hugging Face applies them: `rotate_half` layout
//! (the two halves of each head are the real and imaginary parts), with `rope_theta`,
//! Llama-3 / linear / LongRoPE frequency scaling, and (Phi-3) only the leading
//! `partial_rotary_factor` of each head rotated.

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::config::{LlamaConfig, RopeScaling};

/// The rotary inverse frequencies of a model; angles are computed per forward pass from the
/// positions, as transformers does, so any position works.
#[derive(Module, Debug)]
pub struct Rope {
    inv_freq: Tensor<1>,
    /// LongRoPE: the frequencies of a forward pass whose positions reach past `original`.
    long_inv_freq: Option<Tensor<1>>,
    original: usize,
    /// LongRoPE's factor on cos and sin (1 otherwise).
    attention_factor: f64,
    max_positions: usize,
}

/// `cos` and `sin` of the angles of one forward pass, `[batch, 1, seq, rotary_dim]`.
#[derive(Debug, Clone)]
pub struct RotaryAngles {
    cos: Tensor<4>,
    sin: Tensor<4>,
}

/// Inverse frequencies `1 / theta^(2i/d)` of `d` rotated dimensions in float32, as
/// transformers computes them, after the configured scaling (LongRoPE: its short factors).
pub fn inverse_frequencies(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    let base = theta as f32;
    let plain: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    match *scaling {
        RopeScaling::LongRope { ref short_factor, .. } => longrope_frequencies(head_dim, base, short_factor),
        RopeScaling::Default => plain,
        RopeScaling::Linear { factor } => plain.iter().map(|f| f / factor as f32).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old_len = original_max_position_embeddings as f32;
            let (factor, low, high) = (factor as f32, low_freq_factor as f32, high_freq_factor as f32);
            let low_freq_wavelen = old_len / low;
            let high_freq_wavelen = old_len / high;
            plain
                .iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        let smooth = (old_len / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// LongRoPE's `1 / (factor_i · theta^(2i/d))`, in float32 as transformers has it.
fn longrope_frequencies(dim: usize, base: f32, factors: &[f64]) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| 1.0 / (factors[i] as f32 * base.powf((2 * i) as f32 / dim as f32)))
        .collect()
}

/// LongRoPE's frequencies past the original context (`long_factor`), its original length and
/// its factor on cos and sin; `None` for other scalings.
pub fn long_context_frequencies(
    dim: usize,
    theta: f64,
    scaling: &RopeScaling,
) -> Option<(Vec<f32>, usize, f64)> {
    match scaling {
        RopeScaling::LongRope {
            long_factor,
            original_max_position_embeddings,
            attention_factor,
            ..
        } => Some((
            longrope_frequencies(dim, theta as f32, long_factor),
            *original_max_position_embeddings,
            *attention_factor,
        )),
        _ => None,
    }
}

impl Rope {
    /// The RoPE of `config`'s (global) layers.
    pub fn new(config: &LlamaConfig, device: &Device) -> Self {
        let theta = config.rope_theta_value().unwrap_or(10000.0);
        let scaling = config.rope_scaling_kind().unwrap_or(RopeScaling::Default);
        Self::with(config, theta, &scaling, device)
    }

    /// Gemma 3's RoPE of its sliding-window layers (its own base and scaling); `None` where
    /// every layer shares [`Rope::new`]'s.
    pub fn local(config: &LlamaConfig, device: &Device) -> Option<Self> {
        let (theta, scaling) = config.local_rope().ok().flatten()?;
        Some(Self::with(config, theta, &scaling, device))
    }

    fn with(config: &LlamaConfig, theta: f64, scaling: &RopeScaling, device: &Device) -> Self {
        let dim = config.rotary_dim().unwrap_or(config.head_dim());
        let tensor = |values: Vec<f32>| Tensor::from_data(TensorData::new(values, [dim / 2]), device);
        let long = long_context_frequencies(dim, theta, scaling);
        Self {
            inv_freq: tensor(inverse_frequencies(dim, theta, scaling)),
            original: long.as_ref().map_or(usize::MAX, |l| l.1),
            attention_factor: long.as_ref().map_or(1.0, |l| l.2),
            long_inv_freq: long.map(|l| tensor(l.0)),
            max_positions: config.max_position_embeddings.max(1),
        }
    }

    /// The model's `max_position_embeddings` (positions beyond it still work, as in HF).
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Angles for `positions: [batch, seq]`: a float32 product of position and frequency, like
    /// transformers' float32 matmul, then cos/sin of it.
    ///
    /// LongRoPE picks its long factors when the pass's largest position reaches past the
    /// original context, as transformers does per forward call.
    pub fn angles(&self, positions: &Tensor<2, Int>) -> RotaryAngles {
        let [batch, seq] = positions.dims();
        let [half] = self.inv_freq.dims();
        let inv_freq = match &self.long_inv_freq {
            Some(long) if positions.clone().max().into_scalar::<i64>() + 1 > self.original as i64 => long,
            _ => &self.inv_freq,
        };
        let pos = positions.clone().float().reshape([batch, 1, seq, 1]);
        // The frequencies are a constant of the module, which Burn's `train()` puts on
        // autodiff without gradient checkpointing: in the positions' strategy they combine.
        let inv_freq = match (pos.gradient_checkpointing_strategy(), inv_freq.is_autodiff()) {
            (Some(strategy), true) => inv_freq.clone().with_gradient_checkpointing_strategy(strategy),
            _ => inv_freq.clone(),
        };
        let freqs = pos * inv_freq.reshape([1, 1, 1, half]);
        let both = Tensor::cat(vec![freqs.clone(), freqs], 3);
        let (cos, sin) = (both.clone().cos(), both.sin());
        if self.attention_factor == 1.0 {
            return RotaryAngles { cos, sin };
        }
        RotaryAngles {
            cos: cos.mul_scalar(self.attention_factor),
            sin: sin.mul_scalar(self.attention_factor),
        }
    }
}

impl RotaryAngles {
    /// Rotates `x: [batch, heads, seq, head_dim]`: `x·cos + rotate_half(x)·sin`, through the
    /// backend extension: one kernel each way on GPUs, Burn's slices, negation, concatenation
    /// and products (differentiable as they are) elsewhere.
    /// Under a partial rotary factor (Phi-3) only the leading `rotary_dim` dimensions turn;
    /// the rest pass through.
    pub fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        // In x's type, as transformers casts cos/sin to the activations' dtype.
        let cos = super::as_type_of(self.cos.clone(), &x);
        let sin = super::as_type_of(self.sin.clone(), &x);
        let (head_dim, rotary) = (x.dims()[3], cos.dims()[3]);
        if rotary == head_dim {
            return aligner_parallel::fused_rope(x, cos, sin);
        }
        let turned = aligner_parallel::fused_rope(x.clone().narrow(3, 0, rotary), cos, sin);
        Tensor::cat(vec![turned, x.narrow(3, rotary, head_dim - rotary)], 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_matches_transformers_formula() {
        // Values computed with transformers' `_compute_llama3_parameters` for head_dim 8,
        // theta 500000, factor 8, low 1, high 4, original 8192 — checked by hand here:
        // the highest frequency (wavelength 2π) is untouched, the lowest is divided by 8.
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = inverse_frequencies(8, 500000.0, &RopeScaling::Default);
        let scaled = inverse_frequencies(8, 500000.0, &scaling);
        assert_eq!(plain[0], 1.0);
        assert_eq!(scaled[0], 1.0);
        // wavelength of plain[3] = 2π / 500000^(-0.75) ≈ 117k > 8192 → low frequency, ÷ 8.
        assert!((scaled[3] - plain[3] / 8.0).abs() < 1e-12);
        // plain[2] = 500000^-0.5 ≈ 1.414e-3 → wavelength ≈ 4443, between 2048 and 8192: smoothed.
        let wavelen = 2.0 * std::f32::consts::PI / plain[2];
        let smooth = (8192.0 / wavelen - 1.0) / 3.0;
        let expected = (1.0 - smooth) * plain[2] / 8.0 + smooth * plain[2];
        assert!((scaled[2] - expected).abs() < 1e-9);
        assert!(scaled[2] < plain[2] && scaled[2] > plain[2] / 8.0);
    }

    #[test]
    fn linear_scaling_divides_every_frequency() {
        let plain = inverse_frequencies(16, 10000.0, &RopeScaling::Default);
        let scaled = inverse_frequencies(16, 10000.0, &RopeScaling::Linear { factor: 4.0 });
        for (p, s) in plain.iter().zip(&scaled) {
            assert!((p / 4.0 - s).abs() < 1e-12);
        }
    }

    #[test]
    fn position_zero_is_identity_and_rotation_keeps_norm() {
        let device = Device::flex();
        let config = LlamaConfig::llama(10, 16, 1, 2, 2, 8);
        let rope = Rope::new(&config, &device);
        let x = Tensor::<4>::from_data(
            TensorData::new((0..32).map(|v| v as f32 / 7.0).collect::<Vec<_>>(), [1, 1, 4, 8]),
            &device,
        );
        let positions = Tensor::<2, Int>::from_ints([[0, 1, 2, 300]], &device);
        let y = rope.angles(&positions).apply(x.clone());
        let x0: Vec<f32> = x.clone().narrow(2, 0, 1).into_data().try_to_vec().unwrap();
        let y0: Vec<f32> = y.clone().narrow(2, 0, 1).into_data().try_to_vec().unwrap();
        assert_eq!(x0, y0);
        let nx: Vec<f32> = x.square().sum_dim(3).into_data().try_to_vec().unwrap();
        let ny: Vec<f32> = y.square().sum_dim(3).into_data().try_to_vec().unwrap();
        for (a, b) in nx.iter().zip(&ny) {
            assert!((a - b).abs() < 1e-4 * a.max(1.0));
        }
    }
}
