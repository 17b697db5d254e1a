//! # aligner-spin
//!
//! Self-play fine-tuning (Chen et al., 2024). Each iteration freezes a snapshot of the policy as
//! the reference; the reference answers every SFT prompt with the rollout engine; the pairs
//! (ground-truth response = chosen, the reference's own = rejected) train the policy with
//! aligner-dpo's loss at `spin.beta`; at the end of the iteration the reference takes the
//! policy's weights — and only then. Each iteration is an ordinary run folder
//! (`iter-K/`: generations, cached reference log-probs, metrics, `final/`), and `spin.jsonl`
//! records the ground-truth-over-generation log-prob margin under each iteration's reference.

use std::path::Path;

use aligner_core::cache::CacheKey;
use aligner_core::data::{PromptResponseRow, append_jsonl, read_jsonl};
use aligner_core::run::{RunDir, data_files};
use aligner_core::start::{load_model_split, policy_store};
use aligner_core::train::{DataSection, ModelSection, ModelStore, TrainSection, Trainer};
use aligner_core::{CausalLm, CoreError, Device, LlamaConfig, TextTokenizer};
use aligner_dpo::objective::{DpoExample, DpoObjective, DpoRow, attach_reference, dpo_example};
use aligner_dpo::{LossRegistry, LossSpec};
use aligner_gen::{Engine, EngineOptions, GenerationRequest, SamplingParams};
use burn::module::Module;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// What can go wrong in a SPIN run.
#[derive(Debug, thiserror::Error)]
pub enum SpinError {
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error(transparent)]
    Gen(#[from] aligner_gen::GenError),
    #[error(transparent)]
    Dpo(#[from] aligner_dpo::DpoError),
    #[error(transparent)]
    Loss(#[from] aligner_dpo::LossError),
}

pub type Result<T, E = SpinError> = std::result::Result<T, E>;

/// `[spin]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpinSection {
    pub iterations: usize,
    /// The preference loss of each iteration, by its registry name (SPIN's paper: `dpo`).
    pub loss: String,
    /// β of the DPO loss in the first iteration.
    pub beta: f64,
    /// β from the second iteration on. Once the reference's answers resemble the data, the
    /// pairs carry little signal and a small β lets the policy swing past the data (measured
    /// on the shipped task: at β 0.1 the second iteration took the samples' sentiment from
    /// 2.2 to 1.0–1.6 against the data's 2.2; at 5.0 it stays at 2.15). A larger β keeps those
    /// steps small.
    pub beta_later: f64,
    pub max_new_tokens: usize,
    /// Sampling temperature of the reference's answers (0 = greedy).
    pub temperature: f32,
    /// Keep training on earlier iterations' generations too (scored by the new reference), as
    /// the paper does. Measured on the shipped task (lexicon of samples, 3 seeds, after
    /// iteration 1: 2.20 on the held-out prompts, 1.18 on 24 written ones): iteration 2 alone
    /// gives 2.15 / 0.69 — it learns the train prompts' pairs and loses on other prompts; mixed
    /// with iteration 1's pairs, 2.41 / 1.44.
    pub mix_previous: bool,
    /// Weight of an NLL term on the ground truth (per token) added to the DPO loss (RPO's
    /// regulariser): once the reference's answers resemble the data, DPO alone lowers the
    /// likelihood of both and the policy drifts away from the data it is meant to approach.
    pub sft_weight: f64,
    pub seed: u64,
}

impl Default for SpinSection {
    fn default() -> Self {
        Self {
            iterations: 2,
            loss: "dpo".into(),
            beta: 0.1,
            beta_later: 5.0,
            max_new_tokens: 48,
            temperature: 1.0,
            mix_previous: true,
            sft_weight: 1.0,
            seed: 0,
        }
    }
}

impl SpinSection {
    /// The DPO β of iteration `k` (from 1): `beta` for the first, `beta_later` after it.
    pub fn beta(&self, k: usize) -> f64 {
        if k <= 1 { self.beta } else { self.beta_later }
    }
}

/// `aligner spin` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpinConfig {
    pub model: ModelSection,
    /// SFT data (`{"prompt", "response"}`): prompts to answer, responses as ground truth.
    pub data: DataSection,
    /// The loop of each iteration (`epochs`: passes over that iteration's pairs).
    pub train: TrainSection,
    pub spin: SpinSection,
    /// The reward–KL figures of the policy's own samples (KL to the start model), at every
    /// validation of every iteration.
    pub frontier: aligner_gen::FrontierSection,
    /// Tensor groups (`parallel.tensor`): each rank reads, answers with, scores with and trains
    /// only its blocks of the policy; each group answers and scores a share of the prompts.
    pub parallel: aligner_core::train::ParallelSection,
}

