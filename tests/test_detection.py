"""Detection / segmentation with re-param backbones (orepa.apps.detection).

Small generated images (coloured rectangles with boxes and masks), ResNet-18 at
width x0.25, a few SGD steps per model; then ``orepa.reparameterize`` of the
whole detector / segmenter must give the same eval outputs.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import benchmark_script, tol_close
from torch import nn
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.ops import box_iou

import orepa
from orepa.apps import detection as D
from orepa.blocks import ReparamConv2d, Scale
from orepa.models import create_model

TINY = dict(width_mult=0.25)  # ResNet-18 with 16..128 channels: fast on CPU
SIZE = 128


# these tests freeze stages and norms of backbones built without weights (the warning is tested once)
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:resnet_features.*weights=None:UserWarning")]


def shapes_data(n=4, size=SIZE, seed=0):
    """Images with two coloured rectangles each (class 1 red, class 2 blue), boxes and masks."""
    g = torch.Generator().manual_seed(seed)
    colors = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.2, 0.9]])
    imgs, targets, masks = [], [], []
    for _ in range(n):
        img = 0.5 + 0.05 * torch.randn(3, size, size, generator=g)
        mask = torch.zeros(size, size, dtype=torch.long)
        boxes, labels = [], []
        for _ in range(2):
            c = int(torch.randint(0, 2, (1,), generator=g))
            w, h = torch.randint(size // 5, size // 2, (2,), generator=g).tolist()
            x0 = int(torch.randint(0, size - w, (1,), generator=g))
            y0 = int(torch.randint(0, size - h, (1,), generator=g))
            img[:, y0:y0 + h, x0:x0 + w] = colors[c].view(3, 1, 1)
            mask[y0:y0 + h, x0:x0 + w] = c + 1
            boxes.append([x0, y0, x0 + w, y0 + h])
            labels.append(c + 1)
        imgs.append(img.clamp(0, 1))
        masks.append(mask)
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor(labels)})
    return imgs, targets, masks


def train(model, step_loss, iters, lr):
    opt = torch.optim.SGD(D.param_groups(model, lr, 1e-4), lr=lr, momentum=0.9)
    model.train()
    losses = []
    for it in range(iters):
        batch = [(2 * it) % 4, (2 * it + 1) % 4]
        loss = step_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first, f"loss did not decrease: {[round(v, 3) for v in losses]}"
    return losses


def assert_same_detections(a, b, k=10, iou=0.99, score_tol=1e-4):
    """Every one of ``a``'s top-k detections is in ``b`` (same label, IoU > iou, same score).

    Post-processing may reorder near-tied detections, so matches are searched, not indexed.
    """
    assert len(a["scores"]) > 0
    for i in a["scores"].argsort(descending=True)[:k]:
        ious = box_iou(a["boxes"][i:i + 1], b["boxes"])[0] if len(b["boxes"]) else torch.zeros(0)
        ok = (b["labels"] == a["labels"][i]) & (ious > iou) & ((b["scores"] - a["scores"][i]).abs() < score_tol)
        assert ok.any(), f"detection {a['boxes'][i].tolist()} / {a['scores'][i]:.4f} lost after reparameterize"


def plain_convs_only(model):
    assert not any(isinstance(m, (ReparamConv2d, orepa.AbsorbedNorm)) for m in model.modules())


def detector_loss(model, batch, imgs, targets):
    return sum(model([imgs[i] for i in batch], [targets[i] for i in batch]).values())


# --------------------------------------------------------------------------- features


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
@pytest.mark.parametrize("method", D.METHODS)
def test_features_report_channels_and_strides(name, method):
    f = D.resnet_features(name, method, **TINY)
    out = f(torch.randn(1, 3, 64, 64))
    assert list(out) == ["c2", "c3", "c4", "c5"]
    assert f.strides == D.STRIDES
    for k, v in out.items():
        assert v.shape[1] == f.channels[k] and v.shape[-1] == 64 // f.strides[k]
    expansion = 4 if name == "resnet50" else 1
    assert list(f.channels.values()) == [16 * expansion, 32 * expansion, 64 * expansion, 128 * expansion]
    assert isinstance(f.conv1, orepa.OREPADeepStem) == (method == "orepa")


@pytest.mark.parametrize("name,method", [("resnet18", "orepa"), ("resnet50", "dbb")])
def test_dilated_features_and_deploy(name, method):
    f = D.resnet_features(name, method, replace_stride_with_dilation=(False, True, True), **TINY)
    assert f.strides == {"c2": 4, "c3": 8, "c4": 8, "c5": 8}
    x = torch.randn(1, 3, 64, 64)
    f.eval()
    with torch.no_grad():
        out = f(x)
        assert out["c5"].shape[-1] == 8
        deployed = orepa.reparameterize(f)
        plain_convs_only(deployed)
        for k, v in deployed(x).items():
            tol_close(v, out[k])


@pytest.mark.parametrize("padding_mode", ["reflect", "circular"])
def test_new_geometry_of_a_conv_padded_by_another_mode_is_that_of_a_conv_built_so(padding_mode):
    """An nn.Conv2d of another padding mode pads by a tuple it computes once, when built: dilated,
    it kept padding by the old one (10x10 out of 12x12), while an OREPA block of that mode, dilated
    alike, padded as its deployed conv does: the plain trunk and the converted one disagreed."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, (3, 5), padding=(1, 2), padding_mode=padding_mode).double()
    fresh = nn.Conv2d(3, 4, (3, 5), padding=(2, 4), dilation=2, padding_mode=padding_mode).double()
    fresh.load_state_dict(conv.state_dict())
    block = orepa.convert(nn.Sequential(conv, nn.BatchNorm2d(4)).double(), "orepa")[0].eval()
    D._set_geometry(conv, dilation=2)
    D._set_geometry(block, dilation=2)
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    with torch.no_grad():
        tol_close(conv(x), fresh(x), rel=1e-12)
        tol_close(orepa.reparameterize(block)(x), block(x), rel=1e-12)
        assert block(x).shape == conv(x).shape == (2, 4, 12, 12)


