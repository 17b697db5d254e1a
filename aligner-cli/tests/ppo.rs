//! `aligner ppo` end to end: the default pipeline must raise the reward and the sentiment of
//! the policy's samples with the KL bounded; the critic served from another process must
//! overlap with the actor; losing the critic must stop the run cleanly and `--resume` must
//! finish it.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::{
    aligner, assert_tensorboard_matches_metrics, metrics, quick_reward_model, repo, sample_sentiment,
};
use serde_json::Value;

fn sum(rows: &[Value], key: &str) -> f64 {
    rows.iter().filter_map(|r| r[key].as_f64()).sum()
}

fn values(rows: &[Value], key: &str) -> Vec<f64> {
    rows.iter().filter_map(|r| r[key].as_f64()).collect()
}

/// `aligner serve critic` as a child process; killed when dropped.
struct CriticServer {
    child: Child,
    addr: String,
}

impl CriticServer {
    fn start(model: &Path, port: u16) -> Self {
        let mut child = Command::new(common::aligner_exe())
            .args(["serve", "critic", "--model"])
            .arg(model)
            .arg("--reward-model")
            .arg(model)
            .args(["--port", &port.to_string()])
            .current_dir(repo())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected server output {line:?}"))
            .to_string();
        Self { child, addr }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn port(&self) -> u16 {
        self.addr.rsplit(':').next().unwrap().parse().unwrap()
    }
}

impl Drop for CriticServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn default_ppo_raises_reward_and_sentiment_with_bounded_kl() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("ppo");
    // No reward model given: the run trains one first, as a user's first `aligner ppo` does.
    let (ok, err) = aligner(&[
        "ppo",
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.max_steps=12",
    ]);
    assert!(ok, "{err}");
    assert!(run.join("reward_model/final/model.safetensors").exists());
    for file in [
        "final/model.safetensors",
        "critic/model.safetensors",
        "metrics.svg",
        "timing.md",
    ] {
        assert!(run.join(file).exists(), "{file}");
    }
    let rows = metrics(&run);
    let eval = values(&rows, "eval_reward");
    assert!(eval.len() >= 2);
    assert!(
        *eval.last().unwrap() > eval[0] + 2.0,
        "held-out reward-model reward {eval:?}"
    );
    let kl = values(&rows, "kl");
    assert!(
        kl.iter().all(|k| k.is_finite() && *k < 40.0),
        "KL per response {kl:?}"
    );
    let base = sample_sentiment(&repo().join("assets/stories260K"), &dir.path().join("base.jsonl"));
    let aligned = sample_sentiment(&run.join("final"), &dir.path().join("aligned.jsonl"));
    assert!(
        aligned > base + 2.5,
        "mean lexicon score of own samples: base {base}, after PPO {aligned}"
    );
    let table = std::fs::read_to_string(run.join("timing.md")).unwrap();
    for part in ["generation", "refit", "critic wait", "actor training", "total"] {
        assert!(table.contains(part), "{table}");
    }
    // TensorBoard holds every scalar of metrics.jsonl at the same steps, the timing breakdown
    // (`time_*`) and the frontier figures included.
    assert!(
        rows.iter()
            .any(|r| r.get("time_generate").is_some() || r.get("time_total").is_some())
    );
    assert!(rows.iter().any(|r| r.get("eval_frontier/kl").is_some()));
    assert_tensorboard_matches_metrics(&run);
}

#[test]
fn a_critic_in_another_process_works_while_the_actor_does() {
    let dir = tempfile::tempdir().unwrap();
    let rm = quick_reward_model();
    let server = CriticServer::start(&rm, 0);
    let run = dir.path().join("ppo");
    let url = format!("ppo.critic_url={}", server.url());
    let rm_key = format!("reward_model.path={}", rm.display());
    let (ok, err) = aligner(&[
        "ppo",
        "--out",
        run.to_str().unwrap(),
        "--set",
        &url,
        "--set",
        &rm_key,
        "--set",
        "train.max_steps=4",
        "--set",
        "ppo.eval_prompts=16",
        "--set",
        "train.save_every=0",
    ]);
    assert!(ok, "{err}");
    let rows = metrics(&run);
    // Every step reports the critic's own seconds and the actor's wait for it (how much of
    // the one hides the other is a speed figure, read from these columns, not asserted here).
    let (wait, compute) = (sum(&rows, "time_critic_wait"), sum(&rows, "time_critic_compute"));
    assert!(
        compute > 0.0 && wait >= 0.0,
        "critic {compute} s, waited {wait} s"
    );
    assert_eq!(values(&rows, "time_critic_compute").len(), 4);
    assert_eq!(values(&rows, "value_loss").len(), 4);
}

