"""The dump folder's writers: a graph's folder (`GraphDump`), graphs with fused-op calls by argument
name, kernel files headed with this compile's provenance, scripts that rebuild and run a graph."""

from __future__ import annotations

import dataclasses
import keyword
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.debug_utils import NNModuleToString
from torch._subclasses.fake_tensor import is_fake
from torch.fx import Graph, GraphModule

from seqcompile.capture import Uncompilable
from seqcompile.dump import folder as dump_folder
from seqcompile.fx.nodes import concrete, has_symbols
from seqcompile.ops.fused_op import Call
from seqcompile.options import Options
from seqcompile.report import CompileReport, KernelUse


@dataclasses.dataclass
class GraphDump:
    """One compiled graph's folder in the dump, `<run folder>/<name>` (see `folder.py`), and
    what the backend writes there; with no `dump_dir`, nothing."""

    dump_dir: str | None
    name: str
    _written: int = 0

    @property
    def folder(self) -> Path | None:
        if self.dump_dir is None:
            return None
        path = dump_folder.run_folder(self.dump_dir) / self.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def stage(self, stage: str, gm: GraphModule | str) -> None:
        """Write the graph after `stage` (or generated code) as readable Python, numbered in the
        order written."""
        if (folder := self.folder) is not None:
            text = gm if isinstance(gm, str) else graph_text(gm)
            (folder / f"{self._written:02d}_{stage}.py").write_text(text)
            self._written += 1

    def plan_pass(self, name: str, notes: list[str], graphs: list[GraphModule]) -> None:
        """Write the graphs after stage 5's pass `name`, headed by its notes."""
        if self.dump_dir is not None:
            self.stage(f"plan_memory_{name}", pass_text(name, notes, graphs))

    def rerun(self, gm: GraphModule, inputs: Sequence[Any], options: Options) -> None:
        """Write `rerun.py` for Dynamo's graph `gm` (see `write_rerun`)."""
        write_rerun(self.folder, self.name, gm, inputs, options)

    def unfinished(self, error: BaseException) -> None:
        """Say in `report.txt` that this compile stopped, and why: the folder holds the stages it
        finished."""
        if (folder := self.folder) is None:
            return
        why = f"{type(error).__name__}: {error}".rstrip(": ")
        if isinstance(error, Uncompilable):
            why += "\nThe graph runs as Dynamo captured it."
        elif isinstance(error, torch._dynamo.exc.RestartAnalysis):
            why += "\nDynamo traces the frame again and hands it over as the next graph."
        (folder / "report.txt").write_text(
            f"{self.name} did not finish compiling; the files here are the stages it finished.\n"
            f"{why}\n"
        )
        dump_folder.record(folder.parent, self.name, "stopped: " + why.replace("\n", " "))

    def report(self, report: CompileReport) -> None:
        """Write `report.txt`, and each kernel the graphs launch headed with where they do."""
        if (folder := self.folder) is None:
            return
        _write_kernels(folder / "kernels", report.kernels)
        (folder / "report.txt").write_text(str(report))
        fused = ", ".join(f"{k} {n}" for k, n in sorted(report.counts.items()) if n > 0)
        kernels = len({use.name for use in report.kernels})
        summary = f"compiled: fused {fused or 'nothing'}; {kernels} kernel(s)"
        dump_folder.record(folder.parent, self.name, summary)


def _write_kernels(folder: Path, launched: list[KernelUse]) -> None:
    """A file per kernel in `launched`, and none for a kernel no longer launched (by a compile
    `verify` replaced)."""
    folder.mkdir(exist_ok=True)
    uses: dict[str, list[KernelUse]] = {}
    for use in launched:
        uses.setdefault(use.name, []).append(use)
    for name, kernel_uses in uses.items():
        (folder / f"{name}.py").write_text(kernel_file(kernel_uses))
    for stale in folder.glob("*.py"):
        if stale.stem not in uses:
            stale.unlink()


