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
import json
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from orepa import engine
from orepa.apps.bench.measure import UnreplayedRecorder, environment, git_state, make_runner, record_builds

MiB = 2 ** 20


class _LiveBytes(TorchDispatchMode):
    """Live bytes of the storages allocated under it (an op's output whose storage is none of its
    inputs'), each alive while a Python tensor of that storage is; their peak."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, int] = {}  # storage address -> live tensors of it
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _drop(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= self.sizes.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in inputs and ptr not in self.refs:
                continue  # a view of, or a write into, memory from outside the captures
            if ptr not in self.refs:
                self.refs[ptr] = 0
                self.sizes[ptr] = t.untyped_storage().nbytes()
                self.live += self.sizes[ptr]
                self.peak = max(self.peak, self.live)
            self.refs[ptr] += 1
            weakref.finalize(t, self._drop, ptr)
        return out


class PoolEstimator(UnreplayedRecorder):
    """A stand-in recorder whose captures are followed by one :class:`_LiveBytes` (one pool for
    the network's recordings, as ``engine.CudaGraphRecorder`` has); its replays do nothing."""

    mode: _LiveBytes | None = None

    def record(self, fn) -> tuple:
        cls = type(self)
        if cls.mode is None:
            cls.mode = _LiveBytes()
        with cls.mode:
            outputs = fn()
        return (lambda: None), outputs


def estimate(arch: str) -> dict:
    PoolEstimator.mode = None
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
    pool = PoolEstimator.mode.peak
    return {"groups": len(groups), "recordings": len(recordings), "pool_mib": pool / MiB,
            "gradient_inputs_mib": buffers["gradients in"] / MiB, "outputs_mib": buffers["outputs"] / MiB,
            "total_mib": (pool + held) / MiB,
            "kernels_mib": sum(t.nbytes for rec in recordings for t in rec.kernels) / MiB,
            "parameter_gradients_mib": sum(t.nbytes for rec in recordings for t in rec.grads) / MiB}


if __name__ == "__main__":
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
    with open("benchmarks/results/recorded_memory.json", "w") as f:
        json.dump(out, f, indent=1)
