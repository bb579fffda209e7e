#!/usr/bin/env bash
# Issue 33, thirty-sixth session: the decode lane's tokens to the streams as one TokenRows a step (scheduler ->
# detok -> ingress -> API servers), block tables grown by their new entries, device counts' in-sync figures as an
# array by table row; and the 35th session's pinned staging ring, not yet timed. Sections by $WHAT:
#   tests   the GPU lane files the changes touch ($TESTS), then the GPU servers (alone = batched, replays)
#   ab      bench/engine.py on SmolLM2's shape at $STREAMS for $TREES (default "new pre rows"), alternating, $RUNS
#           times: new = this tree; pre = this tree with bench/pending/tokenrows.patch reversed (c189b83: the ring in);
#           rows = pre with bench/pending/staging.patch reversed (to_device pinning a block a call)
#   http    the same workload engine, then through HTTP (--http --client-procs 4, one API server: the default on 16
#           cores) at $HSTREAMS (1,16,64,256) for $HTREES (default "new pre")
#   prof    a cProfile of the new tree's engine at $PSTREAMS (256) streams (the event loop's thread)
#   restart issue 35's cell where the card is an H200 (bench/gpu_call_v17.sh restart: the 8B at 32k context, a 20,000-token
#           prompt cold, again, after a restart from --prompt-cache-dir), else skipped
#   split   issue 39's long-context decode attention: tests/test_gpu_decode_split.py, then bench/decode_attention.py
#           (paged_decode against paged_decode_split, 1k-32k contexts, b1 / b16 / b64, three models' shapes)
#   eight   the 8B BF16 shape at $PROMPTS8 (1400) x $STREAMS8 (16) with its event log kept ($OUT/log8b_<P>/): the
#           ITL policy's chunks against what the device spent on them (bench/step_timeline.py --gaps, bench/itl_steps.py)
# Prints as it goes; everything under $OUT.
. bench/device_prelude.sh
if [ ! -d /tmp/pre ]; then
  mkdir -p /tmp/pre && cp -r imp bench tests /tmp/pre/ && (cd /tmp/pre && patch -s -R -p1 < bench/pending/tokenrows.patch && echo "pre tree made")
  mkdir -p /tmp/rows && cp -r /tmp/pre/imp /tmp/pre/bench /tmp/pre/tests /tmp/rows/ && (cd /tmp/rows && patch -s -R -p1 < bench/pending/staging.patch && echo "rows tree made")
fi
for w in ${WHAT:-tests ab}; do t0=$(date +%s); case $w in
tests)
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    -o faulthandler_timeout=250 ${TESTS:-tests/test_token_rows.py tests/test_gpu_check.py tests/test_devcounts.py tests/test_gpu_staging.py tests/test_gpu_runner.py tests/test_gpu_mixed.py} 2>&1 | grep -v "^\s*$" | tail -8
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
    -o faulthandler_timeout=250 tests/test_gpu_server.py -k "concurrent or replays" 2>&1 | grep -v "^\s*$" | tail -4 ;;
ab)
  engine_ab "${TREES:-new pre rows}" ;;
http)
  for r in $(seq ${RUNS:-1}); do for t in ${HTREES:-new pre}; do d=$here; [ $t != new ] && d=/tmp/$t
    (cd $d && timeout ${HTTP_S:-280} python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 \
      --streams ${HSTREAMS:-1,16,64,256} --prompt 234 --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072" \
      --http --client-procs 4 > $OUT/http_${t}_$r.txt 2>&1)
    echo "$t http run $r rc $? at $(( $(date +%s) - T0 )) s"; grep -A6 "HTTP / engine" $OUT/http_${t}_$r.txt | grep "^| [0-9]"
  done; done ;;
prof)
  timeout 150 python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 --streams ${PSTREAMS:-256} --prompt 234 --answer 128 \
    --rounds 2 --server-args "--kv-cache-tokens 131072" --profile ${PSTREAMS:-256} > $OUT/prof.txt 2>&1
  grep -A34 "^profile at" $OUT/prof.txt | head -36; grep "^| [0-9]" $OUT/prof.txt | head -4 ;;
restart)
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    WHAT=restart TREES=new bash bench/gpu_call_v17.sh
  else echo "not an H200: issue 35's cell skipped"; fi ;;
split)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_gpu_decode_split.py tests/test_layout.py \
    tests/test_gpu_runner.py -k "split or greedy_matches or 135m_shape or pipelined" 2>&1 | tail -4
  timeout 200 python3 bench/decode_attention.py ${DCTX:+--ctx $DCTX} ${DBATCH:+--batch $DBATCH} ${DSHAPES:+--shapes $DSHAPES} \
    > $OUT/decode_attention.txt 2>&1; tail -40 $OUT/decode_attention.txt ;;
eight)
  [ -f /tmp/8b.gguf ] || python3 bench/write_synth.py 8b-bf16 /tmp/8b.gguf 2>&1 | tail -1
  for P in ${PROMPTS8:-1400}; do
    timeout ${EIGHT_S:-200} python3 bench/engine.py --model /tmp/8b.gguf --device cuda:0 --streams ${STREAMS8:-16} \
      --prompt $P --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072" --log-dir $OUT/log8b_$P \
      > $OUT/engine8b_$P.txt 2>&1
    echo "8b P=$P rc $? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/engine8b_$P.txt | grep -v "idle\|prefill-only" | tail -8
    python3 bench/step_timeline.py $OUT/log8b_$P/events.log --skip 0 --gaps 24 2>&1 | tail -26
  done ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s]"; done
echo "[total $(( $(date +%s) - T0 )) s]"
