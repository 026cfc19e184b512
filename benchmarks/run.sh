#!/usr/bin/env bash
# The benchmarks behind docs/benchmarks.md, on random checkpoints with real shapes
# (benchmarks/make_random.py), interleaved:
# - a Youtu-LLM-2B-shaped checkpoint (YoutuConfig defaults): edgevl bf16 and q8 against llama.cpp
#   bf16 and q8_0, 128-token prompt, 32 new tokens;
# - a Youtu-VL checkpoint with the 4B vision tower (1152 wide, 27 layers, 16 heads) and a 1-layer
#   language model: image encoding, edgevl bf16 against llama.cpp's mtmd (2 threads);
# - a Qwen3.5-0.8B-shaped checkpoint: edgevl bf16 and q8 against llama.cpp bf16 and q8_0;
# - a 449 M-parameter Qwen3.5-MoE (32 experts, top-8) against llama.cpp's qwen35moe, and the same
#   with Qwen3.5-35B-A3B's layer shapes over 4 layers (128 experts of 512, top-8; 3.5 GB); peak
#   memory with an expert cache (benchmarks/moe_memory.py).
#   WORK=/big/disk THREADS="2 1" REPEATS=3 benchmarks/run.sh
# WORK: where checkpoints, packages and GGUF files go (default benchmarks/out); THREADS: the
# thread counts to run, one table each (default "2 1"); REPEATS: interleaved runs per system
# (default 3, as in docs/benchmarks.md).
# Needs: pip install -e ".[dev]" and llama-cpp-python built from source with its multimodal
# library (CMAKE_ARGS="-DLLAVA_BUILD=ON" pip install --no-binary :all: llama-cpp-python), and its
# sdist in $WORK/sdist (pip download --no-deps --no-binary :all: llama-cpp-python -d $WORK/sdist)
# for the GGUF converter.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-$here/out}
export EDGEVL_LLAMACPP_SDIST=$WORK/sdist
mkdir -p "$WORK" "$here/results"
convert() {  # checkpoint, package, dtype
  [ -f "$2/manifest.json" ] || /usr/bin/time -v edgevl convert "$1" "$2" --dtype "$3" \
      2> >(tee "$2.convert.log" >&2)
}
ck=$WORK/youtu2b
[ -f "$ck/config.json" ] || python "$here/make_random.py" youtu "$ck" --shape 2b
convert "$ck" "$WORK/pk2b-bf16" bf16
convert "$ck" "$WORK/pk2b-q8" q8
vl=$WORK/vl4b
[ -f "$vl/config.json" ] || python "$here/make_random.py" youtu_vl "$vl" --shape 4b-vision
convert "$vl" "$WORK/pk-vl4b" bf16
convert "$vl" "$WORK/pk-vl4b-q8" q8
qw=$WORK/qwen35-0.8b
[ -f "$qw/config.json" ] || python "$here/make_random.py" qwen3_5 "$qw" --shape 0.8b
convert "$qw" "$WORK/q35-bf16" bf16
convert "$qw" "$WORK/q35-q8" q8
moe_bench() {  # name, then make_random.py's options: packages q8, bf16 (bf16 experts), q8 --dense q8,
               # bf16 (the default: q8 experts)
  local ck=$WORK/qwen35moe-$1 pk=$WORK/moe-$1 res=$here/results/qwen3_5moe-$1
  [ -f "$ck/config.json" ] || python "$here/make_random.py" qwen3_5_moe "$ck" "${@:2}"
  convert "$ck" "$pk-q8" q8
  [ -f "$pk-bf16/manifest.json" ] || edgevl convert "$ck" "$pk-bf16" --dtype bf16 --experts bf16
  [ -f "$pk-q8dense/manifest.json" ] || edgevl convert "$ck" "$pk-q8dense" --dtype q8 --dense q8
  edgevl bench "$pk-q8" --extra-model "$pk-bf16" --compare llamacpp --gguf-types bf16,q8_0 --threads 2 \
      --repeats "${REPEATS:-3}" --prompt-tokens 128 --gen-tokens 32 --json "$res-t2.json" --plot "$res-t2.png" \
      --markdown "$res-t2.md"
  edgevl bench "$pk-q8" --extra-model "$pk-q8dense" --compare llamacpp --gguf-types q8_0 --threads 2 \
      --repeats "${REPEATS:-3}" --prompt-tokens 128 --gen-tokens 32 --json "$res-dense-q8-t2.json" \
      --markdown "$res-dense-q8-t2.md"
  # no --gguf-types: llama.cpp at each package's precision (bf16 with q8_0 experts for the default)
  [ -f "$pk-bf16q8/manifest.json" ] || edgevl convert "$ck" "$pk-bf16q8" --dtype bf16
  edgevl bench "$pk-bf16q8" --extra-model "$pk-q8" --extra-model "$pk-q8dense" --compare llamacpp --threads 2 \
      --repeats "${REPEATS:-3}" --prompt-tokens 128 --gen-tokens 32 --json "$res-same-t2.json" \
      --plot "$res-same-t2.png" --markdown "$res-same-t2.md"
}
moe_bench 449m --shape 449m
moe_bench a3b-4l --shape a3b --layers 4
# peak memory with an expert cache against "cache + non-expert weights + 15 %": the 4-layer
# package above, and 16 layers of 32 experts (1.1 GB dense, 1.5 GB of q8 experts; 4.1 GB bf16)
ck16=$WORK/qwen35moe-a3b16x32
[ -f "$ck16/config.json" ] || python "$here/make_random.py" qwen3_5_moe "$ck16" --shape a3b --layers 16 --experts 32
convert "$ck16" "$WORK/moe-a3b16x32-q8" q8
python "$here/moe_memory.py" "$WORK/moe-a3b16x32-q8" --cache-mb 380 --cache-mb 300 --cache-mb 100 --cache-mb 0 \
    --json "$here/results/moe-memory-a3b16x32.json"
