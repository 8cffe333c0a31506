"""The network-level kernel builder (orepa.engine.group_kernels): blocks of one signature build
their kernels together and give the per-block route's numbers, state and behaviour."""
import copy
import gc
import json
import operator
import pickle
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import ZOO_ARCHETYPES, Checkpointed, aot_graph_backend, matrix_products, tol_close
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import orepa
from orepa import engine
from orepa.apps.bench.measure import PoolEstimator, UnreplayedRecorder, record_builds
from orepa.blocks import OREPAConv2d


def _pair(name="resnet18", policy="grouped", pack=False, **opts):
    torch.manual_seed(0)
    ref = orepa.create_model(name, "orepa", num_classes=10, width_mult=0.125, **opts).double()
    grouped = copy.deepcopy(ref)
    engine.group_kernels(ref, "per-block")
    engine.group_kernels(grouped, policy, pack=pack)
    return ref, grouped


def _grads(model, *xs):
    """Output and gradients by state_dict key (a packed step's: its rows of its packed parameter's);
    several inputs: their gradients accumulated, one backward each, and the last output."""
    model.zero_grad(set_to_none=True)
    for x in xs:
        y = model(x)
        (y * torch.linspace(-1, 1, y.shape[1], dtype=y.dtype)).square().sum().backward()
    return y, _named_grads(model)


def _named_grads(model) -> dict:
    """``model``'s gradients by state_dict key (a packed step's: its rows of its packed parameter's)."""
    grads = {n: p.grad for n, p in model.named_parameters() if ".packed_parameters." not in n}
    for name, m in model.named_modules():
        slot = m.__dict__.get("_packed")
        if slot is not None:
            grad = slot.holder._parameters[slot.name].grad
            grads[f"{name}.weight"] = None if grad is None else grad.narrow(0, slot.lo, slot.size)
    return grads


def _sgd_steps(model, x, steps=2):
    """``steps`` SGD steps (momentum) on the mean square of ``model(x)``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()


def _assert_same_grads(ref, grouped, x=None, rtol=1e-7, atol=1e-10):
    # train-mode BNs over few values amplify rounding: 4 images of 64x64 leave 16 values at the last stage
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64) if x is None else x
    y0, g0 = _grads(ref, x)
    y1, g1 = _grads(grouped, x)
    torch.testing.assert_close(y1, y0, rtol=1e-9, atol=1e-9)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_grouped_forward_and_gradients_equal_per_block(name):
    ref, grouped = _pair(name, "grouped")
    assert max(len(g) for g in engine.kernel_groups(grouped)) >= 2
    _assert_same_grads(ref, grouped)


@pytest.mark.slow
def test_a_compiled_resnet18_gives_the_per_block_numbers_with_few_operators():
    """The compiled, packed groups of ResNet-18 (deep stem and all, as ``orepa train`` runs them on a
    GPU): the per-block numbers, and a train step (cross-entropy, fused SGD as ``orepa bench``)
    dispatching <= 1.5x base's aten operators (measured 1.2x; unpacked 1.97x), inductor's fused
    kernels not being aten operators. One test for both: compiling ResNet-18 is most of its time."""
    from orepa.apps.bench.measure import count_ops
    from orepa.apps.common import make_sgd

    ref, compiled = _pair("resnet18", "compiled", pack=True)
    assert all(g.packed is not None for g in engine.kernel_groups(compiled))
    _assert_same_grads(ref, compiled)
    base = orepa.create_model("resnet18", "base", num_classes=10, width_mult=0.125).double()
    x, y = torch.randn(2, 3, 64, 64, dtype=torch.float64), torch.randint(0, 10, (2,))
    ops = {}
    for name, model in (("base", base), ("compiled", compiled)):
        opt = make_sgd(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4)

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        step()
        ops[name] = count_ops(step)[0]
    assert ops["compiled"] <= 1.5 * ops["base"], ops


# the zoo's archetypes only: its depth and width variants (resnet34, wide_resnet18_2, repvgg_a1..b1)
# group the same kinds of block in more or wider groups, and reach no line or branch of the
# engine, blocks or kernels that the archetypes do not (checked with coverage)
_ZOO_ONLINE = [(n, m) for n in ZOO_ARCHETYPES for m in orepa.list_methods(n) if m in ("orepa", "orepa-vgg")]


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("name,method", _ZOO_ONLINE)
def test_the_grouped_route_gives_the_per_block_numbers_across_the_zoo(name, method, pack):
    """Every zoo model with online blocks (nested ones too: deep stems, OREPA-VGG), twice: the
    first step makes the groups' storage, the second reads it. Eval-mode BNs keep float64 exact.
    Packed: every step's gradient is its rows of its packed parameter's."""
    torch.manual_seed(0)
    width = 0.25 if name.startswith("resnext") else 0.125  # a ResNeXt group keeps >= 1 channel
    ref = orepa.create_model(name, method, num_classes=10, width_mult=width).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # off the identity/constant initialisation
    grouped = copy.deepcopy(ref)
    engine.group_kernels(ref, "per-block")
    engine.group_kernels(grouped, "grouped", pack=pack)
    ref.eval(), grouped.eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    for _ in range(2):
        y0, g0 = _grads(ref, x)
        y1, g1 = _grads(grouped, x)
        # float64 rounding, relative to each tensor's scale (these untrained nets reach 1e4-1e6)
        torch.testing.assert_close(y1, y0, rtol=1e-9, atol=1e-12 * y0.abs().max().item())
        assert g1.keys() == g0.keys()
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-7, atol=1e-12 * g0[k].abs().max().item(), msg=k)
    assert any(g.plan.family for g in engine.kernel_groups(grouped))
    assert pack == any(g.packed is not None for g in engine.kernel_groups(grouped))


def test_squeeze_function_of_a_group_passes_gradcheck():
    torch.manual_seed(0)
    blocks = [OREPAConv2d(3, 4, 3).double() for _ in range(3)]
    plan = engine.Plan(blocks, tuple(blocks[0].branches))
    params = plan.params()
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.1)  # off the identity/constant initialisation
    fn = lambda *ps: engine.squeeze_kernels(plan, None, *ps)  # noqa: E731
    assert torch.autograd.gradcheck(fn, params)
    # each output is that block's own kernel
    for blk, w in zip(blocks, fn(*params)):
        torch.testing.assert_close(w, blk.equivalent()[0])


def test_grouping_keeps_state_dict_conversion_and_deployment():
    torch.manual_seed(0)
    plain = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125)
    keys = list(plain.state_dict())
    engine.group_kernels(plain, "grouped")
    assert list(plain.state_dict()) == keys  # the groups are plain attributes: no key, no submodule
    assert not any(isinstance(m, engine.KernelGroup) for m in plain.modules())
    deployed = orepa.reparameterize(plain.eval())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(deployed(x), plain(x), rtol=1e-4, atol=1e-4)
    assert not any(isinstance(m, orepa.ReparamConv2d) for m in deployed.modules())


def test_convert_and_the_zoo_group_their_blocks():
    torchvision = pytest.importorskip("torchvision")
    net = orepa.convert(torchvision.models.resnet18(num_classes=10))
    sizes = sorted(len(g) for g in engine.kernel_groups(net))
    assert sum(sizes) == sum(isinstance(m, orepa.ReparamConv2d) and m._closed_form for m in net.modules())
    assert max(sizes) >= 3
    zoo = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125)
    assert engine.kernel_groups(zoo) and all(g.policy == "auto" for g in engine.kernel_groups(zoo))
    # "auto" groups on CUDA only: a CPU tensor keeps each block's own (FLOP-chosen) route
    assert not engine.kernel_groups(zoo)[0].active(torch.zeros(1))


@pytest.mark.parametrize("branches,groups", [(None, 1), (None, 2), (("1x1", "1x1_avg"), 4)])
def test_a_groups_storage_and_filter_family_pass_gradcheck(branches, groups):
    """Through a group's storage (the parameters are views of it) and its filter family (1x1,
    1x1-avg, 1x1-prior as one product): numerical gradients equal the closed-form vjp."""
    torch.manual_seed(0)
    # two channels per conv group at least: gradcheck's numerical Jacobian costs two builds per parameter element
    width = max(4, 2 * groups)
    net = nn.Sequential(*[OREPAConv2d(width, width, 3, groups=groups, branches=branches) for _ in range(2)]).double()
    (group,) = engine.group_kernels(net, "grouped")
    plan = group.plan
    assert len(plan.family) >= 2
    params = plan.params()
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.1)
    storage = group._stacked([t for b in range(plan.n) for t in plan.tensors_of(b)])
    assert storage.family is not None
    # gradcheck perturbs the parameters in place: the storage sees it (they are its views)
    fn = lambda *ps: engine.squeeze_kernels(plan, storage, *ps)  # noqa: E731
    assert torch.autograd.gradcheck(fn, params)
    for blk, w in zip(net, fn(*params)):
        torch.testing.assert_close(w, blk.equivalent()[0])


def test_a_kernel_is_handed_out_once_and_only_while_its_parameters_are_unchanged():
    torch.manual_seed(0)
    a, b = OREPAConv2d(4, 4, 3).double(), OREPAConv2d(4, 4, 3).double()
    net = nn.Sequential(a, nn.BatchNorm2d(4), b).double()
    (group,) = engine.group_kernels(net, "grouped")
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    net(x)  # a built both kernels and took its own, b took the other
    assert not group._pending
    a(x)  # a alone: builds again, b's fresh kernel waits
    assert list(group._pending) == [1]  # b's index
    with torch.no_grad():
        b.branches["kxk"].conv.weight.add_(1.0)  # changed after its kernel was built
    w = group.kernel_of(b)
    torch.testing.assert_close(w, b.equivalent()[0])  # rebuilt, not the stale pending one
    # copies drop pending kernels (they hold an autograd graph) and keep their own groups
    a(x)
    twin = copy.deepcopy(net)
    assert not twin[0]._kernel_group._pending and twin[0]._kernel_group.blocks == (twin[0], twin[2])


@pytest.mark.parametrize("policy", ["grouped", "compiled"])
def test_a_block_skipped_then_run_after_a_backward_gets_a_fresh_kernel(policy, monkeypatch):
    """Gradient accumulation with blocks skipped in one step (stochastic depth, conditional paths):
    the first block's miss builds the group's kernels, its backward spends their graph, and the other
    block, run in the next step with unchanged parameters, must not take its kernel from that build;
    its gradients then equal the per-block route's."""
    if policy == "compiled":
        monkeypatch.setattr(engine, "compile_graph", _run_traced)  # the traced graphs, run as they are
    torch.manual_seed(0)
    a, b = OREPAConv2d(4, 4, 3).double(), OREPAConv2d(4, 4, 3).double()
    net = nn.Sequential(a, b)
    ref = copy.deepcopy(net)
    engine.group_kernels(net, policy)
    engine.group_kernels(ref, "per-block")
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    for model in (net, ref):
        model[0](x).square().sum().backward()  # step 1: block b skipped
        model[1](x).square().sum().backward()  # step 2: block a skipped, nothing updated in between
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


def _reference_autograd(model):
    """``model`` with every online block squeezed by plain autograd through orepa.kernels (the
    reference path deployment uses), not by the engine."""
    for m in model.modules():
        if isinstance(m, OREPAConv2d):
            m._closed_form = False
    return model


def _penalised_grads(model, x, wrt):
    """Gradients by state_dict key of ``loss + |d loss / d wrt|^2`` (``wrt``: "params", a
    penalty on the parameters' gradients, as in Hessian-vector products and meta-learning;
    "input": on the input's, as in WGAN-GP and R1), and the first-order gradients as made
    under ``create_graph=True``."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(wrt == "input")
    y = model(x)
    loss = (y * torch.linspace(-1, 1, y.shape[1], dtype=y.dtype)).square().mean()
    inputs = [x] if wrt == "input" else list(model.parameters())
    first = torch.autograd.grad(loss, inputs, create_graph=True)
    (loss + sum(g.square().sum() for g in first)).backward()
    return [g.detach() for g in first], _named_grads(model)


@pytest.mark.parametrize("wrt", ["params", "input"])
@pytest.mark.parametrize("route", ["per-block", "per-block on a GPU", "grouped", "grouped packed",
                                   "packed, a node per group", "recorded"])
def test_gradients_made_with_create_graph_differentiate_as_plain_autograd(route, wrt, monkeypatch):
    """Double backward (create_graph=True) through every route: the closed-form vjps write through
    out= and the groups' intermediates live in a workspace, which autograd cannot follow, so such a
    backward builds the kernels again in differentiable operators. The first-order gradients and
    the penalty's match the reference path's (a backward whose gradients were cut from the graph
    fails every "params" case; the unfixed engine raised an out= error there)."""
    torch.manual_seed(0)
    ref = _reference_autograd(orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125).double())
    net = copy.deepcopy(ref)
    for m in net.modules():
        if isinstance(m, OREPAConv2d):
            m._closed_form = True
    if route == "per-block on a GPU":  # each block's GPU route: kernel space, kept, launch-bound plans
        monkeypatch.setattr(engine, "_launch_bound", lambda t: True)
        engine.group_kernels(net, "per-block")
    elif route == "recorded":
        _recorded(net)
    else:
        engine.group_kernels(net, "per-block" if route == "per-block" else "grouped", pack="packed" in route,
                             joint=route != "packed, a node per group")
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    first0, g0 = _penalised_grads(ref, x, wrt)
    first1, g1 = _penalised_grads(net, x, wrt)
    assert g0.keys() == g1.keys()
    # relative to the largest gradient: train-mode BNs over 2 images amplify rounding (~1e-11 seen)
    scale = max(g.abs().max() for g in g0.values())
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=1e-9 * scale, msg=k)
    if wrt == "input":
        torch.testing.assert_close(first1[0], first0[0], rtol=0, atol=1e-9 * first0[0].abs().max())


def _data_parallel_replica(model, scale=2.0):
    """What ``torch.nn.parallel.replicate`` makes of ``model`` for one device, on any device: each
    module's ``_replicate_for_data_parallel()`` (its dicts shared with the original's), its
    parameters differentiable functions of the original's (``scale * p`` in place of Broadcast's
    copy, so that reading the original's tensors instead shows)."""
    modules = list(model.modules())
    replicas = {id(m): m._replicate_for_data_parallel() for m in modules}
    for m in modules:
        r = replicas[id(m)]
        r._former_parameters = {}
        for name, child in m._modules.items():
            r._modules[name] = None if child is None else replicas[id(child)]
        for name, p in m._parameters.items():
            if p is None:
                r._parameters[name] = None
            else:  # as replicate does: no longer leaves, so plain attributes, not parameters
                setattr(r, name, p * scale)
                r._former_parameters[name] = r.__dict__[name]
    return replicas[id(model)]


@pytest.mark.parametrize("policy", ["per-block", "grouped"])
def test_a_data_parallel_replica_builds_from_its_own_tensors(policy):
    """DataParallel's replicas share their original's dicts (its group, its plans) but hold the
    tensors broadcast to their device: their kernels are built from those (per block), and the
    gradients reach the original through them. Before, a grouped replica failed (its blocks are
    not the group's) and a per-block one read the original's tensors (on another device: an error)."""
    torch.manual_seed(0)
    net = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125).double()
    twice = copy.deepcopy(net)
    with torch.no_grad():
        for p in twice.parameters():
            p.mul_(2)
    engine.group_kernels(net, policy)
    engine.group_kernels(twice, "per-block")
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    net(x)  # the original's own forward first: its plans and its group's storage are made
    net.zero_grad(set_to_none=True)
    y = _data_parallel_replica(net)(x)
    twice.zero_grad(set_to_none=True)
    y0 = twice(x)
    torch.testing.assert_close(y, y0, rtol=1e-10, atol=1e-12)
    y.square().mean().backward()
    y0.square().mean().backward()
    g, g0 = _named_grads(net), _named_grads(twice)
    for k in g0:  # d/dp of f(2p) = 2 f'(2p)
        torch.testing.assert_close(g[k], 2 * g0[k], rtol=1e-9, atol=1e-12, msg=k)


