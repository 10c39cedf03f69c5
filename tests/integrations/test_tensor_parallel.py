"""Tensor parallelism through DTensor (`parallelize_module` with column- and row-wise linears,
`SequenceParallel` norms) compiles with seqfast: capture keeps every op on a DTensor as a node of
its own, the families fuse the local computation between them (norms, attention, the loss), and
the loss and every gathered gradient match the same parallel setup under `backend="eager"`. A
graph on a tensor subclass the stages fail on runs as Dynamo captured it, with a warning and the
reason in the report, never a crash.

Also cross-entropy over logits sharded along the vocabulary under `loss_parallel` (DTensor's,
with its distributed reduction), FSDP2 over tensor parallelism on a (2, 2) mesh, and dropout:
fused on a replicated local tensor with the same mask on every rank, drawn by DTensor (as
eagerly) on a sharded DTensor. One rank in-process in the default run; two (four for the 2-D
mesh) gloo processes in the slow tier."""

import contextlib
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import checkpoint

from seqcompile import backend, capture
from seqcompile.codegen.launches import counting_launches
from seqcompile.ops import registry
from seqcompile.ops.fused_op import by_name
from seqcompile.patterns.engine import dtensor_refusal
from seqcompile.report import collecting

VOCAB, WIDTH, HEADS, LAYERS, BATCH, LENGTH = 64, 32, 4, 2, 2, 8


class Attention(nn.Module):
    """Separate q, k, v projections, heads read as `-1` (each rank holds its share of them)."""

    def __init__(self):
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in "qkvo")

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class GELUMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = (nn.Linear(WIDTH, 2 * WIDTH, bias=False) for _ in "13")
        self.w2 = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, rms):
        super().__init__()
        norm = nn.RMSNorm if rms else nn.LayerNorm
        self.n1, self.n2 = norm(WIDTH), norm(WIDTH)
        self.attn, self.mlp = Attention(), SwiGLU() if rms else GELUMLP()

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Model(nn.Module):
    def __init__(self, rms=False, checkpointed=False):
        super().__init__()
        self.checkpointed = checkpointed
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(rms) for _ in range(LAYERS))
        self.norm = (nn.RMSNorm if rms else nn.LayerNorm)(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def parallelized(mesh, rms=False, sequence_parallel=False, checkpointed=False, vocab=False):
    """The model sharded with the usual plan: q, k, v and the MLP's first linears column-wise,
    the output projections row-wise; with sequence parallelism, the norms over shards of the
    sequence, the embedding's output and the head's input sharded along it too; with `vocab`,
    the head column-wise, its logits left sharded along the vocabulary for `loss_parallel`."""
    torch.manual_seed(0)
    model = Model(rms, checkpointed)
    between = Shard(1) if sequence_parallel else Replicate()
    for block in model.blocks:
        mlp = {
            name: ColwiseParallel() for name in ("mlp.w1", "mlp.w3") if hasattr(block.mlp, name[4:])
        }
        plan = {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=between),
            **mlp, "mlp.w2": RowwiseParallel(output_layouts=between),
        }  # fmt: skip
        if sequence_parallel:
            gather = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan |= {
                "n1": SequenceParallel(),
                "n2": SequenceParallel(),
                "attn": gather,
                "mlp": gather,
            }
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        parallelize_module(model, mesh, {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })  # fmt: skip
    if vocab:
        head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model, mesh, {"head": head})
    return model


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(VOCAB, (BATCH, LENGTH), generator=g), torch.randint(
        VOCAB, (BATCH, LENGTH), generator=g
    )


def step(model, compile_backend, per_block=False):
    """The loss and every parameter's gradient, gathered whole (the loss under `loss_parallel`
    where the head leaves its logits sharded along the vocabulary)."""
    if per_block:
        for block in model.blocks:
            block.compile(backend=compile_backend)
        run = model
    else:
        run = torch.compile(model, backend=compile_backend)
    vocab_sharded = isinstance(model.head.weight, DTensor) and not isinstance(
        model.head.weight.placements[0], Replicate
    )
    with loss_parallel() if vocab_sharded else contextlib.nullcontext():
        loss = run(*batch())
        loss.backward()
    loss = getattr(loss, "full_tensor", lambda: loss)()
    grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in model.parameters()]
    return loss.detach(), grads


