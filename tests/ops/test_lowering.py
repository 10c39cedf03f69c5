"""Each fused op's CPU lowering (`FusedOp.lowering`) traced with `make_fx` at fake values, on every
registry entry's contiguous samples: the forward as the sample calls it, and each backward op
(and in-place twin) with the arguments its autograd gives it after a real forward. The trace must
hold plain ATen only (no `seqfast` op but the targets' range check, nothing whose result depends
on the data's values), and running it must give what the op gives (which on CPU is the
reference), with the dtypes, shapes and strides of the op's fake implementation."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from checks import SeqfastCalls
from conftest import TOLERANCES
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call, FusedOp
from seqcompile.ops.samples import Sample, replace_slots, tensor_slots

aten = torch.ops.aten
DATA_DEPENDENT = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
    aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default,
    aten.masked_scatter.default,
}  # fmt: skip
"""Ops whose result's size or a host value depends on the data (any other op whose sizes do is
found by its unbacked symbols)."""


def _cases():
    for entry in registry.ENTRIES:
        for sample in entry.samples():
            yield pytest.param(entry, sample, id=f"{entry.name}-{sample.name}")


def _by_name(op, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    call = Call(op, args, kwargs)
    return {name: call[name] for name in call}


def _traced(fn: Callable[..., Any], arguments: Mapping[str, Any]):
    """`fn(**arguments)` traced with make_fx at fake values of the tensor arguments: the graph,
    the real tensors it takes, in order, and the argument each belongs to."""
    leaves, spec = tree_flatten(dict(arguments))
    owners = [name for name, value in arguments.items() for _ in tree_flatten(value)[0]]
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]

    def flat(*tensors: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            filled[i] = t
        return fn(**tree_unflatten(filled, spec))

    tensors = [leaves[i].detach() for i in where]
    gm = make_fx(flat, tracing_mode="fake")(*tensors)
    return gm, tensors, [owners[i] for i in where]


HELPERS = (torch.ops.seqfast.checked_index.default, torch.ops.seqfast.philox_uniforms.default)
"""The seqfast ops a lowering may call, which Inductor runs as they are: the host's check of the
targets, the dropout stream's C function on CPU."""


def _check_plain(gm: torch.fx.GraphModule, name: str) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target in HELPERS:
            continue
        assert getattr(target, "namespace", None) != "seqfast", f"{name}: traces {target}"
        assert target not in DATA_DEPENDENT, f"{name}: data-dependent {target}"
        assert not free_unbacked_symbols(node.meta.get("val")), f"{name}: {target} sizes by data"
        if target is aten.index.Tensor:
            kinds = [i.meta["val"].dtype for i in node.args[1] if i is not None]
            assert torch.bool not in kinds, f"{name}: boolean indexing"


def _fake_outputs(op, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    with FakeTensorMode() as mode:
        fake = tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v,
                        (args, dict(kwargs)))  # fmt: skip
        return op(*fake[0], **fake[1])


def _as_list(result: Any) -> list:
    return list(result) if isinstance(result, tuple | list) else [result]


def _same_layout(actual: torch.Tensor, fake: torch.Tensor, name: str) -> None:
    assert actual.shape == fake.shape, f"{name}: shape {tuple(actual.shape)}, fake {fake.shape}"
    assert actual.dtype == fake.dtype, f"{name}: dtype {actual.dtype}, fake {fake.dtype}"
    dims = [d for d in range(actual.dim()) if actual.shape[d] > 1]
    strides = [actual.stride(d) for d in dims], [fake.stride(d) for d in dims]
    assert strides[0] == strides[1], f"{name}: strides {actual.stride()}, fake {fake.stride()}"


