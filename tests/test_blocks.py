"""Every block, over a grid of conv configurations: train, then deploy exactly."""
import copy
import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import Checkpointed, tol_close
from torch import nn

import orepa
from orepa import DBBConv2d, OREPAConv2d, OREPADeepStem, OREPAVGGBlock, RepVGGBlock
from orepa import kernels as K

FACTORIES = {
    "orepa": lambda *a, **k: OREPAConv2d(*a, **k),
    "orepa-offline": lambda *a, **k: OREPAConv2d(*a, mode="offline", branch_norm=True, inner_norm=True, **k),
    "orepa-branch-bn": lambda *a, **k: OREPAConv2d(*a, mode="offline", branch_norm=True, **k),
    "orepa-scalar": lambda *a, **k: OREPAConv2d(*a, scaling="scalar", **k),
    "orepa-noscale": lambda *a, **k: OREPAConv2d(*a, scaling="none", **k),
    "dbb": lambda *a, **k: DBBConv2d(*a, **k),
    "repvgg": lambda *a, **k: RepVGGBlock(*a, **k),
    "orepa-vgg": lambda *a, **k: OREPAVGGBlock(*a, **k),
    "repvgg-online": lambda *a, **k: OREPAConv2d(*a, branches=("kxk", "1x1", "identity"), **k),
    "orepa-vgg-offline": lambda *a, **k: OREPAConv2d(
        *a, branches=orepa.OREPA_BRANCHES + ("identity",), mode="offline", branch_norm=True, inner_norm=True, **k),
}
NEEDS_K3 = {"dbb", "repvgg", "orepa-vgg", "repvgg-online", "orepa-vgg-offline"}
NEEDS_IDENTITY = {"repvgg-online", "orepa-vgg-offline"}

# kernel size, stride, groups ("dw" = depthwise), dilation, (in, out)
GRID = list(itertools.product([1, 3, 5, 7], [1, 2], [1, 2, "dw"], [1, 2], [(4, 8), (8, 8)]))
# non-square kernels (Inception's 1x7 / 7x1, factorised 1x3 / 3x1 convs), "same" padding on each axis
GRID += list(itertools.product([(1, 3), (7, 1), (3, 5)], [1, 2], [1, "dw"], [1, 2], [(4, 8)]))


def _cfg_id(c):
    k, s, g, d, (ci, co) = c
    return f"k{k if isinstance(k, int) else '{}x{}'.format(*k)}-s{s}-g{g}-d{d}-{ci}to{co}"


def _defined(method, cfg) -> bool:
    """Whether ``method``'s block exists for ``cfg``: RepVGG-style blocks need k >= 3, an identity
    branch in == out and stride 1 (the blocks refuse the rest with the reason: tested below)."""
    k, s, _, _, (ci, co) = cfg
    return not ((method in NEEDS_K3 and k == 1) or (method in NEEDS_IDENTITY and (ci != co or s != 1)))


# (method, cfg) pairs of blocks that exist: the grid's other cells are refusals, not tests to skip
CASES = [pytest.param(m, c, id=f"{m}-{_cfg_id(c)}") for m in FACTORIES for c in GRID if _defined(m, c)]


def _build(method, cfg):
    k, s, g, d, (ci, co) = cfg
    groups = ci if g == "dw" else g
    return FACTORIES[method](ci, co, k, s, dilation=d, groups=groups), ci


def test_the_grids_other_cells_are_refused_with_the_reason():
    reasons = r"needs kernel_size >= 3|a 1x1 block supports branches|identity branch needs in_channels == out_channels|the identity branch needs stride 1"
    refused = 0
    for method in FACTORIES:
        for cfg in GRID:
            if not _defined(method, cfg):
                with pytest.raises(ValueError, match=reasons):
                    _build(method, cfg)
                refused += 1
    assert refused == 276  # 3 k>=3 blocks x 24 1x1 cells, 2 identity blocks x 102 cells