impl Default for SpinConfig {
    fn default() -> Self {
        let mut train = TrainSection::embedded_default(1);
        // Small steps: a larger rate overshoots the data within one iteration (measured: 5e-4
        // turns the policy's samples repetitive and the margin strongly negative).
        train.lr = 1e-4;
        train.save_every = 0;
        Self {
            model: ModelSection::default(),
            data: DataSection::shipped("train.sft.jsonl", "test.sft.jsonl"),
            train,
            spin: SpinSection::default(),
            frontier: aligner_gen::FrontierSection::shipped(),
            parallel: Default::default(),
        }
    }
}

/// One iteration's record in `spin.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IterationReport {
    pub iteration: usize,
    /// Mean over the training pairs of `log π_ref(ground truth) − log π_ref(generation)`
    /// (summed over response tokens) under this iteration's reference.
    pub margin: f64,
    /// The same per response token.
    pub margin_per_token: f64,
    pub eval: serde_json::Map<String, Value>,
    /// Seconds the generation engine took to take this iteration's reference weights (one
    /// engine serves every iteration, refit in place); `None` where it was built.
    #[serde(default)]
    pub refit_seconds: Option<f64>,
}

/// A SPIN run, the whole of it: the policy of `[model]` (LoRA adapters when configured) through
/// `spin.iterations` iterations into `run`, each iteration's loss `spin.loss` from `registry`.
/// Iterations whose `final/` exists are taken as done, so a resumed run continues after them.
pub fn train(
    config: &SpinConfig,
    registry: &LossRegistry,
    run: &RunDir,
    device: &Device,
) -> Result<Vec<IterationReport>> {
    let spin = &config.spin;
    aligner_core::train::check_values(&[
        ("spin.beta", spin.beta, aligner_core::train::Range::Positive),
        (
            "spin.beta_later",
            spin.beta_later,
            aligner_core::train::Range::Positive,
        ),
        (
            "spin.temperature",
            spin.temperature.into(),
            aligner_core::train::Range::NonNegative,
        ),
        (
            "spin.sft_weight",
            spin.sft_weight,
            aligner_core::train::Range::NonNegative,
        ),
    ])?;
    aligner_core::train::check_counts(&[
        ("spin.iterations", spin.iterations),
        ("spin.max_new_tokens", spin.max_new_tokens),
    ])?;
    run.start(config)?;
    // In tensor groups each rank reads only its blocks: every iteration answers, scores and
    // trains on them.
    let (lm, grid) = load_model_split(&config.model, &config.parallel, run, device)?;
    let run = &grid;
    // Checked before the first iteration's answers are generated.
    config.data.max_len(&lm.config)?;
    aligner_core::train::check_new_tokens(&[("spin.max_new_tokens", spin.max_new_tokens)], &lm.config)?;
    let frontier = config
        .frontier
        .for_split_start_model(&lm, &config.model, run, device)?;
    let mut model = lm.model;
    let store = policy_store(&mut model, &config.model, &lm.config, &lm.dir, device)?;
    let spin = Spin {
        config,
        registry,
        llama: &lm.config,
        tokenizer: &lm.tokenizer,
        store: store.as_ref(),
        run,
        device: device.clone(),
        frontier: frontier.as_ref(),
    };
    spin.run(model)
}

/// The pieces a SPIN run works with.
pub struct Spin<'a> {
    pub config: &'a SpinConfig,
    /// Where the iterations' loss (`spin.loss`) comes from.
    pub registry: &'a LossRegistry,
    pub llama: &'a LlamaConfig,
    pub tokenizer: &'a TextTokenizer,
    pub store: &'a dyn ModelStore<CausalLm>,
    /// The SPIN run's folder (each iteration is a run of its own inside it).
    pub run: &'a RunDir,
    pub device: Device,
    /// Measured at every validation: the frontier against the start model.
    pub frontier: Option<&'a aligner_gen::Frontier>,
}

