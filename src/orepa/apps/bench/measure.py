"""Measuring the training cost of benchmark variants, side by side.

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
* ``aten_ops``: aten operators one train step dispatches (counted with a
  ``TorchDispatchMode``; deterministic on any machine). On a fast GPU each costs the
  host ~10-20 us, so this, not FLOPs, bounds an eager online block's step time there.
* ``saved_bytes``: bytes of the tensors autograd saves for backward (read off the
  graph's nodes after the forward), counting every storage once
  (views and shared tensors are not double counted); ``saved_naive_bytes`` is
  the plain sum over saved tensors; ``saved_param_bytes`` the part that is
  parameters/buffers (persistent anyway, not extra memory).
* ``peak_bytes``: peak memory of one train step as if the model ran alone:
  its parameters, buffers and optimizer state plus the peak allocated above
  the start of the step. CUDA: ``torch.cuda.max_memory_allocated``; CPU: the
  allocation events of ``torch.profiler`` (``profile_memory=True``), which count
  requested bytes and do not depend on the allocator's caching.
* ``compiled_launches`` (``compile="inductor"``): the launches of inductor's code per train step,
  forward and backward: its own fused kernels, the calls it leaves to libraries
  (``extern_kernels``: products, convolutions) and to aten (:func:`compiled_launches`); a
  compiled model dispatches no aten operators to count, these are its host cost on a GPU.
* ``fwd_flops`` / ``train_flops``: ``torch.utils.flop_counter.FlopCounterMode``
  over the forward and over forward + backward, with the backward of grouped
  convolutions counted correctly (:func:`flop_counter`).
* ``train_params`` / ``deploy_params``, ``deploy_flops``, ``infer_ms``: the model
  in training form and after ``orepa.reparameterize(model, fuse_bn=True)``
  (median no-grad forward, interleaved as well), with ``deploy_err`` the
  relative max error of the deployed model against the training form in eval.

Variants are built by :mod:`orepa.apps.bench.variants`; tables and plots are
:mod:`orepa.apps.bench.report`.
"""
from __future__ import annotations

import gc
import math
import os
import platform
import re
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import orepa
from orepa.apps.common import (
    capture_cuda_graphs,
    count_params,
    default_pack,
    full_float32,
    make_sgd,
    release_cuda_graphs,
)
from orepa.engine import arena_bytes, group_kernels, kernel_groups, recorded_bytes

from .report import ratios
from .variants import ModelSpec, build_variant, split_run_options

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
    """Run forward + loss and tally what the graph keeps for backward; returns the tally and the
    loss (graph alive).

    The saved tensors are read off the graph's nodes, not caught with ``saved_tensors_hooks``:
    under such hooks (checkpointing, offloading) online blocks take the per-block route
    (``orepa.engine``), so hooks would measure that route whatever the model runs. (A graph with
    checkpointed regions would recompute them when read: not for such models.)"""
    loss = F.cross_entropy(model(x), y)
    return tally_saved(model, loss), loss


def tally_saved(model: nn.Module, loss: torch.Tensor) -> SavedTensors:
    """What the autograd graph under ``loss`` keeps for backward (see :func:`measure_saved`)."""
    st = SavedTensors()
    owned = {_storage_key(t)[:2] for t in [*model.parameters(), *model.buffers()]}
    for t in _saved_in_graph(loss.grad_fn):
        st.count += 1
        st.naive_bytes += t.numel() * t.element_size()
        try:
            dev, ptr, nb = _storage_key(t)
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            continue
        if ptr and (dev, ptr) not in st._keys:
            st._keys[(dev, ptr)] = nb
            st.unique_bytes += nb
            if (dev, ptr) in owned:
                st.param_bytes += nb
    st._keys.clear()
    return st


