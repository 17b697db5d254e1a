//! SteerLM, SPIN and rejection sampling end to end on the shipped model and data.

mod common;

use std::path::{Path, PathBuf};

use common::{
    aligner, jsonl, mean_lexicon, metrics, sample_sentiment, sample_sentiment_seeded, sample_sentiment_with,
};
use serde_json::Value;

fn data(name: &str) -> PathBuf {
    common::repo().join("assets/tinystories_sentiment").join(name)
}

/// SteerLM's four steps end to end. The attribute model and the conditioned SFT are the
/// default runs (what they are calibrated on), trained at the same time since neither needs
/// the other; the bootstrap step samples from a slice of the training prompts and trains on
/// its labelled samples alone, which is enough to show what the step adds.
#[test]
fn steerlm_attribute_model_annotation_and_conditioned_sft() {
    let dir = tempfile::tempdir().unwrap();
    // The attribute and conditioned models are trained (with their defaults) where a
    // bootstrap run with no config looks for its earlier steps, so step 4 below runs with none.
    let boot = dir.path().join("bootstrap");
    let (attr, sft) = (boot.join("attributes"), boot.join("sft"));
    // Validated at the start and the end only, and never checkpointed: the weights are the
    // default run's (measured: the `sft` step's final weights are bit-identical), in 60% of
    // the time.
    const QUIET: [&str; 4] = ["--set", "train.eval_every=0", "--set", "train.save_every=0"];
    let train = |step: &'static str, out: &Path| {
        let out = out.to_str().unwrap().to_string();
        move || {
            let mut args = vec!["steerlm", step, "--out", &out];
            args.extend(QUIET);
            aligner(&args)
        }
    };
    let (attributes, conditioned) = std::thread::scope(|s| {
        let attributes = s.spawn(train("attributes", &attr));
        let conditioned = s.spawn(train("sft", &sft));
        (attributes.join().unwrap(), conditioned.join().unwrap())
    });
    assert!(attributes.0, "{}", attributes.1);
    assert!(conditioned.0, "{}", conditioned.1);
    let rows = metrics(&attr);
    let last = rows
        .iter()
        .rev()
        .find(|r| r["eval_mae_positivity"].is_f64())
        .unwrap();
    let (mae, accuracy) = (
        last["eval_mae_positivity"].as_f64().unwrap(),
        last["eval_bucket_accuracy_positivity"].as_f64().unwrap(),
    );
    // Predicting the training median scores MAE 0.78 and bucket accuracy 0.28 on this split.
    assert!(
        mae < 0.65 && accuracy > 0.45,
        "positivity MAE {mae}, bucket accuracy {accuracy}"
    );

    // Annotation: every row gets every attribute, rounded into 0..4, agreeing with the labels.
    let annotated = dir.path().join("annotated.jsonl");
    let (ok, err) = aligner(&[
        "steerlm",
        "annotate",
        "--model",
        attr.join("final").to_str().unwrap(),
        "--data",
        data("test.steer.jsonl").to_str().unwrap(),
        "--out",
        annotated.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let truth = jsonl(&data("test.steer.jsonl"));
    let predicted = jsonl(&annotated);
    assert_eq!(truth.len(), predicted.len());
    let mut agree = 0;
    for (t, p) in truth.iter().zip(&predicted) {
        for name in ["positivity", "verbosity", "dialogue"] {
            let v = p["attributes"][name].as_u64().unwrap();
            assert!(v <= 4);
        }
        agree += (t["attributes"]["positivity"] == p["attributes"]["positivity"]) as usize;
    }
    assert!(
        agree as f64 / truth.len() as f64 > 0.45,
        "{agree} of {}",
        truth.len()
    );

    // Conditioned SFT (the default run) steers: the lexicon score of the samples rises with the
    // asked positivity. It saves its template; generation applies it.
    let nll = metrics(&sft);
    let first = nll.iter().find_map(|r| r["eval_nll"].as_f64()).unwrap();
    let last = nll.iter().rev().find_map(|r| r["eval_nll"].as_f64()).unwrap();
    assert!(last < first - 0.3, "held-out conditioned NLL {first} -> {last}");
    let settings: Value =
        serde_json::from_str(&std::fs::read_to_string(sft.join("final/steerlm.json")).unwrap()).unwrap();
    assert_eq!(settings["attributes"][2], "positivity");
    let model = sft.join("final");
    let steered = |positivity: u8| -> f64 {
        let out = dir.path().join(format!("positivity-{positivity}.jsonl"));
        let attributes = format!("verbosity:0,dialogue:0,positivity:{positivity}");
        sample_sentiment_with(&model, &out, &["--attributes", &attributes])
    };
    let scores: Vec<f64> = (0..=4).map(steered).collect();
    // The trend, not each step: which level lands how far above the next depends on the
    // machine's float rounding (its matrix kernels) through the sampled tokens. Each level
    // cleared the one below on the AVX-512 machines this test was written on; without AVX-512
    // it measured [0.63, -0.02, 0.35, 0.98, 1.55]: positivity 0 above 1 and 2, the trend
    // (0.28 a level) intact. A model that does not steer has a slope near 0.
    let slope = scores
        .iter()
        .enumerate()
        .map(|(level, score)| (level as f64 - 2.0) * score)
        .sum::<f64>()
        / 10.0;
    assert!(
        slope > 0.2 && scores[4] > scores[2] + 0.5 && scores[3] + scores[4] > scores[0] + scores[1] + 1.0,
        "lexicon by positivity 0..4: {scores:?} (slope {slope:.3} a level)"
    );
    // Verbosity 1 writes more (shorter) words into the same 48 tokens, as its data does.
    let words = |verbosity: u8| -> f64 {
        let out = dir.path().join(format!("verbosity-{verbosity}.jsonl"));
        let attributes = format!("verbosity:{verbosity},dialogue:0,positivity:2");
        sample_sentiment_with(&model, &out, &["--attributes", &attributes]);
        let rows = jsonl(&out);
        rows.iter()
            .map(|r| r["response"].as_str().unwrap().split_whitespace().count() as f64)
            .sum::<f64>()
            / rows.len() as f64
    };
    let (terse, verbose) = (words(0), words(1));
    assert!(
        verbose > terse + 1.0,
        "words at verbosity 0: {terse}, at 1: {verbose}"
    );

    // Step 4, bootstrapping: the conditioned model samples over the grid (5 positivity × 3
    // verbosity values per train prompt), the attribute model labels the samples, and SFT
    // continues on them. The values the human data barely has are learned from the samples
    // that turn out to have them: positivity 0 now samples below 1 (after `sft` alone the two
    // come out alike), and the whole scale rises in order. No config: the run takes the
    // finished `sft` and `attributes` runs in its folder as its model and labeller. It samples
    // for the first 150 training prompts (2,250 samples) and trains on those alone.
    let prompts = common::head("train.prompts.jsonl", 150, &dir.path().join("prompts.jsonl"));
    let (ok, err) = aligner(&[
        "steerlm",
        "bootstrap",
        "--out",
        boot.to_str().unwrap(),
        "--set",
        &format!("bootstrap.prompts={}", prompts.display()),
        "--set",
        "bootstrap.keep_data=false",
        QUIET[0],
        QUIET[1],
        QUIET[2],
        QUIET[3],
    ]);
    assert!(ok, "{err}");
    assert!(
        err.contains("bootstrap samples as labelled") && !err.contains("with its defaults first"),
        "{err}"
    );
    let samples = jsonl(&boot.join("bootstrap.jsonl"));
    assert_eq!(samples.len(), 150 * 15);
    let negative = samples
        .iter()
        .filter(|r| r["attributes"]["positivity"].as_u64().unwrap() == 0)
        .count();
    // Measured: 17 of the 2,250 (the human data has 18 of 2,500).
    assert!(negative > 8, "{negative} samples labelled positivity 0");
    let bootstrapped = boot.join("final");
    assert!(bootstrapped.join("steerlm.json").exists());
    let lexicon = |positivity: u8, guidance: &[&str]| -> f64 {
        let attributes = format!("verbosity:0,dialogue:0,positivity:{positivity}");
        (1..=3)
            .map(|seed| {
                let guided = if guidance.is_empty() { "" } else { "-guided" };
                let out = dir.path().join(format!("boot-{positivity}-{seed}{guided}.jsonl"));
                let mut extra = vec!["--attributes", &attributes];
                extra.extend_from_slice(guidance);
                sample_sentiment_seeded(&bootstrapped, &out, seed, &extra)
            })
            .sum::<f64>()
            / 3.0
    };
    // Measured: -0.44, -0.27, 0.21, 0.85, 1.50 (after `sft`: -0.15, -0.19, 0.39, 0.89, 1.65);
    // guided: -0.76 at 0 and 2.65 at 4.
    let scores: Vec<f64> = (0..=4).map(|p| lexicon(p, &[])).collect();
    // The trend, as for the conditioned SFT above: the steps between neighbours move with the
    // machine's float rounding (-0.44, -0.38 at 0 and 1 once; without AVX-512 0.39, -0.08,
    // 0.31, 0.83, 1.55).
    let slope = scores
        .iter()
        .enumerate()
        .map(|(level, score)| (level as f64 - 2.0) * score)
        .sum::<f64>()
        / 10.0;
    assert!(
        slope > 0.2 && scores[4] > scores[2] + 0.5 && scores[3] + scores[4] > scores[0] + scores[1] + 1.0,
        "bootstrapped lexicon by positivity 0..4: {scores:?}"
    );
    // Classifier-free guidance away from positivity 2 widens the spread between the ends and
    // raises the top. Measured: 0 → -0.76 and 4 → 2.65 (unguided -0.44, 1.50); without
    // AVX-512, 0 → 0.46 and 4 → 2.58 (unguided 0.39, 1.55): there the low end, which the
    // unguided model barely separates from positivity 1, does not fall.
    let guidance = ["--guidance-scale", "2", "--negative-attributes", "positivity:2"];
    let (low, high) = (lexicon(0, &guidance), lexicon(4, &guidance));
    assert!(
        high > scores[4] + 0.5 && high - low > scores[4] - scores[0] + 0.5,
        "guided lexicon at positivity 0: {low} (unguided {}), at 4: {high} (unguided {})",
        scores[0],
        scores[4]
    );

    let out = dir.path().join("steered.jsonl");
    let generate = |attributes: &str, extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "Once upon a time",
            "--attributes",
            attributes,
            "--max-new-tokens",
            "8",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        aligner(&args)
    };
    let (ok, err) = generate("humour:2", &[]);
    assert!(
        !ok && err.contains("humour") && err.contains("positivity"),
        "{err}"
    );
    let (ok, err) = generate("positivity:9", &[]);
    assert!(!ok && err.contains("above 4"), "{err}");
    // Guidance needs the values to steer away from.
    let (ok, err) = generate("positivity:4", &["--guidance-scale", "2"]);
    assert!(!ok && err.contains("--negative-attributes"), "{err}");
    // A model without SteerLM settings cannot be steered.
    let (ok, err) = aligner(&["generate", "--prompt", "Once", "--attributes", "positivity:4"]);
    assert!(!ok && err.contains("steerlm.json"), "{err}");
}

