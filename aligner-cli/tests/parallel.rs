//! Data parallel under `mpirun`: N ranks with batch b train exactly like one process with batch
//! N·b (weights and metrics within 1e-5), a sharded optimiser gives the same weights, a
//! multi-rank run stopped (or with one rank aborted mid-run, as if killed) resumes to where the uninterrupted one ends,
//! and PPO, KTO, SPIN,
//! rejection sampling and SteerLM run across ranks.
//!
//! Needs OpenMPI (`mpirun`) and the binary built with the `mpi` feature:
//! `cargo test --release --workspace --features aligner-cli/mpi`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{aligner, aligner_exe, head, metrics, repo, weights_diff};
use serde_json::Value;

/// `mpirun -np N` around a program, one thread per rank (the CI machine has two cores).
fn mpirun(np: usize, program: &Path) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-x",
            "RAYON_NUM_THREADS=1",
            "-np",
        ])
        .arg(np.to_string())
        .arg(program)
        .current_dir(repo());
    command
}

/// GRPO on the shipped model, small: 6 prompts of 4 samples of up to 16 tokens a step.
const SMALL_GRPO: [&str; 6] = [
    "ppo.advantage=grpo",
    "ppo.samples_per_prompt=4",
    "ppo.rollout_prompts=6",
    "ppo.max_new_tokens=16",
    "ppo.mini_batch=12",
    "ppo.eval_prompts=8",
];

/// Gradient buckets small enough that stories260K's gradients fill dozens.
const SMALL_BUCKETS: &str = "train.bucket_mb=0.01";

/// Runs `aligner args` on `np` ranks (one process without mpirun for `np == 1`); returns what
/// it printed to stderr.
fn ranks(np: usize, args: &[&str]) -> String {
    // The frontier's samples differ between rank counts by float noise (a token drawn at a
    // boundary flips), and only rank 0 measures them: these runs compare training alone.
    let mut args = args.to_vec();
    if matches!(args.first(), Some(&"dpo") | Some(&"kto")) && !args.contains(&"--resume") {
        args.extend(["--set", "frontier.prompts=''"]);
    }
    // Validation on the first 32 held-out rows where a test sets no number of its own: the
    // whole split at the start and the end of every run was much of this file's time, and a
    // layout's validation sums compare on any rows.
    let trainer = matches!(
        args.first(),
        Some(&"sft" | &"rm" | &"dpo" | &"kto" | &"steerlm" | &"spin" | &"rs" | &"distill")
    ) && args.get(1) != Some(&"annotate");
    if trainer && !args.contains(&"--resume") && !args.iter().any(|a| a.starts_with("train.eval_examples")) {
        args.extend(["--set", "train.eval_examples=32"]);
    }
    let args = args.as_slice();
    let out = if np == 1 {
        Command::new(aligner_exe())
            .env("RAYON_NUM_THREADS", "1")
            .args(args)
            .current_dir(repo())
            .output()
            .unwrap()
    } else {
        mpirun(np, &aligner_exe()).args(args).output().unwrap()
    };
    assert!(
        out.status.success(),
        "{np} ranks: aligner {args:?}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The two runs logged the same rows (same steps, same keys) with values within `tol`.
fn same_metrics(a: &Path, b: &Path, tol: f64) {
    let (ra, rb) = (metrics(a), metrics(b));
    assert_eq!(
        ra.len(),
        rb.len(),
        "metrics rows of {} and {}",
        a.display(),
        b.display()
    );
    for (x, y) in ra.iter().zip(&rb) {
        let (x, y) = (x.as_object().unwrap(), y.as_object().unwrap());
        assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
        for (key, value) in x {
            if x["step"].as_u64().unwrap() <= 1 && key.contains("accuracy") {
                // Until the first update (the initial validation and step 1's own batch) the
                // policy is the reference: each margin is rounding noise (~1e-7) and its sign,
                // which accuracy counts, is noise too.
                continue;
            }
            let (p, q) = (value.as_f64().unwrap(), y[key].as_f64().unwrap());
            assert!((p - q).abs() <= tol * (1.0 + p.abs()), "{key}: {p} against {q}");
        }
    }
}

/// `command` with global batch `global` trained by one process and by each `(ranks,
/// train.sharding)` of `layouts` (batch `global / ranks` each): the weights and metrics of the
/// multi-rank runs equal the one-process run's.
fn trains_as_one_process_sharded(
    command: &[&str],
    global: usize,
    sets: &[String],
    tmp: &Path,
    layouts: &[(usize, &str)],
) {
    let layouts: Vec<(usize, &str, usize)> = layouts.iter().map(|&(np, s)| (np, s, 1)).collect();
    trains_as_one_process_in(command, global, sets, tmp, &layouts);
}

/// [`trains_as_one_process_sharded`] for each `(ranks, train.sharding, parallel.tensor)` of
/// `layouts`: `ranks / tensor` data-parallel replicas of batch `global / replicas` each.
/// Returns what each layout's run printed to stderr.
fn trains_as_one_process_in(
    command: &[&str],
    global: usize,
    sets: &[String],
    tmp: &Path,
    layouts: &[(usize, &str, usize)],
) -> Vec<String> {
    let run_of = |np: usize, sharding: &str, tensor: usize| {
        tmp.join(format!("{}-np{np}-{sharding}-t{tensor}", command.join("-")))
    };
    let mut logs = Vec::new();
    for &(np, sharding, tensor) in [(1, "none", 1)].iter().chain(layouts) {
        let out = run_of(np, sharding, tensor);
        let batch = format!("train.batch_size={}", global * tensor / np);
        let sharding_set = format!("train.sharding={sharding}");
        let tensor_set = format!("parallel.tensor={tensor}");
        let mut args: Vec<&str> = command.to_vec();
        args.extend([
            "--out",
            out.to_str().unwrap(),
            "--set",
            &batch,
            "--set",
            &sharding_set,
        ]);
        if tensor > 1 {
            args.extend(["--set", &tensor_set]);
        }
        // Where the gradients are all-reduced, in buckets of 0.01 MiB (~60 on stories260K)
        // summed while the backward goes on, not the one bucket the default size makes.
        if np > 1 && tensor == 1 && matches!(sharding, "none" | "optimizer") {
            args.extend(["--set", SMALL_BUCKETS]);
        }
        for s in sets {
            args.extend(["--set", s]);
        }
        logs.push(ranks(np, &args));
    }
    let one = run_of(1, "none", 1);
    for &(np, sharding, tensor) in layouts {
        let run = run_of(np, sharding, tensor);
        let diff = weights_diff(&one.join("final"), &run.join("final"));
        assert!(
            diff <= 1e-5,
            "{command:?}: {np} ranks (sharding {sharding}, tensor {tensor}) end {diff} from one process"
        );
        same_metrics(&one, &run, 1e-5);
    }
    logs.split_off(1)
}

#[test]
fn collectives_hold_on_two_and_three_ranks() {
    let example = aligner_exe().parent().unwrap().join("examples/collectives");
    assert!(
        example.exists(),
        "{} is built by `cargo test --workspace`",
        example.display()
    );
    for np in [2, 3] {
        let out = mpirun(np, &example).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(stdout.matches("collectives ok").count(), np, "{stdout}");
    }
}

/// Ranks given different runs (another `--set` on one, a data file that differs between
/// them) stop before any work with one error naming the key; ranks given the same run print
/// one summary, rank 0's.
#[test]
fn ranks_given_different_runs_stop_naming_the_key_and_one_summary_is_printed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sft");
    let data = |name: &str, rows: usize| head("train.sft.jsonl", rows, &dir.path().join(name));
    let (a, b) = (data("a.jsonl", 8), data("b.jsonl", 9));
    // `mpirun -np 1 aligner ARGS_0 : -np 1 aligner ARGS_1`: one command line per rank.
    let two = |first: &[String], second: &[String]| {
        let mut command = mpirun(1, &aligner_exe());
        let exe = aligner_exe();
        command
            .args(first)
            .arg(":")
            .args(["-np", "1"])
            .arg(&exe)
            .args(second);
        command.output().unwrap()
    };
    let sft = |sets: &[String]| -> Vec<String> {
        let mut args: Vec<String> = vec!["sft".into(), "--out".into(), out.display().to_string()];
        for s in ["train.max_steps=2".to_string(), "data.validation=''".into()]
            .iter()
            .chain(sets)
        {
            args.extend(["--set".into(), s.clone()]);
        }
        args
    };
    let lr = |v: &str| sft(&[format!("train.lr={v}")]);
    let result = two(&lr("0.001"), &lr("0.002"));
    let err = String::from_utf8_lossy(&result.stderr);
    assert!(
        !result.status.success() && err.contains("`train.lr` is 0.001 on rank 0 and 0.002 on rank 1"),
        "{err}"
    );
    assert!(!out.join("config.toml").exists(), "a rank started the run");

    // One path, other contents on each rank (each node's own copy of the file): each rank
    // reads `train.jsonl` in a working folder of its own.
    let node = |name: &str, rows: &std::path::Path| {
        let folder = dir.path().join(name);
        std::fs::create_dir(&folder).unwrap();
        std::fs::copy(rows, folder.join("train.jsonl")).unwrap();
        folder
    };
    let (node_a, node_b) = (node("node-a", &a), node("node-b", &b));
    let relative = sft(&["data.train='train.jsonl'".to_string()]);
    let mut command = Command::new("mpirun");
    command.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-x",
        "RAYON_NUM_THREADS=1",
    ]);
    for (i, node) in [&node_a, &node_b].into_iter().enumerate() {
        if i > 0 {
            command.arg(":");
        }
        command
            .args(["-np", "1", "--wdir"])
            .arg(node)
            .arg(aligner_exe())
            .args(&relative);
    }
    let result = command.output().unwrap();
    let err = String::from_utf8_lossy(&result.stderr);
    assert!(
        !result.status.success()
            && err.contains("`data.train` is \"train.jsonl\" (a file of ")
            && err.contains("on rank 0 and \"train.jsonl\" (a file of "),
        "{err}"
    );
    assert!(!out.join("config.toml").exists(), "a rank started the run");

    let same = sft(&[]);
    let result = two(&same, &same);
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert_eq!(stdout.matches("sft: 2 steps").count(), 1, "{stdout}");
}

