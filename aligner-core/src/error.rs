//! The error type of aligner-core.

use std::path::PathBuf;

/// Everything that can go wrong loading, running or saving a model.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error(
        "unsupported architecture {0:?}: aligner runs Llama-family models ({supported})",
        supported = crate::config::SUPPORTED_MODEL_TYPES.join(", ")
    )]
    UnsupportedArchitecture(String),
    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("tensor {name:?} is missing from the checkpoint in {dir}")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor {name:?} has dtype {dtype}; aligner loads F32, F16 and BF16")]
    UnsupportedDtype { name: String, dtype: String },
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("{path}: {message}")]
    Llama2c { path: PathBuf, message: String },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Comm(#[from] aligner_parallel::CommError),
    /// A folder given as a trained reward or attribute model that has no score head (a causal
    /// LM's folder): loaded, it would score every sample 0.
    #[error(
        "{dir} is not a reward model: its config.json names {architectures}, not a \
         *ForSequenceClassification, so it has no trained score head and every sample would \
         score 0; give the `final/` folder of an `aligner rm` run (or another sequence classifier)"
    )]
    NotARewardModel { dir: PathBuf, architectures: String },
    #[error("{0}")]
    Invalid(String),
}

/// A data line that could not be used: file, line number (from 1) and why.
#[derive(Debug, thiserror::Error)]
#[error("{path}:{line}: {message}")]
pub struct DataError {
    pub path: PathBuf,
    pub line: usize,
    pub message: String,
}

/// Result alias for aligner-core.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;

impl CoreError {
    /// An I/O error that names the file or folder.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// An I/O error while writing, creating, renaming or removing: names the file or folder.
    pub fn cannot_write(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Write {
            path: path.into(),
            source,
        }
    }
}
