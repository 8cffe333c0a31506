"""RepVGG family (Ding et al., 2021) in its plain, deployed form: a VGG-like stack of 3x3 conv + BN + ReLU.

Layout (ours; RepVGG's own code names its training branches ``rbr_*``)::

    stage0            ConvBNReLU(in_chans, min(64, 64a), stride 2)
    stage1..stage4    nn.Sequential of ConvBNReLU, the first of each with stride 2
    gap, linear       global average pool, classifier

Each ``ConvBNReLU`` is an ``nn.Sequential`` of ``conv`` (3x3, no bias), ``bn``,
``relu``. Widths ``64a, 128a, 256a, 512b``; depths 1-2-4-14-1 (A series) and
1-4-6-16-1 (B series). The re-param methods (RepVGG, OREPA-VGG, ...) replace
the convs; reparameterizing gives this layout back, state_dict key for key.
Pure torch.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from ..blocks import OREPA_BRANCHES
from ..convert import convert
from .resnet import _explicit_widths
from .zoo import BLOCK_OPTS, Family, block_opts, branch_list, register_family

__all__ = ["ConvBNReLU", "RepVGG", "REPVGG_CONFIGS", "build_repvgg"]


class ConvBNReLU(nn.Sequential):
    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__(OrderedDict(
            conv=nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False),
            bn=nn.BatchNorm2d(out_channels),
            relu=nn.ReLU(inplace=True),
        ))


class RepVGG(nn.Module):
    """A plain RepVGG network.

    Args:
        depths: layers of stage1..stage4 (stage0 is one layer).
        width_multipliers: ``(a, b)``: stage widths ``64a, 128a, 256a, 512b``, stage0 ``min(64, 64a)``.
        small_input: stage0 and stage1 keep stride 1 (for 28x28 / 32x32 images).
    """

    def __init__(self, depths=(2, 4, 14, 1), width_multipliers=(0.75, 2.5), num_classes: int = 1000,
                 in_chans: int = 3, *, small_input: bool = False, width_mult: float = 1.0, widths=None,
                 stem_width: int | None = None):
        super().__init__()
        a, b = (float(m) * float(width_mult) for m in width_multipliers)
        if a <= 0 or b <= 0:
            raise ValueError(f"width multipliers must be positive, got {(a, b)}")
        widths = list(_explicit_widths(widths) or (max(1, int(round(64 * a))), max(1, int(round(128 * a))),
                                                   max(1, int(round(256 * a))), max(1, int(round(512 * b)))))
        stem = int(stem_width) if stem_width is not None else min(64, max(1, int(round(64 * a))))
        if stem < 1:
            raise ValueError(f"stem_width must be positive, got {stem_width!r}")
        self.num_classes, self.in_chans, self.small_input = num_classes, in_chans, small_input
        self.stage0 = ConvBNReLU(in_chans, stem, 1 if small_input else 2)
        cin = stem
        for i, (w, d) in enumerate(zip(widths, depths, strict=True)):
            first_stride = 1 if (small_input and i == 0) else 2
            layers = []
            for j in range(d):
                layers.append(ConvBNReLU(cin, w, first_stride if j == 0 else 1))
                cin = w
            setattr(self, f"stage{i + 1}", nn.Sequential(*layers))
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.num_features = cin
        self.linear = nn.Linear(cin, num_classes) if num_classes > 0 else nn.Identity()
        reductions = (1, 1, 2, 4, 8) if small_input else (2, 4, 8, 16, 32)
        chans = (stem, *widths)
        self.feature_info = [dict(num_chs=c, reduction=r, module=f"stage{i}")
                             for i, (c, r) in enumerate(zip(chans, reductions, strict=True))]

    def forward_features(self, x: Tensor) -> Tensor:
        x = self.stage0(x)
        x = self.stage1(x)
        x = self.stage2(x)
        x = self.stage3(x)
        return self.stage4(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.gap(x).flatten(1)
        return x if pre_logits else self.linear(x)

    def get_classifier(self) -> nn.Module:
        return self.linear

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool not in (None, "avg"):
            raise ValueError("only average pooling is supported")
        self.num_classes = num_classes
        self.linear = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


#: name -> (depths of stage1..4, (a, b)); RepVGG paper, Table 2/3
REPVGG_CONFIGS: dict[str, tuple] = {
    "repvgg_a0": ((2, 4, 14, 1), (0.75, 2.5)),
    "repvgg_a1": ((2, 4, 14, 1), (1.0, 2.5)),
    "repvgg_a2": ((2, 4, 14, 1), (1.5, 2.75)),
    "repvgg_b0": ((4, 6, 16, 1), (1.0, 2.5)),
    "repvgg_b1": ((4, 6, 16, 1), (2.0, 4.0)),
}


def build_repvgg(name: str, num_classes: int = 1000, in_chans: int = 3, *, width_mult: float = 1.0,
                 widths=None, stem_width: int | None = None, small_input: bool = False) -> RepVGG:
    """The plain (base) RepVGG model ``name``; ``width_mult`` multiplies both ``a`` and ``b``;
    ``widths`` (stage1..4) and ``stem_width`` (stage0) set the widths explicitly instead."""
    depths, ab = REPVGG_CONFIGS[name]
    return RepVGG(depths, ab, num_classes, in_chans, small_input=small_input, width_mult=width_mult,
                  widths=widths, stem_width=stem_width)


# --------------------------------------------------------------------------- the zoo family and its methods

REPVGG_METHODS: tuple[str, ...] = ("base", "repvgg", "orepa-vgg", "repvgg-online", "orepa-vgg-offline")
_METHOD_OPTS = {
    "orepa-vgg": (*BLOCK_OPTS, "scaling", "scale_init"),
    "repvgg-online": ("scaling", "scale_init", "init"),
    "orepa-vgg-offline": (*BLOCK_OPTS, "inner_norm"),
}


def _identity_ok(name: str, conv: nn.Conv2d) -> bool:
    return conv.in_channels == conv.out_channels and conv.stride == (1, 1) and conv.groups == 1


def _apply_method(model: nn.Module, method: str, opts: dict, name: str) -> nn.Module:
    if method == "repvgg":
        return convert(model, "repvgg", inplace=True)
    extra = block_opts(opts, "dw_expand", "internal_channels", "scaling", "scale_init", "init")
    if method == "orepa-vgg":
        # supp. table "ra0res": the 1x1 and identity branches stay explicit (with BN); the online
        # 3x3 block holds the 3x3 and the 1x1-3x3, 1x1-avg, 1x1-prior and dw-pw branches
        inner_base = tuple(b for b in OREPA_BRANCHES if b != "1x1")
        return convert(model, "orepa-vgg", inplace=True,
                       branches=branch_list(opts, inner_base), **extra)
    if method == "repvgg-online":
        core, conv_method = ("kxk", "1x1"), "orepa"
    else:  # orepa-vgg-offline: every branch explicit, a BN after each of its convs
        core, conv_method = branch_list(opts), "orepa-offline"
        extra.update(block_opts(opts, "inner_norm"))
    core = tuple(b for b in core if b != "identity")
    # identity branch where shapes allow (in == out, stride 1): two passes of the one convert
    convert(model, conv_method, inplace=True, exclude=lambda n, c: not _identity_ok(n, c),
            branches=(*core, "identity"), **extra)
    return convert(model, conv_method, inplace=True, branches=core, **extra)


register_family(Family(
    name="repvgg", configs=REPVGG_CONFIGS, build=build_repvgg, methods=REPVGG_METHODS, default_method="orepa-vgg",
    common_options=("small_input", "width_mult", "widths", "stem_width"), method_options=_METHOD_OPTS,
    apply_method=_apply_method, first_conv="stage0.conv", classifier="linear",
))
