"""The models-on-demand decisions (imp.core.residency) and the catalogue's names (imp.engine.catalog)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from imp.core.residency import Budget, Footprint, Plan, Resident, idle_victims, plan_load
from imp.engine.catalog import WILDCARD, Catalog, CatalogError, Entry, scan
from imp.server import model_header

MB = 2**20


def R(name, mb, used, busy=False, idle=0.0):
    return Resident(name, Footprint(0, mb * MB), used, busy, idle)


def test_a_model_that_fits_evicts_nothing():
    res = [R("a", 100, 1), R("b", 100, 2)]
    assert plan_load("c", Footprint(0, 100 * MB), res, Budget(0, 300 * MB)) == Plan(True, ())
    assert plan_load("c", Footprint(0, 10**6 * MB), res, Budget()) == Plan(True, ())  # 0: no limit


def test_least_recently_used_idle_model_goes_first_and_busy_ones_last():
    res = [R("a", 100, 1, busy=True), R("b", 100, 2), R("c", 100, 3)]
    assert plan_load("d", Footprint(0, 100 * MB), res, Budget(0, 300 * MB)).evict == ("b",)
    assert plan_load("d", Footprint(0, 200 * MB), res, Budget(0, 300 * MB)).evict == ("b", "c")
    # the idle ones do not free enough: the busy one is drained too
    assert plan_load("d", Footprint(0, 300 * MB), res, Budget(0, 300 * MB)).evict == ("b", "c", "a")


def test_a_model_larger_than_the_budget_alone_is_refused():
    p = plan_load("big", Footprint(0, 400 * MB), [R("a", 10, 1)], Budget(0, 300 * MB))
    assert not p.fits and "big" in p.why and "--models-memory" in p.why and p.evict == ()


def test_device_and_host_budgets_each_count():
    res = [Resident("a", Footprint(100 * MB, 10 * MB), 1), Resident("b", Footprint(10 * MB, 100 * MB), 2)]
    assert plan_load("c", Footprint(100 * MB, 0), res, Budget(200 * MB, 0)).evict == ("a",)
    assert plan_load("c", Footprint(0, 100 * MB), res, Budget(0, 200 * MB)).evict == ("a",)  # a is older
    assert plan_load("c", Footprint(0, 100 * MB), res, Budget(1000 * MB, 150 * MB)).evict == ("a", "b")


@given(st.lists(st.tuples(st.integers(1, 500), st.booleans()), max_size=8), st.integers(1, 500),
       st.integers(1, 1500))
def test_the_plan_always_ends_within_the_budget(sizes, need, budget):
    res = [R(f"m{i}", mb, i, busy) for i, (mb, busy) in enumerate(sizes)]
    p = plan_load("new", Footprint(0, need * MB), res, Budget(0, budget * MB))
    if need > budget:
        assert not p.fits
        return
    kept = sum(r.footprint.host for r in res if r.name not in p.evict)
    assert p.fits and kept + need * MB <= budget * MB
    assert len(set(p.evict)) == len(p.evict)
    # nothing evicted that was not needed: without the last victim it would not fit
    if p.evict:
        last = next(r for r in res if r.name == p.evict[-1])
        assert kept + last.footprint.host + need * MB > budget * MB


def test_idle_victims_are_idle_past_their_own_time():
    res = [R("a", 1, 0.0, idle=10), R("b", 1, 5.0, idle=10), R("c", 1, 0.0, busy=True, idle=1), R("d", 1, 0.0)]
    assert idle_victims(12.0, res) == ("a",)
    assert idle_victims(15.0, res) == ("a", "b")


def _entry(name, aliases=()):
    return Entry(name, f"/m/{name}.gguf", 1, tuple(aliases))


def test_names_aliases_paths_and_the_wildcard():
    c = Catalog((_entry("smol", ["gpt-4o-mini"]), _entry("gemma")))
    assert c.resolve("smol").name == c.resolve("gpt-4o-mini").name == c.resolve("/x/smol.gguf").name == "smol"
    assert c.resolve("gemma.gguf").name == "gemma" and c.resolve("nope") is None
    w = Catalog((_entry("smol"), _entry("gemma", [WILDCARD])))
    assert w.resolve("claude-sonnet-4-5").name == "gemma" and w.resolve("smol").name == "smol"


def _gguf(path, arch="llama", **kw):
    from tests.fixtures.synth import write_synthetic_gguf

    return write_synthetic_gguf(str(path), arch=arch, **kw)


def test_scan_reads_the_directory_and_the_models_file(tmp_path):
    d = tmp_path / "models"
    (d / "sub").mkdir(parents=True)
    _gguf(d / "a.gguf", context_length=1024)
    _gguf(d / "sub" / "b.gguf", arch="qwen3", head_dim=32)
    (d / "broken.gguf").write_bytes(b"GGUF")  # listed; loading it answers why
    outside = _gguf(tmp_path / "c.gguf")
    f = tmp_path / "models.toml"
    f.write_text(f'[a]\naliases = ["fast", "*"]\nidle_unload_seconds = 5\n\n[see]\npath = "{outside}"\n')
    c = scan(str(d), str(f), model_header)
    by = {e.name: e for e in c.entries}
    assert set(by) == {"a", "b", "broken", "see"}
    assert by["a"].context_length == 1024 and by["a"].kv_bytes_per_token == 2 * 2 * 2 * 2 * 16
    assert by["a"].idle_unload_s == 5 and by["b"].idle_unload_s is None and by["broken"].context_length == 0
    assert c.resolve("fast").name == "a" and c.resolve("anything").name == "a" and c.resolve("see").name == "see"
    j = tmp_path / "models.json"
    j.write_text(json.dumps({"models": {"b": {"aliases": ["bee"]}}}))
    assert scan(str(d), str(j), model_header).resolve("bee").name == "b"


@pytest.mark.parametrize("text, says", [
    ("[nope]\n", "is not a model of --models-dir"),
    ("[a]\naliases = \"x\"\n", "aliases must be a list"),
    ("[a]\ncolour = 1\n", "unknown keys"),
    ("[a.gguf]\naliases = []\n", r'quoted in TOML: \["a.gguf"\]'),
    ("[a]\nidle_unload_seconds = -1\n", "idle_unload_seconds"),
    ("[a]\npath = \"/does/not/exist.gguf\"\n", "does not exist"),
    ("[a\n", "not valid TOML"),
    ("[a]\naliases = [\"b\"]\n", "taken by both"),
])
def test_a_bad_models_file_is_named_at_boot(tmp_path, text, says):
    _gguf(tmp_path / "a.gguf")
    _gguf(tmp_path / "b.gguf")
    f = tmp_path / "models.toml"
    f.write_text(text)
    with pytest.raises(CatalogError, match=says):
        scan(str(tmp_path), str(f))