def test_new_geometry_keeps_each_conv_padded_as_it_pads():
    """Dilating or un-striding a conv keeps its "same" padding per axis (a 1x3 pads its width
    only); one that pads by TensorFlow's rule (a tf_same block, timm's Conv2dSame) keeps padding 0
    and pads for its new geometry by itself, deployed too."""
    torch.manual_seed(0)
    wide = nn.Conv2d(4, 4, (1, 3), 2, padding=(0, 1))
    D._set_geometry(wide, stride=1, dilation=2)
    assert wide.padding == (0, 2) and wide.stride == (1, 1)
    block = orepa.OREPAConv2d(4, 4, 3, 2, tf_same=True).double()
    D._set_geometry(block, stride=1, dilation=2)
    assert block.padding == (0, 0)
    x = torch.randn(2, 4, 9, 10, dtype=torch.float64)
    block.eval()
    with torch.no_grad():
        y = block(x)
        assert y.shape[-2:] == x.shape[-2:]
        deployed = orepa.reparameterize(block)
        assert isinstance(deployed, orepa.Conv2dTFSame) and deployed.dilation == (2, 2)
        tol_close(deployed(x), y, rel=1e-12)


# --------------------------------------------------------------------------- train, then deploy


def test_fasterrcnn_trains_and_deploys():
    torch.manual_seed(0)
    imgs, targets, _ = shapes_data()
    model = D.fasterrcnn(
        "resnet18", "orepa", num_classes=None, min_size=SIZE, max_size=SIZE, fpn_channels=32,
        backbone_options=TINY, box_head=TwoMLPHead(32 * 7 * 7, 128), box_predictor=FastRCNNPredictor(128, 3),
        rpn_pre_nms_top_n_train=300, rpn_post_nms_top_n_train=100, rpn_pre_nms_top_n_test=300,
        rpn_post_nms_top_n_test=100, box_batch_size_per_image=64, box_score_thresh=0.0)
    assert isinstance(model.backbone.body.conv1, orepa.OREPADeepStem)
    train(model, lambda m, b: detector_loss(m, b, imgs, targets), iters=10, lr=0.02)
    model.eval()
    with torch.no_grad():
        out = model(imgs[:1])[0]
        deployed = orepa.reparameterize(model)
        plain_convs_only(deployed)
        assert_same_detections(out, deployed(imgs[:1])[0])
        # the raw multi-scale features agree to float tolerance
        x = model.transform(imgs[:1])[0].tensors
        ref, dep = model.backbone(x), deployed.backbone(x)
        for k in ref:
            tol_close(dep[k], ref[k])
        # deployed backbone = the zoo's base ResNet layout, key for key
        base = D.resnet_features("resnet18", "base", **TINY)
        base.load_state_dict(deployed.backbone.body.state_dict(), strict=True)
        # BNs folded as well (fx cannot trace a detector: pairs by registration order)
        fused = orepa.reparameterize(model, fuse_bn=True)
        assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.backbone.modules())
        assert_same_detections(out, fused(imgs[:1])[0])


@pytest.mark.parametrize("builder", [D.fasterrcnn, D.retinanet])
def test_detector_builders_take_torchvisions_backbone_names_and_refuse_unknown_keywords(builder):
    """The detectors' ``**kwargs`` end in torchvision's ``GeneralizedRCNNTransform``, which ignores
    what it does not know: torchvision's ``trainable_backbone_layers=0`` left every stage training,
    ``weights_backbone`` loaded nothing, ``fpn_norm_layer`` and a misspelt keyword were dropped,
    silently. Now torchvision's names mean ours and anything else is refused by name."""
    plain = D.resnet_features("resnet18", "base", **TINY)
    kw = dict(num_classes=3, backbone_options=TINY, fpn_channels=16)
    frozen = builder("resnet18", "base", trainable_backbone_layers=0, **kw)
    assert not any(p.requires_grad for p in frozen.backbone.body.parameters())
    loaded = builder("resnet18", "base", weights_backbone=plain.state_dict(), **kw)
    assert torch.equal(loaded.backbone.body.conv1.weight, plain.conv1.weight)
    normed = builder("resnet18", "base", fpn_norm_layer=nn.BatchNorm2d, **kw)
    assert any(isinstance(m, nn.BatchNorm2d) for m in normed.backbone.fpn.modules())
    with pytest.raises(TypeError, match=r"got unexpected keyword\(s\) deep_stem, tranable_layers: backbone keywords "
                                        r"are .*trainable_layers.*backbone_options"):
        builder("resnet18", "orepa", tranable_layers=0, deep_stem=False, **kw)
    with pytest.raises(TypeError, match="both weights= and torchvision's name for it, weights_backbone="):
        builder("resnet18", "base", weights=plain.state_dict(), weights_backbone=plain.state_dict(), **kw)


@pytest.mark.parametrize("builder,levels", [(D.fasterrcnn, (2, 3, 4)), (D.retinanet, (1, 2, 3, 4))])
def test_returned_layers_that_torchvisions_default_anchors_do_not_cover_are_said_when_built(builder, levels):
    """torchvision's default anchor generators cover five feature maps (Faster R-CNN: C2..C5 + pool;
    RetinaNet: C3..C5 + P6, P7); other returned_layers built a detector whose first forward ended in
    torchvision's assertion on the anchors. The builder says it, and takes an anchor generator with
    one entry per map (Faster R-CNN's ``rpn_anchor_generator``)."""
    import re

    from torchvision.models.detection.anchor_utils import AnchorGenerator

    kw = dict(num_classes=3, backbone_options=TINY, fpn_channels=16, min_size=64, max_size=64)
    maps = len(levels) + 1 + (builder is D.retinanet)  # (+ pool; RetinaNet: + P6, P7)
    keyword = "rpn_anchor_generator" if builder is D.fasterrcnn else "anchor_generator"
    with pytest.raises(ValueError, match=re.escape(f"{builder.__name__}(returned_layers={levels}) gives {maps} feature "
                                                   "maps") + f".*covers 5: give {keyword}="):
        builder("resnet18", "base", returned_layers=levels, **kw)
    anchors = AnchorGenerator(tuple((32 * 2 ** i,) for i in range(maps)), ((0.5, 1.0, 2.0),) * maps)
    model = builder("resnet18", "base", returned_layers=levels, **{keyword: anchors}, **kw).eval()
    with torch.no_grad():
        model([torch.rand(3, 64, 64)])


