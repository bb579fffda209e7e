"""Model load time and peak RSS, in a fresh process.

    .venv/bin/python bench/model_load.py MODEL [MODEL ...]     (paths or packaged names)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import resource, sys, time
from imp.fetch import resolve_model
from imp.model.runner import ModelRunner
from imp.text.tokenizer import Tokenizer
path = resolve_model(sys.argv[1], progress=False)
t1 = time.time(); r = ModelRunner.load(str(path)); t2 = time.time()
peak_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
Tokenizer.from_gguf_metadata(r.metadata); t3 = time.time()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"| {path.name} | {t2 - t1:.1f} s | {peak_model:.0f} MB | {t3 - t2:.1f} s | {peak:.0f} MB |")
"""


def main() -> int:
    print("| model | ModelRunner.load | peak RSS after load | + tokenizer | peak RSS with tokenizer |")
    print("|---|---|---|---|---|")
    for m in sys.argv[1:] or ["smollm2-135m", "gemma-3-270m"]:
        out = subprocess.run([sys.executable, "-c", CHILD, m], cwd=ROOT, capture_output=True, text=True)
        print(out.stdout.strip() or f"| {m} | failed: {out.stderr.strip()[-200:]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
