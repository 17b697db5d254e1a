//! The actor's loop: rollout → log-probs and critic values → rewards with the KL penalty →
//! advantages → clipped policy updates, with the critic working alongside.

use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

use aligner_core::data::EncodedPrompt;
use aligner_core::model::recompute::{self, LayerRecompute};
use aligner_core::parallel::map_sharded;
use aligner_core::run::RunDir;
use aligner_core::train::{
    CheckpointLayout, LoopSettings, Method, ModelStore, Optimizer, Stepped, mini_batches, run_loop,
};
use aligner_core::{CausalLm, CoreError, LlamaConfig, TextTokenizer};
use aligner_gen::{Engine, EngineOptions, Generation, Rewards, StopReason, WorkerPool};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::advantages::{
    Advantage, gae, gae_over_own_tokens, group_advantages, kl_per_token, missing_signal, reinforce_pp,
    token_rewards, truncated_is_weights, whiten,
};
use crate::config::{NonEos, PpoConfig};
use crate::critic::{CriticClient, CriticSettings, InferReply, TrainRequest};
use crate::error::{PpoError, Result};
use crate::losses::{LogprobMismatch, LossAgg, entropy, logprob_mismatch, masked_token_mean, policy_loss};
use crate::rollout::{Layout, Packed, Sequence, padding_fractions};
use crate::sampler::{Rollout, Sampler};
pub use crate::timing::StepTimes;
use aligner_parallel::{ReduceOp, shard_range};

/// The file a PPO checkpoint writes last (its presence marks the checkpoint complete).
pub const PPO_STATE: &str = "ppo_state.json";

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct PpoSummary {
    pub steps: usize,
    pub final_dir: PathBuf,
    pub initial_eval_reward: Option<f64>,
    pub final_eval_reward: Option<f64>,
    pub mean_times: StepTimes,
}

/// One PPO run of the actor.
pub struct PpoRunner<'a> {
    pub config: &'a PpoConfig,
    pub llama: &'a LlamaConfig,
    pub tokenizer: &'a TextTokenizer,
    /// Prompts with their rows' other fields (what reward functions read).
    pub train_prompts: &'a [EncodedPrompt],
    pub eval_prompts: &'a [EncodedPrompt],
    /// Saves and loads the actor (full weights or LoRA adapters).
    pub store: &'a dyn ModelStore<CausalLm>,
    /// The run folder: a new run, or one resumed from its newest checkpoint.
    pub run: &'a RunDir,
    pub device: Device,
    /// The rewards the actor computes itself (functions, commands, endpoints, a reward model
    /// beside the actor); `None` when the critic's process holds the reward model.
    pub reward: Option<&'a Rewards>,
    /// The reward–KL figures of the actor's samples against the start model, at every
    /// validation (rank 0).
    pub frontier: Option<&'a aligner_gen::Frontier>,
    /// `[environment]`: episodes of several turns instead of one answer per prompt.
    pub env: Option<&'a dyn aligner_gen::env::Environment>,
}

/// What the actor's update reports (means over its mini-batches).
struct ActorStats {
    clip_fraction: f64,
    approx_kl: f64,
    policy_loss: f64,
    entropy: Option<f64>,
    /// The engine's log-probs against the actor's before its first update (this rank's
    /// first mini-batch).
    mismatch: Option<LogprobMismatch>,
}

/// One-step-off sampling: the next step's samples, drawn on another thread from the weights
/// the current step starts with, while it trains.
enum Ahead<'scope> {
    Drawing(std::thread::ScopedJoinHandle<'scope, (WorkerPool, Result<Rollout>, f64)>),
    /// Drawn (the thread joined early, to free the engines for an evaluation).
    Drawn(Result<Rollout>, f64),
}

impl Ahead<'_> {
    /// The samples and the seconds drawing them took, the engines handed back to `pool`.
    fn land(self, pool: &mut Option<WorkerPool>) -> Result<(Result<Rollout>, f64)> {
        match self {
            Ahead::Drawing(handle) => {
                let (engines, rollout, seconds) = handle
                    .join()
                    .map_err(|_| PpoError::Invalid("the generation thread panicked".into()))?;
                *pool = Some(engines);
                Ok((rollout, seconds))
            }
            Ahead::Drawn(rollout, seconds) => Ok((rollout, seconds)),
        }
    }
}

/// The engines, which one-step-off sampling lends to its thread between steps.
fn engines(pool: &mut Option<WorkerPool>) -> Result<&mut WorkerPool> {
    pool.as_mut()
        .ok_or_else(|| PpoError::Invalid("the generation engines were not handed back".into()))
}

/// A rollout after scoring: everything the updates need, one entry per sequence.
struct Scored {
    sequences: Vec<Sequence>,
    old_logprobs: Vec<Vec<f32>>,
    advantages: Vec<Vec<f32>>,
    old_values: Vec<Vec<f32>>,
    returns: Vec<Vec<f32>>,
}

