#!/bin/bash
# Every policy method's default run on the shipped task, then `aligner eval` of its final/:
# the README's table "Where each default lands" (lexicon of the policy's own samples, KL to the
# start model, the start model's NLL of them). Usage: bash tools/frontier_table.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
# ALIGNER=path/to/aligner uses that binary instead of building one.
if [ -z "${ALIGNER:-}" ]; then
    cargo build --release -q -p aligner-cli
    ALIGNER=$PWD/target/release/aligner
fi
A=$ALIGNER
M=${1:-runs/frontier}
mkdir -p "$M"
run() {
    local name=$1
    shift
    local started=$SECONDS
    "$A" "$@" --out "$M/$name" --overwrite >"$M/$name.log" 2>&1 || { echo "$name failed: see $M/$name.log" >&2; exit 1; }
    echo "$name: trained in $((SECONDS - started)) s" >&2
}
row() {
    local label=$1 summary=$2
    python3 - "$label" "$summary" <<'PY'
import json, sys
label, path = sys.argv[1], sys.argv[2]
s = json.load(open(path))
print("| %s | %.2f ± %.2f | %.1f | %.2f | %.2f | %.1f | %.2f |" % (
    label, s["reward"], s["reward_stderr"], s["kl_per_response"], s["reference_nll_per_token"],
    s["distinct_2"], s["mean_tokens"], s["eos_fraction"]))
PY
}
evaluate() {
    local name=$1 label=$2
    "$A" eval --model "$M/$name/final" --reward-fn tinystories_sentiment --samples-per-prompt 3 \
        --out "$M/eval-$name" >/dev/null 2>&1
    row "$label" "$M/eval-$name/summary.json"
}
run sft sft
run dpo dpo
run kto kto
run spin spin
run ppo ppo
run rs rs
run online-dpo online-dpo
run self-reward self-reward
run cai cai
run distill distill
run simpo dpo --set dpo.loss=simpo --set dpo.beta=2.0 --set dpo.params.gamma=0.5
run dpo-lr1e-3 dpo --set train.lr=1e-3 --set train.schedule=constant --set train.warmup_steps=0 \
    --set train.max_steps=300 --set train.save_every=0
"$A" eval --reward-fn tinystories_sentiment --samples-per-prompt 3 --out "$M/eval-start" >/dev/null 2>&1
row "start model (stories260K)" "$M/eval-start/summary.json"
evaluate sft '`aligner sft`'
evaluate dpo '`aligner dpo`'
evaluate kto '`aligner kto`'
evaluate spin '`aligner spin`'
evaluate ppo '`aligner ppo`'
evaluate rs '`aligner rs`'
evaluate online-dpo '`aligner online-dpo`'
evaluate self-reward '`aligner self-reward`'
evaluate cai '`aligner cai`'
evaluate distill '`aligner distill` (the default DPO run as teacher)'
evaluate simpo '`aligner dpo --set dpo.loss=simpo --set dpo.beta=2.0 --set dpo.params.gamma=0.5`'
evaluate dpo-lr1e-3 '`aligner dpo`, lr 1e-3 constant, 300 steps × 16'
# The runs' paths on the frontier (eval_frontier/... at every validation) on one chart.
"$A" eval --plot "$M/dpo" "$M/kto" "$M/ppo" "$M/spin/iter-2" "$M/dpo-lr1e-3" "$M/eval-sft" "$M/eval-rs" \
    "$M/eval-simpo" "$M/online-dpo" --out "$M" >/dev/null
echo "chart: $M/frontier.svg" >&2
