"""timm interop: registered names, create_model pass-through, features_only, reparameterize_model."""
import copy

import pytest
import torch
from conftest import tol_close, zoo_cases
from torch import nn

timm = pytest.importorskip("timm")

import orepa  # noqa: E402
import orepa.models as zoo  # noqa: E402
from orepa.models import timm_registry  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_name_and_method_is_registered():
    expected = {f"{m.replace('-', '_')}_{n}" for n in zoo.list_models() for m in zoo.list_methods(n)}
    assert set(zoo.TIMM_REGISTERED) == expected and len(expected) == 57
    assert expected <= set(timm.list_models())
    assert {"orepa_resnet50", "dbb_resnet18", "base_resnet18", "orepa_offline_resnet50", "orepa_vgg_repvgg_a0",
            "repvgg_online_repvgg_a0", "orepa_vgg_offline_repvgg_a0", "repvgg_repvgg_a0"} <= expected
    assert timm_registry.timm_name("repvgg_a0", "orepa-vgg-offline") == "orepa_vgg_offline_repvgg_a0"
    assert timm_registry.register() == zoo.TIMM_REGISTERED  # idempotent
    assert timm.models.get_pretrained_cfg("orepa_resnet50").first_conv == "conv1"


@pytest.mark.parametrize("first", ["orepa", "timm"])
def test_the_zoo_is_registered_when_timm_is_imported_before_or_after_orepa(first):
    """``import orepa`` does not import timm (every command would pay its import time); the zoo is
    registered with timm when timm's import runs, or at once where timm is imported already."""
    import subprocess
    import sys

    code = (f"import sys, {first}\n"
            "import orepa.models as zoo\n"
            "before = ('timm' in sys.modules, len(zoo.TIMM_REGISTERED))\n"
            "import timm\n"
            "m = timm.create_model('orepa_resnet18', num_classes=3, width_mult=0.25)\n"
            "print(before, len(zoo.TIMM_REGISTERED), type(m.conv1).__name__, type(timm.__loader__).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert " ".join(out) == ("(False, 0) 57 OREPADeepStem SourceFileLoader" if first == "orepa"
                             else "(True, 57) 57 OREPADeepStem SourceFileLoader"), out


def test_the_zoo_is_registered_when_its_timm_module_is_imported_first():
    """``import orepa.models.timm_registry`` before timm (docs/models.md calls its ``register``): its
    first lines import timm, whose import hook asked the half-made module for ``register`` (a
    circular-import warning, nothing registered)."""
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('error')\n"
            "import orepa.models.timm_registry as registry\n"
            "import orepa.models as zoo, timm\n"
            "print(len(zoo.TIMM_REGISTERED), len(registry.register()), 'orepa_resnet18' in timm.list_models())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.split() == ["57", "57", "True"], (run.stdout, run.stderr[-500:])


