"""Model zoo: every (name, method) builds, trains, deploys exactly, and deploys to the vanilla layout."""
import contextlib
import importlib.util

import pytest
import torch
import torchvision
from conftest import tol_close, zoo_cases
from torch import nn

import orepa
import orepa.models as zoo

ALL = zoo_cases()  # every method on each distinct architecture, the main one on depth/width variants
TORCHVISION = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d"]
# full eval-output equality after reparameterize: the small models, all methods, and a few big ones
EXACT = {(n, m) for n, m in ALL if n in ("resnet18", "repvgg_a0")} | {
    ("resnet50", "orepa"), ("resnet50", "dbb"), ("resnext50_32x4d", "orepa"), ("wide_resnet18_2", "orepa"),
}
SMALL = dict(num_classes=5, small_input=True, width_mult=0.25)  # same depth and branches, quarter width


pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def meta_device():
    """Build on the meta device (shapes only, no memory, no init compute)."""
    with torch.device("meta"):
        yield


def _move_bn_stats(model, x):
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(x + 0.1 * torch.randn_like(x))
    model.eval()


@pytest.mark.parametrize("name,method", ALL, ids=[f"{n}-{m}" for n, m in ALL])
def test_builds_trains_and_reparameterizes(name, method):
    model = zoo.create_model(name, method, **SMALL)
    x = torch.randn(2, 3, 16, 16)
    model.train()
    y = model(x)
    assert y.shape == (2, 5) and torch.isfinite(y).all()
    y.square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing[:5]}"
    n_blocks = sum(isinstance(m, orepa.ReparamConv2d) for m in model.modules())
    assert (n_blocks == 0) == (method == "base")
    if (name, method) not in EXACT:
        return
    torch.optim.SGD(model.parameters(), lr=0.05).step()  # move every parameter (scales init at 0 too)
    _move_bn_stats(model, x)
    with torch.no_grad():
        y = model(x)
        deployed = orepa.reparameterize(model)
        assert not any(isinstance(m, (orepa.ReparamConv2d, orepa.AbsorbedNorm)) for m in deployed.modules())
        base = zoo.create_model(name, "base", **SMALL)
        base.load_state_dict(deployed.state_dict(), strict=True)
        assert [(n, type(m)) for n, m in base.named_modules()] == [(n, type(m)) for n, m in deployed.named_modules()]
        tol_close(base.eval()(x), y)
        tol_close(orepa.fuse_conv_bn(deployed)(x), y)  # = reparameterize(fuse_bn=True), kernels composed once


@pytest.mark.parametrize("name,method", [(n, m) for n, m in ALL if n in TORCHVISION])
def test_deployed_loads_strictly_into_torchvision(name, method):
    """Full size on the meta device: keys, shapes and module types of the deployed model are torchvision's."""
    with meta_device():
        model = zoo.create_model(name, method)
        deployed = orepa.reparameterize(model.eval(), inplace=True)
        tv = getattr(torchvision.models, name)()
    tv.load_state_dict(deployed.state_dict(), strict=True)  # meta -> meta: checks keys and shapes
    assert [(n, type(m).__name__) for n, m in tv.named_modules()] == [
        (n, type(m).__name__) for n, m in deployed.named_modules()]


