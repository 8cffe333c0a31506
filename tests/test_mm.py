"""OREPA backbones inside mmdetection / mmsegmentation (the frameworks the paper's detection and
segmentation results were trained with): the registered ``OREPAResNet`` built from the packages'
own base configs, trained a few steps, deployed exactly.

Optional: skipped unless mmdet, mmseg and mmengine import (they are not orepa dependencies; the
command that installs them is in docs/detection.md). With ``mmcv-lite`` (mmcv without its
compiled ops) the ``mmcv.ops`` modules that ``mmdet.models`` / ``mmseg.models`` import are
stand-ins that raise when called: the paths run here (ResNet + FPN + RetinaNet head losses,
PSPNet) call none of them on a CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

for _pkg in ("mmengine", "mmdet", "mmseg"):
    pytest.importorskip(_pkg, reason=f"{_pkg} is not installed (optional; see docs/detection.md)")


class _MissingOps(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``mmcv.ops`` and its submodules for an mmcv without compiled ops: every name is a class
    whose construction or call raises, so that importing the model zoos works and using an op says
    so."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mmcv.ops" or fullname.startswith("mmcv.ops."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def missing(name):
            if name.startswith("__"):
                raise AttributeError(name)

            def refuse(*args, **kwargs):
                raise RuntimeError(f"{spec.name}.{name} needs mmcv's compiled ops (mmcv-lite has none)")

            return type(name, (), {"__new__": refuse})

        module.__getattr__ = missing
        return module

    def exec_module(self, module):
        pass


if importlib.util.find_spec("mmcv") is not None and importlib.util.find_spec("mmcv._ext") is None:
    sys.meta_path.insert(0, _MissingOps())

import mmdet  # noqa: E402
import mmseg  # noqa: E402
from conftest import child_env  # noqa: E402
from mmengine.config import Config  # noqa: E402
from mmengine.utils import import_modules_from_strings  # noqa: E402

import orepa  # noqa: E402
from orepa.models import create_model  # noqa: E402

WIDTH = 0.25  # ResNet-18 at a quarter width: stages of 16, 32, 64, 128 channels
CHANNELS = [16, 32, 64, 128]


def _base_config(package, rel: str) -> Config:
    return Config.fromfile(os.path.join(os.path.dirname(package.__file__), ".mim", "configs", "_base_", rel))


@pytest.fixture(scope="module")
def registries():
    # as a config's custom_imports = dict(imports=["orepa.apps.detection"]) does
    import_modules_from_strings(imports=["orepa.apps.detection"], allow_failed_imports=False)
    from mmdet.registry import MODELS as DET
    from mmdet.utils import register_all_modules as det_modules
    from mmseg.registry import MODELS as SEG
    from mmseg.utils import register_all_modules as seg_modules

    det_modules(init_default_scope=False)
    seg_modules(init_default_scope=False)
    return DET, SEG


@pytest.fixture(scope="module")
def imagenet_checkpoint(tmp_path_factory):
    """An 'ImageNet' OREPA ResNet-18 checkpoint: random weights, BN statistics calibrated on random
    images (so that a backbone whose norms stay in eval mode computes sensible features, and one
    that did not load them is told apart)."""
    torch.manual_seed(0)
    net = create_model("resnet18", "orepa", width_mult=WIDTH)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None  # cumulative average
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(4, 3, 128, 128))
    path = tmp_path_factory.mktemp("ckpt") / "orepa_r18.pth"
    torch.save(net.state_dict(), path)
    return path, net.state_dict()


def _retinanet_cfg(backbone: dict):
    """mmdetection's RetinaNet base config, small, over ``backbone`` (C2..C5 of CHANNELS)."""
    cfg = _base_config(mmdet, "models/retinanet_r50_fpn.py").model
    cfg.backbone = backbone
    cfg.neck.in_channels = CHANNELS
    cfg.neck.out_channels = cfg.bbox_head.in_channels = cfg.bbox_head.feat_channels = 32
    cfg.bbox_head.stacked_convs = 1
    cfg.bbox_head.num_classes = 3
    return dict(cfg, _scope_="mmdet")  # a config's default_scope


def _retinanet(det, **backbone):
    model = det.build(_retinanet_cfg(dict(type="OREPAResNet", name="resnet18", method="orepa",
                                          out_indices=(0, 1, 2, 3), width_mult=WIDTH, **backbone)))
    model.init_weights()
    return model


