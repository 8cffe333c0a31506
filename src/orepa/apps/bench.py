"""``orepa bench``: the training cost of re-param methods, measured side by side.

Every method (a *variant* of one architecture) is built in ONE process and the
measurements interleave the methods round-robin, so machine noise (other jobs,
thermal state, allocator warm-up) hits all of them alike. Per variant:

* ``step_ms``: median train-step time (zero_grad + forward + cross-entropy +
  backward + SGD step) after warm-up; CUDA is synchronised around each step.
  With ``cuda_graphs`` (``--cuda-graphs``) each model's forward and backward are
  replayed as CUDA graphs (``torch.cuda.make_graphed_callables``; loss and SGD step
  stay eager): an online block launches many small kernels to build its weight,
  and on a fast GPU the host's launches, not the GPU, set its eager step time.
  With ``compile`` (``--compile [BACKEND]``) the timed steps run ``torch.compile``'d
  models (compiled after the cost passes, outside the timing), which fuses an online
  block's kernel-space element-wise work and, on GPUs, removes most host launches.
  The ratios also give ``step_paired``: the median over repetitions of the step
  time over base's step in the same round (the steadiest time ratio).
* ``saved_bytes``: bytes of the tensors autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``), counting every storage once
  (views and shared tensors are not double counted); ``saved_naive_bytes`` is
  the plain sum over saved tensors; ``saved_param_bytes`` the part that is
  parameters/buffers (persistent anyway, not extra memory).
* ``peak_bytes``: peak memory of one train step as if the model ran alone:
  its parameters, buffers and optimizer state plus the peak allocated above
  the start of the step. CUDA: ``torch.cuda.max_memory_allocated``; CPU: the
  allocation events of ``torch.profiler`` (``profile_memory=True``), which count
  requested bytes and do not depend on the allocator's caching.
* ``fwd_flops`` / ``train_flops``: ``torch.utils.flop_counter.FlopCounterMode``
  over the forward and over forward + backward, with the backward of grouped
  convolutions counted correctly (:func:`flop_counter`).
* ``train_params`` / ``deploy_params``, ``deploy_flops``, ``infer_ms``: the model
  in training form and after ``orepa.reparameterize(model, fuse_bn=True)``
  (median no-grad forward, interleaved as well), with ``deploy_err`` the
  relative max error of the deployed model against the training form in eval.

Variants (``--methods``): ``base``; any ``orepa.METHODS`` name (``orepa``,
``orepa-offline``, ``dbb``, ``repvgg``, ``orepa-vgg``), built by the model zoo
(``orepa.models.create_model``) for zoo names, else by ``orepa.convert`` on a
torchvision model or a factory; options are appended as ``name:key=value:key=value``
(``orepa:scaling=scalar``, ``orepa:preset=dw-sep``, ``orepa:branches=kxk/1x1``).
The component ladder of Fig. "budgets" / table "components" (``--components``;
the zoo's presets ``online-only``, ``freq-prior``, ``dw-sep``, ``deep-stem``, ``rep-1x1``):

==============  ============================================================
``online``      online OREPA blocks with DBB's branches (kxk, 1x1, 1x1-avg, 1x1-kxk)
``+prior``      + 1x1 -> frequency prior filter
``+dw``         + linear depthwise separable (all six branches)
``+stem``       + linear deep stem (the 7x7 stem as stacked 3x3 OREPA blocks)
``+rep1x1``     + Rep-1x1 on the 1x1 convs (= full OREPA; only with 1x1 convs)
``offline*``    the same rungs run offline with a BN per branch (the prototype of
                Fig. "linearization"); the offline deep stem runs its three 3x3
                convs on the feature map.
==============  ============================================================
"""
from __future__ import annotations

import argparse
import ast
import gc
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import orepa
from orepa.apps.common import capture_cuda_graphs, full_float32, make_sgd, release_cuda_graphs
from orepa.apps.logs import pyplot, save_figure
from orepa.blocks import OREPA_BRANCHES, OREPADeepStem

ModelSpec = str | Callable[[], nn.Module]

DBB_BRANCHES: tuple[str, ...] = ("kxk", "1x1", "1x1_avg", "1x1_kxk")
#: component ladder: rung -> (branches, deep stem, Rep-1x1)
LADDER: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "online": (DBB_BRANCHES, False, False),
    "+prior": (DBB_BRANCHES + ("1x1_prior",), False, False),
    "+dw": (OREPA_BRANCHES, False, False),
    "+stem": (OREPA_BRANCHES, True, False),
    "+rep1x1": (OREPA_BRANCHES, True, True),
}
OFFLINE_PREFIX = "offline"