def fully_sharded(mesh, **setup):
    """On a ("dp", "tp") mesh: tensor parallel along "tp", then FSDP2 along "dp", per block and
    at the root, as torchtitan composes them."""
    from torch.distributed.fsdp import fully_shard

    model = parallelized(mesh["tp"], **setup)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def check_against_eager(mesh, fused, missed, **setup):
    """Run the setup under eager and seqfast; assert the loss, the gradients and what fused."""
    per_block = setup.pop("per_block", False)
    build = fully_sharded if setup.pop("fsdp", False) else parallelized
    expected, expected_grads = step(build(mesh, **setup), "eager", per_block)
    torch._dynamo.reset()
    with collecting() as report:
        got, grads = step(build(mesh, **setup), "seqfast", per_block)
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    for family, n in fused.items():
        assert report.counts[family] == n, str(report)
    reasons = [m.reason for m in report.missed]
    for needle in missed:
        assert any(needle in r for r in reasons), reasons
    return report


@contextlib.contextmanager
def process_group(rank, world_size, store, backend="gloo"):
    address = f"file://{store}"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_mesh(tmp_path_factory):
    """One process group and mesh for the module: AOTAutograd (torch 2.13, `aot_eager` too) can
    fail to partition a DTensor graph compiled after the process group was made anew ("Node
    tangents_2 was invalid, but is output"), which a training run never does."""
    with process_group(0, 1, tmp_path_factory.mktemp("group") / "store"):
        yield init_device_mesh("cpu", (1,))


KEPT = "DTensor conversions, kept whole and run as DTensor dispatches them: from_local"
VOCABULARY = (
    "cross_entropy on DTensors: its DTensors are placed logits Shard(dim=1), and it shards only"
    " rows"
)


def test_the_computation_between_dtensor_conversions_fuses(one_rank_mesh):
    report = check_against_eager(
        one_rank_mesh, {"norm": 2 * LAYERS + 1, "attention": LAYERS, "loss": 1}, [KEPT]
    )
    (kept,) = [m.reason for m in report.missed]
    assert "redistribute (12)" in kept and "to_local (12)" in kept and "linear" not in kept


@pytest.mark.parametrize(
    "setup, fused, missed",
    [
        pytest.param(  # the default run compiles tensor parallelism in the test above
            {"sequence_parallel": True},
            {"norm": 2 * LAYERS + 1, "loss": 1},
            [KEPT],
            marks=pytest.mark.slow,
        ),
        pytest.param(  # the refusal's path is the normalized-dim case's; both ranks: slow tier
            {"vocab": True},
            {"norm": 2 * LAYERS + 1, "loss": 0},
            [VOCABULARY],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["sequence-parallel-norms-fuse", "vocabulary-sharded-loss-refused"],
)
def test_ops_on_dtensors_fuse_where_their_placements_allow(one_rank_mesh, setup, fused, missed):
    """The norms on sequence shards fuse into `add_norm` on DTensors; a loss over logits
    sharded along the vocabulary is refused with the reason, and DTensor computes it."""
    check_against_eager(one_rank_mesh, fused, missed, **setup)


@pytest.mark.slow
def test_dtensor_ops_inside_checkpointed_blocks_are_kept_too(one_rank_mesh):
    check_against_eager(
        one_rank_mesh, {"norm": 2 * LAYERS + 1, "attention": LAYERS, "loss": 1}, [KEPT],
        checkpointed=True,
    )  # fmt: skip


def _norm_of_sum(x, r, w, b):
    return F.layer_norm(x + r, (WIDTH,), w, b)


@pytest.mark.parametrize("dim, fuses", [(1, True), (2, False)], ids=["rows", "normalized-dim"])
def test_a_norm_on_dtensors_fuses_only_where_its_rows_are_sharded(one_rank_mesh, dim, fuses):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(BATCH, LENGTH, WIDTH, generator=g, requires_grad=True) for _ in "xr")
    w, b = (torch.randn(WIDTH, generator=g, requires_grad=True) for _ in "wb")
    place = [Shard(dim), Shard(dim), Replicate(), Replicate()]
    inputs = [distribute_tensor(t.detach(), one_rank_mesh, [p]).requires_grad_()
              for t, p in zip((x, r, w, b), place, strict=True)]  # fmt: skip
    with collecting() as report:
        out = torch.compile(_norm_of_sum, backend="seqfast")(*inputs)
        out.full_tensor().pow(2).sum().backward()
    expected = _norm_of_sum(x, r, w, b)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out.full_tensor(), expected)
    for got, leaf in zip(inputs, (x, r, w, b), strict=True):
        torch.testing.assert_close(got.grad.full_tensor(), leaf.grad, atol=1e-5, rtol=1e-4)
    assert report.counts["norm"] == (1 if fuses else 0), str(report)
    if not fuses:
        (reason,) = [m.reason for m in report.missed if m.pattern == "norm"]
        assert reason == (  # the replicated weight and bias are not listed
            "add_norm on DTensors: its DTensors are placed x Shard(dim=2), residual Shard(dim=2),"
            " and it shards only rows (any dimension but the last, which it normalizes)"
        )


