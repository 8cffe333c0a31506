"""Datasets, transforms, samplers and loaders for ``orepa train`` / ``eval``.

Two sources:

* ``--data-path fashion-mnist`` (default): the Debian package
  ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist/*.gz``), un-gzipped
  once into ``<cache-dir>/FashionMNIST/raw/`` (the layout torchvision's ``FashionMNIST``
  reads; read here as tensors). 1 channel, 28x28, 10 classes. Train transform: random 28x28
  crop of the image zero-padded by 2, horizontal flip, normalisation; test: only
  normalisation. The images stay tensors (no PIL), which keeps data loading
  negligible next to the model on a CPU.
* ``--data-path DIR``: an ImageNet-style ``ImageFolder`` tree ``DIR/train/<class>/*``
  and ``DIR/val/<class>/*`` with the paper's pre-processing: RandomResizedCrop 224 +
  flip + normalisation for training, resize 256 + centre crop 224 for validation.

Determinism: the training sampler (a :class:`~torch.utils.data.DistributedSampler`,
also with one process) shuffles with ``seed + epoch`` and yields ``(index, epoch)``;
the dataset wrapper seeds the random augmentation of every sample from
``(seed, epoch, index)``. The whole input pipeline is therefore a pure function of
the seed, the epoch and the position in it, independent of the number of loader
workers and of where a run was interrupted: ``--resume`` from a mid-epoch
checkpoint skips the samples already seen and continues with the very same batches.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import os
import signal
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from .checkpoint import atomic_write
from .common import (
    STOP_SIGNALS,
    DistInfo,
    UserError,
    available_cpus,
    class_name,
    error_text,
    long_flag,
    nonneg_int,
    path_arg,
    per_cpu_cap,
    positive_int,
    some_of,
)

FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
)
#: bytes of each un-gzipped IDX file (16- / 8-byte header, then 28x28 images / labels): a cached file of
#: another size is a torn or foreign copy, extracted again
FASHION_MNIST_TRAIN, FASHION_MNIST_TEST = 60000, 10000  # images
FASHION_MNIST_BYTES = dict(zip(FASHION_MNIST_FILES, (16 + FASHION_MNIST_TRAIN * 784, 8 + FASHION_MNIST_TRAIN,
                                                     16 + FASHION_MNIST_TEST * 784, 8 + FASHION_MNIST_TEST)))
FASHION_MNIST_SOURCE = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
#: the paper's ImageFolder sizes: RandomResizedCrop for training; resize, then centre crop, for validation
TRAIN_CROP, VAL_RESIZE, VAL_CROP = 224, 256, 224
FASHION_MNIST_NAMES = ("fashion-mnist", "fashion_mnist", "fashionmnist", "fmnist")


def saved_val_sizes(saved: dict) -> tuple[int, int]:
    """``(resize, crop)`` of the validation images a run's recorded flags (a checkpoint's ``args``) say,
    the defaults where they say nothing: what eval's data and an export's preprocessing are made of."""
    return int(saved.get("val_resize_size") or VAL_RESIZE), int(saved.get("val_crop_size") or VAL_CROP)


def default_cache_dir() -> Path:
    if os.environ.get("OREPA_CACHE"):
        return Path(os.environ["OREPA_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # (the XDG spec: empty is unset, and a relative path is ignored; it would be the current directory's)
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "orepa"


def add_cache_dir_argument(p) -> None:
    """``--cache-dir``, Fashion-MNIST's cache: one flag for every command and script that reads it."""
    p.add_argument("--cache-dir", type=path_arg, default=None,
                   help="where Fashion-MNIST is un-gzipped once (default $OREPA_CACHE or ~/.cache/orepa)")


