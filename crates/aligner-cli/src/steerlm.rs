//! `aligner steerlm attributes|annotate|sft`: the three steps of SteerLM.

use std::path::PathBuf;

use aligner_core::adapter::RewardLoraStore;
use aligner_core::data::read_jsonl;
use aligner_core::reward::{RewardModel, labels_of};
use aligner_core::rm::RewardModelStore;
use aligner_core::sft::{SftExample, SftObjective};
use aligner_core::train::ModelStore;
use aligner_core::{Device, LlamaConfig, LoadedModel, TextTokenizer};
use aligner_steerlm::attribute_model::{attribute_examples, load_attribute_rows, predict, row_ids};
use aligner_steerlm::conditioning::bucket;
use aligner_steerlm::{
    AttributeObjective, AttributeRow, BalanceSection, SteerConfig, balanced, conditioned_rows,
};
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;

use crate::train::{Run, TrainArgs, lora_spec, model_dir, policy_store, prepare_with, trainer_parts};

#[derive(Subcommand)]
pub enum SteerCommand {
    /// Step 1: train the attribute prediction model (multi-output regression, masked MSE).
    Attributes(TrainArgs),
    /// Step 2: label prompt/response data with an attribute model.
    Annotate(AnnotateArgs),
    /// Step 3: attribute-conditioned SFT.
    Sft(TrainArgs),
}

#[derive(Args)]
pub struct AnnotateArgs {
    /// Attribute model folder (from `aligner steerlm attributes`).
    #[arg(long)]
    model: PathBuf,
    /// `{"prompt", "response"}` JSON Lines.
    #[arg(long)]
    data: PathBuf,
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
}

pub fn run(cmd: SteerCommand, device: &Device) -> Result<()> {
    match cmd {
        SteerCommand::Attributes(args) => attributes(args, device),
        SteerCommand::Annotate(args) => annotate(args, device),
        SteerCommand::Sft(args) => sft(args, device),
    }
}

fn attributes(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, out) = prepare_with(&args, "steerlm-attributes", &SteerConfig::for_step(3, 2e-3))?;
    let (train_path, val_path) = trainer_parts(&config.data, &config.train)?;
    let names = config.steerlm.attributes.clone();
    let dir = model_dir(&config.model)?;
    let llama = LlamaConfig::from_file(&dir.join("config.json"))?;
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let mut model = RewardModel::load(&dir, &llama, names.len(), device)
        .with_context(|| format!("loading model {}", dir.display()))?;
    let max_len = config.data.max_seq_len;
    let examples = |path| -> Result<_> {
        let rows = load_attribute_rows(path, &names)?;
        Ok(attribute_examples(&rows, &names, &tokenizer, max_len)?)
    };
    let train = examples(&train_path)?;
    let validation = match &val_path {
        Some(p) => examples(p)?,
        None => Vec::new(),
    };
    let store: Box<dyn ModelStore<RewardModel>> = match lora_spec(&config.model) {
        Some(spec) => {
            model.model.attach_lora(&spec, device);
            Box::new(RewardLoraStore {
                config: llama,
                labels: names.clone(),
                base_dir: dir.clone(),
                spec,
            })
        }
        None => Box::new(RewardModelStore {
            config: llama,
            labels: names.clone(),
            tokenizer_dir: dir.clone(),
        }),
    };
    tracing::info!(train = train.len(), validation = validation.len(), attributes = ?names, "SteerLM attribute model");
    let run = Run {
        args: &args,
        out: &out,
        device,
    };
    run.fit(
        &config.train,
        &AttributeObjective { names },
        store.as_ref(),
        &train,
        &validation,
        model,
    )
}