def test_a_norm_on_sequence_shards_fuses_at_symbolic_sizes(one_rank_mesh):
    """Compiled with dynamic shapes, one graph serves two sequence lengths."""
    compiled = torch.compile(_norm_of_sum, backend="seqfast", dynamic=True)
    place = [Shard(1), Shard(1), Replicate(), Replicate()]
    with collecting() as report:
        for length in (LENGTH, LENGTH + 4):
            g = torch.Generator().manual_seed(length)
            whole = [torch.randn(BATCH, length, WIDTH, generator=g) for _ in "xr"]
            whole += [torch.randn(WIDTH, generator=g) for _ in "wb"]
            pairs = zip(whole, place, strict=True)
            inputs = [distribute_tensor(t, one_rank_mesh, [p]) for t, p in pairs]
            got = compiled(*inputs).full_tensor()
            torch.testing.assert_close(got, _norm_of_sum(*whole))
    assert report.counts["norm"] == 1 and len(report.graphs) == 1, str(report)


def test_an_op_on_dtensors_whose_trace_fails_is_kept_whole(one_rank_mesh, monkeypatch):
    """The failure comes after the op's nodes were traced: they are taken out, the op is
    recorded as one node that DTensor runs, and the rest still fuses."""
    traced, failed = torch.fx.Interpreter.run_node, []

    def failing_once(interpreter, node):
        out = traced(interpreter, node)
        if node.target is F.gelu and not failed:
            failed.append(node)
            raise RuntimeError("this op does not trace")
        return out

    monkeypatch.setattr(torch.fx.Interpreter, "run_node", failing_once)
    captured = []
    trace = capture.trace_pre_dispatch
    monkeypatch.setattr(
        capture, "trace_pre_dispatch", lambda *a: captured.append(trace(*a)) or captured[-1]
    )

    def fn(x, w, b):
        return F.layer_norm(F.gelu(x) * 2, (WIDTH,), w, b)

    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(BATCH, LENGTH, WIDTH, generator=g), torch.randn(WIDTH, generator=g),
             torch.randn(WIDTH, generator=g)]  # fmt: skip
    place = [Shard(1), Replicate(), Replicate()]
    inputs = [distribute_tensor(t, one_rank_mesh, [p]) for t, p in zip(whole, place, strict=True)]
    with collecting() as report:
        out = torch.compile(fn, backend="seqfast")(*inputs)
    torch.testing.assert_close(out.full_tensor(), fn(*whole))
    assert failed and report.counts["norm"] == 1, str(report)
    (kept,) = [m.reason for m in report.missed if m.pattern == "dtensor"]
    assert kept.endswith("DTensor dispatches them: gelu (1)"), kept
    targets = [n.target for n in captured[0].graph.nodes]
    assert F.gelu in targets and torch.ops.aten.gelu.default not in targets  # nothing half-traced