# --------------------------------------------------------------------------- building variants


def _zoo():
    """``orepa.models.create_model`` when the model zoo is installed, else None."""
    try:
        from orepa.models import create_model
    except ImportError:
        return None
    return create_model


def in_zoo(model: ModelSpec) -> bool:
    """True when ``model`` is a name the model zoo builds (else: a factory or a torchvision name)."""
    if callable(model) or _zoo() is None:
        return False
    from orepa.models import model_family

    try:
        model_family(model)
    except ValueError:
        return False
    return True


def base_model(model: ModelSpec, num_classes: int = 1000, in_chans: int = 3, model_options: dict | None = None
               ) -> nn.Module:
    """The plain network: a factory's model, the zoo's ``base``, or a torchvision model."""
    if callable(model):
        return model()
    if in_zoo(model):
        return _zoo()(model, method="base", num_classes=num_classes, in_chans=in_chans, **(model_options or {}))
    if model_options:
        raise ValueError(f"model options {sorted(model_options)} need a model of the zoo; {model!r} is not one")
    import torchvision

    if in_chans != 3:
        raise ValueError(f"in_chans != 3 needs a model of the zoo (orepa.models); {model!r} is not one")
    try:
        return torchvision.models.get_model(model, weights=None, num_classes=num_classes)
    except ValueError as exc:
        raise ValueError(f"unknown model {model!r}: {exc}") from None


def find_stem(model: nn.Module) -> str | None:
    """Name of the stem conv a deep stem replaces: the first plain kxk (k >= 5) conv->BN, groups 1."""
    pairs, _ = orepa.find_conv_bn_pairs(model)
    paired = {c for c, _ in pairs}
    for name, m in model.named_modules():
        if type(m) is nn.Conv2d and name in paired:
            k = m.kernel_size[0]
            if k >= 5 and k % 2 and m.kernel_size[0] == m.kernel_size[1] and m.groups == 1:
                return name
            return None  # the first conv is not a large-kernel stem
    return None


def has_rep_1x1_targets(model: nn.Module) -> bool:
    """True when the model has 1x1 convs outside shortcut projections (bottlenecks)."""
    return any(type(m) is nn.Conv2d and m.kernel_size == (1, 1) and "downsample" not in name
               for name, m in model.named_modules())


