"""Pieces shared by the subcommands.

* :class:`UserError`: a problem the user can fix (bad path, missing package,
  wrong checkpoint, bad value); ``orepa`` prints ``orepa CMD: error: MESSAGE`` on
  stderr (one line, no traceback) and exits with code 2 (:func:`fail`).
* argument types that reject bad numbers at parse time (:func:`positive_int`, ...),
  the flags every computing subcommand shares (:func:`add_run_arguments`) and the
  model flags (:func:`add_model_arguments`, one ``KEY=VALUE`` parser);
* model building from a plain ``model_cfg`` dict (what checkpoints store) with the
  model zoo (``orepa.models.create_model``), or from torchvision / timm with ``orepa.convert``;
* distributed setup (torchrun environment, nccl on GPUs, gloo on CPU);
* optimizer parameter groups implementing the paper's weight-decay rule;
* small measurements (parameter counts, peak memory).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import resource
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import orepa
from orepa.engine import PackedParameters, builds_together


class UserError(Exception):
    """An error with a message meant for the user (no traceback)."""


def fail(prog: str, exc: BaseException) -> int:
    """Print ``exc`` as one ``error:`` line on stderr; return exit code 2."""
    msg = str(exc).strip()
    if "\nOriginal Traceback" in msg:  # re-raised from a DataLoader worker: keep the original message
        last = msg.splitlines()[-1]
        head, sep, rest = last.partition(": ")
        msg = rest if sep and head.split(".")[-1] == type(exc).__name__ else last
    msg = " ".join(msg.split())
    print(f"orepa {prog}: error: {msg}", file=sys.stderr, flush=True)
    return 2


# --------------------------------------------------------------------------- argument types


def _number(kind, low: float, strict: bool, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > low if strict else value >= low) or value != value or value in (float("inf"),):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, 0, True, "a positive integer")
nonneg_int = _number(int, 0, False, "an integer >= 0")
positive_float = _number(float, 0.0, True, "a positive number")
nonneg_float = _number(float, 0.0, False, "a number >= 0")


def add_run_arguments(p: argparse.ArgumentParser, *, seed: bool = True) -> None:
    """``--device``, ``--threads`` (and ``--seed``): every subcommand that computes takes them."""
    g = p.add_argument_group("run")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available); under "
                                                  "torchrun each process takes cuda:LOCAL_RANK")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: torch's choice, usually one per core)")
    if seed:
        g.add_argument("--seed", type=nonneg_int, default=0, help="random seed (0)")


def add_kernel_builder_argument(g, default: str | None = "auto") -> None:
    """``--kernel-builder``: how online blocks build their kernels (:func:`orepa.engine.group_kernels`);
    ``default=None``: the command picks with :func:`default_kernel_builder`."""
    from orepa.engine import POLICIES

    g.add_argument("--kernel-builder", choices=POLICIES, default=default,
                   help="how online blocks build their kernels in training: auto (blocks of one signature together "
                        "on CUDA, where launches cost more than FLOPs; each block its own FLOP-chosen route on a "
                        "CPU), grouped (together on any device), per-block (never together: less peak memory), "
                        "compiled (grouped, the groups' construction compiled by inductor at the first step: "
                        "fewer launches for eager GPU steps). Default: "
                        + ("compiled on a CUDA device where Triton is installed (not with --compile), else auto"
                           if default is None else default))


def default_kernel_builder(device: torch.device, whole_step_compiled: bool = False) -> tuple[str, str | None]:
    """The kernel builder when none is named, and why it is not the compiled one where that would
    be the pick: ``("compiled", None)`` on a CUDA device, measured faster there than the eager
    groups in every step mode (docs/benchmarks.md, H100: ResNet-18 b64 eager 1.61x against 1.85x
    base, with CUDA graphs 1.17x against 1.24x; ResNet-50 b64 eager 1.34x against 1.50x) for a
    compilation of about a minute at the first step; ``"auto"`` on a CPU, where the per-block
    routes chosen by FLOPs are faster at small batches (ResNet-18 b2: 2.87x against 3.92x) and no
    slower at larger ones, and under ``--compile``, whose trace runs every block's own route."""
    if device.type != "cuda" or whole_step_compiled:
        return "auto", None
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "auto", "Triton is not installed, so inductor cannot compile the constructions for CUDA"
    return "compiled", None