def test_dtensors_beside_plain_tensors_are_refused(one_rank_mesh):
    op = registry.entry_named("add_norm").forward
    x = distribute_tensor(torch.randn(BATCH, LENGTH, WIDTH), one_rank_mesh, [Shard(1)])
    args = by_name(op, x=x, residual=None, branch_bias=None, weight=torch.ones(WIDTH),
                   bias=None, seed=None, stream=0, p=0.0, eps=1e-5, rms=True,
                   out_dtype=torch.float32, sum_dtype=torch.float32)  # fmt: skip
    assert dtensor_refusal(op, args) == (
        "add_norm on DTensors: it would take DTensors and plain tensors together (weight plain),"
        " which DTensor does not run"
    )
    replicated = distribute_tensor(torch.ones(WIDTH), one_rank_mesh, [Replicate()])
    assert dtensor_refusal(op, (*args[:3], replicated, *args[4:])) is None


def _failing_stage(monkeypatch):
    def failing(captured, state):
        raise RuntimeError("the stage cannot read this value\nmore detail")

    monkeypatch.setattr(backend, "STAGES", (backend.capture, failing))
    return "on which RuntimeError: the stage cannot read this value"


def _failing_first_call(monkeypatch):
    def differentiate(fused, state):
        def run(*args):
            raise RuntimeError("the runtime cannot save this value\nmore detail")

        return run

    stages = [differentiate if s is backend.differentiate else s for s in backend.STAGES]
    monkeypatch.setattr(backend, "STAGES", stages)
    return "on which its first call raised RuntimeError: the runtime cannot save this value"


@pytest.mark.parametrize("failing", [_failing_stage, _failing_first_call], ids=["stage", "call"])
def test_a_subclass_graph_seqfast_fails_on_runs_as_captured(monkeypatch, failing):
    """A failure stands in for any a subclass meets, at compile or at the first call; without a
    subclass it still raises, as a bug should."""
    said = failing(monkeypatch)

    def fn(x):
        return torch.tanh(x) * 2

    x = torch.randn(3, 4)
    with collecting() as report, pytest.warns(UserWarning, match="runs as captured"):
        compiled = torch.compile(fn, backend="seqfast")
        got, again = compiled(TwoTensor(x, x * 3)), compiled(TwoTensor(x * 2, x))
    for out, (a, b) in ((got, (x, x * 3)), (again, (x * 2, x))):
        expected = fn(TwoTensor(a, b))
        torch.testing.assert_close(out.a, expected.a)
        torch.testing.assert_close(out.b, expected.b)
    (line,) = [m.reason for m in report.missed]
    assert f"it holds a TwoTensor, {said}" in line
    torch._dynamo.reset()
    with pytest.raises(Exception, match="cannot (read|save) this value"):
        torch.compile(fn, backend="seqfast")(x)


KERNELS = {
    "attention": ("attention_fwd", "attention_bwd_dkdv:with_dq"),
    "norm": ("add_norm_fwd", "add_norm_bwd"),
    "loss": ("cross_entropy",), "pointwise": ("pointwise:forward", "pointwise:backward"),
}  # fmt: skip
"""Kernels a family's fused sites launch, forward and backward."""


def assert_launched(launched, fused):
    """Each family that fused launched its kernels on this rank (the kernel path ran)."""
    for family, sites in fused.items():
        for kernel in KERNELS[family] if sites else ():
            assert launched.of(kernel) > 0, f"{family}: no {kernel} launched: {launched.names()}"


def _worker(rank, store, setup, fused, missed, kernels):
    torch.set_num_threads(1)
    if kernels:
        os.environ["SEQFAST_INTERPRET"] = "1"
    shape = setup.pop("mesh", (2,))
    with process_group(rank, math.prod(shape), store), counting_launches() as launched:
        names = ("dp", "tp") if len(shape) == 2 else None
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        check_against_eager(mesh, fused, missed, **setup)
    if kernels:
        assert_launched(launched, fused)


