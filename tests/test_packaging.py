"""What the package declares, held to what its code does: the extras name every package the command
line imports, a command without one of them says which extra to install, the code runs on the lowest
torch it declares, an installed copy does not read a checkout around it, and the source distribution
holds what its tests read."""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from orepa import cli
from orepa.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _apps_extra() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["apps"]
    return {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() for req in extra}


def _imported_packages(paths) -> set[str]:
    """Top-level names of the absolute imports in ``paths``' Python files."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.partition(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.partition(".")[0])
    return names


def test_every_package_the_command_line_imports_is_declared_in_the_apps_extra_and_the_readme():
    """numpy and Pillow were imported by the applications without being declared (they came with
    torchvision): each third-party import of orepa.apps and the CLI is in the apps extra (the mm
    integration's in its own), and the README's dependency table names it."""
    src = ROOT / "src" / "orepa"
    imported = _imported_packages([*(src / "apps").rglob("*.py"), src / "cli.py"])
    third_party = imported - set(sys.stdlib_module_names) - {"orepa", "torch", "mmengine", "mmdet", "mmseg"}
    assert third_party <= set(cli.APPS_PACKAGES), f"not in orepa.cli.APPS_PACKAGES: {third_party - set(cli.APPS_PACKAGES)}"
    assert set(cli.APPS_PACKAGES.values()) == _apps_extra()
    table = (ROOT / "README.md").read_text().partition("## Dependencies")[2].lower()
    assert [d for d in cli.APPS_PACKAGES.values() if d not in table] == []


def test_a_command_whose_apps_package_is_missing_says_which_extra_to_install(monkeypatch, capsys):
    """``pip install orepa`` (torch only) then ``orepa eval``: a traceback ending in
    ``ModuleNotFoundError: No module named 'tqdm'``; now one line naming the package and the extra."""
    from orepa.apps import evaluate

    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed
    monkeypatch.setattr(evaluate, "run", lambda args: list(evaluate._progress([1], 1, "eval", True)))
    assert main(["eval", "x.pth"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orepa eval: error: ") and err.count("\n") == 1, err
    assert "tqdm" in err and 'pip install "orepa[apps]"' in err
    # a module of a package (its import name's first part), under its distribution's name
    old = ModuleNotFoundError("No module named 'PIL.AvifImagePlugin'", name="PIL.AvifImagePlugin")  # (an old Pillow)
    assert "needs the package pillow:" in cli.missing_apps_package(old)


def test_a_missing_module_that_no_extra_provides_still_raises(monkeypatch):
    from orepa.apps import evaluate

    def broken(args):
        raise ModuleNotFoundError("No module named 'orepa.nothing'", name="orepa.nothing")

    monkeypatch.setattr(evaluate, "run", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["eval", "x.pth"])


def test_errors_are_told_on_a_torch_without_the_generic_out_of_memory_error(monkeypatch):
    """torch.OutOfMemoryError is torch 2.5's; on torch 2.4 (the lowest declared) every error a command
    raised became ``AttributeError: module 'torch' has no attribute 'OutOfMemoryError'``."""
    from orepa.apps import common, evaluate

    monkeypatch.delattr(torch, "OutOfMemoryError")
    assert common.out_of_memory(RuntimeError("shapes do not match")) is None
    assert common.out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")) \
        .startswith("out of memory (CUDA out of memory")

    def broken(args):
        raise RuntimeError("shapes do not match")

    monkeypatch.setattr(evaluate, "run", broken)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        main(["eval", "x.pth"])


def _git(*args, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("place", [".venv/lib/python3.11/site-packages", "vendor", "vendor/orepa-0.1/src"])
def test_an_installed_orepa_does_not_report_the_commit_of_a_repository_around_it(tmp_path, monkeypatch, place):
    """orepa installed into a project's .venv (a git repository): ``orepa bench`` headed its table
    ``orepa <the project's commit>``, read from four folders above the installed file. Nor where
    ``pip install --target vendor`` put it four folders below the project's top, or an unpacked
    source distribution's ``src/`` lies in the project (a tree that git does not track as orepa's)."""
    from orepa.apps.bench import measure

    project = tmp_path / "project"
    project.mkdir()
    _git("init", "-q", cwd=project)
    _git("-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q", "--allow-empty", "-m", "x", cwd=project)
    installed = project / place / "orepa" / "apps" / "bench" / "measure.py"
    installed.parent.mkdir(parents=True)
    installed.write_text("")
    monkeypatch.setattr(measure, "__file__", str(installed))
    assert measure.git_state() is None


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_checkouts_commit_is_still_reported():
    from orepa.apps.bench import measure

    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    assert measure.git_state()["commit"] == _git("rev-parse", "--short", "HEAD", cwd=ROOT)


@pytest.mark.slow
def test_the_source_distribution_holds_what_its_tests_read_and_the_wheel_the_package_alone(tmp_path):
    """The sdist held tests/test_*.py (setuptools' default) without tests/conftest.py, the files the
    tests import and the benchmarks they run: its tests could not run. The wheel holds the package,
    its subpackages, and no tests or results."""
    pytest.importorskip("setuptools.build_meta")
    built = subprocess.run([sys.executable, "-c", f"""
import json, os
from setuptools import build_meta
os.chdir({str(ROOT)!r})
names = [build_meta.build_sdist({str(tmp_path)!r}), build_meta.build_wheel({str(tmp_path)!r})]
print("BUILT", json.dumps(names))
"""], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    files = json.loads(built.stdout.rpartition("BUILT ")[2])
    with tarfile.open(tmp_path / files[0]) as sdist:
        top = f"{files[0].removesuffix('.tar.gz')}/"
        held = {n.removeprefix(top) for n in sdist.getnames()}
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True) if shutil.which("git") else None
    tracked = set(listed.stdout.splitlines()) if listed is not None and listed.returncode == 0 else set()
    needed = {p for p in tracked if p.split("/")[0] in ("tests", "benchmarks", "src")} or {
        "tests/conftest.py", "tests/reference_layout.py", "benchmarks/_script.py"}
    assert needed - held == set()
    import zipfile

    with zipfile.ZipFile(tmp_path / files[1]) as wheel:
        names = wheel.namelist()
    for sub in ("orepa/apps/bench/measure.py", "orepa/models/zoo.py", "orepa/analysis/branches.py", "orepa/cli.py"):
        assert sub in names
    assert not [n for n in names if not n.startswith(("orepa/", "orepa-"))]
