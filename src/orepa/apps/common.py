"""Pieces shared by the subcommands (the model they build: :mod:`orepa.apps.model_cfg`).

* :class:`UserError`: a problem the user can fix (bad path, missing package,
  wrong checkpoint, bad value); ``orepa`` prints ``orepa CMD: error: MESSAGE`` on
  stderr (one line, no traceback) and exits with code 2 (:func:`fail`).
* argument types that reject bad numbers and empty paths at parse time (:func:`positive_int`,
  :func:`path_arg`, ...),
  the flags every computing subcommand shares (:func:`add_run_arguments`) and the one
  ``KEY=VALUE`` parser (:func:`parse_key_values`);
* distributed setup (torchrun environment, nccl on GPUs, gloo on CPU);
* optimizer parameter groups implementing the paper's weight-decay rule;
* small measurements (parameter counts, peak memory).
"""
from __future__ import annotations

import argparse
import ast
import datetime
import gc
import importlib
import json
import math
import os
import random
import re
import resource
import signal
import socket
import sys
import time
import traceback
import unicodedata
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import orepa
from orepa.engine import PackedParameters, builds_together


class UserError(Exception):
    """An error with a message meant for the user (no traceback), said by :func:`fail`; ``exit_code`` is
    the command's (2: bad input or a usage error, as argparse's)."""

    exit_code = 2


class CheckFailed(UserError):
    """A check a command ran on its own output failed (the deployed or exported form computes other
    outputs than the trained one): exit code 1, a result that is wrong, not a usage error."""

    exit_code = 1


#: flags whose destination is not their long name with dashes
_SHORT_FLAGS = {"batch_size": "-b/--batch-size", "workers": "-j/--workers"}


def long_flag(dest: str) -> str:
    """An argparse destination's long flag, to write in a command (``batch_size`` -> ``--batch-size``)."""
    return "--" + dest.replace("_", "-")


def flag_name(dest: str) -> str:
    """The command-line spelling of an argparse destination (``batch_size`` -> ``-b/--batch-size``)."""
    return _SHORT_FLAGS.get(dest, long_flag(dest))


def refuse_idle_flags(args: argparse.Namespace, idle: Iterable[str], why: str, instead: str = "") -> None:
    """A :class:`UserError` naming the flags of ``idle`` given explicitly (``args.given``, set by
    ``orepa``), which this command's settings leave nothing to do (``why`` says which setting): a
    command that quietly does other than its command line says is worse than one that stops before
    it starts. Flags left at their defaults pass."""
    given = [d for d in idle if d in (getattr(args, "given", None) or ())]
    if given:
        raise UserError(f"{why}; {', '.join(flag_name(d) for d in sorted(given))} do(es) not apply "
                        + (f"({instead})" if instead else "then"))


#: the signals that ask a training run to stop at the next step with a checkpoint: Ctrl-C, a
#: scheduler's or ``kill``'s SIGTERM (SLURM sends it, then SIGKILL after its KillWait), SLURM's
#: ``--signal=USR1@SECONDS`` warning, the SIGHUP of a closed terminal or dropped ssh session;
#: data-loading workers ignore them (the main process stops them)
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGHUP") if hasattr(signal, n))


def stop_signals_to_catch() -> tuple[int, ...]:
    """The :data:`STOP_SIGNALS` a command takes over: all but a SIGHUP it was started ignoring
    (``nohup``: the run is meant to outlive its terminal)."""
    hup = getattr(signal, "SIGHUP", None)
    return tuple(s for s in STOP_SIGNALS if s != hup or signal.getsignal(s) is not signal.SIG_IGN)


#: set by ``orepa demo`` in its commands' environment to its pid: such a command stops (SIGTERM, the
#: checkpoint of a scheduler's stop) when the demo dies without passing a stop on (SIGKILL, the OOM
#: killer), instead of training on as an orphan that holds its output directory
STOP_WITH_PARENT_ENV = "OREPA_STOP_WITH_PARENT"


