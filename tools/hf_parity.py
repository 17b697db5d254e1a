"""Cross-checks aligner against Hugging Face transformers (needs torch + transformers; not run in CI).

  python3 tools/hf_parity.py fixtures OUT_DIR
      Makes small random Llama-3-scaled, Qwen2 and GPT-2-vocabulary Llama models with transformers,
      saves them (bf16 / f32 safetensors) and writes the transformers logits of fixed inputs to
      OUT_DIR/<name>/expected_logits.json.
  python3 tools/hf_parity.py architectures OUT_DIR [NAME ...]
      Makes small random models of the other families aligner loads (Qwen3 with per-head q/k norms,
      a head_dim of its own and sliding-window layers; Mistral with a 12-token window; OLMo 2 with
      its output norms, whole-projection q/k norms and attention biases; Gemma 2 with soft-capped
      attention and logits, a query pre-scale and alternating windows; Gemma 3 with q/k norms and
      local and global RoPE bases, the global one linearly scaled; Phi-3 with fused projections,
      half of each head rotated, LongRoPE past a 32-token original context and a 24-token window;
      Mixtral with 4 experts, top-2 and a 12-token window; Qwen3-MoE with 6 unnormalised top-2
      experts and a dense middle layer, both with their load-balancing loss on),
      saves them
      and writes transformers' logits of a 70-token input and its greedy continuation of a prompt
      (past the window) to OUT_DIR/<name>/expected_logits.json. They take the shipped model's
      512-token vocabulary and tokenizer files (assets/stories260K), so `aligner sft --set
      model.path=OUT_DIR/<name>` and every other command run on them.
  python3 tools/hf_parity.py padded_aux DIR ...
      Adds to mixture-of-experts fixtures (tests/reference/hf_random/{mixtral_moe,
      qwen3_moe_dense_layer}) transformers' load-balancing loss of a right-padded two-row batch
      with its attention mask, and without it (`padded` in expected_logits.json).
  python3 tools/hf_parity.py load DIR [IDS_JSON]
      Loads an aligner-saved folder with AutoModelForCausalLM / AutoModelForSequenceClassification,
      fails on missing or unexpected keys, prints the logits of IDS as JSON.
"""
import json
import sys

import torch
import transformers


def fixtures(out):
    torch.manual_seed(0)
    specs = {
        "llama3_scaled": transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32}, rope_theta=500000.0, bos_token_id=1, eos_token_id=2),
        "qwen2_bias": transformers.Qwen2Config(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True, rope_theta=1000000.0),
        "llama_head_dim": transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, head_dim=24, max_position_embeddings=64, attention_bias=True, mlp_bias=True),
    }
    ids = [[1, 5, 9, 33, 60, 2, 17, 80, 41, 3] * 7]
    for name, config in specs.items():
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        dtype = torch.bfloat16 if name == "qwen2_bias" else torch.float32
        model.to(dtype).save_pretrained(f"{out}/{name}")
        model.float()
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/{name}", dtype=torch.float32).eval()
        with torch.no_grad():
            logits = reloaded(torch.tensor(ids)).logits[0]
        json.dump({"ids": ids[0], "logits": logits.tolist()}, open(f"{out}/{name}/expected_logits.json", "w"))
        print(name, "saved", dtype)


