#!/usr/bin/env bash
# The GPU checks for a lent GPU machine, one phase per call (run from the repository root):
#   benchmarks/gpu_session.sh probe      # ~4 min: nccl/fp16/SyncBN smoke run + reparam, a torchvision network in
#                                        #   the default CUDA mode + reparam, cost tables at the
#                                        #   paper's setting (ResNet-18 and ResNet-50, batch 64, 224x224)
#   benchmarks/gpu_session.sh compile    # ~8 min: the same cost tables with torch.compile'd train steps
#   benchmarks/gpu_session.sh steps      # ~6 min: the step modes. tests/test_cuda.py (CUDA-graph steps vs eager
#                                        #   steps, grouped vs per-block kernels), the accuracy check (ResNet-18,
#                                        #   Fashion-MNIST, 1 epoch on 25,600 images at batch 256: eager vs the
#                                        #   default mode), and eager / CUDA-graph step times of base, OREPA and DBB
#                                        #   (ResNet-18 and ResNet-50 at batch 64, ResNet-18 at batch 8; 224x224)
#   benchmarks/gpu_session.sh modes      # ~7 min: the tests and step times of "steps" without the accuracy
#                                        #   check, a short default-mode run with --amp --channels-last --model-ema,
#                                        #   torch.compile'd steps of base and OREPA (ResNet-18 b64), and the GPU
#                                        #   time per operator of an eager base / OREPA step (ResNet-18 b64)
#   benchmarks/gpu_session.sh builder    # ~9 min, one call: what decides the CUDA default. tests/test_cuda.py (the
#                                        #   compiled builder on Triton against the eager groups, graphed steps), then
#                                        #   base / OREPA (eager groups) / OREPA (compiled groups) / DBB in one process
#                                        #   each: ResNet-18 b64 eager and CUDA graphs, ResNet-18 b8, ResNet-50 b64;
#                                        #   then, if time is left, the GPU time per fused kernel at ResNet-18 b64
#   benchmarks/gpu_session.sh defaults   # ~9.5 min, one call: the GPU tests of the compiled groups, then what
#                                        #   `orepa train` runs on CUDA by default (compiled builder, packed
#                                        #   parameters, one node for the network's kernels, TF32 matmuls) against
#                                        #   the configuration of the last H100 figures, paired with base:
#                                        #   ResNet-18 b64 eager, the accuracy check of the default mode,
#                                        #   ResNet-18 b8 eager, b64 CUDA graphs, ResNet-50 b64 eager
#   benchmarks/gpu_session.sh graphs     # ~9.5 min, one call: the kernel builds recorded as CUDA graphs (group_kernels'
#                                        #   graphs, --kernel-graphs) for eager steps. Their real-device tests, then
#                                        #   base / OREPA eager groups / recorded / compiled / compiled and recorded /
#                                        #   DBB paired in one process, eager steps: ResNet-18 b64, the accuracy check
#                                        #   with --kernel-graphs, ResNet-18 b8, ResNet-50 b64 (TF32 matmuls)
#   EPOCHS=N [TRAIN_EXTRA=--no-cuda-graphs] benchmarks/gpu_session.sh long
#                                        # full-width OREPA ResNet-18 on Fashion-MNIST, N epochs at batch 256,
#                                        #   then reparam (verified) and the branch analysis of the trained model
#   GPU_SESSION_DRY=1 benchmarks/gpu_session.sh PHASE
#                                        # on any machine, before a session: every command of PHASE checked, not
#                                        #   run (benchmarks/gpu_session_check.py; tests/test_gpu_session.py)
# Fashion-MNIST is read from $OREPA_FASHION_MNIST_DIR (default .gpu/fmnist: the Debian package's .gz files
# copied there, since the GPU machine cannot install packages). Results go to $RESULTS (default /tmp/gpu)
# and, where $OUT is set, into one tarball $OUT/<phase>.tgz.
set -u -o pipefail
phase=${1:?usage: gpu_session.sh probe|compile|steps|modes|builder|defaults|graphs|long}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OREPA_FASHION_MNIST_DIR=${OREPA_FASHION_MNIST_DIR:-$PWD/.gpu/fmnist} OREPA_CACHE=${OREPA_CACHE:-/tmp/orepa-cache}
R=${RESULTS:-/tmp/gpu}/$phase
mkdir -p "$R"
if [ -n "${GPU_SESSION_DRY:-}" ]; then
    # a dry run, on any machine: each command is written down instead of run, then checked at the end by
    # benchmarks/gpu_session_check.py (flags, bench variants, pytest -k selections), so that a typo does not
    # cost a lent GPU's minutes
    : > "$R/dry_commands"
    record() { printf '%q ' "$@" >> "$R/dry_commands"; echo >> "$R/dry_commands"; }
    timeout() { shift; "$@"; }
    python3() { if [ "$1" = -c ]; then echo "dry run: python3 -c not run"; else record python3 "$@"; fi; }
    torchrun() { record torchrun "$@"; }
    nvidia-smi() { echo "dry run: no GPU"; }
