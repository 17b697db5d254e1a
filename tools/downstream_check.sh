#!/usr/bin/env bash
# README's "Using the crates", as a user outside this repository meets it: every crate packaged
# (`cargo package`, what `cargo publish` uploads), then a new crate that depends on aligner-dpo
# alone — resolved from those packages, each unpacked as a registry would serve it (through
# [patch.crates-io]; nothing of the workspace's own folders) — runs the README's snippet and
# trains DPO on the shipped model and data.
#
#   bash tools/downstream_check.sh [WORK_DIR]
#
# Not part of CI: the downstream crate builds Burn without the workspace's GPU features, a
# second Burn build (406 s on 2 cores with an empty target folder, downloads included). Run it
# before a release.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(realpath -m "${1:-$(mktemp -d)}")
mkdir -p "$work"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$work/target}"
export CARGO_TERM_COLOR=never
started=$SECONDS

cargo package --workspace --no-verify --allow-dirty -q
packages="$work/packages"
rm -rf "$packages" && mkdir -p "$packages"
patches=""
for crate in "$CARGO_TARGET_DIR"/package/aligner-*.crate; do
  tar -xzf "$crate" -C "$packages"
  dir=$(basename "$crate" .crate)
  name=${dir%-*}
  patches+="$name = { path = \"$packages/$dir\" }"$'\n'
done

app="$work/my-dpo"
rm -rf "$app" && mkdir -p "$app/src"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
cat > "$app/Cargo.toml" <<TOML
[package]
name = "my-dpo"
version = "0.1.0"
edition = "2024"

[dependencies]
aligner-dpo = "$version"

[patch.crates-io]
$patches
TOML
# The workspace's lock as a start, so the dependencies resolve to the versions tested here.
cp Cargo.lock "$app/Cargo.lock"
# README's snippet, with a short run.
cat > "$app/src/main.rs" <<'RUST'
use aligner_dpo::{Device, LossRegistry, RunDir, objective::DpoConfig};

fn main() -> Result<(), aligner_dpo::DpoError> {
    let mut config = DpoConfig::default(); // the shipped model and tinystories_sentiment pairs
    config.dpo.beta = 0.1;
    config.train.max_steps = 5;
    let registry = LossRegistry::with_builtin();
    let out = std::env::args().nth(1).unwrap_or_else(|| "runs/my-dpo".into());
    let summary = aligner_dpo::train(&config, &registry, &RunDir::new(out), &Device::flex())?;
    println!("{} steps; held-out {:?}; policy in {}", summary.steps, summary.final_eval, summary.final_dir.display());
    Ok(())
}
RUST
cd "$app"
cargo run --release -q -- "$work/run"
test -f "$work/run/final/model.safetensors"
# Nothing of the repository was compiled: every aligner crate came from its package.
if cargo metadata --format-version 1 | grep -q "\"manifest_path\":\"$repo/"; then
  echo "a crate resolved to the repository itself, not to its package" >&2
  exit 1
fi
echo "downstream DPO from the packaged crates: trained in $work/run ($((SECONDS - started)) s)"
