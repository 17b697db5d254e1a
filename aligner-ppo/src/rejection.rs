//! Rejection sampling (best-of-n, as in Llama 2): for each prompt, `rs.n` samples from the
//! policy scored by the reward (the reward model, or any `[[reward]]`), the best kept (above an optional threshold), then SFT on
//! them; several rounds.
//!
//! It lives here, beside PPO, because it is made of the same roles minus the critic: the
//! rollout engine as the actor's sampler and the frozen reward model as the judge
//! ([`crate::critic::rewards_of`] on the same [`crate::rollout::Layout`]); its update is plain
//! SFT from aligner-core.

use aligner_core::data::{EncodedPrompt, Prompt, append_jsonl};
use aligner_core::run::RunDir;
use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::sft::{SftExample, SftObjective, SftRow};
use aligner_core::train::{DataSection, ModelSection, ModelStore, TrainSection, Trainer};
use aligner_core::{CausalLm, CoreError, Device, LlamaConfig, TextTokenizer};
use aligner_gen::{Engine, EngineOptions, GenerationRequest, RewardInput, Rewards, SamplingParams};
use burn::module::Module;
use serde::{Deserialize, Serialize};

use crate::config::RewardModelSection;
use crate::error::{PpoError, Result};

/// `[rs]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RsSection {
    pub rounds: usize,
    /// Samples per prompt.
    pub n: usize,
    /// Keep the best sample only when its reward reaches this.
    pub threshold: Option<f32>,
    pub max_new_tokens: usize,
    pub temperature: f32,
    /// Held-out prompts scored after each round (0 = all).
    pub eval_prompts: usize,
    pub seed: u64,
    /// The best of n is the sample of the highest `reward − kl_coef · (log π(y) − log π_ref(y))`,
    /// π_ref the start model: the best-of-n form of PPO's KL-regularised objective. 0 = by
    /// reward alone (Llama 2's choice), which drifts into unreadable text over rounds.
    pub kl_coef: f64,
}

impl Default for RsSection {
    fn default() -> Self {
        Self {
            rounds: 3,
            n: 4,
            threshold: None,
            max_new_tokens: 48,
            temperature: 1.0,
            eval_prompts: 0,
            seed: 0,
            kl_coef: 0.2,
        }
    }
}

/// `aligner rs` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RsConfig {
    pub model: ModelSection,
    pub reward_model: RewardModelSection,
    /// Prompt files: train (sampled each round) and validation (scored).
    pub data: DataSection,
    /// The SFT loop of each round.
    pub train: TrainSection,
    pub rs: RsSection,
    /// Rewards as functions (as `aligner ppo`'s); empty: the reward model of `[reward_model]`.
    #[serde(skip_serializing_if = "aligner_gen::RewardSpecs::is_empty")]
    pub reward: aligner_gen::RewardSpecs,
    /// The reward–KL figures of the policy's own samples after each round.
    pub frontier: aligner_gen::FrontierSection,
    /// Multi-turn episodes (as `aligner ppo`'s): each sample is a whole episode, scored by the
    /// `[reward]` functions plus the environment's turn rewards; the best one's own tokens are
    /// trained on, its observations masked.
    #[serde(skip_serializing_if = "environment_is_off")]
    pub environment: aligner_gen::env::EnvironmentSection,
    /// Tensor groups (`parallel.tensor`): each round's SFT trains on them; the samples are
    /// drawn by every rank's engine, each a share, with the whole model.
    pub parallel: aligner_core::train::ParallelSection,
}

fn environment_is_off(section: &aligner_gen::env::EnvironmentSection) -> bool {
    !section.enabled()
}

impl Default for RsConfig {
    fn default() -> Self {
        let mut train = TrainSection::embedded_default(1);
        // Measured with `aligner eval` after 3 rounds: lr 1e-3 by reward alone ends at lexicon
        // 3.07, KL 58, NLL 2.93 (unreadable); lr 1e-4 at 3.85, KL 21, NLL 1.67; with the KL
        // term of the selection (kl_coef 0.2) at 3.11, KL 14, NLL 1.49.
        train.lr = 1e-4;
        train.save_every = 0;
        train.eval_every = 0;
        Self {
            model: ModelSection::default(),
            reward_model: RewardModelSection::default(),
            data: DataSection::shipped("train.prompts.jsonl", "test.prompts.jsonl"),
            train,
            rs: RsSection::default(),
            reward: aligner_gen::RewardSpecs::default(),
            frontier: aligner_gen::FrontierSection::shipped(),
            environment: aligner_gen::env::EnvironmentSection::default(),
            parallel: Default::default(),
        }
    }
}

