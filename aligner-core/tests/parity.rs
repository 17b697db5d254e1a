//! Parity with Hugging Face transformers on the shipped model (values in tests/reference).

use std::path::PathBuf;

use aligner_core::model::{FeedForward, with_router_loss};
use aligner_core::score::{ScoredSequence, response_logprobs, sequence_logprobs};
use aligner_core::{Device, LoadedModel};
use burn::tensor::{Int, Tensor, TensorData};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn reference() -> Value {
    let path = repo().join("tests/reference/stories260K_transformers.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
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

#[test]
fn tokenizer_ids_match_reference() {
    let lm = shipped();
    let r = reference();
    for text in r["texts"].as_array().unwrap() {
        let got = lm.tokenizer.encode(text["text"].as_str().unwrap(), true).unwrap();
        assert_eq!(got, ids(&text["ids"]));
    }
}

#[test]
fn logits_match_transformers_at_every_position() {
    let lm = shipped();
    let r = reference();
    let device = Device::flex();
    let mut worst = 0.0f32;
    for text in r["texts"].as_array().unwrap() {
        let ids = ids(&text["ids"]);
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().map(|&t| t as i64).collect::<Vec<_>>(), [1, ids.len()]),
            &device,
        );
        let logits: Vec<f32> = lm.model.forward(tokens).into_data().try_to_vec().unwrap();
        let expected: Vec<f32> = text["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
            .collect();
        assert_eq!(logits.len(), expected.len());
        for (a, b) in logits.iter().zip(&expected) {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(worst < 1e-4, "max |logit difference| {worst}");
}

#[test]
fn batched_right_padded_logits_equal_single_sequences() {
    let lm = shipped();
    let device = Device::flex();
    let texts = ["Once upon a time", "Tom had a big red ball and he liked to play"];
    let seqs: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| lm.tokenizer.encode(t, true).unwrap())
        .collect();
    let rows: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let batch = aligner_core::score::pad_right(&rows, 0, &device);
    let width = batch.dims()[1];
    let batched: Vec<f32> = lm.model.forward(batch).into_data().try_to_vec().unwrap();
    for (i, seq) in seqs.iter().enumerate() {
        let single = aligner_core::score::pad_right(&[seq.as_slice()], 0, &device);
        let alone: Vec<f32> = lm.model.forward(single).into_data().try_to_vec().unwrap();
        let row = &batched[i * width * 512..(i * width + seq.len()) * 512];
        for (a, b) in row.iter().zip(&alone) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}

#[test]
fn response_logprobs_match_transformers() {
    let lm = shipped();
    let r = reference();
    let mut seqs = Vec::new();
    let mut expected = Vec::new();
    for pair in r["pairs"].as_array().unwrap() {
        let prompt = pair["prompt"].as_str().unwrap();
        for side in ["chosen", "rejected"] {
            let seq = ScoredSequence::encode(&lm.tokenizer, prompt, pair[side].as_str().unwrap()).unwrap();
            let reference = &pair[format!("{side}_ref")];
            assert_eq!(seq.ids, ids(&reference["ids"]));
            assert_eq!(seq.prompt_len, ids(&reference["prompt_ids"]).len());
            assert_eq!(
                seq.n_response_tokens() as u64,
                reference["n_tokens"].as_u64().unwrap()
            );
            seqs.push(seq);
            expected.push(reference.clone());
        }
    }
    let got = response_logprobs(&lm.model, &seqs, 8).unwrap();
    for (g, e) in got.iter().zip(&expected) {
        let total = e["logprob"].as_f64().unwrap();
        assert!(
            (g.total() - total).abs() < 1e-3,
            "logprob {} vs {total}",
            g.total()
        );
        for (a, b) in g
            .token_logprobs
            .iter()
            .zip(e["token_logprobs"].as_array().unwrap())
        {
            assert!((*a as f64 - b.as_f64().unwrap()).abs() < 1e-4);
        }
    }
}

/// Random models made and saved by transformers 5 (tools/hf_parity.py): Llama-3 rope scaling
/// with positions past the original context, Qwen2 biases stored in bf16, an explicit
/// head_dim with attention and MLP biases, Qwen3 (per-head q/k norms, a head_dim of its own,
/// sliding-window layers from `layer_types`), Mistral with a 12-token window, both on a
/// 40-token input, OLMo 2 (norms on the blocks' outputs, whole-projection q/k norms,
/// attention biases), Gemma 2 (scaled embeddings, `1 + w` norms on both sides of each block,
/// GeGLU, a query pre-scale, soft-capped scores and logits, alternating windows) and Gemma 3
/// (per-head q/k norms, local and global RoPE bases, the global one linearly scaled), and Phi-3
/// (fused q/k/v and gate/up projections, half of each head rotated, LongRoPE with its long
/// factors on a 40-token input past a 32-token original context, a 24-token window).
#[test]
fn random_transformers_models_match_their_logits() {
    let families = hf_random_families();
    let older = ["llama3_scaled", "qwen2_bias", "llama_head_dim"];
    for name in older.into_iter().chain(families.lines()) {
        let (model, expected) = hf_random(name, &Device::flex());
        let ids = ids(&expected["ids"]);
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().map(|&t| t as i64).collect::<Vec<_>>(), [1, ids.len()]),
            &Device::flex(),
        );
        let logits: Vec<f32> = model.forward(tokens).into_data().try_to_vec().unwrap();
        let want: Vec<f32> = expected["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
            .collect();
        assert_eq!(logits.len(), want.len(), "{name}");
        let worst = logits
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{name}: max |logit difference| {worst}");
    }
}

/// The families of `tests/reference/hf_random` beyond Llama and Qwen2, one a line (each
/// fixture carries transformers' greedy continuation and the shipped tokenizer).
fn hf_random_families() -> String {
    std::fs::read_to_string(repo().join("tests/reference/hf_random/families.txt")).unwrap()
}

/// The random model `tests/reference/hf_random/{name}` and transformers' figures for it (the
/// older fixtures carry no tokenizer, so the weights load without [`LoadedModel`]).
fn hf_random(name: &str, device: &Device) -> (aligner_core::CausalLm, Value) {
    let dir = repo().join("tests/reference/hf_random").join(name);
    let config = aligner_core::LlamaConfig::from_file(&dir.join("config.json")).unwrap();
    let model = aligner_core::checkpoint::load_causal_lm(&dir, &config, device).unwrap();
    let expected =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected_logits.json")).unwrap()).unwrap();
    (model, expected)
}

/// Log-softmax of transformers' logits at each next token: the reference token log-probs.
fn reference_logprobs(expected: &Value) -> Vec<f64> {
    let ids = ids(&expected["ids"]);
    let rows = expected["logits"].as_array().unwrap();
    (0..ids.len() - 1)
        .map(|t| {
            let row: Vec<f64> = rows[t]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            row[ids[t + 1] as usize] - lse
        })
        .collect()
}

/// Training computes what transformers does on the new families too: token log-probs on the
/// autodiff device (the CPU's fused attention under the window mask, the q/k and output norms
/// in the fused RMSNorm; Burn's attention under Gemma 2's soft-cap) match transformers' within
/// 1e-3 per token; and each quirk is really applied: the same weights without the window,
/// without Gemma 2's soft-caps, or with Gemma 3's global RoPE on every layer give other
/// log-probs.
#[test]
fn sliding_windows_and_qk_norms_train_as_transformers_computes_them() {
    let device = Device::flex().autodiff();
    for name in hf_random_families().lines() {
        let (model, expected) = hf_random(name, &device);
        let ids = ids(&expected["ids"]);
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().map(|&t| t as i64).collect::<Vec<_>>(), [1, ids.len()]),
            &device,
        );
        let want = reference_logprobs(&expected);
        let distance = |model: &aligner_core::CausalLm| {
            let got: Vec<f32> = model
                .token_logprobs(tokens.clone())
                .into_data()
                .convert::<f32>()
                .try_to_vec()
                .unwrap();
            got.iter()
                .zip(&want)
                .map(|(a, b)| (*a as f64 - b).abs())
                .fold(0.0, f64::max)
        };
        let worst = distance(&model);
        assert!(worst < 1e-3, "{name}: max |token log-prob difference| {worst}");
        let mut variants: Vec<(&str, aligner_core::CausalLm)> = Vec::new();
        if name != "olmo2_bias" && name != "qwen3_moe_dense_layer" {
            let mut full = model.clone();
            for layer in &mut full.model.layers {
                layer.self_attn.window = None;
            }
            variants.push(("without the window", full));
        }
        if name == "gemma2_capped" {
            let mut uncapped = model.clone();
            uncapped.final_softcap = None;
            variants.push(("without the final soft-cap", uncapped.clone()));
            for layer in &mut uncapped.model.layers {
                layer.self_attn.softcap = None;
            }
            uncapped.final_softcap = model.final_softcap;
            variants.push(("without the attention soft-cap", uncapped));
        }
        if name == "gemma3_local_global" {
            let mut global = model.clone();
            global.model.local_rope = None;
            variants.push(("with the global RoPE everywhere", global));
        }
        if name == "phi3_longrope" {
            // The short factors throughout: what the input's 40 positions must not get.
            let mut short = aligner_core::LlamaConfig::from_file(
                &repo().join("tests/reference/hf_random/phi3_longrope/config.json"),
            )
            .unwrap();
            short.max_position_embeddings = 4096;
            if let Some(p) = short.rope_parameters.as_mut() {
                p["original_max_position_embeddings"] = serde_json::json!(4096);
            }
            let mut variant = model.clone();
            variant.model.rope = aligner_core::model::Rope::new(&short, &device);
            variants.push(("with the short factors and no attention factor", variant));
        }
        if name.contains("moe") {
            // Mixtral renormalises the chosen experts' probabilities; this Qwen3-MoE does not.
            let mut flipped = model.clone();
            for layer in &mut flipped.model.layers {
                if let FeedForward::Sparse(moe) = &mut layer.mlp {
                    moe.normalize_top_k = !moe.normalize_top_k;
                }
            }
            variants.push(("with the top-k normalisation flipped", flipped));
            let mut top1 = model.clone();
            for layer in &mut top1.model.layers {
                if let FeedForward::Sparse(moe) = &mut layer.mlp {
                    moe.top_k = 1;
                }
            }
            variants.push(("with one expert a token", top1));
        }
        for (what, variant) in variants {
            let moved = distance(&variant);
            assert!(moved > 0.05, "{name}: {what} changes nothing ({moved})");
        }
    }
}

