#!/usr/bin/env bash
# Both x86 tiers of both servers in one run (issue 32's table): for each tier (native, then AVX2:
# NUMBA_CPU_NAME=haswell with its own features) and each model, bench/cpu_serving.py with cached and
# with cold prompts against llama-server, and bench/cpu_prefill.py against llama-bench, each built by
# bench/llama_cpp.sh for that tier. Prints the tree, the date and the CPU's flags first.
#
#     LLAMA_NATIVE_DIR=/tmp/llama-cpp-native LLAMA_AVX2_DIR=/tmp/llama-cpp-avx2 bash bench/cpu_tiers.sh > out.txt
set -u
cd "$(dirname "$0")/.."
N=${LLAMA_NATIVE_DIR:-/tmp/llama-cpp-native}/build/bin
A=${LLAMA_AVX2_DIR:-/tmp/llama-cpp-avx2}/build/bin
MODELS=${MODELS:-"gemma-3-270m smollm2-135m"}
git log --oneline | head -1; date
grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -x -E 'avx2|avx512f|avx512vl|avx512_vnni|avx512_bf16|avx512vbmi|amx_int8|f16c|fma' | sort -u | tr '\n' ' '
echo
for tier in native avx2; do
  if [ $tier = avx2 ]; then export NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=""; L=$A; else unset NUMBA_CPU_NAME NUMBA_CPU_FEATURES; L=$N; fi
  for m in $MODELS; do
    echo "=== $tier $m cached"; .venv/bin/python bench/cpu_serving.py --model "$m" --llama-server "$L/llama-server" 2>&1 | tail -15
    echo "=== $tier $m cold"; .venv/bin/python bench/cpu_serving.py --model "$m" --cold --llama-server "$L/llama-server" 2>&1 | tail -15
    echo "=== $tier $m prefill"; .venv/bin/python bench/cpu_prefill.py --model "$m" --llama-bench "$L/llama-bench" 2>&1 | tail -8
  done
done
date
