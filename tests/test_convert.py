"""convert / reparameterize on real architectures: vanilla layout and exact outputs."""
import copy
import warnings

import pytest
import torch
import torchvision
from conftest import tol_close
from torch import nn

import orepa

METHODS = ["orepa", "orepa-offline", "dbb", "repvgg", "orepa-vgg"]
# (resnet50 is torchvision's ResNet/Bottleneck of resnext50_32x4d with groups=1: its conv-BN pairs and shapes are
# resnext50's and resnet18's; it converts in test_orepa_converts_every_conv_bn_pair_of_resnet50_and_keeps_bns)
ARCHS = ["resnet18", "resnext50_32x4d", "vgg11_bn", "mobilenet_v2"]


_BUILT: dict[str, nn.Module] = {}


def _torchvision(arch: str) -> nn.Module:
    """A torchvision model with 10 classes; VGG's 120M-parameter classifier (no conv, nothing to
    convert, most of the test's time in float64) replaced by one linear layer. Built once per
    architecture (VGG's constructor still initialises the 120M parameters, 1.7 s), a deep copy
    returned each time: the callers convert it, change its dtype or load weights into it."""
    if arch not in _BUILT:
        model = getattr(torchvision.models, arch)(num_classes=10)
        if arch.startswith("vgg"):
            model.classifier = nn.Linear(model.classifier[0].in_features, 10)
        _BUILT[arch] = model
    return copy.deepcopy(_BUILT[arch])


def _shallow_resnet(num_classes: int) -> nn.Module:
    """torchvision's ResNet with one BasicBlock a stage (ResNet-18 has two): its stem, blocks, downsample
    convs and BNs, in its layout, at half ResNet-18's convs and weights, for tests whose checks hold for
    any depth."""
    return torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=num_classes)


def _move_bn_stats(model, x, steps=2):
    """Train-mode forwards so every BN's running statistics leave their init values."""
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(x + 0.1 * torch.randn_like(x))
    model.eval()


# (wide_resnet50_2 is resnet50 with wider bottlenecks: nothing new to convert, 30 s in float64)
@pytest.mark.parametrize("arch, method", [(a, m) for a in ARCHS for m in METHODS])
def test_torchvision_roundtrip_loads_strictly_and_matches(arch, method):
    base = _torchvision(arch)
    model, report = orepa.convert(base, method, return_report=True)
    assert report.converted and report.pairing == "torch.fx"
    n_blocks = sum(isinstance(m, orepa.ReparamConv2d) for m in model.modules())
    assert n_blocks >= len(report.converted)
    x = torch.randn(2, 3, 64, 64)
    _move_bn_stats(model, x, steps=1)  # (one batch moves every BN's statistics off their init values)
    # compared in float64: random nets with a batch's BN statistics can be badly conditioned
    # (mobilenet_v2 with the published init: its own float32 error is ~1e-4), which is not what is tested
    model, x = model.double(), x.double()
    with torch.no_grad():
        y = model(x)
        deployed = orepa.reparameterize(model)
        fresh = _torchvision(arch).double()
        fresh.load_state_dict(deployed.state_dict(), strict=True)
        fresh.eval()
        assert [(n, type(m)) for n, m in fresh.named_modules()] == [(n, type(m)) for n, m in deployed.named_modules()]
        tol_close(fresh(x), y, rel=1e-9)
        # (reparameterize(fuse_bn=True) is this deployment then fuse_conv_bn: its folding, without composing
        # every kernel again)
        tol_close(orepa.fuse_conv_bn(deployed)(x), y, rel=1e-9)


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


_FAST = set()  # modules registered by id, as a fast-path registry would keep them


class _GatedById(nn.Module):
    """Control flow on a tensor only where the module does not find itself in a registry keyed by
    ``id``: its tensor-sharing copy fails to trace (a ``TraceError``), the model itself traces."""

    def __init__(self):
        super().__init__()
        _FAST.add(id(self))
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.b1(self.c1(x))
        if id(self) not in _FAST and y.mean() > 0:
            y = y * 2
        return self.b2(self.c2(torch.relu(y)))


def test_a_model_whose_copy_fails_to_trace_on_control_flow_is_traced_itself():
    """The copy's trace failing on control flow does not mean the model's would: a model that looks
    itself up by id branches on a placeholder as a copy only."""
    model = _GatedById()
    _, report = orepa.convert(model, "orepa", inplace=True, return_report=True)
    assert report.pairing == "torch.fx" and sorted(report.converted) == ["c1", "c2"]


@pytest.mark.parametrize("method", ["orepa", "dbb"])
def test_untraceable_model_falls_back(method):
    base = Untraceable()
    x = torch.rand(2, 3, 12, 12)
    # without an example input nothing shows that bn1 / bn3 consume only conv1's / conv3's output
    with pytest.raises(ValueError, match=r"conv1: not paired with 'bn1'.*torch.fx could not trace the model "
                                         r"\(Untraceable; TraceError.*pass example_input"):
        orepa.convert(base, method)
    model, report = orepa.convert(base, method, example_input=x, return_report=True)
    assert report.pairing.startswith("forward hooks")
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
        nn.Conv2d(8, 8, 3, padding=(1, 0)), nn.BatchNorm2d(8),  # a padding per axis: online blocks take it
        nn.Conv2d(8, 8, (1, 3), padding=(0, 1)), nn.BatchNorm2d(8),  # not square, "same"
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(8),  # every block takes it
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
        nn.Conv2d(8, 8, 3, padding="valid"), nn.BatchNorm2d(8),  # not "same": online blocks take it
        nn.Conv2d(8, 8, 3, padding=2), nn.BatchNorm2d(8),
        nn.Conv2d(8, 8, (3, 2), padding=(1, 0)), nn.BatchNorm2d(8),  # an even side
    )
    _, report = orepa.convert(model, return_report=True)
    assert report.converted == ["2", "4", "6", "8", "10", "12"]
    assert "even" in report.skipped["0"]
    assert report.skipped["14"] == "unsupported kernel_size 3x2: even kernels have no centre to align branches on"
    # the blocks that also run their branches on the feature map need "same" padding
    _, report = orepa.convert(model, "dbb", return_report=True)
    assert report.converted == ["4", "6", "8"]
    assert report.skipped["10"] == ("unsupported padding (0, 0) for kernel_size=3x3, dilation=1: only 'same' padding 1 "
                                    "keeps branch centres aligned (online OREPA blocks take any padding)")


def test_unknown_branch_names_are_errors_not_skips():
    """An unknown branch name is a mistake in the options: before, every 3x3 conv was skipped with
    it as the reason and the result was a plain model labelled OREPA."""
    for opts in ({"branches": ("kxk", "nope")}, {"scale_init": {"kxx": 0.5}}):
        with pytest.raises(ValueError, match=r"unknown branch name\(s\) \['(nope|kxx)'\]; known: .*'1x1_avg'"):
            orepa.convert(torchvision.models.resnet50(), **opts)
        with pytest.raises(ValueError, match="unknown branch name"):  # the zoo, small-input stem (no deep stem)
            orepa.models.create_model("resnet18", "orepa", small_input=True, width_mult=0.125, **opts)


@pytest.mark.parametrize("opts,error", [
    ({"dw_expand": 0}, "dw_expand must be an int >= 1, got 0"),
    ({"internal_channels": -2}, "internal_channels must be an int >= 1"),
    ({"scaling": "nope"}, "scaling must be one of"),
    ({"branches": ("kxk", "kxk")}, "duplicate branches ['kxk']"),
    ({"scale_init": {"kxk": "big"}}, "scale_init['kxk'] must be a number"),
    ({"branches": ()}, "branches must name at least one branch"),
    ({"scale_init": {"kxk": float("nan")}}, "scale_init['kxk'] must be a finite number"),
])
def test_a_wrong_option_value_is_an_error_not_a_skip(opts, error):
    """Option values wrong whatever the conv: convert skips a conv whose block raises ValueError, so
    without the check up front ResNet-50 converted only its 1x1 convs (which take neither ``branches``
    nor ``dw_expand``) and came back partly plain, labelled OREPA."""
    with pytest.raises((ValueError, TypeError)) as err:
        orepa.convert(torchvision.models.resnet50(), "orepa", **opts)
    assert error in str(err.value)


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
    model = orepa.convert(_shallow_resnet(3)).double()
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
    model = orepa.convert(_shallow_resnet(10), method)
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


@pytest.mark.parametrize("method", ["dbb", "repvgg"])
def test_a_model_with_sync_batchnorms_deploys_to_its_own_layout(method):
    """Converted after convert_sync_batchnorm: the absorbed norms come back as SyncBatchNorms."""
    vanilla = nn.SyncBatchNorm.convert_sync_batchnorm(_shallow_resnet(10)).eval()
    model = orepa.convert(vanilla, method).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        y = model(x)
        deployed = orepa.reparameterize(model)
        assert [(n, type(m)) for n, m in deployed.named_modules()] == [(n, type(m)) for n, m in vanilla.named_modules()]
        tol_close(deployed(x), y)


@pytest.mark.parametrize("method", ["dbb", "repvgg", "orepa-vgg", "orepa-offline"])
def test_a_block_that_absorbs_a_sync_batchnorm_normalises_with_sync_batchnorms(method):
    """The BNs of a block that absorbed a SyncBatchNorm were plain BatchNorm2ds: under DDP its branches
    normalised by each GPU's batch alone while the plain network's BN took the whole batch's. Now
    they are SyncBatchNorms of the same process group (a block after a BatchNorm2d keeps BatchNorm2ds),
    they train (no process group here: the local batch), and the block deploys back to that layout."""
    plain = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.SyncBatchNorm(6), nn.ReLU(),
                          nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6)).double()
    group = plain[1].process_group = object()  # (any group: SyncBatchNorm only keeps it until a forward syncs)
    model = orepa.convert(plain, method, inplace=True)
    norms = [[m for m in model[i].modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] for i in (0, 3)]
    assert norms[0] and {type(m) for m in norms[0]} == {nn.SyncBatchNorm}
    assert all(m.process_group is group for m in norms[0])
    assert norms[1] and {type(m) for m in norms[1]} == {nn.BatchNorm2d}
    for m in norms[0]:
        m.process_group = None
    x = torch.randn(2, 4, 8, 8, dtype=torch.double)
    _move_bn_stats(model, x)
    with torch.no_grad():
        deployed = orepa.reparameterize(model)
        assert [type(m) for m in deployed] == [nn.Conv2d, nn.SyncBatchNorm, nn.ReLU, nn.Conv2d, nn.BatchNorm2d]
        tol_close(deployed(x), model(x), rel=1e-10)