def stop_with_parent() -> None:
    """Under ``orepa demo`` (:data:`STOP_WITH_PARENT_ENV`) or a torchrun launcher (its
    ``TORCHELASTIC_RUN_ID``): a SIGTERM when that process goes (Linux's parent-death signal;
    elsewhere nothing), so a launcher killed outright (SIGKILL, the OOM killer) does not leave its
    workers training on, holding the run's directory: they stop at their next step, with a
    checkpoint. A parent already gone ends this command now."""
    parent = os.environ.pop(STOP_WITH_PARENT_ENV, None)
    if not parent and os.environ.get("TORCHELASTIC_RUN_ID"):
        parent = str(os.getppid())  # the launcher's agent started this worker
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the demo died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def out_of_memory(exc: BaseException) -> str | None:
    """torch's out-of-memory error (a device's ``torch.OutOfMemoryError``, the CPU allocator's
    RuntimeError) as a short clause, ``out of memory (...)``; None for any other error. torch's
    CUDA message goes on about allocator settings: its first three sentences say what was asked
    for and what was free. Callers add what lowers the memory their command needs."""
    # (torch.OutOfMemoryError, every device's, is torch 2.5's; before it CUDA's was torch.cuda's)
    if not (isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
            or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))):
        return None
    text = " ".join(str(exc).split())
    what = ". ".join(text.split(". ")[:3]).rstrip(".")
    return f"out of memory ({what})"


#: a container's memory limit and use: (limit, usage) files of cgroup v2, then v1
CGROUP_MEMORY_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def free_memory(device: torch.device) -> int | None:
    """Bytes that tensors on ``device`` can still take: a GPU's free memory; on a CPU (Linux) the
    system's available memory and free swap, within the container's memory limit (cgroup v2 or
    v1); None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)}
        free = info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError):
        return None
    for limit, usage in CGROUP_MEMORY_FILES:
        try:
            with open(limit) as f_limit, open(usage) as f_usage:
                text = f_limit.read().strip()
                if text != "max":  # (v2's "no limit"; v1's is a number near 2**63, which min() passes over)
                    free = min(free, max(int(text) - int(f_usage.read()), 0))
            break
        except (OSError, ValueError):
            continue
    return free


def size_text(n: float) -> str:
    """Bytes as a short text: ``1.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def error_text(exc: BaseException, limit: int = 300, *, all_lines: bool = False, typed: bool = True,
               trailer: str | None = None) -> str:
    """``TypeName: message`` of another library's exception, for a one-line error: its first line (or,
    ``all_lines``, every line: some libraries put the sizes on the next ones) with its whitespace
    collapsed, cut at a word past ``limit`` characters (and said so). ``typed=False``: the message
    alone (the type name where there is none); ``trailer``: the message up to that text (where a
    library appends its internals, e.g. the ONNX exporter's " [Caused by"). The one way the commands
    quote an exception."""
    text = str(exc)
    text = (text.split(trailer)[0] if trailer else text).strip()
    text = " ".join((text if all_lines else (text.splitlines() or [""])[0]).split())
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if typed else text


def run_fault(exc: BaseException, world_size: int) -> tuple[str, str] | None:
    """A fault of the machine or of a peer met in a training loop, as ``(what happened, what to
    change)`` clauses: a data-loading worker that died (the out-of-memory killer's usual target),
    another process of a distributed run that failed or went away (its collective then fails here:
    gloo's "Connection closed by peer", NCCL's errors, a timeout); None for any other error (a bug:
    its traceback stays)."""
    text = str(exc)
    first = error_text(exc, 200, typed=False)
    if "DataLoader worker" in text and ("killed by signal" in text or "exited unexpectedly" in text):
        return f"a data-loading worker died ({first})", "the system may be out of memory: fewer workers (-j) need less"
    dist_error = getattr(torch.distributed, "DistError", ())
    if world_size > 1 and (isinstance(exc, dist_error) or any(
            w in text for w in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL",
                                "gloo", "Timed out", "timed out"))):
        return f"another process of the run failed or stopped answering ({first})", ""
    return None