def test_a_data_parallel_replica_of_packed_groups_is_refused_with_the_way_out():
    torch.manual_seed(0)
    net = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125)
    engine.group_kernels(net, "grouped", pack=True)
    with pytest.raises(RuntimeError, match="DataParallel cannot replicate packed.*pack=False"):
        _data_parallel_replica(net)(torch.randn(2, 3, 32, 32))


def test_a_block_used_twice_in_one_forward_gets_both_gradients():
    torch.manual_seed(0)
    shared, other = OREPAConv2d(4, 4, 3).double(), OREPAConv2d(4, 4, 3).double()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    grads = []
    for policy in ("per-block", "grouped"):
        net = nn.Sequential(shared, other)
        engine.group_kernels(net, policy)
        shared.zero_grad(set_to_none=True)
        other.zero_grad(set_to_none=True)
        shared(other(shared(x))).sum().backward()
        grads.append([p.grad.clone() for p in (*shared.parameters(), *other.parameters())])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g1, g0)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy must be one of"):
        engine.group_kernels(nn.Sequential(OREPAConv2d(4, 4, 3)), "fast")


def test_grouping_cuts_the_dispatched_operators_of_a_train_step():
    from orepa.apps.bench.measure import count_ops, make_runner

    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    counts = {}
    for policy in ("per-block", "grouped"):
        # (at a quarter width: the counts are full width's, 2867 and 531, in a ninth of the time)
        r = make_runner("resnet18", "orepa", device=torch.device("cpu"), num_classes=10, kernel_builder=policy,
                        model_options={"width_mult": 0.25})
        r.step(x, y)
        counts[policy] = count_ops(lambda r=r: r.step(x, y))[0]
    assert counts["grouped"] < 0.65 * counts["per-block"], counts


def test_train_takes_the_kernel_builder_and_both_routes_train_alike(cache, tmp_path):
    from orepa.cli import main

    tiny = ["--model", "resnet18", "--width-mult", "0.0625", "--train-subset", "64", "--val-subset", "32",
            "-b", "16", "--epochs", "1", "-j", "0", "--no-progress", "--no-tensorboard", "--no-curves", "--quiet",
            "--device", "cpu", "--cache-dir", cache]
    rows = {}
    for policy in ("grouped", "per-block"):
        out = tmp_path / policy
        assert main(["train", *tiny, "--kernel-builder", policy, "--output-dir", str(out)]) == 0
        rows[policy] = json.loads((out / "log.jsonl").read_text().splitlines()[-1])
    assert rows["grouped"]["train_loss"] == pytest.approx(rows["per-block"]["train_loss"], rel=1e-4)
    assert main(["train", *tiny, "--kernel-builder", "fastest", "--output-dir", str(tmp_path / "bad")]) == 2


def test_the_first_block_of_a_forward_builds_every_group_and_checkpointed_blocks_their_own():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    # widths 4 and 6: blocks of one input width share a group only where one width is a multiple of the other
    a, b = OREPAConv2d(4, 4, 3).double(), OREPAConv2d(4, 6, 3).double()
    c = OREPAConv2d(6, 6, 3).double()
    net = nn.Sequential(a, b, c)
    groups = engine.group_kernels(net, "grouped")
    assert len(groups) == 3 and all(g.peers == groups for g in groups)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    a(x)  # a's miss builds b's and c's kernels too
    assert [sorted(g._pending) for g in groups] == [[], [0], [0]]
    net(x)  # b and c take theirs; a, whose kernel was taken, builds its group only
    assert not any(g._pending for g in groups)
    # in a checkpointed region each block builds its own kernel (the region's recomputation must
    # save what its first pass saved); its group stops building ahead and drops what it held
    y = checkpoint(lambda t: c(b(t)), a(x), use_reentrant=False)
    y.sum().backward()
    assert not any(g._pending for g in groups) and [g.prebuild for g in groups] == [True, False, False]
    a(x)
    assert [sorted(g._pending) for g in groups] == [[], [], []]
    ref = copy.deepcopy(net)
    engine.group_kernels(ref, "per-block")
    x2 = x.detach().requires_grad_()
    ref[2](ref[1](ref[0](x2))).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("pack", [False, True])