#[test]
fn sft_on_two_and_three_ranks_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    // 26 examples in global batches of 12: the last batch of each epoch has 2, so with three
    // ranks one rank's shard is empty; 30 validation examples in batches of 4 per rank are
    // shared out unevenly too.
    let train = head("train.sft.jsonl", 26, &dir.path().join("train.jsonl"));
    let sets = [
        format!("data.train={}", train.display()),
        "train.epochs=2".into(),
        // AdamW divides by √v: a weight whose gradient is near zero moves by up to lr × (its
        // gradient's relative rounding), so the 1e-5 bound holds at lr 5e-4 (3.9e-6 measured;
        // 1.6e-5 at the default 2e-3).
        "train.lr=5e-4".into(),
        "train.grad_accum=2".into(),
        "train.eval_every=1".into(),
        "train.eval_examples=30".into(),
        "train.sync_check_every=1".into(),
    ];
    // ZeRO stages 0, 2 and 3 at 2 and 3 ranks (stage 1 in the resume test below); 3 ranks
    // shard the parameters unevenly (with `full`, rows of every parameter: 3 ranks split
    // stories260K's 64-row weights 22 + 21 + 21), and the rank with an empty shard of the
    // last batch still takes part in its gathers.
    let layouts = [
        (2, "none"),
        (3, "none"),
        (2, "gradients"),
        (3, "gradients"),
        (2, "full"),
        (3, "full"),
    ];
    trains_as_one_process_sharded(&["sft"], 12, &sets, dir.path(), &layouts);
}

/// `train.keep_best` where the ranks hold the model in parts (3 fully sharded ranks, a 1×2
/// tensor group): the validations run on the parts (3 ranks over 5 batches: one evaluates a
/// batch again and discards it), `best/` is saved from them as the file reaches each
/// parameter, and `final/` (copied from `best/`) matches one process's, step included.
#[test]
fn keep_best_on_the_ranks_parts_matches_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=8".to_string(),
        // As in the tensor-group test below: at a larger lr AdamW's first step turns rounding
        // noise in a few near-zero gradients into differences above 1e-5.
        "train.lr=1e-4".into(),
        "train.eval_every=2".into(),
        "train.eval_examples=10".into(),
        "train.save_every=0".into(),
        "train.keep_best=\"eval_nll_response\"".into(),
    ];
    let layouts = [(3, "full", 1), (2, "none", 2)];
    trains_as_one_process_in(&["sft"], 6, &sets, dir.path(), &layouts);
    let kept = |run: &str| {
        let run = dir.path().join(run);
        let weights = |d: &str| std::fs::read(run.join(d).join("model.safetensors")).unwrap();
        assert!(
            weights("final") == weights("best"),
            "{}: final/ holds best/'s weights",
            run.display()
        );
        let kept: Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("final_step.json")).unwrap()).unwrap();
        (kept["step"].as_u64().unwrap(), kept["value"].as_f64().unwrap())
    };
    // The held-out response NLL is lowest after 4 of the 8 steps (by 3e-4): a model saved
    // after training, not the last one.
    let (step, value) = kept("sft-np1-none-t1");
    assert_eq!(step, 4);
    for run in ["sft-np3-full-t1", "sft-np2-none-t2"] {
        let (kept_step, kept_value) = kept(run);
        assert_eq!(kept_step, step, "{run}");
        assert!(
            (kept_value - value).abs() <= 1e-5,
            "{run}: {kept_value} against {value}"
        );
    }
}

/// DPO's frontier where the ranks hold the model in parts (two fully sharded ranks, a 1×2
/// tensor group): rank 0 alone holds the start model for it, the policy is gathered to rank 0
/// alone at each validation (the other rank sending its part), and every validation row
/// carries the frontier's figures, one process's within float noise.
#[test]
fn dpo_frontier_on_the_ranks_parts_is_measured_on_rank_0() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, np: usize, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec!["dpo", "--out", out.to_str().unwrap()];
        for set in [
            "train.max_steps=2",
            "train.eval_every=1",
            "train.eval_examples=8",
            "frontier.max_prompts=8",
            "frontier.max_new_tokens=12",
        ] {
            args.extend(["--set", set]);
        }
        args.extend(extra);
        let out_status = match np {
            1 => Command::new(aligner_exe())
                .args(&args)
                .current_dir(repo())
                .output(),
            _ => mpirun(np, &aligner_exe()).args(&args).output(),
        }
        .unwrap();
        assert!(
            out_status.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out_status.stderr)
        );
        metrics(&out)
            .into_iter()
            .filter(|row| row.get("eval_loss").is_some())
            .map(|row| row["eval_frontier/kl"].as_f64().unwrap_or(f64::NAN))
            .collect::<Vec<f64>>()
    };
    let one = run("one", 1, &["--set", "train.batch_size=4"]);
    assert_eq!(one.len(), 3, "validations at steps 0, 1 and 2");
    for (name, extra) in [
        (
            "full",
            ["--set", "train.batch_size=2", "--set", "train.sharding=full"],
        ),
        (
            "tensor",
            ["--set", "train.batch_size=4", "--set", "parallel.tensor=2"],
        ),
    ] {
        let kl = run(name, 2, &extra);
        assert_eq!(kl.len(), one.len(), "{name}");
        // Step 0: the start model against itself.
        assert!(kl[0].abs() < 1e-3, "{name}: {kl:?}");
        // The same samples here (KL 0.0206 and 0.0841 after steps 1 and 2, equal to 1e-5).
        for (k, o) in kl.iter().zip(&one) {
            assert!(
                k.is_finite() && (k - o).abs() <= 1e-3 + 0.02 * o.abs(),
                "{name}: {kl:?} against {one:?}"
            );
        }
    }
}

/// The reward model and DPO on 2 and 3 data-parallel ranks with ZeRO stages, and in tensor
/// groups of 1×2 (and DPO 2×2 with its gradients sharded), train to the weights and metrics
/// of one process.
#[test]
fn rm_and_dpo_on_sharded_ranks_and_in_tensor_groups_train_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=5".to_string(),
        "train.eval_examples=20".into(),
        "train.eval_every=5".into(),
    ];
    let layouts = [
        (2, "optimizer", 1),
        (3, "gradients", 1),
        (2, "full", 1),
        (2, "none", 2),
    ];
    trains_as_one_process_in(&["rm"], 12, &sets, dir.path(), &layouts);
    // DPO's reference log-probs are computed a shard per rank and gathered into one cache
    // (in tensor groups too: before the groups form).
    let layouts = [
        (2, "gradients", 1),
        (3, "none", 1),
        (3, "full", 1),
        (2, "none", 2),
        // Each tensor rank's blocks with their gradients reduce-scattered over the data ranks.
        (4, "gradients", 2),
    ];
    trains_as_one_process_in(&["dpo"], 12, &sets, dir.path(), &layouts);
    let single = std::fs::read_to_string(dir.path().join("dpo-np1-none-t1/reference_train.jsonl")).unwrap();
    let three = std::fs::read_to_string(dir.path().join("dpo-np3-none-t1/reference_train.jsonl")).unwrap();
    let parse = |t: &str| t.lines().map(|l| l.parse::<f64>().unwrap()).collect::<Vec<_>>();
    let (a, b) = (parse(&single), parse(&three));
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4));
}

/// `train.activation_checkpointing = true` keeps each decoder layer's input alone and reruns
/// the layer in the backward pass. On ranks the reruns gather fully sharded weights and
/// reduce-scatter their gradients, sum a tensor group's partial outputs, and hand overlapped
/// buckets their gradients as an ordinary pass does: DPO, and SFT with two micro-batches a
/// step, on 2 ranks of each kind train as one process does, and one process with it as one
/// without it.
#[test]
fn layer_recomputation_on_ranks_and_in_tensor_groups_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let train = head("train.sft.jsonl", 26, &dir.path().join("train.jsonl"));
    let mut sets = vec![
        "train.max_steps=4".to_string(),
        // See the tensor-group SFT test: rounding noise in a near-zero first gradient.
        "train.lr=1e-4".into(),
        "train.eval_examples=20".into(),
        "train.eval_every=2".into(),
    ];
    let plain = dir.path().join("sft-without");
    let batch = "train.batch_size=8".to_string();
    let data = format!("data.train={}", train.display());
    let grad_accum = "train.grad_accum=2".to_string();
    let mut args = vec!["sft", "--out", plain.to_str().unwrap()];
    for s in sets.iter().chain([&batch, &data, &grad_accum]) {
        args.extend(["--set", s.as_str()]);
    }
    ranks(1, &args);
    sets.push("train.activation_checkpointing=true".into());
    let layouts = [(2, "optimizer", 1), (2, "full", 1), (2, "none", 2)];
    let mut logs = trains_as_one_process_in(&["dpo"], 8, &sets, dir.path(), &layouts);
    sets.extend([data, grad_accum]);
    logs.extend(trains_as_one_process_in(&["sft"], 8, &sets, dir.path(), &layouts));
    // The ranks did rerun their layers (the trainer reports how many).
    for log in &logs {
        assert!(
            log.contains("decoder-layer passes rerun in the backward"),
            "{log}"
        );
    }
    let with = dir.path().join("sft-np1-none-t1");
    let diff = weights_diff(&plain.join("final"), &with.join("final"));
    assert!(diff <= 1e-5, "recomputing the layers moved the weights by {diff}");
    same_metrics(&plain, &with, 1e-5);
}

