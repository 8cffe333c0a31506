"""Fault injection: kill -9 during training and during a checkpoint write, hostile pickles,
bad inputs, divergence. Tiny Fashion-MNIST runs (ResNet-18 at 1/16 width, 64 images,
batches of 16: 4 steps per epoch), one torch thread, so two runs are bit-identical.

(timm's ``reparameterize_model`` on every zoo model is in test_timm.py.)
"""
from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import child_env

from orepa.apps import train
from orepa.apps.checkpoint import RUN_LOCK
from orepa.apps.common import STOP_SIGNALS, STOP_WITH_PARENT_ENV
from orepa.cli import main

TINY = ["--model", "resnet18", "--width-mult", "0.0625", "--train-subset", "64", "--val-subset", "32", "-b", "16",
        "--lr-warmup-epochs", "0.5", "--no-progress",
        "--no-tensorboard", "--no-curves", "--quiet", "--threads", "1", "--no-eval"]
#: the same network in its plain form, for the tests whose checks concern no re-param block (a message, the
#: files of a run, a process's signals or output): it builds and trains in a third of the OREPA form's time.
#: (A run's stop and resume as the uninterrupted run, and what a command does with its blocks, keep OREPA's.)
PLAIN = ["--method", "base"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(cache, tmp_path_factory) -> dict:
    """An uninterrupted 2-epoch run (8 steps)."""
    out = tmp_path_factory.mktemp("reference")
    assert main(["train", *TINY, "--epochs", "2", "--cache-dir", cache, "--output-dir", str(out)]) == 0
    return _load(out / "checkpoint.pth")


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_same_run(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"] and a["epoch"] == b["epoch"]
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"]) for i in sa)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["lr_scheduler"] == b["lr_scheduler"]


@pytest.mark.slow  # a subprocess
def test_kill_9_during_training_then_resume_is_bit_identical(cache, reference, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "orepa", "train", *TINY, "--epochs", "2", "--save-every", "1", "--cache-dir", cache,
           "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = out / "checkpoint.pth"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if ckpt.exists() and _load(ckpt)["global_step"] >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = _load(ckpt)["global_step"]
    assert 2 <= killed_at < 8
    # --resume alone: same directory, same settings
    assert main(["train", "--resume", str(ckpt), "--no-progress", "--quiet", "--threads", "1"]) == 0
    _assert_same_run(reference, _load(ckpt))


KILL_ON_THIRD_SAVE = """
import os, signal, sys, torch
calls = {"n": 0}
real_save = torch.save
def save(obj, f, *a, **k):
    calls["n"] += 1
    if calls["n"] == 3:          # the third checkpoint: half of it on disk, then kill -9
        f.write(b"PK\\x03\\x04 half a checkpoint")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *a, **k)
torch.save = save
from orepa.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a subprocess
def test_kill_9_during_a_checkpoint_write_keeps_the_previous_one(cache, reference, tmp_path):
    out = tmp_path / "run"
    argv = ["train", *TINY, "--epochs", "2", "--save-every", "1", "--cache-dir", cache, "--output-dir", str(out)]
    proc = subprocess.run([sys.executable, "-c", KILL_ON_THIRD_SAVE, *argv], env=child_env(), capture_output=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    ckpt = out / "checkpoint.pth"
    assert _load(ckpt)["global_step"] == 2  # the second save, intact
    stale = list(out.glob(".checkpoint.pth.*.tmp"))
    assert len(stale) == 1 and stale[0].read_bytes().startswith(b"PK")
    assert main(["train", "--resume", str(ckpt), "--no-progress", "--quiet", "--threads", "1"]) == 0
    assert not list(out.glob(".*.tmp"))  # the next write of that file removed the leftover
    _assert_same_run(reference, _load(ckpt))


SIGNAL_ON_SAVE = """
import os, signal, sys, torch
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's run, however the suite was started (nohup ignores it)
sig, at = int(sys.argv[1]), int(sys.argv[2])
calls = {"n": 0}
real_save = torch.save
def save(obj, f, *a, **k):
    calls["n"] += 1
    if calls["n"] == at:  # during a checkpoint write, to the whole process group (as Ctrl-C in a terminal,
        group = os.getpgid(0)  # or a scheduler's SIGTERM): loader workers get it too, from another process
        pid = os.fork()        # (the workers still obey their parent's SIGTERM)
        if pid == 0:
            os.setsid()
            os.killpg(group, sig)
            os._exit(0)
        os.waitpid(pid, 0)
    return real_save(obj, f, *a, **k)
torch.save = save
from orepa.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.slow  # a subprocess
@pytest.mark.parametrize("sig,at,stops_at", [(signal.SIGINT, 2, 3), (signal.SIGTERM, 3, 4), (signal.SIGHUP, 3, 4)])
def test_a_stop_signal_ends_the_step_writes_a_checkpoint_and_the_run_resumes_bit_identical(
        cache, reference, tmp_path, sig, at, stops_at):
    """Ctrl-C, a scheduler's SIGTERM or a closed terminal's SIGHUP, with two loader workers: the step under way ends, the run
    writes a checkpoint where it stands (mid-epoch, or at the epoch's end) and exits with 128 + the
    signal's number, the way to go on printed; --resume then ends as the uninterrupted run."""
    out = tmp_path / "run"
    argv = ["train", *TINY, "--epochs", "2", "--save-every", "1", "-j", "2", "--cache-dir", cache,
            "--output-dir", str(out)]
    proc = subprocess.run([sys.executable, "-c", SIGNAL_ON_SAVE, str(int(sig)), str(at), *argv], env=child_env(),
                          capture_output=True, timeout=300, start_new_session=True)
    err = proc.stderr.decode()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err and "exited unexpectedly" not in err, err[-2000:]
    ckpt = out / "checkpoint.pth"
    assert f"stopped: {sig.name} received; continue with --resume {ckpt}" in proc.stdout.decode()
    stopped = _load(ckpt)
    assert stopped["global_step"] == stops_at and stopped["epoch"] == stops_at // 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_signal"] == sig.name and summary["stopped"] == f"{sig.name} received"
    assert main(["train", "--resume", str(ckpt), "--no-progress", "--quiet", "--threads", "1"]) == 0
    _assert_same_run(reference, _load(ckpt))


def test_a_stop_signal_during_the_evaluation_ends_it_and_keeps_the_epochs_training(
        cache, reference, tmp_path, monkeypatch, capsys):
    """torchrun gives its processes 30 s after passing a SIGINT or SIGTERM on (SLURM its KillWait, 30 s),
    then kills them: a run stopped during an epoch's evaluation evaluated the whole validation set before
    its checkpoint, and with a large set was killed first, the epoch it had trained lost (no checkpoint,
    no word). A stop signal now ends the evaluation at its next batch and the epoch's training is saved
    (a checkpoint at its last step); --resume evaluates it and ends as the run never stopped."""
    real, calls = train.evaluate, []

    def evaluate(*args, **kwargs):
        if not calls:  # the signal comes as the first epoch's evaluation begins
            os.kill(os.getpid(), signal.SIGTERM)
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "evaluate", evaluate)
    out, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoint.pth"
    argv = [a for a in TINY if a != "--no-eval"]
    assert main(["train", *argv, "--epochs", "2", "--cache-dir", cache, "--output-dir", str(out)]) == 143
    assert f"stopped: SIGTERM received; continue with --resume {ckpt}" in capsys.readouterr().out
    stopped = _load(ckpt)
    assert (stopped["epoch"], stopped["step_in_epoch"], stopped["reason"], stopped["history"]) == (0, 4, "trained", [])
    progress = json.loads((out / "progress.json").read_text())  # where it stopped, not its last periodic write
    assert (progress["step"], progress["global_step"]) == (4, 4)
    monkeypatch.setattr(train, "evaluate", real)
    assert main(["train", "--resume", str(ckpt), "--no-progress", "--quiet", "--threads", "1"]) == 0
    done = _load(ckpt)
    _assert_same_run(reference, done)
    assert [r["epoch"] for r in done["history"]] == [1, 2] and all("val_acc1" in r for r in done["history"])


def test_a_stop_signal_during_the_ema_evaluation_ends_it_too(cache, tmp_path, monkeypatch, capsys):
    """With --model-ema each epoch is evaluated twice: a stop signal during the EMA's evaluation ends
    it as one during the model's does (the epoch's training saved at its last step, unevaluated)."""
    real, calls = train.evaluate, []

    def evaluate(*args, **kwargs):
        calls.append(kwargs["desc"])
        if kwargs["desc"] == "eval EMA":
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "evaluate", evaluate)
    out = tmp_path / "run"
    argv = [a for a in TINY if a != "--no-eval"] + PLAIN
    assert main(["train", *argv, "--model-ema", "--epochs", "2", "--cache-dir", cache, "--output-dir", str(out)]) == 143
    assert calls == ["eval", "eval EMA"]
    stopped = _load(out / "checkpoint.pth")
    assert (stopped["epoch"], stopped["step_in_epoch"], stopped["reason"], stopped["history"]) == (0, 4, "trained", [])


DEMO_IN_A_TERMINAL = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground job (a background one ignores it)
from orepa.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a subprocess running two more
@pytest.mark.parametrize("sig,group,runs_got", [(signal.SIGINT, True, "SIGINT"), (signal.SIGTERM, False, "SIGTERM")])
def test_ctrl_c_in_the_demo_stops_every_pipeline_at_a_checkpoint(cache, tmp_path, sig, group, runs_got):
    """Ctrl-C reaches the demo and both of its training runs (one process group); a scheduler's
    SIGTERM reaches the demo alone, which passes it on. Each run ends its step and writes its
    checkpoint, the demo waits for them, starts no later stage, reports them as stopped (not
    failed) and exits with 128 + the signal's number."""
    out = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-c", DEMO_IN_A_TERMINAL, "demo", "--output-dir", str(out),
                             "--train-subset", "20000", "--val-subset", "64", "--width-mult", "0.0625", "-b", "16",
                             "--no-progress", "--cache-dir", cache],
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline, steps = time.monotonic() + 180, [0, 0]
        while min(steps) < 1 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            for i, m in enumerate(("base", "orepa")):
                try:
                    steps[i] = json.loads((out / m / "progress.json").read_text())["global_step"]
                except (OSError, ValueError, KeyError):
                    pass
        assert min(steps) >= 1 and proc.poll() is None, steps
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = err.decode()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err and "failed" not in err, err[-2000:]
    assert f"orepa demo: interrupted ({sig.name}); each running command stops at the end of its step" in err
    for m in ("base", "orepa"):
        assert f"{m}: stopped in stage 'train' ({runs_got}); output so far in {out / m}/" in err
        assert _load(out / m / "checkpoint.pth")["global_step"] >= 2
        assert json.loads((out / m / "summary.json").read_text())["stop_signal"] == runs_got
        assert not (out / m / "reparam.json").exists()  # no later stage started
    assert not (out / "demo.json").exists()


def test_stop_signals_are_recorded_then_a_second_ctrl_c_interrupts_and_the_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with train.StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs in the main thread between bytecodes
        assert signals.received == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert signals.received == "SIGTERM"  # the first one stays the reason
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_a_hangup_stops_a_run_unless_it_was_started_under_nohup():
    """SIGHUP (a closed terminal, a dropped ssh session) stops a run as SIGTERM does; one started
    ignoring it (nohup) keeps ignoring it: it is meant to outlive the terminal."""
    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's run, however the suite was started (nohup)
        with train.StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.01)
            assert signals.received == "SIGHUP"
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with train.StopSignals() as signals:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.01)
            assert signals.received is None
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


# the variable's name comes as the first argument (the test reads orepa's constant): the parent imports
# neither orepa nor torch (seconds of a process start, nothing the signal depends on) and starts its child at once
PARENT_OF_A_RUN = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-m", "orepa", *sys.argv[2:]],
                         env={**os.environ, sys.argv[1]: str(os.getpid())})
print(child.pid, flush=True)
child.wait()
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.slow  # three processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_demo_command_whose_parent_is_killed_stops_with_a_checkpoint(cache, tmp_path):
    """A command started as orepa demo starts its runs, whose parent then dies of SIGKILL (nothing
    passes a stop on): the run gets SIGTERM, ends its step with a checkpoint and frees its output
    directory, instead of training on as an orphan. Started after its parent died, it ends at once."""
    out = tmp_path / "run"
    argv = ["train", *TINY, *PLAIN, "--train-subset", "20000", "--epochs", "1", "--cache-dir", cache, "--output-dir",
            str(out)]
    parent = subprocess.Popen([sys.executable, "-c", PARENT_OF_A_RUN, STOP_WITH_PARENT_ENV, *argv], env=child_env(),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        deadline, step = time.monotonic() + 180, 0
        while step < 1 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
            try:
                step = json.loads((out / "progress.json").read_text())["global_step"]
            except (OSError, ValueError, KeyError):
                pass
        assert step >= 1 and parent.poll() is None, step
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 120
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(child)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_signal"] == "SIGTERM" and summary["global_step"] >= 1
    assert _load(out / "checkpoint.pth")["global_step"] == summary["global_step"]
    assert not (out / RUN_LOCK).exists()
    # the parent named is not this process's (it died before the signal was armed): ended at once
    late = subprocess.run([sys.executable, "-m", "orepa", "eval", "--help"], capture_output=True, timeout=120,
                          env=child_env(OREPA_STOP_WITH_PARENT="1"))
    assert late.returncode == -signal.SIGTERM and not late.stdout


def test_resuming_a_complete_run_trains_and_rewrites_nothing(cache, tmp_path, capsys):
    """--resume of a run at its last epoch, or at the --max-steps given: says so and how to go on,
    exits 0, and leaves every file as it was (it rewrote summary.json without the validation
    figures, train time 0)."""
    out, ckpt = tmp_path / "run", str(tmp_path / "run" / "checkpoint.pth")

    def files():
        return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}

    resume = ["train", "--resume", ckpt, "--no-progress", "--threads", "1"]
    assert main(["train", *TINY, *PLAIN, "--epochs", "1", "--max-steps", "2", "--cache-dir", cache, "--output-dir",
                 str(out)]) == 0
    for argv, said in (([*resume, "--max-steps", "2"], f"{ckpt} is at step 2, the --max-steps 2 given: nothing to "
                                                        "train; a higher --max-steps, or none, continues the run"),
                       (resume, None),  # the rest of the epoch
                       (resume, f"{ckpt} ends a complete run (1/1 epochs, 4 steps): nothing to train; --epochs N "
                                "above 1 continues it")):
        before = files()
        capsys.readouterr()
        assert main(argv) == 0
        if said is not None:
            printed = capsys.readouterr().out
            assert said in printed and "train time" in printed, printed
            assert files() == before
    (out / "summary.json").unlink()  # gone: rebuilt from the checkpoint's history, the run untouched
    # (and a temporary file of a write killed after the last checkpoint goes: no later write would take it)
    host = __import__("orepa.apps.checkpoint", fromlist=["_host"])._host()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = out / f".curves.png.{host}-{int(gone.stdout)}.x1y2.tmp"
    stale.write_bytes(b"")
    assert main(resume) == 0
    rebuilt = json.loads((out / "summary.json").read_text())
    assert rebuilt["epochs_done"] == 1 and rebuilt["train_time_s"] > 0 and not stale.exists()
    assert main([*resume, "--epochs", "2", "--quiet"]) == 0  # a longer run goes on
    assert json.loads((out / "summary.json").read_text())["epochs_done"] == 2


