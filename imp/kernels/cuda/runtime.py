"""Shared plumbing for the GPU kernels: lazy CuPy/Numba, compile cache, streams.

Every CuPy kernel here is compiled with NVRTC from source held in its own
file, once per (source, options) pair, and launched on *torch's current
stream* through `cupy.cuda.ExternalStream`, so that a launch inside
`torch.cuda.graph(...)` is captured into the graph like a torch op.

Arguments go to CuPy as numpy scalars: pointers as `np.uint64(t.data_ptr())`,
sizes as `np.int32`, so no CuPy array is ever created (no second allocator,
and a few microseconds less per launch).

No CUDA headers are included: bf16/f16 are handled as raw uint16 with the
conversions below (`PRELUDE`), so NVRTC needs no include path.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

PRELUDE = r"""
typedef unsigned short u16;
typedef unsigned char u8;
#define NEG_INF (__int_as_float(0xff800000))
__device__ __forceinline__ float bf2f(u16 v) { return __uint_as_float(((unsigned)v) << 16); }
__device__ __forceinline__ float h2f(u16 v) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f; }
__device__ __forceinline__ u16 f2bf(float f) {  // round to nearest even (no NaN payloads here)
    unsigned u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}
__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
"""


def cupy():
    import cupy as cp  # noqa: PLC0415 - optional dependency, GPU machines only

    return cp


def available() -> bool:
    """A CUDA device torch can use, and CuPy importable."""
    if not torch.cuda.is_available():
        return False
    try:
        cupy()
    except Exception:  # noqa: BLE001
        return False
    return True


@functools.lru_cache(maxsize=None)
def module(code: str, name_expressions: tuple[str, ...] = (), options: tuple[str, ...] = (), device: int = 0):
    """Compiled and loaded on `device` (a loaded module belongs to one device's context)."""
    cp = cupy()
    opts = ("-std=c++17",) + tuple(options)
    with cp.cuda.Device(device):
        mod = cp.RawModule(code=PRELUDE + code, options=opts, name_expressions=list(name_expressions) or None)
        mod.compile()
    return mod


def _current_device() -> int:
    """torch's current device, without torch.cuda.current_device()'s lazy-init and index checks (an eager
    step launches ~1,000 kernels: each µs here is a millisecond of the step's host time)."""
    try:
        return torch._C._cuda_getDevice()
    except AttributeError:  # a torch without the private binding
        return torch.cuda.current_device()


def _current_raw_stream(dev: int) -> int:
    """The cudaStream_t of torch's current stream on dev (what torch.cuda.current_stream().cuda_stream
    gives, without building a Stream object)."""
    try:
        return torch._C._cuda_getCurrentRawStream(dev)
    except AttributeError:
        return torch.cuda.current_stream(dev).cuda_stream


def function(code: str, name: str, name_expressions: tuple[str, ...] = (), options: tuple[str, ...] = ()):
    """The kernel for torch's current device (data parallel: one runner per device, each on its own thread)."""
    return _function(code, name, name_expressions, options, _current_device())


@functools.lru_cache(maxsize=None)
def _function(code: str, name: str, name_expressions: tuple[str, ...], options: tuple[str, ...], device: int):
    mod = module(code, name_expressions, options, device)
    with cupy().cuda.Device(device):
        return mod.get_function(name)


_streams: dict[tuple[int, int], object] = {}


def torch_stream():
    """CuPy view of torch's current stream (captured when torch captures)."""
    dev = _current_device()
    ptr = _current_raw_stream(dev)
    s = _streams.get((dev, ptr))  # by device too: every device's default stream is 0
    if s is None:
        try:
            s = cupy().cuda.ExternalStream(ptr, dev)
        except TypeError:  # older CuPy: no device_id argument
            s = cupy().cuda.ExternalStream(ptr)
        _streams[(dev, ptr)] = s
    return s


_direct: dict[int, object] = {}  # id(RawKernel) -> its cupy.cuda.Function (RawKernels live in _function's cache)


def launch(fn, grid, block, args, shared_mem: int = 0) -> None:
    """fn on torch's current stream. The RawKernel's underlying Function takes the stream as an
    argument: no CuPy stream context to enter and leave around every launch."""
    k = _direct.get(id(fn))
    if k is None:
        k = _direct[id(fn)] = getattr(fn, "kernel", False)
    if k:
        k(grid, block, args, shared_mem=shared_mem, stream=torch_stream())
        return
    with torch_stream():
        fn(grid, block, args, shared_mem=shared_mem)


def use_device(index: int) -> None:
    """Make `index` this thread's device for torch and CuPy alike, once, outside any
    capture (switching devices around each launch breaks CUDA graph capture)."""
    torch.cuda.set_device(index)
    try:
        cupy().cuda.runtime.setDevice(index)
    except ImportError:  # CuPy-less checks (torch fallbacks) still work
        pass


STAGE_SEG = 16 << 10  # bytes: a staging segment
STAGE_SEGS = 256  # segments a device (4 MiB pinned); a copy of more than an eighth of them is pinned on its own


class _Staging:
    """Pinned host memory that `to_device`'s small copies take in turn, a segment or a few at a time.

    Why: `t.pin_memory()` a call (a block of the caching host allocator, its bookkeeping and events) and the copy's
    own allocation cost ~0.5 ms of host time a call on an H100 host (cProfile at 256 streams: 1,471 calls, 0.78 s,
    bench/results/2026-12-07-gpu-rows-*-35th.txt), at 4-5 calls a step up to 2 ms of a 5.8 ms decode step. Here a
    call is a memcpy into the next segment and one async copy up. A segment is reused once the copy that last read
    it has run: an event a call, recorded after its copy, waited on before the segment is written again (a ring of
    256 segments later it has long run)."""

    def __init__(self):
        self.buf = torch.empty(STAGE_SEG * STAGE_SEGS, dtype=torch.uint8).pin_memory()
        self.events: list = [None] * STAGE_SEGS
        self.at = 0
        self.lock = threading.Lock()  # (the executor's launch thread and, rarely, others)

    def copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        n = t.numel() * t.element_size()
        k = max(1, -(-n // STAGE_SEG))
        if k > STAGE_SEGS // 8:
            return None
        with self.lock:
            if self.at + k > STAGE_SEGS:
                self.at = 0
            i = self.at
            self.at += k
            for ev in self.events[i:i + k]:
                if ev is not None:
                    ev.synchronize()
            host = self.buf[i * STAGE_SEG:i * STAGE_SEG + n].view(t.dtype).view(t.shape)
            host.copy_(t)
            out = torch.empty(t.shape, dtype=t.dtype, device=device)
            out.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.events[i:i + k] = [ev] * k
        return out


_stagings: dict[int, _Staging] = {}
_stagings_lock = threading.Lock()


def _staging(index: int) -> _Staging:
    st = _stagings.get(index)
    if st is None:
        with _stagings_lock:
            st = _stagings.setdefault(index, _Staging())
    return st


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host array on the device without a stream sync. `torch.tensor(v, device=...)`
    copies from pageable memory and then waits for the stream, i.e. for every step already
    queued: one such call in a launch undoes the pipelining. Staged in pinned memory instead:
    a segment of the device's staging ring (`_Staging`), or, for a large array or inside a
    graph capture, its own pinned block (the caching host allocator keeps it until the copy has run)."""
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=dtype)
    if t.dtype != dtype:
        t = t.to(dtype)
    dev = torch.device(device)
    if dev.type != "cuda":
        return t.to(device)
    if t.numel() and not torch.cuda.is_current_stream_capturing():
        out = _staging(dev.index if dev.index is not None else torch.cuda.current_device()).copy(
            t.contiguous(), dev)
        if out is not None:
            return out
    return t.pin_memory().to(device, non_blocking=True)


def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def check(t: torch.Tensor, name: str, dtype: torch.dtype | tuple, ndim: int | None = None,
          contiguous_last: bool = True, align: int = 0) -> None:
    """Launcher-side checks: device, dtype, rank, unit stride in the last dim, alignment."""
    dts = dtype if isinstance(dtype, tuple) else (dtype,)
    if not t.is_cuda:
        raise ValueError(f"{name}: expected a CUDA tensor")
    if t.dtype not in dts:
        raise ValueError(f"{name}: dtype {t.dtype}, expected {dts}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: rank {t.dim()}, expected {ndim}")
    if contiguous_last and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: last dim must have stride 1")
    if align and t.data_ptr() % align:
        raise ValueError(f"{name}: data pointer not {align}-byte aligned")


# ------------------------------------------------------------------ Numba


def numba_cuda():
    # numba-cuda 0.68 registers overloads for numpy functions that numpy 2.4+
    # removed (np.row_stack, ...): alias them before its first import, or every
    # kernel compile fails with AttributeError (seen on the H200 image).
    for old, new in (("row_stack", "vstack"), ("trapz", "trapezoid"), ("in1d", "isin")):
        if not hasattr(np, old) and hasattr(np, new):
            setattr(np, old, getattr(np, new))
    from numba import cuda  # noqa: PLC0415

    return cuda


def nb_array(t: torch.Tensor):
    """Numba device-array view of a torch tensor (no copy, no stream sync: capturable)."""
    return numba_cuda().as_cuda_array(t, sync=False)


def nb_stream():
    return numba_cuda().external_stream(torch.cuda.current_stream().cuda_stream)


def nb_launch(kernel, grid, block, *tensors) -> None:
    """Launch a Numba kernel on torch's current device and stream, over torch tensors."""
    cuda = numba_cuda()
    dev = torch.cuda.current_device()
    if dev == 0:
        kernel[grid, block, nb_stream()](*(nb_array(t) for t in tensors))
        return
    with cuda.gpus[dev]:  # Numba's context for that device on this thread
        kernel[grid, block, nb_stream()](*(nb_array(t) for t in tensors))
