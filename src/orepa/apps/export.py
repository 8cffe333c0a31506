"""``orepa export``: deploy a zoo model (reparameterize + fold BN) and export it to ONNX or TorchScript.

Library use::

    from orepa.apps.export import export_onnx, export_torchscript
    report = export_onnx(model, "model.onnx", (1, 3, 224, 224))   # verified with onnxruntime
    print(report)

Both functions put the model in eval mode, deploy it with
``orepa.reparameterize(model, fuse_bn=True)`` (a plain conv net, every BN folded),
export the deployed model, and (``verify=True``) check on a random input that

* the deployed PyTorch model equals the training-form model in eval mode, and
* the exported artifact (onnxruntime / the reloaded TorchScript module) equals the
  deployed PyTorch model,

each to ``max|y - y_ref| <= atol * (1 + max|y_ref|)`` (default ``atol=1e-4`` in float32;
the test-suite's reparameterization bound is 1e-5 in the same form). A failed check raises
:class:`ExportVerificationError`.
"""
from __future__ import annotations

import argparse
import ast
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import orepa

__all__ = ["deploy", "export_onnx", "export_torchscript", "load_checkpoint", "ExportReport",
           "ExportVerificationError", "add_arguments", "run"]


class ExportVerificationError(RuntimeError):
    """The exported model does not compute what the PyTorch model computes (to the stated tolerance)."""


@dataclass
class ExportReport:
    path: str
    format: str
    input_shape: tuple[int, ...]
    params_training: int
    params_deployed: int
    verified: bool = False
    atol: float = 1e-4
    errors: dict[str, float] = field(default_factory=dict)  # check -> max abs error
    bounds: dict[str, float] = field(default_factory=dict)  # check -> atol * (1 + max|reference|)

    def __str__(self) -> str:
        lines = [f"exported {self.format} to {self.path} (input {list(self.input_shape)}); "
                 f"params {self.params_training:,} (training form) -> {self.params_deployed:,} (deployed)"]
        if self.verified:
            lines += [f"  {k}: max abs err {v:.3e} <= {self.bounds[k]:.3e} = {self.atol:g} * (1 + max|y_ref|)"
                      for k, v in self.errors.items()]
        else:
            lines.append("  not verified")
        return "\n".join(lines)


def _nparams(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@torch.no_grad()
def deploy(model: nn.Module) -> nn.Module:
    """The inference form: eval mode, every re-param block a conv, every BN folded (a copy)."""
    model.eval()
    return orepa.reparameterize(model, fuse_bn=True).eval()


def _check(report: ExportReport, name: str, y: torch.Tensor, ref: torch.Tensor) -> None:
    err = (y.float() - ref.float()).abs().max().item()
    bound = report.atol * (1 + ref.abs().max().item())
    report.errors[name], report.bounds[name] = err, bound
    if not err <= bound:  # also catches NaN
        raise ExportVerificationError(f"{name}: max abs error {err:.3e} > {bound:.3e} "
                                      f"(= {report.atol:g} * (1 + max|y|)) for {report.path}")


def _example(input_shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*input_shape, generator=g)


@torch.no_grad()
def export_onnx(model: nn.Module, path, input_shape=(1, 3, 224, 224), *, opset: int = 17, verify: bool = True,
                atol: float = 1e-4, dynamic_batch: bool = True, dynamo: bool = False) -> ExportReport:
    """Deploy ``model`` and export it to ONNX at ``path``; verify with onnxruntime.

    Args:
        input_shape: ``(N, C, H, W)`` of the example input (the batch axis is dynamic
            unless ``dynamic_batch=False``).
        opset: ONNX opset version.
        verify: compare deployed vs training form and onnxruntime vs PyTorch (see module doc).
        atol: the bound is ``atol * (1 + max|y_ref|)`` on the max abs error.
        dynamo: use the torch.export-based exporter (slower); default the TorchScript-based one.
    """
    path = str(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    model.eval()
    deployed = deploy(model)
    x = _example(input_shape)
    report = ExportReport(path, "onnx", tuple(input_shape), _nparams(model), _nparams(deployed), atol=atol)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if dynamo:
            dyn = {"x": {0: torch.export.Dim("batch")}} if dynamic_batch else None
            torch.onnx.export(deployed, (x,), path, dynamo=True, opset_version=opset, input_names=["input"],
                              output_names=["output"], dynamic_shapes=dyn)
        else:
            dyn = {"input": {0: "batch"}, "output": {0: "batch"}} if dynamic_batch else None
            torch.onnx.export(deployed, (x,), path, dynamo=False, opset_version=opset, input_names=["input"],
                              output_names=["output"], dynamic_axes=dyn)
    if verify:
        import onnx
        import onnxruntime as ort

        onnx.checker.check_model(path)
        y_train, y_dep = model(x), deployed(x)
        _check(report, "deployed vs training form", y_dep, y_train)
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        xs = [x] + ([_example((input_shape[0] + 1, *input_shape[1:]), 1)] if dynamic_batch else [])
        for i, xi in enumerate(xs):
            y_ort = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: xi.numpy()})[0])
            _check(report, f"onnxruntime vs pytorch (batch {xi.shape[0]})", y_ort, deployed(xi) if i else y_dep)
        report.verified = True
    return report


