"""The model a command builds, as a plain ``model_cfg`` dict (what checkpoints store).

* the model flags (:func:`add_model_arguments`) and the model_cfg they give
  (:func:`model_cfg_from_args`: flags, else a checkpoint's settings, else defaults), checked
  field by field (:func:`checked_cfg`);
* building it (:func:`build_model`): from the model zoo (``orepa.models.create_model``), or a
  torchvision / timm network (``torchvision:NAME``, ``timm:NAME``; :func:`external_model`)
  turned into its method by ``orepa.convert``;
* its forms: training, deployed (vanilla layout), deployed with BNs folded (:func:`deploy`,
  :func:`build_model_form`).
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping

import torch
from torch import nn

import orepa
from orepa import models as zoo
from orepa.convert import METHOD_OPTIONS
from orepa.models.zoo import branch_list, branch_switches

from .common import (
    UserError,
    error_text,
    free_memory,
    long_flag,
    parse_key_values,
    positive_float,
    positive_int,
    size_text,
)

#: model_cfg keys; ``options`` holds the block options (and, for a torchvision / timm network, its
#: constructor keywords under :data:`MODEL_KWARGS`)
MODEL_CFG_KEYS = ("model", "method", "num_classes", "in_chans", "small_input", "width_mult", "options")

DEFAULT_MODEL, DEFAULT_METHOD = "resnet18", "orepa"


def add_model_arguments(p: argparse.ArgumentParser, model_default: str = f"default {DEFAULT_MODEL}") -> None:
    """Model flags. Unset ones (None) come from the checkpoint being resumed/evaluated, else the defaults
    (``model_default``: what the help says of --model's)."""
    g = p.add_argument_group("model (the zoo's orepa.models.create_model, or a torchvision / timm network)")
    g.add_argument("-m", "--model", default=None,
                   help=f"architecture: a zoo name (orepa.models.list_models()), or torchvision:NAME / timm:NAME, "
                        f"any network of those libraries turned into --method by orepa.convert; {model_default}")
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
    # choices: a misspelt preset is refused as the command line is read, before any other check
    g.add_argument("--preset", default=None, choices=sorted(zoo.ABLATIONS),
                   help="an ablation preset of the zoo (orepa.models.ABLATIONS)")
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
    if getattr(args, "branches", None) is not None:
        opts["branches"] = [b.strip() for b in args.branches.split(",") if b.strip()]
        if not opts["branches"]:  # not the default set, silently
            raise UserError(f"--branches {args.branches!r} names no branch (e.g. --branches kxk,1x1,1x1_avg)")
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


def check_model_takes_images(model: nn.Module, data, what: str, **batch) -> None:
    """One blank image of each size ``data`` gives through ``model``: see :func:`check_model_takes`
    (``batch``: its keywords of the batch's memory)."""
    check_model_takes(model, data.image_sizes, data.in_chans, what, lambda size: f"{data.name}'s {size}x{size} images",
                      **batch)


def check_model_takes(model: nn.Module, sizes, in_chans: int, what: str, images, *, batch: int = 1,
                      training: bool = False, amp: bool = False, device: torch.device | None = None,
                      batch_flags: str | None = None, hint: str = "", train_sizes=None) -> None:
    """One blank image of each of ``sizes`` through ``model`` (eval mode, no gradients, on the
    model's device): a network that cannot take them (one that downsamples a 28x28 image to nothing,
    a fixed-size one) gives a :class:`UserError` naming the size (``images(size)`` says what they
    are), not a traceback at the first batch. Any error of that forward is the model's on that
    input, so it is reported as such.

    With ``batch`` > 1, also the memory that ``batch`` images need at least, measured on the one
    image and scaled: for an inference, one layer's input and output (both live when it returns);
    for a ``training`` step, every input that a layer with trainable parameters keeps for its
    gradients. More than the device has free (:func:`~orepa.apps.common.free_memory`) is a
    :class:`UserError` naming the batch (``batch_flags``, default ``-b N``; ``hint`` after the
    advice): allocations on a CPU succeed and the system's out-of-memory killer then ends the
    process without a word. ``device``: where the batches will run (default: the model's);
    ``amp``: under autocast, whose activations take half the bytes of the probe's float32 ones.

    A ``training`` step's images (``train_sizes``, default every size) that leave a BatchNorm one value
    per channel in a batch of ``batch`` (a 1x1 map at -b 1) are refused too: torch's BN refuses them at
    the first step."""
    was = model.training
    param = next(model.parameters(), None)
    on = param.device if param is not None else torch.device("cpu")
    per_image = {}  # size -> bytes of activations one image needs at least
    model.eval()
    try:
        with torch.no_grad(), _ActivationBytes(model, training) as measured:
            for size in sizes:
                x = torch.zeros(1, in_chans, size, size, device=on)
                measured.clear()
                try:
                    out = model(x)
                except (RuntimeError, ValueError, AssertionError) as exc:  # AssertionError: timm's fixed-size models
                    raise UserError(f"{what} cannot take {images(size)}: {error_text(exc, typed=False)}") from None
                if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != 1:
                    got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise UserError(f"{what} gives {got} for one image, not a row of class logits: these commands "
                                    "train and evaluate classifiers (a detection or segmentation network takes a "
                                    "re-param backbone: docs/detection.md)")
                per_image[size] = measured.total()
                if training and batch * measured.bn_values == 1 and (train_sizes is None or size in train_sizes):
                    raise UserError(f"{batch_flags or f'-b {batch}'}, {images(size)}: a training BatchNorm sees "
                                    f"one value per channel in {what} (a 1x1 feature map), which it cannot "
                                    "normalise; use a larger batch or image")
    finally:
        model.train(was)
    if batch > 1 and per_image:
        size = min(per_image, key=per_image.get)  # a bound for every size (train's: its crops' and validation's)
        device = torch.device(device) if device is not None else on
        per = per_image[size] // (2 if amp else 1)
        need, free = batch * per, free_memory(device)
        sharing = _processes_sharing(device)
        if free is not None and need * sharing > free:
            step = "a training step" if training else "an inference"
            shared = (f" (shared by this host's {sharing} processes: {size_text(free // sharing)} each)"
                      if sharing > 1 else "")
            raise UserError(f"{batch_flags or f'-b {batch}'}, {images(size)}: {step} of {what} needs at least "
                            f"{size_text(need)} ({size_text(per)} an image), more than the "
                            f"{size_text(free)} free on {device}{shared}; a smaller batch needs less{hint}")


def _processes_sharing(device: torch.device) -> int:
    """How many of the job's processes draw on the memory :func:`check_model_takes` measures free:
    on a CPU every process torchrun started on this host (``LOCAL_WORLD_SIZE``), which all measure
    the same free memory before any of them allocates; a GPU is each process's own."""
    if device.type != "cpu":
        return 1
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


class _ActivationBytes:
    """Forward hooks on every module of ``model`` while open, adding up the activation bytes one
    forward needs at least (:func:`check_model_takes`); a tensor counted once however many modules
    see it (an in-place ReLU's output is its input). Training: the inputs are held until the
    forward ends, as a training step keeps them (freed, their memory would serve later tensors at
    the same address, counted as one)."""

    def __init__(self, model: nn.Module, training: bool):
        self.model, self.training = model, training
        self.kept: dict[int, torch.UntypedStorage] = {}  # training: address -> storage of an input kept
        self.peak = 0  # inference: the largest input + output of one module
        self.bn_values = math.inf  # the fewest values per channel one image gives a BatchNorm

    def clear(self) -> None:
        self.kept, self.peak, self.bn_values = {}, 0, math.inf

    def total(self) -> int:
        return sum(s.nbytes() for s in self.kept.values()) if self.training else self.peak

    def _hook(self, module: nn.Module, inputs, output) -> None:
        def storages(value) -> dict[int, torch.UntypedStorage]:
            tensors = [t for t in (value if isinstance(value, (tuple, list)) else (value,))
                       if isinstance(t, torch.Tensor) and t.numel()]
            return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}

        if isinstance(module, nn.modules.batchnorm._BatchNorm) and inputs and inputs[0].dim() >= 2:
            self.bn_values = min(self.bn_values, inputs[0][0, 0].numel())
        if self.training:
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                self.kept.update(storages(inputs))
        else:
            self.peak = max(self.peak, sum(s.nbytes() for s in {**storages(inputs), **storages(output)}.values()))

    def __enter__(self):
        self.handles = [m.register_forward_hook(self._hook) for m in self.model.modules()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


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
                raise UserError(f"{key} is given twice: {long_flag(key)} and --model-option {key}=")
            cfg[key] = options.pop(key)
    carried = dict(saved.get("options", {}))
    if cfg["method"] != saved.get("method", cfg["method"]):  # the others were the saved method's own
        carried = plain_network_options(cfg["model"], carried)
    cfg["options"] = {**carried, **options}  # (--no-deep-stem keeps a checkpoint's widths)
    cfg = checked_cfg(cfg)
    if options.get("deep_stem") and cfg["small_input"] and not external_source(cfg["model"]):
        raise UserError("--deep-stem replaces a 7x7 stem conv by a linear deep stem, and the small-input stem "
                        "(--small-input, the default for Fashion-MNIST's 28x28 images) is a 3x3 conv, an OREPA "
                        "block like every 3x3: add --no-small-input for a deep stem, or drop --deep-stem")
    return cfg


def plain_network_options(model: str, options: dict) -> dict:
    """The block options that describe the plain network itself, which a model of another method
    built from a checkpoint keeps: a zoo family's common options (widths, stem), a torchvision / timm
    network's constructor keywords. (``deep_stem`` of an OREPA checkpoint is not one: a ``--method
    base`` run from it builds the plain network, which the deployed deep stem fits.)"""
    if external_source(model) is not None:
        keep: tuple[str, ...] = (MODEL_KWARGS,)
    else:
        try:
            keep = zoo.family_of(model).common_options
        except ValueError:  # an unknown name: reported where the model is built
            return options
    return {k: v for k, v in options.items() if k in keep}


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


def checkpoint_cfg(args: argparse.Namespace, ckpt: dict, path, *, num_classes: int, in_chans: int,
                   small_input: bool) -> dict | None:
    """The model_cfg a checkpoint is loaded with: the model flags given over its saved model_cfg, or
    None where none is given (its own). A bare state_dict records no model, so it needs the flags:
    guessing the defaults only ended in a long key mismatch against the wrong network."""
    if not model_flags_given(args):
        if "model_cfg" in ckpt:
            return None
        raise UserError(f"{path} is a bare state_dict (it records no model): pass --model (and --method, "
                        "--num-classes, --in-chans, ... as it was trained) to say what it holds")
    saved = ckpt.get("model_cfg")
    cfg = model_cfg_from_args(args, num_classes=num_classes, in_chans=in_chans, small_input=small_input, saved=saved)
    if saved is not None and cfg != checked_cfg(dict(saved)):
        # a flag against what the checkpoint records: its weights may still load (RepVGG's small_input only
        # changes strides), into another network than the one they were trained in
        raise UserError(f"{path} records {describe_cfg(saved)}; the model flags given build "
                        f"{describe_cfg(cfg)} (" + "; ".join(cfg_mismatch(saved, cfg)) + "): leave them out "
                        "to use the checkpoint's settings")
    return cfg


def cfg_mismatch(saved: dict, wanted: dict) -> list[str]:
    """What differs between two model_cfgs, key by key (a checkpoint's, and what a command would build)."""
    keys = sorted(set(saved) | set(wanted))
    return [f"{k}: checkpoint {saved.get(k)!r} vs requested {wanted.get(k)!r}" for k in keys
            if saved.get(k) != wanted.get(k)]


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


#: torchvision networks that return their auxiliary classifiers' logits too in training mode
TORCHVISION_AUX_HEADS = ("googlenet", "inception_v3")


def check_external_name(name: str) -> None:
    """A :class:`UserError` for a ``torchvision:NAME`` / ``timm:NAME`` its library lacks (or a library
    not installed): said before anything else about the model's settings."""
    source, _, arch = name.partition(":")
    if source not in EXTERNAL_SOURCES or not arch:
        raise unknown_model(name)
    try:
        if source == "timm":
            import timm

            known, listing = timm.is_model(arch), "timm.list_models()"
        else:
            import torchvision

            known, listing = arch in torchvision.models.list_models(), "torchvision.models.list_models()"
    except ImportError as exc:
        raise UserError(f"model {name!r} needs the package {exc.name or source} (pip install {source})") from None
    if not known:
        raise UserError(f"{source} has no model {arch!r} ({listing})")


def external_model(name: str, num_classes: int, in_chans: int = 3, **kwargs) -> nn.Module:
    """The plain network ``torchvision:NAME`` or ``timm:NAME``, randomly initialised (no weights
    are fetched; ``kwargs`` go to its constructor). timm makes ``in_chans`` itself; in a torchvision
    model the first conv that takes 3 channels is replaced by one that takes ``in_chans`` (same
    geometry, initialised afresh)."""
    check_external_name(name)  # (timm's own error for a name it lacks is a bare RuntimeError)
    source, _, arch = name.partition(":")
    try:
        if source == "timm":
            import timm

            return timm.create_model(arch, pretrained=False, num_classes=num_classes, in_chans=in_chans, **kwargs)
        import torchvision

        if arch in torchvision.models.list_models() and arch not in torchvision.models.list_models(
                module=torchvision.models):  # (their builders would also fetch a pretrained backbone)
            raise UserError(f"{name} is not a classification network of torchvision (torchvision.models."
                            "list_models(module=torchvision.models)); detection and segmentation networks take a "
                            "re-param backbone: docs/detection.md")
        if arch in TORCHVISION_AUX_HEADS:
            if kwargs.get("aux_logits"):
                raise UserError(f"{name} with aux_logits=True returns its auxiliary heads' logits too in training; "
                                "orepa train's loss takes one logits tensor: build it without them (the default)")
            # one logits tensor in training too; init_weights named: the present init, without torchvision's warning
            kwargs = {"aux_logits": False, "init_weights": True, **kwargs}
        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
    except ImportError as exc:
        raise UserError(f"model {name!r} needs the package {exc.name or source} (pip install {source})") from None
    except (ValueError, TypeError, KeyError, AssertionError) as exc:
        if isinstance(exc, AssertionError) and not kwargs:
            raise  # (a constructor's own check failing without a keyword of ours: not a usage error)
        given = f" (with --model-kwarg {', '.join(f'{k}={v!r}' for k, v in kwargs.items())})" if kwargs else ""
        why = str(exc) or f"the constructor's check refused it ({type(exc).__name__})"
        raise UserError(f"cannot build model {name!r}{given}: {why}") from None
    if in_chans != 3:
        _adapt_input_conv(model, in_chans, name)
    return model


#: constructor keywords orepa sets itself, and the flag that sets them
OWN_KWARGS = {"num_classes": "--num-classes", "in_chans": "--in-chans", "weights": None, "pretrained": None}


def check_model_kwargs(name: str, kwargs: dict) -> None:
    """A :class:`UserError` for a ``--model-kwarg`` that orepa sets itself (the class count, the input
    channels, pretrained weights: none are fetched), and for a drop rate outside [0, 1), which timm
    accepts and fails on only in the first training step."""
    for key, value in kwargs.items():
        if key in OWN_KWARGS:
            flag = OWN_KWARGS[key]
            raise UserError(f"--model-kwarg {key}=: " + (f"orepa passes it to the constructor itself; give it as {flag}" if flag else
                            "orepa builds every network randomly initialised (no weights are fetched); start from "
                            "a checkpoint with orepa train --init-from"))
        if "drop" in key and key.endswith("rate") and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1):
            raise UserError(f"--model-kwarg {key}={value!r} for {name}: a drop probability, 0 <= {key} < 1")


