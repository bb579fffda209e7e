#!/usr/bin/env bash
# Issue 33, thirty-third session: the decode lane (deliverable 3's first stage) on the GPU. Sections by $WHAT:
#   server  the GPU server lane tests the lane touches (alone = batched pipelined, the logs replay): $TESTS
#   lane    bench/engine.py on SmolLM2's shape at $STREAMS (64,256), this tree (lane) and /tmp/nolane (the same tree
#           with `decode_lane=False` in imp/engine/cores.py), alternating, $RUNS times
# Prints as it goes; everything under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; git log --oneline -1 2>/dev/null
[ -d /tmp/site ] || python3 bench/device_site.py > $OUT/site.txt 2>&1
export PYTHONPATH=/tmp/site
[ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
here=$PWD
for w in ${WHAT:-server lane}; do t0=$(date +%s); case $w in
server)
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu -x \
    -o faulthandler_timeout=200 ${TESTS:-tests/test_gpu_server.py -k "concurrent or replays"} 2>&1 | grep -v "^\s*$" | tail -8 ;;
lane)
  if [ ! -d /tmp/nolane ]; then
    mkdir -p /tmp/nolane && cp -r imp bench tests /tmp/nolane/ && sed -i 's/decode_lane=True/decode_lane=False/' \
      /tmp/nolane/imp/engine/cores.py && grep -c "decode_lane=False" /tmp/nolane/imp/engine/cores.py
  fi
  for r in $(seq ${RUNS:-2}); do for t in lane nolane; do d=$here; [ $t = nolane ] && d=/tmp/nolane
    (cd $d && timeout ${ENGINE_S:-150} python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 \
      --streams ${STREAMS:-64,256} --prompt 234 --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072" \
      --json $OUT/lane_${t}_$r.json > $OUT/lane_${t}_$r.txt 2>&1)
    echo "$t run $r rc $? at $(( $(date +%s) - T0 )) s"; grep "^| [0-9]" $OUT/lane_${t}_$r.txt | head -4
  done; done ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s]"; done
echo "[total $(( $(date +%s) - T0 )) s]"
