"""Where a train step's time goes: ``torch.profiler`` self time per operator, per variant.

Builds the variants as ``orepa bench`` does (same model zoo, options and fused SGD),
warms them up, then profiles ``--steps`` train steps of each, interleaved, and prints

* a category table (convolutions, matrix products, element-wise, copies and layout,
  normalisation, optimizer, other) in ms per step with the difference to ``base``;
* the top operators by self time for every non-base variant, with input shapes.

Self CPU time is what the operators themselves spent (profiler overhead included, so the
sum exceeds the wall time a little). With ``--device cuda`` that is host time, and a second
report gives the GPU time of each operator's kernels (what a CUDA-graph replay still spends).
This is the script behind docs/benchmarks.md "Where the time goes".

    python benchmarks/profile_step.py -m resnet18 -b 16 --methods base orepa --threads 2 [--json out.json]

``--kernel-builder`` as in ``orepa bench``; with ``compiled`` the kernels of the compiled
constructions, which no aten operator runs, are reported as category "fused".
"""
from __future__ import annotations

import argparse
import contextlib
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from orepa.apps.bench import make_runner, parse_spec
from orepa.apps.bench.measure import quiet_cpu_profiler
from orepa.apps.bench.variants import parse_options
from orepa.apps.checkpoint import check_output_path, report_of, write_json
from orepa.apps.common import (
    UserError,
    add_kernel_builder_argument,
    method_list,
    nonneg_int,
    parse_device,
    positive_int,
    thread_count,
)

#: the mark of this script's reports (report_of): --json replaces those alone, not a file of another kind
REPORT = "benchmarks/profile_step.py"