#[test]
fn steerlm_steps_train_with_lora() {
    let dir = tempfile::tempdir().unwrap();
    for step in ["attributes", "sft"] {
        let out = dir.path().join(step);
        let (ok, err) = aligner(&[
            "steerlm",
            step,
            "--out",
            out.to_str().unwrap(),
            "--set",
            "model.lora_rank=8",
            "--set",
            "train.max_steps=4",
        ]);
        assert!(ok, "{step}: {err}");
        assert!(out.join("final/adapter/adapter_config.json").exists(), "{step}");
    }
}

#[test]
fn spin_moves_the_policy_toward_the_data_and_refreshes_the_reference_per_iteration() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("spin");
    let (ok, err) = aligner(&["spin", "--out", run.to_str().unwrap()]);
    assert!(ok, "{err}");
    let reports = jsonl(&run.join("spin.jsonl"));
    assert_eq!(reports.len(), 2);
    // One engine generates for both iterations: built for the first, refit for the second.
    assert!(reports[0]["refit_seconds"].is_null(), "{:?}", reports[0]);
    assert!(reports[1]["refit_seconds"].as_f64().unwrap() > 0.0);
    let margin = |i: usize| reports[i]["margin"].as_f64().unwrap();
    assert!(
        margin(1).abs() < margin(0).abs(),
        "margins {} -> {}",
        margin(0),
        margin(1)
    );
    // The reference's answers move toward the sentiment of the SFT responses.
    let (first, second) = (
        mean_lexicon(&run.join("iter-1/generations.jsonl")),
        mean_lexicon(&run.join("iter-2/generations.jsonl")),
    );
    let target = mean_lexicon(&data("train.sft.jsonl"));
    assert!(
        first < target && second > first + 0.4,
        "samples {first} -> {second}, data {target}"
    );

    // The policy keeps what it gained: the second iteration does not swing the held-out
    // samples back toward the base model's sentiment.
    let sampled = |model: &Path, name: &str| sample_sentiment(model, &dir.path().join(name));
    let base = sampled(&common::repo().join("assets/stories260K"), "base.jsonl");
    let (after_one, after_two) = (
        sampled(&run.join("iter-1/final"), "iter1.jsonl"),
        sampled(&run.join("final"), "iter2.jsonl"),
    );
    assert!(
        after_one > base + 0.5 && after_two > base + 0.5 && after_two > after_one - 0.5,
        "held-out sample sentiment: base {base}, iteration 1 {after_one}, iteration 2 {after_two}"
    );

    // Iteration k's cached reference log-probs (chosen, rejected alternating) are those of the
    // policy at the start of iteration k: the base model for k = 1, iteration 1's final model
    // for k = 2.
    let score = |model: &Path, iteration: usize| -> Vec<f64> {
        let by = if model.as_os_str().is_empty() {
            "base"
        } else {
            "policy"
        };
        let out = dir.path().join(format!("score-{iteration}-{by}.jsonl"));
        let gens = run.join(format!("iter-{iteration}/generations.jsonl"));
        let mut args = vec![
            "score",
            "--data",
            gens.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        let model = model.to_str().unwrap().to_string();
        if !model.is_empty() {
            args.extend(["--model", model.as_str()]);
        }
        let (ok, err) = aligner(&args);
        assert!(ok, "{err}");
        jsonl(&out)
            .iter()
            .map(|r| r["logprob"].as_f64().unwrap())
            .collect()
    };
    let cached = |iteration: usize| -> Vec<f64> {
        std::fs::read_to_string(run.join(format!("iter-{iteration}/reference_train.jsonl")))
            .unwrap()
            .lines()
            .skip(1)
            .step_by(2)
            .map(|l| l.parse().unwrap())
            .collect()
    };
    let close =
        |a: &[f64], b: &[f64]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-2);
    assert!(close(&score(Path::new(""), 1), &cached(1)));
    // Iteration 2 trains on its own answers and, mixed in after them (`spin.mix_previous`),
    // iteration 1's, scored again by the new reference.
    let own = jsonl(&run.join("iter-2/generations.jsonl")).len();
    let second = cached(2);
    assert_eq!(second.len(), 2 * own);
    let refreshed = score(&run.join("iter-1/final"), 2);
    assert!(close(&refreshed, &second[..own]));
    assert!(
        !close(&score(Path::new(""), 2), &second[..own]),
        "iteration 2 does not score with the base"
    );

    // Interrupted after iteration 1, a resumed run builds iteration 2 from the same pairs:
    // its own answers again, and iteration 1's read back from its folder.
    let reference_file = run.join("iter-2/reference_train.jsonl");
    let first_run = std::fs::read_to_string(&reference_file).unwrap();
    std::fs::remove_dir_all(run.join("iter-2")).unwrap();
    std::fs::remove_dir_all(run.join("final")).unwrap();
    let report_file = run.join("spin.jsonl");
    let first_report = std::fs::read_to_string(&report_file).unwrap();
    std::fs::write(
        &report_file,
        format!("{}\n", first_report.lines().next().unwrap()),
    )
    .unwrap();
    let (ok, err) = aligner(&["spin", "--resume", run.to_str().unwrap()]);
    assert!(ok, "{err}");
    let numbers = |text: &str| -> Vec<f64> { text.lines().map(|l| l.parse().unwrap()).collect() };
    let resumed = numbers(&std::fs::read_to_string(&reference_file).unwrap());
    assert!(
        close(&resumed, &numbers(&first_run)),
        "resumed iteration 2 trains on other pairs"
    );
    assert_eq!(jsonl(&report_file).len(), 2);
}

