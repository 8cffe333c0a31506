"""``OREPAResNet``: the zoo's ResNets (any method) as a backbone of mmdetection 3.x / mmsegmentation 1.x.

Registered by :func:`register_mm_backbones`, which runs when this module is imported (a config's
``custom_imports``), and when :mod:`orepa.apps.detection` is first imported after mmengine. The
keywords are those of :func:`orepa.apps.detection.resnet_features`, plus the mm* ResNet's own
where they mean the same (``frozen_stages``, ``norm_eval``, ``norm_cfg``'s ``requires_grad``,
``init_cfg`` / ``pretrained`` checkpoints, and values of the others that change nothing); other
values of the mm ResNet's keywords are refused with what to write instead, unknown keywords with
the zoo's list of options. The defaults are each framework's own ResNet's: nothing frozen, BN
statistics frozen in mmdetection (``norm_eval=True``), trained in mmsegmentation.
"""
from __future__ import annotations

import inspect
import os
import pickle
import re
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from ..state_dicts import load_weights_only, strip_prefixes
from .detection import _unwrap, build_trunk, load_backbone_weights, resnet_features

__all__ = ["register_mm_backbones"]

#: resnet_features' own keywords; the other keywords are the zoo's block options
_FEATURE_KEYWORDS = frozenset(inspect.signature(resnet_features).parameters) - {"name", "method", "options"}

#: mm* ResNet keywords that have no counterpart here: the value that changes nothing (accepted and
#: dropped, as stock configs spell them out) and what to write instead of any other
_MM_ONLY = {
    "num_stages": (4, "the zoo's ResNets have 4 stages; choose the returned ones with out_indices"),
    "style": ("pytorch", "the zoo's bottlenecks stride in the 3x3 conv (style='pytorch'); 'caffe' is not built"),
    "with_cp": (False, "activation checkpointing is not supported"),
    "dcn": (None, "deformable convs are not supported"),
    "stage_with_dcn": ((False, False, False, False), "deformable convs are not supported"),
    "plugins": (None, "plugins are not supported"),
    "in_channels": (3, "the backbone takes 3-channel images"),
    "dilations": ((1, 1, 1, 1), "dilate with replace_stride_with_dilation=(layer2, layer3, layer4) booleans "
                                "(output stride 8: (False, True, True), as strides=(1, 2, 1, 1), "
                                "dilations=(1, 1, 2, 4) with contract_dilation=True)"),
    "strides": ((1, 2, 2, 2), "dilate with replace_stride_with_dilation=(layer2, layer3, layer4) booleans"),
    "avg_down": (False, "avg_down (ResNetV1d) is not built"),
    "conv_cfg": (None, "the convs are the zoo's (or its re-param blocks): conv_cfg is not supported"),
    "multi_grid": (None, "multi_grid is not supported"),
    "groups": (1, "a ResNeXt is chosen by name (resnext50_32x4d)"),
    "base_width": (None, "a ResNeXt is chosen by name (resnext50_32x4d)"),
    "returned_layers": (None, "choose the returned stages with out_indices (0..3 = C2..C5)"),
}


def register_mm_backbones() -> list[str]:
    """Register ``OREPAResNet`` in mmdetection's and mmsegmentation's ``MODELS`` where they import;
    returns the packages registered into. The registries are read, not searched: ``MODELS.get``
    would import all of ``mmdet.models`` / ``mmseg.models``, and an mmseg missing an optional
    dependency (ftfy) would then break every mmdetection config that imports orepa."""
    done = []
    for pkg, cls in (("mmdet", _MMDetBackbone), ("mmseg", _MMSegBackbone)):
        try:
            registry = __import__(f"{pkg}.registry", fromlist=["MODELS"]).MODELS
        except Exception:  # not installed, or an incompatible version
            continue
        if "OREPAResNet" not in registry.module_dict:
            registry.register_module(name="OREPAResNet", module=cls)
        done.append(pkg)
    return done


def _refuse(message: str) -> ValueError:
    return ValueError(f"OREPAResNet: {message}")


