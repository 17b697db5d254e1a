//! Run configuration: TOML sections shared by every training command, `--set key=value`
//! overrides, and unknown keys reported by name.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::schedule::Schedule;
use crate::error::{CoreError, Result};

/// `[model]`: which model to start from, and LoRA.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// HF model folder; empty = the shipped default.
    pub path: Option<PathBuf>,
    /// 0 = full fine-tuning.
    pub lora_rank: usize,
    pub lora_alpha: f64,
    pub lora_dropout: f64,
    pub lora_targets: Vec<String>,
    /// What the model computes in: `"f32"`, or `"bf16"` / `"f16"` on GPU devices (f32
    /// master weights in the optimizer; checkpoints saved in this type).
    pub dtype: crate::config::Precision,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            path: None,
            lora_rank: 0,
            lora_alpha: 16.0,
            lora_dropout: 0.0,
            lora_targets: ["q_proj", "k_proj", "v_proj", "o_proj"]
                .map(String::from)
                .to_vec(),
            dtype: crate::config::Precision::F32,
        }
    }
}

/// `[parallel]`: how the ranks `mpirun` starts share the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelSection {
    /// Ranks per tensor group (Megatron-style tensor parallel): each keeps a block of every
    /// large weight (heads, the MLP's width, the vocabulary) and the group computes each layer
    /// together. The world's ranks form a `data × tensor` grid; 1 = no tensor parallel.
    pub tensor: usize,
}

impl Default for ParallelSection {
    fn default() -> Self {
        Self { tensor: 1 }
    }
}

impl ParallelSection {
    /// `run` with its ranks in tensor groups of `parallel.tensor` (a collective; `run` itself
    /// when it is 1), refused naming the key where the model or `[model]` cannot be split:
    /// heads or KV heads that the groups do not divide, or LoRA dropout (whose masks a split
    /// layer cannot draw as one process does).
    pub fn grid(
        &self,
        run: &crate::run::RunDir,
        model: &ModelSection,
        config: &crate::config::LlamaConfig,
    ) -> Result<crate::run::RunDir> {
        let t = self.tensor;
        if t == 0 {
            return Err(CoreError::Invalid("parallel.tensor must be at least 1".into()));
        }
        if t == 1 {
            return Ok(run.clone());
        }
        check_tensor_heads(config, t, &format!("parallel.tensor = {t}"))?;
        if model.lora_rank > 0 && model.lora_dropout > 0.0 {
            return Err(CoreError::Invalid(format!(
                "parallel.tensor = {t} with model.lora_dropout = {}: a split layer cannot draw the \
                 dropout one process draws; set model.lora_dropout = 0",
                model.lora_dropout
            )));
        }
        run.clone().in_tensor_groups(t)
    }
}

/// Refuses, naming `setting`, tensor groups of `tensor` ranks that do not divide `config`'s
/// attention heads and key/value heads between them.
pub fn check_tensor_heads(config: &crate::config::LlamaConfig, tensor: usize, setting: &str) -> Result<()> {
    let (heads, kv) = (config.num_attention_heads, config.num_kv_heads());
    if tensor > 1 && (!heads.is_multiple_of(tensor) || !kv.is_multiple_of(tensor)) {
        return Err(CoreError::Invalid(format!(
            "{setting} does not divide the model's {heads} attention heads and {kv} key/value \
             heads between the ranks of a group"
        )));
    }
    Ok(())
}

/// `[data]`: training and validation files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// A `.jsonl`, `.json` (an array of rows) or `.parquet` file, or a folder of such shards.
    pub train: Option<PathBuf>,
    pub validation: Option<PathBuf>,
    pub max_seq_len: usize,
    /// Column renames applied as rows are read: `{ question = "prompt" }` reads a dataset's
    /// `question` column as the prompt.
    pub fields: std::collections::BTreeMap<String, String>,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            train: None,
            validation: None,
            max_seq_len: 256,
            fields: Default::default(),
        }
    }
}

/// `train.bucket_mb`'s default: PyTorch DDP's bucket size.
pub const DEFAULT_BUCKET_MB: f64 = 25.0;

/// The number of f32 values in a bucket of `mb` MiB (0 = no buckets).
pub fn bucket_elements(mb: f64) -> usize {
    (mb * (1 << 20) as f64 / 4.0) as usize
}

