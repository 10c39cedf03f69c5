"""The structural check after every stage: a stage that changes an output, cuts an input's
differentiable path, leaves a node whose recorded value its inputs no longer give, or leaves a
fused region with an input it does not read, fails with the stage, the node and its source line."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import seqcompile.patterns.engine as engine
from seqcompile.checks import structure
from seqcompile.ops.pointwise import region as pointwise_region

aten = torch.ops.aten


def traced(fn, *shapes):
    return requiring_grad(make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes)))


def requiring_grad(gm):
    """`gm` with its inputs' recorded values requiring grad, as Dynamo records them."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"].requires_grad_(True)
    return gm


def call_nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_an_untouched_graph_passes_and_keeps_its_signature():
    gm = traced(lambda x, w: F.gelu(x @ w).transpose(0, 1).contiguous().view(-1), (3, 4), (4, 5))
    before = structure.signature(gm)
    assert before.differentiable == {0, 1}
    assert structure.check("normalize", gm, before) == before


def test_an_output_that_changes_shape_names_the_stage_and_the_node():
    gm = traced(lambda x: (x * 2).sum(0), (3, 4))
    before = structure.signature(gm)
    (total,) = call_nodes(gm, aten.sum.dim_IntList)
    total.args = (total.args[0], [1])
    total.meta["val"] = total.args[0].meta["val"].sum(1)  # a consistent graph, another output
    with pytest.raises(structure.StructureError, match="after stage 'fuse', at sum.*output 0"):
        structure.check("fuse", gm, before)


def test_a_node_whose_inputs_no_longer_give_its_recorded_value_is_caught_where_it_is():
    gm = traced(lambda x: x.transpose(0, 1).contiguous().view(-1), (3, 4))
    before = structure.signature(gm)
    (packed,) = call_nodes(gm, aten.clone.default)
    packed.replace_all_uses_with(packed.args[0])  # a rewrite that lost the copy
    gm.graph.erase_node(packed)
    with pytest.raises(structure.StructureError, match="at view.*fails on its inputs' values"):
        structure.check("fuse", gm, before)


def test_an_input_whose_differentiable_path_is_cut_is_named():
    gm = traced(lambda x, w: x * 2 + w, (3,), (3,))
    before = structure.signature(gm)
    (add,) = call_nodes(gm, aten.add.Tensor)
    w = add.args[1]
    with gm.graph.inserting_before(add):
        detached = gm.graph.call_function(aten.detach.default, (w,))
    detached.meta["val"] = w.meta["val"]
    add.replace_input_with(w, detached)
    with pytest.raises(structure.StructureError, match="input w_1 no longer reaches an output"):
        structure.check("capture", gm, before)


def test_ops_run_with_grad_mode_off_carry_no_gradient():
    def fn(x, w):
        torch._C._set_grad_enabled(False)
        y = x * w
        torch._C._set_grad_enabled(True)
        return y + x

    gm = requiring_grad(make_fx(fn, tracing_mode="fake", pre_dispatch=True)(*torch.randn(2, 3)))
    assert structure.signature(gm).differentiable == {0}


def test_a_fused_region_that_does_not_read_an_input_is_caught():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.placeholder("unused")
    graph.output([graph.call_function(aten.relu.default, (x,))])
    region = pointwise_region.register(graph, [torch.float32] * 2, [False] * 2, [])

    def fn(a, b):
        return torch.ops.seqfast.pointwise.default([a, b], None, 0, region.key)[0]

    gm = traced(fn, (4,), (4,))
    with pytest.raises(structure.StructureError, match=r"does not read its inputs \[1\]"):
        structure.check("fuse", gm, structure.signature(gm))


def test_a_fused_op_laid_out_otherwise_than_the_node_it_replaced_fails_at_the_fuse_stage(
    monkeypatch,
):
    """SDPA returns heads-inner strides and `.contiguous()` after the transpose then copies
    nothing; a fused output left contiguous would break the view after it."""
    monkeypatch.setattr(engine.FuseContext, "in_layout_of", lambda self, value, like: value)
    b, length, heads, dim = 2, 5, 2, 4

    def attention(x):
        q, k, v = (t.view(b, length, heads, dim).transpose(1, 2) for t in x.split(8, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(b, length, heads * dim)

    compiled = torch.compile(attention, backend="seqfast")
    with pytest.raises(Exception, match=r"after stage 'fuse', at transpose.*\.view\(b, length"):
        compiled(torch.randn(b, length, 3 * heads * dim, requires_grad=True))


def _in_place_clamp_under_no_grad(x, w):
    with torch.no_grad():
        w.clamp_(-0.5, 0.5)  # a parameter kept in range, as open_clip's logit scale
    return torch.relu(x * w)


def _in_place_scale_under_no_grad(x, w):
    v = x * w
    with torch.no_grad():
        v.mul_(2)  # changes the values, not the history
    return v * x


def _detached_by_function(x, w):
    return torch.relu(x * torch.detach(w)) + w


def _detached_in_place(x, w):
    v = w * 1
    v.detach_()
    return torch.relu(x * v) + w


@pytest.mark.parametrize(
    "fn",
    [
        _in_place_clamp_under_no_grad,
        _in_place_scale_under_no_grad,
        _detached_by_function,
        _detached_in_place,
    ],
)
def test_correct_graphs_with_in_place_ops_under_no_grad_or_detaches_pass(fn):
    """An in-place op under no_grad keeps the tensor's history; each spelling of detach ends
    it, in Dynamo's graph as in ATen's: the check passes and the gradients are eager's."""
    x = torch.randn(4)
    w_eager, w_fast = (torch.randn(4, generator=torch.Generator().manual_seed(0)) for _ in "ab")
    w_eager.requires_grad_(), w_fast.requires_grad_()
    fn(x, w_eager).sum().backward()
    torch.compile(fn, backend="seqfast")(x, w_fast).sum().backward()
    torch.testing.assert_close(w_fast.grad, w_eager.grad)


def test_an_op_is_known_to_write_the_argument_its_schema_marks():
    """The loss backward's in-place twin writes its second argument, the logits."""
    graph = torch.fx.Graph()
    grad, logits, target, lse = (graph.placeholder(name) for name in ("g", "l", "t", "s"))
    twin = torch.ops.seqfast.cross_entropy_backward_in_place.default
    call = graph.call_function(twin, (grad, logits, target, lse, -100, 0.0))
    scaled = graph.call_function(torch.ops.aten.mul_.Scalar, (grad, 2.0))
    assert structure._written(call) is logits
    assert structure._written(scaled) is grad
