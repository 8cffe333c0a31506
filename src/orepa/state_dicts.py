"""Where a state_dict sits inside what other tools save, and the key prefixes their wrappers add.

One home for both, read by the library (:func:`orepa.models.reference.read_reference_state_dict`)
and by the commands' checkpoint loader (:func:`orepa.apps.checkpoint.load_checkpoint`).
"""
from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

__all__ = ["STATE_DICT_KEYS", "WRAPPER_PREFIXES", "find_state_dict", "is_state_dict", "strip_prefixes"]

#: where tools keep the state_dict inside a checkpoint dict (orepa's own: "model"; the paper's
#: training script, like torchvision's: "state_dict")
STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict")
#: key prefixes of wrappers: DataParallel / DistributedDataParallel, torch.compile
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def is_state_dict(obj) -> bool:
    """A non-empty mapping of tensors."""
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, Tensor) for v in obj.values())


def strip_prefixes(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` with every wrapper prefix removed from its keys (nested wrappers too)."""
    out = {}
    for k, v in sd.items():
        stripped = True
        while stripped:
            stripped = False
            for p in WRAPPER_PREFIXES:
                if k.startswith(p):
                    k, stripped = k[len(p):], True
        out[k] = v
    return out


def find_state_dict(obj) -> str | None:
    """The key of :data:`STATE_DICT_KEYS` under which ``obj`` (a checkpoint dict) holds its
    state_dict, else None."""
    if not isinstance(obj, Mapping):
        return None
    return next((k for k in STATE_DICT_KEYS if is_state_dict(obj.get(k))), None)
