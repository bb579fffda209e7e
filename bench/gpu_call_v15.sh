#!/usr/bin/env bash
# Issue 33, twenty-seventh session ($PATCH: the mixed-step merge, then the device penalty counts): a mixed step's matmuls once over both row kinds where they take the same kernel
# (bench/pending/mixed_merge.patch is the change; "old" = the tree with it reversed, in /tmp/old, same call).
# Sections by $WHAT:
#   tests    the GPU lane files the change touches ($TESTS)
#   engine   bench/engine.py, SmolLM2's shape, 234-token prompts, 128 tokens, streams $STREAMS, for each of $TREES
#   eight    the 8B BF16 shape, --prompt $PROMPTS8 at $STREAMS8, for each of $TREES
#   http     bench/engine.py --http for each of $HTREES (default new), streams $HSTREAMS
#   http8    the same on the 8B BF16 shape, --prompt $HPROMPT8 (250) at $HSTREAMS8 (1,16,64,256)
# Every section prints as it goes (a cut call still says what it measured). FORWARD=1: $PATCH is a change not in the
# tree (bench/pending/fine_buckets.patch): "old" is the tree, "new" this copy with the patch applied.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
WHAT=${WHAT:-"tests engine"}; TREES=${TREES:-"new old"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 --version; nproc; git log --oneline -1 2>/dev/null
[ -d /tmp/site ] || python3 bench/device_site.py > $OUT/site.txt 2>&1
export PYTHONPATH=/tmp/site
[ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
here=$PWD
PATCH=${PATCH:-bench/pending/mixed_merge.patch}  # the change under test ("old" = the tree with it reversed)
[ -d /tmp/old ] && [ ! -d /tmp/old/tests ] && cp -r tests /tmp/old/  # --http starts the server with tests/serverproc.py
if [ ! -d /tmp/old ] && [ "${FORWARD:-0}" = 1 ]; then  # PATCH is a change not in the tree: old = the tree as it is,
  mkdir -p /tmp/old && cp -r imp bench tests /tmp/old/ && patch -s -p1 < $PATCH \
    && echo "new tree: patch applied" || echo "new tree: APPLY FAILED"  # new = this copy with it applied
elif [ ! -d /tmp/old ]; then  # the tree before the change
  mkdir -p /tmp/old && cp -r imp bench tests /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < $here/$PATCH) \
    && echo "old tree: patch reversed" || echo "old tree: REVERSE FAILED"
fi
dir() { [ "$1" = old ] && echo /tmp/old || echo $here; }
for w in $WHAT; do t0=$(date +%s); case $w in
tests)
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu -x \
    -o faulthandler_timeout=200 ${TESTS:-tests/test_gpu_mixed.py tests/test_gpu_runner.py} 2>&1 | grep -v "^\s*$" | tail -8 ;;
engine)
  for t in $TREES; do
    (cd $(dir $t) && timeout ${ENGINE_S:-200} python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 \
      --streams ${STREAMS:-1,16,64,256} --prompt 234 --answer 128 --rounds ${ROUNDS:-2} \
      --server-args "--kv-cache-tokens 131072 ${ARGS:-}" --json $OUT/engine_$t.json > $OUT/engine_$t.txt 2>&1)
    echo "engine $t rc $? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/engine_$t.txt | grep -v "idle\|prefill-only" | tail -24
  done ;;
eight)
  [ -f /tmp/8b.gguf ] || python3 bench/write_synth.py 8b-bf16 /tmp/8b.gguf 2>&1 | tail -1
  for P in ${PROMPTS8:-1400}; do for t in $TREES; do
    (cd $(dir $t) && timeout ${EIGHT_S:-200} python3 bench/engine.py --model /tmp/8b.gguf --device cuda:0 \
      --streams ${STREAMS8:-16,64} --prompt $P --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072 ${ARGS:-}" \
      --json $OUT/engine8b_${t}_$P.json > $OUT/engine8b_${t}_$P.txt 2>&1)
    echo "8b $t P=$P rc $? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/engine8b_${t}_$P.txt | grep -v "idle\|prefill-only" | tail -12
  done; done ;;
http|http8)
  M=/tmp/smol.gguf; P=234; S=${HSTREAMS:-1,16,64}; tag=""; trees=${HTREES:-new}
  if [ $w = http8 ]; then  # the 8B BF16 shape through HTTP (250-token prompts: the 4,000 tok/s workload)
    [ -f /tmp/8b.gguf ] || python3 bench/write_synth.py 8b-bf16 /tmp/8b.gguf 2>&1 | tail -1
    M=/tmp/8b.gguf; P=${HPROMPT8:-250}; S=${HSTREAMS8:-1,16,64,256}; tag=8b; trees=${HTREES8:-new}
  fi
  for t in $trees; do
  (cd $(dir $t) && timeout ${HTTP_S:-300} python3 bench/engine.py --model $M --device cuda:0 --streams $S \
    --prompt $P --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072 ${ARGS:-}" --http --client-procs 4 \
    --json $OUT/http${tag}_$t.json > $OUT/http${tag}_$t.txt 2>&1)
  echo "http$tag $t rc $? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/http${tag}_$t.txt | grep -v "idle\|prefill-only" | tail -30
  done ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s]"; done
echo "[total $(( $(date +%s) - T0 )) s]"
