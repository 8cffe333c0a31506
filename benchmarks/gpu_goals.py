"""The GPU goals of online training at GPU speed, checked against ``orepa bench`` results.

Reads every bench result JSON in the folders given (what ``benchmarks/gpu_session.sh`` writes to
``$RESULTS/<phase>/bench``) and prints, per setting (model, batch, step mode) and OREPA variant, the
paired step-time ratio to base with the goal it has, the peak-memory ratio (goal <= 1.10x) with the
part of it the variant's state alone sets (parameters, buffers and optimizer state, which no kernel
construction changes) and whether the variant is faster than DBB in the same run:

* eager steps: <= 1.25x base at batch 64 (ResNet-18, ResNet-50), <= 2.0x at batch 8;
* the fastest mode (CUDA graphs, or torch.compile'd steps): <= 1.15x base in that same mode.

    python3 benchmarks/gpu_goals.py benchmarks/results/gpu-h100-builders [--json goals.json]

Ratios are the bench's paired ratios (the median over rounds of a variant's step over base's in the
same round), so they hold for one run on one machine; a result without base has none.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orepa.apps.bench.report import saved_result
from orepa.apps.checkpoint import check_output_path, report_of, same_file, write_json

#: the mark of this script's reports (report_of): --json replaces those alone, not a file of another kind
REPORT = "benchmarks/gpu_goals.py"
PEAK_GOAL = 1.10


def step_goal(cfg: dict) -> tuple[str, float | None]:
    """The step mode of a result and the ratio the goals ask for in it (None: no goal there)."""
    small = cfg.get("batch_size", 0) <= 8
    if cfg.get("cuda_graphs") or cfg.get("compile"):  # (the fastest mode's goal is set at batch 64)
        return ("CUDA graphs" if cfg.get("cuda_graphs") else f"torch.compile ({cfg['compile']})"), \
            None if small else 1.15
    return "eager", 2.0 if small else 1.25


def _peak(r: dict, corrected: bool) -> float | None:
    """A result's peak bytes, plus its gradients' where its start held them (``corrected``)."""
    if r.get("peak_bytes") is None or (corrected and r.get("train_params") is None):
        return None
    return r["peak_bytes"] + (4 * r["train_params"] if corrected else 0)


def state_floor_ratio(res: dict, name: str, corrected: bool) -> float | None:
    """The least peak ratio a variant can have: base's peak plus what the variant's state (parameters,
    buffers, optimizer state: held between steps, ``state_bytes``) holds beyond base's. Where that is
    over the goal, no construction of the kernels reaches it."""
    mine, base = res.get(name, {}), res.get("base", {})
    peak = _peak(base, corrected)
    if not peak or mine.get("state_bytes") is None or base.get("state_bytes") is None:
        return None
    return 1 + (mine["state_bytes"] - base["state_bytes"]) / peak


def corrected_peak_ratio(res: dict, name: str) -> float | None:
    """The peak ratio of a result measured before the peak step started without gradients: its start
    held the last step's gradients, which that step frees and makes again, so each peak was short by
    them (float32, one per trainable parameter: ``train_params`` x 4 bytes)."""
    mine, base = _peak(res.get(name, {}), True), _peak(res.get("base", {}), True)
    return None if mine is None or not base else mine / base


def rows_of(result: dict, source: str) -> list[dict]:
    cfg, res, rat = result["config"], result["results"], result.get("ratios") or {}
    mode, goal = step_goal(cfg)
    dbb = (rat.get("dbb") or {}).get("step_paired")
    out = []
    for name, r in rat.items():
        if not name.startswith("orepa"):
            continue
        step, peak = r.get("step_paired"), r.get("peak_bytes")
        corrected = cfg.get("peak_start") is None and peak is not None
        if corrected:
            peak = corrected_peak_ratio(res, name)
        out.append({
            "model": cfg["model"], "batch": cfg["batch_size"], "mode": mode, "variant": name, "source": source,
            "step_ratio": step, "step_goal": goal, "step_met": None if step is None or goal is None else step <= goal,
            "peak_ratio": peak, "peak_met": None if peak is None else peak <= PEAK_GOAL, "peak_corrected": corrected,
            "peak_floor": state_floor_ratio(res, name, corrected),
            "dbb_ratio": dbb, "faster_than_dbb": None if step is None or dbb is None else step < dbb,
            "tf32_matmul": bool(cfg.get("tf32_matmul")), "device": result.get("environment", {}).get("gpu"),
            "commit": (result.get("environment", {}).get("git") or {}).get("commit"),
            "measured": name in res,
        })
    return out


def bench_results(folders: list[str]) -> list[tuple[Path, dict]]:
    """``(file, result)`` of every CUDA bench result with base in ``folders`` (folders of JSONs, or JSON files)."""
    out = []
    for folder in folders:
        path = Path(folder)
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        for f in files:
            result, settings = saved_result(f)
            if not (settings is not None
                    and "base" in (result.get("ratios") or {})
                    and "cuda" in str(result.get("environment", {}).get("device", ""))):
                continue  # not a CUDA bench result with base (a summary, an accuracy file, a CPU run)
            out.append((f, result))
    return out


def table_rows(results: list[tuple[Path, dict]]) -> list[dict]:
    return [row for f, result in results for row in rows_of(result, f"{f.parent.name}/{f.name}")]


def collect(folders: list[str]) -> list[dict]:
    return table_rows(bench_results(folders))


def _x(v, nd: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{nd}f}x"


def _met(v) -> str:
    return "" if v is None else (" yes" if v else " **no**")


def format_table(rows: list[dict]) -> str:
    lines = ["| setting | variant | step / base (goal) | peak / base (goal 1.10x) | of it the state's | DBB step / base | commit | file |",
             "|---|---|---|---|---|---|---|---|"]
    order = {"eager": 0}
    for r in sorted(rows, key=lambda r: (r["model"], -r["batch"], order.get(r["mode"], 1), r["variant"])):
        goal = "" if r["step_goal"] is None else f" (<= {r['step_goal']:.2f}x)"
        dbb = "n/a" if r["dbb_ratio"] is None else (
            f"{_x(r['dbb_ratio'])}: OREPA {'faster' if r['faster_than_dbb'] else '**slower**'}")
        lines.append(f"| {r['model']} b{r['batch']} {r['mode']}{', TF32' if r['tf32_matmul'] else ''} | "
                     f"{r['variant']} | {_x(r['step_ratio'])}{goal}{_met(r['step_met'])} | "
                     f"{_x(r['peak_ratio'], 3)}{'*' if r.get('peak_corrected') else ''}{_met(r['peak_met'])} | {_x(r.get('peak_floor'), 3)} | {dbb} | {r['commit'] or '?'} | {r['source']} |")
    lines += ["", "*of it the state's*: the peak ratio with base's step and this variant's state (parameters, buffers, "
              "optimizer state: held between steps); where it is over 1.10x, no kernel construction meets the goal"]
    if any(r.get("peak_corrected") for r in rows):
        lines += ["", "\\* measured with the last step's gradients at the peak step's start (results of orepa bench "
                  "before it started without them): each peak plus its trainable parameters' float32 bytes"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="folders of bench result JSONs (or JSON files)")
    ap.add_argument("--json", default=None, help='also write the rows as JSON (under "rows")')
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    results = bench_results(args.folders)
    if args.json:  # (--json naming a bench result it reads would replace that measurement with the table)
        check_output_path(args.json, "--json", report=REPORT, not_over={"a bench result this table reads": next(
            (f for f, _ in results if same_file(Path(args.json), f)), None)})
    rows = table_rows(results)
    if not rows:
        print(f"no CUDA bench result with base and an OREPA variant in {' '.join(args.folders)}", file=sys.stderr)
        return 1
    devices = sorted({r["device"] for r in rows if r["device"]})
    commits = sorted({r["commit"] for r in rows if r["commit"]})
    print(f"GPU goals on {', '.join(devices) or 'an unnamed GPU'} (orepa {', '.join(commits) or '?'}); "
          "paired step ratios to base in the same run\n")
    print(format_table(rows))
    if args.json:
        write_json(args.json, report_of(REPORT, {"rows": rows}), indent=1)
    return 0


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