def test_a_networks_groups_build_as_one_node_and_train_as_one_node_per_group(monkeypatch, pack):
    """joint (the default): the groups built at a forward's first block are one autograd node, so
    their constructions' backward is one call; joint=False: a node per group (DDP overlaps each
    group's gradients with the rest of the backward). Both train alike, and a group rebuilt alone
    (its block called twice) is a node of its own."""
    torch.manual_seed(0)
    net = nn.Sequential(OREPAConv2d(4, 4, 3, padding=1), nn.ReLU(), OREPAConv2d(4, 6, 3, padding=1), nn.ReLU(),
                        OREPAConv2d(6, 6, 3, padding=1), OREPAConv2d(6, 6, 3, padding=1)).double()
    apart = copy.deepcopy(net)
    assert len(engine.group_kernels(net, "grouped", pack=pack)) == 3
    engine.group_kernels(apart, "grouped", pack=pack, joint=False)
    nodes = {}
    kernel_of = engine.KernelGroup.kernel_of

    def record(group, block):
        w = kernel_of(group, block)
        nodes.setdefault(id(group.peers), set()).add(w.grad_fn)
        return w

    monkeypatch.setattr(engine.KernelGroup, "kernel_of", record)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    for m in (net, apart):
        _sgd_steps(m, x)
    assert len(nodes[id(engine.kernel_groups(net)[0].peers)]) == 2  # one node per step
    assert len(nodes[id(engine.kernel_groups(apart)[0].peers)]) == 2 * 3
    for p, q in zip(net.parameters(), apart.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-13)
    nodes.clear()
    net[4](net[4](torch.randn(1, 6, 5, 5, dtype=torch.float64))).sum().backward()  # the group of net[4] and net[5]
    assert len(nodes[id(engine.kernel_groups(net)[0].peers)]) == 2  # the joint build, then that group's own


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_regions_of_one_group_give_the_per_block_gradients(reentrant):
    """One group spanning a plain block and a checkpointed region: the region's blocks build their
    own kernels (a reentrant checkpoint's own backward must not run the group's shared node, which
    the plain block still needs)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    net = nn.Sequential(*[OREPAConv2d(4, 4, 3) for _ in range(3)]).double()
    ref = copy.deepcopy(net)
    engine.group_kernels(net, "grouped")
    engine.group_kernels(ref, "per-block")
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    for m in (net, ref):
        checkpoint(lambda t, m=m: m[2](m[1](t)), m[0](x), use_reentrant=reentrant).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _storages(group):
    """Per role, the distinct storages the group's blocks' tensors live in."""
    roles = [group.plan.tensors_of(b) for b in range(len(group))]
    return [{t.untyped_storage().data_ptr() for t in ts} for ts in zip(*roles)]


def test_a_group_keeps_its_blocks_tensors_in_one_storage_and_trains_as_the_per_block_route():
    """A group's first build stacks its blocks' operands into one tensor per role, of which the
    parameters become views: later builds concatenate nothing, the optimizer's in-place updates
    reach them, and state_dict, parameter identities and values are those of the per-block route."""
    ref, grouped = _pair()
    group = max(engine.kernel_groups(grouped), key=len)
    names_before = {n: id(p) for n, p in grouped.named_parameters()}
    # 8 images of 64x64: train-mode BNs over 2 images of 32x32 (layer4: 2 values per channel) amplified the
    # routes' float64 rounding ~1e4-fold per step, past any tolerance that still tests something
    x = torch.randn(8, 3, 64, 64, dtype=torch.float64)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (ref, grouped)]
    for _ in range(3):
        for m, opt in zip((ref, grouped), opts):
            opt.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            opt.step()
    assert all(len(s) == 1 for s in _storages(group))  # every role: one storage for all its blocks
    assert {n: id(p) for n, p in grouped.named_parameters()} == names_before
    sd0, sd1 = ref.state_dict(), grouped.state_dict()
    assert sd0.keys() == sd1.keys()
    for k in sd0:  # (measured: 4e-15)
        torch.testing.assert_close(sd1[k], sd0[k], rtol=1e-10, atol=1e-12, msg=k)
    # the views' addresses are checked each build: the storage is not made again
    kept = [s.data_ptr() for s in group._storage.roles]
    grouped(x)
    assert [s.data_ptr() for s in group._storage.roles] == kept


@pytest.mark.parametrize("change", ["to", "load_assign", "replace", "deepcopy"])
def test_a_group_remakes_its_storage_when_its_tensors_move(change):
    ref, grouped = _pair()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    grouped(x)  # the storage is made
    if change == "to":
        grouped.float().double()  # new tensors for every parameter and buffer
    elif change == "load_assign":
        grouped.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, assign=True)
    elif change == "replace":
        blk = next(m for m in grouped.modules() if isinstance(m, OREPAConv2d) and m._kernel_group
                   and len(m._kernel_group) > 1)
        w = blk.branches["kxk"].conv.weight
        blk.branches["kxk"].conv.weight = nn.Parameter(w.detach() * 2)
        ref_blk = dict(ref.named_modules())[next(n for n, m in grouped.named_modules() if m is blk)]
        with torch.no_grad():
            ref_blk.branches["kxk"].conv.weight.mul_(2)
    elif change == "deepcopy":
        twin = copy.deepcopy(grouped)
        assert all(g._storage is None for g in engine.kernel_groups(twin))
        for g in engine.kernel_groups(twin):  # the copy's plans read the copy's parameters
            for b, blk in enumerate(g.plan.blocks):
                own = {id(p) for p in blk.parameters()}
                assert all(id(t) in own for t in g.plan.params_of(b))
        twin(x)
        for g0, g1 in zip(engine.kernel_groups(grouped), engine.kernel_groups(twin)):
            if len(g0) > 1:  # the copy's storage is its own
                assert {s.untyped_storage().data_ptr() for s in g0._storage.roles}.isdisjoint(
                    s.untyped_storage().data_ptr() for s in g1._storage.roles)
        grouped = twin
    y0, g0 = _grads(ref, x)
    y1, g1 = _grads(grouped, x)
    torch.testing.assert_close(y1, y0, rtol=1e-9, atol=1e-9)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-7, atol=1e-10, msg=k)
    assert all(len(s) == 1 for g in engine.kernel_groups(grouped) for s in _storages(g))


def test_a_grouped_models_state_dict_saves_and_loads_as_separate_tensors(tmp_path):
    ref, grouped = _pair()
    grouped(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    sd = grouped.state_dict()
    torch.save(sd, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    st = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    st.save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "m.safetensors"))
    back = st.load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_tensors_a_group_does_not_own_are_never_repointed():
    """functional_call swaps in the caller's tensors: the group concatenates them per build (the
    per-block numbers) and leaves their memory where it was."""
    from torch.func import functional_call

    ref, grouped = _pair()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    grouped(x)  # the storage is made from the group's own parameters
    theirs = {n: (p.detach() * 1.5).requires_grad_() for n, p in grouped.named_parameters()}
    where = {n: t.data_ptr() for n, t in theirs.items()}
    mine = {n: t.detach().clone().requires_grad_() for n, t in theirs.items()}
    y1 = functional_call(grouped, theirs, (x,))
    y0 = functional_call(ref, mine, (x,))
    torch.testing.assert_close(y1, y0, rtol=1e-9, atol=1e-9)
    y1.square().sum().backward()
    y0.square().sum().backward()
    assert all(t.grad is not None for t in theirs.values())
    assert {n: t.data_ptr() for n, t in theirs.items()} == where
    # the backward runs after functional_call gave the blocks their own tensors back: it must
    # differentiate what the forward read (it read the blocks' again: every branch but the
    # filter family's got the gradient at the model's own values)
    for n in mine:
        torch.testing.assert_close(theirs[n].grad, mine[n].grad, rtol=1e-7, atol=1e-10, msg=n)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_functional_call_backward_differentiates_the_tensors_passed(recompute):
    """Each block's own route (a CPU's; the kernel rebuilt in backward or kept): the gradients are
    those at the tensors functional_call passed, not at the block's own."""
    from torch.func import functional_call

    torch.manual_seed(0)
    block = OREPAConv2d(4, 8, 3, padding=1, recompute=recompute).double()
    plain = copy.deepcopy(block)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    theirs = {n: (p.detach() * 1.5 + 0.1).requires_grad_() for n, p in block.named_parameters()}
    functional_call(block, theirs, (x,)).square().sum().backward()
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(theirs[n])
    plain(x).square().sum().backward()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(theirs[n].grad, p.grad, rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("policy", ["grouped", "per-block"])
def test_functional_call_by_state_dict_names_reaches_the_packed_steps_and_leaves_nothing_behind(policy):
    """A packed model called through ``torch.func.functional_call`` with its state_dict's names (the
    packed steps' own keys, as a checkpoint holds them): the steps read the tensors passed, on the
    grouped and the per-block route, with their gradients; after the call they read their rows
    again (they had been ignored, the output that of the model's own values, and a stale view of
    the rows kept as each step's attribute: the old dtype after .to(), deepcopy refused)."""
    from torch.func import functional_call

    torch.manual_seed(0)
    ref = _Fan([4, 8]).double()
    packed = copy.deepcopy(ref)
    assert all(g.packed is not None for g in engine.group_kernels(packed, policy, pack=True))
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    own = packed(x)
    theirs = {k: (v * 0.5).requires_grad_() for k, v in packed.state_dict().items() if v.is_floating_point()}
    mine = {k: v.detach().clone().requires_grad_() for k, v in theirs.items()}
    y1, y0 = functional_call(packed, theirs, (x,)), functional_call(ref, mine, (x,))
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(y1, own)
    y1.square().sum().backward()
    y0.square().sum().backward()
    for k in mine:
        if mine[k].grad is not None or theirs[k].grad is not None:
            torch.testing.assert_close(theirs[k].grad, mine[k].grad, rtol=1e-9, atol=1e-12, msg=k)
    assert sum(t.grad is not None for t in theirs.values()) > 20
    assert not any("weight" in m.__dict__ for m in packed.modules())
    torch.testing.assert_close(packed(x), own, rtol=0, atol=0)
    packed.float()
    assert {v.dtype for v in copy.deepcopy(packed).state_dict().values() if v.is_floating_point()} == {torch.float32}


def test_torch_compile_of_a_packed_model_gives_the_eager_gradients():
    """``torch.compile`` of a model whose groups are packed: the blocks read their rows of the packed
    parameters inside the traced autograd Function (dynamo failed there on the rows' bookkeeping
    for functional_call, "an intermediate tensor ... aliases an input or output"). ``aot_eager``
    traces and partitions as inductor would, without generating code."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Fan([4, 8]).double()
    with torch.no_grad():
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.group_kernels(eager, "grouped", pack=True)
    net = copy.deepcopy(eager)
    compiled = torch.compile(net, backend="aot_eager")
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    for _ in range(2):  # the second call runs the compiled graph as it is
        net.zero_grad(set_to_none=True)
        y = compiled(x)
        y.square().sum().backward()
    eager(x).square().sum().backward()
    torch.testing.assert_close(y, eager(x), rtol=1e-10, atol=1e-12)
    grads = dict(eager.named_parameters())
    assert sum(".packed_parameters." in n for n in grads) >= 4
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-9, atol=1e-12, msg=n)


def _small_converted_pair(pack: bool):
    """A converted network with the kinds of group ResNet-18 makes, at a fraction of its tracing
    time: a stem, 3x3s of two widths in one group (8 -> 8 twice and 8 -> 16), two 16 -> 16 3x3s, a
    Rep-1x1 group: 7 blocks in 4 groups."""
    torch.manual_seed(0)

    def conv_bn_relu(cin, cout, k=3, stride=1):
        return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    net = nn.Sequential(*conv_bn_relu(3, 8), *conv_bn_relu(8, 8), *conv_bn_relu(8, 8), *conv_bn_relu(8, 16, stride=2),
                        *conv_bn_relu(16, 16), *conv_bn_relu(16, 16), *conv_bn_relu(16, 16, k=1),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    ref = orepa.convert(net, "orepa").double()
    grouped = copy.deepcopy(ref)
    engine.group_kernels(ref, "per-block")
    engine.group_kernels(grouped, "grouped", pack=pack)
    return ref, grouped


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_a_compiled_model_builds_its_groups_kernels_together_inside_the_graph(pack):
    """``torch.compile`` of a grouped network (policy ``grouped``: what ``auto`` does on a GPU;
    ``traced=True``): inside the graph the network's groups build their kernels together, as they
    do eagerly, instead of block by block: at most 4 matrix products per group forward and
    backward, the per-block numbers, one compilation for two steps, and no kernel left in the
    workspace after a forward. (A small network: tracing ResNet-18 took 1-2 minutes a case.)"""
    torch._dynamo.reset()
    ref, grouped = _small_converted_pair(pack)
    groups = engine.group_kernels(grouped, "grouped", pack=pack, traced=True)
    assert sorted(len(g) for g in groups) == [1, 1, 2, 3]
    graphs = []
    compiled = torch.compile(grouped, backend=aot_graph_backend(graphs))
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    for _ in range(2):
        y1, g1 = _grads(compiled, x)
    g1 = _named_grads(grouped)
    y0, g0 = _grads(ref, x)
    torch.testing.assert_close(y1, y0, rtol=1e-9, atol=1e-9)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-7, atol=1e-10, msg=k)
    assert len(graphs) == 2  # one forward, one backward: compiled once
    # (+ 2: the classifier's gradients; 16 measured, block by block (traced=False) 28)
    assert matrix_products(graphs) <= 4 * len(groups) + 2, (matrix_products(graphs), len(groups))
    workspace = groups[0].workspace
    assert workspace.traced == {} and not workspace.forward_open


def _dynamo_instructions(n: int) -> int:
    """The bytecode instructions dynamo traces for a compiled forward and backward of ``n`` 3x3 blocks
    of one signature, grouped with ``traced=True``."""
    from torch._dynamo import symbolic_convert

    translator = getattr(symbolic_convert, "InstructionTranslatorBase", None)
    if translator is None or not hasattr(translator, "step"):
        pytest.skip("this torch's dynamo has no InstructionTranslatorBase.step to count instructions by")
    count = [0]
    step = translator.step

    def counted(self):
        count[0] += 1
        return step(self)

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(*(OREPAConv2d(4, 4, 3, padding=1) for _ in range(n)))
    engine.group_kernels(net, "grouped", traced=True)
    translator.step = counted
    try:
        torch.compile(net, backend="eager")(torch.randn(1, 4, 5, 5)).sum().backward()
    finally:
        translator.step = step
    return count[0]


def test_a_compiled_groups_trace_grows_about_linearly_in_its_blocks():
    """Dynamo's trace of a grouped network costs per instruction of the Python it traces (ResNet-18 at
    1/8 width: 146k instructions, 7.4 s, against base's 3.4k, 0.7 s; docs/benchmarks.md). Looking at
    a group's tensors once per forward (not once per block) and a Function per group (dynamo's model
    of a Function compares each output with each input) keep it about linear in the blocks: 16 blocks
    of one group trace 4.6x the instructions of 4 here (7.3x with a look per block and one Function
    for every group's parameters)."""
    four, sixteen = _dynamo_instructions(4), _dynamo_instructions(16)
    assert sixteen <= 5.5 * four, (four, sixteen)


@pytest.mark.parametrize("policy", ["per-block", "grouped"])
def test_no_plan_is_made_inside_a_compiled_trace(policy, monkeypatch):
    """``group_kernels(..., traced=True)`` makes the plans a trace reads before it (a plan made inside
    costs dynamo thousands of instructions: ResNet-18 block by block 427k instructions against 227k):
    the group's traced twin, and per block those of its routes, on a GPU and on a CPU (whose route
    may run the two-layer branches on the feature map: here four of them at 1 pixel, two at 8x8,
    none at 16x16)."""
    made = []
    init = engine.Plan.__init__

    def counted(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            made.append(args[1])  # (a side effect dynamo carries out of the graph; inside a Function's body it refuses it)
        init(self, *args, **kwargs)

    monkeypatch.setattr(engine.Plan, "__init__", counted)
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(OREPAConv2d(16, 16, 3, padding=1), nn.ReLU(), OREPAConv2d(16, 16, 3, padding=1))
    engine.group_kernels(net, policy, traced=True)
    for size in (1, 8, 16):
        torch.compile(net, backend="eager", fullgraph=True)(torch.randn(2, 16, size, size)).sum().backward()
    assert made == []


#: two branches, one a composition (a matrix product in a traced build): where and when kernels are
#: built, read or compiled does not depend on the branches, while dynamo's trace and inductor's
#: compilation grow with them (tests of those, not of the branches' numbers, take these)
_TWO_BRANCHES = ("kxk", "1x1_kxk")


class _Graphed(nn.Module):
    """Four blocks of one signature: ``a`` -> ``b`` -> ``c`` (``b`` checkpointed, or after a graph
    break), ``unused`` never called; ``"... wider"``: ``b`` twice as wide (one group of two widths).
    Two branches (_TWO_BRANCHES)."""

    def __init__(self, how: str):
        super().__init__()
        wide = 12 if how.endswith("wider") else 6

        def block(cin, cout):
            return OREPAConv2d(cin, cout, 3, padding=1, branches=_TWO_BRANCHES)
        self.a, self.unused = block(6, 6), block(6, 6)
        self.b, self.c = block(6, wide), block(wide, 6)
        self.how = how.removesuffix(", wider")

    def forward(self, x):
        x = self.a(x).relu()
        if self.how == "graph break":
            torch._dynamo.graph_break()
        if self.how == "checkpoint":
            x = torch.utils.checkpoint.checkpoint(self.b, x, use_reentrant=False).relu()
        else:
            x = self.b(x).relu()
        return self.c(x).flatten(1)


@pytest.mark.parametrize("how,frames", [("plain", 1), ("graph break", 2), ("checkpoint", 1), ("checkpoint, wider", 1)])
def test_kernels_traced_into_a_graph_serve_across_graph_breaks_and_checkpoints(how, frames):
    """The kernels the first block builds inside a trace reach the blocks after a graph break (as
    the first graph's outputs) and inside an activation-checkpointed region (read, not changed there:
    a side effect would break the graph; a block wider than its group's narrowest there failed AOT's
    partition of the graph), with the eager groups' numbers, no recompilation over three calls, and
    nothing left after the forward (the unused block's kernel included)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    net, ref = _twins(_Graphed(how), "grouped", "grouped")
    engine.group_kernels(net, "grouped", traced=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(net, backend=counter, fullgraph=how == "plain")
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    for _ in range(3):
        y1, g1 = _grads(compiled, x)
    y0, g0 = _grads(ref, x)
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    for (k, a), b in zip(net.named_parameters(), g0.values()):
        if b is None:  # the unused block: None eagerly, the compiled graph's zeros when traced (documented)
            assert k.startswith("unused.") and (a.grad is None or not a.grad.any()), k
            continue
        torch.testing.assert_close(a.grad, b, rtol=1e-9, atol=1e-12, msg=k)
    assert counter.frame_count == frames
    workspace = net.a._kernel_group.workspace
    assert workspace.traced == {} and not workspace.forward_open


def _block6() -> OREPAConv2d:
    """A 6 -> 6 3x3 block of _TWO_BRANCHES, for tests of where kernels are built, read or traced."""
    return OREPAConv2d(6, 6, 3, padding=1, branches=_TWO_BRANCHES)


def test_a_block_compiled_outside_its_roots_forward_builds_its_own_kernel():
    """Compiled and called by itself (not within the grouped root's forward, whose hooks scope the
    traced kernels) a block builds its own kernel in the graph; compiled as part of the root's forward
    (the root's hooks run eagerly around the compiled submodule), the network's kernels are built
    there. Both with the per-block numbers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net, ref = _twins(nn.Sequential(nn.Sequential(_block6(), nn.ReLU()), _block6(), nn.Flatten()), "grouped", "per-block")
    engine.group_kernels(net, "grouped", traced=True)
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    alone = []
    block = torch.compile(nn.Sequential(net[0], nn.Flatten()), backend=aot_graph_backend(alone))
    y1, _ = _grads(block, x)
    y0, _ = _grads(nn.Sequential(ref[0], nn.Flatten()), x)
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    for (k, a), b in zip(net[0].named_parameters(), ref[0].parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12, msg=k)
    # its graph reads its own tensors and the input only (not its group's other block's)
    reads = sum(n.op == "placeholder" for n in alone[0].graph.nodes)
    assert reads <= len([*net[0].parameters(), *net[0].buffers()]) + 1, reads
    inner = []
    net[0] = torch.compile(net[0], backend=aot_graph_backend(inner))
    y1, _ = _grads(net, x)
    y0, g0 = _grads(ref, x)
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    for (k, a), b in zip(net.named_parameters(), g0.values()):
        torch.testing.assert_close(a.grad, b, rtol=1e-9, atol=1e-12, msg=k)
    reads = sum(n.op == "placeholder" for n in inner[0].graph.nodes)
    assert reads > len([*net[1].parameters(), *net[1].buffers()]) + 1, reads  # the other block's too
    assert net[1]._kernel_group.workspace.traced == {}


def _scope_hooks(m: nn.Module) -> list[str]:
    """The modules of ``m`` that hold forward hooks, by name."""
    return [n for n, sub in m.named_modules() if sub._forward_pre_hooks or sub._forward_hooks]


def test_the_forward_scope_hooks_follow_regrouping_copies_and_deployment():
    """The grouped root holds a pre-hook (dropping kernels built ahead), ``traced=True`` a pair:
    regrouping, also at a wider root, replaces them, a deep copy's open its own workspace, and a
    deployed model carries none, by ``reparameterize`` or by timm's protocol (``fuse()``), so
    TorchScript takes it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(OREPAConv2d(6, 6, 3, padding=1)), OREPAConv2d(6, 6, 3, padding=1))
    engine.group_kernels(net, "grouped")
    assert _scope_hooks(net) == [""] and len(net._forward_pre_hooks) == 1 and not net._forward_hooks
    engine.group_kernels(net[0], "grouped", traced=True)
    assert _scope_hooks(net) == ["", "0"]
    engine.group_kernels(net, "per-block", traced=True)
    assert _scope_hooks(net) == [""] and len(net._forward_pre_hooks) == len(net._forward_hooks) == 1
    twin = copy.deepcopy(net)
    (hook,) = twin._forward_pre_hooks.values()
    assert hook.workspace is twin[1]._kernel_group.workspace is not net[1]._kernel_group.workspace
    assert hook.root() is twin and hook.workspace.root() is twin
    deployed = orepa.reparameterize(twin)
    assert _scope_hooks(deployed) == [] and not deployed._forward_hooks_always_called
    assert _scope_hooks(twin) == [""]  # (a copy was deployed)
    torch.jit.script(deployed)
    for parent, name in ((twin[0], "0"), (twin, "1")):  # what timm.utils.reparameterize_model does
        setattr(parent, name, getattr(parent, name).fuse())
    assert _scope_hooks(twin) == []
    torch.jit.script(twin)


def test_a_block_deployed_alone_leaves_the_roots_hook_to_the_network_that_trains():
    """``reparameterize(block)`` / ``block.fuse()`` of one block (to inspect its conv) took the root's
    pre-hook off a network still training, and with it the guard against kernels built ahead going
    stale: 0.54 off after a ``.data`` write. The last block deployed takes it (timm's protocol)."""
    torch.manual_seed(0)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125, small_input=True).double()
    ref = copy.deepcopy(model)
    engine.group_kernels(model, "grouped")
    engine.group_kernels(ref, "per-block")
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    orepa.reparameterize(model.layer1[0].conv1)
    model.layer2[0].conv1.fuse()
    assert _scope_hooks(model) == [""]
    model.conv1(x)  # the stem alone: every group's kernels built ahead
    for net in (model, ref):
        with torch.no_grad():
            net.layer3[1].conv2.branches["kxk"].conv.weight.data.mul_(0.5)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-10, atol=1e-12)
    blocks = [m for m in model.modules() if isinstance(m, orepa.ReparamConv2d) and m._kernel_group is not None]
    for block in blocks[:-1]:
        block.fuse()
    assert _scope_hooks(model) == [""]
    blocks[-1].fuse()
    assert _scope_hooks(model) == []


def test_a_network_changed_after_grouping_deploys_by_timms_protocol_without_the_hook():
    """Blocks taken out after grouping (a stage replaced, a stem swapped for a 1-channel conv) stay in
    their groups but are never deployed: the root kept its hook, and TorchScript refused the
    deployed model ("'_ScopeHook' object has no attribute '__name__'")."""
    timm_utils = pytest.importorskip("timm.utils")
    torch.manual_seed(0)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125, small_input=True)
    model.layer4, model.fc = nn.Identity(), nn.Linear(32, 10)
    deployed = timm_utils.reparameterize_model(model.eval())
    assert _scope_hooks(deployed) == []
    x = torch.randn(1, 3, 16, 16)
    torch.testing.assert_close(torch.jit.script(deployed)(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("then", ["regrouped", "deployed block by block"])
def test_hooks_pickled_as_partials_with_their_handles_are_removed(then):
    """A model pickled when the root's hooks were ``functools.partial`` s whose handles its workspace
    kept: regrouping it, or deploying it by timm's protocol, removes those hooks as before."""
    import functools

    net = nn.Sequential(OREPAConv2d(4, 4, 3, padding=1), OREPAConv2d(4, 4, 3, padding=1))
    engine.group_kernels(net, "grouped")
    workspace = net[0]._kernel_group.workspace
    net._forward_pre_hooks.clear()  # that model's form: a partial, its handle in the workspace's state
    handle = net.register_forward_pre_hook(functools.partial(engine._open_forward, workspace))
    old, old_handle = pickle.loads(pickle.dumps((net, handle)))  # (the handle unpickled with its model's dict)
    old_ws = old[0]._kernel_group.workspace
    assert old_ws.root is None
    old_ws.__setstate__({"traced_scope": False, "groups": old_ws.groups, "scope_hooks": (old_handle,)})
    if then == "regrouped":
        engine.group_kernels(old, "grouped")
        (hook,) = old._forward_pre_hooks.values()
        assert isinstance(hook, engine._ScopeHook)
    else:
        for i in range(2):
            old[i] = old[i].fuse()
        assert not old._forward_pre_hooks
        torch.jit.script(old)
def test_a_copy_or_pickle_of_a_submodule_carries_nothing_of_the_roots_hooks():
    """The grouped root's hooks were reached from its blocks (their handles, in the network's
    workspace): copying, pickling or deploying a submodule (an EMA of a backbone, ``torch.save(model.
    layer1)``) copied the root's hook dicts, a user's hook there included ("cannot pickle
    '_thread.lock' object")."""
    torch.manual_seed(0)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125, small_input=True)
    engine.group_kernels(model, "grouped")
    lock = threading.Lock()
    model.register_forward_pre_hook(lambda m, a: lock.locked() and None)
    part = copy.deepcopy(model.layer1)
    assert _scope_hooks(part) == []
    pickle.loads(pickle.dumps(model.layer1))
    deployed = orepa.reparameterize(model.layer1.eval())
    x = torch.randn(2, 8, 8, 8)
    torch.testing.assert_close(deployed(x), model.layer1(x), rtol=1e-4, atol=1e-5)
    assert len(model._forward_pre_hooks) == 2  # the root's own: untouched


class _TwoPasses(nn.Module):
    """A submodule run twice in one forward, the second time with other tensors (a MAML inner step,
    a mean teacher). Two branches (_TWO_BRANCHES): which tensors a traced kernel was built from does
    not depend on them."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(OREPAConv2d(6, 6, 3, padding=1, branches=_TWO_BRANCHES), nn.ReLU(),
                                 OREPAConv2d(6, 6, 3, padding=1, branches=_TWO_BRANCHES))

    def forward(self, x, other):
        return (self.net(x) + torch.func.functional_call(self.net, other, (x,))).flatten(1)


@pytest.mark.parametrize("compiled_part,checkpointed", [(0, False), (2, False), (4, False), (2, True)],
                         ids=["first block", "middle block", "last block", "middle block, checkpointed"])
def test_eager_and_compiled_parts_of_one_forward_build_each_kernel_once(compiled_part, checkpointed, monkeypatch):
    """A grouped root that runs eagerly with one block compiled (``torch.compile`` of a stage, or
    blocks past a graph break or dynamo's recompile limit): a kernel built earlier in the forward,
    eagerly or inside the compiled part's graph, is read where the other kind of part needs it, not
    built again (eager blocks after the compiled first block built the whole group once more; a
    compiled block after eager ones built it again in its graph). The per-block numbers over two
    steps, one frame compiled (a compiled activation-checkpointed part compiled none: the engine
    wrote its memo of the groups' dtypes there, a side effect dynamo cannot keep in such a region)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    net, ref = _twins(nn.Sequential(_block6(), nn.ReLU(), _block6(), nn.ReLU(), _block6(), nn.Flatten()),
                      "grouped", "per-block")
    engine.group_kernels(net, "grouped", traced=True)
    eager_builds = []
    build = engine._build_groups
    monkeypatch.setattr(engine, "_build_groups", lambda groups: (eager_builds.append(sum(map(len, groups))),
                                                                 build(groups))[1])
    graphs = []
    counter = CompileCounterWithBackend(aot_graph_backend(graphs))
    part = Checkpointed(net[compiled_part]) if checkpointed else net[compiled_part]
    net[compiled_part] = torch.compile(part, backend=counter)
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    for _ in range(2):
        eager_builds.clear()
        y1, g1 = _grads(net, x)
        y0, g0 = _grads(ref, x)
        torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
        for (k, b), a in zip(g0.items(), g1.values(), strict=True):  # (the compiled part's names: _orig_mod.)
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=k)
        with torch.no_grad():
            for a, b in zip(net.parameters(), ref.parameters()):
                a.sub_(0.1 * a.grad), b.sub_(0.1 * b.grad)
        # the first block compiled: its graph builds the group, the eager blocks read it; else the first
        # (eager) block builds it and the compiled one reads its kernel (its graph builds nothing)
        assert eager_builds == ([] if compiled_part == 0 else [3]), eager_builds
    assert counter.frame_count == 1
    assert (matrix_products(graphs) > 0) == (compiled_part == 0)


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_a_traced_kernel_serves_only_the_tensors_it_was_built_from(pack):
    """Within one compiled forward a block that reads other tensors (``functional_call``) builds
    again: the eager groups' output and gradients, the substituted tensors' included."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net, ref = _twins(_TwoPasses(), "grouped", "grouped")
    engine.group_kernels(net, "grouped", pack=pack, traced=True)
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    other = {k: (v + 0.3 * torch.randn_like(v)).detach().requires_grad_() for k, v in ref.net.named_parameters()}

    def run(model):
        for t in other.values():
            t.grad = None
        y = model(x, other)
        y.square().sum().backward()
        return y, {k: t.grad.clone() for k, t in other.items()}

    y1, g1 = run(torch.compile(net, backend="aot_eager"))
    y0, g0 = run(ref)
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-9, atol=1e-12, msg=k)


class _Mixed(nn.Module):
    """Two blocks of one signature, one in float64 and one in float32."""

    def __init__(self):
        super().__init__()
        self.a = OREPAConv2d(6, 6, 3, padding=1, branches=_TWO_BRANCHES).double()
        self.b = OREPAConv2d(6, 6, 3, padding=1, branches=_TWO_BRANCHES)

    def forward(self, x):
        return self.b(self.a(x).float())


def test_traced_groups_of_mixed_dtypes_build_block_by_block_and_held_groups_build_once():
    """A group whose blocks differ in dtype builds block by block in the graph (as eagerly: it failed
    to compile); a group that declined prebuilding and is reached after another group's build
    builds itself only (it built the other again)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mixed = _Mixed()
    engine.group_kernels(mixed, "grouped", traced=True)
    assert len(engine.kernel_groups(mixed)) == 1
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    y = torch.compile(mixed, backend="aot_eager")(x)
    torch.testing.assert_close(y, mixed(x), rtol=1e-5, atol=1e-6)

    torch._dynamo.reset()
    net = _Fan([6, 6], branches=_TWO_BRANCHES)
    net.blocks.append(OREPAConv2d(4, 8, 3, padding=1, groups=2, branches=_TWO_BRANCHES))
    net, _ = _twins(net, "grouped", "grouped")
    groups = engine.group_kernels(net, "grouped", traced=True)
    assert len(groups) == 2
    graphs = []
    counts = []
    for declined in (False, True):
        graphs.clear()
        torch._dynamo.reset()
        if declined:
            groups[1].decline()
        torch.compile(net, backend=aot_graph_backend(graphs))(torch.randn(2, 4, 5, 5, dtype=torch.float64)).sum().backward()
        counts.append(matrix_products(graphs))
    assert counts[0] == counts[1] > 0, counts


def _twins(net: nn.Module, policy: str, other: str) -> tuple[nn.Module, nn.Module]:
    """``net`` in float64 with its parameters moved off their initial values (identities, zeros),
    and a deep copy of it; grouped with ``policy`` and ``other``."""
    net = net.double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    twin = copy.deepcopy(net)
    engine.group_kernels(net, policy)
    engine.group_kernels(twin, other)
    return net, twin


def _run_traced(gm: torch.fx.GraphModule, inputs) -> torch.fx.GraphModule:
    """A stand-in for ``engine.compile_graph`` that compiles nothing: the traced construction
    (``make_fx``'s graph, what inductor would be given) run as it is, for tests of where and when
    the engine compiles, not of inductor's code (a cold inductor compilation of a few blocks'
    construction and its vjp costs several seconds)."""
    return gm


def _counted(calls: list, compile_graph):
    """``compile_graph`` with each call counted in ``calls``, as whether the generated code checks its
    inputs' sizes (the cache key pins them)."""
    return lambda gm, inputs: calls.append(torch._inductor.config.size_asserts) or compile_graph(gm, inputs)


def _compiled_pair(monkeypatch, branches=None, compile_graph=None):
    """The same little network twice, float64, grouped eagerly and grouped with compiled
    construction (groups of two and of one; with every branch: a filter family, both
    compositions); the calls of the compiler (inductor, ``engine.compile_graph``, unless
    ``compile_graph`` is given) are counted."""
    torch.manual_seed(0)
    a, b = _twins(nn.Sequential(OREPAConv2d(6, 6, 3, padding=1, branches=branches), nn.ReLU(),
                                OREPAConv2d(6, 6, 3, padding=1, branches=branches), nn.ReLU(),
                                OREPAConv2d(6, 8, 3, padding=1, groups=2, branches=branches)), "grouped", "compiled")
    calls = []
    monkeypatch.setattr(engine, "compile_graph", _counted(calls, compile_graph or engine.compile_graph))
    return a, b, calls


def _step(model, opt, x):
    opt.zero_grad(set_to_none=True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.shape[1], dtype=y.dtype).view(1, -1, 1, 1)).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return y.detach(), grads


@pytest.mark.slow
def test_a_compiled_group_gives_the_eager_groups_numbers_and_compiles_once_per_layout(monkeypatch):
    from orepa.apps.bench.measure import count_ops

    a, b, calls = _compiled_pair(monkeypatch)
    assert len(engine.kernel_groups(b)) == 2  # built by one compiled construction
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in (a, b)]
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    for step in range(3):  # the storage is read, then updated in place by SGD, then read again
        (ya, ga), (yb, gb) = _step(a, opts[0], x), _step(b, opts[1], x)
        torch.testing.assert_close(yb, ya, rtol=1e-10, atol=1e-12)
        for k in ga:
            torch.testing.assert_close(gb[k], ga[k], rtol=1e-9, atol=1e-12, msg=k)
        assert len(calls) == 2  # the groups' squeeze and vjp, compiled at the first step only
    ops = {m: count_ops(lambda m=m, o=o: _step(m, o, x))[0] for m, o in zip((a, b), opts)}
    # fewer operators compiled (measured: 248 vs 341 eager, whose views are kept: kernels.keep_views, Workspace)
    assert ops[b] < 0.8 * ops[a], ops
    # a new layout (dtype) compiles again; a deep copy compiles its own (the engine's calls of the
    # compiler: their graphs run as traced, inductor's code for a layout being checked above)
    monkeypatch.setattr(engine, "compile_graph", _counted(calls, _run_traced))
    twin = copy.deepcopy(b).float()
    assert all(not g._compiled for g in engine.kernel_groups(twin))
    y = twin(x.float())
    assert calls == [False] * 4 and not any(g._compile_failed for g in engine.kernel_groups(twin))
    torch.testing.assert_close(y, a.float()(x.float()), rtol=1e-4, atol=1e-5)