def test_mask_rcnn_on_an_orepa_fpn_backbone_trains_and_deploys_exactly():
    """torchvision's Mask R-CNN over ``fpn_backbone(..., "orepa")`` (docs/detection.md): a few steps,
    then boxes, scores, labels and masks unchanged by ``reparameterize`` (float64), the deployed
    detector in the vanilla layout (loads strictly into the same detector over a base backbone)."""
    from torchvision.models.detection import MaskRCNN

    torch.manual_seed(0)
    imgs, targets, _ = shapes_data()
    for t in targets:  # an instance mask per box
        t["masks"] = torch.zeros(len(t["boxes"]), SIZE, SIZE, dtype=torch.uint8)
        for mask, (x0, y0, x1, y1) in zip(t["masks"], t["boxes"].int().tolist()):
            mask[y0:y1, x0:x1] = 1
    # (64 sampled proposals an image in training, not 512, and 10 detections, not 20: the box and mask heads'
    # 256-channel layers on each were most of the test's time; what is compared is the same)
    heads = dict(num_classes=3, min_size=SIZE, max_size=SIZE, box_score_thresh=0.0, rpn_pre_nms_top_n_test=100,
                 rpn_post_nms_top_n_test=50, box_detections_per_img=10, box_batch_size_per_image=64)
    model = MaskRCNN(D.fpn_backbone("resnet18", "orepa", out_channels=32, **TINY), **heads)
    opt = torch.optim.SGD(D.param_groups(model, 0.002, 1e-4, stem_lr_mult=0.1), lr=0.002, momentum=0.9)
    for it in range(2):
        loss = detector_loss(model.train(), [2 * it, 2 * it + 1], imgs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().double()
    x = [imgs[0].double()]
    with torch.no_grad():
        ref = model(x)[0]
        deployed = orepa.reparameterize(model)
        out = deployed(x)[0]
    plain_convs_only(deployed)
    assert len(ref["scores"]) > 0 and torch.equal(ref["labels"], out["labels"])
    for k in ("boxes", "scores", "masks"):
        torch.testing.assert_close(out[k], ref[k], rtol=1e-9, atol=1e-9, msg=k)
    vanilla = MaskRCNN(D.fpn_backbone("resnet18", "base", out_channels=32, **TINY), **heads)
    vanilla.load_state_dict(deployed.state_dict(), strict=True)


def test_retinanet_trains_and_deploys():
    torch.manual_seed(0)
    imgs, targets, _ = shapes_data()
    model = D.retinanet("resnet18", "orepa", num_classes=3, min_size=SIZE, max_size=SIZE, fpn_channels=32,
                        backbone_options=TINY, score_thresh=0.0, topk_candidates=100)
    assert list(model.backbone.body.channels.values()) == [32, 64, 128]
    train(model, lambda m, b: detector_loss(m, b, imgs, targets), iters=10, lr=0.05)
    model.eval()
    with torch.no_grad():
        deployed = orepa.reparameterize(model)
        plain_convs_only(deployed)
        x = model.transform(imgs[:1])[0].tensors
        feats, dfeats = model.backbone(x), deployed.backbone(x)
        for k in feats:
            tol_close(dfeats[k], feats[k])
        head, dhead = model.head(list(feats.values())), deployed.head(list(dfeats.values()))
        for k in head:
            tol_close(dhead[k], head[k])
        assert_same_detections(model(imgs[:1])[0], deployed(imgs[:1])[0])


def seg_loss(model, batch, imgs, masks):
    out = model(torch.stack([imgs[i] for i in batch]))
    y = torch.stack([masks[i] for i in batch])
    return F.cross_entropy(out["out"], y) + 0.5 * F.cross_entropy(out["aux"], y)


@pytest.mark.slow
def test_deeplabv3_trains_and_deploys():
    torch.manual_seed(0)
    imgs, _, masks = shapes_data()
    model = D.deeplabv3("resnet18", "orepa", num_classes=3, aux_loss=True, atrous_rates=(2, 4, 6),
                        backbone_options=TINY)
    assert model.backbone.strides == {"aux": 8, "out": 8}
    train(model, lambda m, b: seg_loss(m, b, imgs, masks), iters=10, lr=0.02)
    model.eval()
    x = torch.stack(imgs[:2])
    with torch.no_grad():
        ref = model(x)
        deployed = orepa.reparameterize(model)
        plain_convs_only(deployed)
        for k, v in deployed(x).items():
            tol_close(v, ref[k])
        tol_close(orepa.reparameterize(model, fuse_bn=True)(x)["out"], ref["out"])


@pytest.mark.slow
@pytest.mark.parametrize("builder,method", [(D.fcn, "dbb"), (D.pspnet, "orepa-offline"),
                                            (D.deeplabv3plus, "orepa"), (D.deeplabv3plus, "dbb")])
def test_other_segmenters_step_and_deploy(builder, method):
    torch.manual_seed(0)
    imgs, _, masks = shapes_data()
    model = builder("resnet18", method, num_classes=3, aux_loss=True, output_stride=16, backbone_options=TINY)
    opt = torch.optim.SGD(D.param_groups(model, 0.01), lr=0.01, momentum=0.9)
    loss = seg_loss(model.train(), [0, 1], imgs, masks)
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.eval()
    x = torch.stack(imgs[:2])
    with torch.no_grad():
        ref = model(x)
        assert ref["out"].shape == (2, 3, SIZE, SIZE)
        deployed = orepa.reparameterize(model)
        plain_convs_only(deployed)
        for k, v in deployed(x).items():
            tol_close(v, ref[k])


# --------------------------------------------------------------------------- norm policy, freezing, groups


def _bns(module):
    return [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["eval", "frozen"])
def test_norm_policy_keeps_statistics_and_deploys_exactly(norm):
    torch.manual_seed(0)
    imgs, targets, _ = shapes_data()
    model = D.fasterrcnn("resnet18", "dbb", num_classes=3, min_size=SIZE, max_size=SIZE, fpn_channels=32,
                         backbone_options=TINY, norm=norm, trainable_layers=5, box_score_thresh=0.0)
    body = model.backbone.body
    for bn in _bns(body):  # random statistics, so that an update would show
        bn.running_mean.uniform_(-0.1, 0.1)
        bn.running_var.uniform_(0.5, 2.0)
    stats = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in _bns(body)]
    branch_bns = [m for blk in body.modules() if isinstance(blk, ReparamConv2d) for m in _bns(blk)]
    assert branch_bns  # DBB keeps a BN in every branch: the policy covers them too
    model.train()
    assert model.training and not any(bn.training for bn in _bns(body))
    # "frozen" freezes the network's own norms; the branch BNs are the blocks' parameterisation
    assert all(p.requires_grad == (norm == "eval" or bn in branch_bns) for bn in _bns(body) for p in bn.parameters())
    opt = torch.optim.SGD(D.param_groups(model, 0.01), lr=0.01)
    for it in range(2):
        loss = detector_loss(model, [2 * it, 2 * it + 1], imgs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for bn, (mean, var) in zip(_bns(body), stats):
        assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)
    model.eval()
    with torch.no_grad():
        x = model.transform(imgs[:1])[0].tensors
        ref = model.backbone(x)
        deployed = orepa.reparameterize(model)
        for k, v in deployed.backbone(x).items():
            tol_close(v, ref[k])


