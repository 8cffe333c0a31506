"""``orepa.import_reference``: checkpoints of the paper's public code, imported exactly.

The fixtures (made with the authors' code, ``../shared/fixtures/reference``) must give the
reference's float64 output to relative 1e-9, in training form and deployed. Architectures
no fixture covers (other depths, odd widths, groups, DBB bottlenecks, RepVGG-B) are checked
against :mod:`reference_layout`, an evaluator of the reference layout that does not use
orepa and that reproduces the fixtures itself.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from reference_layout import (
    deep_stem_kernel,
    deploy_reference,
    make_repvgg,
    make_resnet,
    repvgg_forward,
    resnet_forward,
)

import orepa
import orepa.models

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "reference"
FILES = sorted(FIXTURES.glob("*.pt")) if FIXTURES.is_dir() else []
needs_fixtures = pytest.mark.skipif(not FILES, reason=f"reference fixtures not found in {FIXTURES} "
                                    "(../shared/fixtures/reference is provided outside this repository)")
X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check_import(sd_or_path, expected: torch.Tensor, x: torch.Tensor, tol: float = 1e-9) -> torch.nn.Module:
    model = orepa.import_reference(sd_or_path, dtype=torch.float64).eval()
    with torch.no_grad():
        assert rel(model(x), expected) < tol
        deployed = orepa.reparameterize(model, fuse_bn=True)
        assert not any(isinstance(m, orepa.ReparamConv2d) for m in deployed.modules())
        assert rel(deployed(x), expected) < tol
        vanilla = orepa.reparameterize(model)  # the zoo's base layout, key for key
        base = orepa.models.create_model(model.orepa_config["name"], "base",
                                         num_classes=model.orepa_config["num_classes"],
                                         widths=model.orepa_config["widths"],
                                         stem_width=model.orepa_config["stem_width"]).double().eval()
        base.load_state_dict(vanilla.state_dict(), strict=True)
        assert rel(base(x), expected) < tol
    return model


@pytest.mark.slow
@needs_fixtures
@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_fixture_imports_exactly(path):
    fx = torch.load(path, weights_only=True)
    x, expected = fx["input"].double(), fx["output_float64"]
    model = check_import(path, expected, x)
    method = {"OREPA": "orepa", "OREPA_VGG": "orepa-vgg", "DBB": "dbb"}[fx["impl"]]
    assert model.orepa_config["method"] == method
    # float32, as users load it: the reference's own float32 output to float32 precision
    model32 = orepa.import_reference(path).eval()
    assert next(model32.parameters()).dtype == torch.float32
    with torch.no_grad():
        assert rel(model32(fx["input"]).double(), fx["output"].double()) < 1e-4


@needs_fixtures
@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_independent_evaluator_reproduces_the_fixtures(path):
    """The evaluator used below as the reference is itself right on what the authors' code computed."""
    fx = torch.load(path, weights_only=True)
    forward = repvgg_forward if fx["impl"] == "OREPA_VGG" else resnet_forward
    assert rel(forward(fx["state_dict"], fx["input"]), fx["output_float64"]) < 1e-12