/// `[train]`: the optimisation loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// Optimiser steps; 0 = run `epochs` over the data.
    pub max_steps: usize,
    pub epochs: usize,
    /// Sequences (or pairs) per micro-batch on each rank (TRL's `per_device_train_batch_size`):
    /// N data-parallel ranks with batch b train as one process with batch N·b.
    pub batch_size: usize,
    /// Micro-batches per optimiser step.
    pub grad_accum: usize,
    pub lr: f64,
    pub schedule: Schedule,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    /// AdamW's ε (HF's `adam_epsilon`): added to the root of the second moment, it bounds the
    /// step of a weight whose gradient is near zero (rounding noise moves such a weight by up
    /// to `lr · |g| / (|g| + ε)` a step).
    pub adam_epsilon: f64,
    /// Global gradient-norm clip; 0 = off.
    pub max_grad_norm: f64,
    pub seed: u64,
    pub shuffle: bool,
    /// Checkpoint every N steps; 0 = only at the end.
    pub save_every: usize,
    /// Validate every N steps; 0 = only at the end.
    pub eval_every: usize,
    /// Write a metrics row every N steps.
    pub log_every: usize,
    /// Validation examples used per evaluation; 0 = all.
    pub eval_examples: usize,
    /// Data parallel: compare a checksum of every rank's weights every N steps (and at the
    /// end), stopping with an error when they drift apart; 0 = only at the end.
    pub sync_check_every: usize,
    /// Data parallel: what each rank keeps only its share of (ZeRO's stages; see [`Sharding`]).
    pub sharding: Sharding,
    /// Recompute activations in the backward pass instead of keeping them: `true` (or
    /// `"layers"`) keeps each decoder layer's input alone and reruns the layer in the backward
    /// (HF's gradient checkpointing); `"balanced"` is Burn's strategy. See [`Checkpointing`].
    pub activation_checkpointing: Checkpointing,
    /// With `sharding = "full"`: keep each linear layer's gathered weight from its forward to
    /// its backward instead of gathering it again there (one all-gather a step instead of two;
    /// the whole weights stay in memory through the step, as without sharding).
    pub keep_gathered: bool,
    /// Data parallel with `sharding = "none"` or `"optimizer"`: the gradients are summed over
    /// the ranks in buckets of about this many MiB while the backward pass goes on, each as
    /// soon as its gradients are complete (PyTorch DDP's `bucket_cap_mb`); 0 = all of them
    /// after the backward pass.
    pub bucket_mb: f64,
    /// Keep the model of the best validation by this metric (e.g. `"eval_nll"`) in `best/`
    /// and make it `final/` (the step it is from is in `final_step.json`); none = the last.
    pub keep_best: Option<String>,
    /// Whether `keep_best` is best at its lowest (`min`, as for a loss or an NLL) or highest.
    pub keep_best_mode: BestMode,
    /// Write TensorBoard event files to `<run>/tb/` (every scalar of metrics.jsonl).
    pub tensorboard: bool,
}

/// `train.sharding`: what a data-parallel rank keeps only its share of. Parameters are
/// assigned to ranks whole, by size (the largest rank holds at most one parameter more than
/// an even share); each rank updates its own and broadcasts them after the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    /// ZeRO stage 0: every rank keeps the whole optimizer state; gradients are all-reduced.
    #[default]
    None,
    /// ZeRO stage 1: each rank keeps AdamW's moments of its own parameters; gradients are
    /// still all-reduced whole.
    Optimizer,
    /// ZeRO stage 2: as `optimizer`, and gradients are reduce-scattered: each rank receives
    /// (and keeps) only the summed gradients of its own parameters.
    Gradients,
    /// ZeRO stage 3: each rank keeps its block of rows of every trainable parameter, with
    /// their gradients and moments. A layer's whole weight is all-gathered for its forward
    /// and again for its backward, which reduce-scatters its gradient at once
    /// (`aligner_parallel::shard`).
    Full,
}

impl Sharding {
    /// Whether the optimizer state is split over the ranks.
    pub fn shards_optimizer(self) -> bool {
        self != Sharding::None
    }

    /// The value as written in `train.sharding`.
    pub fn name(self) -> &'static str {
        match self {
            Sharding::None => "none",
            Sharding::Optimizer => "optimizer",
            Sharding::Gradients => "gradients",
            Sharding::Full => "full",
        }
    }
}

/// `train.activation_checkpointing`: what the backward pass recomputes instead of keeping
/// from the forward pass. Written `false` / `true` (the same as `"off"` / `"layers"`) or
/// `"balanced"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checkpointing {
    /// Autodiff keeps what each op's backward needs.
    #[default]
    Off,
    /// Full recomputation a decoder layer at a time (HF's `gradient_checkpointing`): the
    /// forward keeps only each layer's input; the backward reruns one layer at a time from it
    /// and takes that layer's gradients before the next (`crate::model::recompute`). Memory
    /// for activations falls from every layer's to one layer's plus the inputs; a step costs
    /// about one more forward pass.
    Layers,
    /// Burn's balanced gradient checkpointing: memory-bound ops are recomputed, compute-bound
    /// ones such as the matmuls and aligner's fused ops keep their outputs. On aligner's
    /// models it keeps more than it frees (see the README).
    Balanced,
}

