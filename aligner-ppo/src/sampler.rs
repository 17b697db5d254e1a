//! Drawing a step's samples: the prompts of each step, the generation requests, the engine
//! pool's answers (spread over the data-parallel ranks) and their rewards, with DAPO's dynamic
//! sampling and the reward shaping. A [`Sampler`] borrows only what sampling needs and is
//! `Sync`, so a one-step-off run draws the next step's samples on another thread while the
//! actor trains.

use std::time::Instant;

use aligner_core::TextTokenizer;
use aligner_core::data::EncodedPrompt;
use aligner_core::parallel::{map_balanced, map_sharded};
use aligner_core::run::RunDir;
use aligner_core::train::EpochOrder;
use aligner_gen::env::{
    Environment, Episode, EpisodeLimits, EpisodeStart, EpisodeStats, run_episodes, run_episodes_continuous,
};
use aligner_gen::{
    GenError, Generation, GenerationRequest, RewardInput, Rewards, SamplingParams, StopReason, WorkerPool,
};
use serde_json::{Map, Value};

use crate::advantages::{informative_groups, overlong_penalty};
use crate::config::{NonEos, PpoConfig};
use crate::error::{PpoError, Result};
use crate::rollout::Sequence;

/// A step's samples and their rewards (when the actor computes them).
pub(crate) struct Rollout {
    pub generations: Vec<Generation>,
    pub sequences: Vec<Sequence>,
    /// Shaped scores (non-EOS penalty, overlong shaping); `None`: the critic's reply has them.
    pub scores: Option<Vec<f32>>,
    pub metrics: Map<String, Value>,
    pub per_rank: Vec<f64>,
    pub reward_seconds: f64,
}

/// Each reward part's name and its scores.
pub(crate) type PartScores = Vec<(String, Vec<f64>)>;

/// What drawing samples needs of a run.
#[derive(Clone, Copy)]
pub(crate) struct Sampler<'a> {
    pub config: &'a PpoConfig,
    pub tokenizer: &'a TextTokenizer,
    pub train_prompts: &'a [EncodedPrompt],
    /// The rewards the actor computes itself; `None` when the critic's process scores (or,
    /// with an environment, when its rewards are the only ones).
    pub reward: Option<&'a Rewards>,
    /// Multi-turn episodes: the environment the model acts in.
    pub env: Option<&'a dyn Environment>,
    pub run: &'a RunDir,
}

/// A batch's samples: single-turn generations, or whole episodes (`generations[i]` is then
/// `episodes[i].generation`).
pub(crate) struct Samples {
    pub generations: Vec<Generation>,
    pub episodes: Option<Vec<Episode>>,
    pub per_rank: Vec<f64>,
}

impl Samples {
    /// Each request's prompt with what was sampled for it, observations marked.
    pub(crate) fn sequences(&self, requests: &[GenerationRequest]) -> Vec<Sequence> {
        let mut sequences = Sequence::from_generations(requests, &self.generations);
        if let Some(episodes) = &self.episodes {
            for (s, e) in sequences.iter_mut().zip(episodes) {
                s.observed = e.observed.clone();
            }
        }
        sequences
    }
}

