"""Kernels by target: `cpu/` (Numba CPU) and `cuda/` (CuPy RawKernels, Numba CUDA).
They import nothing else of imp, and neither target imports the other."""
