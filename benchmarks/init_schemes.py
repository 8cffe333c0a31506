"""Test top-1 of OREPA ResNet-18 on Fashion-MNIST under both initialisation schemes, and of base.

Runs ``orepa train`` for base, OREPA with ``init=reference`` (the published scheme, the
default) and OREPA with ``init=torch`` (nn.Conv2d's default), over several seeds, two runs
at a time with one thread each, then prints mean / standard deviation / min-max of the
final test top-1 and writes them to a JSON file::

    python3 benchmarks/init_schemes.py                       # the recorded setting
    python3 benchmarks/init_schemes.py --width-mult 0.25 --epochs 10 --seeds 0 1 2

Finished runs (their ``summary.json``, in a folder per setting under ``--runs``) are reused by a
sweep of the same setting, so an interrupted sweep continues.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from orepa.apps.checkpoint import check_output_path, report_of, write_json
from orepa.apps.common import (
    UserError,
    nonneg_float,
    positive_float,
    positive_int,
    seed_int,
    thread_count,
)

#: the mark of this script's reports (report_of): --out replaces those alone, not a file of another kind
REPORT = "benchmarks/init_schemes.py"

VARIANTS = {
    "base": ["--method", "base"],
    "orepa, init=reference": ["--method", "orepa", "--block-opt", "init=reference"],
    "orepa, init=torch": ["--method", "orepa", "--block-opt", "init=torch"],
}


def run_one(args, variant: str, seed: int) -> dict:
    # a folder per setting: a finished run is reused only by a sweep of the same setting
    setting = (f"x{args.width_mult:g}-e{args.epochs}-b{args.batch_size}-w{args.warmup:g}"
               + (f"-n{args.train_subset}" if args.train_subset else ""))
    out = Path(args.runs) / setting / f"{variant.replace(', ', '-').replace('=', '_')}-s{seed}"
    summary = out / "summary.json"
    if not summary.exists():
        cmd = [sys.executable, "-m", "orepa", "train", "--model", "resnet18", *VARIANTS[variant],
               "--width-mult", f"{args.width_mult:g}", "--epochs", str(args.epochs), "-b", str(args.batch_size),
               "--lr-warmup-epochs", f"{args.warmup:g}", "--seed", str(seed), "--threads", "1",
               "--output-dir", str(out), "--no-progress", "--no-tensorboard", "--quiet"]
        if args.train_subset:
            cmd += ["--train-subset", str(args.train_subset)]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if done.returncode:  # (its error is on stderr, above)
            raise UserError(f"orepa train of {variant!r}, seed {seed}, in {out} failed (exit code {done.returncode})")
    s = json.loads(summary.read_text())
    return {"variant": variant, "seed": seed, "val_acc1": s["val_acc1"], "train_time_s": s["train_time_s"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width-mult", type=positive_float, default=0.125)
    p.add_argument("--epochs", type=positive_int, default=2)
    p.add_argument("-b", "--batch-size", type=positive_int, default=128)
    p.add_argument("--warmup", type=nonneg_float, default=0.2, help="linear warm-up epochs")
    p.add_argument("--train-subset", type=positive_int, default=None)
    p.add_argument("--seeds", type=seed_int, nargs="+", default=[0, 1, 2])
    p.add_argument("--jobs", type=thread_count, default=2, help="runs at a time (one thread each)")
    p.add_argument("--runs", default="runs/init_schemes", help="run directories")
    p.add_argument("--out", default="benchmarks/results/init_schemes.json")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # before hours of training: the table's file, and the folder the runs go in
    check_output_path(args.out, "--out", report=REPORT)
    check_output_path(args.runs, "--runs", directory=True)
    todo = [(v, s) for s in args.seeds for v in VARIANTS]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda vs: run_one(args, *vs), todo))
    table = {}
    print(f"ResNet-18 x{args.width_mult:g}, Fashion-MNIST, {args.epochs} epoch(s), batch {args.batch_size}, "
          f"seeds {args.seeds}: test top-1 (%)")
    print(f"{'variant':24} {'mean':>7} {'std':>6} {'min':>7} {'max':>7}  per seed")
    for variant in VARIANTS:
        accs = [r["val_acc1"] for r in rows if r["variant"] == variant]
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        table[variant] = {"mean": statistics.mean(accs), "std": std, "min": min(accs), "max": max(accs),
                          "per_seed": accs}
        print(f"{variant:24} {statistics.mean(accs):7.2f} {std:6.2f} {min(accs):7.2f} {max(accs):7.2f}  "
              + " ".join(f"{a:.2f}" for a in accs))
    write_json(args.out, report_of(REPORT, {"settings": vars(args), "results": table, "runs": rows}), indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