#[test]
fn losing_the_critic_stops_cleanly_and_resume_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let rm = quick_reward_model();
    let server = CriticServer::start(&rm, 0);
    let port = server.port();
    let run = dir.path().join("ppo");
    let sets = [
        format!("ppo.critic_url={}", server.url()),
        format!("reward_model.path={}", rm.display()),
        "train.max_steps=8".into(),
        "train.save_every=2".into(),
        "ppo.eval_prompts=8".into(),
        "ppo.critic_retry_seconds=3".into(),
    ];
    // Stopped after step 3 by the run's own hook (its last checkpoint at 2, step 3 logged
    // after it), then the critic goes away: the resumed actor cannot reach it, and stops
    // saying what to do.
    let mut args = vec!["ppo", "--out", run.to_str().unwrap(), "--stop-after", "3"];
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    let (ok, err) = aligner(&args);
    assert!(ok, "{err}");
    let checkpoint = run.join("checkpoints/step-2");
    assert!(checkpoint.join("ppo_state.json").exists());
    drop(server);
    let (ok, err) = aligner(&["ppo", "--resume", run.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("did not answer") && err.contains("--resume"),
        "{err}"
    );
    for file in [
        "ppo_state.json",
        "actor/model.safetensors",
        "actor_optimizer.bin",
        "critic/model.safetensors",
        "critic/optimizer.bin",
    ] {
        assert!(checkpoint.join(file).exists(), "{file}");
    }
    assert!(!run.join("final").exists());

    let _restarted = CriticServer::start(&rm, port);
    let (ok, stdout, err) = common::aligner_output(&["ppo", "--resume", run.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(run.join("final/model.safetensors").exists());
    let rows = metrics(&run);
    let steps: Vec<f64> = rows.iter().filter_map(|r| r["step"].as_f64()).collect();
    assert_eq!(*steps.last().unwrap(), 8.0);
    // The step-0 evaluation survives the resume, and the summary starts from it.
    assert!(
        rows[0]["step"] == 0.0 && rows[0]["eval_reward"].is_f64(),
        "{:?}",
        rows[0]
    );
    assert!(
        stdout.contains("eval_reward ") && !stdout.contains("eval_reward - ->"),
        "{stdout}"
    );
    // Each step is logged once: the rows of steps after the checkpoint were dropped on resume,
    // in metrics.jsonl and in TensorBoard's event files.
    let mut sorted = steps.clone();
    sorted.dedup();
    assert_eq!(sorted, steps);
    let repeated = common::tensorboard_repeats(&run);
    assert!(repeated.is_empty(), "logged twice in TensorBoard: {repeated:?}");
    assert_tensorboard_matches_metrics(&run);
}

/// RLOO with a LoRA actor and the entropy bonus, its loop from `[train]` like every method's:
/// `train.epochs` over 10 prompts at 8 a step is 2 steps, and the actor's learning rate
/// follows `train.schedule` (linear: the peak, then half of it).
#[test]
fn lora_actor_group_baselines_and_entropy_bonus_run() {
    let dir = tempfile::tempdir().unwrap();
    let rm = quick_reward_model();
    let rm_key = format!("reward_model.path={}", rm.display());
    let prompts = common::head("train.prompts.jsonl", 10, &dir.path().join("ten.prompts.jsonl"));
    let prompts_key = format!("data.train={}", prompts.display());
    let run = dir.path().join("rloo");
    let (ok, err) = aligner(&[
        "ppo",
        "--out",
        run.to_str().unwrap(),
        "--set",
        &rm_key,
        "--set",
        "model.lora_rank=8",
        "--set",
        "ppo.advantage=rloo",
        "--set",
        "ppo.samples_per_prompt=4",
        "--set",
        "ppo.rollout_prompts=8",
        "--set",
        &prompts_key,
        "--set",
        "train.max_steps=0",
        "--set",
        "train.epochs=1",
        "--set",
        "train.schedule=linear",
        "--set",
        "ppo.eval_prompts=8",
        "--set",
        "ppo.entropy_coef=0.01",
    ]);
    assert!(ok, "{err}");
    let lr = values(&metrics(&run), "lr");
    assert!(
        lr.len() == 2 && (lr[0] - 3e-4).abs() < 1e-12 && (lr[1] - 1.5e-4).abs() < 1e-12,
        "{lr:?}"
    );
    assert!(run.join("final/adapter/adapter_model.safetensors").exists());
    let rows = metrics(&run);
    assert!(values(&rows, "value_loss").is_empty(), "RLOO trains no critic");
    // The entropy of the policy's full next-token distributions (vocab 512: at most ln 512).
    let entropy = values(&rows, "entropy");
    assert!(
        entropy.len() == 2 && entropy.iter().all(|&h| h > 0.0 && h < 512f64.ln()),
        "{entropy:?}"
    );
    assert_eq!(values(&rows, "clip_fraction").len(), 2);

    let (ok, err) = aligner(&[
        "ppo",
        "--out",
        dir.path().join("bad").to_str().unwrap(),
        "--set",
        &rm_key,
        "--set",
        "ppo.advantage=grpo",
    ]);
    assert!(!ok);
    assert!(err.contains("ppo.samples_per_prompt"), "{err}");
}

/// A short PPO run (2 steps, no evaluation) against `reward` into `dir/name` with extra
/// `--set`s: its metrics, final model and what it printed to stderr.
fn short_ppo(dir: &Path, reward: &Path, name: &str, sets: &[String]) -> (Vec<Value>, PathBuf, String) {
    let out = dir.join(name);
    let reward = format!("reward_model.path={}", reward.display());
    let mut args: Vec<&str> = vec!["ppo", "--out", out.to_str().unwrap(), "--set", &reward];
    args.extend(["--set", "train.max_steps=2", "--set", "train.eval_every=0"]);
    for set in sets {
        args.extend(["--set", set]);
    }
    let (ok, err) = aligner(&args);
    assert!(ok, "{err}");
    (metrics(&out), out.join("final"), err)
}

/// `train.activation_checkpointing` recomputes the actor's activations in its backward pass
/// (each layer rerun from its kept input): the same rollouts and updates, so the same weights.
#[test]
fn ppo_activation_checkpointing_trains_to_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let reward = quick_reward_model();
    let run = |name: &str, checkpointing: bool| {
        let set = format!("train.activation_checkpointing={checkpointing}");
        let (_, final_dir, log) = short_ppo(dir.path(), &reward, name, &[set]);
        let reruns = log.contains("decoder-layer passes rerun in the backward");
        assert_eq!(reruns, checkpointing, "{log}");
        final_dir
    };
    let (plain, recomputed) = (run("plain", false), run("recomputed", true));
    let diff = common::weights_diff(&plain, &recomputed);
    assert!(
        diff <= 1e-5,
        "recomputing the actor's activations moved its weights by {diff}"
    );
}

/// `ppo.offload_reference` keeps a copy of the frozen reference on the CPU backend (with LoRA,
/// the base with its adapters off): it scores the rollouts as the in-place reference does, so
/// training ends at the same weights.
#[test]
fn an_offloaded_reference_scores_like_the_one_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let reward = quick_reward_model();
    let run = |name: &str, offload: bool| {
        let sets = [
            "model.lora_rank=4".to_string(),
            format!("ppo.offload_reference={offload}"),
        ];
        let (metrics, final_dir, _) = short_ppo(dir.path(), &reward, name, &sets);
        (final_dir, values(&metrics, "kl"))
    };
    let ((in_place, kl_in_place), (offloaded, kl_offloaded)) =
        (run("in-place", false), run("offloaded", true));
    assert_eq!(kl_in_place.len(), kl_offloaded.len());
    for (a, b) in kl_in_place.iter().zip(&kl_offloaded) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "kl {a} against {b}");
    }
    let diff = common::weights_diff(&in_place, &offloaded);
    assert!(
        diff <= 1e-5,
        "offloading the reference moved the weights by {diff}"
    );
}

