"""Export of deployed zoo models: ONNX round trip through onnxruntime, ExportedProgram, TorchScript, the CLI."""
import importlib.util
import inspect
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import orepa.models as zoo  # noqa: E402
from orepa import cli, reparameterize  # noqa: E402
from orepa.apps import export  # noqa: E402
from orepa.apps.common import UserError  # noqa: E402
from orepa.apps.export import (  # noqa: E402
    ExportReport,
    ExportVerificationError,
    export_exported_program,
    export_onnx,
    export_torchscript,
    load_model_file,
    onnx_opset_range,
)

pytestmark = pytest.mark.usefixtures("one_thread", "earlier_objects_frozen")


class _OneBlock(torch.nn.Module):
    """One OREPA block and its BN: for the checks of what an export does whatever the network (a
    failed check, a fixed batch), which any exporter traces in a fraction of a ResNet's time."""

    def __init__(self):
        super().__init__()
        from orepa import OREPAConv2d

        self.conv, self.bn = OREPAConv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def _trained(name, method, **kw):
    """A model whose BN statistics and scales have left their init values."""
    model = zoo.create_model(name, method, **kw)
    x = torch.randn(4, kw.get("in_chans", 3), 32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    model(x).square().mean().backward()
    opt.step()
    with torch.no_grad():
        model(x)
    return model.eval()


@pytest.mark.parametrize("name,method,kw", [
    # (at 1/4 width: the layers, blocks and branches of the full network, a fifth of its time)
    ("resnet18", "orepa", dict(num_classes=10, width_mult=0.25)),
    ("repvgg_a0", "orepa-vgg", dict(num_classes=10, width_mult=0.5)),
])
def test_onnx_round_trip(tmp_path, name, method, kw):
    model = _trained(name, method, **kw)
    report = export_onnx(model, tmp_path / "m.onnx", (1, 3, 64, 64))
    assert report.verified and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    assert report.opset == 17 and "note:" not in str(report)
    assert set(report.errors) == {"deployed vs training form", "onnxruntime vs pytorch (batch 1)",
                                  "onnxruntime vs pytorch (batch 2)"}
    assert report.params_deployed < report.params_training
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node}
    assert "BatchNormalization" not in ops and "Conv" in ops  # deployed: BN folded into the convs
    assert "max abs err" in str(report)