def first_nonfinite(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, ema=None) -> str | None:
    """Name of the first parameter, buffer, optimizer-state or EMA tensor holding NaN/inf, else None."""
    named = [(f"parameter {n}", t) for n, t in model.named_parameters()]
    named += [(f"buffer {n}", t) for n, t in model.named_buffers()]
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in optimizer.state.items():
            named += [(f"optimizer {k} of {names.get(id(p), '?')}", v) for k, v in st.items()
                      if isinstance(v, torch.Tensor)]
    if ema is not None:
        named += [(f"EMA {n}", t) for n, t in ema.module.state_dict().items()]
    for name, t in named:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def negative_bn_variance(model: nn.Module, ema=None) -> str | None:
    """The first BN running variance of ``model`` (or of the EMA's) holding a value below zero, as
    ``"buffer NAME (min VALUE)"``; else None. No trained or folded statistic is negative: such a file
    is damaged, and the BN's square root of it makes every output NaN though each value is finite."""
    modules = [("", model), *([("EMA ", ema.module)] if ema is not None else [])]
    for who, root in modules:
        for name, m in root.named_modules():
            var = getattr(m, "running_var", None) if isinstance(m, nn.modules.batchnorm._NormBase) else None
            if isinstance(var, torch.Tensor) and var.is_floating_point() and bool((var < 0).any()):
                return f"{who}buffer {name + '.' if name else ''}running_var (min {var.min().item():.3g})"
    return None


def weights_damage(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, ema=None) -> tuple[str | None, str]:
    """What makes the weights loaded into ``model`` (the optimizer's state, the EMA's given)
    compute nonsense: (the first tensor holding NaN/inf or None, a phrase naming every kind of
    damage found for "FILE holds ...", empty where there is none)."""
    bad, negative = first_nonfinite(model, optimizer, ema), negative_bn_variance(model, ema)
    damage = [f"non-finite values (NaN/inf), first in {bad}"] if bad else []
    if negative:
        damage.append(f"a negative BN running variance, in {negative} (a damaged statistic: the BN's square root "
                      "of it is NaN)")
    return bad, " and ".join(damage)


def user_message(exc: BaseException) -> str:
    """``exc``'s message as one line (one re-raised from a DataLoader worker: its original message)."""
    msg = str(exc).strip()
    if "\nOriginal Traceback" in msg:  # re-raised from a DataLoader worker: keep the original message
        last = msg.splitlines()[-1]
        head, sep, rest = last.partition(": ")
        msg = rest if sep and head.split(".")[-1] == type(exc).__name__ else last
    return " ".join(msg.split())


def fail(prog: str, exc: BaseException) -> int:
    """Print ``exc`` as one ``error:`` line on stderr; return its exit code (a :class:`UserError`'s
    ``exit_code``, else 2): the one way a command ends with an error. Under torchrun every process
    says its own (one process's error may be its alone: its data directory missing), the ones other
    than rank 0 naming themselves."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    who = f" (rank {rank} of {world})" if rank not in ("", "0") and world not in ("", "1") else ""
    print(f"orepa {prog}{who}: error: {user_message(exc)}", file=sys.stderr, flush=True)
    return getattr(exc, "exit_code", 2)


# --------------------------------------------------------------------------- argument types


def _number(kind, low: float, strict: bool, what: str, high: float = float("inf")):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > low if strict else value >= low) or value != value or value >= float("inf") or value > high:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, 0, True, "a positive integer")
nonneg_int = _number(int, 0, False, "an integer >= 0")
positive_float = _number(float, 0.0, True, "a positive number")
nonneg_float = _number(float, 0.0, False, "a number >= 0")
fraction = _number(float, 0.0, False, "a number in [0, 1]", high=1.0)
#: a decay or momentum: at 1 nothing is ever forgotten (SGD's velocity grows without end, an EMA never moves)
below_one = _number(float, 0.0, False, "a number in [0, 1)", high=math.nextafter(1.0, 0.0))
#: numpy's range for a seed (torch takes 64 bits, but the samplers add the epoch to it)
seed_int = _number(int, 0, False, "an integer in [0, 2**32 - 1]", high=2**32 - 1)


def path_arg(text: str) -> str:
    """The type of every path argument (a checkpoint, ``-o/--output``, ``--json``, ``--output-dir``, ...):
    an empty one (``''``, an unset shell variable) is refused as the command line is read; taken
    further it was the current directory, or the flag's default written without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} names no file or directory; give a path")
    return text