def _saved_in_graph(root) -> Iterator[torch.Tensor]:
    """Every tensor the autograd graph under ``root`` keeps for backward: each node's ``_saved_*``
    values, and a custom Function's ``saved_tensors``."""
    seen, todo = set(), [root]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if isinstance(fn, torch.autograd.function.BackwardCFunction):
            yield from fn.saved_tensors
        else:
            for name in dir(fn):
                if name.startswith("_saved_"):
                    v = getattr(fn, name)
                    if torch.is_tensor(v):
                        yield v
                    elif isinstance(v, (tuple, list)):
                        yield from (t for t in v if torch.is_tensor(t))
        todo.extend(f for f, _ in fn.next_functions)


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters, buffers and optimizer state: what a model holds between steps."""
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return _nbytes(model.parameters()) + _nbytes(model.buffers()) + _nbytes(state)


def quiet_cpu_profiler() -> None:
    """Hush kineto (torch.profiler's backend) for CPU-only profiles: it logs a line at each profile's
    start and stop and, with a CUDA build on a machine without a GPU, an ERROR that it found none,
    noise between a bench's lines. Read at the first profile of the process; a KINETO_LOG_LEVEL the
    user set wins. (CUDA profiles keep kineto's messages: there a CUPTI error means something.)"""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def _cpu_peak_above_start(fn: Callable[[], None]) -> int:
    """Peak bytes allocated above the start while ``fn`` runs (CPU, torch.profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    quiet_cpu_profiler()
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
    kernel_builder: str = "auto"  # the policy its online blocks were grouped with
    packed: bool = False  # its groups' parameters packed (engine.KernelGroup.pack)
    graphed: bool = False  # forward+backward replayed as CUDA graphs (static input shape)
    kernel_graphs: bool = False  # its groups' builds recorded as CUDA graphs (engine.GraphedBuild)
    compiled: nn.Module | None = None  # torch.compile'd model for the timed steps (same parameters)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)  # see capture_cuda_graphs: never zeros under graphs
        # not `compiled or model`: torch.compile's wrapper defines __len__ (raising for non-sequences)
        model = self.compiled if self.compiled is not None else self.model
        loss = F.cross_entropy(model(x), y)
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
    """FLOPs of a convolution's backward: each requested gradient costs the forward's FLOPs.

    torch's own formula counts the weight gradient of a grouped convolution ``groups`` times
    (it treats the transposed problem as one ungrouped conv): for OREPA's depthwise (x8) -> pw
    branch run on the feature map that is thousands of times its real cost. Equal to torch's
    formula for ungrouped convolutions.
    """
    from torch.utils.flop_counter import conv_flop_count

    fwd = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), bool(transposed))
    return fwd * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


# FLOPs of the matrix products torch's registry has no formula for (2 FLOPs per multiply-add, as it counts)
def _addmm_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``self + a @ b``, ``[m, k] @ [k, n]``."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def _baddbmm_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``self + a @ b`` per batch, ``[B, m, k] @ [B, k, n]`` (``addbmm``: the same products, summed)."""
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[-1]


def _mv_flop(a_shape, x_shape, *args, out_shape=None, **kwargs) -> int:
    """``a @ x``, ``[m, n] @ [n]``."""
    return 2 * a_shape[0] * a_shape[1]


def _addmv_flop(self_shape, a_shape, x_shape, *args, out_shape=None, **kwargs) -> int:
    return _mv_flop(a_shape, x_shape)


def _dot_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0]


def _products_torch_leaves_out() -> dict:
    """Matrix products torch's FLOP registry has no formula for: the in-place ``baddbmm_`` /
    ``addmm_`` / ``addbmm_`` (its formulas are keyed by the out-of-place operators), ``addbmm``,
    matrix-vector and dot products. The engine squeezes an online block's filter family (avg,
    prior) with ``baddbmm_`` and takes a depthwise two-step branch's vjp with ``mv``: uncounted,
    the train FLOPs of those routes missed those products."""
    aten = torch.ops.aten
    return {aten.baddbmm_: _baddbmm_flop, aten.addbmm: _baddbmm_flop, aten.addbmm_: _baddbmm_flop,
            aten.addmm_: _addmm_flop, aten.mv: _mv_flop, aten.addmv: _addmv_flop, aten.addmv_: _addmv_flop,
            aten.dot: _dot_flop, aten.vdot: _dot_flop}


def flop_counter():
    """``FlopCounterMode`` counting every convolution and matrix product: the grouped-convolution
    backward counted correctly (:func:`_conv_backward_flop`), and the products torch's registry
    leaves out counted (:func:`_products_torch_leaves_out`)."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: _conv_backward_flop,
                                                          **_products_torch_leaves_out()})


# operators that neither compute nor copy (no kernel launch on a GPU) without being views in their schema
_NO_KERNEL = frozenset(("_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                        "_record_function_enter_new", "_record_function_exit"))


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> tuple[int, int]:
    """``(dispatched, kernels)``: the aten operators ``fn()`` dispatches, and those of them that
    compute or copy (a kernel launch each on a GPU; views, aliases and allocations launch none)."""
    with _OpCounter() as counter:
        fn()
    return counter.count, counter.kernels


class UnreplayedRecorder:
    """A stand-in for ``orepa.engine.CudaGraphRecorder`` on any device, for counting what the host
    issues in a step whose kernel builds are recorded (:func:`record_builds`): it records by
    running the construction once and replays nothing, as a CUDA graph's replay dispatches no
    operator. The kernels are then whatever the recordings' shared output buffer holds
    (``engine.RecordingBuffer``): for counting and timing the host, never for training."""

    def __init__(self, device):
        self.device = device

    @staticmethod
    def supports(t: torch.Tensor) -> bool:
        return True

    def warm(self, fn) -> None:
        fn()

    def record(self, fn) -> tuple:
        return (lambda: None), fn()

    def pool_bytes(self) -> int:
        return 0  # its outputs are ordinary tensors


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages allocated under it (an op's output whose storage is none of its
    inputs'), each alive while a Python tensor of that storage is; ``peak``: their most at once."""

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
                continue  # a view of, or a write into, memory from outside
            if ptr not in self.refs:
                self.refs[ptr] = 0
                self.sizes[ptr] = t.untyped_storage().nbytes()
                self.live += self.sizes[ptr]
                self.peak = max(self.peak, self.live)
            self.refs[ptr] += 1
            weakref.finalize(t, self._drop, ptr)
        return out


class PoolEstimator(UnreplayedRecorder):
    """A stand-in recorder whose captures are followed by one :class:`LiveBytes` (``live``; a
    network has one recorder per device, ``engine.Workspace.recorder``, as its CUDA graphs share one
    pool): its ``peak`` is the least size of the pool those captures would need (without the
    allocator's rounding). Its replays do nothing."""

    def __init__(self, device):
        super().__init__(device)
        self.live = LiveBytes()

    def record(self, fn) -> tuple:
        with self.live:
            outputs = fn()
        return (lambda: None), outputs


def record_builds(model: nn.Module, recorder: type = UnreplayedRecorder) -> None:
    """Make ``model``'s kernel groups record their builds with ``recorder`` (by default one that
    never replays, to count a recorded step's host operators: :class:`UnreplayedRecorder`)."""
    for group in kernel_groups(model):
        group.graphs, group.graph_recorder = True, recorder


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
    out["aten_ops"], out["aten_kernels"] = count_ops(lambda: r.step(x, y))
    # the peak step starts as every step after the first does but without the gradients the step before
    # left, which its zero_grad frees: read with them, the start was short of the peak by their bytes
    # (CUDA), and the profiler counted their frees at the sizes an earlier variant's profile had seen at
    # those addresses (CPU: a variant's peak depended on the variants measured before it)
    r.opt.zero_grad(set_to_none=True)
    gc.collect()
    state = _state_bytes(r.model, r.opt)
    # eager builds' arenas that stay allocated between steps (a CPU's) are held memory, as the state is
    state += arena_bytes(r.model)
    if device.type == "cuda":
        _sync(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        r.step(x, y)
        _sync(device)
        above = torch.cuda.max_memory_allocated(device) - start
        # recorded kernel builds hold their graphs' memory from step to step, so it is not above the start
        held = recorded_bytes(r.model) if r.kernel_graphs else 0
        out.update(peak_bytes=state + held + above, peak_step_bytes=above, kernel_graph_bytes=held,
                   peak_source="torch.cuda.max_memory_allocated")
    elif profile_memory:
        above = _cpu_peak_above_start(lambda: r.step(x, y))
        out.update(peak_bytes=state + above, peak_step_bytes=above, peak_source="torch.profiler memory events")
    else:
        out.update(peak_bytes=None, peak_step_bytes=None, peak_source="n/a")
    out["state_bytes"] = state
    r.opt.zero_grad(set_to_none=True)
    return out


def make_runner(model: ModelSpec, spec: str, *, device, num_classes: int = 1000, in_chans: int = 3,
                model_options: dict | None = None, lr: float = 1e-3, seed: int = 0,
                kernel_builder: str = "auto", pack: bool | None = None, compiled_step: bool = False) -> Runner:
    """One variant built from ``seed``, in training mode, with the harness's optimizer
    (fused SGD, momentum 0.9, weight decay 1e-4). ``kernel_builder``: the policy of
    :func:`orepa.engine.group_kernels` ("grouped" runs the GPU route anywhere), unless the spec
    names its own (``orepa:builder=compiled``); ``pack``: whether its groups pack their parameters
    (``orepa:pack=false``; None: where they build the kernels, as ``orepa train`` does, unless the
    timed steps are ``compiled_step`` s, torch.compile'd); ``orepa:joint=false``: a node per group
    instead of one for the network (``group_kernels``' ``joint``); ``orepa:graphs=true``: the groups'
    builds recorded as CUDA graphs (``group_kernels``' ``graphs``; eager steps only). Compiled steps
    build the groups' kernels inside the graph (``group_kernels``' ``traced``)."""
    torch.manual_seed(seed)
    network, builder, switches = split_run_options(spec, kernel_builder)
    pack = switches.get("pack", pack)
    if pack is None:
        pack = default_pack(builder, torch.device(device), compiled_step)
    net = build_variant(model, network, num_classes, in_chans, model_options).to(device).train()
    graphs = switches.get("graphs", False)
    if graphs and torch.device(device).type != "cuda":
        raise ValueError(f"--methods {spec}: graphs=true records the kernel construction as CUDA graphs, "
                         f"which needs a CUDA device, got {device}")
    groups = group_kernels(net, builder, pack=pack, joint=switches.get("joint", True), graphs=graphs,
                           traced=compiled_step)
    packed = any(g.packed is not None for g in groups)
    return Runner(spec, net, make_sgd(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4), builder, packed,
                  kernel_graphs=graphs)


def variant_specs(methods: Sequence[str]) -> list[str]:
    """The variants a run measures: each spec once, in order, ``base`` (the ratios' reference) first
    where ``methods`` lacks it."""
    specs = list(dict.fromkeys(methods))
    if "base" not in specs:
        specs.insert(0, "base")
    return specs


_LAUNCH = re.compile(r"^\s+(?:[\w, ]+ = )?(extern_kernels\.\w+|torch\.ops\.aten\.\w+\.\w+|aten\.\w+\.\w+|"
                     r"cpp_fused_\w+|triton_\w+)(?:\.run)?\(", re.M)


@contextmanager
def inductor_code() -> Iterator[list[str]]:
    """The source of every module inductor generates (or takes from its cache) inside the block, in
    order: what ``torch._inductor.utils.run_and_get_code`` collects, without the ``torch._dynamo.reset()``
    it starts with, which would drop every model compiled before (their next calls compiling again)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield codes


def compiled_launches(codes: Sequence[str]) -> dict:
    """The launches of inductor's generated modules (the sources :func:`inductor_code` collects: one
    forward, one backward): per module the calls its ``call()`` makes, as ``fused`` (its
    own C++ or Triton kernels), ``extern`` (library calls: products, convolutions) and ``aten``
    (fallbacks, e.g. the convolutions' backward), and ``by_name`` for the extern and aten ones;
    ``total``: their sum over the modules. The modules of torch.compile's default mode: with
    ``mode="reduce-overhead"`` (CUDA graphs) the kernels are called from graph partitions, not from
    ``call()``, and are not counted."""
    out, total = {}, 0
    for i, code in enumerate(codes):
        phase = ("forward", "backward")[i] if len(codes) == 2 else f"module {i}"
        kinds, by_name = {"fused": 0, "extern": 0, "aten": 0}, {}
        for name in _LAUNCH.findall(code[code.find("def call("):]):
            kind = ("fused" if name.startswith(("cpp_fused_", "triton_")) else
                    "extern" if name.startswith("extern_kernels.") else "aten")
            kinds[kind] += 1
            if kind != "fused":
                key = name.split(".")[1] if kind == "extern" else name.split(".")[-2]
                by_name[key] = by_name.get(key, 0) + 1
        out[phase] = {**kinds, "by_name": by_name}
        total += sum(kinds.values())
    out["total"] = total
    return out


def check_step_modes(device: torch.device, cuda_graphs: bool, compile: str | None,
                     runners: Sequence[Runner] = ()) -> None:
    """How the timed steps run: a ValueError for a combination that cannot (with ``runners``: also
    for the variants it excludes)."""
    recorded = [r.name for r in runners if r.kernel_graphs]
    if recorded and (cuda_graphs or compile):
        raise ValueError(f"{', '.join(recorded)}: graphs=true records the kernel construction of eager steps; "
                         f"{'--cuda-graphs records the whole step' if cuda_graphs else '--compile traces it'}")
    if cuda_graphs and compile:
        raise ValueError("CUDA graphs (--cuda-graphs) and torch.compile (--compile) exclude each other "
                         "(torch.compile's mode='reduce-overhead' is its own CUDA-graph path)")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs (--cuda-graphs) need a CUDA device, got {device}")


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
    kernel_builder: str = "auto",
    pack: bool | None = None,
    runners: Sequence[Runner] | None = None,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Measure every variant of ``model`` side by side; returns a JSON-able dict.

    ``compile``: a ``torch.compile`` backend (e.g. ``"inductor"``) for the timed steps.
    ``runners``: the variants of ``variant_specs(methods)`` already built by :func:`make_runner` with
    these settings (``orepa bench`` builds them first, so that a bad variant is a user error).
    """
    log = log or (lambda s: None)
    device = torch.device(device)
    check_step_modes(device, cuda_graphs, compile)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    git_start = git_state()  # the code this process loaded (files edited during a run do not count)
    methods = variant_specs(methods)
    if runners is None:
        runners = [make_runner(model, spec, device=device, num_classes=num_classes, in_chans=in_chans,
                               model_options=model_options, lr=lr, seed=seed, kernel_builder=kernel_builder,
                               pack=pack, compiled_step=bool(compile))
                   for spec in methods]
    runners = list(runners)
    if [r.name for r in runners] != methods:
        raise ValueError(f"runners {[r.name for r in runners]} are not the variants {methods}")
    check_step_modes(device, cuda_graphs, compile, runners)
    # after the builds (each seeds itself): the same data whether the runners came built or not
    torch.manual_seed(seed)
    x = torch.randn(batch_size, in_chans, image_size, image_size, device=device)
    y = torch.randint(0, num_classes, (batch_size,), device=device)

    res: dict[str, dict] = {}
    for r in runners:
        res[r.name] = {"train_params": count_params(r.model), "kernel_builder": r.kernel_builder, "packed": r.packed,
                       "kernel_graphs": r.kernel_graphs}
        log(f"built {r.name}: {res[r.name]['train_params']:,} params")

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
            launches = None
            if compile == "inductor":  # the first call compiles: its generated code read as it is made
                with inductor_code() as codes:
                    r.step(x, y)
                launches = res[r.name]["compiled_launches"] = compiled_launches(codes)
            for _ in range(max(warmup, 1) - (launches is not None)):  # warm the compiled code too
                r.step(x, y)
            _sync(device)
            res[r.name]["compile_s"] = time.perf_counter() - t0
            log(f"compiled {r.name} ({compile}): {res[r.name]['compile_s']:.0f} s" +
                (f", {launches['total']} launches per step" if launches else ""))

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
            # a variant whose random-data steps diverged has no deploy error to compare: said as
            # such, in the table and the JSON alike (JSON has no NaN)
            diverged = not math.isfinite(err)
            res[r.name].update(deploy_params=count_params(d), deploy_flops=_flops_forward(d, x),
                               deploy_err=None if diverged else err, diverged=diverged)
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
            "kernel_builder": kernel_builder, "pack_parameters": pack,
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if device.type == "cuda" else None,
            "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else None,
            # (results without it read the peak step's start with the last step's gradients: CUDA peaks short by
            # their bytes, see measure_variant_costs; benchmarks/gpu_goals.py corrects those)
            "peak_start": "without gradients",
        },
        "environment": {**environment(device, git_start), "loadavg_1m_start": load_start},
        "results": res,
    }
    result["ratios"] = ratios(res)
    return result


def environment(device: torch.device, git: dict | None) -> dict:
    """Machine and software facts of a run; ``git`` is the checkout's state read when the run started."""
    env = {
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "device": str(device), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:  # CPU ratios depend on the processor (its matrix products against its convolutions)
        env["cpu"] = _cpu_model()
    try:
        env["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    env["git"] = git
    return env


def _cpu_model() -> str:
    """The processor's model name (Linux's /proc/cpuinfo, else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_state() -> dict | None:
    """Commit and modified files of the orepa checkout (tables depend on the core code's state)."""
    import subprocess

    here = Path(__file__).resolve()
    root = here.parents[4]  # src/orepa/apps/bench/measure.py -> checkout
    if here.parents[3].name != "src":  # an installed copy (site-packages): no checkout of its own
        return None
    try:
        # the checkout's own repository (not one around a copy of the tree that git does not track)
        top, _, commit = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], check=False,
                                        cwd=root, capture_output=True, text=True, timeout=10).stdout.strip().partition("\n")
        if not top or Path(top).resolve() != root:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "src/orepa"], check=False,
                               cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return None
    if not commit:
        return None
    return {"commit": commit, "modified": [ln[3:] for ln in dirty if ln.strip()]}
