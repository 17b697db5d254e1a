//! The model configuration, mirroring Hugging Face's `config.json` for Llama-family models.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{CoreError, Result};

/// The floating-point type a model computes in (`model.dtype`): f32 everywhere, or half
/// precision on GPU backends — weights and activations in bf16 / f16, with the trained
/// weights kept in f32 (the optimizer's master copy) and the kernels' reductions in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    #[serde(alias = "float32")]
    F32,
    #[serde(alias = "bfloat16")]
    Bf16,
    #[serde(alias = "float16")]
    F16,
}

impl Precision {
    /// Burn's float type of this precision.
    pub fn float_dtype(self) -> burn::tensor::FloatDType {
        use burn::tensor::FloatDType;
        match self {
            Precision::F32 => FloatDType::F32,
            Precision::Bf16 => FloatDType::BF16,
            Precision::F16 => FloatDType::F16,
        }
    }

    /// HF's `torch_dtype` name.
    pub fn torch_dtype(self) -> &'static str {
        match self {
            Precision::F32 => "float32",
            Precision::Bf16 => "bfloat16",
            Precision::F16 => "float16",
        }
    }

    /// The `model.dtype` spelling.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// Whether `device` can compute in this precision: f32 everywhere; half precision on GPU
    /// backends that have the type (the CPU computes in f32; wgpu's WGSL has f16 where the
    /// adapter offers `shader-f16`, and no bf16).
    pub fn check_device(self, device: &burn::tensor::Device) -> std::result::Result<(), String> {
        if self == Precision::F32 {
            return Ok(());
        }
        if aligner_parallel::fused_available(device) {
            return Err(format!(
                "model.dtype = \"{}\": the CPU computes in f32; half precision needs a GPU device \
                 (--device cuda, or wgpu with f16)",
                self.name()
            ));
        }
        if !device.supports_dtype(self.float_dtype()) {
            return Err(format!(
                "model.dtype = \"{}\": device {device:?} has no {} arithmetic (wgpu offers f16 where \
                 the adapter has shader-f16, and no bf16; CUDA has both)",
                self.name(),
                self.torch_dtype()
            ));
        }
        Ok(())
    }
}

/// Model types whose checkpoints share the Llama decoder layout (Qwen3 adds an RMSNorm per
/// query and key head; OLMo 2 normalises the attention's and the MLP's outputs instead of their
/// inputs, and the whole query and key projections; Mistral, Qwen2 and Qwen3 may attend over a
/// sliding window; Gemma 2 and 3 scale the embeddings, normalise both the inputs and the outputs
/// of attention and MLP with `(1 + w)` weights, use GeGLU, a query pre-scale, soft-capping
/// (Gemma 2) and q/k norms with separate local and global RoPE (Gemma 3); Phi-3 fuses the q/k/v
/// and the gate/up projections and may rotate part of each head, with LongRoPE; Mixtral and
/// Qwen3-MoE replace the MLP by a mixture of experts, see [`MoeSpec`]).
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "olmo2",
    "gemma2",
    "gemma3_text",
    "phi3",
    "mixtral",
    "qwen3_moe",
];

/// A mixture-of-experts feed-forward block as the config describes it (Mixtral's
/// `block_sparse_moe`, Qwen3-MoE's sparse `mlp`): a linear router over `experts`, each token
/// sent to its `top_k` most probable experts, their outputs summed with the router's
/// probabilities (renormalised over the chosen `top_k` when `normalize_top_k`).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    pub experts: usize,
    pub top_k: usize,
    /// Renormalise the chosen experts' probabilities (Mixtral always; Qwen3-MoE's
    /// `norm_topk_prob`).
    pub normalize_top_k: bool,
    /// Each expert's hidden width (Mixtral's `intermediate_size`, Qwen3-MoE's
    /// `moe_intermediate_size`).
    pub expert_width: usize,
    /// Which layers are sparse (Qwen3-MoE's `decoder_sparse_step` and `mlp_only_layers`; the
    /// others keep a dense MLP of `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    /// The load-balancing loss added in training, times `router_aux_loss_coef`, as transformers
    /// adds it: only with `output_router_logits`.
    pub aux_loss_coef: Option<f64>,
}

/// The MLP's gate activation (`hidden_act`; Gemma's `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    #[default]
    Silu,
    /// GeGLU with the tanh approximation (`gelu_pytorch_tanh`): Gemma.
    GeluTanh,
}

/// Where a decoder block's RMSNorms sit: on the input of attention and of the MLP (Llama), on
/// their outputs before the residual add (OLMo 2), or both (Gemma).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormPlacement {
    pub before: bool,
    pub after: bool,
}

/// Where an RMSNorm sits on the queries and keys, before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head (`head_dim` weights): Qwen3.
    PerHead,
    /// Over the whole projection (`heads · head_dim` weights): OLMo 2.
    Whole,
}

/// How rotary frequencies are rescaled for long contexts (HF's `rope_scaling` /
/// `rope_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Phi-3's LongRoPE (`longrope`, formerly `su`): each frequency divided by its own factor,
    /// `short_factor` while a forward pass's positions stay within
    /// `original_max_position_embeddings`, `long_factor` past it; cos and sin multiplied by
    /// `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

/// A Llama-family decoder configuration.
///
/// Field names are HF's. Unknown fields of the file are kept in [`LlamaConfig::extra`] and
/// written back on save, so a round trip through aligner loses nothing transformers needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaConfig {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architectures: Option<Vec<String>>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_bias: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<u32>,
    /// Every other key of the file, written back unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
    /// What models built from this configuration compute in (`model.dtype`; not a key of
    /// the file: a bf16 checkpoint loads into f32 unless the run asks for half precision).
    #[serde(skip)]
    pub precision: Precision,
}

fn default_model_type() -> String {
    "llama".into()
}
fn default_max_positions() -> usize {
    2048
}
fn default_eps() -> f64 {
    1e-6
}

