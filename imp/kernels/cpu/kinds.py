"""The GGML types a model's matrices use, carried in a Numba type: the kernels compile only those.

Why: each row kernel dispatches on the matrix's type at run time, over 8 types x 8 tile shapes
(64 LLVM loops), and Numba links a callee's code into every caller's module and optimizes it
again there. A cold boot compiled all 64 loops several times over: ~57 s for SmolLM2 on 2
cores, whose matrices use two of the types. A `Kinds` value passed down the calls puts its set
in every kernel's signature (the disk cache keeps one entry per set: a second model with other
types compiles its own, the first's stay), and `picker` compiles only the set's branches.

    kinds = Kinds({Q4_1, Q8_0})            # Python side, once per model
    row_dot16(w, kinds, qtype, ...)        # jitted side: kinds is a zero-size argument

A type outside the set gives NaN outputs (never a silent number): the callers build the set
from the very matrices they pass.
"""

from __future__ import annotations

import numpy as np
from numba.core import types
from numba.extending import NativeValue, models, overload, register_model, typeof_impl, unbox


class Kinds:
    """A set of GGML type ids (each < 64), hashable, as a Numba-typed value."""

    __slots__ = ("mask",)

    def __init__(self, qtypes):
        self.mask = 0
        for q in qtypes:
            self.mask |= 1 << int(q)

    def __contains__(self, q) -> bool:
        return bool(self.mask >> int(q) & 1)

    def __repr__(self) -> str:
        return f"Kinds({sorted(q for q in range(64) if q in self)})"


class KindsType(types.Type):
    def __init__(self, mask: int):
        self.mask = mask
        super().__init__(name=f"Kinds({mask:#x})")


@typeof_impl.register(Kinds)
def _typeof(val, c):
    return KindsType(val.mask)


register_model(KindsType)(models.OpaqueModel)


@unbox(KindsType)
def _unbox(typ, obj, c):
    return NativeValue(c.context.get_constant_null(typ))


def picker(name: str, fns: dict[int, object], args: tuple[str, ...], units: str, per_super: dict[int, int],
           width: int):
    """A function `name(kinds, qtype, *args)` for jitted code: fns[qtype](*args) for the types in
    kinds, only those compiled. units: the argument counting 32-blocks, which a K-quant's loop
    takes in super-blocks (divided by per_super[qtype]). width: the outputs a call returns (a
    type outside kinds returns that many NaNs; 0: the functions return nothing)."""
    sig = ", ".join(args)
    ns: dict = {}
    exec(f"def {name}(kinds, qtype, {sig}):\n    raise NotImplementedError('called from jitted code only')\n", ns)
    stub = ns[name]

    def build(kinds):
        if not isinstance(kinds, KindsType):
            return None
        g: dict = {"nan": np.float32(np.nan)}
        lines = [f"def impl(kinds, qtype, {sig}):"]
        for qt in sorted(fns):
            if kinds.mask >> qt & 1:
                call = ", ".join(f"{a} // {per_super[qt]}" if a == units and qt in per_super else a for a in args)
                lines.append(f"    if qtype == {qt}:\n        return f{qt}({call})")
                g[f"f{qt}"] = fns[qt]
        lines.append("    return (" + "nan, " * width + ")" if width else "    return None")
        exec("\n".join(lines), g)
        return g["impl"]

    ov: dict = {"build": build}
    exec(f"def ov(kinds, qtype, {sig}):\n    return build(kinds)\n", ov)
    overload(stub, inline="always")(ov["ov"])  # inlined into the caller, as the dispatch it replaced
    return stub
