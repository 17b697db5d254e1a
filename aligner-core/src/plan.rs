//! `aligner plan`'s memory model: what one device holds when aligner trains a model of a given
//! shape with a given method, batch and layout, and which layout fits a cluster.
//!
//! The model counts what aligner itself allocates, phase by phase, and takes the largest:
//!
//! - **states** (always held): the weights in the compute type, f32 master weights of a
//!   half-precision run, AdamW's two f32 moments of the trainable parameters (1/N of them per
//!   rank from `train.sharding = "optimizer"` on), and the frozen models a method keeps beside
//!   the policy (PPO and GRPO's reference — none with LoRA, whose reference is the base with
//!   the adapters switched off — PPO's critic with its own optimizer, and its reward model);
//! - **forward and backward**: the states, the activations autodiff keeps for the
//!   micro-batch (per token and layer, from the shapes) and the logits rows, at their largest
//!   as the backward starts;
//! - **after the backward**: the states, the trainable gradients and the embedding-sized
//!   tensors the backward leaves alive; with N > 1 ranks, the synchronisation's buffers on
//!   top: the flat f32 buffer the all-reduce fills (`none`, `optimizer`), or with
//!   `gradients` the rank's reduced 1/N and its tensors (the gradients themselves become the
//!   send buffer as they are copied out);
//! - with `full` sharding: 1/N of the weights, gradients and moments, plus what is whole for a
//!   while: the output projection (gathered for the forward, kept until its backward), one
//!   layer gathered with its whole gradient, and the largest whole gradient's host copy and
//!   send buffer as it is reduce-scattered; no embedding-sized gradient outlives the backward.
//!
//! - **saving** (a checkpoint, `keep_best`'s `best/`, the final save), on the writer: each
//!   parameter streamed to the file as it is reached, gathered from the ranks' parts where
//!   they hold it in parts (tensor groups, `full`), so no rank gathers the whole model; on a
//!   CPU, whose host memory is the device's, the largest parameter's copies as it is written,
//!   and for a checkpoint Burn's copy of the rank's own AdamW state as it streams to the file
//!   (sharded parts are staged in files, a tensor group's blocks sent to the writer a moment
//!   at a time: no rank holds another's state). LoRA's adapters are folded into each weight
//!   as it is written. The frontier's samples, when a run measures them, gather the whole policy to the writer
//!   (not counted here).
//!
//! Its constants (the tensors autodiff keeps per layer) were measured against aligner's peak
//! memory on the CPU (`docs/scaling.md`); layouts aligner does not run yet (tensor groups beside
//! fully sharded parameters) are predicted from the same counts and marked as such.
//! Tensor groups (`parallel.tensor`) hold 1/T of the weights, gradients, moments and of the
//! activations that the split layers make; PPO/GRPO's engine and reference hold the blocks
//! too (`ppo.split_engine`).

use crate::config::{LlamaConfig, Precision, QkNorm};

/// What is trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanMethod {
    Sft,
    Dpo,
    Ppo,
    Grpo,
}

impl PlanMethod {
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "sft" => PlanMethod::Sft,
            "dpo" => PlanMethod::Dpo,
            "ppo" => PlanMethod::Ppo,
            "grpo" => PlanMethod::Grpo,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            PlanMethod::Sft => "sft",
            PlanMethod::Dpo => "dpo",
            PlanMethod::Ppo => "ppo",
            PlanMethod::Grpo => "grpo",
        }
    }

    /// Sequences the policy trains on per example: DPO's chosen and rejected.
    fn sequences_per_example(self) -> usize {
        match self {
            PlanMethod::Dpo => 2,
            _ => 1,
        }
    }
}

/// One training job, as a device sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workload {
    pub method: PlanMethod,
    /// Examples per micro-batch on each data-parallel rank (`train.batch_size`).
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// LoRA adapters of this rank on every projection; `None` trains every weight.
    pub lora_rank: Option<usize>,
    pub precision: Precision,
}

/// What each data-parallel rank keeps only its share of (ZeRO's stages).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    None,
    Optimizer,
    Gradients,
    Full,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::None => "none",
            Stage::Optimizer => "optimizer",
            Stage::Gradients => "gradients",
            Stage::Full => "full",
        }
    }
}

