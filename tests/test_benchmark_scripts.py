"""The measurement scripts (benchmarks/*.py) held to what ``orepa``'s subcommands do: every path a script
will write checked before it measures (never a run's training checkpoint, never a directory; its JSON
report replaces only an earlier report of that script, as ``orepa eval --json`` does), flags
parsed by the subcommands' argument types (``--threads 0``, ``-b 0``: argparse's error, exit code 2),
errors as one line with exit code 2, and ``--methods`` read as ``orepa bench`` reads it."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import benchmark_script, child_env

from orepa.apps.checkpoint import check_output_path, json_text, report_of
from orepa.apps.common import UserError

pytestmark = pytest.mark.usefixtures("one_thread", "earlier_objects_frozen")


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: a refusal comes before any measurement: seconds (imports), where the measurement takes minutes
REFUSED_WITHIN_S = 120


def run_checkpoint(path: Path) -> bytes:
    """A run's training checkpoint (training form with optimizer state, what ``--resume`` continues) at
    ``path``; its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": torch.zeros(4)}, "optimizer": {"state": {}, "param_groups": []}, "epoch": 3,
                "padding": torch.zeros(4096)}, path)
    return path.read_bytes()


def run_script(script: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *argv], cwd=cwd, capture_output=True, text=True,
                          env=child_env(), timeout=REFUSED_WITHIN_S)


#: script, its arguments with CKPT for the checkpoint's path and TMP for a scratch folder, the checkpoint's
#: path relative to the working directory (TMP), the flag the error names
REFUSALS = {
    "aten_ops.py": (["--json", "CKPT"], "victim/checkpoint.pth", "--json"),
    "block_cost.py": (["--json", "CKPT"], "victim/checkpoint.pth", "--json"),
    "recorded_memory.py": (["--json", "CKPT"], "victim/checkpoint.pth", "--json"),
    "recorded_host_time.py": (["--json", "CKPT"], "victim/checkpoint.pth", "--json"),
    "profile_step.py": (["-b", "2", "--image-size", "32", "--json", "CKPT"], "victim/checkpoint.pth", "--json"),
    "bench_detection.py": (["--backbone", "resnet18", "--size", "64", "--json", "CKPT"], "victim/checkpoint.pth",
                           "--json"),
    "gpu_goals.py": (["TMP", "--json", "CKPT"], "victim/checkpoint.pth", "--json"),
    "init_schemes.py": (["--epochs", "1", "--train-subset", "8", "--seeds", "0", "--jobs", "1", "--runs", "TMP/runs",
                         "--out", "CKPT"], "victim/checkpoint.pth", "--out"),
    # the scripts whose results file is fixed (relative to the working directory)
    "compile_trace_cost.py": ([], "benchmarks/results/compile_trace_cost.json", "results file"),
    "compiled_model_launches.py": (["-m", "resnet50"], "benchmarks/results/compiled_model_launches_resnet50.json",
                                   "results file"),
}


def _victim(tmp_path: Path, script: str) -> tuple[list[str], Path, bytes, str]:
    """The arguments of ``script``'s case in :data:`REFUSALS`, the checkpoint made for it, its bytes, the flag."""
    argv, victim, flag = REFUSALS[script]
    ckpt = tmp_path / victim
    held = run_checkpoint(ckpt)
    return [str(ckpt) if a == "CKPT" else a.replace("TMP", str(tmp_path)) for a in argv], ckpt, held, flag


def _ends_through_run(script: str) -> bool:
    """Whether ``benchmarks/SCRIPT``'s ``if __name__ == "__main__":`` ends with ``raise SystemExit(run(main))``
    (:func:`benchmarks._script.run`, the command line's one ending)."""
    import ast

    tree = ast.parse((BENCHMARKS / script).read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("__name__ == '__main__'", '__name__ == "__main__"'):
            return ast.unparse(node.body[-1]) == "raise SystemExit(run(main))" and any(
                ast.unparse(n) == "from _script import run" for n in node.body)
    return False


@pytest.mark.parametrize("script", list(REFUSALS))
def test_a_script_refuses_to_write_over_a_runs_checkpoint_before_it_measures(tmp_path, monkeypatch, capsys, script):
    """``--json victim/checkpoint.pth`` (block_cost.py replaced a 5 MB checkpoint with its JSON, after
    measuring): an error naming the flag before anything is measured or printed (a report replaces no
    checkpoint, as ``orepa eval --json`` says it); the checkpoint byte for byte as it was. Through the
    scripts' command-line ending (``_script.run``, which each script's ``__main__`` calls), as
    ``orepa``'s subcommands end: one ``error:`` line on stderr, no traceback, exit code 2 (a process of
    its own for one script: the next test; one each cost seconds of imports apiece)."""
    monkeypatch.chdir(tmp_path)  # (where the fixed results files are)
    argv, ckpt, held, flag = _victim(tmp_path, script)
    mod = benchmark_script(script.removesuffix(".py"))
    with pytest.raises(UserError, match=rf"^{flag} .* is a checkpoint \(a zip archive\), not a report to replace"):
        mod.main(argv)
    assert capsys.readouterr().out == ""  # (each script prints as it measures)
    assert _ends_through_run(script)
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *argv])
    assert benchmark_script("_script").run(mod.main) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1, out
    assert out.err.startswith(f"orepa {script}: error: {flag} "), out.err
    assert ckpt.read_bytes() == held


