#!/usr/bin/env bash
# Issue 33, twentieth session: one device call, sections chosen by $WHAT (space-separated):
#   tests   the GPU lane's runner and kernel tests (synthetic models: no download)
#   engine  bench/engine.py, SmolLM2's shape (random weights), --gpu-graphs $GRAPHS ("decode" = the old
#           eager prompt steps, "all" = mixed-step graphs), $HTTP=1 adds the same workload through HTTP
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHAT=${WHAT:-"tests engine"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 --version
[ -d /tmp/site ] || python3 bench/device_site.py
export PYTHONPATH=/tmp/site
[ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
git log --oneline -1
for d in .dev1 .dev2 .dev3; do [ -d $d ] && cp $d/* /tmp/ 2>/dev/null; done; ls /tmp/smolpart.* 2>/dev/null
for w in $WHAT; do case $w in
tests)
  timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu -x -o faulthandler_timeout=120 \
    ${TESTS:-tests/test_gpu_runner.py tests/test_gpu_paged_prefill.py tests/test_gpu_mixed.py} 2>&1 | tail -15 ;;
engine)
  for g in ${GRAPHS:-all}; do
    export TMPDIR=/tmp/engb-$g; mkdir -p $TMPDIR
    h=""; [ "${HTTP:-0}" = 1 ] && h="--http --client-procs 4"
    t0=$(date +%s)
    timeout ${ENGINE_S:-300} python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 \
      --streams ${STREAMS:-1,16,64,256} --prompt 234 --answer 128 --rounds 2 \
      --server-args "--kv-cache-tokens 131072 --gpu-graphs $g" $h --json $OUT/engine_$g.json > $OUT/engine_$g.txt 2>&1
    echo "engine $g rc $? in $(( $(date +%s) - t0 )) s"
    grep -v "^\s*$" $OUT/engine_$g.txt | tail -40
    for f in $TMPDIR/imp-engine-bench-*/server.log; do [ -f "$f" ] && tail -5 "$f"; done
  done ;;
smol)  # the real SmolLM2, carried in two calls (.dev1/, .dev2/, .dev3/ in three calls: the 64 MiB carry limit)
  [ -f /tmp/smolreal.gguf ] || { cat /tmp/smolpart.0 /tmp/smolpart.1 /tmp/smolpart.2 > /tmp/smolreal.gguf && sha256sum /tmp/smolreal.gguf; } ;;
spec)
  timeout ${SPEC_S:-200} python3 bench/spec.py --model /tmp/smolreal.gguf --server-args "--device cuda:0" \
    --streams ${SPEC_STREAMS:-1,16} --prompts ${SPEC_PROMPTS:-8} --max-tokens 256 --workloads ${SPEC_WL:-code,prose} \
    --json $OUT/spec.json > $OUT/spec.txt 2>&1; echo "spec rc $?"; grep -v "^\s*$" $OUT/spec.txt | tail -30 ;;
server)
  IMP_TEST_MODEL=/tmp/smolreal.gguf timeout ${SERVER_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -x \
    -o faulthandler_timeout=120 tests/test_gpu_server.py -k "${SERVER_K:-concurrent or replay or constrained}" 2>&1 | tail -8 ;;
esac; done
