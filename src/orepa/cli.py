"""The ``orepa`` command: one subcommand per application module.

Each subcommand lives in its own module under ``orepa.apps`` exposing
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only
when their subcommand runs, so ``orepa --help`` imports none of them (torch, by
the package's ``__init__``, alone) and the core library never imports the
applications.

One error path: a bad flag value (argparse) or a :class:`orepa.apps.common.UserError`
raised anywhere in a subcommand ends as one line ``orepa CMD: error: ...`` on stderr
and exit code 2, without a traceback. ``args.given`` holds the destinations of the
flags given explicitly on the command line (``train --resume`` keeps the others from
the checkpoint).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import signal
import sys
import threading
import warnings

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("orepa.apps.demo", "Fashion-MNIST: train OREPA and base ResNets, reparameterize, compare (~1.5-5 min on 2 CPU cores)"),
    "train": ("orepa.apps.train", "train a model with the paper's recipe (Fashion-MNIST by default; torchrun for DDP)"),
    "eval": ("orepa.apps.evaluate", "top-1/top-5 of a training-form or deployed checkpoint, or of an export"),
    "reparam": ("orepa.apps.reparam", "turn a training checkpoint into a deployed (vanilla / BN-folded) one, verified"),
    "bench": ("orepa.apps.bench", "training cost of re-param methods side by side (time, memory, FLOPs)"),
    "analyze": ("orepa.apps.analyze", "branch similarity and branch norms of every re-param block (Fig. viz)"),
    "export": ("orepa.apps.export", "deploy a model (reparameterize + fold BN), export to ONNX / torch.export / "
               "TorchScript, verify"),
    "import-reference": ("orepa.apps.import_reference",
                         "a checkpoint trained with the paper's public code -> an orepa training or deployed one"),
}

#: the packages of the ``apps`` extra (pyproject.toml): import name -> distribution name. The library is
#: torch's alone (``pip install orepa``); a command that reaches for one of these without it says so
APPS_PACKAGES: dict[str, str] = {
    "torchvision": "torchvision", "timm": "timm", "tqdm": "tqdm", "matplotlib": "matplotlib", "numpy": "numpy",
    "PIL": "pillow", "onnx": "onnx", "onnxruntime": "onnxruntime", "onnxscript": "onnxscript",
}


def missing_apps_package(exc: ImportError) -> str | None:
    """What to install, where ``exc`` is a package of the apps extra not being there; else None."""
    dist = APPS_PACKAGES.get((exc.name or "").partition(".")[0])
    return None if dist is None else \
        f'this command needs the package {dist}: pip install "orepa[apps]" (the command line\'s packages)'


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``orepa CMD: error: MESSAGE (see orepa CMD --help)``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv_cmd: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog="orepa", description="Online Convolutional Re-parameterization")
    from . import __version__  # (the package is imported already: this module is part of it)
    parser.add_argument("--version", action="version", version=f"orepa {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == argv_cmd:  # only the chosen subcommand's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def _subparser(parser: argparse.ArgumentParser, cmd: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]


def given_flags(argv: list[str], cmd: str) -> frozenset[str]:
    """Destinations of the arguments present in ``argv`` (parsed again with every default suppressed)."""
    parser = build_parser(cmd)
    sub = _subparser(parser, cmd)
    for action in sub._actions:
        action.default = argparse.SUPPRESS
    sub._defaults.clear()
    return frozenset(vars(parser.parse_args(argv))) - {"command"}


def _printable_streams() -> None:
    """Any text reaches the terminal: a Linux file name is any bytes (Python hands those that are not
    UTF-8 over as surrogates), and a strict stream would end a finished command at its last print."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


