"""convert / reparameterize on real architectures: vanilla layout and exact outputs."""
import copy

import pytest
import torch
import torchvision
from conftest import tol_close
from torch import nn

import orepa

METHODS = ["orepa", "orepa-offline", "dbb", "repvgg", "orepa-vgg"]
ARCHS = ["resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "vgg11_bn", "mobilenet_v2"]


def _move_bn_stats(model, x, steps=2):
    """Train-mode forwards so every BN's running statistics leave their init values."""
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(x + 0.1 * torch.randn_like(x))
    model.eval()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_torchvision_roundtrip_loads_strictly_and_matches(arch, method):
    base = getattr(torchvision.models, arch)(num_classes=10)
    model, report = orepa.convert(base, method, return_report=True)
    assert report.converted and report.pairing == "torch.fx"
    n_blocks = sum(isinstance(m, orepa.ReparamConv2d) for m in model.modules())
    assert n_blocks >= len(report.converted)
    x = torch.randn(2, 3, 64, 64)
    _move_bn_stats(model, x)
    # compared in float64: random nets with two batches of BN statistics can be badly conditioned
    # (mobilenet_v2 with the published init: its own float32 error is ~1e-4), which is not what is tested
    model, x = model.double(), x.double()
    with torch.no_grad():
        y = model(x)
        deployed = orepa.reparameterize(model)
        fresh = getattr(torchvision.models, arch)(num_classes=10).double()
        fresh.load_state_dict(deployed.state_dict(), strict=True)
        fresh.eval()
        assert [(n, type(m)) for n, m in fresh.named_modules()] == [(n, type(m)) for n, m in deployed.named_modules()]
        tol_close(fresh(x), y, rel=1e-9)
        tol_close(orepa.reparameterize(model, fuse_bn=True)(x), y, rel=1e-9)


def test_orepa_converts_every_conv_bn_pair_of_resnet50_and_keeps_bns():
    base = torchvision.models.resnet50()
    model, report = orepa.convert(base, return_report=True)
    n_conv = sum(type(m) is nn.Conv2d for m in base.modules())
    assert len(report.converted) == n_conv == 53 and not report.skipped
    # the BN after each online block is its post-addition norm and stays a BatchNorm2d
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 53
    b = model.layer1[0].conv1
    assert isinstance(b, orepa.OREPAConv2d) and set(b.branches) == {"1x1", "1x1_1x1"}  # Rep-1x1
    assert set(model.layer1[0].conv2.branches) == set(orepa.OREPA_BRANCHES)
    # options reach the blocks; rep_1x1=False leaves 1x1 convs plain
    m2, r2 = orepa.convert(base, rep_1x1=False, branches=("kxk", "1x1"), scaling="scalar", return_report=True)
    assert type(m2.layer1[0].conv1) is nn.Conv2d and "rep_1x1=False" in r2.skipped["layer1.0.conv1"]
    assert set(m2.layer1[0].conv2.branches) == {"kxk", "1x1"}


def test_convert_is_not_in_place_by_default_and_reports_skips():
    base = torchvision.models.resnet18()
    model, report = orepa.convert(base, "dbb", return_report=True)
    assert all(type(m) is not orepa.DBBConv2d for m in base.modules())
    assert "layer2.0.downsample.0" in report.skipped  # 1x1: DBB needs k >= 3
    assert "kernel_size >= 3" in report.skipped["layer2.0.downsample.0"]
    assert isinstance(model.bn1, orepa.AbsorbedNorm)
    assert "skipped" in str(report)
    same = orepa.convert(base, "orepa", inplace=True)
    assert same is base


def test_exclude_keeps_convs_plain():
    model = orepa.convert(torchvision.models.resnet18(), exclude=lambda name, conv: name == "conv1")
    assert type(model.conv1) is nn.Conv2d
    assert isinstance(model.layer1[0].conv1, orepa.OREPAConv2d)


class Untraceable(nn.Module):
    """Data-dependent control flow defeats torch.fx; convs without BN must stay plain."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)  # no BN: not converted
        self.conv3, self.bn3 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        if x.sum() > 0:
            x = self.conv2(x)
        x = torch.relu(self.bn3(self.conv3(x)))
        return self.head(x)


@pytest.mark.parametrize("use_example", [True, False])
@pytest.mark.parametrize("method", ["orepa", "dbb"])
def test_untraceable_model_falls_back(use_example, method):
    base = Untraceable()
    x = torch.rand(2, 3, 12, 12)
    model, report = orepa.convert(base, method, example_input=x if use_example else None, return_report=True)
    assert report.pairing.startswith("forward hooks" if use_example else "registration order")
    assert sorted(report.converted) == ["conv1", "conv3"]
    assert type(model.conv2) is nn.Conv2d and "BatchNorm2d" in report.skipped["conv2"]
    _move_bn_stats(model, x)
    with torch.no_grad():
        y = model(x)
        plain = orepa.reparameterize(model)
        fresh = Untraceable()
        fresh.load_state_dict(plain.state_dict(), strict=True)
        tol_close(fresh.eval()(x), y)
        tol_close(orepa.reparameterize(model, fuse_bn=True, example_input=x)(x), y)


class SharedConv(nn.Module):
    """A conv called twice (weights shared) and a conv feeding two consumers."""

    def __init__(self):
        super().__init__()
        self.shared, self.bn_a, self.bn_b = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.BatchNorm2d(4)
        self.forked, self.bn_c = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        x = self.bn_a(self.shared(x)) + self.bn_b(self.shared(x))
        f = self.forked(x)
        return self.bn_c(f) + f


def test_pairs_need_a_single_use_conv_feeding_only_its_bn():
    pairs, how = orepa.find_conv_bn_pairs(SharedConv())
    assert how == "torch.fx" and pairs == []


def test_fuse_conv_bn_on_a_vanilla_model():
    model = torchvision.models.resnet18(num_classes=5)
    x = torch.randn(2, 3, 48, 48)
    _move_bn_stats(model, x)
    fused = orepa.fuse_conv_bn(model)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    with torch.no_grad():
        tol_close(fused(x), model(x))


def test_unknown_method_and_non_conv_are_rejected():
    with pytest.raises(ValueError, match="unknown method"):
        orepa.convert(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)), "acnet")
    with pytest.raises(ValueError, match="not a plain nn.Conv2d"):
        orepa.make_block("orepa", nn.Linear(3, 3))


def test_unsupported_convs_are_skipped_with_reason():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 4, padding=1), nn.BatchNorm2d(8),  # even kernel
        nn.Conv2d(8, 8, 3, padding=0), nn.BatchNorm2d(8),  # not "same" padding
        nn.Conv2d(8, 8, (1, 3), padding=(0, 1)), nn.BatchNorm2d(8),  # not square
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(8),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
    )
    _, report = orepa.convert(model, return_report=True)
    assert report.converted == ["8"]
    assert "even" in report.skipped["0"] and "padding" in report.skipped["2"]
    assert "square" in report.skipped["4"] and "padding_mode" in report.skipped["6"]


def test_unknown_branch_names_are_errors_not_skips():
    """An unknown branch name is a mistake in the options: before, every 3x3 conv was skipped with
    it as the reason and the result was a plain model labelled OREPA."""
    for opts in ({"branches": ("kxk", "nope")}, {"scale_init": {"kxx": 0.5}}):
        with pytest.raises(ValueError, match=r"unknown branch name\(s\) \['(nope|kxx)'\]; known: .*'1x1_avg'"):
            orepa.convert(torchvision.models.resnet50(), **opts)
        with pytest.raises(ValueError, match="unknown branch name"):  # the zoo, small-input stem (no deep stem)
            orepa.models.create_model("resnet18", "orepa", small_input=True, width_mult=0.125, **opts)


@pytest.mark.parametrize("layer,why", [
    (nn.Conv2d(3, 4, 4, padding=1), "0: unsupported kernel_size 4"),
    (nn.Conv1d(3, 4, 3, padding=1), "0: Conv1d: only plain nn.Conv2d layers are converted"),
    (nn.ConvTranspose2d(3, 4, 3, padding=1), "0: ConvTranspose2d: only plain nn.Conv2d"),
    (nn.Conv2d(3, 4, 3, padding=1), "0: not followed by a BatchNorm2d"),
])
def test_a_model_with_nothing_convertible_is_an_error(layer, why):
    norm = nn.BatchNorm1d(4) if isinstance(layer, nn.Conv1d) else nn.BatchNorm2d(4)
    model = nn.Sequential(layer, norm) if "followed" not in why else nn.Sequential(layer, nn.ReLU())
    with pytest.raises(ValueError, match="found nothing to convert in Sequential: " + why):
        orepa.convert(model)
    with pytest.raises(ValueError, match="no nn.Conv2d followed by a BatchNorm2d"):
        orepa.convert(nn.Sequential(nn.Linear(3, 3)))
    # a model converted before (a second pass, as the zoo's RepVGG variants do) is not an error
    once = orepa.convert(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)))
    assert isinstance(orepa.convert(once)[0], orepa.OREPAConv2d)


def test_other_conv_types_are_reported_beside_converted_ones():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ConvTranspose2d(4, 4, 2, 2))
    _, report = orepa.convert(model, return_report=True)
    assert report.converted == ["0"] and "ConvTranspose2d" in report.skipped["2"]


def test_converted_model_trains_and_keeps_float64_and_device():
    model = orepa.convert(torchvision.models.resnet18(num_classes=3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(2, 3, 32, 32, dtype=torch.double)
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(x), torch.tensor([0, 2]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        d = orepa.reparameterize(model, fuse_bn=True)
        assert d.conv1.weight.dtype == torch.double
        tol_close(d(x), model(x), rel=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["orepa", "dbb", "orepa-offline"])
def test_sync_batchnorm_model_deploys_like_the_batchnorm_one(method):
    """--sync-bn trains a convert_sync_batchnorm copy; its BNs (per-branch ones of offline blocks too)
    must still fold, and deploying it must give the plain model's function."""
    model = orepa.convert(torchvision.models.resnet18(num_classes=10), method)
    x = torch.randn(2, 3, 64, 64)
    _move_bn_stats(model, x)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model)).eval()
    assert any(isinstance(m, nn.SyncBatchNorm) for m in synced.modules())
    with torch.no_grad():
        y = model(x)
        for fuse_bn in (False, True):
            deployed = orepa.reparameterize(synced, fuse_bn=fuse_bn)
            assert not any(isinstance(m, orepa.ReparamConv2d) for m in deployed.modules())
            tol_close(deployed(x), y)
