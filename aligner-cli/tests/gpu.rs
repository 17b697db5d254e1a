//! The `aligner` binary on Burn's wgpu backend (`--device wgpu`), checked against the CPU and
//! transformers. Without a GPU this runs on Mesa's software Vulkan (lavapipe); CI installs
//! `mesa-vulkan-drivers`. Needs a binary built with `--features aligner-cli/wgpu` (run with
//! `--features aligner-cli/wgpu`).

mod common;

use std::path::Path;

use common::{aligner, metrics, repo};
use serde_json::Value;

/// What `aligner --device wgpu generate` prints, greedy, with `extra` flags.
fn greedy_on_wgpu(prompt: &str, new_tokens: u64, extra: &[&str]) -> String {
    let new_tokens = new_tokens.to_string();
    let mut args = vec![
        "--device",
        "wgpu",
        "generate",
        "--prompt",
        prompt,
        "--temperature",
        "0",
    ];
    args.extend(["--max-new-tokens", &new_tokens]);
    args.extend(extra);
    let (ok, stdout, stderr) = common::aligner_output(&args);
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
            greedy_on_wgpu(prompt, new_tokens, &[]),
            expected.trim_end(),
            "prompt {prompt:?}"
        );
    }
}

/// tests/reference/hf_random's families beyond Llama and Qwen2 (families.txt, one a line),
/// each loaded on `device`: its name, the model and transformers' expected values.
fn hf_random_models(device: &burn::tensor::Device) -> Vec<(String, aligner_core::LoadedModel, Value)> {
    let root = repo().join("tests/reference/hf_random");
    let families = std::fs::read_to_string(root.join("families.txt")).unwrap();
    families
        .lines()
        .map(|name| {
            let dir = root.join(name);
            let lm = aligner_core::LoadedModel::from_dir(&dir, device).unwrap();
            let text = std::fs::read_to_string(dir.join("expected_logits.json")).unwrap();
            (name.to_owned(), lm, serde_json::from_str(&text).unwrap())
        })
        .collect()
}

/// Random Qwen3 (per-head q/k norms, sliding-window layers), Mistral (12-token window) and
/// OLMo 2 (output norms, whole-projection q/k norms) models made by transformers (tools/hf_parity.py) on the wgpu device: the logits of a
/// 70-token input (the flash-attention kernels under the window mask) match transformers' to
/// 1e-4, and the engine's greedy continuation (40 tokens past a 6-token prompt, decoding over
/// a windowed cache) is transformers' token for token.
#[test]
fn windowed_and_qk_normed_models_on_wgpu_equal_transformers() {
    use aligner_gen::{Engine, EngineOptions, ForwardPath, GenerationRequest, SamplingParams};
    use burn::tensor::{Device, Int, Tensor, TensorData};
    let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    for (name, lm, expected) in hf_random_models(&device) {
        let input = ids(&expected["ids"]);
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(
                input.iter().map(|&t| t as i64).collect::<Vec<_>>(),
                [1, input.len()],
            ),
            &device,
        );
        let logits: Vec<f32> = lm
            .model
            .forward(tokens)
            .into_data()
            .convert::<f32>()
            .try_to_vec()
            .unwrap();
        let want: Vec<f32> = expected["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
            .collect();
        let worst = logits
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{name} on wgpu: max |logit difference| {worst}");
        let options = EngineOptions {
            slots: 2,
            cache_len: None,
            path: ForwardPath::Burn,
        };
        let mut engine = Engine::for_model(&lm, options).with_eos_ids(vec![]);
        let greedy = ids(&expected["greedy"]);
        let request = GenerationRequest::new(ids(&expected["prompt"]), SamplingParams::greedy(greedy.len()));
        let out = engine.generate(&[request]).unwrap();
        assert_eq!(out[0].token_ids, greedy, "{name} on wgpu");
    }
}

