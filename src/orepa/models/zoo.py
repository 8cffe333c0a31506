"""``create_model(name, method, ...)``: the paper's networks and every ablation variant, by name.

One mechanism: build the plain (base) network, then apply the method with
:func:`orepa.convert` (plus :class:`orepa.OREPADeepStem` in place of the 7x7
stem conv for OREPA). :func:`orepa.reparameterize` of any model built here
(``post_bn=False`` excepted) has the base model's layout, state_dict key for key.

Model families register themselves with :func:`register_family`: a family's file
(``resnet.py``, ``repvgg.py``) holds its plain architecture, its model names and how
each of its methods turns the plain network into the training form, so a new family
is one file. :func:`create_model`, :func:`list_models`, the timm names and the
reference-checkpoint importer read the registry.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..blocks import BRANCH_TYPES, OREPA_BRANCHES, ReparamConv2d, Scale, check_block_options, check_flags
from ..engine import group_kernels

__all__ = ["create_model", "list_models", "list_methods", "ABLATIONS", "model_family",
           "Family", "register_family", "family_of"]


@dataclass(frozen=True)
class Family:
    """A model family of the zoo.

    Attributes:
        name: the family's name (``"resnet"``).
        configs: model name -> the family's configuration of it (its keys are the model names).
        build: ``build(name, num_classes, in_chans, **common_options)`` -> the plain (base) model.
        methods: the methods ``create_model`` accepts; ``"base"`` is the plain model.
        default_method: the paper's model of the family (``create_model(name)``).
        common_options: options of every method (widths, stem, ...), passed to ``build``.
        method_options: method -> the further options it accepts, passed to ``apply_method``.
        apply_method: ``apply_method(plain_model, method, options, name)`` -> the training form.
        expand_options: ``expand_options(name, method, options)`` -> options (e.g. presets expanded).
        first_conv, classifier: module names (timm's pretrained-config fields).
    """

    name: str
    configs: Mapping[str, Any]
    build: Callable[..., nn.Module]
    methods: tuple[str, ...]
    default_method: str
    common_options: tuple[str, ...]
    method_options: Mapping[str, tuple[str, ...]]
    apply_method: Callable[[nn.Module, str, dict, str], nn.Module]
    first_conv: str
    classifier: str
    expand_options: Callable[[str, str, dict], dict] = field(default=lambda name, method, options: options)


_FAMILIES: dict[str, Family] = {}  # registration order is list_models()'s order


def register_family(family: Family) -> Family:
    """Add ``family`` to the zoo (its model names must be new)."""
    taken = {n for f in _FAMILIES.values() if f.name != family.name for n in f.configs} & set(family.configs)
    if taken:
        raise ValueError(f"model names {sorted(taken)} are already registered by another family")
    if "base" not in family.methods or family.default_method not in family.methods:
        raise ValueError(f"family {family.name!r}: methods must include 'base' and the default method")
    _FAMILIES[family.name] = family
    return family


def family_of(name: str) -> Family:
    for family in _FAMILIES.values():
        if name in family.configs:
            return family
    raise ValueError(f"unknown model {name!r}; choose from {list_models()}")


def model_family(name: str) -> str:
    return family_of(name).name


def list_models(method: str | None = None) -> list[str]:
    """Model names (in a fixed order); with ``method``, only those that support it."""
    return [n for f in _FAMILIES.values() if method is None or method in f.methods for n in f.configs]


def list_methods(name: str) -> list[str]:
    """The methods ``create_model(name, method)`` accepts."""
    return list(family_of(name).methods)


def _check_options(family: Family, method: str, options: Mapping[str, Any]) -> None:
    allowed = (*family.common_options, *family.method_options.get(method, ()))
    if "branches" in allowed:
        allowed = (*allowed, *branch_switches())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"option(s) {unknown} not accepted by {family.name} method {method!r}; "
                         f"accepted: {sorted(allowed)}")


# --------------------------------------------------------------------------- shared by the families

#: Named ablation presets (method "orepa"; the component rows also with "orepa-offline").
#: Each maps to create_model options; explicit options override a preset's.
ABLATIONS: dict[str, dict[str, Any]] = {
    # table "components" (cumulative rows; "Baseline" = method "base", "+ Offline DBB blocks" = method "dbb")
    "online-only": dict(table="components", row="+ Online (linearized DBB: kxk, 1x1, 1x1-avg, 1x1-kxk)",
                        options=dict(freq_prior=False, dw_sep=False, deep_stem=False, rep_1x1=False)),
    "freq-prior": dict(table="components", row="+ Frequency prior filter",
                       options=dict(freq_prior=True, dw_sep=False, deep_stem=False, rep_1x1=False)),
    "dw-sep": dict(table="components", row="+ Linear depthwise separable",
                   options=dict(freq_prior=True, dw_sep=True, deep_stem=False, rep_1x1=False)),
    "deep-stem": dict(table="components", row="+ Linear deep stem (= full OREPA-ResNet-18/34)",
                      options=dict(freq_prior=True, dw_sep=True, deep_stem=True, rep_1x1=False)),
    "rep-1x1": dict(table="components", row="+ Rep-1x1 (bottleneck nets only; = full OREPA-ResNet-50)",
                    options=dict(freq_prior=True, dw_sep=True, deep_stem=True, rep_1x1=True)),
    # table "linearization" (on the full model)
    "vector-scaling": dict(table="linearization", row="Vector scaling (the default)", options=dict(scaling="vector")),
    "scalar-scaling": dict(table="linearization", row="Scalar scaling", options=dict(scaling="scalar")),
    "no-scaling": dict(table="linearization", row="W/o scaling", options=dict(scaling="none")),
    "no-post-bn": dict(table="linearization", row="W/o post-addition norm (diverges; not vanilla-loadable)",
                       options=dict(post_bn=False)),
    # table "norm", DBB-18 column: DBB's branches with their norms removed, neither BN nor scaling,
    # only the post-addition norm (RepVGG-A0's row: create_model("repvgg_a0", "repvgg-online", scaling="none"))
    "no-branch-norm": dict(table="norm", row="W/o branch-wise norm (DBB's branches, post-addition norm only)",
                           options=dict(freq_prior=False, dw_sep=False, deep_stem=False, rep_1x1=False,
                                        scaling="none")),
}

#: options of the OREPA block declarations, shared by the families' OREPA methods; a method that takes
#: ``branches`` also takes the on/off switch of every registered branch type (``freq_prior``, ``dw_sep``)
BLOCK_OPTS = ("branches", "dw_expand", "internal_channels", "init")


def branch_switches() -> tuple[str, ...]:
    """The options that turn optional branches on and off (``orepa.blocks.BranchType.switch``)."""
    return tuple(t.switch for t in BRANCH_TYPES.values() if t.switch)


def branch_list(opts: Mapping[str, Any], base: Sequence[str] = OREPA_BRANCHES) -> tuple[str, ...]:
    """The branches ``opts`` asks for: ``branches=`` as given, else ``base`` less those whose switch is
    False, and with those whose switch is True that ``base`` lacks (a registered type beyond the
    paper's six), in their registration order."""
    switches = [k for k in branch_switches() if k in opts]
    if opts.get("branches") is not None:
        if switches:
            raise ValueError(f"pass either branches=... or {'/'.join(switches)}, not both")
        return tuple(opts["branches"])
    kept = [b for b in base if not BRANCH_TYPES[b].switch or opts.get(BRANCH_TYPES[b].switch, True)]
    added = [t.name for t in BRANCH_TYPES.values() if t.switch and opts.get(t.switch) is True and t.name not in base]
    return (*kept, *added)


def block_opts(opts: dict, *keys: str) -> dict:
    return {k: opts[k] for k in keys if opts.get(k) is not None}


#: create_model options that are on/off switches (so are the registered branch types' switches)
BOOL_OPTIONS = ("small_input", "zero_init_residual", "deep_stem", "rep_1x1", "post_bn", "inner_norm")


def _check_count(name: str, value, minimum: int, meaning: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{meaning}, got {value!r}")


def _check_model_args(num_classes, in_chans, options: Mapping[str, Any]) -> None:
    """create_model's argument checks. The block options are checked here too, once for the model:
    ``convert`` skips a conv whose block raises a ValueError, which would leave convs plain silently."""
    _check_count("num_classes", num_classes, 0, " (0: no classifier, the pooled features)")
    _check_count("in_chans", in_chans, 1)
    check_flags(options, (*BOOL_OPTIONS, *branch_switches()))
    if "width_mult" in options:
        w = options["width_mult"]
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise TypeError(f"width_mult must be a number, got {w!r} ({type(w).__name__})")
        if not (w > 0 and math.isfinite(w)):
            raise ValueError(f"width_mult must be a positive finite number, got {w!r}")
    check_block_options(**{k: options[k] for k in ("branches", "scaling", "scale_init", "dw_expand",
                                                   "internal_channels") if options.get(k) is not None})


def _check_scale_init_used(model: nn.Module, name: str, method: str, scale_init: Mapping[str, float]) -> None:
    """Every branch ``scale_init`` names must be a scaled branch of some block of the model."""
    scaled = {b for m in model.modules() if isinstance(m, ReparamConv2d)
              for b, br in m.branches.items() if isinstance(br[-1], Scale)}
    unused = sorted(set(scale_init) - scaled)
    if unused:
        raise ValueError(f"scale_init names branch(es) {unused} that no block of {name} ({method}) has; "
                         f"its scaled branches: {sorted(scaled)}")


def create_model(name: str, method: str | None = None, num_classes: int = 1000, in_chans: int = 3,
                 **options) -> nn.Module:
    """Build model ``name`` in training form for ``method``.

    Args:
        name: one of :func:`list_models`.
        method: ResNet family: ``base``, ``dbb``, ``orepa`` (default), ``orepa-offline``;
            RepVGG family: ``base``, ``repvgg``, ``orepa-vgg`` (default), ``repvgg-online``,
            ``orepa-vgg-offline``.
        num_classes: classifier outputs (0: no classifier, the pooled features).
        in_chans: input channels.
        options: ``small_input``, ``width_mult``, ``widths`` (the four stage widths) and ``stem_width``
            (all models; explicit widths override ``width_mult``); ``init`` (online blocks:
            ``"reference"``, the published scheme (default), or ``"torch"``, nn.Conv2d's default);
            OREPA components and ablations
            (``preset``, ``freq_prior``, ``dw_sep``, ``deep_stem``, ``rep_1x1``, ``scaling``,
            ``post_bn``, ``branches``, ``scale_init``, ``dw_expand``, ``internal_channels``,
            ``recompute`` (online blocks: ``"auto"``, True, False; a time/memory trade-off));
            see docs/models.md for which method takes which.
    Raises:
        ValueError: unknown name, method, option or preset (the message lists the valid ones); a bad
            value (``num_classes < 0``, ``in_chans < 1``, ``width_mult <= 0``, ``dw_expand=0``, ...).
        TypeError: an option of the wrong type (a switch such as ``freq_prior`` that is not a bool, ...).
    """
    family = family_of(name)
    method = family.default_method if method is None else method
    if method not in family.methods:
        raise ValueError(f"unknown method {method!r} for {name}; choose from {list(family.methods)}")
    options = dict(options)
    _check_options(family, method, options)
    options = family.expand_options(name, method, options)
    _check_options(family, method, options)
    _check_model_args(num_classes, in_chans, options)
    common = {k: options.pop(k) for k in family.common_options if k in options}
    model = family.build(name, num_classes, in_chans, **common)
    if method != "base":
        model = family.apply_method(model, method, options, name)
        if options.get("scale_init"):
            _check_scale_init_used(model, name, method, options["scale_init"])
        group_kernels(model)  # online blocks of one signature build their kernels together on GPUs
    model.orepa_config = dict(name=name, method=method, num_classes=num_classes, in_chans=in_chans,
                              **common, **options)
    return model
