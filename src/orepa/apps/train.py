"""``orepa train``: the paper's ImageNet recipe, Fashion-MNIST by default, DDP under torchrun.

Flags follow torchvision's reference classification script where they overlap.
Defaults follow the paper ("Implementation Details": SGD, lr 0.1 at global batch 256, scaled
linearly with the global batch here, cosine over 120 epochs, 5 linear warm-up epochs). What the
paper leaves unsaid follows the common ImageNet convention (RepVGG's, torchvision's): momentum
0.9, weight decay 1e-4 on conv/linear weights only; none on BN parameters, biases and the
branch scaling vectors (this project's choice, docs/training.md; fixed filters are buffers).

    orepa train                                   # OREPA ResNet-18 on Fashion-MNIST
    orepa train --data-path /data/imagenet -b 64  # ImageNet-style ImageFolder
    torchrun --nproc_per_node=4 -m orepa train --data-path /data/imagenet -b 64 --amp

Run outputs (rank 0 only) in ``--output-dir``: ``checkpoint.pth`` (latest, written
atomically; ``--resume`` it), ``log.jsonl`` / ``log.csv`` (one row per epoch),
``curves.png``, ``summary.json`` and TensorBoard scalars when tensorboard is installed.
A directory that holds a run is not trained into again without ``--resume`` (continue
it) or ``--overwrite`` (replace it).

Resume: ``orepa train --resume DIR/checkpoint.pth`` alone continues that run in DIR with
the settings it was started with (all but the per-session ones: budgets, device, threads,
workers, output verbosity). Flags given explicitly override the saved settings, are
printed as overrides and take effect: a new ``--lr`` (or ``--epochs``, warm-up, ...)
rescales the schedule from the current step, ``--wd`` / ``--momentum`` replace the
optimizer's. Overrides that cannot apply are refused: another model, other data, another
batch size (the position in the run is counted in its steps), fewer epochs than done.
``--auto-resume`` continues the run its output directory holds, where there is one (a requeued
job's command again); a torchrun restart (``--max-restarts``) continues the run its job began.

Fine-tuning: ``orepa train --init-from CKPT --data-path DATA`` starts a new run from the weights
of a training-form checkpoint (``orepa train``'s or ``orepa import-reference``'s), with this
command's settings; a classifier for another class count is made anew, the rest is loaded. A
deployed checkpoint, a ``--method base`` run's, or a plain network's state_dict (torchvision's,
timm's) starts every block as its conv, its other branches at zero, for any ``--method``.

Divergence: a non-finite loss stops the run, and no checkpoint is written unless every
parameter, buffer (BN statistics), optimizer state and EMA tensor is finite, so the
kept checkpoint is the last good state; resume it with a lower ``--lr``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..blocks import ReparamConv2d
from ..engine import group_kernels
from .checkpoint import (
    DERIVED_FILES,
    FORMAT,
    PROGRESS_FILE,
    RUN_FILES,
    VERSION,
    RunLock,
    adapt_input_channels,
    args_dict,
    check_loaded_weights,
    check_not_held,
    check_output_path,
    classifier_rows_by_name,
    holds_run_dir,
    load_checkpoint,
    load_model_state,
    lock_run_dir,
    new_classifier_keys,
    rng_state,
    run_dir_made_since,
    save_checkpoint,
    set_rng_state,
    unlock_run_dir,
    write_json,
)
from .common import (
    DistInfo,
    UserError,
    add_amp_arguments,
    add_kernel_builder_argument,
    add_kernel_graphs_argument,
    add_pack_argument,
    add_run_arguments,
    add_tf32_matmul_argument,
    apply_tf32_matmul,
    apply_threads,
    below_one,
    capture_cuda_graphs,
    class_name,
    cleanup_distributed,
    count_params,
    decay_to_init,
    default_kernel_builder,
    default_pack,
    error_text,
    first_nonfinite,
    fraction,
    init_distributed,
    long_flag,
    make_sgd,
    nonneg_float,
    nonneg_int,
    out_of_memory,
    path_arg,
    peak_memory,
    positive_float,
    positive_int,
    refuse_amp_dtype_without_amp,
    refuse_idle_flags,
    run_fault,
    seed_everything,
    some_of,
    split_params,
    state_hash,
    stop_signals_to_catch,
    torchrun_job,
    user_message,
)
from .data import add_data_arguments, build_data, train_loader, val_loader
from .evaluate import EvaluationFailed, EvaluationStopped, autocast_context, evaluate
from .logs import TensorBoard, plot_curves, write_history
from .model_cfg import (
    add_model_arguments,
    build_model,
    build_model_form,
    cfg_mismatch,
    check_model_fits_data,
    check_model_takes_images,
    deploy,
    describe_cfg,
    model_cfg_from_args,
    model_slug,
)

EXIT_NONFINITE = 3


class NonFiniteLoss(UserError):
    """The loss became NaN/inf; the message says where and which checkpoint is the last good one."""

    exit_code = EXIT_NONFINITE


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message says which checkpoint to resume from."""


class StopSignals:
    """While active (``with``), the first of :data:`STOP_SIGNALS` is recorded in :attr:`received`
    (its name) and the run stops at the next step boundary with a checkpoint; a second Ctrl-C
    interrupts at once. Handlers can only be set from the main thread: elsewhere (a library caller's
    thread) the signals keep their handlers and nothing is recorded."""

    def __init__(self, hold_on_error: bool = False):
        self.received: str | None = None
        self._previous: dict = {}
        self.hold_on_error = hold_on_error

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in stop_signals_to_catch()}
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: now, from the last checkpoint written
        self.received = self.received or signal.Signals(signum).name

    def __exit__(self, exc_type, *exc) -> None:
        if self.hold_on_error and exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
            # a run failing under torchrun: its launcher sends the survivors SIGTERM the moment a rank
            # fails (a rank killed outright), which would end this process before its error line is out
            # (the one that names the checkpoint to resume from); `orepa` (cli.main) restores the handlers
            # once the line is printed
            self._previous = {}
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p)
    add_model_arguments(p)
    g = p.add_argument_group("optimisation (defaults: the paper's recipe; one process needs -b 256 for its batch)")
    g.add_argument("--epochs", type=positive_int, default=120, help="total epochs (120)")
    g.add_argument("-b", "--batch-size", type=positive_int, default=64,
                   help="images per process (64; the paper: global 256 = 4 GPUs x 64)")
    g.add_argument("--micro-batches", type=positive_int, default=1, metavar="N",
                   help="run each process's batch as N micro-batches one after another, their gradients summed "
                        "before the step: the activation memory of -b/N images, BN statistics per micro-batch "
                        "(as on N GPUs: -b 256 --micro-batches 4 is the paper's 4 x 64 on one GPU); a setting of the "
                        "machine the run is on, not taken from the checkpoint on --resume (1)")
    g.add_argument("--lr", type=positive_float, default=None,
                   help="peak learning rate (default: 0.1 x global batch / 256, the paper's rule)")
    g.add_argument("--momentum", type=below_one, default=0.9)
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=nonneg_float, default=1e-4,
                   help="weight decay of conv/linear weights (1e-4)")
    g.add_argument("--norm-weight-decay", type=nonneg_float, default=0.0,
                   help="weight decay of BN parameters and biases (0: none; the paper does not say)")
    g.add_argument("--scale-weight-decay", type=nonneg_float, default=0.0,
                   help="weight decay of the OREPA branch scaling vectors (0: they play the branch BNs' role; "
                        "see docs/training.md)")
    g.add_argument("--lr-scheduler", default="cosineannealinglr",
                   choices=["cosineannealinglr", "cosine", "steplr", "step", "constant"])
    g.add_argument("--lr-warmup-epochs", type=nonneg_float, default=5.0,
                   help="linear warm-up epochs (5; fractions ok: at least one step where above 0)")
    g.add_argument("--lr-warmup-decay", type=fraction, default=0.01, help="warm-up starts at lr x this (0.01)")
    g.add_argument("--lr-min", type=nonneg_float, default=0.0, help="cosine floor")
    g.add_argument("--lr-step-size", type=positive_int, default=30, help="steplr: epochs per decay")
    g.add_argument("--lr-gamma", type=positive_float, default=0.1, help="steplr: decay factor")
    g.add_argument("--label-smoothing", type=fraction, default=0.0, help="in [0, 1] (0)")
    g.add_argument("--clip-grad-norm", type=positive_float, default=None, help="clip the gradient norm (off)")
    g = p.add_argument_group("speed and memory")
    add_amp_arguments(g, training=True)
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=False, help="NHWC memory format")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile the training model")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay forward+backward as CUDA graphs: an online block's eager step is bound by launching "
                        "its many small kernels on fast GPUs. Default: on where it can run (one process on a CUDA "
                        "device, without --compile), with a one-line note where it cannot; --no-cuda-graphs: eager")
    add_kernel_builder_argument(g, default=None)
    add_pack_argument(g)
    add_kernel_graphs_argument(g)
    add_tf32_matmul_argument(g, default=None)
    g.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=False,
                   help="SyncBatchNorm across processes (DDP on GPUs)")
    g.add_argument("--dist-timeout", type=positive_float, default=None, metavar="MIN",
                   help="under torchrun: how long a process waits for the others in a collective before the run "
                        "fails (a peer stuck on I/O or stopped); default torch's (30 min with gloo, NCCL's own)")
    g.add_argument("--model-ema", action=argparse.BooleanOptionalAction, default=False, help="keep an exponential moving average of the weights")
    g.add_argument("--model-ema-steps", type=positive_int, default=32, help="EMA update every N steps (32)")
    g.add_argument("--model-ema-decay", type=below_one, default=0.99998,
                   help="EMA decay per step at batch 1 (adjusted like torchvision's reference script)")
    add_run_arguments(p)
    g = p.add_argument_group("outputs, checkpoints and budgets")
    g.add_argument("--output-dir", type=path_arg, default=None,
                   help="default runs/<data>-<model>-<method>; with --resume: the checkpoint's directory")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run an --output-dir already holds (default: refuse)")
    g.add_argument("--resume", type=path_arg, default=None,
                   help="continue the run of a training checkpoint (model, optimizer, scheduler, scaler, epoch, "
                        "position in the epoch, RNG) with its settings; flags given override them")
    g.add_argument("--auto-resume", action="store_true",
                   help="continue the run --output-dir holds (its checkpoint.pth) where there is one, else start "
                        "this one: for a job that may run its command again (a requeued or retried job). A "
                        "torchrun restart (--max-restarts) continues the run its job began without it")
    g.add_argument("--init-from", type=path_arg, default=None, metavar="CKPT",
                   help="start a new run from the weights of a checkpoint: training-form (of `orepa train`, or "
                        "`orepa import-reference`), or plain weights that start every block as its conv (deployed, a "
                        "--method base run's, or a plain network's state_dict such as torchvision's or timm's: "
                        "any --method); this command's settings, a fresh optimizer and "
                        "schedule; a classifier for another class count (the data's, or --num-classes) is made anew")
    g.add_argument("--test-only", action="store_true", help="only evaluate (the --resume checkpoint)")
    g.add_argument("--save-every", type=nonneg_int, default=0,
                   help="also checkpoint every N steps (0: epoch ends only)")
    g.add_argument("--save-interval", type=positive_float, default=None, metavar="MIN",
                   help="also checkpoint once MIN minutes have passed since the last checkpoint (bounds what a "
                        "killed process or a torchrun restart repeats in long epochs; the main process's clock "
                        "decides, every rank writes at the same step)")
    g.add_argument("--keep-epoch-checkpoints", action=argparse.BooleanOptionalAction, default=False,
                   help="keep model_<epoch>.pth of every epoch")
    g.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after this many optimizer steps in total, checkpointing (a budget; resume later)")
    g.add_argument("--time-limit", type=positive_float, default=None, metavar="MIN",
                   help="stop (and checkpoint) after this many minutes; --resume continues exactly")
    g.add_argument("--print-freq", type=positive_int, default=10, help="progress-bar update every N steps")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--no-tensorboard", action="store_true", help="no TensorBoard logs even if installed")
    g.add_argument("--curves", action=argparse.BooleanOptionalAction, default=True,
                   help="draw curves.png (the default; --no-curves for sweeps of many short runs: a drawing takes a "
                        "tenth of a second)")
    g.add_argument("--no-eval", action="store_true", help="skip the per-epoch evaluation")
    g.add_argument("--eval", dest="no_eval", action="store_false", default=False,
                   help="evaluate every epoch (the default; --resume of a --no-eval run evaluates again)")
    g.add_argument("--quiet", action="store_true", help="no per-epoch lines (the summary is still printed)")