impl Sampler<'_> {
    /// This step's prompts: consecutive stretches of a per-epoch shuffle of the training
    /// prompts (a stretch may run into the next epoch). Dynamic sampling's extra draws
    /// (`draw` ≥ 1) take the same stretch of shuffles of their own.
    pub(crate) fn step_prompts(&self, step: usize, draw: usize) -> Vec<&EncodedPrompt> {
        let per = self.config.ppo.rollout_prompts.max(1);
        let seed = self.config.train.seed.wrapping_add((draw as u64) << 32);
        EpochOrder::new(self.train_prompts.len(), self.config.train.shuffle, seed)
            .with_epoch_seed(|seed, epoch| seed.wrapping_add(epoch as u64))
            .items(step * per, per)
            .into_iter()
            .map(|i| &self.train_prompts[i])
            .collect()
    }

    /// `samples_per_prompt` requests per prompt (one for evaluation), each with its own seed.
    pub(crate) fn requests(
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
            self.config
                .train
                .seed
                .wrapping_mul(1_000_003)
                .wrapping_add(step as u64 * 100_000)
                .wrapping_add((draw as u64) << 40)
        };
        let params = SamplingParams {
            temperature: cfg.temperature,
            top_k: cfg.top_k,
            top_p: cfg.top_p,
            seed: base,
            max_new_tokens: cfg.max_new_tokens,
            ..SamplingParams::default()
        };
        GenerationRequest::repeated(prompts.iter().map(|p| p.ids.as_slice()), samples, &params)
    }

    /// A step's samples: `rollout_prompts` prompts × `samples_per_prompt`, scored by the
    /// actor's rewards when it holds them. With dynamic sampling, groups whose scores are all
    /// equal are dropped and up to `dynamic_sampling_max_draws` more draws refill the batch.
    pub(crate) fn rollout(&self, pool: &mut WorkerPool, step: usize) -> Result<Rollout> {
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
        let mut episodes_all: Vec<Episode> = Vec::new();
        let mut draws_made = 0;
        for draw in 0..draws {
            draws_made += 1;
            let prompts = self.step_prompts(step, draw);
            let requests = self.requests(&prompts, step, draw, false);
            let first_episode = ((step as u64) << 24) | ((draw as u64) << 16);
            let samples = self.sample(pool, &prompts, &requests, first_episode)?;
            if out.per_rank.len() < samples.per_rank.len() {
                out.per_rank.resize(samples.per_rank.len(), 0.0);
            }
            out.per_rank
                .iter_mut()
                .zip(&samples.per_rank)
                .for_each(|(a, b)| *a += b);
            let sequences = samples.sequences(&requests);
            let t = Instant::now();
            let owners: Vec<&EncodedPrompt> = prompts
                .iter()
                .flat_map(|p| std::iter::repeat_n(*p, group))
                .collect();
            let Some((raw, parts)) = self.scores_of(&owners, &samples)? else {
                out.generations = samples.generations;
                out.sequences = sequences;
                return Ok(out);
            };
            out.reward_seconds += t.elapsed().as_secs_f64();
            if let Some(episodes) = &samples.episodes {
                episodes_all.extend(episodes.iter().cloned());
            }
            let generations = samples.generations;
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
            let mut samples = generations.into_iter().zip(sequences).zip(shaped);
            for &kept in &keep {
                let take = kept && out.sequences.len() / group < wanted;
                for ((generation, sequence), score) in samples.by_ref().take(group) {
                    if take {
                        out.generations.push(generation);
                        out.sequences.push(sequence);
                        kept_scores.push(score);
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
        if self.env.is_some() {
            episode_metrics(&mut out.metrics, &episodes_all);
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

    /// `requests` answered: by the engines, or (with an environment) as whole episodes,
    /// numbered from `first_episode`. Data parallel: every rank samples with the others, the
    /// environment answers on rank 0 and its replies are shared.
    pub(crate) fn sample(
        &self,
        pool: &mut WorkerPool,
        prompts: &[&EncodedPrompt],
        requests: &[GenerationRequest],
        first_episode: u64,
    ) -> Result<Samples> {
        let Some(env) = self.env else {
            let (generations, per_rank) = self.generate(pool, requests)?;
            return Ok(Samples {
                generations,
                episodes: None,
                per_rank,
            });
        };
        let section = &self.config.environment;
        let group = requests.len() / prompts.len().max(1);
        let starts = section.starts(requests, |i| prompts[(i / group.max(1)).min(prompts.len() - 1)]);
        let mut per_rank: Vec<f64> = Vec::new();
        let limits = section.limits(self.config.ppo.max_new_tokens);
        // One process: each episode goes on as soon as its environment answers, the others
        // decoding meanwhile. Data parallel and tensor groups: turn by turn, every rank with
        // the others (a group's ranks decode together, so they must see the same turns).
        let episodes = if self.run.world().world_size() == 1 {
            run_episodes_continuous(
                &starts,
                first_episode,
                &limits,
                self.tokenizer,
                &mut |feed, done| pool.serve(feed, done).map(|_| ()),
                env,
            )?
        } else {
            self.episodes_in_lock_step(env, pool, &starts, first_episode, &limits, &mut per_rank)?
        };
        Ok(Samples {
            generations: episodes.iter().map(|e| e.generation.clone()).collect(),
            episodes: Some(episodes),
            per_rank,
        })
    }

    /// `starts` run turn by turn over the ranks: each turn's requests shared out among the
    /// data-parallel ranks (a tensor group's together), the environment's replies made on the
    /// world's rank 0 and shared ([`run_episodes`]);
    /// each rank's generation seconds added to `per_rank`.
    fn episodes_in_lock_step(
        &self,
        env: &dyn Environment,
        pool: &mut WorkerPool,
        starts: &[EpisodeStart<'_>],
        first_episode: u64,
        limits: &EpisodeLimits,
        per_rank: &mut Vec<f64>,
    ) -> Result<Vec<Episode>> {
        Ok(run_episodes(
            starts,
            first_episode,
            limits,
            self.tokenizer,
            &mut |turn_requests| {
                let (generations, seconds) = self
                    .generate(pool, turn_requests)
                    .map_err(|e| GenError::Core(aligner_core::CoreError::Invalid(e.to_string())))?;
                if per_rank.len() < seconds.len() {
                    per_rank.resize(seconds.len(), 0.0);
                }
                per_rank.iter_mut().zip(&seconds).for_each(|(a, b)| *a += b);
                Ok(generations)
            },
            &mut |turns| {
                // Rank 0 of the world alone: an environment is called once per turn, not once
                // per tensor rank.
                let replies = self.run.is_writer().then(|| env.step(turns));
                self.run.agree(&replies)?.ok_or_else(|| {
                    GenError::Core(aligner_core::CoreError::Invalid(
                        "rank 0 holds no environment replies".into(),
                    ))
                })
            },
        )?)
    }

    /// Each sample's score and each reward part's: the reward functions' (on the whole
    /// episode's text) plus, with an environment, its turns' rewards (part `environment`)
    /// and `environment.error_penalty` for an episode a failure ended. `None` when the
    /// critic's process scores.
    pub(crate) fn scores_of(
        &self,
        owners: &[&EncodedPrompt],
        samples: &Samples,
    ) -> Result<Option<(Vec<f32>, PartScores)>> {
        let (mut raw, mut parts) = match (self.reward, &samples.episodes) {
            (Some(rewards), _) => self.rewards_of(rewards, owners, &samples.generations)?,
            (None, Some(episodes)) => (vec![0.0; episodes.len()], Vec::new()),
            (None, None) => return Ok(None),
        };
        if let Some(episodes) = &samples.episodes {
            let section = &self.config.environment;
            let env: Vec<f64> = episodes.iter().map(|e| section.reward_of(e)).collect();
            for (r, e) in raw.iter_mut().zip(&env) {
                *r += *e as f32;
            }
            parts.push(("environment".into(), env));
        }
        Ok(Some((raw, parts)))
    }

    /// The rewards of `generations` (each answering the prompt in `owners` at the same
    /// index): each sample's weighted total and each part's scores. Data parallel: each rank
    /// scores its shard (a command reward runs one process per rank).
    pub(crate) fn rewards_of(
        &self,
        rewards: &Rewards,
        owners: &[&EncodedPrompt],
        generations: &[Generation],
    ) -> Result<(Vec<f32>, PartScores)> {
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
    pub(crate) fn shaped(&self, raw: &[f32], generations: &[Generation]) -> Vec<f32> {
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

    /// Generations for `requests` (in their order, on every rank), and each rank's generation
    /// seconds when there are several: the ranks' engines take the requests a batch of
    /// `ppo.slots` at a time from one queue, so a rank that finishes early takes more.
    pub(crate) fn generate(
        &self,
        pool: &mut WorkerPool,
        requests: &[GenerationRequest],
    ) -> Result<(Vec<Generation>, Vec<f64>)> {
        let comm = self.run.comm();
        if let Some(group) = self.run.tensor_group() {
            // A tensor group trains on the same sequences: its rank 0's, to the bit (the
            // groups' queues may hand the requests out to other batches).
            let (generations, seconds) = match comm.world_size() {
                1 => (pool.generate(requests, &|_| {})?.0, Vec::new()),
                // An engine split over the group: its ranks generate together, so each group
                // takes a fixed share (a queue per tensor rank would hand them different ones).
                _ if pool.in_tensor_group() => {
                    let started = Instant::now();
                    let generations = map_sharded(comm, requests, |mine| {
                        Ok::<_, PpoError>(pool.generate(mine, &|_| {})?.0)
                    })?;
                    let seconds = aligner_core::parallel::gather(comm, &started.elapsed().as_secs_f64())?;
                    (generations, seconds)
                }
                _ => self.generate_balanced(pool, requests)?,
            };
            let generations = aligner_core::parallel::broadcast_from_root(group.as_ref(), &generations)?;
            return Ok((generations, seconds));
        }
        if comm.world_size() == 1 {
            return Ok((pool.generate(requests, &|_| {})?.0, Vec::new()));
        }
        self.generate_balanced(pool, requests)
    }

    /// [`Sampler::generate`] over the data-parallel ranks, from one queue.
    fn generate_balanced(
        &self,
        pool: &mut WorkerPool,
        requests: &[GenerationRequest],
    ) -> Result<(Vec<Generation>, Vec<f64>)> {
        let comm = self.run.comm();
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
}

/// A step's episode metrics: turns, tool calls and tool errors per episode, episodes a
/// failing environment ended, observation tokens, the environment's reward per turn.
pub(crate) fn episode_metrics(metrics: &mut Map<String, Value>, episodes: &[Episode]) {
    metrics.extend(EpisodeStats::of(episodes).metrics());
}

fn mean(xs: &[f32]) -> f64 {
    xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len().max(1) as f64
}
