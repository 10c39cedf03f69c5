"""seqfast::pointwise and its derived backward, called directly on regions built from plain
functions: the generated kernels (Triton's interpreter) and the reference, each against the same
function run eagerly in float64, forward and every gradient, on broadcast shapes."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES

from seqcompile.ops.pointwise import region as regions
from seqcompile.ops.pointwise.kernels import compile_time_specs  # (also registers the op)
from seqcompile.ops.random import keep_mask
from seqcompile.patterns.pointwise_cut import region_of_function

pytestmark = pytest.mark.kernels("pointwise:forward", "pointwise:backward")

pointwise = torch.ops.seqfast.pointwise
SEED = torch.tensor(987654321, dtype=torch.int64)


def new_gelu(x):
    """GPT-2's NewGELU, written out."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


# name -> (function, shapes of its inputs; "pos" marks a positive input, "bool" a mask)
UNARY = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "new_gelu": new_gelu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "neg": torch.neg,
    "abs": torch.abs,
    "erf": torch.erf,
    "square": torch.square,
    "pow3": lambda x: x**3,
    "pow_neg2": lambda x: x**-2.0,
    "pow5": lambda x: x**5,
    "two_to_the": lambda x: 2**x,
    "constant_base_below_one": lambda x: torch.pow(0.3, x) * x,
    "clamp": lambda x: x.clamp(-0.5, 0.7),
    "clamp_max_only": lambda x: x.clamp(max=0.3) + x.clamp(min=-0.2),
    "half_cast": lambda x: x.to(torch.float16).float() * 3,
    "scalar_ops": lambda x: (2.0 - x) / 3 + 1.5 * x - 0.25,
}
POSITIVE = {
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "pow1.5": lambda x: x**1.5,
    "reciprocal": torch.reciprocal,
}
BINARY = {
    "add_bias": (lambda x, b: x + b, (7,)),
    "sub_row": (lambda x, r: x - r, (3, 5, 1)),
    "mul_middle": (lambda x, m: x * m, (3, 1, 7)),
    "div_scalar_tensor": (lambda x, s: x / s, ()),
    "swiglu": (lambda a, b: F.silu(a) * b, (3, 5, 7)),
    "geglu": (lambda a, b: F.gelu(a) * b, (3, 5, 7)),
    "maximum": (lambda a, b: torch.maximum(a, b), (5, 7)),
    "alpha_add": (lambda a, b: torch.add(a, b, alpha=-2), (1, 7)),
}
SHAPE = (3, 5, 7)


def make(shape, *, positive=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g)
    if positive:
        t = t.abs() + 0.3
    return t.to(dtype).requires_grad_()


def run(fn, inputs, *, p=(), stream=0, grads_seed=5):
    """Fused forward and backward of `fn`, and the same in float64 eager with the fused op's
    dropout masks; returns (fused outputs, fused grads, eager outputs, eager grads)."""
    region = region_of_function(fn, inputs)
    outs = pointwise(list(inputs), SEED if p else None, stream, region.key)
    shape = outs[0].shape
    g = torch.Generator().manual_seed(grads_seed)
    cotangents = [
        torch.randn(o.shape, generator=g).to(o.dtype) for o in outs if o.is_floating_point()
    ]
    diff = [t for t in inputs if t.requires_grad]
    fused_grads = torch.autograd.grad(
        [o for o in outs if o.is_floating_point()], diff, cotangents, allow_unused=True
    )
    wide = [
        t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t
        for t in inputs
    ]
    masks = iter(keep_mask(SEED, shape, stream + k, q) for k, q in enumerate(p))
    with _dropout_from(masks):
        expected = fn(*wide)
    expected = list(expected) if isinstance(expected, tuple | list) else [expected]
    eager_grads = torch.autograd.grad(
        [e for e in expected if e.is_floating_point()],
        [t for t in wide if t.requires_grad],
        [c.double() for c in cotangents],
        allow_unused=True,
    )
    return outs, fused_grads, expected, eager_grads


