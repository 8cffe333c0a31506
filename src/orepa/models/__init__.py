"""Model zoo: the paper's networks and every ablation variant, by name.

    >>> import orepa.models
    >>> model = orepa.models.create_model("resnet50", method="orepa")          # train this
    >>> deployed = orepa.reparameterize(model.eval())                          # torchvision layout
    >>> orepa.models.list_models()

Pure torch (no torchvision). The models are registered with timm as soon as timm is imported,
before or after this package (see :mod:`orepa.models.timm_registry`); importing this package does
not import timm (about 1.7 s, paid otherwise by every ``orepa`` command).
"""
import importlib.abc
import sys

from .reference import import_reference, read_reference_state_dict
from .repvgg import REPVGG_CONFIGS, ConvBNReLU, RepVGG, build_repvgg
from .resnet import RESNET_CONFIGS, BasicBlock, Bottleneck, ResNet, build_resnet
from .zoo import (
    ABLATIONS,
    Family,
    create_model,
    family_of,
    list_methods,
    list_models,
    model_family,
    register_family,
)

__all__ = [
    "create_model", "list_models", "list_methods", "model_family", "ABLATIONS",
    "Family", "register_family", "family_of",
    "import_reference", "read_reference_state_dict",
    "ResNet", "BasicBlock", "Bottleneck", "RESNET_CONFIGS", "build_resnet",
    "RepVGG", "ConvBNReLU", "REPVGG_CONFIGS", "build_repvgg", "TIMM_REGISTERED",
]

#: the timm names of the zoo, filled in place when timm is imported (see :func:`_register_with_timm`)
TIMM_REGISTERED: list[str] = []


def _register_with_timm() -> None:
    """Register the zoo with timm (imported by now); an incompatible timm must not break the zoo."""
    registry = sys.modules.get(f"{__name__}.timm_registry")
    if registry is not None and not hasattr(registry, "register"):
        return  # timm imported by the registry's own first lines (it was imported first): it registers at its end
    try:
        from .timm_registry import register

        TIMM_REGISTERED[:] = register()
    except Exception as exc:  # noqa: BLE001
        import warnings

        warnings.warn(f"orepa.models: timm registration failed ({type(exc).__name__}: {exc})", stacklevel=2)


class _AfterTimmImport(importlib.abc.MetaPathFinder):
    """Registers the zoo right after timm's own import has run, wherever that import happens: an
    import hook, since timm is optional and importing it here would cost every command its import
    time. Removes itself once it has fired. Known by its marker, not its class: a re-run of this
    module (reload, a cleared ``sys.modules``) makes a new class, and two hooks asking each other
    for timm's spec would recurse."""

    _orepa_after_timm = True

    def find_spec(self, fullname, path, target=None):
        if fullname != "timm":
            return None
        for finder in sys.meta_path:
            if getattr(finder, "_orepa_after_timm", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            loader.__dict__.pop("exec_module", None)  # this module only, should the loader be shared
            exec_module(module)
            _drop_hooks()
            _register_with_timm()

        # on this spec's own loader object (made for this import), which otherwise stays as it is
        # (its source for tracebacks, its resource reader)
        loader.exec_module = exec_then_register
        return spec


def _drop_hooks() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_orepa_after_timm", False)]


if "timm" in sys.modules:
    _register_with_timm()
else:
    _drop_hooks()  # one of an earlier run of this module
    sys.meta_path.insert(0, _AfterTimmImport())
