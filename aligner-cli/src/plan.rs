//! `aligner plan`: the memory per device of each layout of a job, the layout that fits and
//! its launch command (aligner_core::plan's model).

use std::path::PathBuf;

use aligner_core::LlamaConfig;
use aligner_core::config::Precision;
use aligner_core::plan::{
    Candidate, Cluster, DeviceKind, Layout, Plan, PlanMethod, Stage, Workload, frontier_extra, plan,
    smallest_cluster,
};
use anyhow::{Context, Result, bail};

#[derive(clap::Args)]
pub struct PlanArgs {
    /// A Hugging Face model folder (its config.json is read; no weights are loaded). Default:
    /// the embedded model.
    #[arg(long, conflicts_with = "config")]
    model: Option<PathBuf>,
    /// A config.json alone.
    #[arg(long)]
    config: Option<PathBuf>,
    /// sft, dpo, ppo or grpo.
    #[arg(long, default_value = "sft", value_parser = ["sft", "dpo", "ppo", "grpo"])]
    method: String,
    /// Examples per micro-batch on each data-parallel rank (`train.batch_size`; DPO: pairs).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// LoRA adapters of this rank on every projection (default: full fine-tuning).
    #[arg(long)]
    lora: Option<usize>,
    /// What the model computes in: f32, bf16 or f16 (half precision keeps f32 master weights).
    #[arg(long, default_value = "bf16", value_parser = crate::parse_precision)]
    dtype: Precision,
    /// Devices in all (default: one node's).
    #[arg(long, conflicts_with = "nodes")]
    gpus: Option<usize>,
    /// Nodes of `--gpus-per-node` devices.
    #[arg(long)]
    nodes: Option<usize>,
    #[arg(long, default_value_t = 8)]
    gpus_per_node: usize,
    /// Memory per device: `80GB`, `141GB`, `24GiB`.
    #[arg(long, default_value = "80GB", value_parser = parse_bytes)]
    gpu_memory: f64,
    /// Also list the layouts aligner does not run yet (tensor groups beside fully sharded
    /// parameters); they are listed anyway when nothing aligner runs fits.
    #[arg(long)]
    all: bool,
    /// The devices are CPU processes (ranks of `mpirun` on host memory): the runtime's own
    /// memory is the process's, not a GPU context's.
    #[arg(long)]
    cpu: bool,
}

/// `80GB` (10^9), `24GiB` (2^30), `512MB`, `1.5TB`, or plain bytes.
fn parse_bytes(text: &str) -> std::result::Result<f64, String> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?}: expected a size such as 80GB or 24GiB"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" | "g" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        other => return Err(format!("{text:?}: unknown unit {other:?} (GB, GiB, MB, ...)")),
    };
    if !(value.is_finite() && value > 0.0) {
        return Err(format!("{text:?}: must be more than 0"));
    }
    Ok(value * scale)
}

fn gb(bytes: f64) -> String {
    match bytes / 1e9 {
        v if v < 10.0 => format!("{v:.2}"),
        v => format!("{v:.1}"),
    }
}

/// The method's command line under the layout.
fn launch_command(args: &PlanArgs, layout: &Layout, per_node: usize) -> String {
    let mut command = match (layout.devices(), args.nodes) {
        (1, _) => "aligner".to_string(),
        (n, Some(_)) => format!("mpirun -np {n} --npernode {per_node} aligner"),
        (n, None) => format!("mpirun -np {n} aligner"),
    };
    let method = match args.method.as_str() {
        "grpo" => "ppo --set ppo.advantage=grpo".to_string(),
        other => other.to_string(),
    };
    command.push_str(&format!(" {method}"));
    if let Some(model) = &args.model {
        command.push_str(&format!(" --set model.path={}", model.display()));
    }
    command.push_str(&format!(" --set train.batch_size={}", args.batch));
    if layout.sharding != Stage::None {
        command.push_str(&format!(" --set train.sharding={}", layout.sharding.name()));
    }
    if layout.tensor > 1 {
        command.push_str(&format!(" --set parallel.tensor={}", layout.tensor));
    }
    if layout.recompute {
        command.push_str(" --set train.activation_checkpointing=true");
    }
    if layout.offload_frozen {
        command.push_str(" --set ppo.offload_reference=true");
        if args.method == "ppo" {
            command.push_str(" --set ppo.offload_reward_model=true");
        }
    }
    if let Some(rank) = args.lora {
        command.push_str(&format!(" --set model.lora_rank={rank}"));
    }
    if args.dtype != Precision::F32 {
        command.push_str(&format!(" --set model.dtype={}", args.dtype.name()));
    }
    command
}

fn print_table(plan: &Plan, all: bool) {
    println!(
        "| data × tensor | sharding | frozen models | recompute | weights | master | optimizer | companions | gradients | activations | logits | kept | sync | training GB | saving GB | peak GB | fits | runs today |"
    );
    println!("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|");
    for (
        i,
        Candidate {
            layout,
            estimate: e,
            fits,
        },
    ) in plan.candidates.iter().enumerate()
    {
        if !all && !layout.runs_today() {
            continue;
        }
        let mark = if plan.picked == Some(i) { " ← picked" } else { "" };
        println!(
            "| {} × {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}{mark} |",
            layout.data,
            layout.tensor,
            layout.sharding.name(),
            if layout.offload_frozen { "host" } else { "device" },
            if layout.recompute { "full" } else { "off" },
            gb(e.weights),
            gb(e.master_weights),
            gb(e.optimizer),
            gb(e.companions),
            gb(e.gradients),
            gb(e.activations),
            gb(e.logits),
            gb(e.kept),
            gb(e.sync),
            gb(e.training),
            gb(e.saving),
            gb(e.peak),
            if *fits { "yes" } else { "no" },
            if layout.runs_today() { "yes" } else { "not yet" },
        );
    }
}

