//! The engine on the shipped model: parity with transformers' greedy tokens, batch
//! independence (continuous batching included), agreement of token log-probs with the scoring
//! path, refit in place, and the worker pool.

use std::path::PathBuf;

use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::{Device, LoadedModel};
use aligner_gen::{
    Engine, EngineOptions, ForwardPath, Generation, GenerationRequest, SamplingParams, StopReason, WorkerPool,
};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn shipped() -> LoadedModel {
    LoadedModel::from_dir(&repo().join("assets/stories260K"), &Device::flex()).unwrap()
}

/// Both forward passes: the host kernels (the CPU default) and the Burn model (any device).
const PATHS: [ForwardPath; 2] = [ForwardPath::Host, ForwardPath::Burn];

fn engine(lm: &LoadedModel, slots: usize, path: ForwardPath) -> Engine {
    let engine = Engine::for_model(
        lm,
        EngineOptions {
            slots,
            cache_len: None,
            path,
        },
    );
    assert_eq!(engine.path(), path);
    engine
}

/// Same tokens and stop reasons; log-probs equal up to the float noise of another batch shape.
fn assert_same(a: &[Generation], b: &[Generation]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.token_ids, y.token_ids);
        assert_eq!(x.stop_reason, y.stop_reason);
        for (p, q) in x.token_logprobs.iter().zip(&y.token_logprobs) {
            assert!((p - q).abs() < 1e-4, "{p} vs {q}");
        }
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

const PROMPTS: [&str; 4] = [
    "Once upon a time",
    "Tom and his dog went to the park. They saw a big",
    "Lily",
    "The sun was shining and the birds were singing. A little boy named Max wanted to",
];

fn requests(lm: &LoadedModel, params: &SamplingParams) -> Vec<GenerationRequest> {
    PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| GenerationRequest {
            prompt_ids: lm.tokenizer.encode(p, true).unwrap(),
            params: SamplingParams {
                seed: 100 + i as u64,
                ..params.clone()
            },
            guidance: None,
        })
        .collect()
}

#[test]
fn greedy_tokens_equal_transformers() {
    let lm = shipped();
    for path in PATHS {
        let file = repo().join("tests/reference/stories260K_transformers.json");
        let reference: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        let cases = reference["greedy"].as_array().unwrap();
        let reqs: Vec<GenerationRequest> = cases
            .iter()
            .map(|c| GenerationRequest {
                prompt_ids: lm.tokenizer.encode(c["prompt"].as_str().unwrap(), true).unwrap(),
                params: SamplingParams::greedy(c["max_new_tokens"].as_u64().unwrap() as usize),
                guidance: None,
            })
            .collect();
        // The reference stops only at max_new_tokens.
        let mut generator = engine(&lm, 64, path).with_eos_ids(vec![]);
        let batched = generator.generate(&reqs).unwrap();
        for (case, out) in cases.iter().zip(&batched) {
            assert_eq!(out.token_ids, ids(&case["ids"]), "prompt {:?}", case["prompt"]);
            assert_eq!(out.stop_reason, StopReason::MaxTokens);
        }
        for (req, out) in reqs.iter().zip(&batched) {
            let alone = generator.generate(std::slice::from_ref(req)).unwrap();
            assert_eq!(alone[0].token_ids, out.token_ids);
        }
    }
}

/// Random Qwen3 (per-head q/k norms, sliding layers), Mistral (12-token window), OLMo 2
/// (output norms, whole-projection q/k norms), Gemma 2 (soft-capped scores and logits, GeGLU,
/// a query pre-scale) and Gemma 3 (local and global RoPE) models made by transformers (tools/hf_parity.py): the engine's greedy continuation of a 6-token prompt,
/// 40 tokens long (well past the window, so decoding reads a windowed cache), is transformers'
/// token for token, on both forward paths, alone and beside another prompt.
#[test]
fn greedy_tokens_of_windowed_and_qk_normed_models_equal_transformers() {
    // tests/reference/hf_random's families beyond Llama and Qwen2, one a line.
    let families = std::fs::read_to_string(repo().join("tests/reference/hf_random/families.txt")).unwrap();
    for name in families.lines() {
        let dir = repo().join("tests/reference/hf_random").join(name);
        let lm = LoadedModel::from_dir(&dir, &Device::flex()).unwrap();
        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected_logits.json")).unwrap())
                .unwrap();
        let want = ids(&expected["greedy"]);
        for path in PATHS {
            let mut engine = engine(&lm, 4, path).with_eos_ids(vec![]);
            let request =
                GenerationRequest::new(ids(&expected["prompt"]), SamplingParams::greedy(want.len()));
            let other = GenerationRequest::new(vec![1, 7, 7, 3], SamplingParams::greedy(30));
            let alone = engine.generate(std::slice::from_ref(&request)).unwrap();
            assert_eq!(alone[0].token_ids, want, "{name} on {path:?}");
            let batched = engine.generate(&[other, request]).unwrap();
            assert_eq!(batched[1].token_ids, want, "{name} on {path:?}, batched");
        }
    }
}

