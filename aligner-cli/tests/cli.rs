//! End-to-end tests of the `aligner` binary on the shipped model.

mod common;

use std::process::Command;

use common::aligner_output as aligner;
use common::{jsonl, repo};
use serde_json::Value;

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
    // More model folders: damaged safetensors headers, a wrong shape, bad config.json values,
    // a missing tokenizer.
    let weights = std::fs::read(repo().join("assets/stories260K/model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&weights[8..8 + header_len]).unwrap();
    let with_header = |name: &str, header: &Value| {
        let copy = model_copy(name);
        let text = header.to_string();
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.extend_from_slice(&weights[8 + header_len..]);
        std::fs::write(copy.join("model.safetensors"), bytes).unwrap();
        copy
    };
    let lying = model_copy("lying-header");
    let mut bytes = weights.clone();
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(lying.join("model.safetensors"), bytes).unwrap();
    let mut past_the_end = header.clone();
    past_the_end["model.norm.weight"]["data_offsets"] = serde_json::json!([0, 1u64 << 30]);
    let past_the_end = with_header("offsets-past-the-end", &past_the_end);
    let mut reshaped = header.clone();
    reshaped["model.embed_tokens.weight"]["shape"] = serde_json::json!([256, 128]);
    let reshaped = with_header("wrong-shape", &reshaped);
    let config_json: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("assets/stories260K/config.json")).unwrap(),
    )
    .unwrap();
    let with_config = |name: &str, edit: &dyn Fn(&mut Value)| {
        let copy = model_copy(name);
        let mut config = config_json.clone();
        edit(&mut config);
        std::fs::write(copy.join("config.json"), config.to_string()).unwrap();
        copy
    };
    let negative_eps = with_config("negative-eps", &|c| c["rms_norm_eps"] = (-1.0).into());
    let no_context = with_config("no-context", &|c| c["max_position_embeddings"] = 0.into());
    let no_hidden = with_config("no-hidden-size", &|c| {
        c.as_object_mut().unwrap().remove("hidden_size");
    });
    let broken_json = model_copy("broken-config");
    std::fs::write(broken_json.join("config.json"), "{\"vocab_size\": 512,").unwrap();
    let no_tokenizer = model_copy("no-tokenizer");
    std::fs::remove_file(no_tokenizer.join("tokenizer.json")).unwrap();
    // Data lines, each in a file of its own after one good line.
    let data_file = |name: &str, line: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!("{{\"prompt\": \"Once\", \"response\": \" upon\"}}\n{line}\n"),
        )
        .unwrap();
        path
    };
    let mistyped = data_file("mistyped.jsonl", r#"{"prompt": "a", "response": 5}"#);
    let no_assistant = data_file(
        "no-assistant.jsonl",
        r#"{"messages": [{"role": "user", "content": "a"}]}"#,
    );
    let unknown_role = data_file(
        "unknown-role.jsonl",
        r#"{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}"#,
    );
    let long_text = "Once upon a time ".repeat(1500);
    let long_prompt = data_file(
        "long-prompt.jsonl",
        &serde_json::json!({ "prompt": long_text }).to_string(),
    );
    let long_scored = data_file(
        "long-scored.jsonl",
        &serde_json::json!({ "prompt": long_text, "response": " x" }).to_string(),
    );
    let both_forms = data_file(
        "both-forms.jsonl",
        r#"{"prompt": "a", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}"#,
    );
    let array_as_lines = dir.path().join("array.jsonl");
    std::fs::write(
        &array_as_lines,
        "[\n  {\"prompt\": \"Once\", \"response\": \" upon\"}\n]\n",
    )
    .unwrap();
    let bad_toml = dir.path().join("bad.toml");
    std::fs::write(&bad_toml, "train = [\n").unwrap();
    let nan_toml = dir.path().join("nan.toml");
    std::fs::write(&nan_toml, "[train]\nlr = nan\n").unwrap();
    let old_online = dir.path().join("old-online.toml");
    std::fs::write(&old_online, "[online]\nprompts_per_step = 4\nlr = 0.001\n").unwrap();
    // Run folders: one that holds a run, one of other files, one without config.toml.
    let earlier_run = dir.path().join("earlier-run");
    std::fs::create_dir_all(earlier_run.join("checkpoints/step-40")).unwrap();
    std::fs::write(earlier_run.join("config.toml"), "").unwrap();
    let other_files = dir.path().join("other-files");
    std::fs::create_dir_all(&other_files).unwrap();
    std::fs::write(other_files.join("notes.txt"), "keep me").unwrap();
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let data = |file: &std::path::Path| format!("data.train={}", file.display());
    // `generate --prompt Once FLAG VALUE`, and `COMMAND --out <a new folder> --set SETTING`.
    let flag = |flag: &str, value: &str| -> Vec<String> {
        ["generate", "--prompt", "Once", flag, value]
            .map(String::from)
            .to_vec()
    };
    let runs = std::cell::Cell::new(0);
    let set = |command: &str, setting: String| -> Vec<String> {
        runs.set(runs.get() + 1);
        let out = dir.path().join(format!("run-{}", runs.get()));
        vec![
            command.into(),
            "--out".into(),
            path(&out),
            "--set".into(),
            setting,
        ]
    };
    let args = |args: &[&str]| -> Vec<String> { args.iter().map(|a| a.to_string()).collect() };
    let base = repo().join("assets/stories260K");
    let lm_as_reward = |key: &str| format!("{key}={}", base.display());
    const NOT_A_REWARD_MODEL: &str = "stories260K is not a reward model";
    let cases: Vec<(Vec<String>, &str)> = vec![
        (flag("--temperature", "-1"), "--temperature"),
        (flag("--temperature", "NaN"), "--temperature"),
        (flag("--top-p", "1.5"), "--top-p"),
        (flag("--max-new-tokens", "0"), "--max-new-tokens"),
        (flag("--workers", "0"), "--workers"),
        (set("sft", "train.lr=0".into()), "train.lr"),
        (set("sft", "train.lr=nan".into()), "train.lr"),
        (set("sft", "train.adam_epsilon=0".into()), "train.adam_epsilon"),
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
        (generate_with(&lying), "model.safetensors"),
        (generate_with(&past_the_end), "model.safetensors"),
        (generate_with(&reshaped), "model.embed_tokens.weight"),
        (generate_with(&negative_eps), "rms_norm_eps"),
        (generate_with(&no_context), "max_position_embeddings"),
        (generate_with(&no_hidden), "hidden_size"),
        (generate_with(&broken_json), "config.json"),
        (generate_with(&no_tokenizer), "tokenizer.json"),
        (set("sft", data(&mistyped)), "mistyped.jsonl:2: response"),
        (
            set("sft", data(&no_assistant)),
            "no-assistant.jsonl:2: messages has no assistant turn",
        ),
        (
            set("sft", data(&unknown_role)),
            "unknown-role.jsonl:2: messages[1].role",
        ),
        (
            args(&["generate", "--prompts", &path(&long_prompt)]),
            "long-prompt.jsonl:2",
        ),
        (
            args(&["score", "--data", &path(&long_scored)]),
            "long-scored.jsonl:2",
        ),
        (
            set("dpo", "data.max_seq_len=5".into()),
            "train.pref.jsonl:1: chosen",
        ),
        (set("sft", "data.max_seq_len=0".into()), "data.max_seq_len"),
        (set("dpo", "data.max_seq_len=9000".into()), "data.max_seq_len"),
        (args(&["sft", "--config", &path(&bad_toml)]), "bad.toml"),
        (args(&["sft", "--config", &path(&nan_toml)]), "train.lr"),
        (set("sft", "train.nope=1".into()), "train.nope"),
        // The loop's keys of PPO, online DPO, SPIN and CAI's online stage moved to [train]
        // (CAI: [online_train]); the old ones are refused naming the new, and [train] keys a
        // sampling method has no use for are refused naming what it uses instead.
        (
            set("ppo", "ppo.steps=3".into()),
            "--set ppo.steps=3: ppo.steps is now train.max_steps",
        ),
        (
            set("ppo", "ppo.actor_lr=0.1".into()),
            "ppo.actor_lr is now train.lr",
        ),
        (
            args(&["online-dpo", "--config", &path(&old_online)]),
            "old-online.toml: online.lr is now train.lr",
        ),
        (
            set("spin", "spin.epochs=2".into()),
            "spin.epochs is now train.epochs",
        ),
        (
            set("cai", "online.steps=2".into()),
            "online.steps is now online_train.max_steps",
        ),
        (
            set("dpo", "train.shard_optimizer=true".into()),
            "train.shard_optimizer is now train.sharding (true: sharding = \"optimizer\"",
        ),
        (set("sft", "train.sharding=zero3".into()), "train.sharding"),
        (
            set("sft", "train.keep_gathered=true".into()),
            "train.keep_gathered = true keeps the weights `train.sharding = \"full\"` gathers, but train.sharding is \"none\"",
        ),
        (
            [
                set("sft", "train.sharding=gradients".into()),
                args(&["--set", "train.bucket_mb=4"]),
            ]
            .concat(),
            "train.bucket_mb sizes the gradient buckets summed during the backward with train.sharding \"none\" or \"optimizer\"; train.sharding = \"gradients\" reduce-scatters instead",
        ),
        (set("sft", "train.bucket_mb=-1".into()), "train.bucket_mb"),
        (
            set("ppo", "ppo.split_engine=false".into()),
            "ppo.split_engine = false chooses how tensor groups generate, but parallel.tensor is 1",
        ),
        (
            args(&["generate", "--prompt", "Once", "--tensor", "2", "--workers", "2"]),
            "--workers 2 with --tensor 2: a tensor group's ranks decode in lock step",
        ),
        (
            set("ppo", "train.batch_size=4".into()),
            "train.batch_size = 4 is not used by ppo: a step samples ppo.rollout_prompts prompts",
        ),
        (
            set("online-dpo", "train.eval_examples=3".into()),
            "train.eval_examples = 3 is not used by online DPO",
        ),
        (
            set("cai", "online_train.grad_accum=2".into()),
            "online_train.grad_accum = 2 is not used by online DPO",
        ),
        (set("dpo", "dpo.beta=-1".into()), "dpo.beta"),
        (set("kto", "kto.beta=0".into()), "kto.beta"),
        (set("ppo", "ppo.top_p=2".into()), "ppo.top_p"),
        (set("spin", "spin.temperature=-1".into()), "spin.temperature"),
        (
            set("ppo", "ppo.clip_eps_high=0.1".into()),
            "ppo.clip_eps_high = 0.1 is below ppo.clip_eps",
        ),
        (
            set("ppo", "ppo.critic_url='localhost:5557'".into()),
            "ppo.critic_url = \"localhost:5557\" has no scheme",
        ),
        (
            set("ppo", "ppo.critic_retry_seconds=1e30".into()),
            "ppo.critic_retry_seconds",
        ),
        (set("ppo", "ppo.slots=0".into()), "ppo.slots"),
        (
            args(&[
                "rs",
                "--out",
                &path(&dir.path().join("rm-beside-reward")),
                "--set",
                "reward.function='tinystories_sentiment'",
                "--set",
                &lm_as_reward("reward_model.path"),
            ]),
            "is set beside [reward]",
        ),
        (
            set("ppo", "ppo.max_new_tokens=100000".into()),
            "ppo.max_new_tokens = 100000: the model's context is 512 positions",
        ),
        (
            set("spin", "spin.max_new_tokens=600".into()),
            "spin.max_new_tokens = 600",
        ),
        (flag("--max-new-tokens", "4096"), "--max-new-tokens = 4096"),
        (
            args(&[
                "ppo",
                "--out",
                &path(&dir.path().join("grpo-with-critic")),
                "--set",
                "ppo.advantage='grpo'",
                "--set",
                "ppo.samples_per_prompt=2",
                "--set",
                "ppo.critic_url='http://localhost:5557'",
            ]),
            "ppo.critic_url is set but ppo.advantage = \"grpo\" uses no critic",
        ),
        (
            args(&[
                "ppo",
                "--out",
                &path(&dir.path().join("timeout")),
                "--set",
                "reward.function='tinystories_sentiment'",
                "--set",
                "reward.timeout_seconds=1e30",
            ]),
            "more than a week",
        ),
        (
            args(&["sft", "--config", "configs/sft.toml", "--set", "train.lr='abc'"]),
            "--set train.lr='abc': train.lr",
        ),
        (
            set("sft", data(&both_forms)),
            "both-forms.jsonl:2: the row has both messages and prompt",
        ),
        (set("sft", data(&array_as_lines)), "array.jsonl:1: "),
        (args(&["sft", "--out", &path(&earlier_run)]), "--overwrite"),
        (
            args(&["sft", "--out", &path(&other_files), "--overwrite"]),
            "holds no run",
        ),
        (
            args(&["sft", "--resume", &path(&earlier_run), "--set", "train.lr=0.5"]),
            "train.lr",
        ),
        (args(&["sft", "--resume", &path(&other_files)]), "config.toml"),
        // A causal LM's folder where a trained reward or attribute model is meant: it has no
        // score head, and a fresh one would score every sample 0.
        (set("ppo", lm_as_reward("reward_model.path")), NOT_A_REWARD_MODEL),
        (set("ppo", lm_as_reward("reward.model")), NOT_A_REWARD_MODEL),
        (
            set("online-dpo", lm_as_reward("reward_model.path")),
            NOT_A_REWARD_MODEL,
        ),
        (set("rs", lm_as_reward("reward_model.path")), NOT_A_REWARD_MODEL),
        (
            args(&[
                "eval",
                "--out",
                &path(&dir.path().join("eval")),
                "--reward",
                &path(&base),
            ]),
            NOT_A_REWARD_MODEL,
        ),
        (
            args(&[
                "steerlm",
                "annotate",
                "--model",
                &path(&base),
                "--data",
                "assets/tinystories_sentiment/test.steer.jsonl",
                "--out",
                &path(&dir.path().join("annotated.jsonl")),
            ]),
            NOT_A_REWARD_MODEL,
        ),
    ];
    for (args, culprit) in cases {
        let output = Command::new(common::aligner_exe())
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
        // Refused before any earlier step trains (PPO and rs train a default reward model).
        if let Some(out) = args.iter().position(|a| a == "--out").map(|i| &args[i + 1]) {
            assert!(
                !std::path::Path::new(out).join("reward_model").exists(),
                "{args:?} trained a reward model before refusing"
            );
        }
    }
    assert!(
        other_files.join("notes.txt").exists(),
        "--overwrite cleared a folder that held no run"
    );
}

