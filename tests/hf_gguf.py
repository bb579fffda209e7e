"""transformers reads a GGUF once per object it makes from it (the tokenizer, the config, then the tensors), each time with
a new `gguf.GGUFReader`, whose parse of a large vocabulary is most of HF's load: ~18 s a read for Gemma 3's 262k tokens
on a 2-core box (cProfile: `_build_fields` over 1.5 M field parts), 52 s for the whole model. Inside `one_read()` a file
is parsed once and its reader handed out again (read-only: transformers only reads fields and tensors), so the
reference is still computed by HF's own loader and model, from the same bytes."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def one_read():
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real