def add_data_arguments(p: argparse.ArgumentParser, training_set: bool = True) -> None:
    """The data flags; without ``training_set`` (commands that read the validation set only) not
    those of the training set, which such a command would accept and ignore."""
    g = p.add_argument_group("data")
    g.add_argument("--data-path", type=path_arg, default="fashion-mnist",
                   help="'fashion-mnist' (default; Debian package dataset-fashion-mnist) or an ImageFolder root "
                        "holding train/ and val/")
    g.add_argument("--dataset", choices=["auto", "fashion-mnist", "imagefolder"], default="auto",
                   help="how to read --data-path (auto: 'fashion-mnist' by name, else ImageFolder)")
    add_cache_dir_argument(g)
    g.add_argument("-j", "--workers", type=nonneg_int, default=None,
                   help="data loading processes per rank (default: 0 for Fashion-MNIST on CPU, else min(8, CPUs))")
    if training_set:
        g.add_argument("--train-subset", type=positive_int, default=None,
                       help="train on a fixed random subset of N images")
    g.add_argument("--val-subset", type=positive_int, default=None,
                   help="evaluate on N validation images spread evenly over the set (every class of a "
                        "folder), the same ones every time")
    if training_set:
        g.add_argument("--train-crop-size", type=positive_int, default=TRAIN_CROP,
                       help="ImageFolder: RandomResizedCrop size")
    g.add_argument("--val-resize-size", type=positive_int, default=VAL_RESIZE, help="ImageFolder: validation resize")
    g.add_argument("--val-crop-size", type=positive_int, default=VAL_CROP, help="ImageFolder: validation centre crop")
    if training_set:
        g.add_argument("--pad-crop", type=nonneg_int, default=2, help="Fashion-MNIST: zero padding of the random crop")


# --------------------------------------------------------------------------- Fashion-MNIST


def prepare_fashion_mnist(cache_dir: str | os.PathLike | None = None, source: str | None = None) -> Path:
    """Un-gzip the Debian package's files into ``cache_dir/FashionMNIST/raw`` (once, and again for a
    cached file that is torn, foreign or has a damaged header or label); return ``cache_dir``.

    Safe under concurrency (several ranks): each file is written to a temporary
    name and renamed into place.
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    source = Path(source or os.environ.get("OREPA_FASHION_MNIST_DIR") or FASHION_MNIST_SOURCE)  # set empty: unset
    raw = root / "FashionMNIST" / "raw"
    missing = [n for n in FASHION_MNIST_FILES if _cached_idx_problem(raw / n, n) is not None]
    if not missing:
        return root
    absent = [n for n in missing if not (source / f"{n}.gz").is_file()]
    if absent:
        raise UserError(
            f"Fashion-MNIST not found: {source}/{absent[0]}.gz is missing. Install it with "
            "`sudo apt-get install dataset-fashion-mnist` (or run scripts/setup.sh), set OREPA_FASHION_MNIST_DIR "
            "to a directory holding the four *-ubyte.gz files, or pass --data-path DIR for an ImageFolder tree"
        )
    for name in missing:
        gz = source / f"{name}.gz"
        try:
            with gzip.open(gz, "rb") as src:
                data = src.read()
        except (OSError, EOFError, zlib.error) as exc:  # not gzip (BadGzipFile), truncated, damaged
            raise UserError(f"Fashion-MNIST file {gz} cannot be read ({type(exc).__name__}: {exc or 'truncated'}); "
                            "reinstall it (`sudo apt-get install --reinstall dataset-fashion-mnist`) or point "
                            "OREPA_FASHION_MNIST_DIR at good copies") from None
        problem = _idx_problem(name, len(data), data)
        if problem:
            raise UserError(f"Fashion-MNIST file {gz} is not its {name} ({problem}); reinstall it (`sudo apt-get "
                            "install --reinstall dataset-fashion-mnist`) or point OREPA_FASHION_MNIST_DIR at good "
                            "copies")
        atomic_write(raw / name, lambda dst: dst.write(data))
    return root


def _idx_problem(name: str, size: int, head: bytes) -> str | None:
    """What makes a file of ``size`` bytes that begins with ``head`` not Fashion-MNIST's IDX file
    ``name`` (its size; its header: magic number and shape; a label outside 0-9, for which ``head``
    holds the whole label file), else None. A pixel's damage cannot be told from an image."""
    if size != FASHION_MNIST_BYTES[name]:
        return f"{size} bytes, not {FASHION_MNIST_BYTES[name]}"
    labels = "labels" in name
    n = (size - (8 if labels else 16)) // (1 if labels else 784)
    header = struct.pack(">II", 2049, n) if labels else struct.pack(">IIII", 2051, n, 28, 28)
    if head[:len(header)] != header:
        return "another IDX header"
    if labels and max(head[8:]) > 9:
        return "a label outside 0-9"
    return None