#[test]
fn rejection_sampling_raises_the_reward_round_over_round() {
    let dir = tempfile::tempdir().unwrap();
    let rm = dir.path().join("rm");
    let (ok, err) = aligner(&[
        "rm",
        "--out",
        rm.to_str().unwrap(),
        "--set",
        "train.max_steps=60",
        "--set",
        "train.save_every=0",
    ]);
    assert!(ok, "{err}");
    let run = dir.path().join("rs");
    let rm_key = format!("reward_model.path={}", rm.join("final").display());
    let (ok, err) = aligner(&[
        "rs",
        "--out",
        run.to_str().unwrap(),
        "--set",
        &rm_key,
        "--set",
        "rs.rounds=2",
    ]);
    assert!(ok, "{err}");
    let rounds = jsonl(&run.join("rs.jsonl"));
    assert_eq!(rounds.len(), 2);
    let get = |i: usize, k: &str| rounds[i][k].as_f64().unwrap();
    assert!(
        get(0, "eval_reward_after") > get(0, "eval_reward_before") + 0.5,
        "{rounds:?}"
    );
    assert!(
        get(1, "eval_reward_after") > get(0, "eval_reward_before") + 1.0,
        "{rounds:?}"
    );
    // One engine samples every round, refit with the new weights in place.
    assert!(get(0, "refit_seconds") > 0.0 && get(1, "refit_seconds") > 0.0);
    // The kept samples are the best of each group.
    assert!(get(0, "kept_reward") > get(0, "sample_reward"));
    assert!(run.join("final/model.safetensors").exists());
    // Each round is placed on the reward–KL frontier: the lexicon score of the policy's own
    // samples rises above the start model's (about 1.2) while the start model's NLL of them
    // stays within 0.5 nats/token of its own samples' (about 1.3).
    let last = &rounds[1];
    assert!(get(1, "eval_frontier/tinystories_sentiment") > 2.0, "{last}");
    assert!(get(1, "eval_frontier/nll") < 1.8, "{last}");
    assert!(
        get(1, "eval_frontier/kl") > get(0, "eval_frontier/kl"),
        "{rounds:?}"
    );
}

