"""orepa analyze: branch similarity / norm statistics of re-param blocks, files, checkpoint handling."""
import json
import os

import pytest
import torch
from torch import nn

import orepa
from orepa.analysis import (
    analyze_block,
    branch_kernels,
    channel_norms,
    cosine_matrix,
    find_blocks,
    mean_off_diagonal,
    normalized_sorted_norms,
)
from orepa.apps import analyze as app
from orepa.apps.checkpoint import load_checkpoint
from orepa.apps.common import UserError
from orepa.apps.proposition1 import TinyOREPANet

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("block", [
    lambda: orepa.OREPAConv2d(4, 6, 3),
    lambda: orepa.OREPAConv2d(4, 8, 3, groups=2),
    lambda: orepa.OREPAConv2d(4, 6, 1),
    lambda: orepa.OREPAConv2d(4, 6, 5, scaling="scalar"),
    lambda: orepa.DBBConv2d(4, 6, 3),
    lambda: orepa.RepVGGBlock(4, 4, 3),
])
def test_branch_kernels_add_up_to_the_squeezed_kernel(block):
    b = block()
    for m in b.modules():  # non-trivial BN statistics and scales
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
        if isinstance(m, orepa.Scale):
            m.weight.data.uniform_(0.5, 1.5)
    kern = branch_kernels(b)
    assert list(kern) == list(b.branches)
    w, _ = b.equivalent()
    torch.testing.assert_close(sum(kern.values()), w.double(), rtol=1e-6, atol=1e-6)
    r = analyze_block(b)
    m, c = len(kern), b.out_channels
    cos = torch.tensor(r["cosine"])
    assert cos.shape == (m, m)
    torch.testing.assert_close(cos, cos.T)
    assert torch.allclose(cos.diagonal(), torch.ones(m, dtype=cos.dtype))
    assert torch.tensor(r["channel_norms"]).shape == (m, c)
    ns = torch.tensor(r["normalized_sorted_norms"])
    assert ns.shape == (m, c)
    assert torch.all(ns[:, :-1] >= ns[:, 1:])  # sorted per branch
    assert ns.sum().item() == pytest.approx(c)  # per channel, the shares sum to 1
    assert sum(r["mean_share"]) == pytest.approx(1.0)


def test_cosine_and_norm_helpers():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 0.0]]).view(4, 1, 2, 1, 1)
    cos = cosine_matrix(a)
    assert cos[0, 2] == pytest.approx(1.0) and cos[0, 1] == pytest.approx(0.0)
    assert cos[3].abs().sum() == 0  # an all-zero kernel is similar to nothing
    assert mean_off_diagonal(torch.eye(3)) == 0.0
    n = channel_norms(torch.ones(2, 3, 1, 1, 1))
    assert n.shape == (2, 3)
    assert normalized_sorted_norms(n).sum(0).tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_cosine_similarity_of_opposite_kernels_is_signed():
    """Branch cosine similarity keeps its sign: opposite kernels give -1 off the diagonal, not +1."""
    k = torch.tensor([[1.0, -2.0], [0.5, 3.0]]).view(2, 2, 1, 1)
    cos = cosine_matrix({"a": k, "b": -k})
    want = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    assert torch.allclose(cos, want, rtol=0, atol=1e-12), cos
    assert mean_off_diagonal(cos) == pytest.approx(-1.0, abs=1e-12)


def test_channel_norms_are_l2_norms_per_output_channel():
    """Per-channel branch norms are the L2 norm of each output channel's kernel (3, 4 -> 5), not L1."""
    k = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]]).view(1, 3, 2, 1, 1)  # [M=1, C_out=3, C_in=2, 1, 1]
    n = channel_norms(k)
    assert n.tolist() == [[5.0, 1.0, 0.0]]
    r = torch.randn(2, 4, 3, 3, 3, dtype=torch.float64)
    want = torch.linalg.vector_norm(r.flatten(2), dim=2)
    assert torch.allclose(channel_norms(r), want, rtol=0, atol=1e-12)


def test_analyze_in_memory_model_writes_files(tmp_path):
    torch.manual_seed(0)
    model = TinyOREPANet(width=4)
    blocks = find_blocks(model)
    assert [n for n, _ in blocks] == ["block1", "block2", "block3"]
    res = app.analyze(model, tmp_path)
    for key in ("json", "cosine", "norms", "summary"):
        assert (tmp_path / res["files"][key].split("/")[-1]).stat().st_size > 0
    data = json.loads((tmp_path / "analysis.json").read_text())
    assert set(data["layers"]) == {"block1", "block2", "block3"}
    b2 = data["layers"]["block2"]
    assert len(b2["cosine"]) == 6 and len(b2["cosine"][0]) == 6
    assert len(b2["channel_norms"]) == 6 and len(b2["channel_norms"][0]) == 8
    assert data["summary"]["blocks"] == 3
    with pytest.raises(ValueError, match="no re-param block"):
        app.analyze(nn.Sequential(nn.Conv2d(1, 1, 3)))


