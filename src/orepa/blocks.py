"""Re-param blocks declared once as branches of linear steps.

A block (:class:`ReparamConv2d`) is a drop-in replacement for one ``nn.Conv2d``:
a dict of :class:`Branch` es, each a sequence of *steps*:

* kernel steps (:class:`ConvStep`, :class:`FixedKernelStep`, or a nested block)
  that are convolutions, and
* channel-affine steps (:class:`Scale`, ``nn.BatchNorm2d``).

The SAME declaration runs in one of two modes, fixed at construction:

* ``online``: every forward squeezes all branches into one kernel with
  :mod:`orepa.kernels` and runs a single convolution (OREPA); in training :mod:`orepa.engine`
  executes it (closed-form backward, routes, blocks of one signature built together). Branches may
  hold scales but no BN; the block is meant to be followed by a BatchNorm2d,
  the post-addition norm (without it the paper's training diverges).
* ``offline``: every branch runs on the feature map and the outputs are summed
  (DBB, RepVGG, the prototype block with a BN after every conv). Without BNs
  it equals the online block to float tolerance: the test of the squeeze.

Offline branches pad their *input* once, by their own receptive field, and
run every step unpadded; only the last kernel step is strided (a purely
pointwise branch without BN subsamples its input first instead: the same
function on fewer pixels). That is the
exact feature-map counterpart of the squeezed kernel (an intermediate BN bias
reaches the border as it does through the squeezed kernel). A branch with a BN
before its spatial step pads after the pointwise steps up to it instead, with
their response to a zero input on running statistics (DBB's "BN-and-pad": in
training the BN's batch statistics leave the border out; in eval the same
function). (A stem built from 3x3 convs
that pad every layer differs from this at the border; see
:class:`OREPADeepStem`.)

:meth:`ReparamConv2d.equivalent` returns the eval-mode ``(weight, bias)`` of any
block; it is the single mechanism behind squeezing, BN folding and deployment.
"""
from __future__ import annotations

import copy
import math
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import engine as E
from . import kernels as K

# BNs a branch or a conv may be folded with: SyncBatchNorm is what --sync-bn (convert_sync_batchnorm) leaves
BATCH_NORMS = (nn.BatchNorm2d, nn.SyncBatchNorm)

__all__ = [
    "ConvStep",
    "FixedKernelStep",
    "Scale",
    "Branch",
    "ReparamConv2d",
    "OREPAConv2d",
    "OREPADeepStem",
    "DBBConv2d",
    "RepVGGBlock",
    "OREPAVGGBlock",
    "AbsorbedNorm",
    "Conv2dTFSame",
    "pad_tf_same",
    "OREPA_BRANCHES",
    "DEFAULT_SCALE_INIT",
    "INIT_SCHEMES",
    "BRANCH_TYPES",
    "BranchType",
    "StepConfig",
    "register_branch",
    "check_conv_config",
]

#: branch name -> its scale's initial value (:data:`BRANCH_TYPES`' ``scale_init``; a live view)
DEFAULT_SCALE_INIT: Mapping[str, float]  # defined with the branch registry below
#: the six branches of the OREPA kxk block (Fig. "blocks")
OREPA_BRANCHES: tuple[str, ...] = ("kxk", "1x1", "1x1_avg", "1x1_prior", "1x1_kxk", "dw_pw")
#: the Rep-1x1 block for 1x1 convs of bottlenecks
REP_1X1_BRANCHES: tuple[str, ...] = ("1x1", "1x1_1x1")
SCALINGS = ("vector", "scalar", "none")
#: nn.Conv2d's default ``kaiming_uniform_`` slope: the weights of every offline baseline (DBB, RepVGG)
TORCH_INIT_A = math.sqrt(5)
#: initialisation schemes of the online blocks (``OREPAConv2d(init=...)``):
#: ``"reference"`` - as the published models were trained (the paper's public code): random branch
#: weights ``kaiming_uniform_(a=0)`` in kxk blocks, ``a=1`` in Rep-1x1 and OREPA-VGG blocks; Rep-1x1's
#: identity on its square factor; a widening first factor of 1x1->kxk a repeated identity.
#: ``"torch"`` - nn.Conv2d's default ``a=sqrt(5)`` everywhere, Rep-1x1's identity on its first factor
#: (spread when it narrows). A number ``a`` is the reference scheme with that slope.
INIT_SCHEMES = ("reference", "torch")
#: nn.Conv2d's padding modes; every block takes each (a conv is linear in its kernel whatever fills the border)
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
# Largest N*H*W for which a 1x1 step on the feature map runs as one matrix product.
_GEMM_1X1_MAX_PIXELS = 2048


def check_conv_config(
    in_channels: int,
    out_channels: int,
    kernel_size,
    stride=1,
    padding=None,
    dilation=1,
    groups: int = 1,
    padding_mode: str = "zeros",
    *,
    any_padding: bool = False,
    same_padding_because: str = "online OREPA blocks take any padding",
) -> tuple[tuple[int, int], int, tuple[int, int], int]:
    """Validate a conv configuration a re-param block can squeeze exactly.

    Returns ``((kh, kw), stride, (ph, pw), dilation)``. Supported: odd kernel
    sizes (square or not: 3x3, 1x7, 3x1), equal strides and dilations on both
    axes, ``groups`` dividing both channel counts and "same" padding
    ``(kh // 2 * dilation, kw // 2 * dilation)`` (``None`` picks it, and ``"same"`` at stride 1:
    as in nn.Conv2d, a strided ``"same"`` is refused).
    ``any_padding``: any non-negative padding (``"valid"``: 0), for online
    blocks: they convolve with their squeezed kernel only, so their branches
    need no common centre on the feature map. Every ``padding_mode`` of nn.Conv2d is
    taken (see :meth:`Branch.run` for the branches on the feature map). Anything else
    raises a ValueError naming the problem.
    """
    for n, v in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{n} must be an int, got {v!r} ({type(v).__name__})")
        if v < 1:
            raise ValueError(f"{n} must be a positive int, got {v!r}")
    for n, v in (("kernel_size", kernel_size), ("stride", stride), ("padding", padding), ("dilation", dilation)):
        if isinstance(v, bool) or (isinstance(v, Sequence) and not isinstance(v, str)
                                   and any(isinstance(i, bool) for i in v)):
            raise TypeError(f"{n} must be an int or a pair of ints, not a bool; got {v!r}")
    kh, kw = K.as_pair(kernel_size, "kernel_size")
    if kh < 1 or kw < 1:
        raise ValueError(f"kernel_size must be a positive odd int (or a pair of them), got {kernel_size!r}")
    if kh % 2 == 0 or kw % 2 == 0:
        raise ValueError(f"unsupported kernel_size {kh}x{kw}: even kernels have no centre to align branches on")
    sh, sw = K.as_pair(stride, "stride")
    if sh != sw or sh < 1:
        raise ValueError(f"unsupported stride {stride!r}: need one positive stride for both axes")
    dh, dw = K.as_pair(dilation, "dilation")
    if dh != dw or dh < 1:
        raise ValueError(f"unsupported dilation {dilation!r}: need one positive dilation for both axes")
    same = (kh // 2 * dh, kw // 2 * dh)
    if padding == "valid":  # nn.Conv2d's name for no padding
        padding = (0, 0)
    if padding == "same" and sh > 1:  # as nn.Conv2d: a strided output cannot keep the input's size
        raise ValueError(f"padding='same' is not supported with stride {sh} (nn.Conv2d refuses it too); give "
                         f"padding={same[0] if same[0] == same[1] else same} (centred, torchvision's choice) or None")
    if padding is None or padding == "same":
        pad = same
    else:
        pad = K.as_pair(padding, "padding")
        if any_padding and min(pad) < 0:
            raise ValueError(f"unsupported padding {padding!r}: need a non-negative padding")
        if not any_padding and pad != same:
            raise ValueError(
                f"unsupported padding {padding!r} for kernel_size={kh}x{kw}, dilation={dh}: "
                f"only 'same' padding {same[0] if same[0] == same[1] else same} keeps branch centres aligned "
                f"({same_padding_because})"
            )
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"unknown padding_mode {padding_mode!r}; nn.Conv2d's are {', '.join(PADDING_MODES)}")
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}")
    return (kh, kw), sh, pad, dh


