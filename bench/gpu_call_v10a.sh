#!/usr/bin/env bash
# Issue 33 baseline, one device call (bench/gpu_notes.md "v9 plan"): the offline engine on the serving
# workload and the same through HTTP, SmolLM2's shape (random weights), streams 1-256.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 --version
python3 bench/device_site.py && export PYTHONPATH=/tmp/site
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -2
export TMPDIR=/tmp/engb; mkdir -p $TMPDIR
timeout 480 python3 bench/engine.py --model /tmp/smol.gguf --device cuda:0 --streams ${STREAMS:-1,16,64,256} \
  --prompt 234 --answer 128 --rounds 2 --server-args "--kv-cache-tokens 131072" --http --client-procs 4 \
  --json $OUT/engine_smol.json > $OUT/engine_smol.txt 2>&1
echo "engine rc $?"
tail -60 $OUT/engine_smol.txt
for f in $TMPDIR/imp-engine-bench-*/*.log; do gzip -c "$f" > "$OUT/$(basename $f).gz"; done
ls -la $OUT
