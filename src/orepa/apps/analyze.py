"""``orepa analyze CHECKPOINT_OR_MODEL``: branch similarity (Fig. "viz") and branch norms (supp. Fig. "viz_norm").

The checkpoint is a training-form state_dict (or a dict holding it under
``"model"`` / ``"state_dict"``), loaded with ``torch.load(weights_only=True)``
into the architecture given by ``--model`` / ``--method`` (and ``--option``).
Without a checkpoint file, the argument is taken as a model name and the
freshly initialised model is analysed. Writes ``analysis.json`` with every
number, ``cosine.png`` (one heatmap per block), ``norms.png`` (sorted
normalised branch norms per block) and ``summary.png`` (mean off-diagonal
similarity per block) to ``--out-dir``.

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
from orepa.apps.checkpoint import state_dict_mismatch
from orepa.apps.logs import pyplot, save_figure


class CheckpointMismatch(ValueError):
    """The checkpoint's keys or shapes do not match the architecture it is loaded into."""


def _unwrap(ckpt) -> dict:
    if isinstance(ckpt, dict):
        for key in ("model", "state_dict", "model_state_dict"):
            if key in ckpt and isinstance(ckpt[key], dict):
                return _unwrap(ckpt[key])
        if ckpt and all(torch.is_tensor(v) for v in ckpt.values()):
            prefixes = ("module.", "_orig_mod.")
            out = {}
            for k, v in ckpt.items():
                for p in prefixes:
                    while k.startswith(p):
                        k = k[len(p):]
                out[k] = v
            return out
    raise CheckpointMismatch(
        "the checkpoint holds no state_dict: expected a dict of tensors, or a dict with one under 'model'"
    )


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A state_dict from a checkpoint file (``torch.load(weights_only=True)``)."""
    return load_checkpoint(path)[0]


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """``(state_dict, model_cfg or None)``; ``model_cfg`` is what ``orepa train`` checkpoints store
    (model, method, num_classes, in_chans, small_input, width_mult, options)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable or unsafe file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointMismatch(f"cannot read {path} with torch.load(weights_only=True): {first}") from None
    cfg = ckpt.get("model_cfg") if isinstance(ckpt, dict) else None
    form = ckpt.get("form") if isinstance(ckpt, dict) else None
    if form not in (None, "train"):
        raise CheckpointMismatch(f"{path} holds a deployed model (form {form!r}): its branches are gone; "
                                 "analyse the training-form checkpoint")
    return _unwrap(ckpt), (cfg if isinstance(cfg, dict) else None)


def infer_num_classes(sd: dict[str, torch.Tensor]) -> int | None:
    for key in ("fc.weight", "head.fc.weight", "head.weight", "classifier.weight", "classifier.1.weight",
                "classifier.6.weight"):
        if key in sd and sd[key].dim() == 2:
            return int(sd[key].shape[0])
    return None


def check_and_load(model: nn.Module, sd: dict[str, torch.Tensor], what: str) -> nn.Module:
    """Strictly load ``sd`` into ``model``; a mismatch raises :class:`CheckpointMismatch` that lists it."""
    own = model.state_dict()
    problem = state_dict_mismatch(model, sd)
    if problem:
        unexpected = [k for k in sd if k not in own]
        hint = ""
        if any(".branches." in k for k in unexpected) and not any(".branches." in k for k in own):
            hint = " The checkpoint is in training form: pass the --method it was trained with."
        elif not any(".branches." in k for k in sd):
            hint = " The checkpoint has no re-param branches (deployed or base model?): nothing to analyse."
        raise CheckpointMismatch(f"checkpoint does not match {what}: {problem}.{hint}")
    model.load_state_dict(sd, strict=True)
    return model


def build_model(model: str, method: str, num_classes: int, in_chans: int = 3, options: dict | None = None):
    from orepa.apps.bench import build_variant, in_zoo

    if in_zoo(model):  # options go to create_model as they are
        return build_variant(model, method, num_classes, in_chans, model_options=options)
    spec = method + "".join(f":{k}={v!r}" for k, v in (options or {}).items())
    return build_variant(model, spec, num_classes, in_chans)


# --------------------------------------------------------------------------- plots


def _short(name: str) -> str:
    return name.replace("branches.stem.", "stem.").replace(".branches.", ".")


