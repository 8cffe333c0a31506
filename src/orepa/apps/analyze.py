"""``orepa analyze CHECKPOINT_OR_MODEL``: branch similarity (Fig. "viz") and branch norms (supp. Fig. "viz_norm").

The checkpoint is read by :func:`orepa.apps.checkpoint.load_checkpoint` (an
``orepa train`` checkpoint, or a training-form state_dict, bare or wrapped) and
loaded into the zoo model its ``model_cfg`` describes, or the one the model flags
(``--model`` / ``--method`` / ``--model-option`` ...) describe. Without a checkpoint
file, the argument is taken as a model name and the freshly initialised model is
analysed. Writes ``analysis.json`` with every number, ``cosine.png`` (one heatmap
per block), ``norms.png`` (sorted normalised branch norms per block) and
``summary.png`` (mean off-diagonal similarity per block) to ``--output-dir``.

From Python: :func:`analyze` takes an in-memory model.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import nn

from orepa.analysis import analyze_model
from orepa.apps.checkpoint import (
    EMA_NOTE,
    check_output_path,
    check_use_ema,
    checkpoint_weights,
    json_text,
    load_checkpoint,
    load_if_fits,
    other_stem_hint,
    same_source,
    write_json,
)
from orepa.apps.common import (
    UserError,
    add_run_arguments,
    add_use_ema_argument,
    apply_threads,
    init_distributed,
    path_arg,
    refuse_idle_flags,
    seed_everything,
)
from orepa.apps.logs import pyplot, save_figure
from orepa.apps.model_cfg import (
    EXTERNAL_SOURCES,
    add_model_arguments,
    build_model,
    checkpoint_cfg_without_data,
    describe_cfg,
    model_cfg_from_args,
)
from orepa.models import list_models


def check_and_load(model: nn.Module, sd: dict[str, torch.Tensor], what: str, *, bare_cfg: dict | None = None
                   ) -> nn.Module:
    """Strictly load ``sd`` into ``model``; a mismatch raises a :class:`UserError` that lists it.
    ``bare_cfg``: the model_cfg ``model`` was built from for a bare state_dict (none recorded), whose
    stem the flags said or left at the default: a state_dict that fits the other stem names its flag."""
    problem = load_if_fits(model, sd)
    if problem:
        # the stem first: a small-input OREPA ResNet's 3x3 block against the deep stem reads as other branches
        hint = other_stem_hint(bare_cfg, sd, forms=("train",)) if bare_cfg is not None else ""
        raise UserError(f"checkpoint does not match {what}: {problem}.{hint or _branch_hint(sd, model.state_dict())}")
    return model


def _branch_hint(sd: dict, own: dict) -> str:
    """What a state_dict's re-param branches against the model's say about the mismatch."""
    unexpected = [k for k in sd if k not in own]
    if any(".branches." in k for k in unexpected) and not any(".branches." in k for k in own):
        return " The checkpoint is in training form: pass the --method it was trained with."
    if any(".branches." in k for k in unexpected) and any(".branches." in k for k in own):
        return " Its branches are not those of this method's blocks: pass the --method it was trained with."
    if not any(".branches." in k for k in sd):
        return " The checkpoint has no re-param branches (deployed or base model?): nothing to analyse."
    return ""


# --------------------------------------------------------------------------- plots


def _short(name: str) -> str:
    return name.replace("branches.stem.", "stem.").replace(".branches.", ".")


def _layer_panels(layers: dict, ncols: int, size: tuple[float, float], **kwargs):
    """One panel per analysed layer, ``ncols`` to a row: ``(fig, axes, [(ax, (name, values)), ...])``;
    the grid's unused panels stay blank."""
    plt = pyplot()
    ncols = min(ncols, max(len(layers), 1))
    nrows = math.ceil(max(len(layers), 1) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False, **kwargs)
    for ax in axes.flat:
        ax.axis("off")
    panels = list(zip(axes.flat, layers.items()))
    for ax, _ in panels:
        ax.axis("on")
    return fig, axes, panels