def add_pack_argument(g) -> None:
    """``--pack-parameters``: pack each kernel group's parameters (:func:`default_pack`)."""
    g.add_argument("--pack-parameters", action=argparse.BooleanOptionalAction, default=None,
                   help="hold each group of online blocks' learnable operands as a few parameters, one per kind and row "
                        "shape (exact: "
                        "the same arithmetic, state_dict keys and checkpoints): autograd, the optimizer and "
                        "zero_grad pay per parameter tensor, and the online blocks of ResNet-18 hold 249 more "
                        "than its convs. Default: on where the kernel builder builds groups (a CUDA device, or "
                        "--kernel-builder grouped/compiled), not under --compile")


def default_pack(kernel_builder: str, device: torch.device, whole_step_compiled: bool = False) -> bool:
    """Whether to pack when not told: where the groups build the kernels (a whole-step ``torch.compile``
    traces every block's own route instead, which would read packed rows through views)."""
    return builds_together(kernel_builder, device) and not whole_step_compiled


def add_tf32_matmul_argument(g, default: bool | None) -> None:
    """``--tf32-matmul``: TF32 tensor cores for float32 matrix products on CUDA (:func:`apply_tf32_matmul`);
    ``default=None``: on for CUDA devices."""
    g.add_argument("--tf32-matmul", action=argparse.BooleanOptionalAction, default=default,
                   help="CUDA: float32 matrix products on TF32 tensor cores, as PyTorch already runs cuDNN "
                        "convolutions; an online block's kernel construction is matrix products (ResNet-18 at "
                        "batch 64 on an H100: ~1 ms of a 16 ms step in full float32). Default: "
                        + ("on for a CUDA device" if default is None else "on" if default else "off, PyTorch's "
                           "default"))


def apply_tf32_matmul(enabled: bool | None, device: torch.device) -> bool:
    """Set float32 matrix products to TF32 (``enabled``; None: on for a CUDA device) for this
    process; cuDNN convolutions keep PyTorch's setting (TF32). Returns the setting. Comparisons
    of deployed and trained forms run under :func:`full_float32` whatever this says."""
    on = device.type == "cuda" if enabled is None else bool(enabled)
    torch.backends.cuda.matmul.allow_tf32 = on
    return on


# --------------------------------------------------------------------------- model building

#: model_cfg keys and their defaults; ``options`` holds the zoo's block options
MODEL_CFG_KEYS = ("model", "method", "num_classes", "in_chans", "small_input", "width_mult", "options")


def parse_value(text: str):
    """``KEY=VALUE`` values: Python/JSON literals (``0.5``, ``true``, ``[\"kxk\", \"1x1\"]``) or a bare string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):  # e.g. {[1]: 2}: not a literal
        pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_key_values(items: Iterable[str] | None, flag: str = "--model-option") -> dict:
    """The one ``KEY=VALUE`` parser: values as :func:`parse_value` reads them, ``-`` in keys -> ``_``."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{flag} expects KEY=VALUE, got {item!r}")
        value = parse_value(value)
        out[key.strip().replace("-", "_")] = list(value) if isinstance(value, tuple) else value
    return out



