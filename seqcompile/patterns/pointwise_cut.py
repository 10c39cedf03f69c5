"""A pointwise region cut out of a graph: its nodes, the values it reads from outside and those
read outside it, and its program (dropout as a keep-mask input, a linear's bias moved into the
region as a weak operand) registered for the generated kernels. `region_of_function` makes one of
all a function's ops, to test the operator on its own."""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Graph, Node

from seqcompile.capture import trace_function
from seqcompile.fx.nodes import arg, tensor_val
from seqcompile.normalize import normalize_graph
from seqcompile.ops.pointwise import region as regions
from seqcompile.patterns.pointwise_ops import unsupported_ops

aten = torch.ops.aten
FOLDED_BIAS = "seqfast_folded_bias"
"""Node meta key on the add a linear's bias was moved into."""


def region_of_function(fn, example_inputs) -> regions.Region:
    """All of `fn`'s ops as one region: inputs are `fn`'s tensor arguments in order and outputs
    its returned tensors (used to test the operator on its own)."""
    gm = trace_function(fn, example_inputs, "the region function")
    normalize_graph(
        gm, next(tensor_val(n) for n in gm.graph.nodes if n.op == "placeholder").fake_mode
    )
    unsupported = unsupported_ops(gm)
    if unsupported:
        raise ValueError(f"not pointwise: {', '.join(unsupported)}")
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = output.args[0]
    outputs = list(returned) if isinstance(returned, list | tuple) else [returned]
    return Cut(nodes, inputs, outputs).register()


@dataclasses.dataclass(frozen=True)
class Cut:
    """A region cut out of a graph: its nodes in graph order, the values it reads from outside,
    and the values read outside it."""

    nodes: list[Node]
    inputs: list[Node]
    outputs: list[Node]
    name: str | None = None
    """The user pattern the cut is a match of: it starts the region key, so its kernels carry it."""

    @classmethod
    def of(cls, nodes: list[Node], name: str | None = None) -> Cut:
        members = set(nodes)
        inputs: list[Node] = []
        for n in nodes:
            inputs += [i for i in n.all_input_nodes if i not in members and i not in inputs]
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        return cls(nodes, inputs, outputs, name)

    @property
    def dropouts(self) -> list[Node]:
        return [n for n in self.nodes if n.target is aten.dropout.default]

    def register(self) -> regions.Region:
        """The region's program (dropout as a keep-mask input), traced and registered."""
        program = Graph()
        env = {i: program.placeholder(f"in{k}") for k, i in enumerate(self.inputs)}
        masks = [program.placeholder(f"keep{k}") for k in range(len(self.dropouts))]
        for n in self.nodes:
            if n.target is aten.dropout.default:
                scale = 1.0 / (1.0 - float(arg(n, 1, "p")))
                scaled = program.call_function(aten.mul.Tensor, (env[n.args[0]], scale))
                keep = masks[self.dropouts.index(n)]
                env[n] = program.call_function(aten.where.ScalarOther, (keep, scaled, 0.0))
            else:
                env[n] = program.node_copy(n, lambda a: env[a])
        program.output([env[o] for o in self.outputs])
        members = set(self.nodes)
        values = [tensor_val(i) for i in self.inputs]
        weak = [
            v.dim() == 0 or _is_folded_bias(i, members)
            for i, v in zip(self.inputs, values, strict=True)
        ]
        drop_p = [float(arg(d, 1, "p")) for d in self.dropouts]
        return regions.register(program, [v.dtype for v in values], weak, drop_p, self.name)


def _is_folded_bias(node: Node, members: set[Node]) -> bool:
    """A linear's bias moved into the region: eager's linear casts it to the matmul's dtype, so it
    takes part in type promotion as a weak operand."""
    return any(u in members and u.meta.get(FOLDED_BIAS) and u.args[1] is node for u in node.users)
