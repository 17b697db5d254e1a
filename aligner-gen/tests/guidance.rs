//! Classifier-free guidance in the engine on the shipped model: each guided token is the one
//! the guided distribution of two separate forward passes picks, scales 1 and 0 give the
//! prompt's and the negative prompt's own generations, and guided requests mixed with plain
//! ones (two cache rows each, rows moving as sequences finish) get what they get alone.

use std::path::PathBuf;

use aligner_core::{Device, LoadedModel};
use aligner_gen::sampling::guided_logits;
use aligner_gen::{
    Engine, EngineOptions, ForwardPath, GenError, Generation, GenerationRequest, Guidance, SamplingParams,
};
use burn::tensor::{Int, Tensor, TensorData};

fn shipped() -> LoadedModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/stories260K");
    LoadedModel::from_dir(&dir, &Device::flex()).unwrap()
}

const PATHS: [ForwardPath; 2] = [ForwardPath::Host, ForwardPath::Burn];

fn engine(lm: &LoadedModel, slots: usize, path: ForwardPath) -> Engine {
    Engine::for_model(
        lm,
        EngineOptions {
            slots,
            cache_len: None,
            path,
        },
    )
}

fn encode(lm: &LoadedModel, text: &str) -> Vec<u32> {
    lm.tokenizer.encode(text, true).unwrap()
}

fn guided(
    lm: &LoadedModel,
    prompt: &str,
    negative: &str,
    scale: f32,
    params: SamplingParams,
) -> GenerationRequest {
    GenerationRequest {
        guidance: Some(Guidance {
            negative_prompt_ids: encode(lm, negative),
            scale,
        }),
        ..GenerationRequest::new(encode(lm, prompt), params)
    }
}

/// Next-token logits after `ids`, from a full forward pass of the model.
fn next_logits(lm: &LoadedModel, ids: &[u32]) -> Vec<f32> {
    let data: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(data, [1, ids.len()]), &Device::flex());
    let logits = lm.model.forward(tokens);
    let [_, seq, vocab] = logits.dims();
    logits
        .slice([0..1, seq - 1..seq, 0..vocab])
        .into_data()
        .try_to_vec::<f32>()
        .unwrap()
}

const PAIRS: [(&str, &str); 2] = [
    ("Lily was happy. She", "Lily was sad. She"),
    (
        "Tom and his dog went to the park. They saw a big",
        "Once upon a time",
    ),
];

#[test]
fn each_guided_token_is_the_guided_argmax_of_both_prompts() {
    let lm = shipped();
    for path in PATHS {
        for (prompt, negative) in PAIRS {
            let request = guided(&lm, prompt, negative, 3.0, SamplingParams::greedy(10));
            let out = engine(&lm, 4, path)
                .generate(std::slice::from_ref(&request))
                .unwrap()
                .remove(0);
            let negative_ids = &request.guidance.as_ref().unwrap().negative_prompt_ids;
            let (mut with_prompt, mut with_negative) = (request.prompt_ids.clone(), negative_ids.clone());
            for (&token, &logprob) in out.token_ids.iter().zip(&out.token_logprobs) {
                let (c, n) = (next_logits(&lm, &with_prompt), next_logits(&lm, &with_negative));
                let g = guided_logits(&c, &n, 3.0);
                let best = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                assert!(
                    g[token as usize] >= best - 1e-3,
                    "{path:?} {prompt:?}: token {token}"
                );
                // The reported log-prob is the prompt's own (what a trainer recomputes).
                let own = aligner_gen::sampling::log_prob(&c, token as usize);
                assert!((logprob - own).abs() < 1e-4, "{logprob} vs {own}");
                with_prompt.push(token);
                with_negative.push(token);
            }
        }
    }
}

fn tokens(out: &[Generation]) -> Vec<Vec<u32>> {
    out.iter().map(|g| g.token_ids.clone()).collect()
}

