//! `aligner distill` end to end on the shipped model: the default run distils the default DPO
//! run (its teacher, trained first) into the start model, which must move to the teacher —
//! the per-token KL to it falls and the reward of its own samples rises with the teacher's;
//! the loss follows `distill.alpha` and `distill.temperature`; a LoRA student trains; a
//! teacher with another tokenizer is refused naming both folders.

mod common;

use std::path::Path;

use common::{aligner, metrics, repo};
use serde_json::Value;

/// The step-0 and last values of `key` in a run's metrics.
fn first_and_last(run: &Path, key: &str) -> (f64, f64) {
    let values: Vec<f64> = metrics(run).iter().filter_map(|r| r[key].as_f64()).collect();
    assert!(values.len() >= 2, "{key}: {values:?}");
    (values[0], values[values.len() - 1])
}

/// Each mode moves the start model to the default DPO run (the teacher, trained first into the
/// supervised run's folder and reused by the others): the held-out per-token KL to it falls
/// by more than half and the lexicon score of the student's own samples rises with it.
#[test]
fn every_mode_moves_the_student_to_the_dpo_teacher() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = dir.path().join("supervised/teacher/final");
    // `supervised-top16`: supervised from the teacher's cached 16 most likely tokens.
    for mode in ["supervised", "gkd", "on_policy", "supervised-top16"] {
        let run = dir.path().join(mode);
        let mut args = vec!["distill".to_string(), "--out".into(), run.display().to_string()];
        let (mode, top_k) = mode.split_once("-top").unwrap_or((mode, "0"));
        let mut sets = vec![
            format!("distill.top_k={top_k}"),
            format!("distill.mode={mode}"),
            "train.max_steps=40".into(),
            "train.eval_every=0".into(),
            "train.save_every=0".into(),
            "frontier.max_prompts=16".into(),
        ];
        if run.file_name().is_some_and(|n| n != "supervised") {
            sets.push(format!("distill.teacher={}", teacher.display()));
        }
        for set in sets {
            args.extend(["--set".to_string(), set]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, err) = aligner(&args);
        assert!(ok, "{mode}: {err}");
        let (kl_before, kl_after) = first_and_last(&run, "eval_kl");
        let (reverse_before, reverse_after) = first_and_last(&run, "eval_reverse_kl");
        // Measured at the default 74 steps: reverse KL 0.375 -> 0.006 (supervised), 0.008
        // (gkd), 0.019 (on_policy, from the sampled tokens alone).
        assert!(
            kl_after < 0.5 * kl_before && reverse_after < 0.5 * reverse_before,
            "{mode}: KL to the teacher {kl_before} -> {kl_after}, reverse {reverse_before} -> {reverse_after}"
        );
        // The teacher's lexicon score (5.4 from the start model's 1.2) comes with it.
        let (reward_before, reward_after) = first_and_last(&run, "eval_frontier/tinystories_sentiment");
        assert!(
            reward_after > reward_before + 2.0,
            "{mode}: the student's own samples {reward_before} -> {reward_after}"
        );
    }
    assert!(teacher.join("model.safetensors").exists());
}

