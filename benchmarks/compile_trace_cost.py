"""What dynamo's trace of a ``torch.compile``'d train step costs, base vs OREPA: bytecode instructions.

Dynamo interprets every bytecode instruction of the Python it traces (the model's, and the engine's
that builds the online blocks' kernels inside the graph), which on a CPU costs tens of microseconds
each, so the instruction count is the trace's host cost in a deterministic number. Counted in the
first forward and backward of a zoo model (10 classes, batch 2, 64x64, 1/8 width; OREPA grouped
as on a GPU, policy ``grouped``, and block by block as on a CPU, policy ``per-block``, both with
``traced=True``) compiled with ``backend="eager"`` (dynamo alone:
inductor's compilation comes on top, the same for any trace of the same graph); the first step's
time is recorded beside it::

    python3 benchmarks/compile_trace_cost.py   # -> benchmarks/results/compile_trace_cost.json

Counts ``torch._dynamo.symbolic_convert.InstructionTranslatorBase.step`` calls (an internal of
dynamo: other torch versions may count differently; compare variants of one run).
"""
import argparse
import collections
import time

import torch
from torch._dynamo import symbolic_convert

from orepa import engine
from orepa.apps.bench.measure import environment, git_state
from orepa.apps.bench.report import add_zoo_model_argument, model_results_file
from orepa.apps.checkpoint import check_output_path, report_of, write_json
from orepa.apps.common import positive_float, positive_int
from orepa.models import create_model

#: the mark of this script's reports (report_of): its results file replaces those alone, not a file of another kind
REPORT = "benchmarks/compile_trace_cost.py"

VARIANTS = {"base": ("base", None), "orepa, grouped": ("orepa", "grouped"), "orepa, per-block": ("orepa", "per-block")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_zoo_model_argument(parser)
    parser.add_argument("--width-mult", type=positive_float, default=0.125, help="width multiplier (default 1/8: the "
                        "trace's instructions do not depend on the width, its compute does)")
    parser.add_argument("--top", type=positive_int, default=10, help="the functions tracing the most instructions to list")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    path = check_output_path(model_results_file("compile_trace_cost", args.model), "results file",
                             report=REPORT)  # before minutes of tracing
    torch.set_num_threads(2)
    counts: collections.Counter = collections.Counter()
    step = symbolic_convert.InstructionTranslatorBase.step

    def counted(self):
        code = self.f_code
        counts[f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_firstlineno}({code.co_name})"] += 1
        return step(self)

    symbolic_convert.InstructionTranslatorBase.step = counted
    try:
        out = {"environment": environment(torch.device("cpu"), git_state()),
               "setting": f"{args.model} x{args.width_mult} width, 10 classes, batch 2, 64x64, "
                          "torch.compile(backend='eager'), group_kernels(traced=True)",
               "models": {}}
        for name, (method, policy) in VARIANTS.items():
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = create_model(args.model, method, num_classes=10, width_mult=args.width_mult).train()
            if policy is not None:
                engine.group_kernels(model, policy, traced=True)
            compiled = torch.compile(model, backend="eager")
            x, y = torch.randn(2, 3, 64, 64), torch.tensor([1, 2])
            counts.clear()
            start = time.perf_counter()
            torch.nn.functional.cross_entropy(compiled(x), y).backward()
            seconds = time.perf_counter() - start
            out["models"][name] = {"instructions": sum(counts.values()), "first_step_s": round(seconds, 1),
                                   "most": counts.most_common(args.top)}
    finally:
        symbolic_convert.InstructionTranslatorBase.step = step

    base = out["models"]["base"]
    print(out["setting"])
    print("| model | instructions traced | first step |")
    print("|---|---|---|")
    for name, row in out["models"].items():
        print(f"| {name} | {row['instructions']:,} ({row['instructions'] / base['instructions']:.0f}x) "
              f"| {row['first_step_s']:.1f} s |")
    for name in VARIANTS:
        if name != "base":
            print(f"\nmost instructions ({name}):")
            for where, n in out["models"][name]["most"]:
                print(f"  {n:>7,}  {where}")
    write_json(path, report_of(REPORT, out), indent=1)
    return out


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
