"""``orepa eval``: top-1/top-5 of a checkpoint, in training form or deployed, or of an export.

The checkpoint says which form it holds (``form``: train / deploy / deploy-fused)
and which model (``model_cfg``); the matching module layout is built before its
weights load. A bare state_dict (e.g. torchvision's) is matched against every form
of the model given with ``--model/--method/...``. An export (``orepa export``: ONNX,
ExportedProgram, TorchScript) runs as it was exported, on the data its metadata names.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import (
    check_output_path,
    load_checkpoint,
    model_from_checkpoint,
    report_of,
    write_json,
)
from .common import (
    DistInfo,
    UserError,
    add_amp_arguments,
    add_run_arguments,
    add_use_ema_argument,
    apply_threads,
    cleanup_distributed,
    count_params,
    error_text,
    init_distributed,
    path_arg,
    peak_memory,
    positive_int,
    refuse_amp_dtype_without_amp,
    refuse_idle_flags,
    user_message,
    weights_damage,
)
from .data import FASHION_MNIST_NAMES, ShardSampler, add_data_arguments, build_data, saved_val_sizes, val_loader
from .export import FORMATS, SOURCE_KEY, export_format, export_records, load_export
from .model_cfg import (
    add_model_arguments,
    check_model_fits_data,
    check_model_takes_images,
    checkpoint_cfg,
    describe_cfg,
    model_flags_given,
)


def autocast_context(device: torch.device, enabled: bool, dtype: str = "auto", cache_enabled: bool = True):
    """bf16 on CPU, fp16 on CUDA (unless ``dtype`` says otherwise); a null context when disabled.

    ``cache_enabled=False`` for CUDA graphs: autocast's cast cache must not outlive a capture."""
    if not enabled:
        return contextlib.nullcontext()
    if dtype == "auto":
        dt = torch.float16 if device.type == "cuda" else torch.bfloat16
    else:
        dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    return torch.autocast(device_type=device.type, dtype=dt, cache_enabled=cache_enabled)


def _progress(iterable, total, desc, enabled):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 30)


class EvaluationStopped(Exception):
    """:func:`evaluate`'s ``stop`` ended it early (on some rank): its figures would be of part of the set."""


class EvaluationFailed(UserError):
    """The loader met an unreadable image (on some rank): every rank raises it together, after the
    evaluation's all-reduce, so that what follows (a training run's collective save) finds every rank there."""


def _until_unreadable(batches, failed: list):
    """``batches`` until the loader meets an unreadable image (its :class:`UserError` kept in ``failed``): a
    rank that raised at once would leave its peers waiting in the evaluation's all-reduce."""
    try:
        yield from batches
    except UserError as exc:
        failed.append(exc)


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, *, info: DistInfo | None = None, amp: bool = False,
             amp_dtype: str = "auto", channels_last: bool = False, progress: bool = False, desc: str = "eval",
             keep_outputs: bool = False, stop=None) -> dict:
    """Loss, top-1, top-5 (in %) over ``loader`` (summed over ranks when distributed).

    With ``keep_outputs`` the float32 logits of this rank are returned too (``outputs``).
    ``stop``: a callable asked before each batch (a training run's stop signal); once it says so on any
    rank, the evaluation ends there and every rank raises :class:`EvaluationStopped` (the ranks learn
    it in the one all-reduce of the sums). An unreadable image on any rank: every rank raises
    :class:`EvaluationFailed` (that rank with the loader's message), learnt in the same all-reduce.
    """
    info = info or DistInfo()
    model.eval()
    crit = nn.CrossEntropyLoss(reduction="sum")
    sums = torch.zeros(6, dtype=torch.float64, device=device)  # loss, correct1, correct5, n, stopped, failed
    outputs, failed = [], []
    batches, t0 = 0, time.perf_counter()
    it = _progress(loader, len(loader), desc, progress and info.is_main)
    for images, target in _until_unreadable(it, failed):
        if stop is not None and stop():
            sums[4] = 1
            break
        images = images.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with autocast_context(device, amp, amp_dtype):
            out = model(images)
        out = out.float()
        k = min(5, out.shape[1])
        top = out.topk(k, dim=1).indices
        hit = top.eq(target[:, None])
        sums[:4] += torch.stack([crit(out, target).double(), hit[:, 0].sum().double(), hit.any(1).sum().double(),
                                 torch.tensor(float(len(target)), dtype=torch.float64, device=device)])
        if keep_outputs:
            outputs.append(out.cpu())
        batches += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    sums[5] = len(failed)
    if info.distributed:
        dist.all_reduce(sums)
    loss, c1, c5, n, stopped, failures = sums.tolist()
    if failed:
        raise EvaluationFailed(user_message(failed[0])) from None  # (a loader worker's: its own message)
    if failures:
        raise EvaluationFailed("another process of this run could not read an image of the validation set (its "
                               "error names it)")
    if stopped:
        raise EvaluationStopped(f"{desc} stopped after {int(n)} images")
    if n == 0:
        raise UserError("the validation set is empty")
    res = {"loss": loss / n, "acc1": 100.0 * c1 / n, "acc5": 100.0 * c5 / n, "n": int(n),
           "time_per_batch_s": elapsed / max(batches, 1), "images_per_s": (n / info.world_size) / max(elapsed, 1e-9)}
    if keep_outputs:
        res["outputs"] = torch.cat(outputs) if outputs else torch.empty(0)
    return res