impl Checkpointing {
    /// The value as written in a config (`config.toml` keeps `false` / `true` for the first
    /// two, as before the third existed).
    pub fn name(self) -> &'static str {
        match self {
            Checkpointing::Off => "off",
            Checkpointing::Layers => "layers",
            Checkpointing::Balanced => "balanced",
        }
    }

    /// `off`, `layers` or `balanced` (and `false` / `true`).
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" | "false" => Ok(Checkpointing::Off),
            "layers" | "true" => Ok(Checkpointing::Layers),
            "balanced" => Ok(Checkpointing::Balanced),
            other => Err(format!(
                "train.activation_checkpointing = {other:?}: expected true, false, \"layers\" or \"balanced\""
            )),
        }
    }
}

impl Serialize for Checkpointing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Checkpointing::Off => s.serialize_bool(false),
            Checkpointing::Layers => s.serialize_bool(true),
            Checkpointing::Balanced => s.serialize_str("balanced"),
        }
    }
}

impl<'de> Deserialize<'de> for Checkpointing {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Flag(bool),
            Name(String),
        }
        match Written::deserialize(d)? {
            Written::Flag(false) => Ok(Checkpointing::Off),
            Written::Flag(true) => Ok(Checkpointing::Layers),
            Written::Name(name) => Checkpointing::parse(&name).map_err(serde::de::Error::custom),
        }
    }
}

/// Which end of a metric is best.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BestMode {
    #[default]
    Min,
    Max,
}

impl BestMode {
    /// Whether `value` is better than `best`.
    pub fn improves(self, value: f64, best: f64) -> bool {
        match self {
            BestMode::Min => value < best,
            BestMode::Max => value > best,
        }
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        Self {
            max_steps: 0,
            epochs: 1,
            batch_size: 8,
            grad_accum: 1,
            lr: 1e-4,
            schedule: Schedule::Constant,
            warmup_steps: 0,
            weight_decay: 0.0,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            seed: 42,
            shuffle: true,
            save_every: 0,
            eval_every: 0,
            log_every: 1,
            eval_examples: 0,
            sync_check_every: 50,
            sharding: Sharding::None,
            activation_checkpointing: Checkpointing::Off,
            keep_gathered: false,
            bucket_mb: DEFAULT_BUCKET_MB,
            keep_best: None,
            keep_best_mode: BestMode::Min,
            tensorboard: true,
        }
    }
}

/// Refuses a text template that lacks one of the `required` placeholders (`{name}`) or has
/// one that is not `allowed` (a typo such as `{promt}` would otherwise reach the model as
/// text), naming the key. Braces around anything but a bare name are text.
pub fn check_template(key: &str, template: &str, required: &[&str], allowed: &[&str]) -> Result<()> {
    if let Some(missing) = required.iter().find(|f| !template.contains(&format!("{{{f}}}"))) {
        return Err(CoreError::Invalid(format!("{key} must contain {{{missing}}}")));
    }
    if let Some(unknown) = placeholders(template).into_iter().find(|p| !allowed.contains(p)) {
        let known: Vec<String> = allowed.iter().map(|a| format!("{{{a}}}")).collect();
        return Err(CoreError::Invalid(format!(
            "{key} has {{{unknown}}}, which is not one of its placeholders ({})",
            known.join(", ")
        )));
    }
    Ok(())
}

/// The `{name}` placeholders of a template, in order (names are letters, digits and `_`,
/// starting with a letter or `_`).
fn placeholders(template: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        rest = &rest[open + 1..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let name = &rest[..end];
        let starts_well = name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if starts_well && rest[end..].starts_with('}') {
            out.push(name);
        }
    }
    out
}

/// `model` moved to the autodiff device `train_device` in training mode, its parameters
/// carrying the device's gradient-checkpointing strategy. Burn's `Module::train` enables
/// autodiff on each parameter with the default strategy (none) whatever the device's, and
/// every activation inherits its inputs' strategy: without this step a checkpointing device
/// (`activation_checkpointing`) would recompute nothing.
pub fn to_train_device<M: burn::module::Module>(model: M, train_device: &burn::tensor::Device) -> M {
    use burn::module::{ModuleMapper, Param};
    use burn::tensor::{GradientCheckpointingStrategy, Tensor};

    struct WithStrategy(GradientCheckpointingStrategy);
    impl ModuleMapper for WithStrategy {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let strategy = self.0;
            param.map(|tensor| tensor.with_gradient_checkpointing_strategy(strategy))
        }
    }
    let model = model.fork(train_device).train();
    match train_device.gradient_checkpointing_strategy() {
        Some(strategy) if strategy != GradientCheckpointingStrategy::Disabled => {
            model.map(&mut WithStrategy(strategy))
        }
        _ => model,
    }
}