@pytest.mark.parametrize("method", ["dbb", "orepa-offline"])
def test_branches_started_from_plain_weights_learn_with_frozen_norms(method):
    """A backbone started from a plain network's weights (its other branches at zero through their
    BNs' affine) with the default norm="frozen": every branch learns, as the blocks promise; were the
    branch BNs frozen with the network's norms, all but the main branch would stay zero for ever."""
    torch.manual_seed(0)
    plain = D.resnet_features("resnet18", "base", **TINY).state_dict()
    f = D.resnet_features("resnet18", method, weights=plain, **TINY).double().train()
    assert f.norm == "frozen" and f.layer4[0].bn1.frozen  # the network's own norm, absorbed by the block
    blk = f.layer4[0].conv1
    before = {k: v.clone() for k, v in blk.state_dict().items()}
    opt = torch.optim.SGD([p for p in f.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    for _ in range(3):
        loss = sum(v.pow(2).mean() for v in f(x).values())
        opt.zero_grad()
        loss.backward()
        opt.step()
    moved = {k.split(".")[1] for k, v in blk.state_dict().items()
             if k.startswith("branches.") and v.is_floating_point() and not torch.equal(v, before[k])}
    assert moved == set(blk.branches)
    deployed = orepa.reparameterize(f)  # the absorbed BNs deploy frozen
    assert not any(p.requires_grad for m in deployed.modules() if isinstance(m, nn.BatchNorm2d)
                   for p in m.parameters())


@pytest.mark.parametrize("method", ["dbb", "orepa-offline"])
@pytest.mark.parametrize("freeze", ["stages", "norms"])
def test_a_frozen_stage_or_norm_deploys_frozen_where_the_block_absorbed_its_bn(method, freeze):
    """Blocks holding their own BNs are frozen after the network is built (trainable_layers, norm=
    "frozen"): the BN deployment restores came back trainable (32 of 40 with norm="frozen"), so
    training the deployed model went on moving them."""
    options = {"trainable_layers": 3} if freeze == "stages" else {"norm": "frozen"}
    f = D.resnet_features("resnet18", method, **options, **TINY)
    deployed = orepa.reparameterize(f)
    bns = {n: p.requires_grad for n, p in deployed.named_parameters()
           if isinstance(deployed.get_submodule(n.rsplit(".", 1)[0]), nn.BatchNorm2d)}
    assert bns
    if freeze == "norms":
        assert not any(bns.values())
    else:
        trains = {n: p.requires_grad for n, p in deployed.named_parameters()}
        assert not any(r for n, r in trains.items() if n.startswith("layer1."))
        assert all(r for n, r in trains.items() if n.startswith(("layer2.", "layer3.", "layer4.")))


@pytest.mark.parametrize("method", ["base", "orepa", "dbb"])
def test_a_frozen_stage_stays_frozen_with_its_bns_folded(method):
    """fuse_bn=True replaced every conv -> BN pair by a new conv that trains: the frozen layer1 (and
    the frozen norms' shifts) of the training form trained in the deployed one."""
    f = D.resnet_features("resnet18", method, trainable_layers=3, norm="frozen", **TINY)
    deployed = orepa.reparameterize(f, fuse_bn=True)
    trains = {n: p.requires_grad for n, p in deployed.named_parameters()}
    assert not any(r for n, r in trains.items() if n.startswith("layer1."))
    assert all(r for n, r in trains.items() if n.startswith(("layer2.", "layer3.", "layer4.")) and n.endswith("weight"))
    assert not any(r for n, r in trains.items() if n.endswith("bias"))  # conv without bias + frozen BN: a fixed shift
    g = D.resnet_features("resnet18", method, trainable_layers=5, norm="train", **TINY)
    assert all(p.requires_grad for p in orepa.reparameterize(g, fuse_bn=True).parameters())


def test_trainable_layers_and_paper_stem():
    # torchvision semantics: 3 trainable stages = layer2..4; OREPA's deep stem stays trainable (paper)
    f = D.resnet_features("resnet18", "orepa", trainable_layers=3, **TINY)
    assert f.frozen_stages == ("layer1",)
    assert all(p.requires_grad for p in f.conv1.parameters())
    assert not any(p.requires_grad for p in f.layer1.parameters())
    assert all(p.requires_grad for p in f.layer4.parameters())
    f.train()
    assert f.layer4[0].bn1.training and not f.layer1[0].bn1.training  # frozen stages keep their statistics
    g = D.resnet_features("resnet18", "orepa", trainable_layers=3, train_stem=False, **TINY)
    assert g.frozen_stages == ("stem", "layer1")
    assert not any(p.requires_grad for p in g.conv1.parameters())
    h = D.resnet_features("resnet18", "dbb", trainable_layers=3, **TINY)
    assert h.frozen_stages == ("stem", "layer1")
    plain_stem = D.resnet_features("resnet18", "orepa", trainable_layers=3, deep_stem=False, **TINY)
    assert plain_stem.frozen_stages == ("stem", "layer1")  # torchvision semantics without a deep stem
    assert D.resnet_features("resnet18", "base", trainable_layers=0, **TINY).frozen_stages == D.STAGES
    with pytest.raises(ValueError, match="trainable_layers"):
        D.resnet_features("resnet18", "base", trainable_layers=6, **TINY)
    with pytest.raises(ValueError, match="norm"):
        D.resnet_features("resnet18", "base", norm="sync", **TINY)


def test_freezing_a_backbone_without_weights_warns():
    """Frozen norms or stages of a backbone that has no weights train a detector on random features
    (torchvision makes every layer trainable there): said, not silently accepted."""
    with pytest.warns(UserWarning, match=r"norm='eval' keeps the BN statistics at their initialisation"):
        D.resnet_features("resnet18", "orepa", norm="eval", **TINY)
    with pytest.warns(UserWarning, match=r"frozen stages \['layer1'\] keep their random weights"):
        D.fasterrcnn("resnet18", "orepa", num_classes=3, backbone_options=TINY, trainable_layers=3)
    weights = D.build_trunk("resnet18", "orepa", **TINY).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = D.resnet_features("resnet18", "orepa", weights=weights, **TINY)  # frozen norms, 3 stages: torchvision's
        D.resnet_features("resnet18", "orepa", **TINY)  # nothing frozen
    assert f.norm == "frozen" and f.frozen_stages == ("layer1",)


def test_param_groups_stem_lr_and_no_decay():
    model = D.fasterrcnn("resnet18", "orepa", num_classes=3, backbone_options=TINY, trainable_layers=3)
    groups = D.param_groups(model, lr=0.02, weight_decay=1e-4, stem_lr_mult=0.1)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"stem/decay", "stem/no_decay", "backbone/decay", "backbone/no_decay",
                            "rest/decay", "rest/no_decay"}
    assert by_name["stem/decay"]["lr"] == pytest.approx(0.002) and by_name["rest/decay"]["lr"] == 0.02
    stem_ids = {id(p) for p in model.backbone.body.conv1.parameters()} | {
        id(p) for p in model.backbone.body.bn1.parameters()}
    assert {id(p) for g in groups if g["name"].startswith("stem/") for p in g["params"]} == stem_ids
    # every trainable parameter exactly once, frozen ones (layer1) nowhere
    listed = [id(p) for g in groups for p in g["params"]]
    assert len(listed) == len(set(listed))
    assert set(listed) == {id(p) for p in model.parameters() if p.requires_grad}
    assert not set(listed) & {id(p) for p in model.backbone.body.layer1.parameters()}
    # no decay on norms, biases and branch scales; decay on every kernel
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert (id(p) in no_decay) == (p.ndim <= 1), name
    scales = [m.weight for m in model.modules() if isinstance(m, Scale)]
    assert scales and all(id(p) in no_decay for p in scales if p.requires_grad)
    torch.optim.SGD(groups, lr=0.02, momentum=0.9)  # accepted as is


def test_param_groups_refuse_packed_parameters_that_span_parts():
    """Packed, a group's weights are one tensor held by its first block: the deep stem's 3x3 convs
    and layer1's share one, which cannot take the stem's lr and the backbone's at once."""
    from orepa.engine import group_kernels

    model = D.fasterrcnn("resnet18", "orepa", num_classes=3, backbone_options=TINY, trainable_layers=5)
    group_kernels(model, "grouped", pack=True)
    with pytest.raises(ValueError, match=r"several parts \(backbone, stem; held by .*packed_parameters.*pack=False"):
        D.param_groups(model, lr=0.02)
    # one learning rate for both parts: the shared tensor takes it (it was refused as well)
    same = D.param_groups(model, lr=0.02, stem_lr_mult=0.5, backbone_lr_mult=0.5)
    assert {id(p) for g in same for p in g["params"]} == {id(p) for p in model.parameters() if p.requires_grad}
    group_kernels(model, "grouped", pack=False)  # unpacked again: every block's own parameters
    assert {id(p) for g in D.param_groups(model, lr=0.02) for p in g["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad}
    # frozen packed parameters take no learning rate at all (the paper's frozen stem and layer1)
    frozen = D.fasterrcnn("resnet18", "orepa", num_classes=3, backbone_options=TINY, trainable_layers=3,
                          train_stem=False)
    group_kernels(frozen, "grouped", pack=True)
    assert {id(p) for g in D.param_groups(frozen, lr=0.02) for p in g["params"]} == {
        id(p) for p in frozen.parameters() if p.requires_grad}


# --------------------------------------------------------------------------- pretrained weights


def _features_of(trunk, x):
    h = trunk.maxpool(trunk.relu(trunk.bn1(trunk.conv1(x))))
    return trunk.layer4(trunk.layer3(trunk.layer2(trunk.layer1(h))))


def test_checkpoint_files_of_any_training_script(tmp_path):
    """A backbone checkpoint file is taken as any other tool's, however its script wrapped the
    state_dict (read with weights_only; nothing orepa-specific is asked of it); a missing or
    damaged file is a ValueError naming it."""
    torch.manual_seed(0)
    sd = create_model("resnet18", "orepa", num_classes=10, **TINY).state_dict()
    for i, saved in enumerate(({"model_state": sd, "epoch": 1}, {"module": sd}, {"state_dict": {"model": sd}},
                               {"state_dict": sd, "version": 2}, {"state_dict": sd, "format": "x"},
                               {"state_dict": sd, "epoch": 2.5})):
        path = tmp_path / f"{i}.pth"
        torch.save(saved, path)
        f = D.resnet_features("resnet18", "orepa", weights=path, **TINY)
        assert all(torch.equal(v, sd[k]) for k, v in f.state_dict().items()), saved.keys()
    damaged = tmp_path / "damaged.pth"
    damaged.write_bytes((tmp_path / "0.pth").read_bytes()[:500])
    for path, message in ((tmp_path / "missing.pth", "missing.pth does not exist"),
                          (damaged, "damaged.pth is corrupt, truncated")):
        with pytest.raises(ValueError, match=message):
            D.resnet_features("resnet18", "orepa", weights=path, **TINY)


def test_ema_weights_of_a_checkpoint(tmp_path):
    """``ema=True`` takes a checkpoint's moving average: ``model_ema`` of an ``orepa train
    --model-ema`` run (a file read by the commands' loader), timm's ``state_dict_ema`` (with its
    ``module.`` prefixes); a checkpoint without one, or no checkpoint, is said."""
    torch.manual_seed(0)
    model, average = (create_model("resnet18", "orepa", num_classes=10, **TINY) for _ in range(2))
    path = tmp_path / "run.pth"
    torch.save({"model": model.state_dict(), "model_ema": average.state_dict()}, path)
    # (each state_dict taken once: taken per key, it was most of the test's time)
    model_sd, average_sd = model.state_dict(), average.state_dict()
    for ema, source in ((False, model_sd), (True, average_sd)):
        f = D.resnet_features("resnet18", "orepa", weights=path, ema=ema, **TINY)
        assert all(torch.equal(v, source[k]) for k, v in f.state_dict().items()), ema
    timm_style = {"state_dict": model.state_dict(),
                  "state_dict_ema": {f"module.{k}": v for k, v in average.state_dict().items()}}
    f = D.resnet_features("resnet18", "orepa", weights=timm_style, ema=True, **TINY)
    assert all(torch.equal(v, average_sd[k]) for k, v in f.state_dict().items())
    # timm's file also holds its run settings as an argparse Namespace, rebuilt by weights_only reading
    import argparse

    torch.save({**timm_style, "args": argparse.Namespace(model="resnet18", lr=0.1), "version": 2}, path)
    f = D.resnet_features("resnet18", "orepa", weights=path, ema=True, **TINY)
    assert all(torch.equal(v, average_sd[k]) for k, v in f.state_dict().items())
    # a checkpoint whose "model" describes the network and whose "state_dict" holds it
    described = {"model": {"arch": "resnet18", "num_classes": 10}, "state_dict": model.state_dict()}
    f = D.resnet_features("resnet18", "orepa", weights=described, **TINY)
    assert all(torch.equal(v, model_sd[k]) for k, v in f.state_dict().items())
    # torchvision's reference script: torch's AveragedModel saved whole, its step counter beside the weights
    torchvision_style = {"model": model.state_dict(), "model_ema": {
        **{f"module.{k}": v for k, v in average.state_dict().items()}, "n_averaged": torch.tensor(7)}}
    f = D.resnet_features("resnet18", "orepa", weights=torchvision_style, ema=True, **TINY)
    assert all(torch.equal(v, average_sd[k]) for k, v in f.state_dict().items())
    with pytest.raises(ValueError, match="holds no EMA weights"):
        D.resnet_features("resnet18", "orepa", weights=model.state_dict(), ema=True, **TINY)
    with pytest.raises(ValueError, match="give weights= too"):
        D.resnet_features("resnet18", "orepa", ema=True, **TINY)


def test_load_training_form_and_deployed_weights(tmp_path):
    torch.manual_seed(0)
    src = create_model("resnet18", "orepa", num_classes=10, **TINY)
    for bn in _bns(src):
        bn.running_mean.uniform_(-0.1, 0.1)
        bn.running_var.uniform_(0.5, 2.0)
    src.eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ref = _features_of(src, x)
    # training form, saved wrapped the way training scripts do (DataParallel prefix, extra entries)
    path = tmp_path / "orepa_r18.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in src.state_dict().items()}, "epoch": 3}, path)
    f = D.resnet_features("resnet18", "orepa", weights=path, **TINY).eval()
    assert f.norm == "frozen" and f.frozen_stages == ("layer1",)  # pretrained defaults, deep stem trainable
    with torch.no_grad():
        tol_close(f(x)["c5"], ref)
    # training form into a base backbone: reparameterized on the way
    trunk = D.build_trunk("resnet18", "base", **TINY)
    assert D.load_backbone_weights(trunk, src.state_dict(), name="resnet18", method="base", **TINY) \
        == "orepa (reparameterized)"
    # deployed (vanilla layout) checkpoint into a base backbone
    deployed = orepa.reparameterize(src).state_dict()
    g = D.resnet_features("resnet18", "base", weights=deployed, **TINY).eval()
    with torch.no_grad():
        tol_close(_features_of(trunk.eval(), x), ref)
        tol_close(g(x)["c5"], ref)
    # deployed (vanilla) weights into a re-param backbone: every block starts as its conv
    for method in ("orepa", "dbb"):
        opts = {**TINY, "deep_stem": False} if method == "orepa" else TINY
        trunk = D.build_trunk("resnet18", method, **opts)
        assert D.load_backbone_weights(trunk, deployed, name="resnet18", method=method, **opts) \
            == "base (every block starting as its conv)"
        with torch.no_grad():
            tol_close(_features_of(trunk.eval(), x), ref)


def test_weight_mismatches_are_explained():
    src = create_model("resnet18", "orepa", **TINY)
    deployed = orepa.reparameterize(src.eval()).state_dict()
    with pytest.raises(ValueError, match="deployed / vanilla.*cannot start as it.*deep_stem=False"):
        D.resnet_features("resnet18", "orepa", weights=deployed, **TINY)  # the zoo's OREPA stem is a deep stem
    with pytest.raises(ValueError, match="'orepa' training form"):
        D.resnet_features("resnet18", "dbb", weights=src.state_dict(), **TINY)
    with pytest.raises(ValueError, match="does not match resnet34"):
        D.resnet_features("resnet34", "base", weights=deployed, **TINY)
    with pytest.raises(ValueError, match="shape mismatch"):
        D.resnet_features("resnet18", "base", weights=deployed, width_mult=0.5)
    with pytest.raises(ValueError, match="not a ResNet-family"):
        D.resnet_features("repvgg_a0", "base")
    # an `orepa train` checkpoint says how it was built (the default run: gray images, small-input stem)
    gray = create_model("resnet18", "orepa", in_chans=1, small_input=True, **TINY)
    ckpt = {"model": gray.state_dict(), "form": "train",
            "model_cfg": {"model": "resnet18", "method": "orepa", "in_chans": 1, "small_input": True}}
    with pytest.raises(ValueError, match="trained as model='resnet18'; method='orepa'; in_chans=1; small_input=True: "
                                         "build the backbone with the same options"):
        D.resnet_features("resnet18", "orepa", weights=ckpt, **TINY)
    D.resnet_features("resnet18", "orepa", weights=ckpt, in_chans=1, small_input=True, **TINY)


def test_checkpoints_without_bn_batch_counts_load_in_every_form():
    """Weights saved before BatchNorm counted its batches (PyTorch < 0.4.1: torchvision's model-zoo ResNet
    files, which mmdetection's ``torchvision://resnet50`` reads; converted checkpoints) hold no ``num_batches_tracked``:
    torch loads them strictly, and so does the backbone, in every form they can take."""
    torch.manual_seed(0)

    def without_counts(sd):
        return {k: v for k, v in sd.items() if not k.endswith("num_batches_tracked")}

    src = create_model("resnet18", "orepa", num_classes=10, **TINY).eval()
    for bn in _bns(src):
        bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ref = _features_of(src, x)
    vanilla = without_counts(orepa.reparameterize(src).state_dict())
    for method, opts, weights in (("base", TINY, vanilla), ("dbb", TINY, vanilla),
                                  ("orepa", {**TINY, "deep_stem": False}, vanilla),
                                  ("orepa", TINY, without_counts(src.state_dict())),
                                  ("base", TINY, without_counts(src.state_dict()))):
        f = D.resnet_features("resnet18", method, weights=weights, **opts).eval()
        with torch.no_grad():
            tol_close(f(x)["c5"], ref)


def test_torchvisions_weights_enum_is_taken_for_weights_backbone(monkeypatch, tmp_path):
    """``weights_backbone=ResNet18_Weights.IMAGENET1K_V1``, as torchvision's own detector builders take
    it: its file is read (weights_only, hash checked), not refused as an unknown type."""
    from torchvision.models import ResNet18_Weights
    from torchvision.models._api import WeightsEnum

    torch.manual_seed(0)
    plain = torchvision.models.resnet18().state_dict()
    asked = {}

    def get_state_dict(self, *args, **kwargs):  # (no download in tests) the file: no BN batch counts
        asked.update(kwargs, weights=self)
        return {k: v for k, v in plain.items() if not k.endswith("num_batches_tracked")}

    monkeypatch.setattr(WeightsEnum, "get_state_dict", get_state_dict)
    model = D.fasterrcnn("resnet18", "base", num_classes=3, weights_backbone=ResNet18_Weights.IMAGENET1K_V1)
    assert asked == {"weights": ResNet18_Weights.IMAGENET1K_V1, "progress": True, "check_hash": True,
                     "weights_only": True}
    assert torch.equal(model.backbone.body.layer4[1].conv2.weight, plain["layer4.1.conv2.weight"])
    # by name, as torchvision's builders take weights_backbone ("DEFAULT", "IMAGENET1K_V1"): it was read as a path
    for spelled, weights in (("DEFAULT", ResNet18_Weights.DEFAULT), ("IMAGENET1K_V1", ResNet18_Weights.IMAGENET1K_V1),
                             ("ResNet18_Weights.IMAGENET1K_V1", ResNet18_Weights.IMAGENET1K_V1)):
        asked.clear()
        D.fasterrcnn("resnet18", "base", num_classes=3, weights_backbone=spelled)
        assert asked["weights"] == weights
    with pytest.raises(ValueError, match=r"weights 'IMAGENET22K': no such file, nor weights of torchvision's "
                                         r"resnet18 \(it has DEFAULT, IMAGENET1K_V1\)"):
        D.fasterrcnn("resnet18", "base", num_classes=3, weights_backbone="IMAGENET22K")
    with pytest.raises(ValueError, match=r"weights 'DEFAULT': no such file, and torchvision has no weights of "
                                         r"wide_resnet18_2 by name"):
        D.resnet_features("wide_resnet18_2", "base", weights="DEFAULT")
    # a file of that name is the file
    monkeypatch.chdir(tmp_path)
    torch.save({k: v * 2 for k, v in plain.items()}, "IMAGENET1K_V1")
    asked.clear()
    model = D.fasterrcnn("resnet18", "base", num_classes=3, weights_backbone="IMAGENET1K_V1")
    assert not asked and torch.equal(model.backbone.body.layer4[1].conv2.weight, 2 * plain["layer4.1.conv2.weight"])


def test_a_checkpoint_of_orepa_train_with_block_options_is_read_as_it_says():
    """An ``orepa train`` checkpoint records its block options (``--no-deep-stem``, a preset): a base
    backbone, which takes no block options, builds the training form from them to reparameterize it,
    and a backbone of other options is told all of them."""
    torch.manual_seed(0)
    src = create_model("resnet18", "orepa", deep_stem=False, **TINY).eval()
    ckpt = {"model": src.state_dict(), "form": "train",
            "model_cfg": {"model": "resnet18", "method": "orepa", "num_classes": 1000, "in_chans": 3,
                          "small_input": False, "width_mult": 0.25, "options": {"deep_stem": False}}}
    x = torch.randn(1, 3, 64, 64)
    f = D.resnet_features("resnet18", "base", weights=ckpt, **TINY).eval()
    with torch.no_grad():
        tol_close(f(x)["c5"], _features_of(src, x))
    with pytest.raises(ValueError, match="small_input=False; deep_stem=False: build the backbone with the same"):
        D.resnet_features("resnet18", "orepa", weights=ckpt, **TINY)


@pytest.mark.parametrize("builder", [D.deeplabv3, D.fcn, D.pspnet, D.deeplabv3plus])
def test_segmenters_with_imagenet_weights_train_every_layer_and_norm_as_torchvisions_do(builder):
    """torchvision's segmenters (and mmsegmentation's ResNet) fine-tune an ImageNet backbone whole, with
    batch statistics: a checkpoint freezes no stage and no norm here either (the detectors' frozen
    defaults are torchvision's detection ones); asked for, they are kept."""
    weights = create_model("resnet18", "orepa", **TINY).state_dict()
    model = builder("resnet18", "orepa", num_classes=3, weights=weights, backbone_options=TINY)
    assert model.backbone.norm == "train" and model.backbone.frozen_stages == ()
    assert all(p.requires_grad for p in model.backbone.parameters())
    model = builder("resnet18", "orepa", num_classes=3, weights=weights, norm="eval", trainable_layers=3,
                    backbone_options=TINY)
    assert model.backbone.norm == "eval" and model.backbone.frozen_stages == ("layer1",)


def test_old_module_path_is_the_same_module():
    """``orepa.detection`` (the module's former home, used in mm* configs) is an alias, not a copy."""
    import importlib
    import sys

    sys.modules.pop("orepa.detection", None)
    with pytest.warns(DeprecationWarning, match="orepa.apps.detection"):
        old = importlib.import_module("orepa.detection")
    assert old is D and old.fasterrcnn is D.fasterrcnn


def test_frozen_batchnorm_pairs_become_orepa_blocks_that_start_as_their_conv_and_deploy_exactly():
    """A network whose norms are torchvision's FrozenBatchNorm2d (its pretrained detectors'): OREPA
    blocks, which keep the norm after them, start as the conv its fixed statistics were taken from
    (the same function), train with the norm fixed, keep frozen stages frozen and deploy to the
    vanilla layout (FrozenBatchNorm2d and all), exactly; fuse_bn folds the fixed norms. Methods whose
    blocks bring BNs of their own skip such convs, saying why."""
    from torchvision.ops.misc import FrozenBatchNorm2d

    torch.manual_seed(0)
    frozen = torchvision.models.resnet18(norm_layer=FrozenBatchNorm2d, num_classes=10).double()
    for m in frozen.modules():
        if isinstance(m, FrozenBatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.uniform_(0.5, 1.5)
    frozen.conv1.requires_grad_(False)  # a frozen stem, as torchvision's trainable_layers leaves it
    model, report = orepa.convert(frozen, "orepa", return_report=True)
    assert len(report.converted) == len(report.frozen_norm) == 20 and not report.skipped
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), frozen.eval()(x), rtol=1e-12, atol=1e-12)
    assert not any(p.requires_grad for p in model.conv1.parameters())
    stats = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("running_mean", "running_var"))}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    model.train()
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), torch.tensor([1, 7])).backward()
        opt.step()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in stats.items())  # the norms stayed fixed
    model.eval()
    deployed = orepa.reparameterize(model)
    assert isinstance(deployed.layer1[0].bn1, FrozenBatchNorm2d)
    vanilla = torchvision.models.resnet18(norm_layer=FrozenBatchNorm2d, num_classes=10).double()
    vanilla.load_state_dict(deployed.state_dict(), strict=True)
    with torch.no_grad():
        want = model(x)
        assert not torch.allclose(want, frozen(x))  # it trained
        fused = orepa.reparameterize(model, fuse_bn=True)
        assert not any(isinstance(m, FrozenBatchNorm2d) for m in fused.modules())
        for net in (deployed, vanilla.eval(), fused):
            torch.testing.assert_close(net(x), want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="'dbb' blocks bring BNs of their own, which would train where the norm is"):
        orepa.convert(frozen, "dbb")
    with pytest.raises(ValueError, match=r"these 'orepa' blocks \(BNs in their branches\) bring BNs"):
        orepa.convert(frozen, "orepa", mode="offline", branch_norm=True)
    # a branch set with no full-size conv for a 3x3 cannot start as it: skipped with the reason, the model intact
    with torch.no_grad():
        want = frozen.eval()(x)
    _, report = orepa.convert(frozen, "orepa", inplace=True, branches=("1x1", "1x1_avg"), return_report=True)
    assert "so its block must start as the conv, which it cannot" in report.skipped["layer1.0.conv1"]
    assert report.frozen_norm == ["layer2.0.downsample.0", "layer3.0.downsample.0", "layer4.0.downsample.0"]
    with torch.no_grad():
        torch.testing.assert_close(frozen.eval()(x), want, rtol=1e-12, atol=1e-12)