/// Self-rewarding: after the IFT + EFT fine-tuning the model judges held-out labelled answers
/// above chance; over two iterations of answering, judging itself and DPO on best against
/// worst, the sentiment of its own samples rises while its judging does not fall, with the KL
/// to the start model reported; every intermediate file is kept.
#[test]
fn self_rewarding_iterations_raise_the_reward_and_keep_the_judge() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("self-reward");
    let (ok, stdout, err) = common::aligner_output(&[
        "self-reward",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "self_reward.iterations=2",
        // The IFT + EFT step validated and saved once, at its end (every 25 steps was 20 s of
        // this test; the weights are the same).
        "--set",
        "sft.eval_every=0",
        "--set",
        "sft.save_every=0",
        // 208 samples per evaluation (standard error about 0.07 lexicon).
        "--set",
        "frontier.max_prompts=104",
        "--set",
        "frontier.samples_per_prompt=2",
    ]);
    assert!(ok, "{err}");
    assert!(stdout.contains("self-reward: 2 iterations"), "{stdout}");
    for file in [
        "sft/final/model.safetensors",
        "ift_eft.train.jsonl",
        "iter-1/candidates.jsonl",
        "iter-1/pairs.jsonl",
        "iter-2/dpo/final/model.safetensors",
        "final/model.safetensors",
    ] {
        assert!(run.join(file).exists(), "{file}");
    }
    let candidates = common::jsonl(&run.join("iter-1/candidates.jsonl"));
    assert_eq!(candidates.len(), 256);
    assert_eq!(candidates[0]["responses"].as_array().unwrap().len(), 4);
    for pair in common::jsonl(&run.join("iter-1/pairs.jsonl")) {
        let (c, r) = (
            pair["chosen_reward"].as_f64().unwrap(),
            pair["rejected_reward"].as_f64().unwrap(),
        );
        assert!(
            c > r + 0.1 && (0.0..=4.0).contains(&c) && (0.0..=4.0).contains(&r),
            "{pair}"
        );
    }
    let reports = common::jsonl(&run.join("self_reward.jsonl"));
    assert_eq!(reports.len(), 3);
    let figure = |i: usize, key: &str| reports[i][key].as_f64().unwrap();
    let agreement: Vec<f64> = (0..3).map(|i| figure(i, "judge_agreement")).collect();
    let reward: Vec<f64> = (0..3)
        .map(|i| figure(i, "eval_frontier/tinystories_sentiment"))
        .collect();
    let kl: Vec<f64> = (0..3).map(|i| figure(i, "eval_frontier/kl")).collect();
    eprintln!("agreement {agreement:?}, reward {reward:?}, kl {kl:?}");
    assert!(
        agreement[0] > 0.55,
        "the EFT-trained judge is at chance: {agreement:?}"
    );
    assert!(
        agreement[2] > agreement[0] - 0.05,
        "the judge fell: {agreement:?}"
    );
    // Measured: 2.12 → 2.37 → 2.71 (standard error about 0.07), agreement 0.61 → 0.63 → 0.63.
    assert!(
        reward[1] > reward[0] + 0.1 && reward[2] > reward[0] + 0.3,
        "{reward:?}"
    );
    assert!(kl.iter().all(|k| k.is_finite()) && kl[2] > 0.0, "{kl:?}");
}