/// How the devices of a job are used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Data-parallel ranks.
    pub data: usize,
    /// Tensor-parallel ranks per model replica (`parallel.tensor`).
    pub tensor: usize,
    pub sharding: Stage,
    /// PPO/GRPO's reference (and PPO's reward model) in host memory (`ppo.offload_reference`,
    /// `ppo.offload_reward_model`).
    pub offload_frozen: bool,
    /// Full activation recomputation (`train.activation_checkpointing = true`): only each
    /// layer's input is kept, and one layer's activations are rebuilt at a time in the
    /// backward.
    pub recompute: bool,
}

impl Layout {
    /// Whether aligner runs this layout today: every one but tensor groups beside fully
    /// sharded parameters (tensor groups run for every method, PPO's critic included, with
    /// the optimizer state or the gradients too sharded over the data ranks, with or without
    /// full recomputation).
    pub fn runs_today(&self) -> bool {
        self.tensor == 1 || self.sharding != Stage::Full || self.data == 1
    }

    pub fn devices(&self) -> usize {
        self.data * self.tensor
    }
}

/// Where the memory goes, in bytes per device.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Breakdown {
    pub weights: f64,
    pub master_weights: f64,
    pub optimizer: f64,
    /// Frozen models beside the policy (reference, reward model), PPO's critic's states, and
    /// PPO/GRPO's generation engine's own copy of the policy.
    pub companions: f64,
    pub gradients: f64,
    pub activations: f64,
    pub logits: f64,
    /// The gradients' synchronisation buffers at their largest.
    pub sync: f64,
    /// Embedding-sized tensors the backward leaves alive beside the gradients.
    pub kept: f64,
    /// The runtime itself (the process on a CPU; context and allocator slack on a GPU).
    pub runtime: f64,
    /// The largest phase of the training steps (forward, backward, the gradients' sums and,
    /// fully sharded, PPO/GRPO's rollout).
    pub training: f64,
    /// The largest phase of saving, on the writer: a checkpoint, `best/` or the final save,
    /// each streamed a parameter at a time.
    pub saving: f64,
    /// The largest phase (what must fit).
    pub peak: f64,
}

/// Parameter counts of a model shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parameters {
    pub total: usize,
    /// In the embedding and an untied output head.
    pub vocabulary: usize,
    /// In one decoder layer.
    pub per_layer: usize,
}

/// The parameters of `config` as aligner builds it (every family it loads), counted from the
/// shapes alone.
pub fn parameters(config: &LlamaConfig) -> Parameters {
    let h = config.hidden_size;
    let (heads, kv, hd) = (
        config.num_attention_heads,
        config.num_kv_heads(),
        config.head_dim(),
    );
    let (q, k) = (heads * hd, kv * hd);
    let mlp = |f: usize| 3 * h * f + if config.mlp_bias() { 2 * f + h } else { 0 };
    let ffn: Vec<usize> = feed_forward_blocks(config)
        .into_iter()
        .map(|(router, widths)| h * router + widths.into_iter().map(mlp).sum::<usize>())
        .collect();
    let mut layer = h * (q + 2 * k) + q * h;
    if config.qkv_bias() {
        layer += q + 2 * k;
    }
    if config.o_bias() {
        layer += h;
    }
    let norms = config.norm_placement();
    layer += 2 * h * (norms.before as usize + norms.after as usize);
    layer += match config.qk_norm() {
        QkNorm::None => 0,
        QkNorm::PerHead => 2 * hd,
        QkNorm::Whole => q + k,
    };
    let heads_out = if config.tied_embeddings() { 1 } else { 2 };
    let vocabulary = config.vocab_size * h * heads_out;
    Parameters {
        total: vocabulary + config.num_hidden_layers * layer + ffn.iter().sum::<usize>() + h,
        vocabulary,
        // The largest layer (a mixture of experts' sparse one).
        per_layer: layer + ffn.iter().copied().max().unwrap_or(0),
    }
}

/// LoRA parameters of rank `rank` on every projection of `config`.
pub fn lora_parameters(config: &LlamaConfig, rank: usize) -> usize {
    let h = config.hidden_size;
    let (q, k) = (
        config.num_attention_heads * config.head_dim(),
        config.num_kv_heads() * config.head_dim(),
    );
    let attention = rank * ((h + q) + 2 * (h + k) + (q + h));
    let mlp = |f: usize| rank * (2 * (h + f) + (f + h));
    // Every expert's projections are adapted (Mixtral's w1 / w3 / w2); routers are not.
    let ffn: usize = feed_forward_blocks(config)
        .into_iter()
        .flat_map(|(_, widths)| widths)
        .map(mlp)
        .sum();
    config.num_hidden_layers * attention + ffn
}