#[test]
fn a_batch_gives_each_prompt_what_it_gets_alone() {
    let lm = shipped();
    for path in PATHS {
        let mut generator = engine(&lm, 64, path);
        for params in [
            SamplingParams::greedy(40),
            SamplingParams {
                temperature: 0.9,
                top_k: 40,
                top_p: 0.95,
                max_new_tokens: 40,
                ..SamplingParams::default()
            },
        ] {
            let reqs = requests(&lm, &params);
            let batched = generator.generate(&reqs).unwrap();
            for (req, out) in reqs.iter().zip(&batched) {
                let alone = generator.generate(std::slice::from_ref(req)).unwrap();
                assert_eq!(alone[0].token_ids, out.token_ids);
                for (a, b) in alone[0].token_logprobs.iter().zip(&out.token_logprobs) {
                    assert!((a - b).abs() < 1e-4);
                }
            }
            // Reordering the batch changes nothing either.
            let mut reversed = reqs.clone();
            reversed.reverse();
            let again = generator.generate(&reversed).unwrap();
            for (out, rev) in batched.iter().zip(again.iter().rev()) {
                assert_eq!(out.token_ids, rev.token_ids);
            }
        }
    }
}

#[test]
fn seeds_make_samples_repeatable_and_different() {
    let lm = shipped();
    for path in PATHS {
        let mut generator = engine(&lm, 64, path);
        let params = SamplingParams {
            max_new_tokens: 30,
            ..SamplingParams::default()
        };
        let prompt_ids = lm.tokenizer.encode("Once upon a time", true).unwrap();
        let mut run = |seed| {
            let req = GenerationRequest {
                prompt_ids: prompt_ids.clone(),
                params: SamplingParams {
                    seed,
                    ..params.clone()
                },
                guidance: None,
            };
            generator.generate(&[req]).unwrap().remove(0).token_ids
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }
}

#[test]
fn engine_logprobs_equal_the_scoring_path() {
    let lm = shipped();
    for path in PATHS {
        let mut generator = engine(&lm, 64, path);
        let params = SamplingParams {
            temperature: 1.0,
            max_new_tokens: 48,
            ..SamplingParams::default()
        };
        let reqs = requests(&lm, &params);
        let outs = generator.generate(&reqs).unwrap();
        let seqs: Vec<ScoredSequence> = reqs
            .iter()
            .zip(&outs)
            .map(|(r, o)| ScoredSequence {
                ids: r.prompt_ids.iter().chain(&o.token_ids).copied().collect(),
                prompt_len: r.prompt_ids.len(),
                observed: Vec::new(),
            })
            .collect();
        let scored = response_logprobs(&lm.model, &seqs, 4).unwrap();
        for (o, s) in outs.iter().zip(&scored) {
            assert_eq!(o.token_logprobs.len(), s.token_logprobs.len());
            for (a, b) in o.token_logprobs.iter().zip(&s.token_logprobs) {
                assert!((a - b).abs() < 1e-4, "engine {a} vs score {b}");
            }
        }
    }
}

#[test]
fn stops_at_eos_and_at_stop_strings() {
    let lm = shipped();
    for path in PATHS {
        let mut generator = engine(&lm, 64, path);
        let prompt_ids = lm.tokenizer.encode("Once upon a time", true).unwrap();
        let req = |stop: Vec<String>| GenerationRequest {
            prompt_ids: prompt_ids.clone(),
            params: SamplingParams {
                stop_strings: stop,
                ..SamplingParams::greedy(200)
            },
            guidance: None,
        };
        let out = generator.generate(&[req(vec![])]).unwrap().remove(0);
        assert!(out.token_ids.len() < 200 || out.stop_reason == StopReason::MaxTokens);
        let text = lm.tokenizer.decode(&out.token_ids, true).unwrap();
        assert!(text.contains("Lily"), "{text}");
        let stopped = generator.generate(&[req(vec!["Lily".into()])]).unwrap().remove(0);
        assert_eq!(stopped.stop_reason, StopReason::StopString);
        let stopped_text = lm.tokenizer.decode(&stopped.token_ids, true).unwrap();
        assert!(stopped_text.ends_with("Lily") || stopped_text.contains("Lily"));
        assert!(stopped.token_ids.len() < out.token_ids.len());
        if out.stop_reason == StopReason::Eos {
            assert_eq!(*out.token_ids.last().unwrap(), 2);
        }
    }
}

/// Prompts of different lengths (1 to ~20 tokens) from the sentiment task's domain.
fn many_requests(lm: &LoadedModel, n: usize, params: &SamplingParams) -> Vec<GenerationRequest> {
    let words = [
        "Once", "upon", "a", "time", "there", "was", "a", "little", "girl", "named", "Lily", "who", "loved",
        "to", "play", "in", "the", "park", "with", "her", "dog",
    ];
    (0..n)
        .map(|i| GenerationRequest {
            prompt_ids: lm
                .tokenizer
                .encode(&words[..1 + (i * 7) % words.len()].join(" "), true)
                .unwrap(),
            params: SamplingParams {
                seed: 1000 + i as u64,
                max_new_tokens: 8 + (i * 13) % 40,
                ..params.clone()
            },
            guidance: None,
        })
        .collect()
}

fn sampled(max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 50,
        max_new_tokens,
        ..SamplingParams::default()
    }
}