impl PpoRunner<'_> {
    /// What drawing samples needs of this run (`Sync`: a one-step-off run samples on another
    /// thread).
    fn sampler(&self) -> Sampler<'_> {
        Sampler {
            config: self.config,
            tokenizer: self.tokenizer,
            train_prompts: self.train_prompts,
            reward: self.reward,
            env: self.env,
            run: self.run,
        }
    }

    /// Steps of the whole run.
    fn steps(&self) -> usize {
        self.config.total_steps(self.train_prompts.len())
    }

    fn checkpoints(&self) -> PathBuf {
        self.run.checkpoints()
    }

    /// Trains `actor` (LoRA already attached when configured), or, when the run is resumed,
    /// continues from its newest checkpoint, in the shared training loop
    /// ([`aligner_core::train::run_loop`]): this crate supplies the step (sample, score, update)
    /// and the evaluation.
    ///
    /// Data parallel: every rank's engine takes rollout requests a batch at a time from one
    /// queue (a rank whose responses come out short takes more), the rollout is gathered on
    /// every rank, and each actor mini-batch is split over the ranks with its gradients summed.
    /// `critic` is rank 0's alone (`None` on the others): rank 0 asks it and shares the replies.
    pub fn run(&self, actor: CausalLm, critic: Option<&dyn CriticClient>) -> Result<PpoSummary> {
        let cfg = &self.config.ppo;
        self.config.check()?;
        if self.train_prompts.is_empty() {
            return Err(PpoError::Invalid("no training prompts".into()));
        }
        if cfg.one_step_off && self.run.comm().world_size() > 1 {
            return Err(PpoError::Invalid(
                "ppo.one_step_off samples on a second thread of one process; run it without mpirun".into(),
            ));
        }
        let train_device = self.config.train.autodiff_device(&self.device);
        let lora = self.config.model.lora_rank > 0;
        let actor = aligner_core::train::config::to_train_device(actor, &train_device);
        // Without LoRA the reference is a frozen copy of the starting policy; with LoRA it is
        // the same weights with the adapters switched off (the base does not train), kept as
        // a copy only when it is offloaded to the CPU.
        // In tensor groups the actor arrives as this rank's blocks. Beside a split engine the
        // reference is those blocks too (its log-probs are computed by the group); beside an
        // engine that generates with the whole model, the reference is whole as well, so the
        // log-probs are one process's to the bit.
        let start = || match self.run.tensor_group().filter(|_| !cfg.split_engine) {
            Some(_) => aligner_core::train::tensor::gather_parameters(&actor).valid(),
            None => actor.valid(),
        };
        let reference = match (lora, cfg.offload_reference) {
            (false, false) => Some(start()),
            (true, false) => None,
            (_, true) => {
                let mut frozen = start();
                frozen.model.set_adapters_enabled(false);
                // A copy the host owns: a fork would keep device buffers (`copied_to_host`).
                let mut frozen = aligner_core::model::copied_to_host(frozen);
                // The host computes in f32 whatever the actor's type on the device.
                frozen.model.precision = aligner_core::config::Precision::F32;
                Some(frozen)
            }
        };
        let layout = CheckpointLayout {
            state: PPO_STATE,
            model: "actor",
            optimizer: "actor_optimizer.bin",
        };
        let settings = LoopSettings {
            layout,
            label: "ppo step",
            ..LoopSettings::from_train(&self.config.train, self.steps())
        };
        let (summary, step) = std::thread::scope(|scope| {
            let mut step = PpoStep {
                runner: self,
                critic,
                reference,
                scope,
                pool: None,
                ahead: None,
                totals: StepTimes::default(),
                steps_run: 0,
                flat_steps: 0,
                last_eval: None,
            };
            let (_, summary) = run_loop(&mut step, actor, self.store, &settings, self.run, &train_device)?;
            // Samples still being drawn when the run stopped early are waited for, and unused.
            if let Some(drawing) = step.ahead.take() {
                let _unused = drawing.land(&mut step.pool)?;
            }
            Ok::<_, PpoError>((summary, (step.totals, step.steps_run, step.last_eval)))
        })?;
        let (totals, steps_run, last_eval) = step;
        Ok(PpoSummary {
            steps: summary.steps,
            final_dir: summary.final_dir,
            initial_eval_reward: summary
                .initial_eval
                .and_then(|eval| eval.get("eval_reward").and_then(Value::as_f64)),
            final_eval_reward: last_eval,
            mean_times: totals.mean(steps_run),
        })
    }

    /// The frontier figures of `actor` (rank 0 measures them; the others log nothing).
    fn frontier_metrics(&self, actor: &CausalLm) -> Result<Map<String, Value>> {
        match self.frontier.filter(|_| self.run.is_writer()) {
            Some(frontier) => Ok(aligner_core::train::ModelEval::evaluate(
                frontier,
                &actor.valid(),
            )?),
            None => Ok(Map::new()),
        }
    }

    fn reference_logprobs(
        &self,
        actor: &CausalLm,
        reference: Option<&CausalLm>,
        sequences: &[Sequence],
    ) -> Result<Vec<Vec<f32>>> {
        let model = match reference {
            Some(r) => r.clone(),
            None => {
                let mut base = actor.valid();
                base.model.set_adapters_enabled(false);
                base
            }
        };
        // The model's own device: `valid()` of an actor trained with activation checkpointing
        // keeps that setting, and Burn refuses to mix it with tensors made without it.
        let device = model.model.embed_tokens.weight.device();
        // Data parallel: each rank scores its shard of the rollout.
        map_sharded(self.run.comm(), sequences, |mine| {
            let mut out = Vec::with_capacity(mine.len());
            for chunk in mine.chunks(self.config.ppo.mini_batch.max(1)) {
                let layout = Layout::new(chunk, &device);
                let lp = match self.config.ppo.pack_sequences {
                    true => {
                        let packed = Packed::new(chunk, &device);
                        packed.response_columns(model.token_logprobs_with(
                            packed.tokens.clone(),
                            &packed.positions,
                            Some(&packed.mask),
                        ))
                    }
                    false => layout.response_columns(model.token_logprobs_with(
                        layout.tokens.clone(),
                        &layout.positions,
                        Some(&layout.mask),
                    )),
                };
                out.extend(layout.ragged(lp));
            }
            Ok::<_, PpoError>(out)
        })
    }

    /// Rank 0's `value` (a critic reply only rank 0 asked for) on every rank.
    fn shared_by_root<T: Serialize + DeserializeOwned>(&self, value: Option<T>) -> Result<T> {
        self.run
            .agree(&value)?
            .ok_or_else(|| PpoError::Critic("rank 0 holds no critic".into()))
    }

    /// Rewards, KL penalty, advantages and returns of a rollout; the step's metrics; why its
    /// samples teach nothing, when they do not.
    fn score(
        &self,
        sequences: Vec<Sequence>,
        generations: &[Generation],
        ref_logprobs: &[Vec<f32>],
        trainer_old: Option<Vec<Vec<f32>>>,
        critic_out: InferReply,
        scores: Vec<f32>,
    ) -> Result<(Scored, Map<String, Value>, Option<String>)> {
        let cfg = &self.config.ppo;
        if scores.len() != sequences.len() {
            return Err(PpoError::Critic(format!(
                "{} rewards for {} sequences (is a reward model loaded where the rewards are computed?)",
                scores.len(),
                sequences.len()
            )));
        }
        let ended: Vec<bool> = generations
            .iter()
            .map(|g| g.stop_reason == StopReason::Eos)
            .collect();
        let engine_logprobs: Vec<Vec<f32>> = generations.iter().map(|g| g.token_logprobs.clone()).collect();
        // π_old: the engine's log-probs, or (truncated importance sampling) the actor's own,
        // each token's advantage then weighted by min(π_old / π_engine, tis_cap).
        let is_weights: Option<Vec<Vec<f32>>> = trainer_old.as_ref().map(|trainer| {
            trainer
                .iter()
                .zip(&engine_logprobs)
                .zip(&sequences)
                .map(|((t, e), s)| {
                    let mut w = truncated_is_weights(t, e, cfg.tis_cap as f32);
                    for (j, w) in w.iter_mut().enumerate() {
                        if s.is_observed(j) {
                            *w = 1.0;
                        }
                    }
                    w
                })
                .collect()
        });
        let old_logprobs = trainer_old.unwrap_or(engine_logprobs);
        // The environment's tokens carry no KL: the model did not choose them.
        let kls: Vec<Vec<f32>> = old_logprobs
            .iter()
            .zip(ref_logprobs)
            .zip(&sequences)
            .map(|((lp, lr), s)| {
                let mut kl = kl_per_token(lp, lr, cfg.kl_estimator);
                for (j, k) in kl.iter_mut().enumerate() {
                    if s.is_observed(j) {
                        *k = 0.0;
                    }
                }
                kl
            })
            .collect();
        let values = critic_out.values;
        let (mut advantages, returns): (Vec<Vec<f32>>, Vec<Vec<f32>>) = match cfg.advantage {
            // GAE over the model's own tokens: an episode's observations are skipped (the
            // next model token's value follows the last one's), their entries left at 0.
            Advantage::Gae => scores
                .iter()
                .zip(&kls)
                .zip(&values)
                .zip(&sequences)
                .map(|(((&s, kl), v), seq)| {
                    let observed: Vec<bool> = (0..kl.len()).map(|j| seq.is_observed(j)).collect();
                    gae_over_own_tokens(
                        &observed,
                        |kl, v| gae(&token_rewards(s, kl, cfg.kl_coef), v, cfg.gamma, cfg.lam),
                        kl,
                        v,
                    )
                })
                .unzip(),
            // Normalised over the batch that trains (after non-EOS exclusion, below).
            Advantage::ReinforcePp => (Vec::new(), values.clone()),
            mode => {
                let totals: Vec<f32> = scores
                    .iter()
                    .zip(&kls)
                    .map(|(&s, kl)| s - cfg.kl_coef * kl.iter().sum::<f32>())
                    .collect();
                let adv = group_advantages(&totals, cfg.samples_per_prompt, mode);
                let per_token = adv.iter().zip(&kls).map(|(&a, kl)| vec![a; kl.len()]).collect();
                (per_token, values.clone())
            }
        };
        let keep: Vec<usize> = (0..sequences.len())
            .filter(|&i| cfg.non_eos != NonEos::Exclude || ended[i])
            .collect();
        let pick = |rows: &[Vec<f32>]| keep.iter().map(|&i| rows[i].clone()).collect::<Vec<_>>();
        if cfg.advantage == Advantage::ReinforcePp {
            let kept_scores: Vec<f32> = keep.iter().map(|&i| scores[i]).collect();
            advantages = reinforce_pp(&kept_scores, &pick(&kls), cfg.kl_coef, cfg.gamma);
        } else {
            let mut kept_adv = pick(&advantages);
            if cfg.whiten_advantages && cfg.advantage == Advantage::Gae {
                whiten(&mut kept_adv);
            }
            advantages = kept_adv;
        }
        let mut tis = Vec::new();
        if let Some(weights) = &is_weights {
            let kept = pick(weights);
            for (adv, w) in advantages.iter_mut().zip(&kept) {
                adv.iter_mut().zip(w).for_each(|(a, w)| *a *= w);
            }
            let own: Vec<f32> = keep
                .iter()
                .flat_map(|&i| {
                    let sequence = &sequences[i];
                    weights[i]
                        .iter()
                        .enumerate()
                        .filter(move |(j, _)| !sequence.is_observed(*j))
                        .map(|(_, &w)| w)
                })
                .collect();
            let capped = own.iter().filter(|&&w| w >= cfg.tis_cap as f32).count();
            tis.push(("tis/weight_mean", mean(&own)));
            tis.push(("tis/capped_fraction", capped as f64 / own.len().max(1) as f64));
        }
        let flat = missing_signal(&scores, keep.len(), cfg.samples_per_prompt, cfg.advantage);
        let mut metrics = row(&[
            (
                "kl",
                mean(&kls.iter().map(|k| k.iter().sum::<f32>()).collect::<Vec<_>>()),
            ),
            (
                "response_length",
                mean(
                    &generations
                        .iter()
                        .map(|g| g.token_ids.len() as f32)
                        .collect::<Vec<_>>(),
                ),
            ),
            (
                "eos_fraction",
                ended.iter().filter(|&&e| e).count() as f64 / ended.len().max(1) as f64,
            ),
        ]);
        metrics.extend(row(&tis));
        let (padded, packed) = padding_fractions(&sequences, cfg.mini_batch);
        metrics.extend(row(&[("padding/padded", padded), ("padding/packed", packed)]));
        let scored = Scored {
            sequences: keep.iter().map(|&i| sequences[i].clone()).collect(),
            old_logprobs: pick(&old_logprobs),
            advantages,
            old_values: pick(&values),
            returns: pick(&returns),
        };
        Ok((scored, metrics, flat))
    }

    /// `ppo.epochs` passes of the clipped policy loss (minus `ppo.entropy_coef` × entropy).
    ///
    /// Data parallel: each rank takes its shard of every mini-batch, weighted by its share of
    /// the response tokens the losses are means over, and the gradients are summed over ranks
    /// before clipping, so the update is the one of the whole mini-batch.
    fn update_actor(
        &self,
        mut actor: CausalLm,
        optim: &mut Optimizer<'_>,
        scored: &Scored,
        lr: f64,
    ) -> Result<(CausalLm, ActorStats)> {
        let cfg = &self.config.ppo;
        // The device the actor's weights are on (with its activation checkpointing setting).
        let device = actor.model.embed_tokens.weight.device();
        let n = scored.sequences.len();
        let comm = self.run.comm();
        let (rank, world) = (comm.rank(), comm.world_size());
        // The model's own tokens: an environment's observations are outside every loss.
        let tokens =
            |r: Range<usize>| -> usize { scored.sequences[r].iter().map(Sequence::own_tokens).sum() };
        let (mut clip, mut kl, mut loss_sum, mut batches) = (0.0, 0.0, 0.0, 0usize);
        let mut mismatch = None;
        let mut entropy_sum = 0.0;
        let _recompute = LayerRecompute::arm(
            self.config.train.activation_checkpointing == aligner_core::train::Checkpointing::Layers,
        );
        for range in mini_batches(n, cfg.mini_batch, cfg.epochs) {
            let shard = shard_range(range.len(), rank, world);
            let mine = range.start + shard.start..range.start + shard.end;
            // The loss is a mean over tokens, or over sequences (the other aggregations).
            let by_tokens = cfg.loss_agg == LossAgg::TokenMean;
            let share = match (world, tokens(range.clone())) {
                (1, _) => 1.0,
                _ if !by_tokens => mine.len() as f64 / range.len().max(1) as f64,
                (_, 0) => 1.0 / world as f64,
                (_, all) => tokens(mine.clone()) as f64 / all as f64,
            };
            // loss, clip fraction, approximate KL, entropy
            let mut stats = [0.0f64; 4];
            let mut grads = GradientsParams::new();
            optim.begin_pass(&actor, true)?;
            // Fully sharded, each pass gathers and reduce-scatters with the other ranks': a rank
            // without rows here still runs one, on the mini-batch's first row, at weight 0.
            let idle = mine.is_empty();
            let rows = match idle && optim.full() {
                true => range.start..range.start + 1,
                false => mine,
            };
            if !rows.is_empty() {
                // Before the first update the actor is the policy that sampled: its log-probs
                // against the engine's are the rollout/trainer mismatch.
                let measure = batches == 0 && !idle;
                // A mixture of experts' load-balancing term joins the loss, as in training.
                let (result, router_loss) = aligner_core::model::with_router_loss(|| {
                    self.actor_loss(&actor, scored, rows, &device, measure)
                });
                let (mut loss, values, measured) = result?;
                if let Some(term) = router_loss {
                    loss = loss + term;
                }
                if !idle {
                    stats = values;
                }
                mismatch = mismatch.or(measured);
                let loss = match (world > 1, idle) {
                    (_, true) => loss.mul_scalar(0.0),
                    (true, false) => loss.mul_scalar(share),
                    (false, false) => loss,
                };
                grads = recompute::gradients(loss, &actor);
            }
            if world > 1 {
                stats.iter_mut().for_each(|s| *s *= share);
                comm.all_reduce_f64(&mut stats, ReduceOp::Sum)
                    .map_err(CoreError::from)?;
            }
            let [value, clip_fraction, approx_kl, h] = stats;
            if !value.is_finite() {
                return Err(PpoError::Invalid(format!(
                    "policy loss is {value}; stopping. The last good checkpoint is kept in {}",
                    self.checkpoints().display()
                )));
            }
            loss_sum += value;
            clip += clip_fraction;
            kl += approx_kl;
            entropy_sum += h;
            batches += 1;
            actor = optim.step(lr, actor, grads)?.0;
        }
        let b = batches.max(1) as f64;
        let stats = ActorStats {
            clip_fraction: clip / b,
            approx_kl: kl / b,
            policy_loss: loss_sum / b,
            entropy: (cfg.entropy_coef > 0.0).then_some(entropy_sum / b),
            mismatch,
        };
        Ok((actor, stats))
    }

    /// The clipped policy loss (minus the entropy bonus) of sequences `rows` of a rollout, and
    /// its logged values: loss, clip fraction, approximate KL, entropy.
    fn actor_loss(
        &self,
        actor: &CausalLm,
        scored: &Scored,
        rows: Range<usize>,
        device: &Device,
        measure_mismatch: bool,
    ) -> Result<(Tensor<1>, [f64; 4], Option<LogprobMismatch>)> {
        let cfg = &self.config.ppo;
        let (start, end) = (rows.start, rows.end);
        let layout = Layout::new(&scored.sequences[start..end], device);
        let old = layout.padded(&scored.old_logprobs[start..end], device);
        let adv = layout.padded(&scored.advantages[start..end], device);
        // One trunk pass serves the log-probs and, with an entropy bonus, the entropy of the
        // response positions' full distributions; over packed rows or the padded layout.
        let packed = cfg
            .pack_sequences
            .then(|| Packed::new(&scored.sequences[start..end], device));
        let (tokens, positions, mask, valid) = match &packed {
            Some(p) => (&p.tokens, &p.positions, &p.mask, &p.valid),
            None => (&layout.tokens, &layout.positions, &layout.mask, &layout.valid),
        };
        let hidden = aligner_core::model::with_valid_tokens(valid.clone(), || {
            actor.model.forward(tokens.clone(), positions, Some(mask), None)
        });
        let [rows, width, d] = hidden.dims();
        let inputs = hidden
            .clone()
            .narrow(1, 0, width - 1)
            .reshape([rows, width - 1, d]);
        let targets = tokens.clone().narrow(1, 1, width - 1);
        let lp = actor.token_logprobs_of_hidden(inputs.clone(), targets);
        let lp = match &packed {
            Some(p) => p.response_columns(lp),
            None => layout.response_columns(lp),
        };
        let mismatch = measure_mismatch.then(|| {
            // The model's own tokens only: an observation's log-prob is no one's sample.
            let own = |rows: &[Vec<f32>]| -> Vec<Vec<f32>> {
                rows.iter()
                    .zip(&scored.sequences[start..end])
                    .map(|(row, s)| {
                        row.iter()
                            .enumerate()
                            .filter(|(j, _)| !s.is_observed(*j))
                            .map(|(_, &v)| v)
                            .collect()
                    })
                    .collect()
            };
            let trainer = layout.ragged(lp.clone().detach());
            logprob_mismatch(&own(&scored.old_logprobs[start..end]), &own(&trainer))
        });
        let mut out = policy_loss(lp, old, adv, &layout.response_mask, &cfg.policy_loss());
        let mut entropy_value = 0.0;
        if cfg.entropy_coef > 0.0 {
            let states = match &packed {
                Some(p) => p.response_states(inputs),
                None => hidden.narrow(1, layout.prompt_width - 1, layout.response_width),
            };
            let h = masked_token_mean(entropy(actor.logits_from_hidden(states)), &layout.response_mask);
            entropy_value = h.clone().into_scalar::<f32>() as f64;
            out.loss = out.loss - h.mul_scalar(cfg.entropy_coef);
        }
        let value = out.loss.clone().into_scalar::<f32>() as f64;
        Ok((
            out.loss,
            [value, out.clip_fraction, out.approx_kl, entropy_value],
            mismatch,
        ))
    }

    /// Mean reward (the weighted sum of the rewards, unshaped) of the policy's samples on the
    /// held-out prompts.
    fn evaluate(
        &self,
        pool: &mut WorkerPool,
        actor: &CausalLm,
        critic: Option<&dyn CriticClient>,
    ) -> Result<f64> {
        let limit = match self.config.ppo.eval_prompts {
            0 => self.eval_prompts.len(),
            n => n.min(self.eval_prompts.len()),
        };
        pool.refit(actor)?;
        let prompts: Vec<&EncodedPrompt> = self.eval_prompts[..limit].iter().collect();
        let requests = self.sampler().requests(&prompts, 0, 0, true);
        let samples = self.sampler().sample(pool, &prompts, &requests, 1 << 60)?;
        let rewards = match self.sampler().scores_of(&prompts, &samples)? {
            Some((rewards, _)) => rewards,
            None => {
                let sequences = samples.sequences(&requests);
                let reply = critic.map(|c| c.infer(sequences).wait()).transpose()?;
                self.shared_by_root(reply.map(|r| r.rewards))?
            }
        };
        Ok(mean(&rewards))
    }
}