def _adapt_input_conv(model: nn.Module, in_chans: int, name: str) -> None:
    first = next(((n, m) for n, m in model.named_modules() if type(m) is nn.Conv2d), None)
    if first is None or first[1].in_channels != 3 or first[1].groups != 1:
        raise UserError(f"model {name!r}: no first 3-channel convolution to give {in_chans} input channel(s)")
    n, c = first
    new = nn.Conv2d(in_chans, c.out_channels, c.kernel_size, c.stride, c.padding, c.dilation, 1, c.bias is not None,
                    c.padding_mode)
    parent, _, attr = n.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def unknown_model(name: str) -> UserError:
    return UserError(f"unknown model {name!r}; choose from {', '.join(zoo.list_models())}, or "
                     f"{' / '.join(s + ':NAME' for s in EXTERNAL_SOURCES)} for a network of those libraries")


def zoo_only_options() -> set[str]:
    """The options of the zoo's models that no method of :func:`orepa.convert` takes: the plain
    network's (widths, stem, ``zero_init_residual``), the zoo's OREPA ResNet's (``deep_stem``,
    ``post_bn``, ``preset``) and the branch switches (``freq_prior``, ...: convert takes ``branches``)."""
    options = set(branch_switches())
    for name in zoo.list_models():
        family = zoo.family_of(name)
        options.update(family.common_options, *family.method_options.values())
    return options.difference(*METHOD_OPTIONS.values())