/// A DPO run resumed on other data (an explicit, recorded change) scores the new pairs with
/// the reference again rather than reusing the log-probs cached for the old ones: its
/// `reference_train.jsonl` is the old one with each pair's two values swapped.
#[test]
fn reference_logprobs_are_recomputed_when_the_data_changes() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("dpo");
    let run_arg = run.to_str().unwrap();
    let (ok, _, stderr) = aligner(&[
        "dpo",
        "--out",
        run_arg,
        "--set",
        "train.max_steps=2",
        "--set",
        "train.save_every=1",
        "--stop-after",
        "1",
    ]);
    assert!(ok, "{stderr}");
    let values = |file: &str| -> Vec<f64> {
        std::fs::read_to_string(run.join(file))
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect()
    };
    let before = values("reference_train.jsonl");
    // The same pairs with chosen and rejected swapped.
    let swapped = dir.path().join("swapped.jsonl");
    let rows: Vec<String> = jsonl(&repo().join("assets/tinystories_sentiment/train.pref.jsonl"))
        .into_iter()
        .map(|mut row| {
            let chosen = row["chosen"].take();
            row["chosen"] = row["rejected"].take();
            row["rejected"] = chosen;
            row.to_string()
        })
        .collect();
    std::fs::write(&swapped, rows.join("\n")).unwrap();
    let change = format!("data.train={}", swapped.display());
    let (ok, _, stderr) = aligner(&["dpo", "--resume", run_arg, "--set", &change]);
    assert!(
        !ok && stderr.contains("data.train") && stderr.contains("--allow-change"),
        "{stderr}"
    );
    let (ok, _, stderr) = aligner(&["dpo", "--resume", run_arg, "--set", &change, "--allow-change"]);
    assert!(ok, "{stderr}");
    let after = values("reference_train.jsonl");
    let expected: Vec<f64> = before.chunks(2).flat_map(|p| [p[1], p[0]]).collect();
    assert_eq!(after.len(), expected.len());
    for (a, e) in after.iter().zip(&expected) {
        assert!(
            (a - e).abs() < 1e-4,
            "reference log-probs were not recomputed: {a} vs {e}"
        );
    }
    let changes = jsonl(&run.join("config_changes.jsonl"));
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0]["changes"][0]["key"], "data.train");
}