DEFAULT_MODEL, DEFAULT_METHOD = "resnet18", "orepa"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model flags. Unset ones (None) come from the checkpoint being resumed/evaluated, else the defaults."""
    g = p.add_argument_group("model (orepa.models.create_model)")
    g.add_argument("-m", "--model", default=None,
                   help=f"architecture: a zoo name (orepa.models.list_models()), or torchvision:NAME / timm:NAME, "
                        f"any network of those libraries turned into --method by orepa.convert; default {DEFAULT_MODEL}")
    g.add_argument("--method", default=None,
                   help="re-param method: base, orepa, orepa-offline, dbb (ResNets); base, repvgg, orepa-vgg, ... "
                        f"(RepVGG); default {DEFAULT_METHOD}")
    g.add_argument("--width-mult", type=positive_float, default=None,
                   help="multiply every stage width (default 1.0; the Fashion-MNIST default model uses 1.0 too)")
    g.add_argument("--small-input", dest="small_input", action="store_true", default=None,
                   help="CIFAR-style stem (3x3 stride-1 conv, no max-pool); default: on for Fashion-MNIST")
    g.add_argument("--no-small-input", dest="small_input", action="store_false")
    g.add_argument("--num-classes", type=positive_int, default=None, help="default: the dataset's")
    g.add_argument("--in-chans", type=positive_int, default=None,
                   help="default: the dataset's (1 for Fashion-MNIST)")
    # block options of the model zoo (passed as create_model(**options) only when given)
    g.add_argument("--branches", default=None,
                   help="comma-separated OREPA branches, e.g. kxk,1x1,1x1_avg (table 'components' ablations)")
    g.add_argument("--scaling", choices=["vector", "scalar", "none"], default=None,
                   help="branch scaling layers (table 'linearization')")
    g.add_argument("--preset", default=None,
                   help="an ablation preset of the zoo (orepa.models.ABLATIONS), e.g. online-only, freq-prior, "
                        "dw-sep, scalar-scaling, no-scaling, no-post-bn")
    for t in orepa.BRANCH_TYPES.values():  # each optional branch type's switch (--freq-prior, --dw-sep, ...)
        if t.switch:
            flag = t.switch.replace("_", "-")
            g.add_argument(f"--{flag}", dest=t.switch, action="store_true", default=None, help=f"{t.help} branch on")
            g.add_argument(f"--no-{flag}", dest=t.switch, action="store_false")
    g.add_argument("--no-post-bn", dest="post_bn", action="store_false", default=None,
                   help="drop the post-addition BN (table 'linearization': diverges)")
    g.add_argument("--deep-stem", dest="deep_stem", action="store_true", default=None, help="linear deep stem on")
    g.add_argument("--no-deep-stem", dest="deep_stem", action="store_false", help="linear deep stem off")
    g.add_argument("--rep-1x1", dest="rep_1x1", action="store_true", default=None, help="Rep-1x1 on bottleneck 1x1s")
    g.add_argument("--no-rep-1x1", dest="rep_1x1", action="store_false")
    g.add_argument("--model-option", "--block-opt", "--option", dest="model_option", action="append", default=[],
                   metavar="KEY=VALUE", help="any other create_model option (repeatable), e.g. --model-option "
                                             "post_bn=false (--block-opt, --option: older spellings)")
    g.add_argument("--model-kwarg", dest="model_kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword of a torchvision:NAME / timm:NAME network's constructor (repeatable), e.g. "
                        "--model-kwarg drop_path_rate=0.1")


#: block-option flags copied into create_model(**options) when given (and every branch switch)
BLOCK_FLAGS = ("preset", "scaling", "post_bn", "deep_stem", "rep_1x1")


def block_options_from_args(args: argparse.Namespace) -> dict:
    opts = {}
    if getattr(args, "branches", None):
        opts["branches"] = [b.strip() for b in args.branches.split(",") if b.strip()]
    from orepa.models.zoo import branch_switches

    for key in (*BLOCK_FLAGS, *branch_switches()):
        if getattr(args, key, None) is not None:
            opts[key] = getattr(args, key)
    opts.update(parse_key_values(getattr(args, "model_option", None)))
    kwargs = parse_key_values(getattr(args, "model_kwarg", None), "--model-kwarg")
    if kwargs:
        opts[MODEL_KWARGS] = kwargs
    return opts


def check_model_fits_data(cfg: dict, data, source) -> None:
    """A model of ``cfg`` (from checkpoint ``source``) can run on ``data``: its input channels, and
    at least as many classes. A :class:`UserError` otherwise (eval, train resuming a run or starting
    from a checkpoint's weights), instead of a shape error at the first batch."""
    if cfg["in_chans"] != data.in_chans:
        raise UserError(f"{source} takes {cfg['in_chans']}-channel images but {data.name} has "
                        f"{data.in_chans} channel(s); pass the --data-path it was trained on")
    if cfg["num_classes"] < data.num_classes:
        raise UserError(f"{source} predicts {cfg['num_classes']} classes but {data.name} has "
                        f"{data.num_classes}; pass the --data-path it was trained on, or fine-tune it on these "
                        "classes in a new run (orepa train --init-from CHECKPOINT makes a new classifier)")


def model_cfg_from_args(args: argparse.Namespace, *, num_classes: int, in_chans: int, small_input: bool,
                        saved: dict | None = None) -> dict:
    """The model_cfg: flags given on the command line, else ``saved`` (a checkpoint's), else defaults."""
    saved = saved or {}
    model = args.model if getattr(args, "model", None) is not None else saved.get("model", DEFAULT_MODEL)
    # the data's small_input default is the zoo's stem switch: another library's network keeps its own stem
    small_input = small_input and not (isinstance(model, str) and external_source(model))
    defaults = {"model": DEFAULT_MODEL, "method": DEFAULT_METHOD, "num_classes": num_classes, "in_chans": in_chans,
                "small_input": small_input, "width_mult": 1.0}
    cfg = {}
    for key, default in defaults.items():
        value = getattr(args, key, None)
        cfg[key] = value if value is not None else saved.get(key, default)
    options = block_options_from_args(args)
    for key in defaults:  # e.g. --model-option width_mult=0.5: a model_cfg key, not a block option
        if key in options:
            if getattr(args, key, None) is not None:
                raise UserError(f"{key} is given twice: --{key.replace('_', '-')} and --model-option {key}=")
            cfg[key] = options.pop(key)
    cfg["options"] = options if options else dict(saved.get("options", {}))
    return checked_cfg(cfg)


def checked_cfg(cfg: dict) -> dict:
    """``cfg`` with its fields as their types (from a flag, ``--model-option`` or a checkpoint)."""
    for key in MODEL_CFG_KEYS:
        cfg[key] = check_cfg_value(key, cfg[key])
    return cfg


def check_cfg_value(key: str, value):
    """One model_cfg field as its type; a value that is not one (``width_mult=abc``,
    ``small_input=maybe``) is a :class:`UserError` naming it."""
    def bad(what: str):
        return UserError(f"model setting {key}={value!r} is not {what}")

    if key in ("num_classes", "in_chans"):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise bad("a positive integer")
        try:
            number = int(value)
        except ValueError:
            raise bad("a positive integer") from None
        if number <= 0 or number != float(value):
            raise bad("a positive integer")
        return number
    if key == "width_mult":
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad("a positive number") from None
        if isinstance(value, bool) or not 0 < number < float("inf"):
            raise bad("a positive number")
        return number
    if key == "small_input" and not isinstance(value, bool):
        raise bad("true or false")
    if key in ("model", "method") and not isinstance(value, str):
        raise bad("a name")
    if key == "options" and not isinstance(value, dict):
        raise bad("a mapping of block options")
    return value


def model_flags_given(args: argparse.Namespace) -> bool:
    """Whether any model flag was given (else a checkpoint's model_cfg is used as it is)."""
    return any(getattr(args, k, None) is not None for k in MODEL_CFG_KEYS[:-1]) or bool(block_options_from_args(args))


def describe_cfg(cfg: dict) -> str:
    extra = "".join(f", {k}={v}" for k, v in sorted(cfg.get("options", {}).items()))
    return (f"{cfg['model']}/{cfg['method']} (width x{cfg['width_mult']:g}, {cfg['in_chans']} input channel(s), "
            f"{cfg['num_classes']} classes, small_input={cfg['small_input']}{extra})")


#: model name prefixes of networks from other libraries: ``torchvision:NAME``, ``timm:NAME``
EXTERNAL_SOURCES = ("torchvision", "timm")
#: the ``options`` entry that holds such a network's constructor keywords (``--model-kwarg``); the
#: other options are the blocks' (``orepa.convert``)
MODEL_KWARGS = "model_kwargs"


def external_source(name: str) -> str | None:
    """``"timm"`` for ``"timm:resnet26d"``; None for a zoo name."""
    source, sep, _ = name.partition(":")
    return source if sep else None


def model_slug(name: str) -> str:
    """``name`` as a file name's part: ``timm:resnet26d`` -> ``timm-resnet26d``."""
    return name.replace(":", "-")


def external_model(name: str, num_classes: int, in_chans: int = 3, **kwargs) -> nn.Module:
    """The plain network ``torchvision:NAME`` or ``timm:NAME``, randomly initialised (no weights
    are fetched; ``kwargs`` go to its constructor). timm makes ``in_chans`` itself; in a torchvision
    model the first conv that takes 3 channels is replaced by one that takes ``in_chans`` (same
    geometry, initialised afresh)."""
    source, _, arch = name.partition(":")
    if source not in EXTERNAL_SOURCES or not arch:
        raise _unknown_model(name)
    try:
        if source == "timm":
            import timm

            if not timm.is_model(arch):  # timm's own error for a name it lacks is a bare RuntimeError
                raise ValueError(f"timm has no model {arch!r} (timm.list_models())")
            return timm.create_model(arch, pretrained=False, num_classes=num_classes, in_chans=in_chans, **kwargs)
        import torchvision

        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
    except ImportError as exc:
        raise UserError(f"model {name!r} needs the package {exc.name or source} (pip install {source})") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"cannot build model {name!r}: {exc}") from None
    if in_chans != 3:
        _adapt_input_conv(model, in_chans, name)
    return model


