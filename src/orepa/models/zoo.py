"""``create_model(name, method, ...)``: the paper's networks and every ablation variant.

One mechanism: build the plain (base) network, then apply the method with
:func:`orepa.convert` (plus :class:`orepa.OREPADeepStem` in place of the 7x7
stem conv for OREPA). :func:`orepa.reparameterize` of any model built here
(``post_bn=False`` excepted) has the base model's layout, state_dict key for key.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..blocks import OREPA_BRANCHES, OREPADeepStem, ReparamConv2d
from ..convert import convert, find_conv_bn_pairs
from .repvgg import REPVGG_CONFIGS, build_repvgg
from .resnet import RESNET_CONFIGS, Bottleneck, build_resnet

__all__ = ["create_model", "list_models", "list_methods", "ABLATIONS", "FAMILY_METHODS", "model_family"]

RESNET_METHODS: tuple[str, ...] = ("base", "dbb", "orepa", "orepa-offline")
REPVGG_METHODS: tuple[str, ...] = ("base", "repvgg", "orepa-vgg", "repvgg-online", "orepa-vgg-offline")
FAMILY_METHODS: dict[str, tuple[str, ...]] = {"resnet": RESNET_METHODS, "repvgg": REPVGG_METHODS}

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
}

_COMMON = {"resnet": ("small_input", "width_mult", "widths", "stem_width", "zero_init_residual"),
           "repvgg": ("small_input", "width_mult", "widths", "stem_width")}
_BLOCK_OPTS = ("branches", "freq_prior", "dw_sep", "dw_expand", "internal_channels", "init")
_METHOD_OPTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("resnet", "base"): (),
    ("resnet", "dbb"): ("internal_channels",),
    ("resnet", "orepa"): ("preset", *_BLOCK_OPTS, "deep_stem", "rep_1x1", "scaling", "scale_init", "post_bn",
                          "recompute"),
    ("resnet", "orepa-offline"): ("preset", *_BLOCK_OPTS, "deep_stem", "rep_1x1"),
    ("repvgg", "base"): (),
    ("repvgg", "repvgg"): (),
    ("repvgg", "orepa-vgg"): (*_BLOCK_OPTS, "scaling", "scale_init"),
    ("repvgg", "repvgg-online"): ("scaling", "scale_init", "init"),
    ("repvgg", "orepa-vgg-offline"): _BLOCK_OPTS,
}


def model_family(name: str) -> str:
    if name in RESNET_CONFIGS:
        return "resnet"
    if name in REPVGG_CONFIGS:
        return "repvgg"
    raise ValueError(f"unknown model {name!r}; choose from {list_models()}")


def list_models(method: str | None = None) -> list[str]:
    """Model names (in a fixed order); with ``method``, only those that support it."""
    names = [*RESNET_CONFIGS, *REPVGG_CONFIGS]
    if method is None:
        return names
    return [n for n in names if method in FAMILY_METHODS[model_family(n)]]


def list_methods(name: str) -> list[str]:
    """The methods ``create_model(name, method)`` accepts."""
    return list(FAMILY_METHODS[model_family(name)])


def _check_options(family: str, method: str, options: Mapping[str, Any]) -> None:
    allowed = (*_COMMON[family], *_METHOD_OPTS[(family, method)])
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"option(s) {unknown} not accepted by {family} method {method!r}; "
                         f"accepted: {sorted(allowed)}")


def _branch_list(freq_prior: bool, dw_sep: bool, branches, base=OREPA_BRANCHES) -> tuple[str, ...]:
    if branches is not None:
        return tuple(branches)
    return tuple(b for b in base if (b != "1x1_prior" or freq_prior) and (b != "dw_pw" or dw_sep))


def _block_opts(opts: dict, *keys: str) -> dict:
    return {k: opts[k] for k in keys if opts.get(k) is not None}


def _apply_preset(method: str, options: dict, bottleneck: bool) -> dict:
    preset = options.pop("preset", None)
    if preset is None:
        return options
    if preset not in ABLATIONS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(ABLATIONS)}")
    spec = ABLATIONS[preset]
    if method == "orepa-offline" and spec["table"] != "components":
        raise ValueError(f"preset {preset!r} is a linearization of the online block; "
                         f"method 'orepa-offline' supports the 'components' presets only")
    if preset == "rep-1x1" and not bottleneck:
        raise ValueError("preset 'rep-1x1' is for bottleneck ResNets (the paper has no such row for "
                         "ResNet-18); pass rep_1x1=True to convert the downsample 1x1 convs anyway")
    return {**spec["options"], **options}


def _resnet_method(model: nn.Module, method: str, opts: dict, bottleneck: bool) -> nn.Module:
    # the 7x7 stem conv stays plain unless the deep stem replaces it (as the reference code does for
    # k >= 7); the 3x3 stem of small_input models is converted like every other 3x3 conv
    big_stem = model.conv1.kernel_size[0] >= 7
    keep_stem = (lambda name, conv: name == "conv1") if big_stem else None
    if method == "dbb":
        return convert(model, "dbb", inplace=True, exclude=keep_stem, **_block_opts(opts, "internal_channels"))

    online = method == "orepa"
    scaling = opts.get("scaling", "vector")
    post_bn = opts.get("post_bn", True)
    if not post_bn and not online:
        raise ValueError("post_bn=False is only defined for method 'orepa'")
    if opts.get("branches") is not None and ("freq_prior" in opts or "dw_sep" in opts):
        raise ValueError("pass either branches=... or freq_prior/dw_sep, not both")
    branches = _branch_list(opts.get("freq_prior", True), opts.get("dw_sep", True), opts.get("branches"))
    rep_1x1 = opts.get("rep_1x1", bottleneck)
    deep_stem = opts.get("deep_stem", online)
    inner = dict(branches=branches, **_block_opts(opts, "dw_expand", "internal_channels", "init"))
    if online:
        inner.update(scaling=scaling, **_block_opts(opts, "scale_init", "recompute"))
    convert(model, method, inplace=True, exclude=keep_stem, rep_1x1=rep_1x1, **inner)
    if deep_stem and big_stem:
        c = model.conv1
        stem_inner = dict(inner)
        if not online:  # the stacked 3x3 kernels are linear (scaled), run on the feature map
            stem_inner.update(scaling="vector")
        model.conv1 = OREPADeepStem(c.in_channels, c.out_channels, c.kernel_size[0], c.stride[0],
                                    mode="online" if online else "offline", **stem_inner
                                    ).to(device=c.weight.device, dtype=c.weight.dtype)
    if not post_bn:
        for conv_name, bn_name in find_conv_bn_pairs(model)[0]:
            block = model.get_submodule(conv_name)
            if isinstance(block, ReparamConv2d) and block.mode == "online":
                parent, _, attr = bn_name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, nn.Identity())
    return model


def _identity_ok(name: str, conv: nn.Conv2d) -> bool:
    return conv.in_channels == conv.out_channels and conv.stride == (1, 1) and conv.groups == 1


def _repvgg_method(model: nn.Module, method: str, opts: dict) -> nn.Module:
    if method == "repvgg":
        return convert(model, "repvgg", inplace=True)
    if opts.get("branches") is not None and ("freq_prior" in opts or "dw_sep" in opts):
        raise ValueError("pass either branches=... or freq_prior/dw_sep, not both")
    fp, dw = opts.get("freq_prior", True), opts.get("dw_sep", True)
    extra = _block_opts(opts, "dw_expand", "internal_channels", "scaling", "scale_init", "init")
    if method == "orepa-vgg":
        # supp. table "ra0res": the 1x1 and identity branches stay explicit (with BN); the online
        # 3x3 block holds the 3x3 and the 1x1-3x3, 1x1-avg, 1x1-prior and dw-pw branches
        inner_base = tuple(b for b in OREPA_BRANCHES if b != "1x1")
        return convert(model, "orepa-vgg", inplace=True,
                       branches=_branch_list(fp, dw, opts.get("branches"), inner_base), **extra)
    if method == "repvgg-online":
        core, conv_method = ("kxk", "1x1"), "orepa"
    else:  # orepa-vgg-offline: every branch explicit, each with its BN
        core, conv_method = _branch_list(fp, dw, opts.get("branches")), "orepa-offline"
    core = tuple(b for b in core if b != "identity")
    # identity branch where shapes allow (in == out, stride 1): two passes of the one convert
    convert(model, conv_method, inplace=True, exclude=lambda n, c: not _identity_ok(n, c),
            branches=(*core, "identity"), **extra)
    return convert(model, conv_method, inplace=True, branches=core, **extra)


#: the method ``create_model`` uses when none is given: the paper's model of each family
DEFAULT_METHOD = {"resnet": "orepa", "repvgg": "orepa-vgg"}


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
        ValueError: unknown name, method, option or preset (the message lists the valid ones).
    """
    family = model_family(name)
    method = DEFAULT_METHOD[family] if method is None else method
    if method not in FAMILY_METHODS[family]:
        raise ValueError(f"unknown method {method!r} for {name}; choose from {list(FAMILY_METHODS[family])}")
    options = dict(options)
    _check_options(family, method, options)
    if family == "resnet":
        bottleneck = RESNET_CONFIGS[name][0] is Bottleneck
        options = _apply_preset(method, options, bottleneck)
        _check_options(family, method, options)
        common = {k: options.pop(k) for k in _COMMON[family] if k in options}
        model = build_resnet(name, num_classes, in_chans, **common)
        if method != "base":
            model = _resnet_method(model, method, options, bottleneck)
    else:
        common = {k: options.pop(k) for k in _COMMON[family] if k in options}
        model = build_repvgg(name, num_classes, in_chans, **common)
        if method != "base":
            model = _repvgg_method(model, method, options)
    model.orepa_config = dict(name=name, method=method, num_classes=num_classes, in_chans=in_chans,
                              **common, **options)
    return model
