//! The Llama-family decoder: a trunk that maps tokens to hidden states, and heads on top.
//!
//! The trunk ([`LlamaModel`]) is shared by every head: the language-model head of
//! [`CausalLm`] now, scalar value/reward and multi-attribute regression heads later. Weights
//! live in Burn's layout (`Linear` weights are `[in, out]`); checkpoint I/O converts to and
//! from Hugging Face's `[out, in]` exactly (a transpose).

mod attention;
mod cache;
mod host;
mod layer;
mod lora;
mod moe;
mod norm;
pub mod recompute;
mod rope;

pub use host::copied_to_host;

use burn::module::{Module, Param, ParamId};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

pub use attention::Attention;
pub use cache::{KvCache, LayerCache};
pub use layer::{DecoderLayer, Mlp};
pub use lora::{LoraAdapter, LoraLinear};
pub use moe::{
    ExpertNaming, FeedForward, SparseMoe, load_balancing_loss, top_k_rows, with_router_loss,
    with_valid_tokens,
};
pub use norm::RmsNorm;
pub use rope::{Rope, RotaryAngles, inverse_frequencies, long_context_frequencies};

use crate::config::{LlamaConfig, Precision};
use aligner_parallel::{DEFAULT_CHUNK_TOKENS, token_logprobs_from_hidden};

/// Token embeddings, decoder layers and the final norm: tokens → hidden states.
#[derive(Module, Debug)]
pub struct LlamaModel {
    pub embed_tokens: Embedding,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// The RoPE of every layer, or (Gemma 3) of the global layers.
    pub rope: Rope,
    /// Gemma 3: the RoPE of the sliding-window layers (another base).
    pub local_rope: Option<Rope>,
    /// Gemma: the factor (`√hidden`) on the token embeddings.
    #[module(skip)]
    pub embedding_scale: Option<f64>,
    /// What the forward pass computes in: activations are cast to it after the embedding
    /// lookup and every weight is cast to the activations' type where it is used, so f32
    /// weights train as master weights under a half-precision forward (the casts' backward
    /// brings the gradients back to f32).
    #[module(skip)]
    pub precision: Precision,
}

impl LlamaModel {
    /// A randomly initialised trunk (weights are replaced when loading a checkpoint).
    pub fn new(config: &LlamaConfig, device: &Device) -> Self {
        Self {
            embed_tokens: EmbeddingConfig::new(config.vocab_size, config.hidden_size).init(device),
            layers: (0..config.num_hidden_layers)
                .map(|i| DecoderLayer::new(config, i, device))
                .collect(),
            norm: layer::rms_norm(config, config.hidden_size, device),
            rope: Rope::new(config, device),
            local_rope: Rope::local(config, device),
            embedding_scale: config.embedding_scale(),
            precision: config.precision,
        }
    }

    /// Whether `layer` rotates with the local RoPE: Gemma 3's sliding-window layers do.
    pub fn rotates_locally(&self, layer: &DecoderLayer) -> bool {
        self.local_rope.is_some() && layer.self_attn.window.is_some()
    }

    /// Decoder layer `i` on `x`, as every pass runs it (an ordinary pass, a recomputed one and
    /// its reruns): with the local angles where the layer rotates locally, and its dropout
    /// masks drawn from the pass's seed for the layer.
    pub(in crate::model) fn layer_forward(
        &self,
        i: usize,
        x: Tensor<3>,
        (angles, local): (&RotaryAngles, Option<&RotaryAngles>),
        mask: Option<&Tensor<4, Bool>>,
        cache: Option<&mut LayerCache>,
        seeds: Option<&recompute::DropoutSeeds>,
    ) -> Tensor<3> {
        let layer = &self.layers[i];
        let angles = match local {
            Some(local) if self.rotates_locally(layer) => local,
            _ => angles,
        };
        if let Some(seeds) = seeds {
            seeds.before_layer(i);
        }
        layer.forward(x, angles, mask, cache)
    }