def graph_text(gm: GraphModule) -> str:
    """`gm` as readable Python, with every call of a seqfast op written with its argument names
    (None-valued ones left out). Printed from a copy: `gm` is left as it is."""
    graph = Graph()  # new nodes; values and metadata are shared
    value, output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(value, type_expr=output.type)
    graph.set_codegen(gm.graph._codegen)
    for node in graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "seqfast":
            shown = Call.of(node).shown()
            if not any(keyword.iskeyword(name) for name in shown):
                node.args, node.kwargs = (), shown
    return GraphModule(gm, graph).print_readable(
        print_output=False, include_stride=True, include_device=True
    )


def pass_text(name: str, notes: list[str], graphs: list[GraphModule]) -> str:
    """A stage-5 pass's file: its notes as comments, then its graphs (the joint graph, or the
    forward and the backward)."""
    header = [f"# stage 5, pass {name!r}"] + [f"# {note}" for note in notes]
    return "\n".join(header) + "\n\n" + "\n\n".join(graph_text(g) for g in graphs)


def kernel_file(uses: list[KernelUse]) -> str:
    """One kernel's file for this compile's dump: a header naming the graphs, nodes and source
    lines it was made for here, then the kernel as cached (without the cache's own header)."""
    first = uses[0]
    header = [
        f"# Generated by seqcompile; cached as {first.path}.",
        f"# template: {first.template}.py.jinja",
        f"# key: {first.spec.describe() or '(none)'}",
        "# launched in this compile by:",
    ] + [f"#   {use}" for use in uses]
    body = first.source.source.splitlines(keepends=True)
    while body and (body[0].startswith("#") or not body[0].strip()):
        body.pop(0)
    return "\n".join(header) + "\n\n" + "".join(body)


def write_rerun(
    folder: Path | None, name: str, gm: GraphModule, inputs: Sequence[Any], options: Options
) -> None:
    """Write `<folder>/rerun.py`: Dynamo's graph `gm` rebuilt, random inputs like `inputs`, and a
    seqfast compile with `options` (without the dump folder and verify), run forward and
    backward in the grad and autocast modes of this compile, with a line per output. Nothing
    without a folder."""
    if folder is None:
        return
    given = {
        f.name: _option_value(getattr(options, f.name))
        for f in dataclasses.fields(options)
        if f.name not in ("dump_dir", "verify")
    }
    lines = ",\n".join(f"    {k!r}: {v!r}" for k, v in given.items())
    device = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
    modes = [f"torch.set_grad_enabled({torch.is_grad_enabled()})"]
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        modes.append(f"torch.autocast({device!r}, {torch.get_autocast_dtype(device)})")
    dynamic = ", dynamic=True" if _symbolic(gm) else ""
    main = f"    with {', '.join(modes)}:\n" + (
        f'        compiled = torch.compile(Repro(), backend="seqfast", options=OPTIONS{dynamic})\n'
        "        result = compiled(*inputs())\n"
        "        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]\n"
        "        grads = [t for t in outputs if t.requires_grad]\n"
        "        if grads:  # a complex output: through its real and imaginary parts\n"
        "            real = [torch.view_as_real(t) if t.is_complex() else t for t in grads]\n"
        "            sum(t.float().sum() for t in real).backward()\n"
        '            print("backward: ran")\n'
        "    for i, t in enumerate(outputs):\n"
        "        total = t.to(torch.complex128 if t.is_complex() else torch.float64).sum().item()\n"
        '        print(f"output {i}: {t.dtype} {list(t.shape)} sum {total:.6g}")\n'
    )
    (folder / "rerun.py").write_text(
        script(
            f"Compiles {name} again as seqfast did, on random inputs of the traced sizes, and runs"
            " it forward and backward.\nRun: python rerun.py (SEQFAST_INTERPRET=1 runs the"
            " kernels under Triton's interpreter, on CPU)",
            gm,
            inputs,
            "from torch.utils._pytree import tree_leaves\n\n"
            "import seqcompile  # noqa: F401 (before torch.compile, so SEQFAST_INTERPRET applies)"
            f"\n\nOPTIONS = {{\n{lines},\n}}",
            main,
        )
    )


