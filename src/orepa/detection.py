"""Former location of :mod:`orepa.apps.detection` (kept so that existing imports and mmdetection /
mmsegmentation configs with ``custom_imports=dict(imports=["orepa.detection"])`` keep working).

Detection is an application (it imports torchvision), so it lives in ``orepa.apps``; this name
is the same module object, not a copy.
"""
import sys
import warnings

from .apps import detection as _detection

warnings.warn("orepa.detection moved to orepa.apps.detection", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _detection
if any(pkg in sys.modules for pkg in ("mmengine", "mmdet", "mmseg")):  # an mm* config's custom_imports, even
    _detection.register_mm_backbones()  # when orepa.apps.detection was imported (and so not run) before