def pad_tf_same(x: Tensor, kernel_size: tuple[int, int], stride: tuple[int, int],
                dilation: tuple[int, int]) -> Tensor:
    """Zero-pad ``x`` as TensorFlow's "SAME" convolutions (and timm's ``Conv2dSame``) do: per axis
    as much as makes the output ``ceil(input / stride)``, the odd pixel at the end, from each input's
    own size."""
    pads = []
    for size, k, s, d in zip(x.shape[-2:], kernel_size, stride, dilation):
        total = _tf_same_excess(size, k, s, d)  # traced sizes are tensors
        total = total.clamp(min=0) if isinstance(total, Tensor) else max(total, 0)
        pads.append((total // 2, total - total // 2))
    (top, bottom), (left, right) = pads
    traced = isinstance(top, Tensor)  # (no branch on a traced size: it would be frozen into the trace)
    return F.pad(x, (left, right, top, bottom)) if traced or top or bottom or left or right else x


def _tf_same_excess(size: int, k: int, s: int, d: int) -> int:
    """The padding along one axis that makes the output ``ceil(size / s)`` (negative: none needed);
    TorchScript compiles it for ints, a trace runs it on tensor sizes. The ceil is a floor division
    of non-negative numbers: traced into ONNX (whose integer Div truncates) the ceil as ``-(-size // s)``
    padded nothing where it should."""
    return ((size + s - 1) // s - 1) * s + (k - 1) * d + 1 - size


def _no_padding(padding) -> bool:
    """Whether ``padding`` asks for none (None, 0, a pair of zeros in any sequence, or 'valid')."""
    if padding is None or padding == "valid":
        return True
    try:
        return K.as_pair(padding, "padding") == (0, 0)
    except ValueError:
        return False


def _check_mode(mode: str, tf_same: bool, padding, padding_mode: str = "zeros") -> None:
    if mode not in ("online", "offline"):
        raise ValueError(f"mode must be 'online' or 'offline', got {mode!r}")
    if tf_same and (mode != "online" or not _no_padding(padding) or padding_mode != "zeros"):
        raise ValueError("tf_same=True (TensorFlow's 'same' padding, uneven where the stride needs it) is for "
                         f"online blocks that pad nothing else; got mode={mode!r}, padding={padding!r}, "
                         f"padding_mode={padding_mode!r}")


def _channels_last(t: Tensor) -> bool:
    """Whether ``t`` is a 4-D tensor laid out channels_last (and not also contiguous, as a 1x1 kernel is both)."""
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def keep_layout(conv: nn.Conv2d, like: Iterable[Tensor]) -> nn.Conv2d:
    """``conv`` with its weight channels_last where a 4-D tensor of ``like`` is (a model moved with
    ``.to(memory_format=torch.channels_last)`` deploys to convs laid out as its own were)."""
    if any(_channels_last(t) for t in like):
        conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
    return conv


class Conv2dTFSame(nn.Conv2d):
    """An ``nn.Conv2d`` with TensorFlow's "SAME" padding (:func:`pad_tf_same`): what a block made
    with ``tf_same=True`` deploys to (``orepa.convert`` deploys such blocks to the class they
    replaced, timm's ``Conv2dSame``, which computes the same)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not _no_padding(self.padding):
            raise ValueError(f"Conv2dTFSame pads by itself; padding must be 0 or 'valid', got {self.padding!r}")
        self.padding = (0, 0)  # 'valid' included: what a deployed conv's layout holds

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():  # (TorchScript compiles this branch only: pad_tf_same takes traced sizes)
            x = _pad_tf_same_scripted(x, self.kernel_size, self.stride, self.dilation)
        else:
            x = pad_tf_same(x, self.kernel_size, self.stride, self.dilation)
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def _pad_tf_same_scripted(x: Tensor, kernel_size: list[int], stride: list[int], dilation: list[int]) -> Tensor:
    """:func:`pad_tf_same` in TorchScript's terms (integer sizes)."""
    pads: list[int] = []
    for axis in (1, 0):  # F.pad's order: the last axis first
        total = max(_tf_same_excess(x.shape[-2 + axis], kernel_size[axis], stride[axis], dilation[axis]), 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


# --------------------------------------------------------------------------- steps


class PackableWeight:
    """A learnable step whose ``weight`` a kernel group may pack (:meth:`orepa.engine.KernelGroup.pack`):
    it is then its rows of the group's parameter, a view read at every access, and the step still
    saves and loads it under its own state_dict key (checkpoints do not depend on packing)."""

    def __getattr__(self, name: str):
        if name == "weight" and "weight" not in self.__dict__.get("_parameters", ()):
            slot = self.__dict__.get("_packed")
            if slot is not None:
                return slot[name]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        slot = self.__dict__.get("_packed") if name == "weight" else None
        if slot is None:
            super().__setattr__(name, value)
            return
        # a packed step given a tensor for its weight: ``torch.func.functional_call`` with the
        # state_dict's names swaps it in for the call and gives back what it read (its rows) after.
        # The step reads that tensor until then (the engine too: orepa.engine.PackedSlot); set as a
        # plain attribute it was ignored by the kernel build, and kept after the call a stale view
        # (old device or dtype after .to(), a model deepcopy refused)
        slot.override(value)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        slot = self.__dict__.get("_packed")
        if slot is not None and "weight" not in self._parameters:
            # a tensor set in place of the rows is what the step computes with: saved, so that the
            # checkpoint describes the model (load_state_dict then puts it into the rows)
            w = slot.view() if slot.overridden is None else slot.overridden
            destination[prefix + "weight"] = w if keep_vars else w.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        slot = self.__dict__.get("_packed")
        if slot is None or "weight" in self._parameters:
            return
        key = prefix + "weight"
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value, w = state_dict[key], slot.view()
        if w.is_meta:  # load_state_dict(assign=True) after a meta-device build: nothing to copy into
            error_msgs.append(f"{key}: a packed weight on the meta device cannot take a value (its rows belong to "
                              "its group's parameter); pack after loading, or unpack (orepa.engine.group_kernels "
                              "without pack) first")
            return
        if not isinstance(value, Tensor) or value.shape != w.shape:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                              f"{getattr(value, 'shape', type(value).__name__)} from checkpoint, the shape in "
                              f"current model is {w.shape}.")
            return
        with torch.no_grad():
            w.copy_(value)
        slot.override(None)  # the rows hold the loaded value: read again


class ConvStep(PackableWeight, nn.Module):
    """A learnable convolution inside a branch (no bias, no padding of its own).

    ``init``: ``"kaiming"`` (``kaiming_uniform_`` with negative slope ``a``; nn.Conv2d's
    default is ``a = sqrt(5)``), ``"identity"`` (a "spread" identity when the step widens,
    see :func:`orepa.kernels.identity_init_1x1`) or ``"identity-tiled"`` (the identity
    repeated, as the paper's public code lays it out, :func:`orepa.kernels.tiled_identity_1x1`).
    ``decays_to_init``: weight decay should pull the weight towards its identity start, not towards
    zero (the published 1x1 -> kxk blocks train a delta on a fixed identity, and decay the delta);
    :meth:`init_weight` is that start. Training applies it (``orepa.apps.common.decay_to_init``).
    """

    INITS = ("kaiming", "identity", "identity-tiled")

    def __init__(self, in_channels: int, out_channels: int, kernel_size, groups: int = 1, init: str = "kaiming",
                 a: float = TORCH_INIT_A, decays_to_init: bool = False):
        super().__init__()
        if init not in self.INITS:
            raise ValueError(f"unknown init {init!r} for a conv step; expected one of {self.INITS}")
        if decays_to_init and init == "kaiming":
            raise ValueError("decays_to_init needs an identity init (a random start is no point to decay towards)")
        self.decays_to_init = decays_to_init
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = K.as_pair(kernel_size, "kernel_size")  # (kh, kw), as nn.Conv2d's
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        self.init, self.a = init, float(a)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.init == "kaiming":
            nn.init.kaiming_uniform_(self.weight, a=self.a)
            return
        with torch.no_grad():
            self.weight.copy_(self.init_weight())

    def init_weight(self) -> Tensor:
        """The identity the weight starts as (an identity init), in the weight's dtype and device."""
        identity = K.identity_init_1x1 if self.init == "identity" else K.tiled_identity_1x1
        w = self.weight
        return K.pad_to(identity(self.out_channels, self.in_channels, self.groups), self.kernel_size).to(w)

    def kernel(self) -> Tensor:
        _check_weight_slot(self)
        return self.weight

    def run(self, x: Tensor, stride: int, dilation: int, padding=0) -> Tensor:
        _check_weight_slot(self)
        if self.kernel_size == (1, 1) and self.groups == 1 and padding in (0, (0, 0)):
            xs = x[:, :, ::stride, ::stride] if stride > 1 else x
            n, c, h, w = xs.shape
            if n * h * w <= _GEMM_1X1_MAX_PIXELS:
                # a 1x1 conv over few pixels (a branch on a small feature map) is one matrix
                # product; CPU conv kernels are slower there (1 thread: the non-mkldnn path)
                y = self.weight.view(self.out_channels, c) @ xs.transpose(0, 1).reshape(c, n * h * w)
                return y.view(self.out_channels, n, h, w).transpose(0, 1).contiguous()
        return F.conv2d(x, self.weight, None, stride, padding, dilation, self.groups)

    def extra_repr(self) -> str:
        init = f"kaiming(a={self.a:g})" if self.init == "kaiming" else self.init
        return (f"{self.in_channels}, {self.out_channels}, k={_size_str(self.kernel_size)}, groups={self.groups}, "
                f"init={init}{', decays to init' if self.decays_to_init else ''}")


class FixedKernelStep(nn.Module):
    """A fixed (not trained) kernel: identity, average pool or frequency prior.

    The kernel is a non-persistent buffer: it is a function of the shape only,
    so checkpoints stay free of it and cannot disagree with the code. It is built in
    the default dtype and cast with the module (float32 constants in a model made
    in float32 and moved to float64, as in the paper's code).
    """

    KINDS = ("identity", "avg", "prior")

    def __init__(self, kind: str, channels: int, kernel_size, groups: int | None = None):
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"unknown fixed kernel {kind!r}, expected one of {self.KINDS}")
        self.kind, self.in_channels, self.out_channels = kind, channels, channels
        self.kernel_size = K.as_pair(kernel_size, "kernel_size")
        self.groups = (groups or 1) if kind == "identity" else channels  # pooling and filtering act per channel
        self.built_dtype = torch.get_default_dtype()
        self.register_buffer("weight", self._build(self.built_dtype, None), persistent=False)

    def _apply(self, fn, recurse=True):
        """Every conversion (``to``, ``double``, ``to_empty``, ...) makes the kernel anew from the shape, in
        the dtype it was built in, then cast: after ``to_empty`` (a model made on the meta device and
        materialised, as FSDP and accelerate do) a buffer that no checkpoint holds would be garbage."""
        out = super()._apply(fn, recurse)
        w = self.weight
        if w is not None and w.device.type != "meta":
            with torch.no_grad():
                w.copy_(self.made_anew(w.device))
        return out

    def made_anew(self, device) -> Tensor:
        """The kernel made again from the shape, in the dtype the block was built in (a module pickled
        before that was recorded: float32), on ``device``."""
        return self._build(getattr(self, "built_dtype", torch.float32), device)

    def _build(self, dtype: torch.dtype, device) -> Tensor:
        c, k = self.out_channels, self.kernel_size
        if self.kind == "identity":
            return K.identity_kernel(c, self.groups, k, dtype=dtype, device=device)
        make = K.avg_pool_kernel if self.kind == "avg" else K.freq_prior_kernel
        return make(c, k, dtype=dtype, device=device)

    def kernel(self) -> Tensor:
        return self.weight

    def run(self, x: Tensor, stride: int, dilation: int, padding=0) -> Tensor:
        if self.kind == "identity" and self.kernel_size == (1, 1):
            return x[:, :, ::stride, ::stride]
        return F.conv2d(x, self.weight, None, stride, padding, dilation, self.groups)

    def extra_repr(self) -> str:
        return f"{self.kind}, channels={self.out_channels}, k={_size_str(self.kernel_size)}"


def _materialise_fixed_kernels(block: nn.Module, incompatible_keys) -> None:
    """A re-param block's load_state_dict post-hook: a block made on the meta device and loaded with
    ``assign=True`` has real parameters but its fixed kernels (which no checkpoint holds) still on the
    meta device: they are made where, and in the dtype, its parameters now are."""
    like = next((p for p in block.parameters() if p.is_floating_point() and p.device.type != "meta"), None)
    if like is None:
        return
    for m in block.modules():
        if isinstance(m, FixedKernelStep) and m.weight is not None and m.weight.device.type == "meta":
            m.weight = m.made_anew(like.device).to(like.dtype)


class Scale(PackableWeight, nn.Module):
    """Linear scaling layer of block linearization: a learnable vector or scalar."""

    def __init__(self, channels: int, init: float = 1.0, mode: str = "vector"):
        super().__init__()
        if mode not in ("vector", "scalar"):
            raise ValueError(f"Scale mode must be 'vector' or 'scalar', got {mode!r}")
        self.mode, self.init_value = mode, float(init)
        self.weight = nn.Parameter(torch.full((channels if mode == "vector" else 1,), float(init)))

    def reset_parameters(self) -> None:
        """Back to the value it started with (``model.apply(lambda m: m.reset_parameters())`` resets
        the branches' scales with their convs and BNs)."""
        if "init_value" not in self.__dict__:
            raise RuntimeError("this Scale was pickled before scales kept the value they start with: build the "
                               "model anew (its constructor) and load its state_dict to reset its parameters")
        with torch.no_grad():
            self.weight.fill_(self.init_value)

    def affine(self) -> tuple[Tensor, Tensor | None]:
        _check_weight_slot(self)
        return self.weight, None

    def forward(self, x: Tensor) -> Tensor:
        _check_weight_slot(self)
        return x * self.weight.view(1, -1, 1, 1).to(x.dtype)  # keeps autocast's dtype

    def extra_repr(self) -> str:
        return f"{self.mode}, size={self.weight.numel()}"


def _refuse_reparametrized_steps(block: nn.Module, error: Exception) -> None:
    """``torch.nn.utils.prune`` or ``parametrize`` (weight_norm, spectral_norm) on a branch's step
    takes its ``weight`` slot away, which the block reads to build its kernel (the step's own forward,
    where they recompute it, never runs): a TypeError naming the steps (of ``block`` or of the blocks
    its group builds with), instead of a KeyError from inside the construction."""
    group = getattr(block, "_kernel_group", None)
    groups = [] if group is None else (group.peers or [group])
    # (named under the network the group was made for, where there is one)
    blocks = {id(b): (b, f"{name}.") for g in groups for b, name in zip(g.blocks, g.block_names or ("",) * len(g.blocks))}
    blocks.setdefault(id(block), (block, ""))
    odd = [prefix + name for b, prefix in blocks.values() for name in reparametrized_steps(b)]
    if odd:
        raise TypeError(reparametrized_steps_message(odd)) from error
    # a parameter slot emptied and the tensor set as a plain attribute in its place: what
    # FullyShardedDataParallel(use_orig_params=False) does with every parameter it flattens
    plain = sorted({prefix + (f"{name}.{key}" if name else key) for b, prefix in blocks.values()
                    for name, m in b.named_modules() if not m.__dict__.get("_is_replica", False)
                    for key, t in m.__dict__.items() if isinstance(t, Tensor)
                    and ((key == "weight" and (_is_kernel_step(m) or isinstance(m, Scale)))
                         or (isinstance(m, E.PackedParameters) and key in m.kinds))})
    if plain:
        raise TypeError(
            f"{', '.join(plain[:3])}{', ...' if len(plain) > 3 else ''} "
            f"{f'({len(plain)} in all) are plain tensors' if len(plain) > 1 else 'is a plain tensor'} "
            "where the block expects registered parameters: FullyShardedDataParallel with use_orig_params=False "
            "puts views of its flat parameter in their place, which a re-param block cannot build its kernel "
            "from. Use FullyShardedDataParallel(..., use_orig_params=True) or FSDP2 (torch.distributed.fsdp."
            "fully_shard), or shard the deployed model (orepa.reparameterize)") from error


def reparametrized_steps(block: nn.Module) -> list[str]:
    """The names (under ``block``) of its steps whose weight slot ``prune`` / ``weight_norm`` /
    ``parametrize`` took away (:func:`_reparametrized`)."""
    return [name for name, m in block.named_modules()
            if (_is_kernel_step(m) or isinstance(m, PackableWeight)) and _reparametrized(m)]


def reparametrized_steps_message(names: Iterable[str]) -> str:
    return (f"the weight of {', '.join(sorted(set(names)))} is pruned or parametrized (torch.nn.utils.prune, "
            "parametrizations.weight_norm, ...): a re-param block builds its kernel from its steps' weight "
            "tensors, which these take away; prune or parametrize the deployed model (orepa.reparameterize), "
            "or remove them (prune.remove, parametrize.remove_parametrizations)")


def _reparametrized(m: nn.Module) -> bool:
    """Whether ``torch.nn.utils.prune`` (``weight_orig``), the hook-based ``weight_norm`` (``weight_v``;
    ``spectral_norm``: ``weight_orig``) or ``parametrize`` (``parametrizations``) took ``m``'s weight slot
    away: they recompute ``weight`` when ``m`` is called, which a step inside a block never is."""
    return "parametrizations" in m._modules or "weight_orig" in m._parameters or "weight_v" in m._parameters


def _check_weight_slot(step: nn.Module) -> None:
    """The feature-map and reference routes read a step's ``weight`` attribute, which a pruned or
    hook-normed step still has (a stale copy from its last call) and a parametrized one computes: a
    KeyError as the kernel route's read of the slot gives, so that every route refuses alike (the
    block names the step, :func:`_refuse_reparametrized_steps`)."""
    if _reparametrized(step):
        raise KeyError("weight")


def _is_kernel_step(m: nn.Module) -> bool:
    return hasattr(m, "kernel") and hasattr(m, "groups")


def _size_str(k: tuple[int, int]) -> str:
    return str(k[0]) if k[0] == k[1] else f"{k[0]}x{k[1]}"


def _affine_of(step: nn.Module) -> tuple[Tensor, Tensor | None]:
    if isinstance(step, Scale):
        return step.affine()
    if isinstance(step, BATCH_NORMS):
        if step.running_mean is None:
            raise ValueError("a BatchNorm without running statistics cannot be folded")
        return K.bn_as_affine(step.running_mean, step.running_var, step.weight, step.bias, step.eps)
    raise TypeError(f"step {type(step).__name__} is neither a kernel nor a channel-affine step")


def _load_norm(bn: nn.Module, state: Mapping[str, Tensor], shift: Tensor | None) -> None:
    """Give ``bn`` the state of the BN a block replaced; the bias ``shift`` of the conv before that
    BN moves into its running mean (batch statistics cancel it anyway)."""
    state = dict(state)
    if bn.affine and "weight" not in state and "bias" not in state and "running_mean" in state:
        # a BN without affine (affine=False) replaced: its function is this one's at weight 1, bias 0
        state.update(weight=torch.ones_like(state["running_mean"]), bias=torch.zeros_like(state["running_mean"]))
    try:
        bn.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"the BN state does not fit {bn}: {exc}") from None
    if shift is not None and bn.running_mean is not None:
        bn.running_mean.sub_(shift.to(bn.running_mean))


class Branch(nn.Sequential):
    """One branch: kernel steps and channel-affine steps, applied in order."""

    def __init__(self, steps: Mapping[str, nn.Module]):
        super().__init__(OrderedDict(steps))
        kinds = [_is_kernel_step(s) for s in self]
        if not kinds or not kinds[0]:
            raise ValueError("a branch must start with a kernel step")
        for s in self:
            if not _is_kernel_step(s) and not isinstance(s, (Scale, *BATCH_NORMS)):
                raise TypeError(f"unsupported step {type(s).__name__} in a branch")
        self._last_kernel = max(i for i, k in enumerate(kinds) if k)
        # the structure is fixed from here on: cache what every forward asks (host time matters
        # on GPUs, where an online block's step is bound by launching its many small ops)
        self._kinds = tuple(kinds)
        sizes = [s.kernel_size for s, k in zip(self, kinds) if k]  # (kh, kw) each, nested blocks too
        self._extent = (1 + sum(kh - 1 for kh, _ in sizes), 1 + sum(kw - 1 for _, kw in sizes))
        self._scaled = isinstance(self[-1], Scale)
        # Zero padding may be applied at the only spatial kernel step (instead of padding the
        # input once) when nothing before it adds a shift: the same function, no padded copy.
        spatial = [i for i, st in enumerate(self) if _is_kernel_step(st) and tuple(st.kernel_size) != (1, 1)]
        self._pad_step = None
        if len(spatial) <= 1:
            i = spatial[0] if spatial else self._last_kernel
            if not any(isinstance(st, BATCH_NORMS) for st in list(self)[:i]):
                self._pad_step = i
        # A BN before the first spatial step (DBB's 1x1 -> BN -> kxk / avg): the pointwise steps up to
        # it run on the unpadded map, which is then padded with what they give a zero input in eval
        # form (DBB's "BN-and-pad"): in training the BN's batch statistics are the map's, not the
        # border's zeros' too; in eval the same function as padding the input first
        self._pad_after = None
        if spatial and self._pad_step is None and any(isinstance(st, BATCH_NORMS) for st in list(self)[:spatial[0]]):
            self._pad_after = spatial[0]
        self._fast_groups = self._closed_form_groups()
        # a pointwise branch (every kernel 1x1) without BN commutes with subsampling: a strided
        # block may subsample its input first and run every step on the smaller map
        self._subsample_first = self.extent == (1, 1) and not self.has_norm

    def _closed_form_groups(self) -> int | None:
        """Groups of the branch kernel if its squeeze has a closed-form backward, else None.

        That holds for one or two plain kernel steps (whose composition has a cheap
        vjp) optionally ended by a scale: every branch of the OREPA blocks.
        """
        steps = list(self)
        if steps and isinstance(steps[-1], Scale):
            steps = steps[:-1]
        if not 1 <= len(steps) <= 2 or not all(isinstance(s, (ConvStep, FixedKernelStep)) for s in steps):
            return None
        if len(steps) == 1:
            return steps[0].groups
        a, b = steps
        return K.cheap_vjp_groups(a.weight.shape, a.groups, b.weight.shape, b.groups)

    def _split(self) -> tuple[list[nn.Module], Scale | None]:
        steps = list(self._modules.values())
        if self._scaled:
            return steps[:-1], steps[-1]
        return steps, None

    @property
    def extent(self) -> tuple[int, int]:
        """Receptive field ``(kh, kw)`` (kernel size) of the composed branch, before dilation."""
        return self._extent

    @property
    def has_norm(self) -> bool:
        return any(isinstance(s, BATCH_NORMS) for s in self)

    def fused_kernel(self) -> tuple[Tensor, Tensor | None, int]:
        """The branch as one affine kernel ``(weight, bias, groups)``; BNs use running stats.

        (Not named ``fuse``: timm's ``reparameterize_model`` replaces any child that has a
        ``fuse()`` by what it returns.)"""
        w = b = None
        g = 1
        for step in self:
            if _is_kernel_step(step):
                if w is None:
                    w, g = step.kernel(), step.groups
                else:
                    w, b, g = K.compose_affine(w, b, g, step.kernel(), None, step.groups)
            else:
                scale, shift = _affine_of(step)
                w = K.scale_channels(w, scale)
                if b is not None:
                    b = b * scale
                if shift is not None:
                    b = shift if b is None else b + shift
        return w, b, g

    def run(self, x: Tensor, stride: int, dilation: int, padded: dict[tuple, Tensor] | None = None,
            padding_mode: str = "zeros") -> Tensor:
        """Run on the feature map: pad once by the branch's receptive field, then valid steps.

        When one kernel step is spatial and nothing before it adds a shift, padding
        there instead is the same function and needs no padded copy of ``x``.
        ``padded`` shares padded inputs between branches of one block. ``padding_mode``: another
        of nn.Conv2d's pads by copies of the map's own pixels, with which the pointwise steps (1x1
        convs, BNs, scales) commute: they run on the unpadded map (a BN's batch statistics are the
        map's), which is padded so just before the first spatial step (no border value to make up,
        as DBB's BN-and-pad does for zeros); in eval the same function as padding the input first.
        """
        if stride > 1 and self._subsample_first:
            x, stride = x[:, :, ::stride, ::stride], 1
        p = (self._extent[0] // 2 * dilation, self._extent[1] // 2 * dilation)
        if padding_mode != "zeros" and p != (0, 0):
            return self._run_padded_by(x, stride, dilation, p, padding_mode)
        h = x
        first, pad_after = 0, getattr(self, "_pad_after", None)  # (a branch pickled before it had one: None)
        if pad_after is not None and p != (0, 0):
            steps = list(self._modules.values())[:pad_after]
            # recomputed in a backward (activation checkpointing); not asked in compiled code (a graph break)
            rerun = not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1
            for step, is_kernel in zip(steps, self._kinds):
                h = step.run(h, 1, dilation) if is_kernel else _statistics_kept(step, h) if rerun else step(h)
            v = self._zero_response(steps, h).view(1, -1, 1, 1)
            h = F.pad(h - v, (p[1], p[1], p[0], p[0])) + v  # the border holds v (not differentiated: DBB's)
            first = pad_after
        elif self._pad_step is None and p != (0, 0):
            if padded is not None and p in padded:
                h = padded[p]
            else:
                h = F.pad(x, (p[1], p[1], p[0], p[0]))
                if padded is not None:
                    padded[p] = h
        for i, (step, is_kernel) in enumerate(zip(self._modules.values(), self._kinds)):
            if i < first:
                continue
            if is_kernel:
                h = step.run(h, stride if i == self._last_kernel else 1, dilation, p if i == self._pad_step else 0)
            else:
                h = step(h)
        return h

    def _run_padded_by(self, x: Tensor, stride: int, dilation: int, p: tuple[int, int], mode: str) -> Tensor:
        """:meth:`run` with a padding of copies of the map's pixels (``mode``, not zeros)."""
        h = x
        steps = list(self._modules.values())
        first = next(i for i, (st, k) in enumerate(zip(steps, self._kinds)) if k and tuple(st.kernel_size) != (1, 1))
        for i, (step, is_kernel) in enumerate(zip(steps, self._kinds)):
            if i == first:
                h = F.pad(h, (p[1], p[1], p[0], p[0]), mode=mode)
            h = step.run(h, stride if i == self._last_kernel else 1, dilation) if is_kernel else step(h)
        return h

    @staticmethod
    @torch.no_grad()
    def _zero_response(steps: list[nn.Module], like: Tensor) -> Tensor:
        """Per channel, what pointwise ``steps`` give a zero input in eval form (BNs on running
        statistics), in ``like``'s dtype."""
        v = None  # None: zero
        for step in steps:
            if _is_kernel_step(step):  # a 1x1 kernel (no bias) of a constant map
                if v is not None:
                    v = F.conv2d(v.view(1, -1, 1, 1), step.kernel(), None, 1, 0, 1, step.groups).view(-1)
                continue
            scale, shift = _affine_of(step)
            if v is not None:
                v = v * scale if shift is None else torch.addcmul(shift, v, scale)
            else:  # a zero input: the shift alone
                v = shift
        return torch.zeros(like.shape[1], dtype=like.dtype, device=like.device) if v is None else v.to(like.dtype)


def _statistics_kept(step: nn.Module, x: Tensor) -> Tensor:
    """``step(x)``, a BN in training mode leaving its running statistics (and batch count) as they
    are: a forward recomputed by activation checkpointing must pad with what the first run padded
    with, DBB's BN-and-pad value read off the statistics that run updated (a second update would
    change the function whose gradients the backward takes: ~30% off at DBB's layers)."""
    if not (isinstance(step, BATCH_NORMS) and step.training and step.track_running_stats):
        return step(x)
    momentum, count = step.momentum, step.num_batches_tracked.clone()
    step.momentum = 0.0  # (the update then keeps the statistics as they are: (1 - 0) * running + 0 * batch)
    try:
        return step(x)
    finally:
        step.momentum = momentum
        step.num_batches_tracked.copy_(count)


# --------------------------------------------------------------------------- blocks


class ReparamConv2d(nn.Module):
    """A convolution trained as parallel branches and deployable as one ``nn.Conv2d``.

    Exposes the ``nn.Conv2d`` attributes (``in_channels``, ``kernel_size``, ...) so it
    drops in where a conv stood. ``mode`` is fixed at construction (no global switch).
    """

    #: (a block pickled before it had a padding mode pads by zeros)
    padding_mode: str = "zeros"

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=None,
        dilation=1,
        groups: int = 1,
        bias: bool = False,
        *,
        branches: Mapping[str, Branch],
        mode: str = "online",
        recompute: bool | str = "auto",
        tf_same: bool = False,
        padding_mode: str = "zeros",
    ):
        super().__init__()
        _check_mode(mode, tf_same, padding, padding_mode)
        if recompute not in ("auto", True, False):
            raise ValueError(f"recompute must be 'auto', True or False, got {recompute!r}")
        self.recompute = recompute
        k, s, p, d = check_conv_config(in_channels, out_channels, kernel_size, stride, 0 if tf_same else padding,
                                       dilation, groups, padding_mode, any_padding=mode == "online")
        # "same" padding by zeros: the branches could also run on the feature map (the offline path, and
        # the engine's per-branch route); any other (online only) convolves with the squeezed kernel alone
        self._aligned = p == (k[0] // 2 * d, k[1] // 2 * d) and padding_mode == "zeros"
        # another mode: online, the input is padded by it, then convolved unpadded (as nn.Conv2d does);
        # offline, each branch pads by it (Branch.run)
        self.padding_mode = padding_mode
        if not branches:
            raise ValueError("a re-param block needs at least one branch")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride, self.padding, self.dilation = k, (s, s), p, (d, d)
        self.mode = mode
        # pad each input as TensorFlow's "SAME" does (a conv of timm's tf_* networks), then convolve unpadded
        self.tf_same = bool(tf_same)
        # the conv class it deploys to (None: nn.Conv2d, or Conv2dTFSame where tf_same): convert sets the
        # class it replaced where that is not nn.Conv2d (timm's Conv2dSame), so deployment gives it back
        self.deploy_class: type[nn.Conv2d] | None = None
        self.branches = nn.ModuleDict(branches)
        self.register_load_state_dict_post_hook(_materialise_fixed_kernels)
        for name, br in self.branches.items():
            first = next(iter(br))
            if first.in_channels != in_channels or br[self._last_kernel_index(br)].out_channels != out_channels:
                raise ValueError(f"branch {name!r} does not map {in_channels}->{out_channels} channels")
            if br.extent[0] > k[0] or br.extent[1] > k[1]:
                raise ValueError(f"branch {name!r} has receptive field {_size_str(br.extent)} beyond kernel_size "
                                 f"{_size_str(k)}")
            if mode == "online" and br.has_norm:
                raise ValueError(
                    f"branch {name!r} holds a BatchNorm2d: batch statistics are not linear, so it can only run offline"
                )
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        # token pairing this block with the BatchNorm it replaced (see AbsorbedNorm)
        self.absorbed_token: str | None = None
        # online blocks whose branches all have closed-form backwards squeeze through
        # engine.squeeze_kernels: nothing but parameters is kept for backward
        self._closed_form = mode == "online" and all(br._fast_groups == groups for br in self.branches.values())
        self._routes: dict[tuple, tuple[list[str], list[str]]] = {}  # input shape -> route (engine.route)
        self._first_full: dict[tuple[str, ...], str | None] = {}  # branch set -> branch starting the sum
        # blocks of this one's construction signature that build their kernels together
        # (engine.group_kernels); a plain attribute, so no state_dict key and no submodule
        self._kernel_group: E.KernelGroup | None = None
        self._plans: dict[tuple[str, ...], E.Plan] = {}  # branch set -> what squeezing it reads

    @staticmethod
    def _last_kernel_index(br: Branch) -> int:
        return br._last_kernel

    @property
    def conv_padding(self) -> tuple[int, int]:
        """The padding the convolution itself applies: ``padding``, or none where the input is padded
        by another ``padding_mode`` first (:meth:`_forward`)."""
        return self.padding if self.padding_mode == "zeros" else (0, 0)

    @property
    def has_norm(self) -> bool:
        return any(br.has_norm for br in self.branches.values())

    def _step_weights(self) -> Iterator[Tensor]:
        """The steps' weights, not parameters(): a packed group's steps hold rows of parameters the group
        keeps; a fixed filter's weight is a buffer."""
        return (m.weight for m in self.modules() if isinstance(getattr(m, "weight", None), Tensor))

    def _fused_parts(self) -> tuple[Tensor, Tensor | None]:
        # composed in the parameters' dtype whatever autocast the caller runs under, as the engine's routes
        # compose: a deployment inside an autocast region gave bfloat16 weights to a float32 model
        with E.autocast_off(next(self._step_weights())):
            parts = []
            for br in self.branches.values():
                w, b, g = br.fused_kernel()
                if g != self.groups:
                    w = K.expand_groups(w, g, self.groups)
                parts.append((w, b))
            return K.add_parallel(parts, self.kernel_size)

    def equivalent(self) -> tuple[Tensor, Tensor | None]:
        """Eval-mode ``(weight, bias)`` of the whole block: the squeeze (BNs use running stats).

        This is the reference path (plain autograd through :mod:`orepa.kernels`); deployment
        uses it for every block. Online training uses the equal closed-form squeeze.
        """
        try:
            w, b = self._fused_parts()
        except KeyError as e:  # a step's weight slot gone (see forward)
            _refuse_reparametrized_steps(self, e)
            raise
        if self.bias is not None:
            b = self.bias if b is None else b + self.bias
        return w, b

    # ---- online path (executed by orepa.engine: squeeze, routes, recomputation, grouping)

    def _first_full_branch(self, names: Sequence[str]) -> str | None:
        """The branch whose fresh kernel starts the sum (a full-size single kernel)."""
        k = self.kernel_size
        return E.memo(self._first_full, tuple(names), lambda: next(
            (n for n in names if self.branches[n].extent == k and len(self.branches[n]._split()[0]) == 1), None))

    def kernel(self) -> Tensor:
        """The squeezed kernel of a BN-free, bias-free block (lets blocks nest as steps).

        Built anew at every call, in eval mode too: a cache keyed on the parameters' version
        counters went stale when weights were written through ``.data`` (a common EMA idiom),
        which no counter sees. For repeated inference, deploy (:func:`orepa.reparameterize`)."""
        if self.has_norm or self.bias is not None:
            raise ValueError("kernel() is only defined for blocks without BN and bias; use equivalent()")
        return self._squeezed()

    def _squeezed(self) -> Tensor:
        """The summed branch kernels of an online block (its bias excluded)."""
        names = tuple(self.branches)
        if not self._closed_form or E.reference_path():
            w = self._fused_parts()[0]
        elif torch.is_grad_enabled():
            w = E.train_kernel(self)
        else:
            w = E.squeeze((self,), names)
        return w

    def run(self, x: Tensor, stride: int, dilation: int, padding=0) -> Tensor:
        # used when this block is a step inside another block's branch
        return F.conv2d(x, self.kernel(), None, stride, padding, dilation, self.groups)

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first: a training form (memo dicts keyed by tuples, autograd
        # Functions, the engine's groups) is no TorchScript; its deployed conv is
        raise RuntimeError(f"torch.jit.script of a training-form {type(self).__name__} ({self.mode}): script the "
                           "deployed model, orepa.reparameterize(model), which computes the same function as plain "
                           "convs")

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(x, torch.fx.Proxy):
            # a symbolic trace (torch.fx; torchvision's create_feature_extractor) records the block as one
            # call, as it records a torch.nn layer: its shape checks and its kernels' construction are no graph
            tracer = x.tracer
            path = tracer.path_of_module(self)
            if not path:
                raise TypeError(f"torch.fx cannot trace the {type(self).__name__} block itself (its forward builds its "
                                "kernel): trace the network that holds it, where it is one call, or its deployed conv "
                                "(orepa.reparameterize(block))")
            return tracer.create_proxy("call_module", path, (x,), {})
        try:
            return self._forward(x)
        except KeyError as e:  # a step's weight slot gone (below): said as what happened
            _refuse_reparametrized_steps(self, e)
            raise

    def _forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__} expects input [N, {self.in_channels}, H, W], got {list(x.shape)}"
            )
        if self.tf_same:
            x = pad_tf_same(x, self.kernel_size, self.stride, self.dilation)
        elif self.padding_mode != "zeros" and self.padding != (0, 0) and self.mode == "online":
            (ph, pw) = self.padding  # (offline, each branch pads by it: Branch.run)
            x = F.pad(x, (pw, pw, ph, ph), mode=self.padding_mode)
        if self.mode == "online":
            if torch.jit.is_tracing():  # its kernel comes from autograd Functions and caches a trace cannot record
                raise RuntimeError(f"torch.jit.trace of an online {type(self).__name__}: trace the deployed model, "
                                   "orepa.reparameterize(model), which computes the same function as plain convs")
            if self._closed_form and torch.is_grad_enabled() and not E.reference_path():
                return E.train_forward(self, x)  # the engine picks the route
            return F.conv2d(x, self._squeezed(), self.bias, self.stride, self.conv_padding, self.dilation, self.groups)
        out = None
        padded: dict[tuple, Tensor] = {}  # branches with the same receptive field share one padded input
        for br in self.branches.values():
            y = br.run(x, self.stride[0], self.dilation[0], padded, self.padding_mode)
            out = y if out is None else out + y
        if self.bias is not None:
            out = out + self.bias.view(1, -1, 1, 1)
        return out

    @torch.no_grad()
    def to_conv(self) -> nn.Conv2d:
        """A plain ``nn.Conv2d`` computing this block in eval mode."""
        w, b = self.equivalent()
        cls = self.deploy_class or (Conv2dTFSame if self.tf_same else nn.Conv2d)
        mode = {} if self.padding_mode == "zeros" else {"padding_mode": self.padding_mode}
        with torch.device(w.device):  # made where it goes (a class of another library takes no device=)
            conv = cls(self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
                       self.dilation, self.groups, bias=b is not None, **mode).to(dtype=w.dtype)
        conv.weight.copy_(w)
        if b is not None:
            conv.bias.copy_(b)
        return keep_layout(conv, self._step_weights())

    @torch.no_grad()
    def load_conv(self, weight: Tensor, bias: Tensor | None = None, norm: Mapping[str, Tensor] | None = None
                  ) -> None:
        """Start as a plain conv: ``conv2d(x, weight, bias)``, followed, in a block that holds its
        own BNs (``has_norm``), by the BN it replaced, whose state_dict is ``norm``.

        The main branch (the first whose one kernel step is a full-size conv, or a nested block)
        takes the weight, its scale 1 or its BN ``norm`` (a conv bias moves into that BN's mean);
        every other branch starts at zero: its scale or BN affine 0, else its last learnable
        conv. Deployed (:func:`orepa.reparameterize`), the block is that conv (and BN) again.
        Branches at zero still learn: a zero scale gets a gradient at once, its branch next.
        Raises ValueError where the block cannot start so (wrong shapes, no such branch, a branch
        with nothing to zero)."""
        shape = (self.out_channels, self.in_channels // self.groups, *self.kernel_size)
        if tuple(weight.shape) != shape:
            raise ValueError(f"{type(self).__name__} takes a conv weight of shape {list(shape)}, got "
                             f"{list(weight.shape)}")
        if self.has_norm != (norm is not None):
            raise ValueError(f"{type(self).__name__} " + ("holds its own BNs: it needs the state of the BN it "
                                                          "replaced" if self.has_norm else "holds no BN: pass none"))
        if bias is not None and self.bias is None and not self.has_norm:
            raise ValueError(f"{type(self).__name__} has no bias to take the conv's")
        main = next((n for n, br in self.branches.items() if self._can_start_as_conv(br)), None)
        if main is None:
            raise ValueError(f"{type(self).__name__} has no branch that is one full-size {shape[2]}x{shape[3]} conv "
                             "to start as the given one (a linear deep stem composes several)")
        for name, br in self.branches.items():
            tail = br[-1] if isinstance(br[-1], (Scale, *BATCH_NORMS)) else None
            if name == main:
                step = br[0]
                if isinstance(step, ReparamConv2d):
                    step.load_conv(weight)
                else:
                    step.weight.copy_(weight)
                if isinstance(tail, Scale):
                    tail.weight.fill_(1.0)
                elif tail is not None:
                    _load_norm(tail, norm, bias)
            elif isinstance(tail, Scale) or (tail is not None and tail.affine):
                tail.weight.zero_()
                if getattr(tail, "bias", None) is not None:  # a BN's shift (a Scale has none)
                    tail.bias.zero_()
            else:
                learnable = [s for s in br if isinstance(s, ConvStep)]
                if not learnable:
                    raise ValueError(f"branch {name!r} of {type(self).__name__} has nothing to start at zero")
                learnable[-1].weight.zero_()
        if self.bias is not None:
            self.bias.copy_(bias if bias is not None and not self.has_norm else torch.zeros_like(self.bias))

    @property
    def can_start_as_conv(self) -> bool:
        """Whether :meth:`load_conv` can start this block as a plain conv (a linear deep stem cannot)."""
        return any(self._can_start_as_conv(br) for br in self.branches.values())

    def _can_start_as_conv(self, br: Branch) -> bool:
        """One kernel step, a full-size learnable conv of the block's groups (or a nested block), then at most
        its tail: the branch :meth:`load_conv` gives the plain conv's weight."""
        steps = list(br)
        if isinstance(steps[-1], (Scale, *BATCH_NORMS)):
            steps = steps[:-1]
        if len(steps) != 1:
            return False
        step = steps[0]
        if isinstance(step, ReparamConv2d):
            return step.kernel_size == self.kernel_size and step.groups == self.groups and not step.has_norm \
                and step.bias is None
        return isinstance(step, ConvStep) and step.kernel_size == self.kernel_size and step.groups == self.groups

    def fuse(self) -> nn.Conv2d:
        """timm's re-parameterization protocol (``timm.utils.reparameterize_model`` replaces a
        child by its ``fuse()``): :meth:`to_conv`. The BN a block absorbed is carried in this
        conv's bias; its :class:`AbsorbedNorm` placeholder fuses to an identity BatchNorm2d. Its
        network's root loses the engine's hooks (:func:`orepa.engine.forward_scope`) with the last
        block of its network deployed, this one and the blocks it nests (OREPA-VGG's, the deep stem's
        steps) counted (:func:`orepa.engine.block_deployed`)."""
        for m in self.modules():
            E.block_deployed(m)
        return self.to_conv().train(self.training)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={'tf_same' if self.tf_same else self.padding}, dilation={self.dilation}, groups={self.groups}, "
            + ("" if self.padding_mode == "zeros" else f"padding_mode={self.padding_mode}, ") + f"mode={self.mode}"
        )


# --------------------------------------------------------------------------- branch declarations


def _tail(name: str, channels: int, scaling: str, scale_init: Mapping[str, float], norm: bool) -> dict:
    """Last step of a branch: a BN (offline prototype / DBB) or a scaling layer."""
    if norm:
        return {"bn": nn.BatchNorm2d(channels)}
    if scaling == "none":
        return {}
    return {"scale": Scale(channels, scale_init.get(name, 1.0), scaling)}


@dataclass(frozen=True)
class StepConfig:
    """What a branch's steps depend on beyond the block's shape."""

    inner_norm: bool = False  # a BN after every kernel step but the last (DBB)
    dw_expand: int = 8  # channel expansion of a depthwise step
    internal: int | None = None  # width of a two-step branch's intermediate (None: the branch's default)
    init_a: float = TORCH_INIT_A  # kaiming_uniform_ slope of the random weights
    reference_init: bool = False  # identity factors placed as the published models place them (INIT_SCHEMES)

    def conv(self, cin: int, cout: int, k: int | tuple[int, int], groups: int, init: str = "kaiming",
             decays_to_init: bool = False) -> ConvStep:
        return ConvStep(cin, cout, k, groups, init=init, a=self.init_a, decays_to_init=decays_to_init)

    def norm(self, channels: int) -> dict:
        return {"bn0": nn.BatchNorm2d(channels)} if self.inner_norm else {}


@dataclass(frozen=True)
class BranchType:
    """One kind of branch: its linear steps, where its scale starts, and the switch that turns it on and off.

    ``steps(cin, cout, k, groups, cfg)`` (``k``: the block's kernel size ``(kh, kw)``) returns the
    steps (its tail, a scale or BN, is added by
    :func:`build_branches`). ``switch`` names a ``create_model`` option and CLI flag
    (``--<switch>`` / ``--no-<switch>``): False removes this branch from a model's OREPA blocks,
    True adds it where the model's branch set lacks it (a type registered beyond the paper's six).
    """

    name: str
    steps: Callable[[int, int, tuple[int, int], int, StepConfig], dict]
    scale_init: float
    switch: str | None = None
    help: str = ""


#: every branch a block can declare, by name: :func:`register_branch` adds one
BRANCH_TYPES: dict[str, BranchType] = {}


def register_branch(branch: BranchType) -> BranchType:
    """Make a branch type available to every block, ``convert``, the zoo (``branches=``, its switch) and the CLI."""
    if branch.name in BRANCH_TYPES:
        raise ValueError(f"branch {branch.name!r} is already registered")
    BRANCH_TYPES[branch.name] = branch
    return branch


class _ScaleInits(Mapping):
    def __getitem__(self, name: str) -> float:
        return BRANCH_TYPES[name].scale_init

    def __iter__(self):
        return iter(BRANCH_TYPES)

    def __len__(self) -> int:
        return len(BRANCH_TYPES)

    def __repr__(self) -> str:
        return repr(dict(self))


DEFAULT_SCALE_INIT = _ScaleInits()


def _kxk(cin, cout, k, groups, c: StepConfig) -> dict:
    return {"conv": c.conv(cin, cout, k, groups)}


def _1x1(cin, cout, k, groups, c: StepConfig) -> dict:
    return {"conv": c.conv(cin, cout, 1, groups)}


def _1x1_avg(cin, cout, k, groups, c: StepConfig) -> dict:
    return {"conv": c.conv(cin, cout, 1, groups), **c.norm(cout), "pool": FixedKernelStep("avg", cout, k)}


def _1x1_prior(cin, cout, k, groups, c: StepConfig) -> dict:
    return {"conv": c.conv(cin, cout, 1, groups), **c.norm(cout), "prior": FixedKernelStep("prior", cout, k)}


def _1x1_kxk(cin, cout, k, groups, c: StepConfig) -> dict:
    # DBB's choice: widen the intermediate for depthwise-like convs so the branch is not a mere rescale
    mid = (cin if groups < cout else 2 * cin) if c.internal is None else c.internal
    return {
        # it is an identity plus what it learns: the published OREPA block trains that delta on a fixed
        # (tiled, where widened) identity, so weight decay pulls it back to the identity, not to zero
        "conv1": c.conv(cin, mid, 1, groups, "identity-tiled" if c.reference_init else "identity",
                        decays_to_init=True),
        **c.norm(mid),
        "conv2": c.conv(mid, cout, k, groups),
    }


def _1x1_1x1(cin, cout, k, groups, c: StepConfig) -> dict:
    # a product of two 1x1s has rank <= min(C_in, C_out): a wider intermediate adds cost, not capacity
    mid = min(cin, cout) if c.internal is None else c.internal
    # the published Rep-1x1 puts the identity on its square factor: the first when the block widens,
    # else the second, so a narrowing block (a bottleneck's conv1, 256 -> 64) sees every input at init
    first_id = not c.reference_init or mid != min(cin, cout) or cout > cin
    return {
        "conv1": c.conv(cin, mid, 1, groups, "identity" if first_id else "kaiming"),
        **c.norm(mid),
        "conv2": c.conv(mid, cout, 1, groups, "kaiming" if first_id else "identity"),
    }


def _dw_pw(cin, cout, k, groups, c: StepConfig) -> dict:
    return {"dw": c.conv(cin, cin * c.dw_expand, k, cin), **c.norm(cin * c.dw_expand),
            "pw": c.conv(cin * c.dw_expand, cout, 1, groups)}


def _avg(cin, cout, k, groups, c: StepConfig) -> dict:
    if not cin == cout == groups:
        raise ValueError(f"the avg branch pools each input channel: it needs a depthwise conv (in_channels == "
                         f"out_channels == groups), got {cin} -> {cout}, groups {groups}")
    return {"pool": FixedKernelStep("avg", cout, k)}


def _identity(cin, cout, k, groups, c: StepConfig) -> dict:
    if cin != cout:
        raise ValueError(f"identity branch needs in_channels == out_channels, got {cin} != {cout}")
    return {"id": FixedKernelStep("identity", cout, 1, groups)}


# Scale values: supplement, "Initialization of branch-wise scaling layers". The paper's public code
# starts the 1x1-avg scale at 0.25; the supplement's 0.5 is the default here (pass
# scale_init={"1x1_avg": 0.25} for the code's value). Rep-1x1's second branch (0.5) and RepVGG's
# identity (1.0) are not listed in the supplement: 0.5 is the public code's value, 1.0 our choice.
for _branch in (
    BranchType("kxk", _kxk, 0.25, help="the kxk conv"),
    BranchType("1x1", _1x1, 1.0, help="a 1x1 conv"),
    BranchType("1x1_avg", _1x1_avg, 0.5, help="1x1 conv -> kxk average pool"),
    BranchType("1x1_prior", _1x1_prior, 0.0, switch="freq_prior", help="1x1 conv -> fixed frequency-prior filter"),
    BranchType("1x1_kxk", _1x1_kxk, 0.5, help="identity-initialised 1x1 conv -> kxk conv"),
    BranchType("dw_pw", _dw_pw, 0.5, switch="dw_sep", help="linear depthwise-separable: depthwise kxk (x8) -> 1x1"),
    BranchType("1x1_1x1", _1x1_1x1, 0.5, help="Rep-1x1's 1x1 -> 1x1"),
    BranchType("avg", _avg, 0.5, help="kxk average pool of the input (a depthwise conv's: DBB's)"),
    BranchType("identity", _identity, 1.0, help="the identity (RepVGG)"),
):
    register_branch(_branch)


def check_flags(options: Mapping[str, object], names: Sequence[str] | None = None) -> None:
    """The ``names`` of ``options`` (None: all of them) that must be True or False (a TypeError naming
    the first other value): ``rep_1x1="no"`` or ``branch_norm=0.5`` were taken by their truth, and
    built what they did not say. The one check behind blocks, ``convert`` and ``create_model``."""
    for key in options if names is None else names:
        if key in options and not isinstance(options[key], bool):
            raise TypeError(f"{key} must be True or False, got {options[key]!r} ({type(options[key]).__name__})")


def check_block_options(*, branches=None, scaling: str = "vector", scale_init=None, dw_expand=8,
                        internal_channels=None) -> None:
    """The block options whose values are wrong whatever the conv (a TypeError / ValueError naming
    the option): the one check behind blocks, ``convert`` and ``create_model``. ``convert`` runs it
    once before its loop: there a ValueError from a block means "this conv cannot be one" and the
    conv is skipped, which would hide a wrong option."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if isinstance(branches, str):
        raise TypeError(f"branches must be a sequence of branch names, got the string {branches!r}")
    names = tuple(branches or ())
    if branches is not None and not names:  # (None: the block's default set)
        raise ValueError("branches must name at least one branch")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate branches {duplicates} in branches={list(names)}: name each branch once")
    if scale_init is not None and not isinstance(scale_init, Mapping):
        raise TypeError(f"scale_init must be a mapping branch name -> initial scale, got {scale_init!r}")
    unknown = sorted(set(names) - set(BRANCH_TYPES)) + sorted(set(scale_init or {}) - set(BRANCH_TYPES))
    if unknown:
        raise ValueError(f"unknown branch name(s) {unknown}; known: {sorted(BRANCH_TYPES)} (unknown branches are "
                         "a mistake in the options, never a conv to skip)")
    for n, v in (scale_init or {}).items():
        if isinstance(v, (bool, str, bytes)) or not hasattr(v, "__float__"):
            raise TypeError(f"scale_init[{n!r}] must be a number, got {v!r}")
        if not math.isfinite(float(v)):  # a NaN or inf scale makes every output of the block NaN
            raise ValueError(f"scale_init[{n!r}] must be a finite number, got {v!r}")
    if scale_init and scaling == "none":
        raise ValueError(f"scale_init={dict(scale_init)} has no scale to start: scaling='none'")
    for n, v, default in (("dw_expand", dw_expand, ""),
                          ("internal_channels", internal_channels, " (None: the branch's default width)")):
        if v is None and default:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{n} must be an int >= 1, got {v!r} ({type(v).__name__}){default}")
        if v < 1:
            raise ValueError(f"{n} must be an int >= 1, got {v!r}{default}")


def build_branches(
    names: Iterable[str],
    in_channels: int,
    out_channels: int,
    kernel_size,
    groups: int,
    *,
    scaling: str = "vector",
    scale_init: Mapping[str, float] | None = None,
    norm: bool = False,
    inner_norm: bool = False,
    dw_expand: int = 8,
    internal_channels: int | None = None,
    init_a: float = TORCH_INIT_A,
    reference_init: bool = False,
) -> dict[str, Branch]:
    """Declare named branches (:data:`BRANCH_TYPES`); ``norm`` puts a BN at the end instead of a scale.

    ``init_a`` / ``reference_init``: how the random and identity factors start (:class:`StepConfig`).
    """
    check_block_options(branches=names, scaling=scaling, scale_init=scale_init, dw_expand=dw_expand,
                        internal_channels=internal_channels)
    names = tuple(names)
    kernel_size = check_conv_config(in_channels, out_channels, kernel_size, groups=groups)[0]  # (kh, kw)
    if scale_init and norm:
        raise ValueError(f"scale_init={dict(scale_init)} has no scale to start: the branches end in a BatchNorm "
                         "(branch_norm=True)")
    init = {**DEFAULT_SCALE_INIT, **(scale_init or {})}
    cfg = StepConfig(inner_norm, dw_expand, internal_channels, init_a, reference_init)
    out = {}
    for name in names:
        steps = BRANCH_TYPES[name].steps(in_channels, out_channels, kernel_size, groups, cfg)
        out[name] = Branch({**steps, **_tail(name, out_channels, scaling, init, norm)})
    return out


class OREPAConv2d(ReparamConv2d):
    """The OREPA block (Fig. "blocks"); for ``kernel_size=1`` the Rep-1x1 block.

    Replaces a Conv2d that is followed by a BatchNorm2d: that BN is the
    post-addition norm, and the block does NOT contain it. Without it the
    paper's training diverges (table "linearization", last row).

    Args:
        branches: which branches are on (default: the six of Fig. "blocks", or
            ``("1x1", "1x1_1x1")`` for 1x1 convs). ``"identity"`` is available
            for RepVGG-style blocks (needs in == out channels and stride 1).
        scaling: ``"vector"`` (per channel, default), ``"scalar"`` or ``"none"``.
        scale_init: per-branch overrides of :data:`DEFAULT_SCALE_INIT`.
        mode: ``"online"`` (squeeze every forward) or ``"offline"`` (run branches).
        branch_norm: offline prototype: a BN ends each branch instead of a scale.
        inner_norm: with ``branch_norm``, a BN after the first conv of each two-step branch too
            (as DBB has): the prototype with "a norm layer right after each computational layer".
        dw_expand: channel expansion of the depthwise step of ``dw_pw`` (8).
        internal_channels: width of the 1x1 -> kxk intermediate; default as the paper's code:
            ``in_channels`` for ``groups <= 4``, else ``2 * in_channels`` (ResNeXt, depthwise convs).
        init: ``"reference"`` (default: as the published models were trained), ``"torch"``
            (nn.Conv2d's default) or a ``kaiming_uniform_`` slope; see :data:`INIT_SCHEMES`.
        recompute: online training keeps no squeezed kernel for backward and rebuilds
            it there (``True``), keeps it (``False``), or ``"auto"``: rebuild when the
            kernel is larger than the input the conv keeps anyway (small batches, deep layers).
        tf_same: pad every input as TensorFlow's "SAME" convolutions do (:func:`pad_tf_same`:
            unevenly where the stride needs it; timm's ``Conv2dSame`` in its ``tf_*`` networks)
            instead of by ``padding``; online mode only (branches on the feature map need a
            common centre). Deploys to :class:`Conv2dTFSame`.
        padding_mode: as nn.Conv2d's (``"reflect"``, ``"replicate"``, ``"circular"``: online, the input
            padded so, then convolved with the squeezed kernel; offline, each branch pads so before
            its first spatial step, :meth:`Branch.run`).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size=3,
        stride=1,
        padding=None,
        dilation=1,
        groups: int = 1,
        bias: bool = False,
        *,
        branches: Sequence[str] | None = None,
        scaling: str = "vector",
        scale_init: Mapping[str, float] | None = None,
        mode: str = "online",
        branch_norm: bool = False,
        inner_norm: bool = False,
        dw_expand: int = 8,
        internal_channels: int | None = None,
        init: str | float = "reference",
        recompute: bool | str = "auto",
        tf_same: bool = False,
        padding_mode: str = "zeros",
    ):
        _check_mode(mode, tf_same, padding, padding_mode)
        check_flags({"bias": bias, "branch_norm": branch_norm, "inner_norm": inner_norm, "tf_same": tf_same})
        k = check_conv_config(in_channels, out_channels, kernel_size, stride, 0 if tf_same else padding, dilation,
                              groups, padding_mode, any_padding=mode == "online")[0]
        init_a, reference_init = _resolve_init(init, k)
        if internal_channels is None and k != (1, 1):
            internal_channels = in_channels if groups <= 4 else 2 * in_channels
        if branches is None:
            branches = REP_1X1_BRANCHES if k == (1, 1) else OREPA_BRANCHES
        if isinstance(branches, str):
            raise TypeError(f"branches must be a sequence of branch names, got the string {branches!r}")
        branches = tuple(branches)
        if not branches:
            raise ValueError("branches must name at least one branch")
        if k == (1, 1) and set(branches) - {"1x1", "1x1_1x1", "identity"}:
            raise ValueError(f"a 1x1 block supports branches 1x1, 1x1_1x1, identity; got {branches}")
        if "identity" in branches and K.as_pair(stride, "stride")[0] != 1:
            raise ValueError("the identity branch needs stride 1")
        if branch_norm and mode == "online":
            raise ValueError("branch_norm=True (a BN per branch) needs mode='offline'")
        if inner_norm and not branch_norm:
            raise ValueError("inner_norm=True (a BN inside each branch) needs branch_norm=True and mode='offline'")
        built = build_branches(
            branches, in_channels, out_channels, k, groups, scaling=scaling, scale_init=scale_init,
            norm=branch_norm, inner_norm=inner_norm, dw_expand=dw_expand, internal_channels=internal_channels, init_a=init_a,
            reference_init=reference_init,
        )
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         branches=built, mode=mode, recompute=recompute, tf_same=tf_same, padding_mode=padding_mode)