path_arg.__name__ = "path"  # argparse names the type in its messages


def add_run_arguments(p: argparse.ArgumentParser, *, seed: bool = True) -> None:
    """``--device``, ``--threads`` (and ``--seed``): every subcommand that computes takes them."""
    g = p.add_argument_group("run")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default, or auto: cuda if available); under "
                                                  "torchrun each process takes cuda:LOCAL_RANK")
    g.add_argument("--threads", type=thread_count, default=None,
                   help="torch intra-op threads (default: torch's choice, usually one per core)")
    if seed:
        g.add_argument("--seed", type=seed_int, default=0, help="random seed (0)")


def add_use_ema_argument(p: argparse.ArgumentParser, verb: str) -> None:
    """``--use-ema``: the checkpoint's EMA weights (``orepa train --model-ema``) instead of its model's,
    taken by :func:`orepa.apps.checkpoint.checkpoint_weights`; ``verb`` says what the command does with them."""
    p.add_argument("--use-ema", action="store_true",
                   help=f"{verb} the checkpoint's EMA weights (orepa train --model-ema) instead of its model's")


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
    compilation of about a minute at the first step (seconds where inductor's cache holds it from an
    earlier run); ``"auto"`` on a CPU, where the per-block routes chosen by FLOPs are faster at
    small batches (ResNet-18 b2: 2.87x against 3.92x) and no slower at larger ones, and under
    ``--compile``, whose trace builds the groups' kernels itself (where ``auto`` groups: a CUDA device)."""
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


def add_kernel_graphs_argument(g) -> None:
    """``--kernel-graphs``: record the kernel builds as CUDA graphs (``group_kernels``' ``graphs``)."""
    g.add_argument("--kernel-graphs", action=argparse.BooleanOptionalAction, default=False,
                   help="eager steps on CUDA: record each group's kernel construction (eager or compiled) "
                        "as two CUDA graphs at the first step and replay them at every step, whatever the batch "
                        "(the construction reads only the parameters); the graphs' memory is held between steps. "
                        "Excludes --cuda-graphs (which records whole steps, the construction with them) and "
                        "--compile. Default: off")


def default_pack(kernel_builder: str, device: torch.device, whole_step_compiled: bool = False) -> bool:
    """Whether to pack when not told: where the groups build the kernels, but not under a whole-step
    ``torch.compile``, which takes no per-parameter host cost away and whose graph then reads packed
    rows through views (ResNet-18: 135 launches per step against 130 unpacked,
    ``benchmarks/compiled_model_launches.py``)."""
    return builds_together(kernel_builder, device) and not whole_step_compiled


def add_amp_arguments(g, training: bool) -> None:
    """``--amp`` / ``--amp-dtype``: autocast for training or evaluation (:func:`autocast_context`);
    ``--amp-dtype`` without ``--amp`` is refused where the command runs (:func:`refuse_amp_dtype_without_amp`)."""
    g.add_argument("--amp", action=argparse.BooleanOptionalAction, default=False,
                   help="mixed precision (autocast): float16 on CUDA" + (" with a GradScaler" if training else "")
                        + ", bfloat16 elsewhere (--amp-dtype to choose)")
    g.add_argument("--amp-dtype", default="auto", choices=["auto", "float16", "bfloat16"],
                   help="with --amp: the autocast type (auto: float16 on CUDA, bfloat16 elsewhere)")


def refuse_amp_dtype_without_amp(args: argparse.Namespace) -> None:
    """``--amp-dtype`` given without ``--amp`` (:func:`add_amp_arguments`'s pair): refused."""
    if not args.amp:
        refuse_idle_flags(args, ("amp_dtype",), "mixed precision is off (no --amp)")


