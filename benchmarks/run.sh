#!/usr/bin/env bash
# The benchmark behind the README table: a random Youtu-LLM-2B-shaped checkpoint (YoutuConfig
# defaults), edgevl bf16 / q8 / bf16 with the expanded KV cache, transformers eager bf16, and
# llama.cpp bf16 / q8_0 (llama-cpp-python built from source), interleaved, 128-token prompt.
#   WORK=/big/disk THREADS="2 1" REPEATS=3 benchmarks/run.sh
# WORK: where checkpoints, packages and GGUF files go (default benchmarks/out); THREADS: the
# thread counts to run, one table each (default "2 1"); REPEATS: interleaved runs per system
# (default 3; the README tables used 5 at 2 threads and 2 at 1 thread, results/*.json "config").
# Needs: pip install -e ".[dev]" llama-cpp-python, and llama-cpp-python's sdist in $WORK/sdist
# (pip download --no-deps --no-binary :all: llama-cpp-python -d $WORK/sdist) for its converter.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-$here/out}
mkdir -p "$WORK" "$here/results"
ck=$WORK/youtu2b
[ -f "$ck/config.json" ] || python "$here/make_random_checkpoint.py" "$ck"
for v in "bf16 absorbed" "q8 absorbed" "bf16 expanded"; do
  set -- $v
  pk=$WORK/pk2b-$1-$2
  [ -f "$pk/manifest.json" ] || /usr/bin/time -v edgevl convert "$ck" "$pk" --dtype "$1" --kv-cache "$2" \
      2> >(tee "$WORK/convert-$1-$2.log" >&2)
done
for t in ${THREADS:-2 1}; do
  edgevl bench "$WORK/pk2b-bf16-absorbed" --extra-model "$WORK/pk2b-q8-absorbed" \
      --extra-model "$WORK/pk2b-bf16-expanded" --compare torch,llamacpp --gguf-types bf16,q8_0 \
      --threads "$t" --repeats "${REPEATS:-3}" --prompt-tokens 128 --gen-tokens 32 \
      --json "$here/results/youtu2b-t$t.json" --plot "$here/results/youtu2b-t$t.png" \
      --markdown "$here/results/youtu2b-t$t.md"
done
