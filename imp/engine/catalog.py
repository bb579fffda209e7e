"""The models a server can serve by name: --models-dir, read once at boot, plus an optional models file.

A name is a GGUF's file stem (one level down too) or an HF directory's basename (config.json and
*.safetensors); the models file adds aliases and per-model settings. Ollama, LM Studio and
llama-swap users name a model and get it: this is where the name is decided, in one place.

The models file (--models-file, TOML or JSON) maps a model's name to its settings:

    [SmolLM2-135M-Instruct.Q4_1]
    aliases = ["smol", "gpt-4o-mini"]
    idle_unload_seconds = 300        # this model's idle unload (else --idle-unload-seconds)

    [gemma]
    path = "/models/gemma-3-270m-q4_k_m.gguf"   # a model outside the directory
    aliases = ["*"]                  # any name nothing else matches (Claude Code's own model names)

`scan` does the I/O (a directory listing, a header read per model for its context and KV figures);
`Catalog` is a plain value that resolves names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

WILDCARD = "*"


class CatalogError(ValueError):
    """A models file that cannot be used: named at boot, never a 500 per request."""


@dataclass(frozen=True)
class Entry:
    """One servable model."""

    name: str
    path: str
    size_bytes: int  # the weights on disk (GGUF file, or the safetensors of an HF directory)
    aliases: tuple[str, ...] = ()
    idle_unload_s: float | None = None  # None: the server's --idle-unload-seconds
    context_length: int = 0  # from the header (0: unreadable; the load says why)
    kv_bytes_per_token: int = 0  # K and V, every layer, at 2 bytes an element (the estimate's unit)
    created: int = 0  # the file's mtime


@dataclass(frozen=True)
class Catalog:
    entries: tuple[Entry, ...] = ()
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        idx: dict[str, Entry] = {}
        for e in self.entries:
            for n in (e.name, *e.aliases):
                idx.setdefault(n, e)
        object.__setattr__(self, "_index", idx)

    def resolve(self, name: str) -> Entry | None:
        """The entry a request's `model` names: its name, an alias, a path a listing showed, else the
        wildcard alias if one model has it; None when nothing matches."""
        e = self._index.get(name)
        if e is None and name:
            stem = Path(name).name
            e = self._index.get(stem[:-5] if stem.endswith(".gguf") else stem)
        return e or self._index.get(WILDCARD)

    def named(self, name: str) -> Entry | None:
        """The entry whose own name (not an alias) is name."""
        return next((e for e in self.entries if e.name == name), None)

    def with_entry(self, entry: Entry) -> "Catalog":
        """This catalog with entry first (the boot model, if the directory did not hold it)."""
        if any(e.name == entry.name for e in self.entries):
            return self
        return Catalog((entry, *self.entries))


# (model path) -> (context length, KV bytes per token at 2-byte elements), (0, 0) if unreadable: the file
# formats' reader, injected by the boot (imp.server.model_header; this layer reads no model formats)
Header = Callable[[Path], tuple[int, int]]


def _no_header(path: Path) -> tuple[int, int]:
    return 0, 0


def entry_for(path: Path, name: str | None = None, aliases: tuple[str, ...] = (),
              idle_unload_s: float | None = None, header: Header = _no_header) -> Entry:
    """An Entry for the model at path (its header read now)."""
    st = path.stat()
    size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else st.st_size
    ctx, kvb = header(path)
    return Entry(name or (path.name if path.is_dir() else path.stem), str(path.resolve()), size, tuple(aliases),
                 idle_unload_s, ctx, kvb, int(st.st_mtime))


def _listing(models_dir: str | None) -> list[Path]:
    if not models_dir or not Path(models_dir).is_dir():
        return []
    d = Path(models_dir)
    hf = [c.parent for c in sorted(d.glob("*/config.json")) if any(c.parent.glob("*.safetensors"))]
    return sorted(d.glob("*.gguf")) + sorted(d.glob("*/*.gguf")) + hf


def read_models_file(path: str) -> dict[str, dict]:
    """The models file's table: name -> {path?, aliases?, idle_unload_seconds?}; CatalogError if malformed."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise CatalogError(f"--models-file {path}: {exc.strerror or exc}") from None
    try:
        if p.suffix == ".json":
            doc = json.loads(raw)
        else:
            import tomllib

            doc = tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CatalogError(f"--models-file {path}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from None
    doc = doc.get("models", doc) if isinstance(doc, dict) else doc
    if not isinstance(doc, dict):
        raise CatalogError(f"--models-file {path}: expected a table of models by name")
    for name, v in doc.items():
        if not isinstance(v, dict):
            raise CatalogError(f"--models-file {path}: [{name}] must be a table")
        unknown = set(v) - {"path", "aliases", "idle_unload_seconds"}
        if unknown:
            dotted = [k for k in unknown if isinstance(v[k], dict)]
            hint = (f"; a name with a dot is quoted in TOML: [\"{name}.{dotted[0]}\"]" if dotted else "")
            raise CatalogError(f"--models-file {path}: [{name}] has unknown keys {sorted(unknown)} "
                               f"(path, aliases, idle_unload_seconds){hint}")
        al = v.get("aliases", [])
        if not isinstance(al, list) or not all(isinstance(a, str) and a for a in al):
            raise CatalogError(f"--models-file {path}: [{name}] aliases must be a list of names")
        idle = v.get("idle_unload_seconds")
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle < 0):
            raise CatalogError(f"--models-file {path}: [{name}] idle_unload_seconds must be a number >= 0")
        if "path" in v and not (isinstance(v["path"], str) and Path(v["path"]).exists()):
            raise CatalogError(f"--models-file {path}: [{name}] path {v['path']!r} does not exist")
    return doc


def scan(models_dir: str | None, models_file: str | None = None, header: Header = _no_header) -> Catalog:
    """Every model of the directory and the file (the file's settings on the directory's models of its
    names; its paths added); CatalogError for a file that names a model nowhere to be found, or an alias twice."""
    table = read_models_file(models_file) if models_file else {}
    found = {(p.name if p.is_dir() else p.stem): p for p in _listing(models_dir)}
    entries, seen = [], {}
    for name, p in found.items():
        if name not in table:
            entries.append(entry_for(p, header=header))
    for name, v in table.items():
        p = Path(v["path"]) if "path" in v else found.get(name)
        if p is None:
            raise CatalogError(f"--models-file {models_file}: [{name}] is not a model of --models-dir and has no path")
        entries.append(entry_for(p, name, tuple(v.get("aliases", ())), v.get("idle_unload_seconds"), header))
    for e in entries:
        for n in (e.name, *e.aliases):
            if n in seen and seen[n] != e.name:
                raise CatalogError(f"the name {n!r} is taken by both {seen[n]!r} and {e.name!r}")
            seen[n] = e.name
    return Catalog(tuple(entries))
