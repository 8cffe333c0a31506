"""Tables, plots and result files of ``orepa bench`` (and re-rendering a saved result)."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from orepa.apps.checkpoint import atomic_write_text, write_json
from orepa.apps.common import error_text
from orepa.apps.logs import pyplot, save_figure

from .variants import LADDER, offline_rung

RATIO_KEYS = ("step_ms", "step_min_ms", "aten_ops", "aten_kernels", "saved_bytes", "saved_act_bytes", "saved_naive_bytes", "peak_bytes",
              "train_flops", "train_params", "deploy_params", "deploy_flops", "infer_ms", "infer_min_ms")


def ratios(res: dict[str, dict], base: str = "base") -> dict[str, dict]:
    """Ratios to ``base`` per variant and metric (plus the derived fields they need), and the paired
    step ratio. Adds ``saved_act_bytes``, ``step_min_ms`` and ``infer_min_ms`` to ``res`` in place."""
    for r in res.values():  # derived: saved for backward that is not a parameter/buffer storage
        if r.get("saved_bytes") is not None and r.get("saved_param_bytes") is not None:
            r["saved_act_bytes"] = r["saved_bytes"] - r["saved_param_bytes"]
        # best of the repetitions: contention only ever adds time, so on a loaded machine the
        # minimum is a steadier estimate than the median
        for key, times in (("step_min_ms", "step_times_s"), ("infer_min_ms", "infer_times_s")):
            if r.get(times):
                r[key] = 1e3 * min(r[times])
    out = {}
    b = res[base]
    for name, r in res.items():
        out[name] = {}
        for k in RATIO_KEYS:
            v, bv = r.get(k), b.get(k)
            out[name][k] = (v / bv) if (v is not None and bv) else None
        # paired: the median over repetitions of (this variant's step / base's step in the same
        # round); a slow phase of the machine hits both steps of a round, so it cancels
        t, bt = r.get("step_times_s"), b.get("step_times_s")
        out[name]["step_paired"] = (statistics.median(a / c for a, c in zip(t, bt))
                                    if t and bt and len(t) == len(bt) else None)
    return out


def _fmt(v, scale=1.0, nd=1) -> str:
    return "n/a" if v is None else f"{v / scale:,.{nd}f}"


def _rx(v) -> str:
    return "" if v is None else f" ({v:.2f}x)"


def format_table(result: dict) -> str:
    """A Markdown table: absolute values with ratios to base."""
    res, rat = result["results"], result["ratios"]
    cols = ["method", "train step ms (median)", "(min)", "(paired)", "aten ops / step", "of them kernels", "saved MiB (unique)", "saved excl. params", "saved MiB (naive)", "peak MiB",
            "train GFLOPs",
            "train params M", "deploy params M", "deploy GFLOPs", "infer ms", "deploy err"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for n, r in res.items():
        q = rat[n]
        row = [
            n,
            _fmt(r.get("step_ms"), 1, 0) + _rx(q["step_ms"]),
            _fmt(r.get("step_min_ms"), 1, 0) + _rx(q["step_min_ms"]),
            "n/a" if q.get("step_paired") is None else f"{q['step_paired']:.2f}x",
            _fmt(r.get("aten_ops"), 1, 0) + _rx(q["aten_ops"]),
            _fmt(r.get("aten_kernels"), 1, 0) + _rx(q.get("aten_kernels")),
            _fmt(r.get("saved_bytes"), 2**20) + _rx(q["saved_bytes"]),
            _fmt(r.get("saved_act_bytes"), 2**20) + _rx(q["saved_act_bytes"]),
            _fmt(r.get("saved_naive_bytes"), 2**20) + _rx(q["saved_naive_bytes"]),
            _fmt(r.get("peak_bytes"), 2**20, 0) + _rx(q["peak_bytes"]),
            _fmt(r.get("train_flops"), 1e9, 2) + _rx(q["train_flops"]),
            _fmt(r.get("train_params"), 1e6, 2) + _rx(q["train_params"]),
            _fmt(r.get("deploy_params"), 1e6, 2),
            _fmt(r.get("deploy_flops"), 1e9, 2) + _rx(q["deploy_flops"]),
            _fmt(r.get("infer_ms"), 1, 0) + _rx(q["infer_ms"]),
            "diverged" if r.get("diverged") else "n/a" if r.get("deploy_err") is None else f"{r['deploy_err']:.1e}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    config = result.get("config")  # (a table of results alone, without a run's config: no note)
    if config is not None and "peak_start" not in config and any(r.get("peak_bytes") is not None
                                                                 for r in res.values()):
        lines += ["", OLD_PEAK_START]
    return "\n".join(lines)


#: the table's line under a result written before its config said ``peak_start`` (the peak step now
#: starts without the last step's gradients: :func:`orepa.apps.bench.measure.measure_variant_costs`)
OLD_PEAK_START = ("note: peak MiB measured with the older start (it held the last step's gradients; this result "
                  "records no peak_start): not comparable with the peaks of newer results")


def format_header(result: dict) -> str:
    c, e = result["config"], result["environment"]
    dev = e.get("gpu") or (f"{e['device']} ({e['cpu']})" if e.get("cpu") else e["device"])
    git = e.get("git") or {}
    code = f"; orepa {git['commit']}{'+modified' if git.get('modified') else ''}" if git.get("commit") else ""
    graphs = ", forward+backward as CUDA graphs" if c.get("cuda_graphs") else ""
    graphs += f", torch.compile ({c['compile']})" if c.get("compile") else ""
    graphs += ", TF32 matmuls" if c.get("tf32_matmul") else ""
    builder = c.get("kernel_builder", "auto")
    if builder != "auto":
        graphs += f", kernel builder {builder}"
    packed = [n for n, r in result["results"].items() if r.get("packed")]
    if packed:
        graphs += f", packed parameters ({', '.join(packed)})"
    if "compiled" in {builder, *(r.get("kernel_builder") for r in result["results"].values())}:
        graphs += " (the compiled builder's fused kernels are not aten operators: not in the operator counts)"
    chans = c.get("in_chans", 3)  # (said where not RGB's: --model-option in_chans=N)
    return (f"{table_head(c)}{f', {chans} input channel(s)' if chans != 3 else ''}, {dev}, "
            f"{e['threads']} threads, torch {e['torch']}, median of {c['reps']} interleaved steps "
            f"after {c['warmup']} warm-up{graphs}; load avg {e.get('loadavg_1m', float('nan')):.2f}{code}")


def table_head(config: dict) -> str:
    """How the header of a result's table starts (every version's): its model, batch and image size."""
    return f"{config['model']}, batch {config['batch_size']}, {config['image_size']}x{config['image_size']}"


def saved_result(path: Path) -> tuple[dict | None, dict | None]:
    """``(result, settings)`` of the JSON at ``path`` as far as it can be read, for the checks made
    before a file is replaced or read further: the parsed object (None where the file is missing,
    unreadable or no JSON object) and its ``config`` with the torch ``threads`` it was timed with
    (None where it has no config mapping). :func:`rerender` is the strict reader that says what is wrong."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return None, None
    if not isinstance(result, dict):
        return None, None
    config, environment = result.get("config"), result.get("environment")
    threads = environment.get("threads") if isinstance(environment, dict) else None
    return result, {**config, "threads": threads} if isinstance(config, dict) else None


