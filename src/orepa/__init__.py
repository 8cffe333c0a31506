"""orepa: Online Convolutional Re-parameterization (CVPR 2022) for PyTorch.

Core library (depends on torch only):

* :mod:`orepa.kernels` - kernel algebra (squeezing rules, BN folding),
* :mod:`orepa.blocks`  - OREPA, Rep-1x1, deep stem, DBB, RepVGG, OREPA-VGG blocks,
* :mod:`orepa.engine`  - how online blocks build their kernels in training (closed-form squeeze,
  ``group_kernels(model)``: blocks of one signature built together, the GPU route),
* :mod:`orepa.convert` - ``convert(model)`` / ``reparameterize(model)`` for any CNN,
* :mod:`orepa.models`  - the model zoo: ``orepa.create_model(name, method)``, ``orepa.list_models()``,
  ``orepa.import_reference(path)`` for checkpoints trained with the paper's public code
  (also registered with timm, as soon as timm is imported: ``import orepa`` does not import it).

Every re-param block follows timm's re-parameterization protocol (``fuse()`` returns the
deployed module), so ``timm.utils.reparameterize_model`` deploys these models too.
"""
from . import engine, kernels
from .blocks import (
    BRANCH_TYPES,
    DEFAULT_SCALE_INIT,
    OREPA_BRANCHES,
    AbsorbedNorm,
    Branch,
    BranchType,
    Conv2dTFSame,
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
    register_branch,
)
from .convert import (
    METHODS,
    ConversionReport,
    convert,
    find_conv_bn_pairs,
    fuse_conv_bn,
    load_plain_state_dict,
    make_block,
    reparameterize,
)
from .engine import group_kernels
from .models import create_model, import_reference, list_methods, list_models  # noqa: E402 - after the core

__version__ = "0.1.0"

__all__ = [
    "kernels", "engine", "group_kernels", "BRANCH_TYPES", "BranchType", "register_branch", "Conv2dTFSame", "DEFAULT_SCALE_INIT", "OREPA_BRANCHES", "AbsorbedNorm", "Branch", "ConvStep", "DBBConv2d",
    "FixedKernelStep", "OREPAConv2d", "OREPADeepStem", "OREPAVGGBlock", "ReparamConv2d", "RepVGGBlock", "Scale",
    "build_branches", "check_conv_config", "METHODS", "ConversionReport", "convert", "find_conv_bn_pairs",
    "fuse_conv_bn", "load_plain_state_dict", "make_block", "reparameterize", "create_model", "list_models", "list_methods",
    "import_reference", "__version__",
]
