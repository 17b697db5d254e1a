//! PPO checkpoints: `checkpoints/step-N/` with the actor, its optimiser, the critic's state and
//! the run position, written to a temporary folder and renamed.

use std::path::{Path, PathBuf};

use aligner_core::{CausalLm, CoreError};
use burn::module::Module;
use burn::optim::ModuleOptimizer;

use crate::critic::CriticClient;
use crate::error::{PpoError, Result};
use crate::runner::{PpoRunner, PpoState};

impl PpoRunner<'_> {
    /// The newest complete checkpoint of the run.
    pub fn latest_checkpoint(out_dir: &Path) -> Option<(usize, PathBuf)> {
        let entries = std::fs::read_dir(out_dir.join("checkpoints")).ok()?;
        entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let step = e
                    .file_name()
                    .to_str()?
                    .strip_prefix("step-")?
                    .parse::<usize>()
                    .ok()?;
                e.path().join("ppo_state.json").exists().then(|| (step, e.path()))
            })
            .max_by_key(|(s, _)| *s)
    }

    /// `checkpoints/step-N/`: actor, its optimiser, critic, state — written to a temporary
    /// folder and renamed, so a crash leaves the previous checkpoint intact.
    pub(crate) fn save_checkpoint(
        &self,
        step: usize,
        actor: &CausalLm,
        optim: &ModuleOptimizer,
        critic: &dyn CriticClient,
    ) -> Result<()> {
        let dir = self.checkpoints();
        let final_dir = dir.join(format!("step-{step}"));
        let tmp = dir.join(format!(".tmp-step-{step}"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| CoreError::io(&tmp, e))?;
        // The critic saves while the actor writes its own part.
        let critic_saved = critic.save(tmp.join("critic"));
        self.store.save(&actor.valid(), &tmp.join("actor"))?;
        let bytes = optim
            .into_bytes()
            .map_err(|e| PpoError::Invalid(format!("optimizer state: {e:?}")))?;
        aligner_core::checkpoint::write_atomic(&tmp.join("actor_optimizer.bin"), &bytes)?;
        critic_saved.wait()?;
        let state = PpoState {
            step,
            seed: self.config.ppo.seed,
        };
        let json = serde_json::to_string_pretty(&state).expect("state serialises");
        aligner_core::checkpoint::write_atomic(&tmp.join("ppo_state.json"), json.as_bytes())?;
        let _ = std::fs::remove_dir_all(&final_dir);
        std::fs::rename(&tmp, &final_dir).map_err(|e| CoreError::io(&final_dir, e))?;
        Ok(())
    }
}
