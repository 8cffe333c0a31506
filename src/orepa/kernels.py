"""Kernel algebra: every training-time linear layer as a (degraded) conv kernel.

Pure, differentiable functions on tensors (no modules, no state). A kernel is a
``(weight, groups)`` pair with ``weight`` of shape ``[C_out, C_in // groups, k, k]``
in PyTorch's cross-correlation convention; an *affine* kernel adds a bias
``[C_out]``. Everything here composes; ``orepa.blocks`` only declares which
layers a branch holds and calls these functions.

The two squeezing rules of the paper are :func:`compose` (sequential, supp.
eq. "merge-seq") and :func:`add_parallel` (parallel, centre aligned).
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

__all__ = [
    "pad_to",
    "identity_kernel",
    "avg_pool_kernel",
    "freq_prior_kernel",
    "identity_init_1x1",
    "tiled_identity_1x1",
    "channel_column",
    "KeptViews",
    "keep_views",
    "kept_view",
    "mul_contiguous",
    "scale_channels",
    "rowdot",
    "expand_groups",
    "compose",
    "compose_vjp",
    "compose_vjp_scaled",
    "compose_into",
    "compose_case",
    "cheap_vjp_groups",
    "compose_affine",
    "bias_through",
    "add_parallel",
    "as_pair",
    "fold_bn",
    "bn_as_affine",
]


def as_pair(v, name: str = "kernel_size") -> tuple[int, int]:
    """An int or a pair of ints as ``(h, w)`` (an int is square); anything else is a ValueError
    naming ``name``."""
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, (tuple, list, torch.Size)) and len(v) == 2 and all(isinstance(i, int) for i in v):
        return (int(v[0]), int(v[1]))
    raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")


def pad_to(weight: Tensor, k) -> Tensor:
    """Zero-pad an odd ``[.., sh, sw]`` kernel around its centre to ``k`` (an int: ``k x k``; or
    ``(kh, kw)``), e.g. 1x1 -> kxk, 1x7 -> 7x7."""
    sh, sw = weight.shape[-2:]
    kh, kw = as_pair(k)
    if (sh, sw) == (kh, kw):
        return weight
    if sh % 2 == 0 or sw % 2 == 0 or kh < sh or kw < sw or (kh - sh) % 2 or (kw - sw) % 2:
        raise ValueError(f"cannot centre-pad a {sh}x{sw} kernel to {kh}x{kw}: both need odd sizes, the target "
                         "the larger")
    ph, pw = (kh - sh) // 2, (kw - sw) // 2
    return F.pad(weight, (pw, pw, ph, ph))


def identity_kernel(channels: int, groups: int = 1, k=1, *, dtype=None, device=None) -> Tensor:
    """Kernel of the identity map: ``[C, C // groups, kh, kw]`` with a 1 at the centre."""
    if channels % groups:
        raise ValueError(f"channels={channels} not divisible by groups={groups}")
    kh, kw = as_pair(k)
    per_group = channels // groups
    w = torch.zeros(channels, per_group, kh, kw, dtype=dtype, device=device)
    idx = torch.arange(channels, device=device)
    w[idx, idx % per_group, kh // 2, kw // 2] = 1.0
    return w


def identity_init_1x1(out_channels: int, in_channels: int, groups: int = 1, *, dtype=None, device=None) -> Tensor:
    """Identity-initialised 1x1 kernel (supp. Table "training-time linear layers").

    Within each group, output ``o`` connects to input ``i`` when ``o / C_o == i / C_i``
    (integer scaling of the local index), which is the identity for ``C_o == C_i``
    and a "spread" identity when the block expands channels.
    """
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"channels {in_channels}->{out_channels} not divisible by groups={groups}")
    ci, co = in_channels // groups, out_channels // groups
    w = torch.zeros(out_channels, ci, 1, 1, dtype=dtype, device=device)
    rows = torch.arange(out_channels, device=device)
    local = rows % co
    hit = (local * ci) % co == 0
    # no boolean indexing, so this also builds on the meta device
    w[rows, (local * ci) // co, 0, 0] = hit.to(w.dtype)
    return w


def tiled_identity_1x1(out_channels: int, in_channels: int, groups: int = 1, *, dtype=None, device=None) -> Tensor:
    """Identity-initialised 1x1 kernel as the paper's public code lays it out: output ``o``
    reads input ``o mod (C_in / groups)`` of its group, so a factor wider than its input
    repeats the identity (it is the identity when ``C_out == C_in``)."""
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"channels {in_channels}->{out_channels} not divisible by groups={groups}")
    w = torch.zeros(out_channels, in_channels // groups, 1, 1, dtype=dtype, device=device)
    rows = torch.arange(out_channels, device=device)
    w[rows, rows % (in_channels // groups), 0, 0] = 1.0
    return w


def avg_pool_kernel(channels: int, k, *, dtype=None, device=None) -> Tensor:
    """Depthwise ``[C, 1, kh, kw]`` kernel of a ``k`` (int: kxk) average pool with zero padding counted."""
    kh, kw = as_pair(k)
    return torch.full((channels, 1, kh, kw), 1.0 / (kh * kw), dtype=dtype, device=device)


def freq_prior_kernel(channels: int, k, *, dtype=None, device=None) -> Tensor:
    """Depthwise ``[C, 1, kh, kw]`` frequency prior filter for any ``k`` (int: kxk; supp. Table).

    ``W[c, h, w] = cos((c + 1)(h + 0.5) pi / kh)`` for ``c < C / 2`` and
    ``cos((c - C / 2 + 1)(w + 0.5) pi / kw)`` otherwise: DCT-like bases along
    rows for the first half of the channels and along columns for the second
    (a kernel one tap high or wide gives that half the constants cos((c + 1) pi / 2)).
    ``C / 2`` is the real half, as in the paper's public code (so that imported checkpoints keep
    their function): for an odd ``C`` the second half's frequencies are half-integers and its
    first channel, ``floor(C / 2)``, takes a row basis. The supplement's table writes
    ``floor(C / 2)`` instead; the two agree for every even ``C`` (all the zoo's widths).
    """
    half = channels / 2
    kh, kw = as_pair(k)
    c = torch.arange(channels, dtype=torch.float64).view(-1, 1, 1)
    h = (torch.arange(kh, dtype=torch.float64) + 0.5).view(1, -1, 1).expand(channels, kh, kw)
    w = (torch.arange(kw, dtype=torch.float64) + 0.5).view(1, 1, -1).expand(channels, kh, kw)
    rows = c < half
    freq = torch.where(rows, c + 1, c - half + 1)
    arg = torch.where(rows, h, w)
    out = torch.cos(freq * arg * math.pi / torch.where(rows, float(kh), float(kw)))
    return out.unsqueeze(1).to(dtype=dtype or torch.get_default_dtype(), device=device)


class KeptViews(dict):
    """The views :func:`kept_view` took of one tensor (key -> view), kept while this holder is alive;
    ``children``: per key, the holder of that view's own kept views."""

    def __init__(self):
        super().__init__()
        self.children: dict[tuple, KeptViews] = {}


def keep_views(t: Tensor) -> KeptViews:
    """Mark ``t`` as long-lived (a kernel group's storage in ``orepa.engine``: read by every
    training step, never resized or re-pointed): the reshaped views this module takes of it are
    then made once and kept, instead of once per use. On a GPU an eager step is bound by the
    host issuing its operators, views included (each is a dispatched operator and a new tensor).

    The views are kept in the returned holder, which the caller keeps as long as ``t`` (the
    storage does); ``t`` refers to it weakly. Not on ``t`` itself: a view holds its base's C++
    tensor, which keeps ``t``'s Python object alive, so a dict on ``t`` would be a cycle the
    garbage collector cannot see, and ``t`` would never be freed."""
    holder = KeptViews()
    t._kept_views = weakref.ref(holder)
    return holder


def kept_view(t: Tensor, key: tuple, make) -> Tensor:
    """``make(t)``, a view of ``t``: made once per ``key`` where ``t`` is marked by :func:`keep_views`
    (never while traced, by dynamo or make_fx: a kept view is not seen to come from the traced input,
    so the trace would take it in as a constant, frozen at its values; and views are free in
    compiled code). What does not read ``t``'s memory (a reshape that had to copy, and any view of
    that copy) is never kept: it would not follow ``t``'s updates."""
    traced = torch.compiler.is_compiling() or get_proxy_mode() is not None
    ref = None if traced else t.__dict__.get("_kept_views")
    kept = None if ref is None else ref()
    if kept is None:
        return make(t)
    view = kept.get(key)
    if view is None:
        view = make(t)
        if view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            kept[key] = view
            # the views of a kept view are kept too, by a holder its parent's holder owns
            view._kept_views = weakref.ref(kept.children.setdefault(key, KeptViews()))
    return view


def _kept_reshape(t: Tensor, *shape: int) -> Tensor:
    """``t.reshape(*shape)``, kept (:func:`kept_view`) under the shape itself as its key."""
    return kept_view(t, shape, lambda x: x.reshape(shape))


def channel_column(scale: Tensor) -> Tensor:
    """A per-output-channel vector ``[C]`` as ``[C, 1, 1, 1]``, broadcasting over a kernel (a
    scale already in that shape is returned as is: no view op)."""
    return scale if scale.dim() == 4 else scale.reshape(-1, 1, 1, 1)


def scale_channels(weight: Tensor, scale: Tensor) -> Tensor:
    """Per-output-channel scaling layer folded into a kernel (scalar broadcasts); ``scale`` is
    ``[C]`` or already ``[C, 1, 1, 1]``."""
    return weight * channel_column(scale)


def batched_product(a: Tensor, b: Tensor, pointwise: bool = False) -> Tensor:
    """``a @ b`` per batch ``[B, m, k] @ [B, k, n]``: a batched matrix product, or (``pointwise``,
    code for a compiler) for a contraction of up to :data:`UNROLLED_CONTRACTION` terms (dw -> pw's
    8 channels, a kernel's k*k taps) the products written out term by term, which the compiler
    fuses into the element-wise passes around them.

    Term by term, not as a broadcast product and a sum: as a reduction, inductor's CPU code
    parallelised the 8-term sum itself, one OpenMP region per output element (ResNet-18's
    512-channel group took 670 ms per build instead of 70 ms eagerly). A long contraction
    (1x1 -> 1x1 over C channels) stays a matrix product: as a broadcast product it is a loop over
    C times the output, never turned into a matrix product."""
    if pointwise and a.shape[-1] <= UNROLLED_CONTRACTION:
        out = a[..., 0:1] * b[..., 0:1, :]
        for j in range(1, a.shape[-1]):
            out = out + a[..., j:j + 1] * b[..., j:j + 1, :]
        return out
    return torch.bmm(a, b)


UNROLLED_CONTRACTION = 16  # terms; a longer contraction is a matrix product (see batched_product)


def rowdot(a: Tensor, b: Tensor, pointwise: bool = False, out: Tensor | None = None,
           launch_bound: bool = True) -> Tensor:
    """Per-output-channel dot product ``sum(a[o] * b[o])`` (into ``out`` where given).

    Contiguous operands on a host-bound device (``launch_bound``: a GPU, or a build that runs
    the fewest operators): a batched matmul of 1-row matrices, one operator and no full-size
    temporary. Otherwise (a CPU's per-block route; strided operands, e.g. slices of a kernel
    gradient; ``pointwise``, code for a compiler, which fuses it): a product and a sum. PyTorch's
    CPU bmm runs 1-row products far below the memory's pace (512 x 4608 operands: 3.9 ms against
    1.1 ms for the two passes, 2-core Xeon) and copies every strided row separately.
    """
    n = a.shape[0]
    if a.is_contiguous() and b.is_contiguous() and not pointwise and launch_bound:
        a, b = _kept_reshape(a, n, 1, -1), _kept_reshape(b, n, -1, 1)
        if out is not None:
            torch.bmm(a, b, out=_kept_reshape(out, n, 1, 1))
            return out
        return torch.bmm(a, b).reshape(n)
    dims = tuple(range(1, a.dim()))
    return torch.mul(a, b).sum(dim=dims) if out is None else torch.sum(torch.mul(a, b), dim=dims, out=out)


def expand_groups(weight: Tensor, groups: int, new_groups: int) -> Tensor:
    """Re-express a grouped kernel with coarser ``new_groups`` (block-diagonal fill)."""
    if groups == new_groups:
        return weight
    if groups % new_groups:
        raise ValueError(f"cannot express groups={groups} as groups={new_groups}")
    c_out, cin_g, kh, kw = weight.shape
    ratio = groups // new_groups  # fine groups per coarse group
    cout_g = c_out // groups
    # [new_groups, ratio, cout_g, cin_g, k, k] -> block diagonal over `ratio`
    w = weight.reshape(new_groups, ratio, cout_g, cin_g, kh, kw)
    eye = torch.eye(ratio, dtype=weight.dtype, device=weight.device)
    full = torch.einsum("grocij,rs->groscij", w, eye)
    return full.reshape(c_out, ratio * cin_g, kh, kw)


def compose_case(w1_shape, g1: int, w2_shape, g2: int) -> str:
    """Which evaluation of the sequential rule applies (shared by compose and compose_vjp)."""
    c1, c2 = w1_shape[0], w2_shape[0]
    if tuple(w2_shape[-2:]) == (1, 1) and g1 % g2 == 0:
        return "pointwise_after"  # dw(xE) -> pw, 1x1 -> 1x1: a batched matmul
    if g1 == g2 and tuple(w1_shape[-2:]) == (1, 1):
        return "pointwise_first"  # 1x1 -> kxk: a batched matmul
    if g2 == c1 == c2 and g2 % g1 == 0:
        # per-channel filter after a coarser conv (avg pool / frequency prior after 1x1)
        return "depthwise_after_1x1" if tuple(w1_shape[-2:]) == (1, 1) else "depthwise_after"
    return "same_groups" if g1 == g2 else "general"


def _conv_compose(w1: Tensor, w2: Tensor, groups: int) -> Tensor:
    """Full (true) convolution of kernels, per group: ``W[c2, c0] = sum_c1 W2[c2, c1] (*) W1[c1, c0]``."""
    c1, c0g, k1h, k1w = w1.shape
    c2, c1g, _, _ = w2.shape
    if groups == 1:
        # a transposed conv is the full (true) convolution: W2's rows as images, W1 as its
        # weight, one operator (a deep stem's 3x3 -> 3x3)
        return F.conv_transpose2d(w2, w1)
    # conv2d computes a cross-correlation; flipping W1 turns it into the true
    # convolution the sequential rule needs (a no-op only when W1 is 1x1).
    inp = w2.reshape(groups, c2 // groups, c1g, *w2.shape[2:]).transpose(0, 1).reshape(c2 // groups, c1, *w2.shape[2:])
    ker = w1.reshape(groups, c1g, c0g, k1h, k1w).transpose(1, 2).reshape(groups * c0g, c1g, k1h, k1w)
    out = F.conv2d(inp, ker.flip(-1, -2), padding=(k1h - 1, k1w - 1), groups=groups)
    kh, kw = out.shape[-2:]
    return out.reshape(c2 // groups, groups, c0g, kh, kw).transpose(0, 1).reshape(c2, c0g, kh, kw)


# The two batched-matmul cases are written as explicit bmm calls on views rather than einsum:
# the same kernels, but a handful of host-side ops instead of einsum's ~20 (an online block's
# eager step on a GPU is bound by the host issuing its small ops).


def _pw_after_operands(w1: Tensor, g1: int, w2: Tensor, g2: int) -> tuple[Tensor, Tensor]:
    """``A [G*r, o, m]`` (a copy of W2; a view where r == 1) and ``B [G*r, m, i*k*k]`` (a view of W1),
    batched over (coarse group G of W2, fine group r of W1 inside it); m = channels per fine group."""
    c1, c0g = w1.shape[:2]
    r = g1 // g2  # each coarse group of W2 sees r fine groups of W1
    m, o = c1 // g1, w2.shape[0] // g2
    if r == 1:
        a = _kept_reshape(w2, g2, o, m)
    else:
        a = kept_view(w2, ("G,r,o,m", g2, r), lambda t: t.reshape(g2, o, r, m).transpose(1, 2)).reshape(g2 * r, o, m)
    return a, _kept_reshape(w1, g2 * r, m, -1)


def _pw_after_unbatch(t: Tensor, g2: int, c2: int, c0g: int, kh: int, kw: int) -> Tensor:
    """``[G*r, o, i*k*k]`` -> the composed kernel ``[C2, r*i, kh, kw]`` (a view when i == 1)."""
    r = t.shape[0] // g2
    t = t.reshape(g2, r, c2 // g2, -1).transpose(1, 2).reshape(c2, r, c0g, kh * kw)
    return t.reshape(c2, r * c0g, kh, kw)


def mul_contiguous(a: Tensor, b: Tensor, traced: bool = False) -> Tensor:
    """``a * b`` as a contiguous tensor of ``a``'s shape, in one pass when ``a`` is a strided view
    (the product writes straight into the reordered layout through out=, no separate copy).
    Code for a compiler (``traced``, or under torch.compile) takes the product and the copy apart:
    the compiler fuses them itself, and its tracers mis-read the layout of an out= write."""
    if traced or torch.compiler.is_compiling():
        return (a * b).contiguous()
    return torch.mul(a, b, out=a.new_empty(a.shape))


def _taps_first(w2: Tensor, g: int, scale: Tensor | None = None, traced: bool = False,
                scratch=None) -> Tensor:
    """``A [G, o*k*k, m]``: a copy of W2 with its taps before its channels (each output channel
    times ``scale``'s, in the same pass, where given; ``traced``: see :func:`mul_contiguous`;
    ``scratch``: the scaled copy written into its buffer ``"scaled taps"``, see :func:`compose_into`)."""
    c2, mg, kh, kw = w2.shape
    taps = kept_view(w2, ("G,o,kk,m", g), lambda t: t.reshape(g, c2 // g, mg, kh * kw).transpose(2, 3))
    if scale is None:
        return taps.reshape(g, (c2 // g) * kh * kw, mg)
    col = _kept_reshape(scale, g, c2 // g, 1, 1)
    if scratch is not None:
        return _kept_reshape(torch.mul(taps, col, out=scratch.buf("scaled taps", taps.shape)), g, -1, mg)
    return mul_contiguous(taps, col, traced).view(g, -1, mg)


def _scaled_pw_rows(w2: Tensor, g2: int, r: int, scale: Tensor | None, order: str, scratch=None,
                    traced: bool = False) -> Tensor:
    """``scale * W2`` of a pointwise W2 after ``r`` fine groups, reordered for the products batched
    over (G, r): ``order`` ``"o,m"`` gives ``[G*r, o, m]`` (the composition), ``"m,o"`` ``[G*r, m, o]``
    (W1's gradient); one pass, into the scratch buffer of that order where given (``traced``: see
    :func:`mul_contiguous`). Without a scale: the reordered rows as they are (a copy where not a view)."""
    o, m = w2.shape[0] // g2, w2.shape[1] // r
    if order == "o,m":
        rows = kept_view(w2, ("G,r,o,m", g2, r), lambda t: t.reshape(g2, o, r, m).transpose(1, 2))
        col = None if scale is None else _kept_reshape(scale, g2, 1, o, 1)
    else:
        rows = kept_view(w2, ("G,r,m,o", g2, r), lambda t: t.reshape(g2, o, r, m).permute(0, 2, 3, 1))
        col = None if scale is None else _kept_reshape(scale, g2, 1, 1, o)
    if col is None:
        return rows.reshape(g2 * r, *rows.shape[2:])
    if scratch is None:
        return mul_contiguous(rows, col, traced).view(g2 * r, *rows.shape[2:])
    out = torch.mul(rows, col, out=scratch.buf(("scaled pw", order), rows.shape))
    return _kept_reshape(out, g2 * r, *rows.shape[2:])


def _pw_first_operands(w1: Tensor, g: int, w2: Tensor) -> tuple[Tensor, Tensor]:
    """``A [G, o*k*k, m]`` (:func:`_taps_first`) and ``B [G, m, i]`` (a view of W1)."""
    return _taps_first(w2, g), _kept_reshape(w1, g, w2.shape[1], w1.shape[1])


def _pw_first_unbatch(t: Tensor, c2: int, kh: int, kw: int) -> Tensor:
    """``[G, o*k*k, i]`` -> ``[C2, i, kh, kw]`` as a strided view (no copy)."""
    return t.reshape(c2, kh * kw, t.shape[-1]).transpose(1, 2).unflatten(2, (kh, kw))


def _pw_after_w1_grad(w2: Tensor, grad: Tensor, g2: int, r: int, m: int, o: int) -> Tensor:
    """dL/dW1 when a pointwise W2 follows a finer-grouped W1 (dw x8 -> pw): per fine group of W1,
    ``sum_o grad[o, i*k*k] W2[o, m]``, returned as ``[G*r, m, i*k*k]``.

    Both operands are read in place (strided views of the kernel gradient and of W2) and the fine
    groups are taken in pairs: one [2*i*k*k, o] @ [o, 2*m] product per pair, whose two
    off-diagonal blocks are discarded. PyTorch's CPU bmm runs unpaired 8-deep products several
    times slower on such strided views, and contiguous copies cost more than they save; the
    discarded blocks cost 2x of a small product.
    """
    b = 2 if r % 2 == 0 else 1  # fine groups per product
    nb = r // b
    it = grad.shape[1] // r * grad.shape[2] * grad.shape[3]  # i*k*k of one fine group
    a = grad.reshape(g2, o, nb, b * it).permute(0, 2, 3, 1).reshape(g2 * nb, b * it, o)
    w = w2.reshape(g2, o, nb, b * m).permute(0, 2, 1, 3).reshape(g2 * nb, o, b * m)
    pairs = torch.bmm(a, w).reshape(g2 * nb, b, it, b, m)
    return pairs.diagonal(dim1=1, dim2=3).permute(0, 3, 2, 1).reshape(g2 * r, m, it)


def compose(w1: Tensor, g1: int, w2: Tensor, g2: int) -> tuple[Tensor, int]:
    """Sequential rule: the kernel of ``conv(W2, g2)`` applied after ``conv(W1, g1)``.

    Both run with stride 1 and the same dilation; the result has spatial size
    ``k1 + k2 - 1`` and is to be applied with the outer layer's stride/dilation.
    Cheap paths (batched matmuls / broadcasts) cover the OREPA branches: pointwise
    after a finer-grouped conv (dw with expansion -> pw), 1x1 -> kxk, and a
    per-channel filter after 1x1; anything else is a grouped convolution of kernels.
    """
    c1 = w1.shape[0]
    if w2.shape[1] * g2 != c1:
        raise ValueError(f"cannot compose: first kernel gives {c1} channels, second expects {w2.shape[1] * g2}")
    case = compose_case(w1.shape, g1, w2.shape, g2)
    c0g = w1.shape[1]
    c2 = w2.shape[0]
    if case == "pointwise_after":
        a, b = _pw_after_operands(w1, g1, w2, g2)
        return _pw_after_unbatch(torch.bmm(a, b), g2, c2, c0g, *w1.shape[-2:]), g2
    if case == "pointwise_first":
        a, b = _pw_first_operands(w1, g1, w2)
        return _pw_first_unbatch(torch.bmm(a, b), c2, *w2.shape[-2:]), g1
    if case == "depthwise_after_1x1":
        return w1 * w2, g1
    if case == "depthwise_after":
        k1h, k1w = w1.shape[-2:]
        k2h, k2w = w2.shape[-2:]
        inp = w1.reshape(1, c1 * c0g, k1h, k1w)
        ker = w2.flip(-1, -2).repeat_interleave(c0g, dim=0)
        out = F.conv2d(F.pad(inp, (k2w - 1, k2w - 1, k2h - 1, k2h - 1)), ker, groups=c1 * c0g)
        return out.reshape(c1, c0g, *out.shape[-2:]), g1
    if case == "same_groups":
        return _conv_compose(w1, w2, g1), g1
    g = math.gcd(g1, g2)
    return _conv_compose(expand_groups(w1, g1, g), expand_groups(w2, g2, g), g), g


def cheap_vjp_groups(w1_shape, g1: int, w2_shape, g2: int) -> int | None:
    """Groups of ``compose`` if :func:`compose_vjp` has a closed form for this pair, else None."""
    case = compose_case(w1_shape, g1, w2_shape, g2)
    return {"pointwise_after": g2, "pointwise_first": g1, "depthwise_after_1x1": g1}.get(case)


def compose_vjp(
    w1: Tensor, g1: int, w2: Tensor, g2: int, grad: Tensor, *, need_w1: bool = True, need_w2: bool = True,
    shared_filter: bool = False, launch_bound: bool = False, scale: Tensor | None = None, traced: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of ``<grad, compose(w1, g1, w2, g2)>`` w.r.t. ``w1`` and ``w2``, in closed form.

    Needs only the operands (never the composed kernel), so a squeeze can keep
    nothing for backward. Supports the cases of :func:`cheap_vjp_groups`. A gradient
    that is not needed (a fixed kernel) is not computed and returned as None;
    ``shared_filter`` says that a per-channel ``w2`` is the same for every channel
    (average pooling), which turns its contraction into one matrix-vector product.
    ``launch_bound``: fewest operators (a GPU's eager step is bound by issuing them) rather
    than the CPU's fastest evaluation where the two differ. ``scale`` (per output channel of
    ``w2``): the composition is of ``w1`` and ``scale * w2``, and the second gradient is the
    scaled kernel's; the scaling is fused into the copy that reorders ``w2`` where there is one.
    ``traced`` (code for a compiler): short contractions written out term by term
    (:func:`batched_product`), and no out= writes (:func:`mul_contiguous`).
    """
    case = compose_case(w1.shape, g1, w2.shape, g2)
    if scale is not None and (case not in ("pointwise_after", "pointwise_first") or scale.numel() != w2.shape[0]):
        w2, scale = scale_channels(w2, scale), None  # nothing to fuse into, or one scalar
    c1, c0g = w1.shape[:2]
    c2 = w2.shape[0]
    d1 = d2 = None
    if case == "pointwise_after":
        r, o, m = g1 // g2, c2 // g2, c1 // g1
        if r == 1:
            # W1 of W2's groups (Rep-1x1's 1x1 -> 1x1): per group W2 [o, m] @ W1 [m, i*k*k] is the kernel
            # in its own layout, so both gradients are products on views, with no reordered copy
            g3 = grad.reshape(g2, o, -1)  # [G, o, i*k*k]
            if need_w2:
                w1t = kept_view(w1, ("G,ikk,m", g2), lambda t: t.reshape(g2, m, -1).transpose(1, 2))
                d2 = torch.bmm(g3, w1t).reshape(w2.shape)  # [G, o, m]
            if need_w1:
                w2t = kept_view(w2, ("G,m,o", g2), lambda t: t.reshape(g2, o, m).transpose(1, 2))  # scale * W2, transposed
                if scale is not None:
                    w2t = w2t * _kept_reshape(scale, g2, 1, o)
                d1 = torch.bmm(w2t, g3).reshape(w1.shape)  # [G, m, i*k*k]
            return d1, d2
        # the gradient as [G*r, i*k*k, o] (a strided view when G == 1): the product's long
        # dimension o is its output's contiguous one
        gt = grad.reshape(g2, o, r, -1).permute(0, 2, 3, 1).reshape(g2 * r, -1, o) if need_w2 or launch_bound else None
        # (each temporary dropped once used: inside a CUDA-graph recording the largest group's
        # live ones set the size of the graphs' memory pool)
        if need_w1 and launch_bound:  # one product per fine group: [m, o] @ [o, i*k*k]
            a = _scaled_pw_rows(w2, g2, r, scale, "m,o", traced=traced)
            d1 = torch.bmm(a, gt.transpose(1, 2)).reshape(w1.shape)
            del a
        if need_w2:
            d2t = batched_product(_kept_reshape(w1, g2 * r, m, -1), gt, traced)  # [G*r, m, o], over i*k*k
            del gt
            # made contiguous: the scale's products and autograd's accumulation into the
            # parameter then run on matching strides (instead of slower mixed-stride passes);
            # one group as a 2-D transpose, which PyTorch's CPU copy runs blocked (512 x 4096:
            # 2 ms against 14 ms for the same copy written as a batch of one)
            d2 = (d2t.reshape(r * m, o).t() if g2 == 1 else d2t.reshape(g2, r * m, o).transpose(1, 2))
            d2 = d2.contiguous().view(w2.shape)
            del d2t
        if need_w1 and not launch_bound:
            w2s = w2 if scale is None else scale_channels(w2, scale)
            d1 = _pw_after_w1_grad(w2s, grad, g2, r, m, o).reshape(w1.shape)
        return d1, d2
    if case == "pointwise_first":
        kh, kw = w2.shape[-2:]
        # the gradient with taps before channels [G, o*k*k, i] (one copy)
        gr = grad.reshape(g1, c2 // g1, c0g, kh * kw).transpose(2, 3).reshape(g1, -1, c0g)
        if need_w1:  # first, so that its copy of W2 is gone before W2's gradient is made (as above)
            a = _taps_first(w2, g1, scale, traced)
            d1 = torch.bmm(a.transpose(1, 2), gr).reshape(w1.shape)  # [G, m, i]
            del a
        if need_w2:
            w1t = kept_view(w1, ("G,i,m", g1), lambda t: t.reshape(g1, c1 // g1, c0g).transpose(1, 2))
            d2 = torch.bmm(gr, w1t)  # [G, o*k*k, m]
            del gr
            d2 = d2.reshape(c2, kh * kw, c1 // g1).transpose(1, 2).reshape(w2.shape).contiguous()  # as above
        return d1, d2
    if case == "depthwise_after_1x1":
        if need_w1:
            taps = w2.shape[-1] * w2.shape[-2]
            if shared_filter:
                d1 = (grad.reshape(-1, taps) @ w2[0].reshape(taps)).reshape(w1.shape)
            else:
                d1 = batched_product(grad.reshape(c2, c0g, taps), w2.reshape(c2, taps, 1), traced).reshape(w1.shape)
        if need_w2:
            d2 = torch.bmm(w1.reshape(c2, 1, c0g), grad.reshape(c2, c0g, -1)).reshape(w2.shape[0], 1, *grad.shape[-2:])
        return d1, d2
    raise NotImplementedError(f"no closed-form vjp for the {case!r} composition")


def compose_vjp_scaled(w1: Tensor, g1: int, w2: Tensor, g2: int, scale: Tensor, grad: Tensor, scratch, *,
                       need_w1: bool = True, outs: tuple = (None, None, None)
                       ) -> tuple[Tensor | None, Tensor, Tensor] | None:
    """Gradients of ``<grad, scale * compose(w1, g1, w2, g2)>`` w.r.t. ``w1``, ``w2`` and the per-output-
    channel ``scale`` (``[C2, 1, 1, 1]``), in closed form, for a host-bound device: the reordered copies
    of ``grad`` and of the scaled W2 and the products are written into ``scratch``'s buffers (see
    :func:`compose_into`), ``grad`` itself should be one (its views are then kept too). The returned
    gradients are fresh tensors, or ``outs`` (the three written in place, each where not None).
    None where this evaluation does not apply (cases other than 1x1 -> kxk and a pointwise W2 after
    a conv of its own or finer groups: Rep-1x1's 1x1 -> 1x1, dw -> pw): :func:`compose_vjp` then."""
    o1, o2, o3 = outs
    case = compose_case(w1.shape, g1, w2.shape, g2)
    c1, c0g = w1.shape[:2]
    c2 = w2.shape[0]
    if case == "pointwise_first" and tuple(grad.shape[-2:]) == tuple(w2.shape[-2:]):
        kh, kw = w2.shape[-2:]
        o, m = c2 // g1, c1 // g1
        gr = scratch.buf("grad taps", (g1, o, kh * kw, c0g))
        gr.copy_(kept_view(grad, ("G,o,kk,i", g1), lambda t: t.view(g1, o, c0g, kh * kw).transpose(2, 3)))
        gr = _kept_reshape(gr, g1, o * kh * kw, c0g)
        w1t = kept_view(w1, ("G,i,m", g1), lambda t: t.reshape(g1, m, c0g).transpose(1, 2))
        d2 = torch.bmm(gr, w1t, out=scratch.buf("d scaled w2", (g1, o * kh * kw, m)))  # of scale * W2, taps first
        d2 = kept_view(d2, ("as w2",), lambda t: t.view(c2, kh * kw, m).transpose(1, 2).unflatten(2, (kh, kw)))
        d1 = None
        if need_w1:
            at = kept_view(_taps_first(w2, g1, scale, scratch=scratch), ("T",), lambda t: t.transpose(1, 2))
            d1 = torch.bmm(at, gr).reshape(w1.shape) if o1 is None else _bmm_into(at, gr, o1, (g1, m, c0g))
        prod = torch.mul(d2, w2, out=scratch.buf("d scale terms", w2.shape))
        d_scale = prod.sum(dim=(1, 2, 3)) if o3 is None else torch.sum(prod, dim=(1, 2, 3), out=o3)
        col = channel_column(scale)
        return d1, (mul_contiguous(d2, col) if o2 is None else torch.mul(d2, col, out=o2)), d_scale
    r = g1 // g2 if g1 % g2 == 0 else 0
    if case == "pointwise_after" and r == 1:
        # W1 of W2's groups (Rep-1x1's 1x1 -> 1x1): per group W2 [o, m] @ W1 [m, i*k*k] is the kernel in
        # its own layout, so every gradient is a product on views
        o, m = c2 // g2, c1 // g2
        g3 = _kept_reshape(grad, g2, o, -1)
        w1t = kept_view(w1, ("G,ikk,m", g2), lambda t: t.reshape(g2, m, -1).transpose(1, 2))
        d2 = torch.bmm(g3, w1t, out=scratch.buf("d scaled w2", (g2, o, m)))  # of scale * W2
        d1 = None
        if need_w1:
            rows = kept_view(w2, ("G,m,o", g2), lambda t: t.reshape(g2, o, m).transpose(1, 2))
            a = torch.mul(rows, _kept_reshape(scale, g2, 1, o), out=scratch.buf(("scaled pw", "m,o"), rows.shape))
            d1 = torch.bmm(a, g3).reshape(w1.shape) if o1 is None else _bmm_into(a, g3, o1, (g2, m, -1))
        d2 = _kept_reshape(d2, *w2.shape)
        d_scale = rowdot(d2, w2, out=o3)
        col = channel_column(scale)
        return d1, (torch.mul(d2, col) if o2 is None else torch.mul(d2, col, out=o2)), d_scale
    if case == "pointwise_after" and r > 1:
        o, m = c2 // g2, c1 // g1
        gt = scratch.buf("grad", (g2, r, grad.shape[1] * grad.shape[2] * grad.shape[3] // r, o))
        gt.copy_(kept_view(grad, ("G,r,ikk,o", g2, r), lambda t: t.view(g2, o, r, -1).permute(0, 2, 3, 1)))
        gt = _kept_reshape(gt, g2 * r, -1, o)
        d2 = torch.bmm(_kept_reshape(w1, g2 * r, m, -1), gt, out=scratch.buf("d scaled w2", (g2 * r, m, o)))
        d2 = kept_view(d2, ("G,o,r,m",), lambda t: t.view(g2, r, m, o).permute(0, 3, 1, 2))
        d1 = None
        if need_w1:
            a = _scaled_pw_rows(w2, g2, r, scale, "m,o", scratch)
            gtt = kept_view(gt, ("T",), lambda t: t.transpose(1, 2))
            d1 = torch.bmm(a, gtt).reshape(w1.shape) if o1 is None else _bmm_into(a, gtt, o1, (g2 * r, m, -1))
        prod = torch.mul(d2, _kept_reshape(w2, g2, o, r, m), out=scratch.buf("d scale terms", (g2, o, r, m)))
        if o3 is None:
            d_scale = prod.sum(dim=(2, 3)).view(c2)
        else:
            d_scale = o3
            torch.sum(prod, dim=(2, 3), out=_kept_reshape(o3, g2, o))
        col = _kept_reshape(scale, g2, o, 1, 1)
        if o2 is None:
            return d1, mul_contiguous(d2, col).view(w2.shape), d_scale
        torch.mul(d2, col, out=_kept_reshape(o2, g2, o, r, m))
        return d1, o2, d_scale
    return None


def _bmm_into(a: Tensor, b: Tensor, out: Tensor, shape: tuple) -> Tensor:
    """``a @ b`` written into ``out`` (a kernel-shaped tensor) through its kept view of ``shape``."""
    torch.bmm(a, b, out=_kept_reshape(out, *shape))
    return out


def compose_into(out: Tensor, w1: Tensor, g1: int, w2: Tensor, g2: int, scale: Tensor | None = None,
                 traced: bool = False, scratch=None) -> None:
    """``out += scale * compose(w1, g1, w2, g2)`` in place (``scale`` per output channel).

    A per-channel filter after a 1x1 is a broadcast product: it is accumulated
    without building the composed kernel. Other cases compose, then add with the
    scale fused into the addition (one pass over ``out``). ``traced`` (code for a compiler):
    dw -> pw's short contraction written out term by term (:func:`batched_product`).

    ``scratch`` (an object whose ``buf(key, shape)`` gives a contiguous tensor that lives as long as
    the operands, the same one for the same key at every call; see ``orepa.engine.Scratch``): the
    batched compositions (1x1 -> kxk, dw -> pw) write their reordered, scaled copy of W2 and their
    product there through out=, so every view taken of them is made once (:func:`kept_view`) and
    nothing is allocated: the fewest operators for a host-bound device. Same products.
    """
    case = compose_case(w1.shape, g1, w2.shape, g2)
    if scratch is not None and scale is not None and scale.numel() == out.shape[0] \
            and tuple(out.shape[-2:]) == tuple(w2.shape[-2:] if case == "pointwise_first" else w1.shape[-2:]):
        if case == "pointwise_first":
            c2, i, kh, kw = out.shape
            a = _taps_first(w2, g1, scale, scratch=scratch)
            b = _kept_reshape(w1, g1, w2.shape[1], w1.shape[1])
            c = torch.bmm(a, b, out=scratch.buf("composed", (g1, a.shape[1], b.shape[2])))
            out.add_(kept_view(c, ("kernel",), lambda t: _pw_first_unbatch(t, c2, kh, kw)))
            return
        r, o = g1 // g2, w2.shape[0] // g2
        if case == "pointwise_after" and r > 1 and out.is_contiguous():
            a = _scaled_pw_rows(w2, g2, r, scale, "o,m", scratch)
            b = _kept_reshape(w1, g2 * r, w1.shape[0] // g1, -1)
            t = torch.bmm(a, b, out=scratch.buf("composed", (g2 * r, o, b.shape[2])))
            out.view(g2, o, r, -1).add_(kept_view(t, ("G,o,r,ikk",), lambda x: x.view(g2, r, o, -1).transpose(1, 2)))
            return
    if case == "depthwise_after_1x1":
        w1s = w1 if scale is None else scale_channels(w1, scale)
        out.addcmul_(w1s, w2)
        return
    if case == "pointwise_after" and scale is not None and scale.numel() == out.shape[0] and out.is_contiguous() \
            and tuple(out.shape[-2:]) == tuple(w1.shape[-2:]):
        # the product's [G*r, o, i*k*k] read in place as out's [G, o, r, i*k*k]: no reordered copy
        a, b = _pw_after_operands(w1, g1, w2, g2)
        t = batched_product(a, b, traced)
        r, o = g1 // g2, w2.shape[0] // g2
        if r == 1:  # W1 of W2's groups (Rep-1x1's 1x1 -> 1x1): the product is the kernel in its own layout
            out.view(g2, o, -1).addcmul_(t, _kept_reshape(scale, g2, o, 1))
        else:
            out.view(g2, o, r, -1).addcmul_(t.view(g2, r, o, -1).transpose(1, 2), _kept_reshape(scale, g2, o, 1, 1))
        return
    composed = compose(w1, g1, w2, g2)[0]
    if scale is None:
        out.add_(composed)
    else:
        out.addcmul_(composed, channel_column(scale))


def bias_through(w: Tensor, groups: int, bias: Tensor) -> Tensor:
    """Output of ``conv(W, groups)`` on a constant map equal to ``bias`` per channel.

    This is exact for the offline path because branches pad their *input* once
    (see ``orepa.blocks``): an intermediate bias then reaches every output pixel
    through the full kernel, as it does through the squeezed kernel.
    """
    c_out, cin_g = w.shape[:2]
    summed = w.sum(dim=(-1, -2)).reshape(groups, c_out // groups, cin_g)
    return torch.einsum("goi,gi->go", summed, bias.reshape(groups, cin_g)).reshape(c_out)


def compose_affine(
    w1: Tensor, b1: Tensor | None, g1: int, w2: Tensor, b2: Tensor | None, g2: int
) -> tuple[Tensor, Tensor | None, int]:
    """Sequential rule with biases: ``W2 * (W1 * x + b1) + b2``."""
    w, g = compose(w1, g1, w2, g2)
    b = None
    if b1 is not None:
        b = bias_through(w2, g2, b1)
    if b2 is not None:
        b = b2 if b is None else b + b2
    return w, b, g


def add_parallel(kernels: list[tuple[Tensor, Tensor | None]], k=None) -> tuple[Tensor, Tensor | None]:
    """Parallel rule: sum of branch kernels with centre alignment (and their biases), padded to
    ``k`` (default: the largest height and width among them)."""
    if not kernels:
        raise ValueError("add_parallel needs at least one kernel")
    k = k or (max(w.shape[-2] for w, _ in kernels), max(w.shape[-1] for w, _ in kernels))
    weight = sum(pad_to(w, k) for w, _ in kernels)
    biases = [b for _, b in kernels if b is not None]
    return weight, (sum(biases) if biases else None)


def bn_as_affine(
    running_mean: Tensor, running_var: Tensor, gamma: Tensor | None, beta: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """Eval-mode BatchNorm as a per-channel ``x * scale + shift``."""
    inv_std = torch.rsqrt(running_var + eps)
    scale = inv_std if gamma is None else gamma * inv_std
    shift = -running_mean * scale
    if beta is not None:
        shift = shift + beta
    return scale, shift


def fold_bn(
    weight: Tensor,
    bias: Tensor | None,
    running_mean: Tensor,
    running_var: Tensor,
    gamma: Tensor | None,
    beta: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """BN folding: ``BN(conv(x, W) + b) == conv(x, W') + b'`` in eval mode."""
    scale, shift = bn_as_affine(running_mean, running_var, gamma, beta, eps)
    new_bias = shift if bias is None else bias * scale + shift
    return scale_channels(weight, scale), new_bias
