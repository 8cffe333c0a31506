"""orepa: Online Convolutional Re-parameterization (CVPR 2022) for PyTorch.

Core library (depends on torch only):

* :mod:`orepa.kernels` - kernel algebra (squeezing rules, BN folding),
* :mod:`orepa.blocks`  - OREPA, Rep-1x1, deep stem, DBB, RepVGG, OREPA-VGG blocks,
* :mod:`orepa.convert` - ``convert(model)`` / ``reparameterize(model)`` for any CNN.
"""
from . import kernels
from .blocks import (
    DEFAULT_SCALE_INIT,
    OREPA_BRANCHES,
    AbsorbedNorm,
    Branch,
    ConvStep,
    DBBConv2d,
    FixedKernelStep,
    OREPAConv2d,
    OREPADeepStem,
    OREPAVGGBlock,
    ReparamConv2d,
    RepVGGBlock,
    Scale,
    build_branches,
    check_conv_config,
)
from .convert import METHODS, ConversionReport, convert, find_conv_bn_pairs, fuse_conv_bn, make_block, reparameterize

__version__ = "0.1.0"

__all__ = [
    "kernels", "DEFAULT_SCALE_INIT", "OREPA_BRANCHES", "AbsorbedNorm", "Branch", "ConvStep", "DBBConv2d",
    "FixedKernelStep", "OREPAConv2d", "OREPADeepStem", "OREPAVGGBlock", "ReparamConv2d", "RepVGGBlock", "Scale",
    "build_branches", "check_conv_config", "METHODS", "ConversionReport", "convert", "find_conv_bn_pairs",
    "fuse_conv_bn", "make_block", "reparameterize", "__version__",
]