pub fn run(args: PlanArgs) -> Result<()> {
    let config_path = match (&args.config, &args.model) {
        (Some(path), _) => path.clone(),
        (None, Some(dir)) => dir.join("config.json"),
        (None, None) => aligner_core::default_model_dir()?.join("config.json"),
    };
    let config = LlamaConfig::from_file(&config_path)
        .with_context(|| format!("--model/--config {}", config_path.display()))?;
    for (name, value) in [
        ("--batch", args.batch),
        ("--seq", args.seq),
        ("--gpus-per-node", args.gpus_per_node),
    ] {
        if value == 0 {
            bail!("{name} 0: must be at least 1");
        }
    }
    if args.lora == Some(0) {
        bail!("--lora 0: a LoRA rank is at least 1");
    }
    let devices = match (args.gpus, args.nodes) {
        (Some(0), _) | (_, Some(0)) => bail!("--gpus / --nodes 0: must be at least 1"),
        (Some(n), _) => n,
        (None, Some(nodes)) => nodes * args.gpus_per_node,
        (None, None) => args.gpus_per_node,
    };
    let work = Workload {
        method: PlanMethod::parse(&args.method).context("--method")?,
        batch: args.batch,
        seq: args.seq,
        lora_rank: args.lora,
        precision: args.dtype,
    };
    let cluster = Cluster {
        devices,
        devices_per_node: args.gpus_per_node.min(devices),
        memory: args.gpu_memory,
        kind: if args.cpu {
            DeviceKind::Cpu
        } else {
            DeviceKind::Gpu
        },
    };
    let params = aligner_core::plan::parameters(&config);
    println!(
        "{} ({} parameters, {} layers) · {} · batch {} × {} tokens{} · {} · {devices} {} of {} GB",
        config_path.display(),
        params.total,
        config.num_hidden_layers,
        args.method,
        args.batch,
        args.seq,
        args.lora.map(|r| format!(" · LoRA rank {r}")).unwrap_or_default(),
        args.dtype.name(),
        match (args.cpu, devices) {
            (true, 1) => "CPU rank",
            (true, _) => "CPU ranks",
            (false, 1) => "GPU",
            (false, _) => "GPUs",
        },
        gb(args.gpu_memory),
    );
    println!();
    let planned = plan(&config, &work, &cluster);
    print_table(&planned, args.all || planned.picked.is_none());
    println!();
    if let Some(i) = planned.picked {
        let c = &planned.candidates[i];
        println!(
            "picked: {} data-parallel rank{} × tensor {}, sharding {}, peak {} GB of {} GB",
            c.layout.data,
            if c.layout.data == 1 { "" } else { "s" },
            c.layout.tensor,
            c.layout.sharding.name(),
            gb(c.estimate.peak),
            gb(args.gpu_memory)
        );
        let mut launch = launch_command(&args, &c.layout, cluster.devices_per_node);
        if work.method.measures_frontier() {
            let extra = frontier_extra(&config, &work, &c.layout);
            let with_frontier = c.estimate.peak + extra;
            match with_frontier <= args.gpu_memory {
                true => println!(
                    "frontier: rank 0 holds {} GB more for the reward–KL frontier (peak {} GB)",
                    gb(extra),
                    gb(with_frontier)
                ),
                false => {
                    println!(
                        "frontier: rank 0 would hold {} GB more for the reward–KL frontier (the start \
                         model, and the policy gathered for its samples; peak {} GB): off in the launch \
                         command",
                        gb(extra),
                        gb(with_frontier)
                    );
                    launch.push_str(" --set frontier.prompts=''");
                }
            }
        }
        println!("launch: {launch}");
        return Ok(());
    }
    let (today, predicted) = smallest_cluster(&config, &work, &cluster);
    let describe = |plan: &Option<Plan>, runs_today: bool| -> String {
        plan.as_ref()
            .and_then(|p| {
                let i = match runs_today {
                    true => p.picked?,
                    false => p.candidates.iter().position(|c| c.fits)?,
                };
                let c = &p.candidates[i];
                Some(format!(
                    "{} devices ({} × {}, sharding {}{}, peak {} GB)",
                    c.layout.devices(),
                    c.layout.data,
                    c.layout.tensor,
                    c.layout.sharding.name(),
                    if c.layout.recompute {
                        ", full recomputation"
                    } else {
                        ""
                    },
                    gb(c.estimate.peak)
                ))
            })
            .unwrap_or_else(|| "none up to 4096 devices".into())
    };
    bail!(
        "nothing aligner runs fits on {devices} devices of {} GB each. The smallest cluster that \
         would: {}. With what aligner does not do yet (tensor groups beside full sharding): {}",
        gb(args.gpu_memory),
        describe(&today, true),
        describe(&predicted, false),
    )
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_read_in_decimal_and_binary_units() {
        assert_eq!(parse_bytes("80GB"), Ok(80e9));
        assert_eq!(parse_bytes("24GiB"), Ok(24.0 * 1024f64.powi(3)));
        assert_eq!(parse_bytes("1.5 TB"), Ok(1.5e12));
        assert!(parse_bytes("80XB").is_err());
        assert!(parse_bytes("0GB").is_err());
        assert!(parse_bytes("GB").is_err());
    }
}