def _train(model, ci, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(steps):
        x = torch.randn(4, ci, 9, 9)
        y = model(x)
        loss = (y - torch.randn_like(y)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize(("method", "cfg"), CASES)
def test_trained_block_deploys_exactly(method, cfg):
    block, ci = _build(method, cfg)
    model = nn.Sequential(block, nn.BatchNorm2d(block.out_channels))  # the post-addition norm
    _train(model, ci)
    model.eval()
    x = torch.randn(2, ci, 9, 9)
    with torch.no_grad():
        y = model(x)
        deployed = orepa.reparameterize(model, fuse_bn=True)
        assert not any(isinstance(m, (orepa.ReparamConv2d, nn.BatchNorm2d)) for m in deployed.modules())
        tol_close(deployed(x), y)
        plain = orepa.reparameterize(model)
        assert [type(m) for m in plain] == [nn.Conv2d, nn.BatchNorm2d]
        tol_close(plain(x), y)


@pytest.mark.parametrize(("cfg", "branches"), [
    pytest.param(c, b, id=f"{_cfg_id(c)}-{name}") for c in GRID
    for name, b in (("default", None), ("repvgg-like", ("kxk", "1x1", "identity")))
    if b is None or _defined("repvgg-online", c)])
def test_online_equals_offline_without_bn(cfg, branches):
    k, s, g, d, (ci, co) = cfg
    groups = ci if g == "dw" else g
    on = OREPAConv2d(ci, co, k, s, dilation=d, groups=groups, branches=branches).double()
    with torch.no_grad():
        for p in on.parameters():
            p.normal_()
    off = OREPAConv2d(ci, co, k, s, dilation=d, groups=groups, branches=branches, mode="offline").double()
    off.load_state_dict(on.state_dict())
    x = torch.randn(2, ci, 11, 11, dtype=torch.double)
    y_on, y_off = on(x), off(x)
    assert y_on.shape == y_off.shape == (2, co, (11 - 1) // s + 1, (11 - 1) // s + 1)
    tol_close(y_on, y_off, rel=1e-12)


def _trains_as_its_kernel(model: nn.Sequential, x: torch.Tensor, conv_of_kernel) -> torch.Tensor:
    """``model`` (a block, then its BN) with random weights: its training output and every gradient
    equal plain autograd through ``conv_of_kernel(w, b)``, the block's squeezed kernel convolved as
    its deployed conv does (float64)."""
    block = model[0]
    with torch.no_grad():
        for q in block.parameters():
            q.normal_()
    y = model.train()(x)
    ref = model[1](conv_of_kernel(*block.equivalent()))
    tol_close(y, ref, rel=1e-12)
    for got, want in zip(torch.autograd.grad(y.square().sum(), [x, *block.parameters()]),
                         torch.autograd.grad(ref.square().sum(), [x, *block.parameters()])):
        tol_close(got, want, rel=1e-10)
    return y


@pytest.mark.parametrize("k,s,p,d,g", [(3, 2, 0, 1, 1), (3, 1, 0, 1, 1), (5, 1, 1, 1, 2), (3, 1, 3, 1, 1),
                                       (3, 2, 0, 2, 8), (1, 1, 1, 1, 1), (7, 2, 0, 1, 1),
                                       # Inception's, a padding per axis, non-square kernels
                                       ((1, 7), 1, (0, 3), 1, 1), ((7, 1), 2, (3, 0), 1, 1), ((3, 5), 1, 0, 1, 2),
                                       ((1, 3), 2, (1, 2), 2, 8), (3, 1, (1, 0), 1, 1)])
@pytest.mark.parametrize("builder", ["auto", "grouped"])
def test_an_online_block_takes_any_padding_and_trains_and_deploys_exactly(k, s, p, d, g, builder):
    """Padding other than "same" (Inception's valid 3x3 convs): the online block convolves with its
    squeezed kernel only, on every route; float64, against plain autograd through its kernel."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, k, s, p, d, groups=g).double()
    model, report = orepa.convert(nn.Sequential(conv, nn.BatchNorm2d(8)).double(), return_report=True)
    assert report.converted == ["0"]
    orepa.engine.group_kernels(model, builder)
    block = model[0]
    x = torch.randn(3, 8, 13, 13, dtype=torch.double, requires_grad=True)
    y = _trains_as_its_kernel(model, x, lambda w, b: F.conv2d(x, w, b, block.stride, block.padding, block.dilation,
                                                             block.groups))
    assert y.shape == conv(x).shape
    model.eval()
    with torch.no_grad():
        deployed = orepa.reparameterize(model)
        assert deployed[0].padding == conv.padding
        tol_close(deployed(x), model(x), rel=1e-12)


@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("k,s,p,d,g", [(3, 1, 1, 1, 1), (3, 2, 1, 1, 2), (5, 1, 2, 1, 1), (3, 1, 2, 2, 8),
                                       ((1, 3), 1, (0, 1), 1, 1), (3, 1, (1, 0), 1, 1), (1, 1, 0, 1, 1)])
@pytest.mark.parametrize("builder", ["auto", "grouped"])
def test_an_online_block_pads_by_its_convs_padding_mode_and_deploys_to_it(padding_mode, k, s, p, d, g, builder):
    """A conv padded by reflection, replication or wrapping (image restoration and generator nets):
    the online block pads its input so, then convolves with its squeezed kernel (a conv is linear in
    its kernel whatever fills the border); float64, every route, against plain autograd through its
    kernel; deployed to an nn.Conv2d of that padding mode."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, k, s, p, d, groups=g, padding_mode=padding_mode).double()
    model, report = orepa.convert(nn.Sequential(conv, nn.BatchNorm2d(8)).double(), return_report=True)
    assert report.converted == ["0"]
    orepa.engine.group_kernels(model, builder)
    block = model[0]
    assert block.padding == conv.padding and block.padding_mode == padding_mode
    x = torch.randn(3, 8, 11, 12, dtype=torch.double, requires_grad=True)
    ph, pw = conv.padding
    y = _trains_as_its_kernel(model, x, lambda w, b: F.conv2d(F.pad(x, (pw, pw, ph, ph), mode=padding_mode), w, b,
                                                             block.stride, 0, block.dilation, block.groups))
    assert y.shape == conv(x).shape
    model.eval()
    with torch.no_grad():
        deployed = orepa.reparameterize(model)
        assert type(deployed[0]) is nn.Conv2d and deployed[0].padding_mode == padding_mode
        assert deployed[0].padding == conv.padding
        tol_close(deployed(x), model(x), rel=1e-12)
        conv.load_state_dict(deployed[0].state_dict())  # the vanilla conv computes it
        tol_close(model[1](conv(x)), model(x), rel=1e-12)
    assert f"padding_mode={padding_mode}" in repr(block)


def test_a_deep_stem_pads_by_its_own_padding_mode_online():
    """The composite blocks pad by their own mode, not their inner steps' (nested steps pad nothing):
    they took padding_mode into their steps and padded by zeros (~10 off the deep stem's reflect conv)."""
    torch.manual_seed(0)
    model = nn.Sequential(OREPADeepStem(3, 8, 7, 2, padding_mode="reflect"), nn.BatchNorm2d(8)).double()
    block = model[0]
    assert block.padding_mode == "reflect"
    x = torch.randn(2, 3, 13, 13, dtype=torch.double, requires_grad=True)
    _trains_as_its_kernel(model, x, lambda w, b: F.conv2d(F.pad(x, (3, 3, 3, 3), mode="reflect"), w, b, 2))
    with torch.no_grad():
        deployed = orepa.reparameterize(model.eval())
        assert deployed[0].padding_mode == "reflect"
        tol_close(deployed(x), model(x), rel=1e-12)


@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("make", [
    lambda m: DBBConv2d(8, 8, 3, padding_mode=m), lambda m: DBBConv2d(8, 16, 3, 2, groups=2, padding_mode=m),
    lambda m: DBBConv2d(8, 8, 5, groups=8, padding_mode=m), lambda m: RepVGGBlock(8, 8, 3, padding_mode=m),
    lambda m: RepVGGBlock(8, 16, 3, 2, padding_mode=m), lambda m: orepa.OREPAVGGBlock(8, 8, 3, padding_mode=m),
    lambda m: OREPAConv2d(8, 8, 3, dilation=2, mode="offline", branch_norm=True, inner_norm=True, padding_mode=m),
    lambda m: OREPADeepStem(8, 8, 7, 2, mode="offline", padding_mode=m)],
    ids=["dbb", "dbb-s2-g2", "dbb-dw5", "repvgg", "repvgg-s2", "orepa-vgg", "offline-d2", "deep-stem-offline"])
def test_a_block_of_feature_map_branches_pads_each_by_its_padding_mode(make, padding_mode):
    """Offline blocks (DBB, RepVGG, OREPA-VGG, the prototype) pad each branch by the mode before its
    first spatial step: its pointwise steps before that run on the map alone (a padding of copies of
    the map's pixels commutes with them; a BN there gathers the map's statistics, as with zeros),
    and in eval the block is one conv of that mode; float64, after training steps."""
    torch.manual_seed(0)
    block = make(padding_mode).double()
    torch.manual_seed(0)
    zeros = make("zeros").double()
    x = torch.randn(4, block.in_channels, 11, 11, dtype=torch.double)
    for _ in range(2):
        block.train()(x)
        zeros.train()(x)
    inner = [n for n, m in block.named_modules() if isinstance(m, nn.BatchNorm2d) and n.endswith(".bn0")
             and ".dw_pw." not in n]  # (dw -> pw's bn0 follows its spatial step)
    for name in inner:
        tol_close(block.get_submodule(name).running_mean, zeros.get_submodule(name).running_mean, rel=1e-12)
    block.eval()
    w, b = block.equivalent()
    with torch.no_grad():
        y = block(x)
        (ph, pw) = block.padding
        tol_close(F.conv2d(F.pad(x, (pw, pw, ph, ph), mode=padding_mode), w, b, block.stride, 0, block.dilation,
                           block.groups), y, rel=1e-12)
        deployed = orepa.reparameterize(block)
        assert type(deployed) is nn.Conv2d and deployed.padding_mode == padding_mode
        tol_close(deployed(x), y, rel=1e-12)


def test_a_padding_mode_is_one_of_nn_conv2ds_and_every_method_takes_it():
    with pytest.raises(ValueError, match=r"unknown padding_mode 'mirror'; nn.Conv2d's are zeros, reflect"):
        OREPAConv2d(8, 8, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match=r"unknown padding_mode 'mirror'"):
        DBBConv2d(8, 8, 3, padding_mode="mirror")
    with pytest.raises(ValueError, match="tf_same=True .* padding_mode='reflect'"):
        OREPAConv2d(8, 8, 3, 2, tf_same=True, padding_mode="reflect")
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(8))
    for method in ("orepa", "dbb", "repvgg", "orepa-offline", "orepa-vgg"):
        converted = orepa.convert(model, method)
        assert next(m for m in converted.modules() if isinstance(m, orepa.ReparamConv2d)).padding_mode == "reflect"


def test_blocks_with_feature_map_branches_need_same_padding():
    for make in (lambda: DBBConv2d(8, 8, 3, padding=0), lambda: RepVGGBlock(8, 8, 3, padding=0),
                 lambda: OREPAConv2d(8, 8, 3, padding=0, mode="offline")):
        with pytest.raises(ValueError, match=r"only 'same' padding 1 keeps branch centres aligned \(online OREPA"):
            make()
    with pytest.raises(ValueError, match=r"unsupported padding \(1, -1\): need a non-negative padding"):
        OREPAConv2d(8, 8, 3, padding=(1, -1))
    assert OREPAConv2d(8, 8, 3, padding="valid").padding == (0, 0)
    assert OREPAConv2d(8, 8, 3, padding=(1, 0)).padding == (1, 0)  # one per axis
    with pytest.raises(ValueError, match=r"only 'same' padding \(0, 1\) keeps branch centres aligned"):
        DBBConv2d(8, 8, (1, 3), padding=1)
    # 'same' with a stride: nn.Conv2d refuses it; a block took it as the centred padding silently
    with pytest.raises(ValueError, match=r"padding='same' is not supported with stride 2 .* give padding=1"):
        OREPAConv2d(8, 8, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="padding='same' is not supported for strided convolutions"):
        nn.Conv2d(8, 8, 3, stride=2, padding="same")
    assert OREPAConv2d(8, 8, 3, stride=2).padding == (1, 1) and OREPAConv2d(8, 8, 3, padding="same").padding == (1, 1)


@pytest.mark.parametrize("method", list(FACTORIES))
def test_every_parameter_gets_a_gradient(method):
    block, ci = _build(method, (3, 1, 1, 1, (8, 8)))
    with torch.no_grad():  # a zero-initialised scale (freq prior) would zero its branch's gradient
        for name, p in block.named_parameters():
            if "scale" in name:
                p.fill_(0.5)
    block(torch.randn(2, ci, 7, 7)).square().sum().backward()
    for name, p in block.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("k", [5, 7])
@pytest.mark.parametrize("stride", [1, 2])
def test_deep_stem_online_offline_and_deploy(k, stride):
    on = OREPADeepStem(3, 8, k, stride).double()
    with torch.no_grad():
        for p in on.parameters():
            p.normal_(std=0.3)
    off = OREPADeepStem(3, 8, k, stride, mode="offline").double()
    off.load_state_dict(on.state_dict())
    x = torch.randn(2, 3, 16, 16, dtype=torch.double)
    tol_close(on(x), off(x), rel=1e-12)
    tol_close(orepa.reparameterize(on)(x), on(x), rel=1e-12)
    # the stem equals (k-1)/2 stacked 3x3 layers that pad by 1 each ONLY away from the border
    y = x
    layers = list(on.branches["stem"])
    for i, layer in enumerate(layers):
        y = torch.nn.functional.conv2d(y, layer.kernel(), stride=stride if i == len(layers) - 1 else 1, padding=1)
    n = (k - 1) // 2  # border pixels influenced by per-layer padding
    m = -(-n // stride)
    ref = on(x)
    inner = (slice(None), slice(None), slice(m, ref.shape[-2] - m), slice(m, ref.shape[-1] - m))
    tol_close(y[inner], ref[inner], rel=1e-12)
    assert (y - ref).abs().max() > 1e-6  # and they do differ at the border


def test_deep_stem_trains_and_deploys_in_a_resnet_stem():
    stem = nn.Sequential(OREPADeepStem(3, 16), nn.BatchNorm2d(16), nn.ReLU())
    _train(stem, 3)
    stem.eval()
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        tol_close(orepa.reparameterize(stem, fuse_bn=True)(x), stem(x))


def test_scale_initialisation_follows_the_supplement():
    b = OREPAConv2d(8, 8, 3)
    want = {"kxk": 0.25, "1x1": 1.0, "1x1_avg": 0.5, "1x1_prior": 0.0, "1x1_kxk": 0.5, "dw_pw": 0.5}
    assert set(b.branches) == set(want)
    for name, v in want.items():
        assert torch.all(b.branches[name].scale.weight == v), name
    b = OREPAConv2d(8, 8, 3, scale_init={"1x1_avg": 0.25})
    assert torch.all(b.branches["1x1_avg"].scale.weight == 0.25)
    r = OREPAConv2d(8, 16, 1)
    assert set(r.branches) == {"1x1", "1x1_1x1"}
    assert OREPAConv2d(8, 8, 3, scaling="scalar").branches["kxk"].scale.weight.shape == (1,)
    assert not hasattr(OREPAConv2d(8, 8, 3, scaling="none").branches["kxk"], "scale")


def test_one_x_one_kxk_branch_starts_as_identity_then_kxk():
    b = OREPAConv2d(8, 8, 3, branches=("1x1_kxk",), scaling="none")
    conv2 = b.branches["1x1_kxk"].conv2.weight
    torch.testing.assert_close(b.kernel(), conv2.detach())


@pytest.mark.parametrize("init", ["reference", "torch"])
def test_a_widened_one_x_one_kxk_starts_from_the_identity_its_init_names(init):
    """Where the 1x1 -> kxk branch widens its intermediate (a depthwise block: 2x its input), its 1x1
    starts as the published code's tiled identity (``init="reference"``: output o reads input
    o mod C_in of its group) or as the spread identity (``init="torch"``), exactly."""
    b = OREPAConv2d(16, 16, 3, groups=16, init=init)
    w = b.branches["1x1_kxk"].conv1.weight
    assert w.shape == (32, 1, 1, 1)
    tiled, spread = K.tiled_identity_1x1(32, 16, 16), K.identity_init_1x1(32, 16, 16)
    assert not torch.equal(tiled, spread)  # (the case tells them apart)
    torch.testing.assert_close(w.detach(), tiled if init == "reference" else spread, rtol=0, atol=0)
    b = OREPAConv2d(4, 8, 3, groups=2, init=init, internal_channels=8)  # widened 2x per group
    w = b.branches["1x1_kxk"].conv1.weight
    torch.testing.assert_close(w.detach(), (K.tiled_identity_1x1 if init == "reference" else K.identity_init_1x1)(
        8, 4, 2), rtol=0, atol=0)


def test_fixed_filters_are_not_parameters_nor_checkpointed():
    b = OREPAConv2d(8, 8, 3)
    names = set(b.state_dict())
    assert not any("pool" in n or "prior" in n.split(".")[-2] for n in names if n.endswith("weight") and ".prior." in n)
    assert "branches.1x1_prior.prior.weight" not in names
    assert "branches.1x1_avg.pool.weight" not in names
    assert all(p.requires_grad for p in b.parameters())


def test_eval_mode_deploy_is_independent_of_batch():
    block = DBBConv2d(4, 8, 3)
    _train(nn.Sequential(block), 4)
    block.eval()
    x = torch.randn(3, 4, 9, 9)
    with torch.no_grad():
        tol_close(block(x[:1]), block(x)[:1])
        tol_close(block.to_conv()(x), block(x))


def test_block_exposes_conv_attributes():
    b = OREPAConv2d(4, 8, 3, 2, dilation=2, groups=2)
    assert (b.in_channels, b.out_channels, b.kernel_size, b.stride, b.padding, b.dilation, b.groups) == (
        4, 8, (3, 3), (2, 2), (2, 2), (2, 2), 2)
    assert b.kernel().shape == (8, 2, 3, 3)


def test_bias_is_kept_through_deploy():
    b = OREPAConv2d(4, 8, 3, bias=True)
    with torch.no_grad():
        b.bias.normal_()
    x = torch.randn(1, 4, 6, 6)
    c = orepa.reparameterize(b)
    assert isinstance(c, nn.Conv2d) and c.bias is not None
    tol_close(c(x), b(x))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kernel_size=4), "even"),
        (dict(kernel_size=(3, 4)), "even"),
        (dict(kernel_size=3, padding=-1), "padding"),
        (dict(kernel_size=3, padding=(1, -1)), "padding"),
        (dict(kernel_size=3, stride=(1, 2)), "stride"),
        (dict(kernel_size=3, dilation=(1, 2)), "dilation"),
        (dict(kernel_size=3, groups=3), "groups"),
        (dict(kernel_size=3, branches=("kxk", "bogus")), "unknown branch"),
        (dict(kernel_size=3, branches=()), "at least one"),
        (dict(kernel_size=3, scaling="matrix"), "scaling"),
        (dict(kernel_size=3, scale_init={"nope": 1.0}), "unknown branches"),
        (dict(kernel_size=3, branches=("kxk", "identity")), "identity"),
        (dict(kernel_size=3, branch_norm=True), "offline"),
        (dict(kernel_size=1, branches=("kxk",)), "1x1 block"),
        (dict(kernel_size=3, mode="lazy"), "mode"),
    ],
)
def test_bad_configurations_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OREPAConv2d(4, 8, **kwargs)