@pytest.mark.parametrize("method", ["orepa", "dbb"])
def test_a_frozen_stage_stays_frozen(method):
    base = _shallow_resnet(10)
    base.layer1.requires_grad_(False)
    base.layer1.eval()  # frozen statistics too (a detection backbone's frozen stage)
    model = orepa.convert(base, method)
    assert not any(p.requires_grad for p in model.layer1.parameters())
    assert all(p.requires_grad for p in model.layer2.parameters())
    deployed = orepa.reparameterize(model)  # deployed as it was: frozen, its BNs in eval mode
    assert not any(p.requires_grad for p in deployed.layer1.parameters())
    assert all(p.requires_grad for p in deployed.layer2.parameters())
    assert not deployed.layer1[0].bn1.training and deployed.layer2[0].bn1.training


@pytest.mark.parametrize("method", ["dbb", "repvgg", "orepa-offline", "orepa-vgg"])
def test_a_frozen_conv_before_a_bn_that_trains_keeps_the_bn_training(method):
    """BN-only fine-tuning (convs frozen, BN affines train): the blocks that absorb the BN froze
    whole with their conv, so the BN's affine got no gradient and deployed frozen. Now the block's
    BNs train as that BN did, its convs stay frozen, and deployment gives the plain flags back."""
    plain = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
    plain[0].weight.requires_grad_(False)
    model = orepa.convert(plain, method)
    model(torch.randn(2, 4, 6, 6)).sum().backward()
    norms = [m for m in model[0].modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(p.grad is not None for m in norms for p in m.parameters())
    convs = [m for m in model[0].modules() if isinstance(m, orepa.ConvStep)]
    assert convs and not any(p.requires_grad for m in convs for p in m.parameters())
    deployed = orepa.reparameterize(model)
    assert {n: p.requires_grad for n, p in deployed.named_parameters()} == \
        {"0.weight": False, "1.weight": True, "1.bias": True}


class _BNRelu(nn.BatchNorm2d):
    """A BatchNorm2d subclass that does more than normalise (as timm's BatchNormAct2d)."""

    def forward(self, x):
        return torch.relu(super().forward(x))


class _Untraceable(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        if x.sum() > -1e9:  # data-dependent control flow: torch.fx cannot trace it
            x = x + 0
        return self.body(x)


@pytest.mark.parametrize("wrap", [False, True])
def test_a_batchnorm_subclass_is_neither_folded_nor_absorbed(wrap):
    """Folding or absorbing its BN would drop what the subclass adds (here a ReLU): torch.fx traces
    into it, and the untraced fallbacks (Sequential neighbours, hooks) used to pair it."""
    body = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), _BNRelu(8))
    model = _Untraceable(body) if wrap else body
    x = torch.randn(2, 4, 8, 8)
    assert orepa.find_conv_bn_pairs(model)[0] == []
    assert orepa.find_conv_bn_pairs(model, example_input=x)[0] == []
    with pytest.raises(ValueError, match=r"followed by a _BNRelu: only BatchNorm2d, SyncBatchNorm and timm's"):
        orepa.convert(model, "dbb")
    model.eval()
    with torch.no_grad():
        tol_close(orepa.fuse_conv_bn(model)(x), model(x))


class _FreedThenReused(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)

    def forward(self, x):
        if x.sum() > -1e9:
            pass
        y = torch.relu(self.conv(x))  # the conv's output is freed here; y * 2 may take its id
        return self.bn(y * 2.0)


class _AlsoSummed(nn.Module):
    def __init__(self, reads_shape_only: bool = False):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.reads_shape_only = reads_shape_only

    def forward(self, x):
        if x.sum() > -1e9:
            pass
        c = self.conv(x)
        if self.reads_shape_only:  # shape queries are no use of the values
            assert c.shape[1] == c.size(1) == 8 and c.dim() == 4
            return self.bn(c) + x
        return self.bn(c) + c  # the conv's output feeds its BN and a sum outside any module


def test_pairing_by_running_the_model_needs_the_conv_output_to_feed_its_bn_alone():
    x8 = torch.randn(2, 8, 8, 8)
    assert orepa.find_conv_bn_pairs(_FreedThenReused(), example_input=torch.randn(2, 4, 8, 8))[0] == []
    assert orepa.find_conv_bn_pairs(_AlsoSummed(), example_input=x8)[0] == []
    assert orepa.find_conv_bn_pairs(_AlsoSummed(reads_shape_only=True), example_input=x8)[0] == [("conv", "bn")]
    model = _AlsoSummed().eval()
    with torch.no_grad():  # nothing folded, so the function is kept
        tol_close(orepa.fuse_conv_bn(model, example_input=x8)(x8), model(x8))


class _ReadBesideBnInTraining(nn.Module):
    """Untraceable; the training forward also reads the conv's output beside its BN, the eval one does not."""

    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.bn2, self.drop = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Dropout(0.5)

    def forward(self, x):
        y = self.c(x)
        if x.sum() > -1e9 and self.training:
            z = self.bn(y) + 0.5 * y
        else:
            z = self.bn(y)
        return self.bn2(self.c2(self.drop(z)))


def test_pairing_by_running_the_model_checks_both_modes_and_leaves_the_model_as_it_was():
    """The hook trace ran the model in eval mode only: a conv whose output the training forward also
    reads was absorbed with its BN (training output 0.9 off). Now both modes run, as torch.fx's two
    graphs are read, and only the pairs they agree on are taken; the training run leaves the BN
    statistics, the random stream and every module's mode as they were. A model that does not run the
    input in training mode (a BN given one value per channel) is paired by its eval run, with a warning."""
    torch.manual_seed(0)
    model = _ReadBesideBnInTraining()
    model.bn2.eval()  # a module in another mode than its model's keeps it
    x = torch.randn(2, 4, 8, 8)
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    with pytest.warns(UserWarning, match="c: its output goes to 'bn' alone in eval mode, but the training mode's"):
        assert orepa.find_conv_bn_pairs(model, example_input=x)[0] == [("c2", "bn2")]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and not model.bn2.training and model.bn.training
    model.bn2.train()  # (a BN in eval mode where its conv trains is a fixed norm, which DBB does not absorb)
    converted, report = orepa.convert(model, "dbb", example_input=x, return_report=True)
    assert report.converted == ["c2"] and "training mode's forward reads it" in report.skipped["c"]
    orepa.load_plain_state_dict(converted, model.state_dict())
    model.drop.p = converted.drop.p = 0.0
    with torch.no_grad():
        tol_close(converted.train()(x), model.train()(x))
    one = torch.randn(1, 4, 1, 1)  # training-mode BN: "expected more than 1 value per channel"
    with pytest.warns(UserWarning, match=r"checked in eval mode only: the model did not run example_input in training"):
        assert orepa.find_conv_bn_pairs(model, example_input=one)[0] == [("c", "bn"), ("c2", "bn2")]


def _dbb_layer():
    return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())


@pytest.mark.parametrize("method", ["dbb", "repvgg", "orepa-offline"])
def test_deep_copies_of_a_converted_layer_deploy_with_their_own_norms(method):
    """A deep copy used to share its AbsorbedNorm token with the original: the last placeholder took
    both blocks' biases and the other stayed an AbsorbedNorm (error 2.5)."""
    layer = orepa.convert(_dbb_layer(), method)
    net = nn.Sequential(layer, copy.deepcopy(layer), copy.deepcopy(layer)).double()
    x = torch.randn(2, 8, 10, 10, dtype=torch.double)
    _move_bn_stats(net, x)
    with torch.no_grad():
        y = net(x)
        deployed = orepa.reparameterize(net)
        assert not any(isinstance(m, orepa.AbsorbedNorm) for m in deployed.modules())
        vanilla = nn.Sequential(_dbb_layer(), _dbb_layer(), _dbb_layer()).double().eval()
        vanilla.load_state_dict(deployed.state_dict(), strict=True)
        tol_close(vanilla(x), y, rel=1e-10)
        tol_close(orepa.reparameterize(net, fuse_bn=True)(x), y, rel=1e-10)


def test_a_token_shared_by_two_blocks_is_an_ambiguity_error():
    net = nn.Sequential(orepa.convert(_dbb_layer(), "dbb"), orepa.convert(_dbb_layer(), "dbb"))
    net[1][0].absorbed_token = net[0][0].absorbed_token  # copies made apart, e.g. by hand
    with pytest.raises(ValueError, match=r"ambiguous BatchNorm pairing: blocks \['0.0', '1.0'\] and AbsorbedNorm "
                                         r"placeholders \['0.1'\]"):
        orepa.reparameterize(net)
    net[1][0].absorbed_token, net[1][1].token = "t", "t"
    net.append(copy.copy(net[1][1]))  # the same token on two placeholders
    with pytest.raises(ValueError, match=r"blocks \['1.0'\] and AbsorbedNorm placeholders \['1.1', '2'\]"):
        orepa.reparameterize(net)


@pytest.mark.parametrize("padding_mode", ["reflect", "circular"])
def test_fuse_conv_bn_keeps_padding_mode(padding_mode):
    model = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1, padding_mode=padding_mode), nn.BatchNorm2d(6), nn.ReLU(),
                          nn.Conv2d(6, 6, 5, padding=2, padding_mode=padding_mode, bias=False), nn.BatchNorm2d(6))
    model = model.double()
    x = torch.randn(2, 4, 9, 9, dtype=torch.double)
    _move_bn_stats(model, x)
    with torch.no_grad():
        y = model(x)
        for fused in (orepa.fuse_conv_bn(model), orepa.reparameterize(model, fuse_bn=True)):
            assert [m.padding_mode for m in fused.modules() if isinstance(m, nn.Conv2d)] == [padding_mode] * 2
            assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
            tol_close(fused(x), y, rel=1e-10)