def _zoo_checkpoint(tmp_path, method="orepa", wrap=True):
    from orepa.apps.bench import build_variant

    torch.manual_seed(0)
    model = build_variant("resnet18", method, 10, model_options={"width_mult": 0.125})
    sd = model.state_dict()
    path = tmp_path / f"{method}.pt"
    torch.save({"model": sd, "epoch": 1} if wrap else {f"module.{k}": v for k, v in sd.items()}, path)
    return model, path


def test_cli_checkpoint(tmp_path, capsys):
    from orepa.cli import main

    model, path = _zoo_checkpoint(tmp_path)
    out = tmp_path / "out"
    rc = main(["analyze", str(path), "-m", "resnet18", "--method", "orepa", "--option", "width_mult=0.125",
               "--out-dir", str(out), "--no-plot"])
    assert rc == 0
    data = json.loads((out / "analysis.json").read_text())
    assert len(data["layers"]) == len(find_blocks(model)) == 19  # 3 deep-stem 3x3 blocks + 16 3x3 convs
    assert data["meta"]["source"] == str(path)
    assert "19 blocks" in capsys.readouterr().out
    # numbers come from the checkpoint's weights
    name = "layer1.0.conv1"
    expect = analyze_block(model.get_submodule(name))["cosine"]
    torch.testing.assert_close(torch.tensor(data["layers"][name]["cosine"]), torch.tensor(expect))


def test_a_model_at_initialisation_gives_the_same_figures_for_the_same_seed(tmp_path):
    from orepa.cli import main

    runs = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        argv = ["analyze", "resnet18", "--width-mult", "0.0625", "--no-plot", "--output-dir", str(tmp_path / name)]
        assert main([*argv, "--seed", seed] if name != "a" else argv) == 0  # --seed 0 is the default
        runs[name] = json.loads((tmp_path / name / "analysis.json").read_text())["layers"]
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]


def test_a_seed_is_refused_for_a_checkpoint(tmp_path, capsys):
    """--seed draws the weights of a model analysed at initialisation: given with a checkpoint it was
    taken, and changed nothing, without a word."""
    from orepa.cli import main

    _, path = _zoo_checkpoint(tmp_path)
    cmd = ["analyze", str(path), "-m", "resnet18", "--method", "orepa", "--option", "width_mult=0.125",
           "--output-dir", str(tmp_path / "out"), "--no-plot"]
    for seed in ("3", "0"):  # given is given, the default's value too
        assert main([*cmd, "--seed", seed]) == 2
        err = capsys.readouterr().err
        assert (f"{path} is a checkpoint, analysed with the weights it holds; --seed do(es) not apply (it seeds a "
                "model analysed at initialisation)") in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    assert main(cmd) == 0