def test_more_bad_configurations():
    with pytest.raises(ValueError, match="kernel_size >= 3"):
        DBBConv2d(4, 8, 1)
    with pytest.raises(ValueError, match="kernel_size >= 3"):
        RepVGGBlock(4, 8, 1)
    with pytest.raises(ValueError, match="deep stem"):
        OREPADeepStem(3, 8, 3)
    with pytest.raises(ValueError, match="identity"):
        OREPAConv2d(4, 8, 3, branches=("identity",))
    with pytest.raises(ValueError, match=r"expects input \[N, 4, H, W\]"):
        OREPAConv2d(4, 8, 3)(torch.randn(1, 3, 5, 5))
    with pytest.raises(ValueError, match="padding_mode"):
        orepa.check_conv_config(4, 8, 3, padding_mode="reflected")
    assert orepa.check_conv_config(4, 8, 3, padding_mode="reflect")[2] == (1, 1)


@pytest.mark.parametrize(
    "make,error,match",
    [
        # zero / negative sizes: before, an IndexError at forward, torch's "negative dimension" error,
        # "even kernels", or silently the default (internal_channels=0, mid_channels=0)
        (lambda: OREPAConv2d(4, 8, 3, dw_expand=0), ValueError, r"dw_expand must be an int >= 1, got 0"),
        (lambda: OREPAConv2d(4, 8, 3, dw_expand=-1), ValueError, r"dw_expand must be an int >= 1, got -1"),
        (lambda: OREPAConv2d(4, 8, 3, dw_expand=2.0), TypeError, r"dw_expand must be an int >= 1, got 2\.0"),
        (lambda: OREPAVGGBlock(4, 8, 3, dw_expand=0), ValueError, r"dw_expand must be an int >= 1, got 0"),
        (lambda: OREPADeepStem(3, 8, 7, dw_expand=0), ValueError, r"dw_expand must be an int >= 1, got 0"),
        (lambda: orepa.build_branches(["kxk"], 4, 8, 3, 1, dw_expand=0), ValueError, r"dw_expand .* got 0"),
        (lambda: OREPAConv2d(4, 8, 3, internal_channels=0), ValueError, r"internal_channels must be .* got 0"),
        (lambda: OREPAConv2d(4, 8, 1, internal_channels=0), ValueError, r"internal_channels must be .* got 0"),
        (lambda: OREPAConv2d(4, 8, 3, internal_channels=-2), ValueError, r"internal_channels must be .* got -2"),
        (lambda: DBBConv2d(4, 8, 3, internal_channels=0), ValueError, r"internal_channels must be .* got 0"),
        (lambda: OREPAConv2d(4, 8, 0), ValueError, r"kernel_size must be a positive odd int \(or a pair of them\), got 0"),
        (lambda: OREPAConv2d(4, 8, -3), ValueError, r"kernel_size must be a positive odd int \(or a pair of them\), got -3"),
        (lambda: OREPADeepStem(3, 8, 7, mid_channels=0), ValueError, r"mid_channels must be an int >= 1 .* got 0"),
        (lambda: OREPADeepStem(3, 8, 7, mid_channels=-1), ValueError, r"mid_channels must be an int >= 1 .* got -1"),
        # bools are ints to isinstance: True was one channel (or torch's "empty()" TypeError)
        (lambda: OREPAConv2d(True, 8, 3), TypeError, r"in_channels must be an int, got True"),
        (lambda: OREPAConv2d(4, True, 3), TypeError, r"out_channels must be an int, got True"),
        (lambda: OREPAConv2d(4, 8, 3, groups=True), TypeError, r"groups must be an int, got True"),
        (lambda: OREPAConv2d(4, 8, True), TypeError, r"kernel_size must be .* not a bool; got True"),
        (lambda: OREPADeepStem(3, 8, 7, mid_channels=True), TypeError, r"mid_channels must be an int .* got True"),
        # branch lists: duplicates were collapsed, a string split into letters
        (lambda: OREPAConv2d(4, 8, 3, branches=("kxk", "1x1", "kxk")), ValueError, r"duplicate branches \['kxk'\]"),
        (lambda: orepa.build_branches(["1x1", "1x1"], 4, 8, 3, 1), ValueError, r"duplicate branches \['1x1'\]"),
        (lambda: OREPAConv2d(4, 8, 3, branches="kxk"), TypeError, r"branches must be a sequence .* string 'kxk'"),
        # scale_init that nothing reads was ignored
        (lambda: OREPAConv2d(4, 8, 3, scaling="none", scale_init={"kxk": 0.5}), ValueError,
         r"scale_init=\{'kxk': 0\.5\} has no scale to start.*scaling='none'"),
        (lambda: OREPAConv2d(4, 8, 3, mode="offline", branch_norm=True, scale_init={"kxk": 0.5}), ValueError,
         r"scale_init=.* has no scale to start.*branch_norm=True"),
        (lambda: OREPAConv2d(4, 8, 3, scale_init={"kxk": "0.5"}), TypeError, r"scale_init\['kxk'\] must be a number"),
        # a NaN or inf scale made every output NaN
        (lambda: OREPAConv2d(4, 8, 3, scale_init={"1x1": float("inf")}), ValueError,
         r"scale_init\['1x1'\] must be a finite number, got inf"),
        (lambda: orepa.build_branches([], 4, 8, 3, 1), ValueError, "branches must name at least one branch"),
    ],
)
def test_bad_sizes_and_types_raise_at_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_none_means_the_default_width():
    # OREPA-VGG's own default intermediate (in_channels unless depthwise), not OREPAConv2d's (2x when groups > 4)
    given = OREPAVGGBlock(8, 16, 3, groups=8, internal_channels=None).branches["kxk"].orepa
    default = OREPAVGGBlock(8, 16, 3, groups=8).branches["kxk"].orepa
    assert given.branches["1x1_kxk"].conv1.out_channels == default.branches["1x1_kxk"].conv1.out_channels == 8
    assert OREPADeepStem(3, 8, 7, mid_channels=None).branches["stem"].layer0.out_channels == 8
    assert OREPADeepStem(3, 8, 7, mid_channels=5).branches["stem"].layer0.out_channels == 5