def _det_batch(model, n=2, size=128):
    from mmdet.structures import DetDataSample
    from mmengine.structures import InstanceData

    g = torch.Generator().manual_seed(1)
    images, samples = [], []
    for i in range(n):
        images.append(torch.randint(0, 255, (3, size, size), dtype=torch.uint8, generator=g))
        sample = DetDataSample(metainfo=dict(img_shape=(size, size), ori_shape=(size, size), scale_factor=(1.0, 1.0)))
        sample.gt_instances = InstanceData(bboxes=torch.tensor([[10.0, 20.0, 60.0 + 10 * i, 90.0]]),
                                           labels=torch.tensor([i % 3]))
        samples.append(sample)
    return model.data_preprocessor(dict(inputs=images, data_samples=samples), training=True)


def _total(losses) -> torch.Tensor:
    return sum(v if torch.is_tensor(v) else sum(v) for k, v in losses.items() if "loss" in k)


def _is_orepa_block(m) -> bool:
    return isinstance(m, (orepa.OREPAConv2d, orepa.OREPADeepStem))


def test_each_framework_gets_its_own_resnets_defaults(registries, imagenet_checkpoint):
    """Without freezing keywords, as mm's own ResNet: nothing frozen, a checkpoint or not; BN
    statistics kept by mmdetection's (norm_eval=True), trained by mmsegmentation's."""
    path, _ = imagenet_checkpoint
    for registry, norm_eval in zip(registries, (True, False)):
        for checkpoint in (None, str(path)):
            backbone = registry.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, weights=checkpoint))
            backbone.init_weights()
            backbone.train()
            assert all(p.requires_grad for p in backbone.parameters())
            norms = [m.training for m in backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)]
            assert norms and all(t is not norm_eval for t in norms), (registry.scope, checkpoint)


