//! `aligner convert`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum ConvertCommand {
    /// A llama2.c checkpoint (+ SentencePiece tokenizer) to a Hugging Face folder.
    Llama2c {
        /// The llama2.c `model.bin`.
        #[arg(long)]
        input: PathBuf,
        /// The SentencePiece `tok.model`.
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Write into a folder that already holds a model (never onto an input).
        #[arg(long)]
        overwrite: bool,
    },
    /// Merge a LoRA adapter folder (PEFT format) into its base model.
    MergeLora {
        /// Folder with adapter_config.json and adapter_model.safetensors.
        #[arg(long)]
        adapter: PathBuf,
        /// Base model folder (default: the adapter's base_model_name_or_path).
        #[arg(long)]
        base: Option<PathBuf>,
        /// Output folder for the merged model.
        #[arg(long)]
        out: PathBuf,
        /// Write into a folder that already holds a model (never onto an input).
        #[arg(long)]
        overwrite: bool,
    },
    /// A shallower model from some of a model's decoder layers (a distillation student
    /// initialised from its teacher), e.g. `--layers 0,2,4`.
    KeepLayers {
        /// The model folder.
        #[arg(long)]
        model: PathBuf,
        /// Indices of the decoder layers to keep, in order.
        #[arg(long, value_delimiter = ',', required = true)]
        layers: Vec<usize>,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Write into a folder that already holds a model (never onto an input).
        #[arg(long)]
        overwrite: bool,
    },
}

/// The files of a model folder that a conversion writes and an earlier model there would lose.
const MODEL_FILES: [&str; 2] = ["config.json", "model.safetensors"];

pub fn run(cmd: ConvertCommand, device: &aligner_core::Device) -> Result<()> {
    match cmd {
        ConvertCommand::Llama2c {
            input,
            tokenizer,
            out,
            overwrite,
        } => {
            let mut inputs = vec![input.as_path()];
            inputs.extend(tokenizer.as_deref());
            crate::output::check_folder("--out", &out, &MODEL_FILES, &inputs, overwrite)?;
            let header = aligner_core::llama2c::convert(&input, tokenizer.as_deref(), &out)?;
            tracing::info!(?header, out = %out.display(), "converted llama2.c checkpoint");
            Ok(())
        }
        ConvertCommand::MergeLora {
            adapter,
            base,
            out,
            overwrite,
        } => {
            let mut inputs = vec![adapter.as_path()];
            inputs.extend(base.as_deref());
            crate::output::check_folder("--out", &out, &MODEL_FILES, &inputs, overwrite)?;
            aligner_core::adapter::merge_adapter(&adapter, base.as_deref(), &out, device)?;
            tracing::info!(out = %out.display(), "merged adapter into its base");
            Ok(())
        }
        ConvertCommand::KeepLayers {
            model,
            layers,
            out,
            overwrite,
        } => {
            crate::output::check_folder("--out", &out, &MODEL_FILES, &[&model], overwrite)?;
            let lm = aligner_core::LoadedModel::from_dir(&model, device)?.with_layers(&layers)?;
            lm.save(&out)?;
            tracing::info!(out = %out.display(), ?layers, parameters = lm.parameter_count(), "kept layers");
            Ok(())
        }
    }
}