#[test]
fn a_sharded_checkpoint_resumes_in_another_layout_where_one_uninterrupted_process_ends() {
    let dir = tempfile::tempdir().unwrap();
    let sets = ["--set", "train.max_steps=8", "--set", "train.save_every=3"];
    let whole = dir.path().join("whole");
    let mut args = vec![
        "sft",
        "--out",
        whole.to_str().unwrap(),
        "--set",
        "train.batch_size=8",
    ];
    args.extend(sets);
    ranks(1, &args);

    let split = dir.path().join("split");
    let mut args = vec![
        "sft",
        "--out",
        split.to_str().unwrap(),
        "--set",
        "train.batch_size=4",
        "--set",
        "train.sharding=gradients",
        "--stop-after",
        "4",
    ];
    args.extend(sets);
    ranks(2, &args);
    // Each rank's share of AdamW's moments is in the checkpoint; nothing else is per rank.
    let checkpoint = split.join("checkpoints/step-3");
    for file in [
        "optimizer-rank-0.bin",
        "optimizer-rank-1.bin",
        "trainer_state.json",
    ] {
        assert!(checkpoint.join(file).exists(), "{file}");
    }
    assert!(!checkpoint.join("optimizer.bin").exists());
    assert!(!split.join("final").exists());
    // The two ranks' ZeRO-2 checkpoint resumed by one process without sharding: the state is
    // merged from both files.
    let one = [
        "--set",
        "train.batch_size=8",
        "--set",
        "train.sharding=none",
        "--allow-change",
    ];
    let mut args = vec!["sft", "--resume", split.to_str().unwrap()];
    args.extend(one);
    ranks(1, &args);
    let diff = weights_diff(&whole.join("final"), &split.join("final"));
    assert!(diff <= 1e-5, "the sharded run resumed whole ends {diff} away");
    same_metrics(&whole, &split, 1e-5);

    // One process's checkpoint resumed on two ranks with ZeRO-1: each keeps its own share.
    let grown = dir.path().join("grown");
    let mut args = vec![
        "sft",
        "--out",
        grown.to_str().unwrap(),
        "--set",
        "train.batch_size=8",
        "--stop-after",
        "4",
    ];
    args.extend(sets);
    ranks(1, &args);
    assert!(grown.join("checkpoints/step-3/optimizer.bin").exists());
    let two = [
        "--set",
        "train.batch_size=4",
        "--set",
        "train.sharding=optimizer",
        "--allow-change",
    ];
    let mut args = vec!["sft", "--resume", grown.to_str().unwrap()];
    args.extend(two);
    ranks(2, &args);
    let diff = weights_diff(&whole.join("final"), &grown.join("final"));
    assert!(diff <= 1e-5, "the whole run resumed sharded ends {diff} away");
    same_metrics(&whole, &grown, 1e-5);
}

/// LoRA fully sharded: the frozen base is split over the ranks too (gathered in each pass, no
/// gradient reduced), the adapters train as in one process; DPO's reference is the base with
/// the adapters off. The reward model's merged classifier is saved as the ranks hold it, a
/// weight at a time, as the causal LM's is.
#[test]
fn lora_fully_sharded_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "train.max_steps=4".to_string(),
        "model.lora_rank=8".into(),
        "train.eval_examples=20".into(),
        "train.eval_every=2".into(),
    ];
    // `final/model.safetensors` is the base with the adapters merged in.
    for command in ["sft", "dpo", "rm"] {
        trains_as_one_process_sharded(&[command], 8, &sets, dir.path(), &[(2, "full")]);
    }
}

/// Tensor parallel: `data × tensor` grids of 1×2 and 2×2 ranks (each tensor group holding
/// half of every layer's heads, of the MLP's width and of the vocabulary) train SFT to the
/// weights and metrics of one process (the reward model and DPO: with the other layouts,
/// above).
#[test]
fn sft_in_tensor_groups_of_one_by_two_and_two_by_two_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let train = head("train.sft.jsonl", 26, &dir.path().join("train.jsonl"));
    let sets = [
        format!("data.train={}", train.display()),
        "train.max_steps=4".into(),
        // SFT's default lr. A few weights (an input dimension the norm all but zeroes) get a
        // first gradient of ~1e-10, pure rounding noise, which AdamW's first step turns into
        // lr × up to ~0.05 with a sign that depends on the order of the sums: 6e-6 here, 3e-5
        // at lr 5e-4.
        "train.lr=1e-4".into(),
        "train.grad_accum=2".into(),
        "train.eval_every=2".into(),
        "train.eval_examples=30".into(),
        "train.sync_check_every=1".into(),
    ];
    // 2×2 with AdamW's state sharded over the two data ranks too (ZeRO-1 on each block).
    let grids = [(2, "none", 2), (4, "none", 2), (4, "optimizer", 2)];
    trains_as_one_process_in(&["sft"], 12, &sets, dir.path(), &grids);
}

/// Tensor parallel over other families and LoRA: Gemma 2 (soft-capped attention and logits,
/// an untied output projection, GeGLU, four norms a layer) and Qwen3 (per-head query/key
/// norms, a sliding window) with adapters on every projection (`lora_B` split on the column
/// layers, `lora_A` on the row layers), and DPO with adapters on the shipped model.
#[test]
fn tensor_groups_split_gemma2_qwen3_and_lora_adapters_as_one_process_trains() {
    let dir = tempfile::tempdir().unwrap();
    let lora = [
        "model.lora_rank=8".to_string(),
        r#"model.lora_targets=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]"#
            .into(),
    ];
    for name in ["gemma2_capped", "qwen3_window"] {
        reference_model_sft_at_one_by_two(dir.path(), name, &lora);
    }
    let mut sets = vec![
        "train.max_steps=4".to_string(),
        "train.eval_examples=20".into(),
        "train.eval_every=2".into(),
    ];
    sets.extend(lora);
    trains_as_one_process_in(&["dpo"], 8, &sets, dir.path(), &[(2, "none", 2)]);
}

/// Three SFT steps of `tests/reference/hf_random/{name}` with `extra` settings, in a 1×2
/// tensor group and in one process, which must end alike (in `dir/name`, returned).
fn reference_model_sft_at_one_by_two(dir: &Path, name: &str, extra: &[String]) -> PathBuf {
    let model = repo().join("tests/reference/hf_random").join(name);
    let mut sets = vec![
        format!("model.path={}", model.display()),
        "train.max_steps=3".into(),
        "train.lr=5e-4".into(),
        "train.eval_examples=16".into(),
        "train.eval_every=3".into(),
    ];
    sets.extend(extra.iter().cloned());
    let tmp = dir.join(name);
    std::fs::create_dir_all(&tmp).unwrap();
    trains_as_one_process_in(&["sft"], 8, &sets, &tmp, &[(2, "none", 2)]);
    tmp
}

/// Mixtures of experts in tensor groups: each expert's gate and up projections split by
/// columns and its down projection by rows (Mixtral's `w1`, `w3`, `w2`), the router whole, so
/// every rank routes each token alike; with the load-balancing loss. Qwen3-MoE trains every
/// weight, its per-head query/key norms included: their whole weights scale a rank's heads
/// alone, so their gradients are summed over the group. Mixtral trains LoRA adapters on its
/// experts. Both at 1×2 against one process (weights and every logged value, the router's
/// loss included, within 1e-5); and Mixtral's GRPO samples with the engine split at 1×2.
#[test]
fn tensor_groups_split_mixtures_of_experts_and_per_head_norms_as_one_process_trains() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str]); 2] = [
        ("qwen3_moe_dense_layer", &[]),
        (
            "mixtral_moe",
            &[
                "model.lora_rank=4",
                r#"model.lora_targets=["gate_proj","up_proj","down_proj"]"#,
            ],
        ),
    ];
    for (name, extra) in cases {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let tmp = reference_model_sft_at_one_by_two(dir.path(), name, &extra);
        let logged = std::fs::read_to_string(tmp.join("sft-np2-none-t2/metrics.jsonl")).unwrap();
        assert!(logged.contains("router_aux_loss"), "{logged}");
    }
    // GRPO's engine split over the group routes and decodes as one process does: the first
    // step's samples (the policy unchanged yet) are the same.
    let model = repo().join("tests/reference/hf_random/mixtral_moe");
    let model = format!("model.path={}", model.display());
    let run_of = |np: usize| dir.path().join(format!("grpo-moe-np{np}"));
    for np in [1, 2] {
        let out = run_of(np);
        let mut args: Vec<&str> = vec!["ppo", "--out", out.to_str().unwrap(), "--set", &model];
        args.extend(tensor_group_sets(np > 1, true));
        let once = [
            "train.max_steps=1",
            "reward.function=tinystories_sentiment",
            "frontier.prompts=''",
        ];
        for s in SMALL_GRPO.iter().chain(&once) {
            args.extend(["--set", s]);
        }
        ranks(np, &args);
    }
    let (one, split) = (first_step(&run_of(1)), first_step(&run_of(2)));
    for key in ["reward", "response_length", "kl"] {
        let (a, b) = (one[key].as_f64().unwrap(), split[key].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-5, "step 1 {key}: {a} against {b}");
    }
}

/// An 8-step SFT run into `out` on `np` ranks of batch `batch`, checkpointed every 3 steps.
fn resumable_sft(out: &Path, np: usize, batch: usize, extra: &[&str]) -> PathBuf {
    let batch = format!("train.batch_size={batch}");
    let mut args = vec!["sft", "--out", out.to_str().unwrap(), "--set", &batch];
    args.extend(["--set", "train.max_steps=8", "--set", "train.save_every=3"]);
    args.extend(extra);
    ranks(np, &args);
    out.to_path_buf()
}

/// `run` resumed on `np` ranks with `sets` ends where the uninterrupted `whole` run does.
fn resume_ends_as(whole: &Path, run: &Path, np: usize, sets: &[&str]) {
    let mut args = vec!["sft", "--resume", run.to_str().unwrap()];
    args.extend(sets);
    args.push("--allow-change");
    ranks(np, &args);
    let diff = weights_diff(&whole.join("final"), &run.join("final"));
    assert!(diff <= 1e-5, "{}: resumed, it ends {diff} away", run.display());
    same_metrics(whole, run, 1e-5);
}