def _mm_keywords(name: str, kwargs: dict, norm_eval_default: bool) -> None:
    """The mm* ResNet keywords in ``kwargs`` in this backbone's (in place); refuses what has no
    counterpart. ``frozen_stages=k`` freezes the stem and layers 1..k (-1: nothing) =
    ``trainable_layers=4-k``; ``norm_eval`` = ``norm="eval"`` / ``"train"``; ``norm_cfg`` with
    ``requires_grad=False`` = ``norm="frozen"``."""
    depth = kwargs.pop("depth", None)
    named = re.search(r"resne(?:t|xt)(\d+)", name)
    if depth is not None and (named is None or depth != int(named.group(1))):
        raise _refuse(f"depth={depth!r} but name={name!r}: the network is chosen by name (resnet18 ... resnet152, "
                      "resnext50_32x4d, wide_resnet50_2, ...)")
    if kwargs.pop("contract_dilation", True) is False and any(kwargs.get("replace_stride_with_dilation") or ()):
        raise _refuse("contract_dilation=False: dilation is contracted here (the first block of a dilated stage "
                      "keeps the previous dilation, as contract_dilation=True)")
    width = round(64 * kwargs.get("width_mult", 1.0))
    for key in ("base_channels", "stem_channels"):
        if kwargs.pop(key, None) not in (None, width):
            raise _refuse(f"{key}: the widths follow width_mult ({key} = 64 * width_mult = {width} here)")
    for key, (neutral, instead) in _MM_ONLY.items():
        if key in kwargs:
            value = kwargs.pop(key)
            if value != neutral and not (isinstance(neutral, tuple) and tuple(value or ()) == neutral):
                raise _refuse(f"{key}={value!r}: {instead}")
    norm_cfg = kwargs.pop("norm_cfg", None)
    frozen_norm = False
    if norm_cfg is not None:
        kind = norm_cfg.get("type") if isinstance(norm_cfg, Mapping) else None
        if kind == "SyncBN":
            raise _refuse("norm_cfg=dict(type='SyncBN'): the backbone is built with BatchNorm2d; convert the "
                          "whole model instead (the Runner's sync_bn='torch', or "
                          "torch.nn.SyncBatchNorm.convert_sync_batchnorm), which keeps its blocks exact")
        if kind not in ("BN", "BN2d") or set(norm_cfg) - {"type", "requires_grad", "eps", "momentum"} \
                or norm_cfg.get("eps", 1e-5) != 1e-5 or norm_cfg.get("momentum", 0.1) != 0.1:
            raise _refuse(f"norm_cfg={norm_cfg!r}: the backbone's norms are BatchNorm2d (eps 1e-5, momentum 0.1); "
                          "choose their mode with norm_eval or norm='train' | 'eval' | 'frozen'")
        frozen_norm = norm_cfg.get("requires_grad", True) is False
    frozen_stages = kwargs.pop("frozen_stages", None)
    norm_eval = kwargs.pop("norm_eval", None)
    if frozen_stages is not None:
        if "trainable_layers" in kwargs:
            raise _refuse("give frozen_stages= or trainable_layers=, not both")
        if not (isinstance(frozen_stages, int) and -1 <= frozen_stages <= 4):
            raise _refuse(f"frozen_stages must be in [-1, 4] (mmdetection's meaning), got {frozen_stages!r}")
        kwargs["trainable_layers"] = 5 if frozen_stages == -1 else 4 - frozen_stages
    kwargs.setdefault("trainable_layers", 5)  # mm's default (frozen_stages=-1), with or without a checkpoint
    if "norm" in kwargs and (norm_eval is not None or frozen_norm):
        raise _refuse("give norm_eval= / norm_cfg=dict(requires_grad=False) or norm=, not both")
    norm_eval = norm_eval_default if norm_eval is None else norm_eval  # (mmseg's default: False)
    if frozen_norm:
        if not norm_eval:
            raise _refuse("norm_cfg=dict(requires_grad=False) with norm_eval=False (frozen affine, statistics "
                          "still updated) is not a mode of this backbone: give norm_eval=True too (norm='frozen'), "
                          "or norm='train' | 'eval'")
        kwargs["norm"] = "frozen"
    elif "norm" not in kwargs:
        kwargs["norm"] = "eval" if norm_eval else "train"


def _checkpoint(init_cfg, pretrained, weights) -> tuple[object, str | None]:
    """The checkpoint an mm* config names and the prefix of its keys to take: ``weights=``,
    ``pretrained=`` (mmsegmentation's ``EncoderDecoder(pretrained=...)`` hands it to the backbone)
    or ``init_cfg=dict(type="Pretrained", checkpoint=..., prefix=...)``. Any other ``init_cfg`` is
    refused: an init rule written for plain convs would overwrite the blocks' own initialisation,
    or the loaded weights."""
    prefix = None
    if init_cfg:
        if not (isinstance(init_cfg, Mapping) and init_cfg.get("type") == "Pretrained" and "checkpoint" in init_cfg
                and set(init_cfg) <= {"type", "checkpoint", "prefix", "map_location"}):
            raise _refuse(f"init_cfg={init_cfg!r} is not supported: the blocks keep the zoo's initialisation; "
                          "give a checkpoint as init_cfg=dict(type='Pretrained', checkpoint=..., prefix=...) "
                          "or weights=...")
        if pretrained is not None:
            raise _refuse("the checkpoint is given twice (pretrained= and init_cfg=); give one")
        pretrained, prefix = init_cfg["checkpoint"], init_cfg.get("prefix")
    if weights is not None and pretrained is not None:
        raise _refuse("the checkpoint is given twice (weights= and pretrained= / init_cfg=); give one")
    return (weights if weights is not None else pretrained), prefix