def test_a_new_branch_type_is_one_registration():
    """register_branch is the whole of adding a branch type: blocks, convert, the zoo and the CLI take it."""
    import argparse

    from orepa.apps.model_cfg import add_model_arguments, block_options_from_args

    new = orepa.BranchType("kxk_twin_test", lambda cin, cout, k, g, c: {"conv": c.conv(cin, cout, k, g)}, 0.1,
                           switch="twin_test", help="a second kxk conv")
    try:
        orepa.register_branch(new)
        with pytest.raises(ValueError, match="already registered"):
            orepa.register_branch(new)
        block = orepa.OREPAConv2d(6, 8, 3, branches=(*orepa.OREPA_BRANCHES, "kxk_twin_test")).double()
        assert block.branches["kxk_twin_test"].scale.weight[0].item() == pytest.approx(0.1)
        x = torch.randn(2, 6, 9, 9, dtype=torch.float64)
        with torch.no_grad():
            tol_close(orepa.reparameterize(block.eval())(x), block(x), rel=1e-12)
        # a registered kh x 1 conv is not a 1x1 of the grouped route's filter family
        tall = orepa.OREPAConv2d(4, 4, (3, 1), branches=("kxk", "kxk_twin_test", "1x1", "1x1_avg")).double()
        orepa.engine.group_kernels(tall, "grouped")
        z = torch.randn(2, 4, 6, 6, dtype=torch.float64)
        y = tall(z)  # with autograd: the grouped route
        with torch.no_grad():
            tol_close(y, orepa.reparameterize(copy.deepcopy(tall).eval())(z), rel=1e-12)
        model = orepa.create_model("resnet18", "orepa", num_classes=3, width_mult=0.125,
                                   branches=["kxk", "kxk_twin_test"], deep_stem=False)
        assert set(model.layer1[0].conv1.branches) == {"kxk", "kxk_twin_test"}
        # its switch: off leaves the six, on adds it to them (it was accepted and added nothing)
        off = orepa.create_model("resnet18", "orepa", num_classes=3, width_mult=0.125, twin_test=False)
        assert tuple(off.layer1[0].conv1.branches) == orepa.OREPA_BRANCHES
        on = orepa.create_model("resnet18", "orepa", num_classes=3, width_mult=0.125, twin_test=True)
        assert tuple(on.layer1[0].conv1.branches) == (*orepa.OREPA_BRANCHES, "kxk_twin_test")
        assert "kxk_twin_test" in on.conv1.branches[next(iter(on.conv1.branches))][0].branches  # the deep stem's too
        p = argparse.ArgumentParser()
        add_model_arguments(p)
        assert block_options_from_args(p.parse_args(["--no-twin-test"]))["twin_test"] is False
        assert block_options_from_args(p.parse_args(["--twin-test"]))["twin_test"] is True
    finally:
        orepa.BRANCH_TYPES.pop("kxk_twin_test", None)
    with pytest.raises(ValueError, match="unknown branch"):
        orepa.OREPAConv2d(6, 8, 3, branches=("kxk", "kxk_twin_test"))