/// A tensor-parallel checkpoint holds the whole model and the whole AdamW state (joined from
/// the group's blocks): resumed by one process, and one process's resumed on a 2×2 grid with
/// the state sharded over its data ranks, both end where one uninterrupted process does. A
/// 2×2 grid's sharded checkpoint holds each data rank's part of the state, its moments joined
/// from the group's blocks: resumed in its own layout and on 3 ranks without tensor groups,
/// both end there too.
#[test]
fn a_tensor_parallel_checkpoint_resumes_in_another_layout() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, np: usize, batch: usize, extra: &[&str]| {
        resumable_sft(&dir.path().join(name), np, batch, extra)
    };
    let whole = run("whole", 1, 12, &[]);
    let split = run(
        "split",
        2,
        12,
        &["--set", "parallel.tensor=2", "--stop-after", "4"],
    );
    let checkpoint = split.join("checkpoints/step-3");
    assert!(weights_diff(&checkpoint, &whole.join("checkpoints/step-3")) <= 1e-5);
    let resume_ends_as_whole = |run: &Path, np: usize, sets: &[&str]| resume_ends_as(&whole, run, np, sets);
    resume_ends_as_whole(&split, 1, &["--set", "parallel.tensor=1"]);
    let grown = run("grown", 1, 12, &["--stop-after", "4"]);
    resume_ends_as_whole(
        &grown,
        4,
        &[
            "--set",
            "train.batch_size=6",
            "--set",
            "parallel.tensor=2",
            "--set",
            "train.sharding=optimizer",
        ],
    );
    let grid = ["--set", "parallel.tensor=2", "--set", "train.sharding=gradients"];
    let sharded = run("sharded", 4, 6, &[&grid[..], &["--stop-after", "4"]].concat());
    let checkpoint = sharded.join("checkpoints/step-3");
    assert!(weights_diff(&checkpoint, &whole.join("checkpoints/step-3")) <= 1e-5);
    for part in ["optimizer-rank-0.bin", "optimizer-rank-1.bin"] {
        assert!(checkpoint.join(part).is_file(), "{part} is missing");
    }
    let moved = dir.path().join("sharded-moved");
    let copied = std::process::Command::new("cp")
        .args(["-r", sharded.to_str().unwrap(), moved.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(copied.success());
    resume_ends_as_whole(&sharded, 4, &grid);
    resume_ends_as_whole(
        &moved,
        3,
        &[
            "--set",
            "train.batch_size=4",
            "--set",
            "parallel.tensor=1",
            "--set",
            "train.sharding=optimizer",
        ],
    );
}

/// `aligner score --tensor 2` under `mpirun`: the log-probs of language models (each rank
/// reading only its blocks of the checkpoint) and the rewards of a reward model, each layer
/// computed by two ranks together, equal one process's; 4 ranks are two groups that split
/// the rows.
#[test]
fn score_in_tensor_groups_matches_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let data = head("test.sft.jsonl", 10, &dir.path().join("rows.jsonl"));
    let rm = dir.path().join("rm");
    ranks(
        1,
        &["rm", "--out", rm.to_str().unwrap(), "--set", "train.max_steps=2"],
    );
    let scores = |np: usize, model: &Path, extra: &[&str]| -> Vec<Value> {
        let out = dir.path().join(format!("scores-{np}-{}.jsonl", extra.len()));
        let mut args = vec![
            "score",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--overwrite",
            "--batch-size",
            "3",
        ];
        args.extend(extra);
        ranks(np, &args);
        std::fs::read_to_string(&out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let lm = repo().join("assets/stories260K");
    // Gemma 2: an output projection of its own (split over the vocabulary as it is read),
    // four norms a layer, soft-capped logits.
    let gemma = repo().join("tests/reference/hf_random/gemma2_capped");
    let rm_final = rm.join("final");
    for (model, key) in [
        (lm.as_path(), "logprob"),
        (gemma.as_path(), "logprob"),
        (rm_final.as_path(), "reward"),
    ] {
        let one = scores(1, model, &[]);
        assert_eq!(one.len(), 10);
        for (np, extra) in [
            (2, &["--tensor", "2"][..]),
            (4, &["--tensor", "2"][..]),
            (2, &[][..]),
        ] {
            let many = scores(np, model, extra);
            assert_eq!(many.len(), one.len(), "{np} ranks {extra:?}");
            for (a, b) in one.iter().zip(&many) {
                let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + x.abs()),
                    "{key}: {x} against {y} ({np} ranks {extra:?})"
                );
            }
        }
    }
}

/// `aligner generate` under `mpirun`: the prompts split over two ranks, and over tensor groups
/// of 1×2 and 2×2 whose ranks each hold a block of every layer (their heads, their share of
/// the MLP and of the vocabulary, the KV cache of their heads) and decode together, the
/// logits' blocks gathered for each draw: the tokens one process draws (greedy, and sampled
/// with each prompt's seed), their log-probs within 1e-4.
#[test]
fn generate_on_ranks_and_in_tensor_groups_matches_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = head("test.prompts.jsonl", 10, &dir.path().join("prompts.jsonl"));
    for temperature in ["0", "1"] {
        let run = |np: usize, tensor: usize| {
            let out = dir.path().join(format!("t{temperature}-np{np}-t{tensor}.jsonl"));
            let tensor_arg = tensor.to_string();
            let mut args = vec![
                "generate",
                "--prompts",
                prompts.to_str().unwrap(),
                "--max-new-tokens",
                "24",
                "--temperature",
                temperature,
                "--batch-size",
                "3",
                "--out",
                out.to_str().unwrap(),
            ];
            if tensor > 1 {
                args.extend(["--tensor", &tensor_arg]);
            }
            ranks(np, &args);
            common::jsonl(&out)
        };
        let one = run(1, 1);
        assert_eq!(one.len(), 10);
        for (np, tensor) in [(2, 1), (2, 2), (4, 2)] {
            let many = run(np, tensor);
            assert_eq!(many.len(), one.len());
            for (a, b) in one.iter().zip(&many) {
                let what = format!("temperature {temperature}, {np} ranks, tensor {tensor}");
                assert_eq!(a["token_ids"], b["token_ids"], "{what}: {}", a["prompt"]);
                let lp = |row: &Value| -> Vec<f64> {
                    row["token_logprobs"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_f64().unwrap())
                        .collect()
                };
                let diff = lp(a)
                    .iter()
                    .zip(lp(b))
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f64::max);
                assert!(diff < 1e-4, "{what}: log-probs {diff} apart");
            }
        }
    }
}

/// What tensor parallel cannot split is refused naming `parallel.tensor`: heads the groups do
/// not divide, LoRA dropout, fused projections (Phi-3), OLMo 2's norm over
/// the whole query projection, and fully sharded parameters beside it.
#[test]
fn what_tensor_groups_cannot_split_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let model = |name: &str| {
        let path = repo().join("tests/reference/hf_random").join(name);
        format!("model.path={}", path.display())
    };
    let cases: Vec<(usize, Vec<String>, &str)> = vec![
        (3, vec!["parallel.tensor=3".into()], "8 attention heads"),
        (
            2,
            vec!["parallel.tensor=2".into(), model("mistral_window")],
            "1 key/value heads",
        ),
        (
            2,
            vec![
                "parallel.tensor=2".into(),
                "model.lora_rank=4".into(),
                "model.lora_dropout=0.1".into(),
            ],
            "model.lora_dropout",
        ),
        (
            2,
            vec!["parallel.tensor=2".into(), model("phi3_longrope")],
            "fused projections",
        ),
        (
            2,
            vec!["parallel.tensor=2".into(), model("olmo2_bias")],
            "normalises the whole projection",
        ),
        (
            4,
            vec!["parallel.tensor=2".into(), "train.sharding=full".into()],
            "train.sharding = \"full\"",
        ),
    ];
    for (i, (np, sets, expected)) in cases.iter().enumerate() {
        let out = dir.path().join(format!("case-{i}"));
        let mut command = mpirun(*np, &aligner_exe());
        command.args([
            "sft",
            "--out",
            out.to_str().unwrap(),
            "--set",
            "train.max_steps=1",
        ]);
        for s in sets {
            command.args(["--set", s]);
        }
        let output = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{sets:?} was accepted");
        assert!(
            stderr.contains("parallel.tensor") && stderr.contains(expected),
            "{sets:?}: {stderr}"
        );
    }
    // Online DPO's episodes would run on each rank of a group: an environment is refused there
    // before anything is trained.
    let output = mpirun(2, &aligner_exe())
        .args(["online-dpo", "--out", dir.path().join("env").to_str().unwrap()])
        .args(["--set", "parallel.tensor=2"])
        .args([
            "--set",
            "environment.command=[\"python3\", \"assets/agentic/ask_env.py\"]",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("[environment] with parallel.tensor"),
        "{stderr}"
    );
    assert!(!dir.path().join("env/reward_model").exists());
    // One process is one group of one rank.
    let (ok, err) = aligner(&[
        "sft",
        "--out",
        dir.path().join("one").to_str().unwrap(),
        "--set",
        "parallel.tensor=2",
    ]);
    assert!(!ok && err.contains("does not divide the 1 ranks"), "{err}");
}

/// `train.sharding = "full"` checkpoints hold each rank's rows of AdamW's moments: two ranks'
/// resumed by one process (the rows joined), and one process's resumed on three fully sharded
/// ranks keeping their gathered weights (each keeps its rows), both end where one
/// uninterrupted process does.
#[test]
fn a_fully_sharded_checkpoint_resumes_in_another_layout() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, np: usize, batch: usize, extra: &[&str]| {
        resumable_sft(&dir.path().join(name), np, batch, extra)
    };
    let whole = run("whole", 1, 12, &[]);
    let split = run(
        "split",
        2,
        6,
        &["--set", "train.sharding=full", "--stop-after", "4"],
    );
    let checkpoint = split.join("checkpoints/step-3");
    assert!(checkpoint.join("optimizer-rank-1.bin").exists());
    let state = std::fs::read_to_string(checkpoint.join("trainer_state.json")).unwrap();
    assert!(state.contains("\"optimizer_rows\": true"), "{state}");
    // The model folder is whole: transformers' shapes.
    assert!(weights_diff(&checkpoint, &whole.join("checkpoints/step-3")) <= 1e-5);
    // `run` resumed on `np` ranks with `sets`, ending where the uninterrupted run does.
    let resume_ends_as_whole = |run: &Path, np: usize, sets: &[&str]| resume_ends_as(&whole, run, np, sets);
    let one = ["--set", "train.batch_size=12", "--set", "train.sharding=none"];
    resume_ends_as_whole(&split, 1, &one);

    let grown = run("grown", 1, 12, &["--stop-after", "4"]);
    // With the gathered weights kept from each forward to its backward.
    let three = [
        "--set",
        "train.batch_size=4",
        "--set",
        "train.sharding=full",
        "--set",
        "train.keep_gathered=true",
    ];
    resume_ends_as_whole(&grown, 3, &three);
}