class Tangled(nn.Module):
    """torch.fx cannot trace it (data-dependent branch), and registration order lies: ``bn`` follows
    a ReLU, ``shared_bn`` normalizes two convs. Only ``seq`` and the traceable ``block`` are provable."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()
        self.conv_a, self.shared_bn, self.conv_b = nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.Conv2d(6, 6, 1)
        self.seq = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.block = torchvision.models.resnet.BasicBlock(6, 6)

    def forward(self, x):
        x = self.bn(self.act(self.conv(x)))
        if x.sum() > 0:
            x = x + 1
        x = self.shared_bn(self.conv_a(x)) + self.shared_bn(self.conv_b(x))
        return self.block(self.seq(x))


def _trusted_warnings(seen) -> list[str]:
    return [str(w.message) for w in seen if "paired by nn.Sequential order" in str(w.message)]


def test_untraceable_model_without_example_pairs_only_provable_neighbours():
    """The registration-order fallback paired conv -> ReLU -> bn and one user of a shared BN: fuse_conv_bn
    folded BNs across a ReLU (error 2.07) and convert absorbed them (deployed model off by 0.12).
    A Sequential's pair inside the untraced model is taken as its Sequential builds it where the
    model's forward calls the Sequential whole (``self.seq(x)``), as this one does: no warning."""
    model = Tangled().double()
    x = torch.randn(2, 4, 10, 10, dtype=torch.double)
    _move_bn_stats(model, x)
    with pytest.warns(UserWarning, match=r"pairs left out: conv: not paired with 'bn'.*pass example_input"):
        pairs, how = orepa.find_conv_bn_pairs(model)
    assert sorted(pairs) == [("block.conv1", "block.bn1"), ("block.conv2", "block.bn2"), ("seq.0", "seq.1")]
    assert how.startswith("traceable submodules and nn.Sequential order")
    with torch.no_grad():
        y = model(x)
        with pytest.warns(UserWarning) as seen:
            fused = orepa.fuse_conv_bn(model)
        assert any("conv_a: not paired with 'shared_bn'" in str(w.message) for w in seen)
        assert _trusted_warnings(seen) == [] and {w.filename for w in seen} == {__file__}  # pointed at the caller
        assert type(fused.bn) is type(fused.shared_bn) is nn.BatchNorm2d and type(fused.seq[1]) is nn.Identity
        tol_close(fused(x), y, rel=1e-10)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        converted, report = orepa.convert(model, "dbb", return_report=True)
    assert _trusted_warnings(seen) == []
    assert sorted(report.converted) == ["block.conv1", "block.conv2", "seq.0"]
    assert "torch.fx could not trace the model (Tangled" in report.skipped["conv"]
    assert "'shared_bn'" in report.skipped["conv_a"]
    _move_bn_stats(converted, x)
    with torch.no_grad():
        y = converted(x)
        tol_close(orepa.reparameterize(converted)(x), y, rel=1e-10)
    # with an example input the hook trace pairs exactly the same (it sees the ReLU and the shared BN)
    assert sorted(orepa.find_conv_bn_pairs(model, example_input=x)[0]) == sorted(pairs)


class ReachesIn(nn.Module):
    """Untraceable, and its forward calls its Sequential's BN before its conv."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))

    def forward(self, x):
        if x.sum() > 0:
            x = self.seq[1](x)
        return self.seq[0](x)


def test_folding_a_bn_whose_sequential_the_forward_reaches_into_warns():
    """The fallback pairs a Sequential's neighbours as it builds them; a forward that reaches into the
    Sequential (here: its BN called before its conv) computes something else. Folded or absorbed on
    that pairing the model was 1.79 / 0.16 off, silently; a warning names the pair and asks for
    ``example_input`` (which pairs by running the model and leaves it out). An online block leaves
    the BN where it is and does not warn."""
    model = ReachesIn().double().eval()
    _move_bn_stats(model, torch.randn(2, 4, 6, 6, dtype=torch.double))
    message = ("torch.fx could not trace the model, so the BN after 'seq.0' was paired by nn.Sequential order or by "
               "tracing its submodule alone, trusting that forward, which reaches into the submodule, to call each "
               "such submodule whole")
    with pytest.warns(UserWarning, match="fuse_conv_bn: " + message):
        orepa.fuse_conv_bn(model)
    with pytest.warns(UserWarning, match=r"convert\(method='dbb'\): " + message):
        converted = orepa.convert(model, "dbb")
    # said again where the deployment restores the BN (a warning at convert is easily lost in a long log)
    with pytest.warns(UserWarning, match="reparameterize: " + message + ".*the deployed model computes the trained"):
        orepa.reparameterize(copy.deepcopy(converted))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        orepa.convert(model, "orepa")
        with pytest.raises(ValueError, match="found nothing to convert"):  # run, the model shows the BN first
            orepa.convert(model, "dbb", example_input=torch.randn(2, 4, 6, 6, dtype=torch.double))
    assert _trusted_warnings(seen) == []


class ReachesInThroughAHelper(ReachesIn):
    """The same, with the reaching done by a method the forward calls (only forward was read)."""

    def forward(self, x):
        return self._body(x)

    def _body(self, x):
        return self._swapped(x) if x.sum() > 0 else self.seq(x)

    def _swapped(self, x):
        return self.seq[0](self.seq[1](x))


def test_a_helper_method_that_reaches_into_the_sequential_warns_too():
    model = ReachesInThroughAHelper().double().eval()
    _move_bn_stats(model, torch.randn(2, 4, 6, 6, dtype=torch.double))
    with pytest.warns(UserWarning, match="the BN after 'seq.0' was paired by nn.Sequential order"):
        orepa.fuse_conv_bn(model)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


class _CallsInnersConv(nn.Module):
    """Untraceable; calls its traceable submodule's conv on its own and sums it with the BN's output."""

    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x):
        if x.sum() > -1e9:
            y = self.inner.conv(x)
            return self.inner.bn(y) + y
        return self.inner(x)


def _split_sum(seq, x):
    y = seq[0](x)
    return seq[1](y) + y


class _PassesItsSequential(nn.Module):
    """Untraceable; hands its Sequential to a module-level function, which reaches into it."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))

    def forward(self, x):
        return _split_sum(self.seq, x) if x.sum() > -1e9 else self.seq(x)


class _AliasesItsSequential(_PassesItsSequential):
    """The same through a local name, iterated."""

    def forward(self, x):
        seq = self.seq
        if x.sum() > -1e9:
            outs = [x]
            for m in seq:
                outs.append(m(outs[-1]))
            return outs[1] + outs[2]
        return seq(x)


class _CallsItsSequentialWhole(_PassesItsSequential):
    def forward(self, x):
        if self.seq is not None and x.sum() > -1e9:
            x = x + 1
        return self.seq(x)


@pytest.mark.parametrize("cls", [_CallsInnersConv, _PassesItsSequential, _AliasesItsSequential])
def test_the_fallback_warns_where_the_untraced_forward_reaches_in_any_way(cls):
    """The fallback took, without a word, the pairs of a traced submodule whose conv the untraced parent
    calls itself (the reach-in check was for Sequentials only), and of a Sequential the forward passes to
    a function or keeps under a local name (the source check saw only ``self.seq[..]``, ``self.seq.x``,
    ``in self.seq``): folded 0.07 and absorbed 2.2 off. Any mention of the child other than a call of it
    whole (or an ``is None`` test) now counts as reaching in: the warning names the pair."""
    torch.manual_seed(0)
    model = cls().double()
    x = torch.randn(2, 4, 6, 6, dtype=torch.double)
    _move_bn_stats(model, x)
    conv = "inner.conv" if cls is _CallsInnersConv else "seq.0"
    with pytest.warns(UserWarning, match=f"fuse_conv_bn: torch.fx could not trace the model, so the BN after "
                                         f"'{conv}' was paired"):
        orepa.fuse_conv_bn(model)
    with pytest.warns(UserWarning, match=rf"convert\(method='dbb'\): torch.fx could not trace the model, so the BN "
                                         f"after '{conv}' was paired"):
        orepa.convert(model, "dbb")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        orepa.fuse_conv_bn(_CallsItsSequentialWhole())  # a plain call (and an is-None test) takes it as it is
    assert _trusted_warnings(seen) == []


def test_a_shared_bn_module_is_never_paired_by_the_fallback():
    class TwoPaths(nn.Module):
        def __init__(self):
            super().__init__()
            bn = nn.BatchNorm2d(4)
            self.a = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), bn)
            self.b = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), bn)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else self.b(x)

    with pytest.warns(UserWarning, match=r"a.0: not paired with 'a.1': 'a.1' is registered at several places"):
        assert orepa.find_conv_bn_pairs(TwoPaths())[0] == []


def test_converting_an_eval_model_keeps_the_absorbed_norm_in_eval_for_timm():
    """The placeholder was created in train mode: timm's reparameterize_model (fuse() of every child)
    then deployed a train-mode BatchNorm2d (error 0.54)."""
    timm_utils = pytest.importorskip("timm.utils")
    base = _dbb_layer().double()
    x = torch.randn(2, 8, 10, 10, dtype=torch.double)
    _move_bn_stats(base, x)
    model = orepa.convert(base.eval(), "dbb")
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        y = model(x)
        deployed = timm_utils.reparameterize_model(model)
        assert not any(m.training for m in deployed.modules())
        assert isinstance(deployed[1], nn.BatchNorm2d)
        tol_close(deployed(x), y, rel=1e-10)
    assert orepa.convert(_dbb_layer(), "dbb")[1].training  # a training model stays in training


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_absorbed_norm_restores_with_its_dtype_and_device(device):
    """fuse() / restore(None) built the BatchNorm2d in the default dtype on the CPU: float64 / CUDA
    models failed with 'mixed dtype (CPU)'."""
    timm_utils = pytest.importorskip("timm.utils")
    model = orepa.convert(_dbb_layer(), "dbb").to(device=device, dtype=torch.double)
    x = torch.randn(2, 8, 10, 10, dtype=torch.double, device=device)
    _move_bn_stats(model, x)
    bn = model[1].fuse()
    assert (bn.running_mean.dtype, bn.running_mean.device.type) == (torch.double, device)
    assert not bn.training and not any("_like" in k for k in model.state_dict())  # no new checkpoint key
    with torch.no_grad():
        y = model(x)
        tol_close(timm_utils.reparameterize_model(model)(x), y, rel=1e-10)
        # the placeholder without its block (a slice of the model): an identity BatchNorm2d of its dtype
        tail = orepa.reparameterize(model[1:])
        assert isinstance(tail[0], nn.BatchNorm2d) and tail[0].weight.dtype == torch.double
        tol_close(tail(y), y, rel=1e-12)