def test_checkpoint_mismatch_is_a_clear_error(tmp_path, capsys):
    from orepa.cli import main

    _, path = _zoo_checkpoint(tmp_path, wrap=False)  # DDP-style "module." keys are accepted
    sd = load_checkpoint(path)["model"]
    assert not any(k.startswith("module.") for k in sd)
    rc = main(["analyze", str(path), "-m", "resnet18", "--method", "dbb", "--option", "width_mult=0.125",
               "--out-dir", str(tmp_path / "x"), "--no-plot"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "does not match --model resnet18 --method dbb" in err and "missing" in err
    assert "Its branches are not those of this method's blocks: pass the --method it was trained with" in err
    from orepa.apps.bench import build_variant

    wrong_width = build_variant("resnet18", "orepa", 10, model_options={"width_mult": 0.25})
    with pytest.raises(UserError, match="shape mismatch"):
        app.check_and_load(wrong_width, sd, "wider model")
    torch.save({"epoch": 3}, tmp_path / "bad.pt")
    with pytest.raises(UserError, match="no state_dict"):
        load_checkpoint(tmp_path / "bad.pt")
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "bad.pt")]) == 2
    assert "holds no state_dict" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "missing.pt")]) == 2
    # a base model's checkpoint has no branches: a one-line error, not a traceback
    base = tmp_path / "base.pt"
    torch.save(orepa.create_model("resnet18", "base", num_classes=10, width_mult=0.125).state_dict(), base)
    capsys.readouterr()
    assert main(["analyze", str(base), "--method", "base", "--model-option", "width_mult=0.125",
                 "--output-dir", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no re-param block" in err and "Traceback" not in err, err
    # a checkpoint of another format or a newer version is refused by the one loader
    torch.save({"format": "other", "model": sd}, tmp_path / "fmt.pt")
    torch.save({"format": "orepa-checkpoint", "version": 99, "model": sd}, tmp_path / "ver.pt")
    for name, msg in (("fmt.pt", "unknown checkpoint format 'other'"), ("ver.pt", "version 99 is newer")):
        assert main(["analyze", str(tmp_path / name), "--model-option", "width_mult=0.125"]) == 2
        assert msg in capsys.readouterr().err


def test_checkpoint_with_model_cfg_needs_no_flags(tmp_path):
    """`orepa train` checkpoints carry a model_cfg: analyze rebuilds the architecture from it."""
    from orepa.apps.bench import build_variant
    from orepa.cli import main

    torch.manual_seed(0)
    opts = {"width_mult": 0.125, "small_input": True, "scaling": "none"}
    model = build_variant("resnet18", "orepa", 10, 1, model_options=opts)
    cfg = {"model": "resnet18", "method": "orepa", "num_classes": 10, "in_chans": 1, "small_input": True,
           "width_mult": 0.125, "options": {"scaling": "none"}}
    ckpt = {"format": "orepa-checkpoint", "version": 1, "form": "train", "model_cfg": cfg,
            "model": model.state_dict(), "epoch": 0}
    torch.save(ckpt, tmp_path / "ck.pth")
    assert main(["analyze", str(tmp_path / "ck.pth"), "--out-dir", str(tmp_path / "o"), "--no-plot"]) == 0
    data = json.loads((tmp_path / "o" / "analysis.json").read_text())
    assert data["meta"]["options"] == opts
    assert len(data["layers"]) == 17  # small-input 3x3 stem + 16 convs; no deep stem
    assert all("scale" not in k for k in model.state_dict())  # scaling="none" really applied
    torch.save({**ckpt, "form": "deploy"}, tmp_path / "dep.pth")
    assert main(["analyze", str(tmp_path / "dep.pth"), "--output-dir", str(tmp_path / "o2")]) == 2


def test_a_directory_is_not_taken_for_a_checkpoint_or_a_model(tmp_path, capsys, monkeypatch):
    """A run directory was read as a model name ('unknown model') or 'no checkpoint file' (it exists)."""
    from orepa.cli import main

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    for target in ("run", "run/", str(run)):
        assert main(["analyze", target, "--output-dir", str(tmp_path / "a")]) == 2, target
        err = capsys.readouterr().err
        assert f"{target} is a directory; give a checkpoint file in it" in err and err.count("\n") == 1, err
        assert "unknown model" not in err
    _zoo_checkpoint(run)
    (run / "orepa.pt").rename(run / "checkpoint.pth")
    assert main(["analyze", "run", "--output-dir", str(tmp_path / "a")]) == 2
    assert "run is a directory; give a checkpoint file in it, e.g. run/checkpoint.pth" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "nope")]) == 2
    assert f"checkpoint {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    # what exists but is no file (a device), or a link to nothing: said as every command's loader says it
    assert main(["analyze", os.devnull]) == 2
    assert f"{os.devnull} is not a file" in capsys.readouterr().err
    (tmp_path / "dangling.pth").symlink_to(tmp_path / "gone.pth")
    assert main(["analyze", str(tmp_path / "dangling.pth")]) == 2
    assert "is a symbolic link to nothing" in capsys.readouterr().err
    # a model name is analysed as one, whatever folder of that name is here
    (tmp_path / "resnet18").mkdir()
    assert main(["analyze", "resnet18", "--width-mult", "0.0625", "--no-plot", "--output-dir", str(tmp_path / "m")]) == 0
    assert not (tmp_path / "a").exists()  # refused before anything is written