/// The held-out reward before training and at the end, and the last step's KL, of a run on
/// the shipped verifiable task (`configs/grpo.toml`: `reward.command` runs the task's Python
/// verifier) with extra `--set`s.
fn verifiable_run(dir: &Path, name: &str, sets: &[&str]) -> (f64, f64, f64, Vec<Value>) {
    let out = dir.join(name);
    let mut args = vec![
        "ppo",
        "--config",
        "configs/grpo.toml",
        "--out",
        out.to_str().unwrap(),
        "--set",
        "frontier.prompts=",
        "--set",
        "train.max_steps=16",
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    let (ok, err) = aligner(&args);
    assert!(ok, "{name}: {err}");
    let rows = metrics(&out);
    let eval = values(&rows, "eval_reward");
    let kl = values(&rows, "kl");
    (eval[0], *eval.last().unwrap(), *kl.last().unwrap(), rows)
}

/// Every member of the GRPO family, each a named option, raises the held-out reward of the
/// verifiable task (the share of stories that contain their row's target word, scored by an
/// external command) over the start model's, with the KL to it reported.
#[test]
fn every_grpo_family_option_raises_the_verifiable_reward() {
    let dir = tempfile::tempdir().unwrap();
    let options: [(&str, &[&str]); 6] = [
        ("grpo", &[]),
        (
            "dapo",
            &[
                "ppo.clip_eps_high=0.28",
                "ppo.dynamic_sampling=true",
                "ppo.loss_agg=token-mean",
                "ppo.overlong_buffer=8",
                "ppo.overlong_penalty=0.1",
            ],
        ),
        (
            "dr_grpo",
            &["ppo.advantage=dr_grpo", "ppo.loss_agg=seq-mean-token-sum-norm"],
        ),
        (
            "gspo",
            &[
                "ppo.importance_ratio=sequence",
                "ppo.loss_agg=seq-mean-token-mean",
                "ppo.clip_eps=3e-4",
                "ppo.clip_eps_high=4e-4",
            ],
        ),
        ("reinforce_pp", &["ppo.advantage=reinforce_pp"]),
        ("rloo", &["ppo.advantage=rloo"]),
    ];
    let mut report = Vec::new();
    for (name, sets) in options {
        let (start, end, kl, rows) = verifiable_run(dir.path(), name, sets);
        report.push(format!("{name}: {start:.3} -> {end:.3} at KL {kl:.1}"));
        // The start model's stories contain their word about 9% of the time.
        assert!(start < 0.2, "{name}: start {start}");
        assert!(end > start + 0.1, "{name}: held-out reward {start} -> {end}");
        assert!(kl > 0.0 && kl.is_finite(), "{name}: kl {kl}");
        assert!(values(&rows, "value_loss").is_empty(), "{name} trains no critic");
        assert_eq!(values(&rows, "reward/contains_word").len(), 16, "{name}");
        if name == "dapo" {
            // Dynamic sampling: never more groups than asked for, and extra draws made when
            // groups were dropped.
            let groups = values(&rows, "dynamic_sampling/groups");
            assert!(groups.iter().all(|g| (1.0..=16.0).contains(g)), "{groups:?}");
            assert!(values(&rows, "dynamic_sampling/draws").iter().any(|&d| d > 1.0));
        }
    }
    eprintln!("{}", report.join("\n"));
}

/// A reward command that crashes, hangs or prints garbage stops the run with a message naming
/// it: nothing is trained on made-up scores. A prompt row without the field a rule reads is
/// refused naming its file and line.
#[test]
fn a_broken_reward_stops_the_run_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let scripts = [
        (
            "crash",
            "import sys\nsys.stdin.readline()\nprint('verifier: no such task', file=sys.stderr)\nsys.exit(2)\n",
            "verifier: no such task",
        ),
        (
            "hang",
            "import sys, time\nsys.stdin.readline()\ntime.sleep(600)\n",
            "within 2.0 s",
        ),
        (
            "garbage",
            "import sys\nfor line in sys.stdin:\n    print('correct!', flush=True)\n",
            "\"correct!\"",
        ),
    ];
    for (name, script, says) in scripts {
        let path = dir.path().join(format!("{name}.py"));
        std::fs::write(&path, script).unwrap();
        let out = dir.path().join(name);
        let command = format!("reward.command=[\"python3\", \"{}\"]", path.display());
        let (ok, err) = aligner(&[
            "ppo",
            "--config",
            "configs/grpo.toml",
            "--out",
            out.to_str().unwrap(),
            "--set",
            &command,
            "--set",
            "reward.timeout_seconds=2",
        ]);
        assert!(!ok, "{name}: the run went on");
        assert!(
            err.contains(&format!("{name}.py")) && err.contains(says),
            "{name}: {err}"
        );
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(!out.join("final").exists(), "{name}");
    }
    let (ok, err) = aligner(&[
        "ppo",
        "--config",
        "configs/grpo.toml",
        "--out",
        dir.path().join("field").to_str().unwrap(),
        "--set",
        "reward={rule = \"exact\", field = \"answer\"}",
    ]);
    assert!(!ok);
    assert!(
        err.contains("train.prompts.jsonl:1:") && err.contains("no field \"answer\""),
        "{err}"
    );
}