def _cached_idx_problem(path: Path, name: str) -> str | None:
    """:func:`_idx_problem` of an un-gzipped file in the cache (a torn or foreign copy is extracted
    again)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(FASHION_MNIST_BYTES[name] if "labels" in name else 16)
    except OSError as exc:
        return exc.strerror or str(exc)
    return _idx_problem(name, size, head)


class PadCropFlip:
    """Random crop of a zero-padded uint8 tensor image + horizontal flip (uses the torch RNG)."""

    def __init__(self, size: int, padding: int, flip: bool = True):
        self.size, self.padding, self.flip = size, padding, flip

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        p = self.padding
        if p:
            img = torch.nn.functional.pad(img, (p, p, p, p))
        h, w = img.shape[-2:]
        i = int(torch.randint(0, h - self.size + 1, ()))
        j = int(torch.randint(0, w - self.size + 1, ()))
        img = img[..., i:i + self.size, j:j + self.size]
        if self.flip and torch.rand(()) < 0.5:
            img = img.flip(-1)
        return img


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return (img.float() / 255.0 - self.mean) / self.std


class Resize:
    """A square image of floats resized to ``size`` x ``size`` as torchvision's ``Resize`` does (bilinear,
    antialiased): what an export made for another input size than Fashion-MNIST's 28 records it takes."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.interpolate(img[None], size=(self.size, self.size), mode="bilinear",
                                               align_corners=False, antialias=True)[0]


class Compose:
    def __init__(self, *fns):
        self.fns = fns

    def __call__(self, x):
        for f in self.fns:
            x = f(x)
        return x


class Relabeled(Dataset):
    """``ds`` with label ``y`` read as ``index[y]`` (another class order: ``classes``)."""

    def __init__(self, ds: Dataset, index: Sequence[int], classes: Sequence[str] = ()):
        self.ds, self.index, self.classes = ds, list(index), list(classes)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        x, y = self.ds[i]
        return x, self.index[y]