/// One round's record in `rs.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundReport {
    pub round: usize,
    /// Mean reward of the policy's samples on the held-out prompts before the round's SFT.
    pub eval_reward_before: f64,
    /// ... and after it.
    pub eval_reward_after: f64,
    /// Mean reward of all samples and of the kept best ones.
    pub sample_reward: f64,
    pub kept_reward: f64,
    pub kept: usize,
    /// Seconds spent handing the round's new weights to the generation engine (one engine
    /// serves every round, refit in place).
    #[serde(default)]
    pub refit_seconds: f64,
    /// The frontier figures after the round (`eval_frontier/...`).
    #[serde(flatten)]
    pub frontier: serde_json::Map<String, serde_json::Value>,
}

/// A rejection-sampling run.
pub struct RejectionSampling<'a> {
    pub config: &'a RsConfig,
    pub llama: &'a LlamaConfig,
    pub tokenizer: &'a TextTokenizer,
    pub store: &'a dyn ModelStore<CausalLm>,
    /// The reward functions; `None` when an environment's rewards are the only ones.
    pub reward: Option<&'a Rewards>,
    /// `[environment]`: each sample a multi-turn episode.
    pub env: Option<&'a dyn aligner_gen::env::Environment>,
    /// Prompts with their rows' fields.
    pub train_prompts: &'a [EncodedPrompt],
    pub eval_prompts: &'a [EncodedPrompt],
    /// The run's folder (each round's SFT is a run of its own inside it).
    pub run: &'a RunDir,
    /// The same run with its ranks in tensor groups (`parallel.tensor`), which each round's
    /// SFT trains on (`run` itself without them).
    pub grid: &'a RunDir,
    pub device: Device,
    /// The start model, for the KL term of the selection (`rs.kl_coef` > 0).
    pub reference: Option<&'a CausalLm>,
    /// Measured after each round (rank 0).
    pub frontier: Option<&'a aligner_gen::Frontier>,
}