def test_retinanet_trains_with_mmdetection_keywords_and_deploys_exactly(registries, imagenet_checkpoint):
    """mmdetection's own ResNet keywords (frozen_stages=1, norm_eval=True, init_cfg Pretrained)
    mean what they mean there: layer1 frozen, BN statistics kept, the weights loaded; the linear
    deep stem still trains, as in the paper (``train_stem`` decides)."""
    path, saved = imagenet_checkpoint
    det, _ = registries
    model = _retinanet(det, frozen_stages=1, norm_eval=True,
                       init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    body = model.backbone.features
    assert sum(_is_orepa_block(m) for m in body.modules()) > 0
    for k, v in body.state_dict().items():  # loaded as saved; init_weights left it alone
        assert torch.equal(v, saved[k]), k
    frozen = {k for k, p in body.named_parameters() if not p.requires_grad}
    assert frozen == {k for k, _ in body.named_parameters() if k.startswith("layer1.")}
    assert all(p.requires_grad for k, p in body.named_parameters() if k.startswith(("layer2", "layer3", "layer4")))

    data = _det_batch(model)
    before = {k: v.clone() for k, v in body.state_dict().items()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    model.train()
    assert not any(m.training for m in body.modules() if isinstance(m, torch.nn.BatchNorm2d))  # norm_eval
    losses = []
    for _ in range(4):
        loss = _total(model.loss(data["inputs"], data["data_samples"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    after = body.state_dict()
    for k, v in after.items():
        if k.startswith("layer1.") or "running_" in k or "num_batches" in k:
            assert torch.equal(v, before[k]), f"{k} changed"
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    for branch in ("kxk.conv", "1x1_kxk.conv1", "dw_pw.pw", "1x1_prior.scale"):  # every kind of branch trains
        assert f"layer4.1.conv2.branches.{branch}.weight" in changed, branch
    assert "conv1.branches.stem.layer0.branches.kxk.conv.weight" in changed

    model.eval()
    x = data["inputs"].float()[:1]
    with torch.no_grad():
        reference = model.extract_feat(x)
        model = orepa.reparameterize(model)
        assert not any(_is_orepa_block(m) for m in model.modules())
        deployed = model.extract_feat(x)
    for a, b in zip(reference, deployed):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()


def test_the_deployed_detector_loads_into_mmdetections_own_resnet(registries, imagenet_checkpoint):
    """Deployment back to the vanilla architecture inside mmdetection: the deployed backbone is
    torchvision's ResNet layout, which is mmdetection's ``ResNet(style="pytorch")``; its keys lose
    the ``features.`` level and the detector no longer needs orepa."""
    path, _ = imagenet_checkpoint
    det, _ = registries
    model = _retinanet(det, norm_eval=True, weights=str(path)).eval()
    deployed = orepa.reparameterize(model).state_dict()
    vanilla = {k.replace("backbone.features.", "backbone.", 1): v for k, v in deployed.items()}

    native = det.build(_retinanet_cfg(dict(type="ResNet", depth=18, base_channels=int(64 * WIDTH),
                                           out_indices=(0, 1, 2, 3), norm_eval=True, style="pytorch"))).eval()
    native.load_state_dict(vanilla, strict=True)
    x = _det_batch(model)["inputs"].float()
    with torch.no_grad():
        for a, b in zip(model.extract_feat(x), native.extract_feat(x)):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()


def test_pspnet_with_a_dilated_backbone_and_mmsegmentation_pretrained(registries, imagenet_checkpoint):
    """mmsegmentation's PSPNet base config (output stride 8): ``EncoderDecoder(pretrained=...)``
    hands the checkpoint to the backbone, which loads it (and trains every layer and BN, as
    mmseg's ResNet); a step; deployment exact, and the deployed backbone is mmsegmentation's own
    dilated ResNet-18 (BasicBlocks dilate their first conv only)."""
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample

    path, saved = imagenet_checkpoint
    _, seg = registries
    cfg = _base_config(mmseg, "models/pspnet_r50-d8.py").model
    cfg.pretrained = str(path)
    cfg.backbone = dict(type="OREPAResNet", name="resnet18", method="orepa", out_indices=(0, 1, 2, 3),
                        width_mult=WIDTH, replace_stride_with_dilation=(False, True, True))
    for head, width in ((cfg.decode_head, CHANNELS[3]), (cfg.auxiliary_head, CHANNELS[2])):
        head.in_channels, head.channels, head.num_classes = width, 16, 4
        head.norm_cfg = dict(type="BN", requires_grad=True)  # SyncBN needs a process group
    cfg.data_preprocessor.size = (64, 64)  # a config's crop size
    model = seg.build(dict(cfg, _scope_="mmseg"))
    model.init_weights()
    body = model.backbone.features
    for k, v in body.state_dict().items():
        assert torch.equal(v, saved[k]), k
    model.train()
    assert all(p.requires_grad for p in body.parameters())
    assert all(m.training for m in body.modules() if isinstance(m, torch.nn.BatchNorm2d))

    g = torch.Generator().manual_seed(2)
    size = 64
    images = [torch.randint(0, 255, (3, size, size), dtype=torch.uint8, generator=g) for _ in range(2)]
    samples = []
    for _ in range(2):
        s = SegDataSample(metainfo=dict(img_shape=(size, size), ori_shape=(size, size), pad_shape=(size, size)))
        s.gt_sem_seg = PixelData(data=torch.randint(0, 4, (1, size, size), generator=g))
        samples.append(s)
    data = model.data_preprocessor(dict(inputs=images, data_samples=samples), training=True)
    features = model.extract_feat(data["inputs"])
    assert [tuple(f.shape[-2:]) for f in features] == [(16, 16), (8, 8), (8, 8), (8, 8)]  # output stride 8

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    for _ in range(2):
        loss = _total(model.loss(data["inputs"], data["data_samples"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)

    model.eval()
    with torch.no_grad():
        reference = model._forward(data["inputs"][:1])
        model = orepa.reparameterize(model)
        assert not any(_is_orepa_block(m) for m in model.modules())
        deployed = model._forward(data["inputs"][:1])
    assert torch.allclose(reference, deployed, rtol=1e-4, atol=1e-4), (reference - deployed).abs().max()

    native = seg.build(dict(type="ResNet", depth=18, base_channels=16, stem_channels=16, out_indices=(0, 1, 2, 3),
                            dilations=(1, 1, 2, 4), strides=(1, 2, 1, 1), contract_dilation=True,
                            _scope_="mmseg"))
    native.load_state_dict(model.backbone.features.state_dict(), strict=True)
    native.eval()  # (mm's ResNet.train returns None)
    with torch.no_grad():
        for a, b in zip(model.backbone(data["inputs"][:1]), native(data["inputs"][:1])):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("keywords, message", [
    (dict(init_cfg=dict(type="Kaiming", layer="Conv2d")), "init_cfg=.* is not supported"),
    (dict(init_cfg=dict(type="Pretrained", checkpoint="a.pth"), pretrained="b.pth"), "given twice"),
    (dict(weights="a.pth", pretrained="b.pth"), "given twice"),
    (dict(frozen_stages=1, trainable_layers=3), "frozen_stages= or trainable_layers="),
    (dict(frozen_stages=5), r"frozen_stages must be in \[-1, 4\]"),
    (dict(norm_eval=True, norm="frozen"), "or norm=, not both"),
    (dict(out_indices=(0, 4)), "out_indices must be stages 0..3"),
    (dict(depth=50), "depth=50 but name='resnet18'"),
    (dict(dilations=(1, 1, 2, 4), strides=(1, 2, 1, 1)), "replace_stride_with_dilation"),
    (dict(style="caffe"), "'caffe' is not built"),
    (dict(with_cp=True), "activation checkpointing is not supported"),
    (dict(contract_dilation=False, replace_stride_with_dilation=(False, True, True)), "dilation is contracted"),
    (dict(base_channels=64), "base_channels = 64 \\* width_mult = 16 here"),
    (dict(norm_cfg=dict(type="SyncBN", requires_grad=True)), "sync_bn='torch'"),
    (dict(norm_cfg=dict(type="GN", num_groups=8)), "norms are BatchNorm2d"),
    (dict(norm_cfg=dict(type="BN", requires_grad=False), norm_eval=False), "not a mode of this backbone"),
    (dict(groups=32, base_width=4), "a ResNeXt is chosen by name"),
    (dict(returned_layers=[2, 3]), "out_indices"),
])
def test_bad_keywords_are_named(registries, keywords, message):
    det, _ = registries
    with pytest.raises(ValueError, match=message):
        det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, **keywords))


def test_a_frozen_norm_cfg_under_mmsegmentations_default_is_refused(registries):
    """mmseg's ResNet with norm_cfg requires_grad=False and its default norm_eval=False keeps updating
    the statistics under a frozen affine: no mode of this backbone, so it is said (not frozen)."""
    _, seg = registries
    with pytest.raises(ValueError, match="not a mode of this backbone"):
        seg.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH,
                       norm_cfg=dict(type="BN", requires_grad=False)))
    frozen = seg.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, norm_eval=True,
                            norm_cfg=dict(type="BN", requires_grad=False)))
    assert frozen.features.norm == "frozen"


def test_stock_keywords_that_change_nothing_are_taken(registries):
    """What stock configs spell out (mm's defaults) builds the same backbone; a frozen norm_cfg is
    norm='frozen'."""
    det, _ = registries
    stock = det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, depth=18, num_stages=4,
                           style="pytorch", with_cp=False, dcn=None, stage_with_dcn=(False, False, False, False),
                           plugins=None, base_channels=16, norm_cfg=dict(type="BN", requires_grad=True),
                           contract_dilation=False, conv_cfg=None, multi_grid=None, stem_channels=None,
                           frozen_stages=-1, norm_eval=True))
    assert stock.features.norm == "eval" and not stock.features.frozen_stages
    frozen = det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH,
                            norm_cfg=dict(type="BN", requires_grad=False)))
    assert frozen.features.norm == "frozen"


