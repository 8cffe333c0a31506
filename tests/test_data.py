"""Reading an ImageFolder tree (``orepa.apps.data.imagefolder``): what the tree holds is read once, each
image under its own class, or the command says what is wrong with the tree."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from orepa.apps.common import UserError
from orepa.apps.data import imagefolder
from orepa.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("one_thread")


def tree(root: Path, per_class: int = 3) -> Path:
    """``root/{train,val}/{a,b}/*.png``: 8x8 images."""
    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / split / c / f"{i}.png")
    return root


def read(root: Path):
    return imagefolder(str(root), train_crop=8, val_resize=8, val_crop=8)


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links on this system")
def test_a_folder_reached_twice_through_links_is_refused_a_linked_class_folder_is_read(tmp_path):
    """A link back to a folder above it (``val/a/up -> ..``) made torchvision's ImageFolder walk the
    loop 40 levels deep: 328 validation images from 6, every one labelled ``a``, and an evaluation at
    98.8%; a link to a folder the tree holds already read its images twice under the link's class.
    Both are named; a class folder linked from elsewhere (another disk) is read as before."""
    root = tree(tmp_path / "d")
    train, val = read(root)
    assert (len(train), len(val)) == (6, 6)

    (root / "val" / "a" / "up").symlink_to("..")
    with pytest.raises(UserError, match=r"^--data-path .*: val/: the symbolic link .*val/a/up leads to .*val, a "
                                        r"folder above it \(a loop\): its images would be read again"):
        read(root)
    (root / "val" / "a" / "up").unlink()

    (root / "train" / "b" / "again").symlink_to(root / "train" / "a", target_is_directory=True)
    with pytest.raises(UserError, match=r"train/: the symbolic link .*train/b/again leads to .*train/a, which the "
                                        r"tree holds already"):
        read(root)
    (root / "train" / "b" / "again").unlink()

    elsewhere = tree(tmp_path / "disk2", per_class=2) / "val" / "b"
    for split in ("train", "val"):
        (root / split / "c").symlink_to(elsewhere, target_is_directory=True)
    train, val = read(root)
    assert (len(train), len(val)) == (8, 8) and val.classes == ["a", "b", "c"]
    assert sorted(t for _, t in val.samples).count(2) == 2


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links on this system")
def test_the_command_line_says_the_loop_in_one_line(tmp_path, capsys):
    root = tree(tmp_path / "d")
    (root / "val" / "a" / "up").symlink_to("..")
    code = cli_main(["train", "--data-path", str(root), "--width-mult", "0.125", "--epochs", "1", "-b", "2",
                     "--train-crop-size", "8", "--val-resize-size", "8", "--val-crop-size", "8", "--no-progress",
                     "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "a folder above it (a loop)" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoint.pth").exists()


def test_hidden_files_and_folders_are_not_read(tmp_path):
    """What a Mac, Jupyter or git leave in a tree: an AppleDouble ``._0.png`` (not an image) ended a
    run when its turn came; a hidden folder next to the classes (``.ipynb_checkpoints``, empty) stopped
    every command ("Found no valid file for the classes .ipynb_checkpoints"), one holding an image
    (``train/.git``) was a class of its own, and a hidden folder inside a class (``.thumbnails``) had its
    images trained as that class. Names beginning with a dot are skipped, as ``ls`` does."""
    root = tree(tmp_path / "d")
    for split in ("train", "val"):
        (root / split / ".ipynb_checkpoints").mkdir()
        (root / split / "a" / "._0.png").write_bytes(b"\x00\x05\x16\x07AppleDouble")
    (root / "train" / ".git").mkdir()
    Image.new("RGB", (8, 8)).save(root / "train" / ".git" / "x.png")
    (root / "train" / "b" / ".thumbnails").mkdir()
    Image.new("RGB", (4, 4)).save(root / "train" / "b" / ".thumbnails" / "0.png")
    train, val = read(root)
    assert train.classes == val.classes == ["a", "b"]
    assert [Path(p).relative_to(root).as_posix() for p, _ in train.samples] == [
        f"train/{c}/{i}.png" for c in ("a", "b") for i in range(3)]
    assert len(val) == 6 and all(x.shape == (3, 8, 8) for x, _ in val)


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links on this system")
def test_only_names_inside_the_tree_are_judged_hidden(tmp_path):
    """A tree kept under a dot folder (``~/.cache/datasets/...``) is read whole: only the names below the
    split folder count. A hidden link to a class folder (a ``.latest`` alias) is skipped as any hidden
    folder is, not refused as a folder read twice."""
    root = tree(tmp_path / ".cache" / "d")
    (root / "train" / ".latest").symlink_to(root / "train" / "a", target_is_directory=True)
    train, val = read(root)
    assert train.classes == val.classes == ["a", "b"] and len(train) == len(val) == 6


def test_a_class_folder_without_images_is_named_with_the_extensions_read(tmp_path):
    root = tree(tmp_path / "d")
    (root / "train" / "c").mkdir()
    (root / "val" / "c").mkdir()
    (root / "train" / "c" / "._0.jpg").write_bytes(b"\x00")
    (root / "val" / "c" / "0.gif").write_bytes(b"GIF89a")
    with pytest.raises(UserError, match=r"^--data-path .*: train/: Found no valid file for the classes c\. "
                                        r"Supported extensions are: \.jpg, \.jpeg, \.png"):
        read(root)


def test_images_outside_the_class_folders_are_named(tmp_path):
    """ImageNet's validation images as distributed lie flat in val/: torchvision said only "Couldn't find
    any class folder"; a half-sorted val/ (class folders, and images still beside them) was read without
    the loose images, the accuracy measured on what happened to be sorted. Both name the images."""
    root = tree(tmp_path / "d")
    for i in (1, 2):
        Image.new("RGB", (8, 8)).save(root / "val" / f"ILSVRC2012_val_{i:08d}.JPEG")
    with pytest.raises(UserError, match=r"^--data-path .*: val/: 2 images lie in .*val itself, outside any class "
                                        r"folder \(ILSVRC2012_val_00000001\.JPEG, ILSVRC2012_val_00000002\.JPEG\): "
                                        r"an image's class is the folder it is in$"):
        read(root)
    for c in ("a", "b"):
        for f in (root / "val" / c).iterdir():
            f.unlink()
        (root / "val" / c).rmdir()
    with pytest.raises(UserError, match=r"val/: 2 images lie in .*val itself, outside any class folder .*: an image's "
                                        r"class is the folder it is in; sort them into one folder per class "
                                        r"\(ImageNet's validation images come flat, their classes in the devkit's "
                                        r"ground truth\)$"):
        read(root)


def test_validation_images_are_torchvisions_resize_and_crop_and_a_thin_one_is_resized_where_its_crop_lies(
        tmp_path, monkeypatch):
    """The validation transform is torchvision's Resize(256) + CenterCrop(224), pixel for pixel. A thin
    image (a 3 x 900 banner) was resized whole first: 256 x 76,800 pixels here, 1,024,000 for a 4 x 16000
    one (750 MB in a loader worker) for a 224 x 224 crop. It is resized only where the crop lies, within
    one level of the whole resize's pixels."""
    import numpy as np
    from torchvision import transforms as T

    from orepa.apps.data import ResizeCentreCrop

    rng = np.random.default_rng(0)
    reference = T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224)])
    mine = ResizeCentreCrop(256, 224)
    for w, h in ((300, 257), (256, 900), (640, 480), (225, 224), (40, 640)):  # (16:1 at most: resized whole)
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        assert np.array_equal(np.asarray(mine(img)), np.asarray(reference(img))), (w, h)
    sizes = []
    resize = Image.Image.resize
    monkeypatch.setattr(Image.Image, "resize", lambda self, size, *a, **k: sizes.append(size) or resize(
        self, size, *a, **k))
    for w, h in ((3, 900), (900, 3), (17, 280)):
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        sizes.clear()
        got = np.asarray(mine(img)).astype(int)
        assert sizes == [(224, 224)], sizes
        want = np.asarray(reference(img)).astype(int)
        assert got.shape == want.shape == (224, 224, 3) and np.abs(got - want).max() <= 1, (w, h)
    # read from a tree: the 4 x 16000 banner resized to 224 x 224 alone
    root = tree(tmp_path / "d")
    Image.new("RGB", (4, 16000), (90, 10, 10)).save(root / "val" / "a" / "banner.png")
    _, val = imagefolder(str(root))
    sizes.clear()
    x, y = val[[p for p, _ in val.samples].index(str(root / "val" / "a" / "banner.png"))]
    assert tuple(x.shape) == (3, 224, 224) and y == 0 and sizes == [(224, 224)]


def test_class_names_written_two_ways_in_unicode_are_one_class(tmp_path):
    """A class folder named on a Mac is stored decomposed (NFD: ``e`` + a combining accent), the same
    name made elsewhere composed (NFC: one code point). train/ of one and val/ of the other were refused
    as "different class folders (only in train/: éclair; only in val/: éclair)", and a checkpoint's
    names as written matched nothing of the other tree. Names are compared in NFC; sorted as written
    (torchvision's labels), ``e`` + accent comes before ``fig`` and ``é`` after it: val's labels are
    train's, by name."""
    from orepa.apps.data import Data

    nfd, nfc = "e\u0301clair", "\u00e9clair"
    for split, names in (("train", (nfd, "fig")), ("val", (nfc, "fig"))):
        for i, c in enumerate(names):
            (tmp_path / split / c).mkdir(parents=True)
            Image.new("RGB", (8, 8), (100 * i, 0, 0)).save(tmp_path / split / c / "0.png")
    train, val = read(tmp_path)
    assert train.classes == val.classes == [nfc, "fig"]
    labels = {Path(p).parent.name: t for p, t in train.samples}
    assert labels == {nfd: 0, "fig": 1}
    assert sorted(val[i][1] for i in range(len(val))) == [0, 1]
    assert {Path(val.ds.samples[i][0]).parent.name: val[i][1] for i in range(len(val))} == {nfc: 0, "fig": 1}
    # a checkpoint that kept the names as written (NFD) reads this data by name
    data = Data("imagefolder", None, val, 2, 3, False, classes=tuple(val.classes))
    assert data.read_as([nfd, "fig"], "ckpt") is data
    flipped = data.read_as(["fig", nfd], "ckpt")
    assert [flipped.val[i][1] for i in range(len(val))] == [1 - val[i][1] for i in range(len(val))]
    # one name written both ways in one split: two folders that cannot be told apart by their names
    try:
        (tmp_path / "val" / nfd).mkdir()
    except FileExistsError:  # a file system that compares names in one form (APFS) holds one folder of both
        return
    Image.new("RGB", (8, 8)).save(tmp_path / "val" / nfd / "0.png")
    with pytest.raises(UserError, match="are one name written two ways .*merge them"):
        read(tmp_path)