def test_torchvision_checkpoint_loads_into_base_and_matches():
    tv = torchvision.models.resnet18(num_classes=7).eval()
    _move_bn_stats(tv, torch.randn(2, 3, 32, 32))
    base = zoo.create_model("resnet18", "base", num_classes=7).eval()
    base.load_state_dict(tv.state_dict(), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(base(x), tv(x), rtol=0, atol=0)
    # same names, types and shapes for the others (meta device: no weights needed)
    with meta_device():
        for name in TORCHVISION[1:]:
            tvm = getattr(torchvision.models, name)()
            zoo.create_model(name, "base").load_state_dict(tvm.state_dict(), strict=True)


def test_wide_resnet18_is_resnet18_with_wider_stages():
    for name, mult in (("wide_resnet18_1_5", 1.5), ("wide_resnet18_2", 2.0)):
        with meta_device():
            wide = zoo.create_model(name, "base")
            ref = zoo.create_model("resnet18", "base", width_mult=mult)
            deployed = orepa.reparameterize(zoo.create_model(name, "orepa").eval(), inplace=True) if mult == 2 else wide
        shapes = {k: v.shape for k, v in wide.state_dict().items()}
        assert shapes == {k: v.shape for k, v in ref.state_dict().items()}
        assert shapes == {k: v.shape for k, v in deployed.state_dict().items()}
        assert shapes["layer4.1.conv2.weight"][0] == int(512 * mult) and shapes["conv1.weight"][0] == int(64 * mult)


def test_repvgg_widths_depths_and_params():
    # RepVGG paper, Table 2: params (M) of the inference-time A0, A1, A2, B0, B1, i.e. BN folded into a conv
    # bias; the paper's figures are the counts truncated to two decimals (A2: 25,499,944 -> 25.49)
    expected = {"repvgg_a0": 8.30, "repvgg_a1": 12.78, "repvgg_a2": 25.49, "repvgg_b0": 14.33, "repvgg_b1": 51.82}
    for name, mparams in expected.items():
        with meta_device():  # (counts of shapes: the five networks built without initialising their weights)
            m = orepa.reparameterize(zoo.create_model(name, "base").eval(), fuse_bn=True, inplace=True)
        n = sum(p.numel() for p in m.parameters())
        assert n // 10_000 == round(mparams * 100), (name, n)
    m = zoo.create_model("repvgg_a0", "base", num_classes=3)
    assert isinstance(zoo.create_model("repvgg_a0", num_classes=3).stage1[0].conv, orepa.OREPAVGGBlock)  # default method
    assert isinstance(zoo.create_model("resnet18", num_classes=3).layer1[0].conv1, orepa.OREPAConv2d)
    assert [len(getattr(m, f"stage{i}")) for i in range(1, 5)] == [2, 4, 14, 1]
    assert m.stage0.conv.out_channels == 48 and m.stage4[0].conv.out_channels == 1280
    assert m(torch.randn(1, 3, 64, 64)).shape == (1, 3)


def test_small_input_and_in_chans():
    m = zoo.create_model("resnet18", "orepa", num_classes=10, in_chans=1, small_input=True, width_mult=0.5)
    assert isinstance(m.maxpool, nn.Identity) and isinstance(m.conv1, orepa.OREPAConv2d)
    assert m.conv1.kernel_size == (3, 3) and m.conv1.stride == (1, 1) and m.conv1.in_channels == 1
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    r = zoo.create_model("repvgg_a0", "orepa-vgg", num_classes=10, in_chans=1, small_input=True, width_mult=0.25)
    assert r.forward_features(torch.randn(2, 1, 28, 28)).shape[-1] == 4  # 28 / 8 (rounded up)
    # a deep stem asked for beside the small-input stem (a 3x3 block) was dropped without a word; a
    # preset's (the ablation rows name one) is not asked for: those rows run at any stem
    for method in ("orepa", "orepa-offline"):
        with pytest.raises(ValueError, match="deep_stem=True replaces a 7x7 stem conv .* small_input=True makes"):
            zoo.create_model("resnet18", method, small_input=True, deep_stem=True, width_mult=0.25)
    m = zoo.create_model("resnet18", "orepa", small_input=True, preset="deep-stem", width_mult=0.25)
    assert isinstance(m.conv1, orepa.OREPAConv2d) and m.conv1.kernel_size == (3, 3)


# --------------------------------------------------------------------------- components and ablations


def _branches(block):
    return set(block.branches)


def test_orepa_resnet_components_by_default():
    m = zoo.create_model("resnet50", "orepa", width_mult=0.25)
    assert isinstance(m.conv1, orepa.OREPADeepStem) and isinstance(m.bn1, nn.BatchNorm2d)
    assert _branches(m.layer1[0].conv2) == set(orepa.OREPA_BRANCHES)
    assert _branches(m.layer1[0].conv1) == {"1x1", "1x1_1x1"}  # Rep-1x1 in bottlenecks
    assert _branches(m.layer1[0].downsample[0]) == {"1x1", "1x1_1x1"}
    assert isinstance(m.layer1[0].bn2, nn.BatchNorm2d)  # the post-addition norm stays
    r18 = zoo.create_model("resnet18", "orepa", width_mult=0.25)
    assert isinstance(r18.conv1, orepa.OREPADeepStem)
    assert type(r18.layer2[0].downsample[0]) is nn.Conv2d  # Rep-1x1 is for bottlenecks only
    dbb = zoo.create_model("resnet18", "dbb", width_mult=0.25)
    assert type(dbb.conv1) is nn.Conv2d and isinstance(dbb.layer1[0].conv1, orepa.DBBConv2d)
    assert isinstance(dbb.layer1[0].bn1, orepa.AbsorbedNorm)


def test_component_presets_build_the_table_rows():
    rows = {
        "online-only": {"kxk", "1x1", "1x1_avg", "1x1_kxk"},
        "freq-prior": {"kxk", "1x1", "1x1_avg", "1x1_kxk", "1x1_prior"},
        "dw-sep": set(orepa.OREPA_BRANCHES),
        "deep-stem": set(orepa.OREPA_BRANCHES),
        "rep-1x1": set(orepa.OREPA_BRANCHES),
    }
    for preset, branches in rows.items():
        for method in ("orepa", "orepa-offline") if preset in ("online-only", "rep-1x1") else ("orepa",):
            m = zoo.create_model("resnet50", method, preset=preset, width_mult=0.25)
            block = m.layer2[0].conv2
            assert _branches(block) == branches, (preset, method)
            assert block.mode == ("online" if method == "orepa" else "offline")
            assert isinstance(m.conv1, orepa.OREPADeepStem) == (preset in ("deep-stem", "rep-1x1")), preset
            assert isinstance(m.layer2[0].conv1, orepa.OREPAConv2d) == (preset == "rep-1x1"), preset
            assert isinstance(m.layer2[0].downsample[0], orepa.OREPAConv2d) == (preset == "rep-1x1")
    # the online-only block is the linearized DBB: DBB's branches with scales instead of BNs
    dbb = zoo.create_model("resnet18", "dbb", width_mult=0.25).layer1[0].conv1
    lin = zoo.create_model("resnet18", "orepa", preset="online-only", width_mult=0.25).layer1[0].conv1
    assert _branches(dbb) == _branches(lin)
    assert not any(isinstance(s, nn.BatchNorm2d) for s in lin.modules())
    with pytest.raises(ValueError, match="bottleneck"):
        zoo.create_model("resnet18", "orepa", preset="rep-1x1")
    # explicit options override the preset
    m = zoo.create_model("resnet18", "orepa", preset="online-only", deep_stem=True, width_mult=0.25)
    assert isinstance(m.conv1, orepa.OREPADeepStem) and _branches(m.layer1[0].conv1) == rows["online-only"]


def test_the_offline_prototype_has_a_bn_after_every_conv():
    """Fig. "linearization"'s prototype: "a norm layer right after each computational layer" (as in
    DBB), so a two-step branch has a BN after its first conv as well as at its end;
    ``inner_norm=False`` keeps only the branch's last BN."""
    def steps(block, name):
        return [type(s).__name__ for s in block.branches[name]]

    kw = dict(width_mult=0.25, num_classes=4)
    r50 = zoo.create_model("resnet50", "orepa-offline", **kw)
    for name in ("1x1_avg", "1x1_prior", "1x1_kxk", "dw_pw"):
        assert steps(r50.layer1[0].conv2, name)[1] == "BatchNorm2d" == steps(r50.layer1[0].conv2, name)[-1], name
    assert steps(r50.layer1[0].conv1, "1x1_1x1") == ["ConvStep", "BatchNorm2d", "ConvStep", "BatchNorm2d"]
    assert steps(r50.layer1[0].conv2, "kxk") == ["ConvStep", "BatchNorm2d"]
    vgg = zoo.create_model("repvgg_a0", "orepa-vgg-offline", **kw)
    assert steps(vgg.stage1[0].conv, "dw_pw") == ["ConvStep", "BatchNorm2d", "ConvStep", "BatchNorm2d"]
    lean = zoo.create_model("resnet18", "orepa-offline", inner_norm=False, **kw)
    assert steps(lean.layer1[0].conv2, "1x1_kxk") == ["ConvStep", "ConvStep", "BatchNorm2d"]
    assert steps(zoo.create_model("repvgg_a0", "orepa-vgg-offline", inner_norm=False, **kw).stage1[0].conv,
                 "dw_pw") == ["ConvStep", "ConvStep", "BatchNorm2d"]
    with pytest.raises(ValueError, match="inner_norm"):
        zoo.create_model("resnet18", "orepa", inner_norm=True)
    with pytest.raises(ValueError, match="needs branch_norm"):
        orepa.OREPAConv2d(4, 4, 3, inner_norm=True)
    # trained a little (BN statistics away from their start), the prototype still deploys exactly
    torch.manual_seed(0)
    m = zoo.create_model("resnet18", "orepa-offline", **kw).double()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for _ in range(2):
        torch.nn.functional.cross_entropy(m(torch.randn(4, 3, 32, 32, dtype=torch.float64)),
                                          torch.tensor([0, 1, 2, 3])).backward()
        opt.step()
        opt.zero_grad()
    m.eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(orepa.reparameterize(m, fuse_bn=True)(x), m(x), rtol=1e-9, atol=1e-9)


def test_linearization_presets():
    def scales(m):
        return {s.mode for s in m.modules() if isinstance(s, orepa.Scale)}

    kw = dict(width_mult=0.25, num_classes=4)
    assert scales(zoo.create_model("resnet18", "orepa", preset="vector-scaling", **kw)) == {"vector"}
    assert scales(zoo.create_model("resnet18", "orepa", preset="scalar-scaling", **kw)) == {"scalar"}
    assert scales(zoo.create_model("resnet18", "orepa", preset="no-scaling", **kw)) == set()
    m = zoo.create_model("resnet18", "orepa", preset="no-post-bn", **kw)
    assert isinstance(m.bn1, nn.Identity) and isinstance(m.layer1[0].bn2, nn.Identity)
    assert isinstance(m.layer2[0].downsample[1], nn.BatchNorm2d)  # plain 1x1 conv keeps its BN
    x = torch.randn(2, 3, 32, 32)
    m.eval()
    with torch.no_grad():
        y = m(x)
        deployed = orepa.reparameterize(m)
        tol_close(deployed(x), y)
    with pytest.raises(RuntimeError):  # the one variant that is not vanilla-loadable
        torchvision.models.resnet18(num_classes=4).load_state_dict(deployed.state_dict(), strict=True)
    with pytest.raises(ValueError, match="components"):
        zoo.create_model("resnet18", "orepa-offline", preset="scalar-scaling")
    # table "norm": DBB-18 without its branch-wise norms (neither BN nor scale; the post-addition BN kept)
    nn_ = zoo.create_model("resnet18", "orepa", preset="no-branch-norm", **kw)
    dbb = zoo.create_model("resnet18", "dbb", **kw)
    assert _branches(nn_.layer1[0].conv1) == _branches(dbb.layer1[0].conv1) and scales(nn_) == set()
    assert not any(isinstance(s, nn.BatchNorm2d) for s in nn_.layer1[0].conv1.modules())
    assert type(nn_.conv1) is nn.Conv2d and isinstance(nn_.layer1[0].bn1, nn.BatchNorm2d)
    vgg = zoo.create_model("repvgg_a0", "repvgg-online", scaling="none", **kw)
    assert scales(vgg) == set() and not any(isinstance(s, nn.BatchNorm2d) for s in vgg.stage1[1].conv.modules())
    with pytest.raises(ValueError, match="post_bn"):
        zoo.create_model("resnet18", "orepa-offline", post_bn=False)


def test_repvgg_methods_structure():
    kw = dict(width_mult=0.25, num_classes=4)
    online = zoo.create_model("repvgg_a0", "repvgg-online", **kw)
    assert _branches(online.stage1[0].conv) == {"kxk", "1x1"} and online.stage1[0].conv.mode == "online"
    assert _branches(online.stage1[1].conv) == {"kxk", "1x1", "identity"}
    assert isinstance(online.stage1[1].bn, nn.BatchNorm2d)
    ovgg = zoo.create_model("repvgg_a0", "orepa-vgg", **kw)
    blk = ovgg.stage1[1].conv
    assert isinstance(blk, orepa.OREPAVGGBlock) and _branches(blk) == {"kxk", "1x1", "identity"}
    assert _branches(blk.branches["kxk"].orepa) == {"kxk", "1x1_kxk", "1x1_avg", "1x1_prior", "dw_pw"}
    off = zoo.create_model("repvgg_a0", "orepa-vgg-offline", **kw)
    blk = off.stage1[1].conv
    assert blk.mode == "offline" and _branches(blk) == set(orepa.OREPA_BRANCHES) | {"identity"}
    assert all(br.has_norm for br in blk.branches.values())
    assert _branches(off.stage1[0].conv) == set(orepa.OREPA_BRANCHES)
    rep = zoo.create_model("repvgg_a0", "repvgg", **kw)
    assert isinstance(rep.stage1[1].conv, orepa.RepVGGBlock) and isinstance(rep.stage1[1].bn, orepa.AbsorbedNorm)


def test_invalid_names_methods_options():
    with pytest.raises(ValueError, match="resnet18.*repvgg_a0"):
        zoo.create_model("resnet19")
    with pytest.raises(ValueError, match="orepa-offline"):
        zoo.create_model("resnet18", "repvgg")
    with pytest.raises(ValueError, match="repvgg-online"):
        zoo.create_model("repvgg_a0", "dbb")
    with pytest.raises(ValueError, match="accepted"):
        zoo.create_model("resnet18", "base", scaling="scalar")
    with pytest.raises(ValueError, match="online-only"):
        zoo.create_model("resnet18", "orepa", preset="nope")
    assert zoo.list_models("repvgg") == [n for n in zoo.list_models() if n.startswith("repvgg")]
    assert sum(len(zoo.list_methods(n)) for n in zoo.list_models()) == 8 * 4 + 5 * 5


@pytest.mark.parametrize(
    "name,method,kwargs,error,match",
    [
        # before: built, then an IndexError at forward (dw_expand=0) or silently the default (internal_channels=0)
        ("resnet18", "orepa", dict(dw_expand=0, deep_stem=False), ValueError, r"dw_expand must be an int >= 1, got 0"),
        ("repvgg_a0", "orepa-vgg", dict(dw_expand=0), ValueError, r"dw_expand must be an int >= 1, got 0"),
        ("resnet18", "orepa", dict(internal_channels=0), ValueError, r"internal_channels must be an int >= 1, got 0"),
        ("resnet18", "base", dict(in_chans=0), ValueError, r"in_chans must be an int >= 1, got 0"),
        ("resnet18", "orepa", dict(in_chans=0), ValueError, r"in_chans must be an int >= 1, got 0"),
        ("resnet18", "base", dict(in_chans="rgb"), TypeError, r"in_chans must be an int, got 'rgb'"),
        ("resnet18", "base", dict(in_chans=True), TypeError, r"in_chans must be an int, got True"),
        ("resnet18", "base", dict(num_classes=-1), ValueError, r"num_classes must be an int >= 0 .* got -1"),
        ("repvgg_a0", "base", dict(num_classes=2.0), TypeError, r"num_classes must be an int, got 2\.0"),
        # on/off switches: a truthy non-bool ("no") kept the branch
        ("resnet18", "orepa", dict(freq_prior="no"), TypeError, r"freq_prior must be True or False, got 'no'"),
        ("resnet18", "orepa", dict(dw_sep=0), TypeError, r"dw_sep must be True or False, got 0"),
        ("resnet18", "orepa", dict(deep_stem="false"), TypeError, r"deep_stem must be True or False"),
        ("resnet18", "orepa", dict(rep_1x1=1), TypeError, r"rep_1x1 must be True or False, got 1"),
        ("resnet18", "orepa", dict(post_bn=0), TypeError, r"post_bn must be True or False, got 0"),
        ("resnet18", "base", dict(small_input="yes"), TypeError, r"small_input must be True or False"),
        ("repvgg_a0", "orepa-vgg", dict(freq_prior=None), TypeError, r"freq_prior must be True or False, got None"),
        ("repvgg_a0", "base", dict(width_mult=-1), ValueError, r"width_mult must be a positive finite number, got -1"),
        ("resnet18", "base", dict(width_mult=0), ValueError, r"width_mult must be a positive finite number, got 0"),
        ("resnet18", "base", dict(width_mult=float("nan")), ValueError, r"width_mult must be a positive finite"),
        ("resnet18", "base", dict(width_mult="0.5"), TypeError, r"width_mult must be a number, got '0\.5'"),
        # branches and scale_init: duplicates collapsed, a scale_init nothing reads ignored
        ("resnet18", "orepa", dict(branches=["kxk", "1x1", "kxk"]), ValueError, r"duplicate branches \['kxk'\]"),
        ("resnet18", "orepa", dict(scale_init={"1x1_1x1": 0.5}), ValueError,
         r"scale_init names branch\(es\) \['1x1_1x1'\] that no block of resnet18 \(orepa\) has"),
        ("resnet18", "orepa", dict(dw_sep=False, scale_init={"dw_pw": 0.5}), ValueError, r"\['dw_pw'\].*scaled branches"),
        ("repvgg_a0", "orepa-vgg", dict(scale_init={"1x1": 2.0}), ValueError, r"\['1x1'\] that no block"),
        ("resnet18", "orepa", dict(preset="no-scaling", scale_init={"kxk": 0.5}), ValueError,
         r"scale_init=\{'kxk': 0\.5\} has no scale to start: scaling='none'"),
    ],
)
def test_bad_arguments_raise_at_construction(name, method, kwargs, error, match):
    kwargs = {"width_mult": 0.125, **kwargs}
    with pytest.raises(error, match=match):
        zoo.create_model(name, method, **kwargs)


def test_valid_edge_arguments_still_build():
    assert isinstance(zoo.create_model("resnet18", "orepa", num_classes=0, width_mult=0.125).fc, nn.Identity)
    # scale_init is model-wide: Rep-1x1 blocks (no 1x1_avg branch) and blocks without identity are still built
    m = zoo.create_model("resnet50", "orepa", width_mult=0.125, scale_init={"1x1_avg": 0.25})
    assert isinstance(m.layer1[0].conv1, orepa.OREPAConv2d) and set(m.layer1[0].conv1.branches) == {"1x1", "1x1_1x1"}
    assert m.layer1[0].conv2.branches["1x1_avg"].scale.weight[0].item() == 0.25
    r = zoo.create_model("repvgg_a0", "repvgg-online", width_mult=0.125, scale_init={"identity": 0.5})
    assert isinstance(r.stage1[0].conv, orepa.OREPAConv2d) and "identity" not in r.stage1[0].conv.branches


def test_flops_on_meta_equal_cpu():
    """The model cards count FLOPs on the meta device: same count as on CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    def flops(device_ctx):
        with device_ctx:
            m = zoo.create_model("resnet18", "orepa", width_mult=0.25).eval()
            x = torch.randn(1, 3, 32, 32)
            with FlopCounterMode(display=False) as fc, torch.no_grad():
                m(x)
        return fc.get_total_flops()

    assert flops(meta_device()) == flops(contextlib.nullcontext()) > 0


@pytest.mark.parametrize("method,opts", [("orepa", {}), ("orepa-offline", dict(deep_stem=True))])
def test_deep_stem_models_deploy_exactly(method, opts):
    """The 7x7 stem (not small_input) as a linear deep stem, online and offline."""
    model = zoo.create_model("resnet18", method, num_classes=5, width_mult=0.25, **opts)
    assert isinstance(model.conv1, orepa.OREPADeepStem)
    assert model.conv1.mode == ("online" if method == "orepa" else "offline")
    x = torch.randn(2, 3, 32, 32)
    _move_bn_stats(model, x)
    with torch.no_grad():
        y = model(x)
        base = zoo.create_model("resnet18", "base", num_classes=5, width_mult=0.25)
        base.load_state_dict(orepa.reparameterize(model).state_dict(), strict=True)
        tol_close(base.eval()(x), y)


def test_deep_stem_is_off_by_default_offline_and_for_dbb():
    """Only online OREPA builds the linear deep stem by default (docs/models.md): orepa-offline and dbb
    keep the plain 7x7 stem conv, and orepa-offline builds the deep stem only when asked."""
    for method in ("orepa-offline", "dbb"):
        m = zoo.create_model("resnet18", method, num_classes=5, width_mult=0.25)
        assert type(m.conv1) is nn.Conv2d and m.conv1.kernel_size == (7, 7), (method, type(m.conv1))
    m = zoo.create_model("resnet18", "orepa-offline", num_classes=5, width_mult=0.25, deep_stem=True)
    assert isinstance(m.conv1, orepa.OREPADeepStem) and m.conv1.mode == "offline"
    assert isinstance(zoo.create_model("resnet18", "orepa", num_classes=5, width_mult=0.25).conv1,
                      orepa.OREPADeepStem)


@pytest.mark.parametrize("name,method", [("repvgg_a0", "orepa-vgg"), ("resnet18", "orepa")])
@pytest.mark.parametrize("small_input,size", [(True, 32), (False, 64)])
def test_stage_outputs_match_their_feature_info_reductions(name, method, small_input, size):
    """Every feature_info stage's output is input / reduction: the small-input strides (stride 1 in
    the stem and the first stage) are where feature_info says they are."""
    model = zoo.create_model(name, method, num_classes=5, width_mult=0.25, small_input=small_input).eval()
    sizes = {}

    def record(key):
        def hook(mod, inp, out):
            sizes.setdefault(key, tuple(out.shape[1:]))  # (the first call: the stem's relu)
        return hook

    for info in model.feature_info:
        model.get_submodule(info["module"]).register_forward_hook(record(info["module"]))
    with torch.no_grad():
        model(torch.randn(1, 3, size, size))
    for info in model.feature_info:
        r = info["reduction"]
        assert sizes[info["module"]] == (info["num_chs"], size // r, size // r), info


def test_a_new_family_is_one_registration():
    """register_family is the whole of adding a family: create_model, list_models, list_methods and the
    deployment to the family's plain layout follow from it."""
    from orepa.models import zoo as registry

    if importlib.util.find_spec("timm"):
        import timm  # noqa: F401 - imported before the family is: the zoo's registration with timm has run

    class Tiny(nn.Sequential):
        def __init__(self, num_classes, in_chans, width=8):
            super().__init__(nn.Conv2d(in_chans, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

    family = registry.Family(
        name="tiny", configs={"tiny_test": None}, build=lambda name, num_classes, in_chans, width=8: Tiny(
            num_classes, in_chans, width), methods=("base", "orepa"), default_method="orepa",
        common_options=("width",), method_options={"orepa": ("init",)},
        apply_method=lambda model, method, opts, name: orepa.convert(model, method, inplace=True, **opts),
        first_conv="0", classifier="5")
    try:
        registry.register_family(family)
        assert "tiny_test" in registry.list_models("orepa") and registry.list_methods("tiny_test") == ["base", "orepa"]
        model = registry.create_model("tiny_test", num_classes=3, width=4, init="torch")
        assert isinstance(model[0], orepa.OREPAConv2d) and model.orepa_config["width"] == 4
        plain = registry.create_model("tiny_test", "base", num_classes=3, width=4)
        plain.load_state_dict(orepa.reparameterize(model.eval()).state_dict(), strict=True)
        with pytest.raises(ValueError, match="not accepted"):
            registry.create_model("tiny_test", "base", preset="dw-sep")
        if importlib.util.find_spec("timm"):  # a second register() adds the new family's timm names only
            import timm

            from orepa.models import timm_registry

            assert set(timm_registry.register()) - set(zoo.TIMM_REGISTERED) == {"base_tiny_test", "orepa_tiny_test"}
            assert isinstance(timm.create_model("orepa_tiny_test", num_classes=3, width=4)[0], orepa.OREPAConv2d)
        with pytest.raises(ValueError, match="already registered"):
            registry.register_family(registry.Family(**{**family.__dict__, "name": "tiny2"}))
    finally:
        registry._FAMILIES.pop("tiny", None)
        if importlib.util.find_spec("timm"):  # timm itself keeps the two names; orepa's list forgets them
            from orepa.models import timm_registry

            for name in ("base_tiny_test", "orepa_tiny_test"):
                timm_registry.TIMM_NAMES.pop(name, None)
    assert "tiny_test" not in registry.list_models()


@pytest.mark.parametrize("name", ["resnet18", "repvgg_a0"])
def test_reset_classifier_sets_the_head_and_the_num_classes_it_reports(name):
    """timm's reset_classifier: a new head of num_classes outputs (0: the pooled features) and
    .num_classes saying so."""
    m = zoo.create_model(name, "base", num_classes=10, width_mult=0.125).eval()
    x = torch.randn(2, 3, 32, 32)
    m.reset_classifier(5)
    assert m.num_classes == 5 and m(x).shape == (2, 5) and m.get_classifier().out_features == 5
    m.reset_classifier(0)
    assert m.num_classes == 0 and isinstance(m.get_classifier(), nn.Identity)
    assert m(x).shape == (2, m.num_features)