def architectures(out, *names):
    import shutil
    torch.manual_seed(1)
    specs = {
        "qwen3_window": transformers.Qwen3Config(
            vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
            rope_theta=1000000.0, use_sliding_window=True, sliding_window=12, max_window_layers=1,
            bos_token_id=1, eos_token_id=2),
        "mistral_window": transformers.MistralConfig(
            vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0,
            sliding_window=12, bos_token_id=1, eos_token_id=2),
        "olmo2_bias": transformers.Olmo2Config(
            vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rope_theta=500000.0,
            attention_bias=True, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "gemma2_capped": transformers.Gemma2Config(
            vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
            final_logit_softcapping=6.0, sliding_window=12, max_position_embeddings=256, rope_theta=10000.0,
            tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "gemma3_local_global": transformers.Gemma3TextConfig(
            vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=20, sliding_window=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=0),
        "phi3_longrope": transformers.Phi3Config(
            vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=32,
            partial_rotary_factor=0.5, sliding_window=24, tie_word_embeddings=False,
            rope_scaling={"rope_type": "longrope", "rope_theta": 10000.0,
                          "short_factor": [1.0, 1.5], "long_factor": [3.0, 7.0]},
            bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "mixtral_moe": transformers.MixtralConfig(
            vocab_size=512, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=12,
            max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=True,
            router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "qwen3_moe_dense_layer": transformers.Qwen3MoeConfig(
            vocab_size=512, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=256,
            tie_word_embeddings=True, output_router_logits=True, router_aux_loss_coef=0.01,
            bos_token_id=1, eos_token_id=2, pad_token_id=0),
    }
    if names:
        specs = {k: v for k, v in specs.items() if k in names}
    ids = [[1, 403, 407, 261, 378, 2, 17, 80, 341, 3] * 4]
    prompt = [[1, 403, 407, 261, 378, 17]]
    for name, config in specs.items():
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for key, p in model.named_parameters():
                # Sharp distributions; norm weights around 1 as trained models have them.
                if p.dim() == 1:
                    # Gemma's norms scale by (1 + w).
                    p.copy_((0.0 if name.startswith("gemma") else 1.0) + 0.3 * torch.randn_like(p))
                else:
                    # Output norms (OLMo 2, Gemma) flatten a 0.25 model into one repeated token.
                    # Gemma scales embeddings by √hidden: smaller ones keep the stream from
                    # repeating its input token.
                    std = 0.5 if name.startswith(("olmo2", "gemma")) else 0.25
                    p.normal_(0.0, 0.1 if name.startswith("gemma") and "embed" in key else std)
        model.save_pretrained(f"{out}/{name}")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/{name}", dtype=torch.float32).eval()
        reloaded.config._attn_implementation = "eager"
        with torch.no_grad():
            result = reloaded(torch.tensor(ids), labels=torch.tensor(ids))
            logits = result.logits[0]
            greedy = reloaded.generate(torch.tensor(prompt), max_new_tokens=40, do_sample=False,
                                       eos_token_id=None, pad_token_id=0, min_new_tokens=40)
        for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"]:
            shutil.copy(f"assets/stories260K/{f}", f"{out}/{name}/{f}")
        expected = {"ids": ids[0], "logits": [[round(v, 6) for v in row] for row in logits.tolist()],
                    "prompt": prompt[0],
                    "greedy": greedy[0, len(prompt[0]):].tolist()}
        if getattr(result, "aux_loss", None) is not None:
            # Mixtures of experts: the load-balancing loss of the input (unscaled) and the
            # training loss it joins (mean NLL + router_aux_loss_coef · aux).
            expected["aux_loss"] = result.aux_loss.item()
            expected["loss"] = result.loss.item()
        json.dump(expected, open(f"{out}/{name}/expected_logits.json", "w"))
        print(name, "saved; greedy", greedy[0, len(prompt[0]):].tolist())


def padded_aux(*paths):
    """Adds to a mixture-of-experts fixture transformers' load-balancing loss of a right-padded
    batch with its attention mask (padding left out of the loss)."""
    rows = [[1, 403, 407, 261, 378, 2, 17, 80, 341, 3, 44, 91], [1, 261, 378, 17, 80]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    for path in paths:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            masked = model(ids, attention_mask=mask).aux_loss.item()
            unmasked = model(ids).aux_loss.item()
        expected = json.load(open(f"{path}/expected_logits.json"))
        expected["padded"] = {"rows": rows, "aux_loss": masked, "aux_loss_without_mask": unmasked}
        json.dump(expected, open(f"{path}/expected_logits.json", "w"))
        print(path, "padded aux", masked, "without the mask", unmasked)


def load(path, ids_json=None):
    config = transformers.AutoConfig.from_pretrained(path)
    arch = (config.architectures or ["LlamaForCausalLM"])[0]
    cls = transformers.AutoModelForSequenceClassification if "SequenceClassification" in arch else transformers.AutoModelForCausalLM
    model, info = cls.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        sys.exit(f"{path}: {bad}")
    ids = json.loads(ids_json) if ids_json else [1, 403, 407, 261, 378]
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    print(json.dumps({"architecture": arch, "logits": out.logits[0].tolist()}))


if __name__ == "__main__":
    {"fixtures": fixtures, "architectures": architectures, "load": load, "padded_aux": padded_aux}[sys.argv[1]](*sys.argv[2:])