class _dropout_from:
    """Within the block, F.dropout applies the given keep-masks in order."""

    def __init__(self, masks):
        self.masks = masks

    def __enter__(self):
        self.original = F.dropout
        F.dropout = lambda x, p=0.5, training=True, inplace=False: torch.where(
            next(self.masks), x / (1 - p), 0.0
        )

    def __exit__(self, *exc):
        F.dropout = self.original


def check(outs, fused_grads, expected, eager_grads, dtype=torch.float32):
    tol = TOLERANCES[dtype]
    assert len(outs) == len(expected)
    for o, e in zip(outs, expected, strict=True):
        want = e.to(o.dtype) if o.is_floating_point() else e
        torch.testing.assert_close(o, want, **tol)
    for a, e in zip(fused_grads, eager_grads, strict=True):
        assert (a is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(a, e.to(a.dtype), **tol)


@pytest.mark.parametrize("name", sorted(UNARY) + sorted(POSITIVE))
def test_every_unary_op_alone(impl, name):
    fn = UNARY.get(name) or POSITIVE[name]
    check(*run(fn, [make(SHAPE, positive=name in POSITIVE)]))


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.kernels("pointwise:forward")  # x + bias needs no backward kernel
def test_binary_ops_on_broadcast_shapes(impl, name):
    fn, other = BINARY[name]
    positive = name.startswith("div")
    check(*run(fn, [make(SHAPE), make(other, positive=positive, seed=1)]))


@pytest.mark.parametrize("base", [3.5, 0.5, 1, 0.0, -1, -2.0])
def test_a_constant_base_at_special_exponents(impl, base):
    """Integer, half and infinite exponents and NaN; a negative base is real at integers only
    (negative at the odd ones). The gradient is `base ** x * ln(base)`, NaN below zero."""
    x = torch.tensor(
        [-3.0, -2.0, -1.5, -1.0, -0.25, 0.0, 0.5, 1.0, 2.0, 3.0, 7.0, math.inf, -math.inf, math.nan]
    ).requires_grad_()
    region = region_of_function(lambda t: torch.pow(base, t), [x])
    (out,) = pointwise([x], None, 0, region.key)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    wide = x.detach().double().requires_grad_()
    expected = torch.pow(base, wide)
    (expected_grad,) = torch.autograd.grad(expected, wide, torch.ones_like(expected))
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out, expected.float(), **tol, equal_nan=True)
    torch.testing.assert_close(grad, expected_grad.float(), **tol, equal_nan=True)


def test_masks_where_comparisons_and_bool_outputs(impl):
    def fn(x, mask, r):
        keep = (x > 0.1) & ~mask
        y = torch.where(keep, x * r, -x).masked_fill(x.abs() > 1.5, 0.25)
        return y, keep

    mask = torch.rand(3, 1, 7, generator=torch.Generator().manual_seed(2)) > 0.5
    outs, fg, expected, eg = run(fn, [make(SHAPE), mask, make((5, 1), seed=3)])
    assert outs[1].dtype is torch.bool
    check(outs, fg, expected, eg)


def test_a_chain_with_several_outputs(impl):
    """A value used inside and outside the region is an output; each gets its own gradient."""

    def fn(x, b, r):
        h = F.gelu(x + b)
        s = r + h * 0.5
        return h, s, torch.sigmoid(s)

    check(*run(fn, [make(SHAPE), make((7,), seed=1), make(SHAPE, seed=2)]))


