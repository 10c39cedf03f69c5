"""The `verify` option: when a graph is compiled, it is run beside the graph Dynamo captured
(eager), on copies of the inputs of the call that made Dynamo compile it (laid out as given:
sizes, strides and storage offsets), forward and backward with the same random output
gradients, and every output and input gradient is compared within a tolerance for its dtype.

On a mismatch the fused site responsible is found by bisection (the graph is recompiled fusing only
the first sites in graph order until the smallest failing prefix is known; repeated while a
mismatch remains), the graph is compiled without it, a warning names the site and the error, and a
standalone script that reproduces the mismatch is written into the dump folder (or a temporary
one). What `verify` found goes into the compile report.

A graph that draws random numbers (dropout) cannot be compared with eager, whose random numbers
differ: it is reported as not verified.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.fx import GraphModule
from torch.utils._pytree import tree_leaves

from seqcompile.dump import GraphDump
from seqcompile.dump import graphs as dump
from seqcompile.report import CompileReport, Missed, publish

log = logging.getLogger("seqcompile")

TOLERANCE = {
    torch.float64: 1e-7,
    torch.float32: 1e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
"""Largest accepted difference, relative to the largest magnitude of the reference value."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """What `verify` found for one graph, for the report."""

    graph: str
    verdict: str
    left_unfused: tuple[str, ...] = ()
    repro: str | None = None

    def __str__(self) -> str:
        lines = [f"  {self.graph}: {self.verdict}"]
        lines += [f"    left unfused: {site}" for site in self.left_unfused]
        if self.repro:
            lines.append(f"    reproduction: {self.repro}")
        return "\n".join(lines)


_DROP_PROBABILITY = {
    torch.ops.aten.dropout.default: (1, "p"),
    torch.ops.aten.native_dropout.default: (1, "p"),
    torch.ops.aten.scaled_dot_product_attention.default: (4, "dropout_p"),
}
"""Ops that draw random numbers only to drop with a probability (where it is found)."""


def draws_random_numbers(gm: GraphModule) -> bool:
    """Whether the (ATen) graph has an op that draws random numbers; one that only drops with
    probability 0 (or a dropout not training) does not count."""
    for node in gm.graph.nodes:
        tags = getattr(node.target, "tags", ())
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in tags:
            continue
        if node.target in _DROP_PROBABILITY:
            index, name = _DROP_PROBABILITY[node.target]
            p = node.kwargs.get(name, node.args[index] if len(node.args) > index else 0.0)
            train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)
            if p == 0 or (node.target is torch.ops.aten.dropout.default and train is False):
                continue
        return True
    return False


Compile = Callable[[frozenset[str] | None], tuple[Callable[..., Any], dict[str, str]]]
"""Compiles the graph fusing only the given site keys (None: all); returns the callable and the
sites it fused (key to place in the source)."""


def verified(
    name: str,
    captured: GraphModule,
    compiled: Callable[..., Any],
    sites: dict[str, str],
    recompile: Compile,
    args: Sequence[Any],
    dump_dir: Path | None,
    random: bool,
) -> tuple[Callable[..., Any], Finding]:
    """Compare `compiled` with `captured` on `args` (gradients too when grad mode is on); return
    what should run from now on and what was found. `random`: the graph draws random numbers."""
    if random:
        return compiled, Finding(name, "not verified: the graph draws random numbers (dropout)")
    mismatch = error = difference(captured, compiled, args)
    if mismatch is None:
        return compiled, Finding(name, f"matches eager ({len(sites)} fused sites)")
    left_out: list[str] = []
    while mismatch is not None:
        culprit = _first_failing_site(captured, recompile, args, list(sites), left_out)
        if culprit is None:
            break
        left_out.append(culprit)
        compiled, _ = recompile(frozenset(sites) - set(left_out))
        mismatch = difference(captured, compiled, args)
    unfused = tuple(f"{key} at {sites[key]}" for key in left_out)
    repro = _write_repro(name, captured, args, dump_dir, error)
    if mismatch is not None:
        verdict = f"differs from eager with no site to blame ({mismatch}); running eager"
        compiled = captured
    else:
        verdict = f"differed from eager ({error}); compiled without the site(s) responsible"
    warnings.warn(
        f"seqfast verify: {name} {verdict}"
        + "".join(f"; left unfused: {site}" for site in unfused)
        + f"; reproduction: {repro}",
        stacklevel=2,
    )
    return compiled, Finding(name, verdict, unfused, str(repro))


Recompiled = tuple[Callable[..., Any], CompileReport, dict[str, str]]
"""A recompile's callable, its report and the sites it fused."""


