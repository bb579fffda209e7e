"""Summarize py-spy raw (collapsed) stacks of a bench/engine.py run: per thread, the samples (py-spy counts
active time only), the top own frames and the top inclusive frames. Boot, the runner's rate probe and the
report are left out (the main thread's samples outside the event loop).

    py-spy record -r 1000 --threads -f raw -o spy.txt -- python3 bench/engine.py ... (bench/gpu_call_v12.sh spy)
    .venv/bin/python bench/spy_summary.py spy.txt
"""

import collections
import re
import sys

path = sys.argv[1]
own = collections.defaultdict(collections.Counter)
inc = collections.defaultdict(collections.Counter)
tot = collections.Counter()
for line in open(path):
    line = line.rstrip("\n")
    if not line:
        continue
    stack, _, n = line.rpartition(" ")
    n = int(n)
    frames = stack.split(";")
    th = frames[0]
    fr = frames[1:]
    if any(any(k in f for k in ("runner_rates", "load_engine", "write_raw_gguf", "step_kinds")) for f in fr):
        continue
    if "MainThread" in th and not any("Runner.run" in f for f in fr):
        continue  # imports, the report
    tot[th] += n
    if fr:
        own[th][re.sub(r"\s+\(/.*/", " (", fr[-1])] += n
    for f in set(re.sub(r"\s+\(/.*/", " (", x) for x in fr):
        inc[th][f] += n
for th, n in tot.most_common(8):
    print(f"\n== {th}: {n} samples")
    print("  own:")
    for f, k in own[th].most_common(18):
        print(f"    {k:6d} {100*k/n:5.1f}%  {f}")
    print("  inclusive:")
    for f, k in inc[th].most_common(30):
        print(f"    {k:6d} {100*k/n:5.1f}%  {f}")