@torch.no_grad()
def export_torchscript(model: nn.Module, path, input_shape=(1, 3, 224, 224), *, verify: bool = True,
                       atol: float = 1e-4) -> ExportReport:
    """Deploy ``model``, ``torch.jit.trace`` it and save it at ``path``; verify the reloaded module."""
    path = str(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    model.eval()
    deployed = deploy(model)
    x = _example(input_shape)
    report = ExportReport(path, "torchscript", tuple(input_shape), _nparams(model), _nparams(deployed), atol=atol)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*deprecated.*")
        traced = torch.jit.trace(deployed, x)
        torch.jit.save(traced, path)
        if verify:
            loaded = torch.jit.load(path)
            y_train, y_dep = model(x), deployed(x)
            _check(report, "deployed vs training form", y_dep, y_train)
            _check(report, "torchscript vs pytorch", loaded(x), y_dep)
            report.verified = True
    return report


# --------------------------------------------------------------------------- checkpoints


def _unwrap_state_dict(obj) -> dict:
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "model_state_dict", "model_ema"):
            inner = obj.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                obj = inner
                break
    if not (isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise ValueError("the checkpoint is not a state_dict (nor a dict holding one under "
                         "'state_dict' / 'model' / 'model_state_dict')")
    out = {}
    for k, v in obj.items():
        for prefix in ("module.", "_orig_mod."):  # DDP / torch.compile wrappers
            if k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def _mismatch(model: nn.Module, sd: dict) -> str:
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} {tuple(sd[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in sd and sd[k].shape != v.shape]
    parts = []
    for what, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
        if items:
            parts.append(f"{len(items)} {what} (e.g. {', '.join(items[:3])})")
    return "; ".join(parts) or "no key/shape difference"


def load_checkpoint(name: str, method: str, path, **create_kwargs) -> tuple[nn.Module, str]:
    """Build ``create_model(name, method, **create_kwargs)`` and load a checkpoint into it.

    The checkpoint (``torch.load(weights_only=True)``) may be the training form's
    state_dict, the deployed form's (``reparameterize(model)``: the base layout) or the
    BN-folded deployed form's (``reparameterize(model, fuse_bn=True)``), optionally
    wrapped in ``{"state_dict" | "model": ...}`` and with ``module.`` prefixes.
    Returns ``(model, form)``; raises ValueError naming the differences if nothing matches.
    """
    from orepa.models import create_model

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle of non-tensor objects, missing file, ...
        raise ValueError(f"cannot load checkpoint {path} with torch.load(weights_only=True): {exc}") from exc
    sd = _unwrap_state_dict(obj)
    candidates = [("training form", lambda: create_model(name, method, **create_kwargs))]
    if method != "base":
        candidates.append(("deployed form", lambda: create_model(name, "base", **create_kwargs)))
    candidates.append(("deployed form, BN folded",
                       lambda: orepa.reparameterize(create_model(name, "base", **create_kwargs).eval(), fuse_bn=True)))
    why = []
    for form, build in candidates:
        model = build()
        own = model.state_dict()
        if set(own) == set(sd) and all(own[k].shape == sd[k].shape for k in own):
            model.load_state_dict(sd, strict=True)
            return model, form
        why.append(f"{form}: {_mismatch(model, sd)}")
    raise ValueError(f"checkpoint {path} does not match {name} / {method} "
                     f"(options {create_kwargs}):\n  " + "\n  ".join(why))


# --------------------------------------------------------------------------- CLI


def _parse_option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--option expects key=value, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="zoo model name (orepa.models.list_models()); default: the checkpoint's model_cfg")
    p.add_argument("--method", default=None,
                   help="re-param method the checkpoint was trained with (default: the checkpoint's, else base)")
    p.add_argument("--checkpoint", default=None,
                   help="state_dict (training form, deployed form, or deployed with BN folded), bare or inside an "
                        "orepa checkpoint; default: random init")
    p.add_argument("--num-classes", type=int, default=None, help="default: the checkpoint's, else 1000")
    p.add_argument("--in-chans", type=int, default=None, help="default: the checkpoint's, else 3")
    p.add_argument("--input-size", type=int, default=224, help="height = width of the example input")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--small-input", dest="small_input", action="store_true", default=None,
                   help="CIFAR-style stem (as the model was trained); default: the checkpoint's, else off")
    p.add_argument("--width-mult", type=float, default=None, help="default: the checkpoint's, else 1.0")
    p.add_argument("--option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="further create_model option, e.g. --option preset=online-only (repeatable)")
    p.add_argument("--output", default=None, help="output file (default: {model}_{method}.onnx / .pt)")
    p.add_argument("--format", choices=("onnx", "torchscript"), default="onnx")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--dynamo", action="store_true", help="ONNX: use the torch.export-based exporter")
    p.add_argument("--atol", type=float, default=1e-4, help="verification bound: atol * (1 + max|y|)")
    p.add_argument("--no-verify", action="store_true")


def _saved_cfg(path) -> dict:
    """``model_cfg`` of an orepa checkpoint (apps.checkpoint format), else {}."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return {}
    cfg = obj.get("model_cfg") if isinstance(obj, dict) else None
    return dict(cfg) if isinstance(cfg, dict) else {}


def run(args: argparse.Namespace) -> int:
    from orepa.models import create_model

    saved = _saved_cfg(args.checkpoint) if args.checkpoint else {}
    name = args.model or saved.get("model")
    if name is None:
        print("error: --model is required (the checkpoint has no model_cfg)")
        return 2
    method = args.method or saved.get("method", "base")
    kwargs = dict(saved.get("options") or {}) if name == saved.get("model") else {}
    kwargs.update(dict(args.option))
    for key, default in (("num_classes", 1000), ("in_chans", 3), ("small_input", False), ("width_mult", 1.0)):
        value = getattr(args, key)
        if value is not None:
            kwargs[key] = value
        elif key not in kwargs:
            kwargs[key] = saved.get(key, default)
    try:
        if args.checkpoint:
            model, form = load_checkpoint(name, method, args.checkpoint, **kwargs)
            print(f"loaded {args.checkpoint} as the {form} of {name} / {method}")
        else:
            model = create_model(name, method, **kwargs)
            print(f"no --checkpoint: exporting a randomly initialised {name} / {method}")
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    shape = (args.batch_size, kwargs["in_chans"], args.input_size, args.input_size)
    suffix = ".onnx" if args.format == "onnx" else ".pt"
    out = args.output or f"{name}_{method}{suffix}"
    try:
        if args.format == "onnx":
            report = export_onnx(model, out, shape, opset=args.opset, verify=not args.no_verify, atol=args.atol,
                                 dynamo=args.dynamo)
        else:
            report = export_torchscript(model, out, shape, verify=not args.no_verify, atol=args.atol)
    except ExportVerificationError as exc:
        print(f"error: verification failed: {exc}")
        return 1
    print(report)
    return 0