# operator name (without "aten::") -> category; anything else is "other"
CATEGORIES = {
    "conv": ("convolution", "convolution_backward", "mkldnn_convolution", "_convolution", "cudnn_convolution",
             "conv2d", "_slow_conv2d_forward", "_slow_conv2d_backward"),
    "matmul": ("mm", "bmm", "addmm", "baddbmm", "addmv", "addmv_", "addbmm", "matmul", "dot", "mv"),
    "elementwise": ("mul", "mul_", "add", "add_", "addcmul_", "addcmul", "sub", "sub_", "div", "div_", "sum",
                    "neg", "rsqrt", "clamp_min", "clamp_min_", "relu", "relu_", "threshold_backward", "where",
                    "fill_", "zero_", "pow", "sqrt", "_log_softmax", "_log_softmax_backward_data",
                    "nll_loss_forward", "nll_loss_backward"),
    "copy/layout": ("copy_", "clone", "contiguous", "cat", "constant_pad_nd", "_to_copy", "index", "flip",
                    "repeat_interleave", "index_put_", "slice_backward", "select_backward", "new_zeros", "zeros"),
    "norm": ("native_batch_norm", "native_batch_norm_backward", "_batch_norm_impl_index",
             "_batch_norm_impl_index_backward", "batch_norm", "cudnn_batch_norm", "cudnn_batch_norm_backward",
             "_native_batch_norm_legit", "_native_batch_norm_legit_functional"),
    "optimizer": ("_fused_sgd_", "_foreach_add_", "_foreach_mul_", "_foreach_add", "_foreach_mul",
                  "_foreach_addcmul_", "_foreach_lerp_"),
    # views and allocations move no data: their time is dispatch overhead (the host cost of many small ops)
    "views/alloc": ("view", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "t", "permute", "expand",
                    "unsqueeze", "squeeze", "select", "slice", "narrow", "as_strided", "as_strided_", "alias",
                    "unflatten", "flatten", "split", "detach", "empty", "empty_like", "empty_strided", "resize_"),
    "pool": ("max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward",
             "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "mean"),
}
_CATEGORY_OF = {op: cat for cat, ops in CATEGORIES.items() for op in ops}
ORDER = ("conv", "matmul", "elementwise", "copy/layout", "norm", "pool", "optimizer", "views/alloc", "fused",
         "other")


def is_fused(name: str) -> bool:
    """A kernel of inductor's own code (``--kernel-builder compiled``): a Triton kernel on a GPU,
    a C++ one on a CPU (profiled with ``cpp.enable_kernel_profile``); no aten operator runs it."""
    return name.startswith("triton_") or "cpp_fused" in name


def category(op_name: str) -> str:
    return "fused" if is_fused(op_name) else _CATEGORY_OF.get(op_name.removeprefix("aten::"), "other")


def profile_variants(model, methods, *, batch_size: int, image_size: int = 224, steps: int = 2, warmup: int = 2,
                     num_classes: int = 1000, device: str = "cpu", model_options: dict | None = None,
                     kernel_builder: str = "auto") -> dict:
    """Self time per ``(operator, input shapes)`` and per category, in ms per step, for every variant:
    ``result[variant]`` the host's (CPU) time; on CUDA also ``result[variant]["device"]``, the GPU's.
    With ``kernel_builder="compiled"`` the compiled constructions' kernels count as category "fused"."""
    with _kernel_profiling(kernel_builder):
        return _profile(model, methods, batch_size, image_size, steps, warmup, num_classes, device, model_options,
                        kernel_builder)


def _kernel_profiling(kernel_builder: str):
    """Where the compiled builder runs: inductor's CPU kernels made profiler events (Triton kernels
    always are); a no-op context otherwise."""
    if kernel_builder != "compiled":
        return contextlib.nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch({"cpp.enable_kernel_profile": True})


def _profile(model, methods, batch_size, image_size, steps, warmup, num_classes, device, model_options,
             kernel_builder) -> dict:
    device = torch.device(device)
    torch.manual_seed(0)
    x = torch.randn(batch_size, 3, image_size, image_size, device=device)
    y = torch.randint(0, num_classes, (batch_size,), device=device)
    for spec in methods:
        parse_spec(spec)  # a clear error for a bad spec before anything is built
    try:  # what goes wrong in a build is the spec's or the model's; errors of the profiling keep their traceback
        runners = [make_runner(model, spec, device=device, num_classes=num_classes, model_options=model_options,
                               kernel_builder=kernel_builder) for spec in methods]
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"cannot build the variants {list(methods)} of {getattr(model, '__name__', model)}: "
                        f"{exc}") from None
    for _ in range(max(warmup, 1)):
        for r in runners:
            r.step(x, y)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type != "cuda":
        quiet_cpu_profiler()
    on_gpu = device.type == "cuda"
    ops: dict[str, dict[tuple, list]] = {r.name: defaultdict(lambda: [0.0, 0, 0.0]) for r in runners}
    for _ in range(steps):
        for r in runners:  # interleaved, as orepa bench: load changes hit every variant alike
            with profile(activities=activities, record_shapes=True) as prof:
                r.step(x, y)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            for e in prof.key_averages(group_by_input_shape=True):
                fused = is_fused(e.key)
                if on_gpu and fused and e.device_type != DeviceType.CUDA:
                    continue  # a Triton kernel's launch: the kernel's own event holds its GPU time
                if not (e.key.startswith("aten::") or fused):
                    continue  # autograd nodes and wrappers: their children are counted
                acc = ops[r.name][(e.key, str(e.input_shapes))]
                acc[0] += e.self_cpu_time_total / 1e3 / steps
                acc[1] += e.count / steps
                if on_gpu:  # the name changed in torch 2.4 (self_cuda_time_total before)
                    acc[2] += getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3 / steps
    out = {}
    for name, table in ops.items():
        out[name] = _summary({k: (ms, n) for k, (ms, n, _) in table.items()})
        if on_gpu:
            out[name]["device"] = _summary({k: (ms, n) for k, (_, n, ms) in table.items()})
    return out


def _summary(table: dict[tuple, tuple[float, float]]) -> dict:
    """Per category and per operator (costliest first) from ``{(op, shapes): (ms, calls)}``."""
    cats = dict.fromkeys(ORDER, 0.0)
    for (op, _), (ms, _) in table.items():
        cats[category(op)] += ms
    top = sorted(((ms, n, op, shapes) for (op, shapes), (ms, n) in table.items()), reverse=True)
    return {"categories_ms": cats, "total_ms": sum(cats.values()),
            "ops": [{"op": op, "shapes": shapes, "ms": ms, "calls": n} for ms, n, op, shapes in top]}


