"""The lent-GPU script (benchmarks/gpu_session.sh) checked on any machine: every command of every phase
parses with its command's own parser, every bench variant builds, every ``pytest -k`` selects tests. A GPU
is lent for minutes, by chance; a typo found there costs the session's measurements."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import benchmark_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
PHASES = ("probe", "compile", "steps", "modes", "builder", "defaults", "graphs", "long")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="benchmarks/gpu_session.sh needs bash")


def _checker():
    return benchmark_script("gpu_session_check")


def _recorded(phase: str, results: Path) -> list[str]:
    """The commands ``phase`` would run, as the script writes them in a dry run."""
    env = {**os.environ, "GPU_SESSION_DRY": "record", "RESULTS": str(results), "EPOCHS": "1",
           # python3 is this interpreter where the script runs one (it is only written down here)
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("OUT", None)
    out = subprocess.run(["bash", str(SCRIPT), phase], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, (phase, out.stdout[-2000:], out.stderr[-2000:])
    return [line for line in (results / phase / "dry_commands").read_text().splitlines() if line.strip()]


def test_every_command_of_every_phase_would_run(tmp_path):
    lines = {phase: _recorded(phase, tmp_path) for phase in PHASES}
    for phase, commands in lines.items():
        assert commands, f"phase {phase} runs no command"
    # phases share commands (step_times, the accuracy runs): each distinct one checked once, in one batch
    seen = _checker().Checker().check_all([line for commands in lines.values() for line in commands])
    failed = {line: said for line, said in seen.items() if isinstance(said, Exception)}
    assert not failed, failed
    assert any("variants built" in v for v in seen.values()) and any("tests selected" in v for v in seen.values())


def test_the_check_names_what_would_fail():
    bad = {"python3 -m orepa bench -m resnet18 --methods base orepa:graphz=true --device cuda": "graphz",
           "python3 -m orepa bench -m resnet18 --methods base orepa:builder=compield": "compield",
           "python3 -m orepa train --epochs 1 --kernel-graphz": "--kernel-graphz",
           "python3 -m orepa bench -m resnet18 --reps ten": "ten",
           "python3 -m pytest tests/test_cuda.py -k no_such_test_name": "selects no test",
           "python3 -m pytest tests/test_cuda.py -k 'not ('": "pytest refuses -k 'not (' on tests/test_cuda.py (exit 4): ERROR: Wrong expression",
           "python3 benchmarks/profile_step.py --device cuda --stepz 3": "--stepz",
           "torchrun --nproc_per_node=1 -m orepa train --amp --sync-bn --bogus": "--bogus",
           "python3 -m orepa train --output-dir 'unclosed": "No closing quotation"}
    said = _checker().Checker().check_all([*bad, "python3 -m pytest tests/test_cuda.py -k capture"])
    for line, word in bad.items():
        assert isinstance(said[line], Exception) and word in str(said[line]), (line, said[line])
    assert "tests selected" in said["python3 -m pytest tests/test_cuda.py -k capture"]  # one batch: the others still run
    with pytest.raises(ValueError, match="--bogus"):  # one command alone
        _checker().check(["torchrun", "--nproc_per_node=1", "-m", "orepa", "train", "--bogus"])


def test_the_goals_table_reads_the_recorded_gpu_results(tmp_path, capsys):
    """benchmarks/gpu_goals.py on the H100 results in the repository: each OREPA variant's paired
    ratios against the goals (eager <= 1.25x at batch 64, <= 2.0x at batch 8, the fastest mode
    <= 1.15x at batch 64, peak <= 1.10x, faster than DBB)."""
    import json

    goals = benchmark_script("gpu_goals")
    folder = ROOT / "benchmarks" / "results" / "gpu-h100-builders"
    assert goals.main([str(folder), "--json", str(tmp_path / "goals.json")]) == 0
    rows = {(r["model"], r["batch"], r["mode"], r["variant"]): r for r in json.loads((tmp_path / "goals.json").read_text())["rows"]}
    eager = rows[("resnet18", 64, "eager", "orepa:builder=compiled")]
    assert eager["step_ratio"] == pytest.approx(1.61, abs=0.005) and eager["step_goal"] == 1.25
    assert eager["step_met"] is False and eager["faster_than_dbb"] is True
    graphs = rows[("resnet18", 64, "CUDA graphs", "orepa:builder=compiled")]
    assert graphs["step_goal"] == 1.15 and graphs["step_ratio"] == pytest.approx(1.17, abs=0.005)
    assert rows[("resnet18", 8, "eager", "orepa")]["step_goal"] == 2.0
    assert rows[("resnet18", 8, "CUDA graphs", "orepa")]["step_goal"] is None
    assert rows[("resnet50", 64, "eager", "orepa")]["peak_met"] is True
    # measured with the last step's gradients at the peak step's start: each peak plus its parameters' bytes
    assert eager["peak_corrected"] is True and eager["peak_ratio"] == pytest.approx(1.165, abs=0.002)
    assert eager["peak_met"] is False
    # the state alone (3.2x parameters and their momentum: 288 against 89 MiB) puts ResNet-18 b64 over the goal
    assert eager["peak_floor"] == pytest.approx(1.136, abs=0.002) and eager["peak_floor"] > goals.PEAK_GOAL
    assert rows[("resnet18", 8, "eager", "orepa")]["peak_floor"] == pytest.approx(1.648, abs=0.002)
    out = capsys.readouterr().out
    assert "NVIDIA H100" in out and "| resnet18 b64 eager | orepa:builder=compiled | 1.61x (<= 1.25x) **no** |" in out
    assert "| 1.165x* **no** | 1.136x | 3.32x: OREPA faster |" in out
    assert goals.main([str(tmp_path)]) == 1  # no result there
