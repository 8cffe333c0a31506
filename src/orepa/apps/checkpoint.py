"""Checkpoints: atomic writes, ``weights_only=True`` reads, clear errors.

A checkpoint is a dict of tensors and primitive values only, so it loads with
``torch.load(weights_only=True)`` (no code runs when reading it)::

    format       "orepa-checkpoint"
    version      1
    form         "train" | "deploy" | "deploy-fused"
    model_cfg    {"model", "method", "num_classes", "in_chans", "small_input", "width_mult", "options"}
    model        state_dict of the model in that form
    model_ema    state_dict of the EMA copy (optional)
    optimizer, lr_scheduler, scaler     state_dicts (training form, optional)
    epoch        the epoch in progress (== epochs done when step_in_epoch == 0)
    step_in_epoch, global_step
    rng          {"torch": uint8 tensor, "cuda": [uint8 tensors], "python": {...}, "numpy": {...}}
    args         the command line as a dict
    history      per-epoch metrics (list of dicts)
    metrics      e.g. {"acc1": ..., "acc5": ...}

Deployed checkpoints (``orepa reparam``) hold the vanilla-layout model's
state_dict. :func:`load_checkpoint` is the one reader every subcommand uses: it also
takes a bare state_dict (e.g. a torchvision one) or one wrapped as ``{"state_dict": ...}``
/ ``{"model_state_dict": ...}``, strips DDP / torch.compile prefixes (``module.``,
``_orig_mod.``), and checks ``format`` / ``version``.

Writes are atomic (temporary file, fsync, rename) with the permissions of any other
file the process creates (0666 minus the umask), through a symbolic link to the file it
names; temporary files that a killed write left behind (``.<name>.<host>-<pid>.*.tmp``,
whose process is gone) are removed by the next write of that file, and by the next run that takes
their directory (:func:`lock_run_dir`).
"""
from __future__ import annotations

import json
import math
import os
import pickle
import random
import re
import shutil
import socket
import tempfile
import time
import warnings
import weakref
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path

import torch
from torch import nn

import orepa

from ..models.reference import REFERENCE_KEY_ENDINGS, is_deployed_reference, is_reference_state_dict
from ..state_dicts import (
    EMA_KEYS,
    STATE_DICT_KEYS,
    find_state_dict,
    is_state_dict,
    load_weights_only,
    strip_prefixes,
    without_ema_counter,
)
from .common import UserError, class_name, error_text, size_text, some_of, weights_damage
from .model_cfg import FORMS, MODEL_CFG_KEYS, build_model_form, checked_cfg, describe_cfg, external_source

FORMAT = "orepa-checkpoint"
VERSION = 1


# --------------------------------------------------------------------------- RNG state as tensors


def rng_state() -> dict:
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        p = state["python"]
        random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = list(state["cuda"])
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        try:
            import numpy as np

            n = state["numpy"]
            np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))
        except ImportError:
            pass


# --------------------------------------------------------------------------- args


def plain(value):
    """``value`` reduced to types ``weights_only`` loading accepts (dict/list/str/int/float/bool/None)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def args_dict(args) -> dict:
    return {k: plain(v) for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}


# --------------------------------------------------------------------------- save / load


def _umask() -> int:
    try:  # Linux: read it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _host() -> str:
    return socket.gethostname().replace(".", "_")


def _writer_tag() -> str:
    return f"{_host()}-{os.getpid()}"


def _dead(tag: str) -> bool:
    """Whether the writer ``host-pid`` of a temporary file is a process of this host that is gone."""
    host, _, pid = tag.rpartition("-")
    if host != _host() or not pid.isdigit():
        return False  # another machine's (a shared file system) or an unknown writer: leave it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False


#: the file that marks a run directory as being written by one process (``host-pid flock``)
RUN_LOCK = ".orepa-run.lock"
#: the word in a lock that says its writer holds it with ``flock`` for as long as it runs
_FLOCKED = "flock"


class RunLock:
    """A run directory's lock, held by this process (:func:`lock_run_dir`): the lock file, and its
    open descriptor, which holds the file's ``flock`` until :func:`unlock_run_dir` (or this process's
    end, however it ends: the kernel releases it); ``folder``, the directory's open descriptor, which
    tells it from one made there since (:func:`run_dir_made_since`: an open directory's inode is not
    given to another)."""

    def __init__(self, path: Path, fd: int | None, folder: int | None = None):
        self.path, self.fd, self.folder = path, fd, folder

    def close(self) -> None:
        """Its descriptors closed (its flock released); the file stays."""
        for name in ("fd", "folder"):
            if getattr(self, name) is not None:
                with suppress(OSError):
                    os.close(getattr(self, name))
                setattr(self, name, None)


def _refuse(directory: Path, flag: str, held: str, lock: Path) -> UserError:
    who = held.split(" ")[0] if held else "unknown"
    return UserError(f"{flag} {directory} is being written by another run (process {who}); wait for it to end or "
                     f"choose another {flag} (a run that died on another machine leaves {lock}: remove it)")


def _lock_text(fd: int) -> str:
    """What a run lock open as ``fd`` says (``host-pid [flock]``; empty where not yet written)."""
    return os.read(fd, 4096).decode(errors="replace").strip()


def _unwritable(directory: Path, flag: str, lock: Path, exc: OSError) -> UserError:
    return UserError(f"{flag} {directory}: cannot write {lock.name} ({exc.strerror or exc})")


def _still_at(fd: int, path: Path) -> bool:
    """Whether the file open as ``fd`` is the one at ``path`` (not removed or replaced meanwhile)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_not_held(directory: Path, flag: str = "--output-dir") -> None:
    """Raise :func:`lock_run_dir`'s refusal where a live run holds ``directory``'s lock (its ``flock``),
    without taking it: said before advice that the lock would refuse (``--resume`` it, ``--overwrite`` it).
    Where the file system has no ``flock`` the lock's taking judges."""
    try:
        import fcntl
    except ImportError:
        return
    lock = directory / RUN_LOCK
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:  # none (unreadable: lock_run_dir says so)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (released with the descriptor)
    except BlockingIOError:
        raise _refuse(directory, flag, _lock_text(fd), lock) from None
    except OSError:  # no flock on this file system
        pass
    finally:
        os.close(fd)


