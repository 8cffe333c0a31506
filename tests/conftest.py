import pytest
import torch

#: architectures whose parametrized test cases belong to the full suite only (``-m "not slow"`` skips them):
#: the fast subset keeps every test, on the small networks (resnet18, resnet34, repvgg_a0, mobilenet_v2, ...)
LARGE_ARCHITECTURES = frozenset({
    "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "wide_resnet50_2", "wide_resnet18_1_5", "wide_resnet18_2",
    "vgg11_bn", "repvgg_a1", "repvgg_a2", "repvgg_b0", "repvgg_b1",
})


def pytest_collection_modifyitems(config, items):
    """Mark a parametrized case ``slow`` when one of its parameters names a large architecture."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v in LARGE_ARCHITECTURES for v in params.values()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread, restored afterwards: these tests are dominated by per-op overhead on
    tiny models, and extra threads only oversubscribe shared cores. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tol_close(y, ref, rel=1e-5):
    """The suite's float32 equivalence criterion: max|y - ref| <= rel * (1 + max|ref|)."""
    err = (y - ref).abs().max().item()
    bound = rel * (1 + ref.abs().max().item())
    assert err <= bound, f"max abs error {err:.3e} > {bound:.3e}"
    return err
