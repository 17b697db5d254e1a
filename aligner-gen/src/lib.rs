//! # aligner-gen
//!
//! The rollout engine of aligner: prompts in, sampled responses out, with the per-token
//! log-probs a trainer needs. An [`Engine`] owns a KV cache of `slots` rows allocated once;
//! prompts are prefilled in batches and decoded a token a step, and a finished sequence's row
//! goes to the next queued prompt at once (continuous batching). Each request samples from its
//! own seeded random stream, so its output does not depend on the rest of the batch.
//! A request may carry classifier-free guidance ([`Guidance`]): its negative prompt runs in a
//! second cache row, fed the tokens the request samples from the guided distribution.
//! [`Engine::refit`] takes a training model's current weights in place (LoRA merged on the
//! fly); a [`WorkerPool`] runs several engines from one queue.
//!
//! Two forward passes serve the engine ([`ForwardPath`]): on the CPU, the model's weights are
//! copied into plain buffers and each step runs aligner-parallel's host kernels between `gemm`
//! products, with a KV cache whose rows keep their own lengths (no padding, no masks, no
//! per-step cache views); on other devices, the Burn model itself with a tensor KV cache.
//! Both give the same tokens (tested); the CPU path is several times faster on small models,
//! where a step's hundreds of tiny tensor ops cost more than their arithmetic.
//!
//! ```no_run
//! use aligner_core::{Device, LoadedModel};
//! use aligner_gen::{Engine, EngineOptions, GenerationRequest, SamplingParams};
//! let lm = LoadedModel::from_dir(&aligner_core::default_model_dir().unwrap(), &Device::flex()).unwrap();
//! let prompt_ids = lm.tokenizer.encode("Once upon a time", true).unwrap();
//! let request = GenerationRequest::new(prompt_ids, SamplingParams::greedy(32));
//! let mut engine = Engine::for_model(&lm, EngineOptions::default());
//! let out = engine.generate(&[request]).unwrap();
//! println!("{}", lm.tokenizer.decode(&out[0].token_ids, true).unwrap());
//! ```

mod engine;
pub mod env;
mod error;
pub mod frontier;
mod options;
mod pool;
mod process;
pub mod reward;
mod runner;
pub mod sampling;

pub use engine::{
    Engine, EngineOptions, FeedBounds, Generation, GenerationRequest, Guidance, RequestFeed, StopReason,
};
pub use error::{GenError, Result};
pub use frontier::{Frontier, FrontierSection};
pub use options::{EngineStats, ForwardPath};
pub use pool::{PoolReport, WorkerPool, WorkerReport};
pub use reward::{Reward, RewardError, RewardInput, RewardSpec, RewardSpecs, Rewards};
pub use sampling::SamplingParams;