def _symbolic(gm: GraphModule) -> bool:
    """Whether Dynamo traced `gm` at symbolic sizes (a dynamic compile)."""
    return has_symbols([n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")])


def _option_value(value: Any) -> Any:
    """An option as `Options.resolve` reads it back."""
    if dataclasses.is_dataclass(value):  # a Budget: its fraction or its size in bytes
        return value.fraction if value.size is None else value.size
    return value


def script(doc: str, gm: GraphModule, inputs: Sequence[Any], imports: str, main: str) -> str:
    """A standalone script: `doc`, the graph `gm` rebuilt from its code as `Repro`, `inputs()`
    drawing random inputs like `inputs` (seeded), then `main` as the body of its `__main__`
    block, after `imports`. A graph that cannot be rebuilt gives a script that says why."""
    names = gm.graph.python_code("self").globals
    problem = _not_rebuildable(gm, names)
    if problem is not None:
        problem = f"the graph cannot be rebuilt from its code: {problem}"
    elif (unmakeable := _unmakeable(inputs)) is not None:
        problem = f"the graph's inputs cannot be made by this script: {unmakeable}"
    if problem is not None:
        message = f"seqfast: {problem}"
        return f'"""{doc}"""\n\nraise SystemExit({message!r})\n'
    more = "".join(f"{_import_line(n, v)}\n" for n, v in names.items() if n not in _IN_PREAMBLE)
    made = "\n".join(f"        {_input_expression(a)}," for a in inputs)
    return (
        f'"""{doc}"""\n\n{_PREAMBLE}{more}\n{imports}\n\n'
        f"{NNModuleToString.convert(gm)}\n\n"
        "def inputs():\n    torch.manual_seed(0)\n    return [\n"
        f"{made}\n    ]\n\n\n"
        f'if __name__ == "__main__":\n{main}'
    )


_PREAMBLE = (
    "import torch\n"
    "from math import inf, nan  # noqa: F401 (in the graph's code)\n"
    "from torch import device  # noqa: F401 (in the graph's code)\n\n"
    "NoneType = type(None)\n"
)
_IN_PREAMBLE = {"torch", "device", "inf", "nan", "NoneType"}


def _not_rebuildable(gm: GraphModule, names: dict[str, Any]) -> str | None:
    """Why `gm`'s code, which uses the global `names`, cannot be written out as a script that
    runs (None if it can)."""
    for child, module in gm.named_children():
        if NNModuleToString._module_constructor_string(module) is None:
            kind = type(module).__name__
            return f"it calls the sub-module {child} ({kind}), which has no constructor code"
    for node in gm.graph.nodes:
        stored = node.target in gm._buffers or node.target in gm._parameters
        if node.op == "get_attr" and not stored and "." not in node.target:
            return f"it reads the constant {node.target}, which is neither buffer nor parameter"
    for name, value in names.items():
        if name not in _IN_PREAMBLE and _import_line(name, value) is None:
            return f"its code calls {name} ({value!r}), which cannot be imported by name"
    return None


def _import_line(name: str, value: Any) -> str | None:
    """The import that defines `name` as `value` (a module, or a module's top-level object);
    None where there is none (a function defined in `__main__` or inside another)."""
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__} as {name}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module == "__main__" or getattr(sys.modules.get(module), str(qualname), None) is not value:
        return None
    return f"from {module} import {qualname} as {name}"


_RANDN = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)
"""Dtypes `torch.randn` draws in directly; other floating and complex dtypes (float8, complex32)
are drawn in float32 or complex64 and cast."""
_INTEGERS = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
_SCALARS = (bool, int, float, complex, str, type(None))