def test_a_scripts_refusal_is_one_line_and_exit_code_2(tmp_path):
    """On the command line, in a process of its own (block_cost.py; every script ends through the
    same ``_script.run``, checked in process above): one ``error:`` line on stderr, no traceback,
    exit code 2; nothing measured (nothing on stdout), the checkpoint as it was."""
    script = "block_cost.py"
    argv, ckpt, held, flag = _victim(tmp_path, script)
    done = run_script(script, argv, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == ""
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"orepa {script}: error: {flag} "), done.stderr
    assert "is a checkpoint (a zip archive), not a report to replace" in done.stderr
    assert ckpt.read_bytes() == held


def test_proposition1_refuses_a_runs_checkpoint_in_its_output_dir_before_training(tmp_path, capsys):
    """benchmarks/proposition1.py checks the files it will write in --output-dir before part (a) runs
    (on the command line: one error line, exit code 2, as tests/test_proposition1.py holds it to)."""
    out = tmp_path / "p"
    held = run_checkpoint(out / "proposition1.json")
    with pytest.raises(UserError, match=r"^--output-dir .*proposition1.json is a checkpoint \(a zip archive\)"):
        benchmark_script("proposition1").main(["--steps", "1", "--data", "synthetic", "--output-dir", str(out)])
    assert capsys.readouterr().out == ""
    assert (out / "proposition1.json").read_bytes() == held


def test_a_directory_or_a_bad_force_is_refused_before_any_timing(tmp_path):
    """block_cost.py: a directory given to --json (found after minutes of timing), a --force naming no
    branch (found after the first layer's timings) are one-line errors before the first timing."""
    mod = benchmark_script("block_cost")
    with pytest.raises(UserError, match="--json .* is a directory, not a file"):
        mod.main(["--json", str(tmp_path)])
    with pytest.raises(UserError, match=r"--force 1x1,nope: no branch \['nope'\]"):
        mod.main(["--force", "1x1", "--force", "1x1,nope"])


def test_gpu_goals_refuses_to_write_its_table_over_a_result_it_reads(tmp_path):
    """gpu_goals.py FILE --json FILE replaced the bench result it read with its table."""
    goals = benchmark_script("gpu_goals")
    source = BENCHMARKS / "results" / "gpu-h100-builders"
    result = tmp_path / "bench.json"
    held = next(f for f in sorted(source.glob("*.json")) if goals.collect([str(f)])).read_bytes()
    result.write_bytes(held)
    with pytest.raises(UserError, match="is a bench result this table reads"):
        goals.main([str(tmp_path), "--json", str(result)])
    assert result.read_bytes() == held
    assert goals.main([str(result), "--json", str(tmp_path / "goals.json")]) == 0
    assert json.loads((tmp_path / "goals.json").read_text())  # (strict JSON: Python's reader is not the judge)


#: REFUSALS' scripts and proposition1.py, whose report is proposition1.json in its --output-dir (beside its plots)
REPORTS = {**REFUSALS, "proposition1.py": (["--steps", "1", "--data", "synthetic", "--output-dir", "TMP/p"],
                                           "p/proposition1.json", "--output-dir")}
RESULTS = BENCHMARKS / "results"
#: a report of each script in benchmarks/results; None: the test makes one
RESULT = {"aten_ops.py": "aten_ops.json", "block_cost.py": "block_cost_b2_cpu.json",
          "recorded_memory.py": "recorded_memory.json", "recorded_host_time.py": "recorded_host_time.json",
          "profile_step.py": None, "bench_detection.py": "detection/resnet50_320_cpu.json", "gpu_goals.py": None,
          "init_schemes.py": "init_schemes.json", "compile_trace_cost.py": "compile_trace_cost.json",
          "compiled_model_launches.py": "compiled_model_launches_resnet50.json",
          "proposition1.py": "proposition1/proposition1.json"}
