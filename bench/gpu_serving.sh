#!/usr/bin/env bash
# The GPU serving run (issue 14), one device call: the GPU lane's tests, then
# bench/serving.py through HTTP for each --api-servers layout and llama.cpp's
# llama-server (CUDA, built by `LLAMA_CUDA=1 bench/llama_cpp.sh`) on the same GGUF.
#
#     IMP_TEST_MODEL=/tmp/smol.gguf bash bench/gpu_serving.sh [tests] [layouts] [streams]
set -uo pipefail
MODEL=${IMP_TEST_MODEL:?the SmolLM2 GGUF}
OUT=${OUT:-/tmp}
LAYOUTS=${2:-0,1,2}
STREAMS=${3:-1,16,64,256}
if [ "${1:-tests}" = tests ]; then
  # the whole lane takes ~320 s on an H200 (2026-12-01): a shorter limit reads as a hang
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu -o faulthandler_timeout=120 tests/ 2>&1 | tail -15
fi
LS=${LLAMA_DIR:-/tmp/llama-cpp}/build/bin/llama-server
args=(--model "$MODEL" --device cuda:0 --layouts "$LAYOUTS" --streams "$STREAMS" --tokens 128 --runs 2
      --client-procs 4 --logs "$OUT")
[ -x "$LS" ] && args+=(--llama-server "$LS" --threads 8)
python3 bench/serving.py "${args[@]}" 2>&1 | tee "$OUT/serving.md"