def test_an_analysis_of_another_model_is_replaced_only_with_overwrite(tmp_path, capsys):
    """analysis.json of another checkpoint was replaced without a word, and a --no-plot run left the
    earlier model's plots beside the new JSON; NaN in the classifier (no branch reads it) was refused
    as "its branch statistics would be NaN"."""
    from orepa.cli import main

    _, path = _zoo_checkpoint(tmp_path)
    out = tmp_path / "out"
    first = ["analyze", str(path), "-m", "resnet18", "--method", "orepa", "--option", "width_mult=0.125",
             "--out-dir", str(out)]
    assert main(first) == 0 and (out / "cosine.png").is_file()
    assert main([*first, "--no-plot"]) == 0  # a rerun of the same analysis replaces its own, plots included
    assert sorted(p.name for p in out.iterdir()) == ["analysis.json"]
    # ... its checkpoint named by another path too (it was "the analysis of" another checkpoint)
    (tmp_path / "link").symlink_to(path.parent, target_is_directory=True)
    other_name = tmp_path / "link" / path.name
    assert main([*first[:1], str(other_name), *first[2:], "--no-plot"]) == 0
    assert main([*first, "--no-plot"]) == 0
    before = (out / "analysis.json").read_bytes()
    other = ["analyze", "resnet18", "--width-mult", "0.0625", "--output-dir", str(out), "--no-plot"]
    capsys.readouterr()
    assert main(other) == 2
    assert (f"analysis.json holds the analysis of {path} (resnet18/orepa); pass --overwrite"
            in capsys.readouterr().err) and (out / "analysis.json").read_bytes() == before
    assert main([*other, "--overwrite"]) == 0
    assert json.loads((out / "analysis.json").read_text())["meta"]["options"] == {"width_mult": 0.0625}
    # non-finite values outside the branches change no branch statistic; inside them they are refused
    sd = load_checkpoint(path)["model"]
    for key, ok in (("fc.weight", True), ("layer1.0.conv1.branches.kxk.conv.weight", False)):
        bad = {k: v.clone() for k, v in sd.items()}
        bad[key].view(-1)[0] = float("nan")
        torch.save(bad, tmp_path / "nan.pt")
        capsys.readouterr()
        rc = main(["analyze", str(tmp_path / "nan.pt"), "-m", "resnet18", "--method", "orepa", "--option",
                   "width_mult=0.125", "--out-dir", str(tmp_path / f"nan_{ok}"), "--no-plot"])
        assert rc == (0 if ok else 2), key
        if not ok:
            assert f"holds non-finite values (NaN/inf), first in {key} (a branch)" in capsys.readouterr().err