#: what ``orepa eval --json`` writes: a marked report
EVAL_REPORT = {"report": "eval", "checkpoint": "run/checkpoint.pth", "loss": 0.31, "acc1": 90.1, "acc5": 99.8,
               "n": 10000}


def report_text(script: str) -> str:
    """The text of a report of ``script``: its file in benchmarks/results, else one it would write."""
    if RESULT[script]:
        return (RESULTS / RESULT[script]).read_text()
    if script == "gpu_goals.py":
        rows = benchmark_script("gpu_goals").collect([str(RESULTS / "gpu-h100-builders")])
        return json_text(report_of("benchmarks/gpu_goals.py", {"rows": rows}), indent=1)
    return json_text(report_of("benchmarks/profile_step.py", {
        "config": {"model": "resnet18", "methods": ["base", "orepa"], "json": "prof.json"},
        "results": {"base": {"total_ms": 1.0, "categories_ms": {"conv": 1.0}, "ops": []}}}))


def _report_at(tmp_path: Path, script: str, name: str) -> tuple[list[str], Path, str]:
    """``script``'s arguments (:data:`REPORTS`) with its JSON report at ``name`` in TMP where a flag names
    that path (else at the script's own path), that path, the flag the error names."""
    argv, own, flag = REPORTS[script]
    path = tmp_path / (name if "CKPT" in argv else own)
    path.parent.mkdir(parents=True, exist_ok=True)
    return [str(path) if a == "CKPT" else a.replace("TMP", str(tmp_path)) for a in argv], path, flag


class Checked(Exception):
    """A script's check of its report's path passed: the test stops there, before anything is measured."""


def stop_after_check(monkeypatch, mod, path: Path) -> None:
    """``mod``'s checks as they are, and :class:`Checked` (with the check's keywords) once the one of
    ``path`` passed: a test that expects a refusal ends there too where there is none."""
    def check(where, flag, **kw):
        checked = check_output_path(where, flag, **kw)
        if checked.resolve() == path.resolve():
            raise Checked(kw)
        return checked

    monkeypatch.setattr(mod, "check_output_path", check)


def _bench_result(path: Path, script: str) -> None:  # orepa bench's: config, environment, ratios, results
    path.write_bytes((RESULTS / "resnet18_b2_224_cpu.json").read_bytes())


def _run_summary(path: Path, script: str) -> None:  # a run's summary.json, beside the run's checkpoint
    run_checkpoint(path.parent / "checkpoint.pth")
    path.write_bytes((RESULTS / "gpu-h100" / "accuracy_base_default.json").read_bytes())


def _another_scripts(path: Path, script: str) -> None:
    path.write_text(report_text("aten_ops.py" if script == "block_cost.py" else "block_cost.py"))


#: a file that is no report of the script: its name, how it is made, what the refusal says it is
NOT_ITS_REPORT = {
    "onnx": ("model.onnx", lambda p, s: p.write_bytes(b"\x08\x08\x12\x07pytorch\x1a\x052.5.1:\xff\xfe\x00\x9a"),
             "a file that is no JSON report"),
    "eval report": ("eval.json", lambda p, s: p.write_text(json.dumps(EVAL_REPORT)), "the report of orepa eval"),
    "another script's report": ("other.json", _another_scripts, "the report of benchmarks/"),
    "bench result": ("bench.json", _bench_result, "a JSON file that is no report of benchmarks/"),
    "run summary": ("run/summary.json", _run_summary, "a file of the training run in "),
}


@pytest.mark.parametrize("victim", list(NOT_ITS_REPORT))
@pytest.mark.parametrize("script", list(REPORTS))
def test_a_scripts_report_replaces_no_file_of_another_kind(tmp_path, monkeypatch, capsys, script, victim):
    """``aten_ops.py --json model.onnx`` (or a run's summary.json, or the results of another script or
    command) replaced that file with the script's report: an error naming the flag and what the file is,
    before anything is measured or printed; the file byte for byte as it was."""
    name, make, what = NOT_ITS_REPORT[victim]
    if victim == "run summary" and "CKPT" not in REPORTS[script][0]:
        pytest.skip("the script's report has a path of its own, no run's file")
    monkeypatch.chdir(tmp_path)  # (where the fixed results files are)
    argv, path, flag = _report_at(tmp_path, script, name)
    make(path, script)
    held = path.read_bytes()
    mod = benchmark_script(script.removesuffix(".py"))
    stop_after_check(monkeypatch, mod, path)  # (without the check, minutes of measuring)
    with pytest.raises(UserError, match=f"^{re.escape(flag)} [^\n]*{re.escape(path.name)} is {re.escape(what)}"
                                        "[^\n]*, not a report to replace; choose another path$"):
        mod.main(argv)
    assert capsys.readouterr().out == ""
    assert path.read_bytes() == held