impl Spin<'_> {
    /// Runs every iteration from `policy` (LoRA attached when configured); iterations whose
    /// `final/` exists are taken as done (a resumed run continues after them).
    pub fn run(&self, mut policy: CausalLm) -> Result<Vec<IterationReport>> {
        let (train_rows, validation_rows) =
            data_files(&self.config.data)?.load(|path, _| read_jsonl::<PromptResponseRow>(path))?;
        let train_config = &self.config.train;
        let mut reports = Vec::new();
        let mut earlier: Vec<DpoRow> = Vec::new();
        let mut engine = None;
        for k in 1..=self.config.spin.iterations {
            let iteration = self.run.child(&format!("iter-{k}"));
            let dir = iteration.path().to_path_buf();
            if iteration.agree(&dir.join("final/config.json").exists())? {
                policy = self.store.load(&dir.join("final"), &self.device)?;
                if let Some(group) = self.run.tensor_group() {
                    // Kept as this rank's blocks, as the iterations hold the policy.
                    policy = aligner_core::train::tensor::split_parameters(policy, group)?;
                }
                tracing::info!(iteration = k, "already done; continuing from its final model");
                // A resumed run mixes in the answers the finished iteration saved.
                let file = dir.join("generations.jsonl");
                let saved = saved_answers(&file, train_rows.len()).ok_or_else(|| {
                    CoreError::Invalid(format!(
                        "{}: iteration {k} is done but its answers are missing or incomplete",
                        file.display()
                    ))
                })?;
                earlier.extend(pairs(&train_rows, saved));
                continue;
            }
            if self.run.is_writer() {
                std::fs::create_dir_all(&dir).map_err(|e| CoreError::cannot_write(&dir, e))?;
            }
            // The snapshot that answers the prompts and scores the pairs for this iteration.
            let reference = policy.valid();
            let (engine, refit) = Engine::refit_or_build(
                &mut engine,
                &reference,
                self.llama,
                Some(self.tokenizer),
                EngineOptions::default(),
            )?;
            let mut rows =
                self.self_play_rows(engine, &train_rows, &dir.join("generations.jsonl"), k, &reference)?;
            let current = rows.clone();
            let current_len = current.len();
            if self.config.spin.mix_previous {
                rows.extend(earlier.iter().cloned());
            }
            earlier.extend(current);
            let eval_rows = self.self_play_rows(
                engine,
                &validation_rows,
                &dir.join("generations_validation.jsonl"),
                k,
                &reference,
            )?;
            let batch = train_config.batch_size.max(1) * 2;
            let max_len = self.config.data.max_len(self.llama)?;
            let mut train = self.examples(&rows, max_len)?;
            let comm = self.run.comm();
            attach_reference(
                &mut train,
                &reference,
                &dir.join("reference_train.jsonl"),
                batch,
                comm,
            )?;
            let mut validation = self.examples(&eval_rows, max_len)?;
            attach_reference(
                &mut validation,
                &reference,
                &dir.join("reference_validation.jsonl"),
                batch,
                comm,
            )?;
            // The margin of this iteration's own generations (the mixed-in earlier ones were
            // the earlier references' answers).
            let (margin, margin_per_token) = margins(&train[..current_len]);
            tracing::info!(
                iteration = k,
                margin,
                margin_per_token,
                pairs = train.len(),
                "SPIN iteration"
            );
            let trainer = Trainer {
                config: train_config,
                objective: &self.objective(k)?,
                store: self.store,
                train: &train,
                validation: &validation,
                run: &iteration,
                device: self.device.clone(),
                model_eval: self
                    .frontier
                    .map(|f| f as &dyn aligner_core::train::ModelEval<CausalLm>),
            };
            // In tensor groups each rank keeps its blocks: no rank ever holds the whole policy.
            let (trained, summary) = trainer.run_in_blocks(policy)?;
            // The reference takes the policy's weights at the start of the next iteration.
            policy = trained.valid();
            let report = IterationReport {
                iteration: k,
                refit_seconds: refit.map(|d| d.as_secs_f64()),
                margin,
                margin_per_token,
                eval: summary.final_eval,
            };
            if self.run.is_writer() {
                append_jsonl(&self.run.join("spin.jsonl"), &report)?;
            }
            reports.push(report);
        }
        // In tensor groups the writer's group sends it the policy's blocks.
        let whole = aligner_core::train::tensor::whole_on_writer(&policy, self.run);
        self.run.write_shared(|| match &whole {
            Some(policy) => self.store.save(policy, &self.run.final_dir()),
            None => Ok(()),
        })?;
        Ok(reports)
    }

    /// Iteration `k`'s loss: `spin.loss` at `spin.beta` (`spin.beta_later` from the second
    /// iteration on) plus the NLL term of `spin.sft_weight`.
    fn objective(&self, k: usize) -> Result<DpoObjective> {
        let spin = &self.config.spin;
        let beta = spin.beta(k);
        Ok(DpoObjective {
            loss: self.registry.build(&spin.loss, &LossSpec::with_beta(beta))?,
            sft_weight: spin.sft_weight,
        })
    }

    /// Ground truth as chosen, the answer of `reference` (the engine holding this iteration's
    /// reference weights) as rejected; answers are written to `file` (and read back from it
    /// when a resumed run already made them from the same weights, rows and sampling settings:
    /// `weights`, the reference's snapshot, keys the file).
    fn self_play_rows(
        &self,
        reference: &mut Engine,
        rows: &[PromptResponseRow],
        file: &Path,
        iteration: usize,
        weights: &CausalLm,
    ) -> Result<Vec<DpoRow>> {
        let prompts: Vec<String> = rows
            .iter()
            .map(|r| r.prompt.render(self.tokenizer))
            .collect::<Result<_, _>>()?;
        let spin = &self.config.spin;
        let key = self.run.is_writer().then(|| {
            CacheKey::builder("spin answers")
                .weights(weights)
                .value(rows)
                .value(&(iteration, spin.temperature, spin.seed, spin.max_new_tokens))
                .finish()
        });
        let saved = key
            .as_ref()
            .filter(|key| aligner_core::cache::read_fresh(file, key).is_some())
            .and_then(|_| saved_answers(file, rows.len()));
        let saved = self.run.agree(&saved)?;
        let answers: Vec<String> = match saved {
            Some(saved) => saved,
            None => {
                let requests = prompts
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        Ok(GenerationRequest {
                            prompt_ids: self.tokenizer.encode(p, true)?,
                            params: SamplingParams {
                                temperature: self.config.spin.temperature,
                                seed: self
                                    .config
                                    .spin
                                    .seed
                                    .wrapping_add((iteration * 1_000_000 + i) as u64),
                                max_new_tokens: self.config.spin.max_new_tokens,
                                ..SamplingParams::default()
                            },
                            guidance: None,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let (split, slots) = (reference.in_tensor_group(), reference.slots().max(1));
                let mut answer = |requests: &[GenerationRequest]| {
                    let outputs = reference.generate(requests)?;
                    requests
                        .iter()
                        .zip(&outputs)
                        .map(|(r, o)| self.tokenizer.decode_continuation(&r.prompt_ids, &o.token_ids))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(SpinError::from)
                };
                let comm = self.run.comm();
                let answers = match split {
                    // A tensor group's ranks decode together: each data rank's group takes
                    // its fixed share of the prompts.
                    true => aligner_core::parallel::map_sharded(comm, &requests, answer)?,
                    // Data parallel: the ranks' engines take the prompts a batch at a time.
                    false => {
                        let (answers, work) =
                            aligner_core::parallel::map_balanced(comm, requests.len(), slots, |range| {
                                answer(&requests[range])
                            })?;
                        if work.len() > 1 {
                            tracing::info!(?work, "self-play answers per rank");
                        }
                        answers
                    }
                };
                // A tensor group's ranks train on the same pairs: the world's rank 0's answers
                // (the groups' queues may batch the prompts differently).
                let answers = match self.run.tensor_group() {
                    Some(_) => self.run.agree(&answers)?,
                    None => answers,
                };
                let text: String = rows
                    .iter()
                    .zip(&answers)
                    .map(|(r, a)| format!("{}\n", json!({"prompt": r.prompt, "response": a})))
                    .collect();
                if let Some(key) = &key {
                    aligner_core::cache::write(file, key, &text)?;
                }
                answers
            }
        };
        Ok(pairs(rows, answers))
    }

    fn examples(&self, rows: &[DpoRow], max_len: usize) -> Result<Vec<DpoExample>> {
        Ok(rows
            .iter()
            .map(|r| dpo_example(r, self.tokenizer, max_len))
            .collect::<Result<Vec<_>, _>>()?)
    }
}

/// The answers an iteration saved in `file`, when it holds one for each of `expected` prompts.
fn saved_answers(file: &Path, expected: usize) -> Option<Vec<String>> {
    match read_jsonl::<PromptResponseRow>(file) {
        Ok(saved) if saved.len() == expected => Some(saved.into_iter().map(|r| r.response).collect()),
        _ => None,
    }
}

/// SPIN's pairs: the ground truth chosen over the reference's answer.
fn pairs(rows: &[PromptResponseRow], answers: Vec<String>) -> Vec<DpoRow> {
    rows.iter()
        .zip(answers)
        .map(|(r, answer)| DpoRow {
            prompt: Some(r.prompt.clone()),
            chosen: r.response.clone().into(),
            rejected: answer.into(),
            chosen_reward: None,
            rejected_reward: None,
        })
        .collect()
}

/// Mean reference margin of chosen over rejected: per sequence and per response token.
fn margins(examples: &[DpoExample]) -> (f64, f64) {
    let n = examples.len().max(1) as f64;
    let (mut seq, mut tok) = (0.0, 0.0);
    for e in examples {
        if let Some((c, r)) = e.reference {
            seq += (c - r) as f64;
            tok += c as f64 / e.chosen.n_response_tokens().max(1) as f64
                - r as f64 / e.rejected.n_response_tokens().max(1) as f64;
        }
    }
    (seq / n, tok / n)
}

/// The key that moved from `[spin]` to `[train]`, the loop's section in every method.
pub const MOVED_KEYS: &[aligner_core::train::MovedKey] = &[("spin.epochs", "train.epochs")];

#[cfg(test)]
mod tests {
    use super::*;
    use aligner_core::score::ScoredSequence;

    fn rows(lines: &[&str]) -> Vec<PromptResponseRow> {
        lines.iter().map(|l| serde_json::from_str(l).unwrap()).collect()
    }

    #[test]
    fn the_ground_truth_is_chosen_over_the_references_answer() {
        let rows = rows(&[
            r#"{"prompt": "Once", "response": " upon a time"}"#,
            r#"{"prompt": "Tom", "response": " ran home"}"#,
        ]);
        let pairs = pairs(&rows, vec![" there was".into(), " sat".into()]);
        let expected: Vec<DpoRow> = [
            r#"{"prompt": "Once", "chosen": " upon a time", "rejected": " there was"}"#,
            r#"{"prompt": "Tom", "chosen": " ran home", "rejected": " sat"}"#,
        ]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
        assert_eq!(format!("{pairs:?}"), format!("{expected:?}"));
    }

    #[test]
    fn margins_are_chosen_minus_rejected_per_sequence_and_per_token() {
        // Prompt of 2 ids: 3 response tokens chosen, 1 rejected.
        let sequence = |n: u32| ScoredSequence {
            ids: (0..n).collect(),
            prompt_len: 2,
            observed: Vec::new(),
        };
        let example = |reference: Option<(f32, f32)>| DpoExample {
            chosen: sequence(5),
            rejected: sequence(3),
            reference,
            rewards: None,
        };
        let examples = [example(Some((-6.0, -2.0))), example(Some((-3.0, -4.0)))];
        let (per_sequence, per_token) = margins(&examples);
        // ((-6 + 2) + (-3 + 4)) / 2 and ((-6/3 + 2/1) + (-3/3 + 4/1)) / 2.
        assert!((per_sequence - -1.5).abs() < 1e-9, "{per_sequence}");
        assert!((per_token - 1.5).abs() < 1e-9, "{per_token}");
        assert_eq!(margins(&[]), (0.0, 0.0));
    }

    #[test]
    fn saved_answers_are_reused_only_when_every_prompt_has_one() {
        let dir = std::env::temp_dir().join(format!("aligner-spin-answers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("generations.jsonl");
        std::fs::write(
            &file,
            "{\"prompt\": \"Once\", \"response\": \" a\"}\n{\"prompt\": \"Tom\", \"response\": \" b\"}\n",
        )
        .unwrap();
        assert_eq!(
            saved_answers(&file, 2),
            Some(vec![" a".to_string(), " b".to_string()])
        );
        // A file cut short (an interrupted iteration) or of another run is generated again.
        assert_eq!(saved_answers(&file, 3), None);
        assert_eq!(saved_answers(&dir.join("missing.jsonl"), 2), None);
        std::fs::write(&file, "not json\n").unwrap();
        assert_eq!(saved_answers(&file, 1), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_first_iteration_takes_beta_and_the_later_ones_beta_later() {
        let spin = SpinSection::default();
        assert_eq!((spin.beta(1), spin.beta(2), spin.beta(5)), (0.1, 5.0, 5.0));
        let config: SpinConfig =
            toml::from_str("[spin]\nbeta = 0.3\nbeta_later = 0.7\niterations = 3\n").unwrap();
        assert_eq!((config.spin.beta(1), config.spin.beta(3)), (0.3, 0.7));
        // The loop's other settings keep SPIN's defaults.
        assert_eq!(config.train.lr, 1e-4);
        assert!(toml::from_str::<SpinConfig>("[spin]\nbeta_latter = 1.0\n").is_err());
    }
}