/// Two PPO steps on wgpu into `out`, scored by the reward model set in `reward` (a
/// `reward_model.path=...` setting), with `extra` flags: (success, stderr).
fn ppo_on_wgpu(out: &Path, reward: &str, extra: &[&str]) -> (bool, String) {
    ppo_on_wgpu_with(out, reward, extra, &[])
}

/// [`ppo_on_wgpu`] with more environment variables for the process.
fn ppo_on_wgpu_with(out: &Path, reward: &str, extra: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut args = vec![
        "--device",
        "wgpu",
        "ppo",
        "--out",
        out.to_str().unwrap(),
        "--set",
        reward,
        "--set",
        "train.max_steps=2",
        "--set",
        "train.eval_every=0",
        // Small rollouts (one mini-batch, one pass) and evaluations, 16 new tokens, no
        // frontier sampling: lavapipe runs every kernel on the CPU, and what these tests check
        // does not depend on their size.
        "--set",
        "ppo.rollout_prompts=4",
        "--set",
        "ppo.mini_batch=4",
        "--set",
        "ppo.epochs=1",
        "--set",
        "ppo.eval_prompts=4",
        "--set",
        "ppo.max_new_tokens=16",
        "--set",
        "frontier.prompts=''",
    ];
    args.extend(extra);
    let (ok, _, stderr) = common::aligner_output_with(&args, env);
    (ok, stderr)
}

/// Steps of the wgpu-against-CPU runs below, and the rows each trains on: lavapipe runs every
/// kernel on the CPU (an SFT step at the default batch of 16 took 5 s), so the runs are small,
/// with an lr (2e-3) high enough that 4 steps move the held-out metrics well past the 1e-3 the
/// two backends are compared to, a backward that went wrong on wgpu would show there (SFT's
/// held-out NLL rises at that lr, 1.762 -> 1.865; DPO's held-out margin grows, 0 -> 0.186).
const PARITY_STEPS: usize = 4;
const PARITY_BATCH: usize = 4;

/// Trains `command` for [`PARITY_STEPS`] steps of [`PARITY_BATCH`] rows on `device` into `run`
/// (with `extra` settings), evaluating on 16 held-out rows at the start and the end; returns
/// what it printed to stderr.
fn train(command: &str, device: &str, run: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "--device".to_string(),
        device.into(),
        command.into(),
        "--out".into(),
        run.display().to_string(),
    ];
    let mut set = |key: String| args.extend(["--set".to_string(), key]);
    set(format!("train.max_steps={PARITY_STEPS}"));
    set(format!("train.batch_size={PARITY_BATCH}"));
    set("train.lr=2e-3".into());
    set("train.eval_every=0".into());
    set("train.save_every=0".into());
    // The frontier's sampling at each validation costs minutes on lavapipe; generation on
    // wgpu is checked above against transformers' greedy tokens. The reference pass covers the
    // pairs the steps train on, not the whole training split.
    if command == "dpo" {
        set("frontier.prompts=''".into());
        let pairs = common::head(
            "train.pref.jsonl",
            PARITY_STEPS * PARITY_BATCH,
            &run.with_extension("pairs.jsonl"),
        );
        set(format!("data.train={}", pairs.display()));
    }
    let held_out_file = if command == "dpo" {
        "test.pref.jsonl"
    } else {
        "test.sft.jsonl"
    };
    let held_out = common::head(held_out_file, 16, &run.with_extension("held-out.jsonl"));
    set(format!("data.validation={}", held_out.display()));
    for key in extra {
        set(key.to_string());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, err) = aligner(&args);
    assert!(ok, "{command} on {device}: {err}");
    err
}

/// Every step's training loss on wgpu equals the CPU's within 1e-3, and the held-out metrics
/// at the start and the end too; `moved` (a held-out metric) changes by more than 0.01 over
/// the run, so that the comparison covers what training did.
fn matches_cpu(command: &str, keys: &[&str], moved: &str) {
    matches_cpu_with(command, keys, moved, &[]);
}