/// `--out` on a folder that holds a run is refused; `--overwrite` replaces the whole run, so
/// none of the old run's checkpoints survive to be resumed.
#[test]
fn a_run_folder_is_overwritten_only_when_asked_and_then_whole() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("sft");
    let run_arg = run.to_str().unwrap();
    let sft = |steps: &str, extra: &[&str]| {
        let steps = format!("train.max_steps={steps}");
        let mut args = vec![
            "sft",
            "--out",
            run_arg,
            "--set",
            &steps,
            "--set",
            "train.save_every=1",
        ];
        args.extend(extra);
        aligner(&args)
    };
    let (ok, _, stderr) = sft("4", &[]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = sft("2", &[]);
    assert!(
        !ok && stderr.contains("already holds a run") && stderr.contains("--overwrite"),
        "{stderr}"
    );
    let (ok, _, stderr) = sft("2", &["--overwrite"]);
    assert!(ok, "{stderr}");
    let checkpoints: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    // The new run's checkpoints only (the last step is saved as `final/`).
    assert!(checkpoints.contains(&"step-1".to_string()), "{checkpoints:?}");
    assert!(
        checkpoints.iter().all(|c| c == "step-1" || c == "step-2"),
        "the old run's checkpoints survived: {checkpoints:?}"
    );
    let steps: Vec<u64> = common::metrics(&run)
        .iter()
        .filter_map(|row| row["step"].as_u64())
        .collect();
    assert_eq!(
        steps.iter().max(),
        Some(&2),
        "metrics of the old run were kept: {steps:?}"
    );
}

