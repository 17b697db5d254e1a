//! Supervised fine-tuning: next-token loss on response (assistant) tokens only.

use std::path::Path;

use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::data::Prompt;
use crate::error::{CoreError, Result};
use crate::model::CausalLm;
use crate::run::{RunDir, data_files};
use crate::score::pad_right;
use crate::start::policy_store;
pub use crate::store::CausalLmStore;
use crate::tokenizer::{ChatMessage, TextTokenizer};
use crate::train::{EvalSum, Objective, RunSummary, StepOutput, fit};

/// One SFT data line: prompt/response or a chat conversation.
#[derive(Debug, Clone)]
pub enum SftRow {
    PromptResponse { prompt: Prompt, response: String },
    Chat { messages: Vec<ChatMessage> },
}

/// By its fields: `{"prompt", "response"}` or `{"messages"}` (with an assistant turn to train
/// on); a missing, mistyped or mixed field is named.
impl<'de> Deserialize<'de> for SftRow {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        #[derive(Deserialize)]
        struct Fields {
            prompt: Option<Prompt>,
            response: Option<String>,
            messages: Option<Vec<ChatMessage>>,
        }
        let expected = "an SFT row is {\"prompt\", \"response\"} or {\"messages\": [...]}";
        match Fields::deserialize(d)? {
            Fields {
                prompt: Some(prompt),
                response: Some(response),
                messages: None,
            } => Ok(SftRow::PromptResponse { prompt, response }),
            Fields {
                prompt: None,
                response: None,
                messages: Some(messages),
            } => {
                if messages.is_empty() {
                    return Err(D::Error::custom("messages is empty"));
                }
                if !messages.iter().any(|m| m.role == "assistant") {
                    return Err(D::Error::custom(
                        "messages has no assistant turn (SFT trains on the assistant's turns)",
                    ));
                }
                Ok(SftRow::Chat { messages })
            }
            Fields {
                messages: Some(_),
                prompt,
                response,
            } => {
                let also: Vec<&str> = [("prompt", prompt.is_some()), ("response", response.is_some())]
                    .iter()
                    .filter(|(_, given)| *given)
                    .map(|(name, _)| *name)
                    .collect();
                Err(D::Error::custom(format!(
                    "the row has both messages and {}: give one form, not both ({expected})",
                    also.join(" and ")
                )))
            }
            Fields { prompt: Some(_), .. } => Err(D::Error::missing_field("response")),
            Fields {
                response: Some(_), ..
            } => Err(D::Error::missing_field("prompt")),
            _ => Err(D::Error::custom(format!(
                "no prompt, response or messages field ({expected})"
            ))),
        }
    }
}

/// A tokenized example: `ids`, and for each position whether that token is trained on.
/// A packed example holds several sequences; `starts` lists where each one begins.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SftExample {
    pub ids: Vec<u32>,
    pub trained: Vec<bool>,
    #[serde(default)]
    pub starts: Vec<usize>,
    /// Trained tokens that end a sequence or a turn (an EOS id: the one appended to a
    /// prompt/response pair, or a chat template's), so validation can report the NLL of the
    /// response tokens alone beside the one with them. Empty = none.
    #[serde(default)]
    pub end: Vec<bool>,
}

impl SftExample {
    /// Tokenizes a row: prompt/response pairs by the scoring convention plus EOS (so the model
    /// learns to stop); chats with the chat template, training every assistant turn. Truncated
    /// to `max_len` tokens.
    pub fn from_row(row: &SftRow, tokenizer: &TextTokenizer, max_len: usize) -> Result<Self> {
        let (mut ids, mut trained) = match row {
            SftRow::PromptResponse { prompt, response } => {
                let prompt = prompt.render(tokenizer)?;
                let mut ids = tokenizer.encode(&format!("{prompt}{response}"), true)?;
                let prompt_len = tokenizer.encode(&prompt, true)?.len().min(ids.len());
                ids.extend(tokenizer.eos_ids().first());
                let trained = (0..ids.len()).map(|i| i >= prompt_len.max(1)).collect();
                (ids, trained)
            }
            SftRow::Chat { messages } => {
                let full = tokenizer.encode(&tokenizer.apply_chat_template(messages, false)?, true)?;
                let mut trained = vec![false; full.len()];
                for (i, m) in messages.iter().enumerate().filter(|(_, m)| m.role == "assistant") {
                    let start = tokenizer
                        .encode(&tokenizer.apply_chat_template(&messages[..i], true)?, true)?
                        .len();
                    let end = tokenizer
                        .encode(&tokenizer.apply_chat_template(&messages[..=i], false)?, true)?
                        .len();
                    let _ = m;
                    for t in trained.iter_mut().take(end.min(full.len())).skip(start.max(1)) {
                        *t = true;
                    }
                }
                (full, trained)
            }
        };
        ids.truncate(max_len.max(2));
        trained.truncate(ids.len());
        if !trained.iter().any(|&t| t) {
            return Err(CoreError::Invalid(format!(
                "no response tokens left within max_seq_len {max_len} (sequence of {} tokens)",
                ids.len()
            )));
        }
        let eos = tokenizer.eos_ids();
        let end = ids
            .iter()
            .zip(&trained)
            .map(|(id, &t)| t && eos.contains(id))
            .collect();
        Ok(Self {
            ids,
            trained,
            starts: vec![0],
            end,
        })
    }