def _refuse_zoo_only_options(cfg: dict, options: dict) -> None:
    """A :class:`UserError` naming every option of ``cfg`` (a torchvision / timm network's) that only the
    zoo's models have (:func:`zoo_only_options`): convert's blocks would not take it (a TypeError in
    each block, said as "found nothing to convert")."""
    zoo_only = {k: cfg[k] for k, plain in (("width_mult", 1.0), ("small_input", False)) if cfg[k] != plain}
    zoo_only_keys = zoo_only_options()
    zoo_only.update((k, v) for k, v in options.items() if k in zoo_only_keys)
    if not zoo_only:
        return
    switches = {k: v for k, v in zoo_only.items() if k in branch_switches()}
    hint = ""
    if switches and "branches" not in options and "branches" in METHOD_OPTIONS.get(cfg["method"], ()):
        hint = f" (name its blocks' branches instead: --branches {','.join(branch_list(switches))})"
    raise UserError(f"{', '.join(f'{k}={v}' for k, v in zoo_only.items())}: options of the zoo's models, not of "
                    f"{cfg['model']}{hint}")


def build_model(cfg: dict) -> nn.Module:
    """The training-form model described by ``cfg`` (see :data:`MODEL_CFG_KEYS`): from the zoo, or a
    torchvision / timm network (:func:`external_model`) turned into ``method`` by :func:`orepa.convert`
    with the block options of ``cfg["options"]``."""
    if external_source(cfg["model"]) is not None:
        check_external_name(cfg["model"])
        options = dict(cfg["options"])
        _refuse_zoo_only_options(cfg, options)
        kwargs = options.pop(MODEL_KWARGS, {})
        if not isinstance(kwargs, dict):
            raise UserError(f"{MODEL_KWARGS} must be a mapping of constructor keywords, got {kwargs!r}")
        check_model_kwargs(cfg["model"], kwargs)
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
            flag = " (--model-option without_bn=true)" if "without_bn=True converts" in str(exc) else ""
            raise UserError(f"cannot build {describe_cfg(cfg)}: {exc}{flag}") from None
    if cfg["model"] not in zoo.list_models():
        raise unknown_model(cfg["model"])
    if MODEL_KWARGS in cfg.get("options", {}):
        raise UserError(f"--model-kwarg passes keywords to a torchvision:NAME / timm:NAME network's constructor; "
                        f"{cfg['model']} is a zoo model (its options: --model-option KEY=VALUE)")
    options = dict(cfg.get("options", {}))
    if cfg["small_input"] and options.get("deep_stem"):
        # recorded by a run from before the zoo refused the pair (model_cfg_from_args refuses the flag): its
        # deep stem was never built, the small-input stem being a 3x3 block, so its model is the one without
        del options["deep_stem"]
    try:
        return zoo.create_model(cfg["model"], method=cfg["method"], num_classes=cfg["num_classes"],
                                in_chans=cfg["in_chans"], small_input=cfg["small_input"],
                                width_mult=cfg["width_mult"], **options)
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