/// Each layer's feed-forward block as the outputs of its router (0 for a dense MLP) and the
/// hidden widths of its gated MLPs: one of `intermediate_size`, or a mixture's experts.
fn feed_forward_blocks(config: &LlamaConfig) -> Vec<(usize, Vec<usize>)> {
    let dense = || (0, vec![config.intermediate_size]);
    match config.moe().ok().flatten() {
        Some(spec) => spec
            .sparse_layers
            .iter()
            .map(|&sparse| match sparse {
                true => (spec.experts, vec![spec.expert_width; spec.experts]),
                false => dense(),
            })
            .collect(),
        None => (0..config.num_hidden_layers).map(|_| dense()).collect(),
    }
}

/// Activation values autodiff keeps per token of one decoder layer, by what they scale with.
/// Fitted to aligner's peak memory on the CPU (`aligner bench train`, docs/scaling.md): the
/// 16M-parameter benchmark model keeps ~300 KB a token at 1,024–2,048 tokens a step.
const KEPT_PER_HIDDEN: f64 = 4.0;
const KEPT_PER_PROJECTION: f64 = 2.0;
const KEPT_PER_FFN: f64 = 3.0;
/// Attention scores per head and key position (soft-capped attention; none with flash
/// attention).
const KEPT_PER_SCORE: f64 = 2.0;
/// Logit rows per token: the chunked log-prob op keeps the logits once, in f32.
const KEPT_PER_LOGIT: f64 = 1.0;
/// Logit rows per token of a tensor group's block of the vocabulary: its log-prob op is
/// composed of Burn ops (the fused op one process uses computes over a whole row), which
/// hold the block and, as the backward starts, most of a second copy. Fitted to the 16M
/// benchmark model at 1 × 2 (docs/scaling.md: 0.71 GB measured at 16 × 128 tokens, 0.55
/// predicted with one copy; 226 KB a token against 142).
const KEPT_PER_SPLIT_LOGIT: f64 = 1.85;
/// Embedding-sized tensors still alive when the backward pass ends, beyond the gradients
/// (measured after the backward on the 16M and the 0.5B-shaped models, both with tied
/// embeddings: 118 MB and 1.36 GB, 2.4 and 2.5 times the embedding).
const EMBEDDING_COPIES_KEPT: f64 = 2.5;
/// The process itself on a CPU (binary, threads, allocator: 101 MB for the 260K model's whole
/// step), and a GPU's context and allocator slack.
const CPU_RUNTIME_BYTES: f64 = 100e6;
const GPU_RUNTIME_BYTES: f64 = 1.5e9;

/// Where the job runs: what the runtime itself takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