def test_the_compiler_gets_no_short_reduction_and_the_same_numbers(monkeypatch):
    """The forward construction handed to the compiler is element-wise code and deep products:
    its short contractions (dw -> pw's 8 channels, the filter family's 3 members) are written out
    term by term. As reductions, inductor's CPU code ran the 8-term sum with one OpenMP region
    per output element (ResNet-18's 512-channel group: 670 ms per build, 70 ms eagerly)."""
    import torch._inductor
    from torch.fx.experimental.proxy_tensor import make_fx

    from orepa import kernels as K

    graphs = []
    monkeypatch.setattr(engine, "compile_graph", lambda gm, inputs: graphs.append(gm) or gm)  # run it traced
    torch.manual_seed(0)
    # two 3x3 blocks (dw -> pw, the filter family) and a Rep-1x1 (1x1 -> 1x1 over 24 channels: a long contraction)
    ref, model = _twins(nn.Sequential(OREPAConv2d(24, 24, 3, padding=1), nn.ReLU(), OREPAConv2d(24, 24, 3, padding=1),
                                      OREPAConv2d(24, 32, 1)), "per-block", "compiled")
    x = torch.randn(2, 24, 6, 6, dtype=torch.float64)
    (y0, g0), (y1, g1) = (_step(m, torch.optim.SGD(m.parameters(), lr=0.0), x) for m in (ref, model))
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-9, atol=1e-12, msg=k)
    assert len(graphs) == 2  # both groups at once: their construction, then its vjp
    reductions = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in
                  (torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default)]
    assert not reductions, reductions
    assert any(n.target == torch.ops.aten.bmm.default for n in graphs[1].graph.nodes)  # the Rep-1x1's
    # the storages are the graphs' inputs, never their constants: the views a storage keeps
    # (kernels.keep_views), taken in by a trace, were frozen at their values of the compile
    assert not [n.target for g in graphs for n in g.graph.nodes if n.op == "get_attr"]
    # the unrolled product itself, against the matrix product; a long contraction (a Rep-1x1's
    # 1x1 -> 1x1) stays a matrix product, which a broadcast product would not become
    for depth in (1, 3, K.UNROLLED_CONTRACTION, K.UNROLLED_CONTRACTION + 1):
        a, b = torch.randn(4, 5, depth, dtype=torch.float64), torch.randn(4, depth, 7, dtype=torch.float64)
        torch.testing.assert_close(K.batched_product(a, b, pointwise=True), torch.bmm(a, b), rtol=1e-12, atol=1e-12)
        ops = {n.target for n in make_fx(lambda a, b: K.batched_product(a, b, pointwise=True))(a, b).graph.nodes}
        assert torch.ops.aten.sum.dim_IntList not in ops
        assert (torch.ops.aten.bmm.default in ops) == (depth > K.UNROLLED_CONTRACTION)