class TensorImages(Dataset):
    """uint8 images ``[N, H, W]`` or ``[N, C, H, W]`` + int labels, transformed per sample."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, transform, classes):
        self.images = images if images.dim() == 4 else images.unsqueeze(1)
        self.targets = targets.long()
        self.transform, self.classes = transform, list(classes)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), int(self.targets[i])


#: Fashion-MNIST's class names in label order (torchvision's ``FashionMNIST.classes``)
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")


def _read_idx(path: Path) -> torch.Tensor:
    """The uint8 images ``[N, 28, 28]`` or labels ``[N]`` of an un-gzipped IDX file that
    :func:`prepare_fashion_mnist` checked (size, header, labels). Read here, not by torchvision's
    ``FashionMNIST``: the same bytes, without importing torchvision, whose ops import torch._dynamo
    (about 2 s of a 2-core CPU's ``orepa eval`` start; a process that builds a torch optimizer
    imports dynamo anyway)."""
    labels = "labels" in path.name
    buf = bytearray(path.stat().st_size)
    with open(path, "rb") as f:  # (into one writable buffer: the tensor shares it, no copy)
        f.readinto(buf)
    body = torch.frombuffer(buf, dtype=torch.uint8, offset=8 if labels else 16)
    return body if labels else body.view(-1, 28, 28)


def fashion_mnist(cache_dir, pad_crop: int = 2, val_size: int = 28) -> tuple[Dataset, Dataset]:
    """``(train, val)``; ``val_size``: the validation images resized to it (an export's input size)."""
    if pad_crop >= 28:  # a crop could then hold no pixel of the image
        raise UserError(f"--pad-crop {pad_crop}: the padding must be smaller than Fashion-MNIST's 28-pixel images "
                        "(the default: 2)")
    root = prepare_fashion_mnist(cache_dir)
    raw, sets = root / "FashionMNIST" / "raw", []
    for train in (True, False):
        images, labels = (n for n in FASHION_MNIST_FILES if n.startswith("train" if train else "t10k"))
        norm = Normalize(FASHION_MNIST_MEAN, FASHION_MNIST_STD)
        tf = Compose(PadCropFlip(28, pad_crop), norm) if train else (
            norm if val_size == 28 else Compose(norm, Resize(val_size)))
        sets.append(TensorImages(_read_idx(raw / images), _read_idx(raw / labels), tf, FASHION_MNIST_CLASSES))
    return sets[0], sets[1]


# --------------------------------------------------------------------------- ImageFolder


def imagefolder(root: str, train_crop: int = TRAIN_CROP, val_resize: int = VAL_RESIZE, val_crop: int = VAL_CROP,
                need_train: bool = True):
    """``(train, val)`` ImageFolders with the paper's transforms; ``train`` is None unless ``need_train``
    (scanning ImageNet's train/ takes a while, and eval/reparam do not need it)."""
    from torchvision import transforms as T

    root_p = Path(root)
    missing = [d for d in (("train", "val") if need_train else ("val",)) if not (root_p / d).is_dir()]
    if missing:
        wanted = (f"{root}/train/<class>/*.jpg and {root}/val/<class>/*.jpg" if need_train else
                  f"{root}/val/<class>/*.jpg (this command reads the validation set only)")
        raise UserError(f"--data-path {root}: expected an ImageFolder tree with {wanted}; missing: "
                        f"{', '.join(str(root_p / d) for d in missing)}"
                        + (" (--dataset imagefolder reads a tree: give its --data-path)" if str(root) == "fashion-mnist"
                           else " (or use --data-path fashion-mnist)"))
    if val_crop > val_resize:  # torchvision's CenterCrop pads what the image lacks with zeros
        raise UserError(f"--val-crop-size {val_crop} is larger than --val-resize-size {val_resize}: the validation "
                        "crop would take black borders (the paper: resize 256, crop 224)")
    norm = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = T.Compose([T.RandomResizedCrop(train_crop, antialias=True), T.RandomHorizontalFlip(),
                          T.PILToTensor(), T.ConvertImageDtype(torch.float), norm])
    val_tf = T.Compose([ResizeCentreCrop(val_resize, val_crop), T.PILToTensor(), T.ConvertImageDtype(torch.float),
                        norm])
    def folder(split: str, tf):
        again = _folder_read_twice(root_p / split)
        if again:
            link, first = again
            raise UserError(f"--data-path {root}: {split}/: the symbolic link {link} leads to {first}, "
                            + ("a folder above it (a loop)" if link.is_relative_to(first) else "which the tree holds "
                               "already") + ": its images would be read again, labelled as the class the link is in; "
                            "remove the link")
        try:
            return ImageFolder(str(root_p / split), tf)
        except (FileNotFoundError, RuntimeError) as exc:  # torchvision's message names no split
            raise UserError(f"--data-path {root}: {split}/: {exc}") from None

    train = folder("train", train_tf) if need_train else None
    val = folder("val", val_tf)
    if train is not None and train.classes != val.classes and sorted(train.classes) == sorted(val.classes):
        # the same names, written one way in one split and the other way in the other (a Mac's NFD): sorted
        # as written (torchvision's labels), their order can differ; val's labels are train's, by name
        val = Relabeled(val, [train.classes.index(c) for c in val.classes], train.classes)
    if train is not None and train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise UserError(f"--data-path {root}: train/ and val/ have different class folders ("
                        + "; ".join(f"only in {where}/: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                                    for where, names in (("train", only_train), ("val", only_val)) if names) + ")")
    if train is not None and len(train.classes) < 2:
        raise UserError(f"--data-path {root}: train/ has {len(train.classes)} class folder "
                        f"({', '.join(train.classes)}); a classifier needs at least 2")
    return train, val


class ResizeCentreCrop:
    """torchvision's ``Resize(resize)`` (the shorter side to ``resize``), then ``CenterCrop(crop)``, of a PIL
    image: the paper's validation images. A thin image (its long side over :attr:`THIN` times its short
    one) is resized only where the crop lies: resized whole, a 4 x 16000 banner became 256 x 1,024,000
    pixels (750 MB) for a 224 x 224 crop. Its pixels then differ from the whole resize's by at most one
    level in 255 (Pillow rounds the box's coefficients otherwise); every other image's are torchvision's."""

    THIN = 16  # (its resized image: at most 256 x 4096 x 3 bytes, 3 MB, at the paper's sizes)

    def __init__(self, resize: int, crop: int):
        from torchvision import transforms as T

        if crop > resize:  # (imagefolder refuses it first; the box below assumes the crop fits)
            raise ValueError(f"crop {crop} > resize {resize}")
        self.resize, self.crop = resize, crop
        self.whole = T.Compose([T.Resize(resize, antialias=True), T.CenterCrop(crop)])

    def __call__(self, img):
        from PIL import Image

        w, h = img.size
        if max(w, h) <= self.THIN * min(w, h):
            return self.whole(img)
        # torchvision's size of the resized image and its centre crop's place (Resize, CenterCrop)
        long = int(self.resize * max(w, h) / min(w, h))
        rw, rh = (self.resize, long) if w <= h else (long, self.resize)
        top, left = int(round((rh - self.crop) / 2.0)), int(round((rw - self.crop) / 2.0))
        sx, sy = w / rw, h / rh  # (Pillow's filters reach past the box into the image, as the whole resize's)
        box = (left * sx, top * sy, (left + self.crop) * sx, (top + self.crop) * sy)
        return img.resize((self.crop, self.crop), Image.BILINEAR, box=box)


def _hidden(name: str) -> bool:
    """A dot file or folder (a Mac's ``.DS_Store`` and ``._x.jpg``, ``.ipynb_checkpoints``, ``.git``): not the
    data's, skipped as ``ls`` skips it."""
    return name.startswith(".")


def _visible_image(top: str, path: str) -> bool:
    """Whether ``path``, under the split folder ``top``, is an image ImageFolder reads: torchvision's
    extensions, no hidden file or folder on the way to it."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

    below = path[len(top):] if path.startswith(top) else os.path.relpath(path, top)  # (fast: ImageNet's 1.3M)
    return has_file_allowed_extension(path, IMG_EXTENSIONS) and not any(map(_hidden, below.split(os.sep)))


class ImageFolder(Dataset):
    """torchvision's ``ImageFolder`` (``root/<class>/**/<image>``, classes in name order, links followed; its
    ``classes``, ``class_to_idx``, ``samples`` and ``targets``) without hidden files and folders, each image
    read by :func:`load_image`. Errors as torchvision's (FileNotFoundError)."""

    def __init__(self, root: str, transform):
        from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

        self.root, self.transform = root, transform
        with os.scandir(root) as entries:
            entries = list(entries)
        # in torchvision's order (of the names as written), each name as orepa compares it (class_name)
        folders = sorted(e.name for e in entries if e.is_dir() and not _hidden(e.name))
        self.classes = [class_name(f) for f in folders]
        if len(set(self.classes)) < len(folders):
            twice = [f for f in folders if self.classes.count(class_name(f)) > 1]
            raise FileNotFoundError(f"the class folders {some_of(map(ascii, twice), 4)} of {root} are one name written "
                                    "two ways (Unicode NFC and NFD, as a Mac writes it): merge them into one folder")
        loose = sorted(e.name for e in entries if not e.is_dir() and _visible_image(root, e.path))
        if loose:  # (torchvision reads no image there: ImageNet's flat val/, or one half sorted, read in part)
            raise FileNotFoundError(
                f"{len(loose)} image{'s lie' if len(loose) > 1 else ' lies'} in {root} itself, outside any class "
                f"folder ({some_of(loose, 2)}): an image's class is the folder it is in" + (
                    "" if self.classes else "; sort them into one folder per class (ImageNet's validation images come "
                                            "flat, their classes in the devkit's ground truth)"))
        if not self.classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = make_dataset(root, {f: i for i, f in enumerate(folders)},
                                    is_valid_file=partial(_visible_image, root), allow_empty=True)
        self.targets = [t for _, t in self.samples]
        empty = sorted(set(self.classes) - {self.classes[t] for t in set(self.targets)})
        if empty:
            raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)}. Supported extensions "
                                    f"are: {', '.join(IMG_EXTENSIONS)}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, target = self.samples[i]
        return self.transform(load_image(path)), target


