//! One decoder block: attention and a gated MLP, each with a residual, and RMSNorms on the
//! blocks' inputs (Llama), outputs (OLMo 2) or both (Gemma).

use burn::module::Module;
use burn::nn::LinearConfig;
use burn::tensor::activation::{gelu_approximate, silu};
use burn::tensor::{Bool, Device, Tensor};

use super::attention::Attention;
use super::cache::LayerCache;
use super::lora::LoraLinear;
use super::moe::FeedForward;
use super::norm::RmsNorm;
use super::rope::RotaryAngles;
use crate::config::{Activation, LlamaConfig};

/// `down(act(gate(x)) ⊙ up(x))`: SwiGLU (`silu`), or GeGLU (Gemma's tanh-approximated GELU).
#[derive(Module, Debug)]
pub struct Mlp {
    /// `gate_proj` and `up_proj`, or Phi-3's one `gate_up_proj` (gate columns, then up).
    pub gate_up: Vec<LoraLinear>,
    pub down_proj: LoraLinear,
    #[module(skip)]
    pub activation: Activation,
}

impl Mlp {
    /// A gated MLP of hidden width `width` (`intermediate_size`, or an expert's width).
    pub fn new(config: &LlamaConfig, width: usize, device: &Device) -> Self {
        let (h, f, bias) = (config.hidden_size, width, config.mlp_bias());
        let proj =
            |d_in, d_out| LoraLinear::from(LinearConfig::new(d_in, d_out).with_bias(bias).init(device));
        let gate_up = if config.fused_projections() {
            vec![proj(h, 2 * f)]
        } else {
            vec![proj(h, f), proj(h, f)]
        };
        Self {
            gate_up,
            down_proj: proj(f, h),
            activation: config.activation().unwrap_or_default(),
        }
    }

    /// HF's names of [`Mlp::gate_up`]'s projections, in order.
    pub fn projection_names(&self) -> &'static [&'static str] {
        if self.gate_up.len() == 1 {
            &["gate_up_proj"]
        } else {
            &["gate_proj", "up_proj"]
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let (gate, up) = match self.gate_up.as_slice() {
            [fused] => {
                let y = fused.forward(x);
                let f = y.dims()[2] / 2;
                (y.clone().narrow(2, 0, f), y.narrow(2, f, f))
            }
            [gate, up] => (gate.forward(x.clone()), up.forward(x)),
            other => unreachable!("{} gate/up projections", other.len()),
        };
        let hidden = match self.activation {
            // Training on CPU, and on GPUs: one fused node instead of sigmoid, two products
            // and their backward.
            Activation::Silu if fused_here(&gate) => aligner_parallel::fused_swiglu(gate, up),
            Activation::Silu => silu(gate) * up,
            Activation::GeluTanh => gelu_approximate(gate) * up,
        };
        self.down_proj.forward(hidden)
    }
}

/// `x + out(attn(in(x)))`, then `x + out(mlp(in(x)))`, where each `in` / `out` norm may be
/// absent: Llama has the input norms only, OLMo 2 the output norms only, Gemma all four.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// HF's `input_layernorm`.
    pub attn_norm_in: Option<RmsNorm>,
    pub self_attn: Attention,
    /// OLMo 2's and Gemma's `post_attention_layernorm`.
    pub attn_norm_out: Option<RmsNorm>,
    /// Llama's `post_attention_layernorm`, Gemma's `pre_feedforward_layernorm`.
    pub mlp_norm_in: Option<RmsNorm>,
    /// A gated MLP, or (Mixtral, Qwen3-MoE) a mixture of experts.
    pub mlp: FeedForward,
    /// OLMo 2's and Gemma's `post_feedforward_layernorm`.
    pub mlp_norm_out: Option<RmsNorm>,
}

/// `norm.forward(x)`, as one fused node when training on CPU (Burn's is seven: casts, square,
/// mean, add, sqrt, div, mul).
pub fn norm(norm: &RmsNorm, x: Tensor<3>) -> Tensor<3> {
    norm_in_group(norm, x, None)
}

/// [`norm`] on a tensor group's block of heads (`group`: Qwen3's and Gemma 3's per-head
/// query/key norms under tensor parallel): the whole weight scales this rank's heads only,
/// so its gradient is summed over the group (Megatron's `f` on the weight).
pub fn norm_in_group(
    norm: &RmsNorm,
    x: Tensor<3>,
    group: Option<&aligner_parallel::tensor::Group>,
) -> Tensor<3> {
    let mut scale = norm.scale_for(&x);
    if let Some(group) = group {
        scale = aligner_parallel::tensor::tp_copy(scale, group);
    }
    if fused_here(&x) {
        let scale = super::as_type_of(scale, &x);
        aligner_parallel::fused_rms_norm(x, scale, norm.epsilon)
    } else {
        norm.forward_scaled(x, scale)
    }
}

/// `x` through `norm` when there is one.
fn maybe_norm(n: Option<&RmsNorm>, x: Tensor<3>) -> Tensor<3> {
    match n {
        Some(n) => norm(n, x),
        None => x,
    }
}

/// Whether `x`'s ops take the fused path: training on the CPU (its inference has its own
/// kernels in aligner-gen), and always on Cube devices (aligner's CubeCL kernels).
fn fused_here(x: &Tensor<3>) -> bool {
    let device = x.device();
    (x.is_autodiff() && aligner_parallel::fused_available(&device))
        || aligner_parallel::cube_kernels_available(&device)
}

/// An HF-style RMSNorm of width `d` for `config`'s family (Gemma's scale by `1 + w`).
pub fn rms_norm(config: &LlamaConfig, d: usize, device: &Device) -> RmsNorm {
    RmsNorm::new(d, config.rms_norm_eps, config.norm_unit_offset(), device)
}

impl DecoderLayer {
    /// Layer `index` of a model built for `config`.
    pub fn new(config: &LlamaConfig, index: usize, device: &Device) -> Self {
        let placement = config.norm_placement();
        let norm = |present: bool| present.then(|| rms_norm(config, config.hidden_size, device));
        Self {
            attn_norm_in: norm(placement.before),
            self_attn: Attention::new(config, index, device),
            attn_norm_out: norm(placement.after),
            mlp_norm_in: norm(placement.before),
            mlp: FeedForward::new(config, index, device),
            mlp_norm_out: norm(placement.after),
        }
    }

    /// HF's names (`model.layers.N.<name>.weight`) of the norms in field order (attention's
    /// input and output, the MLP's input and output): the MLP's input norm is
    /// `post_attention_layernorm` unless attention has an output norm of that name (Gemma's
    /// `pre_feedforward_layernorm`).
    pub fn norm_names(&self) -> [&'static str; 4] {
        let mlp_in = if self.attn_norm_out.is_some() {
            "pre_feedforward_layernorm"
        } else {
            "post_attention_layernorm"
        };
        [
            "input_layernorm",
            "post_attention_layernorm",
            mlp_in,
            "post_feedforward_layernorm",
        ]
    }

    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &RotaryAngles,
        mask: Option<&Tensor<4, Bool>>,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let h = maybe_norm(self.attn_norm_in.as_ref(), x.clone());
        let h = self.self_attn.forward(h, rope, mask, cache);
        let x = x + maybe_norm(self.attn_norm_out.as_ref(), h);
        let h = maybe_norm(self.mlp_norm_in.as_ref(), x.clone());
        let h = self.mlp.forward(h);
        x + maybe_norm(self.mlp_norm_out.as_ref(), h)
    }
}