    /// Final hidden states `[batch, seq, hidden]` of `tokens: [batch, seq]` at `positions`.
    ///
    /// With a cache, `tokens` continue the cached sequence and their keys/values are appended.
    pub fn forward(
        &self,
        tokens: Tensor<2, Int>,
        positions: &Tensor<2, Int>,
        mask: Option<&Tensor<4, Bool>>,
        mut cache: Option<&mut KvCache>,
    ) -> Tensor<3> {
        let angles = self.rope.angles(positions);
        let local = self.local_rope.as_ref().map(|r| r.angles(positions));
        if recompute::applies(self, cache.is_some()) {
            return recompute::forward(self, tokens, angles, local, mask);
        }
        // A training pass's LoRA dropout draws each layer's masks from a seed of its own, as
        // a recomputed pass and its reruns do (the same masks, the same gradients).
        let seeds = match cache.is_some() {
            true => None,
            false => recompute::DropoutSeeds::draw(self),
        };
        let mut x = self.embed(tokens);
        for i in 0..self.layers.len() {
            let layer_cache = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = self.layer_forward(i, x, (&angles, local.as_ref()), mask, layer_cache, seeds.as_ref());
        }
        if let Some(seeds) = &seeds {
            seeds.after_pass();
        }
        layer::norm(&self.norm, x)
    }

    /// The token embeddings of `tokens` (Gemma's scaled), in the compute type.
    pub fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let x = if let Some(split) = tensor_split(&self.embed_tokens.weight) {
            vocab_parallel_embedding(self.embed_tokens.weight.val(), tokens, &split)
        } else {
            match shard_spec(&self.embed_tokens.weight) {
                Some(spec) => {
                    aligner_parallel::shard::shard_embedding(self.embed_tokens.weight.val(), tokens, spec)
                }
                // Through `whole_value`, so an overlapped gradient sum sees the read.
                None => burn::tensor::module::embedding(whole_value(&self.embed_tokens.weight), tokens),
            }
        };
        let x = match self.embedding_scale {
            Some(scale) => x.mul_scalar(scale as f32),
            None => x,
        };
        x.cast(self.precision.float_dtype())
    }
}

/// The rows `tokens` of an embedding table whose block of rows `split` says this rank holds:
/// each rank looks up the tokens of its block (zeros for the others) and the group sums them.
fn vocab_parallel_embedding(
    block: Tensor<2>,
    tokens: Tensor<2, Int>,
    split: &aligner_parallel::tensor::TensorSplit,
) -> Tensor<3> {
    let (index, inside) = aligner_parallel::vocab::block_index(tokens, &split.own_range());
    let x = burn::tensor::module::embedding(block, index) * inside.unsqueeze_dim::<3>(2);
    aligner_parallel::tensor::tp_reduce(x, &split.group)
}

/// A decoder with a language-model head (`LlamaForCausalLM`).
#[derive(Module, Debug)]
pub struct CausalLm {
    pub model: LlamaModel,
    /// `None` when the output embeddings are tied to the input embeddings.
    pub lm_head: Option<Linear>,
    /// Gemma's `final_logit_softcapping`: logits become `cap · tanh(logit / cap)`.
    #[module(skip)]
    pub final_softcap: Option<f64>,
}

impl CausalLm {
    /// A randomly initialised model for `config`.
    pub fn new(config: &LlamaConfig, device: &Device) -> Self {
        let lm_head = (!config.tied_embeddings()).then(|| {
            LinearConfig::new(config.hidden_size, config.vocab_size)
                .with_bias(false)
                .init(device)
        });
        Self {
            model: LlamaModel::new(config, device),
            lm_head,
            final_softcap: config.final_softcap().ok().flatten(),
        }
    }

    /// `cap · tanh(logits / cap)` under a final soft-cap (Gemma), the logits themselves
    /// otherwise.
    pub fn cap_logits<const D: usize>(&self, logits: Tensor<D>) -> Tensor<D> {
        aligner_parallel::soft_cap(logits, self.final_softcap)
    }

    /// The output projection `[hidden, vocab]` (the transposed embeddings when tied), in its
    /// stored type (see [`as_type_of`] for the compute type).
    pub fn output_weight(&self) -> Tensor<2> {
        match &self.lm_head {
            Some(head) => whole_value(&head.weight),
            None => whole_value(&self.model.embed_tokens.weight).transpose(),
        }
    }

    /// Under tensor parallel (`parallel.tensor`): this rank's block of the output projection,
    /// `[hidden, its block of the vocabulary]`, and how the projection is split (the
    /// vocabulary's indices this rank holds are `split.own_range()`); `None` for a whole
    /// model.
    pub fn output_block(&self) -> Option<(Tensor<2>, aligner_parallel::tensor::TensorSplit)> {
        match &self.lm_head {
            Some(head) => tensor_split(&head.weight).map(|s| (head.weight.val(), s)),
            None => tensor_split(&self.model.embed_tokens.weight)
                .map(|s| (self.model.embed_tokens.weight.val().transpose(), s)),
        }
    }