def add_tf32_matmul_argument(g, default: bool | None) -> None:
    """``--tf32-matmul``: TF32 tensor cores for float32 matrix products on CUDA (:func:`apply_tf32_matmul`);
    ``default=None``: on for CUDA devices."""
    g.add_argument("--tf32-matmul", action=argparse.BooleanOptionalAction, default=default,
                   help="CUDA: float32 matrix products on TF32 tensor cores, as PyTorch already runs cuDNN "
                        "convolutions; an online block's kernel construction is matrix products (ResNet-18 at "
                        "batch 64 on an H100: ~1 ms of a 16 ms step in full float32). Default: "
                        + ("on for a CUDA device" if default is None else "on" if default else "off, PyTorch's "
                           "default"))


@contextmanager
def process_settings_kept() -> Iterator[None]:
    """What a command sets for the whole process (torch's threads: ``--threads``; TF32 matrix
    products: ``--tf32-matmul``; cuDNN's autotuning) as it was before, once the command ends: a command
    run in-process (``orepa demo --in-process``, a library caller, a test) leaves the next one the
    settings it found. ``orepa``'s command line runs every command inside it."""
    threads, tf32, autotune = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark = tf32, autotune


def apply_tf32_matmul(enabled: bool | None, device: torch.device) -> bool:
    """Set float32 matrix products to TF32 (``enabled``; None: on for a CUDA device) for this
    process; cuDNN convolutions keep PyTorch's setting (TF32). Returns the setting. Comparisons
    of deployed and trained forms run under :func:`full_float32` whatever this says."""
    on = device.type == "cuda" if enabled is None else bool(enabled)
    torch.backends.cuda.matmul.allow_tf32 = on
    return on


# --------------------------------------------------------------------------- KEY=VALUE options

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
        key = key.strip().replace("-", "_")
        if key == "scaling" and value is None:  # the block option's value 'none' (no scaling layer), not None
            value = "none"
        if key == "branches" and isinstance(value, str):  # a list of names however written: kxk, kxk/1x1, kxk,1x1
            value = [name for name in re.split(r"[,/]", value) if name.strip()] or value
        if key in out:  # the last would win without a word
            raise UserError(f"{flag} gives {key} twice ({out[key]!r}, then {value!r}): give it once")
        out[key] = list(value) if isinstance(value, tuple) else value
    return out



def tolerance_bound(reference: torch.Tensor, tol: float) -> float:
    """The verification bound of ``orepa reparam``, ``export`` and ``import-reference``: a form's outputs
    agree with ``reference`` when their max abs difference is at most ``tol x (1 + max|reference|)``
    (relative for large outputs, absolute near zero; 0 for no outputs)."""
    return tol * (1.0 + reference.abs().max().item()) if reference.numel() else 0.0


