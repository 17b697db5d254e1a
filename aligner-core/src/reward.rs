//! Sequence-level heads on the decoder trunk: a scalar reward / value head and a regression
//! head with several named outputs (SteerLM's attribute model), saved as HF
//! `LlamaForSequenceClassification` (`score.weight`, `[num_labels, hidden]`).

use std::collections::HashMap;
use std::path::Path;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use serde_json::Value;

use crate::checkpoint::{
    Fold, Slot, load_slots, pending_slot_tensors_folding, trunk_slots, write_atomic,
    write_pending_safetensors,
};
use crate::config::LlamaConfig;
use crate::error::{CoreError, Result};
use crate::model::{LlamaModel, default_positions};

/// The decoder trunk with a linear head read at each sequence's last token.
#[derive(Module, Debug)]
pub struct RewardModel {
    pub model: LlamaModel,
    /// `[hidden, outputs]`, no bias (as HF's `score`).
    pub score: Linear,
}

impl RewardModel {
    /// A trunk with a fresh head of `outputs` values (zero-initialised: every reward starts at 0).
    pub fn new(config: &LlamaConfig, outputs: usize, device: &Device) -> Self {
        let mut score = LinearConfig::new(config.hidden_size, outputs)
            .with_bias(false)
            .init(device);
        score.weight = crate::model::named_param(
            "score.weight",
            Tensor::zeros([config.hidden_size, outputs], device),
        );
        Self {
            model: LlamaModel::new(config, device),
            score,
        }
    }

    /// Number of outputs of the head.
    pub fn outputs(&self) -> usize {
        self.score.weight.dims()[1]
    }

    /// Head outputs of each of `rows` (token ids, any lengths), `batch_size` rows per forward
    /// pass: one `outputs()`-long vector per row.
    pub fn score_rows(&self, rows: &[&[u32]], batch_size: usize) -> crate::Result<Vec<Vec<f32>>> {
        let device = self.score.weight.device();
        let outputs = self.outputs();
        let mut out = Vec::with_capacity(rows.len());
        for chunk in rows.chunks(batch_size.max(1)) {
            let lengths: Vec<usize> = chunk.iter().map(|r| r.len()).collect();
            let values: Vec<f32> = self
                .forward(crate::score::pad_right(chunk, 0, &device), &lengths)
                .into_data()
                .try_to_vec()
                .map_err(|e| crate::CoreError::Invalid(format!("reward model outputs: {e:?}")))?;
            out.extend(values.chunks(outputs).map(<[f32]>::to_vec));
        }
        Ok(out)
    }

    /// Head outputs `[batch, outputs]` for right-padded `tokens: [batch, seq]` whose real lengths
    /// are `lengths`.
    pub fn forward(&self, tokens: Tensor<2, Int>, lengths: &[usize]) -> Tensor<2> {
        let [batch, _] = tokens.dims();
        let positions = default_positions(&tokens);
        let hidden = self.model.forward(tokens, &positions, None, None);
        let [_, _, d] = hidden.dims();
        let last: Vec<i64> = lengths.iter().map(|&l| l.saturating_sub(1) as i64).collect();
        let index = Tensor::<1, Int>::from_data(TensorData::new(last, [batch]), &hidden.device())
            .reshape([batch, 1, 1])
            .expand([batch, 1, d]);
        let pooled = hidden.gather(1, index).reshape([batch, d]);
        self.head(pooled)
    }

    /// Head outputs at every position, `[batch, seq, outputs]`, of `tokens` at `positions`
    /// under `mask` (a critic reads its per-token values this way).
    pub fn forward_all(
        &self,
        tokens: Tensor<2, Int>,
        positions: &Tensor<2, Int>,
        mask: Option<&Tensor<4, burn::tensor::Bool>>,
    ) -> Tensor<3> {
        let hidden = self.model.forward(tokens, positions, mask, None);
        let [b, s, d] = hidden.dims();
        self.head(hidden.reshape([b * s, d]))
            .reshape([b, s, self.outputs()])
    }

    /// The head on pooled hidden states `[rows, hidden]`, in the trunk's compute type; the
    /// outputs are f32.
    fn head(&self, pooled: Tensor<2>) -> Tensor<2> {
        let weight =
            crate::model::as_type_of(crate::model::param_value(&self.score.weight, &pooled), &pooled);
        pooled.matmul(weight).cast(burn::tensor::FloatDType::F32)
    }

    fn slots(&mut self) -> Vec<(String, Slot<'_>)> {
        let mut out = trunk_slots(&mut self.model);
        out.push(("score".to_string(), Slot::Linear(&mut self.score)));
        out
    }

