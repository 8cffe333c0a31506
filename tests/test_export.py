"""Export of deployed zoo models: ONNX round trip through onnxruntime, TorchScript, the CLI."""
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import orepa.models as zoo  # noqa: E402
from orepa import cli  # noqa: E402
from orepa.apps.common import UserError  # noqa: E402
from orepa.apps.export import (  # noqa: E402
    ExportVerificationError,
    export_onnx,
    export_torchscript,
    load_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_thread")


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
    ("resnet18", "orepa", dict(num_classes=10)),
    ("repvgg_a0", "orepa-vgg", dict(num_classes=10, width_mult=0.5)),
])
def test_onnx_round_trip(tmp_path, name, method, kw):
    model = _trained(name, method, **kw)
    report = export_onnx(model, tmp_path / "m.onnx", (1, 3, 64, 64))
    assert report.verified and (tmp_path / "m.onnx").exists()
    assert set(report.errors) == {"deployed vs training form", "onnxruntime vs pytorch (batch 1)",
                                  "onnxruntime vs pytorch (batch 2)"}
    assert report.params_deployed < report.params_training
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node}
    assert "BatchNormalization" not in ops and "Conv" in ops  # deployed: BN folded into the convs
    assert "max abs err" in str(report)


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


def test_cli_export_with_checkpoints(tmp_path, capsys):
    kw = dict(num_classes=10, in_chans=1, small_input=True, width_mult=0.25)
    model = _trained("resnet18", "orepa", **kw)
    train_ckpt = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "epoch": 3}, train_ckpt)
    args = ["export", "--model", "resnet18", "--method", "orepa", "--num-classes", "10", "--in-chans", "1",
            "--small-input", "--width-mult", "0.25", "--input-size", "28"]
    assert cli.main(args + ["--checkpoint", str(train_ckpt), "--output", str(tmp_path / "a.onnx")]) == 0
    out = capsys.readouterr().out
    assert "as the training form" in out and "onnxruntime vs pytorch" in out
    # a deployed (vanilla layout) checkpoint of the same model, exported to TorchScript
    import orepa

    deployed_ckpt = tmp_path / "deployed.pt"
    torch.save(orepa.reparameterize(model).state_dict(), deployed_ckpt)
    m, form = load_checkpoint("resnet18", "orepa", deployed_ckpt, **kw)
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
        load_checkpoint("resnet18", "orepa", tmp_path / "empty.pt", **kw)


def test_cli_export_errors_name_the_problem(tmp_path, capsys):
    """An unreadable file is diagnosed as such (not as a missing --model); bad sizes exit 2."""
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x80\x02not a checkpoint" * 20)
    cases = [
        ([str(garbage)], "corrupt, truncated or not a PyTorch checkpoint"),
        ([str(tmp_path / "missing.pt")], "does not exist"),
        (["--model", "resnet18", "--input-size", "0"], "--input-size: must be a positive integer, got 0"),
        ([], "give a checkpoint, or --model"),
    ]
    bare = tmp_path / "bare.pt"
    torch.save(zoo.create_model("resnet18", "base", num_classes=10, width_mult=0.25).state_dict(), bare)
    cases.append(([str(bare)], "bare state_dict: pass --model"))
    cases.append(([str(bare), "--model", "resnet18", "--num-classes", "10", "--width-mult", "0.25", "-o",
                   str(bare)], "is the input checkpoint"))
    other = tmp_path / "other.pt"
    other.write_bytes(bare.read_bytes())
    cases.append(([str(bare), "--model", "resnet18", "--num-classes", "10", "--width-mult", "0.25", "-o",
                   str(other)], "holds a checkpoint; pass --overwrite"))
    for argv, msg in cases:
        capsys.readouterr()
        assert cli.main(["export", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert other.read_bytes() == bare.read_bytes()


def test_cli_export_takes_the_input_size_and_model_from_the_checkpoint(tmp_path, capsys):
    from orepa.apps.checkpoint import save_checkpoint

    cfg = {"model": "resnet18", "method": "orepa", "num_classes": 10, "in_chans": 1, "small_input": True,
           "width_mult": 0.125, "options": {}}
    model = _trained("resnet18", "orepa", num_classes=10, in_chans=1, small_input=True, width_mult=0.125)
    path = save_checkpoint({"format": "orepa-checkpoint", "version": 1, "form": "train", "model_cfg": cfg,
                            "model": model.state_dict(), "args": {"data_path": "fashion-mnist"}}, tmp_path / "c.pth")
    assert cli.main(["export", str(path), "-o", str(tmp_path / "m.pt"), "--format", "torchscript",
                     "--threads", "1", "--device", "cpu"]) == 0
    assert "input [1, 1, 28, 28]" in capsys.readouterr().out
