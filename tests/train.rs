//! Training commands end to end on the shipped model and data: real runs that must improve a
//! held-out metric, exact resume, and the failure paths.

use std::path::Path;

use aligner_tests::{aligner, first_and_last, metrics, repo, sample_sentiment};
use serde_json::Value;

#[test]
fn sft_lowers_held_out_nll_and_writes_the_run_folder() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("sft");
    let (ok, err) = aligner(&[
        "sft",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.max_steps=50",
        "--set",
        "train.save_every=10",
        "--set",
        "train.eval_every=0",
    ]);
    assert!(ok, "{err}");
    let rows = metrics(&run);
    let (base, trained) = first_and_last(&rows, "eval_nll");
    assert_eq!(rows[0]["step"], 0);
    assert!(trained < base - 0.1, "validation NLL {base} -> {trained}");
    for file in [
        "config.toml",
        "metrics.svg",
        "final/config.json",
        "final/model.safetensors",
        "final/tokenizer.json",
        "checkpoints/step-10/optimizer.bin",
        "checkpoints/step-20/trainer_state.json",
    ] {
        assert!(run.join(file).exists(), "{file}");
    }
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(config.contains("max_steps = 50"), "{config}");
    // The trained folder is a model aligner itself loads and samples from.
    let (ok, err) = aligner(&[
        "generate",
        "--model",
        run.join("final").to_str().unwrap(),
        "--prompt",
        "Once",
        "--max-new-tokens",
        "8",
    ]);
    assert!(ok, "{err}");
}

#[test]
fn reward_model_ranks_held_out_pairs_far_above_chance() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("rm");
    let (ok, err) = aligner(&[
        "rm",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.max_steps=40",
        "--set",
        "train.eval_every=0",
    ]);
    assert!(ok, "{err}");
    let rows = metrics(&run);
    let (_, accuracy) = first_and_last(&rows, "eval_accuracy");
    assert!(accuracy > 0.8, "held-out pair accuracy {accuracy}");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("final/config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "LlamaForSequenceClassification");
    // `aligner score` on a reward-model folder prints rewards; chosen outscores rejected.
    let pairs = std::fs::read_to_string(repo().join("assets/tinystories_sentiment/test.pref.jsonl")).unwrap();
    let mut data = String::new();
    for line in pairs.lines().take(10) {
        let p: Value = serde_json::from_str(line).unwrap();
        for side in ["chosen", "rejected"] {
            data.push_str(&serde_json::json!({"prompt": p["prompt"], "response": p[side]}).to_string());
            data.push('\n');
        }
    }
    let input = dir.path().join("pairs.jsonl");
    std::fs::write(&input, data).unwrap();
    let scored = dir.path().join("rewards.jsonl");
    let (ok, err) = aligner(&[
        "score",
        "--model",
        run.join("final").to_str().unwrap(),
        "--data",
        input.to_str().unwrap(),
        "--out",
        scored.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let rewards: Vec<f64> = std::fs::read_to_string(scored)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["reward"]
                .as_f64()
                .unwrap()
        })
        .collect();
    let wins = rewards.chunks(2).filter(|p| p[0] > p[1]).count();
    assert!(wins >= 7, "chosen won {wins} of 10");
}