def _read(source, prefix: str | None, ema: bool):
    """What :func:`load_backbone_weights` takes: a URI read by mmengine's checkpoint loader, the
    keys under ``prefix`` (of the EMA weights with ``ema``) taken before any wrapper prefix is
    stripped."""
    if isinstance(source, str) and "://" in source:
        source = _fetch(source)
    if not prefix:
        return source
    sd = strip_prefixes(_unwrap(source, ema=ema)[0])  # (DDP's module., torch.compile's _orig_mod. first)
    prefix = prefix if prefix.endswith(".") else prefix + "."
    taken = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not taken:
        raise _refuse(f"no key of the checkpoint starts with prefix {prefix!r} (its keys begin "
                      f"{sorted({k.split('.')[0] + '.' for k in sd})[:5]})")
    return taken


def _fetch(uri: str):
    """A checkpoint named by a URI (``https://``, ``torchvision://``, ``open-mmlab://``, ... : the
    schemes of mmengine's checkpoint loader), read with ``weights_only``. mmengine's loaders fetch the
    file and call ``torch.load(f, map_location)``, which before torch 2.6 unpickles whatever the file
    holds (code too): for this call ``torch.load`` is orepa's reader (a fetched file: the checks and
    messages of every checkpoint path; a stream, e.g. from ceph: ``weights_only`` alone)."""
    from mmengine.runner import CheckpointLoader  # mm* installed: this config came from there

    from .checkpoint import _unpickling_error, read_checkpoint_file
    from .common import UserError

    real_load = torch.load

    def load(f, map_location=None, **_):
        torch.load = real_load  # what the readers below call
        try:
            return read_checkpoint_file(f) if isinstance(f, (str, os.PathLike)) else load_weights_only(f)
        except pickle.UnpicklingError as exc:  # (a stream; a path's reader says what is wrong itself)
            raise _unpickling_error(uri, exc) from None
        finally:
            torch.load = load

    torch.load = load
    try:
        return CheckpointLoader.load_checkpoint(uri, map_location="cpu")
    except UserError as exc:  # a ValueError, as a path's (detection._unwrap)
        raise ValueError(str(exc)) from None
    finally:
        torch.load = real_load


class _MMBackbone(nn.Module):
    """mm* backbone: a tuple of stage outputs (``out_indices`` 0..3 = C2..C5). A checkpoint named
    as mm names it (``init_cfg``, ``pretrained``) is read by :meth:`init_weights`, as mm's ResNet
    reads its ``init_cfg``: the Runner calls it before training; a model built to test or to infer
    (``init_detector``, ``Runner.test()``) does not read the ImageNet file, whose weights the
    detector's checkpoint replaces. ``weights=`` (this backbone's own keyword, as in
    :func:`~orepa.apps.detection.resnet_features`) is loaded when the backbone is built."""

    _NORM_EVAL = False  # the framework's own ResNet's default

    def __init__(self, name: str = "resnet50", method: str = "orepa", out_indices: Sequence[int] = (0, 1, 2, 3),
                 init_cfg=None, pretrained=None, weights=None, **kwargs):
        super().__init__()
        if not out_indices or not all(isinstance(i, int) and 0 <= i <= 3 for i in out_indices):
            raise _refuse(f"out_indices must be stages 0..3 (C2..C5), got {out_indices!r}")
        _mm_keywords(name, kwargs, self._NORM_EVAL)
        source, prefix = _checkpoint(init_cfg, pretrained, weights)
        self._ema = bool(kwargs.pop("ema", False))
        if self._ema and source is None:
            raise _refuse("ema=True takes a checkpoint's EMA weights: give the checkpoint too")
        self._build = (name, method, {k: v for k, v in kwargs.items() if k not in _FEATURE_KEYWORDS})
        returned = [i + 1 for i in out_indices]
        if weights is not None:
            self._pending = None
            self.features = resnet_features(name, method, returned_layers=returned, ema=self._ema,
                                            weights=_read(weights, None, self._ema), **kwargs)
            return
        self._pending = None if source is None else (source, prefix)
        with warnings.catch_warnings():
            if source is not None:  # the statistics and frozen stages get their weights in init_weights()
                warnings.filterwarnings("ignore", message=r"resnet_features\(.*weights=None", category=UserWarning)
            self.features = resnet_features(name, method, returned_layers=returned, **kwargs)

    def init_weights(self):
        """Load the checkpoint (once), in any form :func:`load_backbone_weights` accepts."""
        if self._pending is None:
            return
        source, prefix = self._pending
        name, method, options = self._build
        # into the whole classification network, the one every checkpoint form is matched against
        # (self.features stops at its last returned stage)
        trunk = build_trunk(name, method, **options)
        load_backbone_weights(trunk, _read(source, prefix, self._ema), name=name, method=method,
                              ema=self._ema and not prefix, **options)
        loaded = trunk.state_dict()
        self.features.load_state_dict({k: loaded[k] for k in self.features.state_dict()}, strict=True)
        self._pending = None

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(self.features(x).values())


class _MMDetBackbone(_MMBackbone):
    _NORM_EVAL = True  # mmdet's ResNet: norm_eval=True


class _MMSegBackbone(_MMBackbone):
    _NORM_EVAL = False  # mmseg's ResNet: norm_eval=False


register_mm_backbones()  # importing this module (custom_imports=dict(imports=["orepa.apps.mm_backbone"])) registers
