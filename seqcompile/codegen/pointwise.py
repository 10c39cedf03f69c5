"""The expression printer from post-dispatch ATen to Triton: a traced pointwise graph becomes the
body of the `pointwise` kernel template, one line per node. Floating values are computed in float32
(float64 when the graph holds float64); an explicit cast to a half type rounds there, as eager does.
Loads and stores convert from and to whatever dtype the tensors have at launch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.fx import GraphModule, Node

from seqcompile.codegen import pointwise_arithmetic, pointwise_functions
from seqcompile.codegen.pointwise_printing import TL_DTYPES, Printer, Unprintable, kind, literal
from seqcompile.codegen.spec import KernelSpec

__all__ = [
    "PRINTABLE",
    "Layout",
    "Load",
    "Mask",
    "Unprintable",
    "jit_function",
    "render",
    "what_of",
]

aten = torch.ops.aten
Layout = str | tuple[bool, ...]
"""How an operand is indexed: "flat" (contiguous over the whole region), "scalar" (one element),
or, per dimension of the collapsed region shape, whether the operand varies along it (strided)."""


@dataclasses.dataclass(frozen=True)
class Load:
    """A placeholder read from tensor parameter `name` with `layout`."""

    name: str
    layout: Layout


@dataclasses.dataclass(frozen=True)
class Mask:
    """A placeholder that is dropout's keep-mask, regenerated from the seed: element `idx` of
    random stream `stream + offset` is kept when its uniform number is at least `p`."""

    offset: int
    p: float


_RULES = {**pointwise_arithmetic.RULES, **pointwise_functions.RULES}
PRINTABLE = frozenset(_RULES)
"""Post-dispatch ATen ops the printer spells in Triton."""


def _float_type(gm: GraphModule) -> str:
    wide = any(
        isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype is torch.float64
        for n in gm.graph.nodes
    )
    return "tl.float64" if wide else "tl.float32"


def _offset(name: str, layout: Layout) -> str:
    if layout == "flat":
        return "idx"
    terms = [f"c{d} * {name}_stride{d}" for d, varies in enumerate(layout) if varies]
    return " + ".join(terms) or "0"


INDEX_LIMIT = 2**31
"""Indices, coordinates and offsets below this fit a kernel's 32-bit integers."""


def index_fits_32_bits(
    numel: int, block: int, sizes: Sequence[int], walks: Sequence[Sequence[int]]
) -> bool:
    """Whether a region of `numel` elements walked in blocks of `block`, its operands at strides
    `walks` over the collapsed `sizes`, indexes in 32 bits: every element index of the last
    block, and every operand's farthest offset."""
    farthest = max(
        (sum((n - 1) * abs(s) for n, s in zip(sizes, walk, strict=True)) for walk in walks),
        default=0,
    )
    return numel + block <= INDEX_LIMIT and farthest < INDEX_LIMIT


def _print_nodes(gm: GraphModule, names: dict[Node, str], printer: Printer) -> list[str]:
    """One line per call in `gm`, assigning its value to `v_<name>` (recorded in `names`, which
    holds the placeholders' variables)."""
    lines = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        rule = _RULES.get(node.target)
        if rule is None:
            raise Unprintable(f"{node.target} has no Triton spelling in the pointwise printer")
        # a list is a constant's size (zeros): the constant broadcasts over the region
        args = [
            names[a] if isinstance(a, Node) else literal(a)
            for a in node.args
            if not isinstance(a, torch.dtype | torch.device | torch.layout | str | list)
        ]
        var = names[node] = f"v_{node.name}"
        value = rule(node, args, printer)
        literal_value = rule in pointwise_arithmetic.CONSTANT_RULES
        lines.append(f"{var} = {value if literal_value else _in_kind(value, node)}")
    return lines


def _in_kind(expression: str, node: Node) -> str:
    """`expression` held as `node`'s boolean or integer dtype holds it: Triton promotes an op's
    operands among themselves, where torch writes the result in the op's own dtype (a boolean
    `where` of a float branch is a boolean, an integer sum wraps at its width)."""
    dtype = node.meta["val"].dtype
    if dtype is torch.bool:
        return f"({expression} != 0)"
    if not dtype.is_floating_point and dtype in TL_DTYPES:
        return f"({expression}).to({TL_DTYPES[dtype]})"
    return expression