class Compiled(Protocol):
    """What `on_first_call` reads of the compile it checks."""

    name: str
    report: CompileReport
    dump: GraphDump


class Fused(Protocol):
    """What it reads of the fuse stage's result: the sites (key to place) and whether the graph
    draws random numbers."""

    sites: dict[str, str]
    draws_random: bool


def on_first_call(
    captured: GraphModule,
    compiled: Callable[..., Any],
    state: Compiled,
    fused: Fused,
    recompile: Callable[[frozenset[str] | None, Sequence[Any]], Recompiled],
) -> Callable[..., Any]:
    """`compiled`, compared with `captured` on its first call's inputs; from then on it runs
    without the fused sites that made them differ (`recompile`: the graph compiled fusing only
    the given sites, at the given inputs). What was found is published as a report of its own
    and added to the compile's report and its dump."""
    chosen: list[Callable[..., Any]] = []

    def run(*args: Any) -> Any:
        if not chosen:
            recompiled: list[tuple[Callable[..., Any], CompileReport]] = []

            def again(only: frozenset[str] | None) -> tuple[Callable[..., Any], dict[str, str]]:
                function, report, sites = recompile(only, args)
                recompiled.append((function, report))
                return function, sites

            result, finding = verified(
                state.name,
                captured,
                compiled,
                fused.sites,
                again,
                args,
                state.dump.folder,
                fused.draws_random,
            )
            found = CompileReport(verified=[finding])
            if result is not compiled:  # what runs now launches other kernels, or none
                found.withdrawn = (state.name,)
            if result is captured:  # running eager: nothing is fused
                found.counts.subtract(state.report.counts)
            else:
                found.counts.subtract(site.split(":")[0] for site in finding.left_unfused)
                kept = next((r for c, r in recompiled if c is result), CompileReport())
                found.kernels, found.memory = kept.kernels, kept.memory
                found.variants, found.sites = kept.variants, kept.sites
            found.missed += [
                Missed(state.name, "verify", f"left unfused: {site}")
                for site in finding.left_unfused
            ]
            state.report.merge(found)
            state.dump.report(state.report)
            publish(found)
            chosen.append(result)
        return chosen[0](*args)

    return run


def _first_failing_site(
    captured: GraphModule,
    recompile: Compile,
    args: Sequence[Any],
    order: list[str],
    left_out: list[str],
) -> str | None:
    """The site whose fusion first makes the graph differ: fusing the sites before it matches,
    fusing it too does not. None if fusing none of them differs already, or fusing all of them
    no longer does (a difference that does not repeat)."""
    candidates = [key for key in order if key not in left_out]

    def fails(count: int) -> bool:
        return difference(captured, recompile(frozenset(candidates[:count]))[0], args) is not None

    if not candidates or fails(0) or not fails(len(candidates)):
        return None
    low, high = 0, len(candidates)  # fusing `low` sites matches, fusing `high` differs
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fails(middle) else (middle, high)
    return candidates[high - 1]


def difference(
    reference: Callable[..., Any], candidate: Callable[..., Any], args: Sequence[Any]
) -> str | None:
    """The first output or input gradient where `candidate` differs from `reference` on `args`
    beyond its dtype's tolerance, described; None if none does. Both run in the caller's grad
    mode; gradients are compared only where it is on."""
    expected, expected_grads = _run(reference, args)
    actual, actual_grads = _run(candidate, args)
    if len(actual) != len(expected):
        return f"{len(actual)} outputs where eager has {len(expected)}"
    pairs = [(f"output {i}", a, e) for i, (a, e) in enumerate(zip(actual, expected, strict=True))]
    pairs += [
        (f"the gradient of input {i}", a, e)
        for i, (a, e) in enumerate(zip(actual_grads, expected_grads, strict=True))
    ]
    for what, a, e in pairs:
        problem = _compare(a, e)
        if problem:
            return f"{what}: {problem}"
    return None