def test_checkpoints_are_read_by_init_weights_with_mmdetections_prefixes(registries, imagenet_checkpoint, tmp_path):
    """As mm's ResNet: the checkpoint is read by init_weights(), so a model built to test (the
    detector's own checkpoint loaded after) does not need the ImageNet file; a missing or damaged
    file is named there. ``prefix`` takes a detector checkpoint's backbone, spelt ``backbone.`` as
    in mmdetection (an OREPAResNet detector's keys go on with ``features.``)."""
    path, saved = imagenet_checkpoint
    det, _ = registries
    missing = det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH,
                             init_cfg=dict(type="Pretrained", checkpoint=str(tmp_path / "imagenet.pth"))))
    with pytest.raises(Exception, match=r"checkpoint .*imagenet\.pth does not exist"):
        missing.init_weights()
    damaged = tmp_path / "damaged.pth"
    damaged.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(Exception, match=r"checkpoint .*damaged\.pth is corrupt, truncated"):
        det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, weights=str(damaged))).init_weights()

    detector = {"state_dict": {**{f"backbone.features.{k}": v for k, v in saved.items()},
                               "neck.conv.weight": torch.zeros(1)}, "meta": {"epoch": 12}}
    ckpt = tmp_path / "detector.pth"
    torch.save(detector, ckpt)
    wrapped = tmp_path / "wrapped.pth"  # (saved from a DDP-wrapped detector)
    torch.save({"state_dict": {f"module.{k}": v for k, v in detector["state_dict"].items()}}, wrapped)
    for source, prefix in ((ckpt, "backbone"), (ckpt, "backbone."), (ckpt, "backbone.features."),
                           (wrapped, "backbone.")):
        backbone = det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, frozen_stages=-1,
                                  init_cfg=dict(type="Pretrained", checkpoint=str(source), prefix=prefix)))
        backbone.init_weights()
        assert all(p.requires_grad for p in backbone.parameters())
        for k, v in backbone.features.state_dict().items():
            assert torch.equal(v, saved[k]), (prefix, k)
    with pytest.raises(ValueError, match="no key of the checkpoint starts with prefix 'head.'"):
        det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH,
                       init_cfg=dict(type="Pretrained", checkpoint=str(ckpt), prefix="head"))).init_weights()