/// [`matches_cpu`] with `extra` settings on wgpu alone; returns the wgpu run's stderr.
fn matches_cpu_with(command: &str, keys: &[&str], moved: &str, extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let (gpu, cpu) = (dir.path().join("wgpu"), dir.path().join("cpu"));
    let log = train(command, "wgpu", &gpu, extra);
    train(command, "cpu", &cpu, &[]);
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
    assert!(
        compared >= PARITY_STEPS + 2,
        "{command}: only {compared} values compared"
    );
    let (first, last) = common::first_and_last(&gpu_rows, moved);
    assert!(
        (first - last).abs() > 0.01,
        "{command}: {moved} barely moved, {first} -> {last}"
    );
    eprintln!(
        "{command}: worst |wgpu - cpu| {worst:.2e} over {compared} values; {moved} {first:.4} -> {last:.4}"
    );
    log
}

#[test]
fn sft_steps_on_wgpu_match_the_cpu() {
    matches_cpu("sft", &["loss", "eval_nll"], "eval_nll");
}

/// `train.activation_checkpointing = true` on wgpu: each layer is rerun in the backward
/// through aligner's CubeCL kernels (flash attention, fused norms) from its kept input, and
/// SFT's losses and held-out NLL match the CPU's without it.
#[test]
fn sft_recomputing_layers_on_wgpu_matches_the_cpu_without() {
    let log = matches_cpu_with(
        "sft",
        &["loss", "eval_nll"],
        "eval_nll",
        &["train.activation_checkpointing=true"],
    );
    assert!(
        log.contains("decoder-layer passes rerun in the backward"),
        "{log}"
    );
}

#[test]
fn dpo_steps_on_wgpu_match_the_cpu() {
    matches_cpu(
        "dpo",
        &["loss", "eval_loss", "eval_rewards/margin"],
        "eval_rewards/margin",
    );
}

/// PPO on wgpu with `ppo.offload_reference` and `ppo.offload_reward_model`: the reference
/// and the reward model are kept on the CPU backend and score there, while the actor samples
/// and trains on the GPU (and the critic trains there). Before the first update the
/// policy is the reference, so step 1's KL is only the two backends' rounding (measured
/// ~3e-6 nats per response on lavapipe), and the run trains on. What only offloading does:
/// the device holds less, by the two frozen models' weights. At step 2's end a run that keeps
/// them in place holds both on the device (the actor, the critic and the engine have moved
/// on to updated weights, and the reference and the reward model keep the start's), and the
/// offloaded run holds neither. Measured: 14.19 MiB in place, 12.21 offloaded, for 1.99 MiB of
/// weights. Before the reference was copied into the host's own memory it was forked there,
/// which left its bytes in the device's allocator: the offloaded run then held 15.18 MiB.
#[test]
fn ppo_with_the_reference_offloaded_to_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let reward_dir = common::quick_reward_model();
    let reward = format!("reward_model.path={}", reward_dir.display());
    let run = dir.path().join("ppo");
    let (ok, err) = ppo_on_wgpu(
        &run,
        &reward,
        &[
            "--set",
            "ppo.offload_reference=true",
            "--set",
            "ppo.offload_reward_model=true",
        ],
    );
    assert!(ok, "{err}");
    let kl: Vec<f64> = common::metrics(&run)
        .iter()
        .filter_map(|row| row["kl"].as_f64())
        .collect();
    assert_eq!(kl.len(), 2, "{kl:?}");
    assert!(
        kl[0].abs() < 1e-4,
        "step 1's KL against the offloaded reference: {}",
        kl[0]
    );
    // The reward model beside the critic (combined roles, the default) scored on the CPU
    // while the critic trained on the GPU.
    let rewards: Vec<f64> = common::metrics(&run)
        .iter()
        .filter_map(|row| row["reward"].as_f64())
        .collect();
    assert!(
        rewards.len() == 2 && rewards.iter().all(|r| r.is_finite()),
        "{rewards:?}"
    );
    assert!(run.join("final/model.safetensors").exists());

    let in_place = dir.path().join("in-place");
    let (ok, err) = ppo_on_wgpu(&in_place, &reward, &[]);
    assert!(ok, "{err}");
    let held = |run: &Path| {
        common::metrics(run)
            .iter()
            .find(|row| row["step"] == 2)
            .and_then(|row| row["device_memory_mib"].as_f64())
            .unwrap_or_else(|| panic!("no device_memory_mib at step 2 in {}", run.display()))
    };
    let weights_mib = |model: &Path| {
        let bytes = std::fs::metadata(model.join("model.safetensors")).unwrap().len();
        bytes as f64 / (1024.0 * 1024.0)
    };
    let frozen = weights_mib(&repo().join("assets/stories260K")) + weights_mib(&reward_dir);
    let (kept, offloaded) = (held(&in_place), held(&run));
    assert!(
        kept - offloaded >= 0.9 * frozen,
        "the device held {kept:.3} MiB with the frozen models in place and {offloaded:.3} MiB \
         with them offloaded: {frozen:.3} MiB of their weights should have left it"
    );
}

