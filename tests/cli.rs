//! End-to-end tests of the `aligner` binary on the shipped model.

use std::process::Command;

use aligner_tests::{jsonl, repo};
use serde_json::Value;

fn aligner(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(aligner_tests::aligner_exe())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn greedy_generate_prints_the_reference_story() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/reference/stories260K_transformers.json")).unwrap(),
    )
    .unwrap();
    let case = &reference["greedy"][0];
    let prompt = case["prompt"].as_str().unwrap();
    let (ok, stdout, stderr) = aligner(&[
        "generate",
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--max-new-tokens",
        "64",
    ]);
    assert!(ok, "{stderr}");
    let expected = format!("{prompt} {}", case["text"].as_str().unwrap());
    assert_eq!(stdout.trim_end(), expected.trim_end());
}

#[test]
fn generated_responses_score_to_their_own_token_logprobs() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"Once upon a time\"}\n{\"prompt\": \"Tom and Sue went to the beach.\"}\n{\"prompt\": \"The cat\"}\n",
    )
    .unwrap();
    let generated = dir.path().join("gen.jsonl");
    let (ok, _, stderr) = aligner(&[
        "generate",
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "40",
        "--seed",
        "3",
        "--top-k",
        "50",
        "--out",
        generated.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let rows = jsonl(&generated);
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["prompt"], "Once upon a time");
    for row in &rows {
        let n = row["token_ids"].as_array().unwrap().len();
        assert_eq!(row["token_logprobs"].as_array().unwrap().len(), n);
        assert!(["eos", "max_tokens", "stop_string"].contains(&row["stop_reason"].as_str().unwrap()));
    }
    let scored = dir.path().join("scored.jsonl");
    let (ok, _, stderr) = aligner(&[
        "score",
        "--data",
        generated.to_str().unwrap(),
        "--out",
        scored.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    for (generated_row, score) in rows.iter().zip(jsonl(&scored)) {
        let ids = generated_row["token_ids"].as_array().unwrap();
        assert_eq!(
            score["n_tokens"].as_u64().unwrap() as usize,
            ids.len(),
            "{generated_row}"
        );
        let own: f64 = generated_row["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .sum();
        assert!(
            (score["logprob"].as_f64().unwrap() - own).abs() < 1e-3,
            "{score} vs {own}"
        );
    }
    // The same seed gives the same samples whatever the batch size.
    let again = dir.path().join("again.jsonl");
    let (ok, _, _) = aligner(&[
        "generate",
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "40",
        "--seed",
        "3",
        "--top-k",
        "50",
        "--batch-size",
        "1",
        "--out",
        again.to_str().unwrap(),
    ]);
    assert!(ok);
    for (a, b) in jsonl(&again).iter().zip(&rows) {
        for key in ["prompt", "response", "token_ids", "stop_reason"] {
            assert_eq!(a[key], b[key]);
        }
        let close = a["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .zip(b["token_logprobs"].as_array().unwrap());
        for (x, y) in close {
            assert!((x.as_f64().unwrap() - y.as_f64().unwrap()).abs() < 1e-4);
        }
    }
}

#[test]
fn score_matches_the_reference_pairs() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/reference/stories260K_transformers.json")).unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("pairs.jsonl");
    let mut text = String::new();
    for pair in reference["pairs"].as_array().unwrap() {
        text.push_str(&serde_json::json!({"prompt": pair["prompt"], "response": pair["chosen"]}).to_string());
        text.push('\n');
    }
    std::fs::write(&data, text).unwrap();
    let (ok, stdout, stderr) = aligner(&["score", "--data", data.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let lines: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 16);
    for (line, pair) in lines.iter().zip(reference["pairs"].as_array().unwrap()) {
        let expected = pair["chosen_ref"]["logprob"].as_f64().unwrap();
        assert!((line["logprob"].as_f64().unwrap() - expected).abs() < 1e-3);
        assert_eq!(line["n_tokens"], pair["chosen_ref"]["n_tokens"]);
    }
}

#[test]
fn bad_input_is_reported_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("bad.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"a\", \"response\": \"b\"}\n{\"prompt\": 3}\n",
    )
    .unwrap();
    let (ok, _, stderr) = aligner(&["score", "--data", data.to_str().unwrap()]);
    assert!(!ok);
    assert!(stderr.contains("bad.jsonl:2"), "{stderr}");
    let (ok, _, stderr) = aligner(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt",
        "x",
    ]);
    assert!(!ok);
    assert!(stderr.contains("config.json"), "{stderr}");
}

#[test]
fn convert_llama2c_writes_a_loadable_folder() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hf");
    let src = repo().join("assets/stories260K_llama2c");
    let (ok, _, stderr) = aligner(&[
        "convert",
        "llama2c",
        "--input",
        src.join("stories260K.bin").to_str().unwrap(),
        "--tokenizer",
        src.join("tok512.model").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let (ok, stdout, stderr) = aligner(&[
        "generate",
        "--model",
        out.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0",
        "--max-new-tokens",
        "20",
    ]);
    assert!(ok, "{stderr}");
    let (_, shipped, _) = aligner(&[
        "generate",
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0",
        "--max-new-tokens",
        "20",
    ]);
    assert_eq!(stdout, shipped);
}

/// Bad values and files, each refused before work starts with a message naming the culprit,
/// and none a panic (exit code 101).
#[test]
fn bad_inputs_are_refused_naming_the_culprit() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let blank = dir.path().join("blank.jsonl");
    std::fs::write(&blank, "\n   \n\n").unwrap();
    // Model folders: a tokenizer with ids past the model's vocabulary, and truncated weights.
    let model_copy = |name: &str| {
        let copy = dir.path().join(name);
        std::fs::create_dir_all(&copy).unwrap();
        for entry in std::fs::read_dir(repo().join("assets/stories260K")).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
        }
        copy
    };
    let small_vocab = model_copy("small-vocab");
    let config = std::fs::read_to_string(small_vocab.join("config.json")).unwrap();
    let config = config.replace("\"vocab_size\": 512", "\"vocab_size\": 100");
    assert!(config.contains("\"vocab_size\": 100"), "{config}");
    std::fs::write(small_vocab.join("config.json"), config).unwrap();
    let truncated = model_copy("truncated");
    let weights = std::fs::read(truncated.join("model.safetensors")).unwrap();
    std::fs::write(truncated.join("model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    let not_finite = model_copy("nan-weights");
    let mut weights = std::fs::read(not_finite.join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    weights[8 + header..8 + header + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(not_finite.join("model.safetensors"), weights).unwrap();
    let generate_with = |model: &std::path::Path| -> Vec<String> {
        ["generate", "--model", model.to_str().unwrap(), "--prompt", "Once"]
            .map(String::from)
            .to_vec()
    };
    let out = dir.path().join("run");
    let out = out.to_str().unwrap();
    let data = |file: &std::path::Path| format!("data.train={}", file.display());
    // `generate --prompt Once FLAG VALUE`, and `COMMAND --out run --set SETTING`.
    let flag = |flag: &str, value: &str| -> Vec<String> {
        ["generate", "--prompt", "Once", flag, value]
            .map(String::from)
            .to_vec()
    };
    let set = |command: &str, setting: String| -> Vec<String> {
        vec![
            command.into(),
            "--out".into(),
            out.into(),
            "--set".into(),
            setting,
        ]
    };
    let cases: Vec<(Vec<String>, &str)> = vec![
        (flag("--temperature", "-1"), "--temperature"),
        (flag("--temperature", "NaN"), "--temperature"),
        (flag("--top-p", "1.5"), "--top-p"),
        (flag("--max-new-tokens", "0"), "--max-new-tokens"),
        (flag("--workers", "0"), "--workers"),
        (set("sft", "train.lr=0".into()), "train.lr"),
        (set("sft", "train.lr=nan".into()), "train.lr"),
        (
            set("sft", "train.max_grad_norm=nan".into()),
            "train.max_grad_norm",
        ),
        (set("sft", data(&empty)), "empty.jsonl"),
        (set("rm", data(&blank)), "blank.jsonl"),
        (set("dpo", data(&empty)), "empty.jsonl"),
        (set("kto", data(&blank)), "blank.jsonl"),
        (generate_with(&small_vocab), "tokenizer.json"),
        (generate_with(&truncated), "model.safetensors"),
        (generate_with(&not_finite), "not finite"),
    ];
    for (args, culprit) in cases {
        let output = Command::new(aligner_tests::aligner_exe())
            .args(&args)
            .current_dir(repo())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} was accepted");
        assert_ne!(output.status.code(), Some(101), "{args:?} panicked: {stderr}");
        assert!(
            stderr.contains(culprit),
            "{args:?}: the error does not name {culprit}: {stderr}"
        );
    }
}