/// What a numeric setting must be (always finite).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    /// Above 0.
    Positive,
    /// At least 0.
    NonNegative,
    /// From 0 to 1.
    Fraction,
    /// Above 0, at most 1 (`top_p`).
    OpenFraction,
    /// At least 0, below 1 (a dropout probability).
    DropoutRate,
}

impl Range {
    fn holds(self, v: f64) -> bool {
        v.is_finite()
            && match self {
                Range::Positive => v > 0.0,
                Range::NonNegative => v >= 0.0,
                Range::Fraction => (0.0..=1.0).contains(&v),
                Range::OpenFraction => v > 0.0 && v <= 1.0,
                Range::DropoutRate => (0.0..1.0).contains(&v),
            }
    }

    fn rule(self) -> &'static str {
        match self {
            Range::Positive => "a finite number above 0",
            Range::NonNegative => "a finite number of at least 0",
            Range::Fraction => "a number from 0 to 1",
            Range::OpenFraction => "a number above 0 and at most 1",
            Range::DropoutRate => "a number of at least 0 and below 1",
        }
    }
}

/// Refuses `value` for the setting `key` unless it is in `range`, naming the key.
pub fn check_value(key: &str, value: impl Into<f64>, range: Range) -> Result<()> {
    let value = value.into();
    if range.holds(value) {
        Ok(())
    } else {
        Err(CoreError::Invalid(format!(
            "{key} = {value}: must be {}",
            range.rule()
        )))
    }
}

/// Refuses a count of 0 for any of `settings` (`(key, value)` each), naming the key.
pub fn check_counts(settings: &[(&str, usize)]) -> Result<()> {
    match settings.iter().find(|(_, value)| *value == 0) {
        Some((key, _)) => Err(CoreError::Invalid(format!("{key} = 0: must be at least 1"))),
        None => Ok(()),
    }
}

/// Refuses a number of new tokens (`(key, value)` each) that cannot fit the model's context
/// beside a prompt (`max_position_embeddings` or more), naming the key and the model's context.
pub fn check_new_tokens(settings: &[(&str, usize)], model: &crate::LlamaConfig) -> Result<()> {
    let context = model.max_position_embeddings;
    match settings.iter().find(|(_, value)| *value >= context) {
        Some((key, value)) => Err(CoreError::Invalid(format!(
            "{key} = {value}: the model's context is {context} positions (max_position_embeddings), \
             prompt included; ask for fewer new tokens"
        ))),
        None => Ok(()),
    }
}

/// Checks several settings with [`check_value`]: `(key, value, range)` each.
pub fn check_values(settings: &[(&str, f64, Range)]) -> Result<()> {
    settings
        .iter()
        .try_for_each(|(key, value, range)| check_value(key, *value, *range))
}

impl TrainSection {
    /// The autodiff device training runs on: `device` with gradients, and with gradient
    /// checkpointing when `activation_checkpointing` is set.
    pub fn autodiff_device(&self, device: &burn::tensor::Device) -> burn::tensor::Device {
        let train = device.clone().autodiff();
        if self.activation_checkpointing == Checkpointing::Balanced {
            train.gradient_checkpointing()
        } else {
            train
        }
    }

    /// `model` ready to train on `train_device` ([`TrainSection::autodiff_device`]): see
    /// [`to_train_device`].
    pub fn train_model<M: burn::module::Module>(&self, model: M, device: &burn::tensor::Device) -> M {
        to_train_device(model, &self.autodiff_device(device))
    }

    /// Optimiser steps of a run over `examples` training examples on `ranks` ranks:
    /// `max_steps`, or `epochs` over the data in global batches of `batch_size` per rank,
    /// `grad_accum` micro-batches a step.
    pub fn total_steps(&self, examples: usize, ranks: usize) -> usize {
        if self.max_steps > 0 {
            return self.max_steps;
        }
        let per_epoch = examples.div_ceil(self.batch_size.max(1) * ranks.max(1));
        (per_epoch * self.epochs.max(1)).div_ceil(self.grad_accum.max(1))
    }

    /// Refuses settings the loop cannot run with, naming the key.
    pub fn check(&self) -> Result<()> {
        check_counts(&[
            ("train.batch_size", self.batch_size),
            ("train.grad_accum", self.grad_accum),
            ("train.log_every", self.log_every),
        ])?;
        check_value("train.lr", self.lr, Range::Positive)?;
        check_value("train.max_grad_norm", self.max_grad_norm, Range::NonNegative)?;
        check_value("train.weight_decay", self.weight_decay, Range::NonNegative)?;
        check_value("train.adam_epsilon", self.adam_epsilon, Range::Positive)?;
        check_value("train.bucket_mb", self.bucket_mb, Range::NonNegative)?;
        if self.bucket_mb != DEFAULT_BUCKET_MB
            && matches!(self.sharding, Sharding::Gradients | Sharding::Full)
        {
            return Err(CoreError::Invalid(format!(
                "train.bucket_mb sizes the gradient buckets summed during the backward with \
                 train.sharding \"none\" or \"optimizer\"; train.sharding = \"{}\" \
                 reduce-scatters instead",
                self.sharding.name()
            )));
        }
        if self.keep_gathered && self.sharding != Sharding::Full {
            return Err(CoreError::Invalid(format!(
                "train.keep_gathered = true keeps the weights `train.sharding = \"full\"` gathers, \
                 but train.sharding is \"{}\"",
                self.sharding.name()
            )));
        }
        Ok(())
    }

