"""Memory the user owns and lays out as they like, which a compiled step writes: `.grad`s
(transposed, a slice of a larger buffer, views into one flat bucket at odd offsets, odd strides)
and buffers or outputs written in place. With `accumulate_grads` or without, on the reference and
on the kernels, each receives eager's values and keeps its object and layout, over two
micro-batches whose backwards run in reverse order. Where the accumulating backward was compiled
to the parameter's layout (Inductor), a `.grad` laid out otherwise goes through a counted copy."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from checks import AccumulatingCalls
from conftest import assert_close
from torch._subclasses.fake_tensor import FakeTensorMode

import seqcompile.ops.accumulate  # noqa: F401  (registers the seqfast::accumulate* ops)
from seqcompile.report import collecting
from seqcompile.run.copies import counting_copies

GRAD_LAYOUTS = ("transposed", "strided", "bucket", "odd", "materialized")
"""`.grad` layouts: the last two dimensions swapped in memory; a slice of wider rows (a step
along a vector); views of one flat buffer at odd offsets; transposed with a step along each
dimension; an expanded tensor cloned (contiguous)."""

MIXED = {
    "qkv.weight": "transposed",
    "qkv.bias": "bucket",
    "bias": "odd",
    "norm.weight": "materialized",
    "norm.bias": "strided",
    "head.weight": "strided",
    "head.bias": "bucket",
}
"""Every layout at once, one per parameter of `Block` (the default run's case; each layout for
every parameter is the slow tier's)."""


def laid_out(shape, layout, generator):
    """A random tensor of `shape` in `layout` (any but `bucket`), and the buffer it views."""
    matrix = len(shape) >= 2
    if layout == "transposed" and matrix:
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=generator)
        return base.transpose(-1, -2), base
    if layout == "strided":  # a slice of wider rows; every other element of a vector
        if matrix:
            base = torch.randn(*shape[:-1], shape[-1] + 3, generator=generator)
            return base[..., : shape[-1]], base
        base = torch.randn(2 * shape[0], generator=generator)
        return base[::2], base
    if layout == "odd":  # transposed, with a step along each of the last two dimensions
        if matrix:
            base = torch.randn(*shape[:-2], 3 * shape[-1], 2 * shape[-2], generator=generator)
            return base.transpose(-1, -2)[..., ::2, ::3], base
        base = torch.randn(3 * shape[0] + 1, generator=generator)
        return base[1::3], base
    if layout == "offset":
        base = torch.randn(math.prod(shape) + 3, generator=generator)
        return base[3:].view(shape), base
    if layout == "materialized":  # an expanded tensor, cloned: contiguous
        row = torch.randn(*[1] * (len(shape) - 1), shape[-1], generator=generator)
        view = row.expand(shape).clone()
        return view, view
    view = torch.randn(shape, generator=generator)  # contiguous (a vector "transposed" too)
    return view, view


def set_grads(model, layouts, seed):
    """Give each parameter a `.grad` of random values in its layout (`layouts`: by name, or one
    for all), those in `bucket` views of one flat buffer; the buffers the `.grad`s view."""
    generator = torch.Generator().manual_seed(seed)
    named = list(model.named_parameters())
    layout = {name: layouts if isinstance(layouts, str) else layouts[name] for name, _ in named}
    bucketed = [p for name, p in named if layout[name] == "bucket"]
    bucket = torch.randn(sum(p.numel() + 1 for p in bucketed) + 1, generator=generator)
    start = 1
    for p in bucketed:
        p.grad = bucket[start : start + p.numel()].view(p.shape)
        start += p.numel() + 1
    bases = [bucket]
    for name, p in named:
        if layout[name] != "bucket":
            p.grad, base = laid_out(p.shape, layout[name], generator)
            bases.append(base)
    return bases


class Block(torch.nn.Module):
    """Attention with a learned bias, a residual + LayerNorm, and a linear head + cross-entropy:
    each fused op that has a gradient to accumulate (the head's through its accumulation hook)."""

    def __init__(self, d=8, heads=2, length=4, vocab=16):
        super().__init__()
        self.heads, self.vocab = heads, vocab
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.bias = torch.nn.Parameter(0.1 * torch.randn(1, heads, length, length))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x, targets):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        h = self.norm(x + attended.transpose(1, 2).reshape(b, n, d))
        return F.cross_entropy(self.head(h).view(-1, self.vocab), targets.view(-1))


def batches(*shape_of_x, vocab=16, n=2):
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(*shape_of_x, generator=generator),
            torch.randint(0, vocab, shape_of_x[:-1], generator=generator),
        )
        for _ in range(n)
    ]


def forwards_then_backwards_reversed(step, inputs):
    """Forward A, forward B, backward B, backward A."""
    losses = [step(*args) for args in inputs]
    for loss in reversed(losses):
        loss.backward()


def layout_of(t):
    """Which tensor `t` is, and where its elements lie."""
    return id(t), t.stride(), t.storage_offset(), t.data_ptr()


