"""ResNet family (plain conv + BN), with exactly torchvision's module names and layout.

``conv1, bn1, relu, maxpool, layer1..layer4 (BasicBlock / Bottleneck with
conv1/bn1/conv2/bn2[/conv3/bn3]/downsample.0/.1), avgpool, fc`` and
torchvision's initialisation, so a torchvision checkpoint loads strictly into
the base model and the deployed form of every re-param method loads strictly
into ``torchvision.models.<name>()``. Pure torch: torchvision is not imported.

Extras beyond torchvision (they change shapes, not names): ``in_chans``,
``width_mult`` (multiplies the stem and all stage widths, the supplement's
WideResNet-18), ``small_input`` (CIFAR-style stem: 3x3/1 conv, no max-pool),
``num_classes=0`` (``fc`` is an ``nn.Identity``: pooled features).

The bottom of the file registers the family with the zoo: the model names and how the
methods ``dbb``, ``orepa`` (with its ablation presets) and ``orepa-offline`` turn the plain
network into its training form.
"""
from __future__ import annotations

from torch import Tensor, nn

from ..blocks import OREPADeepStem, ReparamConv2d
from ..convert import convert, find_conv_bn_pairs
from .zoo import ABLATIONS, BLOCK_OPTS, Family, block_opts, branch_list, register_family

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "RESNET_CONFIGS", "build_resnet", "resnet_widths"]


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1, dilation: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride, padding=dilation, groups=groups, bias=False, dilation=dilation)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 groups: int = 1, base_width: int = 64):
        super().__init__()
        if groups != 1 or base_width != 64:
            raise ValueError("BasicBlock only supports groups=1 and base_width=64")
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 groups: int = 1, base_width: int = 64):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        if width < 1:
            raise ValueError(f"bottleneck width is 0 for planes={planes}, base_width={base_width}: width_mult too small")
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride, groups)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet layout (no dilation / replace_stride_with_dilation).

    Args:
        block, layers: residual block class and blocks per stage.
        widths: the four stage widths (``planes``); torchvision's are 64, 128, 256, 512.
        stem_width: output channels of ``conv1`` (64 in torchvision).
        groups, width_per_group: ResNeXt cardinality and group width.
        small_input: ``conv1`` is 3x3 stride 1 padding 1 and ``maxpool`` an ``nn.Identity``.
        zero_init_residual: zero the last BN of each block (torchvision's option).
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int], num_classes: int = 1000,
                 in_chans: int = 3, *, widths=(64, 128, 256, 512), stem_width: int = 64, groups: int = 1,
                 width_per_group: int = 64, small_input: bool = False, zero_init_residual: bool = False):
        super().__init__()
        self.inplanes = stem_width
        self.groups, self.base_width = groups, width_per_group
        self.num_classes, self.in_chans, self.small_input = num_classes, in_chans, small_input
        if small_input:
            self.conv1 = nn.Conv2d(in_chans, stem_width, 3, 1, 1, bias=False)
        else:
            self.conv1 = nn.Conv2d(in_chans, stem_width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem_width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity() if small_input else nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, widths[0], layers[0])
        self.layer2 = self._make_layer(block, widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(block, widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(block, widths[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.num_features = widths[3] * block.expansion
        self.fc = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)
                elif isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0)

        # strides of the stem and layer1..4 outputs (timm feature_info, for features_only)
        reductions = (1, 1, 2, 4, 8) if small_input else (2, 4, 8, 16, 32)
        chans = (stem_width, *(w * block.expansion for w in widths))
        modules = ("relu", "layer1", "layer2", "layer3", "layer4")
        self.feature_info = [dict(num_chs=c, reduction=r, module=m) for c, r, m in zip(chans, reductions, modules, strict=True)]

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample, self.groups, self.base_width)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes, groups=self.groups, base_width=self.base_width))
        return nn.Sequential(*layers)

    # timm-style interface (methods only: the module layout stays torchvision's)
    def forward_features(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        return self.layer4(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.avgpool(x).flatten(1)
        return x if pre_logits else self.fc(x)

    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool not in (None, "avg"):
            raise ValueError("only average pooling is supported")
        self.num_classes = num_classes
        self.fc = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


#: name -> (block, layers, groups, width_per_group, width multiplier)
RESNET_CONFIGS: dict[str, tuple] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2], 1, 64, 1.0),
    "resnet34": (BasicBlock, [3, 4, 6, 3], 1, 64, 1.0),
    "resnet50": (Bottleneck, [3, 4, 6, 3], 1, 64, 1.0),
    "resnet101": (Bottleneck, [3, 4, 23, 3], 1, 64, 1.0),
    "resnet152": (Bottleneck, [3, 8, 36, 3], 1, 64, 1.0),
    # supplement, table "wresnet": ResNet-18 with the stem and every stage widened
    "wide_resnet18_1_5": (BasicBlock, [2, 2, 2, 2], 1, 64, 1.5),
    "wide_resnet18_2": (BasicBlock, [2, 2, 2, 2], 1, 64, 2.0),
    "resnext50_32x4d": (Bottleneck, [3, 4, 6, 3], 32, 4, 1.0),
}