def lock_run_dir(directory: Path, flag: str = "--output-dir") -> RunLock:
    """Take ``directory`` for this process's run (``RUN_LOCK``): a second run into it (``--overwrite``
    or ``--resume`` while the first still runs) would write over the first's files.

    The lock is an exclusive ``flock`` on the file, held for the whole run: a run killed outright
    releases it with its process, so its lock is taken over, whatever pid the next run has (a
    restarted container's command is pid 1 each time; containers that share a host name have pid
    spaces of their own, where a pid says nothing). A lock another host wrote is left to the user
    (a shared file system's locks need not reach across hosts). Where the file system has no
    ``flock``, or the lock was written without one (an older orepa's), a lock is taken over only
    where its host is this one and its pid no longer runs. Taken, the temporary files that killed
    writes left in ``directory`` go (:func:`remove_stale_tmp`: a file the run never writes again, a
    ``model_<epoch>.pth`` of an epoch it resumed after, kept its own for good). Release it with
    :func:`unlock_run_dir`."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: the pid's word alone
        fcntl = None
    lock = directory / RUN_LOCK
    for attempt in range(20):
        try:
            # made by this call, or opened as it is: a file this call made is its own (where the file
            # system has no flock, the only word two runs starting at once have)
            created, fd = True, os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            try:
                created, fd = False, os.open(lock, os.O_RDWR)
            except FileNotFoundError:  # removed meanwhile (a run ending): again
                continue
            except OSError as exc:
                raise _unwritable(directory, flag, lock, exc) from None
        except OSError as exc:
            raise _unwritable(directory, flag, lock, exc) from None
        flocked = fcntl is not None
        if flocked:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live run holds it
                held = _lock_text(fd)
                os.close(fd)
                raise _refuse(directory, flag, held, lock) from None
            except OSError:  # this file system has no flock
                flocked = False
        if not _still_at(fd, lock):  # removed (a run ending) or replaced while we opened it: again
            os.close(fd)
            continue
        held = _lock_text(fd)
        if not held and not created and not flocked:
            # without flock an empty lock is another run's, made a moment ago and not yet written: wait for its word
            os.close(fd)
            if attempt < 19:
                time.sleep(0.05)
                continue
            raise UserError(f"{flag} {directory}: its lock {lock} stayed empty (a run that died while making it "
                            "leaves it so on a file system without flock); remove it if no run writes there")
        tag = held.split(" ")[0] if held else ""
        host = tag.rpartition("-")[0]
        gone = created or (not held and flocked) or \
            (host == _host() and (held.split(" ")[-1] == _FLOCKED and flocked or _dead(tag)))
        if not gone:  # another host's, or one an older orepa wrote, or no flock here: its pid's word
            os.close(fd)
            raise _refuse(directory, flag, held, lock)
        if not flocked and not created:
            # without flock a lock is taken only by making it (O_EXCL): a stale one goes first, and of the runs
            # that found it stale the one that makes the next file has it
            if _still_at(fd, lock):
                with suppress(FileNotFoundError):
                    os.unlink(lock)
            os.close(fd)
            continue
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, f"{_writer_tag()}{' ' + _FLOCKED if flocked else ''}".encode())
        except OSError as exc:  # a full disk still makes a file (an inode), but refuses what it holds
            if created and _still_at(fd, lock):
                with suppress(OSError):
                    os.unlink(lock)
            os.close(fd)
            raise _unwritable(directory, flag, lock, exc) from None
        if not flocked:
            # a run that found the stale lock an instant ago may remove this one as that: look again once the
            # instant is past (if it went, that run makes the lock)
            time.sleep(0.05)
            if not _still_at(fd, lock):
                os.close(fd)
                continue
        try:
            folder = os.open(directory, os.O_RDONLY)
        except OSError:  # (a system that opens no directory: run_dir_made_since cannot tell)
            folder = None
        taken = RunLock(lock, fd, folder)
        remove_stale_tmp(directory, inside=True)  # what runs killed while writing there left (any file's)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=partial(_not_in_children, weakref.ref(taken)))
        return taken
    raise UserError(f"{flag} {directory}: another run took it at the same moment; choose another {flag}")


def _not_in_children(ref: weakref.ref) -> None:
    """In a forked child (a DataLoader worker): close its copy of the run lock's descriptor. A flock
    lasts while any descriptor of it is open, so a run killed outright (kill -9) stayed locked until
    its workers noticed and ended (~5 s), and a --resume right after was refused."""
    held = ref()
    if held is not None:
        held.close()


def holds_run_dir(lock: RunLock) -> bool:
    """Whether ``lock`` is still its run directory's: its file not removed (with the directory, an
    ``rm -rf`` of it) nor replaced (by another run's, made since)."""
    return lock.fd is not None and _still_at(lock.fd, Path(lock.path))


def run_dir_made_since(lock: RunLock) -> bool:
    """Whether the directory ``lock`` is in is another than the one it locked (that one removed, this
    one made since)."""
    return lock.folder is None or not _still_at(lock.folder, Path(lock.path).parent)


def unlock_run_dir(lock: RunLock | None) -> None:
    if lock is not None:
        try:
            if holds_run_dir(lock):  # (a lock made there since this one went is another run's: kept)
                Path(lock.path).unlink(missing_ok=True)  # before the flock goes: no one takes a file about to go
        finally:
            lock.close()


def remove_stale_tmp(path: str | os.PathLike, *, inside: bool = False) -> list[Path]:
    """Delete the ``.<name>.<host>-<pid>.*.tmp`` files that interrupted atomic writes of ``path`` left
    behind (``inside``: of any file in the directory ``path``): those whose writing process (on this
    host) no longer runs; a concurrent writer's stays."""
    path = Path(path)
    folder, pattern = (path, ".*.tmp") if inside else (path.parent, f".{glob_escape(path.name)}.*.tmp")
    if not folder.is_dir():
        return []
    stale = []
    for p in folder.glob(pattern):
        parts = p.name[:-len(".tmp")].rsplit(".", 2)  # [".<name>", "<host>-<pid>", mkstemp's letters]
        if len(parts) == 3 and _dead(parts[1]):
            p.unlink(missing_ok=True)
            stale.append(p)
    return stale


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def check_output_path(path: str | os.PathLike, flag: str, *, directory: bool = False,
                      not_over: dict[str, str | os.PathLike | None] | None = None, report: str | None = None) -> Path:
    """Before any long computation: ``path`` can be written as a file (or, ``directory``, made a
    directory). A :class:`UserError` naming ``flag`` where it is a directory (a file; or a name
    ending in "/"), where what would hold it is a file or cannot be written into, where it is one
    of the files ``not_over`` names (``{"the input checkpoint": path, ...}``: the same file by any
    name), where the JSON report of command ``report`` would replace anything but an earlier
    report of that command (:func:`_not_a_report`), or where a file output would replace a
    run's training checkpoint (``--overwrite`` or not)."""
    if str(path) == "-":  # the shell's spelling of standard output, which would be a file named "-" here
        raise UserError(f"{flag} -: orepa writes files, not to standard output; give a path (./- for a "
                        f"{'directory' if directory else 'file'} named '-')")
    if not directory and str(path).endswith(("/", os.sep)):  # (Path() would drop the "/" and write a file)
        raise UserError(f"{flag} {path} ends with '{str(path)[-1]}', a directory's name; give a file's name "
                        "(e.g. in that directory)")
    path = Path(path)
    if path.is_symlink():
        try:
            path.resolve(strict=False)
        except (RuntimeError, OSError):  # Python < 3.13 raises RuntimeError for a loop
            raise UserError(f"{flag} {path} is a symbolic link that leads back to itself (a loop); "
                            "choose another path") from None
    for what, other in (not_over or {}).items():
        if other is not None and same_file(path, Path(other)):
            raise UserError(f"{flag} {path} is {what}; choose another path")
    if report and path.is_file():
        if zipfile.is_zipfile(path):
            raise UserError(f"{flag} {path} is a checkpoint (a zip archive), not a report to replace; choose another "
                            "path")
        what = _not_a_report(path, report)
        if what:
            raise UserError(f"{flag} {path} is {what}, not a report to replace; choose another path")
    if not report and not directory and path.is_file() and _is_run_checkpoint(path):  # what --resume continues
        raise UserError(f"{flag} {path} is the training checkpoint of a run (it holds optimizer state: the run's "
                        f"resumable state) and is never replaced, not even with --overwrite; choose another {flag}")
    if path.exists() and not (path.is_file() or path.is_dir()):  # an atomic write would replace a device node
        raise UserError(f"{flag} {path} is not a regular file (a device, pipe or socket); choose another path")
    if path.exists() and path.is_dir() != directory:
        raise UserError(f"{flag} {path} is a {'file' if directory else 'directory'}, not a "
                        f"{'directory' if directory else 'file'}")
    parent = path if directory and path.exists() else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {parent} is not writable")
    # os.access answers yes to root on file systems that take no new files (/proc, read-only
    # mounts): a probe file, made and removed at once, asks the file system itself
    try:
        fd, probe = tempfile.mkstemp(prefix=".orepa-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot create files in {parent} ({e.strerror or e})") from None
    return path


#: files that mark a directory as holding a run
RUN_FILES = ("checkpoint.pth", "summary.json", "log.jsonl", "log.csv", "curves.png", "progress.json")
#: where a run is (written from its first step): alone, the trace of a run that wrote no checkpoint
PROGRESS_FILE = "progress.json"


def deployed_file_name(fuse_bn: bool, ema: bool) -> str:
    """``orepa reparam``'s default output next to a run's checkpoint (its EMA weights deploy apart)."""
    return f"deployed{'-ema' if ema else ''}{'-fused' if fuse_bn else ''}.pth"


#: made from a run's checkpoint by ``orepa reparam`` (its default outputs): --overwrite replaces them too
DERIVED_FILES = tuple(deployed_file_name(fuse, ema) for ema in (False, True) for fuse in (False, True))


def report_of(command: str, res: dict) -> dict:
    """A command's JSON report: ``res`` marked as ``command``'s (``"report"``), so that a later
    ``--json`` of another command does not replace it (:func:`_not_a_report`). ``command`` is an
    ``orepa`` subcommand ("eval") or a benchmark script by its path in the repository
    ("benchmarks/aten_ops.py")."""
    return {"report": command, **res}


def _writer(command: str) -> str:
    """Who writes ``command``'s reports, as an error names it: ``orepa eval``, or ``benchmarks/aten_ops.py``."""
    return command if command.endswith(".py") else f"orepa {command}"


def _not_a_report(path: Path, command: str) -> str | None:
    """What an existing file is where ``command``'s JSON report would replace it, or None where it is
    one of that command's reports (marked by :func:`report_of`; an ``orepa`` command's, unmarked, from
    before the mark: a JSON object with the keys its reports hold). A report is rewritten only by the
    command that wrote it: an ONNX model, an image, a run's summary or another command's results (a
    benchmark's) given to --json by a slip would be lost."""
    if path.suffix == ".json" and path.name in RUN_FILES and \
            any((path.parent / f).is_file() for f in ("checkpoint.pth", PROGRESS_FILE)):
        return f"a file of the training run in {path.parent}"
    try:
        if path.stat().st_size > 64 << 20:  # larger than any report
            return "a large file that is no JSON report"
        held = json.loads(path.read_bytes())
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return "a file that is no JSON report"
    if not isinstance(held, dict):
        return f"a JSON file that is no report of {_writer(command)}"
    if isinstance(held.get("report"), str):
        return None if held["report"] == command else f"the report of {_writer(held['report'])}"
    legacy = _LEGACY_REPORT_KEYS.get(command)
    return None if legacy and legacy <= held.keys() else \
        f"a JSON file that is no report of {_writer(command)} (another command's results?)"


#: what each command's report held before reports were marked (a run's summary holds a checkpoint too); a
#: benchmark script's reports are known by their mark alone
_LEGACY_REPORT_KEYS = {"eval": {"checkpoint", "loss", "acc1", "acc5", "n"},
                       "reparam": {"checkpoint", "form", "params_train", "params_deployed"}}


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same path once resolved (links, ``..``), or
    two names of one existing file (hard links)."""
    try:
        if a.resolve() == b.resolve():
            return True
    except (RuntimeError, OSError):  # a symbolic link loop names no file
        return False
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def same_source(held, record: Mapping, path_key: str) -> bool:
    """Whether ``held``, what an existing output records of what it was made from, is ``record``: a
    rerun of the command that made it on the same source, which replaces its own output without
    --overwrite. The same values, with the checkpoint (``path_key``) named by any path
    (``run/checkpoint.pth``, ``./run/...``, an absolute one); the same path is the same source, as
    ``orepa analyze`` judges it (a run's checkpoint.pth trained further is still that run's)."""
    if not isinstance(held, Mapping):
        return False
    held, record = plain(dict(held)), plain(dict(record))  # (tuples as lists: the form a file gives back)
    a, b = held.pop(path_key, None), record.pop(path_key, None)
    if held != record:
        return False
    return a == b or (isinstance(a, str) and isinstance(b, str) and same_file(Path(a), Path(b)))


@contextmanager
def _writing(path: Path) -> Iterator[Path]:
    """The temporary file of an atomic write of ``path`` (made beside it, removed unless it became
    ``path``); the file system's refusals (permissions, a full disk, a directory in the way) as a
    :class:`UserError` naming ``path``. The previous ``path`` is untouched either way, and the
    directories made for it are removed again when the write fails."""
    tmp = None
    if path.is_symlink():  # the file it names is replaced, the link kept (a rename would replace the link itself)
        path = Path(os.path.realpath(path))
    made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]  # deepest first
    done = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{_writer_tag()}.", suffix=".tmp")
        os.close(fd)
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        done = True
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    except RuntimeError as exc:
        # torch.save reports a failed write (a full disk) as a RuntimeError of its zip writer
        if not any(mark in str(exc) for mark in ("inline_container", "PytorchStreamWriter")):
            raise
        # (its own text, e.g. "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0", says
        # nothing to a user; the file system's refusal it swallowed, its context, does: a quota or a file-size
        # limit refuses a disk with room; without one, the disk's free space)
        refusal = exc.__context__ if isinstance(exc.__context__, OSError) else None
        if refusal is not None:
            raise UserError(f"cannot write {path}: {refusal.strerror or refusal}; the file before it, if any, is "
                            "kept") from None
        try:
            free = f"{size_text(shutil.disk_usage(path.parent).free)} free there"
        except OSError:
            free = "the disk may be full"
        raise UserError(f"cannot write {path}: torch's writer failed ({free}); the file before it, if any, is "
                        "kept") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if not done:
            for d in made:
                try:
                    d.rmdir()  # only while empty
                except OSError:
                    break


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Write ``path`` atomically: ``write(binary file)`` into a temporary file in the same
    directory, fsync, ``os.replace``. A reader (or a crash) never sees a half-written file;
    the file gets the usual permissions (0666 minus the umask, not mkstemp's 0600)."""
    path = Path(path)
    with _writing(path) as tmp, open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    return path


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """For writers that need the temporary file by name (ONNX's writer takes a file name) or read it back
    before it replaces ``path`` (the exporters verify the reloaded file): a temporary path beside
    ``path``; when the block ends normally it replaces ``path`` (usual permissions) once on disk, after
    an exception it is removed."""
    with _writing(Path(path)) as tmp:
        yield tmp
        with open(tmp, "rb") as f:  # (what the writer wrote reaches the disk before the rename, as atomic_write's)
            os.fsync(f.fileno())


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


def _strict_json(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict_json(v) for v in obj]
    return obj


def json_text(obj, indent: int | None = None) -> str:
    """``obj`` as strict JSON, the text every JSON file orepa writes holds: NaN and inf (a diverged
    run's loss, a ratio of nothing) become null, since JSON has no such numbers and readers other
    than Python's refuse the file."""
    return json.dumps(_strict_json(obj), indent=indent, allow_nan=False)


def write_json(path: str | os.PathLike, obj, indent: int | None = None) -> Path:
    """``obj`` written to ``path`` as :func:`json_text`, atomically: the one way orepa writes a JSON file
    (a report, a run's progress, a benchmark's results)."""
    return atomic_write_text(path, json_text(obj, indent))


def save_checkpoint(obj: dict, path: str | os.PathLike) -> Path:
    """``torch.save`` through :func:`atomic_write`."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (a zip with code, which a checkpoint has not)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/constants.pkl") or "/code/" in n for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def is_exported_program(path: Path) -> bool:
    """Whether ``path`` is a ``torch.export.save`` archive (an ExportedProgram: a zip whose
    ``archive_format`` says ``pt2``, or, from torch before 2.6, holding ``serialized_exported_program.json``)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            fmt = next((n for n in names if n.rsplit("/", 1)[-1] == "archive_format"), None)
            return (fmt is not None and z.read(fmt).strip() == b"pt2") or "serialized_exported_program.json" in names
    except (zipfile.BadZipFile, OSError, KeyError):
        return False


def is_onnx(path: Path) -> bool:
    """Whether ``path`` is an ONNX model (a graph; read without its external data). False where the
    onnx package is missing: such a file is then only a file torch cannot read."""
    try:
        import onnx

        with open(path, "rb") as f:  # a file object: onnx's path reader takes no name that is not UTF-8
            proto = onnx.load_model(f, load_external_data=False)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, or anything else a foreign file gives
        return False
    return proto.ir_version > 0 and len(proto.graph.node) > 0


#: what an unreadable file is called, whichever way reading it failed (random bytes fail either way)
_DAMAGED = "corrupt, truncated or not a PyTorch checkpoint"


def _unpickling_error(path: Path, exc: Exception) -> UserError:
    text = str(exc)
    # torch's two wordings: a global it does not allow, and one from a module it blocks (os, posix, ...)
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([^\s,]+)", text)
    if found:
        return UserError(
            f"checkpoint {path} holds Python objects ({found.group(1)}), not only tensors and plain values: "
            "reading it would run code from the file, so it is refused (torch.load(weights_only=True)). "
            "If you trust the file, load it with torch.load(..., weights_only=False) and save only its tensors "
            "(e.g. model.state_dict())")
    return UserError(f"checkpoint {path} is {_DAMAGED} (it does not unpickle as one)")


def _check_crcs(path: Path) -> None:
    """A zip checkpoint (torch.save's format) whose entries fail their CRC check was changed after
    it was written: torch's reader does not check, and would hand back damaged tensors (a
    checkpoint evaluated at loss nan). Reads the file once; other formats pass to torch.load."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return  # not a zip archive (an old torch format), or torn: torch.load says what it finds
    if bad is not None:
        raise UserError(f"checkpoint {path} is damaged: its entry {bad} fails its CRC check (the file changed "
                        "after it was written)")


def read_checkpoint_file(path: str | os.PathLike, *, lazy: bool = False):
    """What a checkpoint file holds, read with ``weights_only=True`` (no code in the file runs), as
    it was saved; :class:`UserError` naming what is wrong with the file (missing, empty, damaged,
    a TorchScript / ExportedProgram / ONNX / text file, Python objects). ``lazy``: the tensors are memory-mapped,
    not read, nor checked against their CRCs. :func:`load_checkpoint` interprets what it holds."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} is a symbolic link to nothing (a dangling link or a loop)"
                        if path.is_symlink() and not path.exists() else
                        f"checkpoint {path} does not exist" if not path.exists() else
                        f"{path} is not a file" + (f" (a run directory: its checkpoint is {path / 'checkpoint.pth'})"
                                                   if (path / "checkpoint.pth").is_file() else ""))
    if path.stat().st_size == 0:
        raise UserError(f"checkpoint {path} is an empty file (a write that never finished?)")
    try:  # (not a damaged file: one this user may not read)
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise UserError(f"checkpoint {path} cannot be read ({exc.strerror or exc})") from None
    if is_torchscript(path):  # torch.load would hand it to torch.jit.load
        raise UserError(f"{path} is a TorchScript archive (a compiled program), not a checkpoint; "
                        "load it with torch.jit.load")
    if is_exported_program(path):  # (torch.load says only that data.pkl is missing: "corrupt")
        raise UserError(f"{path} is an ExportedProgram archive (torch.export), not a checkpoint; load it with "
                        "torch.export.load, or give the checkpoint it was exported from")
    if not lazy:
        _check_crcs(path)
    try:
        obj = _torch_load(path, lazy)
    except Exception as exc:  # noqa: BLE001 - any failure to read means a damaged or foreign file
        if is_onnx(path):  # looked for only now: parsing a large checkpoint as protobuf costs its size
            raise UserError(f"{path} is an ONNX model (an exported graph, for onnxruntime), not a checkpoint; "
                            "give the checkpoint it was exported from") from None
        if _is_text(head):  # what torch says of one ("KeyError: 101", a JSON's unpickling error) names nothing
            raise UserError(f"checkpoint {path} is a text file, not a PyTorch checkpoint (a zip archive, or a "
                            "pickle in torch's legacy format)")
        if isinstance(exc, pickle.UnpicklingError):
            raise _unpickling_error(path, exc) from None
        raise UserError(f"checkpoint {path} is {_DAMAGED} ({error_text(exc, 200)})") from None
    return obj


