"""Check the commands of a dry run of ``benchmarks/gpu_session.sh`` on any machine, before a lent GPU's
few minutes are spent on them (``GPU_SESSION_DRY=1 benchmarks/gpu_session.sh PHASE``; the script writes
each command it would run, shell-quoted, one per line, and calls this on that file at its end).

Each ``orepa`` command is parsed by the command's own parser (flags, choices, types) and, for
``orepa bench``, each ``--methods`` variant is parsed and built on the CPU at 1/16 width (an unknown
variant or option fails here, not after a GPU's start-up); each ``pytest -k EXPR`` must select at least
one test of its file; each benchmark script is parsed by its own parser. Prints one line per command
and exits 1 if any fails.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _strip_runner(argv: list[str]) -> list[str]:
    """``torchrun --nproc_per_node=1 -m orepa ...`` -> ``python3 -m orepa ...``."""
    if argv and argv[0] == "torchrun":
        rest = argv[1:]
        while rest and rest[0].startswith("--"):
            rest = rest[1:]
        return ["python3", *rest]
    return argv


def _parse_orepa(argv: list[str]) -> argparse.Namespace:
    from orepa.cli import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args, extra = build_parser(argv[0]).parse_known_args(argv)
        except SystemExit:
            raise ValueError(err.getvalue().strip() or "the parser refused it") from None
    if extra:
        raise ValueError(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _check_bench(args: argparse.Namespace) -> str:
    from orepa.apps.bench.measure import variant_specs
    from orepa.apps.bench.variants import build_variant, in_zoo, parse_spec, split_run_options
    from orepa.apps.common import method_list
    from orepa.engine import POLICIES

    specs = variant_specs(method_list(args.methods))
    for spec in specs:
        network, builder, _ = split_run_options(spec, args.kernel_builder)
        if builder not in POLICIES:
            raise ValueError(f"{spec}: kernel builder {builder!r} is none of {POLICIES}")
        parse_spec(network)
        build_variant(args.model, network, num_classes=args.num_classes,
                      model_options={"width_mult": 0.0625} if in_zoo(args.model) else None)
    return f"{len(specs)} variants built"


def _check_pytest(argv: list[str]) -> str:
    files = [a for a in argv if a.endswith(".py")]
    k = argv[argv.index("-k") + 1] if "-k" in argv else None
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
           *files, *(["-k", k] if k else [])]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    selected = [line for line in out.stdout.splitlines() if "::" in line]
    if not selected:
        raise ValueError(f"-k {k!r} selects no test of {' '.join(files)}" + (f" ({out.stdout.strip()[-200:]})"
                                                                             if out.returncode not in (0, 5) else ""))
    return f"{len(selected)} tests selected"


def _check_script(argv: list[str]) -> str:
    path = ROOT / argv[0]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            module.build_parser().parse_args(argv[1:])
        except SystemExit:
            raise ValueError(err.getvalue().strip()) from None
    return "parsed"


def check(argv: list[str]) -> str:
    """What the command would do, checked; raises ValueError (or the builder's error) where it would fail."""
    argv = _strip_runner(argv)
    if argv[:3] == ["python3", "-m", "orepa"]:
        args = _parse_orepa(argv[3:])
        return _check_bench(args) if args.command == "bench" else "parsed"
    if argv[:3] == ["python3", "-m", "pytest"]:
        return _check_pytest(argv[3:])
    if argv[:1] == ["python3"] and len(argv) > 1 and argv[1].endswith(".py"):
        return _check_script(argv[1:])
    raise ValueError("not a command this check knows (python3 -m orepa / -m pytest / a benchmark script)")


def main(path: str) -> int:
    failed = 0
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    for line in lines:
        argv = shlex.split(line)
        try:
            said = check(argv)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
            failed += 1
            print(f"FAIL {line}\n     {type(exc).__name__}: {exc}")
        else:
            print(f"ok   {line[:150]}{'...' if len(line) > 150 else ''}  [{said}]")
    print(f"{len(lines) - failed} of {len(lines)} commands would run" + (f"; {failed} would fail" if failed else ""))
    return 1 if failed or not lines else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