impl LlamaConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| CoreError::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// Parses and validates a `config.json` text; `path` only names the source in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let config: Self = serde_json::from_str(text).map_err(|source| CoreError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        config.validate(path)?;
        Ok(config)
    }

    /// A small Llama config with the given sizes, for tests and random models.
    pub fn llama(
        vocab: usize,
        hidden: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        ffn: usize,
    ) -> Self {
        Self {
            model_type: "llama".into(),
            architectures: Some(vec!["LlamaForCausalLM".into()]),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: ffn,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: Some(kv_heads),
            head_dim: None,
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-5,
            rope_theta: Some(10000.0),
            rope_scaling: None,
            rope_parameters: None,
            hidden_act: None,
            tie_word_embeddings: Some(false),
            attention_bias: Some(false),
            mlp_bias: Some(false),
            bos_token_id: Some(1),
            eos_token_id: Some(Value::from(2)),
            pad_token_id: None,
            extra: Map::new(),
            precision: Precision::F32,
        }
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let err = |message: String| CoreError::Config {
            path: path.to_path_buf(),
            message,
        };
        if !SUPPORTED_MODEL_TYPES.contains(&self.model_type.as_str()) {
            return Err(CoreError::UnsupportedArchitecture(self.model_type.clone()));
        }
        if let Some(archs) = &self.architectures
            && let Some(bad) = archs.iter().find(|a| !is_supported_architecture(a))
        {
            return Err(CoreError::UnsupportedArchitecture(bad.clone()));
        }
        self.activation().map_err(err)?;
        for (key, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if value == 0 {
                return Err(err(format!("{key} must be positive")));
            }
        }
        let kv = self.num_kv_heads();
        if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
            return Err(err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({kv})",
                self.num_attention_heads
            )));
        }
        if self.head_dim.is_none()
            && self.family_head_dim().is_none()
            && !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(err(format!(
                "hidden_size ({}) is not divisible by num_attention_heads ({}) and no head_dim is given",
                self.hidden_size, self.num_attention_heads
            )));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(err(format!(
                "head_dim ({}) must be even for rotary embeddings",
                self.head_dim()
            )));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(err(format!(
                "rms_norm_eps must be a finite number above 0, got {}",
                self.rms_norm_eps
            )));
        }
        self.rope_theta_value().map_err(err)?;
        self.rotary_dim().map_err(err)?;
        self.rope_scaling_kind().map_err(err)?;
        self.local_rope().map_err(err)?;
        self.attention_windows().map_err(err)?;
        self.attention_scale().map_err(err)?;
        self.attention_softcap().map_err(err)?;
        self.final_softcap().map_err(err)?;
        self.moe().map_err(err)?;
        if let Some(key) = self.unimplemented_key() {
            return Err(err(format!(
                "{key} = {} asks for computation aligner does not implement for {:?} models; \
                 refusing rather than computing another model",
                self.extra[key], self.model_type
            )));
        }
        Ok(())
    }

    /// The first key of the file that changes what the model computes in a way aligner does
    /// not implement for this family (soft-capping, a query pre-scale or local RoPE outside
    /// Gemma, partial rotary dimensions, experts, bidirectional attention).
    fn unimplemented_key(&self) -> Option<&'static str> {
        const NEUTRAL: &[(&str, Option<f64>)] = &[
            ("attn_logit_softcapping", None),
            ("final_logit_softcapping", None),
            ("query_pre_attn_scalar", None),
            ("rope_local_base_freq", None),
            ("partial_rotary_factor", Some(1.0)),
            ("num_local_experts", Some(0.0)),
            ("num_experts", Some(0.0)),
            // Mixtral's multiplicative noise on the router's input in training.
            ("router_jitter_noise", Some(0.0)),
        ];
        // Gemma computes these (Gemma 3 keeps `attn_logit_softcapping` in its config but
        // transformers does not apply it, nor does aligner).
        const GEMMA: &[&str] = &[
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "query_pre_attn_scalar",
            "rope_local_base_freq",
        ];
        let bidirectional = self
            .extra
            .get("use_bidirectional_attention")
            .is_some_and(|v| v.as_bool() == Some(true));
        if bidirectional {
            return Some("use_bidirectional_attention");
        }
        NEUTRAL.iter().find_map(|&(key, neutral)| {
            if self.is_gemma() && GEMMA.contains(&key) {
                return None;
            }
            if self.model_type == "phi3" && key == "partial_rotary_factor" {
                return None;
            }
            if self.is_moe() && matches!(key, "num_local_experts" | "num_experts") {
                return None;
            }
            let value = self.extra.get(key)?;
            let harmless = value.is_null() || neutral.is_some_and(|n| value.as_f64() == Some(n));
            (!harmless).then_some(key)
        })
    }

    /// Phi-3's fused projections: `qkv_proj` (queries, keys, values in turn) and `gate_up_proj`
    /// (gate, then up).
    pub fn fused_projections(&self) -> bool {
        self.model_type == "phi3"
    }

    /// The leading dimensions of each head that RoPE rotates: `head_dim · partial_rotary_factor`
    /// (Phi-3's key, at the top level or in `rope_parameters`), the whole head elsewhere.
    pub fn rotary_dim(&self) -> Result<usize, String> {
        let head_dim = self.head_dim();
        if self.model_type != "phi3" {
            return Ok(head_dim);
        }
        let factor = self
            .rope_dict(false)
            .and_then(|p| p.get("partial_rotary_factor"))
            .or_else(|| self.extra.get("partial_rotary_factor"))
            .filter(|v| !v.is_null());
        let factor = match factor {
            None => 1.0,
            Some(v) => v
                .as_f64()
                .filter(|f| *f > 0.0 && *f <= 1.0)
                .ok_or_else(|| format!("partial_rotary_factor must be in (0, 1], got {v}"))?,
        };
        // transformers truncates, as Python's int() does.
        let dim = (head_dim as f64 * factor) as usize;
        if dim < 2 || !dim.is_multiple_of(2) {
            return Err(format!(
                "partial_rotary_factor {factor} of head_dim {head_dim} rotates {dim} dimensions: \
                 RoPE needs an even number"
            ));
        }
        Ok(dim)
    }

    /// A sequence classifier (`*ForSequenceClassification`): a reward, value or attribute
    /// model's folder, with a trained `score` head.
    pub fn is_sequence_classifier(&self) -> bool {
        self.architectures
            .as_ref()
            .is_some_and(|a| a.iter().any(|n| n.ends_with("ForSequenceClassification")))
    }

    /// Mixtral or Qwen3-MoE: a mixture of experts in place of (some) MLPs.
    pub fn is_moe(&self) -> bool {
        matches!(self.model_type.as_str(), "mixtral" | "qwen3_moe")
    }

    /// The mixture of experts, as transformers reads it, or `None` for a dense model.
    pub fn moe(&self) -> Result<Option<MoeSpec>, String> {
        if !self.is_moe() {
            return Ok(None);
        }
        let mixtral = self.model_type == "mixtral";
        let count = |key: &str, default: u64| -> Result<usize, String> {
            match self.extra.get(key) {
                None | Some(Value::Null) => Ok(default as usize),
                Some(v) => v
                    .as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| format!("{key} must be a non-negative integer, got {v}")),
            }
        };
        let flag = |key: &str, default: bool| -> Result<bool, String> {
            match self.extra.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| format!("{key} must be true or false, got {v}")),
            }
        };
        let layers = self.num_hidden_layers;
        let (experts, top_k) = if mixtral {
            (count("num_local_experts", 8)?, count("num_experts_per_tok", 2)?)
        } else {
            // transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
            let experts = match self.extra.get("num_experts") {
                None | Some(Value::Null) => count("num_local_experts", 128)?,
                Some(_) => count("num_experts", 128)?,
            };
            (experts, count("num_experts_per_tok", 8)?)
        };
        if experts == 0 {
            let key = if mixtral {
                "num_local_experts"
            } else {
                "num_experts"
            };
            return Err(format!("{key} must be positive"));
        }
        if top_k == 0 || top_k > experts {
            return Err(format!(
                "num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({experts})"
            ));
        }
        let (expert_width, sparse_layers, normalize_top_k) = if mixtral {
            (self.intermediate_size, vec![true; layers], true)
        } else {
            let width = count("moe_intermediate_size", 768)?;
            if width == 0 {
                return Err("moe_intermediate_size must be positive".into());
            }
            let step = count("decoder_sparse_step", 1)?;
            if step == 0 {
                return Err("decoder_sparse_step must be positive".into());
            }
            let dense: Vec<usize> = match self.extra.get("mlp_only_layers") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| {
                        v.as_u64()
                            .map(|i| i as usize)
                            .filter(|&i| i < layers)
                            .ok_or_else(|| {
                                format!("mlp_only_layers entry {v} is not a layer index below {layers}")
                            })
                    })
                    .collect::<Result<_, _>>()?,
                Some(v) => return Err(format!("mlp_only_layers must be a list, got {v}")),
            };
            let sparse = (0..layers)
                .map(|i| !dense.contains(&i) && (i + 1).is_multiple_of(step))
                .collect();
            (width, sparse, flag("norm_topk_prob", false)?)
        };
        let coef = match self.extra.get("router_aux_loss_coef") {
            None | Some(Value::Null) => 0.001,
            Some(v) => v
                .as_f64()
                .filter(|c| c.is_finite() && *c >= 0.0)
                .ok_or_else(|| format!("router_aux_loss_coef must be a number >= 0, got {v}"))?,
        };
        let aux_loss_coef = flag("output_router_logits", false)?.then_some(coef);
        Ok(Some(MoeSpec {
            experts,
            top_k,
            normalize_top_k,
            expert_width,
            sparse_layers,
            aux_loss_coef,
        }))
    }

    /// Gemma 2 or Gemma 3 (text).
    pub fn is_gemma(&self) -> bool {
        matches!(self.model_type.as_str(), "gemma2" | "gemma3_text")
    }

    /// The RMSNorm on the queries and keys before RoPE (`q_norm`, `k_norm`).
    pub fn qk_norm(&self) -> QkNorm {
        match self.model_type.as_str() {
            "qwen3" | "qwen3_moe" | "gemma3_text" => QkNorm::PerHead,
            "olmo2" => QkNorm::Whole,
            _ => QkNorm::None,
        }
    }

    /// Where the blocks' norms sit: inputs (Llama), outputs (OLMo 2's
    /// `post_attention_layernorm` / `post_feedforward_layernorm`), or both (Gemma's four).
    pub fn norm_placement(&self) -> NormPlacement {
        match self.model_type.as_str() {
            "olmo2" => NormPlacement {
                before: false,
                after: true,
            },
            "gemma2" | "gemma3_text" => NormPlacement {
                before: true,
                after: true,
            },
            _ => NormPlacement {
                before: true,
                after: false,
            },
        }
    }

    /// Whether RMSNorm scales by `1 + w` (Gemma; the file stores `w`) rather than `w`.
    pub fn norm_unit_offset(&self) -> bool {
        self.is_gemma()
    }

    /// The factor on the token embeddings: `√hidden_size` in Gemma (in f32, as transformers
    /// casts it to the weights' type).
    pub fn embedding_scale(&self) -> Option<f64> {
        self.is_gemma().then(|| (self.hidden_size as f64).sqrt())
    }

    /// The MLP's activation: `hidden_act` (default `silu`), or Gemma's `hidden_activation`
    /// (default `gelu_pytorch_tanh`).
    pub fn activation(&self) -> Result<Activation, String> {
        let (key, name) = if self.is_gemma() {
            let name = self
                .extra
                .get("hidden_activation")
                .and_then(Value::as_str)
                .or(self.hidden_act.as_deref())
                .unwrap_or("gelu_pytorch_tanh");
            ("hidden_activation", name)
        } else {
            ("hidden_act", self.hidden_act.as_deref().unwrap_or("silu"))
        };
        match name {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu_pytorch_tanh" => Ok(Activation::GeluTanh),
            other => Err(format!(
                "{key} {other:?} is not supported (\"silu\", \"gelu_pytorch_tanh\")"
            )),
        }
    }

    /// The attention's score scale: `query_pre_attn_scalar^-½` in Gemma (default 256),
    /// `head_dim^-½` elsewhere.
    pub fn attention_scale(&self) -> Result<f64, String> {
        if !self.is_gemma() {
            return Ok(1.0 / (self.head_dim() as f64).sqrt());
        }
        match self.extra.get("query_pre_attn_scalar") {
            None | Some(Value::Null) => Ok(1.0 / 16.0),
            Some(v) => match v.as_f64() {
                Some(s) if s > 0.0 => Ok(1.0 / s.sqrt()),
                _ => Err(format!(
                    "query_pre_attn_scalar must be a positive number, got {v}"
                )),
            },
        }
    }

    /// `cap · tanh(x / cap)` on the attention scores (Gemma 2's `attn_logit_softcapping`,
    /// default 50; `null` turns it off).
    pub fn attention_softcap(&self) -> Result<Option<f64>, String> {
        match self.model_type.as_str() {
            "gemma2" => self.softcap("attn_logit_softcapping", Some(50.0)),
            _ => Ok(None),
        }
    }

    /// `cap · tanh(x / cap)` on the output logits (`final_logit_softcapping`: Gemma 2's default
    /// 30, Gemma 3's none).
    pub fn final_softcap(&self) -> Result<Option<f64>, String> {
        match self.model_type.as_str() {
            "gemma2" => self.softcap("final_logit_softcapping", Some(30.0)),
            "gemma3_text" => self.softcap("final_logit_softcapping", None),
            _ => Ok(None),
        }
    }

    fn softcap(&self, key: &str, default: Option<f64>) -> Result<Option<f64>, String> {
        match self.extra.get(key) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(cap) if cap > 0.0 && cap.is_finite() => Ok(Some(cap)),
                _ => Err(format!("{key} must be a positive number or null, got {v}")),
            },
        }
    }

    /// Each layer's sliding attention window, as transformers reads it: `None` attends to every
    /// earlier token; `Some(w)` lets a query see itself and the `w - 1` keys before it.
    ///
    /// - `layer_types` (transformers ≥ 4.53 writes it): `"sliding_attention"` layers use
    ///   `sliding_window`, `"full_attention"` layers do not.
    /// - Mistral: `sliding_window` on every layer (absent: transformers' default 4096; `null`:
    ///   none).
    /// - Qwen2 / Qwen3: only with `use_sliding_window`, on layers from `max_window_layers` on.
    /// - Llama has no sliding window (transformers ignores the key there too).
    pub fn attention_windows(&self) -> Result<Vec<Option<usize>>, String> {
        let layers = self.num_hidden_layers;
        // Gemma's default window (transformers' config default).
        let family_window = self.is_gemma().then_some(4096);
        let window = |default: Option<usize>| -> Result<Option<usize>, String> {
            match self.extra.get("sliding_window") {
                None => Ok(default),
                Some(Value::Null) => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(w) if w > 0 => Ok(Some(w as usize)),
                    _ => Err(format!(
                        "sliding_window must be a positive integer or null, got {v}"
                    )),
                },
            }
        };
        if let Some(types) = self.extra.get("layer_types").filter(|v| !v.is_null()) {
            let types = types
                .as_array()
                .ok_or_else(|| format!("layer_types must be a list, got {types}"))?;
            if types.len() != layers {
                return Err(format!(
                    "layer_types has {} entries for num_hidden_layers = {layers}",
                    types.len()
                ));
            }
            let sliding = window(family_window)?;
            return types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(None),
                    Some("sliding_attention") => sliding.map(Some).ok_or_else(|| {
                        "layer_types has \"sliding_attention\" layers but sliding_window is not set"
                            .to_string()
                    }),
                    _ => Err(format!(
                        "layer_types entry {t} is not supported (\"full_attention\", \"sliding_attention\")"
                    )),
                })
                .collect();
        }
        // Qwen's window: `sliding_window` (default 4096) only with `use_sliding_window`.
        let qwen_window = || -> Result<Option<usize>, String> {
            let enabled = self
                .extra
                .get("use_sliding_window")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            if enabled { window(Some(4096)) } else { Ok(None) }
        };
        match self.model_type.as_str() {
            "mistral" => Ok(vec![window(Some(4096))?; layers]),
            "qwen2" | "qwen3" => {
                let sliding = qwen_window()?;
                let first = match self.extra.get("max_window_layers") {
                    None | Some(Value::Null) => 28,
                    Some(v) => v
                        .as_u64()
                        .ok_or_else(|| format!("max_window_layers must be an integer, got {v}"))?
                        as usize,
                };
                Ok((0..layers).map(|i| sliding.filter(|_| i >= first)).collect())
            }
            // Gemma 2 alternates sliding and global layers; Gemma 3 makes every
            // `sliding_window_pattern`-th layer (default 6) global, the others sliding.
            "gemma2" | "gemma3_text" => {
                let every = if self.model_type == "gemma2" {
                    2
                } else {
                    match self
                        .extra
                        .get("sliding_window_pattern")
                        .or_else(|| self.extra.get("_sliding_window_pattern"))
                    {
                        None | Some(Value::Null) => 6,
                        Some(v) => v.as_u64().filter(|&p| p > 0).ok_or_else(|| {
                            format!("sliding_window_pattern must be a positive integer, got {v}")
                        })? as usize,
                    }
                };
                let sliding = window(family_window)?;
                Ok((0..layers)
                    .map(|i| sliding.filter(|_| !(i + 1).is_multiple_of(every)))
                    .collect())
            }
            // Phi-3 and Mixtral: `sliding_window` (default none) on every layer.
            "phi3" | "mixtral" => Ok(vec![window(None)?; layers]),
            // Qwen3-MoE: on every layer, with `use_sliding_window`.
            "qwen3_moe" => Ok(vec![qwen_window()?; layers]),
            _ => Ok(vec![None; layers]),
        }
    }

    /// Key/value heads (grouped-query attention); equals the query heads when absent.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// The attention shape one rank of a tensor group of `ranks` computes
    /// (`parallel.tensor`): its share of the query and key/value heads, each head as wide as
    /// before (what its KV cache holds).
    pub fn heads_of_tensor_rank(&self, ranks: usize) -> Self {
        let mut config = self.clone();
        let ranks = ranks.max(1);
        config.head_dim = Some(self.head_dim());
        config.num_attention_heads = self.num_attention_heads / ranks;
        config.num_key_value_heads = Some(self.num_kv_heads() / ranks);
        config
    }

    /// Per-head dimension: `head_dim` when given, else `hidden_size / num_attention_heads`
    /// (Qwen3's default is 128, independent of the hidden size, as transformers has it).
    pub fn head_dim(&self) -> usize {
        let default = self
            .family_head_dim()
            .unwrap_or(self.hidden_size / self.num_attention_heads);
        self.head_dim.unwrap_or(default)
    }

    /// transformers' default `head_dim` where it does not derive from the hidden size.
    fn family_head_dim(&self) -> Option<usize> {
        match self.model_type.as_str() {
            "qwen3" => Some(128),
            "gemma2" | "gemma3_text" => Some(256),
            _ => None,
        }
    }

    /// Output embeddings shared with the input embeddings. HF's default differs by model type
    /// (Gemma ties them).
    pub fn tied_embeddings(&self) -> bool {
        self.tie_word_embeddings.unwrap_or(self.is_gemma())
    }

    /// Biases on the q/k/v projections (Qwen2 always; Llama when `attention_bias`).
    pub fn qkv_bias(&self) -> bool {
        self.model_type == "qwen2" || self.attention_bias.unwrap_or(false)
    }

    /// Bias on the output projection (Llama's `attention_bias`; never in Qwen2).
    pub fn o_bias(&self) -> bool {
        self.model_type != "qwen2" && self.attention_bias.unwrap_or(false)
    }

    /// Biases on the MLP projections.
    pub fn mlp_bias(&self) -> bool {
        self.mlp_bias.unwrap_or(false)
    }

    /// End-of-sequence ids (HF allows one id or a list).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// `rope_theta` of the (global) layers, from the top level or from `rope_parameters`
    /// (transformers ≥ 4.56 / 5).
    pub fn rope_theta_value(&self) -> Result<f64, String> {
        self.rope_theta_of(false)
    }

    /// The rotary scaling of the (global) layers, from `rope_scaling` or `rope_parameters`.
    pub fn rope_scaling_kind(&self) -> Result<RopeScaling, String> {
        self.rope_scaling_of(false)
    }

    /// Gemma 3's RoPE of its sliding-window layers, base and scaling apart from the global
    /// layers' (`rope_parameters.sliding_attention`, or `rope_local_base_freq`, default 10000,
    /// unscaled); `None` where every layer shares one.
    pub fn local_rope(&self) -> Result<Option<(f64, RopeScaling)>, String> {
        if self.model_type != "gemma3_text" {
            return Ok(None);
        }
        Ok(Some((self.rope_theta_of(true)?, self.rope_scaling_of(true)?)))
    }

    /// The rotary settings of the global (`sliding == false`) or the local layers: Gemma 3
    /// keeps one dict per layer kind in `rope_parameters`; other families one for all layers
    /// (Gemma 3's older flat `rope_scaling` applies to its global layers only).
    fn rope_dict(&self, sliding: bool) -> Option<&Value> {
        let params = match (&self.rope_parameters, &self.rope_scaling) {
            (Some(p), _) if !p.is_null() => p,
            (_, Some(s)) if !s.is_null() => s,
            _ => return None,
        };
        let per_kind = params.get("full_attention").is_some() || params.get("sliding_attention").is_some();
        if per_kind {
            let kind = if sliding {
                "sliding_attention"
            } else {
                "full_attention"
            };
            return params.get(kind).filter(|v| v.is_object());
        }
        (!(sliding && self.model_type == "gemma3_text")).then_some(params)
    }

    fn rope_theta_of(&self, sliding: bool) -> Result<f64, String> {
        let nested = self
            .rope_dict(sliding)
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64);
        let top = if sliding {
            self.extra.get("rope_local_base_freq").and_then(Value::as_f64)
        } else {
            self.rope_theta
        };
        let family = match self.model_type.as_str() {
            "gemma3_text" | "mixtral" if !sliding => 1_000_000.0,
            _ => 10000.0,
        };
        let theta = nested.or(top).unwrap_or(family);
        if theta <= 0.0 {
            return Err(format!("rope_theta must be positive, got {theta}"));
        }
        Ok(theta)
    }

    fn rope_scaling_of(&self, sliding: bool) -> Result<RopeScaling, String> {
        let Some(params) = self.rope_dict(sliding) else {
            return Ok(RopeScaling::Default);
        };
        let kind = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let num = |key: &str| -> Result<f64, String> {
            params
                .get(key)
                .and_then(Value::as_f64)
                .ok_or_else(|| format!("rope scaling {kind:?} needs a numeric {key:?}"))
        };
        match kind {
            "default" => Ok(RopeScaling::Default),
            "linear" => Ok(RopeScaling::Linear {
                factor: num("factor")?,
            }),
            "llama3" => Ok(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
            }),
            "longrope" | "su" => self.longrope(params, kind),
            other => Err(format!(
                "rope scaling type {other:?} is not supported (default, linear, llama3, longrope)"
            )),
        }
    }

    /// LongRoPE's settings as transformers reads them: one short and one long factor per rotated
    /// frequency, `original_max_position_embeddings` from the dict or the top level, and the
    /// attention factor given or derived from `factor` (default `max_position_embeddings /
    /// original`) as `√(1 + ln factor / ln original)`.
    fn longrope(&self, params: &Value, kind: &str) -> Result<RopeScaling, String> {
        let half = self.rotary_dim()? / 2;
        let factors = |key: &str| -> Result<Vec<f64>, String> {
            let list = params
                .get(key)
                .and_then(Value::as_array)
                .ok_or_else(|| format!("rope scaling {kind:?} needs a list {key:?}"))?;
            let values: Option<Vec<f64>> = list.iter().map(Value::as_f64).collect();
            match values {
                Some(v) if v.len() == half && v.iter().all(|f| *f > 0.0) => Ok(v),
                _ => Err(format!(
                    "rope scaling {key:?} must hold {half} positive numbers (one per rotated frequency), got {}",
                    Value::Array(list.clone())
                )),
            }
        };
        let original = params
            .get("original_max_position_embeddings")
            .or_else(|| self.extra.get("original_max_position_embeddings"))
            .and_then(Value::as_u64)
            .filter(|&n| n > 1)
            .ok_or_else(|| {
                format!("rope scaling {kind:?} needs original_max_position_embeddings (above 1)")
            })? as usize;
        let attention_factor = match params.get("attention_factor").and_then(Value::as_f64) {
            Some(f) => f,
            None => {
                let factor = params
                    .get("factor")
                    .and_then(Value::as_f64)
                    .unwrap_or(self.max_position_embeddings as f64 / original as f64);
                if factor <= 1.0 {
                    1.0
                } else {
                    (1.0 + factor.ln() / (original as f64).ln()).sqrt()
                }
            }
        };
        Ok(RopeScaling::LongRope {
            short_factor: factors("short_factor")?,
            long_factor: factors("long_factor")?,
            original_max_position_embeddings: original,
            attention_factor,
        })
    }

    /// Writes the configuration as pretty JSON.
    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(self).expect("a config always serialises")
    }
}

