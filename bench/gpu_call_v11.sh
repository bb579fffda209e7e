#!/usr/bin/env bash
# Issue 35, twenty-second session: the GPU executor's tiers and swap. One device call, sections by $WHAT:
#   tests    the GPU lane's kvcopy tests (and the runner's, for what runner.py gained), synthetic models
#   swap     bench/swap.py on the GPU: swap vs recompute under pool pressure (SmolLM2's shape, random weights)
#   restart  bench/prompt_cache.py on the GPU: the 8B BF16 shape with a 32k context, a 20k-token prompt of
#            token ids, cold / after a restart (page cache dropped when root) / again
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHAT=${WHAT:-"tests swap"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 --version; df -h /tmp | tail -1
[ -d /tmp/site ] || python3 bench/device_site.py
export PYTHONPATH=/tmp/site
[ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
git log --oneline -1
for w in $WHAT; do case $w in
tests)
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu -x \
    -o faulthandler_timeout=150 ${TESTS:-tests/test_gpu_kvcopy.py tests/test_gpu_runner.py} 2>&1 | tail -15 ;;
swap)
  t0=$(date +%s)
  timeout ${SWAP_S:-360} python3 bench/swap.py --device cuda:0 --model /tmp/smol.gguf \
    --lengths ${LENGTHS:-1024,4096} --modes ${MODES:-recompute,swap,auto} --streams ${STREAMS:-8} \
    --tokens ${TOKENS:-1000} --log-dir $OUT > $OUT/swap.txt 2>&1
  echo "swap rc $? in $(( $(date +%s) - t0 )) s"; cat $OUT/swap.txt
  grep -h "swap area" $OUT/swap-*.log | head -3 ;;
restart)
  t0=$(date +%s)
  [ -f /tmp/8b32k.gguf ] || python3 bench/write_synth.py 8b-bf16 /tmp/8b32k.gguf 32768 2>&1 | tail -1
  echo "8b written in $(( $(date +%s) - t0 )) s"
  timeout ${RESTART_S:-420} python3 bench/prompt_cache.py --model /tmp/8b32k.gguf --device cuda:0 --ctx 32768 \
    --prompt-tokens ${PROMPT_TOKENS:-20000} --max-tokens 16 --drop-caches > $OUT/restart.txt 2>&1
  echo "restart rc $? in $(( $(date +%s) - t0 )) s"; cat $OUT/restart.txt ;;
esac; done