    /// The tensor group this model's layers are split over (`parallel.tensor`); `None` for a
    /// whole model.
    pub fn tensor_group(&self) -> Option<aligner_parallel::tensor::Group> {
        tensor_split(&self.model.embed_tokens.weight).map(|s| s.group)
    }

    /// [`CausalLm::output_weight`] for projecting `hidden`, which places the weight's
    /// gradient work in the backward right after the projection's (a sharded weight's
    /// reduce-scatter, an overlapped bucket) rather than at its end.
    fn output_weight_for<const D: usize>(&self, hidden: &Tensor<D>) -> Tensor<2> {
        match &self.lm_head {
            Some(head) => param_value(&head.weight, hidden),
            None => param_value(&self.model.embed_tokens.weight, hidden).transpose(),
        }
    }

    /// Logits `[batch, seq, vocab]` of hidden states.
    pub fn logits_from_hidden(&self, hidden: Tensor<3>) -> Tensor<3> {
        // One [batch·seq, hidden] × [hidden, vocab] product: a single large GEMM is much
        // faster on CPU than a broadcast batched matmul.
        let [b, s, d] = hidden.dims();
        let weight = as_type_of(self.output_weight_for(&hidden), &hidden);
        let vocab = weight.dims()[1];
        let logits = hidden
            .reshape([b * s, d])
            .matmul(weight)
            .reshape([b, s, vocab])
            .cast(burn::tensor::FloatDType::F32);
        self.cap_logits(logits)
    }

    /// The logits of `hidden` (`[batch, seq, d]`) over the vocabulary this rank holds: the
    /// whole vocabulary's ([`CausalLm::logits_from_hidden`]), or in a tensor group its block
    /// of the vocabulary alone (`[batch, seq, block]`, under the final soft-cap; the hidden
    /// states' gradient summed over the group). With the [`Vocabulary`] they are over.
    ///
    /// [`Vocabulary`]: aligner_parallel::vocab::Vocabulary
    pub fn own_logits_from_hidden(
        &self,
        hidden: Tensor<3>,
    ) -> (Tensor<3>, aligner_parallel::vocab::Vocabulary) {
        let Some((block, split)) = self.output_block() else {
            return (self.logits_from_hidden(hidden), Default::default());
        };
        let [b, s, d] = hidden.dims();
        let hidden = aligner_parallel::tensor::tp_copy(hidden.reshape([b * s, d]), &split.group);
        let range = split.own_range();
        let logits = hidden
            .clone()
            .matmul(as_type_of(block, &hidden))
            .reshape([b, s, range.len()])
            .cast(burn::tensor::FloatDType::F32);
        let vocabulary = aligner_parallel::vocab::Vocabulary::Split {
            group: split.group,
            block: range,
        };
        (self.cap_logits(logits), vocabulary)
    }

    /// Logits of right-padded (or unpadded) `tokens: [batch, seq]` at positions `0..seq`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let positions = default_positions(&tokens);
        let hidden = self.model.forward(tokens, &positions, None, None);
        self.logits_from_hidden(hidden)
    }

    /// Per-token log-probabilities `[batch, seq - 1]`: entry `t` is `log p(tokens[t+1] | ..=t)`.
    ///
    /// Computed from hidden states in chunks, so `[batch, seq, vocab]` logits never exist at
    /// once. Differentiable. Positions after a sequence's end (right padding) are computed but
    /// meaningless; callers mask them.
    pub fn token_logprobs(&self, tokens: Tensor<2, Int>) -> Tensor<2> {
        let positions = default_positions(&tokens);
        self.token_logprobs_with(tokens, &positions, None)
    }

    /// [`CausalLm::token_logprobs`] with explicit positions and attention mask (`true` =
    /// hidden), e.g. for packed rows holding several sequences.
    pub fn token_logprobs_with(
        &self,
        tokens: Tensor<2, Int>,
        positions: &Tensor<2, Int>,
        mask: Option<&Tensor<4, Bool>>,
    ) -> Tensor<2> {
        let [batch, seq] = tokens.dims();
        let hidden = self.model.forward(tokens.clone(), positions, mask, None);
        let [_, _, d] = hidden.dims();
        let inputs = hidden.narrow(1, 0, seq - 1).reshape([batch, seq - 1, d]);
        let targets = tokens.narrow(1, 1, seq - 1);
        self.token_logprobs_of_hidden(inputs, targets)
    }

    /// `log p(targets)` of the next-token distributions of `hidden: [batch, seq, d]` (chunked:
    /// no `[batch, seq, vocab]` tensor), under the final soft-cap when the model has one.
    /// In f32 whatever the compute type (the weight is cast to the activations' type there).
    pub fn token_logprobs_of_hidden(&self, hidden: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<2> {
        // Tensor parallel: each rank's logits over its block of the vocabulary.
        if let Some((block, split)) = self.output_block() {
            return aligner_parallel::tensor::vocab_parallel_logprobs(
                hidden,
                block,
                targets,
                split.own_range(),
                DEFAULT_CHUNK_TOKENS,
                self.final_softcap,
                &split.group,
            );
        }
        let weight = self.output_weight_for(&hidden);
        token_logprobs_from_hidden(hidden, weight, targets, DEFAULT_CHUNK_TOKENS, self.final_softcap)
    }
}

