"""Model zoo: the paper's networks and every ablation variant, by name.

    >>> import orepa.models
    >>> model = orepa.models.create_model("resnet50", method="orepa")          # train this
    >>> deployed = orepa.reparameterize(model.eval())                          # torchvision layout
    >>> orepa.models.list_models()

Pure torch (no torchvision). Importing this package registers the models with
timm when timm is installed (see :mod:`orepa.models.timm_registry`).
"""
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

try:  # timm is optional: register the entry points when it is importable
    from .timm_registry import register as _register_timm
except ImportError:  # timm not installed
    TIMM_REGISTERED: list[str] = []
else:
    try:
        TIMM_REGISTERED = _register_timm()
    except Exception as _exc:  # an incompatible timm must not break the zoo itself
        import warnings

        warnings.warn(f"orepa.models: timm registration failed ({type(_exc).__name__}: {_exc})", stacklevel=2)
        TIMM_REGISTERED = []
