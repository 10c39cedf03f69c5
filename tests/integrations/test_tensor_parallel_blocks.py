"""Blocks compiled one at a time under tensor parallelism, as torchtitan's `apply_compile` does
(each block `torch.compile(block, backend="seqfast", fullgraph=True)`, the loss compiled apart
or inside the last block's graph), on a llama-style model sharded by torchtitan's plan: the
embedding row-wise, q, k, v and the MLP's first linears column-wise, the output projections
row-wise, with sequence parallelism the norms on sequence shards and `PrepareModuleInput`
before attention and the MLP. The loss, every gathered gradient and each gradient's type and
placements match the same per-block setup under `backend="eager"`, on the reference path and on
the kernels under Triton's interpreter (one compile runs both).

What crosses a compiled block's boundary is what DTensor hands it outside the graph: a local
tensor that is the pending result of the embedding's reduction (an `AsyncCollectiveTensor`),
or, where the plan keeps its outputs as DTensors, a DTensor, replicated or sharded along the
sequence. Its gradient must reach DTensor's autograd outside: lost, the step fails in
`Redistribute.backward`, or under FSDP2 the embedding's gradient is silently zero.

Slow tier only: one spawn of two gloo ranks runs the tensor-parallel setups in turn, one of
four ranks FSDP2 over tensor parallelism on a (2, 2) mesh."""

import math
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from seqcompile.codegen.launches import counting_launches
from seqcompile.report import collecting

from .test_tensor_parallel import (
    BATCH,
    LAYERS,
    LENGTH,
    VOCAB,
    WIDTH,
    Block,
    assert_launched,
    process_group,
)

pytestmark = pytest.mark.slow


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Last(nn.Module):
    """The last block, then the final norm, the output projection and the loss: compiled whole
    where the loss joins the last block's graph."""

    def __init__(self, rms):
        super().__init__()
        self.block = Block(rms)
        self.norm = (nn.RMSNorm if rms else nn.LayerNorm)(WIDTH)
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)
        self.loss = cross_entropy

    def forward(self, h, targets):
        return self.loss(self.output(self.norm(self.block(h))), targets)


class Llama(nn.Module):
    def __init__(self, rms):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(rms) for _ in range(LAYERS - 1))
        self.last = Last(rms)

    def forward(self, idx, targets):
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h)
        return self.last(h, targets)


def parallelized(mesh, rms, sequence_parallel, embedding, dtensors):
    """torchtitan's plan: the embedding's output placed as `embedding` (`Shard(1)` or
    `Replicate()`); with `dtensors`, the blocks take and return DTensors (the row-wise
    projections keep their outputs as DTensors), else local tensors."""
    torch.manual_seed(0)
    model = Llama(rms)
    between = Shard(1) if sequence_parallel else Replicate()
    local = not dtensors
    row = RowwiseParallel(output_layouts=between, use_local_output=local)
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=embedding, use_local_output=local
        ),
        "last.output": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
        **({"last.norm": SequenceParallel()} if sequence_parallel else {}),
    })  # fmt: skip
    for block in (*model.layers, model.last.block):
        mlp = {f"mlp.{w}": ColwiseParallel() for w in ("w1", "w3") if hasattr(block.mlp, w)}
        plan = {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": row, **mlp, "mlp.w2": row,
        }  # fmt: skip
        if sequence_parallel:
            gather = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan |= {"n1": SequenceParallel(), "n2": SequenceParallel(), "attn": gather,
                     "mlp": gather}  # fmt: skip
        parallelize_module(block, mesh, plan)
    return model


def compiled_per_block(model, backend, loss_in_last_block):
    """Each block compiled alone, fullgraph, as torchtitan's `apply_compile` does it; the loss
    compiled apart, or the last block compiled with the final norm, projection and loss."""
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=backend, fullgraph=True)
    last = model.last
    if loss_in_last_block:
        model.last = torch.compile(last, backend=backend, fullgraph=True)
    else:
        last.block = torch.compile(last.block, backend=backend, fullgraph=True)
        last.loss = torch.compile(cross_entropy, backend=backend, fullgraph=True)
    return model


def fully_sharded(model, mesh):
    """FSDP2 along "dp" over each compiled block and the root, as torchtitan composes them
    (sum reductions: gloo has no PREMUL_SUM)."""
    from torch.distributed.fsdp import fully_shard

    for module in (*model.layers, model.last, model):
        fully_shard(module, mesh=mesh["dp"]).set_force_sum_reduction_for_comms(True)
    return model


