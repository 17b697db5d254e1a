//! `aligner dpo` as a library call: the typed configuration, the variant registry, a run folder
//! and a device in, the run's summary out.

use aligner_core::run::{RunDir, data_files};
use aligner_core::start::{load_model_split, policy_store};
use aligner_core::train::{ModelEval, RunSummary, fit_evaluated};
use aligner_core::{CoreError, Device};

use crate::objective::{DpoConfig, DpoObjective, attach_reference, load_dpo_examples};
use crate::{DpoError, LossRegistry};

/// A DPO-family run: `dpo.loss` built from `registry` (the built-ins, plus whatever variant
/// crates registered), the policy of `[model]` (LoRA adapters when configured) trained on
/// `data.train`'s pairs into `run`. The start model is the reference; its log-probs are
/// computed once before training and cached in the run folder (`reference_train.jsonl`,
/// `reference_validation.jsonl`), so a resumed run reuses them. Reference-free losses skip it.
pub fn train(
    config: &DpoConfig,
    registry: &LossRegistry,
    run: &RunDir,
    device: &Device,
) -> Result<RunSummary, DpoError> {
    // The loss (its name and knobs) is checked before the run folder is claimed.
    let loss = config.dpo.build_loss(registry)?;
    run.start(config)?;
    let files = data_files(&config.data)?;
    // In tensor groups, each rank reads only its blocks of the weights; the reference
    // log-probs are computed on the blocks, each group a share of the pairs.
    let (lm, run) = load_model_split(&config.model, &config.parallel, run, device)?;
    let run = &run;
    let frontier = config
        .frontier
        .for_split_start_model(&lm, &config.model, run, device)?;
    let max_len = config.data.max_len(&lm.config)?;
    let batch = config.train.batch_size.max(1) * 2;
    let (train, validation) = files.load(|path, split| {
        let mut examples = load_dpo_examples(path, &lm.tokenizer, max_len)?;
        if loss.uses_reference() {
            // With LoRA the reference is the base, which is the start model: adapters start at zero.
            let cache = run.join(format!("reference_{}.jsonl", split.name()));
            attach_reference(&mut examples, &lm.model, &cache, batch, run.comm())?;
        }
        Ok::<_, CoreError>(examples)
    })?;
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device)?;
    tracing::info!(
        train = train.len(),
        validation = validation.len(),
        loss = loss.name(),
        "DPO"
    );
    let objective = DpoObjective {
        loss,
        sft_weight: config.dpo.sft_weight,
    };
    Ok(fit_evaluated(
        model,
        &objective,
        (&train, &validation),
        store.as_ref(),
        &config.train,
        run,
        device,
        frontier.as_ref().map(|f| f as &dyn ModelEval<_>),
    )?)
}
