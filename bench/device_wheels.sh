#!/usr/bin/env bash
# Wheels for the GPU machine (no network there): the packages imp and its GPU lane need that a
# bare torch image may lack, at the versions this venv holds, for CPython 3.12 / x86-64, into
# .whl/ (ignored by git; name it in the device call's `carry`). On the device,
# `python3 bench/device_site.py` installs the ones it lacks into /tmp/site.
#
#     bash bench/device_wheels.sh            # here, once per session
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PKGS=${PKGS:-"msgspec aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl gguf
  hypothesis sortedcontainers llguidance uvloop prometheus_client pyzmq sqlite-utils click-default-group
  sqlite-fts4 tabulate opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
  opentelemetry-exporter-otlp-proto-common opentelemetry-proto opentelemetry-semantic-conventions
  opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common googleapis-common-protos
  protobuf pytest pytest-asyncio pluggy iniconfig openai anthropic jiter docstring_parser httpx2 httpcore2
  h11 anyio sniffio distro truststore pydantic pydantic_core typing-inspection annotated-types
  jsonschema jsonschema-specifications referencing rpds-py attrs idna lark"}
mkdir -p .whl
for p in $PKGS; do
  v=$($PIP show "$p" 2>/dev/null | awk "/^Version:/{print \$2}" || true)
  [ -n "$v" ] || { echo "skip $p (not in this venv)"; continue; }
  ls .whl | grep -qi "^$(echo "$p" | tr '-' '_')-$v-" && continue
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 -d .whl "$p==$v" || echo "FAILED $p==$v"
done
du -sh .whl