def _folder_read_twice(top: Path) -> tuple[Path, Path] | None:
    """A folder of the tree under ``top`` that symbolic links lead to twice, as ``(the second way to it, the
    first)``; None where each is reached once. torchvision's ImageFolder follows links (class folders
    linked from other disks are common) and would walk a loop 40 levels deep or read a folder twice."""
    first_way: dict[str, Path] = {}
    todo = [top]
    while todo:
        folder = todo.pop()
        real = os.path.realpath(folder)
        if real in first_way:  # (the way through a link first: the other may be the folder itself)
            ways = sorted((folder, first_way[real]), key=lambda w: not _through_link(w, top))
            return ways[0], ways[1]
        first_way[real] = folder
        try:
            with os.scandir(folder) as entries:
                todo += sorted(Path(e.path) for e in entries if e.is_dir() and not _hidden(e.name))  # (follows links)
        except OSError:  # unreadable: ImageFolder's reading says so
            continue
    return None


def _through_link(path: Path, top: Path) -> bool:
    """Whether ``path`` (under ``top``) is reached through a symbolic link below ``top``."""
    return any(p.is_symlink() for p in (path, *path.parents) if p != top and p.is_relative_to(top))


def load_image(path: str):
    """An RGB PIL image; an unreadable file is a :class:`UserError` naming it (not a worker traceback).
    A 16-bit grayscale image (Pillow's modes ``I;16*``; mode ``I``, 32-bit integers, where a value
    exceeds 255) is scaled to 8 bits: Pillow's own conversion clips every value above 255 to white.
    Floating-point images are refused (nothing says their range)."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            if img.mode.startswith("I;16") or img.mode == "I":
                import numpy as np

                deep = np.asarray(img, dtype=np.float64)
                if img.mode != "I" or deep.max(initial=0) > 255:  # (an "I" image within 0..255 is 8-bit data)
                    deep = deep / 257.0
                img = Image.fromarray(np.clip(np.rint(deep), 0, 255).astype(np.uint8), "L")
            elif img.mode == "F":
                raise UserError(f"image {path} has floating-point pixels (Pillow mode F), whose range nothing "
                                "says: save it as 8- or 16-bit")
            return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:  # UnidentifiedImageError: OSError
        raise UserError(f"cannot read image {path}: {error_text(exc, 200)} "
                        "(remove or replace the file)") from None


# --------------------------------------------------------------------------- deterministic sampling


def sample_seed(seed: int, epoch: int, index: int) -> int:
    h = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


class SeededAugment(Dataset):
    """Indexing with ``(index, epoch)`` runs the transform under a torch RNG seeded from
    ``(seed, epoch, index)`` (the global CPU RNG is restored afterwards); a plain int
    index runs it unseeded."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        if isinstance(key, tuple):
            index, epoch = key
            state = torch.get_rng_state()
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            try:
                return self.dataset[index]
            finally:
                torch.set_rng_state(state)
        return self.dataset[key]