fn is_supported_architecture(arch: &str) -> bool {
    const KNOWN: &[&str] = &[
        "LlamaForCausalLM",
        "LlamaForSequenceClassification",
        "LlamaModel",
        "Qwen2ForCausalLM",
        "Qwen2ForSequenceClassification",
        "Qwen2Model",
        "MistralForCausalLM",
        "MistralForSequenceClassification",
        "MistralModel",
        "Qwen3ForCausalLM",
        "Qwen3ForSequenceClassification",
        "Qwen3Model",
        "Olmo2ForCausalLM",
        "Olmo2ForSequenceClassification",
        "Olmo2Model",
        "Gemma2ForCausalLM",
        "Gemma2ForSequenceClassification",
        "Gemma2Model",
        "Gemma3ForCausalLM",
        "Gemma3TextForSequenceClassification",
        "Gemma3TextModel",
        "Phi3ForCausalLM",
        "Phi3ForSequenceClassification",
        "Phi3Model",
        "MixtralForCausalLM",
        "MixtralForSequenceClassification",
        "MixtralModel",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeForSequenceClassification",
        "Qwen3MoeModel",
    ];
    KNOWN.contains(&arch)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<LlamaConfig> {
        LlamaConfig::from_json_str(text, Path::new("config.json"))
    }

    #[test]
    fn llama_with_rope_theta_and_defaults() {
        let c = parse(
            r#"{"model_type":"llama","vocab_size":512,"hidden_size":64,"intermediate_size":172,
            "num_hidden_layers":5,"num_attention_heads":8,"num_key_value_heads":4,"rope_theta":500000.0,
            "tie_word_embeddings":true,"eos_token_id":2,"torch_dtype":"float32"}"#,
        )
        .unwrap();
        assert_eq!(c.head_dim(), 8);
        assert_eq!(c.num_kv_heads(), 4);
        assert_eq!(c.rope_theta_value().unwrap(), 500000.0);
        assert_eq!(c.rope_scaling_kind().unwrap(), RopeScaling::Default);
        assert!(c.tied_embeddings());
        assert!(!c.qkv_bias());
        assert_eq!(c.eos_token_ids(), vec![2]);
        assert_eq!(c.extra.get("torch_dtype"), Some(&Value::from("float32")));
    }

    #[test]
    fn llama3_rope_scaling_in_both_layouts() {
        let old = parse(
            r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,
            "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192},
            "eos_token_id":[128001,128009]}"#,
        )
        .unwrap();
        let new = parse(
            r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,
            "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        )
        .unwrap();
        let expected = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        assert_eq!(old.rope_scaling_kind().unwrap(), expected);
        assert_eq!(new.rope_scaling_kind().unwrap(), expected);
        assert_eq!(new.rope_theta_value().unwrap(), 500000.0);
        assert_eq!(old.eos_token_ids(), vec![128001, 128009]);
    }

    #[test]
    fn qwen2_has_qkv_bias_but_no_o_bias() {
        let c = parse(
            r#"{"model_type":"qwen2","architectures":["Qwen2ForCausalLM"],"vocab_size":10,"hidden_size":8,
            "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1}"#,
        )
        .unwrap();
        assert!(c.qkv_bias());
        assert!(!c.o_bias());
    }

    #[test]
    fn explicit_head_dim_wins() {
        let c = parse(
            r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"head_dim":16}"#,
        )
        .unwrap();
        assert_eq!(c.head_dim(), 16);
    }

    #[test]
    fn bad_configs_are_named_errors() {
        let gpt2 = parse(
            r#"{"model_type":"gpt2","vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2}"#,
        );
        assert!(matches!(gpt2, Err(CoreError::UnsupportedArchitecture(t)) if t == "gpt2"));
        let heads = parse(
            r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":3,"num_key_value_heads":2}"#,
        );
        assert!(heads.unwrap_err().to_string().contains("num_key_value_heads"));
        let yarn = parse(
            r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"rope_scaling":{"rope_type":"yarn","factor":2.0}}"#,
        );
        assert!(yarn.unwrap_err().to_string().contains("yarn"));
        // A key whose computation is not implemented is named, never ignored.
        let capped = parse(
            r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"attn_logit_softcapping":50.0}"#,
        );
        assert!(capped.unwrap_err().to_string().contains("attn_logit_softcapping"));
        let partial = parse(
            r#"{"model_type":"qwen3","vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"partial_rotary_factor":0.5}"#,
        );
        assert!(partial.unwrap_err().to_string().contains("partial_rotary_factor"));
        let neutral = parse(
            r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"final_logit_softcapping":null,"partial_rotary_factor":1.0}"#,
        );
        assert!(neutral.is_ok());
        let missing = parse(r#"{"hidden_size":8}"#);
        assert!(missing.unwrap_err().to_string().contains("vocab_size"));
    }

    #[test]
    fn sliding_windows_per_layer_as_transformers_reads_them() {
        let base = r#""vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":3,"num_attention_heads":2"#;
        let windows =
            |extra: &str| parse(&format!("{{{base}{extra}}}")).map(|c| c.attention_windows().unwrap());
        // Mistral: every layer; transformers' default 4096 when the key is absent; null: none.
        assert_eq!(
            windows(r#","model_type":"mistral","sliding_window":12"#).unwrap(),
            vec![Some(12); 3]
        );
        assert_eq!(
            windows(r#","model_type":"mistral""#).unwrap(),
            vec![Some(4096); 3]
        );
        assert_eq!(
            windows(r#","model_type":"mistral","sliding_window":null"#).unwrap(),
            vec![None; 3]
        );
        // Qwen2/3: only when enabled, from max_window_layers on.
        assert_eq!(
            windows(r#","model_type":"qwen2","sliding_window":12"#).unwrap(),
            vec![None; 3]
        );
        assert_eq!(
            windows(
                r#","model_type":"qwen3","sliding_window":12,"use_sliding_window":true,"max_window_layers":1"#
            )
            .unwrap(),
            vec![None, Some(12), Some(12)]
        );
        // layer_types wins; Llama has none.
        assert_eq!(
            windows(r#","model_type":"mistral","sliding_window":5,"layer_types":["sliding_attention","full_attention","sliding_attention"]"#).unwrap(),
            vec![Some(5), None, Some(5)]
        );
        assert_eq!(windows(r#","sliding_window":12"#).unwrap(), vec![None; 3]);
        // Bad values name the key.
        let bad = windows(
            r#","model_type":"mistral","layer_types":["chunked_attention","full_attention","full_attention"]"#,
        );
        assert!(bad.unwrap_err().to_string().contains("layer_types"));
        let bad = windows(r#","model_type":"mistral","sliding_window":-3"#);
        assert!(bad.unwrap_err().to_string().contains("sliding_window"));
    }

    #[test]
    fn qwen3_has_qk_norms_and_its_own_head_dim_default() {
        let c = parse(
            r#"{"model_type":"qwen3","architectures":["Qwen3ForCausalLM"],"vocab_size":10,"hidden_size":8,
            "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":3,"num_key_value_heads":1}"#,
        )
        .unwrap();
        assert!(c.qk_norm() == QkNorm::PerHead && !c.qkv_bias() && !c.o_bias());
        assert_eq!(c.head_dim(), 128);
    }

    #[test]
    fn gemma_defaults_and_layer_patterns_as_transformers_has_them() {
        let base = r#""vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":7,"num_attention_heads":2"#;
        let gemma2 = parse(&format!(r#"{{{base},"model_type":"gemma2"}}"#)).unwrap();
        assert_eq!(gemma2.head_dim(), 256);
        assert!(gemma2.tied_embeddings());
        assert_eq!(gemma2.activation().unwrap(), Activation::GeluTanh);
        assert_eq!(gemma2.attention_scale().unwrap(), 1.0 / 16.0);
        assert_eq!(gemma2.attention_softcap().unwrap(), Some(50.0));
        assert_eq!(gemma2.final_softcap().unwrap(), Some(30.0));
        assert_eq!(gemma2.embedding_scale(), Some(8f64.sqrt()));
        assert!(gemma2.norm_unit_offset() && gemma2.qk_norm() == QkNorm::None);
        assert_eq!(
            gemma2.norm_placement(),
            NormPlacement {
                before: true,
                after: true
            }
        );
        // Alternating, the first layer sliding; transformers' 4096-token default window.
        let w = Some(4096);
        assert_eq!(
            gemma2.attention_windows().unwrap(),
            vec![w, None, w, None, w, None, w]
        );
        assert!(gemma2.local_rope().unwrap().is_none());

        // Gemma 3 with an older config's flat keys: every 3rd layer global, rope_theta and
        // rope_scaling for the global layers, rope_local_base_freq for the others.
        let gemma3 = parse(&format!(
            r#"{{{base},"model_type":"gemma3_text","sliding_window":5,"sliding_window_pattern":3,
            "rope_theta":1000000.0,"rope_local_base_freq":10000.0,"rope_scaling":{{"rope_type":"linear","factor":8.0}},
            "query_pre_attn_scalar":64,"attn_logit_softcapping":null,"final_logit_softcapping":null}}"#
        ))
        .unwrap();
        assert_eq!(
            gemma3.attention_windows().unwrap(),
            vec![Some(5), Some(5), None, Some(5), Some(5), None, Some(5)]
        );
        assert_eq!(gemma3.rope_theta_value().unwrap(), 1_000_000.0);
        assert_eq!(
            gemma3.rope_scaling_kind().unwrap(),
            RopeScaling::Linear { factor: 8.0 }
        );
        assert_eq!(
            gemma3.local_rope().unwrap(),
            Some((10000.0, RopeScaling::Default))
        );
        assert_eq!(gemma3.attention_scale().unwrap(), 0.125);
        assert_eq!(gemma3.qk_norm(), QkNorm::PerHead);
        assert_eq!(gemma3.attention_softcap().unwrap(), None);
        assert_eq!(gemma3.final_softcap().unwrap(), None);

        // Refused by name: Gemma's keys on a Llama, bidirectional Gemma 3, a bad activation.
        let llama_scalar = parse(&format!(r#"{{{base},"query_pre_attn_scalar":64}}"#));
        assert!(
            llama_scalar
                .unwrap_err()
                .to_string()
                .contains("query_pre_attn_scalar")
        );
        let bidirectional = parse(&format!(
            r#"{{{base},"model_type":"gemma3_text","use_bidirectional_attention":true}}"#
        ));
        assert!(
            bidirectional
                .unwrap_err()
                .to_string()
                .contains("use_bidirectional_attention")
        );
        let act = parse(&format!(
            r#"{{{base},"model_type":"gemma2","hidden_activation":"relu"}}"#
        ));
        assert!(act.unwrap_err().to_string().contains("hidden_activation"));
        let cap = parse(&format!(
            r#"{{{base},"model_type":"gemma2","final_logit_softcapping":-1}}"#
        ));
        assert!(cap.unwrap_err().to_string().contains("final_logit_softcapping"));
    }

    #[test]
    fn phi3_partial_rotary_and_longrope_as_transformers_reads_them() {
        let base = r#""model_type":"phi3","vocab_size":10,"hidden_size":32,"intermediate_size":16,"num_hidden_layers":2,"num_attention_heads":4,"max_position_embeddings":128"#;
        let c = parse(&format!(
            r#"{{{base},"sliding_window":24,"rope_parameters":{{"rope_type":"longrope","rope_theta":10000.0,
            "partial_rotary_factor":0.5,"original_max_position_embeddings":32,"short_factor":[1.0,1.5],"long_factor":[3.0,7.0]}}}}"#
        ))
        .unwrap();
        assert!(c.fused_projections());
        assert_eq!(c.rotary_dim().unwrap(), 4);
        assert_eq!(c.attention_windows().unwrap(), vec![Some(24); 2]);
        // factor 128 / 32 = 4: attention factor √(1 + ln 4 / ln 32).
        let expected = RopeScaling::LongRope {
            short_factor: vec![1.0, 1.5],
            long_factor: vec![3.0, 7.0],
            original_max_position_embeddings: 32,
            attention_factor: (1.0 + 4f64.ln() / 32f64.ln()).sqrt(),
        };
        assert_eq!(c.rope_scaling_kind().unwrap(), expected);
        // Phi-3's older layout: `su`, the original length and the factor at the top level.
        let old = parse(&format!(
            r#"{{{base},"original_max_position_embeddings":32,"partial_rotary_factor":0.5,
            "rope_scaling":{{"type":"su","short_factor":[1.0,1.5],"long_factor":[3.0,7.0]}}}}"#
        ))
        .unwrap();
        assert_eq!(old.rope_scaling_kind().unwrap(), expected);
        assert_eq!(old.attention_windows().unwrap(), vec![None; 2]);
        // One factor per rotated frequency, named when wrong; an odd rotated width refused.
        let short = parse(&format!(
            r#"{{{base},"original_max_position_embeddings":32,"rope_scaling":{{"type":"longrope","short_factor":[1.0],"long_factor":[3.0,7.0,1.0,1.0]}}}}"#
        ));
        assert!(short.unwrap_err().to_string().contains("short_factor"));
        let odd = parse(&format!(r#"{{{base},"partial_rotary_factor":0.2}}"#));
        assert!(odd.unwrap_err().to_string().contains("partial_rotary_factor"));
    }

    #[test]
    fn experts_as_transformers_reads_them() {
        let base = r#""vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":4,"num_attention_heads":2"#;
        let mixtral = parse(&format!(r#"{{{base},"model_type":"mixtral"}}"#)).unwrap();
        let spec = mixtral.moe().unwrap().unwrap();
        // transformers' defaults: 8 experts, top-2, renormalised, on every layer; no aux loss
        // without output_router_logits; RoPE base 1e6.
        assert_eq!(
            (spec.experts, spec.top_k, spec.normalize_top_k, spec.expert_width),
            (8, 2, true, 16)
        );
        assert_eq!(spec.sparse_layers, vec![true; 4]);
        assert_eq!(spec.aux_loss_coef, None);
        assert_eq!(mixtral.rope_theta_value().unwrap(), 1e6);
        let qwen = parse(&format!(
            r#"{{{base},"model_type":"qwen3_moe","num_experts":6,"num_experts_per_tok":3,"moe_intermediate_size":4,
                "decoder_sparse_step":2,"mlp_only_layers":[3],"output_router_logits":true}}"#
        ))
        .unwrap();
        let spec = qwen.moe().unwrap().unwrap();
        assert_eq!(
            (spec.experts, spec.top_k, spec.normalize_top_k, spec.expert_width),
            (6, 3, false, 4)
        );
        // Every second layer is sparse, except those listed dense.
        assert_eq!(spec.sparse_layers, vec![false, true, false, false]);
        assert_eq!(spec.aux_loss_coef, Some(0.001));
        assert_eq!(qwen.qk_norm(), QkNorm::PerHead);
        // transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
        let renamed = parse(&format!(
            r#"{{{base},"model_type":"qwen3_moe","num_local_experts":5,"num_experts_per_tok":2}}"#
        ))
        .unwrap();
        assert_eq!(renamed.moe().unwrap().unwrap().experts, 5);
        assert!(
            parse(&format!(r#"{{{base},"model_type":"llama"}}"#))
                .unwrap()
                .moe()
                .unwrap()
                .is_none()
        );
        for (extra, key) in [
            (
                r#","model_type":"mixtral","num_experts_per_tok":9"#,
                "num_experts_per_tok",
            ),
            (
                r#","model_type":"mixtral","num_local_experts":0"#,
                "num_local_experts",
            ),
            (
                r#","model_type":"mixtral","router_jitter_noise":0.1"#,
                "router_jitter_noise",
            ),
            (
                r#","model_type":"qwen3_moe","num_experts":4,"num_experts_per_tok":2,"mlp_only_layers":[7]"#,
                "mlp_only_layers",
            ),
            (
                r#","model_type":"qwen3_moe","num_experts_per_tok":2,"decoder_sparse_step":0"#,
                "decoder_sparse_step",
            ),
            (
                r#","model_type":"qwen3_moe","num_experts_per_tok":2,"router_aux_loss_coef":-1"#,
                "router_aux_loss_coef",
            ),
            // Experts on a dense family are refused, not ignored.
            (
                r#","model_type":"llama","num_local_experts":4"#,
                "num_local_experts",
            ),
        ] {
            let err = parse(&format!("{{{base}{extra}}}")).unwrap_err().to_string();
            assert!(err.contains(key), "{extra}: {err}");
        }
    }

    #[test]
    fn unknown_keys_survive_a_round_trip() {
        let c = parse(r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"use_cache":true,"initializer_range":0.02}"#).unwrap();
        let again = parse(&c.to_json_string()).unwrap();
        assert_eq!(again.extra.get("use_cache"), Some(&Value::Bool(true)));
        assert_eq!(again.extra.get("initializer_range"), Some(&Value::from(0.02)));
    }
}