#[test]
fn scale_one_is_the_prompt_and_scale_zero_the_negative_prompt() {
    let lm = shipped();
    for path in PATHS {
        let mut generator = engine(&lm, 8, path);
        let plain = |text: &str| GenerationRequest::new(encode(&lm, text), SamplingParams::greedy(16));
        let prompts: Vec<GenerationRequest> = PAIRS.iter().map(|(p, _)| plain(p)).collect();
        let negatives: Vec<GenerationRequest> = PAIRS.iter().map(|(_, n)| plain(n)).collect();
        let at = |scale: f32| -> Vec<GenerationRequest> {
            PAIRS
                .iter()
                .map(|(p, n)| guided(&lm, p, n, scale, SamplingParams::greedy(16)))
                .collect()
        };
        let one = generator.generate(&at(1.0)).unwrap();
        assert_eq!(tokens(&one), tokens(&generator.generate(&prompts).unwrap()));
        let zero = generator.generate(&at(0.0)).unwrap();
        assert_eq!(tokens(&zero), tokens(&generator.generate(&negatives).unwrap()));
        // Guidance changes what is drawn.
        assert_ne!(tokens(&generator.generate(&at(4.0)).unwrap()), tokens(&one));
    }
}

#[test]
fn guided_and_plain_requests_together_get_what_they_get_alone() {
    let lm = shipped();
    let words =
        "Once upon a time there was a little girl named Lily who loved to play in the park with her dog";
    let words: Vec<&str> = words.split(' ').collect();
    let requests: Vec<GenerationRequest> = (0..12)
        .map(|i| {
            let prompt = words[..1 + (i * 7) % words.len()].join(" ");
            let params = SamplingParams {
                top_k: 50,
                seed: 500 + i as u64,
                max_new_tokens: 6 + (i * 11) % 30,
                ..SamplingParams::default()
            };
            match i % 3 {
                0 => GenerationRequest::new(encode(&lm, &prompt), params),
                _ => guided(
                    &lm,
                    &prompt,
                    &words[..1 + (i * 5) % 9].join(" "),
                    1.5 + i as f32 * 0.25,
                    params,
                ),
            }
        })
        .collect();
    for path in PATHS {
        // 5 rows: a guided request waits when one row is free; pairs finish at different steps
        // and the last rows move into the gaps.
        let mut shared = engine(&lm, 5, path);
        let together = shared.generate(&requests).unwrap();
        assert!(shared.stats().admitted_mid_batch > 0);
        let mut single = engine(&lm, 2, path);
        for (request, out) in requests.iter().zip(&together) {
            let alone = single.generate(std::slice::from_ref(request)).unwrap().remove(0);
            assert_eq!(alone.token_ids, out.token_ids);
            assert_eq!(alone.stop_reason, out.stop_reason);
            for (a, b) in alone.token_logprobs.iter().zip(&out.token_logprobs) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }
}

#[test]
fn guidance_needs_two_rows_a_negative_prompt_and_a_usable_scale() {
    let lm = shipped();
    let request = guided(&lm, "Lily", "Tom", 2.0, SamplingParams::greedy(4));
    let err = engine(&lm, 1, ForwardPath::Host).generate(std::slice::from_ref(&request));
    assert!(matches!(err, Err(GenError::GuidanceNeedsTwoSlots)), "{err:?}");
    let empty = GenerationRequest {
        guidance: Some(Guidance {
            negative_prompt_ids: Vec::new(),
            scale: 2.0,
        }),
        ..request
    };
    let err = engine(&lm, 2, ForwardPath::Host).generate(&[empty]);
    assert!(matches!(err, Err(GenError::EmptyPrompt(0))), "{err:?}");
    for scale in [-1.0, f32::NAN, f32::INFINITY] {
        let plain = GenerationRequest::new(encode(&lm, "Tom"), SamplingParams::greedy(4));
        let bad = guided(&lm, "Lily", "Tom", scale, SamplingParams::greedy(4));
        let err = engine(&lm, 4, ForwardPath::Host).generate(&[plain, bad]);
        assert!(
            matches!(err, Err(GenError::BadGuidanceScale { request: 1, .. })),
            "{err:?}"
        );
    }
}