/// Constitutional AI with the embedded default: every stage's files are kept and are what the
/// shipped constitution's templates say; the feedback judge's AI labels agree with the
/// lexicon's labels well above chance; the policy trained on them (a reward model on the soft
/// labels, then online DPO) samples happier stories than the start model.
#[test]
fn constitutional_ai_keeps_its_files_and_its_ai_labels_raise_the_reward() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("cai");
    let (ok, stdout, err) = common::aligner_output(&[
        "cai",
        "--out",
        run.to_str().unwrap(),
        // Half the default's 512 prompts: the stages and their files are the same, and the
        // reward still rises by twice the margin asserted below.
        "--set",
        "cai.max_prompts=256",
        // 208 samples per evaluation (standard error about 0.1 lexicon).
        "--set",
        "frontier.max_prompts=104",
        "--set",
        "frontier.samples_per_prompt=2",
    ]);
    assert!(ok, "{err}");
    assert!(stdout.contains("cai: 2 stages"), "{stdout}");
    for file in [
        "sl/answers.jsonl",
        "sl/critiques.jsonl",
        "sl/revisions.jsonl",
        "sl/sft.train.jsonl",
        "sl/sft/final/model.safetensors",
        "judge/final/model.safetensors",
        "rl/labels.jsonl",
        "rl/preferences.jsonl",
        "rl/reward_model/final/model.safetensors",
        "rl/online_dpo/final/model.safetensors",
        "final/model.safetensors",
    ] {
        assert!(run.join(file).exists(), "{file}");
    }
    let constitution: toml::Table = toml::from_str(
        &std::fs::read_to_string(common::repo().join("aligner-selfreward/src/cai/stories_constitution.toml"))
            .unwrap(),
    )
    .unwrap();
    let text = |v: &toml::Value| v.as_str().unwrap().to_string();
    let principle = |name: &str| {
        constitution["principles"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .unwrap()
            .clone()
    };
    let answers = common::jsonl(&run.join("sl/answers.jsonl"));
    let critiques = common::jsonl(&run.join("sl/critiques.jsonl"));
    let revisions = common::jsonl(&run.join("sl/revisions.jsonl"));
    assert_eq!(answers.len(), 256);
    assert_eq!((critiques.len(), revisions.len()), (256, 256));
    for ((a, c), r) in answers.iter().zip(&critiques).zip(&revisions).take(50) {
        let p = principle(c["principle"].as_str().unwrap());
        let s = |v: &Value| v.as_str().unwrap().to_string();
        // The current prompt comes last in each, after the few-shot example.
        let critique_tail = text(&constitution["critique_template"])
            .replace("{critique_request}", &text(&p["critique_request"]))
            .replace("{prompt}", &s(&a["prompt"]))
            .replace("{response}", &s(&a["response"]));
        assert!(s(&c["critique_prompt"]).ends_with(&critique_tail), "{c}");
        assert!(!s(&c["critique"]).contains('\n'), "a critique is one line: {c}");
        let revision_tail = text(&constitution["revision_template"])
            .replace("{critique_request}", &text(&p["critique_request"]))
            .replace("{revision_request}", &text(&p["revision_request"]))
            .replace("{prompt}", &s(&a["prompt"]))
            .replace("{critique}", &s(&c["critique"]))
            .replace("{response}", &s(&a["response"]));
        assert!(s(&r["revision_prompt"]).ends_with(&revision_tail), "{r}");
    }
    let labels = common::jsonl(&run.join("rl/labels.jsonl"));
    assert_eq!(labels.len(), 256);
    assert!(
        labels
            .iter()
            .all(|l| (0.0..=1.0).contains(&l["p_a"].as_f64().unwrap()))
    );
    for p in common::jsonl(&run.join("rl/preferences.jsonl")) {
        assert!(p["chosen_probability"].as_f64().unwrap() >= 0.55, "{p}");
    }
    let reports = common::jsonl(&run.join("cai.jsonl"));
    let stages: Vec<&str> = reports.iter().map(|r| r["stage"].as_str().unwrap()).collect();
    assert_eq!(stages, ["start", "sl", "rl"]);
    let reward = |i: usize| {
        reports[i]["eval_frontier/tinystories_sentiment"]
            .as_f64()
            .unwrap()
    };
    let agreement = reports[2]["ai_label_agreement"].as_f64().unwrap();
    eprintln!(
        "AI label agreement {agreement}, judge {}, reward {} → {} → {}, kl {}",
        reports[2]["judge_agreement"],
        reward(0),
        reward(1),
        reward(2),
        reports[2]["eval_frontier/kl"]
    );
    // Measured on 256 prompts: agreement 0.89 (judge 0.96), lexicon 1.09 → 1.16 → 3.21 at KL
    // 7.2 (on the default 512: 0.91, 1.09 → 1.43 → 4.61 at KL 8.6).
    assert!(agreement > 0.7, "AI labels near chance: {agreement}");
    assert!(reward(2) > reward(0) + 1.0, "{} → {}", reward(0), reward(2));
}
