"""timm entry points for the model zoo (registered by :mod:`orepa.models` when timm is imported, before or after it).

Naming scheme: ``{method}_{name}`` with the method's dashes written as underscores::

    base_resnet18   dbb_resnet18   orepa_resnet50   orepa_offline_resnet50   orepa_wide_resnet18_2
    base_repvgg_a0  repvgg_repvgg_a0  orepa_vgg_repvgg_a0  repvgg_online_repvgg_a0  orepa_vgg_offline_repvgg_a0

so ``timm.create_model("orepa_resnet50", num_classes=10, in_chans=1, small_input=True)`` is
``orepa.models.create_model("resnet50", "orepa", num_classes=10, in_chans=1, small_input=True)``
(every create_model option passes through). ``features_only=True`` (with ``out_indices``)
works for every model: the ResNets give the stem and layer1..4 outputs (strides 2, 4, 8, 16, 32),
the RepVGGs stage0..4 (same strides; 1, 1, 2, 4, 8 with ``small_input``). No pretrained weights
are registered: ``pretrained=True`` raises.
"""
from __future__ import annotations

import sys

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from .zoo import create_model, family_of, list_methods, list_models

__all__ = ["register", "timm_name", "TIMM_NAMES"]

#: timm name -> (zoo name, method); filled by :func:`register`
TIMM_NAMES: dict[str, tuple[str, str]] = {}
default_cfgs: dict = {}  # read by timm's register_model (module attribute of the entry points)


def timm_name(name: str, method: str) -> str:
    """The timm model name of ``create_model(name, method)``."""
    return f"{method.replace('-', '_')}_{name}"


def _cfg(name: str) -> dict:
    family = family_of(name)
    return dict(
        url="", num_classes=1000, input_size=(3, 224, 224), pool_size=(7, 7), crop_pct=0.875,
        interpolation="bilinear", mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
        first_conv=family.first_conv, classifier=family.classifier,
    )


def _entry(variant: str, name: str, method: str):
    def build(**kwargs):
        return create_model(name, method, **kwargs)

    def entry(pretrained: bool = False, **kwargs):
        if pretrained:
            raise ValueError(f"no pretrained weights are registered for {variant}; train it or load a checkpoint")
        if kwargs.pop("global_pool", None) not in (None, "", "avg"):
            raise ValueError("orepa models support average pooling only")
        return build_model_with_cfg(build, variant, pretrained, **kwargs)

    entry.__name__ = entry.__qualname__ = variant
    entry.__module__ = __name__
    entry.__doc__ = f"orepa.models.create_model({name!r}, {method!r}, **kwargs)"
    return entry


def register() -> list[str]:
    """Register every (name, method) of the zoo with timm; returns the timm names. Idempotent: a
    second call registers only what is new (a family registered after ``orepa.models`` was imported)."""
    pairs = [(n, m) for n in list_models() for m in list_methods(n) if timm_name(n, m) not in TIMM_NAMES]
    if not pairs:
        return list(TIMM_NAMES)
    default_cfgs.update(generate_default_cfgs({timm_name(n, m): _cfg(n) for n, m in pairs}))
    mod = sys.modules[__name__]
    for n, m in pairs:
        variant = timm_name(n, m)
        fn = _entry(variant, n, m)
        setattr(mod, variant, fn)
        register_model(fn)
        TIMM_NAMES[variant] = (n, m)
    return list(TIMM_NAMES)


# imported before timm, this module's first lines imported it, before it could register: now it can
from . import _register_with_timm  # noqa: E402

_register_with_timm()
