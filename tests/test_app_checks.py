"""The application layer's shared checks, one home each (orepa.apps.checkpoint, .common,
.model_cfg): temporary files of other writers, outputs that name an input or a run's checkpoint,
the order of an atomic write, a checkpoint's metadata and version, flag bounds, model settings, the
checks of loaded weights (EMA included). Each case is one a planted one-line bug got past."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from orepa.apps import checkpoint as ckpt_mod
from orepa.apps import common
from orepa.apps.model_cfg import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_write_leaves_the_temporary_files_of_another_hosts_or_users_writers(tmp_path, monkeypatch):
    """Only a killed writer of this host leaves a temporary file the next write removes: another
    host's (a shared file system: its pid says nothing here) and a live process of another user's
    (os.kill says EPERM) stay, whatever their pid."""
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    path = tmp_path / "c.pth"
    dead = tmp_path / f".c.pth.{ckpt_mod._host()}-{gone}.x1y2.tmp"
    remote = tmp_path / f".c.pth.elsewhere-{gone}.c3d4.tmp"  # a pid that runs nowhere here
    for p in (dead, remote):
        p.write_bytes(b"partial")
    ckpt_mod.save_checkpoint({"model": {"w": torch.ones(2)}}, path)
    assert not dead.exists() and remote.exists()
    others = tmp_path / f".c.pth.{ckpt_mod._host()}-{gone}.e5f6.tmp"
    others.write_bytes(b"partial")

    def not_ours(pid, sig):  # a process of another user: it runs, and may not be signalled
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", not_ours)
    ckpt_mod.save_checkpoint({"model": {"w": torch.ones(2)}}, path)
    assert others.exists() and remote.exists()


def test_another_tools_training_checkpoint_is_never_replaced_by_an_output(tmp_path):
    """A timm / torchvision training checkpoint (optimizer state, no orepa format, no form) is a run's
    resumable state, as orepa's own checkpoint.pth is: an output given its name is refused."""
    timm_run = tmp_path / "timm_run.pth"
    torch.save({"epoch": 3, "arch": "resnet18", "version": 2, "state_dict": {"w": torch.zeros(1)},
                "optimizer": {"state": {}, "param_groups": []}}, timm_run)
    with pytest.raises(common.UserError, match="is the training checkpoint of a run"):
        ckpt_mod.check_output_path(timm_run, "-o/--output")


def test_an_existing_output_directory_is_itself_checked_for_writing(tmp_path, monkeypatch):
    """--output-dir naming a directory that exists: the files go into it, so it is the one that must
    take them (its parent may well be writable where it is not: a read-only results folder)."""
    from pathlib import Path

    out = tmp_path / "out"
    out.mkdir()
    real = os.access
    # (as a user other than root sees a directory of mode 0555; root's os.access says yes to all)
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: Path(p) != out and real(p, mode, *a, **k))
    with pytest.raises(common.UserError, match=f"{out} is not writable"):
        ckpt_mod.check_output_path(out, "--output-dir", directory=True)
    assert ckpt_mod.check_output_path(tmp_path / "new", "--output-dir", directory=True) == tmp_path / "new"


