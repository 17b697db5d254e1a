//! `aligner`: the command line of the aligner toolkit.

/// Prints a run's result on stdout from rank 0 only: under `mpirun` every rank ends the same
/// run, and one summary is what a user reads.
macro_rules! say {
    ($($arg:tt)*) => {
        if aligner_parallel::world().is_root() {
            println!($($arg)*);
        }
    };
}

mod bench;
mod bench_episodes;
mod convert;
mod eval;
mod generate;
mod online;
mod output;
mod plan;
mod plot;
mod registry;
mod score;
mod serve;
mod steerlm;
mod train;

use anyhow::{Result, bail};
use burn::tensor::Device;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "aligner",
    version,
    about = "Align language models with human preferences"
)]
struct Cli {
    /// Compute device: `cpu`; `wgpu`, `wgpu:cpu`, `wgpu:N` in builds with the `wgpu` feature;
    /// `cuda`, `cuda:N` in builds with the `cuda` feature.
    #[arg(long, global = true, default_value = "cpu")]
    device: String,
    /// Only warnings and errors on stderr (the results still go to stdout).
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// More detail on stderr: -v debug, -vv trace (RUST_LOG, when set, decides instead).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Supervised fine-tuning (loss on response tokens).
    Sft(train::TrainArgs),
    /// Train a reward model on preference pairs (Bradley–Terry).
    Rm(train::TrainArgs),
    /// Direct preference optimisation and its variants (`dpo.loss`).
    Dpo(train::TrainArgs),
    /// KTO on unpaired desirable/undesirable completions.
    #[cfg(feature = "kto")]
    Kto(train::TrainArgs),
    /// RLHF with PPO: actor, reference, critic and reward model; with a critic-free
    /// `ppo.advantage`, the GRPO family (GRPO, DAPO, Dr. GRPO, GSPO, REINFORCE++, RLOO).
    Ppo(train::TrainArgs),
    /// Online DPO: the policy's own answer pairs, judged by a reward, one DPO step each round.
    OnlineDpo(train::TrainArgs),
    /// SteerLM: attribute model, annotation, attribute-conditioned SFT.
    #[command(subcommand)]
    Steerlm(steerlm::SteerCommand),
    /// Self-play fine-tuning (SPIN) iterations.
    Spin(train::TrainArgs),
    /// Self-rewarding language models: IFT + EFT fine-tuning, then iterations of answering,
    /// judging its own answers and DPO on the best against the worst.
    SelfReward(train::TrainArgs),
    /// Constitutional AI: answers critiqued and revised under a constitution's principles
    /// (SFT on the revisions), then AI preference labels from a feedback model and DPO or a
    /// reward model on them (RLAIF).
    Cai(train::TrainArgs),
    /// Rejection sampling (best-of-n) rounds.
    Rs(train::TrainArgs),
    /// Knowledge distillation: a student learns a teacher's next-token distributions.
    Distill(train::TrainArgs),
    /// Serve a PPO role over gRPC.
    #[command(subcommand)]
    Serve(serve::ServeCommand),
    /// Generate responses to prompts.
    Generate(generate::GenerateArgs),
    /// Sequence log-probs of responses given prompts.
    Score(score::ScoreArgs),
    /// Where a policy stands on the reward–KL frontier: reward of its own samples, KL to the
    /// reference, the reference's NLL of them, distinct-n, length, EOS fraction.
    Eval(eval::EvalArgs),
    /// Several runs' metrics on one SVG (one panel per metric, one line per run).
    Plot(plot::PlotArgs),
    /// Convert checkpoints from other formats into Hugging Face folders.
    #[command(subcommand)]
    Convert(convert::ConvertCommand),
    /// Benchmarks that print a table.
    Bench(bench::BenchArgs),
    /// The memory per device of each layout of a job (data parallel, sharding stage, tensor
    /// parallel, offloads), the one that fits a cluster, and its launch command.
    Plan(plan::PlanArgs),
}

/// A `--dtype` value: `f32`, `bf16` or `f16` (HF's `float32`, `bfloat16`, `float16` too).
fn parse_precision(text: &str) -> std::result::Result<aligner_core::config::Precision, String> {
    serde_json::from_value(serde_json::Value::String(text.to_string()))
        .map_err(|_| format!("{text:?} is not a dtype: f32, bf16 or f16"))
}

/// The device `--device` names: `cpu`, and in GPU builds `wgpu` (Burn's wgpu backend: Vulkan,
/// Metal or DX12; `wgpu:cpu` for a software adapter such as lavapipe, `wgpu:N` for the N-th
/// discrete GPU) and `cuda` / `cuda:N`.
fn device(name: &str) -> Result<Device> {
    let index = |prefix: &str| -> Result<Option<usize>> {
        name.strip_prefix(prefix)
            .map(|rest| {
                rest.parse()
                    .map_err(|_| anyhow::anyhow!("--device {name:?}: {rest:?} is not a device index"))
            })
            .transpose()
    };
    match name {
        "cpu" | "flex" => Ok(Device::flex()),
        #[cfg(feature = "wgpu")]
        "wgpu" => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
        #[cfg(feature = "wgpu")]
        "wgpu:cpu" => Ok(Device::wgpu(burn::tensor::DeviceKind::Cpu)),
        #[cfg(feature = "wgpu")]
        wgpu if wgpu.starts_with("wgpu:") => Ok(Device::wgpu(burn::tensor::DeviceKind::DiscreteGpu(
            index("wgpu:")?.unwrap_or(0),
        ))),
        #[cfg(feature = "cuda")]
        cuda if cuda == "cuda" || cuda.starts_with("cuda:") => Ok(Device::cuda(index("cuda:")?.unwrap_or(0))),
        other => {
            let _ = index;
            let mut have = vec!["cpu"];
            if cfg!(feature = "wgpu") {
                have.push("wgpu, wgpu:cpu, wgpu:N");
            }
            if cfg!(feature = "cuda") {
                have.push("cuda, cuda:N");
            }
            bail!(
                "unknown device {other:?} (this build has: {}; GPU devices need the `wgpu` or `cuda` feature)",
                have.join(", ")
            )
        }
    }
}

