"""TRL's own trainers beside aligner's (not run in CI; needs `pip install trl`).

  python3 tools/trl_bench.py speed       # SFTTrainer and DPOTrainer step times at aligner bench's shapes
  python3 tools/trl_bench.py dpo OUT     # DPOTrainer with `aligner dpo`'s defaults on the shipped data

speed: batch 8 x 128 tokens (SFT) and 8 pairs x 128 tokens with 32 prompt tokens (DPO), the shapes of
`aligner bench train` and `aligner bench dpo`; the stories260K model and a random ~16M Llama (vocab
50257). Each step is timed from the trainer's step callbacks (data collation, forward, backward,
clipping, AdamW), the first 2 steps left out. DPO is timed twice: TRL's default (reference model run
every step) and `precompute_ref_log_probs=True` (aligner's way: reference log-probs computed once).

dpo: the same steps, batch, learning rate, schedule, warm-up, beta, clipping and seed as
`aligner dpo` with no config, on sequences tokenized the way aligner does (BOS + prompt, continuation
without an added EOS). Writes OUT/final (an HF folder `aligner generate` can sample from) and
OUT/metrics.json (TRL's eval rewards/accuracies on test.pref.jsonl before and after).
"""
import json
import os
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")
import torch
import transformers
from datasets import Dataset
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

torch.set_num_threads(2)
DATA = "assets/tinystories_sentiment"


def models():
    yield "stories260K", lambda: transformers.AutoModelForCausalLM.from_pretrained(
        "assets/stories260K", dtype=torch.float32)
    cfg = transformers.LlamaConfig(vocab_size=50257, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)

    def random_16m():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg)

    yield "random-16M", random_16m


class StepTimer(transformers.TrainerCallback):
    def __init__(self, skip=2):
        self.skip, self.times, self.last = skip, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.last is None:
            self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if state.global_step > self.skip:
            self.times.append(now - self.last)
        self.last = now

    def per_step(self):
        return sum(self.times) / len(self.times)


def common(out, **kw):
    return dict(output_dir=out, use_cpu=True, report_to=[], save_strategy="no", logging_steps=10_000,
                dataloader_num_workers=0, disable_tqdm=True, seed=42, **kw)


def tokenizer():
    tok = transformers.AutoTokenizer.from_pretrained("assets/stories260K")
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token or tok.eos_token
    return tok


def speed(steps=7):
    g = torch.Generator().manual_seed(0)
    tok = tokenizer()
    print("| model | trainer | batch | ms / step | tokens/s (SFT) or pairs/s (DPO) |")
    print("|---|---|---|---:|---:|")
    for name, make in models():
        vocab = make().config.vocab_size
        ids = torch.randint(3, vocab, (steps * 8 * 3, 128), generator=g).tolist()
        sft_data = Dataset.from_dict({"input_ids": ids[: steps * 8]})
        timer = StepTimer()
        trainer = SFTTrainer(model=make(), train_dataset=sft_data, processing_class=tok, callbacks=[timer],
                             args=SFTConfig(**common("/tmp/trl_bench_sft"), per_device_train_batch_size=8,
                                            max_length=128, max_steps=steps, learning_rate=1e-4))
        trainer.train()
        per = timer.per_step()
        print(f"| {name} | SFTTrainer | 8 x 128 | {per * 1e3:.1f} | {8 * 128 / per:.0f} |", flush=True)
        pairs = Dataset.from_dict({"prompt_ids": [r[:32] for r in ids[: steps * 8]],
                                   "chosen_ids": [r[32:] for r in ids[steps * 8: steps * 16]],
                                   "rejected_ids": [r[32:] for r in ids[steps * 16:]]})
        text = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
        for precompute in (False, True):
            timer = StepTimer()
            trainer = DPOTrainer(model=make(), ref_model=make(), train_dataset=text, processing_class=tok, callbacks=[timer],
                                 args=DPOConfig(**common("/tmp/trl_bench_dpo"), per_device_train_batch_size=8,
                                                max_length=128, max_steps=steps, learning_rate=1e-4,
                                                precompute_ref_log_probs=precompute))
            trainer.train_dataset = trainer._precompute_ref_logps(pairs, "train", 8) if precompute else pairs
            trainer.train()
            per = timer.per_step()
            how = "reference precomputed" if precompute else "reference each step"
            print(f"| {name} | DPOTrainer ({how}) | 8 pairs x 128 | {per * 1e3:.1f} | {8 / per:.1f} |",
                  flush=True)


def pref_dataset(path, tok):
    rows = [json.loads(line) for line in open(path)]
    out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for row in rows:
        prompt = tok(row["prompt"])["input_ids"]
        out["prompt_ids"].append(prompt)
        for key in ("chosen", "rejected"):
            full = tok(row["prompt"] + row[key])["input_ids"][:256]
            out[f"{key}_ids"].append(full[len(prompt):])
    return Dataset.from_dict(out)


def dpo(out):
    tok = tokenizer()
    train = pref_dataset(f"{DATA}/train.pref.jsonl", tok)
    test = pref_dataset(f"{DATA}/test.pref.jsonl", tok)
    text = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    model = transformers.AutoModelForCausalLM.from_pretrained("assets/stories260K", dtype=torch.float32)
    # aligner dpo defaults: 1 epoch, batch 16, lr 3e-4 cosine with 5 warm-up steps, beta 0.1, clip 1.0.
    args = DPOConfig(**common(out), per_device_train_batch_size=16, per_device_eval_batch_size=16,
                     num_train_epochs=1, learning_rate=3e-4, lr_scheduler_type="cosine", warmup_steps=5,
                     beta=0.1, max_grad_norm=1.0, weight_decay=0.0, max_length=None)
    trainer = DPOTrainer(model=model, train_dataset=text, eval_dataset=text, processing_class=tok, args=args)
    trainer.train_dataset, trainer.eval_dataset = train, test
    before = trainer.evaluate()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = trainer.evaluate()
    trainer.save_model(f"{out}/final")
    tok.save_pretrained(f"{out}/final")
    metrics = {"train_seconds": seconds, "steps": trainer.state.global_step, "before": before, "after": after}
    json.dump(metrics, open(f"{out}/metrics.json", "w"), indent=1)
    for key in ("eval_rewards/accuracies", "eval_rewards/margins", "eval_loss"):
        print(f"{key}: {before.get(key)} -> {after.get(key)}")
    print(f"{trainer.state.global_step} steps in {seconds:.1f} s")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "speed"
    speed() if what == "speed" else dpo(sys.argv[2])
