"""``orepa demo``: the whole pipeline on real data, in one to three minutes on two CPU cores.

On Fashion-MNIST (Debian package ``dataset-fashion-mnist``) it trains a small OREPA
ResNet-18 (stage widths x0.125, CIFAR-style 3x3 stem for 28x28 inputs, one input
channel) and its plain ``base`` counterpart with the same recipe and seed, then
for each: reparameterizes it (``orepa reparam``), evaluates the training form and
the deployed plain network on the full 10,000-image test set, checks that their
outputs and accuracies agree, and prints a side-by-side table.

Each model runs as the two commands a user would type (printed at the start)::

    orepa train --method M ... --output-dir runs/demo/M
    orepa reparam runs/demo/M/checkpoint.pth

The two pipelines run concurrently, one torch thread each (``--jobs``), which on a
small CPU is faster than running them one after the other with two threads each,
and gives both methods the same conditions for the timing comparison.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

from .checkpoint import check_output_path, write_json
from .common import (
    STOP_SIGNALS,
    STOP_WITH_PARENT_ENV,
    UserError,
    available_cpus,
    init_distributed,
    method_list,
    nonneg_float,
    path_arg,
    positive_float,
    positive_int,
    seed_int,
    stop_signals_to_catch,
    thread_count,
)
from .data import (
    FASHION_MNIST_TEST,
    FASHION_MNIST_TRAIN,
    add_cache_dir_argument,
    check_batch_fits,
    prepare_fashion_mnist,
)
from .model_cfg import build_model, external_source
from .train import PROGRESS_FILE, run_files


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", nargs="+", default=["base", "orepa"],
                   help="methods to compare: words or a comma-separated list (base orepa)")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--width-mult", type=positive_float, default=0.125,
                   help="stage width multiplier (0.125: 8-16-32-64)")
    p.add_argument("--epochs", type=positive_int, default=1)
    p.add_argument("--train-subset", type=positive_int, default=None, help="train on N images (default: all 60,000)")
    p.add_argument("--val-subset", type=positive_int, default=None, help="test on N images (default: all 10,000)")
    p.add_argument("-b", "--batch-size", type=positive_int, default=128)
    p.add_argument("--lr", type=positive_float, default=None, help="default: 0.1 x batch / 256 (the paper's rule)")
    p.add_argument("--lr-warmup-epochs", type=nonneg_float, default=0.1)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="pipelines run at once (default: min(#methods, #CPUs)); each gets --threads/jobs threads")
    p.add_argument("--device", default=None, help="passed to train and reparam (default: cuda if available)")
    p.add_argument("--threads", type=thread_count, default=None,
                   help="torch threads of all pipelines together (default: the CPUs available)")
    p.add_argument("--output-dir", type=path_arg, default="runs/demo",
                   help="where the runs go (runs/demo); a previous demo there is replaced (a run the demo did not make, "
                        "or trained on since, e.g. with --resume, is refused)")
    add_cache_dir_argument(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--in-process", action="store_true",
                   help="run the commands one after the other inside this process (no subprocesses; for tests)")


#: the demo's record, in each method's folder, of the checkpoint its pipeline left there: a run trained
#: on since (a --resume) is the user's, no longer the demo's to replace
DEMO_RECORD = "demo-run.json"


def _checkpoint_digest(folder: Path) -> str | None:
    """The sha256 of ``folder``'s checkpoint.pth (None where there is none): whether it is still the
    one the demo left, whatever path or copy it is read from."""
    digest = hashlib.sha256()
    try:
        with open(folder / "checkpoint.pth", "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def _trained_on(folder: Path) -> bool:
    """Whether the demo's run in ``folder`` was trained on after the demo left it (its checkpoint.pth is
    not the one the demo recorded). A folder without the record is taken as the demo's, as before the
    record: an older demo's (its demo.log says it is the demo's), or one whose demo was killed outright;
    the demo has no --overwrite, so refusing it would leave removing it by hand as the only way on."""
    try:
        record = json.loads((folder / DEMO_RECORD).read_text())
    except (OSError, ValueError):
        return False
    try:
        return not isinstance(record, dict) or record.get("checkpoint_sha256") != _checkpoint_digest(folder)
    except OSError:  # a checkpoint it cannot read: not known to be the one the demo left
        return True


def _commands(args, method: str, out: Path, threads: int) -> list[list[str]]:
    orepa = [sys.executable, "-m", "orepa"]
    common = ["--threads", str(threads), "--no-progress"]
    if args.device:
        common += ["--device", args.device]
    if args.cache_dir:
        common += ["--cache-dir", args.cache_dir]
    # (a zoo model at --width-mult; another network, torchvision:NAME / timm:NAME, as it is built)
    width = [] if external_source(args.model) else ["--width-mult", f"{args.width_mult:g}"]
    train = [*orepa, "train", "--model", args.model, "--method", method, *width,
             "--epochs", str(args.epochs), "-b", str(args.batch_size),
             "--lr-warmup-epochs", f"{args.lr_warmup_epochs:g}", "--no-eval", "--no-tensorboard",
             "--output-dir", str(out), "--overwrite", "--seed", str(args.seed), *common]
    if args.lr is not None:
        train += ["--lr", f"{args.lr:g}"]
    if args.train_subset:
        train += ["--train-subset", str(args.train_subset)]
    reparam = [*orepa, "reparam", str(out / "checkpoint.pth"), "--json", str(out / "reparam.json"), *common]
    if args.val_subset:
        reparam += ["--val-subset", str(args.val_subset)]
    return [train, reparam]


class _Pipeline(threading.Thread):
    def __init__(self, method: str, cmds: list[list[str]], out: Path, gate: threading.Semaphore,
                 in_process: bool = False):
        super().__init__(daemon=True)
        self.method, self.cmds, self.out, self.gate, self.in_process = method, cmds, out, gate, in_process
        self.rc: int | None = None
        self.stage = "waiting"
        self.failed_in: str | None = None  # the stage that failed or was stopped
        self.log = out / "demo.log"
        self.t0 = self.t1 = None
        self._halt = threading.Event()
        self._proc: subprocess.Popen | None = None
        self.took: int | None = None  # in-process: the stop signal the demo's handler took during a command

    @property
    def stopped_by(self) -> str | None:
        """The stop signal that ended this pipeline's command (``orepa train`` exits with 128 + its
        number after its checkpoint; a command without a handler dies of it; in-process, the
        signal the demo took for it), else None."""
        if self.took is not None:
            return signal.Signals(self.took).name
        for sig in STOP_SIGNALS:
            if self.rc in (128 + sig, -sig):
                return signal.Signals(sig).name
        return None

    def interrupt(self) -> None:
        """Stop at the running command's next step boundary (SIGTERM: a train run that got the
        terminal's SIGINT too records the first and does not take this one as a second Ctrl-C) and
        start no further stage."""
        self._halt.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def run(self) -> None:
        with self.gate:
            if self._halt.is_set():
                return
            self.t0 = time.perf_counter()
            try:
                with open(self.log, "w") as log:
                    for stage, cmd in zip(("train", "reparam + test"), self.cmds):
                        self.stage = stage
                        log.write("$ " + shlex.join(cmd) + "\n")
                        log.flush()
                        if self.in_process:
                            from contextlib import redirect_stderr, redirect_stdout

                            from ..cli import main

                            with redirect_stdout(log), redirect_stderr(log):
                                self.rc = main(cmd[3:])
                        else:
                            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={
                                **os.environ, STOP_WITH_PARENT_ENV: str(os.getpid())})
                            if self._halt.is_set():  # interrupted while it started
                                self._proc.send_signal(signal.SIGTERM)
                            self.rc = self._proc.wait()
                            self._proc = None
                        if self.rc != 0 or self._halt.is_set():
                            self.failed_in = stage
                            break
            except KeyboardInterrupt:  # in-process: the demo's stop between (or around) its commands
                self._halt.set()
                self.failed_in = self.stage
                raise
            finally:
                self.stage = "done" if self.rc == 0 and not self._halt.is_set() else \
                    "stopped" if self.stopped_by or self._halt.is_set() else "failed"
                self.t1 = time.perf_counter()
                # what the demo left, however it ended (a stopped run's checkpoint is the demo's too)
                with suppress(OSError, UserError):
                    write_json(self.out / DEMO_RECORD, {"checkpoint_sha256": _checkpoint_digest(self.out)})


def _watch(pipes: list[_Pipeline], show: bool) -> None:
    bars = {}
    if show:
        from tqdm import tqdm

        bars = {p.method: tqdm(total=1, desc=f"{p.method:>8}", position=i, dynamic_ncols=True, leave=True,
                               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}")
                for i, p in enumerate(pipes)}
    try:
        while any(p.is_alive() for p in pipes):
            time.sleep(1.0)
            for p in pipes:
                if p.method not in bars:
                    continue
                bar = bars[p.method]
                try:
                    prog = json.loads((p.out / PROGRESS_FILE).read_text())
                except (OSError, ValueError):
                    prog = None
                if prog:
                    bar.total = prog["total_steps"]
                    bar.n = prog["global_step"]
                    post = (f"{p.stage}: loss {prog.get('loss', prog.get('train_loss', 0)):.3f}, "
                            f"{prog.get('images_per_s', 0):.0f} img/s")
                else:
                    post = p.stage
                bar.set_postfix_str(post if p.stage == "train" else p.stage, refresh=False)
                bar.refresh()
    finally:
        for bar in bars.values():
            bar.close()


def run(args: argparse.Namespace) -> int:
    prepare_fashion_mnist(args.cache_dir)  # fails early, with the install hint, if the package is missing
    # each once: two pipelines of one method would share its directory
    methods = method_list(args.methods)
    if args.in_process and (args.jobs or 1) > 1:  # said, not silently dropped
        raise UserError(f"--in-process runs the pipelines one after the other in this process: --jobs {args.jobs} "
                        "needs them as processes of their own (leave out --in-process)")
    check_batch_fits(min(args.train_subset or FASHION_MNIST_TRAIN, FASHION_MNIST_TRAIN), args.batch_size)
    # (a bad --device said once here, not by each pipeline's train after it started)
    init_distributed(args.device, one_process="orepa demo")
    check_output_path(args.output_dir, "--output-dir", directory=True)
    root = Path(args.output_dir)
    if run_files(root):  # a training run's own directory: the demo's would lie among its files
        raise UserError(f"--output-dir {root} holds a training run ({', '.join(run_files(root))}); the demo puts a "
                        "folder per method in a directory of its own: choose another --output-dir")
    zoo = external_source(args.model) is None
    if not zoo and "width_mult" in (getattr(args, "given", None) or ()):
        raise UserError(f"--width-mult scales the zoo's models, not {args.model} (built as it is)")
    for m in methods:  # before any pipeline starts: every model the demo would train can be built
        build_model({"model": args.model, "method": m, "num_classes": 10, "in_chans": 1, "small_input": zoo,
                     "width_mult": args.width_mult if zoo else 1.0, "options": {}})
        found = run_files(root / m)
        if found and not (root / m / "demo.log").exists():  # a demo replaces its own runs, no other
            raise UserError(f"--output-dir {root}: {root / m} holds a run the demo did not make "
                            f"({', '.join(found)}); choose another --output-dir")
        if found and _trained_on(root / m):  # ... nor one of its runs that a user continued
            raise UserError(f"--output-dir {root}: {root / m} holds a run trained on since the demo made it (its "
                            "checkpoint.pth is not the one the demo left: a --resume?); choose another --output-dir")
    cpus = args.threads or available_cpus()
    # (more jobs than pipelines would run none more, and split the CPUs among jobs that never start)
    jobs = 1 if args.in_process else min(args.jobs or cpus, len(methods))
    threads = max(1, cpus // jobs)
    shape = f" x{args.width_mult:g} width, small-input stem," if zoo else ""
    print(f"orepa demo: Fashion-MNIST, {args.model}{shape} 1 channel; "
          f"methods {', '.join(methods)}; {args.epochs} epoch(s) on "
          f"{args.train_subset or FASHION_MNIST_TRAIN} training images, tested on {args.val_subset or FASHION_MNIST_TEST}; "
          f"{jobs} pipeline(s) at once, {threads} thread(s) each", flush=True)
    gate = threading.Semaphore(jobs)
    pipes = []
    for m in methods:
        out = root / m
        out.mkdir(parents=True, exist_ok=True)
        (out / PROGRESS_FILE).unlink(missing_ok=True)
        (out / DEMO_RECORD).unlink(missing_ok=True)  # (its checkpoint is about to change: recorded again at the end)
        cmds = _commands(args, m, out, threads)
        for c in cmds:
            print("  $ " + shlex.join(["orepa", *c[3:]]), flush=True)
        pipes.append(_Pipeline(m, cmds, out, gate, args.in_process))
    t0 = time.perf_counter()
    interrupted = False
    received: list[int | None] = [None]  # the first stop signal the demo itself took

    def on_stop(signum, frame):
        # a scheduler's SIGTERM (or SLURM's SIGUSR1) stops the demo as Ctrl-C does: no orphaned runs;
        # a later one while the runs stop changes nothing (Ctrl-C again stops at once)
        if received[0] is None:
            received[0] = signum
            for p in pipes:
                if p.in_process and p.stage not in ("waiting", "done", "failed", "stopped"):
                    p.took = signum  # the command in this thread, which the exception below ends
            raise KeyboardInterrupt

    on_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_stop) for s in stop_signals_to_catch() if s != signal.SIGINT} if on_main else {}
    try:
        if args.in_process:
            for p in pipes:
                p.run()
                if p.stopped_by:  # the command in this thread took the signal: run no further pipeline
                    interrupted = True
                    break
        else:
            for p in pipes:
                p.start()
            _watch(pipes, not args.no_progress)
            for p in pipes:
                p.join()
    except KeyboardInterrupt:
        # a terminal's Ctrl-C reaches the commands as well; a SIGINT to this process alone does not
        interrupted = True
        if received[0] is None:
            received[0] = signal.SIGINT
        print(f"\norepa demo: interrupted ({signal.Signals(received[0]).name}); each running command stops at the "
              "end of its step (a training run writes its checkpoint); Ctrl-C again stops at once", file=sys.stderr,
              flush=True)
        for p in pipes:
            p.interrupt()
        for p in pipes:
            if p.is_alive():
                p.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    wall = time.perf_counter() - t0
    for p in pipes:
        if p.stage == "stopped" or (interrupted and p.rc is None):
            where = (f"in stage {p.failed_in!r}" + (f" ({p.stopped_by})" if p.stopped_by else "")) \
                if p.rc is not None or p.failed_in else "before it started"
            print(f"{p.method}: stopped {where}; output so far in {p.out}/ (demo.log)", file=sys.stderr)
        elif p.rc != 0:
            tail = p.log.read_text().splitlines()[-15:] if p.log.exists() else []
            print(f"\n{p.method} failed (exit {p.rc}) in stage {p.failed_in!r}; last lines of {p.log}:",
                  file=sys.stderr)
            print("\n".join("  " + line for line in tail), file=sys.stderr)
    stopped = next((p.stopped_by for p in pipes if p.stopped_by), None)
    if interrupted or stopped:  # 128 + the signal's number, as orepa train: 130 for Ctrl-C, 143 for SIGTERM
        return 128 + (received[0] or signal.Signals[stopped])
    if any(p.rc != 0 for p in pipes):
        return 1
    rows = {}
    for p in pipes:
        s = json.loads((p.out / "summary.json").read_text())
        r = json.loads((p.out / "reparam.json").read_text())
        rows[p.method] = (s, r, p.t1 - p.t0)
    print_table(rows, wall, args, jobs)
    results = {m: {"summary": s, "reparam": r, "pipeline_s": t} for m, (s, r, t) in rows.items()}
    write_json(root / "demo.json", {"wall_s": wall, "results": results}, indent=2)
    ok = all(r["outputs_match"] and r["accuracy_equal"] for _, r, _ in rows.values())
    print(f"\ndeployed accuracy == training-form accuracy for every model: {'yes' if ok else 'NO'}; "
          f"total {wall / 60:.1f} min. Results in {root}/ (demo.json, <method>/log.csv, curves.png, "
          "checkpoint.pth, deployed.pth)")
    return 0 if ok else 1


def print_table(rows: dict, wall: float, args, jobs: int) -> None:
    methods = list(rows)
    lines = [
        ("test top-1, training form", lambda s, r, t: f"{r['train_form_acc1']:.2f}%"),
        ("test top-1, deployed", lambda s, r, t: f"{r['deployed_acc1']:.2f}%"),
        ("test top-5, deployed", lambda s, r, t: f"{r['deployed_acc5']:.2f}%"),
        ("predictions that differ", lambda s, r, t: f"{r['predictions_differ']} / {r['n']}"),
        ("max |logit diff|", lambda s, r, t: f"{r['max_abs_diff']:.1e}"),
        ("train time", lambda s, r, t: f"{s['train_time_s']:.0f} s"),
        ("time per batch", lambda s, r, t: f"{s['time_per_batch_s'] * 1e3:.0f} ms"),
        ("params, training form", lambda s, r, t: f"{s['params_train']:,}"),
        ("params, deployed", lambda s, r, t: f"{r['params_deployed']:,}"),
        ("peak memory (max RSS)", lambda s, r, t: f"{s['peak_memory_mib']:.0f} MiB"),
        ("pipeline wall time", lambda s, r, t: f"{t:.0f} s"),
    ]
    w0 = max(len(name) for name, _ in lines)
    cells = [[fn(*rows[m]) for m in methods] for _, fn in lines]
    w = max(12, *(len(c) for row in cells for c in row), *(len(m) for m in methods))
    print()
    print(f"{'':<{w0}}  " + "  ".join(f"{m:>{w}}" for m in methods))
    for (name, _), row in zip(lines, cells):
        print(f"{name:<{w0}}  " + "  ".join(f"{c:>{w}}" for c in row))
    b = args.batch_size
    print(f"(batch {b}, {args.epochs} epoch(s); " + (
        "the pipelines ran concurrently, so train times compare the methods under the same load)" if jobs > 1 else
        "the pipelines ran one after the other)"))
