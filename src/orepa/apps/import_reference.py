"""``orepa import-reference``: a checkpoint of the paper's public code -> an orepa checkpoint.

    orepa import-reference ref/checkpoint.pth.tar -o r50.pth                  # training form
    orepa train --init-from r50.pth --data-path /data/mine --epochs 20 ...    # fine-tune it
    orepa import-reference ref/checkpoint.pth.tar -o r50-deploy.pth --deploy  # torchvision layout
    orepa import-reference ref/deployed.pth -o r50-deploy.pth --deploy --fuse-bn  # its convert.py's output

The architecture (family, depth, widths, block kinds) is read off the checkpoint's keys
and shapes (:func:`orepa.import_reference`). The training-form checkpoint holds the
model and its ``model_cfg`` but no optimizer state: ``orepa train --init-from`` (or
``--resume``) starts a fine-tuning run from it (fresh optimizer and schedule, the settings of
that command, a new classifier where the data has another class count).
``--deploy`` writes the deployed model (vanilla layout; ``--fuse-bn`` folds the BNs),
which ``orepa eval`` and ``orepa export`` read. The deployed checkpoint the reference's
conversion script writes (each block one conv, its BN folded in) imports as that network only
(``--deploy --fuse-bn``). ``--use-ema`` imports the file's moving average of the weights instead
(timm's ``state_dict_ema``, ``model_ema``), recorded as such (``ema``). Before writing, the
written form is checked against the imported model on a random batch.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..models.reference import is_deployed_reference
from ..state_dicts import EMA_KEYS
from .checkpoint import (
    FORMAT,
    VERSION,
    args_dict,
    check_output_path,
    load_checkpoint,
    model_from_checkpoint,
    save_checkpoint,
)
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
    tolerance_bound,
)
from .model_cfg import deploy, describe_cfg, model_cfg_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=path_arg,
                   help="state_dict or {'state_dict': ...} saved by the paper's code (any 'module.' prefix)")
    p.add_argument("-o", "--output", type=path_arg, required=True, help="orepa checkpoint to write")
    p.add_argument("--deploy", action="store_true", help="write the deployed model (vanilla layout) instead of "
                                                          "the training form")
    p.add_argument("--fuse-bn", action="store_true", help="with --deploy: also fold every BN into its conv")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output (never a run's training checkpoint)")
    add_use_ema_argument(p, "import")
    p.add_argument("--rtol", type=positive_float, default=1e-4,
                   help="check tolerance: max|diff| <= rtol * (1 + max|logit|) on a random batch (1e-4)")
    add_run_arguments(p)


def import_checkpoint(args: argparse.Namespace) -> dict:
    apply_threads(args)
    # where the written checkpoint is checked against the imported model
    _, device = init_distributed(args.device, one_process="orepa import-reference")
    src, out = Path(args.checkpoint), Path(args.output)
    if args.fuse_bn and not args.deploy:
        raise UserError("--fuse-bn needs --deploy (a training-form checkpoint keeps its BNs)")
    check_output_path(args.output, "--output", not_over={"the input checkpoint": src})  # (as given: a final "/")
    if out.exists() and not args.overwrite:
        raise UserError(f"--output {out} exists; pass --overwrite to replace it, or choose another --output")
    import orepa

    # the one checkpoint reader: a missing, damaged, foreign or TorchScript file and pickled objects
    # are reported as for every command; the reference's state_dict comes back as "model"
    held = load_checkpoint(src, reference=True)
    if args.use_ema and held.get("model_ema") is None:
        raise UserError(f"{src} holds no EMA weights (looked for {' / '.join(EMA_KEYS)}: timm's training script saves "
                        "them as state_dict_ema); leave out --use-ema")
    state = held["model_ema"] if args.use_ema else held["model"]
    converted = is_deployed_reference(state)  # (the reference's convert.py's output: imported as it is)
    if converted and not (args.deploy and args.fuse_bn):
        raise UserError(f"{src} is a deployed checkpoint of the reference code (its conversion script's output: each "
                        "block one conv, its BN folded in, its branches gone): it imports as that network only; add "
                        "--deploy --fuse-bn")
    torch.manual_seed(args.seed)
    try:
        model = orepa.import_reference(state)
    except ValueError as exc:
        raise UserError(f"{src}: {exc}") from None
    except (RuntimeError, IndexError, TypeError) as exc:  # a tensor of the wrong rank, shape or dtype
        raise UserError(f"{src}: a tensor of the reference layout has the wrong shape or type "
                        f"({error_text(exc, 200)})") from None
    model.eval()
    cfg = model_cfg_of(model)
    form = ("deploy-fused" if args.fuse_bn else "deploy") if args.deploy else "train"
    written = model if converted else deploy(model, form)
    ckpt = {"format": FORMAT, "version": VERSION, "form": form, "model_cfg": cfg,
            "model": {k: v.detach().cpu() for k, v in written.state_dict().items()},
            "epoch": 0, "step_in_epoch": 0, "global_step": 0, "source": str(src), "imported_from": "reference",
            "ema": bool(args.use_ema),
            "import_args": args_dict(args)}
    # what is written must read back through the one checkpoint loader and compute the imported model
    reread, _, _ = model_from_checkpoint(ckpt, out, use_ema=False)
    x = torch.randn(2, cfg["in_chans"], 64, 64, device=device)
    with torch.no_grad():
        ref, got = model.to(device)(x), reread.to(device)(x)
    diff = (ref - got).abs().max().item()
    bound = tolerance_bound(ref, args.rtol)
    if not diff <= bound:
        raise CheckFailed(f"the {form} form computes other logits than the imported model (max |diff| {diff:.2e} > "
                          f"{bound:.2e}); nothing written")
    save_checkpoint(ckpt, out)
    return {"source": str(src) + (" (its EMA weights)" if args.use_ema else ""), "model": describe_cfg(cfg),
            "form": form, "output": str(out),
            "params_train": None if written is model else count_params(model), "params_written": count_params(written),
            "max_abs_diff": diff, "tolerance": bound}


def run(args: argparse.Namespace) -> int:
    res = import_checkpoint(args)
    print(f"{res['source']}: {res['model']}")
    trained = ("the reference's deployed form" if res["params_train"] is None else
               f"training form {res['params_train']:,}")
    print(f"  {res['form']} form, {res['params_written']:,} parameters ({trained}); "
          f"checked on a random batch: max |logit diff| {res['max_abs_diff']:.1e} (tolerance {res['tolerance']:.1e})")
    print(f"  wrote {res['output']}")
    if res["form"] == "train":
        print(f"  fine-tune: orepa train --init-from {res['output']} --data-path DATA ...")
    return 0


__all__ = ["add_arguments", "run", "import_checkpoint"]