class EpochSampler(DistributedSampler):
    """DistributedSampler (also for one process) yielding ``(index, epoch)``, resumable mid-epoch.

    ``set_start(n)`` skips this rank's first ``n`` samples of the current epoch
    (reset to 0 by ``set_epoch``).
    """

    def __init__(self, dataset, *, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def set_start(self, n: int) -> None:
        self.start = n

    def __iter__(self):
        for i, index in enumerate(super().__iter__()):
            if i >= self.start:
                yield (index, self.epoch)

    def __len__(self) -> int:
        return self.num_samples - self.start


class ShardSampler(Sampler):
    """Evaluation: rank r gets indices r, r + W, r + 2W, ... (no padding, so nothing is counted twice)."""

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank

    def __iter__(self):
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))


# --------------------------------------------------------------------------- building it all


@dataclass
class Data:
    name: str
    train: Dataset
    val: Dataset
    num_classes: int
    in_chans: int
    small_input: bool  # what the model should default to
    image_sizes: tuple[int, ...] = ()  # the square sizes the model is given: training crops, validation crops
    classes: tuple[str, ...] = ()  # class names, label i is classes[i] (stored in checkpoints)
    train_images: int = 0  # images of the training set before any --train-subset (stored in checkpoints)

    def read_as(self, classes: Sequence[str], source) -> Data:
        """This data with the validation labels of a model trained on ``classes`` (from checkpoint
        ``source``): a folder holding some of its classes, or them in another order, gets their
        indices by name. A :class:`UserError` names the classes the model never saw."""
        classes = tuple(map(class_name, classes))  # (an older orepa's checkpoint kept them as written)
        if not classes or not self.classes or classes == self.classes:
            return self
        unknown = [c for c in self.classes if c not in classes]
        if unknown:
            raise UserError(f"{source} was trained on other classes: {self.name} has {len(unknown)} it never saw "
                            f"({some_of(unknown)}); its classes are {some_of(classes, 5)}")
        index = [classes.index(c) for c in self.classes]
        return dataclasses.replace(self, val=Relabeled(self.val, index, classes), num_classes=len(classes),
                                   classes=classes)


def names_fashion_mnist(data_path) -> bool:
    """Whether a --data-path names the embedded Fashion-MNIST (``fashion-mnist``, ``fmnist``, ... in
    any case): a name, not a path (``./fashion-mnist`` is a folder). The one judgement of it, for a
    run's data (:func:`resolve_kind`) and for what a checkpoint's run read (export)."""
    return str(data_path).lower() in FASHION_MNIST_NAMES