/// `model.dtype = "f16"` on wgpu (lavapipe has shader-f16): activations and weights in f16,
/// f32 master weights in the optimizer. The losses track the f32 CPU run within f16's
/// rounding and the held-out NLL falls as it does; the final folder is saved in f16 as HF saves such a model
/// (`torch_dtype: float16`) and its weights are the f32 run's within f16 rounding; a run cut
/// after its step-3 checkpoint and resumed ends where the uninterrupted one does, because
/// it continues from `master.safetensors`, not from the rounded f16 folder.
#[test]
fn sft_in_f16_on_wgpu_trains_on_f32_master_weights_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let held_out = common::head("test.sft.jsonl", 32, &dir.path().join("held-out.jsonl"));
    let validation = format!("data.validation={}", held_out.display());
    let (half, cut, cpu) = (
        dir.path().join("f16"),
        dir.path().join("cut"),
        dir.path().join("cpu"),
    );
    let run = |device: &str, out: &Path, extra: &[&str]| {
        let mut args = vec![
            "--device",
            device,
            "sft",
            "--out",
            out.to_str().unwrap(),
            "--set",
            "train.max_steps=6",
            "--set",
            "train.eval_every=0",
            "--set",
            "train.save_every=3",
            // Batches of 4 (a step at the default 16 took 5 s on lavapipe), validated on 32
            // held-out rows.
            "--set",
            "train.batch_size=4",
            "--set",
            "train.lr=2e-4",
            "--set",
            &validation,
        ];
        if device == "wgpu" {
            args.extend(["--set", "model.dtype=\"f16\""]);
        }
        args.extend(extra);
        let (ok, err) = aligner(&args);
        assert!(ok, "{device} {extra:?}: {err}");
    };
    run("wgpu", &half, &[]);
    run("cpu", &cpu, &[]);
    let losses =
        |run: &Path| -> Vec<f64> { metrics(run).iter().filter_map(|r| r["loss"].as_f64()).collect() };
    let (l16, l32) = (losses(&half), losses(&cpu));
    assert_eq!(l16.len(), 6, "{l16:?}");
    for (step, (a, b)) in l16.iter().zip(&l32).enumerate() {
        assert!((a - b).abs() < 0.05, "step {}: f16 loss {a} vs f32 {b}", step + 1);
    }
    // Held-out NLL at the start and the end: f16 lowers it as f32 does (1.8308 -> 1.8209 on
    // the CPU in f32).
    let (first16, last16) = common::first_and_last(&metrics(&half), "eval_nll");
    let (first32, last32) = common::first_and_last(&metrics(&cpu), "eval_nll");
    eprintln!("eval_nll f16 {first16:.4} -> {last16:.4}, f32 {first32:.4} -> {last32:.4}");
    assert!(
        last16 < first16 - 0.005,
        "f16 training lowers the held-out NLL: {first16} -> {last16}"
    );
    assert!((last16 - last32).abs() < 0.01 && (first16 - first32).abs() < 0.01);

    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(half.join("final/config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "float16");
    assert_eq!(common::saved_dtypes(&half.join("final")), ["F16"]);
    let f16_weights = common::tensors(&half.join("final"));
    let f32_weights = common::tensors(&cpu.join("final"));
    let worst = f16_weights
        .iter()
        .flat_map(|(name, w)| w.iter().zip(&f32_weights[name]).map(|(a, b)| (a - b).abs()))
        .fold(0.0f32, f32::max);
    assert!(worst < 0.02, "f16 weights vs the f32 run: {worst}");
    assert!(half.join("checkpoints/step-3/master.safetensors").exists());
    assert!(
        !cpu.join("checkpoints/step-3/master.safetensors").exists(),
        "an f32 run keeps no second copy"
    );

    // Cut after step 4 (the newest checkpoint is step 3), then resumed; without validation,
    // which the losses and weights compared here do not depend on.
    run(
        "wgpu",
        &cut,
        &["--stop-after", "4", "--set", "data.validation=''"],
    );
    assert!(!cut.join("final").exists());
    let (ok, err) = aligner(&["--device", "wgpu", "sft", "--resume", cut.to_str().unwrap()]);
    assert!(ok, "{err}");
    let (resumed, full) = (losses(&cut), l16);
    for (a, b) in resumed.iter().zip(&full) {
        assert!(
            (a - b).abs() < 1e-5,
            "resumed {resumed:?} vs uninterrupted {full:?}"
        );
    }
    let resumed_weights = common::tensors(&cut.join("final"));
    assert_eq!(
        resumed_weights, f16_weights,
        "the resumed run ends on the same f16 weights"
    );
}

/// Greedy generation in f16 on wgpu (`--dtype f16`: the engine's weights, activations and KV
/// cache in f16, logits compared in f32) follows the f32 tokens of transformers.
#[test]
fn greedy_generation_in_f16_on_wgpu_follows_transformers() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/reference/stories260K_transformers.json")).unwrap(),
    )
    .unwrap();
    let case = &reference["greedy"][0];
    let prompt = case["prompt"].as_str().unwrap();
    let new_tokens = case["max_new_tokens"].as_u64().unwrap();
    let expected = format!("{prompt} {}", case["text"].as_str().unwrap());
    assert_eq!(
        greedy_on_wgpu(prompt, new_tokens, &["--dtype", "f16"]),
        expected.trim_end()
    );
    // The CPU computes in f32 and says so.
    let (ok, _, stderr) = common::aligner_output(&["generate", "--dtype", "bf16", "--prompt", "x"]);
    assert!(
        !ok && stderr.contains("--dtype") && stderr.contains("f32"),
        "{stderr}"
    );
    // So does the bench, before it prints a table.
    let (ok, stdout, stderr) = common::aligner_output(&["bench", "--dtype", "bf16", "forward"]);
    assert!(
        !ok && stdout.is_empty() && stderr.contains("--dtype"),
        "{stdout}{stderr}"
    );
}