def _resolve_init(init: str | float, k: tuple[int, int]) -> tuple[float, bool]:
    """``(kaiming slope a, reference identity layout)`` of an init scheme for a kxk (k > 1) or 1x1 block."""
    if init == "reference":
        return (1.0 if k == (1, 1) else 0.0), True
    if init == "torch":
        return TORCH_INIT_A, False
    if isinstance(init, (int, float)) and not isinstance(init, bool) and init >= 0:
        return float(init), True
    raise ValueError(f"init must be one of {INIT_SCHEMES} or a non-negative kaiming slope, got {init!r}")


class DBBConv2d(ReparamConv2d):
    """Diverse Branch Block (offline): kxk, 1x1, 1x1->avg, 1x1->kxk, a BN after every conv (on a
    depthwise conv, as DBB: kxk, avg pool, 1x1->kxk with its 1x1 widened to 2 C_in, a plain conv).

    Contains its BNs, so it replaces a Conv2d *and* the BatchNorm2d after it.
    """

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, padding=None, dilation=1, groups=1,
                 bias=False, *, internal_channels: int | None = None, padding_mode: str = "zeros"):
        k = check_conv_config(in_channels, out_channels, kernel_size, stride, padding, dilation, groups)[0]
        if k == (1, 1):
            raise ValueError("DBB needs kernel_size >= 3 (its branches degenerate for 1x1 convs)")
        # DBB's own structure on a depthwise conv: no 1x1 branch, and the average pool of the input
        # itself (a 1x1 conv before it would be a per-channel scale)
        depthwise = groups >= out_channels and in_channels == out_channels
        built = build_branches(("kxk", "avg", "1x1_kxk") if depthwise else ("kxk", "1x1", "1x1_avg", "1x1_kxk"),
                               in_channels, out_channels, k, groups, norm=True, inner_norm=True,
                               internal_channels=internal_channels)
        first = built["1x1_kxk"].conv1
        if first.out_channels != first.in_channels:  # DBB's identity-based layer is square; a wider one is a plain conv
            built["1x1_kxk"].conv1 = ConvStep(first.in_channels, first.out_channels, 1, first.groups)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         branches=built, mode="offline", padding_mode=padding_mode)


