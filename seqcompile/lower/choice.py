"""Stage 6's choice of what each fused call in a planned graph runs: the op as called (its
generated kernels; on CPU its reference), its lowering, plain ATen that the executor compiles
with its neighbours (`lower/inline.py`), or a vendor's kernels (`FusedOp.vendor`), called from
ATen the executor compiles the same way, for the calls the vendor can express.

The `implementations` option forces one per operator or family (a call the vendor cannot express
runs its kernel, and the report says why). Otherwise ("auto"):
- on CPU under Inductor, the lowering (the op would run its reference op by op); with the eager
  executor, under Triton's interpreter and on the meta device, the op as called;
- on CUDA, measured on first use per (op, specialization, shape bucket, dtypes) on each device
  model, torch and Triton version: each candidate is checked against the lowering run op by op,
  then timed (`lower/measure.py`). Another implementation replaces the kernel only where it is
  faster by more than `TIE` and allocates no more while it runs than the kernel does (the memory
  plan is the kernel's); the lowering only where it holds no value larger than the call's largest
  tensor or the op's own workspace. Results are kept on disk beside the tuning cache; with
  `SEQFAST_AUTOTUNE=0` the shipped `DEFAULT_TABLE` decides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import triton
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_flatten

from seqcompile.codegen import tuning
from seqcompile.codegen.cache import add_entry, cache_dir, read_entries, text_digest
from seqcompile.fx.nodes import concrete, device_of
from seqcompile.lower.inline import Traced, traced_body
from seqcompile.lower.measure import (
    Measured,
    Measurer,
    compiled_by_inductor,
    cuda_measurer,
    measure,
    run_as_traced,
)
from seqcompile.lower.traced_launches import launch_trace, launches_inlined
from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call, FusedOp
from seqcompile.options import Options
from seqcompile.run import runtime

log = logging.getLogger("seqcompile")

TIE = 0.05
"""Another implementation replaces the kernel only where it is faster by more than this fraction
of the kernel's time: a tie goes to the generated kernel."""

ALLOCATION_SLACK = 1 << 20
"""Bytes another implementation may allocate while it runs beyond what the kernel allocates."""

