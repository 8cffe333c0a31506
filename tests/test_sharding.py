"""Online blocks under memory-sharding wrappers: FSDP2 (``fully_shard``), FullyShardedDataParallel and
a parameter that is a view of memory another owner writes (ZeroRedundancyOptimizer's bucket views).
One gloo process each (the mechanisms do not need two ranks: docs/training.md, "Sharded training")."""
import pytest
import torch
import torch.distributed as dist
from test_engine import _pair, _sgd_steps

from orepa import engine


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fully_shard():
    """FSDP2's ``fully_shard`` (public from torch 2.6, before that under ``_composable``)."""
    for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            return getattr(__import__(where, fromlist=["fully_shard"]), "fully_shard")
        except (ImportError, AttributeError):
            continue
    pytest.skip(f"torch {torch.__version__} has no FSDP2 (fully_shard)")


def _small_pair(pack=False):
    return _pair("resnet18", pack=pack, small_input=True)


def test_a_group_reads_what_another_owner_writes_into_its_parameters_memory():
    """Parameters that are views of a buffer another owner writes (ZeroRedundancyOptimizer with
    parameters_as_bucket_view broadcasts each rank's updated parameters into its buckets) stay its
    views: a group that re-pointed them into a storage of its own built every later step from the
    values they had at its first build, and the ranks drifted apart silently."""
    ref, grouped = _small_pair()
    params = [p for p in grouped.parameters()]
    bucket = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:  # what ZeroRedundancyOptimizer(parameters_as_bucket_view=True) does
        p.data = bucket[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    grouped(x)
    with torch.no_grad():  # another rank's update, broadcast into the bucket
        bucket.mul_(1.5)
        for p in ref.parameters():
            p.mul_(1.5)
    torch.testing.assert_close(grouped(x), ref(x), rtol=1e-9, atol=1e-9)


def _trains_as(ref, model, sharded, x, steps):
    """``steps`` SGD steps of ``ref`` and of ``sharded`` (``model`` under FSDP) end with ``model``'s full
    state_dict equal to ``ref``'s."""
    for m in (ref, sharded):
        _sgd_steps(m, x, steps=steps)
    sd = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-9, atol=1e-10, msg=k)


@pytest.mark.parametrize("above", [False, True])
def test_fully_shard_trains_a_grouped_model_as_the_per_block_route(gloo, above):
    """FSDP2 all-gathers into its unsharded parameters' own storage at every forward: a group that had
    re-pointed them into its storage kept building from the first step's values (after three SGD
    steps 0.1 from the per-block route, in float32 with two ranks as with one). ``above``: fully_shard
    applied to a module holding the grouped network (a task's wrapper), which the group does not see
    from its root."""
    fully_shard = _fully_shard()

    ref, grouped = _small_pair()
    sharded = torch.nn.Sequential(grouped) if above else grouped
    fully_shard(sharded)
    _trains_as(ref, grouped, sharded, torch.randn(4, 3, 32, 32, dtype=torch.float64), steps=3)


@pytest.mark.parametrize("above", [False, True])
def test_packed_parameters_under_fully_shard_are_refused_at_the_first_forward(gloo, above):
    """A packed step saves and loads its rows of the group's packed parameter under its own key: rows of
    FSDP2's shards are no views of them, so a load_state_dict (torch.distributed.checkpoint's
    set_state_dict) wrote into copies and left the weights as they were, and a state_dict after a
    forward read memory FSDP2 had freed (a segmentation fault). Refused at the first forward, naming
    the way out (unpacked, such a model trains: the test above)."""
    fully_shard = _fully_shard()

    _, packed = _small_pair(pack=True)
    sharded = torch.nn.Sequential(packed) if above else packed
    fully_shard(sharded)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"packed parameters under FSDP2.*pack=False"):
        sharded(x)


def test_a_group_split_across_fsdp_units_is_refused_by_name(gloo):
    """FSDP units that split a kernel group: the group builds every block's kernel at the forward's
    first online block, while the other units' parameters are still shards (an obscure DTensor
    NotImplementedError, or a shape mismatch under FullyShardedDataParallel): a RuntimeError names the
    parameter and the ways out; building block by block ('per-block') trains."""
    fully_shard = _fully_shard()

    _, grouped = _small_pair()
    for stage in (grouped.layer1, grouped.layer2, grouped.layer3, grouped.layer4):
        fully_shard(stage)
    fully_shard(grouped)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"is not gathered \(a DTensor shard\).*'per-block'"):
        grouped(x).sum().backward()
    ref, per_block = _small_pair()
    engine.group_kernels(per_block, "per-block")
    for stage in (per_block.layer1, per_block.layer2, per_block.layer3, per_block.layer4):
        fully_shard(stage)
    fully_shard(per_block)
    _trains_as(ref, per_block, per_block, x, steps=2)


@pytest.mark.parametrize("pack", [False, True])
def test_flat_parameter_fsdp_is_refused_by_name(gloo, pack):
    """FullyShardedDataParallel(use_orig_params=False) replaces every parameter by a plain view of its
    flat parameter: a TypeError saying so and naming use_orig_params=True / fully_shard, not a
    KeyError('_packed') from inside the construction."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    _, grouped = _small_pair(pack)
    wrapped = FSDP(grouped, use_orig_params=False, device_id=torch.device("cpu"))
    with pytest.raises(TypeError, match="use_orig_params=False.*use_orig_params=True"):
        wrapped(torch.randn(2, 3, 32, 32, dtype=torch.float64))
