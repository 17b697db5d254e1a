//! Training commands end to end on the shipped model and data: real runs that must improve a
//! held-out metric, exact resume, and the failure paths.

mod common;

use std::path::Path;

use common::{
    aligner, aligner_output, assert_tensorboard_matches_metrics, first_and_last, jsonl, lexicon_score,
    metrics, repo, sample_sentiment,
};
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
        "train.lr=2e-3",
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
    // The same scalars as TensorBoard events in tb/, every one at its step.
    assert_tensorboard_matches_metrics(&run);
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

/// The default SFT run shifts the style of the model's own samples (a higher lexicon score)
/// while they stay readable: the start model's NLL of them is at most 0.5 nats/token above
/// that of its own samples (README, "Where each default lands").
#[test]
fn default_sft_shifts_sentiment_and_its_samples_stay_fluent() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("sft");
    let (ok, err) = aligner(&[
        "sft",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.save_every=0",
    ]);
    assert!(ok, "{err}");
    let evaluate = |model: Option<&Path>, name: &str| -> Value {
        let out = dir.path().join(name);
        let mut args = vec![
            "eval".to_string(),
            "--reward-fn".into(),
            "tinystories_sentiment".into(),
            "--samples-per-prompt".into(),
            "2".into(),
            "--out".into(),
            out.display().to_string(),
        ];
        if let Some(model) = model {
            args.extend(["--model".into(), model.display().to_string()]);
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, stdout, stderr) = aligner_output(&refs);
        assert!(ok, "{stderr}");
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    let start = evaluate(None, "eval-start");
    let tuned = evaluate(Some(&run.join("final")), "eval-sft");
    let figure = |v: &Value, k: &str| v[k].as_f64().unwrap();
    assert!(
        figure(&tuned, "reward") > figure(&start, "reward") + 0.5,
        "{start} -> {tuned}"
    );
    assert!(
        figure(&tuned, "reference_nll_per_token") < figure(&start, "reference_nll_per_token") + 0.5,
        "{start} -> {tuned}"
    );
    // The held-out response tokens alone are reported beside the NLL with EOS.
    let last = metrics(&run).pop().unwrap();
    assert!(last["eval_nll_response"].as_f64().is_some(), "{last}");
}