def plot_cosine(result: dict, path: str | Path, ncols: int = 6) -> Path:
    fig, axes, panels = _layer_panels(result["layers"], ncols, (2.9, 2.9), constrained_layout=True)
    im = None
    for ax, (name, v) in panels:
        cos = v["cosine"]
        im = ax.imshow(cos, vmin=-1, vmax=1, cmap="RdBu_r")
        m = len(v["branches"])
        if m <= 8:
            for i in range(m):
                for j in range(m):
                    ax.text(j, i, f"{cos[i][j]:.2f}", ha="center", va="center", fontsize=5,
                            color="w" if abs(cos[i][j]) > 0.6 else "k")  # readable on dark cells
        ax.set_xticks(range(m), v["branches"], rotation=90, fontsize=5)
        ax.set_yticks(range(m), v["branches"], fontsize=5)
        kh, kw = v["kernel_size"]
        ax.set_title(f"{_short(name)} ({kh}x{kw})\nmean off-diag "
                     f"{v['mean_off_diagonal_cosine']:.3f}", fontsize=6)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="cosine similarity")
    return save_figure(fig, path, dpi=110)


def plot_norms(result: dict, path: str | Path, ncols: int = 6) -> Path:
    fig, axes, panels = _layer_panels(result["layers"], ncols, (2.8, 2.2))
    for ax, (name, v) in panels:
        for b, row in zip(v["branches"], v["normalized_sorted_norms"]):
            ax.plot([i / max(len(row) - 1, 1) for i in range(len(row))], row, lw=1, label=b)
        ax.set_title(_short(name), fontsize=6)
        ax.set_ylim(0, 1)
        ax.tick_params(labelsize=5)
        ax.set_xlabel("output channels (sorted)", fontsize=5)
        ax.set_ylabel("share of channel norm", fontsize=5)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize=6)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def plot_summary(result: dict, path: str | Path) -> Path:
    plt = pyplot()

    layers = result["layers"]
    names = [_short(n) for n in layers]
    vals = [v["mean_off_diagonal_cosine"] for v in layers.values()]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.25 * len(names) + 2), 3.2))
    ax.bar(range(len(vals)), vals)
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=5)
    ax.set_ylabel("mean off-diagonal cosine")
    ax.axhline(0, color="k", lw=0.6)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


# --------------------------------------------------------------------------- API / CLI


def analyze(model: nn.Module, out_dir: str | Path | None = None, *, plots: bool = True, meta: dict | None = None
            ) -> dict:
    """Analyse every re-param block of an in-memory ``model``; write JSON and PNGs to ``out_dir`` if given."""
    result = analyze_model(model)
    if meta:
        result["meta"] = meta
    if not result["layers"]:
        raise ValueError("the model has no re-param block with two or more branches")
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = {"json": out / "analysis.json"}
        if plots:
            files["cosine"] = plot_cosine(result, out / "cosine.png")
            files["norms"] = plot_norms(result, out / "norms.png")
            files["summary"] = plot_summary(result, out / "summary.png")
        else:  # an earlier analysis' plots beside this one's JSON would show another model
            for stale in PLOT_FILES:
                (out / stale).unlink(missing_ok=True)
        result["files"] = {k: str(v) for k, v in files.items()}
        write_json(files["json"], result, indent=1)
    return result


#: the plots an analysis writes beside its analysis.json
PLOT_FILES = ("cosine.png", "norms.png", "summary.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", type=path_arg,
                   help="training-form checkpoint (.pt/.pth), or a model name to analyse at init")
    add_model_arguments(p)
    add_run_arguments(p)  # --seed: the weights of a model analysed at initialisation
    add_use_ema_argument(p, "analyse")
    p.add_argument("--output-dir", "--out-dir", dest="output_dir", type=path_arg, default="analysis",
                   help="where analysis.json and the plots go (analysis; --out-dir: older spelling)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the analysis of another checkpoint or model in --output-dir (a rerun of the same "
                        "one replaces its own)")


