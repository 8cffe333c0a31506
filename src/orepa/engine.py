"""The online engine: executes the branches that blocks declare.

:mod:`orepa.blocks` declares *what* a block is (its branches of linear steps); this module holds
*how* an online block's kernel is built during training:

* the closed-form squeeze (:class:`Plan`: ``squeeze`` and its backward ``vjp``): branch
  kernels summed in place, gradients through closed-form vjps, nothing but the operands kept;
* the autograd Functions around them (:class:`GroupsFunction`, :class:`RecomputedSqueezeConv`);
* each block's own route in training (:func:`train_forward`): per branch kernel space or the
  feature map, whichever costs fewer FLOPs for the input (:func:`route`), and kernel recomputation;
* the network-level kernel builder (:func:`group_kernels`): blocks of one construction signature
  form a :class:`KernelGroup`, whose kernels are built together once per forward, every group's
  at the forward's first online block, their intermediates written into the network's
  :class:`Workspace` (buffers that are the same tensors at every step, in memory that exists only
  while a build runs: their views are made once, nothing is allocated).

Grouping rests on one identity: ``B`` blocks of the same signature, their operands concatenated
along the output channels and their groups multiplied by ``B``, are ONE block whose kernel is the
concatenation of theirs (each composition is block-diagonal in the blocks). A :class:`Plan` is
written for a list of blocks and a single block is the case ``B = 1``: one mechanism either way.
A group makes those concatenations once, as its :class:`Storage`, and its blocks' tensors become
views of it; there the branches that are a 1x1 and a fixed per-channel filter (a :class:`Family`)
share one batched product. The blocks need not be equally wide: a signature leaves the output
channels out, and blocks whose widths are multiples of the narrowest (a stage's 64 -> 64 blocks
and its 64 -> 128 transition) are one group of *virtual blocks* as wide as the narrowest, each
reading its block's rows and its block's input-side steps (those are replicated per virtual
block at each build, their gradients summed back): one construction where there were two.

Why group: on a GPU an eager online step is bound by the host issuing hundreds of tiny
kernel-construction ops (~10-20 us each), not by their FLOPs; a group builds ``B`` kernels with
the ops of one. On a CPU the FLOPs decide, and each block's own route (feature map vs kernel
space, kernel recomputation; :func:`route`) is kept. The policy says which:
``"auto"`` groups where the block's tensors are on a CUDA device, ``"grouped"`` everywhere,
``"per-block"`` nowhere, ``"compiled"`` everywhere with the groups' construction compiled
(:class:`CompiledBuild`: a few fused kernels per group instead of ~100 operators, after a
compilation at the first training step). The first online block of a training forward builds
every group's kernels, as one autograd node (:class:`GroupsFunction`; compiled, one call forward
and one backward for the whole network). ``group_kernels(..., graphs=True)`` records each group's
construction, eager or compiled, as two CUDA graphs (:class:`Recording`, replayed by a
:class:`GraphedBuild`): it reads only parameters, whose memory stays put between steps, so a
replay serves every eager step whatever its batch. ``group_kernels(..., traced=True)``: inside a
``torch.compile`` trace of the root's forward the groups build together too, traced into the graph
in the form written for a compiler (:meth:`KernelGroup._traced_kernel_of`).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import itertools
import math
import operator
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels as K

__all__ = ["ChainedBuild", "CompiledBuild", "CudaGraphRecorder", "GraphedBuild", "KernelGroup", "POLICIES",
           "PackedParameters", "Plan", "Recording", "RecordingBuffer", "arena_bytes", "block_deployed",
           "builds_together", "choose_route", "forward_scope", "functorch_active", "group_kernels", "kernel_groups",
           "needs_recompute", "plan_of", "recorded_bytes", "reference_path", "release_scope", "route", "squeeze",
           "squeeze_kernels", "strip_scopes", "train_forward", "train_kernel"]

#: where blocks build their kernels together (see the module docstring)
POLICIES = ("auto", "grouped", "per-block", "compiled")


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


_version = operator.attrgetter("_version")  # a tensor's in-place update counter


def _learnable(step: nn.Module) -> bool:
    """Whether a step's weight is a parameter slot (a conv) rather than a buffer (a fixed filter). By
    the slot, not the tensor's class: under ``torch.func.functional_call`` (or FSDP) the slot holds a
    plain tensor, and a plan made then is kept for the block's life (a class test marked its convs
    fixed for good: they never trained again). A packed step's weight is rows of a parameter; a
    DataParallel replica's parameters are plain attributes (``_replica_weight``)."""
    return "weight" in step._parameters or step.__dict__.get("_packed") is not None or _replica_weight(step)


def _replica_weight(step: nn.Module) -> bool:
    """Whether ``step`` is a DataParallel replica holding its parameter ``weight`` as ``replicate``
    leaves it: a plain attribute, the tensor broadcast to its device (buffers stay buffers)."""
    return step.__dict__.get("_is_replica", False) and "weight" in step.__dict__


def _weight(step: nn.Module) -> Tensor:
    # straight from the module's dicts: the generic attribute lookup is a visible share of host time
    w = step._parameters.get("weight")
    if w is None:
        w = step._buffers.get("weight")
    return step.weight if w is None else w  # a packed step's rows


def _slot(step: nn.Module, learnable: bool) -> tuple:
    """(mapping, key) holding a step's weight: its parameter or buffer dict, or its packed slot."""
    if not learnable:
        return step._buffers, "weight"
    if "weight" in step._parameters:
        return step._parameters, "weight"
    if _replica_weight(step):
        return step.__dict__, "weight"
    return step.__dict__["_packed"], "weight"


class _Branch(NamedTuple):
    name: str
    steps: tuple[tuple[nn.Module, ...], ...]  # steps[j]: the j-th kernel step of every block
    scales: tuple[nn.Module, ...] | None
    groups: tuple[int, ...]  # per kernel step, times the number of blocks
    learnable: tuple[bool, ...]
    shared: tuple[bool, ...]
    scalar: bool
    # the branch kernel's centred window in the kh x kw kernel, rows [top, top + eh) and columns
    # [left, left + ew); None where it is the whole kernel (fixed per plan: no test per build)
    window: tuple[slice, slice] | None
    # whether its first step is input-side (rows not the block's outputs: 1x1 -> kxk's 1x1, dw -> pw's
    # dw) in a plan of blocks of several widths: replicated per virtual block at each build
    replicated: bool = False


def _per_channel(step: nn.Module) -> bool:
    """Whether a kernel step filters each channel on its own (a depthwise kernel, multiplier 1)."""
    w = _weight(step)
    return w.shape[1] == 1 and step.groups == w.shape[0]


class Family(NamedTuple):
    """The *filter family* of a group's storage: branches that are a learnable 1x1 and a fixed
    per-channel filter (none for a bare 1x1: its centre tap), scaled per channel: 1x1, 1x1-avg and
    1x1-prior in OREPA's block. Their kernels sum to one batched product, ``sum_j s_j W_j F_j``."""

    weights: Tensor  # [J, B * C_out, C_in / groups]: the members' 1x1 weights in one storage
    scales: Tensor  # [J, B * C_out, 1]
    filters: Tensor  # [B * C_out, J, kh * kw]: member j's filter per output channel


class Storage(NamedTuple):
    """A group's operands made once (:meth:`KernelGroup._stacked`): per role (:meth:`Plan.tensors_of`)
    the blocks' tensors concatenated along dim 0, which they are views of, and the filter family;
    ``operands``: the roles as :meth:`Plan.operands` hands them to the squeeze. ``packed``: where
    its learnable roles are rows of the group's packed parameters (:meth:`KernelGroup.pack`), the
    squeeze's gradients are theirs, one per packed parameter, not one per block and role: per packed
    parameter, the gradients it concatenates (indices into the learnable roles outside the filter
    family in order, then the family's 1x1 weights and scales)."""

    roles: list[Tensor]
    family: Family | None
    operands: list[tuple[list[Operand], Tensor | None]]
    packed: tuple[tuple[int, ...], ...] = ()
    kept: tuple[K.KeptViews, ...] = ()  # the views builds take of its tensors (kernels.keep_views)


class PackedSlot:
    """Where a packed step's weight lives: rows ``[lo, lo + size)`` of the packed parameter
    ``name`` of ``holder`` (see :meth:`KernelGroup.pack`). Read through the holder, so it follows
    ``.to()``, copies and pickles of the model; a :class:`Plan` reads it as it reads a module's
    tensor dict (``slot["weight"]``). ``overridden``: a tensor set in place of the rows (what
    ``torch.func.functional_call`` swaps in by the step's state_dict name), read instead of them
    until the rows are set back."""

    def __init__(self, holder: nn.Module, name: str, lo: int, size: int):
        self.holder, self.name, self.lo, self.size = holder, name, lo, size
        self.overridden: Tensor | None = None
        self._handed = None  # a weak reference to the last view of the rows handed out by [] (see override)

    def __getstate__(self):  # pickles (torch.save of a model) take no weak reference
        return {**self.__dict__, "_handed": None}

    def view(self) -> Tensor:
        return self.holder._parameters[self.name].narrow(0, self.lo, self.size)

    def __getitem__(self, key: str) -> Tensor:
        if self.overridden is not None:
            return self.overridden
        rows = self.view()
        if not torch.compiler.is_compiling():  # (a traced side effect dynamo cannot carry out of a Function)
            self._handed = weakref.ref(rows)
        return rows

    def override(self, value: Tensor | None) -> None:
        """Read ``value`` instead of the rows. The rows themselves end it: a view of them handed out
        by ``[]`` (what functional_call read before its swap and sets back after it, even where it
        swapped the packed parameter too), one of the rows' memory, or None."""
        if value is None or (self._handed is not None and self._handed() is value):
            self._set(None)
            return
        if isinstance(value, nn.Parameter):
            raise TypeError("a packed step's weight is its rows of its group's packed parameter and cannot be "
                            "replaced by a new nn.Parameter; unpack first (orepa.engine.group_kernels without pack)")
        if not isinstance(value, Tensor):
            raise TypeError(f"a packed weight can only be replaced by a tensor, got {type(value).__name__}")
        rows = self.view()
        try:
            own = (value.device == rows.device and value.dtype == rows.dtype and value.shape == rows.shape
                   and value.stride() == rows.stride() and value.data_ptr() == rows.data_ptr())
        except RuntimeError:  # a tensor without storage (torch.func's grad/vmap wrap theirs): not the rows
            own = False
        self._set(None if own else value)

    def _set(self, value: Tensor | None) -> None:
        # the holder counts its steps' overrides: a build asks it, not every slot (host time)
        counts = self.holder.__dict__  # (a model pickled before the count existed has none)
        counts["overrides"] = counts.get("overrides", 0) + (value is not None) - (self.overridden is not None)
        self.overridden = value


class PackedParameters(nn.Module):
    """A group's learnable operands as a few parameters (:meth:`KernelGroup.pack`), the
    child ``packed_parameters`` of the group's first block. No state_dict keys of its own: every
    step still saves and loads its rows under its own key (see ``orepa.blocks.PackableWeight``).
    ``kinds``: per parameter, ``"scale"`` (branch scaling vectors) or ``"weight"`` (conv kernels),
    for weight-decay grouping by role."""

    def __init__(self):
        super().__init__()
        self.kinds: dict[str, str] = {}
        self.overrides = 0  # how many of its steps read a tensor set in place of their rows (PackedSlot)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        return

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        return


