"""Checkpoints trained with the paper's public code, imported into this project's models.

:func:`import_reference` reads a state_dict in the layout of the paper's reference
implementation (``stage0..stage4`` + ``linear``; blocks ``OREPA``, ``OREPA_1x1``,
``OREPA_LargeConv``, ``DBB``, ``ConvBN``, ``RepVGGBlock_OREPA``, ``RepVGGBlock``), reads the
architecture off its keys and shapes, and returns the zoo model in training form holding
those weights, computing the function the reference computes:

* ResNet family (BasicBlock / Bottleneck, the depths of ResNet-18/34/50/101/152 and
  ResNeXt-50 32x4d, any widths): method ``orepa`` (kxk OREPA blocks, Rep-1x1 on 1x1 convs,
  linear deep stem, each where the checkpoint has it), ``dbb`` or ``base``;
* RepVGG family (A and B depths, any widths, no grouped layers): ``orepa-vgg``, ``repvgg`` or
  ``base`` (the reference's ``-t base``: ConvBN blocks).

Two facts of the reference shape the mapping. Its 1x1 -> kxk first factor is a learnable
delta on a fixed identity (``idconv1 + id_tensor``); here the factor itself is the
parameter, so the sum is stored. Its deep stem composes the three 3x3 kernels with
PyTorch's cross-correlation, ``K = T(conv2d(conv2d(T(K0), K1), K2))``, which is the true
composition of ``K0``, ``flip(K1)``, ``flip(K2)``: the second and later 3x3 blocks are
imported spatially flipped (kxk, the second factor of 1x1 -> kxk and the depthwise
kernels flipped; the symmetric average filter as is; the frequency prior's flip is a
sign per channel, moved into that branch's scale), so the squeezed 7x7 kernel is the
reference's. Everything is computed in float64 and cast to ``dtype`` at the end.
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .. import kernels as K
from ..blocks import DBBConv2d, OREPAConv2d, OREPADeepStem, OREPAVGGBlock, RepVGGBlock
from ..state_dicts import find_state_dict, is_state_dict, load_weights_only, strip_prefixes, without_ema_counter
from .repvgg import REPVGG_CONFIGS, build_repvgg
from .resnet import RESNET_CONFIGS, BasicBlock, Bottleneck, resnet_widths
from .zoo import create_model

__all__ = ["import_reference", "read_reference_state_dict", "is_deployed_reference"]

#: row of each OREPA branch in the reference's scaling ``vector`` (kxk block / OREPA-VGG's 3x3 block)
_OREPA_ROWS = {"kxk": 0, "1x1_avg": 1, "1x1_prior": 2, "1x1_kxk": 3, "1x1": 4, "dw_pw": 5}
_OREPA_VGG_ROWS = {"kxk": 0, "1x1_avg": 1, "1x1_prior": 2, "1x1_kxk": 3, "dw_pw": 4}
_BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def read_reference_state_dict(src) -> dict[str, Tensor]:
    """The reference state_dict of ``src``: a path, a bare state_dict, or one inside a checkpoint
    dict (the training script's ``{"state_dict": ..., "optimizer": ...}``, or under another key of
    :data:`orepa.state_dicts.STATE_DICT_KEYS`); wrapper prefixes (``module.`` of DataParallel / DDP and
    torch's ``AveragedModel``, ``_orig_mod.`` of torch.compile) and that EMA's step counter removed, as
    every orepa command reads checkpoints. Files load with ``weights_only=True``: no code in them runs."""
    if isinstance(src, (str, os.PathLike)):
        try:
            src = load_weights_only(src)
        except FileNotFoundError:
            raise ValueError(f"reference checkpoint {os.fspath(src)} does not exist") from None
        except Exception as exc:  # noqa: BLE001 - any failure to read means a damaged or foreign file
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"cannot read reference checkpoint {os.fspath(src)} with weights_only=True: "
                             f"{type(exc).__name__}: {first[:300]}") from None
    key = None if is_state_dict(src) else find_state_dict(src)
    if key is not None:
        src = src[key]
    if not is_state_dict(src):
        found = f"a dict with keys {list(src)[:8]}" if isinstance(src, Mapping) else type(src).__name__
        raise ValueError(f"not a reference checkpoint: expected a state_dict or {{'state_dict': ...}}, got {found}")
    return strip_prefixes(without_ema_counter(src))


class _Reader:
    """float64 views of one reference module's entries; remembers which keys were read."""

    def __init__(self, sd: Mapping[str, Tensor], consumed: set[str], prefix: str = ""):
        self.sd, self.consumed, self.prefix = sd, consumed, prefix

    def sub(self, name: str) -> _Reader:
        return _Reader(self.sd, self.consumed, f"{self.prefix}{name}.")

    def has(self, name: str) -> bool:
        return self.prefix + name in self.sd

    def __call__(self, name: str, rows: int | None = None) -> Tensor:
        """The entry ``name``; ``rows``: only its first rows, the part the reference reads (the rest is
        neither checked nor returned)."""
        key = self.prefix + name
        if key not in self.sd:
            raise ValueError(f"reference checkpoint lacks {key!r}")
        self.consumed.add(key)
        t = self.sd[key] if rows is None else self.sd[key][:rows]
        if not t.is_floating_point() and not name.endswith("num_batches_tracked"):  # only a BN's count is one
            raise ValueError(f"reference checkpoint: {key} holds {t.dtype} values, where a float weight or "
                             "statistic belongs")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"reference checkpoint holds non-finite values (nan or inf) in {key!r}")
        if name.endswith("running_var") and t.is_floating_point() and bool((t < 0).any()):
            # a variance below zero: the BN's sqrt gives nan, named here rather than as nan logits
            raise ValueError(f"reference checkpoint holds a negative running variance in {key!r} "
                             f"(min {t.min().item():.3g}): a damaged BatchNorm statistic")
        return t.to(torch.float64) if t.is_floating_point() else t.clone()

    def bn(self, name: str, into: str) -> dict[str, Tensor]:
        r = self.sub(name)
        return {f"{into}.{k}": r(k) for k in _BN_KEYS if k != "num_batches_tracked" or r.has(k)}