/// The memory one device holds for `work` on `config` in `layout`.
pub fn estimate(config: &LlamaConfig, work: &Workload, layout: &Layout, kind: DeviceKind) -> Breakdown {
    let counts = parameters(config);
    let p = counts.total as f64;
    let (d, t) = (layout.data.max(1) as f64, layout.tensor.max(1) as f64);
    let w = match work.precision {
        Precision::F32 => 4.0,
        _ => 2.0,
    };
    let trainable = match work.lora_rank {
        Some(rank) => lora_parameters(config, rank) as f64,
        None => p,
    };
    let full = layout.sharding == Stage::Full;
    let shard = |stage: Stage| if layout.sharding >= stage { d } else { 1.0 };
    // The weights a rank holds: all of them, or with `full` its share, plus the output
    // projection (gathered once per forward and kept by the log-prob op until its backward)
    // and the layer being computed (gathered, with its whole gradient in the backward).
    let output_projection = (config.vocab_size * config.hidden_size) as f64;
    let held = if full {
        p / (t * d) + (output_projection + 2.0 * counts.per_layer as f64) / t
    } else {
        p / t
    };
    let mut b = Breakdown {
        weights: held * w,
        ..Breakdown::default()
    };
    if w < 4.0 && work.lora_rank.is_none() {
        b.master_weights = 4.0 * p / (t * shard(Stage::Full));
    }
    b.optimizer = 8.0 * trainable / (t * shard(Stage::Optimizer));
    // The trainable gradients as the backward ends (aligner reduces after it, not during).
    b.gradients = trainable * w / t;
    if full {
        b.gradients /= d;
    }
    let frozen_share = if layout.offload_frozen { 0.0 } else { 1.0 };
    // A sampling method's engine holds the whole policy in its own layout on every rank,
    // whatever the sharding (it is refitted from the policy, gathered whole, each step); in
    // a tensor group, the rank's blocks (`ppo.split_engine`, refitted from them).
    let engine = p * w / t;
    b.companions = match work.method {
        PlanMethod::Sft | PlanMethod::Dpo => 0.0,
        PlanMethod::Grpo | PlanMethod::Ppo => engine,
    };
    b.companions += match work.method {
        PlanMethod::Sft | PlanMethod::Dpo => 0.0,
        // The reference: none with LoRA (the base with the adapters off); in a tensor group,
        // a copy of the actor's blocks beside the split engine.
        PlanMethod::Grpo => work.lora_rank.map_or(p * w / t, |_| 0.0) * frozen_share,
        PlanMethod::Ppo => {
            let reference = work.lora_rank.map_or(p * w / t, |_| 0.0);
            let reward_model = p * w / t;
            // The critic trains in process: weights, gradients and AdamW, sharded as the actor.
            let critic = p * w / t + trainable * w / t + 8.0 * trainable / (t * shard(Stage::Optimizer));
            (reference + reward_model) * frozen_share + critic
        }
    };
    let tokens = (work.batch * work.seq * work.method.sequences_per_example()) as f64;
    let h = config.hidden_size as f64;
    let proj = (config.num_attention_heads + 2 * config.num_kv_heads()) as f64 * config.head_dim() as f64;
    // A token goes through `top_k` experts of a mixture's sparse layers.
    let ffn = match config.moe().ok().flatten() {
        Some(spec) => (spec.top_k * spec.expert_width).max(config.intermediate_size) as f64,
        None => config.intermediate_size as f64,
    };
    // Flash attention keeps no score matrix: a GPU's kernels, and the CPU's fused attention
    // (which keeps each row's logsumexp). Only soft-capped attention (Gemma 2) takes Burn's
    // composed ops, which keep the scores.
    let capped = config.attention_softcap().ok().flatten().is_some();
    let scores = match capped {
        true => config.num_attention_heads as f64 * work.seq as f64,
        false => 0.0,
    };
    let per_token_layer =
        KEPT_PER_HIDDEN * h + (KEPT_PER_PROJECTION * proj + KEPT_PER_FFN * ffn + KEPT_PER_SCORE * scores) / t;
    let layers = config.num_hidden_layers as f64;
    b.activations = match layout.recompute {
        false => tokens * layers * per_token_layer * w,
        true => tokens * (layers * h + per_token_layer) * w,
    };
    let kept_per_logit = match layout.tensor > 1 {
        true => KEPT_PER_SPLIT_LOGIT,
        false => KEPT_PER_LOGIT,
    };
    b.logits = tokens * kept_per_logit * config.vocab_size as f64 / t * w.max(4.0);
    b.runtime = match kind {
        DeviceKind::Cpu => CPU_RUNTIME_BYTES,
        DeviceKind::Gpu => GPU_RUNTIME_BYTES,
    };
    // With `full` each whole gradient is reduce-scattered as the backward makes it: none of
    // the embedding-sized ones outlives it.
    if !full {
        b.kept = EMBEDDING_COPIES_KEPT * output_projection * w.max(4.0) / t;
    }
    let states = b.weights + b.master_weights + b.optimizer + b.companions + b.runtime + b.kept;
    // The activations peak as the backward starts, before the gradients are built. Fully
    // sharded, the output projection is gathered there too: its host copy beside the tensor.
    let gathering = if full { 4.0 * output_projection / t } else { 0.0 };
    let forward = states + b.activations + b.logits + gathering;
    // A fully sharded sampling method gathers the whole policy (f32) for its engine and its
    // log-prob passes each step, before the update's activations exist (a tensor group's
    // engine generates on the blocks).
    let rollout = match (full, work.method) {
        (true, PlanMethod::Grpo | PlanMethod::Ppo) => states + 4.0 * p,
        _ => 0.0,
    };
    // Saving. Every save streams the model to its writer a parameter at a time, gathering
    // each one held in parts (tensor groups, `full`) as the file reaches it: no rank holds the
    // whole model. On a CPU, whose host memory is the device's, the writer holds the largest
    // parameter three times over (gathered in f32, transposed, encoded), and a checkpoint's
    // writer then Burn's copy of its own AdamW state while it streams to the file; a GPU's
    // host holds both. No rank holds another's state: sharded parts are staged in files, a
    // tensor group's blocks sent a moment at a time.
    let largest_parameter = output_projection.max((config.intermediate_size * config.hidden_size) as f64);
    let encoded = match kind {
        DeviceKind::Cpu => b.optimizer.max(3.0 * 4.0 * largest_parameter),
        DeviceKind::Gpu => 0.0,
    };
    let after_backward = states + b.gradients;
    if layout.data > 1 {
        let flat = 4.0 * trainable / t;
        b.sync = match layout.sharding {
            // The reduced buffer beside the gradients it is copied from.
            Stage::None | Stage::Optimizer => flat,
            // The gradients become the buffer; the rank's reduced share and its tensors.
            Stage::Gradients => 2.0 * flat / d,
            // One whole gradient at a time, the largest (the embedding's): its host copy and
            // the reduce-scatter's send buffer.
            Stage::Full => 2.0 * 4.0 * output_projection / t,
        };
    }
    b.training = forward.max(after_backward + b.sync).max(rollout);
    b.saving = states + encoded;
    b.peak = b.training.max(b.saving);
    b
}

