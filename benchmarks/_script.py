"""How a benchmark script ends, shared by ``benchmarks/*.py`` (no script of its own).

Each script parses its flags with the argument types of ``orepa``'s subcommands
(:mod:`orepa.apps.common`: a bad count is argparse's error, exit code 2), checks every path it
will write before it measures (:func:`orepa.apps.checkpoint.check_output_path`) and writes its
JSON with :func:`orepa.apps.checkpoint.write_json` (atomic, strict JSON). Its command line ends
through :func:`run`, imported where ``__name__ == "__main__"`` (where Python puts this folder on
the path), so that a test or ``gpu_session_check.py`` loading a script as a module needs nothing
of this one::

    if __name__ == "__main__":
        from _script import run

        raise SystemExit(run(main))
"""
from __future__ import annotations

import sys
from pathlib import Path

from orepa.apps.common import UserError, fail


def run(main) -> int:
    """``main()`` on the command line's arguments, ended as ``orepa``'s subcommands end: a
    :class:`~orepa.apps.common.UserError` (a refused output path, a bad value found after parsing) is
    one ``error:`` line on stderr, no traceback, and exit code 2 (:func:`~orepa.apps.common.fail`);
    otherwise ``main``'s exit code where it returns one, else 0."""
    try:
        code = main()
    except UserError as exc:
        return fail(Path(sys.argv[0]).name, exc)
    return code if isinstance(code, int) and not isinstance(code, bool) else 0