fi
# tests/test_cuda.py without the compile comparison (minutes of compilation); $1: its time limit
cuda_tests() {
    # the whole log kept (a run cut off by its limit loses pytest's last line); its end shown. In this
    # process (-o addopts=-q: no pytest-xdist workers; the device machine may not have xdist, and
    # one device is shared anyway)
    timeout "$1" python3 -m pytest -o addopts=-q -rA -p no:cacheprovider tests/test_cuda.py \
        -k "${CUDA_TESTS:-not compile}" 2>&1 \
        | tee "$R/test_cuda.log" | tail -15
    pack  # after each stage: a run cut off by its time limit still returns what it measured
}
# eager and CUDA-graph step times of base / OREPA / DBB at the paper's setting: fp32 (TF32 convs),
# cudnn.benchmark, SGD momentum, steps interleaved; $1: the time limit of each bench
step_times() {
    local setting graphs
    for setting in "resnet18 64" "resnet50 64" "resnet18 8"; do
        set -- "$1" $setting
        for graphs in "" "--cuda-graphs"; do
            timeout "$1" python3 -m orepa bench -m "$2" -b "$3" --image-size 224 --device cuda --cudnn-benchmark \
                --methods base orepa dbb --reps 25 --warmup 5 --no-inference $graphs --output-dir "$R/bench" \
                --no-plot 2>&1 | tail -6 | tee -a "$R/bench.log"
            pack
        done
    done
}
# phases "builder" and "defaults": their stages share one deadline, $BUDGET_S (default 560 s) from the start,
# so slack flows to later stages; `left N`: the stage's limit N, or what is left if less
deadline=$((SECONDS + ${BUDGET_S:-560}))
left() { local l=$((deadline - SECONDS)); echo $((l < $1 ? l : $1)); }
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/$phase.part" -C "$R" . && mv "$OUT/$phase.part" "$OUT/$phase.tgz"; }
trap pack EXIT

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
} 2>&1 | tee "$R/machine.txt"

case $phase in
probe)
    # DDP with nccl, fp16 autocast + GradScaler, SyncBatchNorm, channels_last: one epoch on 12800 images
    timeout 150 torchrun --nproc_per_node=1 -m orepa train --epochs 1 --train-subset 12800 -b 128 -j 8 \
        --amp --sync-bn --channels-last --lr-warmup-epochs 0.2 --output-dir /tmp/smoke --no-progress \
        2>&1 | tee "$R/smoke_train.log"
    timeout 90 python3 -m orepa reparam /tmp/smoke/checkpoint.pth --fuse-bn --json "$R/smoke_reparam.json" \
        --no-progress 2>&1 | tee "$R/smoke_reparam.log"
    # a network of another library in orepa train's CUDA default mode (torchvision's MobileNetV3: depthwise
    # blocks, dropout in the graphed step), then its deployed checkpoint verified
    timeout 150 python3 -m orepa train -m torchvision:mobilenet_v3_large --method orepa --epochs 1 --train-subset 5120 \
        -b 128 -j 8 --lr-warmup-epochs 0.2 --output-dir /tmp/smoke_tv --no-progress --no-tensorboard 2>&1 \
        | tail -8 | tee "$R/smoke_torchvision_train.log"
    timeout 90 python3 -m orepa reparam /tmp/smoke_tv/checkpoint.pth --json "$R/smoke_torchvision_reparam.json" \
        --no-progress 2>&1 | tee "$R/smoke_torchvision_reparam.log"
    # the paper's cost setting: batch 64 per GPU, 224x224, fp32 train steps
    for m in resnet18 resnet50; do
        timeout 200 python3 -m orepa bench -m "$m" -b 64 --image-size 224 --device cuda --cudnn-benchmark \
            --methods base orepa dbb --reps 30 --warmup 10 --output-dir "$R/bench" 2>&1 | tee "$R/bench_$m.log"
    done
    ;;
