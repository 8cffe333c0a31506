"""Host time of an eager train step whose kernel builds are recorded, predicted on a CPU.

A recorded build (``group_kernels(..., graphs=True)``, ``orepa train --kernel-graphs``) replays two
CUDA graphs per group, which the host issues in microseconds while the GPU runs them. What the
host still does per step (issuing the convolutions and the rest of the network, the copies out
of the recordings, autograd, the optimizer, the engine's Python) is timed here in the host-bound
regime of docs/benchmarks.md (ResNet-18 at 1/16 width, one 32x32 image, one thread), with a
recorder whose replays do nothing (``measure.UnreplayedRecorder``: the step's numbers are not the
point). Paired with base (median over interleaved steps of the ratio to base's step in the same
round) next to the eager groups, one node and a node per group (what DDP runs). A prediction of
the host's share of an eager GPU step, not a GPU measurement::

    python3 benchmarks/recorded_host_time.py     # -> benchmarks/results/recorded_host_time.json
"""
import argparse
import statistics
import time

import torch

from orepa.apps.bench.measure import environment, git_state, make_runner, record_builds
from orepa.apps.checkpoint import check_output_path, report_of, write_json

#: the mark of this script's reports (report_of): --json replaces those alone, not a file of another kind
REPORT = "benchmarks/recorded_host_time.py"

OPTIONS = {"width_mult": 0.0625, "small_input": True}
VARIANTS = (  # name, spec, recorded
    ("base", "base", False),
    ("eager groups", "orepa", False),
    ("recorded", "orepa", True),
    ("eager groups, a node per group", "orepa:joint=false", False),
    ("recorded, a node per group", "orepa:joint=false", True),
)
WARMUP, REPS = 10, 80


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="benchmarks/results/recorded_host_time.json",
                    help="where the results go (default %(default)s)")
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)  # (a --help must not run the measurement and overwrite the results)
    check_output_path(args.json, "--json", report=REPORT)  # before the timing
    torch.set_num_threads(1)
    git = git_state()
    x, y = torch.randn(1, 3, 32, 32), torch.randint(0, 1000, (1,))
    runners = {}
    for name, spec, recorded in VARIANTS:
        r = make_runner("resnet18", spec, device=torch.device("cpu"), kernel_builder="grouped", model_options=OPTIONS)
        if recorded:
            record_builds(r.model)
        for _ in range(WARMUP):
            r.step(x, y)
        runners[name] = r
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(REPS):
        for name, r in runners.items():
            t0 = time.perf_counter()
            r.step(x, y)
            times[name].append(time.perf_counter() - t0)
    env = environment(torch.device("cpu"), git)
    out = {"environment": env, "reps": REPS, "variants": {},
           "setting": "resnet18 width_mult=0.0625 small_input, batch 1, 32x32, kernel builder grouped, packed"}
    print(f"{env['cpu']}, 1 thread, torch {env['torch']}; {out['setting']}")
    print("| variant | step ms (median) | paired ratio to base |\n|---|---|---|")
    for name, ts in times.items():
        paired = statistics.median(t / b for t, b in zip(ts, times["base"]))
        out["variants"][name] = {"step_ms": statistics.median(ts) * 1e3, "paired": paired}
        print(f"| {name} | {statistics.median(ts) * 1e3:.2f} | {paired:.2f}x |")
    write_json(args.json, report_of(REPORT, out), indent=1)
    return out


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
