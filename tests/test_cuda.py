"""Checks that need a real CUDA device (skipped without one): the fast training modes follow eager
training, and the grouped kernel builder (eager and compiled with Triton) matches the per-block
one on the GPU.

Run on a GPU machine with Fashion-MNIST at $OREPA_FASHION_MNIST_DIR (benchmarks/gpu_session.sh does)::

    python -m pytest -n 0 tests/test_cuda.py -v     # in one process (one device); -o addopts= without pytest-xdist
"""
import json

import pytest
import torch

from orepa import engine
from orepa.apps.common import full_float32
from orepa.cli import main
from orepa.models import create_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# 8 steps of a quarter-width OREPA ResNet-18 (every online block type incl. the deep stem); momentum
# carries a wrong gradient into every later step. A small constant lr: these first steps amplify float
# noise at large rates (2 vs 1 CPU threads alone move lr 0.2's updates by 49%, lr 0.02's by 17%,
# lr 1e-3's by 0.9%), while a doubled or dropped gradient moves them by O(1) at any rate.
RUN = ["--model", "resnet18", "--method", "orepa", "--width-mult", "0.25", "--train-subset", "512",
       "--val-subset", "256", "-b", "64", "--epochs", "1", "--lr", "1e-3", "--lr-warmup-epochs", "0",
       "--lr-scheduler", "constant", "-j", "0", "--no-progress", "--no-tensorboard", "--no-curves", "--seed", "0",
       "--device", "cuda"]


def _run(cache, out, *extra):
    assert main(["train", *RUN, "--cache-dir", cache, "--output-dir", str(out), *extra]) == 0
    ckpt = torch.load(out / "checkpoint.pth", map_location="cpu", weights_only=True)
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return ckpt["model"], rows[-1]


@pytest.mark.parametrize("mode", ["--cuda-graphs", "--compile", "--kernel-graphs"])
def test_fast_mode_steps_follow_eager_steps(mode, cache, tmp_path):
    """Weights, BN statistics and loss after 8 steps of a fast mode equal eager steps' to float noise
    (cuDNN's atomics and algorithm choice, TF32): measured on the weights' *updates*, which a doubled
    or dropped gradient changes by O(1) (the --cuda-graphs defect: 0.8), noise by ~1e-2."""
    start, _ = _run(cache, tmp_path / "start", "--no-cuda-graphs", "--lr", "1e-12")  # the initial weights
    eager, eager_row = _run(cache, tmp_path / "eager", "--no-cuda-graphs")
    fast, fast_row = _run(cache, tmp_path / "fast", mode, *(["--no-cuda-graphs"] if mode == "--compile" else []))
    assert eager.keys() == fast.keys()
    weights = [k for k in eager if k.endswith("weight") and eager[k].dtype.is_floating_point]
    du = torch.cat([(fast[k] - eager[k]).flatten() for k in weights])
    upd = torch.cat([(eager[k] - start[k]).flatten() for k in weights])
    assert upd.norm() > 0
    assert (du.norm() / upd.norm()).item() < 0.1, f"{mode}: updates differ by {(du.norm() / upd.norm()).item():.3g}"
    for k in eager:
        if "running_" in k:
            torch.testing.assert_close(fast[k], eager[k], rtol=2e-2, atol=2e-3, msg=f"{mode}: {k}")
    assert fast_row["train_loss"] == pytest.approx(eager_row["train_loss"], rel=2e-3)


def test_grouped_kernels_equal_per_block_kernels_on_the_gpu():
    """On CUDA the default policy groups; its forward and every gradient equal the per-block route's."""
    torch.manual_seed(0)
    with full_float32():
        models = []
        for policy in ("auto", "per-block"):
            torch.manual_seed(0)
            m = create_model("resnet50", "orepa", num_classes=10, width_mult=0.25).cuda().double()
            engine.group_kernels(m, policy)
            models.append(m)
        assert engine.kernel_groups(models[0])[0].active(torch.zeros(1, device="cuda"))
        x = torch.randn(4, 3, 64, 64, device="cuda", dtype=torch.float64)
        outs = []
        for m in models:
            y = m(x)
            y.square().sum().backward()
            outs.append(y)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-9)
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-9, msg=name)