compile)
    # torch.compile (inductor) removes the host launches of the kernel construction, as CUDA graphs do, and
    # fuses its element-wise passes; the variants compile one after another outside the timing
    for m in resnet18 resnet50; do
        timeout 290 python3 -m orepa bench -m "$m" -b 64 --image-size 224 --device cuda --cudnn-benchmark --compile \
            --methods base orepa dbb --reps 20 --warmup 3 --no-inference --output-dir "$R/bench" 2>&1 | tee "$R/bench_$m.log"
    done
    ;;
steps)
    cuda_tests 240
    # the accuracy check: the same seed and data, eager vs the default mode (CUDA graphs where they run)
    for run in "orepa eager --no-cuda-graphs" "orepa default" "base default"; do
        set -- $run
        timeout 120 python3 -m orepa train --method "$1" --epochs 1 --train-subset 25600 -b 256 -j 8 --seed 0 \
            --lr-warmup-epochs 0.2 --no-progress --no-tensorboard --output-dir "/tmp/acc_$1_$2" ${3:-} 2>&1 \
            | tail -8 | tee "$R/acc_$1_$2.log"
        cp "/tmp/acc_$1_$2/summary.json" "$R/acc_$1_$2.json" 2>/dev/null
        pack
    done
    step_times 150
    # the grouped kernel builder's share: the per-block route on the same GPU
    timeout 120 python3 -m orepa bench -m resnet18 -b 64 --image-size 224 --device cuda --cudnn-benchmark \
        --methods base orepa --reps 25 --warmup 5 --no-inference --kernel-builder per-block --output-dir "$R/bench" \
        --no-plot 2>&1 | tail -10 | tee -a "$R/bench.log"
    ;;
modes)
    # the step modes side by side after a change: the real-device tests, eager and CUDA-graph steps of
    # base / OREPA / DBB at the paper's setting, and torch.compile'd steps of base and OREPA (ResNet-18 b64)
    cuda_tests 150
    # the default mode (CUDA graphs) with the options that change what the capture sees: fp16 autocast,
    # channels_last, an EMA of the weights; one short epoch, then its deployment checked
    timeout 90 python3 -m orepa train --epochs 1 --train-subset 5120 -b 256 -j 8 --amp --channels-last --model-ema \
        --lr-warmup-epochs 0.2 --no-progress --no-tensorboard --output-dir /tmp/opts 2>&1 | tail -6 | tee "$R/opts_train.log"
    timeout 60 python3 -m orepa reparam /tmp/opts/checkpoint.pth --fuse-bn --json "$R/opts_reparam.json" \
        --no-progress 2>&1 | tail -3 | tee "$R/opts_reparam.log"
    pack
    step_times 120
    # where the GPU time of OREPA's kernel construction goes (what a CUDA-graph replay still runs)
    timeout 90 python3 benchmarks/profile_step.py -m resnet18 -b 64 --device cuda --methods base orepa --steps 3 \
        --top 30 --json "$R/profile_resnet18_b64_cuda.json" > "$R/profile_resnet18_b64_cuda.txt" 2>&1
    pack
    timeout 200 python3 -m orepa bench -m resnet18 -b 64 --image-size 224 --device cuda --cudnn-benchmark --compile \
        --methods base orepa --reps 20 --warmup 3 --no-inference --output-dir "$R/bench" --no-plot 2>&1 | tail -6 \
        | tee -a "$R/bench.log"
    ;;