def test_weights_keyword_loads_when_built(registries, imagenet_checkpoint):
    """``weights=`` (the backbone's own keyword) is loaded at construction, as resnet_features does:
    a model trained without the Runner (no init_weights call) has them."""
    path, saved = imagenet_checkpoint
    det, _ = registries
    backbone = det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, weights=str(path)))
    for k, v in backbone.features.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_ema_weights_through_init_cfg(registries, imagenet_checkpoint, tmp_path):
    path, saved = imagenet_checkpoint
    det, _ = registries
    average = {k: v + 1 if v.is_floating_point() else v for k, v in saved.items()}
    run, detector = tmp_path / "run.pth", tmp_path / "detector.pth"
    torch.save({"model": saved, "model_ema": average}, run)
    torch.save({"state_dict": {f"backbone.features.{k}": v for k, v in saved.items()},
                "state_dict_ema": {f"backbone.features.{k}": v for k, v in average.items()}}, detector)
    for checkpoint, prefix in ((run, None), (detector, "backbone.")):
        backbone = det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, ema=True,
                                  init_cfg=dict(type="Pretrained", checkpoint=str(checkpoint), prefix=prefix)))
        backbone.init_weights()
        for k, v in backbone.features.state_dict().items():
            assert torch.equal(v, average[k]), k
    with pytest.raises(ValueError, match="give the checkpoint too"):
        det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, ema=True))