def deploy(model: nn.Module, form: str, *, inplace: bool = False) -> nn.Module:
    """The ``form`` of a training-form model (a copy unless ``inplace``; ``train`` returns the model itself)."""
    if form == "train":
        return model
    was = model.training
    model.eval()
    out = orepa.reparameterize(model, fuse_bn=(form == "deploy-fused"), inplace=inplace)
    if not inplace:
        model.train(was)
    return out.eval()


def build_model_form(cfg: dict, form: str) -> nn.Module:
    """An (untrained) model with the module layout of ``form``, ready for ``load_state_dict``."""
    if form not in FORMS:
        raise UserError(f"unknown model form {form!r}; expected one of {FORMS}")
    return deploy(build_model(cfg), form, inplace=True)  # (a model of its own: no copy to make)


def checkpoint_cfg_without_data(args: argparse.Namespace, ckpt: dict, path, sd: Mapping[str, torch.Tensor]
                                ) -> dict | None:
    """:func:`checkpoint_cfg` for a command that has no data to say the class count, the input channels
    and the stem (export, analyze): a bare state_dict's sizes read from its weights (:func:`sizes_of_weights`,
    ImageNet's where they say nothing), the standard stem."""
    cfg = checkpoint_cfg(args, ckpt, path, num_classes=1000, in_chans=3, small_input=False)
    if cfg is not None and ckpt.get("model_cfg") is None:
        cfg = checkpoint_cfg(args, ckpt, path, **sizes_of_weights(cfg, sd), small_input=False)
    return cfg


