"""Check the commands of a dry run of ``benchmarks/gpu_session.sh`` on any machine, before a lent GPU's
few minutes are spent on them (``GPU_SESSION_DRY=1 benchmarks/gpu_session.sh PHASE``; the script writes
each command it would run, shell-quoted, one per line, and calls this on that file at its end).

Each ``orepa`` command is parsed by the command's own parser (flags, choices, types) and, for
``orepa bench``, each ``--methods`` variant is parsed and built on the CPU at 1/16 width (an unknown
variant or option fails here, not after a GPU's start-up); each ``pytest -k EXPR`` must parse and select at
least one test of its file; each benchmark script is parsed by its own parser. Prints one line per command
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


#: run in one process for one list of test files: ``pytest --collect-only`` once per ``-k`` expression
#: (argv[1]: the files, argv[2]: the expressions, as JSON; JSON null: no -k), each followed by a line
#: ``SELECTION_END <rc>``; pytest's own selection, not an imitation of its ``-k`` matching
_COLLECT = """
import json, sys, pytest
files, expressions = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for k in expressions:
    rc = pytest.main(["--collect-only", "-q", "-o", "addopts=", "-p", "no:cacheprovider", *files,
                      *(["-k", k] if k is not None else [])])
    print("SELECTION_END", int(rc), flush=True)
"""


def _pytest_selection(argv: list[str]) -> tuple[tuple[str, ...], str | None]:
    """(test files, -k expression) of ``pytest ARGV``."""
    return tuple(a for a in argv if a.endswith(".py")), (argv[argv.index("-k") + 1] if "-k" in argv else None)


class Checker:
    """Checks commands, sharing the work of a batch (:meth:`check_all`): each distinct bench variant is
    built once, and every ``-k`` selection of one list of test files is collected in one process (an
    interpreter and torch started once, not once a command: the dry run of every phase holds 29
    bench commands and 3 selections)."""

    def __init__(self):
        self._built: set[tuple] = set()
        self._collected: dict[tuple[tuple[str, ...], str | None], tuple[list[str], int, str]] = {}

    def _check_bench(self, args: argparse.Namespace) -> str:
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
            if (args.model, network, args.num_classes) not in self._built:
                build_variant(args.model, network, num_classes=args.num_classes,
                              model_options={"width_mult": 0.0625} if in_zoo(args.model) else None)
                self._built.add((args.model, network, args.num_classes))
        return f"{len(specs)} variants built"

    def collect(self, selections: list[tuple[tuple[str, ...], str | None]]) -> None:
        """Collect the tests each of ``selections`` would run, one process per list of files."""
        import json

        by_files: dict[tuple[str, ...], list[str | None]] = {}
        for files, k in selections:
            if (files, k) not in self._collected and k not in by_files.setdefault(files, []):
                by_files[files].append(k)
        for files, expressions in by_files.items():
            if not expressions:
                continue
            out = subprocess.run([sys.executable, "-c", _COLLECT, json.dumps(list(files)), json.dumps(expressions)],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            parts = out.stdout.split("SELECTION_END ")
            for i, k in enumerate(expressions):
                if i + 1 < len(parts):  # the part before its end mark, and the mark's return code
                    text, rc = parts[i], int(parts[i + 1].split(maxsplit=1)[0])
                    text = text.split("\n", 1)[1] if i else text  # drop the previous mark's code
                else:  # the process ended before this selection: its output so far stands as the reason
                    text, rc = parts[i] if i < len(parts) else "", out.returncode or 1
                self._collected[files, k] = ([line for line in text.splitlines() if "::" in line], rc, text)

    def _check_pytest(self, argv: list[str]) -> str:
        files, k = _pytest_selection(argv)
        self.collect([(files, k)])
        selected, rc, text = self._collected[files, k]
        if rc not in (0, 5):  # pytest lists what it collected, then refuses a malformed expression (usage error)
            errors = [line for line in text.splitlines() if line.startswith("ERROR")] or text.strip().splitlines()[-1:]
            raise ValueError(f"pytest refuses -k {k!r} on {' '.join(files)} (exit {rc}): {' '.join(errors)[-300:]}")
        if not selected:
            raise ValueError(f"-k {k!r} selects no test of {' '.join(files)}")
        return f"{len(selected)} tests selected"

    def check(self, argv: list[str]) -> str:
        """What the command would do, checked; raises ValueError (or the builder's error) where it would fail."""
        argv = _strip_runner(argv)
        if argv[:3] == ["python3", "-m", "orepa"]:
            args = _parse_orepa(argv[3:])
            return self._check_bench(args) if args.command == "bench" else "parsed"
        if argv[:3] == ["python3", "-m", "pytest"]:
            return self._check_pytest(argv[3:])
        if argv[:1] == ["python3"] and len(argv) > 1 and argv[1].endswith(".py"):
            return _check_script(argv[1:])
        raise ValueError("not a command this check knows (python3 -m orepa / -m pytest / a benchmark script)")

    def check_all(self, lines: list[str]) -> dict[str, str | Exception]:
        """Each distinct line's result: what it would do, or the exception saying why it would fail."""
        results: dict[str, str | Exception] = {}
        argvs: dict[str, list[str]] = {}
        for line in lines:
            try:
                argvs[line] = _strip_runner(shlex.split(line))
            except ValueError as exc:  # an unbalanced quote: the shell would not run it either
                results[line] = exc
        self.collect([_pytest_selection(a[3:]) for a in argvs.values() if a[:3] == ["python3", "-m", "pytest"]])
        for line, argv in argvs.items():
            try:
                results[line] = self.check(argv)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, the others still checked
                results[line] = exc
        return results


def check(argv: list[str]) -> str:
    """One command checked (:meth:`Checker.check`); a batch shares its work through :meth:`Checker.check_all`."""
    return Checker().check(argv)


def main(path: str) -> int:
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    results = Checker().check_all(lines)
    failed = 0
    for line in lines:
        said = results[line]
        if isinstance(said, Exception):
            failed += 1
            print(f"FAIL {line}\n     {type(said).__name__}: {said}")
        else:
            print(f"ok   {line[:150]}{'...' if len(line) > 150 else ''}  [{said}]")
    print(f"{len(lines) - failed} of {len(lines)} commands would run" + (f"; {failed} would fail" if failed else ""))
    return 1 if failed or not lines else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