class _RunsCode:
    """Unpickling it runs code (writes a file): what a checkpoint must never do when read."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_uri_is_read_with_weights_only_whatever_torchs_default(registries, imagenet_checkpoint, tmp_path,
                                                                monkeypatch):
    """A ``scheme://`` checkpoint goes through mmengine's loaders, which call ``torch.load(f,
    map_location)`` without ``weights_only``: torch < 2.6 (here its default forced back by
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``) would unpickle code. They read weights only, a fetched file
    with the messages of a path, a stream (ceph's loader) too; ``torch.load`` is torch's again after."""
    import io

    from mmengine.runner import CheckpointLoader

    path, saved = imagenet_checkpoint
    marker = tmp_path / "code-ran"
    hostile = tmp_path / "hostile.pth"
    torch.save({"state_dict": saved, "payload": _RunsCode(marker)}, hostile)
    damaged = tmp_path / "damaged.pth"
    damaged.write_bytes(path.read_bytes()[:1000])
    files = {"good": path, "hostile": hostile, "damaged": damaged}
    # as mmengine's own: torch.load of a fetched file (http, torchvision, open-mmlab), of a stream (ceph)
    CheckpointLoader.register_scheme("orepa-test-file://", lambda name, map_location=None: torch.load(
        files[name.split("://")[1]], map_location=map_location), force=True)
    CheckpointLoader.register_scheme("orepa-test-stream://", lambda name, map_location=None: torch.load(
        io.BytesIO(files[name.split("://")[1]].read_bytes()), map_location=map_location), force=True)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    det, _ = registries
    real_load = torch.load
    for scheme in ("orepa-test-file", "orepa-test-stream"):
        backbone = det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH,
                                  init_cfg=dict(type="Pretrained", checkpoint=f"{scheme}://good")))
        backbone.init_weights()
        for k, v in backbone.features.state_dict().items():
            assert torch.equal(v, saved[k]), (scheme, k)
        with pytest.raises(ValueError, match=r"checkpoint .*hostile.* holds Python objects \(io\.open\)"):
            det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH,
                           weights=f"{scheme}://hostile"))
        assert not marker.exists(), scheme
        assert torch.load is real_load
    with pytest.raises(ValueError, match=r"checkpoint .*damaged\.pth is corrupt, truncated"):
        det.build(dict(type="OREPAResNet", name="resnet18", width_mult=WIDTH, weights="orepa-test-file://damaged"))
    assert torch.load is real_load


def test_a_config_file_registers_without_importing_mmdetection_first(tmp_path):
    """``Config.fromfile`` (what a training script runs first) imports mmengine only: the
    ``custom_imports`` module registers there, under either of its names."""
    for module in ("orepa.apps.detection", "orepa.apps.mm_backbone"):
        config = tmp_path / "config.py"
        config.write_text(f"custom_imports = dict(imports=[{module!r}], allow_failed_imports=False)\n"
                          "model = dict(backbone=dict(type='OREPAResNet', name='resnet18'))\n")
        script = textwrap.dedent(f"""
            import sys
            from mmengine.config import Config
            Config.fromfile({str(config)!r})
            assert "mmdet" not in sys.modules or "mmdet.registry" in sys.modules
            from mmdet.registry import MODELS as DET
            from mmseg.registry import MODELS as SEG
            print("OREPAResNet" in DET.module_dict, "OREPAResNet" in SEG.module_dict)
        """)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(),
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["True", "True"], module


def test_a_broken_model_zoo_does_not_break_registration():
    """Registering looks at the registries only: ``MODELS.get`` would import all of mmseg.models,
    and an mmseg lacking one of its optional dependencies (e.g. ftfy) would then break every
    mmdetection config importing orepa."""
    script = textwrap.dedent("""
        import importlib.abc, sys
        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name in ("mmdet.models", "mmseg.models"):
                    raise ImportError(f"No module named 'ftfy' (importing {name})")
        sys.meta_path.insert(0, Broken())
        import mmdet, mmseg
        import orepa.apps.detection
        from mmdet.registry import MODELS as DET
        from mmseg.registry import MODELS as SEG
        print("OREPAResNet" in DET.module_dict, "OREPAResNet" in SEG.module_dict)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("module", ["orepa.apps.mm_backbone", "orepa.detection"])
def test_custom_imports_register_after_orepa_was_imported_first(tmp_path, module):
    """A script that imported orepa's detection module before reading the config: importing it again
    runs nothing, so the config names a module that registers whatever was imported before."""
    config = tmp_path / "config.py"
    config.write_text(f"custom_imports = dict(imports=[{module!r}], allow_failed_imports=False)\n")
    script = textwrap.dedent(f"""
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)
        import orepa.apps.detection
        from mmengine.config import Config
        Config.fromfile({str(config)!r})
        from mmdet.registry import MODELS as DET
        from mmseg.registry import MODELS as SEG
        print("OREPAResNet" in DET.module_dict, "OREPAResNet" in SEG.module_dict)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]


@pytest.mark.slow  # a Runner, a dataset on disk: ~8 s
def test_a_runner_trains_from_a_config_file_and_its_checkpoint_deploys(imagenet_checkpoint, tmp_path):
    """The user's path: a config file (``_base_`` inheritance, ``custom_imports``, ``_delete_``)
    run by mmengine's Runner on a COCO-format dataset (four generated images): ``init_weights``
    loads the ImageNet checkpoint (layer1, frozen by ``frozen_stages=1``, still holds it after
    training), the loss stays finite, ``paramwise_cfg`` takes the backbone's parameters, the
    CheckpointHook's file loads strictly into a model built from the same config and deploys
    exactly."""
    import json

    import cv2
    import numpy as np
    from mmengine.runner import Runner

    path, saved = imagenet_checkpoint
    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    images, annotations = [], []
    for i in range(4):
        image = (rng.random((128, 128, 3)) * 60).astype(np.uint8)
        x0 = 10 + 10 * i
        image[20:70, x0:x0 + 40] = (200, 50 * i, 30)
        cv2.imwrite(str(tmp_path / "images" / f"{i}.png"), image)
        images.append(dict(id=i, file_name=f"{i}.png", width=128, height=128))
        annotations.append(dict(id=i, image_id=i, category_id=i % 3, bbox=[x0, 20, 40, 50], area=2000, iscrowd=0))
    (tmp_path / "ann.json").write_text(json.dumps(dict(
        images=images, annotations=annotations, categories=[dict(id=k, name=f"c{k}") for k in range(3)])))
    base = os.path.join(os.path.dirname(mmdet.__file__), ".mim", "configs", "_base_", "models", "retinanet_r50_fpn.py")
    (tmp_path / "config.py").write_text(textwrap.dedent(f"""
        _base_ = [{base!r}]
        custom_imports = dict(imports=["orepa.apps.mm_backbone"], allow_failed_imports=False)
        default_scope = "mmdet"
        model = dict(
            backbone=dict(_delete_=True, type="OREPAResNet", name="resnet18", method="orepa", width_mult={WIDTH},
                          out_indices=(0, 1, 2, 3), frozen_stages=1, norm_eval=True,
                          init_cfg=dict(type="Pretrained", checkpoint={str(path)!r})),
            neck=dict(in_channels={CHANNELS}, out_channels=32),
            bbox_head=dict(num_classes=3, in_channels=32, feat_channels=32, stacked_convs=1))
        train_dataloader = dict(
            batch_size=2, num_workers=0, sampler=dict(type="DefaultSampler", shuffle=True),
            dataset=dict(type="CocoDataset", data_root={str(tmp_path)!r}, ann_file="ann.json",
                         metainfo=dict(classes=("c0", "c1", "c2")), data_prefix=dict(img="images/"),
                         pipeline=[dict(type="LoadImageFromFile"), dict(type="LoadAnnotations", with_bbox=True),
                                   dict(type="Resize", scale=(128, 128), keep_ratio=True),
                                   dict(type="PackDetInputs")]))
        train_cfg = dict(type="IterBasedTrainLoop", max_iters=4, val_interval=1000)
        optim_wrapper = dict(type="OptimWrapper",
                             optimizer=dict(type="SGD", lr=0.01, momentum=0.9, weight_decay=1e-4),
                             paramwise_cfg=dict(norm_decay_mult=0.0, flat_decay_mult=0.0))
        default_hooks = dict(checkpoint=dict(type="CheckpointHook", interval=2, by_epoch=False),
                             logger=dict(type="LoggerHook", interval=1))
        log_processor = dict(by_epoch=False)
        log_level = "ERROR"
        randomness = dict(seed=0)
        work_dir = {str(tmp_path / "work")!r}
    """))
    runner = Runner.from_cfg(Config.fromfile(str(tmp_path / "config.py")))
    runner.train()
    assert torch.isfinite(torch.tensor(runner.message_hub.get_scalar("train/loss").current()))
    trained = runner.model.state_dict()
    layer1 = [k for k in saved if k.startswith("layer1.")]
    assert layer1 and all(torch.equal(trained[f"backbone.features.{k}"], saved[k]) for k in layer1)
    assert not torch.equal(trained["backbone.features.layer4.1.conv2.branches.kxk.conv.weight"],
                           saved["layer4.1.conv2.branches.kxk.conv.weight"])

    from mmdet.registry import MODELS

    model = MODELS.build(Config.fromfile(str(tmp_path / "config.py")).model)
    # (a file this test wrote: mmengine's checkpoints hold its own objects, which weights_only refuses)
    checkpoint = torch.load(tmp_path / "work" / "iter_4.pth", map_location="cpu", weights_only=False)
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    model.eval()
    x = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        reference = model.extract_feat(x)
        deployed = orepa.reparameterize(model).extract_feat(x)
    for a, b in zip(reference, deployed):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()
