"""Memory that recorded kernel builds hold between steps, estimated on a CPU.

A recorded build (``group_kernels(..., graphs=True)``, ``orepa train --kernel-graphs``) keeps, per
network and device, one CUDA-graph memory pool for all its groups' recordings, from which the
temporaries of every capture come (a capture may reuse what an earlier one freed), and two buffers
the recordings share: their kernels' gradients in, and their outputs (``engine.RecordingBuffer``).
Here the captures run on a CPU under a dispatch mode that follows every tensor they allocate
(alive while a Python tensor of its storage is), which gives the pool's least size (its peak of live bytes over all captures, without the allocator's rounding and
fragmentation); ``torch.cuda`` reports the real figure on a GPU (``engine.recorded_bytes``,
``orepa bench`` variant ``orepa:graphs=true``)::

    python3 benchmarks/recorded_memory.py     # -> benchmarks/results/recorded_memory.json

The groups build eagerly here: the memory of a compiled construction (``--kernel-builder
compiled``) is allocated by inductor's generated code, which no dispatch mode sees.
"""
import argparse

import torch

from orepa import engine
from orepa.apps.bench.measure import PoolEstimator, environment, git_state, make_runner, record_builds
from orepa.apps.checkpoint import check_output_path, report_of, write_json

#: the mark of this script's reports (report_of): --json replaces those alone, not a file of another kind
REPORT = "benchmarks/recorded_memory.py"
MiB = 2 ** 20


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="benchmarks/results/recorded_memory.json",
                    help="where the results go (default %(default)s)")
    return ap


def estimate(arch: str) -> dict:
    r = make_runner(arch, "orepa", device=torch.device("cpu"), kernel_builder="grouped")
    record_builds(r.model, PoolEstimator)
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 1000, (2,))
    r.step(x, y)
    groups = engine.kernel_groups(r.model)
    recordings = [g._recording for g in groups if g._recording is not None]
    buffers = {use: groups[0].workspace.recording_buffer(torch.device("cpu"), use).buffer.nbytes
               for use in ("outputs", "gradients in")}
    held = engine.recorded_bytes(r.model)  # the buffers (this recorder's pool_bytes is 0)
    assert held == sum(buffers.values())
    pool = groups[0].workspace.recorder(PoolEstimator, torch.device("cpu")).live.peak
    return {"groups": len(groups), "recordings": len(recordings), "pool_mib": pool / MiB,
            "gradient_inputs_mib": buffers["gradients in"] / MiB, "outputs_mib": buffers["outputs"] / MiB,
            "total_mib": (pool + held) / MiB,
            "kernels_mib": sum(t.nbytes for rec in recordings for t in rec.kernels) / MiB,
            "parameter_gradients_mib": sum(t.nbytes for rec in recordings for t in rec.grads) / MiB}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)  # (a --help must not run the measurement and overwrite the results)
    check_output_path(args.json, "--json", report=REPORT)  # before the estimates
    torch.set_num_threads(2)
    git = git_state()
    out = {"environment": environment(torch.device("cpu"), git), "dtype": "float32", "builder": "grouped (eager)",
           "models": {}}
    print("| model | pool (least) | kernels' gradients in | outputs | held | "
          "all groups' kernels / parameter gradients |\n|---|---|---|---|---|---|")
    for arch in ("resnet18", "resnet50"):
        e = out["models"][arch] = estimate(arch)
        print(f"| {arch} | {e['pool_mib']:.0f} MiB | {e['gradient_inputs_mib']:.0f} MiB | {e['outputs_mib']:.0f} MiB | "
              f"**{e['total_mib']:.0f} MiB** | {e['kernels_mib']:.0f} / {e['parameter_gradients_mib']:.0f} MiB |")
    write_json(args.json, report_of(REPORT, out), indent=1)
    return out


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
