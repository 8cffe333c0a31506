"""The fast online training path equals the reference squeeze, value and gradient.

Online blocks train through a closed-form squeeze (hand-written backward, no
intermediate kernels kept), may rebuild the kernel in backward instead of
keeping it, and may run a 1x1 -> kxk branch on the feature map when that is
cheaper for the input (matrix-chain order). All of it must be invisible.
"""
import contextlib
import copy
import itertools

import pytest
import torch
from conftest import aot_graph_backend, matrix_products, tol_close
from torch import nn

import orepa
from orepa import engine
from orepa import kernels as K
from orepa.engine import plan_of, squeeze_kernels


def _randomized(block):
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
    return block


def _grads(block, x, gy):
    y = block(x)
    return y, torch.autograd.grad(y, [x, *block.parameters()], gy)


CASES = list(itertools.product([1, 3, 5, (1, 3), (5, 3)], [1, 2], [1, 2, "dw"], [(4, 8), (32, 32)],
                               ["auto", True, False]))


@pytest.mark.parametrize("k,s,g,ch,recompute", CASES)
def test_training_path_matches_offline_reference(k, s, g, ch, recompute):
    ci, co = ch
    groups = ci if g == "dw" else g
    on = _randomized(orepa.OREPAConv2d(ci, co, k, s, groups=groups, recompute=recompute, bias=True).double())
    off = orepa.OREPAConv2d(ci, co, k, s, groups=groups, mode="offline", bias=True).double()
    off.load_state_dict(on.state_dict())
    for n, h in [(1, 3), (4, 9)]:  # tiny inputs take the feature route for big blocks
        x = torch.randn(n, ci, h, h, dtype=torch.double, requires_grad=True)
        y_on, g_on = _grads(on, x, gy := torch.randn_like(off(x)))
        y_off, g_off = _grads(off, x, gy)
        tol_close(y_on, y_off, rel=1e-12)
        for a, b in zip(g_on, g_off):
            tol_close(a, b, rel=1e-10)


@pytest.mark.parametrize("policy,recompute", [("per-block", "auto"), ("per-block", True), ("per-block", False),
                                              ("grouped", "auto")])
def test_scalar_scaling_trains_as_the_offline_reference(policy, recompute):
    """``scaling="scalar"`` (the ablation's one factor per branch): every gradient, the scales' sums
    over the output channels included, equals the offline blocks' autograd, on each route (feature-map
    routes for the small input, kernel space for the larger one), a depthwise block's too."""
    torch.manual_seed(0)

    def net(mode):
        return nn.Sequential(*(orepa.OREPAConv2d(8, 8, 3, groups=g, scaling="scalar", mode=mode, recompute=recompute)
                               for g in (1, 8, 1))).double()

    on = _randomized(net("online"))
    off = net("offline")
    off.load_state_dict(on.state_dict())
    engine.group_kernels(on, policy)
    for n, h in [(1, 3), (4, 9)]:
        x = torch.randn(n, 8, h, h, dtype=torch.double, requires_grad=True)
        y_on, g_on = _grads(on, x, gy := torch.randn_like(off(x)))
        y_off, g_off = _grads(off, x, gy)
        tol_close(y_on, y_off, rel=1e-12)
        names = ["input", *(name for name, _ in on.named_parameters())]
        for name, a, b in zip(names, g_on, g_off, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11, msg=name)


@pytest.mark.parametrize("k", [3, (1, 7)])
def test_chain_order_choice_depends_on_input_size(k):
    block = orepa.OREPAConv2d(64, 64, k)
    small = torch.randn(1, 64, 4, 4)
    large = torch.randn(16, 64, 56, 56)
    assert "1x1_kxk" in engine.route(block, small, engine.needs_recompute(block, small))[1]
    squeezed, on_features = engine.route(block, large, engine.needs_recompute(block, large))
    assert on_features == [] and set(squeezed) == set(block.branches)
    assert engine.needs_recompute(block, small) and not engine.needs_recompute(block, large)


