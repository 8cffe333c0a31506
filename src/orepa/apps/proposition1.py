"""Proposition 1, the empirical side (paper Fig. "viz"): do scaling layers diversify the branches?

:func:`similarity_experiment` trains :class:`TinyOREPANet` (three six-branch OREPA blocks) with
``scaling="none"``, ``"scalar"`` and ``"vector"`` from the same initialisation and the same batches,
and tracks the mean off-diagonal cosine similarity of the branch kernels and of their accumulated
updates. The exact, data-free check of the proposition is :mod:`orepa.analysis.proposition1`;
``benchmarks/proposition1.py`` runs both and plots the result (docs/analysis.md).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..analysis import analyze_model, branch_kernels, cosine_matrix, find_blocks, mean_off_diagonal
from ..blocks import OREPAConv2d

__all__ = ["TinyOREPANet", "load_fashion_mnist", "synthetic_data", "similarity_experiment"]


class TinyOREPANet(nn.Module):
    """Plain 3x3 stem, three OREPA blocks (each + post BN + ReLU), global pool, linear."""

    def __init__(self, in_chans: int = 1, num_classes: int = 10, width: int = 16, *, scaling: str = "vector",
                 branches=None):
        super().__init__()
        w = width
        opts = dict(scaling=scaling, branches=branches)
        self.stem = nn.Sequential(nn.Conv2d(in_chans, w, 3, 2, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        self.block1 = OREPAConv2d(w, w, 3, **opts)
        self.bn1 = nn.BatchNorm2d(w)
        self.block2 = OREPAConv2d(w, 2 * w, 3, 2, **opts)
        self.bn2 = nn.BatchNorm2d(2 * w)
        self.block3 = OREPAConv2d(2 * w, 2 * w, 3, **opts)
        self.bn3 = nn.BatchNorm2d(2 * w)
        self.fc = nn.Linear(2 * w, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        x = F.relu(self.bn1(self.block1(x)))
        x = F.relu(self.bn2(self.block2(x)))
        x = F.relu(self.bn3(self.block3(x)))
        return self.fc(x.mean((2, 3)))


def load_fashion_mnist(n: int | None = None, train: bool = True, cache_dir=None) -> tuple[Tensor, Tensor]:
    """The first ``n`` Fashion-MNIST images ``[n, 1, 28, 28]`` (normalised as ``orepa train`` does) and labels,
    read by the applications' one Fashion-MNIST reader (:func:`orepa.apps.data.fashion_mnist`)."""
    from .data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, fashion_mnist

    ds = fashion_mnist(cache_dir)[0 if train else 1]
    x = (ds.images[:n].float().div(255.0) - FASHION_MNIST_MEAN[0]) / FASHION_MNIST_STD[0]
    return x, ds.targets[:n]


def synthetic_data(n: int, seed: int = 0, num_classes: int = 10, size: int = 28) -> tuple[Tensor, Tensor]:
    """Class-conditional smooth templates plus noise: a stand-in when Fashion-MNIST is absent."""
    gen = torch.Generator().manual_seed(seed)
    templates = F.avg_pool2d(torch.randn(num_classes, 1, size, size, generator=gen), 5, 1, 2) * 3
    y = torch.randint(0, num_classes, (n,), generator=gen)
    x = templates[y] + 0.5 * torch.randn(n, 1, size, size, generator=gen)
    return x, y


def _data(data: str, n_train: int, n_test: int, seed: int, cache_dir=None):
    if data == "fashion-mnist":  # a missing data set is an error (UserError naming the fix), never a silent swap
        return load_fashion_mnist(n_train, cache_dir=cache_dir), load_fashion_mnist(n_test, train=False,
                                                                                    cache_dir=cache_dir)
    if data != "synthetic":
        raise ValueError(f"data must be 'fashion-mnist' or 'synthetic', got {data!r}")
    x, y = synthetic_data(n_train + n_test, seed)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def _mean_cos(model: nn.Module) -> tuple[float, dict[str, float]]:
    res = analyze_model(model)
    per = {n: v["mean_off_diagonal_cosine"] for n, v in res["layers"].items()}
    return res["summary"]["mean_off_diagonal_cosine"], per


def _kernels(model: nn.Module) -> dict[str, Tensor]:
    return {n: torch.stack(list(branch_kernels(b).values())) for n, b in find_blocks(model)}


def _update_cos(model: nn.Module, init: dict[str, Tensor]) -> tuple[float, dict[str, float], dict[str, list]]:
    """Cosine similarity between the branches' accumulated updates ``K_j(t) - K_j(0)`` (each fused with its scale)."""
    per, mats = {}, {}
    for n, k in _kernels(model).items():
        cos = cosine_matrix(k - init[n])
        per[n], mats[n] = mean_off_diagonal(cos), cos.tolist()
    return sum(per.values()) / len(per), per, mats


def similarity_experiment(scalings=("none", "scalar", "vector"), *, steps: int = 150, batch: int = 64,
                          lr: float = 0.05, width: int = 16, n_train: int = 4096, n_test: int = 1000,
                          data: str = "fashion-mnist", seed: int = 0, log_every: int = 10, branches=None,
                          log=None, cache_dir=None) -> dict:
    """Train :class:`TinyOREPANet` once per scaling (same seed, same init of the branch kernels,
    same batches; SGD momentum 0.9) and track the mean off-diagonal cosine similarity of the
    branch kernels (each fused with its scale) over training."""
    (xtr, ytr), (xte, yte) = _data(data, n_train, n_test, seed, cache_dir)
    out = {"config": dict(scalings=list(scalings), steps=steps, batch=batch, lr=lr, width=width,
                          n_train=len(xtr), n_test=len(xte), data=data, seed=seed,
                          branches=list(branches) if branches else None),
           "runs": {}}
    for s in scalings:
        torch.manual_seed(seed)
        model = TinyOREPANet(1, 10, width, scaling=s, branches=branches)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        gen = torch.Generator().manual_seed(seed + 1)
        mc, per = _mean_cos(model)
        init = _kernels(model)
        hist = [{"step": 0, "loss": None, "mean_cos": mc, "per_block": per, "update_cos": None}]
        t0 = time.perf_counter()
        model.train()
        for step in range(1, steps + 1):
            idx = torch.randint(0, len(xtr), (batch,), generator=gen)
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % log_every == 0 or step == steps:
                mc, per = _mean_cos(model)
                uc, uper, _ = _update_cos(model, init)
                hist.append({"step": step, "loss": loss.item(), "mean_cos": mc, "per_block": per,
                             "update_cos": uc, "update_per_block": uper})
                if log:
                    log(f"{s:>7} step {step:4d} loss {loss.item():.3f} mean cos {mc:.3f} update cos {uc:.3f}")
        model.eval()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        final = analyze_model(model)
        uc, _, umats = _update_cos(model, init)
        out["runs"][s] = {
            "final_update_cos": uc,
            "final_update_cosine": umats,
            "history": hist,
            "initial_mean_cos": hist[0]["mean_cos"],
            "final_mean_cos": hist[-1]["mean_cos"],
            "test_accuracy": acc,
            "seconds": time.perf_counter() - t0,
            "final_cosine": {n: v["cosine"] for n, v in final["layers"].items()},
            "branches": next(iter(final["layers"].values()))["branches"],
        }
    return out
