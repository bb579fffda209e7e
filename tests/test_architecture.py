"""The layering rules of docs/ARCHITECTURE.md, enforced.

Every `import` / `from ... import` in imp/ — at module level or inside a
function (a lazy import hides a cycle, it does not remove it) — is checked
against the folder table: a folder may import only the folders its rule
names. And the import graph between imp's modules has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "imp"

# folder (or top-level module) -> what it may import besides itself. The order of the
# table is the layering, bottom first; docs/ARCHITECTURE.md has the same table.
RULES: dict[str, set[str]] = {
    "imp.messages": set(),
    "imp.config": set(),
    "imp.kernels": set(),
    "imp.kernels.cpu": set(),  # the two targets import nothing of each other (nor of imp)
    "imp.kernels.cuda": set(),
    "imp.formats": set(),
    "imp.fetch": set(),
    "imp.settle": set(),  # boot's last step: what a process gives back before serving
    "imp.precompile": {"imp.bootstatus"},  # a cold Numba cache compiled in a child (its steps are passed in)
    "imp.bootstatus": set(),  # the port's 503 'compiling' with progress while that child runs
    "imp.text": {"imp.formats"},
    "imp.log": {"imp.messages"},
    "imp.core": {"imp.messages", "imp.log"},
    "imp.sampling": {"imp.messages", "imp.kernels"},
    "imp.constrain": {"imp.messages", "imp.kernels"},
    "imp.tools": {"imp.constrain"},
    "imp.model": {"imp.messages", "imp.formats", "imp.kernels", "imp.sampling", "imp.constrain"},
    "imp.gpu": {"imp.messages", "imp.formats", "imp.kernels", "imp.sampling", "imp.model", "imp.constrain"},
    "imp.actors": {"imp.messages", "imp.core", "imp.log", "imp.text", "imp.sampling", "imp.constrain"},
    "imp.store": {"imp.messages", "imp.actors"},
    "imp.engine": {"imp.messages", "imp.config", "imp.core", "imp.log", "imp.actors", "imp.store",
                   "imp.sampling", "imp.constrain", "imp.text"},
    # HTTP sees the engine only through its port (imp.engine.port), never the actors or the model.
    # Inside it, bottom first: the request pipeline every dialect shares; the dialects (parse and
    # render only); the other endpoints; the shell (app, routes, access) over all of them.
    "imp.http": {"imp.messages", "imp.config", "imp.text", "imp.engine.port", "imp.tools", "imp.constrain"},
    "imp.http.pipeline": {"imp.messages", "imp.config", "imp.text", "imp.engine.port", "imp.tools",
                          "imp.constrain", "imp.http.errors", "imp.http.keys"},
    "imp.http.dialects": {"imp.messages", "imp.text", "imp.engine.port", "imp.tools", "imp.constrain",
                          "imp.http.errors", "imp.http.keys", "imp.http.pipeline"},
    "imp.http.endpoints": {"imp.messages", "imp.config", "imp.text", "imp.engine.port", "imp.tools",
                           "imp.constrain", "imp.http.errors", "imp.http.keys", "imp.http.pipeline",
                           "imp.http.dialects"},
    # boot: builds everything
    "imp.server": {"*"},
    "imp.procs": {"*"},
    "imp.__main__": {"*"},
}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, lazy ones included."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from imp.http import anthropic` imports a module: keep the name, resolved later
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return [(ln, m) for ln, m in out if m == "imp" or m.startswith("imp.")]


def _owner(mod: str) -> str | None:
    """The RULES entry a module belongs to (longest prefix)."""
    best = None
    for key in RULES:
        if (mod == key or mod.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    return best


def _allowed(src_owner: str, target: str) -> bool:
    allowed = RULES[src_owner]
    if "*" in allowed:
        return True
    if target == src_owner or target.startswith(src_owner + "."):
        return True
    return any(target == a or target.startswith(a + ".") for a in allowed)


def _files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_has_a_rule():
    missing = [_module(p) for p in _files() if _module(p) != "imp" and _owner(_module(p)) is None]
    assert not missing, f"modules outside every folder rule (add them to RULES and ARCHITECTURE.md): {missing}"


def test_imports_follow_the_folder_rules():
    bad = []
    for p in _files():
        src = _module(p)
        owner = _owner(src)
        if owner is None:
            continue
        for line, target in _imports(p):
            if not _allowed(owner, target):
                bad.append(f"{p.relative_to(ROOT)}:{line}: {src} imports {target} ({owner} may import "
                           f"{sorted(RULES[owner]) or 'nothing of imp'})")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def _resolve(target: str, modules: set[str]) -> str | None:
    """The imp module a dotted import names (a name imported from a module resolves to it)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def test_no_import_cycles():
    files = _files()
    modules = {_module(p) for p in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for p in files:
        src = _module(p)
        for _, target in _imports(p):
            t = _resolve(target, modules)
            if t and t != src and t != "imp":
                graph[src].add(t)
    # Tarjan's strongly connected components: any component of 2+ modules is a cycle
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not comps, f"import cycles: {comps}"


def test_a_dialect_is_its_own_room():
    """A dialect imports the pipeline and the OpenAI family's shared pieces, never another dialect:
    adding one is a parser, a renderer and a line in the routes table."""
    bad = []
    for p in sorted((PKG / "http" / "dialects").rglob("*.py")):
        src = _module(p)
        parts = src.split(".")
        if len(parts) < 4:  # imp.http.dialects itself
            continue
        own = ".".join(parts[:4])
        for line, target in _imports(p):
            if target.startswith("imp.http.dialects.") and not (
                    target.startswith(own + ".") or target == own or target.startswith("imp.http.dialects.openai")):
                bad.append(f"{p.relative_to(ROOT)}:{line}: {src} imports {target}")
    assert not bad, "a dialect reaches into another:\n" + "\n".join(bad)


def test_rules_table_matches_the_architecture_doc():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for key in RULES:
        folder = key.replace(".", "/")
        assert f"`{folder}" in doc, f"docs/ARCHITECTURE.md has no row for {folder}"


def test_every_message_of_the_catalogue_is_in_the_logged_union():
    """imp/messages is a package of conversations; the event log decodes ONE tagged union
    (imp.messages.Message): a message class defined in a module but left out of it would not
    decode from a log."""
    import typing

    import imp.messages as m

    defined = {c for c in m.Msg.__subclasses__() if c.__module__.startswith("imp.messages")}
    union = set(typing.get_args(m.Message))
    assert defined == union, f"not in Message: {sorted(c.__name__ for c in defined - union)}"
    assert all(getattr(m, c.__name__) is c for c in defined)  # every one importable from imp.messages