def test_an_onnx_verification_holds_no_autograd_graph(tmp_path, monkeypatch):
    """The ONNX check ran the training form and the deployed model with autograd on, holding every
    activation of the example batch for a backward that never came: at -b 8000 (ResNet-18 x1/16,
    28 x 28) 5.5 GB of peak memory against 2.5 GB without."""
    seen = []
    check_one = export._check_one

    def recorded(report, name, y, ref):
        seen.append((name, y.grad_fn, ref.grad_fn))
        check_one(report, name, y, ref)

    monkeypatch.setattr(export, "_check_one", recorded)
    model = zoo.create_model("resnet18", "orepa", num_classes=10, width_mult=0.0625, small_input=True, in_chans=1)
    assert export_onnx(model, tmp_path / "m.onnx", (2, 1, 28, 28)).verified
    assert len(seen) == 3 and all(y is None and ref is None for _, y, ref in seen), seen


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_torchscript_and_verification_failure(tmp_path):
    model = _trained("resnet18", "dbb", num_classes=10, width_mult=0.25, small_input=True, in_chans=1)
    report = export_torchscript(model, tmp_path / "m.pt", (2, 1, 28, 28))
    assert report.verified and report.format == "torchscript"
    loaded = torch.jit.load(str(tmp_path / "m.pt"))
    assert loaded(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    with pytest.raises(ExportVerificationError):
        export_torchscript(model, tmp_path / "m2.pt", (2, 1, 28, 28), atol=-1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]  # a failed check writes nothing
    # a TorchScript archive is not a checkpoint (torch.load would hand it to torch.jit.load)
    assert cli.main(["eval", str(tmp_path / "m.pt")]) == 2


def test_exported_program_round_trip_with_a_dynamic_batch(tmp_path):
    """torch.export's program of the deployed network: no BN left, any batch size (its trace of a
    batch of 1 would fix the batch at 1), the metadata as extra files, reloaded and checked."""
    model = _trained("resnet18", "orepa", num_classes=10, width_mult=0.25, small_input=True, in_chans=1)
    path = tmp_path / "m.pt2"
    report = export_exported_program(model, path, (1, 1, 28, 28), metadata={"classes": '["a"]'})
    assert report.verified and report.format == "exported-program"
    assert set(report.errors) == {"deployed vs training form", "exported program vs pytorch (batch 1)",
                                  "exported program vs pytorch (batch 2)"}
    extra = {"classes": ""}
    program = torch.export.load(str(path), extra_files=extra)
    assert extra == {"classes": '["a"]'}
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any("conv" in op for op in ops) and not any("batch_norm" in op for op in ops), ops
    deployed = export.deploy_fused(model)
    for batch in (1, 7):
        x = torch.randn(batch, 1, 28, 28)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(x), deployed(x), rtol=0, atol=0)
    assert export.is_export(path, "exported-program") and not export.is_export(path, "torchscript")
    # a fixed batch, when asked for: another size is refused by the program's own guard (of any network:
    # one block's, as below)
    block = _OneBlock().eval()
    report = export_exported_program(block, tmp_path / "fixed.pt2", (3, 1, 28, 28), dynamic_batch=False)
    assert set(report.errors) == {"deployed vs training form", "exported program vs pytorch (batch 3)"}
    with pytest.raises(Exception, match="3"):
        torch.export.load(str(tmp_path / "fixed.pt2")).module()(torch.randn(2, 1, 28, 28))
    # a failed check writes nothing; an ExportedProgram is not a checkpoint
    with pytest.raises(ExportVerificationError):
        export_exported_program(block, tmp_path / "m2.pt2", (1, 1, 28, 28), atol=-1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fixed.pt2", "m.pt2"]
    with pytest.raises(UserError, match="is an ExportedProgram archive"):
        load_model_file("resnet18", "orepa", path, num_classes=10)


class _DataDependent(torch.nn.Module):
    """A network whose path depends on its input's values: torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)

    def forward(self, x):
        return self.conv(x) if x.mean() > 0 else -self.conv(x)


def test_a_model_torch_export_cannot_trace_is_one_error_and_no_file(tmp_path, capfd):
    """torch prints the partial graph of a failed trace and logs a warning: not shown, the error says it."""
    with pytest.raises(UserError, match=r"^torch\.export cannot export this model \(\w+: .*\); --format onnx or "
                                        "torchscript may$"):
        export_exported_program(_DataDependent(), tmp_path / "m.pt2", (1, 1, 8, 8))
    assert list(tmp_path.iterdir()) == [] and capfd.readouterr() == ("", "")


def test_an_exported_program_of_an_older_torch_is_known_with_its_source(tmp_path):
    """torch.export.save before torch 2.6 wrote another layout: serialized_exported_program.json and
    extra_files/<key> at the top of the zip."""
    import zipfile

    old = tmp_path / "old.pt2"
    with zipfile.ZipFile(old, "w") as z:
        z.writestr("serialized_exported_program.json", "{}")
        z.writestr("version", "7.0")
        z.writestr(f"extra_files/{export.SOURCE_KEY}", json.dumps({"checkpoint": None, "ema": False}))
    assert export.is_export(old, "exported-program") and not export.is_export(old, "torchscript")
    assert export.export_source(old, "exported-program") == {"checkpoint": None, "ema": False}
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("archive/archive_format", "not pt2")
    assert not export.is_export(other, "exported-program")


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_an_onnx_export_whose_temporary_file_the_disk_refuses_is_one_error(tmp_path, monkeypatch):
    """The ONNX exporter writes into a temporary directory ($TMPDIR, often a small /tmp) before the model
    is saved beside its output: a full one (here a file-size limit) ended the export with torch's
    traceback (OSError: [Errno 27] File too large, no file named). One error naming that directory."""
    import resource
    import tempfile

    raw = export._export_with_torch

    def limited(*a, **k):  # (Python ignores SIGXFSZ: a write past the limit fails, EFBIG)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            return raw(*a, **k)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    monkeypatch.setattr(export, "_export_with_torch", limited)
    model = zoo.create_model("resnet18", "orepa", num_classes=10, in_chans=1, small_input=True, width_mult=0.25)
    with pytest.raises(UserError, match=f"cannot write the ONNX exporter's temporary file in {tempfile.gettempdir()}: "
                                        "File too large") as err:
        export_onnx(model.eval(), tmp_path / "m.onnx", (1, 1, 28, 28))
    assert "TMPDIR" in str(err.value) and not list(tmp_path.iterdir())


def test_export_writes_to_a_file_name_that_is_not_utf8(tmp_path, capsys):
    """torch's C++ writers and onnxruntime take no such name (a TypeError deep in torch.jit.save);
    a Linux file name is any bytes, which Python hands over as surrogates."""
    odd = tmp_path / os.fsdecode(b"model-\xff")
    try:
        odd.write_bytes(b"")
        odd.unlink()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes no file name that is not UTF-8")
    formats = ["torchscript", "exported-program"] + (["onnx"] if importlib.util.find_spec("onnxruntime") else [])
    for fmt in formats:
        out = f"{odd}.{fmt}"
        assert cli.main(["export", *TINY_ARGS, "--branches", "kxk,1x1", "--format", fmt, "-o", out, "--threads",
                         "1"]) == 0, fmt
        assert "vs pytorch" in capsys.readouterr().out  # verified from the file written
        assert export.is_export(Path(out), fmt)
        # an export given where a checkpoint belongs is named as what it is (eval runs one: below)
        assert cli.main(["reparam", out]) == 2
        said = {"onnx": "is an ONNX model", "torchscript": "is a TorchScript archive",
                "exported-program": "is an ExportedProgram archive"}[fmt]
        assert said in capsys.readouterr().err


def test_cli_export_with_checkpoints(tmp_path, capsys):
    kw = dict(num_classes=10, in_chans=1, small_input=True, width_mult=0.25, **TWO_BRANCHES)
    model = _trained("resnet18", "orepa", **kw)
    train_ckpt = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "epoch": 3}, train_ckpt)
    args = ["export", "--model", "resnet18", "--method", "orepa", "--num-classes", "10", "--in-chans", "1",
            "--small-input", "--width-mult", "0.25", "--branches", "kxk,1x1", "--input-size", "28"]
    assert cli.main(args + ["--checkpoint", str(train_ckpt), "--output", str(tmp_path / "a.onnx")]) == 0
    out = capsys.readouterr().out
    assert "as the training form" in out and "onnxruntime vs pytorch" in out
    # a deployed (vanilla layout) checkpoint of the same model, exported to TorchScript
    import orepa

    deployed_ckpt = tmp_path / "deployed.pt"
    torch.save(orepa.reparameterize(model).state_dict(), deployed_ckpt)
    m, form = load_model_file("resnet18", "orepa", deployed_ckpt, **kw)
    assert form == "deployed form"
    assert cli.main(args + ["--checkpoint", str(deployed_ckpt), "--format", "torchscript",
                            "--output", str(tmp_path / "a.pt")]) == 0
    assert (tmp_path / "a.pt").exists()
    # a checkpoint of another model: a clear error, exit code 2
    bad = tmp_path / "bad.pt"
    torch.save(zoo.create_model("repvgg_a0", "base", num_classes=10, width_mult=0.25).state_dict(), bad)
    capsys.readouterr()
    assert cli.main(args + ["--checkpoint", str(bad), "--output", str(tmp_path / "b.onnx")]) == 2
    err = capsys.readouterr().err
    assert "fits no form of resnet18/orepa" in err and "missing" in err and "unexpected" in err
    assert err.count("\n") == 1 and not (tmp_path / "b.onnx").exists()
    with pytest.raises(UserError, match="holds no state_dict"):
        torch.save({"epoch": 1}, tmp_path / "empty.pt")
        load_model_file("resnet18", "orepa", tmp_path / "empty.pt", **kw)


def test_cli_export_errors_name_the_problem(tmp_path, capsys):
    """An unreadable file is diagnosed as such (not as a missing --model); bad sizes exit 2."""
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x80\x02not a checkpoint" * 20)
    cases = [
        ([str(garbage)], "corrupt, truncated or not a PyTorch checkpoint"),
        ([str(tmp_path / "missing.pt")], "does not exist"),
        (["--model", "resnet18", "--input-size", "0"], "--input-size: must be a positive integer, got 0"),
        ([], "give a checkpoint, or --model"),
        (["--model", "resnet18", "--format", "torchscript", "--dynamo"],
         "--dynamo applies to --format onnx, not --format torchscript"),
        (["--model", "resnet18", "--format", "torchscript", "--opset", "17"],
         "--opset 17 applies to --format onnx, not --format torchscript"),
        # the bound of a verification that does not run: taken and ignored, exit 0
        (["--model", "resnet18", "--no-verify", "--rtol", "0.5", "-o", str(tmp_path / "nv.onnx")],
         "--no-verify skips the verification; --rtol do(es) not apply then"),
        (["--model", "resnet18", "--no-verify", "--atol", "0.5", "-o", str(tmp_path / "nv.onnx")],
         "--no-verify skips the verification; --rtol do(es) not apply then"),
    ]
    bare = tmp_path / "bare.pt"
    torch.save(zoo.create_model("resnet18", "base", num_classes=10, width_mult=0.25).state_dict(), bare)
    cases.append(([str(bare)], "bare state_dict (it records no model): pass --model"))
    # no data to take the stem's default from (eval takes the dataset's, and exported another network)
    cases.append(([str(bare), "--model", "resnet18", "--num-classes", "10", "--width-mult", "0.25"],
                  "say which stem it was trained with, --small-input (orepa train's default on Fashion-MNIST) or "
                  "--no-small-input"))
    cases.append(([str(bare), "--model", "resnet18", "--num-classes", "10", "--width-mult", "0.25",
                   "--no-small-input", "-o", str(bare)], "is the input checkpoint"))
    other = tmp_path / "other.pt"
    other.write_bytes(bare.read_bytes())
    cases.append(([str(bare), "--model", "resnet18", "--num-classes", "10", "--width-mult", "0.25",
                   "--no-small-input", "-o", str(other)], "holds a checkpoint; pass --overwrite"))
    # any other file: only a previous export of the same format is replaced without --overwrite
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for fmt, what in (("onnx", "an ONNX model"), ("torchscript", "a TorchScript module"),
                      ("exported-program", "an ExportedProgram (torch.export)")):
        cases.append((["--model", "resnet18", "--format", fmt, "-o", str(notes)],
                      f"--output {notes} exists and is not {what}; pass --overwrite"))
    cases.append(([str(bare), "--model", "resnet18", "--num-classes", "10", "--width-mult", "0.25",
                   "--no-small-input", "-o", str(tmp_path)], "is a directory"))
    for argv, msg in cases:
        capsys.readouterr()
        assert cli.main(["export", *argv]) == 2, argv
        printed = capsys.readouterr()
        err = printed.err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, err
        assert "loaded" not in printed.out, argv  # refused before the model was loaded and built
    assert other.read_bytes() == bare.read_bytes() and notes.read_text() == "my notes\n"
    ts = tmp_path / "m.pt"
    small = ["--model", "resnet18", "--width-mult", "0.0625", "--num-classes", "10", "--input-size", "32",
             "--format", "torchscript", "-o", str(ts), "--threads", "1", "--device", "cpu"]
    assert cli.main(["export", *small]) == 0 and cli.main(["export", *small]) == 0  # a re-export replaces it
    assert export.is_export(ts, "torchscript") and not export.is_export(other, "torchscript")
    assert not export.is_export(notes, "onnx") and not export.is_export(other, "onnx")


def test_cli_export_takes_the_input_size_and_model_from_the_checkpoint(tmp_path, capsys):
    from orepa.apps.checkpoint import save_checkpoint

    cfg = {"model": "resnet18", "method": "orepa", "num_classes": 10, "in_chans": 1, "small_input": True,
           "width_mult": 0.125, "options": {"branches": ["kxk", "1x1"]}}
    model = _trained("resnet18", "orepa", **TINY, **TWO_BRANCHES)
    path = save_checkpoint({"format": "orepa-checkpoint", "version": 1, "form": "train", "model_cfg": cfg,
                            "model": model.state_dict(), "args": {"data_path": "fashion-mnist"}}, tmp_path / "c.pth")
    assert cli.main(["export", str(path), "-o", str(tmp_path / "m.pt"), "--format", "torchscript",
                     "--threads", "1", "--device", "cpu"]) == 0
    assert "input [1, 1, 28, 28]" in capsys.readouterr().out
    # the class names a checkpoint holds go with the exported model
    names = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Boot"]
    named = save_checkpoint({**torch.load(path, weights_only=True), "classes": names}, tmp_path / "named.pth")
    assert cli.main(["export", str(named), "-o", str(tmp_path / "named.pt"), "--format", "torchscript",
                     "--threads", "1", "--no-verify"]) == 0
    extra = {"classes": "", "preprocessing": ""}
    torch.jit.load(str(tmp_path / "named.pt"), _extra_files=extra)
    assert json.loads(extra["classes"]) == names
    # ... and what its input must be: fed pixels in [0, 1] without the run's normalisation it scored at chance
    fashion = {"image": "grayscale 28x28 (Fashion-MNIST)", "scale": "pixel / 255", "mean": [0.286], "std": [0.353]}
    assert json.loads(extra["preprocessing"]) == fashion
    if importlib.util.find_spec("onnx") is not None:
        import onnx

        assert cli.main(["export", str(named), "-o", str(tmp_path / "named.onnx"), "--threads", "1", "--no-verify"]) == 0
        props = {p.key: p.value for p in onnx.load(str(tmp_path / "named.onnx")).metadata_props}
        assert json.loads(props["classes"]) == names and json.loads(props["preprocessing"]) == fashion
    # an ImageFolder run's: its resize and centre crop, ImageNet's statistics
    from orepa.apps.export import preprocessing_of

    assert preprocessing_of({"args": {"data_path": "/data/birds", "val_resize_size": 160, "val_crop_size": 128}},
                            3) == {"image": "RGB", "resize": 160, "center_crop": 128, "scale": "pixel / 255",
                                   "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def test_model_flags_against_what_a_checkpoint_records_are_refused(tmp_path, capsys):
    """A deployed RepVGG trained with small_input loads strictly without it (the flag changes only
    strides): `export --no-small-input` exported another network (1.4e-3 off at initialisation), its
    check comparing two models built alike. Flags that repeat the checkpoint's settings are fine."""
    from orepa.apps.checkpoint import save_checkpoint
    from orepa.apps.model_cfg import deploy

    cfg = {"model": "repvgg_a0", "method": "repvgg", "num_classes": 10, "in_chans": 1, "small_input": True,
           "width_mult": 0.0625, "options": {}}
    model = _trained("repvgg_a0", "repvgg", num_classes=10, in_chans=1, small_input=True, width_mult=0.0625)
    path = save_checkpoint({"format": "orepa-checkpoint", "version": 1, "form": "deploy", "model_cfg": cfg,
                            "model": deploy(model, "deploy").state_dict()}, tmp_path / "deployed.pth")
    out = tmp_path / "m.pt"
    capsys.readouterr()
    assert cli.main(["export", str(path), "--no-small-input", "-o", str(out), "--format", "torchscript"]) == 2
    assert ("(small_input: checkpoint True vs requested False): leave them out to use the checkpoint's settings"
            in capsys.readouterr().err) and not out.exists()
    assert cli.main(["export", str(path), "--small-input", "--width-mult", "0.0625", "-o", str(out),
                     "--format", "torchscript", "--input-size", "28"]) == 0


TINY = dict(num_classes=10, in_chans=1, small_input=True, width_mult=0.125)
#: OREPA blocks of two branches (the default has six): for the tests of what the commands read, record,
#: write and refuse, which the blocks' branches do not change; each command builds, loads and deploys
#: such a network in about half the time
TWO_BRANCHES = dict(branches=("kxk", "1x1"))
TINY_ARGS = ["--model", "resnet18", "--method", "orepa", "--num-classes", "10", "--in-chans", "1", "--small-input",
             "--width-mult", "0.125", "--input-size", "28"]


def _dynamo_available() -> bool:
    return importlib.util.find_spec("onnxscript") is not None and \
        "dynamo" in inspect.signature(torch.onnx.export).parameters


@pytest.mark.skipif(not _dynamo_available(), reason="needs onnxscript and torch.onnx.export(dynamo=True)")
def test_a_torch_before_the_dynamo_exporter_writes_onnx_and_refuses_dynamo_in_one_line(tmp_path, monkeypatch):
    """torch 2.4 (the lowest this package takes) has no ``dynamo=`` keyword in torch.onnx.export (2.5's): the
    TorchScript-based export passed ``dynamo=False`` and ended in a TypeError; --dynamo is said to need 2.5."""
    real = torch.onnx.export
    calls = []

    def export_of_torch_2_4(model, args, f, export_params=True, verbose=False, training=None, input_names=None,
                            output_names=None, operator_export_type=None, opset_version=None,
                            do_constant_folding=True, dynamic_axes=None, keep_initializers_as_inputs=None,
                            custom_opsets=None, export_modules_as_functions=False, autograd_inlining=True):
        calls.append(opset_version)
        return real(model, args, f, dynamo=False, input_names=input_names, output_names=output_names,
                    opset_version=opset_version, dynamic_axes=dynamic_axes)

    monkeypatch.setattr(torch.onnx, "export", export_of_torch_2_4)
    model = _trained("resnet18", "orepa", **TINY)
    ckpt = tmp_path / "train.pt"
    torch.save(model.state_dict(), ckpt)
    assert cli.main(["export", str(ckpt), *TINY_ARGS, "-o", str(tmp_path / "m.onnx")]) == 0
    assert calls == [17] and (tmp_path / "m.onnx").stat().st_size > 0
    with pytest.raises(UserError, match=r"^--dynamo: the torch.export-based ONNX exporter is torch 2.5's and later's"):
        export.check_onnx_request(18, dynamo=True)


def test_dynamo_export_is_one_self_contained_file(tmp_path, capsys):
    """The dynamo exporter keeps weights in a side file named after its target: the written .onnx
    must hold them itself (it works once copied elsewhere), and no temporary file may remain."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    model = _trained("resnet18", "orepa", **TINY, **TWO_BRANCHES)
    ckpt = tmp_path / "train.pt"
    torch.save(model.state_dict(), ckpt)
    out_dir = tmp_path / "out"
    assert cli.main(["export", str(ckpt), *TINY_ARGS, "--branches", "kxk,1x1", "--dynamo", "-o",
                     str(out_dir / "m.onnx")]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert sorted(p.name for p in out_dir.iterdir()) == ["m.onnx"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(out_dir / "m.onnx", elsewhere / "m.onnx")
    shutil.rmtree(out_dir)
    onnx.checker.check_model(str(elsewhere / "m.onnx"))
    sess = ort.InferenceSession(str(elsewhere / "m.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 1, 28, 28)
    y = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy().astype(np.float32)})[0])
    with torch.no_grad():
        ref = model(x)
    assert (y - ref).abs().max().item() <= 1e-4 * (1 + ref.abs().max().item())
    # with --dynamo the default opset is that exporter's lowest, 18: no down-conversion to 17 is
    # tried (it failed with a logged traceback), and the report needs no note
    written = next(o.version for o in onnx.load(str(elsewhere / "m.onnx")).opset_import if o.domain in ("", "ai.onnx"))
    assert written == 18 and f"exported onnx opset {written} to" in out and "asked for" not in out
    assert "Traceback" not in captured.err
    # 17 asked for explicitly: refused before any work (the exporter logged a failed down-conversion's
    # traceback and wrote its lowest, 18)
    with pytest.raises(UserError, match=r"--opset 17 is outside the opsets 18\.\."):
        export_onnx(model, tmp_path / "asked17.onnx", (1, 1, 28, 28), opset=17, dynamo=True)
    assert not (tmp_path / "asked17.onnx").exists()

    # a forward whose argument has another name (nn.Sequential's input): its batch dynamic too (the
    # dynamic shapes were keyed by the name x: "Failed to export the model with torch.export")
    seq = torch.nn.Sequential(*_OneBlock().children()).eval()
    export_onnx(seq, tmp_path / "seq.onnx", (1, 1, 28, 28), dynamo=True)
    sess = ort.InferenceSession(str(tmp_path / "seq.onnx"), providers=["CPUExecutionProvider"])
    x3 = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x3.numpy()})[0]),
                                   reparameterize(seq)(x3), rtol=1e-4, atol=1e-5)

    # a failed export leaves the old file as it was and nothing temporary beside it (any network's
    # fails so: one block's)
    old = elsewhere / "m.onnx"
    before = old.read_bytes()
    with pytest.raises(ExportVerificationError):
        export_onnx(_OneBlock().eval(), old, (1, 1, 28, 28), dynamo=True, atol=-1.0)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["m.onnx"] and old.read_bytes() == before


@pytest.mark.parametrize("module,flags", [("onnx", ["--no-verify"]), ("onnxruntime", []),
                                          ("onnxscript", ["--dynamo", "--no-verify"])])
def test_cli_export_names_a_missing_package_before_exporting(tmp_path, capsys, monkeypatch, module, flags):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if it were not installed
    capsys.readouterr()
    assert cli.main(["export", *TINY_ARGS, *flags, "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert f"missing package(s) {module} " in err and f"pip install {module} " in err and "orepa[apps]" in err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ("--no-verify" in err) == (module == "onnxruntime")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match=f"pip install {module}"):  # the library function checks too
        export_onnx(zoo.create_model("resnet18", "base", **TINY), tmp_path / "m.onnx", (1, 1, 28, 28),
                    verify="--no-verify" not in flags, dynamo="--dynamo" in flags)
    assert list(tmp_path.iterdir()) == []


def test_cli_export_rejects_an_opset_the_exporter_does_not_support(tmp_path, capsys):
    low, high = onnx_opset_range(dynamo=False)
    assert low <= 17 <= high  # the default is inside
    cases = [([f"--opset={high + 1}"], f"--opset {high + 1} is outside the opsets {low}..{high}"),
             ([f"--opset={low - 1}"], f"--opset {low - 1} is outside the opsets {low}..{high}")]
    if _dynamo_available():
        dlow, dhigh = onnx_opset_range(dynamo=True)
        dlow = max(dlow, 18)  # the dynamo exporter's lowest
        cases.append((["--dynamo", "--opset", str(dhigh + 1)], f"outside the opsets {dlow}..{dhigh} that the dynamo"))
        cases.append((["--dynamo", "--opset", "17"], f"--opset 17 is outside the opsets {dlow}..{dhigh}"))
    for flags, msg in cases:
        capsys.readouterr()
        assert cli.main(["export", *TINY_ARGS, *flags, "-o", str(tmp_path / "m.onnx")]) == 2, flags
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def _report(atol=1e-3):
    return ExportReport(path="m.onnx", format="onnx", input_shape=(1, 3, 8, 8), params_training=1,
                        params_deployed=1, atol=atol)


def test_verification_bound_is_atol_times_one_plus_the_largest_reference_value():
    """Export verification allows atol * (1 + max|ref|), not a bound that grows with the output's size
    (sum|ref|): 1.5x the bound fails, 0.5x passes."""
    ref = torch.tensor([[2.0, -2.0, 1.0, -1.0, 2.0, -2.0]])  # max|ref| = 2, sum|ref| = 10
    bound = 1e-3 * (1 + 2.0)
    report = _report()
    export._check(report, "half", ref + 0.5 * bound, ref)
    with pytest.raises(ExportVerificationError, match="max abs error"):
        export._check(report, "over", ref + 1.5 * bound, ref)
    assert report.bounds["half"] == report.bounds["over"] == pytest.approx(bound, rel=1e-9)
    assert report.errors["half"] == pytest.approx(0.5 * bound, rel=1e-4)


def test_a_nan_in_the_exported_output_fails_verification():
    """A NaN in the exported model's output is a verification failure (a plain `err > bound` would pass it)."""
    ref = torch.tensor([[0.5, -1.0, 2.0]])
    y = ref.clone()
    y[0, 1] = float("nan")
    with pytest.raises(ExportVerificationError):
        export._check(_report(), "nan", y, ref)


def test_report_says_when_the_opset_written_is_not_the_one_asked_for():
    report = ExportReport("m.onnx", "onnx", (1, 3, 8, 8), 10, 5, opset=18, opset_requested=17)
    assert "exported onnx opset 18 to m.onnx" in str(report)
    assert "opset 18 written, not the 17 asked for" in str(report)
    same = ExportReport("m.onnx", "onnx", (1, 3, 8, 8), 10, 5, opset=17, opset_requested=17)
    assert "note:" not in str(same)


# --------------------------------------------------------------------------- a run's checkpoint


def _run_checkpoint(path: Path, **kw) -> Path:
    """A checkpoint as ``orepa train`` writes it: training form, model_cfg and the optimizer's state
    (a run resumes from it). Of a network of two-branch blocks (``orepa train --branches kxk,1x1``):
    what is checked of it is what the commands read, write and record (TWO_BRANCHES)."""
    from orepa.apps.model_cfg import model_cfg_of

    model = _trained("resnet18", "orepa", **{**TINY, **TWO_BRANCHES, **kw})
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    model(torch.randn(2, 1, 28, 28)).square().mean().backward()
    opt.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": "orepa-checkpoint", "version": 1, "form": "train", "model_cfg": model_cfg_of(model),
                "model": model.eval().state_dict(), "optimizer": opt.state_dict(), "epoch": 1, "step_in_epoch": 0,
                "global_step": 1}, path)
    return path


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_cli_export_never_replaces_a_run_checkpoint(tmp_path, capsys):
    """--overwrite replaced a run's checkpoint.pth with the export (its resumable state gone)."""
    run = _run_checkpoint(tmp_path / "run" / "checkpoint.pth")
    src = tmp_path / "src.pth"
    src.write_bytes(run.read_bytes())
    before = run.read_bytes()
    for argv in (["--overwrite"], ["--overwrite", "--format", "torchscript"], []):
        capsys.readouterr()
        assert cli.main(["export", str(src), "-o", str(run), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"--output {run} is the training checkpoint of a run" in err and "choose another --output" in err
        assert "pass --overwrite" not in err  # it would not help
    assert run.read_bytes() == before
    # weights without optimizer state (no run resumes from them) are replaced with --overwrite
    ckpt = torch.load(src, weights_only=True)
    del ckpt["optimizer"]
    torch.save(ckpt, tmp_path / "weights.pth")
    assert cli.main(["export", str(src), "-o", str(tmp_path / "weights.pth"), "--format", "torchscript",
                     "--overwrite"]) == 0
    assert export.is_export(tmp_path / "weights.pth", "torchscript")


def test_a_tf_same_block_exports_its_padding_for_every_input_size(tmp_path):
    """TensorFlow's "SAME" padding computed ceil(size / stride) as -(-size // stride), which ONNX's
    truncating integer division made a floor: the exported graph padded nothing at 9x9, stride 2 (a
    4x4 output for 5x5; the check then failed on the shapes with a RuntimeError). The traced module
    follows other sizes too."""
    from orepa import OREPAConv2d

    torch.manual_seed(0)
    model = torch.nn.Sequential(OREPAConv2d(3, 4, 3, 2, tf_same=True), torch.nn.BatchNorm2d(4)).eval()
    if importlib.util.find_spec("onnxruntime") is not None:
        report = export_onnx(model, tmp_path / "m.onnx", (1, 3, 9, 9), opset=11)
        assert report.verified and report.errors["onnxruntime vs pytorch (batch 2)"] < 1e-5
        with pytest.raises(UserError, match="cannot write this model at opset 9: .*Pad in opset 9.*a higher --opset"):
            export_onnx(model, tmp_path / "old.onnx", (1, 3, 9, 9), opset=9)
        assert not (tmp_path / "old.onnx").exists()
    export_torchscript(model, tmp_path / "m.pt", (1, 3, 9, 9))
    traced = torch.jit.load(str(tmp_path / "m.pt"))
    with torch.no_grad():
        for size in (7, 10, 11):
            x = torch.randn(2, 3, size, size)
            torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["train", "deploy"])
def test_a_state_dict_without_bn_batch_counts_loads_as_pytorch_loads_it(tmp_path, capsys, form):
    """Weights saved without the BNs' ``num_batches_tracked`` (converted files, PyTorch before
    0.4.1) load strictly into a PyTorch BN (it counts from 0): export and eval take them too (they
    were refused as "20 missing key(s)"), with the same outputs."""
    import orepa
    from orepa.apps.checkpoint import model_from_checkpoint
    from orepa.apps.model_cfg import model_cfg_of

    kw = dict(num_classes=10, in_chans=1, small_input=True, width_mult=0.25, **TWO_BRANCHES)
    model = _trained("resnet18", "orepa", **kw)
    cfg = model_cfg_of(model)
    if form == "deploy":
        model = orepa.reparameterize(model)
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    path = tmp_path / "legacy.pt"
    torch.save(sd, path)
    loaded, _, got = model_from_checkpoint({"model": sd}, path, cfg=cfg)
    assert got == form
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(loaded(x), model.eval()(x), rtol=1e-5, atol=1e-5)
    args = ["export", "--model", "resnet18", "--method", "orepa", "--num-classes", "10", "--in-chans", "1",
            "--small-input", "--width-mult", "0.25", "--branches", "kxk,1x1", "--input-size", "28", "--checkpoint",
            str(path), "--output", str(tmp_path / "a.onnx")]
    assert cli.main(args) == 0, capsys.readouterr().err


def test_an_export_reads_a_checkpoints_data_as_its_run_read_it():
    """export judged "trained on Fashion-MNIST" from the data path's name apart from how a run reads
    it (data.resolve_kind): a run with --dataset imagefolder on a folder named fashion-mnist (RGB,
    224 px) was exported for 28x28 grayscale input with Fashion-MNIST's statistics. Both now take
    the one judgement (data.names_fashion_mnist) and agree wherever a run could have read the data."""
    import argparse

    from orepa.apps.data import resolve_kind
    from orepa.apps.export import input_size_of, preprocessing_of

    for data_path in ("fashion-mnist", "FMNIST", "fashion_mnist", "./fashion-mnist", "/data/birds"):
        for dataset in ("auto", "fashion-mnist", "imagefolder"):
            args = argparse.Namespace(data_path=data_path, dataset=dataset)
            try:
                fashion = resolve_kind(args) == "fashion-mnist"
            except UserError:  # (--dataset fashion-mnist with a path: no run read that)
                continue
            ckpt = {"args": {"data_path": data_path, "dataset": dataset, "val_crop_size": 160}}
            assert input_size_of(ckpt) == (28 if fashion else 160), (data_path, dataset)
            assert (preprocessing_of(ckpt, 3)["image"] == "RGB") != fashion, (data_path, dataset)
    # a run's settings without --dataset (older checkpoints): the name alone, as before
    assert input_size_of({"args": {"data_path": "fmnist"}}) == 28
    assert input_size_of({"args": {"data_path": "/data/birds"}}) == 224


def test_a_bare_state_dict_of_the_other_stem_names_the_stem_flag(tmp_path, capsys):
    """The loader of eval and export said only that no form fits a bare state_dict given the other
    stem's flag; it now names the flag to pass, as analyze does."""
    torch.manual_seed(0)
    model = zoo.create_model("resnet18", "orepa", **TINY, **TWO_BRANCHES)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    cmd = ["export", str(tmp_path / "sd.pt"), "-m", "resnet18", "--method", "orepa", "--num-classes", "10",
           "--in-chans", "1", "--width-mult", "0.125", "--branches", "kxk,1x1", "-o", str(tmp_path / "m.pt"),
           "--format", "torchscript", "--no-verify"]
    assert cli.main([*cmd, "--no-small-input"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith("It fits the small-input stem (CIFAR / Fashion-MNIST "
                                                          "style): pass --small-input."), err
    assert not (tmp_path / "m.pt").exists()
    assert cli.main([*cmd, "--small-input", "--input-size", "28"]) == 0


def test_a_bare_state_dicts_classes_and_channels_are_read_from_its_weights(tmp_path, capsys):
    """Without --num-classes / --in-chans, export and analyze built a bare state_dict's model for 1000
    classes and 3 channels (eval takes them from the data): a Fashion-MNIST state_dict given its
    model flags failed on its stem's shape. Its classifier and first convolution say them."""
    torch.manual_seed(0)
    model = zoo.create_model("resnet18", "orepa", **TINY, **TWO_BRANCHES)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    flags = ["-m", "resnet18", "--method", "orepa", "--width-mult", "0.125", "--branches", "kxk,1x1", "--small-input"]
    assert cli.main(["export", str(tmp_path / "sd.pt"), *flags, "-o", str(tmp_path / "m.pt"), "--format",
                     "torchscript", "--input-size", "28"]) == 0
    assert "1 input channel(s), 10 classes" in capsys.readouterr().out
    # (--no-plot: the sizes are read before any analysis, which analysis.json holds; drawing it is another matter)
    assert cli.main(["analyze", str(tmp_path / "sd.pt"), *flags, "--output-dir", str(tmp_path / "a"), "--no-plot"]) == 0
    assert json.loads((tmp_path / "a" / "analysis.json").read_text())
    # the flags still decide
    assert cli.main(["export", str(tmp_path / "sd.pt"), *flags, "--num-classes", "7", "-o", str(tmp_path / "n.pt"),
                     "--format", "torchscript", "--no-verify"]) == 2
    assert "fc.weight: checkpoint [10, 64] vs model [7, 64]" in capsys.readouterr().err
    # the network built from the flags says which tensors to read, whatever their order: a block whose
    # depthwise branch comes first (its weight has 1 input channel), RepVGG's classifier ("linear"), a
    # timm network whose position embedding comes before its stem, AlexNet's hidden layers before its head
    from orepa.apps.model_cfg import checked_cfg, sizes_of_weights

    cases = [("resnet18", "orepa", {"branches": ["dw_pw", "kxk"]}), ("repvgg_a0", "repvgg", {})]
    for name, method, opts in cases:
        with torch.device("meta"):
            sd = zoo.create_model(name, method, num_classes=7, in_chans=2, small_input=True, width_mult=0.25,
                                  **opts).state_dict()
        cfg = checked_cfg({"model": name, "method": method, "num_classes": 1000, "in_chans": 3, "small_input": True,
                           "width_mult": 0.25, "options": opts})
        assert sizes_of_weights(cfg, sd) == {"num_classes": 7, "in_chans": 2}, name
    import torchvision

    with torch.device("meta"):
        sd = torchvision.models.alexnet(num_classes=7).state_dict()
    cfg = checked_cfg({"model": "torchvision:alexnet", "method": "base", "num_classes": 1000, "in_chans": 3,
                       "small_input": False, "width_mult": 1.0, "options": {}})
    assert sizes_of_weights(cfg, sd) == {"num_classes": 7, "in_chans": 3}


def test_exporting_leaves_the_callers_model_in_its_mode(tmp_path):
    """export_torchscript / export_onnx put the model they were given into eval mode (a training loop
    that exported a snapshot went on with frozen BN statistics)."""
    model = zoo.create_model("resnet18", "orepa", num_classes=10, in_chans=1, small_input=True, width_mult=0.0625)
    model.train()
    export_torchscript(model, tmp_path / "m.pt", (1, 1, 28, 28))
    assert model.training and all(m.training for m in model.modules())


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_reparam_and_export_replace_only_an_output_of_the_same_source(tmp_path, capsys, monkeypatch):
    """reparam and export replaced an output made from another checkpoint without a word (an epoch's
    deployed model or export by the last checkpoint's). Each output records its source: a rerun on
    the same one (by any path; the same path after more training, as analyze judges it) replaces its
    own, another checkpoint, its EMA weights or the other form is refused, --overwrite replacing it;
    an output that records no source (an older orepa's, another tool's) is refused too."""
    import onnx

    from orepa.apps.checkpoint import save_checkpoint

    monkeypatch.chdir(tmp_path)
    def with_ema(path):  # (weights of its own for --use-ema)
        ckpt = torch.load(_run_checkpoint(path), weights_only=True)
        return save_checkpoint({**ckpt, "model_ema": ckpt["model"]}, path)

    first, last = with_ema(tmp_path / "run" / "model_1.pth"), _run_checkpoint(tmp_path / "run" / "checkpoint.pth")
    deployed = tmp_path / "run" / "deployed.pth"

    def refused(argv, out, said):
        before = out.read_bytes()
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and "pass --overwrite" in err and err.count("\n") == 1, err
        assert out.read_bytes() == before

    reparam = ["reparam", "--no-verify"]
    assert cli.main([*reparam, str(first)]) == 0
    refused([*reparam, str(last)], deployed, f"--output {deployed} holds the deployed model of {first}, BN not folded")
    for extra in (["--fuse-bn"], ["--use-ema"]):
        refused([*reparam, str(first), "-o", str(deployed), *extra], deployed, f"holds the deployed model of {first}")
    assert cli.main([*reparam, "run/./model_1.pth"]) == 0  # the same checkpoint by another path
    with_ema(first)  # trained further: the same path is the same source
    assert cli.main([*reparam, str(first)]) == 0
    assert cli.main([*reparam, str(last), "--overwrite"]) == 0
    assert torch.load(deployed, weights_only=True)["source_path"] == str(last)
    # an older reparam's record (the path as given) still names its source; a deployed model without one is refused
    held = torch.load(deployed, weights_only=True)
    save_checkpoint({k: v for k, v in held.items() if k != "source_path"}, deployed)
    assert cli.main([*reparam, str(last)]) == 0
    save_checkpoint({k: v for k, v in held.items() if k not in ("source", "source_path")}, deployed)
    refused([*reparam, str(last)], deployed, "holds a deployed model that records no source checkpoint")

    onnx_out, ts_out, ep_out = tmp_path / "m.onnx", tmp_path / "m.pt", tmp_path / "m.pt2"
    exporting = ["export", "--no-verify", "--input-size", "28"]
    for out, fmt in ((onnx_out, "onnx"), (ts_out, "torchscript"), (ep_out, "exported-program")):
        cmd = [*exporting, "--format", fmt, "-o", str(out)]
        assert cli.main([*cmd, str(first)]) == 0
        refused([*cmd, str(last)], out, f"--output {out} holds the export of {first}, resnet18/orepa")
        if fmt == "onnx":  # (each format's record is read by one export_source: the other cases once)
            refused([*cmd, str(first), "--use-ema"], out, f"holds the export of {first}, resnet18/orepa")
            assert cli.main([*cmd, "run/model_1.pth"]) == 0 and cli.main([*cmd, str(first)]) == 0
        assert cli.main([*cmd, str(last), "--overwrite"]) == 0
        assert export.export_source(out, fmt)["checkpoint"] == str(last)
    # an ONNX model that records no source: another tool's, or an older orepa's export
    model = onnx.load(str(onnx_out))
    del model.metadata_props[:]
    onnx.save(model, str(onnx_out))
    refused([*exporting, "-o", str(onnx_out), str(last)], onnx_out, "holds an ONNX model that records no source")


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_eval_runs_each_export_by_its_runtime_on_the_data_its_metadata_names(tmp_path, capsys, cache):
    """What is shipped, measured as it is: ``orepa eval`` of each export gives its checkpoint's numbers
    on Fashion-MNIST (named by the export's metadata); flags that cannot apply to a fixed network are
    refused, and an export that does not say its data (another tool's) needs --data-path."""
    import onnx

    ckpt = _run_checkpoint(tmp_path / "run" / "checkpoint.pth")
    torch.save({**torch.load(ckpt, weights_only=True), "args": {"data_path": "fashion-mnist"}}, ckpt)
    common = ["--val-subset", "64", "-b", "16", "--no-progress", "-j", "0", "--cache-dir", cache]
    result = tmp_path / "e.json"

    def evaluated(path, *extra):
        assert cli.main(["eval", str(path), *common, "--json", str(result), *extra]) == 0
        return json.loads(result.read_text())

    ref = evaluated(ckpt)
    weights = set()
    for fmt, runtime in (("onnx", "onnxruntime (CPUExecutionProvider)"), ("exported-program", "torch.export.load"),
                         ("torchscript", "torch.jit.load")):
        path = tmp_path / f"m{export.FORMATS[fmt][0]}"
        assert cli.main(["export", str(ckpt), "--format", fmt, "-o", str(path), "--no-verify"]) == 0
        capsys.readouterr()
        res = evaluated(path, *(["--no-amp"] if fmt == "onnx" else []))  # (float32 asked for: as run)
        assert (res["acc1"], res["acc5"], res["n"]) == (ref["acc1"], ref["acc5"], 64), fmt
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5), fmt
        assert (res["form"], res["exported_from"], res["runtime"]) == (fmt, str(ckpt), runtime)
        assert f"{path}: {export.FORMATS[fmt][1]} of {ckpt}, resnet18/orepa" in capsys.readouterr().out
        weights.add(res["params"])
    assert len(weights) == 1 and weights.pop() < ref["params"]  # the deployed network's, BN folded
    onnx_path = tmp_path / "m.onnx"
    for extra, said in ((["--use-ema"], "--use-ema do(es) not apply"), (["--amp"], "--amp do(es) not apply"),
                        (["--model", "resnet18"], "a network fixed at its export; the model flags")):
        capsys.readouterr()
        assert cli.main(["eval", str(onnx_path), *common, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    # an ONNX model that records nothing (another tool's): its data must be named
    model = onnx.load(str(onnx_path))
    del model.metadata_props[:]
    onnx.save(model, str(onnx_path))
    capsys.readouterr()
    assert cli.main(["eval", str(onnx_path), *common]) == 2
    assert f"{onnx_path} does not say which data it was trained on: give its --data-path" in capsys.readouterr().err
    res = evaluated(onnx_path, "--data-path", "fashion-mnist")
    assert (res["acc1"], res["exported_from"], res["model"]) == (ref["acc1"], None, "a model it does not describe")
    random = tmp_path / "random.pt2"
    assert cli.main(["export", *TINY_ARGS, "--format", "exported-program", "-o", str(random), "--no-verify"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", str(random), *common]) == 2
    assert "is the export of a randomly initialised model: give the --data-path" in capsys.readouterr().err


def test_a_legacy_checkpoint_is_not_parsed_as_onnx_to_tell_it_from_an_export(tmp_path, monkeypatch):
    """eval looks for an export before it reads a checkpoint: torch's legacy format (a pickle, no zip)
    is told apart by its first byte, not by parsing the whole file as protobuf."""
    legacy = tmp_path / "legacy.pth"
    torch.save({"model": {"w": torch.ones(2)}}, legacy, _use_new_zipfile_serialization=False)
    monkeypatch.setattr(export.ckpt_io, "is_onnx", lambda path: pytest.fail("parsed as ONNX"))
    assert export.export_format(legacy) is None and export.export_format(tmp_path) is None


def test_eval_of_a_damaged_or_foreign_export_is_one_error(tmp_path, capsys, cache):
    """An export orepa did not make, or one torn after it was written, is said in one line (exit 2),
    never a traceback: a program its runtime cannot load, one that predicts fewer classes than the
    data has or gives no tensor, an export without preprocessing read from an ImageFolder tree."""
    import zipfile

    from PIL import Image

    common = ["--val-subset", "16", "-b", "8", "--no-progress", "-j", "0", "--cache-dir", cache]

    def refused(path, said, *extra):
        capsys.readouterr()
        assert cli.main(["eval", str(path), *common, *extra]) == 2, path
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err

    class Head(torch.nn.Module):
        def __init__(self, classes=10, pair=False):
            super().__init__()
            self.fc, self.pair = torch.nn.Linear(28 * 28, classes), pair

        def forward(self, x):
            y = self.fc(x.flatten(1))
            return (y, y) if self.pair else y

    x, batch = torch.randn(2, 1, 28, 28), ({0: torch.export.Dim("batch")},)
    for name, module, said in (("five", Head(5), "predicts 5 classes but fashion-mnist has 10"),
                               ("pair", Head(pair=True), "gives a tuple, not a tensor of logits")):
        path = tmp_path / f"{name}.pt2"
        torch.export.save(torch.export.export(module, (x,), dynamic_shapes=batch), str(path))
        refused(path, said, "--data-path", "fashion-mnist")
    # an ExportedProgram archive that torch.export.load cannot read (its program taken out)
    torn = tmp_path / "torn.pt2"
    with zipfile.ZipFile(tmp_path / "five.pt2") as src, zipfile.ZipFile(torn, "w") as dst:
        for n in src.namelist():
            if "/models/" not in n:
                dst.writestr(n, src.read(n))
    refused(torn, "torch.export.load cannot load it", "--data-path", "fashion-mnist")
    # no preprocessing recorded, an ImageFolder tree: that data's own sizes (as the docs say), not a TypeError
    for c in ("a", "b"):
        (tmp_path / "tree" / "val" / c).mkdir(parents=True)
        Image.new("RGB", (40, 40), (200 if c == "a" else 20, 0, 0)).save(tmp_path / "tree" / "val" / c / "0.png")
    random = tmp_path / "random.pt2"  # (records its model, no preprocessing)
    assert cli.main(["export", *TINY_ARGS, "--format", "exported-program", "-o", str(random), "--no-verify"]) == 0
    refused(random, "takes 1-channel images but imagefolder has 3", "--data-path", str(tmp_path / "tree"))


def test_an_export_at_another_input_size_records_the_crops_its_graph_takes(tmp_path, capsys):
    """``--input-size`` other than the run's crop: the graph (ONNX, ExportedProgram) fixes its height and
    width, so its ``preprocessing`` says that crop (the run's resize scaled alike), which eval then reads."""
    from orepa.apps.model_cfg import model_cfg_of

    model, ckpt = _trained("resnet18", "orepa", **{**TINY, "in_chans": 3}), tmp_path / "checkpoint.pth"
    torch.save({"format": "orepa-checkpoint", "version": 1, "form": "train", "model_cfg": model_cfg_of(model),
                "model": model.state_dict(),
                "args": {"data_path": "/data/birds", "val_resize_size": 36, "val_crop_size": 32}}, ckpt)
    out = tmp_path / "m.pt2"
    assert cli.main(["export", str(ckpt), "--format", "exported-program", "-o", str(out), "--input-size", "48",
                     "--no-verify"]) == 0
    prep = json.loads(export.export_metadata(out, "exported-program")["preprocessing"])
    assert (prep["resize"], prep["center_crop"]) == (54, 48)
    # a Fashion-MNIST run's 28x28 images: the size they must be brought to said beside them
    torch.save({**torch.load(ckpt, weights_only=True), "args": {"data_path": "fashion-mnist"}}, ckpt)
    assert cli.main(["export", str(ckpt), "--format", "exported-program", "-o", str(out), "--input-size", "32",
                     "--no-verify"]) == 0
    prep = json.loads(export.export_metadata(out, "exported-program")["preprocessing"])
    assert prep["image"] == "grayscale 28x28 (Fashion-MNIST), resized to 32x32 (this export's input size)"


def test_eval_of_a_fashion_mnist_export_at_another_size_resizes_the_images_as_it_records(tmp_path, capsys, cache):
    """An export made with ``--input-size 32`` records "resized to 32x32"; eval fed it the 28x28 images
    anyway: the ONNX model refused them, the TorchScript one scored what its record says it is not fed."""
    from torchvision.transforms import v2 as T

    from orepa.apps import data

    ckpt = _run_checkpoint(tmp_path / "run" / "checkpoint.pth")
    torch.save({**torch.load(ckpt, weights_only=True), "args": {"data_path": "fashion-mnist"}}, ckpt)
    common = ["--val-subset", "64", "-b", "16", "--no-progress", "-j", "0", "--cache-dir", cache]
    result = tmp_path / "e.json"
    res = {}
    for fmt in ("onnx", "torchscript"):
        path = tmp_path / f"m{export.FORMATS[fmt][0]}"
        assert cli.main(["export", str(ckpt), "--format", fmt, "-o", str(path), "--no-verify", "--input-size",
                         "32"]) == 0
        assert json.loads(export.export_metadata(path, fmt)["preprocessing"])["resize"] == 32
        assert cli.main(["eval", str(path), *common, "--json", str(result)]) == 0, capsys.readouterr().err
        res[fmt] = json.loads(result.read_text())
    assert cli.main(["eval", str(ckpt), *common, "--json", str(result)]) == 0
    at_28 = json.loads(result.read_text())
    assert res["onnx"]["acc1"] == res["torchscript"]["acc1"]
    assert res["onnx"]["loss"] == pytest.approx(res["torchscript"]["loss"], rel=1e-5)
    assert res["torchscript"]["loss"] != pytest.approx(at_28["loss"], rel=1e-5)  # fed 32x32 images, not 28x28
    x = data.fashion_mnist(cache, val_size=32)[1][0][0]
    want = T.Resize(32, antialias=True)(data.fashion_mnist(cache)[1][0][0])  # torchvision's resize
    assert x.shape == (1, 32, 32) and torch.allclose(x, want, atol=1e-5)


def test_an_export_of_ema_weights_deployed_by_reparam_says_so(tmp_path, capsys):
    """A checkpoint whose model is EMA weights (``orepa reparam --use-ema``: ``"ema": True``) exports with
    ``source.ema`` true, as ``orepa eval`` says "(EMA)" of the checkpoint itself."""
    ckpt = _run_checkpoint(tmp_path / "run" / "checkpoint.pth")
    saved = torch.load(ckpt, weights_only=True)
    deployed = tmp_path / "deployed.pth"
    torch.save({k: v for k, v in saved.items() if k != "optimizer"} | {"ema": True}, deployed)
    out = tmp_path / "m.pt2"
    assert cli.main(["export", str(deployed), "--format", "exported-program", "-o", str(out), "--no-verify"]) == 0
    assert export.export_source(out, "exported-program")["ema"] is True


# --------------------------------------------------------------------------- segmenters, backbones

@pytest.fixture(scope="module")
def pspnet_with_aux():
    """A PSPNet (dict output ``out``, ``aux``) whose BN statistics have left their init values."""
    from orepa.apps import detection

    torch.manual_seed(0)
    model = detection.pspnet("resnet18", "orepa", num_classes=3, aux_loss=True,
                             backbone_options=dict(width_mult=0.125))
    with torch.no_grad():
        model.train()(torch.randn(2, 3, 64, 96))
    return model.eval()


def test_a_segmenter_exports_to_onnx_with_its_named_outputs_where_its_bins_do_not_divide_the_map(
        tmp_path, pspnet_with_aux):
    """torchvision's segmenter interface returns a dict: each entry is an output of the file, by its
    name, and each is checked. PSPNet's bins 3 and 6 on the 8 x 12 map of a 64 x 96 image (stride 8)
    are windows that overlap, which torch's exporter refuses as adaptive_avg_pool2d: they are written
    as products with averaging matrices, the other bins as AveragePools."""
    import onnx
    import onnxruntime as ort

    path = tmp_path / "psp.onnx"
    report = export_onnx(pspnet_with_aux, path, (1, 3, 64, 96))
    assert report.verified
    assert set(report.errors) == {f"{check} [{name}]" for name in ("out", "aux") for check in (
        "deployed vs training form", "onnxruntime vs pytorch (batch 1)", "onnxruntime vs pytorch (batch 2)")}
    graph = onnx.load(str(path)).graph
    assert [o.name for o in graph.output] == ["out", "aux"]
    ops = [n.op_type for n in graph.node]
    assert "MatMul" in ops and "BatchNormalization" not in ops
    # (the deployed copy's pools were made exportable: the model given keeps torch's own)
    assert {type(m) for m in pspnet_with_aux.modules() if isinstance(m, torch.nn.AdaptiveAvgPool2d)} == {
        torch.nn.AdaptiveAvgPool2d}
    x = torch.randn(3, 3, 64, 96)
    outs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})
    with torch.no_grad():
        y = pspnet_with_aux(x)
    for name, out in zip(("out", "aux"), outs):
        assert out.shape == (3, 3, 64, 96)
        assert (torch.from_numpy(out) - y[name]).abs().max() <= 1e-4 * (1 + y[name].abs().max())


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("fmt", ["torchscript", "exported-program"])
def test_a_segmenters_dict_of_outputs_exports_to_torchscript_and_exported_program(tmp_path, pspnet_with_aux, fmt):
    exporter = {"torchscript": export_torchscript, "exported-program": export_exported_program}[fmt]
    path = tmp_path / "psp"
    report = exporter(pspnet_with_aux, path, (1, 3, 64, 96))
    assert report.verified and {"deployed vs training form [out]", "deployed vs training form [aux]"} <= set(report.errors)
    loaded = torch.jit.load(str(path)) if fmt == "torchscript" else torch.export.load(str(path)).module()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        y, ref = loaded(x), export.deploy_fused(pspnet_with_aux)(x)
    assert list(y) == ["out", "aux"]
    for name in y:
        torch.testing.assert_close(y[name], ref[name], rtol=0, atol=0)


@pytest.mark.parametrize("size,out", [((8, 12), 3), ((8, 12), 6), ((9, 7), (4, None)), ((5, 5), (None, 2)),
                                      ((6, 6), 1), ((12, 8), (3, 4)), ((3, 5), 7)])
def test_the_exportable_adaptive_pool_computes_torchs_windows(size, out):
    """Overlapping windows (8 -> 3), a kept axis (None), divisible sizes (torch's own operator) and an
    output larger than the input (windows repeat) all give ``nn.AdaptiveAvgPool2d``'s means."""
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    pool = torch.nn.AdaptiveAvgPool2d(out)
    ref = pool(x)
    pool.__class__ = export._OnnxAdaptiveAvgPool2d
    torch.testing.assert_close(pool(x), ref, rtol=1e-12, atol=1e-12)


def test_a_detector_is_refused_with_its_output_named_and_its_backbone_exports(tmp_path):
    """A detector returns a list of dicts of boxes, a count per image: refused in one line, nothing
    written. Its backbone (the re-param part) returns a dict of feature maps, which export; a key of
    digits is named ``output<key>``, as TorchScript takes no name of digits."""
    import onnx

    from orepa.apps import detection

    torch.manual_seed(0)
    detector = detection.fasterrcnn("resnet18", "orepa", num_classes=3, min_size=64, max_size=64,
                                    backbone_options=dict(width_mult=0.125))
    with pytest.raises(UserError, match=r"returns list\[dict\[str, Tensor\]\].*export its backbone, e\.g\. "
                                        r"model\.backbone"):
        export_onnx(detector, tmp_path / "det.onnx", (1, 3, 64, 64))
    assert list(tmp_path.iterdir()) == []
    report = export_onnx(detector.backbone, tmp_path / "backbone.onnx", (1, 3, 64, 64))
    names = ["output0", "output1", "output2", "output3", "pool"]
    assert report.verified and [o.name for o in onnx.load(str(tmp_path / "backbone.onnx")).graph.output] == names
    assert export.named_outputs((torch.zeros(1), torch.ones(1))).keys() == {"output0", "output1"}


def test_an_output_named_like_the_input_gets_a_name_of_its_own(tmp_path):
    """ONNX names a graph's values by name: a dict output keyed ``input`` would share the input's name
    (onnx's checker refuses such a graph); it is written as ``outputinput``, the other keys as they are."""
    import onnx

    from orepa import OREPAConv2d

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = OREPAConv2d(3, 4, 3, padding=1)

        def forward(self, x):
            y = self.body(x)
            return {"input": y, "out": y.mean((2, 3))}

    torch.manual_seed(0)
    report = export_onnx(TwoHeads(), tmp_path / "m.onnx", (1, 3, 8, 8))
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert report.verified
    assert [i.name for i in graph.input] == ["input"] and [o.name for o in graph.output] == ["outputinput", "out"]


class _DeepLabLike(torch.nn.Module):
    """Stride-2 OREPA blocks, then the logits upsampled to the input's size (a segmenter's last step,
    which reads the input's size as a tensor's shape: traced as sizes, not numbers)."""

    def __init__(self):
        super().__init__()
        from orepa import OREPAConv2d

        self.body = torch.nn.Sequential(OREPAConv2d(3, 8, 3, stride=2, padding=1, **TWO_BRANCHES),
                                        torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                        OREPAConv2d(8, 4, 3, stride=2, padding=1, **TWO_BRANCHES),
                                        torch.nn.BatchNorm2d(4))

    def forward(self, x):
        y = self.body(x)
        return {"out": torch.nn.functional.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False),
                "pooled": y.mean((2, 3))}


_ANY_SIZE_FORMATS = ["onnx", "onnx-dynamo", "exported-program", "torchscript"]


def _has_dim_auto() -> bool:
    return hasattr(torch.export.Dim, "AUTO")


def test_torch_export_at_any_size_without_dim_auto_is_one_error(tmp_path, monkeypatch):
    """A torch before 2.6 has no ``Dim.AUTO``: an export by torch.export at any height and width is
    refused before anything is traced, naming the versions; the TorchScript-based ONNX exporter still does it."""
    monkeypatch.setattr(torch.export, "Dim", type("Dim", (), {}))
    with pytest.raises(UserError, match=r"torch.export at any height and width needs torch >= 2.6 \(Dim.AUTO\)"):
        export_exported_program(_SizeAsNumber(), tmp_path / "m.pt2", (1, 3, 32, 32), dynamic_size=True)
    if _dynamo_available():  # (else the missing exporter is said first)
        with pytest.raises(UserError, match="needs torch >= 2.6"):
            export_onnx(_SizeAsNumber(), tmp_path / "m.onnx", (1, 3, 32, 32), dynamic_size=True, dynamo=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("fmt", _ANY_SIZE_FORMATS)
def test_an_export_at_any_height_and_width_is_verified_at_another_and_runs_at_a_third(tmp_path, fmt):
    """``dynamic_size``: the export is checked at 32 more rows and 64 more columns too, and runs at a
    size neither check used (odd, so a stride's rounding differs), its outputs' sizes following."""
    if fmt == "onnx-dynamo" and not _dynamo_available():
        pytest.skip("the dynamo ONNX exporter needs torch >= 2.5 and onnxscript")
    if fmt in ("onnx-dynamo", "exported-program") and not _has_dim_auto():
        pytest.skip("torch.export at any height and width needs Dim.AUTO (torch >= 2.6)")
    torch.manual_seed(0)
    model = _DeepLabLike().eval()
    with torch.no_grad():
        model.train()(torch.randn(4, 3, 32, 32))  # BN statistics off their init
    model.eval()
    path = tmp_path / "m"
    if fmt.startswith("onnx"):
        report = export_onnx(model, path, (1, 3, 32, 32), dynamic_size=True, dynamo=fmt == "onnx-dynamo")
    else:
        exporter = export_torchscript if fmt == "torchscript" else export_exported_program
        report = exporter(model, path, (1, 3, 32, 32), dynamic_size=True)
    assert report.verified and report.dynamic == ("batch", "height", "width")
    assert "any batch, height, width" in str(report)
    checks = {k for k in report.errors if "pytorch" in k}
    for size in ("(batch 1)", "(batch 2)", "(batch 2, 64x96)", "(batch 2, 65x97)"):
        assert any(size in k for k in checks), (size, checks)
    x = torch.randn(2, 3, 37, 51)
    with torch.no_grad():
        ref = export.deploy_fused(model)(x)
    if fmt.startswith("onnx"):
        import onnxruntime as ort

        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        y = dict(zip([o.name for o in sess.get_outputs()], map(torch.from_numpy, sess.run(None, {"input": x.numpy()}))))
    else:
        loaded = torch.jit.load(str(path)) if fmt == "torchscript" else torch.export.load(str(path)).module()
        with torch.no_grad():
            y = loaded(x)
    assert y["out"].shape == (2, 4, 37, 51)
    for name in ("out", "pooled"):
        torch.testing.assert_close(y[name], ref[name], rtol=1e-4, atol=1e-5)


class _SizeAsNumber(torch.nn.Module):
    """A forward that reads the input's width as a Python number: a trace writes the example's."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x).mean((2, 3)) * int(x.shape[-1])


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_an_export_that_fixed_a_size_fails_its_check_at_another_and_writes_nothing(tmp_path):
    with pytest.raises(ExportVerificationError, match=r"onnxruntime vs pytorch \(batch 2, 64x96\): max abs error"):
        export_onnx(_SizeAsNumber(), tmp_path / "m.onnx", (1, 3, 32, 32), dynamic_size=True)
    with pytest.raises(ExportVerificationError, match=r"torchscript vs pytorch \(batch 2, 64x96\)"):
        export_torchscript(_SizeAsNumber(), tmp_path / "m.pt", (1, 3, 32, 32), dynamic_size=True)
    assert list(tmp_path.iterdir()) == []
    # (without it, the same exports are the example's size's, as they are)
    assert export_onnx(_SizeAsNumber(), tmp_path / "m.onnx", (1, 3, 32, 32)).verified


class _PadToEven(torch.nn.Module):
    """A forward that pads an odd width to an even one, the padding read as a Python number: a trace
    at an even size writes no padding, right at every even size and wrong at odd ones."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(torch.nn.functional.pad(x, (0, int(x.shape[-1]) % 2)))


class _EvenSkip(torch.nn.Module):
    """A skip over a stride-2 pool and its upsampling: the model itself takes even sizes only."""

    def forward(self, x):
        return x + torch.nn.functional.interpolate(torch.nn.functional.avg_pool2d(x, 2), scale_factor=2.0)


class _Flattened(torch.nn.Module):
    """A classifier on the flattened map: the model itself takes its one size only."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3 * 32 * 32, 2)

    def forward(self, x):
        return self.fc(x.flatten(1))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_an_export_at_any_size_is_checked_at_odd_sizes_where_the_model_takes_them(tmp_path, capsys):
    """The check at another size keeps a multiple of the strides (+32, +64), then adds one: a size
    fixed only for the parity (a "same" padding read as a number) fails there; a model that takes
    even sizes only is checked at those; one that takes its one size only is said before any check."""
    with pytest.raises(ExportVerificationError, match=r"\(batch 2, 65x97\)"):
        export_onnx(_PadToEven(), tmp_path / "m.onnx", (1, 3, 32, 32), dynamic_size=True)
    report = export_onnx(_EvenSkip(), tmp_path / "even.onnx", (1, 3, 32, 32), dynamic_size=True)
    assert report.verified and any("64x96" in k for k in report.errors)
    assert not any("65x97" in k for k in report.errors)
    with pytest.raises(UserError, match=r"the model itself does not take an input of shape \[2, 3, 64, 96\]"):
        export_onnx(_Flattened(), tmp_path / "flat.onnx", (1, 3, 32, 32), dynamic_size=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["even.onnx"]


def test_an_onnx_export_at_any_size_refuses_pooling_to_a_grid_and_names_the_pool(tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d((3, 2)))
    with pytest.raises(UserError, match=r"adaptive average pooling to a grid.*: 1 \(\[3, 2\]\); export at one size"):
        export_onnx(model, tmp_path / "m.onnx", (1, 3, 32, 32), dynamic_size=True)
    assert list(tmp_path.iterdir()) == []
    # (a global pool is ONNX's GlobalAveragePool: any size)
    model[1] = torch.nn.AdaptiveAvgPool2d(1)
    assert export_onnx(model, tmp_path / "m.onnx", (1, 3, 32, 32), dynamic_size=True).verified


@pytest.mark.skipif(not _has_dim_auto(), reason="torch.export at any height and width needs torch >= 2.6")
def test_cli_export_at_any_size(tmp_path, capsys):
    """At 32 x 32 ResNet-18's last feature map is one pixel, a size torch.export fixes: the check at
    another size says so; at 64 x 64 (2 x 2) the program takes any size."""
    args = ["export", "--model", "resnet18", "--method", "orepa", "--width-mult", "0.125", "--branches", "kxk,1x1",
            "--num-classes", "10", "--dynamic-size", "--format", "exported-program", "-o", str(tmp_path / "m.pt2")]
    assert cli.main(args + ["--input-size", "32"]) == 1
    err = capsys.readouterr().err
    assert "(batch 2, 64x96): the export does not run on an input of shape [2, 3, 64, 96]" in err
    assert "torch.export specialises" in err and err.count("\n") == 1 and not (tmp_path / "m.pt2").exists()
    assert cli.main(args + ["--input-size", "64"]) == 0
    said = capsys.readouterr().out
    assert "(input [1, 3, 64, 64]; any batch, height, width)" in said and "(batch 2, 96x128)" in said
    with torch.no_grad():
        assert torch.export.load(str(tmp_path / "m.pt2")).module()(torch.randn(1, 3, 72, 88)).shape == (1, 10)