class RepVGGBlock(ReparamConv2d):
    """RepVGG's block without its ReLU: kxk+BN, 1x1+BN, identity BN (when in == out, stride 1)."""

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, padding=None, dilation=1, groups=1,
                 bias=False, *, padding_mode: str = "zeros"):
        k, s, _, _ = check_conv_config(in_channels, out_channels, kernel_size, stride, padding, dilation, groups)
        if k == (1, 1):
            raise ValueError("RepVGG needs kernel_size >= 3")
        names = ["kxk", "1x1"] + (["identity"] if in_channels == out_channels and s == 1 else [])
        built = build_branches(names, in_channels, out_channels, k, groups, norm=True)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         branches=built, mode="offline", padding_mode=padding_mode)


class OREPAVGGBlock(ReparamConv2d):
    """OREPA-VGG: a RepVGG block whose kxk branch is an online OREPA block (+BN).

    The identity and 1x1 branches keep their BNs and run offline (supp. "Limitations").
    ``orepa_options`` go to the inner :class:`OREPAConv2d`; as in the paper's code, its random
    weights start with ``kaiming_uniform_(a=1)`` under ``init="reference"`` and its 1x1 -> kxk
    intermediate is ``2 * in_channels`` wide only when ``groups == out_channels``.
    """

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, padding=None, dilation=1, groups=1,
                 bias=False, init: str | float = "reference", **orepa_options):
        k, s, _, d = check_conv_config(in_channels, out_channels, kernel_size, stride, padding, dilation, groups)
        if k == (1, 1):
            raise ValueError("OREPA-VGG needs kernel_size >= 3")
        if orepa_options.get("internal_channels") is None:  # None: OREPA-VGG's default, not OREPAConv2d's
            orepa_options["internal_channels"] = in_channels if groups < out_channels else 2 * in_channels
        # the block's padding mode, not its inner block's (a nested step pads nothing)
        padding_mode = orepa_options.pop("padding_mode", "zeros")
        inner = OREPAConv2d(in_channels, out_channels, k, 1, None, d, groups,
                            init=1.0 if init == "reference" else init, **orepa_options)
        if inner.mode != "online" or inner.has_norm:
            raise ValueError("the kxk branch of OREPA-VGG must be an online OREPA block")
        built = {"kxk": Branch({"orepa": inner, "bn": nn.BatchNorm2d(out_channels)})}
        names = ["1x1"] + (["identity"] if in_channels == out_channels and s == 1 else [])
        built.update(build_branches(names, in_channels, out_channels, k, groups, norm=True))
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         branches=built, mode="offline", padding_mode=padding_mode)