def test_a_second_model_of_the_same_layout_takes_its_construction_from_inductors_cache():
    """The compiled constructions go through inductor's graph cache (on disk: a later process
    compiles a ResNet-18's construction in seconds instead of most of a minute): a second model of
    the same layout compiles no graph anew."""
    from torch._dynamo.utils import counters

    def compiled_model():
        # one block of _TWO_BRANCHES: any construction goes through the cache
        torch.manual_seed(0)
        net = nn.Sequential(OREPAConv2d(6, 6, 3, padding=1, branches=_TWO_BRANCHES)).double()
        engine.group_kernels(net, "compiled", pack=True)
        net(torch.randn(2, 6, 5, 5, dtype=torch.float64)).sum().backward()
        return net

    compiled_model()
    before = dict(counters["inductor"])
    compiled_model()
    new = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                                                  "fxgraph_cache_bypass")}
    assert new == {"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 0}, new


def test_a_failed_compilation_warns_and_the_group_builds_eagerly(monkeypatch):
    a, b, _ = _compiled_pair(monkeypatch)

    def no_compiler(gm, inputs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(engine, "compile_graph", no_compiler)
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="compiling the kernel construction failed .RuntimeError: no C.. "
                                            "compiler found.; the kernels are built eagerly"):
        y, g = _step(b, torch.optim.SGD(b.parameters(), lr=0.0), x)
    y0, g0 = _step(a, torch.optim.SGD(a.parameters(), lr=0.0), x)
    torch.testing.assert_close(y, y0, rtol=1e-10, atol=1e-12)
    for k in g0:
        torch.testing.assert_close(g[k], g0[k], rtol=1e-9, atol=1e-12, msg=k)
    assert engine.kernel_groups(b)[0]._compile_failed  # the group that leads the network's build


# --------------------------------------------------------------------------- packed parameters


def _packed_pair(name="resnet18", policy="grouped"):
    """The same model grouped with ``policy``, unpacked and packed (float64)."""
    torch.manual_seed(0)
    plain = orepa.create_model(name, "orepa", num_classes=10, width_mult=0.125).double()
    packed = copy.deepcopy(plain)
    engine.group_kernels(plain, policy)
    engine.group_kernels(packed, policy, pack=True)
    return plain, packed


def _train(model, x, steps=3):
    from orepa.apps.common import make_sgd, split_params

    opt = make_sgd(split_params(model).torch_groups(1e-2, 1e-3), lr=0.05, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        y = model(x)
        (y * torch.linspace(-1, 1, y.shape[1], dtype=y.dtype)).square().sum().backward()
        opt.step()
    return opt


@pytest.mark.parametrize("name,policy", [("resnet18", "grouped"), ("resnet50", "grouped"), ("resnet18", "auto")])
def test_packed_groups_train_exactly_as_unpacked_ones_with_fewer_parameter_tensors(name, policy):
    """Packing changes where the numbers live, not the numbers: the same state_dict keys and values
    before and after training steps with weight decay by role (auto on a CPU: every block its own
    route, reading its rows of the packed parameters), the same number of parameters in far fewer
    tensors."""
    plain, packed = _packed_pair(name, policy)
    n_plain, n_packed = len(list(plain.parameters())), len(list(packed.parameters()))
    assert n_packed < 0.45 * n_plain, (n_plain, n_packed)
    assert sum(p.numel() for p in packed.parameters()) == sum(p.numel() for p in plain.parameters())
    sd0, sd1 = plain.state_dict(), packed.state_dict()
    assert list(sd1) == list(sd0) and all(torch.equal(sd1[k], sd0[k]) for k in sd0)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    _train(plain, x)
    _train(packed, x)
    sd0, sd1 = plain.state_dict(), packed.state_dict()
    assert list(sd1) == list(sd0)
    for k in sd0:
        torch.testing.assert_close(sd1[k], sd0[k], rtol=1e-12, atol=1e-12, msg=k)
    # and it trained: the weight-decay groups hold the same tensors' numbers
    from orepa.apps.common import split_params
    for role in ("decay", "no_decay", "scales"):
        assert sum(p.numel() for p in getattr(split_params(packed), role)) == \
            sum(p.numel() for p in getattr(split_params(plain), role)), role


def test_a_packed_model_loads_copies_moves_and_deploys_as_an_unpacked_one():
    plain, packed = _packed_pair()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    _train(plain, x, steps=1)
    # a checkpoint of the unpacked model loads strictly into the packed one, and back
    packed.load_state_dict(plain.state_dict())
    loaded = packed.state_dict()  # (taken once, not once per key)
    assert all(torch.equal(loaded[k], v) for k, v in plain.state_dict().items())
    key = next(k for k in plain.state_dict() if k.endswith("branches.kxk.conv.weight"))
    bad = dict(plain.state_dict())
    del bad[key]
    with pytest.raises(RuntimeError, match=f"Missing key\\(s\\) in state_dict: \"{key}\""):
        packed.load_state_dict(bad)
    bad[key] = torch.zeros(3)
    with pytest.raises(RuntimeError, match=f"size mismatch for {key}"):
        packed.load_state_dict(bad)
    bad[key + "_extra"] = torch.zeros(3)
    del bad[key]
    assert packed.load_state_dict(bad, strict=False).missing_keys == [key]
    packed.load_state_dict(plain.state_dict())
    meta = copy.deepcopy(packed).to("meta")
    with pytest.raises(RuntimeError, match="a packed weight on the meta device cannot take a value"):
        meta.load_state_dict(plain.state_dict(), assign=True)
    # copies (EMA, deployment) and moves keep the packed layout consistent
    twin = copy.deepcopy(packed)._apply(lambda t: t.clone())  # new memory for every tensor, as a device move
    y0, g0 = _grads(plain, x)
    for m in (packed, twin):
        y1, _ = _grads(m, x)
        torch.testing.assert_close(y1, y0, rtol=1e-9, atol=1e-9)
        grads = {n: p.grad for n, p in m.named_parameters()}
        assert all(n in grads and grads[n] is not None for n, p in m.named_parameters())
    blk = next(m for m in twin.modules() if getattr(m, "packed_parameters", None) is not None)
    assert blk.branches["kxk"].conv.weight.untyped_storage().data_ptr() == \
        getattr(blk.packed_parameters, blk.branches["kxk"].conv._packed.name).untyped_storage().data_ptr()
    deployed = [orepa.reparameterize(m).eval() for m in (plain, packed)]
    torch.testing.assert_close(deployed[1](x), deployed[0](x), rtol=1e-12, atol=1e-12)
    assert deployed[0].state_dict().keys() == deployed[1].state_dict().keys()


def test_regrouping_unpacks_and_per_block_parameters_train_again():
    plain, packed = _packed_pair()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    _train(plain, x, steps=1)
    _train(packed, x, steps=1)
    engine.group_kernels(packed, "grouped")  # no pack: back to one parameter per step
    assert len(list(packed.parameters())) == len(list(plain.parameters()))
    assert not any(isinstance(m, engine.PackedParameters) for m in packed.modules())
    assert [n for n, _ in packed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    _train(plain, x, steps=2)
    _train(packed, x, steps=2)
    trained = packed.state_dict()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(trained[k], v, rtol=1e-12, atol=1e-12, msg=k)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_blocks_of_a_packed_group_give_the_per_block_gradients(reentrant):
    """In a checkpointed region each block builds its own kernel from its rows of the packed
    parameters: the gradients reach the packed parameters all the same."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    net = nn.Sequential(*[OREPAConv2d(4, 4, 3) for _ in range(3)]).double()
    ref = copy.deepcopy(net)
    engine.group_kernels(net, "grouped", pack=True)
    engine.group_kernels(ref, "per-block")
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    for m in (net, ref):
        checkpoint(lambda t, m=m: m[2](m[1](t)), m[0](x), use_reentrant=reentrant).sum().backward()
    for name, p in net[0].packed_parameters.named_parameters():
        rows = sorted((st._packed.lo, dict(ref.named_modules())[n].weight.grad) for n, st in net.named_modules()
                      if st.__dict__.get("_packed") is not None and st._packed.name == name)
        want = torch.cat([g.reshape(-1, *p.shape[1:]) for _, g in rows])  # each step's rows, in order
        torch.testing.assert_close(p.grad, want, msg=name)


_FAMILY = ("1x1.conv", "1x1.scale", "1x1_avg.conv", "1x1_avg.scale", "1x1_prior.conv", "1x1_prior.scale")


@pytest.mark.parametrize("frozen", [(), ("kxk.conv",), ("kxk.scale",), ("kxk.conv", "kxk.scale"), _FAMILY,
                                    ("1x1_prior.conv", "1x1_prior.scale"), ("1x1.conv",), ("1x1_avg.scale",)],
                         ids=["none", "kxk weight", "kxk scale", "kxk", "filter family", "1x1-prior (of the family)",
                              "1x1 weight (of the family)", "1x1-avg scale (of the family)"])
def test_a_group_packs_one_parameter_per_kind_row_shape_and_trainability(frozen):
    """Packed parameters are the concatenations of the steps whose rows agree in kind (scale or conv
    weight), in shape and in trainability (a branch frozen in every block gets a parameter of its
    own, without gradient): every branch's scales in one, the 3x3 kernels of kxk and 1x1 -> kxk in
    one, ... The gradients are each step's, by its rows. The filter family's 1x1 weights (and its
    scales) are one operand: frozen in the whole family they pack apart, in part of it the group
    stays unpacked. (A frozen kxk scale, alone in its parameter, crashed the backward; a frozen
    1x1-prior trained, and a frozen 1x1 weight froze the family's other 1x1 weights.)"""
    torch.manual_seed(0)
    net = nn.Sequential(OREPAConv2d(4, 4, 3, padding=1), nn.ReLU(), OREPAConv2d(4, 4, 3, padding=1)).double()
    for i in (0, 2):
        for name in frozen:
            net[i].branches.get_submodule(name).weight.requires_grad_(False)
    plain = copy.deepcopy(net)
    engine.group_kernels(plain, "grouped")
    want = {}
    for name, m in plain.named_modules():
        w = m._parameters.get("weight") if name.split(".")[0] in ("0", "2") and ".branches." in name else None
        if w is not None:
            key = ("scale" if w.dim() == 1 else "weight", tuple(w.shape[1:]), w.requires_grad)
            want[key] = want.get(key, 0) + w.shape[0]
    (group,) = engine.group_kernels(net, "grouped", pack=True)
    if frozen and set(frozen) < set(_FAMILY):
        assert group.packed is None
    else:
        got = {(group.packed.kinds[n], tuple(p.shape[1:]), p.requires_grad): p.shape[0]
               for n, p in group.packed.named_parameters()}
        assert got == want and len(got) > (5 if frozen else 4) and "scales" in dict(group.packed.named_parameters())
    xs = [torch.randn(2, 4, 4, 4, dtype=torch.float64) for _ in range(2)]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, weight_decay=1e-2)
            for m in (plain, net)]
    for x in xs:  # two steps: the second reads what the first wrote
        (y0, g0), (y1, g1) = _grads(plain, x), _grads(net, x)
        torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
        for k, g in g0.items():
            if g is None:
                assert any(k.endswith(f"branches.{n}.weight") for n in frozen), k
                assert g1[k] is None, k
                continue
            torch.testing.assert_close(g1[k], g, rtol=1e-12, atol=1e-12, msg=k)
        if group.packed is not None:
            assert all((p.grad is None) == (not p.requires_grad) for p in group.packed.parameters())
        for opt in opts:
            opt.step()
    after = net.state_dict()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(after[k], v, rtol=1e-12, atol=1e-12, msg=k)
        if any(k.endswith(f"branches.{n}.weight") for n in frozen):
            assert torch.equal(after[k], before[k]), k  # frozen: unchanged


def test_a_group_frozen_in_some_blocks_only_stays_unpacked():
    """group_kernels groups blocks frozen apart apart (each group packs, its frozen rows in a
    ``_frozen`` parameter without gradient); a group frozen in some blocks only (made by hand, or
    frozen after grouping) does not pack: a role's rows in one parameter cannot say which train."""
    torch.manual_seed(0)
    net = nn.Sequential(*[OREPAConv2d(4, 4, 3) for _ in range(3)]).double()
    net[1].branches["kxk"].conv.weight.requires_grad_(False)
    groups = engine.group_kernels(net, "grouped", pack=True)
    assert [[list(net).index(b) for b in g.blocks] for g in groups] == [[0, 2], [1]]
    assert all(g.packed is not None for g in groups)
    net(torch.randn(2, 4, 6, 6, dtype=torch.float64)).sum().backward()
    frozen = dict(groups[1].packed.named_parameters())
    assert [n for n, p in frozen.items() if not p.requires_grad] == ["weights_4x3x3_frozen"]
    assert all((p.grad is None) != p.requires_grad for p in frozen.values())
    engine.group_kernels(net, "grouped")  # unpacked again
    mixed = engine.KernelGroup(list(net), "grouped")
    assert not mixed.pack() and mixed.packed is None
    net[1].branches["kxk"].conv.weight.requires_grad_(True)
    (group,) = engine.group_kernels(net, "grouped", pack=True)
    assert group.packed is not None


@pytest.mark.parametrize("policy", ["grouped", "per-block", "auto"])
def test_freezing_a_stage_after_packing_is_said_once_with_the_blocks_frozen_together(policy):
    """ResNet-18's layer3 frozen after packing: the 256-channel group's packed parameters (held by
    layer3) hold layer4.0.conv1's rows too, so it is frozen with them; one warning per network names
    the group's blocks, whatever route the blocks take. Frozen before packing, each block trains as
    it was told, without a warning."""
    x = torch.randn(2, 3, 32, 32)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125)
    engine.group_kernels(model, policy, pack=True)
    model(x).sum().backward()
    model.layer3.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"frozen or unfrozen after packing.*\(layer3\.0\.conv2, layer3\.1\.conv1, "
                      r"layer3\.1\.conv2, layer4\.0\.conv1\)") as said:
        for _ in range(2):
            model(x).sum().backward()
    assert sum("after packing" in str(w.message) for w in said) == 1
    before = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125)
    before.layer3.requires_grad_(False)
    engine.group_kernels(before, "grouped", pack=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before(x).sum().backward()
    grads = _named_grads(before)
    assert all(g is None for k, g in grads.items() if k.startswith("layer3.") and ".conv" in k)
    assert all(g is not None for k, g in grads.items() if k.startswith("layer4.0.conv1.branches."))


def _packed_after_a_step(name: str, x, frozen_backbone: bool = False, **options) -> nn.Module:
    """A zoo network (x0.125) packed, its backbone frozen before where asked, after one training step."""
    model = orepa.create_model(name, "orepa", num_classes=10, width_mult=0.125, **options)
    if frozen_backbone:
        for child_name, child in model.named_children():
            child.requires_grad_(child_name == "fc")
    engine.group_kernels(model, "per-block", pack=True)
    model(x).sum().backward()
    return model


def test_unfreezing_a_stage_after_packing_is_said_and_freezing_everything_is_not():
    """The backbone frozen before packing (as the docs ask), then layer4 unfrozen for a second stage of
    fine-tuning: layer4.0.conv1's rows lie in a parameter layer3 holds, so it stayed frozen, silently.
    Said now, as is freezing layer4 (the same block missed); freezing a group of one, or every block,
    after packing is exact, and not said, nor are a functional_call's tensors in the parameters' place."""
    x = torch.randn(2, 3, 32, 32)
    model = _packed_after_a_step("resnet18", x, frozen_backbone=True)
    model.layer4.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"frozen or unfrozen after packing.*layer4\.0\.conv1 \(its rows held by layer3\."):
        model(x).sum().backward()
    stage = _packed_after_a_step("resnet18", x)
    stage.layer4.requires_grad_(False)  # its own group exactly, but layer4.0.conv1's rows are layer3's
    with pytest.warns(UserWarning, match=r"layer4\.0\.conv1 \(its rows held by layer3\.0\.conv2\) did not change "
                                         r"with its stage"):
        stage(x).sum().backward()
    stem = _packed_after_a_step("resnet18", x, small_input=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stem.conv1.requires_grad_(False)  # a group of one: exact
        stem(x).sum().backward()
        # tensors put in the parameters' place for one call, frozen or not: not the model's trainability
        torch.func.functional_call(stem, {k: nn.Parameter(v.detach(), requires_grad=k.startswith("layer1"))
                                          for k, v in stem.named_parameters()}, (x,)).sum().backward()
        stem(x).sum().backward()
    twin = copy.deepcopy(stage)  # a copy keeps what its original's trainability was
    twin.layer3.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"layer3\.0\.conv1 \(its rows held by layer2\.0\.conv2\) did not change"):
        twin(x).sum().backward()
    deep = _packed_after_a_step("resnet50", x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("conv1", "bn1", "layer1"):  # torchvision's trainable_layers=3, exact here (downsample included)
            deep.get_submodule(name).requires_grad_(False)
        deep(x).sum().backward()
    everything = _packed_after_a_step("resnet18", x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, child in everything.named_children():  # fine-tuning the head alone
            child.requires_grad_(name == "fc")
        everything(x).sum().backward()
        everything.requires_grad_(True)  # and then everything
        everything(x).sum().backward()


@pytest.mark.slow
def test_a_packed_compiled_group_trains_as_a_packed_eager_one(monkeypatch):
    """The compiled construction of a packed group returns one gradient per packed parameter, as
    the eager one does (two signatures, one with the filter family; compiled at the first step).
    (The traced construction, run as traced: what inductor compiles of a packed construction is
    checked on ResNet-18's, test_a_compiled_resnet18_gives_the_per_block_numbers_with_few_operators.)"""
    calls = []
    monkeypatch.setattr(engine, "compile_graph", _counted(calls, _run_traced))
    torch.manual_seed(0)
    net = nn.Sequential(OREPAConv2d(4, 4, 3), nn.ReLU(), OREPAConv2d(4, 4, 3), nn.ReLU(), OREPAConv2d(4, 8, 3)).double()
    ref = copy.deepcopy(net)
    engine.group_kernels(net, "compiled", pack=True)
    engine.group_kernels(ref, "grouped", pack=True)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    for m in (net, ref):
        _sgd_steps(m, x)
    groups = engine.kernel_groups(net)
    assert all(g._storage.packed for g in groups)
    assert groups[0]._compiled_for[1].plans == tuple(g.plan for g in groups)  # one compiled build for all
    assert len(calls) == 2  # its construction and vjp, compiled at the first step only
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)


class _Fan(nn.Module):
    """Blocks of one input width side by side (as a network's stage transitions are: 64 -> 64 and
    64 -> 128), their outputs concatenated."""

    def __init__(self, widths, k=3, **options):
        super().__init__()
        self.blocks = nn.ModuleList(OREPAConv2d(4, w, k, padding=k // 2, **options) for w in widths)

    def forward(self, x):
        return torch.cat([b(x) for b in self.blocks], 1).flatten(1)


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_gradients_of_unscaled_branches_accumulate_over_backwards_on_the_grouped_route(pack):
    """Branches without scales (``scaling="none"``: a kxk's gradient is the kernel's own, which the
    grouped route assembles in its workspace): two backwards without zeroing accumulate what the
    per-block route accumulates (a buffer handed out as ``.grad`` would be overwritten by the next
    build)."""
    torch.manual_seed(0)
    net, ref = _twins(_Fan([8, 4, 12], scaling="none"), "per-block", "per-block")
    engine.group_kernels(net, "grouped", pack=pack)
    xs = torch.randn(2, 2, 4, 5, 5, dtype=torch.float64).unbind(0)
    y1, g1 = _grads(net, *xs)
    y0, g0 = _grads(ref, *xs)
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-9, atol=1e-12, msg=k)


@pytest.mark.parametrize("k", [3, 1])  # OREPA's six branches; Rep-1x1 (1x1 -> 1x1)
@pytest.mark.parametrize("pack", [False, True])
def test_blocks_of_several_widths_build_as_one_group_with_the_per_block_numbers(k, pack):
    """Blocks whose widths are multiples of the smallest (at most 4x) share a group: its rows are
    theirs concatenated, the input-side steps (1x1 -> kxk's 1x1, dw -> pw's dw) used once per
    multiple. Outputs, gradients and SGD steps equal the per-block route's; the state_dict and the
    deployed convs are the blocks' own."""
    torch.manual_seed(0)
    net, ref = _twins(_Fan([4, 8, 12, 4, 16, 20, 6], k), "per-block", "per-block")
    before = {n: t.shape for n, t in net.state_dict().items()}
    groups = engine.group_kernels(net, "grouped", pack=pack)
    assert [[b.out_channels for b in g.blocks] for g in groups] == [[4, 8, 12, 4, 16], [6], [20]]
    assert groups[0].plan.v == 11 and any(br.replicated for br in groups[0].plan.branches)
    assert (groups[0].packed is not None) == pack
    assert {n: t.shape for n, t in net.state_dict().items()} == before
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    _assert_same_grads(ref, net, x, rtol=1e-9, atol=1e-12)
    for m in (net, ref):
        _sgd_steps(m, x, steps=3)
    for (name, p), q in zip(ref.state_dict().items(), net.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12, msg=name)
    deployed = orepa.reparameterize(copy.deepcopy(net).eval())
    torch.testing.assert_close(deployed(x), ref.eval()(x), rtol=1e-9, atol=1e-10)


def test_a_mixed_width_group_counts_fewer_operators_than_a_group_per_width():
    """The point of sharing a group across widths: the kernel construction of a 64 -> 64 and a
    64 -> 128 block costs the operators of one group, not two (a few more to replicate the
    input-side steps)."""
    def ops(widths_apart: bool) -> int:
        torch.manual_seed(0)
        net = _Fan([4, 8])
        groups = engine.group_kernels(net, "grouped", pack=True)
        if widths_apart:  # what grouping by exact signature made of them
            for g, blk in zip([engine.KernelGroup([b], "grouped") for b in net.blocks], net.blocks):
                blk._kernel_group = g
            groups = engine.kernel_groups(net)
            for g in groups:
                g.peers = groups
        x = torch.randn(1, 4, 5, 5)
        net(x).sum().backward()
        from orepa.apps.bench.measure import count_ops
        return count_ops(lambda: net(x).sum().backward())[0]

    together, apart = ops(False), ops(True)
    assert together < apart - 30, (together, apart)


def test_frozen_blocks_and_trainable_ones_form_groups_of_their_own():
    """Blocks of one signature but frozen apart (a detection backbone's frozen stage beside the
    next stage's first block) build in groups of their own, so each can pack."""
    net = _Fan([4, 4, 8, 8])
    for p in [*net.blocks[0].parameters(), *net.blocks[2].parameters()]:
        p.requires_grad_(False)
    groups = engine.group_kernels(net, "grouped", pack=True)
    assert [[list(net.blocks).index(b) for b in g.blocks] for g in groups] == [[0, 2], [1, 3]]
    assert all(g.packed is not None for g in groups)


@pytest.mark.parametrize("case", ["no scales", "one family member", "functional_call"])
def test_a_group_whose_first_block_is_not_the_narrowest(case):
    """Virtual blocks are as wide as the narrowest block wherever it sits (a per-channel filter's
    groups are its block's rows: read off the first, wider block they made the compositions
    fail to fit, where no filter-family storage took those branches)."""
    from torch.func import functional_call

    torch.manual_seed(0)
    opts = {"no scales": {"scaling": "none"}, "one family member": {"branches": ("kxk", "1x1_avg")},
            "functional_call": {}}[case]
    net = _Fan([8, 4, 12], **opts).double()
    ref = copy.deepcopy(net)
    assert len(engine.group_kernels(net, "grouped")) == 1
    engine.group_kernels(ref, "per-block")
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    outs = []
    for m in (net, ref):
        theirs = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}
        y = functional_call(m, theirs, (x,)) if case == "functional_call" else m(x)
        y.square().sum().backward()
        grads = [theirs[n].grad for n in sorted(theirs)] if case == "functional_call" else \
            [p.grad for _, p in sorted(m.named_parameters())]
        outs.append((y, grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-10, atol=1e-12)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_torch_func_transforms_take_a_packed_models_state_dict_names():
    """grad and vmap over functional_call with the state_dict's names (their tensors have no storage
    to compare with the rows'): the unpacked model's numbers, nothing left behind."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    net = _Fan([4, 8]).double()
    ref = copy.deepcopy(net)
    engine.group_kernels(net, "grouped", pack=True)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    sd = {k: v.detach().clone() for k, v in net.state_dict().items() if v.is_floating_point()}

    def loss(m):
        return lambda p: functional_call(m, p, (x,)).square().sum()

    ga, gb = grad(loss(net))(sd), grad(loss(ref))(sd)
    for k in sd:
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-9, atol=1e-12, msg=k)
    two = {k: torch.stack([v, v * 0.5]) for k, v in sd.items()}
    torch.testing.assert_close(vmap(lambda p: functional_call(net, p, (x,)))(two),
                               vmap(lambda p: functional_call(ref, p, (x,)))(two), rtol=1e-10, atol=1e-12)
    assert all(g.packed.overrides == 0 for g in engine.kernel_groups(net))


def test_a_packed_steps_weight_set_through_its_packed_parameter_too_is_given_back():
    """functional_call given the packed names and the state_dict's at once: each step is set back
    to what it read before the swap (a view of the passed packed tensor), which ends its override;
    a new nn.Parameter for a packed step's weight is refused (no optimizer or state_dict would see it)."""
    from torch.func import functional_call

    torch.manual_seed(0)
    net = _Fan([4, 8]).double()
    engine.group_kernels(net, "grouped", pack=True)
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    before = net(x).detach()
    both = {**{k: v.detach() * 0.5 for k, v in net.named_parameters()},
            **{k: v.detach() * 0.5 for k, v in net.state_dict().items() if v.is_floating_point()}}
    functional_call(net, both, (x,))
    assert all(g.packed.overrides == 0 for g in engine.kernel_groups(net))
    torch.testing.assert_close(net(x), before, rtol=0, atol=0)
    step = net.blocks[0].branches["kxk"].conv
    with pytest.raises(TypeError, match="cannot be replaced by a new nn.Parameter; unpack first"):
        step.weight = nn.Parameter(torch.zeros_like(step.weight))


@pytest.mark.parametrize("policy", ["grouped", "per-block"])
def test_fixed_kernels_passed_to_functional_call_are_the_ones_differentiated(policy):
    """Buffers (the fixed filters) passed with other values: the backward reads those, not the
    block's own that functional_call gave back before the backward ran."""
    from torch.func import functional_call

    torch.manual_seed(0)
    block = OREPAConv2d(4, 4, 3, padding=1, branches=("kxk", "1x1_avg", "1x1_prior")).double()
    with torch.no_grad():  # off the initial values (zero scales would hide the filters' part)
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    plain = copy.deepcopy(block)
    engine.group_kernels(nn.Sequential(block), policy)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    theirs = {n: (p.detach() * 2).requires_grad_() for n, p in block.named_parameters()}
    theirs.update((n, b * 2) for n, b in block.named_buffers())  # the filters: not in the state_dict
    functional_call(block, theirs, (x,)).square().sum().backward()
    with torch.no_grad():
        for n, t in [*plain.named_parameters(), *plain.named_buffers()]:
            t.copy_(theirs[n])
    plain(x).square().sum().backward()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(theirs[n].grad, p.grad, rtol=1e-9, atol=1e-12, msg=n)


def test_a_rep_1x1_group_builds_and_differentiates_its_kernels_in_few_operators():
    """Rep-1x1's 1x1 -> 1x1 branch of equal groups: per group the product of its two matrices is
    the kernel in its own layout, and both gradients are products on views (no reordered copies):
    a train step of two grouped Rep-1x1 blocks dispatches at most 32 operators (52 with the
    general dw -> pw evaluation, 42 with the views of the group's storage made at every step)."""
    from orepa.apps.bench.measure import count_ops

    torch.manual_seed(0)
    net = nn.Sequential(OREPAConv2d(8, 8, 1), OREPAConv2d(8, 8, 1))
    engine.group_kernels(net, "grouped", pack=True)
    x = torch.randn(1, 8, 4, 4)
    net(x).sum().backward()
    net.zero_grad(set_to_none=True)
    assert count_ops(lambda: net(x).sum().backward())[0] <= 32


@pytest.mark.parametrize("pack", [False, True])
def test_a_group_storage_keeps_its_views_and_a_new_storage_makes_its_own(pack):
    """The views a build takes of its group's storage are made once (kernels.keep_views) and read
    the storage's current values: steps after in-place updates, and after a conversion that
    makes a new storage, give the per-block numbers."""
    torch.manual_seed(0)
    a = nn.Sequential(OREPAConv2d(4, 4, 3, padding=1), OREPAConv2d(4, 8, 3, padding=1),
                      OREPAConv2d(8, 8, 1)).double()
    b = copy.deepcopy(a)
    engine.group_kernels(a, "per-block")
    groups = engine.group_kernels(b, "grouped", pack=pack)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for m in (a, b)]
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    storages = []
    for step in range(4):
        if step == 2:  # a new dtype: new storages, whose views are their own
            for m in (a, b):
                m.float()
            x = x.float()
        ya, yb = a(x), b(x)
        torch.testing.assert_close(yb, ya, **({"rtol": 1e-10, "atol": 1e-12} if step < 2 else {}))
        for y, opt in ((ya, opts[0]), (yb, opts[1])):
            opt.zero_grad(set_to_none=True)
            (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
            opt.step()
        stored = [g._storage for g in groups]
        assert all(any(st.kept) for st in stored)
        storages.append(stored)
    assert all(map(operator.is_, storages[0], storages[1]))  # kept across in-place updates
    assert not any(map(operator.is_, storages[1], storages[2]))  # remade for the new dtype
    # a storage and its views are freed with the model (nothing refers back to them)
    gone = [weakref.ref(t) for st in storages[0] + storages[-1] for t in st.roles]
    del a, b, m, groups, opts, storages, stored, ya, yb, y, opt
    gc.collect()
    assert not [r for r in gone if r() is not None]


def _arena(model):
    (arena,) = engine.kernel_groups(model)[0].workspace.arenas.values()
    return arena


def _in_arena(t, arena):
    """Whether ``t`` is a view of the arena's memory (its storage one of the arena's)."""
    return t.untyped_storage()._cdata in {st._cdata for st in arena.storages}


@pytest.mark.parametrize("pack", [False, True])
def test_a_groups_intermediates_live_in_a_workspace_freed_between_builds(pack):
    """The eager groups write their reordered copies and products into the network's workspace
    (engine.Workspace): its buffers are the same tensors at every step, nothing handed out (kernels,
    gradients) lives there, and the numbers are the per-block route's. Where the arena frees its
    memory between builds (a CUDA device's default, here on a CPU by its switch) the buffers
    keep their places and the next build takes the memory again: none held between steps."""
    ref, grouped = _pair(pack=pack)
    _assert_same_grads(ref, grouped)
    arena = _arena(grouped)
    assert not arena.frees and all(st.nbytes() > 0 for st in arena.storages)  # a CPU's default: kept
    arena.frees = True
    _assert_same_grads(ref, grouped)
    assert all(st.nbytes() == 0 for st in arena.storages) and arena.owner is None and not arena.lock.locked()
    assert sum(arena.elements) > 0
    bufs = [id(t) for sc in engine.kernel_groups(grouped)[0].workspace.scratches.values()
            for s in sc.values() for t in [*s.bufs.values(), *(u for b in s._branches.values() for u in b.bufs.values())]]
    assert bufs
    seen = []  # the kernels the blocks convolve with are not the arena's
    conv2d = F.conv2d

    def spy(x, w, *a, **k):
        seen.append(_in_arena(w, arena))
        return conv2d(x, w, *a, **k)

    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    engine.F.conv2d, saved = spy, engine.F.conv2d
    try:
        _assert_same_grads(ref, grouped, x)
    finally:
        engine.F.conv2d = saved
    assert len(seen) > 10 and not any(seen)
    group = engine.kernel_groups(grouped)[0]
    scratch = group.workspace.scratches[group.plan][(arena.base.device, arena.base.dtype), "backward"]
    assert _in_arena(next(t for (key, _), t in scratch.bufs.items() if key == "grad"), arena)  # the check sees it
    for p in grouped.parameters():  # no gradient is a view of the (freed) arena
        assert p.grad is not None and not _in_arena(p.grad, arena)
    assert [id(t) for sc in engine.kernel_groups(grouped)[0].workspace.scratches.values()
            for s in sc.values() for t in [*s.bufs.values(), *(u for b in s._branches.values()
                                                               for u in b.bufs.values())]] == bufs


def test_the_workspace_saves_the_views_and_allocations_of_a_groups_eager_step():
    """The same step without a workspace (the evaluation that allocates its intermediates)
    dispatches more operators (measured on this model, packed, float64: 977 against 825) for the
    same gradients."""
    from orepa.apps.bench.measure import count_ops

    ref, grouped = _pair(pack=True)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    _grads(grouped, x)
    with_ws = count_ops(lambda: _grads(grouped, x))[0]
    y1, g1 = _grads(grouped, x)
    for g in engine.kernel_groups(grouped):
        g.workspace = None
    _grads(grouped, x)
    without = count_ops(lambda: _grads(grouped, x))[0]
    y0, g0 = _grads(grouped, x)
    assert with_ws < 0.85 * without, (with_ws, without)
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-10, atol=1e-12, msg=k)


def test_two_forwards_before_one_backward_and_a_failed_build_leave_the_workspace_sound():
    """Builds share the workspace one after the other: two forwards then one backward give the
    per-block gradients; a build that raises leaves the arena unlocked and readable (a traceback
    may show its buffers), and the next build runs."""
    ref, grouped = _pair()
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    for m in (ref, grouped):
        m.zero_grad(set_to_none=True)
        (m(x).square().sum() + m(x.flip(-1)).square().sum()).backward()
    for (n, p), q in zip(grouped.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-10, msg=n)
    arena = _arena(grouped)
    arena.frees = True  # as on a CUDA device
    plan = engine.kernel_groups(grouped)[0].plan
    squeeze = engine.Plan.squeeze

    def failing(self, *a, **k):
        if self is plan:
            raise RuntimeError("boom")
        return squeeze(self, *a, **k)

    engine.Plan.squeeze = failing
    try:
        with pytest.raises(RuntimeError, match="boom"):
            grouped(x)
    finally:
        engine.Plan.squeeze = squeeze
    assert not arena.lock.locked() and arena.owner is None
    assert all(st.nbytes() > 0 for st in arena.storages)  # not freed after the failure
    _assert_same_grads(ref, grouped, x)
    assert all(st.nbytes() == 0 for st in arena.storages)


def test_copies_of_a_grouped_model_get_a_workspace_of_their_own():
    """deepcopy and pickling (torch.save) give an empty workspace, shared by the copy's groups;
    a dtype change builds in an arena of its own."""
    import io

    ref, grouped = _pair()
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    _assert_same_grads(ref, grouped, x)
    buf = io.BytesIO()
    torch.save(grouped, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(grouped), torch.load(buf, weights_only=False)):
        spaces = {id(g.workspace) for g in engine.kernel_groups(twin)}
        assert len(spaces) == 1 and spaces != {id(engine.kernel_groups(grouped)[0].workspace)}
        assert not engine.kernel_groups(twin)[0].workspace.arenas
        _assert_same_grads(ref, twin, x)
    grouped.float()
    grouped(x.float()).sum().backward()
    arenas = engine.kernel_groups(grouped)[0].workspace.arenas
    assert {k[1] for k in arenas} == {torch.float64, torch.float32}
    # the float64 arena (kept between builds on a CPU) let its memory go when the float32 one came
    assert all(st.nbytes() == 0 for k, a in arenas.items() if k[1] == torch.float64 for st in a.storages)
    assert all(st.nbytes() > 0 for k, a in arenas.items() if k[1] == torch.float32 for st in a.storages)


# --------------------------------------------------------------------------- recorded (graphed) builds


class _Rerun(UnreplayedRecorder):
    """A recorder that replays by running the recorded function again into the outputs it returned
    first (a CUDA graph rewrites its outputs from the tensors it read): what GraphedBuild hands the
    recordings in and takes out of them is checked on any device. Counts replays."""

    recorded: list = []
    replays = 0

    def record(self, fn):
        outputs = fn()
        type(self).recorded.extend(outputs)

        def replay():
            type(self).replays += 1
            for out, new in zip(outputs, fn()):
                out.copy_(new)

        return replay, outputs


def _recorded(model, policy="grouped", pack=False, joint=True, recorder=None):
    groups = engine.group_kernels(model, policy, pack=pack, joint=joint, graphs=True)
    recorder = recorder or type("Rec", (_Rerun,), {"recorded": [], "replays": 0})
    record_builds(model, recorder)
    return groups, recorder


def _assert_same_state(a, b, tol=1e-10):
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize("pack,joint", [(False, True), (True, True), (True, False)])
def test_a_recorded_build_replays_one_recording_per_node_and_trains_as_the_per_block_route(pack, joint):
    """graphs=True: each group's construction is recorded once, forward and vjp, and each step
    replays each once, in one node for the network (joint) or one per group; three SGD steps give
    the per-block route's parameters and BN statistics."""
    ref, grouped = _pair()
    groups, rec = _recorded(grouped, pack=pack, joint=joint)
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    for m in (ref, grouped):
        _sgd_steps(m, x, steps=3)
    _assert_same_state(ref, grouped)
    leaders = [g for g in groups if g._graphed_for is not None]
    assert len(leaders) == (1 if joint else len(groups)) and all(g._recordings == 1 for g in groups)
    assert {len(g._graphed_for[1].recordings) for g in leaders} == ({len(groups)} if joint else {1})
    assert rec.replays == 2 * 3 * len(groups)


def test_recorded_kernels_and_gradients_are_copies_and_gradients_accumulate():
    """What a replay writes is copied out: the kernels blocks get and the gradients autograd gets
    share no memory with the recording's outputs, so two forwards and their backwards in turn
    (micro-batches) accumulate the per-block gradients; a build's kernels stay as they were after
    a later build."""
    ref, grouped = _pair()
    groups, rec = _recorded(grouped, pack=True)
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    (_, g0), (_, g1) = _grads(ref, x, x.flip(-1)), _grads(grouped, x, x.flip(-1))
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-7, atol=1e-10, msg=k)
    outputs = {t.untyped_storage().data_ptr() for t in rec.recorded}
    assert not {p.grad.untyped_storage().data_ptr() for p in grouped.parameters()} & outputs
    engine._build_groups(groups)
    first = [k for g in groups for _, k in g._pending.values()]
    assert not {k.untyped_storage().data_ptr() for k in first} & outputs
    kept = [k.clone() for k in first]
    with torch.no_grad():
        for p in grouped.parameters():
            p.mul_(1.5)
    for g in groups:
        g._pending = {}
    engine._build_groups(groups)  # a replay from the changed parameters
    assert any(not torch.equal(k, v) for g in groups for (_, k), v in zip(g._pending.values(), kept))
    for k, v in zip(first, kept):
        assert torch.equal(k, v)