def add_deep_stem(model: nn.Module, *, mode: str = "online", **orepa_options) -> nn.Module:
    """Replace the stem conv of ``model`` (in place) by an :class:`OREPADeepStem`."""
    name = find_stem(model)
    if name is None:
        raise ValueError("the model has no kxk (k >= 5) stem conv followed by a BatchNorm2d")
    conv = model.get_submodule(name)
    stem = OREPADeepStem(conv.in_channels, conv.out_channels, conv.kernel_size[0], conv.stride[0],
                         bias=conv.bias is not None, mode=mode, **orepa_options)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, stem.to(conv.weight.device))
    return model


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"orepa:scaling=scalar:branches=kxk/1x1"`` -> ``("orepa", {...})``."""
    name, *opts = spec.split(":")
    options = {}
    for o in opts:
        if "=" not in o:
            raise ValueError(f"bad option {o!r} in {spec!r}: expected key=value")
        k, v = o.split("=", 1)
        try:
            val = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            val = tuple(v.split("/")) if "/" in v else v
        options[k] = val
    return name, options


def is_ladder(name: str) -> bool:
    rung = name.removeprefix(OFFLINE_PREFIX)
    return name in LADDER or name == OFFLINE_PREFIX or (name.startswith(OFFLINE_PREFIX) and rung in LADDER
                                                       and rung != "online")


def _ladder_rung(name: str) -> tuple[str, str]:
    """``"offline+dw"`` -> ("offline", "+dw"); ``"offline"`` -> ("offline", "online")."""
    if name.startswith(OFFLINE_PREFIX):
        rest = name[len(OFFLINE_PREFIX):]
        return "offline", rest or "online"
    return "online", name


#: ladder rung -> the model zoo's preset of table "components"
LADDER_PRESETS = {"online": "online-only", "+prior": "freq-prior", "+dw": "dw-sep", "+stem": "deep-stem",
                  "+rep1x1": "rep-1x1"}


def _convert_fallback(net: nn.Module, method: str, *, deep_stem: bool, stem_mode: str = "online",
                      **options) -> nn.Module:
    """Without the zoo: like it, keep a large stem conv plain (or make it a deep stem), convert the rest."""
    stem = find_stem(net)
    if deep_stem and stem is not None:
        add_deep_stem(net, mode=stem_mode, **{k: v for k, v in options.items() if k != "rep_1x1"})
    exclude = (lambda n, c: n == stem) if stem is not None else None
    return orepa.convert(net, method, exclude=exclude, **options)


def build_variant(model: ModelSpec, spec: str, num_classes: int = 1000, in_chans: int = 3,
                  model_options: dict | None = None) -> nn.Module:
    """Build one benchmark variant (see the module docstring) in training mode.

    Zoo models (``orepa.models``) are built by ``create_model`` (ladder rungs via its
    table-"components" presets); a factory or a torchvision name by ``orepa.convert``
    with the same conventions (7x7 stem kept plain unless it becomes a deep stem).
    ``model_options`` (zoo only, e.g. ``width_mult``, ``small_input``) go to every variant.
    """
    name, options = parse_spec(spec)
    mopts = dict(model_options or {})
    if name == "base":
        if options:
            raise ValueError("base takes no options")
        return base_model(model, num_classes, in_chans, mopts).train()
    zoo = in_zoo(model)
    if mopts and not zoo:
        raise ValueError(f"model options {sorted(mopts)} need a model of the zoo; {model!r} is not one")
    options = {**mopts, **options}
    if is_ladder(name):
        family, rung = _ladder_rung(name)
        method = "orepa" if family == "online" else "orepa-offline"
        if zoo:
            return _zoo()(model, method=method, num_classes=num_classes, in_chans=in_chans,
                          preset=LADDER_PRESETS[rung], **options).train()
        branches, stem, rep_1x1 = LADDER[rung]
        net = base_model(model, num_classes, in_chans)
        opts = {"branches": branches, **options}
        return _convert_fallback(net, method, deep_stem=stem, stem_mode=family, rep_1x1=rep_1x1, **opts).train()
    if name not in orepa.METHODS:
        known = ["base", *orepa.METHODS, *LADDER, *(OFFLINE_PREFIX + (r if r != "online" else "") for r in LADDER)]
        raise ValueError(f"unknown method {name!r}; choose from {known}")
    if zoo:
        return _zoo()(model, method=name, num_classes=num_classes, in_chans=in_chans, **options).train()
    net = base_model(model, num_classes, in_chans)
    deep_stem = options.pop("deep_stem", name == "orepa")
    if name in ("orepa", "orepa-offline"):  # as the zoo: Rep-1x1 for bottleneck nets only
        options.setdefault("rep_1x1", has_rep_1x1_targets(net))
    return _convert_fallback(net, name, deep_stem=deep_stem, **options).train()


def component_variants(model: ModelSpec, num_classes: int = 1000, in_chans: int = 3,
                       model_options: dict | None = None) -> list[str]:
    """The ladder of Fig. "budgets": base, dbb, then each rung online and offline."""
    net = base_model(model, num_classes, in_chans, model_options)
    rungs = [r for r in LADDER
             if not (r == "+stem" and find_stem(net) is None)
             and not (r == "+rep1x1" and not has_rep_1x1_targets(net))]
    if "+stem" not in rungs and "+rep1x1" in rungs:
        rungs.remove("+rep1x1")  # the ladder is cumulative
    online = rungs
    offline = [OFFLINE_PREFIX + ("" if r == "online" else r) for r in rungs]
    return ["base", "dbb", *online, *offline]


# --------------------------------------------------------------------------- measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr(), s.nbytes())


@dataclass
class SavedTensors:
    """What autograd saved for backward during one forward."""

    unique_bytes: int = 0
    naive_bytes: int = 0
    param_bytes: int = 0
    count: int = 0
    _keys: dict = field(default_factory=dict, repr=False)


def measure_saved(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[SavedTensors, torch.Tensor]:
    """Run forward + loss under ``saved_tensors_hooks``; returns the tally and the loss (graph alive)."""
    st = SavedTensors()
    owned = {_storage_key(t)[:2] for t in [*model.parameters(), *model.buffers()]}

    def pack(t: torch.Tensor):
        st.count += 1
        st.naive_bytes += t.numel() * t.element_size()
        try:
            dev, ptr, nb = _storage_key(t)
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            return t
        if ptr and (dev, ptr) not in st._keys:
            st._keys[(dev, ptr)] = nb
            st.unique_bytes += nb
            if (dev, ptr) in owned:
                st.param_bytes += nb
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), y)
    st._keys.clear()
    return st, loss


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters, buffers and optimizer state: what a model holds between steps."""
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return _nbytes(model.parameters()) + _nbytes(model.buffers()) + _nbytes(state)