def _random_bn_state(model: nn.Module) -> None:
    with torch.no_grad():
        for bn in model.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.normal_(0, 0.1)
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.normal_(0, 0.1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k,bias,groups", [(3, False, 1), (3, True, 1), (3, False, 4), (7, False, 1), (1, False, 1)])
def test_a_block_starts_as_the_plain_conv_it_replaced_and_learns_from_there(method, k, bias, groups):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(8, 8, k, padding=k // 2, bias=bias, groups=groups), nn.BatchNorm2d(8)).double()
    _random_bn_state(plain)
    try:
        model = orepa.convert(plain, method)
    except ValueError:
        assert k == 1 and method in ("dbb", "repvgg", "orepa-vgg")  # kxk-only blocks
        return
    block = model[0]
    block.load_conv(plain[0].weight, plain[0].bias, plain[1].state_dict() if block.has_norm else None)
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    for train in (False, True):  # batch statistics too: the other branches add exactly zero
        model.train(train), plain.train(train)
        with torch.no_grad():
            torch.testing.assert_close(model(x), plain(x), rtol=1e-9, atol=1e-9)
    deployed = orepa.reparameterize(model.eval())
    torch.testing.assert_close(deployed(x), plain.eval()(x), rtol=1e-9, atol=1e-9)
    # the branches started at zero learn: their scale or BN affine gets a gradient at the first step
    model.train()
    model(x).square().sum().backward()
    zeroed = [br[-1].weight for name, br in block.branches.items() if not block._can_start_as_conv(br)]
    assert zeroed and all(w.grad is not None and w.grad.abs().sum() > 0 for w in zeroed)


def test_load_conv_names_what_does_not_fit():
    block = orepa.OREPAConv2d(4, 8, 3)
    with pytest.raises(ValueError, match=r"takes a conv weight of shape \[8, 4, 3, 3\], got \[8, 4, 1, 1\]"):
        block.load_conv(torch.zeros(8, 4, 1, 1))
    with pytest.raises(ValueError, match="holds no BN: pass none"):
        block.load_conv(torch.zeros(8, 4, 3, 3), norm=nn.BatchNorm2d(8).state_dict())
    with pytest.raises(ValueError, match="has no bias to take the conv's"):
        block.load_conv(torch.zeros(8, 4, 3, 3), torch.zeros(8))
    with pytest.raises(ValueError, match="needs the state of the BN it replaced"):
        orepa.DBBConv2d(4, 8, 3).load_conv(torch.zeros(8, 4, 3, 3))
    with pytest.raises(ValueError, match="a linear deep stem composes several"):
        orepa.OREPADeepStem(3, 8, 7).load_conv(torch.zeros(8, 3, 7, 7))
    no_kxk = orepa.OREPAConv2d(4, 8, 3, branches=("1x1", "1x1_kxk"))
    with pytest.raises(ValueError, match="no branch that is one full-size 3x3 conv"):
        no_kxk.load_conv(torch.zeros(8, 4, 3, 3))


@pytest.mark.parametrize("method", METHODS)
def test_a_converted_network_starts_from_the_plain_networks_weights(method):
    """Pretrained weights in torchvision's layout: the OREPA (DBB, ...) network computes the plain
    network's function, in eval and in training mode, and deploys back to those weights."""
    torch.manual_seed(0)
    plain = _shallow_resnet(10)
    _random_bn_state(plain)
    model = orepa.convert(_shallow_resnet(10), method)
    orepa.load_plain_state_dict(model, plain.state_dict())
    x = torch.randn(2, 3, 64, 64)
    for train in (False, True):
        model.train(train), plain.train(train)
        with torch.no_grad():
            tol_close(model(x), plain(x))
    deployed = orepa.reparameterize(model.eval())
    with torch.no_grad():
        tol_close(deployed(x), plain.eval()(x))
    if method == "orepa":  # a block without BNs of its own deploys to the very conv it started as
        want = plain.state_dict()
        for key, value in deployed.state_dict().items():
            torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6)


def test_a_zoo_model_starts_from_the_plain_networks_weights_and_a_mismatch_is_named():
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    _random_bn_state(plain)
    x = torch.randn(2, 3, 64, 64)
    zoo = orepa.create_model("resnet18", "orepa", num_classes=10, deep_stem=False)
    orepa.engine.group_kernels(zoo, "grouped", pack=True)  # packed parameters: written through their views
    orepa.load_plain_state_dict(zoo, plain.state_dict())
    with torch.no_grad():
        tol_close(zoo.eval()(x), plain.eval()(x))
    with pytest.raises(ValueError, match="conv1: OREPADeepStem has no branch"):
        orepa.load_plain_state_dict(orepa.create_model("resnet18", "orepa", num_classes=10), plain.state_dict())
    sd = plain.state_dict()
    fc = sd.pop("fc.weight")
    with pytest.raises(ValueError, match="missing fc.weight"):
        orepa.load_plain_state_dict(zoo, sd)
    with pytest.raises(ValueError, match="unexpected extra.weight"):
        orepa.load_plain_state_dict(zoo, {**sd, "fc.weight": fc, "extra.weight": fc})
    head = orepa.create_model("resnet18", "dbb", num_classes=7)
    before = head.fc.weight.clone()
    orepa.load_plain_state_dict(head, {**sd, "fc.weight": fc}, keep=["fc.weight", "fc.bias"])  # a new classifier
    assert torch.equal(head.fc.weight, before)


@pytest.mark.parametrize("opts", [{"scaling": "scalar"}, {"scaling": "none"},
                                  {"scaling": "none", "branches": ("kxk", "1x1_kxk", "dw_pw", "1x1_prior")}])
def test_a_block_without_scales_starts_as_its_conv_through_its_last_learnable_factor(opts):
    """Without a scale to zero, a branch starts at zero through its last learnable conv: the one
    that gets a gradient while its first factor (an identity, a random depthwise) stays non-zero."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)).double()
    _random_bn_state(plain)
    model = orepa.convert(plain, "orepa", **opts)
    block = model[0]
    block.load_conv(plain[0].weight)
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    torch.testing.assert_close(model.eval()(x), plain.eval()(x), rtol=1e-9, atol=1e-9)
    model.train()(x).square().sum().backward()
    for name, br in block.branches.items():
        if name != "kxk":
            last = [s for s in br if isinstance(s, orepa.ConvStep)][-1] if opts.get("scaling") == "none" else br[-1]
            assert last.weight.grad.abs().sum() > 0, name


class _NormalisedOtherwise(nn.Module):
    """Convs that no BatchNorm2d follows: one before a GroupNorm, a depthwise one before a
    channels-last LayerNorm (ConvNeXt's), a 1x1 and a head conv with nothing after them, beside a
    conv -> BN pair."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(8)
        self.conv_gn = nn.Conv2d(8, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.conv_dw = nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.ln = nn.LayerNorm(8)
        self.pw = nn.Conv2d(8, 16, 1)
        self.head = nn.Conv2d(16, 5, 3, stride=2, padding=1)
        self.patch = nn.Conv2d(5, 5, 2, stride=2)  # an even kernel: no block takes it

    def forward(self, x):
        x = torch.relu(self.stem_bn(self.stem(x)))
        x = torch.relu(self.gn(self.conv_gn(x)))
        x = self.ln(self.conv_dw(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.patch(self.head(torch.relu(self.pw(x))))


def test_without_bn_converts_the_convs_no_batchnorm_follows_and_deploys_to_their_layout():
    torch.manual_seed(0)
    plain = _NormalisedOtherwise().double()
    model, report = orepa.convert(plain, without_bn=True, return_report=True)
    assert report.converted == ["stem", "conv_gn", "conv_dw", "pw", "head"]
    assert report.without_bn == ["conv_gn", "conv_dw", "pw", "head"]
    assert list(report.skipped) == ["patch"] and "4 without a BatchNorm2d after them" in str(report)
    assert all(isinstance(model.get_submodule(n), orepa.ReparamConv2d) for n in report.converted)
    assert model.conv_dw.bias is not None and model.stem.bias is None
    x = torch.randn(4, 3, 16, 16, dtype=torch.double)
    model.train()
    with torch.no_grad():
        trained = model(x)  # BN in training mode: batch statistics, the same in the deployed net
    deployed = orepa.reparameterize(model)
    assert {k: v.shape for k, v in deployed.state_dict().items()} == \
        {k: v.shape for k, v in plain.state_dict().items()}
    deployed.load_state_dict(deployed.state_dict(), strict=True)
    assert all(type(deployed.get_submodule(n)) is nn.Conv2d for n in report.converted)
    with torch.no_grad():
        tol_close(deployed.eval()(x), model.eval()(x))
        tol_close(deployed.train()(x), trained)  # (one more update of the BN statistics: compared last)
    # started as the plain network: its function, in training mode too, and its very weights deployed
    orepa.load_plain_state_dict(model, plain.state_dict())
    with torch.no_grad():
        tol_close(model.train()(x), plain.train()(x))
    for key, value in orepa.reparameterize(model.eval()).state_dict().items():
        torch.testing.assert_close(value, plain.state_dict()[key], rtol=1e-9, atol=1e-12)
    # the 1x1 convs can stay plain; the scales of every block get gradients
    kept = orepa.convert(plain, without_bn=True, rep_1x1=False, return_report=True)[1]
    assert kept.without_bn == ["conv_gn", "conv_dw", "head"] and "rep_1x1=False" in kept.skipped["pw"]
    model.train()(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_without_bn_is_for_orepa_and_named_where_it_would_convert_something():
    plain = _NormalisedOtherwise()
    for method in ("dbb", "repvgg", "orepa-vgg", "orepa-offline"):
        with pytest.raises(ValueError, match=f"without_bn=True is for method 'orepa'.*'{method}' blocks hold BNs"):
            orepa.convert(plain, method, without_bn=True)
    unnormed = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4))
    with pytest.raises(ValueError, match=r"not followed by a BatchNorm2d it alone feeds \(without_bn=True converts"):
        orepa.convert(unnormed)
    assert isinstance(orepa.convert(unnormed, without_bn=True)[0], orepa.OREPAConv2d)


@pytest.mark.slow
def test_inception_v3_converts_every_conv_its_non_square_and_valid_ones_too():
    """torchvision's Inception-v3: 1x7 / 7x1 / 1x3 / 3x1 kernels with a padding per axis and valid
    3x3 convs. OREPA converts all 94; DBB, whose branches run on the feature map, takes the "same"
    padded ones, non-square among them. Moved off the initialisation, then deployed: the plain
    network, float64."""
    torch.manual_seed(0)
    net = torchvision.models.inception_v3(num_classes=10, aux_logits=False, init_weights=True).double()
    x = torch.randn(2, 3, 75, 75, dtype=torch.double)
    convs = [n for n, m in net.named_modules() if type(m) is nn.Conv2d]
    non_square = {n for n in convs if net.get_submodule(n).kernel_size[0] != net.get_submodule(n).kernel_size[1]}
    assert len(convs) == 94 and len(non_square) == 34
    plain = torchvision.models.inception_v3(num_classes=10, aux_logits=False, init_weights=False).double()
    for method in ("orepa", "dbb"):
        model, report = orepa.convert(net, method, return_report=True)
        if method == "orepa":
            assert sorted(report.converted) == sorted(convs) and not report.skipped
        else:
            assert non_square <= set(report.converted) and len(report.converted) == 47
            assert {r.split(":")[0] for r in report.skipped.values()} == {  # the 1x1s and the valid 3x3s
                "DBB needs kernel_size >= 3 (its branches degenerate for 1x1 convs)",
                "unsupported padding (0, 0) for kernel_size=3x3, dilation=1"}
        with torch.no_grad():  # off the initialisation: weights moved, BN statistics of a batch
            for p in model.parameters():  # (uniform noise: a third of normal noise's time on 76M weights)
                p.add_(torch.empty_like(p).uniform_(-0.02, 0.02))
            model.train()(x)
        model.eval()
        with torch.no_grad():  # (the plain network's every weight and buffer loaded: built once for both methods)
            plain.load_state_dict(orepa.reparameterize(model).state_dict())
            tol_close(plain.eval()(x), model(x), rel=1e-9)


class _Tap(nn.Module):
    """Returns the normalised map and the raw conv output (a feature tap); untraceable."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        if x.sum() > -1e9:
            x = x + 0
        y = self.conv(x)
        return {"out": self.bn(y), "raw": y}


class _Aliased(nn.Module):
    def __init__(self):
        super().__init__()
        conv = nn.Conv2d(4, 4, 3, padding=1)
        self.first_conv = conv  # the same module under two names; forward uses the second
        self.body = nn.Sequential(conv, nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                                  nn.BatchNorm2d(4))

    def forward(self, x):
        return self.body(x)


class _TiedDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.mid, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return nn.functional.conv_transpose2d(self.bn2(self.mid(self.bn(self.enc(x)))), self.enc.weight, padding=1)


class _ReadsConvWeight(nn.Module):
    """Reads its conv's weight beside calling it, as timm's EdgeNeXt position encoding does
    (``self.token_projection.weight.dtype``); a BN follows the conv or a GroupNorm."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.proj, self.norm = nn.Conv2d(4, 4, 3, padding=1), norm
        self.other = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))

    def forward(self, x):
        return self.other(self.norm(self.proj(x.to(self.proj.weight.dtype))))


@pytest.mark.parametrize("route", ["torch.fx", "forward hooks"])
@pytest.mark.parametrize("norm", ["bn", "gn"])
def test_a_conv_whose_weight_the_forward_reads_stays_plain_on_every_route(route, norm):
    """The forward reads the conv's weight itself: a block has none, so the converted model failed
    ("'OREPAConv2d' object has no attribute 'weight'"): for ``without_bn``'s lone convs on every
    route (timm's EdgeNeXt), and for a BN's pair where the pairs came from running example_input.
    Now such a conv stays plain on every route, the report saying why."""
    torch.manual_seed(0)
    body = _ReadsConvWeight(nn.BatchNorm2d(4) if norm == "bn" else nn.GroupNorm(1, 4))
    model = _Untraceable(body) if route == "forward hooks" else body
    x = torch.randn(2, 4, 6, 6)
    converted, report = orepa.convert(model, "orepa", return_report=True, without_bn=norm == "gn",
                                      example_input=x if route == "forward hooks" else None)
    assert report.pairing.startswith(route)
    prefix = "body." if route == "forward hooks" else ""
    assert report.converted == [prefix + "other.0"]
    assert "read outside it" in report.skipped[prefix + "proj"]
    converted.eval()
    with torch.no_grad():
        tol_close(orepa.reparameterize(converted)(x), converted(x))


class _AuxInTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = _dbb_layer()
        self.aux = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))

    def forward(self, x):
        y = self.main(x)
        return (y, self.aux(y)) if self.training else y


@pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")
def test_convert_pairs_only_what_it_can_replace_whole():
    """A conv output the model also returns is not its BN's alone; a conv registered under two
    names is not split, nor one whose weight the forward also reads; a conv with weight_norm's hooks is not stripped of them; a branch that runs
    in training only is converted from a model in eval mode too, and every module keeps its mode."""
    x = torch.randn(2, 4, 8, 8)
    assert orepa.find_conv_bn_pairs(_Tap(), example_input=x)[0] == []
    model, report = orepa.convert(_Aliased(), "dbb", return_report=True)
    assert report.converted == ["body.3"] and "registered at several places" in report.skipped["first_conv"]
    assert model.first_conv is model.body[0] and isinstance(model.body[1], nn.BatchNorm2d)
    _, report = orepa.convert(_Aliased(), "orepa", without_bn=True, return_report=True)
    assert "registered at several places" in report.skipped["first_conv"]
    aliased = _Aliased().eval()  # fuse_conv_bn pairs by the same rule: nothing of the aliased pair is folded
    with torch.no_grad(), pytest.warns(UserWarning, match="'first_conv' is registered at several places"):
        tol_close(orepa.fuse_conv_bn(aliased)(x), aliased(x))
    model, report = orepa.convert(_TiedDecoder(), "orepa", return_report=True)
    assert report.converted == ["mid"] and "tied weight" in report.skipped["enc"]
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 3, 8, 8)
    for norm in (nn.utils.weight_norm, nn.utils.spectral_norm):
        hooked = nn.Sequential(norm(nn.Conv2d(4, 4, 3, padding=1)), nn.BatchNorm2d(4), nn.ReLU(),
                               nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))
        _, report = orepa.convert(hooked, "orepa", inplace=True, return_report=True)
        assert report.converted == ["3"] and "forward pre-hooks" in report.skipped["0"], report.skipped
    with pytest.raises(ValueError, match="pass inplace=True"):
        orepa.convert(nn.Sequential(nn.utils.weight_norm(nn.Conv2d(4, 4, 3, padding=1)), nn.BatchNorm2d(4)))
    # a hook on the BN: an online block leaves that BN in place, hooks and all (it was left plain, for a
    # drop that does not happen); a block that absorbs the BN would drop them, and stays plain, saying so
    seen = []
    hooked = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))
    hooked[1].register_forward_hook(lambda m, a, out: seen.append(out.shape))
    model, report = orepa.convert(hooked, "orepa", return_report=True)
    assert report.converted == ["0"] and model[1] is not hooked[1] and isinstance(model[1], nn.BatchNorm2d)
    model(x)
    assert seen == [x.shape]
    with pytest.raises(ValueError, match="'1' carries forward hooks .* which the 'dbb' block absorbing it would drop"):
        orepa.convert(hooked, "dbb")
    model = _AuxInTraining().eval()
    model.main[1].train()  # a module in another mode than its model's keeps it
    converted, report = orepa.convert(model, "orepa", return_report=True)
    assert report.converted == ["main.0", "aux.0"]
    assert not converted.training and converted.main[1].training and not converted.aux[1].training
    _, report = orepa.convert(model, "orepa", example_input=torch.randn(2, 8, 8, 8), return_report=True)
    assert model.main[1].training and not model.main[0].training  # the run by hooks left the modes too


# --------------------------------------------------------------------------- what convert must not pair or take


