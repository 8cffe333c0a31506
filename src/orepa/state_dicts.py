"""Reading what other tools save: the file, where its state_dict (and its EMA) sits, and the key
prefixes their wrappers add.

One home for all of them, read by the library (:func:`orepa.models.reference.read_reference_state_dict`),
the commands' checkpoint loader (:func:`orepa.apps.checkpoint.load_checkpoint`) and the
backbones' weight loader (:func:`orepa.apps.detection.load_backbone_weights`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["EMA_KEYS", "SAFE_GLOBALS", "STATE_DICT_KEYS", "WRAPPER_PREFIXES", "find_state_dict", "is_state_dict",
           "load_weights_only", "strip_prefixes", "without_ema_counter", "wrapper_prefix"]

#: where tools keep the state_dict inside a checkpoint dict, first match taken (orepa's own and
#: DeiT's: "model"; the paper's training script, timm's, mmengine's: "state_dict")
STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "module")
#: where a checkpoint keeps the weights' moving average: orepa train --model-ema, timm's train.py
EMA_KEYS = ("model_ema", "state_dict_ema")
#: key prefixes of wrappers: DataParallel / DistributedDataParallel, torch.compile
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: the classes besides tensors and plain values that ``weights_only`` reading rebuilds: timm's and
#: torchvision's training scripts save their run settings as an argparse Namespace ("args"), which
#: holds values and runs no code when rebuilt; anything else in a file is still refused
SAFE_GLOBALS = (argparse.Namespace,)


def without_ema_counter(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An EMA's state_dict without ``n_averaged``, the step counter that torch's ``AveragedModel``
    keeps beside the averaged weights (torchvision's reference scripts save it whole)."""
    return {k: v for k, v in sd.items() if k != "n_averaged"}


def load_weights_only(path: str | os.PathLike, *, mmap: bool = False):
    """``torch.load(path, weights_only=True)`` onto the CPU, :data:`SAFE_GLOBALS` allowed (on torch
    without ``safe_globals``, before 2.5, a file holding one is refused as before)."""
    allow = getattr(torch.serialization, "safe_globals", None)
    # only those not allowed already: leaving the context removes what it added, a user's own too
    extra = [] if allow is None else [g for g in SAFE_GLOBALS if g not in torch.serialization.get_safe_globals()]
    with allow(extra) if extra else contextlib.nullcontext():
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def is_state_dict(obj) -> bool:
    """A non-empty mapping of tensors."""
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, Tensor) for v in obj.values())


def wrapper_prefix(key: str) -> str:
    """The wrapper prefixes ``key`` starts with, nested ones too: ``"module._orig_mod."`` for
    ``"module._orig_mod.conv1.weight"``; ``""`` for none."""
    rest = key
    while (found := next((p for p in WRAPPER_PREFIXES if rest.startswith(p)), None)) is not None:
        rest = rest[len(found):]
    return key[:len(key) - len(rest)]


def strip_prefixes(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` with every wrapper prefix removed from its keys (nested wrappers too)."""
    return {k[len(wrapper_prefix(k)):]: v for k, v in sd.items()}


def find_state_dict(obj) -> str | None:
    """The key of :data:`STATE_DICT_KEYS` under which ``obj`` (a checkpoint dict) holds its
    state_dict, else None."""
    if not isinstance(obj, Mapping):
        return None
    return next((k for k in STATE_DICT_KEYS if is_state_dict(obj.get(k))), None)
