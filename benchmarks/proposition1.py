#!/usr/bin/env python3
"""Proposition 1, checked: exact update comparison (float64) and the branch-similarity experiment.

    python benchmarks/proposition1.py --output-dir bench_results/proposition1         # defaults below
    python benchmarks/proposition1.py --steps 300 --width 8 --batch 32 --seeds 0 1 2 # the docs/analysis.md run

Writes ``proposition1.json`` (every number), ``similarity_curves.png`` (mean
off-diagonal cosine of the branch kernels and of their accumulated updates over
training, per scaling) and ``similarity_final.png`` (the final matrices).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from orepa.analysis.proposition1 import proposition1_table
from orepa.apps.checkpoint import check_output_path, report_of, write_json
from orepa.apps.common import positive_float, positive_int, seed_int, thread_count
from orepa.apps.data import add_cache_dir_argument, prepare_fashion_mnist
from orepa.apps.logs import pyplot, save_figure
from orepa.apps.proposition1 import similarity_experiment

#: the mark of this script's reports (report_of): its JSON replaces those alone, not a file of another kind
REPORT = "benchmarks/proposition1.py"
REPORT_FILE = "proposition1.json"
#: what a run writes in --output-dir
FILES = (REPORT_FILE, "similarity_curves.png", "similarity_final.png")


def plot(exp: dict, out: Path) -> list[Path]:
    plt = pyplot()
    runs = exp["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for s, r in runs.items():
        h = r["history"]
        axes[0].plot([p["step"] for p in h], [p["mean_cos"] for p in h], label=s)
        axes[1].plot([p["step"] for p in h[1:]], [p["update_cos"] for p in h[1:]], label=s)
        axes[2].plot([p["step"] for p in h[1:]], [p["loss"] for p in h[1:]], label=s)
    axes[0].set_title("branch kernels: mean off-diagonal cosine", fontsize=9)
    axes[1].set_title("branch updates K_j(t)-K_j(0): mean off-diagonal cosine", fontsize=9)
    axes[2].set_title("training loss (batch)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8, title="scaling", title_fontsize=8)
    c = exp["config"]
    fig.suptitle(f"TinyOREPANet width {c['width']}, {c['data']} ({c['n_train']} images), batch {c['batch']}, "
                 f"lr {c['lr']}, seed {c['seed']}", fontsize=8)
    fig.tight_layout()
    curves = save_figure(fig, out / "similarity_curves.png", dpi=120)

    blocks = list(next(iter(runs.values()))["final_cosine"])
    fig, axes = plt.subplots(2 * len(runs), len(blocks), figsize=(3.0 * len(blocks), 2.9 * 2 * len(runs)),
                             squeeze=False)
    for i, (s, r) in enumerate(runs.items()):
        names = r["branches"]
        for row, (key, what) in enumerate((("final_cosine", "kernels"), ("final_update_cosine", "updates"))):
            for j, b in enumerate(blocks):
                ax = axes[2 * i + row][j]
                m = r[key][b]
                ax.imshow(m, vmin=-1, vmax=1, cmap="RdBu_r")
                for a in range(len(m)):
                    for bb in range(len(m)):
                        ax.text(bb, a, f"{m[a][bb]:.2f}", ha="center", va="center", fontsize=5)
                ax.set_xticks(range(len(names)), names, rotation=90, fontsize=5)
                ax.set_yticks(range(len(names)), names, fontsize=5)
                ax.set_title(f"{s}: {b} {what}", fontsize=7)
    fig.tight_layout()
    return [curves, save_figure(fig, out / "similarity_final.png", dpi=110)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", "--out-dir", dest="output_dir", default="bench_results/proposition1")
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--width", type=positive_int, default=8)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=0.1)
    p.add_argument("--n-train", type=positive_int, default=4096)
    p.add_argument("--seeds", type=seed_int, nargs="+", default=[0])
    p.add_argument("--data", default="fashion-mnist", choices=["fashion-mnist", "synthetic"])
    p.add_argument("--scalings", nargs="+", default=["none", "scalar", "vector"], choices=["none", "scalar", "vector"])
    p.add_argument("--threads", type=thread_count, default=1)
    add_cache_dir_argument(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = check_output_path(args.output_dir, "--output-dir", directory=True)  # before any training
    for name in FILES:  # (a directory, a run's checkpoint there by that name)
        check_output_path(out / name, "--output-dir", report=REPORT if name == REPORT_FILE else None)
    if args.data == "fashion-mnist":  # missing data said before part (a) runs and before --output-dir is made
        prepare_fashion_mnist(args.cache_dir)

    rows = proposition1_table(steps=20)
    print("(a) end-to-end SGD update, multi-branch (3 branches) vs single conv-scale, float64")
    print(f"{'scaling':<8}{'steps':>6}{'diff @ same lr':>16}{'diff @ kernel lr x M':>22}{'span residual':>15}")
    for r in rows:
        print(f"{r['scaling']:<8}{r['steps']:>6}{r['diff_same_lr']:>16.2e}{r['diff_kernel_lr_x_M']:>22.2e}"
              f"{r['span_residual']:>15.2e}")

    experiments = []
    for seed in args.seeds:
        exp = similarity_experiment(args.scalings, steps=args.steps, batch=args.batch, lr=args.lr, width=args.width,
                                    n_train=args.n_train, data=args.data, seed=seed, log_every=max(args.steps // 20, 1),
                                    log=print, cache_dir=args.cache_dir)
        experiments.append(exp)
    print("\n(b) mean off-diagonal cosine after training (kernels | accumulated updates), test accuracy")
    print(f"{'seed':>4} " + "".join(f"{s:>30}" for s in args.scalings))
    for exp in experiments:
        cells = [f"{r['initial_mean_cos']:+.3f}->{r['final_mean_cos']:+.3f} | {r['final_update_cos']:+.3f} "
                 f"{100 * r['test_accuracy']:4.1f}%" for r in exp["runs"].values()]
        print(f"{exp['config']['seed']:>4} " + "".join(f"{c:>30}" for c in cells))
    out.mkdir(parents=True, exist_ok=True)
    files = plot(experiments[0], out)
    write_json(out / REPORT_FILE, report_of(REPORT, {"update_check": rows, "experiments": experiments}),
               indent=1)  # NaN as null
    print("wrote", out / REPORT_FILE, *files)
    return 0


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))  # missing data, an unwritable --output-dir: one line, exit code 2
