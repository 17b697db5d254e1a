"""A real-size model on one machine: a random Qwen2.5-0.5B-shaped model, aligner beside TRL.

Needs torch, transformers and trl (`pip install trl`); not run in CI.

  python3 tools/real_size.py make OUT
      Builds a randomly initialised model of Qwen2.5-0.5B's shape with transformers (494M
      parameters: hidden 896, 24 layers, 14 heads, 2 KV heads, FFN 4864, q/k/v biases, a
      151,936-row vocabulary, tied embeddings; seeded) and saves it to OUT in float32 with the
      shipped model's tokenizer files (its 512 ids are a subset of the vocabulary), so every
      `aligner` command takes `--set model.path=OUT`.
  python3 tools/real_size.py table OUT [ALIGNER]
      Times aligner (the release binary, default target/release/aligner) and TRL on OUT, one
      process per measurement, alternating between them: seconds per step and peak resident
      memory (`/usr/bin/time`'s maximum RSS) of SFT and of DPO at batch 4 x 256 tokens, and
      generation tokens/s at batch 32 (8-token prompts, 64 new tokens) against transformers'
      `generate`. TRL 1.x trains with gradient checkpointing by default (`SFTConfig` and
      `DPOConfig` set `gradient_checkpointing=True`: each decoder layer rerun in the backward);
      aligner is measured the same way (`--activation-checkpointing`, its
      `train.activation_checkpointing = true`) and, in a column of its own, without it.
      Prints a Markdown table.
  python3 tools/real_size.py trl-sft OUT | trl-dpo OUT | hf-generate OUT
      One of TRL's / transformers' measurements alone (what `table` runs); prints one JSON line.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")

BATCH, SEQ, STEPS = 4, 256, 3
GEN_BATCH, GEN_NEW, GEN_PROMPT = 32, 64, 8


def make(out):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"]:
        shutil.copy(f"assets/stories260K/{name}", f"{out}/{name}")
    params = sum(p.numel() for p in model.parameters())
    print(f"{out}: {params / 1e6:.1f}M parameters")


def ids(salt, length, vocab):
    # aligner bench's synthetic rows: a fixed pseudo-random pattern per row.
    return [1 + (salt * 131 + t * 37) % (vocab - 1) for t in range(length)]


def step_timer():
    import transformers

    class StepTimer(transformers.TrainerCallback):
        """Seconds per optimiser step after the first (warm-up) step."""

        def __init__(self):
            self.times, self.last = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step > 1:
                self.times.append(time.perf_counter() - self.last)

    return StepTimer()


def trainer_args(config_cls, out, **kw):
    # TRL 1.x turns bf16 autocast on by default (`bf16=True`). aligner computes in f32 unless
    # `model.dtype` says otherwise, so both are measured in f32. On a CPU without bf16 matrix
    # instructions (this AVX2 EPYC), PyTorch's bf16 products fall back to its scalar loop: one
    # TRL SFT step ran for over 20 minutes.
    return config_cls(output_dir=out, use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=10_000,
                      dataloader_num_workers=0, disable_tqdm=True, seed=42, per_device_train_batch_size=BATCH,
                      max_steps=STEPS + 1, learning_rate=1e-4, **kw)


def load(out):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token or tok.eos_token
    return model, tok


def trl_sft(out):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tok = load(out)
    vocab = model.config.vocab_size
    data = Dataset.from_dict({"input_ids": [ids(b, SEQ, vocab) for b in range(BATCH * (STEPS + 1))]})
    timer = step_timer()
    SFTTrainer(model=model, train_dataset=data, processing_class=tok, callbacks=[timer],
               args=trainer_args(SFTConfig, "/tmp/real_size_sft", max_length=SEQ)).train()
    print(json.dumps({"seconds_per_step": sum(timer.times) / len(timer.times)}))


def trl_dpo(out):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, tok = load(out)
    vocab = model.config.vocab_size
    # aligner bench dpo's pairs: prompt = the first quarter, chosen and rejected rows of SEQ tokens.
    rows = BATCH * (STEPS + 1)
    chosen = [ids(2 * i, SEQ, vocab) for i in range(rows)]
    rejected = [ids(2 * i + 1, SEQ, vocab) for i in range(rows)]
    pairs = Dataset.from_dict({"prompt_ids": [c[: SEQ // 4] for c in chosen],
                               "chosen_ids": [c[SEQ // 4:] for c in chosen],
                               "rejected_ids": [r[SEQ // 4:] for r in rejected]})
    text = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    timer = step_timer()
    # aligner caches the reference log-probs before training; TRL's equivalent.
    trainer = DPOTrainer(model=model, train_dataset=text, processing_class=tok, callbacks=[timer],
                         args=trainer_args(DPOConfig, "/tmp/real_size_dpo", max_length=SEQ,
                                           precompute_ref_log_probs=True))
    trainer.train_dataset = trainer._precompute_ref_logps(pairs, "train", BATCH)
    trainer.train()
    print(json.dumps({"seconds_per_step": sum(timer.times) / len(timer.times)}))


def hf_generate(out):
    import torch

    model, _ = load(out)
    vocab = model.config.vocab_size
    prompts = torch.tensor([[1 + (i * 31 + t * 17) % (vocab - 1) for t in range(GEN_PROMPT)]
                            for i in range(GEN_BATCH)])
    with torch.no_grad():
        model.generate(prompts[:2], max_new_tokens=2, do_sample=True, pad_token_id=0)
        start = time.perf_counter()
        model.generate(prompts, max_new_tokens=GEN_NEW, min_new_tokens=GEN_NEW, do_sample=True,
                       eos_token_id=None, pad_token_id=0)
        seconds = time.perf_counter() - start
    print(json.dumps({"tokens_per_s": GEN_BATCH * GEN_NEW / seconds}))


def measured(cmd):
    """Runs `cmd` under /usr/bin/time: its stdout and its peak resident memory in GB."""
    run = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M"] + cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{run.stdout}\n{run.stderr}")
    rss = int(re.search(r"MAXRSS (\d+)", run.stderr).group(1)) / 1024 ** 2
    return run.stdout, rss


def table_cell(stdout, column):
    """`column` of the first data row of aligner bench's Markdown table."""
    lines = [l for l in stdout.splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    row = [c.strip() for c in lines[2].strip("|").split("|")]
    return float(row[header.index(column)])


def table(out, aligner="target/release/aligner"):
    bench = [aligner, "bench", "--model", out]
    me = [sys.executable, __file__]
    results = {}
    train = bench + ["train", "--batch", str(BATCH), "--seq", str(SEQ), "--steps", str(STEPS)]
    dpo = bench + ["dpo", "--pairs", str(BATCH), "--seq", str(SEQ), "--steps", str(STEPS)]
    recompute = ["--activation-checkpointing", "layers"]
    for what, ours, theirs in [
        ("SFT", train + recompute, me + ["trl-sft", out]),
        ("DPO", dpo + recompute, me + ["trl-dpo", out]),
        ("generate", bench + ["generate", "--prompts", str(GEN_BATCH), "--new-tokens", str(GEN_NEW),
                              "--batch-sizes", str(GEN_BATCH)],
         me + ["hf-generate", out]),
    ]:
        stdout, rss = measured(ours)
        if what == "generate":
            mine = table_cell(stdout, "tokens/s")
        else:
            mine = table_cell(stdout, "ms / step") / 1e3
        theirs_out, theirs_rss = measured(theirs)
        data = json.loads(theirs_out.strip().splitlines()[-1])
        results[what] = (mine, rss, data.get("seconds_per_step", data.get("tokens_per_s")), theirs_rss)
        print(f"{what}: aligner {mine:.2f} ({rss:.1f} GB), reference {results[what][2]:.2f} "
              f"({theirs_rss:.1f} GB)", file=sys.stderr, flush=True)
    # aligner without recomputation (TRL's `gradient_checkpointing=False` is not measured).
    kept = {}
    for what, ours in [("SFT", train), ("DPO", dpo)]:
        stdout, rss = measured(ours)
        kept[what] = (table_cell(stdout, "ms / step") / 1e3, rss)
        print(f"{what}: aligner without recomputation {kept[what][0]:.2f} ({rss:.1f} GB)",
              file=sys.stderr, flush=True)
    threads = os.cpu_count()
    print(f"| {os.path.basename(out.rstrip('/'))}, {threads} cores | aligner | TRL / transformers "
          f"| aligner without activation checkpointing |")
    print("|---|---:|---:|---:|")
    for what, unit in [("SFT", "s / step"), ("DPO", "s / step")]:
        mine, rss, theirs, theirs_rss = results[what]
        plain, plain_rss = kept[what]
        print(f"| {what}, batch {BATCH} x {SEQ} tokens: {unit} | {mine:.1f} | {theirs:.1f} | {plain:.1f} |")
        print(f"| {what}: peak resident memory, GB | {rss:.1f} | {theirs_rss:.1f} | {plain_rss:.1f} |")
    mine, rss, theirs, theirs_rss = results["generate"]
    print(f"| generation, batch {GEN_BATCH}, {GEN_NEW} new tokens: tokens/s | {mine:.0f} | {theirs:.0f} | |")
    print(f"| generation: peak resident memory, GB | {rss:.1f} | {theirs_rss:.1f} | |")


if __name__ == "__main__":
    commands = {"make": make, "table": table, "trl-sft": trl_sft, "trl-dpo": trl_dpo, "hf-generate": hf_generate}
    if len(sys.argv) < 3 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](*sys.argv[2:])