def test_chain_order_is_chosen_once_per_input_shape(monkeypatch):
    """The choice depends on shapes only: cached per shape (host time per step), bounded."""
    block = orepa.OREPAConv2d(64, 64, 3)
    calls = []
    choose = engine.choose_route
    monkeypatch.setattr(engine, "choose_route",
                        lambda b, shape, r, lb=False: calls.append(tuple(shape)) or choose(b, shape, r, lb))
    small, large = torch.randn(1, 64, 4, 4), torch.randn(16, 64, 56, 56)
    first = engine.route(block, small, True)
    first[0].append("mutated by a caller")  # callers get copies
    assert engine.route(block, small, True) == choose(block, small.shape, True)
    engine.route(block, large, False)
    assert calls == [tuple(small.shape), tuple(large.shape)]
    for n in range(70):
        engine.route(block, torch.empty(n + 2, 64, 4, 4), True)
    assert len(block._routes) <= 64


def test_closed_form_squeeze_passes_gradcheck():
    block = orepa.OREPAConv2d(4, 6, 3, groups=2).double()
    _randomized(block)
    names = tuple(block.branches)
    params = list(block.parameters())
    assert torch.autograd.gradcheck(lambda *ps: squeeze_kernels(plan_of(block, names), None, *ps)[0], params)


@pytest.mark.parametrize(
    "shapes",
    [((8, 4, 1, 1), 1, (6, 8, 3, 3), 1), ((8, 2, 1, 1), 2, (6, 4, 5, 5), 2), ((32, 1, 3, 3), 4, (6, 16, 1, 1), 2),
     ((6, 4, 1, 1), 2, (6, 1, 3, 3), 6), ((4, 4, 1, 1), 1, (8, 4, 1, 1), 1),
     ((8, 2, 3, 3), 4, (6, 4, 1, 1), 2), ((12, 3, 1, 1), 2, (8, 6, 3, 3), 2),
     # dw x8 -> pw as in OREPA: an even and an odd number of fine groups (paired / unpaired products)
     ((48, 1, 3, 3), 6, (5, 48, 1, 1), 1), ((40, 1, 3, 3), 5, (6, 40, 1, 1), 1), ((36, 2, 3, 3), 6, (6, 12, 1, 1), 3),
     # a pointwise W2 after W1 of the same groups (Rep-1x1's 1x1 -> 1x1, grouped; a 3x3 first)
     ((8, 2, 1, 1), 2, (6, 4, 1, 1), 2), ((8, 2, 3, 3), 2, (6, 4, 1, 1), 2)],
)
def test_compose_vjp_matches_autograd(shapes):
    s1, g1, s2, g2 = shapes
    w1 = torch.randn(s1, dtype=torch.double, requires_grad=True)
    w2 = torch.randn(s2, dtype=torch.double, requires_grad=True)
    out, _ = K.compose(w1, g1, w2, g2)
    grad = torch.randn_like(out)
    ref = torch.autograd.grad(out, (w1, w2), grad)
    for launch_bound, traced in ((False, False), (True, False), (True, True)):
        got = K.compose_vjp(w1, g1, w2, g2, grad, launch_bound=launch_bound, traced=traced)
        for a, b in zip(got, ref):
            tol_close(a, b, rel=1e-12)
            assert a.is_contiguous()  # (accumulated into the parameters' gradients as they are)
    # with a per-output-channel (and a scalar) scale on W2: the gradients of W1 and of the scaled W2
    for scale in (torch.rand(s2[0], dtype=torch.double) + 0.5, torch.tensor([0.7], dtype=torch.double)):
        w2s = K.scale_channels(w2.detach(), scale).requires_grad_()
        out, _ = K.compose(w1, g1, w2s, g2)
        ref = torch.autograd.grad(out, (w1, w2s), grad)
        for launch_bound, traced in ((False, False), (True, False), (True, True)):
            got = K.compose_vjp(w1, g1, w2.detach(), g2, grad, launch_bound=launch_bound, scale=scale,
                                traced=traced)
            for a, b in zip(got, ref):
                tol_close(a, b, rel=1e-12)


