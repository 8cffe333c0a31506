"""Network level: turn any CNN into its re-param form and back.

``convert`` finds every Conv2d -> BatchNorm2d pair of a model (torch.fx, or a
forward-hook trace when the model cannot be traced; without an example input,
only the provable pairs of nn.Sequentials and traceable submodules) and
swaps the conv for a block. For online OREPA the BN stays where it is and
becomes the post-addition norm; for blocks that hold their own BNs (DBB,
RepVGG, OREPA-VGG, the offline prototype) the BN is replaced by an
:class:`~orepa.blocks.AbsorbedNorm` placeholder.

``reparameterize`` turns every block back into an ``nn.Conv2d`` and every
placeholder back into a BatchNorm2d, so the result has the module names, types
and state_dict keys of the model before ``convert``; ``fuse_bn=True`` then
folds every conv-BN pair for inference.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import os
import re
import textwrap
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import Tensor, nn

from . import engine as E
from . import kernels as K
from .blocks import (
    BATCH_NORMS,
    AbsorbedNorm,
    Conv2dTFSame,
    DBBConv2d,
    OREPAConv2d,
    OREPADeepStem,
    OREPAVGGBlock,
    ReparamConv2d,
    RepVGGBlock,
    _channels_last,
    _materialise_fixed_kernels,
    _resolve_init,
    check_block_options,
    check_conv_config,
    check_flags,
    keep_layout,
    reparametrized_steps,
    reparametrized_steps_message,
)
from .engine import group_kernels
from .state_dicts import wrapper_prefix

__all__ = ["convert", "reparameterize", "load_plain_state_dict", "fuse_conv_bn", "find_conv_bn_pairs", "ConversionReport",
           "METHODS", "METHOD_OPTIONS", "make_block"]


@dataclass
class ConversionReport:
    """What ``convert`` did: converted conv names, skipped ones with reasons, how pairs were found."""

    method: str
    pairing: str = ""
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    #: the converted convs that no BatchNorm2d follows (``without_bn=True``)
    without_bn: list[str] = field(default_factory=list)
    #: the converted convs a fixed norm follows (a FrozenBatchNorm2d, or a BN frozen where its conv trains),
    #: with why it counts as fixed: their blocks start as the plain conv, the norm kept after them
    frozen_norm_why: dict[str, str] = field(default_factory=dict)
    #: re-param blocks the model held already (an earlier ``convert``, the zoo), kept as they are: name -> kind
    kept: dict[str, str] = field(default_factory=dict)

    @property
    def frozen_norm(self) -> list[str]:
        """The names of :attr:`frozen_norm_why`, in conversion order."""
        return list(self.frozen_norm_why)

    def __str__(self) -> str:
        unnormed = f" ({len(self.without_bn)} without a BatchNorm2d after them)" if self.without_bn else ""
        if self.frozen_norm:
            unnormed += f" ({len(self.frozen_norm)} before a fixed norm, started as their conv)"
        lines = [f"convert(method={self.method!r}): {len(self.converted)} converted{unnormed}, "
                 f"{len(self.skipped)} skipped; pairs found by {self.pairing}"]
        if self.kept:
            kinds = Counter(self.kept.values())
            lines[0] += (f"; {len(self.kept)} re-param blocks already there kept as they are ("
                         + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + ")")
        lines += [f"  {n} started as their conv, {why}" for why, n in Counter(self.frozen_norm_why.values()).items()]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _tf_same(m: nn.Module) -> bool:
    """timm's ``Conv2dSame`` (its ``tf_*`` networks' strided convs): an nn.Conv2d that pads each
    input by TensorFlow's "SAME" rule before convolving; online OREPA blocks do the same
    (``tf_same=True``) and deploy back to it."""
    return type(m) is Conv2dTFSame or (type(m).__name__ == "Conv2dSame" and type(m).__module__.startswith("timm.")
                                       and isinstance(m, nn.Conv2d))


def pads_tf_same(m: nn.Module) -> bool:
    """Whether ``m`` pads each input by TensorFlow's "SAME" rule itself (a conv or a block with
    ``tf_same``): its ``padding`` stays 0 whatever its stride or dilation."""
    return _tf_same(m) or bool(getattr(m, "tf_same", False))


def _convertible(m: nn.Module) -> bool:
    """A conv that ``convert`` may turn into a block: a plain nn.Conv2d, or timm's Conv2dSame."""
    return type(m) is nn.Conv2d or _tf_same(m)


def _conv_args(conv: nn.Conv2d) -> dict:
    mode = {} if conv.padding_mode == "zeros" else {"padding_mode": conv.padding_mode}  # (Conv2dSame: zeros)
    return dict(
        in_channels=conv.in_channels, out_channels=conv.out_channels, kernel_size=conv.kernel_size,
        stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
        bias=conv.bias is not None, **mode,
    )


def _orepa(conv: nn.Conv2d, rep_1x1: bool = True, **opts) -> ReparamConv2d:
    if conv.kernel_size == (1, 1) and not rep_1x1:
        raise ValueError("1x1 conv left plain (rep_1x1=False)")
    # checked here too: a 1x1 conv drops the branch list below, which would hide a wrong one
    check_block_options(branches=opts.get("branches"), scale_init=opts.get("scale_init"))
    if conv.kernel_size == (1, 1):
        opts = {k: v for k, v in opts.items() if k not in ("branches", "dw_expand")}
    if _tf_same(conv):
        opts["tf_same"] = True
    return OREPAConv2d(**_conv_args(conv), **opts)


def _orepa_offline(conv: nn.Conv2d, rep_1x1: bool = True, inner_norm: bool = True, **opts) -> ReparamConv2d:
    # the prototype of Fig. "linearization": "a norm layer right after each computational layer",
    # so two-step branches have a BN after their first conv too, as DBB's do
    return _orepa(conv, rep_1x1, mode="offline", branch_norm=True, inner_norm=inner_norm, **opts)


def _orepa_vgg(conv: nn.Conv2d, **opts) -> ReparamConv2d:
    return OREPAVGGBlock(**_conv_args(conv), **opts)


def _dbb(conv: nn.Conv2d, **opts) -> ReparamConv2d:
    return DBBConv2d(**_conv_args(conv), **opts)


def _repvgg(conv: nn.Conv2d, **opts) -> ReparamConv2d:
    return RepVGGBlock(**_conv_args(conv), **opts)


#: method name -> factory(conv, **options) -> block; a ValueError means "unsupported, skip"
METHODS: dict[str, Callable[..., ReparamConv2d]] = {
    "orepa": _orepa,
    "orepa-offline": _orepa_offline,
    "dbb": _dbb,
    "repvgg": _repvgg,
    "orepa-vgg": _orepa_vgg,
}

#: the block options each method's factory takes (``convert(model, method, **options)``); the others
#: come from the conv a block replaces (``padding_mode``, timm's ``tf_same``) or from the method
_OREPA_OPTIONS = ("branches", "scaling", "scale_init", "dw_expand", "internal_channels", "init", "recompute")
METHOD_OPTIONS: dict[str, tuple[str, ...]] = {
    "orepa": (*_OREPA_OPTIONS, "rep_1x1", "mode", "branch_norm", "inner_norm"),
    "orepa-offline": (*_OREPA_OPTIONS, "rep_1x1", "inner_norm"),
    "dbb": ("internal_channels",),
    "repvgg": (),
    "orepa-vgg": _OREPA_OPTIONS,
}


def _check_conv_of(conv: nn.Module, method: str) -> None:
    """:func:`check_conv_config` of ``conv``'s settings for a ``method`` block (online OREPA takes any padding)."""
    check_conv_config(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                      conv.dilation, conv.groups, conv.padding_mode, any_padding=method == "orepa")


def _block_could_take(conv: nn.Module) -> bool:
    """Whether an online OREPA block can replace ``conv`` (its kernel, stride, padding, groups)."""
    try:
        _check_conv_of(conv, "orepa")
    except (ValueError, TypeError):
        return False
    return _convertible(conv)


def make_block(method: str, conv: nn.Conv2d, **options) -> ReparamConv2d:
    """The ``method`` block replacing ``conv`` (same device, dtype, memory format, mode, and frozen where
    the conv's weight is: a frozen stage stays frozen); ValueError if unsupported."""
    if not isinstance(method, str) or method not in METHODS:  # (a list is unhashable: no dict lookup)
        raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
    if not _convertible(conv):
        raise ValueError(f"{type(conv).__name__} is not a plain nn.Conv2d")
    if _tf_same(conv) and (method != "orepa" or options.get("mode", "online") != "online"):
        raise ValueError(f"{type(conv).__name__} pads by TensorFlow's 'same' rule (unevenly where the stride needs "
                         "it), which leaves no common centre for branches on the feature map: online OREPA blocks "
                         "(method 'orepa') take it")
    hooks = _hooks(conv)
    if hooks:
        raise ValueError(f"it carries {hooks} (torch.nn.utils.weight_norm / spectral_norm, or a caller's), which a "
                         "block would drop")
    _check_conv_of(conv, method)
    block = METHODS[method](conv, **options)
    if type(conv) is not nn.Conv2d:
        block.deploy_class = type(conv)  # deployed back to the class it replaced
    if not conv.weight.requires_grad:
        block.requires_grad_(False)
    # laid out as the conv was (a model moved to channels_last before convert deploys to channels_last convs)
    layout = {"memory_format": torch.channels_last} if _channels_last(conv.weight) else {}
    return block.to(device=conv.weight.device, dtype=conv.weight.dtype, **layout).train(conv.training)