/// What rank 0 holds beyond [`estimate`] when the run measures the reward–KL frontier (DPO,
/// PPO and GRPO do by default, `[frontier]`): the start model its samples are scored against
/// (in the compute type; none extra for LoRA on a whole model, whose base is the start model),
/// and where the ranks hold the policy in parts (tensor groups, `full`), the policy gathered
/// to it in f32 for the samples. Rank 0 alone holds either.
pub fn frontier_extra(config: &LlamaConfig, work: &Workload, layout: &Layout) -> f64 {
    let p = parameters(config).total as f64;
    let w = match work.precision {
        Precision::F32 => 4.0,
        _ => 2.0,
    };
    let in_parts = layout.tensor > 1 || layout.sharding == Stage::Full;
    let start_model = match (work.lora_rank, in_parts) {
        (Some(_), false) => 0.0,
        _ => w * p,
    };
    start_model + if in_parts { 4.0 * p } else { 0.0 }
}

impl PlanMethod {
    /// Whether the method's default configuration measures the reward–KL frontier.
    pub fn measures_frontier(self) -> bool {
        !matches!(self, PlanMethod::Sft)
    }
}

/// A cluster to plan for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cluster {
    pub devices: usize,
    pub devices_per_node: usize,
    /// Bytes per device.
    pub memory: f64,
    pub kind: DeviceKind,
}

/// One layout considered, with its estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub layout: Layout,
    pub estimate: Breakdown,
    pub fits: bool,
}

/// The layouts considered for `cluster`, in the order preferred when several fit (the least
/// communication and sharding first), and the one picked.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub candidates: Vec<Candidate>,
    /// Index into `candidates` of the first one that fits and that aligner runs today.
    pub picked: Option<usize>,
}

/// The layouts of `devices` devices: data parallel over all of them with each sharding stage,
/// then tensor-parallel groups of 2..=devices_per_node (with each ZeRO stage beside them;
/// `full` predicted only), each with the frozen models on the device and, for PPO and GRPO,
/// offloaded to the host; then all of them again with full activation recomputation (slower,
/// so tried second).
pub fn layouts(work: &Workload, devices: usize, devices_per_node: usize) -> Vec<Layout> {
    let offloads: &[bool] = match work.method {
        PlanMethod::Ppo | PlanMethod::Grpo => &[false, true],
        _ => &[false],
    };
    let stages = [Stage::None, Stage::Optimizer, Stage::Gradients, Stage::Full];
    let mut out = Vec::new();
    for recompute in [false, true] {
        let mut tensor = 1;
        while tensor <= devices_per_node.max(1) && devices.is_multiple_of(tensor) {
            for &offload_frozen in offloads {
                for sharding in stages {
                    let data = devices / tensor;
                    if data == 1 && sharding != Stage::None {
                        continue;
                    }
                    out.push(Layout {
                        data,
                        tensor,
                        sharding,
                        offload_frozen,
                        recompute,
                    });
                }
            }
            tensor *= 2;
        }
    }
    out
}