@pytest.mark.parametrize("script", list(REPORTS))
def test_a_script_replaces_its_own_earlier_report(tmp_path, monkeypatch, script):
    """A rerun to the same path: the script's report (marked ``"report": "benchmarks/<script>"``, as
    the files in benchmarks/results are) passes the check before measuring."""
    text = report_text(script)
    assert json.loads(text)["report"] == f"benchmarks/{script}"
    monkeypatch.chdir(tmp_path)
    argv, path, _ = _report_at(tmp_path, script, "earlier.json")
    path.write_text(text)
    mod = benchmark_script(script.removesuffix(".py"))
    stop_after_check(monkeypatch, mod, path)
    with pytest.raises(Checked) as passed:
        mod.main(argv)
    assert passed.value.args[0]["report"] == mod.REPORT == f"benchmarks/{script}"
    assert path.read_text() == text


def test_a_rerun_replaces_the_scripts_report(tmp_path):
    """block_cost.py and gpu_goals.py run twice to one path: the second run replaces the first's report,
    marked as the script's."""
    out = tmp_path / "block_cost.json"
    for _ in range(2):
        benchmark_script("block_cost").main(["-b", "1", "--reps", "1", "--json", str(out)])
        held = json.loads(out.read_text())
        assert held["report"] == "benchmarks/block_cost.py" and len(held["rows"]) == 7
    goals = tmp_path / "goals.json"
    for _ in range(2):
        assert benchmark_script("gpu_goals").main([str(RESULTS / "gpu-h100-builders"), "--json", str(goals)]) == 0
        held = json.loads(goals.read_text())
        assert held["report"] == "benchmarks/gpu_goals.py" and held["rows"]


def test_every_result_in_the_repository_is_known_as_its_writers():
    """Each JSON file in benchmarks/results is an orepa bench result, a run's summary, or a report marked
    by the script that wrote it (which a rerun replaces): no script replaces another's, no orepa command
    a script's."""
    writers = {f"benchmarks/{s}" for s in REPORTS}
    for path in sorted(RESULTS.rglob("*.json")):
        held = json.loads(path.read_text())
        if {"config", "environment", "results"} <= held.keys() or "global_step" in held:
            continue  # (orepa bench's results, a run's summary: the scripts replace neither)
        assert held.get("report") in writers, path
        for writer in [*writers, "eval", "reparam"]:
            if writer == held["report"]:
                check_output_path(path, "--json", report=writer)
            else:
                with pytest.raises(UserError, match=f"is the report of {re.escape(held['report'])}, not a report"):
                    check_output_path(path, "--json", report=writer)


#: script, arguments (the smallest settings, where an unchecked value would run), the message argparse gives
BAD_FLAGS = [
    ("block_cost", ["--threads", "0", "-b", "1", "--reps", "1"], "argument --threads: must be a positive integer"),
    ("block_cost", ["-b", "0", "--reps", "1", "--threads", "1"], "argument -b/--batch-size: must be a positive integer"),
    ("block_cost", ["--reps", "0", "-b", "1"], "argument --reps: must be a positive integer"),
    ("bench_detection", ["--threads", "0", "--steps", "0"], "argument --threads: must be a positive integer"),
    ("bench_detection", ["-b", "0", "--steps", "0"], "argument -b/--batch-size: must be a positive integer"),
    ("bench_detection", ["--steps", "-1"], "argument --steps: must be an integer >= 0"),
    ("bench_detection", ["--lr", "nan"], "argument --lr: must be a positive number"),
    ("bench_detection", ["--trainable-layers", "6"], "argument --trainable-layers: invalid choice: 6"),
    ("profile_step", ["--threads", "0"], "argument --threads: must be a positive integer"),
    ("profile_step", ["-b", "0"], "argument -b/--batch-size: must be a positive integer"),
    ("init_schemes", ["-b", "0", "--epochs", "1", "--seeds", "0", "--jobs", "1", "--runs", "TMP/runs", "--out",
                      "TMP/out.json"], "argument -b/--batch-size: must be a positive integer"),
    ("init_schemes", ["--seeds", "-1", "--epochs", "1", "--jobs", "1", "--runs", "TMP/runs", "--out", "TMP/out.json"],
     "argument --seeds: must be an integer in [0, 2**32 - 1]"),
    ("init_schemes", ["--jobs", "0", "--runs", "TMP/runs", "--out", "TMP/out.json"],
     "argument --jobs: must be a positive integer"),
    ("proposition1", ["--seeds", "-1", "--steps", "1", "--data", "synthetic", "--output-dir", "TMP/p"],
     "argument --seeds: must be an integer in [0, 2**32 - 1]"),
]