/// A GPU device that cannot start (no driver, no adapter) panics inside Burn at its first
/// tensor; one tiny tensor here turns that into an error naming the device.
fn probe(device: &Device, name: &str) -> Result<()> {
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(|| {
        burn::tensor::Tensor::<1>::ones([4], device)
            .sum()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
    });
    std::panic::set_hook(quiet);
    match result {
        Ok(Ok(values)) if values == [4.0] => Ok(()),
        Ok(other) => bail!("--device {name}: the device computed 1+1+1+1 = {other:?}"),
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic without a message");
            bail!(
                "--device {name}: the device did not start ({why}); a CUDA device needs the driver's \
                 libcuda.so and libdevice under CUDA_PATH, a wgpu one a Vulkan, Metal or DX12 adapter \
                 (Mesa's lavapipe on a machine without a GPU)"
            )
        }
    }
}

/// mimalloc keeps freed pages for reuse: a training step allocates and frees the same large
/// buffers (logits, gradients, optimizer moments) every time, which glibc hands back to the
/// kernel and faults in again.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Burn puts what it makes without a device (a resumed optimizer's state) on its default
    // device, the first GPU backend compiled in: pointed at `--device`'s backend, a CPU run
    // never starts the Vulkan or CUDA runtime. Set before any thread exists, and whatever the
    // environment says: a child process (a critic server) decides by its own `--device`.
    let backend = match cli.device.split(':').next() {
        Some("cpu" | "flex") => Some("flex"),
        Some(gpu @ ("wgpu" | "cuda")) => Some(gpu),
        // An unknown name is refused, naming it, when the device is made.
        _ => None,
    };
    if let Some(backend) = backend {
        // SAFETY: the program is single-threaded here (MPI and the logger start below).
        unsafe { std::env::set_var("BURN_DEVICE", backend) };
    }
    // Under `mpirun` / `srun` (builds with the `mpi` feature) this process is one rank of a
    // data-parallel group; otherwise the group is this process alone.
    let launch = aligner_parallel::launch()?;
    let world = aligner_parallel::world();
    // Rank 0 reports; the other ranks only warn (RUST_LOG still decides when set).
    let default_level = match (world.is_root(), cli.quiet, cli.verbose) {
        (false, ..) | (true, true, _) => "warn",
        (true, false, 0) => "info",
        (true, false, 1) => "debug",
        _ => "trace",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let outcome = run(cli);
    if world.world_size() > 1
        && let Err(e) = &outcome
    {
        eprintln!("Error (rank {} of {}): {e:?}", world.rank(), world.world_size());
        launch.abort(1);
    }
    outcome
}

fn run(cli: Cli) -> Result<()> {
    let device = device(&cli.device)?;
    if !matches!(cli.device.as_str(), "cpu" | "flex") {
        probe(&device, &cli.device)?;
    }
    match cli.command {
        Command::Sft(args) => train::sft(args, &device),
        Command::Rm(args) => train::rm(args, &device),
        Command::Dpo(args) => train::dpo(args, &device),
        #[cfg(feature = "kto")]
        Command::Kto(args) => train::kto(args, &device),
        Command::Ppo(args) => online::ppo(args, &device),
        Command::OnlineDpo(args) => online::online_dpo(args, &device),
        Command::Serve(cmd) => serve::run(cmd, &device),
        Command::Spin(args) => online::spin(args, &device),
        Command::SelfReward(args) => online::self_reward(args, &device),
        Command::Cai(args) => online::cai(args, &device),
        Command::Rs(args) => online::rs(args, &device),
        Command::Distill(args) => train::distill(args, &device),
        Command::Steerlm(cmd) => steerlm::run(cmd, &device),
        Command::Generate(args) => generate::run(args, &device),
        Command::Score(args) => score::run(args, &device),
        Command::Eval(args) => eval::run(args, &device),
        Command::Plot(args) => plot::run(args),
        Command::Convert(cmd) => convert::run(cmd, &device),
        Command::Bench(cmd) => bench::run(cmd, &device),
        Command::Plan(args) => plan::run(args),
    }
}

/// Writes JSON lines to `out` (through a temporary file and a rename) or to stdout.
fn write_jsonl(out: Option<&std::path::Path>, rows: &[serde_json::Value]) -> Result<()> {
    match out {
        Some(path) => aligner_core::data::write_jsonl(path, rows)?,
        None => {
            for row in rows {
                println!("{}", serde_json::to_string(row)?);
            }
        }
    }
    Ok(())
}