#: reference module kind -> its main conv weight (key under the module's prefix); first match wins
_MAIN_WEIGHT = {"orepa": "weight_orepa_origin", "rep_1x1": "weight_or1x1_origin", "dbb": "dbb_origin.conv.weight",
                "orepa_vgg": "rbr_dense.weight_rbr_origin", "repvgg": "rbr_dense.conv.weight", "conv_bn": "conv.weight"}


#: reference module kind -> the conv its deployed form holds (the conversion script's ``switch_to_deploy``:
#: the block's kernel with its BN folded in as a bias). RepVGG's and OREPA-VGG's blocks both leave
#: ``rbr_reparam`` (RepVGG's own name), so a deployed checkpoint does not say which it was.
_DEPLOYED_CONV = {"orepa": "orepa_reparam", "rep_1x1": "or1x1_reparam", "deep_stem": "or_large_reparam",
                  "dbb": "dbb_reparam", "repvgg": "rbr_reparam", "conv_bn": "conv"}

#: key endings only the authors' modules write (training form, then deployed form)
REFERENCE_KEY_ENDINGS = ("weight_orepa_origin", "weight_or1x1_origin", "dbb_origin.conv.weight",
                         "weight_rbr_origin",
                         *(f".{conv}.weight" for conv in _DEPLOYED_CONV.values() if conv.endswith("_reparam")))


def is_reference_state_dict(sd: Mapping[str, Tensor]) -> bool:
    """Whether ``sd`` is a state_dict of the paper's own code (read by :func:`import_reference`),
    training form or deployed, not of this package."""
    return any(isinstance(k, str) and k.endswith(REFERENCE_KEY_ENDINGS) for k in sd)


def is_deployed_reference(sd: Mapping[str, Tensor]) -> bool:
    """Whether ``sd`` (a reference-layout state_dict) is the deployed form its conversion script
    writes: no BatchNorm left (each block one conv with a bias). Its training form has a BN at
    every conv."""
    keys = [k for k in sd if isinstance(k, str)]
    return not any(k.endswith(".running_mean") for k in keys) and any(
        k.endswith(tuple(f".{conv}.bias" for conv in _DEPLOYED_CONV.values())) for k in keys)


def _site_kind(sd: Mapping[str, Tensor], prefix: str) -> str | None:
    """Which reference module sits at ``prefix`` (``stage1.0.conv1``, ``stage2.3``, ...)."""
    p = prefix + "."
    if p + "weight0.weight_orepa_origin" in sd:
        return "deep_stem"
    if p + "weight0" in sd:
        return "deep_stem_base"  # OREPA_LargeConvBase: not what the reference's models build
    return next((kind for kind, key in _MAIN_WEIGHT.items() if p + key in sd), None) or next(
        (kind for kind, conv in _DEPLOYED_CONV.items() if f"{p}{conv}.bias" in sd), None)


def _out_in(sd: Mapping[str, Tensor], prefix: str) -> tuple[int, int]:
    """(output channels, input channels per group) of the conv at ``prefix``."""
    kind = _site_kind(sd, prefix)
    if kind == "deep_stem" and f"{prefix}.weight0.weight_orepa_origin" in sd:  # first block's inputs, last's outputs
        n = _count(sd, rf"{re.escape(prefix)}\.weight(\d+)\.")
        return sd[f"{prefix}.weight{n - 1}.weight_orepa_origin"].shape[0], \
            sd[f"{prefix}.weight0.weight_orepa_origin"].shape[1]
    key = next((k for k in (f"{prefix}.{_MAIN_WEIGHT.get(kind)}", f"{prefix}.{_DEPLOYED_CONV.get(kind)}.weight")
                if k in sd), None)
    if key is None:
        raise _unknown_site(sd, prefix, kind)
    w = sd[key]
    return w.shape[0], w.shape[1]