def test_integer_inputs_promote(impl):
    def fn(x, ids):
        return (1 - ids) * -1e4 + x * ids

    ids = torch.randint(0, 2, (3, 1, 7))
    check(*run(fn, [make(SHAPE), ids]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(impl, dtype):
    def fn(x, b):
        return F.gelu(x + b) * torch.sigmoid(x)

    outs, fg, expected, eg = run(fn, [make(SHAPE, dtype=dtype), make((7,), seed=1, dtype=dtype)])
    assert outs[0].dtype is dtype and fg[0].dtype is dtype and fg[1].dtype is dtype
    check(outs, fg, expected, eg, dtype)


def test_bias_gelu_dropout_matches_its_masks(impl):
    def fn(x, b):
        return F.dropout(F.gelu(x + b), 0.2)

    check(*run(fn, [make(SHAPE), make((7,), seed=1)], p=(0.2,), stream=4))


def test_two_dropouts_use_two_streams(impl):
    def fn(x, r):
        return F.dropout(x, 0.3) + F.dropout(r, 0.3)

    outs, fg, expected, eg = run(fn, [make(SHAPE), make(SHAPE, seed=1)], p=(0.3, 0.3), stream=2)
    check(outs, fg, expected, eg)
    assert not torch.equal(fg[0] != 0, fg[1] != 0)


def test_dropout_statistics_and_mask_agreement(impl):
    """Keep ratio and scale in the forward; the backward drops exactly where the forward did."""
    x = torch.ones(64, 40, requires_grad=True)
    region = region_of_function(lambda t: F.dropout(t, 0.25), [x])
    (out,) = pointwise([x], SEED, 11, region.key)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.03
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.75))
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert torch.equal(grad != 0, kept)
    (again,) = pointwise([x], SEED, 11, region.key)
    assert torch.equal(again, out)
    (other,) = pointwise([x], SEED, 12, region.key)
    assert not torch.equal(other, out)


def test_non_contiguous_and_expanded_inputs(impl):
    def fn(x, y):
        return x * torch.tanh(y)

    x = make((7, 5, 3)).transpose(0, 2)
    y = make((5, 1), seed=1).expand(5, 7)
    check(*run(fn, [x, y.unsqueeze(0).expand(3, 5, 7)]))


def test_a_strided_operand_of_a_region_that_collapses_to_one_dimension(impl):
    """Every dimension merges (each operand walks its rows evenly) but one operand reads every
    other element: the kernel indexes its one dimension by the flat index (it had named an
    undefined `inner0`)."""
    x = make((3, 5, 14))[..., ::2]
    check(*run(lambda x, y: F.silu(x) * y, [x, make((3, 5, 7), seed=1)]))


def test_empty_and_single_element_regions(impl):
    fn = lambda x, b: F.silu(x + b)  # noqa: E731
    check(*run(fn, [make((1, 1)), make((1,), seed=1)]))
    outs, *_ = run(fn, [make((0, 7)), make((7,), seed=1)])
    assert outs[0].shape == (0, 7)