builder)
    # the kernel builders side by side, paired with base in one process (orepa:builder=compiled is a variant);
    # the first run compiles ResNet-18's groups, later ones find them in inductor's cache (kernel shapes do
    # not depend on the batch); ResNet-50 compiles its 20 groups last. Each stage: at most its limit, see left().
    cuda_tests "$(left 120)"
    for run in "resnet18 64 140" "resnet18 64 90 --cuda-graphs" "resnet18 8 60" "resnet50 64 150"; do
        set -- $run
        limit=$(left "$3"); [ "$limit" -gt 20 ] || break
        timeout "$limit" python3 -m orepa bench -m "$1" -b "$2" --image-size 224 --device cuda --cudnn-benchmark ${4:-} \
            --methods base orepa orepa:builder=compiled dbb --reps 25 --warmup 5 --no-inference \
            --output-dir "$R/bench" --no-plot 2>&1 | tail -7 | tee -a "$R/bench.log"
        pack
    done
    # the compiled builder in the default mode (CUDA graphs) trains as the eager groups do: the accuracy check
    # of "steps" (ResNet-18, Fashion-MNIST, 1 epoch on 25,600 images at batch 256, seed 0)
    limit=$(left 100)
    if [ "$limit" -gt 40 ]; then
        timeout "$limit" python3 -m orepa train --method orepa --epochs 1 --train-subset 25600 -b 256 -j 8 --seed 0 \
            --lr-warmup-epochs 0.2 --no-progress --no-tensorboard --kernel-builder compiled \
            --output-dir /tmp/acc_compiled 2>&1 | tail -8 | tee "$R/acc_orepa_default_compiled-builder.log"
        cp /tmp/acc_compiled/summary.json "$R/acc_orepa_default_compiled-builder.json" 2>/dev/null
        pack
    fi
    # where the compiled constructions' GPU time goes (their Triton kernels: category "fused")
    limit=$(left 60)
    if [ "$limit" -gt 20 ]; then
        timeout "$limit" python3 benchmarks/profile_step.py -m resnet18 -b 64 --device cuda --methods base orepa \
            --steps 3 --top 30 --kernel-builder compiled --json "$R/profile_resnet18_b64_cuda_compiled-builder.json" \
            > "$R/profile_resnet18_b64_cuda_compiled-builder.txt" 2>&1
        pack
    fi
    ;;
defaults)
    # what `orepa train` runs on CUDA by default (the compiled builder, packed parameters, the network's
    # kernels as one node: one compiled call each way; TF32 matmuls) against the configuration the last
    # H100 figures had (compiled groups, unpacked, a node and a compiled call per group), paired with base
    # (same matmul setting); at ResNet-18 b8, where the host decides most, also packed with a node per
    # group, which tells packing's share from the joint node's. First the real-device tests (compiled on
    # Triton against eager, replayed under capture), and right after the first bench the accuracy check of
    # the default mode (graphs; eager steps gave 79.12% at fb786e5, compiled groups with graphs 79.15% at
    # 333a741). Stage limits sum to ~9.7 min on a 560 s deadline: the last stage gets what is left.
    old=orepa:builder=compiled:pack=false:joint=false
    CUDA_TESTS="inductor or capture or equal_per_block" cuda_tests "$(left 70)"
    for run in "resnet18 64 140 --tf32-matmul" "accuracy" "resnet18 8 90 --tf32-matmul" \
               "resnet18 64 80 --tf32-matmul --cuda-graphs" "resnet50 64 100 --tf32-matmul"; do
        set -- $run
        if [ "$1" = accuracy ]; then
            limit=$(left 100); [ "$limit" -gt 40 ] || continue
            timeout "$limit" python3 -m orepa train --method orepa --epochs 1 --train-subset 25600 -b 256 -j 8 \
                --seed 0 --lr-warmup-epochs 0.2 --no-progress --no-tensorboard --output-dir /tmp/acc_default \
                2>&1 | tail -8 | tee "$R/acc_orepa_default.log"
            cp /tmp/acc_default/summary.json "$R/acc_orepa_default.json" 2>/dev/null
            pack
            continue
        fi
        limit=$(left "$3"); [ "$limit" -gt 20 ] || break
        methods="base $old orepa:builder=compiled"
        [ "$2" = 8 ] && methods="base $old orepa:builder=compiled:joint=false orepa:builder=compiled"
        timeout "$limit" python3 -m orepa bench -m "$1" -b "$2" --image-size 224 --device cuda --cudnn-benchmark \
            ${4:-} ${5:-} --methods $methods --reps 25 \
            --warmup 5 --no-inference --output-dir "$R/bench" --no-plot 2>&1 | tail -7 | tee -a "$R/bench.log"
        pack
    done
    ;;