    /// Refuses the keys of `unused` (each with what the method uses instead) that differ from
    /// `defaults`: a method whose steps are not batches of examples (PPO draws
    /// `ppo.rollout_prompts` a step) says so rather than ignore `train.batch_size`. `section`
    /// is this section's name in the configuration (`train`).
    pub fn check_unused(
        &self,
        section: &str,
        defaults: &TrainSection,
        method: &str,
        unused: &[(&str, &str)],
    ) -> Result<()> {
        let table = |section: &TrainSection| toml::Value::try_from(section).ok();
        let (mine, theirs) = (table(self), table(defaults));
        for (key, instead) in unused {
            let value = |t: &Option<toml::Value>| t.as_ref().and_then(|t| t.get(*key)).cloned();
            if let Some(set) = value(&mine).filter(|v| Some(v) != value(&theirs).as_ref()) {
                return Err(CoreError::Invalid(format!(
                    "{section}.{key} = {set} is not used by {method}: {instead}"
                )));
            }
        }
        Ok(())
    }

    /// A sampling method's steps: `max_steps`, or `epochs` passes over `prompts` prompts drawn
    /// `per_step` a step.
    pub fn sampling_steps(&self, prompts: usize, per_step: usize) -> usize {
        if self.max_steps > 0 {
            return self.max_steps;
        }
        prompts.div_ceil(per_step.max(1)) * self.epochs.max(1)
    }

    /// The loop of the embedded default runs: `epochs` over the shipped data with batch 16,
    /// cosine decay from 2e-3 after 5 warm-up steps, validation and checkpoints every 25 steps.
    pub fn embedded_default(epochs: usize) -> Self {
        Self {
            epochs,
            batch_size: 16,
            lr: 2e-3,
            schedule: Schedule::Cosine,
            warmup_steps: 5,
            eval_every: 25,
            save_every: 25,
            ..Self::default()
        }
    }
}

impl DataSection {
    /// `max_seq_len`, checked against the model it trains: at least 1 and within the
    /// model's context (`max_position_embeddings`).
    pub fn max_len(&self, model: &crate::LlamaConfig) -> Result<usize> {
        let context = model.max_position_embeddings;
        if self.max_seq_len == 0 {
            return Err(CoreError::Invalid(
                "data.max_seq_len = 0: must be at least 1".into(),
            ));
        }
        if self.max_seq_len > context {
            return Err(CoreError::Invalid(format!(
                "data.max_seq_len = {} is longer than the model's context (max_position_embeddings = {context} \
                 in its config.json): set data.max_seq_len to at most {context}",
                self.max_seq_len
            )));
        }
        Ok(self.max_seq_len)
    }

    /// Training and validation files of the shipped tinystories_sentiment task.
    pub fn shipped(train: &str, validation: &str) -> Self {
        let dir = crate::default_data_dir();
        Self {
            train: Some(dir.join(train)),
            validation: Some(dir.join(validation)),
            ..Self::default()
        }
    }
}

/// A configuration key that moved: `(old, new)`, both dotted (`("ppo.steps",
/// "train.max_steps")`). A file or `--set` that still gives the old key is refused naming the
/// new one, instead of the plain "unknown field".
pub type MovedKey = (&'static str, &'static str);

/// Builds a command's configuration: its defaults, then the TOML file, then `--set` overrides.
/// Unknown keys anywhere are an error naming the key.
pub fn load_config<T: Serialize + DeserializeOwned>(
    defaults: &T,
    file: Option<&Path>,
    overrides: &[String],
) -> Result<T> {
    load_config_moved(defaults, file, overrides, &[])
}

/// Keys every configuration refuses, each with the key (and values) that replaced it.
const REPLACED: &[(&str, &str)] = &[(
    "train.shard_optimizer",
    "train.sharding (true: sharding = \"optimizer\"; false: \"none\"; \"gradients\" also \
     reduce-scatters the gradients)",
)];

