"""aten operators dispatched by one eager train step: base, DBB and OREPA ResNets at the paper's setting.

Each dispatched operator costs the host ~10-20 us on a GPU, so this count bounds an eager
online block's step time there, on any machine. The second count, kernels, leaves out views,
aliases and allocations: the operators that launch a GPU kernel, which a CUDA-graph replay
still runs one after another. Counted with a ``TorchDispatchMode`` over one
train step (zero_grad + forward + cross-entropy + backward + fused SGD) after one warm-up step,
224x224 inputs (``orepa bench`` reports the same count in its "aten ops / step" column). OREPA is
counted on the routes of ``orepa.engine``: "grouped" (blocks of one signature build their kernels
together: what runs on a GPU), "per-block" (each block its own FLOP-chosen route: a CPU) and
"compiled" (grouped, the groups' construction compiled by inductor: its fused kernels are not
aten operators, only its products and allocations are; compiles for a minute first). The grouped
routes pack their parameters (a few per group, as ``orepa train`` does where groups build)
and are counted unpacked too ("unpacked": one parameter per step, one accumulation each).
"recorded" is the grouped route with its builds recorded as CUDA graphs (``group_kernels(...,
graphs=True)``, ``orepa train --kernel-graphs``): a replay dispatches no operator, so it is counted
with a recorder whose replays do nothing (``measure.UnreplayedRecorder``; the numbers of that step
are not the point), which leaves what the host issues besides the replays::

    python3 benchmarks/aten_ops.py            # -> benchmarks/results/aten_ops.json
"""
import argparse

import torch

from orepa.apps.bench.measure import count_ops, make_runner, record_builds
from orepa.apps.checkpoint import check_output_path, report_of, write_json

#: the mark of this script's reports (report_of): --json replaces those alone, not a file of another kind
REPORT = "benchmarks/aten_ops.py"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="benchmarks/results/aten_ops.json", help="where the results go (default %(default)s)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)  # (a --help must not run the measurement and overwrite the results)
    check_output_path(args.json, "--json", report=REPORT)  # before minutes of counting
    out = {}
    for model, b in (("resnet18", 64), ("resnet50", 32)):
        x, y = torch.randn(b, 3, 224, 224), torch.randint(0, 1000, (b,))
        for spec, builder in (("base", "auto"), ("dbb", "auto"), ("orepa", "grouped"), ("orepa:pack=false", "grouped"),
                              ("orepa", "recorded"), ("orepa", "per-block"), ("orepa", "compiled"),
                              ("orepa:pack=false", "compiled")):
            key = f"{model} b{b} {spec.split(':')[0]}" + ("" if spec == "base" or spec == "dbb" else f" {builder}") + (
                " unpacked" if spec.endswith("pack=false") else "")
            r = make_runner(model, spec, device=torch.device("cpu"),
                            kernel_builder="grouped" if builder == "recorded" else builder)
            if builder == "recorded":
                record_builds(r.model)
            r.step(x, y)
            ops, kernels = count_ops(lambda r=r: r.step(x, y))
            out[key], out[f"{key} kernels"] = ops, kernels
            base = f"{model} b{b} base"
            print(f"{key:32} {ops:6d} ops ({ops / out[base]:.2f}x base), {kernels:5d} kernels "
                  f"({kernels / out[base + ' kernels']:.2f}x)", flush=True)
    write_json(args.json, report_of(REPORT, out), indent=1)
    return out


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
