"""The variants of one architecture that ``orepa bench`` compares.

A variant is ``METHOD[:key=value:...]``: ``base``, any method of the model zoo (``dbb``,
``orepa``, ``orepa-offline``; ``repvgg``, ``orepa-vgg``, ... for the RepVGG family) with
block options (``orepa:scaling=scalar``, ``orepa:preset=dw-sep``, ``orepa:branches=kxk/1x1``),
or a rung of the component ladder of table "components" / Fig. "budgets". One option is not the
network's but how it runs: ``builder=`` its own kernel builder (:func:`orepa.engine.group_kernels`,
e.g. ``orepa:builder=compiled``), so the builders are timed side by side in one process.

==============  ============================================================
``online``      online OREPA blocks with DBB's branches (kxk, 1x1, 1x1-avg, 1x1-kxk)
``+prior``      + 1x1 -> frequency prior filter
``+dw``         + linear depthwise separable (all six branches)
``+stem``       + linear deep stem (the 7x7 stem as stacked 3x3 OREPA blocks)
``+rep1x1``     + Rep-1x1 on the 1x1 convs (= full OREPA; bottleneck nets only)
``offline*``    the same rungs run offline with a BN after every conv (the prototype of
                Fig. "linearization"); the offline deep stem runs its three 3x3
                convs on the feature map.
==============  ============================================================

Zoo names are built by :func:`orepa.models.create_model` (the ladder through its
table-"components" presets), so a benchmark measures exactly the networks that
``orepa train`` trains. Other names (torchvision, timm) and factories are converted by
:func:`orepa.convert` as they are; the ladder needs a zoo model.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

import orepa
from orepa.apps.common import UserError, parse_key_values, parse_value
from orepa.apps.model_cfg import check_external_name, external_model, external_source, unknown_model
from orepa.models import create_model, list_methods, model_family

ModelSpec = str | Callable[[], nn.Module]

OFFLINE_PREFIX = "offline"
#: ladder rung -> the model zoo's preset of table "components" (online: method "orepa", offline: "orepa-offline")
LADDER: dict[str, str] = {"online": "online-only", "+prior": "freq-prior", "+dw": "dw-sep", "+stem": "deep-stem",
                          "+rep1x1": "rep-1x1"}


def in_zoo(model: ModelSpec) -> bool:
    """True when ``model`` is a name the model zoo builds (else: a factory, a torchvision or timm name)."""
    if callable(model):
        return False
    try:
        model_family(model)
    except ValueError:
        return False
    return True


def base_model(model: ModelSpec, num_classes: int = 1000, in_chans: int = 3, model_options: dict | None = None
               ) -> nn.Module:
    """The plain network: a factory's model, the zoo's ``base``, or a torchvision / timm one
    (``NAME`` or ``torchvision:NAME``, ``timm:NAME``; :func:`orepa.apps.model_cfg.external_model`)."""
    if callable(model):
        return model()
    if in_zoo(model):
        return create_model(model, method="base", num_classes=num_classes, in_chans=in_chans, **(model_options or {}))
    name = model if external_source(model) else f"torchvision:{model}"  # a bare name the zoo lacks is torchvision's
    if model_options:
        try:  # a name of nothing is said first, before what its options cannot do
            check_external_name(name)
        except UserError:
            if external_source(model) is not None:
                raise
            raise unknown_model(model) from None
        raise ValueError(f"model options {sorted(model_options)} need a model of the zoo; {model!r} is not one "
                         "(block options go into a variant: --methods orepa:KEY=VALUE)")
    return external_model(name, num_classes, in_chans)


def parse_options(items: Iterable[str], flag: str) -> dict:
    """``KEY=VALUE`` items as every subcommand reads them (:func:`orepa.apps.common.parse_key_values`:
    ``false`` is False, ``0.5`` a float, ...), plus bench's list spelling: a bare value with ``/`` is a
    tuple (``branches=kxk/1x1``), as ``:`` separates a variant's options and ``,`` variants."""
    return {k: tuple(parse_value(part) for part in v.split("/")) if isinstance(v, str) and "/" in v
            else tuple(v) if k == "branches" and isinstance(v, list) else v  # (branch names however written: a tuple)
            for k, v in parse_key_values(items, flag).items()}


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"orepa:scaling=scalar:branches=kxk/1x1"`` -> ``("orepa", {...})`` (values: :func:`parse_options`)."""
    name, *opts = spec.split(":")
    return name, parse_options(opts, f"--methods {spec}")


#: the variant options that say how it runs, not what it is (not block options): its kernel builder,
#: and the switches of engine.group_kernels (whether its groups pack their parameters, whether
#: they build as one autograd node, whether their builds are recorded as CUDA graphs)
BUILDER_OPTION, SWITCH_OPTIONS = "builder", ("pack", "joint", "graphs")


def split_run_options(spec: str, default: str) -> tuple[str, str, dict[str, bool]]:
    """``("orepa:builder=compiled:pack=false:scaling=scalar", "auto")`` -> ``("orepa:scaling=scalar",
    "compiled", {"pack": False})``: the network's spec, the kernel builder it runs with (``default``
    where it names none) and the :data:`SWITCH_OPTIONS` it names."""
    name, *opts = spec.split(":")
    builder, switches = default, {}
    kept = []
    for o in opts:
        key, sep, value = o.partition("=")
        if key in (BUILDER_OPTION, *SWITCH_OPTIONS) and not sep:
            raise ValueError(f"--methods {spec}: {key} expects {key}=VALUE")
        if key == BUILDER_OPTION:
            builder = value
        elif key in SWITCH_OPTIONS:
            switches[key] = parse_options([o], f"--methods {spec}")[key]
            if not isinstance(switches[key], bool):
                raise ValueError(f"{key}= takes true or false, got {value!r}")
        else:
            kept.append(o)
    return ":".join([name, *kept]), builder, switches


def offline_rung(rung: str) -> str:
    """``"+dw"`` -> ``"offline+dw"``, ``"online"`` -> ``"offline"``."""
    return OFFLINE_PREFIX + ("" if rung == "online" else rung)


def ladder_rung(name: str) -> tuple[str, str] | None:
    """``"offline+dw"`` -> ("orepa-offline", "+dw"), ``"online"`` -> ("orepa", "online"); None for other names."""
    if name in LADDER:
        return "orepa", name
    if name.startswith(OFFLINE_PREFIX):
        rung = name[len(OFFLINE_PREFIX):] or "online"
        if rung in LADDER and offline_rung(rung) == name:
            return "orepa-offline", rung
    return None


def known_variants() -> list[str]:
    return ["base", *orepa.METHODS, *LADDER, *(offline_rung(r) for r in LADDER)]


def build_variant(model: ModelSpec, spec: str, num_classes: int = 1000, in_chans: int = 3,
                  model_options: dict | None = None) -> nn.Module:
    """Build one benchmark variant (see the module docstring) in training mode.

    ``model_options`` (zoo only, e.g. ``width_mult``, ``small_input``) go to every variant.
    """
    name, options = parse_spec(spec)
    mopts = dict(model_options or {})
    if name == "base":
        if options:
            raise ValueError("base takes no options")
        return base_model(model, num_classes, in_chans, mopts).train()
    zoo = in_zoo(model)
    if mopts and not zoo:
        raise ValueError(f"model options {sorted(mopts)} need a model of the zoo; {model!r} is not one "
                         "(block options go into a variant: --methods orepa:KEY=VALUE)")
    # what the command sets itself, or the ladder's rung does, is no variant option: said, not a
    # keyword given twice deep in create_model
    taken = sorted(set(options) & ({"num_classes", "in_chans"} | set(mopts)
                                   | ({"preset"} if ladder_rung(name) is not None else set())))
    if taken:
        where = {k: "--model-option" if k in mopts else "--num-classes" if k == "num_classes" else
                 "the image channels (--model-option in_chans=N)" if k == "in_chans" else f"the rung {name!r}"
                 for k in taken}
        raise ValueError("; ".join(f"{k} is set by {where[k]}, not in the variant" for k in taken))
    rung = ladder_rung(name)
    if rung is not None:
        if not zoo:
            raise ValueError(f"the component ladder ({name!r}) needs a model of the zoo (orepa.models); "
                             f"{model!r} is not one")
        method, step = rung
        return create_model(model, method=method, num_classes=num_classes, in_chans=in_chans, preset=LADDER[step],
                            **mopts, **options).train()
    if zoo:
        if name not in list_methods(model):  # (the zoo's own message lists its methods, not the ladder's rungs)
            raise ValueError(f"unknown method {name!r} for {model}; choose from {list_methods(model)} or a rung of the "
                             f"component ladder: {[*LADDER, *(offline_rung(r) for r in LADDER)]}")
        return create_model(model, method=name, num_classes=num_classes, in_chans=in_chans, **mopts,
                            **options).train()
    if name not in orepa.METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {known_variants()}")
    return orepa.convert(base_model(model, num_classes, in_chans), name, **options).train()


def _has_large_stem(model: nn.Module) -> bool:
    """The first conv is a kxk (k >= 5) stem: what the linear deep stem replaces."""
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return conv is not None and conv.kernel_size[0] >= 5


def _has_rep_1x1_targets(model: nn.Module) -> bool:
    """1x1 convs outside shortcut projections (bottlenecks): what Rep-1x1 converts."""
    return any(type(m) is nn.Conv2d and m.kernel_size == (1, 1) and "downsample" not in name
               for name, m in model.named_modules())


def component_variants(model: str, num_classes: int = 1000, in_chans: int = 3,
                       model_options: dict | None = None) -> list[str]:
    """The ladder of Fig. "budgets" for a zoo model: base, dbb, then each rung online and offline.

    ``+stem`` needs the standard 7x7 stem (not ``small_input``), ``+rep1x1`` a bottleneck net;
    the ladder is cumulative, so it stops at the first rung the model does not have.
    """
    if not in_zoo(model):
        raise ValueError(f"the component ladder needs a model of the zoo (orepa.models); {model!r} is not one")
    if model_family(model) != "resnet":  # its references include DBB, whose blocks the VGG family lacks
        raise ValueError(f"the component ladder (table \"components\") is the paper's for ResNets; {model!r} is "
                         "not one (measure its variants with --methods)")
    net = base_model(model, num_classes, in_chans, model_options)
    rungs = ["online", "+prior", "+dw"]
    if _has_large_stem(net):
        rungs.append("+stem")
        if _has_rep_1x1_targets(net):
            rungs.append("+rep1x1")
    return ["base", "dbb", *rungs, *(offline_rung(r) for r in rungs)]