/// PPO's step in the shared loop: its engines, the reference, the critic, and what carries
/// from one step to the next (one-step-off samples, the step times, the flat-step count).
struct PpoStep<'r, 'scope> {
    runner: &'r PpoRunner<'r>,
    critic: Option<&'r dyn CriticClient>,
    reference: Option<CausalLm>,
    scope: &'scope std::thread::Scope<'scope, 'r>,
    /// The generation engines (made from the trained weights once they are in place).
    pool: Option<WorkerPool>,
    ahead: Option<Ahead<'scope>>,
    totals: StepTimes,
    /// Steps this process ran (the mean step times' count).
    steps_run: usize,
    /// Steps in a row whose samples carried no learning signal.
    flat_steps: usize,
    /// The last evaluation's reward in this process.
    last_eval: Option<f64>,
}

impl PpoStep<'_, '_> {
    /// The group this rank's engine generates with (`ppo.split_engine` in tensor groups): it
    /// holds this rank's blocks of the actor and is made at its first use, from the blocks.
    fn engine_group(&self) -> Option<std::sync::Arc<dyn aligner_parallel::Communicator>> {
        self.runner
            .run
            .tensor_group()
            .filter(|_| self.runner.config.ppo.split_engine)
    }

    /// The generation engines on `actor`'s weights (`ppo.workers` of them; one for a model
    /// split over a tensor group, whose ranks decode in lock step).
    fn new_pool(&self, actor: &CausalLm) -> WorkerPool {
        let engine = Engine::new(
            actor.valid(),
            self.runner.llama.clone(),
            Some(self.runner.tokenizer.clone()),
            EngineOptions {
                slots: self.runner.config.ppo.slots,
                cache_len: None,
                ..EngineOptions::default()
            },
        );
        WorkerPool::new(engine, self.runner.config.ppo.workers)
    }
}

