"""The training application: orepa train / eval / reparam / demo on tiny Fashion-MNIST subsets.

Everything here is small on purpose (ResNet-18 at 1/16 width, 64 training images,
batches of 16): the tests check behaviour (resume is exact, DDP ranks agree,
deployed == training form, clear errors), not accuracy.
"""
from __future__ import annotations

import copy
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env
from torch import nn

import orepa
from orepa.apps import checkpoint as ckpt_mod
from orepa.apps import common, data, train
from orepa.apps import demo as demo_app
from orepa.apps.model_cfg import build_model
from orepa.cli import main

TINY = ["--model", "resnet18", "--width-mult", "0.0625", "--train-subset", "64", "--val-subset", "32", "-b", "16",
        "--lr-warmup-epochs", "0.5", "--no-progress", "--no-tensorboard", "--no-curves", "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _train(cache, out, *extra) -> int:
    return main(["train", *TINY, "--cache-dir", cache, "--output-dir", str(out), *extra])


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _training_checkpoint(cfg: dict, path, seed: int | None = None):
    """A training-form checkpoint of the model ``cfg`` describes at ``path`` (with ``seed``: its weights
    and BN statistics moved off the initialisation, so that every branch counts); returns the model."""
    from orepa.apps.checkpoint import save_checkpoint
    from orepa.apps.model_cfg import build_model

    if seed is not None:
        torch.manual_seed(seed)
    model = build_model(cfg)
    if seed is not None:
        with torch.no_grad():
            for t in model.state_dict().values():
                if t.is_floating_point():
                    t.add_(torch.rand_like(t), alpha=0.1)
    save_checkpoint({"format": "orepa-checkpoint", "version": 1, "form": "train", "model_cfg": cfg,
                     "model": model.state_dict()}, path)
    return model


# --------------------------------------------------------------------------- data


def test_missing_fashion_mnist_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("OREPA_FASHION_MNIST_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(common.UserError, match="apt-get install dataset-fashion-mnist"):
        data.prepare_fashion_mnist(tmp_path / "cache")


@pytest.mark.parametrize("xdg", ["", "rel/cache"])
def test_an_empty_or_relative_xdg_cache_home_is_not_the_current_directory(monkeypatch, xdg):
    """XDG_CACHE_HOME set empty (or relative, which the spec says to ignore) put the 55 MB cache under
    ./orepa of wherever the command ran; the spec's default, ~/.cache, is meant."""
    monkeypatch.delenv("OREPA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert data.default_cache_dir() == Path.home() / ".cache" / "orepa"


def test_a_torn_fashion_mnist_cache_file_is_extracted_again(cache, tmp_path):
    """A cached IDX file of the wrong size (a copy cut short) is un-gzipped again, not read."""
    import shutil

    root = tmp_path / "cache"
    shutil.copytree(Path(cache, "FashionMNIST"), root / "FashionMNIST")
    torn = root / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte"
    torn.write_bytes(torn.read_bytes()[:984])
    data.prepare_fashion_mnist(root)
    assert torn.stat().st_size == data.FASHION_MNIST_BYTES[torn.name] == 8 + 10000
    assert len(data.fashion_mnist(root)[1]) == 10000


def test_fashion_mnist_is_read_as_torchvision_reads_it_without_importing_torchvision(cache):
    """orepa reads the IDX files it checked itself: the images, labels and class names torchvision's
    ``FashionMNIST`` gives, and a process that reads them does not import torchvision (nor, through its
    ops, torch._dynamo: about 2 s of an ``orepa eval``'s start)."""
    from torchvision.datasets import FashionMNIST

    for ds, is_train in zip(data.fashion_mnist(cache), (True, False)):
        ref = FashionMNIST(cache, train=is_train, download=False)
        assert torch.equal(ds.images.squeeze(1), ref.data) and torch.equal(ds.targets, ref.targets)
        assert ds.images.dtype == torch.uint8 and ds.classes == ref.classes
    code = ("import sys, orepa.cli; from orepa.apps import data, train\n"
            f"fit, val = data.fashion_mnist({cache!r})\n"
            "print(len(fit), len(val), fit[0][0].shape, 'torchvision' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["60000", "10000", "torch.Size([1,", "28,", "28])", "False", "False"], out


@pytest.mark.parametrize("damage", ["label", "header"])
def test_a_damaged_fashion_mnist_cache_file_is_extracted_again(cache, tmp_path, damage):
    """A cached IDX file of the right size with a label outside 0-9 (torch's loss failed at the
    first step) or another header (torchvision's AssertionError) is un-gzipped again."""
    import shutil

    root = tmp_path / "cache"
    shutil.copytree(Path(cache, "FashionMNIST"), root / "FashionMNIST")
    name = "train-labels-idx1-ubyte" if damage == "label" else "t10k-images-idx3-ubyte"
    f = root / "FashionMNIST" / "raw" / name
    good = f.read_bytes()
    bad = bytearray(good)
    bad[100 if damage == "label" else 3] = 200
    f.write_bytes(bytes(bad))
    data.prepare_fashion_mnist(root)
    assert f.read_bytes() == good


@pytest.mark.parametrize("damage,message", [
    ("truncated", "cannot be read (EOFError: "), ("not gzip", "cannot be read (BadGzipFile: "),
    ("foreign", "is not its t10k-labels-idx1-ubyte (3 bytes, not 10008)")])
def test_a_damaged_fashion_mnist_source_file_is_named(cache, tmp_path, monkeypatch, damage, message):
    """A package file cut short, not gzip, or of other content: a UserError naming it and how to
    reinstall (a traceback, or "cannot write" the cache, before), and nothing put in the cache."""
    import gzip
    import shutil

    root, source = tmp_path / "cache", tmp_path / "source"
    shutil.copytree(Path(cache, "FashionMNIST"), root / "FashionMNIST")
    (root / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    source.mkdir()
    gz = source / "t10k-labels-idx1-ubyte.gz"
    good = gzip.compress(Path(cache, "FashionMNIST", "raw", "t10k-labels-idx1-ubyte").read_bytes())
    gz.write_bytes({"truncated": good[:len(good) // 2], "not gzip": b"<html>404</html>",
                    "foreign": gzip.compress(b"abc")}[damage])
    monkeypatch.setenv("OREPA_FASHION_MNIST_DIR", str(source))
    with pytest.raises(common.UserError, match="apt-get install --reinstall dataset-fashion-mnist") as err:
        data.prepare_fashion_mnist(root)
    assert f"Fashion-MNIST file {gz} " + message in str(err.value)
    assert not (root / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte").exists()


def test_fashion_mnist_is_ungzipped_once_and_read_by_torchvision(cache):
    raw = Path(cache, "FashionMNIST", "raw")
    assert sorted(p.name for p in raw.iterdir()) == sorted(data.FASHION_MNIST_FILES)
    mtimes = [p.stat().st_mtime_ns for p in raw.iterdir()]
    train_set, val_set = data.fashion_mnist(cache)
    assert [p.stat().st_mtime_ns for p in raw.iterdir()] == mtimes  # not rewritten
    assert len(train_set) == 60000 and len(val_set) == 10000 and len(train_set.classes) == 10
    x, y = train_set[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)


def test_augmentation_is_a_function_of_seed_epoch_index_not_of_workers(cache):
    ds = data.SeededAugment(data.fashion_mnist(cache)[0], seed=3)
    sub = torch.utils.data.Subset(ds, range(40))

    def batches(workers, start=0):
        s = data.EpochSampler(range(40), num_replicas=1, rank=0, seed=3)
        s.set_epoch(2)
        s.set_start(start)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=s, num_workers=workers)
        return [x for x, _ in loader]

    a, b = batches(0), batches(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == 5
    assert all(torch.equal(x, y) for x, y in zip(a[2:], batches(0, start=16)))  # mid-epoch resume
    assert len(sub) == 40
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    ds[(5, 1)]
    assert torch.equal(torch.rand(3), before)  # the global RNG is left alone


def test_the_loaders_leave_the_global_random_stream_alone(cache):
    """Each DataLoader iterator drew its workers' base seed from torch's global generator: a run
    resumed mid-epoch (one iterator more) or evaluated (its iterators) drew its dropout masks from
    a shifted stream, so a resumed network with dropout was not its uninterrupted self."""
    import argparse

    from orepa.apps.common import DistInfo

    train_set, val_set = data.fashion_mnist(cache)
    d = argparse.Namespace(train=data.SeededAugment(train_set, seed=0), val=val_set)
    args = argparse.Namespace(seed=0, batch_size=4, workers=0)
    train_loader, _ = data.train_loader(d, args, DistInfo(), torch.device("cpu"))
    val_loader = data.val_loader(d, args, DistInfo(), torch.device("cpu"))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for loader in (train_loader, val_loader, train_loader):
        next(iter(loader))
    assert torch.equal(torch.rand(3), expected)


def _png_tree(root: Path, classes=("cat", "dog"), n_train=6, n_val=2, size=40):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, n in (("train", n_train), ("val", n_val)):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n):
                arr = torch.randint(0, 255, (size, size + 8, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(arr).save(d / f"{i}.png")


def test_imagefolder_pipeline_and_missing_dirs(tmp_path, capsys):
    root = tmp_path / "imgs"
    _png_tree(root)
    out = tmp_path / "run"
    rc = main(["train", "--data-path", str(root), "--model", "resnet18", "--width-mult", "0.0625", "--epochs", "1",
               "-b", "4", "--train-crop-size", "32", "--val-resize-size", "36", "--val-crop-size", "32",
               "--lr-warmup-epochs", "0", "--no-progress",
               "--no-tensorboard", "--no-curves", "-j", "0", "--output-dir", str(out)])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["dataset"] == "imagefolder" and s["model_cfg"]["in_chans"] == 3 and s["model_cfg"]["num_classes"] == 2
    assert not s["model_cfg"]["small_input"] and "val_acc1" in s
    # eval / reparam find the data and the transform sizes in the checkpoint
    assert main(["eval", str(out / "checkpoint.pth"), "--no-progress", "-j", "0", "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["acc1"] == pytest.approx(s["val_acc1"])
    assert main(["reparam", str(out / "checkpoint.pth"), "--no-progress", "-j", "0"]) == 0
    ds_train, ds_val = data.imagefolder(str(root), 32, 36, 32)
    assert ds_train[0][0].shape == (3, 32, 32) and ds_val[0][0].shape == (3, 32, 32)
    (root / "val").rename(root / "validation")
    capsys.readouterr()
    assert main(["train", "--data-path", str(root), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "expected an ImageFolder tree" in err and "val" in err and "(or use --data-path fashion-mnist)" in err
    # --dataset imagefolder left at the default --data-path: the hint names what is missing, not the value given
    assert main(["train", "--dataset", "imagefolder", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "(--dataset imagefolder reads a tree: give its --data-path)" in err and "or use --data-path" not in err
    # eval reads val/ only: its message asks for that alone
    assert main(["eval", str(out / "checkpoint.pth"), "--data-path", str(root), "-j", "0"]) == 2
    err = capsys.readouterr().err
    assert f"expected an ImageFolder tree with {root}/val/<class>/*.jpg (this command reads the validation set only)" \
        in err and "/train/" not in err


def test_a_batch_a_training_batchnorm_sees_as_one_value_is_refused_before_the_run(tmp_path, capsys):
    """-b 1 (or micro-batches of one image) with crops the network reduces to 1x1: a training BN then
    normalises one value per channel, which torch refuses at the first step (a traceback). Refused in
    one line, and no directory is made; a 1x1 validation crop (BNs in eval mode) is no such case."""
    root = tmp_path / "imgs"
    _png_tree(root, n_train=2, n_val=1)
    out = tmp_path / "run"
    base = ["train", "--data-path", str(root), "--model", "resnet18", "--width-mult", "0.0625", "--epochs", "1",
            "--lr-warmup-epochs", "0", "--no-progress",
            "--no-tensorboard", "--no-curves", "-j", "0", "--output-dir", str(out)]
    for flags in (["-b", "1", "--train-crop-size", "16"], ["-b", "2", "--micro-batches", "2", "--train-crop-size", "16"]):
        assert main([*base, *flags, "--val-crop-size", "16", "--val-resize-size", "16"]) == 2
        err = capsys.readouterr().err
        assert "16x16 images: a training BatchNorm sees one value per channel in resnet18/orepa" in err
        assert "Traceback" not in err
        assert not out.exists()
    assert main([*base, "-b", "2", "--train-crop-size", "16", "--val-crop-size", "1", "--val-resize-size", "1"]) == 0


def test_a_relative_data_path_from_a_checkpoint_is_named_as_the_checkpoints(tmp_path, capsys, monkeypatch):
    """A run trained on --data-path imgs (relative), evaluated or resumed from another directory:
    the message says the path is the checkpoint's, relative to where its run started (it named a
    --data-path the user never gave); a reparam without verification needs no data."""
    _png_tree(tmp_path / "imgs", n_train=4, n_val=1)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--data-path", "imgs", "--model", "resnet18", "--width-mult", "0.0625", "--epochs", "1",
                 "-b", "4", "--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32",
                 "--no-eval", "--no-progress",
                 "--no-tensorboard", "--no-curves", "-j", "0", "--output-dir", "run"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ckpt = str(tmp_path / "run" / "checkpoint.pth")
    for argv, source in ((["eval", ckpt], ckpt), (["train", "--resume", ckpt, "--epochs", "2"], f"--resume {ckpt}")):
        capsys.readouterr()
        assert main([*argv, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"{source} was trained on --data-path imgs, a path relative to the directory its run was started " \
               f"in; there is no imgs under {elsewhere}" in err, err
    assert main(["reparam", ckpt, "--no-verify"]) == 0
    assert main(["eval", ckpt, "--data-path", str(tmp_path / "imgs"), "--no-progress", "-j", "0"]) == 0


def test_eval_notes_a_model_with_more_classes_than_the_data(tmp_path, capsys):
    """Allowed (a folder holding some of its classes), but a top-5 over 3 classes of a 5-way model was
    reported without a word."""
    root, out = tmp_path / "imgs", tmp_path / "run"
    _png_tree(root, classes=("cat", "dog", "fox"))
    sizes = ["--train-crop-size", "32", "--val-resize-size", "36", "--val-crop-size", "32"]
    assert main(["train", "--data-path", str(root), *TINY[:4], "--epochs", "1", "-b", "6", *sizes, "--num-classes",
                 "5", "--no-progress",
                 "--no-tensorboard", "--no-curves", "-j", "0", "--max-steps", "1", "--output-dir", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(out / "checkpoint.pth"), "--no-progress", "-j", "0"]) == 0
    assert (f"note: {out / 'checkpoint.pth'} predicts 5 classes, imagefolder has 3: an image predicted as one of "
            "the other 2 counts as wrong") in capsys.readouterr().out


def test_checkpoints_name_their_classes_and_eval_reads_other_folders_by_name(tmp_path, capsys):
    """A folder holding some of the classes (or them in another order) is evaluated with each image's
    label read by class name, not by its folder's rank; classes the model never saw are an error, and
    a resumed run refuses a folder whose classes changed."""
    import shutil

    from orepa.apps.checkpoint import load_checkpoint, model_from_checkpoint

    root, out = tmp_path / "imgs", tmp_path / "run"
    _png_tree(root, classes=("cat", "dog", "fox"))
    sizes = ["--train-crop-size", "32", "--val-resize-size", "36", "--val-crop-size", "32"]
    assert main(["train", "--data-path", str(root), *TINY[:4], "--epochs", "2", "-b", "6", *sizes,
                 "--lr-warmup-epochs", "0", "--no-progress",
                 "--no-tensorboard", "--no-curves", "-j", "0", "--max-steps", "3",
                 "--output-dir", str(out)]) == 0
    ckpt_path = out / "checkpoint.pth"
    ckpt = load_checkpoint(ckpt_path)
    assert ckpt["classes"] == ["cat", "dog", "fox"]
    assert main(["reparam", str(ckpt_path), "--no-progress", "-j", "0"]) == 0
    assert _load(out / "deployed.pth")["classes"] == ["cat", "dog", "fox"]
    # the model's own predictions on the validation images, labelled as in training
    model = model_from_checkpoint(ckpt, ckpt_path)[0].eval()
    val = data.imagefolder(str(root), 32, 36, 32, need_train=False)[1]
    with torch.no_grad():
        pred = {val.samples[i][0]: int(model(val[i][0][None]).argmax()) for i in range(len(val))}
    # a folder with fox and cat only (ranks 1 and 0 there, 2 and 0 in training)
    part = tmp_path / "part"
    for c in ("fox", "cat"):
        shutil.copytree(root / "val" / c, part / "val" / c)
    right = [pred[str(root / "val" / c / f"{i}.png")] == k for c, k in (("cat", 0), ("fox", 2)) for i in range(2)]
    for path in (ckpt_path, out / "deployed.pth"):
        capsys.readouterr()
        assert main(["eval", str(path), "--data-path", str(part), "--no-progress", "-j", "0",
                     "--json", str(tmp_path / "e.json")]) == 0
        assert json.loads((tmp_path / "e.json").read_text())["acc1"] == pytest.approx(100 * sum(right) / 4)
        assert "the 2 classes of imagefolder read by name" in capsys.readouterr().out
    # an export of it alike: its metadata say the classes and the 36 -> 32 resize and crop
    exported = tmp_path / "m.pt2"
    assert main(["export", str(ckpt_path), "--format", "exported-program", "-o", str(exported), "--no-verify"]) == 0
    assert main(["eval", str(exported), "--data-path", str(part), "--no-progress", "-j", "0",
                 "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["acc1"] == pytest.approx(100 * sum(right) / 4)
    assert "the 2 classes of imagefolder read by name" in capsys.readouterr().out
    assert main(["eval", str(exported), "--data-path", str(part), "--val-crop-size", "28", "--no-progress"]) == 2
    assert "cannot take a batch of one of imagefolder's images (" in capsys.readouterr().err  # (its graph fixes its input size)
    assert main(["eval", str(exported), "--no-progress"]) == 2
    assert f"{exported} was trained on an ImageFolder tree, which an export does not record: give its --data-path" \
        in capsys.readouterr().err
    assert main(["train", "--test-only", "--resume", str(ckpt_path), "--data-path", str(part), "--no-progress",
                 "-j", "0"]) == 0  # torchvision-style evaluation reads them alike
    assert f"top-1 {100 * sum(right) / 4:.2f}%" in capsys.readouterr().out
    # and so does reparam's check (it read the folder by rank: fox as dog)
    assert main(["reparam", str(ckpt_path), "--data-path", str(part), "--no-progress", "-j", "0", "-o",
                 str(tmp_path / "part-deployed.pth"), "--json", str(tmp_path / "r.json")]) == 0
    checked = json.loads((tmp_path / "r.json").read_text())
    assert checked["train_form_acc1"] == checked["deployed_acc1"] == pytest.approx(100 * sum(right) / 4)
    assert "the 2 classes of imagefolder read by name" in capsys.readouterr().out
    shutil.copytree(root / "val" / "dog", part / "val" / "wolf")
    assert main(["eval", str(ckpt_path), "--data-path", str(part), "--no-progress", "-j", "0"]) == 2
    err = capsys.readouterr().err
    assert "trained on other classes" in err and "has 1 it never saw (wolf)" in err
    # the training folder gained a class since the run began: resuming would relabel its images
    shutil.copytree(root / "train" / "dog", root / "train" / "wolf")
    shutil.copytree(root / "val" / "dog", root / "val" / "wolf")
    before = ckpt_path.read_bytes()
    assert main(["train", "--resume", str(ckpt_path), "--no-progress", "-j", "0"]) == 2
    err = capsys.readouterr().err
    assert "no longer has the classes this run began with (new: wolf)" in err
    assert ckpt_path.read_bytes() == before


def test_init_from_keeps_the_classifier_rows_of_the_classes_it_knows(tmp_path, capsys):
    """Fine-tuning on a folder that shares classes with the checkpoint: their trained classifier rows
    move to their new places (ImageFolder ranks folders by name, so one new folder shifts them)."""
    from orepa.apps.checkpoint import classifier_rows_by_name

    root, first = tmp_path / "imgs", tmp_path / "first"
    _png_tree(root, classes=("cat", "dog", "fox"), n_train=2, n_val=1)
    sizes = ["--train-crop-size", "32", "--val-resize-size", "36", "--val-crop-size", "32", "-j", "0",
             "--no-progress", "--no-tensorboard", "--no-curves", "--lr-warmup-epochs", "0", "--no-eval"]
    assert main(["train", "--data-path", str(root), *TINY[:4], "-b", "2", *sizes, "--max-steps", "2",
                 "--output-dir", str(first)]) == 0
    start = _load(first / "checkpoint.pth")["model"]
    other = tmp_path / "other"
    _png_tree(other, classes=("bird", "cat", "fox"), n_train=2, n_val=1)
    capsys.readouterr()
    assert main(["train", "--data-path", str(other), *TINY[:4], "-b", "2", *sizes, "--max-steps", "1",
                 "--lr", "1e-9", "--init-from", str(first / "checkpoint.pth"), "--output-dir", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "a 3-class classifier whose rows for the 2 class(es) the checkpoint knows come from it (by name); " \
           "new: bird" in out
    tuned = _load(tmp_path / "t" / "checkpoint.pth")
    assert tuned["classes"] == ["bird", "cat", "fox"]
    for key in ("fc.weight", "fc.bias"):
        torch.testing.assert_close(tuned["model"][key][1:], start[key][[0, 2]], rtol=0, atol=1e-6)
        assert not torch.allclose(tuned["model"][key][0], start[key][1])  # bird: initialised, not dog's
    # the same classes in another order (names given by the library's caller): rows permuted
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    sd = {"1.weight": torch.arange(12.0).view(3, 4), "1.bias": torch.arange(3.0)}
    moved, what = classifier_rows_by_name(model, sd, 3, ["a", "b", "c"], ["c", "a", "b"])
    assert torch.equal(moved["1.weight"], sd["1.weight"][[2, 0, 1]]) and torch.equal(moved["1.bias"], torch.tensor([2., 0, 1]))
    assert "class order" in what
    assert classifier_rows_by_name(model, sd, 3, ["a", "b", "c"], ["x", "y", "z"]) == (sd, "")  # nothing in common


# --------------------------------------------------------------------------- recipe


def test_weight_decay_groups_follow_the_paper():
    model = orepa.models.create_model("resnet18", "orepa", num_classes=10, width_mult=0.0625)
    groups = common.split_params(model)
    scales = {id(m.weight) for m in model.modules() if isinstance(m, orepa.Scale)}
    bns = {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
    assert {id(p) for p in groups.scales} == scales and scales
    assert bns <= {id(p) for p in groups.no_decay} and id(model.fc.bias) in {id(p) for p in groups.no_decay}
    assert all(p.ndim >= 2 for p in groups.decay) and id(model.fc.weight) in {id(p) for p in groups.decay}
    n = len(groups.decay) + len(groups.no_decay) + len(groups.scales)
    assert n == len(list(model.parameters()))  # every parameter once; fixed filters are buffers, not here
    opt_groups = groups.torch_groups(1e-4, 0.0)
    assert {g["name"]: g["weight_decay"] for g in opt_groups} == {"decay": 1e-4, "no_decay": 0.0, "branch_scales": 0.0}


def test_every_one_dimensional_parameter_is_left_out_of_weight_decay():
    """A 1-D (or 0-D) parameter is a bias or a per-channel factor whatever its module or name (a
    PReLU's slopes, a learned temperature): it was decayed towards zero like a conv weight."""
    class Temperature(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            return x / self.t

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.PReLU(8), nn.Flatten(), nn.LazyLinear(4),
                          nn.PReLU(), Temperature())
    model(torch.randn(2, 3, 6, 6))
    groups = common.split_params(model)

    def names(params):
        ids = {id(p) for p in params}
        return {n for n, p in model.named_parameters() if id(p) in ids}

    assert names(groups.no_decay) == {"0.bias", "1.weight", "1.bias", "2.weight", "4.bias", "5.weight", "6.t"}
    assert names(groups.decay) == {"0.weight", "4.weight"} and not groups.scales


@pytest.mark.parametrize("scaled", [False, True], ids=["", "loss-scaled"])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("net", ["resnet18", "depthwise"])
def test_weight_decay_pulls_the_identity_factors_towards_the_identity(pack, net, scaled):
    """The published OREPA block trains its 1x1 -> kxk first factor as a delta on a fixed identity
    (tiled where a depthwise-like conv widens it to 2 C_in), so weight decay shrinks the delta; here
    the factor itself is the parameter, and decay pulled it towards zero, eroding the identity the
    branch starts from. With zero gradients, one SGD step: those factors move as I + (W - I)(1 - lr
    wd), every other decayed weight as W (1 - lr wd), packed into a group's parameters or not, and
    stepped by a GradScaler (float16 training), which handed the fused SGD scaled gradients: the
    pull towards the identity was added to them and divided by the scale (towards zero, 3x the step)."""
    from orepa.blocks import ConvStep
    from orepa.engine import group_kernels

    torch.manual_seed(0)
    if net == "resnet18":
        model = orepa.models.create_model("resnet18", "orepa", num_classes=10, width_mult=0.0625, in_chans=1)
    else:  # a depthwise conv: its factor is widened to 2 C_in
        model = orepa.convert(nn.Sequential(
            nn.Conv2d(1, 8, 1, bias=False), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
            nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)), "orepa", init="reference")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    group_kernels(model, "grouped", pack=pack)
    steps = {n: m for n, m in model.named_modules() if isinstance(m, ConvStep)}
    anchored = [n for n, m in steps.items() if m.decays_to_init]
    assert anchored and all(n.endswith("1x1_kxk.conv1") for n in anchored)
    assert {steps[n].out_channels // steps[n].in_channels for n in anchored} == ({1} if net == "resnet18" else {2})
    before = {n: m.weight.detach().clone() for n, m in steps.items()}
    lr, wd = 0.5, 0.1
    opt = common.make_sgd(common.split_params(model).torch_groups(wd, 0.0), lr=lr, momentum=0.9, loss_scaled=scaled)
    assert common.decay_to_init(opt, model) is not None
    scaler = torch.amp.GradScaler("cpu", init_scale=1.5, enabled=scaled)
    scaler.scale(0.0 * model(torch.randn(2, 1, 32, 32)).sum()).backward()  # every gradient zero
    scaler.step(opt)
    for n, m in steps.items():
        start = m.init_weight() if m.decays_to_init else torch.zeros_like(before[n])
        torch.testing.assert_close(m.weight.detach(), start + (before[n] - start) * (1 - lr * wd),
                                   rtol=1e-6, atol=1e-7, msg=n)


def test_a_loss_scaled_sgd_skips_an_overflowing_step_whole():
    """float16 training (GradScaler): the scaler's first scale often overflows and it skips that step;
    the fused SGD it was given then kept momentum buffers as allocated, never written (1e34 here), and
    the next step wrote them into the weights (DBB's loss NaN at its third step). make_sgd's
    ``loss_scaled`` optimizer steps after the skip as from the start."""
    def net():
        torch.manual_seed(0)
        # (OREPA's: DBB's padding reads the BN statistics, which the skipped step's forward moved)
        return orepa.models.create_model("resnet18", "orepa", num_classes=10, width_mult=0.0625, in_chans=1,
                                         small_input=True)

    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    hp = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
    model = net()
    opt = common.make_sgd(model.parameters(), loss_scaled=True, **hp)
    assert not opt.defaults["fused"]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(2):
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        if step == 0:  # the first scale overflowed a float16 gradient: that step is skipped, the next one taken
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**9
    # the skipped step left nothing behind: the model is a fresh one after one plain step
    fresh = net()
    plain = torch.optim.SGD(fresh.parameters(), **hp)
    nn.functional.cross_entropy(fresh(x), y).backward()
    plain.step()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_make_sgd_is_fused_where_possible_and_steps_like_plain_sgd():
    """The fused optimizer kernel (torch >= 2.4 on CPU and CUDA) gives plain SGD's update, with
    per-group hyper-parameters; a torch/device without one falls back to the default."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.LazyLinear(4))
    model(torch.randn(2, 3, 6, 6))
    twin = copy.deepcopy(model)
    hp = {"lr": 0.1, "momentum": 0.9, "nesterov": True}

    def groups(m):
        return [{"params": list(m[0].parameters()) + list(m[3].parameters()), "weight_decay": 1e-3},
                {"params": list(m[1].parameters()), "weight_decay": 0.0}]

    fused, plain = common.make_sgd(groups(model), **hp), torch.optim.SGD(groups(twin), **hp)
    assert fused.defaults["fused"] is True  # this machine's torch has the CPU kernel
    x = torch.randn(4, 3, 6, 6)
    for _ in range(3):
        for m, opt in ((model, fused), (twin, plain)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    on_meta = common.make_sgd([nn.Parameter(torch.zeros(3, device="meta"))], lr=0.1)
    assert not on_meta.defaults["fused"]  # no fused kernel there: the default implementation


def test_lr_schedule_warmup_then_cosine():
    import argparse

    a = argparse.Namespace(lr_warmup_epochs=2, epochs=10, lr_scheduler="cosineannealinglr", lr_min=0.0, lr=0.1,
                           lr_warmup_decay=0.01, lr_gamma=0.1, lr_step_size=3)
    f = train.lr_factor_fn(a, iters_per_epoch=10)
    assert f(0) == pytest.approx(0.01) and f(10) == pytest.approx(0.505) and f(20) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.5) and f(100) == pytest.approx(0.0, abs=1e-12)
    assert all(f(i) >= f(i + 1) for i in range(20, 100))


def test_a_warm_up_shorter_than_half_a_step_is_one_step_not_none():
    """--lr-warmup-epochs 0.1 at 4 steps an epoch (0.4 steps) rounded to no warm-up: the first step
    trained at the peak lr, --lr-warmup-decay took no effect, and nothing said so."""
    import argparse

    a = argparse.Namespace(lr_warmup_epochs=0.1, epochs=2, lr_scheduler="constant", lr_min=0.0, lr=0.1,
                           lr_warmup_decay=0.01, lr_gamma=0.1, lr_step_size=3)
    assert train.warmup_steps(a, 4) == 1 and train.warmup_steps(a, 20) == 2
    assert [train.lr_factor_fn(a, 4)(i) for i in (0, 1)] == pytest.approx([0.01, 1.0])
    assert train.warmup_steps(argparse.Namespace(lr_warmup_epochs=0.0), 4) == 0


def test_the_step_schedule_counts_its_steps_from_the_end_of_the_warm_up():
    """steplr decays by --lr-gamma every --lr-step-size epochs counted from the end of the warm-up
    (counted from iteration 0, each decay came a warm-up early: at iteration 30 here, not 50)."""
    import argparse

    a = argparse.Namespace(lr_warmup_epochs=2, epochs=10, lr_scheduler="step", lr_min=0.0, lr=0.1,
                           lr_warmup_decay=0.01, lr_gamma=0.1, lr_step_size=3)
    f = train.lr_factor_fn(a, iters_per_epoch=10)  # warm-up: iterations 0-19; a decay every 30 after it
    assert f(19) == pytest.approx(0.01 + 0.99 * 19 / 20)
    assert [f(i) for i in (20, 29, 30, 49)] == pytest.approx([1.0] * 4)
    assert [f(i) for i in (50, 79, 80, 99)] == pytest.approx([0.1, 0.1, 0.01, 0.01])


def test_the_ema_decays_per_update_by_the_interval_batch_and_world_size():
    """torchvision's recipe: --model-ema-decay is per image at batch 1; an update every
    --model-ema-steps steps of world x batch images moves the average by (1 - decay) x world x batch
    x steps / epochs of the way to the model (the interval left out, it moved 32 times too little)."""
    import argparse

    from orepa.apps.common import DistInfo

    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    args = argparse.Namespace(batch_size=16, model_ema_steps=32, epochs=10, model_ema_decay=0.999)
    alpha = (1 - 0.999) * 2 * 16 * 32 / 10  # 0.1024
    ema = train.make_ema(model, args, DistInfo(world_size=2), torch.device("cpu"))
    floats = [t for t in model.state_dict().values() if t.is_floating_point()]
    with torch.no_grad():
        torch._foreach_zero_(floats)
    ema.update_parameters(model)  # the first update: the model's weights as they are
    with torch.no_grad():
        torch._foreach_add_(floats, 1.0)
    ema.update_parameters(model)  # then: a step of alpha from 0 towards 1
    for key, value in ema.module.state_dict().items():
        if value.is_floating_point():  # parameters and BN statistics (use_buffers) alike
            torch.testing.assert_close(value, torch.full_like(value, alpha), msg=lambda m, key=key: f"{key}: {m}")
    assert int(ema.n_averaged) == 2


def test_the_logged_lr_of_an_epoch_is_the_rate_its_last_step_trained_at(cache, tmp_path):
    """It was the rate after the schedule's step: the next epoch's first, and 0.0 for the last epoch,
    a rate no step used."""
    import argparse

    run = tmp_path / "run"
    assert _train(cache, run, "--epochs", "2", "--no-eval", "--method", "base") == 0  # 4 steps an epoch (any network)
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    factor = train.lr_factor_fn(argparse.Namespace(**_load(run / "checkpoint.pth")["args"]), iters_per_epoch=4)
    assert [r["lr"] for r in rows] == [pytest.approx(0.00625 * factor(3)), pytest.approx(0.00625 * factor(7))]
    assert rows[-1]["lr"] > 0


@pytest.mark.parametrize("dtype,scaled", [("float16", True), ("bfloat16", False), ("auto", False)])
def test_float16_autocast_scales_the_loss_on_a_cpu_too(cache, tmp_path, dtype, scaled):
    """The gradient scaler existed on CUDA only: --amp --amp-dtype float16 on a CPU trained float16
    gradients unscaled (small ones underflow to zero). bfloat16 (a CPU's auto) needs no scaling."""
    run = tmp_path / "run"
    assert _train(cache, run, "--epochs", "1", "--no-eval", "--amp", "--amp-dtype", dtype, "--max-steps", "2") == 0
    scaler = _load(run / "checkpoint.pth")["scaler"]
    assert (scaler.get("scale") == 65536.0) == scaled and bool(scaler) == scaled


def test_progress_json_says_where_a_run_stopped_mid_epoch(cache, tmp_path):
    """progress.json, written every few seconds, kept its first step's position after a stop mid-epoch
    (step 1 of a run checkpointed at step 3): it is written at the stop too."""
    run = tmp_path / "run"
    # (where a run is: any network; base builds fastest)
    assert _train(cache, run, "--epochs", "1", "--no-eval", "--max-steps", "3", "--method", "base") == 0
    progress = json.loads((run / "progress.json").read_text())
    assert (progress["global_step"], progress["step"], progress["epoch"]) == (3, 3, 1)
    assert _load(run / "checkpoint.pth")["global_step"] == 3
    # at an epoch's end: all its steps done (it said step 0 of the epoch just completed)
    assert _train(cache, run, "--epochs", "2", "--no-eval", "--max-steps", "4", "--method", "base", "--resume",
                  str(run / "checkpoint.pth")) == 0
    progress = json.loads((run / "progress.json").read_text())
    assert (progress["global_step"], progress["step"], progress["epoch"], progress["steps_per_epoch"]) == (4, 4, 1, 4)


def test_a_resumed_command_that_ends_no_epoch_keeps_the_runs_last_evaluation_in_its_summary(cache, tmp_path):
    """summary.json of a command resumed mid-epoch that stopped before the epoch's end had no val
    figures, though the run's earlier command had written epoch 1's: they are the run's last ones."""
    run = tmp_path / "run"
    # epoch 1 (4 steps) evaluated (what the summary says: any network; base builds fastest)
    assert _train(cache, run, "--epochs", "2", "--max-steps", "5", "--method", "base") == 0
    first = json.loads((run / "summary.json").read_text())
    assert main(["train", "--resume", str(run / "checkpoint.pth"), "--no-progress", "--quiet", "--max-steps", "6"]) == 0
    second = json.loads((run / "summary.json").read_text())
    assert second["global_step"] == 6 and second["epochs_done"] == 1
    row = _load(run / "checkpoint.pth")["history"][-1]
    for key in ("val_acc1", "val_acc5", "val_loss"):
        assert second[key] == first[key] == row[key], key


def test_a_step_schedule_that_would_raise_or_never_decay_the_rate_is_said(cache, tmp_path, capsys):
    """--lr-gamma 10 made the step schedule raise the rate tenfold each step (--lr-min above --lr was
    refused for the cosine schedule, this not); a --lr-step-size longer than the run never decayed,
    without a word. The first is refused, the second noted; a step inside the run gets no note."""
    step = ("--method", "base", "--epochs", "2", "--no-eval", "--max-steps", "1", "--lr-scheduler", "steplr")
    assert _train(cache, tmp_path / "a", *step, "--lr-gamma", "10") == 2
    assert "--lr-gamma 10 is above 1: the step schedule would raise the learning rate 10x every --lr-step-size" \
        in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert _train(cache, tmp_path / "b", *step, "--lr-step-size", "5") == 0
    assert ("note: --lr-step-size 5 epoch(s) after the warm-up is not within the 2-epoch run: the step schedule "
            "never decays the learning rate") in capsys.readouterr().out
    assert _train(cache, tmp_path / "c", *step, "--lr-step-size", "1") == 0
    assert "never decays" not in capsys.readouterr().out


def test_a_warm_up_longer_than_the_run_is_noted(cache, tmp_path, capsys):
    """The default 5-epoch warm-up with --epochs 1 ended at 21% of the peak lr, the schedule never
    begun, and nothing said so; a run whose warm-up ends inside it gets no note."""
    base = ("--method", "base")  # (the schedule's note: any network; base builds fastest)
    assert _train(cache, tmp_path / "a", "--epochs", "1", "--no-eval", "--lr-warmup-epochs", "2", "--max-steps", "1",
                  *base) == 0
    # 4 steps of 8 warm-up steps: the last at 0.01 + 0.99 x 3 / 8 of the peak
    assert ("note: the 2-epoch warm-up outlasts the 1-epoch run: the learning rate ends at 38% of --lr 0.00625, and "
            "the cosineannealinglr schedule never starts") in capsys.readouterr().out
    assert _train(cache, tmp_path / "b", "--epochs", "1", "--no-eval", "--max-steps", "1", *base) == 0
    assert "warm-up outlasts" not in capsys.readouterr().out
    assert _train(cache, tmp_path / "c", "--epochs", "1", "--no-eval", "--lr-warmup-epochs", "1", "--max-steps", "1",
                  "--model-ema", *base) == 0
    assert "never starts (--lr-warmup-epochs sets the warm-up); the EMA restarts at every update during warm-up" \
        in capsys.readouterr().out


# --------------------------------------------------------------------------- train / eval / reparam


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.load's deprecation (the TorchScript export)
def test_train_eval_reparam_roundtrip(cache, tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(cache, out, "--method", "orepa", "--epochs", "2", "--model-ema", "--model-ema-steps", "1",
                  "--curves") == 0
    for name in ("checkpoint.pth", "log.jsonl", "log.csv", "curves.png", "summary.json", "progress.json"):
        assert (out / name).is_file(), name
    hist = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2] and all("val_acc1" in h and "ema_val_acc1" in h for h in hist)
    s = json.loads((out / "summary.json").read_text())
    assert s["params_train"] > s["params_deploy"] > 0 and s["peak_memory_mib"] > 0 and s["time_per_batch_s"] > 0
    assert "val_acc1" in s and "val_acc5" in s
    ck = _load(out / "checkpoint.pth")  # weights_only: tensors and plain values only
    assert ck["form"] == "train" and ck["epoch"] == 2 and ck["step_in_epoch"] == 0
    assert ck["model_cfg"]["in_chans"] == 1 and ck["model_cfg"]["small_input"] is True

    capsys.readouterr()
    res = {}
    for name, extra in (("train", []), ("ema", ["--use-ema"])):
        assert main(["eval", str(out / "checkpoint.pth"), "--no-progress", "--val-subset", "32",
                     "--json", str(tmp_path / f"{name}.json"), *extra]) == 0
        res[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert res["train"]["form"] == "train" and res["train"]["acc1"] == pytest.approx(s["val_acc1"])
    # export --use-ema exports the EMA weights, as reparam --use-ema deploys them
    from orepa.apps.checkpoint import model_from_checkpoint

    x, exported = torch.randn(2, 1, 28, 28), {}
    for extra, use_ema in (([], False), (["--use-ema"], True)):
        ts = tmp_path / f"ema{use_ema}.pt"
        assert main(["export", str(out / "checkpoint.pth"), "--format", "torchscript", "-o", str(ts), *extra]) == 0
        ref = model_from_checkpoint(ck, out / "checkpoint.pth", use_ema=use_ema)[0].eval()
        with torch.no_grad():
            exported[use_ema] = torch.jit.load(str(ts))(x)
            assert (exported[use_ema] - ref(x)).abs().max() <= 1e-4 * (1 + ref(x).abs().max())
    assert (exported[True] - exported[False]).abs().max() > 1e-3  # the EMA weights are other weights

    for fused in (False, True):
        dep = tmp_path / ("fused.pth" if fused else "deployed.pth")
        assert main(["reparam", str(out / "checkpoint.pth"), "-o", str(dep), "--val-subset", "32", "--no-progress",
                     "--json", str(tmp_path / "rep.json"), *(["--fuse-bn"] if fused else [])]) == 0
        rep = json.loads((tmp_path / "rep.json").read_text())
        assert rep["outputs_match"] and rep["accuracy_equal"] and rep["predictions_differ"] == 0
        assert rep["params_deployed"] < rep["params_train"]
        assert main(["eval", str(dep), "--no-progress", "--val-subset", "32", "--json", str(tmp_path / "d.json")]) == 0
        d = json.loads((tmp_path / "d.json").read_text())
        assert d["form"] == ("deploy-fused" if fused else "deploy")
        assert d["acc1"] == pytest.approx(res["train"]["acc1"]) and d["acc5"] == pytest.approx(res["train"]["acc5"])
    # the EMA weights deploy next to the checkpoint under a name of their own (they replaced deployed.pth),
    # and say so when evaluated
    plain = out / "deployed.pth"
    assert main(["reparam", str(out / "checkpoint.pth"), "--no-verify"]) == 0
    before = plain.read_bytes()
    assert main(["reparam", str(out / "checkpoint.pth"), "--no-verify", "--use-ema"]) == 0
    assert plain.read_bytes() == before and _load(out / "deployed-ema.pth")["ema"] is True
    capsys.readouterr()
    # a deployed checkpoint given to reparam is said to be one (not that its default output is its input)
    assert main(["reparam", str(plain), "--no-verify"]) == 2
    assert f"{plain} is already deployed (deploy)" in capsys.readouterr().err and plain.read_bytes() == before
    assert main(["eval", str(out / "deployed-ema.pth"), "--no-progress", "--val-subset", "32", "--json",
                 str(tmp_path / "e.json")]) == 0
    e = json.loads((tmp_path / "e.json").read_text())
    assert "deploy form (EMA)" in capsys.readouterr().out and e["ema"] is True
    assert e["acc1"] == pytest.approx(res["ema"]["acc1"])
    assert main(["eval", str(out / "deployed-ema.pth"), "--use-ema", "--no-progress"]) == 2
    assert "holds EMA weights as its model (written so by orepa reparam or import-reference --use-ema): leave out --use-ema" \
        in capsys.readouterr().err
    # the deployed (vanilla-layout) weights load strictly into the base model of the zoo
    base = orepa.models.create_model("resnet18", "base", num_classes=10, in_chans=1, small_input=True,
                                     width_mult=0.0625)
    base.load_state_dict(_load(tmp_path / "deployed.pth")["model"], strict=True)
    # a bare state_dict is accepted too, given the model flags
    torch.save(base.state_dict(), tmp_path / "bare.pth")
    assert main(["eval", str(tmp_path / "bare.pth"), "--method", "base", "--width-mult", "0.0625", "--no-progress",
                 "--val-subset", "32", "--json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["acc1"] == pytest.approx(res["train"]["acc1"])
    # torchvision-style --test-only
    capsys.readouterr()
    assert main(["train", "--test-only", "--resume", str(out / "checkpoint.pth"), "--val-subset", "32",
                 "--no-progress"]) == 0
    assert "top-1" in capsys.readouterr().out


def test_test_only_is_orepa_eval_of_the_resume_checkpoint(cache, tmp_path, capsys, monkeypatch):
    """``train --test-only`` evaluated with an evaluation of its own: training flags beside it were
    dropped without a word, ``--data-path fashion-mnist`` given explicitly was taken for the default
    (the checkpoint's data evaluated instead), ``--amp-dtype`` without ``--amp`` passed, and eval's
    notes were missing. It is ``orepa eval`` now, with the flags the two share."""
    out = tmp_path / "run"
    assert _train(cache, out, "--method", "base", "--epochs", "1", "--no-eval", "--max-steps", "1") == 0
    ckpt = str(out / "checkpoint.pth")
    capsys.readouterr()
    for extra, msg in ((["--epochs", "5", "--model-ema"], "--test-only only evaluates the --resume checkpoint (as "
                        "orepa eval does); --epochs, --model-ema do(es) not apply then"),
                       (["--amp-dtype", "bfloat16"], "mixed precision is off (no --amp); --amp-dtype")):
        assert main(["train", "--test-only", "--resume", ckpt, "--no-progress", *extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    # a checkpoint whose name begins with "-" (given as --resume=-NAME) is a file name to eval too
    import shutil

    shutil.copy(ckpt, tmp_path / "-dash.pth")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--test-only", "--resume=-dash.pth", "--val-subset", "16", "--no-progress"]) == 0
    capsys.readouterr()
    said = []
    for argv in (["train", "--test-only", "--resume", ckpt], ["eval", ckpt]):
        assert main([*argv, "--val-subset", "16", "--no-progress"]) == 0
        said.append(capsys.readouterr().out.splitlines())
    assert said[0][0] == said[1][0] and said[0][0].startswith(f"{ckpt}: resnet18/base")
    results = [lines[1].partition("(")[0] for lines in said]  # the numbers, before the time they took
    assert results[0] == results[1] and "fashion-mnist val: top-1" in results[0]


@pytest.mark.parametrize("cmd", ["eval", "reparam"])
def test_commands_that_draw_nothing_take_no_seed(cmd, tmp_path, capsys):
    """eval and reparam accepted --seed and read it nowhere (a --val-subset is spread evenly)."""
    assert main([cmd, str(tmp_path / "x.pth"), "--seed", "3"]) == 2
    assert "unrecognized arguments: --seed 3" in capsys.readouterr().err


def test_micro_batches_give_the_whole_batchs_step(cache, tmp_path, capsys):
    """Without batch statistics (timm's ResNet with GroupNorm, OREPA blocks before its norms), a step
    over N micro-batches is the step over the whole batch: the same weights after two steps (float32
    reassociation aside), the same loss; with BNs, each micro-batch is normalised on its own."""
    # (timm's test_resnet: the same ResNet code as resnet10t, few channels; only its norms matter here)
    net = ["--model", "timm:test_resnet", "--model-kwarg", "norm_layer=groupnorm1", "--model-option", "without_bn=true",
           "--train-subset", "64", "-b", "16", "--max-steps", "2", "--no-eval", "--no-progress",
           "--no-tensorboard", "--no-curves",
           "--quiet", "--cache-dir", cache, "--lr", "0.05", "--lr-warmup-epochs", "0"]
    assert main(["train", *net, "--output-dir", str(tmp_path / "whole")]) == 0
    assert main(["train", *net, "--micro-batches", "4", "--output-dir", str(tmp_path / "micro")]) == 0
    whole, micro = _load(tmp_path / "whole" / "checkpoint.pth"), _load(tmp_path / "micro" / "checkpoint.pth")
    common.seed_everything(0)  # the runs' initial weights, as orepa train makes them
    start = build_model(whole["model_cfg"]).state_dict()
    moved = 0.0
    for key, value in whole["model"].items():
        torch.testing.assert_close(micro["model"][key], value, rtol=1e-4, atol=1e-6)
        moved = max(moved, (value - start[key]).abs().max().item())
    assert moved > 1e-3  # the steps did move the weights
    assert micro["epoch_sums"][1:] == whole["epoch_sums"][1:]  # correct predictions, images
    assert micro["epoch_sums"][0] == pytest.approx(whole["epoch_sums"][0], rel=1e-5)  # the summed loss
    # with BNs: per micro-batch statistics, another step; a count that does not divide the batch: refused
    assert _train(cache, tmp_path / "bn", "--max-steps", "1", "--micro-batches", "2") == 0
    capsys.readouterr()
    assert _train(cache, tmp_path / "odd", "--micro-batches", "3") == 2
    assert "--micro-batches 3 must divide the batch (-b 16)" in capsys.readouterr().err


def test_resume_mid_epoch_matches_uninterrupted_run(cache, tmp_path):
    args = ("--method", "orepa", "--epochs", "2", "--no-eval")  # 4 steps per epoch, 8 in all
    assert _train(cache, tmp_path / "a", *args) == 0
    b = tmp_path / "b"
    assert _train(cache, b, *args, "--max-steps", "3") == 0          # killed mid-epoch 1
    mid = _load(b / "checkpoint.pth")
    assert (mid["epoch"], mid["step_in_epoch"], mid["global_step"]) == (0, 3, 3)
    assert _train(cache, b, *args, "--max-steps", "6", "--resume", str(b / "checkpoint.pth")) == 0  # mid-epoch 2
    # the summary's train time is the run's, of every command (it was this command's alone)
    mid, summary = _load(b / "checkpoint.pth"), json.loads((b / "summary.json").read_text())
    run_time = mid["history"][0]["epoch_time_s"] + mid["epoch_timed"][0]
    assert mid["epoch_timed"][1] == 2 and summary["train_time_s"] == pytest.approx(run_time)
    assert summary["time_per_batch_s"] == pytest.approx(run_time / 6)
    assert _train(cache, b, *args, "--resume", str(b / "checkpoint.pth")) == 0
    ca, cb = _load(tmp_path / "a" / "checkpoint.pth"), _load(b / "checkpoint.pth")
    summary = json.loads((b / "summary.json").read_text())
    assert summary["train_time_s"] == pytest.approx(sum(h["epoch_time_s"] for h in cb["history"]))
    assert cb["global_step"] == ca["global_step"] == 8
    for k, v in ca["model"].items():
        assert torch.equal(v, cb["model"][k]), k
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert all(torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"]) for i in sa)
    assert ca["lr_scheduler"]["last_epoch"] == cb["lr_scheduler"]["last_epoch"]
    assert [h["train_loss"] for h in ca["history"]] == pytest.approx([h["train_loss"] for h in cb["history"]])


def test_save_interval_checkpoints_mid_epoch_once_its_minutes_have_passed_since_the_last(cache, tmp_path,
                                                                                          monkeypatch):
    """--save-interval MIN: a mid-epoch checkpoint once MIN minutes have passed since the last one (a
    killed process, or torchrun's restart, repeats at most that much of a long epoch), none at an
    epoch's end (it writes one anyway); the run ends as one without it."""
    written = []
    real = train.Trainer.checkpoint
    monkeypatch.setattr(train.Trainer, "checkpoint", lambda self, reason: written.append(
        (self.state.global_step, reason)) or real(self, reason))
    args = ("--method", "base", "--epochs", "2", "--no-eval")  # 4 steps per epoch
    assert _train(cache, tmp_path / "plain", *args, "--save-interval", "10") == 0
    assert written == [(4, "epoch"), (8, "epoch")]
    written.clear()
    clock = iter(range(0, 10**6, 31))  # half a minute and a second between any two readings
    monkeypatch.setattr(train.time, "perf_counter", lambda: float(next(clock)))
    assert _train(cache, tmp_path / "saved", *args, "--save-interval", "1.5") == 0
    steps = [step for step, reason in written if reason == "step"]
    assert steps and all(step % 4 for step in steps) and [r for _, r in written].count("epoch") == 2, written
    # (each step reads the clock at least once: 1.5 minutes pass within every 3 steps)
    assert all(b - a <= 3 for a, b in zip([0, *steps], steps)), written
    plain, saved = (_load(tmp_path / d / "checkpoint.pth") for d in ("plain", "saved"))
    assert saved["args"]["save_interval"] == 1.5 and plain["global_step"] == saved["global_step"] == 8
    assert all(torch.equal(v, saved["model"][k]) for k, v in plain["model"].items())


def test_auto_resume_starts_a_run_where_there_is_none_and_continues_the_one_there(cache, tmp_path, capsys):
    """A requeued job runs its command again as first given: --auto-resume continues the run its
    directory holds (here stopped by a step budget, as a job killed mid-epoch), to the weights of the
    run never stopped, and a run that has ended again is its summary (exit 0, nothing trained)."""
    args = ("--method", "orepa", "--epochs", "2", "--no-eval", "--auto-resume")
    assert _train(cache, tmp_path / "whole", *args) == 0  # nothing there: a new run
    out = tmp_path / "job"
    assert _train(cache, out, *args, "--max-steps", "3") == 0
    capsys.readouterr()
    assert _train(cache, out, *args) == 0
    said = capsys.readouterr().out
    assert f"--auto-resume: the run there continues (--resume {out / 'checkpoint.pth'})" in said
    assert "global step 3, with its settings; no overrides" in said
    whole, job = _load(tmp_path / "whole" / "checkpoint.pth"), _load(out / "checkpoint.pth")
    assert job["global_step"] == 8 and all(torch.equal(v, job["model"][k]) for k, v in whole["model"].items())
    assert _train(cache, out, *args) == 0
    assert "ends a complete run (2/2 epochs, 8 steps): nothing to train" in capsys.readouterr().out
    assert _load(out / "checkpoint.pth")["global_step"] == 8
    for flag in (["--overwrite"], ["--resume", str(out / "checkpoint.pth")]):
        assert _train(cache, out, *args, *flag) == 2
        assert f"--auto-resume continues the run in --output-dir and {flag[0]} " in capsys.readouterr().err


def test_auto_resume_decides_before_the_setup_says_or_builds_anything(cache, tmp_path, capsys, monkeypatch):
    """The continuation is set up again as a --resume: what the command's own setup had said (a note)
    and built (the data) before it knew came twice, and the first line was not the one naming the
    continuation. With --output-dir it is decided first; in the default directory (known once the
    model is), what was said is held until then."""
    args = ("--method", "orepa", "--epochs", "2", "--no-eval", "--no-tf32-matmul", "--auto-resume")
    note = "note: --no-tf32-matmul acts on CUDA devices only"
    out = tmp_path / "job"
    assert _train(cache, out, *args, "--max-steps", "2") == 0
    built = []
    real = train.build_data
    monkeypatch.setattr(train, "build_data", lambda *a, **k: built.append(1) or real(*a, **k))
    capsys.readouterr()
    assert _train(cache, out, *args, "--max-steps", "3") == 0
    said = capsys.readouterr().out
    assert said.startswith("--auto-resume: the run there continues") and said.count(note) == 1 and len(built) == 1
    monkeypatch.chdir(tmp_path)  # runs/<data>-<model>-<method>
    argv = ["train", *TINY, "--cache-dir", cache, *args]
    assert main([*argv, "--max-steps", "2"]) == 0 and capsys.readouterr().out.count(note) == 1
    assert main([*argv, "--max-steps", "3"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("--auto-resume: the run there continues") and said.count(note) == 1
    assert _load(tmp_path / "runs" / "fashion-mnist-resnet18-orepa" / "checkpoint.pth")["global_step"] == 3


def test_auto_resume_continues_a_run_that_overwrite_had_moved_aside(cache, tmp_path, capsys):
    """A --overwrite run killed outright before its first checkpoint leaves the run it replaces in
    .replaced-run, put back by the next command: --auto-resume continues it there, as the run its
    directory holds, instead of refusing it ("already holds a run")."""
    args = ("--method", "orepa", "--epochs", "2", "--no-eval")
    out = tmp_path / "job"
    assert _train(cache, tmp_path / "old", *args, "--max-steps", "3") == 0
    shutil.copytree(tmp_path / "old", out / train.REPLACED_DIR)
    capsys.readouterr()
    assert _train(cache, out, *args, "--auto-resume", "--max-steps", "5") == 0
    said = capsys.readouterr().out
    assert "the run --overwrite moved aside" in said and "--auto-resume: the run there continues" in said
    assert _load(out / "checkpoint.pth")["global_step"] == 5 and not (out / train.REPLACED_DIR).exists()


def test_a_torchrun_restart_continues_the_run_its_job_began_and_no_other(cache, tmp_path, capsys, monkeypatch):
    """torchrun --max-restarts starts the processes again with the first command line, which would
    start its run anew (--init-from), replace it (--overwrite) or refuse the directory its first start
    made: the restart continues the run its job began (named in its checkpoints). A run there of
    another job (the first start found it and was refused) is judged as the command says."""
    args = ("--method", "orepa", "--epochs", "2", "--no-eval")
    assert _train(cache, tmp_path / "whole", *args) == 0
    start = tmp_path / "start.pth"
    shutil.copy(tmp_path / "whole" / "checkpoint.pth", start)
    out = tmp_path / "job"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _train(cache, out, *args, "--max-steps", "3") == 0
    assert _load(out / "checkpoint.pth")["torchrun_job"] == "rendezvous job-a"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")  # another job's first start, then its restart
    for restart in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        assert _train(cache, out, *args) == 2
        assert f"--output-dir {out} already holds a run" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    assert _train(cache, out, *args, "--overwrite", "--init-from", str(start)) == 0
    said = capsys.readouterr().out
    assert f"torchrun restart 1: the run this job began continues (--resume {out / 'checkpoint.pth'})" in said
    assert "--overwrite" not in said and "starting from the weights" not in said
    whole, job = _load(tmp_path / "whole" / "checkpoint.pth"), _load(out / "checkpoint.pth")
    assert job["global_step"] == 8 and all(torch.equal(v, job["model"][k]) for k, v in whole["model"].items())


def test_a_torchrun_job_is_named_alike_over_its_restarts_and_otherwise_between_jobs(monkeypatch):
    """Without a rendezvous id (the static rendezvous of several nodes): rank 0's torchrun process,
    with its start time (a pid is used again)."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert common.torchrun_job(common.DistInfo()) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    named = common.torchrun_job(common.DistInfo())
    restart, job = named.restart, named.name
    with open(f"/proc/{os.getppid()}/stat") as f:
        started = f.read().rpartition(")")[2].split()[19]
    assert restart == 2 and job == f"torchrun {socket.gethostname()}:{os.getppid()}:{started}"
    monkeypatch.setattr(os, "getppid", lambda: os.getpid())
    assert common.torchrun_job(common.DistInfo()).name != job


@pytest.mark.filterwarnings("ignore:Creating legend")  # (matplotlib times its legend: a minute a reading)
def test_curves_are_drawn_at_the_runs_end_not_at_each_epoch_of_a_short_run(cache, tmp_path, monkeypatch):
    """A drawing of curves.png took a third of a second: a run of short epochs drew each (a tiny
    run's fifth of its time); it is drawn at the end (a stopped run's too), during a run at an
    epoch's end once a minute has passed, and not at all with --no-curves."""
    drawn = []
    real = train.plot_curves
    monkeypatch.setattr(train, "plot_curves", lambda history, *a: drawn.append(len(history)) or real(history, *a))
    args = ("--no-eval", "--method", "base")  # (when the curves are drawn: any network; base builds fastest)
    assert _train(cache, tmp_path / "short", "--epochs", "3", *args, "--curves") == 0
    assert drawn == [3] and (tmp_path / "short" / "curves.png").is_file()
    drawn.clear()
    assert _train(cache, tmp_path / "stopped", "--epochs", "3", *args, "--max-steps", "6", "--curves") == 0
    assert drawn == [1]  # (stopped in epoch 2: the one epoch done)
    drawn.clear()
    clock = iter(range(0, 10**6, 61))  # a minute passes between any two readings
    monkeypatch.setattr(train.time, "perf_counter", lambda: float(next(clock)))
    assert _train(cache, tmp_path / "long", "--epochs", "2", *args, "--curves") == 0
    assert drawn == [1, 2]
    drawn.clear()
    assert _train(cache, tmp_path / "none", "--epochs", "2", *args) == 0  # (the tests' runs: --no-curves)
    assert drawn == [] and not (tmp_path / "none" / "curves.png").exists()


def test_a_faults_message_says_when_torchruns_restart_will_continue_the_run(tmp_path, monkeypatch):
    """Under torchrun --max-restarts with restarts left, a fault's line says the restart continues
    from the checkpoint it names (the user need not); with none left, or without torchrun, it does not."""
    from types import SimpleNamespace

    ckpt = tmp_path / "checkpoint.pth"
    ckpt.write_bytes(b"")
    plain = f"the last checkpoint is {ckpt}: --resume {ckpt} continues the run"
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "j")
    for restart, said in (("0", " (as torchrun's restart 1 of 2 will)"), ("1", " (as torchrun's restart 2 of 2 will)"),
                          ("2", ""), (None, "")):
        if restart is None:
            monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
        else:
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        trainer = SimpleNamespace(dir_lost=False, ckpt_path=ckpt, torchrun=common.torchrun_job(common.DistInfo()))
        assert train.Trainer.how_to_go_on(trainer) == plain + said


def test_a_resumed_run_continues_its_ema_average(cache, tmp_path, capsys):
    """The EMA's update count is restored with its weights: from a count of 0, the first update after
    a resume copied the model's weights over the average (AveragedModel's start) instead of averaging."""
    args = ("--epochs", "1", "--no-eval", "--lr-warmup-epochs", "0", "--model-ema", "--model-ema-steps", "1")
    assert _train(cache, tmp_path / "a", *args) == 0  # 4 steps, an EMA update at each
    b = tmp_path / "b"
    assert _train(cache, b, *args, "--max-steps", "2") == 0
    assert int(_load(b / "checkpoint.pth")["ema_n_averaged"]) == 2
    assert _train(cache, b, *args, "--resume", str(b / "checkpoint.pth")) == 0
    ca, cb = _load(tmp_path / "a" / "checkpoint.pth"), _load(b / "checkpoint.pth")
    assert cb["global_step"] == ca["global_step"] == 4
    for k, v in ca["model_ema"].items():
        assert torch.equal(v, cb["model_ema"][k]), k
    assert int(cb["ema_n_averaged"]) == int(ca["ema_n_averaged"]) == 4
    assert any(not torch.equal(v, ca["model"][k]) for k, v in ca["model_ema"].items())  # an average, not the model
    # EMA weights that do not fit the model are named in one line, as the model's are (a traceback before)
    damaged = _load(b / "checkpoint.pth")
    lost = next(iter(damaged["model_ema"]))
    del damaged["model_ema"][lost]
    torch.save(damaged, tmp_path / "damaged.pth")
    assert main(["train", "--resume", str(tmp_path / "damaged.pth"), "--epochs", "2", "--no-progress", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "damaged.pth (its EMA weights) does not fit the model built" in err and lost in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_ema_restarts_during_the_warm_up_steps_only(cache, tmp_path):
    """A fractional warm-up (0.5 epochs: 2 of the 4 steps) restarted the average at every update of
    its whole first epoch (compared by epoch), so the EMA ended as the model; it restarts at the
    warm-up's steps: the updates after steps 3 and 4 average, by alpha = (1 - decay) x 16 x 1 / 1."""
    args = ("--epochs", "1", "--no-eval", "--model-ema", "--model-ema-steps", "1", "--model-ema-decay", "0.99")
    assert _train(cache, tmp_path / "whole", *args) == 0  # TINY: --lr-warmup-epochs 0.5
    assert _train(cache, tmp_path / "three", *args, "--max-steps", "3") == 0
    whole, three = _load(tmp_path / "whole" / "checkpoint.pth"), _load(tmp_path / "three" / "checkpoint.pth")
    assert int(three["ema_n_averaged"]) == 1 and int(whole["ema_n_averaged"]) == 2
    alpha = 0.01 * 16
    for key, value in whole["model_ema"].items():
        if value.is_floating_point():
            expected = (1 - alpha) * three["model"][key] + alpha * whole["model"][key]
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_a_resumed_run_draws_the_dropout_masks_it_would_have_drawn(cache, tmp_path):
    """One process: --resume restores the global random stream, so a network with dropout stopped
    mid-epoch and resumed ends bit-identical to one that was not (from the stream as a fresh run
    leaves it, the resumed steps drew the first steps' masks again)."""
    # (timm's test_resnet: timm's ResNet, its drop_rate dropout before the classifier, few channels)
    argv = ["train", "-m", "timm:test_resnet", "--method", "base", "--model-kwarg", "drop_rate=0.5", "--train-subset",
            "16", "-b", "4", "--epochs", "1", "--lr-warmup-epochs", "0", "--no-eval", "--no-progress",
            "--no-tensorboard", "--no-curves", "--quiet", "-j", "0", "--cache-dir", cache]  # 4 steps
    assert main([*argv, "--output-dir", str(tmp_path / "whole")]) == 0
    assert main([*argv, "--output-dir", str(tmp_path / "parts"), "--max-steps", "2"]) == 0
    torch.manual_seed(1)  # whatever stream this process is at: the checkpoint's is the one that counts
    assert main(["train", "--resume", str(tmp_path / "parts" / "checkpoint.pth"), "--no-progress", "--quiet",
                 "-j", "0"]) == 0
    whole, parts = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "parts"))
    assert whole["global_step"] == parts["global_step"] == 4
    assert parts["weights_sha256"] == whole["weights_sha256"]


def test_packed_parameters_train_as_unpacked_ones_and_resume_in_their_layout(cache, tmp_path, capsys):
    """Grouped on a CPU packs by default (as on a GPU): the same weights as an unpacked run, the
    same checkpoint keys; the optimizer state is the packed parameters', so a resume keeps the
    layout, refuses another with a hint, and a checkpoint from before packing resumes unpacked."""
    args = ("--method", "orepa", "--epochs", "1", "--no-eval", "--kernel-builder", "grouped", "--max-steps", "3")
    assert _train(cache, tmp_path / "packed", *args) == 0
    assert _train(cache, tmp_path / "plain", *args, "--no-pack-parameters") == 0
    packed, plain = _load(tmp_path / "packed" / "checkpoint.pth"), _load(tmp_path / "plain" / "checkpoint.pth")
    assert packed["args"]["pack_parameters"] is True and plain["args"]["pack_parameters"] is False
    assert list(packed["model"]) == list(plain["model"])
    for k, v in plain["model"].items():
        torch.testing.assert_close(packed["model"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert len(packed["optimizer"]["state"]) < len(plain["optimizer"]["state"])
    ckpt = tmp_path / "packed" / "checkpoint.pth"
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--no-pack-parameters", "--max-steps", "4", "--no-progress"]) == 2
    assert "it was saved with packed parameters: resume with --pack-parameters" in capsys.readouterr().err
    assert main(["train", "--resume", str(ckpt), "--max-steps", "4", "--no-progress", "--quiet"]) == 0
    assert _load(ckpt)["global_step"] == 4
    old = tmp_path / "plain" / "checkpoint.pth"  # as written before packing existed: no such setting
    ck = _load(old)
    del ck["args"]["pack_parameters"]
    torch.save(ck, old)
    assert main(["train", "--resume", str(old), "--max-steps", "4", "--no-progress", "--quiet"]) == 0
    assert _load(old)["args"]["pack_parameters"] is False


def test_a_run_begun_on_a_gpu_resumes_on_this_device_with_its_precision(cache, tmp_path, monkeypatch):
    """How steps run is this session's (its device, its flags), not the checkpoint's: a run a GPU began
    (whole steps as CUDA graphs, compiled kernel builds) continues on a CPU, and in micro-batches (the
    out-of-memory advice), instead of replaying graphs there; its --no-tf32-matmul holds on --resume."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    out = tmp_path / "run"
    assert _train(cache, out, "--method", "orepa", "--epochs", "1", "--no-eval", "--max-steps", "2") == 0
    ckpt = out / "checkpoint.pth"
    assert _load(ckpt)["args"]["tf32_matmul"] is None  # the device's default: decided by each session
    ck = _load(ckpt)
    ck["args"].update(cuda_graphs=True, kernel_builder="compiled", kernel_graphs=False, tf32_matmul=False,
                      device="cuda")  # what a one-GPU run started with --no-tf32-matmul saves
    torch.save(ck, ckpt)
    torch.backends.cuda.matmul.allow_tf32 = True
    from orepa.apps import train as train_app

    applied = []
    set_tf32 = train_app.apply_tf32_matmul
    monkeypatch.setattr(train_app, "apply_tf32_matmul", lambda *a: applied.append(set_tf32(*a)) or applied[-1])
    assert main(["train", "--resume", str(ckpt), "--micro-batches", "2", "--max-steps", "3", "--no-progress",
                 "--quiet"]) == 0
    after = _load(ckpt)
    assert after["global_step"] == 3
    assert after["args"]["cuda_graphs"] is False and after["args"]["kernel_builder"] == "auto"
    assert after["args"]["tf32_matmul"] is False and applied == [False]
    # the command's setting ends with it: the process has its own back
    assert torch.backends.cuda.matmul.allow_tf32 is True


def test_a_library_caller_of_train_gets_the_commands_refusals(cache, tmp_path):
    """``train.train(args)`` with a Namespace of its own (no ``args.given``, which the command line
    sets): part of train took the flags off their defaults as given, the shared refusals none, so a
    flag the command refuses (a step size for the cosine schedule) trained without a word."""
    args = train._parser().parse_args([*TINY, "--cache-dir", cache, "--output-dir", str(tmp_path / "run"),
                                       "--lr-step-size", "5"])
    assert getattr(args, "given", None) is None
    with pytest.raises(common.UserError, match="does not decay in steps .*--lr-step-size"):
        train.train(args)
    assert not (tmp_path / "run").exists()


def test_a_command_leaves_the_process_its_threads_and_precision(cache, tmp_path):
    """--threads, TF32 matrix products and cuDNN's autotuning hold for the command that set them: a
    second command in the same process (``orepa demo --in-process``, a library caller) ran with the
    first one's thread count."""
    before = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark
    threads = 2 if before[0] == 1 else 1
    out = tmp_path / "run"
    assert _train(cache, out, "--method", "base", "--epochs", "1", "--no-eval", "--max-steps", "1", "--threads",
                  str(threads), "--tf32-matmul") == 0
    assert (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark) == before


def test_a_run_replaced_by_an_overwrite_killed_before_its_first_checkpoint_comes_back(cache, tmp_path, capsys):
    """--overwrite moves the previous run aside until its own first checkpoint; killed outright before
    it (the OOM killer: no cleanup runs), the previous run lay hidden in .replaced-run, where the next
    run into the directory took it over and a later --overwrite deleted it. Now --resume names where
    it is, and the next command into the directory puts it back (and so refuses to train over it)."""
    out = tmp_path / "run"
    args = ("--epochs", "1", "--no-eval", "--max-steps", "2", "--method", "base")  # (any network: base builds fastest)
    assert _train(cache, out, *args) == 0
    ckpt = out / "checkpoint.pth"
    before = _load(ckpt)["global_step"]
    keep = out / train.REPLACED_DIR  # what a killed --overwrite leaves: the old run aside, its own progress
    keep.mkdir()
    for name in ckpt_mod.RUN_FILES:
        if (out / name).exists():
            os.replace(out / name, keep / name)
    (out / "progress.json").write_text("{}")
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--no-progress"]) == 2
    assert f"the run --overwrite replaced there is in {keep}" in capsys.readouterr().err
    assert _train(cache, out, *args) == 2
    captured = capsys.readouterr()
    assert "is back: the run replacing it ended before its first checkpoint" in captured.out
    assert "already holds a run" in captured.err
    assert not keep.exists() and _load(ckpt)["global_step"] == before
    assert main(["train", "--resume", str(ckpt), "--max-steps", "3", "--no-progress", "--quiet"]) == 0
    assert _load(ckpt)["global_step"] == 3


def test_a_resume_that_started_while_the_run_was_still_writing_refuses_to_train_over_it(cache, tmp_path, capsys,
                                                                                        monkeypatch):
    """--resume read the checkpoint before it took the directory's lock: where the run still wrote
    there (ending as the command started), the command found the lock free, trained the run's last
    steps again and replaced its finished checkpoint. Now the checkpoint is looked at again under
    the lock, and a newer one refused."""
    run = tmp_path / "run"
    # (what a directory holds: any network; base builds fastest)
    assert _train(cache, run, "--epochs", "2", "--no-eval", "--max-steps", "3", "--method", "base") == 0
    ckpt = run / "checkpoint.pth"
    finished = tmp_path / "finished.pth"
    torch.save({**_load(ckpt), "global_step": 4}, finished)  # what the other run wrote last
    lock = train.lock_run_dir

    def the_other_run_ends_first(directory):
        os.replace(finished, ckpt)  # its last atomic write, then its lock goes
        return lock(directory)

    monkeypatch.setattr(train, "lock_run_dir", the_other_run_ends_first)
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--no-progress"]) == 2
    assert "wrote a newer checkpoint while this command started" in capsys.readouterr().err
    assert _load(ckpt)["global_step"] == 4 and not (run / ".orepa-run.lock").exists()
    monkeypatch.setattr(train, "lock_run_dir", lock)
    assert main(["train", "--resume", str(ckpt), "--no-progress", "--max-steps", "5", "--quiet"]) == 0
    assert _load(ckpt)["global_step"] == 5


def test_a_resume_that_builds_kernels_otherwise_than_the_last_session_says_so(cache, tmp_path, capsys):
    """The kernel builder is the resuming command's device's choice, not the checkpoint's (every builder
    takes the same steps, up to rounding): a resume without --kernel-builder on a run built otherwise says
    which builder it takes and how to keep the run's; one that keeps it says nothing."""
    run = tmp_path / "run"
    assert _train(cache, run, "--epochs", "1", "--no-eval", "--kernel-builder", "grouped") == 0
    ckpt = run / "checkpoint.pth"
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--epochs", "2", "--max-steps", "5", "--no-progress"]) == 0
    assert ("note: kernel builder auto, this device's default; the checkpoint's run last built with grouped (the "
            "same steps up to rounding; --kernel-builder grouped keeps it)") in capsys.readouterr().out
    assert main(["train", "--resume", str(ckpt), "--epochs", "2", "--max-steps", "6", "--no-progress",
                 "--kernel-builder", "grouped"]) == 0
    assert "note: kernel builder" not in capsys.readouterr().out


def test_a_warmup_override_after_the_warmup_ended_is_refused_during_it_taken(cache, tmp_path, capsys):
    """--lr-warmup-decay on --resume once the run's warm-up has ended sets rates no step is left to
    take: it was listed as an override and changed nothing. Refused in one line; during the warm-up
    it is taken, as before. --lr-warmup-epochs moves cosine's (and steplr's) schedule after the
    warm-up, so it is taken there; under a constant schedule, with both warm-ups over, it is refused."""
    run = tmp_path / "run"
    # warm-up: 2 steps of 4 (the schedule's: any network; base builds fastest)
    assert _train(cache, run, "--epochs", "2", "--no-eval", "--max-steps", "1", "--method", "base") == 0
    ckpt = run / "checkpoint.pth"
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--lr-warmup-decay", "0.5", "--max-steps", "3", "--no-progress"]) == 0
    assert "overrides: lr_warmup_decay 0.01 -> 0.5" in capsys.readouterr().out
    assert _load(ckpt)["global_step"] == 3 and _load(ckpt)["args"]["lr_warmup_decay"] == 0.5
    before = ckpt.read_bytes()
    for argv, msg in (
            (["--lr-warmup-decay", "0.1"], "--lr-warmup-decay 0.1 changes nothing: this run's warm-up ended at step 2 "
                                           "(epoch 0.5), and the run is at step 3"),
            (["--lr-scheduler", "constant", "--lr-warmup-epochs", "0.25"],
             "--lr-warmup-epochs 0.25 changes nothing: this run's warm-up ended at step 2 (epoch 0.5), this one would "
             "end at step 1, and the run is at step 3")):
        capsys.readouterr()
        assert main(["train", "--resume", str(ckpt), *argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err, err
    assert ckpt.read_bytes() == before
    # the same value as the run's changes nothing and asks for nothing; a warm-up of another length moves
    # the cosine schedule after it (--max-steps 3: the run stops where it is)
    for argv in (["--lr-warmup-decay", "0.5"], ["--lr-warmup-epochs", "0.25"]):
        assert main(["train", "--resume", str(ckpt), *argv, "--max-steps", "3", "--no-progress"]) == 0, argv


def test_resume_overrides_are_printed_and_take_effect(cache, tmp_path, capsys, monkeypatch):
    """--resume alone keeps the run's settings and directory; a given --lr / --epochs / --wd replaces
    the saved one and rescales the schedule from the current step; what cannot apply is refused."""
    run = tmp_path / "run"
    assert _train(cache, run, "--epochs", "1", "--no-eval", "--wd", "5e-4") == 0  # 4 steps, lr 0.00625
    ckpt = run / "checkpoint.pth"
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--epochs", "3", "--lr", "0.05", "--wd", "1e-3", "--max-steps", "6",
                 "--no-progress", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "overrides: epochs 1 -> 3, lr 0.00625 -> 0.05, weight_decay 0.0005 -> 0.001" in out
    ck = _load(ckpt)  # the same directory: the run continued in place
    assert ck["global_step"] == 6 and ck["args"]["lr"] == 0.05 and ck["args"]["train_subset"] == 64
    import argparse

    factor = train.lr_factor_fn(argparse.Namespace(**ck["args"]), iters_per_epoch=4)
    groups = ck["optimizer"]["param_groups"]
    assert all(g["lr"] == pytest.approx(0.05 * factor(6)) and g["initial_lr"] == 0.05 for g in groups)
    assert {g["name"]: g["weight_decay"] for g in groups}["decay"] == 1e-3
    assert ck["lr_scheduler"]["base_lrs"] == [0.05] * len(groups)
    before = ckpt.read_bytes()
    for argv, msg in ((["-b", "8"], "this run's global batch is 1 x 16 = 16 images, this command's 1 x 8 = 8 (the "
                                    "position in the run and its schedule are counted in steps of that batch); -b 16 "
                                    "with 1 process(es) keeps it"),
                      # a batch whose epoch has fewer steps than where the run stopped (step 2; here 1): the batch
                      # is what changed, not the training set
                      (["-b", "64"], "this run's global batch is 1 x 16 = 16 images, this command's 1 x 64 = 64"),
                      (["--train-subset", "32"], "--train-subset 32 cannot apply"),
                      # the seed chooses the subset's images and orders every epoch: it was taken silently
                      (["--seed", "5"], "--seed 5 cannot apply to this run (it was started with 0"),
                      (["--width-mult", "0.125"], "was trained as resnet18/orepa"),
                      (["--epochs", "1"], "--epochs 1 is fewer than the 2 epoch(s) this run has begun")):
        capsys.readouterr()
        assert main(["train", "--resume", str(ckpt), *argv, "--no-progress"]) == 2
        assert msg in capsys.readouterr().err
    assert ckpt.read_bytes() == before
    # another number of processes sharing the same global batch resumes (each rank's share of an epoch's
    # order is then the same images); saved as 2 x 8 and resumed in one process: -b 16, not the saved 8
    two = tmp_path / "two.pth"
    torch.save({**_load(ckpt), "args": {**_load(ckpt)["args"], "batch_size": 8, "world_size": 2}}, two)
    capsys.readouterr()
    assert main(["train", "--resume", str(two), "--output-dir", str(tmp_path / "two"), "--no-progress"]) == 2
    assert "this run's global batch is 2 x 8 = 16 images, this command's 1 x 8 = 8" in capsys.readouterr().err
    # said before the data are read (an ImageFolder's scan of a large tree) or the model built
    with monkeypatch.context() as m:
        m.setattr(train, "build_data", lambda *a, **k: pytest.fail("the data were read before the batch was checked"))
        assert main(["train", "--resume", str(two), "--output-dir", str(tmp_path / "two"), "--no-progress"]) == 2
    assert "this run's global batch is 2 x 8 = 16 images" in capsys.readouterr().err
    assert main(["train", "--resume", str(two), "-b", "16", "--output-dir", str(tmp_path / "two"), "--epochs", "3",
                 "--max-steps", "7", "--no-progress"]) == 0
    assert "world size 2 -> 1" in capsys.readouterr().out
    assert _load(tmp_path / "two" / "checkpoint.pth")["global_step"] == 7  # (a step on from 6)
    # but not where the processes' shares round to other steps per epoch (or the checkpoint does not say)
    saved = _load(ckpt)
    for steps, said in ((3, "an epoch of this run has 3 steps, here it would have 4 (1 x -b 16 over 64 images"),
                        (None, "it records no steps per epoch (an older checkpoint)")):
        fields = {k: v for k, v in saved.items() if k != "steps_per_epoch"}
        torch.save({**fields, **({} if steps is None else {"steps_per_epoch": steps}),
                    "args": {**saved["args"], "batch_size": 8, "world_size": 2}}, two)
        capsys.readouterr()
        assert main(["train", "--resume", str(two), "-b", "16", "--output-dir", str(tmp_path / "three"), "--epochs", "3",
                     "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert said in err and "resume with 2 process(es)" in err, err


def test_a_run_directory_is_never_replaced_silently(cache, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert _train(cache, run, "--epochs", "1", "--no-eval", "--method", "base") == 0
    ckpt = run / "checkpoint.pth"
    before = ckpt.read_bytes()
    capsys.readouterr()
    assert _train(cache, run, "--epochs", "1", "--no-eval") == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"--resume {ckpt}" in err and "--overwrite" in err
    assert ckpt.read_bytes() == before
    # a run still writing there: said first, not advice the lock would refuse (--resume it, --overwrite it)
    held = ckpt_mod.lock_run_dir(run)
    try:
        assert _train(cache, run, "--epochs", "1", "--no-eval") == 2
        err = capsys.readouterr().err
        assert f"--output-dir {run} is being written by another run (process" in err and "--resume" not in err, err
    finally:
        ckpt_mod.unlock_run_dir(held)
    # reparam never writes over its input, nor over a run's training checkpoint (--overwrite or not:
    # it is what --resume continues), nor over another checkpoint without --overwrite
    other = tmp_path / "other.pth"
    other.write_bytes(before)
    run_ckpt = "is the training checkpoint of a run (it holds optimizer state"
    for out, extra, msg in ((ckpt, [], "is the input checkpoint"), (other, [], run_ckpt),
                            (other, ["--overwrite"], run_ckpt)):
        assert main(["reparam", str(ckpt), "-o", str(out), "--no-verify", *extra]) == 2
        assert msg in capsys.readouterr().err
    assert ckpt.read_bytes() == other.read_bytes() == before
    bare = tmp_path / "bare.pth"
    torch.save(_load(ckpt)["model"], bare)
    assert main(["reparam", str(ckpt), "-o", str(bare), "--no-verify"]) == 2
    assert "is not a deployed checkpoint (a bare state_dict)" in capsys.readouterr().err
    assert main(["reparam", str(ckpt), "-o", str(bare), "--no-verify", "--overwrite"]) == 0
    assert _load(bare)["form"] == "deploy"
    assert main(["reparam", str(ckpt), "--no-verify"]) == 0 and main(["reparam", str(ckpt), "--no-verify"]) == 0
    # --overwrite replaces the run only once the new one is set up: a command that fails on its
    # flags (an unknown method, a batch larger than the data) leaves the old run as it was
    files = sorted(p.name for p in run.iterdir())
    for argv, msg in ((["--method", "nope"], "nope"), (["-b", "4096"], "batch")):
        assert _train(cache, run, "--epochs", "1", "--no-eval", "--overwrite", *argv) == 2
        assert msg in capsys.readouterr().err
        assert sorted(p.name for p in run.iterdir()) == files and ckpt.read_bytes() == before
    (tmp_path / "a_file").write_text("x")
    assert _train(cache, tmp_path / "a_file", "--epochs", "1", "--no-eval") == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    # --overwrite: a run that fails before its first checkpoint puts the old run back as it was
    files = sorted(p.name for p in run.iterdir())
    assert "deployed.pth" in files

    def broken_disk(self):
        raise train.UserError("the disk went away")

    with monkeypatch.context() as m:
        m.setattr(train.Trainer, "train_epoch", broken_disk)
        assert _train(cache, run, "--epochs", "1", "--no-eval", "--overwrite", "--method", "base") == 2
    out = capsys.readouterr()
    assert "the disk went away" in out.err and "are back in" in out.out + out.err
    assert sorted(p.name for p in run.iterdir()) == files and ckpt.read_bytes() == before
    # a killed write's temporary file goes at the next write; a running writer's (or another host's) stays
    host = ckpt_mod._host()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = run / f".checkpoint.pth.{host}-{int(gone.stdout)}.x1y2.tmp"
    live = run / f".checkpoint.pth.{host}-{os.getpid()}.a1b2.tmp"
    remote = run / ".checkpoint.pth.elsewhere-1.c3d4.tmp"
    for p in (dead, live, remote):
        p.write_bytes(b"partial")
    assert _train(cache, run, "--epochs", "1", "--no-eval", "--overwrite") == 0
    assert _load(ckpt)["model_cfg"]["method"] == "orepa"
    # a run still writing the directory holds its lock (a flock for as long as it runs): refused,
    # whatever pid it has; a lock nobody holds goes, whatever pid it names (a live one too: a restarted
    # container's pid 1, or a pid of another container's pid space); an older orepa's lock (no flock)
    # goes only where its pid is gone
    import fcntl

    lock = run / ckpt_mod.RUN_LOCK
    before = ckpt.read_bytes()
    plain = ("--epochs", "1", "--no-eval", "--overwrite", "--method", "base")  # (any network: base builds fastest)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
                               "f.write(sys.argv[2]); f.flush(); fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True); "
                               "time.sleep(60)", str(lock), f"{host}-1 flock"], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        assert _train(cache, run, *plain) == 2
        assert "is being written by another run (process " + f"{host}-1)" in capsys.readouterr().err
        assert ckpt.read_bytes() == before
    finally:
        holder.kill()
        holder.wait()
    for held in (f"{host}-1 flock", f"{host}-{os.getpid()} flock", f"{host}-{int(gone.stdout)}", ""):
        lock.write_text(held)
        # (the last run's files are the directory's at the end: its curves.png too, for the permissions below)
        assert _train(cache, run, *plain, *(["--curves"] if held == "" else [])) == 0, held
        assert not lock.exists(), held
    with subprocess.Popen(["sleep", "60"]) as other:
        lock.write_text(f"{host}-{other.pid}")  # no flock word: its pid's word, which says it runs
        assert _train(cache, run, *plain) == 2
        other.kill()
    assert "is being written by another run" in capsys.readouterr().err
    lock.unlink()
    assert fcntl is not None
    # the old run's files went, those reparam made from its checkpoint among them
    assert not (run / "deployed.pth").exists() and not (run / ".replaced-run").exists()
    assert not dead.exists() and live.exists() and remote.exists()
    live.unlink()
    remote.unlink()
    # every file the run writes has the same permissions: 0666 minus the umask (not mkstemp's 0600)
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in run.iterdir() if p.is_file()}
    assert set(modes) >= {"checkpoint.pth", "log.jsonl", "log.csv", "summary.json", "progress.json", "curves.png"}
    assert set(modes.values()) == {0o666 & ~mask}, modes


def test_a_run_that_ended_before_its_first_checkpoint_does_not_block_the_next(cache, tmp_path, capsys, monkeypatch):
    """A first run that fails at its first steps (a corrupt image, a killed process) leaves only its
    progress: the same command, run again, trains; a run still in its first epoch keeps its directory."""
    run = tmp_path / "run"
    args = ("--epochs", "1", "--no-eval", "--method", "base")  # (what a directory holds: any network; base is fastest)
    real_epoch = train.Trainer.train_epoch

    def fails_after_a_step(self):
        self.args.max_steps = 1
        real_epoch(self)
        (self.out / "tb").mkdir(exist_ok=True)
        raise train.UserError("cannot read image x.png")

    with monkeypatch.context() as m:
        m.setattr(train.Trainer, "train_epoch", fails_after_a_step)
        assert _train(cache, run, *args) == 2
    assert "cannot read image" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["progress.json", "tb"]
    # a live run in its first epoch holds the lock: its progress stays
    lock = run / ckpt_mod.RUN_LOCK
    with subprocess.Popen(["sleep", "60"]) as other:
        lock.write_text(f"{ckpt_mod._host()}-{other.pid}")
        assert _train(cache, run, *args) == 2
        other.kill()
    assert "is being written by another run" in capsys.readouterr().err
    assert (run / "progress.json").exists()
    lock.unlink()
    assert _train(cache, run, *args) == 0
    out = capsys.readouterr().out
    assert "held only the progress of a run that ended before its first checkpoint" in out
    assert (run / "checkpoint.pth").exists() and not (run / "tb").exists() and not (run / ".replaced-run").exists()
    # with a checkpoint it is a run again: refused without --resume / --overwrite
    assert _train(cache, run, *args) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(cache, tmp_path, monkeypatch, capsys):
    calls = {"n": 0}

    class Poisoned(nn.CrossEntropyLoss):
        def forward(self, x, y):
            calls["n"] += 1
            loss = super().forward(x, y)
            return loss * float("nan") if calls["n"] == 6 else loss

    monkeypatch.setattr(train, "make_criterion", lambda args: Poisoned())
    out = tmp_path / "run"
    capsys.readouterr()
    assert _train(cache, out, "--epochs", "3", "--no-eval") == train.EXIT_NONFINITE
    err = capsys.readouterr().err
    assert "loss is nan" in err and "epoch 2, step 2" in err and "last good checkpoint" in err
    ck = _load(out / "checkpoint.pth")
    assert (ck["epoch"], ck["step_in_epoch"]) == (1, 0)  # end of epoch 1: the last good state
    assert all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())


def test_corrupt_and_foreign_checkpoints_give_clear_errors(cache, tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(cache, out, "--method", "base", "--epochs", "1", "--no-eval") == 0
    good = out / "checkpoint.pth"
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(good.read_bytes()[:2000])
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"this is not a checkpoint" * 10)
    pickled = tmp_path / "module.pth"
    torch.save(nn.Linear(2, 2), pickled)  # a whole module: refused by weights_only
    for path, msg in ((truncated, "corrupt, truncated"), (garbage, "corrupt"), (pickled, "weights_only"),
                      (tmp_path / "missing.pth", "does not exist")):
        capsys.readouterr()
        assert main(["eval", str(path), "--no-progress", "--val-subset", "16"]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
    with pytest.raises(common.UserError, match="corrupt"):
        ckpt_mod.load_checkpoint(truncated)
    # another tool's checkpoint keeps its own version numbering (timm's CheckpointSaver writes 'version': 2)
    timm_style = tmp_path / "timm.pth"
    torch.save({"epoch": 3, "arch": "resnet18", "state_dict": {"w": torch.zeros(1)}, "version": 2}, timm_style)
    assert list(ckpt_mod.load_checkpoint(timm_style)["model"]) == ["w"]
    # ... and its run settings: timm's and torchvision's training scripts save their flags as an argparse
    # Namespace (which weights_only loading rebuilds, running nothing), flags that are not orepa's: read
    # neither as orepa's run settings nor refused; timm's EMA under 'state_dict_ema' is what --use-ema takes
    import argparse
    import json

    saved = _load(good)
    scrambled = {k: v.flip(0) if v.is_floating_point() and v.dim() else v for k, v in saved["model"].items()}
    timm_run = tmp_path / "timm_run.pth"
    torch.save({"epoch": 3, "arch": "resnet18", "version": 2, "optimizer": {"state": {}, "param_groups": []},
                "state_dict": {f"module.{k}": v for k, v in scrambled.items()},
                "state_dict_ema": {f"module.{k}": v for k, v in saved["model"].items()},
                "args": argparse.Namespace(data_path=str(tmp_path / "elsewhere"), model="resnet50", lr=0.1)}, timm_run)
    held = ckpt_mod.load_checkpoint(timm_run)
    assert "args" not in held and held["model_ema"].keys() == saved["model"].keys()
    # torchvision's reference script saves its EMA (torch's AveragedModel) whole: its step counter too
    torchvision_run = tmp_path / "torchvision_run.pth"
    torch.save({"model": saved["model"], "args": argparse.Namespace(model="resnet18"), "epoch": 3,
                "model_ema": {**{f"module.{k}": v for k, v in saved["model"].items()}, "n_averaged": torch.tensor(7)}},
               torchvision_run)
    assert ckpt_mod.load_checkpoint(torchvision_run)["model_ema"].keys() == saved["model"].keys()
    cfg = saved["model_cfg"]
    flags = ["--model", cfg["model"], "--method", cfg["method"], "--width-mult", str(cfg["width_mult"]),
             "--num-classes", str(cfg["num_classes"]), "--in-chans", str(cfg["in_chans"]),
             "--small-input" if cfg["small_input"] else "--no-small-input",
             "--cache-dir", cache, "--no-progress", "--val-subset", "16"]
    top1 = {}
    for name, path, extra in (("run", good, []), ("ema", timm_run, ["--use-ema"]), ("raw", timm_run, [])):
        assert main(["eval", str(path), *(flags if path == timm_run else flags[-5:]), *extra,
                     "--json", str(tmp_path / f"{name}.json")]) == 0, capsys.readouterr().err
        top1[name] = {k: v for k, v in json.loads((tmp_path / f"{name}.json").read_text()).items()
                      if k in ("acc1", "acc5", "loss", "dataset", "n")}
    assert top1["ema"] == top1["run"] and top1["raw"]["loss"] != top1["run"]["loss"], top1
    # another architecture than the checkpoint records: refused as such, whether its weights fit or not
    capsys.readouterr()
    assert main(["eval", str(good), "--width-mult", "0.125", "--no-progress", "--val-subset", "16"]) == 2
    err = capsys.readouterr().err
    assert "records resnet18/base" in err and "(width_mult: checkpoint 0.0625 vs requested 0.125): leave them out" in err
    assert main(["eval", str(good), "--method", "orepa", "--no-progress", "--val-subset", "16"]) == 2
    assert "method: checkpoint 'base' vs requested 'orepa'" in capsys.readouterr().err
    assert _train(cache, out, "--method", "orepa", "--epochs", "1", "--resume", str(good)) == 2
    err = capsys.readouterr().err
    assert "was trained as resnet18/base" in err and "method: checkpoint 'base' vs requested 'orepa'" in err


def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.pth"
    ckpt_mod.save_checkpoint({"model": {"w": torch.ones(2)}}, path)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(common.UserError, match=f"cannot write {path}: disk full"):
        ckpt_mod.save_checkpoint({"model": {"w": torch.zeros(2)}}, path)
    assert torch.equal(_load(path)["model"]["w"], torch.ones(2))  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["c.pth"]      # no temp file left behind


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links on this system")
def test_a_write_through_a_symbolic_link_replaces_the_file_it_names(tmp_path):
    """An output path that is a symbolic link (``-o latest.pth`` -> a file elsewhere): the atomic
    rename replaced the link itself by a new file and left its target as it was; the target is
    written now, the link kept, and no temporary file left in either folder."""
    elsewhere = tmp_path / "store"
    elsewhere.mkdir()
    target = elsewhere / "c.pth"
    ckpt_mod.save_checkpoint({"model": {"w": torch.ones(2)}}, target)
    link = tmp_path / "latest.pth"
    link.symlink_to(target)
    ckpt_mod.save_checkpoint({"model": {"w": torch.zeros(2)}}, link)
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert torch.equal(_load(target)["model"]["w"], torch.zeros(2))
    ckpt_mod.write_json(tmp_path / "r.json", {"a": 1})
    (tmp_path / "report.json").symlink_to("r.json")  # a relative link
    ckpt_mod.write_json(tmp_path / "report.json", {"a": 2})
    assert (tmp_path / "report.json").is_symlink() and json.loads((tmp_path / "r.json").read_text()) == {"a": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pth", "r.json", "report.json", "store"]
    assert [p.name for p in elsewhere.iterdir()] == ["c.pth"]


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664)], ids=["umask022", "umask002"])
def test_checkpoints_get_the_permissions_a_plain_open_would_give(tmp_path, umask, mode):
    """The atomic write's temporary file is made owner-only (mkstemp's 0o600); the checkpoint it
    becomes gets 0o666 less the umask, as one written in place would (others could not read it)."""
    before = os.umask(umask)
    try:
        path = ckpt_mod.save_checkpoint({"model": {"w": torch.ones(2)}}, tmp_path / "c.pth")
    finally:
        os.umask(before)
    assert oct(path.stat().st_mode & 0o777) == oct(mode)


def test_the_default_kernel_builder_is_the_compiled_one_on_cuda_only_where_it_can_compile(monkeypatch):
    """orepa train names no builder: compiled on CUDA (measured faster there in every step mode),
    auto on a CPU and under --compile, and auto with its reason where Triton is missing."""
    import importlib.util

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert common.default_kernel_builder(cpu) == ("auto", None)
    assert common.default_kernel_builder(cuda, whole_step_compiled=True) == ("auto", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else None)
    assert common.default_kernel_builder(cuda) == ("compiled", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    builder, why = common.default_kernel_builder(cuda)
    assert builder == "auto" and "Triton is not installed" in why


def test_tf32_matmuls_are_the_cuda_default_and_follow_the_flag():
    """apply_tf32_matmul: on for CUDA unless --no-tf32-matmul, off on a CPU unless asked; the torch
    setting is what it returns."""
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for enabled, device, want in ((None, "cuda", True), (None, "cpu", False), (False, "cuda", False),
                                      (True, "cpu", True)):
            assert common.apply_tf32_matmul(enabled, torch.device(device)) is want
            assert torch.backends.cuda.matmul.allow_tf32 is want
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    from orepa.cli import build_parser

    assert build_parser("train").parse_args(["train"]).tf32_matmul is None  # resolved per device in setup
    assert build_parser("train").parse_args(["train", "--no-tf32-matmul"]).tf32_matmul is False
    assert build_parser("bench").parse_args(["bench"]).tf32_matmul is False  # the recorded tables' setting


@pytest.mark.parametrize("picked", ["auto", "compiled"])
def test_train_without_a_kernel_builder_groups_with_the_default_pick(cache, tmp_path, monkeypatch, picked):
    """The pick of default_kernel_builder is the policy the model's blocks are grouped with (the
    spy groups them eagerly, so that "compiled" costs no compilation on a CPU)."""
    seen = []

    def spy(model, policy, pack, joint, graphs, traced):
        seen.append(policy)
        # one process: the network's kernels as one node; recorded builds off; not compiled: nothing traced
        assert joint and not graphs and not traced
        return real(model, "grouped", pack, joint)

    real = train.group_kernels
    monkeypatch.setattr(train, "group_kernels", spy)
    monkeypatch.setattr(train, "default_kernel_builder", lambda device, whole_step_compiled: (picked, None))
    main(["train", *TINY, "--method", "orepa", "--epochs", "1", "--cache-dir", cache, "--output-dir",
          str(tmp_path / "run"), "--device", "cpu"])
    assert seen == [picked]
    main(["train", *TINY, "--method", "orepa", "--epochs", "1", "--cache-dir", cache, "--output-dir",
          str(tmp_path / "named"), "--device", "cpu", "--kernel-builder", "per-block"])
    assert seen == [picked, "per-block"]  # a named builder is kept


def test_init_from_a_training_form_of_another_method_or_rgb_images_starts_from_its_deployed_network(
        cache, tmp_path, capsys):
    """An OREPA run trained on RGB images (ImageNet, say) starts a run on gray images, or a run of
    another method: its branches fit neither (the stem's depthwise branch has no one-channel form),
    its deployed network does; every block then starts as its deployed conv, RGB summed to gray."""
    from orepa.apps.model_cfg import deploy

    cfg = {"model": "resnet18", "method": "orepa", "num_classes": 1000, "in_chans": 3, "small_input": True,
           "width_mult": 0.0625, "options": {}}
    start = tmp_path / "rgb_orepa.pth"
    rgb = _training_checkpoint(cfg, start, seed=3)
    plain = deploy(rgb, "deploy").state_dict()
    for run, extra, why in (("orepa", [], "its input channels 3, not 1"),
                            ("dbb", ["--method", "dbb"], "its blocks are 'orepa', not 'dbb'; its input channels 3, not 1"),
                            ("no_dw", ["--no-dw-sep"], "its input channels 3, not 1; other block options")):
        out = tmp_path / run
        capsys.readouterr()
        assert _train(cache, out, "--init-from", str(start), "--lr", "1e-9", "--lr-warmup-epochs", "0",
                      "--max-steps", "1", *extra) == 0
        log = capsys.readouterr().out
        assert f"its training form deployed here ({why}): every re-param block starts as its conv" in log
        assert "RGB weights made for 1 input channel(s), summed over RGB: conv1.weight" in log
        if run != "orepa":  # DBB's blocks hold BNs, whose statistics the training step moved
            continue
        again = tmp_path / f"{run}_deployed.pth"
        assert main(["reparam", str(out / "checkpoint.pth"), "-o", str(again), "--no-verify"]) == 0
        got = _load(again)["model"]
        torch.testing.assert_close(got["conv1.weight"], plain["conv1.weight"].sum(1, keepdim=True))
        for key in (k for k, v in plain.items() if v.dim() == 4 and k != "conv1.weight"):
            torch.testing.assert_close(got[key], plain[key], rtol=1e-5, atol=1e-6)
    # the other way: a run trained on gray images starts one on RGB images (the gray weights on their mean)
    gray = tmp_path / "gray.pth"
    gray_model = _training_checkpoint({**cfg, "in_chans": 1, "num_classes": 10}, gray)
    _png_tree(tmp_path / "imgs")
    capsys.readouterr()
    assert main(["train", "--data-path", str(tmp_path / "imgs"), "--model", "resnet18", "--width-mult", "0.0625",
                 "--max-steps", "1", "-b", "4", "--train-crop-size", "32", "--val-resize-size", "36",
                 "--val-crop-size", "32", "--lr", "1e-9", "--lr-warmup-epochs", "0", "--no-progress",
                 "--no-tensorboard", "--no-curves",
                 "--no-eval", "-j", "0", "--init-from", str(gray), "--output-dir", str(tmp_path / "rgb_run")]) == 0
    log = capsys.readouterr().out
    assert "gray weights made for 3 input channel(s), gray repeated, scaled by 1 / channels: conv1.weight" in log
    assert main(["reparam", str(tmp_path / "rgb_run" / "checkpoint.pth"), "-o", str(tmp_path / "rgb.pth"),
                 "--no-verify"]) == 0
    torch.testing.assert_close(_load(tmp_path / "rgb.pth")["model"]["conv1.weight"],
                               deploy(gray_model, "deploy").state_dict()["conv1.weight"].expand(-1, 3, -1, -1) / 3,
                               rtol=1e-5, atol=1e-6)


def test_init_from_a_deep_stem_orepa_run_starts_a_plain_run_from_its_deployed_network(cache, tmp_path, capsys):
    """The block options of the checkpoint's method (deep_stem) do not carry over to a run of another
    method (it was "option(s) ['deep_stem'] not accepted by resnet method 'base'"); the options that
    shape the plain network (widths) do: the base run starts from the deployed network, exactly."""
    from orepa.apps.model_cfg import deploy

    cfg = {"model": "resnet18", "method": "orepa", "num_classes": 10, "in_chans": 1, "small_input": True,
           "width_mult": 0.0625, "options": {"deep_stem": True, "stem_width": 8}}
    start = tmp_path / "deep_stem.pth"
    model = _training_checkpoint(cfg, start, seed=4)
    plain = deploy(model, "deploy").state_dict()
    capsys.readouterr()
    assert _train(cache, tmp_path / "base", "--init-from", str(start), "--method", "base", "--lr", "1e-9",
                  "--lr-warmup-epochs", "0", "--max-steps", "1") == 0
    log = capsys.readouterr().out
    assert "its training form deployed here (its blocks are 'orepa', not 'base'; other block options)" in log
    saved = _load(tmp_path / "base" / "checkpoint.pth")
    assert saved["model_cfg"]["options"] == {"stem_width": 8}
    got = saved["model"]
    assert got["conv1.weight"].shape[0] == 8
    for key in (k for k, v in plain.items() if v.dim() == 4):
        torch.testing.assert_close(got[key], plain[key], rtol=1e-5, atol=1e-6)
    # an RGB one for the gray data: its deployed network would start an OREPA model but for the deep
    # stem, which no conv starts (it was refused as "pass the --data-path it was trained on")
    rgb = tmp_path / "rgb_deep_stem.pth"
    _training_checkpoint({**cfg, "in_chans": 3, "small_input": False}, rgb)  # (a 7x7 stem's deep stem)
    capsys.readouterr()
    assert _train(cache, tmp_path / "rgb", "--init-from", str(rgb), "--max-steps", "1") == 2
    assert ("but for conv1 (OREPADeepStem), which no conv's weights can start; build the model without it: "
            "--no-deep-stem") in capsys.readouterr().err
    assert _train(cache, tmp_path / "rgb", "--init-from", str(rgb), "--max-steps", "1", "--no-deep-stem") == 0


def test_init_from_starts_a_new_run_from_a_checkpoints_weights_with_a_new_classifier(cache, tmp_path, capsys):
    """--init-from: another run's weights, this command's settings and a fresh optimizer; a
    classifier for another class count is made anew (the rest loaded); such a run resumes like any
    other; a deployed checkpoint, --resume with it, or another architecture: one error line."""
    first = tmp_path / "first"
    assert _train(cache, first, "--epochs", "1") == 0
    start = _load(first / "checkpoint.pth")
    capsys.readouterr()
    tuned = tmp_path / "tuned"
    assert _train(cache, tuned, "--init-from", str(first / "checkpoint.pth"), "--num-classes", "12", "--epochs", "1",
                  "--lr", "1e-7", "--lr-warmup-epochs", "0", "--max-steps", "2") == 0  # 2 of its 4 steps
    out = capsys.readouterr().out
    assert f"starting from the weights of {first / 'checkpoint.pth'}" in out
    assert "a new 12-class classifier (fc.weight, fc.bias) in place of the checkpoint's 10-class one" in out
    end = _load(tuned / "checkpoint.pth")
    assert end["model_cfg"] == {**start["model_cfg"], "num_classes": 12} and end["global_step"] == 2
    assert end["model"]["fc.weight"].shape == (12, start["model"]["fc.weight"].shape[1])
    moved = max((end["model"][k] - v).abs().max().item() for k, v in start["model"].items()
                if not k.startswith("fc.") and v.is_floating_point() and "running_" not in k)
    assert moved < 1e-4  # lr 1e-7: the loaded weights, barely moved (BN statistics aside)
    assert "init_from" in end["args"]
    # a run started from a checkpoint resumes as any run (--init-from is not taken from it)
    assert main(["train", "--resume", str(tuned / "checkpoint.pth"), "--no-progress", "--quiet"]) == 0
    assert _load(tuned / "checkpoint.pth")["epoch"] == 1
    # a bare state_dict: the model the command's flags describe
    torch.save(start["model"], tmp_path / "bare.pth")
    assert _train(cache, tmp_path / "bare", "--init-from", str(tmp_path / "bare.pth"), "--max-steps", "1") == 0
    capsys.readouterr()
    deployed = tmp_path / "deployed.pth"
    assert main(["reparam", str(first / "checkpoint.pth"), "-o", str(deployed), "--no-progress", "-j", "0",
                 "--val-subset", "16"]) == 0
    # a deployed checkpoint: every block starts as its deployed conv (lr 1e-9: still that conv at the end)
    assert _train(cache, tmp_path / "from_deployed", "--init-from", str(deployed), "--lr", "1e-9",
                  "--lr-warmup-epochs", "0", "--max-steps", "1") == 0
    log = capsys.readouterr().out
    assert "; deployed weights: every re-param block starts as its conv" in log
    assert f"(deployed from {first / 'checkpoint.pth'})" in log  # it said "imported from"
    again = tmp_path / "again.pth"
    assert main(["reparam", str(tmp_path / "from_deployed" / "checkpoint.pth"), "-o", str(again), "--no-verify"]) == 0
    a, b = _load(deployed)["model"], _load(again)["model"]
    for key in (k for k, v in a.items() if v.dim() == 4):
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    # a --method base run's checkpoint holds the plain network: the same start as from deployed weights
    assert _train(cache, tmp_path / "base", "--method", "base", "--max-steps", "1") == 0
    capsys.readouterr()
    assert _train(cache, tmp_path / "from_base", "--init-from", str(tmp_path / "base" / "checkpoint.pth"), "--method",
                  "orepa", "--lr", "1e-9", "--lr-warmup-epochs", "0", "--max-steps", "1") == 0
    assert "; a --method base run's weights: every re-param block starts as its conv" in capsys.readouterr().out
    assert main(["reparam", str(tmp_path / "from_base" / "checkpoint.pth"), "-o", str(again), "--no-verify",
                 "--overwrite"]) == 0
    a, b = _load(tmp_path / "base" / "checkpoint.pth")["model"], _load(again)["model"]
    assert a.keys() == b.keys()
    for key in (k for k, v in a.items() if v.dim() == 4):
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    fused = tmp_path / "fused.pth"
    assert main(["reparam", str(first / "checkpoint.pth"), "-o", str(fused), "--fuse-bn", "--no-verify"]) == 0
    for extra, message in ((["--init-from", str(fused)], "holds deploy-fused weights"),
                           (["--init-from", str(first / "checkpoint.pth"), "--resume", str(first / "checkpoint.pth")],
                            "give one of them"),
                           (["--init-from", str(first / "checkpoint.pth"), "--model", "resnet34"],
                            "was trained as")):
        capsys.readouterr()
        assert _train(cache, tmp_path / "refused", *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not (tmp_path / "refused").exists()
    # never into the directory of the checkpoint it starts from, --overwrite or not
    before = (first / "checkpoint.pth").read_bytes()
    assert _train(cache, first, "--init-from", str(first / "checkpoint.pth"), "--overwrite") == 2
    assert "holds the checkpoint this run starts from" in capsys.readouterr().err
    assert (first / "checkpoint.pth").read_bytes() == before


# --------------------------------------------------------------------------- distributed


RECORD_GROUP_FREED = """
import os, sys, time
from orepa.apps import train
real_cleanup = train.cleanup_distributed
def cleanup(info, **kwargs):  # what each rank's teardown said: was the process group freed?
    freed = real_cleanup(info, **kwargs)
    record = os.path.join(os.environ["GROUP_FREED_DIR"], "rank" + os.environ["RANK"])
    with open(record + ".tmp", "w") as f:
        f.write(repr(freed))
    os.replace(record + ".tmp", record)
    # no rank leaves before the other has recorded: one exiting non-zero makes torchrun kill the rest
    deadline = time.monotonic() + 60
    while not all(os.path.exists(record[:-1] + r) for r in "01") and time.monotonic() < deadline:
        time.sleep(0.05)
    return freed
train.cleanup_distributed = cleanup
if os.environ.get("INTERRUPT_AT_FORWARD"):
    real_setup = train.Trainer.setup
    def setup(self):  # a Ctrl-C inside the DDP wrapper's call at the second step
        real_setup(self)
        calls = []
        def interrupt(module, args):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
        self.model.register_forward_pre_hook(interrupt)
    train.Trainer.setup = setup
from orepa.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _torchrun_recording_group_freed(tmp_path: Path, argv: list[str], **env) -> subprocess.CompletedProcess:
    """``orepa ARGV`` in two gloo processes, each writing whether its teardown freed the process
    group to ``tmp_path/rank{0,1}``."""
    script = tmp_path / "record_group_freed.py"
    script.write_text(RECORD_GROUP_FREED)
    env = child_env(GROUP_FREED_DIR=str(tmp_path), **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("builder,micro", [("per-block", 2), ("grouped", 1)])
def test_ddp_two_cpu_processes_end_with_identical_weights(cache, tmp_path, builder, micro):
    """Both kernel-builder routes under DDP. Grouped is what torchrun on GPUs runs (no CUDA graphs
    there; a node per group): a group's backward makes all its blocks' gradients ready at once,
    which DDP's buckets must take as they come. The compiled builder (torchrun's default on GPUs)
    runs inside the same nodes, the same numbers (tests/test_engine.py); not run here: two
    processes compiling ResNet-18's eight groups take about a minute on two cores. Micro-batches:
    the gradients all-reduced once a step, with the last one's backward (DDP's no_sync before).
    The EMA's BN statistics are rank 0's on every rank before an evaluation: each rank averaged its
    own, so the EMA evaluated across the ranks was none of them, and not the one saved.
    Each rank frees its process group at the end: one left alive (held by the DDP wrapper) kept
    gloo's worker threads, and one releasing the last collective's tensors while the interpreter
    shut down aborted a finished run now and then (SIGABRT, torchrun: failed)."""
    out = tmp_path / "ddp"
    proc = _torchrun_recording_group_freed(tmp_path, [
        "train", *TINY, "--method", "orepa", "--epochs", "1", "--cache-dir", cache, "--output-dir", str(out),
        "--device", "cpu", "--kernel-builder", builder, "--micro-batches", str(micro), "--model-ema",
        "--model-ema-steps", "1", "--curves"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["True", "True"]
    s = json.loads((out / "summary.json").read_text())
    assert main(["eval", str(out / "checkpoint.pth"), "--use-ema", "--cache-dir", cache, "--no-progress", "-j", "0",
                 "--val-subset", "32", "--json", str(tmp_path / "ema.json")]) == 0
    assert s["ema_val_loss"] == pytest.approx(json.loads((tmp_path / "ema.json").read_text())["loss"], rel=1e-6)
    assert s["world_size"] == 2 and s["global_batch"] == 32 and s["global_step"] == 2  # 64 images / (2 x 16)
    assert len(s["rank_weights_sha256"]) == 2 and s["ranks_in_sync"]
    assert s["rank_weights_sha256"][1] == common.state_hash(_load(out / "checkpoint.pth")["model"])
    assert "val_acc1" in s
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        ["checkpoint.pth", "curves.png", "log.csv", "log.jsonl", "progress.json", "summary.json"])


@pytest.mark.slow
def test_a_ddp_run_interrupted_inside_the_wrappers_call_frees_its_group(cache, tmp_path):
    """A Ctrl-C (or any fault) raised inside the DDP wrapper's call: the exception's frames held the
    wrapper, and with it the process group, past the teardown (the exit could then abort). Each
    rank says where to continue, exits 130 and has freed its group."""
    out = tmp_path / "ddp"
    proc = _torchrun_recording_group_freed(tmp_path, [
        "train", *TINY, "--epochs", "1", "--cache-dir", cache, "--output-dir", str(out), "--device", "cpu"],
        INTERRUPT_AT_FORWARD="1")
    assert "exitcode  : 130" in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "interrupted; no checkpoint had been written yet" in proc.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["True", "True"]


SIGNAL_RANK_ONE = """
import json, os, signal, sys, time
import torch
from orepa.apps import train
real_build_model = train.build_model
def build_model(cfg):  # dropout 0.5 on the classifier's input (as timm's drop_rate), drawn from the global stream
    model = real_build_model(cfg)
    model.fc.register_forward_pre_hook(lambda m, args: (torch.nn.functional.dropout(args[0], 0.5, m.training),))
    return model
train.build_model = build_model
real_time_up = train.Trainer._time_up
def time_up(self):  # asked once a step: rank 1 alone gets a SIGTERM during its third (mid-epoch 2), first start only
    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and self.state.global_step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_time_up(self)
real_write = train.write_json
def slow_write(path, obj, *a, **k):  # rank 0's summary on a slow disk: rank 1, stopped by its signal, exits first
    if os.environ["RANK"] == "0" and str(path).endswith("summary.json"):
        time.sleep(3)
    if str(path).endswith("progress.json"):  # every progress row, by start
        with open(os.environ["PROGRESS_ROWS"], "a") as f:
            f.write(json.dumps({"start": os.environ["TORCHELASTIC_RESTART_COUNT"], **obj}) + "\\n")
    return real_write(path, obj, *a, **k)
if os.environ.get("PROGRESS_ROWS"):  # the run stopped and restarted (the one never stopped: the dropout alone)
    train.Trainer._time_up, train.write_json = time_up, slow_write
from orepa.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # two torchrun launches (the second starts its processes twice)
def test_a_signal_to_one_rank_stops_every_rank_and_torchruns_restart_ends_as_the_run_never_stopped(cache, tmp_path):
    """Two gloo processes, 2 steps an epoch, dropout 0.5 in the network, evaluated every epoch.
    Stopping: only rank 1 receives SIGTERM (during the third step); both stop after that step with
    one mid-epoch checkpoint and exit with 143. Rank 0 writes its summary slowly: torchrun stops the
    other ranks when one exits non-zero, and rank 1 no longer leaves before rank 0 is done (its
    summary, printed once written, is there).
    Restarting: torchrun --max-restarts starts every process again with the first command line,
    which refused the directory its own first start had made ("already holds a run"): the restart
    continues the run its job began, from that mid-epoch checkpoint. (Its process group keeps its
    keys apart from the first start's in torchrun's shared store: it read their dead addresses and
    failed to connect, or hung, in 2 of 4 restarts.)
    Random streams: every rank had the same global random state (seeded alike, never offset), so
    dropout and drop-path dropped the same units on every rank. Each rank draws from seed + rank
    after the model is built alike, checkpoints keep every rank's streams, and the resumed run ends
    bit-identical to one never stopped. The loaders draw their workers' seeds from generators of
    their own: from the global one, the resumed run's new iterator and every evaluation shifted the
    stream the masks are drawn from.
    progress.json's running loss and top-1 are the epoch's over every rank's images: rank 0's own
    were mixed, after a mid-epoch resume, with the checkpoint's sums of all ranks."""
    script = tmp_path / "signal_rank_one.py"
    script.write_text(SIGNAL_RANK_ONE)
    rows = tmp_path / "progress_rows.jsonl"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # the zoo's network, its dropout added by the script (a timm or torchvision network's drop rate: the same
    # masks from the same stream, after about 1.5 s more of imports in each of the six processes)
    argv = ["train", "-m", "resnet18", "--width-mult", "0.0625", "--method", "base", "--train-subset",
            "32", "--val-subset", "16", "-b", "8", "--epochs", "2", "--lr-warmup-epochs", "0", "--no-progress",
            "--no-tensorboard", "--no-curves", "--quiet", "-j", "0", "--cache-dir", cache, "--device", "cpu"]

    def run(*cmd, **env):
        proc = subprocess.run([*launch, *cmd], env=child_env(**env), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    run(str(script), *argv, "--output-dir", str(tmp_path / "whole"))
    out = tmp_path / "parts"
    ckpt_path = out / "checkpoint.pth"
    proc = run("--max-restarts=1", str(script), *argv, "--output-dir", str(out), PROGRESS_ROWS=str(rows))
    first, _, restarted = proc.stdout.partition("torchrun restart 1: the run this job began continues")
    assert restarted.startswith(f" (--resume {ckpt_path})"), proc.stdout[-3000:]
    assert f"stopped: a stop signal received (by another rank); continue with --resume {ckpt_path}" in first
    assert "1/2 (3 steps), stopped: a stop signal received (by another rank)" in first  # rank 0's summary
    assert f"resumed {ckpt_path}: epoch 2, step 1, global step 3, with its settings; no overrides" in restarted
    whole, parts = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "parts"))
    assert whole["global_step"] == parts["global_step"] == 4 and whole["ranks_in_sync"] and parts["ranks_in_sync"]
    assert parts["stop_signal"] is None and parts["weights_sha256"] == whole["weights_sha256"]
    ckpt = _load(ckpt_path)
    ranks = ckpt["rng_ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"])
    # the restart's row at its step (the epoch's last): the epoch's figures, as its history says them
    row, = [r for r in map(json.loads, rows.read_text().splitlines()) if r["start"] == "1" and "loss" in r]
    assert row["global_step"] == 4 and [row["loss"], row["acc1"]] == pytest.approx(
        [ckpt["history"][1]["train_loss"], ckpt["history"][1]["train_acc1"]], rel=1e-9)


# --------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("cmd", ["train", "eval", "reparam", "demo", "export", "analyze"])
def test_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: orepa " + cmd in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"orepa {orepa.__version__}\n"


@pytest.mark.slow
def test_demo_end_to_end_tiny(cache, tmp_path, capsys):
    # (--threads 1: the demo's default, every CPU, spins idle OpenMP threads on a network this small: 3x the CPU time)
    rc = main(["demo", "--width-mult", "0.0625", "--train-subset", "64", "--val-subset", "64", "-b", "16",
               "--output-dir", str(tmp_path / "demo"), "--cache-dir", cache, "--no-progress", "--in-process",
               "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "test top-1, deployed" in out and "params, training form" in out
    assert "the pipelines ran one after the other" in out and "concurrently" not in out  # (--in-process)
    res = json.loads((tmp_path / "demo" / "demo.json").read_text())["results"]
    assert set(res) == {"base", "orepa"}
    for r in res.values():
        assert r["reparam"]["train_form_acc1"] == r["reparam"]["deployed_acc1"]
        assert r["reparam"]["params_deployed"] == res["base"]["reparam"]["params_deployed"]
    # a demo replaces its own runs, never another run in its output dir; a method it cannot build
    # is refused before any pipeline starts
    foreign = tmp_path / "mine"
    assert _train(cache, foreign / "base", "--epochs", "1", "--no-eval", "--method", "base") == 0
    before = (foreign / "base" / "checkpoint.pth").read_bytes()
    capsys.readouterr()
    for argv, msg in (([], f"{foreign / 'base'} holds a run the demo did not make (checkpoint.pth"),
                      (["--methods", "orepa,repvgg"], "unknown method 'repvgg' for resnet18"),
                      (["--jobs", "2"], "--in-process runs the pipelines one after the other in this process")):
        assert main(["demo", "--output-dir", str(foreign), "--cache-dir", cache, "--no-progress", "--in-process",
                     *argv]) == 2
        out = capsys.readouterr()
        assert msg in out.err and "$ orepa train" not in out.out, out
    assert (foreign / "base" / "checkpoint.pth").read_bytes() == before and not (foreign / "orepa").exists()


def test_demo_jobs_beyond_its_methods_leave_no_threads_idle(cache, tmp_path, capsys, monkeypatch):
    """--jobs 3 with one method said "3 pipeline(s) at once" and gave the one pipeline a third of the
    CPUs: the pipelines that run at once are at most the methods."""
    threads = []

    def commands(args, method, out, n):  # (the plan is what is checked: no pipeline runs)
        threads.append(n)
        raise common.UserError("planned")

    monkeypatch.setattr(demo_app, "available_cpus", lambda: 4)
    monkeypatch.setattr(demo_app, "_commands", commands)
    assert main(["demo", "--methods", "base", "--jobs", "3", "--output-dir", str(tmp_path / "d"),
                 "--cache-dir", cache]) == 2
    assert "1 pipeline(s) at once, 4 thread(s) each" in capsys.readouterr().out and threads == [4]


def test_a_demo_rerun_never_replaces_a_run_trained_on_since(cache, tmp_path, capsys):
    """Rerunning the demo put its run back at the demo's epoch after the user had continued it (train
    --resume), without a word. The demo records the checkpoint it left: a run trained on since is
    refused as one the demo did not make; the demo's own run is still replaced by a rerun."""
    demo = ["demo", "--width-mult", "0.0625", "--train-subset", "32", "--val-subset", "16", "-b", "16", "--methods",
            "base", "--output-dir", str(tmp_path / "d"), "--cache-dir", cache, "--no-progress", "--in-process",
            "--threads", "1"]  # (the default, every CPU, spins idle threads on a network this small)
    assert main(demo) == 0
    assert not demo_app._trained_on(tmp_path / "d" / "base")  # its own run: a rerun replaces it
    ckpt = tmp_path / "d" / "base" / "checkpoint.pth"
    assert main(["train", "--resume", str(ckpt), "--epochs", "2", "--no-progress", "--quiet"]) == 0
    before = ckpt.read_bytes()
    capsys.readouterr()
    assert main(demo) == 2
    out = capsys.readouterr()
    assert (f"{tmp_path / 'd' / 'base'} holds a run trained on since the demo made it" in out.err
            and "$ orepa train" not in out.out), out
    assert ckpt.read_bytes() == before and _load(ckpt)["epoch"] == 2


@pytest.mark.slow
def test_the_demo_takes_another_network_as_it_is_built(cache, tmp_path, capsys):
    """``--model timm:NAME`` (or torchvision:NAME), which the demo's unknown-model error offers, was refused
    for the zoo's width and stem options the demo passed on itself; it now trains that network as built
    (--width-mult, given, is refused: it scales the zoo's models)."""
    pytest.importorskip("timm")
    # timm's test_resnet: a ResNet of timm's own, built as timm builds it, at a tenth of resnet10t's weights
    # (which network of a library does not matter here, only that it is one the zoo does not build)
    common = ["--model", "timm:test_resnet", "--train-subset", "32", "--val-subset", "32", "-b", "16",
              "--cache-dir", cache, "--no-progress", "--in-process", "--threads", "1"]  # (test_demo_end_to_end_tiny)
    assert main(["demo", *common, "--output-dir", str(tmp_path / "demo")]) == 0, capsys.readouterr()
    res = json.loads((tmp_path / "demo" / "demo.json").read_text())["results"]
    assert res["orepa"]["reparam"]["train_form_acc1"] == res["orepa"]["reparam"]["deployed_acc1"]
    assert res["orepa"]["reparam"]["params_deployed"] == res["base"]["reparam"]["params_deployed"]
    capsys.readouterr()
    assert main(["demo", *common, "--width-mult", "0.5", "--output-dir", str(tmp_path / "other")]) == 2
    assert "--width-mult scales the zoo's models, not timm:test_resnet" in capsys.readouterr().err


def test_cuda_graphs_are_refused_where_they_cannot_run(cache, tmp_path, capsys):
    capsys.readouterr()
    assert _train(cache, tmp_path / "run", "--epochs", "1", "--cuda-graphs") == 2
    assert "--cuda-graphs needs a CUDA device" in capsys.readouterr().err
    assert _train(cache, tmp_path / "run", "--epochs", "1", "--kernel-graphs") == 2
    assert "--kernel-graphs needs a CUDA device" in capsys.readouterr().err


def test_kernel_graphs_are_refused_beside_whole_step_graphs_and_compiled_steps(cache, tmp_path, capsys, monkeypatch):
    """Recorded kernel builds serve eager steps: on a CUDA device (stood in for; the refusals come
    before any CUDA work) --cuda-graphs or --compile beside --kernel-graphs is a one-line error."""
    real = train.init_distributed
    monkeypatch.setattr(train, "init_distributed", lambda device, **kw: (real("cpu")[0], torch.device("cuda")))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)  # put back after
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    for extra, message in ((["--cuda-graphs"], "--kernel-graphs records the kernel construction of eager steps, "
                                               "--cuda-graphs whole steps (the construction with them): give one"),
                           (["--compile"], "--kernel-graphs and --compile exclude each other")):
        capsys.readouterr()
        assert _train(cache, tmp_path / "run", "--epochs", "1", "--kernel-graphs", *extra) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_graph_capture_puts_back_what_its_warm_up_touched(monkeypatch):
    """No GPU here: a stand-in for make_graphed_callables that, like the real one, runs warm-up
    forward+backward passes on the sample (moving BN statistics, accumulating gradients)."""
    from orepa.models import create_model

    model = create_model("resnet18", "orepa", num_classes=10, in_chans=1, small_input=True, width_mult=0.125).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sample = torch.randn(4, 1, 28, 28)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def fake_make_graphed_callables(m, args):
        for _ in range(3):
            m(*args).sum().backward()
        return m

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_make_graphed_callables)
    train.capture_cuda_graphs(model, sample, opt)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats, num_batches_tracked
    assert all(p.grad is None for p in model.parameters())  # a kept .grad would alias the graph's buffer


def test_a_kept_grad_would_double_a_graphed_backward():
    """Why graphed steps clear gradients to None: a graphed backward returns its static buffer,
    autograd adopts it as ``.grad``, and a zeroed (kept) ``.grad`` then has the next replay's
    gradient added to itself. A Function returning a persistent buffer, as the graphed one does."""
    buf = torch.zeros(3)

    class Replayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p):
            return p * 2

        @staticmethod
        def backward(ctx, g):
            buf.copy_(g * 2)  # the "replay" writes the static gradient buffer
            return buf.detach()

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for set_to_none, want in ((False, 4.0), (True, 2.0)):
        for _ in range(2):
            opt.zero_grad(set_to_none=set_to_none)
            Replayed.apply(p).sum().backward()
        assert p.grad.tolist() == [want] * 3


@pytest.mark.slow
def test_compiled_orepa_training_runs_and_saves_the_plain_model(cache, tmp_path, monkeypatch):
    """``--compile`` on an OREPA model (dynamo once crashed on the online blocks' saved aliases).
    ``aot_eager`` stands in for inductor: the same tracing and forward/backward partition, no
    C++ code generation (minutes on this machine). The network: timm's test_resnet with a one-conv
    stem (stem_type=: 13 convs; the deep stem's two more took about a fifth of the compilation)
    converted to OREPA blocks (the blocks and the engine's hooks the zoo's networks are built of: 3x3,
    1x1 and a 7x7 stem), whose trace is smaller than the zoo's ResNet-18's (two thirds of it with the
    deep stem): the compilation is the test's whole cost."""
    compile_fn = torch.compile
    used = []

    def aot_eager_compile(model, **kwargs):
        used.append(type(model).__name__)
        return compile_fn(model, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", aot_eager_compile)
    torch._dynamo.reset()
    out = tmp_path / "run"
    model = ["--model", "timm:test_resnet", "--model-kwarg", "stem_type=", "--method", "orepa"]
    assert main(["train", *model, *TINY[4:], "--cache-dir", cache, "--output-dir", str(out), "--epochs", "1",
                 "--compile"]) == 0
    assert used == ["ResNet"]
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from orepa import engine
    # the engine's scope hooks, each compiled at most once (one code object served both hooks and was
    # compiled twice, guarded on its arguments' count)
    compiled = [len(_debug_get_cache_entry_list(hook.__call__.__code__))
                for hook in (engine._ScopeHook, engine._ScopeCloseHook)]
    assert max(compiled) <= 1, compiled
    ck = _load(out / "checkpoint.pth")
    assert not any(k.startswith("_orig_mod.") for k in ck["model"])  # the plain model is saved
    assert main(["reparam", str(out / "checkpoint.pth"), "--no-progress", "-j", "0", "--val-subset", "16"]) == 0


def test_the_command_quiets_only_torchs_warning_about_its_own_deprecated_helper():
    """A fresh ``--compile`` run printed torch's FutureWarning about ``_prims_common.check``, which
    inductor's own lowering of ``diagonal`` calls (nothing a user can act on); the same warning
    raised from anywhere else still shows. A ``--compile``d DDP run printed the reducer's warning
    of gradient strides for each 1x1 conv weight whose strides differ only in size-1 dimensions
    (the same layout); a mismatch of strides that lays the data out otherwise still shows."""
    import warnings

    from orepa import cli

    message = "`torch._prims_common.check` is deprecated and will be removed in the future."

    def strides(grad, bucket, sizes="[32, 32, 1, 1]"):  # DDP's reducer's words, as torch 2.x writes them
        return ("Grad strides do not match bucket view strides. This may indicate grad was not created according "
                "to the gradient layout contract, or that the param's strides changed since DDP was constructed.  "
                f"This is not an error, but may impair performance.\ngrad.sizes() = {sizes}, strides() = {grad}\n"
                f"bucket_view.sizes() = {sizes}, strides() = {bucket} (Triggered internally at reducer.cpp:335.)")

    same_layout = strides("[32, 1, 32, 32]", "[32, 1, 1, 1]")  # a 1x1 conv's weight: size-1 dims' strides only
    other = [strides("[32, 1, 1, 32]", "[32, 1, 1, 1]", "[32, 32, 1, 2]"),  # strides that move data
             strides("[1, 32, 32, 32]", "[32, 1, 1, 1]")]  # (a transposed 1x1 weight)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cli._quiet_torch_internals()
        warnings.warn_explicit(message, FutureWarning, "lowering.py", 1, module="torch._inductor.lowering")
        warnings.warn_explicit(message, FutureWarning, "mine.py", 1, module="mine")
        warnings.warn_explicit("another", FutureWarning, "lowering.py", 2, module="torch._inductor.lowering")
        for text in (same_layout, *other):
            warnings.warn_explicit(text, UserWarning, "graph.py", 3, module="torch.autograd.graph")
    assert [(w.filename, str(w.message)) for w in seen] == [("mine.py", message), ("lowering.py", "another"),
                                                             *(("graph.py", text) for text in other)]


def test_the_command_drops_two_of_torchs_logs_about_itself_and_keeps_the_rest(caplog):
    """A --compile'd torchrun run logged dynamo's "Profiler record function ... will be ignored" (DDP's
    forward opens a profiler range) and, on a machine without CUDA, cpp_extension's "No CUDA runtime is
    found" (inductor's CPU compiler uses no CUDA): those two formats are dropped, once however often
    the filters are installed; the loggers' other records pass."""
    import logging

    from orepa import cli

    cli._quiet_torch_internals()
    cli._quiet_torch_internals()
    dynamo, cpp = (logging.getLogger(n) for n in ("torch._dynamo.variables.ctx_manager", "torch.utils.cpp_extension"))
    assert sum(isinstance(f, cli._DropMessage) for f in dynamo.filters) == 1
    for logger in (dynamo, cpp):  # (torch's loggers do not propagate to the root's handlers)
        logger.addHandler(caplog.handler)
    try:
        dynamo.warning("Profiler record function %s will be ignored", torch.autograd.profiler.record_function)
        cpp.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        dynamo.warning("Profiler function %s will be ignored", "f")
        cpp.warning("another %s", "x")
    finally:
        for logger in (dynamo, cpp):
            logger.removeHandler(caplog.handler)
    assert [r.getMessage() for r in caplog.records] == ["Profiler function f will be ignored", "another x"]


def test_eval_warns_of_non_finite_weights(cache, tmp_path, capsys):
    """A checkpoint with NaN weights was evaluated to an accuracy without a word; a warning on
    stderr names the first such tensor (eval still reports: looking at a diverged run is fair)."""
    run = tmp_path / "run"
    assert _train(cache, run, "--epochs", "1", "--no-eval", "--method", "base") == 0
    ckpt = _load(run / "checkpoint.pth")
    ckpt["model"]["fc.weight"].fill_(float("nan"))
    torch.save(ckpt, tmp_path / "nan.pth")
    for path, bad in ((run / "checkpoint.pth", None), (tmp_path / "nan.pth", "parameter fc.weight")):
        capsys.readouterr()
        assert main(["eval", str(path), "--cache-dir", cache, "--val-subset", "16", "--no-progress", "--json",
                     str(tmp_path / "r.json")]) == 0
        out = capsys.readouterr()
        assert ("non-finite" in out.err) == (bad is not None) and "top-1" in out.out
        assert json.loads((tmp_path / "r.json").read_text())["nonfinite"] == bad
    assert f"warning: {tmp_path / 'nan.pth'} holds non-finite values (NaN/inf), first in parameter fc.weight" \
        in out.err


def test_reparam_whose_check_fails_exits_1_and_writes_nothing(cache, tmp_path, capsys, monkeypatch):
    """A failed verification is a failed check, not a usage error: exit code 1 (as export's), said in
    --help; nothing is written."""
    from orepa.apps import reparam

    run = tmp_path / "run"
    assert _train(cache, run, "--epochs", "1", "--no-eval") == 0
    files = sorted(p.name for p in run.iterdir())
    real = reparam.deploy

    def off(model, form):  # a deployment that computes other logits
        out = real(model, form)
        with torch.no_grad():
            out.fc.bias.add_(1.0)
        return out

    monkeypatch.setattr(reparam, "deploy", off)
    capsys.readouterr()
    assert main(["reparam", str(run / "checkpoint.pth"), "--cache-dir", cache, "--val-subset", "16",
                 "--no-progress", "--json", str(tmp_path / "r.json")]) == 1
    assert "outputs differ from the training form's beyond the tolerance; nothing written" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == files and not (tmp_path / "r.json").exists()
    with pytest.raises(SystemExit):
        main(["reparam", "--help"])
    assert "exit code is 1" in " ".join(capsys.readouterr().out.split())


# --------------------------------------------------------------------------- transforms, sampling, evaluation pinned


def _imagefolder_sets(tmp_path):
    """The (train, val) ImageFolders of a tiny tree: train crop 32, val resize 36, val crop 32."""
    _png_tree(tmp_path / "imgs")
    return data.imagefolder(str(tmp_path / "imgs"), 32, 36, 32)


def test_the_imagefolder_train_crop_takes_torchvisions_scale_and_ratio(tmp_path):
    """The training crop is RandomResizedCrop with the paper's (torchvision's) defaults:
    scale (0.08, 1.0), ratio (3/4, 4/3), at --train-crop-size."""
    from torchvision import transforms as T

    train_set, _ = _imagefolder_sets(tmp_path)
    crops = [t for t in train_set.transform.transforms if isinstance(t, T.RandomResizedCrop)]
    assert len(crops) == 1 and tuple(crops[0].size) == (32, 32)
    assert tuple(crops[0].scale) == (0.08, 1.0)
    assert tuple(crops[0].ratio) == pytest.approx((3 / 4, 4 / 3), rel=1e-12)


def test_the_imagefolder_train_augmentation_flips_left_right_never_top_bottom(tmp_path):
    """Over 200 seeded draws of an image whose red grows left to right and green top to bottom,
    30-70% come out mirrored left-right (a horizontal flip) and none upside down."""
    from PIL import Image

    train_set, _ = _imagefolder_sets(tmp_path)
    x = torch.arange(40, dtype=torch.uint8) * 6
    arr = torch.stack([x[None, :].expand(40, 40), x[:, None].expand(40, 40), torch.full((40, 40), 128,
                                                                                        dtype=torch.uint8)], -1)
    img = Image.fromarray(arr.numpy(), "RGB")
    lr = tb = 0
    with torch.random.fork_rng(devices=[]):
        for i in range(200):
            torch.manual_seed(i)
            out = train_set.transform(img)  # normalised: still increasing where the pixels increase
            red, green = out[0], out[1]
            lr += bool(red[:, 0].mean() > red[:, -1].mean())
            tb += bool(green[0, :].mean() > green[-1, :].mean())
    assert 60 <= lr <= 140 and tb == 0, (lr, tb)


def test_the_imagefolder_val_transform_resizes_the_shorter_side_then_centre_crops(tmp_path):
    """A 40x80 (h x w) image: shorter side to --val-resize-size 36 keeping the aspect (36x72), then
    the centre 32x32 crop (rows 2-33, columns 20-51), normalised; not squashed to a square."""
    from PIL import Image
    from torchvision.transforms import functional as TF

    _, val_set = _imagefolder_sets(tmp_path)
    g = torch.Generator().manual_seed(1)
    arr = torch.randint(0, 256, (40, 80, 3), generator=g, dtype=torch.uint8)
    arr[5:15, 50:70] = 255  # an asymmetric mark, right of the centre
    img = Image.fromarray(arr.numpy(), "RGB")
    got = val_set.transform(img)
    resized = TF.pil_to_tensor(TF.resize(img, [36, 72], antialias=True)).float() / 255
    ref = resized[:, 2:34, 20:52]
    mean, std = torch.tensor(data.IMAGENET_MEAN)[:, None, None], torch.tensor(data.IMAGENET_STD)[:, None, None]
    ref = (ref - mean) / std
    assert got.shape == (3, 32, 32)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_a_validation_subset_is_spread_evenly_over_the_classes():
    """--val-subset n takes indices i * len // n (an ImageFolder lists its images class by class;
    the first n would hold the first classes only)."""
    ds = [(i, 0 if i < 5 else 1) for i in range(10)]
    sub = data._subset(ds, 4, None)
    assert list(sub.indices) == [i * 10 // 4 for i in range(4)] == [0, 2, 5, 7]
    assert {y for _, y in sub} == {0, 1}


def test_the_epoch_sampler_yields_the_epoch_it_was_set_to_and_each_epoch_augments_anew(tmp_path):
    """EpochSampler yields (index, epoch) with set_epoch's epoch; SeededAugment gives an index other
    images in epochs 1 and 2, the same image again for the same (index, epoch)."""
    train_set, _ = _imagefolder_sets(tmp_path)
    ds = data.SeededAugment(train_set, seed=0)
    s = data.EpochSampler(ds, num_replicas=1, rank=0, seed=0)
    for epoch in (1, 2):
        s.set_epoch(epoch)
        keys = list(s)
        assert len(keys) == len(ds) == 12
        assert sorted(i for i, _ in keys) == list(range(12)) and {e for _, e in keys} == {epoch}
    for i in range(3):
        assert torch.equal(ds[(i, 1)][0], ds[(i, 1)][0])
        assert not torch.equal(ds[(i, 1)][0], ds[(i, 2)][0])


def test_evaluate_gives_the_top1_top5_and_mean_loss_per_sample_over_uneven_batches():
    """evaluate's loss is the cross-entropy averaged per sample (batches of 4 and 1, not per batch),
    top-5 counts the 5th-ranked class as a hit (7 classes), top-1 the first only."""
    from orepa.apps.evaluate import evaluate

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=g, dtype=torch.float32)
    ranks = [1, 5, 3, 7, 5]  # the rank of each sample's target class
    order = logits.argsort(dim=1, descending=True)
    y = torch.tensor([order[i, r - 1].item() for i, r in enumerate(ranks)])
    model = nn.Linear(7, 7)
    with torch.no_grad():
        model.weight.copy_(torch.eye(7))
        model.bias.zero_()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(logits, y), batch_size=4)
    res = evaluate(model, loader, torch.device("cpu"))
    out = model(logits).detach()
    acc1 = 100.0 * (out.argmax(1) == y).double().mean().item()
    acc5 = 100.0 * (out.topk(5, dim=1).indices == y[:, None]).any(1).double().mean().item()
    assert (acc1, acc5) == (20.0, 80.0) and res["n"] == 5
    assert res["acc1"] == pytest.approx(acc1, rel=1e-6)
    assert res["acc5"] == pytest.approx(acc5, rel=1e-6)
    assert res["loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-6)


@pytest.mark.parametrize("who", ["alone", "this rank", "another rank"])
def test_an_unreadable_validation_image_is_raised_by_every_rank_after_the_all_reduce(who, monkeypatch):
    """The loader's unreadable image (a UserError) is held until the evaluation's one all-reduce: a rank
    raising at once left its peers waiting there (a training run could then not save the epoch, a
    collective save). Every rank raises EvaluationFailed, the one that met the image with its message."""
    from orepa.apps import evaluate as ev

    said = "cannot read image val/cat/3.jpg: truncated (remove or replace the file)"

    class Loader:
        def __init__(self, fail: bool):
            self.fail = fail

        def __len__(self):
            return 2

        def __iter__(self):
            yield torch.randn(2, 3), torch.tensor([0, 1])
            if self.fail:  # alone: as a loader worker's error reaches the process (its original message last)
                raise common.UserError(said if info.distributed else "Caught UserError in DataLoader worker process 0."
                                       "\nOriginal Traceback (most recent call last):\n  File \"data.py\", line 1"
                                       f"\norepa.apps.common.UserError: {said}")
            yield torch.randn(2, 3), torch.tensor([1, 2])

    reduced = []

    def all_reduce(t):  # a peer's sums: 2 images, and whether it failed
        reduced.append(t.clone())
        t += torch.tensor([1.0, 1, 2, 2, 0, float(who == "another rank")], dtype=t.dtype)

    monkeypatch.setattr(ev.dist, "all_reduce", all_reduce)
    info = common.DistInfo(rank=0, world_size=2, distributed=who != "alone")
    with pytest.raises(ev.EvaluationFailed) as err:
        ev.evaluate(nn.Linear(3, 3), Loader(who != "another rank"), torch.device("cpu"), info=info)
    assert str(err.value) == (said if who != "another rank" else
                              "another process of this run could not read an image of the validation set "
                              "(its error names it)")
    assert isinstance(err.value, common.UserError)  # (the command line's one-line error)
    if who != "alone":
        assert len(reduced) == 1 and reduced[0][5] == float(who == "this rank")
        assert reduced[0][3] == (2 if who == "this rank" else 4)  # (the images this rank evaluated)


def test_the_training_criterion_applies_label_smoothing():
    """make_criterion takes --label-smoothing: equal to F.cross_entropy with label_smoothing=0.1."""
    import argparse

    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(6, 5, generator=g), torch.randint(0, 5, (6,), generator=g)
    got = train.make_criterion(argparse.Namespace(label_smoothing=0.1))(logits, y)
    want = nn.functional.cross_entropy(logits, y, label_smoothing=0.1)
    assert abs(got.item() - want.item()) <= 1e-7
    assert abs(want.item() - nn.functional.cross_entropy(logits, y).item()) > 1e-3  # the smoothing matters here


def test_the_no_decay_group_takes_norm_weight_decay_not_wd(cache, tmp_path):
    """The optimizer group "no_decay" (BN, biases) gets --norm-weight-decay (default 0.0), the "decay"
    group --wd, as the checkpoint's optimizer state records after one step."""
    def groups(out, *extra):
        assert _train(cache, out, "--epochs", "1", "--no-eval", "--max-steps", "1", "--wd", "0.001", *extra) == 0
        return {g["name"]: g["weight_decay"] for g in _load(out / "checkpoint.pth")["optimizer"]["param_groups"]}

    default = groups(tmp_path / "a")
    assert default["no_decay"] == 0.0 and default["decay"] == pytest.approx(0.001)
    assert groups(tmp_path / "b", "--norm-weight-decay", "0.03")["no_decay"] == pytest.approx(0.03)


# --------------------------------------------------------------------------- mutation round 3


def _grad_l2(params) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.detach().float().norm() for p in params
                                                 if p.grad is not None])).item()


def test_clip_grad_norm_clips_the_unscaled_l2_norm_with_and_without_float16_scaling(cache, tmp_path, monkeypatch):
    """--clip-grad-norm bounds the L2 norm of the true gradients: under float16 autocast the scaler
    unscales them first (clipping the 65536x scaled ones would leave them ~65536x too small)."""
    real, seen = nn.utils.clip_grad_norm_, []

    def spy(parameters, max_norm, *a, **k):
        params = list(parameters)
        before = _grad_l2(params)
        out = real(params, max_norm, *a, **k)
        seen.append((before, _grad_l2(params)))
        return out

    monkeypatch.setattr(nn.utils, "clip_grad_norm_", spy)
    extra = ("--epochs", "1", "--no-eval", "--max-steps", "1", "--lr-warmup-epochs", "0", "--clip-grad-norm", "0.01")
    assert _train(cache, tmp_path / "fp32", *extra) == 0
    assert _train(cache, tmp_path / "fp16", *extra, "--amp", "--amp-dtype", "float16") == 0
    (fp32_before, fp32_after), (fp16_before, fp16_after) = seen
    assert fp32_before > 0.05  # the clip did act
    assert fp32_after == pytest.approx(0.01, rel=1e-3) and fp16_after == pytest.approx(0.01, rel=1e-3)
    assert fp16_before == pytest.approx(fp32_before, rel=0.05)  # the true gradients', not the scaled ones'


def test_the_default_lr_scales_with_the_global_batch_of_all_processes(cache, tmp_path, monkeypatch):
    """Without --lr the peak rate is 0.1 x global batch / 256: with 2 processes of -b 16 it is
    0.0125, not the 0.00625 of one process's batch."""
    from orepa.apps.common import DistInfo

    monkeypatch.setattr(train, "init_distributed", lambda *a, **k: (DistInfo(rank=0, world_size=2), torch.device("cpu")))
    assert _train(cache, tmp_path / "run", "--epochs", "1", "--no-eval", "--max-steps", "1") == 0
    ck = _load(tmp_path / "run" / "checkpoint.pth")
    assert ck["args"]["lr"] == pytest.approx(0.1 * 32 / 256)


def test_resume_allows_epochs_equal_to_the_finished_ones_and_refuses_fewer_than_begun(cache, tmp_path):
    """A run that finished epoch 1 (at step 0 of epoch 2) has begun 1 epoch: --resume --epochs 1 is
    allowed; one stopped inside epoch 2 has begun 2: --epochs 1 is refused."""
    run = tmp_path / "run"
    # 4 steps an epoch (any network; base builds fastest)
    assert _train(cache, run, "--epochs", "2", "--no-eval", "--max-steps", "4", "--method", "base") == 0
    ck = _load(run / "checkpoint.pth")
    assert (ck["epoch"], ck["step_in_epoch"]) == (1, 0)
    argv = ["--resume", str(run / "checkpoint.pth"), "--epochs", "1"]
    assert train.resumed_args(train._parser().parse_args(argv), ck)[0].epochs == 1
    with pytest.raises(common.UserError, match="--epochs 1 is fewer than the 2 epoch"):
        train.resumed_args(train._parser().parse_args(argv), {**ck, "step_in_epoch": 2})


def test_resuming_an_earlier_epochs_checkpoint_in_its_run_keeps_the_later_states(cache, tmp_path, capsys):
    """--resume DIR/model_1.pth into DIR replaced the run's later checkpoint.pth at its first write
    (and model_2.pth at its epoch 2) without a word. Refused, naming them; continuing from it into
    another --output-dir, or in DIR once they are moved away (or once checkpoint.pth is unreadable:
    the epoch's file is then the way back), runs."""
    run = tmp_path / "run"
    # (which states a directory keeps: any network; base builds fastest)
    assert _train(cache, run, "--epochs", "3", "--no-eval", "--keep-epoch-checkpoints", "--max-steps", "10",
                  "--method", "base") == 0
    latest, later = (run / "checkpoint.pth").read_bytes(), (run / "model_2.pth").read_bytes()
    capsys.readouterr()
    resume = ["train", "--resume", str(run / "model_1.pth"), "--cache-dir", cache]
    assert main(resume) == 2
    assert (f"--resume {run / 'model_1.pth'} (step 4): {run} holds later states of this run (checkpoint.pth, "
            "model_2.pth), which continuing there would replace") in capsys.readouterr().err
    assert (run / "checkpoint.pth").read_bytes() == latest and (run / "model_2.pth").read_bytes() == later
    assert main([*resume, "--output-dir", str(tmp_path / "branch"), "--max-steps", "5"]) == 0
    assert _load(tmp_path / "branch" / "checkpoint.pth")["global_step"] == 5
    (run / "model_2.pth").rename(tmp_path / "model_2.pth")
    (run / "checkpoint.pth").write_bytes(latest[:100])  # torn: nothing left to keep
    assert main([*resume, "--max-steps", "5"]) == 0
    assert _load(run / "checkpoint.pth")["global_step"] == 5


def test_resuming_another_runs_checkpoint_into_a_run_directory_keeps_that_run(cache, tmp_path, capsys):
    """--resume DIR/other.pth, a checkpoint of another run copied into DIR, continued there and replaced
    DIR's run (its checkpoint.pth and logs) without a word when it had fewer steps; with more, it was
    called "later states of this run". Each run records an id that its resumes keep: both are refused,
    naming the other run; the same run resumed in its own directory goes on."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    assert _train(cache, mine, "--epochs", "1", "--no-eval", "--max-steps", "2", "--method", "base") == 0
    assert _train(cache, other, "--epochs", "1", "--no-eval", "--max-steps", "3", "--method", "base") == 0
    ids = {_load(d / "checkpoint.pth")["run_id"] for d in (mine, other)}
    assert len(ids) == 2
    def files():
        return {p.name: p.read_bytes() for p in mine.iterdir() if p.is_file() and p.name != "copied.pth"}
    held = files()
    for steps in (3, 1):  # the copy has more steps than the run there, then fewer
        ck = _load(other / "checkpoint.pth")
        torch.save({**ck, "global_step": steps}, mine / "copied.pth")
        capsys.readouterr()
        assert main(["train", "--resume", str(mine / "copied.pth"), "--cache-dir", cache, "--max-steps", "4"]) == 2
        assert (f"{mine} holds another run (checkpoint.pth, global step 2), which continuing there would replace"
                in capsys.readouterr().err)
        assert files() == held and "checkpoint.pth" in held
    (mine / "copied.pth").unlink()
    assert main(["train", "--resume", str(mine / "checkpoint.pth"), "--cache-dir", cache, "--max-steps", "3"]) == 0
    assert _load(mine / "checkpoint.pth")["run_id"] in ids


@pytest.mark.parametrize("n", [2, 4])
def test_each_micro_batch_loss_is_weighted_by_its_share_of_the_batch(n):
    """_forward_backward over N micro-batches leaves the gradient of the whole batch's mean loss
    (each piece's loss / N), and returns the batch's mean loss and its [loss sum, correct, images]."""
    import argparse
    import contextlib
    import types

    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    x, t = torch.randn(8, 5), torch.randint(0, 3, (8,))
    whole = nn.functional.cross_entropy(model(x), t)
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    fake = types.SimpleNamespace(args=argparse.Namespace(micro_batches=n, amp=False, amp_dtype="auto",
                                                         cuda_graphs=False),
                                 train_model=model, criterion=nn.CrossEntropyLoss(), device=torch.device("cpu"),
                                 scaler=None, info=common.DistInfo())
    fake.train_model.no_sync = contextlib.nullcontext
    loss, sums = train.Trainer._forward_backward(fake, x, t)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    assert loss.item() == pytest.approx(whole.item(), rel=1e-5)
    assert sums[0].item() == pytest.approx(8 * whole.item(), rel=1e-5) and sums[2].item() == 8


def test_pad_crop_flip_takes_every_offset_of_the_padded_image_and_flips_left_right_only():
    """Fashion-MNIST's augmentation: a 28x28 crop of the image zero-padded by 2 on all four sides, at
    any of the 5 x 5 offsets, mirrored left-right (never top-bottom) half the time."""
    img = torch.arange(1, 28 * 28 + 1, dtype=torch.float32).reshape(1, 28, 28)
    padded = nn.functional.pad(img, (2, 2, 2, 2))
    crops = {}
    for i in range(5):
        for j in range(5):
            c = padded[..., i:i + 28, j:j + 28]
            crops[(i, j, False)], crops[(i, j, True)] = c, c.flip(-1)
    t = data.PadCropFlip(28, 2)
    seen = set()
    for seed in range(400):
        torch.manual_seed(seed)
        out = t(img)
        hits = [k for k, c in crops.items() if torch.equal(out, c)]
        assert len(hits) == 1, f"seed {seed}: not a left-right-flipped crop of the zero-padded image"
        seen.add(hits[0])
    assert seen == set(crops)  # every offset, flipped and not


def test_a_seeded_training_subset_depends_on_its_seed():
    """--train-subset N picks N images at random from --seed: the same seed the same images (sorted),
    another seed others."""
    ds = list(range(1000))
    a, b, c = (list(data._subset(ds, 16, seed)) for seed in (1, 1, 2))
    assert a == b and a != c
    assert a == sorted(set(a)) and len(a) == 16 and 0 <= a[0] and a[-1] < 1000


class _Indexed(torch.utils.data.Dataset):
    """Yields the index (a training loader's keys are ``(index, epoch)``)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, key):
        index, epoch = key
        return torch.tensor(index), torch.tensor(epoch)


def test_the_training_loader_shuffles_by_seed_and_epoch_and_drops_the_last_partial_batch():
    """The order of a training epoch is a function of --seed and the epoch (another seed, another
    order); every batch is full: the images left over (70 = 4 x 16 + 6) are dropped."""
    import argparse

    from orepa.apps.common import DistInfo

    def epoch_order(seed, epoch=0):
        d = argparse.Namespace(train=_Indexed(70))
        loader, sampler = data.train_loader(d, argparse.Namespace(seed=seed, batch_size=16, workers=0), DistInfo(),
                                            torch.device("cpu"))
        sampler.set_epoch(epoch)
        batches = [x for x, _ in loader]
        assert len(loader) == 4 and [len(x) for x in batches] == [16] * 4
        return torch.cat(batches).tolist()

    a = epoch_order(0)
    assert a == epoch_order(0) and len(set(a)) == 64
    assert a != epoch_order(1) and a != epoch_order(0, epoch=1)


def test_a_checkpoint_whose_tensor_has_another_shape_is_refused_naming_the_key_and_both_shapes():
    """A state_dict with every key but one tensor of another width (same rank) is a UserError that
    names the key and both shapes, not torch's RuntimeError from load_state_dict."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["0.weight"] = torch.zeros(5, 3, 3, 3)
    assert "1 shape mismatch(es) (0.weight: checkpoint [5, 3, 3, 3] vs model [4, 3, 3, 3])" in \
        ckpt_mod.state_dict_mismatch(model, sd)
    with pytest.raises(common.UserError, match=r"does not fit the model built, net: .*0\.weight: checkpoint \[5, 3, 3, 3\]"):
        ckpt_mod.load_model_state(model, sd, path="x.pth", built="net")


def test_a_checkpoint_read_as_another_method_names_what_it_was_saved_for(tmp_path):
    """A training checkpoint (form "train") of an OREPA ResNet-18 read as a DBB one is refused in that
    form, naming the network built and the one it was saved for; read as itself it loads. EMA weights
    that do not fit were named as the checkpoint's, with a clause repeating the network built."""
    cfg = {"model": "resnet18", "method": "orepa", "num_classes": 10, "in_chans": 1, "small_input": True,
           "width_mult": 0.0625, "options": {}}
    path = tmp_path / "orepa.pth"
    saved = _training_checkpoint(cfg, path, seed=1)
    ckpt = ckpt_mod.load_checkpoint(path)
    model, _, form = ckpt_mod.model_from_checkpoint(ckpt, path)
    assert form == "train" and all(torch.equal(v, saved.state_dict()[k]) for k, v in model.state_dict().items())
    with pytest.raises(common.UserError) as e:
        ckpt_mod.model_from_checkpoint(ckpt, path, cfg={**cfg, "method": "dbb"})
    msg = str(e.value)
    assert "does not fit the model built" in msg and "[train]" in msg and "(it was saved for" in msg
    # EMA weights that do not fit: named as the EMA's, and no clause saying it was saved for the same network
    damaged = {**ckpt, "model_ema": dict(list(ckpt["model"].items())[1:])}
    with pytest.raises(common.UserError) as e:
        ckpt_mod.model_from_checkpoint(damaged, path, use_ema=True)
    msg = str(e.value)
    assert f"checkpoint {path} (its EMA weights) does not fit" in msg and "(it was saved for" not in msg, msg


def test_the_cosine_schedule_decays_from_the_peak_to_the_lr_min_floor():
    """With --lr-min the cosine runs from 1 to lr_min / lr (0.1 of the peak here): 1 at the end of
    the warm-up, 0.55 half-way, 0.1 at the end, never above 1."""
    import argparse

    a = argparse.Namespace(lr_warmup_epochs=2, epochs=10, lr_scheduler="cosine", lr_min=0.01, lr=0.1,
                           lr_warmup_decay=0.01, lr_gamma=0.1, lr_step_size=3)
    f = train.lr_factor_fn(a, iters_per_epoch=10)
    assert [f(20), f(60), f(100)] == pytest.approx([1.0, 0.55, 0.1])
    assert max(f(i) for i in range(101)) == pytest.approx(1.0)


def test_every_command_refuses_a_batch_its_device_cannot_hold_before_it_writes(cache, tmp_path, monkeypatch, capsys):
    """train, eval, reparam, export and bench measure what one image needs and refuse a batch
    needing more than the device has free (here: 1 MiB), naming -b, before any output exists.
    train checks its micro-batch (--micro-batches 16 fits), eval and reparam their batch of the
    validation images (-b larger than the set: the set; under torchrun: the rank's shard)."""
    from orepa.apps import model_cfg

    run = tmp_path / "run"
    assert _train(cache, run, "--epochs", "1", "--no-eval", "--method", "base") == 0
    ckpt = run / "checkpoint.pth"
    monkeypatch.setattr(model_cfg, "free_memory", lambda device: 2**20)
    small = ["--width-mult", "0.0625"]
    cases = {
        "train": (["train", *TINY, "--cache-dir", cache, "--output-dir", str(tmp_path / "t"), "-b", "64"],
                  "-b 64 (64 images a step), fashion-mnist's 28x28 images: a training step of", tmp_path / "t"),
        "eval": (["eval", str(ckpt), "--cache-dir", cache, "--val-subset", "64", "-b", "1000", "--no-progress",
                  "--json", str(tmp_path / "e.json")], "-b 1000 (64 images), fashion-mnist's 28x28 images: an inference of",
                 tmp_path / "e.json"),
        "reparam": (["reparam", str(ckpt), "--cache-dir", cache, "--val-subset", "64", "--no-progress", "-o",
                     str(tmp_path / "r.pth")], "-b 256 (64 images), fashion-mnist's 28x28 images: an inference of",
                    tmp_path / "r.pth"),
        "export": (["export", "--model", "resnet18", "--method", "orepa", *small, "-b", "256", "--input-size", "32",
                    "-o", str(tmp_path / "x.onnx")], "-b 256, --input-size 32 (32x32 images): an inference of",
                   tmp_path / "x.onnx"),
        "bench": (["bench", "-m", "resnet18", "--model-option", "width_mult=0.0625", "-b", "64", "--image-size", "32",
                   "--methods", "base", "orepa", "--output-dir", str(tmp_path / "b")],
                  "-b 64, --image-size 32 (32x32 images): a training step of", tmp_path / "b"),
    }
    for command, (argv, said, output) in cases.items():
        capsys.readouterr()
        assert main(argv) == 2, command
        err = capsys.readouterr().err
        assert said in err and "more than the 1.0 MiB free on " in err and "a smaller batch needs less" in err, err
        assert not output.exists(), command
    # eval under torchrun: each rank's batches are of its shard of the validation set (here rank 1 of
    # 2: 32 of the 64 images, which fit; stood in for, without a process group)
    from orepa.apps import evaluate
    from orepa.apps.common import DistInfo

    monkeypatch.setattr(evaluate, "init_distributed", lambda device, **kw: (DistInfo(rank=1, world_size=2),
                                                                          torch.device("cpu")))
    assert main(cases["eval"][0]) == 0, capsys.readouterr()  # (rank 1 prints and writes nothing)
    assert main(["train", *TINY, "--cache-dir", cache, "--output-dir", str(tmp_path / "t"), "-b", "64",
                 "--micro-batches", "8"]) == 2
    assert "-b 64 --micro-batches 8 (8 images a step)" in capsys.readouterr().err
    assert _train(cache, tmp_path / "t", "-b", "64", "--micro-batches", "16", "--epochs", "1", "--no-eval") == 0


def test_a_resume_turns_off_the_switches_its_run_was_started_with(cache, tmp_path, capsys):
    """--no-eval, --keep-epoch-checkpoints and --sync-bn are run settings that --resume keeps, but they
    had no opposite flag: a run started with them could not be resumed without them. --eval,
    --no-keep-epoch-checkpoints and --no-sync-bn override them like any other setting."""
    run = tmp_path / "run"
    assert _train(cache, run, "--epochs", "2", "--no-eval", "--keep-epoch-checkpoints", "--sync-bn",
                  "--max-steps", "4", "--method", "base") == 0  # the end of epoch 1 of 2 (any network: base is fastest)
    ckpt = run / "checkpoint.pth"
    assert (run / "model_1.pth").is_file() and "val_acc1" not in _load(ckpt)["history"][0]
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--eval", "--no-keep-epoch-checkpoints", "--no-sync-bn",
                 "--no-progress", "--quiet"]) == 0
    assert "overrides: sync_bn True -> False, keep_epoch_checkpoints True -> False, no_eval True -> False" in \
        capsys.readouterr().out
    ck = _load(ckpt)
    assert ck["global_step"] == 8 and "val_acc1" in ck["history"][1] and not (run / "model_2.pth").exists()
    assert {k: ck["args"][k] for k in ("no_eval", "keep_epoch_checkpoints", "sync_bn")} == dict.fromkeys(
        ("no_eval", "keep_epoch_checkpoints", "sync_bn"), False)
    assert "val_acc1" in json.loads((run / "summary.json").read_text())


def test_resume_refuses_another_tools_training_checkpoint_and_names_init_from(cache, tmp_path, capsys):
    """A training checkpoint of torchvision's or timm's reference scripts (model, optimizer, epoch and its
    own flags) was taken for an orepa run without settings: the advice was to give --data-path and the
    run's flags, and with them it "resumed" at that tool's epoch count, global step 0. Its optimizer,
    schedule and position are not an orepa run's: refused in one line, with --init-from for its weights."""
    import argparse

    assert _train(cache, tmp_path / "run", "--epochs", "1", "--no-eval", "--max-steps", "1") == 0
    saved = _load(tmp_path / "run" / "checkpoint.pth")
    other = tmp_path / "torchvision.pth"  # what torchvision's references/classification/train.py saves
    torch.save({"model": saved["model"], "optimizer": saved["optimizer"], "lr_scheduler": saved["lr_scheduler"],
                "epoch": 1, "args": argparse.Namespace(model="resnet18", lr=0.1)}, other)
    out = tmp_path / "continued"
    for extra in ([], ["--data-path", "fashion-mnist", "--cache-dir", cache, *TINY]):
        capsys.readouterr()
        assert main(["train", "--resume", str(other), "--output-dir", str(out), "--no-progress", *extra]) == 2
        err = capsys.readouterr().err
        assert "another tool's training checkpoint" in err and f"--init-from {other}" in err, err
        assert err.count("\n") == 1 and not out.exists()


def test_a_resume_whose_epochs_end_the_run_where_it_stopped_sums_it_up_as_ended(cache, tmp_path, capsys):
    """--epochs N equal to the epochs a stopped run has done ends it there: the command said "ends a
    complete run (1/1 epochs)", then printed the summary of the stopped 3-epoch run (1/3, stopped:
    --max-steps 4 reached). The summary is the ended run's, as --epochs says."""
    run = tmp_path / "run"
    # the end of epoch 1 of 3 (how a run is summed up: any network; base builds fastest)
    assert _train(cache, run, "--epochs", "3", "--no-eval", "--max-steps", "4", "--method", "base") == 0
    ckpt = run / "checkpoint.pth"
    before = ckpt.read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--epochs", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "ends a complete run (1/1 epochs, 4 steps)" in out and "1/1 (4 steps)" in out and "stopped" not in \
        out.split("summary:")[1], out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["epochs_done"], summary["epochs"], summary["stopped"]) == (1, 1, None)
    # the checkpoint says so too (it kept the 3 epochs, and a plain --resume trained two more): the same
    # weights and position, the run's new count
    ended = _load(ckpt)
    assert ended["args"]["epochs"] == 1 and ended["reason"] == "ended" and ckpt.read_bytes() != before
    assert ended["global_step"] == 4 and all(torch.equal(v, ended["model"][k])
                                           for k, v in torch.load(io.BytesIO(before), weights_only=True)["model"].items())
    before = ckpt.read_bytes()
    assert main(["train", "--resume", str(ckpt), "--no-progress"]) == 0
    assert "ends a complete run (1/1 epochs, 4 steps)" in capsys.readouterr().out and ckpt.read_bytes() == before
    # at its step budget with more epochs: a stopped run of as many epochs as the command says
    assert main(["train", "--resume", str(ckpt), "--epochs", "5", "--max-steps", "4", "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["epochs_done"], summary["epochs"], summary["stopped"]) == (1, 5, "--max-steps 4 reached")
    assert ckpt.read_bytes() == before  # nothing trained: the checkpoint is the run's
