//! # aligner-parallel
//!
//! The lowest layer of aligner. It knows nothing of models: it holds the numerical ops whose
//! memory or speed decide what fits on a device, and (later) the device mesh and the gradient
//! communicator that data-parallel training synchronises through.
//!
//! Its first occupant is [`token_logprobs`]: the log-probability of each target token under a
//! softmax over the vocabulary, computed a chunk of positions at a time so that the full
//! `[batch, seq, vocab]` log-softmax never exists at once. For 50k–150k vocabularies that tensor
//! (and its autodiff copies) dominates training memory. Every op here is built from plain Burn
//! tensor ops, so gradients come from Burn's autodiff on any backend; fused CubeCL kernels will
//! slot in behind the same functions.

pub mod fused;
mod logprob;

pub use fused::{fused_attention, fused_available, fused_swiglu, fused_token_logprobs};
pub use logprob::{DEFAULT_CHUNK_TOKENS, token_logprobs, token_logprobs_from_hidden};
