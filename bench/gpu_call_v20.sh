#!/usr/bin/env bash
# Issue 33, thirty-fifth session: a plan's decode lane rows as columns to the runner and their ids back as one
# (imp/sampling/works.py, DecodeRows) on the GPU. Sections by $WHAT:
#   tests   the GPU lane files the change touches ($TESTS), then the GPU servers (alone = batched, replays)
#   ab      bench/engine.py on SmolLM2's shape at $STREAMS (64,256) for $TREES (default "new old older"), alternating,
#           $RUNS times: new = this tree; old = this tree with bench/pending/rowbatch_old.patch reversed (f52a863, the
#           34th session's tree); older = old with bench/pending/rowcols_old.patch reversed (799d525); rows = this
#           tree with bench/pending/staging.patch reversed (to_device pinning a block a call, as before the ring)
#   prof    a cProfile of the new tree's engine at $PSTREAMS (256) streams (the event loop's thread)
# Prints as it goes; everything under $OUT.
. bench/device_prelude.sh
if [ ! -d /tmp/old ]; then
  mkdir -p /tmp/old && cp -r imp bench tests /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < bench/pending/rowbatch_old.patch && echo "old tree made")
  mkdir -p /tmp/older && cp -r /tmp/old/imp /tmp/old/bench /tmp/old/tests /tmp/older/ && (cd /tmp/older && patch -s -R -p1 < bench/pending/rowcols_old.patch && echo "older tree made")
fi
if [ ! -d /tmp/rows ] && grep -q _Staging imp/kernels/cuda/runtime.py; then
  mkdir -p /tmp/rows && cp -r imp bench tests /tmp/rows/ && (cd /tmp/rows && patch -s -R -p1 < bench/pending/staging.patch && echo "rows tree made")
fi
for w in ${WHAT:-tests ab}; do t0=$(date +%s); case $w in
tests)
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    -o faulthandler_timeout=250 ${TESTS:-tests/test_gpu_staging.py tests/test_rowbatch.py tests/test_rowparams.py tests/test_devcounts.py tests/test_gpu_check.py tests/test_gpu_runner.py tests/test_gpu_mixed.py} 2>&1 | grep -v "^\s*$" | tail -8
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
    -o faulthandler_timeout=250 tests/test_gpu_server.py -k "concurrent or replays" 2>&1 | grep -v "^\s*$" | tail -4 ;;
ab)
  engine_ab "${TREES:-new old older}" ;;
prof)
  timeout 150 python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 --streams ${PSTREAMS:-256} --prompt 234 --answer 128 \
    --rounds 2 --server-args "--kv-cache-tokens 131072" --profile ${PSTREAMS:-256} > $OUT/prof.txt 2>&1
  grep -A34 "^profile at" $OUT/prof.txt | head -36; grep "^| [0-9]" $OUT/prof.txt | head -4 ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s]"; done
echo "[total $(( $(date +%s) - T0 )) s]"
