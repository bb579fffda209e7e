#!/usr/bin/env bash
# Issue 35, twenty-ninth session: the restart TTFT on the GPU. One device call, sections by $WHAT:
#   kernel   the paged prefill kernel's tests (segments in turn = side by side, bit for bit; the 20k-context timing)
#            and the mixed graphs' routing, GPU lane
#   lane     the GPU lane's runner and server files (greedy equalities, replays) at this tree
#   null     bench/prompt_cache.py --null-kv-bytes 2097152 on a tiny model: the restart's host side alone on this
#            machine's cores (no model math; the 8B shape's block size)
#   restart  bench/prompt_cache.py on the 8B BF16 shape, 32k context, a 20k-token prompt: this tree, then the tree
#            before the session (bench/pending/split_prefill_old.patch reversed into /tmp/old), page cache warm
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WHAT=${WHAT:-"kernel null restart"}
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 --version; nproc
[ -d /tmp/site ] || python3 bench/device_site.py
export PYTHONPATH=/tmp/site
for w in $WHAT; do echo "=== $w at $(( $(date +%s) - T0 )) s"; case $w in
kernel)
  [ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${TEST_S:-240} python3 -m pytest -q -s -p no:cacheprovider -m gpu -o faulthandler_timeout=120 \
    ${TESTS:-tests/test_gpu_paged_prefill.py tests/test_gpu_mixed.py tests/test_gpu_kvcopy.py} 2>&1 | grep -v "^\s*$" | tail -25 ;;
lane)
  [ -f /tmp/smol.gguf ] || python3 bench/write_synth.py 135m-q4_1 /tmp/smol.gguf 2>&1 | tail -1
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${LANE_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -o faulthandler_timeout=150 \
    tests/test_gpu_runner.py 2>&1 | tail -2
  IMP_TEST_MODEL=/tmp/smol.gguf timeout ${LANE_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu -o faulthandler_timeout=150 \
    tests/test_gpu_server.py -k "concurrent or replays" 2>&1 | tail -2 ;;
null)
  python3 -c "
import sys; sys.path.insert(0, '.')
from tests.fixtures.synth_raw import write_raw_gguf
from gguf import GGMLQuantizationType as T
write_raw_gguf('/tmp/tiny32k.gguf', n_layers=2, d_model=256, n_heads=2, n_kv_heads=2, d_ff=256, vocab=32000, qtype=T.Q8_0, context_length=32768)"
  timeout 200 python3 bench/prompt_cache.py --model /tmp/tiny32k.gguf --prompt-tokens 20000 --null-kv-bytes 2097152 \
    --ctx 32768 2>&1 | grep "^|\|server\|tier:" | head -20 ;;
restart)
  [ -f /tmp/8b32k.gguf ] || python3 bench/write_synth.py 8b-bf16 /tmp/8b32k.gguf 32768 2>&1 | tail -1
  echo "8b ready at $(( $(date +%s) - T0 )) s"
  if [ ! -d /tmp/old ]; then
    mkdir -p /tmp/old && cp -r imp bench tests pyproject.toml /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < bench/pending/${OLD_PATCH:-split_prefill_old.patch} && echo "old tree made")
  fi
  n=0
  for tree in ${TREES:-new old}; do
    n=$((n + 1)); d=$PWD; [ $tree = old ] && d=/tmp/old
    x=${EXTRA:-}; [ $n = 1 ] && x="${EXTRA1:-$x}"
    (cd $d && timeout ${RESTART_S:-300} python3 bench/prompt_cache.py --model /tmp/8b32k.gguf --device cuda:0 --ctx 32768 \
      --prompt-tokens ${PROMPT_TOKENS:-20000} --max-tokens 16 $x > $OUT/restart-$n-$tree.txt 2>&1)
    echo "--- $tree rc $? at $(( $(date +%s) - T0 )) s"; grep "^|\|server\|tier:\|Error\|error\|dropped" $OUT/restart-$n-$tree.txt | head -24
  done ;;
esac; done
echo "[total $(( $(date +%s) - T0 )) s]"