def sizes_of_weights(cfg: dict, sd: Mapping[str, torch.Tensor]) -> dict:
    """``num_classes`` and ``in_chans`` as a bare state_dict says them, for a command without data to
    take them from (export, analyze), ``cfg``'s where it says nothing: ``cfg``'s network, built on the
    meta device in each form, names the tensors to read (its first weight over the input's
    ``cfg["in_chans"]`` channels, its classifier's ``nn.Linear`` of ``cfg["num_classes"]`` rows), whatever
    order the tensors come in (a timm network's position embedding first, a block's depthwise branch
    first). The flags, where given, still decide (:func:`model_cfg_from_args`)."""
    found: dict[str, int] = {}
    for form in FORMS:
        try:
            with torch.device("meta"):
                model = build_model_form(cfg, form)
        except (UserError, ValueError, TypeError, RuntimeError):  # a form this network has not
            continue
        stem = next((k for k, t in model.state_dict().items() if t.dim() == 4 and t.shape[1] == cfg["in_chans"]), None)
        if "in_chans" not in found and isinstance(sd.get(stem), torch.Tensor) and sd[stem].dim() == 4:
            found["in_chans"] = int(sd[stem].shape[1])
        head = next((f"{name}.weight" for name, m in model.named_modules()
                     if isinstance(m, nn.Linear) and m.out_features == cfg["num_classes"]), None)
        if "num_classes" not in found and isinstance(sd.get(head), torch.Tensor) and sd[head].dim() == 2:
            found["num_classes"] = int(sd[head].shape[0])
        if len(found) == 2:
            break
    return {"num_classes": cfg["num_classes"], "in_chans": cfg["in_chans"], **found}