/// SFT reports the held-out NLL of the response tokens alone beside the one with the
/// appended EOS, and `train.keep_best` makes `final/` the model of the best validation,
/// naming its step.
#[test]
fn keep_best_makes_final_the_best_validations_model() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("sft");
    let (ok, stdout, err) = aligner_output(&[
        "--quiet",
        "sft",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.max_steps=24",
        "--set",
        "train.eval_every=4",
        "--set",
        "train.lr=0.01",
        "--set",
        "train.save_every=0",
        "--set",
        "train.keep_best=eval_nll_response",
    ]);
    assert!(ok, "{err}");
    let evals: Vec<Value> = metrics(&run)
        .into_iter()
        .filter(|r| r.get("eval_nll").is_some())
        .collect();
    assert_eq!(evals.len(), 7, "validations at 0, 4, ..., 24");
    for row in &evals {
        let (with_eos, alone) = (
            row["eval_nll"].as_f64().unwrap(),
            row["eval_nll_response"].as_f64().unwrap(),
        );
        assert!(with_eos != alone, "{row}");
    }
    let best = evals
        .iter()
        .min_by(|a, b| {
            a["eval_nll_response"]
                .as_f64()
                .unwrap()
                .total_cmp(&b["eval_nll_response"].as_f64().unwrap())
        })
        .unwrap();
    let kept: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("final_step.json")).unwrap()).unwrap();
    assert_eq!(kept["step"], best["step"], "{kept} against {best}");
    assert_eq!(kept["metric"], "eval_nll_response");
    let weights = |d: &str| std::fs::read(run.join(d).join("model.safetensors")).unwrap();
    assert!(
        weights("final") == weights("best"),
        "final/ holds best/'s weights"
    );
    // Copied from best/ but for best/'s own record (the run folder's final_step.json says it).
    assert!(run.join("best/best.json").exists() && !run.join("final/best.json").exists());
    assert!(run.join("final/config.json").exists() && run.join("final/tokenizer.json").exists());
    // The last step's model is not the best one here (lr 0.01 overshoots), so the choice shows.
    assert_ne!(kept["step"], 24, "{evals:?}");
    // --quiet leaves warnings only on stderr; the one-line summary on stdout names the step
    // final/ holds and prints numbers as numbers.
    assert!(!err.contains("INFO"), "{err}");
    let line = stdout.lines().last().unwrap();
    assert!(line.starts_with("sft: 24 steps"), "{line}");
    assert!(
        line.contains(&format!("the best validation's, step {}", kept["step"])),
        "{line}"
    );
    assert!(
        line.contains("eval_nll_response ") && !line.contains("Number("),
        "{line}"
    );
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
    // The RL and self-play configs, cut to one tiny step, scored by the shared quick reward
    // model.
    let rm = format!("reward_model.path={}", common::quick_reward_model().display());
    let runs: [(&[&str], &str, &[&str]); 9] = [
        (
            &["ppo"],
            "ppo",
            &[
                "train.max_steps=1",
                "ppo.rollout_prompts=4",
                "ppo.eval_prompts=4",
                "ppo.mini_batch=4",
            ],
        ),
        (
            &["ppo"],
            "grpo",
            &["train.max_steps=1", "ppo.rollout_prompts=4", "ppo.eval_prompts=4"],
        ),
        (
            &["online-dpo"],
            "online_dpo",
            &[
                "train.max_steps=1",
                "online.prompts_per_step=4",
                "online.eval_prompts=4",
            ],
        ),
        (
            &["self-reward"],
            "self_reward",
            &[
                "self_reward.iterations=1",
                "self_reward.max_prompts=8",
                "sft.max_steps=1",
                "train.max_steps=1",
            ],
        ),
        (
            &["cai"],
            "cai",
            &[
                "cai.max_prompts=4",
                "cai.min_confidence=0",
                "judge.max_steps=1",
                "sl.max_steps=1",
                "reward_model.max_steps=1",
                "online_train.max_steps=1",
                "online.prompts_per_step=4",
                "frontier.max_prompts=4",
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
        (
            &["distill"],
            "distill",
            &[
                "distill.teacher=assets/stories260K",
                "train.max_steps=1",
                "data.validation=''",
                "frontier.prompts=''",
            ],
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
            .chain(["ppo", "rs", "online_dpo"].contains(&file).then(|| rm.clone()))
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
    // Shared with distillation's tests, which take it as their teacher.
    let run = common::default_dpo_run();
    let base = sample_sentiment(&repo().join("assets/stories260K"), &dir.path().join("base.jsonl"));
    let aligned = sample_sentiment(&run.join("final"), &dir.path().join("aligned.jsonl"));
    assert!(
        aligned > base + 1.5,
        "mean lexicon score of own samples: base {base}, after DPO {aligned}"
    );
    // The run traced its own path on the reward–KL frontier at every validation: from the
    // start model (KL 0) to a higher lexicon score at a KL above zero, its samples staying
    // fluent under the start model (at most 0.5 nats/token above where they began).
    let rows: Vec<Value> = metrics(&run)
        .into_iter()
        .filter(|r| r.get("eval_nll").is_some() || r.get("eval_loss").is_some())
        .collect();
    let steps: Vec<u64> = rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps.first(), Some(&0));
    assert!(steps.len() >= 3, "validations at {steps:?}");
    let figure = |row: &Value, name: &str| -> f64 {
        row[format!("eval_frontier/{name}")]
            .as_f64()
            .unwrap_or_else(|| panic!("no eval_frontier/{name} in {row}"))
    };
    let (first, last) = (&rows[0], rows.last().unwrap());
    assert!(figure(first, "kl").abs() < 0.05, "{first}");
    assert!(figure(last, "kl") > 1.0, "{last}");
    assert!(
        figure(last, "tinystories_sentiment") > figure(first, "tinystories_sentiment") + 1.0,
        "{first} -> {last}"
    );
    assert!(
        figure(last, "nll") < figure(first, "nll") + 0.5,
        "{first} -> {last}"
    );
    // `aligner eval --plot` draws that path beside a single evaluation.
    let eval_out = dir.path().join("eval-dpo");
    let final_dir = run.join("final");
    let (ok, stdout, stderr) = aligner_output(&[
        "eval",
        "--model",
        final_dir.to_str().unwrap(),
        "--reward-fn",
        "tinystories_sentiment",
        "--out",
        eval_out.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let summary: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    // The built-in reward is the task's lexicon (counted here independently).
    let samples = jsonl(&eval_out.join("samples.jsonl"));
    let lexicon: f64 = samples
        .iter()
        .map(|s| lexicon_score(s["response"].as_str().unwrap()) as f64)
        .sum::<f64>()
        / samples.len() as f64;
    assert!(
        (summary["reward"].as_f64().unwrap() - lexicon).abs() < 1e-9,
        "{summary}"
    );
    assert!(lexicon > base + 1.0, "{summary}");
    let plot = dir.path().join("plot");
    let (ok, _, stderr) = aligner_output(&[
        "eval",
        "--plot",
        run.to_str().unwrap(),
        eval_out.to_str().unwrap(),
        "--out",
        plot.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    // `aligner plot` draws chosen metrics of runs against the step.
    let chart = dir.path().join("runs.svg");
    let (ok, _, stderr) = aligner_output(&[
        "plot",
        run.to_str().unwrap(),
        "--keys",
        "loss,eval_frontier/kl",
        "--out",
        chart.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let drawn = std::fs::read_to_string(&chart).unwrap();
    assert!(
        drawn.contains("\nloss\n") && drawn.contains("\neval_frontier/kl\n"),
        "a panel per key"
    );
    let (ok, _, stderr) = aligner_output(&["plot", run.to_str().unwrap(), "--keys", "nope"]);
    assert!(!ok && stderr.contains("\"nope\""), "{stderr}");
    let svg = std::fs::read_to_string(plot.join("frontier.svg")).unwrap();
    // Each series is named by its folder.
    let run_name = run.file_name().unwrap().to_str().unwrap();
    assert!(
        svg.contains(&format!("\n{run_name}\n")) && svg.contains("\neval-dpo\n"),
        "legend of both series"
    );
    // The run's validations and the evaluation are drawn, plus a legend mark for each series.
    assert_eq!(svg.matches("<circle").count(), rows.len() + 1 + 2);
}

#[test]
fn activation_checkpointing_trains_to_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, checkpointing: &str| {
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
        // The layers are rerun in the backward, and only under `true`.
        let reruns = err.contains("decoder-layer passes rerun in the backward");
        assert_eq!(reruns, checkpointing == "true", "{checkpointing}: {err}");
        out.join("final")
    };
    let plain = run("plain", "false");
    for (name, checkpointing) in [("recomputed", "true"), ("balanced", "balanced")] {
        let diff = common::weights_diff(&plain, &run(name, checkpointing));
        assert!(
            diff <= 1e-6,
            "activation_checkpointing = {checkpointing} moved the weights by {diff}"
        );
    }
    let config = std::fs::read_to_string(dir.path().join("recomputed/config.toml")).unwrap();
    assert!(config.contains("activation_checkpointing = true"), "{config}");
    let config = std::fs::read_to_string(dir.path().join("balanced/config.toml")).unwrap();
    assert!(
        config.contains("activation_checkpointing = \"balanced\""),
        "{config}"
    );
    // Anything else is refused naming the key.
    let (ok, err) = aligner(&[
        "sft",
        "--out",
        dir.path().join("bad").to_str().unwrap(),
        "--set",
        "train.activation_checkpointing=sometimes",
    ]);
    assert!(!ok && err.contains("train.activation_checkpointing"), "{err}");
}

/// TRL's conversational preference rows — an explicit prompt of messages, an implicit prompt
/// (the turns `chosen` and `rejected` share), the same set as Parquet (as `datasets` writes
/// it), as a JSON array, and with a renamed column (`data.fields`) — all train DPO from the
/// same reference log-probs to the same first-step loss.
#[test]
fn conversational_parquet_and_json_forms_train_dpo_alike() {
    let dir = tempfile::tempdir().unwrap();
    let pairs: Vec<Value> = jsonl(&repo().join("assets/tinystories_sentiment/test.pref.jsonl"))
        .into_iter()
        .take(24)
        .collect();
    let turn = |role: &str, content: &Value| serde_json::json!({"role": role, "content": content});
    let explicit: Vec<Value> = pairs
        .iter()
        .map(|p| {
            serde_json::json!({
                "prompt": [turn("user", &p["prompt"])],
                "chosen": [turn("assistant", &p["chosen"])],
                "rejected": [turn("assistant", &p["rejected"])],
            })
        })
        .collect();
    let implicit: Vec<Value> = pairs
        .iter()
        .map(|p| {
            serde_json::json!({
                "chosen": [turn("user", &p["prompt"]), turn("assistant", &p["chosen"])],
                "rejected": [turn("user", &p["prompt"]), turn("assistant", &p["rejected"])],
            })
        })
        .collect();
    let write_lines = |name: &str, rows: &[Value]| {
        let path = dir.path().join(name);
        let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
        std::fs::write(&path, text).unwrap();
        path
    };
    let explicit_file = write_lines("explicit.jsonl", &explicit);
    let implicit_file = write_lines("implicit.jsonl", &implicit);
    // A JSON array whose prompt column is called "question".
    let renamed: Vec<Value> = explicit
        .iter()
        .map(|r| serde_json::json!({"question": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}))
        .collect();
    let array_file = dir.path().join("renamed.json");
    std::fs::write(&array_file, serde_json::to_string(&renamed).unwrap()).unwrap();
    // A folder of shards: the Parquet file and nothing else.
    let shards = dir.path().join("data-shards");
    std::fs::create_dir_all(&shards).unwrap();
    std::fs::copy(
        repo().join("tests/data/pref_conversational.parquet"),
        shards.join("train-00000.parquet"),
    )
    .unwrap();
    let parquet = repo().join("tests/data/pref_conversational.parquet");
    let forms: [(&str, &Path, &[&str]); 5] = [
        ("explicit", &explicit_file, &[]),
        ("implicit", &implicit_file, &[]),
        ("parquet", &parquet, &[]),
        ("shards", &shards, &[]),
        ("renamed", &array_file, &["data.fields.question=prompt"]),
    ];
    let mut first: Option<(String, f64)> = None;
    for (name, file, extra) in forms {
        let out = dir.path().join(name);
        let data = format!("data.train={}", file.display());
        let mut args = vec![
            "dpo",
            "--out",
            out.to_str().unwrap(),
            "--set",
            &data,
            "--set",
            "data.validation=''",
            "--set",
            "frontier.prompts=''",
            "--set",
            "train.max_steps=1",
            "--set",
            "train.batch_size=8",
        ];
        for e in extra {
            args.extend(["--set", e]);
        }
        let (ok, err) = aligner(&args);
        assert!(ok, "{name}: {err}");
        let reference = std::fs::read_to_string(out.join("reference_train.jsonl")).unwrap();
        let loss = metrics(&out).iter().find_map(|r| r["loss"].as_f64()).unwrap();
        match &first {
            None => first = Some((reference, loss)),
            Some((r, l)) => {
                assert_eq!(&reference, r, "{name}: reference log-probs");
                assert_eq!(loss, *l, "{name}: first-step loss");
            }
        }
    }
    // KTO's conversational rows (a message completion after a message prompt) render as the
    // DPO pairs do: each row's completion scores as the same pair's chosen response.
    let unpaired: Vec<Value> = explicit
        .iter()
        .map(|r| serde_json::json!({"prompt": r["prompt"], "completion": r["chosen"], "label": true}))
        .collect();
    let kto_file = write_lines("unpaired.jsonl", &unpaired);
    let kto = dir.path().join("kto");
    let (ok, err) = aligner(&[
        "kto",
        "--out",
        kto.to_str().unwrap(),
        "--set",
        &format!("data.train={}", kto_file.display()),
        "--set",
        "data.validation=''",
        "--set",
        "frontier.prompts=''",
        "--set",
        "train.max_steps=1",
    ]);
    assert!(ok, "{err}");
    let numbers = |run: &Path| -> Vec<f64> {
        std::fs::read_to_string(run.join("reference_train.jsonl"))
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect()
    };
    let (dpo, kto) = (numbers(&dir.path().join("explicit")), numbers(&kto));
    assert_eq!(dpo.len(), kto.len());
    for i in (0..dpo.len()).step_by(2) {
        assert_eq!(dpo[i], kto[i], "pair {}: chosen against completion", i / 2);
    }
    // A text pair needs its prompt; the error names the file and the row.
    let (ok, err) = aligner(&[
        "dpo",
        "--out",
        dir.path().join("no-prompt").to_str().unwrap(),
        "--set",
        &format!(
            "data.train={}",
            write_lines(
                "text.jsonl",
                &[serde_json::json!({"chosen": "a", "rejected": "b"})]
            )
            .display()
        ),
    ]);
    assert!(
        !ok && err.contains("text.jsonl:1") && err.contains("prompt"),
        "{err}"
    );
}

/// The families beyond Llama train end to end through the CLI: tiny random Qwen3 (per-head q/k
/// norms, a head_dim of its own, sliding-window layers), Mistral (12-token window), OLMo 2
/// (output norms), Gemma 2 (soft-capping, GeGLU, four norms a layer) and Gemma 3 (q/k norms,
/// local RoPE) and Phi-3 (fused projections, partial rotary, LongRoPE: its LoRA adapts
/// `qkv_proj` and `gate_up_proj`), Mixtral (4 experts, top-2, a 12-token window) and Qwen3-MoE (6
/// experts, a dense middle layer; both with the load-balancing loss on) models made by
/// transformers (tools/hf_parity.py), whose windows are far
/// shorter than the shipped stories, go through LoRA SFT on every projection (held-out NLL falls), a reward model with
/// a score head, DPO from the SFT model and two GRPO steps, and every saved folder keeps its
/// family: `model_type`, the window, the q/k and output norms, and the classifier architecture.
#[test]
fn qwen3_mistral_olmo2_and_gemma_models_train_with_every_method_and_keep_their_family() {
    let dir = tempfile::tempdir().unwrap();
    for (name, family, window) in [
        ("qwen3_window", "Qwen3", Value::from(12)),
        ("mistral_window", "Mistral", Value::from(12)),
        ("olmo2_bias", "Olmo2", Value::Null),
        ("gemma2_capped", "Gemma2", Value::from(12)),
        ("gemma3_local_global", "Gemma3", Value::from(12)),
        ("phi3_longrope", "Phi3", Value::from(24)),
        ("mixtral_moe", "Mixtral", Value::from(12)),
        ("qwen3_moe_dense_layer", "Qwen3Moe", Value::Null),
    ] {
        let start = repo().join("tests/reference/hf_random").join(name);
        let model = format!("model.path={}", start.display());
        let run = |method: &str, out: &Path, extra: &[&str]| {
            let mut args = vec![method, "--out", out.to_str().unwrap()];
            args.extend_from_slice(extra);
            let (ok, err) = aligner(&args);
            assert!(ok, "{name} {method}: {err}");
        };
        let sft = dir.path().join(format!("{name}-sft"));
        run(
            "sft",
            &sft,
            &[
                "--set",
                &model,
                "--set",
                "model.lora_rank=8",
                "--set",
                "model.lora_targets=[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\",\"gate_proj\",\"up_proj\",\"down_proj\"]",
                "--set",
                "train.lr=1e-2",
                "--set",
                "train.max_steps=30",
                "--set",
                "train.eval_every=0",
                "--set",
                "train.save_every=0",
            ],
        );
        let (base, trained) = first_and_last(&metrics(&sft), "eval_nll");
        assert!(
            trained < base - 0.5,
            "{name}: LoRA SFT held-out NLL {base} -> {trained}"
        );
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(sft.join("final/config.json")).unwrap()).unwrap();
        assert_eq!(config["architectures"][0], format!("{family}ForCausalLM"));
        assert_eq!(config["sliding_window"], window);
        let saved = common::tensors(&sft.join("final"));
        let has = |key: &str| saved.contains_key(&format!("model.layers.0.{key}.weight"));
        // Phi-3 keeps its fused projections, and its adapter names them as PEFT expects.
        let phi3 = family == "Phi3";
        assert_eq!(
            (
                has("self_attn.qkv_proj"),
                has("mlp.gate_up_proj"),
                has("self_attn.q_proj")
            ),
            (phi3, phi3, !phi3),
            "{name}: fused projections saved for Phi-3 only"
        );
        let adapter: Value = serde_json::from_str(
            &std::fs::read_to_string(sft.join("final/adapter/adapter_config.json")).unwrap(),
        )
        .unwrap();
        let targets = adapter["target_modules"].as_array().unwrap();
        assert_eq!(
            targets.contains(&Value::from("qkv_proj")),
            phi3,
            "{name}: adapter targets {targets:?}"
        );
        // The mixtures keep their experts under their own names; Mixtral's LoRA adapts them as
        // `w1` / `w3` / `w2` (PEFT's names there), Qwen3-MoE's as Llama's.
        let expert = match family {
            "Mixtral" => Some(("block_sparse_moe.experts.3.w2", "w1")),
            "Qwen3Moe" => Some(("mlp.experts.5.down_proj", "gate_proj")),
            _ => None,
        };
        if let Some((weight, target)) = expert {
            assert!(has(weight), "{name}: {weight} saved");
            assert!(
                targets.contains(&Value::from(target)),
                "{name}: adapter targets {targets:?}"
            );
        }
        assert_eq!(
            has("self_attn.q_norm"),
            ["Qwen3", "Olmo2", "Gemma3", "Qwen3Moe"].contains(&family),
            "{name}: q_norm saved for Qwen3, OLMo 2 and Gemma 3"
        );
        let gemma = family.starts_with("Gemma");
        assert_eq!(
            (
                has("input_layernorm"),
                has("post_feedforward_layernorm"),
                has("pre_feedforward_layernorm")
            ),
            (family != "Olmo2", family == "Olmo2" || gemma, gemma),
            "{name}: OLMo 2's output norms replace the input norms; Gemma has both"
        );
        let sft_model = format!("model.path={}", sft.join("final").display());

        let rm = dir.path().join(format!("{name}-rm"));
        run(
            "rm",
            &rm,
            &[
                "--set",
                &model,
                "--set",
                "train.max_steps=10",
                "--set",
                "train.save_every=0",
            ],
        );
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(rm.join("final/config.json")).unwrap()).unwrap();
        // transformers' name for a Gemma 3 text classifier.
        let classifier = if family == "Gemma3" { "Gemma3Text" } else { family };
        assert_eq!(
            config["architectures"][0],
            format!("{classifier}ForSequenceClassification")
        );

        let dpo = dir.path().join(format!("{name}-dpo"));
        run(
            "dpo",
            &dpo,
            &[
                "--set",
                &sft_model,
                "--set",
                "train.max_steps=10",
                "--set",
                "train.save_every=0",
                "--set",
                "frontier.max_prompts=8",
            ],
        );
        assert!(dpo.join("final/model.safetensors").exists());

        let grpo = dir.path().join(format!("{name}-grpo"));
        run(
            "ppo",
            &grpo,
            &[
                "--config",
                repo().join("configs/grpo.toml").to_str().unwrap(),
                "--set",
                &sft_model,
                "--set",
                "train.max_steps=2",
                "--set",
                "ppo.rollout_prompts=4",
                "--set",
                "train.eval_every=0",
                "--set",
                "ppo.eval_prompts=4",
                "--set",
                "frontier.prompts=''",
            ],
        );
        let rows = metrics(&grpo);
        assert!(rows.iter().any(|r| r["step"] == 2), "{name}: GRPO ran two steps");
    }
}

/// `aligner bench --model DIR` measures any model folder aligner loads (here the random Phi-3,
/// fused projections and LongRoPE included) in place of the built-in models: one row each of
/// training, DPO (with its peak memory) and generation, named after the folder, with
/// positive figures; a folder that is not a model is named in the error.
#[test]
fn bench_measures_a_model_folder() {
    let dir = repo().join("tests/reference/hf_random/phi3_longrope");
    let model = dir.to_str().unwrap();
    for what in [
        &["train", "--batch", "2", "--seq", "16", "--steps", "1"][..],
        &["dpo", "--pairs", "2", "--seq", "16", "--steps", "1"],
        &[
            "generate",
            "--prompts",
            "2",
            "--new-tokens",
            "4",
            "--batch-sizes",
            "2",
        ],
    ] {
        let mut args = vec!["bench", "--model", model];
        args.extend_from_slice(what);
        let (ok, stdout, stderr) = common::aligner_output(&args);
        assert!(ok, "{what:?}: {stderr}");
        let rows: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("| phi3_longrope |"))
            .collect();
        assert_eq!(rows.len(), 1, "{what:?}: {stdout}");
        let numbers: Vec<f64> = rows[0]
            .split('|')
            .filter_map(|cell| cell.trim().parse().ok())
            .collect();
        // Parameters, time and throughput at least (single-process all-reduce columns are 0).
        assert!(
            numbers.iter().filter(|n| **n > 0.0).count() >= 3,
            "{what:?}: {}",
            rows[0]
        );
    }
    let (ok, _, stderr) = common::aligner_output(&["bench", "--model", "assets", "forward"]);
    assert!(!ok && stderr.contains("assets"), "{stderr}");
    // A selection of no model is refused, not answered with an empty table.
    let (ok, _, stderr) = common::aligner_output(&["bench", "--only", "nope", "forward"]);
    assert!(!ok && stderr.contains("--only \"nope\""), "{stderr}");
    // A count of 0 is refused naming the flag (`--seq 0` panicked on a capacity overflow).
    let (ok, _, stderr) = common::aligner_output(&["bench", "--only", "stories", "train", "--seq", "0"]);
    assert!(
        !ok && stderr.contains("--seq") && stderr.contains("at least 1"),
        "{stderr}"
    );
}