impl RejectionSampling<'_> {
    pub fn run(&self, mut policy: CausalLm) -> Result<Vec<RoundReport>> {
        let cfg = &self.config.rs;
        let eval_limit = match cfg.eval_prompts {
            0 => self.eval_prompts.len(),
            n => n.min(self.eval_prompts.len()),
        };
        let eval = &self.eval_prompts[..eval_limit];
        let mut reports = Vec::new();
        let mut engine = None;
        let mut before = self.sample(&mut engine, &policy, eval, 1, u64::MAX / 2)?.mean;
        for round in 1..=cfg.rounds {
            let seed = cfg.seed.wrapping_add(round as u64 * 10_000_000);
            let sampled = self.sample(&mut engine, &policy, self.train_prompts, cfg.n.max(1), seed)?;
            let (sample_reward, samples, refit) = (sampled.mean, sampled.samples, sampled.refit_seconds);
            let max_len = self.config.data.max_len(self.llama)?;
            let mut train: Vec<SftExample> = Vec::new();
            let mut kept_sum = 0.0;
            for (prompt, group) in self.train_prompts.iter().zip(samples.chunks(cfg.n.max(1))) {
                let best = best_of(group).expect("n >= 1");
                if cfg.threshold.is_none_or(|t| best.reward >= t) {
                    kept_sum += best.reward as f64;
                    train.push(match &best.episode {
                        // An episode trains on its own tokens as sampled, observations masked.
                        Some(episode) => episode.example(&prompt.ids, max_len),
                        None => SftExample::from_row(
                            &SftRow::PromptResponse {
                                prompt: Prompt::Text(prompt.text.clone()),
                                response: best.text.clone(),
                            },
                            self.tokenizer,
                            max_len,
                        )?,
                    });
                }
            }
            let kept = train.len();
            let round_run = self.grid.child(&format!("round-{round}"));
            let dir = round_run.path();
            if self.run.is_writer() {
                std::fs::create_dir_all(dir).map_err(|e| CoreError::cannot_write(dir, e))?;
            }
            if kept > 0 {
                let trainer = Trainer {
                    config: &self.config.train,
                    objective: &SftObjective,
                    store: self.store,
                    train: &train,
                    validation: &[],
                    run: &round_run,
                    device: self.device.clone(),
                    model_eval: None,
                };
                policy = trainer.run(policy)?.0.valid();
            }
            let evaluated = self.sample(&mut engine, &policy, eval, 1, u64::MAX / 2)?;
            let (after, refit_after) = (evaluated.mean, evaluated.refit_seconds);
            let frontier = match self.frontier.filter(|_| self.run.is_writer()) {
                Some(frontier) => frontier.evaluate(&policy)?.0.metrics(),
                None => Default::default(),
            };
            let report = RoundReport {
                round,
                eval_reward_before: before,
                eval_reward_after: after,
                sample_reward,
                kept_reward: kept_sum / kept.max(1) as f64,
                kept,
                refit_seconds: refit + refit_after,
                frontier,
            };
            tracing::info!(?report, "rejection-sampling round");
            if self.run.is_writer() {
                append_jsonl(&self.run.join("rs.jsonl"), &report)?;
            }
            reports.push(report);
            before = after;
        }
        self.run
            .write_shared(|| self.store.save(&policy, &self.run.final_dir()))?;
        Ok(reports)
    }

    /// `log π(y) − log π_ref(y)` of each output (zeros without a KL term).
    fn drift(&self, requests: &[GenerationRequest], outputs: &[aligner_gen::Generation]) -> Result<Vec<f64>> {
        let reference = match self.reference.filter(|_| self.config.rs.kl_coef > 0.0) {
            Some(reference) => reference,
            None => return Ok(vec![0.0; outputs.len()]),
        };
        let sequences: Vec<ScoredSequence> = requests.iter().zip(outputs).map(|(r, o)| o.scored(r)).collect();
        let reference_lp = response_logprobs(reference, &sequences, 32)?;
        Ok(outputs
            .iter()
            .zip(reference_lp)
            .map(|(o, r)| o.token_logprobs.iter().map(|&v| v as f64).sum::<f64>() - r.total())
            .collect())
    }

    /// `n` samples per prompt (seeds from `seed`) from `policy` through the engine in
    /// `engine`, with their rewards.
    fn sample(
        &self,
        engine: &mut Option<Engine>,
        policy: &CausalLm,
        prompts: &[EncodedPrompt],
        n: usize,
        seed: u64,
    ) -> Result<Sampled> {
        let cfg = &self.config.rs;
        let params = SamplingParams {
            temperature: cfg.temperature,
            seed,
            max_new_tokens: cfg.max_new_tokens,
            ..SamplingParams::default()
        };
        let requests = GenerationRequest::repeated(prompts.iter().map(|p| p.ids.as_slice()), n, &params);
        let (engine, refit) = Engine::refit_or_build(
            engine,
            policy,
            self.llama,
            Some(self.tokenizer),
            EngineOptions::default(),
        )?;
        // Data parallel: the ranks' engines take the requests a batch at a time (a rank whose
        // samples come out shorter takes more), each scoring its own.
        let chunk = engine.slots().max(1);
        let (samples, work) =
            aligner_core::parallel::map_balanced(self.run.comm(), requests.len(), chunk, |range| {
                let owners: Vec<&EncodedPrompt> = range.clone().map(|i| &prompts[i / n]).collect();
                let first = range.start as u64;
                let requests = &requests[range];
                let (outputs, episodes) = match self.env {
                    None => (engine.generate(requests)?, None),
                    Some(env) => {
                        let episodes = self.config.environment.run(
                            env,
                            engine,
                            self.tokenizer,
                            requests,
                            |i| owners[i],
                            seed.wrapping_add(first),
                            cfg.max_new_tokens,
                        )?;
                        let outputs = episodes.iter().map(|e| e.generation.clone()).collect();
                        (outputs, Some(episodes))
                    }
                };
                let texts: Vec<String> = requests
                    .iter()
                    .zip(&outputs)
                    .map(|(r, o)| self.tokenizer.decode_continuation(&r.prompt_ids, &o.token_ids))
                    .collect::<Result<_, _>>()?;
                let inputs: Vec<RewardInput<'_>> = owners
                    .iter()
                    .zip(&outputs)
                    .zip(&texts)
                    .map(|((p, o), text)| RewardInput {
                        prompt: &p.text,
                        response: text,
                        prompt_ids: &p.ids,
                        response_ids: &o.token_ids,
                        stop_reason: o.stop_reason,
                        fields: &p.fields,
                    })
                    .collect();
                let mut rewards = match self.reward {
                    Some(reward) => reward.score_parts(&inputs)?.total,
                    None => vec![0.0; inputs.len()],
                };
                let drift = self.drift(requests, &outputs)?;
                let mut tokens: Vec<Option<EpisodeTokens>> = vec![None; outputs.len()];
                if let Some(episodes) = episodes {
                    for ((r, t), e) in rewards.iter_mut().zip(tokens.iter_mut()).zip(episodes) {
                        *r += self.config.environment.reward_of(&e);
                        *t = Some(EpisodeTokens {
                            ids: e.generation.token_ids,
                            observed: e.observed,
                        });
                    }
                }
                texts
                    .into_iter()
                    .zip(rewards)
                    .zip(drift)
                    .zip(tokens)
                    .map(|(((text, reward), drift), episode)| {
                        let mut candidate = Candidate::new(text, reward as f32, drift, cfg.kl_coef);
                        candidate.episode = episode;
                        Ok(candidate)
                    })
                    .collect::<Result<Vec<_>, PpoError>>()
            })?;
        if work.len() > 1 {
            tracing::info!(?work, "samples per rank");
        }
        let mean = samples.iter().map(|s| s.reward as f64).sum::<f64>() / samples.len().max(1) as f64;
        Ok(Sampled {
            mean,
            samples,
            refit_seconds: refit.map_or(0.0, |d| d.as_secs_f64()),
        })
    }
}

