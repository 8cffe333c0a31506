"""The online engine: executes the branches that blocks declare.

:mod:`orepa.blocks` declares *what* a block is (its branches of linear steps); this module holds
*how* an online block's kernel is built during training:

* the closed-form squeeze (:func:`squeeze`) and its backward (:func:`squeeze_vjp`): branch
  kernels summed in place, gradients through closed-form vjps, nothing but the operands kept;
* the autograd Functions around them (:class:`SqueezeFunction`, :class:`RecomputedSqueezeConv`);
* the network-level kernel builder (:func:`group_kernels`): blocks of one construction signature
  form a :class:`KernelGroup`, whose kernels are built together once per forward.

Grouping rests on one identity: ``B`` blocks of the same signature, their operands concatenated
along the output channels and their groups multiplied by ``B``, are ONE block whose kernel is the
concatenation of theirs (each composition is block-diagonal in the blocks). :func:`squeeze` is
written for a list of blocks and a single block is the case ``B = 1``: one mechanism either way.

Why group: on a GPU an eager online step is bound by the host issuing hundreds of tiny
kernel-construction ops (~10-20 us each), not by their FLOPs; a group builds ``B`` kernels with
the ops of one. On a CPU the FLOPs decide, and each block's own route (feature map vs kernel
space, kernel recomputation; see ``ReparamConv2d._route``) is kept. The policy says which:
``"auto"`` groups where the block's tensors are on a CUDA device, ``"grouped"`` everywhere,
``"per-block"`` nowhere.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels as K

__all__ = ["POLICIES", "KernelGroup", "group_kernels", "kernel_groups", "squeeze", "squeeze_vjp"]

#: where blocks build their kernels together (see the module docstring)
POLICIES = ("auto", "grouped", "per-block")


def memo(cache: dict, key, compute):
    """``cache[key]``, computed on a miss. Bounded (many input sizes, e.g. detection, clear it
    now and then), and bypassed inside a traced call: filling a cache there would make the
    compiled graph guard on it and recompile on the next call."""
    if torch.compiler.is_compiling():
        return compute()
    if key not in cache:
        if len(cache) >= 64:
            cache.clear()
        cache[key] = compute()
    return cache[key]


# --------------------------------------------------------------------------- closed-form squeeze


class Operand(NamedTuple):
    """One kernel step of a branch as the squeeze sees it."""

    kernel: Tensor
    groups: int
    learnable: bool
    shared: bool  # a fixed per-channel filter equal for every channel (average pooling)


def _operands(blocks: Sequence[nn.Module], name: str) -> tuple[list[Operand], Tensor | None, bool]:
    """Kernel steps and scale of branch ``name``, over ``blocks`` concatenated along dim 0."""
    steps, scale = blocks[0].branches[name]._split()
    n = len(blocks)
    if n == 1:
        tensors = [st.kernel() for st in steps]
        s = None if scale is None else scale.weight
    else:
        per_block = [blk.branches[name]._split() for blk in blocks]
        tensors = [torch.cat([p[0][j].kernel() for p in per_block]) for j in range(len(steps))]
        s = None if scale is None else torch.cat([p[1].weight for p in per_block])
    ks = [Operand(t, st.groups * n, isinstance(st.weight, nn.Parameter), getattr(st, "kind", None) == "avg")
          for t, st in zip(tensors, steps)]
    return ks, s, scale is not None and scale.mode == "scalar"


def _fresh_kernel(ks: list[Operand], s: Tensor | None) -> Tensor:
    w = ks[0].kernel
    return w.clone() if s is None else K.scale_channels(w, s)


def _add_into(out: Tensor, ks: list[Operand], s: Tensor | None) -> None:
    """``out += branch kernel`` in place; no temporary for a single kernel or a per-channel
    filter after a 1x1, the scale fused into the addition."""
    if len(ks) == 1:
        if s is None:
            out.add_(ks[0].kernel)
        else:
            out.addcmul_(ks[0].kernel, s.reshape(-1, 1, 1, 1))
        return
    K.compose_into(out, ks[0].kernel, ks[0].groups, ks[1].kernel, ks[1].groups, s)


def _kernel_vjp(ks: list[Operand], s: Tensor | None, scalar: bool, grad: Tensor) -> list[Tensor | None]:
    """Gradients of ``<grad, branch kernel>`` for ``[*steps, scale]`` (None: fixed or absent)."""
    n = len(ks)
    out: list[Tensor | None] = [None] * (n + 1)
    last = ks[-1]

    def scale_grad(ds: Tensor) -> Tensor:
        return ds.sum(0, keepdim=True) if scalar else ds

    if n == 2:
        first = ks[0]
        if s is not None and K.compose_case(first.kernel.shape, first.groups, last.kernel.shape,
                                            last.groups) == "depthwise_after_1x1":
            # a per-channel filter after a 1x1: the scale folds into the 1x1 (the small factor),
            # so the filter's gradient is never needed for the scale's
            w1 = first.kernel
            d_w1s, d_last = K.compose_vjp(K.scale_channels(w1, s), first.groups, last.kernel, last.groups, grad,
                                          need_w2=last.learnable, shared_filter=last.shared)
            out[2] = scale_grad(K.rowdot(d_w1s, w1))
            if first.learnable:
                out[0] = K.scale_channels(d_w1s, s)
            if last.learnable:
                out[1] = d_last
            return out
        last_s = last.kernel if s is None else K.scale_channels(last.kernel, s)
        d_first, d_last = K.compose_vjp(first.kernel, first.groups, last_s, last.groups, grad,
                                        need_w1=first.learnable, need_w2=last.learnable or s is not None,
                                        shared_filter=last.shared and s is None)
        out[0] = d_first if first.learnable else None
        grad = d_last
    if s is not None:
        out[n] = scale_grad(K.rowdot(grad, last.kernel))
        if last.learnable:
            grad = K.scale_channels(grad, s)
    if last.learnable:
        out[n - 1] = grad
    return out


def _gather(blocks: Sequence[nn.Module], names: Sequence[str]) -> dict:
    return {name: _operands(blocks, name) for name in names}


def squeeze(blocks: Sequence[nn.Module], names: Sequence[str], operands: dict | None = None) -> Tensor:
    """Summed kernels of the named branches of ``blocks`` (one signature), concatenated along the
    output channels: ``[B * C_out, C_in / groups, k, k]``. Call without grad.

    A full-size single-kernel branch (kxk) starts the sum as a fresh tensor; every other branch
    is added into its centred window with its scale fused in.
    """
    blk = blocks[0]
    k = blk.kernel_size[0]
    ops = operands or _gather(blocks, names)
    first = blk._first_full_branch(names)
    if first is not None:
        out = _fresh_kernel(*ops[first][:2])
    else:
        ref = ops[names[0]][0][0].kernel
        out = ref.new_zeros(len(blocks) * blk.out_channels, blk.in_channels // blk.groups, k, k)
    for name in names:
        if name == first:
            continue
        e = blk.branches[name].extent
        o = (k - e) // 2
        _add_into(out[:, :, o:o + e, o:o + e], *ops[name][:2])
    return out


def squeeze_vjp(blocks: Sequence[nn.Module], names: Sequence[str], grad: Tensor,
                operands: dict | None = None) -> list[Tensor]:
    """Gradients of ``<grad, squeeze(blocks, names)>`` for :func:`squeeze_params` ``(blocks, names)``."""
    blk = blocks[0]
    k = blk.kernel_size[0]
    ops = operands or _gather(blocks, names)
    n = len(blocks)
    per_branch = {}
    for name in names:
        e = blk.branches[name].extent
        o = (k - e) // 2
        grads = _kernel_vjp(*ops[name], grad[:, :, o:o + e, o:o + e])
        # learnable operands in the branch's parameters() order: its conv steps, then its scale
        per_branch[name] = [(g.split(g.shape[0] // n) if n > 1 else (g,)) for g in grads if g is not None]
    return [g[i] for i in range(n) for name in names for g in per_branch[name]]


def squeeze_params(blocks: Sequence[nn.Module], names: Sequence[str]) -> list[Tensor]:
    """The parameters :func:`squeeze` reads, in the order :func:`squeeze_vjp` returns gradients."""
    return [p for blk in blocks for name in names for p in blk.branches[name].param_list()]


class SqueezeFunction(torch.autograd.Function):
    """``squeeze(blocks, names)`` with a hand-written backward; returns one kernel per block.

    Branch gradients come from dL/dW of the squeezed kernels through closed-form vjps: nothing
    but the operands is kept (for one block, the parameters themselves)."""

    @staticmethod
    def forward(ctx, blocks: tuple, names: tuple[str, ...], *params: Tensor):
        ops = _gather(blocks, names)
        w = squeeze(blocks, names, ops)
        ctx.blocks, ctx.names = blocks, names
        if len(blocks) == 1:
            ctx.save_for_backward(*params)
            return w
        # the concatenated operands are kept (a copy of the group's parameters) rather than
        # concatenated again in backward: memory is plentiful where grouping runs, host ops are not
        flat = [t for name in names for t in _flat_operands(ops[name])]
        ctx.save_for_backward(*flat)
        return w.split(blocks[0].out_channels)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        blocks, names = ctx.blocks, ctx.names
        saved = ctx.saved_tensors
        if len(blocks) == 1:
            ops = _gather(blocks, names)
        else:
            ops = _unflatten_operands(blocks, names, saved)
        shape = (blocks[0].out_channels, blocks[0].in_channels // blocks[0].groups, *blocks[0].kernel_size)
        ref = saved[0]
        grad = grads[0] if len(grads) == 1 else torch.cat(
            [g if g is not None else ref.new_zeros(shape) for g in grads])
        return (None, None, *squeeze_vjp(blocks, names, grad, ops))


def _flat_operands(op: tuple[list[Operand], Tensor | None, bool]) -> list[Tensor]:
    ks, s, _ = op
    return [o.kernel for o in ks] + ([] if s is None else [s])


def _unflatten_operands(blocks, names, saved) -> dict:
    out, i = {}, 0
    for name in names:
        steps, scale = blocks[0].branches[name]._split()
        n = len(blocks)
        ks = []
        for st in steps:
            ks.append(Operand(saved[i], st.groups * n, isinstance(st.weight, nn.Parameter),
                              getattr(st, "kind", None) == "avg"))
            i += 1
        s = None
        if scale is not None:
            s, i = saved[i], i + 1
        out[name] = (ks, s, scale is not None and scale.mode == "scalar")
    return out


class RecomputedSqueezeConv(torch.autograd.Function):
    """``conv(x, squeeze(params))`` that keeps only ``x`` for backward and rebuilds the kernel
    there: a block then costs the memory of a plain conv. Honours autocast explicitly."""

    @staticmethod
    def forward(ctx, x: Tensor, block: nn.Module, names: tuple[str, ...], bias: Tensor | None, *params: Tensor):
        w = squeeze((block,), names)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            y = F.conv2d(x.to(dtype), w.to(dtype), None if bias is None else bias.to(dtype),
                         block.stride, block.padding, block.dilation, block.groups)
        ctx.block, ctx.names, ctx.conv_dtype, ctx.has_bias = block, names, dtype, bias is not None
        # x itself is kept, not its autocast copy: the layer before usually keeps x anyway, so
        # this adds no memory (and torch.compile cannot save an alias of an input made here)
        ctx.save_for_backward(x, *params)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, *params = ctx.saved_tensors
        block, dtype = ctx.block, ctx.conv_dtype
        w = squeeze((block,), ctx.names)
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad_y.to(dtype), x.to(dtype), w.to(dtype), [block.out_channels] if ctx.has_bias else None,
            list(block.stride), list(block.padding), list(block.dilation), False, [0, 0], block.groups,
            [ctx.needs_input_grad[0], True, ctx.has_bias],
        )
        grads = squeeze_vjp((block,), ctx.names, gw.to(w.dtype))
        gx = None if gx is None else gx.to(x.dtype)
        gb = gb.to(w.dtype) if ctx.has_bias else None
        return (gx, None, None, gb, *grads)


# --------------------------------------------------------------------------- network-level builder


def _versions(block: nn.Module, names: Sequence[str]) -> tuple:
    return tuple(p._version for name in names for p in block.branches[name].param_list())


class KernelGroup:
    """Online blocks of one construction signature whose kernels are built together (or one block).

    The first block of the group that asks in a training forward builds every block's kernel
    (one :class:`SqueezeFunction` over the group); the others take theirs. A kernel is handed out
    once and only while its block's parameters are unchanged (their version counters), so a block
    called twice, a forward that stopped halfway or a parameter changed in between rebuilds
    instead of reusing a stale kernel or a graph already freed by backward.
    """

    def __init__(self, blocks: Sequence[nn.Module], policy: str = "auto"):
        if policy not in POLICIES:
            raise ValueError(f"kernel-builder policy must be one of {POLICIES}, got {policy!r}")
        self.blocks = tuple(blocks)
        self.names = tuple(self.blocks[0].branches)
        self.policy = policy
        self._pending: dict[int, tuple[tuple, Tensor]] = {}

    def __getstate__(self):  # copies and pickles drop kernels that hold an autograd graph
        return {**self.__dict__, "_pending": {}}

    def __len__(self) -> int:
        return len(self.blocks)

    def active(self, ref: Tensor) -> bool:
        """Whether blocks on ``ref``'s device build their kernels here (training forwards only)."""
        if self.policy == "per-block" or torch.compiler.is_compiling():
            return False
        return self.policy == "grouped" or ref.is_cuda

    def kernel_of(self, block: nn.Module) -> Tensor:
        entry = self._pending.pop(id(block), None)
        if entry is not None and entry[0] == _versions(block, self.names):
            return entry[1]
        blocks = self.blocks
        params = squeeze_params(blocks, self.names)
        ref = params[0]
        if any(p.device != ref.device or p.dtype != ref.dtype for p in params):
            return SqueezeFunction.apply((block,), self.names, *squeeze_params((block,), self.names))
        kernels = SqueezeFunction.apply(blocks, self.names, *params)
        if len(blocks) == 1:
            return kernels
        self._pending = {id(b): (_versions(b, self.names), w) for b, w in zip(blocks, kernels) if b is not block}
        return kernels[blocks.index(block)]