#[test]
fn a_two_rank_run_with_an_aborted_rank_resumes_to_where_the_uninterrupted_run_ends() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "--set",
        "train.max_steps=14",
        "--set",
        "train.save_every=2",
        "--set",
        "train.eval_examples=32",
    ];
    let whole = dir.path().join("whole");
    let mut args = vec![
        "sft",
        "--out",
        whole.to_str().unwrap(),
        "--set",
        "train.batch_size=8",
    ];
    args.extend(sets);
    ranks(1, &args);

    let killed = dir.path().join("killed");
    let mut args = vec![
        "sft",
        "--out",
        killed.to_str().unwrap(),
        "--set",
        "train.batch_size=4",
    ];
    args.extend(sets);
    // The last rank aborts after step 5 as if killed (the run's own hook, at a known step:
    // after the checkpoint at 4, before the one at 6): no rank gets to clean up, and the
    // launcher takes the other down.
    args.extend(["--abort-after", "5"]);
    let status = mpirun(2, &aligner_exe())
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "a job with a killed rank fails");
    assert!(!killed.join("final").exists(), "killed before the end");
    assert!(killed.join("checkpoints/step-4/trainer_state.json").exists());
    assert!(!killed.join("checkpoints/step-6").exists());

    ranks(2, &["sft", "--resume", killed.to_str().unwrap()]);
    let diff = weights_diff(&whole.join("final"), &killed.join("final"));
    assert!(
        diff <= 1e-5,
        "the resumed run ends {diff} away from the uninterrupted one"
    );
    same_metrics(&whole, &killed, 1e-5);
}

/// PPO with its critic over two ranks (with ZeRO-2, `train.sharding = "gradients"`, as any
/// method's loop takes it), and in a tensor group of two, raises the held-out reward as one
/// process does.
#[test]
fn ppo_on_two_ranks_and_in_a_tensor_group_raises_the_held_out_reward_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let rm = dir.path().join("rm");
    let (ok, err) = aligner(&["rm", "--out", rm.to_str().unwrap()]);
    assert!(ok, "{err}");
    let rm_set = format!("reward_model.path={}", rm.join("final").display());
    // (ranks, tensor group size): ZeRO-2 on plain data-parallel ranks.
    let eval_rewards = |np: usize, tensor: usize| -> Vec<f64> {
        let run = dir.path().join(format!("ppo-np{np}-t{tensor}"));
        let sharding = format!(
            "train.sharding={}",
            if np > 1 && tensor == 1 {
                "gradients"
            } else {
                "none"
            }
        );
        let tensor_set = format!("parallel.tensor={tensor}");
        ranks(
            np,
            &[
                "ppo",
                "--out",
                run.to_str().unwrap(),
                "--set",
                "train.max_steps=8",
                "--set",
                &rm_set,
                "--set",
                &sharding,
                "--set",
                &tensor_set,
            ],
        );
        if np > 1 && tensor == 1 {
            // Each rank saved its share of the actor's optimizer state.
            let checkpoint = run.join("checkpoints/step-6");
            for rank in 0..np {
                let shard = checkpoint.join(format!("optimizer-rank-{rank}.bin"));
                assert!(shard.exists(), "{}", shard.display());
            }
            let timing = std::fs::read_to_string(run.join("timing.md")).unwrap();
            assert!(
                timing.contains("| rank | generation seconds |") && timing.contains("imbalance"),
                "{timing}"
            );
        }
        metrics(&run)
            .iter()
            .filter_map(|r| r.get("eval_reward").and_then(Value::as_f64))
            .collect()
    };
    let one = eval_rewards(1, 1);
    let gain_one = one.last().unwrap() - one[0];
    assert!(gain_one > 2.0, "{one:?}");
    // Two data-parallel ranks, and one tensor group of two (the actor's blocks generating
    // together; the critic on rank 0, its values shared with the group).
    for (np, tensor) in [(2, 1), (2, 2)] {
        let many = eval_rewards(np, tensor);
        assert!((one[0] - many[0]).abs() < 1e-6, "same start: {one:?} {many:?}");
        let gain = many.last().unwrap() - many[0];
        assert!(gain > 2.0, "{np} ranks, tensor {tensor}: {many:?}");
        assert!(
            (gain_one - gain).abs() < 1.0,
            "{np} ranks, tensor {tensor}: {one:?} {many:?}"
        );
    }
}

/// GRPO (critic-free, the lexicon as its reward) trains to the same weights on one process and
/// on two and three ranks with ZeRO-2, ZeRO-1 and ZeRO-3: the rollouts carry their own seeds, the
/// actor's mini-batches are split over the ranks and their gradients summed. AdamW's ε is 1e-6:
/// group-normalised advantages cancel some weights' gradients to rounding noise, which at the
/// default 1e-8 AdamW turns into steps of up to lr · |g| / (|g| + ε) whose size follows the order
/// of the sums (measured without AVX-512: 5.0e-5 from one process on 3 ZeRO-1 ranks, in one
/// element; 3.2e-6 at ε 1e-6, the policy moving 5.7e-3 either way).
#[test]
fn grpo_on_two_and_three_sharded_ranks_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let sets: Vec<String> = SMALL_GRPO
        .iter()
        .chain(&[
            "train.max_steps=3",
            "train.eval_every=3",
            "train.lr=5e-4",
            "train.adam_epsilon=1e-6",
            "reward.function=tinystories_sentiment",
            "frontier.prompts=''",
        ])
        .map(|s| s.to_string())
        .collect();
    // PPO's batch is `ppo.rollout_prompts` whatever the ranks: no per-rank batch to scale.
    // With `full` the engines and the reference pass read the actor gathered whole each step.
    let layouts = [(2, "gradients"), (3, "optimizer"), (2, "full")];
    let run_of = |np: usize, sharding: &str| dir.path().join(format!("grpo-np{np}-{sharding}"));
    for &(np, sharding) in [(1, "none")].iter().chain(&layouts) {
        let out = run_of(np, sharding);
        let sharding_set = format!("train.sharding={sharding}");
        let mut args: Vec<&str> = vec!["ppo", "--out", out.to_str().unwrap(), "--set", &sharding_set];
        if sharding == "optimizer" {
            args.extend(["--set", SMALL_BUCKETS]);
        }
        for s in &sets {
            args.extend(["--set", s]);
        }
        ranks(np, &args);
    }
    let moved = weights_diff(
        &repo().join("assets/stories260K"),
        &run_of(1, "none").join("final"),
    );
    assert!(moved > 1e-4, "the policy moved {moved}");
    for &(np, sharding) in &layouts {
        let diff = weights_diff(
            &run_of(1, "none").join("final"),
            &run_of(np, sharding).join("final"),
        );
        assert!(
            diff <= 1e-5,
            "GRPO on {np} ranks ({sharding}) ends {diff} from one process"
        );
        same_logged_values(&run_of(1, "none"), &run_of(np, sharding));
    }
}

/// Every value two PPO runs logged but the timings (and the per-rank timing only ranks have),
/// within 1e-4.
/// PPO's first logged training step in `run`.
fn first_step(run: &Path) -> Value {
    metrics(run)
        .into_iter()
        .find(|r| r["step"] == 1 && r.get("reward").is_some())
        .unwrap()
}

/// The `--set`s of a PPO run in 1×2 groups (`tensor`), its engine split over the group or
/// generating with the whole actor (`split`).
fn tensor_group_sets(tensor: bool, split: bool) -> Vec<&'static str> {
    let mut sets = Vec::new();
    if tensor {
        sets.extend(["--set", "parallel.tensor=2"]);
    }
    if tensor && !split {
        sets.extend(["--set", "ppo.split_engine=false"]);
    }
    sets
}

fn same_logged_values(one: &Path, many: &Path) {
    let (a, b) = (metrics(one), metrics(many));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        for (key, value) in x.as_object().unwrap() {
            if key.starts_with("time_") {
                continue;
            }
            let (p, q) = (value.as_f64().unwrap(), y[key].as_f64().unwrap());
            assert!(
                (p - q).abs() <= 1e-4 * (1.0 + p.abs()),
                "{key}: {p} against {q} ({})",
                many.display()
            );
        }
    }
}

