"""``orepa export``: deploy a zoo model (reparameterize + fold BN) and export it to ONNX, an
ExportedProgram (``torch.export``) or TorchScript.

Library use::

    from orepa.apps.export import export_exported_program, export_onnx, export_torchscript
    report = export_onnx(model, "model.onnx", (1, 3, 224, 224))   # verified with onnxruntime
    print(report)

A model may return one tensor (a classifier), or a dict, tuple or list of tensors (a segmenter's
``out`` / ``aux``, a detector backbone's feature maps): each is an output of the export, by the name
:func:`named_outputs` gives it, and each is checked.

Each function puts the model in eval mode, deploys it with
``orepa.reparameterize(model, fuse_bn=True)`` (a plain conv net, every BN folded),
export the deployed model, and (``verify=True``) check on a random input that

* the deployed PyTorch model equals the training-form model in eval mode, and
* the exported artifact (onnxruntime / the reloaded ExportedProgram / TorchScript module)
  equals the deployed PyTorch model (ONNX and ExportedProgram: at two batch sizes, their batch
  axis being dynamic; with ``dynamic_size=True``, every format also at two other heights and widths,
  :func:`dynamic_axes`),

each to ``max|y - y_ref| <= atol * (1 + max|y_ref|)`` (default ``atol=1e-4`` in float32;
the test-suite's reparameterization bound is 1e-5 in the same form). A failed check raises
:class:`ExportVerificationError` and writes nothing: the file is written to a temporary
name, checked there and only then renamed into place.

An ONNX file is self-contained (its weights inside it, so a model over protobuf's 2 GiB
limit is refused: export it to TorchScript). The packages an ONNX export needs
(onnx; onnxscript for ``dynamo=True``; onnxruntime to verify) and the opset are checked
before anything is built (:func:`check_onnx_request`).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import io
import json
import logging
import math
import os
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..blocks import ReparamConv2d
from . import checkpoint as ckpt_io
from .common import (
    CheckFailed,
    UserError,
    add_run_arguments,
    add_use_ema_argument,
    apply_threads,
    count_params,
    error_text,
    init_distributed,
    path_arg,
    positive_float,
    positive_int,
    refuse_idle_flags,
    tolerance_bound,
)
from .model_cfg import (
    add_model_arguments,
    build_model,
    check_model_takes,
    checkpoint_cfg_without_data,
    describe_cfg,
    external_source,
    model_cfg_from_args,
    model_slug,
)
from .model_cfg import deploy as deploy_form

__all__ = ["deploy_fused", "export_onnx", "export_exported_program", "export_torchscript", "load_model_file",
           "check_onnx_request", "onnx_opset_range", "default_opset", "dynamic_axes", "named_outputs", "ExportReport",
           "ExportVerificationError",
           "FORMATS", "export_format", "export_metadata", "export_records", "load_export", "OnnxModel",
           "add_arguments", "run"]


class ExportVerificationError(RuntimeError):
    """The exported model does not compute what the PyTorch model computes (to the stated tolerance)."""


@dataclass
class ExportReport:
    path: str
    format: str
    input_shape: tuple[int, ...]
    params_training: int  # the model as given (training form, or a form already deployed)
    params_deployed: int
    verified: bool = False
    atol: float = 1e-4
    errors: dict[str, float] = field(default_factory=dict)  # check -> max abs error
    bounds: dict[str, float] = field(default_factory=dict)  # check -> atol * (1 + max|reference|)
    opset: int | None = None  # ONNX: the opset the file holds ...
    opset_requested: int | None = None  # ... and the one asked for
    dynamic: tuple[str, ...] = ()  # the input's axes the export takes at any size ("batch", "height", "width")

    def __str__(self) -> str:
        fmt = f"{self.format} opset {self.opset}" if self.opset is not None else self.format
        dynamic = f"; any {', '.join(self.dynamic)}" if self.dynamic else ""
        lines = [f"exported {fmt} to {self.path} (input {list(self.input_shape)}{dynamic}); "
                 f"params {self.params_training:,} (as loaded) -> {self.params_deployed:,} (deployed, BN folded)"]
        if self.opset_requested is not None and self.opset != self.opset_requested:
            lines.append(f"  note: opset {self.opset} written, not the {self.opset_requested} asked for (the exporter "
                         "could not convert its graph to that opset)")
        if self.verified:
            lines += [f"  {k}: max abs err {v:.3e} <= {self.bounds[k]:.3e} = {self.atol:g} * (1 + max|y_ref|)"
                      for k, v in self.errors.items()]
        else:
            lines.append("  not verified")
        return "\n".join(lines)


def _in_eval_mode(fn):
    """``fn(model, ...)`` with ``model`` in eval mode (its BNs' statistics are what is folded and
    compared), each of its modules given back its own mode after: a training loop that exports a
    snapshot goes on training."""
    @functools.wraps(fn)
    def wrapper(model: nn.Module, *args, **kwargs):
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            return fn(model, *args, **kwargs)
        finally:
            for m, training in modes:
                m.training = training
    return wrapper


@_in_eval_mode
@torch.no_grad()
def deploy_fused(model: nn.Module) -> nn.Module:
    """The inference form of ``model`` (a copy, in eval mode): every re-param block a conv, every BN
    folded."""
    return deploy_form(model, "deploy-fused").eval()


def _check(report: ExportReport, name: str, y, ref) -> None:
    """``y`` against ``ref`` (a tensor, or the named outputs of :func:`named_outputs`), each output
    within the report's bound; a check per output is named ``name [output]`` where there are several."""
    y, ref = named_outputs(y), named_outputs(ref)
    if list(y) != list(ref):
        report.errors[name], report.bounds[name] = float("inf"), 0.0
        raise ExportVerificationError(f"{name}: outputs {list(y)} vs {list(ref)} for {report.path}")
    for key in ref:
        _check_one(report, name if len(ref) == 1 else f"{name} [{key}]", y[key], ref[key])


