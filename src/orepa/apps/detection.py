"""Detection and segmentation with re-param ResNet backbones (application layer).

The paper transfers ImageNet-pretrained OREPA-ResNet-50 to Faster R-CNN and
RetinaNet (COCO) and to PSPNet and DeepLabV3+ (Cityscapes), replacing only the
backbone (table "detseg", supplement "Object Detection and Semantic
Segmentation: Detailed Setup"). This module builds those models from
torchvision's detector / segmenter classes with any ResNet-family name of the
model zoo and any method (``base``, ``dbb``, ``orepa``, ``orepa-offline``):

* :func:`resnet_features` - the trunk as a multi-scale feature extractor
  (C2..C5, strides 4, 8, 16, 32; channel counts in ``.channels``),
* :func:`fpn_backbone` - the same with torchvision's ``BackboneWithFPN``,
* :func:`fasterrcnn`, :func:`retinanet` - torchvision detectors,
* :func:`deeplabv3`, :func:`fcn`, :func:`pspnet`, :func:`deeplabv3plus` - segmenters,
* :func:`load_backbone_weights` - ImageNet checkpoints in training or deployed form,
* :func:`param_groups` - optimizer groups: the paper's deep-stem lr x0.1, no
  weight decay on norms / biases / branch scales.

After training, ``orepa.reparameterize(model)`` turns the whole detector or
segmenter into plain convolutions (no tracing needed: blocks are found by type
and absorbed BNs by token); the deployed backbone has torchvision's ResNet
layout.

Norm layers (``norm=``). torchvision freezes detection backbones' BNs by
swapping them for ``FrozenBatchNorm2d``; mmdetection (used by the paper) keeps
``BatchNorm2d`` modules in eval mode (``norm_eval=True``). Here every norm stays
an ``nn.BatchNorm2d`` - the BNs inside DBB / offline branches, the post-addition
BN after every OREPA block and the vanilla BNs alike - because the re-param
machinery folds exactly those (``Branch`` steps, ``AbsorbedNorm``,
``fuse_conv_bn``). Freezing is a *policy* of the feature extractor instead:

* ``"train"``: ordinary BN (batch statistics in training; torchvision's choice
  for backbones trained from scratch and for segmentation, mmsegmentation's default);
* ``"eval"``: BNs always run on their running statistics, their affine
  parameters still train (mmdetection ``norm_eval=True``, the paper's setup);
* ``"frozen"``: as ``"eval"`` and the affine parameters of the network's own
  norms are frozen too: the same function as torchvision's ``FrozenBatchNorm2d``
  (the BNs inside DBB / offline branches are the block's parameterisation and
  train; the BN a block absorbed is deployed frozen).

In every mode BNs of frozen stages run on running statistics. With ``"eval"`` /
``"frozen"`` a DBB branch is an affine map during training, so the post-training
deployment is exact as always; an OREPA block's post-addition BN becomes a
fixed (or learned) per-channel affine map after the squeezed conv.
"""
from __future__ import annotations

import inspect
import os
import re
import sys
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Dict  # noqa: UP035 - TorchScript reads typing.Dict, not dict, in annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.utils import _reverse_repeat_tuple
from torchvision.models import WeightsEnum
from torchvision.models.segmentation._utils import _SimpleSegmentationModel

from ..blocks import AbsorbedNorm, OREPADeepStem, ReparamConv2d
from ..convert import load_plain_state_dict, pads_tf_same, reparameterize
from ..engine import kernel_groups
from ..models.reference import is_reference_state_dict
from ..state_dicts import EMA_KEYS, STATE_DICT_KEYS, WRAPPER_PREFIXES, is_state_dict, without_ema_counter
from .common import split_params

__all__ = [
    "METHODS", "NORM_MODES", "STAGES", "STRIDES",
    "build_trunk", "dilate_resnet", "load_backbone_weights", "method_of_weights",
    "ResNetFeatures", "resnet_features", "fpn_backbone", "stage_channels", "stage_strides",
    "fasterrcnn", "retinanet", "deeplabv3", "fcn", "pspnet", "deeplabv3plus",
    "PSPHead", "DeepLabV3PlusHead", "DeepLabV3Plus", "PSPNet",
    "param_groups", "register_mm_backbones",
]

#: backbone methods for the ResNet family
METHODS: tuple[str, ...] = ("base", "dbb", "orepa", "orepa-offline")
NORM_MODES: tuple[str, ...] = ("train", "eval", "frozen")
#: ResNet stages in order; "stem" is conv1 + bn1 (the deep stem for OREPA)
STAGES: tuple[str, ...] = ("stem", "layer1", "layer2", "layer3", "layer4")
_STEM_MODULES = ("conv1", "bn1")
#: default names of the returned features and their strides (standard 7x7/2 stem, no dilation)
FEATURE_NAMES: dict[str, str] = {"layer1": "c2", "layer2": "c3", "layer3": "c4", "layer4": "c5"}
STRIDES: dict[str, int] = {"c2": 4, "c3": 8, "c4": 16, "c5": 32}


# --------------------------------------------------------------------------- the trunk


def build_trunk(name: str = "resnet50", method: str = "orepa", **options) -> nn.Module:
    """The ResNet-family network ``name`` of the model zoo in ``method``'s training form, without classifier.

    ``options`` go to :func:`orepa.models.create_model` (``width_mult``, ``small_input``,
    block options such as ``branches``, ``scaling``, ``deep_stem``, ...).
    """
    from ..models import create_model, model_family

    if model_family(name) != "resnet":
        raise ValueError(f"{name!r} is not a ResNet-family network; detection backbones need C2..C5 stages")
    if method not in METHODS:
        raise ValueError(f"unknown backbone method {method!r}; choose from {METHODS}")
    return create_model(name, method=method, num_classes=0, **options)