def build_resnet(name: str, num_classes: int = 1000, in_chans: int = 3, *, width_mult: float = 1.0,
                 widths=None, stem_width: int | None = None, small_input: bool = False,
                 zero_init_residual: bool = False) -> ResNet:
    """The plain (base) ResNet-family model ``name``; ``width_mult`` multiplies the name's own width.

    ``widths`` (the four stage widths, ``planes``) and ``stem_width`` set widths explicitly instead
    (e.g. the ``int(64 * w)`` widths of the paper's code, which rounding ``width_mult`` may miss).
    """
    block, layers, groups, wpg, _ = RESNET_CONFIGS[name]
    own_stem, own_widths = resnet_widths(name, width_mult)
    widths = _explicit_widths(widths) or own_widths
    stem = int(stem_width) if stem_width is not None else own_stem
    if stem < 1:
        raise ValueError(f"stem_width must be positive, got {stem_width!r}")
    return ResNet(block, layers, num_classes, in_chans, widths=widths, stem_width=stem, groups=groups,
                  width_per_group=wpg, small_input=small_input, zero_init_residual=zero_init_residual)


def resnet_widths(name: str, width_mult: float = 1.0) -> tuple[int, tuple[int, ...]]:
    """``(stem width, the four stage widths)`` of model ``name`` at ``width_mult`` (its own multiplier
    times ``width_mult``, rounded)."""
    mult = RESNET_CONFIGS[name][4] * float(width_mult)
    if mult <= 0:
        raise ValueError(f"width_mult must be positive, got {width_mult!r}")
    return max(1, int(round(64 * mult))), tuple(max(1, int(round(w * mult))) for w in (64, 128, 256, 512))


def _explicit_widths(widths) -> tuple[int, ...] | None:
    """Four positive stage widths, or None when not given."""
    if widths is None:
        return None
    if isinstance(widths, (str, bytes)) or len(widths) != 4 or not all(int(w) == w and w >= 1 for w in widths):
        raise ValueError(f"widths must be four positive ints (one per stage), got {widths!r}")
    return tuple(int(w) for w in widths)


# --------------------------------------------------------------------------- the zoo family and its methods

RESNET_METHODS: tuple[str, ...] = ("base", "dbb", "orepa", "orepa-offline")
_OREPA_OPTS = ("preset", *BLOCK_OPTS, "deep_stem", "rep_1x1")
_METHOD_OPTS = {
    "dbb": ("internal_channels",),
    "orepa": (*_OREPA_OPTS, "scaling", "scale_init", "post_bn", "recompute"),
    "orepa-offline": (*_OREPA_OPTS, "inner_norm"),
}


