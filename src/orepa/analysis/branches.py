"""Branch-level statistics of re-param blocks: Fig. "viz" and supplement Fig. "viz_norm".

Every branch of a block is fused into one ``k x k`` kernel *including its scale*
(or its BN, with running statistics), i.e. its additive contribution to the
squeezed kernel; a 1x1 branch is zero-padded around the centre and a branch with
finer groups is written with the block's groups. Then per block:

* ``cosine``: the M x M cosine similarity between the flattened branch kernels
  (Fig. "viz"); a branch whose kernel is exactly zero (e.g. the frequency-prior
  branch at its 0.0 scale init) has similarity 0 with every branch.
* ``norms``: the L2 norm of every branch kernel per output channel, ``[M, C_out]``;
  ``normalized_sorted``: each channel's norms divided by their sum over the
  branches (the branch's share of that channel), then sorted per branch in
  decreasing order (supp. Fig. "viz_norm": "the average contribution of the
  branches varies, each branch matters for some specific channels").
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import kernels as K
from ..blocks import ReparamConv2d

__all__ = ["branch_kernels", "cosine_matrix", "mean_off_diagonal", "channel_norms", "normalized_sorted_norms",
           "find_blocks", "analyze_block", "analyze_model"]


@torch.no_grad()
def branch_kernels(block: ReparamConv2d) -> dict[str, Tensor]:
    """``{branch: kernel [C_out, C_in/groups, kh, kw]}``: each branch's share of the squeezed kernel."""
    k = block.kernel_size
    out = {}
    for name, br in block.branches.items():
        w, _, g = br.fused_kernel()
        if g != block.groups:
            w = K.expand_groups(w, g, block.groups)
        out[name] = K.pad_to(w, k).detach().to(torch.float64)
    return out


def _stack(kernels: dict[str, Tensor] | Tensor) -> Tensor:
    if isinstance(kernels, dict):
        kernels = torch.stack(list(kernels.values()))
    return kernels.to(torch.float64)


def cosine_matrix(kernels: dict[str, Tensor] | Tensor) -> Tensor:
    """M x M cosine similarity of the flattened branch kernels (0 for an all-zero kernel)."""
    f = _stack(kernels).flatten(1)
    n = f.norm(dim=1)
    unit = f / torch.where(n > 0, n, torch.ones_like(n)).unsqueeze(1)
    cos = unit @ unit.T
    return cos.clamp(-1.0, 1.0)


def mean_off_diagonal(cos: Tensor) -> float:
    """Mean of the off-diagonal entries of a similarity matrix (nan for a single branch)."""
    m = cos.shape[0]
    if m < 2:
        return float("nan")
    mask = ~torch.eye(m, dtype=torch.bool, device=cos.device)
    return cos[mask].mean().item()


def channel_norms(kernels: dict[str, Tensor] | Tensor) -> Tensor:
    """``[M, C_out]``: L2 norm of every branch kernel per output channel."""
    f = _stack(kernels)
    return f.flatten(2).norm(dim=2)


def normalized_sorted_norms(norms: Tensor) -> Tensor:
    """Per channel, each branch's share of the summed norms; then sorted per branch (descending)."""
    total = norms.sum(0, keepdim=True)
    share = norms / torch.where(total > 0, total, torch.ones_like(total))
    return share.sort(dim=1, descending=True).values


def find_blocks(model: nn.Module, min_branches: int = 2) -> list[tuple[str, ReparamConv2d]]:
    """Every re-param block with at least ``min_branches`` branches (nested ones included,
    e.g. the 3x3 blocks inside a deep stem), in registration order."""
    if isinstance(model, ReparamConv2d) and len(model.branches) >= min_branches:
        found = [("", model)]
    else:
        found = []
    found += [(n, m) for n, m in model.named_modules()
              if n and isinstance(m, ReparamConv2d) and len(m.branches) >= min_branches]
    return found


@torch.no_grad()
def analyze_block(block: ReparamConv2d) -> dict:
    """Cosine matrix, per-channel norms and their sorted shares for one block (JSON-able)."""
    kern = branch_kernels(block)
    cos = cosine_matrix(kern)
    norms = channel_norms(kern)
    return {
        "type": type(block).__name__,
        "branches": list(kern),
        "kernel_size": list(block.kernel_size),  # [kh, kw]
        "in_channels": block.in_channels,
        "out_channels": block.out_channels,
        "groups": block.groups,
        "cosine": cos.tolist(),
        "mean_off_diagonal_cosine": mean_off_diagonal(cos),
        "branch_norm": [n.item() for n in _stack(kern).flatten(1).norm(dim=1)],
        "channel_norms": norms.tolist(),
        "normalized_sorted_norms": normalized_sorted_norms(norms).tolist(),
        "mean_share": (norms / norms.sum(0, keepdim=True).clamp_min(1e-300)).mean(1).tolist(),
    }


@torch.no_grad()
def analyze_model(model: nn.Module, min_branches: int = 2) -> dict:
    """``{"layers": {name: analyze_block(...)}, "summary": {...}}`` for every block of ``model``."""
    layers = {name or "<block>": analyze_block(b) for name, b in find_blocks(model, min_branches)}
    vals = [v["mean_off_diagonal_cosine"] for v in layers.values()]
    return {
        "layers": layers,
        "summary": {
            "blocks": len(layers),
            "mean_off_diagonal_cosine": (sum(vals) / len(vals)) if vals else float("nan"),
        },
    }