def test_the_detection_benchmark_says_a_missing_device_in_one_line(monkeypatch):
    """benchmarks/bench_detection.py --device cuda where there is none: the commands' one-line
    error (it was the driver's traceback from the first tensor moved there)."""
    from orepa.apps.common import UserError

    mod = benchmark_script("bench_detection")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device cuda requested but CUDA is not available"):
        mod.main(["--device", "cuda"])
    with pytest.raises(UserError, match="--device 'gpu': expected cpu, cuda or cuda:N"):
        mod.main(["--device", "gpu"])


def test_a_frozen_stem_freezes_its_batchnorm_too():
    """A frozen stem (trainable_layers=3 without a deep stem) is conv1 and bn1: neither has trainable
    parameters, and bn1 keeps its statistics in train() like layer1's norms."""
    f = D.resnet_features("resnet18", "base", trainable_layers=3, **TINY)
    assert f.frozen_stages == ("stem", "layer1")
    assert not any(p.requires_grad for p in f.bn1.parameters())
    f.train()
    assert not f.bn1.training and not f.layer1[0].bn1.training and f.layer2[0].bn1.training


def test_a_small_input_trunk_reports_the_strides_its_features_have():
    """Without the stride-2 stem conv and max-pool (small_input) C2..C5 have strides 1, 2, 4, 8, and
    every returned feature map is the input size divided by its reported stride."""
    f = D.resnet_features("resnet18", "base", small_input=True, width_mult=0.125)
    out = f(torch.randn(1, 3, 32, 32))
    assert f.strides == {"c2": 1, "c3": 2, "c4": 4, "c5": 8}
    assert all(v.shape[-1] == 32 // f.strides[k] for k, v in out.items())