def _apply_preset(name: str, method: str, options: dict) -> dict:
    bottleneck = RESNET_CONFIGS[name][0] is Bottleneck
    if options.get("deep_stem") and options.get("small_input"):
        # asked for, not a preset's (whose deep stem a small-input network just has no 7x7 stem for): it
        # built the small-input network's 3x3 stem block without a word
        raise ValueError("deep_stem=True replaces a 7x7 stem conv by a linear deep stem, and small_input=True "
                         "makes the stem a 3x3 conv (an OREPA block like every 3x3): pass one of them")
    preset = options.pop("preset", None)
    if preset is None:
        return options
    if preset not in ABLATIONS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(ABLATIONS)}")
    spec = ABLATIONS[preset]
    if method == "orepa-offline" and spec["table"] != "components":
        raise ValueError(f"preset {preset!r} ({spec['table']!r} table) is a linearization of the online block; "
                         f"method 'orepa-offline' supports the 'components' presets only")
    if preset == "rep-1x1" and not bottleneck:
        raise ValueError(f"preset 'rep-1x1' is for bottleneck ResNets ({name} has basic blocks; the paper's "
                         "Rep-1x1 row is ResNet-50's); pass rep_1x1=True to convert the downsample 1x1 convs anyway")
    return {**spec["options"], **options}


def _apply_method(model: nn.Module, method: str, opts: dict, name: str) -> nn.Module:
    bottleneck = RESNET_CONFIGS[name][0] is Bottleneck
    # the 7x7 stem conv stays plain unless the deep stem replaces it (as the reference code does for
    # k >= 7); the 3x3 stem of small_input models is converted like every other 3x3 conv
    big_stem = model.conv1.kernel_size[0] >= 7
    keep_stem = (lambda name, conv: name == "conv1") if big_stem else None
    if method == "dbb":
        return convert(model, "dbb", inplace=True, exclude=keep_stem, **block_opts(opts, "internal_channels"))

    online = method == "orepa"
    scaling = opts.get("scaling", "vector")
    post_bn = opts.get("post_bn", True)
    if not post_bn and not online:
        raise ValueError("post_bn=False is only defined for method 'orepa'")
    branches = branch_list(opts)
    rep_1x1 = opts.get("rep_1x1", bottleneck)
    deep_stem = opts.get("deep_stem", online)
    inner = dict(branches=branches, **block_opts(opts, "dw_expand", "internal_channels", "init"))
    if online:
        inner.update(scaling=scaling, **block_opts(opts, "scale_init", "recompute"))
    blocks = {**inner, **({} if online else block_opts(opts, "inner_norm"))}
    convert(model, method, inplace=True, exclude=keep_stem, rep_1x1=rep_1x1, **blocks)
    if deep_stem and big_stem:
        c = model.conv1
        stem_inner = dict(inner)
        if not online:  # the stacked 3x3 kernels are linear (scaled), run on the feature map
            stem_inner.update(scaling="vector")
        model.conv1 = OREPADeepStem(c.in_channels, c.out_channels, c.kernel_size[0], c.stride[0],
                                    mode="online" if online else "offline", **stem_inner
                                    ).to(device=c.weight.device, dtype=c.weight.dtype)
    if not post_bn:
        for conv_name, bn_name in find_conv_bn_pairs(model)[0]:
            block = model.get_submodule(conv_name)
            if isinstance(block, ReparamConv2d) and block.mode == "online":
                parent, _, attr = bn_name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, nn.Identity())
    return model


register_family(Family(
    name="resnet", configs=RESNET_CONFIGS, build=build_resnet, methods=RESNET_METHODS, default_method="orepa",
    common_options=("small_input", "width_mult", "widths", "stem_width", "zero_init_residual"),
    method_options=_METHOD_OPTS, apply_method=_apply_method, expand_options=_apply_preset,
    first_conv="conv1", classifier="fc",
))