/// Temperature sampling without filters: the Burn path draws it on the device.
fn plain(max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        max_new_tokens,
        ..SamplingParams::default()
    }
}

#[test]
fn continuous_batching_gives_each_prompt_what_it_gets_alone() {
    let lm = shipped();
    for path in PATHS {
        let mut alone = engine(&lm, 1, path);
        for params in [SamplingParams::greedy(0), sampled(0)] {
            let reqs = many_requests(&lm, 14, &params);
            // 3 rows for 14 prompts of different lengths: rows free at different steps and are
            // refilled mid-batch; the cursor runs past the buffers and the rows shift.
            let mut continuous = engine(&lm, 3, path);
            let outs = continuous.generate(&reqs).unwrap();
            let stats = continuous.stats();
            assert!(stats.admitted_mid_batch >= 8, "{stats:?}");
            // The Burn path's rows share a cursor, which runs past the buffers: rows shift.
            assert!(path == ForwardPath::Host || stats.shifts > 0, "{stats:?}");
            assert_eq!(stats.allocations, 1);
            for (req, out) in reqs.iter().zip(&outs) {
                let single = alone.generate(std::slice::from_ref(req)).unwrap().remove(0);
                assert_eq!(single.token_ids, out.token_ids);
                assert_eq!(single.stop_reason, out.stop_reason);
                for (a, b) in single.token_logprobs.iter().zip(&out.token_logprobs) {
                    assert!((a - b).abs() < 1e-4, "{a} vs {b}");
                }
            }
            // The same engine runs again with its cache kept.
            assert_eq!(continuous.generate(&reqs).unwrap(), outs);
            assert_eq!(continuous.stats().allocations, 1);
        }
    }
}

/// A LoRA policy as training leaves it: on the autodiff device, adapters with non-zero `B`.
fn lora_policy(lm: &LoadedModel) -> aligner_core::CausalLm {
    use aligner_core::model::{LoraSpec, projections};
    use burn::module::Module;
    use burn::tensor::{Distribution, Tensor};
    let device = Device::flex().autodiff();
    let mut model = lm.model.clone().fork(&device).train();
    let spec = LoraSpec {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: ["q_proj", "v_proj", "up_proj", "down_proj"]
            .map(String::from)
            .to_vec(),
    };
    model.attach_lora(&spec, &device);
    device.seed(7);
    for (_, layer) in projections(&mut model.model) {
        if let Some(lora) = &mut layer.lora {
            lora.b = lora.b.clone().map(|b| {
                Tensor::random(b.shape(), Distribution::Normal(0.0, 0.3), &b.device()).require_grad()
            });
        }
    }
    model
}