#: the hooks a module may carry (attribute, what they are called), none of which a module replacing it has
_HOOKS = (("_forward_pre_hooks", "forward pre-hooks"), ("_forward_hooks", "forward hooks"),
          ("_backward_pre_hooks", "backward pre-hooks"), ("_backward_hooks", "backward hooks"),
          ("_state_dict_pre_hooks", "state_dict pre-hooks"), ("_state_dict_hooks", "state_dict hooks"),
          ("_load_state_dict_pre_hooks", "load_state_dict hooks"),
          ("_load_state_dict_post_hooks", "load_state_dict post-hooks"))


def _hooks(m: nn.Module) -> str:
    """The hooks ``m`` carries, in words ("forward pre-hooks, forward hooks"; "" for none): a block or a
    fold replacing it would drop them (weight_norm / spectral_norm of torch.nn.utils compute a conv's
    weight in a pre-hook; a caller's hook on a BN may mask or record its output)."""
    return ", ".join(what for attr, what in _HOOKS
                     # (a block's own hook, blocks._materialise_fixed_kernels, is no caller's: it goes with it)
                     if any(h is not _materialise_fixed_kernels for h in (getattr(m, attr, None) or {}).values()))


# --------------------------------------------------------------------------- finding conv -> BN pairs


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, (ReparamConv2d, AbsorbedNorm)) or _norm_then_act(m) or _tf_same(m) or _frozen_bn(m) \
            or super().is_leaf_module(m, qualname)


#: the hooks that run around a module's forward (and so inside a trace through it)
_CALL_HOOKS = ("_forward_pre_hooks", "_forward_hooks")


#: the modules (by their class's module) whose forwards keep nothing of a call in the model: torch.nn's
#: layers and containers, the zoo's networks, orepa's blocks (a subclass elsewhere may: it is not one)
_FORWARDS_THAT_KEEP_NOTHING = ("torch.nn.modules.", "orepa.models.", "orepa.blocks")


def _traced(model: nn.Module) -> torch.fx.Graph:
    """``model``'s graph (modules named as in ``model``), traced on a copy of it that shares its
    tensors: torch.fx runs the Python of the forward and of the hooks of the modules it traces
    through on placeholders (Proxy objects), and whatever they keep in the model (a forward's or a
    hook's stored outputs: timm's ``feature_cls="hook"`` nets) broke the model's copying, pickling
    and deployment. The hooks run (one that changes a module's input or output is part of the
    function; a caller's function that records outputs in its own list still records placeholders
    there). A model whose copy cannot be made or traced (one that looks itself up by ``id``) is
    traced itself, whatever the copy's error (a forward that branches on a placeholder only where
    it does not find itself in such a registry fails on the copy alone), so an untraceable model
    is traced twice. A model of torch.nn's and orepa's own modules without hooks keeps nothing of a
    trace (their forwards store nothing) and is traced itself: the copy costs more than the trace."""
    if all(type(m).__module__.startswith(_FORWARDS_THAT_KEEP_NOTHING) and not any(getattr(m, attr, None)
                                                                                for attr in _CALL_HOOKS)
           for m in model.modules()):
        return _LeafTracer().trace(model)
    try:
        twin = _deepcopy(model, {id(t): t for t in _held_tensors(model)})
    except Exception:  # noqa: BLE001 - weight_norm's computed weight refuses copies, as may other code
        return _LeafTracer().trace(model)
    try:
        return _LeafTracer().trace(twin)
    except Exception:  # noqa: BLE001 - e.g. a registry keyed by id(module), which control flow may read too
        return _LeafTracer().trace(model)


def _attribute_values(holder) -> Iterator:
    """What ``holder`` keeps as plain attributes: each value, and a list's, tuple's or dict's items."""
    for value in getattr(holder, "__dict__", {}).values():
        yield value
        yield from value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()


def _held_tensors(model: nn.Module) -> list[Tensor]:
    """The tensors the copy for tracing shares with ``model`` instead of copying them: its parameters
    and buffers, the tensors its modules hold as plain attributes (directly or in a list, tuple or
    dict), and those the objects behind their hooks hold so (a feature logger's stored outputs)."""
    found = [*model.parameters(), *model.buffers()]
    holders = list(model.modules())
    holders += [hook.__self__ for m in model.modules() for attr in _CALL_HOOKS
                for hook in getattr(m, attr, {}).values() if hasattr(hook, "__self__")]
    found += [t for holder in holders for t in _attribute_values(holder) if isinstance(t, Tensor)]
    return found


def _deepcopy(model: nn.Module, memo: dict | None = None) -> nn.Module:
    """``copy.deepcopy(model)`` with every module in its own training mode (a GraphModule's copy,
    torchvision's ``create_feature_extractor``'s, comes back in training mode)."""
    twin = copy.deepcopy(model, memo)
    for mine, theirs in zip(twin.modules(), model.modules()):
        mine.training = theirs.training
    return twin


def _is_conv(m: nn.Module) -> bool:
    return _convertible(m) or isinstance(m, ReparamConv2d)


#: timm's BatchNorm subclasses whose forward is the batch norm, then ``self.drop``, then ``self.act``
_TIMM_NORM_ACTS = ("BatchNormAct2d", "SyncBatchNormAct")


def _norm_then_act(m: nn.Module) -> bool:
    """timm's BatchNormAct2d / SyncBatchNormAct (timm's ConvNormAct layers, most of its CNNs):
    the BN part folds into the conv before it and ``drop`` and ``act`` stay (:func:`_tail`)."""
    return (type(m).__name__ in _TIMM_NORM_ACTS and type(m).__module__.startswith("timm.")
            and isinstance(m, BATCH_NORMS) and isinstance(getattr(m, "drop", None), nn.Module)
            and isinstance(getattr(m, "act", None), nn.Module))


def _tail(bn: nn.Module) -> nn.Module:
    """What stays of a folded BN: nothing for BatchNorm2d / SyncBatchNorm, a timm norm-act's
    dropout and activation."""
    return nn.Sequential(bn.drop, bn.act) if _norm_then_act(bn) else nn.Identity()


def _normalise_as(block: nn.Module, bn: nn.Module) -> None:
    """A block's own BNs take the ``eps`` and ``momentum`` of the BN it absorbs (a network may declare
    others than torch's defaults: torchvision's MobileNetV3 1e-3 / 0.01, timm's ``tf_*`` nets eps 1e-3):
    with the plain weights loaded the block then computes conv + BN exactly, in training mode too, and
    its running statistics follow the network's own average. They are SyncBatchNorms (of its process
    group) where it is one: under DDP their statistics are then the whole batch's, as its were. Their
    affines train where its did (a frozen conv before a BN that trains, BN-only fine-tuning: the block's
    convs stay frozen, its BNs train as that BN did)."""
    for m in block.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eps, m.momentum = bn.eps, bn.momentum
            if m.affine and bn.affine:
                m.weight.requires_grad_(bn.weight.requires_grad)
                m.bias.requires_grad_(bn.bias.requires_grad)
    if isinstance(bn, nn.SyncBatchNorm):  # (the block is no BN itself: its children are swapped in place)
        nn.SyncBatchNorm.convert_sync_batchnorm(block, bn.process_group)


def _is_bn(m: nn.Module) -> bool:
    """A BatchNorm2d or SyncBatchNorm itself, or a timm norm-act: any other subclass may do more
    than normalise, which folding or absorbing its BN would drop."""
    return type(m) in BATCH_NORMS or _norm_then_act(m)


def _foldable_bn(bn: nn.Module, conv: nn.Module) -> bool:
    if _frozen_bn(bn):  # fixed statistics: folds as a BN in eval mode does
        return bn.running_mean.numel() == conv.out_channels
    return _is_bn(bn) and bn.track_running_stats and bn.num_features == conv.out_channels