def plot_cosine(result: dict, path: str | Path, ncols: int = 6) -> Path:
    plt = pyplot()

    layers = result["layers"]
    n = max(len(layers), 1)
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.9 * ncols, 2.9 * nrows), squeeze=False,
                             constrained_layout=True)
    im = None
    for ax in axes.flat:
        ax.axis("off")
    for ax, (name, v) in zip(axes.flat, layers.items()):
        ax.axis("on")
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
        ax.set_title(f"{_short(name)} ({v['kernel_size']}x{v['kernel_size']})\nmean off-diag "
                     f"{v['mean_off_diagonal_cosine']:.3f}", fontsize=6)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="cosine similarity")
    return save_figure(fig, path, dpi=110)


def plot_norms(result: dict, path: str | Path, ncols: int = 6) -> Path:
    plt = pyplot()

    layers = result["layers"]
    n = max(len(layers), 1)
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.8 * ncols, 2.2 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (name, v) in zip(axes.flat, layers.items()):
        ax.axis("on")
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
        result["files"] = {k: str(v) for k, v in files.items()}
        files["json"].write_text(json.dumps(result, indent=1))
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="training-form checkpoint (.pt/.pth), or a model name to analyse at init")
    p.add_argument("-m", "--model", default=None,
                   help="architecture (default: the checkpoint's model_cfg, else resnet18)")
    p.add_argument("--method", default=None,
                   help="re-param method the checkpoint was trained with (default: model_cfg, else orepa)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="model/block option used in training, e.g. scaling=scalar, width_mult=0.5, "
                        "small_input=True (repeatable; added to the checkpoint's model_cfg options)")
    p.add_argument("--num-classes", type=int, default=None, help="default: model_cfg, the classifier's shape, 1000")
    p.add_argument("--in-chans", type=int, default=None, help="default: model_cfg, else 3")
    p.add_argument("--out-dir", default="analysis")
    p.add_argument("--no-plot", action="store_true")


def run(args: argparse.Namespace) -> int:
    import sys

    try:
        return _run(args)
    except (CheckpointMismatch, FileNotFoundError) as exc:
        print(f"orepa analyze: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from orepa.apps.bench import parse_spec

    options = parse_spec("x:" + ":".join(args.option))[1] if args.option else {}
    target = Path(args.target)
    method = args.method or "orepa"
    if target.is_file():
        sd, cfg = load_checkpoint(target)
        cfg = cfg or {}
        model_name = args.model or cfg.get("model") or "resnet18"
        method = args.method or cfg.get("method") or "orepa"
        num_classes = args.num_classes or cfg.get("num_classes") or infer_num_classes(sd) or 1000
        in_chans = args.in_chans or cfg.get("in_chans") or 3
        saved_opts = dict(cfg.get("options") or {})
        if cfg.get("small_input"):
            saved_opts["small_input"] = True
        if cfg.get("width_mult") is not None and float(cfg["width_mult"]) != 1.0:
            saved_opts["width_mult"] = float(cfg["width_mult"])
        options = {**saved_opts, **options}
        what = (f"--model {model_name} --method {method} --num-classes {num_classes} --in-chans {in_chans}"
                + "".join(f" --option {k}={v}" for k, v in options.items()))
        model = build_model(model_name, method, num_classes, in_chans, options)
        check_and_load(model, sd, what)
        source = str(target)
    elif target.suffix in (".pt", ".pth", ".ckpt", ".bin") or "/" in args.target:
        raise FileNotFoundError(f"no checkpoint file {args.target!r}")
    else:
        model_name = args.model or args.target
        model = build_model(model_name, method, args.num_classes or 1000, args.in_chans or 3, options)
        source = f"{model_name} at initialisation (no checkpoint)"
    meta = {"source": source, "model": model_name, "method": method, "options": options}
    result = analyze(model.eval(), args.out_dir, plots=not args.no_plot, meta=meta)
    print(f"{source}: {result['summary']['blocks']} blocks, mean off-diagonal cosine "
          f"{result['summary']['mean_off_diagonal_cosine']:.3f}")
    print(f"{'block':<44}{'branches':>9}{'mean cos':>10}  mean share per branch")
    for name, v in result["layers"].items():
        shares = " ".join(f"{b}={s:.2f}" for b, s in zip(v["branches"], v["mean_share"]))
        print(f"{_short(name):<44}{len(v['branches']):>9}{v['mean_off_diagonal_cosine']:>10.3f}  {shares}")
    print("wrote " + ", ".join(result.get("files", {}).values()))
    return 0