/// GRPO in tensor groups of 1×2 and 2×2 with `ppo.split_engine = false`: the engines generate
/// with the actor gathered whole, each group trains on its rank 0's samples, and the policy
/// ends where one process's does. At lr 1e-4 and AdamW's ε 1e-6: group-normalised advantages
/// cancel some weights' gradients to rounding noise (~1e-8), which AdamW's first steps turn
/// into updates of up to lr · |g| / (|g| + ε) that differ with the order of the sums (2.7e-5
/// at lr 5e-4 and ε 1e-8, in one element; without AVX-512 1.7e-5 at lr 1e-4, and 1.7e-6 at ε
/// 1e-6, the policy moving 1.2e-3 either way). With the engine split over the group (the default), each group draws the same
/// first samples as one process (the same rewards, lengths and KL; log-probs as far from the
/// trainer's as one process's are); its behaviour log-probs differ from one process's by
/// ~1e-6 (sums in another order), which those same AdamW steps make a different trajectory
/// from there on (measured 1.1e-3–1.6e-3 apart after 3 steps), so only how far it strays is
/// bounded.
#[test]
fn grpo_in_tensor_groups_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let sets: Vec<&str> = SMALL_GRPO
        .into_iter()
        .chain([
            "train.max_steps=3",
            "train.eval_every=3",
            "train.lr=1e-4",
            "train.adam_epsilon=1e-6",
            "reward.function=tinystories_sentiment",
            "frontier.prompts=''",
        ])
        .collect();
    let run_of = |np: usize| dir.path().join(format!("grpo-np{np}"));
    let split_of = |np: usize| dir.path().join(format!("grpo-np{np}-split"));
    for (np, out, split) in [
        (1, run_of(1), false),
        (2, run_of(2), false),
        (4, run_of(4), false),
        (2, split_of(2), true),
        (4, split_of(4), true),
    ] {
        let mut args: Vec<&str> = vec!["ppo", "--out", out.to_str().unwrap()];
        args.extend(tensor_group_sets(np > 1, split));
        for s in &sets {
            args.extend(["--set", s]);
        }
        ranks(np, &args);
    }
    let one = first_step(&run_of(1));
    for np in [2, 4] {
        let split = first_step(&split_of(np));
        for key in ["reward", "response_length", "kl"] {
            let (a, b) = (one[key].as_f64().unwrap(), split[key].as_f64().unwrap());
            assert!(
                (a - b).abs() <= 1e-5,
                "split engine on {np} ranks, step 1 {key}: {a} against {b}"
            );
        }
        let mismatch = split["logprob_mismatch_max"].as_f64().unwrap();
        assert!(
            mismatch < 1e-4,
            "split engine on {np} ranks: behaviour log-probs {mismatch} off"
        );
        let diff = weights_diff(&run_of(1).join("final"), &split_of(np).join("final"));
        assert!(
            diff < 1e-2,
            "split engine on {np} ranks ends {diff} from one process"
        );
    }
    let moved = weights_diff(&repo().join("assets/stories260K"), &run_of(1).join("final"));
    assert!(moved > 1e-4, "the policy moved {moved}");
    for np in [2, 4] {
        let diff = weights_diff(&run_of(1).join("final"), &run_of(np).join("final"));
        assert!(
            diff <= 1e-5,
            "GRPO on {np} ranks in groups of 2 ends {diff} from one process"
        );
        same_logged_values(&run_of(1), &run_of(np));
    }
}

/// GRPO in a multi-turn environment (configs/agent_env.toml, a Python program answering over
/// three turns) on two ranks and in tensor groups: two data-parallel ranks (each weighing its
/// shard by the model's own tokens, not the observations), and 1×2 and 2×2 groups with the
/// whole actor in every rank's engine, end where one process does (the episodes run turn by
/// turn, the environment called on the world's rank 0 alone); with the engine split over the
/// group, step 1 draws one process's episodes.
#[test]
fn grpo_in_an_environment_on_ranks_and_in_tensor_groups_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "ppo.rollout_prompts=4",
        "ppo.mini_batch=16",
        "ppo.eval_prompts=4",
        "train.max_steps=2",
        "train.eval_every=2",
        // The episodes' sparse rewards leave a few weights a gradient near 0, which AdamW's
        // first steps turn into steps of ±lr whatever its size: at 1e-4 one weight of 260K
        // ends 1.5e-5 from one process's (its gradient's float noise), at 5e-5, 7e-6.
        "train.lr=5e-5",
    ];
    let run_of = |name: &str| dir.path().join(name);
    // (ranks, run, tensor groups, split engine)
    for (np, name, tensor, split) in [
        (1, "one", false, false),
        (2, "dp2", false, false),
        (2, "np2", true, false),
        (4, "np4", true, false),
        (2, "np2-split", true, true),
    ] {
        let out = run_of(name);
        let mut args: Vec<&str> = vec![
            "ppo",
            "--config",
            "configs/agent_env.toml",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(tensor_group_sets(tensor, split));
        for s in &sets {
            args.extend(["--set", s]);
        }
        ranks(np, &args);
    }
    let one = first_step(&run_of("one"));
    assert_eq!(one["env/turns"].as_f64(), Some(3.0), "{one}");
    let split = first_step(&run_of("np2-split"));
    for key in ["reward", "response_length", "env/observation_tokens"] {
        let (a, b) = (one[key].as_f64().unwrap(), split[key].as_f64().unwrap());
        assert!(
            (a - b).abs() <= 1e-5,
            "split engine, step 1 {key}: {a} against {b}"
        );
    }
    let moved = weights_diff(&repo().join("assets/stories260K"), &run_of("one").join("final"));
    assert!(moved > 5e-5, "the policy moved {moved}");
    for name in ["dp2", "np2", "np4"] {
        let diff = weights_diff(&run_of("one").join("final"), &run_of(name).join("final"));
        assert!(diff <= 1e-5, "{name} ends {diff} from one process");
        same_logged_values(&run_of("one"), &run_of(name));
    }
}

/// KTO and two SPIN iterations (each rank reads, answers with, scores with and trains only its
/// blocks; the second iteration's engine takes the first's trained blocks) in a 1×2 tensor
/// group end where one process does. SPIN answers greedily here: sampled, one answer in 590
/// drew another token at a near-tie of the split engine's sums.
#[test]
fn kto_spin_rs_and_steerlm_in_a_tensor_group_train_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let no_frontier = "frontier.prompts=''";
    for (command, sets) in [
        ("kto", vec![no_frontier, "train.max_steps=4"]),
        (
            "spin",
            vec![
                no_frontier,
                "spin.iterations=2",
                "train.max_steps=2",
                "spin.temperature=0",
            ],
        ),
        // Rejection sampling: every rank draws a share of the samples with the whole model;
        // the round's SFT trains in the group.
        (
            "rs",
            vec![
                no_frontier,
                "rs.rounds=1",
                "rs.n=2",
                "rs.max_new_tokens=16",
                "rs.eval_prompts=8",
                "reward.function=tinystories_sentiment",
                "train.max_steps=4",
            ],
        ),
        // The attribute model: the trunk's blocks under a whole head of several outputs.
        ("steerlm attributes", vec!["train.max_steps=4"]),
        // At its default lr of 2e-3, AdamW's first steps turn the float noise of a few
        // near-zero gradients into steps of ±lr: 7e-5 apart after 4 steps.
        ("steerlm sft", vec!["train.max_steps=4", "train.lr=3e-4"]),
    ] {
        for np in [1, 2] {
            let name = format!("{}-{np}", command.replace(' ', "-"));
            let run = out(&name);
            let mut args: Vec<&str> = command.split(' ').collect();
            args.extend(["--out", &run]);
            if np > 1 {
                args.extend(["--set", "parallel.tensor=2"]);
            }
            for s in &sets {
                args.extend(["--set", s]);
            }
            ranks(np, &args);
        }
        let name = command.replace(' ', "-");
        let (one, two) = (
            dir.path().join(format!("{name}-1")),
            dir.path().join(format!("{name}-2")),
        );
        // The attribute model's folder holds a head the start model has not.
        if command != "steerlm attributes" {
            let moved = weights_diff(&repo().join("assets/stories260K"), &one.join("final"));
            assert!(moved > 1e-4, "{command}: the policy moved {moved}");
        }
        // SPIN's second iteration starts a fresh AdamW from reference log-probs 4e-5 apart (of
        // sums near -60): its first step turns the float noise of a few near-zero gradients into
        // steps of ±lr (1e-4): 5 of the 260,032 weights end over 1e-5 apart. The first
        // iteration must end within 1e-5 (below).
        let tolerance = if command == "spin" { 1e-4 } else { 1e-5 };
        let diff = weights_diff(&one.join("final"), &two.join("final"));
        assert!(
            diff <= tolerance,
            "{command} in a 1×2 group ends {diff} from one process"
        );
    }
    let spin = |np: usize| dir.path().join(format!("spin-{np}"));
    let diff = weights_diff(&spin(1).join("iter-1/final"), &spin(2).join("iter-1/final"));
    assert!(
        diff <= 1e-5,
        "SPIN's first iteration ends {diff} from one process"
    );
    for iteration in ["iter-1", "iter-2"] {
        let answers =
            |np: usize| std::fs::read_to_string(spin(np).join(iteration).join("generations.jsonl")).unwrap();
        assert_eq!(answers(1), answers(2), "SPIN's {iteration} answers");
    }
    for (run, step) in [
        ("kto", ""),
        ("steerlm-attributes", ""),
        ("steerlm-sft", ""),
        ("rs", "round-1"),
    ] {
        same_logged_values(
            &dir.path().join(format!("{run}-1")).join(step),
            &dir.path().join(format!("{run}-2")).join(step),
        );
    }
    // The same samples kept, and the same rewards before and after the round.
    let round = |np: usize| -> Value {
        let text = std::fs::read_to_string(dir.path().join(format!("rs-{np}/rs.jsonl"))).unwrap();
        serde_json::from_str(text.trim()).unwrap()
    };
    let (one, two) = (round(1), round(2));
    assert_eq!(one["kept"], two["kept"]);
    for key in [
        "sample_reward",
        "kept_reward",
        "eval_reward_before",
        "eval_reward_after",
    ] {
        let (a, b) = (one[key].as_f64().unwrap(), two[key].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-5, "rs {key}: {a} against {b}");
    }
    // SPIN's accuracies at steps 0 and 1 count margins that are 0 up to float noise (the
    // policy is still its reference): every other value must agree.
    let iterations = |np: usize| {
        [
            metrics(&spin(np).join("iter-1")),
            metrics(&spin(np).join("iter-2")),
        ]
        .concat()
    };
    let (one, two) = (iterations(1), iterations(2));
    assert_eq!(one.len(), two.len());
    for (x, y) in one.iter().zip(&two) {
        for (key, value) in x.as_object().unwrap() {
            let unmoved = x["step"].as_u64().is_some_and(|step| step <= 1);
            if key.starts_with("time_") || (unmoved && key.ends_with("rewards/accuracy")) {
                continue;
            }
            let (p, q) = (value.as_f64().unwrap(), y[key].as_f64().unwrap());
            assert!(
                (p - q).abs() <= 1e-4 * (1.0 + p.abs()),
                "SPIN {key}: {p} against {q}"
            );
        }
    }
}