class _NoGradient(torch.autograd.Function):
    """Passes its input on and gives it no gradient (None), as the fused linear + cross-entropy
    gives its hidden states for an empty batch."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.kernels("pointwise:forward")  # no gradient arrives: no backward kernel
def test_an_output_given_no_gradient_gives_the_inputs_none(impl):
    """The backward answers a list of None for the list of inputs (autograd checks the
    structure; a bare None failed with "Expected the return from backward to be of the same
    structure as the inputs")."""
    x, b = make(SHAPE), make((7,), seed=1)
    region = region_of_function(lambda x, b: F.gelu(x + b), [x, b])
    (out,) = pointwise([x, b], None, 0, region.key)
    dx, db = torch.autograd.grad(_NoGradient.apply(out).sum(), [x, b], allow_unused=True)
    assert dx is None and db is None


def test_the_backward_saves_only_the_inputs_it_reads():
    """x + dropout(h) needs no input for its backward, gelu(x + b) needs x and b."""
    x, b, h = make(SHAPE), make((7,), seed=1), make(SHAPE, seed=2)
    for fn, p, expected in [
        (lambda x, h: x + F.dropout(h, 0.1), (0.1,), [SEED]),
        (lambda x, b: F.gelu(x + b), (), [x, b]),
    ]:
        inputs = [x, h] if p else [x, b]
        region = region_of_function(fn, inputs)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(saved.append, lambda t: t):
            pointwise(inputs, SEED if p else None, 0, region.key)
        kept = [t for t in saved if t is not None]
        assert len(kept) == len(expected)
        assert all(any(k is e for e in expected) for k in kept)


@pytest.mark.kernels("pointwise:backward")
def test_the_backward_adds_gradient_terms_itself(impl):
    """An output gradient passed as several terms (a folded autograd sum, one of them broadcast)
    gives every input the gradient their sum gives, and the sum itself when it is written."""
    x, h, b = make(SHAPE), make(SHAPE, seed=1), make((7,), seed=2)
    region = region_of_function(lambda x, h, b: x + F.dropout(F.gelu(h + b), 0.1), [x, h, b])
    terms = [
        make(SHAPE, seed=3).detach(),
        make(SHAPE, seed=4).detach(),
        torch.randn(7).expand(SHAPE),
    ]
    total = terms[0] + terms[1] + terms[2]

    def backward(grads, count, written):
        plan = regions.backward_plan(region.key, (True,) * 3, (count,), (written,))
        saved = [t.detach() for t, keep in zip([x, h, b], plan.saved, strict=True) if keep]
        dtype_codes = [0] * len(plan.computed)
        return plan, torch.ops.seqfast.pointwise_backward(
            saved, grads, SEED, 0, region.key, [True] * 3, [count], [written], dtype_codes
        )

    one, unfolded = backward([total], 1, False)
    three, folded = backward(terms, 3, True)
    assert [g.kind for g in one.input_grads] == ["passthrough", "computed", "computed"]
    for before, after in zip(one.input_grads, three.input_grads, strict=True):
        assert after.kind == "computed"
        expected = total if before.kind == "passthrough" else unfolded[before.index]
        torch.testing.assert_close(folded[after.index], expected)
    torch.testing.assert_close(folded[three.sums[0]], total)


def test_wrong_arguments_are_clear_errors():
    x = make(SHAPE)
    region = region_of_function(lambda t: F.dropout(t, 0.5) * 2, [x])
    with pytest.raises(ValueError, match="needs a seed"):
        pointwise([x], None, 0, region.key)
    with pytest.raises(ValueError, match="takes 1 inputs; got 2"):
        pointwise([x, x], SEED, 0, region.key)
    with pytest.raises(RuntimeError, match="not registered"):
        pointwise([x], SEED, 0, "0123456789abcdef")
    with pytest.raises(ValueError, match="not pointwise: aten.sum"):
        region_of_function(lambda t: t.sum() * 2, [x])


@pytest.mark.kernels("pointwise:forward", "pointwise:backward")
def test_an_output_no_differentiated_input_reaches_takes_its_gradient_as_nothing(impl):
    """The fused op's outputs all require grad when one input does; a gradient arriving for an
    output computed from constants only (a weight gathered per row) adds nothing (tracing the
    backward had failed: "element 0 of tensors does not require grad")."""
    x, c = make(SHAPE), make(SHAPE, seed=1).detach()
    region = region_of_function(lambda x, c: (x * (c * 2), c * 2), [x, c])
    outs = pointwise([x, c], None, 0, region.key)
    assert outs[1].requires_grad  # as the custom op gives it
    (grad,) = torch.autograd.grad(outs, x, [torch.ones_like(o) for o in outs])
    torch.testing.assert_close(grad, c * 2)


@pytest.mark.parametrize(
    ("shape", "bias", "wide"),
    [
        ((1024, 768), (768,), False),
        ((2**16 - 1, 2**15), (2**15,), False),  # the last block's indices stay below 2**31
        ((2**16, 2**15), (2**15,), True),
        ((8, 4), (2**31, 4), True),  # an operand whose farthest offset passes 2**31
    ],
    ids=["small", "under 2**31", "2**31", "far operand"],
)
def test_indices_are_32_bit_unless_the_sizes_need_64(shape, bias, wide):
    """The kernel's element indices, coordinates and offsets are 32-bit integers (cheaper division
    and modulo on a GPU) unless an element index of its last block or an operand's farthest
    offset reaches 2**31; rendered at sizes no memory holds (meta tensors)."""
    x, b = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    region = region_of_function(lambda x, b: x * b, [x, b])
    inputs = [torch.empty(shape, device="meta")]
    if len(bias) == 1:
        inputs.append(torch.empty(bias, device="meta"))
    else:  # a strided operand: every 2**31-th row of a tall one
        inputs.append(torch.empty_strided(shape, (2**31, 1), device="meta"))
    (forward,) = compile_time_specs(region, inputs, None)
    index_line = dict(forward.key)["body"][0]
    assert index_line.startswith("idx = tl.program_id(0)")
    assert (".to(tl.int64)" in index_line) is wide
