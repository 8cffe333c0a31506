"""Networks of other libraries through the command line: ``--model torchvision:NAME`` / ``timm:NAME``
are built plain, converted by orepa.convert, trained, deployed into the library's own layout."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("timm")

import orepa  # noqa: E402
from orepa.apps.bench.variants import base_model  # noqa: E402
from orepa.apps.common import UserError  # noqa: E402
from orepa.apps.model_cfg import build_model, deploy, external_model  # noqa: E402
from orepa.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _load_model(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _cfg(model: str, method: str, **kw) -> dict:
    return {"model": model, "method": method, "num_classes": 10, "in_chans": 1, "small_input": False,
            "width_mult": 1.0, "options": {}, **kw}


@pytest.mark.parametrize("model,method", [("torchvision:resnet18", "orepa"), ("timm:resnet10t", "dbb"),
                                          ("torchvision:mobilenet_v3_small", "orepa"), ("timm:resnet10t", "repvgg"),
                                          ("torchvision:googlenet", "orepa")])  # one logits tensor in training too
def test_a_converted_network_deploys_into_the_plain_network_of_its_library(model, method):
    torch.manual_seed(0)
    net = build_model(_cfg(model, method))
    assert sum(isinstance(m, orepa.ReparamConv2d) for m in net.modules()) >= 10
    x = torch.randn(4, 1, 40, 40)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):  # the BN statistics and branches move off their initialisation
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), torch.arange(4)).backward()
        opt.step()
    net.eval()
    plain = build_model(_cfg(model, "base"))
    assert not any(isinstance(m, orepa.ReparamConv2d) for m in plain.modules())
    plain.load_state_dict(deploy(net, "deploy").state_dict(), strict=True)  # the library's own layout
    with torch.no_grad():
        ref, y = net(x), plain.eval()(x)
    assert (y - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())


def test_the_first_convolution_takes_the_data_channels():
    tv = external_model("torchvision:resnet18", 10, in_chans=1)
    assert tv.conv1.in_channels == 1 and tv.conv1.kernel_size == (7, 7) and tv.conv1.stride == (2, 2)
    assert tv.fc.out_features == 10
    tm = external_model("timm:resnet10t", 7, in_chans=2)  # timm's own in_chans
    assert tm.eval()(torch.randn(1, 2, 32, 32)).shape == (1, 7)
    # orepa bench: a bare name the zoo lacks is torchvision's; prefixed names as in orepa train
    assert base_model("mobilenet_v3_small", 10, in_chans=1).features[0][0].in_channels == 1
    assert base_model("timm:resnet10t", 10).fc.out_features == 10


def test_the_command_line_trains_deploys_and_evaluates_a_torchvision_network(cache, tmp_path, capsys, monkeypatch):
    """(MobileNetV3-Small: a fifth of ResNet-18's weights, whose OREPA form is written, deployed and checked
    several times here; the --init-from tests below take torchvision's ResNet-18 through the command line.)"""
    run = tmp_path / "run"
    common = ["--train-subset", "32", "--val-subset", "16", "-b", "16", "--no-progress", "--cache-dir", cache]
    assert main(["train", "-m", "torchvision:mobilenet_v3_small", "--method", "orepa", "--epochs", "1",
                 "--no-tensorboard", "--no-curves", "--quiet", "--output-dir", str(run), *common]) == 0
    ckpt = torch.load(run / "checkpoint.pth", map_location="cpu", weights_only=True)
    # Fashion-MNIST's small_input default is the zoo's stem switch: torchvision's stem stays
    assert ckpt["model_cfg"]["model"] == "torchvision:mobilenet_v3_small" and ckpt["model_cfg"]["small_input"] is False
    deployed = tmp_path / "deployed.pth"
    assert main(["reparam", str(run / "checkpoint.pth"), "-o", str(deployed), *common[2:]]) == 0
    assert "0 prediction(s) differ" in capsys.readouterr().out
    assert main(["eval", str(deployed), *common[2:]]) == 0
    import torchvision

    plain = torchvision.models.mobilenet_v3_small(num_classes=10)
    plain.features[0][0] = torch.nn.Conv2d(1, 16, 3, 2, 1, bias=False)
    plain.load_state_dict(torch.load(deployed, map_location="cpu", weights_only=True)["model"], strict=True)
    monkeypatch.chdir(tmp_path)  # export's default file name: the model's name without its colon
    assert main(["export", str(deployed), "--format", "torchscript"]) == 0
    assert (tmp_path / "torchvision-mobilenet_v3_small_orepa.pt").is_file()


def test_constructor_keywords_reach_the_network_and_stay_in_its_settings():
    timm_net = build_model(_cfg("timm:resnet10t", "orepa", options={"model_kwargs": {"drop_path_rate": 0.1}}))
    assert any(type(m).__name__ == "DropPath" for m in timm_net.modules())
    tv_net = build_model(_cfg("torchvision:mobilenet_v3_small", "dbb", options={"model_kwargs": {"dropout": 0.5}}))
    assert tv_net.classifier[2].p == 0.5
    assert any(isinstance(m, orepa.DBBConv2d) for m in tv_net.modules())
    import argparse

    from orepa.apps.model_cfg import model_cfg_from_args
    from orepa.apps.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["-m", "timm:resnet10t", "--model-kwarg", "drop_path_rate=0.1", "--branches", "kxk,1x1"])
    cfg = model_cfg_from_args(args, num_classes=10, in_chans=1, small_input=True)
    assert cfg["options"] == {"branches": ["kxk", "1x1"], "model_kwargs": {"drop_path_rate": 0.1}}
    assert cfg["small_input"] is False