/// [`load_config`] for a configuration some of whose keys moved (`moved`): a file or `--set`
/// giving an old key is an error naming its new place.
pub fn load_config_moved<T: Serialize + DeserializeOwned>(
    defaults: &T,
    file: Option<&Path>,
    overrides: &[String],
    moved: &[MovedKey],
) -> Result<T> {
    let moved_error = |path: PathBuf, (old, new): &MovedKey| CoreError::Config {
        path,
        message: match REPLACED.iter().find(|(key, _)| key == old) {
            Some((_, how)) => format!("{old} is now {how}"),
            None => format!("{old} is now {new} (rename the key; the value means the same)"),
        },
    };
    let moved: Vec<MovedKey> = moved
        .iter()
        .copied()
        .chain(REPLACED.iter().map(|&(old, _)| (old, old)))
        .collect();
    let moved = &moved[..];
    let mut value = toml::Value::try_from(defaults).map_err(|e| CoreError::Invalid(e.to_string()))?;
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|e| CoreError::io(path, e))?;
        let user: toml::Value = toml::from_str(&text).map_err(|e| CoreError::Config {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        if let Some(key) = moved.iter().find(|(old, _)| has_dotted(&user, old)) {
            return Err(moved_error(path.to_path_buf(), key));
        }
        merge(&mut value, user);
    }
    let mut set_keys = Vec::new();
    for item in overrides {
        let (key, raw) = item
            .split_once('=')
            .ok_or_else(|| CoreError::Invalid(format!("--set {item:?}: expected key=value")))?;
        if let Some(moved_key) = moved.iter().find(|(old, _)| *old == key.trim()) {
            return Err(moved_error(PathBuf::from(format!("--set {item}")), moved_key));
        }
        set_dotted(&mut value, key.trim(), parse_value(raw.trim()))?;
        set_keys.push((key.trim().to_string(), item));
    }
    // A bad value is blamed on the `--set` that gave it, else on the file.
    let source = |bad_key: &str| -> PathBuf {
        let covers = |set: &str| {
            bad_key == set
                || bad_key.starts_with(&format!("{set}."))
                || set.starts_with(&format!("{bad_key}."))
        };
        match set_keys.iter().rev().find(|(set, _)| covers(set)) {
            Some((_, item)) => PathBuf::from(format!("--set {item}")),
            None => file
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("--set")),
        }
    };
    if let Some(key) = first_non_finite("", &value) {
        return Err(CoreError::Config {
            path: source(&key),
            message: format!("{key} is not a finite number (nan and inf are refused)"),
        });
    }
    // The error names the key it is about (`train.lr: invalid type ...`).
    serde_path_to_error::deserialize(value).map_err(|e| {
        let key = e.path().to_string();
        CoreError::Config {
            path: source(&key),
            // toml's own messages end in a newline (and sometimes repeat the key after it).
            message: crate::data::with_field(e, |m| m.split("\nin `").next().unwrap_or_default().trim_end()),
        }
    })
}

/// The dotted key of the first NaN or infinite float in `value`.
fn first_non_finite(prefix: &str, value: &toml::Value) -> Option<String> {
    let key = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    match value {
        toml::Value::Float(f) if !f.is_finite() => Some(prefix.to_string()),
        toml::Value::Table(t) => t.iter().find_map(|(k, v)| first_non_finite(&key(k), v)),
        toml::Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| first_non_finite(&format!("{prefix}[{i}]"), v)),
        _ => None,
    }
}

/// A `--set` value: TOML when it parses (numbers, booleans, arrays), else a plain string.
fn parse_value(raw: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

/// Whether `value` holds the dotted `key`.
fn has_dotted(value: &toml::Value, key: &str) -> bool {
    key.split('.')
        .try_fold(value, |node, part| node.as_table().and_then(|t| t.get(part)))
        .is_some()
}

fn merge(base: &mut toml::Value, update: toml::Value) {
    match (base, update) {
        (toml::Value::Table(b), toml::Value::Table(u)) => {
            for (k, v) in u {
                match b.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, u) => *b = u,
    }
}

fn set_dotted(root: &mut toml::Value, key: &str, value: toml::Value) -> Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    let mut node = root;
    for part in &parts[..parts.len() - 1] {
        let table = node
            .as_table_mut()
            .ok_or_else(|| CoreError::Invalid(format!("--set {key}: {part:?} is not a section")))?;
        node = table
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    }
    let table = node
        .as_table_mut()
        .ok_or_else(|| CoreError::Invalid(format!("--set {key}: not inside a section")))?;
    table.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

/// A key whose value differs between two configurations (values as TOML; `(unset)` for an
/// absent one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConfigChange {
    pub key: String,
    pub from: String,
    pub to: String,
}

impl std::fmt::Display for ConfigChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} -> {}", self.key, self.from, self.to)
    }
}