def load_checkpoint(path: str | os.PathLike, *, lazy: bool = False, reference: bool = False) -> dict:
    """Read a checkpoint with ``weights_only=True`` (no code in the file runs).

    Returns a dict whose ``"model"`` is a state_dict without wrapper prefixes: an orepa
    checkpoint as saved, or ``{"model": sd}`` for a bare / wrapped state_dict of another tool.
    Raises :class:`UserError` naming what is wrong with the file. ``lazy``: for a look at the
    metadata only; the tensors are memory-mapped, not read, nor checked against their CRCs.
    ``reference``: a state_dict of the paper's own code is read too (``orepa import-reference``).
    """
    path = Path(path)
    obj = read_checkpoint_file(path, lazy=lazy)
    if is_state_dict(obj):
        return {"model": _not_the_references(path, strip_prefixes(obj), reference)}
    if not isinstance(obj, dict):
        raise UserError(f"{path} is not an orepa checkpoint nor a state_dict (it holds a {type(obj).__name__})")
    if obj.get("format", FORMAT) != FORMAT:
        raise UserError(f"{path}: unknown checkpoint format {obj.get('format')!r} (this orepa reads {FORMAT!r})")
    if "format" in obj:  # (another tool's checkpoint has its own versions: timm's says 'version': 2)
        try:
            version = int(obj.get("version", VERSION))
        except (TypeError, ValueError):
            raise UserError(f"{path}: unreadable checkpoint version {obj.get('version')!r}") from None
        if version > VERSION:
            raise UserError(f"{path}: checkpoint version {version} is newer than this orepa (reads {VERSION})")
    key = find_state_dict(obj)
    if key is None:
        found = ", ".join(f"{k} ({type(v).__name__})" for k, v in list(obj.items())[:6]) if obj else None
        raise UserError(f"{path} holds no state_dict: expected a dict of tensors, or one under "
                        f"{' / '.join(map(repr, STATE_DICT_KEYS))} "
                        f"({'found keys ' + found if found else 'it holds an empty dict'})")
    out = dict(obj)
    out["model"] = _not_the_references(path, strip_prefixes(obj[key]), reference)
    if "format" not in obj:  # another tool's training checkpoint (timm's, torchvision's references')
        out.pop("args", None)  # its run settings are its own flags, not orepa's (data_path, model, ...)
        ema = next((k for k in EMA_KEYS if is_state_dict(obj.get(k))), None)
        if ema is not None:  # timm's state_dict_ema: read as --use-ema reads orepa's model_ema
            out["model_ema"] = without_ema_counter(obj[ema])
    if "model_ema" in out and is_state_dict(out["model_ema"]):
        out["model_ema"] = strip_prefixes(out["model_ema"])
    _check_metadata(path, out)
    return out