def test_an_atomic_write_reaches_the_disk_before_its_rename(tmp_path, monkeypatch):
    """The temporary file is fsynced, then renamed: a rename first (or no fsync) leaves a crash or power
    loss an empty or torn checkpoint under the real name, where the previous one was whole."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync")
        return real_fsync(fd)

    def replace(a, b):
        events.append("replace")
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    ckpt_mod.save_checkpoint({"model": {"w": torch.ones(2)}}, tmp_path / "c.pth")
    assert events == ["fsync", "replace"]
    events.clear()
    with ckpt_mod.atomic_path(tmp_path / "m.onnx") as tmp:  # (the exporters' writes)
        tmp.write_bytes(b"onnx")
    assert events == ["fsync", "replace"] and (tmp_path / "m.onnx").read_bytes() == b"onnx"


@pytest.mark.parametrize("field,value", [
    ("epoch", -1), ("global_step", True), ("step_in_epoch", 2.0),
    ("classes", ["cat", 3]), ("epoch_timed", [float("inf"), 3]), ("epoch_sums", [0.0, 0.0, 0.0, 0.0]),
    ("epoch_sums", [0.0, 0.0]),
])
def test_a_damaged_counter_or_record_of_a_checkpoint_is_named_when_it_is_read(tmp_path, field, value):
    """Each field a reader relies on, of a type or value orepa never writes (a negative or boolean
    count, a class name that is no string, an infinite time, sums that are not three): a UserError
    naming the field as the file is read, not a wrong resume (an epoch -1) or an error deep inside."""
    path = tmp_path / "c.pth"
    torch.save({"format": "orepa-checkpoint", "version": 1, "form": "train", "model": {"w": torch.ones(2)},
                field: value}, path)
    with pytest.raises(common.UserError, match=f"{path}: damaged {field} "):
        ckpt_mod.load_checkpoint(path)


def test_damaged_weights_are_named_as_the_emas_where_they_are_and_advice_follows_the_damage():
    """check_loaded_weights: EMA weights taken with --use-ema are named as such (the model's may be
    whole); "from before the run diverged" is said of NaN/inf (a diverged run), not of a negative
    BN variance alone (a damaged file: no run diverges into it)."""
    from torch import nn

    nan_model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    with torch.no_grad():
        nan_model[0].weight[0, 0, 0, 0] = float("nan")
    with pytest.raises(common.UserError) as e:
        ckpt_mod.check_loaded_weights(nan_model, "c.pth", "its deployed form would compute nothing useful",
                                      use_ema=True)
    assert str(e.value).startswith("c.pth (its EMA weights) holds non-finite values (NaN/inf), first in parameter "
                                   "0.weight: its deployed form would compute nothing useful; give a checkpoint from "
                                   "before the run diverged"), e.value
    negative = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    negative[1].running_var[0] = -1.0
    with pytest.raises(common.UserError) as e:
        ckpt_mod.check_loaded_weights(negative, "c.pth", "a run started from it would train on NaN")
    msg = str(e.value)
    assert msg.startswith("c.pth holds a negative BN running variance, in buffer 1.running_var (min -1)") and \
        "diverged" not in msg, msg


def test_an_output_is_refused_where_it_names_the_input_by_another_path(tmp_path):
    """not_over: the input by any of its names (``./``, ``..``, a symbolic or hard link) is refused, not
    only by the string it was given as."""
    src = tmp_path / "in.pth"
    torch.save({"w": torch.ones(1)}, src)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.pth").symlink_to(src)
    os.link(src, tmp_path / "hard.pth")
    for other in (tmp_path / "sub" / ".." / "in.pth", tmp_path / "link.pth", tmp_path / "hard.pth"):
        with pytest.raises(common.UserError, match="is the input checkpoint; choose another path"):
            ckpt_mod.check_output_path(other, "-o/--output", not_over={"the input checkpoint": src})


def test_the_number_flags_take_their_bounds_and_refuse_infinity():
    """Each bound a flag's help states is taken (--label-smoothing 1, --seed 2**32-1, --threads up to the
    cap, 32 at least); infinity is no number a flag takes (--lr inf trained on NaN)."""
    import argparse

    assert common.fraction("1") == 1.0 and common.fraction("0") == 0.0
    assert common.seed_int(str(2**32 - 1)) == 2**32 - 1
    cap = common.per_cpu_cap()
    assert cap >= 32 and common.thread_count(str(cap)) == cap and common.thread_count("32") == 32
    for parse, text in ((common.thread_count, str(cap + 1)), (common.positive_float, "inf"),
                        (common.nonneg_float, "inf"), (common.positive_int, "0"), (common.below_one, "1")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


@pytest.mark.parametrize("key,value", [("num_classes", 0), ("in_chans", 2.5), ("num_classes", True),
                                       ("width_mult", True), ("width_mult", float("inf")), ("model", 5),
                                       ("method", None), ("options", [])])
def test_a_model_setting_that_is_not_its_type_is_named(key, value):
    """model_cfg fields (a checkpoint's, a --model-option's): a class count of 0, a fractional channel
    count, a boolean width or a model that is no name are refused naming the field, not built as
    something else (int(2.5) == 2, float(True) == 1.0)."""
    from orepa.apps.model_cfg import check_cfg_value

    with pytest.raises(common.UserError, match=f"model setting {key}="):
        check_cfg_value(key, value)


def test_a_drop_rate_of_one_is_refused():
    from orepa.apps.model_cfg import check_model_kwargs

    check_model_kwargs("timm:resnet10t", {"drop_path_rate": 0.99, "drop_rate": 0})
    for value in (1, 1.0, -0.1, True, "0.1"):
        with pytest.raises(common.UserError, match="a drop probability, 0 <= drop_path_rate < 1"):
            check_model_kwargs("timm:resnet10t", {"drop_path_rate": value})


def test_a_checkpoint_with_a_key_the_model_lacks_is_refused_naming_it():
    """Keys the model has not (another network's head, a wrapper's extra buffer): a UserError naming
    them, not load_state_dict's RuntimeError from deep inside."""
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    sd = {**model.state_dict(), "2.weight": torch.zeros(1)}
    assert ckpt_mod.state_dict_mismatch(model, sd) == "1 unexpected key(s) (2.weight)"
    with pytest.raises(common.UserError, match=r"does not fit the model built, net: 1 unexpected key\(s\) \(2\.weight\)"):
        ckpt_mod.load_model_state(model, sd, path="x.pth", built="net")