/// A sample drawn for selection.
#[derive(Serialize, Deserialize)]
struct Candidate {
    text: String,
    reward: f32,
    /// What the best of n is chosen by: the reward less the KL term.
    selection: f64,
    /// A multi-turn episode's tokens after the prompt, as sampled.
    episode: Option<EpisodeTokens>,
}

/// An episode's tokens after the prompt and which of them the environment wrote.
#[derive(Clone, Serialize, Deserialize)]
struct EpisodeTokens {
    ids: Vec<u32>,
    observed: Vec<bool>,
}

impl EpisodeTokens {
    /// The SFT example of `prompt` and this episode: the model's own tokens trained, the
    /// prompt and the observations not; cut to `max_len` tokens.
    fn example(&self, prompt: &[u32], max_len: usize) -> SftExample {
        let mut ids = prompt.to_vec();
        ids.extend(&self.ids);
        let mut trained = vec![false; prompt.len()];
        trained.extend(self.observed.iter().map(|o| !o));
        trained.resize(ids.len(), true);
        ids.truncate(max_len);
        trained.truncate(max_len);
        SftExample {
            ids,
            trained,
            starts: Vec::new(),
            end: Vec::new(),
        }
    }
}

impl Candidate {
    /// A sample of `reward` whose log-ratio to the start model is `drift`, chosen by
    /// `reward − kl_coef · drift`.
    fn new(text: String, reward: f32, drift: f64, kl_coef: f64) -> Self {
        Self {
            text,
            reward,
            selection: reward as f64 - kl_coef * drift,
            episode: None,
        }
    }
}

/// The candidate of a prompt's group that is kept: the highest selection score.
fn best_of(group: &[Candidate]) -> Option<&Candidate> {
    group.iter().max_by(|a, b| a.selection.total_cmp(&b.selection))
}

/// What [`RejectionSampling::sample`] drew.
struct Sampled {
    /// Mean reward of the samples.
    mean: f64,
    /// Each sample, prompt by prompt (`n` in a row).
    samples: Vec<Candidate>,
    /// Seconds the engine took to take the policy's weights (0 when it was built).
    refit_seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kl_term_passes_over_a_high_reward_bought_with_drift() {
        // (reward, log π − log π_ref): the first has the highest reward but drifted 20 nats.
        let group = |kl_coef: f64| -> Vec<Candidate> {
            [(5.0, 20.0), (3.0, 2.0), (1.0, 0.0)]
                .iter()
                .enumerate()
                .map(|(i, &(r, d))| Candidate::new(i.to_string(), r, d, kl_coef))
                .collect()
        };
        // By reward alone: 5 > 3 > 1.
        assert_eq!(best_of(&group(0.0)).unwrap().text, "0");
        // 0.2: 5 − 4 = 1, 3 − 0.4 = 2.6, 1 − 0 = 1.
        assert_eq!(best_of(&group(0.2)).unwrap().text, "1");
        // 2.0: −35, −1, 1.
        assert_eq!(best_of(&group(2.0)).unwrap().text, "2");
        assert!(best_of(&[]).is_none());
    }

    /// A kept episode trains on the model's own tokens only.
    #[test]
    fn an_episode_trains_on_its_own_tokens() {
        let episode = EpisodeTokens {
            ids: vec![7, 8, 9, 10],
            observed: vec![false, true, true, false],
        };
        let example = episode.example(&[1, 5], 16);
        assert_eq!(example.ids, vec![1, 5, 7, 8, 9, 10]);
        assert_eq!(example.trained, vec![false, false, true, false, false, true]);
        assert_eq!(episode.example(&[1, 5], 4).ids, vec![1, 5, 7, 8]);
    }
}
