import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tol_close(y, ref, rel=1e-5):
    """The suite's float32 equivalence criterion: max|y - ref| <= rel * (1 + max|ref|)."""
    err = (y - ref).abs().max().item()
    bound = rel * (1 + ref.abs().max().item())
    assert err <= bound, f"max abs error {err:.3e} > {bound:.3e}"
    return err