    /// Starts a reward model from a causal-LM or reward-model folder; a causal LM gets a fresh
    /// head of `outputs` values.
    pub fn load(dir: &Path, config: &LlamaConfig, outputs: usize, device: &Device) -> Result<Self> {
        Self::load_in(dir, config, outputs, device, None)
    }

    /// [`RewardModel::load`] on a rank of tensor group `group` (when given): the trunk's
    /// weights that tensor parallel splits are read as this rank's blocks alone; the head
    /// stays whole.
    pub fn load_in(
        dir: &Path,
        config: &LlamaConfig,
        outputs: usize,
        device: &Device,
        group: Option<&std::sync::Arc<dyn aligner_parallel::Communicator>>,
    ) -> Result<Self> {
        let mut model = Self::new(config, outputs, device);
        let slots = match config.is_sequence_classifier() {
            true => model.slots(),
            false => trunk_slots(&mut model.model),
        };
        match group {
            Some(group) if group.world_size() > 1 => {
                crate::checkpoint::load_slots_split(dir, config, slots, device, group).map(drop)?
            }
            _ => load_slots(dir, config, slots, device)?,
        }
        Ok(model)
    }

    /// Saves as an HF `*ForSequenceClassification` folder, with `labels` naming the outputs.
    pub fn save(
        &self,
        config: &LlamaConfig,
        labels: &[String],
        dir: &Path,
        tokenizer_from: Option<&Path>,
    ) -> Result<()> {
        self.save_folding(config, labels, dir, tokenizer_from, &HashMap::new())
    }

    /// [`RewardModel::save`] with the trunk's adapters of `folds` (see
    /// [`crate::checkpoint::lora_folds`]) folded into the weights they adapt, a layer at a time
    /// as the file reaches it: a LoRA reward model the ranks hold in parts is saved merged
    /// without being gathered whole first.
    pub fn save_folding(
        &self,
        config: &LlamaConfig,
        labels: &[String],
        dir: &Path,
        tokenizer_from: Option<&Path>,
        folds: &HashMap<String, Fold>,
    ) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| CoreError::cannot_write(dir, e))?;
        let mut this = self.clone();
        let precision = self.model.precision;
        write_pending_safetensors(
            &dir.join("model.safetensors"),
            pending_slot_tensors_folding(this.slots(), folds),
            precision,
        )?;
        let mut config = sequence_classification_config(config, labels);
        config
            .extra
            .insert("torch_dtype".into(), precision.torch_dtype().into());
        write_atomic(&dir.join("config.json"), config.to_json_string().as_bytes())?;
        if let Some(src) = tokenizer_from {
            crate::checkpoint::copy_tokenizer_files(src, dir)?;
        }
        Ok(())
    }
}

/// The config of a sequence classifier: architecture, `id2label` / `label2id` (HF derives
/// `num_labels` from them) and a pad token id (HF pools at the last non-pad token).
pub fn sequence_classification_config(config: &LlamaConfig, labels: &[String]) -> LlamaConfig {
    let mut config = config.clone();
    let arch = match config.model_type.as_str() {
        "qwen2" => "Qwen2ForSequenceClassification",
        "qwen3" => "Qwen3ForSequenceClassification",
        "olmo2" => "Olmo2ForSequenceClassification",
        "gemma2" => "Gemma2ForSequenceClassification",
        "gemma3_text" => "Gemma3TextForSequenceClassification",
        "phi3" => "Phi3ForSequenceClassification",
        "mistral" => "MistralForSequenceClassification",
        "mixtral" => "MixtralForSequenceClassification",
        "qwen3_moe" => "Qwen3MoeForSequenceClassification",
        _ => "LlamaForSequenceClassification",
    };
    config.architectures = Some(vec![arch.into()]);
    let id2label: serde_json::Map<String, Value> = labels
        .iter()
        .enumerate()
        .map(|(i, l)| (i.to_string(), Value::from(l.clone())))
        .collect();
    let label2id: serde_json::Map<String, Value> = labels
        .iter()
        .enumerate()
        .map(|(i, l)| (l.clone(), Value::from(i)))
        .collect();
    config.extra.insert("id2label".into(), Value::Object(id2label));
    config.extra.insert("label2id".into(), Value::Object(label2id));
    if config.pad_token_id.is_none() {
        config.pad_token_id = Some(0);
    }
    config
}

/// The output names of a sequence-classifier config, in order (`id2label`).
pub fn labels_of(config: &LlamaConfig) -> Vec<String> {
    let Some(Value::Object(map)) = config.extra.get("id2label") else {
        return Vec::new();
    };
    let mut pairs: Vec<(usize, String)> = map
        .iter()
        .filter_map(|(k, v)| Some((k.parse().ok()?, v.as_str()?.to_string())))
        .collect();
    pairs.sort();
    pairs.into_iter().map(|(_, l)| l).collect()
}