def _top_level_split(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and braces (an option's value may be a Python
    literal: ``orepa:returned_layers=[2,3,4]``)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def method_list(words: Iterable[str], flag: str = "--methods") -> list[str]:
    """The methods (or variant specs) of a ``--methods`` flag, given as words, each a comma-separated
    list (``base orepa`` and ``base,orepa`` alike; option values never hold commas: a branch list is
    written ``branches=kxk/1x1``), each once, in order. The one reading of ``--methods`` for
    ``orepa bench``, ``orepa demo`` and the benchmark scripts."""
    words = list(words)
    out = list(dict.fromkeys(m.strip() for word in words for m in _top_level_split(word) if m.strip()))
    if not out:
        raise UserError(f"{flag} {' '.join(words)!r} names none (e.g. {flag} base orepa)")
    return out


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


def init_anchors(model: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """``(parameter, target)`` for the trained tensors whose weight decay pulls towards their start
    (:attr:`orepa.blocks.ConvStep.decays_to_init`: the identity factor of 1x1 -> kxk): the
    target holds each such step's identity in its rows, zeros elsewhere (a packed parameter holds
    other steps' rows too, which decay towards zero as before). Frozen tensors are left out."""
    targets: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, orepa.blocks.ConvStep) or not m.decays_to_init:
                continue
            slot = m.__dict__.get("_packed")
            packed = slot is not None and "weight" not in m._parameters
            p = slot.holder._parameters[slot.name] if packed else m.weight
            if not p.requires_grad:
                continue
            entry = targets.setdefault(id(p), (p, torch.zeros_like(p)))
            (entry[1].narrow(0, slot.lo, slot.size) if packed else entry[1]).copy_(m.init_weight())
    return list(targets.values())


def decay_to_init(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Make ``optimizer``'s weight decay of :func:`init_anchors`' parameters pull them towards their
    identity start, as the published blocks do (they train a delta on a fixed identity and decay
    the delta): SGD adds ``wd * p`` to a decayed parameter's gradient, and a step pre-hook adds
    ``-wd * target`` before it, so the step decays ``p - target`` (with the group's current
    ``weight_decay``; a step the AMP scaler skips runs no hook). Returns the hook's handle, or None
    where the model has no such parameter."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    anchors = [(p, t, group_of[id(p)]) for p, t in init_anchors(model) if id(p) in group_of]
    if not anchors:
        return None

    def pull(opt, args, kwargs) -> None:
        by_decay: dict[float, tuple[list, list]] = {}
        for p, t, group in anchors:
            if p.grad is not None and group["weight_decay"]:
                grads, targets = by_decay.setdefault(group["weight_decay"], ([], []))
                grads.append(p.grad)
                targets.append(t)
        for wd, (grads, targets) in by_decay.items():
            torch._foreach_add_(grads, targets, alpha=-wd)

    return optimizer.register_step_pre_hook(pull)


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
    """``--device`` as a device this machine has: ``cpu``, ``cuda`` or ``cuda:N`` (default, or ``auto``:
    cuda if available); anything else is a :class:`UserError` naming the flag."""
    if device_arg is not None and not device_arg.strip():
        raise UserError("--device '' names no device: give cpu, cuda or cuda:N, or leave the flag out")
    text = device_arg if device_arg not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UserError(f"--device {text!r}: expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {text}: orepa runs on cpu or cuda, not {device.type}")
    if device.type == "cpu" and device.index not in (None, 0):
        # torch parses cpu:N but has one CPU device: such a run would not use another processor
        raise UserError(f"--device {text}: the CPU is one device (cpu); set how many cores it uses with --threads")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {text} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _torchrun_env() -> tuple[int, int, int]:
    """``(WORLD_SIZE, RANK, LOCAL_RANK)`` from torchrun's environment (1, 0, 0 without it); a
    :class:`UserError` naming the variable that is missing or wrong (not a KeyError, or a process
    that waits forever for peers that cannot come)."""
    def number(name: str, default: str | None = None) -> int:
        text = os.environ.get(name, default)
        if text is None:
            raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {name} is not: start the processes "
                            "with torchrun, which sets both (or unset WORLD_SIZE for one process)")
        try:
            return int(text)
        except ValueError:
            raise UserError(f"{name}={text!r} in the environment is not an integer (torchrun sets it)") from None

    world = number("WORLD_SIZE", "1")
    if world < 1:
        raise UserError(f"WORLD_SIZE={world} in the environment: a run has at least one process")
    if world == 1:
        return 1, 0, 0
    rank, local = number("RANK"), number("LOCAL_RANK", "0")
    if not 0 <= rank < world or local < 0:
        raise UserError(f"RANK={rank}, LOCAL_RANK={local} in the environment: a rank is in [0, WORLD_SIZE={world})")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise UserError(f"WORLD_SIZE={world} but {' and '.join(missing)} not set: the processes cannot find each "
                        "other; start them with torchrun")
    return world, rank, local


def init_distributed(device_arg: str | None, *, one_process: str | None = None, timeout_min: float | None = None
                     ) -> tuple[DistInfo, torch.device]:
    """Read torchrun's environment; init nccl (CUDA) or gloo (CPU). Returns (info, device).
    ``one_process``: the command (e.g. ``"orepa export"``) runs in one process only: refused under
    torchrun with more than one (each would write the same files). ``timeout_min``: the collectives'
    timeout (None: torch's default)."""
    want_cuda = parse_device(device_arg).type == "cuda"
    world, rank, local = _torchrun_env()
    if world > 1 and one_process:
        raise UserError(f"{one_process} runs in one process (WORLD_SIZE={world} in the environment): run it "
                        "without torchrun")
    if world > 1:
        info = DistInfo(rank, world, local, True)
        if want_cuda:
            torch.cuda.set_device(info.local_rank)
            device = torch.device("cuda", info.local_rank)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            # imported before the group exists: its functions' defaults (``group=group.WORLD``, read at
            # import, which DistributedDataParallel triggers) would otherwise hold the group for good,
            # and cleanup_distributed could not free it
            importlib.import_module("torch.distributed.nn.functional")
            timeout = {} if timeout_min is None else {"timeout": datetime.timedelta(minutes=timeout_min)}
            group = dict(timeout)  # init_process_group's settings
            restart = _torchrun_restart()
            if restart:
                # torchrun's processes share its rendezvous store, which keeps the first start's keys: a
                # restart's process group read the dead processes' addresses there and failed to connect
                # (gloo, NCCL) or hung (pytorch#135712). Its keys go under a prefix of the restart's own.
                store, _, _ = next(dist.rendezvous("env://", rank, world, **timeout))
                group.update(store=dist.PrefixStore(f"orepa-restart-{restart}", store), rank=rank, world_size=world)
            dist.init_process_group("nccl" if want_cuda else "gloo",
                                    **({"device_id": device} if want_cuda else {}), **group)
        return info, device
    device = parse_device(device_arg)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return DistInfo(), device


def _torchrun_restart() -> int | None:
    """How often torchrun has started this command's processes again (None without torchrun)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return None if count is None else int(count) if count.isdigit() else 0


@dataclass(frozen=True)
class TorchrunJob:
    restart: int  # how often torchrun has started this command's processes again
    max_restarts: int  # its --max-restarts
    name: str  # the job's name, the same over its restarts (torchrun_job)


def torchrun_job(info: DistInfo) -> TorchrunJob | None:
    """Under torchrun: its job (:class:`TorchrunJob`). ``restart``: how often torchrun has started this
    command's processes again (``--max-restarts``: when one process fails, torchrun stops the others and
    starts them all again with the same command line). ``name``: a name of the torchrun job, the same over its
    restarts and another for every new ``torchrun`` command: its rendezvous id (``--standalone`` and
    one-node runs make a random one; several nodes have the ``--rdzv-id`` their nodes share), else
    (the static rendezvous of several nodes leaves it ``none``) rank 0's torchrun process: host, pid
    and start time. None without torchrun. Collective with several processes: rank 0's name is
    every rank's (a process's parent is its own node's torchrun)."""
    restart = _torchrun_restart()
    if restart is None:
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id not in ("", "none"):
        job = f"rendezvous {run_id}"
    else:
        agent = os.getppid()
        try:  # a pid is used again: its start time (clock ticks since boot, the 22nd field) tells the process
            with open(f"/proc/{agent}/stat") as f:
                started = f.read().rpartition(")")[2].split()[19]
        except (OSError, IndexError):
            started = "?"
        job = f"torchrun {socket.gethostname()}:{agent}:{started}"
    if info.distributed:
        box = [job]
        dist.broadcast_object_list(box, 0)
        job = box[0]
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    return TorchrunJob(restart, int(most) if most.isdigit() else 0, job)


