//! The actor's loop: rollout → log-probs and critic values → rewards with the KL penalty →
//! advantages → clipped policy updates, with the critic working alongside.

use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

use aligner_core::checkpoint::write_json;
use aligner_core::data::EncodedPrompt;
use aligner_core::parallel::{map_balanced, map_sharded};
use aligner_core::run::{RunDir, progress_bar};
use aligner_core::train::grads::{all_reduce_gradients, clip_grad_norm};
use aligner_core::train::{
    EpochOrder, MetricsLog, ModelStore, adamw, load_optimizer, mini_batches, plot_metrics, save_optimizer,
};
use aligner_core::{CausalLm, CoreError, LlamaConfig, TextTokenizer};
use aligner_gen::{
    Engine, EngineOptions, Generation, GenerationRequest, RewardInput, Rewards, SamplingParams, StopReason,
    WorkerPool,
};
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::advantages::{
    Advantage, gae, group_advantages, informative_groups, kl_per_token, overlong_penalty, reinforce_pp,
    token_rewards, whiten,
};
use crate::config::{NonEos, PpoConfig};
use crate::critic::{CriticClient, CriticSettings, InferReply, TrainRequest};
use crate::error::{PpoError, Result};
use crate::losses::{LossAgg, entropy, masked_token_mean, policy_loss};
use crate::rollout::{Layout, Sequence};
pub use crate::timing::StepTimes;
use aligner_parallel::{DEFAULT_CHUNK_TOKENS, ReduceOp, shard_range, token_logprobs_from_hidden};

/// The file a PPO checkpoint writes last (its presence marks the checkpoint complete).
pub const PPO_STATE: &str = "ppo_state.json";

/// Where a run stands; stored with each checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PpoState {
    pub step: usize,
    pub seed: u64,
}

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
}

/// What the actor's update reports (means over its mini-batches).
struct ActorStats {
    clip_fraction: f64,
    approx_kl: f64,
    policy_loss: f64,
    entropy: Option<f64>,
}

/// A step's samples and their rewards (when the actor computes them).
struct Rollout {
    generations: Vec<Generation>,
    sequences: Vec<Sequence>,
    /// Shaped scores (non-EOS penalty, overlong shaping); `None`: the critic's reply has them.
    scores: Option<Vec<f32>>,
    metrics: Map<String, Value>,
    per_rank: Vec<f64>,
    reward_seconds: f64,
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
    fn checkpoints(&self) -> PathBuf {
        self.run.checkpoints()
    }