class Plan:
    """What squeezing the named branches of ``blocks`` (one signature) reads, worked out once:
    the steps of every block per branch, their groups, which are learnable, the centred windows."""

    def __init__(self, blocks: Sequence[nn.Module], names: Sequence[str], launch_bound: bool = False,
                 traced: bool = False):
        blk = blocks[0]
        self.blocks, self.names, self.n = tuple(blocks), tuple(names), len(blocks)
        # a group's plan (what a GPU runs): the fewest operators where they and the CPU's FLOPs disagree
        self.launch_bound = launch_bound
        # a plan traced for a compiler (CompiledBuild) writes nothing through out= (tracers mis-read
        # the layout of such writes, and the compiler fuses what out= would have saved anyway) and
        # writes short contractions out term by term (kernels.batched_product), which the compiler fuses too
        self.traced = traced
        kh, kw = blk.kernel_size
        # blocks may differ in their output channels (multiples of the smallest, see group_kernels):
        # the compositions then run over *virtual blocks* of `unit` output rows each, every one
        # with its block's input-side step (the first step of 1x1 -> kxk, dw -> pw) as operand
        self.rows = tuple(b.out_channels for b in blocks)
        unit = min(self.rows)
        self._reps = tuple(r // unit for r in self.rows)
        self.v = sum(self._reps)  # == n where the blocks are alike
        self.kernel_shapes = tuple((r, blk.in_channels // blk.groups, kh, kw) for r in self.rows)
        self.kernel_shape = self.kernel_shapes[0]
        self._replicas: dict = {}  # (rows per block, device) -> the virtual blocks' rows (_replica_index)
        self.first = blk._first_full_branch(self.names)
        self.branches = []
        for name in self.names:
            per_block = [b.branches[name]._split() for b in blocks]
            steps0, scale0 = per_block[0]
            eh, ew = blk.branches[name].extent
            self.branches.append(_Branch(
                name, tuple(tuple(p[0][j] for p in per_block) for j in range(len(steps0))),
                None if scale0 is None else tuple(p[1] for p in per_block),
                # per virtual block: the narrowest block's groups (a per-channel filter's are its rows)
                tuple(st.groups * self.v for st in per_block[self._reps.index(1)][0]),
                tuple(_learnable(st) for st in steps0),
                tuple(getattr(st, "kind", None) == "avg" for st in steps0),
                scale0 is not None and scale0.mode == "scalar",
                None if (eh, ew) == (kh, kw) else (slice((kh - eh) // 2, (kh - eh) // 2 + eh),
                                                   slice((kw - ew) // 2, (kw - ew) // 2 + ew)),
                len(steps0) == 2 and self.v != self.n and not _per_channel(steps0[1])))
        self._find_slots()
        self._virtual = tuple(b for b, reps in enumerate(self._reps) for _ in range(reps))  # their blocks
        self.build = EagerBuild((self,))  # this plan's construction alone, as GroupsFunction runs it
        # per filter-family member (see Family): its roles (1x1 weight, fixed filter or None, scale)
        members, indices, role = [], [], 0
        for i, br in enumerate(self.branches):
            if self._in_family(br, blk):
                members.append((role, role + 1 if len(br.steps) == 2 else None, role + len(br.steps)))
                indices.append(i)
            role += len(br.steps) + (br.scales is not None)
        family = len(members) >= 2
        self.family = tuple(members) if family else ()
        self._family_branches = frozenset(indices if family else ())

    def _in_family(self, br: _Branch, blk: nn.Module) -> bool:
        if br.name == self.first or br.scales is None or br.scalar or not br.learnable[0]:
            return False
        conv = br.steps[0][0]
        if tuple(_weight(conv).shape[-2:]) != (1, 1) or conv.groups != blk.groups:  # a 1x1 (not a kh x 1)
            return False
        return len(br.steps) == 1 or (len(br.steps) == 2 and not br.learnable[1]
                                      and br.steps[1][0].groups == blk.out_channels)

    def params(self) -> list[Tensor]:
        """The parameters read, in ``parameters()`` order per block: the order of :meth:`vjp`'s gradients."""
        return [p for b in range(self.n) for p in self.params_of(b)]

    def tensors_of(self, b: int) -> list[Tensor]:
        """Block ``b``'s operand tensors, one per *role*: per branch every kernel step's weight
        (learnable or fixed), then its scale. :meth:`params_of` is the learnable subset, in order."""
        return [d[k] for d, k in self._slots[b]]

    def ref(self, b: int = 0) -> Tensor:
        """A parameter of block ``b`` (the first): where (device) and how (dtype) the plan computes."""
        d, k = self._param_slots[b][0]
        return d.holder._parameters[d.name] if isinstance(d, PackedSlot) else d[k]  # no view op per call

    def versions(self, b: int) -> tuple:
        """Version counters of block ``b``'s parameters (they change with every in-place update)."""
        return tuple(_version(d[k]) for d, k in self._param_slots[b])

    def params_of(self, b: int) -> list[Tensor]:
        """Block ``b``'s parameters: per branch its learnable kernel steps, then its scale."""
        return [d[k] for d, k in self._param_slots[b]]

    def _find_slots(self) -> None:
        """Where each block's operand tensors live, as (the module's tensor dict, key) per role:
        gathering them is then a list of dict lookups (an eager GPU step is bound by host time).
        Read at every gathering, so a parameter assigned anew is the one read."""
        # per role, whether it is a parameter (the rest are fixed kernels, buffers)
        self.learnable_roles = tuple(r for br in self.branches
                                     for r in (*br.learnable, *((True,) if br.scales is not None else ())))
        self._fixed_roles = tuple(r for r, learnable in enumerate(self.learnable_roles) if not learnable)
        # per role, whether it is learnable and its index among the roles of its kind (_roles)
        self._role_index = tuple((learnable, sum(1 for x in self.learnable_roles[:r] if x == learnable))
                                 for r, learnable in enumerate(self.learnable_roles))
        ends = list(itertools.accumulate(len(br.steps) + (br.scales is not None) for br in self.branches))
        self._scale_roles = frozenset(e - 1 for e, br in zip(ends, self.branches) if br.scales is not None)
        self._slots, self._param_slots = [], []
        # per role, its module in every block (what KernelGroup.pack re-points)
        self.role_modules = [mods for br in self.branches for mods in (*br.steps, *((br.scales,) if br.scales else ()))]
        for b in range(self.n):
            slots = []
            for br in self.branches:
                slots.extend(_slot(st[b], learnable) for st, learnable in zip(br.steps, br.learnable))
                if br.scales is not None:
                    slots.append(_slot(br.scales[b], True))
            self._slots.append(slots)
            self._param_slots.append([slot for slot, p in zip(slots, self.learnable_roles) if p])

    def operands(self, stacked: Sequence[Tensor] | None = None) -> list[tuple[list[Operand], Tensor | None]]:
        """Per branch: its kernel steps and scale over the blocks, concatenated along dim 0.

        ``stacked``: those concatenations already made, one per role (a :class:`Storage`'s roles);
        None: made now from what the blocks hold."""
        roles = iter(self._roles(self.params(), self.fixed()) if stacked is None else stacked)
        out = []
        for br in self.branches:
            ts = [next(roles) for _ in br.steps]
            s = next(roles) if br.scales is not None else None
            out.append(([Operand(*a) for a in zip(ts, br.groups, br.learnable, br.shared)], s))
        return out

    def fixed(self) -> list[Tensor]:
        """The blocks' fixed kernels (buffers) as they hold them now, block-major."""
        return [d[k] for slots in self._slots for d, k in (slots[r] for r in self._fixed_roles)]

    def _roles(self, leaves: Sequence[Tensor], fixed: Sequence[Tensor]) -> list[Tensor]:
        """Per role, the blocks' tensors concatenated, from ``leaves`` (:meth:`params` order) and
        ``fixed`` (:meth:`fixed` order)."""
        # block-major: a role's tensors are every m-th of its kind (a slice: few instructions where dynamo
        # traces this, instead of a loop over every tensor)
        if self.n == 1:
            return [leaves[k] if learnable else fixed[k] for learnable, k in self._role_index]
        m, f = len(self.learnable_roles) - len(self._fixed_roles), len(self._fixed_roles)
        return [torch.cat(leaves[k::m] if learnable else fixed[k::f]) for learnable, k in self._role_index]

    def storage_from(self, leaves: Sequence[Tensor], fixed: Sequence[Tensor]) -> Storage:
        """The operands of a build that read ``leaves`` and ``fixed`` (see :meth:`_roles`) as a
        :class:`Storage` (no filter family): what its backward differentiates."""
        roles = self._roles(leaves, fixed)
        return Storage(roles, None, self.operands(roles))

    def squeeze(self, stacked: Storage | None = None, scratch: Scratch | None = None,
                into: Tensor | None = None) -> Tensor:
        """Summed kernels of the named branches of the blocks, concatenated along the output
        channels: ``[sum of C_out, C_in / groups, k, k]``. Call without grad.

        A full-size single-kernel branch (kxk) starts the sum as a fresh tensor (``into``: in that
        tensor, e.g. a recording's output, :class:`Recording`); every other branch is added into its
        centred window with its scale fused in (a storage's filter family: all its members in one
        batched product). ``scratch`` (a storage's build on a host-bound device, :class:`Workspace`):
        the intermediates go to its buffers.
        """
        ops = stacked.operands if stacked is not None else self.operands()
        with autocast_off(ops[0][0][0].kernel):  # composed in the parameters' dtype, as a deployed conv's weight is
            return self._squeeze(ops, stacked, scratch, into)

    def _squeeze(self, ops, stacked: Storage | None, scratch: Scratch | None, into: Tensor | None) -> Tensor:
        family = stacked.family if stacked is not None else None
        skip = self._family_branches if family is not None else frozenset()
        out = None
        for br, (ks, s) in zip(self.branches, ops):
            if br.name == self.first:
                out = _fresh_kernel(ks, s, into)
                break
        if out is None:
            _, i, kh, kw = self.kernel_shape
            out = ops[0][0][0].kernel.new_zeros(sum(self.rows), i, kh, kw) if into is None else into.zero_()
        for i, (br, (ks, s)) in enumerate(zip(self.branches, ops)):
            if br.name != self.first and i not in skip:
                sub = None if scratch is None else scratch.branch(i)
                _add_into(self._window(out, br), self._replicate(ks, sub) if br.replicated else ks, s, self.traced,
                          sub)
        if family is not None:
            # out += sum_j (s_j W_j) F_j: per output channel [C_in/g, J] @ [J, kh*kw]
            w = K.kept_view(family.weights, ("rows,w,J",), lambda t: t.permute(1, 2, 0))
            ws = torch.mul(w, K.kept_view(family.scales, ("rows,w,J",), lambda t: t.permute(1, 2, 0)),
                           **({} if scratch is None else {"out": scratch.buf("family", w.shape)}))
            flat = out.view(out.shape[0], out.shape[1], -1)
            if self.traced:
                flat.add_(K.batched_product(ws, family.filters, pointwise=True))
            else:
                flat.baddbmm_(ws, family.filters)
        return out

    def kernels(self, stacked: Storage | None = None, scratch: Scratch | None = None) -> tuple[Tensor, ...]:
        """:meth:`squeeze` as one kernel per block (views of it)."""
        w = self.squeeze(stacked, scratch)
        if self.n == 1:
            return (w,)
        if self.traced:  # slices, not a split: AOT's partitioner can neither save nor recompute a split's list
            # for a block in an activation-checkpointed region of the graph (blocks of several widths)
            starts = itertools.accumulate(self.rows, initial=0)
            return tuple(w.narrow(0, lo, rows) for lo, rows in zip(starts, self.rows))
        return w.split(self.kernel_shape[0] if self.v == self.n else self.rows)

    def kernels_vjp(self, grads: Sequence[Tensor], stacked: Storage | None = None,
                    scratch: Scratch | None = None) -> list[Tensor]:
        """:meth:`vjp` from the gradients of :meth:`kernels`, one per block (with a ``scratch``: gathered
        into its buffer, whose views are then kept)."""
        if scratch is not None and grads[0].dtype == scratch.dtype:
            shape = (sum(self.rows), *self.kernel_shape[1:])
            return self.vjp(torch.cat(list(grads), out=scratch.buf("grad", shape)), stacked, scratch)
        return self.vjp(grads[0] if self.n == 1 else torch.cat(list(grads)), stacked)

    def _replica_index(self, first: Tensor) -> Tensor:
        """Rows of a replicated first step's concatenation that the virtual blocks read, in order.
        Made by kernels on the device (no copy from the host: it may be inside a CUDA-graph capture)
        and kept, except inside a capture (that memory is the graph's) and a dynamo trace (where keeping
        it would make the graph guard on the cache: the compiler folds it into the gather instead)."""
        m = first.shape[0] // self.n
        index = self._replicas.get((m, first.device))
        if index is None:
            index = torch.cat([torch.arange(b * m, (b + 1) * m, device=first.device) for b in self._virtual])
            if not (first.is_cuda and torch.cuda.is_current_stream_capturing()) and not torch.compiler.is_compiling():
                self._replicas[(m, first.device)] = index
        return index

    def replica_indices(self, stacked: Storage) -> None:
        """Make the replica indices for ``stacked``'s device ahead (a compiled build's trace then
        takes them as constants instead of tracing their construction)."""
        for br, (ks, _) in zip(self.branches, stacked.operands):
            if br.replicated:
                self._replica_index(ks[0].kernel)

    def _replicate(self, ks: list[Operand], scratch=None) -> list[Operand]:
        """A branch's operands over the virtual blocks: its first step's rows once per virtual block
        (into the ``scratch`` buffer ``"replica"`` where given)."""
        first = ks[0].kernel
        index = self._replica_index(first)
        if scratch is None:
            return [ks[0]._replace(kernel=first.index_select(0, index)), *ks[1:]]
        out = scratch.buf("replica", (index.shape[0], *first.shape[1:]))
        return [ks[0]._replace(kernel=torch.index_select(first, 0, index, out=out)), *ks[1:]]

    def _gather(self, grad: Tensor, first: Tensor, out: Tensor | None = None) -> Tensor:
        """A replicated first step's gradient summed back onto its blocks' rows (undoes :meth:`_replicate`;
        into ``out`` where given)."""
        out = grad.new_zeros(first.shape) if out is None else out.zero_()
        return out.index_add_(0, self._replica_index(first), grad)

    def _packed_places(self, stacked: Storage, scratch: Scratch | None,
                       into: Sequence[Tensor] | None = None) -> tuple[list[Tensor], list[Tensor]]:
        """Per packed parameter, the buffer of ``scratch`` its gradient is assembled in (None for a
        parameter of one role: its gradient is made fresh), and per gradient of :meth:`vjp` 's packed
        order (``Storage.packed``'s indices) its rows of that buffer in the gradient's shape (or None);
        made once per scratch. ``into`` instead of a scratch: every packed parameter's buffer, given."""
        places = None if scratch is None else scratch.cache.get("packed places")
        if places is None:
            in_family = {r for w, _, s_ in self.family for r in (w, s_)}
            shapes = [(t.shape[0],) if r in self._scale_roles else tuple(t.shape) for r, t in enumerate(stacked.roles)
                      if self.learnable_roles[r] and r not in in_family]
            if stacked.family is not None:
                j, rows, w = stacked.family.weights.shape
                shapes += [(j * rows, w, 1, 1), (j * rows,)]
            order: list[Tensor | None] = [None] * len(shapes)
            buffers = []
            for p, members in enumerate(stacked.packed):
                if len(members) == 1 and into is None:  # its one gradient is the parameter's, made fresh (no copy)
                    buffers.append(None)
                    continue
                total = (sum(shapes[m][0] for m in members), *shapes[members[0]][1:])
                buf = scratch.buf(("packed gradient", p), total) if into is None else into[p]
                if buf.shape != total:
                    raise ValueError(f"packed gradient {p}: a buffer of {tuple(buf.shape)} given for {total}")
                lo = 0
                for m in members:
                    order[m] = K.kept_view(buf, ("rows", lo, shapes[m]),
                                           lambda t, lo=lo, sh=shapes[m]: t.narrow(0, lo, sh[0]).view(sh))
                    lo += shapes[m][0]
                buffers.append(buf)
            places = (buffers, order)
            if scratch is not None:
                scratch.cache["packed places"] = places
        return places

    def _window(self, kernel: Tensor, br: _Branch) -> Tensor:
        """The branch's centred window of a kernel (no view op when it is the whole kernel)."""
        return kernel if br.window is None else kernel[:, :, br.window[0], br.window[1]]

    def vjp(self, grad: Tensor, stacked: Storage | None = None, scratch: Scratch | None = None,
            into: Sequence[Tensor] | None = None) -> list[Tensor]:
        """Gradients of ``<grad, squeeze()>`` for :meth:`params`, in that order (``scratch``: see
        :meth:`squeeze`; ``grad`` then one of its buffers). ``into``, for a packed storage without a
        scratch: one tensor per packed parameter, in its shape, where its gradient is written, and
        returned (a recording's outputs, :class:`Recording`): each branch's gradients go to their rows
        as they are made, so no two copies of them live at once."""
        with autocast_off(grad):
            return self._vjp(grad, stacked, scratch, into)

    def _vjp(self, grad: Tensor, stacked: Storage | None, scratch: Scratch | None,
             into: Sequence[Tensor] | None) -> list[Tensor]:
        ops = stacked.operands if stacked is not None else self.operands()
        n = self.n
        family = stacked.family if stacked is not None else None
        packed = stacked is not None and stacked.packed
        # packed, with a scratch: each gradient written into its rows of its packed parameter's
        # gradient, assembled in the scratch (no concatenation, no allocation, views kept)
        places = (self._packed_places(stacked, scratch, into if scratch is None else None)
                  if packed and (scratch is not None or into is not None) else None)
        fam_outs = places[1][-2:] if places is not None and family is not None else None
        d_family = _family_vjp(family, grad, self.traced, scratch, fam_outs) if family is not None else None
        members = iter(zip(d_family[0].view(*d_family[0].shape, 1, 1).unbind(0), d_family[1].unbind(0))
                       if family is not None and not packed else ())
        slots = iter(places[1]) if places is not None else None
        per_branch = []
        for i, (br, (ks, s)) in enumerate(zip(self.branches, ops)):
            if family is not None and i in self._family_branches:
                if packed:  # the family's gradients come last, whole
                    continue
                grads = list(next(members))
            else:
                outs = None if slots is None else [next(slots) if learnable else None for learnable in
                                                   (*(k.learnable for k in ks), *((True,) if s is not None else ()))]
                sub = None if scratch is None else scratch.branch(i)
                if br.replicated:
                    into = None if outs is None else outs[0]
                    grads = _kernel_vjp(self._replicate(ks, sub), s, br.scalar, self._window(grad, br),
                                        self.launch_bound, self.traced, sub, None if outs is None else [None, *outs[1:]])
                    if grads[0] is not None:
                        grads[0] = self._gather(grads[0], ks[0].kernel, into)
                else:
                    grads = _kernel_vjp(ks, s, br.scalar, self._window(grad, br), self.launch_bound, self.traced,
                                        sub, outs)
            # learnable operands in the branch's parameters() order: its conv steps, then its scale;
            # per block: output-side rows by the blocks' widths, a replicated first step's alike
            per_branch.append([g if packed else (g,) if n == 1 else g.split(
                g.shape[0] // n if self.v == n or (j == 0 and br.replicated) else self.rows)
                for j, g in enumerate(grads) if g is not None])
        if packed:  # one gradient per packed parameter, in KernelGroup.pack's order
            flat = [g for gs in per_branch for g in gs]
            if family is not None:  # (in their packed shapes already where written into their places)
                d_w, d_s = d_family
                flat += [d_w if d_w.dim() == 4 else d_w.view(-1, *d_w.shape[2:], 1, 1), d_s if d_s.dim() == 1 else d_s.view(-1)]
            if places is not None:  # assembled ones handed out as fresh tensors (the next build reuses the scratch)
                return [flat[members[0]] if buf is None else buf if scratch is None else buf.clone()
                        for buf, members in zip(places[0], stacked.packed)]
            # a parameter of several roles: their gradients concatenated (rows of one shape already)
            return [flat[members[0]] if len(members) == 1 else torch.cat([flat[m] for m in members])
                    for members in stacked.packed]
        return [g[i] for i in range(n) for gs in per_branch for g in gs]


def _family_vjp(family: Family, grad: Tensor, traced: bool = False, scratch: Scratch | None = None,
                outs: Sequence[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The gradients of the family's 1x1 weights ``[J, rows, w]`` and scales ``[J, rows]``, member
    j's at index j (``traced``, ``scratch``: see :class:`Plan`; ``outs``: written into these, the
    weights' ``[J * rows, w, 1, 1]`` and the scales' ``[J * rows]``, and returned as they are)."""
    rows, width = grad.shape[:2]
    filters_t = K.kept_view(family.filters, ("rows,kk,J",), lambda t: t.transpose(1, 2))
    g = K._kept_reshape(grad, rows, width, -1)
    if scratch is None:
        d = K.batched_product(g, filters_t, traced)
    else:
        d = torch.bmm(g, filters_t, out=scratch.buf("family d", (rows, width, filters_t.shape[2])))
    d = K.kept_view(d, ("J,rows,w",), lambda t: t.permute(2, 0, 1))  # [J, rows, w]
    if scratch is not None or outs is not None:  # (the same evaluation, written in place or not: the same numbers)
        j = d.shape[0]
        terms = (d * family.weights if scratch is None
                 else torch.mul(d, family.weights, out=scratch.buf("family scale terms", d.shape)))
        o_w, o_s = outs if outs is not None else (None, None)
        if o_w is None:
            d_w = K.mul_contiguous(d, family.scales)
        else:
            d_w = o_w
            torch.mul(d, family.scales, out=K._kept_reshape(o_w, j, rows, width))
        if o_s is None:
            return d_w, terms.sum(-1)
        torch.sum(terms, -1, out=K._kept_reshape(o_s, j, rows))
        return d_w, o_s
    # the weights' gradients made contiguous (autograd then takes them as they are, without a copy)
    return K.mul_contiguous(d, family.scales, traced), (d * family.weights).sum(-1)


def _fresh_kernel(ks: list[Operand], s: Tensor | None, into: Tensor | None = None) -> Tensor:
    w = ks[0].kernel
    if into is not None:
        return into.copy_(w) if s is None else torch.mul(w, K.channel_column(s), out=into)
    return w.clone() if s is None else K.scale_channels(w, s)


def _add_into(out: Tensor, ks: list[Operand], s: Tensor | None, traced: bool = False, scratch=None) -> None:
    """``out += branch kernel`` in place; no temporary for a single kernel or a per-channel
    filter after a 1x1, the scale fused into the addition (``scratch``: see :class:`Scratch`)."""
    if len(ks) == 1:
        if s is None:
            out.add_(ks[0].kernel)
        else:
            out.addcmul_(ks[0].kernel, K.channel_column(s))
        return
    K.compose_into(out, ks[0].kernel, ks[0].groups, ks[1].kernel, ks[1].groups, s, traced=traced, scratch=scratch)


def _kernel_vjp(ks: list[Operand], s: Tensor | None, scalar: bool, grad: Tensor, launch_bound: bool = False,
                traced: bool = False, scratch=None, outs: Sequence[Tensor | None] | None = None) -> list[Tensor | None]:
    """Gradients of ``<grad, branch kernel>`` for ``[*steps, scale]`` (None: fixed or absent;
    ``traced``, ``scratch``: see :class:`Plan`; ``outs``: per gradient, where to write it, or None:
    a fresh tensor)."""
    grads = _branch_vjp(ks, s, scalar, grad, launch_bound, traced, scratch, outs)
    for j, o in enumerate(outs or ()):
        if o is not None and grads[j] is not None and grads[j] is not o:
            grads[j] = o.copy_(grads[j])  # (an evaluation that does not write in place)
    return grads


def _branch_vjp(ks: list[Operand], s: Tensor | None, scalar: bool, grad: Tensor, launch_bound: bool,
                traced: bool, scratch, outs) -> list[Tensor | None]:
    n = len(ks)
    out: list[Tensor | None] = [None] * (n + 1)
    last = ks[-1]
    if scratch is not None and n == 2 and s is not None and not scalar and last.learnable:
        first = ks[0]
        grads = K.compose_vjp_scaled(first.kernel, first.groups, last.kernel, last.groups, s, grad, scratch,
                                     need_w1=first.learnable, outs=tuple(outs) if outs else (None,) * 3)
        if grads is not None:
            return list(grads)
    if outs is not None and n == 1 and last.learnable and not scalar:  # a kxk: into its places
        # (a place may be None: a packed parameter of this role alone, e.g. one frozen apart, gets a fresh tensor)
        if s is not None:
            return [torch.mul(grad, K.channel_column(s), out=outs[0]), K.rowdot(grad, last.kernel, out=outs[1])]
        return [grad.clone() if outs[0] is None else outs[0].copy_(grad), None]

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
                                          need_w2=last.learnable, shared_filter=last.shared, launch_bound=launch_bound,
                                          traced=traced)
            out[2] = scale_grad(K.rowdot(d_w1s, w1, traced, launch_bound=launch_bound))
            if first.learnable:
                out[0] = K.scale_channels(d_w1s, s)
            if last.learnable:
                out[1] = d_last
            return out
        # grad now: the gradient of the scaled second kernel (the scaling fused into its reordering),
        # a fresh tensor, scaled in place below (no second copy of it lives at once)
        out[0], grad = K.compose_vjp(first.kernel, first.groups, last.kernel, last.groups, grad,
                                     need_w1=first.learnable, need_w2=last.learnable or s is not None,
                                     shared_filter=last.shared and s is None, launch_bound=launch_bound,
                                     scale=s, traced=traced)
    if s is not None:
        out[n] = scale_grad(K.rowdot(grad, last.kernel, traced, launch_bound=launch_bound))
        if last.learnable:
            fresh = n == 2 and not traced and not grad.requires_grad  # (autograd keeps no reference to it)
            grad = grad.mul_(K.channel_column(s)) if fresh else K.scale_channels(grad, s)
    if last.learnable:
        # the kernel's own gradient (a kxk without scale) is a scratch buffer's: handed out as a copy
        out[n - 1] = grad.clone() if scratch is not None and n == 1 and s is None and outs is None else grad
    return out


def plan_of(block: nn.Module, names: Sequence[str], launch_bound: bool = False) -> Plan:
    """The (cached) plan of one block's named branches (``launch_bound``: see :class:`Plan`)."""
    cache = block._plans
    if _is_replica(block):
        # a DataParallel replica (made anew at every forward) shares its original's dicts, plan cache
        # included, but reads the tensors broadcast to its device: plans of its own (its forward's and
        # its recomputing backward's)
        group = block._kernel_group
        if group is not None and group.packed is not None:
            raise RuntimeError(
                f"{type(block).__name__}: DataParallel cannot replicate packed parameters (their steps read the "
                f"original's rows on its device); use DistributedDataParallel, or "
                f"orepa.engine.group_kernels(model, pack=False) before wrapping")
        cache = block.__dict__.setdefault("_replica_plans", {})
    if torch.compiler.is_compiling():
        # traced by dynamo (a torch.compile'd model): the form written for a compiler, whose short
        # contractions and scale gradients inductor fuses into the element-wise passes around them;
        # made before the trace where group_kernels(traced=True) could (_prepare_traced_plans): made in
        # it, a plan costs dynamo thousands of instructions
        plan = None if _is_replica(block) else block.__dict__.get("_traced_plans", {}).get((tuple(names), launch_bound))
        return plan if plan is not None else Plan((block,), names, launch_bound, traced=True)
    return memo(cache, (tuple(names), launch_bound), lambda: Plan((block,), names, launch_bound))


def _prepare_traced_plans(block: nn.Module) -> None:
    """The traced plans (:func:`plan_of` inside a dynamo trace) of ``block``'s routes, made now: on a
    GPU its whole branch set, on a CPU every set :func:`choose_route` may squeeze (its two-layer
    branches may run on the feature map instead)."""
    names = tuple(block.branches)
    movable = [n for n, br in block.branches.items() if block._aligned and _may_run_on_features(br)]
    plans = {(names, True): Plan((block,), names, True, traced=True)}
    for k in range(len(movable) + 1):
        for off in itertools.combinations(movable, k):
            squeezed = tuple(n for n in names if n not in off)
            if squeezed:
                plans[(squeezed, False)] = Plan((block,), squeezed, False, traced=True)
    block._traced_plans = plans


def _is_replica(module: nn.Module) -> bool:
    """Whether ``module`` is a replica that ``torch.nn.DataParallel`` made for one of its devices."""
    return module.__dict__.get("_is_replica", False)


def squeeze(blocks: Sequence[nn.Module], names: Sequence[str]) -> Tensor:
    """Summed kernels of the named branches of ``blocks`` (one signature), concatenated along
    the output channels (see :meth:`Plan.squeeze`). Call without grad."""
    return (plan_of(blocks[0], names) if len(blocks) == 1 else Plan(blocks, names)).squeeze()


class GroupsFunction(torch.autograd.Function):
    """Kernels as one autograd node: ``build`` (an :class:`EagerBuild`, :class:`CompiledBuild`,
    :class:`GraphedBuild` or :class:`ChainedBuild`) makes them from ``storages`` (one per plan;
    ``None``: its operands concatenated anew); ``params`` are the plans' leaves in the same order,
    and get one gradient each. One block's plan, a group's, or a network's groups (see
    :func:`group_kernels`, ``joint``): their backward is one call too.

    Branch gradients come from dL/dW of the kernels through closed-form vjps: nothing but the
    operands is kept (for one block, the parameters themselves)."""

    @staticmethod
    def forward(ctx, build: EagerBuild | CompiledBuild | GraphedBuild | ChainedBuild,
                storages: tuple[Storage | None, ...], *params: Tensor):
        ctx.build, ctx.storages = build, storages
        ctx.set_materialize_grads(False)  # a kernel the loss did not reach: None, not zeros (see backward)
        # each plan's fixed kernels as read now, where no storage holds them (see backward)
        ctx.fixed = tuple(plan.fixed() if st is None else None for plan, st in zip(build.plans, storages))
        # the parameters are kept (no memory; autograd checks they are unchanged at backward), and
        # the operands read again there: from the group's storage, whose memory is theirs, or
        # concatenated anew without one (keeping per-step concatenations instead held a copy of
        # every online parameter through the step: on an H100, ResNet-18 b64, peak 1.32x base
        # instead of 1.13x)
        ctx.save_for_backward(*params)
        return build.kernels(storages)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        # the kernels' graph is spent (their grad_fn is this ctx): a group must not hand them out again
        ctx.spent = True
        saved = ctx.saved_tensors
        ref = saved[0]
        unused = [g is None for g in grads]  # kernels of blocks the loss did not reach
        grads = [g if g is not None else ref.new_zeros(shape) for g, shape in zip(grads, ctx.build.kernel_shapes)]
        if torch.is_grad_enabled():  # create_graph=True: these gradients are differentiated in turn
            out = _differentiable_vjp(ctx.build.plans, ctx.storages, ctx.fixed, saved, grads)
        else:
            # without a storage the operands are read anew, from the leaves the forward read: the blocks
            # may hold other tensors by now (functional_call gives them their own back before backward)
            storages = [plan.storage_from(leaves, fixed) if st is None else st
                        for plan, st, fixed, leaves in zip(ctx.build.plans, ctx.storages, ctx.fixed,
                                                           _leaves_per_plan(ctx.build.plans, ctx.storages, saved))]
            out = ctx.build.kernels_vjp(grads, storages)
        if any(unused):
            out = _none_where_unused(ctx.build.plans, ctx.storages, unused, out)
        return (None, None, *out)


def _none_where_unused(plans: Sequence[Plan], storages: Sequence[Storage | None], unused: Sequence[bool],
                       grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """:class:`GroupsFunction`'s gradients, None for the parameters of blocks whose kernels the loss did
    not reach (``unused``, one per kernel: per plan, per block), as each block built alone gives them:
    optimizers skip a parameter without a gradient (a zero one would still get weight decay and
    momentum: a head left out of a step moved). A packed parameter holds the rows of all its group's
    blocks: None only where none of them was reached."""
    out, i, k = list(grads), 0, 0
    for plan, st in zip(plans, storages):
        idle, k = unused[k:k + plan.n], k + plan.n
        if st is not None and st.packed:
            count = len(st.packed)
            if all(idle):  # (partly: no warning, a block called twice in a forward is in two builds)
                out[i:i + count] = [None] * count
        else:
            per_block = sum(plan.learnable_roles)
            count = plan.n * per_block
            for b in (b for b, off in enumerate(idle) if off):
                out[i + b * per_block:i + (b + 1) * per_block] = [None] * per_block
        i += count
    return out


def _leaves_per_plan(plans: Sequence[Plan], storages: Sequence[Storage | None],
                     leaves: Sequence[Tensor]) -> list[Sequence[Tensor]]:
    """:class:`GroupsFunction`'s leaves split by plan: a packed storage's packed parameters, or every
    block's parameters (:meth:`Plan.params` order)."""
    out, i = [], 0
    for plan, st in zip(plans, storages):
        count = len(st.packed) if st is not None and st.packed else plan.n * sum(plan.learnable_roles)
        out.append(leaves[i:i + count])
        i += count
    return out


def _autograd_twin(plan: Plan) -> Plan:
    """``plan`` evaluated in plain differentiable operators (its traced form: nothing written through
    out=, which autograd cannot follow), made once: for a backward that is itself differentiated."""
    twin = plan.__dict__.get("_twin")
    if twin is None:
        twin = plan._twin = Plan(plan.blocks, plan.names, plan.launch_bound, traced=True)
    return twin


def _differentiable_vjp(plans: Sequence[Plan], storages: Sequence[Storage | None],
                        fixed: Sequence[list[Tensor] | None], leaves: Sequence[Tensor],
                        grads: Sequence[Tensor]) -> list[Tensor | None]:
    """:class:`GroupsFunction`'s backward as a graph, under ``create_graph=True`` (gradient penalties,
    Hessian-vector products, meta-learning): the kernels built again with autograd from the leaves
    (each plan's :func:`_autograd_twin`) and differentiated. The closed-form vjps' numbers, rounding
    aside; that kind of backward alone pays the second construction."""
    kernels = []
    with torch.enable_grad():
        for plan, st, fx, mine in zip(plans, storages, fixed, _leaves_per_plan(plans, storages, leaves)):
            twin = _autograd_twin(plan)
            kernels.extend(twin.kernels(_storage_of_leaves(twin, st, mine, plan.fixed() if fx is None else fx)))
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(kernels, wanted, grads, create_graph=True, allow_unused=True))
    return [next(got) if t.requires_grad else None for t in leaves]


def _storage_of_leaves(plan: Plan, st: Storage | None, leaves: Sequence[Tensor], fixed: Sequence[Tensor]) -> Storage:
    """The operands of a build as differentiable functions of its ``leaves``: a packed storage's roles
    (and filter family) as views of the packed parameters they are rows of, any other storage's as
    the concatenations of the blocks' parameters (:meth:`Plan.storage_from`)."""
    if st is None or not st.packed:
        return plan.storage_from(leaves, fixed)
    by_memory = {p.untyped_storage().data_ptr(): p for p in leaves}

    def rows(t: Tensor) -> Tensor:  # a fixed kernel lies in no parameter: itself
        p = by_memory.get(t.untyped_storage().data_ptr())
        return t if p is None else p.as_strided(t.shape, t.stride(), t.storage_offset())

    roles = [rows(t) for t in st.roles]
    family = None if st.family is None else st.family._replace(weights=rows(st.family.weights),
                                                               scales=rows(st.family.scales))
    return Storage(roles, family, plan.operands(roles))


def squeeze_kernels(plan: Plan, stacked: Storage | None, *params: Tensor) -> tuple[Tensor, ...]:
    """``plan.kernels(stacked)`` with autograd (``params``: ``plan.params()``): one kernel per block."""
    return GroupsFunction.apply(plan.build, (stacked,), *params)


class _Build:
    """What :class:`GroupsFunction` reads of every build (eager, compiled, graphed, chained): its
    ``plans`` in order, their ``n`` blocks and those blocks' ``kernel_shapes``."""

    def __init__(self, plans: Sequence[Plan]):
        self.plans = tuple(plans)
        self.n = sum(p.n for p in self.plans)
        self.kernel_shapes = [shape for p in self.plans for shape in p.kernel_shapes]


class EagerBuild(_Build):
    """The eager constructions of several groups, one after the other (interchangeable with a
    :class:`CompiledBuild` in :class:`GroupsFunction`): ``plans[i]`` builds from ``storages[i]``,
    in the buffers of ``workspace`` where given (see :class:`Workspace`)."""

    def __init__(self, plans: Sequence[Plan], workspace: Workspace | None = None):
        super().__init__(plans)
        self.workspace = workspace

    def kernels(self, storages: Sequence[Storage | None]) -> tuple[Tensor, ...]:
        with _scratches(self.workspace, self.plans, storages, "forward") as scratches:
            return tuple(w for plan, stacked, sc in zip(self.plans, storages, scratches)
                         for w in plan.kernels(stacked, sc))

    def kernels_vjp(self, grads: Sequence[Tensor], storages: Sequence[Storage | None]) -> list[Tensor]:
        out, i = [], 0
        with _scratches(self.workspace, self.plans, storages, "backward") as scratches:
            for plan, stacked, sc in zip(self.plans, storages, scratches):
                out.extend(plan.kernels_vjp(grads[i:i + plan.n], stacked, sc))
                i += plan.n
        return out


class Scratch:
    """One plan's buffers in an :class:`Arena`: ``buf(key, shape)`` is a contiguous tensor at a place
    of the arena fixed at its first request, the same tensor at every call, marked to keep the views
    taken of it (``kernels.keep_views``). ``branch(i)``: the buffers of branch ``i``, which are dead
    once its part of a build is done (it returns fresh tensors), so every branch's buffers start at
    the same place, in the arena's second pool."""

    def __init__(self, arena: Arena, pool: int = 0):
        self.arena, self.pool, self.dtype = arena, pool, arena.base.dtype
        self.bufs: dict = {}
        self.cache: dict = {}  # what a plan works out once about its buffers (Plan._packed_places)
        self.kept: list[K.KeptViews] = []  # the views taken of the buffers live as long as this
        self.size = 0  # elements the buffers span, from the pool's start
        self._branches: dict[int, Scratch] = {}

    def buf(self, key, shape) -> Tensor:
        key = (key, tuple(shape))
        t = self.bufs.get(key)
        if t is None:
            t = self.arena.take(self.pool, self.size, key[1])
            self.size += t.numel()
            self.kept.append(K.keep_views(t))
            self.bufs[key] = t
        return t

    def branch(self, i: int) -> Scratch:
        sub = self._branches.get(i)
        if sub is None:
            sub = self._branches[i] = Scratch(self.arena, 1)
        return sub


class Arena:
    """Memory for the :class:`Scratch` es of one device and dtype: two pools (a plan's own buffers,
    its branches'), storages that every plan's buffers are placed in from their start (plans build
    one after the other, and nothing a build returns lives there), allocated when a build begins
    and, on a CUDA device, freed when it ends (resized to nothing: the buffers, views of them, keep
    their places and follow them), so they hold no memory at a step's peak. ``owner``: the thread
    building in it."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.base = torch.empty(0, device=device, dtype=dtype)
        self.storages = (self.base.untyped_storage(), torch.empty(0, device=device, dtype=dtype).untyped_storage())
        self.bases = (self.base, torch.empty(0, device=device, dtype=dtype).set_(self.storages[1]))
        self.elements = [0, 0]  # per pool, what the largest build so far needed
        # freed after each build where its allocator caches freed memory (CUDA: taking it again costs
        # ~nothing); a CPU's returns large blocks to the system, and taking them again costs page
        # faults (ResNet-18's 243 MiB: +130 ms a step on one thread), so there the arena stays
        self.frees = self.base.is_cuda
        self.lock = threading.Lock()
        self.owner: int | None = None

    def _reserve(self, pool: int) -> None:
        nbytes = self.elements[pool] * self.base.element_size()
        if self.storages[pool].nbytes() < nbytes:
            self.storages[pool].resize_(nbytes)

    def take(self, pool: int, offset: int, shape: tuple[int, ...]) -> Tensor:
        self.elements[pool] = max(self.elements[pool], offset + math.prod(shape))
        self._reserve(pool)
        strides = [1] * len(shape)
        for j in range(len(shape) - 2, -1, -1):
            strides[j] = strides[j + 1] * shape[j + 1]
        return self.bases[pool].as_strided(shape, strides, offset)

    def __getstate__(self):
        raise TypeError("an Arena is not copied (a Workspace copies as an empty one)")

    def __enter__(self) -> Arena:
        self.lock.acquire()
        self.owner = threading.get_ident()
        try:
            self._reserve(0)
            self._reserve(1)
        except BaseException:
            self.owner = None
            self.lock.release()
            raise
        return self

    def release(self) -> None:
        """Its memory given back (the buffers keep their places; the next build takes it again)."""
        for st in self.storages:
            st.resize_(0)

    def __exit__(self, exc_type, *exc) -> None:
        try:
            # (after a failure its buffers stay readable: tracebacks show them)
            if exc_type is None and self.frees:
                self.release()
        finally:
            self.owner = None
            self.lock.release()


class Workspace:
    """Where the eager builds of a network's groups put their intermediates on a host-bound device:
    per device and dtype an :class:`Arena`, per plan its :class:`Scratch` in it. Writing the
    reordered copies and products of a construction through out= into buffers that are the same
    tensors at every step lets every view of them be made once: an eager OREPA step dispatches about
    a quarter fewer operators (views and allocations; its kernels are the same). It also holds the
    network's recorders (:meth:`recorder`: the groups' recorded builds share their memory pool) and
    the lock around their replays. Copies and pickles of a model get an empty one."""

    def __init__(self):
        self.arenas: dict[tuple, Arena] = {}
        self.scratches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # plan -> {arena key: Scratch}
        self.recorders: dict[tuple, object] = {}
        self.buffers: dict[tuple, RecordingBuffer] = {}  # per device and use, what its recordings share
        self.replay_lock = threading.Lock()  # one network build's copies in, replays and copies out at a time
        # group_kernels(traced=True): the kernels built inside a dynamo trace during the root's forward, per
        # (group, block) with the tensors each was built from; whether that forward is running (opened and
        # closed by the root's hooks, whose handles these are: KernelGroup.traces_together)
        self.traced: dict[tuple[int, int], tuple[Tensor, tuple[Tensor, ...]]] = {}
        self.traced_together: dict[tuple, bool] = {}  # per (group, device, dtype): KernelGroup.traces_together
        self.forward_open = False
        self.root: weakref.ref | None = None  # the grouped root that holds the hooks (:class:`_ScopeHook`)
        self.traced_scope = False  # whether those hooks open and close that scope (group_kernels' traced)
        self.groups: list[KernelGroup] = []  # the network's groups (their root's pre-hook drops their kernels)
        # the parameters packing or unpacking took out of the model, until a look for optimizers holding
        # them (_warn_of_stale_optimizers); the blocks deployed one by one (fuse(): block_deployed)
        self.replaced: list[weakref.ref] = []
        self.deployed: weakref.WeakSet = weakref.WeakSet()
        self.said_frozen = False  # whether _check_trainability has warned for this network
        self.said_replaced = False  # whether _warn_of_stale_optimizers has warned for this network

    def recorder(self, kind: type, device: torch.device):
        """The network's recorder of type ``kind`` (e.g. :class:`CudaGraphRecorder`) for ``device``."""
        return memo(self.recorders, (kind, device), lambda: kind(device))

    def recording_buffer(self, device: torch.device, use: str) -> RecordingBuffer:
        """The buffer the network's recordings on ``device`` share for ``use``: ``"outputs"`` (their kernels
        and parameters' gradients) or ``"gradients in"`` (their kernels' gradients), see :class:`Recording`."""
        return memo(self.buffers, (device, use), lambda: RecordingBuffer(device))

    def __reduce__(self):
        # a copy starts empty but for the groups its root's hooks serve; nothing of the root: a copy of
        # a submodule must not copy it, and a copy of the root gets its root from the root's copied
        # hooks (_ScopeHook), which hold it
        return (Workspace, (), {"traced_scope": self.traced_scope, "groups": self.groups})

    def __setstate__(self, state: dict) -> None:
        hooks = state.pop("scope_hooks", ())  # pickled when it held its hooks' handles (release_scope removes them)
        self.__dict__.update(state)
        if hooks:
            self.legacy_hooks = tuple(hooks)
        if "traced_scope" not in state:  # pickled when only a traced root had hooks
            self.traced_scope = bool(hooks)

    def arena(self, key: tuple) -> Arena:
        """The arena of ``key`` = (device, dtype). A new one frees the memory of those before it that
        no build holds (the model moved, ``.to()`` or ``.float()``: a CPU's arena would stay)."""
        arena = self.arenas.get(key)
        if arena is None:
            for old in self.arenas.values():
                if old.lock.acquire(blocking=False):
                    try:
                        old.release()
                    finally:
                        old.lock.release()
            arena = self.arenas[key] = Arena(*key)
        return arena

    def scratch(self, plan: Plan, key: tuple, phase: str) -> Scratch:
        """``plan`` 's buffers in the arena of ``key`` for its builds' ``phase`` (``"forward"`` or
        ``"backward"``: never at once, so the two are placed alike, from the pools' starts)."""
        per_plan = self.scratches.get(plan)
        if per_plan is None:
            per_plan = self.scratches[plan] = {}
        sc = per_plan.get((key, phase))
        if sc is None:
            sc = per_plan[(key, phase)] = Scratch(self.arena(key))
        return sc


@contextlib.contextmanager
def _scratches(workspace: Workspace | None, plans: Sequence[Plan], storages: Sequence[Storage | None], phase: str):
    """Per plan its :class:`Scratch` for a build's ``phase`` from ``storages`` (None: no storage, or a plan traced for a
    compiler), in the arena held for the build; all None without a workspace or inside a CUDA-graph
    capture (a captured build must not resize memory the graph reads at replay)."""
    ref = next((st.roles[0] for st in storages if st is not None), None)
    if workspace is None or ref is None or (ref.is_cuda and torch.cuda.is_current_stream_capturing()):
        yield (None,) * len(plans)
        return
    key = (ref.device, ref.dtype)
    arena = workspace.arena(key)
    if arena.owner == threading.get_ident():  # a build inside a build (none known): its own memory
        yield (None,) * len(plans)
        return
    with arena:
        yield tuple(None if st is None or plan.traced or st.roles[0].dtype != ref.dtype
                    or st.roles[0].device != ref.device else workspace.scratch(plan, key, phase)
                    for plan, st in zip(plans, storages))


class RecomputedSqueezeConv(torch.autograd.Function):
    """``conv(x, squeeze(params))`` that keeps only ``x`` for backward and rebuilds the kernel
    there: a block then costs the memory of a plain conv. Honours autocast explicitly."""

    @staticmethod
    def forward(ctx, x: Tensor, block: nn.Module, names: tuple[str, ...], bias: Tensor | None, *params: Tensor):
        plan = plan_of(block, names, _launch_bound(x))
        w = plan.squeeze()
        ctx.fixed = plan.fixed()  # as read now (see GroupsFunction.backward)
        device = x.device.type
        # (autocast leaves float64 as it is)
        cast = torch.is_autocast_enabled(device) and x.dtype is not torch.float64
        dtype = torch.get_autocast_dtype(device) if cast else x.dtype
        with torch.autocast(device, enabled=False):
            y = F.conv2d(x.to(dtype), w.to(dtype), None if bias is None else bias.to(dtype),
                         block.stride, block.conv_padding, block.dilation, block.groups)
        ctx.block, ctx.names, ctx.conv_dtype, ctx.has_bias = block, names, dtype, bias is not None
        # x itself is kept, not its autocast copy: the layer before usually keeps x anyway, so
        # this adds no memory (and torch.compile cannot save an alias of an input made here)
        ctx.save_for_backward(x, *params)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, *params = ctx.saved_tensors
        block, dtype = ctx.block, ctx.conv_dtype
        plan = plan_of(block, ctx.names, _launch_bound(x))
        if torch.is_grad_enabled():  # create_graph=True: the closed form in differentiable operators
            plan = _autograd_twin(plan)
        stacked = plan.storage_from(params, ctx.fixed)  # what the forward read (not what the block holds by now)
        w = plan.squeeze(stacked)
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad_y.to(dtype), x.to(dtype), w.to(dtype), [block.out_channels] if ctx.has_bias else None,
            list(block.stride), list(block.conv_padding), list(block.dilation), False, [0, 0], block.groups,
            [ctx.needs_input_grad[0], True, ctx.has_bias],
        )
        grads = plan.vjp(gw.to(w.dtype), stacked)
        gx = None if gx is None else gx.to(x.dtype)
        gb = gb.to(w.dtype) if ctx.has_bias else None
        return (gx, None, None, gb, *grads)


# --------------------------------------------------------------------------- routes of one block

# Cost of one memory-bound pass over one kernel element, in multiply-adds of a matrix
# product (CPU: ~0.6 ns per element and pass vs ~0.05 ns per MAC); used by the chain-order choice.
_ELEMENT_PASS_MACS = 16


def _launch_bound(t: Tensor) -> bool:
    """Whether ``t``'s device runs an eager step at the pace its host issues operators (a GPU:
    launches decide how a kernel is built) rather than at that of their FLOPs (a CPU)."""
    return t.is_cuda


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jacrev, ...) is running: the engine's autograd
    Functions define no vmap rule, so blocks then squeeze by the plain-autograd reference path."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active and active())


def reference_path() -> bool:
    """Whether blocks squeeze by the plain-autograd reference path instead of the engine: inside a
    ``torch.func`` transform (:func:`functorch_active`), or with forward-mode AD on (a
    ``torch.autograd.forward_ad.dual_level``: the engine's autograd Functions define no jvp, and a
    parameter may carry a tangent, e.g. forward gradients through ``functional_call``)."""
    return functorch_active() or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass or under saved-tensor hooks: activation
    checkpointing (its recomputation must save exactly what its first pass saved; a reentrant
    one runs its own backward, which must not reach a group's shared node) or offloading. There
    each block builds its own kernel in its own forward."""
    if torch._C._current_graph_task_id() != -1:
        return True
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _grouped(block: nn.Module, ref: Tensor) -> KernelGroup | None:
    group = block._kernel_group
    if group is not None and torch.compiler.is_compiling():
        return group if group.traces_together(ref) and not _is_replica(block) else None
    if group is None or not group.active(ref) or _is_replica(block):
        # a DataParallel replica shares its original's group, which builds from the original's
        # tensors: it takes its own route, from its own (see plan_of)
        return None
    if _recomputing():
        group.decline()
        return None
    return group


def train_forward(block: nn.Module, x: Tensor) -> Tensor:
    """A training (grad-enabled) forward of an online block with closed-form branches.

    In a :class:`KernelGroup` that is active for ``x``'s device (a GPU by default): the group's
    kernel, a plain conv. Otherwise each block takes its own route: per branch the cheaper
    matrix-chain order for this input (:func:`route`), the squeezed part optionally rebuilt in
    backward instead of kept (:func:`needs_recompute`). On a GPU (per-block policy, a checkpointed
    region, a block compiled outside its root's forward) that route is the group's, block by block:
    launches decide.
    """
    group = _grouped(block, x)
    if group is not None:
        # the kernel space on a GPU: launches, not FLOPs, decide
        return F.conv2d(x, group.kernel_of(block), block.bias, block.stride, block.conv_padding, block.dilation,
                        block.groups)
    recompute = needs_recompute(block, x)
    squeezed, on_features = route(block, x, recompute)
    y = None
    if squeezed:
        plan = plan_of(block, squeezed, _launch_bound(x))
        if recompute:
            y = RecomputedSqueezeConv.apply(x, block, tuple(squeezed), block.bias, *plan.params())
        else:
            (w,) = squeeze_kernels(plan, None, *plan.params())
            y = F.conv2d(x, w, block.bias, block.stride, block.conv_padding, block.dilation, block.groups)
    for name in on_features:
        z = block.branches[name].run(x, block.stride[0], block.dilation[0])
        y = z if y is None else y + z
    if not squeezed and block.bias is not None:
        y = y + block.bias.view(1, -1, 1, 1)
    return y


def train_kernel(block: nn.Module) -> Tensor:
    """The squeezed kernel of a closed-form online block with autograd (a block nested as a step)."""
    group = block._kernel_group
    # its group's plan where it has one: inside a dynamo trace plan_of makes a plan, which costs the trace
    # more than the kernel's own operators (a DataParallel replica is not among its group's blocks)
    i = None if group is None else group._index.get(id(block))
    plan = None if i is not None else plan_of(block, tuple(block.branches))
    ref = group.plan.ref(i) if plan is None else plan.ref()
    group = _grouped(block, ref)
    if group is not None:
        return group.kernel_of(block)
    if plan is None:
        plan = plan_of(block, tuple(block.branches))
    if _launch_bound(ref):
        plan = plan_of(block, tuple(block.branches), True)
    return squeeze_kernels(plan, None, *plan.params())[0]


def needs_recompute(block: nn.Module, x: Tensor) -> bool:
    """Rebuild the kernel in backward instead of keeping it (auto: when it outweighs the input, on a
    CPU; a GPU keeps it, as a group does: rebuilding costs launches, and a kernel is small beside a
    GPU batch's activations)."""
    if block.recompute != "auto":
        return bool(block.recompute)
    if _launch_bound(x):
        return False
    w_numel = block.out_channels * (block.in_channels // block.groups) * block.kernel_size[0] * block.kernel_size[1]
    return w_numel > x.numel()


def route(block: nn.Module, x: Tensor, recompute: bool) -> tuple[list[str], list[str]]:
    """Matrix-chain order per branch: ``(squeezed in kernel space, run on the feature map)``.

    A 1x1 -> kxk branch costs ``C_out k^2 C_mid C_in`` MACs to compose whatever the batch; on the
    feature map it costs ``N H W`` times its kernels' sizes. Both give the same function (no BN
    inside), so the cheaper one for this input is taken (small batches and deep layers run such
    branches on the feature map). Depends on shapes only, so it is computed once per input shape
    (``block._routes``). On a GPU every branch is squeezed: the fewest launches.
    """
    squeezed, on_features = memo(block._routes, _route_key(x, recompute),
                                 lambda: choose_route(block, x.shape, recompute, _launch_bound(x)))
    return list(squeezed), list(on_features)


def _route_key(x: Tensor, recompute: bool) -> tuple:
    return tuple(x.shape), recompute, _launch_bound(x)


def force_route(block: nn.Module, x: Tensor, recompute: bool, on_features: Sequence[str]) -> None:
    """Make :func:`route` answer ``on_features`` (the rest squeezed) for inputs like ``x``: for timing
    other routes than the chosen one (``benchmarks/block_cost.py --force``); ``block._routes.clear()``
    undoes it."""
    block._routes[_route_key(x, recompute)] = ([n for n in block.branches if n not in on_features],
                                                [n for n in block.branches if n in on_features])


def _may_run_on_features(br: nn.Module) -> bool:
    """Whether branch ``br`` may run on the feature map instead of its kernel's (:func:`choose_route`): two
    steps, the first learnable, padded where its kernel would be."""
    steps, _ = br._split()
    return len(steps) == 2 and _learnable(steps[0]) and br._pad_step is not None


def choose_route(block: nn.Module, shape: torch.Size, recompute: bool,
                 launch_bound: bool = False) -> tuple[list[str], list[str]]:
    if launch_bound or not block._aligned:  # other than "same" padding, the kernel route is the only one
        return list(block.branches), []
    n, _, h, w = shape
    s = block.stride[0]
    ho, wo = (h - 1) // s + 1, (w - 1) // s + 1
    kernel_passes = 4 if recompute else 3  # forward, 2 in backward, (+1 rebuild)
    squeezed, on_features = [], []
    for name, br in block.branches.items():
        if _may_run_on_features(br):
            a, b = br._split()[0]
            first_pixels = n * ho * wo if br._subsample_first else n * h * w
            feature_macs = first_pixels * a.weight.numel() + n * ho * wo * b.weight.numel()
            if K.compose_case(a.weight.shape, a.groups, b.weight.shape, b.groups) == "depthwise_after_1x1":
                # a per-channel filter after a 1x1 is a broadcast product in kernel space: memory
                # bound, about _ELEMENT_PASS_MACS per element and pass (forward, backward, rebuild)
                out_numel = a.weight.numel() * b.weight[0].numel()
                compose_cost = out_numel * _ELEMENT_PASS_MACS * (kernel_passes - 1)
            else:
                # a matrix product contracting over C_mid / groups; short contractions
                # (dw x8 -> pw: 8) run far below peak
                contraction = a.out_channels // max(a.groups, b.groups)
                compose_cost = kernel_passes * b.weight.numel() * a.weight[0].numel() * 256 / min(256, contraction)
            if 3 * feature_macs < compose_cost:
                on_features.append(name)
                continue
        squeezed.append(name)
    return squeezed, on_features


# --------------------------------------------------------------------------- network-level builder


class KernelGroup:
    """Online blocks of one construction signature whose kernels are built together (or one block).

    A group builds every block's kernel at once (with its peers, one :class:`GroupsFunction`); its
    blocks take theirs. A kernel is handed out once and only while its block's parameters are
    unchanged (their version counters) and its build has not been through a backward, so a block
    called twice, a forward that stopped halfway, a block skipped in one step and run in the next,
    or a parameter changed in between rebuilds instead of reusing a stale kernel or a graph already
    freed by backward; the grouped root's forward drops kernels built before it (weights written
    through ``.data`` or by ``.to()`` bump no counter: :func:`forward_scope`). The first miss of a
    training forward also builds the kernels of every other group of the network (``peers``) that
    holds none: the whole network's kernels are built while few activations are alive, so the
    construction's temporaries do not add to the step's peak.
    """

    def __init__(self, blocks: Sequence[nn.Module], policy: str = "auto"):
        if policy not in POLICIES:
            raise ValueError(f"kernel-builder policy must be one of {POLICIES}, got {policy!r}")
        self.blocks = tuple(blocks)
        self.names = tuple(self.blocks[0].branches)
        self.policy = policy
        self.plan = Plan(self.blocks, self.names, launch_bound=True)
        # the shapes of its blocks' tensors (block-major, per role), and of its packed parameters
        # (pack()): what a build checks its operands against where they are not its storage's views
        self._shapes = tuple(t.shape for b in range(self.plan.n) for t in self.plan.tensors_of(b))
        self._packed_shapes: tuple[torch.Size, ...] = ()
        self._index = {id(b): i for i, b in enumerate(self.blocks)}
        self._pending: dict[int, tuple[tuple, Tensor]] = {}
        self.peers: list[KernelGroup] = [self]  # the groups of one network (group_kernels sets them)
        self.prebuild = True  # built by a peer's first miss; off once a block declined a kernel
        # the storage the blocks' tensors are views of (made at the first build, see _stacked)
        # and the tensors' addresses then
        self._storage: Storage | None = None
        self._addresses: tuple[int, ...] = ()
        # whether the groups built at one miss (this one and its peers) are one autograd node
        # (group_kernels' ``joint``)
        self.joint = True
        # policy "compiled": the compiled constructions of the builds this group leads, per plans and
        # storage layouts, the one of the last build's storages, and whether compiling failed
        self._compiled: dict[tuple, CompiledBuild] = {}
        self._compiled_for: tuple[tuple[Storage, ...], CompiledBuild] | None = None
        self._graphed_for: tuple[tuple[Storage, ...], GraphedBuild] | None = None
        self._recording: Recording | None = None  # its construction recorded for its storage (graphs)
        self._compile_failed = False
        # where its eager builds put their intermediates: one for the network's groups (group_kernels)
        self.workspace: Workspace | None = None
        # group_kernels' ``graphs``: its construction recorded (Recording) by the workspace's recorder of
        # this type where it supports the tensors; how many recordings it made, and whether it stopped
        self.graphs = False
        self.graph_recorder: type = CudaGraphRecorder
        self._recordings = 0
        self._graphs_off = False
        # pack(): the group's learnable operands as a few parameters; where each role's rows are in
        # them (name, first row, rows), the filter family's 1x1 weights' and scales', and what the
        # squeeze's packed gradients concatenate (Storage.packed)
        self.packed: PackedParameters | None = None
        self._packed_roles: dict[int, tuple[str, int, int]] = {}
        self._packed_family: tuple[tuple[str, int, int], tuple[str, int, int]] | None = None
        self._packed_layout: tuple[tuple[int, ...], ...] = ()
        self._trainable_packed: tuple[tuple[str, bool], ...] = ()  # _packed_state() when last looked at
        # the blocks' names under the root group_kernels was given (for messages)
        self.block_names: tuple[str, ...] = ()
        self.index_in_peers = 0  # its place among its peers (group_kernels): its kernels' key in a trace
        # the parameters pack() or unpack() took out of the model, until group_kernels (or, for a group
        # packed by hand, its next build) looks whether an optimizer made before holds them
        self._replaced: tuple[weakref.ref, ...] = ()

    def __getstate__(self):
        # copies and pickles drop kernels that hold an autograd graph, and the storage: a copy's
        # tensors are remade into storage of their own at its first build (compiled code is not
        # picklable either; a copy compiles again)
        return {**self.__dict__, "_pending": {}, "_index": None, "_storage": None, "_addresses": (),
                "_compiled": {}, "_compiled_for": None, "_graphed_for": None, "_recording": None, "_replaced": ()}

    def __setstate__(self, state):
        self.__dict__.update(state)
        for key, value in (("workspace", None), ("graphs", False), ("graph_recorder", CudaGraphRecorder),
                           ("_recordings", 0), ("_graphs_off", False), ("_graphed_for", None),
                           ("_recording", None), ("block_names", ()), ("index_in_peers", 0), ("_replaced", ())):
            self.__dict__.setdefault(key, value)  # a group pickled before it had them
        self.__dict__.pop("_packed_own", None)  # (a copy's tensors are others: its first look takes them)
        self.__dict__.setdefault("_trainable_packed", ())
        self._index = {id(b): i for i, b in enumerate(self.blocks)}  # ids of the copied blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def active(self, ref: Tensor) -> bool:
        """Whether blocks on ``ref``'s device build their kernels here (training forwards only)."""
        return not torch.compiler.is_compiling() and builds_together(self.policy, ref.device)

    def traces_together(self, ref: Tensor) -> bool:
        """Inside a dynamo trace: whether this group's blocks take their kernels from a build of the
        network's groups traced into the graph (:meth:`_traced_kernel_of`): grouped with ``traced=True``,
        where its eager blocks would build as a group, its tensors on one device and of one dtype (else
        each block builds its own, as eagerly), and only within a forward of the root that
        :func:`group_kernels` was given (its hooks open and close the scope the traced kernels live in)."""
        ws = self.workspace
        if ws is None or not ws.forward_open or not builds_together(self.policy, ref.device):
            return False
        # looked at once per forward, by the root's pre-hook (:func:`_open_forward`): every block of the
        # group asks, and dynamo's instructions over the group's tensors cost more than the tensors' own
        # tracing (ResNet-18: 58k of 298k instructions); not written here, where the caller may be inside an
        # activation-checkpointed region of a graph (a write there would make dynamo run it all eagerly)
        together = ws.traced_together.get((self.index_in_peers, ref.device, ref.dtype))
        return self._of_one_kind(ref) if together is None else together

    def _of_one_kind(self, ref: Tensor) -> bool:
        """Whether every tensor of the group is on ``ref``'s device and of its dtype."""
        return all(t.device == ref.device and t.dtype == ref.dtype
                   for b in range(self.plan.n) for t in self.plan.tensors_of(b))

    def _sources(self, b: int) -> tuple[Tensor, ...]:
        """What block ``b``'s kernel is built from, as objects: its packed parameters (unless a step reads
        a tensor set in place of its rows) or its own tensors, then its fixed kernels."""
        if self.packed is not None and not self._overridden():
            fixed = (t for t, learnable in zip(self.plan.tensors_of(b), self.plan.learnable_roles) if not learnable)
            return (*self.packed._parameters.values(), *fixed)
        return tuple(self.plan.tensors_of(b))

    def _traced_kernel_of(self, i: int) -> Tensor:
        """Block ``i``'s kernel inside a dynamo trace: the first block to ask builds the kernels of
        every group of the network that traces together (a :class:`GroupsFunction` per group over its
        plan's traced twin, :func:`_autograd_twin`; only its own group's without ``joint``), keeping
        them in the workspace for their blocks to read. Between graphs (a graph break) they stay there
        as the graph's outputs; the root's hooks drop them at the forward's start and end, so no kernel
        outlives its forward. A kernel serves while its block reads the tensors it was built from (the
        same objects: a second pass with other tensors, e.g. ``functional_call``, builds again); their
        values do not change within a forward (the optimizer steps between forwards).

        Read, not taken out: a block inside a higher-order operator's body (an activation-checkpointed
        region) may read what the graph holds but not change it, and a block called twice reuses its
        kernel. A build inside such a region (its first online block) changes the workspace: dynamo
        then breaks the graph there and runs the region eagerly."""
        held = self.workspace.traced
        kernel = self._held_traced(i)
        if kernel is None:
            # built eagerly earlier in this forward (the root runs eagerly, a compiled part of it now):
            # read, not built again (the pre-hook drops every eager kernel at the root's forward start)
            pending = self._pending.get(i)
            if pending is not None:
                return pending[1]
            # this group, and every group of the network that traces together and holds no kernels yet
            groups = [self, *(g for g in self.peers if self.joint and g is not self and g.prebuild and not g._pending
                              and (g.index_in_peers, 0) not in held and g.traces_together(g.plan.ref()))]
            # a Function per group, not one for them all: inside a compiled graph the autograd nodes are the
            # compiler's (one forward, one backward, whatever ``joint``), and dynamo's model of a Function
            # compares each output with each input (ResNet-18's 20 kernels x 300 parameters: 107k instructions)
            for g in groups:
                plan = _autograd_twin(g.plan)
                kernels = GroupsFunction.apply(EagerBuild((plan,)), (None,), *plan.params())
                for j in range(plan.n):
                    held[(g.index_in_peers, j)] = (kernels[j], g._sources(j))
            kernel = held[(self.index_in_peers, i)][0]
        return kernel

    def _held_traced(self, i: int) -> Tensor | None:
        """Block ``i``'s kernel as a graph of this root's forward built it (:meth:`_traced_kernel_of`),
        while the block reads the tensors it was built from; else None."""
        ws = self.workspace
        entry = None if ws is None or not ws.forward_open else ws.traced.get((self.index_in_peers, i))
        if entry is None:
            return None
        mine = self._sources(i)
        return entry[0] if len(entry[1]) == len(mine) and all(a is b for a, b in zip(entry[1], mine)) else None

    def kernel_of(self, block: nn.Module) -> Tensor:
        i = self._index[id(block)]
        if torch.compiler.is_compiling():
            return self._traced_kernel_of(i)
        entry = self._pending.pop(i, None)
        # still valid: the parameters unchanged and the build's graph not yet through a backward
        # (blocks skipped in one step and run in the next, gradients accumulated in between)
        if entry is not None and entry[0] == self._versions(i) and not getattr(entry[1].grad_fn, "spent", False):
            return entry[1]
        # a graph of this forward built it (a block that runs eagerly after a compiled part of the root:
        # past a graph break, or past dynamo's recompile limit)
        kernel = self._held_traced(i)
        if kernel is not None:
            return kernel
        traced = self.workspace.traced if self.workspace is not None and self.workspace.forward_open else {}
        others = [group for group in self.peers if group is not self and group.prebuild and not group._pending
                  and (group.index_in_peers, 0) not in traced and group.active(group.plan.ref())]
        if self.joint:
            _build_groups([self, *others])
        else:
            for group in (self, *others):
                _build_groups([group])
        return self._pending.pop(i)[1]

    def decline(self) -> None:
        """A block of this group builds its own kernel (inside a checkpointed region): building
        this group's kernels ahead would only hold memory."""
        self.prebuild = False
        self._pending = {}

    def _versions(self, i: int) -> tuple:
        """Version counters of what block ``i``'s kernel is built from (its group's, when packed)."""
        if self.packed is not None and not self._overridden():
            return tuple(map(_version, self.packed._parameters.values()))
        return self.plan.versions(i)

    def _overridden(self) -> bool:
        """Whether a packed step reads a tensor set in place of its rows (``functional_call``)."""
        return self.packed.__dict__.get("overrides", 0) > 0

    def _operands(self) -> tuple[Storage | None, list[Tensor], tuple[tuple, ...]] | None:
        """What a build of this group's kernels reads: ``(storage, leaves, versions)``, the leaves
        getting the gradients and ``versions[j]`` the version counters block ``j``'s kernel is valid
        for; None where the blocks' tensors are on several devices or dtypes (:meth:`_build_apart`)."""
        plan = self.plan
        if self._replaced:  # a group packed by hand (group_kernels looks for a network's: _open_forward)
            replaced, self._replaced = self._replaced, ()
            _warn_of_stale_optimizers(replaced, self.workspace, self.packed is not None)
        if self.packed is not None and not self._overridden():
            leaves = list(self.packed._parameters.values())
            stacked = self._storage
            if stacked is None or not self._holds([*leaves, *self.plan.fixed()]):
                if self._under_fsdp2():
                    # the steps save and load their rows of the packed parameters under their own keys:
                    # rows of FSDP2's sharded parameters are no views of them (a load wrote into copies,
                    # a state_dict after a forward read freed memory)
                    raise RuntimeError(
                        f"{self.block_names[0] if self.block_names else type(self.blocks[0]).__name__}: packed "
                        "parameters under FSDP2 (fully_shard): their steps' state_dict keys read and write rows "
                        "of the packed parameters, which FSDP2's shards are not; group without packing "
                        "(orepa.group_kernels(model, policy), pack=False, the default of create_model and "
                        "convert) before fully_shard")
                self._check_gathered(leaves, self.__dict__.get("_packed_shapes", ()), packed=True)
                stacked = self._packed_storage()
            return stacked, leaves, (tuple(map(_version, leaves)),) * plan.n
        tensors = [t for b in range(plan.n) for t in plan.tensors_of(b)]  # block-major, every role
        leaves = [t for t, learnable in zip(tensors, itertools.cycle(plan.learnable_roles)) if learnable]
        ref = tensors[0]
        # the common case: nothing moved since the storage was made (not a packed group's storage,
        # read here only while a step reads a tensor set in place of its rows)
        held = self.packed is None and self._holds(tensors)
        if not held:
            self._check_gathered(tensors, self.__dict__.get("_shapes", ()), packed=False)
        if not held and not all(t.device == ref.device and t.dtype == ref.dtype for t in tensors):
            return None
        # (a packed group's steps reading tensors set in their place: concatenated for this build only)
        stacked = None if self.packed is not None else self._storage if held else self._stacked(tensors)
        m = len(leaves) // plan.n  # leaves are block-major: block j's are leaves[j*m:(j+1)*m]
        return stacked, leaves, tuple(tuple(map(_version, leaves[j * m:(j + 1) * m])) for j in range(plan.n))

    def _packed_state(self) -> tuple[tuple[str, bool], ...]:
        """Per packed parameter, its name and whether it trains (_check_trainability)."""
        params = self.packed._parameters if self.packed is not None else {}
        return tuple((name, p.requires_grad) for name, p in params.items())

    def _build_apart(self) -> None:
        """Blocks on several devices or dtypes: each builds its own kernel."""
        plan = self.plan
        for j, one in enumerate(plan_of(b, self.names) for b in plan.blocks):
            self._pending[j] = (plan.versions(j), squeeze_kernels(one, None, *one.params())[0])

    def pack(self) -> bool:
        """Make the group's learnable operands a few ``nn.Parameter`` s, held by the child
        ``packed_parameters`` of the group's first block: one per kind (scales or conv weights), row
        shape and trainability, the concatenation along dim 0 of the roles' tensors of that kind
        (each role: its blocks' tensors concatenated), e.g. ``scales`` (every branch's scales),
        ``weights_64x3x3`` (the kxk and 1x1 -> kxk branches' 3x3 kernels of 64 input channels).
        Each step's ``weight`` is then its rows (``orepa.blocks.PackableWeight``), read and written
        as before (state_dict keys, ``reparameterize``, deployment and every per-block route are
        unchanged).

        Why: autograd, the optimizer and ``zero_grad`` pay per parameter tensor, and an eager GPU step
        is bound by that host time; ResNet-18's online blocks hold 249 parameters more than its convs,
        packed they hold five per group. Parameters of one kind and row shape keep what optimizers
        and weight-decay rules read (``ndim``, ``kinds``). The optimizer must be made after packing
        (it holds the parameters it was given: one made before is warned of by ``group_kernels``);
        ``torch.func.functional_call`` takes the packed names or the
        state_dict's (the steps' own, see :class:`PackedSlot`). Returns
        whether the group packed: a group of one block without a filter family has nothing to pack,
        and tensors on several devices or dtypes, frozen in some blocks only (or in some branches of
        the filter family only), or that the blocks do not own (``functional_call``, FSDP) stay as
        they are."""
        plan = self.plan
        if self.packed is not None:
            return True
        if plan.n == 1 and not plan.family:
            return False
        tensors = [t for b in range(plan.n) for t in plan.tensors_of(b)]
        ref = tensors[0]
        if not all(t.device == ref.device and t.dtype == ref.dtype for t in tensors):
            return False
        roles = len(tensors) // plan.n
        if any(len({t.requires_grad for t in tensors[r::roles]}) > 1 for r in range(roles)):
            return False  # some blocks frozen, others not: a role's rows in one parameter cannot say which
        if any(len({tensors[r].requires_grad for r in rs}) > 1
               for rs in ([w for w, _, _ in plan.family], [s_ for _, _, s_ in plan.family])):
            return False  # the filter family's 1x1 weights (its scales) pack as one operand: alike or not at all
        stacked = self._stacked(tensors, packing=True)  # the blocks' tensors become views of one storage per role
        if stacked is None:
            return False
        # the learnable operands in the order of the squeeze's packed gradients (Storage.packed): the
        # roles outside the filter family, then the family's 1x1 weights and its scales
        in_family = {r for w, _, s_ in plan.family for r in (w, s_)}
        operands = [(r, stacked.roles[r], plan.role_modules[r][0])
                    for r, learnable in enumerate(plan.learnable_roles) if learnable and r not in in_family]
        if stacked.family is not None:
            fam, (w_role, _, s_role) = stacked.family, plan.family[0]
            operands += [(None, fam.weights.reshape(-1, fam.weights.shape[-1], 1, 1), plan.role_modules[w_role][0]),
                         (None, fam.scales, plan.role_modules[s_role][0])]
        operands = [(r, t.reshape(-1) if _kind(mod) == "scale" else t, mod) for r, t, mod in operands]
        # one parameter per kind (scales, or conv weights whose rows have one shape) and trainability,
        # the concatenation of its operands' rows: a step reads its rows wherever they are, and fewer
        # tensors cost the host less (scales of every branch in one, the 3x3 kernels of kxk and of
        # 1x1 -> kxk in one, ...); weight decay by kind or by dimension still tells them apart
        by_key: dict[tuple, list[int]] = {}
        for i, (_, t, mod) in enumerate(operands):
            by_key.setdefault((_kind(mod), tuple(t.shape[1:]), _weight(mod).requires_grad), []).append(i)
        holder, where, layout = PackedParameters(), {}, []
        with torch.no_grad():
            for (kind, rows, trainable), members in by_key.items():
                name = ("scales" if kind == "scale" else "weights_" + "x".join(map(str, rows))) + \
                    ("" if trainable else "_frozen")
                ts = [operands[i][1] for i in members]
                holder.register_parameter(name, nn.Parameter(ts[0] if len(ts) == 1 else torch.cat(ts), trainable))
                holder.kinds[name] = kind
                lo = 0
                for i, t in zip(members, ts):
                    where[i] = (name, lo, t.shape[0])
                    lo += t.shape[0]
                layout.append(tuple(members))
        # every step of a packed role reads its rows from now on
        roles = {r: where[i] for i, (r, _, _) in enumerate(operands) if r is not None}
        starts = {r: (name, lo) for r, (name, lo, _) in roles.items()}  # role -> (parameter, block 0's first row)
        family = (where[len(operands) - 2], where[len(operands) - 1]) if stacked.family is not None else None
        for j, (w_role, _, s_role) in enumerate(plan.family):
            size = sum(mod._parameters["weight"].shape[0] for mod in plan.role_modules[w_role])
            (w_name, w_lo, _), (s_name, s_lo, _) = family
            starts[w_role], starts[s_role] = (w_name, w_lo + j * size), (s_name, s_lo + j * size)
        replaced = []
        for r, (name, start) in starts.items():
            for mod in plan.role_modules[r]:
                size = mod._parameters["weight"].shape[0]
                replaced.append(weakref.ref(mod._parameters.pop("weight")))
                mod._packed = PackedSlot(holder, name, start, size)
                start += size
        self.blocks[0].packed_parameters = holder
        self._packed_shapes = tuple(p.shape for p in holder._parameters.values())
        self.packed, self._packed_roles, self._packed_family, self._packed_layout = holder, roles, family, tuple(layout)
        self._trainable_packed = self._packed_state()
        self._replan()
        self._packed_storage()
        self._replaced += tuple(replaced)
        return True

    def unpack(self) -> None:
        """Undo :meth:`pack`: every step holds its own ``nn.Parameter`` again (views of the packed
        values; a new optimizer is needed, as after packing)."""
        if self.packed is None:
            return
        for mods in self.plan.role_modules:
            for mod in mods:
                slot = mod.__dict__.pop("_packed", None)
                if slot is not None:
                    leaf = slot.holder._parameters[slot.name]
                    mod._parameters["weight"] = nn.Parameter(slot.view().detach(), leaf.requires_grad)
        self._replaced += tuple(map(weakref.ref, self.packed._parameters.values()))
        del self.blocks[0]._modules["packed_parameters"]
        self.packed, self._packed_roles, self._packed_family, self._packed_layout = None, {}, None, ()
        self._replan()
        self._storage = None

    def prepare_trace(self) -> None:
        """What a dynamo trace of the group reads, made before it (made inside, a plan costs the trace
        thousands of instructions): its plan's traced twin (:meth:`_traced_kernel_of`) and its blocks'
        traced plans (:func:`plan_of`)."""
        _autograd_twin(self.plan)
        for b in self.blocks:
            _prepare_traced_plans(b)

    def _replan(self) -> None:
        """New plans after the steps' weights moved (plans hold where each tensor lives)."""
        self.plan = Plan(self.blocks, self.names, launch_bound=True)
        for b in self.blocks:
            b._plans.clear()
        if self.workspace is not None and self.workspace.traced_scope:  # grouped with traced=True
            self.prepare_trace()
        self._pending, self._compiled, self._compiled_for, self._graphed_for = {}, {}, None, None
        self._recording = None

    def _packed_storage(self) -> Storage:
        """The storage of a packed group: its packed parameters as they are (no copy), the fixed
        kernels concatenated (their buffers re-pointed into it, outside a CUDA graph capture)."""
        plan, leaves = self.plan, self.packed._parameters
        roles: list[Tensor | None] = [None] * len(plan.learnable_roles)
        def rows(name: str, lo: int, size: int) -> Tensor:
            t = leaves[name].detach()
            return t if size == t.shape[0] else t.narrow(0, lo, size)

        for r, where in self._packed_roles.items():
            roles[r] = rows(*where)
        family_wts = None
        if plan.family:
            j = len(plan.family)
            w, s_ = (rows(*where) for where in self._packed_family)
            family_wts = (w.view(j, -1, *w.shape[1:]), s_.view(j, -1))
            for i, (w_role, _, s_role) in enumerate(plan.family):
                roles[w_role], roles[s_role] = family_wts[0][i], family_wts[1][i]
        fixed = self.plan.fixed()
        # inside a CUDA graph capture: made for this build only (its tensors are the graph's)
        capturing = bool(fixed) and fixed[0].is_cuda and torch.cuda.is_current_stream_capturing()
        per_block = len(fixed) // plan.n
        with torch.no_grad():
            for k, r in enumerate(r for r, role in enumerate(roles) if role is None):
                roles[r] = _concat(fixed[k::per_block], not capturing)
        storage = self._finish_storage(roles, family_wts, packed=self._packed_layout)
        if not capturing:
            self._storage = storage
            self._addresses = tuple(t.data_ptr() for t in [*leaves.values(), *fixed])  # fixed: re-pointed now
        return storage

    def _finish_storage(self, raw: list[Tensor], family_wts: tuple[Tensor, Tensor] | None,
                        packed: tuple = ()) -> Storage:
        """A :class:`Storage` from its roles' concatenations: the family's fixed filters built and
        the scales kept as ``[B * C_out, 1, 1, 1]`` views (they broadcast over kernels with no view
        op per use). Its tensors keep the views the construction takes of them (``kernels.keep_views``):
        a storage outlives many builds."""
        plan = self.plan
        family = None
        if family_wts is not None:
            weights, scales = family_wts
            (j, rows), (kh, kw) = weights.shape[:2], plan.kernel_shape[2:]
            with torch.no_grad():
                filters = weights.new_zeros(rows, j, kh, kw)
                for i, (_, f_role, _) in enumerate(plan.family):
                    if f_role is None:  # a bare 1x1: the centre tap
                        filters[:, i, kh // 2, kw // 2] = 1
                    else:
                        eh, ew = raw[f_role].shape[-2:]
                        top, left = (kh - eh) // 2, (kw - ew) // 2
                        filters[:, i, top:top + eh, left:left + ew] = raw[f_role][:, 0]
            family = Family(weights.view(j, rows, -1), scales.view(j, rows, 1), filters.view(rows, j, kh * kw))
        roles = [K.channel_column(s) if s.dim() == 1 else s for s in raw]
        kept = tuple(K.keep_views(t) for t in (*roles, *(family or ())))
        return Storage(roles, family, plan.operands(roles), packed, kept)

    def _builder(self, groups: Sequence[KernelGroup], storages: tuple[Storage | None, ...]
                 ) -> EagerBuild | CompiledBuild | GraphedBuild | ChainedBuild:
        """How a build led by this group makes the kernels of ``groups`` (itself first, then its
        peers) from ``storages``: eagerly, or (policy ``"compiled"``) by their construction compiled
        for these storages' layouts, at its first use; eagerly, with one warning, where compiling
        fails (e.g. no C++ compiler or Triton), and where a group has no storage (inside a capture).
        With ``graphs``, each group's construction recorded for its storage (:meth:`_recorded`),
        where the recorder supports them, replayed one after the other; where it does not (on CUDA:
        inside another capture, e.g. a graphed whole step), each group's own build in turn
        (:class:`ChainedBuild`)."""
        plans = tuple(group.plan for group in groups)
        graphable = (self.graphs and not self._graphs_off and self.workspace is not None
                     and all(st is not None for st in storages) and self.graph_recorder.supports(storages[0].roles[0])
                     # one device (the recordings of a build are replayed in one lock, on one device's stream)
                     and all(st.roles[0].device == storages[0].roles[0].device for st in storages))
        last = self._graphed_for if graphable else self._compiled_for
        if last is not None and len(last[0]) == len(storages) and all(map(operator.is_, last[0], storages)):
            return last[1]  # the common case: the storages of the last build
        if graphable:
            self._graphed_for = None  # its recordings may be replaced: their memory goes first
            device = storages[0].roles[0].device
            # room for the largest group of the network there, before any records (see RecordingBuffer)
            there = [group for group in self.peers if group.plan.ref().device == device]  # (groups among them)
            self.workspace.recording_buffer(device, "outputs").reserve(max(g._output_bytes() for g in there))
            self.workspace.recording_buffer(device, "gradients in").reserve(max(g._input_bytes() for g in there))
            recordings = []
            for group, st in zip(groups, storages):
                rec = group._recorded(st, self.graph_recorder)
                if rec is None:
                    break
                recordings.append(rec)
            else:
                graphed = GraphedBuild(recordings, self.workspace.replay_lock)
                self._graphed_for = (storages, graphed)
                return graphed
        elif self.graphs and all(st is not None for st in storages):
            # not recordable now (inside another capture): each group's own build, the one its recording
            # was made of, so a compiled group compiles nothing inside the capture
            return ChainedBuild([group._unrecorded_builder((group.plan,), (st,))
                                 for group, st in zip(groups, storages)])
        return self._unrecorded_builder(plans, storages)

    def _input_bytes(self) -> int:
        """The room a recording of this group's build takes in the buffer of its kernels' gradients."""
        size = self.plan.ref().element_size()
        return sum(_aligned(math.prod(shape) * size) for shape in self.plan.kernel_shapes)

    def _output_bytes(self) -> int:
        """The room a recording of this group's build takes in the buffer of its outputs: its kernels'
        or its parameters' gradients', the larger."""
        plan = self.plan
        leaves = self.packed._parameters.values() if self.packed is not None else plan.params()
        return max(self._input_bytes(), sum(_aligned(p.numel() * p.element_size()) for p in leaves))

    def _recorded(self, stacked: Storage, kind: type) -> Recording | None:
        """This group's construction from ``stacked`` recorded by the network's recorder of type
        ``kind`` (:class:`Recording`; the last one while ``stacked`` is its storage); None, with one
        warning, where recording fails or the group has recorded :data:`_MAX_RECORDINGS` times (its
        tensors keep moving): its builds are then unrecorded."""
        if self._recording is not None and self._recording.storage is stacked:
            return self._recording
        if self._graphs_off:
            return None
        if self._recordings >= _MAX_RECORDINGS:
            self._graphs_off = True
            warnings.warn(f"kernel graphs: the group's parameters moved {self._recordings} times (each move "
                          "records its construction anew); its kernels are built without graphs from now on",
                          RuntimeWarning, stacklevel=4)
            return None
        build = self._unrecorded_builder((self.plan,), (stacked,))
        if isinstance(build, EagerBuild):
            build = EagerBuild(build.plans)  # recorded without the workspace: the graphs' pool holds its memory
        self._recordings += 1
        self._recording = None  # the last recording's memory goes before the next is made
        try:
            device = stacked.roles[0].device
            ws = self.workspace
            self._recording = Recording(build, stacked, ws.recorder(kind, device), ws.recording_buffer(device, "outputs"),
                                        ws.recording_buffer(device, "gradients in"))
        except Exception as e:  # noqa: BLE001 - a capture that fails leaves the unrecorded build
            self._graphs_off = True
            warnings.warn(f"kernel graphs: recording the kernel construction failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); the kernels are built without graphs",
                          RuntimeWarning, stacklevel=4)
        return self._recording

    def _unrecorded_builder(self, plans: tuple[Plan, ...],
                            storages: tuple[Storage | None, ...]) -> EagerBuild | CompiledBuild:
        """:meth:`_builder` without graphs."""
        if self.policy != "compiled" or self._compile_failed or any(st is None for st in storages):
            return EagerBuild(plans, self.workspace)
        # a plan is made anew when its group's tensors move (_replan); the build holds its plans, so
        # their ids stay theirs while it is cached
        key = tuple((id(plan), st.packed, *((t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)
                                            for t in CompiledBuild.inputs((st,)))) for plan, st in zip(plans, storages))
        try:
            build = memo(self._compiled, key, lambda: CompiledBuild(plans, storages))
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager construction
            self._compile_failed = True
            warnings.warn(f"kernel builder 'compiled': compiling the kernel construction failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); the kernels are built eagerly",
                          RuntimeWarning, stacklevel=2)
            return EagerBuild(plans, self.workspace)
        self._compiled_for = (storages, build)
        return build

    def _under_fsdp2(self) -> bool:
        """Whether FSDP2 (``fully_shard``) manages a module holding a block of the group (the grouped
        root, a module above it or a block): its unsharded parameters own their storage, which it frees
        after a forward and all-gathers into again before the next, so they can be no views of a group's
        storage. Read off torch's registry of the modules ``fully_shard`` was applied to, where torch
        has it (a private one; else the grouped network's own modules are looked at)."""
        cls = _fsdp2_module_class()
        if cls is None:
            return False
        try:
            from torch.distributed._composable_state import _module_state_mapping

            managed = [m for m in list(_module_state_mapping) if isinstance(m, cls)]
        except (ImportError, TypeError):
            root = self.workspace.root() if self.workspace is not None and self.workspace.root is not None else None
            return any(isinstance(m, cls) for m in (root.modules() if root is not None else self.blocks))
        mine = {id(b) for b in self.blocks}
        return any(id(sub) in mine for m in managed for sub in m.modules())

    def _check_gathered(self, tensors: Sequence[Tensor], shapes: Sequence[torch.Size], packed: bool) -> None:
        """Refuse to build from tensors that are shards (a DTensor, or a shape other than the group's own
        when it was made): FSDP wrapping the group's blocks in several units gathers each unit's
        parameters at its own forward, while the group builds every block's kernel at its first."""
        for i, (t, shape) in enumerate(zip(tensors, shapes)):
            if not (_is_dtensor(t) or t.shape != shape):
                continue
            if packed:
                name = f"{self.block_names[0] if self.block_names else ''}.packed_parameters." \
                       f"{list(self.packed._parameters)[i]}".lstrip(".")
            else:
                roles = len(tensors) // self.plan.n
                b, r = divmod(i, roles)
                block, step = self.blocks[b], self.plan.role_modules[r][b]
                inner = next((n for n, m in block.named_modules() if m is step), "?")
                prefix = self.block_names[b] if self.block_names else type(block).__name__
                name = f"{prefix}.{inner}.weight"
            what = "a DTensor shard" if _is_dtensor(t) else f"shape {tuple(t.shape)}, not {tuple(shape)}"
            raise RuntimeError(
                f"{name} is not gathered ({what}) when its kernel group builds: a group of online blocks "
                f"({len(self.blocks)} blocks, {', '.join(self.block_names[:3]) or type(self.blocks[0]).__name__}"
                f"{', ...' if len(self.blocks) > 3 else ''}) builds every block's kernel at the forward's first "
                "online block, while FSDP gathers a unit's parameters at that unit's forward. Keep a group's "
                "blocks in one FSDP unit (wrap the whole network as one: no auto_wrap_policy, or fully_shard on "
                "the root alone), or let each block build its own kernel: orepa.group_kernels(model, 'per-block')")

    def _holds(self, tensors: list[Tensor]) -> bool:
        """Whether ``tensors`` are still the views of this group's storage (one device and dtype)."""
        return self._storage is not None and self._storage.roles[0].device == tensors[0].device and all(
            t.data_ptr() == ptr for t, ptr in zip(tensors, self._addresses))

    def _stacked(self, tensors: list[Tensor], packing: bool = False) -> Storage | None:
        """Make the group's *storage*: per role, the blocks' tensors as one tensor concatenated
        along dim 0, of which they become views, so later builds concatenate nothing (:meth:`_build`
        reuses it while :meth:`_holds` says the tensors are still its views).

        The parameters stay the blocks' own ``nn.Parameter`` s (state_dict, optimizer, DDP and
        ``convert`` see nothing new); only their ``.data`` points into the storage. Whatever breaks
        that (``.to()``, ``load_state_dict(assign=True)``, a replaced parameter) shows in the
        tensors' addresses and the storage is made again from their values. Inside a CUDA graph
        capture it is not remade (a captured concatenation reads the tensors as they are at replay),
        nor for tensors that are not the blocks' own parameters and buffers: None is returned, and
        the operands are concatenated as without storage.
        """
        plan = self.plan
        n = plan.n
        if (n > 1 or plan.family) and tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        if not all(isinstance(t, nn.Parameter) or (t.is_leaf and not t.requires_grad) for t in tensors):
            # tensors the blocks do not own (functional_call, FSDP's views of its flat parameter):
            # never re-pointed, concatenated per build instead
            return None
        own = set() if self._storage is None else {r.untyped_storage()._cdata for r in self._storage.roles}
        if not packing and (not _repointable(tensors, own) or self._under_fsdp2()):
            # parameters whose memory another owner writes (FSDP2 all-gathers into the unsharded
            # parameters' own storage at every forward, a ZeroRedundancyOptimizer broadcasts into its
            # buckets): re-pointed, they would stop seeing its writes and the group would build from
            # stale values; concatenated per build instead (pack() takes the tensors out of the model:
            # their values are what it reads)
            return None
        roles = len(tensors) // n
        per_role = [tensors[r::roles] for r in range(roles)]
        with torch.no_grad():
            # the filter family's 1x1 weights and scales share one storage each: one product for all
            placed: dict[int, Tensor] = {}
            if plan.family:
                w0 = per_role[plan.family[0][0]][0]
                rows, j = sum(w.shape[0] for w in per_role[plan.family[0][0]]), len(plan.family)
                weights, scales = w0.new_empty(j, rows, *w0.shape[1:]), w0.new_empty(j, rows)
                for i, (w_role, _, s_role) in enumerate(plan.family):
                    placed[w_role], placed[s_role] = weights[i], scales[i]
            storage = [_concat(ts, True, placed.get(r)) for r, ts in enumerate(per_role)]
        self._storage = self._finish_storage(storage, (weights, scales) if plan.family else None)
        self._addresses = tuple(t.data_ptr() for t in tensors)
        return self._storage


@functools.cache
def _fsdp2_module_class() -> type | None:
    """FSDP2's module class (``fully_shard`` makes a module an instance of it), where torch has it."""
    for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            return getattr(__import__(where, fromlist=["FSDPModule"]), "FSDPModule")
        except (ImportError, AttributeError):
            continue
    return None


def _is_dtensor(t: Tensor) -> bool:
    cls = type(t)
    return cls is not Tensor and cls is not nn.Parameter and cls.__name__ == "DTensor"


def _repointable(tensors: Sequence[Tensor], own: set[int]) -> bool:
    """Whether a group may make ``tensors`` views of a storage of its own (:meth:`KernelGroup._stacked`):
    every storage they live in is theirs alone, each tensor's own or one of ``own``, the storages the
    group made before (some of whose tensors were replaced since), or one wholly covered by those of
    ``tensors`` it holds, whose rows are alike (a copy of a grouped model: its tensors share one storage
    per role as the original's did). Not where the storage holds more than them: FSDP2's unsharded
    parameters are views of its all-gather buffer, refilled at every forward, and
    ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` broadcasts the updated parameters into its
    buckets; a tensor re-pointed away from such memory keeps the values it had then. (The storage of
    another group, regrouped since, is not known here: its tensors are concatenated at each build.)"""
    held: dict[int, list] = {}
    for t in tensors:
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        entry = held.setdefault(storage._cdata, [storage.nbytes(), 0, set()])
        entry[1] += t.numel() * t.element_size()
        entry[2].add((t.dtype, tuple(t.shape[1:])))
    return all((used == nbytes and len(rows) == 1) or impl in own for impl, (nbytes, used, rows) in held.items())


def _build_groups(groups: Sequence[KernelGroup]) -> None:
    """Build the kernels of ``groups`` (each group's ``_pending``) as one :class:`GroupsFunction`,
    led by the first group (whose policy and compiled builds serve)."""
    parts = []
    for group in groups:
        operands = group._operands()
        if operands is None:
            group._build_apart()
        else:
            parts.append((group, *operands))
    if not parts:
        return
    storages = tuple(stacked for _, stacked, _, _ in parts)
    build = parts[0][0]._builder([group for group, *_ in parts], storages)
    kernels = GroupsFunction.apply(build, storages, *(t for _, _, leaves, _ in parts for t in leaves))
    i = 0
    for group, _, _, versions in parts:
        group._pending = {j: (versions[j], kernels[i + j]) for j in range(group.plan.n)}
        i += group.plan.n


def _concat(ts: list[Tensor], repoint: bool, out: Tensor | None = None) -> Tensor:
    """``ts`` concatenated along dim 0 (into ``out``), re-pointed (``repoint``) to views of it; one
    tensor is its own concatenation unless ``out`` is given."""
    if len(ts) == 1 and out is None:
        return ts[0].detach()
    stack = torch.cat([t.detach() for t in ts], out=out)
    if repoint:
        for t, view in zip(ts, stack.split([t.shape[0] for t in ts])):
            t.data = view
    return stack


def _kind(step: nn.Module) -> str:
    """What a packed parameter holds, for weight decay: branch ``"scale"`` s (vectors) or conv ``"weight"`` s."""
    return "scale" if _weight(step).dim() == 1 else "weight"


class CompiledBuild(_Build):
    """The constructions of one or several groups compiled for their storages' layouts (policy
    ``"compiled"``): the plans' squeezes and vjps traced once (``make_fx``) and compiled by
    inductor, so a training step runs the network's kernel construction as one call forward and
    one backward, a few fused kernels and the deep products per group, instead of ~25 operators
    forward and 60-90 backward per group, each issued by the host. The same kernels and gradients
    as the plans (rounding aside); the construction and its vjp are both compiled at once, on the
    forward's thread, before any backward needs the vjp. Interchangeable with an
    :class:`EagerBuild` in :class:`GroupsFunction` (``n``, ``kernel_shapes``, ``kernels``,
    ``kernels_vjp``)."""

    def __init__(self, plans: Sequence[Plan], storages: Sequence[Storage]):
        import torch._inductor  # here, not at import: the eager routes never need the compiler
        from torch.fx.experimental.proxy_tensor import make_fx

        super().__init__(plans)  # the plans held: the cache key names them by id
        traced = [Plan(p.blocks, p.names, launch_bound=True, traced=True) for p in self.plans]
        for plan, st in zip(traced, storages):
            plan.replica_indices(st)
        layout = [(len(st.roles), len(self.inputs((st,))), st.packed) for st in storages]

        def parts(ts: Sequence[Tensor]):  # the traced function's inputs as each plan's Storage
            i = 0
            for plan, (roles, size, packed) in zip(traced, layout):
                part, i = ts[i:i + size], i + size
                rs = list(part[:roles])
                yield plan, Storage(rs, Family(*part[roles:]) if size > roles else None, plan.operands(rs), packed)

        def kernels(*ts):
            return tuple(w for plan, st in parts(ts) for w in plan.kernels(st))

        def vjp(*ts):
            grads, out, i = ts[:self.n], [], 0
            for plan, st in parts(ts[self.n:]):
                out.extend(plan.kernels_vjp(grads[i:i + plan.n], st))
                i += plan.n
            return tuple(out)

        inputs = self.inputs(storages)
        grads = [inputs[0].new_zeros(shape) for shape in self.kernel_shapes]
        # no size/stride asserts in the generated code (one call per input and product, ~110 per
        # ResNet-18 step, 1-2% of a host-bound step): the build is only called on inputs of the
        # layout it was compiled for, which KernelGroup._builder's cache key pins
        with torch.no_grad(), torch.autocast(inputs[0].device.type, enabled=False), \
                torch._inductor.config.patch(size_asserts=False):
            self._kernels = compile_graph(make_fx(kernels)(*inputs), inputs)
            self._vjp = compile_graph(make_fx(vjp)(*grads, *inputs), [*grads, *inputs])

    @staticmethod
    def inputs(storages: Sequence[Storage]) -> list[Tensor]:
        """The storages' tensors as the compiled code takes them: per storage its roles, then its family."""
        return [t for st in storages for t in (*st.roles, *(st.family or ()))]

    def kernels(self, storages: Sequence[Storage]) -> tuple[Tensor, ...]:
        with autocast_off(storages[0].roles[0]):
            return tuple(self._kernels(*self.inputs(storages)))

    def kernels_vjp(self, grads: Sequence[Tensor], storages: Sequence[Storage]) -> list[Tensor]:
        with autocast_off(grads[0]):
            return list(self._vjp(*(g.contiguous() for g in grads), *self.inputs(storages)))


def compile_graph(gm: torch.fx.GraphModule, inputs: list[Tensor]):
    """``gm`` (an aten graph of static shapes) compiled by inductor for ``inputs``' layouts: through
    its standalone entry, whose compiled graphs persist in inductor's cache across processes (a
    ResNet-18's construction: ~4 s in a later run instead of ~45 s; ``torch._inductor.compile``
    bypasses that cache for a graph traced outside dynamo), where this torch has it."""
    import torch._inductor
    standalone = getattr(torch._inductor, "standalone_compile", None)
    if standalone is not None and "dynamic_shapes" in inspect.signature(standalone).parameters:
        return standalone(gm, inputs, dynamic_shapes="from_example_inputs")
    return torch._inductor.compile(gm, inputs)


def autocast_off(t: Tensor):
    """No autocast around a kernel construction (composed in the parameters' dtype), a no-op context
    where autocast is off already (most calls) or the device has none (``meta``: FLOP counts)."""
    device = t.device.type
    if device not in ("cpu", "cuda") and not _has_autocast(device):  # (cpu, cuda: nothing to ask inside a trace)
        return contextlib.nullcontext()
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


def _has_autocast(device: str) -> bool:
    available = getattr(torch.amp, "is_autocast_available", None)  # (torch >= 2.4's; before it, cpu and cuda)
    return available(device) if available is not None else device in ("cpu", "cuda")


class CudaGraphRecorder:
    """How a :class:`Recording` records: ``record(fn)`` captures ``fn`` (no arguments; it reads
    tensors that stay where they are and returns a tuple of tensors) as a CUDA graph and returns
    ``(replay, outputs)``; a replay rewrites ``outputs`` from what the tensors hold then. The graphs
    of one recorder (one per network and device, :meth:`Workspace.recorder`) share a memory pool: a
    graph's temporaries may lie where a graph recorded later keeps its outputs, so each replay's
    outputs are copied out before the next replay of any of them (:class:`GraphedBuild` does)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        # the warm-ups' and captures' side stream, of this device (torch.cuda.graph's default capture
        # stream is made once, on whichever device was current then)
        self.stream = torch.cuda.Stream(device)

    @staticmethod
    def supports(t: Tensor) -> bool:
        """Whether builds from tensors like ``t`` can be recorded (not inside another capture)."""
        return t.is_cuda and not torch.cuda.is_current_stream_capturing()

    def warm(self, fn) -> None:
        """One run of ``fn`` on a side stream before its capture (lazy initialisations, e.g. cuBLAS
        workspaces and cuDNN's choices, must not happen inside it)."""
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                fn()
            torch.cuda.current_stream().wait_stream(self.stream)

    def record(self, fn) -> tuple:
        graph = torch.cuda.CUDAGraph()
        # on the tensors' device, which need not be the current one: a capture records only the
        # work of its own device's stream (work on another would run once, unrecorded)
        with torch.cuda.device(self.device):
            # thread_local: a DataLoader's pin-memory thread may use the device meanwhile
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                outputs = fn()

        def replay() -> None:
            with torch.cuda.device(self.device):  # on that device's current stream
                graph.replay()

        return replay, outputs

    def pool_bytes(self) -> int:
        """The device memory of this recorder's pool (its segments' size: the recordings' outputs
        and the temporaries their replays write, none of which the allocator lends elsewhere)."""
        pool = tuple(self.pool)
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == pool)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // RecordingBuffer.ALIGN) * RecordingBuffer.ALIGN


class RecordingBuffer:
    """One device's memory that every recording of a network there uses for one thing, from its
    start: its outputs (the kernels, or the parameters' gradients), or its kernels' gradients in.
    A replay's outputs are copied out before the next replay, and a recording's gradients are copied
    in right before its replay (:class:`GraphedBuild`), so the recordings need room for the largest
    one's only, where buffers of their own would hold every group's between steps (ResNet-18 in
    float32: outputs 183 MiB and gradients in 42 MiB, against 90 and 27 MiB for its largest group;
    ResNet-50 343 and 90 MiB against 90 and 27). :meth:`reserve` it for the network's groups before
    recording them: a buffer that has to grow later is replaced, and recordings made before keep the old one."""

    ALIGN = 256  # bytes between the starts of two of its tensors (the CUDA caching allocator's rounding)

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer: Tensor | None = None

    def reserve(self, nbytes: int) -> None:
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def views(self, like: Sequence[tuple[torch.Size, torch.dtype]]) -> list[Tensor]:
        """Contiguous tensors of these shapes and dtypes, side by side from the buffer's start."""
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in like]
        self.reserve(sum(map(_aligned, sizes)))
        out, lo = [], 0
        for (shape, dtype), n in zip(like, sizes):
            out.append(self.buffer.narrow(0, lo, n).view(dtype).view(shape))
            lo += _aligned(n)
        return out


class Recording:
    """One group's construction (``inner``: an :class:`EagerBuild` without workspace, or a
    :class:`CompiledBuild`, of its plan) recorded for its ``storage`` by ``recorder`` (a
    :class:`CudaGraphRecorder`) as two graphs: its kernels, and their vjp from the kernels'
    gradients in fixed buffers (``grads_in``). :class:`GraphedBuild` replays the recordings of a build's
    groups. The gradients in are views of ``inputs`` and the outputs views of ``outputs`` (the
    network's :class:`RecordingBuffer` s): an eager construction makes its kernels there and, packed,
    writes its parameters' gradients there as it makes them; each graph copies whatever else it made
    there at its end (one multi-tensor copy), so the graphs' pool holds only the temporaries of the
    largest phase (those a construction has alive at once: it drops each once used).
    The graphs read ``storage``'s memory, so a recording serves only that storage (the group records
    anew when its tensors move, :meth:`KernelGroup._recorded`). Both run with autocast off, in the
    parameters' dtype, as compiled builds do."""

    def __init__(self, inner: EagerBuild | CompiledBuild, storage: Storage, recorder: CudaGraphRecorder,
                 outputs: RecordingBuffer, inputs: RecordingBuffer):
        (plan,) = inner.plans
        self.plan = plan
        self.storage = storage  # held: the graphs read its memory
        ref = storage.roles[0]
        shapes = inner.kernel_shapes
        eager = isinstance(inner, EagerBuild)
        if eager:  # the kernels' gradients side by side in one tensor, as the vjp reads them: no concatenation
            rows = [shape[0] for shape in shapes]
            whole_shape = ((sum(rows), *shapes[0][1:]), ref.dtype)
            (whole,) = inputs.views([whole_shape])
            self.grads_in = list(whole.split(rows))
            # and the kernels made where they are handed out from (Plan.squeeze's ``into``): no copy
            (made_kernels,) = outputs.views([whole_shape])
            kernel_views = tuple(made_kernels.split(rows))
        else:
            self.grads_in = inputs.views([(shape, ref.dtype) for shape in shapes])
        # an eager packed construction writes its parameters' gradients where they go, row by row
        # (Plan.vjp's ``into``); other outputs are copied there at the end of the graph
        places = eager and bool(storage.packed)

        def forward() -> tuple[Tensor, ...]:
            if eager:
                plan.squeeze(storage, None, made_kernels)
                return kernel_views
            return tuple(inner.kernels((storage,)))

        def backward(into: list[Tensor] | None = None) -> tuple[Tensor, ...]:
            if eager:
                return tuple(plan.vjp(whole, storage, None, into))
            return tuple(inner.kernels_vjp(self.grads_in, (storage,)))

        def ending_in(views: list[Tensor], phase, *args):
            def run() -> tuple[Tensor, ...]:
                pairs = [(v, t) for v, t in zip(views, phase(*args)) if t is not v]
                if pairs:  # (the phase's own outputs die here: memory of the pool)
                    torch._foreach_copy_([v for v, _ in pairs], [t for _, t in pairs])
                return tuple(views)
            return run

        with torch.no_grad(), torch.autocast(ref.device.type, enabled=False):
            made: list[list[tuple]] = []
            recorder.warm(lambda: made.extend([(t.shape, t.dtype) for t in ts] for ts in (forward(), backward())))
            # both phases' outputs from the buffer's start: the kernels are copied out before a backward
            kernels = list(kernel_views) if eager else outputs.views(made[0])  # (eager: made there, no copy)
            grads = outputs.views(made[1])
            self.forward, self.kernels = recorder.record(ending_in(kernels, forward))
            self.backward, self.grads = recorder.record(ending_in(grads, backward, grads if places else None))


class GraphedBuild(_Build):
    """The builds of several groups replayed from their :class:`Recording` s, interchangeable with
    the builds they record in :class:`GroupsFunction`.

    Why: on a GPU an eager step is bound by the host issuing the construction's operators (~230 for
    ResNet-18, each ~10 us) or its compiled kernels; a replay issues a group's at once, and the
    construction depends on no input, so it serves every step, whatever its batch, while the rest of
    the step stays eager. A forward replays each group's kernels and copies them out right after
    (one ``_foreach_clone`` each: the kernels are then ordinary tensors, which autograd and later
    replays cannot overwrite, and no replay of a group recorded earlier, whose temporaries may lie
    where a later recording's outputs are, can reach them first); a backward copies the kernels'
    gradients in (one ``_foreach_copy_`` for all), then replays each group's vjp and copies its
    parameters' gradients out (they accumulate, e.g. over micro-batches). Recordings per group, not
    per build: the groups a build covers vary (a block skipped, by stochastic depth say, leaves its
    group out of the next build) and each group's recording serves every build it is in. ``lock``
    (the network's) keeps two threads' copies and replays apart."""

    def __init__(self, recordings: Sequence[Recording], lock: threading.Lock):
        self.recordings = tuple(recordings)
        super().__init__([rec.plan for rec in self.recordings])
        self._lock = lock

    def kernels(self, storages: Sequence[Storage]) -> tuple[Tensor, ...]:
        out: list[Tensor] = []
        with self._lock:
            for rec in self.recordings:
                rec.forward()
                out.extend(_clones(rec.kernels))
        return tuple(out)

    def kernels_vjp(self, grads: Sequence[Tensor], storages: Sequence[Storage]) -> list[Tensor]:
        out: list[Tensor] = []
        i = 0
        with self._lock:
            for rec in self.recordings:  # (the recordings share the memory of their gradients in)
                n = len(rec.grads_in)
                torch._foreach_copy_(rec.grads_in, list(grads[i:i + n]))
                i += n
                rec.backward()
                out.extend(_clones(rec.grads))
        return out


class ChainedBuild(_Build):
    """Several groups' own builds (eager or compiled, one plan each) one after the other,
    interchangeable with the others in :class:`GroupsFunction`: what groups that record their
    builds run where they cannot record (inside another CUDA-graph capture)."""

    def __init__(self, builds: Sequence[EagerBuild | CompiledBuild]):
        self.builds = tuple(builds)
        super().__init__([p for b in self.builds for p in b.plans])

    def kernels(self, storages: Sequence[Storage]) -> tuple[Tensor, ...]:
        return tuple(k for b, st in zip(self.builds, storages) for k in b.kernels((st,)))

    def kernels_vjp(self, grads: Sequence[Tensor], storages: Sequence[Storage]) -> list[Tensor]:
        out, i = [], 0
        for b, st in zip(self.builds, storages):
            out.extend(b.kernels_vjp(grads[i:i + b.n], (st,)))
            i += b.n
        return out


def _clones(ts: Sequence[Tensor]) -> list[Tensor]:
    """Copies of ``ts`` (one operator where this torch has ``_foreach_clone``)."""
    clone = getattr(torch, "_foreach_clone", None)
    return list(clone(list(ts))) if clone is not None else [t.clone() for t in ts]


#: recordings a group may make before it stops graphing (its parameters keep moving, e.g. an
#: optimizer that replaces them: each recording costs a capture and its memory)
_MAX_RECORDINGS = 4


def builds_together(policy: str, device: torch.device | str) -> bool:
    """Whether blocks grouped with ``policy`` build their kernels as groups on ``device`` (outside a
    ``torch.compile`` trace): everywhere for ``grouped`` and ``compiled``, on a GPU for ``auto``
    (launches decide there), nowhere for ``per-block``. Where they do, packing pays (``group_kernels(...,
    pack=True)``); elsewhere each block reads its rows of a packed parameter, which costs a view."""
    if policy == "per-block":
        return False
    return policy in ("grouped", "compiled") or (device if isinstance(device, torch.device) else
                                                 torch.device(device)).type == "cuda"


def _signature(block: nn.Module) -> tuple:
    """What blocks must share to build their kernels together. Not their output channels where
    their convolutions are ungrouped: a group's rows are the concatenation of its blocks' rows
    (:class:`Plan`'s virtual blocks), so only the input side of each step has to match: a step's
    input channels and kernel size, and the whole shape of a step that is not on the output side
    (the first step of 1x1 -> kxk or dw -> pw)."""
    steps = []
    free_rows = block.groups == 1
    for name, br in block.branches.items():
        convs, scale = br._split()
        input_side = len(convs) == 2 and not _per_channel(convs[1])
        for j, st in enumerate([*convs, *((scale,) if scale is not None else ())]):
            w = getattr(st, "weight", None)
            shape, groups = None if w is None else tuple(w.shape), getattr(st, "groups", None)
            if shape is not None and free_rows and not (j == 0 and input_side):
                # a per-channel filter's groups are its rows
                shape, groups = shape[1:], (None if groups == shape[0] and shape[1] == 1 else groups)
            steps.append((name, type(st).__name__, groups, getattr(st, "kind", None),
                          getattr(st, "mode", None), shape))
    # which tensors train: a group of frozen and trainable blocks could not pack (KernelGroup.pack),
    # e.g. a detection backbone's frozen 64 -> 64 stage beside the 64 -> 128 block after it
    trains = tuple(p.requires_grad for p in block.parameters())
    return (type(block).__name__, block.in_channels, None if free_rows else block.out_channels, block.kernel_size,
            block.groups, tuple(steps), trains)


#: blocks of one signature but several widths share a group where each width is at most this multiple
#: of the group's smallest (the input-side steps are replicated per multiple at each build)
_MAX_WIDTH_RATIO = 4


def _by_width(blocks: list[nn.Module]) -> list[list[nn.Module]]:
    """Blocks of one signature split into groups whose widths are multiples of the group's smallest
    (at most :data:`_MAX_WIDTH_RATIO` times), each in module order."""
    out, rest = [], blocks
    while rest:
        unit = min(b.out_channels for b in rest)
        fits = [b.out_channels % unit == 0 and b.out_channels // unit <= _MAX_WIDTH_RATIO for b in rest]
        out.append([b for b, f in zip(rest, fits) if f])
        rest = [b for b, f in zip(rest, fits) if not f]
    return out


def group_kernels(root: nn.Module, policy: str = "auto", pack: bool = False, joint: bool = True,
                  graphs: bool = False, traced: bool = False) -> list[KernelGroup]:
    """Group the online blocks under ``root`` by construction signature (input channels, kernel
    size, groups, branch set and step shapes; the output channels where the blocks' convs are
    grouped) so each group builds its kernels together in training forwards. Blocks of one
    signature but several widths share a group where their widths are multiples of the narrowest,
    up to :data:`_MAX_WIDTH_RATIO` (see the module docstring). Regrouping replaces earlier groups
    (e.g. to change ``policy``) and unpacks them first: the same numbers, but packing again makes
    new parameters, so an optimizer made before a second call must be made again (warned of).

    Blocks with scalar scales stay alone (their scales do not concatenate per channel): a group
    of one, which still takes the grouped route (the kernel space, no recomputation). Blocks holding
    a parameter registered at several places (tied) are not grouped: they build block by block. A
    part of a grouped network grouped anew leaves the groups of the rest as they were, without it.

    ``pack``: every group's learnable operands become a few parameters, one per kind and row shape
    (:meth:`KernelGroup.pack`): fewer tensors for autograd and the optimizer, the step's host time
    where a group builds its kernels (a GPU, or policy ``grouped``/``compiled``). Make the optimizer
    afterwards (one made before is warned of, here or at the first training forward) and freeze
    stages before (a change after is warned of at the next training forward); parameter
    groups per module need ``pack=False``: a module's ``parameters()`` then no longer hold its
    blocks' weights, which are their group's (held by its first block, maybe in another stage). A
    block that a step's loss does not reach gets no gradient (None, which optimizers skip; built ``traced`` in a compiled graph: zeros). Packed, that holds only where its
    whole group sits out: the rows of a block left out while others of its group train get zeros,
    which weight decay and momentum act on; keep ``pack=False`` for models whose blocks sit out
    steps (several heads or exits).

    ``joint``: the groups built at a forward's first online block are one autograd node (compiled:
    one call forward, one backward), the fewest calls for the host. Their parameters' gradients
    then all arrive at the end of the backward; ``joint=False`` (one node per group) gives each
    group's as soon as its blocks' backward is done, which DistributedDataParallel overlaps with
    the rest of the backward.

    ``graphs``: on a CUDA device, each group's construction (eager, or compiled) is recorded as two
    CUDA graphs at its first build and replayed at every later one (:class:`Recording`,
    :class:`GraphedBuild`): the construction's host time in an eager step becomes per group a replay
    and a copy each way; its memory (the graphs' pool) is then held between steps. Outside a capture
    only (a whole step recorded as a graph records the construction with it).

    ``traced``: a ``torch.compile`` of ``root`` (or of parts of it, called within its forward) builds
    the groups' kernels together inside the graph, where they build as groups (:meth:`KernelGroup.
    traces_together`), instead of block by block: ResNet-18's compiled train step launches 130 kernels
    instead of 224 (base 81). ``root`` gets a forward pre-hook and forward hook that scope those kernels
    to its forward (:func:`forward_scope`; deployment removes them). Within one forward each kernel is
    built once, eagerly or in a graph, and read by either: a compiled part after eager blocks reads
    their kernels, eager blocks after a compiled part (a graph break, a part past dynamo's recompile
    limit) read its graph's. Not with activation checkpointing
    in or around the compiled code: a compiled region called inside an eagerly checkpointed one
    recomputes block by block in backward (after the root's forward) and fails checkpoint's check of
    the recomputed tensors, and a checkpointed region that holds a network's first online block breaks
    the graph (it runs eagerly). Returns the groups.
    """
    if policy not in POLICIES:
        raise ValueError(f"kernel-builder policy must be one of {POLICIES}, got {policy!r}")
    inner = {id(m) for m in root.modules()}
    earlier = {id(g.peers[0]): g.peers for g in kernel_groups(root)}  # the groupings its blocks are in
    replaced: list[weakref.ref] = []  # what regrouping takes out of the model, for the new groups to look at
    for peers in earlier.values():
        outer = [[b for b in g.blocks if id(b) not in inner] for g in peers]
        packed = any(g.packed is not None for g in peers)
        for group in peers:
            group.unpack()
            replaced += group._replaced
            group._replaced = ()
        replaced += peers[0].workspace.replaced if peers[0].workspace is not None else ()
        if any(outer):  # made for an enclosing module: its other blocks are grouped again, as they were
            old = peers[0]
            names = {id(b): n for g in peers for b, n in zip(g.blocks, g.block_names)}
            _make_groups([part for blocks in outer if blocks for part in _by_width(blocks)], names, old.policy,
                         packed, old.joint, old.graphs,
                         old.workspace is not None and old.workspace.traced_scope, old.workspace or Workspace())
        else:
            release_scope(peers[0].workspace)
    by_signature: dict[tuple, list[nn.Module]] = {}
    tied = _tied_parameters(root)
    for m in root.modules():
        if not hasattr(m, "_kernel_group"):
            continue
        m._kernel_group = None
        m.__dict__.pop("_traced_plans", None)  # (made again for the blocks grouped with traced=True)
        if not m._closed_form or (tied and any(id(p) in tied for p in m.parameters())):
            continue
        sig = _signature(m)
        if any(getattr(st, "mode", None) == "scalar" for br in m.branches.values() for st in br):
            sig = (sig, id(m))
        by_signature.setdefault(sig, []).append(m)
    names = {id(m): name for name, m in root.named_modules()}
    workspace = Workspace()
    groups = _make_groups([part for same in by_signature.values() for part in _by_width(same)], names, policy,
                          pack, joint, graphs, traced, workspace)
    for group in groups:
        replaced += group._replaced
        group._replaced = ()
    if groups:
        forward_scope(root, workspace, traced)
        # an optimizer made before is alive now; what else still holds the parameters taken out (a list
        # kept of them) is looked at again at the first training forward, once
        if _warn_of_stale_optimizers(replaced, workspace, pack) and not workspace.said_replaced:
            workspace.replaced = replaced
    return groups


def _make_groups(parts: Sequence[Sequence[nn.Module]], names: dict[int, str], policy: str, pack: bool, joint: bool,
                 graphs: bool, traced: bool, workspace: Workspace) -> list[KernelGroup]:
    """The groups of one network (peers), one per list of blocks in ``parts`` (:func:`group_kernels`)."""
    groups = []
    for index, blocks in enumerate(parts):
        group = KernelGroup(blocks, policy)
        group.block_names = tuple(names[id(b)] for b in blocks)
        for blk in blocks:
            blk._kernel_group = group
        group.joint, group.workspace, group.graphs, group.index_in_peers = joint, workspace, graphs, index
        groups.append(group)
    workspace.groups = groups
    for group in groups:
        group.peers = groups
        if pack:
            group.pack()
        if traced:
            group.prepare_trace()
    return groups


def _tied_parameters(root: nn.Module) -> set[int]:
    """The ids of the parameters registered at several places under ``root`` (a weight tied between
    blocks, or with another module). Blocks holding one build alone, block by block (exact): a group's
    storage holds its rows once per block (the parameter then reads one block's copy, the other block
    its own, which no step updates), and packing makes new parameters of them (untying them)."""
    seen: set[int] = set()
    tied: set[int] = set()
    for _, p in root.named_parameters(remove_duplicate=False):
        (tied if id(p) in seen else seen).add(id(p))
    return tied


class _ScopeHook:
    """A grouped root's forward pre-hook (or, ``traced``, forward hook) for its network's
    ``workspace`` (:func:`forward_scope`). It holds the root (weakly; strongly in its copies' and
    pickles' arguments, which reach it through the root anyway), so that a copy of the root gives
    the copied workspace its copied root, while a copy of a submodule, which never reaches the
    root's hooks, copies nothing of them."""

    __slots__ = ("workspace", "root", "fn", "__weakref__")

    def __init__(self, workspace: Workspace, root: nn.Module | None, fn):
        self.workspace, self.fn = workspace, fn
        self.root = None if root is None else weakref.ref(root)
        if self.root is not None:
            workspace.root = self.root

    def __call__(self, module: nn.Module, args):
        return self.fn(self.workspace, module, args)

    def __reduce__(self):
        return (type(self), (self.workspace, None if self.root is None else self.root(), self.fn))


class _ScopeCloseHook(_ScopeHook):
    """:class:`_ScopeHook` as a forward hook. A ``__call__`` of its own: one code object serving both
    arities made dynamo compile its frame twice (guarded on ``len(args)``) under ``torch.compile``."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args, output):
        return self.fn(self.workspace, module, args, output)


def forward_scope(root: nn.Module, workspace: Workspace, traced: bool = False) -> None:
    """Make ``root``'s forward the scope of the kernels its groups build, by hooks bound to
    ``workspace`` (:func:`release_scope`): a pre-hook drops the kernels built ahead for blocks that
    an earlier call did not reach (a forward that stopped halfway, a submodule called alone), which
    weights written since without a version count (through ``.data``, ``.to()``) would leave stale,
    and at an eager training forward says what packing makes of an optimizer made before it and of
    trainability changed after it (:func:`_open_forward`); with ``traced``, the pre-hook and a
    forward hook also open and close the scope of the kernels built inside a dynamo trace
    (:meth:`KernelGroup._traced_kernel_of`)."""
    release_scope(workspace)
    workspace.traced_scope = traced
    root.register_forward_pre_hook(_ScopeHook(workspace, root, _open_forward))
    if traced:
        root.register_forward_hook(_ScopeCloseHook(workspace, root, _close_forward), always_call=True)


def _strip_scope_hooks(module: nn.Module, workspace: Workspace | None = None) -> None:
    """Take the engine's hooks (those of ``workspace``; None: any) off ``module``, as their handles'
    ``remove()`` would (the handles are not kept: a copy of a submodule would copy the root's hook
    dicts with them)."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(hooks.items()):
            # (functools.partial: the hooks of a model pickled when they were partials)
            bound = hook.workspace if isinstance(hook, _ScopeHook) else hook.args[0] if (
                isinstance(hook, functools.partial) and hook.func in (_open_forward, _close_forward)) else None
            if bound is not None and (workspace is None or bound is workspace):
                del hooks[key]
                for extra in (module._forward_hooks_always_called, module._forward_hooks_with_kwargs,
                              module._forward_pre_hooks_with_kwargs):
                    extra.pop(key, None)


def strip_scopes(model: nn.Module) -> None:
    """Take every engine hook off ``model``'s modules: ``model`` is deployed, every block under it
    (and so every grouped root's network) gone (:func:`orepa.reparameterize`)."""
    for m in model.modules():
        _strip_scope_hooks(m)


def release_scope(workspace: Workspace | None) -> None:
    """Remove the hooks :func:`forward_scope` gave a root for ``workspace`` (regrouping, deployment: a
    deployed model carries nothing of the engine, and TorchScript takes only its own hooks)."""
    if workspace is None:
        return
    root = None if workspace.root is None else workspace.root()
    if root is not None:
        _strip_scope_hooks(root, workspace)
    for handle in workspace.__dict__.pop("legacy_hooks", ()):  # a model pickled when hooks were partials
        handle.remove()
    workspace.root = None
    workspace.traced.clear()
    workspace.forward_open = False


def block_deployed(block: nn.Module) -> None:
    """``block`` was deployed by its ``fuse()`` (timm's protocol replaces a network's blocks one by
    one): with the last block of its network's groups, the root loses the engine's hooks (and a
    block deployed alone leaves them to the network that still trains)."""
    group = getattr(block, "_kernel_group", None)
    workspace = None if group is None else group.workspace
    if workspace is None:
        return
    workspace.deployed.add(block)
    root = None if workspace.root is None else workspace.root()
    pending = [b for g in workspace.groups for b in g.blocks if b not in workspace.deployed]
    # (blocks taken out of the model since it was grouped, e.g. a stage replaced, are not waited for)
    if not pending or (root is not None and not _holds_any(root, pending)):
        release_scope(workspace)


def _holds_any(root: nn.Module, modules: list[nn.Module]) -> bool:
    """Whether ``root`` holds any of ``modules``. Depth first from the last child: a network deployed
    front to back (timm's ``reparameterize_model``) has its blocks still to come at its end, so the
    search ends at once instead of walking the whole network at every block (quadratic)."""
    wanted = {id(m) for m in modules}
    seen: set[int] = set()
    stack = [root]
    while stack:
        m = stack.pop()
        if id(m) in wanted:
            return True
        if id(m) not in seen:
            seen.add(id(m))
            stack.extend(c for c in m._modules.values() if c is not None)
    return False


def _open_forward(workspace: Workspace, module: nn.Module, args) -> None:
    """The grouped root's forward begins: no kernel built before it serves in it (eagerly; a compiled
    graph keeps none between calls), and kernels traced into a compiled graph may be built and kept
    for its blocks to read (none is left from a forward that stopped halfway). A training forward
    also looks at what packing changed (whatever route the blocks take: here, not at a build)."""
    for group in workspace.groups:  # (inside a trace too: a compiled part of the forward reads them)
        if group._pending:
            group._pending = {}
    if not torch.compiler.is_compiling():
        if module.training and torch.is_grad_enabled():
            if workspace.replaced:
                replaced, workspace.replaced = workspace.replaced, []
                _warn_of_stale_optimizers(replaced, workspace, _packed(workspace))
            _check_trainability(workspace)
    if workspace.traced_scope:
        workspace.traced.clear()
        workspace.traced_together.clear()
        workspace.forward_open = True
        if module.training and torch.is_grad_enabled():  # (KernelGroup.traces_together reads them: training only)
            for group in workspace.groups:
                ref = group.plan.ref()
                if builds_together(group.policy, ref.device):
                    workspace.traced_together[(group.index_in_peers, ref.device, ref.dtype)] = group._of_one_kind(ref)


def _close_forward(workspace: Workspace, module: nn.Module, args, output) -> None:
    workspace.traced.clear()
    workspace.traced_together.clear()
    workspace.forward_open = False


def _caller_level() -> int:
    """The ``stacklevel`` of a warning from a forward hook that names the user's call: the first
    frame outside this package and torch (how many of torch's frames a module call takes varies)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        level, frame = level + 1, frame.f_back
    return level


_INTERNAL_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _packed(workspace: Workspace) -> bool:
    return any(g.packed is not None for g in workspace.groups)


def _warn_of_stale_optimizers(replaced: Sequence[weakref.ref], workspace: Workspace | None, packed: bool) -> bool:
    """After :meth:`KernelGroup.pack` or :meth:`KernelGroup.unpack` the parameters they took out of
    the model are read by nothing, so an optimizer made before holds parameters that never get a
    gradient, and the online blocks do not train, silently. Said once per network where a live
    ``torch.optim.Optimizer`` holds some (a loop variable or a list may hold them too: not a mistake
    to warn of). Returns whether any of them is still alive (something may yet make an optimizer of
    them)."""
    alive = [p for ref in replaced if (p := ref()) is not None]  # (held here: their ids stay theirs)
    if not alive or (workspace is not None and workspace.said_replaced):
        return bool(alive)
    stale = _optimizers_holding(alive)
    if stale:
        # an optimizer deleted in a reference cycle is found until a collection: collected, looked at
        # again (only then: a full collection of a large process takes most of a second)
        del alive
        gc.collect()
        alive = [p for ref in replaced if (p := ref()) is not None]
        stale = _optimizers_holding(alive) if alive else []
    if stale:
        if workspace is not None:
            workspace.said_replaced = True
        warnings.warn(
            f"an optimizer ({', '.join(stale)}) holds parameters that {'packing' if packed else 'unpacking'} took "
            f"out of the model: it was made before group_kernels(model, policy, pack={packed}), and stepping them "
            "does not train the online blocks; make the optimizer (and any model average, e.g. torch.optim."
            "swa_utils.AveragedModel) after grouping, from model.parameters()", stacklevel=_caller_level())
    return bool(alive)


def _optimizers_holding(tensors: Sequence[Tensor]) -> list[str]:
    """The class names of the ``torch.optim.Optimizer`` objects (not yet collected) holding any of
    ``tensors``."""
    held = {id(t) for t in tensors}
    # (type(o), not isinstance: a proxy's __class__ may warn, e.g. torch.distributed's deprecated reduce_op)
    optimizers = [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]
    return sorted({type(o).__name__ for o in optimizers
                   if any(id(p) in held for g in o.param_groups for p in g["params"])})


def _stage(name: str) -> str:
    """The stage a block's name places it in: its name up to the last index of a container that
    holds the block below one of its elements (``layer3.0.conv2`` and ``layer3.0.downsample.0`` ->
    ``layer3``, ``stages.2.blocks.0.conv2`` -> ``stages.2.blocks``); without one, its first component
    (a deep stem's steps: ``conv1``)."""
    parts = name.split(".")
    # (the last component is the block's own name, an index where the block is a container's element)
    last = max((i for i, part in enumerate(parts[:-1]) if part.isdigit()), default=0)
    return ".".join(parts[:last]) if last else parts[0]


def _check_trainability(workspace: Workspace) -> None:
    """A packed parameter holds the rows of every block of its group, which may lie in other stages
    than its holder (a stage's first block groups with the stage before), while a block whose
    group's parameters another module holds follows that module. Freezing or unfreezing a stage
    after packing therefore changes more or fewer blocks than it holds: said once per network, with
    those blocks, at the next training forward (eagerly: a compiled forward runs no check) after
    the packed parameters' trainability changed. Not where every packed parameter is now frozen or
    every one trains, nor where each changed group lies in its holder's stage and the stages
    changed hold no block of an unchanged group: exact then, as far as stages tell. A stage whose
    modules hold no packed parameter (ResNet-18's layer1: the deep stem holds its blocks' rows)
    changes none by ``requires_grad_``, which no look at them can tell from freezing its BNs only."""
    changed, states = [], []
    for group in workspace.groups:
        if group.packed is None:
            continue
        params = group.packed._parameters
        if not all(isinstance(p, nn.Parameter) for p in params.values()):
            return  # tensors put in their place for a call (functional_call's): not the model's trainability
        now, held = group._packed_state(), tuple(map(id, params.values()))
        states += [t for _, t in now]
        own = group.__dict__.get("_packed_own")
        if own is not None and held != own:
            if group.__dict__.get("_packed_candidate") != held:
                group._packed_candidate = held  # other parameters in their place, maybe for one call only
                continue
        group._packed_own = held  # (a copy's at its first look; the tensors held since the last one)
        if now != group._trainable_packed:
            if group._trainable_packed:
                changed.append(group)
            group._trainable_packed = now
    if not changed or all(states) or not any(states) or workspace.said_frozen:
        return
    packed = [g for g in workspace.groups if g.packed is not None and g.block_names]
    stages = {_stage(g.block_names[0]) for g in changed if g.block_names}
    holder = {n: g.block_names[0] for g in packed for n in g.block_names}
    extra = [n for g in changed for n in g.block_names if _stage(n) not in stages]
    missed = [n for g in packed if g not in changed for n in g.block_names if _stage(n) in stages]
    if not (extra or missed):
        return
    workspace.said_frozen = True
    together = ["(" + ", ".join(g.block_names) + ")" for g in changed if len(g.block_names) > 1]
    warnings.warn(
        "packed parameters were frozen or unfrozen after packing: each holds the rows of every block of its "
        "group, which change together" + (": " + ", ".join(together) if together else "") + "; so " +
        "; ".join(part for part in (
            ", ".join(f"{n} (with {holder[n]}, which holds its rows)" for n in extra) + " changed outside the "
            "stage changed" if extra else "",
            ", ".join(f"{n} (its rows held by {holder[n]})" for n in missed) + " did not change with its stage"
            if missed else "") if part) +
        ". To train some blocks only, set requires_grad before packing (orepa.engine.group_kernels(model, "
        "pack=True) packs frozen and trainable rows apart), or unpack (group_kernels(model, policy, pack=False))",
        stacklevel=_caller_level())


def arena_bytes(root: nn.Module) -> int:
    """The memory that the eager builds' arenas of ``root``'s groups hold between steps: those that
    stay allocated (a CPU's, :class:`Arena`), each storage once."""
    spaces = {id(g.workspace): g.workspace for g in kernel_groups(root) if g.workspace is not None}
    held = {st.data_ptr(): st.nbytes() for ws in spaces.values() for arena in ws.arenas.values()
            if not arena.frees for st in arena.storages if st.nbytes()}
    return sum(held.values())


def recorded_bytes(root: nn.Module) -> int:
    """The memory that the recorded builds of ``root``'s groups (``group_kernels(..., graphs=True)``)
    hold between steps: their recorders' pools, the recordings' inputs (the kernels' gradients) and
    the output buffers they write into, each storage once."""
    groups = kernel_groups(root)
    spaces = {id(g.workspace): g.workspace for g in groups if g.workspace is not None}
    pools = sum(rec.pool_bytes() for ws in spaces.values() for rec in ws.recorders.values())
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for g in groups if g._recording is not None
            for t in (*g._recording.grads_in, *g._recording.kernels, *g._recording.grads)}
    return pools + sum(held.values())


def kernel_groups(root: nn.Module) -> list[KernelGroup]:
    """The groups of the blocks under ``root`` (each once, in module order)."""
    seen: dict[int, KernelGroup] = {}
    for m in root.modules():
        g = getattr(m, "_kernel_group", None)
        if g is not None:
            seen.setdefault(id(g), g)
    return list(seen.values())