def test_squeeze_keeps_no_intermediate_kernels():
    """With recomputation the block keeps for backward only its input, like a plain conv."""
    block = orepa.OREPAConv2d(32, 32, 3, recompute=True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept.append(t.shape)
        return t

    x = torch.randn(16, 32, 16, 16, requires_grad=True)
    assert engine.route(block, x, True)[1] == []  # every branch squeezed for this input
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    assert kept == [x.shape]


def test_autocast_bfloat16_on_cpu():
    block = orepa.OREPAConv2d(16, 16, 3, recompute=True)
    ref = orepa.OREPAConv2d(16, 16, 3, recompute=False)
    ref.load_state_dict(block.state_dict())
    x = torch.randn(2, 16, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = block(x), ref(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    tol_close(y.float(), y_ref.float(), rel=2e-2)
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in block.parameters())


_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
             torch.ops.aten.addmm.default, torch.ops.aten.mm.out, torch.ops.aten.bmm.out}


@pytest.mark.parametrize("route", ["per-block", "grouped", "compiled", "eval"])
def test_under_autocast_the_kernels_are_built_in_the_parameters_dtype(route):
    """Under bfloat16 autocast every route composes the branches' kernels in float32, as the eager
    groups did (their products write through ``out=``, which autocast leaves alone) and the deployed
    conv's float32 weight is: only the convolution runs in bfloat16. The per-block route, a compiled
    model's traced construction and an eval forward composed in bfloat16 (1.5x the groups' error)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in _PRODUCTS:
                self.dtypes.append(out.dtype)
            return out

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(orepa.OREPAConv2d(8, 8, 3, padding=1), nn.ReLU(), orepa.OREPAConv2d(8, 16, 3, padding=1))
    engine.group_kernels(net, "per-block" if route in ("per-block", "eval") else "grouped", traced=route == "compiled")
    x = torch.randn(4, 8, 10, 10)  # (every branch squeezed on the per-block route: 4 x 10 x 10 pixels)
    if route == "eval":
        net.eval()
    graphs = []
    model = torch.compile(net, backend=aot_graph_backend(graphs)) if route == "compiled" else net
    seen = Products() if route != "compiled" else contextlib.nullcontext()  # (dynamo skips frames under a mode)
    with torch.autocast("cpu", dtype=torch.bfloat16), seen, torch.set_grad_enabled(route != "eval"):
        y = model(x)
    assert y.dtype == torch.bfloat16
    dtypes = seen.dtypes if route != "compiled" else [
        n.meta["val"].dtype for gm in graphs for n in gm.graph.nodes if n.target in _PRODUCTS]
    assert dtypes and set(dtypes) == {torch.float32}, dtypes


@pytest.mark.parametrize("method", ["orepa", "dbb"])
def test_deployment_and_the_reference_path_under_autocast_compose_in_the_parameters_dtype(method):
    """The reference path (every block's deployment, ``equivalent()``; the linear deep stem's kernel in
    training and eval) composed under the caller's autocast: ``reparameterize`` inside a bfloat16
    region gave a float32 model a bfloat16 stem (its next float32 forward failed) and DBB weights
    0.2% off; the deep stem's kernel had 2x the rounding of the float32 kernel cast."""
    torch.manual_seed(0)
    model = orepa.create_model("resnet18", method, num_classes=10, width_mult=0.0625)  # (the deep stem: orepa)
    x = torch.randn(2, 3, 64, 64)
    model.train()
    model(x)  # BN statistics off their start
    model.eval()
    reference = orepa.reparameterize(model, fuse_bn=True).state_dict()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        deployed = orepa.reparameterize(model, fuse_bn=True).state_dict()
    assert deployed.keys() == reference.keys()
    for k, v in deployed.items():
        assert v.dtype == reference[k].dtype and torch.equal(v, reference[k]), k
    if method == "orepa":
        stem = model.conv1
        assert isinstance(stem, orepa.OREPADeepStem)
        for training in (True, False):
            stem.train(training)
            with torch.set_grad_enabled(training):
                exact = stem._squeezed().to(torch.bfloat16)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    assert torch.equal(stem._squeezed().to(torch.bfloat16), exact), training


def test_a_float64_model_under_autocast_runs_in_float64():
    """Autocast leaves float64 alone (base, DBB, the grouped route did); the per-block route's
    recomputed convolution cast a float64 input to bfloat16 (output 48% off)."""
    torch.manual_seed(0)
    net = nn.Sequential(orepa.OREPAConv2d(8, 8, 3, padding=1, recompute=True), nn.BatchNorm2d(8)).double()
    engine.group_kernels(net, "per-block")
    x = torch.randn(2, 8, 10, 10, dtype=torch.float64, requires_grad=True)
    y = net(x)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = net(x)
        (ga,) = torch.autograd.grad(ya.square().sum(), x)
    assert ya.dtype == torch.float64
    torch.testing.assert_close(ya, y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ga, g, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("update", ["in place", ".data"])
def test_eval_forwards_follow_every_parameter_update(update):
    """An eval-mode forward sees the weights as they are now, however they were written: in place
    (an optimizer step) or through ``.data`` (an EMA idiom no version counter sees)."""
    block = orepa.OREPAConv2d(8, 8, 3).eval()
    x = torch.randn(1, 8, 6, 6)
    with torch.no_grad():
        y1 = block(x)
        for p in block.parameters():
            (p.data if update == ".data" else p).mul_(2.0)
        y2 = block(x)
    tol_close(y2, orepa.reparameterize(block)(x))
    assert (y1 - y2).abs().max() > 1e-3


def test_resnet_training_is_unchanged_by_the_fast_path():
    """One SGD step of an OREPA ResNet block stack equals the offline (no BN) reference."""
    torch.manual_seed(0)
    net = nn.Sequential(orepa.OREPAConv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
                        orepa.OREPAConv2d(16, 16, 3, 2), nn.BatchNorm2d(16), nn.ReLU(),
                        orepa.OREPAConv2d(16, 32, 1), nn.BatchNorm2d(32)).double()
    ref = nn.Sequential(orepa.OREPAConv2d(3, 16, 3, mode="offline"), nn.BatchNorm2d(16), nn.ReLU(),
                        orepa.OREPAConv2d(16, 16, 3, 2, mode="offline"), nn.BatchNorm2d(16), nn.ReLU(),
                        orepa.OREPAConv2d(16, 32, 1, mode="offline"), nn.BatchNorm2d(32)).double()
    ref.load_state_dict(net.state_dict())
    x = torch.randn(4, 3, 12, 12, dtype=torch.double)
    for model in (net, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    for (n, a), b in zip(net.state_dict().items(), ref.state_dict().values()):
        tol_close(a.double(), b.double(), rel=1e-9)


COMPOSE_CASES = [((8, 4, 1, 1), 1, (6, 8, 3, 3), 1), ((32, 1, 3, 3), 4, (6, 16, 1, 1), 2),
                 ((6, 4, 1, 1), 2, (6, 1, 3, 3), 6), ((4, 4, 1, 1), 1, (8, 4, 1, 1), 1), ((8, 2, 1, 1), 2, (6, 4, 1, 1), 2),
                 ((8, 2, 3, 3), 2, (6, 4, 1, 1), 2)]


@pytest.mark.parametrize("shapes", COMPOSE_CASES)
@pytest.mark.parametrize("scaled", [False, True])
def test_compose_into_accumulates_the_scaled_composition(shapes, scaled):
    s1, g1, s2, g2 = shapes
    w1, w2 = torch.randn(s1, dtype=torch.double), torch.randn(s2, dtype=torch.double)
    ref, _ = K.compose(w1, g1, w2, g2)
    scale = torch.randn(ref.shape[0], dtype=torch.double) if scaled else None
    out = torch.randn_like(ref)
    expected = out + (ref if scale is None else K.scale_channels(ref, scale))
    K.compose_into(out, w1, g1, w2, g2, scale)
    tol_close(out, expected, rel=1e-12)


def test_compose_vjp_skips_unneeded_and_shares_a_common_filter():
    w1 = torch.randn(6, 4, 1, 1, dtype=torch.double, requires_grad=True)
    avg = K.avg_pool_kernel(6, 3, dtype=torch.double)
    out, _ = K.compose(w1, 1, avg, 6)
    grad = torch.randn_like(out)
    (ref,) = torch.autograd.grad(out, (w1,), grad)
    for shared in (False, True):
        d1, d2 = K.compose_vjp(w1, 1, avg, 6, grad, need_w2=False, shared_filter=shared)
        assert d2 is None
        tol_close(d1, ref, rel=1e-12)
    assert K.compose_vjp(w1, 1, avg, 6, grad, need_w1=False)[0] is None
    a, b = torch.randn(5, 7, dtype=torch.double), torch.randn(5, 7, dtype=torch.double)
    out = torch.empty(5, dtype=torch.double)
    for launch_bound in (True, False):  # one batched product, or a product and a sum (CPU per-block route)
        tol_close(K.rowdot(a, b, launch_bound=launch_bound), (a * b).sum(1), rel=1e-12)
        assert K.rowdot(a, b, out=out, launch_bound=launch_bound) is out
        tol_close(out, (a * b).sum(1), rel=1e-12)


@pytest.mark.parametrize("n,h,stride", [(2, 7, 1), (2, 8, 2), (1, 45, 1), (64, 56, 1)])
def test_pointwise_step_on_small_maps_is_the_conv(n, h, stride):
    """1x1 steps on few pixels run as one matrix product: same values and gradients."""
    step = orepa.blocks.ConvStep(12, 10, 1).double()
    x = torch.randn(n, 12, h, h, dtype=torch.double, requires_grad=True)
    y = step.run(x, stride, 1)
    ref = nn.functional.conv2d(x, step.weight, None, stride)
    assert y.shape == ref.shape and y.is_contiguous()
    tol_close(y, ref, rel=1e-12)
    gy = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(y, (x, step.weight), gy), torch.autograd.grad(ref, (x, step.weight), gy)):
        tol_close(a, b, rel=1e-12)


def test_block_step_dispatches_few_ops():
    """Host cost guard: on a fast GPU an online block's eager step is bound by the host issuing
    its small ops (docs/benchmarks.md, "GPU"), so their number is a measured property. One
    64->64 3x3 OREPA block, every branch squeezed, forward + backward: 150 aten ops at the time
    of writing (203 before the einsum-free compositions and the cached chain order)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    block = orepa.OREPAConv2d(64, 64, 3, padding=1, recompute=False)
    x, gy = torch.randn(16, 64, 14, 14), torch.randn(16, 64, 14, 14)
    assert engine.route(block, x, False) == (list(block.branches), [])
    block(x).backward(gy)
    block.zero_grad(set_to_none=True)
    with CountOps() as ops:
        block(x).backward(gy)
    assert ops.n <= 165


def test_a_launch_bound_device_squeezes_every_branch_and_keeps_the_kernel(monkeypatch):
    """On a GPU a block's own route (per-block policy, a checkpointed region, a compiled model) is
    the group's, block by block: every branch in kernel space, the kernel kept, the plan with the
    fewest operators. Here on a CPU standing in for one; it computes what the CPU's route does."""
    block = _randomized(orepa.OREPAConv2d(8, 8, 3, padding=1, dw_expand=2)).double()
    x = torch.randn(1, 8, 3, 3, dtype=torch.double, requires_grad=True)  # small: on the map, rebuilt
    gy = torch.randn(1, 8, 3, 3, dtype=torch.double)
    assert engine.needs_recompute(block, x) and engine.route(block, x, True)[1]
    y_cpu, ref = _grads(block, x, gy)
    monkeypatch.setattr(engine, "_launch_bound", lambda t: True)
    assert not engine.needs_recompute(block, x)
    assert engine.route(block, x, False) == (list(block.branches), [])
    assert engine.choose_route(block, x.shape, False, launch_bound=True) == (list(block.branches), [])
    built = []
    plan_of = engine.plan_of
    monkeypatch.setattr(engine, "plan_of", lambda b, names, lb=False: built.append(lb) or plan_of(b, names, lb))
    y, grads = _grads(block, x, gy)
    assert built and all(built)
    tol_close(y, y_cpu, rel=1e-12)
    for a, b in zip(grads, ref):
        tol_close(a, b, rel=1e-12)
    block.recompute = True  # asked for explicitly: still rebuilt in backward
    assert engine.needs_recompute(block, x)


@pytest.mark.slow
@pytest.mark.parametrize("recompute,n,hw", [(True, 16, 8), (False, 16, 8), ("auto", 1, 3)])
def test_torch_compile_traces_the_online_path(recompute, n, hw):
    """``torch.compile(model)`` must work on online blocks (it crashed on the recomputing
    path, which saved an alias of its input) and must not recompile on the second call (the
    chain-order caches filled by a traced call were guarded on). ``aot_eager`` traces and
    partitions forward/backward as inductor would, without generating code."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    # two branches, one a two-layer chain (its order cached per shape): dynamo's trace grows with the branches
    block = _randomized(orepa.OREPAConv2d(8, 8, 3, recompute=recompute, branches=("kxk", "1x1_kxk")))
    x = torch.randn(n, 8, hw, hw, requires_grad=True)
    gy = torch.randn(n, 8, hw, hw)
    on_features = engine.route(block, x, engine.needs_recompute(block, x))[1]
    assert (on_features == []) if n > 1 else ("1x1_kxk" in on_features)  # all squeezed / some on the map
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter)
    for _ in range(2):
        y, grads = _grads(compiled, x, gy)
    y_ref, ref = _grads(block, x, gy)
    tol_close(y, y_ref, rel=1e-5)
    for a, b in zip(grads, ref):
        tol_close(a, b, rel=1e-4)
    assert counter.frame_count == 1


@pytest.mark.parametrize("launch_bound", [True, False])
def test_torch_compile_traces_the_form_written_for_a_compiler(monkeypatch, launch_bound):
    """Traced by dynamo, a block squeezes in the form written for a compiler (as a compiled group
    does): its short contractions and the scales' gradients as element-wise products and sums,
    which inductor fuses, so only the long contractions stay matrix products (1x1 -> kxk's
    composition forward and its two gradients, dw -> pw's depthwise gradient: 4 per block, where
    the launch-bound eager form issues 11). The same values and gradients as eager, GPU route
    (every branch in kernel space) and CPU route alike."""
    torch._dynamo.reset()
    monkeypatch.setattr(engine, "_launch_bound", lambda t: launch_bound)
    graphs = []
    backend = aot_graph_backend(graphs)
    torch.manual_seed(0)
    block = _randomized(orepa.OREPAConv2d(32, 32, 3, recompute=False)).double()
    x = torch.randn(16, 32, 8, 8, dtype=torch.double, requires_grad=True)
    gy = torch.randn(16, 32, 8, 8, dtype=torch.double)
    assert engine.route(block, x, False)[1] == []  # every branch in kernel space, CPU route too
    y, grads = _grads(torch.compile(block, backend=backend), x, gy)
    y_ref, ref = _grads(block, x, gy)
    tol_close(y, y_ref, rel=1e-12)
    for a, b in zip(grads, ref):
        tol_close(a, b, rel=1e-10)
    products = matrix_products(graphs)
    assert len(graphs) == 2 and products <= 4, products


def test_a_functional_call_first_leaves_every_weight_learnable():
    """``torch.func.functional_call`` swaps plain tensors into the parameter slots; a plan made under
    it must still treat the convs as learnable (it is kept for the block's life): the functional
    call's gradients and the block's own afterwards equal a fresh twin's."""
    torch.manual_seed(0)
    block = orepa.OREPAConv2d(8, 8, 3).double()
    twin = copy.deepcopy(block)
    x = torch.randn(2, 8, 8, 8, dtype=torch.float64)
    swapped = {k: v.detach().clone().requires_grad_() for k, v in block.named_parameters()}
    torch.func.functional_call(block, swapped, (x,)).square().sum().backward()
    block(x).square().sum().backward()
    twin(x).square().sum().backward()
    for (name, p), q in zip(block.named_parameters(), twin.parameters()):
        assert p.grad is not None and swapped[name].grad is not None, name
        tol_close(p.grad, q.grad, rel=1e-10)
        tol_close(swapped[name].grad, q.grad, rel=1e-10)


@pytest.mark.parametrize("policy,pack", [("per-block", False), ("grouped", False), ("grouped", True)])
def test_forward_mode_ad_through_online_blocks_matches_their_backward(policy, pack):
    """Forward-mode AD (``torch.autograd.forward_ad``) with tangents on the input and on the
    parameters (dual tensors through ``functional_call``, as forward gradients take them; packed:
    the packed parameters'): the engine's autograd Functions define no jvp, so under a dual level
    blocks squeeze by plain autograd (it failed with "You must implement the jvp function"). The
    tangent agrees with the engine's backward: <J t, v> = <t, J^T v>."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    net = nn.Sequential(orepa.OREPAConv2d(4, 8, 3, padding=1), nn.ReLU(), orepa.OREPAConv2d(8, 8, 3, padding=1),
                        nn.ReLU(), orepa.OREPAConv2d(8, 8, 3, padding=1)).double()
    engine.group_kernels(net, policy, pack=pack)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 8, 6, 6, dtype=torch.float64)
    (net(x) * v).sum().backward()
    params = dict(net.named_parameters())
    assert any(".packed_parameters." in k for k in params) == pack
    tx, tp = torch.randn_like(x), {k: torch.randn_like(p) for k, p in params.items()}
    want = (tx * x.grad).sum() + sum((tp[k] * p.grad).sum() for k, p in params.items())
    with fwAD.dual_level():
        duals = {k: fwAD.make_dual(p.detach(), tp[k]) for k, p in params.items()}
        y = torch.func.functional_call(net, duals, (fwAD.make_dual(x.detach(), tx),))
        got = (fwAD.unpack_dual(y).tangent * v).sum()
    tol_close(got, want, rel=1e-10)
    tol_close(fwAD.unpack_dual(y).primal, net(x), rel=1e-12)


def test_torch_func_transforms_take_the_reference_path():
    """``torch.func.grad`` and ``vmap`` (per-sample gradients) through online blocks: the engine's
    autograd Functions define no vmap rule, so blocks squeeze by plain autograd there, with the
    gradients of the engine's path."""
    torch.manual_seed(0)
    net = nn.Sequential(orepa.OREPAConv2d(4, 8, 3), nn.ReLU(), orepa.OREPAConv2d(8, 4, 3, stride=2)).double()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(3, 4, 6, 6, dtype=torch.float64)

    def loss(p, xb):
        return torch.func.functional_call(net, p, (xb,)).square().sum()

    grads = torch.func.grad(loss)(params, x)
    net(x).square().sum().backward()
    for name, p in net.named_parameters():
        tol_close(grads[name], p.grad, rel=1e-10)
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x.unsqueeze(1))
    for name, p in net.named_parameters():
        tol_close(per_sample[name].sum(0), p.grad, rel=1e-10)
