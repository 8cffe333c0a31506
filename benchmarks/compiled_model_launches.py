"""Kernel launches of a ``torch.compile``'d train step: what inductor's code runs per step, base vs OREPA.

A compiled model has no aten operators to count (``aten_ops.py`` counts eager steps): its host
cost on a GPU is the launches its generated code makes, one per fused kernel and one per call it
leaves to an external library (``extern_kernels.*``: matrix products, convolutions) or to aten
(a fallback, e.g. the convolutions' backward). Counted in inductor's generated forward and backward
(``torch._inductor.utils.run_and_get_code``) for one zero_grad-free forward + cross-entropy +
backward of ResNet-18 (1/4 width, 10 classes, batch 8, 64x64: the counts do not depend on the size).

Inside a compiled graph the online blocks build their kernels block by block (groups stand aside),
on the route a CUDA device takes (every branch in kernel space); on a CPU the route is chosen by
FLOPs per input, so this script sets the engine's device test to the GPU's answer. The code is
inductor's CPU code, generated without SIMD (as the test suite does; the counts are the same with
it). Compiles each model once (about 1.5 minutes for OREPA on 2 cores)::

    python3 benchmarks/compiled_model_launches.py   # -> benchmarks/results/compiled_model_launches.json
"""
import json
import os

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import torch  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

from orepa import engine  # noqa: E402
from orepa.apps.bench.measure import compiled_launches, environment, git_state  # noqa: E402
from orepa.models import create_model  # noqa: E402

engine._launch_bound = lambda t: True  # the route of a CUDA device: every branch in kernel space (see above)
torch.set_num_threads(2)
git = git_state()
out = {"environment": environment(torch.device("cpu"), git),
       "setting": "resnet18 width_mult=0.25, 10 classes, batch 8, 64x64, torch.compile (inductor), GPU route",
       "models": {}}
for method in ("base", "orepa"):
    torch.manual_seed(0)
    model = create_model("resnet18", method, num_classes=10, width_mult=0.25).train()
    compiled = torch.compile(model)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

    def step():
        torch.nn.functional.cross_entropy(compiled(x), y).backward()

    _, codes = run_and_get_code(step)
    if len(codes) != 2:
        raise SystemExit(f"{method}: expected one forward and one backward module, got {len(codes)}")
    row = compiled_launches(codes)
    out["models"][method] = row
    torch._dynamo.reset()

print(out["setting"])
print("| model | forward: fused / extern / aten | backward: fused / extern / aten | launches per step |")
print("|---|---|---|---|")
for method, row in out["models"].items():
    f, b = row["forward"], row["backward"]
    print(f"| {method} | {f['fused']} / {f['extern']} / {f['aten']} | {b['fused']} / {b['extern']} / {b['aten']} "
          f"| {row['total']} ({row['total'] / out['models']['base']['total']:.2f}x) |")
with open("benchmarks/results/compiled_model_launches.json", "w") as fh:
    json.dump(out, fh, indent=1)
