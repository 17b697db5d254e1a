//! Property tests of the parsers that read what users hand in: JSON Lines data, `--set`
//! overrides of the TOML configuration, and safetensors headers. Whatever the input, each
//! returns a value or an error; none panics, and valid input reads back as written.

use std::path::Path;

use aligner_core::data::{Prompt, PromptResponseRow, read_jsonl_numbered};
use aligner_core::sft::SftRow;
use aligner_core::train::{DataSection, ModelSection, TrainSection, load_config};
use aligner_core::{Device, LlamaConfig};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct Config {
    model: ModelSection,
    data: DataSection,
    train: TrainSection,
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any bytes: rows or an error, never a panic.
    #[test]
    fn jsonl_of_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "any.jsonl", &bytes);
        let _ = read_jsonl_numbered::<SftRow>(&path);
        let _ = read_jsonl_numbered::<PromptResponseRow>(&path);
    }

    /// JSON-ish lines (the characters JSON is made of): the error, when there is one, names
    /// the file and a line that exists.
    #[test]
    fn jsonl_errors_name_an_existing_line(lines in proptest::collection::vec("[{}\\[\\]\":, a-z0-9]{0,40}", 1..6)) {
        let dir = tempfile::tempdir().unwrap();
        let text = lines.join("\n");
        let path = write(dir.path(), "rows.jsonl", text.as_bytes());
        if let Err(e) = read_jsonl_numbered::<SftRow>(&path) {
            let message = e.to_string();
            prop_assert!(message.contains("rows.jsonl"), "{}", message);
            // `rows.jsonl:N: why` for a bad line, `rows.jsonl: no rows` for a file without any.
            let after = message.split("rows.jsonl:").nth(1).unwrap_or("");
            if let Ok(line) = after.split(':').next().unwrap_or("").parse::<usize>() {
                prop_assert!(line >= 1 && line <= lines.len(), "{}", message);
            } else {
                prop_assert!(message.contains("no rows"), "{}", message);
            }
        }
    }

    /// Valid rows, with blank lines and CRLF between them, read back as written and numbered
    /// by their line in the file.
    #[test]
    fn valid_rows_read_back_with_their_lines(
        rows in proptest::collection::vec((any::<String>(), any::<String>(), 0usize..3, any::<bool>()), 1..8),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::new();
        let mut expected = Vec::new();
        let mut line = 0;
        for (prompt, response, blanks, crlf) in &rows {
            for _ in 0..*blanks {
                text.push('\n');
                line += 1;
            }
            let row = serde_json::json!({"prompt": prompt, "response": response});
            text.push_str(&row.to_string());
            text.push_str(if *crlf { "\r\n" } else { "\n" });
            line += 1;
            expected.push((line, prompt.clone(), response.clone()));
        }
        let path = write(dir.path(), "valid.jsonl", text.as_bytes());
        let read = read_jsonl_numbered::<PromptResponseRow>(&path).unwrap();
        let got: Vec<(usize, String, String)> = read
            .into_iter()
            .map(|(l, r)| match r.prompt {
                Prompt::Text(p) => (l, p, r.response),
                Prompt::Messages(_) => unreachable!("a string prompt"),
            })
            .collect();
        prop_assert_eq!(got, expected);
    }

    /// Any `--set` text: a configuration or an error, never a panic.
    #[test]
    fn any_override_never_panics(set in "\\PC{0,40}") {
        let _ = load_config(&Config::default(), None, &[set]);
    }

    /// Overrides of known keys read back (TOML integers are i64, so seeds up to 2^63 - 1);
    /// NaN and infinities are refused naming the key.
    #[test]
    fn overrides_of_known_keys_read_back(steps in 0usize..1_000_000, lr in 1e-9f64..10.0, seed in 0..=i64::MAX as u64) {
        let sets = [format!("train.max_steps={steps}"), format!("train.lr={lr:e}"), format!("train.seed = {seed}")];
        let config = load_config(&Config::default(), None, &sets).unwrap();
        prop_assert_eq!(config.train.max_steps, steps);
        prop_assert_eq!(config.train.lr, lr);
        prop_assert_eq!(config.train.seed, seed);
        for bad in ["nan", "inf", "-inf"] {
            let err = load_config(&Config::default(), None, &[format!("train.lr={bad}")]).unwrap_err().to_string();
            prop_assert!(err.contains("train.lr"), "{}", err);
        }
    }

    /// The shipped weights with their header damaged (its length, its bytes, or the file cut
    /// short): an error naming the file or a tensor, never a panic.
    #[test]
    fn damaged_safetensors_headers_are_errors(
        length in prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in prop_oneof![Just(None), any::<prop::sample::Index>().prop_map(Some)],
    ) {
        let shipped = aligner_core::default_model_dir().unwrap();
        let mut bytes = std::fs::read(shipped.join("model.safetensors")).unwrap();
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        if let Some(length) = length {
            bytes[..8].copy_from_slice(&length.to_le_bytes());
        }
        for (at, byte) in &flips {
            bytes[8 + at.index(header)] = *byte;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "model.safetensors", &bytes);
        let config = LlamaConfig::from_file(&shipped.join("config.json")).unwrap();
        match aligner_core::checkpoint::load_causal_lm(dir.path(), &config, &Device::flex()) {
            Ok(_) => prop_assert!(length.is_none() && cut.is_none(), "a damaged length or a cut file loaded"),
            Err(e) => {
                let message = e.to_string();
                prop_assert!(
                    message.contains("model.safetensors") || message.contains("tensor"),
                    "{}",
                    message
                );
            }
        }
    }
}