class OREPADeepStem(ReparamConv2d):
    """Linear deep stem: a kxk conv (7x7/2 in ResNets) trained as (k-1)/2 stacked 3x3 OREPA blocks.

    Online, the stacked kernels are composed (sequential rule) into one kxk kernel
    every forward. Offline, the stack runs on the feature map with the input
    padded once, which is exactly the squeezed conv. A stack of 3x3 convs that
    each pad by 1 (Guo et al.'s deep stem) matches it only away from the border.
    ``orepa_options`` go to each inner 3x3 :class:`OREPAConv2d`.
    """

    def __init__(self, in_channels, out_channels, kernel_size=7, stride=2, padding=None, dilation=1, groups=1,
                 bias=False, *, mid_channels: int | None = None, mode: str = "online", **orepa_options):
        # TensorFlow's "SAME" padding is the stem's own (its composed kernel pads as one conv), never its
        # nested steps', which pad nothing: taken out of the options the steps get
        tf_same = orepa_options.pop("tf_same", False)  # (checked with the mode by ReparamConv2d)
        kh, kw = check_conv_config(in_channels, out_channels, kernel_size, stride, 0 if tf_same else padding,
                                   dilation, groups, any_padding=bool(tf_same),
                                   same_padding_because="a deep stem's stacked convs need it, online too")[0]
        if kh != kw or kh < 5 or groups != 1:
            raise ValueError(f"a deep stem needs a square kernel_size >= 5 and groups=1, got k={_size_str((kh, kw))}, "
                             f"groups={groups}")
        k = kh
        if mid_channels is not None and (isinstance(mid_channels, bool) or not isinstance(mid_channels, int)):
            raise TypeError(f"mid_channels must be an int >= 1 or None (out_channels), got {mid_channels!r}")
        if mid_channels is not None and mid_channels < 1:
            raise ValueError(f"mid_channels must be an int >= 1 or None (out_channels), got {mid_channels!r}")
        mid = out_channels if mid_channels is None else mid_channels
        n = (k - 1) // 2
        chans = [in_channels] + [mid] * (n - 1) + [out_channels]
        # the stem's padding mode, not its steps' (nested steps pad nothing)
        padding_mode = orepa_options.pop("padding_mode", "zeros")
        steps = {f"layer{i}": OREPAConv2d(chans[i], chans[i + 1], 3, **orepa_options) for i in range(n)}
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         branches={"stem": Branch(steps)}, mode=mode, padding_mode=padding_mode, tf_same=tf_same)