graphs)
    # eager steps whose kernel construction is replayed (engine.GraphedBuild): what it saves against the eager
    # and compiled groups, and what its held graph memory costs at the peak. Stage limits sum to ~9.6 min on
    # the 560 s deadline; the accuracy check runs right after the first bench (eager steps gave 79.12%)
    CUDA_TESTS="recorded or kernel-graphs" cuda_tests "$(left 150)"
    for run in "resnet18 64 150" "accuracy" "resnet18 8 60" "resnet50 64 100"; do
        set -- $run
        if [ "$1" = accuracy ]; then
            limit=$(left 100); [ "$limit" -gt 40 ] || continue
            timeout "$limit" python3 -m orepa train --method orepa --epochs 1 --train-subset 25600 -b 256 -j 8 \
                --seed 0 --lr-warmup-epochs 0.2 --no-progress --no-tensorboard --kernel-graphs \
                --output-dir /tmp/acc_kernel_graphs 2>&1 | tail -8 | tee "$R/acc_orepa_kernel-graphs.log"
            cp /tmp/acc_kernel_graphs/summary.json "$R/acc_orepa_kernel-graphs.json" 2>/dev/null
            pack
            continue
        fi
        limit=$(left "$3"); [ "$limit" -gt 20 ] || break
        methods="base orepa orepa:graphs=true orepa:builder=compiled orepa:builder=compiled:graphs=true dbb"
        [ "$1" = resnet50 ] && methods="base orepa orepa:graphs=true dbb"  # no compilation of 20 groups here
        timeout "$limit" python3 -m orepa bench -m "$1" -b "$2" --image-size 224 --device cuda --cudnn-benchmark \
            --tf32-matmul --methods $methods --reps 25 --warmup 5 --no-inference --output-dir "$R/bench" \
            --no-plot 2>&1 | tail -9 | tee -a "$R/bench.log"
        pack
    done
    ;;
long)
    epochs=${EPOCHS:?set EPOCHS}
    # batch 256, lr 0.1: the paper's global batch and rate; fp32 (TF32) steps, since at 28x28 the OREPA step is
    # bound by kernel launches and autocast only adds casts. --time-limit keeps room for reparam and analyze.
    timeout "${TRAIN_TIMEOUT:-500}" python3 -m orepa train --epochs "$epochs" -b 256 --lr-warmup-epochs 1 -j 8 ${TRAIN_EXTRA:-} \
        --time-limit "${TIME_LIMIT_MIN:-7.5}" --output-dir /tmp/long --no-progress 2>&1 | tee "$R/train.log"
    for f in log.jsonl log.csv summary.json curves.png; do cp /tmp/long/$f "$R/" 2>/dev/null; done
    timeout 90 python3 -m orepa reparam /tmp/long/checkpoint.pth --fuse-bn --json "$R/reparam.json" \
        --no-progress 2>&1 | tee "$R/reparam.log"
    timeout 90 python3 -m orepa analyze /tmp/long/checkpoint.pth --output-dir "$R/analyze" 2>&1 | tee "$R/analyze.log"
    ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
# the GPU goals (docs/benchmarks.md) against what this phase measured (benchmarks/gpu_goals.py): the verdict at a glance
if [ -d "$R/bench" ] || [ -n "${GPU_SESSION_DRY:-}" ]; then
    python3 benchmarks/gpu_goals.py "$R/bench" --json "$R/goals.json" 2>&1 | tee "$R/goals.md"
fi
if [ -n "${GPU_SESSION_DRY:-}" ]; then  # GPU_SESSION_DRY=record: the commands written down, not checked
    [ "$GPU_SESSION_DRY" = record ] || command python3 benchmarks/gpu_session_check.py "$R/dry_commands"
    exit $?
fi