def _check_op(entry: FusedOp, op, args: tuple, kwargs: Mapping[str, Any], expected: Any) -> None:
    """Trace `op`'s lowering at this call and compare what the trace computes with `expected`
    (the op's own result) and with the fake implementation's outputs."""
    name = str(op)
    gm, tensors, _ = _traced(entry.lowering[op], _by_name(op, args, kwargs))
    _check_plain(gm, name)
    actual = _as_list(gm(*[t.clone() for t in tensors]))
    fakes = _as_list(_fake_outputs(op, args, kwargs))
    expected = _as_list(expected)
    assert len(actual) == len(expected) == len(fakes), name
    for i, (a, e, f) in enumerate(zip(actual, expected, fakes, strict=True)):
        _same_layout(a, f, f"{name} output {i}")
        torch.testing.assert_close(
            a, e, rtol=0, atol=0, equal_nan=True, msg=lambda m, i=i: f"{name} output {i}: {m}"
        )


def _check_twin(entry: FusedOp, args: tuple, kwargs: Mapping[str, Any], expected: Any) -> None:
    """The in-place twin's lowering at the functional backward's call: it writes `expected` (the
    functional op's result) over its argument and returns nothing."""
    twin, over = entry.in_place.twin, entry.in_place.over
    arguments = _by_name(twin, Call(entry.in_place.functional, args, kwargs).arguments_of(twin), {})
    gm, tensors, owners = _traced(entry.lowering[twin], arguments)
    _check_plain(gm, str(twin))
    leaves = [t.clone() for t in tensors]
    assert gm(*leaves) is None
    written = leaves[owners.index(over)]
    torch.testing.assert_close(written, expected, rtol=0, atol=0, equal_nan=True, msg=str(twin))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.rotating(2)  # every sample of every operator: half per run, in turn
@pytest.mark.parametrize("entry, sample", list(_cases()))
def test_lowering_traces_to_plain_aten_and_computes_the_reference(entry: FusedOp, sample: Sample):
    args = replace_slots(
        sample.args,
        lambda slot, t: t.clone().requires_grad_(slot in sample.grads and t.is_floating_point()),
    )
    with SeqfastCalls() as recorded:
        result = entry.forward(**args)
        outputs = [_as_list(result)[i] for i in sample.outputs]
        differentiable = [o for o in outputs if o.requires_grad]
        wrt = [t for slot, t in tensor_slots(args) if t.requires_grad]
        if differentiable and wrt:
            g = torch.Generator().manual_seed(7)
            torch.autograd.grad(
                differentiable, wrt, [torch.randn(o.shape, generator=g) for o in differentiable],
                allow_unused=True,
            )  # fmt: skip
    seen = {op for op, *_ in recorded.calls}
    assert entry.forward in seen
    if differentiable and wrt and not sample.is_empty():
        assert seen & set(entry.backward), "the forward's autograd called no backward op"
    for op, call_args, call_kwargs, out in recorded.calls:
        detached = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                            (call_args, call_kwargs, out))  # fmt: skip
        _check_op(entry, op, *detached)
        if entry.in_place is not None and op is entry.in_place.functional:
            _check_twin(entry, *detached)


def test_the_fused_loss_lowers_to_one_chunk_at_symbolic_sizes():
    """At a symbolic number of rows the fused loss's lowering takes every row in one chunk (a
    loop over the rows would fix their number), and computes the op's results."""
    entry = registry.entry_named("linear_cross_entropy")
    sample = next(s for s in entry.samples() if s.name == "mean")
    arguments = dict(sample.args)
    tensors = [arguments[name] for name in ("hidden", "weight", "bias", "target")]
    assert all(isinstance(t, torch.Tensor) for t in tensors)

    def lowered(hidden, weight, bias, target):
        changes = dict(hidden=hidden, weight=weight, bias=bias, target=target, chunk=1)
        return entry.lowering[entry.forward](**{**arguments, **changes})

    gm = make_fx(lowered, tracing_mode="symbolic")(*tensors)
    _check_plain(gm, "linear_cross_entropy at symbolic sizes")
    mms = [n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    assert len(mms) <= 3, "one chunk: the logits and at most two gradient products"
    actual = gm(*tensors)
    expected = entry.forward(**arguments)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a, e, **TOLERANCES[torch.float32], equal_nan=True,
                                   msg=lambda m, i=i: f"output {i}: {m}")  # fmt: skip