def _is_text(head: bytes) -> bool:
    """Whether a file's first bytes ``head`` are text (UTF-8, printable or white space)."""
    for cut in range(4):  # the last character may be cut off by the read
        try:
            chars = head[:len(head) - cut].decode()
        except UnicodeDecodeError:
            continue
        return bool(chars) and all(c.isprintable() or c in "\t\r\n" for c in chars)
    return False


def _not_the_references(path: Path, sd: dict, reference: bool) -> dict:
    """``sd``, unless it is in the layout of the paper's own code and ``reference`` is not set: a
    :class:`UserError` naming the command that reads it (every other command's message would be a
    list of unexpected keys)."""
    if not reference and is_reference_state_dict(sd):
        raise UserError(f"{path} holds a model in the layout of the paper's own code (e.g. "
                        f"{next(k for k in sd if k.endswith(REFERENCE_KEY_ENDINGS))}): convert it first with "
                        f"`orepa import-reference {path} -o OUT.pth"
                        f"{' --deploy --fuse-bn' if is_deployed_reference(sd) else ''}`, then give OUT.pth")
    return sd


def _torch_load(path: Path, lazy: bool):
    with warnings.catch_warnings():  # a plain pickle's protocol: the error that follows says what the file is
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        if lazy:
            try:
                return load_weights_only(path, mmap=True)
            except RuntimeError as exc:  # torch's legacy (non-zip) format cannot be mapped: read it whole
                if "mmap" not in str(exc):
                    raise
        return load_weights_only(path)