/// Top-k / top-p sampling on wgpu draws on the device (the filters' kernel, then the inverse
/// CDF, only the tokens coming back) and takes the tokens the CPU's host sampler takes from
/// the same seeds; the draws are really sampled (not the greedy text).
#[test]
fn filtered_sampling_on_wgpu_takes_the_cpu_tokens() {
    let sample = |device: &str| {
        let args = [
            "--device",
            device,
            "generate",
            "--prompt",
            "Once upon a time",
            "--temperature",
            "0.9",
            "--top-k",
            "40",
            "--top-p",
            "0.85",
            "--seed",
            "11",
            "--max-new-tokens",
            "40",
        ];
        let (ok, stdout, stderr) = common::aligner_output(&args);
        assert!(ok, "{stderr}");
        stdout
    };
    let on_wgpu = sample("wgpu");
    assert_eq!(on_wgpu, sample("cpu"));
    assert_ne!(on_wgpu.trim_end(), greedy_on_wgpu("Once upon a time", 40, &[]));
}

/// PPO with `model.dtype = "f16"` on wgpu: the actor, the critic and the reward model beside
/// it compute in f16 on f32 master weights. The critic's folder is saved in f16; each step
/// checkpoint keeps the actor's and the critic's master weights, so a run cut after its
/// step-1 checkpoint and resumed logs the uninterrupted run's steps and ends on its weights.
#[test]
fn ppo_in_f16_on_wgpu_resumes_actor_and_critic_from_master_weights() {
    let dir = tempfile::tempdir().unwrap();
    let reward = common::quick_reward_model();
    let reward = format!("reward_model.path={}", reward.display());
    let (full, cut) = (dir.path().join("full"), dir.path().join("cut"));
    // The three runs pick the same kernels: CubeCL's autotuner chooses by timing and keeps its
    // choices in a store other tests' processes write to at the same time, so an environment
    // of this test's own (one f16 rounding apart is enough to break a bitwise resume). And
    // lavapipe runs a dispatch's workgroups on one thread: on several, the order in which
    // they finish can move with the machine's load, and with it any sum made across them
    // (the full suite broke this bitwise check three times; a run alone never did).
    let env = [
        ("CUBECL_ENVIRONMENT", "aligner-test-ppo-f16-resume"),
        ("LP_NUM_THREADS", "1"),
    ];
    let ppo = |out: &Path, extra: &[&str]| {
        let mut args = vec!["--set", "train.save_every=1", "--set", "model.dtype=\"f16\""];
        args.extend(extra);
        let (ok, err) = ppo_on_wgpu_with(out, &reward, &args, &env);
        assert!(ok, "{extra:?}: {err}");
    };
    ppo(&full, &[]);
    let rows = metrics(&full);
    let column =
        |rows: &[Value], key: &str| -> Vec<f64> { rows.iter().filter_map(|r| r[key].as_f64()).collect() };
    let (rewards, value_loss) = (column(&rows, "reward"), column(&rows, "value_loss"));
    assert!(
        rewards.len() == 2 && rewards.iter().all(|r| r.is_finite()),
        "{rewards:?}"
    );
    assert!(
        value_loss.len() == 2 && value_loss.iter().all(|v| v.is_finite()),
        "{rows:?}"
    );
    let step = full.join("checkpoints/step-1");
    assert!(step.join("actor/master.safetensors").exists());
    assert!(step.join("critic/master.safetensors").exists());
    assert_eq!(common::saved_dtypes(&step.join("critic")), ["F16"]);
    assert_eq!(common::saved_dtypes(&full.join("final")), ["F16"]);

    ppo(&cut, &["--stop-after", "1"]);
    assert!(!cut.join("final").exists());
    let (ok, _, err) = common::aligner_output_with(
        &["--device", "wgpu", "ppo", "--resume", cut.to_str().unwrap()],
        &env,
    );
    assert!(ok, "{err}");
    let resumed = metrics(&cut);
    for key in ["reward", "value_loss", "kl"] {
        let (a, b) = (column(&resumed, key), column(&rows, key));
        assert_eq!(a.len(), 2, "{key}: {a:?}");
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() < 1e-4,
                "{key}: resumed {a:?} vs uninterrupted {b:?}"
            );
        }
    }
    assert_eq!(
        common::tensors(&cut.join("final")),
        common::tensors(&full.join("final")),
        "the resumed run ends on the uninterrupted run's weights"
    );
}