class _TiedConvs(nn.Module):
    """Two conv -> BN pairs whose convs share one weight Parameter, then a third pair of its own."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.c2, self.b2 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.c2.weight = self.c1.weight
        self.c3, self.b3 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.b3(self.c3(self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))))


class _ReadBesideBnInEval(nn.Module):
    """A conv whose output only the BN reads in training, and the forward too in eval mode."""

    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.c2, self.bn2 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)

    def forward(self, x):
        y = self.c(x)
        z = self.bn(y)
        z = z if self.training else z + y
        return self.bn2(self.c2(z))


@pytest.mark.parametrize("method", ["orepa", "dbb"])
def test_tied_convs_and_convs_read_beside_their_bn_in_one_mode_are_left_as_they_are(method):
    """Converted, a tied pair trained two weights and deployed one (relative error 1.4); a conv whose
    output the eval forward also reads was absorbed with its BN (0.42): both are skipped, said why,
    and the rest of the network converts, deploying to the same function."""
    for net, skipped, converted, why in (
            (_TiedConvs(), ("c1", "c2"), ["c3"], "is tied (another module holds the same Parameter)"),
            (_ReadBesideBnInEval(), ("c",), ["c2"], "alone in training mode, but the eval mode's forward")):
        net = net.double()
        model, report = orepa.convert(net, method, return_report=True)
        assert set(skipped) <= set(report.skipped) and all(why in report.skipped[n] for n in skipped), report.skipped
        assert all(type(getattr(model, n)) is nn.Conv2d for n in skipped)
        assert report.converted == converted
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model.train()(x).square().mean().backward()
            opt.step()
        model.eval()
        deployed = orepa.reparameterize(model)
        plain = copy.deepcopy(net)
        plain.load_state_dict(deployed.state_dict(), strict=True)
        with torch.no_grad():
            torch.testing.assert_close(plain.eval()(x), model(x), rtol=1e-9, atol=1e-9)


def _zero_output(module, args, out):
    return out * 0


@pytest.mark.parametrize("hook", [
    lambda bn: bn.register_forward_hook(_zero_output),
    lambda bn: bn.register_forward_pre_hook(lambda module, args: (args[0] * 0,)),
    lambda bn: bn.register_full_backward_hook(lambda module, grad_in, grad_out: None)])
def test_a_bn_that_carries_hooks_is_neither_absorbed_nor_folded(hook):
    """A hook on the BN (a caller's mask, a feature or gradient tap) was dropped without a word where a
    block absorbed that BN (the output 3.4 instead of 0) or fuse_conv_bn replaced it by an Identity: the
    pair is now left out, said why, as a conv's hooks are. An online block leaves the BN in place, hooks
    and all: its conv is converted."""
    net = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                        nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6)).eval()
    hook(net[1])
    x = torch.randn(2, 4, 8, 8)
    for method in ("dbb", "orepa"):
        model, report = orepa.convert(net, method, return_report=True)
        if method == "orepa":
            assert report.converted == ["0", "3"], report.skipped
        else:
            assert report.converted == ["3"] and "'1' carries" in report.skipped["0"], report.skipped
            assert type(model[0]) is nn.Conv2d
        assert type(model[1]) is nn.BatchNorm2d and _hook_count(model[1]) == 1
        with torch.no_grad():
            tol_close(orepa.reparameterize(model)(x), model(x))  # (the hook in the deployed model too)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"pairs left out: 0: '1' carries"):
        fused = orepa.fuse_conv_bn(net)
        assert type(fused[1]) is nn.BatchNorm2d and type(fused[4]) is nn.Identity
        tol_close(fused(x), net(x))


def _hook_count(m: nn.Module) -> int:
    return len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)


@pytest.mark.parametrize("method", ["orepa", "dbb"])
def test_reparameterize_carries_the_hooks_of_a_block_and_of_a_placeholder(method):
    """A hook registered on a block after conversion (a feature tap, an activation-statistics or
    calibration hook, a mask) or on an absorbed BN's placeholder was dropped without a word when
    ``reparameterize`` put the plain conv / BN in its place: the deployed model computed another
    function (a mask lost) and taps saw nothing. The hooks now go to the module that replaces the
    block (as torch.ao's fuse_modules carries a fused module's); where the block absorbed the BN after
    it (DBB), the conv computes its output less a shift that the restored BN adds back, so the hooks
    on its output go to that BN. The BNs hold statistics and affines away from their init, so that
    shift is not zero. (A backward hook on an absorbing block sees the gradient before its output
    hooks, which this mask leaves as it is: the loss's gradient is zero where it masks.) The hooks of
    the modules inside a block, which have no counterpart, are named
    in a warning."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                        nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6)).eval()
    model = orepa.convert(net, method).eval()
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):  # (DBB: its branches' BNs too)
        for t in (bn.weight, bn.bias, bn.running_mean):
            t.data.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    seen, taps = [], []
    model[0].register_forward_pre_hook(lambda m, args, kwargs: seen.append("pre") or ((args[0] * 2,), kwargs),
                                       with_kwargs=True)
    model[0].register_forward_hook(lambda m, args, out: taps.append(out.detach().clone()))
    model[3].register_forward_hook(lambda m, args, out: out * (torch.arange(6.0).view(1, 6, 1, 1) % 2))  # a mask
    model[1].register_forward_hook(lambda m, args, out: seen.append("norm"))
    # on the BN after the second conv (DBB: its placeholder, the identity on the block's output)
    model[4].register_forward_pre_hook(lambda m, args: taps.append(args[0].detach().clone()))
    model[4].register_forward_pre_hook(lambda m, args: (args[0] * (torch.arange(6.0).view(1, 6, 1, 1) < 4),))
    model[3].register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(("backward", grad_out[0].sum())))
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    ref = model(x)
    (ref ** 2).sum().backward()
    ref_seen, ref_grad, ref_taps = list(seen), x.grad.clone(), list(taps)
    assert [s if isinstance(s, str) else s[0] for s in ref_seen] == ["pre", "norm", "backward"]
    for fuse_bn in (False, True):
        seen.clear(), taps.clear()
        x.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (fuse_bn: the convs carrying hooks are left unfolded, said why)
            deployed = orepa.reparameterize(model, fuse_bn=fuse_bn)
        assert type(deployed[0]) is nn.Conv2d and type(deployed[3]) is nn.Conv2d
        out = deployed(x)
        tol_close(out, ref)
        assert len(taps) == len(ref_taps) == 2
        for tap, ref_tap in zip(taps, ref_taps):  # (DBB: the restored BNs' outputs, the blocks')
            tol_close(tap, ref_tap)
        (out ** 2).sum().backward()
        assert [s if isinstance(s, str) else s[0] for s in seen] == ["pre", "norm", "backward"], (fuse_bn, seen)
        assert seen[2][1].item() == pytest.approx(ref_seen[2][1].item(), rel=1e-4, abs=1e-4)
        tol_close(x.grad, ref_grad)
    inner = copy.deepcopy(model)
    inner[0].branches["kxk"].register_forward_hook(lambda m, args, out: None)
    with pytest.warns(UserWarning, match=r"hooks with no counterpart in the deployed model are dropped: 0\.branches\.kxk "
                                         r"\(forward hooks\)"):
        orepa.reparameterize(inner)


def test_reparameterize_places_the_hooks_of_a_norm_act_placeholder_where_they_see_the_training_values():
    """timm's BatchNormAct2d absorbed by a DBB block: the restored module runs BN, drop and act. The
    block's output hooks and the placeholder's pre-hooks see the BN's output, so they run as forward
    pre-hooks of its drop (on the whole module they saw the activation's output); the hooks of the
    placeholder's drop and act are kept with them, without a warning that they were dropped."""
    timm_layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), timm_layers.BatchNormAct2d(4, act_layer=nn.ReLU)).eval()
    model = orepa.convert(net, "dbb").eval()
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        bn.bias.data.uniform_(-1, 1)
        bn.running_mean.uniform_(-1, 1)
    taps = []
    model[0].register_forward_hook(lambda m, args, out: taps.append(("block", out.detach().clone())))
    model[0].register_forward_hook(lambda m, args, out: out - 0.5)
    model[1].register_forward_pre_hook(lambda m, args: taps.append(("input", args[0].detach().clone())))
    model[1].act.register_forward_hook(lambda m, args, out: taps.append(("act", out.detach().clone())))
    x = torch.randn(2, 3, 6, 6)
    ref = model(x)
    ref_taps = list(taps)
    taps.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing is dropped)
        deployed = orepa.reparameterize(model)
    tol_close(deployed(x), ref)
    assert [name for name, _ in taps] == [name for name, _ in ref_taps] == ["block", "input", "act"]
    for (_, tap), (_, ref_tap) in zip(taps, ref_taps):
        tol_close(tap, ref_tap)
    assert ref_taps[0][1].min() < 0  # (the block's output, before the activation)


def test_reparameterize_keeps_the_callers_hook_objects():
    """A hook that is a recorder's bound method (class-based feature extractors, Grad-CAM) records into
    the caller's recorder from the deployed model: the default copy had copied the recorder with it."""
    class Recorder:
        def __init__(self):
            self.seen = []

        def save(self, module, args, out):
            self.seen.append(out.shape)

    model = orepa.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), "orepa").eval()
    recorder = Recorder()
    model[0].register_forward_hook(recorder.save)
    orepa.reparameterize(model)(torch.randn(1, 3, 5, 5))
    assert recorder.seen == [torch.Size([1, 4, 3, 3])]


class _KeepsItsFeatures(nn.Module):
    """A model whose own method, hooked on its stage, keeps that stage's output (a feature pyramid's way)."""

    def __init__(self):
        super().__init__()
        self.stage = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Conv2d(4, 2, 1)
        self.kept = []
        self.stage.register_forward_hook(self.keep)

    def keep(self, module, args, out):
        self.kept.append(out.shape)

    def forward(self, x):
        return self.head(self.stage(x))


@pytest.mark.parametrize("how", ["convert", "fuse_conv_bn", "reparameterize"])
def test_copies_keep_the_callers_hooks_and_give_the_models_own_to_the_copy(how):
    """convert and fuse_conv_bn copied a recorder hooked on a module (it recorded nothing from the copy),
    where reparameterize kept it: all three keep the caller's hook objects. A hook that is a method of
    the model's own module is the copy's, so the copy keeps its features in itself, not in the original."""
    class Recorder:
        def __init__(self):
            self.seen = []

        def save(self, module, args, out):
            self.seen.append(out.shape)

    model, recorder = _KeepsItsFeatures().eval(), Recorder()
    if how == "reparameterize":
        model = orepa.convert(model, "orepa", inplace=True)
    model.stage.register_forward_hook(recorder.save)
    made = getattr(orepa, how)(model)
    made(torch.randn(1, 3, 5, 5))
    assert recorder.seen == [torch.Size([1, 4, 3, 3])]
    assert made.kept == [torch.Size([1, 4, 3, 3])] and model.kept == []


class _ReadsItsBnWeight(nn.Module):
    """Scales the normalised map by the BN's own weight (as a network-slimming variant might)."""

    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.c2, self.bn2 = nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6)

    def forward(self, x):
        return self.bn2(self.c2(self.bn(self.c(x)) * self.bn.weight.view(1, -1, 1, 1)))


def test_a_bn_whose_tensors_the_forward_reads_is_neither_absorbed_nor_folded():
    """torch.fx records ``self.bn.weight`` as a read of the BN's tensor outside it; only the conv's
    were checked, so a block absorbed that BN (its placeholder has no weight) and fuse_conv_bn put
    an Identity in its place: the converted or fused model failed at its first forward. The pair is
    now left out, said why."""
    net = _ReadsItsBnWeight().eval()
    with torch.no_grad():
        net.bn.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 4, 8, 8)
    model, report = orepa.convert(net, "dbb", return_report=True)
    assert report.converted == ["c2"] and "reads the tensors of its BN 'bn' outside it" in report.skipped["c"]
    with torch.no_grad():
        model.eval()(x)
        with pytest.warns(UserWarning, match="pairs left out: c: the forward also reads the tensors of its BN 'bn'"):
            fused = orepa.fuse_conv_bn(net)
        assert type(fused.bn) is nn.BatchNorm2d and type(fused.bn2) is nn.Identity
        tol_close(fused(x), net(x))


def test_what_convert_and_reparameterize_cannot_take_is_a_type_error():
    """A string, a TorchScript module, or a conv whose channel counts are numpy integers (nn.Conv2d
    takes them): one clear error or a skipped conv with its reason, not an AttributeError or a
    TypeError from inside the package; a traced training form names the deployed model to trace."""
    np = pytest.importorskip("numpy")
    scripted = torch.jit.script(nn.Conv2d(3, 3, 3))
    for fn in (orepa.convert, orepa.reparameterize):
        with pytest.raises(TypeError, match="takes an nn.Module, got str"):
            fn("resnet18")
        with pytest.raises(TypeError, match="not a TorchScript module .* reparameterize the model first"):
            fn(scripted)
    net = nn.Sequential(nn.Conv2d(3, np.int64(4), 3, padding=1), nn.BatchNorm2d(4),
                        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))
    _, report = orepa.convert(net, "orepa", return_report=True)
    assert report.converted == ["2"] and "out_channels must be an int" in report.skipped["0"]
    block = orepa.OREPAConv2d(4, 4, 3).eval()
    with pytest.raises(RuntimeError, match=r"trace the deployed model, orepa.reparameterize\(model\)"):
        torch.jit.trace(block, torch.randn(1, 4, 8, 8))
    # scripted likewise (it failed inside TorchScript on a memo's tuple keys); the deployed net scripts
    net = nn.Sequential(orepa.DBBConv2d(4, 4, 3, padding=1), nn.ReLU())
    x = torch.randn(1, 4, 8, 8)
    deployed = orepa.reparameterize(net.eval())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated in newer torch
        with pytest.raises(RuntimeError, match=r"script of a training-form DBBConv2d .* orepa.reparameterize"):
            torch.jit.script(net)
        torch.testing.assert_close(torch.jit.script(deployed)(x), deployed(x))


