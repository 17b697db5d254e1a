//! Online DPO (Guo et al., 2024, "Direct Language Model Alignment from Online AI Feedback";
//! TRL's `OnlineDPOTrainer`): each step the current policy answers a batch of prompts twice, a
//! reward (a reward model or any `[[reward]]` function) picks the chosen and rejected answer of
//! each pair (ties are skipped), and one DPO step follows, the start model as the reference.
//!
//! Sampling goes through aligner-gen's engine, refit in place to the policy's weights before
//! each step; the loss is `[dpo]`'s (any registered preference loss), computed by the same
//! [`DpoObjective`] the offline runs use.

use std::path::PathBuf;

use aligner_core::checkpoint::write_json;
use aligner_core::data::EncodedPrompt;
use aligner_core::rm::RmConfig;
use aligner_core::run::{RunDir, data_files, progress_bar};
use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::start::{LoadedRewardModel, load_model, policy_store};
use aligner_core::train::grads::clip_grad_norm;
use aligner_core::train::{
    DataSection, EpochOrder, MetricsLog, ModelEval, ModelSection, Objective, adamw, load_optimizer,
    save_optimizer,
};
use aligner_core::{CausalLm, CoreError, Device};
use aligner_gen::reward::ModelReward;
use aligner_gen::{
    Engine, EngineOptions, Generation, GenerationRequest, RewardInput, RewardSpecs, Rewards, SamplingParams,
};
use burn::module::Module;
use burn::optim::GradientsParams;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::objective::{DpoExample, DpoObjective, DpoSection};
use crate::{DpoError, LossRegistry};

/// The file an online-DPO checkpoint writes last.
pub const ONLINE_STATE: &str = "online_dpo_state.json";

/// `[online]`: the sampling loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OnlineSection {
    /// Sample-and-update steps.
    pub steps: usize,
    /// Prompts per step (two answers each).
    pub prompts_per_step: usize,
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub lr: f64,
    pub max_grad_norm: f64,
    /// Held-out reward (and the frontier) every this many steps (0 = at the end only).
    pub eval_every: usize,
    /// Held-out prompts scored at each evaluation (0 = all).
    pub eval_prompts: usize,
    pub save_every: usize,
    /// Engine rows decoded together.
    pub slots: usize,
    pub seed: u64,
    pub tensorboard: bool,
}

impl Default for OnlineSection {
    fn default() -> Self {
        Self {
            steps: 24,
            prompts_per_step: 32,
            max_new_tokens: 48,
            temperature: 1.0,
            lr: 3e-4,
            max_grad_norm: 1.0,
            eval_every: 8,
            eval_prompts: 64,
            save_every: 8,
            slots: 64,
            seed: 0,
            tensorboard: true,
        }
    }
}

/// `[reward_model]` of online DPO: used when no `[[reward]]` is given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct OnlineRewardModel {
    /// HF sequence-classifier folder; empty = train one on the shipped preference pairs first.
    pub path: Option<PathBuf>,
}

/// `aligner online-dpo` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OnlineDpoConfig {
    pub model: ModelSection,
    pub reward_model: OnlineRewardModel,
    /// Prompt files (`{"prompt", ...fields a reward reads}`): train and held-out.
    pub data: DataSection,
    /// The preference loss (any registered one) and β.
    pub dpo: DpoSection,
    pub online: OnlineSection,
    /// Rewards as functions; empty: the reward model.
    #[serde(skip_serializing_if = "RewardSpecs::is_empty")]
    pub reward: RewardSpecs,
    pub frontier: aligner_gen::FrontierSection,
}

impl Default for OnlineDpoConfig {
    fn default() -> Self {
        Self {
            model: ModelSection::default(),
            reward_model: OnlineRewardModel::default(),
            data: DataSection::shipped("train.prompts.jsonl", "test.prompts.jsonl"),
            dpo: DpoSection::default(),
            online: OnlineSection::default(),
            reward: RewardSpecs::default(),
            frontier: aligner_gen::FrontierSection::shipped(),
        }
    }
}