/// A multi-turn episode's next turn on wgpu: a prompt continuing a kept sequence
/// (`SamplingParams::keep_cache`) starts from its cached keys and values — under sliding
/// windows, q/k norms, logit caps and experts too (tests/reference/hf_random) — and samples the
/// tokens and log-probs (1e-4) of a fresh engine computing it whole beside another prompt.
/// Phi-3's LongRoPE keeps nothing (its switch of factors recomputes a sequence whole).
#[test]
fn continued_sequences_on_wgpu_reuse_their_cache() {
    use aligner_gen::{Engine, EngineOptions, ForwardPath, GenerationRequest, SamplingParams};
    use burn::tensor::Device;
    let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
    for (name, lm, expected) in hf_random_models(&device) {
        let input: Vec<u32> = expected["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let engine = || {
            let options = EngineOptions {
                slots: 3,
                cache_len: None,
                path: ForwardPath::Burn,
            };
            Engine::for_model(&lm, options).with_eos_ids(vec![])
        };
        let mut kept = engine();
        let first = GenerationRequest::new(
            input[..8].to_vec(),
            SamplingParams {
                keep_cache: true,
                ..SamplingParams::greedy(12)
            },
        );
        let out = kept.generate(std::slice::from_ref(&first)).unwrap();
        let continued = [&input[..8], out[0].token_ids.as_slice(), &input[20..27]].concat();
        let batch = [
            GenerationRequest::new(input[30..34].to_vec(), SamplingParams::greedy(8)),
            GenerationRequest::new(continued, SamplingParams::greedy(16)),
        ];
        let got = kept.generate(&batch).unwrap();
        let reused = kept.stats().reused_positions;
        if name == "phi3_longrope" {
            assert_eq!(reused, 0, "{name}");
        } else {
            assert_eq!(reused, 8 + 11, "{name}");
        }
        let fresh = engine().generate(&batch).unwrap();
        for (a, b) in got.iter().zip(&fresh) {
            assert_eq!(a.token_ids, b.token_ids, "{name}");
            for (x, y) in a.token_logprobs.iter().zip(&b.token_logprobs) {
                assert!((x - y).abs() < 1e-4, "{name}: {x} against {y}");
            }
        }
    }
}