# --------------------------------------------------------------------------- the subcommand

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=path_arg,
                   help="a training checkpoint (orepa train), a deployed one (orepa reparam), a bare state_dict "
                        "(then give --model/--method/...), or an export (orepa export: ONNX, ExportedProgram, "
                        "TorchScript), run as it was exported")
    add_data_arguments(p, training_set=False)
    # unset: the data the checkpoint was trained on
    p.set_defaults(data_path=None, val_resize_size=None, val_crop_size=None)
    add_model_arguments(p)
    add_run_arguments(p, seed=False)  # (nothing here draws: a --val-subset is spread evenly)
    p.add_argument("-b", "--batch-size", type=positive_int, default=256)
    add_amp_arguments(p, training=False)
    p.add_argument("--channels-last", action="store_true")
    add_use_ema_argument(p, "evaluate")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=path_arg, default=None, metavar="PATH", help="also write the results to PATH as JSON")


def data_args_from_checkpoint(args: argparse.Namespace, ckpt: dict) -> None:
    """Fill unset data flags with what the checkpoint was trained with (else Fashion-MNIST)."""
    saved = ckpt.get("args") or {}
    if args.data_path is None:
        args.data_path = saved.get("data_path") or "fashion-mnist"
        if args.dataset == "auto" and saved.get("dataset"):
            args.dataset = saved["dataset"]
        if args.cache_dir is None:
            args.cache_dir = saved.get("cache_dir")
        args._data_path_of = args.checkpoint  # (build_data's message names where the path came from)
    for key, size in zip(("val_resize_size", "val_crop_size"), saved_val_sizes(saved)):
        if getattr(args, key, None) is None:
            setattr(args, key, size)


def checkpoint_data(args: argparse.Namespace, ckpt: dict, info: DistInfo):
    """The validation data to evaluate the checkpoint on, each image labelled as the checkpoint's
    classifier numbers its class (by name, where both name their classes: :meth:`Data.read_as`)."""
    def note(text: str) -> None:  # the main process's (the other ranks read the same data)
        if info.is_main:
            print(text, flush=True)

    data = build_data(args, need_train=False, note=note)
    read = data.read_as(ckpt.get("classes") or (), args.checkpoint)
    if read is not data and info.is_main:
        print(f"note: the {len(data.classes)} classes of {data.name} read by name as {args.checkpoint}'s "
              f"{len(read.classes)}", flush=True)
    return read


def checkpoint_model(args: argparse.Namespace, ckpt: dict, data, device: torch.device,
                     info: DistInfo | None = None) -> tuple[nn.Module, dict, str]:
    """The checkpoint's model (its model_cfg, or the model flags given), checked against ``data``
    and the batches of -b validation images this process (``info``'s rank) gives it on ``device``."""
    cfg = checkpoint_cfg(args, ckpt, args.checkpoint, num_classes=data.num_classes, in_chans=data.in_chans,
                         small_input=data.small_input)
    model, cfg, form = model_from_checkpoint(ckpt, args.checkpoint, cfg=cfg, use_ema=args.use_ema)
    check_model_fits_data(cfg, data, args.checkpoint)
    shard = len(ShardSampler(len(data.val), info.world_size, info.rank)) if info is not None else len(data.val)
    batch = min(args.batch_size, shard)
    check_model_takes_images(model, data, f"{args.checkpoint} ({describe_cfg(cfg)})", batch=batch,
                             amp=getattr(args, "amp", False), device=device,
                             batch_flags=f"-b {args.batch_size}" + (f" ({batch} images)" if batch < args.batch_size else ""))
    return model, cfg, form