def _cpu_peak_above_start(fn: Callable[[], None]) -> int:
    """Peak bytes allocated above the start while ``fn`` runs (CPU, torch.profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        if e.device_type() != torch.autograd.DeviceType.CPU:
            continue
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


@dataclass
class Runner:
    """One variant with its optimizer, ready to take train steps on shared data."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    graphed: bool = False  # forward+backward replayed as CUDA graphs (static input shape)
    compiled: nn.Module | None = None  # torch.compile'd model for the timed steps (same parameters)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        # a graphed backward accumulates into the .grad tensors it was captured with: keep them
        self.opt.zero_grad(set_to_none=not self.graphed)
        loss = F.cross_entropy((self.compiled or self.model)(x), y)
        loss.backward()
        self.opt.step()

    def capture(self, x: torch.Tensor) -> None:
        """Capture forward and backward as CUDA graphs (after the eager warm-up and cost passes)."""
        capture_cuda_graphs(self.model, x, self.opt)
        self.graphed = True

    def compile(self, backend: str) -> None:
        """Time steps through ``torch.compile(model)`` (cost passes measure the eager model:
        the same arithmetic and saved tensors up to the compiler's recomputation choices)."""
        self.compiled = torch.compile(self.model, backend=backend)

    def release(self) -> None:
        """Back to the eager model (before deployment deep-copies it)."""
        self.compiled = None
        if self.graphed:
            release_cuda_graphs(self.model)
            self.graphed = False


def _median_ms(ts: Sequence[float]) -> float:
    return 1e3 * statistics.median(ts)