#[test]
fn refit_takes_new_weights_in_place() {
    let lm = shipped();
    for path in PATHS {
        // Sampled rows show that the weights changed; the equalities below compare greedy rows,
        // since two computations of the same weights differ by float noise (the merge order,
        // and the matmul split over however many threads are free), which can flip a sampled
        // token whose draw lands on a boundary, while greedy needs a near-tie of logits.
        let reqs = many_requests(&lm, 6, &sampled(0));
        let greedy = many_requests(
            &lm,
            6,
            &SamplingParams {
                temperature: 0.0,
                ..sampled(0)
            },
        );
        let mut engine = engine(&lm, 4, path);
        let before = engine.generate(&reqs).unwrap();
        let before_greedy = engine.generate(&greedy).unwrap();
        let capacity = engine.cache_len();

        let policy = lora_policy(&lm);
        let took = engine.refit(&policy).unwrap();
        assert!(took.as_secs_f64() < 5.0);
        let after = engine.generate(&reqs).unwrap();
        assert_ne!(before, after, "the new weights change the samples");
        assert_eq!(engine.cache_len(), capacity, "the cache stays allocated");
        assert_eq!(engine.stats().allocations, 1);
        let after_greedy = engine.generate(&greedy).unwrap();

        // A fresh engine on the merged weights decodes the same.
        let merged = burn::module::Module::valid(&policy).merged();
        let mut fresh = Engine::new(
            merged,
            lm.config.clone(),
            Some(lm.tokenizer.clone()),
            EngineOptions {
                path,
                ..EngineOptions::default()
            },
        );
        assert_same(&fresh.generate(&greedy).unwrap(), &after_greedy);

        // And the merged log-probs are the adapter model's own (score path, adapters unmerged).
        let seqs: Vec<ScoredSequence> = reqs
            .iter()
            .zip(&after)
            .map(|(r, o)| ScoredSequence {
                ids: r.prompt_ids.iter().chain(&o.token_ids).copied().collect(),
                prompt_len: r.prompt_ids.len(),
                observed: Vec::new(),
            })
            .collect();
        let scored = response_logprobs(&burn::module::Module::valid(&policy), &seqs, 4).unwrap();
        for (o, s) in after.iter().zip(&scored) {
            for (a, b) in o.token_logprobs.iter().zip(&s.token_logprobs) {
                assert!((a - b).abs() < 1e-4, "engine {a} vs score {b}");
            }
        }

        // Refitting the original weights restores the original output.
        engine.refit(&lm.model).unwrap();
        assert_same(&engine.generate(&greedy).unwrap(), &before_greedy);
    }
}

#[test]
fn refit_rejects_another_architecture() {
    let lm = shipped();
    for path in PATHS {
        let mut engine = engine(&lm, 2, path);
        let mut config = lm.config.clone();
        config.num_hidden_layers = 1;
        let other = aligner_core::CausalLm::new(&config, &Device::flex());
        assert!(engine.refit(&other).is_err());
    }
}