def test_a_recorded_group_records_again_when_its_tensors_move_and_stops_after_a_few():
    """Parameters given new memory (load_state_dict(assign=True), as a device move does) make the
    group record its build anew for the new storage, with the right numbers; a group whose tensors
    keep moving stops recording with one warning and builds as before."""
    ref, grouped = _pair()
    groups, rec = _recorded(grouped)
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    _assert_same_grads(ref, grouped, x)
    leader = groups[0]
    for moves in range(1, engine._MAX_RECORDINGS):
        grouped.load_state_dict({k: v.clone() for k, v in grouped.state_dict().items()}, assign=True)
        _assert_same_grads(ref, grouped, x)
        assert all(g._recordings == moves + 1 for g in groups)
    grouped.load_state_dict({k: v.clone() for k, v in grouped.state_dict().items()}, assign=True)
    with pytest.warns(RuntimeWarning, match="kernel graphs: the group's parameters moved 4 times"):
        _assert_same_grads(ref, grouped, x)
    assert leader._graphs_off and leader._recordings == engine._MAX_RECORDINGS
    replays = rec.replays
    _assert_same_grads(ref, grouped, x)
    assert rec.replays == replays


def test_a_failed_recording_warns_and_the_group_builds_without_graphs():
    class Failing(_Rerun):
        def record(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing\ndetail")

    ref, grouped = _pair()
    groups, _ = _recorded(grouped, recorder=Failing)
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="recording the kernel construction failed .RuntimeError: operation "
                                            "not permitted when stream is capturing.; the kernels are built without"):
        _assert_same_grads(ref, grouped, x)
    assert groups[0]._graphs_off and groups[0]._graphed_for is None
    _assert_same_grads(ref, grouped, x)