@pytest.mark.parametrize("flags,message", [
    (["-m", "torchvision:nope"], "torchvision has no model 'nope' (torchvision.models.list_models())"),
    # the unknown name first, not the zoo options it could not take
    (["-m", "torchvision:nope", "--width-mult", "0.5"], "torchvision has no model 'nope'"),
    (["-m", "timm:nope"], "timm has no model 'nope'"),
    (["-m", "foo:bar"], "unknown model 'foo:bar'; choose from resnet18"),
    (["-m", "torchvision:resnet18", "--width-mult", "0.5"], "width_mult=0.5: options of the zoo's models"),
    (["-m", "torchvision:resnet18", "--small-input"], "small_input=True: options of the zoo's models"),
    (["-m", "torchvision:resnet18", "--method", "nope"], "unknown method 'nope' for torchvision:resnet18"),
    (["-m", "torchvision:resnet18", "--method", "base", "--branches", "kxk"], "need a re-param method, not base"),
    (["-m", "torchvision:vit_b_16"], "found nothing to convert in VisionTransformer"),
    (["-m", "timm:resnet10t", "--model-kwarg", "nope=1"], "unexpected keyword argument 'nope'"),
    (["-m", "torchvision:fcn_resnet50"], "torchvision:fcn_resnet50 is not a classification network of torchvision"),
    (["-m", "torchvision:googlenet", "--model-kwarg", "aux_logits=True"], "aux_logits=True returns its auxiliary"),
    (["-m", "timm:resnet10t", "--model-kwarg", "features_only=True"], "gives list for one image, not a row of class"),
    (["-m", "timm:convnext_atto"], "stem.0, stages.0.blocks.0.conv_dw, stages.0.blocks.0.mlp.fc1 and 37 more: not "
                                   "followed by a BatchNorm2d it alone feeds (without_bn=True converts the convs that "
                                   "no BatchNorm2d follows too) (--model-option without_bn=true)"),
    (["-m", "timm:convnext_atto", "--method", "base"],  # 32x downsampling: nothing left of 28x28 for the last conv
     "timm:convnext_atto/base (width x1, 1 input channel(s), 10 classes, small_input=False) cannot take "
     "fashion-mnist's 28x28 images: Calculated padded input size per channel: (1 x 1)"),
    (["-m", "resnet18", "--model-kwarg", "drop_rate=0.1"], "resnet18 is a zoo model"),
])
def test_a_network_that_cannot_be_built_is_one_line(cache, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    assert main(["train", *flags, "--epochs", "1", "--train-subset", "16", "--no-progress", "--cache-dir", cache,
                 "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_network_whose_first_convolution_does_not_take_rgb_is_refused():
    from orepa.apps.model_cfg import _adapt_input_conv

    with pytest.raises(UserError, match="no first 3-channel convolution to give 1 input channel"):
        _adapt_input_conv(torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(3, 8, 3)), 1, "custom")


def test_training_starts_from_the_plain_networks_weights(cache, tmp_path, capsys):
    """Pretrained weights in the library's own layout (a bare state_dict, another class count):
    every block starts as its conv, the classifier anew; at a tiny learning rate the deployed
    convs are still those weights."""
    from orepa.apps.model_cfg import external_model

    torch.manual_seed(1)
    plain = external_model("torchvision:resnet18", 1000, in_chans=1).state_dict()
    weights = tmp_path / "resnet18_weights.pth"
    torch.save(plain, weights)
    run = tmp_path / "run"
    common = ["--train-subset", "32", "--val-subset", "16", "-b", "16", "--no-progress", "--cache-dir", cache]
    capsys.readouterr()
    assert main(["train", "-m", "torchvision:resnet18", "--method", "orepa", "--init-from", str(weights), "--epochs",
                 "1", "--lr", "1e-9", "--no-tensorboard", "--no-curves", "--output-dir", str(run), *common]) == 0
    out = capsys.readouterr().out
    assert "a new 10-class classifier (fc.weight, fc.bias)" in out and "every re-param block starts as its conv" in out
    deployed = tmp_path / "deployed.pth"
    assert main(["reparam", str(run / "checkpoint.pth"), "-o", str(deployed), "--no-verify"]) == 0
    sd = torch.load(deployed, map_location="cpu", weights_only=True)["model"]
    convs = [k for k, v in plain.items() if v.dim() == 4]
    assert len(convs) == 20 and sd["fc.weight"].shape == (10, 512)
    for key in convs:  # an OREPA block keeps the BN after it: its deployed conv is the conv it started as
        torch.testing.assert_close(sd[key], plain[key], rtol=1e-5, atol=1e-5)
    # weights that fit neither form: both problems named
    capsys.readouterr()
    assert main(["train", "-m", "torchvision:resnet34", "--method", "dbb", "--init-from", str(weights),
                 "--output-dir", str(tmp_path / "other"), *common]) == 2
    err = capsys.readouterr().err
    assert "nor is it the plain network's" in err and "layer1.2.conv1.weight" in err, err


def test_rgb_weights_are_made_for_the_datas_channels():
    from orepa.apps.checkpoint import adapt_input_channels

    torch.manual_seed(0)
    rgb = torch.randn(8, 3, 3, 3)
    other = torch.randn(8, 3, 3, 3)  # a grouped conv deeper in: the model's own shape has 3 there too
    sd = {"stem.weight": rgb, "deep.weight": other, "fc.weight": torch.randn(10, 8)}
    shapes = {"stem.weight": torch.Size([8, 1, 3, 3]), "deep.weight": torch.Size([8, 3, 3, 3]),
              "fc.weight": torch.Size([10, 8])}
    assert adapt_input_channels(sd, shapes, 1) == ["stem.weight"] and sd["deep.weight"] is other
    gray = torch.randn(2, 1, 9, 9)  # the same function on a gray image as the RGB weights on it, replicated
    torch.testing.assert_close(torch.nn.functional.conv2d(gray, sd["stem.weight"]),
                               torch.nn.functional.conv2d(gray.expand(-1, 3, -1, -1), rgb))
    sd = {"stem.weight": rgb}
    assert adapt_input_channels(sd, {"stem.weight": torch.Size([8, 4, 3, 3])}, 4) == ["stem.weight"]
    torch.testing.assert_close(sd["stem.weight"], torch.cat([rgb, rgb[:, :1]], 1) * 0.75)
    assert adapt_input_channels({"stem.weight": rgb}, {"stem.weight": torch.Size([8, 3, 3, 3])}, 3) == []
    # weights made for gray images (a checkpoint's in_chans 1) on RGB data: the gray weights on the channels' mean
    gray_w = torch.randn(8, 1, 3, 3)
    sd = {"stem.weight": gray_w, "dw.weight": torch.randn(8, 1, 3, 3)}
    shapes = {"stem.weight": torch.Size([8, 3, 3, 3]), "dw.weight": torch.Size([8, 1, 3, 3])}
    assert adapt_input_channels(sd, shapes, 3, from_chans=1) == ["stem.weight"]
    image = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(torch.nn.functional.conv2d(image, sd["stem.weight"]),
                               torch.nn.functional.conv2d(image.mean(1, keepdim=True), gray_w))
    assert adapt_input_channels({"stem.weight": gray_w}, {"stem.weight": torch.Size([8, 3, 3, 3])}, 3) == []


def test_training_starts_from_rgb_weights_on_gray_data(cache, tmp_path, capsys):
    """(MobileNetV3-Small, whose first convolution is features.0.0: a fifth of ResNet-18's weights in the two
    runs' OREPA form; the test above takes ResNet-18's weights, stem conv1, through the same --init-from.)"""
    from orepa.apps.model_cfg import external_model

    net, stem = "torchvision:mobilenet_v3_small", "features.0.0.weight"
    torch.manual_seed(2)
    plain = external_model(net, 1000, in_chans=3).state_dict()
    weights = tmp_path / "rgb.pth"
    torch.save(plain, weights)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "-m", net, "--method", "orepa", "--init-from", str(weights), "--epochs",
                 "1", "--lr", "1e-9", "--train-subset", "16", "--no-eval", "-b", "16", "--no-progress",
                 "--no-tensorboard", "--no-curves", "--cache-dir", cache, "--output-dir", str(run)]) == 0
    assert f"RGB weights made for 1 input channel(s), summed over RGB: {stem}" in capsys.readouterr().out
    deployed = tmp_path / "deployed.pth"
    assert main(["reparam", str(run / "checkpoint.pth"), "-o", str(deployed), "--no-verify"]) == 0
    sd = torch.load(deployed, map_location="cpu", weights_only=True)["model"]
    torch.testing.assert_close(sd[stem], plain[stem].sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
    # an RGB run's deployed checkpoint (ImageNet-trained, say) starts a run on gray data the same way
    from orepa.apps.checkpoint import save_checkpoint

    cfg = _cfg(net, "dbb", num_classes=1000, in_chans=3)
    rgb_run = tmp_path / "rgb_deployed.pth"
    save_checkpoint({"format": "orepa-checkpoint", "version": 1, "form": "deploy", "model_cfg": cfg, "model": plain},
                    rgb_run)
    capsys.readouterr()
    assert main(["train", "-m", net, "--method", "orepa", "--init-from", str(rgb_run), "--epochs",
                 "1", "--lr", "1e-9", "--train-subset", "16", "--no-eval", "-b", "16", "--no-progress",
                 "--no-tensorboard", "--no-curves", "--cache-dir", cache,
                 "--output-dir", str(tmp_path / "from_rgb_run")]) == 0
    out = capsys.readouterr().out
    assert f"RGB weights made for 1 input channel(s), summed over RGB: {stem}" in out
    assert "deployed weights: every re-param block starts as its conv" in out
    assert _load_model(tmp_path / "from_rgb_run" / "checkpoint.pth")["model_cfg"]["in_chans"] == 1


def test_timm_conv2d_same_becomes_an_online_block_and_deploys_back_to_it():
    """timm's tf_* networks pad their strided convs by TensorFlow's 'same' rule (Conv2dSame): OREPA
    converts them (tf_same blocks), the deployed network holds Conv2dSame again and equals the plain
    one at odd and even sizes, BN-folded too; the methods with branches on the feature map skip them."""
    import timm

    torch.manual_seed(0)
    net = timm.create_model("tf_mobilenetv3_small_minimal_100", num_classes=10).double()
    same = [n for n, m in net.named_modules() if type(m).__name__ == "Conv2dSame"]
    assert len(same) == 5
    model, report = orepa.convert(net, "orepa", return_report=True)
    assert set(same) <= set(report.converted) and not any(n in report.skipped for n in same)
    assert all(model.get_submodule(n).tf_same for n in same)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.01)
        model.train()(torch.randn(2, 3, 64, 64, dtype=torch.double))  # BN statistics of a batch
    model.eval()
    deployed = orepa.reparameterize(model)
    assert all(type(deployed.get_submodule(n)) is type(net.get_submodule(n)) for n in same)
    plain = timm.create_model("tf_mobilenetv3_small_minimal_100", num_classes=10).double().eval()
    plain.load_state_dict(deployed.state_dict())
    fused = orepa.reparameterize(model, fuse_bn=True)
    with torch.no_grad():
        for size in (63, 64):
            x = torch.randn(2, 3, size, size, dtype=torch.double)
            ref = model(x)
            assert (plain(x) - ref).abs().max() <= 1e-10 * (1 + ref.abs().max())
            assert (fused(x) - ref).abs().max() <= 1e-10 * (1 + ref.abs().max())
    for method in ("dbb", "repvgg", "orepa-offline"):
        with pytest.raises(ValueError, match="Conv2dSame pads by TensorFlow's 'same' rule .* online OREPA blocks"):
            orepa.make_block(method, net.conv_stem)