@contextlib.contextmanager
def _in_mode(model: nn.Module, training: bool):
    """Every module in ``training`` mode for a while, then each back in its own (a frozen stage's
    BN stays in eval mode inside a model in training mode)."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


#: why a conv whose tensors the forward reads itself is left plain, paired with a BN or not (``without_bn``)
_READ_OUTSIDE = "its weight or bias is also read outside it (a tied weight), which a block does not hold"


def _graph_pairs(model: nn.Module, graph, left_out: dict[str, str] | None) -> tuple[list[tuple[str, str]], set[str]]:
    """The conv -> BN pairs of one traced graph of ``model``, and the modules that graph calls;
    ``left_out`` also takes every conv whose tensors the graph reads outside it (a lone conv too, which
    ``without_bn`` would otherwise replace: ``self.proj.weight.dtype`` in timm's EdgeNeXt)."""
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    # a conv whose weight or bias the forward also reads itself (a tied decoder's F.conv_transpose2d
    # of encoder.weight): a block holds no such tensor; a BN whose affine or statistics it reads (a
    # sparsity term of bn.weight): the placeholder or Identity standing for it holds none either
    read = {node.target for node in graph.nodes if node.op == "get_attr"}

    def read_outside(name: str) -> bool:
        return any(t.startswith(name + ".") for t in read)

    if left_out is not None:
        for target in read:
            owner = target.rpartition(".")[0]  # ('' where the model is the conv: its own forward's read)
            if owner and owner in modules and _is_conv(modules[owner]):
                left_out.setdefault(owner, _READ_OUTSIDE)
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        src = node.args[0]
        if src.op != "call_module" or len(src.users) != 1:
            continue
        conv, bn = modules[src.target], modules[node.target]
        if _is_conv(conv) and _foldable_bn(bn, conv) and calls[src.target] == 1 and calls[node.target] == 1:
            if read_outside(src.target):
                why = _READ_OUTSIDE
            elif read_outside(node.target):
                why = (f"the forward also reads the tensors of its BN {node.target!r} outside it (its weight, bias "
                       "or statistics), which folding or absorbing that BN would remove")
            else:
                pairs.append((src.target, node.target))
                continue
            if left_out is not None:
                left_out[src.target] = why
    return pairs, set(calls)


def _pairs_fx(model: nn.Module, left_out: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The conv -> BN pairs of ``model``'s traced graphs; ``left_out`` takes ``{conv: why}`` for the
    convs that a BN follows but whose (or whose BN's) tensors the forward also reads.

    Both modes' graphs, agreed as :func:`_agreed_pairs` does. An eval graph torch.fx cannot trace
    leaves the training graph's pairs."""
    with _in_mode(model, True):
        found = {True: _graph_pairs(model, _traced(model), left_out)}
    try:
        with _in_mode(model, False):
            found[False] = _graph_pairs(model, _traced(model), left_out)
    except Exception:  # noqa: BLE001 - control flow fx cannot follow in eval mode only
        pass
    return _agreed_pairs(found, left_out)


def _agreed_pairs(found: dict[bool, tuple[list[tuple[str, str]], Iterable[str]]],
                  left_out: dict[str, str] | None) -> list[tuple[str, str]]:
    """The pairs both modes agree on, from ``{training: (its pairs, the modules its forward calls)}``.

    A branch that runs in training only (an aux head) is paired by the training mode, and a pair
    holds only where the other mode, if it calls the conv at all, pairs it too (a forward that also
    reads the conv's output in eval mode only would compute another function once the BN is
    absorbed); ``left_out`` takes the reason for those. One mode alone (the other could not be traced
    or run) gives its pairs."""
    if len(found) == 1:
        return next(iter(found.values()))[0]
    (train_pairs, train_calls), (eval_pairs, eval_calls) = found[True], found[False]
    pairs = [p for p in train_pairs if p in eval_pairs or p[0] not in eval_calls]
    pairs += [p for p in eval_pairs if p not in train_pairs and p[0] not in train_calls]
    if left_out is not None:
        for (conv, bn), mode, other in [*((p, "training", "eval") for p in train_pairs),
                                        *((p, "eval", "training") for p in eval_pairs)]:
            if (conv, bn) not in pairs and conv not in left_out:
                left_out[conv] = (f"its output goes to {bn!r} alone in {mode} mode, but the {other} mode's forward "
                                  "reads it otherwise too, which a block replacing both would change")
    return pairs


class _UseCounter(torch.overrides.TorchFunctionMode):
    """Counts, for each watched tensor, the torch functions that compute a tensor from it: a
    conv's output may feed its BN and also an op outside any module (a residual sum), which the
    BN's forward hook alone cannot see. Shape and dtype queries compute no tensor and do not count."""

    def __init__(self, watched: dict[int, torch.Tensor], params: dict[int, tuple[torch.Tensor, str]] | None = None):
        super().__init__()
        self.watched = watched
        self.uses: dict[int, int] = {}
        # a conv's parameters ({id: (tensor, conv name)}): any use, a ``.dtype`` too, while that conv is
        # not running is the forward reading them itself (``read_outside``), which a block would not hold
        self.params, self.running, self.read_outside = {} if params is None else params, set(), set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            owner = self.params.get(id(t)) if isinstance(t, torch.Tensor) else None
            if owner is not None and owner[0] is t and owner[1] not in self.running:
                self.read_outside.add(owner[1])
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(out)):
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and self.watched.get(id(t)) is t:
                    self.uses[id(t)] = self.uses.get(id(t), 0) + 1
        return out


def _pairs_hooks(model: nn.Module, example_input, left_out: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The conv -> BN pairs of running ``example_input`` through the model in each mode
    (:func:`_pairs_run`), agreed as :func:`_agreed_pairs` does. They hold for the path that input
    takes: a forward whose control flow depends on the data may take another for other inputs.

    The training-mode run leaves the model's buffers (its BNs' running statistics) and the random
    streams as they were. A model that does not take the input in training mode (a detector wants
    targets then, a BN a batch of more than one value per channel) is paired by its eval run, with a
    warning."""
    found = {False: _pairs_run(model, example_input, training=False, left_out=left_out)}
    try:
        with _untouched(model):
            found[True] = _pairs_run(model, example_input, training=True, left_out=left_out)
    except Exception as exc:  # noqa: BLE001 - any error of the model's own forward
        warnings.warn(f"conv -> BN pairs checked in eval mode only: the model did not run example_input in training "
                      f"mode ({type(exc).__name__}: {str(exc)[:100]}), so a forward that also reads a conv's output "
                      "beside its BN in training only would be changed", stacklevel=2)
    return _agreed_pairs(found, left_out)


@contextlib.contextmanager
def _untouched(model: nn.Module):
    """The model's buffers (a BN's running statistics and batch count) and the random streams (of the
    CPU and the model's GPUs: its dropout) back as they were after a while."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    gpus = sorted({t.device.index for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=gpus):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, value in saved:
                    b.copy_(value)


def _pairs_run(model: nn.Module, example_input, training: bool, left_out: dict[str, str] | None = None) \
        -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Run the model once in ``training`` mode; a BN whose input IS a conv's output tensor, and that
    tensor's only use, pairs with that conv, unless the forward reads the conv's tensors outside it
    (``left_out`` takes those convs, paired or not). The conv outputs are held until the run ends: a
    freed output's ``id`` can come back as another tensor's (the BN's input after a ReLU, say). Returns
    the pairs and the modules called."""
    outputs: dict[int, torch.Tensor] = {}  # id -> a conv's output
    conv_of: dict[int, str] = {}  # id -> the conv's name
    bn_input: dict[str, torch.Tensor] = {}  # BN name -> the conv output it read
    calls: dict[str, int] = {}
    handles = []

    def hook(name):
        def fn(mod, args, out):
            calls[name] = calls.get(name, 0) + 1
            if _pairs_with_conv(mod) and args and isinstance(args[0], torch.Tensor) and outputs.get(id(args[0])) is args[0]:
                bn_input[name] = args[0]
            if _is_conv(mod) and isinstance(out, torch.Tensor):
                outputs[id(out)], conv_of[id(out)] = out, name
        return fn

    params: dict[int, tuple[torch.Tensor, str]] = {}
    counter = _UseCounter(outputs, params)
    for name, m in model.named_modules():
        if _is_conv(m) or _pairs_with_conv(m):
            handles.append(m.register_forward_hook(hook(name)))
        if _is_conv(m):
            params.update((id(p), (p, name)) for p in m._parameters.values() if p is not None)
            handles.append(m.register_forward_pre_hook(lambda mod, args, name=name: counter.running.add(name)))
            handles.append(m.register_forward_hook(lambda mod, args, out, name=name: counter.running.discard(name),
                                                   prepend=True))
    try:
        with _in_mode(model, training), torch.no_grad(), counter:
            result = model(*example_input) if isinstance(example_input, tuple) else model(example_input)
    finally:
        for h in handles:
            h.remove()
    for t in torch.utils._pytree.tree_leaves(result):  # a conv output the model returns is used there too
        if isinstance(t, torch.Tensor) and outputs.get(id(t)) is t:
            counter.uses[id(t)] = counter.uses.get(id(t), 0) + 1
    modules = dict(model.named_modules())
    pairs = [(conv_of[id(t)], b) for b, t in bn_input.items() if counter.uses.get(id(t)) == 1]
    pairs = [(c, b) for c, b in pairs if calls[c] == 1 and calls[b] == 1 and _foldable_bn(modules[b], modules[c])
             and c not in counter.read_outside]
    if left_out is not None:
        for name in counter.read_outside:
            left_out.setdefault(name, _READ_OUTSIDE)
    return pairs, calls


def _frozen_bn(m: nn.Module) -> bool:
    """torchvision's ``FrozenBatchNorm2d`` (and others of that name, e.g. detectron2's): a BN whose
    statistics and affine are buffers (no torchvision import in the library: by its name and buffers)."""
    return type(m).__name__ == "FrozenBatchNorm2d" and all(
        isinstance(getattr(m, k, None), torch.Tensor) for k in ("weight", "bias", "running_mean", "running_var"))


def _fixed_norm(bn: nn.Module, conv: nn.Conv2d) -> str | None:
    """Why the norm after ``conv`` is fixed where the conv trains (how its conv is then converted:
    the norm stays after the block, which starts as the conv), or None: a ``FrozenBatchNorm2d``, or a
    BN its network froze while the conv trains (in eval mode: frozen-BN fine-tuning; or its affine
    frozen). Absorbed, its block's own BNs would train where it does not."""
    if _frozen_bn(bn):
        return f"followed by a {type(bn).__name__} (fixed statistics, as torchvision's pretrained detectors have)"
    if not conv.training or not isinstance(bn, nn.modules.batchnorm._BatchNorm):
        return None
    if not bn.training:
        return f"followed by a {type(bn).__name__} in eval mode while the conv trains (fixed statistics)"
    if conv.weight.requires_grad and bn.affine and not (bn.weight.requires_grad or bn.bias.requires_grad):
        return f"followed by a {type(bn).__name__} whose affine is frozen while the conv trains"
    return None


def _pairs_with_conv(m: nn.Module) -> bool:
    """A norm a conv -> norm pair may end in: a BN :func:`_is_bn` takes, or a frozen one."""
    return _is_bn(m) or _frozen_bn(m)


def _followed_by_unfoldable_bn(model: nn.Module) -> dict[str, str]:
    """``{conv name: why}`` for each plain conv registered right before a BatchNorm2d subclass (see
    :func:`_is_bn`) or a BN without running statistics: the reason it is skipped."""
    out = {}
    for parent_name, parent in model.named_modules():
        children = list(parent.named_children())
        prefix = f"{parent_name}." if parent_name else ""
        for (cn, c), (_, bn) in zip(children, children[1:]):
            if _convertible(c) and isinstance(bn, BATCH_NORMS) and not _is_bn(bn):
                out[prefix + cn] = (f"followed by a {type(bn).__name__}: only BatchNorm2d, "
                                    "SyncBatchNorm and timm's BatchNormAct2d are folded or absorbed, since another "
                                    "subclass may do more than normalise")
            elif _convertible(c) and _is_bn(bn) and not bn.track_running_stats:
                out[prefix + cn] = ("followed by a BatchNorm2d without running statistics (track_running_stats="
                                    "False), which normalises by the batch in eval mode too: no conv folds it")
    return out


def _slots(model: nn.Module) -> dict[int, int]:
    """id(module or Parameter) -> at how many places (parent, attribute) of the model it is registered."""
    count: dict[int, int] = {}
    for parent in model.modules():
        # children() would count a child held twice by one parent once
        for child in [*parent._modules.values(), *parent._parameters.values()]:
            if child is not None:
                count[id(child)] = count.get(id(child), 0) + 1
    return count


def _pairs_structural(model: nn.Module) -> tuple[list[tuple[str, str]], dict[str, str], dict[str, str]]:
    """The fallback when torch.fx cannot trace the whole model and no example input is given.

    Pairs only what is adjacent by construction: consecutive children of an ``nn.Sequential``
    (its stock forward feeds each child's output to the next child only) and the pairs
    torch.fx finds in every submodule it can trace on its own. What the untraceable parent does
    with those submodules is not seen: a forward that also calls one child of a Sequential on its
    own (``self.seq[0](x)``) needs ``example_input``. A conv or BN registered at
    several places (a BN shared by two convs) is never paired. Returns the pairs,
    for the conv -> BN pairs a registration-order guess would have made but that are not
    provable, or that a traced submodule leaves out, ``{conv_name: why it was left out}``, and for
    the pairs taken on trust (a Sequential's or a traced submodule's that is the child of a module
    torch.fx could not trace whose forward reaches into it:
    :func:`_reaches_into`) ``{conv_name: that module's name}``.
    """
    slots = _slots(model)
    pairs: list[tuple[str, str]] = []
    left_out: dict[str, str] = {}
    untraced: dict[str, str] = {}  # module name -> why torch.fx could not trace it
    seen: set[int] = set()
    trusted: dict[str, str] = {}  # conv name -> the untraced module trusted to call its submodule whole

    def visit(module: nn.Module, prefix: str, caller: tuple[str, str] | None) -> None:
        # caller: where this one is the child of an untraced module, (that module's name, this child's
        # name), whose forward may reach into it; a container further down that it iterates and whose
        # elements it calls whole (a head's ModuleList, a YOLO-style layer list) calls them whole too,
        # so their children get None: reaching two levels down is not looked for
        if id(module) in seen or isinstance(module, (ReparamConv2d, AbsorbedNorm)) or not any(module.children()):
            return  # visited, a block (its steps are not the model's convs) or a leaf
        seen.add(id(module))
        sequential = isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
        if sequential:
            children = list(module.named_children())
            found = [(prefix + cn, prefix + bn_name) for (cn, c), (bn_name, bn) in zip(children, children[1:])
                     if _is_conv(c) and _foldable_bn(bn, c)]
        else:
            inner: dict[str, str] = {}
            try:
                found = [(prefix + c, prefix + b) for c, b in _pairs_fx(module, inner)]
            except Exception as exc:  # untraceable: look inside
                name = prefix.rstrip(".")
                untraced[name] = f"{type(exc).__name__}: {str(exc)[:100]}".split("\n")[0]
                for child_name, child in module.named_children():
                    visit(child, f"{prefix}{child_name}.", (name, child_name))
                return
            left_out.update((prefix + c, why) for c, why in inner.items())
        pairs.extend(found)
        # (the caller's source read once per submodule, not once per pair)
        if found and caller is not None and _reaches_into(model.get_submodule(caller[0]), caller[1]):
            trusted.update((conv, caller[0]) for conv, _ in found)
        if sequential:  # (a traced submodule's pairs are all found: nothing inside it to visit)
            for child_name, child in module.named_children():
                visit(child, f"{prefix}{child_name}.", None)

    visit(model, "", None)
    pairs = [(c, b) for c, b in pairs if slots[id(model.get_submodule(c))] == slots[id(model.get_submodule(b))] == 1]
    paired = {c for c, _ in pairs}
    for parent_name, parent in model.named_modules():
        if isinstance(parent, (ReparamConv2d, AbsorbedNorm)) or _inside_block(parent_name, model):
            continue
        children = list(parent.named_children())
        prefix = f"{parent_name}." if parent_name else ""
        for (cn, c), (bn_name, bn) in zip(children, children[1:]):
            if prefix + cn in paired or prefix + cn in left_out or not (_is_conv(c) and _foldable_bn(bn, c)):
                continue
            conv_name, bn_name = prefix + cn, prefix + bn_name
            if slots[id(c)] > 1 or slots[id(bn)] > 1:
                shared = conv_name if slots[id(c)] > 1 else bn_name
                left_out[conv_name] = (f"not paired with {bn_name!r}: {shared!r} is registered at several places "
                                       "(shared), so it may not be a single conv -> BN pair")
            elif parent_name in untraced:
                where = f"{parent_name!r}" if parent_name else "the model"
                left_out[conv_name] = (
                    f"not paired with {bn_name!r}, registered right after it: torch.fx could not trace "
                    f"{where} ({type(parent).__name__}; {untraced[parent_name]}), so nothing "
                    f"shows that {bn_name!r} consumes only this conv's output; pass example_input to pair by "
                    "running the model")
    return pairs, left_out, {c: trusted[c] for c in paired if c in trusted}


def _reaches_into(module: nn.Module, attr: str) -> bool:
    """Whether ``module``'s forward, as its source reads, may reach into its child ``attr`` instead of
    calling it whole: it names the child otherwise than to call it (``self.seq(x)``) or to test it
    (``self.seq is not None``): indexes it (``self.seq[1]``), takes a child of it (``self.seq.conv``),
    iterates over it, passes it to a function (``helper(self.seq, x)``), keeps it under another name
    (``seq = self.seq``), fetches it by name (``getattr``), or goes through the module tree
    (``self.children()``, ``self.modules()``, ``self._modules``, ``get_submodule``; a Sequential
    subclass's ``self[0]``, ``for m in self:``), or hands the module itself to a function
    (``_apply(self, x)``: code outside the class, which may do any of these). True where the
    source cannot be read. The methods of its class that forward calls (``self._head(x)``), and those
    they call, are read too. (A forward that calls the Sequential whole, as torchvision's detectors
    call their heads, leaves its pairs as it builds them.)"""
    a = re.escape(attr)

    def reach(me: str) -> re.Pattern:  # ``me``: the method's first parameter, ``self`` by custom
        # (not after a digit: a child "0" is no float's "1.0")
        return re.compile(rf"(?<!\d)\.{a}\b(?!\s*\(|\s+is\s+(not\s+)?None\b)|getattr\([^)]*['\"]{a}['\"]"
                          r"|\.(named_)?(children|modules)\s*\(|\._modules\b|\bget_submodule\s*\("
                          rf"|\b{me}\s*\[|\bin\s+{me}\s*:")

    cls, todo, seen = type(module), ["forward"], set()
    while todo:
        name = todo.pop()
        fn = inspect.getattr_static(cls, name, None)
        if name in seen or fn is None or fn is getattr(nn.Module, name, None):
            continue  # read once; a child module or attribute, or nn.Module's own method: not the class's code
        seen.add(name)
        fn = getattr(fn, "__func__", fn)  # a static or class method
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            if name == "forward":
                return True
            continue  # a helper without readable source (a builtin, a C extension's): nothing to read
        me = _first_parameter(src)
        if me is None:
            return True  # (unparsable: may do anything)
        name_re = re.escape(me or "self")
        if reach(name_re).search(src) or _passes_self(src, me):
            return True
        todo += re.findall(rf"\b{name_re}\.(\w+)\s*\(", src)
    return False


#: functions that take a module without reaching into it
_TAKE_SELF_WHOLE = frozenset({"isinstance", "issubclass", "type", "id", "hasattr", "super", "repr", "str"})


def _method_node(src: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function definition the method source ``src`` holds (None for a lambda's line)."""
    tree = ast.parse(textwrap.dedent(src))
    return next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)


def _first_parameter(src: str) -> str | None:
    """The first parameter's name of the method whose source is ``src`` (``self`` by custom; ``""``
    for a static method or a lambda's line); None where the source does not parse."""
    try:
        fn = _method_node(src)
    except SyntaxError:
        return None
    return fn.args.args[0].arg if fn is not None and fn.args.args else ""


def _passes_self(src: str, me: str) -> bool:
    """Whether the method source ``src`` hands its module (its first parameter, ``me``) to a function."""
    fn = _method_node(src) if me else None
    if fn is None:
        return False  # (a static method: no module to hand on)

    def is_me(a: ast.expr) -> bool:
        return isinstance(a, ast.Name) and a.id == me or isinstance(a, ast.Starred) and is_me(a.value)

    return any(isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _TAKE_SELF_WHOLE)
               and any(is_me(a) for a in (*node.args, *(k.value for k in node.keywords))) for node in ast.walk(fn))


def _replace_reason(model: nn.Module, slots: dict[int, int], names, hooked=None) -> str | None:
    """Why the modules ``names`` (a conv and its BN, or a lone conv) cannot be replaced: one is
    registered at several places (:func:`_slots`), or holds a parameter another module holds too
    (a tied weight: ``c2.weight = c1.weight``); swapping it under one name would leave the other
    name, or the other module, holding the old tensors. Or one of ``hooked`` (default: all) carries
    hooks (:func:`_hooks`), which its replacement would drop. None where they can."""
    # (the model itself is registered nowhere)
    shared = [n for n in names if n is not None and slots.get(id(model.get_submodule(n)), 0) > 1]
    if shared:
        return (f"{shared[0]!r} is registered at several places (another attribute holds the same module), so "
                "replacing it under one name would split it")
    for n in names:
        if n is None:
            continue
        hooks = _hooks(model.get_submodule(n)) if hooked is None or n in hooked else None
        if hooks:
            who = repr(n) if n else f"the {type(model).__name__} itself"  # (the model is the conv: its name is '')
            return (f"{who} carries {hooks} (a caller's, or torch.nn.utils.weight_norm / spectral_norm's), which "
                    "the block or fold replacing it would drop")
        for pname, p in model.get_submodule(n)._parameters.items():
            if p is not None and slots.get(id(p), 1) > 1:
                return (f"{n}.{pname} is tied (another module holds the same Parameter), which a block would "
                        "train and deploy apart from it")
    return None


def _find_pairs(model: nn.Module, example_input=None, bn_hooks: bool = True) \
        -> tuple[list[tuple[str, str]], str, dict[str, str], dict[str, str]]:
    """:func:`find_conv_bn_pairs` plus ``{conv_name: why}`` for the likely pairs it left out and
    ``{conv_name: module}`` for the pairs taken on trust of an untraced module (:func:`_pairs_structural`).
    Whatever the route, a pair with a module registered at several places, holding a tied parameter or
    carrying hooks is left out (:func:`_replace_reason`): neither ``convert`` nor ``fuse_conv_bn`` could
    replace it whole. ``bn_hooks=False``: a BN's hooks are the caller's to judge (``convert``, whose
    online blocks leave the BN in place)."""
    pairs, how, left_out, trusted = _pairs_any_route(model, example_input)
    slots = _slots(model)
    kept = []
    for conv_name, bn_name in pairs:
        why = _replace_reason(model, slots, (conv_name, bn_name), None if bn_hooks else (conv_name,))
        if why is None:
            kept.append((conv_name, bn_name))
        else:
            left_out[conv_name] = why
    return kept, how, left_out, {c: m for c, m in trusted.items() if c not in left_out}


def _pairs_any_route(model: nn.Module, example_input=None) \
        -> tuple[list[tuple[str, str]], str, dict[str, str], dict[str, str]]:
    """The pairs of the first route that works: torch.fx, forward hooks, the structural fallback."""
    left_out: dict[str, str] = {}
    try:
        return _pairs_fx(model, left_out), "torch.fx", left_out, {}
    except Exception as exc:  # untraceable control flow etc.
        reason = f"{type(exc).__name__}"
    if example_input is not None:
        return _pairs_hooks(model, example_input, left_out), f"forward hooks (fx failed: {reason})", left_out, {}
    pairs, left_out, trusted = _pairs_structural(model)
    return pairs, (f"traceable submodules and nn.Sequential order (fx failed on the model: {reason}; "
                   "pass example_input to pair the rest by running the model)"), left_out, trusted


def _warn_trusted(caller: str, trusted: dict[str, str], stacklevel: int = 3,
                  advice: str = "pass example_input to pair by running the model") -> None:
    """Where a BN is folded or absorbed on a pairing only trusted (:func:`_pairs_structural`): a
    forward that calls one child of such a Sequential or traced submodule alone, or reorders them,
    would be changed."""
    if trusted:
        convs = sorted(trusted)
        where = ", ".join(sorted({repr(m) if m else "the model" for m in trusted.values()}))
        warnings.warn(f"{caller}: torch.fx could not trace {where}, so the BN after {', '.join(map(repr, convs[:3]))}"
                      f"{f' and {len(convs) - 3} more convs' if len(convs) > 3 else ''} was paired by nn.Sequential "
                      "order or by tracing its submodule alone, trusting that forward, which reaches into the "
                      "submodule, to call each such submodule whole (one calling a child alone or reordering them "
                      f"would be changed); {advice}", stacklevel=stacklevel)


def find_conv_bn_pairs(model: nn.Module, example_input=None) -> tuple[list[tuple[str, str]], str]:
    """``[(conv_name, bn_name)]`` where the BN directly and only consumes the conv's output.

    Tries torch.fx; if the model cannot be traced, runs ``example_input`` through
    it with hooks, in training and in eval mode (the pairs both agree on, the model left as it
    was; they hold for the path that input takes, where the forward's control flow depends on
    the data); without an example input, pairs only what is adjacent by construction:
    consecutive children of an ``nn.Sequential`` and the pairs in every submodule
    torch.fx can trace on its own (a conv and BN registered one after the other
    in an untraceable module are left out, with a warning). That fallback trusts the
    untraceable parent to call those submodules whole: one that also calls a Sequential's
    child on its own needs ``example_input`` (where its source shows it reaching into the
    submodule, folding or absorbing such a pair warns). Returns the pairs and
    the method used.
    """
    pairs, how, left_out, _ = _find_pairs(model, example_input)
    _warn_left_out(left_out)
    return pairs, how


def _warn_left_out(left_out: dict[str, str], stacklevel: int = 3) -> None:
    if left_out:
        warnings.warn("conv -> BN pairs left out: " + "; ".join(f"{c}: {why}" for c, why in left_out.items()),
                      stacklevel=stacklevel)


# --------------------------------------------------------------------------- convert / reparameterize


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def convert(
    model: nn.Module,
    method: str = "orepa",
    *,
    inplace: bool = False,
    example_input=None,
    exclude: Callable[[str, nn.Conv2d], bool] | None = None,
    return_report: bool = False,
    without_bn: bool = False,
    **options,
):
    """Replace every supported Conv2d -> BatchNorm2d pair of ``model`` by a ``method`` block.

    Args:
        method: ``"orepa"``, ``"orepa-offline"``, ``"dbb"``, ``"repvgg"`` or ``"orepa-vgg"``.
        inplace: modify ``model`` itself instead of a deep copy.
        example_input: used to pair convs with BNs when torch.fx cannot trace the model (run in
            both modes: the pairs hold for the path it takes, see :func:`find_conv_bn_pairs`).
        exclude: ``exclude(name, conv) -> True`` keeps that conv plain.
        return_report: also return a :class:`ConversionReport`.
        without_bn: ``"orepa"`` only: also convert the convs that no BatchNorm2d follows (those
            of networks normalised otherwise, as ConvNeXt's depthwise convs before a LayerNorm or
            a head's convs before a GroupNorm). The deployed network keeps their layout (a conv's
            bias stays its bias). The paper puts a BN after every block (its post-addition norm,
            which keeps the sum of the branches' outputs in scale); here the network's own norm
            takes that role, and where nothing normalises a conv's output the block's output
            starts ~3x the plain conv's in scale: start such a network as the plain one
            (:func:`load_plain_state_dict`) or keep those convs plain (``exclude``;
            ``rep_1x1=False`` for the 1x1 convs, squeeze-excitation's among them).
        options: passed to the block (e.g. ``branches``, ``scaling``, ``scale_init``, ``rep_1x1``;
            :data:`METHOD_OPTIONS` lists each method's). ``branches`` and ``dw_expand`` shape the kxk
            blocks: an OREPA 1x1 conv becomes the paper's Rep-1x1 (1x1 and 1x1->1x1) whatever they
            say, as in the paper's ablations; ``rep_1x1=False`` leaves the 1x1 convs plain.
    Convs without a following BatchNorm2d are left alone (unless ``without_bn``): re-param
    blocks need a norm after them (OREPA uses it as the post-addition norm). So are convs a
    block cannot replace (even kernels; for the blocks that run branches on the feature map, a
    padding other than "same"; ...,
    and every layer that is not a plain ``nn.Conv2d``: Conv1d, ConvTranspose2d; timm's
    ``Conv2dSame`` is the exception, an online OREPA block with ``tf_same=True``),
    convs and BNs that carry hooks (``torch.nn.utils.weight_norm`` / ``spectral_norm``, a caller's:
    a block or fold would drop them), convs and BNs registered at several places (replacing one
    name would split the module) or holding a Parameter another module holds too (a tied weight),
    convs whose output the forward of one mode (training or eval) reads beside their BN, pairs
    whose BN's tensors the forward reads itself (``bn.weight``),
    and convs followed by a BatchNorm2d subclass, which may do more than normalise
    (timm's BatchNormAct2d / SyncBatchNormAct are the exception: blocks that keep
    the BN after them, such as OREPA's, take them); the report says why for each.

    The blocks are initialised afresh (the method's initialisation): a kernel
    does not split back into branches. A conv followed by a ``FrozenBatchNorm2d``
    (torchvision's pretrained detectors; fixed statistics and affine) is the exception: an
    ``"orepa"`` block, which keeps the norm after it, starts as that conv (its main branch the
    conv, the others at zero), since the fixed statistics fit those weights only; the blocks of
    the other methods hold BNs of their own and skip such convs. To start as the plain network instead
    (pretrained weights), pass its state_dict to :func:`load_plain_state_dict`
    after converting: each block's main branch takes its conv, the others start
    at zero. Convs whose weight does not require grad (frozen
    stages) give blocks that do not either.

    Raises:
        ValueError: an unknown ``method``, option (not in :data:`METHOD_OPTIONS`) or branch name
            (in ``branches`` / ``scale_init``), or a model in which nothing was converted (no
            supported conv -> BN pair, and no re-param block from an earlier
            ``convert``): the message lists every conv and why it was skipped.
    """
    _check_module(model, "convert")
    if not isinstance(method, str) or method not in METHODS:  # (a list is unhashable: no dict lookup)
        raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")
    if exclude is not None and not callable(exclude):  # (else a TypeError at the first conv, naming no option)
        raise TypeError(f"exclude must be a function (name, conv) -> bool, got {type(exclude).__name__}")
    check_flags({"inplace": inplace, "return_report": return_report, "without_bn": without_bn, **options},
                ("inplace", "return_report", "without_bn", "rep_1x1", "branch_norm", "inner_norm"))
    if without_bn and method != "orepa":
        raise ValueError(f"without_bn=True is for method 'orepa', whose blocks keep the BN after them as it is; "
                         f"{method!r} blocks hold BNs of their own and absorb the BatchNorm2d after them, so they "
                         "need one")
    # options, and option values, wrong for every conv fail here: in the loop a block's ValueError (or
    # TypeError: an unexpected keyword) skips its conv, and "found nothing to convert" would name the convs
    unknown = sorted(set(options) - set(METHOD_OPTIONS[method]))
    if unknown:
        accepted = sorted({*METHOD_OPTIONS[method], *(("without_bn",) if method == "orepa" else ())})
        raise ValueError(f"option(s) {unknown} not accepted by convert(method={method!r}); accepted: "
                         f"{accepted or 'none'}")
    check_block_options(**{k: options[k] for k in ("branches", "scaling", "scale_init", "dw_expand",
                                                   "internal_channels") if k in options})
    if "init" in options:
        _resolve_init(options["init"], (3, 3))  # (the kernel size sets only the default's slope)
    if not inplace:
        try:
            model = _deepcopy(model, _callers_hooks(model))
        except RuntimeError as exc:  # torch.nn.utils.weight_norm's computed weight refuses to be copied
            raise ValueError(f"convert(inplace=False) cannot copy {type(model).__name__} ({exc}); "
                             "pass inplace=True to convert the model itself") from None
    pairs, how, left_out, trusted = _find_pairs(model, example_input, bn_hooks=False)  # (checked where absorbed)
    report = ConversionReport(method, how)
    paired = {c for c, _ in pairs}
    for name, block in _top_level_blocks(model):
        report.kept[name] = _block_kind(block)
    had_blocks = bool(report.kept)
    subclassed = _followed_by_unfoldable_bn(model)
    for name, m in model.named_modules():
        if _convertible(m) and name not in paired:
            report.skipped[name] = left_out.get(name) or subclassed.get(name) or \
                "not followed by a BatchNorm2d it alone feeds"
        elif isinstance(m, nn.modules.conv._ConvNd) and not _convertible(m) and not _inside_block(name, model):
            report.skipped[name] = f"{type(m).__name__}: only plain nn.Conv2d layers are converted"
    if without_bn:  # every other plain conv too, a block with no BN after it
        pairs = pairs + [(name, None) for name in report.skipped
                         if _convertible(model.get_submodule(name)) and not _inside_block(name, model)
                         and left_out.get(name) != _READ_OUTSIDE]
    slots = _slots(model)
    absorbed_on_trust: dict[str, str] = {}  # (an online block leaves the BN where it is: a pair on trust is safe)
    for conv_name, bn_name in pairs:
        conv = model.get_submodule(conv_name)
        if not _convertible(conv):
            continue  # already a block
        if exclude is not None and exclude(conv_name, conv):
            report.skipped[conv_name] = "excluded by the caller"
            continue
        why = _replace_reason(model, slots, (conv_name,)) if bn_name is None else None  # pairs: _find_pairs checked
        if why is not None:
            report.skipped[conv_name] = why
            continue
        try:
            block = make_block(method, conv, **options)
        except (ValueError, TypeError) as exc:  # TypeError: a setting of another type (numpy channel counts)
            report.skipped[conv_name] = str(exc)
            continue
        if bn_name is None:  # without_bn: orepa's block, which leaves what follows it as it is
            del report.skipped[conv_name]
            if conv_name:
                _set_submodule(model, conv_name, block)
            else:  # the model is the conv itself: its block is the result (as reparameterize gives a block's conv)
                model = block
            report.converted.append(conv_name)
            report.without_bn.append(conv_name)
            continue
        bn = model.get_submodule(bn_name)
        frozen = _fixed_norm(bn, conv)
        if frozen is not None:
            if block.has_norm:
                these = f"{method!r} blocks" if method != "orepa" else "these 'orepa' blocks (BNs in their branches)"
                report.skipped[conv_name] = (f"{frozen}: {these} bring BNs of their own, which would train where the "
                                             "norm is fixed; online 'orepa' blocks keep it after them")
                continue
            # a fixed norm fits only the weights its statistics were taken from: the block starts as its
            # conv (a fresh block's output scale would meet statistics of another, several times off)
            try:
                block.load_conv(conv.weight, conv.bias)
            except ValueError as exc:  # (a branch set without a full-size conv to start from)
                report.skipped[conv_name] = f"{frozen}, so its block must start as the conv, which it cannot: {exc}"
                continue
            report.frozen_norm_why[conv_name] = frozen  # (the norm stays where it is)
        elif block.has_norm:  # the block brings its own BNs: the one after it is absorbed (a norm-act's tail kept)
            hooks = _hooks(bn)
            if hooks:  # (an online block leaves the BN, hooks and all, where it is)
                report.skipped[conv_name] = (f"{bn_name!r} carries {hooks} (a caller's, or torch.nn.utils.weight_norm "
                                             f"/ spectral_norm's), which the {method!r} block absorbing it would "
                                             "drop; online 'orepa' blocks keep it after them")
                continue
            absorbed = AbsorbedNorm(bn, norm_act=_norm_then_act(bn))
            block.absorbed_token = absorbed.token
            _normalise_as(block, bn)
            if conv_name in trusted:
                absorbed_on_trust[conv_name] = trusted[conv_name]
                absorbed.paired_on_trust = trusted[conv_name]  # (said again where reparameterize restores it)
            _set_submodule(model, bn_name, absorbed)
        _set_submodule(model, conv_name, block)
        report.converted.append(conv_name)
    if not report.converted and not had_blocks:
        by_reason: dict[str, list[str]] = {}  # one clause a reason: a deep network's list stays readable
        for name, reason in report.skipped.items():
            by_reason.setdefault(reason, []).append(name or type(model).__name__)
        why = "; ".join(f"{', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}: {reason}"
                        for reason, names in by_reason.items())
        # the hint only where it would convert something: a ViT's 16x16 patch conv is no block either way
        unpaired = any(r.startswith("not followed by a BatchNorm2d") and _block_could_take(model.get_submodule(n))
                       for n, r in report.skipped.items() if n)
        hint = " (without_bn=True converts the convs that no BatchNorm2d follows too)" \
            if unpaired and method == "orepa" else ""
        raise ValueError(f"convert(method={method!r}) found nothing to convert in {type(model).__name__}: "
                         + (why or "it has no nn.Conv2d followed by a BatchNorm2d") + hint)
    _warn_trusted(f"convert(method={method!r})", absorbed_on_trust)
    made = "offline OREPA" if method == "orepa" and options.get("mode") == "offline" else _METHOD_KIND[method]
    other = sorted({kind for kind in report.kept.values() if kind != made})
    if other:
        # a second convert does not change blocks: a kernel does not split back into branches
        warnings.warn(f"convert(method={method!r}) kept the {', '.join(other)} blocks the model already had "
                      f"({sum(k in other for k in report.kept.values())} of them, e.g. "
                      f"{next(n for n, k in report.kept.items() if k in other) or type(model).__name__!r}); to change "
                      "their method, convert the plain network, or the one reparameterize(model) deploys",
                      stacklevel=2)
    group_kernels(model)  # online blocks of one signature build their kernels together on GPUs
    return (model, report) if return_report else model


#: the kind of block each method makes (:func:`_block_kind`)
_METHOD_KIND = {"orepa": "online OREPA", "orepa-offline": "offline OREPA", "dbb": "DBB", "repvgg": "RepVGG",
                "orepa-vgg": "OREPA-VGG"}


def _block_kind(block: ReparamConv2d) -> str:
    """Which method's kind of block ``block`` is (:data:`_METHOD_KIND`'s words), or its class's name."""
    if isinstance(block, (OREPAConv2d, OREPADeepStem)):
        return f"{block.mode} OREPA"
    for cls, kind in ((DBBConv2d, "DBB"), (RepVGGBlock, "RepVGG"), (OREPAVGGBlock, "OREPA-VGG")):
        if isinstance(block, cls):
            return kind
    return type(block).__name__


def load_plain_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor], keep: Iterable[str] = ()) -> None:
    """Start a training-form model (``convert``'s or the zoo's) as the plain network whose
    ``state_dict`` is given, in the layout :func:`reparameterize` gives back (e.g. torchvision's
    or timm's pretrained weights for the network ``convert`` was given).

    Every block starts as its plain conv (:meth:`ReparamConv2d.load_conv`: the main branch takes
    the conv, and the BN the block replaced where it holds its own; every other branch starts at
    zero); every other module takes its tensors by name. The model then computes the plain
    network's function, in training mode too, and learns from there. ``keep``: model keys left as
    they are (a new classifier). Raises ValueError naming what does not fit (missing or unexpected
    keys, shapes, a block that cannot start as a conv such as a linear deep stem); the model may
    then be partly loaded.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_plain_state_dict takes a state_dict (a mapping of names to tensors), got "
                        f"{type(state_dict).__name__}")
    not_tensors = [k for k, v in state_dict.items() if not isinstance(v, Tensor)]
    if not_tensors:
        raise TypeError(f"the plain state_dict holds values that are not tensors: {', '.join(map(str, not_tensors[:4]))}")
    blocks = _top_level_blocks(model)
    absorbed, _ = _absorbed_pairing(model, blocks)
    keep = set(keep)
    sd = {k: v for k, v in state_dict.items() if k not in keep}
    taken, problems, loads = set(), [], []
    for name, block in blocks:
        key = f"{name}.weight"
        if key not in sd:
            problems.append(f"no {key} for block {name}")
            continue
        bias = sd.get(f"{name}.bias")
        taken.update(k for k in (key, f"{name}.bias") if k in sd)
        norm = None
        if block.has_norm:
            norm_name = absorbed.get(block.absorbed_token)
            if norm_name is None:
                problems.append(f"block {name} holds its own BNs but the BN it replaced is not found")
                continue
            prefix = norm_name + "."
            norm = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
            taken.update(prefix + k for k in norm)
        loads.append((name, block, sd[key], bias, norm))
    inside = tuple(f"{name}." for name, _ in blocks)
    own = {k for k in model.state_dict() if not k.startswith(inside)} - keep
    rest = {k: v for k, v in sd.items() if k not in taken}
    # a BN's batch count is optional, as in torch's own load of a state_dict without version metadata
    missing = sorted(k for k in own - set(rest) if not k.endswith(".num_batches_tracked"))
    unexpected = sorted(set(rest) - own)
    if missing:
        problems.append(f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
    for name, block, weight, bias, norm in loads:
        try:
            block.load_conv(weight, bias, norm)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
    if problems:
        # the wrappers' prefixes every key carries, nested ones whole ("module._orig_mod.")
        prefixed = wrapper_prefix(os.path.commonprefix([wrapper_prefix(k) for k in sd]))
        hint = (f" (every key starts with {prefixed!r}, a wrapper's: DataParallel / DDP, torch.compile; "
                "orepa.state_dicts.strip_prefixes(state_dict) removes it)") if prefixed else ""
        raise ValueError("the plain state_dict does not fit this model: " + "; ".join(problems) + hint)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # the modules' versions, which some loaders read (torchvision's MNASNet)
        rest = OrderedDict(rest)
        rest._metadata = metadata
    try:
        model.load_state_dict(rest, strict=False)  # the blocks' keys were given above, by load_conv
    except (RuntimeError, ValueError) as exc:  # shapes; a module's own loader refusing what it reads
        raise ValueError(f"the plain state_dict does not fit this model: {exc}") from None


def _inside_block(name: str, model: nn.Module) -> bool:
    """Whether module ``name`` lives inside a re-param block (its steps are not the model's convs)."""
    parts = name.split(".")
    return any(isinstance(model.get_submodule(".".join(parts[:i])), ReparamConv2d) for i in range(1, len(parts)))


def _top_level_blocks(model: nn.Module) -> list[tuple[str, ReparamConv2d]]:
    found, inside = [], []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, ReparamConv2d):
            found.append((name, m))
            inside.append(name)
    return found


