"""`accumulate_grads` on two gloo processes: under DistributedDataParallel the micro-batches in
`no_sync()` accumulate into `.grad` and the last hands its gradients to the reducer; under FSDP2
(`fully_shard`) every micro-batch accumulates, with or without the sync switch. Each rank's
gradients after the micro-batches equal eager's under the same wrapper."""

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checks import AccumulatingCalls

from seqcompile.demo import GPT, GPTConfig, toy_batch

CONFIG = GPTConfig(vocab=64, max_len=32, d_model=32, n_heads=2, n_layers=2, dropout=0.0)
MICRO_BATCHES = 3

pytestmark = pytest.mark.slow

DDP_OPTIONS = {
    "ddp": {},
    "ddp_bucket_view": {"gradient_as_bucket_view": True},
    "ddp_find_unused": {"find_unused_parameters": True},
}


def _wrapped(wrapper):
    """The model under `wrapper`, and the context its micro-batches but the last run in."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if wrapper.startswith("ddp"):
        ddp = torch.nn.parallel.DistributedDataParallel(model, **DDP_OPTIONS[wrapper])
        return ddp, model, ddp.no_sync
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return model, model, no_sync


def _train(wrapper, rank, compiled):
    """Gradients of this rank's parameters (its shards, under FSDP2) after the micro-batches, and
    how many accumulating ops each micro-batch's backward ran."""
    step, model, no_sync = _wrapped(wrapper)
    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step, backend="seqfast", options={"accumulate_grads": True})
    calls = []
    for i in range(MICRO_BATCHES):
        generator = torch.Generator().manual_seed(100 * rank + i)
        idx, targets = toy_batch(CONFIG, 3, 5, torch.device("cpu"), generator)
        last = i == MICRO_BATCHES - 1
        with contextlib.nullcontext() if last else no_sync():
            loss = step(idx, targets) / MICRO_BATCHES
            with AccumulatingCalls() as accumulating:
                loss.backward()
        calls.append(accumulating.count)
    grads = [getattr(p.grad, "_local_tensor", p.grad).clone() for p in model.parameters()]
    return grads, calls


def _worker(rank, store, wrapper):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        expected, _ = _train(wrapper, rank, compiled=False)
        got, calls = _train(wrapper, rank, compiled=True)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        if wrapper.startswith("ddp"):  # the reducer takes the last micro-batch's from autograd
            assert all(n > 0 for n in calls[:-1]) and calls[-1] == 0, calls
        else:
            assert all(n > 0 for n in calls), calls
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrapper", [*DDP_OPTIONS, "fsdp2"])
def test_accumulated_gradients_equal_eagers_on_two_ranks(wrapper, tmp_path):
    mp.spawn(functools.partial(_worker, store=tmp_path / "store", wrapper=wrapper), nprocs=2)