#[test]
fn kto_spin_rejection_sampling_and_annotation_run_on_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    ranks(2, &["kto", "--out", &out("kto"), "--set", "train.max_steps=4"]);
    assert!(dir.path().join("kto/final/model.safetensors").exists());
    ranks(
        2,
        &[
            "spin",
            "--out",
            &out("spin"),
            "--set",
            "spin.iterations=1",
            "--set",
            "train.max_steps=3",
        ],
    );
    // Rank 0 wrote one answer per prompt, generated across both ranks' engines.
    let answers = std::fs::read_to_string(dir.path().join("spin/iter-1/generations.jsonl")).unwrap();
    let prompts =
        std::fs::read_to_string(repo().join("assets/tinystories_sentiment/train.sft.jsonl")).unwrap();
    assert_eq!(answers.lines().count(), prompts.lines().count());
    let attributes = out("attributes");
    ranks(
        2,
        &[
            "steerlm",
            "attributes",
            "--out",
            &attributes,
            "--set",
            "train.max_steps=3",
        ],
    );
    let labelled = out("labelled.jsonl");
    ranks(
        2,
        &[
            "steerlm",
            "annotate",
            "--model",
            &format!("{attributes}/final"),
            "--data",
            "assets/tinystories_sentiment/test.sft.jsonl",
            "--out",
            &labelled,
        ],
    );
    let rows = std::fs::read_to_string(&labelled).unwrap();
    let test = std::fs::read_to_string(repo().join("assets/tinystories_sentiment/test.sft.jsonl")).unwrap();
    assert_eq!(rows.lines().count(), test.lines().count());
    let rm = out("rm");
    ranks(1, &["rm", "--out", &rm, "--set", "train.max_steps=20"]);
    ranks(
        2,
        &[
            "rs",
            "--out",
            &out("rs"),
            "--set",
            "rs.rounds=1",
            "--set",
            &format!("reward_model.path={rm}/final"),
        ],
    );
    assert!(dir.path().join("rs/final/model.safetensors").exists());
}

/// KTO's KL baseline z0 is a mean over the whole micro-batch: each rank sums its shard's
/// mismatched log-ratios, the sums are added over the ranks before the step, and every rank's
/// loss uses the z0 one process would (a rank's own shard would give another baseline).
/// Supervised distillation on 1, 2 and 3 ranks and in tensor groups of 1×2 and 2×2 (a random
/// Gemma 2 teacher, so the KL is far from zero; in the groups it is split as the student is):
/// the same weights and metrics. In a 1×2 group, GKD (half of each batch the student's own
/// answers, drawn by the engine split over the group) and supervised distillation on the
/// teacher's cached top-k log-probs (computed by the writer's group together) end where one
/// process does too.
#[test]
fn distill_on_two_and_three_ranks_and_in_tensor_groups_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = common::repo().join("tests/reference/hf_random/gemma2_capped");
    let sets = |extra: &[&str]| {
        let mut sets = vec![
            format!("distill.teacher={}", teacher.display()),
            "train.max_steps=3".into(),
            "data.validation=''".into(),
            "frontier.prompts=''".into(),
        ];
        sets.extend(extra.iter().map(|s| s.to_string()));
        sets
    };
    trains_as_one_process_in(
        &["distill"],
        12,
        &sets(&[]),
        dir.path(),
        &[(2, "none", 1), (3, "none", 1), (2, "none", 2), (4, "none", 2)],
    );
    for (name, extra) in [
        ("gkd", ["distill.mode=gkd", "distill.max_new_tokens=12"]),
        ("top-k", ["distill.top_k=8", "train.eval_every=0"]),
    ] {
        let tmp = dir.path().join(name);
        trains_as_one_process_in(&["distill"], 8, &sets(&extra), &tmp, &[(2, "none", 2)]);
    }
    // A teacher whose vocabulary is padded past the student's 512 ids (as Qwen2.5-7B's is past
    // 0.5B's): one process compares the ids the two share, and a 1×2 group reads the
    // teacher's first 512 rows, so both split the vocabulary alike. The padding changes
    // nothing: one process ends where it does with the unpadded teacher.
    let padded = padded_vocabulary(&teacher, &dir.path().join("padded-teacher"), 517);
    let tmp = dir.path().join("padded");
    let mut sets = sets(&[]);
    sets[0] = format!("distill.teacher={}", padded.display());
    let logs = trains_as_one_process_in(&["distill"], 12, &sets, &tmp, &[(2, "none", 2)]);
    assert!(
        logs[0].contains("the losses run over the vocabulary split across the tensor group"),
        "{}",
        logs[0]
    );
    let one = |root: &Path| root.join("distill-np1-none-t1/final");
    let diff = weights_diff(&one(dir.path()), &one(&tmp));
    assert!(
        diff <= 1e-5,
        "the padded teacher moved one process's run by {diff}"
    );
}

/// A copy of the model folder `model` in `out` whose embedding and output projection have
/// `rows` rows (`vocab_size` in its config.json): the model's, then rows no token id reaches.
fn padded_vocabulary(model: &Path, out: &Path, rows: usize) -> PathBuf {
    use safetensors::tensor::TensorView;
    std::fs::create_dir_all(out).unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, out.join(path.file_name().unwrap())).unwrap();
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = rows.into();
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in file.tensors() {
        let (mut shape, mut data) = (view.shape().to_vec(), view.data().to_vec());
        if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            assert_eq!(view.dtype(), safetensors::Dtype::F32);
            let extra = (rows - shape[0]) * shape[1];
            data.extend((0..extra).flat_map(|i| (0.05 * (i as f32).sin()).to_le_bytes()));
            shape[0] = rows;
        }
        tensors.push((name, view.dtype(), shape, data));
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
    out.to_path_buf()
}

#[test]
fn kto_on_two_and_three_ranks_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let run_of = |np: usize| dir.path().join(format!("kto-np{np}"));
    for np in [1, 2, 3] {
        let out = run_of(np);
        let batch = format!("train.batch_size={}", 12 / np);
        ranks(
            np,
            &[
                "kto",
                "--out",
                out.to_str().unwrap(),
                "--set",
                &batch,
                "--set",
                "train.max_steps=4",
                "--set",
                "train.lr=5e-4",
                "--set",
                "data.validation=",
            ],
        );
    }
    for np in [2, 3] {
        let diff = weights_diff(&run_of(1).join("final"), &run_of(np).join("final"));
        assert!(diff <= 1e-5, "kto: {np} ranks end {diff} from one process");
        let (one, many) = (metrics(&run_of(1)), metrics(&run_of(np)));
        assert_eq!(one.len(), many.len());
        for (a, b) in one.iter().zip(&many) {
            for key in ["loss", "kl"] {
                let (p, q) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
                assert!(
                    (p - q).abs() <= 1e-5 * (1.0 + p.abs()),
                    "{key} at {}: {p} against {q}",
                    a["step"]
                );
            }
        }
    }
}

/// Online DPO over data-parallel ranks: each draws and scores its share of a step's prompts
/// (every answer seeded by its place in the whole batch) and trains on its share of the pairs;
/// 2 and 3 ranks (uneven shares) end where one process does, and a 3-rank run stopped at its
/// checkpoint resumes on 2 ranks to the same end.
#[test]
fn online_dpo_on_two_and_three_ranks_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("online.toml");
    std::fs::write(
        &config,
        "[online]\nprompts_per_step = 8\nmax_new_tokens = 16\neval_prompts = 7\n\
         [train]\nmax_steps = 4\neval_every = 2\nsave_every = 2\n\
         [frontier]\nprompts = \"\"\n\
         [[reward]]\nfunction = \"tinystories_sentiment\"\n",
    )
    .unwrap();
    let run_of = |name: &str| dir.path().join(name);
    let config = config.to_str().unwrap();
    for (np, name, extra) in [
        (1, "one", None),
        (2, "two", None),
        (3, "three", None),
        (3, "cut", Some("2")),
    ] {
        let out = run_of(name);
        let mut args = vec!["online-dpo", "--config", config, "--out", out.to_str().unwrap()];
        if let Some(step) = extra {
            args.extend(["--stop-after", step]);
        }
        ranks(np, &args);
    }
    let cut = run_of("cut");
    ranks(
        2,
        &["online-dpo", "--resume", cut.to_str().unwrap(), "--allow-change"],
    );
    let one = run_of("one");
    let pairs: f64 = metrics(&one).iter().filter_map(|r| r["pairs"].as_f64()).sum();
    assert!(pairs > 0.0, "no step had a pair to train on");
    for name in ["two", "three", "cut"] {
        let run = run_of(name);
        let diff = weights_diff(&one.join("final"), &run.join("final"));
        assert!(diff <= 1e-5, "online DPO, {name}: ends {diff} from one process");
        same_metrics(&one, &run, 1e-5);
    }
}

/// Online DPO in tensor groups of 1×2 and 2×2: each group's ranks sample their share of the
/// prompts together (the engine split over the group, as the policy and the reference are),
/// the frontier is measured on the policy gathered to rank 0 alone, and the run ends where one
/// process's does, in weights and in every logged value; a 1×2 run stopped at step 2 resumes
/// in one process to the same end. At lr 5e-5: one weight's gradient (a `gate_proj` element)
/// is rounding noise in the first steps, which AdamW turns into an update of up to ~0.09 lr
/// whose sign follows the order of the sums (measured 2.6e-5 from one process at the default
/// lr 3e-4, 8.5e-6 at 1e-4; the samples, rewards and pairs are one process's).
#[test]
fn online_dpo_in_tensor_groups_trains_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("online.toml");
    std::fs::write(
        &config,
        "[online]\nprompts_per_step = 8\nmax_new_tokens = 16\neval_prompts = 6\n\
         [train]\nmax_steps = 4\neval_every = 2\nsave_every = 2\nlr = 5e-5\n\
         [frontier]\nmax_prompts = 4\nmax_new_tokens = 8\n\
         [[reward]]\nfunction = \"tinystories_sentiment\"\n",
    )
    .unwrap();
    let run_of = |name: &str| dir.path().join(name);
    let config = config.to_str().unwrap();
    for (np, name, tensor, stop) in [
        (1, "one", 1, None),
        (2, "group", 2, None),
        (4, "grid", 2, None),
        (2, "cut", 2, Some("2")),
    ] {
        let out = run_of(name);
        let tensor = format!("parallel.tensor={tensor}");
        let mut args = vec![
            "online-dpo",
            "--config",
            config,
            "--out",
            out.to_str().unwrap(),
            "--set",
            &tensor,
        ];
        if let Some(step) = stop {
            args.extend(["--stop-after", step]);
        }
        ranks(np, &args);
    }
    let cut = run_of("cut");
    ranks(
        1,
        &[
            "online-dpo",
            "--resume",
            cut.to_str().unwrap(),
            "--allow-change",
            "--set",
            "parallel.tensor=1",
        ],
    );
    let one = run_of("one");
    let rows = metrics(&one);
    let pairs: f64 = rows.iter().filter_map(|r| r["pairs"].as_f64()).sum();
    assert!(pairs > 0.0, "no step had a pair to train on");
    assert!(
        rows.iter().any(|r| r.get("eval_frontier/kl").is_some()),
        "the frontier was measured"
    );
    let moved = weights_diff(&repo().join("assets/stories260K"), &one.join("final"));
    assert!(moved > 5e-5, "the policy moved {moved}");
    for name in ["group", "grid", "cut"] {
        let run = run_of(name);
        let diff = weights_diff(&one.join("final"), &run.join("final"));
        assert!(diff <= 1e-5, "online DPO, {name}: ends {diff} from one process");
        same_metrics(&one, &run, 1e-5);
    }
}