def _conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                        _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """FLOPs of a convolution's backward: each requested gradient costs the MACs of the forward.

    torch's own formula counts the weight gradient of a grouped convolution ``groups`` times
    (it treats the transposed problem as one ungrouped conv): for OREPA's depthwise (x8) -> pw
    branch run on the feature map that is thousands of times its real cost. Equal to torch's
    formula for ungrouped convolutions.
    """
    from torch.utils.flop_counter import conv_flop_count

    fwd = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), bool(transposed))
    return fwd * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def flop_counter():
    """``FlopCounterMode`` with the grouped-convolution backward counted correctly."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: _conv_backward_flop})


def _flops_forward(model: nn.Module, x: torch.Tensor) -> int:
    with flop_counter() as fc:
        model(x)
    return int(fc.get_total_flops())


def measure_variant_costs(r: Runner, x, y, device: torch.device, profile_memory: bool = True) -> dict:
    """Saved bytes, FLOPs and peak memory of one variant (untimed passes)."""
    out: dict = {}
    r.opt.zero_grad(set_to_none=True)
    with flop_counter() as fwd:
        st, loss = measure_saved(r.model, x, y)
    with flop_counter() as bwd:
        loss.backward()
    del loss
    out.update(saved_bytes=st.unique_bytes, saved_naive_bytes=st.naive_bytes, saved_param_bytes=st.param_bytes,
               saved_tensors=st.count, fwd_flops=int(fwd.get_total_flops()),
               train_flops=int(fwd.get_total_flops() + bwd.get_total_flops()))
    r.opt.zero_grad(set_to_none=True)
    state = _state_bytes(r.model, r.opt)
    if device.type == "cuda":
        _sync(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        r.step(x, y)
        _sync(device)
        above = torch.cuda.max_memory_allocated(device) - start
        out.update(peak_bytes=state + above, peak_step_bytes=above, peak_source="torch.cuda.max_memory_allocated")
    elif profile_memory:
        above = _cpu_peak_above_start(lambda: r.step(x, y))
        out.update(peak_bytes=state + above, peak_step_bytes=above, peak_source="torch.profiler memory events")
    else:
        out.update(peak_bytes=None, peak_step_bytes=None, peak_source="n/a")
    out["state_bytes"] = state
    r.opt.zero_grad(set_to_none=True)
    return out


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_runner(model: ModelSpec, spec: str, *, device, num_classes: int = 1000, in_chans: int = 3,
                model_options: dict | None = None, lr: float = 1e-3, seed: int = 0) -> Runner:
    """One variant built from ``seed``, in training mode, with the harness's optimizer
    (fused SGD, momentum 0.9, weight decay 1e-4)."""
    torch.manual_seed(seed)
    net = build_variant(model, spec, num_classes, in_chans, model_options).to(device).train()
    return Runner(spec, net, make_sgd(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4))


def run_benchmark(
    model: ModelSpec,
    methods: Sequence[str],
    *,
    batch_size: int = 16,
    image_size: int = 224,
    device: str | torch.device = "cpu",
    reps: int = 5,
    warmup: int = 2,
    num_classes: int = 1000,
    in_chans: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
    inference: bool = True,
    profile_memory: bool = True,
    model_options: dict | None = None,
    cuda_graphs: bool = False,
    compile: str | None = None,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Measure every variant of ``model`` side by side; returns a JSON-able dict.

    ``compile``: a ``torch.compile`` backend (e.g. ``"inductor"``) for the timed steps.
    """
    log = log or (lambda s: None)
    device = torch.device(device)
    if cuda_graphs and compile:
        raise ValueError("cuda_graphs and compile exclude each other (torch.compile's mode='reduce-overhead' "
                         "is its own CUDA-graph path)")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs needs a CUDA device (got {device})")
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    git_start = _git_state()  # the code this process loaded (files edited during a run do not count)
    methods = list(dict.fromkeys(methods))
    if "base" not in methods:
        methods.insert(0, "base")
    torch.manual_seed(seed)
    x = torch.randn(batch_size, in_chans, image_size, image_size, device=device)
    y = torch.randint(0, num_classes, (batch_size,), device=device)

    runners: list[Runner] = []
    res: dict[str, dict] = {}
    for spec in methods:
        runners.append(make_runner(model, spec, device=device, num_classes=num_classes, in_chans=in_chans,
                                   model_options=model_options, lr=lr, seed=seed))
        res[spec] = {"train_params": _n_params(runners[-1].model)}
        log(f"built {spec}: {res[spec]['train_params']:,} params")

    log(f"warm-up: {warmup} step(s) per variant")
    for _ in range(max(warmup, 1)):  # one step at least: the optimizer state exists before measuring
        for r in runners:
            r.step(x, y)
    _sync(device)

    for r in runners:
        res[r.name].update(measure_variant_costs(r, x, y, device, profile_memory))
        log(f"costs {r.name}: saved {res[r.name]['saved_bytes'] / 2**20:.1f} MiB, "
            f"{res[r.name]['train_flops'] / 1e9:.2f} GFLOPs")

    if cuda_graphs:
        for r in runners:
            r.capture(x)
            r.step(x, y)  # first replay outside the timing
        _sync(device)
        log("captured forward+backward of every variant as CUDA graphs")
    if compile:
        for r in runners:
            t0 = time.perf_counter()
            r.compile(compile)
            for _ in range(max(warmup, 1)):  # the first call compiles; warm the compiled code too
                r.step(x, y)
            _sync(device)
            res[r.name]["compile_s"] = time.perf_counter() - t0
            log(f"compiled {r.name} ({compile}): {res[r.name]['compile_s']:.0f} s")

    times: dict[str, list[float]] = {r.name: [] for r in runners}
    gc.collect()
    for rep in range(reps):
        order = runners[rep % len(runners):] + runners[:rep % len(runners)]  # round robin
        for r in order:
            _sync(device)
            t0 = time.perf_counter()
            r.step(x, y)
            _sync(device)
            times[r.name].append(time.perf_counter() - t0)
        log(f"rep {rep + 1}/{reps}: " + ", ".join(f"{n} {1e3 * t[-1]:.0f} ms" for n, t in times.items()))
    for name, ts in times.items():
        res[name].update(step_ms=_median_ms(ts) if ts else None, step_times_s=ts)
    for r in runners:
        r.release()

    # deployed form: every variant reparameterized with BNs folded
    deployed: dict[str, nn.Module] = {}
    with torch.no_grad(), full_float32():
        for r in runners:
            r.model.eval()
            ref = r.model(x)
            d = orepa.reparameterize(r.model, fuse_bn=True).eval()
            err = (d(x) - ref).abs().max().item() / (1.0 + ref.abs().max().item())
            deployed[r.name] = d
            res[r.name].update(deploy_params=_n_params(d), deploy_flops=_flops_forward(d, x), deploy_err=err)
            r.model.train()
    inf_times: dict[str, list[float]] = {n: [] for n in deployed}
    if inference:
        with torch.inference_mode():
            for d in deployed.values():
                d(x)
            for rep in range(reps):
                names = list(deployed)
                names = names[rep % len(names):] + names[:rep % len(names)]
                for n in names:
                    _sync(device)
                    t0 = time.perf_counter()
                    deployed[n](x)
                    _sync(device)
                    inf_times[n].append(time.perf_counter() - t0)
    for n, ts in inf_times.items():
        res[n].update(infer_ms=_median_ms(ts) if ts else None, infer_times_s=ts)

    result = {
        "config": {
            "model": model if isinstance(model, str) else getattr(model, "__name__", "custom"),
            "methods": methods, "batch_size": batch_size, "image_size": image_size, "in_chans": in_chans,
            "num_classes": num_classes, "model_options": model_options or {}, "reps": reps, "warmup": warmup,
            "lr": lr, "seed": seed, "dtype": "float32", "cuda_graphs": cuda_graphs, "compile": compile,
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if device.type == "cuda" else None,
        },
        "environment": {**environment(device, git_start), "loadavg_1m_start": load_start},
        "results": res,
    }
    result["ratios"] = ratios(res)
    return result