def test_the_zoo_is_registered_once_after_orepa_models_ran_again():
    """A second run of ``orepa.models`` (a reload, or ``sys.modules`` cleared and orepa imported
    again) leaves one import hook: two asked each other for timm's spec without end."""
    import subprocess
    import sys

    code = ("import importlib, sys, orepa\n"
            "for k in [k for k in sys.modules if k.split('.')[0] == 'orepa']: del sys.modules[k]\n"
            "import orepa\n"
            "importlib.reload(orepa.models)\n"
            "hooks = lambda: sum(hasattr(f, '_orepa_after_timm') for f in sys.meta_path)\n"
            "before = hooks()\n"
            "import timm\n"
            "print(before, len(orepa.models.TIMM_REGISTERED), hooks())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "57", "0"], out


def test_create_model_passes_options_through():
    m = timm.create_model("orepa_resnet18", num_classes=10, in_chans=1, small_input=True, width_mult=0.25,
                          preset="online-only")
    assert isinstance(m.layer1[0].conv1, orepa.OREPAConv2d)
    assert set(m.layer1[0].conv1.branches) == {"kxk", "1x1", "1x1_avg", "1x1_kxk"}
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert m.pretrained_cfg["classifier"] == "fc" and m.get_classifier() is m.fc
    m.reset_classifier(0)
    assert m(torch.randn(1, 1, 28, 28)).shape == (1, 128)
    with pytest.raises(ValueError, match="pretrained"):
        timm.create_model("orepa_resnet18", pretrained=True)
    with pytest.raises(ValueError, match="accepted"):
        timm.create_model("base_resnet18", drop_rate=0.1)


@pytest.mark.parametrize("variant,chans,reductions", [
    ("orepa_resnet50", [16, 64, 128, 256, 512], [2, 4, 8, 16, 32]),
    ("dbb_resnet18", [16, 16, 32, 64, 128], [2, 4, 8, 16, 32]),
    ("orepa_vgg_repvgg_a0", [12, 12, 24, 48, 320], [2, 4, 8, 16, 32]),
])
def test_features_only(variant, chans, reductions):
    m = timm.create_model(variant, features_only=True, width_mult=0.25)
    assert m.feature_info.channels() == chans and m.feature_info.reduction() == reductions
    x = torch.randn(2, 3, 64, 64)
    feats = m(x)
    assert [f.shape[1] for f in feats] == chans
    assert [64 // f.shape[-1] for f in feats] == reductions
    sub = timm.create_model(variant, features_only=True, out_indices=(2, 4), width_mult=0.25)
    assert [f.shape[1] for f in sub(x)] == [chans[2], chans[4]]


def test_features_only_small_input_and_deployed_backbone():
    m = timm.create_model("orepa_resnet18", features_only=True, small_input=True, width_mult=0.25, in_chans=1)
    x = torch.randn(2, 1, 32, 32)
    assert m.feature_info.reduction() == [1, 1, 2, 4, 8]
    assert [f.shape[-1] for f in m(x)] == [32, 32, 16, 8, 4]
    # the feature extractor reparameterizes like the classifier
    m.eval()
    with torch.no_grad():
        ref = m(x)
        deployed = orepa.reparameterize(m)
        for a, b in zip(deployed(x), ref, strict=True):
            tol_close(a, b)  # relative to the feature scale: fresh BN statistics leave it unnormalised


def test_import_orepa_is_enough_for_the_zoo_and_the_timm_names():
    assert orepa.create_model is zoo.create_model and orepa.list_models() == zoo.list_models()
    assert "orepa_resnet18" in timm.list_models()


@pytest.mark.parametrize("name,method", zoo_cases())
def test_timm_reparameterize_model_deploys_every_zoo_model_exactly(name, method):
    """timm's protocol: a child with ``fuse()`` is replaced by what it returns (before, Branch.fuse
    returned a tuple and timm crashed on every re-param model)."""
    from timm.utils import reparameterize_model

    model = zoo.create_model(name, method, num_classes=5, small_input=True, width_mult=0.25)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        model.train()(x)  # BN statistics away from their init
        model.eval()
        ref = model(x)
        deployed = reparameterize_model(model)
        assert not any(isinstance(m, (orepa.ReparamConv2d, orepa.AbsorbedNorm)) for m in deployed.modules())
        assert any(isinstance(m, orepa.ReparamConv2d) for m in model.modules()) == (method != "base")  # a copy
        tol_close(deployed(x), ref)
        tol_close(deployed(x), orepa.reparameterize(model)(x))


@pytest.mark.parametrize("method", ["orepa", "orepa-offline"])
def test_timm_reparameterize_model_deploys_the_deep_stem(method):
    from timm.utils import reparameterize_model

    model = zoo.create_model("resnet18", method, num_classes=5, width_mult=0.25, deep_stem=True)  # 7x7 stem
    assert isinstance(model.conv1, orepa.OREPADeepStem)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model.train()(x)
        model.eval()
        deployed = reparameterize_model(model)
        assert type(deployed.conv1) is nn.Conv2d and deployed.conv1.kernel_size == (7, 7)
        tol_close(deployed(x), model(x))


@pytest.mark.parametrize("method", ["orepa", "dbb", "orepa-vgg"])
def test_timm_reparameterize_model_deploys_a_converted_torchvision_model(method):
    import torchvision
    from timm.utils import reparameterize_model

    model = orepa.convert(torchvision.models.resnet18(num_classes=4), method)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model.train()(x)
        model.eval()
        deployed = reparameterize_model(model)
        assert sum(isinstance(m, nn.Conv2d) for m in deployed.modules()) == 20
        tol_close(deployed(x), model(x))


@pytest.mark.parametrize("name", ["lcnet_050", "efficientnet_b0"])
def test_timm_cnns_with_norm_act_layers_convert_train_and_deploy_exactly(name):
    """timm's CNNs put a BatchNormAct2d (BN, then dropout and activation) after their convs:
    orepa keeps it after the block; deployment gives the vanilla timm model, and folding the BN
    keeps the activation. DBB / RepVGG, which absorb the BN, refuse it with the reason."""
    torch.manual_seed(0)
    model, report = orepa.convert(timm.create_model(name, num_classes=10), "orepa", return_report=True)
    assert len(report.converted) > 10 and report.pairing == "torch.fx"
    x = torch.randn(2, 3, 64, 64)
    model.train()
    model(x).square().mean().backward()
    blocks = [m for m in model.modules() if isinstance(m, orepa.ReparamConv2d)]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for b in blocks for p in b.parameters())
    _deploys_exactly_into(model, timm.create_model(name, num_classes=10), x)


@torch.no_grad()
def _deploys_exactly_into(model, plain, x):
    """``model``'s BN statistics moved off their init, then in float64 eval mode: its deployed form
    has ``plain``'s modules, loads strictly into it and gives the training form's output, as does
    its BN-folded form. Returns the float64 model, input and output."""
    model(x + 0.1 * torch.randn_like(x))
    model = model.double().eval()
    xd = x.double()
    y = model(xd)
    deployed = orepa.reparameterize(model)
    fresh = plain.double().eval()
    fresh.load_state_dict(deployed.state_dict(), strict=True)
    assert [(n, type(m)) for n, m in fresh.named_modules()] == [(n, type(m)) for n, m in deployed.named_modules()]
    tol_close(fresh(xd), y, rel=1e-9)
    tol_close(orepa.reparameterize(model, fuse_bn=True)(xd), y, rel=1e-9)
    return model, xd, y


@pytest.mark.parametrize("method", ["dbb", "repvgg"])
def test_blocks_that_absorb_a_norm_act_keep_its_activation_and_deploy_to_the_timm_model(method):
    """DBB / RepVGG hold their own BNs: the BatchNormAct2d after their conv becomes a placeholder
    that keeps its dropout and activation (an activation with parameters, PReLU here, keeps its
    keys), and deployment gives it back as a BatchNormAct2d: the vanilla timm model, exactly."""
    torch.manual_seed(0)
    name = "efficientnet_b0"
    plain = timm.create_model(name, num_classes=10)
    plain.bn1.act = nn.PReLU(plain.bn1.num_features)  # a parametrised activation, as timm's act_layer="prelu"
    keys = set(plain.state_dict())
    model = orepa.convert(copy.deepcopy(plain), method)
    absorbed = [m for m in model.modules() if isinstance(m, orepa.AbsorbedNorm)]
    assert len(absorbed) > 10 and set(model.state_dict()) >= {k for k in keys if k.startswith("bn1.act.")}
    assert isinstance(model.bn1.act, nn.PReLU) and "then its drop and act" in repr(model.bn1)
    x = torch.randn(2, 3, 64, 64)
    model.train()
    model(x).square().mean().backward()
    assert model.bn1.act.weight.grad is not None
    model, xd, y = _deploys_exactly_into(model, plain, x)  # (strict loading: the keys are plain's)
    with torch.no_grad():
        model.bn1.act = nn.Identity()  # the placeholder runs its activation: without it the output moves
        assert not torch.allclose(model(xd), y)