/// LoRA settings: rank, `alpha`, dropout on the adapter input, and the projection names
/// (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`; Phi-3's
/// `qkv_proj` and `gate_up_proj`) to adapt.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: Vec<String>,
}

impl LoraSpec {
    /// Whether the projection called `name` (its HF name, e.g.
    /// `model.layers.0.self_attn.q_proj`) gets an adapter: its last part is a target.
    pub fn adapts(&self, name: &str) -> bool {
        let short = name.rsplit('.').next().unwrap_or_default();
        self.targets.iter().any(|t| t == short)
    }

    /// The spec with its targets named as `model` names its projections: on a model with fused
    /// projections (Phi-3), `q_proj` / `k_proj` / `v_proj` mean `qkv_proj` and `gate_proj` /
    /// `up_proj` mean `gate_up_proj` (what PEFT's `target_modules` must then say).
    pub fn for_model(&self, model: &LlamaModel) -> LoraSpec {
        let fused = model.layers.first().is_some_and(|l| l.self_attn.qkv.len() == 1);
        let experts = model.layers.iter().find_map(|l| match &l.mlp {
            FeedForward::Sparse(moe) => Some(moe.naming),
            FeedForward::Dense(_) => None,
        });
        let mut targets: Vec<String> = Vec::new();
        for target in &self.targets {
            let name = match target.as_str() {
                "q_proj" | "k_proj" | "v_proj" if fused => "qkv_proj",
                "gate_proj" | "up_proj" if fused => "gate_up_proj",
                other => other,
            };
            // Mixtral's experts call their projections w1 / w3 / w2: both names are
            // adapted (a Qwen3-MoE model's dense layers and experts share Llama's).
            if let Some(naming) = experts {
                let renamed = naming.rename(name);
                if renamed != name && !targets.iter().any(|t| t == renamed) {
                    targets.push(renamed.to_string());
                }
            }
            if !targets.iter().any(|t| t == name) {
                targets.push(name.to_string());
            }
        }
        LoraSpec {
            targets,
            ..self.clone()
        }
    }
}

/// The projections of every layer (seven; five in Phi-3) with their HF prefixes.
pub fn projections(model: &mut LlamaModel) -> Vec<(String, &mut LoraLinear)> {
    let mut out = Vec::new();
    for (i, layer) in model.layers.iter_mut().enumerate() {
        let p = format!("model.layers.{i}");
        let attn = &mut layer.self_attn;
        let names = attn.projection_names();
        for (name, proj) in names.iter().zip(attn.qkv.iter_mut()) {
            out.push((format!("{p}.self_attn.{name}"), proj));
        }
        out.push((format!("{p}.self_attn.o_proj"), &mut attn.o_proj));
        for (name, proj) in layer.mlp.named_parts_mut().projections {
            out.push((format!("{p}.{name}"), proj));
        }
    }
    out
}

impl LlamaModel {
    /// Freezes every weight of the trunk and attaches adapters to the targeted projections.
    /// Returns the number of adapted layers.
    pub fn attach_lora(&mut self, spec: &LoraSpec, device: &Device) -> usize {
        let spec = &spec.for_model(self);
        *self = self.clone().no_grad();
        let mut adapted = 0;
        for (name, layer) in projections(self) {
            if spec.adapts(&name) {
                layer.attach(&name, spec.rank, spec.alpha, spec.dropout, device);
                adapted += 1;
            }
        }
        adapted
    }