/// Mixtral and Qwen3-MoE (tools/hf_parity.py, `output_router_logits` on) train with
/// transformers' loss: the load-balancing loss of the input's routing equals transformers'
/// `aux_loss` (1e-4), and the mean NLL plus `router_aux_loss_coef` times it equals transformers'
/// training loss with labels = ids; the term reaches the routers' weights (a gradient on every
/// sparse layer's router), while a dense layer (Qwen3-MoE's `mlp_only_layers`) stays an MLP.
#[test]
fn mixtures_of_experts_add_transformers_load_balancing_loss() {
    let device = Device::flex().autodiff();
    for (name, coef, dense_layers) in [
        ("mixtral_moe", 0.02, vec![]),
        ("qwen3_moe_dense_layer", 0.01, vec![1]),
    ] {
        let (model, expected) = hf_random(name, &device);
        for (i, layer) in model.model.layers.iter().enumerate() {
            let sparse = matches!(layer.mlp, FeedForward::Sparse(_));
            assert_eq!(sparse, !dense_layers.contains(&i), "{name} layer {i}");
        }
        let ids = ids(&expected["ids"]);
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().map(|&t| t as i64).collect::<Vec<_>>(), [1, ids.len()]),
            &device,
        );
        let (logprobs, term) = with_router_loss(|| model.token_logprobs(tokens.clone()));
        let term = term.expect("output_router_logits is on");
        let aux = term.clone().into_scalar::<f32>() as f64 / coef;
        let want = expected["aux_loss"].as_f64().unwrap();
        assert!(
            (aux - want).abs() < 1e-4,
            "{name}: load-balancing loss {aux} against {want}"
        );
        let loss = logprobs.mean().neg() + term;
        let got = loss.clone().into_scalar::<f32>() as f64;
        let want = expected["loss"].as_f64().unwrap();
        assert!(
            (got - want).abs() < 1e-4,
            "{name}: training loss {got} against {want}"
        );
        let grads = loss.backward();
        for layer in &model.model.layers {
            if let FeedForward::Sparse(moe) = &layer.mlp {
                let grad = moe
                    .router
                    .weight
                    .grad(&grads)
                    .expect("the router takes gradients");
                let norm: f32 = grad.abs().sum().into_scalar();
                assert!(norm > 0.0, "{name}: a router without gradient");
            }
        }
        // A right-padded batch: padding is left out of the loss as transformers leaves out
        // what the attention mask hides, by the path every preference loss takes.
        let padded = &expected["padded"];
        let rows: Vec<Vec<u32>> = padded["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect()
            })
            .collect();
        let seqs: Vec<ScoredSequence> = rows
            .iter()
            .map(|r| ScoredSequence {
                ids: r.clone(),
                prompt_len: 1,
                observed: Vec::new(),
            })
            .collect();
        let refs: Vec<&ScoredSequence> = seqs.iter().collect();
        let (_, term) = with_router_loss(|| sequence_logprobs(&model, &refs));
        let aux = term.unwrap().into_scalar::<f32>() as f64 / coef;
        let (want, unmasked) = (
            padded["aux_loss"].as_f64().unwrap(),
            padded["aux_loss_without_mask"].as_f64().unwrap(),
        );
        assert!(
            (aux - want).abs() < 1e-4,
            "{name}: padded batch's load-balancing loss {aux} against {want} ({unmasked} with the padding)"
        );
        assert!(
            (want - unmasked).abs() > 1e-3,
            "{name}: the padding changes nothing"
        );
        // Outside a recording scope nothing is collected; a pass without gradients records
        // nothing either.
        let (_, none) =
            with_router_loss(|| burn::module::Module::valid(&model).token_logprobs(tokens.clone().inner()));
        assert!(none.is_none(), "{name}: routing recorded without gradients");
    }
}
