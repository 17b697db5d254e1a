//! The error type of aligner-ppo.

/// What can go wrong in a PPO run.
#[derive(Debug, thiserror::Error)]
pub enum PpoError {
    #[error(transparent)]
    Core(#[from] aligner_core::CoreError),
    #[error(transparent)]
    Gen(#[from] aligner_gen::GenError),
    #[error(transparent)]
    Reward(#[from] aligner_gen::RewardError),
    #[error("critic: {0}")]
    Critic(String),
    #[error(
        "the critic server at {url} did not answer for {seconds:.0} s ({last}); the run stopped. \
         Restart the server and continue with --resume; the last checkpoint is in {checkpoints}"
    )]
    CriticUnreachable {
        url: String,
        seconds: f64,
        last: String,
        checkpoints: String,
    },
    /// `ppo.stop_after_flat_steps` steps in a row whose samples carried no learning signal.
    #[error(
        "{steps} steps in a row taught the policy nothing: {why}. The run stopped \
         (ppo.stop_after_flat_steps = {steps}); the last checkpoint is in {checkpoints}"
    )]
    NoSignal {
        steps: usize,
        why: String,
        checkpoints: String,
    },
    #[error("{0}")]
    Invalid(String),
}

/// Result alias for aligner-ppo.
pub type Result<T, E = PpoError> = std::result::Result<T, E>;