RATIO_KEYS = ("step_ms", "step_min_ms", "saved_bytes", "saved_act_bytes", "saved_naive_bytes", "peak_bytes", "train_flops",
              "train_params", "deploy_params", "deploy_flops", "infer_ms", "infer_min_ms")


def ratios(res: dict[str, dict], base: str = "base") -> dict[str, dict]:
    for r in res.values():  # derived: saved for backward that is not a parameter/buffer storage
        if r.get("saved_bytes") is not None and r.get("saved_param_bytes") is not None:
            r["saved_act_bytes"] = r["saved_bytes"] - r["saved_param_bytes"]
        # best of the repetitions: contention only ever adds time, so on a loaded machine the
        # minimum is the steadier estimate; the median is the figure the issue asks for
        for key, times in (("step_min_ms", "step_times_s"), ("infer_min_ms", "infer_times_s")):
            if r.get(times):
                r[key] = 1e3 * min(r[times])
    out = {}
    b = res[base]
    for name, r in res.items():
        out[name] = {}
        for k in RATIO_KEYS:
            v, bv = r.get(k), b.get(k)
            out[name][k] = (v / bv) if (v is not None and bv) else None
        # paired: the median over repetitions of (this variant's step / base's step in the same
        # round); a slow phase of the machine hits both steps of a round, so it cancels
        t, bt = r.get("step_times_s"), b.get("step_times_s")
        out[name]["step_paired"] = (statistics.median(a / c for a, c in zip(t, bt))
                                    if t and bt and len(t) == len(bt) else None)
    return out


