//! # aligner-tests
//!
//! The end-to-end tests of aligner: each test file runs the real `aligner` binary (built by
//! `cargo test --release --workspace` from aligner-cli) on the shipped model and data. This
//! library holds what they share: where the binary and the repository are, running it, and
//! reading what it wrote.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `aligner` binary of this build: `target/<profile>/aligner`, beside the `deps/` folder
/// that holds the running test. `cargo test --workspace` builds it (aligner-cli has a test of
/// its own); run alone, this package needs `cargo build -p aligner-cli` with the same profile.
pub fn aligner_exe() -> PathBuf {
    let test = std::env::current_exe().expect("the running test's path");
    let profile_dir = test
        .parent()
        .and_then(Path::parent)
        .expect("tests run from target/<profile>/deps");
    let exe = profile_dir.join(format!("aligner{}", std::env::consts::EXE_SUFFIX));
    assert!(
        exe.exists(),
        "{} is missing: run `cargo test --workspace` (or `cargo build -p aligner-cli` with this profile) first",
        exe.display()
    );
    exe
}

/// Runs the `aligner` binary from the repository root: (success, stderr).
pub fn aligner(args: &[&str]) -> (bool, String) {
    let (ok, _, stderr) = aligner_output(args);
    (ok, stderr)
}

/// Runs the `aligner` binary from the repository root: (success, stdout, stderr).
pub fn aligner_output(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(aligner_exe())
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The rows of a JSON-lines file.
pub fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub fn metrics(run: &Path) -> Vec<Value> {
    jsonl(&run.join("metrics.jsonl"))
}

pub fn first_and_last(rows: &[Value], key: &str) -> (f64, f64) {
    let values: Vec<f64> = rows.iter().filter_map(|r| r[key].as_f64()).collect();
    (values[0], *values.last().unwrap())
}

/// The tinystories_sentiment lexicon score (assets/tinystories_sentiment/SOURCE.txt): positive
/// minus negative words, words being lower-cased runs of [a-z'].
pub fn lexicon_score(text: &str) -> i64 {
    const POSITIVE: &str = "happy happily smiled smile smiles laughed laugh fun love loved loves friend friends good great kind nice hug hugged play played together yay glad enjoy enjoyed best beautiful proud excited thank thanked";
    const NEGATIVE: &str = "sad sadly cried cry crying scared angry mad hurt bad upset lost alone broke broken afraid fear tears mean never sorry ouch pain sick";
    let lower = text.to_lowercase();
    let words = lower.split(|c: char| !(c.is_ascii_lowercase() || c == '\''));
    words
        .filter(|w| !w.is_empty())
        .map(|w| POSITIVE.split(' ').any(|p| p == w) as i64 - NEGATIVE.split(' ').any(|n| n == w) as i64)
        .sum()
}

/// Mean lexicon score of the `"response"` of each row of a JSON-lines file.
pub fn mean_lexicon(path: &Path) -> f64 {
    let rows = jsonl(path);
    rows.iter()
        .map(|r| lexicon_score(r["response"].as_str().unwrap()) as f64)
        .sum::<f64>()
        / rows.len() as f64
}

/// Mean lexicon score of a model's own samples on the held-out prompts (temperature 1,
/// 48 new tokens).
pub fn sample_sentiment(model: &Path, out: &Path) -> f64 {
    sample_sentiment_with(model, out, &[])
}

/// [`sample_sentiment`] with more `aligner generate` arguments (e.g. `--attributes`).
pub fn sample_sentiment_with(model: &Path, out: &Path, extra: &[&str]) -> f64 {
    sample_sentiment_seeded(model, out, 1, extra)
}

/// [`sample_sentiment_with`] drawing with `seed`.
pub fn sample_sentiment_seeded(model: &Path, out: &Path, seed: u64, extra: &[&str]) -> f64 {
    let seed = seed.to_string();
    let prompts = repo().join("assets/tinystories_sentiment/test.prompts.jsonl");
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "48",
        "--temperature",
        "1",
        "--seed",
        &seed,
        "--batch-size",
        "32",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (ok, err) = aligner(&args);
    assert!(ok, "{err}");
    mean_lexicon(out)
}

/// The f32 tensors of a model folder's `model.safetensors`, by name.
pub fn tensors(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect()
}

/// Largest absolute difference between the weights of two model folders.
pub fn weights_diff(a: &Path, b: &Path) -> f32 {
    let (a, b) = (tensors(a), tensors(b));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .flat_map(|(name, x)| x.iter().zip(&b[name]).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// A small reward model (a few steps on the shipped pairs) for tests that only need one.
pub fn quick_reward_model(dir: &Path) -> PathBuf {
    let run = dir.join("rm");
    let (ok, err) = aligner(&[
        "rm",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.max_steps=30",
        "--set",
        "train.save_every=0",
        "--set",
        "train.eval_every=0",
    ]);
    assert!(ok, "{err}");
    run.join("final")
}
