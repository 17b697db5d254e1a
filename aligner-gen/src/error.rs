//! The error type of aligner-gen.

/// What can go wrong generating.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error("prompt {0} is empty (it needs at least a BOS token)")]
    EmptyPrompt(usize),
    #[error("a prompt of {tokens} tokens leaves no room in the model's context of {max}")]
    PromptTooLong { tokens: usize, max: usize },
    #[error("stop strings need a tokenizer to decode the response")]
    StopStringsNeedTokenizer,
    #[error("refit with a model of {got} parameters; the engine's model has {have}")]
    RefitMismatch { have: usize, got: usize },
    #[error("engines on different forward paths (Burn and host) cannot share weights")]
    MixedForwardPaths,
    #[error("a guided request needs two cache rows (slots / --batch-size of at least 2)")]
    GuidanceNeedsTwoSlots,
    #[error("request {request}: {why}")]
    BadSampling { request: usize, why: String },
    #[error("request {request}: a guidance scale is a finite number of at least 0, not {scale}")]
    BadGuidanceScale { request: usize, scale: f32 },
    #[error("generation worker {0} panicked")]
    WorkerPanicked(usize),
    #[error(transparent)]
    Reward(#[from] crate::reward::RewardError),
    #[error(transparent)]
    Core(#[from] aligner_core::CoreError),
}

/// Result alias for aligner-gen.
pub type Result<T, E = GenError> = std::result::Result<T, E>;

/// For callers that report core errors only (a trainer's model evaluation): a core error is
/// itself, anything else its message.
impl From<GenError> for aligner_core::CoreError {
    fn from(e: GenError) -> Self {
        match e {
            GenError::Core(core) => core,
            other => aligner_core::CoreError::Invalid(other.to_string()),
        }
    }
}