def test_a_bare_block_deploys_in_its_mode_and_frozen_as_inside_a_model():
    block = orepa.OREPAConv2d(4, 4, 3).eval().requires_grad_(False)
    conv = orepa.reparameterize(block)
    assert not conv.training and not any(p.requires_grad for p in conv.parameters())
    assert orepa.reparameterize(orepa.OREPAConv2d(4, 4, 3)).training


def test_a_method_or_exclude_of_the_wrong_type_is_named():
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match=r"unknown method \['orepa'\]; choose from"):
        orepa.convert(plain, ["orepa"])
    with pytest.raises(ValueError, match=r"unknown method \['dbb'\]"):
        orepa.make_block(["dbb"], plain[0])
    with pytest.raises(TypeError, match=r"exclude must be a function \(name, conv\) -> bool, got list"):
        orepa.convert(plain, exclude=["0"])


@pytest.mark.parametrize("opts,flag", [({"rep_1x1": "no"}, "rep_1x1"), ({"without_bn": "yes"}, "without_bn"),
                                       ({"inplace": 1}, "inplace"), ({"branch_norm": 0.5}, "branch_norm")])
def test_a_flag_that_is_not_true_or_false_is_named(opts, flag):
    """``rep_1x1="no"`` was taken by its truth: the 1x1 convs converted, what it did not say."""
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    with pytest.raises(TypeError, match=rf"^{flag} must be True or False, got "):
        orepa.convert(plain, **opts)
    with pytest.raises(TypeError, match=r"^branch_norm must be True or False, got 'no' \(str\)"):
        orepa.OREPAConv2d(4, 4, 3, mode="offline", branch_norm="no")


def test_a_bare_conv_converts_without_bn_to_its_block():
    """The model itself the one conv: its block is the result (a KeyError before), deployed back to the conv."""
    conv = nn.Conv2d(3, 5, 3, padding=1, bias=True).double()
    block, report = orepa.convert(conv, without_bn=True, return_report=True)
    assert isinstance(block, orepa.OREPAConv2d) and report.without_bn == [""]
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    block.train()(x).sum().backward()
    deployed = orepa.reparameterize(block.eval())
    assert type(deployed) is nn.Conv2d
    torch.testing.assert_close(deployed(x), block(x))
    conv.register_forward_hook(lambda *args: None)  # its refusal names the model, not ''
    with pytest.raises(ValueError, match="the Conv2d itself carries forward hooks"):
        orepa.convert(conv, without_bn=True)


def test_a_bare_placeholder_deploys_to_its_batch_norm():
    """Before, the restored BN was registered as a child named '' of the placeholder itself."""
    placeholder = orepa.AbsorbedNorm(nn.BatchNorm2d(3, eps=1e-3))
    restored = orepa.reparameterize(placeholder)
    assert type(restored) is nn.BatchNorm2d and restored.eps == 1e-3 and not list(restored.children())
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(restored.eval()(x), x)


def test_what_convert_skips_and_refuses_says_so_plainly():
    """A BN without running statistics is named as such (it was 'not followed by a BatchNorm2d it
    alone feeds'); a deep stem's padding refusal no longer says online blocks take any padding."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4, track_running_stats=False),
                        nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))
    _, report = orepa.convert(net, "orepa", return_report=True)
    assert "without running statistics (track_running_stats=False)" in report.skipped["0"]
    with pytest.raises(ValueError, match=r"only 'same' padding 3 .* \(a deep stem's stacked convs need it, online"):
        orepa.OREPADeepStem(3, 8, 7, 2, padding=0)


@pytest.mark.parametrize("method", ["orepa", "dbb"])
def test_load_plain_state_dict_takes_what_torch_takes_and_names_a_wrapper_prefix(method):
    """No num_batches_tracked (torch's strict load of such a state_dict fills them in); a DataParallel
    / torch.compile prefix gets the hint that removes it; no mapping, or no tensors, is a TypeError."""
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                          nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)).double()
    _random_bn_state(plain)
    model = orepa.convert(plain, method)
    sd = {k: v for k, v in plain.state_dict().items() if not k.endswith("num_batches_tracked")}
    orepa.load_plain_state_dict(model, sd)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), plain.eval()(x), rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match=r"every key starts with 'module\.'.*strip_prefixes"):
        orepa.load_plain_state_dict(model, {f"module.{k}": v for k, v in sd.items()})
    with pytest.raises(TypeError, match="takes a state_dict"):
        orepa.load_plain_state_dict(model, list(sd.items()))
    with pytest.raises(TypeError, match="values that are not tensors: 0.weight"):
        orepa.load_plain_state_dict(model, {**sd, "0.weight": sd["0.weight"].tolist()})


@pytest.mark.parametrize("method", ["dbb", "repvgg", "orepa-vgg", "orepa-offline"])
@pytest.mark.parametrize("momentum", [0.01, None])
def test_blocks_that_absorb_a_bn_normalise_with_its_eps_and_momentum(method, momentum):
    """The BNs of a block that absorbs the BN after its conv were torch's defaults (eps 1e-5,
    momentum 0.1) whatever that BN declared (torchvision's MobileNetV3: 1e-3 / 0.01): loaded with
    the plain weights the block was 0.8 off the plain network in eval mode at a small variance, and
    trained its running statistics at another rate. Now it starts as conv + BN exactly, both modes,
    its running statistics move as the plain BN's, and deployed it is the trained block."""
    def plain_net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(4, 6, 3, padding=1, bias=False),
                             nn.BatchNorm2d(6, eps=1e-3, momentum=momentum)).double()

    plain = plain_net()
    _random_bn_state(plain)
    with torch.no_grad():
        plain[1].running_var.fill_(0.01)  # where eps is seen
    model = orepa.convert(plain_net(), method)
    assert {(m.eps, m.momentum) for m in model.modules() if isinstance(m, nn.BatchNorm2d)} == {(1e-3, momentum)}
    orepa.load_plain_state_dict(model, plain.state_dict())
    x = torch.randn(2, 4, 9, 9, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), plain.eval()(x), rtol=1e-12, atol=1e-12)
        for _ in range(2):  # train mode: the same output, the same running statistics after
            torch.testing.assert_close(model.train()(x), plain.train()(x), rtol=1e-12, atol=1e-12)
    main_bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d) and m.weight.abs().sum() > 0)
    torch.testing.assert_close(main_bn.running_var, plain[1].running_var, rtol=1e-12, atol=1e-12)
    deployed = orepa.reparameterize(model.eval())
    assert (deployed[1].eps, deployed[1].momentum) == (1e-3, momentum)
    with torch.no_grad():
        torch.testing.assert_close(deployed(x), model(x), rtol=1e-10, atol=1e-10)


def test_the_without_bn_hint_is_given_only_where_it_would_convert_something():
    """A ViT's patch embedding (a 16x16 conv, no BN after it): without_bn=True could not make it a
    block either, so the hint that sent users there is not given."""
    patch = nn.Sequential(nn.Conv2d(3, 8, 16, stride=16), nn.Flatten())
    with pytest.raises(ValueError, match="not followed by a BatchNorm2d it alone feeds") as err:
        orepa.convert(patch, "orepa")
    assert "without_bn" not in str(err.value)
    with pytest.raises(ValueError, match=r"without_bn=True converts"):
        orepa.convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten()), "orepa")


def test_a_second_convert_keeps_the_blocks_there_and_says_so():
    """Blocks do not split back into branches: converting a converted model to another method keeps
    its blocks, which the report lists and a warning names (the same method again: no warning)."""
    model = orepa.convert(_shallow_resnet(1000), "orepa")  # 12 blocks: the stem, 8 in the stages, 3 downsamples
    with pytest.warns(UserWarning, match=r"method='dbb'\) kept the online OREPA blocks .*12 of them"):
        again, report = orepa.convert(model, "dbb", return_report=True)
    assert report.converted == [] and len(report.kept) == 12 and set(report.kept.values()) == {"online OREPA"}
    assert "12 re-param blocks already there kept as they are" in str(report)
    assert not any(isinstance(m, orepa.DBBConv2d) for m in again.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, report = orepa.convert(model, "orepa", return_report=True)
    assert len(report.kept) == 12
    dbb = orepa.convert(_shallow_resnet(1000), "dbb", exclude=lambda n, c: n == "conv1")
    with pytest.warns(UserWarning, match="kept the DBB blocks"):
        _, report = orepa.convert(dbb, "orepa", return_report=True)  # the plain convs convert, the DBB blocks stay
    assert report.converted == ["conv1", *(f"layer{i}.0.downsample.0" for i in (2, 3, 4))]  # (DBB skips 1x1s)
    assert list(report.kept.values()) == ["DBB"] * 8


@pytest.mark.parametrize("fuse_bn,pack", [(False, False), (True, False), (False, True)])
def test_a_channels_last_model_deploys_to_channels_last_convs(fuse_bn, pack):
    """A model moved with ``.to(memory_format=torch.channels_last)`` deploys to convs laid out so (their
    weights came back contiguous: the same numbers, a layout change at every conv of a channels_last
    inference), packed groups too (their blocks' steps hold rows of the group's parameters); a
    contiguous model keeps contiguous ones."""
    torch.manual_seed(0)
    model = orepa.convert(_shallow_resnet(10), "orepa").eval()
    if pack:
        orepa.engine.group_kernels(model, "grouped", pack=True)
    x = torch.randn(2, 3, 32, 32)
    y = model(x)
    plain = orepa.reparameterize(model, fuse_bn=fuse_bn)
    assert all(p.is_contiguous() for p in plain.parameters())
    model = model.to(memory_format=torch.channels_last)
    deployed = orepa.reparameterize(model, fuse_bn=fuse_bn)
    kernels = [m.weight for m in deployed.modules() if isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1)]
    assert len(kernels) == 9 and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
                                      for w in kernels)
    tol_close(deployed(x.to(memory_format=torch.channels_last)), y, rel=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_a_model_converted_in_channels_last_keeps_that_layout_through_deployment(method):
    """Moved to channels_last before convert: the blocks were made contiguous, so the deployed convs came
    back contiguous in a channels_last network."""
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 5, padding=2, groups=2), nn.BatchNorm2d(4)).double()
    model = orepa.convert(plain.to(memory_format=torch.channels_last), method)
    _random_bn_state(model)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)
    model.train()(x).sum().backward()
    y = model.eval()(x)
    for fuse_bn in (False, True):
        deployed = orepa.reparameterize(model, fuse_bn=fuse_bn)
        assert all(deployed[i].weight.is_contiguous(memory_format=torch.channels_last)
                   and not deployed[i].weight.is_contiguous() for i in (0, 3))
        torch.testing.assert_close(deployed(x), y)


