"""The PyTorch side of aligner's benchmarks (not run in CI): transformers Llama models equal to
`aligner bench`'s (shipped stories260K, random ~16M with vocab 50257), batch 8 x 128 tokens.

  python3 tools/torch_bench.py [forward|train|generate] [ONLY] [BATCH,SIZES]

ONLY keeps the models whose name contains it (as `aligner bench --only`); BATCH,SIZES are generate's
batch sizes (default 1,8,64).

train = forward + backward + AdamW step on an SFT loss, the inner step of TRL's SFTTrainer
(TRL adds data collation and logging on top, so TRL itself is slower than this).
"""
import sys
import time

import torch
import transformers

torch.set_num_threads(2)


def models():
    yield "stories260K", transformers.AutoModelForCausalLM.from_pretrained("assets/stories260K", dtype=torch.float32)
    cfg = transformers.LlamaConfig(vocab_size=50257, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    yield "random-16M", transformers.AutoModelForCausalLM.from_config(cfg)


def main(what, only="", batch_sizes=(1, 8, 64)):
    batch, seq = 8, 128
    for name, model in models():
        if only not in name:
            continue
        ids = torch.randint(1, model.config.vocab_size, (batch, seq))
        if what == "forward":
            model.eval()
            with torch.no_grad():
                model(ids)
                t = time.time()
                for _ in range(5):
                    model(ids)
            per = (time.time() - t) / 5
            print(f"| {name} | forward | {per * 1e3:.1f} ms | {batch * seq / per:.0f} tokens/s |")
        elif what == "train":
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step():
                loss = model(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()

            step()
            t = time.time()
            for _ in range(5):
                step()
            per = (time.time() - t) / 5
            print(f"| {name} | train step | {per * 1e3:.1f} ms | {batch * seq / per:.0f} tokens/s |")
        elif what == "generate":
            model.eval()
            prompts = torch.randint(3, model.config.vocab_size, (64, 8))
            for bs in batch_sizes:
                t = time.time()
                n = 0
                for i in range(0, 64, bs):
                    out = model.generate(prompts[i:i + bs], max_new_tokens=128, min_new_tokens=128, do_sample=True,
                                         pad_token_id=0)
                    n += (out.shape[1] - 8) * out.shape[0]
                dt = time.time() - t
                print(f"| {name} | generate batch {bs} | {dt:.2f} s | {n / dt:.0f} tokens/s |")


if __name__ == "__main__":
    args = sys.argv[1:] + [None] * 3
    main(args[0] or "train", args[1] or "",
         tuple(int(b) for b in args[2].split(",")) if args[2] else (1, 8, 64))