/// Every layout of `cluster` for `work` on `config`, and the first that fits and runs today.
pub fn plan(config: &LlamaConfig, work: &Workload, cluster: &Cluster) -> Plan {
    let candidates: Vec<Candidate> = layouts(work, cluster.devices, cluster.devices_per_node)
        .into_iter()
        .map(|layout| {
            let estimate = estimate(config, work, &layout, cluster.kind);
            Candidate {
                layout,
                estimate,
                fits: estimate.peak <= cluster.memory,
            }
        })
        .collect();
    let picked = candidates.iter().position(|c| c.fits && c.layout.runs_today());
    Plan { candidates, picked }
}

/// The smallest cluster of `cluster`'s devices (a power of two up to 4096) on which some
/// layout fits: the one aligner runs today, and the one with the predicted layouts too.
pub fn smallest_cluster(
    config: &LlamaConfig,
    work: &Workload,
    cluster: &Cluster,
) -> (Option<Plan>, Option<Plan>) {
    let (mut today, mut predicted) = (None, None);
    let mut devices = 1;
    while devices <= 4096 && (today.is_none() || predicted.is_none()) {
        let sized = Cluster { devices, ..*cluster };
        let plan = plan(config, work, &sized);
        if today.is_none() && plan.picked.is_some() {
            today = Some(plan.clone());
        }
        if predicted.is_none() && plan.candidates.iter().any(|c| c.fits) {
            predicted = Some(plan);
        }
        devices *= 2;
    }
    (today, predicted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen_05b() -> LlamaConfig {
        let mut config = LlamaConfig::llama(151_936, 896, 24, 14, 2, 4864);
        config.model_type = "qwen2".into();
        config.tie_word_embeddings = Some(true);
        config
    }

    #[test]
    fn counts_qwen2_05b_as_transformers_does() {
        // transformers' Qwen2.5-0.5B: 494,032,768 parameters (tools/real_size.py).
        assert_eq!(parameters(&qwen_05b()).total, 494_032_768);
    }

    #[test]
    fn counts_every_family_as_the_built_model_has_it() {
        let device = burn::tensor::Device::flex();
        let families = [
            r#""model_type": "llama", "attention_bias": true, "mlp_bias": true"#,
            r#""model_type": "qwen2""#,
            r#""model_type": "qwen3", "head_dim": 24"#,
            r#""model_type": "mistral", "sliding_window": 4, "tie_word_embeddings": false"#,
            r#""model_type": "gemma2", "head_dim": 16"#,
            r#""model_type": "gemma3_text", "head_dim": 16"#,
            r#""model_type": "olmo2""#,
            r#""model_type": "phi3""#,
            r#""model_type": "mixtral", "num_local_experts": 3"#,
            r#""model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [1]"#,
        ];
        for family in families {
            let text = format!(
                r#"{{{family}, "vocab_size": 96, "hidden_size": 32, "intermediate_size": 40,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "max_position_embeddings": 64, "rms_norm_eps": 1e-6}}"#
            );
            let config = LlamaConfig::from_json_str(&text, std::path::Path::new("config.json")).unwrap();
            let model = crate::CausalLm::new(&config, &device);
            assert_eq!(
                parameters(&config).total,
                crate::model::parameter_count(&model),
                "{family}"
            );
        }
    }

    #[test]
    fn sharding_divides_what_it_shards() {
        let config = qwen_05b();
        let work = Workload {
            method: PlanMethod::Sft,
            batch: 2,
            seq: 128,
            lora_rank: None,
            precision: Precision::F32,
        };
        let at = |data, sharding| {
            estimate(
                &config,
                &work,
                &Layout {
                    data,
                    tensor: 1,
                    sharding,
                    offload_frozen: false,
                    recompute: false,
                },
                DeviceKind::Cpu,
            )
        };
        let one = at(1, Stage::None);
        let p = parameters(&config).total as f64;
        assert_eq!(one.optimizer, 8.0 * p);
        assert_eq!(at(4, Stage::Optimizer).optimizer, 2.0 * p);
        assert_eq!(at(4, Stage::Gradients).gradients, one.gradients);
        assert!(at(4, Stage::Gradients).training < at(4, Stage::Optimizer).training);
        assert!(at(4, Stage::Full).training < at(4, Stage::Gradients).training);
        assert!(
            at(2, Stage::None).training > one.training,
            "the all-reduce buffer"
        );
        // Saving: a CPU writer's checkpoint copies its own AdamW state as it streams to the
        // file (at one rank more than the backward's gradients); no rank gathers the whole
        // model, so fully sharded saving falls with the states.
        assert!(one.saving > one.training);
        assert!(at(4, Stage::Optimizer).saving < one.saving);
        assert!(at(4, Stage::Full).saving < one.saving / 2.0);
        assert!(
            at(2, Stage::Full).peak < one.peak,
            "full sharding's peak falls, saving included"
        );
    }

    #[test]
    fn the_frontier_adds_the_start_model_and_a_gathered_policy_on_rank_0() {
        let config = qwen_05b();
        let p = parameters(&config).total as f64;
        let work = Workload {
            method: PlanMethod::Dpo,
            batch: 1,
            seq: 128,
            lora_rank: None,
            precision: Precision::Bf16,
        };
        let layout = |data, tensor, sharding| Layout {
            data,
            tensor,
            sharding,
            offload_frozen: false,
            recompute: false,
        };
        // Whole on every rank: the start model in bf16 beside the trained one.
        assert_eq!(
            frontier_extra(&config, &work, &layout(2, 1, Stage::None)),
            2.0 * p
        );
        // In parts: the start model whole, and the policy gathered in f32 for the samples.
        assert_eq!(
            frontier_extra(&config, &work, &layout(2, 1, Stage::Full)),
            6.0 * p
        );
        assert_eq!(
            frontier_extra(&config, &work, &layout(1, 2, Stage::None)),
            6.0 * p
        );
        // LoRA on a whole model: the start model is the base, already held.
        let lora = Workload {
            lora_rank: Some(16),
            ..work
        };
        assert_eq!(frontier_extra(&config, &lora, &layout(2, 1, Stage::None)), 0.0);
        assert!(PlanMethod::Dpo.measures_frontier() && !PlanMethod::Sft.measures_frontier());
    }

    #[test]
    fn the_smallest_cluster_is_the_first_that_fits() {
        let mut config = LlamaConfig::llama(128_256, 8192, 80, 64, 8, 28_672);
        config.tie_word_embeddings = Some(false);
        let work = Workload {
            method: PlanMethod::Dpo,
            batch: 1,
            seq: 4096,
            lora_rank: None,
            precision: Precision::Bf16,
        };
        let cluster = Cluster {
            devices: 8,
            devices_per_node: 8,
            memory: 80e9,
            kind: DeviceKind::Gpu,
        };
        // 70B in bf16 is 141 GB of weights, 1.1 TB with the f32 master weights and AdamW's
        // moments: nothing fits on 8 devices. At 4,096 tokens the activations of 80 layers
        // (182 GB, which data-parallel ranks do not divide) fit on no cluster as they are:
        // recomputed a layer at a time (each layer's input kept), full sharding fits.
        assert!(plan(&config, &work, &cluster).picked.is_none());
        let (today, _) = smallest_cluster(&config, &work, &cluster);
        let today = today.expect("full sharding with recomputation fits somewhere");
        let picked = &today.candidates[today.picked.expect("picked")];
        assert!(picked.layout.recompute, "{:?}", picked.layout);
        assert_eq!(picked.layout.sharding, Stage::Full);
        let kept = today
            .candidates
            .iter()
            .filter(|c| !c.layout.recompute && c.layout.runs_today());
        assert!(kept.clone().count() > 0 && kept.clone().all(|c| !c.fits));
        // At 1,024 tokens, full sharding over enough ranks fits (saving streams to the writer,
        // gathering nothing whole), and half as many ranks do not.
        let work = Workload { seq: 1024, ..work };
        let (today, _) = smallest_cluster(&config, &work, &cluster);
        let today = today.expect("full sharding fits somewhere");
        let picked = &today.candidates[today.picked.expect("picked")];
        assert_eq!(picked.layout.sharding, Stage::Full);
        let devices = picked.layout.devices();
        assert!(devices > 8, "{devices}");
        let smaller = Cluster {
            devices: devices / 2,
            ..cluster
        };
        assert!(plan(&config, &work, &smaller).picked.is_none());
    }
}