def _check_resnet(trunk: nn.Module, name: str) -> None:
    missing = [m for m in ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4") if not hasattr(trunk, m)]
    if missing:
        raise ValueError(f"{name!r} is not a ResNet-family network with torchvision's layout (no {missing})")


def _stage_blocks(trunk: nn.Module, stage: str) -> list[nn.Module]:
    return list(getattr(trunk, stage).children())


def _is_bottleneck(block: nn.Module) -> bool:
    return hasattr(block, "conv3")


def stage_channels(trunk: nn.Module) -> dict[str, int]:
    """Output channels of layer1..layer4 of a ResNet-layout trunk (any method)."""
    out = {}
    for stage in STAGES[1:]:
        last = _stage_blocks(trunk, stage)[-1]
        out[stage] = (last.conv3 if _is_bottleneck(last) else last.conv2).out_channels
    return out


def _stride(m: nn.Module) -> int:
    s = getattr(m, "stride", 1)
    return s[0] if isinstance(s, tuple) else int(s)


def stage_strides(trunk: nn.Module) -> dict[str, int]:
    """Output strides of layer1..layer4 (from the stem, max-pool and first-block convs; dilation aware)."""
    stride = _stride(trunk.conv1) * (_stride(trunk.maxpool) if isinstance(trunk.maxpool, nn.MaxPool2d) else 1)
    out = {}
    for stage in STAGES[1:]:
        first = _stage_blocks(trunk, stage)[0]
        stride *= _stride(first.conv2 if _is_bottleneck(first) else first.conv1)
        out[stage] = stride
    return out


def _set_geometry(conv: nn.Module, stride: int | None = None, dilation: int | None = None) -> None:
    """Change stride / dilation of an ``nn.Conv2d`` or a re-param block in place ("same" padding
    kept; one that pads by TensorFlow's rule, timm's ``Conv2dSame``, pads for its new geometry by
    itself).

    Re-param blocks read ``stride``, ``padding`` and ``dilation`` at every forward
    (online squeeze, offline branches) and in ``to_conv``, like ``nn.Conv2d``.
    """
    if not isinstance(conv, (nn.Conv2d, ReparamConv2d)):
        raise TypeError(f"cannot dilate a {type(conv).__name__}")
    if stride is not None:
        conv.stride = (stride, stride)
    if dilation is not None:
        conv.dilation = (dilation, dilation)
    if not pads_tf_same(conv):
        conv.padding = tuple(k // 2 * d for k, d in zip(conv.kernel_size, conv.dilation))
        if hasattr(conv, "_reversed_padding_repeated_twice"):  # what an nn.Conv2d of another padding_mode pads by
            conv._reversed_padding_repeated_twice = _reverse_repeat_tuple(conv.padding, 2)  # (as nn.Conv2d makes it)


def dilate_resnet(trunk: nn.Module, replace_stride_with_dilation: Sequence[bool]) -> nn.Module:
    """torchvision's ``replace_stride_with_dilation`` applied to a built (possibly converted) trunk.

    For layer2..layer4 flagged True the stride-2 conv and the downsample conv
    get stride 1, and the 3x3 convs get dilation as in torchvision's
    ``ResNet._make_layer``: the first block of the stage keeps the previous
    dilation, the others use twice that. Bottleneck: the 3x3 ``conv2``; BasicBlock
    (torchvision refuses dilation there): ``conv1`` only, as mm's BasicBlock (``conv2`` keeps
    dilation 1), so a dilated ResNet-18 / 34 is mmsegmentation's ResNet with
    ``contract_dilation=True`` (mmdetection's does not contract: its first blocks differ).
    Works the same on plain convs and on re-param blocks, so every method can be dilated.
    """
    flags = list(replace_stride_with_dilation)
    if len(flags) != 3:
        raise ValueError(f"replace_stride_with_dilation needs 3 booleans (layer2..4), got {flags}")
    dilation = 1
    for stage, flag in zip(STAGES[2:], flags):
        if not flag:
            continue
        previous, dilation = dilation, dilation * 2
        for i, block in enumerate(_stage_blocks(trunk, stage)):
            d = previous if i == 0 else dilation
            if _is_bottleneck(block):
                _set_geometry(block.conv2, stride=1, dilation=d)
            else:
                _set_geometry(block.conv1, stride=1, dilation=d)
            if getattr(block, "downsample", None) is not None:
                _set_geometry(block.downsample[0], stride=1)
            if hasattr(block, "stride"):
                block.stride = 1
    return trunk


# --------------------------------------------------------------------------- pretrained weights


#: prefixes every key of a backbone's state_dict may share: wrappers' (DDP, torch.compile), a
#: detector's (torchvision's ``backbone.body.``, mm*'s ``backbone.``) and the mm* backbone's
_PREFIXES = (*WRAPPER_PREFIXES, "backbone.body.", "backbone.", "body.", "features.")


#: torchvision's weights by name, as its builders take ``weights_backbone``: "DEFAULT", "IMAGENET1K_V1",
#: "ResNet50_Weights.IMAGENET1K_V1" (a name that is no file)
_WEIGHTS_NAME = re.compile(r"(?:[A-Za-z0-9]+_Weights\.)?[A-Z][A-Z0-9_]*")


def _named_weights(weights, name: str):
    """``weights`` as torchvision's weights enum where it names torchvision's weights of network ``name``
    rather than a file; else as given."""
    if not (isinstance(weights, str) and _WEIGHTS_NAME.fullmatch(weights)) or os.path.exists(weights):
        return weights
    from torchvision.models import get_model_weights

    try:
        enum = get_model_weights(name)
    except ValueError:
        raise ValueError(f"weights {weights!r}: no such file, and torchvision has no weights of {name} by name "
                         "(give a checkpoint's path)") from None
    try:
        return enum.verify(weights)
    except KeyError:
        raise ValueError(f"weights {weights!r}: no such file, nor weights of torchvision's {name} (it has DEFAULT, "
                         f"{', '.join(w.name for w in enum)})") from None


def _unwrap(weights, *, ema: bool = False) -> tuple[dict[str, Tensor], dict]:
    """The state_dict ``weights`` holds (``ema``: its EMA weights), keys as saved, and what the
    checkpoint says of itself (``model_cfg``, ``form``: an ``orepa train`` / ``orepa reparam``
    checkpoint's; for messages). A path is read by :func:`orepa.apps.checkpoint.read_checkpoint_file`
    (``weights_only``; a missing, damaged or foreign file is named, as a ``ValueError``), whose
    content is taken as any other tool's: checkpoints of training scripts wrap their state_dict
    in many ways."""
    if isinstance(weights, (str, os.PathLike)):
        from .checkpoint import read_checkpoint_file
        from .common import UserError

        try:
            weights = read_checkpoint_file(weights)
        except UserError as exc:
            raise ValueError(str(exc)) from None
    if isinstance(weights, WeightsEnum):  # torchvision's (weights_backbone=ResNet50_Weights.IMAGENET1K_V1): its file
        weights = weights.get_state_dict(progress=True, check_hash=True, weights_only=True)
    saved = {k: weights[k] for k in ("model_cfg", "form") if k in weights} if isinstance(weights, Mapping) else {}
    if ema:
        key = next((k for k in EMA_KEYS if isinstance(weights, Mapping) and isinstance(weights.get(k), Mapping)
                    and weights[k]), None)
        if key is None:
            raise ValueError(f"the checkpoint holds no EMA weights (looked for {' / '.join(EMA_KEYS)}: a run of "
                             "orepa train with --model-ema saves them); leave out ema=True for its weights")
        weights = without_ema_counter(weights[key])
    if isinstance(weights, nn.Module):
        weights = weights.state_dict()
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a path, a state_dict, a module or torchvision's weights enum, got "
                        f"{type(weights).__name__}")
    while not all(isinstance(v, Tensor) for v in weights.values()):
        # a state_dict itself first (a checkpoint's "model" may be a description of it), then a wrapper
        inner = next((weights[k] for k in STATE_DICT_KEYS if is_state_dict(weights.get(k))), None) or \
            next((weights[k] for k in STATE_DICT_KEYS if isinstance(weights.get(k), Mapping) and weights[k]), None)
        if inner is None:
            bad = [k for k, v in weights.items() if not isinstance(v, Tensor)][:5]
            raise ValueError(f"checkpoint is not a state_dict: non-tensor entries {bad} and no "
                             f"{'/'.join(STATE_DICT_KEYS)} entry to unwrap")
        weights = inner
    return dict(weights), saved


def _as_state_dict(weights, *, ema: bool = False) -> tuple[dict[str, Tensor], dict]:
    """:func:`_unwrap`, with the prefixes every key shares that wrappers add (DDP, torch.compile, a
    detector's ``backbone.``, the mm* backbone's ``features.``) removed."""
    sd, saved = _unwrap(weights, ema=ema)
    changed = True
    while changed and sd:
        changed = False
        for p in _PREFIXES:
            if all(k.startswith(p) for k in sd):
                sd = {k[len(p):]: v for k, v in sd.items()}
                changed = True
    return sd, saved


def _backbone_keys(keys: Iterable[str]) -> set[str]:
    """The keys that tell a checkpoint's form: neither the classifier's (``fc.*``) nor the BNs' batch
    counts, which weights saved before PyTorch 0.4.1 (torchvision's model-zoo ResNet files) lack and
    ``load_state_dict`` does not ask for."""
    return {k for k in keys if not k.startswith("fc.") and not k.endswith(".num_batches_tracked")}


_COMMON_OPTIONS = ("width_mult", "small_input", "zero_init_residual")


def method_of_weights(state_dict: Mapping[str, Tensor], name: str, **options) -> str | None:
    """Which method's training form (``"base"`` = deployed / vanilla) ``state_dict``'s keys are, or None.

    Compares key sets (the classifier ``fc.*`` ignored) with the trunk of every
    method in :data:`METHODS` built with ``options`` (the ``base`` trunk with the
    architecture options only: ``width_mult``, ``small_input``).
    """
    keys = _backbone_keys(state_dict)
    for method in METHODS:
        opts = options if method != "base" else {k: v for k, v in options.items() if k in _COMMON_OPTIONS}
        try:
            ref = build_trunk(name, method, **opts)
        except ValueError:  # options that this method does not take
            continue
        if _backbone_keys(ref.state_dict()) == keys:
            return method
    return None


def _load_matching(trunk: nn.Module, sd: Mapping[str, Tensor], what: str) -> None:
    own = trunk.state_dict()
    bad = [f"{k}: checkpoint {list(v.shape)} vs model {list(own[k].shape)}"
           for k, v in sd.items() if k in own and own[k].shape != v.shape]
    if bad:
        raise ValueError(f"{what}: shape mismatch (another depth / width?) at {len(bad)} tensors, e.g. "
                         + "; ".join(bad[:3]))
    result = trunk.load_state_dict({k: v for k, v in sd.items() if not k.startswith("fc.")}, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith("fc.")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{what}: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")


def load_backbone_weights(trunk: nn.Module, weights, *, name: str, method: str, ema: bool = False,
                          **options) -> str:
    """Load an ImageNet checkpoint into ``trunk`` (the classification network); returns the form found.

    ``weights``: a path (read with ``weights_only=True``), a state_dict (also
    wrapped in ``{"state_dict": ...}`` / ``{"model": ...}``, ``module.`` prefixes
    stripped), a module or torchvision's weights, as enum or by name (``ResNet50_Weights.IMAGENET1K_V1``,
    ``"DEFAULT"``, ``"IMAGENET1K_V2"``: its file, downloaded as torchvision does). ``ema``: the checkpoint's EMA weights (``model_ema`` of an
    ``orepa train --model-ema`` run, timm's ``state_dict_ema``). The classifier (``fc.*``) is
    ignored. Accepted:

    * the same form as ``trunk`` (training form of ``method``, or deployed /
      vanilla for ``method="base"``, e.g. torchvision's ImageNet weights);
    * the training form of another method into a ``"base"`` trunk: it is
      built, loaded and reparameterized first (deployed = vanilla layout);
    * deployed / vanilla weights into a re-param trunk: every block starts as
      its plain conv (:func:`orepa.load_plain_state_dict`: its other branches at
      zero), so the backbone computes the plain network. A linear deep stem
      cannot (``deep_stem=False``).

    Anything else raises ``ValueError`` saying what the checkpoint is.
    """
    sd, saved = _as_state_dict(_named_weights(weights, name), ema=ema)
    if _backbone_keys(sd) == _backbone_keys(trunk.state_dict()):
        _load_matching(trunk, sd, f"checkpoint for {name}/{method}")
        return method
    cfg = saved.get("model_cfg") if isinstance(saved.get("model_cfg"), Mapping) else {}
    recorded = dict(cfg["options"]) if isinstance(cfg.get("options"), Mapping) else {}  # its block options
    if method == "base":  # (which a base trunk does not take: the training form is built with those recorded)
        options = {**recorded, **options}
    form = method_of_weights(sd, name, **options)
    if form is None and is_reference_state_dict(sd):  # (its key lists would name nothing the user can act on)
        raise ValueError("the checkpoint holds a model in the layout of the paper's own code: convert it first "
                         "(orepa.import_reference, or `orepa import-reference CKPT -o OUT.pth`), then give OUT.pth")
    if form is None:
        own = _backbone_keys(trunk.state_dict())
        theirs = _backbone_keys(sd)
        said = "; ".join([f"{k}={cfg[k]!r}" for k in ("model", "method", "width_mult", "in_chans", "small_input")
                          if k in cfg] + [f"{k}={v!r}" for k, v in sorted(recorded.items())])
        raise ValueError(
            f"checkpoint does not match {name} in any form {METHODS}: e.g. missing {sorted(own - theirs)[:3]}, "
            f"unexpected {sorted(theirs - own)[:3]} (another architecture, or different block options?"
            + (f" The checkpoint says it was trained as {said}: build the backbone with the same options"
               if said else "")
            + (" A BN-folded (deploy-fused) checkpoint has no BNs to load into a backbone; use the deployed one "
               "(orepa reparam without --fuse-bn)" if saved.get("form") == "deploy-fused" else "") + ")")
    if method == "base":
        src = build_trunk(name, form, **options)
        _load_matching(src, sd, f"{form} checkpoint for {name}")
        deployed = reparameterize(src.eval())
        _load_matching(trunk, deployed.state_dict(), f"deployed {form} checkpoint for {name}")
        return f"{form} (reparameterized)"
    if form == "base":
        # branch parameters cannot be recovered from a merged kernel, but every block can start as it
        head = [k for k in trunk.state_dict() if k.startswith("fc.")]
        try:
            load_plain_state_dict(trunk, {k: v for k, v in sd.items() if not k.startswith("fc.")}, keep=head)
        except ValueError as exc:
            stem = " with deep_stem=False (a linear deep stem cannot start as a given 7x7 kernel)," \
                if isinstance(trunk.conv1, OREPADeepStem) else ""
            raise ValueError(
                f"the checkpoint is a deployed / vanilla {name} (plain conv weights); the {method!r} backbone "
                f"cannot start as it: {exc}. Build it{stem} or with method='base' to fine-tune the plain "
                "network") from None
        return "base (every block starting as its conv)"
    raise ValueError(f"the checkpoint is the {form!r} training form of {name}; build the backbone with "
                     f"method={form!r} (or method='base' to load it reparameterized)")


# --------------------------------------------------------------------------- feature extractor


class ResNetFeatures(nn.ModuleDict):
    """A ResNet trunk (any method) returning the outputs of chosen stages.

    Like torchvision's ``IntermediateLayerGetter`` (the modules up to the last
    returned stage, same names, so parameter names stay ``conv1.*``,
    ``layer3.0.conv2.*``), plus the backbone's norm policy (see the module
    docstring) and freezing.

    Attributes:
        return_layers: stage -> output name.
        channels: output name -> channels.  strides: output name -> stride.
        norm: ``"train"``, ``"eval"`` or ``"frozen"``.  frozen_stages: stages without gradients.
    """

    def __init__(self, trunk: nn.Module, return_layers: Mapping[str, str], *, norm: str = "train",
                 frozen_stages: Iterable[str] = ()):
        _check_resnet(trunk, type(trunk).__name__)
        if norm not in NORM_MODES:
            raise ValueError(f"norm must be one of {NORM_MODES}, got {norm!r}")
        unknown = set(return_layers) - set(STAGES[1:])
        if unknown:
            raise ValueError(f"return_layers must name stages layer1..layer4, got {sorted(unknown)}")
        last = max(STAGES.index(s) for s in return_layers)
        layers = OrderedDict()
        for child_name, child in trunk.named_children():
            layers[child_name] = child
            if child_name == STAGES[last]:
                break
        super().__init__(layers)
        chans = stage_channels(trunk)
        self.return_layers = dict(return_layers)
        self.channels = {out: chans[stage] for stage, out in return_layers.items()}
        strides = stage_strides(trunk)
        self.strides = {out: strides[stage] for stage, out in return_layers.items()}
        self.norm = norm
        self.frozen_stages = tuple(s for s in STAGES if s in set(frozen_stages))
        for name, p in self.named_parameters():
            if self._stage_of(name) in self.frozen_stages:
                p.requires_grad_(False)
        if norm == "frozen":
            # the network's own norms: not the BNs inside re-param blocks, which are the block's
            # parameterisation (a DBB branch started at zero from plain weights learns only through
            # its BN's affine) and fold into its kernel; an absorbed BN deploys frozen
            inside = {id(m) for b in self.modules() if isinstance(b, ReparamConv2d) for m in b.modules()}
            for m in self.modules():
                if isinstance(m, _BatchNorm) and id(m) not in inside:
                    m.requires_grad_(False)
                elif isinstance(m, AbsorbedNorm):
                    m.frozen = True
        self.train(trunk.training)

    @staticmethod
    def _stage_of(qualified_name: str) -> str:
        top = qualified_name.split(".", 1)[0]
        return "stem" if top in _STEM_MODULES else top

    def train(self, mode: bool = True):
        super().train(mode)
        if mode:
            for name, m in self.named_modules():
                if isinstance(m, _BatchNorm) and (self.norm != "train" or self._stage_of(name) in self.frozen_stages):
                    m.eval()
        return self

    def forward(self, x: Tensor) -> Dict[str, Tensor]:  # noqa: UP006 - TorchScript
        out = OrderedDict()
        for name, module in self.items():
            x = module(x)
            if name in self.return_layers:
                out[self.return_layers[name]] = x
        return out

    def extra_repr(self) -> str:
        return f"channels={self.channels}, strides={self.strides}, norm={self.norm!r}, frozen={self.frozen_stages}"


def _frozen_stages(deep_stem: bool, trainable_layers: int, train_stem: bool | None) -> list[str]:
    if not 0 <= trainable_layers <= 5:
        raise ValueError(f"trainable_layers must be in [0, 5], got {trainable_layers}")
    if train_stem not in (None, True, False):  # (a string from a command line would read as True)
        raise ValueError(f"train_stem must be True, False or None, got {train_stem!r}")
    trainable = set(STAGES[::-1][:trainable_layers])  # layer4, layer3, ..., stem (torchvision's order)
    if train_stem is None:
        train_stem = "stem" in trainable or deep_stem  # paper: the linear deep stem is not frozen
    if train_stem:
        trainable.add("stem")
    else:
        trainable.discard("stem")
    return [s for s in STAGES if s not in trainable]


def resnet_features(
    name: str = "resnet50",
    method: str = "orepa",
    *,
    weights=None,
    ema: bool = False,
    returned_layers: Sequence[int] = (1, 2, 3, 4),
    output_names: Sequence[str] | None = None,
    trainable_layers: int | None = None,
    train_stem: bool | None = None,
    norm: str | None = None,
    replace_stride_with_dilation: Sequence[bool] | None = None,
    **options,
) -> ResNetFeatures:
    """A ResNet-family backbone (zoo name, any method) returning C2..C5 (strides 4, 8, 16, 32).

    Args:
        name, method: zoo network (``resnet18`` ... ``resnet152``, ``resnext50_32x4d``,
            wide variants) and ``"base" | "dbb" | "orepa" | "orepa-offline"``.
        weights: ImageNet checkpoint (path / state_dict), see :func:`load_backbone_weights`.
        ema: take the checkpoint's EMA weights (``orepa train --model-ema``).
        returned_layers: stages 1..4 to return (C2..C5).
        output_names: names of the returned features (default ``c2``..``c5``).
        trainable_layers: torchvision's meaning: how many stages, counted from
            layer4 down to the stem, get gradients (0..5). Default 3 with
            ``weights``, 5 without (as torchvision).
        train_stem: override for the stem (conv1 + bn1). Default: trainable when it
            is a linear deep stem (``orepa``; ``orepa-offline`` with ``deep_stem=True``; the paper does not
            freeze it and lowers its lr x0.1 instead, see :func:`param_groups`), else
            as ``trainable_layers`` says.
        norm: ``"train" | "eval" | "frozen"`` (module docstring). Default
            ``"frozen"`` with ``weights`` (torchvision detection), ``"train"`` without.
        replace_stride_with_dilation: 3 booleans for layer2..4 (see :func:`dilate_resnet`).
        options: block options for the zoo (``branches``, ``scaling``, ...).

    The result has ``.channels`` and ``.strides`` (output name -> int).
    """
    trunk = build_trunk(name, method, **options)
    _check_resnet(trunk, name)
    if weights is not None:
        load_backbone_weights(trunk, weights, name=name, method=method, ema=ema, **options)
    elif ema:
        raise ValueError("ema=True takes a checkpoint's EMA weights: give weights= too")
    if trainable_layers is None:
        trainable_layers = 3 if weights is not None else 5
    if norm is None:
        norm = "frozen" if weights is not None else "train"
    frozen = _frozen_stages(isinstance(trunk.conv1, OREPADeepStem), trainable_layers, train_stem)
    if weights is None and (norm in ("eval", "frozen") or frozen):
        # torchvision makes every layer trainable here (with a warning); this backbone may be given its
        # weights later (a whole detector's state_dict), so it keeps the request and says what it means
        warnings.warn(f"resnet_features({name!r}, weights=None): " + " and ".join(
            what for what, on in ((f"norm={norm!r} keeps the BN statistics at their initialisation (mean 0, "
                                   "variance 1)", norm in ("eval", "frozen")),
                                  (f"frozen stages {frozen} keep their random weights", bool(frozen))) if on)
                      + "; load the backbone's weights before training, or pass norm='train', trainable_layers=5",
                      UserWarning, stacklevel=2)
    dilation = tuple(replace_stride_with_dilation or (False, False, False))
    if any(dilation):
        dilate_resnet(trunk, dilation)
    bad = [i for i in returned_layers if i not in (1, 2, 3, 4)]
    if bad or not returned_layers:
        raise ValueError(f"returned_layers must be a non-empty subset of 1..4, got {list(returned_layers)}")
    stages = [f"layer{i}" for i in returned_layers]
    names = list(output_names) if output_names is not None else [FEATURE_NAMES[s] for s in stages]
    if len(names) != len(stages) or len(set(stages)) != len(stages):
        raise ValueError("returned_layers must not repeat, and output_names needs one name per returned layer")
    return_layers = dict(sorted(zip(stages, names)))  # network order: the order of the outputs
    return ResNetFeatures(trunk, return_layers, norm=norm, frozen_stages=frozen)


def fpn_backbone(
    name: str = "resnet50",
    method: str = "orepa",
    *,
    returned_layers: Sequence[int] = (1, 2, 3, 4),
    out_channels: int = 256,
    extra_blocks=None,
    fpn_norm_layer=None,
    **kwargs,
):
    """torchvision ``BackboneWithFPN`` over :func:`resnet_features` (outputs ``"0"``, ``"1"``, ... , ``"pool"``).

    ``kwargs`` go to :func:`resnet_features`. ``.body`` is the
    :class:`ResNetFeatures` (``.body.channels``, ``.body.strides``).
    """
    from torchvision.models.detection.backbone_utils import BackboneWithFPN

    returned_layers = sorted(returned_layers)  # FPN levels from fine to coarse, named "0", "1", ...
    body = resnet_features(name, method, returned_layers=returned_layers,
                           output_names=[str(i) for i in range(len(returned_layers))], **kwargs)
    fpn = BackboneWithFPN(nn.Sequential(body), {"0": "0"}, list(body.channels.values()), out_channels,
                          extra_blocks=extra_blocks, norm_layer=fpn_norm_layer)
    fpn.body = body  # the getter built by BackboneWithFPN is replaced by ours (norm policy, channels)
    return fpn


# --------------------------------------------------------------------------- detectors


#: torchvision's detector builders' names for the backbone keywords (``fasterrcnn_resnet50_fpn(...)``)
_TORCHVISION_BACKBONE_NAMES = {"trainable_backbone_layers": "trainable_layers", "weights_backbone": "weights"}


def _split_backbone_kwargs(kwargs: dict, detector: type, builder: str) -> tuple[dict, dict]:
    """``kwargs`` of a detector builder as (backbone keywords, detector keywords). The detector's
    ``**kwargs`` end in ``GeneralizedRCNNTransform``, which ignores what it does not know: a keyword
    neither takes (torchvision's backbone names, a typo) would be dropped, silently, so it is mapped
    (``trainable_backbone_layers``, ``weights_backbone``) or refused."""
    for theirs, ours in _TORCHVISION_BACKBONE_NAMES.items():
        if theirs in kwargs:
            if ours in kwargs:
                raise TypeError(f"{builder}() got both {ours}= and torchvision's name for it, {theirs}=")
            kwargs[ours] = kwargs.pop(theirs)
    names = (set(inspect.signature(resnet_features).parameters) | {"fpn_norm_layer"}) - {
        "name", "method", "options", "output_names"}
    bb = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    bb.update(kwargs.pop("backbone_options", None) or {})
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    known = {n for cls in (detector, GeneralizedRCNNTransform) for n, p in inspect.signature(cls).parameters.items()
             if p.kind is not p.VAR_KEYWORD} | {"_skip_resize"}  # (the transform's one keyword taken from **kwargs)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(
            f"{builder}() got unexpected keyword(s) {', '.join(unknown)}: backbone keywords are "
            f"{', '.join(sorted(names))} (torchvision's {', '.join(_TORCHVISION_BACKBONE_NAMES)} too) and block options "
            f"go in backbone_options={{...}}; the rest goes to torchvision's {detector.__name__}")
    return bb, kwargs


def _check_feature_maps(body, det_kwargs: dict, extra: int, builder: str, anchors: str) -> None:
    """torchvision's default anchor generators (Faster R-CNN's, RetinaNet's) have five levels: other
    ``returned_layers`` (``extra``: the maps the FPN adds) would fail at the first forward, in
    torchvision's assertion on the anchors, so they need an anchor generator (keyword ``anchors``) of
    their own."""
    layers = tuple(int(stage[len("layer"):]) for stage in body.body.return_layers)
    maps = len(layers) + extra
    if maps != 5 and det_kwargs.get(anchors) is None:
        raise ValueError(f"{builder}(returned_layers={layers}) gives {maps} feature maps ({len(layers)} stages and "
                         f"{extra} extra level(s)), but torchvision's default anchor generator covers 5: give "
                         f"{anchors}=AnchorGenerator(sizes, aspect_ratios) with one entry per map")


def fasterrcnn(backbone: str = "resnet50", method: str = "orepa", num_classes: int = 91, *,
               fpn_channels: int = 256, **kwargs):
    """torchvision ``FasterRCNN`` with an FPN over a re-param ResNet (C2..C5 + max-pool P6).

    Backbone keywords (``weights``, ``trainable_layers``, ``train_stem``,
    ``norm``, ``returned_layers``; torchvision's ``weights_backbone`` and
    ``trainable_backbone_layers`` mean the first two) go to :func:`resnet_features`,
    ``fpn_norm_layer`` to :func:`fpn_backbone`, block options in
    ``backbone_options={...}``; everything else (``min_size``, ``max_size``,
    ``rpn_*``, ``box_*``, ...) to ``FasterRCNN``. A keyword none of them takes is
    refused (torchvision's transform would drop it silently).
    """
    from torchvision.models.detection import FasterRCNN

    bb_kwargs, det_kwargs = _split_backbone_kwargs(kwargs, FasterRCNN, "fasterrcnn")
    body = fpn_backbone(backbone, method, out_channels=fpn_channels, **bb_kwargs)
    _check_feature_maps(body, det_kwargs, 1, "fasterrcnn", "rpn_anchor_generator")  # + LastLevelMaxPool's "pool"
    if det_kwargs.get("box_predictor") is not None:
        num_classes = None  # torchvision: the predictor fixes the classes
    return FasterRCNN(body, num_classes=num_classes, **det_kwargs)


def retinanet(backbone: str = "resnet50", method: str = "orepa", num_classes: int = 91, *,
              fpn_channels: int = 256, **kwargs):
    """torchvision ``RetinaNet``: FPN on C3..C5 plus P6/P7 from P5 (``LastLevelP6P7``), as torchvision's v1.

    Keywords are split as in :func:`fasterrcnn`.
    """
    from torchvision.models.detection import RetinaNet
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    bb_kwargs, det_kwargs = _split_backbone_kwargs(kwargs, RetinaNet, "retinanet")
    bb_kwargs.setdefault("returned_layers", (2, 3, 4))
    body = fpn_backbone(backbone, method, out_channels=fpn_channels,
                        extra_blocks=LastLevelP6P7(fpn_channels, fpn_channels), **bb_kwargs)
    _check_feature_maps(body, det_kwargs, 2, "retinanet", "anchor_generator")  # + P6, P7
    return RetinaNet(body, num_classes=num_classes, **det_kwargs)


# --------------------------------------------------------------------------- segmenters


def _seg_features(backbone: str, method: str, output_stride: int, aux_loss: bool, low_level: bool, kwargs: dict):
    if output_stride not in (8, 16, 32):
        raise ValueError(f"output_stride must be 8, 16 or 32, got {output_stride}")
    dilation = {8: (False, True, True), 16: (False, False, True), 32: (False, False, False)}[output_stride]
    kwargs.setdefault("replace_stride_with_dilation", dilation)
    # torchvision's segmenters (and mmsegmentation's ResNet) fine-tune the whole backbone with batch
    # statistics, pretrained or not: resnet_features' defaults with weights are torchvision's detection ones
    kwargs.setdefault("trainable_layers", 5)
    kwargs.setdefault("norm", "train")
    layers, names = [4], ["out"]
    if aux_loss:
        layers, names = [3] + layers, ["aux"] + names
    if low_level:
        layers, names = [1] + layers, ["low"] + names
    return resnet_features(backbone, method, returned_layers=layers, output_names=names, **kwargs)


def _aux_head(features: ResNetFeatures, num_classes: int, aux_loss: bool):
    from torchvision.models.segmentation.fcn import FCNHead

    return FCNHead(features.channels["aux"], num_classes) if aux_loss else None


def deeplabv3(backbone: str = "resnet50", method: str = "orepa", num_classes: int = 21, *,
              aux_loss: bool = False, output_stride: int = 8, atrous_rates: Sequence[int] | None = None, **kwargs):
    """torchvision ``DeepLabV3`` (ASPP head on C5; dilated layer3/4 for output stride 8).

    ``kwargs`` go to :func:`resnet_features` (block options in ``backbone_options``).
    """
    from torchvision.models.segmentation.deeplabv3 import ASPP, DeepLabHead, DeepLabV3

    kwargs.update(kwargs.pop("backbone_options", None) or {})
    features = _seg_features(backbone, method, output_stride, aux_loss, False, kwargs)
    head = DeepLabHead(features.channels["out"], num_classes)
    if atrous_rates is not None:
        head[0] = ASPP(features.channels["out"], list(atrous_rates))
    return DeepLabV3(features, head, _aux_head(features, num_classes, aux_loss))


def fcn(backbone: str = "resnet50", method: str = "orepa", num_classes: int = 21, *,
        aux_loss: bool = False, output_stride: int = 8, **kwargs):
    """torchvision ``FCN`` (FCNHead on C5), dilated as torchvision's ``fcn_resnet50``."""
    from torchvision.models.segmentation.fcn import FCN, FCNHead

    kwargs.update(kwargs.pop("backbone_options", None) or {})
    features = _seg_features(backbone, method, output_stride, aux_loss, False, kwargs)
    return FCN(features, FCNHead(features.channels["out"], num_classes), _aux_head(features, num_classes, aux_loss))


def _conv_bn_relu(cin: int, cout: int, k: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class PSPHead(nn.Module):
    """Pyramid pooling head (Zhao et al.): average-pool to each of ``bins``, 1x1 conv-BN-ReLU to
    ``in_channels // 4``, upsample, concatenate with the input, 3x3 conv-BN-ReLU, dropout, classifier."""

    def __init__(self, in_channels: int, num_classes: int, bins: Sequence[int] = (1, 2, 3, 6),
                 channels: int = 512, dropout: float = 0.1):
        super().__init__()
        pool_channels = max(in_channels // 4, 1)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.AdaptiveAvgPool2d(b), *_conv_bn_relu(in_channels, pool_channels, 1)) for b in bins)
        self.bottleneck = _conv_bn_relu(in_channels + len(bins) * pool_channels, channels, 3)
        self.dropout = nn.Dropout2d(dropout)
        self.classifier = nn.Conv2d(channels, num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        size = x.shape[-2:]
        pyramid = [x] + [F.interpolate(s(x), size=size, mode="bilinear", align_corners=False) for s in self.stages]
        return self.classifier(self.dropout(self.bottleneck(torch.cat(pyramid, 1))))


class PSPNet(_SimpleSegmentationModel):
    """PSPNet: features ``{"out", ["aux"]}`` -> :class:`PSPHead`; outputs as torchvision's segmenters."""


class DeepLabV3PlusHead(nn.Module):
    """DeepLabV3+ decoder (Chen et al. 2018): ASPP on C5, 48-channel projection of C2, concat, two 3x3 convs."""

    def __init__(self, in_channels: int, low_channels: int, num_classes: int,
                 atrous_rates: Sequence[int] = (12, 24, 36), channels: int = 256, low_proj: int = 48):
        from torchvision.models.segmentation.deeplabv3 import ASPP

        super().__init__()
        self.aspp = ASPP(in_channels, list(atrous_rates), channels)
        self.low = _conv_bn_relu(low_channels, low_proj, 1)
        self.fuse = nn.Sequential(_conv_bn_relu(channels + low_proj, channels, 3), _conv_bn_relu(channels, channels, 3))
        self.classifier = nn.Conv2d(channels, num_classes, 1)

    def forward(self, x: Tensor, low: Tensor) -> Tensor:
        low = self.low(low)
        x = F.interpolate(self.aspp(x), size=low.shape[-2:], mode="bilinear", align_corners=False)
        return self.classifier(self.fuse(torch.cat([x, low], 1)))


class DeepLabV3Plus(nn.Module):
    """DeepLabV3+ = features ``{"low", ["aux"], "out"}`` + :class:`DeepLabV3PlusHead`; same outputs as torchvision's."""

    def __init__(self, backbone: nn.Module, classifier: DeepLabV3PlusHead, aux_classifier: nn.Module | None = None):
        super().__init__()
        self.backbone, self.classifier, self.aux_classifier = backbone, classifier, aux_classifier

    def forward(self, x: Tensor) -> Dict[str, Tensor]:  # noqa: UP006 - TorchScript
        size = x.shape[-2:]
        f = self.backbone(x)
        result = OrderedDict()
        result["out"] = F.interpolate(self.classifier(f["out"], f["low"]), size=size, mode="bilinear",
                                      align_corners=False)
        if self.aux_classifier is not None:
            result["aux"] = F.interpolate(self.aux_classifier(f["aux"]), size=size, mode="bilinear",
                                          align_corners=False)
        return result


def pspnet(backbone: str = "resnet50", method: str = "orepa", num_classes: int = 21, *,
           aux_loss: bool = False, output_stride: int = 8, bins: Sequence[int] = (1, 2, 3, 6), **kwargs):
    """PSPNet (pyramid pooling head on a dilated C5), as the paper's Cityscapes model."""
    kwargs.update(kwargs.pop("backbone_options", None) or {})
    features = _seg_features(backbone, method, output_stride, aux_loss, False, kwargs)
    return PSPNet(features, PSPHead(features.channels["out"], num_classes, bins),
                  _aux_head(features, num_classes, aux_loss))


def deeplabv3plus(backbone: str = "resnet50", method: str = "orepa", num_classes: int = 21, *,
                  aux_loss: bool = False, output_stride: int = 8, atrous_rates: Sequence[int] = (12, 24, 36),
                  **kwargs):
    """DeepLabV3+ (ASPP on dilated C5 + C2 decoder), as the paper's Cityscapes model."""
    kwargs.update(kwargs.pop("backbone_options", None) or {})
    features = _seg_features(backbone, method, output_stride, aux_loss, True, kwargs)
    head = DeepLabV3PlusHead(features.channels["out"], features.channels["low"], num_classes, atrous_rates)
    return DeepLabV3Plus(features, head, _aux_head(features, num_classes, aux_loss))


# --------------------------------------------------------------------------- optimizer groups


def _stem_prefixes(model: nn.Module) -> list[str]:
    """Qualified names of every ResNet stem (conv1, bn1 of a module that also has layer1)."""
    out = []
    for name, m in model.named_modules():
        if hasattr(m, "layer1") and hasattr(m, "conv1"):
            prefix = f"{name}." if name else ""
            out += [prefix + s + "." for s in _STEM_MODULES if hasattr(m, s)]
    return out


def param_groups(model: nn.Module, lr: float, weight_decay: float = 1e-4, *, stem_lr_mult: float = 0.1,
                 backbone_lr_mult: float = 1.0, norm_weight_decay: float = 0.0) -> list[dict]:
    """Optimizer parameter groups for a detector / segmenter (or any model with a ResNet trunk).

    * the ResNet stem (``conv1`` + ``bn1``, i.e. OREPA's linear deep stem) gets
      ``lr * stem_lr_mult`` (paper: not frozen, lr x0.1);
    * other parameters of a module holding ``layer1`` (the backbone body) get
      ``lr * backbone_lr_mult``;
    * norms (BN, GN, LN, ...), biases, OREPA branch scales and other 1-D parameters get
      ``norm_weight_decay`` (0 by default), everything else ``weight_decay``: the split of
      ``orepa train`` (:func:`orepa.apps.common.split_params`);
    * parameters with ``requires_grad=False`` (frozen stages) are left out.

    Returns a list of ``{"params", "lr", "weight_decay", "name"}`` dicts for
    ``torch.optim`` (empty groups dropped); ``group["name"]`` is e.g. ``"stem/no_decay"``.
    Refuses a model whose trainable packed parameters (``group_kernels(..., pack=True)``) hold
    the weights of blocks in parts of different learning rates: one tensor cannot take two.
    """
    decayed = {id(p) for p in split_params(model).decay}
    stems = _stem_prefixes(model)
    bodies = [p[: -len("conv1.")] for p in stems if p.endswith("conv1.")]

    def part_of(name: str) -> str:
        if any(name.startswith(s) for s in stems):
            return "stem"
        return "backbone" if any(name.startswith(b) for b in bodies) else "rest"

    names = {id(m): n + "." for n, m in model.named_modules()}
    mults = {"stem": stem_lr_mult, "backbone": backbone_lr_mult, "rest": 1.0}
    for group in kernel_groups(model):
        if group.packed is None or not any(p.requires_grad for p in group.packed.parameters()):
            continue  # its blocks' parameters are their own, or it trains nothing (frozen stages)
        # a group made over a larger module may also hold blocks outside this one
        parts = {part_of(names[id(b)]) if id(b) in names else "outside the model" for b in group.plan.blocks}
        if len({mults.get(part) for part in parts}) > 1:  # parts of one learning rate may share a tensor
            first = names.get(id(group.plan.blocks[0]), "a block outside the model: its ")
            raise ValueError(
                f"param_groups: packed parameters (group_kernels(..., pack=True)) hold the weights of online "
                f"blocks in several parts ({', '.join(sorted(parts))}; held by {first}packed_parameters), "
                f"which take different learning rates; build the parameter groups of an unpacked model "
                f"(orepa.engine.group_kernels(model, pack=False))")
    groups: dict[str, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        part = part_of(name)
        mult = mults[part]
        decay = id(p) in decayed
        key = f"{part}/{'decay' if decay else 'no_decay'}"
        g = groups.setdefault(key, {"params": [], "lr": lr * mult,
                                    "weight_decay": weight_decay if decay else norm_weight_decay, "name": key})
        g["params"].append(p)
    return list(groups.values())


# --------------------------------------------------------------------------- mmdetection / mmsegmentation


def register_mm_backbones() -> list[str]:
    """Register ``OREPAResNet`` in mmdetection / mmsegmentation (:mod:`orepa.apps.mm_backbone`)."""
    from .mm_backbone import register_mm_backbones as register

    return register()


# imported by an mm* config's custom_imports (mmengine reads the config; mm_backbone, when it is the
# module imported, registers itself once it is whole)
if any(pkg in sys.modules for pkg in ("mmengine", "mmdet", "mmseg")) and "orepa.apps.mm_backbone" not in sys.modules:
    register_mm_backbones()