@pytest.mark.parametrize("pack", [False, True])
def test_the_workspace_on_the_gpu_frees_its_memory_between_builds_and_gives_the_per_block_numbers(pack):
    """The eager groups' workspace (engine.Workspace) on CUDA: its arena holds no memory between
    builds, and two SGD steps give the per-block route's gradients."""
    import copy

    torch.manual_seed(0)
    with full_float32():
        m = create_model("resnet18", "orepa", num_classes=10, width_mult=0.25).cuda().double()
        ref = copy.deepcopy(m)
        engine.group_kernels(m, "grouped", pack=pack)
        engine.group_kernels(ref, "per-block")
        x = torch.randn(8, 3, 64, 64, device="cuda", dtype=torch.float64)
        opts = [torch.optim.SGD(n.parameters(), lr=0.01, momentum=0.9) for n in (m, ref)]
        for _ in range(2):
            for n, opt in zip((m, ref), opts):
                opt.zero_grad(set_to_none=True)
                n(x).square().mean().backward()
                opt.step()
        (arena,) = engine.kernel_groups(m)[0].workspace.arenas.values()
        assert arena.frees and sum(arena.elements) > 0 and all(st.nbytes() == 0 for st in arena.storages)
        for (k, a), b in zip(m.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=k)


@pytest.mark.parametrize("pack", [False, True])
def test_a_capture_that_finds_the_storage_moved_reads_the_parameters_at_replay(pack):
    """A group whose tensors moved (here: load_state_dict(assign=True), or new memory for every
    tensor as a device move gives) remakes its storage at the next build, except inside a CUDA graph
    capture: there it concatenates the tensors in the graph (a packed group: the fixed filters; its
    packed parameters are read as they are), so a replay reads them as they are then (in-place
    updates after the capture included)."""
    import copy

    torch.manual_seed(0)
    with full_float32():
        m = create_model("resnet18", "orepa", num_classes=10, width_mult=0.25).cuda().double().eval()
        engine.group_kernels(m, "grouped", pack=pack)
        ref = copy.deepcopy(m)
        engine.group_kernels(ref, "per-block")
        x = torch.randn(4, 3, 64, 64, device="cuda", dtype=torch.float64)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(x).sum().backward()  # warm-up: every group makes its storage
        torch.cuda.current_stream().wait_stream(side)
        if pack:
            m._apply(lambda t: t.clone())
        else:
            m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
        m.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = m(x)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.1)
            ref.load_state_dict(m.state_dict())
        graph.replay()
        torch.testing.assert_close(y, ref(x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("pack", [False, True])
def test_the_inductor_kernel_builder_equals_the_eager_groups_and_replays_under_capture(pack):
    """--kernel-builder compiled on the GPU (Triton): the same outputs and gradients as the eager
    groups, eager and replayed as CUDA graphs (the compiled code runs inside the capture); with
    packed parameters (train's default on CUDA) too."""
    import copy

    from torch import nn

    from orepa.blocks import OREPAConv2d

    torch.manual_seed(0)
    with full_float32():
        net = nn.Sequential(OREPAConv2d(16, 16, 3, padding=1), nn.ReLU(), OREPAConv2d(16, 16, 3, padding=1),
                            nn.ReLU(), OREPAConv2d(16, 32, 3, padding=1, groups=2)).cuda().double()
        ref = copy.deepcopy(net)
        engine.group_kernels(net, "compiled", pack=pack)
        engine.group_kernels(ref, "grouped", pack=pack)
        x = torch.randn(2, 16, 8, 8, device="cuda", dtype=torch.float64)

        def grads(model):
            model.zero_grad(set_to_none=True)
            y = model(x)
            y.square().sum().backward()
            return y.detach(), [p.grad.clone() for p in model.parameters()]

        y, g = grads(net)
        y0, g0 = grads(ref)
        groups = engine.kernel_groups(net)
        assert not groups[0]._compile_failed  # one compiled build, led by the first group, for all
        assert groups[0]._compiled_for[1].plans == tuple(grp.plan for grp in groups)
        torch.testing.assert_close(y, y0, rtol=1e-10, atol=1e-12)
        for a, b in zip(g, g0):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        graphed = torch.cuda.make_graphed_callables(net, (x,))
        for _ in range(2):  # a replay reads the parameters as they are: updated in place in between
            net.zero_grad(set_to_none=True)
            y = graphed(x)
            y.square().sum().backward()
            y0, g0 = grads(ref)
            torch.testing.assert_close(y, y0, rtol=1e-10, atol=1e-12)
            for p, b in zip(net.parameters(), g0):
                torch.testing.assert_close(p.grad, b, rtol=1e-9, atol=1e-12)
            with torch.no_grad():
                for p, q in zip(net.parameters(), ref.parameters()):
                    p.mul_(0.9)
                    q.copy_(p)


@pytest.mark.parametrize("policy,pack", [("grouped", False), ("grouped", True), ("compiled", True)])
def test_recorded_kernel_builds_train_as_unrecorded_ones_at_any_batch_and_under_a_capture(policy, pack):
    """group_kernels(graphs=True) on the GPU: SGD steps of varying batch (8, 5, then two micro-batches
    accumulated) give the unrecorded groups' parameters, from one recording per group; a whole
    forward captured as a CUDA graph captures each group's own build inside it (no recording is
    replayed, nothing compiled there) and reads the parameters at replay; under fp16 autocast a
    step runs."""
    import copy
    import importlib.util

    if policy == "compiled" and importlib.util.find_spec("triton") is None:
        pytest.skip("the compiled builder needs Triton")
    torch.manual_seed(0)
    with full_float32():
        m = create_model("resnet18", "orepa", num_classes=10, width_mult=0.25).cuda().double()
        ref = copy.deepcopy(m)
        groups = engine.group_kernels(m, policy, pack=pack, graphs=True)
        engine.group_kernels(ref, policy, pack=pack)
        opts = [torch.optim.SGD(n.parameters(), lr=0.01, momentum=0.9) for n in (m, ref)]
        xs = [torch.randn(b, 3, 64, 64, device="cuda", dtype=torch.float64) for b in (8, 5, 4, 4)]
        for batch in ([xs[0]], [xs[1]], xs[2:]):
            for n, opt in zip((m, ref), opts):
                opt.zero_grad(set_to_none=True)
                for x in batch:
                    n(x).square().mean().backward()
                opt.step()
        assert isinstance(groups[0]._graphed_for[1], engine.GraphedBuild)
        assert all(g._recordings == 1 for g in groups)
        # held: the pool (temporaries) and the two buffers every recording's outputs (kernels and
        # gradients) and kernels' gradients in are views of
        device = next(m.parameters()).device
        buffers = [groups[0].workspace.recording_buffer(device, use).buffer for use in ("outputs", "gradients in")]
        for buffer, ts in zip(buffers, ([t for g in groups for t in (*g._recording.kernels, *g._recording.grads)],
                                        [t for g in groups for t in g._recording.grads_in])):
            assert {t.untyped_storage().data_ptr() for t in ts} == {buffer.untyped_storage().data_ptr()}
        pools = sum(r.pool_bytes() for r in groups[0].workspace.recorders.values())
        assert pools > 0 and engine.recorded_bytes(m) == pools + sum(b.nbytes for b in buffers)
        for (k, a), b in zip(m.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=k)
        m.eval(), ref.eval()  # BN statistics fixed: the captured forward is compared with eager ones
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(xs[0])
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            y = m(xs[0])
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.1)
            ref.load_state_dict(m.state_dict())
        graph.replay()
        torch.testing.assert_close(y, ref(xs[0]), rtol=1e-9, atol=1e-9)
        assert all(g._recordings == 1 for g in groups)
    m.train().float()  # a new recording for the float32 storage, under autocast: kernels in float32
    x = xs[0].float()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = m(x).float().square().mean()
    loss.backward()
    assert torch.isfinite(loss) and all(g._recordings == 2 for g in groups)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("route", ["grouped packed", "recorded"])
def test_double_backward_on_the_gpu_matches_plain_autograd(route):
    """create_graph=True on the GPU routes (the workspace's out= writes, recorded builds): the gradient
    of a penalty on the parameters' gradients matches plain autograd through orepa.kernels."""
    import copy

    from orepa.blocks import OREPAConv2d

    torch.manual_seed(0)
    with full_float32():
        ref = create_model("resnet18", "orepa", num_classes=10, width_mult=0.125).cuda().double()
        net = copy.deepcopy(ref)
        for m in ref.modules():
            if isinstance(m, OREPAConv2d):
                m._closed_form = False  # the reference path: plain autograd
        engine.group_kernels(net, "grouped", pack=True, graphs=route == "recorded")
        x = torch.randn(2, 3, 32, 32, device="cuda", dtype=torch.float64)
        grads = []
        for model in (ref, net):
            for _ in range(2):  # the second step replays what the first recorded
                model.zero_grad(set_to_none=True)
                loss = model(x).square().mean()
                first = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
                (loss + sum(g.square().sum() for g in first)).backward()
            grads.append({k: v.grad for k, v in model.named_parameters() if ".packed_parameters." not in k})
        for name, m in net.named_modules():  # a packed step's gradient: its rows of its packed parameter's
            slot = m.__dict__.get("_packed")
            if slot is not None:
                grads[1][f"{name}.weight"] = slot.holder._parameters[slot.name].grad.narrow(0, slot.lo, slot.size)
        scale = max(g.abs().max() for g in grads[0].values())
        assert grads[0].keys() == grads[1].keys()
        for k, g in grads[0].items():
            torch.testing.assert_close(grads[1][k], g, rtol=0, atol=1e-9 * scale, msg=k)