# --------------------------------------------------------------------------- recipe pieces


def _file_identity(path) -> tuple | None:
    """What changes when a file is written again (atomic writes replace it: a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def make_criterion(args) -> nn.Module:
    return nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)


def schedule_name(args) -> str:
    """``--lr-scheduler`` without its aliases (``cosine``, ``step``)."""
    return {"cosine": "cosineannealinglr", "step": "steplr"}.get(args.lr_scheduler, args.lr_scheduler)


def _cfg_flag(args, key: str, value) -> str:
    """How this command gave the model setting ``key`` its ``value``: its own flag (``--num-classes 5``)
    or ``--model-option num_classes=5``."""
    return f"{long_flag(key)} {value}" if getattr(args, key, None) == value else \
        f"--model-option {key}={value}"


def warmup_steps(args, iters_per_epoch: int) -> int:
    """The optimizer steps of the linear warm-up (``--lr-warmup-epochs`` may be a fraction): at least
    one where a warm-up is asked for (one shorter than half a step rounded to none, which left
    --lr-warmup-decay without effect and unsaid)."""
    steps = int(round(args.lr_warmup_epochs * iters_per_epoch))
    return max(1, steps) if args.lr_warmup_epochs > 0 else 0


def lr_factor_fn(args, iters_per_epoch: int):
    """Multiplier of the peak lr after ``it`` optimizer steps: linear warm-up, then the schedule."""
    warm = warmup_steps(args, iters_per_epoch)
    total = args.epochs * iters_per_epoch
    sched = schedule_name(args)
    floor = (args.lr_min / args.lr) if args.lr else 0.0

    def factor(it: int) -> float:
        if it < warm:
            return args.lr_warmup_decay + (1.0 - args.lr_warmup_decay) * it / warm
        if sched == "constant":
            return 1.0
        if sched == "steplr":
            return args.lr_gamma ** ((it - warm) // max(1, args.lr_step_size * iters_per_epoch))
        t = min(1.0, (it - warm) / max(1, total - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    return factor


def make_ema(model: nn.Module, args, info: DistInfo, device):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    # torchvision's reference: decay given per step at batch 1, adjusted for batch, world size and interval
    adjust = info.world_size * args.batch_size * args.model_ema_steps / args.epochs
    alpha = min(1.0, (1.0 - args.model_ema_decay) * adjust)
    return AveragedModel(model, device=device, multi_avg_fn=get_ema_multi_avg_fn(1.0 - alpha), use_buffers=True)


@dataclass
class Progress:
    epoch: int = 0            # epoch in progress (0-based); == epochs done when step_in_epoch == 0
    step_in_epoch: int = 0
    global_step: int = 0
    history: list = field(default_factory=list)
    # loss sum, correct, images of the epoch so far, of all ranks (the same on every rank: a checkpoint's)
    sums: list = field(default_factory=lambda: [0.0, 0.0, 0.0])
    # seconds and steps of the epoch in progress trained before this command (the runs it resumed):
    # an epoch's time is its own, however many commands trained it
    timed: list = field(default_factory=lambda: [0.0, 0])


def _sync_buffers(info: DistInfo, *models: nn.Module | None) -> None:
    """Give every rank rank 0's BN statistics (DDP syncs parameters, not the buffers' last update), the
    EMA's too (each rank averages its own model's statistics: the EMA evaluated across the ranks would
    be none of them, and not the one rank 0 saves)."""
    if info.distributed:
        for model in models:
            for b in () if model is None else model.buffers():
                dist.broadcast(b, 0)


#: flags of one session, never taken from the checkpoint on --resume
SESSION_FLAGS = frozenset({"resume", "auto_resume", "init_from", "test_only", "max_steps", "time_limit", "device", "threads", "workers",
                           "dist_timeout",
                           "micro_batches",
                           # how steps run on this session's device (Trainer._step_modes)
                           "cuda_graphs", "kernel_graphs", "kernel_builder", "compile",
                           "print_freq", "no_progress", "no_tensorboard", "curves", "quiet", "overwrite", "output_dir",
                           "given", "command"})
#: settings a resumed run cannot change: the position in the run is counted in their units (the seed
#: chooses a --train-subset's images and orders every epoch: another would repeat some of the current
#: epoch's images and skip others). (The data's place may change: a moved folder, or a path relative to
#: another directory, is the same data where it holds the same classes and number of training images,
#: which setup checks.)
FIXED_ON_RESUME = ("dataset", "train_subset", "seed")  # (and the global batch: Trainer._restore)
#: what load_state_dict / set_rng_state raise for a saved state that does not fit (or is damaged)
_UNFIT_STATE = (ValueError, KeyError, RuntimeError, TypeError, AttributeError, IndexError)
#: where --overwrite keeps the run it replaces until the new run's first checkpoint
REPLACED_DIR = ".replaced-run"


def run_files(directory: Path) -> list[str]:
    """The files of the run ``directory`` holds, with those reparam made from its checkpoint; [] where
    it holds none (reparam's outputs alone are no run)."""
    found = ([n for n in RUN_FILES + DERIVED_FILES if (directory / n).exists()]
             + sorted(p.name for p in directory.glob("model_*.pth")))
    return found if any(n not in DERIVED_FILES for n in found) else []


def _parser() -> argparse.ArgumentParser:
    """``orepa train``'s flags alone: their defaults, types and choices."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def _given(args: argparse.Namespace) -> frozenset[str]:
    """Flags given explicitly: ``args.given`` (set by ``orepa``), else those that differ from the defaults."""
    if getattr(args, "given", None) is not None:
        return frozenset(args.given)
    defaults = vars(_parser().parse_args([]))
    return frozenset(k for k, v in vars(args).items() if k in defaults and defaults[k] != v)


def _refuse_idle_flags(args: argparse.Namespace) -> None:
    """The flags given that the run's settings (a resumed run's included) leave nothing to do, refused
    (:func:`refuse_idle_flags`): each acts only with another setting, which is off, and whoever gave it
    expects the run to train with it. (``--val-subset`` beside ``--no-eval`` passes: it changes nothing
    that trains, and a shared set of flags holds both.)"""
    refuse_amp_dtype_without_amp(args)
    sched = schedule_name(args)
    run_dir = Path(args.resume).parent if args.resume else None  # where a resumed run lives
    for idle, flags, why in (
            (not args.model_ema, ("model_ema_decay", "model_ema_steps"), "the run keeps no EMA (no --model-ema)"),
            (sched != "steplr", ("lr_step_size", "lr_gamma"),
             f"--lr-scheduler {args.lr_scheduler} does not decay in steps (steplr does)"),
            (sched != "cosineannealinglr", ("lr_min",),
             f"--lr-scheduler {args.lr_scheduler} has no floor (cosine's has)"),
            (args.lr_warmup_epochs == 0, ("lr_warmup_decay",), "the run has no warm-up (--lr-warmup-epochs 0)"),
            (run_dir is not None and args.output_dir is not None
             and Path(args.output_dir).resolve() == run_dir.resolve(), ("overwrite",),
             f"--resume continues the run in {run_dir}, which it does not replace")):
        if idle:
            refuse_idle_flags(args, flags, why)


def _as_parsed(actions: list[argparse.Action], value):
    """A saved setting as the parser makes it from the command line (its type, bounds and choices
    checked); a ValueError says why it is none the parser would make."""
    if value is None and any(a.default is None for a in actions):
        return None
    a = actions[0]
    if a.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ValueError("not true or false")
        return value
    if isinstance(a, argparse._AppendAction):  # a repeatable flag: the list of what was given
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("not a list of texts")
        return value
    if a.type is None:
        if not isinstance(value, str):
            raise ValueError(f"a {type(value).__name__}, not a text")
        parsed = value
    else:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"a {type(value).__name__}, not {getattr(a.type, '__name__', 'a value')}")
        try:
            parsed = a.type(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ValueError(str(exc)) from None
    if a.choices is not None and parsed not in a.choices:
        raise ValueError(f"not one of {', '.join(map(str, a.choices))}")
    return parsed


def resumed_args(args: argparse.Namespace, ckpt: dict) -> tuple[argparse.Namespace, list[str]]:
    """This command's settings on ``--resume``: the checkpoint's run settings, except the flags given
    explicitly (overrides) and the per-session ones. Returns ``(settings, override descriptions)``.
    A saved setting the parser would not make (a damaged or hand-edited checkpoint) is a
    :class:`UserError` naming it, not an error deep inside the run."""
    given = _given(args)
    saved = ckpt.get("args")
    if not saved and "data_path" not in given:
        raise UserError(f"--resume {args.resume}: it records no run settings (no 'args'), so not which data it "
                        "was trained on: give --data-path (an ImageFolder root, or fashion-mnist) and the flags its "
                        "run was started with")
    saved = saved or {}
    actions: dict[str, list[argparse.Action]] = {}
    for a in _parser()._actions:
        actions.setdefault(a.dest, []).append(a)
    out = argparse.Namespace(**vars(args))
    overrides = []
    for key, value in saved.items():
        if key in SESSION_FLAGS or not hasattr(args, key):
            continue
        if key in given:
            if value != getattr(args, key):
                if key in FIXED_ON_RESUME:
                    raise UserError(
                        f"--resume {args.resume}: {long_flag(key)} {getattr(args, key)} cannot apply to "
                        f"this run (it was started with {value!r}; the position in the run is counted in its "
                        "steps and data); start a new run with another --output-dir instead")
                overrides.append(f"{key} {value!r} -> {getattr(args, key)!r}")
        elif key in actions:
            try:
                setattr(out, key, _as_parsed(actions[key], value))
            except ValueError as exc:
                fix = ("the run cannot continue from it (its position is counted in this setting's units): start "
                       "a new run from its weights with --init-from" if key in (*FIXED_ON_RESUME, "batch_size") else
                       f"give {long_flag(key)} to replace it")
                raise UserError(f"--resume {args.resume}: damaged run setting {key} ({str(value)[:40]!r}: {exc}); "
                                + fix) from None
        else:
            setattr(out, key, value)
    if "output_dir" not in given:
        out.output_dir = str(Path(args.resume).parent)
    if "data_path" not in given:
        out._data_path_of = f"--resume {args.resume}"
    done = int(ckpt.get("epoch", 0)) + (int(ckpt.get("step_in_epoch", 0)) > 0)  # begun epochs
    if out.epochs < done:
        raise UserError(f"--resume {args.resume}: --epochs {out.epochs} is fewer than the {done} epoch(s) this run "
                        "has begun")
    return out, overrides


# --------------------------------------------------------------------------- the run


class Trainer:
    def __init__(self, args: argparse.Namespace):
        self.args = argparse.Namespace(**vars(args))  # resume and defaults fill this copy, not the caller's
        self._last_progress = 0.0
        self.drawn = (time.perf_counter(), 0)  # when curves.png was last drawn (or the run began), of how many epochs
        self.signal_stopped = False
        self.epoch_time, self.epoch_steps, self._epoch_t0 = 0.0, 0, None  # this command's part of the epoch
        self.info, self.device = init_distributed(args.device, timeout_min=args.dist_timeout)
        self.signals = StopSignals(hold_on_error=self.info.distributed)  # set up for the training loop by fit()
        self.main = self.info.is_main
        self.t_start = self.saved_at = time.perf_counter()  # saved_at: when the last checkpoint was written
        self.replaced: list[str] = []  # the run --overwrite moved aside until this one's first checkpoint
        self.lock: RunLock | None = None  # the output directory's lock (lock_run_dir), held by the main process
        self.dir_lost = False  # the output directory went, and another run has it now
        self.made_dirs: list[Path] = []
        self.command = argparse.Namespace(**vars(self.args))  # as given: setup fills self.args in
        self.continued = False  # setup turned this command into the continuation of its directory's run
        # what setup says before it knows whether this command continues its directory's run (_continuation):
        # said once that is known, or dropped for the continuation's setup to say again
        self.held: list[tuple] | None = None
        # the torchrun job (restart count, --max-restarts, name): a restart continues the run its job began (setup)
        self.torchrun = torchrun_job(self.info)

    def log(self, *msg) -> None:
        if self.held is not None:
            self.held.append(msg)
        elif self.main:
            print(*msg, flush=True)

    def _say_held(self, drop: bool = False) -> None:
        held, self.held = self.held or [], None
        for msg in [] if drop else held:
            self.log(*msg)

    # ------------------------------------------------------------------ setup
    def _step_modes(self, args: argparse.Namespace) -> None:
        """How this session's steps run (CUDA graphs, recorded kernel builds, the kernel builder):
        decided from the run's settings (as resumed) and this command's flags on this session's
        device, never taken from a checkpoint: every mode computes the same step, and a run begun on
        one GPU may continue on a CPU, under torchrun, or in micro-batches after running out of memory."""
        device, info = self.device, self.info
        # TF32 is the run's precision (a run's --no-tf32-matmul holds on --resume); None: the
        # device's default, decided again by each session's device
        self.tf32_on = apply_tf32_matmul(args.tf32_matmul, device)
        if "tf32_matmul" in _given(args) and device.type != "cuda":  # (a machine's setting: said, not refused)
            self.log(f"note: --{'' if args.tf32_matmul else 'no-'}tf32-matmul acts on CUDA devices only; this run "
                     f"is on {device.type}")
        if args.batch_size % args.micro_batches:
            raise UserError(f"--micro-batches {args.micro_batches} must divide the batch (-b {args.batch_size})")
        why = ("needs a CUDA device" if device.type != "cuda" else
               "runs in one process (DDP's collectives are not captured here; run without torchrun)"
               if info.distributed else "and --compile exclude each other" if args.compile else
               # a graph's gradients land in its own buffers, which the next micro-batch's replay overwrites
               "and --micro-batches exclude each other" if args.micro_batches > 1 else None)
        if args.kernel_graphs:  # recorded kernel builds serve eager steps
            if device.type != "cuda" or args.compile:
                raise UserError("--kernel-graphs " + ("needs a CUDA device" if device.type != "cuda"
                                                      else "and --compile exclude each other"))
            if args.cuda_graphs:
                raise UserError("--kernel-graphs records the kernel construction of eager steps, --cuda-graphs "
                                "whole steps (the construction with them): give one of them")
            if args.cuda_graphs is None:
                args.cuda_graphs = False
                self.log("orepa train: eager steps with the kernel construction replayed as CUDA graphs "
                         "(--kernel-graphs), not whole steps as graphs")
        if args.cuda_graphs is None:  # the default: the fastest exact mode where it can run
            args.cuda_graphs = why is None
            if why is not None and device.type == "cuda":
                self.log(f"orepa train: eager steps, not CUDA graphs (CUDA graphs {why})")
        elif args.cuda_graphs and why:
            raise UserError(f"--cuda-graphs {why}")
        if args.kernel_builder is None:  # the default: the compiled constructions where they can run
            args.kernel_builder, why_not = default_kernel_builder(device, whole_step_compiled=bool(args.compile))
            if why_not:
                self.log(f"orepa train: kernel builder auto, not compiled ({why_not})")
            last = ((self.resume_ckpt or {}).get("args") or {}).get("kernel_builder")
            if last and last != args.kernel_builder:  # (said: the weights then differ from its own by rounding)
                self.log(f"note: kernel builder {args.kernel_builder}, this device's default; the checkpoint's run "
                         f"last built with {last} (the same steps up to rounding; --kernel-builder {last} keeps it)")

    def setup(self) -> None:
        self.held = []
        try:
            self._setup()
        finally:
            self._say_held()  # (a setup that failed before its _continuation: what it said, with its error)

    def _setup(self) -> None:
        args, info, device = self.args, self.info, self.device
        if device.type == "cuda":
            # input shapes are fixed, so cuDNN may time its algorithms once (as torchvision's reference script)
            torch.backends.cudnn.benchmark = True
        self.graphs_captured = False
        self.step_lr: float | None = None  # the rate the last step trained at (_logged_lr)
        self.resume_ckpt = None
        self.overrides: list[str] = []
        saved_cfg = None
        # a run's starting point (fine-tuning): a checkpoint's model and weights, this command's settings,
        # a fresh optimizer and schedule; its path, and the flag that named it (for messages)
        self.start_weights, self.start_path, self.start_flag = None, None, None
        self.plain_start = False  # the starting point holds the plain network's weights (set below)
        if args.resume and args.init_from:
            raise UserError("--resume continues a run and --init-from starts a new one from a checkpoint's weights: "
                            "give one of them")
        for flag, what in (("resume", "continues the checkpoint it names"), ("overwrite", "replaces the run there")):
            if args.auto_resume and getattr(args, flag):
                raise UserError(f"--auto-resume continues the run in --output-dir and --{flag} {what}: give one of "
                                "them")
        decided = args.output_dir is not None
        if decided:  # before anything is read or built for a run this command might not be (an --init-from gone since)
            self.out = Path(args.output_dir)
            self.ckpt_path = self.out / "checkpoint.pth"
            continuation = self._continuation()
            if continuation is not None:  # set up again as the --resume of the run there
                self.args = continuation
                return self._setup()
        if args.resume:
            kept = Path(args.resume).parent / REPLACED_DIR / Path(args.resume).name
            if not Path(args.resume).exists() and kept.is_file():
                raise UserError(f"--resume {args.resume}: no such file; the run --overwrite replaced there is in "
                                f"{kept.parent} (its replacement ended before its first checkpoint): any `orepa "
                                f"train` into {kept.parent.parent} puts it back, or move its files back yourself")
            resumed_file = _file_identity(args.resume)
            self.resume_ckpt = load_checkpoint(args.resume)
        if self.resume_ckpt is not None and self.resume_ckpt.get("imported_from") and \
                self.resume_ckpt.get("form") == "train" and "optimizer" not in self.resume_ckpt:
            # written by `orepa import-reference`: a starting point, not the continuation of a run
            self.start_weights, self.resume_ckpt = self.resume_ckpt, None
            self.start_path, self.start_flag = args.resume, f"--resume {args.resume}"
        elif args.init_from:
            self.start_weights = load_checkpoint(args.init_from)
            self.start_path, self.start_flag = args.init_from, f"--init-from {args.init_from}"
            form = self.start_weights.get("form", "train")
            if form not in ("train", "deploy"):  # a deployed one starts every block as its conv (below)
                raise UserError(f"{self.start_flag}: it holds {form} weights (BNs folded into the convs: not the "
                                "plain network's layout); start from a training-form or deployed (`orepa reparam` "
                                "without --fuse-bn) checkpoint")
        if self.start_weights is not None:
            saved_cfg = self.start_weights.get("model_cfg")
        elif args.resume:
            if "format" not in self.resume_ckpt and "optimizer" in self.resume_ckpt:
                # torchvision's or timm's reference scripts: their optimizer groups, schedule, epoch count and
                # random streams are their own, no position in an orepa run
                raise UserError(f"--resume {args.resume}: another tool's training checkpoint (not one of `orepa "
                                "train`): its optimizer, schedule and position are not an orepa run's; start a new "
                                f"run from its weights with --init-from {args.resume}")
            if self.resume_ckpt.get("form", "train") != "train" or "optimizer" not in self.resume_ckpt:
                raise UserError(f"--resume {args.resume}: not a training checkpoint (it holds "
                                f"{self.resume_ckpt.get('form', 'bare')} weights without optimizer state); "
                                "use `orepa eval` for it, or resume from a checkpoint.pth written by `orepa train`")
            saved_cfg = self.resume_ckpt.get("model_cfg")
            self.args, self.overrides = resumed_args(args, self.resume_ckpt)
            args = self.args
        # a run's identity, kept by its resumes (os.urandom: no random stream of the run moves)
        self.run_id = (self.resume_ckpt or {}).get("run_id") or uuid.uuid4().hex
        _refuse_idle_flags(args)
        self._step_modes(args)
        self.global_batch = args.batch_size * info.world_size
        if self.resume_ckpt is not None:  # before the data are read (an ImageFolder's scan) and the model built
            self._check_global_batch(self.resume_ckpt)
        source = self.start_flag or f"--resume {args.resume}"
        self.data = build_data(args, note=self.log)
        was = tuple(map(class_name, self.resume_ckpt.get("classes") or ())) if self.resume_ckpt is not None else ()
        if was and was != self.data.classes:
            # the folder changed since the run began: its labels would now name other classes
            now = self.data.classes
            change = "; ".join(f"{what} {some_of(names)}" for what, names in (
                ("new:", [c for c in now if c not in was]), ("gone:", [c for c in was if c not in now])) if names)
            raise UserError(f"--resume {args.resume}: {self.data.name} no longer has the classes this run began with "
                            f"({change or 'the same names in another order'}); put the folder back as it was, or "
                            "start a new run from its weights with --init-from")
        saved_size = None if self.resume_ckpt is None else self.resume_ckpt.get("train_images")
        if saved_size is not None and saved_size != self.data.train_images:
            # other images under the same classes: the epoch's order (and a --train-subset's choice), and the
            # position in it, would be others'
            raise UserError(f"--resume {args.resume}: {self.data.name} has {self.data.train_images:,} training images, "
                            f"this run began with {saved_size:,}; put the folder back as it was, or start a new "
                            "run from its weights with --init-from")
        # a starting point's class count is the data's (or --num-classes): fine-tuning on other classes
        # makes a new classifier
        new_head = self.start_weights is not None and saved_cfg is not None
        # the plain network's weights (a deployed checkpoint's, a base run's) start any method, and RGB
        # ones are made for the data's channels when loaded: only the plain network must match
        self.plain_start = new_head and (self.start_weights.get("form") == "deploy" or saved_cfg.get("method") == "base")
        self.deployed_here = ""  # why a training-form starting point was deployed in memory (below)
        self.cfg, expected = self._start_cfg(args, saved_cfg, new_head, self.plain_start)
        if new_head and not self.plain_start and not self._fits(expected, self.cfg):
            # a training form of another method, or one for images of other channels (an RGB run on gray
            # data: its stem's depthwise branch has no one-channel form): its deployed network may fit
            cfg, plain_expected = self._start_cfg(args, saved_cfg, new_head, True)
            if self._fits(plain_expected, cfg):
                stuck = [(n, type(b).__name__) for n, b in build_model(cfg).named_modules()
                         if isinstance(b, ReparamConv2d) and not b.can_start_as_conv]
                if stuck:  # its deployed network fits but for blocks no conv's weights can start (a linear deep stem)
                    other = saved_cfg.get("in_chans") != self.data.in_chans
                    raise UserError(
                        f"{self.start_flag}: "
                        + (f"it takes {saved_cfg['in_chans']}-channel images but {self.data.name} has "
                           f"{self.data.in_chans} channel(s), so its training form does not fit; " if other else "")
                        + "its deployed network would start this model but for "
                        + ", ".join(f"{n} ({kind})" for n, kind in stuck) + ", which no conv's weights can start"
                        + ("; build the model without it: --no-deep-stem"
                           if all(kind == "OREPADeepStem" for _, kind in stuck) else ""))
                self.start_weights = self._deployed_start(saved_cfg)
                self.plain_start = True
                self.deployed_here = "; ".join(
                    [f"{what} {saved_cfg[k]!r}, not {cfg[k]!r}" for k, what in
                     (("method", "its blocks are"), ("in_chans", "its input channels")) if saved_cfg[k] != cfg[k]]
                    + (["other block options"] if saved_cfg["options"] != cfg["options"] else []))
                self.cfg, expected = cfg, plain_expected
        n, have = self.cfg["num_classes"], self.data.num_classes
        if saved_cfg is None and n < have:  # a new run's count (a checkpoint's is checked below)
            raise UserError(f"{_cfg_flag(args, 'num_classes', n)} is fewer than the {have} classes of {self.data.name}")
        if saved_cfg is None and self.cfg["in_chans"] != self.data.in_chans:  # (a checkpoint's: below)
            raise UserError(f"{_cfg_flag(args, 'in_chans', self.cfg['in_chans'])}: the images of {self.data.name} "
                            f"have {self.data.in_chans} channel(s), which a new run's model takes: leave it out")
        if saved_cfg is not None and expected != self.cfg:
            raise UserError(f"{source} was trained as {describe_cfg(saved_cfg)}, but this command "
                            f"builds {describe_cfg(self.cfg)} (" + "; ".join(cfg_mismatch(expected, self.cfg)) + ")")
        if saved_cfg is not None:  # its settings won over the data's: they must fit the data
            check_model_fits_data(self.cfg, self.data, source)
        if args.lr is None:
            args.lr = 0.1 * self.global_batch / 256
        if args.lr_min > args.lr and schedule_name(args) == "cosineannealinglr":
            raise UserError(f"--lr-min {args.lr_min:g} is above the peak --lr {args.lr:g}"
                            + ("" if "lr" in _given(args) else " (0.1 x global batch / 256)")
                            + ": the cosine schedule would raise the learning rate")
        if args.lr_gamma > 1 and schedule_name(args) == "steplr":
            raise UserError(f"--lr-gamma {args.lr_gamma:g} is above 1: the step schedule would raise the learning "
                            f"rate {args.lr_gamma:g}x every --lr-step-size {args.lr_step_size} epoch(s); it decays "
                            "with a factor below 1 (0.1 by default)")
        if args.output_dir is None:
            args.output_dir = f"runs/{self.data.name}-{model_slug(self.cfg['model'])}-{self.cfg['method']}"
        self.out = Path(args.output_dir)
        self.ckpt_path = self.out / "checkpoint.pth"
        continuation = None if decided else self._continuation()  # (the default directory: known only now)
        if continuation is not None:
            self.args = continuation
            return self._setup()
        previous = self._check_output_dir()
        seed_everything(args.seed)  # same initial weights on every rank
        # before the directory is made: a model that cannot be built, or cannot take the data, leaves none
        model = build_model(self.cfg)
        deploy_form = build_model_form(self.cfg, "deploy")  # its size, and the plain layout's shapes
        step = min(args.batch_size // args.micro_batches, len(self.data.train))  # the images of one forward
        flags = f"-b {args.batch_size}" + (f" --micro-batches {args.micro_batches}" if args.micro_batches > 1 else "")
        check_model_takes_images(deploy_form, self.data, describe_cfg(self.cfg), training=True, amp=args.amp,
                                 batch=step, device=self.device, batch_flags=f"{flags} ({step} images a step)",
                                 hint="; more --micro-batches keep the batch and need less",
                                 train_sizes=(args.train_crop_size,) if self.data.name == "imagefolder" else None)
        if self.main:
            self._take_dir()
            if self._recover_replaced_run():  # the directory holds that run again: judged anew
                previous = self._check_output_dir()
            if self.resume_ckpt is not None and _file_identity(args.resume) != resumed_file:
                # read before the lock: a run still writing there (ending as this one started) has
                # written a newer state since, which this run would train over again and replace
                raise UserError(f"--resume {args.resume}: the run in {Path(args.resume).parent} wrote a newer "
                                "checkpoint while this command started (it was still running); run the command "
                                "again to continue from its last state")

        if args.pack_parameters is None:
            # a run resumed from before packing existed holds per-block optimizer state
            resumed_unpacked = self.resume_ckpt is not None and "pack_parameters" not in (self.resume_ckpt.get("args") or {})
            args.pack_parameters = not resumed_unpacked and default_pack(args.kernel_builder, device, bool(args.compile))
        # one autograd node for the network's kernels (the fewest host calls), except under DDP, whose
        # all-reduce of a group's gradients overlaps the rest of the backward only with a node per group
        groups = group_kernels(model, args.kernel_builder, pack=args.pack_parameters, joint=not info.distributed,
                               graphs=args.kernel_graphs, traced=bool(args.compile))
        self.n_groups = len(groups)
        if args.kernel_builder == "compiled" and groups:
            self.log(f"kernel builder: the construction of {len(groups)} group(s) of online blocks is compiled "
                     "during the first training step (seconds per group, taken from inductor's cache in later "
                     "runs; --kernel-builder auto builds them eagerly, uncompiled)")
        if self.start_weights is not None:
            self._load_start_weights(model, saved_cfg, deploy_form)
        self.params_train = count_params(model)
        self.params_deploy = count_params(deploy_form)
        if args.sync_bn and not info.distributed:
            self.log("note: --sync-bn has no effect in one process (it shares BN statistics between the processes "
                     "of a torchrun run)")
        if args.dist_timeout is not None and not info.distributed:
            self.log("note: --dist-timeout has no effect in one process (how long the processes of a torchrun run "
                     "wait for each other)")
        if args.sync_bn and info.distributed:
            if device.type != "cuda":
                raise UserError("--sync-bn needs CUDA devices (SyncBatchNorm has no CPU implementation)")
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model.to(device)
        if args.channels_last:
            model.to(memory_format=torch.channels_last)
        self.model = model  # the plain module: checkpoints, evaluation, EMA

        groups = split_params(model).torch_groups(args.weight_decay, args.scale_weight_decay)
        for g in groups:
            if g["name"] == "no_decay":
                g["weight_decay"] = args.norm_weight_decay
        # float16 gradients underflow without loss scaling: "auto" is float16 on CUDA, bfloat16 elsewhere, but
        # --amp-dtype float16 may be asked on a CPU too
        amp_fp16 = args.amp and (args.amp_dtype == "float16" or (device.type == "cuda" and args.amp_dtype == "auto"))
        self.optimizer = make_sgd(groups, lr=args.lr, momentum=args.momentum, loss_scaled=amp_fp16)
        decay_to_init(self.optimizer, model)  # the identity factors decay towards the identity
        self.loader, self.sampler = train_loader(self.data, args, info, device)
        self.iters_per_epoch = len(self.loader)
        if self.resume_ckpt is not None and int(self.resume_ckpt.get("step_in_epoch", 0)) > self.iters_per_epoch:
            # a checkpoint from before the image count was recorded, whose training set shrank since
            raise UserError(f"--resume {args.resume}: it stopped at step {self.resume_ckpt['step_in_epoch']} of an "
                            f"epoch, but an epoch of {self.data.name} now has {self.iters_per_epoch} steps (the training "
                            "set changed since the run began); put the folder back as it was, or start a new run "
                            "from its weights with --init-from")
        if self.resume_ckpt is not None:
            self._refuse_idle_warmup(self.resume_ckpt)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor_fn(args, self.iters_per_epoch))
        self.warmup_steps = warmup_steps(args, self.iters_per_epoch)
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp_fp16) if device.type == "cuda" or amp_fp16 \
            else None
        self.criterion = make_criterion(args)
        self.ema = make_ema(model, args, info, device) if args.model_ema else None
        self.val = None
        if not args.no_eval:
            self.val = val_loader(self.data, args, info, device, batch_size=max(args.batch_size, 256))

        self.state = Progress()
        if info.distributed:
            # the model is built alike on every rank (from args.seed); from here each rank draws its own
            # random numbers (dropout and drop-path masks), as timm's seed + rank: alike, every rank would drop
            # the same units of its images (the augmentation is a function of seed, epoch and index anyway)
            seed_everything((args.seed + info.rank) % 2**32)
        if self.resume_ckpt is not None:
            self._restore(self.resume_ckpt)
        train_model = model
        if info.distributed:
            train_model = nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
        if args.compile:
            train_model = torch.compile(train_model)
        self.train_model = train_model
        # only now, with the model, data and optimizer built from this command's flags: a mistyped
        # flag must not cost the run it was meant to replace
        self._clear_previous_run(previous)

    def _start_cfg(self, args, saved_cfg: dict | None, new_head: bool, plain: bool) -> tuple[dict, dict | None]:
        """This command's model config, and what it must equal to take the starting point (or
        resumed run) ``saved_cfg``: its config, but for the class count of a new classifier, and for a
        start from the ``plain`` network's weights, which any method and input channels take."""
        free = ("num_classes", "in_chans") if plain else ("num_classes",)
        kept = {k: v for k, v in saved_cfg.items() if k not in free} if new_head else saved_cfg
        cfg = model_cfg_from_args(args, num_classes=self.data.num_classes, in_chans=self.data.in_chans,
                                  small_input=self.data.small_input, saved=kept)
        expected = {**saved_cfg, "num_classes": cfg["num_classes"]} if new_head else saved_cfg
        if plain:
            expected = {**expected, "method": cfg["method"], "options": cfg["options"], "in_chans": cfg["in_chans"]}
        return cfg, expected

    def _fits(self, expected: dict, cfg: dict) -> bool:
        """Whether the model ``cfg`` takes the starting point (``expected``, :meth:`_start_cfg`) and the data."""
        return expected == cfg and cfg["in_chans"] == self.data.in_chans

    def _deployed_start(self, saved_cfg: dict) -> dict:
        """The training-form starting point as its deployed checkpoint (reparameterized here)."""
        model = build_model(saved_cfg)
        load_model_state(model, self.start_weights["model"], path=self.start_path, built=describe_cfg(saved_cfg))
        return {**self.start_weights, "form": "deploy", "model": deploy(model, "deploy").state_dict()}

    def _load_start_weights(self, model: nn.Module, saved_cfg: dict | None, deploy_form: nn.Module) -> None:
        """Load the starting point's weights, but for a classifier of another class count (kept as
        initialised: fine-tuning on other classes). A deployed checkpoint, or a bare state_dict of the
        plain network (e.g. torchvision's or timm's weights, RGB ones adapted to the data's channels):
        every re-param block then starts as its conv."""
        sd, path = self.start_weights["model"], self.start_path
        sd, by_name = classifier_rows_by_name(model, sd, self.cfg["num_classes"],
                                              self.start_weights.get("classes") or (), self.data.classes)
        fresh = new_classifier_keys(model, sd, self.cfg["num_classes"])
        bare = "format" not in self.start_weights
        deployed = self.start_weights.get("form") == "deploy"
        adapted = []
        # a bare state_dict is RGB (torchvision's, timm's, ...); a checkpoint says what it was made for
        src = (saved_cfg or {}).get("in_chans", 3)
        if bare or self.plain_start:  # weights for images of other channels than the data's
            shapes = {k: v.shape for k, v in deploy_form.state_dict().items()}
            shapes.update((k, v.shape) for k, v in model.state_dict().items())
            sd = dict(sd)
            adapted = adapt_input_channels(sd, shapes, self.cfg["in_chans"], src)
        how = load_model_state(model, sd, path=path, built=describe_cfg(self.cfg),
                               saved=describe_cfg(saved_cfg) if saved_cfg else None, keep=fresh,
                               plain=bare or self.plain_start)
        check_loaded_weights(model, path, "a run started from it would train on NaN")
        # where the checkpoint came from: a reference checkpoint it was imported from, a run it was deployed from
        source = self.start_weights.get("source")
        made = "imported" if self.start_weights.get("imported_from") else "deployed"
        head = ""
        if fresh:
            head = (f"; a new {self.cfg['num_classes']}-class classifier ({', '.join(fresh)}) in place of "
                    f"the checkpoint's {tuple(sd[fresh[0]].shape)[0]}-class one")
        if by_name:
            head += f"; {by_name}"
        if adapted:
            name = {1: "gray", 3: "RGB"}.get(src, f"{src}-channel")
            how_made = f"summed over {name}" if self.cfg["in_chans"] == 1 else f"{name} repeated, scaled by {src} / channels"
            head += f"; {name} weights made for {self.cfg['in_chans']} input channel(s), {how_made}: {', '.join(adapted)}"
        if how == "plain" or self.deployed_here:  # (a plain model takes a deployed network as it is)
            what = (f"its training form deployed here ({self.deployed_here})" if self.deployed_here
                    else "deployed weights" if deployed else "a --method base run's weights" if self.plain_start
                    else "the plain network's weights")
            head += f"; {what}" + (": every re-param block starts as its conv, its other branches at zero"
                                   if how == "plain" else "")
        self.log(f"starting from the weights of {path}{f' ({made} from {source})' if source else ''}: "
                 f"fresh optimizer and schedule, this command's settings{head}")

    def _take_dir(self) -> None:
        """Main process: make the output directory and take its lock, before anything of this run is
        written there (once: _continuation may have taken it)."""
        if self.lock is not None:
            return
        # the directories this run makes, deepest first: a run that fails before writing anything
        # leaves none of them (remove_made_dirs)
        self.made_dirs = [d for d in (self.out, *self.out.parents) if not d.exists()]
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--output-dir {self.out}: cannot make the directory ({exc.strerror or exc})") from None
        self.lock = lock_run_dir(self.out)

    def _continuation(self) -> argparse.Namespace | None:
        """This command as the ``--resume`` of the run in its output directory, where it is to continue
        that run rather than begin its own (else None). With --auto-resume: the run of whichever
        checkpoint.pth is there (a requeued job runs its command again as first given). After a
        torchrun restart (--max-restarts: when a process fails, torchrun starts them all again with
        the first command line): the run this torchrun job began, told by the job's name in its
        checkpoint (:func:`torchrun_job`), whatever --resume, --init-from or --overwrite the command
        gives. (The command again would start that run anew, or refuse the directory it made.) A
        run there of another job is judged as the command says, as at its first start. Says what setup
        held back (:attr:`held`) where the command is not to continue it."""
        args = self.args
        if self.continued:
            return None
        here = self.ckpt_path.is_file()
        if args.auto_resume:
            if not here and self.main and (self.out / REPLACED_DIR / "checkpoint.pth").is_file():
                # the run --overwrite moved aside, whose replacement was killed before its first checkpoint:
                # the run there once it is put back (under the lock), so continued rather than refused
                self._say_held()
                self._take_dir()
                self._recover_replaced_run()
                here = self.ckpt_path.is_file()
            if self.info.distributed:  # rank 0's word: it alone puts a run back
                box = [here]
                dist.broadcast_object_list(box, 0)
                here = box[0]
        if not here or (args.resume and Path(args.resume).resolve() == self.ckpt_path.resolve()):
            self._say_held()  # (nothing to continue, or continuing it already)
            return None
        why = None
        if self.torchrun is not None and self.torchrun.restart > 0:
            try:
                job = load_checkpoint(self.ckpt_path, lazy=True).get("torchrun_job")
            except UserError:  # damaged: no word of its job
                job = None
            if job == self.torchrun.name:
                why = f"torchrun restart {self.torchrun.restart}: the run this job began continues"
        if why is None and args.auto_resume:
            why = "--auto-resume: the run there continues"
        if why is None:
            self._say_held()
            return None
        self._say_held(drop=True)  # the continuation's setup says its own
        self.log(f"{why} (--resume {self.ckpt_path})")
        self.continued = True
        command = argparse.Namespace(**vars(self.command))
        command.resume, command.init_from, command.overwrite, command.auto_resume = str(self.ckpt_path), None, False, False
        command.given = (_given(self.command) - {"init_from", "overwrite", "auto_resume"}) | {"resume"}
        return command

    def _check_output_dir(self) -> list[str]:
        """Refuse to train into a directory holding another run unless --overwrite; the files of the run
        that --overwrite will replace (:meth:`_clear_previous_run`, once this run is set up)."""
        args = self.args
        check_output_path(self.out, "--output-dir", directory=True)
        found = run_files(self.out)
        if not found:
            return []
        if self.start_path and Path(self.start_path).resolve().parent == self.out.resolve():
            # a new run would write over (or, with --overwrite, remove) the checkpoint it starts from
            raise UserError(f"--output-dir {self.out} holds the checkpoint this run starts from "
                            f"({self.start_flag}); a new run goes to another --output-dir")
        if args.resume and Path(args.resume).resolve().parent == self.out.resolve():
            self._refuse_rewinding()
            return []  # continuing the run that lives here
        if found == [PROGRESS_FILE]:
            # a run that ended (failed, was killed) before its first checkpoint: nothing to continue or
            # keep. Taken like --overwrite, after the directory's lock: a run still in its first epoch
            # holds that lock and keeps its directory.
            return found
        if not args.overwrite:
            if self.lock is None:  # (not yet this run's: a run still writing there takes neither --resume nor --overwrite)
                check_not_held(self.out)
            what = f"a run ({some_of(found)})"
            hint = f"continue it with --resume {self.ckpt_path}, " if (self.out / "checkpoint.pth").exists() else ""
            raise UserError(f"--output-dir {self.out} already holds {what}; {hint}replace it with --overwrite, "
                            "or choose another --output-dir")
        return found

    def _refuse_rewinding(self) -> None:
        """An earlier state of the run resumed in its own directory (``model_<epoch>.pth``, kept by
        --keep-epoch-checkpoints) would replace the later states there without a word: its
        checkpoint.pth at the first write, the later epochs' files as it reaches them. Refused, with
        both ways on: branching off into another directory, or moving them away to go back. A
        checkpoint.pth that cannot be read holds no state to keep (resuming an epoch's file is then
        the way back)."""
        here = self.resume_ckpt
        step, epoch = int(here.get("global_step", 0)), int(here.get("epoch", 0))
        epochs = {p: int(p.stem[len("model_"):]) for p in self.out.glob("model_*.pth")
                  if p.stem[len("model_"):].isdigit()}  # (the files of --keep-epoch-checkpoints)
        later = sorted((p for p, e in epochs.items() if e > epoch), key=epochs.get)
        if self.ckpt_path.is_file() and self.ckpt_path.resolve() != Path(self.args.resume).resolve():
            try:
                held = load_checkpoint(self.ckpt_path, lazy=True)
            except UserError:
                held = {}
            ours, theirs = here.get("run_id"), held.get("run_id")
            if ours and theirs and ours != theirs:  # (checkpoints older than run ids cannot say: steps alone decide)
                raise UserError(f"--resume {self.args.resume}: {self.out} holds another run ({self.ckpt_path.name}, "
                                f"global step {int(held.get('global_step', 0))}), which continuing there would "
                                f"replace; give another --output-dir to continue from it there, or move that run away")
            if int(held.get("global_step", 0)) > step:
                later.insert(0, self.ckpt_path)
        if later:
            raise UserError(f"--resume {self.args.resume} (step {step}): {self.out} holds later states of this run "
                            f"({', '.join(p.name for p in later)}), which continuing there would replace; give "
                            f"another --output-dir to continue from it there, or move them away to go back in {self.out}")

    def _hold_dir(self) -> None:
        """Before each write into the output directory (main process): it is still this run's. Removed while
        the run trained (an ``rm -rf`` of it), it was made again by the next write without the run's lock,
        and a run started there meanwhile wrote into it with this one. It is made and locked again, said;
        where another run has it now (its lock, or its files in a directory made since), this run stops
        without writing there."""
        if self.lock is None or holds_run_dir(self.lock):
            return
        made = run_dir_made_since(self.lock)
        unlock_run_dir(self.lock)  # (its descriptors only: a lock file there is not this run's)
        self.lock = None
        lost = f"--output-dir {self.out} was removed while this run was writing there"
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self.lock = lock_run_dir(self.out)
        except (UserError, OSError) as exc:
            self.dir_lost = True
            why = exc.strerror if isinstance(exc, OSError) else user_message(exc)
            raise UserError(f"{lost}, and could not be taken again ({why}); this run stops without writing "
                            "there") from None
        others = run_files(self.out) if made else []
        if others:  # a directory made since, by a run that has ended
            unlock_run_dir(self.lock)
            self.lock, self.dir_lost = None, True
            raise UserError(f"{lost}, and another run has written there since ({some_of(others)}); this run stops "
                            "without writing there")
        self.log(f"note: {lost}: made again (what it held is gone) and taken again" if made else
                 f"note: --output-dir {self.out}: its lock {self.lock.path.name} was removed while this run was "
                 "writing there: taken again")

    def _clear_previous_run(self, found: list[str]) -> None:
        """--overwrite: move the previous run aside (``REPLACED_DIR``); it is removed once this run has
        a checkpoint of its own (:meth:`_drop_replaced_run`), and put back if this run ends before
        (:meth:`restore_replaced_run`): a run that fails at its first step costs nothing."""
        if not found or not self.main:
            return
        if found == [PROGRESS_FILE] and not self.args.overwrite:
            (self.out / PROGRESS_FILE).unlink(missing_ok=True)
            shutil.rmtree(self.out / "tb", ignore_errors=True)  # its curves would run into this run's
            self.log(f"note: {self.out} held only the progress of a run that ended before its first checkpoint; "
                     "this run replaces it")
            return
        keep = self.out / REPLACED_DIR
        shutil.rmtree(keep, ignore_errors=True)  # one left by a run killed before its first checkpoint
        keep.mkdir()
        for name in [*found, "tb"]:
            if (self.out / name).exists():
                os.replace(self.out / name, keep / name)
        self.replaced = found
        self.log(f"note: --overwrite: the previous run's {', '.join(found)} moved to {keep}; removed when this "
                 "run writes its first checkpoint, put back if it ends before")

    def _recover_replaced_run(self) -> bool:
        """Under the directory's lock: a run that --overwrite moved aside (``REPLACED_DIR``) whose
        replacement died before its first checkpoint (killed outright: no cleanup ran) is put back, so
        that this command finds it as it was. Returns whether it did."""
        if not (self.out / REPLACED_DIR).is_dir() or (self.out / "checkpoint.pth").exists():
            return False
        back = self._put_back_replaced()
        self.log(f"note: {self.out}: the run --overwrite moved aside ({', '.join(back)}) is back: the run replacing "
                 "it ended before its first checkpoint")
        return True

    def _put_back_replaced(self) -> list[str]:
        """The files of the run in ``REPLACED_DIR`` back in the run directory, the replacing run's own
        files gone; returns their names."""
        keep = self.out / REPLACED_DIR
        for name in RUN_FILES:
            (self.out / name).unlink(missing_ok=True)
        shutil.rmtree(self.out / "tb", ignore_errors=True)
        back = sorted(p.name for p in keep.iterdir())
        for name in back:
            os.replace(keep / name, self.out / name)
        keep.rmdir()
        return back

    def _drop_replaced_run(self) -> None:
        if self.replaced:
            shutil.rmtree(self.out / REPLACED_DIR, ignore_errors=True)
            self.replaced = []

    def remove_made_dirs(self) -> None:
        """After a failed setup or run (its lock released): the directories it made that stayed empty."""
        for d in self.made_dirs:
            try:
                d.rmdir()
            except OSError:  # it holds something (this run's files, another's): kept, and so its parents
                break
        self.made_dirs = []

    def restore_replaced_run(self) -> None:
        """This run ended before its first checkpoint: its own files go, the previous run's come back."""
        if not self.replaced:
            return
        if not (self.out / REPLACED_DIR).is_dir():  # removed meanwhile by someone else: nothing to put back
            self.replaced = []
            return
        self._put_back_replaced()
        self.log(f"note: the previous run's {', '.join(self.replaced)} are back in {self.out} (this run wrote "
                 "no checkpoint)")
        self.replaced = []

    def _check_global_batch(self, ckpt: dict) -> None:
        """The position in the run (its sampler's, its schedule's) is counted in steps of the global batch:
        that stays, however many processes share it (each rank's part of an epoch's permutation is then the
        same images: DistributedSampler's shards of one order)."""
        args, saved = self.args, ckpt.get("args") or {}
        world, b0 = self.info.world_size, saved.get("batch_size")
        w0 = saved.get("world_size") or world
        if isinstance(b0, int) and not isinstance(b0, bool) and b0 > 0 and b0 * w0 != self.global_batch:
            share = b0 * w0 / world
            keep = (f"-b {share:.0f} with {world} process(es) keeps it" if share.is_integer() else
                    f"{world} process(es) cannot share it evenly")
            raise UserError(f"--resume {args.resume}: this run's global batch is {w0} x {b0} = {b0 * w0} images, "
                            f"this command's {world} x {args.batch_size} = {self.global_batch} (the position in the "
                            f"run and its schedule are counted in steps of that batch); {keep}, or start a new run "
                            "from its weights with --init-from")

    def _refuse_idle_warmup(self, ckpt: dict) -> None:
        """A warm-up setting changed on --resume that the rest of the run never reads, refused (it was
        taken and changed nothing): --lr-warmup-decay once the warm-up has ended (it sets the warm-up's
        rates only); --lr-warmup-epochs where both warm-ups have ended and the schedule after them is
        constant (cosine's and steplr's are counted from the warm-up's end: a change moves them)."""
        args, saved, ipe = self.args, ckpt.get("args") or {}, self.iters_per_epoch
        step = int(ckpt.get("global_step", 0))
        changed = {k for k in ("lr_warmup_decay", "lr_warmup_epochs") if k in _given(args)
                   and isinstance(saved.get(k), (int, float)) and saved[k] != getattr(args, k)}
        warm = warmup_steps(args, ipe)
        was = warmup_steps(argparse.Namespace(lr_warmup_epochs=saved.get("lr_warmup_epochs", 0)), ipe) \
            if "lr_warmup_epochs" in changed else warm
        ended = f"this run's warm-up ended at step {was} (epoch {was / ipe:g})"
        if "lr_warmup_decay" in changed and step >= warm:
            key, why = "lr_warmup_decay", (f"{ended if was == warm else f'the warm-up would end at step {warm}'}, "
                                           f"and the run is at step {step} (the flag sets the warm-up's first rate)")
        elif "lr_warmup_epochs" in changed and schedule_name(args) == "constant" and step >= max(warm, was):
            key, why = "lr_warmup_epochs", (f"{ended}, this one would end at step {warm}, and the run is at step "
                                            f"{step}, where the constant schedule's rate does not depend on either")
        else:
            return
        raise UserError(f"--resume {args.resume}: {long_flag(key)} {getattr(args, key):g} changes nothing: "
                        f"{why}; leave it out")

    def _restore(self, ckpt: dict) -> None:
        args = self.args
        load_model_state(self.model, ckpt["model"], path=args.resume, built=describe_cfg(self.cfg),
                         saved=describe_cfg(ckpt["model_cfg"]) if ckpt.get("model_cfg") else None)
        hyper = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                 for g in self.optimizer.param_groups]
        try:
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.scheduler.load_state_dict(ckpt["lr_scheduler"])
        except _UNFIT_STATE as exc:
            packed = bool((ckpt.get("args") or {}).get("pack_parameters"))
            hint = (f"; it was saved {'with' if packed else 'without'} packed parameters: resume with "
                    f"--{'' if packed else 'no-'}pack-parameters" if packed != bool(args.pack_parameters) else "")
            raise UserError(f"--resume {args.resume}: optimizer/scheduler state does not fit ({exc}){hint}") from None
        # this command's settings take effect (unchanged ones give back exactly the saved values):
        # weight decay and momentum per group, and the schedule of --lr/--epochs/warm-up at this step
        factor = lr_factor_fn(args, self.iters_per_epoch)
        step = self.scheduler.last_epoch
        for g, h in zip(self.optimizer.param_groups, hyper):
            g.update(h)
            g["initial_lr"], g["lr"] = args.lr, args.lr * factor(step)
        self.scheduler.base_lrs = [args.lr] * len(self.optimizer.param_groups)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        if self.ema is not None:
            if "model_ema" in ckpt:
                load_model_state(self.ema.module, ckpt["model_ema"], path=f"{args.resume} (its EMA weights)",
                                 built=describe_cfg(self.cfg))
                self.ema.n_averaged.copy_(ckpt.get("ema_n_averaged", self.ema.n_averaged))
            else:
                self.ema.module.load_state_dict(self.model.state_dict())
                self.log(f"note: {args.resume} has no EMA weights; the EMA restarts from the resumed weights")
        if isinstance(ckpt.get("step_lr"), float):  # what the last step trained at, whatever the overrides
            self.step_lr = ckpt["step_lr"]
        self.state = Progress(int(ckpt["epoch"]), int(ckpt.get("step_in_epoch", 0)), int(ckpt.get("global_step", 0)),
                              list(ckpt.get("history", [])),
                              list(ckpt.get("epoch_sums", [0.0, 0.0, 0.0])),  # all ranks', as every rank holds
                              list(ckpt.get("epoch_timed", [0.0, 0])) if int(ckpt.get("step_in_epoch", 0)) else [0.0, 0])
        if "rng" in ckpt:
            ranks = ckpt.get("rng_ranks") or []
            try:
                if self.info.distributed and len(ranks) == self.info.world_size:
                    set_rng_state(ranks[self.info.rank])  # each rank's own stream goes on
                else:
                    set_rng_state(ckpt["rng"])
                    if self.info.distributed and self.info.rank:
                        # no state of this rank (a run saved by another number of processes, or before the
                        # ranks' streams were saved): one of its own, made from where the run is
                        seed_everything((args.seed + 1_000_003 * int(ckpt.get("global_step", 0)) + self.info.rank)
                                        % 2**32)
            except _UNFIT_STATE as exc:
                raise UserError(f"--resume {args.resume}: damaged rng (the random generators' state: "
                                f"{error_text(exc, 160, all_lines=True)}); the run cannot continue exactly from it: "
                                "start a new run from its weights with --init-from") from None
        check_loaded_weights(self.model, args.resume, "the run cannot continue from it", optimizer=self.optimizer,
                             ema=self.ema)
        saved = ckpt.get("args") or {}
        world = self.info.world_size
        w0 = saved.get("world_size") or world
        # (its global batch: _check_global_batch, before the data were read and the model built)
        # and so is an epoch's step count, which the processes' shares of the images round (a sampler
        # pads each rank's share to the same size): the same global batch may still give other steps
        spe = ckpt.get("steps_per_epoch")
        spe = spe if isinstance(spe, int) and not isinstance(spe, bool) else None
        if w0 != world and (spe or 0) != self.iters_per_epoch:
            had = (f"an epoch of this run has {spe} steps, here it would have {self.iters_per_epoch} ({world} x "
                   f"-b {args.batch_size} over {len(self.data.train):,} images: the processes' shares round "
                   "differently)" if spe else
                   f"it records no steps per epoch (an older checkpoint), so not whether {world} process(es) "
                   "give as many")
            raise UserError(f"--resume {args.resume}: {had}; the position in the run and its schedule are counted in "
                            f"those steps: resume with {w0} process(es), or start a new run from its weights with "
                            "--init-from")
        if saved.get("world_size") not in (None, world):
            self.overrides.append(f"world size {saved['world_size']} -> {world}")
        st = self.state
        # (a run that ended is at the end of its last epoch, not at the start of one more)
        where = (f"epoch {st.epoch + 1}, step {st.step_in_epoch}" if st.epoch < args.epochs else
                 f"its end ({st.epoch}/{args.epochs} epochs)")
        self.log(f"resumed {args.resume}: {where}, global step {st.global_step}, "
                 + ("with its settings; " if saved else "with this command's settings (it records none); ")
                 + (f"overrides: {', '.join(self.overrides)}" if self.overrides else "no overrides"))

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, reason: str) -> Path | None:
        """Save (rank 0) the current position. Collective: every rank must call it at the same step."""
        _sync_buffers(self.info, self.model, self.ema)
        bad = first_nonfinite(self.model, self.optimizer, self.ema)
        flag = torch.tensor([float(bad is not None)], device=self.device)
        if self.info.distributed:
            dist.all_reduce(flag)
        if flag.item() > 0:
            raise NonFiniteLoss(f"{bad or 'a tensor on another rank'} became non-finite by global step "
                                f"{self.state.global_step} ({reason} checkpoint not written)")
        rngs = [rng_state()]  # every rank's random streams, so that a resumed run draws as this one would
        if self.info.distributed:
            rngs = [None] * self.info.world_size
            dist.all_gather_object(rngs, rng_state())
        if not self.main:
            return None
        self._hold_dir()
        s = self.state
        ckpt = {
            "format": FORMAT, "version": VERSION, "form": "train", "model_cfg": self.cfg,
            "classes": list(self.data.classes),  # label i's name: eval reads other folders by name
            "train_images": self.data.train_images,  # a resumed run's data must be the same (setup)
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else {},
            "epoch": s.epoch, "step_in_epoch": s.step_in_epoch, "global_step": s.global_step,
            "steps_per_epoch": self.iters_per_epoch,  # a resume with another process count must have as many
            "step_lr": self.step_lr,  # the rate the last step trained at: an epoch ended on resume logs it
            "epoch_sums": list(s.sums), "epoch_timed": self._epoch_timed() if s.step_in_epoch else [0.0, 0],
            "history": s.history, "rng": rngs[0], **({"rng_ranks": rngs} if self.info.distributed else {}),
            "args": {**args_dict(self.args), "world_size": self.info.world_size}, "reason": reason,
            "run_id": self.run_id,  # which run this is: a resume into a directory holding another is refused
            # the torchrun job that wrote it: that job's restart continues from it (_continuation)
            **({"torchrun_job": self.torchrun.name} if self.torchrun else {}),
        }
        if self.ema is not None:
            ckpt["model_ema"] = self.ema.module.state_dict()
            ckpt["ema_n_averaged"] = self.ema.n_averaged.detach().cpu()
        if s.history:
            ckpt["metrics"] = {k: v for k, v in s.history[-1].items() if k.startswith("val_")}
        path = save_checkpoint(ckpt, self.ckpt_path)
        self.saved_at = time.perf_counter()
        self._drop_replaced_run()
        if self.args.keep_epoch_checkpoints and reason == "epoch":
            save_checkpoint(ckpt, self.out / f"model_{s.epoch}.pth")
        return path

    # ------------------------------------------------------------------ one epoch
    def train_epoch(self) -> str | None:
        """Train the rest of the current epoch; returns a stop reason or None."""
        args, s, device, info = self.args, self.state, self.device, self.info
        self.sampler.set_epoch(s.epoch)
        self.sampler.set_start(s.step_in_epoch * args.batch_size)
        self.train_model.train()
        steps_left = len(self.loader)
        bar = None
        if self.main and not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=self.iters_per_epoch, initial=s.step_in_epoch, desc=f"epoch {s.epoch + 1}/{args.epochs}",
                       dynamic_ncols=True, leave=False, mininterval=0.5 if sys.stderr.isatty() else 30)
        acc = torch.zeros(3, dtype=torch.float64, device=device)  # this session's loss sum, correct, images (all ranks)
        self._epoch_t0 = t0 = time.perf_counter()
        stop = None
        steps = self.epoch_steps = 0
        try:
            for images, target in self._batches(acc):
                images = images.to(device, non_blocking=True)
                if args.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                target = target.to(device, non_blocking=True)
                if args.cuda_graphs and not self.graphs_captured:  # captured on the first batch (static shapes)
                    with autocast_context(device, args.amp, args.amp_dtype, cache_enabled=False):
                        capture_cuda_graphs(self.model, images, self.optimizer)
                    self.graphs_captured = True
                # None, never zeros: with CUDA graphs a kept .grad aliases the graph's gradient buffer
                # and would be doubled (see capture_cuda_graphs)
                self.optimizer.zero_grad(set_to_none=True)
                loss, sums = self._forward_backward(images, target)
                # one all-reduce a step: every rank stops and checkpoints at the same step (a signal may
                # reach one rank only; the main process's clock decides --save-interval) (the host's
                # flags in one copy to the device, all four back in one); the step's sums ride along, so
                # every rank holds the epoch's sums of all ranks (progress.json's loss means the same
                # after a resume, whose checkpoint holds those)
                host = [float(self._time_up()), float(self.signals.received is not None), float(self._save_due())]
                flags = torch.cat([(~torch.isfinite(loss)).to(torch.float64).view(1),
                                   torch.tensor(host, dtype=torch.float64, device=device), sums])
                if info.distributed:
                    dist.all_reduce(flags)
                nonfinite, time_up, signalled, save_due = (f > 0 for f in flags[:4].tolist())
                if nonfinite:  # before the step: the weights stay those of the last good step
                    raise NonFiniteLoss(f"loss is {loss.item()} {self.where()} (global step {s.global_step + 1})" +
                                        (" on some rank" if info.distributed else ""))
                if self.scaler is not None and self.scaler.is_enabled():
                    if args.clip_grad_norm:
                        self.scaler.unscale_(self.optimizer)
                        nn.utils.clip_grad_norm_(self.model.parameters(), args.clip_grad_norm)
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    if args.clip_grad_norm:
                        nn.utils.clip_grad_norm_(self.model.parameters(), args.clip_grad_norm)
                    self.optimizer.step()
                self.step_lr = self.optimizer.param_groups[0]["lr"]  # the rate this step trained at (logs)
                self.scheduler.step()
                if self.ema is not None and s.global_step % args.model_ema_steps == 0:
                    self.ema.update_parameters(self.model)
                    if s.global_step < self.warmup_steps:
                        # torchvision: restart the average during warm-up (counted in steps: a fractional
                        # warm-up's epoch goes on after it)
                        self.ema.n_averaged.fill_(0)
                acc += flags[4:]
                s.step_in_epoch += 1
                s.global_step += 1
                steps += 1
                self.epoch_steps = steps
                if bar is not None:
                    bar.update(1)
                    if steps % args.print_freq == 0 or steps == steps_left:
                        m = self._running(acc, steps, t0)
                        bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc1']:.1f}%", img_s=f"{m['images_per_s']:.0f}",
                                        lr=f"{m['lr']:.3g}")
                if self.main and time.perf_counter() - self._last_progress > 5.0:
                    self._write_progress(acc, steps, t0)
                due = save_due or args.save_every and s.global_step % args.save_every == 0
                if due and s.step_in_epoch < self.iters_per_epoch:  # (the epoch's end writes one anyway)
                    self._flush_sums(acc)
                    self.checkpoint("step")
                if args.max_steps is not None and s.global_step >= args.max_steps:
                    stop = f"--max-steps {args.max_steps} reached"
                elif time_up:
                    stop = f"--time-limit {args.time_limit:g} min reached"
                elif signalled:
                    stop = self._signal_stop()
                if stop:
                    if self.main:  # (else it keeps the position of its last periodic write)
                        self._write_progress(acc, steps, t0)
                    break
        finally:  # a fault in the loop (an unreadable image, a peer gone) ends the bar's line first
            if bar is not None:
                bar.close()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.epoch_time = time.perf_counter() - t0
        self._epoch_t0 = None
        self._flush_sums(acc)
        return stop

    def _batches(self, acc: torch.Tensor):
        """The loader's batches. A batch it cannot deliver (an unreadable image, a worker the system killed) first
        keeps the steps this epoch trained before it as a checkpoint at the last one (one process only, since
        the save is collective): the cause removed, --resume continues with the very batches the run would train."""
        try:
            yield from self.loader
        except Exception:  # (the weights are those of the last step, whatever the loader met)
            if not self.info.distributed and self.epoch_steps:
                self._flush_sums(acc)
                self.checkpoint("fault")
            raise

    def _forward_backward(self, images: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's gradients, over ``--micro-batches`` pieces of the batch one after another (each
        piece's loss weighted by its share; under DDP the gradients are all-reduced once, with the last
        piece's backward). Returns the batch's mean loss (detached) and this step's ``[loss sum, correct,
        images]``."""
        args, n = self.args, self.args.micro_batches
        sums = torch.zeros(3, dtype=torch.float64, device=images.device)
        loss_sum = None
        for i, (x, t) in enumerate(zip(images.chunk(n), target.chunk(n))):
            last = i == n - 1
            sync = self.train_model.no_sync() if self.info.distributed and not last else contextlib.nullcontext()
            with sync:
                with autocast_context(self.device, args.amp, args.amp_dtype, cache_enabled=not args.cuda_graphs):
                    output = self.train_model(x)
                    loss = self.criterion(output, t)
                part = loss / n if n > 1 else loss
                (self.scaler.scale(part) if self.scaler is not None and self.scaler.is_enabled() else part).backward()
            with torch.no_grad():
                loss = loss.detach()
                loss_sum = loss if loss_sum is None else loss_sum + loss
                sums += torch.stack([loss.double() * len(t), output.detach().argmax(1).eq(t).sum().double(),
                                     torch.tensor(float(len(t)), dtype=torch.float64, device=images.device)])
        return (loss_sum / n if n > 1 else loss_sum), sums

    def _logged_lr(self) -> float:
        """The rate the last step trained at (the optimizer holds the next step's once the schedule stepped)."""
        return self.step_lr if self.step_lr is not None else self.optimizer.param_groups[0]["lr"]

    def _running(self, acc: torch.Tensor, steps: int, t0: float) -> dict:
        """The running loss/accuracy over the epoch so far (all ranks'), and the global throughput."""
        loss_sum, c, n = (a + b for a, b in zip(self.state.sums, acc.tolist()))
        el = time.perf_counter() - t0
        return {"loss": loss_sum / max(n, 1), "acc1": 100 * c / max(n, 1),
                "images_per_s": steps * self.global_batch / max(el, 1e-9), "lr": self._logged_lr()}

    def _write_progress(self, acc: torch.Tensor, steps: int, t0: float) -> None:
        """``progress.json``: where the run is, for monitoring (``watch cat``; the demo reads it)."""
        s = self.state
        row = {"epoch": s.epoch + 1, "epochs": self.args.epochs, "step": s.step_in_epoch,
               "steps_per_epoch": self.iters_per_epoch, "global_step": s.global_step,
               "total_steps": self.args.epochs * self.iters_per_epoch, **self._running(acc, steps, t0),
               "elapsed_s": time.perf_counter() - self.t_start}
        self._hold_dir()
        write_json(self.out / PROGRESS_FILE, row)
        self._last_progress = time.perf_counter()

    def _run_time(self) -> float:
        """Seconds the run has trained, by this command and the runs it resumed: its epochs' (each its own,
        however many commands trained it) and the epoch in progress's, every step of the run timed once."""
        s = self.state
        done = sum(r.get("epoch_time_s") or 0.0 for r in s.history if isinstance(r, dict))
        return done + (self._epoch_timed()[0] if s.step_in_epoch else 0.0)

    def _epoch_timed(self) -> list:
        """[seconds, steps] of the epoch in progress trained so far, by this command and the runs it resumed."""
        t = self.epoch_time if self._epoch_t0 is None else time.perf_counter() - self._epoch_t0
        return [self.state.timed[0] + t, self.state.timed[1] + self.epoch_steps]

    def _flush_sums(self, acc: torch.Tensor) -> None:
        self.state.sums = [a + b for a, b in zip(self.state.sums, acc.tolist())]
        acc.zero_()

    def _time_up(self) -> bool:
        return self.args.time_limit is not None and time.perf_counter() - self.t_start > 60 * self.args.time_limit

    def _save_due(self) -> bool:
        """--save-interval has passed since the last checkpoint, by the main process's clock (the step's
        all-reduce carries its word to every rank: each writes at the same step)."""
        interval = self.args.save_interval  # (a resumed older run's: this command's, resumed_args)
        return self.main and interval is not None and time.perf_counter() - self.saved_at >= 60 * interval

    def _signal_stop(self) -> str:
        self.signal_stopped = True
        return f"{self.signals.received or 'a stop signal'} received" + \
            ("" if self.signals.received or not self.info.distributed else " (by another rank)")

    def _stop_asked(self) -> bool:
        """A stop signal reached this process (the evaluation asks before each batch)."""
        return self.signals.received is not None

    def _signal_between_epochs(self) -> bool:
        """A stop signal that came during an epoch's end (evaluation, checkpoint), on any rank."""
        got = torch.tensor([float(self._stop_asked())], dtype=torch.float64, device=self.device)
        if self.info.distributed:
            dist.all_reduce(got)
        return got.item() > 0

    # ------------------------------------------------------------------ the loop
    def where(self) -> str:
        """Where the run is, for a fault's message: a step of an epoch, or its evaluation."""
        s = self.state
        if s.step_in_epoch >= self.iters_per_epoch:
            return f"in the evaluation after epoch {s.epoch + 1}"
        return f"at epoch {s.epoch + 1}, step {s.step_in_epoch + 1}"

    def how_to_go_on(self) -> str:
        """After a fault: the checkpoint that is still good, and the command that continues from it."""
        if self.dir_lost:  # (a checkpoint.pth there is another run's)
            return "this run's checkpoints went with its directory"
        if self.ckpt_path.exists():
            said = f"the last checkpoint is {self.ckpt_path}: --resume {self.ckpt_path} continues the run"
            job = self.torchrun
            if job is not None and job.restart < job.max_restarts:
                said += f" (as torchrun's restart {job.restart + 1} of {job.max_restarts} will)"  # (_continuation)
            return said
        return "no checkpoint had been written yet"

    def fit(self) -> dict:
        args, s, info = self.args, self.state, self.info
        if s.epoch >= args.epochs:  # resumed at its end: nothing to train
            saved_epochs = ((self.resume_ckpt or {}).get("args") or {}).get("epochs")
            if saved_epochs != args.epochs:  # an --epochs override ends the run here: its checkpoint says so
                self.checkpoint("ended")  # (as the run's last epoch would have; a later plain --resume agrees)
            return self._complete_run(f"ends a complete run ({s.epoch}/{args.epochs} epochs, {s.global_step} steps): "
                                      f"nothing to train; --epochs N above {args.epochs} continues it")
        if args.max_steps is not None and s.global_step >= args.max_steps and self.resume_ckpt is not None:
            return self._complete_run(f"is at step {s.global_step}, the --max-steps {args.max_steps} given: nothing "
                                      "to train; a higher --max-steps, or none, continues the run",
                                      stop=f"--max-steps {args.max_steps} reached")
        self.log(f"orepa train: {describe_cfg(self.cfg)}")
        self.log(f"  params: {self.params_train:,} training form, {self.params_deploy:,} deployed; "
                 f"data: {self.data.name}, {len(self.data.train)} train / {len(self.data.val)} val images")
        self.log(f"  {info.world_size} process(es) on {self.device}, global batch {self.global_batch}, "
                 f"lr {args.lr:g} ({args.lr_scheduler}, {args.lr_warmup_epochs:g} warm-up epochs), "
                 f"{self.iters_per_epoch} steps/epoch x {args.epochs} epochs, wd {args.weight_decay:g}"
                 f"{', AMP' if args.amp else ''}{', channels_last' if args.channels_last else ''}"
                 f"{', compiled' if args.compile else ''}{', CUDA graphs' if args.cuda_graphs else ''}"
                 f"{', TF32 matmuls' if self.tf32_on and self.device.type == 'cuda' else ''}"
                 f"{f', kernel builder {args.kernel_builder}' if self.n_groups else ''}"
                 f"{', packed parameters' if args.pack_parameters and self.n_groups else ''}"
                 f"{', kernel graphs' if args.kernel_graphs and self.n_groups else ''}"
                 f"{', EMA' if self.ema is not None else ''}; "
                 f"output {self.out}")
        total = args.epochs * self.iters_per_epoch
        if args.lr_warmup_epochs >= args.epochs:  # (the default warm-up, 5 epochs, with a short run)
            peak = lr_factor_fn(args, self.iters_per_epoch)(total - 1)
            self.log(f"  note: the {args.lr_warmup_epochs:g}-epoch warm-up outlasts the {args.epochs}-epoch run: the "
                     f"learning rate ends at {peak:.0%} of --lr {args.lr:g}, and the {args.lr_scheduler} schedule "
                     "never starts (--lr-warmup-epochs sets the warm-up)"
                     + ("; the EMA restarts at every update during warm-up (as torchvision's), so it ends as the "
                        f"weights at its last update (every {args.model_ema_steps} steps, --model-ema-steps)"
                        if self.ema is not None else ""))
        elif schedule_name(args) == "steplr" and args.lr_gamma != 1 and \
                lr_factor_fn(args, self.iters_per_epoch)(total - 1) == 1:
            self.log(f"  note: --lr-step-size {args.lr_step_size} epoch(s) after the warm-up is not within the "
                     f"{args.epochs}-epoch run: the step schedule never decays the learning rate")
        if self.ema is not None and total <= args.model_ema_steps:
            self.log(f"  note: the run's {total} step(s) are not more than --model-ema-steps {args.model_ema_steps}: "
                     "the EMA is updated at the first step only (it holds the weights after one step)")
        tb = TensorBoard(self.out, enabled=self.main and not args.no_tensorboard)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        stop = None
        # the run's last evaluation, until this command ends an epoch: a resumed command that ends none
        # rewrote summary.json without the figures the run had
        last = s.history[-1] if s.history else {}
        try:
            with self.signals:
                while s.epoch < args.epochs:
                    if args.max_steps is not None and s.global_step >= args.max_steps:
                        stop = f"--max-steps {args.max_steps} reached"
                        break
                    stop = self.train_epoch()
                    if s.step_in_epoch >= self.iters_per_epoch:  # the epoch is complete (even if stopping now)
                        row = self.end_epoch(tb)
                        if row is None:  # a stop signal ended its evaluation: its training is saved
                            stop = self._signal_stop()
                        else:
                            last = row
                            if not stop and s.epoch < args.epochs and self._signal_between_epochs():
                                stop = self._signal_stop()
                    elif stop:
                        self.checkpoint("stop")
                    if stop and s.epoch >= args.epochs:
                        stop = None  # the budget ran out exactly at the end: the run is complete
                    if stop:
                        self.log(f"stopped: {stop}; continue with --resume {self.ckpt_path}")
                        break
        finally:
            tb.close()
        self._draw_curves(final=True)  # (a stopped run's too)
        return self.summary(stop, last)

    def _draw_curves(self, final: bool) -> None:
        """``curves.png`` of the epochs done (main process): at an epoch's end once a minute has passed
        since the run began or was last drawn, and at the run's end. A drawing takes a tenth of a second
        (matplotlib): the epochs of a long run are each drawn, while a short run's many epochs are
        not each paid for. (A run that fails leaves the drawing of its last minute's epochs out.)"""
        done = len(self.state.history)
        if (not self.main or not self.args.curves or done == self.drawn[1]
                or not final and time.perf_counter() - self.drawn[0] < 60):
            return
        plot_curves(self.state.history, self.out / "curves.png", describe_cfg(self.cfg))
        self.drawn = (time.perf_counter(), done)

    def _complete_run(self, why: str, stop: str | None = None) -> dict:
        """The summary of a run resumed where there is nothing to train (after its last epoch, at its
        step budget: ``stop``): its summary.json, rebuilt from its history when that is gone."""
        s = self.state
        self.log(f"orepa train: {self.ckpt_path} {why}")
        saved = None
        if self.main:  # (what a run killed after its last checkpoint left half-written went with lock_run_dir)
            try:
                saved = json.loads((self.out / "summary.json").read_text())
            except (OSError, ValueError):
                pass
            # (a summary of the same step whose run had more epochs: an --epochs override ends the run here)
            if not (isinstance(saved, dict) and saved.get("global_step") == s.global_step
                    and saved.get("epochs") == self.args.epochs):
                saved = None
        if self.info.distributed:  # rank 0's file decides for every rank (summary() below is collective)
            box = [saved]
            dist.broadcast_object_list(box, 0)
            saved = box[0]
        if saved is None:  # rebuilt (this command trained nothing)
            return self.summary(stop, s.history[-1] if s.history else {})
        if self.main:
            print_summary(saved)
        return {**saved, "stop_signal": None}  # (no signal stopped this command: its exit code is 0)

    def end_epoch(self, tb: TensorBoard) -> dict | None:
        """Evaluate the epoch just trained, log it and save it; None where a stop signal (on any rank)
        ended the evaluation: torchrun and schedulers kill a stopped run 30 s on, which a large validation
        set outlasts, so the epoch's training is saved at its last step instead (--resume evaluates it)."""
        args, s, info = self.args, self.state, self.info
        loss_sum, c, n = s.sums  # (all ranks')
        seconds, timed_steps = self._epoch_timed()
        row = {"epoch": s.epoch + 1, "lr": self._logged_lr(),
               "train_loss": loss_sum / max(n, 1), "train_acc1": 100 * c / max(n, 1),
               "epoch_time_s": seconds, "time_per_batch_s": seconds / max(timed_steps, 1),
               "images_per_s": timed_steps * self.global_batch / max(seconds, 1e-9)}
        if self.epoch_steps < self.iters_per_epoch:
            row["resumed_at_step"] = self.iters_per_epoch - self.epoch_steps
        _sync_buffers(info, self.model, self.ema)
        if self.val is not None:
            try:
                r = evaluate(self.model, self.val, self.device, info=info, amp=args.amp, amp_dtype=args.amp_dtype,
                             channels_last=args.channels_last, progress=not args.no_progress, desc="eval",
                             stop=self._stop_asked)
                row.update(val_loss=r["loss"], val_acc1=r["acc1"], val_acc5=r["acc5"])
                if self.ema is not None:
                    r = evaluate(self.ema.module, self.val, self.device, info=info, amp=args.amp,
                                 amp_dtype=args.amp_dtype, channels_last=args.channels_last,
                                 progress=not args.no_progress, desc="eval EMA", stop=self._stop_asked)
                    row.update(ema_val_loss=r["loss"], ema_val_acc1=r["acc1"], ema_val_acc5=r["acc5"])
            except EvaluationStopped:  # every rank learnt it in the evaluation's all-reduce: the save is collective
                self.checkpoint("trained")
                if self.main:  # where it stopped: the epoch's last step (its sums are flushed into the state)
                    self._write_progress(torch.zeros(3, dtype=torch.float64), self.epoch_steps,
                                         time.perf_counter() - self.epoch_time)
                return None
            except EvaluationFailed:  # an unreadable validation image: the epoch's training is kept, at its last
                # step (--resume evaluates it again); every rank raised it after the evaluation's all-reduce, so
                # the collective save finds them all
                self.checkpoint("trained")
                raise
        s.history.append(row)
        s.epoch += 1
        s.step_in_epoch = 0
        s.sums, s.timed = [0.0, 0.0, 0.0], [0.0, 0]
        self.checkpoint("epoch")
        if self.main:
            # (the epoch just completed, all its steps done: "step 0" read as the epoch begun anew)
            write_json(self.out / PROGRESS_FILE, {**row, "epochs": args.epochs, "step": self.iters_per_epoch,
                                                  "steps_per_epoch": self.iters_per_epoch,
                                                  "global_step": s.global_step,
                                                  "total_steps": args.epochs * self.iters_per_epoch,
                                                  "elapsed_s": time.perf_counter() - self.t_start})
            write_history(self.out, s.history)
            tb.epoch(row)
            self._draw_curves(final=s.epoch >= args.epochs)
            if not args.quiet:
                val = (f"  val top-1 {row['val_acc1']:.2f}% top-5 {row['val_acc5']:.2f}%"
                       if "val_acc1" in row else "")
                ema = f"  EMA top-1 {row['ema_val_acc1']:.2f}%" if "ema_val_acc1" in row else ""
                print(f"epoch {row['epoch']}/{args.epochs}: train loss {row['train_loss']:.4f} "
                      f"acc {row['train_acc1']:.2f}%{val}{ema}  ({row['epoch_time_s']:.1f} s, "
                      f"{row['time_per_batch_s'] * 1e3:.0f} ms/batch, {row['images_per_s']:.0f} img/s)", flush=True)
        return row

    def summary(self, stop: str | None, last: dict) -> dict:
        info = self.info
        _sync_buffers(info, self.model, self.ema)
        mine = state_hash(self.model.state_dict())
        hashes = [mine]
        if info.distributed:
            hashes = [None] * info.world_size
            dist.all_gather_object(hashes, mine)
        mem, mem_kind = peak_memory(self.device)
        run_time = self._run_time()
        out = {
            "model": describe_cfg(self.cfg), "model_cfg": self.cfg, "dataset": self.data.name,
            "epochs_done": self.state.epoch, "epochs": self.args.epochs, "global_step": self.state.global_step,
            # the signal that stopped the run (None: it was not stopped by one; "" another rank received it)
            "stopped": stop, "stop_signal": (self.signals.received or "") if stop and self.signal_stopped else None,
            "train_time_s": run_time,
            "time_per_batch_s": run_time / max(self.state.global_step, 1),
            "global_batch": self.global_batch, "world_size": info.world_size, "device": str(self.device),
            "peak_memory_mib": mem, "peak_memory_kind": mem_kind,
            "params_train": self.params_train, "params_deploy": self.params_deploy,
            "checkpoint": str(self.ckpt_path) if self.ckpt_path.exists() else None, "output_dir": str(self.out),
            "weights_sha256": mine, "ranks_in_sync": len(set(hashes)) == 1, "rank_weights_sha256": hashes,
        }
        for k in ("val_acc1", "val_acc5", "val_loss", "ema_val_loss", "ema_val_acc1", "ema_val_acc5"):
            if k in last:
                out[k] = last[k]
        if self.main:
            self._hold_dir()
            write_json(self.out / "summary.json", out, indent=2)
            print_summary(out)
        return out


def print_summary(s: dict) -> None:
    rows = [("model", s["model"]),
            ("epochs", f"{s['epochs_done']}/{s['epochs']} ({s['global_step']} steps)"
             + (f", stopped: {s['stopped']}" if s.get("stopped") else ""))]
    if "val_acc1" in s:
        rows.append(("val top-1 / top-5", f"{s['val_acc1']:.2f}% / {s['val_acc5']:.2f}%"))
    if "ema_val_acc1" in s:
        rows.append(("EMA val top-1 / top-5", f"{s['ema_val_acc1']:.2f}% / {s['ema_val_acc5']:.2f}%"))
    rows += [("train time", f"{s['train_time_s']:.1f} s, {s['time_per_batch_s'] * 1e3:.1f} ms/batch "
                            f"(global batch {s['global_batch']}, {s['world_size']} x {s['device']})"),
             ("peak memory", f"{s['peak_memory_mib']:.0f} MiB ({s['peak_memory_kind']})"),
             ("params", f"{s['params_train']:,} training form, {s['params_deploy']:,} deployed")]
    if s["world_size"] > 1:
        rows.append(("ranks in sync", "yes (bit-identical weights)" if s["ranks_in_sync"] else "NO"))
    rows.append(("checkpoint", s["checkpoint"] or "none written"))
    w = max(len(k) for k, _ in rows)
    print("summary:")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")


#: flags ``--test-only`` takes besides those it shares with ``orepa eval``
_TEST_ONLY_FLAGS = frozenset({"resume", "test_only", "dist_timeout", "quiet"})


def test_only(args: argparse.Namespace) -> dict:
    """``--test-only`` (torchvision's spelling): ``orepa eval`` of the --resume checkpoint, with the flags
    the two share as given here and eval's defaults for the rest (the checkpoint's data, unless given);
    a training flag given beside it is refused, not dropped."""
    from . import evaluate as ev

    if not args.resume:
        raise UserError("--test-only evaluates the checkpoint given with --resume")
    parser = argparse.ArgumentParser(prog="orepa train --test-only")
    ev.add_arguments(parser)
    eval_args = parser.parse_args(["--", args.resume])  # (a file name may begin with "-")
    given = _given(args)
    shared = given & vars(eval_args).keys()
    refuse_idle_flags(argparse.Namespace(given=given), given - shared - _TEST_ONLY_FLAGS,
                      "--test-only only evaluates the --resume checkpoint (as orepa eval does)")
    for key in shared:
        setattr(eval_args, key, getattr(args, key))
    eval_args.given = shared
    info, device = init_distributed(args.device, timeout_min=args.dist_timeout)
    try:
        return ev.evaluate_checkpoint(eval_args, info, device)
    finally:
        cleanup_distributed(info)


def train(args: argparse.Namespace) -> dict:
    """Run ``orepa train`` with parsed ``args``; returns the summary. Raises UserError / NonFiniteLoss."""
    if getattr(args, "given", None) is None:
        # a library caller's Namespace: the flags given are those off their defaults, for every check that
        # asks (refuse_idle_flags read none as given, so an idle flag there passed where the command refused it)
        args, given = argparse.Namespace(**vars(args)), _given(args)
        args.given = given
    apply_threads(args)
    if args.test_only:
        return test_only(args)
    trainer = Trainer(args)
    ended = False  # fit() returned (finished, or stopped at a step every rank agreed on)
    try:
        try:
            trainer.setup()
        except RuntimeError as exc:  # a peer that failed while setting up (its own error is its message)
            fault = run_fault(exc, trainer.info.world_size)
            if fault is None:
                raise
            what, change = fault
            raise UserError(f"{what} while the run was being set up, before its first step"
                            + (f"; {change}" if change else "")) from None
        try:
            summary = trainer.fit()
            ended = True
            return summary
        except NonFiniteLoss as exc:
            last = trainer.ckpt_path if trainer.ckpt_path.exists() else None
            lower = f"{trainer.args.lr / 10:g}"
            where = (f"the last good checkpoint is {last} (kept unchanged, finite); continue it with e.g. "
                     f"--resume {last} --lr {lower} (or --clip-grad-norm, or without --amp)" if last
                     else f"no checkpoint had been written yet; start again with e.g. --lr {lower} or "
                          "--clip-grad-norm, and --overwrite")
            raise NonFiniteLoss(f"{exc}: training stopped; {where}") from None
        except UserError as exc:  # a fault met while training (an unreadable image, a full disk): how to go on
            raise UserError(f"{user_message(exc)}; {trainer.how_to_go_on()}") from None
        except RuntimeError as exc:  # out of memory: where, and the checkpoint that is still good
            oom = out_of_memory(exc)
            if oom is None:
                fault = run_fault(exc, trainer.info.world_size)
                if fault is None:
                    raise
                what, change = fault
                raise UserError(f"{what} {trainer.where()}; " + (f"{change}; " if change else "")
                                + trainer.how_to_go_on()) from None
            last = trainer.ckpt_path if trainer.ckpt_path.exists() else None
            raise UserError(f"{oom}; {trainer.where()}, batch "
                            f"{trainer.args.batch_size} per process in {trainer.args.micro_batches} micro-batch(es); " +
                            (f"--resume {last} --micro-batches N continues the run with each batch in N pieces "
                             "(less memory, the same batch)" if last else
                             "no checkpoint had been written yet; more --micro-batches keep the batch and need less")
                            + "; a smaller -b or --amp needs less too") from None
        except KeyboardInterrupt:
            last = trainer.ckpt_path if trainer.ckpt_path.exists() else None
            raise Interrupted("interrupted; " + (f"continue from the last checkpoint with --resume {last}" if last
                                                 else "no checkpoint had been written yet")) from None
    except BaseException:
        # the cleanup of a failed run says what it could not do but never replaces the failure itself
        # (a file system gone read-only refuses the lock's removal as it refused the run's write)
        try:
            trainer.restore_replaced_run()
        except OSError as exc:
            print(f"warning: the previous run's files stay in {trainer.out / REPLACED_DIR} ({exc.strerror or exc})",
                  file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            unlock_run_dir(trainer.lock)
        trainer.lock = None  # released: the finally below must not remove a lock another run took since
        with contextlib.suppress(OSError):
            trainer.remove_made_dirs()
        raise
    finally:
        try:
            unlock_run_dir(trainer.lock)
        finally:
            info = trainer.info
            vars(trainer).clear()  # its DDP wrapper holds the process group: let go before the group is freed
            cleanup_distributed(info, together=ended)


def run(args: argparse.Namespace) -> int:
    """``orepa train``'s exit code: 0 for a run that ended or stopped at a limit it was given, 128 + the
    signal's number for one a signal stopped (with a checkpoint; 130 for Ctrl-C, as the shell's)."""
    name = train(args).get("stop_signal")  # (a NonFiniteLoss ends it as every UserError: exit code 3)
    if name is None:
        return 0
    return 128 + (signal.Signals[name] if name else signal.SIGTERM).value