def test_ema_weights_of_no_form_are_named_as_the_emas_and_an_unknown_form_is_refused(tmp_path):
    cfg = {"model": "resnet18", "method": "base", "num_classes": 10, "in_chans": 1, "small_input": True,
           "width_mult": 0.0625, "options": {}}
    sd = build_model(cfg).state_dict()
    ckpt = {"model": sd, "model_ema": dict(list(sd.items())[1:])}  # (no form: every form is tried)
    with pytest.raises(common.UserError, match=r"^checkpoint c\.pth \(its EMA weights\) fits no form of resnet18/base"):
        ckpt_mod.model_from_checkpoint(ckpt, "c.pth", cfg=cfg, use_ema=True)
    path = tmp_path / "bogus.pth"
    torch.save({"format": "orepa-checkpoint", "version": 1, "form": "bogus", "model": sd}, path)
    with pytest.raises(common.UserError, match=f"{path}: unknown model form 'bogus'"):
        ckpt_mod.load_checkpoint(path)


def test_checking_an_output_leaves_nothing_and_takes_a_directory_name_ending_in_a_slash(tmp_path):
    """check_output_path's probe file goes at once; an --output-dir written ``runs/`` (a shell's
    completion) is a directory's name, refused only for a file output; an earlier report named
    summary.json outside any run is that report, replaced by its command's rerun."""
    assert ckpt_mod.check_output_path(tmp_path / "x.pth", "-o/--output") == tmp_path / "x.pth"
    assert ckpt_mod.check_output_path(f"{tmp_path / 'runs'}/", "--output-dir", directory=True) == tmp_path / "runs"
    assert not any(tmp_path.iterdir())
    report = tmp_path / "summary.json"
    ckpt_mod.write_json(report, ckpt_mod.report_of("eval", {"checkpoint": "c.pth", "acc1": 1.0}))
    assert ckpt_mod.check_output_path(report, "--json", report="eval") == report


def test_model_cfgs_of_other_methods_old_runs_and_other_libraries():
    """A method other than the checkpoint's drops that method's block options; a recorded small-input
    model with deep_stem (before the pair was refused) builds as it was trained, without it; a width
    multiplier on a torchvision network is refused (it has no such knob)."""
    import argparse

    from orepa.apps.model_cfg import model_cfg_from_args

    saved = {"model": "resnet18", "method": "orepa", "num_classes": 10, "in_chans": 1, "small_input": True,
             "width_mult": 0.0625, "options": {"scaling": "scalar", "freq_prior": False}}
    cfg = model_cfg_from_args(argparse.Namespace(method="base"), num_classes=10, in_chans=1, small_input=True,
                              saved=saved)
    assert cfg["method"] == "base" and cfg["options"] == {}
    old = {**saved, "options": {"deep_stem": True}}
    assert build_model(old).state_dict().keys() == build_model({**saved, "options": {}}).state_dict().keys()
    with pytest.raises(common.UserError, match="width_mult=0.5: options of the zoo's models, not of torchvision:resnet18"):
        build_model({"model": "torchvision:resnet18", "method": "orepa", "num_classes": 10, "in_chans": 3,
                     "small_input": False, "width_mult": 0.5, "options": {}})


@pytest.mark.parametrize("version,said", [(2, "checkpoint version 2 is newer than this orepa (reads 1)"),
                                          ("abc", "unreadable checkpoint version 'abc'"),
                                          (None, "unreadable checkpoint version None")])
def test_a_checkpoint_of_a_newer_or_unreadable_version_is_refused(tmp_path, version, said):
    path = tmp_path / "c.pth"
    torch.save({"format": "orepa-checkpoint", "version": version, "form": "train", "model": {"w": torch.ones(2)}}, path)
    with pytest.raises(common.UserError, match=re.escape(f"{path}: {said}")):
        ckpt_mod.load_checkpoint(path)