fn annotate(args: AnnotateArgs, device: &Device) -> Result<()> {
    let llama = LlamaConfig::from_file(&args.model.join("config.json"))
        .with_context(|| format!("reading {}", args.model.join("config.json").display()))?;
    let names = labels_of(&llama);
    let tokenizer = TextTokenizer::from_dir(&args.model)?;
    let model = RewardModel::load(&args.model, &llama, names.len(), device)
        .with_context(|| format!("loading attribute model {}", args.model.display()))?;
    let rows: Vec<AttributeRow> = read_jsonl(&args.data)?;
    let ids = rows
        .iter()
        .map(|r| row_ids(r, &tokenizer, llama.max_position_embeddings))
        .collect::<Result<Vec<_>, _>>()?;
    let bar = crate::progress(
        rows.len() as u64,
        "{bar:30} {pos}/{len} rows annotated [{elapsed} < {eta}]",
    );
    let predictions = predict(&model, &ids, args.batch_size, &|n| bar.inc(n as u64))?;
    bar.finish_and_clear();
    let out: Vec<serde_json::Value> = rows
        .iter()
        .zip(&predictions)
        .map(|(row, pred)| {
            let attributes: serde_json::Map<String, serde_json::Value> = names
                .iter()
                .zip(pred)
                .map(|(n, &v)| (n.clone(), json!(bucket(v as f64))))
                .collect();
            json!({"prompt": row.prompt, "response": row.response, "attributes": attributes})
        })
        .collect();
    crate::write_jsonl(Some(&args.out), &out)?;
    tracing::info!(rows = out.len(), attributes = ?names, out = %args.out.display(), "annotated");
    Ok(())
}

fn sft(args: TrainArgs, device: &Device) -> Result<()> {
    // The conditioning is learned slowly by a 260K model (measured without oversampling:
    // positivity 0 → 4 moves the lexicon by +0.3 after 2 epochs, +0.9 after 4, +1.5 after 8),
    // and values the data barely has not at all: positivity 0 and 1 (160 of 2,500 rows)
    // sampled as positive as 2, verbosity 1 as long as 0. Oversampling the rare values of
    // both (6 epochs over the 5,090 rows that makes) steers them: lexicon at positivity
    // 0..4 −0.14, −0.14, 0.41, 0.84, 1.51 (was 0.45, 0.35, 0.38, 0.78, 1.81); verbosity 1
    // adds 2.2 words to 48 tokens (was 0.2).
    let mut defaults = SteerConfig::for_step(6, 3e-3);
    defaults.balance.attributes = ["positivity", "verbosity"].map(String::from).to_vec();
    let (config, out) = prepare_with(&args, "steerlm-sft", &defaults)?;
    let (train_path, val_path) = trainer_parts(&config.data, &config.train)?;
    let names = &config.steerlm.attributes;
    let dir = model_dir(&config.model)?;
    let lm =
        LoadedModel::from_dir(&dir, device).with_context(|| format!("loading model {}", dir.display()))?;
    let max_len = config.data.max_seq_len;
    let examples = |path, balance: &BalanceSection| -> Result<Vec<SftExample>> {
        let rows = balanced(&load_attribute_rows(path, names)?, balance);
        conditioned_rows(&rows, &config.steerlm, &lm.tokenizer)?
            .iter()
            .map(|row| Ok(SftExample::from_row(row, &lm.tokenizer, max_len)?))
            .collect()
    };
    // Oversampling reweights training only; validation keeps the data's own distribution.
    let train = examples(&train_path, &config.balance)?;
    let validation = match &val_path {
        Some(p) => examples(p, &BalanceSection::default())?,
        None => Vec::new(),
    };
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &dir, device);
    tracing::info!(train = train.len(), validation = validation.len(), template = %config.steerlm.template, "SteerLM conditioned SFT");
    let run = Run {
        args: &args,
        out: &out,
        device,
    };
    run.fit(
        &config.train,
        &SftObjective,
        store.as_ref(),
        &train,
        &validation,
        model,
    )?;
    // Generation applies the same template and order.
    config.steerlm.save(&out.join("final"))?;
    Ok(())
}