/// `--resume` passes over a checkpoint whose files no longer match its manifest (warning which
/// file), and when no checkpoint is intact it stops before changing anything in the folder:
/// not `config.toml`, not `config_changes.jsonl`, not the metrics.
#[test]
fn a_resume_passes_over_a_damaged_checkpoint_and_one_that_cannot_resume_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("sft");
    let run_arg = run.to_str().unwrap();
    let (ok, _, stderr) = aligner(&[
        "sft",
        "--out",
        run_arg,
        "--set",
        "train.max_steps=6",
        "--set",
        "train.save_every=2",
        "--stop-after",
        "4",
    ]);
    assert!(ok, "{stderr}");
    let weights = |step: usize| run.join(format!("checkpoints/step-{step}/model.safetensors"));
    assert!(run.join("checkpoints/step-4/manifest.json").exists());
    let damage = |step: usize| -> Vec<u8> {
        let bytes = std::fs::read(weights(step)).unwrap();
        let mut damaged = bytes.clone();
        damaged[bytes.len() / 2] ^= 0x40;
        std::fs::write(weights(step), damaged).unwrap();
        bytes
    };
    fn files(dir: &std::path::Path, out: &mut Vec<(std::path::PathBuf, Vec<u8>)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for path in entries {
            match path.is_dir() {
                true => files(&path, out),
                false => out.push((path.clone(), std::fs::read(&path).unwrap())),
            }
        }
    }
    let snapshot = || {
        let mut out = Vec::new();
        files(&run, &mut out);
        out
    };
    // `sft --resume` with a recorded change; VK_LOADER_DEBUG makes a started Vulkan loader say so.
    let resume = || {
        let output = Command::new(common::aligner_exe())
            .args([
                "sft",
                "--resume",
                run_arg,
                "--set",
                "train.lr=0.002",
                "--allow-change",
            ])
            .env("VK_LOADER_DEBUG", "all")
            .current_dir(repo())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (output.status.success(), stderr)
    };
    damage(4);
    let step_2 = damage(2);
    let before = snapshot();
    let (ok, stderr) = resume();
    assert!(
        !ok && stderr.contains("no intact checkpoint")
            && stderr.contains("step-4: model.safetensors does not match its checksum")
            && stderr.contains("step-2: model.safetensors"),
        "{stderr}"
    );
    assert!(snapshot() == before, "a failed resume changed the run folder");
    assert!(!run.join("config_changes.jsonl").exists());

    // With step 2 intact again, the run resumes from it and finishes, each step logged once;
    // on the CPU it never starts the Vulkan loader (a wgpu build's default device).
    std::fs::write(weights(2), step_2).unwrap();
    let (ok, stderr) = resume();
    assert!(ok, "{stderr}");
    assert!(
        !stderr.contains("Vulkan Loader"),
        "a CPU resume loaded Vulkan: {stderr}"
    );
    assert!(
        stderr.contains("passed over") && stderr.contains("step-4"),
        "{stderr}"
    );
    let steps: Vec<u64> = common::metrics(&run)
        .iter()
        .filter(|r| r.get("loss").is_some())
        .filter_map(|r| r["step"].as_u64())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    assert_eq!(jsonl(&run.join("config_changes.jsonl")).len(), 1);
    assert!(run.join("final/model.safetensors").exists());
}