#[test]
fn worker_pool_shares_one_queue() {
    let lm = shipped();
    for path in PATHS {
        let reqs = many_requests(&lm, 20, &sampled(0));
        let expected = engine(&lm, 4, path).generate(&reqs).unwrap();
        let mut pool = WorkerPool::new(engine(&lm, 4, path), 2);
        let finished = std::sync::atomic::AtomicUsize::new(0);
        let (outs, report) = pool
            .generate(&reqs, &|_| {
                finished.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
            .unwrap();
        assert_same(&outs, &expected);
        assert_eq!(finished.into_inner(), reqs.len());
        assert_eq!(report.workers.len(), 2);
        assert_eq!(
            report.workers.iter().map(|w| w.prompts).sum::<usize>(),
            reqs.len()
        );
        assert_eq!(
            report.tokens(),
            expected.iter().map(|g| g.token_ids.len()).sum::<usize>()
        );
        assert!(report.workers.iter().all(|w| w.prompts > 0), "{report:?}");
        // Refit reaches every worker.
        pool.refit(&lora_policy(&lm)).unwrap();
        let (changed, _) = pool.generate(&reqs, &|_| {}).unwrap();
        assert_ne!(changed, expected);
    }
}

#[test]
fn host_and_burn_paths_agree() {
    let lm = shipped();
    // The Burn path draws every kind (greedy, top-k, plain temperature) on its device.
    for params in [SamplingParams::greedy(0), sampled(0), plain(0)] {
        let reqs = many_requests(&lm, 12, &params);
        let host = engine(&lm, 5, ForwardPath::Host).generate(&reqs).unwrap();
        let burn = engine(&lm, 5, ForwardPath::Burn).generate(&reqs).unwrap();
        assert_same(&host, &burn);
    }
    // On the CPU the engine picks the host kernels by itself.
    let auto = Engine::for_model(&lm, EngineOptions::default());
    assert_eq!(auto.path(), ForwardPath::Host);
}

/// A random Llama of other shapes than the shipped one: a vocabulary of several output panels
/// (the last one narrower), a head width without an unrolled attention path (12), tied
/// embeddings. Both forward paths give the same tokens and log-probs.
#[test]
fn host_and_burn_paths_agree_on_other_shapes() {
    let mut config = aligner_core::LlamaConfig::llama(5000, 48, 2, 4, 2, 96);
    config.tie_word_embeddings = Some(true);
    let device = Device::flex();
    device.seed(7);
    let model = aligner_core::CausalLm::new(&config, &device);
    let build = |path| {
        let options = EngineOptions {
            slots: 4,
            cache_len: None,
            path,
        };
        Engine::new(model.clone(), config.clone(), None, options)
    };
    for params in [SamplingParams::greedy(24), sampled(24), plain(24)] {
        let reqs: Vec<GenerationRequest> = (0..6)
            .map(|i| GenerationRequest {
                prompt_ids: (0..3 + 5 * i)
                    .map(|t| (7 + 331 * t * (i + 1)) as u32 % 5000)
                    .collect(),
                params: SamplingParams {
                    seed: 50 + i as u64,
                    ..params.clone()
                },
                guidance: None,
            })
            .collect();
        let host = build(ForwardPath::Host).generate(&reqs).unwrap();
        let burn = build(ForwardPath::Burn).generate(&reqs).unwrap();
        assert!(
            host.iter().any(|g| g.token_ids.len() > 8),
            "long enough to compare"
        );
        assert_same(&host, &burn);
    }
}

#[test]
fn prompts_beyond_one_prefill_pass_are_split_between_passes() {
    let lm = shipped();
    // 48 prompts of ~100 tokens: more tokens than one host prefill pass takes (4,096).
    let story =
        "Once upon a time there was a little girl named Lily. She loved to play in the park with her dog. ";
    let reqs: Vec<GenerationRequest> = (0..48)
        .map(|i| GenerationRequest {
            prompt_ids: lm
                .tokenizer
                .encode(&format!("{story}{story}{story}{i}"), true)
                .unwrap(),
            params: SamplingParams::greedy(4),
            guidance: None,
        })
        .collect();
    let total: usize = reqs.iter().map(|r| r.prompt_ids.len()).sum();
    assert!(total > 4096, "{total} prompt tokens");
    let batched = engine(&lm, 48, ForwardPath::Host).generate(&reqs).unwrap();
    let mut alone = engine(&lm, 1, ForwardPath::Host);
    for (req, out) in reqs.iter().zip(&batched) {
        assert_same(
            &alone.generate(std::slice::from_ref(req)).unwrap(),
            std::slice::from_ref(out),
        );
    }
}

/// A multi-turn episode's next turn (`SamplingParams::keep_cache`): a prompt that continues a
/// kept sequence (its prompt and output, then an "observation") starts from that sequence's
/// cached keys and values and computes only the new tokens — the same greedy tokens and
/// log-probs (1e-4) as a fresh engine computing it whole, beside another prompt. Two
/// continuations of different lengths are admitted together: the Burn path runs them as one
/// batch, recomputing what the shorter-kept one needs beyond its cache. Nothing kept outlives
/// the next call or a refit.
#[test]
fn a_continued_sequence_reuses_its_cache_and_samples_the_same_tokens() {
    let lm = shipped();
    let encode = |text: &str, bos| lm.tokenizer.encode(text, bos).unwrap();
    let prompts = [
        encode("Once upon a time, Lily", true),
        encode("Tom had a big red", true),
    ];
    let observations = [
        encode(" Mom said, \"Tell me about the ball.\"", false),
        encode(" The end.", false),
    ];
    // How many tokens each kept sequence generated.
    let lengths = [20, 12];
    for path in PATHS {
        let mut kept = engine(&lm, 4, path).with_eos_ids(vec![]);
        let firsts: Vec<GenerationRequest> = prompts
            .iter()
            .zip(lengths)
            .map(|(prompt, n)| {
                let params = SamplingParams {
                    keep_cache: true,
                    ..SamplingParams::greedy(n)
                };
                GenerationRequest::new(prompt.clone(), params)
            })
            .collect();
        let outs = kept.generate(&firsts).unwrap();
        let nexts: Vec<GenerationRequest> = (0..2)
            .map(|i| {
                let continued = [prompts[i].as_slice(), &outs[i].token_ids, &observations[i]].concat();
                GenerationRequest::new(continued, SamplingParams::greedy(20))
            })
            .collect();
        let other = GenerationRequest::new(vec![1, 7, 7, 3], SamplingParams::greedy(10));
        let batch = [other, nexts[0].clone(), nexts[1].clone()];
        let got = kept.generate(&batch).unwrap();
        // Every position but the last sampled token's (never fed) came from the cache on the
        // host path; the Burn path recomputes the longer observation's extra tokens for the
        // sequence with the shorter one.
        let reused = kept.stats().reused_positions;
        let kept_positions: usize = prompts.iter().zip(lengths).map(|(p, n)| p.len() + n - 1).sum();
        let longest_rest = (0..2)
            .map(|i| nexts[i].prompt_ids.len() - (prompts[i].len() + lengths[i] - 1))
            .max()
            .unwrap();
        let expected = match path {
            ForwardPath::Host => kept_positions,
            _ => nexts
                .iter()
                .map(|n| n.prompt_ids.len().saturating_sub(longest_rest))
                .sum(),
        };
        assert_eq!(reused, expected, "{path:?}");
        // Both sequences took some of their cache (the Burn path included).
        assert!(expected > nexts[0].prompt_ids.len() - longest_rest, "{path:?}");
        let fresh = engine(&lm, 4, path)
            .with_eos_ids(vec![])
            .generate(&batch)
            .unwrap();
        for (a, b) in got.iter().zip(&fresh) {
            assert_eq!(a.token_ids, b.token_ids, "{path:?}");
            for (x, y) in a.token_logprobs.iter().zip(&b.token_logprobs) {
                assert!((x - y).abs() < 1e-4, "{path:?}: {x} against {y}");
            }
        }
        // Kept only until the next call: the same continuation again computes it whole.
        kept.generate(&nexts).unwrap();
        assert_eq!(kept.stats().reused_positions, reused, "{path:?}");
        // A refit drops what was kept (its keys and values are the old weights').
        kept.generate(&firsts).unwrap();
        kept.refit(&lm.model).unwrap();
        kept.generate(&nexts).unwrap();
        assert_eq!(kept.stats().reused_positions, reused, "{path:?}");
    }
}

/// Answers every turn with an observation and ends episodes after their third turn; episode
/// 0's first turn is answered only once every other episode is over (when it is alone in its
/// batch; `None` in `gated` says it was not).
struct Gate {
    others: usize,
    over: std::sync::Mutex<usize>,
    changed: std::sync::Condvar,
    gated: std::sync::Mutex<Option<bool>>,
}

impl Gate {
    fn new(others: usize) -> Self {
        Self {
            others,
            over: std::sync::Mutex::new(0),
            changed: std::sync::Condvar::new(),
            gated: std::sync::Mutex::new(None),
        }
    }
}

impl aligner_gen::env::Environment for Gate {
    fn name(&self) -> &str {
        "gate"
    }

    fn step(&self, turns: &[aligner_gen::env::Turn<'_>]) -> Vec<aligner_gen::env::TurnResult> {
        if turns.iter().any(|t| t.episode == 0 && t.turn == 0) {
            let mut gated = self.gated.lock().unwrap();
            if turns.len() == 1 {
                // Held until the others are over: they go on meanwhile, or never.
                let over = self.over.lock().unwrap();
                let (over, _) = self
                    .changed
                    .wait_timeout_while(over, std::time::Duration::from_secs(120), |n| *n < self.others)
                    .unwrap();
                *gated = Some(*over == self.others);
            } else {
                *gated = Some(false);
            }
        }
        turns
            .iter()
            .map(|t| {
                if t.episode != 0 && t.turn == 2 {
                    *self.over.lock().unwrap() += 1;
                    self.changed.notify_all();
                }
                Ok(aligner_gen::env::Reply {
                    observation: Some(" Mom said yes.".into()),
                    reward: Some(t.turn as f64),
                    done: t.turn == 2,
                    tool_calls: 0,
                })
            })
            .collect()
    }
}

/// Episodes in flight (`run_episodes_continuous`): while episode 0's environment holds its
/// first answer until every other episode is over, the engine goes on decoding the others'
/// turns (in lock step they would all wait for it) — and the episodes are the same tokens as
/// in lock step (log-probs within 1e-4), on both forward paths, the host path reusing each
/// turn's cache.
#[test]
fn episodes_go_on_while_another_waits_for_its_environment() {
    use aligner_gen::env::{EpisodeLimits, EpisodeStart, run_episodes, run_episodes_continuous};
    let lm = shipped();
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| lm.tokenizer.encode(p, true).unwrap())
        .collect();
    let metadata = serde_json::Map::new();
    // Episode 0 talks at length; the others end each turn at their first space.
    let starts: Vec<EpisodeStart<'_>> = prompts
        .iter()
        .zip(PROMPTS)
        .enumerate()
        .map(|(i, (ids, text))| EpisodeStart {
            prompt_ids: ids,
            prompt: text,
            metadata: &metadata,
            params: SamplingParams {
                temperature: 1.0,
                seed: 7 + i as u64,
                stop_strings: if i == 0 { vec![] } else { vec![" ".into()] },
                ..SamplingParams::default()
            },
        })
        .collect();
    // Episode 0's first turn takes 400 decode steps: time for the others' three turns each.
    let limits = EpisodeLimits {
        max_turns: 3,
        max_tokens: 480,
        turn_max_new_tokens: 400,
    };
    for path in PATHS {
        let gate = Gate::new(starts.len() - 1);
        let mut engine = engine(&lm, 8, path).with_eos_ids(vec![]);
        let in_flight = run_episodes_continuous(
            &starts,
            0,
            &limits,
            &lm.tokenizer,
            &mut |feed, done| engine.serve(feed, &mut |i, out| done(i, out)),
            &gate,
        )
        .unwrap();
        assert_eq!(
            *gate.gated.lock().unwrap(),
            Some(true),
            "{path:?}: episode 0's first turn was answered alone, after the others were over"
        );
        assert!(in_flight[1..].iter().all(|e| e.turns == 3), "{path:?}");
        assert!(in_flight[0].generation.token_ids.len() >= 400, "{path:?}");
        let stats = engine.stats();
        assert!(stats.admitted_mid_batch > 0, "{path:?}");
        assert!(stats.reused_positions > 0, "{path:?}");
        let plain = Gate::new(0);
        let mut fresh = self::engine(&lm, 8, path).with_eos_ids(vec![]);
        let lock_step = run_episodes(
            &starts,
            0,
            &limits,
            &lm.tokenizer,
            &mut |r| fresh.generate(r),
            &mut |turns| Ok(aligner_gen::env::Environment::step(&plain, turns)),
        )
        .unwrap();
        for (a, b) in in_flight.iter().zip(&lock_step) {
            assert_same(
                std::slice::from_ref(&a.generation),
                std::slice::from_ref(&b.generation),
            );
            assert_eq!(a.observed, b.observed, "{path:?}");
            assert_eq!(a.turn_rewards, b.turn_rewards, "{path:?}");
        }
    }
}
