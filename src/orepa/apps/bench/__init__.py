"""``orepa bench``: the training cost of re-param methods, measured side by side.

Every variant of one architecture (:mod:`.variants`: methods, block options, the component
ladder of Fig. "budgets") is built in ONE process; :mod:`.measure` times their train steps
round-robin, so machine noise hits all of them alike, and counts what autograd saves for
backward, peak memory, FLOPs and parameters, in training form and deployed; :mod:`.report`
writes the table, the plots and the JSON. docs/benchmarks.md describes every column.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from orepa.apps.checkpoint import check_output_path, same_file
from orepa.apps.common import (
    UserError,
    add_kernel_builder_argument,
    add_pack_argument,
    add_run_arguments,
    add_tf32_matmul_argument,
    apply_tf32_matmul,
    apply_threads,
    init_distributed,
    method_list,
    nonneg_int,
    path_arg,
    positive_float,
    positive_int,
    refuse_idle_flags,
)
from orepa.apps.model_cfg import MODEL_CFG_KEYS, check_cfg_value, check_model_takes, model_slug

from .measure import (
    Runner,
    check_step_modes,
    environment,
    flop_counter,
    make_runner,
    measure_saved,
    measure_variant_costs,
    run_benchmark,
    tally_saved,
    variant_specs,
)
from .report import (
    format_header,
    format_table,
    is_table_of,
    no_plot_reason,
    plot_budgets,
    plot_ratios,
    ratios,
    rerender,
    save,
    saved_result,
)
from .variants import LADDER, base_model, build_variant, component_variants, in_zoo, parse_options, parse_spec

__all__ = [
    "LADDER", "Runner", "add_arguments", "base_model", "build_variant", "component_variants", "environment",
    "flop_counter", "format_header", "format_table", "in_zoo", "make_runner", "measure_saved", "tally_saved",
    "measure_variant_costs", "parse_options", "parse_spec", "plot_budgets", "plot_ratios", "ratios", "rerender", "run",
    "run_benchmark", "save", "variant_specs",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="resnet18", help="model name: the zoo's, torchvision's (NAME or torchvision:NAME) or timm:NAME")
    p.add_argument("--methods", nargs="+", default=["base", "dbb", "orepa"],
                   help="variants: base, orepa, orepa-offline, dbb, repvgg, orepa-vgg, ladder rungs "
                        f"({', '.join(LADDER)}, offline, offline+prior, ...); options as name:key=value, "
                        "builder=KERNEL_BUILDER a variant's own --kernel-builder (orepa orepa:builder=compiled "
                        "times both in one run), pack=true|false its own --pack-parameters, joint=false a node "
                        "per group of online blocks instead of one for the network, graphs=true their builds "
                        "recorded as CUDA graphs (eager steps on CUDA); comma-separated lists "
                        "are accepted")
    p.add_argument("--components", action="store_true",
                   help="the component ladder of Fig. 'budgets' (base, dbb, each rung online and offline)")
    p.add_argument("-b", "--batch-size", type=positive_int, default=16)
    p.add_argument("--image-size", type=positive_int, default=224)
    p.add_argument("--reps", type=positive_int, default=5, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=nonneg_int, default=2)
    p.add_argument("--num-classes", type=positive_int, default=1000)
    p.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="zoo model option for every variant, e.g. width_mult=0.5 or small_input=True (repeatable); "
                        "in_chans=N (any model): the synthetic images' channels (3)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a result file of other variants (a rerun of the same variants replaces its own)")
    p.add_argument("--lr", type=positive_float, default=1e-3,
                   help="SGD lr (momentum 0.9, wd 1e-4); cost does not depend on it, small keeps random-data steps finite")
    p.add_argument("--no-inference", action="store_true", help="skip deployed inference timing")
    p.add_argument("--no-memory-profile", action="store_true", help="CPU: skip the profiler peak-memory pass")
    p.add_argument("--cudnn-benchmark", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: time steps with forward+backward replayed as CUDA graphs (no host launch overhead)")
    add_tf32_matmul_argument(p, default=False)  # off: the recorded tables' setting, TF32 convolutions only
    add_kernel_builder_argument(p)  # grouped: the GPU route on any device, e.g. to count its operators on a CPU
    add_pack_argument(p)
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="time steps of torch.compile'd models (default backend inductor; compiled outside the timing)")
    p.add_argument("--output-dir", "--out-dir", dest="output_dir", type=path_arg, default="bench_results",
                   help="where TAG.json, TAG.md and the plots go (--out-dir: older spelling)")
    p.add_argument("--tag", default=None, help="output file stem (default from the settings)")
    p.add_argument("--no-plot", action="store_true")
    add_run_arguments(p)  # --device, --threads, --seed as every computing subcommand takes them
    p.add_argument("--from-json", type=path_arg, default=None, metavar="FILE",
                   help="re-render the table and plots of a saved result (no measurement), into --output-dir if "
                        "given, else next to FILE")


#: the files one result is written as (:func:`orepa.apps.bench.report.save`): TAG + each suffix
RESULT_SUFFIXES = (".json", ".md", "_ratios.png", "_budgets.png")


#: the settings that make a bench result another measurement (beside its variants), which the default
#: file name does not say (or not wholly: "_compiled" for every backend); a rerun that differs in others
#: (repetitions, warm-up) replaces its own. All are the result's ``config`` but ``threads``, its
#: ``environment``'s (the torch threads it was timed with)
DEFINING_SETTINGS = ("model", "model_options", "num_classes", "in_chans", "lr", "seed", "compile", "pack_parameters",
                     "cudnn_benchmark", "tf32_matmul", "threads")


def _check_result_files(out_dir: Path, tag: str, wanted: dict | None, overwrite: bool,
                        replacing: Path | None = None) -> None:
    """Before measuring (or re-rendering): where this result goes. A file of its names that is a
    directory stops it; a result file of other variants or settings (``wanted``: the ``config`` of
    the result to write, its ``methods`` and :data:`DEFINING_SETTINGS`; the default name says the
    model, batch, size and device only), or a table or plot of its names beside no result of
    these, is replaced only with --overwrite; a rerun of the same measurement replaces its own.
    ``replacing``: the result being re-rendered, which may be the result file itself (in place).
    Either way, a .md beside the result that is not its table (:func:`is_table_of`: a user's notes),
    or plots beside no table of it, are replaced only with --overwrite too."""
    paths = [out_dir / f"{tag}{suffix}" for suffix in RESULT_SUFFIXES]
    for path in paths:
        if path.is_dir():
            raise UserError(f"--output-dir {out_dir}: {path.name} is a directory; remove it, or give --tag NAME")
    result, table = paths[0], paths[1]
    if overwrite or not any(p.exists() for p in paths):
        return
    in_place = replacing is not None and same_file(result, replacing)
    saved, settings = saved_result(result)
    config = settings or {}
    held = config.get("methods")
    where = f"--from-json {replacing}" if in_place else f"--output-dir {out_dir}"
    elsewhere = "another --output-dir" if replacing is not None else "--tag NAME to write this run's result beside it"
    methods = None if wanted is None else wanted.get("methods")
    if not isinstance(methods, list) or not isinstance(held, list):
        methods = held = None
    differ = [] if methods is None else [
        f"{k}: {config.get(k)!r} there, {wanted.get(k)!r} here" for k in DEFINING_SETTINGS
        if k in wanted and config.get(k) != wanted.get(k)]
    if not in_place and (methods is None or variant_specs(held) != variant_specs(methods) or differ):
        what = (f"{result.name} holds a result of {', '.join(map(str, held))}"
                + (f" with other settings ({'; '.join(differ)})" if differ else "") if isinstance(held, list) else
                f"{result.name} holds another file" if result.exists() else
                f"{', '.join(p.name for p in paths if p.exists())} exist(s) beside no result of these variants")
        raise UserError(f"{where}: {what}; pass --overwrite to replace it, or {elsewhere}")
    if in_place and settings is None:
        return  # a damaged source: rerender says what is wrong with it, before it writes anything
    # the result's own files: its table, and the plots beside it; another .md of the table's name is a user's
    others = [p.name for p in paths[1:] if p.exists()]
    if others and not is_table_of(table, saved):
        what = (f"{table.name} is not the table of {result.name} but another file" if table.exists() else
                f"{', '.join(others)} exist(s) beside no table of {result.name}")
        raise UserError(f"{where}: {what}; pass --overwrite to replace it, or {elsewhere}")


def _say_no_plot(result: dict, no_plot: bool) -> None:
    reason = None if no_plot else no_plot_reason(result)
    if reason:
        print(f"note: no ratio plot: {reason}")


def run(args: argparse.Namespace) -> int:
    if args.tag is not None and (Path(args.tag).name != args.tag or args.tag in ("", ".", "..")):
        raise UserError(f"--tag {args.tag!r} is a file stem in --output-dir, not a path")
    if args.from_json is not None:
        given = set(getattr(args, "given", None) or ())
        # said, not silently dropped: a re-rendered result keeps its own settings
        refuse_idle_flags(args, given - {"from_json", "output_dir", "no_plot", "overwrite"},
                          "--from-json re-renders a saved result as it was measured",
                          "only --output-dir, --overwrite and --no-plot do")
        source = Path(args.from_json)
        # an --output-dir given on the command line takes the files; else they go next to FILE
        out_dir = args.output_dir if "output_dir" in given else None
        if out_dir is not None:
            check_output_path(out_dir, "--output-dir", directory=True)
        _, held = saved_result(source)  # (None: rerender says what is wrong with the file)
        if source.is_file():
            _check_result_files(Path(out_dir) if out_dir is not None else source.parent, source.stem,
                                held, args.overwrite, replacing=source)
        try:
            result, files = rerender(args.from_json, plots=not args.no_plot, out_dir=out_dir)
        except (OSError, ValueError) as exc:  # missing, unreadable, not JSON, not a bench result
            said = str(getattr(exc, "strerror", None) or exc)  # rerender's messages name the file themselves
            raise UserError(f"--from-json {said}" if said.startswith(str(source)) else
                            f"--from-json {args.from_json}: {said}") from None
        print(format_header(result) + "\n\n" + format_table(result))
        print("\nwrote " + ", ".join(str(f) for f in files))
        _say_no_plot(result, args.no_plot)
        return 0
    # every check on the flags before the first build: a bad one fails in seconds, not after minutes
    apply_threads(args)
    _, device = init_distributed(args.device, one_process="orepa bench")
    try:
        check_step_modes(device, args.cuda_graphs, args.compile)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.compile:  # torch.compile names an unknown backend only at the first compiled step
        from torch import _dynamo

        known = _dynamo.list_backends(exclude_tags=())
        if args.compile not in known:
            raise UserError(f"--compile {args.compile}: not a torch.compile backend; e.g. {', '.join(sorted(known)[:6])}")
    check_output_path(args.output_dir, "--output-dir", directory=True)
    cuda_only = [f for f, on in (("--cudnn-benchmark", args.cudnn_benchmark), ("--tf32-matmul", args.tf32_matmul))
                 if on]
    if cuda_only and device.type != "cuda":  # said, as --cuda-graphs is, not taken and ignored
        raise UserError(f"{' and '.join(cuda_only)} appl{'y' if len(cuda_only) > 1 else 'ies'} to CUDA devices, "
                        f"not {device}")
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    apply_tf32_matmul(args.tf32_matmul, device)
    mopts = parse_options(args.model_option, "--model-option")
    for key in set(mopts) & set(MODEL_CFG_KEYS):  # width_mult, small_input, ...: the types every command checks
        mopts[key] = check_cfg_value(key, mopts[key])
    # the synthetic images' channels, which every variant is built for (it was a keyword given twice)
    in_chans = mopts.pop("in_chans", 3)
    model_flags = f"-m {args.model}" + "".join(f" --model-option {o}" for o in args.model_option)
    if args.components:
        if "methods" in set(getattr(args, "given", None) or ()):
            raise UserError("--components measures the ladder of the paper's components (its own variants): give "
                            "it or --methods, not both")
        try:
            methods = component_variants(args.model, args.num_classes, in_chans, mopts)
        except (ValueError, TypeError, KeyError) as exc:
            raise UserError(f"--components with {model_flags}: {exc}") from None
    else:
        methods = method_list(args.methods)
    dev = "cuda" if str(device).startswith("cuda") else "cpu"
    tag = args.tag or (f"{model_slug(args.model)}_b{args.batch_size}_{args.image_size}_{dev}"
                       + ("_graphs" if args.cuda_graphs else "") + ("_compiled" if args.compile else "")
                       + ("_tf32" if args.tf32_matmul and dev == "cuda" else "")
                       # "_compiled" names a torch.compile'd step: the compiled kernel builder is told apart
                       + ("" if args.kernel_builder == "auto" else "_" + args.kernel_builder
                          + ("-builder" if args.kernel_builder == "compiled" else ""))
                       + ("_components" if args.components else ""))
    if len(tag.encode()) > 240:  # the file system's 255 bytes, with the longest suffix: said before measuring
        raise UserError(f"--tag: {tag[:40]}... is too long for a file name (at most 240 bytes)")
    cuda = device.type == "cuda"
    _check_result_files(Path(args.output_dir), tag, {
        "methods": methods, "model": args.model, "model_options": mopts, "num_classes": args.num_classes,
        "in_chans": in_chans, "lr": args.lr, "seed": args.seed, "compile": args.compile,
        "pack_parameters": args.pack_parameters, "threads": torch.get_num_threads(),
        # (as the result records them)
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if cuda else None,
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None}, args.overwrite)
    # built here, each in its own try: what goes wrong in a build is the spec's or the model's (an unknown
    # name or option, a bad value); errors of the measurement itself keep their traceback
    runners = []
    for spec in variant_specs(methods):
        try:
            runners.append(make_runner(args.model, spec, device=device, num_classes=args.num_classes,
                                       in_chans=in_chans, model_options=mopts, lr=args.lr, seed=args.seed,
                                       kernel_builder=args.kernel_builder, pack=args.pack_parameters,
                                       compiled_step=bool(args.compile)))
        except (ValueError, TypeError, KeyError) as exc:
            # a comma inside an option's value ("orepa:branches=kxk,1x1") made its tail a variant of its own
            split = ":" not in spec and spec in methods and any("=" in m for m in methods[:methods.index(spec)])
            raise UserError(f"cannot build variant {spec!r} ({model_flags}): {exc}"
                            + ("; a comma separates variants: a list inside an option is written with '/', e.g. "
                               "orepa:branches=kxk/1x1" if split else "")) from None
    # a network that cannot take the images (the plain one: variant_specs puts base first), said before
    # anything is measured
    check_model_takes(runners[0].model, (args.image_size,), in_chans, model_flags,
                      lambda size: f"--image-size {size} ({size}x{size} images)", batch=args.batch_size, training=True)
    try:
        check_step_modes(device, args.cuda_graphs, args.compile, runners)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    # (a batch that leaves a training BatchNorm one value per channel was refused by check_model_takes)
    result = run_benchmark(
        args.model, methods, batch_size=args.batch_size, image_size=args.image_size, device=device,
        reps=args.reps, warmup=args.warmup, num_classes=args.num_classes, in_chans=in_chans, lr=args.lr,
        seed=args.seed, inference=not args.no_inference, profile_memory=not args.no_memory_profile,
        model_options=mopts,
        cuda_graphs=args.cuda_graphs, compile=args.compile, kernel_builder=args.kernel_builder,
        pack=args.pack_parameters, runners=runners,
    )
    print()
    print(format_header(result))
    print()
    print(format_table(result))
    files = save(result, args.output_dir, tag, plots=not args.no_plot)
    print("\nwrote " + ", ".join(str(f) for f in files))
    _say_no_plot(result, args.no_plot)
    diverged = [n for n, r in result["results"].items() if r.get("diverged")]
    off = [n for n, r in result["results"].items() if r["deploy_err"] is not None and r["deploy_err"] > 1e-3]
    if diverged:
        print(f"note: non-finite outputs for {diverged}: the random-data steps diverged (lower --lr); "
              "costs are unaffected")
    if off:
        print(f"warning: the deployed model differs from the training form for {off} (max |difference| > 1e-3)",
              file=sys.stderr)
    return 0