def test_the_guard_and_the_load_check_look_at_the_ema_too_and_take_a_zero_variance():
    """An EMA holding NaN, or a negative BN variance, is damage as the model's is (the run's
    checkpoint guard, --resume's check of what it loaded); a running variance of exactly 0 is none
    (a channel that is constant on every image, a dead ReLU's, decays to it in float32)."""
    import copy
    from types import SimpleNamespace

    from torch import nn

    from orepa.apps.common import negative_bn_variance, weights_damage

    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    ema = SimpleNamespace(module=copy.deepcopy(model))  # (what ModelEmaV3 holds: .module)
    with torch.no_grad():
        ema.module[0].weight[0, 0, 0, 0] = float("nan")
    assert common.first_nonfinite(model) is None
    assert common.first_nonfinite(model, None, ema) == "EMA 0.weight"
    ema = SimpleNamespace(module=copy.deepcopy(model))
    ema.module[1].running_var[1] = -2.0
    assert negative_bn_variance(model) is None
    assert negative_bn_variance(model, ema) == "EMA buffer 1.running_var (min -2)"
    model[1].running_var[0] = 0.0
    assert negative_bn_variance(model) is None and weights_damage(model) == (None, "")


def test_a_model_option_without_a_key_is_refused():
    from orepa.apps.common import UserError, parse_key_values

    for item in ("=5", " =true"):
        with pytest.raises(UserError, match=f"--model-option expects KEY=VALUE, got '{item}'"):
            parse_key_values([item])


# --------------------------------------------------------------------------- a batch's memory


def _probe_net() -> torch.nn.Module:
    # conv 3->8, BN, in-place ReLU, a view, linear: a BN's input is the conv's output, the linear's
    # is the BN's (the ReLU wrote into it, the flatten is a view of it)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU(inplace=True), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 5))


@pytest.mark.parametrize("training,amp,per_image", [
    (False, False, 4 * (8 + 8) * 36),  # the BN's input and output (the conv's: 3 + 8 channels)
    (True, False, 4 * (3 + 8 + 8) * 36),  # conv, BN and linear inputs, each storage once
    (True, True, 2 * (3 + 8 + 8) * 36),  # half-precision activations under autocast
])
def test_a_batch_is_refused_where_its_activations_need_more_than_the_device_has_free(monkeypatch, training, amp,
                                                                                     per_image):
    """The memory a batch needs at least, measured on one image and scaled by the batch, against
    what the device has free: exactly at the bound it runs, a byte over it is refused naming -b."""
    from orepa.apps import model_cfg

    net = _probe_net()
    check = lambda batch: model_cfg.check_model_takes(  # noqa: E731
        net, (6,), 3, "probe", lambda s: f"{s}x{s} images", batch=batch, training=training, amp=amp, hint=" (hint)")
    free = 10 * per_image
    monkeypatch.setattr(model_cfg, "free_memory", lambda device: free)
    check(10)
    with pytest.raises(common.UserError) as err:
        check(11)
    step = "a training step" if training else "an inference"
    assert str(err.value) == (f"-b 11, 6x6 images: {step} of probe needs at least {common.size_text(11 * per_image)} "
                              f"({common.size_text(per_image)} an image), more than the {common.size_text(free)} "
                              "free on cpu; a smaller batch needs less (hint)")
    # images of several sizes (train's crops and validation's): the bound of the smallest
    pooled = torch.nn.Sequential(*list(_probe_net())[:3], torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                 torch.nn.Linear(8, 5))
    monkeypatch.setattr(model_cfg, "free_memory", lambda device: 10 * 4 * 16 * 36)  # its BN's at 6x6, 10 images
    model_cfg.check_model_takes(pooled, (12, 6), 3, "pooled", lambda s: f"{s}x{s} images", batch=10)
    with pytest.raises(common.UserError, match="^-b 11, 6x6 images: an inference of pooled"):
        model_cfg.check_model_takes(pooled, (12, 6), 3, "pooled", lambda s: f"{s}x{s} images", batch=11)
    # on a CPU the processes torchrun started on this host share what each measured free: a fourth each of
    # the 4-process job's (10 images fit in 10 images' memory with one process, 2 in it with four)
    monkeypatch.setattr(model_cfg, "free_memory", lambda device: free)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check(2)
    with pytest.raises(common.UserError, match=rf"free on cpu \(shared by this host's 4 processes: "
                                               rf"{common.size_text(free // 4)} each\); a smaller batch"):
        check(3)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(model_cfg, "free_memory", lambda device: None)  # unknown: not refused
    check(10**9)
    assert not any(m._forward_hooks for m in net.modules())  # the probe's hooks are gone
    assert net.training