_FLASH = (
    "SDPA's flash kernels ran attention (L 4096, d 128, bf16, causal or not, no dropout) at 1.3x"
    " to 1.5x the generated forward's speed and 2.2x to 2.4x forward + backward's on an H200"
    " (benchmarks/results/nvidia-h200.md)"
)
DEFAULT_TABLE: dict[str, tuple[str, str]] = {
    "seqfast::attention": ("vendor", _FLASH),
    "seqfast::attention_backward": ("vendor", _FLASH),
    "seqfast::pointwise_backward": (
        "lowering",
        "bias + GELU + dropout ran forward at 0.96x and forward + backward at 0.43x Inductor's"
        " speed on an H200 (benchmarks/results/nvidia-h200.md)",
    ),
}
"""What a CUDA call runs where nothing is measured (`SEQFAST_AUTOTUNE=0`), by op, with the
measurement behind it; an op absent runs its kernel, and so does a call the vendor named cannot
express."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """What a fused call runs ("kernel", "lowering" or "vendor") and why."""

    implementation: str
    reason: str
    launched: bool = False
    """Its kernels' launches are traced into the graph, for the executor to launch
    (`lower/traced_launches.py`)."""
    planned: bool = False
    """Those launches run as planned `Launch`es (`lower/planned_launches.py`)."""


def choose(gm: GraphModule, fake_mode: Any, options: Options, executor: str) -> dict[Node, Choice]:
    """The implementation of each fused call in `gm`, a graph the executor `executor` ("inductor"
    or "eager") runs, its values fake in `fake_mode`."""
    chosen = {}
    for node in gm.graph.nodes:
        entry = registry.entry_of(node)
        if entry is not None:
            chosen[node] = _choice(node, entry, options, executor, fake_mode)
    return chosen


_INJECTED: list[Measurer] = []


@contextlib.contextmanager
def measuring_with(measurer: Measurer) -> Iterator[None]:
    """Within it, "auto" calls on any device are measured with `measurer` (tests inject a
    timer; on CPU the op as called runs its reference, or its kernels under the interpreter)."""
    _INJECTED.append(measurer)
    try:
        yield
    finally:
        _INJECTED.remove(measurer)


def _choice(node: Node, entry: FusedOp, options: Options, executor: str, fake_mode) -> Choice:
    asked = options.implementations
    forced = asked.get(entry.name, asked.get(entry.family, "auto"))
    if forced == "vendor":
        refusal = entry.vendor_refusal(Call.of(node))
        if refusal is not None:
            return Choice("kernel", f"the implementations option asks for vendor, but {refusal}")
    if forced != "auto":
        return Choice(forced, "forced by the implementations option")
    device = device_of(node)
    measurer = _INJECTED[-1] if _INJECTED else None
    if measurer is None and device.type == "cuda" and tuning.autotuning(device):
        measurer = cuda_measurer()
    if measurer is None:
        return _by_rule(node, entry, device, executor)
    if entry.in_place is not None and node.target is entry.in_place.twin:
        return Choice("kernel", f"writes over its argument {entry.in_place.over}: not measured")
    bodies, not_eligible = _eligible(node, entry, fake_mode)
    if not bodies:
        return Choice("kernel", "; ".join(not_eligible))
    return _measured(node, entry, device, executor, fake_mode, measurer, bodies, not_eligible)


def _eligible(node: Node, entry: FusedOp, fake_mode) -> tuple[list[str], list[str]]:
    """The implementations besides the kernel that `node` may run, and why each other is not
    eligible."""
    bodies, not_eligible = [], []
    if "lowering" in entry.implementations:
        excess = _excess(node, fake_mode)
        if excess is None:
            bodies.append("lowering")
        else:
            not_eligible.append(f"the lowering is not eligible: {excess}")
    if "vendor" in entry.implementations:
        refusal = entry.vendor_refusal(Call.of(node))
        if refusal is None:
            bodies.append("vendor")
        else:
            not_eligible.append(f"the vendor is not eligible: {refusal}")
    return bodies, not_eligible


def _by_rule(node: Node, entry: FusedOp, device: torch.device, executor: str) -> Choice:
    if device.type == "cpu" and runtime.interpreting():
        return Choice("kernel", "on CPU under Triton's interpreter: the generated kernels")
    if device.type == "cpu":
        if executor == "inductor":
            return Choice("lowering", "on CPU: Inductor compiles it with its neighbours")
        return Choice("kernel", "on CPU with the eager executor: the op runs its reference")
    if device.type != "cuda":
        return Choice("kernel", f"on the {device.type} device: the op as called")
    implementation, why = DEFAULT_TABLE.get(str(node.target.name()), ("kernel", "no measurement"))
    if implementation == "vendor" and (refusal := entry.vendor_refusal(Call.of(node))):
        implementation, why = "kernel", f"the vendor is not eligible: {refusal}"
    return Choice(
        implementation, f"default table, nothing measured ({tuning.AUTOTUNE_ENV}=0): {why}"
    )


def _excess(node: Node, fake_mode: Any) -> str | None:
    """Why the lowering of `node` would hold more than the op allows (None: it would not): a
    value with more elements than the call's largest tensor argument or result and more bytes
    than the op's own workspace (attention's lowering holds every score)."""
    call_values = [a.meta.get("val") for a in node.all_input_nodes]
    call_values += tree_flatten(node.meta.get("val"))[0]
    largest = max((_numel(v) for v in call_values if isinstance(v, torch.Tensor)), default=0)
    workspace = registry.workspace_of(node)
    for inner in traced_body(node, fake_mode).gm.graph.nodes:
        value = inner.meta.get("val")
        if inner.op != "call_function" or not isinstance(value, torch.Tensor):
            continue
        if getattr(inner.target, "is_view", False):
            continue
        numel = _numel(value)
        if numel > largest and numel * value.element_size() > workspace:
            return (
                f"its {inner.target} holds {numel} elements where the call's largest tensor has"
                f" {largest} and the op's workspace is {workspace} bytes"
            )
    return None


def _numel(value: torch.Tensor) -> int:
    n = 1
    for size in value.shape:
        n *= concrete(size)
    return n


def _measured(
    node: Node,
    entry: FusedOp,
    device: torch.device,
    executor: str,
    fake_mode,
    measurer,
    bodies: list[str],
    not_eligible: list[str],
) -> Choice:
    path, key = _results_file(device), _key(node)
    found = read_entries(path, "implementations").get(key)
    if isinstance(found, dict) and found.get("implementation") in ("kernel", *bodies):
        return Choice(found["implementation"], f"measured earlier: {found.get('measured')}")
    compile_body = compiled_by_inductor if executor == "inductor" else run_as_traced
    launches = launch_trace(node, fake_mode) if launches_inlined(device, executor) else None
    traced = launches if isinstance(launches, Traced) else None  # (else the op as called)
    measured = measure(node, fake_mode, compile_body, measurer, traced, bodies)
    choice = _fastest(measured)
    said = "; ".join([choice.reason, *not_eligible])
    add_entry(path, key, {"implementation": choice.implementation, "measured": said})
    log.info("seqfast: %s: %s (%s)", key, choice.implementation, said)
    return Choice(choice.implementation, f"measured: {said}")


def _fastest(measured: Measured) -> Choice:
    """The fastest implementation that agrees with the reference, beats the kernel by more than
    `TIE` and allocates no more than it while it runs; the kernel otherwise."""
    times, allocated, rejected = dict(measured.times), measured.allocated, dict(measured.rejected)
    kernel_bytes = allocated.get("kernel")
    for name in [name for name in times if name != "kernel" and name in allocated]:
        if kernel_bytes is not None and allocated[name] > kernel_bytes + ALLOCATION_SLACK:
            rejected[name] = (
                f"allocates {allocated[name]} bytes while it runs where the kernel allocates"
                f" {kernel_bytes}"
            )
    said = ", ".join(f"{name} {ms:.4g} ms" for name, ms in times.items())
    said += "".join(f"; {name} left out: it {why}" for name, why in rejected.items())
    others = {name: ms for name, ms in times.items() if name != "kernel" and name not in rejected}
    best = min(others, key=others.__getitem__, default=None)
    kernel = times.get("kernel")
    wins = best is not None and (kernel is None or others[best] < kernel * (1 - TIE))
    if not times:
        log.warning("seqfast: no implementation agrees with the reference (%s)", said)
    return Choice(best if wins else "kernel", said)


def _key(node: Node) -> str:
    """What a measurement holds for: the op, its kernels' specializations and its literal
    arguments, and each tensor's dtype with its sizes rounded up to powers of two."""
    call = Call.of(node)
    specs = [spec.key for spec in registry.kernels_of(node)]
    literals = {n: call[n] for n in call if not _holds_node(call[n])}
    shapes = []
    for name in call:
        value = call.value(name)
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                bucket = "x".join(str(_power_of_two(concrete(s))) for s in leaf.shape)
                shapes.append(f"{name}:{str(leaf.dtype).removeprefix('torch.')}[{bucket}]")
    digest = text_digest(repr((specs, sorted(literals.items(), key=str))))
    return "|".join([node.target.name(), digest, *shapes])


def _holds_node(value: Any) -> bool:
    return any(isinstance(leaf, Node) for leaf in tree_flatten(value)[0])


def _power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _results_file(device: torch.device) -> Path:
    """The file holding the choices measured on `device`'s model with this torch and Triton."""
    model = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "-", f"{model}-torch-{torch.__version__}")
    return cache_dir() / "implementations" / f"{name}-triton-{triton.__version__}.json"
