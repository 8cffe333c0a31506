"""Checkpoints in the layout of the paper's public code, for tests: a float64 evaluator and a generator.

The evaluator computes a reference-layout state_dict's logits the way the reference code
composes kernels (as ``../shared/fixtures/reference/README.md`` describes: each OREPA
kernel the scaled sum of its branches, the grouped dw -> pw composition reading its
pointwise rows as ``[out / g, g]``, the deep stem ``T(conv2d(conv2d(T(K0), K1), K2))``,
DBB and RepVGG branches on the feature map with their BNs). It does not use
``orepa``: tests first check it against the fixtures' float64 outputs, then use it as the
reference for random checkpoints of architectures no fixture covers (other depths, odd
widths, groups).
"""
from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

EPS = 1e-5


# --------------------------------------------------------------------------- evaluator


def _bn(x, sd, p):
    return F.batch_norm(x, sd[p + "running_mean"], sd[p + "running_var"], sd[p + "weight"], sd[p + "bias"],
                        False, 0.0, EPS)


def _prior(cout, k):
    half = cout / 2
    t = torch.empty(cout, k, k, dtype=torch.float64)
    for i in range(cout):
        for h in range(k):
            for w in range(k):
                t[i, h, w] = math.cos(math.pi * ((h if i < half else w) + 0.5) * ((i + 1) if i < half else (i + 1 - half)) / k)
    return t.float().double()  # the reference builds its buffers in float32


