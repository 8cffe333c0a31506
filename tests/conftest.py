import os
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

# Inductor's CPU code without SIMD in the suite: the tests check the compiled constructions' graphs
# and numbers, not inductor's vectorisation, which costs about 40% of a cold compile (probing the
# ISAs with test builds, tiling analysis), and a clean clone's suite compiles ResNet-18's
# construction several times. Read when torch._inductor.config is first imported (``import torch``
# does not import it); subprocesses (torchrun in the DDP tests) inherit it. Override by setting it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# Bytecode caches written, whatever PYTHONDONTWRITEBYTECODE says (container images set it): without
# them every process the suite starts (a command, torchrun's ranks: about 150 a run) compiled
# orepa's 19k lines again, and every xdist worker rewrote the tests' asserts again. Its workers and
# subprocesses inherit the environment. (__pycache__ folders are git-ignored.)
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

#: architectures whose parametrized test cases run in the full suite only (``-m "not slow"`` skips them):
#: the large or deep networks; the fast subset keeps every test on the small ones (resnet18, resnet34, repvgg_a0)
SLOW_ARCHITECTURES = frozenset({
    "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "wide_resnet50_2", "wide_resnet18_1_5", "wide_resnet18_2",
    "vgg11_bn", "mobilenet_v2", "repvgg_a1", "repvgg_a2", "repvgg_b0", "repvgg_b1",
})


#: the zoo's models whose code differs from each other's: the basic block, the bottleneck, grouped
#: bottlenecks, a width multiplier that rounds, the RepVGG family. The others (resnet34/101/152,
#: wide_resnet18_2, repvgg_a1..b1) change only depth or width, which every method builds alike.
ZOO_ARCHETYPES = ("resnet18", "resnet50", "resnext50_32x4d", "wide_resnet18_1_5", "repvgg_a0")


def zoo_cases() -> list[tuple[str, str]]:
    """(name, method) of the zoo for tests that check a method's build or deployment: every method
    on each of ZOO_ARCHETYPES, base and the main online method (``orepa`` / ``orepa-vgg``) on the
    depth and width variants (their configuration still builds, trains and deploys)."""
    import orepa.models as zoo

    cases = []
    for name in zoo.list_models():
        methods = zoo.list_methods(name)
        if name not in ZOO_ARCHETYPES:
            methods = [m for m in methods if m in ("base", "orepa", "orepa-vgg")]
        cases += [(name, m) for m in methods]
    return cases


def pytest_configure(config):
    """One torch intra-op thread for the whole suite: the tests run tiny models, dominated by per-op
    overhead, and a second OpenMP thread only adds barriers; on shared cores (other jobs) two threads
    made tests several times slower. Tests that need more set it themselves."""
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Mark a parametrized case ``slow`` when one of its parameters names one of SLOW_ARCHITECTURES,
    then run the ``slow`` tests first: xdist hands tests out in this order, and a long one handed out
    last (a torchrun launch, 40 s) kept one worker busy after the other had finished."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v in SLOW_ARCHITECTURES for v in params.values()):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (stable: files' order kept)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread around a test, and the thread count restored afterwards, so that a test
    that changes it (e.g. ``orepa train --threads N`` in process) cannot leak into the next one.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def earlier_objects_frozen():
    """What the process held before a test kept out of the garbage collector's reach while it runs
    (``gc.freeze``), all thawed afterwards. ``orepa bench`` collects before each variant's peak and
    timed steps, and Python collects by itself as commands build, trace and export models: in the
    suite's process each full collection walked every object of the modules and tests before it
    (0.3 to 1 s), where a command's own process holds few. The garbage a test makes is collected as
    in that process. Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    import gc

    gc.freeze()
    yield
    gc.unfreeze()


SRC = str(Path(__file__).resolve().parents[1] / "src")


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` loaded as a module (the scripts are no package), to call its ``main``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child_env(**extra: str) -> dict:
    """The environment of a child process the tests start (``python -m orepa``, torchrun): this
    checkout's ``src`` first on its path, one OpenMP thread (the suite's processes share two cores)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra,
            "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def tol_close(y, ref, rel=1e-5):
    """The suite's float32 equivalence criterion: max|y - ref| <= rel * (1 + max|ref|)."""
    err = (y - ref).abs().max().item()
    bound = rel * (1 + ref.abs().max().item())
    assert err <= bound, f"max abs error {err:.3e} > {bound:.3e}"
    return err


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> str:
    """Fashion-MNIST un-gzipped once per test session (the training tests' data)."""
    from orepa.apps import data

    source = os.environ.get("OREPA_FASHION_MNIST_DIR", data.FASHION_MNIST_SOURCE)  # as data.prepare_fashion_mnist
    if not Path(source, "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"dataset-fashion-mnist is not installed (no {source}/train-images-idx3-ubyte.gz)")
    root = tmp_path_factory.mktemp("fmnist-cache")
    data.prepare_fashion_mnist(root)
    return str(root)


class Checkpointed(torch.nn.Module):
    """``inner`` run under activation checkpointing (``torch.utils.checkpoint``)."""

    def __init__(self, inner: torch.nn.Module, reentrant: bool = False):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def aot_graph_backend(graphs: list):
    """A ``torch.compile`` backend that traces and partitions forward and backward as inductor would
    (AOTAutograd) and runs them as traced, appending each graph module to ``graphs``."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm, example_inputs):
        def keep(gm, _):
            graphs.append(gm)
            return make_boxed_func(gm)
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)
    return backend


def matrix_products(graphs) -> int:
    """The matrix products (``mm``, ``bmm``) in traced graph modules."""
    return sum(n.target in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default)
               for gm in graphs for n in gm.graph.nodes)