@pytest.mark.parametrize("size", [9, 10])
@pytest.mark.parametrize("k,s,d,g", [(3, 2, 1, 1), (5, 2, 1, 8), ((1, 3), 2, 1, 1), (3, 1, 2, 1), (1, 2, 1, 1)])
@pytest.mark.parametrize("builder", ["auto", "grouped"])
def test_a_tf_same_block_pads_as_tensorflow_and_deploys_to_a_conv_that_does(k, s, d, g, size, builder):
    """TensorFlow's "SAME" padding (timm's Conv2dSame): per axis enough for an output of
    ceil(n / stride), the odd pixel at the end, from each input's size; float64, every route, the
    gradients against autograd through the block's kernel; deployed to Conv2dTFSame."""
    torch.manual_seed(0)
    model = nn.Sequential(OREPAConv2d(8, 8, k, s, dilation=d, groups=g, tf_same=True), nn.BatchNorm2d(8)).double()
    orepa.engine.group_kernels(model, builder)
    block = model[0]
    x = torch.randn(3, 8, size, size + 1, dtype=torch.double, requires_grad=True)
    pads = []
    for n, kk in zip(x.shape[-2:], block.kernel_size):
        total = max((-(-n // s) - 1) * s + (kk - 1) * d + 1 - n, 0)
        pads.append((total // 2, total - total // 2))
    y = _trains_as_its_kernel(model, x, lambda w, b: F.conv2d(F.pad(x, (*pads[1], *pads[0])), w, b, s, 0, d,
                                                             block.groups))
    assert y.shape[-2:] == (-(-size // s), -(-(size + 1) // s))
    model.eval()
    with torch.no_grad():
        deployed = orepa.reparameterize(model)
        assert type(deployed[0]) is orepa.Conv2dTFSame and deployed[0].padding == (0, 0)
        tol_close(deployed(x), model(x), rel=1e-12)
        small = x[:, :, :size - 1, :size - 2]  # each input pads by its own size
        tol_close(deployed(small), model(small), rel=1e-12)
    assert "padding=tf_same" in repr(block)
    for bad in (lambda: OREPAConv2d(8, 8, 3, 2, padding=1, tf_same=True),
                lambda: OREPAConv2d(8, 8, 3, 2, tf_same=True, mode="offline")):
        with pytest.raises(ValueError, match="tf_same=True .* is for online blocks that pad nothing else"):
            bad()
    for none in (0, (0, 0), [0, 0], "valid", None):  # every way of asking for no other padding
        assert OREPAConv2d(8, 8, 3, 2, padding=none, tf_same=True).tf_same
    assert orepa.Conv2dTFSame(8, 8, 3, 2, padding="valid").padding == (0, 0)
    with pytest.raises(ValueError, match=r"pads by itself; padding must be 0 or 'valid', got \(1, 1\)"):
        orepa.Conv2dTFSame(8, 8, 3, 2, padding=1)
    with pytest.raises(ValueError, match="mode must be 'online' or 'offline'"):  # not a tf_same complaint
        OREPAConv2d(8, 8, 3, 2, tf_same=True, mode="onlin")


@pytest.mark.parametrize("size", [9, 10])
def test_a_tf_same_deep_stem_pads_as_one_conv_of_its_composed_kernel(size):
    """``OREPADeepStem(..., tf_same=True)`` went to its nested 3x3 steps, which pad nothing: the stem
    padded symmetrically and deployed to an nn.Conv2d, without a word. It now pads by TensorFlow's
    rule as one conv of its composed kernel (float64, gradients against autograd through that
    kernel) and deploys to Conv2dTFSame; offline, it is refused as every block's tf_same is."""
    torch.manual_seed(0)
    model = nn.Sequential(OREPADeepStem(3, 8, 7, 2, tf_same=True), nn.BatchNorm2d(8)).double()
    stem = model[0]
    assert stem.tf_same and not any(getattr(m, "tf_same", False) for m in stem.branches.modules())
    x = torch.randn(2, 3, size, size + 1, dtype=torch.double, requires_grad=True)
    pads = [(t // 2, t - t // 2) for t in (max((-(-n // 2) - 1) * 2 + 7 - n, 0) for n in x.shape[-2:])]
    _trains_as_its_kernel(model, x, lambda w, b: F.conv2d(F.pad(x, (*pads[1], *pads[0])), w, b, 2))
    model.eval()
    with torch.no_grad():
        deployed = orepa.reparameterize(model)
        assert type(deployed[0]) is orepa.Conv2dTFSame
        tol_close(deployed(x), model(x), rel=1e-12)
    with pytest.raises(ValueError, match="tf_same=True .* is for online blocks that pad nothing else"):
        OREPADeepStem(3, 8, 7, 2, tf_same=True, mode="offline")


@pytest.mark.parametrize("make", [lambda: OREPAConv2d(8, 8, 3), lambda: DBBConv2d(8, 8, 3),
                                  lambda: OREPADeepStem(3, 8)], ids=["orepa", "dbb", "deep_stem"])
def test_a_block_made_on_the_meta_device_gets_its_fixed_kernels(make):
    """FSDP's and accelerate's flow: made on the meta device, then materialised (``to_empty``) or loaded
    with ``assign=True``. The fixed kernels (average pool, frequency prior, identity) are buffers that
    no checkpoint holds: they stayed uninitialised memory (the output 9e21 off, or NaN) or on the meta
    device."""
    torch.manual_seed(0)
    ref = make().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.rand_like(p), alpha=0.1)
    x = torch.randn(2, ref.in_channels, 8, 8)
    fixed = {n: b for n, b in ref.named_buffers() if n.endswith((".pool.weight", ".prior.weight", ".id.weight"))}
    assert fixed or isinstance(ref, OREPADeepStem)
    for how in ("to_empty", "assign"):
        with torch.device("meta"):
            blk = make()
        if how == "to_empty":
            blk = blk.to_empty(device="cpu")
            blk.load_state_dict(ref.state_dict())
        else:
            blk.load_state_dict(ref.state_dict(), assign=True)
        assert not any(t.is_meta for t in (*blk.parameters(), *blk.buffers())), how
        for n, b in blk.named_buffers():
            if n in fixed:
                assert torch.equal(b, fixed[n]), (how, n)
        torch.testing.assert_close(blk.eval()(x), ref(x), rtol=0, atol=0)


def test_fixed_kernels_follow_conversions_with_the_values_they_were_built_with():
    """Made anew at every conversion, in the dtype the block was built in, then cast: a float32 block
    moved to float64 keeps float32 constants (as the paper's code), round trips change nothing."""
    blk = OREPAConv2d(4, 4, 3)
    avg = blk.branches["1x1_avg"].pool.weight.clone()
    assert avg.dtype == torch.float32
    blk.double()
    assert torch.equal(blk.branches["1x1_avg"].pool.weight, avg.double())
    blk.half().float()
    assert torch.equal(blk.branches["1x1_avg"].pool.weight, avg)  # not the float16-rounded 1/9


@pytest.mark.parametrize("name", ["1x1_kxk", "1x1_avg"])
def test_dbb_branch_bn_before_the_spatial_step_normalises_the_unpadded_map(name):
    """DBB's 1x1 -> BN -> kxk / avg branches ("BN-and-pad"): in training the inner BN takes its batch
    statistics over the unpadded map, and the border is padded with what the 1x1 -> BN gives a zero
    input on running statistics (not differentiated). Padding the input first instead put the
    zero border into the batch statistics (1.4 off at a 6x6 map, running statistics drifting)."""
    torch.manual_seed(0)
    blk = DBBConv2d(4, 6, 3, 1, 1).double().train()
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(0.3 * torch.randn_like(p))
    br = blk.branches[name]
    ref = copy.deepcopy(br)
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    steps = list(ref.children())
    h = F.conv2d(x, steps[0].kernel())
    bn0 = steps[1]
    h = F.batch_norm(h, bn0.running_mean, bn0.running_var, bn0.weight, bn0.bias, True, bn0.momentum, bn0.eps)
    pad = (bn0.bias - bn0.running_mean * bn0.weight / (bn0.running_var + bn0.eps).sqrt()).detach().view(1, -1, 1, 1)
    h = F.pad(h - pad, (1, 1, 1, 1)) + pad
    h = F.conv2d(h, steps[2].kernel(), groups=steps[2].groups)
    tail = steps[3]
    want = F.batch_norm(h, tail.running_mean, tail.running_var, tail.weight, tail.bias, True, tail.momentum, tail.eps)
    got = br.run(x, 1, 1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (n, a), b in zip(br.named_buffers(), ref.buffers()):
        if a.is_floating_point():  # the running statistics (F.batch_norm counts no batches)
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=n)
    g, = torch.autograd.grad(got.square().sum(), [br.bn0.weight])
    gw, = torch.autograd.grad(want.square().sum(), [ref.bn0.weight])
    torch.testing.assert_close(g, gw, rtol=1e-10, atol=1e-12)
    blk.eval()  # on running statistics, the squeezed kernel's function, as before
    with torch.no_grad():
        w, b = blk.equivalent()
        tol_close(blk(x), F.conv2d(x, w, b, 1, 1))


@pytest.mark.parametrize("method", ["dbb", "orepa-offline", "repvgg"])
def test_plain_weights_load_into_blocks_that_absorbed_a_bn_without_affine(method):
    """A BatchNorm2d(affine=False) absorbed by a block holding its own (affine) BNs: the plain
    network's state loads (weight 1, bias 0: the same function) and the block computes the plain
    network, in eval and in training."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8, affine=False)).double()
    with torch.no_grad():
        plain[1].running_mean.uniform_(-0.5, 0.5)
        plain[1].running_var.uniform_(0.5, 2.0)
    block = orepa.convert(copy.deepcopy(plain), method)
    orepa.load_plain_state_dict(block, plain.state_dict())
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    for training in (False, True):
        plain.train(training), block.train(training)
        with torch.no_grad():
            tol_close(block(x), plain(x))


def test_dbb_on_a_depthwise_conv_has_dbbs_own_branches():
    """DBB on a depthwise conv (groups >= out_channels): no 1x1 branch, the average pool of the input
    itself (then its BN), and a 1x1 -> kxk whose 1x1 is widened to 2 C_in and is a plain random conv
    (DBB's identity-based layer is square only): DBB's 624 parameters for a 16-channel 3x3 depthwise
    conv (its four general branches made 720). A channel multiplier keeps the general structure."""
    torch.manual_seed(0)
    dw = DBBConv2d(16, 16, 3, 1, 1, groups=16)
    assert list(dw.branches) == ["kxk", "avg", "1x1_kxk"]
    assert [type(s).__name__ for s in dw.branches["avg"]] == ["FixedKernelStep", "BatchNorm2d"]
    first = dw.branches["1x1_kxk"].conv1
    assert (first.out_channels, first.init, first.decays_to_init) == (32, "kaiming", False)
    assert sum(p.numel() for p in dw.parameters()) == 624
    assert list(DBBConv2d(16, 32, 3, 1, 1, groups=16).branches) == ["kxk", "1x1", "1x1_avg", "1x1_kxk"]
    assert sum(p.numel() for p in DBBConv2d(16, 32, 3, 1, 1, groups=16).parameters()) == 1008
    assert DBBConv2d(16, 16, 3, 1, 1).branches["1x1_kxk"].conv1.decays_to_init  # square: identity-based
    dw = dw.double()
    with torch.no_grad():
        for m in dw.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5), m.running_var.uniform_(0.5, 2.0), m.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 16, 7, 7, dtype=torch.float64)
    dw.train()(x).square().sum().backward()  # trains
    with torch.no_grad():
        tol_close(orepa.reparameterize(dw.eval())(x), dw(x))
    with pytest.raises(ValueError, match="the avg branch pools each input channel"):
        orepa.blocks.build_branches(["avg"], 8, 16, 3, 1)


@pytest.mark.parametrize("k,s,d", [(3, 2, 1), (5, 3, 1), ((3, 5), 2, 2)])
def test_a_tf_same_deployed_conv_scripts_and_pads_as_eagerly(k, s, d):
    """A block made with ``tf_same=True`` deploys to ``Conv2dTFSame``, which TorchScript refused
    (``'Tensor' object has no attribute or method 'forward'``): scripted, it pads as it does eagerly
    at every input size."""
    torch.manual_seed(0)
    block = OREPAConv2d(3, 4, k, stride=s, dilation=d, tf_same=True).eval()
    deployed = orepa.reparameterize(nn.Sequential(block))
    scripted = torch.jit.script(deployed)
    for size in ((7, 9), (8, 8), (5, 12), (2, 3)):
        x = torch.randn(2, 3, *size)
        torch.testing.assert_close(scripted(x), deployed(x), rtol=0, atol=0)
        torch.testing.assert_close(deployed(x), block(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_symbolic_trace_records_each_block_as_one_call(mode):
    """torch.fx (torchvision's ``create_feature_extractor``) traced into the block's forward and
    failed on its input check ("symbolically traced variables cannot be used as inputs to control
    flow"): a block is now one ``call_module``, as a torch.nn layer is, and the features equal the
    model's, training forwards (the engine's kernels) included."""
    import torchvision
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    model = orepa.convert(torchvision.models.resnet18(num_classes=10), method="orepa").double()
    getattr(model, mode)()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    traced = torch.fx.symbolic_trace(model)
    calls = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert "layer1.0.conv1" in calls and not any(".branches." in c for c in calls)
    features = create_feature_extractor(model, {"layer2": "f2", "fc": "out"})
    seen = {}
    model.layer2.register_forward_hook(lambda mod, i, o: seen.__setitem__("f2", o))
    with torch.set_grad_enabled(mode == "train"):
        got, want = features(x), model(x)
        torch.testing.assert_close(traced(x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["out"], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["f2"], seen["f2"], rtol=1e-12, atol=1e-12)


def _reparametrize(step: nn.Module, how: str) -> None:
    from torch.nn.utils import prune

    if how == "prune":
        prune.l1_unstructured(step, "weight", amount=0.5)
    elif how == "weight_norm":
        torch.nn.utils.parametrizations.weight_norm(step)
    else:  # the hook-based weight_norm (weight_g, weight_v)
        torch.nn.utils.weight_norm(step)


@pytest.mark.parametrize("how", ["prune", "weight_norm", "hook_weight_norm"])
def test_a_pruned_or_parametrized_branch_step_is_refused_by_name(how):
    """``prune`` / ``weight_norm`` on a branch's step take its weight slot away, which the block
    reads to build its kernel: a TypeError naming the step and what to do (the deployed model
    prunes as any conv net), at the next forward, whatever route the input takes, and at deployment.
    The hook-based ``weight_norm`` was a bare ``KeyError: 'weight'``; a small input (its 1x1 -> kxk and
    dw -> pw branches on the feature map) trained on the step's stale pruned copy, and
    ``reparameterize`` deployed it."""
    torch.manual_seed(0)
    for mode in ("online", "offline"):
        block = OREPAConv2d(16, 16, 3, padding=1, mode=mode)
        steps = [block.branches["kxk"].conv, block.branches["dw_pw"].pw, block.branches["1x1"].scale]
        for step, name in zip(steps, ("branches.kxk.conv", "branches.dw_pw.pw", "branches.1x1.scale")):
            fresh = OREPAConv2d(16, 16, 3, padding=1, mode=mode)
            fresh.load_state_dict(block.state_dict())
            _reparametrize(fresh.get_submodule(name), how)
            refused = rf"the weight of {re.escape(name)} is pruned or parametrized.*prune or parametrize the deployed"
            # large and small inputs: the kernel route, and (online) the feature map's for dw -> pw
            for x in (torch.randn(4, 16, 16, 16), torch.randn(1, 16, 2, 2)):
                for train in (True, False):
                    with pytest.raises(TypeError, match=refused):
                        fresh.train(train)(x)
                with torch.no_grad(), pytest.raises(TypeError, match=refused):
                    fresh.eval()(x)
            with pytest.raises(TypeError, match=refused):
                orepa.reparameterize(fresh.eval())
    net = nn.Sequential(OREPAConv2d(4, 4, 3, padding=1), OREPAConv2d(4, 4, 3, padding=1))
    orepa.engine.group_kernels(net, "grouped")
    _reparametrize(net[1].branches["kxk"].conv, how)
    with pytest.raises(TypeError, match=r"the weight of 1\.branches\.kxk\.conv is pruned"):  # named in the network
        net(torch.randn(2, 4, 6, 6))


@pytest.mark.parametrize("how", ["prune", "weight_norm", "hook_weight_norm"])
@pytest.mark.parametrize("inplace", [False, True])
def test_reparameterize_refuses_a_network_with_a_pruned_branch_step_by_name(how, inplace):
    """In a network (not a bare block), ``reparameterize`` copied the model first: ``prune`` and the
    hook-based ``weight_norm`` leave the step's ``weight`` a computed (non-leaf) tensor, which
    ``copy.deepcopy`` refuses ("Only Tensors created explicitly by the user ..."), so the named
    refusal never came; in place, the blocks before the step's were already plain convs when it came."""
    torch.manual_seed(0)
    net = nn.Sequential(OREPAConv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), OREPAConv2d(4, 4, 3, padding=1),
                        nn.BatchNorm2d(4))
    _reparametrize(net[2].branches["kxk"].conv, how)
    with pytest.raises(TypeError, match=r"the weight of 2\.branches\.kxk\.conv is pruned or parametrized"):
        orepa.reparameterize(net.eval(), inplace=inplace)
    assert isinstance(net[0], OREPAConv2d) and isinstance(net[2], OREPAConv2d)  # nothing deployed


def test_reset_parameters_resets_the_branch_scales_too():
    """``model.apply(lambda m: m.reset_parameters())`` reset the convs and BNs but left every
    branch scale at its trained value (``Scale`` had no ``reset_parameters``)."""
    torch.manual_seed(0)
    block = OREPAConv2d(4, 4, 3, padding=1)
    started = {k: v.clone() for k, v in block.state_dict().items() if k.endswith("scale.weight")}
    assert len(started) >= 5 and len({float(v[0]) for v in started.values()}) > 1  # (not all one value)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(1.0)
    block.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    for k, v in started.items():
        torch.testing.assert_close(block.state_dict()[k], v, rtol=0, atol=0, msg=k)
    old = block.branches["kxk"].scale
    del old.__dict__["init_value"]  # a Scale pickled before it kept its value
    with pytest.raises(RuntimeError, match="pickled before scales kept the value they start with"):
        old.reset_parameters()


def test_a_symbolic_trace_of_a_bare_block_is_refused_with_the_way_out():
    with pytest.raises(TypeError, match=r"torch.fx cannot trace the OREPAConv2d block itself.*trace the network"):
        torch.fx.symbolic_trace(OREPAConv2d(4, 4, 3, padding=1))


@pytest.mark.parametrize("method", ["dbb", "orepa-offline"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_bn_and_pad_branches_exactly(method, reentrant):
    """A branch with a BN before its kxk step pads with what its steps give a zero input on running
    statistics (DBB's BN-and-pad); activation checkpointing's recomputation ran those BNs again in
    training mode, which updated the statistics a second time, so the backward differentiated
    another function: every DBB weight of the checkpointed stage ~30% off (up to 1.7x), silently.
    The recomputation now leaves the statistics those pads read as the first run left them: the
    gradients are those of the run without checkpointing."""
    torch.manual_seed(0)
    model = orepa.create_model("resnet18", method, num_classes=4, width_mult=0.0625, small_input=True).double()
    for bn in model.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    checkpointed = copy.deepcopy(model)
    checkpointed.layer2 = Checkpointed(checkpointed.layer2, reentrant)
    x = torch.randn(2, 3, 16, 16, dtype=torch.double, requires_grad=reentrant)
    for m in (model, checkpointed):
        m.train()(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    # a BN whose statistics the recomputation kept kept its batch count too (what a BN without
    # momentum averages by); the stage's other BNs are counted twice, as torch's checkpointing does
    kept = 0
    bns = [[(n, m) for n, m in net.named_modules() if isinstance(m, nn.BatchNorm2d)] for net in (model, checkpointed)]
    for (name, a), (_, b) in zip(*bns, strict=True):
        same_stats = torch.equal(a.running_mean, b.running_mean)
        kept += same_stats
        assert same_stats == torch.equal(a.num_batches_tracked, b.num_batches_tracked), name
    assert kept > 0


def test_the_checkpointing_check_breaks_no_compiled_graph():
    """The recomputation check (``torch._C._current_graph_task_id``, which dynamo cannot trace) broke
    the graph in every BN-and-pad branch: a compiled DBB ResNet-18 step became 17 graphs and ran slower
    than eager. It is not asked in compiled code."""
    import torch._dynamo

    torch.manual_seed(0)
    block = DBBConv2d(4, 4, 3, padding=1).train()
    explained = torch._dynamo.explain(block)(torch.randn(2, 4, 6, 6))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
