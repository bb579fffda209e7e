#!/usr/bin/env bash
# On the GPU machine: the tool-calling / structured-output acceptance table
# (bench/tools_acceptance.py, through the official SDKs and HTTP) against the GPU executor,
# then the GPU server tests on the same tree. Usage, from the repo root:
#
#     MODEL=/path/SmolLM2-135M-Instruct.Q4_1.gguf N=20 bash bench/gpu_acceptance.sh [OUTDIR]
set -uo pipefail
MODEL=${MODEL:?a GGUF path}
N=${N:-20}
OUT=${1:-${OUT:-/tmp}}
PY=${PY:-python3}
PORT=${PORT:-8080}
$PY -m imp --model "$MODEL" --device cuda:0 --port "$PORT" --kv-cache-tokens 65536 ${SERVER_ARGS:-} >"$OUT/server.log" 2>&1 &
SRV=$!
$PY - "$PORT" <<'PYEOF'
import sys, time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2); break
    except Exception:
        time.sleep(0.5)
PYEOF
timeout "${ACC_TIMEOUT:-330}" $PY bench/tools_acceptance.py --url "http://127.0.0.1:$PORT" --n "$N" | tee "$OUT/acceptance.md"
kill $SRV; wait $SRV 2>/dev/null
[ -n "${SKIP_TESTS:-}" ] || IMP_TEST_MODEL="$MODEL" timeout "${TEST_TIMEOUT:-220}" $PY -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_gpu_server.py tests/test_gpu_token_mask.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