class _SurvivableStream:
    """A text stream whose loss ends its output, not the command: a closed pipe (``orepa train ... |
    head``) or a hung-up terminal (an ssh session dropped: EIO) made the next ``print`` raise, which
    ended a training run between epochs with a traceback instead of its checkpoint, summary and exit
    code. The first failed write sends the stream's descriptor to /dev/null (what is still buffered
    goes there at exit too, instead of a second error); everything else is the stream's own."""

    def __init__(self, stream):
        self._stream, self._lost = stream, False

    def _lose(self) -> None:
        self._lost = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass  # (a stream without a descriptor: nothing buffered will reach one)

    def write(self, text: str) -> int:
        if not self._lost:
            try:
                return self._stream.write(text)
            except OSError:
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self._lost:
            try:
                self._stream.flush()
            except OSError:
                self._lose()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _survivable_streams():
    """sys.stdout and sys.stderr as :class:`_SurvivableStream` while a command runs."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if s is None or isinstance(s, _SurvivableStream) else _SurvivableStream(s)
                              for s in saved)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def _quiet_torch_internals() -> None:
    """Warnings torch's own code raises at itself, which no flag of ours can act on: inductor's
    lowering of ``diagonal`` (a compiled kernel construction's vjp, a ``--compile``d step) calls
    torch's deprecated ``_prims_common.check``; DDP's reducer, given a 1x1 conv's weight gradient
    from a compiled backward (strides ``[I, 1, I, I]``), says its strides do not match its bucket's
    (``[I, 1, 1, 1]``), comparing the strides of size-1 dimensions: the same layout in memory
    (pytorch/pytorch#47163). Any other mismatch of strides still shows. And two of torch's logs
    (:data:`_TORCH_LOG_NOISE`)."""
    warnings.filterwarnings("ignore", message=r"`torch\._prims_common\.check` is deprecated",
                            category=FutureWarning, module=r"torch\._inductor\.")
    warnings.filterwarnings("ignore", category=UserWarning, message=(
        r"Grad strides do not match bucket view strides\.[^\n]*\n"
        r"grad\.sizes\(\) = \[(\d+), (\d+), 1, 1\], strides\(\) = \[\2, 1, \d+, \d+\]\n"
        r"bucket_view\.sizes\(\) = \[\1, \2, 1, 1\], strides\(\) = \[\2, 1, \d+, \d+\]"))
    for name, message in _TORCH_LOG_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.message == message for f in logger.filters):
            logger.addFilter(_DropMessage(message))


#: (logger, message format) of torch's logs about itself in a command's run: dynamo does not trace the
#: profiler range DDP's forward opens (every --compile'd torchrun run); a CUDA build of torch on a
#: machine without CUDA names the CUDA_HOME that inductor's CPU compiler does not use (every --compile)
_TORCH_LOG_NOISE = (("torch._dynamo.variables.ctx_manager", "Profiler record function %s will be ignored"),
                    ("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME='%s'"))


class _DropMessage(logging.Filter):
    """Drops a logger's records of one message format."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message


#: commands that take the stop signals over themselves (a run stops at its next step, with a checkpoint)
_OWN_STOP = ("train", "demo")


class _Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, raised where the command is: it unwinds as Ctrl-C does, so what it was
    writing (a temporary file beside its output, a scratch directory) is removed on the way out."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_stopped(signum, frame):
    raise _Stopped(signum)


@contextlib.contextmanager
def _stop_signals_unwind(command: str):
    """While a command runs, SIGTERM / SIGHUP end it as Ctrl-C does (the default action killed it
    where it stood, leaving its temporary files); not for the commands that handle them
    (:data:`_OWN_STOP`), nor a SIGHUP ignored (``nohup``). Afterwards every stop signal's handler is
    as it was (a failing training run under torchrun keeps its own until its error line is out).
    Off the main thread (where no handler can be set) nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from .apps.common import STOP_SIGNALS

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    if command not in _OWN_STOP:
        for sig in (getattr(signal, name, None) for name in ("SIGTERM", "SIGHUP")):
            if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, _raise_stopped)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    _printable_streams()
    with _survivable_streams():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_torch_internals()
    cmd = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(cmd if cmd in SUBCOMMANDS else None)
    if cmd in SUBCOMMANDS:  # (the subcommand's module, imported above, imports torch and this anyway)
        from .apps.common import stop_with_parent

        stop_with_parent()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the subcommand's parser: its name and its --help
            target = _subparser(parser, args.command) if args.command else parser
            target.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # a bad argument (its one-line error is printed): the exit code; --help: exit
        if exc.code in (0, None):
            raise
        return int(exc.code)
    if args.command is None:
        parser.print_help()
        return 0
    args.given = given_flags(argv, args.command)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    from orepa.apps.common import UserError, fail, out_of_memory, process_settings_kept

    try:
        with _stop_signals_unwind(args.command), process_settings_kept():
            try:
                return int(module.run(args) or 0)
            except UserError as exc:  # (said with the command's signal handlers still in place: see train.StopSignals)
                return fail(args.command, exc)
    except ModuleNotFoundError as exc:  # an installation without the apps extra (pip install orepa: torch only)
        missing = missing_apps_package(exc)
        if missing is None:
            raise
        return fail(args.command, UserError(missing))
    except RuntimeError as exc:  # torch.OutOfMemoryError among them: that one is the user's to fix
        oom = out_of_memory(exc)
        if oom is None:
            raise
        # what sizes the tensors here: the batch, and the images where a flag sets them (analyze has neither)
        sizes = [f for k, f in (("batch_size", "batch (-b)"), ("input_size", "--input-size"), ("image_size", "--image-size"))
                 if k in vars(args)]
        hint = f"; a smaller {' or '.join(sizes)} needs less" if sizes else ""
        return fail(args.command, UserError(f"{oom}{hint}"))
    except OSError as exc:  # a path the system refuses (a name too long, ...) that no check before named
        if exc.filename is None:
            raise
        return fail(args.command, UserError(f"{exc.filename}: {exc.strerror or exc}"))
    except KeyboardInterrupt as exc:  # Ctrl-C (or _Stopped): one line (a command may say how to go on), the shell's code
        print(f"orepa {args.command}: {str(exc) or 'interrupted'}", file=sys.stderr, flush=True)
        return 128 + getattr(exc, "signum", signal.SIGINT)


if __name__ == "__main__":
    raise SystemExit(main())