def cleanup_distributed(info: DistInfo, *, together: bool = False) -> bool:
    """Destroy the process group, and free it: the caller drops what holds it first (a
    DistributedDataParallel wrapper, and the model its hooks are on); the frames of an exception
    on its way out (a fault inside the wrapper's forward) are cleared here.

    ``together``: every rank ended normally; none leaves before all are done with their files.
    torchrun stops the other ranks as soon as one exits non-zero, as each of a signal-stopped run
    does (143): rank 0 could be killed before its summary was written.

    Freed, the group's destructor joins gloo's worker threads. Left alive, a worker may still hold
    the last collective's tensors when the interpreter shuts down, and their release there (it takes
    the GIL) aborts the process: a finished run exited with SIGABRT now and then, and torchrun
    reported it failed. Where something else still holds the group, the worker threads get the GIL
    for a moment instead. Returns whether the group was freed (True without one)."""
    if not (info.distributed and dist.is_initialized()):
        return True
    try:
        if together:
            _wait_for_every_rank()
    finally:  # (a Ctrl-C while waiting still frees the group)
        _clear_frames_of(sys.exc_info()[1])
        group = weakref.ref(dist.group.WORLD)
        gc.collect()  # wrappers and models in reference cycles hold the group
        dist.destroy_process_group()
        freed = group() is None
        if not freed:
            time.sleep(0.2)  # GIL released: a worker finishing a collective's release takes it now
    return freed