NORMS = 2 * LAYERS + 1
SETUPS = {
    "layer-norm": ({}, {"norm": NORMS, "attention": LAYERS, "loss": 1}, [KEPT]),
    "rms-norm": ({"rms": True}, {"norm": NORMS, "attention": LAYERS, "loss": 1}, [KEPT]),
    "sequence-parallel-rms-norm": (
        {"sequence_parallel": True, "rms": True}, {"norm": NORMS, "attention": LAYERS, "loss": 1},
        [KEPT],
    ),
    "per-block": ({"per_block": True}, {"norm": 2, "attention": 1}, [KEPT]),  # one graph, reused
    "sequence-parallel": (
        {"sequence_parallel": True}, {"norm": NORMS, "attention": LAYERS, "loss": 1}, [KEPT]
    ),
    "loss-parallel": (
        {"vocab": True}, {"norm": NORMS, "attention": LAYERS, "loss": 0}, [VOCABULARY]
    ),
    # FSDP2's hooks end a graph at each block: one block's graph, reused
    "fsdp2-tp": ({"fsdp": True, "mesh": (2, 2)}, {"norm": 2, "attention": 1}, [KEPT]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernels"])
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_two_ranks_match_eager(name, kernels):
    setup, fused, missed = SETUPS[name]
    ranks = math.prod(setup.get("mesh", (2,)))
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(
            _worker,
            args=(f"{folder}/store", setup, fused, missed, kernels),
            nprocs=ranks,
            join=True,
        )


class Dropped(nn.Module):
    """A row-wise linear, then dropout: on the replicated output as a plain tensor, or on its
    sequence shards as a DTensor."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        y = F.dropout(self.w(x), 0.5, True)
        return (y.to_local() if isinstance(y, DTensor) else y) * 3


DRAWS_DROPOUT = "its DTensors are sharded (inputs[0] Shard(dim=1)), and it draws dropout"


def _dropout_mask(mesh, sharded, compile_backend):
    torch.manual_seed(0)  # every rank draws the same numbers, as tensor parallelism needs
    model = Dropped().to(mesh.device_type)
    style = RowwiseParallel(
        input_layouts=Replicate(),
        output_layouts=Shard(1) if sharded else Replicate(),
        use_local_output=not sharded,
    )
    parallelize_module(model, mesh, {"w": style})
    ones = torch.ones(BATCH, LENGTH, WIDTH, device=mesh.device_type)
    return torch.compile(model, backend=compile_backend)(ones) != 0


def _dropout_worker(rank, store, sharded, device):
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    with process_group(rank, 2, store, "nccl" if device == "cuda" else "gloo"):
        mesh = init_device_mesh(device, (2,))
        with collecting() as report:
            kept = _dropout_mask(mesh, sharded, "seqfast")
        assert 0.3 < kept.float().mean() < 0.7
        gathered = [torch.empty_like(kept) for _ in range(2)]
        dist.all_gather(gathered, kept)
        if sharded:  # a DTensor's dropout: refused, and DTensor draws it, as eagerly
            assert report.counts["pointwise"] == 0, str(report)
            assert any(DRAWS_DROPOUT in m.reason for m in report.missed), str(report)
            assert torch.equal(kept, _dropout_mask(mesh, sharded, "eager"))
            # DTensor's generator offsets each shard's draws on CUDA; on CPU it has none, and
            # each rank draws as a plain tensor does (eagerly too)
            assert torch.equal(gathered[0], gathered[1]) == (device == "cpu")
        else:  # fused, the same mask on every rank, or the ranks' copies would drift apart
            assert report.counts["pointwise"] == 1, str(report)
            assert torch.equal(gathered[0], gathered[1])


def _dropout_masks(sharded, device):
    with tempfile.TemporaryDirectory() as folder:
        args = (f"{folder}/store", sharded, device)
        mp.spawn(_dropout_worker, args=args, nprocs=2, join=True)


SHARDING = pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sequence-sharded"])


@pytest.mark.slow
@SHARDING
def test_dropout_masks_agree_where_replicated_and_are_dtensors_where_sharded(sharded):
    _dropout_masks(sharded, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@SHARDING
def test_dropout_masks_differ_between_shards_on_cuda(sharded):
    _dropout_masks(sharded, "cuda")
