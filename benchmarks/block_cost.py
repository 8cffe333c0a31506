"""Cost of one OREPA block against the plain conv it replaces, per ResNet-18 layer shape.

For each 3x3 conv shape of ResNet-18 at 224x224 (or the shapes given), times forward +
backward of ``nn.Conv2d`` and of ``OREPAConv2d`` (min and median of the repetitions), and
prints which branches the chain-order choice runs on the feature map and whether the
kernel is recomputed. ``--force`` also times fixed routes, e.g. ``--force 1x1_kxk,dw_pw``.

    python benchmarks/block_cost.py -b 2 --threads 2 [--json out.json] [--force "" --force 1x1_kxk,dw_pw]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from orepa import engine
from orepa.apps.checkpoint import check_output_path, report_of, write_json
from orepa.apps.common import UserError, positive_int, thread_count
from orepa.blocks import OREPAConv2d

#: the mark of this script's reports (report_of): --json replaces those alone, not a file of another kind
REPORT = "benchmarks/block_cost.py"

RESNET18_SHAPES = [(64, 64, 1, 56), (64, 128, 2, 56), (128, 128, 1, 28), (128, 256, 2, 28),
                   (256, 256, 1, 14), (256, 512, 2, 14), (512, 512, 1, 7)]


def _time(fn, reps: int, warmup: int = 2) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3, statistics.median(ts) * 1e3


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-b", "--batch-size", type=positive_int, default=2)
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--reps", type=positive_int, default=12)
    ap.add_argument("--force", action="append", default=[],
                    help="comma-separated branches to run on the feature map (repeatable; '' = all in kernel space)")
    ap.add_argument("--json", default=None)
    return ap


def check_forced(specs: list[str]) -> None:
    """A :class:`UserError` for a ``--force`` naming a branch some layer's block lacks: before any timing."""
    for cin, cout, stride, _ in RESNET18_SHAPES:
        branches = list(OREPAConv2d(cin, cout, 3, stride).branches)
        for spec in specs:
            unknown = [n for n in spec.split(",") if n and n not in branches]
            if unknown:
                raise UserError(f"--force {spec}: no branch {unknown} in {branches}")


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.json:
        check_output_path(args.json, "--json", report=REPORT)
    check_forced(args.force)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for cin, cout, stride, size in RESNET18_SHAPES:
        x = torch.randn(args.batch_size, cin, size, size, requires_grad=True)
        conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        block = OREPAConv2d(cin, cout, 3, stride)

        def step(m):
            y = m(x)
            y.backward(torch.ones_like(y))

        recompute = engine.needs_recompute(block, x)
        row = {"shape": f"{cin}->{cout} s{stride} {size}x{size}", "conv_ms": _time(lambda: step(conv), args.reps),
               "orepa_ms": _time(lambda: step(block), args.reps),
               "on_features": engine.route(block, x, recompute)[1],
               "recompute": recompute, "forced": {}}
        for spec in args.force:
            feat = [n for n in spec.split(",") if n]
            engine.force_route(block, x, recompute, feat)
            assert engine.route(block, x, recompute)[1] == feat  # (the memo is read: the forced route runs)
            row["forced"][spec or "(none)"] = _time(lambda: step(block), args.reps)
            block._routes.clear()
        rows.append(row)
        forced = "  ".join(f"[{k}] {v[0]:.1f}" for k, v in row["forced"].items())
        print(f"{row['shape']:>22}: conv {row['conv_ms'][0]:6.1f} ms  orepa {row['orepa_ms'][0]:6.1f} ms "
              f"({row['orepa_ms'][0] / row['conv_ms'][0]:.2f}x)  features={row['on_features']} "
              f"recompute={recompute}  {forced}")
    if args.json:
        write_json(args.json, report_of(REPORT, {"batch_size": args.batch_size, "threads": torch.get_num_threads(),
                                         "rows": rows}), indent=1)
    return rows


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