    /// Switches every adapter on or off (off = the frozen base model).
    pub fn set_adapters_enabled(&mut self, enabled: bool) {
        for (_, layer) in projections(self) {
            layer.adapter_enabled = enabled;
        }
    }

    /// A copy with every adapter folded into its base weight.
    pub fn merged(&self) -> Self {
        let mut out = self.clone();
        for (_, layer) in projections(&mut out) {
            *layer = LoraLinear::from(layer.merged());
        }
        out
    }
}

impl CausalLm {
    /// Freezes the whole model (embeddings, norms, head included) and attaches adapters.
    pub fn attach_lora(&mut self, spec: &LoraSpec, device: &Device) -> usize {
        if let Some(head) = self.lm_head.take() {
            self.lm_head = Some(head.no_grad());
        }
        self.model.attach_lora(spec, device)
    }

    /// A copy with adapters folded in.
    pub fn merged(&self) -> Self {
        Self {
            model: self.model.merged(),
            lm_head: self.lm_head.clone(),
            final_softcap: self.final_softcap,
        }
    }
}

/// `weight` in `x`'s float type (a no-op when they agree): how half-precision activations
/// meet f32 master weights.
pub fn as_type_of<const D: usize, const E: usize>(weight: Tensor<D>, x: &Tensor<E>) -> Tensor<D> {
    weight.cast(burn::tensor::FloatDType::from(x.dtype()))
}

/// Makes `trunk` (built from `config`) compute in `precision`, and `config` say so, so the
/// stores built from it save in that type; refused, naming `model.dtype`, where `device`
/// cannot compute in it.
pub fn compute_in(
    precision: Precision,
    config: &mut LlamaConfig,
    trunk: &mut LlamaModel,
    device: &Device,
) -> crate::Result<()> {
    precision
        .check_device(device)
        .map_err(crate::CoreError::Invalid)?;
    config.precision = precision;
    trunk.precision = precision;
    Ok(())
}

/// A copy of `module` whose float weights are stored in `precision` (inference: the engine
/// casts once instead of at every use). Training keeps f32 weights and casts at use.
pub fn with_weights_in<M: Module>(module: M, precision: Precision) -> M {
    struct Cast(burn::tensor::FloatDType);
    impl burn::module::ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|t| t.cast(dtype))
        }
    }
    if precision == Precision::F32 {
        return module;
    }
    module.map(&mut Cast(precision.float_dtype()))
}

/// Positions `0..seq` for every row of `tokens: [batch, seq]`.
pub fn default_positions(tokens: &Tensor<2, Int>) -> Tensor<2, Int> {
    let [batch, seq] = tokens.dims();
    Tensor::<1, Int>::arange(0..seq as i64, &tokens.device())
        .unsqueeze_dim::<2>(0)
        .expand([batch, seq])
}

/// Positions and attention mask for left-padded rows.
///
/// `valid[b][t]` says whether key `t` of row `b` is a real token. Positions count real tokens
/// only (HF's `cumsum(mask) - 1`, pads at 0). The mask (`true` = hidden) is
/// `[batch, 1, queries, keys]` for the last `queries` of `keys` positions: padding keys and
/// future keys are hidden.
pub fn left_padded_layout(
    valid: &[Vec<bool>],
    queries: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<4, Bool>) {
    let batch = valid.len();
    let keys = valid.first().map_or(0, Vec::len);
    let mut positions = Vec::with_capacity(batch * queries);
    let mut mask = Vec::with_capacity(batch * queries * keys);
    for row in valid {
        let mut pos = Vec::with_capacity(keys);
        let mut count = 0i64;
        for &v in row {
            pos.push(if v { count } else { 0 });
            count += v as i64;
        }
        positions.extend_from_slice(&pos[keys - queries..]);
        for q in keys - queries..keys {
            // A padding query keeps its own key, so no row is fully masked (which would
            // give NaN in some kernels and poison the cache through its values).
            mask.extend((0..keys).map(|k| k > q || (!row[k] && k != q)));
        }
    }
    (
        Tensor::from_data(TensorData::new(positions, [batch, queries]), device),
        Tensor::from_data(TensorData::new(mask, [batch, 1, queries, keys]), device),
    )
}

