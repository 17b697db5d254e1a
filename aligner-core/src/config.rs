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
/// sliding window).
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "qwen2", "qwen3", "mistral", "olmo2"];

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
    #[serde(default = "default_act")]
    pub hidden_act: String,
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
fn default_act() -> String {
    "silu".into()
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
            hidden_act: "silu".into(),
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
        if self.hidden_act != "silu" {
            return Err(err(format!(
                "hidden_act {:?} is not supported (only \"silu\")",
                self.hidden_act
            )));
        }
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
            && self.model_type != "qwen3"
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
        self.rope_scaling_kind().map_err(err)?;
        self.attention_windows().map_err(err)?;
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
    /// not implement (soft-capping, a query pre-scale, partial rotary dimensions, experts).
    fn unimplemented_key(&self) -> Option<&'static str> {
        const NEUTRAL: &[(&str, Option<f64>)] = &[
            ("attn_logit_softcapping", None),
            ("final_logit_softcapping", None),
            ("query_pre_attn_scalar", None),
            ("rope_local_base_freq", None),
            ("partial_rotary_factor", Some(1.0)),
            ("num_local_experts", Some(0.0)),
            ("num_experts", Some(0.0)),
        ];
        NEUTRAL.iter().find_map(|&(key, neutral)| {
            let value = self.extra.get(key)?;
            let harmless = value.is_null() || neutral.is_some_and(|n| value.as_f64() == Some(n));
            (!harmless).then_some(key)
        })
    }

    /// The RMSNorm on the queries and keys before RoPE (`q_norm`, `k_norm`).
    pub fn qk_norm(&self) -> QkNorm {
        match self.model_type.as_str() {
            "qwen3" => QkNorm::PerHead,
            "olmo2" => QkNorm::Whole,
            _ => QkNorm::None,
        }
    }

    /// Norms on the outputs of attention and MLP (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`) instead of on their inputs: OLMo 2.
    pub fn norms_after(&self) -> bool {
        self.model_type == "olmo2"
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
            let sliding = window(None)?;
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
        match self.model_type.as_str() {
            "mistral" => Ok(vec![window(Some(4096))?; layers]),
            "qwen2" | "qwen3" => {
                let enabled = self
                    .extra
                    .get("use_sliding_window")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let sliding = if enabled { window(Some(4096))? } else { None };
                let first = match self.extra.get("max_window_layers") {
                    None | Some(Value::Null) => 28,
                    Some(v) => v
                        .as_u64()
                        .ok_or_else(|| format!("max_window_layers must be an integer, got {v}"))?
                        as usize,
                };
                Ok((0..layers).map(|i| sliding.filter(|_| i >= first)).collect())
            }
            _ => Ok(vec![None; layers]),
        }
    }

    /// Key/value heads (grouped-query attention); equals the query heads when absent.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head dimension: `head_dim` when given, else `hidden_size / num_attention_heads`
    /// (Qwen3's default is 128, independent of the hidden size, as transformers has it).
    pub fn head_dim(&self) -> usize {
        let default = if self.model_type == "qwen3" {
            128
        } else {
            self.hidden_size / self.num_attention_heads
        };
        self.head_dim.unwrap_or(default)
    }

    /// Output embeddings shared with the input embeddings. HF's default differs by model type.
    pub fn tied_embeddings(&self) -> bool {
        self.tie_word_embeddings.unwrap_or(false)
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

    /// `rope_theta`, from the top level or from `rope_parameters` (transformers ≥ 4.56 / 5).
    pub fn rope_theta_value(&self) -> Result<f64, String> {
        let nested = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64);
        let theta = nested.or(self.rope_theta).unwrap_or(10000.0);
        if theta <= 0.0 {
            return Err(format!("rope_theta must be positive, got {theta}"));
        }
        Ok(theta)
    }

    /// The rotary scaling, from `rope_scaling` or `rope_parameters`.
    pub fn rope_scaling_kind(&self) -> Result<RopeScaling, String> {
        let params = match (&self.rope_parameters, &self.rope_scaling) {
            (Some(p), _) if !p.is_null() => p,
            (_, Some(s)) if !s.is_null() => s,
            _ => return Ok(RopeScaling::Default),
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
            other => Err(format!(
                "rope scaling type {other:?} is not supported (default, linear, llama3)"
            )),
        }
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
    fn unknown_keys_survive_a_round_trip() {
        let c = parse(r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"use_cache":true,"initializer_range":0.02}"#).unwrap();
        let again = parse(&c.to_json_string()).unwrap();
        assert_eq!(again.extra.get("use_cache"), Some(&Value::Bool(true)));
        assert_eq!(again.extra.get("initializer_range"), Some(&Value::from(0.02)));
    }
}