def _adapt_input_conv(model: nn.Module, in_chans: int, name: str) -> None:
    first = next(((n, m) for n, m in model.named_modules() if type(m) is nn.Conv2d), None)
    if first is None or first[1].in_channels != 3 or first[1].groups != 1:
        raise UserError(f"model {name!r}: no first 3-channel convolution to give {in_chans} input channel(s)")
    n, c = first
    new = nn.Conv2d(in_chans, c.out_channels, c.kernel_size, c.stride, c.padding, c.dilation, 1, c.bias is not None,
                    c.padding_mode)
    parent, _, attr = n.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def _unknown_model(name: str) -> UserError:
    return UserError(f"unknown model {name!r}; choose from {', '.join(_zoo().list_models())}, or "
                     f"{' / '.join(s + ':NAME' for s in EXTERNAL_SOURCES)} for a network of those libraries")


def _zoo():
    from orepa import models

    return models


def build_model(cfg: dict) -> nn.Module:
    """The training-form model described by ``cfg`` (see :data:`MODEL_CFG_KEYS`): from the zoo, or a
    torchvision / timm network (:func:`external_model`) turned into ``method`` by :func:`orepa.convert`
    with the block options of ``cfg["options"]``."""
    zoo = _zoo()
    if external_source(cfg["model"]) is not None:
        zoo_only = [f"{k}={cfg[k]}" for k, plain in (("width_mult", 1.0), ("small_input", False)) if cfg[k] != plain]
        if zoo_only:
            raise UserError(f"{', '.join(zoo_only)}: options of the zoo's models, not of {cfg['model']}")
        options = dict(cfg["options"])
        kwargs = options.pop(MODEL_KWARGS, {})
        if not isinstance(kwargs, dict):
            raise UserError(f"{MODEL_KWARGS} must be a mapping of constructor keywords, got {kwargs!r}")
        model = external_model(cfg["model"], cfg["num_classes"], cfg["in_chans"], **kwargs)
        if cfg["method"] == "base":
            if options:
                raise UserError(f"block options {sorted(options)} need a re-param method, not base")
            return model
        if cfg["method"] not in orepa.METHODS:
            raise UserError(f"unknown method {cfg['method']!r} for {cfg['model']}; choose from base, "
                            f"{', '.join(sorted(orepa.METHODS))}")
        try:
            return orepa.convert(model, cfg["method"], inplace=True, **options)
        except (ValueError, TypeError) as exc:
            raise UserError(f"cannot build {describe_cfg(cfg)}: {exc}") from None
    if cfg["model"] not in zoo.list_models():
        raise _unknown_model(cfg["model"])
    if MODEL_KWARGS in cfg.get("options", {}):
        raise UserError(f"--model-kwarg passes keywords to a torchvision:NAME / timm:NAME network's constructor; "
                        f"{cfg['model']} is a zoo model (its options: --model-option KEY=VALUE)")
    try:
        return zoo.create_model(cfg["model"], method=cfg["method"], num_classes=cfg["num_classes"],
                                in_chans=cfg["in_chans"], small_input=cfg["small_input"],
                                width_mult=cfg["width_mult"], **cfg.get("options", {}))
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"cannot build {describe_cfg(cfg)}: {exc}") from None


