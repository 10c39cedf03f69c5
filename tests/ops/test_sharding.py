"""Each fused op's sharding rule (`FusedOp.sharding`), checked on every registry entry's samples on
simulated ranks (a fake process group of two, `LocalTensorMode`: each DTensor holds every rank's
shard in this one process, and collectives compute their results). For every op call a sample
makes (the forward, and each backward op with the arguments its autograd gives it) and every
strategy its rule offers, the call on DTensors placed as the strategy says must keep those
placements (DTensor ran the op on the shards, nothing redistributed) and give, gathered, what the
op gives on whole tensors. Placements no rule offers (the normalized dimension sharded, logits
sharded along the vocabulary, dropout on shards) are redistributed, and still give the op's
answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checks import SeqfastCalls, forward_kernels
from conftest import TOLERANCES
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_leaves, tree_map

from seqcompile.ops import registry, sharding
from seqcompile.ops.fused_op import Call, FusedOp
from seqcompile.ops.samples import Sample, replace_slots, tensor_slots
from seqcompile.ops.sharding import Strategy

RANKS = 2
REPLICATED_ONLY = {registry.entry_named("linear_row_loss").forward}
"""Ops whose rule offers no sharding by design (a row loss's program may take any statistic of
the rows); every other op must offer one on some sample."""


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=RANKS)
    try:
        with LocalTensorMode(RANKS):
            made = init_device_mesh("cpu", (RANKS,))
        yield made
    finally:
        dist.destroy_process_group()


def _cases():
    """Every sample; those with non-finite values (which test numerics, not placements) in the
    slow tier."""
    for entry in registry.ENTRIES:
        for sample in entry.samples():
            numeric = "nan" in sample.name or "inf" in sample.name
            marks = [pytest.mark.slow] if numeric else []
            yield pytest.param(entry, sample, id=f"{entry.name}-{sample.name}", marks=marks)


def _calls(entry: FusedOp, sample: Sample) -> list[tuple[Any, dict[str, Any], Any]]:
    """Each op call the sample makes, forward and backward, by argument name, with its result."""
    args = replace_slots(
        sample.args,
        lambda slot, t: t.clone().requires_grad_(slot in sample.grads and t.is_floating_point()),
    )
    with SeqfastCalls() as recorded:
        result = entry.forward(**args)
        outputs = [o for o in tree_leaves(result) if o.requires_grad]
        wrt = [t for _, t in tensor_slots(args) if t.requires_grad]
        if outputs and wrt:
            g = torch.Generator().manual_seed(3)
            grads = [torch.randn(o.shape, generator=g) for o in outputs]
            torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
    calls = []
    for op, call_args, call_kwargs, out in recorded.calls:
        detached = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                            (call_args, call_kwargs, out))  # fmt: skip
        call = Call(op, detached[0], detached[1])
        calls.append((op, {name: call[name] for name in call}, detached[2]))
    return calls


def _offered(entry: FusedOp, op, arguments: dict[str, Any], mesh) -> list[Strategy]:
    """The strategies the op's rule offers for this call (besides replicating everything)."""

    def spec(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        return DTensorSpec(mesh, (Replicate(),), TensorMeta(v.shape, v.stride(), v.dtype))

    specs = {name: [spec(t) for t in v] if isinstance(v, list) else spec(v)
             for name, v in arguments.items()}  # fmt: skip
    try:
        offered = sharding.offered(op, entry.sharding[op], Call(op, (), specs))
    except sharding.NoSharding:
        return []
    return [s for s in offered if _shardable(arguments, s)]


def _shardable(arguments: dict[str, Any], strategy: Strategy) -> bool:
    """Whether DTensor takes the strategy: each sharded dimension has a row for every rank."""
    for name, placements in strategy.inputs.items():
        tensors = arguments[name] if isinstance(arguments[name], list) else [arguments[name]]
        placements = placements if isinstance(placements, list) else [placements]
        for t, p in zip(tensors, placements, strict=False):
            if isinstance(p, Shard) and t is not None and t.shape[p.dim] < RANKS:
                return False
    return True


def _placed(t: torch.Tensor, placement: Any, mesh) -> DTensor:
    if isinstance(placement, Partial):  # each rank holds half the sum, exactly
        return DTensor.from_local(t / RANKS, mesh, [Partial()], run_check=False)
    return distribute_tensor(t, mesh, [placement])


def _distributed(arguments: dict[str, Any], strategy: Strategy, mesh) -> dict[str, Any]:
    def one(name: str, v: Any) -> Any:
        given = strategy.inputs.get(name)
        if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            given = given if given is not None else [Replicate()] * len(v)
            return [_placed(t, p, mesh) for t, p in zip(v, given, strict=True)]
        if isinstance(v, torch.Tensor):
            return _placed(v, given if given is not None else Replicate(), mesh)
        return v

    return {name: one(name, v) for name, v in arguments.items()}


def _gathered(result: Any) -> list[list[torch.Tensor]]:
    """Each output whole, as each simulated rank holds it after gathering."""

    def each_rank(t: torch.Tensor) -> list[torch.Tensor]:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if isinstance(full, LocalTensor):
            return [full._local_tensors[r] for r in range(RANKS)]
        return [full]

    return [each_rank(t) for t in tree_leaves(result) if isinstance(t, torch.Tensor)]


def _compare(gathered: list[list[torch.Tensor]], expected: Any, where: str) -> None:
    expected = [t for t in tree_leaves(expected) if isinstance(t, torch.Tensor)]
    assert len(gathered) == len(expected), where
    for i, (ranks, e) in enumerate(zip(gathered, expected, strict=True)):
        for rank, value in enumerate(ranks):
            tolerance = TOLERANCES.get(e.dtype, dict(atol=0, rtol=0))
            torch.testing.assert_close(
                value, e, **tolerance, equal_nan=True,
                msg=lambda m, i=i, rank=rank: f"{where} output {i} on rank {rank}: {m}",
            )  # fmt: skip


def _run(op, arguments: dict[str, Any]) -> Any:
    return op(*Call(op, (), arguments).arguments())


@pytest.mark.filterwarnings("ignore:.*implicitly creating a replicated DTensor")
@pytest.mark.parametrize("entry, sample", list(_cases()))
def test_every_offered_sharding_computes_the_op_on_the_shards(entry: FusedOp, sample, mesh):
    for op, arguments, expected in _calls(entry, sample):
        for strategy in _offered(entry, op, arguments, mesh):
            where = f"{op} placed {strategy}"
            with LocalTensorMode(RANKS):
                result = _run(op, _distributed(arguments, strategy, mesh))
                gathered = _gathered(result)
            got = [t.placements[0] for t in tree_leaves(result) if isinstance(t, DTensor)]
            assert got == list(strategy.outputs), f"{where}: redistributed to {got}"
            _compare(gathered, expected, where)


ON_KERNELS = {
    "attention": "bias-mask", "add_norm": "layer-norm", "cross_entropy": "plain",
    "linear_cross_entropy": "sum-without-bias", "linear_row_loss": "z-loss",
    "soft_cross_entropy": "plain", "pointwise": "bias-gelu",
}  # fmt: skip
"""A sample of each entry that offers a sharded forward, for the kernel path."""


def _kernel_cases():
    for entry in registry.ENTRIES:
        sample = next(s for s in entry.samples() if s.name == ON_KERNELS[entry.name])
        marks = [pytest.mark.slow, pytest.mark.kernels(*forward_kernels(entry, sample))]
        yield pytest.param(entry, sample, id=f"{entry.name}-{sample.name}", marks=marks)


@pytest.mark.parametrize("entry, sample", list(_kernel_cases()))
def test_offered_shardings_on_the_kernel_path(entry: FusedOp, sample, mesh, interpret):
    """The generated kernels on each rank's shards (views DTensor cut, and their gradients)."""
    test_every_offered_sharding_computes_the_op_on_the_shards(entry, sample, mesh)


def test_every_op_but_the_row_program_offers_a_sharding(mesh):
    """A rule that offered nothing would pass the sweep above untested: every op must offer a
    sharded strategy on some sample."""
    offered: set = set()
    for entry in registry.ENTRIES:
        for sample in entry.samples():
            for op, arguments, _ in _calls(entry, sample):
                if _offered(entry, op, arguments, mesh):
                    offered.add(op)
    every = {op for entry in registry.ENTRIES for op in entry.sharding}
    twins = {e.in_place.twin for e in registry.ENTRIES if e.in_place is not None}
    assert every - offered - twins == REPLICATED_ONLY
    assert every == {op for entry in registry.ENTRIES for op in entry.ops}, "an op has no rule"


def _sample(name: str, sample: str) -> tuple[FusedOp, dict[str, Any]]:
    entry = registry.entry_named(name)
    return entry, dict(next(s for s in entry.samples() if s.name == sample).args)


DROPOUT = dict(p=0.25, seed=torch.tensor(11, dtype=torch.int64))
HEADS = {"q": Shard(1), "k": Shard(1), "v": Shard(1), "bias": Shard(1)}
_g = torch.Generator().manual_seed(5)
ODD_GROUPS = dict(  # 6 query heads on 3 key heads: halves of 3 and 2 would not group
    q=torch.randn(1, 6, 5, 8, generator=_g), k=torch.randn(1, 3, 7, 8, generator=_g),
    v=torch.randn(1, 3, 7, 8, generator=_g), bias=None, mask=None,
)  # fmt: skip


@pytest.mark.parametrize(
    "name, sample, changes, placements",
    [
        ("add_norm", "layer-norm", {}, {"x": Shard(2)}),  # the normalized dimension
        ("add_norm", "layer-norm", DROPOUT, {"x": Shard(0), "residual": Shard(0)}),
        ("cross_entropy", "plain", {}, {"logits": Shard(1)}),  # the vocabulary (loss_parallel)
        ("linear_cross_entropy", "mean", {}, {"hidden": Shard(0)}),  # a mean over all rows
        ("attention", "bias-mask", DROPOUT, HEADS),  # one seed: each shard the same masks
        ("attention", "bias-mask", ODD_GROUPS, {"q": Shard(1), "k": Shard(1), "v": Shard(1)}),
    ],
    ids=[
        "normalized-dim",
        "norm-dropout",
        "vocabulary",
        "mean",
        "attention-dropout",
        "uneven-head-groups",
    ],  # fmt: skip
)
def test_placements_no_rule_offers_are_redistributed_to_the_right_answer(
    name, sample, changes, placements, mesh
):
    entry, arguments = _sample(name, sample)
    arguments |= changes
    expected = entry.forward(**arguments)
    with LocalTensorMode(RANKS):
        result = entry.forward(**_distributed(arguments, Strategy([], placements), mesh))
        gathered = _gathered(result)
    _compare(gathered, expected, f"{name} placed {placements}")
    got = {t.placements[0] for t in tree_leaves(result) if isinstance(t, DTensor)}
    assert got == {Replicate()}, f"ran sharded as {got}"