impl<'r, 'scope> Method<CausalLm> for PpoStep<'r, 'scope> {
    type Error = PpoError;

    fn shards_fully(&self) -> bool {
        true
    }

    fn splits_tensors(&self) -> bool {
        true
    }

    fn begin(&mut self, actor: &CausalLm, resumed: Option<&std::path::Path>) -> Result<()> {
        if let (Some(dir), Some(critic)) = (resumed, self.critic) {
            critic.load(dir.join("critic")).wait()?;
        }
        // A tensor group's engine takes the actor's blocks (made at its first use); any other
        // generates with the whole model, so blocks read from the checkpoint are gathered.
        if self.engine_group().is_none() {
            self.pool = Some(match self.runner.run.tensor_group() {
                Some(_) => self.new_pool(&aligner_core::train::tensor::gather_parameters(actor)),
                None => self.new_pool(actor),
            });
        }
        Ok(())
    }

    fn step(&mut self, step: usize, actor: CausalLm, optim: &mut Optimizer<'_>) -> Result<Stepped<CausalLm>> {
        let runner = self.runner;
        let cfg = &runner.config.ppo;
        let critic = self.critic;
        let began = Instant::now();
        // What the engines and the log-prob passes read: fully sharded, the actor gathered
        // whole (a collective); in tensor groups, the blocks themselves (each group's ranks
        // generate and score together).
        let split_engine = self.engine_group().is_some();
        let whole = match (optim.full(), optim.splits() && !split_engine) {
            (true, _) => Some(aligner_core::train::full::gather_parameters(&actor)),
            (_, true) => Some(aligner_core::train::tensor::gather_parameters(&actor)),
            _ => None,
        };
        if split_engine && self.pool.is_none() {
            self.pool = Some(self.new_pool(&actor));
        }
        let whole_actor = whole.as_ref().unwrap_or(&actor);
        let mut times = StepTimes::default();

        // This step's samples: drawn now from the current weights, or (one-step-off) drawn
        // during the last step from the weights it started with, one update behind.
        let t = Instant::now();
        let (rollout, lag) = match self.ahead.take() {
            Some(drawing) => {
                let (rollout, seconds) = drawing.land(&mut self.pool)?;
                times.generation_overlapped = seconds;
                (rollout?, 1)
            }
            None => {
                let engines = engines(&mut self.pool)?;
                engines.refit(whole_actor)?;
                times.refit = t.elapsed().as_secs_f64();
                (runner.sampler().rollout(engines, step)?, 0)
            }
        };
        // The time the actor waited for its samples.
        times.generation = t.elapsed().as_secs_f64() - times.refit;
        if lag == 0 {
            times.generation -= rollout.reward_seconds;
            times.reward = rollout.reward_seconds;
        }
        times.generation_per_rank = rollout.per_rank;
        if cfg.one_step_off && step + 1 < runner.steps() {
            // The next step's samples come from the weights this step starts with.
            let t = Instant::now();
            let mut lent = self
                .pool
                .take()
                .ok_or_else(|| PpoError::Invalid("the generation engines were not handed back".into()))?;
            lent.refit(whole_actor)?;
            times.refit += t.elapsed().as_secs_f64();
            let sampler = runner.sampler();
            self.ahead = Some(Ahead::Drawing(self.scope.spawn(move || {
                let t = Instant::now();
                let rollout = sampler.rollout(&mut lent, step + 1);
                (lent, rollout, t.elapsed().as_secs_f64())
            })));
        }
        let sequences = rollout.sequences;
        let generations = rollout.generations;

        // The critic scores while the actor computes the reference log-probs.
        let needs_critic = cfg.advantage.needs_critic();
        let pending = critic
            .filter(|_| needs_critic)
            .map(|c| c.infer(sequences.clone()));
        let t = Instant::now();
        let ref_logprobs = runner.reference_logprobs(whole_actor, self.reference.as_ref(), &sequences)?;
        // Truncated importance sampling: the actor's own log-probs of what the engine sampled.
        let trainer_old = match cfg.tis_cap > 0.0 {
            true => Some(runner.reference_logprobs(whole_actor, Some(&whole_actor.valid()), &sequences)?),
            false => None,
        };
        drop(whole);
        times.logprobs = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let critic_out: InferReply = if needs_critic {
            runner.shared_by_root(pending.map(|p| p.wait()).transpose()?)?
        } else {
            InferReply {
                values: sequences
                    .iter()
                    .map(|s| vec![0.0; s.response_ids.len()])
                    .collect(),
                rewards: Vec::new(),
                seconds: 0.0,
            }
        };
        times.critic_wait = t.elapsed().as_secs_f64();
        times.critic_compute = critic_out.seconds;

        let mut metrics = rollout.metrics;
        metrics.insert("behaviour_lag".into(), lag.into());
        let scores = match rollout.scores {
            Some(scores) => scores,
            None => {
                metrics.insert("reward".into(), mean(&critic_out.rewards).into());
                runner.sampler().shaped(&critic_out.rewards, &generations)
            }
        };
        let (scored, more, flat) = runner.score(
            sequences,
            &generations,
            &ref_logprobs,
            trainer_old,
            critic_out,
            scores,
        )?;
        metrics.extend(more);
        match flat {
            Some(why) => {
                self.flat_steps += 1;
                tracing::warn!(step = step + 1, "this step's samples teach nothing: {why}");
                if cfg.stop_after_flat_steps > 0 && self.flat_steps >= cfg.stop_after_flat_steps {
                    return Err(PpoError::NoSignal {
                        steps: self.flat_steps,
                        why,
                        checkpoints: runner.run.checkpoints().display().to_string(),
                    });
                }
            }
            None => self.flat_steps = 0,
        }
        let train_values = cfg.advantage == Advantage::Gae && !scored.sequences.is_empty();
        let value_ticket = critic.filter(|_| train_values).map(|critic| {
            critic.train(TrainRequest {
                sequences: scored.sequences.clone(),
                old_values: scored.old_values.clone(),
                returns: scored.returns.clone(),
                settings: CriticSettings {
                    lr: cfg.critic_lr,
                    clip_eps: cfg.value_clip_eps,
                    epochs: cfg.epochs,
                    mini_batch: cfg.mini_batch,
                    max_grad_norm: runner.config.train.max_grad_norm,
                },
            })
        });
        let t = Instant::now();
        let train = &runner.config.train;
        let lr = aligner_core::train::learning_rate(
            train.schedule,
            train.lr,
            step,
            train.warmup_steps,
            runner.steps(),
        );
        let (actor, stats) = runner.update_actor(actor, optim, &scored, lr)?;
        times.train = t.elapsed().as_secs_f64();
        let mut value_loss = None;
        if train_values {
            let t = Instant::now();
            let reply = value_ticket.map(|t| t.wait()).transpose()?;
            let (loss, seconds): (f64, f64) =
                runner.shared_by_root(reply.map(|r| (r.value_loss, r.seconds)))?;
            times.critic_wait += t.elapsed().as_secs_f64();
            times.critic_compute += seconds;
            value_loss = Some(loss);
        }
        times.total = began.elapsed().as_secs_f64();
        self.totals.add(&times);
        self.steps_run += 1;

        let mut out = metrics;
        for (k, v) in [
            ("policy_loss", stats.policy_loss),
            ("clip_fraction", stats.clip_fraction),
            ("approx_kl", stats.approx_kl),
            ("lr", lr),
        ] {
            out.insert(k.into(), v.into());
        }
        if let Some(h) = stats.entropy {
            out.insert("entropy".into(), h.into());
        }
        if let Some(m) = stats.mismatch {
            out.insert("logprob_mismatch".into(), m.mean.into());
            out.insert("logprob_mismatch_max".into(), m.max.into());
        }
        if let Some(v) = value_loss {
            out.insert("value_loss".into(), v.into());
        }
        for (k, v) in serde_json::to_value(&times)
            .ok()
            .and_then(|v| v.as_object().cloned())
            .unwrap_or_default()
        {
            out.insert(format!("time_{k}"), v);
        }
        let reward = out.get("reward").and_then(Value::as_f64).unwrap_or(f64::NAN);
        Ok(Stepped {
            model: actor,
            row: out,
            message: format!("reward {reward:.3} · {:.1} s/step", times.total),
        })
    }

