"""Proposition 1 (sec. "Gradient Analysis on Multi-branch Topology") made checkable.

Setting of the derivation: a conv layer trained as M parallel branches of the
same shape (one learnable layer each), followed by scaling,

* shared scale   ``W_e = gamma * sum_j W_j``                (Phi^{Conv-Scale}_M)
* branch-wise    ``W_e = sum_j gamma_j * W_j``              (Phi^{Conv-Scale}_{M,2}),
  ``gamma_j`` a per-channel vector or a scalar,
* no scale       ``W_e = sum_j W_j``,

compared with the single conv-scale layer ``W_e = gamma * W`` (Phi^{Conv-Scale}).

What holds exactly (checked here in float64, see :func:`check_update`):

1. Shared scale (and no scale): the SGD update of the end-to-end kernel is the
   single conv-scale update. Every branch receives the same gradient
   ``gamma * dL/dW_e``, so ``sum_j W_j`` moves like one kernel at ``M`` times the
   learning rate: with the single conv's kernel lr set to ``M * lr`` the two
   trajectories coincide to rounding, step after step. (The paper writes the
   update as equal; the factor ``M`` on the kernel's lr is a constant rescale
   that adds no direction.) Each update of channel ``c`` lies in
   ``span{W_e[c], dL/dW_e[c]}``, exactly like the single layer's.
2. Branch-wise scales (vector or scalar): the update contains
   ``sum_j <W_j[c], G[c]> W_j[c]``, a combination of the individual branch
   kernels, which leaves that span: no learning rate makes a single conv-scale
   layer follow it (eq. "nlsp" vs "sgdcn"; Condition 1 holds for random init).

The empirical side (Fig. "viz": a tiny CNN of OREPA blocks trained with and
without scaling, and the similarity of its branches) is an application:
:func:`orepa.apps.proposition1.similarity_experiment`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MultiBranchConv", "ConvScale", "check_update", "proposition1_table"]

SCALINGS = ("shared", "vector", "scalar", "none")


class MultiBranchConv(nn.Module):
    """M same-shape kxk conv branches with a shared, branch-wise vector/scalar, or no scale.

    ``mode="offline"`` runs every branch on the feature map and sums the outputs
    (the multi-branch block as written); ``"online"`` convolves once with
    :meth:`end_to_end` (the same function).
    """

    def __init__(self, weights: Tensor, scaling: str, scale: Tensor | None = None, mode: str = "offline"):
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        m, c_out = weights.shape[:2]
        self.scaling, self.mode, self.k = scaling, mode, weights.shape[-1]
        self.weight = nn.Parameter(weights.clone())
        expected = {"shared": (c_out,), "vector": (m, c_out), "scalar": (m,), "none": None}[scaling]
        if expected is None:
            self.scale = None
        else:
            if scale is None or tuple(scale.shape) != expected:
                raise ValueError(f"scaling={scaling!r} needs a scale of shape {expected}")
            self.scale = nn.Parameter(scale.clone())

    def branch_scale(self, j: int) -> Tensor | None:
        if self.scaling == "vector":
            return self.scale[j]
        if self.scaling == "scalar":
            return self.scale[j].expand(self.weight.shape[1])
        return None

    def end_to_end(self) -> Tensor:
        w = self.weight
        if self.scaling == "shared":
            return self.scale.view(-1, 1, 1, 1) * w.sum(0)
        if self.scaling == "vector":
            return (self.scale.view(*self.scale.shape, 1, 1, 1) * w).sum(0)
        if self.scaling == "scalar":
            return (self.scale.view(-1, 1, 1, 1, 1) * w).sum(0)
        return w.sum(0)

    def forward(self, x: Tensor) -> Tensor:
        p = self.k // 2
        if self.mode == "online":
            return F.conv2d(x, self.end_to_end(), padding=p)
        out = 0
        for j in range(self.weight.shape[0]):
            y = F.conv2d(x, self.weight[j], padding=p)
            s = self.branch_scale(j)
            out = out + (y if s is None else y * s.view(1, -1, 1, 1))
        if self.scaling == "shared":
            out = out * self.scale.view(1, -1, 1, 1)
        return out


class ConvScale(nn.Module):
    """The single conv-scale layer ``y = gamma * conv(x, W)`` (no scale when ``gamma`` is None)."""

    def __init__(self, weight: Tensor, scale: Tensor | None):
        super().__init__()
        self.k = weight.shape[-1]
        self.weight = nn.Parameter(weight.clone())
        self.scale = None if scale is None else nn.Parameter(scale.clone())

    def end_to_end(self) -> Tensor:
        return self.weight if self.scale is None else self.scale.view(-1, 1, 1, 1) * self.weight

    def forward(self, x: Tensor) -> Tensor:
        y = F.conv2d(x, self.weight, padding=self.k // 2)
        return y if self.scale is None else y * self.scale.view(1, -1, 1, 1)


def _loss(y: Tensor, t: Tensor) -> Tensor:
    return 0.5 * (y - t).pow(2).mean()


def _sgd(module: nn.Module, x: Tensor, t: Tensor, lr: float, kernel_lr: float | None = None) -> None:
    """One plain SGD step (no momentum, no weight decay), ``kernel_lr`` for ``module.weight``."""
    module.zero_grad(set_to_none=True)
    _loss(module(x), t).backward()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p -= (kernel_lr if (name == "weight" and kernel_lr is not None) else lr) * p.grad


def _span_residual(delta: Tensor, w: Tensor, g: Tensor) -> float:
    """max over output channels of ||delta[c] - proj_{span{w[c], g[c]}} delta[c]|| / ||delta[c]||."""
    worst = 0.0
    for c in range(delta.shape[0]):
        basis = torch.stack([w[c].flatten(), g[c].flatten()], 1)
        d = delta[c].flatten()
        coef = torch.linalg.lstsq(basis, d.unsqueeze(1)).solution
        r = (d - (basis @ coef).squeeze(1)).norm() / d.norm().clamp_min(1e-300)
        worst = max(worst, r.item())
    return worst


def check_update(scaling: str, *, branches: int = 3, c_in: int = 3, c_out: int = 4, k: int = 3, lr: float = 0.1,
                 steps: int = 1, batch: int = 4, size: int = 6, seed: int = 0, mode: str = "offline") -> dict:
    """Compare SGD on the multi-branch layer with SGD on the single conv-scale layer (float64).

    The single layer starts from the same end-to-end kernel (shared scale:
    ``gamma`` and ``sum_j W_j``; branch-wise: ``gamma = mean_j gamma_j``, ``W = W_e / gamma``).
    Returns

    * ``diff_same_lr``: max |W_e(multi) - W_e(single)| after ``steps`` steps at lr for both;
    * ``diff_kernel_lr_x_M``: the same with the single layer's kernel at ``M * lr``;
    * ``span_residual``: relative part of the first step's end-to-end update outside
      ``span{W_e[c], dL/dW_e[c]}`` (worst channel): 0 for a single layer;
    * ``update_norm``: ||first end-to-end update||.
    """
    if scaling not in SCALINGS:  # (checked before the draws below, which differ by scaling)
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    for name, value in (("branches", branches), ("c_in", c_in), ("c_out", c_out), ("k", k), ("steps", steps),
                        ("batch", batch), ("size", size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    w = torch.randn(branches, c_out, c_in, k, k, generator=gen, dtype=dt) / math.sqrt(c_in * k * k)
    scale = {
        "shared": 1 + 0.3 * torch.randn(c_out, generator=gen, dtype=dt),
        "vector": 1 + 0.3 * torch.randn(branches, c_out, generator=gen, dtype=dt),
        "scalar": 1 + 0.3 * torch.randn(branches, generator=gen, dtype=dt),
        "none": None,
    }[scaling]
    x = torch.randn(batch, c_in, size, size, generator=gen, dtype=dt)
    t = torch.randn(batch, c_out, size, size, generator=gen, dtype=dt)

    multi = MultiBranchConv(w, scaling, scale, mode)
    w_e0 = multi.end_to_end().detach().clone()
    if scaling == "shared":
        single_init = (w.sum(0), scale)
    elif scaling == "none":
        single_init = (w.sum(0), None)
    else:  # gamma = mean_j gamma_j (per channel), W = W_e / gamma: for M = 1 exactly the branch itself
        g_s = (scale if scaling == "vector" else scale.view(-1, 1).expand(branches, c_out)).mean(0)
        single_init = (w_e0 / g_s.view(-1, 1, 1, 1), g_s)

    # dL/dW_e at the start: the direction a plain conv would follow
    w_leaf = w_e0.clone().requires_grad_(True)
    _loss(F.conv2d(x, w_leaf, padding=k // 2), t).backward()
    g = w_leaf.grad

    singles = {"same_lr": ConvScale(*single_init), "kernel_lr_x_M": ConvScale(*single_init)}
    first_delta = None
    diffs = {n: 0.0 for n in singles}
    for step in range(steps):
        _sgd(multi, x, t, lr)
        _sgd(singles["same_lr"], x, t, lr)
        _sgd(singles["kernel_lr_x_M"], x, t, lr, kernel_lr=branches * lr)
        with torch.no_grad():
            we = multi.end_to_end()
            if first_delta is None:
                first_delta = we - w_e0
            for n, s in singles.items():
                diffs[n] = max(diffs[n], (we - s.end_to_end()).abs().max().item())
    return {
        "scaling": scaling,
        "branches": branches,
        "steps": steps,
        "lr": lr,
        "mode": mode,
        "diff_same_lr": diffs["same_lr"],
        "diff_kernel_lr_x_M": diffs["kernel_lr_x_M"],
        "span_residual": _span_residual(first_delta, w_e0, g),
        "update_norm": first_delta.norm().item(),
        "kernel_norm": w_e0.norm().item(),
    }


def proposition1_table(steps: int = 5, **kw) -> list[dict]:
    """:func:`check_update` for every scaling, one step and ``steps`` steps."""
    rows = []
    for s in SCALINGS:
        for n in (1, steps):
            rows.append(check_update(s, steps=n, **kw))
    return rows