def is_table_of(path: Path, result) -> bool:
    """Whether the file at ``path`` is a table :func:`save` wrote of ``result`` (a result as read from
    its JSON), in any version's format (a re-rendering renews an older one): its header starts with
    the result's :func:`table_head` and it has a row of each of its variants. A .md of that name
    that is not (a user's notes) is not the result's to replace."""
    try:
        if path.stat().st_size > 1 << 20:  # larger than any table
            return False
        lines = path.read_text().splitlines()
        rows = {line.split("|")[1].strip() for line in lines if line.startswith("| ")}
        return bool(lines) and lines[0].startswith(table_head(result["config"]) + ",") and \
            set(result["results"]) <= rows
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # (UnicodeDecodeError is a ValueError)
        return False


#: the panels of the ratio plot: metric -> title
RATIO_PLOTS = (("step_ms", "train step time"), ("saved_bytes", "saved for backward"), ("peak_bytes", "peak memory"),
               ("train_flops", "train FLOPs"), ("infer_ms", "deployed inference"))


def ratio_metrics(result: dict) -> list[tuple[str, str]]:
    """The panels of :func:`plot_ratios` that have a value: the metrics some variant has a ratio of."""
    rat = result["ratios"]
    return [(k, t) for k, t in RATIO_PLOTS if any(rat[n].get(k) is not None for n in rat)]


