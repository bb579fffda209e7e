"""A GGUF whose tensors cannot be read as they say (rows that are not whole blocks, data past the end
of the file) is refused when its header is read, naming the tensor, instead of reaching the kernels
(which read such rows out of bounds: a 64-wide Q4_K model crashed the CPU forward with a heap error)."""

from __future__ import annotations

import os

import pytest
from gguf import GGMLQuantizationType as T

from imp.formats.gguf_file import read_header
from tests.fixtures.synth_raw import write_raw_gguf


def test_rows_that_are_not_whole_blocks_are_refused(tmp_path):
    path = write_raw_gguf(tmp_path / "bad.gguf", d_model=64, qtype=T.Q4_K)  # Q4_K blocks hold 256 values
    with pytest.raises(ValueError, match=r"tensor token_embd\.weight: a row of 0 values is not whole Q4_K blocks"):
        read_header(path)


def test_a_truncated_file_is_refused(tmp_path):
    path = write_raw_gguf(tmp_path / "ok.gguf", d_model=64, d_ff=128, qtype=T.Q8_0)
    assert "output_norm.weight" in read_header(path).tensors
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_header(path)


def test_a_short_or_garbled_header_is_a_model_file_error(tmp_path):
    from imp.formats.gguf_file import ModelFileError

    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF\x03\x00")  # cut inside the counts
    with pytest.raises(ModelFileError, match="not a readable GGUF header"):
        read_header(short)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFileError):
        read_header(empty)


@pytest.mark.parametrize("what", ["missing", "junk"])
def test_the_server_refuses_a_bad_model_in_one_line(tmp_path, what):
    """`python -m imp --model X` with a path that is not a model: exit 2 and one 'cannot start' line, no
    traceback, no process left (both layouts share the check: imp.server.serve, imp.procs.engine_main)."""
    import subprocess
    import sys

    from tests.serverproc import ROOT, free_port

    path = tmp_path / "m.gguf"
    if what == "junk":
        path.write_bytes(os.urandom(4096))
    r = subprocess.run([sys.executable, "-m", "imp", "--model", str(path), "--port", str(free_port()),
                        "--responses-store", "off"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "cannot start:" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