def test_graphs_where_the_recorder_cannot_record_build_as_before_and_copies_record_their_own():
    """On a CPU (the CUDA recorder supports CUDA tensors outside a capture only) graphs=True builds
    as without; a deep copy or pickle of a recorded model holds no recording and makes its own."""
    import io

    ref, grouped = _pair()
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    plain = copy.deepcopy(grouped)
    groups = engine.group_kernels(plain, "grouped", graphs=True)
    assert groups[0].graph_recorder is engine.CudaGraphRecorder and not engine.CudaGraphRecorder.supports(x)
    _assert_same_grads(ref, plain, x)
    assert all(g._graphed_for is None and g._recordings == 0 for g in groups)
    _recorded(grouped, recorder=_Rerun)  # a class pickles by name
    _assert_same_grads(ref, grouped, x)
    buf = io.BytesIO()
    torch.save(grouped, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(grouped), torch.load(buf, weights_only=False)):
        twin_groups = engine.kernel_groups(twin)
        assert all(g._graphed_for is None and g.graphs for g in twin_groups)
        _assert_same_grads(ref, twin, x)
        assert twin_groups[0]._graphed_for is not None
    _Rerun.recorded.clear()


def test_a_recorded_step_dispatches_little_more_than_base_besides_its_replays():
    """With its builds recorded, what an eager OREPA step issues from the host besides the two
    replays (a recorder whose replays do nothing: a CUDA graph's issue no operator) is base's
    step plus the copies in and out of the recordings (one ``_foreach_clone`` per group each way,
    one ``_foreach_copy_``) and the packed parameters' accumulations: measured 1.08x base's
    operators and 1.10x its kernels (ResNet-18 b64, benchmarks/aten_ops.py; the eager groups 1.79x
    and 2.18x)."""
    from orepa.apps.bench.measure import count_ops, make_runner

    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    ops, kernels = {}, {}
    for spec in ("base", "orepa:builder=grouped"):
        # (at a quarter width: the counts are full width's, 295 and 325 operators, in a seventh of the time)
        r = make_runner("resnet18", spec, device=torch.device("cpu"), num_classes=10,
                        model_options={"width_mult": 0.25})
        record_builds(r.model)
        r.step(x, y)
        ops[spec], kernels[spec] = count_ops(lambda r=r: r.step(x, y))
    assert engine.kernel_groups(r.model)[0]._graphed_for is not None
    assert ops["orepa:builder=grouped"] <= 1.15 * ops["base"], ops
    assert kernels["orepa:builder=grouped"] <= 1.15 * kernels["base"], kernels


def test_the_cuda_recorder_captures_on_its_devices_stream_and_replays_there(monkeypatch):
    """No GPU here: torch.cuda's graph API stood in for, each call bound to the real signature.
    The recorder warms up and captures on its own stream inside its device's guard, into its
    pool, and replays inside that guard too (a capture records only its device's stream)."""
    import contextlib
    import inspect

    calls = []
    real_graph = inspect.signature(torch.cuda.graph)

    @contextlib.contextmanager
    def device(d):
        calls.append(("device", d))
        yield

    class Stream:
        def __init__(self, *args, **kwargs):
            inspect.signature(torch.cuda.Stream).bind(*args, **kwargs)

        def wait_stream(self, other):
            calls.append("wait")

    class Graph:
        def replay(self):
            calls.append("replay")

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        bound = real_graph.bind(*args, **kwargs).arguments
        calls.append(("capture", bound["pool"], type(bound["stream"]).__name__, bound["capture_error_mode"]))
        yield

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    dev = torch.device("cuda", 1)
    rec = engine.CudaGraphRecorder(dev)
    rec.warm(lambda: calls.append("warm-up"))
    replay, outputs = rec.record(lambda: (torch.ones(2),))
    assert torch.equal(outputs[0], torch.ones(2))
    replay()
    assert calls == [("device", dev), "wait", "warm-up", "wait", ("device", dev),
                     ("capture", "pool", "Stream", "thread_local"), ("device", dev), "replay"]