def run(args: argparse.Namespace) -> int:
    apply_threads(args)
    device = init_distributed(args.device, one_process="orepa analyze")[1]
    check_output_path(args.output_dir, "--output-dir", directory=True)
    target = Path(args.target)
    if target.is_file():
        ckpt = load_checkpoint(target)
        form = ckpt.get("form", "train")
        if form != "train":
            raise UserError(f"{target} holds a deployed model (form {form!r}): its branches are gone; "
                            "analyse the training-form checkpoint")
        # said, not ignored: only a model built here at initialisation draws its weights
        refuse_idle_flags(args, ("seed",), f"{target} is a checkpoint, analysed with the weights it holds",
                          "it seeds a model analysed at initialisation")
        sd = checkpoint_weights(ckpt, target, args.use_ema)
        cfg = checkpoint_cfg_without_data(args, ckpt, target, sd) or ckpt["model_cfg"]
        model = check_and_load(build_model(cfg), sd, _flags(cfg),
                               bare_cfg=cfg if ckpt.get("model_cfg") is None else None)
        # the branches' tensors only: a classifier or stem BN holding NaN changes no branch statistic
        bad = next((k for k, t in model.state_dict().items() if "branches." in k and t.is_floating_point()
                    and not bool(torch.isfinite(t).all())), None)
        if bad:
            raise UserError(f"{target}{EMA_NOTE if args.use_ema else ''} holds non-finite values (NaN/inf), first "
                            f"in {bad} (a branch): its branch statistics would be NaN; give a checkpoint from "
                            "before the run diverged")
        source = str(target)
    elif target.is_dir() and not _names_a_model(args.target):  # a model name wins over a folder of that name
        raise UserError(f"{args.target} is a directory; give a checkpoint file in it"
                        + (f", e.g. {target / 'checkpoint.pth'}" if (target / "checkpoint.pth").is_file() else
                           " (a .pth written by orepa train)") + ", or a model name to analyse at initialisation")
    elif (not target.is_dir() and (target.exists() or target.is_symlink())  # a device, a dangling link
          or target.suffix in (".pt", ".pth", ".ckpt", ".bin") or "/" in args.target):
        load_checkpoint(target)  # not a file: the one loader says what it is (missing, a dangling link, a device)
    else:
        if args.model is not None and args.model != args.target:
            raise UserError(f"two models: {args.target} and -m {args.model}; give one (the target names the model "
                            "to analyse at initialisation)")
        check_use_ema(args.use_ema)
        if args.model is None:
            args = argparse.Namespace(**{**vars(args), "model": args.target})
        cfg = model_cfg_from_args(args, num_classes=1000, in_chans=3, small_input=False)
        seed_everything(args.seed)  # the same figures from the same command
        model = build_model(cfg)
        source = f"{cfg['model']} at initialisation (seed {args.seed}, no checkpoint)"
    options = {**cfg.get("options", {}), **{k: cfg[k] for k in ("small_input", "width_mult") if cfg.get(k)}}
    if options.get("width_mult") == 1.0:
        del options["width_mult"]
    # "ema": which weights of the checkpoint (its EMA's: --use-ema), so that neither analysis passes for the other
    meta = {"source": source, "ema": bool(args.use_ema), "model": cfg["model"], "method": cfg["method"],
            "options": options}
    _check_previous(Path(args.output_dir), meta, args.overwrite)
    try:
        result = analyze(model.to(device).eval(), args.output_dir, plots=not args.no_plot, meta=meta)
    except ValueError as exc:  # no block to analyse
        hint = ("analyse one trained with --method orepa, dbb, ..." if cfg["method"] == "base" else
                "its blocks have one branch each (--branches): analyse a model of two or more")
        raise UserError(f"{source}: {describe_cfg(cfg)}: {exc}, so there is nothing to analyse; {hint}") from None
    print(f"{_described(meta)}: {result['summary']['blocks']} blocks, mean off-diagonal cosine "
          f"{result['summary']['mean_off_diagonal_cosine']:.3f}")
    print(f"{'block':<44}{'branches':>9}{'mean cos':>10}  mean share per branch")
    for name, v in result["layers"].items():
        shares = " ".join(f"{b}={s:.2f}" for b, s in zip(v["branches"], v["mean_share"]))
        print(f"{_short(name):<44}{len(v['branches']):>9}{v['mean_off_diagonal_cosine']:>10.3f}  {shares}")
    print("wrote " + ", ".join(result.get("files", {}).values()))
    return 0