/// The step loss is `(1 − alpha)·τ²·kl + alpha·nll` of the logged terms (GKD: `τ²·jsd`); the
/// sampling modes train on the student's own answers; a LoRA student saves its adapter.
#[test]
fn the_loss_follows_alpha_and_temperature_and_lora_students_train() {
    let dir = tempfile::tempdir().unwrap();
    // A random Gemma 2 (another architecture, same tokenizer) teaches the Llama student.
    let teacher = repo().join("tests/reference/hf_random/gemma2_capped");
    let teacher = format!("distill.teacher={}", teacher.display());
    let run = |name: &str, sets: &[&str]| -> Vec<Value> {
        let out = dir.path().join(name);
        let mut args = vec![
            "distill",
            "--out",
            out.to_str().unwrap(),
            "--set",
            &teacher,
            "--set",
            "train.max_steps=2",
            "--set",
            "train.eval_every=0",
            "--set",
            "frontier.prompts=''",
        ];
        for set in sets {
            args.extend(["--set", set]);
        }
        let (ok, err) = aligner(&args);
        assert!(ok, "{name}: {err}");
        metrics(&out)
            .into_iter()
            .filter(|r| r.get("loss").is_some())
            .collect()
    };
    let number = |row: &Value, key: &str| {
        row[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing from {row}"))
    };
    for (name, sets, alpha, tau) in [
        ("plain", &[][..], 0.0, 1.0),
        (
            "mixed",
            &["distill.alpha=0.25", "distill.temperature=2.0"][..],
            0.25,
            2.0,
        ),
        ("lora", &["model.lora_rank=4"][..], 0.0, 1.0),
    ] {
        let rows = run(name, sets);
        assert_eq!(rows.len(), 2, "{name}");
        for row in rows {
            let (loss, kl, nll) = (number(&row, "loss"), number(&row, "kl"), number(&row, "nll"));
            let want = (1.0 - alpha) * tau * tau * kl + alpha * nll;
            assert!(
                (loss - want).abs() < 1e-4 * (1.0 + want.abs()),
                "{name}: loss {loss} against {want}"
            );
            // A random teacher is far from the trained student.
            assert!(kl > 0.1, "{name}: kl {kl}");
        }
    }
    // GKD: half of each batch of 8 is the student's own answers, the loss τ² · JSD.
    for row in run(
        "gkd",
        &[
            "distill.mode=gkd",
            "distill.temperature=2.0",
            "train.batch_size=8",
        ],
    ) {
        let (loss, jsd) = (number(&row, "loss"), number(&row, "jsd"));
        assert!((loss - 4.0 * jsd).abs() < 1e-4 * (1.0 + loss.abs()), "{row}");
        assert!(jsd > 0.0 && number(&row, "own_answer_tokens") > 0.0, "{row}");
    }
    // On-policy: every answer the student's own, the sampled tokens' reverse KL logged. GRPO's
    // clipped loss with the engine's log-probs as the behaviour policy: on the CPU the engine
    // and the trainer agree, so the ratio is 1, nothing clips and the token-mean loss is the
    // mean advantage's negative, the reverse KL itself (γ = 0).
    for row in run("on-policy", &["distill.mode=on_policy", "train.batch_size=4"]) {
        let reverse_kl = number(&row, "reverse_kl");
        assert!(reverse_kl > 0.1, "{row}");
        assert!(number(&row, "own_answer_tokens") > 0.0, "{row}");
        assert!(number(&row, "logprob_mismatch_max") < 1e-3, "{row}");
        assert_eq!(number(&row, "clip_fraction"), 0.0, "{row}");
        assert!((number(&row, "loss") - reverse_kl).abs() < 1e-3, "{row}");
    }
    // The GRPO family's variations run: GSPO's sequence ratio, clip-higher, a sequence-level
    // aggregation and γ = 1 (each token's advantage the reverse KL of the rest of the answer).
    for row in run(
        "on-policy-gspo",
        &[
            "distill.mode=on_policy",
            "train.batch_size=4",
            "distill.importance_ratio=sequence",
            "distill.clip_eps_high=0.28",
            "distill.loss_agg=seq-mean-token-sum-norm",
            "distill.gamma=1.0",
        ],
    ) {
        assert!(
            number(&row, "loss").is_finite() && number(&row, "reverse_kl") > 0.1,
            "{row}"
        );
    }
    // ... and are refused where no policy gradient is taken.
    let out = dir.path().join("refused");
    let (ok, err) = aligner(&[
        "distill",
        "--out",
        out.to_str().unwrap(),
        "--set",
        &teacher,
        "--set",
        "distill.gamma=0.5",
    ]);
    assert!(
        !ok && err.contains("distill.clip_eps") && err.contains("gamma"),
        "{err}"
    );
    assert!(
        dir.path()
            .join("lora/final/adapter/adapter_model.safetensors")
            .exists()
    );
}

#[test]
fn a_teacher_with_another_tokenizer_is_refused_naming_both_folders() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = dir.path().join("lowercasing-teacher");
    std::fs::create_dir_all(&teacher).unwrap();
    let shipped = repo().join("assets/stories260K");
    for entry in std::fs::read_dir(&shipped).unwrap().flatten() {
        std::fs::copy(entry.path(), teacher.join(entry.file_name())).unwrap();
    }
    // The same vocabulary, but every text lowercased first: other ids for the same text.
    let path = teacher.join("tokenizer.json");
    let mut tokenizer: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut normalizers = vec![serde_json::json!({"type": "Lowercase"})];
    if !tokenizer["normalizer"].is_null() {
        normalizers.push(tokenizer["normalizer"].take());
    }
    tokenizer["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": normalizers});
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let out = dir.path().join("run");
    let (ok, err) = aligner(&[
        "distill",
        "--out",
        out.to_str().unwrap(),
        "--set",
        &format!("distill.teacher={}", teacher.display()),
    ]);
    assert!(!ok);
    assert!(
        err.contains("lowercasing-teacher")
            && err.contains("stories260K")
            && err.contains("do not share a tokenizer"),
        "{err}"
    );
    assert!(!out.join("metrics.jsonl").exists());
}