def test_plots_of_an_analysis_s_names_beside_none_are_replaced_only_with_overwrite(tmp_path, capsys):
    """A folder holding a user's summary.png and no analysis.json lost it to `analyze --no-plot` (an
    earlier analysis' plots are removed) or had it overwritten; now that takes --overwrite."""
    from orepa.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.png").write_bytes(b"mine")
    cmd = ["analyze", "resnet18", "--width-mult", "0.0625", "--output-dir", str(out)]
    for extra in ([], ["--no-plot"]):
        assert main([*cmd, *extra]) == 2
        assert ("summary.png exist(s) beside no analysis.json (files this command writes or removes); pass "
                "--overwrite") in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["summary.png"]
        assert (out / "summary.png").read_bytes() == b"mine"
    assert main([*cmd, "--no-plot", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["analysis.json"]


def _ema_checkpoint(tmp_path):
    """An orepa train checkpoint whose EMA weights differ from its model's in every branch."""
    from orepa.apps.bench import build_variant

    torch.manual_seed(0)
    opts = {"width_mult": 0.125, "small_input": True}
    model = build_variant("resnet18", "orepa", 10, 1, model_options=opts)
    ema = build_variant("resnet18", "orepa", 10, 1, model_options=opts)
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(torch.randn_like(p))
    cfg = {"model": "resnet18", "method": "orepa", "num_classes": 10, "in_chans": 1, "small_input": True,
           "width_mult": 0.125, "options": {}}
    path = tmp_path / "run.pth"
    torch.save({"format": "orepa-checkpoint", "version": 1, "form": "train", "model_cfg": cfg,
                "model": model.state_dict(), "model_ema": ema.state_dict(), "epoch": 1}, path)
    return model, ema, path


def test_use_ema_analyses_the_checkpoints_ema_weights_and_says_so(tmp_path, capsys):
    """analyze had no --use-ema (eval, export and reparam have it): the EMA weights, which a run with
    --model-ema evaluates and deploys, could not be analysed. Its analysis says so, and neither
    analysis of one checkpoint passes for a rerun of the other."""
    from orepa.cli import main

    model, ema, path = _ema_checkpoint(tmp_path)
    out = tmp_path / "out"
    cmd = ["analyze", str(path), "--output-dir", str(out), "--no-plot"]
    assert main([*cmd, "--use-ema"]) == 0
    assert f"{path} (its EMA weights): 17 blocks" in capsys.readouterr().out
    data = json.loads((out / "analysis.json").read_text())
    assert data["meta"]["ema"] is True and data["meta"]["source"] == str(path)
    name = "layer1.0.conv1"
    expect, other = (analyze_block(m.get_submodule(name))["cosine"] for m in (ema, model))
    torch.testing.assert_close(torch.tensor(data["layers"][name]["cosine"]), torch.tensor(expect))
    assert not torch.allclose(torch.tensor(expect), torch.tensor(other))
    assert main([*cmd, "--use-ema"]) == 0  # a rerun of the same analysis replaces its own
    # the model's weights of the same checkpoint are another analysis, both ways
    before = (out / "analysis.json").read_bytes()
    capsys.readouterr()
    # (the refusal said "holds the analysis of" the very checkpoint given, not which weights differ)
    assert main(cmd) == 2
    assert (f"analysis.json holds the analysis of {path}'s EMA weights (resnet18/orepa), and this run analyses its "
            "model weights; pass --overwrite" in capsys.readouterr().err)
    assert (out / "analysis.json").read_bytes() == before
    assert main([*cmd, "--overwrite"]) == 0
    assert json.loads((out / "analysis.json").read_text())["meta"]["ema"] is False
    (tmp_path / "link").symlink_to(path.parent, target_is_directory=True)  # the checkpoint by another name
    assert main([*cmd[:1], str(tmp_path / "link" / path.name), *cmd[2:], "--use-ema"]) == 2
    assert (f"holds the analysis of {path}'s model weights (resnet18/orepa), and this run analyses its EMA weights; "
            "pass --overwrite") in capsys.readouterr().err
    # an analysis written before --use-ema (no "ema" in its meta) was of the model's weights
    held = json.loads((out / "analysis.json").read_text())
    del held["meta"]["ema"]
    (out / "analysis.json").write_text(json.dumps(held))
    assert main(cmd) == 0
    # the errors of the other commands' --use-ema, from the same loader
    held = torch.load(path, weights_only=True)
    torch.save({k: v for k, v in held.items() if k != "model_ema"}, tmp_path / "no_ema.pth")
    torch.save({**held, "model_ema": None}, tmp_path / "none_ema.pth")  # (it was a TypeError)
    for argv, message in (
            ([str(tmp_path / "no_ema.pth")], "no_ema.pth has no EMA weights (train with --model-ema)"),
            ([str(tmp_path / "none_ema.pth")], "none_ema.pth has no EMA weights (train with --model-ema)"),
            (["resnet18", "--width-mult", "0.0625"], "--use-ema needs a checkpoint with EMA weights")):
        assert main(["analyze", *argv, "--use-ema", "--output-dir", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()
    # non-finite EMA weights (the model's finite): every command says it was the EMA's
    nan_ema = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in held["model_ema"].items()}
    torch.save({**held, "model_ema": nan_ema}, tmp_path / "nan_ema.pth")
    nan_path = tmp_path / "nan_ema.pth"
    for argv in (["analyze", str(nan_path), "--output-dir", str(tmp_path / "x")],
                 ["export", str(nan_path), "-o", str(tmp_path / "m.onnx"), "--input-size", "32"],
                 ["reparam", str(nan_path), "-o", str(tmp_path / "d.pth"), "--no-verify"]):
        assert main([*argv, "--use-ema"]) == 2, argv
        err = capsys.readouterr().err
        assert f"{nan_path} (its EMA weights) holds non-finite values" in err, (argv, err)


@pytest.mark.parametrize("small_input", [True, False])
def test_a_bare_state_dict_of_the_other_stem_names_the_stem_flag(small_input, tmp_path, capsys):
    """A bare state_dict of a small-input (CIFAR / Fashion-MNIST style) OREPA ResNet analysed without
    --small-input got "pass the --method it was trained with" (its 3x3 stem block against the deep
    stem reads as other branches), though --method was right; the hint now names the stem's flag."""
    from orepa.apps.bench import build_variant
    from orepa.cli import main

    torch.manual_seed(0)
    model = build_variant("resnet18", "orepa", 10, model_options={"width_mult": 0.125, "small_input": small_input})
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    cmd = ["analyze", str(tmp_path / "sd.pt"), "-m", "resnet18", "--method", "orepa", "--option", "width_mult=0.125",
           "--output-dir", str(tmp_path / "out"), "--no-plot"]
    wrong, right = ("--no-small-input", "--small-input") if small_input else ("--small-input", "--no-small-input")
    for given in ([], [wrong]) if small_input else ([wrong],):
        assert main([*cmd, *given]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pass {right}." in err and "--method it was trained with" not in err, err
    assert main([*cmd, right]) == 0
