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
    },
}

pub fn run(cmd: ConvertCommand) -> Result<()> {
    match cmd {
        ConvertCommand::Llama2c {
            input,
            tokenizer,
            out,
        } => {
            let header = aligner_core::llama2c::convert(&input, tokenizer.as_deref(), &out)?;
            tracing::info!(?header, out = %out.display(), "converted llama2.c checkpoint");
            Ok(())
        }
    }
}
