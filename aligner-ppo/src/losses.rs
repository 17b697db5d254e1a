//! PPO's clipped objectives and the GRPO family's variations on them, as pure functions on
//! `[batch, tokens]` log-probs: they live in [`aligner_loss::policy`], where every method that
//! trains a policy by its gradient (on-policy distillation among them) finds them without
//! depending on this crate.

pub use aligner_loss::policy::*;