/// A smaller student — layers 0 and 4 of the shipped model's five (`aligner convert
/// keep-layers`) — distilled from the full model beats SFT on the same rows for the same steps
/// on the held-out responses' NLL (measured at 40 steps, lr 3e-3: 2.32 against 2.42 nats per
/// token; the EOS the data appends is left out, since the teacher never ends a story there).
#[test]
fn a_smaller_student_distilled_beats_sft_on_held_out_nll() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = repo().join("assets/stories260K");
    let student = dir.path().join("two-layers");
    let (ok, err) = aligner(&[
        "convert",
        "keep-layers",
        "--model",
        teacher.to_str().unwrap(),
        "--layers",
        "0,4",
        "--out",
        student.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(student.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_hidden_layers"], 2);
    // Never onto its own model (it wrote over the shipped model before), and into a folder
    // that holds a model only with --overwrite.
    let shipped = std::fs::read(teacher.join("model.safetensors")).unwrap();
    let keep = |out: &Path, extra: &[&str]| {
        let mut args = vec!["convert", "keep-layers", "--model", teacher.to_str().unwrap()];
        args.extend(["--layers", "0", "--out", out.to_str().unwrap()]);
        args.extend(extra);
        aligner(&args)
    };
    let (ok, err) = keep(&teacher, &["--overwrite"]);
    assert!(!ok && err.contains("an input of this command"), "{err}");
    assert_eq!(std::fs::read(teacher.join("model.safetensors")).unwrap(), shipped);
    let (ok, err) = keep(&student, &[]);
    assert!(!ok && err.contains("--overwrite"), "{err}");
    assert_eq!(
        config,
        serde_json::from_str::<Value>(&std::fs::read_to_string(student.join("config.json")).unwrap())
            .unwrap()
    );
    let model = format!("model.path={}", student.display());
    let run = |command: &str, extra: &[String]| -> (f64, f64) {
        let out = dir.path().join(command);
        let mut args = vec![command.to_string(), "--out".into(), out.display().to_string()];
        for set in [
            model.clone(),
            "train.lr=3e-3".into(),
            "train.max_steps=40".into(),
            "train.eval_every=0".into(),
            "train.save_every=0".into(),
        ]
        .iter()
        .chain(extra)
        {
            args.extend(["--set".to_string(), set.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, err) = aligner(&args);
        assert!(ok, "{command}: {err}");
        first_and_last(&out, "eval_nll_response")
    };
    let (start, distilled) = run(
        "distill",
        &[
            format!("distill.teacher={}", teacher.display()),
            "frontier.prompts=''".into(),
        ],
    );
    let (same_start, fine_tuned) = run("sft", &[]);
    assert!((start - same_start).abs() < 1e-4, "{start} against {same_start}");
    assert!(
        distilled < fine_tuned - 0.05,
        "held-out response NLL: distilled {distilled}, SFT {fine_tuned} (from {start})"
    );
}

/// GKD stopped after its step-2 checkpoint and resumed ends where the uninterrupted run does:
/// the student's own answers are drawn from the step's seed, not from the process's history.
#[test]
fn a_resumed_gkd_run_ends_where_the_uninterrupted_one_does() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = repo().join("tests/reference/hf_random/gemma2_capped");
    let teacher = format!("distill.teacher={}", teacher.display());
    let run = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec!["distill", "--out", out.to_str().unwrap()];
        for set in [
            teacher.as_str(),
            "distill.mode=gkd",
            "train.batch_size=4",
            "train.max_steps=4",
            "train.save_every=2",
            "train.eval_every=0",
            "frontier.prompts=''",
        ] {
            args.extend(["--set", set]);
        }
        args.extend(extra);
        let (ok, err) = aligner(&args);
        assert!(ok, "{name}: {err}");
        out
    };
    let whole = run("whole", &[]);
    let cut = run("cut", &["--stop-after", "2"]);
    assert!(!cut.join("final").exists());
    let (ok, err) = aligner(&["distill", "--resume", cut.to_str().unwrap()]);
    assert!(ok, "{err}");
    let diff = common::weights_diff(&whole.join("final"), &cut.join("final"));
    assert!(diff <= 1e-6, "the resumed run ends {diff} away");
}

/// `distill.top_k`: the teacher's top-k log-probs are computed once into the run folder and
/// read back by every step and by a resumed run; with k the whole vocabulary the student
/// trains exactly as from the teacher's full distribution every step.
#[test]
fn cached_top_k_teacher_log_probs_train_as_the_teacher_does() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = repo().join("tests/reference/hf_random/gemma2_capped");
    let teacher = format!("distill.teacher={}", teacher.display());
    let run = |name: &str, sets: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec!["distill", "--out", out.to_str().unwrap(), "--set", &teacher];
        for set in ["train.max_steps=6", "train.save_every=3", "frontier.prompts=''"]
            .iter()
            .chain(sets)
        {
            args.extend(["--set", set]);
        }
        let (ok, err) = aligner(&args);
        assert!(ok, "{name}: {err}");
        out
    };
    let full = run("full", &[]);
    // 512: the shipped tokenizer's whole vocabulary.
    let cached = run("cached", &["distill.top_k=512"]);
    let cache = cached.join("teacher_top_k_train.safetensors");
    assert!(cache.exists() && cached.join("teacher_top_k_train.safetensors.key").exists());
    let diff = common::weights_diff(&full.join("final"), &cached.join("final"));
    assert!(
        diff <= 1e-5,
        "cached top-512 ends {diff} from the teacher every step"
    );
    let kl = |run: &Path| {
        metrics(run)
            .iter()
            .filter_map(|r| r["kl"].as_f64())
            .collect::<Vec<_>>()
    };
    let (a, b) = (kl(&full), kl(&cached));
    assert!(
        a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4),
        "{a:?} against {b:?}"
    );

    // A few tokens: a stopped run resumes from the same cache (not computed again).
    let top = dir.path().join("top8");
    let (ok, err) = aligner(&[
        "distill",
        "--out",
        top.to_str().unwrap(),
        "--set",
        &teacher,
        "--set",
        "train.max_steps=6",
        "--set",
        "train.save_every=3",
        "--set",
        "frontier.prompts=''",
        "--set",
        "distill.top_k=8",
        "--stop-after",
        "3",
    ]);
    assert!(ok, "{err}");
    assert!(!top.join("final").exists());
    let written = std::fs::metadata(top.join("teacher_top_k_train.safetensors"))
        .unwrap()
        .modified()
        .unwrap();
    let (ok, err) = aligner(&["distill", "--resume", top.to_str().unwrap()]);
    assert!(ok, "{err}");
    let again = std::fs::metadata(top.join("teacher_top_k_train.safetensors"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(written, again, "the resumed run computed the cache again");
    let rows: Vec<f64> = kl(&top);
    assert!(rows.iter().all(|&k| k.is_finite() && k > 0.0), "{rows:?}");

    // Only supervised distillation reads the data's responses the cache was made from.
    let (ok, err) = aligner(&[
        "distill",
        "--out",
        dir.path().join("bad").to_str().unwrap(),
        "--set",
        &teacher,
        "--set",
        "distill.mode=gkd",
        "--set",
        "distill.top_k=8",
    ]);
    assert!(!ok && err.contains("distill.top_k = 8"), "{err}");
    let (ok, err) = aligner(&[
        "distill",
        "--out",
        dir.path().join("bad2").to_str().unwrap(),
        "--set",
        &teacher,
        "--set",
        "distill.top_k=513",
    ]);
    assert!(
        !ok && err.contains("distill.top_k = 513 is more than the 512 tokens"),
        "{err}"
    );
}

/// `distill.teacher_weight` λ < 1 distils the geometric mixture of the start model and a DPO
/// teacher (the policy DPO would reach at β/λ): the student gets most of the teacher's reward
/// gain at a clearly lower KL to the start than the teacher's own, and its KL to the teacher
/// itself still falls by more than half (measured at λ = 0.7, GKD: 66% of the gain at 54% of
/// the KL; reverse KL to the teacher 0.375 → 0.04).
#[test]
fn a_mixture_target_buys_most_of_the_teachers_reward_at_a_lower_kl() {
    let dir = tempfile::tempdir().unwrap();
    // The default DPO run, trained once for the tests that read it.
    let teacher = common::default_dpo_run();
    let student = dir.path().join("student");
    let teacher_set = format!("distill.teacher={}", teacher.join("final").display());
    let (ok, err) = aligner(&[
        "distill",
        "--out",
        student.to_str().unwrap(),
        "--set",
        &teacher_set,
        "--set",
        "distill.mode=gkd",
        "--set",
        "distill.teacher_weight=0.7",
    ]);
    assert!(ok, "{err}");
    let eval = |model: &Path| -> (f64, f64) {
        let (ok, out, err) = common::aligner_output(&[
            "eval",
            "--model",
            model.to_str().unwrap(),
            "--reward-fn",
            "tinystories_sentiment",
            "--samples-per-prompt",
            "2",
        ]);
        assert!(ok, "{err}");
        let line = out.lines().rev().find(|l| l.starts_with('{')).unwrap();
        let v: Value = serde_json::from_str(line).unwrap();
        (
            v["reward"].as_f64().unwrap(),
            v["kl_per_response"].as_f64().unwrap(),
        )
    };
    let (start_reward, _) = eval(&repo().join("assets/stories260K"));
    let (teacher_reward, teacher_kl) = eval(&teacher.join("final"));
    let (reward, kl) = eval(&student.join("final"));
    let share = (reward - start_reward) / (teacher_reward - start_reward);
    assert!(
        share > 0.5 && kl < 0.8 * teacher_kl,
        "student {reward:.2} at KL {kl:.1}; teacher {teacher_reward:.2} at KL {teacher_kl:.1}; start {start_reward:.2}"
    );
    let rows = metrics(&student);
    let to_teacher: Vec<f64> = rows
        .iter()
        .filter_map(|r| r["eval_reverse_kl_teacher"].as_f64())
        .collect();
    let (first, last) = (to_teacher[0], to_teacher[to_teacher.len() - 1]);
    assert!(last < 0.5 * first, "reverse KL to the teacher {first} -> {last}");

    let (ok, err) = aligner(&[
        "distill",
        "--out",
        dir.path().join("bad").to_str().unwrap(),
        "--set",
        &teacher_set,
        "--set",
        "distill.teacher_weight=0",
    ]);
    assert!(
        !ok && err.contains("distill.teacher_weight = 0: must be in (0, 1]"),
        "{err}"
    );
}
