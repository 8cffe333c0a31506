"""The ``orepa`` command: one subcommand per application module.

Each subcommand lives in its own module under ``orepa.apps`` exposing
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only
when their subcommand runs, so ``orepa --help`` stays fast and the core
library never imports the applications.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("orepa.apps.demo", "Fashion-MNIST: train OREPA and base ResNets, reparameterize, compare (~10 min CPU)"),
    "train": ("orepa.apps.train", "train a model with the paper's recipe (Fashion-MNIST by default; torchrun for DDP)"),
    "eval": ("orepa.apps.evaluate", "top-1/top-5 of a training-form or deployed checkpoint"),
    "reparam": ("orepa.apps.reparam", "turn a training checkpoint into a deployed (vanilla / BN-folded) one, verified"),
    "bench": ("orepa.apps.bench", "training cost of re-param methods side by side (time, memory, FLOPs)"),
    "analyze": ("orepa.apps.analyze", "branch similarity and branch norms of every re-param block (Fig. viz)"),
    "export": ("orepa.apps.export", "deploy a zoo model (reparameterize + fold BN), export to ONNX / TorchScript, verify"),
}


def build_parser(argv_cmd: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orepa", description="Online Convolutional Re-parameterization")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == argv_cmd:  # only the chosen subcommand's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(cmd if cmd in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