def no_plot_reason(result: dict) -> str | None:
    """Why :func:`save` draws no ratio plot for ``result`` (None where it does)."""
    return None if ratio_metrics(result) else ("no metric has a ratio to base (every value is missing or base's "
                                               "is 0)")


def plot_ratios(result: dict, path: str | Path) -> Path:
    """Bar charts of the cost ratios to base, one panel per metric."""
    plt = pyplot()

    rat = result["ratios"]
    names = list(rat)
    metrics = ratio_metrics(result)
    if not metrics:
        raise ValueError("no cost ratio to base to plot")
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.6), squeeze=False)
    for ax, (k, title) in zip(axes[0], metrics):
        vals = [rat[n][k] or 0.0 for n in names]
        bars = ax.bar(range(len(names)), vals, color=["0.6" if n == "base" else "C0" for n in names])
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("x base")
    fig.suptitle(format_header(result), fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def plot_budgets(result: dict, path: str | Path) -> Path:
    """Fig. "budgets": memory and time as components are added, online vs offline."""
    plt = pyplot()

    res = result["results"]
    rungs = [r for r in LADDER if r in res]
    off = {r: offline_rung(r) for r in rungs}
    mem_key = "peak_bytes" if all(res[n].get("peak_bytes") for n in res) else "saved_bytes"
    panels = [(mem_key, 2**20, "peak memory (MiB)" if mem_key == "peak_bytes" else "saved for backward (MiB)"),
              ("saved_bytes", 2**20, "saved for backward (MiB)") if mem_key == "peak_bytes" else None,
              ("step_ms", 1.0, "train step (ms)")]
    panels = [p for p in panels if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    xs = range(len(rungs))
    for ax, (k, s, label) in zip(axes[0], panels):
        on = [(res[r].get(k) or 0) / s for r in rungs]
        of = [(res[off[r]].get(k) or 0) / s if off[r] in res else 0.0 for r in rungs]
        w = 0.38
        b1 = ax.bar([i - w / 2 for i in xs], on, w, label="online (OREPA)", color="C0")
        b2 = ax.bar([i + w / 2 for i in xs], of, w, label="offline (BN per branch)", color="C3")
        for bars in (b1, b2):
            for b in bars:
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{b.get_height():.0f}", ha="center",
                        va="bottom", fontsize=6)
        ax.axhline((res["base"].get(k) or 0) / s, color="k", ls="--", lw=0.9, label="base")
        if "dbb" in res:
            ax.axhline((res["dbb"].get(k) or 0) / s, color="C1", ls=":", lw=1.2, label="DBB")
        ax.set_xticks(list(xs), rungs)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("cost as components are added: " + format_header(result), fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def save(result: dict, out_dir: str | Path, tag: str, plots: bool = True) -> list[Path]:
    out_dir = Path(out_dir)
    files = [write_json(out_dir / f"{tag}.json", result, indent=1),
             atomic_write_text(out_dir / f"{tag}.md", format_header(result) + "\n\n" + format_table(result) + "\n")]
    if plots and no_plot_reason(result) is None:  # a result without a ratio has only its table
        files.append(plot_ratios(result, out_dir / f"{tag}_ratios.png"))
        if any(n in LADDER for n in result["results"]):
            files.append(plot_budgets(result, out_dir / f"{tag}_budgets.png"))
    for stale in (out_dir / f"{tag}_ratios.png", out_dir / f"{tag}_budgets.png"):
        if stale not in files and stale.is_file():  # an earlier result's plot beside this one's table
            stale.unlink()
    return files


#: what a saved result's numbers must be, so that a hand-edited or damaged file is named field by
#: field instead of failing inside a ratio or a format: counts and sizes (None where not measured)
RESULT_NUMBERS = (*RATIO_KEYS, "saved_param_bytes", "saved_tensors", "fwd_flops", "peak_step_bytes", "state_bytes",
                  "deploy_err")
#: the config fields the header prints (positive, or >= 0 for the counts of steps)
CONFIG_COUNTS = {"batch_size": 1, "image_size": 1, "reps": 0, "warmup": 0}


def _number(v, least: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= least


def damaged_field(result: dict) -> str | None:
    """The first field of a saved bench result that no orepa bench writes (a wrong type, a negative
    or infinite count, a time that is not positive), said as ``results['orepa']['step_ms'] is ...``;
    None where every field it renders is sound."""
    c = result["config"]
    if not isinstance(c.get("model"), str):
        return f"config['model'] is {c.get('model')!r}, not a model name"
    for k, least in CONFIG_COUNTS.items():
        if not (_number(c.get(k), least) and float(c[k]).is_integer()):
            return f"config[{k!r}] is {c.get(k)!r}, not a whole number >= {least}"
    e = result["environment"]
    if not isinstance(e.get("device"), str):
        return f"environment['device'] is {e.get('device')!r}, not a device name"
    if e.get("loadavg_1m") is not None and not _number(e["loadavg_1m"], 0):
        return f"environment['loadavg_1m'] is {e['loadavg_1m']!r}, not a number >= 0"
    for name, r in result["results"].items():
        if not isinstance(r, dict):
            return f"results[{name!r}] is {r!r}, not a variant's measurements"
        for k in RESULT_NUMBERS:
            if r.get(k) is not None and not _number(r[k], 0):
                return f"results[{name!r}][{k!r}] is {r[k]!r}, not a number >= 0"
        for k in ("step_times_s", "infer_times_s"):
            times = r.get(k)
            if times is None:
                continue
            if not isinstance(times, list):
                return f"results[{name!r}][{k!r}] is {times!r}, not a list of times"
            for i, t in enumerate(times):
                if not _number(t, 0) or t == 0:
                    return f"results[{name!r}][{k!r}][{i}] is {t!r}, not a time > 0"
    return None


def rerender(path: str | Path, plots: bool = True, out_dir: str | Path | None = None) -> tuple[dict, list[Path]]:
    """Recompute ratios, table and plots of a saved result JSON, written to ``out_dir`` (default:
    next to it, replacing its table and JSON)."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        result = json.loads(raw.decode())
    except ValueError as exc:  # (UnicodeDecodeError too): the decoder's words alone named no file kind
        said = "an empty file" if not raw.strip() else error_text(exc, 120)
        raise ValueError(f"{path} is not JSON ({said}); give a result JSON that orepa bench wrote") from None
    if isinstance(result, dict) and result.get("results") in ({}, []):
        raise ValueError(f"{path} holds no results (no variant was measured): nothing to render; "
                         "measure again with orepa bench")
    if not (isinstance(result, dict) and all(isinstance(result.get(k), dict) for k in ("config", "environment"))
            and isinstance(result.get("results"), dict) and "base" in result["results"]):
        raise ValueError(f"{path} is not an orepa bench result (JSON with config, environment and "
                         "the results of base)")
    try:  # rendered in memory first: a damaged result is refused before any file is written
        bad = damaged_field(result)
        if bad:
            raise ValueError(bad)
        result["ratios"] = ratios(result["results"])
        format_header(result), format_table(result)
    except (KeyError, TypeError, AttributeError, ValueError, ZeroDivisionError) as exc:
        what = (f"no {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc) if isinstance(exc, ValueError)
                else f"{type(exc).__name__}: {exc}")
        raise ValueError(f"{path} is not an orepa bench result as written by orepa bench ({what})") from None
    return result, save(result, path.parent if out_dir is None else Path(out_dir), path.stem, plots=plots)


def add_zoo_model_argument(parser) -> None:
    """``-m/--model``: a zoo model with an OREPA form, for the scripts that measure one (its results file
    named by :func:`model_results_file`)."""
    from orepa.models import list_models

    parser.add_argument("-m", "--model", default="resnet18", choices=list_models("orepa"), metavar="MODEL",
                        help="a zoo model with an orepa method (default resnet18)")


def model_results_file(stem: str, model: str) -> str:
    """Where a script's results for ``model`` go (relative to the repository's root): ``stem.json`` for
    ResNet-18, ``stem_MODEL.json`` for another."""
    return f"benchmarks/results/{stem}{'' if model == 'resnet18' else f'_{model}'}.json"