def _check_one(report: ExportReport, name: str, y: torch.Tensor, ref: torch.Tensor) -> None:
    y, ref = y.float().cpu(), ref.float().cpu()
    if y.shape != ref.shape:  # (an exported graph that computes another size: a verification failure too)
        report.errors[name], report.bounds[name] = float("inf"), 0.0
        raise ExportVerificationError(f"{name}: output shape {list(y.shape)} vs {list(ref.shape)} for {report.path}")
    err = (y - ref).abs().max().item()
    bound = tolerance_bound(ref, report.atol)
    report.errors[name], report.bounds[name] = err, bound
    if not err <= bound:  # also catches NaN
        raise ExportVerificationError(f"{name}: max abs error {err:.3e} > {bound:.3e} "
                                      f"(= {report.atol:g} * (1 + max|y|)) for {report.path}")


INPUT_NAME = "input"  # the name of an ONNX export's one input


def named_outputs(y) -> dict[str, torch.Tensor]:
    """A model's output as name -> tensor, the names an export gives its outputs: one tensor is
    ``output``; a mapping's keys are its names (torchvision's segmenters: ``out``, and ``aux`` where
    they have an auxiliary head), a key of digits prefixed (a detector's backbone: its feature maps
    ``output0`` ... ``output3`` and ``pool``; TorchScript takes no name of digits), and so is a key
    ``input`` (``outputinput``: an ONNX graph's input has that name); a tuple or list's items are
    ``output0``, ``output1``, ... Another output (a detector's list of dicts of boxes, whose count
    varies per image) is refused with :class:`UserError`."""
    if isinstance(y, torch.Tensor):
        return {"output": y}
    if isinstance(y, Mapping) and y and all(isinstance(v, torch.Tensor) for v in y.values()):
        named = {f"output{k}" if str(k).isdigit() or str(k) == INPUT_NAME else str(k): v for k, v in y.items()}
        return named if len(named) == len(y) else {f"output{i}": v for i, v in enumerate(y.values())}
    if isinstance(y, (tuple, list)) and y and all(isinstance(v, torch.Tensor) for v in y):
        return {f"output{i}": v for i, v in enumerate(y)}
    raise UserError(f"the model returns {_structure(y)}: an export takes a model whose output is a tensor, or a "
                    "dict, tuple or list of tensors (a detector's boxes are not: export its backbone, e.g. "
                    "model.backbone, whose output is a dict of feature maps, and run the heads in PyTorch)")


def _structure(y, depth: int = 0) -> str:
    """``y``'s type, with its items' types (``list[dict[str, Tensor]]``), for an error message."""
    name = "Tensor" if isinstance(y, torch.Tensor) else type(y).__name__
    if depth < 2 and isinstance(y, Mapping) and y:
        k, v = next(iter(y.items()))
        return f"{name}[{type(k).__name__}, {_structure(v, depth + 1)}]"
    if depth < 2 and isinstance(y, (tuple, list)) and y:
        return f"{name}[{_structure(y[0], depth + 1)}]"
    return name + (" (empty)" if isinstance(y, (Mapping, tuple, list)) and not y else "")


def _deploy_check(model: nn.Module) -> str:
    """The name of the check of the deployed model against ``model``: its training form, or, given a
    model without re-param blocks (a deployed checkpoint), that model with its BNs (nothing to
    compare where none is left: it says so)."""
    if any(isinstance(m, ReparamConv2d) for m in model.modules()):
        return "deployed vs training form"
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return "BN folded vs the model loaded"
    return "deployed vs the model loaded (already deployed)"


def _example(input_shape, seed: int = 0, device=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*input_shape, generator=g).to(device)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


#: what an ONNX export imports: module -> why (the pip package has the module's name)
_ONNX_NEEDS = {"onnx": "ONNX export", "onnxscript": "--dynamo export", "onnxruntime": "verification"}