/// Where a run stands; stored with each checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct OnlineState {
    step: usize,
}

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct OnlineDpoSummary {
    pub steps: usize,
    pub final_dir: PathBuf,
    pub initial_eval_reward: Option<f64>,
    pub final_eval_reward: Option<f64>,
}

/// A step's pairs: which of each prompt's two answers the reward prefers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preference {
    /// Index of the chosen answer in its pair (0 or 1).
    pub chosen: usize,
}

/// The pair `(a, b)`'s preference by reward, `None` for a tie (no signal to learn from).
pub fn prefer(a: f64, b: f64) -> Option<Preference> {
    if (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs())) {
        None
    } else {
        Some(Preference {
            chosen: if a > b { 0 } else { 1 },
        })
    }
}

/// An online-DPO run: the policy of `[model]` (LoRA when configured) trained into `run`.
pub fn train(
    config: &OnlineDpoConfig,
    registry: &LossRegistry,
    run: &RunDir,
    device: &Device,
) -> Result<OnlineDpoSummary, DpoError> {
    let loss = config.dpo.build_loss(registry)?;
    config.reward.check()?;
    let on = &config.online;
    aligner_core::train::check_counts(&[
        ("online.steps", on.steps),
        ("online.prompts_per_step", on.prompts_per_step),
        ("online.max_new_tokens", on.max_new_tokens),
    ])?;
    aligner_core::train::check_values(&[
        ("online.lr", on.lr, aligner_core::train::Range::Positive),
        (
            "online.temperature",
            on.temperature.into(),
            aligner_core::train::Range::NonNegative,
        ),
        (
            "online.max_grad_norm",
            on.max_grad_norm,
            aligner_core::train::Range::NonNegative,
        ),
    ])?;
    if run.comm().world_size() > 1 {
        return Err(DpoError::Invalid(
            "online DPO runs in one process (launch it without mpirun)".into(),
        ));
    }
    config.reward.check_unused_model(
        config.reward_model.path.as_deref(),
        "online DPO has no other use for it",
    )?;
    run.start_with_steps(config, &["reward_model"])?;
    let rewards = if config.reward.is_empty() {
        let dir = match &config.reward_model.path {
            Some(path) => path.clone(),
            None => run.earlier_step("reward_model", "config.json", |rm_run| {
                aligner_core::rm::train(&RmConfig::default(), rm_run, device).map(drop)
            })?,
        };
        let model = LoadedRewardModel::from_dir(&dir, device)?.model;
        Rewards::new(vec![(1.0, Box::new(ModelReward::new("reward", model, 32)))])
    } else {
        config.reward.build(device)?
    };
    let lm = load_model(&config.model, device)?;
    aligner_core::train::check_new_tokens(&[("online.max_new_tokens", on.max_new_tokens)], &lm.config)?;
    let frontier = config.frontier.for_start_model(&lm, device)?;
    let context = lm.config.max_position_embeddings;
    let (train_prompts, eval_prompts) = data_files(&config.data)?
        .load(|path, _| aligner_core::data::load_prompts(path, &lm.tokenizer, context))?;
    if train_prompts.is_empty() {
        return Err(DpoError::Invalid("no training prompts".into()));
    }
    // The start model is the reference (with LoRA: the base, which the adapters start from).
    let reference = lm.model.clone();
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device);
    let objective = DpoObjective {
        loss,
        sft_weight: config.dpo.sft_weight,
    };
    let train_device = device.clone().autodiff();
    let mut policy = model.fork(&train_device).train();
    let mut optim = adamw(0.0);
    let mut start = 0;
    run.prepare_checkpoints()?;
    if let Some((step, dir)) = run.resume_point(ONLINE_STATE)? {
        policy = store.load(&dir.join("policy"), &train_device)?.train();
        optim = load_optimizer(optim, &dir.join("optimizer.bin"))?;
        tracing::info!(step, dir = %dir.display(), "resuming");
        start = step;
    }
    let mut engine = Engine::new(
        policy.valid(),
        lm.config.clone(),
        Some(lm.tokenizer.clone()),
        EngineOptions {
            slots: on.slots,
            ..EngineOptions::default()
        },
    );
    let sampler = Sampler {
        config: on,
        tokenizer: &lm.tokenizer,
        rewards: &rewards,
    };
    let log = MetricsLog::for_run_with_tensorboard(run, run.is_resumed().then_some(start), on.tensorboard)?;
    let eval_limit = match on.eval_prompts {
        0 => eval_prompts.len(),
        n => n.min(eval_prompts.len()),
    };
    let eval_set: Vec<&EncodedPrompt> = eval_prompts[..eval_limit].iter().collect();
    let evaluate = |engine: &mut Engine, policy: &CausalLm| -> Result<Map<String, Value>, DpoError> {
        let mut out = Map::new();
        if !eval_set.is_empty() {
            engine.refit(policy)?;
            let (_, scores) = sampler.sample(engine, &eval_set, 1, 0xe7a1)?;
            out.insert("eval_reward".into(), mean(&scores).into());
        }
        if let Some(frontier) = &frontier {
            out.extend(ModelEval::evaluate(frontier, &policy.valid())?);
        }
        Ok(out)
    };
    // A resumed run reads its step-0 evaluation back from the log it kept.
    let mut initial = log.logged(0, "eval_reward")?;
    if start == 0 {
        let mut first = evaluate(&mut engine, &policy)?;
        initial = first.get("eval_reward").and_then(Value::as_f64);
        first.insert("step".into(), 0.into());
        log.write(&first)?;
    }
    let mut last = None;
    let bar = progress_bar(
        on.steps as u64,
        "online-dpo step {pos}/{len} {bar:30} {msg} [{elapsed} < {eta}]",
    );
    bar.set_position(start as u64);
    for step in start..on.steps {
        if run.stops_at(step) {
            bar.abandon();
            return Ok(OnlineDpoSummary {
                steps: step,
                final_dir: run.final_dir(),
                initial_eval_reward: initial,
                final_eval_reward: last,
            });
        }
        engine.refit(&policy)?;
        let prompts: Vec<&EncodedPrompt> = EpochOrder::new(train_prompts.len(), true, on.seed)
            .with_epoch_seed(|seed, epoch| seed.wrapping_add(epoch as u64))
            .items(step * on.prompts_per_step, on.prompts_per_step)
            .into_iter()
            .map(|i| &train_prompts[i])
            .collect();
        let seed = on
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(step as u64 * 100_000);
        let (sampled, scores) = sampler.sample(&mut engine, &prompts, 2, seed)?;
        let mut examples = Vec::new();
        for (pair, s) in sampled.chunks(2).zip(scores.chunks(2)) {
            if let Some(p) = prefer(s[0], s[1]) {
                let (c, r) = (p.chosen, 1 - p.chosen);
                examples.push(DpoExample {
                    chosen: pair[c].clone(),
                    rejected: pair[r].clone(),
                    reference: None,
                    rewards: Some((s[c] as f32, s[r] as f32)),
                });
            }
        }
        let mut row = Map::new();
        row.insert("step".into(), (step + 1).into());
        row.insert("reward".into(), mean(&scores).into());
        row.insert("pairs".into(), examples.len().into());
        row.insert("lr".into(), on.lr.into());
        if !examples.is_empty() {
            if objective.loss.uses_reference() {
                let seqs: Vec<ScoredSequence> = examples
                    .iter()
                    .flat_map(|e| [e.chosen.clone(), e.rejected.clone()])
                    .collect();
                let lp = response_logprobs(&reference, &seqs, 32)?;
                for (e, pair) in examples.iter_mut().zip(lp.chunks(2)) {
                    e.reference = Some((pair[0].total() as f32, pair[1].total() as f32));
                }
            }
            let batch: Vec<&DpoExample> = examples.iter().collect();
            let out = objective.step(&policy, &batch)?;
            let value = out.loss.clone().into_scalar::<f32>() as f64;
            if !value.is_finite() {
                return Err(DpoError::Invalid(format!(
                    "online DPO loss is {value} at step {}; the last good checkpoint is kept in {}",
                    step + 1,
                    run.checkpoints().display()
                )));
            }
            let mut grads = GradientsParams::from_grads(out.loss.backward(), &policy);
            let norm = clip_grad_norm(&policy, &mut grads, on.max_grad_norm);
            policy = optim.step(on.lr, policy, grads);
            row.insert("loss".into(), value.into());
            row.insert("grad_norm".into(), norm.into());
            for (k, v) in out.metrics {
                row.insert(k, v.into());
            }
        }
        let done = step + 1;
        if done == on.steps || (on.eval_every > 0 && done.is_multiple_of(on.eval_every)) {
            let eval = evaluate(&mut engine, &policy)?;
            last = eval.get("eval_reward").and_then(Value::as_f64).or(last);
            row.extend(eval);
        }
        bar.set_position(done as u64);
        bar.set_message(format!("reward {:.3}", mean(&scores)));
        log.write(&row)?;
        if on.save_every > 0 && done.is_multiple_of(on.save_every) && done < on.steps {
            run.save_checkpoint(done, |tmp| {
                store.save(&policy.valid(), &tmp.join("policy"))?;
                save_optimizer(&optim, &tmp.join("optimizer.bin"))?;
                write_json(&tmp.join(ONLINE_STATE), &OnlineState { step: done })
            })?;
        }
    }
    bar.finish_and_clear();
    run.write_shared(|| store.save(&policy.valid(), &run.final_dir()))?;
    Ok(OnlineDpoSummary {
        steps: on.steps,
        final_dir: run.final_dir(),
        initial_eval_reward: initial,
        final_eval_reward: last,
    })
}