def _absorbed_pairing(model: nn.Module, blocks: list[tuple[str, ReparamConv2d]]) -> tuple[dict[str, str], list[str]]:
    """``({token: placeholder name}, [names of placeholders no block holds the token of])``.

    Raises a ValueError when one token is held by several blocks or several placeholders
    (copies made apart from each other, e.g. ``copy.copy`` or a hand-set token) and a block
    holds it: which placeholder belongs to which block is then unknown.
    """
    norms: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, AbsorbedNorm):
            norms.setdefault(m.token, []).append(name)
    owners: dict[str, list[str]] = {}
    for name, block in blocks:
        if block.absorbed_token is not None:
            owners.setdefault(block.absorbed_token, []).append(name)
    for token, held_by in owners.items():
        found = norms.get(token, [])
        if found and (len(found) > 1 or len(held_by) > 1):
            raise ValueError(
                f"ambiguous BatchNorm pairing: blocks {held_by} and AbsorbedNorm placeholders {found} share the "
                f"token {token!r}, so which placeholder belongs to which block is unknown (copies made apart: "
                "copy a converted layer with copy.deepcopy of the block and its placeholder together)")
    paired = {token: norms[token][0] for token in owners if token in norms}
    return paired, [name for token, names in norms.items() if token not in paired for name in names]