def onnx_opset_range(dynamo: bool = False) -> tuple[int, int] | None:
    """The opsets the installed torch's ONNX exporter supports, from torch's own constants
    (None where this torch does not say: then torch itself judges)."""
    try:
        from torch.onnx import _constants as c

        low, high = int(c.ONNX_MIN_OPSET), int(c.ONNX_MAX_OPSET)
    except (ImportError, AttributeError):
        return None
    if not dynamo:  # the TorchScript-based exporter stops earlier (torch warns above it, fails further up)
        high = int(getattr(c, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", high))
    return low, high


def check_onnx_request(opset: int, *, dynamo: bool = False, verify: bool = True) -> None:
    """Raise :class:`UserError` before any work if a package the export needs is missing or
    ``opset`` is outside what the exporter supports (found out otherwise only at its end)."""
    needed = ["onnx"] + ["onnxscript"] * dynamo + ["onnxruntime"] * verify
    missing = []
    for module in needed:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append((module, exc))
    if missing:
        what = ", ".join(f"{m} (for {_ONNX_NEEDS[m]}: {exc})" for m, exc in missing)
        hint = " or pass --no-verify" if [m for m, _ in missing] == ["onnxruntime"] else ""
        raise UserError(f"missing package(s) {what}: pip install {' '.join(m for m, _ in missing)} "
                        f"(or the apps extra: pip install 'orepa[apps]'){hint}")
    if dynamo and not _has_dynamo_exporter():
        raise UserError(f"--dynamo: the torch.export-based ONNX exporter is torch 2.5's and later's (this is torch "
                        f"{torch.__version__}); leave the flag out for the TorchScript-based one")
    bounds = onnx_opset_range(dynamo)
    if dynamo and bounds:  # its lowest (asked for less it logs a failed down-conversion and writes 18)
        bounds = (max(bounds[0], default_opset(True)), bounds[1])
    if bounds and not bounds[0] <= opset <= bounds[1]:
        exporter = "dynamo (--dynamo)" if dynamo else "TorchScript-based"
        raise UserError(f"--opset {opset} is outside the opsets {bounds[0]}..{bounds[1]} that the {exporter} ONNX "
                        f"exporter of torch {torch.__version__} supports")


@torch.no_grad()
def default_opset(dynamo: bool = False) -> int:
    """The opset written when none is asked for: 17 (the TorchScript-based exporter's long-standing
    default, read by most runtimes), 18 for the dynamo exporter, whose lowest it is (asked for 17,
    it tries a down-conversion that fails with a logged traceback, then writes 18)."""
    return 18 if dynamo else 17


@_in_eval_mode
def export_onnx(model: nn.Module, path, input_shape=(1, 3, 224, 224), *, opset: int | None = None, verify: bool = True,
                atol: float = 1e-4, dynamic_batch: bool = True, dynamic_size: bool = False, dynamo: bool = False,
                metadata: Mapping[str, str] | None = None) -> ExportReport:
    """Deploy ``model`` and export it to ONNX at ``path`` (one self-contained file); verify with onnxruntime.

    Args:
        input_shape: ``(N, C, H, W)`` of the example input (the batch axis is dynamic
            unless ``dynamic_batch=False``; height and width with ``dynamic_size=True``, see
            :func:`dynamic_axes`).
        opset: ONNX opset version (:func:`onnx_opset_range`; default :func:`default_opset`); the
            report says the one written, which the dynamo exporter may raise to its lowest (18 in
            torch 2.5-2.14).
        verify: compare deployed vs training form and onnxruntime vs PyTorch (see module doc).
        atol: the bound is ``atol * (1 + max|y_ref|)`` on the max abs error.
        dynamo: use the torch.export-based exporter (slower); default the TorchScript-based one.
        metadata: key -> text stored in the model's ``metadata_props`` (``export`` stores ``classes``,
            the class names as a JSON list, where the checkpoint has them, and :data:`SOURCE_KEY`).
    """
    opset = default_opset(dynamo) if opset is None else opset
    check_onnx_request(opset, dynamo=dynamo, verify=verify)
    import onnx

    deployed = deploy_fused(model)
    size = sum(t.numel() * t.element_size() for t in deployed.state_dict().values())
    if size >= onnx.checker.MAXIMUM_PROTOBUF:  # protobuf's limit on one message: refuse before exporting
        raise UserError(f"the deployed model's weights take {size / 2**30:.2f} GiB: over the 2 GiB that one ONNX "
                        "file can hold; export it with --format exported-program (or torchscript)")
    dynamic = dynamic_axes(dynamic_batch, dynamic_size, torch_export=dynamo)
    if dynamic_size:
        _refuse_fixed_pools(deployed)
    x = _example(input_shape, device=_device(model))
    _onnx_adaptive_pools(deployed)
    with torch.no_grad():
        y_dep = deployed(x)  # (its outputs' names, and the reference the verification reads)
    outputs = named_outputs(y_dep)
    report = ExportReport(str(path), "onnx", tuple(input_shape), count_params(model), count_params(deployed),
                          atol=atol, opset_requested=opset, dynamic=dynamic)
    # The exporter may put the weights in side files named after its target (dynamo: "<target>.data"),
    # so it writes into a private temporary directory; the model is re-saved from there as one file.
    try:
        with tempfile.TemporaryDirectory(prefix="orepa-export-") as work:
            raw = str(Path(work, "model.onnx"))  # torch's writers take no file name that is not UTF-8
            _export_raw(deployed, raw, x, opset, outputs, dynamic, dynamo)
            proto = onnx.load(raw)  # with the weights of any external-data file
    except OSError as exc:  # a full (or read-only) temporary directory: torch's write names no file
        raise UserError(f"cannot write the ONNX exporter's temporary file in {tempfile.gettempdir()}: "
                        f"{exc.strerror or exc} (the environment variable TMPDIR names another directory for "
                        "it)") from None
    report.opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if metadata:
        onnx.helper.set_model_props(proto, dict(metadata))
    with ckpt_io.atomic_path(path) as tmp:
        onnx.save_model(proto, str(tmp))
        if verify:
            _verify_onnx(model, deployed, str(tmp), x, y_dep, report, dynamo)
    return report


def _export_raw(deployed, path: str, x, opset, outputs, dynamic, dynamo) -> None:
    try:
        _export_with_torch(deployed, path, x, opset, outputs, dynamic, dynamo)
    except torch.onnx.OnnxExporterError as exc:  # an operator the opset lacks (Pad before 11, ...): said in one line
        text = error_text(exc, all_lines=True, typed=False, trailer=" [Caused by")
        hint = "; a higher --opset may have it" if "opset" in text.lower() else ""
        raise UserError(f"the ONNX exporter cannot write this model at opset {opset}: {text}{hint}") from None


def _export_with_torch(deployed, path: str, x, opset, outputs, dynamic, dynamo) -> None:
    """``torch.onnx.export`` of ``deployed`` on ``x``, its outputs named as ``outputs`` (:func:`named_outputs`),
    the input's axes ``dynamic`` (:func:`dynamic_axes`) at any size."""
    names = list(outputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if dynamo:
            torch.onnx.export(deployed, (x,), path, dynamo=True, opset_version=opset, input_names=[INPUT_NAME],
                              output_names=names, dynamic_shapes=_export_shapes(dynamic))
        else:
            # the outputs' axes by name too: a feature map's height and width follow the input's
            axes = {INPUT_NAME: {i: a for i, a in enumerate(_NCHW) if a in dynamic}} | {
                name: {i: f"{name}_{a}" if i else a for i, a in enumerate(_NCHW[:y.dim()]) if a in dynamic}
                for name, y in outputs.items()}
            dyn = {name: named for name, named in axes.items() if named} or None
            # (the TorchScript-based exporter: asked for by name where the choice exists, torch 2.5 on, whose
            # default became dynamo's in 2.9; before 2.5 it is the only one, and the keyword a TypeError)
            choice = {"dynamo": False} if _has_dynamo_exporter() else {}
            torch.onnx.export(deployed, (x,), path, **choice, opset_version=opset, input_names=[INPUT_NAME],
                              output_names=names, dynamic_axes=dyn)


def _has_dynamo_exporter() -> bool:
    """Whether this torch's ``torch.onnx.export`` takes ``dynamo=`` (torch 2.5 on)."""
    return "dynamo" in inspect.signature(torch.onnx.export).parameters


@torch.no_grad()
def _verify_onnx(model, deployed, path: str, x, y_dep, report, dynamo: bool) -> None:
    import onnx
    import onnxruntime as ort

    serialized = Path(path).read_bytes()  # as bytes: the C++ readers take no file name that is not UTF-8
    onnx.checker.check_model(onnx.load_model_from_string(serialized))
    _check(report, _deploy_check(model), y_dep, model(x))
    sess = ort.InferenceSession(serialized, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]

    def run(xi: torch.Tensor) -> dict[str, torch.Tensor]:
        outs = sess.run(None, {sess.get_inputs()[0].name: xi.cpu().numpy()})
        return {name: torch.from_numpy(out) for name, out in zip(names, outs)}

    _check_inputs(report, "onnxruntime vs pytorch", run, deployed, x, y_dep, traced_by_export=dynamo)
    report.verified = True


class _OnnxAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` in a form torch's ONNX exporter writes at every size: where the output
    size divides the input's, torch's own operator (written as an AveragePool); elsewhere, which the
    exporter refuses ("output size that are not factor of input size": PSPNet's bins 3 and 6 on the
    64 x 128 map of a 512 x 1024 image), the same means as a product with each axis's averaging matrix
    (the windows overlap there, so no AveragePool computes them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _global_pool(self):  # (the input's sizes not read: they stay dynamic where the export's are)
            return super().forward(x)
        with warnings.catch_warnings():  # the sizes are the example's: what the export fixes anyway
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            h, w = (int(n) for n in x.shape[-2:])
        size = _pool_size(self)
        oh, ow = (n if s is None else s for s, n in zip(size, (h, w)))
        if h % oh == 0 and w % ow == 0:
            return super().forward(x)
        return _window_means(oh, h, x) @ x @ _window_means(ow, w, x).T


def _window_means(m: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """The (m, n) matrix of adaptive average pooling from n to m: row i averages the inputs
    ``floor(i n / m) .. ceil((i + 1) n / m) - 1``, the windows of ``torch.nn.AdaptiveAvgPool2d``."""
    i = torch.arange(m, device=like.device)
    start, end = (i * n) // m, ((i + 1) * n + m - 1) // m
    j = torch.arange(n, device=like.device)
    inside = (j >= start[:, None]) & (j < end[:, None])
    return inside.to(like.dtype) / (end - start).to(like.dtype)[:, None]


def _pool_size(pool: nn.AdaptiveAvgPool2d) -> tuple:
    return tuple(pool.output_size) if isinstance(pool.output_size, (tuple, list)) else (pool.output_size,) * 2


def _global_pool(pool: nn.AdaptiveAvgPool2d) -> bool:
    """Whether ``pool`` averages whole feature maps (output 1 x 1): ONNX's GlobalAveragePool, at any size."""
    return all(s == 1 for s in _pool_size(pool))


def _refuse_fixed_pools(deployed: nn.Module) -> None:
    """An ONNX export at any height and width is refused for a model whose adaptive average pools
    pool to a grid (PSPNet's bins): ONNX writes them for the example's size only."""
    fixed = [f"{name} ({list(_pool_size(m))})" for name, m in deployed.named_modules()
             if isinstance(m, nn.AdaptiveAvgPool2d) and not _global_pool(m)]
    if fixed:
        raise UserError(f"an ONNX export at any height and width cannot hold adaptive average pooling to a grid, "
                        f"which ONNX writes for the example's size only: {', '.join(fixed[:3])}"
                        f"{' ...' if len(fixed) > 3 else ''}; export at one size (without dynamic height and width), "
                        "or as an ExportedProgram")


#: the axes of an image batch, as :func:`dynamic_axes` names them
_NCHW = ("batch", "channels", "height", "width")


def dynamic_axes(dynamic_batch: bool, dynamic_size: bool, *, torch_export: bool = False) -> tuple[str, ...]:
    """The axes of the input that an export takes at any size: ``batch`` and ``height``, ``width``.
    An export at any height and width is verified at a second size too (:func:`_check_inputs`), where
    the format has no dynamic axes (TorchScript) as well. ``torch_export``: the export traces with
    ``torch.export``, which finds the sizes a network takes itself (``Dim.AUTO``, torch 2.6 on): a
    :class:`UserError` on an older torch."""
    if dynamic_size and torch_export and not hasattr(torch.export.Dim, "AUTO"):
        raise UserError(f"an export by torch.export at any height and width needs torch >= 2.6 (Dim.AUTO); this is "
                        f"torch {torch.__version__}: export at one size, or with the TorchScript-based ONNX exporter")
    return (("batch",) if dynamic_batch else ()) + (("height", "width") if dynamic_size else ())


def _export_shapes(dynamic: tuple[str, ...]):
    """``torch.export``'s ``dynamic_shapes`` for the one input (by position: a spec keyed by name fit only
    a forward whose argument is called x, not nn.Sequential's input). The height and width as
    ``Dim.AUTO``: a ResNet's strided layers give sizes that a named Dim would have to bound."""
    if not dynamic:
        return None
    spec = {0: torch.export.Dim("batch")} if "batch" in dynamic else {}
    spec |= {i: torch.export.Dim.AUTO for i, a in enumerate(_NCHW) if a in dynamic and a != "batch"}
    return (spec,)


def _onnx_adaptive_pools(deployed: nn.Module) -> None:
    """Make the (private, deployed) copy's adaptive average pools :class:`_OnnxAdaptiveAvgPool2d`s."""
    for m in deployed.modules():
        if type(m) is nn.AdaptiveAvgPool2d:
            m.__class__ = _OnnxAdaptiveAvgPool2d  # a subclass with no state of its own: the module is unchanged


#: why an export traced by torch.export may not run at another height and width
_SPECIALISED = ("; it fixed a size that the example's made 1 (a feature map of one pixel, which torch.export "
                "specialises): a larger example size may not")


def _check_inputs(report: ExportReport, name: str, run, deployed: nn.Module, x: torch.Tensor,
                  y_dep: torch.Tensor, *, traced_by_export: bool = False) -> None:
    """``run`` (the reloaded export) against the deployed model at the example's batch, at one more
    image where the export's batch axis is dynamic, and where its height and width are
    (``report.dynamic``) at 32 more rows and 64 more columns (a multiple of a network's stride stays
    one), then at one more row and column than that: odd sizes, where a stride's rounding and
    "same" padding differ (a size the model itself does not take, as a network whose skips need even
    sizes, is left out). ``traced_by_export``: the export was traced by torch.export (an input it does
    not take is said with :data:`_SPECIALISED`)."""
    n = x.shape[0] + ("batch" in report.dynamic)
    # (input, its reference or None to compute, whether a size the model itself refuses is left out)
    xs = [(x, y_dep, False)]
    if "batch" in report.dynamic:
        xs.append((_example((n, *x.shape[1:]), 1, x.device), None, False))
    if "height" in report.dynamic:
        h, w = x.shape[2] + 32, x.shape[3] + 64
        xs += [(_example((n, x.shape[1], h, w), 2, x.device), None, False),
               (_example((n, x.shape[1], h + 1, w + 1), 3, x.device), None, True)]
    for i, (xi, ref, optional) in enumerate(xs):
        check = f"{name} (batch {xi.shape[0]}" + (f", {xi.shape[2]}x{xi.shape[3]})" if xi.shape[2:] != x.shape[2:]
                                                  else ")")
        if ref is None:
            try:
                ref = deployed(xi)
            except Exception as exc:  # noqa: BLE001 - what the model's own forward refuses at that size
                if optional:
                    continue
                raise UserError(f"an export at any height and width: the model itself does not take an input of "
                                f"shape {list(xi.shape)} ({error_text(exc)}); export it at one size") from None
        try:
            y = run(xi)
        except Exception as exc:  # noqa: BLE001 - a runtime's error on an input it does not take (sizes fixed)
            if not i:
                raise
            report.errors[check], report.bounds[check] = float("inf"), 0.0
            raise ExportVerificationError(
                f"{check}: the export does not run on an input of shape {list(xi.shape)} ({error_text(exc)}) for "
                f"{report.path}" + (_SPECIALISED if traced_by_export else "")) from None
        _check(report, check, y, ref)


@_in_eval_mode
@torch.no_grad()
def export_torchscript(model: nn.Module, path, input_shape=(1, 3, 224, 224), *, verify: bool = True,
                       atol: float = 1e-4, dynamic_size: bool = False,
                       metadata: Mapping[str, str] | None = None) -> ExportReport:
    """Deploy ``model``, ``torch.jit.trace`` it and save it at ``path``; verify the reloaded module
    (at another batch size, and with ``dynamic_size`` at another height and width too: a trace has no
    fixed sizes but those its Python read as numbers). ``metadata`` (key -> text) is saved as extra
    files of the archive (``torch.jit.load(path, _extra_files={"classes": ""})`` reads them)."""
    deployed = deploy_fused(model)
    x = _example(input_shape, device=_device(model))
    report = ExportReport(str(path), "torchscript", tuple(input_shape), count_params(model), count_params(deployed),
                          atol=atol, dynamic=dynamic_axes(True, dynamic_size) if dynamic_size else ())
    with warnings.catch_warnings(), ckpt_io.atomic_path(path) as tmp:
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*deprecated.*")
        traced = torch.jit.trace(deployed, x, strict=False)  # (not strict: a dict of outputs, as a segmenter's)
        with open(tmp, "wb") as f:  # a file object: torch's writer takes no file name that is not UTF-8
            torch.jit.save(traced, f, _extra_files=dict(metadata or {}))
        if verify:
            with open(tmp, "rb") as f:
                loaded = torch.jit.load(f)
            y_train, y_dep = model(x), deployed(x)
            _check(report, _deploy_check(model), y_dep, y_train)
            if dynamic_size:
                _check_inputs(report, "torchscript vs pytorch", loaded, deployed, x, y_dep)
            else:
                _check(report, "torchscript vs pytorch", loaded(x), y_dep)
            report.verified = True
    return report


@_in_eval_mode
@torch.no_grad()
def export_exported_program(model: nn.Module, path, input_shape=(1, 3, 224, 224), *, verify: bool = True,
                            atol: float = 1e-4, dynamic_batch: bool = True, dynamic_size: bool = False,
                            metadata: Mapping[str, str] | None = None) -> ExportReport:
    """Deploy ``model``, ``torch.export.export`` it and ``torch.export.save`` the ExportedProgram at
    ``path`` (a ``.pt2`` archive: the graph of aten operators and the weights, no Python code; what
    AOTInductor (``torch._inductor.aoti_compile_and_package``) and ExecuTorch take); verify the
    reloaded program's module. The batch axis is dynamic unless ``dynamic_batch=False``; height and
    width with ``dynamic_size`` (:func:`dynamic_axes`).
    ``metadata`` (key -> text) is saved as the archive's extra files (``torch.export.load(path,
    extra_files={"classes": ""})`` reads them)."""
    deployed = deploy_fused(model)
    x = _example(input_shape, device=_device(model))
    dynamic = dynamic_axes(dynamic_batch, dynamic_size, torch_export=True)
    report = ExportReport(str(path), "exported-program", tuple(input_shape), count_params(model),
                          count_params(deployed), atol=atol, dynamic=dynamic)
    # torch.export fixes a size of 1 to 1 (its 0/1 specialisation): a dynamic batch is traced on two images
    traced_on = _example((2, *input_shape[1:]), device=x.device) if dynamic_batch and input_shape[0] == 1 else x
    program = _torch_export(deployed, traced_on, _export_shapes(dynamic))
    with ckpt_io.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:  # a file object, as for TorchScript
            torch.export.save(program, f, extra_files=dict(metadata or {}))
        if verify:
            with open(tmp, "rb") as f:
                loaded = torch.export.load(f).module()
            y_train, y_dep = model(x), deployed(x)
            _check(report, _deploy_check(model), y_dep, y_train)
            _check_inputs(report, "exported program vs pytorch", loaded, deployed, x, y_dep, traced_by_export=True)
            report.verified = True
    return report


def _torch_export(deployed: nn.Module, x: torch.Tensor, dims):
    """``torch.export.export``, a failure said in one line (:class:`UserError`). torch also prints the
    partial graph of a failed trace to stderr (what it prints is held, and written out only where the
    export succeeds) and logs a warning on the symbols it could not place (that logger says only
    errors while the export runs)."""
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level, printed = shapes_log.level, io.StringIO()
    shapes_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(printed):
            program = torch.export.export(deployed, (x,), dynamic_shapes=dims)
    except Exception as exc:  # noqa: BLE001 - torch.export's many error types: what a model does that it cannot trace
        raise UserError(f"torch.export cannot export this model ({error_text(exc)}); --format onnx or torchscript "
                        "may") from exc
    finally:
        shapes_log.setLevel(level)
    sys.stderr.write(printed.getvalue())
    return program


#: ``--format`` -> (its default file suffix, what a file of it is called)
FORMATS = {"onnx": (".onnx", "an ONNX model"), "exported-program": (".pt2", "an ExportedProgram (torch.export)"),
           "torchscript": (".pt", "a TorchScript module")}


# --------------------------------------------------------------------------- checkpoints

#: labels of the model forms a checkpoint may hold
FORM_NAMES = {"train": "training form", "deploy": "deployed form", "deploy-fused": "deployed form, BN folded"}


def load_model_file(name: str, method: str, path, **create_kwargs) -> tuple[nn.Module, str]:
    """Build ``create_model(name, method, **create_kwargs)`` and load a checkpoint into it.

    The checkpoint (read by :func:`orepa.apps.checkpoint.load_checkpoint`: ``weights_only``,
    wrappers and ``module.`` prefixes removed) may hold the training form's state_dict, the
    deployed form's (``reparameterize(model)``: the base layout) or the BN-folded deployed
    form's. Returns ``(model, form label)``; raises :class:`UserError` naming the differences
    if no form fits.
    """
    common = {k: create_kwargs.pop(k) for k in ("num_classes", "in_chans", "small_input", "width_mult")
              if k in create_kwargs}
    cfg = {"model": name, "method": method, "num_classes": int(common.get("num_classes", 1000)),
           "in_chans": int(common.get("in_chans", 3)), "small_input": bool(common.get("small_input", False)),
           "width_mult": float(common.get("width_mult", 1.0)), "options": dict(create_kwargs)}
    ckpt = ckpt_io.load_checkpoint(path)
    model, _, form = ckpt_io.model_from_checkpoint(ckpt, path, cfg=cfg)
    return model, FORM_NAMES[form]


def _trained_on_fashion_mnist(saved: dict) -> bool:
    """Whether a checkpoint's run (its ``args``) read Fashion-MNIST: --dataset fashion-mnist, or a
    --data-path naming it where --dataset was auto (``--dataset imagefolder`` reads a folder of that name)."""
    from .data import names_fashion_mnist

    dataset = saved.get("dataset") or "auto"
    return dataset == "fashion-mnist" or (dataset == "auto" and names_fashion_mnist(saved.get("data_path",
                                                                                           "fashion-mnist")))


def input_size_of(ckpt: dict) -> int | None:
    """The image size a checkpoint's training run used (28 for Fashion-MNIST), if it says."""
    from .data import saved_val_sizes

    saved = ckpt.get("args") or {}
    if not saved:
        return None
    return 28 if _trained_on_fashion_mnist(saved) else saved_val_sizes(saved)[1]


def preprocessing_of(ckpt: dict, in_chans: int) -> dict | None:
    """How the checkpoint's run made its validation images into tensors (what an exported model's
    input must be: without it a model fed pixels in [0, 1] scores at chance), if it says: pixels
    scaled to [0, 1], then per channel ``(x - mean) / std``, after ImageFolder's resize and centre crop."""
    from .data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, IMAGENET_MEAN, IMAGENET_STD, saved_val_sizes

    saved = ckpt.get("args") or {}
    if not saved:
        return None
    if _trained_on_fashion_mnist(saved):
        return {"image": "grayscale 28x28 (Fashion-MNIST)", "scale": "pixel / 255",
                "mean": list(FASHION_MNIST_MEAN), "std": list(FASHION_MNIST_STD)}
    if in_chans != len(IMAGENET_MEAN):
        return None
    resize, crop = saved_val_sizes(saved)
    return {"image": "RGB", "resize": resize, "center_crop": crop, "scale": "pixel / 255",
            "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}


def is_export(path: Path, fmt: str) -> bool:
    """Whether ``path`` holds an earlier export of format ``fmt``: what export replaces without
    --overwrite, where it was made from the same source (:func:`export_source`; any other file is
    refused). TorchScript: a zip archive with code (a checkpoint has none); ExportedProgram: a zip
    that says it is one; ONNX: a model with a graph (loaded without its external data)."""
    if not path.is_file():
        return False
    return {"torchscript": ckpt_io.is_torchscript, "exported-program": ckpt_io.is_exported_program,
            "onnx": ckpt_io.is_onnx}[fmt](path)


#: the metadata entry in which an export records what it was made from: ``{"checkpoint": its absolute
#: path, or None for a randomly initialised model, "ema": --use-ema, "model_cfg": the model}`` as JSON
SOURCE_KEY = "source"


def export_format(path) -> str | None:
    """The ``--format`` of the export at ``path`` (:func:`is_export`), None for any other file. ONNX is
    looked for only in a file that is neither a zip archive nor a pickle (a checkpoint is one of them,
    torch's legacy format a pickle, and parsing one as protobuf would cost its size)."""
    path = Path(path)
    if not path.is_file():
        return None
    if zipfile.is_zipfile(path):
        return next((fmt for fmt in ("torchscript", "exported-program") if is_export(path, fmt)), None)
    try:
        with open(path, "rb") as f:
            pickled = f.read(1) == b"\x80"  # pickle's PROTO opcode; no ONNX model starts with it
    except OSError:
        return None
    return "onnx" if not pickled and is_export(path, "onnx") else None


def export_metadata(path, fmt: str) -> dict[str, str]:
    """The metadata an export of format ``fmt`` carries (key -> text): the ONNX model's metadata_props,
    the TorchScript or ExportedProgram archive's extra files (read from the zip: loading the module
    would run its code, the program would deserialize the whole graph). Raises what the reader raises
    for a damaged file."""
    if fmt == "onnx":
        import onnx

        with open(path, "rb") as f:  # (a file object: onnx's path reader takes no name that is not UTF-8)
            return {p.key: p.value for p in onnx.load_model(f, load_external_data=False).metadata_props}
    # the entries <archive name>/extra/<key> (torch.export.save before torch 2.6: extra_files/<key>)
    with zipfile.ZipFile(path) as archive:
        return {parts[-1]: archive.read(n).decode() for n in archive.namelist()
                if len(parts := n.split("/")) >= 2 and parts[-2] in ("extra", "extra_files") and parts[-1]}


def export_records(path, fmt: str) -> dict:
    """The JSON values an export records (:data:`SOURCE_KEY`, ``classes``, ``preprocessing``), read
    once: an entry that is no JSON is left out, and a file that cannot be read records nothing (an
    older orepa's export, another tool's model may record none)."""
    try:
        metadata = export_metadata(path, fmt)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, a torn zip: no record
        return {}
    records = {}
    for key, text in metadata.items():
        try:
            records[key] = json.loads(text)
        except ValueError:
            pass
    return records


def export_source(path: Path, fmt: str) -> dict | None:
    """What an earlier export of format ``fmt`` at ``path`` records of its source (:data:`SOURCE_KEY`),
    None where it records none."""
    held = export_records(path, fmt).get(SOURCE_KEY)
    return held if isinstance(held, dict) else None


class OnnxModel(nn.Module):
    """An ONNX model run by onnxruntime as a module: tensors in and out on the caller's device (the
    session runs on the CPU, or on CUDA where onnxruntime has that provider and the input is there)."""

    def __init__(self, path, device: torch.device):
        super().__init__()
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # (--threads, as for torch)
        cuda = device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers()
        self.provider = "CUDAExecutionProvider" if cuda else "CPUExecutionProvider"
        serialized = Path(path).read_bytes()
        self.session = ort.InferenceSession(serialized, options, providers=[self.provider])
        self.input_name = self.session.get_inputs()[0].name
        import onnx

        floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
        self.params = sum(math.prod(t.dims) for t in onnx.load_model_from_string(serialized).graph.initializer
                          if t.data_type in floats)  # the weights (not the graph's integer shape constants)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.session.run(None, {self.input_name: x.detach().float().cpu().numpy()})[0]
        return torch.from_numpy(y).to(x.device)


class _TracedInEvalMode(nn.Module):
    """An ExportedProgram's module, whose ``eval()`` and ``train()`` raise (torch: "not supported
    yet"): its graph was traced in eval mode, so there is nothing to switch. Held outside the module
    tree, which ``eval()`` walks."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.__dict__["program"] = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.program(x)


def load_export(path, fmt: str, device: torch.device) -> tuple[nn.Module, str, int]:
    """The exported model at ``path`` as a module on ``device``, what runs it (onnxruntime and its
    execution provider, the ExportedProgram's module from ``torch.export.load``, the TorchScript
    module from ``torch.jit.load``) and its number of weights."""
    if fmt == "onnx":
        model = OnnxModel(path, device)
        return model, f"onnxruntime ({model.provider})", model.params
    with open(path, "rb") as f:  # (file objects: torch's readers take no file name that is not UTF-8)
        if fmt == "exported-program":
            module = torch.export.load(f).module().to(device)
            return _TracedInEvalMode(module), "torch.export.load", count_params(module)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deprecated.*")
            module = torch.jit.load(f, map_location=device)
        return module, "torch.jit.load", count_params(module)


def _described(source: dict) -> str:
    """An export's source as said: the checkpoint (and whether its EMA weights), or the model exported at
    initialisation."""
    try:
        model = describe_cfg(source["model_cfg"])
    except (KeyError, TypeError, ValueError):
        model = "a model it does not describe"
    if source.get("checkpoint"):
        return f"{source['checkpoint']}{ckpt_io.EMA_NOTE if source.get('ema') else ''}, {model}"
    return f"a randomly initialised model, {model}"


def _check_previous(out: Path, fmt: str, source: dict, overwrite: bool) -> None:
    """An earlier export at ``out`` (all that :func:`_check_output` lets through) of another checkpoint,
    of its other weights (--use-ema) or of another model is replaced only with --overwrite; a rerun on
    the same source replaces its own, whatever its other flags (--input-size, --opset, ...). One that
    records no source is refused too: any ONNX graph passes :func:`is_export` (another tool's model
    the user keeps), and an older orepa's export costs one --overwrite."""
    if overwrite or not out.is_file():
        return
    held = export_source(out, fmt)
    if ckpt_io.same_source(held, source, "checkpoint"):
        return
    what = (f"the export of {_described(held)}" if held is not None else
            f"{FORMATS[fmt][1]} that records no source (another tool's, or exported by an older orepa)")
    raise UserError(f"--output {out} holds {what}; pass --overwrite to replace it, or choose another --output")


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", type=path_arg, default=None,
                   help="an orepa checkpoint or a state_dict (training form, deployed form, or deployed with BN "
                        "folded), bare or wrapped; default: a randomly initialised --model")
    p.add_argument("--checkpoint", dest="checkpoint_opt", type=path_arg, default=None, metavar="CHECKPOINT",
                   help=argparse.SUPPRESS)  # the older spelling of the positional argument
    add_model_arguments(p, model_default="the checkpoint's; without a checkpoint, required (a randomly initialised "
                                          "zoo model)")
    add_run_arguments(p, seed=False)
    p.add_argument("-o", "--output", type=path_arg, default=None,
                   help="output file (default: {model}_{method}[_ema].onnx / .pt2 / .pt)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output whatever it holds (without it only an earlier export of the same "
                        "checkpoint or model, with the same --use-ema, in this --format is replaced); never a run's "
                        "training checkpoint")
    p.add_argument("--input-size", type=positive_int, default=None,
                   help="height = width of the example input (default: the checkpoint's training size, "
                        "28 for Fashion-MNIST; else 224)")
    p.add_argument("-b", "--batch-size", type=positive_int, default=1)
    p.add_argument("--dynamic-size", action="store_true",
                   help="an export that takes any height and width (ONNX, ExportedProgram: dynamic axes), verified "
                        "at two more sizes (32 more rows and 64 more columns, then an odd size); default: the "
                        "--input-size alone")
    p.add_argument("--format", choices=tuple(FORMATS), default="onnx",
                   help="onnx (for onnxruntime, TensorRT, ...), exported-program (torch.export's .pt2: for "
                        "AOTInductor, ExecuTorch, torch.export.load) or torchscript (torch.jit, deprecated by torch)")
    p.add_argument("--opset", type=positive_int, default=None,
                   help="ONNX opset (default: 17; 18 with --dynamo, that exporter's lowest)")
    p.add_argument("--dynamo", action="store_true", help="ONNX: use the torch.export-based exporter")
    # (--atol: this command's earlier spelling of the bound reparam and import-reference call --rtol)
    p.add_argument("--rtol", "--atol", dest="rtol", type=positive_float, default=1e-4,
                   help="verification bound: max|diff| <= rtol * (1 + max|y|) (1e-4)")
    p.add_argument("--no-verify", action="store_true")
    add_use_ema_argument(p, "export")


def _check_output(out: Path, args: argparse.Namespace, path) -> None:
    """The output may be written: not the input, nor a name of the other format, nor another kind of
    file unless ``--overwrite``."""
    ckpt_io.check_output_path(args.output or out, "--output", not_over={  # (as given: a final "/")
        "the input checkpoint (export never writes over its input)": path or None})
    if out.exists() and not args.overwrite and not is_export(out, args.format):
        held = "holds a checkpoint" if ckpt_io.checkpoint_form(out) is not None else (
            f"exists and is not {FORMATS[args.format][1]}")
        raise UserError(f"--output {out} {held}; pass --overwrite to replace it, or choose another --output")
    named = {".pth": "torchscript", **{suffix: fmt for fmt, (suffix, _) in FORMATS.items()}}.get(out.suffix.lower())
    if named not in (None, args.format):  # a file named for one format holding another: said, not written
        raise UserError(f"--output {args.output or out} is named as {FORMATS[named][1]}, and --format {args.format} "
                        f"writes {FORMATS[args.format][1]}: give --format {named}, or another name")


def run(args: argparse.Namespace) -> int:
    apply_threads(args)
    if args.no_verify:  # said, not silently dropped (as reparam says it)
        refuse_idle_flags(args, ("rtol",), "--no-verify skips the verification")
    if args.format != "onnx" and (args.dynamo or args.opset is not None):  # said, not silently dropped
        raise UserError(f"{'--dynamo' if args.dynamo else f'--opset {args.opset}'} applies to --format onnx, not "
                        f"--format {args.format}")
    if args.format == "onnx":  # before the model is loaded: a missing package or a bad --opset fails at once
        args.opset = default_opset(args.dynamo) if args.opset is None else args.opset
        check_onnx_request(args.opset, dynamo=args.dynamo, verify=not args.no_verify)
    device = init_distributed(args.device, one_process="orepa export")[1]
    if args.checkpoint and args.checkpoint_opt and args.checkpoint != args.checkpoint_opt:
        raise UserError(f"two checkpoints: {args.checkpoint} and --checkpoint {args.checkpoint_opt}; give one")
    path = args.checkpoint or args.checkpoint_opt
    if args.output:  # before anything is loaded or built
        _check_output(Path(args.output), args, path)
    ckpt = ckpt_io.load_checkpoint(path) if path else {}
    if path:
        if "model_cfg" not in ckpt and args.small_input is None and args.model and not external_source(args.model):
            # no data here to take the stem's default from (eval takes the dataset's): a RepVGG's weights
            # fit either stem, so a guess would export another network without a word
            raise UserError(f"{path} is a bare state_dict (it records no model): say which stem it was trained "
                            "with, --small-input (orepa train's default on Fashion-MNIST) or --no-small-input")
        cfg = checkpoint_cfg_without_data(args, ckpt, path, ckpt["model"])
        model, cfg, form = ckpt_io.model_from_checkpoint(ckpt, path, cfg=cfg, use_ema=args.use_ema)
        ckpt_io.check_loaded_weights(model, path, "an exported model would compute nothing useful",
                                     use_ema=args.use_ema)
        print(f"loaded {path}{ckpt_io.EMA_NOTE if args.use_ema else ''} as the {FORM_NAMES[form]} of "
              f"{describe_cfg(cfg)}")
    else:
        if args.model is None:
            raise UserError("give a checkpoint, or --model for a randomly initialised zoo model")
        ckpt_io.check_use_ema(args.use_ema)
        cfg = model_cfg_from_args(args, num_classes=1000, in_chans=3, small_input=False)
        model = build_model(cfg)
        print(f"no checkpoint: exporting a randomly initialised {describe_cfg(cfg)}")
    size = args.input_size or input_size_of(ckpt) or 224
    shape = (args.batch_size, cfg["in_chans"], size, size)
    out = Path(args.output or f"{model_slug(cfg['model'])}_{cfg['method']}{'_ema' if args.use_ema else ''}"
                              f"{FORMATS[args.format][0]}")
    if not args.output:  # (a given one was checked before the model was loaded)
        _check_output(out, args, path)
    # what the export records of its source (the checkpoint by its absolute path: a relative one names
    # another file from another directory), by which a rerun knows its own file
    # ("ema": its EMA weights, taken with --use-ema or deployed so by orepa reparam --use-ema, as eval says of it)
    source = {"checkpoint": os.path.abspath(path) if path else None, "ema": bool(args.use_ema or ckpt.get("ema")),
              "model_cfg": cfg}
    _check_previous(out, args.format, source, args.overwrite)
    check_model_takes(model, (size,), cfg["in_chans"], describe_cfg(cfg), lambda s: f"--input-size {s} ({s}x{s} images)",
                      batch=args.batch_size, device=device,
                      hint=" (the exported model takes any batch size: -b sizes only its example input)")
    model.to(device)
    # for whoever runs the exported model: the class names (label i is classes[i]) and what its input must be
    preprocessing = preprocessing_of(ckpt, cfg["in_chans"])
    if preprocessing and preprocessing.get("center_crop") not in (None, size):  # --input-size: the crops the graph
        # takes (ONNX and ExportedProgram fix height and width), after the run's resize scaled alike
        resize = round(preprocessing["resize"] * size / preprocessing["center_crop"])
        preprocessing.update(resize=resize, center_crop=size)
    elif preprocessing and "center_crop" not in preprocessing and size != 28:  # Fashion-MNIST's, at another size
        preprocessing["image"] += f", resized to {size}x{size} (this export's input size)"
        preprocessing["resize"] = size  # (as a number too: orepa eval of the export resizes the images so)
    metadata = {**({"classes": json.dumps(ckpt["classes"])} if ckpt.get("classes") else {}),
                **({"preprocessing": json.dumps(preprocessing)} if preprocessing else {}),
                SOURCE_KEY: ckpt_io.json_text(ckpt_io.plain(source))}
    try:
        if args.format == "onnx":
            report = export_onnx(model, out, shape, opset=args.opset, verify=not args.no_verify, atol=args.rtol,
                                 dynamic_size=args.dynamic_size, dynamo=args.dynamo, metadata=metadata)
        else:
            export = export_torchscript if args.format == "torchscript" else export_exported_program
            report = export(model, out, shape, verify=not args.no_verify, atol=args.rtol,
                            dynamic_size=args.dynamic_size, metadata=metadata)
    except ExportVerificationError as exc:
        raise CheckFailed(f"verification failed: {exc}") from None
    print(report)
    return 0