def _check_previous(out: Path, meta: dict, overwrite: bool) -> None:
    """The analysis of another checkpoint or model in ``out`` is replaced only with --overwrite (its
    JSON and plots would go without a word), and so are plots of its names beside no analysis (a
    user's own); a rerun of the same one replaces its own."""
    previous = out / "analysis.json"
    if overwrite:
        return
    if not previous.exists():
        plots = [name for name in PLOT_FILES if (out / name).exists()]
        if plots:
            raise UserError(f"--output-dir {out}: {', '.join(plots)} exist(s) beside no analysis.json (files this "
                            "command writes or removes); pass --overwrite to replace them, or choose another "
                            "--output-dir")
        return
    try:
        held = json.loads(previous.read_text()).get("meta")
    except (OSError, ValueError, AttributeError):
        held = None
    if _same_analysis(held, json.loads(json_text(meta))):
        return
    if not isinstance(held, dict):
        what = "another file"
    elif _other_weights_of_one_checkpoint(held, meta):  # its name alone would say it holds this very analysis
        what = (f"the analysis of {held['source']}'s {_weights(held)} ({held.get('model')}/{held.get('method')}), "
                f"and this run analyses its {_weights(meta)}")
    else:
        what = f"the analysis of {_described(held)} ({held.get('model')}/{held.get('method')})"
    raise UserError(f"--output-dir {out}: {previous.name} holds {what}; pass --overwrite to replace it, or choose "
                    "another --output-dir")


def _same_analysis(held, meta: dict) -> bool:
    """Whether an earlier analysis's ``held`` meta is that of ``meta`` (a rerun of it): the same, with
    its checkpoint named by any path (``run/checkpoint.pth``, ``./run/...``, an absolute one)."""
    # (an analysis written before --use-ema was of the model's weights)
    return isinstance(held, dict) and same_source({"ema": False, **held}, meta, "source")


def _described(meta: dict) -> str:
    """An analysis' source as said: the checkpoint, and whether its EMA weights were analysed."""
    return f"{meta.get('source')}{EMA_NOTE if meta.get('ema') else ''}"


def _weights(meta: dict) -> str:
    """Which weights of its checkpoint an analysis is of (``--use-ema``: the EMA's)."""
    return "EMA weights" if meta.get("ema") else "model weights"


def _other_weights_of_one_checkpoint(held: dict, meta: dict) -> bool:
    """Whether analyses ``held`` and ``meta`` are of one checkpoint (by any path), one of its model's
    weights and the other of its EMA's."""
    a, b = held.get("source"), meta.get("source")
    return (bool(held.get("ema")) != bool(meta.get("ema")) and isinstance(a, str)
            and same_source({"source": a}, {"source": b}, "source"))


def _names_a_model(name: str) -> bool:
    """Whether ``name`` is what the model-name argument takes (a zoo name, torchvision:NAME, timm:NAME)."""
    source, sep, arch = name.partition(":")
    return name in list_models() or bool(sep and arch and source in EXTERNAL_SOURCES)


def _flags(cfg: dict) -> str:
    return (f"--model {cfg['model']} --method {cfg['method']} --num-classes {cfg['num_classes']} "
            f"--in-chans {cfg['in_chans']}" + (" --small-input" if cfg["small_input"] else "")
            + (f" --width-mult {cfg['width_mult']:g}" if cfg["width_mult"] != 1.0 else "")
            + "".join(f" --model-option {k}={v}" for k, v in cfg.get("options", {}).items()))