@torch.no_grad()
def fuse_conv_bn(model: nn.Module, *, inplace: bool = False, example_input=None) -> nn.Module:
    """Fold every Conv2d -> BatchNorm2d pair (eval statistics) into the conv; the BN becomes Identity
    (a timm BatchNormAct2d its dropout and activation). The folded weight trains where the conv's weight
    or the BN's scale did, its bias where the conv's bias or the BN's affine did (a frozen stage stays
    frozen)."""
    if not inplace:
        model = _deepcopy(model, _callers_hooks(model))
    pairs, _, left_out, trusted = _find_pairs(model, example_input)
    # (stacklevel: past torch.no_grad's wrapper to the caller)
    _warn_left_out(left_out, stacklevel=4)
    _warn_trusted("fuse_conv_bn", {c: m for c, m in trusted.items() if _convertible(model.get_submodule(c))}, 4)
    for conv_name, bn_name in pairs:
        conv, bn = model.get_submodule(conv_name), model.get_submodule(bn_name)
        if not _convertible(conv):
            continue
        w, b = K.fold_bn(conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
        mode = {"padding_mode": conv.padding_mode} if type(conv) is nn.Conv2d else {}  # timm's Conv2dSame: none
        with torch.device(w.device):  # made where it goes (timm's Conv2dSame takes no device=)
            fused = type(conv)(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                               conv.dilation, conv.groups, bias=True, **mode).to(dtype=w.dtype)
        fused.weight.copy_(w)
        fused.bias.copy_(b)
        # frozen where what it folds was (a frozen stage, a frozen BN's shift): a new conv would train
        trains = {k: isinstance(t, nn.Parameter) and t.requires_grad for k, t in
                  (("w", conv.weight), ("b", conv.bias), ("g", getattr(bn, "weight", None)),
                   ("beta", getattr(bn, "bias", None)))}
        fused.weight.requires_grad_(trains["w"] or trains["g"])
        fused.bias.requires_grad_(trains["b"] or trains["g"] or trains["beta"])
        _set_submodule(model, conv_name, keep_layout(fused, (conv.weight,)).train(conv.training))
        _set_submodule(model, bn_name, _tail(bn))
    return model


def _check_module(model, caller: str) -> None:
    """A TypeError for what ``caller`` cannot take: no nn.Module, or a TorchScript one (compiled code,
    whose blocks it cannot replace: it is made from the deployed model, not the reverse)."""
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(f"{caller} takes the nn.Module, not a TorchScript module (torch.jit.trace / script): "
                        "reparameterize the model first, then trace or script the deployed one")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller} takes an nn.Module, got {type(model).__name__}")


