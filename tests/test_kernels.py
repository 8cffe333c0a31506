"""Kernel algebra against running the layers on feature maps, in float64."""
import math

import pytest
import torch
import torch.nn.functional as F

from orepa import kernels as K


@pytest.fixture(autouse=True)
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def run_seq(x, layers, pad):
    """Apply convs (weight, groups) in sequence on x zero-padded once by `pad`."""
    h = F.pad(x, (pad,) * 4)
    for w, g in layers:
        h = F.conv2d(h, w, groups=g)
    return h


def close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max().item() <= tol * (1 + b.abs().max().item())


def test_pad_to_centres_1x1():
    w = torch.randn(4, 3, 1, 1)
    p = K.pad_to(w, 5)
    assert p.shape == (4, 3, 5, 5)
    assert torch.equal(p[:, :, 2, 2], w[:, :, 0, 0])
    assert p.abs().sum() == w.abs().sum()
    x = torch.randn(2, 3, 9, 9)
    close(F.conv2d(x, p, padding=2), F.conv2d(x, w))
    with pytest.raises(ValueError):
        K.pad_to(torch.randn(1, 1, 3, 3), 4)
    # per axis: a 1x3 inside 5x3, a 1x1 inside 1x7
    w = torch.randn(4, 3, 1, 3)
    p = K.pad_to(w, (5, 3))
    assert p.shape == (4, 3, 5, 3) and torch.equal(p[:, :, 2:3], w) and p.abs().sum() == w.abs().sum()
    close(F.conv2d(x, p, padding=(2, 1)), F.conv2d(x, w, padding=(0, 1)))
    assert K.pad_to(torch.ones(1, 1, 1, 1), (1, 7))[0, 0, 0].tolist() == [0, 0, 0, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="cannot centre-pad a 1x3 kernel to 3x1"):
        K.pad_to(w, (3, 1))