# --------------------------------------------------------------------------- absorbed BN placeholder


class AbsorbedNorm(nn.Identity):
    """Stands where a BatchNorm2d was when the block that replaced its conv holds its own BNs.

    ``orepa.reparameterize`` turns it back into a BatchNorm2d (so the deployed
    model has the vanilla layout) that carries the block's bias. It keeps the
    original BN's configuration, training flag, dtype and device (an empty
    non-persistent buffer, so ``.double()`` / ``.to()`` move it and no
    state_dict key is added) and a token pairing it with its block.

    The token is shared by the placeholder and its block; ``copy.deepcopy`` gives
    a block and placeholder copied together one new token, so every copy of a
    converted layer stays paired with its own placeholder.

    ``norm_act``: ``bn`` is a norm followed by its own dropout and activation (timm's
    BatchNormAct2d, ``bn.drop`` then ``bn.act``): the placeholder keeps those two, under the same
    names (an activation's parameters keep their keys), and runs them; it is restored as a module
    of ``bn``'s own class holding them.
    """

    class Token(str):
        """A pairing token: ``copy.deepcopy`` makes a new one (the same one for every reference
        copied in one deepcopy call, by deepcopy's memo)."""

        def __deepcopy__(self, memo) -> AbsorbedNorm.Token:
            return type(self)(uuid.uuid4().hex)

    def __init__(self, bn: nn.BatchNorm2d, token: str | None = None, norm_act: bool = False):
        super().__init__()
        if norm_act:
            self.drop, self.act = bn.drop, bn.act
            # bn's class and configuration, without its dropout and activation (those live here) and
            # outside the module tree (no state_dict key, not moved by .to(): restore() places it)
            blank = {id(bn.drop): nn.Identity(), id(bn.act): nn.Identity()}
            self.__dict__["_norm_act_template"] = copy.deepcopy(bn, blank)
        self.num_features, self.eps, self.momentum = bn.num_features, bn.eps, bn.momentum
        self.affine, self.track_running_stats = bn.affine, bn.track_running_stats
        self.sync = isinstance(bn, nn.SyncBatchNorm)  # restored as the kind it was
        self.frozen = bn.weight is not None and not bn.weight.requires_grad  # restored frozen (a frozen stage)
        self.token = token or AbsorbedNorm.Token(uuid.uuid4().hex)
        like = next((t for t in (bn.weight, bn.running_mean) if t is not None), None)
        factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
        self.register_buffer("_like", torch.empty(0, **factory), persistent=False)
        self.train(bn.training)

    def fuse(self) -> nn.BatchNorm2d:
        """timm's protocol (see :meth:`ReparamConv2d.fuse`, whose conv carries this BN's affine):
        a BatchNorm2d that is the identity in eval mode."""
        return self.restore(None)

    def restore(self, shift: Tensor | None) -> nn.BatchNorm2d:
        """A BatchNorm2d (a SyncBatchNorm where it replaced one) whose eval output is ``x + shift``,
        with this placeholder's dtype, device and training flag."""
        like = getattr(self, "_like", shift)  # placeholders pickled before _like existed: the shift's
        factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
        template = self.__dict__.get("_norm_act_template")
        if template is None:
            kind = nn.SyncBatchNorm if getattr(self, "sync", False) else nn.BatchNorm2d  # older pickles: BatchNorm2d
            bn = kind(self.num_features, self.eps, self.momentum, self.affine, self.track_running_stats, **factory)
        else:
            bn = copy.deepcopy(template).to(**factory)
            bn.reset_parameters()  # the running statistics and the affine at their init, as a new BN's
            bn.drop, bn.act = self.drop, self.act
        with torch.no_grad():
            # (x - mean) / sqrt(var + eps): var = 1 - eps makes the denominator 1
            bn.running_var.fill_(1.0 - self.eps)
            if shift is not None:
                bn.running_mean.copy_(-shift)
        if getattr(self, "frozen", False):  # older pickles: not frozen
            bn.requires_grad_(False)
        return bn.train(self.training)

    def forward(self, x: Tensor) -> Tensor:
        return x if self.__dict__.get("_norm_act_template") is None else self.act(self.drop(x))

    def extra_repr(self) -> str:
        return f"{self.num_features}, absorbed into its conv's re-param block" + (
            "" if self.__dict__.get("_norm_act_template") is None else ", then its drop and act")
