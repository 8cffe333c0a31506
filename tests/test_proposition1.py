"""Proposition 1 (gradient analysis on multi-branch topology), checked in float64 and empirically."""
import json

import pytest
import torch
from conftest import benchmark_script

from orepa.analysis.proposition1 import MultiBranchConv, check_update
from orepa.apps.proposition1 import load_fashion_mnist, similarity_experiment, synthetic_data

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", ["offline", "online"])
@pytest.mark.parametrize("scaling", ["shared", "none"])
@pytest.mark.parametrize("steps", [1, 5])
def test_shared_scale_updates_like_a_single_conv(scaling, steps, mode):
    r = check_update(scaling, steps=steps, mode=mode, branches=3)
    # SGD on M branches under one shared scale == SGD on gamma * W with the kernel's lr x M, to rounding
    assert r["diff_kernel_lr_x_M"] < 1e-12
    # ... and each channel's update stays in span{W_e[c], dL/dW_e[c]}, like the single layer's
    assert r["span_residual"] < 1e-10
    assert r["update_norm"] > 1e-3 * r["kernel_norm"]  # a real step, not a no-op
    # at the same lr the sum of M kernels moves M times as far: the constant rescale the paper glosses over
    assert r["diff_same_lr"] > 1e-3


@pytest.mark.parametrize("scaling", ["vector", "scalar"])
def test_branch_wise_scales_change_the_update(scaling):
    r = check_update(scaling, steps=1, branches=3)
    # part of the end-to-end update leaves span{W_e[c], G[c]}: no single conv-scale layer (any lr) does that
    assert r["span_residual"] > 1e-2
    assert r["diff_same_lr"] > 1e-3 and r["diff_kernel_lr_x_M"] > 1e-3


@pytest.mark.parametrize("scaling", ["vector", "scalar"])
def test_branch_wise_single_layer_counterpart_starts_from_the_same_kernel(scaling):
    """The single layer compared with branch-wise scales starts at W_e / mean gamma (the same W_e):
    at a vanishing lr the two end-to-end kernels agree, so any later gap is the update's own."""
    r = check_update(scaling, steps=1, branches=3, lr=1e-9)
    assert r["diff_same_lr"] < 1e-6


def test_single_branch_is_the_single_layer():
    for scaling in ("shared", "vector"):
        r = check_update(scaling, steps=3, branches=1)
        assert r["diff_same_lr"] < 1e-12 and r["span_residual"] < 1e-10


def test_multibranch_online_equals_offline():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, 2, 3, 3, generator=g, dtype=torch.float64)
    x = torch.randn(2, 2, 5, 5, generator=g, dtype=torch.float64)
    for scaling, scale in (("shared", torch.rand(4, dtype=torch.float64)),
                           ("vector", torch.rand(3, 4, dtype=torch.float64)),
                           ("scalar", torch.rand(3, dtype=torch.float64)), ("none", None)):
        on, off = MultiBranchConv(w, scaling, scale, "online"), MultiBranchConv(w, scaling, scale, "offline")
        torch.testing.assert_close(on(x), off(x), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="needs a scale"):
        MultiBranchConv(w, "vector", torch.rand(4, dtype=torch.float64))
    # check_update's own arguments: a bare KeyError of its scale table, an autograd error of no branch
    with pytest.raises(ValueError, match=r"scaling must be one of \('shared', 'vector', 'scalar', 'none'\), got 'x'"):
        check_update("x")
    with pytest.raises(ValueError, match="branches must be an int >= 1, got 0"):
        check_update("vector", branches=0)


@pytest.mark.slow
def test_no_scaling_keeps_branch_updates_more_similar():
    """Trained side by side (same init, same batches), the branches' accumulated kernel updates are
    more alike without scaling layers than with vector scaling (mean off-diagonal cosine)."""
    r = similarity_experiment(("none", "vector"), steps=100, batch=32, width=8, n_train=2048, n_test=256,
                              lr=0.1, seed=0, log_every=50)
    none, vector = r["runs"]["none"], r["runs"]["vector"]
    assert none["final_update_cos"] > vector["final_update_cos"] + 0.03
    for run in (none, vector):  # training did something, and the numbers are well formed
        assert run["history"][-1]["loss"] < run["history"][1]["loss"] * 1.5
        assert -1 <= run["final_mean_cos"] <= 1
        assert len(run["branches"]) == 6