CASES = {  # name: (random reference checkpoint, the zoo model and method it must import as)
    # ResNet-34 depth at the reference's int(64 * 0.15) widths: odd stem (deep-stem prior flip is no sign flip)
    "resnet34_orepa_w0.15": (lambda: make_resnet("orepa", [3, 4, 6, 3], [9, 19, 38, 76], seed=1),
                             "resnet34", "orepa"),
    "resnet101_orepa_tiny": (lambda: make_resnet("orepa", [3, 4, 23, 3], [4, 8, 16, 32], bottleneck=True, seed=2),
                             "resnet101", "orepa"),
    "resnext50_32x4d_orepa": (lambda: make_resnet("orepa", [3, 4, 6, 3], [16, 32, 64, 128], bottleneck=True,
                                                  groups=32, width_per_group=4, stem=8, seed=3),
                              "resnext50_32x4d", "orepa"),
    "resnet50_dbb_tiny": (lambda: make_resnet("dbb", [3, 4, 6, 3], [4, 8, 16, 32], bottleneck=True, seed=4),
                          "resnet50", "dbb"),
    "resnet34_dbb_odd": (lambda: make_resnet("dbb", [3, 4, 6, 3], [5, 11, 19, 38], seed=5), "resnet34", "dbb"),
    "resnet18_base": (lambda: make_resnet("base", [2, 2, 2, 2], [8, 16, 32, 64], seed=6), "resnet18", "base"),
    "repvgg_b0_orepa_vgg": (lambda: make_repvgg([4, 6, 16, 1], [8, 16, 32, 80], 8, seed=7), "repvgg_b0",
                            "orepa-vgg"),
    "repvgg_a_repvgg_odd": (lambda: make_repvgg([2, 4, 14, 1], [9, 19, 37, 73], 9, kind="repvgg", seed=8),
                            "repvgg_a0", "repvgg"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_other_architectures_import_exactly(case):
    make, name, method = CASES[case]
    sd = make()
    forward = repvgg_forward if "repvgg" in case else resnet_forward
    model = check_import(sd, forward(sd, X), X)
    assert (model.orepa_config["name"], model.orepa_config["method"]) == (name, method)


def test_plain_repvgg_of_the_training_scripts_base_type_imports_as_base():
    """The reference's RepVGG is built with conv_bn_relu: its -t base checkpoint (stage0.conv / stage0.bn,
    ConvBN blocks) was refused as "not a checkpoint of the paper's ResNet or RepVGG models"."""
    sd = make_repvgg([2, 4, 14, 1], [6, 12, 24, 48], 6, kind="base", seed=18)
    model = check_import(sd, repvgg_forward(sd, X), X, tol=1e-13)
    assert (model.orepa_config["name"], model.orepa_config["method"]) == ("repvgg_a0", "base")


def _check_deployed_import(sd, expected, x, tol=1e-12):
    """The deployed form of reference checkpoint ``sd`` (what its conversion script writes) imports
    as the zoo's deployed network, BNs folded, and computes ``expected``."""
    model = orepa.import_reference(deploy_reference(sd), dtype=torch.float64)
    assert not any(isinstance(m, (orepa.ReparamConv2d, torch.nn.BatchNorm2d)) for m in model.modules())
    cfg = model.orepa_config
    zoo = orepa.models.create_model(cfg["name"], cfg["method"], **{k: v for k, v in cfg.items()
                                                                   if k not in ("name", "method")})
    assert model.state_dict().keys() == orepa.reparameterize(zoo.eval(), fuse_bn=True).state_dict().keys()
    with torch.no_grad():
        assert rel(model(x), expected) < tol
    return model


@needs_fixtures
@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_a_fixtures_deployed_form_imports_as_its_deployed_network(path):
    """The conversion script's output for each fixture (``deploy_reference``: every block's kernel and
    bias read off the evaluator, which does not use orepa): the reference's float64 logits."""
    fx = torch.load(path, weights_only=True)
    model = _check_deployed_import(fx["state_dict"], fx["output_float64"], fx["input"].double())
    # the deployed keys name the block, not RepVGG's from OREPA-VGG's (both rbr_reparam): imported as repvgg
    method = {"OREPA": "orepa", "OREPA_VGG": "repvgg", "DBB": "dbb"}[fx["impl"]]
    assert model.orepa_config["method"] == method


@pytest.mark.parametrize("arch", ["resnet", "repvgg"])
def test_a_deployed_plain_reference_checkpoint_imports_as_the_plain_network(arch):
    """The reference's conversion of a -t base model leaves each ConvBN a conv with a bias and no BN
    (``<site>.conv``)."""
    sd = (make_resnet("base", [2, 2, 2, 2], [4, 8, 16, 32], seed=13) if arch == "resnet"
          else make_repvgg([2, 4, 14, 1], [6, 12, 24, 48], 6, kind="base", seed=18))
    forward = resnet_forward if arch == "resnet" else repvgg_forward
    model = _check_deployed_import(sd, forward(sd, X), X)
    assert model.orepa_config["method"] == "base"


def test_a_deployed_orepa_resnet50_imports_and_a_site_in_another_form_or_name_is_said():
    """The reference's conversion of a ResNet-50 of OREPA blocks, Rep-1x1s and a deep stem leaves
    ``orepa_reparam``, ``or1x1_reparam`` and ``or_large_reparam``: imported as that network; a module
    left in the training form, or a conv under a name the conversion does not write, is said."""
    sd = make_resnet("orepa", [3, 4, 6, 3], [4, 8, 16, 32], bottleneck=True, seed=12)
    model = _check_deployed_import(sd, resnet_forward(sd, X), X)
    assert {k: model.orepa_config[k] for k in ("name", "method", "deep_stem", "rep_1x1")} == {
        "name": "resnet50", "method": "orepa", "deep_stem": True, "rep_1x1": True}
    # a module in the other form, or a conv under a name the conversion does not write: said
    deployed = deploy_reference(sd)
    training_site = {k: v for k, v in sd.items() if k.startswith("stage2.1.conv2.")}
    mixed = {**{k: v for k, v in deployed.items() if not k.startswith("stage2.1.conv2.")}, **training_site}
    with pytest.raises(ValueError, match=r"stage2.1.conv2 is in the training form .* other 52 modules in the "
                                         r"deployed form"):
        orepa.import_reference(mixed)
    renamed = {k.replace("stage2.1.conv2.orepa_reparam.", "stage2.1.conv2."): v for k, v in deployed.items()}
    with pytest.raises(ValueError, match=r"at 'stage2.1.conv2' .*a deployed layout, but not under a name the "
                                         r"reference's conversion script writes \(conv, dbb_reparam"):
        orepa.import_reference(renamed)


def test_orepa_vgg_reads_only_the_scaling_rows_the_reference_reads():
    """OREPA-VGG's 6th scaling row (in == out, stride 1) is an uninitialised torch.Tensor that the
    reference's weight_gen never reads: nan or inf there leaves its model working, and the import."""
    sd = make_repvgg([2, 4, 14, 1], [8, 16, 32, 64], 8, seed=19)
    six = [k for k in sd if k.endswith("rbr_dense.vector") and sd[k].shape[0] == 6]
    assert six
    for i, k in enumerate(six):
        sd[k] = sd[k].clone()
        sd[k][5] = (float("nan"), float("inf"))[i % 2]
    check_import(sd, repvgg_forward(sd, X), X, tol=1e-13)
    sd[six[0]][4, 0] = float("nan")  # a row it reads is still checked
    with pytest.raises(ValueError, match=rf"non-finite values \(nan or inf\) in '{six[0]}'"):
        orepa.import_reference(sd)


def test_odd_width_deep_stem_is_exact_in_float64():
    """An odd stem width's flipped prior needs a kxk correction: built from the exact prior, while the block
    (and the reference) holds it rounded to float32, the 7x7 stem kernel was off by ~3e-8."""
    sd = make_resnet("orepa", [2, 2, 2, 2], [9, 18, 36, 72], seed=20)
    model = orepa.import_reference(sd, dtype=torch.float64).eval()
    with torch.no_grad():
        ours = orepa.reparameterize(model).conv1.weight
    expected = deep_stem_kernel({k: v.double() for k, v in sd.items() if v.is_floating_point()}, "stage0.conv1.")
    assert rel(ours, expected) < 1e-14


def test_training_script_wrapping_and_module_prefix(tmp_path):
    sd = make_resnet("orepa", [2, 2, 2, 2], [8, 16, 32, 64], seed=9)
    wrapped = {"epoch": 3, "arch": "ResNet-18", "best_acc1": torch.tensor(1.0),
               "state_dict": {f"module.{k}": v for k, v in sd.items()}, "optimizer": {"state": {}, "param_groups": []}}
    path = tmp_path / "checkpoint.pth.tar"
    torch.save(wrapped, path)
    a = orepa.import_reference(sd, dtype=torch.float64).eval()
    b = orepa.import_reference(path, dtype=torch.float64).eval()
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    # the library reads what every command reads: other wrapper keys, torch.compile's prefix
    for other in ({"model": {f"_orig_mod.{k}": v for k, v in sd.items()}},
                  {"model_state_dict": {f"module._orig_mod.{k}": v for k, v in sd.items()}, "epoch": 1}):
        c = orepa.import_reference(other, dtype=torch.float64).eval().state_dict()  # (once: not per key)
        assert all(torch.equal(v, c[k]) for k, v in a.state_dict().items())


def test_averaged_model_and_count_free_state_dicts_import():
    """Two state_dicts torch itself loads into the reference model were refused: an EMA kept by
    torch's ``AveragedModel`` (``module.`` keys and its step counter ``n_averaged``: "1 reference
    key(s) match nothing: n_averaged") and one without the BNs' ``num_batches_tracked`` (PyTorch
    before 0.4.1, or filtered out: "missing [...num_batches_tracked...]"); a BN with momentum 0.1
    never reads that count."""
    sd = make_resnet("dbb", [2, 2, 2, 2], [4, 8, 16, 32], seed=18)
    expected = resnet_forward(sd, X)
    ema = {**{f"module.{k}": v for k, v in sd.items()}, "n_averaged": torch.tensor(7)}
    model = orepa.import_reference({"state_dict": ema}, dtype=torch.float64).eval()
    with torch.no_grad():
        assert rel(model(X), expected) < 1e-12
    counts = [k for k in sd if k.endswith("num_batches_tracked")]
    assert counts
    model = orepa.import_reference({k: v for k, v in sd.items() if k not in counts}, dtype=torch.float64).eval()
    with torch.no_grad():
        assert rel(model(X), expected) < 1e-12
    assert all(int(v) == 0 for k, v in model.state_dict().items() if k.endswith("num_batches_tracked"))
    # where the checkpoint has them, they are carried over
    model = orepa.import_reference(sd, dtype=torch.float64)
    assert int(model.state_dict()["layer1.0.conv1.branches.kxk.bn.num_batches_tracked"]) == 3


@pytest.mark.parametrize("mult,name", [(1.5, "wide_resnet18_1_5"), (2, "wide_resnet18_2"), (1, "resnet18")])
def test_a_wide_resnet18_imports_as_the_zoo_model_of_its_widths(mult, name):
    """The reference's ResNet-18-1.5x / -2x (``width_multiplier``; the authors released WideResNet-18 x2)
    imported as ``resnet18`` with explicit widths, where the zoo has them by name (as RepVGGs are named)."""
    w = [int(c * mult) for c in (64, 128, 256, 512)]
    sd = make_resnet("base", [2, 2, 2, 2], w, seed=19)
    model = orepa.import_reference(sd)
    assert model.orepa_config["name"] == name and model.orepa_config["widths"] == w
    assert model.orepa_config["stem_width"] == w[0]


def test_imported_model_trains_like_the_zoo_model():
    """The import is a training-form model: its online path gives the same gradients as its offline twin."""
    sd = make_resnet("orepa", [2, 2, 2, 2], [8, 16, 32, 64], seed=10)
    model = orepa.import_reference(sd, dtype=torch.float64).train()
    loss = model(X).logsumexp(1).sum()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_unknown_layouts_are_refused_with_the_keys():
    with pytest.raises(ValueError, match="first keys: features.0.weight"):
        orepa.import_reference({"features.0.weight": torch.zeros(8, 3, 3, 3)})
    sd = make_resnet("orepa", [2, 2, 2, 2], [8, 16, 32, 64], seed=11)
    sd["stage1.0.conv1.weight_orepa_extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="stage1.0.conv1.weight_orepa_extra"):
        orepa.import_reference(sd)
    del sd["stage1.0.conv1.weight_orepa_extra"]
    del sd["stage2.1.conv2.weight_orepa_gconv_pw"]
    with pytest.raises(ValueError, match="stage2.1.conv2.weight_orepa_gconv_pw"):
        orepa.import_reference(sd)
    # block types mixed (the first stage plain, the others OREPA): said as such, not blamed on the stem
    plain = make_resnet("base", [2, 2, 2, 2], [8, 16, 32, 64], seed=11)
    mixed = {**{k: v for k, v in sd.items() if not k.startswith("stage1.")},
             **{k: v for k, v in plain.items() if k.startswith("stage1.")}}
    with pytest.raises(ValueError, match=r"mixes block types in its 3x3 convs \(conv_bn from stage1.0.conv1, "
                                         r"orepa from stage2.0.conv1\)"):
        orepa.import_reference(mixed)
    # one site as the reference's conversion script leaves it (one conv with a bias, no BN), the rest trained
    sd = make_resnet("orepa", [2, 2, 2, 2], [8, 16, 32, 64], seed=11)
    site = "stage1.0.conv1"
    w = sd[f"{site}.weight_orepa_origin"]
    sd = {k: v for k, v in sd.items() if not k.startswith(site + ".")}
    sd.update({f"{site}.orepa_reparam.weight": w, f"{site}.orepa_reparam.bias": torch.zeros(w.shape[0])})
    with pytest.raises(ValueError, match=r"stage1.0.conv1 is in the deployed form .* other 19 modules in the "
                                         r"training form"):
        orepa.import_reference(sd)
    with pytest.raises(ValueError, match="not a reference checkpoint"):
        orepa.import_reference({"state_dict": {}})
    with pytest.raises(ValueError, match="does not exist"):
        orepa.import_reference("/nonexistent/ckpt.pth")


def test_hostile_pickle_is_not_run(tmp_path):
    class Boom:
        def __reduce__(self):
            return (exec, ("open(%r, 'w').write('ran')" % str(tmp_path / "ran"),))

    path = tmp_path / "evil.pth"
    torch.save({"state_dict": {"x": Boom()}}, path)
    with pytest.raises(ValueError, match="weights_only=True"):
        orepa.import_reference(path)
    assert not (tmp_path / "ran").exists()


# --------------------------------------------------------------------------- orepa import-reference


def test_cli_writes_training_and_deployed_checkpoints(tmp_path, capsys):
    from orepa.apps.checkpoint import load_checkpoint, model_from_checkpoint
    from orepa.cli import main

    sd = make_resnet("orepa", [3, 4, 6, 3], [4, 8, 16, 32], bottleneck=True, seed=12)
    src = tmp_path / "ref.pth.tar"
    torch.save({"state_dict": {f"module.{k}": v for k, v in sd.items()}, "epoch": 120}, src)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = orepa.import_reference(src).eval()(x)
    assert main(["import-reference", str(src), "-o", str(tmp_path / "train.pth")]) == 0
    ckpt = load_checkpoint(tmp_path / "train.pth")
    assert ckpt["form"] == "train" and ckpt["model_cfg"]["model"] == "resnet50" and "optimizer" not in ckpt
    model, cfg, form = model_from_checkpoint(ckpt, tmp_path / "train.pth")
    assert form == "train" and cfg["options"]["widths"] == [4, 8, 16, 32]
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    capsys.readouterr()
    assert main(["import-reference", str(src), "-o", str(tmp_path / "dep.pth"), "--deploy", "--fuse-bn"]) == 0
    assert re.search(r"max \|logit diff\| \S+ \(tolerance \S+\)", capsys.readouterr().out)  # (the bound it was held to)
    dep = load_checkpoint(tmp_path / "dep.pth")
    model, _, form = model_from_checkpoint(dep, tmp_path / "dep.pth")
    assert form == "deploy-fused" and not any(isinstance(m, orepa.ReparamConv2d) for m in model.modules())
    with torch.no_grad():
        assert (model(x) - expected).abs().max() <= 1e-4 * (1 + expected.abs().max())
    # the conversion script's output: only as the deployed network (said), then as the checkpoint above
    deployed = tmp_path / "converted.pth"
    torch.save(deploy_reference(sd), deployed)
    capsys.readouterr()
    for flags in ([], ["--deploy"]):
        assert main(["import-reference", str(deployed), "-o", str(tmp_path / "c.pth"), *flags]) == 2
        assert "is a deployed checkpoint of the reference code" in capsys.readouterr().err
    assert main(["eval", str(deployed), "--data-path", str(tmp_path)]) == 2  # another command: named, with the flags
    assert f"orepa import-reference {deployed} -o OUT.pth --deploy --fuse-bn`" in capsys.readouterr().err
    assert main(["import-reference", str(deployed), "-o", str(tmp_path / "c.pth"), "--deploy", "--fuse-bn"]) == 0
    assert "(the reference's deployed form)" in capsys.readouterr().out
    converted = load_checkpoint(tmp_path / "c.pth")
    assert converted["model"].keys() == dep["model"].keys() and converted["model_cfg"] == dep["model_cfg"]
    model, _, form = model_from_checkpoint(converted, tmp_path / "c.pth")
    with torch.no_grad():
        assert form == "deploy-fused" and (model(x) - expected).abs().max() <= 1e-4 * (1 + expected.abs().max())


def test_cli_a_written_form_that_computes_otherwise_fails_its_check_with_exit_1(tmp_path, capsys, monkeypatch):
    """The check of what import-reference writes is a failed check (exit 1, as reparam's and export's),
    not a usage error (2), and writes nothing."""
    from orepa.apps import import_reference
    from orepa.cli import main

    src = tmp_path / "ref.pth.tar"
    torch.save({"state_dict": make_resnet("orepa", [2, 2, 2, 2], [4, 8, 16, 32], seed=5)}, src)
    reread = import_reference.model_from_checkpoint

    def off(*args, **kwargs):  # what was written computes other logits
        model, cfg, form = reread(*args, **kwargs)
        with torch.no_grad():
            model.fc.bias.add_(1.0)
        return model, cfg, form

    monkeypatch.setattr(import_reference, "model_from_checkpoint", off)
    capsys.readouterr()
    assert main(["import-reference", str(src), "-o", str(tmp_path / "out.pth")]) == 1
    err = capsys.readouterr().err
    assert "computes other logits than the imported model" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.pth").exists()


@pytest.mark.parametrize("case", ["exists", "same", "missing", "garbage", "fuse_without_deploy"])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    from orepa.cli import main

    src = tmp_path / "ref.pth"
    torch.save(make_resnet("base", [2, 2, 2, 2], [4, 8, 16, 32], seed=13), src)
    out = tmp_path / "out.pth"
    out.write_bytes(b"keep me")
    argv = {"exists": [str(src), "-o", str(out)],
            "same": [str(src), "-o", str(src), "--overwrite"],
            "missing": [str(tmp_path / "nope.pth"), "-o", str(tmp_path / "new.pth")],
            "garbage": [str(out), "-o", str(tmp_path / "new.pth")],
            "fuse_without_deploy": [str(src), "-o", str(tmp_path / "new.pth"), "--fuse-bn"]}[case]
    capsys.readouterr()
    assert main(["import-reference", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("orepa import-reference: error: ")
    assert out.read_bytes() == b"keep me" and not (tmp_path / "new.pth").exists()


def test_cli_never_replaces_a_run_checkpoint(tmp_path, capsys):
    """--overwrite replaced a run's checkpoint.pth (its optimizer state: the run's resumable state)."""
    from orepa.apps.model_cfg import model_cfg_of
    from orepa.cli import main

    src = tmp_path / "ref.pth"
    torch.save(make_resnet("base", [2, 2, 2, 2], [4, 8, 16, 32], seed=13), src)
    model = orepa.models.create_model("resnet18", "orepa", num_classes=10, width_mult=0.0625)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()
    run = tmp_path / "run" / "checkpoint.pth"  # as orepa train writes it
    run.parent.mkdir()
    torch.save({"format": "orepa-checkpoint", "version": 1, "form": "train", "model_cfg": model_cfg_of(model),
                "model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, run)
    before = run.read_bytes()
    for extra in (["--overwrite"], ["--overwrite", "--deploy"], []):
        capsys.readouterr()
        assert main(["import-reference", str(src), "-o", str(run), *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--output {run} is the training checkpoint of a run" in err[0], err
        assert "pass --overwrite" not in err[0]
    assert run.read_bytes() == before
    # an earlier import (no optimizer state) is still replaced with --overwrite
    assert main(["import-reference", str(src), "-o", str(tmp_path / "imp.pth")]) == 0
    assert main(["import-reference", str(src), "-o", str(tmp_path / "imp.pth"), "--overwrite", "--deploy"]) == 0
    assert torch.load(tmp_path / "imp.pth", weights_only=True)["form"] == "deploy"


@pytest.mark.parametrize("flag,classes", [("--resume", 2), ("--init-from", 5)])
def test_train_fine_tunes_an_imported_checkpoint(tmp_path, capsys, flag, classes):
    """`orepa train --resume` or `--init-from` on an import-reference checkpoint starts a run from its
    weights (fresh optimizer and schedule, that command's settings); the imported architecture is
    kept, and a classifier for the data's 2 classes is made where the import has 5."""
    from PIL import Image

    from orepa.apps.checkpoint import load_checkpoint
    from orepa.cli import main

    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 8), ("val", 4)):
        for cls in ("a", "b"):
            d = tmp_path / "imgs" / split / cls
            d.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(torch.randint(0, 255, (40, 40, 3), generator=g, dtype=torch.uint8).numpy()).save(
                    d / f"{i}.png")
    sd = make_resnet("orepa", [2, 2, 2, 2], [4, 8, 16, 32], num_classes=classes, seed=14)
    torch.save({"state_dict": sd}, tmp_path / "ref.pth")
    assert main(["import-reference", str(tmp_path / "ref.pth"), "-o", str(tmp_path / "start.pth")]) == 0
    out = tmp_path / "run"
    capsys.readouterr()
    rc = main(["train", flag, str(tmp_path / "start.pth"), "--data-path", str(tmp_path / "imgs"),
               "--epochs", "1", "-b", "4", "--lr", "1e-7", "--lr-warmup-epochs", "0", "--train-crop-size", "32",
               "--val-resize-size", "36", "--val-crop-size", "32", "-j", "0", "--no-progress",
               "--no-tensorboard", "--no-curves",
               "--output-dir", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0 and f"starting from the weights of {tmp_path / 'start.pth'} (imported from " in stdout
    assert ("a new 2-class classifier (fc.weight, fc.bias) in place of the checkpoint's 5-class one" in stdout) == (
        classes == 5)
    start, end = load_checkpoint(tmp_path / "start.pth"), load_checkpoint(out / "checkpoint.pth")
    assert end["model_cfg"] == {**start["model_cfg"], "num_classes": 2} and end["epoch"] == 1
    assert end["model"]["fc.weight"].shape[0] == 2
    w = "layer2.0.conv1.branches.kxk.conv.weight"  # lr 1e-7: the imported weights, barely moved
    assert 0 < (end["model"][w] - start["model"][w]).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_import(dtype):
    """Their fixed filters (avg, frequency prior) are stored rounded to the checkpoint's precision:
    compared at that precision, not refused as another filter."""
    sd = make_resnet("orepa", [2, 2, 2, 2], [8, 16, 32, 64], seed=15)
    half = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    model = orepa.import_reference(half, dtype=torch.float64).eval()
    rounded = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in half.items()}
    with torch.no_grad():
        # the import computes the fixed filters exactly; the evaluator reads them rounded
        assert rel(model(X), resnet_forward(rounded, X)) < torch.finfo(dtype).eps


def test_damaged_tensors_are_refused_naming_the_key(tmp_path, capsys):
    from orepa.cli import main

    sd = make_resnet("orepa", [2, 2, 2, 2], [8, 16, 32, 64], seed=16)
    nan = dict(sd)
    nan["stage3.1.conv2.weight_orepa_origin"] = sd["stage3.1.conv2.weight_orepa_origin"].clone()
    nan["stage3.1.conv2.weight_orepa_origin"][0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite values \(nan or inf\) in 'stage3.1.conv2.weight_orepa_origin'"):
        orepa.import_reference(nan)
    var = next(k for k in sd if k.endswith("running_var"))
    negative = {**sd, var: sd[var].clone()}
    negative[var][0] = -1.0  # imported, it gave nan logits and "max |diff| nan > nan"
    with pytest.raises(ValueError, match=f"a negative running variance in '{var}'"):
        orepa.import_reference(negative)
    avg = next(k for k in sd if k.endswith("weight_orepa_avg_avg"))
    ints = {**sd, avg: sd[avg].long()}
    with pytest.raises(ValueError, match=f"{avg} holds torch.int64 values"):
        orepa.import_reference(ints)
    head = next(k for k in sd if k.endswith("weight") and sd[k].dim() == 2)  # the classifier: was cast silently
    with pytest.raises(ValueError, match=f"{head} holds torch.int64 values, where a float weight"):
        orepa.import_reference({**sd, head: sd[head].long()})
    key = "stage1.0.conv1.weight_orepa_origin"
    flat = {**sd, key: sd[key].flatten()}  # a tensor of the wrong rank
    torch.save(flat, tmp_path / "flat.pth")
    capsys.readouterr()
    assert main(["import-reference", str(tmp_path / "flat.pth"), "-o", str(tmp_path / "out.pth")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has the wrong shape or type" in err[0] and not (tmp_path / "out.pth").exists()
    # the Python API says ValueError (an IndexError from the architecture's reading escaped it)
    with pytest.raises(ValueError, match="reading the architecture: a tensor of the checkpoint has the wrong shape"):
        orepa.import_reference(flat)
    # the reference's vector has a row per branch kind, 6: a 7th was taken silently
    vec = "stage1.0.conv1.vector"
    with pytest.raises(ValueError, match=f"{vec} has 7 rows, expected 6"):
        orepa.import_reference({**sd, vec: torch.cat([sd[vec], sd[vec][:1]])})


def test_a_tensor_with_no_rows_is_one_line(tmp_path, capsys):
    """A DBB identity conv with no rows: its group count came out 0 and the import ended in a
    ZeroDivisionError traceback (orepa.import_reference: the ZeroDivisionError, not its ValueError)."""
    from orepa.cli import main

    sd = make_resnet("dbb", [2, 2, 2, 2], [4, 8, 16, 32], seed=3)
    key = "stage2.0.conv1.dbb_1x1_kxk.idconv1.weight"
    torch.save({**sd, key: sd[key][:0]}, tmp_path / "ref.pth")
    capsys.readouterr()
    assert main(["import-reference", str(tmp_path / "ref.pth"), "-o", str(tmp_path / "out.pth")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reading reference module 'stage2.0.conv1': a tensor of the checkpoint has the wrong " \
        "shape or type for the reference layout (ZeroDivisionError" in err[0], err
    assert not (tmp_path / "out.pth").exists()
    with pytest.raises(ValueError, match="wrong shape or type"):  # the library's documented error, not the CLI's
        orepa.import_reference({**sd, key: sd[key][:0]})


def test_train_resume_of_an_import_that_does_not_fit_the_data_is_one_line(tmp_path, capsys):
    """A 3-channel import fine-tuned on Fashion-MNIST (1 channel): one error line, not a shape
    error at the first batch."""
    from orepa.cli import main

    torch.save(make_resnet("orepa", [2, 2, 2, 2], [4, 8, 16, 32], num_classes=10, seed=17), tmp_path / "ref.pth")
    assert main(["import-reference", str(tmp_path / "ref.pth"), "-o", str(tmp_path / "start.pth")]) == 0
    capsys.readouterr()
    rc = main(["train", "--resume", str(tmp_path / "start.pth"), "--epochs", "1", "-b", "4", "--max-steps", "1",
               "--train-subset", "16", "--val-subset", "8", "--no-progress", "--no-tensorboard", "--no-curves",
               "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "takes 3-channel images but fashion-mnist has 1 channel(s)" in err[0]
    assert "but for conv1 (OREPADeepStem), which no conv's weights can start; build the model without it" in err[0]


def test_a_checkpoint_of_the_papers_code_given_to_another_command_names_import_reference(tmp_path, capsys):
    """Its keys fit no model of this package: every other command listed hundreds of unexpected keys
    (or asked for --model, which could not help); now each names the command that reads it."""
    from orepa.cli import main

    sd = make_resnet("orepa", [2, 2, 2, 2], [4, 8, 16, 32], bottleneck=False, seed=3)
    src = tmp_path / "ref.pth.tar"
    torch.save({"state_dict": sd, "epoch": 1}, src)
    for argv in (["eval", str(src)], ["export", str(src), "-o", str(tmp_path / "m.onnx")],
                 ["analyze", str(src), "--output-dir", str(tmp_path / "a")],
                 ["train", "--init-from", str(src), "--output-dir", str(tmp_path / "t")]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "holds a model in the layout of the paper's own code" in err and \
            f"orepa import-reference {src} -o OUT.pth" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.pth.tar"]
    # a detection backbone given it (a list of keys in every form before)
    from orepa.apps.detection import resnet_features

    with pytest.raises(ValueError, match="layout of the paper's own code: convert it first"):
        resnet_features("resnet18", "orepa", weights=src)


def test_cli_imports_a_checkpoints_ema_weights_with_use_ema(tmp_path, capsys):
    """A timm-style file of the paper's code holding both the weights and their moving average
    (``state_dict_ema``, ``module.`` prefixed): ``--use-ema`` imports the average, recorded as EMA
    weights (a later --use-ema on the written file is said to be one too many); a file without one is
    said."""
    from orepa.apps.checkpoint import load_checkpoint, model_from_checkpoint
    from orepa.cli import main

    weights = make_resnet("orepa", [2, 2, 2, 2], [4, 8, 16, 32], seed=3)
    average = make_resnet("orepa", [2, 2, 2, 2], [4, 8, 16, 32], seed=4)
    src = tmp_path / "ref.pth.tar"
    torch.save({"state_dict": weights, "state_dict_ema": {f"module.{k}": v for k, v in average.items()}}, src)
    x = torch.randn(2, 3, 64, 64)
    for use_ema, sd in ((False, weights), (True, average)):
        out = tmp_path / f"ema{use_ema}.pth"
        assert main(["import-reference", str(src), "-o", str(out), *(["--use-ema"] if use_ema else [])]) == 0
        assert ("(its EMA weights)" in capsys.readouterr().out) == use_ema
        ckpt = load_checkpoint(out)
        assert ckpt["ema"] is use_ema
        model, _, _ = model_from_checkpoint(ckpt, out)
        with torch.no_grad():
            assert torch.equal(model.eval()(x), orepa.import_reference(sd).eval()(x))
    assert main(["export", str(tmp_path / "emaTrue.pth"), "--use-ema", "-o", str(tmp_path / "m.onnx")]) == 2
    assert "holds EMA weights as its model" in capsys.readouterr().err
    torch.save({"state_dict": weights}, src)
    assert main(["import-reference", str(src), "-o", str(tmp_path / "none.pth"), "--use-ema"]) == 2
    err = capsys.readouterr().err
    assert "holds no EMA weights (looked for model_ema / state_dict_ema" in err and err.count("\n") == 1
    assert not (tmp_path / "none.pth").exists()
