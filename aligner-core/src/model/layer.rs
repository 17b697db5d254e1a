//! One pre-norm decoder block: attention and a SwiGLU MLP, each with a residual.

use burn::module::Module;
use burn::nn::{LinearConfig, RmsNorm, RmsNormConfig};
use burn::tensor::activation::silu;
use burn::tensor::{Bool, Device, Tensor};

use super::attention::Attention;
use super::cache::LayerCache;
use super::lora::LoraLinear;
use super::rope::RotaryAngles;
use crate::config::LlamaConfig;

/// `down(silu(gate(x)) ⊙ up(x))`.
#[derive(Module, Debug)]
pub struct Mlp {
    pub gate_proj: LoraLinear,
    pub up_proj: LoraLinear,
    pub down_proj: LoraLinear,
}

impl Mlp {
    pub fn new(config: &LlamaConfig, device: &Device) -> Self {
        let (h, f, bias) = (config.hidden_size, config.intermediate_size, config.mlp_bias());
        let proj =
            |d_in, d_out| LoraLinear::from(LinearConfig::new(d_in, d_out).with_bias(bias).init(device));
        Self {
            gate_proj: proj(h, f),
            up_proj: proj(h, f),
            down_proj: proj(f, h),
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let gate = self.gate_proj.forward(x.clone());
        let up = self.up_proj.forward(x);
        // Training on CPU, and on GPUs: one fused node instead of sigmoid, two products and
        // their backward.
        let hidden = if fused_here(&gate) {
            aligner_parallel::fused_swiglu(gate, up)
        } else {
            silu(gate) * up
        };
        self.down_proj.forward(hidden)
    }
}

/// `x + attn(norm(x))`, then `x + mlp(norm(x))`; OLMo 2: `x + norm(attn(x))`, then
/// `x + norm(mlp(x))`.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// The norm before attention; `None` in OLMo 2, which normalises outputs instead.
    pub input_layernorm: Option<RmsNorm>,
    pub self_attn: Attention,
    /// The norm before the MLP; in OLMo 2 the norm of attention's output.
    pub post_attention_layernorm: RmsNorm,
    /// OLMo 2: the norm of the MLP's output.
    pub post_feedforward_layernorm: Option<RmsNorm>,
    pub mlp: Mlp,
}

/// `norm.forward(x)`, as one fused node when training on CPU (Burn's is seven: casts, square,
/// mean, add, sqrt, div, mul).
pub fn norm(norm: &RmsNorm, x: Tensor<3>) -> Tensor<3> {
    if fused_here(&x) {
        let gamma = super::as_type_of(norm.gamma.val(), &x);
        aligner_parallel::fused_rms_norm(x, gamma, norm.epsilon)
    } else {
        norm.forward(x)
    }
}

/// Whether `x`'s ops take the fused path: training on the CPU (its inference has its own
/// kernels in aligner-gen), and always on Cube devices (aligner's CubeCL kernels).
fn fused_here(x: &Tensor<3>) -> bool {
    let device = x.device();
    (x.is_autodiff() && aligner_parallel::fused_available(&device))
        || aligner_parallel::cube_kernels_available(&device)
}

/// An HF-style RMSNorm (`x · rsqrt(mean(x²) + ε) · w`) of width `d`.
pub fn rms_norm(d: usize, eps: f64, device: &Device) -> RmsNorm {
    RmsNormConfig::new(d).with_epsilon(eps).init(device)
}

impl DecoderLayer {
    /// Layer `index` of a model built for `config`.
    pub fn new(config: &LlamaConfig, index: usize, device: &Device) -> Self {
        let norm = || rms_norm(config.hidden_size, config.rms_norm_eps, device);
        let after = config.norms_after();
        Self {
            input_layernorm: (!after).then(norm),
            self_attn: Attention::new(config, index, device),
            post_attention_layernorm: norm(),
            post_feedforward_layernorm: after.then(norm),
            mlp: Mlp::new(config, device),
        }
    }

    /// Whether the norms sit on the blocks' outputs (OLMo 2) rather than their inputs.
    pub fn norms_after(&self) -> bool {
        self.input_layernorm.is_none()
    }

    /// The attention block's norm and the MLP block's: `input_layernorm` and
    /// `post_attention_layernorm` on their inputs, or (OLMo 2) `post_attention_layernorm` and
    /// `post_feedforward_layernorm` on their outputs. Every forward pass (this one, the engine's
    /// host kernels) reads them here.
    pub fn block_norms(&self) -> (&RmsNorm, &RmsNorm) {
        match (&self.input_layernorm, &self.post_feedforward_layernorm) {
            (Some(pre), _) => (pre, &self.post_attention_layernorm),
            (None, Some(post)) => (&self.post_attention_layernorm, post),
            // Not built by `new`: one norm left, it serves both blocks.
            (None, None) => (&self.post_attention_layernorm, &self.post_attention_layernorm),
        }
    }

    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RotaryAngles,
        mask: Option<&Tensor<4, Bool>>,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let (attn_norm, mlp_norm) = self.block_norms();
        if self.norms_after() {
            let attn = self.self_attn.forward(x.clone(), rope, mask, cache);
            let x = x + norm(attn_norm, attn);
            let mlp = self.mlp.forward(x.clone());
            x + norm(mlp_norm, mlp)
        } else {
            let x = x.clone() + self.self_attn.forward(norm(attn_norm, x), rope, mask, cache);
            let mlp = self.mlp.forward(norm(mlp_norm, x.clone()));
            x + mlp
        }
    }
}