#[test]
fn a_resumed_run_writes_the_same_metrics_as_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let (full, cut) = (dir.path().join("full"), dir.path().join("cut"));
    let common = [
        "--set",
        "train.max_steps=12",
        "--set",
        "train.save_every=4",
        "--set",
        "train.eval_every=6",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.grad_accum=2",
        "--set",
        "train.eval_examples=16",
    ];
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec!["sft", "--out", out.to_str().unwrap()];
        args.extend(common);
        args.extend(extra);
        aligner(&args)
    };
    assert!(run(&full, &[]).0);
    let (ok, err) = run(&cut, &["--stop-after", "7"]);
    assert!(ok, "{err}");
    assert!(!cut.join("final").exists());
    let (ok, err) = aligner(&["sft", "--resume", cut.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(err.contains("resuming"), "{err}");
    assert_eq!(metrics(&full), metrics(&cut));
    assert_eq!(
        std::fs::read(full.join("final/model.safetensors")).unwrap(),
        std::fs::read(cut.join("final/model.safetensors")).unwrap()
    );
}

#[test]
fn a_diverging_loss_stops_the_run_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("nan");
    let (ok, err) = aligner(&[
        "sft",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.lr=1e30",
        "--set",
        "train.max_grad_norm=0",
        "--set",
        "train.max_steps=20",
        "--set",
        "train.save_every=1",
        "--set",
        "train.eval_every=0",
    ]);
    assert!(!ok);
    assert!(err.contains("loss is"), "{err}");
    // The message names the checkpoint that is kept, and it exists.
    let named = err
        .split_whitespace()
        .find(|w| w.contains("checkpoints/step-"))
        .unwrap_or_else(|| panic!("no checkpoint named: {err}"));
    assert!(
        Path::new(named.trim_end_matches(['.', ',']))
            .join("trainer_state.json")
            .exists(),
        "{err}"
    );
    assert!(run.join("checkpoints/step-1/trainer_state.json").exists());
    assert!(!run.join("final").exists());
}

#[test]
fn bad_configs_and_data_are_named_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x");
    let (ok, err) = aligner(&["sft", "--out", out.to_str().unwrap(), "--set", "train.lrr=1"]);
    assert!(!ok);
    assert!(err.contains("lrr"), "{err}");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"prompt\": \"a\", \"response\": \"b\"}\n{\"prompt\": \"a\", \"respons\": 1}\n",
    )
    .unwrap();
    let (ok, err) = aligner(&[
        "sft",
        "--out",
        out.to_str().unwrap(),
        "--set",
        &format!("data.train={}", bad.display()),
    ]);
    assert!(!ok);
    assert!(err.contains("bad.jsonl:2"), "{err}");
    assert!(!out.join("metrics.jsonl").exists());
    // A blank line still counts: a row that parses but cannot be used (its prompt fills
    // data.max_seq_len) is named by its line in the file.
    std::fs::write(
        &bad,
        "{\"prompt\": \"a\", \"response\": \"b\"}\n\n{\"prompt\": \"Once upon a time there was a little girl\", \"response\": \"b\"}\n",
    )
    .unwrap();
    let (ok, err) = aligner(&[
        "sft",
        "--out",
        out.to_str().unwrap(),
        "--set",
        &format!("data.train={}", bad.display()),
        "--set",
        "data.max_seq_len=6",
    ]);
    assert!(!ok);
    assert!(err.contains("bad.jsonl:3"), "{err}");
    // A variant's parameters are its own typed keys: a misspelt one is named, for a built-in
    // loss and for one registered by a variant crate.
    for (loss, key) in [("dpo", "gamma"), ("simpo", "gama")] {
        let (ok, err) = aligner(&[
            "dpo",
            "--out",
            out.to_str().unwrap(),
            "--set",
            &format!("dpo.loss={loss}"),
            "--set",
            &format!("dpo.params.{key}=1"),
        ]);
        assert!(!ok);
        assert!(err.contains(&format!("dpo.params.{key}")), "{loss}: {err}");
    }
    assert!(!out.join("metrics.jsonl").exists());
}

