"""Kernel launches of a ``torch.compile``'d train step: what inductor's code runs per step, base vs OREPA.

A compiled model has no aten operators to count (``aten_ops.py`` counts eager steps): its host
cost on a GPU is the launches its generated code makes, one per fused kernel and one per call it
leaves to an external library (``extern_kernels.*``: matrix products, convolutions) or to aten
(a fallback, e.g. the convolutions' backward). Counted in inductor's generated forward and backward
(``orepa.apps.bench.measure.inductor_code``) for one zero_grad-free forward + cross-entropy +
backward of ResNet-18 (10 classes, batch 8, 64x64).

Inside a compiled graph the online blocks build their kernels block by block (groups stand aside),
on the route a CUDA device takes (every branch in kernel space); on a CPU the route is chosen by
FLOPs per input, so this script sets the engine's device test to the GPU's answer. The code is
inductor's CPU code, whose choices depend on the sizes (at 1/4 width it turns more small products
into fused loops of its own) and differ from its GPU code's: a count to compare variants by, not
the GPU's. Compiles each model once (about 2 minutes for OREPA on 2 cores)::

    python3 benchmarks/compiled_model_launches.py   # -> benchmarks/results/compiled_model_launches.json
"""
import json

import torch

from orepa import engine
from orepa.apps.bench.measure import compiled_launches, environment, git_state, inductor_code
from orepa.models import create_model

engine._launch_bound = lambda t: True  # the route of a CUDA device: every branch in kernel space (see above)
torch.set_num_threads(2)
git = git_state()
out = {"environment": environment(torch.device("cpu"), git),
       "setting": "resnet18, 10 classes, batch 8, 64x64, torch.compile (inductor), GPU route",
       "models": {}}
for method in ("base", "orepa"):
    torch.manual_seed(0)
    model = create_model("resnet18", method, num_classes=10).train()
    compiled = torch.compile(model)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

    def step():
        torch.nn.functional.cross_entropy(compiled(x), y).backward()

    with inductor_code() as codes:
        step()
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
