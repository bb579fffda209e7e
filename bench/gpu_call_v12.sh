#!/usr/bin/env bash
# Issue 33, twenty-third session: where the engine's time goes at 64-256 streams on the GPU. Sections by $WHAT:
#   tests    the GPU lane's runner and mixed-graph tests (device_ns: the landing events now timed)
#   engine   bench/engine.py on SmolLM2's shape (random weights), 234-token prompts, 128 tokens, streams $STREAMS;
#            the step table now has the device's own ms per kind (CUDA events)
#   spy      the same at 256 streams (4 rounds) under py-spy (carried in .dev4/), every thread, raw stacks to $OUT
#   eight    the 8B BF16 shape: --prompt 250 and 1400 at 1,16,64 streams
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHAT=${WHAT:-"tests engine spy"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 --version; nproc
[ -d /tmp/site ] || python3 bench/device_site.py
export PYTHONPATH=/tmp/site
[ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
git log --oneline -1
for w in $WHAT; do t0=$(date +%s); case $w in
tests)
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu -x \
    -o faulthandler_timeout=150 ${TESTS:-tests/test_gpu_runner.py tests/test_gpu_mixed.py} 2>&1 | tail -6 ;;
engine)  # $CONFIGS: name=flags,... ("new" = the defaults; "old" = 512-token steps without the ratio policy)
  for c in ${CONFIGS:-old=--max-step-tokens_512_--itl-ratio_0 new=}; do n=${c%%=*}; f=$(echo "${c#*=}" | tr _ ' ')
    timeout ${ENGINE_S:-200} python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 \
      --streams ${STREAMS:-1,16,64,256} --prompt 234 --answer 128 --rounds 2 \
      --server-args "--kv-cache-tokens 131072 $f ${ARGS:-}" ${HTTP:+--http --client-procs 4} \
      --json $OUT/engine_$n.json > $OUT/engine_$n.txt 2>&1
    echo "engine $n ($f) rc $?"; grep -v "^\s*$" $OUT/engine_$n.txt | grep -v Warning | grep "^|" | tail -30
  done ;;
spy)
  chmod +x .dev4/py-spy
  for C in ${SPY_STREAMS:-256}; do
    timeout ${SPY_S:-240} .dev4/py-spy record -r 1000 --threads -f raw -o $OUT/spy$C.txt --nonblocking -- \
      python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 --streams $C --prompt 234 \
      --answer 128 --rounds 4 --server-args "--kv-cache-tokens 131072 ${ARGS:-}" > $OUT/spy_engine$C.txt 2>&1
    echo "spy $C rc $?"; grep -A3 "^| streams | tok" $OUT/spy_engine$C.txt; tail -2 $OUT/spy_engine$C.txt
    python3 bench/spy_summary.py $OUT/spy$C.txt > $OUT/spy${C}_summary.txt 2>&1; rm -f $OUT/spy$C.txt
  done ;;
eight)  # $CONFIGS8 as $CONFIGS; $PROMPTS8 prompt lengths
  [ -f /tmp/8b.gguf ] || python3 bench/write_synth.py 8b-bf16 /tmp/8b.gguf 2>&1 | tail -1
  echo "8b written at $(( $(date +%s) - t0 )) s"
  for c in ${CONFIGS8:-new=}; do n=${c%%=*}; f=$(echo "${c#*=}" | tr _ ' ')
  for P in ${PROMPTS8:-250 1400}; do
    timeout ${EIGHT_S:-240} python3 bench/engine.py --model /tmp/8b.gguf --device cuda:0 --streams ${STREAMS8:-1,16,64} \
      --prompt $P --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072 $f ${ARGS:-}" \
      --json $OUT/engine8b_${n}_$P.json > $OUT/engine8b_${n}_$P.txt 2>&1
    echo "8b $n ($f) P=$P rc $? at $(( $(date +%s) - t0 )) s"; grep "^|" $OUT/engine8b_${n}_$P.txt | tail -16
  done; done ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s]"; done