def _count(sd: Mapping[str, Tensor], pattern: str) -> int:
    """Number of distinct integers captured by ``pattern`` at the start of keys (blocks of a stage)."""
    rx = re.compile(pattern)
    found = {int(m.group(1)) for k in sd if (m := rx.match(k))}
    if found and found != set(range(len(found))):
        raise ValueError(f"reference blocks matching {pattern!r} are not numbered 0..n-1: {sorted(found)}")
    return len(found)


def _unknown_site(sd: Mapping[str, Tensor], prefix: str, kind: str | None) -> ValueError:
    """The error for a site whose layout is not one the reference writes; a conv with a bias under
    another name than its conversion script's is said to be one."""
    keys = [k for k in sd if k.startswith(prefix + ".")]
    tails = sorted(k.rsplit(".", 1)[-1] for k in keys)
    deployed = tails == ["bias", "weight"] and sd[next(k for k in keys if k.endswith(".weight"))].dim() == 4
    hint = ("; a conv with a bias: a deployed layout, but not under a name the reference's conversion script "
            f"writes ({', '.join(sorted(set(_DEPLOYED_CONV.values())))})" if deployed else "")
    return ValueError(f"unknown or unsupported module layout at {prefix!r} ({kind or 'no known weight'}; "
                      f"keys: {_keys_under(sd, prefix + '.')}){hint}")


def _keys_under(sd: Mapping[str, Tensor], prefix: str, n: int = 6) -> str:
    keys = [k for k in sd if k.startswith(prefix)]
    return ", ".join(keys[:n]) + (", ..." if len(keys) > n else "") if keys else "none"


# --------------------------------------------------------------------------- per-module mappings


def _orepa(r: _Reader, into: str, block: OREPAConv2d, rows: Mapping[str, int], flip: bool = False,
           prefix: str = "weight_orepa_") -> dict[str, Tensor]:
    """An OREPA kxk block (its BN excluded); ``flip``: spatially flipped, see the module docstring."""
    # OREPA-VGG's 6th row (in == out, stride 1) is uninitialised memory (torch.Tensor) that the
    # reference's weight_gen never reads: only the rows of its branches are read (and checked)
    vec = r("vector", rows=len(rows))
    k = block.kernel_size[0]
    names = set(block.branches)
    if names != set(rows):
        raise ValueError(f"{r.prefix}: the reference block has branches {sorted(rows)}, the model built "
                         f"here {sorted(names)}")
    stored = r.sd[r.prefix + "vector"].shape[0]
    if not len(rows) <= stored <= len(_OREPA_ROWS):  # the reference's vector has a row per branch kind
        expected = len(rows) if len(rows) == len(_OREPA_ROWS) else f"{len(rows)} to {len(_OREPA_ROWS)}"
        raise ValueError(f"{r.prefix}vector has {stored} rows, expected {expected}")
    mirror = (lambda w: torch.flip(w, (2, 3))) if flip else (lambda w: w)
    _check_fixed(r, prefix + "avg_avg", torch.full((k, k), 1.0 / (k * k), dtype=torch.float64))
    # the prior the block holds (built in float32, as the reference's buffer): the flip below must
    # be taken of it, not of the exact one, or the stem is off by float32 rounding (1e-9 to 1e-8)
    prior = block.branches["1x1_prior"].prior.kernel()[:, 0].to(torch.float64)
    _check_fixed(r, prefix + "prior", prior)
    if r.has(prefix + "1x1_kxk_idconv1"):
        first = r(prefix + "1x1_kxk_idconv1")
        identity = r("id_tensor") if r.has("id_tensor") else K.tiled_identity_1x1(
            first.shape[0], first.shape[1] * block.groups, block.groups, dtype=torch.float64)
        first = first + identity
    else:
        first = r(prefix + "1x1_kxk_conv1")
    b = f"{into}branches."
    out = {
        f"{b}kxk.conv.weight": mirror(r(prefix + "origin")),
        f"{b}1x1_avg.conv.weight": r(prefix + "avg_conv"),
        f"{b}1x1_prior.conv.weight": r(prefix + "pfir_conv"),
        f"{b}1x1_kxk.conv1.weight": first,
        f"{b}1x1_kxk.conv2.weight": mirror(r(prefix + "1x1_kxk_conv2")),
        f"{b}dw_pw.dw.weight": mirror(r(prefix + "gconv_dw")),
        f"{b}dw_pw.pw.weight": _pw_rows(r(prefix + "gconv_pw"), block.groups),
    }
    if "1x1" in rows:
        out[f"{b}1x1.conv.weight"] = r(prefix + "1x1")
    for name, row in rows.items():
        out[f"{b}{name}.scale.weight"] = vec[row]
    if flip:
        _flip_prior_branch(out, f"{b}", prior, r.prefix)
    return out


