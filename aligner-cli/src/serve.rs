//! `aligner serve critic`: the PPO critic (and reward model) as a gRPC server.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use aligner_core::Device;
use aligner_ppo::CriticWorker;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum ServeCommand {
    /// The critic (a value head, trained by the actor's requests) and optionally the reward model.
    Critic(CriticArgs),
}

#[derive(Args)]
pub struct CriticArgs {
    /// Folder the critic starts from: a reward model (NeMo-Aligner's choice) or a causal LM.
    #[arg(long)]
    model: PathBuf,
    /// A reward model to serve in the same process (`ppo.combine_rm_and_critic`).
    #[arg(long)]
    reward_model: Option<PathBuf>,
    #[arg(long, default_value_t = 50051)]
    port: u16,
    /// Address to listen on; loopback unless told otherwise.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// What the critic and reward model compute in: f32, or bf16 / f16 on GPU devices (the
    /// actor's `model.dtype`; the critic trains on f32 master weights).
    #[arg(long, default_value = "f32", value_parser = crate::parse_precision)]
    dtype: aligner_core::config::Precision,
}

pub fn run(cmd: ServeCommand, device: &Device) -> Result<()> {
    let ServeCommand::Critic(args) = cmd;
    args.dtype
        .check_device(device)
        .map_err(|e| anyhow::anyhow!("--dtype: {e}"))?;
    let worker = CriticWorker::from_dirs(&args.model, args.reward_model.as_deref(), device, args.dtype)?;
    let has_reward_model = args.reward_model.is_some();
    let addr = SocketAddr::new(args.host, args.port);
    aligner_ppo::server::serve(worker, has_reward_model, addr, |bound| {
        // Scripts and tests wait for this line.
        println!("listening on {bound}");
        tracing::info!(%bound, reward_model = has_reward_model, "critic server ready");
    })
    .with_context(|| format!("serving the critic on {addr}"))
}