def _signature(block: nn.Module) -> tuple:
    steps = []
    for name, br in block.branches.items():
        for st in br:
            w = getattr(st, "weight", None)
            steps.append((name, type(st).__name__, getattr(st, "groups", None), getattr(st, "kind", None),
                          getattr(st, "mode", None), None if w is None else tuple(w.shape)))
    return (type(block).__name__, block.in_channels, block.out_channels, block.kernel_size, block.groups,
            tuple(steps))


def group_kernels(root: nn.Module, policy: str = "auto") -> list[KernelGroup]:
    """Group the online blocks under ``root`` by construction signature (channels, kernel size,
    groups, branch set and step shapes) so each group builds its kernels together in training
    forwards. Idempotent: regrouping replaces earlier groups (e.g. to change ``policy``).

    Blocks with scalar scales stay alone (their scales do not concatenate per channel): a group
    of one, which still takes the grouped route (the kernel space, no recomputation). Returns the
    groups.
    """
    if policy not in POLICIES:
        raise ValueError(f"kernel-builder policy must be one of {POLICIES}, got {policy!r}")
    by_signature: dict[tuple, list[nn.Module]] = {}
    for m in root.modules():
        if not hasattr(m, "_kernel_group"):
            continue
        m._kernel_group = None
        if not m._closed_form:
            continue
        sig = _signature(m)
        if any(getattr(st, "mode", None) == "scalar" for br in m.branches.values() for st in br):
            sig = (sig, id(m))
        by_signature.setdefault(sig, []).append(m)
    groups = []
    for blocks in by_signature.values():
        group = KernelGroup(blocks, policy)
        for blk in blocks:
            blk._kernel_group = group
        groups.append(group)
    return groups


def kernel_groups(root: nn.Module) -> list[KernelGroup]:
    """The groups of the blocks under ``root`` (each once, in module order)."""
    seen: dict[int, KernelGroup] = {}
    for m in root.modules():
        g = getattr(m, "_kernel_group", None)
        if g is not None:
            seen.setdefault(id(g), g)
    return list(seen.values())


def block_count(groups: Iterable[KernelGroup]) -> int:
    return sum(len(g) for g in groups)
