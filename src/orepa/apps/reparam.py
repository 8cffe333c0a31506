"""``orepa reparam``: training checkpoint -> deployed checkpoint, verified.

The deployed model is ``orepa.reparameterize(model)``: the vanilla layout (for the
ResNet family, torchvision's module names and state_dict keys), or with
``--fuse-bn`` every BN folded into its conv. Before writing it, the command runs
the training-form and the deployed model on the validation set (or ``--val-subset``
images of it) and checks that the logits agree to float32 tolerance
(max |diff| <= ``--rtol`` x (1 + max |logit|)); it reports both accuracies and how
many predictions differ. Exit code 1 if the outputs disagree (a failed check, as
``orepa export``'s verification, not a usage error: those exit 2), nothing written.

It never writes over its input or a run's training checkpoint (one with optimizer state). Without
``--overwrite`` it replaces only its own earlier output: a deployed checkpoint of the same input (by
any path: the same path is the same source, as for ``orepa analyze``, so a rerun after more training
replaces it), with the same ``--use-ema`` and ``--fuse-bn``, and the same model.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from .checkpoint import (
    EMA_NOTE,
    FORMAT,
    VERSION,
    args_dict,
    check_loaded_weights,
    check_output_path,
    checkpoint_form,
    deployed_file_name,
    load_checkpoint,
    model_from_checkpoint,
    report_of,
    same_source,
    save_checkpoint,
    write_json,
)
from .common import (
    CheckFailed,
    UserError,
    add_run_arguments,
    add_use_ema_argument,
    apply_threads,
    count_params,
    full_float32,
    init_distributed,
    path_arg,
    positive_float,
    positive_int,
    refuse_idle_flags,
    tolerance_bound,
)
from .data import add_data_arguments, val_loader
from .evaluate import checkpoint_data, checkpoint_model, data_args_from_checkpoint, evaluate
from .model_cfg import deploy, describe_cfg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=path_arg, help="a training checkpoint written by `orepa train`")
    p.add_argument("-o", "--output", type=path_arg, default=None,
                   help="deployed checkpoint to write (default: <checkpoint dir>/deployed[-ema][-fused].pth)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output whatever it holds (without it only an earlier deployment of this "
                        "checkpoint with the same --use-ema and --fuse-bn is replaced); never the input, nor a run's "
                        "training checkpoint")
    p.add_argument("--fuse-bn", action="store_true", help="also fold every BN into its conv (fastest inference)")
    add_use_ema_argument(p, "deploy")
    p.add_argument("--rtol", type=positive_float, default=1e-4,
                   help="verification tolerance: max|diff| <= rtol * (1 + max|logit|) (1e-4); beyond it nothing "
                        "is written and the exit code is 1 (a failed check, as in export), not 2 (a usage error)")
    p.add_argument("--no-verify", action="store_true", help="skip the verification on data")
    add_data_arguments(p, training_set=False)
    p.set_defaults(data_path=None, val_resize_size=None, val_crop_size=None)
    p.add_argument("-b", "--batch-size", type=positive_int, default=256)
    add_run_arguments(p, seed=False)  # (nothing here draws: a --val-subset is spread evenly)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=path_arg, default=None, metavar="PATH", help="also write the results to PATH as JSON")


#: the destinations of the flags that only the verification on data reads
VERIFY_FLAGS = frozenset({"data_path", "dataset", "cache_dir", "workers", "val_subset", "val_resize_size",
                          "val_crop_size", "rtol", "batch_size"})


def verify(model, deployed, loader, device, rtol: float, progress: bool = False) -> dict:
    """Both forms on the same data: accuracies, prediction disagreements, max logit difference."""
    with full_float32():
        a = evaluate(model, loader, device, keep_outputs=True, progress=progress, desc="training form")
        b = evaluate(deployed, loader, device, keep_outputs=True, progress=progress, desc="deployed")
    ya, yb = a.pop("outputs"), b.pop("outputs")
    diff = (ya - yb).abs().max().item() if len(ya) else 0.0
    bound = tolerance_bound(ya, rtol)
    return {"n": a["n"], "train_form_acc1": a["acc1"], "deployed_acc1": b["acc1"],
            "train_form_acc5": a["acc5"], "deployed_acc5": b["acc5"],
            "predictions_differ": int((ya.argmax(1) != yb.argmax(1)).sum()), "max_abs_diff": diff,
            "tolerance": bound, "outputs_match": diff <= bound, "accuracy_equal": a["acc1"] == b["acc1"],
            "train_form_s_per_batch": a["time_per_batch_s"], "deployed_s_per_batch": b["time_per_batch_s"]}


def _check_output(out: Path, args) -> None:
    check_output_path(args.output or out, "--output",  # (as given: a final "/")
                      not_over={"the input checkpoint (reparam never writes over its input)": args.checkpoint})
    if args.json:
        check_output_path(args.json, "--json", report="reparam",
                          not_over={"the input checkpoint": args.checkpoint, "--output": out})
    form = checkpoint_form(out) if out.exists() and not args.overwrite else "deploy"
    if form not in ("deploy", "deploy-fused"):
        held = {None: "not an orepa checkpoint", "state_dict": "a bare state_dict"}.get(form, f"a {form} checkpoint")
        raise UserError(f"--output {out} exists and is not a deployed checkpoint ({held}); "
                        "pass --overwrite to replace it, or choose another --output")


def _check_previous(out: Path, record: dict, overwrite: bool) -> None:
    """A deployed checkpoint at ``out`` (all that :func:`_check_output` lets through) made from another
    checkpoint, from its other weights (--use-ema), in the other form (--fuse-bn) or of another model
    is replaced only with --overwrite; a rerun on the same source replaces its own. One without a
    source (not written by reparam: every reparam recorded it) is refused too."""
    if overwrite or not out.is_file():
        return
    try:
        held = load_checkpoint(out, lazy=True)
    except UserError:  # (changed since _check_output read it) nothing to compare: another file
        held = {}
    # its input by its absolute path ("source_path"; the path as given, "source", is all an older reparam wrote)
    previous = {"source": held.get("source_path", held.get("source")), "ema": bool(held.get("ema", False)),
                "form": held.get("form"), "model_cfg": held.get("model_cfg")}
    if same_source(previous, record, "source"):
        return
    if previous["source"] is None:
        what = "a deployed model that records no source checkpoint (not written by orepa reparam)"
    else:
        folded = "BN folded (--fuse-bn)" if previous["form"] == "deploy-fused" else "BN not folded"
        what = f"the deployed model of {previous['source']}{EMA_NOTE if previous['ema'] else ''}, {folded}"
        if previous["model_cfg"] != record["model_cfg"] and isinstance(previous["model_cfg"], dict):
            what += f", {describe_cfg(previous['model_cfg'])}"
    raise UserError(f"--output {out} holds {what}; pass --overwrite to replace it, or choose another --output")


def reparam(args: argparse.Namespace) -> dict:
    apply_threads(args)
    args = argparse.Namespace(**vars(args))  # the checkpoint's data settings fill this copy
    if args.no_verify:  # said, not silently dropped: the flags of the verification on data
        refuse_idle_flags(args, VERIFY_FLAGS, "--no-verify skips the verification on data")
    info, device = init_distributed(args.device, one_process="orepa reparam")
    out = Path(args.output) if args.output else Path(args.checkpoint).with_name(
        deployed_file_name(args.fuse_bn, args.use_ema))
    held = checkpoint_form(args.checkpoint)  # (before the output: a deployed.pth's default output is itself)
    if held not in (None, "train", "state_dict"):
        raise UserError(f"{args.checkpoint} is already deployed ({held})")
    _check_output(out, args)
    ckpt = load_checkpoint(args.checkpoint)
    if ckpt.get("model_cfg") is None:  # reparam takes no model flags: what the weights are must be recorded
        raise UserError(f"{args.checkpoint} is a bare state_dict; reparam needs an orepa training checkpoint "
                        "(orepa train's checkpoint.pth, or orepa import-reference's output)")
    form_out = "deploy-fused" if args.fuse_bn else "deploy"
    # (the input by its absolute path: a relative one names another file from another directory)
    source = {"source": os.path.abspath(args.checkpoint), "ema": bool(args.use_ema), "form": form_out,
              "model_cfg": ckpt["model_cfg"]}
    _check_previous(out, source, args.overwrite)  # before the data is read and the verification runs
    data_args_from_checkpoint(args, ckpt)
    need_data = not args.no_verify
    data = checkpoint_data(args, ckpt, info) if need_data else None  # its images labelled as the checkpoint's classes
    if data is None:
        model, cfg, form = model_from_checkpoint(ckpt, args.checkpoint, use_ema=args.use_ema)
    else:
        model, cfg, form = checkpoint_model(args, ckpt, data, device)
    if form != "train":
        raise UserError(f"{args.checkpoint} holds deployed weights ({form}); nothing to reparameterize")
    check_loaded_weights(model, args.checkpoint, "its deployed form would compute nothing useful",
                         use_ema=args.use_ema)
    model.to(device).eval()
    deployed = deploy(model, form_out).to(device).eval()
    res = {"checkpoint": str(args.checkpoint), "model": describe_cfg(cfg), "form": form_out, "ema": bool(args.use_ema),
           "params_train": count_params(model), "params_deployed": count_params(deployed)}
    if need_data:
        res.update(verify(model, deployed, val_loader(data, args, info, device), device, args.rtol,
                          progress=not args.no_progress))
    if need_data and not res["outputs_match"]:
        res["output"] = None
        return res
    save_checkpoint({
        "format": FORMAT, "version": VERSION, "form": form_out, "model_cfg": cfg,
        "classes": list(ckpt.get("classes") or []),
        "model": {k: v.detach().cpu() for k, v in deployed.state_dict().items()},
        "source": str(args.checkpoint), "source_path": source["source"], "ema": bool(args.use_ema),
        "args": ckpt.get("args", {}),
        "reparam_args": args_dict(args),
        "metrics": {k: v for k, v in res.items() if isinstance(v, (int, float, bool))},
    }, out)
    res["output"] = str(out)
    return res


def run(args: argparse.Namespace) -> int:
    res = reparam(args)
    print(f"{res['checkpoint']}{EMA_NOTE if res['ema'] else ''}: {res['model']}")
    print(f"  params {res['params_train']:,} (training form) -> {res['params_deployed']:,} ({res['form']})")
    if "n" in res:
        print(f"  verified on {res['n']} validation images: top-1 {res['train_form_acc1']:.2f}% (training form) vs "
              f"{res['deployed_acc1']:.2f}% (deployed), {res['predictions_differ']} prediction(s) differ; "
              f"max |logit diff| {res['max_abs_diff']:.2e} (tolerance {res['tolerance']:.2e})")
    if res.get("output") is None:
        raise CheckFailed("the deployed model's outputs differ from the training form's beyond the tolerance; "
                          "nothing written")
    print(f"  wrote {res['output']}")
    if args.json:
        write_json(args.json, report_of("reparam", res), indent=2)
    return 0


__all__ = ["add_arguments", "run", "reparam", "verify"]