def evaluate_checkpoint(args: argparse.Namespace, info: DistInfo, device: torch.device) -> dict:
    """``orepa eval``'s work on parsed ``args`` (a copy the checkpoint's data settings may fill): the
    checkpoint's model on its data, the result printed (by the main process) and returned. The one
    evaluation of a checkpoint: ``orepa train --test-only`` runs it too."""
    refuse_amp_dtype_without_amp(args)
    if args.json:
        check_output_path(args.json, "--json", report="eval", not_over={"the input checkpoint": args.checkpoint})
    ckpt = load_checkpoint(args.checkpoint)
    data_args_from_checkpoint(args, ckpt)
    data = checkpoint_data(args, ckpt, info)
    model, cfg, form = checkpoint_model(args, ckpt, data, device, info)
    if cfg["num_classes"] > data.num_classes and info.is_main:  # allowed (a subset of its classes), but said
        print(f"note: {args.checkpoint} predicts {cfg['num_classes']} classes, {data.name} has "
              f"{data.num_classes}: an image predicted as one of the other "
              f"{cfg['num_classes'] - data.num_classes} counts as wrong", flush=True)
    bad, damage = weights_damage(model)
    if damage and info.is_main:
        # a warning, not an error: eval reports what the weights compute, and looking at a diverged
        # run (or a non-finite buffer the forward never reads) is legitimate; the numbers may be garbage
        print(f"warning: {args.checkpoint} holds {damage}: the accuracy and loss below may be meaningless"
              f"{' (a diverged run?)' if bad else ''}", file=sys.stderr, flush=True)
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    loader = val_loader(data, args, info, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ema = bool(args.use_ema or ckpt.get("ema"))  # EMA weights taken here, or deployed so by reparam
    res = evaluate(model, loader, device, info=info, amp=args.amp, amp_dtype=args.amp_dtype,
                   channels_last=args.channels_last, progress=not args.no_progress)
    mem, mem_kind = peak_memory(device)
    res.update(checkpoint=str(args.checkpoint), form=form, model=describe_cfg(cfg), params=count_params(model),
               peak_memory_mib=mem, peak_memory_kind=mem_kind, dataset=data.name, ema=ema,
               nonfinite=bad)
    if info.is_main:
        print(f"{args.checkpoint}: {describe_cfg(cfg)}, {form} form{' (EMA)' if ema else ''}, "
              f"{res['params']:,} params")
        print(f"  {data.name} val: top-1 {res['acc1']:.2f}%  top-5 {res['acc5']:.2f}%  loss {res['loss']:.4f}  "
              f"({res['n']} images, {res['time_per_batch_s'] * 1e3:.1f} ms/batch, peak memory {mem:.0f} MiB "
              f"[{mem_kind}])")
        if args.json:
            write_json(args.json, report_of("eval", res), indent=2)
    return res


def evaluate_export(args: argparse.Namespace, info: DistInfo, device: torch.device, fmt: str) -> dict:
    """``orepa eval`` of an export (``fmt``: :data:`orepa.apps.export.FORMATS`): the file run by its own
    runtime on the validation data, what was shipped measured as it is. Its metadata say the classes and
    the images it takes (Fashion-MNIST, or the size of an ImageFolder run's crops); an export that does
    not (another tool's) needs ``--data-path``, read with that data's own preprocessing."""
    path, what = args.checkpoint, FORMATS[fmt][1]
    if model_flags_given(args):
        raise UserError(f"{path} is {what}, a network fixed at its export; the model flags (--model, --method, ...) "
                        "do not apply")
    refuse_idle_flags(args, ("use_ema", "amp_dtype", "channels_last") + ("amp",) * bool(args.amp),  # (--no-amp: as run)
                      f"{path} is {what}, run in float32 as it was exported (its weights chosen then)")
    if args.json:
        check_output_path(args.json, "--json", report="eval", not_over={"the export": path})
    records = export_records(path, fmt)  # (an ONNX model's metadata are read by parsing the whole model: once)
    source, classes, prep = (records.get(k) for k in (SOURCE_KEY, "classes", "preprocessing"))
    source = source if isinstance(source, dict) else {}
    prep = prep if isinstance(prep, dict) else {}
    fashion_mnist = "Fashion-MNIST" in str(prep.get("image", ""))
    if args.data_path is None:
        if fashion_mnist:
            args.data_path = "fashion-mnist"
        elif source and not source.get("checkpoint"):
            raise UserError(f"{path} is the export of a randomly initialised model: give the --data-path to run it on")
        elif "center_crop" in prep:
            raise UserError(f"{path} was trained on an ImageFolder tree, which an export does not record: give its "
                            "--data-path")
        else:
            raise UserError(f"{path} does not say which data it was trained on: give its --data-path")
    if fashion_mnist:  # exported for another input size: its images resized as its record says (not fed at 28)
        size = prep.get("resize")
        if not isinstance(size, int):  # (an export that says it in words only)
            size = re.search(r"resized to (\d+)x", str(prep["image"]))
            size = int(size.group(1)) if size else None
        args._fashion_mnist_size = size
    for key, size, default in zip(("val_resize_size", "val_crop_size"), (prep.get("resize"), prep.get("center_crop")),
                                  saved_val_sizes({})):  # (none recorded: that data's own, as a run's defaults)
        if getattr(args, key, None) is None:
            setattr(args, key, size if isinstance(size, int) else default)
    data = checkpoint_data(args, {"classes": classes if isinstance(classes, list) else ()}, info)  # (with its note)
    cfg = source.get("model_cfg")
    if isinstance(cfg, dict) and {"in_chans", "num_classes"} <= set(cfg):
        check_model_fits_data(cfg, data, path)
    try:
        model, runner, params = load_export(path, fmt, device)
    except Exception as exc:  # noqa: BLE001 - each runtime's own error type: a torn or foreign file
        runtime = {"onnx": "onnxruntime", "exported-program": "torch.export.load"}.get(fmt, "torch.jit.load")
        raise UserError(f"{path} looks like {what}, but {runtime} cannot load it (damaged or truncated?): "
                        f"{error_text(exc, all_lines=True)}") from None
    try:  # one image first: a shape the export was not made for is said in one line
        with torch.no_grad():
            y = model(data.val[0][0][None].to(device))
    except Exception as exc:  # noqa: BLE001 - each runtime's own error type (onnxruntime's sizes on its next lines)
        raise UserError(f"{path} cannot take a batch of one of {data.name}'s images "
                        f"({error_text(exc, all_lines=True)})") from None
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        gives = f"an output of shape {list(y.shape)}" if isinstance(y, torch.Tensor) else f"a {type(y).__name__}"
        raise UserError(f"{path} gives {gives}, not a tensor of logits (batch, classes)")
    if y.shape[1] < data.num_classes:  # (a model it does not describe: check_model_fits_data could not say it)
        raise UserError(f"{path} predicts {y.shape[1]} classes but {data.name} has {data.num_classes}; pass the "
                        "--data-path it was trained on")
    loader = val_loader(data, args, info, device)
    res = evaluate(model, loader, device, info=info, progress=not args.no_progress)
    described = describe_cfg(cfg) if isinstance(cfg, dict) else "a model it does not describe"
    res.update(checkpoint=str(path), form=fmt, model=described, params=params, dataset=data.name,
               ema=bool(source.get("ema")), exported_from=source.get("checkpoint"), runtime=runner)
    if info.is_main:
        origin = f" of {source['checkpoint']}" if source.get("checkpoint") else ""
        print(f"{path}: {what}{origin}, {described}{' (EMA)' if res['ema'] else ''}, {params:,} weights, "
              f"run by {runner}")
        print(f"  {data.name} val: top-1 {res['acc1']:.2f}%  top-5 {res['acc5']:.2f}%  loss {res['loss']:.4f}  "
              f"({res['n']} images, {res['time_per_batch_s'] * 1e3:.1f} ms/batch)")
        if args.json:
            write_json(args.json, report_of("eval", res), indent=2)
    return res


def run(args: argparse.Namespace) -> int:
    info = DistInfo()
    apply_threads(args)
    args = argparse.Namespace(**vars(args))  # the checkpoint's data settings fill this copy
    try:
        info, device = init_distributed(args.device)
        fmt = export_format(args.checkpoint)
        if fmt is not None:
            evaluate_export(args, info, device, fmt)
        else:
            evaluate_checkpoint(args, info, device)
        return 0
    finally:
        cleanup_distributed(info)


__all__ = ["evaluate", "EvaluationFailed", "EvaluationStopped", "evaluate_checkpoint", "autocast_context",
           "add_arguments", "run", "FASHION_MNIST_NAMES"]
