#!/usr/bin/env bash
# Issue 33, twenty-seventh session: where the engine process's time goes through HTTP at 256 streams (HTTP / engine
# 0.74-0.79 there, 0.85-0.95 at 1-64). py-spy (carried in .dev6/: `pip download --no-deps py-spy`, the wheel
# unpacked) over bench/engine.py --http and its children: the engine level in the bench's own process, then the same
# workload through `python -m imp` (engine process + one API server) and 4 client processes. Raw stacks gzipped to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; T0=$(date +%s)
export PYTHONPATH=/tmp/site
[ -d /tmp/site ] || python3 bench/device_site.py > /dev/null 2>&1
[ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
S=.dev6/py_spy-0.4.3.data/scripts/py-spy; chmod +x $S
timeout ${SPY_S:-240} $S record -r ${RATE:-200} --threads --subprocesses -f raw -o $OUT/spy_http.txt --nonblocking -- \
  python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 --streams ${STREAMS:-256} --prompt 234 --answer 128 \
  --rounds ${ROUNDS:-4} --server-args "--kv-cache-tokens 131072 ${ARGS:-}" --http --client-procs 4 > $OUT/spy_http_engine.txt 2>&1
echo "spy rc $? at $(( $(date +%s) - T0 )) s"; grep "^| [0-9]" $OUT/spy_http_engine.txt | grep -v "idle\|prefill"
ls -la $OUT/spy_http.txt; gzip -f $OUT/spy_http.txt
