//! The `aligner` binary on Burn's wgpu backend (`--device wgpu`), checked against the CPU and
//! transformers. Without a GPU this runs on Mesa's software Vulkan (lavapipe); CI installs
//! `mesa-vulkan-drivers`. Needs a binary built with `--features aligner-cli/wgpu` (run with
//! `--features aligner-cli/wgpu,aligner-tests/wgpu`).

use std::path::Path;

use aligner_tests::{aligner, metrics, repo};
use serde_json::Value;

/// What `aligner --device wgpu generate` prints, greedy.
fn greedy_on_wgpu(prompt: &str, new_tokens: u64) -> String {
    let new_tokens = new_tokens.to_string();
    let (ok, stdout, stderr) = aligner_tests::aligner_output(&[
        "--device",
        "wgpu",
        "generate",
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--max-new-tokens",
        &new_tokens,
    ]);
    assert!(ok, "{stderr}");
    stdout.trim_end().to_owned()
}

#[test]
fn greedy_tokens_on_wgpu_equal_transformers() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/reference/stories260K_transformers.json")).unwrap(),
    )
    .unwrap();
    for case in reference["greedy"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let new_tokens = case["max_new_tokens"].as_u64().unwrap();
        let expected = format!("{prompt} {}", case["text"].as_str().unwrap());
        assert_eq!(
            greedy_on_wgpu(prompt, new_tokens),
            expected.trim_end(),
            "prompt {prompt:?}"
        );
    }
}

/// Trains `command` for 10 steps on `device` into `run`, evaluating at the start and the end.
fn train(command: &str, device: &str, run: &Path) {
    let mut args = vec![
        "--device",
        device,
        command,
        "--out",
        run.to_str().unwrap(),
        "--set",
        "train.max_steps=10",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.save_every=0",
    ];
    // The frontier's sampling at each validation costs minutes on lavapipe; generation on
    // wgpu is checked above against transformers' greedy tokens.
    if command == "dpo" {
        args.extend(["--set", "frontier.prompts=''"]);
    }
    let (ok, err) = aligner(&args);
    assert!(ok, "{command} on {device}: {err}");
}

/// Every step's training loss on wgpu equals the CPU's within 1e-3, and the held-out metrics
/// at the start and the end too.
fn matches_cpu(command: &str, keys: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let (gpu, cpu) = (dir.path().join("wgpu"), dir.path().join("cpu"));
    train(command, "wgpu", &gpu);
    train(command, "cpu", &cpu);
    let (gpu_rows, cpu_rows) = (metrics(&gpu), metrics(&cpu));
    assert_eq!(gpu_rows.len(), cpu_rows.len(), "{command}: metrics rows");
    let (mut compared, mut worst) = (0, 0.0f64);
    for (g, c) in gpu_rows.iter().zip(&cpu_rows) {
        assert_eq!(g["step"], c["step"]);
        for key in keys {
            if let (Some(a), Some(b)) = (g[*key].as_f64(), c[*key].as_f64()) {
                assert!(
                    (a - b).abs() < 1e-3,
                    "{command} step {}: {key} wgpu {a} vs cpu {b}",
                    g["step"]
                );
                compared += 1;
                worst = worst.max((a - b).abs());
            }
        }
    }
    assert!(compared >= 10, "{command}: only {compared} values compared");
    eprintln!("{command}: worst |wgpu - cpu| {worst:.2e} over {compared} values");
}

#[test]
fn ten_sft_steps_on_wgpu_match_the_cpu() {
    matches_cpu("sft", &["loss", "eval_nll"]);
}

#[test]
fn ten_dpo_steps_on_wgpu_match_the_cpu() {
    matches_cpu("dpo", &["loss", "eval_loss", "eval_rewards/margin"]);
}

/// PPO on wgpu with `ppo.offload_reference`: the reference is copied to the CPU backend and
/// scores there, while the actor samples and trains on the GPU. Before the first update the
/// policy is the reference, so step 1's KL is only the two backends' rounding (measured
/// ~3e-6 nats per response on lavapipe), and the run trains on.
#[test]
fn ppo_with_the_reference_offloaded_to_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let reward = aligner_tests::quick_reward_model(dir.path());
    let reward = format!("reward_model.path={}", reward.display());
    let run = dir.path().join("ppo");
    let (ok, err) = aligner(&[
        "--device",
        "wgpu",
        "ppo",
        "--out",
        run.to_str().unwrap(),
        "--set",
        &reward,
        "--set",
        "ppo.steps=2",
        "--set",
        "ppo.eval_every=0",
        "--set",
        "ppo.offload_reference=true",
    ]);
    assert!(ok, "{err}");
    let kl: Vec<f64> = aligner_tests::metrics(&run)
        .iter()
        .filter_map(|row| row["kl"].as_f64())
        .collect();
    assert_eq!(kl.len(), 2, "{kl:?}");
    assert!(
        kl[0].abs() < 1e-4,
        "step 1's KL against the offloaded reference: {}",
        kl[0]
    );
    assert!(run.join("final/model.safetensors").exists());
}
