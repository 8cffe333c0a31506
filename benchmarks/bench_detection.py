#!/usr/bin/env python3
"""Detector training cost, base vs DBB vs OREPA backbones (table "detseg", Mem / Time columns).

    python benchmarks/bench_detection.py                                  # Faster R-CNN + RetinaNet, R-50, 320 px
    python benchmarks/bench_detection.py --detectors fasterrcnn --size 800 --max-size 1333 --device cuda
    python benchmarks/bench_detection.py --steps 0 --size 640                      # memory only

Every (detector, method) is built in ONE process from the same seed and the
train steps interleave round-robin, so machine noise hits all alike. Setup as
the paper's (mmdetection defaults): batch 2, SGD momentum 0.9 (lr 1e-3: random
weights diverge at the paper's 0.02; the cost does not depend on it), stem + layer1
frozen (``trainable_layers=3``) except OREPA's deep stem (trainable, lr x0.1;
the variant ``orepa:train_stem=False`` freezes it like the others' stems),
BNs on running statistics with trainable affine (``norm="eval"``); random
weights (the cost does not depend on them) with BN statistics calibrated on the
batch, so that frozen statistics do not make the network blow up. Per variant:

* ``step_s``: median train step (zero_grad + forward + losses + backward + SGD step);
* ``saved_MB``: bytes autograd keeps for backward after one forward (read off the graph,
  ``orepa.apps.bench.tally_saved``), every storage counted once, parameters excluded; on CUDA
  also ``peak_MB`` (``torch.cuda.max_memory_allocated``);
* ``train_params`` / ``deploy_params`` and ``deploy_err``: backbone features of
  ``orepa.reparameterize(model)`` against the training form in eval (relative max error).

Prints a table and one JSON object (``--json PATH`` also writes it).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import orepa
from orepa.apps import detection as D
from orepa.apps.bench import tally_saved
from orepa.apps.bench.variants import parse_spec
from orepa.apps.checkpoint import check_output_path, json_text, report_of, write_json
from orepa.apps.common import (
    UserError,
    method_list,
    nonneg_int,
    parse_device,
    positive_float,
    positive_int,
    thread_count,
)

#: the mark of this script's reports (report_of): --json replaces those alone, not a file of another kind
REPORT = "benchmarks/bench_detection.py"
#: the least image side the synthetic batch's boxes fit in (1/8 to 1/2 of it)
MIN_SIZE = 8


def shapes_batch(n: int, size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    imgs, targets = [], []
    for _ in range(n):
        img = torch.rand(3, size, size, generator=g)
        boxes = []
        for _ in range(3):
            w, h = torch.randint(size // 8, size // 2, (2,), generator=g).tolist()
            x0, y0 = int(torch.randint(0, size - w, (1,), generator=g)), int(torch.randint(0, size - h, (1,), generator=g))
            img[:, y0:y0 + h, x0:x0 + w] = torch.rand(3, 1, 1, generator=g)
            boxes.append([x0, y0, x0 + w, y0 + h])
        imgs.append(img)
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.randint(1, 5, (3,), generator=g)})
    return imgs, targets


def saved_bytes(model, imgs, targets) -> int:
    st = tally_saved(model, sum(model(imgs, targets).values()))
    return st.unique_bytes - st.param_bytes


@torch.no_grad()
def calibrate_bn(model, imgs) -> None:
    """Give the backbone BNs the statistics of the data (stand-in for pretrained weights), so that
    ``norm="eval"`` on a randomly initialised network does not blow up."""
    bns = [m for m in model.backbone.body.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
        m.train()
    model.backbone.body(model.transform(imgs)[0].tensors)
    for m in bns:
        m.momentum = 0.1
    model.train()  # re-applies the norm policy


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--detectors", nargs="+", default=["fasterrcnn", "retinanet"], choices=["fasterrcnn", "retinanet"])
    p.add_argument("--backbone", default="resnet50")
    p.add_argument("--methods", nargs="+", default=["base", "dbb", "orepa", "orepa:train_stem=False"],
                   help="METHOD[:key=value:...] with backbone keywords, e.g. orepa:train_stem=False; words or "
                        "comma-separated lists (base dbb, base,dbb), as orepa bench --methods")
    p.add_argument("--trainable-layers", type=nonneg_int, choices=range(6), default=3,
                   help="3: stem + layer1 frozen (mmdet's frozen_stages=1)")
    p.add_argument("-b", "--batch-size", type=positive_int, default=2)
    p.add_argument("--size", type=positive_int, default=320, help="image side (min_size); the paper uses 800")
    p.add_argument("--max-size", type=positive_int, default=None, help="default: --size (paper: 1333)")
    p.add_argument("--steps", type=nonneg_int, default=3, help="timed steps per variant (after --warmup); 0: memory only")
    p.add_argument("--warmup", type=nonneg_int, default=1)
    p.add_argument("--lr", type=positive_float, default=1e-3,
                   help="SGD lr (the paper: 0.02 with pretrained weights; random weights diverge there; "
                        "the cost of a step does not depend on it)")
    p.add_argument("--threads", type=thread_count, default=1, help="torch CPU threads (1 is steadiest on a shared machine)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cpu)")
    p.add_argument("--json", default=None)
    return p


def variants(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """``(spec, method, backbone keywords)`` of each ``--methods`` variant ``METHOD[:key=value:...]``, split
    and read as ``orepa bench`` reads its variants; a :class:`UserError` for one that does not parse."""
    return [(spec, *parse_spec(spec)) for spec in method_list(args.methods)]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.json:  # before minutes of measuring
        check_output_path(args.json, "--json", report=REPORT)
    if args.size < MIN_SIZE:
        raise UserError(f"--size {args.size}: the synthetic images need at least {MIN_SIZE} pixels a side")
    specs = variants(args)
    args.methods = [spec for spec, _, _ in specs]  # (the report's config: one variant a word)
    torch.set_num_threads(args.threads)
    device = parse_device(args.device)  # (a device this machine lacks: one line, not a driver's traceback)
    imgs, targets = shapes_batch(args.batch_size, args.size)
    imgs = [i.to(device) for i in imgs]
    targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
    max_size = args.max_size or args.size

    runs = []
    for det in args.detectors:
        for variant, method, opts in specs:
            kw = {"trainable_layers": args.trainable_layers, "norm": "eval", **opts}
            torch.manual_seed(0)
            try:  # what goes wrong in a build is the variant's or the backbone's
                model = getattr(D, det)(args.backbone, method, num_classes=5, min_size=args.size, max_size=max_size,
                                        **kw).to(device)
            except (ValueError, TypeError, KeyError) as exc:
                raise UserError(f"cannot build {det} with the {args.backbone} backbone, variant {variant}: "
                                f"{exc}") from None
            calibrate_bn(model, imgs)
            opt = torch.optim.SGD(D.param_groups(model, args.lr, 1e-4), lr=args.lr, momentum=0.9)
            runs.append(dict(detector=det, method=variant, model=model, opt=opt, times=[]))

    def step(r):
        model, opt = r["model"].train(), r["opt"]
        sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = sum(model(imgs, targets).values())
        loss.backward()
        opt.step()
        sync(device)
        return time.perf_counter() - t0

    for i in range(args.warmup + args.steps if args.steps else 0):  # round-robin over variants
        for r in runs:
            t = step(r)
            if i >= args.warmup:
                r["times"].append(t)

    results = []
    for r in runs:
        model = r["model"]
        model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sb = saved_bytes(model, imgs, targets)
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        model.eval()
        with torch.no_grad():
            x = model.transform(imgs[:1])[0].tensors
            ref = model.backbone(x)
            deployed = orepa.reparameterize(model)
            dep = deployed.backbone(x)
            err = max(((dep[k] - ref[k]).abs().max() / (1 + ref[k].abs().max())).item() for k in ref)
        results.append(dict(
            detector=r["detector"], method=r["method"],
            step_s=statistics.median(r["times"]) if r["times"] else None,
            steps=[round(t, 4) for t in r["times"]], saved_MB=sb / 2**20,
            peak_MB=None if peak is None else peak / 2**20,
            train_params=sum(p.numel() for p in model.backbone.body.parameters()),
            deploy_params=sum(p.numel() for p in deployed.backbone.body.parameters()), deploy_err=err))
        r["model"] = r["opt"] = None

    w = max(8, *(len(r["method"]) + 1 for r in results))
    head = f"{'detector':<11}{'method':<{w}}{'step s':>9}{'x base':>8}{'saved MB':>10}{'x base':>8}" \
           f"{'peak MB':>9}{'train P':>10}{'deploy P':>10}{'deploy err':>12}"
    print(head)
    for res in results:
        base = next((b for b in results if b["detector"] == res["detector"] and b["method"] == "base"), res)
        peak = "-" if res["peak_MB"] is None else f"{res['peak_MB']:.0f}"
        step = "-" if res["step_s"] is None else f"{res['step_s']:.3f}"
        step_x = "-" if res["step_s"] is None else f"{res['step_s'] / base['step_s']:.2f}"
        print(f"{res['detector']:<11}{res['method']:<{w}}{step:>9}{step_x:>8}"
              f"{res['saved_MB']:>10.1f}{res['saved_MB'] / base['saved_MB']:>8.2f}{peak:>9}"
              f"{res['train_params'] / 1e6:>9.2f}M{res['deploy_params'] / 1e6:>9.2f}M{res['deploy_err']:>12.1e}")
    report = dict(config={k: v for k, v in vars(args).items() if k != "json"},
                  machine=dict(platform=platform.platform(), torch=torch.__version__, threads=torch.get_num_threads(),
                               device=str(device) if device.type != "cuda" else torch.cuda.get_device_name()),
                  results=results)
    print(json_text(report))  # (strict JSON, as the file: NaN as null)
    if args.json:
        write_json(args.json, report_of(REPORT, report), indent=1)
    return 0


if __name__ == "__main__":
    from _script import run

    raise SystemExit(run(main))
