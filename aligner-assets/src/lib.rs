//! # aligner-assets
//!
//! The files aligner ships, embedded so that a binary or a crate that depends on aligner runs
//! its defaults from any folder: the default model, `stories260K` (a real trained
//! 260K-parameter Llama, karpathy's tinyllamas, MIT — `stories260K/SOURCE.txt`), and the
//! `tinystories_sentiment` alignment task in that model's domain (`tinystories_sentiment/SOURCE.txt`).
//!
//! [`model_dir`] and [`sentiment_dir`] give the folders on disk when this package's own files
//! are there (a checkout, or cargo's copy of the package); [`MODEL`] and [`SENTIMENT`] hold
//! the bytes for when they are not (an installed binary).

use std::path::PathBuf;

/// Bytes of one shipped folder's files, by file name.
pub type Files = &'static [(&'static str, &'static [u8])];

/// The default model's files (a Hugging Face `LlamaForCausalLM` folder).
pub const MODEL: Files = &[
    ("config.json", include_bytes!("../stories260K/config.json")),
    (
        "generation_config.json",
        include_bytes!("../stories260K/generation_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../stories260K/model.safetensors"),
    ),
    (
        "special_tokens_map.json",
        include_bytes!("../stories260K/special_tokens_map.json"),
    ),
    ("tokenizer.json", include_bytes!("../stories260K/tokenizer.json")),
    (
        "tokenizer_config.json",
        include_bytes!("../stories260K/tokenizer_config.json"),
    ),
];

/// The tinystories_sentiment files the embedded defaults train and evaluate on (the raw
/// scored samples are left out: no default reads them).
pub const SENTIMENT: Files = &[
    (
        "SOURCE.txt",
        include_bytes!("../tinystories_sentiment/SOURCE.txt"),
    ),
    (
        "train.sft.jsonl",
        include_bytes!("../tinystories_sentiment/train.sft.jsonl"),
    ),
    (
        "train.pref.jsonl",
        include_bytes!("../tinystories_sentiment/train.pref.jsonl"),
    ),
    (
        "train.kto.jsonl",
        include_bytes!("../tinystories_sentiment/train.kto.jsonl"),
    ),
    (
        "train.prompts.jsonl",
        include_bytes!("../tinystories_sentiment/train.prompts.jsonl"),
    ),
    (
        "train.steer.jsonl",
        include_bytes!("../tinystories_sentiment/train.steer.jsonl"),
    ),
    (
        "test.sft.jsonl",
        include_bytes!("../tinystories_sentiment/test.sft.jsonl"),
    ),
    (
        "test.pref.jsonl",
        include_bytes!("../tinystories_sentiment/test.pref.jsonl"),
    ),
    (
        "test.kto.jsonl",
        include_bytes!("../tinystories_sentiment/test.kto.jsonl"),
    ),
    (
        "test.prompts.jsonl",
        include_bytes!("../tinystories_sentiment/test.prompts.jsonl"),
    ),
    (
        "test.steer.jsonl",
        include_bytes!("../tinystories_sentiment/test.steer.jsonl"),
    ),
];

/// This package's folder of the default model, when its files are on disk.
pub fn model_dir() -> Option<PathBuf> {
    on_disk("stories260K", MODEL)
}

/// This package's folder of the tinystories_sentiment task, when its files are on disk.
pub fn sentiment_dir() -> Option<PathBuf> {
    on_disk("tinystories_sentiment", SENTIMENT)
}

fn on_disk(folder: &str, files: Files) -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(folder);
    files
        .iter()
        .all(|(name, _)| dir.join(name).is_file())
        .then_some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_files_are_the_ones_on_disk() {
        for (dir, files) in [(model_dir(), MODEL), (sentiment_dir(), SENTIMENT)] {
            let dir = dir.expect("the package's files are on disk in a checkout");
            for (name, bytes) in files {
                assert_eq!(std::fs::read(dir.join(name)).unwrap(), *bytes, "{name}");
            }
        }
    }
}
