//! # aligner-gen
//!
//! Generation for aligner: prompts in, sampled responses out, with the per-token log-probs a
//! trainer needs. A KV cache is allocated once per batch and written in place; prompts are
//! prefilled together and decoded a token a step; each request samples from its own seeded
//! random stream, so its output does not depend on the rest of the batch.
//!
//! ```no_run
//! use aligner_core::{Device, LoadedModel};
//! use aligner_gen::{GenerationRequest, Generator, SamplingParams};
//! let lm = LoadedModel::from_dir(&aligner_core::default_model_dir().unwrap(), &Device::flex()).unwrap();
//! let prompt_ids = lm.tokenizer.encode("Once upon a time", true).unwrap();
//! let request = GenerationRequest { prompt_ids, params: SamplingParams::greedy(32) };
//! let out = Generator::new(&lm.model, &lm.config, Some(&lm.tokenizer)).generate(&[request]).unwrap();
//! println!("{}", lm.tokenizer.decode(&out[0].token_ids, true).unwrap());
//! ```

mod engine;
mod error;
pub mod sampling;

pub use engine::{Generation, GenerationRequest, Generator, StopReason};
pub use error::{GenError, Result};
pub use sampling::SamplingParams;