def model_cfg_of(model: nn.Module) -> dict:
    """The model_cfg that :func:`build_model` turns back into ``model`` (a zoo model: its ``orepa_config``)."""
    oc = dict(model.orepa_config)
    cfg = {"model": oc.pop("name"), "method": oc.pop("method"), "num_classes": oc.pop("num_classes"),
           "in_chans": oc.pop("in_chans"), "small_input": bool(oc.pop("small_input", False)),
           "width_mult": float(oc.pop("width_mult", 1.0))}
    cfg["options"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in oc.items()}
    return cfg


#: deployed forms: "deploy" = vanilla layout (BNs kept), "deploy-fused" = BNs folded into the convs
FORMS = ("train", "deploy", "deploy-fused")


def deploy(model: nn.Module, form: str) -> nn.Module:
    """The ``form`` of a training-form model (a copy; ``train`` returns the model itself)."""
    if form == "train":
        return model
    was = model.training
    model.eval()
    out = orepa.reparameterize(model, fuse_bn=(form == "deploy-fused"))
    model.train(was)
    return out.eval()


def build_model_form(cfg: dict, form: str) -> nn.Module:
    """An (untrained) model with the module layout of ``form``, ready for ``load_state_dict``."""
    if form not in FORMS:
        raise UserError(f"unknown model form {form!r}; expected one of {FORMS}")
    return deploy(build_model(cfg), form)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- weight decay