    fn validates(&self) -> bool {
        !self.runner.eval_prompts.is_empty()
    }

    fn evaluate(&mut self, actor: &CausalLm) -> Result<Map<String, Value>> {
        // One-step-off: the next step's samples are waited for, to free the engines.
        if let Some(drawing) = self.ahead.take() {
            let (rollout, seconds) = drawing.land(&mut self.pool)?;
            self.ahead = Some(Ahead::Drawn(rollout, seconds));
        }
        // Tensor groups: the engine takes the blocks of the (gathered) actor.
        let blocks = match self.engine_group() {
            Some(group) => Some(aligner_core::train::tensor::split_parameters(
                actor.clone(),
                group,
            )?),
            None => None,
        };
        let engine_actor = blocks.as_ref().unwrap_or(actor);
        if self.pool.is_none() {
            self.pool = Some(self.new_pool(engine_actor));
        }
        let reward = self
            .runner
            .evaluate(engines(&mut self.pool)?, engine_actor, self.critic)?;
        drop(blocks);
        self.last_eval = Some(reward);
        let mut out = Map::new();
        out.insert("eval_reward".into(), reward.into());
        out.extend(self.runner.frontier_metrics(actor)?);
        Ok(out)
    }

    /// `checkpoints/step-N/`: the actor and its optimiser, and the critic, which saves while
    /// the actor writes its own part (only rank 0 writes, and only rank 0 holds the critic).
    fn checkpoint(
        &self,
        tmp: &std::path::Path,
        write_model: &mut dyn FnMut() -> aligner_core::Result<()>,
    ) -> Result<()> {
        let critic_saved = self.critic.map(|c| c.save(tmp.join("critic")));
        write_model()?;
        if let Some(saved) = critic_saved {
            saved.wait()?;
        }
        Ok(())
    }

    fn finish(&self, run: &RunDir) -> Result<()> {
        if let Some(critic) = self.critic {
            critic.save(run.join("critic")).wait()?;
        }
        Ok(())
    }

    fn plot_keys(&self) -> Vec<String> {
        ["reward", "eval_reward", "kl", "value_loss"]
            .map(String::from)
            .to_vec()
    }
}

fn mean(xs: &[f32]) -> f64 {
    xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len().max(1) as f64
}

fn row(pairs: &[(&str, f64)]) -> Map<String, Value> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), Value::from(*v)))
        .collect()
}
