"""Kernel launches of a ``torch.compile``'d train step: what inductor's code runs per step, base vs OREPA.

A compiled model has no aten operators to count (``aten_ops.py`` counts eager steps): its host
cost on a GPU is the launches its generated code makes, one per fused kernel and one per call it
leaves to an external library (``extern_kernels.*``: matrix products, convolutions) or to aten
(a fallback, e.g. the convolutions' backward). Counted in inductor's generated forward and backward
(``orepa.apps.bench.measure.inductor_code``) for one zero_grad-free forward + cross-entropy +
backward of ResNet-18 (10 classes, batch 8, 64x64; another zoo model with `-m`).

OREPA three ways: grouped as on a CUDA device (the network's groups build their kernels together
inside the graph), unpacked and packed, and block by block (policy ``per-block``), each block on
the route a CUDA device takes (every branch in kernel space); on a CPU the route is chosen by
FLOPs per input and ``auto`` does not group, so this script sets the engine's device test to the
GPU's answer and groups with policy ``grouped``. The code is
inductor's CPU code, whose choices depend on the sizes (at 1/4 width it turns more small products
into fused loops of its own) and differ from its GPU code's: a count to compare variants by, not
the GPU's. Compiles each model once (1-2 minutes for OREPA on 2 cores; the first step's time is
recorded, inductor's caches off)::

    python3 benchmarks/compiled_model_launches.py   # -> benchmarks/results/compiled_model_launches.json
    python3 benchmarks/compiled_model_launches.py -m resnet50   # -> ..._resnet50.json
"""
import argparse
import time
from unittest import mock

import torch

from orepa import engine
from orepa.apps.bench.measure import compiled_launches, environment, git_state, inductor_code
from orepa.apps.bench.report import add_zoo_model_argument, model_results_file
from orepa.apps.checkpoint import check_output_path, report_of, write_json
from orepa.apps.common import UserError
from orepa.models import create_model

#: the mark of this script's reports (report_of): its results file replaces those alone, not a file of another kind
REPORT = "benchmarks/compiled_model_launches.py"

# OREPA as a GPU groups it (policy "auto" there, "grouped" here), unpacked and packed, and block by block
VARIANTS = {"base": ("base", None, False), "orepa": ("orepa", "grouped", False),
            "orepa, packed": ("orepa", "grouped", True), "orepa, per-block": ("orepa", "per-block", False)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_zoo_model_argument(parser)
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    path = check_output_path(model_results_file("compiled_model_launches", args.model), "results file",
                             report=REPORT)  # before minutes of compilation
    # the route of a CUDA device: every branch in kernel space (see above); the engine's own again afterwards
    with mock.patch.object(engine, "_launch_bound", lambda t: True):
        return _measure(args, path)


def _measure(args, path) -> dict:
    torch.set_num_threads(2)
    torch._inductor.config.force_disable_caches = True  # each compilation from scratch: its time is recorded
    git = git_state()
    out = {"environment": environment(torch.device("cpu"), git),
           "setting": f"{args.model}, 10 classes, batch 8, 64x64, torch.compile (inductor), GPU route",
           "models": {}}
    for name, (method, policy, pack) in VARIANTS.items():
        torch.manual_seed(0)
        model = create_model(args.model, method, num_classes=10).train()
        if policy is not None:
            engine.group_kernels(model, policy, pack=pack, traced=True)
        compiled = torch.compile(model)
        x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

        def step():
            torch.nn.functional.cross_entropy(compiled(x), y).backward()

        start = time.perf_counter()
        with inductor_code() as codes:
            step()
        seconds = time.perf_counter() - start  # the first step: tracing and compiling
        if len(codes) != 2:
            raise UserError(f"{name}: expected one forward and one backward module, got {len(codes)}")
        row = {**compiled_launches(codes), "first_step_s": round(seconds, 1)}
        out["models"][name] = row
        torch._dynamo.reset()

    print(out["setting"])
    print("| model | forward: fused / extern / aten | backward: fused / extern / aten | launches per step | first step |")
    print("|---|---|---|---|---|")
    for method, row in out["models"].items():
        f, b = row["forward"], row["backward"]
        print(f"| {method} | {f['fused']} / {f['extern']} / {f['aten']} | {b['fused']} / {b['extern']} / {b['aten']} "
              f"| {row['total']} ({row['total'] / out['models']['base']['total']:.2f}x) | {row['first_step_s']:.0f} s |")
    write_json(path, report_of(REPORT, out), indent=1)
    return out


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