@dataclass
class ParamGroups:
    decay: list
    no_decay: list
    scales: list

    def torch_groups(self, weight_decay: float, scale_weight_decay: float) -> list[dict]:
        groups = [{"params": self.decay, "weight_decay": weight_decay, "name": "decay"},
                  {"params": self.no_decay, "weight_decay": 0.0, "name": "no_decay"},
                  {"params": self.scales, "weight_decay": scale_weight_decay, "name": "branch_scales"}]
        return [g for g in groups if g["params"]]


_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def split_params(model: nn.Module) -> ParamGroups:
    """Decay conv/linear weights; not BN parameters, biases, branch scaling vectors.

    Fixed filters (avg-pool, frequency prior, identity kernels) are non-persistent
    buffers, not parameters, so the optimizer never sees them. Classification is by
    module type (norms, :class:`orepa.Scale`) and parameter name (``bias``), with
    any other 1-D parameter treated like a bias; a packed parameter
    (:class:`orepa.engine.PackedParameters`) by the role it packs.
    """
    decay, no_decay, scales, seen = [], [], [], set()
    for _, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, PackedParameters):
                (scales if module.kinds[pname] == "scale" else decay).append(p)
            elif isinstance(module, orepa.Scale):
                scales.append(p)
            elif isinstance(module, _NORMS) or pname == "bias" or p.ndim <= 1:
                no_decay.append(p)
            else:
                decay.append(p)
    return ParamGroups(decay, no_decay, scales)


