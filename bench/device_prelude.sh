# Sourced by the GPU call scripts (bench/gpu_call_v20.sh on): the card and host named, the carried wheels installed
# into /tmp/site (bench/device_site.py) and on PYTHONPATH, SmolLM2's random-weight shape written to /tmp/smol.gguf;
# $OUT made, $T0 the call's start, $here the tree the call runs in.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; lscpu | grep "Model name"
[ -d /tmp/site ] || python3 bench/device_site.py > $OUT/site.txt 2>&1
export PYTHONPATH=/tmp/site
[ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
here=$PWD

# engine_ab TREES: bench/engine.py on SmolLM2's shape at $STREAMS (64,256) for each tree in turn, $RUNS (2) times;
# tree "new" is $here, any other /tmp/<tree> (the caller makes it); raw output $OUT/ab_<tree>_<run>.{txt,json}
engine_ab() {
  for r in $(seq ${RUNS:-2}); do for t in $1; do d=$here; [ $t != new ] && d=/tmp/$t
    (cd $d && timeout ${ENGINE_S:-150} python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 \
      --streams ${STREAMS:-64,256} --prompt 234 --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072" \
      --json $OUT/ab_${t}_$r.json > $OUT/ab_${t}_$r.txt 2>&1)
    echo "$t run $r rc $? at $(( $(date +%s) - T0 )) s"; grep "^| [0-9]" $OUT/ab_${t}_$r.txt | head -4
  done; done
}
