#!/usr/bin/env bash
# Issue 34, fortieth session: draft-free speculation on the GPU with verify steps that land like any other
# (VerifyLanding: no host wait at launch, the rows beside a verify stay pipelined) and pipelined sequences that
# cool down when their verifies keep < 1 token each. Sections by $WHAT:
#   stash   the real SmolLM2 in xz parts (.dev6/ in one call, .dev7/ in the next: the carry limit) to /tmp/m;
#           joined and checked (sha256) into /tmp/smollm2.gguf once both are there
#   w8      the 8B BF16 random-weight shape written to /tmp/8b.gguf in the background (setsid: it outlives the call)
#   old     /tmp/old = this tree with bench/pending/spec_async.patch reversed (verify steps waited for at launch)
#   tests   the GPU lane files the change touches, then the GPU servers' speculation / concurrency / replay tests
#           on $SERVER_MODEL (default the real SmolLM2 when joined, else the random shape /tmp/smol.gguf)
#   spec    bench/spec.py on $SPEC_MODEL (default /tmp/smollm2.gguf) for each tree of $TREES ("new old"), server
#           args "--device cuda:0 $SARGS", code and prose at $SSTREAMS (1,16); raw $OUT/spec_<tree><tag>.{txt,json}
#   eight   the same on the 8B BF16 random-weight shape (written to /tmp/8b.gguf; byte-level synthetic tokenizer)
# Prints as it goes; everything under $OUT.
. bench/device_prelude.sh
mkdir -p /tmp/m
for w in ${WHAT:-stash tests}; do t0=$(date +%s); case $w in
stash)
  cp .dev6/* .dev7/* /tmp/m/ 2>/dev/null; ls -la /tmp/m
  if [ ! -f /tmp/smollm2.gguf ] && [ -f /tmp/m/smol.xz.1 ] && [ -f /tmp/m/smol.xz.2 ]; then
    cat /tmp/m/smol.xz.1 /tmp/m/smol.xz.2 | xz -d > /tmp/smollm2.gguf
    echo "$(sha256sum /tmp/smollm2.gguf | cut -c1-16) (want b179c9523d0e6a0f)"
  fi ;;
w8)
  [ -f /tmp/8b.gguf ] || (setsid nohup python3 bench/write_synth.py 8b-bf16 /tmp/8b.gguf < /dev/null > /tmp/w8.txt 2>&1 &)
  echo "8B file: $(ls -la /tmp/8b.gguf 2>/dev/null || echo being written)" ;;
old)
  mkdir -p /tmp/old && cp -r imp bench tests /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < ${PATCH:-bench/pending/spec_async.patch} \
    && echo "old tree made") ;;
tests)
  SM=${SERVER_MODEL:-$([ -f /tmp/smollm2.gguf ] && echo /tmp/smollm2.gguf || echo /tmp/smol.gguf)}
  timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_gpu_split.py tests/test_spec.py \
    > $OUT/tests_lane.txt 2>&1
  timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_runner.py -k "verify or greedy_matches" \
    >> $OUT/tests_lane.txt 2>&1
  grep -E "passed|failed|Error" $OUT/tests_lane.txt | tail -8
  IMP_TEST_MODEL=$SM timeout ${SERVER_S:-300} python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_server.py \
    -k "${SERVER_K:-speculation or concurrent or replays}" > $OUT/tests_server.txt 2>&1
  grep -E "verify steps|passed|failed|Error" $OUT/tests_server.txt | tail -12 ;;
spec|eight)
  if [ $w = eight ]; then
    while pgrep -f "write_synth.py 8b-bf16" > /dev/null; do sleep 2; done; cat /tmp/w8.txt 2>/dev/null
    [ -f /tmp/8b.gguf ] || python3 bench/write_synth.py 8b-bf16 /tmp/8b.gguf 2>&1 | tail -1
    M=/tmp/8b.gguf; TAG=_8b; EXTRA="--max-chars ${MAXC:-2500}"
  else
    M=${SPEC_MODEL:-/tmp/smollm2.gguf}; TAG=${STAG:-}; EXTRA=${SEXTRA:-}
  fi
  for t in ${TREES:-new old}; do d=$here; [ $t != new ] && d=/tmp/$t
    (cd $d && timeout ${SPEC_S:-240} python3 bench/spec.py --model $M --workloads ${SWORK:-code,prose} --prompts ${SPROMPTS:-6} \
      --max-tokens ${STOK:-256} --streams ${SSTREAMS:-1,16} $EXTRA \
      --server-args "--device cuda:0 --kv-cache-tokens ${SKV:-131072} ${SARGS:-}" \
      --json $OUT/spec_$t$TAG.json > $OUT/spec_$t$TAG.txt 2>&1)
    echo "== $t$TAG ${SARGS:-} rc $? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/spec_$t$TAG.txt | tail -12
  done ;;
esac; echo "[$w: $(( $(date +%s) - t0 )) s, call at $(( $(date +%s) - T0 )) s]"; done
