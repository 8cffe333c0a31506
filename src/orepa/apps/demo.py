"""``orepa demo``: convert a torchvision ResNet-18 with every method, train a few steps,
reparameterize, and show that the deployed plain network computes the same function."""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import orepa


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="orepa,orepa-offline,dbb,repvgg,orepa-vgg")
    p.add_argument("--steps", type=int, default=3, help="SGD steps on random data")
    p.add_argument("-b", "--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64)


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@torch.no_grad()
def _recalibrate_bn(model: nn.Module, x: torch.Tensor, passes: int = 4) -> None:
    """Exact-average BN statistics over a few passes, so eval outputs are sane after a few steps."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    model.train()
    for _ in range(passes):
        model(x)


def run(args: argparse.Namespace) -> int:
    import torchvision

    torch.manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 10, (args.batch_size,))
    base = torchvision.models.resnet18(num_classes=10)
    print(f"{'method':<14}{'converted':>10}{'train params':>14}{'deploy params':>15}{'max|diff|':>12}{'max|y|':>9}{'s/step':>8}")
    for method in args.methods.split(","):
        model, report = orepa.convert(base, method, return_report=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model.train()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = nn.functional.cross_entropy(model(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        step = (time.perf_counter() - t0) / max(args.steps, 1)
        _recalibrate_bn(model, x)
        model.eval()
        with torch.no_grad():
            y = model(x)
            deployed = orepa.reparameterize(model)
            vanilla = torchvision.models.resnet18(num_classes=10)
            vanilla.load_state_dict(deployed.state_dict(), strict=True)  # the vanilla layout, exactly
            diff = (vanilla.eval()(x) - y).abs().max().item()
        print(f"{method:<14}{len(report.converted):>10}{_params(model):>14,}{_params(vanilla):>15,}"
              f"{diff:>12.2e}{y.abs().max().item():>9.3f}{step:>8.2f}")
    return 0