/// Self-rewarding (data parallel) and Constitutional AI (its fine-tuning stages in a 1×2 tensor
/// group) on two ranks with LoRA adapters, then resumed: a finished iteration or stage is kept
/// (its model not trained again), an unfinished one is run.
#[test]
fn self_reward_and_cai_in_a_tensor_group_run_on_two_ranks_with_lora_and_resume_by_stage() {
    let dir = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let modified = |path: PathBuf| std::fs::metadata(&path).unwrap().modified().unwrap();
    ranks(
        2,
        &[
            "self-reward",
            "--out",
            &out("self-reward"),
            "--set",
            "model.lora_rank=4",
            "--set",
            "self_reward.iterations=1",
            "--set",
            "self_reward.max_prompts=16",
            "--set",
            "sft.max_steps=20",
            "--set",
            "frontier.max_prompts=8",
        ],
    );
    let sr = dir.path().join("self-reward");
    for file in [
        "sft/final/adapter",
        "iter-1/pairs.jsonl",
        "iter-1/dpo/final/adapter",
        "final/model.safetensors",
    ] {
        assert!(sr.join(file).exists(), "{file}");
    }
    // Written once, by rank 0: iteration 0 and 1.
    assert_eq!(common::jsonl(&sr.join("self_reward.jsonl")).len(), 2);
    // Interrupted in iteration 1: resumed, the IFT + EFT model is kept and iteration 1 redone.
    let sft_model = sr.join("sft/final/model.safetensors");
    let before = modified(sft_model.clone());
    std::fs::remove_dir_all(sr.join("iter-1/dpo/final")).unwrap();
    let first = std::fs::read_to_string(sr.join("self_reward.jsonl")).unwrap();
    std::fs::write(
        sr.join("self_reward.jsonl"),
        format!("{}\n", first.lines().next().unwrap()),
    )
    .unwrap();
    ranks(2, &["self-reward", "--resume", &out("self-reward")]);
    assert_eq!(
        modified(sft_model),
        before,
        "the finished IFT + EFT step was trained again"
    );
    assert!(sr.join("iter-1/dpo/final/adapter").exists());
    let iterations: Vec<u64> = common::jsonl(&sr.join("self_reward.jsonl"))
        .iter()
        .map(|r| r["iteration"].as_u64().unwrap())
        .collect();
    assert_eq!(iterations, [0, 1]);

    ranks(
        2,
        &[
            "cai",
            "--out",
            &out("cai"),
            "--set",
            "model.lora_rank=4",
            // Its fine-tuning stages (the judge, SFT on the revisions, the reward model on the
            // AI labels and online DPO against it) in a 1×2 tensor group; its answers,
            // critiques and revisions over the ranks.
            "--set",
            "parallel.tensor=2",
            "--set",
            "cai.max_prompts=32",
            "--set",
            "judge.max_steps=20",
            "--set",
            "reward_model.max_steps=8",
            "--set",
            "online_train.max_steps=2",
            "--set",
            "online.prompts_per_step=8",
            "--set",
            "frontier.max_prompts=8",
        ],
    );
    let cai = dir.path().join("cai");
    for file in [
        "sl/sft/final/adapter",
        "judge/final/adapter",
        "rl/reward_model/final/adapter",
        "rl/online_dpo/final/adapter",
        "final/model.safetensors",
    ] {
        assert!(cai.join(file).exists(), "{file}");
    }
    assert_eq!(common::jsonl(&cai.join("rl/labels.jsonl")).len(), 32);
    assert_eq!(common::jsonl(&cai.join("cai.jsonl")).len(), 3);
    // The ranks' engines shared the answering, critiques and revisions: each request draws from
    // its own seed, so one process writes the same texts.
    ranks(
        1,
        &[
            "cai",
            "--out",
            &out("cai-one"),
            "--set",
            "model.lora_rank=4",
            "--set",
            "cai.rl=dpo",
            "--set",
            "cai.max_prompts=32",
            "--set",
            "judge.max_steps=1",
            "--set",
            "sl.max_steps=1",
            "--set",
            "train.max_steps=1",
            "--set",
            "cai.min_confidence=0",
            "--set",
            "frontier.prompts=''",
        ],
    );
    for file in ["sl/answers.jsonl", "sl/critiques.jsonl", "sl/revisions.jsonl"] {
        assert_eq!(
            common::jsonl(&cai.join(file)),
            common::jsonl(&dir.path().join("cai-one").join(file)),
            "{file}"
        );
    }

    // Interrupted in the RL stage: its model gone, its report not written.
    let kept = [
        cai.join("sl/sft/final/model.safetensors"),
        cai.join("judge/final/model.safetensors"),
    ];
    let before: Vec<_> = kept.iter().map(|p| modified(p.clone())).collect();
    std::fs::remove_dir_all(cai.join("rl/online_dpo/final")).unwrap();
    let reports = std::fs::read_to_string(cai.join("cai.jsonl")).unwrap();
    let first_two: String = reports.lines().take(2).map(|l| format!("{l}\n")).collect();
    std::fs::write(cai.join("cai.jsonl"), first_two).unwrap();
    ranks(2, &["cai", "--resume", &out("cai")]);
    let after: Vec<_> = kept.iter().map(|p| modified(p.clone())).collect();
    assert_eq!(before, after, "a finished stage was trained again");
    assert!(cai.join("rl/online_dpo/final/adapter").exists());
    let reports = common::jsonl(&cai.join("cai.jsonl"));
    let stages: Vec<&str> = reports.iter().map(|r| r["stage"].as_str().unwrap()).collect();
    assert_eq!(stages, ["start", "sl", "rl"]);
}

/// `aligner plan`'s memory model against the peak memory `aligner bench train` measures (the
/// largest rank's resident memory) on the 16M-parameter benchmark model: one process, two
/// ranks with each sharding stage (`full` included) and a 1×2 tensor group, within 15%.
#[test]
fn plan_predicts_the_peak_memory_that_training_measures() {
    let dir = tempfile::tempdir().unwrap();
    // `aligner bench`'s random-16M: hidden 256, 4 layers, 4 heads, 2 KV heads, FFN 688,
    // GPT-2's vocabulary, tied embeddings.
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 50257,
            "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let global_batch = 16;
    // (ranks, train.sharding, parallel.tensor)
    for (np, sharding, tensor) in [
        (1, "none", 1),
        (2, "none", 1),
        (2, "optimizer", 1),
        (2, "gradients", 1),
        (2, "full", 1),
        (2, "none", 2),
    ] {
        let tensor_text = tensor.to_string();
        let bench = [
            "bench",
            "--only",
            "random-16M",
            "train",
            "--batch",
            &global_batch.to_string(),
            "--seq",
            "128",
            "--steps",
            "1",
            "--sharding",
            sharding,
            "--tensor",
            &tensor_text,
        ];
        let out = match np {
            1 => Command::new(aligner_exe())
                .env("RAYON_NUM_THREADS", "1")
                .args(bench)
                .output()
                .unwrap(),
            _ => mpirun(np, &aligner_exe()).args(bench).output().unwrap(),
        };
        let table = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let row = table.lines().find(|l| l.starts_with("| random-16M")).unwrap();
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let (overlapped, buckets) = (cells[12], cells[13]);
        if np > 1 && tensor == 1 && matches!(sharding, "none" | "optimizer") {
            // The default 25 MiB buckets: the layers' gradients in one, the 51 MB embedding
            // in another; the layers' is summed while the backward computes the embedding's.
            assert_eq!(buckets, "2 of 2", "{row}");
            assert!(overlapped.parse::<f64>().unwrap() > 0.0, "{row}");
        } else {
            assert_eq!((overlapped, buckets), ("–", "–"), "{row}");
        }
        let mib: f64 = row
            .trim_end_matches('|')
            .rsplit('|')
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let measured = mib * 1024.0 * 1024.0 / 1e9;

        // The batch of each data-parallel rank (a tensor group's ranks share theirs).
        let per_rank = (global_batch * tensor / np).to_string();
        let np_text = np.to_string();
        let out = Command::new(aligner_exe())
            .args([
                "plan",
                "--config",
                config.to_str().unwrap(),
                "--cpu",
                "--gpus",
                &np_text,
            ])
            .args([
                "--gpu-memory",
                "24GiB",
                "--dtype",
                "f32",
                "--batch",
                &per_rank,
                "--seq",
                "128",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let row = text
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "| {} × {tensor} | {sharding} | device | off |",
                    np / tensor
                ))
            })
            .unwrap_or_else(|| panic!("{text}"));
        // The training phases' column ("training GB"): `bench train` saves nothing.
        let predicted: f64 = row.split('|').nth(14).unwrap().trim().parse().unwrap();
        let error = (predicted - measured).abs() / measured;
        assert!(
            error <= 0.15,
            "{np} ranks, sharding {sharding}, tensor {tensor}: predicted {predicted} GB, measured {measured:.3} GB"
        );
        eprintln!(
            "{np} ranks, sharding {sharding}, tensor {tensor}: predicted {predicted} GB, measured {measured:.3} GB"
        );
    }
}
