"""On the GPU machine: install the carried wheels (.whl/, see bench/device_wheels.sh) whose
distributions the image lacks, into /tmp/site (then `export PYTHONPATH=/tmp/site`). What the
image already has is kept: a carried wheel never replaces a package torch or CuPy were built with.

    python3 bench/device_site.py && export PYTHONPATH=/tmp/site
"""

import importlib.metadata as md
import pathlib
import subprocess
import sys

have, need = [], []
for w in sorted(pathlib.Path(".whl").glob("*.whl")):
    dist = w.name.split("-")[0]
    try:
        md.distribution(dist)
        have.append(dist)
    except md.PackageNotFoundError:
        need.append(str(w))
print(f"device_site: {len(have)} present, installing {len(need)}", file=sys.stderr)
if need:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *need], check=True)