def step(model):
    """The loss, and each parameter's gradient gathered whole with its type and placements."""
    g = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(VOCAB, (BATCH, LENGTH), generator=g) for _ in "it")
    loss = model(idx, targets)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        name = name.replace("_orig_mod.", "")
        placed = (type(p.grad), getattr(p.grad, "placements", None))
        grads[name] = (getattr(p.grad, "full_tensor", lambda g=p.grad: g)(), placed)
        p.grad = None
    return loss.detach(), grads


def check_setup(mesh, rms, sequence_parallel, embedding, dtensors, loss_in_last_block):
    """Eager, then seqfast's reference path and its kernels under the interpreter on the same
    compile, each against eager."""
    tp_mesh = mesh["tp"] if mesh.ndim == 2 else mesh

    def build(backend):
        model = parallelized(tp_mesh, rms, sequence_parallel, embedding, dtensors)
        model = compiled_per_block(model, backend, loss_in_last_block)
        return fully_sharded(model, mesh) if mesh.ndim == 2 else model

    torch._dynamo.reset()
    expected, expected_grads = step(build("eager"))
    torch._dynamo.reset()
    with collecting() as report:
        model = build("seqfast")
        paths = {"reference": step(model)}
        os.environ["SEQFAST_INTERPRET"] = "1"
        try:
            with counting_launches() as launched:
                paths["kernels"] = step(model)
        finally:
            del os.environ["SEQFAST_INTERPRET"]
    assert not any("runs as captured" in m.reason for m in report.missed), str(report)
    assert report.counts["attention"] >= 1 and report.counts["norm"] >= 2, str(report)
    assert_launched(launched, report.counts)
    for path, (loss, grads) in paths.items():
        torch.testing.assert_close(loss, expected, msg=lambda m, p=path: f"{p}: loss: {m}")
        assert grads.keys() == expected_grads.keys()
        for name, (grad, placed) in grads.items():
            want, want_placed = expected_grads[name]
            assert placed == want_placed, f"{path}: {name}: {placed} != {want_placed}"
            torch.testing.assert_close(
                grad, want, atol=1e-5, rtol=1e-4, msg=lambda m, p=path, n=name: f"{p}: {n}: {m}"
            )


SETUPS = {
    # the blocks take local tensors: the reduction's pending result, replicated or scattered
    "tp": dict(rms=False, sequence_parallel=False, embedding=Replicate(), dtensors=False),
    "tp-sp": dict(rms=True, sequence_parallel=True, embedding=Shard(1), dtensors=False),
    # the blocks take DTensors: the first replicated or sharded, the second sharded
    "tp-sp-dtensors-replicated": dict(
        rms=True, sequence_parallel=True, embedding=Replicate(), dtensors=True
    ),
    "tp-sp-dtensors-sharded": dict(
        rms=False, sequence_parallel=True, embedding=Shard(1), dtensors=True
    ),
}
RUNS = [
    ("tp", False), ("tp", True), ("tp-sp", False), ("tp-sp", True),
    ("tp-sp-dtensors-replicated", True), ("tp-sp-dtensors-sharded", False),
]  # fmt: skip
"""(setup, whether the loss is compiled inside the last block's graph) on two ranks."""
FSDP_RUNS = [("tp-sp", False), ("tp-sp", True), ("tp", False), ("tp", True)]
"""On a (2, 2) mesh, FSDP2 along its first dimension: the embedding's output sharded (sequence
parallel) or replicated, the loss compiled apart or in the last block's graph."""


def _worker(rank, store, shape, runs):
    torch.set_num_threads(1)
    with process_group(rank, math.prod(shape), store):
        names = ("dp", "tp") if len(shape) == 2 else None
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for setup, loss_in_last_block in runs:
            try:
                check_setup(mesh, **SETUPS[setup], loss_in_last_block=loss_in_last_block)
            except Exception as error:
                where = "the loss in the last block's graph" if loss_in_last_block else "apart"
                raise AssertionError(f"{setup}, loss compiled {where}: {error}") from error


@pytest.mark.parametrize("shape, runs", [((2,), RUNS), ((2, 2), FSDP_RUNS)], ids=["tp", "fsdp2-tp"])
def test_blocks_compiled_apart_train_as_eager(shape, runs):
    with tempfile.TemporaryDirectory() as folder:
        ranks = math.prod(shape)
        mp.spawn(_worker, args=(f"{folder}/store", shape, runs), nprocs=ranks, join=True)