def orepa_kernel(sd, p, groups=1, prefix="weight_orepa_"):
    """Kernel of a reference OREPA block (6 rows) or OREPA-VGG 3x3 block (5 rows, prefix weight_rbr_)."""
    v = sd[p + "vector"]
    origin = sd[p + prefix + "origin"]
    cout, _, k, _ = origin.shape
    vgg = prefix == "weight_rbr_"
    avg = sd.get(p + prefix + "avg_avg", torch.full((k, k), 1.0 / k ** 2).double())
    prior = sd.get(p + prefix + "prior", _prior(cout, k))
    w = origin * v[0].view(-1, 1, 1, 1)
    w = w + sd[p + prefix + "avg_conv"] * avg * v[1].view(-1, 1, 1, 1)
    w = w + sd[p + prefix + "pfir_conv"] * prior[:, None] * v[2].view(-1, 1, 1, 1)
    first = sd[p + prefix + "1x1_kxk_idconv1"][:, :, 0, 0]
    first = first + (sd[p + "id_tensor"][:, :, 0, 0] if p + "id_tensor" in sd else _tiled_id(*first.shape))
    second = sd[p + prefix + "1x1_kxk_conv2"]
    t, ig = first.shape
    o, tg = second.shape[:2]
    kxk = torch.einsum("gti,gothw->goihw", first.view(groups, t // groups, ig),
                       second.view(groups, o // groups, tg, k, k)).reshape(o, ig, k, k)
    w = w + kxk * v[3].view(-1, 1, 1, 1)
    if not vgg:
        w = w + F.pad(sd[p + prefix + "1x1"], [k // 2] * 4) * v[4].view(-1, 1, 1, 1)
    dw, pw = sd[p + prefix + "gconv_dw"], sd[p + prefix + "gconv_pw"][:, :, 0, 0]
    cin = dw.shape[0] // 8
    dw = dw.view(groups, cin // groups, 8, k, k)
    pw = pw.reshape(o // groups, groups, cin // groups, 8)
    dwpw = torch.einsum("cgthw,ocgt->coghw", dw, pw).reshape(o, cin // groups, k, k)
    return w + dwpw * v[4 if vgg else 5].view(-1, 1, 1, 1)


def _tiled_id(t, i):
    e = torch.zeros(t, i, dtype=torch.float64)
    e[torch.arange(t), torch.arange(t) % i] = 1
    return e


def rep_1x1_kernel(sd, p):
    v = sd[p + "vector"]
    l2i = torch.einsum("ti,ot->oi", sd[p + "weight_or1x1_l2i_conv1"][:, :, 0, 0], sd[p + "weight_or1x1_l2i_conv2"][:, :, 0, 0])
    return (sd[p + "weight_or1x1_origin"] * v[0].view(-1, 1, 1, 1) + l2i[:, :, None, None] * v[1].view(-1, 1, 1, 1))


def deep_stem_kernel(sd, p):
    n = len({k.split(".")[0] for k in (key[len(p):] for key in sd if key.startswith(p + "weight"))})
    w = orepa_kernel(sd, p + "weight0.").transpose(0, 1)
    for i in range(1, n):
        w = F.conv2d(w, orepa_kernel(sd, f"{p}weight{i}."), padding=2)
    return w.transpose(0, 1)


def _bn_pad(x, sd, p, pad):
    y = F.pad(_bn(x, sd, p), [pad] * 4)
    value = (sd[p + "bias"] - sd[p + "running_mean"] * sd[p + "weight"] / torch.sqrt(sd[p + "running_var"] + EPS))
    value = value.view(1, -1, 1, 1)
    y[:, :, :pad], y[:, :, -pad:], y[:, :, :, :pad], y[:, :, :, -pad:] = value, value, value, value
    return y


def _dbb(x, sd, p, stride, groups):
    def conv_bn(q, s, pad):
        return _bn(F.conv2d(x, sd[q + "conv.weight"], None, s, pad, 1, groups), sd, q + "bn.")
    k = sd[p + "dbb_origin.conv.weight"].shape[-1]
    out = conv_bn(p + "dbb_origin.", stride, k // 2) + conv_bn(p + "dbb_1x1.", stride, 0)
    a = _bn_pad(F.conv2d(x, sd[p + "dbb_avg.conv.weight"], groups=groups), sd, p + "dbb_avg.bn.bn.", k // 2)
    out = out + _bn(F.avg_pool2d(a, k, stride, 0), sd, p + "dbb_avg.avgbn.")
    idw = sd[p + "dbb_1x1_kxk.idconv1.weight"]
    c = F.conv2d(x, idw + _tiled_id(*idw.shape[:2])[:, :, None, None], groups=groups)
    c = F.conv2d(_bn_pad(c, sd, p + "dbb_1x1_kxk.bn1.bn.", k // 2), sd[p + "dbb_1x1_kxk.conv2.weight"], None,
                 stride, 0, 1, groups)
    return out + _bn(c, sd, p + "dbb_1x1_kxk.bn2.")


def _site(x, sd, p, stride, groups=1):
    """A reference conv+BN module at prefix ``p`` (without its ReLU)."""
    if p + "weight0.weight_orepa_origin" in sd:
        w = deep_stem_kernel(sd, p)
        return _bn(F.conv2d(x, w, None, stride, w.shape[-1] // 2), sd, p + "bn.")
    if p + "weight_orepa_origin" in sd:
        w = orepa_kernel(sd, p, groups)
        return _bn(F.conv2d(x, w, None, stride, w.shape[-1] // 2, 1, groups), sd, p + "bn.")
    if p + "weight_or1x1_origin" in sd:
        return _bn(F.conv2d(x, rep_1x1_kernel(sd, p), None, stride), sd, p + "bn.")
    if p + "dbb_origin.conv.weight" in sd:
        return _dbb(x, sd, p, stride, groups)
    w = sd[p + "conv.weight"]
    return _bn(F.conv2d(x, w, None, stride, w.shape[-1] // 2, 1, groups), sd, p + "bn.")


def resnet_forward(sd, x):
    sd = {k: (v.double() if v.is_floating_point() else v) for k, v in sd.items()}
    bottleneck = any(k.startswith("stage1.0.conv3.") for k in sd)
    x = F.max_pool2d(F.relu(_site(x.double(), sd, "stage0.conv1.", 2)), 3, 2, 1)
    for i in range(1, 5):
        j = 0
        while any(k.startswith(f"stage{i}.{j}.") for k in sd):
            p, s = f"stage{i}.{j}.", (2 if i > 1 and j == 0 else 1)
            if bottleneck:
                d = sd[p + "conv1." + _w(sd, p + "conv1.")].shape[0]
                g = d // sd[p + "conv2." + _w(sd, p + "conv2.")].shape[1]
                out = F.relu(_site(x, sd, p + "conv1.", 1))
                out = F.relu(_site(out, sd, p + "conv2.", s, g))
                out = _site(out, sd, p + "conv3.", 1)
            else:
                out = _site(F.relu(_site(x, sd, p + "conv1.", s)), sd, p + "conv2.", 1)
            sc = _site(x, sd, p + "shortcut.", s) if any(k.startswith(p + "shortcut.") for k in sd) else x
            x, j = F.relu(out + sc), j + 1
    return F.linear(x.mean((2, 3)), sd["linear.weight"], sd["linear.bias"])


def _w(sd, p):
    return next(n for n in ("weight_orepa_origin", "weight_or1x1_origin", "dbb_origin.conv.weight", "conv.weight")
                if p + n in sd)


def repvgg_forward(sd, x):
    sd = {k: (v.double() if v.is_floating_point() else v) for k, v in sd.items()}
    x = x.double()
    prefixes = ["stage0."] + [f"stage{i}.{j}." for i in range(1, 5) for j in range(100)
                              if any(k.startswith(f"stage{i}.{j}.") for k in sd)]
    for p in prefixes:
        x = F.relu(_repvgg_block(x, sd, p, 2 if p == "stage0." or p.endswith(".0.") else 1))
    return F.linear(x.mean((2, 3)), sd["linear.weight"], sd["linear.bias"])


def _repvgg_block(x, sd, p, s):
    """A reference RepVGG-layout block at prefix ``p`` (without its ReLU)."""
    if p + "conv.weight" in sd:  # the training script's -t base: a ConvBN block
        return _site(x, sd, p, s)
    if p + "rbr_dense.weight_rbr_origin" in sd:
        dense = _bn(F.conv2d(x, orepa_kernel(sd, p + "rbr_dense.", prefix="weight_rbr_"), None, s, 1), sd,
                    p + "rbr_dense.bn.")
    else:
        dense = _bn(F.conv2d(x, sd[p + "rbr_dense.conv.weight"], None, s, 1), sd, p + "rbr_dense.bn.")
    out = dense + _bn(F.conv2d(x, sd[p + "rbr_1x1.conv.weight"], None, s), sd, p + "rbr_1x1.bn.")
    if p + "rbr_identity.weight" in sd:
        out = out + _bn(x, sd, p + "rbr_identity.")
    return out


# --------------------------------------------------------------------------- deployed form

#: the reference module at a site (by its main weight) -> the conv its conversion script leaves
_DEPLOYED_NAME = {"weight0.weight_orepa_origin": "or_large_reparam", "weight_orepa_origin": "orepa_reparam",
                  "weight_or1x1_origin": "or1x1_reparam", "dbb_origin.conv.weight": "dbb_reparam",
                  "rbr_dense.weight_rbr_origin": "rbr_reparam", "rbr_dense.conv.weight": "rbr_reparam",
                  "conv.weight": "conv"}


def deploy_reference(sd):
    """What the reference's conversion script writes for a training-form ``sd`` (groups 1): each
    block one conv with a bias under its deployed name. Each site's kernel and bias are read off
    its float64 evaluator (the functions above, which hold every branch and BN) by probing it,
    as an affine map that is a conv with padding k // 2 (DBB's BN-and-pad layers keep it one at
    the borders): the bias is its output on zeros, the kernel its answer to one-hot inputs."""
    sd = {k: (v.double() if v.is_floating_point() else v) for k, v in sd.items()}
    resnet = any(k.startswith("stage0.conv1.") for k in sd)
    site = re.compile(r"^(stage0\.conv1|stage\d\.\d+\.(?:conv\d|shortcut))\." if resnet else r"^(stage0|stage\d\.\d+)\.")
    out = {"linear.weight": sd["linear.weight"], "linear.bias": sd["linear.bias"]}
    for p in dict.fromkeys(m.group(1) for k in sd if (m := site.match(k))):
        main = next(n for n in _DEPLOYED_NAME if p + "." + n in sd)
        w = sd[f"{p}.{main}"]
        k = 7 if main.startswith("weight0.") else w.shape[-1]
        fn = _site if resnet else _repvgg_block
        kernel, bias = _probe(lambda x, p=p: fn(x, sd, p + ".", 1), w.shape[1], k)
        out[f"{p}.{_DEPLOYED_NAME[main]}.weight"], out[f"{p}.{_DEPLOYED_NAME[main]}.bias"] = kernel, bias
    return out


def _probe(f, cin, k):
    c = k // 2
    bias = f(torch.zeros(1, cin, k, k, dtype=torch.float64))[0, :, c, c]
    one_hot = torch.zeros(cin, cin, k, k, dtype=torch.float64)
    one_hot[torch.arange(cin), torch.arange(cin), c, c] = 1
    # output[i, o, y, x] = kernel[o, i, 2c - y, 2c - x] + bias[o]
    kernel = (f(one_hot) - bias.view(1, -1, 1, 1)).flip(2, 3).transpose(0, 1).contiguous()
    return kernel, bias


# --------------------------------------------------------------------------- generator


class _Gen:
    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.sd = {}

    def t(self, name, *shape, scale=0.3):
        if len(shape) == 4:  # conv weights: unit gain, so that deep random nets stay well conditioned
            scale = scale / (shape[1] * shape[2] * shape[3]) ** 0.5
        self.sd[name] = (torch.randn(*shape, generator=self.g) * scale).float()

    def bn(self, p, c):
        self.t(p + "weight", c)
        self.sd[p + "weight"] += 1
        self.t(p + "bias", c, scale=0.1)
        self.t(p + "running_mean", c, scale=0.1)
        self.sd[p + "running_var"] = (torch.rand(c, generator=self.g) + 0.5).float()
        self.sd[p + "num_batches_tracked"] = torch.tensor(3)

    def orepa(self, p, cin, cout, k=3, groups=1, vgg=False):
        pre = "weight_rbr_" if vgg else "weight_orepa_"
        self.t(p + pre + "origin", cout, cin // groups, k, k)
        self.t(p + pre + "avg_conv", cout, cin // groups, 1, 1)
        self.t(p + pre + "pfir_conv", cout, cin // groups, 1, 1)
        if not vgg:
            self.t(p + pre + "1x1", cout, cin // groups, 1, 1)
        mid = cin if (groups <= 4 if not vgg else groups < cout) else 2 * cin
        self.t(p + pre + "1x1_kxk_idconv1", mid, cin // groups, 1, 1, scale=0.05)
        self.t(p + pre + "1x1_kxk_conv2", cout, mid // groups, k, k)
        self.t(p + pre + "gconv_dw", cin * 8, 1, k, k)
        self.t(p + pre + "gconv_pw", cout, cin * 8 // groups, 1, 1, scale=0.1)
        self.t(p + "vector", 6 if (not vgg or cin == cout) else 5, cout, scale=0.5)
        self.sd[p + pre + "avg_avg"] = torch.full((k, k), 1.0 / k ** 2)
        self.sd[p + "id_tensor"] = _tiled_id(mid, cin // groups).float()[:, :, None, None]
        self.sd[p + pre + "prior"] = _prior(cout, k).float()

    def site(self, kind, p, cin, cout, k, groups=1):
        if kind == "orepa" and k == 1:
            self.t(p + "weight_or1x1_origin", cout, cin, 1, 1)
            mid = min(cin, cout)
            self.t(p + "weight_or1x1_l2i_conv1", mid, cin, 1, 1)
            self.t(p + "weight_or1x1_l2i_conv2", cout, mid, 1, 1)
            self.t(p + "vector", 2, cout, scale=0.5)
        elif kind == "orepa" and k == 7:
            for i, (a, b) in enumerate([(cin, cout), (cout, cout), (cout, cout)]):
                self.orepa(f"{p}weight{i}.", a, b)
        elif kind == "orepa":
            self.orepa(p, cin, cout, k, groups)
        elif kind == "dbb" and k == 3:
            for q in ("dbb_origin.", "dbb_1x1."):
                self.t(p + q + "conv.weight", cout, cin // groups, k if q == "dbb_origin." else 1, k if q == "dbb_origin." else 1)
                self.bn(p + q + "bn.", cout)
            self.t(p + "dbb_avg.conv.weight", cout, cin // groups, 1, 1)
            self.bn(p + "dbb_avg.bn.bn.", cout)
            self.bn(p + "dbb_avg.avgbn.", cout)
            self.t(p + "dbb_1x1_kxk.idconv1.weight", cin, cin // groups, 1, 1, scale=0.05)
            self.bn(p + "dbb_1x1_kxk.bn1.bn.", cin)
            self.t(p + "dbb_1x1_kxk.conv2.weight", cout, cin // groups, k, k)
            self.bn(p + "dbb_1x1_kxk.bn2.", cout)
            return
        else:
            self.t(p + "conv.weight", cout, cin // groups, k, k)
        self.bn(p + "bn.", cout)


def make_resnet(kind, layers, planes, *, bottleneck=False, stem=None, groups=1, width_per_group=64,
                num_classes=10, seed=0):
    """A random reference ResNet / ResNeXt state_dict; ``kind``: ``orepa``, ``dbb`` or ``base``."""
    gen = _Gen(seed)
    stem = stem or planes[0]
    gen.site("orepa" if kind == "orepa" else "base", "stage0.conv1.", 3, stem, 7)
    cin, exp = stem, 4 if bottleneck else 1
    one_by_one = "orepa" if kind == "orepa" else "base"
    for i, (n, pl) in enumerate(zip(layers, planes), 1):
        for j in range(n):
            p, s = f"stage{i}.{j}.", (2 if i > 1 and j == 0 else 1)
            if s != 1 or cin != pl * exp:
                gen.site(one_by_one if bottleneck else "base", p + "shortcut.", cin, pl * exp, 1)
            if bottleneck:
                d = groups * int(pl * width_per_group / 64)
                gen.site(one_by_one, p + "conv1.", cin, d, 1)
                gen.site(kind, p + "conv2.", d, d, 3, groups)
                gen.site(one_by_one, p + "conv3.", d, pl * exp, 1)
            else:
                gen.site(kind, p + "conv1.", cin, pl, 3)
                gen.site(kind, p + "conv2.", pl, pl, 3)
            cin = pl * exp
    gen.t("linear.weight", num_classes, cin)
    gen.t("linear.bias", num_classes)
    return gen.sd


def make_repvgg(depths, widths, stem, *, kind="orepa-vgg", num_classes=10, seed=0):
    """A random reference RepVGG state_dict; ``kind``: ``orepa-vgg`` (``RepVGGBlock_OREPA``), ``repvgg``
    (``RepVGGBlock``) or ``base`` (``ConvBN``, what the training script's ``-t base`` builds)."""
    gen = _Gen(seed)
    cin = 3
    for p, cout, s in [("stage0.", stem, 2)] + [(f"stage{i}.{j}.", w, 2 if j == 0 else 1)
                                                 for i, (d, w) in enumerate(zip(depths, widths), 1) for j in range(d)]:
        if kind == "base":
            gen.site("base", p, cin, cout, 3)
        else:
            if cin == cout and s == 1:
                gen.bn(p + "rbr_identity.", cout)
            if kind == "orepa-vgg":
                gen.orepa(p + "rbr_dense.", cin, cout, vgg=True)
                if s != 1:  # the reference adds the (unused) 6th scaling row only for in == out, stride 1
                    gen.sd[p + "rbr_dense.vector"] = gen.sd[p + "rbr_dense.vector"][:5]
            else:
                gen.t(p + "rbr_dense.conv.weight", cout, cin, 3, 3)
            gen.bn(p + "rbr_dense.bn.", cout)
            gen.t(p + "rbr_1x1.conv.weight", cout, cin, 1, 1)
            gen.bn(p + "rbr_1x1.bn.", cout)
        cin = cout
    gen.t("linear.weight", num_classes, cin)
    gen.t("linear.bias", num_classes)
    return gen.sd
