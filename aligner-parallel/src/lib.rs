//! # aligner-parallel
//!
//! The lowest layer of aligner. It knows nothing of models: it holds the numerical ops whose
//! memory or speed decide what fits on a device, and the [`comm`] process group that
//! data-parallel training synchronises through ([`Communicator`]: [`Single`] by default, MPI
//! with the `mpi` feature; [`launch`] starts it, [`world`] reads it).
//!
//! Its first occupant is [`token_logprobs`]: the log-probability of each target token under a
//! softmax over the vocabulary, computed a chunk of positions at a time so that the full
//! `[batch, seq, vocab]` log-softmax never exists at once. For 50k–150k vocabularies that tensor
//! (and its autodiff copies) dominates training memory. It is built from plain Burn tensor ops,
//! so gradients come from Burn's autodiff on any backend.
//!
//! On the CPU, training runs the [`fused`] ops instead: the vocabulary projection + log-softmax +
//! gather ([`fused_token_logprobs`]), grouped-query attention ([`fused_attention`]), the
//! SwiGLU of the MLP ([`fused_swiglu`]) and RMS norm ([`fused_rms_norm`]), each one autodiff node with a hand-written backward,
//! registered as a Burn backend extension for Flex and autodiff-over-Flex. Their loops are
//! compiled for AVX-512 / AVX2 at run time and their products go through `gemm`'s AVX-512
//! kernels. `tests/fused.rs` checks values and gradients against the composed ops.
//!
//! Inference (aligner-gen's CPU path) has its own kernels in [`fused::infer`] — RMS norm,
//! SwiGLU, RoPE, and ragged grouped-query attention reading a KV cache in place — and
//! [`fused::panels::ColumnPanels`], the layout of the output projection; `tests/infer.rs`
//! checks each against the composed ops, and `examples/` time the two layouts.
//!
//! [`shard`] holds the ops of fully sharded parameters (ZeRO-3) and [`tensor`] those of tensor
//! parallel (Megatron's `f` and `g`, the vocabulary-parallel token log-probs), each a Burn
//! backend extension with a hand-written backward; `tests/shard.rs` and `tests/tensor.rs` check
//! them against the ops they stand for; [`vocab`] holds distributions over a vocabulary split
//! over a tensor group (the distillation losses' log-softmax, sums and picks). [`overlap`] sums data-parallel gradients in buckets
//! while the backward pass goes on (its hook is one more such op).

pub mod comm;
pub mod fused;
mod logprob;
pub mod overlap;
mod registry;
pub mod shard;
pub mod tensor;
pub mod vocab;

pub use comm::{
    CommError, Communicator, Grid, Launch, ReduceOp, Single, Traffic, WorkQueue, launch, launched_by_mpi,
    shard_range, world,
};
pub use fused::{
    cube_kernels_available, flash_attention, flash_attention_available, fused_attention, fused_available,
    fused_rms_norm, fused_rope, fused_swiglu, fused_token_logprobs, use_burn_attention,
};
pub use logprob::{DEFAULT_CHUNK_TOKENS, soft_cap, token_logprobs, token_logprobs_from_hidden};