def copy_as_given(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`, detached and requiring grad as `t` does, with `t`'s sizes, strides and
    storage offset. `clone` would make a strided view contiguous and drop its offset, and a
    fused op that reads some layout wrongly must meet that layout in the comparison as it does
    in the user's call."""
    source = t.detach()
    plain = type(source) is torch.Tensor and source.layout == torch.strided
    if not plain or source.is_conj() or source.is_neg():
        return source.clone().requires_grad_(t.requires_grad)
    offset = source.storage_offset()
    extent = 0  # elements from the first the view reads to the last, gaps included
    if source.numel():
        extent = 1 + sum((n - 1) * s for n, s in zip(source.shape, source.stride(), strict=True))
    storage = source.new_empty((offset + extent,))
    storage[offset:].copy_(source.as_strided((extent,), (1,), offset))
    copy = storage.as_strided(source.shape, source.stride(), offset)
    return copy.requires_grad_(t.requires_grad)


def _run(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    inputs = [copy_as_given(a) if isinstance(a, torch.Tensor) else a for a in args]
    outputs = [t for t in tree_leaves(fn(*inputs)) if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled():
        differentiable = [t for t in outputs if t.requires_grad]
        generator = torch.Generator().manual_seed(0)
        cotangents = [
            torch.randn(t.shape, generator=generator).to(t.device, t.dtype) for t in differentiable
        ]
        if differentiable:
            torch.autograd.backward(differentiable, cotangents)
    grads = [
        i.grad if isinstance(i, torch.Tensor) and torch.is_grad_enabled() else None for i in inputs
    ]
    return [t.detach() for t in outputs], grads


def _compare(actual: torch.Tensor | None, expected: torch.Tensor | None) -> str | None:
    if (actual is None) != (expected is None):
        return (
            "eager has a gradient and the compiled graph none"
            if actual is None
            else ("the compiled graph has a gradient and eager none")
        )
    if expected is None:
        return None
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return (
            f"{actual.dtype}{list(actual.shape)} where eager has"
            f" {expected.dtype}{list(expected.shape)}"
        )
    if not expected.is_floating_point():
        return None if torch.equal(actual, expected) else "values differ"
    a, e = actual.double(), expected.double()
    if not torch.equal(a.isnan(), e.isnan()):
        return "NaN in other places than eager"
    a, e = a.nan_to_num(0.0), e.nan_to_num(0.0)
    scale = e.abs().max().item() if e.numel() else 0.0
    error = (a - e).abs().max().item() if e.numel() else 0.0
    tolerance = TOLERANCE.get(expected.dtype, 1e-3) * max(scale, 1e-6)
    if error > tolerance:
        return f"max difference {error:.3g} at magnitude {scale:.3g} (tolerance {tolerance:.3g})"
    return None


def _write_repro(
    name: str, captured: GraphModule, args: Sequence[Any], dump_dir: Path | None, error: str | None
) -> Path:
    """A script that rebuilds the captured graph, draws inputs of the same sizes, dtypes and
    strides, and compares seqfast with eager through `verify.difference`."""
    folder = dump_dir or Path(tempfile.mkdtemp(prefix="seqfast_verify_"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}_verify_repro.py"
    path.write_text(
        dump.script(
            f"seqfast verify found that {name} differs from eager: {error}.\n"
            f"Run: python {path.name}",
            captured,
            args,
            "from seqcompile.checks.verify import difference",
            "    module, args = Repro(), inputs()\n"
            '    compiled = torch.compile(module, backend="seqfast")\n'
            '    print(difference(module, compiled, args) or "matches eager")\n',
        )
    )
    return path
