import pytest
import torch


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