@pytest.mark.parametrize("groups", [1, 2, 6])
@pytest.mark.parametrize("k", [1, 3, (1, 5)])
def test_identity_kernel(groups, k):
    x = torch.randn(2, 6, 7, 7)
    w = K.identity_kernel(6, groups, k)
    kh, kw = (k, k) if isinstance(k, int) else k
    close(F.conv2d(x, w, padding=(kh // 2, kw // 2), groups=groups), x)


def test_identity_init_1x1_matches_paper_rule():
    w = K.identity_init_1x1(8, 4)[:, :, 0, 0]
    for o in range(8):
        for i in range(4):
            assert w[o, i] == (1.0 if o / 8 == i / 4 else 0.0)
    x = torch.randn(1, 4, 3, 3)
    close(F.conv2d(x, K.identity_init_1x1(4, 4, groups=2), groups=2), x)


@pytest.mark.parametrize("k", [3, 5, 7, (1, 7), (5, 3)])
def test_avg_pool_kernel_equals_avg_pool(k):
    x = torch.randn(2, 5, 11, 11)
    w = K.avg_pool_kernel(5, k)
    pad = (k // 2, k // 2) if isinstance(k, int) else (k[0] // 2, k[1] // 2)
    ref = F.avg_pool2d(x, k, stride=1, padding=pad, count_include_pad=True)
    close(F.conv2d(x, w, padding=pad, groups=5), ref)


@pytest.mark.parametrize("k", [3, 5, 7, 9])
@pytest.mark.parametrize("c", [6, 7])
def test_freq_prior_formula_any_odd_k(k, c):
    w = K.freq_prior_kernel(c, k)
    assert w.shape == (c, 1, k, k)
    half = c / 2  # the paper's real half: half-integer frequencies for odd c
    for ch in range(c):
        for h in range(k):
            for v in range(k):
                if ch < half:
                    ref = math.cos((ch + 1) * (h + 0.5) * math.pi / k)
                else:
                    ref = math.cos((ch - half + 1) * (v + 0.5) * math.pi / k)
                assert abs(w[ch, 0, h, v].item() - ref) < 1e-12
    # first half varies along rows only, second half along columns only
    first = math.ceil(half)  # channels c < C / 2
    assert torch.allclose(w[:first], w[:first, :, :, :1].expand_as(w[:first]))
    assert torch.allclose(w[first:], w[first:, :, :1, :].expand_as(w[first:]))


@pytest.mark.parametrize("kh,kw", [(1, 7), (7, 1), (3, 5)])
def test_freq_prior_of_a_non_square_kernel_takes_each_axis_own_length(kh, kw):
    """Rows: cos((c + 1)(h + 0.5) pi / kh); columns: cos((c - C/2 + 1)(w + 0.5) pi / kw)."""
    c = 6
    w = K.freq_prior_kernel(c, (kh, kw), dtype=torch.float64)
    assert w.shape == (c, 1, kh, kw)
    for ch in range(c):
        for h in range(kh):
            for v in range(kw):
                ref = (math.cos((ch + 1) * (h + 0.5) * math.pi / kh) if ch < c // 2
                       else math.cos((ch - c // 2 + 1) * (v + 0.5) * math.pi / kw))
                assert abs(w[ch, 0, h, v].item() - ref) < 1e-12
    assert torch.equal(K.freq_prior_kernel(c, (5, 5)), K.freq_prior_kernel(c, 5))  # a square pair: the same


@pytest.mark.parametrize(
    "c0,c1,c2,k1,k2,g",
    [(3, 5, 4, 3, 3, 1), (4, 6, 8, 1, 3, 2), (4, 4, 6, 3, 1, 2), (6, 6, 6, 3, 5, 3), (2, 3, 2, 5, 3, 1), (4, 8, 4, 3, 3, 4)],
)
def test_compose_same_groups_equals_sequential_convs(c0, c1, c2, k1, k2, g):
    w1 = torch.randn(c1, c0 // g, k1, k1)
    w2 = torch.randn(c2, c1 // g, k2, k2)
    w, gg = K.compose(w1, g, w2, g)
    assert gg == g and w.shape == (c2, c0 // g, k1 + k2 - 1, k1 + k2 - 1)
    x = torch.randn(2, c0, 10, 10)
    p = (k1 + k2 - 2) // 2
    close(F.conv2d(F.pad(x, (p,) * 4), w, groups=g), run_seq(x, [(w1, g), (w2, g)], p))


@pytest.mark.parametrize("g", [1, 2, 4])
def test_compose_depthwise_expansion_then_pointwise(g):
    cin, e, cout, k = 4, 3, 6 if g != 4 else 8, 3
    dw = torch.randn(cin * e, 1, k, k)
    pw = torch.randn(cout, cin * e // g, 1, 1)
    w, gg = K.compose(dw, cin, pw, g)
    assert gg == g and w.shape == (cout, cin // g, k, k)
    x = torch.randn(2, cin, 8, 8)
    close(F.conv2d(F.pad(x, (1,) * 4), w, groups=g), run_seq(x, [(dw, cin), (pw, g)], 1))


@pytest.mark.parametrize("w1_shape,g1,w2_shape,g2", [((8, 2, 3, 3), 4, (6, 4, 1, 1), 2),  # grouped -> pw, 2 in/group
                                                      ((12, 3, 1, 1), 2, (8, 6, 3, 3), 2)])  # grouped 1x1 -> 3x3
def test_compose_batched_matmul_cases_with_groups_equal_sequential_convs(w1_shape, g1, w2_shape, g2):
    w1, w2 = torch.randn(w1_shape), torch.randn(w2_shape)
    w, g = K.compose(w1, g1, w2, g2)
    x = torch.randn(2, w1_shape[1] * g1, 8, 8)
    p = (w.shape[-1] - 1) // 2
    close(F.conv2d(F.pad(x, (p,) * 4), w, groups=g), run_seq(x, [(w1, g1), (w2, g2)], p))


@pytest.mark.parametrize("k1", [1, 3])
def test_compose_then_depthwise(k1):
    # 1x1 (or kxk) conv followed by a per-channel filter: the avg / prior branches
    w1 = torch.randn(6, 2, k1, k1)
    w2 = K.freq_prior_kernel(6, 3)
    w, gg = K.compose(w1, 2, w2, 6)
    assert gg == 2
    x = torch.randn(1, 4, 9, 9)
    p = (k1 + 1) // 2
    close(F.conv2d(F.pad(x, (p,) * 4), w, groups=2), run_seq(x, [(w1, 2), (w2, 6)], p))


def test_compose_general_groups_fallback():
    w1 = torch.randn(6, 2, 3, 3)  # groups 2: 4 -> 6
    w2 = torch.randn(6, 2, 3, 3)  # groups 3: 6 -> 6
    w, gg = K.compose(w1, 2, w2, 3)
    assert gg == 1
    x = torch.randn(1, 4, 8, 8)
    close(F.conv2d(F.pad(x, (2,) * 4), w), run_seq(x, [(w1, 2), (w2, 3)], 2))


def test_expand_groups_is_block_diagonal():
    w = torch.randn(8, 2, 3, 3)
    x = torch.randn(1, 8, 6, 6)
    for new in (1, 2):
        close(F.conv2d(x, K.expand_groups(w, 4, new), padding=1, groups=new), F.conv2d(x, w, padding=1, groups=4))
    with pytest.raises(ValueError):
        K.expand_groups(w, 4, 3)


def test_compose_affine_with_bias_and_padding_once():
    w1, b1 = torch.randn(5, 3, 1, 1), torch.randn(5)
    w2, b2 = torch.randn(4, 5, 3, 3), torch.randn(4)
    w, b, g = K.compose_affine(w1, b1, 1, w2, b2, 1)
    x = torch.randn(2, 3, 7, 7)
    ref = F.conv2d(F.conv2d(F.pad(x, (1,) * 4), w1, b1), w2, b2)  # bias reaches the border too
    close(F.conv2d(x, w, b, padding=1), ref)


def test_add_parallel_aligns_centres():
    x = torch.randn(2, 3, 8, 8)
    parts = [(torch.randn(4, 3, 3, 3), torch.randn(4)), (torch.randn(4, 3, 1, 1), None), (torch.randn(4, 3, 5, 5), None)]
    w, b = K.add_parallel(parts)
    ref = sum(F.conv2d(x, pw, pb, padding=pw.shape[-1] // 2) for pw, pb in parts)
    close(F.conv2d(x, w, b, padding=2), ref)


def test_scale_channels_vector_and_scalar():
    w = torch.randn(4, 3, 3, 3)
    s = torch.randn(4)
    x = torch.randn(1, 3, 5, 5)
    close(F.conv2d(x, K.scale_channels(w, s)), F.conv2d(x, w) * s.view(1, -1, 1, 1))
    close(K.scale_channels(w, torch.tensor([2.0])), 2 * w)


def test_fold_bn_matches_eval_bn():
    conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=True)
    bn = torch.nn.BatchNorm2d(4)
    bn.train()
    for _ in range(3):
        bn(conv(torch.randn(4, 3, 6, 6)))
    bn.weight.data.uniform_(0.5, 2)
    bn.bias.data.normal_()
    bn.eval()
    x = torch.randn(2, 3, 6, 6)
    w, b = K.fold_bn(conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps)
    close(F.conv2d(x, w, b, padding=1), bn(conv(x)))


def test_gradcheck_sequential_and_parallel_squeeze():
    w1 = torch.randn(4, 3, 1, 1, requires_grad=True)
    w2 = torch.randn(5, 4, 3, 3, requires_grad=True)
    dw = torch.randn(6, 1, 3, 3, requires_grad=True)
    pw = torch.randn(5, 6, 1, 1, requires_grad=True)
    p1 = torch.randn(5, 3, 1, 1, requires_grad=True)
    s = torch.randn(5, requires_grad=True)

    def squeeze(w1, w2, dw, pw, p1, s):
        a, _ = K.compose(w1, 1, w2, 1)  # 1x1 -> kxk
        b, _ = K.compose(dw, 3, pw, 1)  # dw (x2) -> pw
        c, _ = K.compose(p1, 1, K.freq_prior_kernel(5, 3), 5)  # 1x1 -> prior
        w, _ = K.add_parallel([(K.scale_channels(a, s), None), (b, None), (c, None), (p1, None)])
        return w

    assert torch.autograd.gradcheck(squeeze, (w1, w2, dw, pw, p1, s))
    w3 = torch.randn(4, 4, 3, 3, requires_grad=True)  # kxk -> kxk needs the flip
    assert torch.autograd.gradcheck(lambda a, b: K.compose(a, 1, b, 1)[0], (w3, w2))


@pytest.mark.parametrize("w1_shape, g1, w2_shape, g2", [
    ((16, 1, 3, 3), 4, (6, 8, 1, 1), 2),  # dw x4 -> pw, two blocks (groups of W2)
    ((8, 4, 1, 1), 2, (6, 4, 3, 3), 2),  # 1x1 -> kxk
    ((8, 4, 1, 1), 2, (6, 4, 1, 1), 2),  # 1x1 -> 1x1 (Rep-1x1)
])
def test_kept_views_give_the_same_numbers_and_are_made_once(w1_shape, g1, w2_shape, g2):
    """Tensors marked by keep_views (a group storage's) keep the views the compositions take of
    them: the same results as unmarked operands, each view made once, none under dynamo or make_fx."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(w1_shape, dtype=torch.float64), torch.randn(w2_shape, dtype=torch.float64)
    s = torch.randn(w2_shape[0], 1, 1, 1, dtype=torch.float64)
    composed = K.compose(w1, g1, w2, g2)[0]
    grad = torch.randn_like(composed)

    def run(a, b, scale):
        out = torch.zeros_like(composed)
        K.compose_into(out, a, g1, b, g2, scale)
        d = K.compose_vjp(a, g1, b, g2, grad, scale=scale, launch_bound=True)
        return out, *d, K.rowdot(d[1].contiguous(), b)

    plain = run(w1, w2, s)
    marked = [t.clone() for t in (w1, w2, s)]
    holders = [K.keep_views(t) for t in marked]
    for _ in range(2):
        for x, y in zip(run(*marked), plain):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    kept = [(t, v) for t, h in zip(marked, holders) for v in h.values()]
    assert kept and all(v._base is not None and v.data_ptr() >= t.data_ptr() for t, v in kept)  # views
    run(*marked)
    assert [v for h in holders for v in h.values()] == [v for _, v in kept]  # not remade
    assert K.kept_view(w1, ("k",), lambda t: t.view(-1)) is not K.kept_view(w1, ("k",), lambda t: t.view(-1))
    fresh = [t.clone() for t in (w1, w2, s)]
    fresh_holders = [K.keep_views(t) for t in fresh]
    compiled = torch.compile(run, backend="eager", fullgraph=True)
    for x, y in zip(compiled(*fresh), plain):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert not any(fresh_holders)  # nothing kept under dynamo
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(run)(*fresh)  # nor in a make_fx trace: a kept view would be a constant of the graph
    constants = [getattr(traced, n.target) for n in traced.graph.nodes if n.op == "get_attr"]  # grad, composed
    marked_memory = {t.untyped_storage().data_ptr() for t in fresh}
    assert not any(fresh_holders) and not [c for c in constants if c.untyped_storage().data_ptr() in marked_memory]
    for x, y in zip(traced(*fresh), plain):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make", [
    lambda x: x.reshape(-1),  # a copy
    lambda x: x.reshape(4, 6).t(),  # a view of a copy
])
def test_what_does_not_read_the_tensors_memory_is_never_kept(make):
    t = torch.randn(4, 6).t()  # not contiguous: its reshapes copy
    holder = K.keep_views(t)
    first = K.kept_view(t, ("k",), make)
    t.mul_(2)
    again = K.kept_view(t, ("k",), make)
    torch.testing.assert_close(again, make(t))
    assert first is not again and not holder


def test_kept_views_do_not_keep_their_tensor_alive():
    """The views live in the holder keep_views returns (the storage holds it), not on the tensor:
    a view holds its base's C++ tensor, so views kept on the tensor would never let it be freed."""
    import gc
    import weakref

    t = torch.zeros(100, 10)
    holder = K.keep_views(t)
    view = K.kept_view(t, ("k",), lambda x: x.view(10, 10, 10))
    assert holder[("k",)] is view
    alive = weakref.ref(t)
    del t, view, holder
    gc.collect()
    assert alive() is None


class _DictScratch:
    """A scratch (``orepa.engine.Scratch``'s interface): one persistent buffer per key, marked to
    keep its views; counts the buffers made."""

    def __init__(self):
        self.bufs, self.holders = {}, []

    def buf(self, key, shape):
        key = (key, tuple(shape))
        if key not in self.bufs:
            self.bufs[key] = torch.full(key[1], float("nan"), dtype=torch.float64)  # garbage until written
            self.holders.append(K.keep_views(self.bufs[key]))
        return self.bufs[key]


@pytest.mark.parametrize("w1_shape,g1,w2_shape,g2", [
    ((32, 1, 3, 3), 4, (6, 16, 1, 1), 2),  # dw (x8) -> pw, two blocks of two fine groups each
    ((8, 4, 1, 1), 2, (6, 4, 3, 3), 2),  # 1x1 -> kxk
    ((8, 4, 1, 1), 2, (6, 4, 1, 1), 2),  # 1x1 -> 1x1 (Rep-1x1)
])
@pytest.mark.parametrize("into", [False, True])
def test_the_scratch_evaluations_give_the_reference_numbers(w1_shape, g1, w2_shape, g2, into):
    """compose_into and compose_vjp_scaled with a scratch (buffers written through out=, the
    host-bound route) give the reference evaluations' kernel and gradients (compose_vjp with the
    scale, rowdot), written into given places or fresh, and nothing they return is a buffer."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(w1_shape, dtype=torch.float64), torch.randn(w2_shape, dtype=torch.float64)
    s = torch.randn(w2_shape[0], 1, 1, 1, dtype=torch.float64)
    composed = s * K.compose(w1, g1, w2, g2)[0]
    grad = torch.randn_like(composed)
    d1, d_scaled = K.compose_vjp(w1, g1, w2, g2, grad, scale=s, launch_bound=True)
    ref = (d1, d_scaled * s, K.rowdot(d_scaled.contiguous(), w2))
    scratch = _DictScratch()
    marked = [t.clone() for t in (w1, w2, s)]
    holders = [K.keep_views(t) for t in marked]
    for _ in range(2):  # the second time on the buffers and views of the first
        out = torch.zeros_like(composed)
        K.compose_into(out, marked[0], g1, marked[1], g2, marked[2], scratch=scratch)
        torch.testing.assert_close(out, composed, rtol=1e-12, atol=1e-12)
        g = scratch.buf("grad", grad.shape).copy_(grad)
        places = tuple(torch.full_like(t, float("nan")) for t in ref) if into else (None, None, None)
        got = K.compose_vjp_scaled(marked[0], g1, marked[1], g2, marked[2], g, scratch, outs=places)
        for x, y, place in zip(got, ref, places):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
            assert x is place if into else all(x.untyped_storage()._cdata != b.untyped_storage()._cdata
                                                for b in scratch.bufs.values())
    assert scratch.bufs and any(holders) and any(h for h in scratch.holders)
