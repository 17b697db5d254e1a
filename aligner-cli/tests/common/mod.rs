//! What the end-to-end tests share (`mod common;` in each test file): where the binary and the
//! repository are, running the binary, and reading what it wrote. Each test file uses part of
//! it, hence `dead_code` allowed.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `aligner` binary cargo built for these tests (integration tests of aligner-cli, so cargo
/// builds it, with this build's profile and features, before any of them runs: an edit is
/// never tested against an older binary).
pub fn aligner_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_aligner"))
}

/// Runs the `aligner` binary from the repository root: (success, stderr).
pub fn aligner(args: &[&str]) -> (bool, String) {
    let (ok, _, stderr) = aligner_output(args);
    (ok, stderr)
}

/// Runs the `aligner` binary from the repository root: (success, stdout, stderr).
pub fn aligner_output(args: &[&str]) -> (bool, String, String) {
    aligner_output_with(args, &[])
}

/// [`aligner_output`] with more environment variables for the process.
pub fn aligner_output_with(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(aligner_exe())
        .args(args)
        .envs(env.iter().copied())
        .current_dir(repo())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The first `n` lines of the shipped data file `file` (in `assets/tinystories_sentiment`),
/// written to `out`: a slice for tests that need the data's form, not all of it.
pub fn head(file: &str, n: usize, out: &Path) -> PathBuf {
    let text = std::fs::read_to_string(repo().join("assets/tinystories_sentiment").join(file)).unwrap();
    let lines: String = text.lines().take(n).map(|l| format!("{l}\n")).collect();
    std::fs::write(out, lines).unwrap();
    out.to_path_buf()
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
/// minus negative words, words being lower-cased runs of [a-z']. The library's own function,
/// the one copy of the lexicon, which the frontier and the built-in reward also use.
pub fn lexicon_score(text: &str) -> i64 {
    aligner_gen::frontier::sentiment_lexicon(text)
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

/// The tensors of a model folder's `model.safetensors` as f32 values (F32, F16 or BF16 in
/// the file), by name.
pub fn tensors(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view.data();
            let values = match view.dtype() {
                safetensors::Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                safetensors::Dtype::F16 => data
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                safetensors::Dtype::BF16 => data
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                other => panic!("{name}: {other:?}"),
            };
            (name, values)
        })
        .collect()
}

/// The dtypes a model folder's `model.safetensors` holds (`["F16"]` for an f16 model).
pub fn saved_dtypes(dir: &Path) -> Vec<String> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut dtypes: Vec<String> = file
        .tensors()
        .iter()
        .map(|(_, v)| format!("{:?}", v.dtype()))
        .collect();
    dtypes.sort();
    dtypes.dedup();
    dtypes
}