    /// Trains `actor` (LoRA already attached when configured), or, when the run is resumed,
    /// continues from its newest checkpoint.
    ///
    /// Data parallel: every rank's engine takes rollout requests a batch at a time from one
    /// queue (a rank whose responses come out short takes more), the rollout is gathered on
    /// every rank, and each actor mini-batch is split over the ranks with its gradients summed.
    /// `critic` is rank 0's alone (`None` on the others): rank 0 asks it and shares the replies.
    pub fn run(&self, actor: CausalLm, critic: Option<&dyn CriticClient>) -> Result<PpoSummary> {
        let cfg = &self.config.ppo;
        cfg.check()?;
        if self.train_prompts.is_empty() {
            return Err(PpoError::Invalid("no training prompts".into()));
        }
        let train_device = self.config.ppo.actor_device(&self.device);
        let lora = self.config.model.lora_rank > 0;
        let mut actor = actor.fork(&train_device).train();
        // Without LoRA the reference is a frozen copy of the starting policy; with LoRA it is
        // the same weights with the adapters switched off (the base does not train), kept as
        // a copy only when it is offloaded to the CPU.
        let reference = match (lora, cfg.offload_reference) {
            (false, false) => Some(actor.valid()),
            (true, false) => None,
            (_, true) => {
                let mut frozen = actor.valid();
                frozen.model.set_adapters_enabled(false);
                Some(frozen.fork(&Device::flex()))
            }
        };
        let mut optim = adamw(0.0);
        let mut start = 0;
        self.run.prepare_checkpoints()?;
        if let Some((step, dir)) = self.run.resume_point(PPO_STATE)? {
            actor = self.store.load(&dir.join("actor"), &train_device)?.train();
            optim = load_optimizer(optim, &dir.join("actor_optimizer.bin"))?;
            if let Some(critic) = critic {
                critic.load(dir.join("critic")).wait()?;
            }
            tracing::info!(step, dir = %dir.display(), "resuming");
            start = step;
        }
        let engine = Engine::new(
            actor.valid(),
            self.llama.clone(),
            Some(self.tokenizer.clone()),
            EngineOptions {
                slots: cfg.slots,
                cache_len: None,
                ..EngineOptions::default()
            },
        );
        let mut pool = WorkerPool::new(engine, cfg.workers);
        let log = MetricsLog::for_run_with_tensorboard(
            self.run,
            self.run.is_resumed().then_some(start),
            cfg.tensorboard,
        )?;
        let mut initial_eval = None;
        if start == 0 && !self.eval_prompts.is_empty() {
            let reward = self.evaluate(&mut pool, &actor, critic)?;
            initial_eval = Some(reward);
            let mut first = row(&[("step", 0.0), ("eval_reward", reward)]);
            first.extend(self.frontier_metrics(&actor)?);
            log.write(&first)?;
        }
        let bar = progress_bar(
            cfg.steps as u64,
            "ppo step {pos}/{len} {bar:30} {msg} [{elapsed} < {eta}]",
        );
        bar.set_position(start as u64);
        let mut totals = StepTimes::default();
        let mut last_eval = None;
        for step in start..cfg.steps {
            if self.run.stops_after().is_some_and(|s| step >= s) {
                bar.abandon();
                return Ok(self.summary(step, initial_eval, last_eval, &totals, step - start));
            }
            let began = Instant::now();
            let mut times = StepTimes::default();

            let t = Instant::now();
            pool.refit(&actor)?;
            times.refit = t.elapsed().as_secs_f64();

            let t = Instant::now();
            let rollout = self.rollout(&mut pool, step)?;
            times.generation = t.elapsed().as_secs_f64() - rollout.reward_seconds;
            times.reward = rollout.reward_seconds;
            times.generation_per_rank = rollout.per_rank;
            let sequences = rollout.sequences;
            let generations = rollout.generations;

            // The critic scores while the actor computes the reference log-probs.
            let needs_critic = cfg.advantage.needs_critic();
            let pending = critic
                .filter(|_| needs_critic)
                .map(|c| c.infer(sequences.clone()));
            let t = Instant::now();
            let ref_logprobs = self.reference_logprobs(&actor, reference.as_ref(), &sequences)?;
            times.logprobs = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let critic_out: InferReply = if needs_critic {
                self.shared_by_root(pending.map(|p| p.wait()).transpose()?)?
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
            let scores = match rollout.scores {
                Some(scores) => scores,
                None => {
                    metrics.insert("reward".into(), mean(&critic_out.rewards).into());
                    self.shaped(&critic_out.rewards, &generations)
                }
            };
            let (scored, more) = self.score(sequences, &generations, &ref_logprobs, critic_out, scores)?;
            metrics.extend(more);
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
                        max_grad_norm: cfg.max_grad_norm,
                    },
                })
            });
            let t = Instant::now();
            let stats = self.update_actor(&mut actor, &mut optim, &scored)?;
            times.train = t.elapsed().as_secs_f64();
            let mut value_loss = None;
            if train_values {
                let t = Instant::now();
                let reply = value_ticket.map(|t| t.wait()).transpose()?;
                let (loss, seconds): (f64, f64) =
                    self.shared_by_root(reply.map(|r| (r.value_loss, r.seconds)))?;
                times.critic_wait += t.elapsed().as_secs_f64();
                times.critic_compute += seconds;
                value_loss = Some(loss);
            }
            times.total = began.elapsed().as_secs_f64();
            totals.add(&times);

            let done = step + 1;
            let mut out = metrics;
            out.insert("step".into(), done.into());
            for (k, v) in [
                ("policy_loss", stats.policy_loss),
                ("clip_fraction", stats.clip_fraction),
                ("approx_kl", stats.approx_kl),
            ] {
                out.insert(k.into(), v.into());
            }
            if let Some(h) = stats.entropy {
                out.insert("entropy".into(), h.into());
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
            if !self.eval_prompts.is_empty()
                && (done == cfg.steps || (cfg.eval_every > 0 && done.is_multiple_of(cfg.eval_every)))
            {
                let reward = self.evaluate(&mut pool, &actor, critic)?;
                last_eval = Some(reward);
                out.insert("eval_reward".into(), reward.into());
                out.extend(self.frontier_metrics(&actor)?);
            }
            let reward = out.get("reward").and_then(Value::as_f64).unwrap_or(f64::NAN);
            bar.set_position(done as u64);
            bar.set_message(format!("reward {reward:.3} · {:.1} s/step", times.total));
            log.write(&out)?;
            if cfg.save_every > 0 && done.is_multiple_of(cfg.save_every) && done < cfg.steps {
                self.save_checkpoint(done, &actor, &optim, critic)?;
            }
        }
        bar.finish_and_clear();
        self.run.write_shared(|| {
            self.store.save(&actor.valid(), &self.run.final_dir())?;
            if let Some(critic) = critic {
                critic.save(self.run.join("critic")).wait()?;
            }
            let rows = log.rows()?;
            Ok::<_, PpoError>(plot_metrics(
                &rows,
                &["reward", "eval_reward", "kl", "value_loss"],
                &self.run.join("metrics.svg"),
            )?)
        })?;
        Ok(self.summary(cfg.steps, initial_eval, last_eval, &totals, cfg.steps - start))
    }

    /// `checkpoints/step-N/`: actor, its optimiser, the critic, the run position.
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

    fn save_checkpoint(
        &self,
        step: usize,
        actor: &CausalLm,
        optim: &ModuleOptimizer,
        critic: Option<&dyn CriticClient>,
    ) -> Result<()> {
        self.run.save_checkpoint(step, |tmp| {
            // The critic saves while the actor writes its own part (only rank 0 writes, and
            // only rank 0 holds the critic).
            let critic_saved = critic.map(|c| c.save(tmp.join("critic")));
            self.store.save(&actor.valid(), &tmp.join("actor"))?;
            save_optimizer(optim, &tmp.join("actor_optimizer.bin"))?;
            if let Some(saved) = critic_saved {
                saved.wait()?;
            }
            let state = PpoState {
                step,
                seed: self.config.ppo.seed,
            };
            Ok::<_, PpoError>(write_json(&tmp.join(PPO_STATE), &state)?)
        })?;
        Ok(())
    }

    fn summary(
        &self,
        steps: usize,
        initial: Option<f64>,
        last: Option<f64>,
        totals: &StepTimes,
        run_steps: usize,
    ) -> PpoSummary {
        PpoSummary {
            steps,
            final_dir: self.run.final_dir(),
            initial_eval_reward: initial,
            final_eval_reward: last,
            mean_times: totals.mean(run_steps),
        }
    }

    /// This step's prompts: consecutive stretches of a per-epoch shuffle of the training
    /// prompts (a stretch may run into the next epoch). Dynamic sampling's extra draws
    /// (`draw` ≥ 1) take the same stretch of shuffles of their own.
    fn step_prompts(&self, step: usize, draw: usize) -> Vec<&EncodedPrompt> {
        let per = self.config.ppo.rollout_prompts.max(1);
        let seed = self.config.ppo.seed.wrapping_add((draw as u64) << 32);
        EpochOrder::new(self.train_prompts.len(), true, seed)
            .with_epoch_seed(|seed, epoch| seed.wrapping_add(epoch as u64))
            .items(step * per, per)
            .into_iter()
            .map(|i| &self.train_prompts[i])
            .collect()
    }

    /// `samples_per_prompt` requests per prompt (one for evaluation), each with its own seed.
    fn requests(
        &self,
        prompts: &[&EncodedPrompt],
        step: usize,
        draw: usize,
        eval: bool,
    ) -> Vec<GenerationRequest> {
        let cfg = &self.config.ppo;
        let samples = if eval { 1 } else { cfg.samples_per_prompt.max(1) };
        let base = if eval {
            0xe7a1
        } else {
            cfg.seed
                .wrapping_mul(1_000_003)
                .wrapping_add(step as u64 * 100_000)
                .wrapping_add((draw as u64) << 40)
        };
        prompts
            .iter()
            .flat_map(|p| std::iter::repeat_n(p, samples))
            .enumerate()
            .map(|(i, p)| GenerationRequest {
                prompt_ids: p.ids.clone(),
                params: SamplingParams {
                    temperature: cfg.temperature,
                    top_k: cfg.top_k,
                    top_p: cfg.top_p,
                    seed: base.wrapping_add(i as u64),
                    max_new_tokens: cfg.max_new_tokens,
                    stop_strings: Vec::new(),
                },
                guidance: None,
            })
            .collect()
    }

    /// A step's samples: `rollout_prompts` prompts × `samples_per_prompt`, scored by the
    /// actor's rewards when it holds them. With dynamic sampling, groups whose scores are all
    /// equal are dropped and up to `dynamic_sampling_max_draws` more draws refill the batch.
    fn rollout(&self, pool: &mut WorkerPool, step: usize) -> Result<Rollout> {
        let cfg = &self.config.ppo;
        let group = cfg.samples_per_prompt.max(1);
        let wanted = cfg.rollout_prompts.max(1);
        let draws = if cfg.dynamic_sampling {
            1 + cfg.dynamic_sampling_max_draws
        } else {
            1
        };
        let mut out = Rollout {
            generations: Vec::new(),
            sequences: Vec::new(),
            scores: None,
            metrics: Map::new(),
            per_rank: Vec::new(),
            reward_seconds: 0.0,
        };
        // Raw scores of every sample drawn, and each reward part's, for the step's metrics.
        let mut raw_all: Vec<f32> = Vec::new();
        let mut parts_all: Vec<(String, Vec<f64>)> = Vec::new();
        let mut kept_scores = Vec::new();
        let mut draws_made = 0;
        for draw in 0..draws {
            draws_made += 1;
            let prompts = self.step_prompts(step, draw);
            let requests = self.requests(&prompts, step, draw, false);
            let (generations, per_rank) = self.generate(pool, &requests)?;
            if out.per_rank.len() < per_rank.len() {
                out.per_rank.resize(per_rank.len(), 0.0);
            }
            out.per_rank.iter_mut().zip(&per_rank).for_each(|(a, b)| *a += b);
            let sequences = Sequence::from_generations(&requests, &generations);
            let Some(rewards) = self.reward else {
                out.generations = generations;
                out.sequences = sequences;
                return Ok(out);
            };
            let t = Instant::now();
            let owners: Vec<&EncodedPrompt> = prompts
                .iter()
                .flat_map(|p| std::iter::repeat_n(*p, group))
                .collect();
            let (raw, parts) = self.rewards_of(rewards, &owners, &generations)?;
            out.reward_seconds += t.elapsed().as_secs_f64();
            raw_all.extend(&raw);
            for (name, scores) in parts {
                match parts_all.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, all)) => all.extend(scores),
                    None => parts_all.push((name, scores)),
                }
            }
            let shaped = self.shaped(&raw, &generations);
            let keep = if cfg.dynamic_sampling {
                informative_groups(&shaped, group)
            } else {
                vec![true; prompts.len()]
            };
            let mut generations = generations.into_iter();
            let mut sequences = sequences.into_iter();
            for (g, &kept) in keep.iter().enumerate() {
                let groups_kept = out.sequences.len() / group;
                let take = kept && groups_kept < wanted;
                for i in g * group..(g + 1) * group {
                    let (Some(generation), Some(sequence)) = (generations.next(), sequences.next()) else {
                        break;
                    };
                    if take {
                        out.generations.push(generation);
                        out.sequences.push(sequence);
                        kept_scores.push(shaped[i]);
                    }
                }
            }
            if out.sequences.len() / group >= wanted {
                break;
            }
        }
        out.metrics.insert("reward".into(), mean(&raw_all).into());
        if parts_all.len() > 1 || parts_all.first().is_some_and(|(n, _)| n != "reward") {
            for (name, scores) in &parts_all {
                let m = scores.iter().sum::<f64>() / scores.len().max(1) as f64;
                out.metrics.insert(format!("reward/{name}"), m.into());
            }
        }
        if cfg.dynamic_sampling {
            out.metrics
                .insert("dynamic_sampling/draws".into(), draws_made.into());
            out.metrics.insert(
                "dynamic_sampling/groups".into(),
                (out.sequences.len() / group).into(),
            );
        }
        out.scores = Some(kept_scores);
        Ok(out)
    }

    /// The rewards of `generations` (each answering the prompt in `owners` at the same
    /// index): each sample's weighted total and each part's scores. Data parallel: each rank
    /// scores its shard (a command reward runs one process per rank).
    fn rewards_of(
        &self,
        rewards: &Rewards,
        owners: &[&EncodedPrompt],
        generations: &[Generation],
    ) -> Result<(Vec<f32>, Vec<(String, Vec<f64>)>)> {
        let texts: Vec<String> = owners
            .iter()
            .zip(generations)
            .map(|(p, g)| self.tokenizer.decode_continuation(&p.ids, &g.token_ids))
            .collect::<std::result::Result<_, _>>()?;
        let inputs: Vec<RewardInput<'_>> = owners
            .iter()
            .zip(generations)
            .zip(&texts)
            .map(|((p, g), text)| RewardInput {
                prompt: &p.text,
                response: text,
                prompt_ids: &p.ids,
                response_ids: &g.token_ids,
                stop_reason: g.stop_reason,
                fields: &p.fields,
            })
            .collect();
        let per_sample: Vec<(f64, Vec<f64>)> = map_sharded(self.run.comm(), &inputs, |mine| {
            let scored = rewards.score_parts(mine)?;
            Ok::<_, PpoError>(
                (0..mine.len())
                    .map(|i| (scored.total[i], scored.parts.iter().map(|(_, s)| s[i]).collect()))
                    .collect(),
            )
        })?;
        let names = rewards.names();
        let parts = names
            .iter()
            .enumerate()
            .map(|(j, name)| (name.to_string(), per_sample.iter().map(|(_, p)| p[j]).collect()))
            .collect();
        Ok((per_sample.iter().map(|(t, _)| *t as f32).collect(), parts))
    }

    /// Raw scores with the configured shaping: the non-EOS penalty and DAPO's overlong
    /// penalty.
    fn shaped(&self, raw: &[f32], generations: &[Generation]) -> Vec<f32> {
        let cfg = &self.config.ppo;
        raw.iter()
            .zip(generations)
            .map(|(&score, g)| {
                let mut s = score;
                if cfg.non_eos == NonEos::Penalize && g.stop_reason != StopReason::Eos {
                    s += cfg.non_eos_penalty;
                }
                s + overlong_penalty(
                    g.token_ids.len(),
                    cfg.max_new_tokens,
                    cfg.overlong_buffer,
                    cfg.overlong_penalty,
                )
            })
            .collect()
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
                let lp =
                    model.token_logprobs_with(layout.tokens.clone(), &layout.positions, Some(&layout.mask));
                out.extend(layout.ragged(layout.response_columns(lp)));
            }
            Ok::<_, PpoError>(out)
        })
    }

    /// Generations for `requests` (in their order, on every rank), and each rank's generation
    /// seconds when there are several: the ranks' engines take the requests a batch of
    /// `ppo.slots` at a time from one queue, so a rank that finishes early takes more.
    fn generate(
        &self,
        pool: &mut WorkerPool,
        requests: &[GenerationRequest],
    ) -> Result<(Vec<Generation>, Vec<f64>)> {
        let comm = self.run.comm();
        if comm.world_size() == 1 {
            return Ok((pool.generate(requests, &|_| {})?.0, Vec::new()));
        }
        // Batches no larger than the engines take at once, and small enough that every rank
        // gets several to balance with.
        let engine_batch = self.config.ppo.slots.max(1) * self.config.ppo.workers.max(1);
        let chunk = engine_batch
            .min(requests.len().div_ceil(4 * comm.world_size()))
            .max(1);
        let (generations, work) = map_balanced(comm, requests.len(), chunk, |range| {
            Ok::<_, PpoError>(pool.generate(&requests[range], &|_| {})?.0)
        })?;
        Ok((generations, work.iter().map(|w| w.seconds).collect()))
    }

    /// Rank 0's `value` (a critic reply only rank 0 asked for) on every rank.
    fn shared_by_root<T: Serialize + DeserializeOwned>(&self, value: Option<T>) -> Result<T> {
        self.run
            .agree(&value)?
            .ok_or_else(|| PpoError::Critic("rank 0 holds no critic".into()))
    }

    /// Rewards, KL penalty, advantages and returns of a rollout; the step's metrics.
    fn score(
        &self,
        sequences: Vec<Sequence>,
        generations: &[Generation],
        ref_logprobs: &[Vec<f32>],
        critic_out: InferReply,
        scores: Vec<f32>,
    ) -> Result<(Scored, Map<String, Value>)> {
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
        let old_logprobs: Vec<Vec<f32>> = generations.iter().map(|g| g.token_logprobs.clone()).collect();
        let kls: Vec<Vec<f32>> = old_logprobs
            .iter()
            .zip(ref_logprobs)
            .map(|(lp, lr)| kl_per_token(lp, lr, cfg.kl_estimator))
            .collect();
        let values = critic_out.values;
        let (mut advantages, returns): (Vec<Vec<f32>>, Vec<Vec<f32>>) = match cfg.advantage {
            Advantage::Gae => scores
                .iter()
                .zip(&kls)
                .zip(&values)
                .map(|((&s, kl), v)| gae(&token_rewards(s, kl, cfg.kl_coef), v, cfg.gamma, cfg.lam))
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
        let metrics = row(&[
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
        let scored = Scored {
            sequences: keep.iter().map(|&i| sequences[i].clone()).collect(),
            old_logprobs: pick(&old_logprobs),
            advantages,
            old_values: pick(&values),
            returns: pick(&returns),
        };
        Ok((scored, metrics))
    }

    /// `ppo.epochs` passes of the clipped policy loss (minus `ppo.entropy_coef` × entropy).
    ///
    /// Data parallel: each rank takes its shard of every mini-batch, weighted by its share of
    /// the response tokens the losses are means over, and the gradients are summed over ranks
    /// before clipping, so the update is the one of the whole mini-batch.
    fn update_actor(
        &self,
        actor: &mut CausalLm,
        optim: &mut ModuleOptimizer,
        scored: &Scored,
    ) -> Result<ActorStats> {
        let cfg = &self.config.ppo;
        // The device the actor's weights are on (with its activation checkpointing setting).
        let device = actor.model.embed_tokens.weight.device();
        let n = scored.sequences.len();
        let comm = self.run.comm();
        let (rank, world) = (comm.rank(), comm.world_size());
        let tokens =
            |r: Range<usize>| -> usize { scored.sequences[r].iter().map(|s| s.response_ids.len()).sum() };
        let (mut clip, mut kl, mut loss_sum, mut batches) = (0.0, 0.0, 0.0, 0usize);
        let mut entropy_sum = 0.0;
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
            if !mine.is_empty() {
                let (loss, values) = self.actor_loss(actor, scored, mine, &device)?;
                stats = values;
                let loss = if world > 1 { loss.mul_scalar(share) } else { loss };
                grads = GradientsParams::from_grads(loss.backward(), actor);
            }
            if world > 1 {
                all_reduce_gradients(actor, &mut grads, 1.0, comm).map_err(CoreError::from)?;
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
            clip_grad_norm(actor, &mut grads, cfg.max_grad_norm);
            *actor = optim.step(cfg.actor_lr, actor.clone(), grads);
        }
        let b = batches.max(1) as f64;
        Ok(ActorStats {
            clip_fraction: clip / b,
            approx_kl: kl / b,
            policy_loss: loss_sum / b,
            entropy: (cfg.entropy_coef > 0.0).then_some(entropy_sum / b),
        })
    }

    /// The clipped policy loss (minus the entropy bonus) of sequences `rows` of a rollout, and
    /// its logged values: loss, clip fraction, approximate KL, entropy.
    fn actor_loss(
        &self,
        actor: &CausalLm,
        scored: &Scored,
        rows: Range<usize>,
        device: &Device,
    ) -> Result<(Tensor<1>, [f64; 4])> {
        let cfg = &self.config.ppo;
        let (start, end) = (rows.start, rows.end);
        let layout = Layout::new(&scored.sequences[start..end], device);
        let old = layout.padded(&scored.old_logprobs[start..end], device);
        let adv = layout.padded(&scored.advantages[start..end], device);
        // One trunk pass serves the log-probs and, with an entropy bonus, the entropy of the
        // response positions' full distributions.
        let hidden = actor
            .model
            .forward(layout.tokens.clone(), &layout.positions, Some(&layout.mask), None);
        let [rows, width, d] = hidden.dims();
        let inputs = hidden
            .clone()
            .narrow(1, 0, width - 1)
            .reshape([rows, width - 1, d]);
        let targets = layout.tokens.clone().narrow(1, 1, width - 1);
        let lp = token_logprobs_from_hidden(inputs, actor.output_weight(), targets, DEFAULT_CHUNK_TOKENS);
        let mut out = policy_loss(
            layout.response_columns(lp),
            old,
            adv,
            &layout.response_mask,
            &cfg.policy_loss(),
        );
        let mut entropy_value = 0.0;
        if cfg.entropy_coef > 0.0 {
            let states = hidden.narrow(1, layout.prompt_width - 1, layout.response_width);
            let h = masked_token_mean(entropy(actor.logits_from_hidden(states)), &layout.response_mask);
            entropy_value = h.clone().into_scalar::<f32>() as f64;
            out.loss = out.loss - h.mul_scalar(cfg.entropy_coef);
        }
        let value = out.loss.clone().into_scalar::<f32>() as f64;
        Ok((out.loss, [value, out.clip_fraction, out.approx_kl, entropy_value]))
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
        let requests = self.requests(&prompts, 0, 0, true);
        let (generations, _) = self.generate(pool, &requests)?;
        let sequences = Sequence::from_generations(&requests, &generations);
        let rewards = match self.reward {
            Some(rewards) => self.rewards_of(rewards, &prompts, &generations)?.0,
            None => {
                let reply = critic.map(|c| c.infer(sequences).wait()).transpose()?;
                self.shared_by_root(reply.map(|r| r.rewards))?
            }
        };
        Ok(mean(&rewards))
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