/// `generate`, `score`, `eval` and `plot` never write over one of their inputs, and replace
/// an earlier result, or write straight into a model or run folder, only with `--overwrite`;
/// a refused command leaves every file as it was.
#[test]
fn outputs_never_overwrite_inputs_or_earlier_results() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name);
    let s = |path: &std::path::Path| path.to_str().unwrap().to_string();
    let model = repo().join("assets/stories260K");
    std::fs::write(
        p("prompts.jsonl"),
        "{\"prompt\": \"Once\"}\n{\"prompt\": \"Tom\"}\n",
    )
    .unwrap();
    let run = p("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(
        run.join("metrics.jsonl"),
        "{\"step\": 1, \"loss\": 2.0}\n{\"step\": 2, \"loss\": 1.5}\n",
    )
    .unwrap();
    let contents = |paths: &[std::path::PathBuf]| -> Vec<Option<Vec<u8>>> {
        paths.iter().map(|f| std::fs::read(f).ok()).collect()
    };
    let watched = [
        p("prompts.jsonl"),
        run.join("metrics.jsonl"),
        model.join("config.json"),
        p("gen.jsonl"),
        p("scores.jsonl"),
        p("eval/summary.json"),
        p("runs.svg"),
    ];
    let refused = |args: &[String], says: &str| {
        let before = contents(&watched);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, stdout, stderr) = aligner(&args);
        assert!(!ok && stderr.contains(says), "{args:?}: {stdout}{stderr}");
        assert!(contents(&watched) == before, "{args:?} changed a file");
        assert!(!model.join("gen.jsonl").exists() && !run.join("gen.jsonl").exists());
    };
    let works = |args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, _, stderr) = aligner(&args);
        assert!(ok, "{args:?}: {stderr}");
    };
    let owned = |args: &[&str]| -> Vec<String> { args.iter().map(|a| a.to_string()).collect() };
    // `COMMAND --prompts prompts.jsonl --max-new-tokens 4 --out OUT EXTRA...`.
    let with_prompts = |command: &str, out: &std::path::Path, extra: &[&str]| {
        let prompts = s(&p("prompts.jsonl"));
        let mut args = owned(&[command, "--prompts", &prompts, "--max-new-tokens", "4"]);
        args.extend(owned(&["--out", &s(out)]));
        args.extend(owned(extra));
        args
    };
    let generate = |out: &std::path::Path, extra: &[&str]| with_prompts("generate", out, extra);

    // generate: its prompts file, a file of the model folder it reads, a run folder.
    refused(&generate(&p("prompts.jsonl"), &["--overwrite"]), "an input");
    refused(
        &generate(&model.join("gen.jsonl"), &["--model", &s(&model), "--overwrite"]),
        "inside",
    );
    refused(&generate(&run.join("gen.jsonl"), &[]), "is a run folder");
    works(&generate(&p("gen.jsonl"), &[]));
    refused(&generate(&p("gen.jsonl"), &["--seed", "5"]), "pass --overwrite");
    let first = std::fs::read(p("gen.jsonl")).unwrap();
    works(&generate(&p("gen.jsonl"), &["--seed", "5", "--overwrite"]));
    assert_ne!(
        std::fs::read(p("gen.jsonl")).unwrap(),
        first,
        "--overwrite replaced nothing"
    );

    // score: its data, an earlier result.
    let score = |out: &std::path::Path, extra: &[&str]| {
        let mut args = owned(&["score", "--data", &s(&p("gen.jsonl")), "--out", &s(out)]);
        args.extend(owned(extra));
        args
    };
    refused(&score(&p("gen.jsonl"), &["--overwrite"]), "an input");
    works(&score(&p("scores.jsonl"), &[]));
    refused(&score(&p("scores.jsonl"), &[]), "pass --overwrite");
    works(&score(&p("scores.jsonl"), &["--overwrite"]));

    // eval: a folder holding an earlier evaluation, a run folder, its own prompts' folder.
    let eval = |out: &std::path::Path, extra: &[&str]| with_prompts("eval", out, extra);
    works(&eval(&p("eval"), &[]));
    refused(&eval(&p("eval"), &[]), "pass --overwrite");
    refused(&eval(&run, &[]), "is a run folder");
    works(&eval(&p("eval"), &["--overwrite"]));
    refused(
        &owned(&["eval", "--plot", &s(&p("eval")), "--out", &s(&p("eval"))]),
        "an input",
    );

    // plot: a file of a run it draws, an earlier chart.
    let plot = |out: &std::path::Path, extra: &[&str]| {
        let mut args = owned(&["plot", &s(&run), "--out", &s(out)]);
        args.extend(owned(extra));
        args
    };
    refused(&plot(&run.join("metrics.jsonl"), &["--overwrite"]), "an input");
    works(&plot(&p("runs.svg"), &[]));
    refused(&plot(&p("runs.svg"), &[]), "pass --overwrite");
    works(&plot(&p("runs.svg"), &["--overwrite"]));
}