def assert_written_as_eager(compiled_model, eager_model, compiled_bases, eager_bases, before):
    """Every `.grad` is the tensor it was, laid out as it was, with eager's values; the memory
    around the views (their buffers) as eager left it."""
    for (name, p), e, was in zip(
        compiled_model.named_parameters(), eager_model.parameters(), before, strict=True
    ):
        assert layout_of(p.grad) == was, f"{name}: .grad replaced or laid out anew"
        assert p.grad.stride() == e.grad.stride(), f"{name}: eager's layout differs"
        assert_close(p.grad, e.grad)
    for got, want in zip(compiled_bases, eager_bases, strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("layouts", ["mixed", pytest.param("each", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "accumulate_grads, rest",
    [
        (True, "eager"),
        (True, "inductor"),
        (False, "eager"),
        pytest.param(False, "inductor", marks=pytest.mark.slow),  # autograd accumulates
    ],
    ids=[
        "accumulate_grads-eager",
        "accumulate_grads-inductor",
        "default-eager",
        "default-inductor",
    ],
)
@pytest.mark.kernels(
    "attention_fwd", "attention_bwd_dkdv:with_dq", "add_norm_fwd", "add_norm_bwd", "cross_entropy"
)
@pytest.mark.rotating(2)  # half the cases per run, in turn: the default run has a time budget
def test_grads_in_any_layout_receive_eagers_sum(impl, accumulate_grads, rest, layouts, caplog):
    """One compiled step serves every layout in turn: Dynamo guards no `.grad`."""
    torch.manual_seed(0)
    model = Block()
    inputs = batches(2, 4, 8)
    options = {"accumulate_grads": accumulate_grads, "rest": rest}
    step = torch.compile(model, backend="seqfast", options=options)
    copied_in_all = 0
    with collecting() as report, caplog.at_level("INFO", logger="seqcompile"):
        for layout in [MIXED] if layouts == "mixed" else GRAD_LAYOUTS:
            caplog.clear()
            eager = copy.deepcopy(model)
            eager_bases = set_grads(eager, layout, seed=2)
            bases = set_grads(model, layout, seed=2)
            before = [layout_of(p.grad) for p in model.parameters()]
            forwards_then_backwards_reversed(eager, inputs)
            losses = [step(*args) for args in inputs]
            with counting_copies() as copies, AccumulatingCalls() as calls:
                for loss in reversed(losses):
                    loss.backward()
            assert (calls.count > 0) == accumulate_grads
            assert_written_as_eager(model, eager, bases, eager_bases, before)
            # Inductor's accumulating backward takes each .grad at its parameter's strides:
            # another layout is accumulated in a copy, counted once per micro-batch
            other = sum(p.grad.stride() != p.stride() for p in model.parameters())
            copied = 2 * other if accumulate_grads and rest == "inductor" else 0
            grads = {label: n for label, n in copies.items() if label.startswith("accumulate")}
            assert sum(grads.values()) == copied, f"{layout}: {grads}"
            copied_in_all += copied
            assert ("accumulated in a copy" in caplog.text) == (copied > 0), "logged once"
    fused = {family: report.counts[family] for family in ("attention", "norm", "loss")}
    assert fused == {"attention": 1, "norm": 1, "loss": 1}
    said = {label: n for label, n in report.copies.items() if label.startswith("accumulate")}
    assert sum(said.values()) == copied_in_all, "the report counts the copies of every step"
    assert all(f"{label}: {n}x" in str(report) for label, n in said.items())


class OddParameters(torch.nn.Module):
    """A transposed leaf, whose gradient is a transposed product (accumulated as the product of
    the transposes), and a parameter whose gradient is a sum's, expanded (stride 0), unlike the
    `.grad` it goes into."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 16).t())
        self.s = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, targets):
        return (x @ self.w.t()).relu().sum() + self.s.sum() * targets.float().mean()


@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_parameters_not_laid_out_as_their_gradients_accumulate(rest):
    torch.manual_seed(0)
    model = OddParameters()
    eager = copy.deepcopy(model)
    inputs = batches(3, 8)
    forwards_then_backwards_reversed(eager, inputs)
    step = torch.compile(model, backend="seqfast", options={"accumulate_grads": True, "rest": rest})
    forwards_then_backwards_reversed(step, inputs)
    for p, e in zip(model.parameters(), eager.parameters(), strict=True):
        assert p.grad.stride() == e.grad.stride() == p.stride()
        assert_close(p.grad, e.grad)


@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_an_expanded_grad_fails_as_in_eager(rest):
    """Adding into a `.grad` whose elements share memory is an error in eager; so it is here,
    with eager's message, not a wrong sum."""
    linear = torch.nn.Linear(4, 3)
    linear.weight.grad = torch.zeros(1, 4).expand(3, 4)
    options = {"accumulate_grads": True, "rest": rest}
    loss = torch.compile(linear, backend="seqfast", options=options)(torch.randn(2, 4)).sum()
    with pytest.raises(RuntimeError, match="refers to a single memory location"):
        loss.backward()


class Stats(torch.nn.Module):
    """Buffers the forward writes (a running mean with `mul_`/`add_`, a `copy_`, an `add_`)
    and an output it writes in place, around a residual + LayerNorm and a linear head +
    cross-entropy."""

    def __init__(self, d=8, length=4, vocab=16):
        super().__init__()
        self.vocab = vocab
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("running", torch.zeros(d))
        self.register_buffer("seen", torch.zeros(length, d))
        self.register_buffer("total", torch.zeros(length, d))

    def forward(self, x, y, targets, out):
        h = self.norm(x + y)
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * h.mean((0, 1)))
            self.seen.copy_(h[0] * 2)
            self.total.add_(h[1])
        out.copy_(torch.relu(h.detach()) * 2 + 1)
        return F.cross_entropy(self.head(h).view(-1, self.vocab), targets.view(-1))


WRITTEN_MIXED = {"running": "offset", "seen": "transposed", "total": "strided", "out": "odd"}
"""Each tensor `Stats` writes in a layout of its own (the default run's case)."""


def stats_writing(layout):
    """A `Stats` whose buffers, and the outputs of two calls, are laid out as `layout` says (by
    name); those tensors and the buffers they view."""
    torch.manual_seed(0)
    model = Stats()
    generator = torch.Generator().manual_seed(3)
    shapes = {name: b.shape for name, b in model.named_buffers()}
    written, bases = [], []
    for name, shape in [*shapes.items(), ("out", (2, 4, 8)), ("out", (2, 4, 8))]:
        view, base = laid_out(shape, layout[name], generator)
        if name in shapes:
            setattr(model, name, view)
        written.append(view)
        bases.append(base)
    return model, written, bases


@pytest.mark.parametrize(
    "layouts",
    [
        pytest.param(WRITTEN_MIXED, id="mixed"),
        *(
            pytest.param(layout, marks=pytest.mark.slow)
            for layout in ("transposed", "strided", "offset", "odd")
        ),
    ],
)
@pytest.mark.parametrize("rest", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("accumulate_grads", [False, True], ids=["default", "accumulate_grads"])
@pytest.mark.kernels("add_norm_fwd", "pointwise:forward", "cross_entropy")
def test_buffers_and_outputs_written_in_place_keep_their_layout(
    impl, accumulate_grads, rest, layouts
):
    layout = dict.fromkeys(WRITTEN_MIXED, layouts) if isinstance(layouts, str) else layouts
    eager, eager_written, eager_bases = stats_writing(layout)
    model, written, bases = stats_writing(layout)
    generator = torch.Generator().manual_seed(5)
    inputs = [(x, torch.randn(x.shape, generator=generator), t) for x, t in batches(2, 4, 8)]
    before = [layout_of(t) for t in written]
    forwards_then_backwards_reversed(
        eager, [(*args, out) for args, out in zip(inputs, eager_written[-2:], strict=True)]
    )
    options = {"accumulate_grads": accumulate_grads, "rest": rest}
    step = torch.compile(model, backend="seqfast", options=options)
    forwards_then_backwards_reversed(
        step, [(*args, out) for args, out in zip(inputs, written[-2:], strict=True)]
    )
    assert [layout_of(t) for t in [*model.buffers(), *written[-2:]]] == before
    for got, want in zip(bases, eager_bases, strict=True):
        assert_close(got, want)
    for p, e in zip(model.parameters(), eager.parameters(), strict=True):
        assert_close(p.grad, e.grad)


def accumulation_calls(grad):
    """Each accumulation op's arguments after `grad`, and the sum it must leave in `grad`."""
    generator = torch.Generator().manual_seed(6)
    a, b = torch.randn(4, 3, generator=generator), torch.randn(3, 8, generator=generator)
    update, scale = torch.randn(4, 8, generator=generator), torch.tensor(0.5)
    rows, indices = torch.randn(5, 8, generator=generator), torch.tensor([0, 1, 1, 3, 2])
    kept = indices != 1  # the padding row is left out
    seqfast = torch.ops.seqfast
    return {
        seqfast.accumulate_matmul_: ((a, b), grad + a @ b),
        seqfast.accumulate_scaled_: ((update, scale), grad + update * scale),
        seqfast.accumulate_rows_: (
            (rows, indices, 1),
            grad.index_add(0, indices[kept], rows[kept]),
        ),
        seqfast.accumulate_: ((update,), grad + update),
    }


@pytest.mark.parametrize("layout", ["transposed", "strided", "offset", "odd"])
def test_accumulation_ops_add_in_place_as_their_fakes_say(layout):
    """Each op adds into `grad` where it lies, the tensor and its strides kept, and its fake
    implementation, which compiled graphs are planned by, leaves a fake `grad` so too."""

    def grad():
        return laid_out((4, 8), layout, torch.Generator().manual_seed(7))[0]

    for op, (args, expected) in accumulation_calls(grad()).items():
        written = grad()
        was = layout_of(written)
        op(written, *args)
        assert layout_of(written) == was, op
        assert_close(written, expected)
        with FakeTensorMode() as mode:
            fake = mode.from_tensor(grad())
            op(fake, *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert (fake.shape, fake.stride(), fake.storage_offset()) == (
            written.shape,
            was[1],
            was[2],
        ), op