/// Online DPO on the verifiable task against the reward command, and rejection sampling with
/// built-in rules combined by weight: both raise the held-out reward.
#[test]
fn online_dpo_and_rejection_sampling_take_reward_functions() {
    let dir = tempfile::tempdir().unwrap();
    let online = dir.path().join("online");
    let (ok, stdout, err) = common::aligner_output(&[
        "online-dpo",
        "--out",
        online.to_str().unwrap(),
        "--set",
        "data.train=assets/verifiable_words/train.prompts.jsonl",
        "--set",
        "data.validation=assets/verifiable_words/test.prompts.jsonl",
        "--set",
        "reward.command=[\"python3\", \"assets/verifiable_words/contains_word.py\"]",
        "--set",
        "online.eval_prompts=0",
        "--set",
        "train.max_steps=16",
        "--set",
        "frontier.prompts=",
    ]);
    assert!(ok, "{err}");
    assert!(stdout.contains("online-dpo: 16 steps"), "{stdout}");
    let rows = metrics(&online);
    let eval = values(&rows, "eval_reward");
    assert!(eval.len() == 3 && eval[2] > eval[0] + 0.1, "{eval:?}");
    // Pairs are the ones whose two answers scored differently; each step logs how many.
    let pairs = values(&rows, "pairs");
    assert!(pairs.len() == 16 && pairs.iter().all(|&p| p <= 32.0) && pairs.iter().sum::<f64>() > 0.0);
    assert!(online.join("final/model.safetensors").exists());

    let rs = dir.path().join("rs");
    let config = dir.path().join("rs.toml");
    std::fs::write(
        &config,
        "[data]\ntrain = \"assets/verifiable_words/train.prompts.jsonl\"\n\
         validation = \"assets/verifiable_words/test.prompts.jsonl\"\n\
         [rs]\nrounds = 2\nn = 8\nkl_coef = 0.0\n\
         [train]\nlr = 2e-3\n\
         [frontier]\nprompts = \"\"\n\
         [[reward]]\nrule = \"contains\"\nfield = \"word\"\n\
         [[reward]]\nrule = \"length\"\ntarget = 48\nweight = 0.1\n",
    )
    .unwrap();
    let (ok, err) = aligner(&[
        "rs",
        "--config",
        config.to_str().unwrap(),
        "--out",
        rs.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let rounds = common::jsonl(&rs.join("rs.jsonl"));
    let before = rounds[0]["eval_reward_before"].as_f64().unwrap();
    let after = rounds[1]["eval_reward_after"].as_f64().unwrap();
    assert!(after > before + 0.1, "{before} -> {after}");
    let round = &rounds[0];
    // The best of 8 by the word rule: far more kept samples contain their word than the 8%
    // of all samples do.
    assert!(round["kept_reward"].as_f64().unwrap() > 0.3, "{round}");
}

/// One-step-off: each step after the first trains on samples drawn, during the step before,
/// from the weights that step started with (`behaviour_lag` 1), the drawing overlapped with
/// training; the held-out reward still rises.
#[test]
fn one_step_off_trains_on_samples_one_update_old_and_still_learns() {
    let dir = tempfile::tempdir().unwrap();
    // Stale samples teach less per step: the config's 24 steps rather than the family's 16.
    let (start, end, _, rows) = verifiable_run(
        dir.path(),
        "async",
        &["ppo.one_step_off=true", "train.max_steps=24"],
    );
    let steps: Vec<&Value> = rows.iter().filter(|r| r["behaviour_lag"].is_number()).collect();
    assert_eq!(steps.len(), 24);
    let lags: Vec<f64> = steps
        .iter()
        .map(|r| r["behaviour_lag"].as_f64().unwrap())
        .collect();
    assert_eq!(lags[0], 0.0, "the first step samples from its own weights");
    assert!(lags[1..].iter().all(|&l| l == 1.0), "{lags:?}");
    // Every step after the first had its samples drawn on the side (the seconds that took).
    let overlapped: Vec<f64> = steps
        .iter()
        .map(|r| r["time_generation_overlapped"].as_f64().unwrap())
        .collect();
    assert!(
        overlapped[0] == 0.0 && overlapped[1..].iter().all(|&s| s > 0.0),
        "{overlapped:?}"
    );
    assert!(end > start + 0.1, "held-out reward {start} -> {end}");
}

/// Steps whose samples teach nothing warn and, `ppo.stop_after_flat_steps` of them in a row,
/// stop the run with an error saying why, instead of logging `policy_loss 0` to the end: GRPO
/// at temperature 0 draws one answer four times per prompt (every group advantage 0), and a
/// reward weighted 0 scores every sample alike.
#[test]
fn steps_that_teach_nothing_stop_the_run_saying_why() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, sets: &[&str]| -> (bool, String, PathBuf) {
        let out = dir.path().join(name);
        let mut args = vec![
            "ppo",
            "--out",
            out.to_str().unwrap(),
            "--set",
            "ppo.advantage=\"grpo\"",
            "--set",
            "ppo.samples_per_prompt=4",
            "--set",
            "ppo.rollout_prompts=4",
            "--set",
            "ppo.mini_batch=16",
            "--set",
            "ppo.eval_prompts=4",
            "--set",
            "train.max_steps=6",
            "--set",
            "ppo.stop_after_flat_steps=2",
            "--set",
            "reward.function=\"tinystories_sentiment\"",
            "--set",
            "frontier.prompts=''",
        ];
        for s in sets {
            args.extend(["--set", s]);
        }
        let (ok, err) = aligner(&args);
        (ok, err, out)
    };
    let (ok, err, out) = run("greedy", &["ppo.temperature=0"]);
    assert!(!ok, "a run at temperature 0 trained to its end: {err}");
    assert!(
        err.contains("2 steps in a row taught the policy nothing")
            && err.contains("the 4 samples of each prompt had the same reward")
            && err.contains("ppo.stop_after_flat_steps"),
        "{err}"
    );
    assert!(
        err.contains("this step's samples teach nothing"),
        "no warning: {err}"
    );
    // The first flat step trained and was logged; the second stopped the run before its update.
    let steps: Vec<f64> = values(&metrics(&out), "policy_loss");
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert!(!out.join("final").exists());

    let (ok, err, _) = run("weightless", &["reward.weight=0"]);
    assert!(
        !ok && err.contains("every sample's reward was 0") && err.contains("weights all 0"),
        "{err}"
    );
    // A signal that comes back resets the count: at temperature 1 the run ends normally.
    let (ok, err, out) = run("sampled", &["train.max_steps=2"]);
    assert!(ok, "{err}");
    assert!(out.join("final/model.safetensors").exists());
}