def test_synthetic_data_shapes():
    x, y = synthetic_data(20, seed=1)
    assert x.shape == (20, 1, 28, 28) and y.shape == (20,) and int(y.max()) < 10


def test_fashion_mnist_comes_from_the_applications_reader(tmp_path, monkeypatch):
    """The experiment reads the data set through apps/data.py (one reader, one cache, one error)."""
    from orepa.apps.common import UserError

    x, y = load_fashion_mnist(5, cache_dir=tmp_path)
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32 and y.tolist() == [9, 0, 0, 3, 0]
    assert abs(x.mean().item()) < 1.0  # normalised with the train mean / std
    with pytest.raises(ValueError, match="synthetic"):
        similarity_experiment(("none",), steps=1, data="mnist")
    monkeypatch.setenv("OREPA_FASHION_MNIST_DIR", str(tmp_path / "absent"))
    with pytest.raises(UserError, match="Fashion-MNIST not found"):  # an error, not a silent synthetic stand-in
        load_fashion_mnist(5, cache_dir=tmp_path / "empty")


def test_the_script_says_bad_input_in_one_line_and_writes_its_plots_whole(tmp_path, monkeypatch, capsys):
    """benchmarks/proposition1.py: an unknown scaling (it failed after part (a) had run), --threads 0
    and missing data were tracebacks (missing data is said before part (a) runs and before the output
    directory is made); a run writes its JSON and both plots. The refusals through the
    script's command-line ending in this process (``_script.run``, as its ``__main__`` ends), the run
    in a process of its own."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "proposition1.py"
    args = ["--steps", "2", "--n-train", "64", "--width", "4", "--batch", "8", "--output-dir", str(tmp_path / "p")]
    mod, ending = benchmark_script("proposition1"), benchmark_script("_script")
    for extra, said in ((["--scalings", "bogus"], "invalid choice: 'bogus'"),
                        (["--threads", "0"], "--threads: must be a positive integer")):
        monkeypatch.setattr(sys, "argv", [str(script), *args, *extra])
        with pytest.raises(SystemExit) as stop:  # argparse's own ending: usage, one error line
            ending.run(mod.main)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and said in err and "Traceback" not in err, err
    monkeypatch.setenv("OREPA_FASHION_MNIST_DIR", str(tmp_path / "absent"))
    monkeypatch.setenv("OREPA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    assert ending.run(mod.main) == 2
    said = capsys.readouterr()
    assert said.err.count("\n") == 1 and said.err.startswith("orepa proposition1.py: error: Fashion-MNIST not found")
    assert said.out == "" and not (tmp_path / "p").exists()  # before part (a) ran, nothing made
    run = subprocess.run([sys.executable, str(script), *args, "--data", "synthetic", "--scalings", "none"],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "proposition1.json", "similarity_curves.png", "similarity_final.png"]


def test_the_script_reads_fashion_mnist_from_its_cache_dir(cache, tmp_path, monkeypatch):
    """``--cache-dir`` (the flag of every command that reads Fashion-MNIST): the script read only
    $OREPA_CACHE's, here a place without the data set, whose package is out of reach too."""
    monkeypatch.setenv("OREPA_FASHION_MNIST_DIR", str(tmp_path / "absent"))
    monkeypatch.setenv("OREPA_CACHE", str(tmp_path / "cache"))
    mod = benchmark_script("proposition1")
    assert mod.main(["--steps", "2", "--n-train", "64", "--width", "4", "--batch", "8", "--scalings", "none",
                     "--output-dir", str(tmp_path / "p"), "--cache-dir", cache]) == 0
    report = json.loads((tmp_path / "p" / "proposition1.json").read_text())
    assert report["experiments"][0]["config"]["data"] == "fashion-mnist" and not (tmp_path / "cache").exists()