def _flip_prior_branch(out: dict[str, Tensor], b: str, prior: Tensor, where: str) -> None:
    """Make the prior branch compute ``pfir (x) flip(prior)`` with the fixed, unflipped prior.

    For an even channel count every channel's flipped filter is +-itself (integer frequencies):
    the sign goes into the branch's scale. Otherwise (half-integer frequencies: the flipped filter
    is a sine, which no channel of the fixed prior holds, so no scale or permutation gives it) the
    difference ``flip(prior) - prior`` is a kxk kernel and goes into the kxk branch, divided by its
    scale. ``prior`` is the block's own (rounded) buffer, so the sum is ``flip`` of what it holds.
    """
    flipped = torch.flip(prior, (1, 2))
    sign = torch.sign((flipped * prior).sum((1, 2)))
    if torch.allclose(flipped, sign.view(-1, 1, 1) * prior, rtol=0, atol=1e-14):
        out[f"{b}1x1_prior.scale.weight"] = out[f"{b}1x1_prior.scale.weight"] * sign
        return
    s_prior, s_kxk = out[f"{b}1x1_prior.scale.weight"], out[f"{b}kxk.scale.weight"]
    if (s_kxk == 0).any() and (s_prior[s_kxk == 0] != 0).any():
        raise ValueError(f"{where}: the flipped frequency prior needs the kxk branch, whose scale is 0 "
                         f"on some channels: this deep-stem block cannot be imported exactly")
    ratio = torch.where(s_kxk == 0, torch.zeros_like(s_kxk), s_prior / s_kxk)
    pfir = out[f"{b}1x1_prior.conv.weight"][:, :, 0, 0]  # [out, in]
    out[f"{b}kxk.conv.weight"] = out[f"{b}kxk.conv.weight"] + ratio.view(-1, 1, 1, 1) * \
        pfir[:, :, None, None] * (flipped - prior)[:, None]