@pytest.mark.parametrize("when,stage", [("train", "train"), ("reparam", "reparam + test"), ("between", "reparam + test")])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_to_an_in_process_demo_is_named_and_stops_it(when, stage, sig, tmp_path, capsys, monkeypatch):
    """--in-process: a SIGTERM (a scheduler's) or SIGUSR1 (SLURM's warning) that arrives outside
    train's own handler, in a command or between two, is reported as itself with its exit code;
    that pipeline is stopped in its stage and the next is not started."""
    import shlex

    from orepa.apps import demo, reparam

    def stop(*_):
        os.kill(os.getpid(), sig)
        time.sleep(0.5)  # the handler runs here
        return 0

    class Join:  # the command line the log records: between the two stages
        @staticmethod
        def join(cmd):
            if when == "between" and "reparam" in cmd and cmd[0] != "orepa":  # not the commands printed first
                stop()
            return shlex.join(cmd)

    monkeypatch.setattr(demo, "prepare_fashion_mnist", lambda d: None)
    monkeypatch.setattr(demo, "shlex", Join)
    monkeypatch.setattr(train, "run", stop if when == "train" else lambda a: 0)
    monkeypatch.setattr(reparam, "run", stop if when == "reparam" else lambda a: 0)
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    rc = main(["demo", "--in-process", "--methods", "base,orepa", "--output-dir", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 128 + sig, err
    assert f"base: stopped in stage {stage!r} ({sig.name})" in err and "orepa: stopped before it started" in err, err
    assert "failed" not in err and "Traceback" not in err
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


DEMO_CHILD = """
import signal, sys, time
from pathlib import Path
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append(1))
Path(sys.argv[1] + ".started").touch()
while not got:
    time.sleep(0.05)
deadline = time.monotonic() + 60  # the end of its step: not before the demo got its second signal
while not Path(sys.argv[1]).with_name("second.sent").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
Path(sys.argv[1] + ".stopped").touch()
sys.exit(143)
"""


def test_a_second_sigterm_lets_the_demo_wait_for_its_runs(tmp_path, capsys, monkeypatch):
    """The demo passes a SIGTERM on to its runs and waits for them; a second one (a scheduler's
    repeat, a second SIGUSR1) neither ends the demo early nor orphans them."""
    import threading

    from orepa.apps import demo

    def commands(args, method, out, threads):
        return [[sys.executable, "-c", DEMO_CHILD, str(tmp_path / method)], ["false"]]

    def signal_twice():
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{m}.started").exists() for m in ("base", "orepa")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGUSR1)
        (tmp_path / "second.sent").touch()  # the runs end their step only now: the demo is still waiting

    monkeypatch.setattr(demo, "prepare_fashion_mnist", lambda d: None)
    monkeypatch.setattr(demo, "_commands", commands)
    sender = threading.Thread(target=signal_twice, daemon=True)
    sender.start()
    rc = main(["demo", "--methods", "base,orepa", "--jobs", "2", "--output-dir", str(tmp_path / "out"),
               "--no-progress"])
    sender.join()
    err = capsys.readouterr().err
    assert rc == 143, err
    for m in ("base", "orepa"):
        assert (tmp_path / f"{m}.stopped").exists()  # the demo waited for it
        assert f"{m}: stopped in stage 'train' (SIGTERM)" in err, err
    assert "Traceback" not in err


class Hostile:
    """Unpickling this runs code: ``exec`` writes a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


def test_a_checkpoint_this_user_may_not_read_is_said_so_not_called_corrupt(tmp_path, capsys, monkeypatch):
    """A checkpoint without read permission was 'corrupt, truncated or not a PyTorch checkpoint
    (PermissionError ...)'. (Root reads any file: the refusal is made by a stand-in open.)"""
    from orepa.apps import checkpoint as ckpt_io

    path = tmp_path / "theirs.pth"
    torch.save({"w": torch.zeros(1)}, path)

    def refused(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(ckpt_io, "open", refused, raising=False)
    assert main(["eval", str(path)]) == 2
    assert capsys.readouterr().err == f"orepa eval: error: checkpoint {path} cannot be read (Permission denied)\n"


@pytest.mark.parametrize("argv", [["eval", "{}"], ["reparam", "{}"], ["train", "--resume", "{}", "--epochs", "1"],
                                  ["train", "--init-from", "{}", "--epochs", "1"], ["export", "{}"], ["analyze", "{}"]])
def test_a_hostile_pickle_never_runs(tmp_path, capsys, argv):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pth"
    torch.save({"model": {"w": torch.zeros(1)}, "payload": Hostile(marker)}, path)
    with pytest.raises(Exception):  # noqa: B017 - the unsafe load that would run it, for contrast
        torch.load(path, weights_only=True)
    assert not marker.exists()
    capsys.readouterr()
    assert main([a.replace("{}", str(path)) for a in argv] + ["--output-dir", str(tmp_path / "o")] * (
        argv[0] in ("train", "analyze"))) == 2
    err = capsys.readouterr().err
    assert "holds Python objects (exec)" in err and "run code" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not marker.exists()


def _png_tree(root: Path, corrupt: bool = False):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(4):
                arr = torch.randint(0, 255, (36, 36, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(arr).save(d / f"{i}.png")
    if corrupt:
        (root / "train" / "dog" / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")


@pytest.mark.slow  # a subprocess
def test_a_corrupt_image_read_by_loader_workers_ends_the_process(tmp_path):
    """The error line, then the exit: the workers (which drop a scheduler's SIGTERM) still end
    when their parent stops them (the process used to wait for them forever after the error)."""
    imgs = tmp_path / "imgs"
    _png_tree(imgs, corrupt=True)
    argv = ["train", "--data-path", str(imgs), "--model", "resnet18", *PLAIN, "--width-mult", "0.0625", "-b", "2",
            "--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32", "--no-progress",
            "-j", "2", "--threads", "1", "--no-tensorboard", "--no-curves", "--output-dir", str(tmp_path / "run")]
    proc = subprocess.run([sys.executable, "-m", "orepa", *argv], env=child_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "cannot read image " + str(imgs / "train" / "dog") in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
    ({"WORLD_SIZE": "abc", "RANK": "0"}, "WORLD_SIZE='abc' in the environment is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 in the environment: a run has at least one process"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR and MASTER_PORT not set"),
    # rank 3 of 2 waited for peers without end
    ({"WORLD_SIZE": "2", "RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"},
     "RANK=3, LOCAL_RANK=0 in the environment: a rank is in [0, WORLD_SIZE=2)"),
])
def test_a_wrong_torchrun_environment_is_one_line(env, message, tmp_path, capsys, monkeypatch):
    """Was a KeyError / ValueError traceback, or a process waiting forever for peers."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["eval", str(tmp_path / "x.pth")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_one_process_commands_refuse_torchrun(tmp_path, capsys, monkeypatch):
    """analyze, export, reparam, import-reference, bench and demo under torchrun: each process wrote the
    same files (analyze and reparam waited for peers when started alone with a WORLD_SIZE; reparam
    refused only after them; import-reference and bench wrote, the demo started its pipelines)."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(key, value)
    for argv in (["analyze", "resnet18", "--width-mult", "0.0625", "--output-dir", str(tmp_path / "a")],
                 ["export", "--model", "resnet18", "-o", str(tmp_path / "m.onnx")],
                 ["reparam", str(tmp_path / "x.pth")],
                 ["import-reference", str(tmp_path / "x.pth"), "-o", str(tmp_path / "i.pth")],
                 ["bench", "-m", "resnet18", "--methods", "base", "--output-dir", str(tmp_path / "b")],
                 ["demo", "--output-dir", str(tmp_path / "d")]):
        assert main(argv) == 2
        assert f"orepa {argv[0]} runs in one process (WORLD_SIZE=2 in the environment)" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in ("a", "b", "d"))


def _each_exits_2_with_one_line(cases, ckpt, capsys) -> None:
    """Each ``(argv, message)`` case exits 2 with one line on stderr holding ``message``, as does
    a deployment into /proc where there is one."""
    if Path("/proc/self").is_dir():  # procfs takes no new files, though os.access says yes to root
        cases = [*cases, (["reparam", str(ckpt), "-o", "/proc/orepa-deployed.pth"], "cannot create files in /proc")]
    for argv, msg in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)


def test_every_bad_input_exits_2_with_one_line(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (where a default output would go)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--epochs", "1", "--cache-dir", cache, "--output-dir", str(run), "--method",
                 "base"]) == 0
    ckpt = run / "checkpoint.pth"
    rgb = tmp_path / "rgb.pth"
    torch.save(train.build_model({"model": "resnet18", "method": "base", "num_classes": 10, "in_chans": 3,
                                  "small_input": True, "width_mult": 0.0625, "options": {}}).state_dict(), rgb)
    imgs = tmp_path / "imgs"
    _png_tree(imgs, corrupt=True)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(os.urandom(4096))
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    # a checkpoint changed in the middle after it was written (torch's zip reader checks no CRC: it
    # evaluated such a file at loss nan, exit 0)
    damaged = tmp_path / "damaged.pth"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2:len(data) // 2 + 5000] = os.urandom(5000)
    damaged.write_bytes(bytes(data))
    deployed = tmp_path / "deployed.pth"
    bench_result = tmp_path / "resnet18_b2_16_cpu.json"  # (what orepa bench writes, in short)
    bench_result.write_text(json.dumps({"variants": ["base"], "rows": [{"name": "base", "step_ms": 3.1}]}))
    copied_summary = tmp_path / "run-summary.json"
    copied_summary.write_text((run / "summary.json").read_text())
    eval_report = tmp_path / "eval.json"
    eval_report.write_text(json.dumps({"report": "eval", "checkpoint": str(ckpt), "acc1": 80.0}))
    text = tmp_path / "notes.pth"  # torch said "KeyError: 101" of a text file
    text.write_text("epoch 3: top-1 0.91\nepoch 4: top-1 0.92\n")
    hollow_dict = tmp_path / "hollow.pth"
    torch.save({}, hollow_dict)
    new = ["train", *TINY, "--cache-dir", cache]
    external = ["train", "--model", "torchvision:resnet18", "--no-progress", "--cache-dir", cache]
    cases = [
        (["train", "-b", "0"], "argument -b/--batch-size: must be a positive integer, got 0"),
        # into a run's directory a misspelt preset was reported as "already holds a run ... --overwrite"
        ([*new, "--method", "orepa", "--preset", "onlin-only", "--output-dir", str(run)],
         "argument --preset: invalid choice: 'onlin-only' (choose from 'deep-stem', "),
        (["train", "-b", "-4"], "argument -b/--batch-size: must be a positive integer, got -4"),
        (["train", "--lr", "-0.1"], "argument --lr: must be a positive number, got -0.1"),
        (["train", "--epochs", "0"], "argument --epochs: must be a positive integer, got 0"),
        (["train", "--label-smoothing", "2"], "argument --label-smoothing: must be a number in [0, 1], got 2"),
        (["train", "--model-ema-decay", "1.5"], "argument --model-ema-decay: must be a number in [0, 1), got 1.5"),
        (["train", "--model-ema-decay", "1"], "argument --model-ema-decay: must be a number in [0, 1), got 1"),
        (["train", "--momentum", "1.5"], "argument --momentum: must be a number in [0, 1), got 1.5"),
        (["train", "--lr-warmup-decay", "2"], "argument --lr-warmup-decay: must be a number in [0, 1], got 2"),
        (["train", "--seed", str(2**64)], "argument --seed: must be an integer in [0, 2**32 - 1]"),
        (["demo", "--seed", "-1"], "argument --seed: must be an integer in [0, 2**32 - 1], got -1"),
        # 5,000 threads on 2 cores evaluated 100x slower per batch, without a word
        (["eval", str(ckpt), "--threads", "100000"], "argument --threads: must be a positive integer up to "),
        (["demo", "--threads", "100000"], "argument --threads: must be a positive integer up to "),
        ([*new, "--dataset", "fashion-mnist", "--data-path", str(imgs), "--output-dir", str(tmp_path / "d")],
         f"--dataset fashion-mnist reads the Debian package's files (or those in $OREPA_FASHION_MNIST_DIR), "
         f"not --data-path {imgs}"),
        ([*new, "--num-classes", "5", "--output-dir", str(tmp_path / "n")],
         "--num-classes 5 is fewer than the 10 classes of fashion-mnist"),
        # the class count as a block option went past the check: an IndexError in the first step's loss
        ([*new, "--model-option", "num_classes=5", "--output-dir", str(tmp_path / "n")],
         "--model-option num_classes=5 is fewer than the 10 classes of fashion-mnist"),
        # a constructor keyword orepa passes itself: a TypeError traceback
        ([*external, "--model-kwarg", "num_classes=10", "--output-dir",
          str(tmp_path / "k")], "--model-kwarg num_classes=: orepa passes it to the constructor itself; give it "
                                "as --num-classes"),
        (["export", "--model", "torchvision:resnet18", "--model-kwarg", "in_chans=3"], "give it as --in-chans"),
        (["export", "--model", "torchvision:resnet18", "--model-kwarg", "weights=DEFAULT"], "no weights are fetched"),
        # a constructor that checks its keywords with assert: a traceback
        (["export", "--model", "timm:resnet10t", "--model-kwarg", "global_pool=bogus"],
         "cannot build model 'timm:resnet10t' (with --model-kwarg global_pool='bogus'): "),
        # timm takes any drop rate and fails in the first training step (a negative keep probability)
        ([*external, "--model-kwarg", "drop_path_rate=5", "--output-dir",
          str(tmp_path / "k")], "--model-kwarg drop_path_rate=5 for torchvision:resnet18: a drop probability, "
                                "0 <= drop_path_rate < 1"),
        # a cosine "floor" above the peak raised the learning rate over the run
        ([*new, "--lr", "0.1", "--lr-min", "0.5", "--output-dir", str(tmp_path / "l")],
         "--lr-min 0.5 is above the peak --lr 0.1: the cosine schedule would raise the learning rate"),
        ([*new, "--pad-crop", "28", "--output-dir", str(tmp_path / "p")],
         "--pad-crop 28: the padding must be smaller than Fashion-MNIST's 28-pixel images"),
        (["export", "--model", "resnet18", "--input-size", "0"], "argument --input-size: must be a positive integer"),
        ([*new, "--branches", "kxk,nope", "--output-dir", str(tmp_path / "b")], "unknown branch name(s) ['nope']"),
        ([*new, "--branches", " , ", "--output-dir", str(tmp_path / "b")], "--branches ' , ' names no branch"),
        (["analyze", str(ckpt), "--branches", ""], "--branches '' names no branch"),
        (["train", "--data-path", str(imgs), "--model", "resnet18", "--width-mult", "0.0625", "-b", "4",
          "--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32", "--no-progress", "-j", "1",
          "--no-tensorboard", "--no-curves", "--output-dir", str(tmp_path / "c")],
         "cannot read image " + str(imgs / "train" / "dog")),
        # the training set's flags: eval and reparam read the validation set only (they took and ignored them)
        (["eval", str(ckpt), "--train-subset", "5"], "unrecognized arguments: --train-subset 5 (see orepa eval --help)"),
        (["reparam", str(ckpt), "--pad-crop", "3"], "unrecognized arguments: --pad-crop 3 (see orepa reparam --help)"),
        (["eval", str(ckpt), "--data-path", str(imgs), "--val-resize-size", "32", "--val-crop-size", "40"],
         "--val-crop-size 40 is larger than --val-resize-size 32: the validation crop would take black borders"),
        (["analyze", str(ckpt)], "has no re-param block"),
        (["eval", str(rgb), "--method", "base", "--width-mult", "0.0625", "--in-chans", "3", "--val-subset", "16",
          "--no-progress", "--cache-dir", cache], "takes 3-channel images but fashion-mnist has 1 channel"),
        (["eval", str(garbage)], "is corrupt, truncated or not a PyTorch checkpoint"),
        (["eval", str(text)], f"checkpoint {text} is a text file, not a PyTorch checkpoint"),
        # a JSON report given as the checkpoint: torch's unpickler fails first ("does not unpickle")
        (["eval", str(run / "summary.json")], f"checkpoint {run / 'summary.json'} is a text file"),
        (["eval", str(hollow_dict)], "holds no state_dict: expected a dict of tensors, or one under 'model' / "
                                     "'state_dict' / 'model_state_dict' / 'model_state' / 'module' (it holds an "
                                     "empty dict)"),
        (["export", str(garbage)], "is corrupt, truncated or not a PyTorch checkpoint"),
        (["train", *TINY, "--epochs", "1", "--cache-dir", cache, "--output-dir", str(run)], "already holds a run"),
        (["reparam", str(ckpt), "-o", str(ckpt)], "is the input checkpoint"),
        # the verification's flags beside --no-verify were taken and ignored (a deployment written, exit 0)
        (["reparam", str(ckpt), "-o", str(tmp_path / "nv.pth"), "--no-verify", "--rtol", "0.5", "-b", "4"],
         "--no-verify skips the verification on data; -b/--batch-size, --rtol do(es) not apply then"),
        # both pipelines started, each failed in train: two blocks of log tails, exit 1
        (["demo", "--device", "bogus", "--output-dir", str(tmp_path / "demo"), "--cache-dir", cache],
         "--device 'bogus': expected cpu, cuda or cuda:N"),
        (["demo", "--output-dir", str(run), "--cache-dir", cache],
         f"--output-dir {run} holds a training run (checkpoint.pth, summary.json"),
        (["eval", str(damaged)], "fails its CRC check"),
        (["export", str(damaged)], "fails its CRC check"),
        # a --json report may not replace the input, the output or any checkpoint
        (["eval", str(ckpt), "--json", str(ckpt)], "--json " + str(ckpt) + " is the input checkpoint"),
        (["reparam", str(ckpt), "-o", str(deployed), "--json", str(ckpt)], "is the input checkpoint"),
        (["reparam", str(ckpt), "-o", str(deployed), "--json", str(deployed)], "is --output"),
        (["eval", str(rgb), "--json", str(ckpt)], "is a checkpoint (a zip archive), not a report"),
        # nor anything else but a report (an exported model or a run's own file, replaced at a slip)
        (["eval", str(ckpt), "--json", str(garbage)], f"--json {garbage} is a file that is no JSON report, not a report"),
        (["eval", str(ckpt), "--json", str(run / "summary.json")],
         f"--json {run / 'summary.json'} is a file of the training run in {run}, not a report to replace"),
        # an atomic write renames over its target: a device node (as root) would be replaced by a file
        # (a pipe of the test's own, not /dev/null: a regression of the check would rename over it, as root too)
        (["reparam", str(ckpt), "-o", str(pipe), "--overwrite"], f"--output {pipe} is not a regular file"),
        # another command's results (a benchmark's), or another command's report: replaced without a word
        (["eval", str(ckpt), "--json", str(bench_result)],
         f"--json {bench_result} is a JSON file that is no report of orepa eval (another command's results?)"),
        (["reparam", str(ckpt), "-o", str(deployed), "--json", str(eval_report)],
         f"--json {eval_report} is the report of orepa eval, not a report to replace"),
        # a run's summary copied away from its run (it names a checkpoint, as reports did before their mark)
        (["eval", str(ckpt), "--json", str(copied_summary)],
         f"--json {copied_summary} is a JSON file that is no report of orepa eval"),
        # a directory's name (a final "/"): written as a file of that name
        (["reparam", str(ckpt), "-o", f"{tmp_path / 'newdir'}/", "--no-verify"], "ends with '/', a directory's name"),
        (["export", str(ckpt), "-o", f"{tmp_path / 'exdir'}/"], "ends with '/', a directory's name"),
        (["eval", str(ckpt), "--json", f"{tmp_path / 'jdir'}/"], "ends with '/', a directory's name"),
        (["import-reference", str(ckpt), "-o", f"{tmp_path / 'idir'}/"], "ends with '/', a directory's name"),
        # flags that another setting leaves nothing to do: each was taken, and the run did without it
        ([*new, "--amp-dtype", "float16"], "mixed precision is off (no --amp); --amp-dtype do(es) not apply then"),
        (["eval", str(ckpt), "--amp-dtype", "bfloat16"],
         "mixed precision is off (no --amp); --amp-dtype do(es) not apply then"),
        ([*new, "--model-ema-steps", "3", "--model-ema-decay", "0.9"], "the run keeps no EMA (no --model-ema); "
         "--model-ema-decay, --model-ema-steps do(es) not apply then"),
        ([*new, "--lr-step-size", "3"], "--lr-scheduler cosineannealinglr does not decay in steps (steplr does); "
         "--lr-step-size do(es) not apply then"),
        ([*new, "--lr-scheduler", "constant", "--lr-min", "0.001"],
         "--lr-scheduler constant has no floor (cosine's has); --lr-min do(es) not apply then"),
        ([*new, "--lr-warmup-epochs", "0", "--lr-warmup-decay", "0.5"],
         "the run has no warm-up (--lr-warmup-epochs 0); --lr-warmup-decay do(es) not apply then"),
        (["train", "--resume", str(ckpt), "--overwrite", "--cache-dir", cache],
         f"--resume continues the run in {run}, which it does not replace; --overwrite do(es) not apply then"),
        # a small-input stem is a 3x3 block: the deep stem (a 7x7 stem's) was dropped without a word
        ([*new, "--method", "orepa", "--deep-stem", "--output-dir", str(tmp_path / "ds")],
         "--deep-stem replaces a 7x7 stem conv by a linear deep stem, and the small-input stem (--small-input, "
         "the default for Fashion-MNIST's 28x28 images) is a 3x3 conv"),
        (["export", str(ckpt), "--format", "torchscript", "-o", str(tmp_path / "ts.onnx")],
         f"--output {tmp_path / 'ts.onnx'} is named as an ONNX model, and --format torchscript writes a TorchScript "
         "module: give --format onnx, or another name"),
        (["export", str(ckpt), "--format", "exported-program", "-o", str(tmp_path / "ep.pt")],
         f"--output {tmp_path / 'ep.pt'} is named as a TorchScript module, and --format exported-program writes an "
         "ExportedProgram (torch.export): give --format torchscript, or another name"),
        # an empty path (an unset shell variable): the current directory ("error: . is not a file"), the
        # flag's default, or nothing written without a word
        (["eval", ""], "argument checkpoint: '' names no file or directory; give a path"),
        (["eval", str(ckpt), "--json", ""], "argument --json: '' names no file or directory"),
        ([*new, "--epochs", "1", "--output-dir", ""], "argument --output-dir: '' names no file or directory"),
        ([*new, "--epochs", "1", "--resume", ""], "argument --resume: '' names no file or directory"),
        # a new run's input channels are the data's: a model for other images said as such (was torch's conv error)
        ([*new, "--in-chans", "3", "--output-dir", str(tmp_path / "rgb")],
         "--in-chans 3: the images of fashion-mnist have 1 channel(s), which a new run's model takes: leave it out"),
        # a run directory given for its checkpoint: the file named
        ([*new, "--resume", str(run), "--output-dir", str(tmp_path / "r2")],
         f"{run} is not a file (a run directory: its checkpoint is {ckpt})"),
        ([*new, "--init-from", " ", "--output-dir", str(tmp_path / "e")], "argument --init-from: ' ' names no file"),
        (["analyze", ""], "argument target: '' names no file or directory"),
        (["analyze", str(ckpt), "--output-dir", ""], "argument --output-dir/--out-dir: '' names no file"),
        (["import-reference", "", "-o", str(tmp_path / "i.pth")], "argument checkpoint: '' names no file"),
        (["import-reference", str(ckpt), "-o", ""], "argument -o/--output: '' names no file or directory"),
        (["reparam", str(ckpt), "-o", ""], "argument -o/--output: '' names no file"),
        (["reparam", str(ckpt), "--json", ""], "argument --json: '' names no file"),
        (["export", str(ckpt), "-o", "", "--no-verify"], "argument -o/--output: '' names no file"),
        (["demo", "--output-dir", ""], "argument --output-dir: '' names no file"),
        ([*new, "--epochs", "1", "--cache-dir", "", "--output-dir", str(tmp_path / "e")],
         "argument --cache-dir: '' names no file"),
        ([*new, "--epochs", "1", "--data-path", " ", "--output-dir", str(tmp_path / "e")],
         "argument --data-path: ' ' names no file"),
        # the zoo's own options on another library's network: "found nothing to convert ... unexpected keyword"
        *(([*external, *flags, "--output-dir", str(tmp_path / "z")],
           f"{said}: options of the zoo's models, not of torchvision:resnet18")
          for flags, said in ((["--deep-stem"], "deep_stem=True"), (["--no-post-bn"], "post_bn=False"),
                              (["--no-dw-sep"], "dw_sep=False"), (["--preset", "online-only"], "preset=online-only"),
                              (["--model-option", "stem_width=16"], "stem_width=16"),
                              (["--model-option", "zero_init_residual=true"], "zero_init_residual=True"))),
        ([*external, "--no-freq-prior", "--output-dir", str(tmp_path / "z")],
         "freq_prior=False: options of the zoo's models, not of torchvision:resnet18 (name its blocks' branches "
         "instead: --branches kxk,1x1,1x1_avg,1x1_kxk,dw_pw)"),
        ([*external, "--model-option", "bogus=1", "--output-dir", str(tmp_path / "z")],
         "bogus=1): option(s) ['bogus'] not accepted by convert(method='orepa'); accepted: ['branch_norm', "),
        ([*external, "--model-option", "init=foo", "--output-dir", str(tmp_path / "z")],
         "init=foo): init must be one of ('reference', 'torch') or a non-negative kaiming slope, got 'foo'"),
        ([*external, "--method", "dbb", "--branches", "kxk", "--output-dir", str(tmp_path / "z")],
         "option(s) ['branches'] not accepted by convert(method='dbb'); accepted: ['internal_channels']"),
    ]
    odd = tmp_path / "odd"  # val/ names another class than train/
    _png_tree(odd)
    (odd / "val" / "dog").rename(odd / "val" / "bird")
    cases.append((["train", "--data-path", str(odd), "--output-dir", str(tmp_path / "o")],
                  f"--data-path {odd}: train/ and val/ have different class folders (only in train/: dog; "
                  "only in val/: bird)"))
    hollow = tmp_path / "hollow"  # a class folder of val/ without images: the split is named
    _png_tree(hollow)
    for f in (hollow / "val" / "dog").iterdir():
        f.unlink()
    cases.append((["train", "--data-path", str(hollow), "--output-dir", str(tmp_path / "h")],
                  f"--data-path {hollow}: val/: Found no valid file for the classes dog"))
    loop = tmp_path / "loop1.pth"  # a symbolic link loop, as an output and as an input
    loop.symlink_to(tmp_path / "loop2.pth")
    (tmp_path / "loop2.pth").symlink_to(loop)
    cases += [
        (["reparam", str(ckpt), "-o", str(loop)], f"--output {loop} is a symbolic link that leads back to itself"),
        (["eval", str(ckpt), "--json", str(loop)], f"--json {loop} is a symbolic link that leads back to itself"),
        (["reparam", str(loop)], f"checkpoint {loop} is a symbolic link to nothing"),
        (["import-reference", str(ckpt), "-o", str(tmp_path / "i.pth"), "--device", "mps"],
         "--device mps: orepa runs on cpu or cuda, not mps"),
        (["eval", str(ckpt), "--device", "cpu:1"], "--device cpu:1: the CPU is one device (cpu)"),
        (["eval", str(ckpt), "--bogus"], "orepa eval: error: unrecognized arguments: --bogus (see orepa eval --help)"),
        (["import-reference", str(ckpt), "-o", str(tmp_path / "i.pth"), "--rtol", "-1"],
         "argument --rtol: must be a positive number, got -1"),
        (["eval", str(ckpt), "-j", "100000", "--val-subset", "16"], "-j/--workers 100000: more loader processes"),
    ]
    before = ckpt.read_bytes()
    _each_exits_2_with_one_line(cases, ckpt, capsys)
    assert ckpt.read_bytes() == before and not deployed.exists()  # nothing replaced, nothing written
    assert json.loads(bench_result.read_text())["variants"] == ["base"] and json.loads(eval_report.read_text())["acc1"]
    assert copied_summary.read_text() == (run / "summary.json").read_text()
    assert not any((tmp_path / made).exists() for made in ("newdir", "exdir", "jdir", "idir", "z", "e", "runs"))
    # the same through a real process: exit status 2, one line on stderr; and a plain pickle: one
    # line, not torch's warning about its protocol first (pytest hides warnings in-process). The two
    # processes run at once (each spends seconds importing torch)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"weights": [1.0, 2.0]}, protocol=4))
    procs = [subprocess.Popen([sys.executable, "-m", "orepa", *argv], env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv in (["train", "-b", "-4"], ["eval", str(plain)])]
    (_, bad_batch), (_, bad_pickle) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 2 and bad_batch.count("\n") == 1 and "batch-size" in bad_batch, bad_batch
    assert procs[1].returncode == 2 and bad_pickle.count("\n") == 1 and "not a PyTorch checkpoint" in bad_pickle, \
        bad_pickle


def test_divergence_keeps_a_finite_checkpoint(cache, tmp_path, capsys):
    """lr 1e3: the BN running variances overflow before the loss does. Nothing non-finite is ever
    saved (parameters, buffers, optimizer state are checked before every write)."""
    out = tmp_path / "run"
    capsys.readouterr()
    rc = main(["train", *TINY, "--epochs", "2", "--lr", "1e3", "--lr-warmup-epochs", "0", "--save-every", "1",
               "--cache-dir", cache, "--output-dir", str(out)])
    assert rc == train.EXIT_NONFINITE
    err = capsys.readouterr().err
    assert "became non-finite" in err and "the last good checkpoint is" in err and "--lr 100" in err
    ck = _load(out / "checkpoint.pth")
    tensors = [*ck["model"].values(), *(t for st in ck["optimizer"]["state"].values() for t in st.values())]
    assert all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
    assert ck["global_step"] >= 1


def test_the_guard_names_a_non_finite_buffer_and_optimizer_state():
    from torch import nn

    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1, 5, 5)).sum().backward()
    opt.step()
    assert train.first_nonfinite(model, opt) is None
    opt.state[model[0].weight]["momentum_buffer"][0] = float("inf")
    assert train.first_nonfinite(model, opt) == "optimizer momentum_buffer of 0.weight"
    model[1].running_var[1] = float("nan")
    assert train.first_nonfinite(model, opt) == "buffer 1.running_var"


def test_damaged_settings_and_unwritable_paths_exit_2_with_one_line(cache, reference, tmp_path, capsys):
    """Settings a command cannot use (a damaged checkpoint's fields, a device or model option that is
    not one) and outputs it cannot write are one ``error:`` line each, before any long computation,
    and nothing already written changes."""
    good = {**reference}

    def damaged(name, **fields):
        path = tmp_path / f"{name}.pth"
        torch.save({**good, **fields}, path)
        return str(path)

    cfg = dict(good["model_cfg"])
    no_method = {k: v for k, v in cfg.items() if k != "method"}
    bare = tmp_path / "bare.pth"
    torch.save(good["model"], bare)
    empty = tmp_path / "empty.pth"
    empty.write_bytes(b"")
    ckpt = tmp_path / "ckpt.pth"
    torch.save(good, ckpt)
    a_dir, a_file = tmp_path / "a_dir", tmp_path / "a_file"
    a_dir.mkdir()
    a_file.write_text("keep me")
    one_class = tmp_path / "one"
    for split in ("train", "val"):
        (one_class / split / "cat").mkdir(parents=True)
    from PIL import Image

    for split in ("train", "val"):
        Image.new("RGB", (8, 8)).save(one_class / split / "cat" / "0.png")
    new = ["train", "--epochs", "1", "--cache-dir", cache, "--output-dir", str(tmp_path / "new"), "--no-progress"]
    cases = [
        (["eval", damaged("cfg_str", model_cfg="resnet18")], "damaged model_cfg (a str, not a mapping)"),
        (["eval", damaged("cfg_no_method", model_cfg=no_method)], "damaged model_cfg (missing method)"),
        (["eval", damaged("cfg_width", model_cfg={**cfg, "width_mult": "abc"})],
         "damaged model_cfg: model setting width_mult='abc' is not a positive number"),
        (["eval", damaged("args_str", args="lr=0.1")], "damaged args (a str, not a mapping)"),
        (["train", "--resume", damaged("epoch_x", epoch="x"), "--epochs", "3"], "damaged epoch ('x', not a count)"),
        (["eval", str(ckpt), "--device", "tpu"], "--device 'tpu': expected cpu, cuda or cuda:N"),
        ([*new, "--model-option", "width_mult=abc"], "model setting width_mult='abc' is not a positive number"),
        ([*new, "--model-option", "small_input=maybe"], "model setting small_input='maybe' is not true or false"),
        ([*new, "--width-mult", "0.5", "--model-option", "width_mult=0.25"], "width_mult is given twice"),
        (["eval", str(empty)], "is an empty file"),
        (["reparam", str(bare), "--no-verify"], "is a bare state_dict; reparam needs an orepa training checkpoint"),
        # a bare state_dict records no model: eval/analyze/export ask for the flags instead of guessing resnet18
        *((([cmd, str(bare), "--cache-dir", cache] if cmd == "eval" else [cmd, str(bare)]),
           "is a bare state_dict (it records no model): pass --model") for cmd in ("eval", "analyze", "export")),
        (["reparam", str(ckpt), "-o", str(a_dir)], f"--output {a_dir} is a directory, not a file"),
        (["reparam", str(ckpt), "-o", str(a_file / "x.pth")], f"{a_file} is a file, not a directory"),
        (["eval", str(ckpt), "--json", str(a_dir), "--cache-dir", cache], f"--json {a_dir} is a directory"),
        (["analyze", str(ckpt), "--output-dir", str(a_file)], f"--output-dir {a_file} is a file, not a directory"),
        (["demo", "--methods", ",", "--cache-dir", cache], "--methods ',' names none"),
        (["demo", "--output-dir", str(a_file), "--cache-dir", cache], f"--output-dir {a_file} is a file"),
        (["import-reference", str(a_dir), "-o", str(tmp_path / "imp.pth")], f"{a_dir} is not a file"),
        (["train", "--data-path", str(one_class), "--model", "resnet18", "--width-mult", "0.0625", "-b", "1",
          "--no-progress", "--output-dir", str(tmp_path / "c")], "a classifier needs at least 2"),
    ]
    _each_exits_2_with_one_line(cases, ckpt, capsys)
    assert a_file.read_text() == "keep me" and not any(a_dir.iterdir())
    assert not (tmp_path / "imp.pth").exists() and not (tmp_path / "new").exists()


def test_a_failed_write_is_one_line_and_keeps_the_previous_file(tmp_path):
    """A full disk (or any refusal of the file system) while writing: a UserError naming the file,
    the previous file unchanged and no temporary file left; a bug in the writer is not disguised."""
    import errno

    from orepa.apps import checkpoint as ck
    from orepa.apps.common import UserError

    path = tmp_path / "checkpoint.pth"
    path.write_bytes(b"previous")

    def full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def zip_writer_full(f):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    for write, msg in ((full, "No space left on device"), (zip_writer_full, "torch's writer failed (")):
        with pytest.raises(UserError, match=f"cannot write {path}") as err:
            ck.atomic_write(path, write)
        assert msg in str(err.value) and "inline_container" not in str(err.value)
        assert path.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    with pytest.raises(RuntimeError, match="a bug"):
        ck.atomic_write(path, lambda f: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(UserError, match="cannot write"), ck.atomic_path(tmp_path / "x" / "y.onnx") as tmp:
        raise OSError(errno.EACCES, "Permission denied", str(tmp))
    assert path.read_bytes() == b"previous"
    # the directories made for a write that failed (an export whose verification failed) go again
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="verification"), ck.atomic_path(tmp_path / "new" / "sub" / "m.onnx"):
        raise ValueError("verification failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    with ck.atomic_path(tmp_path / "kept" / "m.onnx") as tmp:  # a write that succeeds keeps them
        tmp.write_bytes(b"onnx")
    assert (tmp_path / "kept" / "m.onnx").read_bytes() == b"onnx"


def test_a_checkpoint_the_file_system_refuses_names_the_refusal(tmp_path):
    """torch's zip writer turns the file system's refusal of a write into its own RuntimeError ("unexpected
    pos 64 vs 0"), with the OSError as its context: a quota exceeded, or a file-size limit (`ulimit -f`, FAT32),
    was said as "torch's writer failed (71.5 GiB free there)", a disk with room. The refusal is named."""
    import errno

    from orepa.apps import checkpoint as ck
    from orepa.apps.common import UserError

    path = tmp_path / "checkpoint.pth"
    path.write_bytes(b"previous")
    for code in (errno.EDQUOT, errno.EFBIG, errno.ENOSPC):
        class Refusing(io.RawIOBase):  # the file: its first records written, then refused
            def __init__(self, f):
                self.f, self.n = f, 0

            def writable(self):
                return True

            def write(self, b, code=code):
                self.n += 1
                if self.n > 3:
                    raise OSError(code, os.strerror(code))
                return self.f.write(b)

        def save(f):
            torch.save({"w": torch.zeros(1000)}, Refusing(f))

        with pytest.raises(UserError, match=f"cannot write {path}") as err:
            ck.atomic_write(path, save)
        assert os.strerror(code) in str(err.value) and "writer failed" not in str(err.value), str(err.value)
        assert path.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_ctrl_c_during_training_is_one_line_with_the_checkpoint_to_resume(cache, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", *TINY, *PLAIN, "--epochs", "1", "--cache-dir", cache, "--output-dir", str(out)]) == 0

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(train.Trainer, "fit", interrupted)
    capsys.readouterr()
    assert main(["train", "--resume", str(out / "checkpoint.pth"), "--epochs", "2", "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err == f"orepa train: interrupted; continue from the last checkpoint with --resume {out / 'checkpoint.pth'}\n"


def test_the_form_of_an_existing_output_is_read_from_its_metadata(tmp_path):
    """What reparam and export check before writing over a file: its tensors are mapped, not read,
    so a damaged tensor does not hide a checkpoint; torch's legacy format is read whole."""
    from orepa.apps.checkpoint import checkpoint_form, load_checkpoint
    from orepa.apps.common import UserError

    sd = {"w": torch.full((4096,), 7.0)}
    deployed = tmp_path / "deployed.pth"
    torch.save({"format": "orepa-checkpoint", "version": 1, "form": "deploy", "model": sd}, deployed)
    assert checkpoint_form(deployed) == "deploy"
    data = bytearray(deployed.read_bytes())
    at = data.index(torch.full((64,), 7.0).numpy().tobytes())
    data[at:at + 256] = bytes(256)  # the tensor's bytes, not the pickled metadata
    deployed.write_bytes(bytes(data))
    with pytest.raises(UserError, match="fails its CRC check"):
        load_checkpoint(deployed)
    assert checkpoint_form(deployed) == "deploy"
    legacy = tmp_path / "legacy.pth"
    torch.save({"format": "orepa-checkpoint", "version": 1, "form": "train", "model": sd}, legacy,
               _use_new_zipfile_serialization=False)
    assert checkpoint_form(legacy) == "train"
    bare = tmp_path / "bare.pth"
    torch.save(sd, bare)
    assert checkpoint_form(bare) == "state_dict"
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    assert checkpoint_form(text) is None and checkpoint_form(tmp_path / "absent.pth") is None


def test_out_of_memory_is_one_line_with_what_to_change(cache, tmp_path, capsys, monkeypatch):
    """A batch too large for the device: one error line with torch's figures (not its allocator
    advice), where the run was, the checkpoint that is still good; exit code 2."""
    out = tmp_path / "run"
    assert main(["train", *TINY, *PLAIN, "--epochs", "1", "--cache-dir", cache, "--output-dir", str(out)]) == 0
    calls = {"n": 0}
    real_step = torch.optim.SGD.step

    def step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use. If "
                "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.SGD, "step", step)
    capsys.readouterr()
    assert main(["train", "--resume", str(out / "checkpoint.pth"), "--epochs", "2", "--no-progress"]) == 2
    ckpt = out / "checkpoint.pth"
    assert capsys.readouterr().err == (
        "orepa train: error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 1.02 GiB is free); at epoch 2, step 2, batch 16 per process in 1 "
        f"micro-batch(es); --resume {ckpt} --micro-batches N continues the run with each batch in N pieces (less "
        "memory, the same batch); a smaller -b or --amp needs less too\n")
    assert _load(ckpt)["global_step"] == 4  # the epoch's checkpoint, untouched
    monkeypatch.setattr(torch.optim.SGD, "step", real_step)  # as the message says: the run goes on
    assert main(["train", "--resume", str(ckpt), "--epochs", "2", "--micro-batches", "2", "--no-progress",
                 "--quiet"]) == 0
    assert _load(ckpt)["global_step"] == 8
    # any other command: the same clause, from the command line's one handler
    monkeypatch.setattr("orepa.apps.evaluate.evaluate", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                     "you tried to allocate 40000000000000 bytes. Error code 12 (Cannot allocate memory)")))
    assert main(["eval", str(ckpt), "--no-progress", "--cache-dir", cache, "--val-subset", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orepa eval: error: out of memory ([enforce fail at alloc_cpu.cpp:127] err == 0. "
                          "DefaultCPUAllocator: can't allocate memory: you tried to allocate 40000000000000 bytes. "
                          "Error code 12 (Cannot allocate memory)); a smaller batch (-b) needs less\n"), err


def test_an_image_over_pils_pixel_limit_is_named(tmp_path, monkeypatch):
    """PIL refuses images over twice its pixel limit (decompression bombs) with an error that is
    no OSError: still the one error naming the file."""
    from PIL import Image

    from orepa.apps import data

    _png_tree(tmp_path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 36 x 36 images are over 2 x 100 pixels
    path = tmp_path / "train" / "cat" / "0.png"
    with pytest.raises(data.UserError, match=f"cannot read image {path}: DecompressionBombError"):
        data.load_image(str(path))


def test_ctrl_c_in_a_command_says_interrupted(monkeypatch, capsys):
    from orepa.apps import reparam

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(reparam, "run", interrupted)
    assert main(["reparam", "x.pth"]) == 130
    assert capsys.readouterr().err == "orepa reparam: interrupted\n"


@pytest.mark.parametrize("command,hint", [("analyze", False), ("eval", True)])
def test_out_of_memory_names_the_batch_only_where_a_command_has_one(command, hint, monkeypatch, capsys):
    import importlib

    module = importlib.import_module(f"orepa.apps.{'evaluate' if command == 'eval' else command}")

    def out_of_memory(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1 GiB free.")

    monkeypatch.setattr(module, "run", out_of_memory)
    assert main([command, "x.pth"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"orepa {command}: error: out of memory (CUDA out of memory") and err.count("\n") == 1
    assert ("(-b)" in err) == hint, err


# --------------------------------------------------------------------------- a resumed run's data and settings

IMGS = ["--model", "resnet18", "--width-mult", "0.0625", "--train-crop-size", "32", "--val-resize-size", "32",
        "--val-crop-size", "32", "--no-eval", "--no-progress",
        "--no-tensorboard", "--no-curves", "-j", "0", "--threads", "1"]


def _one_error_line(argv, capsys) -> str:
    """``main(argv)`` exits 2 with one line on stderr, which is returned."""
    capsys.readouterr()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    return err


def test_a_subset_larger_than_the_set_takes_it_whole_and_says_so(tmp_path, capsys):
    """--train-subset / --val-subset above the set's size took the whole set without a word (a user
    who asked for 100,000 of Fashion-MNIST's 60,000 was not told): it still does (scripts ask for
    "all" so), with one note per flag, from train, eval and reparam alike; the set's own size is silent."""
    imgs, out = tmp_path / "imgs", tmp_path / "run"
    _png_tree(imgs)  # 8 training, 8 validation images

    def notes() -> list[str]:
        return [line for line in capsys.readouterr().out.splitlines() if "-subset" in line]

    capsys.readouterr()
    assert main(["train", "--data-path", str(imgs), *IMGS, "-b", "2", "--train-subset", "20", "--val-subset", "8",
                 "--epochs", "1", "--max-steps", "1", "--output-dir", str(out)]) == 0
    assert notes() == [f"note: --train-subset 20 is more than the 8 training images of {imgs}: all are used"]
    ckpt = out / "checkpoint.pth"
    assert main(["eval", str(ckpt), "--val-subset", "9", "--no-progress", "-j", "0"]) == 0
    assert notes() == [f"note: --val-subset 9 is more than the 8 validation images of {imgs}: all are used"]
    assert main(["reparam", str(ckpt), "-o", str(tmp_path / "deployed.pth"), "--val-subset", "100000",
                 "--no-progress", "-j", "0"]) == 0
    assert notes() == [f"note: --val-subset 100000 is more than the 8 validation images of {imgs}: all are used"]
    assert main(["eval", str(ckpt), "--val-subset", "8", "--no-progress", "-j", "0"]) == 0
    assert notes() == []


def test_a_resume_refuses_a_training_folder_of_another_size(tmp_path, capsys):
    """The same class folders with images added or removed: the epoch's order, and the position
    in it, would be those of other images (the run went on as if nothing had changed, or stopped
    at a step past the end of the now shorter epoch)."""
    imgs, out = tmp_path / "imgs", tmp_path / "run"
    _png_tree(imgs)  # 8 training images: 4 steps of 2 an epoch
    assert main(["train", "--data-path", str(imgs), *IMGS, *PLAIN, "-b", "2", "--epochs", "1", "--max-steps", "3",
                 "--output-dir", str(out)]) == 0
    ckpt = out / "checkpoint.pth"
    saved = _load(ckpt)
    assert saved["train_images"] == 8 and saved["step_in_epoch"] == 3
    resume = ["train", "--resume", str(ckpt), "--no-progress"]
    (imgs / "train" / "cat" / "4.png").write_bytes((imgs / "train" / "cat" / "0.png").read_bytes())
    before = ckpt.read_bytes()
    err = _one_error_line(resume, capsys)
    assert f"--resume {ckpt}: " in err and "has 9 training images, this run began with 8" in err, err
    assert "--init-from" in err and ckpt.read_bytes() == before
    # a checkpoint from before the count was recorded, whose training set shrank to 2 steps an epoch
    del saved["train_images"]
    torch.save(saved, ckpt)
    for f in ("cat/4.png", "cat/3.png", "cat/2.png", "dog/3.png", "dog/2.png"):
        (imgs / "train" / f).unlink()
    before = ckpt.read_bytes()
    err = _one_error_line(resume, capsys)
    assert "it stopped at step 3 of an epoch, but an epoch of" in err and "now has 2" in err, err
    assert ckpt.read_bytes() == before
    # a --train-subset run counts the folder's images, not the subset's: its seeded choice of 6 of 9
    # images would be another than of 6 of 8
    imgs, out = tmp_path / "imgs2", tmp_path / "run2"
    _png_tree(imgs)
    assert main(["train", "--data-path", str(imgs), *IMGS, *PLAIN, "-b", "2", "--train-subset", "6", "--epochs", "1",
                 "--max-steps", "1", "--output-dir", str(out)]) == 0
    assert _load(out / "checkpoint.pth")["train_images"] == 8
    (imgs / "train" / "cat" / "4.png").write_bytes((imgs / "train" / "cat" / "0.png").read_bytes())
    err = _one_error_line(["train", "--resume", str(out / "checkpoint.pth"), "--no-progress"], capsys)
    assert "has 9 training images, this run began with 8" in err, err


def test_a_relative_data_path_resumes_from_another_directory_given_its_place(tmp_path, capsys, monkeypatch):
    """A run started on --data-path imgs (relative), resumed from elsewhere with the folder's
    absolute path: the same classes and images, so the run goes on and the override is printed
    (the data path was fixed on resume: the run could not be continued from anywhere else)."""
    _png_tree(tmp_path / "imgs")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--data-path", "imgs", *IMGS, *PLAIN, "-b", "4", "--epochs", "1", "--output-dir", "run"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ckpt, imgs = str(tmp_path / "run" / "checkpoint.pth"), str(tmp_path / "imgs")
    capsys.readouterr()
    assert main(["train", "--resume", ckpt, "--epochs", "2", "--data-path", imgs, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"data_path 'imgs' -> {imgs!r}" in printed, printed
    assert _load(ckpt)["global_step"] == 4 and not any(elsewhere.iterdir())


def _damaged_copy(ckpt: dict, path: Path, **fields) -> str:
    """``ckpt`` with ``fields`` replaced, saved at ``path``."""
    torch.save({**ckpt, **fields}, path)
    return str(path)


def test_damaged_run_settings_and_states_of_a_checkpoint_are_one_line(reference, tmp_path, capsys):
    """A hand-edited or damaged checkpoint's run settings and states: one line naming the field,
    before any step, the file left as it was (a run setting no flag would make went into the run:
    a negative batch, a schedule of no name that trained on without one and exited 0; a state that
    is no mapping failed deep in load_state_dict with a traceback)."""
    d = tmp_path / "damaged"
    d.mkdir()
    saved = reference["args"]
    rng = dict(reference["rng"])
    rng["torch"] = torch.zeros(3, dtype=torch.uint8)

    def resume(name, **fields):
        return ["train", "--resume", _damaged_copy(reference, d / f"{name}.pth", **fields), "--no-progress"]

    cases = [
        (resume("batch", args={**saved, "batch_size": -3}), "damaged run setting batch_size"),
        (resume("batch", args={**saved, "batch_size": -3}), "start a new run from its weights with --init-from"),
        (resume("epochs", args={**saved, "epochs": "ten"}), "damaged run setting epochs"),
        (resume("option", args={**saved, "model_option": 5}), "damaged run setting model_option"),
        (resume("sched", args={**saved, "lr_scheduler": "bogus"}), "damaged run setting lr_scheduler"),
        (resume("no_args", args={}), "records no run settings"),
        (resume("opt", optimizer="zzz"), "damaged optimizer (a str, not a mapping)"),
        (resume("rng_str", rng="x"), "damaged rng"),
        (resume("history", history="x"), "damaged history"),
        (resume("sums", epoch_sums="x"), "damaged epoch_sums"),
        (resume("timed", epoch_timed=[-1.0, 3]), "damaged epoch_timed"),
        (resume("rng_torch", rng=rng), "damaged rng (the random generators' state"),
    ]
    without_args = {k: v for k, v in reference.items() if k != "args"}
    torch.save(without_args, d / "args_missing.pth")
    cases.append((["train", "--resume", str(d / "args_missing.pth"), "--no-progress"], "records no run settings"))
    cases.append((["eval", str(d / "opt.pth")], "damaged optimizer (a str, not a mapping)"))
    files = {p.name: p.read_bytes() for p in d.iterdir()}
    for argv, msg in cases:
        err = _one_error_line(argv, capsys)
        assert msg in err, (argv, err)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == files  # nothing changed, nothing written


def test_the_epoch_count_of_a_damaged_checkpoint_can_be_replaced(reference, tmp_path, cache, capsys):
    """The fix the message gives for a damaged setting that is no position (--epochs N) works."""
    path = _damaged_copy(reference, tmp_path / "checkpoint.pth", args={**reference["args"], "epochs": "ten"})
    err = _one_error_line(["train", "--resume", path, "--no-progress"], capsys)
    assert "give --epochs to replace it" in err, err
    assert main(["train", "--resume", path, "--epochs", "2", "--no-progress", "--cache-dir", cache]) == 0


class RunsAShell:
    """Unpickling this runs a shell command: ``os.system`` makes a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {str(self.marker)!r}",)


def test_a_pickle_that_runs_a_shell_command_is_refused(tmp_path, capsys):
    """torch's other wording (a global of a module it blocks: os / posix) is named as such, not as a
    corrupt file; whichever way it was saved, nothing runs."""
    marker = tmp_path / "marker"
    payload = {"model": {"w": torch.zeros(1)}, "payload": RunsAShell(marker)}
    zipped, legacy, plain = tmp_path / "zip.pth", tmp_path / "legacy.pth", tmp_path / "plain.pkl"
    torch.save(payload, zipped)
    torch.save(payload, legacy, _use_new_zipfile_serialization=False)
    plain.write_bytes(pickle.dumps({"payload": RunsAShell(marker)}, protocol=2))
    for path in (zipped, legacy, plain):
        for argv in (["eval", str(path)], ["train", "--resume", str(path), "--epochs", "1", "--no-progress"]):
            err = _one_error_line(argv, capsys)
            assert "holds Python objects (" in err and "refused" in err, err
    # pickle's default protocol: torch's reader stops at its first opcode, before any global
    newer = tmp_path / "newer.pkl"
    newer.write_bytes(pickle.dumps({"payload": RunsAShell(marker)}))
    assert "not a PyTorch checkpoint" in _one_error_line(["eval", str(newer)], capsys)
    assert not marker.exists()


def test_an_empty_fashion_mnist_dir_variable_counts_as_unset(tmp_path, monkeypatch):
    """OREPA_FASHION_MNIST_DIR= (set, empty): the package's directory, not the current one (the
    error named ./train-images-idx3-ubyte.gz)."""
    from orepa.apps import data
    from orepa.apps.common import UserError

    absent = tmp_path / "absent"
    monkeypatch.setattr(data, "FASHION_MNIST_SOURCE", str(absent))
    monkeypatch.setenv("OREPA_FASHION_MNIST_DIR", "")
    (tmp_path / "cache").mkdir()
    with pytest.raises(UserError) as err:
        data.prepare_fashion_mnist(tmp_path / "cache")
    assert f"{absent}/train-images-idx3-ubyte.gz is missing" in str(err.value)
    assert "./train-images" not in str(err.value)


def test_the_demo_checks_its_batch_first_and_runs_each_method_once(tmp_path, capsys, monkeypatch):
    """A batch larger than the training subset: said before any pipeline starts (each run failed
    after the other had started); a method named twice is one pipeline (two shared one directory)."""
    from orepa.apps import demo

    monkeypatch.setattr(demo, "prepare_fashion_mnist", lambda d: None)
    out = tmp_path / "demo"
    for methods in ("base,orepa", "base,base"):
        err = _one_error_line(["demo", "--methods", methods, "-b", "8", "--train-subset", "4", "--output-dir",
                               str(out), "--no-progress"], capsys)
        assert "gets 4 training images, fewer than one batch (-b 8)" in err, err
    assert not out.exists()
    made = []

    def commands(args, method, out, threads):
        made.append(method)
        return [["false"]]  # a stage that fails at once: no training

    monkeypatch.setattr(demo, "_commands", commands)
    capsys.readouterr()
    assert main(["demo", "--methods", "orepa, orepa,orepa", "--output-dir", str(out), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert made == ["orepa"] and "methods orepa;" in captured.out, captured.out
    assert captured.err.count("orepa failed (exit 1)") == 1, captured.err
    assert sorted(p.name for p in out.iterdir()) == ["orepa"]
    # words, as orepa bench takes them (the demo took one comma-separated word only)
    made.clear()
    assert main(["demo", "--methods", "base", "orepa,base", "--output-dir", str(tmp_path / "words"),
                 "--no-progress"]) == 1
    assert made == ["base", "orepa"]


def test_a_checkpoint_of_nan_weights_is_refused_except_by_eval(reference, tmp_path, cache, capsys):
    """Weights holding NaN (another tool's diverged run, a damaged file): resuming, fine-tuning,
    deploying, exporting or analysing them is one line and writes nothing (they trained on, or
    wrote a deployed model of NaN); eval reports what they compute, in strict JSON (its loss NaN
    was written as the bare word NaN, which JSON readers other than Python's refuse)."""
    model = dict(reference["model"])
    name = next(k for k, v in model.items() if k.endswith("weight") and v.is_floating_point())
    model[name] = torch.full_like(model[name], float("nan"))
    d = tmp_path / "nan"
    d.mkdir()
    path = _damaged_copy(reference, d / "nan.pth", model=model)
    before = Path(path).read_bytes()
    err = _one_error_line(["train", "--resume", path, "--no-progress", "--cache-dir", cache], capsys)
    assert f"{path} holds non-finite values (NaN/inf), first in" in err, err
    assert "the run cannot continue from it" in err, err
    for argv in (["train", *TINY, "--init-from", path, "--epochs", "1", "--cache-dir", cache, "--output-dir",
                  str(tmp_path / "new")],
                 ["reparam", path, "-o", str(tmp_path / "deployed.pth"), "--cache-dir", cache, "--val-subset", "16"],
                 ["export", path, "-o", str(tmp_path / "m.onnx"), "--input-size", "28"],
                 ["analyze", path, "--output-dir", str(tmp_path / "analysis")]):
        err = _one_error_line(argv, capsys)
        assert "holds non-finite values (NaN/inf), first in" in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan"]
    assert sorted(p.name for p in d.iterdir()) == ["nan.pth"] and Path(path).read_bytes() == before
    report = tmp_path / "out.json"
    capsys.readouterr()
    assert main(["eval", path, "--json", str(report), "--val-subset", "16", "--no-progress", "--cache-dir",
                 cache]) == 0
    assert "warning: " in capsys.readouterr().err
    res = json.loads(report.read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert res["loss"] is None and res["nonfinite"], res


def test_a_negative_bn_running_variance_is_refused_except_by_eval(reference, tmp_path, cache, capsys):
    """A BN running variance below zero (a damaged file) passes the non-finite check, and its square
    root is NaN: reparam --fuse-bn --no-verify wrote a deployed model of NaN weights and export
    --no-verify a NaN graph, both exit 0 (verified, they failed as outputs that "differ", NaN > NaN);
    eval said nothing beside a loss of NaN. Now deploying, exporting or starting a run from it is one
    line naming the buffer (the check of loaded weights every command runs), and eval warns."""
    model = dict(reference["model"])
    model["bn1.running_var"] = model["bn1.running_var"].clone()
    model["bn1.running_var"][0] = -1.0
    ema = dict(reference["model"])  # (the weights --use-ema takes)
    d = tmp_path / "negative"
    d.mkdir()
    path = _damaged_copy(reference, d / "negative.pth", model=model, model_ema=ema)
    for argv in (["reparam", path, "-o", str(tmp_path / "deployed.pth"), "--fuse-bn", "--no-verify"],
                 ["reparam", path, "-o", str(tmp_path / "deployed.pth"), "--cache-dir", cache, "--val-subset", "16"],
                 ["export", path, "-o", str(tmp_path / "m.pt"), "--format", "torchscript", "--no-verify"],
                 ["export", path, "-o", str(tmp_path / "m.onnx")],
                 ["train", *TINY, "--init-from", path, "--cache-dir", cache, "--output-dir", str(tmp_path / "run")]):
        err = _one_error_line(argv, capsys)
        assert f"{path} holds a negative BN running variance, in buffer bn1.running_var (min -1)" in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["negative"]
    capsys.readouterr()
    assert main(["reparam", path, "-o", str(tmp_path / "ema.pth"), "--use-ema", "--no-verify"]) == 0  # its EMA is whole
    capsys.readouterr()
    assert main(["eval", path, "--val-subset", "16", "--no-progress", "--cache-dir", cache]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "negative BN running variance, in buffer bn1.running_var" in err, err
    # both kinds of damage in one file: one warning naming both (there were two, one per kind)
    model["fc.weight"] = torch.full_like(model["fc.weight"], float("nan"))
    both = _damaged_copy(reference, d / "both.pth", model=model)
    assert main(["eval", both, "--val-subset", "16", "--no-progress", "--cache-dir", cache]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and "non-finite values (NaN/inf), first in parameter fc.weight and a negative BN running " \
        "variance, in buffer bn1.running_var (min -1)" in warned[0], warned


@pytest.mark.parametrize("kind", ["int", "complex", "sparse"])
def test_weights_that_are_not_real_floats_are_refused_naming_the_key(reference, tmp_path, capsys, kind):
    """Integer or complex weights were cast by load_state_dict without a word (complex losing its
    imaginary part; eval, reparam and export exited 0), sparse ones failed deep inside it."""
    model = dict(reference["model"])
    w = model["fc.weight"]
    model["fc.weight"] = {"int": lambda: w.round().long(), "complex": lambda: w.to(torch.complex64),
                          "sparse": lambda: w.to_sparse()}[kind]()
    d = tmp_path / "kinds"
    d.mkdir()
    path = _damaged_copy(reference, d / "kinds.pth", model=model)
    for argv in (["eval", path, "--val-subset", "16", "--no-progress"],
                 ["reparam", path, "-o", str(tmp_path / "deployed.pth"), "--no-verify"]):
        err = _one_error_line(argv, capsys)
        assert "1 tensor(s) not of real floats (fc.weight: checkpoint torch." in err and "vs model torch.float32" in err, \
            (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kinds"]


def test_use_ema_on_a_deployed_checkpoint_says_where_the_ema_weights_are(reference, tmp_path, capsys):
    """A deployed checkpoint holds one set of weights: --use-ema said "train with --model-ema", wrong
    advice where the run had an EMA; it names the command that deploys the run's EMA weights."""
    (tmp_path / "run").mkdir()
    reference_path = _damaged_copy(reference, tmp_path / "run" / "checkpoint.pth")
    deployed = tmp_path / "deployed.pth"
    assert main(["reparam", reference_path, "-o", str(deployed), "--no-verify"]) == 0
    capsys.readouterr()
    err = _one_error_line(["eval", str(deployed), "--use-ema", "--val-subset", "16", "--no-progress"], capsys)
    assert (f"{deployed} holds deployed model weights, no EMA weights; deploy the run's EMA weights with `orepa "
            f"reparam {os.path.abspath(reference_path)} --use-ema`") in err, err


def test_a_run_that_fails_in_setup_leaves_no_directory_it_made(cache, tmp_path, capsys):
    """-b larger than the training set fails after the output directory was made: the directories
    the run made go again (an empty tree was left behind); one that existed before stays."""
    too_large = ["train", *TINY, "-b", "128", "--cache-dir", cache]
    err = _one_error_line([*too_large, "--output-dir", str(tmp_path / "new" / "deeper")], capsys)
    assert "fewer than one batch (-b 128)" in err, err
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_error_line([*too_large, "--output-dir", str(empty)], capsys)
    assert empty.is_dir() and not any(empty.iterdir())


def test_a_model_name_its_library_lacks_is_said_first(tmp_path, capsys):
    """The name of nothing, with options: that the name names nothing (it said what the options
    could not do for it)."""
    err = _one_error_line(["train", "-m", "torchvision:nonexist", "--width-mult", "0.125", "--no-progress",
                           "--output-dir", str(tmp_path / "t")], capsys)
    assert "torchvision has no model 'nonexist'" in err, err
    err = _one_error_line(["bench", "-m", "nope", "--model-option", "width_mult=0.125", "--output-dir",
                           str(tmp_path / "b")], capsys)
    assert "unknown model 'nope'" in err, err
    assert not any(tmp_path.iterdir())


def test_out_of_memory_in_export_names_the_batch_and_the_input_size(monkeypatch, capsys):
    """export's tensors are sized by -b and --input-size: the hint names both."""
    from orepa.apps import export

    def out_of_memory(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1 GiB free.")

    monkeypatch.setattr(export, "run", out_of_memory)
    err = _one_error_line(["export", "x.pth"], capsys)
    assert err.startswith("orepa export: error: out of memory (CUDA out of memory")
    assert err.endswith("; a smaller batch (-b) or --input-size needs less\n"), err


def test_the_data_flags_of_the_other_kind_of_data_are_refused(reference, cache, tmp_path, capsys):
    """--pad-crop on an ImageFolder tree, crop sizes on Fashion-MNIST: taken and ignored before;
    --sync-bn in one process says it does nothing."""
    imgs = tmp_path / "imgs"
    _png_tree(imgs)
    ckpt = _damaged_copy(reference, tmp_path / "fmnist.pth")
    for argv, msg in (
            (["train", "--data-path", str(imgs), *IMGS, "-b", "2", "--pad-crop", "3", "--output-dir",
              str(tmp_path / "p")], "--pad-crop applies to Fashion-MNIST"),
            (["eval", ckpt, "--val-crop-size", "20", "--cache-dir", cache], "applies to ImageFolder trees"),
            (["train", *TINY, "--train-crop-size", "20", "--cache-dir", cache, "--output-dir", str(tmp_path / "c")],
             "applies to ImageFolder trees")):
        err = _one_error_line(argv, capsys)
        assert msg in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fmnist.pth", "imgs"]
    capsys.readouterr()
    assert main(["train", *TINY, "--sync-bn", "--dist-timeout", "5", "--epochs", "1", "--max-steps", "1",
                 "--cache-dir", cache, "--output-dir", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "note: --sync-bn has no effect in one process" in out
    assert "note: --dist-timeout has no effect in one process" in out


def test_two_names_for_one_input_and_a_name_too_long_are_one_line(reference, tmp_path, capsys):
    """analyze's target and -m, export's checkpoint and --checkpoint: one was dropped without a word;
    a file name over the file system's limit was a traceback (OSError) wherever it was first used."""
    ckpt = _damaged_copy(reference, tmp_path / "a.pth")
    long = str(tmp_path / ("x" * 300 + ".onnx"))
    for argv, msg in ((["analyze", "resnet34", "-m", "resnet18"], "two models: resnet34 and -m resnet18"),
                      (["export", ckpt, "--checkpoint", str(tmp_path / "b.pth")], "two checkpoints"),
                      (["export", ckpt, "-o", long], "File name too long"),
                      (["analyze", long.replace(".onnx", ".pth")], "File name too long")):
        assert msg in _one_error_line(argv, capsys), argv


def test_the_option_value_none_of_scaling_is_the_name_not_python_none():
    """``--model-option scaling=none`` (the no-scaling ablation) read as None was refused; a key
    given twice is an error, not the last value winning."""
    from orepa.apps.common import UserError, parse_key_values

    assert parse_key_values(["scaling=none", "internal_channels=none"]) == {"scaling": "none",
                                                                            "internal_channels": None}
    with pytest.raises(UserError, match="--model-option gives width_mult twice"):
        parse_key_values(["width_mult=0.5", "width-mult=0.25"])
    # a branch list of one name (bench's orepa:branches=kxk, the one-branch ablation) was a string, refused
    for written in ("kxk", "kxk/", "kxk,"):
        assert parse_key_values([f"branches={written}"]) == {"branches": ["kxk"]}, written
    assert parse_key_values(["branches=kxk/1x1"]) == parse_key_values(["branches=kxk,1x1"]) == {
        "branches": ["kxk", "1x1"]}


def test_the_dynamo_exporter_opsets_below_its_lowest_are_refused_first(capsys):
    """Asked for opset 17 it logged a failed down-conversion's traceback, wrote 18 and exited 0."""
    pytest.importorskip("onnxscript")
    err = _one_error_line(["export", "-m", "resnet18", "--dynamo", "--opset", "17", "-o", "x.onnx"], capsys)
    assert "--opset 17 is outside the opsets 18.." in err, err


def test_analyze_says_why_a_model_has_nothing_to_analyse(tmp_path, capsys):
    """One branch per block is not a base model (the hint said to train with --method orepa)."""
    err = _one_error_line(["analyze", "resnet18", "--model-option", "width_mult=0.0625", "--branches", "kxk",
                           "--output-dir", str(tmp_path / "a"), "--no-plot"], capsys)
    assert "its blocks have one branch each (--branches)" in err and "a base" not in err, err
    err = _one_error_line(["analyze", "resnet18", "--method", "base", "--output-dir", str(tmp_path / "b")], capsys)
    assert "analyse one trained with --method orepa" in err, err


def test_a_dash_for_an_output_is_not_taken_for_a_file_named_dash(reference, tmp_path, capsys, monkeypatch):
    """``-o -`` (standard output, to a shell user) wrote a file named "-"; ``./-`` still does."""
    monkeypatch.chdir(tmp_path)
    ckpt = _damaged_copy(reference, tmp_path / "a.pth")
    for argv, flag in ((["export", ckpt, "-o", "-"], "--output -"), (["analyze", ckpt, "--output-dir", "-"],
                                                                    "--output-dir -")):
        err = _one_error_line(argv, capsys)
        assert f"{flag}: orepa writes files, not to standard output" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pth"]


def test_a_dead_loader_worker_or_peer_is_one_line_with_the_checkpoint(cache, tmp_path, capsys, monkeypatch):
    """Faults of the machine met in the loop: a data-loading worker killed (the OOM killer's usual
    target) or, in a run of several processes, a peer gone (its collective fails here): one line with
    where the run was and the checkpoint that continues it, not torch's traceback. A bug stays one."""
    from orepa.apps.common import run_fault

    out = tmp_path / "run"
    assert main(["train", *TINY, *PLAIN, "--epochs", "1", "--cache-dir", cache, "--output-dir", str(out)]) == 0
    ckpt = out / "checkpoint.pth"
    killed = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")
    real_step = torch.optim.SGD.step
    monkeypatch.setattr(torch.optim.SGD, "step", lambda self, *a, **k: (_ for _ in ()).throw(killed))
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--epochs", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"orepa train: error: a data-loading worker died (DataLoader worker (pid 4242) is killed by "
                   f"signal: Killed.) at epoch 2, step 1; the system may be out of memory: fewer workers (-j) need "
                   f"less; the last checkpoint is {ckpt}: --resume {ckpt} continues the run"], err
    assert _load(ckpt)["global_step"] == 4 and not (out / RUN_LOCK).exists()
    peer = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:40211")
    assert run_fault(peer, 2) == ("another process of the run failed or stopped answering ([../third_party/gloo/"
                                  "gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40211)", "")
    assert run_fault(peer, 1) is None and run_fault(RuntimeError("shape mismatch"), 2) is None
    # met by the end-of-epoch evaluation: said so, not as a step past the epoch's last
    monkeypatch.setattr(torch.optim.SGD, "step", real_step)
    monkeypatch.setattr(train, "evaluate", lambda *a, **k: (_ for _ in ()).throw(killed))
    evaluated = [a for a in TINY if a != "--no-eval"] + PLAIN
    assert main(["train", *evaluated, "--epochs", "1", "--cache-dir", cache, "--output-dir", str(tmp_path / "e")]) == 2
    assert "died (DataLoader worker (pid 4242) is killed by signal: Killed.) in the evaluation after epoch 1;" in \
        capsys.readouterr().err
    monkeypatch.setattr(torch.optim.SGD, "step", lambda self, *a, **k: (_ for _ in ()).throw(
        RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train", "--resume", str(ckpt), "--epochs", "2", "--no-progress"])
    monkeypatch.setattr(torch.optim.SGD, "step", real_step)


def test_an_unreadable_image_met_while_training_names_the_checkpoint_and_keeps_the_epoch(
        cache, tmp_path, capsys, monkeypatch):
    """A bad image read while training says how to go on; one read by the end-of-epoch evaluation
    keeps the epoch just trained (a checkpoint at its last step: --resume evaluates it again) instead
    of ending the run with it unsaved; and the cleanup of a failed run (its lock, on a file system
    gone read-only) never replaces the error that ended it."""
    out = tmp_path / "run"
    ckpt = out / "checkpoint.pth"
    real_evaluate = train.evaluate

    def unreadable(*a, **k):  # (what evaluate raises, on every rank, for its loader's unreadable image)
        raise train.EvaluationFailed("cannot read image val/cat/3.jpg: truncated (remove or replace the file)")

    monkeypatch.setattr(train, "evaluate", unreadable)
    evaluated = [a for a in TINY if a != "--no-eval"] + PLAIN
    assert main(["train", *evaluated, "--epochs", "2", "--cache-dir", cache, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"orepa train: error: cannot read image val/cat/3.jpg: truncated (remove or replace the file); "
                   f"the last checkpoint is {ckpt}: --resume {ckpt} continues the run"], err
    kept = _load(ckpt)
    assert (kept["epoch"], kept["step_in_epoch"], kept["global_step"], kept["history"]) == (0, 4, 4, [])
    seconds, steps = kept["epoch_timed"]  # the epoch's training time goes with it
    assert seconds > 0 and steps == 4
    monkeypatch.setattr(train, "evaluate", real_evaluate)
    assert main(["train", "--resume", str(ckpt), "--no-progress", "--quiet"]) == 0
    done = _load(ckpt)
    assert done["epoch"] == 2 and done["global_step"] == 8 and "val_acc1" in done["history"][0]
    first = done["history"][0]  # (it was ~0 s: the resumed command trained none of it)
    # the rate its last step trained at, as an uninterrupted run logs it (not the next step's)
    assert first["lr"] == kept["step_lr"] != kept["optimizer"]["param_groups"][0]["lr"]
    assert first["epoch_time_s"] >= seconds and first["time_per_batch_s"] == pytest.approx(first["epoch_time_s"] / 4)
    assert done["epoch_timed"] == [0.0, 0]
    # the cleanup's own failure: the run's error is the one said
    monkeypatch.setattr(train.Trainer, "train_epoch", lambda self: (_ for _ in ()).throw(
        train.UserError("cannot write progress.json: Read-only file system")))

    def read_only(lock):
        if lock is not None:
            raise OSError(30, "Read-only file system", str(lock))

    monkeypatch.setattr(train, "unlock_run_dir", read_only)
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--epochs", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot write progress.json: Read-only file system" in err and "lock" not in err, err


def test_a_deployed_stem_given_to_a_linear_deep_stem_names_no_deep_stem():
    """--init-from a deployed checkpoint into a model with OREPA's linear deep stem: a 7x7 conv
    cannot start three composed 3x3 blocks, and the error names the flag that builds a stem that
    can; a model description said once where the checkpoint was saved for the same one."""
    from orepa.apps.checkpoint import load_model_state
    from orepa.apps.common import UserError
    from orepa.models import create_model

    model = create_model("resnet18", "orepa", num_classes=10, width_mult=0.0625)
    plain = create_model("resnet18", "base", num_classes=10, width_mult=0.0625).state_dict()
    with pytest.raises(UserError) as err:
        load_model_state(model, plain, path="deployed.pth", built="resnet18/orepa", saved="resnet18/orepa", plain=True)
    assert "--no-deep-stem builds the stem as one block" in str(err.value)
    assert "saved for" not in str(err.value)


def test_dist_timeout_sets_the_collectives_timeout_and_is_not_a_setting_of_the_run(monkeypatch):
    """--dist-timeout MIN: how long a process waits for a stuck peer (torch's default, 30 min with
    gloo, when not given); a setting of the invocation, not of the run (a resume does not keep it)."""
    import datetime

    from orepa.apps import common

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29556"}.items():
        monkeypatch.setenv(key, value)
    seen = []
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(common.dist, "init_process_group", lambda backend, **kw: seen.append((backend, kw)))
    common.init_distributed("cpu", timeout_min=0.5)
    common.init_distributed("cpu")
    assert seen == [("gloo", {"timeout": datetime.timedelta(seconds=30)}), ("gloo", {})]
    assert "dist_timeout" in train.SESSION_FLAGS
    assert train._parser().parse_args(["--dist-timeout", "2.5"]).dist_timeout == 2.5


def test_a_run_whose_lock_the_full_disk_refuses_is_one_line_and_leaves_nothing(cache, tmp_path, capsys, monkeypatch):
    """On a full disk a new file can still be made (an inode), not written: the run lock's pid was refused
    with a traceback (OSError: [Errno 28] from os.write), and its empty lock file and the directory made
    for the run stayed. One line naming the lock file and the refusal; nothing left."""
    import resource

    lock = train.lock_run_dir

    def on_a_full_disk(directory, *a, **k):  # (Python ignores SIGXFSZ: a write past the limit fails, EFBIG)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
        try:
            return lock(directory, *a, **k)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    monkeypatch.setattr(train, "lock_run_dir", on_a_full_disk)
    out = tmp_path / "new" / "run"
    assert main(["train", *TINY, "--epochs", "1", "--cache-dir", cache, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--output-dir {out}: cannot write {RUN_LOCK} (File too large)" in err, err
    assert not (tmp_path / "new").exists()


def test_taking_a_run_directory_removes_the_temporary_files_of_writes_that_died(tmp_path):
    """A run killed while writing a file it never writes again (``model_3.pth`` of --keep-epoch-checkpoints,
    the run resumed from epoch 3's checkpoint.pth; a deployed file) left its full-size hidden temporary file
    for good: only the next write of the same name removed it. A run taking the directory removes every
    one whose writer (on this host) is gone; a live writer's, and other files, stay."""
    from orepa.apps.checkpoint import _host, lock_run_dir, unlock_run_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    run = tmp_path / "run"
    run.mkdir()
    gone = [run / f".model_3.pth.{_host()}-{int(dead.stdout)}.k2x_9abc.tmp",
            run / f".deployed-fused.pth.{_host()}-{int(dead.stdout)}.q1w2e3r4.tmp"]
    kept = [run / f".checkpoint.pth.{_host()}-{os.getpid()}.a1b2c3d4.tmp", run / ".notes.tmp",
            run / f".x.pth.otherhost-{int(dead.stdout)}.a1b2c3d4.tmp", run / "model_3.pth"]
    for p in gone + kept:
        p.write_bytes(b"x")
    unlock_run_dir(lock_run_dir(run))
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in kept)


@pytest.mark.parametrize("meanwhile", ["removed", "taken", "taken in the epoch", "ended", "lock removed"])
def test_a_run_whose_directory_is_removed_takes_it_again_or_stops(cache, tmp_path, capsys, monkeypatch, meanwhile):
    """The output directory removed while the run trains (an ``rm -rf`` of it): the next write made it
    again without the run's lock, and a run started there meanwhile (``--overwrite``) wrote into it with
    this one, silently; this run's end then removed that run's lock. Now the run takes the directory
    again before its next write (said), or, where another run has it (its lock, or its files in the
    directory made since, that run ended), stops without writing there and leaves that run's lock and
    files. Its lock file alone removed (the directory kept), it is taken again and the run goes on."""
    import shutil

    from orepa.apps.checkpoint import lock_run_dir, unlock_run_dir

    out, held = tmp_path / "run", []
    first = train.Trainer.train_epoch

    def remove():
        held.append(None)
        if meanwhile == "lock removed":
            (out / RUN_LOCK).unlink()
            return
        shutil.rmtree(out)
        if meanwhile != "removed":  # another run starts there
            out.mkdir()
            held[0] = lock_run_dir(out)
        if meanwhile == "ended":  # and ends, its files kept
            (out / "log.jsonl").write_text("{}\n")
            unlock_run_dir(held[0])

    def removed_meanwhile(self):
        stop = first(self)
        if not held:
            remove()
        return stop

    step = train.Trainer._forward_backward

    def removed_in_the_epoch(self, *a):  # (the step that --max-steps stops at: progress.json is written first)
        if self.state.global_step == 5 and not held:
            remove()
        return step(self, *a)

    if meanwhile == "taken in the epoch":
        monkeypatch.setattr(train.Trainer, "_forward_backward", removed_in_the_epoch)
        meanwhile = "taken"
    else:
        monkeypatch.setattr(train.Trainer, "train_epoch", removed_meanwhile)
    code = main(["train", *TINY, *PLAIN, "--epochs", "2", "--max-steps", "6", "--cache-dir", cache, "--output-dir",
                 str(out)])
    captured = capsys.readouterr()
    if meanwhile in ("taken", "ended"):
        assert code == 2 and captured.err.count("\n") == 1, captured.err
        lost = f"--output-dir {out} was removed while this run was writing there, and "
        assert lost + (f"could not be taken again (--output-dir {out} is being written by another run (process "
                       if meanwhile == "taken" else "another run has written there since (log.jsonl)") in captured.err
        assert "this run stops without writing there; this run's checkpoints went with its directory" in captured.err
        # the other run's lock or files, nothing of this one's
        assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK if meanwhile == "taken" else "log.jsonl"]
        unlock_run_dir(held[0])
    else:
        assert code == 0, captured.err
        note = (f"note: --output-dir {out} was removed while this run was writing there: made again (what it held "
                "is gone) and taken again" if meanwhile == "removed" else
                f"note: --output-dir {out}: its lock {RUN_LOCK} was removed while this run was writing there: taken again")
        assert note in captured.out and captured.out.count("taken again") == 1, captured.out  # (said once)
        assert _load(out / "checkpoint.pth")["global_step"] == 6 and not (out / RUN_LOCK).exists()


def test_a_run_lock_is_released_without_removing_another_runs(tmp_path):
    """A run whose directory was removed (and made again by another run, which locked it) removed that
    run's lock at its end: a third run could then take the directory from the live second one."""
    from orepa.apps.checkpoint import lock_run_dir, unlock_run_dir
    from orepa.apps.common import UserError

    run = tmp_path / "run"
    run.mkdir()
    first = lock_run_dir(run)
    (run / RUN_LOCK).unlink()
    run.rmdir()
    run.mkdir()
    second = lock_run_dir(run)
    unlock_run_dir(first)
    with pytest.raises(UserError, match="is being written by another run"):
        lock_run_dir(run)
    unlock_run_dir(second)
    assert not (run / RUN_LOCK).exists()
    assert (second.fd, second.folder) == (None, None)  # (both its descriptors closed: the lock's, the directory's)


def test_without_flock_runs_starting_at_once_take_the_lock_once(tmp_path, monkeypatch):
    """On a file system without flock a lock is taken only by making it (O_EXCL): of runs starting into
    one directory at the same moment exactly one gets it, in a new directory (each read the other's
    empty file as free) and where a dead run's lock lies (each found it stale and wrote its own); a lock
    found empty is waited for, then refused with how to remove it."""
    import fcntl
    import threading

    from orepa.apps.checkpoint import _host, lock_run_dir, unlock_run_dir
    from orepa.apps.common import UserError

    def no_flock(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for trial in range(10):
        run = tmp_path / f"run{trial}"
        run.mkdir()
        if trial % 2:
            (run / RUN_LOCK).write_text(f"{_host()}-{int(dead.stdout)}")  # a dead run's lock
        start, taken, refused = threading.Barrier(4), [], []

        def take():
            start.wait()
            try:
                taken.append(lock_run_dir(run))
            except UserError as exc:
                refused.append(str(exc))

        threads = [threading.Thread(target=take) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(taken) == 1 and len(refused) == 3, (trial, taken, refused)
        assert all("is being written by another run" in r for r in refused)
        unlock_run_dir(taken[0])
        assert not (run / RUN_LOCK).exists()
    (tmp_path / "run0" / RUN_LOCK).write_text("")
    with pytest.raises(UserError, match=r"its lock .* stayed empty .*remove it if no run writes there"):
        lock_run_dir(tmp_path / "run0")


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_during_an_export_leaves_no_temporary_file(tmp_path, monkeypatch, capsys, signame):
    """SIGTERM (a scheduler, kill) or SIGHUP (a closed terminal) in the middle of an export's write
    killed the process where it stood: a full-size hidden ``.tmp`` beside the output and the exporter's
    scratch directory stayed. They now unwind as Ctrl-C does: nothing left, one line, exit 128 + N."""
    from orepa.apps import export as export_app
    from orepa.apps.checkpoint import atomic_path

    def stopped_midway(model, path, *args, **kwargs):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"half an export")
            os.kill(os.getpid(), getattr(signal, signame))
            time.sleep(5)  # (the handler raises in this frame long before)
        raise AssertionError("not stopped")

    before = signal.getsignal(getattr(signal, signame))
    if before is signal.SIG_IGN:  # (then the command leaves it ignored: a run under nohup is meant to go on)
        pytest.skip(f"{signame} is ignored in this process (nohup?)")
    monkeypatch.setattr(export_app, "export_torchscript", stopped_midway)
    out = tmp_path / "m.pt"
    rc = main(["export", "--model", "resnet18", "--width-mult", "0.0625", "--num-classes", "10", "--format",
               "torchscript", "-o", str(out), "--input-size", "32"])
    assert rc == 128 + getattr(signal, signame)
    assert f"orepa export: stopped by {signame}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the output nor its temporary file
    assert signal.getsignal(getattr(signal, signame)) == before  # the handler is the process's again


def test_a_16_bit_image_is_scaled_to_8_bits_and_a_float_one_refused(tmp_path):
    """Pillow converts a 16-bit grayscale image to RGB by clipping at 255 (a full-range ramp came
    out 99.6% white): the loader scales it instead, as an 8-bit save of it reads; a floating-point
    image, whose range nothing says, is refused naming the file."""
    import numpy as np
    from PIL import Image

    from orepa.apps import data

    ramp = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    deep = tmp_path / "deep.png"
    Image.fromarray(ramp).save(deep)
    assert Image.open(deep).mode in ("I;16", "I")
    got = np.asarray(data.load_image(str(deep)))
    assert got.shape == (64, 64, 3) and (got[..., 0] == got[..., 1]).all()
    np.testing.assert_array_equal(got[..., 0], np.rint(ramp / 257.0).astype(np.uint8))
    assert (got == 255).mean() < 0.01
    for wide, expect in ((ramp.astype(np.int32), np.rint(ramp / 257.0)), (ramp.astype(np.int32) // 257, ramp // 257)):
        Image.fromarray(wide).save(tmp_path / "wide.tif")  # mode I: 16-bit values scaled, 8-bit ones kept
        assert Image.open(tmp_path / "wide.tif").mode == "I"
        np.testing.assert_array_equal(np.asarray(data.load_image(str(tmp_path / "wide.tif")))[..., 0],
                                      expect.astype(np.uint8))
    flt = tmp_path / "float.tif"
    Image.fromarray(ramp.astype(np.float32) / 65535).save(flt)
    with pytest.raises(data.UserError, match=f"image {flt} has floating-point pixels"):
        data.load_image(str(flt))


def test_the_default_loader_workers_count_the_cpus_this_process_may_use(monkeypatch):
    """A job pinned to one CPU (taskset, a scheduler's share) started a worker per CPU of the host."""
    from types import SimpleNamespace

    from orepa.apps import data

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    args = SimpleNamespace(workers=None, dataset="imagefolder", data_path="/data/imagenet")
    assert data.default_workers(args, torch.device("cpu")) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert data.default_workers(args, torch.device("cpu")) == 8


@pytest.mark.slow  # a subprocess
def test_a_closed_output_pipe_ends_the_output_not_the_run(cache, tmp_path):
    """``orepa train ... | head -1``: the first print after the reader went raised BrokenPipeError,
    which ended the run between epochs (exit 1, a traceback, no summary). Now the output ends there
    and the run goes on to its end: exit 0, its checkpoint and summary written, nothing on stderr."""
    out = tmp_path / "run"
    argv = [a for a in TINY if a != "--quiet"] + PLAIN
    proc = subprocess.Popen([sys.executable, "-m", "orepa", "train", *argv, "--epochs", "2", "--cache-dir", cache,
                             "--output-dir", str(out)], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.communicate(timeout=300)[1].decode()
    assert proc.returncode == 0 and err == "", err[-2000:]
    assert json.loads((out / "summary.json").read_text())["epochs"] == 2


def test_a_lost_terminal_ends_the_output_not_the_command(capsys):
    """A hung-up terminal (an ssh session dropped) fails writes with EIO: the same, for any stream."""
    import errno

    from orepa.cli import _SurvivableStream

    class HungUp(io.StringIO):
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")

    stream = _SurvivableStream(HungUp())
    assert stream.write("epoch 1/2\n") == len("epoch 1/2\n")
    stream.flush()
    assert stream.write("stopped: SIGHUP\n") == len("stopped: SIGHUP\n") and stream._lost


def test_a_folder_named_as_the_embedded_data_is_not_read_in_its_place(tmp_path, monkeypatch, capsys):
    """``--data-path fashion-mnist`` (or fmnist, ...) with a folder of that name here trained on the
    embedded Fashion-MNIST without a word; now the two readings are named (the default data path,
    not typed, still means the embedded data)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fmnist" / "train" / "cat").mkdir(parents=True)
    assert main(["train", *TINY, "--data-path", "fmnist", "--output-dir", str(tmp_path / "run")]) == 2
    assert "give ./fmnist to read that directory (an ImageFolder root), or add --dataset fashion-mnist" in \
        capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    # a folder of that name that is no ImageFolder tree (a run's output orepa made, a cache) is not meant
    assert main(["train", *TINY, *PLAIN, "--data-path", "fashion-mnist", "--epochs", "1", "--cache-dir",
                 "fashion-mnist", "--output-dir", "fashion-mnist/run"]) == 0, capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (a DataLoader worker's start)")
def test_a_forked_worker_does_not_hold_its_parents_run_lock(tmp_path):
    """A flock lasts while any descriptor of it is open, and forked DataLoader workers inherited the run
    lock's: a run killed outright (kill -9) stayed locked until its workers noticed (~5 s), and a
    --resume right after was refused ("being written by another run"). Forked children now close
    their copy: the lock goes with the process that took it."""
    from orepa.apps.checkpoint import lock_run_dir, unlock_run_dir

    run = tmp_path / "run"
    run.mkdir()
    held = lock_run_dir(run)
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # a worker: alive while its parent "dies"
        try:
            os.close(ready_r)
            os.write(ready_w, b"1")
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"1"
        os.close(held.fd)  # what the kernel does for a process killed outright (its file stays)
        held.fd = None
        unlock_run_dir(lock_run_dir(run))  # taken at once: the worker holds nothing
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready_r)


def test_a_peer_that_fails_while_the_run_is_set_up_is_one_line(monkeypatch, capsys, tmp_path):
    """A rank whose setup fails (its data directory missing) says so and exits; the survivor's next
    collective (DistributedDataParallel's first broadcast) then fails with gloo's "Connection closed
    by peer": one line naming that, not torch's traceback; torch's text cut at a word."""
    from orepa.apps.common import DistInfo

    gloo = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:5437 "
            + "Check the logs of the remote worker for the error that ended it " * 4)

    def setup(self):
        raise RuntimeError(gloo)

    monkeypatch.setattr(train, "init_distributed", lambda *a, **k: (DistInfo(0, 2, 0, True), torch.device("cpu")))
    monkeypatch.setattr(train.Trainer, "setup", setup)
    capsys.readouterr()
    assert main(["train", *TINY, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "orepa train: error: another process of the run failed or stopped answering ([../third_party/gloo/"), err
    assert err[0].endswith("Check the logs of the remote worker for ...) while the run was being set up, before its "
                           "first step"), err
    assert not (tmp_path / "run").exists()


def test_under_torchrun_a_process_other_than_rank_0_names_itself_in_its_error(monkeypatch, capsys):
    """Every process of a torchrun run says its own error (it may be its alone: its data directory
    missing); the others than rank 0 name themselves, so a rank's own error shows whose it is."""
    from orepa.apps.common import UserError, fail

    for rank, who in (("0", ""), ("3", " (rank 3 of 4)")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "4")
        assert fail("train", UserError("Fashion-MNIST not found")) == 2
        assert capsys.readouterr().err == f"orepa train{who}: error: Fashion-MNIST not found\n"
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert fail("eval", UserError("no such file")) == 2
    assert capsys.readouterr().err == "orepa eval: error: no such file\n"


def test_a_failing_distributed_run_says_its_error_before_a_launchers_sigterm_ends_it(monkeypatch, capsys):
    """torchrun sends the surviving ranks SIGTERM the moment one fails (a rank killed outright): the
    survivor's training loop had failed already (its peer's socket closed), had given the signals their
    default handlers back, and died of that SIGTERM before its error line (the checkpoint to resume
    from) was out: nothing but torchrun's traceback. A distributed run's stop handlers now stay until
    the command has said its error; then the command's own are back."""
    from orepa.apps import common

    reached_outside = []  # (a default handler here would end the test's process instead)

    def outside_handler(signum, frame):
        reached_outside.append(signum)

    outside = signal.signal(signal.SIGTERM, outside_handler)
    said = common.fail

    def fail_after_a_sigterm(command, exc):
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's, between the failure and the error line
        return said(command, exc)

    def failing_run(args):
        with train.StopSignals(hold_on_error=True):
            raise common.UserError("another process of the run failed or stopped answering (Connection closed by "
                                   "peer) at epoch 1, step 120; the last checkpoint is dk/checkpoint.pth")

    monkeypatch.setattr(common, "fail", fail_after_a_sigterm)
    monkeypatch.setattr(train, "run", failing_run)
    try:
        assert main(["train"]) == 2
        assert "orepa train: error: another process of the run failed" in capsys.readouterr().err
        assert reached_outside == []  # taken by the run's handler, still in place when it came
        assert signal.getsignal(signal.SIGTERM) is outside_handler  # the caller's back once the line was out
    finally:
        signal.signal(signal.SIGTERM, outside)


@pytest.mark.slow  # three short runs
def test_an_unreadable_training_image_keeps_the_steps_trained_before_it(tmp_path, capsys, monkeypatch):
    """One bad file among many training images (or a loader worker killed) ended the run at the last
    checkpoint: every step of the epoch before the bad image was lost (on ImageNet, up to an epoch's
    hours). The steps trained are kept as a checkpoint at the last one, which the message names;
    replacing the file and resuming continues with the very batches the run would have trained."""
    from orepa.apps import data

    imgs = tmp_path / "imgs"
    _png_tree(imgs)
    out = tmp_path / "run"
    argv = ["train", "--data-path", str(imgs), "--model", "resnet18", *PLAIN, "--width-mult", "0.0625", "-b", "2",
            "--train-crop-size", "16", "--val-resize-size", "16", "--val-crop-size", "16", "--no-progress", "-j", "0",
            "--threads", "1",
            "--no-tensorboard", "--no-curves", "--quiet", "--no-eval", "--epochs", "1", "--output-dir", str(out)]
    real, calls = data.load_image, []

    def fifth_unreadable(path):
        calls.append(path)
        if len(calls) == 5:  # in the third batch of two: two steps trained
            raise data.UserError(f"cannot read image {path}: truncated (remove or replace the file)")
        return real(path)

    monkeypatch.setattr(data, "load_image", fifth_unreadable)
    assert main(argv) == 2
    ckpt = out / "checkpoint.pth"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"orepa train: error: cannot read image {calls[4]}: truncated (remove or replace the file); "
                   f"the last checkpoint is {ckpt}: --resume {ckpt} continues the run"], err
    kept = _load(ckpt)
    assert (kept["epoch"], kept["step_in_epoch"], kept["global_step"]) == (0, 2, 2)
    monkeypatch.setattr(data, "load_image", real)
    assert main(["train", "--resume", str(ckpt), "--no-progress", "--quiet"]) == 0
    assert main([*argv[:-1], str(tmp_path / "whole")]) == 0
    resumed, whole = _load(ckpt), _load(tmp_path / "whole" / "checkpoint.pth")
    _assert_same_run(resumed, whole)
    # the epoch's figures count the steps trained before the bad image too
    assert resumed["history"][0]["train_loss"] == pytest.approx(whole["history"][0]["train_loss"])
    # met at the run's first batch: nothing trained, no checkpoint written (an --overwrite's replaced run stays)
    def first_unreadable(path):
        raise data.UserError(f"cannot read image {path}: truncated (remove or replace the file)")

    monkeypatch.setattr(data, "load_image", first_unreadable)
    capsys.readouterr()
    assert main([*argv[:-1], str(tmp_path / "first")]) == 2
    assert "; no checkpoint had been written yet" in capsys.readouterr().err
    assert not (tmp_path / "first" / "checkpoint.pth").exists()
    # a loader worker the system killed (out of memory): the same
    calls.clear()

    def fifth_killed(path):
        calls.append(path)
        if len(calls) == 5:
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")
        return real(path)

    monkeypatch.setattr(data, "load_image", fifth_killed)
    capsys.readouterr()
    assert main([*argv[:-1], str(tmp_path / "killed")]) == 2
    ckpt = tmp_path / "killed" / "checkpoint.pth"
    assert f"a data-loading worker died (DataLoader worker (pid 4242) is killed by signal: Killed.) at epoch 1, step " \
           f"3; the system may be out of memory: fewer workers (-j) need less; the last checkpoint is {ckpt}: " \
           f"--resume {ckpt} continues the run" in capsys.readouterr().err
    assert _load(ckpt)["step_in_epoch"] == 2