/// Positions and block-diagonal causal mask for rows packing several sequences: `segments[b][t]`
/// is the sequence index of token `t` of row `b` (`None` for padding). Positions restart at 0
/// for each sequence; a token sees only earlier tokens of its own sequence (padding sees itself).
pub fn packed_layout(segments: &[Vec<Option<usize>>], device: &Device) -> (Tensor<2, Int>, Tensor<4, Bool>) {
    let batch = segments.len();
    let len = segments.first().map_or(0, Vec::len);
    let mut positions = Vec::with_capacity(batch * len);
    let mut mask = Vec::with_capacity(batch * len * len);
    for row in segments {
        let mut pos = 0i64;
        for t in 0..len {
            pos = if t > 0 && row[t].is_some() && row[t] == row[t - 1] {
                pos + 1
            } else {
                0
            };
            positions.push(pos);
        }
        for q in 0..len {
            mask.extend((0..len).map(|k| !(k == q || (k < q && row[k].is_some() && row[k] == row[q]))));
        }
    }
    (
        Tensor::from_data(TensorData::new(positions, [batch, len]), device),
        Tensor::from_data(TensorData::new(mask, [batch, 1, len, len]), device),
    )
}

/// The trainable parameter count of any module.
pub fn parameter_count<M: Module>(module: &M) -> usize {
    module.num_params()
}

/// How `param` is split when it is a shard of a fully sharded trainer's parameter
/// (`train.sharding = "full"`); `None` for a whole tensor.
pub fn shard_spec<const D: usize>(param: &Param<Tensor<D>>) -> Option<aligner_parallel::shard::ShardSpec> {
    aligner_parallel::shard::spec_of(param.id.val(), &param.val().dims())
}

/// The whole value of `param`: the tensor itself, or, for a shard, the whole tensor gathered
/// from the ranks (differentiable; `anchor`, the activation it is used with, places the
/// gradient's reduce-scatter right after its user in the backward).
pub fn param_value<const D: usize, const E: usize>(
    param: &Param<Tensor<D>>,
    anchor: &Tensor<E>,
) -> Tensor<D> {
    let value = param.val();
    if let Some(split) = tensor_split(param) {
        // A use that does not compute on the block: the whole tensor, gathered.
        return aligner_parallel::tensor::tp_gather(value, split);
    }
    if let Some(spec) = aligner_parallel::shard::spec_of(param.id.val(), &value.dims()) {
        return aligner_parallel::shard::shard_gather(value, anchor, spec);
    }
    // Data parallel with overlap: the read's gradient goes to its bucket.
    match aligner_parallel::overlap::hook_of(param.id.val()) {
        Some(hook) => aligner_parallel::overlap::grad_hook(value, anchor, hook),
        None => value,
    }
}

/// How `param` is split when it is this rank's block of a tensor-parallel parameter
/// (`parallel.tensor`); `None` for a whole tensor.
pub fn tensor_split<const D: usize>(
    param: &Param<Tensor<D>>,
) -> Option<aligner_parallel::tensor::TensorSplit> {
    if !aligner_parallel::tensor::active() {
        return None;
    }
    aligner_parallel::tensor::split_of(param.id.val(), &param.val().dims())
}

/// [`param_value`] without an activation at hand (its reduce-scatter runs at the end of the
/// backward).
pub fn whole_value<const D: usize>(param: &Param<Tensor<D>>) -> Tensor<D> {
    // The shard is its own anchor: no activation orders its backward.
    param_value(param, &param.val())
}

/// A trainable parameter whose id is derived from its HF name, so the same checkpoint always
/// yields the same ids and optimiser state saved against them re-attaches on resume.
pub fn named_param<const D: usize>(name: &str, value: Tensor<D>) -> Param<Tensor<D>> {
    // FNV-1a: stable across runs and platforms.
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    PARAM_NAMES
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(std::collections::HashMap::new)
        .entry(hash)
        .or_insert_with(|| name.to_string());
    let (_, value, mapper) = Param::from_tensor(value).consume();
    Param::from_mapped_value(ParamId::from(hash), value, mapper)
}

/// The HF names of the parameters [`named_param`] made, by id.
static PARAM_NAMES: std::sync::RwLock<Option<std::collections::HashMap<u64, String>>> =
    std::sync::RwLock::new(None);

/// The HF name of the parameter with id `id`, when [`named_param`] made it (every weight a
/// checkpoint loads, and every LoRA factor).
pub fn param_name(id: u64) -> Option<String> {
    PARAM_NAMES
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()?
        .get(&id)
        .cloned()
}