python "$here/moe_memory.py" "$WORK/moe-a3b-4l-q8" --cache-mb 350 --cache-mb 0 --json "$here/results/moe-memory-a3b4x128.json"
for t in ${THREADS:-2 1}; do
  edgevl bench "$WORK/pk2b-bf16" --extra-model "$WORK/pk2b-q8" --compare llamacpp --gguf-types bf16,q8_0 \
      --threads "$t" --repeats "${REPEATS:-3}" --prompt-tokens 128 --gen-tokens 32 \
      --json "$here/results/youtu2b-t$t.json" --plot "$here/results/youtu2b-t$t.png" \
      --markdown "$here/results/youtu2b-t$t.md"
  edgevl bench "$WORK/q35-bf16" --extra-model "$WORK/q35-q8" --compare llamacpp --gguf-types bf16,q8_0 \
      --threads "$t" --repeats "${REPEATS:-3}" --prompt-tokens 128 --gen-tokens 32 \
      --json "$here/results/qwen3_5-0.8b-t$t.json" --plot "$here/results/qwen3_5-0.8b-t$t.png" \
      --markdown "$here/results/qwen3_5-0.8b-t$t.md"
done
# the vision towers, bf16 and int8 (q8 packages), against llama.cpp's mtmd (f16 and q8_0 projectors)
edgevl bench "$WORK/pk-vl4b" --extra-model "$WORK/pk-vl4b-q8" --images 640x480,1024x768 --compare llamacpp \
    --gguf-types f16 --threads 2 --repeats "${REPEATS:-3}" \
    --json "$here/results/vl4b-tower-images-t2.json" --markdown "$here/results/vl4b-tower-images-t2.md"
edgevl bench "$WORK/q35-bf16" --extra-model "$WORK/q35-q8" --images 384x384,448x448,640x480,1024x768 \
    --compare llamacpp --gguf-types f16,q8_0 --threads 2 --repeats "${REPEATS:-3}" \
    --json "$here/results/qwen3_5-0.8b-tower-images-t2.json" --markdown "$here/results/qwen3_5-0.8b-tower-images-t2.md"
python "$here/bench_qwen3_5.py" "$WORK/q35-bf16" --threads 1 --repeat "${REPEATS:-3}"
