#!/usr/bin/env bash
# Issue 33, thirty-fourth session: the executor's rows as columns (imp/sampling/rowparams.py, imp/gpu/tables.py) on
# the GPU. Sections by $WHAT:
#   tests   the GPU lane files the change touches ($TESTS), then the GPU servers (alone = batched, replays)
#   ab      bench/engine.py on SmolLM2's shape at $STREAMS (64,256): this tree (new) and /tmp/old (this tree with
#           bench/pending/rowcols_old.patch reversed), alternating, $RUNS times
#   prof    a cProfile of the new tree's engine at 256 streams (the event loop's thread)
#   restart issue 35's cell where the card is an H200 (bench/gpu_call_v17.sh restart), else skipped
# Prints as it goes; everything under $OUT.
. bench/device_prelude.sh
for w in ${WHAT:-tests ab}; do t0=$(date +%s); case $w in
tests)
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
    -o faulthandler_timeout=250 ${TESTS:-tests/test_rowparams.py tests/test_devcounts.py tests/test_gpu_runner.py tests/test_gpu_mixed.py tests/test_gpu_kernels.py} 2>&1 | grep -v "^\s*$" | tail -8
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
    -o faulthandler_timeout=250 tests/test_gpu_server.py -k "concurrent or replays" 2>&1 | grep -v "^\s*$" | tail -4 ;;
ab)
  if [ ! -d /tmp/old ]; then
    mkdir -p /tmp/old && cp -r imp bench tests /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < bench/pending/rowcols_old.patch && echo "old tree made")
  fi
  engine_ab "new old" ;;
prof)
  timeout 150 python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 --streams 256 --prompt 234 --answer 128 \
    --rounds 2 --server-args "--kv-cache-tokens 131072" --profile 256 > $OUT/prof.txt 2>&1
  grep -A22 "^profile at" $OUT/prof.txt | head -24 ;;
restart)
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    WHAT=restart TREES=new bash bench/gpu_call_v17.sh
  else echo "not an H200: issue 35's cell skipped"; fi ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s]"; done
echo "[total $(( $(date +%s) - T0 )) s]"