def jit_function(gm: GraphModule, name: str) -> tuple[str, ...]:
    """`gm` as the source lines of a `@triton.jit` function `name` of its placeholders (float
    values) returning its outputs, one line per node."""
    printer = Printer(_float_type(gm))
    names = {n: f"v_{n.name}" for n in gm.graph.nodes if n.op == "placeholder"}
    params = list(names.values())
    lines = _print_nodes(gm, names, printer)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = ", ".join(names[value] for value in output.args[0])
    return (
        "@triton.jit",
        f"def {name}({', '.join(params)}):",
        *(f"    {line}" for line in lines),
        f"    return {returned}",
    )


def render(
    gm: GraphModule,
    operands: Sequence[Load | Mask | None],
    outputs: Sequence[str],
    rank: int,
    mode: str,
    region: str,
    label: str | None = None,
    wide: bool = True,
) -> tuple[KernelSpec, tuple[str, ...]]:
    """The `mode` ("forward" or "backward") kernel of `region` (named after `label`, a user
    pattern, when given), computing `gm`: placeholder i
    is read as `operands[i]` (None: unused), and the graph's i-th output is stored to the tensor
    parameter `outputs[i]`. Element indices, coordinates and offsets are 64-bit where `wide`,
    else 32-bit (the launcher's sizes keep every one below 2**31: `index_fits_32_bits`). Returns
    the spec and the kernel's parameter names in order (tensors by name; `<name>_stride<d>`,
    `size<d>`, `inner<d>`, `N`, `SEED`, `stream`)."""
    printer = Printer(_float_type(gm))
    names: dict[Node, str] = {}
    body: list[str] = []
    params: list[tuple[str, str]] = []
    scalars: list[str] = []
    used_dims: set[int] = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    masks = False

    for node, operand in zip(placeholders, operands, strict=True):
        if not node.users:
            continue
        var = names[node] = f"v_{node.name}"
        if isinstance(operand, Mask):
            masks = True
            body.append(
                f"{var} = philox_uniform_run(seed, tl.program_id(0).to(tl.int64) * BLOCK,"
                f" stream + {operand.offset}, BLOCK) >= {operand.p!r}"
            )
            continue
        assert operand is not None, f"placeholder {node.name} is read but has no operand"
        params.append((operand.name, what_of(node)))
        if isinstance(operand.layout, tuple):
            for d, varies in enumerate(operand.layout):
                if varies:
                    scalars.append(f"{operand.name}_stride{d}")
                    used_dims.add(d)
        if operand.layout == "scalar":
            load = f"tl.load({operand.name})"
        else:
            offset = _offset(operand.name, operand.layout)
            load = f"tl.load({operand.name} + {offset}, mask=live, other=0)"
        loaded = kind(node.meta["val"].dtype)
        if loaded == "float":
            load += f".to({printer.float_type})"
        elif loaded == "bool":
            load = f"({load} != 0)"
        body.append(f"{var} = {load}")

    body += _print_nodes(gm, names, printer)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for name, value in zip(outputs, output.args[0], strict=True):
        params.append((name, "output, contiguous over the region"))
        body.append(f"tl.store({name} + idx, {names[value]}, mask=live)")

    coords = []
    for d in sorted(used_dims):
        if rank == 1:  # the region collapsed to one dimension: its index is the coordinate
            coords.append("c0 = idx")
        elif d == 0:
            coords.append("c0 = idx // inner0")
        elif d == rank - 1:
            coords.append(f"c{d} = idx % size{d}")
        else:
            coords.append(f"c{d} = idx // inner{d} % size{d}")
    dims = [f"size{d}" for d in sorted(used_dims) if d > 0] + [
        f"inner{d}" for d in sorted(used_dims) if d < rank - 1
    ]
    program = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
    index = [f"idx = {program} * BLOCK + tl.arange(0, BLOCK)", "live = idx < N"]
    seed = ["seed = tl.load(SEED)"] if masks else []
    if masks:
        params.append(("SEED", "() int64 seed of the graph"))
        scalars.append("stream")
    params += [(s, "") for s in scalars + dims + ["N"]]
    spec = KernelSpec.of(
        "pointwise",
        mode=mode,
        region=region,
        philox=masks,
        params=tuple(params),
        body=tuple(index + seed + coords + body),
        **({"label": label} if label is not None else {}),
    )
    return spec, tuple(p for p, _ in params)


def what_of(node: Node) -> str:
    val = node.meta.get("val")
    return f"{node.name}: {val.dtype} in the trace" if isinstance(val, torch.Tensor) else node.name