class _Copies(TorchDispatchMode):
    """The multi-tensor copies dispatched under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket is torch.ops.aten._foreach_copy_
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("pack", [False, True])
def test_recordings_share_one_buffer_for_their_outputs_and_one_for_their_gradients_in(pack):
    """Every recording's kernels and gradients are views of the network's one output buffer, and its
    kernels' gradients in of one input buffer, each sized for the largest group instead of all of
    them; recorded_bytes is the recorders' pools (a stand-in's: none) and those buffers. An eager
    packed construction writes its gradients into their rows as it makes them (no copy at the end
    of its graph), and every eager construction its kernels where they are handed out from (none at
    the end of its forward graph either). The numbers: the other recorded tests."""
    _, grouped = _pair()
    assert engine.recorded_bytes(grouped) == 0
    groups, _ = _recorded(grouped, pack=pack)
    grouped(torch.randn(2, 3, 32, 32, dtype=torch.float64)).sum().backward()
    recordings = [g._recording for g in groups]
    cpu = torch.device("cpu")
    outputs, inputs = (groups[0].workspace.recording_buffer(cpu, use).buffer for use in ("outputs", "gradients in"))
    for buffer, ts, need in ((outputs, [t for rec in recordings for t in (*rec.kernels, *rec.grads)], "_output_bytes"),
                             (inputs, [t for rec in recordings for t in rec.grads_in], "_input_bytes")):
        assert {t.untyped_storage().data_ptr() for t in ts} == {buffer.untyped_storage().data_ptr()}
        assert buffer.nbytes == max(getattr(g, need)() for g in groups) < 0.7 * sum(t.nbytes for t in ts)
    assert engine.recorded_bytes(grouped) == outputs.nbytes + inputs.nbytes
    for rec in recordings:
        with _Copies() as copies:
            rec.forward()  # the stand-in's replay runs the recorded function
        assert copies.count == 0
        with _Copies() as copies:
            rec.backward()
        assert copies.count == (0 if pack else 1)


@pytest.mark.parametrize("pack,bound", [(True, 2.25), (False, 5.0)])
def test_a_recorded_construction_holds_few_temporaries_at_once(pack, bound):
    """The pool of a network's CUDA graphs is as large as the most their captures hold alive at once
    (PoolEstimator follows every tensor they allocate). An eager construction writes its kernels
    where they are handed out from and drops each temporary once used, so at most about two copies
    the size of the largest group's kernels live at once where parameters are packed (their
    gradients then written into the outputs too). Before: 3.8x packed, 6.2x unpacked."""
    torch.manual_seed(0)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125).double()
    groups = engine.group_kernels(model, "grouped", pack=pack, graphs=True)
    record_builds(model, PoolEstimator)
    model(torch.randn(2, 3, 32, 32, dtype=torch.float64)).sum().backward()
    peak = groups[0].workspace.recorder(PoolEstimator, torch.device("cpu")).live.peak
    assert 0 < peak <= bound * max(g._input_bytes() for g in groups)


class _Capturing(_Rerun):
    """A recorder that cannot record now (as inside another CUDA-graph capture)."""

    @staticmethod
    def supports(t):
        return False


def test_recorded_groups_where_they_cannot_record_run_their_own_builds_in_turn():
    """Where the recorder cannot record (inside a whole-step capture), a recorded network builds each
    group with its own build in turn (engine.ChainedBuild), with the per-block numbers."""
    ref, grouped = _pair(pack=True)
    groups, _ = _recorded(grouped, recorder=_Capturing)
    chained = []
    builder = engine.KernelGroup._builder
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    try:
        engine.KernelGroup._builder = lambda self, *a: chained.append(builder(self, *a)) or chained[-1]
        _assert_same_grads(ref, grouped, x)
    finally:
        engine.KernelGroup._builder = builder
    assert [type(b).__name__ for b in chained] == ["ChainedBuild"]
    assert len(chained[0].builds) == len(groups) and all(g._recordings == 0 for g in groups)


@pytest.mark.slow
def test_a_recorded_compiled_network_compiles_per_group_and_nothing_where_it_cannot_record(monkeypatch):
    """Policy compiled with graphs: each group's recording compiles that group's construction; where
    the network cannot record (a whole-step capture), its groups run those compiled builds in turn,
    so nothing compiles there (a compilation inside a capture would fail)."""
    # _TWO_BRANCHES: what is compiled where does not depend on the branches (each group compiles on its own here)
    # (the engine's calls of the compiler counted, their graphs run as traced: not inductor's code)
    a, b, calls = _compiled_pair(monkeypatch, branches=_TWO_BRANCHES, compile_graph=_run_traced)
    groups, rec = _recorded(b, policy="compiled")
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    opt = torch.optim.SGD(a.parameters(), lr=0.0)
    (ya, ga), (yb, gb) = _step(a, opt, x), _step(b, torch.optim.SGD(b.parameters(), lr=0.0), x)
    assert len(calls) == 2 * len(groups) and rec.replays == 2 * len(groups)
    for g in groups:
        g.graph_recorder = _Capturing
    (yc, gc) = _step(b, torch.optim.SGD(b.parameters(), lr=0.0), x)
    assert len(calls) == 2 * len(groups)  # nothing compiled anew
    for y, grads in ((yb, gb), (yc, gc)):
        torch.testing.assert_close(y, ya, rtol=1e-10, atol=1e-12)
        for k in ga:
            torch.testing.assert_close(grads[k], ga[k], rtol=1e-9, atol=1e-12, msg=k)


def test_recorded_builds_under_ddp_give_the_per_block_numbers(tmp_path):
    """DistributedDataParallel (one gloo process; torchrun's nodes: one per group) over recorded
    builds: its reducer takes the gradients the replays hand autograd, and two SGD steps give the
    per-block route's parameters."""
    import torch.distributed as dist

    ref, grouped = _pair()
    _recorded(grouped, pack=True, joint=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(grouped)
        x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
        for m in (ref, ddp):
            _sgd_steps(m, x)
    finally:
        dist.destroy_process_group()
    _assert_same_state(ref, grouped)
    assert all(g._recordings == 1 for g in engine.kernel_groups(grouped))


class _TwoHeads(nn.Module):
    """A trunk and two heads of one signature (one kernel group); a step trains one head."""

    def __init__(self, head_kernel: int = 3):
        super().__init__()
        self.trunk = nn.Sequential(OREPAConv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.head_a = nn.Sequential(OREPAConv2d(8, 8, 3), nn.BatchNorm2d(8))
        self.head_b = nn.Sequential(OREPAConv2d(8, 8, head_kernel), nn.BatchNorm2d(8))

    def forward(self, x, head):
        return getattr(self, "head_" + head)(self.trunk(x))


@pytest.mark.parametrize("pack,joint,head_kernel", [(False, True, 3), (False, False, 3), (True, True, 5),
                                                    (True, False, 5)])
def test_a_block_the_loss_does_not_reach_gets_no_gradient(pack, joint, head_kernel):
    """The group's node handed every block's parameters a gradient, zeros for a head left out of the
    step: weight decay and momentum then moved it (3e-2 after three SGD steps) where each block
    built alone leaves it (None: the optimizer skips it). A packed group whose blocks all sit out
    gets None too (one whose blocks partly do cannot: its rows are one tensor; documented)."""
    torch.manual_seed(0)
    model = _TwoHeads(head_kernel).double()
    engine.group_kernels(model, "grouped", pack=pack, joint=joint)
    before, trained = copy.deepcopy(model.head_b.state_dict()), copy.deepcopy(model.head_a.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    x = torch.randn(2, 3, 10, 10, dtype=torch.double)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            opt.zero_grad()
            model(x, "a").square().mean().backward()
            opt.step()
    assert all(p.grad is None for p in model.head_b.parameters() if p.requires_grad)
    for key, value in model.head_b.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not torch.equal(model.head_a.state_dict()["0.branches.kxk.conv.weight"],
                           trained["0.branches.kxk.conv.weight"])  # the head in the loss trained


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("tie", ["parameter", "module"])
def test_blocks_with_tied_weights_build_alone_and_stay_exact(pack, tie):
    """Two blocks of one signature sharing a branch's weight: the group's storage held its rows once
    per block and the parameter read the second copy, so the first block's kernel stayed at the
    first step's weights (2.6 off after one SGD step); packed, the tie was cut. Such blocks are left
    out of groups (built block by block) and train as the ungrouped model does."""
    def make():
        torch.manual_seed(0)
        a, b = OREPAConv2d(4, 4, 3), OREPAConv2d(4, 4, 3)
        if tie == "parameter":
            b.branches["kxk"].conv.weight = a.branches["kxk"].conv.weight
        else:
            b.branches["kxk"].conv = a.branches["kxk"].conv
        return nn.ModuleList([a, b, OREPAConv2d(4, 4, 3)]).double()

    ref, grouped = make(), make()
    engine.group_kernels(ref, "per-block")
    groups = engine.group_kernels(grouped, "grouped", pack=pack)
    assert [g.block_names for g in groups] == [("2",)]  # the untied block alone is grouped
    x = torch.randn(2, 4, 8, 8, dtype=torch.double)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, grouped)]
    for _ in range(3):
        for m, opt in zip((ref, grouped), opts):
            opt.zero_grad()
            sum(blk(x).square().mean() for blk in m).backward()
            opt.step()
    for (key, want), got in zip(ref.state_dict().items(), grouped.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=key)
    assert grouped[0].branches["kxk"].conv.weight is grouped[1].branches["kxk"].conv.weight  # still tied
    for blk, twin in zip(grouped, ref):  # a training forward after the steps: the kernels of the weights now
        torch.testing.assert_close(blk(x), twin(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pack", [False, True])
def test_grouping_a_part_of_a_grouped_network_leaves_the_rest_grouped_without_it(pack):
    """The root's earlier groups still listed the part's blocks: packed, the next training forward
    failed (KeyError: 'weight'), unpacked every step concatenated the storages again and built 27
    kernels for 17 blocks. The rest keeps its groups (settings, names) without the part's blocks."""
    ref, model = _pair()
    engine.group_kernels(model, "grouped", pack=True)
    groups = engine.group_kernels(model.layer3, "grouped", pack=pack)
    assert {name.split(".")[0] for g in groups for name in g.block_names} == {"0", "1"}  # named under layer3
    everyone = engine.kernel_groups(model)
    outer = [g for g in everyone if g not in groups]
    assert outer and all(g.packed is not None and g.peers is outer[0].peers for g in outer)
    blocks = [b for g in everyone for b in g.blocks]
    assert len(blocks) == len({id(b) for b in blocks}) == sum(1 for m in model.modules() if hasattr(m, "_kernel_group")
                                                               and m._closed_form)
    assert not any(n.startswith("layer3.") for g in outer for n in g.block_names)
    x = torch.randn(2, 3, 32, 32, dtype=torch.double)
    for _ in range(2):  # the second: from the storages the first made
        y_ref, g_ref = _grads(ref, x)
        y, g = _grads(model, x)
        tol_close(y, y_ref, rel=1e-12)
        for key, want in g_ref.items():
            tol_close(g[key].reshape(want.shape), want, rel=1e-10)


def test_a_tensor_set_as_a_packed_weight_is_what_state_dict_saves_until_a_load():
    """A plain tensor assigned to a packed step's weight is read in place of its rows (as
    functional_call's swap is): the state_dict saved the rows all the same, so a model reloaded from
    its own state_dict computed something else (1.45 off). It saves what the step reads; a load
    puts the value into the rows and ends the substitution."""
    torch.manual_seed(0)
    net = nn.Sequential(OREPAConv2d(4, 4, 3), nn.BatchNorm2d(4), OREPAConv2d(4, 4, 3), nn.BatchNorm2d(4)).double()
    engine.group_kernels(net, "grouped", pack=True)
    step = net[2].branches["kxk"].conv
    step.weight = torch.zeros_like(step.weight)
    x = torch.randn(2, 4, 8, 8, dtype=torch.double)
    sd = net.state_dict()
    assert not sd["2.branches.kxk.conv.weight"].any()
    torch.manual_seed(1)
    fresh = nn.Sequential(OREPAConv2d(4, 4, 3), nn.BatchNorm2d(4), OREPAConv2d(4, 4, 3), nn.BatchNorm2d(4)).double()
    fresh.load_state_dict(sd)
    net.eval(), fresh.eval()
    tol_close(fresh(x), net(x), rel=1e-12)
    net.load_state_dict(fresh.state_dict())  # into the rows: the substitution ends
    assert step.__dict__["_packed"].overridden is None and not step.weight.any() and step.weight.requires_grad


def _stale_optimizer_warnings(record) -> int:
    return sum("holds parameters that" in str(w.message) for w in record)


# (no "auto": on a CPU it is "per-block" wherever the engine reads a policy, builds_together)
@pytest.mark.parametrize("policy", ["grouped", "per-block"])
@pytest.mark.parametrize("regroup", ["once", "unpacked after", "twice"])
def test_an_optimizer_made_before_packing_is_warned_of_once(policy, regroup):
    """Packing takes the steps' parameters out of the model: an optimizer made before holds tensors
    that never get a gradient, and the online blocks would not train, silently. Warned once per
    network by the grouping, whatever route the blocks take (a CPU's ``auto`` and ``per-block`` build
    no group: they were not), also where the model is grouped again before a step (the first
    packing's parameters were forgotten); made after, no warning."""
    x = torch.randn(2, 3, 16, 16)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.0625)
    if regroup == "unpacked after":  # packed, its optimizer made, then regrouped unpacked: stale again
        engine.group_kernels(model, policy, pack=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine.group_kernels(model, policy, pack=regroup != "unpacked after")
        if regroup == "twice":
            engine.group_kernels(model, policy, pack=True)
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert _stale_optimizer_warnings(said) == 1, [str(w.message) for w in said]
    assert "made before group_kernels(model, policy, pack=" in str(said[0].message)
    assert said[0].filename == __file__  # said at the user's call
    # (what the warning is about: the optimizer's tensors of the online blocks never moved)
    assert sum(torch.equal(a, p) for a, p in zip(before, opt.param_groups[0]["params"])) >= 20
    del opt
    right = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.0625)
    engine.group_kernels(right, policy, pack=True)
    if regroup != "once":
        engine.group_kernels(right, policy, pack=regroup == "twice")
    opt = torch.optim.SGD(right.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        right(x).sum().backward()
        opt.step()
        right(x).sum().backward()


def test_an_optimizer_made_after_packing_of_parameters_listed_before_is_warned_of_at_the_first_step():
    """Parameters listed before packing (a framework's parameter groups) and the optimizer made of
    them after: the grouping finds no optimizer yet, the first training forward does."""
    x = torch.randn(2, 3, 32, 32)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125)
    listed = [{"params": list(model.parameters()), "weight_decay": 0.0}]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine.group_kernels(model, "per-block", pack=True)
        assert _stale_optimizer_warnings(said) == 0
        opt = torch.optim.SGD(listed, lr=0.1)
        with torch.no_grad():
            model.eval()(x)  # (not a training forward)
        assert _stale_optimizer_warnings(said) == 0
        for _ in range(2):
            model.train()(x).sum().backward()
    assert _stale_optimizer_warnings(said) == 1 and opt is not None
    assert model._forward_pre_hooks and not next(iter(model._forward_pre_hooks.values())).workspace.replaced


def test_an_optimizer_deleted_before_packing_is_not_warned_of_though_a_cycle_held_it():
    """An optimizer deleted while a reference cycle holds it lives on until the collector runs: the
    search for stale optimizers, which collects only once it has found one, must not warn of it
    (the grouping or its first training forward), nor of the parameters the cycle kept alive."""
    import gc

    x = torch.randn(2, 3, 32, 32)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.itself = opt  # a cycle: only the collector frees it
    gc.disable()  # (no automatic collection between here and the check)
    try:
        del opt
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            engine.group_kernels(model, "grouped", pack=True)
            model.train()(x).sum().backward()
    finally:
        gc.enable()
    assert _stale_optimizer_warnings(said) == 0, [str(w.message) for w in said]


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("write", ["data_in_place", "data_assigned", "to_float"])
def test_kernels_built_ahead_do_not_outlive_a_call_that_stopped_short_of_their_blocks(pack, write):
    """A call that runs part of a grouped network (a submodule probed alone, a forward that stopped
    halfway) builds every group's kernels ahead; weights written after it without a version count
    (through ``.data``, by ``.to()``) must not meet those kernels: the root's next forward builds
    anew and gives the per-block numbers (they were up to 0.9 off; ``.float()`` raised a dtype error)."""
    torch.manual_seed(0)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125).double()
    ref = copy.deepcopy(model)
    engine.group_kernels(ref, "per-block")
    engine.group_kernels(model, "grouped", pack=pack)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    model.conv1(x)  # the stem alone: the kernels of every group are built ahead
    assert any(g._pending for g in engine.kernel_groups(model))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1 and write == "data_in_place":
                p.data.mul_(0.5)
            elif p.ndim > 1 and write == "data_assigned":
                p.data = p.data * 0.5
    ref.load_state_dict(model.state_dict())
    if write == "to_float":
        model.float(), ref.float()
        x = x.float()
    tol = dict(rtol=1e-4, atol=1e-4) if write == "to_float" else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model(x), ref(x), **tol)


def test_a_functional_call_with_detached_tensors_is_not_a_freeze_after_packing():
    """``functional_call`` with detached copies of a packed model's parameters (torch.func's idiom)
    freezes nothing: no warning, and a real freeze afterwards is still warned of."""
    x = torch.randn(2, 3, 32, 32)
    model = orepa.create_model("resnet18", "orepa", num_classes=10, width_mult=0.125)
    engine.group_kernels(model, "grouped", pack=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.func.functional_call(model, {k: v.detach() for k, v in model.named_parameters()}, (x,))
    model.layer3.requires_grad_(False)
    with pytest.warns(UserWarning, match="frozen or unfrozen after packing"):
        model(x).sum().backward()


def test_a_copy_of_blocks_whose_grouped_root_was_dropped_copies():
    """timm's ``features_only`` keeps the children of the model it built, dropping that root and
    the dicts of its hooks: a deep copy of the blocks (an EMA, a detector's copy) failed on the
    hooks' handles ("cannot create weak reference to 'NoneType' object")."""
    root = nn.Sequential(nn.Sequential(OREPAConv2d(4, 4, 3, padding=1), OREPAConv2d(4, 4, 3, padding=1)))
    engine.group_kernels(root, "grouped")
    kept = root[0]
    del root
    gc.collect()
    twin = copy.deepcopy(kept)
    x = torch.randn(1, 4, 6, 6)
    torch.testing.assert_close(twin(x), kept(x))


@pytest.mark.parametrize("kind", ["orepa-vgg", "deep stem"])
def test_a_deployed_network_of_nesting_blocks_carries_no_engine_hook(kind):
    """OREPA-VGG's blocks and the deep stem nest the online blocks that are grouped: deploying them
    left the grouped root's pre-hook (and through it the training-form blocks) on the deployed
    model, which TorchScript refused ("'functools.partial' object has no attribute '__name__'")."""
    torch.manual_seed(0)
    if kind == "orepa-vgg":
        net = orepa.convert(nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)), "orepa-vgg")
    else:
        net = nn.Sequential(orepa.OREPADeepStem(3, 8, 7, 2), nn.BatchNorm2d(8))
        engine.group_kernels(net)
    assert net._forward_pre_hooks
    deployed = orepa.reparameterize(net.eval(), fuse_bn=True)
    assert _scope_hooks(deployed) == [] and not any(hasattr(m, "_kernel_group") for m in deployed.modules())
    x = torch.randn(2, net[0].in_channels, 12, 12)
    torch.testing.assert_close(torch.jit.script(deployed)(x), net(x), rtol=1e-4, atol=1e-5)