def _deployed_conv(block: ReparamConv2d, output_hooks: bool = True) -> nn.Conv2d:
    """``block`` as its plain conv, in the block's mode, and frozen where the block is (a frozen
    stage deploys frozen), with the hooks around the block's call (:func:`_carry_call_hooks`; without
    ``output_hooks``, its forward hooks stay behind)."""
    conv = block.fuse()  # (timm's protocol: also takes the engine's hooks off the root)
    if _frozen_block(block):
        conv.requires_grad_(False)
    _carry_call_hooks(block, conv, _INPUT_HOOK_DICTS + (_OUTPUT_HOOK_DICTS if output_hooks else ()))
    return conv


#: the hooks around a module's call and their flags, which a module computing the same function takes over:
#: those that see its input (and the gradients, which a constant shift of the output leaves as they are; on
#: a block that absorbed its BN, the gradient of its output is taken before the forward hooks, moved to the
#: BN after the conv, which is the training form's where those hooks do not replace the output) ...
_BACKWARD_HOOK_DICTS = ("_backward_pre_hooks", "_backward_hooks")  # (the gradients' alone)
_INPUT_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", *_BACKWARD_HOOK_DICTS)
#: ... and those that see (and may replace) its output
_OUTPUT_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _carry_call_hooks(old: nn.Module, new: nn.Module, dicts=_INPUT_HOOK_DICTS + _OUTPUT_HOOK_DICTS) -> nn.Module:
    """``new`` (the plain conv or BN deployment puts in place of the block or placeholder ``old``) with
    ``old``'s hooks of ``dicts``, after those it has: a caller's hook that records, masks or changes the
    block's output (activation statistics, features) sees the same values there, as
    ``torch.ao.quantization.fuse_modules`` carries a fused module's hooks. The state_dict hooks, of the
    block's layout, stay behind (:func:`_dropped_hooks`)."""
    for attr in dicts:
        theirs = getattr(old, attr, None)
        if theirs:
            getattr(new, attr).update(theirs)
    if "_backward_hooks" in dicts and getattr(old, "_backward_hooks", None):
        new._is_full_backward_hook = old._is_full_backward_hook
    return new


