"""Write one of bench/gpu.py's random-weight GGUFs (for serving benchmarks on the GPU machine).

    python3 bench/write_synth.py 8b-bf16 /tmp/imp_bench/8b-bf16.gguf
    python3 bench/write_synth.py 8b-bf16 /tmp/imp_bench/8b-bf16-32k.gguf 32768   # another context length
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import SHAPES  # noqa: E402

from tests.fixtures.synth_raw import write_raw_gguf  # noqa: E402

if __name__ == "__main__":
    name, out = sys.argv[1], Path(sys.argv[2])
    out.parent.mkdir(parents=True, exist_ok=True)
    shape = dict(SHAPES[name], **({"context_length": int(sys.argv[3])} if len(sys.argv) > 3 else {}))
    write_raw_gguf(out, seed=0, **shape)
    print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB)")