/// Draws answers from the engine and scores them.
struct Sampler<'a> {
    config: &'a OnlineSection,
    tokenizer: &'a aligner_core::TextTokenizer,
    rewards: &'a Rewards,
}

impl Sampler<'_> {
    /// `n` answers per prompt (in prompt order) as scored sequences, and their rewards.
    fn sample(
        &self,
        engine: &mut Engine,
        prompts: &[&EncodedPrompt],
        n: usize,
        seed: u64,
    ) -> Result<(Vec<ScoredSequence>, Vec<f64>), DpoError> {
        let params = SamplingParams {
            temperature: self.config.temperature,
            seed,
            max_new_tokens: self.config.max_new_tokens,
            ..SamplingParams::default()
        };
        let requests = GenerationRequest::repeated(prompts.iter().map(|p| p.ids.as_slice()), n, &params);
        let outputs: Vec<Generation> = engine.generate(&requests)?;
        let texts: Vec<String> = requests
            .iter()
            .zip(&outputs)
            .map(|(r, o)| self.tokenizer.decode_continuation(&r.prompt_ids, &o.token_ids))
            .collect::<Result<_, CoreError>>()?;
        let inputs: Vec<RewardInput<'_>> = outputs
            .iter()
            .enumerate()
            .map(|(i, o)| {
                let p = prompts[i / n];
                RewardInput {
                    prompt: &p.text,
                    response: &texts[i],
                    prompt_ids: &p.ids,
                    response_ids: &o.token_ids,
                    stop_reason: o.stop_reason,
                    fields: &p.fields,
                }
            })
            .collect();
        let scores = self.rewards.score_parts(&inputs)?.total;
        let sequences = requests.iter().zip(&outputs).map(|(r, o)| o.scored(r)).collect();
        Ok((sequences, scores))
    }
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_higher_reward_is_chosen_and_ties_are_skipped() {
        assert_eq!(prefer(1.0, 0.0), Some(Preference { chosen: 0 }));
        assert_eq!(prefer(-2.0, 0.5), Some(Preference { chosen: 1 }));
        assert_eq!(prefer(1.0, 1.0), None);
        assert_eq!(prefer(0.0, 0.0), None);
    }
}