@pytest.mark.parametrize("script,argv,said", BAD_FLAGS)
def test_a_bad_count_is_argparses_error(tmp_path, capsys, script, argv, said):
    """``--threads 0`` (block_cost.py ignored it; bench_detection.py ended in a traceback), ``-b 0``
    (block_cost.py printed timings of empty batches), ...: exit code 2 with argparse's message."""
    mod = benchmark_script(script)
    with pytest.raises(SystemExit) as exc:
        mod.main([a.replace("TMP", str(tmp_path)) for a in argv])
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def test_the_fixed_path_scripts_take_only_zoo_models_with_an_orepa_method(capsys):
    """compile_trace_cost.py / compiled_model_launches.py -m: a name argparse checks (it failed after
    base's trace), and their counts' flags positive."""
    for script, argv, said in (("compile_trace_cost", ["--width-mult", "0"], "argument --width-mult: must be a positive"),
                               ("compile_trace_cost", ["--top", "0"], "argument --top: must be a positive integer"),
                               ("compiled_model_launches", ["-m", "resnet9"], "argument -m/--model: invalid choice")):
        with pytest.raises(SystemExit) as exc:
            benchmark_script(script).main(argv)
        assert exc.value.code == 2 and said in capsys.readouterr().err, script


def test_methods_split_at_the_commas_outside_an_options_brackets():
    """bench_detection's variant options are Python literals (``returned_layers=[2,3,4]``): a split at
    every comma cut them apart."""
    from orepa.apps.common import method_list

    assert method_list(["orepa:returned_layers=[2,3,4],base", "dbb:backbone_options={'a':1,'b':2}"]) == [
        "orepa:returned_layers=[2,3,4]", "base", "dbb:backbone_options={'a':1,'b':2}"]
    assert method_list(["base,orepa", "orepa"]) == ["base", "orepa"]


def test_profile_step_takes_methods_as_orepa_bench_does(tmp_path, capsys):
    """profile_step.py --methods base,orepa: two variants, as ``orepa bench --methods base,orepa``
    (it was one unknown method "base,orepa"); the report's config lists them one a word, and the
    printed report has the online variant's top operators."""
    mod = benchmark_script("profile_step")
    out = tmp_path / "prof.json"
    # (at 1/16 width: the script's flags and report are what is checked, not ResNet-18's operators' times)
    res = mod.main(["-m", "resnet18", "--model-option", "width_mult=0.0625", "-b", "2", "--image-size", "32",
                    "--num-classes", "10", "--steps", "1", "--warmup", "1", "--top", "1", "--threads", "1",
                    "--methods", "base,orepa", "--json", str(out)])
    assert list(res) == ["base", "orepa"]
    assert "orepa: top operators" in capsys.readouterr().out
    held = json.loads(out.read_text())
    assert held["config"]["methods"] == ["base", "orepa"] and set(held["results"]) == {"base", "orepa"}
    assert mod.build_parser().parse_args(["--methods", "base", "orepa"]).methods == ["base", "orepa"]
    with pytest.raises(UserError, match="--methods .,. names none"):
        mod.main(["--methods", ","])


def test_bench_detection_takes_methods_as_orepa_bench_does():
    """bench_detection.py --methods: words or comma-separated lists, each ``METHOD[:key=value:...]`` read
    as orepa bench reads its variants; an option that does not parse is one line before anything is
    built (it was a traceback), and one of the wrong kind one line from the build."""
    mod = benchmark_script("bench_detection")
    specs = mod.variants(argparse.Namespace(methods=["base,orepa:train_stem=False", "dbb"]))
    assert specs == [("base", "base", {}), ("orepa:train_stem=False", "orepa", {"train_stem": False}), ("dbb", "dbb", {})]
    with pytest.raises(UserError, match="--methods orepa:train_stem expects KEY=VALUE"):
        mod.variants(argparse.Namespace(methods=["orepa:train_stem"]))
    # a value of the wrong kind: refused by the first build, before any variant is measured
    with pytest.raises(UserError, match="variant orepa:train_stem=nope: train_stem must be True, False or None"):
        mod.main(["--backbone", "resnet18", "--size", "64", "--steps", "0", "--detectors", "retinanet",
                  "--methods", "orepa:train_stem=nope"])
    with pytest.raises(UserError, match="--size 4: the synthetic images need at least 8 pixels"):
        mod.main(["--size", "4"])