class _LayerList(nn.Module):
    """YOLO-style: an untraceable forward iterates its layers and calls each whole."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                                   nn.SiLU()),
                                     nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))])

    def forward(self, x):
        for m in self.layers:
            x = m(x)
            if x.mean() > 1e9:  # data-dependent: torch.fx cannot trace the model
                break
        return x


def test_a_forward_that_iterates_its_layers_and_calls_each_whole_is_not_warned_about():
    """Iterating a ModuleList and calling its elements whole (torchvision's SSD heads, YOLO-style
    nets) reaches into the list, not into the elements that hold the pairs: no warning, folded exactly."""
    torch.manual_seed(0)
    net = _LayerList().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused = orepa.fuse_conv_bn(net)
        converted, report = orepa.convert(net, "dbb", return_report=True)
    assert len(report.converted) == 2
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        tol_close(fused(x), net(x))
        tol_close(orepa.reparameterize(converted.eval())(x), converted(x))


@pytest.mark.parametrize("how", ["eval", "frozen affine"])
def test_a_norm_its_network_froze_is_kept_fixed_not_absorbed(how):
    """A BN put in eval mode (frozen-BN fine-tuning), or with its affine frozen, while its conv trains:
    the methods that absorb it brought BNs of their own that trained on batch statistics with
    trainable affines, 1.8 off the plain network after load_plain_state_dict in training mode. Now
    such a norm is fixed as a FrozenBatchNorm2d is: online blocks keep it after them, starting as
    the conv (exact), the others leave the conv with a reason."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)).double()
    with torch.no_grad():
        seq[1].running_mean.normal_(0, 0.5)
        seq[1].running_var.uniform_(0.5, 2)
        seq[1].weight.uniform_(0.5, 1.5)
    if how == "eval":
        seq[1].eval()
    else:
        seq[1].requires_grad_(False)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    converted, report = orepa.convert(seq, "orepa", return_report=True)
    assert report.converted == ["0"] and report.frozen_norm == ["0"]
    why = "in eval mode while the conv trains" if how == "eval" else "whose affine is frozen while the conv trains"
    assert why in report.frozen_norm_why["0"] and f"1 started as their conv, followed by a BatchNorm2d {why}" in str(report)
    assert type(converted[1]) is nn.BatchNorm2d and converted[1].training == (how != "eval")
    orepa.load_plain_state_dict(converted, seq.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(converted(x), seq(x), rtol=1e-12, atol=1e-12)
    said = "in eval mode while the conv trains" if how == "eval" else "whose affine is frozen while the conv trains"
    for method in ("dbb", "repvgg", "orepa-offline"):
        with pytest.raises(ValueError, match=f"0: followed by a BatchNorm2d {said}.*bring BNs of their own"):
            orepa.convert(seq, method)


# --------------------------------------------------------------------------- what tracing leaves behind


def test_tracing_leaves_no_placeholder_in_the_model_and_keeps_the_hooks_that_change_it():
    """``convert`` traces the model with torch.fx, which runs the Python of its forward and of the
    hooks of the modules it traces through on placeholders (Proxy objects): timm's hook-based feature
    extractor (``feature_cls="hook"``, which stores its outputs by device) held them after conversion,
    so that copying, pickling or deploying it failed ("'node' not in new_dict during proxy
    unpickling"). Now tracing runs on a copy of the model that shares its tensors. The hooks still run
    there: one that changes a module's input is part of the function (setting hooks aside paired a
    conv with a BN it does not feed as it is: 5.7 off, silently)."""
    import pickle

    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    for method in ("orepa", "dbb"):
        features = orepa.convert(timm.create_model("resnet10t", features_only=True, feature_cls="hook"), method)
        pickle.dumps(features)
        _move_bn_stats(features, torch.randn(2, 3, 32, 32), steps=1)
        x = torch.randn(1, 3, 32, 32)
        deployed = orepa.reparameterize(copy.deepcopy(features.eval()))
        with torch.no_grad():
            for got, want in zip(deployed(x), features(x)):
                tol_close(got, want)

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.post = nn.Sequential(nn.BatchNorm2d(8), nn.ReLU())

        def forward(self, x):
            return self.post(self.conv(x))

    model = Masked()
    _move_bn_stats(model, torch.randn(2, 3, 8, 8))
    mask = (torch.rand(1, 8, 1, 1) > 0.5).float()
    model.post.register_forward_pre_hook(lambda m, inputs: (inputs[0] * mask + 0.5,))
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        tol_close(orepa.fuse_conv_bn(model)(x), model(x))
    with pytest.raises(ValueError, match="conv: not followed by a BatchNorm2d it alone feeds"):
        orepa.convert(model, "dbb")
    assert len(model.post._forward_pre_hooks) == 1


def test_a_model_handed_to_a_function_counts_as_reached_into():
    """An untraceable forward that hands its module to a function outside the class (which takes a
    Sequential's conv and BN apart) was trusted to call its Sequential whole, silently: folded 0.1 off.
    Now the fallback warns, as for any forward that reaches in, whatever the first parameter's name."""

    def apply(m, x):
        y = m.body[0](x)
        return m.body[1](y) + y

    class HandsItselfOn(nn.Module):
        def __init__(me):
            super().__init__()
            me.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))

        def forward(me, x):
            if x.sum() > 0:  # (torch.fx cannot trace this)
                x = x * 1.0
            return apply(me, x)

    class CallsItsHelperAsMe(HandsItselfOn):  # the helper method reached through ``me.``, not ``self.``
        def forward(me, x):
            if x.sum() > 0:
                x = x * 1.0
            return me._swapped(x)

        def _swapped(me, x):
            y = me.body[0](x)
            return me.body[1](y) + y

    for cls in (HandsItselfOn, CallsItsHelperAsMe):
        model = cls().double()
        _move_bn_stats(model, torch.randn(2, 3, 6, 6, dtype=torch.double))
        with pytest.warns(UserWarning, match="fuse_conv_bn: torch.fx could not trace the model, so the BN after "
                                             "'body.0'"):
            orepa.fuse_conv_bn(model)


def test_plain_weights_load_with_their_modules_versions():
    """``load_plain_state_dict`` rebuilt the state_dict without its ``_metadata``, which torchvision's
    MNASNet reads ("version should be set to 1 or 2 instead of None"), after loading the blocks."""
    torch.manual_seed(0)
    plain = torchvision.models.mnasnet0_5(num_classes=4)
    _move_bn_stats(plain, torch.randn(2, 3, 32, 32), steps=1)
    plain.eval()
    x = torch.randn(1, 3, 32, 32)
    for method in ("orepa", "dbb"):
        model = orepa.convert(plain, method)
        orepa.load_plain_state_dict(model, plain.state_dict())
        with torch.no_grad():
            tol_close(model.eval()(x), plain(x))


def test_a_graph_module_keeps_its_mode_through_convert_and_reparameterize():
    """A GraphModule's deep copy comes back in training mode (torchvision's create_feature_extractor):
    ``reparameterize`` of an eval-mode one returned a model in training mode, 37-99% off until
    ``.eval()``."""
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    net = orepa.convert(_shallow_resnet(4), "orepa")
    _move_bn_stats(net, torch.randn(2, 3, 32, 32), steps=1)
    extractor = create_feature_extractor(net, {"layer2": "c3", "fc": "logits"}).eval()
    deployed = orepa.reparameterize(extractor)
    assert not any(m.training for m in deployed.modules())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        for key in ("c3", "logits"):
            tol_close(deployed(x)[key], extractor(x)[key])
    assert not any(m.training for m in orepa.convert(create_feature_extractor(
        _shallow_resnet(4), {"fc": "logits"}).eval(), "dbb").modules())


def test_load_plain_state_dict_names_every_wrappers_prefix_whole():
    """The wrapper prefixes are orepa.state_dicts' (they were spelt again here): each gets the hint,
    and nested wrappers (DDP around torch.compile) are named whole, not by their outer prefix alone."""
    from orepa.state_dicts import WRAPPER_PREFIXES, strip_prefixes

    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))
    model = orepa.convert(plain, "orepa")
    sd = plain.state_dict()
    for prefix in (*WRAPPER_PREFIXES, "module._orig_mod.", "_orig_mod.module."):
        wrapped = {prefix + k: v for k, v in sd.items()}
        with pytest.raises(ValueError, match=rf"every key starts with '{prefix}', a wrapper's"):
            orepa.load_plain_state_dict(model, wrapped)
        orepa.load_plain_state_dict(model, strip_prefixes(wrapped))  # what the hint says removes it
    # keys under different nestings: the prefix they all share
    mixed = {("module._orig_mod." if i % 2 else "module.") + k: v for i, (k, v) in enumerate(sd.items())}
    with pytest.raises(ValueError, match=r"every key starts with 'module\.', a wrapper's"):
        orepa.load_plain_state_dict(model, mixed)
    with pytest.raises(ValueError) as exc:  # no shared wrapper prefix: no hint
        orepa.load_plain_state_dict(model, {("_orig_mod." if i % 2 else "module.") + k: v
                                            for i, (k, v) in enumerate(sd.items())})
    assert "every key starts" not in str(exc.value)


@pytest.mark.parametrize("method", ["dbb", "orepa-offline", "repvgg", "orepa"])
def test_a_conv_with_a_bias_deploys_with_the_bias_it_trained_to(method):
    """A conv with a bias before its BN: the block keeps a bias of its own, which training moves
    off the plain conv's; the deployed network (the conv's bias, and where the block held its BNs
    the rest moved into the restored BN) computes what the trained block computed."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=True), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, bias=True), nn.BatchNorm2d(8), nn.Flatten())
    model = orepa.convert(plain, method, example_input=torch.randn(2, 4, 6, 6)).double()
    blocks = [m for m in model.modules() if isinstance(m, orepa.ReparamConv2d)]
    assert len(blocks) == 2 and all(b.bias is not None for b in blocks)
    with torch.no_grad():
        for b in blocks:
            b.bias.normal_()  # (as training leaves it: the plain conv's was a small uniform draw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 4, 6, 6, dtype=torch.float64)).square().mean().backward()
        opt.step()
    model.eval()
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    deployed = orepa.reparameterize(model)
    assert not any(isinstance(m, orepa.ReparamConv2d) for m in deployed.modules())
    with torch.no_grad():
        torch.testing.assert_close(deployed(x), model(x), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(orepa.reparameterize(model, fuse_bn=True)(x), model(x), rtol=1e-10, atol=1e-10)