def checkpoint_form(path: str | os.PathLike) -> str | None:
    """What an existing file holds, for a command about to write over it: an orepa checkpoint's
    form (``"train"``, ``"deploy"``, ``"deploy-fused"``), ``"state_dict"`` for another tool's
    state_dict, ``None`` for anything else. Reads the metadata only (see ``load_checkpoint``'s ``lazy``)."""
    try:
        ckpt = load_checkpoint(path, lazy=True, reference=True)
    except UserError:
        return None
    return ckpt.get("form", "train") if "format" in ckpt else "state_dict"


def _is_run_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a training run's checkpoint (training form with optimizer state:
    ``orepa train``'s ``checkpoint.pth``, ``model_N.pth``, or another tool's). Reads the metadata only."""
    try:
        held = load_checkpoint(path, lazy=True, reference=True)
    except UserError:  # not a checkpoint the loader reads: no run resumes from it
        return False
    return "optimizer" in held and held.get("form", "train") == "train"


#: integer fields of a training checkpoint (where it stopped, and the size of its training set)
_COUNTERS = ("epoch", "step_in_epoch", "global_step", "train_images")
_MAPPINGS = ("model", "model_ema", "optimizer", "lr_scheduler", "scaler", "rng")


def _check_metadata(path: Path, ckpt: dict) -> None:
    """The fields every reader relies on have the types orepa writes: a damaged or hand-edited
    checkpoint is reported here, by field, not as an error deep inside a command."""
    cfg = ckpt.get("model_cfg")
    if cfg is not None:
        missing = [k for k in MODEL_CFG_KEYS if not isinstance(cfg, dict) or k not in cfg]
        if missing:
            raise UserError(f"{path}: damaged model_cfg (" + (f"missing {', '.join(missing)}" if isinstance(cfg, dict)
                                                             else f"a {type(cfg).__name__}, not a mapping") + ")")
        try:
            checked_cfg(dict(cfg))
        except UserError as exc:
            raise UserError(f"{path}: damaged model_cfg: {exc}") from None
    if ckpt.get("args") is not None and not isinstance(ckpt["args"], dict):
        raise UserError(f"{path}: damaged args (a {type(ckpt['args']).__name__}, not a mapping)")
    classes = ckpt.get("classes")
    if classes is not None and (not isinstance(classes, (list, tuple)) or not all(isinstance(c, str) for c in classes)):
        raise UserError(f"{path}: damaged classes ({type(classes).__name__}, not a list of class names)")
    for key in _COUNTERS:
        value = ckpt.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{path}: damaged {key} ({value!r}, not a count)")
    if ckpt.get("form") is not None and ckpt["form"] not in FORMS:
        raise UserError(f"{path}: unknown model form {ckpt['form']!r} (expected one of {', '.join(FORMS)})")
    if "format" not in ckpt:  # another tool's checkpoint: its other fields are not orepa's to judge
        return
    for key in _MAPPINGS:  # states handed to load_state_dict / set_rng_state
        if ckpt.get(key) is not None and not isinstance(ckpt[key], dict):
            raise UserError(f"{path}: damaged {key} (a {type(ckpt[key]).__name__}, not a mapping)")
    history = ckpt.get("history", [])
    if not isinstance(history, list) or not all(isinstance(row, dict) for row in history):
        raise UserError(f"{path}: damaged history (not a list of per-epoch records)")
    sums = ckpt.get("epoch_sums", [0.0, 0.0, 0.0])
    if not isinstance(sums, (list, tuple)) or len(sums) != 3 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in sums):
        raise UserError(f"{path}: damaged epoch_sums ({repr(sums)[:60]}, not three numbers: the epoch's loss "
                        "sum, correct predictions and images)")
    timed = ckpt.get("epoch_timed", [0.0, 0])
    if not (isinstance(timed, (list, tuple)) and len(timed) == 2
            and isinstance(timed[0], (int, float)) and not isinstance(timed[0], bool) and 0 <= timed[0] < math.inf
            and isinstance(timed[1], int) and not isinstance(timed[1], bool) and timed[1] >= 0):
        raise UserError(f"{path}: damaged epoch_timed ({repr(timed)[:60]}, not two counts: the seconds and steps "
                        "of the epoch trained so far)")


#: what a command says after a checkpoint's name where it took the checkpoint's EMA weights (--use-ema)
EMA_NOTE = " (its EMA weights)"


def check_loaded_weights(model: nn.Module, path, use: str, *, optimizer=None, ema=None,
                         use_ema: bool = False) -> None:
    """A :class:`UserError` where the weights loaded from checkpoint ``path`` into ``model`` (and the
    optimizer's state, the EMA's weights given) hold NaN/inf, or a BN running variance below zero
    (finite, but the BN's square root of it is NaN): orepa writes neither, so such a file is damaged,
    or another tool's diverged run. ``use``: what this command would have made of them;
    ``use_ema``: ``model`` holds the checkpoint's EMA weights (--use-ema), said so."""
    where = f"{path}{EMA_NOTE if use_ema else ''}"
    after = "(`orepa eval` still reports what it computes)"
    bad, damage = weights_damage(model, optimizer, ema)
    if damage:
        raise UserError(f"{where} holds {damage}: {use}; {'give a checkpoint from before the run diverged ' if bad else ''}"
                        f"{after}")


def with_bn_counts(model: nn.Module, sd: dict) -> dict:
    """``sd`` with the BN batch counts (``num_batches_tracked``) it lacks taken from ``model``:
    weights saved without them (converted files, PyTorch before 0.4.1) load as PyTorch loads them
    into a BN, counting from the model's (0 when built)."""
    own = model.state_dict()
    missing = [k for k in own if k.rpartition(".")[2] == "num_batches_tracked" and k not in sd]
    return {**sd, **{k: own[k] for k in missing}} if missing else sd


def state_dict_mismatch(model: nn.Module, sd: dict) -> str:
    """Empty if ``sd`` fits ``model`` exactly, else a short description of the differences."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k}: checkpoint {list(sd[k].shape)} vs model {list(own[k].shape)}"
              for k in own if k in sd and isinstance(sd[k], torch.Tensor) and sd[k].shape != own[k].shape]
    # integers, booleans, complex or sparse tensors where the model holds real floats: load_state_dict
    # casts them without a word (complex loses its imaginary part) or fails deep inside (sparse)
    kinds = [f"{k}: checkpoint {sd[k].dtype}{'' if sd[k].layout == torch.strided else f' {sd[k].layout}'} vs "
             f"model {own[k].dtype}" for k in own
             if k in sd and isinstance(sd[k], torch.Tensor) and own[k].is_floating_point()
             and (not sd[k].is_floating_point() or sd[k].layout != torch.strided)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s) ({some_of(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s) ({some_of(unexpected)})")
    if shapes:
        parts.append(f"{len(shapes)} shape mismatch(es) ({some_of(shapes, 2)})")
    if kinds:
        parts.append(f"{len(kinds)} tensor(s) not of real floats ({some_of(kinds, 2)})")
    return "; ".join(parts)


def load_if_fits(model: nn.Module, sd: dict) -> str:
    """Load ``sd`` strictly into ``model`` if it fits (the BN counts it lacks taken from ``model``,
    :func:`with_bn_counts`): ``""``; else nothing is loaded and :func:`state_dict_mismatch` says why.
    The one check-then-load of every command; each caller phrases the mismatch for its situation."""
    full = with_bn_counts(model, sd)
    problem = state_dict_mismatch(model, full)
    if not problem:
        model.load_state_dict(full, strict=True)
    return problem


def adapt_input_channels(sd: dict, shapes: Mapping[str, torch.Size], in_chans: int, from_chans: int = 3) -> list[str]:
    """Weights made for images of ``from_chans`` channels (RGB unless a checkpoint says otherwise)
    for a model that takes ``in_chans``: every 4-D tensor of ``sd`` that differs from
    ``shapes[key]`` only by ``from_chans`` input channels against ``in_chans`` is adapted in place
    and its key returned. One channel: the sum over the source's channels (the function its
    weights compute on a gray image given as equal channels); other counts: the source's
    channels repeated, scaled by ``from_chans / in_chans`` (as timm's ``adapt_input_conv`` for
    RGB; from one channel, the gray weights applied to the channels' mean)."""
    if in_chans == from_chans:
        return []
    changed = []
    for key, w in sd.items():
        want = shapes.get(key)
        if want is None or w.dim() != 4 or w.shape[1] != from_chans or len(want) != 4 or want[1] != in_chans or \
                (w.shape[0], *w.shape[2:]) != (want[0], *want[2:]):
            continue
        if in_chans == 1:
            sd[key] = w.sum(dim=1, keepdim=True)
        else:
            sd[key] = w.repeat(1, -(-in_chans // from_chans), 1, 1)[:, :in_chans] * (from_chans / in_chans)
        changed.append(key)
    return changed


def new_classifier_keys(model: nn.Module, sd: dict, num_classes: int) -> list[str]:
    """The keys of ``model``'s classifier that ``sd`` holds for another class count: the parameters
    of its ``nn.Linear`` layers with ``num_classes`` outputs whose shape differs from ``sd``'s."""
    own = model.state_dict()
    return [key for key in _classifier_keys(model, num_classes)
            if key in sd and isinstance(sd[key], torch.Tensor) and sd[key].shape != own[key].shape]


def _classifier_keys(model: nn.Module, num_classes: int) -> list[str]:
    """The state_dict keys of ``model``'s classifier: the parameters of its ``nn.Linear`` layers with
    ``num_classes`` outputs."""
    return [f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, nn.Linear)
            and m.out_features == num_classes for p, _ in m.named_parameters(recurse=False)]


def classifier_rows_by_name(model: nn.Module, sd: dict, num_classes: int, saved: Sequence[str],
                            classes: Sequence[str]) -> tuple[dict, str]:
    """``sd`` with ``model``'s classifier rows taken from ``sd``'s by class name: the checkpoint was
    trained on classes ``saved`` (its label j is ``saved[j]``), the model is for ``classes``. A class of
    both keeps its trained row, wherever it sits in either; any other row keeps the model's
    initialisation. Returns ``(sd, what was done)``; ``sd`` unchanged (and ``""``) where the names
    say nothing (unnamed, the same list, or no class in common)."""
    saved, classes = tuple(map(class_name, saved)), tuple(classes)  # (an older orepa's: as written)
    common = [c for c in classes if c in saved]
    if not saved or not classes or saved == classes or not common:
        return sd, ""
    own = model.state_dict()
    keys = [key for key in _classifier_keys(model, num_classes)
            if isinstance(sd.get(key), torch.Tensor) and sd[key].dim() >= 1 and sd[key].shape[0] >= len(saved)
            and sd[key].shape[1:] == own[key].shape[1:]]
    if not keys:
        return sd, ""
    rows = torch.tensor([classes.index(c) for c in common])
    from_rows = torch.tensor([saved.index(c) for c in common])
    sd = dict(sd)
    for key in keys:
        t = own[key].detach().clone()
        t[rows] = sd[key][from_rows].to(t.dtype)
        sd[key] = t
    new = [c for c in classes if c not in saved]
    if not new and len(classes) == len(saved) == num_classes:
        return sd, "its classifier's rows put in this data's class order (by name)"
    return sd, (f"a {num_classes}-class classifier whose rows for the {len(common)} class(es) the checkpoint knows "
                "come from it (by name)" + (f"; new: {some_of(new)}" if new else ""))


def load_model_state(model: nn.Module, sd: dict, *, path, built: str, saved: str | None = None,
                     keep: Sequence[str] = (), plain: bool = False) -> str:
    """Strict ``load_state_dict`` with an error naming both architectures when it does not fit;
    the tensors named in ``keep`` (a new classifier) keep the model's values. ``plain``: a
    state_dict that does not fit the training form may be the plain network's (the deployed
    layout, e.g. torchvision's or timm's weights): every block then starts as its conv
    (:func:`orepa.load_plain_state_dict`). Returns how it loaded: ``"train"`` or ``"plain"``."""
    if keep:
        own = model.state_dict()
        full = {**sd, **{k: own[k] for k in keep}}
    else:
        full = sd
    problem = load_if_fits(model, full)
    if not problem:
        return "train"
    if plain and any(isinstance(m, orepa.ReparamConv2d) for m in model.modules()):
        try:
            orepa.load_plain_state_dict(model, sd, keep=keep)
            return "plain"
        except ValueError as exc:
            problem += f"; nor is it the plain network's ({exc})"
            if any(isinstance(m, orepa.OREPADeepStem) for m in model.modules()) and "deep stem" in str(exc):
                problem += ("; --no-deep-stem builds the stem as one block, which starts as the checkpoint's stem "
                            "conv")
    origin = f" (it was saved for {saved})" if saved and saved != built else ""
    raise UserError(f"checkpoint {path} does not fit the model built, {built}{origin}: {problem}")


def checkpoint_weights(ckpt: dict, path, use_ema: bool = False) -> dict:
    """The state_dict a command loads from checkpoint ``ckpt`` (read from ``path``): its model's, or
    with ``use_ema`` (--use-ema) its EMA's; an EMA it does not hold is a :class:`UserError` saying why."""
    if not use_ema:
        return ckpt["model"]
    if ckpt.get("model_ema") is None:  # (absent, or saved as None by a run without one)
        if ckpt.get("ema"):
            raise UserError(f"{path} holds EMA weights as its model (written so by orepa reparam or import-reference "
                            "--use-ema): leave out --use-ema")
        if ckpt.get("form", "train") != "train":  # deployed from a run's model weights: its EMA, if any, is there
            source = ckpt.get("source_path") or ckpt.get("source")
            raise UserError(f"{path} holds deployed model weights, no EMA weights; deploy the run's EMA weights with "
                            f"`orepa reparam {source or 'CHECKPOINT'} --use-ema`")
        raise UserError(f"{path} has no EMA weights (train with --model-ema)")
    return ckpt["model_ema"]


def check_use_ema(use_ema: bool) -> None:
    """Where a command was given no checkpoint (a model built at initialisation): --use-ema has no
    EMA to take."""
    if use_ema:
        raise UserError("--use-ema needs a checkpoint with EMA weights")


def other_stem_hint(cfg: dict, sd: dict, forms: Sequence[str] = FORMS) -> str:
    """For a bare state_dict that does not fit ``cfg``'s zoo model: a sentence naming the flag to pass
    where it fits the same model with the other stem (small-input, CIFAR / Fashion-MNIST style, or
    the standard one) in one of ``forms``; else "". A bare state_dict records neither stem, and its
    key mismatch reads as another method's branches (an OREPA ResNet's deep stem against a 3x3 block)."""
    if external_source(cfg["model"]):  # (another library's network keeps its own stem)
        return ""
    other = {**cfg, "small_input": not cfg["small_input"]}
    for form in forms:
        try:
            model = build_model_form(other, form)
        except (UserError, ValueError, TypeError, KeyError):  # a model without that stem: no hint
            return ""
        if not state_dict_mismatch(model, with_bn_counts(model, sd)):
            return (" It fits the small-input stem (CIFAR / Fashion-MNIST style): pass --small-input."
                    if other["small_input"] else " It fits the standard stem, not the small-input one: pass "
                    "--no-small-input.")
    return ""


def model_from_checkpoint(ckpt: dict, path, *, cfg: dict | None = None, use_ema: bool = False
                          ) -> tuple[nn.Module, dict, str]:
    """Build the model a checkpoint describes (training or deployed form) and load its weights.

    ``cfg`` overrides the stored model_cfg (needed for a bare state_dict). Without a
    stored ``form`` every form is tried and the one whose keys fit is used.
    Returns ``(model in eval mode, cfg, form)``.
    """
    saved_cfg = ckpt.get("model_cfg")
    cfg = cfg or saved_cfg
    if cfg is None:
        raise UserError(f"{path} is a bare state_dict: pass --model/--method/--num-classes/... to say what it is")
    sd = checkpoint_weights(ckpt, path, use_ema)
    saved_desc = describe_cfg(saved_cfg) if saved_cfg else None
    form = ckpt.get("form")
    if form is not None:
        if form not in FORMS:
            raise UserError(f"{path}: unknown model form {form!r}")
        model = build_model_form(cfg, form)
        # (the EMA named where its weights are the ones that do not fit; the saved model said where it differs)
        load_model_state(model, sd, path=f"{path}{EMA_NOTE if use_ema else ''}", built=f"{describe_cfg(cfg)} [{form}]",
                         saved=f"{saved_desc} [{form}]" if saved_desc else None)
        return model.eval(), cfg, form
    problems = []
    for form in FORMS:
        model = build_model_form(cfg, form)
        problem = load_if_fits(model, sd)
        if not problem:
            return model.eval(), cfg, form
        problems.append(f"as {form}: {problem}")
    hint = other_stem_hint(cfg, sd) if saved_cfg is None else ""  # (a saved model_cfg says its stem)
    raise UserError(f"checkpoint {path}{EMA_NOTE if use_ema else ''} fits no form of {describe_cfg(cfg)}: "
                    + " | ".join(problems)
                    + (f".{hint}" if hint else ""))