/// `train.sharding = "full"` and `parallel.tensor = 2` on wgpu: two ranks (`mpirun`) keep
/// half of every parameter on the device — rows gathered through the host for each forward
/// and backward, or Megatron blocks whose activations are summed through the host — and train
/// to the weights and metrics of one wgpu process; so do two plain data-parallel ranks whose
/// gradient buckets are summed during the backward.
#[test]
fn fully_sharded_and_tensor_parallel_ranks_on_wgpu_train_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    // Validated on 16 held-out rows (the whole split, twice a run, was most of its time).
    let held_out = common::head("test.sft.jsonl", 16, &dir.path().join("held-out.jsonl"));
    let validation = format!("data.validation={}", held_out.display());
    // (ranks, batch per rank, the layout's setting)
    let run = |np: usize, batch: usize, layout: &str| {
        let out = dir
            .path()
            .join(format!("np{np}-{}", layout.replace(['.', '='], "-")));
        let batch = format!("train.batch_size={batch}");
        let args = [
            "--device",
            "wgpu",
            "sft",
            "--out",
            out.to_str().unwrap(),
            "--set",
            "train.max_steps=2",
            "--set",
            &batch,
            "--set",
            &validation,
            "--set",
            layout,
        ];
        let output = std::process::Command::new("mpirun")
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "-x",
                "RAYON_NUM_THREADS=1",
            ])
            .args(["-np", &np.to_string()])
            .arg(common::aligner_exe())
            .args(args)
            .current_dir(repo())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        out
    };
    let one = run(1, 4, "train.sharding=none");
    // Plain data parallel too, its gradients read back from the device by the hooks and
    // summed in small buckets while the backward goes on.
    let layouts = [
        run(2, 2, "train.sharding=full"),
        run(2, 4, "parallel.tensor=2"),
        run(2, 2, "train.bucket_mb=0.01"),
    ];
    for layout in layouts {
        let diff = common::weights_diff(&one.join("final"), &layout.join("final"));
        assert!(
            diff <= 1e-5,
            "{}: two wgpu ranks end {diff} from one",
            layout.display()
        );
        let (a, b) = (metrics(&one), metrics(&layout));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            for key in ["loss", "grad_norm", "eval_nll"] {
                if let (Some(p), Some(q)) = (x[key].as_f64(), y[key].as_f64()) {
                    assert!((p - q).abs() <= 1e-5, "step {}: {key} {p} vs {q}", x["step"]);
                }
            }
        }
    }
}