def _pw_rows(pw: Tensor, groups: int) -> Tensor:
    """The reference's grouped dw -> pw composition reads its pointwise rows as ``[out / g, g]``:
    output ``c * (out / g) + j`` of group ``c`` uses row ``j * g + c``. Reordered to plain rows."""
    if groups == 1:
        return pw
    o = pw.shape[0]
    return pw.reshape(o // groups, groups, *pw.shape[1:]).transpose(0, 1).reshape(pw.shape)


def _check_fixed(r: _Reader, name: str, expected: Tensor) -> None:
    """A fixed filter stored by the reference must equal the one computed here."""
    if r.has(name):
        stored = r(name)
        dtype = r.sd[r.prefix + name].dtype
        if not dtype.is_floating_point:
            raise ValueError(f"{r.prefix}{name} holds {dtype} values; the reference stores this filter as floats")
        # stored in the checkpoint's precision (half-precision checkpoints round it to ~1e-3)
        atol = max(1e-6, torch.finfo(dtype).eps) * max(1.0, expected.abs().max().item())
        if stored.shape != expected.shape or not torch.allclose(stored, expected, atol=atol):
            raise ValueError(f"{r.prefix}{name} differs from the filter this project computes for that shape "
                             f"(max difference {(stored - expected).abs().max().item() if stored.shape == expected.shape else 'shape'})")


def _rep_1x1(r: _Reader, into: str) -> dict[str, Tensor]:
    vec = r("vector")
    return {
        f"{into}branches.1x1.conv.weight": r("weight_or1x1_origin"),
        f"{into}branches.1x1.scale.weight": vec[0],
        f"{into}branches.1x1_1x1.conv1.weight": r("weight_or1x1_l2i_conv1"),
        f"{into}branches.1x1_1x1.conv2.weight": r("weight_or1x1_l2i_conv2"),
        f"{into}branches.1x1_1x1.scale.weight": vec[1],
    }


def _deep_stem(r: _Reader, into: str, stem: OREPADeepStem) -> dict[str, Tensor]:
    out = {}
    for i, layer in enumerate(stem.branches["stem"]):
        out.update(_orepa(r.sub(f"weight{i}"), f"{into}branches.stem.layer{i}.", layer, _OREPA_ROWS, flip=i > 0))
    return out


def _dbb(r: _Reader, into: str, block: DBBConv2d) -> dict[str, Tensor]:
    b = f"{into}branches."
    if not r.has("dbb_avg.conv.weight") or not r.has("dbb_1x1.conv.weight"):
        raise ValueError(f"{r.prefix}: a DBB block without its 1x1 branches (groups == out_channels) "
                         f"is not supported")
    kxk = r.sub("dbb_1x1_kxk")
    if kxk.has("idconv1.weight"):
        w = kxk("idconv1.weight")
        first = w + K.tiled_identity_1x1(w.shape[0], w.shape[0], w.shape[0] // w.shape[1], dtype=torch.float64)
    else:
        first = kxk("conv1.weight")
    # the reference pools with F.avg_pool2d (an exact 1/k^2 in float64); the pool kernel here holds the
    # float32 constant, as the reference's OREPA blocks do. The ratio moves into the BN after the pool.
    k = block.kernel_size[0]
    ratio = (1.0 / (k * k)) / block.branches["1x1_avg"].pool.weight.flatten()[0].item()
    avg_bn = r.bn("dbb_avg.avgbn", f"{b}1x1_avg.bn")
    avg_bn[f"{b}1x1_avg.bn.running_mean"] = avg_bn[f"{b}1x1_avg.bn.running_mean"] / ratio
    avg_bn[f"{b}1x1_avg.bn.weight"] = avg_bn[f"{b}1x1_avg.bn.weight"] * ratio
    return {
        f"{b}kxk.conv.weight": r("dbb_origin.conv.weight"), **r.bn("dbb_origin.bn", f"{b}kxk.bn"),
        f"{b}1x1.conv.weight": r("dbb_1x1.conv.weight"), **r.bn("dbb_1x1.bn", f"{b}1x1.bn"),
        f"{b}1x1_avg.conv.weight": r("dbb_avg.conv.weight"), **r.bn("dbb_avg.bn.bn", f"{b}1x1_avg.bn0"),
        **avg_bn,
        f"{b}1x1_kxk.conv1.weight": first, **kxk.bn("bn1.bn", f"{b}1x1_kxk.bn0"),
        f"{b}1x1_kxk.conv2.weight": kxk("conv2.weight"), **kxk.bn("bn2", f"{b}1x1_kxk.bn"),
    }


def _vgg_side_branches(r: _Reader, into: str) -> dict[str, Tensor]:
    """The 1x1 + BN and identity BN branches of a RepVGG-style block."""
    b = f"{into}branches."
    out = {f"{b}1x1.conv.weight": r("rbr_1x1.conv.weight"), **r.bn("rbr_1x1.bn", f"{b}1x1.bn")}
    if r.has("rbr_identity.weight"):
        out.update(r.bn("rbr_identity", f"{b}identity.bn"))
    return out


def _orepa_vgg(r: _Reader, into: str, block: OREPAVGGBlock) -> dict[str, Tensor]:
    dense = r.sub("rbr_dense")
    out = _orepa(dense, f"{into}branches.kxk.orepa.", block.branches["kxk"][0], _OREPA_VGG_ROWS,
                 prefix="weight_rbr_")
    return {**out, **dense.bn("bn", f"{into}branches.kxk.bn"), **_vgg_side_branches(r, into)}


def _repvgg(r: _Reader, into: str) -> dict[str, Tensor]:
    b = f"{into}branches."
    return {f"{b}kxk.conv.weight": r("rbr_dense.conv.weight"), **r.bn("rbr_dense.bn", f"{b}kxk.bn"),
            **_vgg_side_branches(r, into)}


# which module type of this project each reference module becomes
_EXPECTED = {"orepa": OREPAConv2d, "rep_1x1": OREPAConv2d, "deep_stem": OREPADeepStem, "dbb": DBBConv2d,
             "orepa_vgg": OREPAVGGBlock, "repvgg": RepVGGBlock, "conv_bn": nn.Conv2d}


def _site_deployed(sd: Mapping[str, Tensor], ref: str, kind: str) -> bool:
    """Whether the module at ``ref`` is in its deployed form (one conv with a bias, no BN)."""
    return f"{ref}.{_DEPLOYED_CONV.get(kind)}.bias" in sd and f"{ref}.bn.running_mean" not in sd


def _map_site(sd, consumed, ref: str, model: nn.Module, conv_name: str, bn_name: str,
              deployed: bool = False) -> dict[str, Tensor]:
    kind = _site_kind(sd, ref)
    if kind not in _EXPECTED:
        raise _unknown_site(sd, ref, kind)
    module = model.get_submodule(conv_name)
    if deployed:  # the deployed network: the conv's kernel and bias, as they are
        if type(module) is not nn.Conv2d:
            raise ValueError(f"{ref} is a deployed conv but the model built here has {type(module).__name__} at "
                             f"{conv_name}")
        r = _Reader(sd, consumed, f"{ref}.{_DEPLOYED_CONV[kind]}.")
        return {f"{conv_name}.weight": r("weight"), f"{conv_name}.bias": r("bias")}
    fits = type(module) is _EXPECTED[kind]
    if fits and kind in ("orepa", "rep_1x1", "deep_stem"):  # online blocks; Rep-1x1 is the 1x1 one
        fits = module.mode == "online" and (kind == "rep_1x1") == (tuple(module.kernel_size) == (1, 1))
    if not fits:
        raise ValueError(f"{ref} is a reference {kind} module but the model built here has "
                         f"{type(module).__name__} at {conv_name}")
    r = _Reader(sd, consumed, ref + ".")
    into = conv_name + "."
    if kind == "conv_bn":
        return {f"{into}weight": r("conv.weight"), **r.bn("bn", bn_name)}
    if kind == "orepa":
        return {**_orepa(r, into, module, _OREPA_ROWS), **r.bn("bn", bn_name)}
    if kind == "rep_1x1":
        return {**_rep_1x1(r, into), **r.bn("bn", bn_name)}
    if kind == "deep_stem":
        return {**_deep_stem(r, into, module), **r.bn("bn", bn_name)}
    if kind == "dbb":
        return _dbb(r, into, module)
    if kind == "orepa_vgg":
        return _orepa_vgg(r, into, module)
    return _repvgg(r, into)


# --------------------------------------------------------------------------- architectures


def _resnet(sd: Mapping[str, Tensor]) -> tuple[str, str, dict, list[tuple[str, str, str]], str]:
    layers = [_count(sd, rf"stage{i}\.(\d+)\.") for i in range(1, 5)]
    if not all(layers):
        raise ValueError(f"reference ResNet without blocks in some stage (blocks per stage {layers})")
    bottleneck = any(k.startswith("stage1.0.conv3.") for k in sd)
    block = Bottleneck if bottleneck else BasicBlock
    spatial = "conv2" if bottleneck else "conv1"
    width_in = [_out_in(sd, f"stage{i}.0.conv1")[0] for i in range(1, 5)]
    d_out, d_in = _out_in(sd, f"stage1.0.{spatial}")
    groups = width_in[0] // d_in if bottleneck else 1
    planes = [_out_in(sd, f"stage{i}.0.{'conv3' if bottleneck else 'conv2'}")[0] // block.expansion
              for i in range(1, 5)]
    names = [n for n, (b, ls, g, _, _) in RESNET_CONFIGS.items() if b is block and ls == layers and g == groups]
    if not names:
        raise ValueError(f"reference ResNet with {block.__name__} blocks {layers}, groups {groups} matches no zoo "
                         f"model; known: {sorted(RESNET_CONFIGS)}")
    name = names[0]
    _, _, _, wpg, _ = RESNET_CONFIGS[name]
    if bottleneck and [int(p * wpg / 64) * groups for p in planes] != width_in:
        raise ValueError(f"reference bottleneck widths {width_in} do not follow planes {planes} with "
                         f"{groups} groups of width {wpg}")
    # the kxk convs decide the method; a checkpoint mixing their types fits no zoo model (said before
    # the stem, which would be blamed for not fitting the first stage's type)
    kinds: dict[str, str] = {}
    for i, n in enumerate(layers, 1):
        for j in range(n):
            for c in ((spatial,) if bottleneck else ("conv1", "conv2")):
                kind = _site_kind(sd, f"stage{i}.{j}.{c}")
                if kind is None:  # no module the reference writes: its keys, not a block type "None"
                    raise _unknown_site(sd, f"stage{i}.{j}.{c}", kind)
                kinds.setdefault(kind, f"stage{i}.{j}.{c}")
    if len(kinds) > 1:
        raise ValueError("reference ResNet mixes block types in its 3x3 convs ("
                         + ", ".join(f"{kind} from {ref}" for kind, ref in kinds.items())
                         + "): a zoo model has one type")
    stem_kind = _site_kind(sd, "stage0.conv1")
    method = {"orepa": "orepa", "dbb": "dbb", "conv_bn": "base"}.get(_site_kind(sd, f"stage1.0.{spatial}"))
    if method is None or stem_kind not in ("deep_stem", "conv_bn"):
        raise ValueError(f"unsupported reference ResNet: stem {stem_kind}, 3x3 blocks "
                         f"{_site_kind(sd, f'stage1.0.{spatial}')} (keys: {_keys_under(sd, 'stage0.')})")
    stem_out, in_chans = _out_in(sd, "stage0.conv1")
    # the name whose own widths these are (the reference's ResNet-18-2x is wide_resnet18_2), else the first
    name = next((n for n in names if resnet_widths(n) == (stem_out, tuple(planes))), name)
    options: dict = {"widths": planes, "stem_width": stem_out}
    sites = [("stage0.conv1", "conv1", "bn1")]
    for i, n in enumerate(layers, 1):
        for j in range(n):
            convs = ("conv1", "conv2", "conv3") if bottleneck else ("conv1", "conv2")
            sites += [(f"stage{i}.{j}.{c}", f"layer{i}.{j}.{c}", f"layer{i}.{j}.bn{c[-1]}") for c in convs]
            if any(k.startswith(f"stage{i}.{j}.shortcut.") for k in sd):
                sites.append((f"stage{i}.{j}.shortcut", f"layer{i}.{j}.downsample.0", f"layer{i}.{j}.downsample.1"))
    if method == "orepa":
        options["deep_stem"] = stem_kind == "deep_stem"
        options["rep_1x1"] = any(_site_kind(sd, ref) == "rep_1x1" for ref, _, _ in sites)
    return name, method, {"in_chans": in_chans, **options}, sites, "fc"


def _repvgg_arch(sd: Mapping[str, Tensor]) -> tuple[str, str, dict, list[tuple[str, str, str]], str]:
    depths = tuple(_count(sd, rf"stage{i}\.(\d+)\.") for i in range(1, 5))
    kind = _site_kind(sd, "stage0")
    # the reference's RepVGG is built with conv_bn_relu, so its training script's -t base gives ConvBN
    # blocks (stage0.conv / stage0.bn): the zoo's base RepVGG, key for key
    method = {"orepa_vgg": "orepa-vgg", "repvgg": "repvgg", "conv_bn": "base"}.get(kind)
    if method is None:
        if kind is None:  # nothing the reference trains (a deployed checkpoint, a foreign layout): its keys
            raise _unknown_site(sd, "stage0", kind)
        raise ValueError(f"unsupported reference RepVGG block {kind} (keys: {_keys_under(sd, 'stage0.')}); "
                         "the zoo's RepVGGs have RepVGGBlock_OREPA, RepVGGBlock or ConvBN blocks")
    sites = [("stage0", "stage0.conv", "stage0.bn")]
    sites += [(f"stage{i}.{j}", f"stage{i}.{j}.conv", f"stage{i}.{j}.bn") for i in range(1, 5)
              for j in range(depths[i - 1])]
    cin = None
    for ref, _, _ in sites:
        out, per_group = _out_in(sd, ref)
        if cin is not None and per_group != cin:
            raise ValueError(f"{ref} is a grouped conv ({cin} inputs, {per_group} per group): grouped RepVGG "
                             f"(g2/g4 variants) is not in the zoo")
        cin = out
    widths = [_out_in(sd, f"stage{i}.0")[0] for i in range(1, 5)]
    stem_out, in_chans = _out_in(sd, "stage0")
    names = [n for n, (d, _) in REPVGG_CONFIGS.items() if tuple(d) == depths]
    if not names:
        raise ValueError(f"reference RepVGG with depths {list(depths)} matches no zoo model; known: "
                         f"{ {n: list(d) for n, (d, _) in REPVGG_CONFIGS.items()} }")
    # the name whose own widths these are, else the first of that depth with explicit widths
    name = next((n for n in names if [m.out_channels for m in _stage_heads(build_repvgg(n))] == [stem_out, *widths]),
                names[0])
    return name, method, {"in_chans": in_chans, "widths": widths, "stem_width": stem_out}, sites, "linear"


def _stage_heads(model: nn.Module) -> list[nn.Conv2d]:
    return [model.stage0.conv] + [getattr(model, f"stage{i}")[0].conv for i in range(1, 5)]


def import_reference(src, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """This project's model holding the weights of a reference checkpoint: in training form, or,
    given the deployed form the reference's conversion script writes, that deployed network.

    Args:
        src: a path or a state_dict in the layout of the paper's public code (also the
            training script's ``{"state_dict": ...}``, keys prefixed ``module.`` or not).
        dtype: of the returned model's parameters (the mapping is computed in float64).
    Returns:
        ``create_model(...)`` of the matching zoo model and method (in train mode, as
        ``create_model`` returns it; ``model.orepa_config`` says how to rebuild it) with every
        parameter and BN statistic set. ``orepa.reparameterize`` deploys it. A deployed
        checkpoint (:func:`is_deployed_reference`: each block one conv, its BN folded in as a
        bias) gives ``orepa.reparameterize(create_model(...), fuse_bn=True)`` of that model, in
        eval mode, its kernels and biases the checkpoint's: the vanilla layout with BNs folded.
        (Its blocks' branches are gone: it cannot be trained as OREPA again, only fine-tuned as the
        plain network it is. Its keys name RepVGG's and OREPA-VGG's blocks alike, both imported as
        ``repvgg``, whose deployed layout is the same.)
    Raises:
        ValueError: unreadable file, a layout that is not the reference's (the message lists the
            keys that did not match), or a module this project cannot hold exactly.
    """
    sd = read_reference_state_dict(src)
    if any(k.startswith("stage0.conv1.") for k in sd):
        with _layout_errors("the architecture"):
            name, method, options, sites, head = _resnet(sd)
    elif any(k.startswith("stage0.") for k in sd):  # the RepVGG's stem is one block, at stage0 itself
        with _layout_errors("the architecture"):
            name, method, options, sites, head = _repvgg_arch(sd)
    else:
        raise ValueError("not a checkpoint of the paper's ResNet or RepVGG models (expected keys under "
                         f"'stage0.conv1.' (ResNet) or 'stage0.' (RepVGG)); first keys: {', '.join(list(sd)[:8])}")
    if "linear.weight" not in sd:
        raise ValueError("reference checkpoint has no classifier 'linear.weight'")
    num_classes = sd["linear.weight"].shape[0]
    model = create_model(name, method, num_classes=num_classes, **options).to(torch.float64)
    deployed = _one_form(sd, [ref for ref, _, _ in sites])
    if deployed:
        from ..convert import reparameterize

        model = reparameterize(model.eval(), fuse_bn=True)
    consumed: set[str] = set()
    ours: dict[str, Tensor] = {}
    for ref, conv_name, bn_name in sites:
        with _layout_errors(f"reference module {ref!r}"):
            ours.update(_map_site(sd, consumed, ref, model, conv_name, bn_name, deployed))
    head_r = _Reader(sd, consumed, "linear.")
    ours.update({f"{head}.weight": head_r("weight"), f"{head}.bias": head_r("bias")})
    unused = [k for k in sd if k not in consumed and not _ignorable(k)]
    if unused:
        raise ValueError(f"{len(unused)} reference key(s) match nothing in {name}/{method}: "
                         f"{', '.join(unused[:10])}{', ...' if len(unused) > 10 else ''}")
    own = model.state_dict()
    # a BN's batch count may be absent (PyTorch before 0.4.1): load_state_dict keeps the model's 0, as
    # torch does for the reference's own model; momentum 0.1 never reads it
    missing = [k for k in own if k not in ours and not k.endswith("num_batches_tracked")]
    wrong = [f"{k}: reference {list(v.shape)} vs model {list(own[k].shape)}" for k, v in ours.items()
             if k in own and v.shape != own[k].shape]
    extra = [k for k in ours if k not in own]
    if missing or wrong or extra:
        raise ValueError(f"reference checkpoint does not fit {name}/{method} {options}: "
                         f"missing {missing[:5]}, shape mismatches {wrong[:5]}, unplaced {extra[:5]}")
    model.load_state_dict(ours, strict=True)
    return model.to(dtype)


def _one_form(sd: Mapping[str, Tensor], refs: list[str]) -> bool:
    """Whether the modules at ``refs`` are deployed (else in training form); modules of both forms
    (the conversion script deploys every one) are refused, naming the fewer."""
    deployed = {ref: _site_deployed(sd, ref, _site_kind(sd, ref)) for ref in refs}
    most = 2 * sum(deployed.values()) > len(deployed)
    odd = [ref for ref, d in deployed.items() if d != most]
    if odd:
        forms = ("deployed", "training") if most else ("training", "deployed")
        raise ValueError(f"{', '.join(odd[:4])}{', ...' if len(odd) > 4 else ''} {'is' if len(odd) == 1 else 'are'} "
                         f"in the {forms[1]} form (keys: {_keys_under(sd, odd[0] + '.', 3)}) and the checkpoint's other "
                         f"{len(refs) - len(odd)} modules in the {forms[0]} form (the reference's conversion script "
                         "deploys them all): a checkpoint of one form is imported")
    return most


@contextlib.contextmanager
def _layout_errors(what: str):
    """A tensor of another shape or type than the layout's (a 1-D kernel, one with no rows: a group
    count of 0, ...) met while reading ``what``: a ValueError naming it, not an IndexError or a
    ZeroDivisionError from deep inside."""
    try:
        yield
    except (IndexError, RuntimeError, TypeError, ArithmeticError) as exc:
        raise ValueError(f"reading {what}: a tensor of the checkpoint has the wrong shape or type for the "
                         f"reference layout ({type(exc).__name__}: {str(exc)[:120]})") from None


def _ignorable(key: str) -> bool:
    # the unused 6th scaling row of OREPA-VGG blocks is read with the vector; fixed buffers are checked
    return key.endswith(("weight_orepa_avg_avg", "weight_rbr_avg_avg", "weight_orepa_prior", "weight_rbr_prior",
                         "id_tensor"))
