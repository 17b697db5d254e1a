//! What an engine runs and what it counts: shared by the engine and its forward passes (the
//! runners), which otherwise know nothing of each other's types.

/// Which forward pass an engine runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ForwardPath {
    /// The host kernels on the CPU (Flex), Burn's model elsewhere.
    #[default]
    Auto,
    /// The Burn model with a tensor KV cache: any device.
    Burn,
    /// aligner-parallel's host kernels over weights copied to plain buffers: the CPU.
    Host,
}

/// Counters of what an engine has done since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Batched forward passes of one token per running row.
    pub decode_steps: usize,
    /// Forward passes over newly admitted prompts.
    pub prefills: usize,
    /// Prompts admitted while other sequences were running (continuous batching).
    pub admitted_mid_batch: usize,
    /// Times the rows shifted left to make room at the end of the cache (Burn path: its rows
    /// share one write cursor).
    pub shifts: usize,
    /// Cache (re)allocations.
    pub allocations: usize,
    /// Cached positions a prompt took from the sequence it continues instead of computing
    /// them ([`crate::SamplingParams::keep_cache`]).
    pub reused_positions: usize,
}