def test_free_memory_is_the_systems_within_a_containers_limit(tmp_path, monkeypatch):
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("reads /proc/meminfo (Linux)")
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(common, "CGROUP_MEMORY_FILES", ((str(limit), str(usage)),))
    system = common.free_memory(torch.device("cpu"))  # no container files: the system's
    assert system > 0
    limit.write_text("max\n")
    usage.write_text("1000\n")
    assert abs(common.free_memory(torch.device("cpu")) - system) < 2**30  # no limit (the machine moves a little)
    limit.write_text(f"{2**20 + 1000}\n")
    assert common.free_memory(torch.device("cpu")) == 2**20  # the limit less what the container uses
    usage.write_text(f"{2**21}\n")
    assert common.free_memory(torch.device("cpu")) == 0
    assert common.free_memory(torch.device("meta")) is None
    assert [common.size_text(n) for n in (512, 1536, 3 * 2**30, 2**50)] == ["512 B", "1.5 KiB", "3.0 GiB", "1024.0 TiB"]


def test_an_export_of_a_batch_no_machine_holds_is_refused_before_it_runs(tmp_path, capsys):
    """``orepa export -b 10000000`` (3x224x224 images): refused in one line with what the batch
    needs and what is free here, nothing written; it was ended by the system's out-of-memory
    killer (exit 137, no message)."""
    from orepa.cli import main

    out = tmp_path / "x.onnx"
    assert main(["export", "--model", "resnet18", "--method", "base", "-b", "10000000", "--device", "cpu", "-o",
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"-b 10000000, --input-size 224 \(224x224 images\): an inference of resnet18/base .* needs at "
                     r"least [\d.]+ TiB \(6\.1 MiB an image\), more than the [\d.]+ [GT]iB free on cpu", err), err
    assert "-b sizes only its example input" in err and not out.exists()


def test_another_librarys_error_is_said_in_one_line_cut_at_a_word():
    exc = RuntimeError("  Got invalid dimensions\n index: 2 Got: 32   Expected: 48\n")
    assert common.error_text(exc) == "RuntimeError: Got invalid dimensions"
    assert common.error_text(exc, all_lines=True) == "RuntimeError: Got invalid dimensions index: 2 Got: 32 Expected: 48"
    assert common.error_text(ValueError("alpha beta gamma"), 12) == "ValueError: alpha beta ..."
    assert common.error_text(KeyError()) == "KeyError"
    assert common.error_text(ValueError("alpha beta gamma"), 12, typed=False) == "alpha beta ..."
    assert common.error_text(KeyError(), typed=False) == "KeyError"  # no message: its type says what it was


def test_an_exception_quoted_by_a_commands_error_is_cut_at_a_word(tmp_path):
    """The commands' one-line errors quote exceptions through ``error_text`` (an unreadable image's
    was cut inside a word, without saying so)."""
    from unittest import mock

    from PIL import Image

    from orepa.apps import data

    path = tmp_path / "img.png"
    path.write_bytes(b"not an image")
    why = OSError("cannot identify image file " + "x" * 150 + " " + "y" * 100)
    with pytest.raises(common.UserError) as raised, mock.patch.object(Image, "open", side_effect=why):
        data.load_image(str(path))
    assert str(raised.value) == (f"cannot read image {path}: OSError: cannot identify image file {'x' * 150} ... "
                                 "(remove or replace the file)")


def test_the_onnx_exporters_internals_are_left_out_of_its_error_and_the_error_is_cut_at_a_word():
    """The ONNX exporter appends its internals (" [Caused by ...") to a message that may span lines:
    the command's error quotes the message alone, whole words only."""
    from unittest import mock

    import torch

    from orepa.apps import export

    why = torch.onnx.OnnxExporterError("Unsupported: ONNX export of operator\n  Pad in opset 9 "
                                       + "z" * 290 + " tail [Caused by the value 'x' of node 7]")
    with mock.patch.object(export, "_export_with_torch", side_effect=why), \
            pytest.raises(common.UserError) as raised:
        export._export_raw(None, "m.onnx", None, 9, ["output"], False, False)
    assert str(raised.value) == ("the ONNX exporter cannot write this model at opset 9: Unsupported: ONNX export "
                                 "of operator Pad in opset 9 ...; a higher --opset may have it")


def test_device_auto_is_the_default_device_and_others_are_named():
    """``--device auto`` (orepa bench's default before it took the shared flags) picks what leaving the
    flag out picks; a device orepa does not run on is refused naming the flag."""
    assert common.parse_device("auto") == common.parse_device(None)
    assert common.parse_device("cpu") == torch.device("cpu")
    with pytest.raises(common.UserError, match=r"--device 'gpu': expected cpu, cuda or cuda:N"):
        common.parse_device("gpu")