def format_report(result: dict, top: int = 20) -> str:
    names = list(result)
    base = result.get("base")
    lines = ["| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for cat in ORDER + ("total",):
        cells = []
        for n in names:
            v = result[n]["total_ms"] if cat == "total" else result[n]["categories_ms"][cat]
            ref = None if base is None or n == "base" else (
                base["total_ms"] if cat == "total" else base["categories_ms"][cat])
            cells.append(f"{v:,.1f}" + ("" if ref is None else f" ({v - ref:+,.1f})"))
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    for n in names:
        if n == "base" and len(names) > 1:
            continue
        lines += ["", f"{n}: top operators by self time (ms per step)", "",
                  "| ms | calls | operator | input shapes |", "|---|---|---|---|"]
        for o in result[n]["ops"][:top]:
            lines.append(f"| {o['ms']:,.1f} | {o['calls']:g} | {o['op']} | {o['shapes'][:110]} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="resnet18")
    ap.add_argument("--methods", nargs="+", default=["base", "orepa"],
                    help="variants as orepa bench takes them: words or comma-separated lists (base orepa, base,orepa)")
    ap.add_argument("-b", "--batch-size", type=positive_int, default=16)
    ap.add_argument("--image-size", type=positive_int, default=224)
    ap.add_argument("--num-classes", type=positive_int, default=1000)
    ap.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                    help="zoo model option for every variant, e.g. width_mult=0.0625 (repeatable), as orepa bench")
    ap.add_argument("--steps", type=positive_int, default=2, help="profiled steps per variant (averaged)")
    ap.add_argument("--warmup", type=nonneg_int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--top", type=positive_int, default=20)
    ap.add_argument("--json", default=None)
    add_kernel_builder_argument(ap)  # with 'compiled', its fused kernels are category 'fused'
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.json:  # before minutes of profiling
        check_output_path(args.json, "--json", report=REPORT)
    args.methods = method_list(args.methods)  # (orepa bench's reading: "base,orepa" is two variants)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = parse_device(args.device)  # (a CUDA device this machine lacks: one line)
    try:
        result = profile_variants(args.model, args.methods, batch_size=args.batch_size, image_size=args.image_size,
                                  steps=args.steps, warmup=args.warmup, num_classes=args.num_classes, device=device,
                                  model_options=parse_options(args.model_option, "--model-option"),
                                  kernel_builder=args.kernel_builder)
    except ValueError as exc:  # as orepa bench says it
        if "Expected more than 1 value per channel" not in str(exc):
            raise
        raise UserError(f"-b {args.batch_size} --image-size {args.image_size}: a training BatchNorm sees one value "
                        "per channel at the network's smallest feature map; use a larger batch or image") from None
    builder = "" if args.kernel_builder == "auto" else f", kernel builder {args.kernel_builder}"
    print(f"{args.model}, batch {args.batch_size}, {args.image_size}x{args.image_size}, {args.device}, "
          f"{torch.get_num_threads()} threads{builder}, self time per train step (ms), mean of {args.steps} "
          "profiled steps\n")
    print(format_report(result, args.top))
    if any("device" in r for r in result.values()):
        print("\nGPU time of the operators' kernels per train step (ms)\n")
        print(format_report({n: r["device"] for n, r in result.items()}, args.top))
    if args.json:  # the 200 costliest operators per variant (the categories count all of them)
        def trimmed(r: dict) -> dict:
            return {**r, "ops": r["ops"][:200], "ops_total": len(r["ops"])}

        saved = {n: {**trimmed(r), **({"device": trimmed(r["device"])} if "device" in r else {})}
                 for n, r in result.items()}
        write_json(args.json, report_of(REPORT, {"config": vars(args), "results": saved}), indent=1)
    return result


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
