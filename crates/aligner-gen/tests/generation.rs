//! Generation on the shipped model: parity with transformers' greedy tokens, batch
//! independence, and agreement of token log-probs with the scoring path.

use std::path::PathBuf;

use aligner_core::score::{ScoredSequence, response_logprobs};
use aligner_core::{Device, LoadedModel};
use aligner_gen::{GenerationRequest, Generator, SamplingParams, StopReason};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn shipped() -> LoadedModel {
    LoadedModel::from_dir(&repo().join("assets/stories260K"), &Device::flex()).unwrap()
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
        })
        .collect()
}

#[test]
fn greedy_tokens_equal_transformers() {
    let lm = shipped();
    let path = repo().join("tests/reference/stories260K_transformers.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = reference["greedy"].as_array().unwrap();
    let reqs: Vec<GenerationRequest> = cases
        .iter()
        .map(|c| GenerationRequest {
            prompt_ids: lm.tokenizer.encode(c["prompt"].as_str().unwrap(), true).unwrap(),
            params: SamplingParams::greedy(c["max_new_tokens"].as_u64().unwrap() as usize),
        })
        .collect();
    // The reference stops only at max_new_tokens.
    let generator = Generator::new(&lm.model, &lm.config, Some(&lm.tokenizer)).with_eos_ids(vec![]);
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

#[test]
fn a_batch_gives_each_prompt_what_it_gets_alone() {
    let lm = shipped();
    let generator = Generator::new(&lm.model, &lm.config, Some(&lm.tokenizer));
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

#[test]
fn seeds_make_samples_repeatable_and_different() {
    let lm = shipped();
    let generator = Generator::new(&lm.model, &lm.config, Some(&lm.tokenizer));
    let params = SamplingParams {
        max_new_tokens: 30,
        ..SamplingParams::default()
    };
    let prompt_ids = lm.tokenizer.encode("Once upon a time", true).unwrap();
    let run = |seed| {
        let req = GenerationRequest {
            prompt_ids: prompt_ids.clone(),
            params: SamplingParams {
                seed,
                ..params.clone()
            },
        };
        generator.generate(&[req]).unwrap().remove(0).token_ids
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn engine_logprobs_equal_the_scoring_path() {
    let lm = shipped();
    let generator = Generator::new(&lm.model, &lm.config, Some(&lm.tokenizer));
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

#[test]
fn stops_at_eos_and_at_stop_strings() {
    let lm = shipped();
    let generator = Generator::new(&lm.model, &lm.config, Some(&lm.tokenizer));
    let prompt_ids = lm.tokenizer.encode("Once upon a time", true).unwrap();
    let req = |stop: Vec<String>| GenerationRequest {
        prompt_ids: prompt_ids.clone(),
        params: SamplingParams {
            stop_strings: stop,
            ..SamplingParams::greedy(200)
        },
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