def _callers_hooks(model: nn.Module) -> dict[int, object]:
    """A ``copy.deepcopy`` memo that keeps the hooks around ``model``'s modules' calls themselves: the
    copy's hooks are the caller's, so a recorder's bound method records into the caller's object, not
    into a copy of it. Hooks that belong to the model go with the copy: the engine's (the model's own
    workspace) and a method of one of the model's modules or of an object a module holds (a model that
    records its own features, timm's ``FeatureHooks``)."""
    own = {id(v) for m in model.modules() for v in (m, *_attribute_values(m))}
    return {id(h): h for m in model.modules()
            for attr in (*_CALL_HOOKS, *_BACKWARD_HOOK_DICTS)
            for h in (getattr(m, attr, None) or {}).values()
            if not isinstance(h, E._ScopeHook) and id(getattr(h, "__self__", None)) not in own}


def _restored_with_hooks(block: ReparamConv2d, placeholder: AbsorbedNorm, restored: nn.Module) -> nn.Module:
    """The BN restored in ``placeholder``'s place after the conv of ``block``, which absorbed it, with the
    hooks that see the block's output: the conv computes that output less the shift this BN adds back.
    In eval mode the placeholder is the identity on the block's output (then a norm-act's drop and act),
    and the BN's output (a norm-act's, its drop's input) is that output. So the block's forward hooks
    and then the placeholder's forward pre-hooks run there, in that order (on a norm-act, as forward
    pre-hooks of its drop, which the placeholder held), then the placeholder's forward and backward
    hooks on the whole. A hook placed on the BN gets the BN (and, as a forward hook, the BN's input) as
    its module and arguments; the values it sees and returns are the training form's."""
    norm_act = placeholder.__dict__.get("_norm_act_template") is not None
    outputs = [(h, block._forward_hooks_with_kwargs.get(i, False)) for i, h in block._forward_hooks.items()]
    inputs = [(h, placeholder._forward_pre_hooks_with_kwargs.get(i, False))
              for i, h in placeholder._forward_pre_hooks.items()]
    if norm_act:  # (each prepended before the drop's own pre-hooks: the placeholder's, then before them the block's)
        for h, kw in reversed(inputs):  # (the drop's input is the placeholder's)
            restored.drop.register_forward_pre_hook(h, prepend=True, with_kwargs=kw)
        for hook in reversed([_output_hook_as_input_hook(h, kw) for h, kw in outputs]):
            restored.drop.register_forward_pre_hook(hook, prepend=True)
    else:
        _carry_call_hooks(block, restored, _OUTPUT_HOOK_DICTS)
        for h, kw in inputs:
            restored.register_forward_hook(_input_hook_as_output_hook(h, kw))
    return _carry_call_hooks(placeholder, restored, _OUTPUT_HOOK_DICTS + _BACKWARD_HOOK_DICTS)


