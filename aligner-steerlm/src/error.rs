//! The error type of aligner-steerlm.

#[derive(Debug, thiserror::Error)]
pub enum SteerError {
    #[error("unknown attribute {name:?} (this model knows: {known})")]
    UnknownAttribute { name: String, known: String },
    #[error("attributes: {0}")]
    BadConditioning(String),
    #[error(transparent)]
    Generation(#[from] aligner_gen::GenError),
    #[error(transparent)]
    Core(#[from] aligner_core::CoreError),
}

pub type Result<T, E = SteerError> = std::result::Result<T, E>;
