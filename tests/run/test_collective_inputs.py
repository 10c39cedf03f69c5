"""A compiled graph's input that is, or holds, a collective's pending result (what DTensor's
`to_local` returns after an asynchronous reduction): its gradient reaches the tensor before it,
and the graph reads it only once the collective is done. On one gloo rank, in-process; the
tensor-parallel models that hand blocks such inputs are in
`tests/integrations/test_tensor_parallel_blocks.py`."""

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from seqcompile.report import collecting

WIDTH = 8


@pytest.fixture(scope="module")
def group():
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


class Reduced(torch.autograd.Function):
    """`x` summed over the group (one rank: `x` itself), as the pending result the collective
    returns, with `x`'s gradient."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _norm_sum(x, w):
    return F.layer_norm(x, (WIDTH,), w).sin().sum()


def test_a_pending_input_gets_its_gradient(group):
    g = torch.Generator().manual_seed(0)
    leaf = torch.randn(2, 3, WIDTH, generator=g, requires_grad=True)
    w = torch.randn(WIDTH, generator=g, requires_grad=True)
    _norm_sum(leaf * 2, w).backward()
    expected = leaf.grad, w.grad
    leaf.grad = w.grad = None
    pending = Reduced.apply(leaf * 2, group)
    assert isinstance(pending, AsyncCollectiveTensor) and pending.grad_fn is not None
    with collecting() as report:
        torch.compile(_norm_sum, backend="seqfast", fullgraph=True)(pending, w).backward()
    assert report.counts["norm"] == 1, str(report)
    assert leaf.grad is not None, "the pending input's gradient was dropped"
    torch.testing.assert_close((leaf.grad, w.grad), expected)


def test_a_dtensor_holding_a_pending_tensor_is_read_once_done(group):
    mesh = init_device_mesh("cpu", (1,))
    x = torch.randn(2, 3, WIDTH, generator=torch.Generator().manual_seed(0))
    held = DTensor.from_local(funcol.all_reduce(x, "sum", group), mesh, [Replicate()])
    local = held._local_tensor
    assert isinstance(local, AsyncCollectiveTensor) and not local.completed
    out = torch.compile(lambda t: t.sin() * 2, backend="seqfast", fullgraph=True)(held)
    assert local.completed, "the graph read the collective's buffer before waiting for it"
    torch.testing.assert_close(out.full_tensor(), x.sin() * 2)