def _input_hook_as_output_hook(hook, with_kwargs: bool):
    """A forward pre-hook of an identity (the placeholder) as a forward hook of the module computing its
    input: the output is what the identity's input was, and what the hook returns replaces it."""
    def on_output(module, args, output):
        got = hook(module, (output,), {}) if with_kwargs else hook(module, (output,))
        if got is None:
            return None
        got = got[0] if with_kwargs else got  # (args, kwargs) / args, or one value
        return got[0] if isinstance(got, tuple) else got
    return on_output


def _output_hook_as_input_hook(hook, with_kwargs: bool):
    """A forward hook of the block as a forward pre-hook of the module its output enters first."""
    def on_input(module, args):
        got = hook(module, args, {}, args[0]) if with_kwargs else hook(module, args, args[0])
        return None if got is None else (got,)
    return on_input


def _dropped_hooks(name: str, old: nn.Module) -> list[str]:
    """What deploying ``old`` (a block or placeholder at ``name``) drops of a caller's hooks: its state_dict
    hooks, and every hook of the modules inside a block, which the plain conv has no counterpart of (a
    norm-act placeholder's drop and act go into the restored module as they are)."""
    found = []
    for sub_name, sub in (old.named_modules() if isinstance(old, ReparamConv2d) else [("", old)]):
        kinds = _hooks(sub) if sub_name else ", ".join(
            what for attr, what in _HOOKS if attr.startswith(("_state_dict", "_load_state_dict"))
            and any(h is not _materialise_fixed_kernels for h in (getattr(sub, attr, None) or {}).values()))
        if kinds:
            found.append(f"{'.'.join(p for p in (name, sub_name) if p) or type(old).__name__} ({kinds})")
    return found


def _frozen_block(block: ReparamConv2d) -> bool:
    """No parameter of ``block`` but its BNs' trains (a frozen stage, frozen when or after the model was
    built; its BNs may train, as the absorbed BN did: that one is restored trainable, the conv frozen)."""
    norms = {id(p) for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()}
    return not any(p.requires_grad for p in block.parameters() if id(p) not in norms)


def _frozen_norms(block: ReparamConv2d) -> bool:
    """``block`` holds BNs and none of their parameters trains: the BN it absorbed is deployed frozen."""
    params = [p for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()]
    return bool(params) and not any(p.requires_grad for p in params)


@torch.no_grad()
def reparameterize(model: nn.Module, fuse_bn: bool = False, *, inplace: bool = False, example_input=None) -> nn.Module:
    """Turn every re-param block into a plain ``nn.Conv2d`` (eval-mode equivalent).

    With ``fuse_bn=False`` the result has the same module names, types and
    state_dict keys as the model before :func:`convert`: blocks that held their
    own BNs give their bias to the restored BatchNorm2d. With ``fuse_bn=True``
    every conv-BN pair is folded as well (fastest inference form).
    A bare block passed directly is returned as its ``nn.Conv2d``, a bare placeholder as its BatchNorm2d.
    The forward and backward hooks registered on a block (or on an absorbed BN's placeholder) go to the
    module that replaces it, the caller's hook objects themselves (a block that absorbed the BN after it:
    the hooks that see its output, its forward hooks and the placeholder's pre-hooks, to the restored BN,
    whose eval output that is; :func:`_restored_with_hooks`); the hooks of modules inside a block, which
    have no counterpart, are dropped with a warning naming them. A branch step that is pruned or
    parametrized is refused (TypeError).
    """
    _check_module(model, "reparameterize")
    if isinstance(model, ReparamConv2d):
        return _deployed_conv(model)
    if isinstance(model, AbsorbedNorm):  # a bare placeholder: its BN (no child of itself can stand for it)
        return _carry_call_hooks(model, model.restore(None))
    # a pruned or normed branch step is refused before anything is copied or replaced: the copy would
    # fail on the step's computed weight (torch's deepcopy of a non-leaf tensor), and in place the
    # blocks before it would already be plain convs
    odd = [f"{name}.{step}" for name, block in _top_level_blocks(model) for step in reparametrized_steps(block)]
    if odd:
        raise TypeError(reparametrized_steps_message(odd))
    if not inplace:
        model = _deepcopy(model, _callers_hooks(model))
    blocks = _top_level_blocks(model)
    absorbed, orphans = _absorbed_pairing(model, blocks)
    dropped = [h for name, block in blocks for h in _dropped_hooks(name, block)]
    dropped += [h for name, m in model.named_modules() if isinstance(m, AbsorbedNorm) for h in _dropped_hooks(name, m)]
    if dropped:
        warnings.warn("reparameterize: hooks with no counterpart in the deployed model are dropped: "
                      f"{'; '.join(dropped)} (the forward and backward hooks of a block or of an absorbed BN's "
                      "placeholder go to the plain conv or BN that replaces it)", stacklevel=3)
    on_trust = {name: getattr(model.get_submodule(absorbed[block.absorbed_token]), "paired_on_trust", None)
                for name, block in blocks if block.absorbed_token in absorbed}
    _warn_trusted("reparameterize", {c: m for c, m in on_trust.items() if m is not None}, 4, advice=(
        "the deployed model computes the trained one only if that forward calls them whole; convert with "
        "example_input pairs by running the model"))  # (stacklevel: past torch.no_grad's wrapper to the caller)
    for name, block in blocks:
        norm_name = absorbed.get(block.absorbed_token)
        # a block that absorbed the BN after it: the conv computes its output less the shift the restored BN
        # adds back, so the hooks on its output go to that BN, whose (eval) output is the block's
        conv = _deployed_conv(block, output_hooks=norm_name is None)
        if norm_name is not None:
            # the conv keeps the original conv's bias (if any); the rest moves into the restored BN
            shift = None
            if conv.bias is not None:
                shift = conv.bias if block.bias is None else conv.bias - block.bias
            placeholder = model.get_submodule(norm_name)
            restored = _restored_with_hooks(block, placeholder, placeholder.restore(shift))
            if _frozen_norms(block):  # frozen after conversion (a detector's frozen stages or norms): it stays so
                restored.requires_grad_(False)
            _set_submodule(model, norm_name, restored)  # in its placeholder's mode: a frozen BN stays in eval
            if block.bias is None:
                conv.bias = None
            else:
                conv.bias.copy_(block.bias)
        _set_submodule(model, name, conv)
    for name in orphans:  # placeholders whose block was not found: plain BN, identity-like
        placeholder = model.get_submodule(name)
        _set_submodule(model, name, _carry_call_hooks(placeholder, placeholder.restore(None)))
    E.strip_scopes(model)  # every block under it deployed: no grouped root's hook serves (nor scripts)
    if fuse_bn:
        model = fuse_conv_bn(model, inplace=True, example_input=example_input)
    return model
