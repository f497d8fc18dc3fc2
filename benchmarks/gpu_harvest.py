"""The one-GPU harvesting benchmark (issue 3): a pipeline stage's real compute with 1F1B bubbles, alone and with
fill jobs under naive co-location, MPS only and bubble harvesting. See ``gpubench.run`` and
docs/benchmarks.md.

    .venv/bin/python benchmarks/gpu_harvest.py                 # full size on a GPU (cuda:0)
    .venv/bin/python benchmarks/gpu_harvest.py --device cpu    # smoke run on CPU: checks that it runs, no figures
"""

from __future__ import annotations

import sys

from gpubench.run import main

if __name__ == "__main__":
    sys.exit(main())