/// The dotted keys whose values differ between `before` and `after`, in key order (what a
/// `--set` on a resumed run would change).
pub fn config_changes<T: Serialize>(before: &T, after: &T) -> Result<Vec<ConfigChange>> {
    let flat = |config: &T| -> Result<std::collections::BTreeMap<String, toml::Value>> {
        let value = toml::Value::try_from(config).map_err(|e| CoreError::Invalid(e.to_string()))?;
        let mut out = std::collections::BTreeMap::new();
        flatten("", value, &mut out);
        Ok(out)
    };
    let (before, after) = (flat(before)?, flat(after)?);
    let keys: std::collections::BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    let shown = |v: Option<&toml::Value>| v.map_or_else(|| "(unset)".to_string(), |v| v.to_string());
    Ok(keys
        .into_iter()
        .filter(|k| before.get(*k) != after.get(*k))
        .map(|k| ConfigChange {
            key: k.clone(),
            from: shown(before.get(k)),
            to: shown(after.get(k)),
        })
        .collect())
}

fn flatten(prefix: &str, value: toml::Value, out: &mut std::collections::BTreeMap<String, toml::Value>) {
    match value {
        toml::Value::Table(table) => {
            for (k, v) in table {
                let key = if prefix.is_empty() {
                    k
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        leaf => {
            out.insert(prefix.to_string(), leaf);
        }
    }
}

/// Serialises a resolved configuration as TOML (the run folder's `config.toml`).
pub fn to_toml<T: Serialize>(config: &T) -> Result<String> {
    toml::to_string_pretty(config).map_err(|e| CoreError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn templates_need_their_placeholders_and_no_others() {
        let allowed = ["prompt", "response"];
        assert!(check_template("t", "{prompt}{response} Score:", &allowed, &allowed).is_ok());
        let missing = check_template("t", "{prompt} Score:", &allowed, &allowed).unwrap_err();
        assert!(
            missing.to_string().contains("t must contain {response}"),
            "{missing}"
        );
        let typo = check_template("t", "{promt}{prompt}{response}", &allowed, &allowed).unwrap_err();
        assert!(typo.to_string().contains("t has {promt}"), "{typo}");
        // JSON and other braces are text.
        assert!(check_template("t", r#"{prompt}{response} {"a": 1} {} {1}"#, &allowed, &allowed).is_ok());
        assert_eq!(placeholders("a {x_1} {b c} {_y}{"), vec!["x_1", "_y"]);
    }

    #[test]
    fn config_changes_name_each_changed_key() {
        let before = Example::default();
        let mut after = before.clone();
        assert_eq!(config_changes(&before, &after).unwrap(), vec![]);
        after.train.lr = 2e-4;
        after.data.train = Some(PathBuf::from("other.jsonl"));
        let changes = config_changes(&before, &after).unwrap();
        let keys: Vec<&str> = changes.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(keys, ["data.train", "train.lr"]);
        assert_eq!(changes[0].from, "(unset)");
        assert_eq!(changes[0].to, "\"other.jsonl\"");
        assert_eq!(changes[1].to_string(), "train.lr: 0.0001 -> 0.0002");
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
    #[serde(deny_unknown_fields, default)]
    struct Example {
        model: ModelSection,
        data: DataSection,
        train: TrainSection,
    }

    #[test]
    fn file_then_overrides_then_typed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "[train]\nlr = 0.5\nschedule = \"cosine\"\n[data]\ntrain = \"a.jsonl\"\n",
        )
        .unwrap();
        let sets = [
            "train.max_steps=20".to_string(),
            "train.lr=0.25".into(),
            "model.path=some/dir".into(),
        ];
        let c = load_config(&Example::default(), Some(&path), &sets).unwrap();
        assert_eq!(c.train.lr, 0.25);
        assert_eq!(c.train.max_steps, 20);
        assert_eq!(c.train.schedule, Schedule::Cosine);
        assert_eq!(c.data.train, Some(PathBuf::from("a.jsonl")));
        assert_eq!(c.model.path, Some(PathBuf::from("some/dir")));
        assert_eq!(c.train.batch_size, TrainSection::default().batch_size);
        let back: Example = toml::from_str(&to_toml(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn a_bad_value_is_blamed_on_where_it_came_from() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[train]\nlr = 0.5\n").unwrap();
        let err = |file: &Path, sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            load_config(&Example::default(), Some(file), &sets)
                .unwrap_err()
                .to_string()
        };
        let e = err(&path, &["train.max_steps=2", "train.lr=abc"]);
        assert!(e.starts_with("--set train.lr=abc: train.lr: invalid type"), "{e}");
        let e = err(&path, &["train.lrr=1"]);
        assert!(e.starts_with("--set train.lrr=1:") && e.contains("lrr"), "{e}");
        let e = err(&path, &["train.lr=nan"]);
        assert!(
            e.starts_with("--set train.lr=nan: train.lr is not a finite"),
            "{e}"
        );
        // The file's own bad value is the file's, whatever else is set.
        std::fs::write(&path, "[train]\nlr = \"fast\"\n").unwrap();
        let e = err(&path, &["train.max_steps=2"]);
        assert!(e.starts_with(&format!("{}: train.lr", path.display())), "{e}");
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = load_config(&Example::default(), None, &["train.lrr=1".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("lrr"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[optimizer]\nlr = 1\n").unwrap();
        let err = load_config(&Example::default(), Some(&path), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("optimizer"), "{err}");
        let err = load_config(&Example::default(), None, &["nokey".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("key=value"), "{err}");
    }

    #[test]
    fn moved_keys_are_refused_naming_their_new_place() {
        const MOVED: &[MovedKey] = &[("model.steps", "train.max_steps")];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[model]\nsteps = 3\n").unwrap();
        let err = load_config_moved(&Example::default(), Some(&path), &[], MOVED)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "{}: model.steps is now train.max_steps (rename the key; the value means the same)",
                path.display()
            )
        );
        let err = load_config_moved(&Example::default(), None, &["model.steps=3".into()], MOVED)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("--set model.steps=3: model.steps is now train.max_steps"),
            "{err}"
        );
        // The new key loads; a section of the same name without the old key is untouched.
        std::fs::write(&path, "[model]\nlora_rank = 2\n[train]\nmax_steps = 3\n").unwrap();
        let c: Example = load_config_moved(&Example::default(), Some(&path), &[], MOVED).unwrap();
        assert_eq!((c.model.lora_rank, c.train.max_steps), (2, 3));
    }

    #[test]
    fn unused_train_keys_are_refused_only_when_changed() {
        let defaults = TrainSection {
            max_steps: 24,
            ..TrainSection::default()
        };
        let unused = [("batch_size", "a step is ppo.rollout_prompts prompts")];
        let mut train = defaults.clone();
        train.lr = 0.5;
        assert!(train.check_unused("train", &defaults, "ppo", &unused).is_ok());
        train.batch_size = 3;
        let err = train
            .check_unused("train", &defaults, "ppo", &unused)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "train.batch_size = 3 is not used by ppo: a step is ppo.rollout_prompts prompts"
        );
        // max_steps, or epochs over the prompts at `per_step` a step.
        assert_eq!(defaults.sampling_steps(100, 8), 24);
        let by_epochs = TrainSection {
            max_steps: 0,
            epochs: 2,
            ..defaults
        };
        assert_eq!(by_epochs.sampling_steps(10, 8), 4);
    }

    #[test]
    fn values_are_checked_by_key() {
        assert!(check_value("a", 1.0, Range::Positive).is_ok());
        for (value, range) in [
            (0.0, Range::Positive),
            (-1.0, Range::NonNegative),
            (f64::NAN, Range::NonNegative),
            (f64::INFINITY, Range::Positive),
            (1.5, Range::Fraction),
            (0.0, Range::OpenFraction),
        ] {
            let err = check_value("ppo.top_p", value, range).unwrap_err().to_string();
            assert!(err.starts_with("ppo.top_p = "), "{err}");
        }
        assert!(
            check_value("p", 1.0, Range::OpenFraction).is_ok()
                && check_value("p", 0.0, Range::Fraction).is_ok()
        );
    }

    #[test]
    fn nan_and_inf_are_refused_anywhere_naming_the_key() {
        for set in [
            "train.lr=nan",
            "train.max_grad_norm=inf",
            "train.weight_decay=-inf",
        ] {
            let err = load_config(&Example::default(), None, &[set.to_string()])
                .unwrap_err()
                .to_string();
            let key = set.split('=').next().unwrap();
            assert!(err.contains(key) && err.contains("not a finite number"), "{err}");
        }
        let err = load_config(&Example::default(), None, &["train.lr=abc".to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("train.lr: invalid type"), "{err}");
        let err = load_config(&Example::default(), None, &["train.nope=1".to_string()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("train.nope: unknown field"), "{err}");
    }

    #[test]
    fn max_seq_len_must_fit_the_model() {
        let model = crate::LlamaConfig {
            max_position_embeddings: 512,
            ..crate::LlamaConfig::llama(16, 8, 1, 2, 2, 16)
        };
        let data = |max_seq_len| DataSection {
            max_seq_len,
            ..DataSection::default()
        };
        assert_eq!(data(512).max_len(&model).unwrap(), 512);
        assert!(
            data(0)
                .max_len(&model)
                .unwrap_err()
                .to_string()
                .contains("data.max_seq_len = 0")
        );
        let err = data(2006).max_len(&model).unwrap_err().to_string();
        assert!(
            err.contains("data.max_seq_len = 2006") && err.contains("context"),
            "{err}"
        );
    }
}