    /// Whether token `t` is a trained end token.
    fn is_end(&self, t: usize) -> bool {
        self.end.get(t).copied().unwrap_or(false)
    }

    /// Sequence index of each token (for packed rows).
    fn segments(&self) -> Vec<usize> {
        let mut seg = Vec::with_capacity(self.ids.len());
        let mut current = 0;
        for t in 0..self.ids.len() {
            if t > 0 && self.starts.contains(&t) {
                current += 1;
            }
            seg.push(current);
        }
        seg
    }

    /// Tokens that count in the loss.
    pub fn n_trained(&self) -> usize {
        self.trained.iter().filter(|&&t| t).count()
    }
}

/// Packs examples, in order, into rows of at most `max_len` tokens (sequence packing): fewer
/// padding tokens per batch, with attention kept inside each sequence.
pub fn pack_examples(examples: Vec<SftExample>, max_len: usize) -> Vec<SftExample> {
    let mut rows: Vec<SftExample> = Vec::new();
    for ex in examples {
        match rows.last_mut() {
            Some(row) if row.ids.len() + ex.ids.len() <= max_len => {
                row.starts.push(row.ids.len());
                // A row built without end marks gets them (all false) before more are added.
                row.end.resize(row.ids.len(), false);
                row.ids.extend(ex.ids);
                row.trained.extend(ex.trained);
                let mut end = ex.end;
                end.resize(row.trained.len() - row.end.len(), false);
                row.end.extend(end);
            }
            _ => rows.push(ex),
        }
    }
    rows
}

/// Tokenizes a whole file, reporting the first bad line with file and line number.
pub fn load_sft_examples(path: &Path, tokenizer: &TextTokenizer, max_len: usize) -> Result<Vec<SftExample>> {
    crate::data::load_examples(path, |row: &SftRow| SftExample::from_row(row, tokenizer, max_len))
}

/// `[batch, seq-1]` log-probs, the mask of trained tokens and their count; with
/// `response_only`, the end tokens ([`SftExample::end`]) are left out of the mask.
fn masked_logprobs(
    model: &CausalLm,
    batch: &[&SftExample],
    device: &Device,
) -> (Tensor<2>, Tensor<2>, usize) {
    let (lp, masks) = logprobs_and_masks(model, batch, device, &[false]);
    let (mask, n) = masks.into_iter().next().expect("one mask asked for");
    (lp, mask, n)
}

/// The mask of `batch`'s trained tokens as the positions predicting them, `[batch, width − 1]`
/// for rows padded to `width` tokens (position t predicts token t + 1), and their count; with
/// `skip_end`, the end tokens ([`SftExample::end`]) are left out.
pub fn trained_mask(
    batch: &[&SftExample],
    width: usize,
    skip_end: bool,
    device: &Device,
) -> (Tensor<2>, usize) {
    let b = batch.len();
    let mut mask = vec![0f32; b * (width - 1)];
    let mut n = 0;
    for (i, e) in batch.iter().enumerate() {
        for t in 1..e.ids.len() {
            if e.trained[t] && !(skip_end && e.is_end(t)) {
                mask[i * (width - 1) + t - 1] = 1.0;
                n += 1;
            }
        }
    }
    (
        Tensor::<2>::from_data(TensorData::new(mask, [b, width - 1]), device),
        n,
    )
}

/// The log-probs of `batch` and one trained-token mask (with its count) for each entry of
/// `response_only` (whether it leaves the end tokens out).
fn logprobs_and_masks(
    model: &CausalLm,
    batch: &[&SftExample],
    device: &Device,
    response_only: &[bool],
) -> (Tensor<2>, Vec<(Tensor<2>, usize)>) {
    let rows: Vec<&[u32]> = batch.iter().map(|e| e.ids.as_slice()).collect();
    let tokens = pad_right(&rows, 0, device);
    let [_, width] = tokens.dims();
    let masks = response_only
        .iter()
        .map(|&skip_end| trained_mask(batch, width, skip_end, device))
        .collect();
    let valid = crate::score::right_padding_valid(&rows);
    let logprobs = crate::model::with_valid_tokens(valid, || {
        if batch.iter().any(|e| e.starts.len() > 1) {
            let segments: Vec<Vec<Option<usize>>> = batch
                .iter()
                .map(|e| {
                    let mut s: Vec<Option<usize>> = e.segments().into_iter().map(Some).collect();
                    s.resize(width, None);
                    s
                })
                .collect();
            let (positions, attention) = crate::model::packed_layout(&segments, device);
            model.token_logprobs_with(tokens, &positions, Some(&attention))
        } else {
            model.token_logprobs(tokens)
        }
    });
    (logprobs, masks)
}

