#!/usr/bin/env python3
"""Training-cost benchmark: ``python benchmarks/bench_train.py [options]`` == ``orepa bench [options]``.

Examples (see docs/benchmarks.md for the recorded tables)::

    python benchmarks/bench_train.py -m resnet18 -b 16 --methods base dbb orepa orepa-offline
    python benchmarks/bench_train.py -m resnet50 -b 8 --methods base dbb orepa
    python benchmarks/bench_train.py -m resnet18 -b 8 --components      # Fig. "budgets"
"""
import sys

from orepa.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