#[test]
fn example_configs_parse_and_run() {
    let dir = tempfile::tempdir().unwrap();
    for command in ["sft", "rm", "dpo", "kto"] {
        let out = dir.path().join(command);
        let config = repo().join("configs").join(format!("{command}.toml"));
        let (ok, err) = aligner(&[
            command,
            "--config",
            config.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--set",
            "train.max_steps=2",
            "--set",
            "data.validation=''",
        ]);
        assert!(ok, "{command}: {err}");
    }
    // The RL and self-play configs, cut to one tiny step (the base model stands in as a
    // reward model with a fresh, zero head).
    let base = repo().join("assets/stories260K");
    let rm = format!("reward_model.path={}", base.display());
    let runs: [(&[&str], &str, &[&str]); 4] = [
        (
            &["ppo"],
            "ppo",
            &[
                "ppo.steps=1",
                "ppo.rollout_prompts=4",
                "ppo.eval_prompts=4",
                "ppo.mini_batch=4",
            ],
        ),
        (
            &["rs"],
            "rs",
            &[
                "rs.rounds=1",
                "data.train=assets/tinystories_sentiment/test.prompts.jsonl",
                "rs.eval_prompts=4",
                "rs.n=2",
            ],
        ),
        (
            &["spin"],
            "spin",
            &[
                "spin.iterations=1",
                "train.max_steps=1",
                "data.train=assets/tinystories_sentiment/test.sft.jsonl",
                "data.validation=''",
            ],
        ),
        (
            &["steerlm", "sft"],
            "steerlm",
            &["train.max_steps=1", "data.validation=''"],
        ),
    ];
    for (command, file, sets) in runs {
        let out = dir.path().join(file);
        let config = repo().join("configs").join(format!("{file}.toml"));
        let mut args: Vec<String> = command.iter().map(|s| s.to_string()).collect();
        args.extend([
            "--config".into(),
            config.display().to_string(),
            "--out".into(),
            out.display().to_string(),
        ]);
        for s in sets
            .iter()
            .map(|s| s.to_string())
            .chain((file != "spin" && file != "steerlm").then(|| rm.clone()))
        {
            args.extend(["--set".into(), s]);
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, err) = aligner(&refs);
        assert!(ok, "{file}: {err}");
    }
    let out = dir.path().join("packed");
    let (ok, err) = aligner(&[
        "sft",
        "--out",
        out.to_str().unwrap(),
        "--set",
        "sft.packing=true",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.batch_size=2",
        "--set",
        "data.validation=''",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("packed"), "{err}");
}

#[test]
fn lora_sft_improves_and_its_adapter_merges_into_the_saved_model() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("lora");
    let (ok, err) = aligner(&[
        "sft",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "model.lora_rank=8",
        "--set",
        "model.lora_targets=[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\",\"gate_proj\",\"up_proj\",\"down_proj\"]",
        "--set",
        "train.lr=5e-3",
        "--set",
        "train.max_steps=50",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.save_every=0",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("trainable"), "{err}");
    let (base, trained) = first_and_last(&metrics(&run), "eval_nll");
    assert!(trained < base - 0.08, "LoRA validation NLL {base} -> {trained}");
    let final_dir = run.join("final");
    for file in [
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "model.safetensors",
        "config.json",
    ] {
        assert!(final_dir.join(file).exists(), "{file}");
    }
    // final/ itself is a plain HF folder (no adapter files beside the merged weights).
    assert!(!final_dir.join("adapter_config.json").exists());
    let merged = dir.path().join("merged");
    let (ok, err) = aligner(&[
        "convert",
        "merge-lora",
        "--adapter",
        final_dir.join("adapter").to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read(merged.join("model.safetensors")).unwrap(),
        std::fs::read(final_dir.join("model.safetensors")).unwrap()
    );
}

#[test]
fn lora_reward_model_trains_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (full, cut) = (dir.path().join("full"), dir.path().join("cut"));
    let common = [
        "--set",
        "model.lora_rank=4",
        "--set",
        "train.lr=5e-3",
        "--set",
        "train.max_steps=6",
        "--set",
        "train.save_every=3",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.eval_examples=16",
    ];
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec!["rm", "--out", out.to_str().unwrap()];
        args.extend(common);
        args.extend(extra);
        aligner(&args)
    };
    let (ok, err) = run(&full, &[]);
    assert!(ok, "{err}");
    assert!(full.join("final/adapter/adapter_model.safetensors").exists());
    let (ok, err) = run(&cut, &["--stop-after", "4"]);
    assert!(ok, "{err}");
    let (ok, err) = aligner(&["rm", "--resume", cut.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert_eq!(metrics(&full), metrics(&cut));
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(full.join("final/adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["task_type"], "SEQ_CLS");
    assert_eq!(config["modules_to_save"][0], "score");
}

#[test]
fn dpo_separates_held_out_pairs_and_caches_reference_logprobs() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("dpo");
    let (ok, err) = aligner(&[
        "dpo",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.max_steps=20",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.save_every=10",
    ]);
    assert!(ok, "{err}");
    let rows = metrics(&run);
    let (_, margin) = first_and_last(&rows, "eval_rewards/margin");
    let (start_loss, end_loss) = first_and_last(&rows, "eval_loss");
    assert!(
        (start_loss - 2f64.ln()).abs() < 1e-3,
        "policy = reference gives log 2, got {start_loss}"
    );
    assert!(
        end_loss < start_loss - 0.05,
        "held-out DPO loss {start_loss} -> {end_loss}"
    );
    assert!(margin > 0.0, "held-out reward margin {margin}");
    let (_, accuracy) = first_and_last(&rows, "eval_rewards/accuracy");
    assert!(accuracy > 0.6, "held-out reward accuracy {accuracy}");
    let cache = run.join("reference_train.jsonl");
    assert_eq!(std::fs::read_to_string(&cache).unwrap().lines().count(), 2 * 603);
    let (ok, err) = aligner(&["dpo", "--out", run.to_str().unwrap(), "--set", "dpo.loss=dpoo"]);
    assert!(!ok && err.contains("dpoo") && err.contains("ipo"), "{err}");
}

#[test]
fn kto_rewards_desirable_completions_above_undesirable_ones() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("kto");
    let (ok, err) = aligner(&[
        "kto",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.max_steps=30",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.save_every=0",
    ]);
    assert!(ok, "{err}");
    let rows = metrics(&run);
    let last = rows.last().unwrap();
    let (chosen, rejected) = (
        last["eval_rewards/chosen"].as_f64().unwrap(),
        last["eval_rewards/rejected"].as_f64().unwrap(),
    );
    assert!(
        chosen > rejected,
        "held-out implicit reward: desirable {chosen}, undesirable {rejected}"
    );
    assert!(rows.iter().any(|r| r["kl"].as_f64().is_some()));
    assert_eq!(
        std::fs::read_to_string(run.join("reference_train.jsonl"))
            .unwrap()
            .lines()
            .count(),
        2 * 749
    );
}

#[test]
fn simpo_registered_from_its_own_crate_trains_without_a_reference_pass() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("simpo");
    let (ok, err) = aligner(&[
        "dpo",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "dpo.loss=simpo",
        "--set",
        "dpo.beta=2.0",
        "--set",
        "dpo.params.gamma=0.5",
        "--set",
        "train.max_steps=20",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.save_every=0",
    ]);
    assert!(ok, "{err}");
    assert!(!run.join("reference_train.jsonl").exists());
    let (start, end) = first_and_last(&metrics(&run), "eval_loss");
    assert!(end < start - 0.02, "held-out SimPO loss {start} -> {end}");
}

#[test]
fn default_dpo_makes_the_policys_own_samples_more_positive() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("dpo");
    let (ok, err) = aligner(&[
        "dpo",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.save_every=0",
    ]);
    assert!(ok, "{err}");
    let base = sample_sentiment(&repo().join("assets/stories260K"), &dir.path().join("base.jsonl"));
    let aligned = sample_sentiment(&run.join("final"), &dir.path().join("aligned.jsonl"));
    assert!(
        aligned > base + 1.5,
        "mean lexicon score of own samples: base {base}, after DPO {aligned}"
    );
}

#[test]
fn activation_checkpointing_trains_to_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, checkpointing: bool| {
        let out = dir.path().join(name);
        let (ok, err) = aligner(&[
            "sft",
            "--out",
            out.to_str().unwrap(),
            "--set",
            "train.max_steps=6",
            "--set",
            "train.eval_every=0",
            "--set",
            &format!("train.activation_checkpointing={checkpointing}"),
        ]);
        assert!(ok, "{err}");
        out.join("final")
    };
    let (plain, recomputed) = (run("plain", false), run("recomputed", true));
    let diff = aligner_tests::weights_diff(&plain, &recomputed);
    assert!(
        diff <= 1e-6,
        "recomputing activations moved the weights by {diff}"
    );
    let config = std::fs::read_to_string(dir.path().join("recomputed/config.toml")).unwrap();
    assert!(config.contains("activation_checkpointing = true"), "{config}");
}