/// The SFT objective: mean NLL over trained tokens.
pub struct SftObjective;

impl Objective<CausalLm> for SftObjective {
    type Example = SftExample;

    fn step(&self, model: &CausalLm, batch: &[&SftExample]) -> Result<StepOutput> {
        let device = model.model.embed_tokens.weight.device();
        let (lp, mask, n) = masked_logprobs(model, batch, &device);
        let loss = (lp * mask).sum().neg().div_scalar(n.max(1) as f64);
        let tokens = batch.iter().map(|e| e.ids.len()).sum();
        Ok(StepOutput {
            loss,
            metrics: Vec::new(),
            tokens,
        })
    }

    /// The loss is a mean over trained tokens.
    fn loss_weight(&self, batch: &[&SftExample]) -> f64 {
        batch.iter().map(|e| e.n_trained()).sum::<usize>() as f64
    }

    /// `nll`: per trained token, end tokens (EOS) included, as the loss counts them;
    /// `nll_response`: per response token alone. The two part where a model learns where to
    /// stop but not the responses themselves.
    fn evaluate(&self, model: &CausalLm, batch: &[&SftExample]) -> Result<Vec<EvalSum>> {
        let device = model.model.embed_tokens.weight.device();
        let (lp, masks) = logprobs_and_masks(model, batch, &device, &[false, true]);
        let names = ["nll", "nll_response"];
        Ok(masks
            .into_iter()
            .zip(names)
            .map(|((mask, n), name)| EvalSum {
                name: name.into(),
                sum: -(lp.clone() * mask).sum().into_scalar::<f32>() as f64,
                weight: n as f64,
            })
            .collect())
    }

    fn plot_keys(&self) -> Vec<String> {
        vec!["eval_nll".into(), "eval_nll_response".into()]
    }
}

/// `[sft]`: options of supervised fine-tuning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SftSection {
    /// Pack several training sequences into each row of `data.max_seq_len` tokens.
    pub packing: bool,
}

/// `aligner sft` configuration: the shared sections and `[sft]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    pub model: crate::train::ModelSection,
    pub data: crate::train::DataSection,
    pub train: crate::train::TrainSection,
    pub sft: SftSection,
    pub parallel: crate::train::ParallelSection,
}

impl Default for SftConfig {
    /// The embedded default: the shipped model on the shipped tinystories_sentiment SFT data,
    /// two epochs in well under a minute on a laptop CPU.
    fn default() -> Self {
        Self {
            model: Default::default(),
            data: crate::train::DataSection::shipped("train.sft.jsonl", "test.sft.jsonl"),
            // Measured with `aligner eval` (lexicon of own samples, KL to the start model,
            // start model's NLL of them): lr 2e-3 went to 1.95 at KL 24 with NLL 2.00 — text
            // falling apart; 1e-4 reaches 2.28 at KL 2.1, NLL 1.22. The shipped responses are
            // the start model's own best-of-4, so SFT can shift their style, not fit them better.
            train: crate::train::TrainSection {
                lr: 1e-4,
                ..crate::train::TrainSection::embedded_default(2)
            },
            sft: SftSection::default(),
            parallel: Default::default(),
        }
    }
}

/// Supervised fine-tuning, the whole run: the model of `[model]` (LoRA adapters when
/// `model.lora_rank > 0`) trained on `data.train` (packed with `sft.packing`), validated on
/// `data.validation`, into `run` (or continued there when it is resumed).
pub fn train(config: &SftConfig, run: &RunDir, device: &Device) -> Result<RunSummary> {
    run.start(config)?;
    let files = data_files(&config.data)?;
    // In tensor groups, each rank reads only its blocks of the weights.
    let (lm, run) = crate::start::load_model_split(&config.model, &config.parallel, run, device)?;
    let run = &run;
    let max_len = config.data.max_len(&lm.config)?;
    let (mut train, validation) = files.load(|path, _| load_sft_examples(path, &lm.tokenizer, max_len))?;
    if config.sft.packing {
        let sequences = train.len();
        train = pack_examples(train, max_len);
        tracing::info!(sequences, rows = train.len(), "packed");
    }
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device)?;
    tracing::info!(train = train.len(), validation = validation.len(), "SFT");
    fit(
        model,
        &SftObjective,
        (&train, &validation),
        store.as_ref(),
        &config.train,
        run,
        device,
    )
}