def resolve_kind(args) -> str:
    kind = getattr(args, "dataset", "auto") or "auto"
    named = names_fashion_mnist(args.data_path)
    if kind == "auto":
        if named and "data_path" in (getattr(args, "given", None) or ()) and \
                (Path(str(args.data_path)) / "train").is_dir():
            # a name that the user typed meaning their ImageFolder tree: reading the embedded data instead was
            # silent (a folder without train/, e.g. a run's or a cache that orepa made, is no such tree)
            raise UserError(f"--data-path {args.data_path} names the embedded Fashion-MNIST, and there is also a "
                            f"directory {args.data_path} here: give ./{args.data_path} to read that directory (an "
                            "ImageFolder root), or add --dataset fashion-mnist to read Fashion-MNIST")
        return "fashion-mnist" if named else "imagefolder"
    if kind == "fashion-mnist" and not named:  # one place says where Fashion-MNIST's files are
        raise UserError(f"--dataset fashion-mnist reads the Debian package's files (or those in "
                        f"$OREPA_FASHION_MNIST_DIR), not --data-path {args.data_path}; drop --data-path, or read "
                        "an ImageFolder tree there with --dataset imagefolder")
    return kind


def check_saved_data_path(args, source: str) -> None:
    """``args.data_path``, a setting of checkpoint ``source`` (``args._data_path_of``), names a folder
    from here: a relative one is relative to where its run was started, which a :class:`UserError`
    says (the ImageFolder check would name a --data-path the user never gave)."""
    path = Path(str(args.data_path))
    if resolve_kind(args) == "imagefolder" and not path.is_absolute() and not path.is_dir():
        raise UserError(f"{source} was trained on --data-path {path}, a path relative to the directory its run "
                        f"was started in; there is no {path} under {Path.cwd()}: run from that directory or give "
                        "--data-path")


def _subset(ds, n: int | None, seed: int | None):
    if n is None or n >= len(ds):
        return ds
    if n <= 0:
        raise UserError(f"subset size must be positive, got {n}")
    if seed is None:  # evenly spread: an ImageFolder lists its images class by class, so the first n would
        idx = [i * len(ds) // n for i in range(n)]  # hold the first classes only
    else:
        idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n].sort().values.tolist()
    sub = torch.utils.data.Subset(ds, idx)
    sub.classes = getattr(ds, "classes", None)
    return sub


#: the data flags of one kind of data: given for the other kind, they would be taken and ignored
KIND_FLAGS = {"pad_crop": "fashion-mnist", "train_crop_size": "imagefolder", "val_resize_size": "imagefolder",
              "val_crop_size": "imagefolder"}


def build_data(args, *, note: Callable[[str], None], need_train: bool = True) -> Data:
    """The data ``args`` name; ``note`` prints a note (the main process's print: under torchrun the other
    ranks' is silent)."""
    kind = resolve_kind(args)
    stray = sorted(k for k in getattr(args, "given", None) or () if KIND_FLAGS.get(k, kind) != kind)
    if stray:
        flags = " / ".join(long_flag(k) for k in stray)
        raise UserError(f"{flags} appl{'ies' if len(stray) == 1 else 'y'} to " + (
            "Fashion-MNIST (the zero padding of its random crop), not to an ImageFolder tree, whose training images "
            "are random resized crops of --train-crop-size" if kind == "imagefolder" else
            "ImageFolder trees (--data-path DIR), not to Fashion-MNIST, whose 28x28 images are read at their size "
            "(--pad-crop: the padding of its random crop)"))
    if getattr(args, "_data_path_of", None):  # the path is a checkpoint's setting, not a flag given here
        check_saved_data_path(args, args._data_path_of)
    if kind == "fashion-mnist":
        size = getattr(args, "_fashion_mnist_size", None) or 28  # (an export's recorded input size: eval)
        train, val = fashion_mnist(getattr(args, "cache_dir", None), getattr(args, "pad_crop", 2), size)
        in_chans, small, sizes = 1, True, (size,)
    else:
        train_crop, val_crop = getattr(args, "train_crop_size", TRAIN_CROP), getattr(args, "val_crop_size", VAL_CROP)
        train, val = imagefolder(args.data_path, train_crop, getattr(args, "val_resize_size", VAL_RESIZE), val_crop,
                                 need_train=need_train)
        in_chans, small, sizes = 3, False, tuple(sorted({train_crop, val_crop} if need_train else {val_crop}))
    classes = val.classes
    where = kind if kind == "fashion-mnist" else str(args.data_path)

    def subset(ds, key: str, seed: int | None, what: str):
        n = getattr(args, key, None)
        if n is not None and n > len(ds):  # taken whole (scripts ask for "all" so), but said: not what was asked
            note(f"note: {long_flag(key)} {n} is more than the {len(ds):,} {what} images of {where}: "
                 "all are used")
        return _subset(ds, n, seed)

    total = 0
    if need_train:
        total = len(train)  # a subset of other images than the run's would have the same size
        train = subset(train, "train_subset", getattr(args, "seed", 0), "training")
        train = SeededAugment(train, getattr(args, "seed", 0))
    val = subset(val, "val_subset", None, "validation")
    return Data(kind, train, val, len(classes), in_chans, small, sizes, tuple(classes), total)