#: how long the ranks that ended wait for the others at the end (rank 0 writing its summary takes
#: well under this); a peer that did not come failed after its last collective, and NCCL, which
#: never notices a peer gone, would otherwise wait out the group's timeout (10 minutes by default)
END_WAIT = datetime.timedelta(minutes=2)


def _wait_for_every_rank() -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    try:
        dist.all_reduce(torch.zeros(1, device=device), async_op=True).wait(timeout=END_WAIT)
    except RuntimeError:  # a peer gone or late: its own error is said there
        pass


def _clear_frames_of(exc: BaseException | None) -> None:
    """Drop the locals of the frames ``exc`` and the exceptions chained to it went through: a fault
    raised inside DistributedDataParallel's forward keeps that frame, and its ``self``, the wrapper
    that holds the process group (``raise ... from None`` hides the fault but keeps it as context).
    What is printed of the exception (files, lines, messages) does not change."""
    todo, seen = [exc], set()
    while todo:
        exc = todo.pop()
        if exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            traceback.clear_frames(exc.__traceback__)
            todo += [exc.__cause__, exc.__context__]


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


def make_sgd(params, *, loss_scaled: bool = False, **kwargs) -> torch.optim.SGD:
    """``torch.optim.SGD`` with the fused kernel where this torch has one for every parameter's
    device and dtype (CPU and CUDA floating point since torch 2.4), else the default one.

    Fused reads and writes each parameter, gradient and momentum buffer once per step instead
    of once per elementwise op: a re-param model trains 2-4x the plain net's parameters, so its
    optimizer step is a visible share of a step.
    torch checks the devices only at the first step, hence the check here.

    ``loss_scaled`` (a ``GradScaler`` steps it: float16 autocast): the default one. A scaler hands a
    fused SGD the still-scaled gradients with their scale, so (a) a first step the scaler skips (its
    first scale overflows, as it often does) leaves the fused kernel's momentum buffers as allocated,
    never written (values up to 1e34 here: the next step's weights were -7e33, the loss NaN), and
    (b) a step pre-hook (:func:`decay_to_init`) that adds to the gradients would add to scaled ones.
    Unfused, the scaler unscales the gradients before the step and skips the step whole.
    """
    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without the helper: stay with the default implementation
        devices = set()
    fused = not loss_scaled and bool(tensors) and all(t.device.type in devices and t.is_floating_point()
                                                      for t in tensors)
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


def class_name(name: str) -> str:
    """A class name as orepa holds and compares it: Unicode NFC. A folder named on a Mac (HFS+ stores
    names decomposed, NFD: ``e`` + a combining accent) and the same name made elsewhere (``é``, one
    code point) are one class, though Python and the file system tell them apart."""
    return unicodedata.normalize("NFC", name)


def some_of(items, n: int = 3) -> str:
    """The first ``n`` of ``items`` for a message: ``"a, b, c, ..."``."""
    items = list(items)
    return ", ".join(items[:n]) + (", ..." if len(items) > n else "")


def per_cpu_cap() -> int:
    """The most threads, or loader processes, a command starts: 4 per CPU, or 32. Beyond, they only
    contend (ResNet-18 evaluation with 5,000 threads on 2 cores: 100x slower per batch)."""
    return max(32, 4 * available_cpus())


def thread_count(text: str) -> int:
    """``--threads``: a positive integer up to :func:`per_cpu_cap`."""
    cap = per_cpu_cap()
    return _number(int, 0, True, f"a positive integer up to {cap} (4 per CPU, or 32)", high=cap)(text)


thread_count.__name__ = "thread count"