# --------------------------------------------------------------------------- distributed / device


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    distributed: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def parse_device(device_arg: str | None) -> torch.device:
    """``--device`` as a device this machine has: ``cpu``, ``cuda`` or ``cuda:N`` (default: cuda if
    available); anything else is a :class:`UserError` naming the flag."""
    text = device_arg or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UserError(f"--device {text!r}: expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {text}: orepa runs on cpu or cuda, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {text} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def init_distributed(device_arg: str | None) -> tuple[DistInfo, torch.device]:
    """Read torchrun's environment; init nccl (CUDA) or gloo (CPU). Returns (info, device)."""
    want_cuda = parse_device(device_arg).type == "cuda"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        info = DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")), True)
        if want_cuda:
            torch.cuda.set_device(info.local_rank)
            device = torch.device("cuda", info.local_rank)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if want_cuda else "gloo",
                                    **({"device_id": device} if want_cuda else {}))
        return info, device
    device = parse_device(device_arg)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return DistInfo(), device


def cleanup_distributed(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


@contextmanager
def full_float32() -> Iterator[None]:
    """No TF32 inside: CUDA convs and matmuls default to TF32 (10-bit mantissa), whose rounding
    (~1e-3 relative) would hide or fake a re-param mismatch; comparisons run in true float32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def make_sgd(params, **kwargs) -> torch.optim.SGD:
    """``torch.optim.SGD`` with the fused kernel where this torch has one for every parameter's
    device and dtype (CPU and CUDA floating point since torch 2.4), else the default one.

    Fused reads and writes each parameter, gradient and momentum buffer once per step instead
    of once per elementwise op: a re-param model trains 2-4x the plain net's parameters, so its
    optimizer step is a visible share of a step.
    torch checks the devices only at the first step, hence the check here.
    """
    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without the helper: stay with the default implementation
        devices = set()
    fused = bool(tensors) and all(t.device.type in devices and t.is_floating_point() for t in tensors)
    return torch.optim.SGD(params, fused=fused or None, **kwargs)


def capture_cuda_graphs(model: nn.Module, sample: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """Make ``model``'s training forward and backward CUDA-graph replays (``make_graphed_callables``
    replaces its ``forward``; in eval mode the eager forward runs). The capture's warm-up runs real
    forward+backward passes on ``sample``: the buffers (BN statistics) and gradients they touch are
    put back, so a run with graphs follows the eager run's trajectory and resumes the same way.
    Undo with :func:`release_cuda_graphs` before deep-copying the model.

    Every step must then clear gradients with ``zero_grad(set_to_none=True)``: the graphed backward
    returns its static gradient buffers, and autograd adopts such a buffer as ``.grad`` when
    ``.grad`` is None. A kept ``.grad`` IS that buffer, which the next replay overwrites and
    autograd then adds to itself: every gradient doubled from the second step on."""
    saved = [b.detach().clone() for b in model.buffers()]
    torch.cuda.make_graphed_callables(model, (sample,))
    with torch.no_grad():
        for b, v in zip(model.buffers(), saved):
            b.copy_(v)
    optimizer.zero_grad(set_to_none=True)


def release_cuda_graphs(model: nn.Module) -> None:
    """Back to the eager forward. ``make_graphed_callables`` set ``model.forward`` to a closure over
    this module; a deep copy (``orepa.reparameterize``) would keep calling the original."""
    model.__dict__.pop("forward", None)


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(MiB, what was measured): CUDA max allocated on GPUs, process max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "torch.cuda.max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "process max RSS"


def state_hash(state: dict) -> str:
    """SHA-256 of a state_dict's keys, dtypes, shapes and raw bytes: equal iff bit-identical."""
    import hashlib

    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key]
        if not isinstance(t, torch.Tensor):
            h.update(f"{key}={t!r}".encode())
            continue
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{key}:{t.dtype}:{list(state[key].shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def apply_threads(args) -> None:
    n = getattr(args, "threads", None)
    if n:
        torch.set_num_threads(max(1, n))


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