def _unmakeable(inputs: Sequence[Any]) -> str | None:
    """Why the script cannot make one of `inputs` (None where it can make them all)."""
    for i, a in enumerate(inputs):
        if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool) or isinstance(a, _SCALARS):
            continue
        if not isinstance(a, torch.Tensor):
            return f"input {i} is a {type(a).__name__}, which the script cannot make"
        if type(a) not in (torch.Tensor, torch.nn.Parameter) and not is_fake(a):
            return f"input {i} is a tensor subclass ({type(a).__name__})"
        if a.layout != torch.strided:
            return f"input {i} has the layout {a.layout}, not strided"
        if a.is_quantized:
            return f"input {i} is quantized ({a.dtype})"
        drawn = a.is_floating_point() or a.is_complex() or a.dtype in (torch.bool, *_INTEGERS)
        if not drawn:  # the sub-byte uint1..7 and int1..7, the bits types
            return f"input {i} has the dtype {a.dtype}, which the script cannot draw"
    return None


def _hint(a: torch.SymInt | torch.SymFloat | torch.SymBool) -> bool | int | float:
    """A symbolic scalar at the value it had when traced."""
    if isinstance(a, torch.SymInt):
        return concrete(a)
    hint = a.node.hint
    if hint is None:
        hint = a.node.shape_env.size_hint(a.node.expr)
    return bool(hint) if isinstance(a, torch.SymBool) else float(hint)


def _literal(value: Any) -> str:
    """Python for a number as the script's preamble reads it (`nan`, `inf` and complex values
    with either written so)."""
    if isinstance(value, complex):
        return f"complex({value.real!r}, {value.imag!r})"
    return repr(value)


def _input_expression(a: Any) -> str:
    """Python that makes an input like `a`: the same sizes (at their traced hints), strides,
    dtype, device and requires_grad, with random values; a 0-d tensor (a number Dynamo made an
    input, such as a norm's eps) keeps its value, and integers stay within the smallest (or 0)
    and largest values seen (0 or 1 where they cannot be read). `_unmakeable` says first which
    inputs this cannot make."""
    if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
        return repr(_hint(a))
    if not isinstance(a, torch.Tensor):
        return _literal(a)
    readable = not is_fake(a) and a.device.type != "meta"
    size, stride = [concrete(s) for s in a.shape], [concrete(s) for s in a.stride()]
    storage = 1 + sum((s - 1) * st for s, st in zip(size, stride, strict=True)) if all(size) else 0
    if readable and a.dim() == 0:
        make = f"torch.tensor({_literal(a.item())}, dtype={a.dtype})"
    elif a.dtype in _RANDN:
        make = f"torch.randn({storage}, dtype={a.dtype})"
    elif a.is_complex():
        make = f"torch.randn({storage}, dtype=torch.complex64).to({a.dtype})"
    elif a.is_floating_point():
        make = f"torch.randn({storage}).to({a.dtype})"
    elif a.dtype == torch.bool:
        make = f"torch.rand({storage}) > 0.5"
    else:
        make = f"torch.randint({_integer_range(a, readable)}, ({storage},)).to({a.dtype})"
    made = f"({make}).to({str(a.device)!r}).as_strided({size}, {stride}).detach()"
    if isinstance(a, torch.nn.Parameter):
        return f"torch.nn.Parameter({made}, requires_grad={a.requires_grad})"
    differentiable = a.is_floating_point() or a.is_complex()
    return made + (f".requires_grad_({a.requires_grad})" if differentiable else "")


def _integer_range(a: torch.Tensor, readable: bool) -> str:
    """`low, high` for `torch.randint` (int64) covering the values of the integer tensor `a`,
    kept within both its dtype and int64."""
    info, int64 = torch.iinfo(a.dtype), torch.iinfo(torch.int64)
    low, high = 0, 2
    if readable and a.numel():
        # max and min are not implemented for every integer dtype (uint16..uint64): read them
        # in a dtype that holds the values (float64 for uint64, whose top half int64 lacks)
        wide = a.detach().to(torch.float64 if a.dtype == torch.uint64 else torch.int64)
        low, high = min(int(wide.min().item()), 0), int(wide.max().item()) + 1
    low = max(low, info.min, int64.min)
    high = min(max(high, low + 1), info.max + 1, int64.max)
    return f"{low}, {high}"