/// Largest absolute difference between the weights of two model folders.
pub fn weights_diff(a: &Path, b: &Path) -> f32 {
    let (a, b) = (tensors(a), tensors(b));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .flat_map(|(name, x)| x.iter().zip(&b[name]).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// A small reward model (30 steps on the shipped pairs) for tests that only need one: trained
/// once per build and shared (see [`shared_run`]); the tests only read it.
pub fn quick_reward_model() -> PathBuf {
    shared_run(
        "quick-rm",
        &[
            "rm",
            "--set",
            "train.max_steps=30",
            "--set",
            "train.save_every=0",
            "--set",
            "train.eval_every=0",
        ],
    )
    .join("final")
}

/// The default DPO run (`aligner dpo`, no checkpoints), trained once per build and shared (see
/// [`shared_run`]): the default-run test reads its metrics and samples it, and distillation
/// takes it as its teacher. The run folder, not `final/`.
pub fn default_dpo_run() -> PathBuf {
    shared_run("default-dpo", &["dpo", "--set", "train.save_every=0"])
}

/// A run that several tests read and none changes (a reward model, an attribute model, an SFT
/// model), trained once per build of `aligner` and shared by every test and every test binary
/// that asks for it. The first caller trains it (`args` plus `--out`) under a file lock; the
/// others, in this process or in another one (nextest runs each test in a process of its own),
/// wait on the lock and reuse the folder. The folder is keyed by the binary (size and time) and
/// the arguments, so a rebuilt `aligner` or other settings train anew, and lives in the target
/// folder beside the binary. A run that failed or was cut leaves no `.complete` mark and is
/// trained again by the next caller.
pub fn shared_run(name: &str, args: &[&str]) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let exe = aligner_exe();
    let built = std::fs::metadata(&exe).unwrap();
    let mut key = std::hash::DefaultHasher::new();
    built.len().hash(&mut key);
    built.modified().unwrap().hash(&mut key);
    args.hash(&mut key);
    let root = exe.parent().unwrap().join("aligner-test-runs");
    std::fs::create_dir_all(&root).unwrap();
    let id = format!("{name}-{:016x}", key.finish());
    let dir = root.join(&id);
    let lock = std::fs::File::create(root.join(format!("{id}.lock"))).unwrap();
    lock.lock().unwrap();
    if !dir.join(".complete").exists() {
        // Runs of an earlier build under this name (`{name}-` and a 16-digit key, nothing
        // longer, so another name that starts with this one keeps its runs) are of no more use.
        let earlier = format!("{name}-");
        for entry in std::fs::read_dir(&root).unwrap().flatten() {
            let file = entry.file_name().to_string_lossy().into_owned();
            let key = file.strip_prefix(&earlier).unwrap_or_default();
            if key.len() == 16 && key.chars().all(|c| c.is_ascii_hexdigit()) && entry.path().is_dir() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let mut full = args.to_vec();
        full.extend(["--out", dir.to_str().unwrap()]);
        let (ok, err) = aligner(&full);
        assert!(ok, "the shared run {name} failed: {err}");
        std::fs::write(dir.join(".complete"), "").unwrap();
    }
    dir
}

/// The scalars of every TensorBoard event file in `run/tb/` as `(tag, step) -> value`, read
/// here independently of aligner: TFRecord framing with each length and CRC checked (masked
/// CRC-32C), and the `Event` / `Summary` protobufs decoded field by field.
pub fn tensorboard_scalars(run: &Path) -> std::collections::BTreeMap<(String, i64), f32> {
    tensorboard_values(run)
        .into_iter()
        .map(|(tag, step, v)| ((tag, step), v))
        .collect()
}

/// The `(tag, step)`s that more than one TensorBoard event of the run holds.
pub fn tensorboard_repeats(run: &Path) -> Vec<(String, i64)> {
    let mut seen = std::collections::BTreeMap::new();
    for (tag, step, _) in tensorboard_values(run) {
        *seen.entry((tag, step)).or_insert(0) += 1;
    }
    seen.into_iter().filter(|(_, n)| *n > 1).map(|(k, _)| k).collect()
}

/// Every scalar of every event file of `run/tb`: `(tag, step, value)`, read independently of
/// aligner-core's reader.
fn tensorboard_values(run: &Path) -> Vec<(String, i64, f32)> {
    fn masked(bytes: &[u8]) -> u32 {
        crc32c::crc32c(bytes).rotate_right(15).wrapping_add(0xa282_ead8)
    }
    fn varint(b: &[u8], at: &mut usize) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[*at];
            *at += 1;
            v |= ((byte & 0x7f) as u64) << shift;
            if byte & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }
    /// `(field, wire type, payload)` of a message.
    fn fields(b: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < b.len() {
            let key = varint(b, &mut at);
            let (field, wire) = (key >> 3, key & 7);
            let payload = match wire {
                0 => varint(b, &mut at).to_le_bytes().to_vec(),
                1 => {
                    at += 8;
                    b[at - 8..at].to_vec()
                }
                2 => {
                    let len = varint(b, &mut at) as usize;
                    at += len;
                    b[at - len..at].to_vec()
                }
                5 => {
                    at += 4;
                    b[at - 4..at].to_vec()
                }
                other => panic!("wire type {other}"),
            };
            out.push((field, wire, payload));
        }
        out
    }
    let mut scalars = Vec::new();
    let files: Vec<_> = std::fs::read_dir(run.join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(!files.is_empty(), "no event file in {}", run.join("tb").display());
    for file in files {
        let bytes = std::fs::read(&file).unwrap();
        let mut at = 0;
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            assert_eq!(
                masked(len_bytes).to_le_bytes(),
                bytes[at + 8..at + 12],
                "length CRC"
            );
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(
                masked(data).to_le_bytes(),
                bytes[at + 12 + len..at + 16 + len],
                "data CRC"
            );
            at += 16 + len;
            let event = fields(data);
            let step = event
                .iter()
                .find(|f| f.0 == 2)
                .map_or(0, |f| u64::from_le_bytes(f.2[..8].try_into().unwrap()) as i64);
            for summary in event.iter().filter(|f| f.0 == 5) {
                for value in fields(&summary.2).into_iter().filter(|f| f.0 == 1) {
                    let value = fields(&value.2);
                    let tag = value
                        .iter()
                        .find(|f| f.0 == 1)
                        .map(|f| String::from_utf8(f.2.clone()).unwrap());
                    let simple = value.iter().find(|f| f.0 == 2 && f.1 == 5);
                    if let (Some(tag), Some(simple)) = (tag, simple) {
                        scalars.push((tag, step, f32::from_le_bytes(simple.2[..4].try_into().unwrap())));
                    }
                }
            }
        }
    }
    scalars
}

/// Every number of every row of `run/metrics.jsonl` is a TensorBoard scalar of the same name
/// at the same step (to f32 precision).
pub fn assert_tensorboard_matches_metrics(run: &Path) {
    let scalars = tensorboard_scalars(run);
    let mut checked = 0;
    for row in metrics(run) {
        let step = row["step"].as_f64().unwrap() as i64;
        for (key, value) in row.as_object().unwrap() {
            let Some(v) = value.as_f64().filter(|_| key != "step") else {
                continue;
            };
            let tb = scalars
                .get(&(key.clone(), step))
                .unwrap_or_else(|| panic!("no TensorBoard scalar {key} at step {step}"));
            assert!(
                (*tb as f64 - v).abs() <= 1e-6 * v.abs().max(1.0),
                "{key} at step {step}: {tb} in TensorBoard, {v} in metrics.jsonl"
            );
            checked += 1;
        }
    }
    assert!(checked > 0);
}