def environment(device: torch.device, git: dict | None) -> dict:
    """Machine and software facts of a run; ``git`` is the checkout's state read when the run started."""
    env = {
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "device": str(device), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "orepa_models_zoo": _zoo() is not None,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        env["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    env["git"] = git
    return env


def _git_state() -> dict | None:
    """Commit and modified files of the orepa checkout (tables depend on the core code's state)."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "src/orepa"], check=False,
                               cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    if not commit:
        return None
    return {"commit": commit, "modified": [ln[3:] for ln in dirty if ln.strip()]}


# --------------------------------------------------------------------------- output


def _fmt(v, scale=1.0, nd=1) -> str:
    return "n/a" if v is None else f"{v / scale:,.{nd}f}"


def _rx(v) -> str:
    return "" if v is None else f" ({v:.2f}x)"


def format_table(result: dict) -> str:
    """A Markdown table: absolute values with ratios to base."""
    res, rat = result["results"], result["ratios"]
    cols = ["method", "train step ms (median)", "(min)", "(paired)", "saved MiB (unique)", "saved excl. params", "saved MiB (naive)", "peak MiB",
            "train GFLOPs",
            "train params M", "deploy params M", "deploy GFLOPs", "infer ms", "deploy err"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for n, r in res.items():
        q = rat[n]
        row = [
            n,
            _fmt(r.get("step_ms"), 1, 0) + _rx(q["step_ms"]),
            _fmt(r.get("step_min_ms"), 1, 0) + _rx(q["step_min_ms"]),
            "n/a" if q.get("step_paired") is None else f"{q['step_paired']:.2f}x",
            _fmt(r.get("saved_bytes"), 2**20) + _rx(q["saved_bytes"]),
            _fmt(r.get("saved_act_bytes"), 2**20) + _rx(q["saved_act_bytes"]),
            _fmt(r.get("saved_naive_bytes"), 2**20) + _rx(q["saved_naive_bytes"]),
            _fmt(r.get("peak_bytes"), 2**20, 0) + _rx(q["peak_bytes"]),
            _fmt(r.get("train_flops"), 1e9, 2) + _rx(q["train_flops"]),
            _fmt(r.get("train_params"), 1e6, 2) + _rx(q["train_params"]),
            _fmt(r.get("deploy_params"), 1e6, 2),
            _fmt(r.get("deploy_flops"), 1e9, 2) + _rx(q["deploy_flops"]),
            _fmt(r.get("infer_ms"), 1, 0) + _rx(q["infer_ms"]),
            "n/a" if r.get("deploy_err") is None else f"{r['deploy_err']:.1e}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_header(result: dict) -> str:
    c, e = result["config"], result["environment"]
    dev = e.get("gpu", e["device"])
    git = e.get("git") or {}
    code = f"; orepa {git['commit']}{'+modified' if git.get('modified') else ''}" if git.get("commit") else ""
    graphs = ", forward+backward as CUDA graphs" if c.get("cuda_graphs") else ""
    graphs += f", torch.compile ({c['compile']})" if c.get("compile") else ""
    return (f"{c['model']}, batch {c['batch_size']}, {c['image_size']}x{c['image_size']}, {dev}, "
            f"{e['threads']} threads, torch {e['torch']}, median of {c['reps']} interleaved steps "
            f"after {c['warmup']} warm-up{graphs}; load avg {e.get('loadavg_1m', float('nan')):.2f}{code}")


def plot_ratios(result: dict, path: str | Path) -> Path:
    """Bar charts of the cost ratios to base, one panel per metric."""
    plt = pyplot()

    rat = result["ratios"]
    names = list(rat)
    metrics = [("step_ms", "train step time"), ("saved_bytes", "saved for backward"),
               ("peak_bytes", "peak memory"), ("train_flops", "train FLOPs"), ("infer_ms", "deployed inference")]
    metrics = [(k, t) for k, t in metrics if any(rat[n][k] is not None for n in names)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.6), squeeze=False)
    for ax, (k, title) in zip(axes[0], metrics):
        vals = [rat[n][k] or 0.0 for n in names]
        bars = ax.bar(range(len(names)), vals, color=["0.6" if n == "base" else "C0" for n in names])
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("x base")
    fig.suptitle(format_header(result), fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def plot_budgets(result: dict, path: str | Path) -> Path:
    """Fig. "budgets": memory and time as components are added, online vs offline."""
    plt = pyplot()

    res = result["results"]
    rungs = [r for r in LADDER if r in res]
    off = {r: OFFLINE_PREFIX + ("" if r == "online" else r) for r in rungs}
    mem_key = "peak_bytes" if all(res[n].get("peak_bytes") for n in res) else "saved_bytes"
    panels = [(mem_key, 2**20, "peak memory (MiB)" if mem_key == "peak_bytes" else "saved for backward (MiB)"),
              ("saved_bytes", 2**20, "saved for backward (MiB)") if mem_key == "peak_bytes" else None,
              ("step_ms", 1.0, "train step (ms)")]
    panels = [p for p in panels if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    xs = range(len(rungs))
    for ax, (k, s, label) in zip(axes[0], panels):
        on = [(res[r].get(k) or 0) / s for r in rungs]
        of = [(res[off[r]].get(k) or 0) / s if off[r] in res else 0.0 for r in rungs]
        w = 0.38
        b1 = ax.bar([i - w / 2 for i in xs], on, w, label="online (OREPA)", color="C0")
        b2 = ax.bar([i + w / 2 for i in xs], of, w, label="offline (BN per branch)", color="C3")
        for bars in (b1, b2):
            for b in bars:
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{b.get_height():.0f}", ha="center",
                        va="bottom", fontsize=6)
        ax.axhline((res["base"].get(k) or 0) / s, color="k", ls="--", lw=0.9, label="base")
        if "dbb" in res:
            ax.axhline((res["dbb"].get(k) or 0) / s, color="C1", ls=":", lw=1.2, label="DBB")
        ax.set_xticks(list(xs), rungs)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("cost as components are added: " + format_header(result), fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def save(result: dict, out_dir: str | Path, tag: str, plots: bool = True) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / f"{tag}.json"]
    files[0].write_text(json.dumps(result, indent=1))
    (out_dir / f"{tag}.md").write_text(format_header(result) + "\n\n" + format_table(result) + "\n")
    files.append(out_dir / f"{tag}.md")
    if plots:
        files.append(plot_ratios(result, out_dir / f"{tag}_ratios.png"))
        if any(n in LADDER for n in result["results"]):
            files.append(plot_budgets(result, out_dir / f"{tag}_budgets.png"))
    return files


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="resnet18", help="model name (model zoo or torchvision)")
    p.add_argument("--methods", nargs="+", default=["base", "dbb", "orepa"],
                   help="variants: base, orepa, orepa-offline, dbb, repvgg, orepa-vgg, ladder rungs "
                        f"({', '.join(LADDER)}, offline, offline+prior, ...); options as name:key=value; "
                        "comma-separated lists are accepted")
    p.add_argument("--components", action="store_true",
                   help="the component ladder of Fig. 'budgets' (base, dbb, each rung online and offline)")
    p.add_argument("-b", "--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--reps", type=int, default=5, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="zoo model option for every variant, e.g. width_mult=0.5 or small_input=True (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="SGD lr (momentum 0.9, wd 1e-4); cost does not depend on it, small keeps random-data steps finite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-inference", action="store_true", help="skip deployed inference timing")
    p.add_argument("--no-memory-profile", action="store_true", help="CPU: skip the profiler peak-memory pass")
    p.add_argument("--cudnn-benchmark", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: time steps with forward+backward replayed as CUDA graphs (no host launch overhead)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="time steps of torch.compile'd models (default backend inductor; compiled outside the timing)")
    p.add_argument("--out-dir", default="bench_results")
    p.add_argument("--tag", default=None, help="output file stem (default from the settings)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="re-render the table and plots of a saved result (no measurement)")


def _methods(args) -> list[str]:
    out = []
    for m in args.methods:
        out += m.split(",") if ":" not in m else [m]
    return [m for m in out if m]


def rerender(path: str | Path, plots: bool = True) -> tuple[dict, list[Path]]:
    """Recompute ratios, table and plots of a saved result JSON (next to it)."""
    path = Path(path)
    result = json.loads(path.read_text())
    result["ratios"] = ratios(result["results"])
    return result, save(result, path.parent, path.stem, plots=plots)


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        result, files = rerender(args.from_json, plots=not args.no_plot)
        print(format_header(result) + "\n\n" + format_table(result))
        print("\nwrote " + ", ".join(str(f) for f in files))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    mopts = parse_spec("x:" + ":".join(args.model_option))[1] if args.model_option else {}
    methods = component_variants(args.model, args.num_classes, 3, mopts) if args.components else _methods(args)
    result = run_benchmark(
        args.model, methods, batch_size=args.batch_size, image_size=args.image_size, device=device,
        reps=args.reps, warmup=args.warmup, num_classes=args.num_classes, lr=args.lr, seed=args.seed,
        inference=not args.no_inference, profile_memory=not args.no_memory_profile, model_options=mopts,
        cuda_graphs=args.cuda_graphs, compile=args.compile,
    )
    dev = "cuda" if str(device).startswith("cuda") else "cpu"
    tag = args.tag or (f"{args.model}_b{args.batch_size}_{args.image_size}_{dev}"
                       + ("_graphs" if args.cuda_graphs else "") + ("_compiled" if args.compile else "")
                       + ("_components" if args.components else ""))
    print()
    print(format_header(result))
    print()
    print(format_table(result))
    files = save(result, args.out_dir, tag, plots=not args.no_plot)
    print("\nwrote " + ", ".join(str(f) for f in files))
    diverged = [n for n, r in result["results"].items() if not math.isfinite(r["deploy_err"])]
    off = [n for n, r in result["results"].items() if math.isfinite(r["deploy_err"]) and r["deploy_err"] > 1e-3]
    if diverged:
        print(f"note: non-finite outputs for {diverged}: the random-data steps diverged (lower --lr); "
              "costs are unaffected")
    if off:
        print(f"WARNING: deployed model differs from the training form for {off}")
    return 0