/// `aligner eval` puts the start model at zero KL to itself, with the reference's NLL of its
/// samples near the start model's own (1.32 nats/token on the held-out prompts), and a policy
/// trained away from it at a KL above zero, measured against the start model its run folder
/// records; the KL is the mean of the per-sample log-ratios it writes.
#[test]
fn eval_places_policies_on_the_reward_kl_frontier() {
    let dir = tempfile::tempdir().unwrap();
    let summary = |args: &[&str]| -> Value {
        let (ok, stdout, stderr) = aligner(args);
        assert!(ok, "{stderr}");
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    let start_out = dir.path().join("eval-start");
    let start = summary(&["eval", "--out", start_out.to_str().unwrap()]);
    assert_eq!(start["samples"], 104);
    assert!(start["kl_per_response"].as_f64().unwrap().abs() < 1e-3, "{start}");
    let nll = start["reference_nll_per_token"].as_f64().unwrap();
    assert!((1.1..1.6).contains(&nll), "{start}");
    assert!(start["reward"].is_null());
    let samples = jsonl(&start_out.join("samples.jsonl"));
    assert_eq!(samples.len(), 104);

    let shipped = repo().join("assets/stories260K");
    let model_path = format!("model.path={}", shipped.display());
    let run = dir.path().join("sft");
    let (ok, _, stderr) = aligner(&[
        "sft",
        "--out",
        run.to_str().unwrap(),
        "--set",
        &model_path,
        "--set",
        "train.max_steps=10",
        "--set",
        "train.lr=0.01",
    ]);
    assert!(ok, "{stderr}");
    let out = dir.path().join("eval-sft");
    let final_dir = run.join("final");
    let trained = summary(&[
        "eval",
        "--model",
        final_dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        trained["reference"],
        shipped.to_str().unwrap(),
        "the run's start model is the reference"
    );
    let kl = trained["kl_per_response"].as_f64().unwrap();
    assert!(kl > 0.5, "{trained}");
    let samples = jsonl(&out.join("samples.jsonl"));
    let mean: f64 = samples
        .iter()
        .map(|s| s["policy_logprob"].as_f64().unwrap() - s["reference_logprob"].as_f64().unwrap())
        .sum::<f64>()
        / samples.len() as f64;
    assert!((mean - kl).abs() < 1e-6 * (1.0 + kl), "{mean} against {kl}");
}

/// `aligner plan` picks the first layout that fits, prints its launch command, and refuses a
/// cluster nothing fits on naming the smallest one that would.
#[test]
fn plan_picks_a_layout_that_fits_or_names_the_smallest_cluster() {
    let dir = tempfile::tempdir().unwrap();
    // Qwen2.5-0.5B's shape.
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--config",
            config.to_str().unwrap(),
            "--cpu",
            "--dtype",
            "f32",
        ];
        args.extend(["--batch", "2", "--seq", "128"]);
        args.extend(extra);
        aligner(&args)
    };
    // Two unsharded copies need 11.3 GB a rank; sharding the optimizer brings it to 9.4.
    let (ok, stdout, stderr) = plan(&["--gpus", "2", "--gpu-memory", "10GB"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("494032768 parameters"), "{stdout}");
    assert!(
        stdout.contains(
            "launch: mpirun -np 2 aligner sft --set train.batch_size=2 --set train.sharding=optimizer"
        ),
        "{stdout}"
    );
    // DPO measures the frontier by default: rank 0 holds the start model for it (and the
    // policy gathered for its samples when sharded). Where that does not fit, the launch
    // command turns it off and says why.
    let (ok, stdout, stderr) = plan(&["--method", "dpo", "--gpus", "2", "--gpu-memory", "10GB"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("frontier: rank 0 would hold"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("launch: ") && l.ends_with(" --set frontier.prompts=''")),
        "{stdout}"
    );
    let (ok, stdout, stderr) = plan(&["--method", "dpo", "--gpus", "2", "--gpu-memory", "40GB"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("frontier: rank 0 holds"), "{stdout}");
    assert!(!stdout.contains("frontier.prompts"), "{stdout}");
    let (ok, _, stderr) = plan(&["--gpus", "2", "--gpu-memory", "4GB"]);
    assert!(!ok);
    assert!(
        stderr.contains("nothing aligner runs fits on 2 devices of 4.00 GB each")
            // Fully sharded, four ranks hold what two cannot, saving included (saving streams
            // to the writer a parameter at a time: no rank gathers the whole model).
            && stderr.contains("The smallest cluster that would: 4 devices (4 × 1, sharding full, peak 3.88 GB)")
            && stderr.contains(
                "With what aligner does not do yet (tensor groups beside full sharding): 4 devices (4 × 1, sharding full, peak 3.88 GB)"
            ),
        "{stderr}"
    );
    let (ok, _, stderr) = plan(&["--gpus", "2", "--gpu-memory", "80XB"]);
    assert!(!ok && stderr.contains("80XB"), "{stderr}");
}

/// `ALIGNER_COMM` names the transport of the gradients' collectives: `nccl` needs a build with
/// the `nccl` feature and an MPI launcher; anything else is refused naming the variable.
#[test]
fn an_unavailable_transport_is_refused_naming_it() {
    let run = |value: &str| {
        Command::new(common::aligner_exe())
            .env("ALIGNER_COMM", value)
            .args(["plan", "--gpus", "1"])
            .output()
            .unwrap()
    };
    let out = run("nccl");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("ALIGNER_COMM=nccl: this build has no NCCL") || err.contains("run under `mpirun`"),
        "{err}"
    );
    let out = run("gloo");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("ALIGNER_COMM=\"gloo\": expected mpi"),
        "{err}"
    );
    assert!(run("mpi").status.success());
}
