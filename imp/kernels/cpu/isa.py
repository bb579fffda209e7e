"""What the CPU Numba compiles for can do: the int8 dot the quantized loops use and how many
float lanes a vector register holds. Decided once, here, from Numba's target (the host unless
NUMBA_CPU_NAME says otherwise; with a name, NUMBA_CPU_FEATURES as Numba reads it: absent = the
host's features, "" = the named CPU's own), so the AVX2 tier can be compiled and tested on any
x86 box (issue 32).

    DOT   "vnni"    AVX-512 VNNI (+VL) or AVX-VNNI: one vpdpbusd, 4 products a lane
          "avx2"    vpmaddubsw + vpmaddwd(1): the same 4-product lanes (exact int32)
          "generic" sign extensions and pair products (NEON too)
    ZMM   True where the code may use AVX-512's 32 x 16-lane registers; False on AVX2 (16 x 8
          lanes: a 16-lane value takes two registers, so loops that keep 16 such values live
          spill there and pick a narrower schedule of the same operations)
"""

from __future__ import annotations

# CPUs Numba may be told to compile for with NUMBA_CPU_FEATURES="" (the name's own features).
# Unlisted names: the generic loop, no AVX-512.
_AVX2_CPUS = frozenset(("haswell", "broadwell", "skylake", "skylake-avx512", "cannonlake", "znver1", "znver2",
                        "znver3", "x86-64-v3", "x86-64-v4"))
_VNNI_CPUS = frozenset(("cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
                        "alderlake", "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5"))
_AVX512_CPUS = (_VNNI_CPUS - {"alderlake"}) | {"skylake-avx512", "cannonlake", "x86-64-v4"}


def _features() -> tuple[str | None, set[str] | None]:
    """(the named CPU or None, the feature set, or None for 'the named CPU's own')."""
    import llvmlite.binding as ll
    import numba

    name, feats = numba.config.CPU_NAME, numba.config.CPU_FEATURES
    if feats is None:  # Numba passes the host's features
        f = ll.get_host_cpu_features()
        return name, {k for k in f if f[k]}
    if feats.strip():
        return name, {x[1:] for x in feats.split(",") if x.startswith("+")}
    return name, None


def _dot(name, have) -> str:
    if have is None:
        return "vnni" if name in _VNNI_CPUS else "avx2" if name in _AVX2_CPUS else "generic"
    if "avxvnni" in have or {"avx512vnni", "avx512vl"} <= have:
        return "vnni"
    return "avx2" if "avx2" in have else "generic"


def _zmm(name, have) -> bool:
    return name in _AVX512_CPUS if have is None else "avx512f" in have


_NAME, _HAVE = _features()
DOT = _dot(_NAME, _HAVE)
ZMM = _zmm(_NAME, _HAVE)