def default_workers(args, device: torch.device) -> int:
    if getattr(args, "workers", None) is not None:
        cap = per_cpu_cap()  # each worker holds a copy of the process's memory
        if args.workers > cap:
            raise UserError(f"-j/--workers {args.workers}: more loader processes than this machine can hold "
                            f"(at most {cap}: 4 per CPU, or 32)")
        return max(0, args.workers)
    if resolve_kind(args) == "fashion-mnist" and device.type == "cpu":
        return 0
    return min(8, available_cpus())  # the CPUs this process may run on (a pinned job: its share)


def ignore_stop_signals(worker_id: int, owner: int | None = None) -> None:
    """A loader worker's start: Ctrl-C reaches every process of the terminal's group, a scheduler's
    SIGTERM every process of the job; a worker that died of it would fail the batch the main process
    is about to fetch on its way to a clean stop (the main process shuts the workers down).

    The worker's own parent is still obeyed: torch's DataLoader and multiprocessing's exit stop
    workers that do not leave by themselves with SIGTERM, and a worker that ignored it would make
    the main process wait for it forever (a run that failed on a corrupt image never exited). So
    where the sender can be told (``sigwaitinfo``), the other stop signals stay blocked and one thread
    takes them: from the parent they end the worker, from anyone else they are dropped. ``owner``:
    the process that made the loader (a forkserver's or spawn's worker has another parent)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's; a parent never sends it
    others = set(STOP_SIGNALS) - {signal.SIGINT}
    if not others:
        return
    if not hasattr(signal, "sigwaitinfo"):  # macOS, Windows: the default action (the parent's stop works)
        return
    senders = {os.getppid(), owner} - {1, None}  # pid 1: init, the parent of an orphan
    signal.pthread_sigmask(signal.SIG_BLOCK, others)  # every thread started later inherits the mask

    def orphaned() -> bool:  # the loader's process is gone (killed): nobody else will stop this worker
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    def take() -> None:
        while True:
            info = signal.sigwaitinfo(others)
            if info.si_pid in senders or (owner is not None and orphaned()):
                os._exit(0)  # as asked; 0: torch's SIGCHLD check in the parent reports any other code

    threading.Thread(target=take, name="orepa-stop-signals", daemon=True).start()


def check_batch_fits(per_process: int, batch_size: int, processes: int = 1) -> None:
    """A :class:`UserError` where a process's share of the training images fills no batch (the loader
    drops the last incomplete one: an epoch of no step)."""
    if per_process < batch_size:
        raise UserError(f"each of the {processes} process(es) gets {per_process} training images, "
                        f"fewer than one batch (-b {batch_size}); use a smaller batch or more data")


def train_loader(data: Data, args, info: DistInfo, device: torch.device) -> tuple[DataLoader, EpochSampler]:
    sampler = EpochSampler(data.train, num_replicas=info.world_size, rank=info.rank, seed=args.seed)
    check_batch_fits(sampler.num_samples, args.batch_size, info.world_size)
    workers = default_workers(args, device)
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=device.type == "cuda", drop_last=True, persistent_workers=workers > 0,
                        worker_init_fn=partial(ignore_stop_signals, owner=os.getpid()),
                        generator=_own_generator(args.seed))
    return loader, sampler


def _own_generator(seed: int) -> torch.Generator:
    """A loader's own generator: every iterator a DataLoader makes draws its workers' base seed from
    it, from torch's global generator without one, so a run resumed mid-epoch (one iterator more)
    or an evaluation shifted the stream its dropout and drop-path masks are drawn from (the
    augmentation here is a function of seed, epoch and index: SeededAugment)."""
    return torch.Generator().manual_seed(seed)


def val_loader(data: Data, args, info: DistInfo, device: torch.device, batch_size: int | None = None) -> DataLoader:
    sampler = ShardSampler(len(data.val), info.world_size, info.rank)
    workers = default_workers(args, device)
    # persistent: the loader is built once per run and evaluated every epoch (no worker respawn)
    return DataLoader(data.val, batch_size=batch_size or args.batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                      worker_init_fn=partial(ignore_stop_signals, owner=os.getpid()),
                      generator=_own_generator(getattr(args, "seed", 0)))
