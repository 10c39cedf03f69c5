"""The differential fuzzer: each seed's program (tests/fuzz/programs.py) runs in eager and compiled
with seqfast; the outputs, every gradient (inputs and parameters) and the fusion counts the docs
promise must agree. Programs with dropout are compared with p=0, then run with p>0 for shapes,
finite values, and the keep ratio and scaling where a dropout is the last op. A failure's first
line names the seed, the program and the command that reruns it alone; the program follows as a
script."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from conftest import TOLERANCES

from fuzz.programs import Program, generate
from seqcompile.ops.registry import FAMILIES
from seqcompile.report import collecting

ALL_SEEDS = range(200)
DEFAULT_SEEDS = (*range(1, 10), 24, 38, 39)
"""Seeds 1 to 9, and the first seeds after them to draw the generators those miss (a boolean and
a prefix-LM mask, a mask filled as `where(m, 0, fill)`, 24; one filled as `(1 - m) * fill`, 38;
a product of masks, 39). Seed 0, the slowest of the first ten, draws nothing these miss. The default
run takes half of them, in turn (the whole set every two runs); the slow tier runs every other
seed."""
SLOW_SEEDS = tuple(seed for seed in ALL_SEEDS if seed not in DEFAULT_SEEDS)


@dataclasses.dataclass
class Run:
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    counts: Counter[str]
    missed: list[str]
    readings: Counter[str]
    """What fused attention computes from the model's code (causal, a window, a prefix, a bias
    by key - query) or reads as a tensor, and the readings evaluating the code refuted."""


class Fuzzed(torch.nn.Module):
    """A program as a module: `m` holds its parameters; with `ws` it returns the projected loss."""

    def __init__(self, namespace: dict[str, Any], m: torch.nn.Module, ws: list | None):
        super().__init__()
        self.m, self.ws = m, ws
        self.program, self.project = namespace["program"], namespace["project"]

    def forward(self, *xs: torch.Tensor) -> Any:
        outs = self.program(self.m, *xs)
        return outs if self.ws is None else self.project(outs, self.ws)


def run(
    program: Program,
    p: float,
    compiled: bool,
    ws: list | None = None,
    double: bool = False,
    wobble: int | None = None,
) -> Run:
    """One forward and backward of `program` with dropout `p`, eager or with seqfast. Given `ws`
    (projection weights), the outputs are projected to the scalar loss (by the compiled function
    itself when `compiled`) and that loss is the one output. `double` runs eager on float64
    copies of the parameters and inputs; `wobble` (a seed) with every float parameter and input
    moved by up to one unit of its dtype's precision (`sensitivity`)."""
    namespace = program.namespace(p)
    g = torch.Generator().manual_seed(program.seed)
    m, xs = namespace["build"](g), namespace["inputs"](g)
    if wobble is not None:
        moved = torch.Generator().manual_seed(wobble)
        with torch.no_grad():
            for t in [*m.parameters(), *xs]:
                if t.is_floating_point() and t.numel() and 0 not in t.stride():
                    u = torch.rand(t.shape, generator=moved) * 2 - 1
                    t.copy_((t.double() * (1 + u * torch.finfo(t.dtype).eps)).to(t.dtype))
    if double:
        m.double()
        xs = [
            x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x
            for x in xs
        ]
    fn: Any = Fuzzed(namespace, m, ws if compiled else None)
    if compiled:
        torch._dynamo.reset()  # every program runs through the same Fuzzed.forward
        fn = torch.compile(fn, backend="seqfast")
    torch.manual_seed(program.seed)
    with collecting() as report:
        result = fn(*xs)
        if compiled and ws is not None:
            outputs, loss = [result], result
        else:
            outputs = list(result)
            cast = torch.Tensor.double if double else torch.Tensor.float
            rs = ws or namespace["weights"](outputs)
            loss = sum((cast(o) * r).sum() for o, r in zip(outputs, rs, strict=True))
            outputs = outputs if ws is None else [loss]
        loss.backward()
    leaves = {f"input {i}": x for i, x in enumerate(xs) if x.requires_grad}
    leaves.update({f"parameter {n}": t for n, t in m.named_parameters()})
    return Run(
        outputs=[o.detach() for o in outputs],
        grads={name: t.grad for name, t in leaves.items()},
        counts=report.counts,
        missed=[f"{m.pattern}: {m.reason}" for m in report.missed],
        readings=readings(report),
    )


READINGS = {
    "causal after a prefix": "prefix LM",
    "causal": "causal",
    "sliding window": "window",
    "reads a bias by key - query": "bias by key - query",
    "reads a mask": "mask read as a tensor",
    "reads a bias": "bias read as a tensor",
    "compares document ids": "documents",
}


def readings(report: Any) -> Counter[str]:
    """The attention readings of `report`'s forward sites (`READINGS`), and "refuted: <reason>"
    for each one evaluating the model's code refuted."""
    found: Counter[str] = Counter()
    for site in report.sites:
        for part in site.rsplit(": ", 1)[-1].split("; ")[0].split(", "):
            name = next((n for start, n in READINGS.items() if part.startswith(start)), None)
            if name is not None:
                found[name] += 1
    found.update(f"refuted: {m.reason}" for m in report.refuted)
    return found


AMPLIFIED_ULPS = 64
"""Eager off from the float64 result by more than this many units of the dtype's precision at
the result's largest magnitude: the program amplifies rounding (see `assert_close`)."""
ILL_CONDITIONED = 8
"""How much farther from the float64 result than eager seqfast may then be."""
WOBBLES = 3
"""Eager runs on inputs moved by rounding that measure a program's `sensitivity`."""


def assert_close(
    what: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    truth: Callable[[], torch.Tensor] | None = None,
    sensitivity: Callable[[], float] | None = None,
) -> None:
    """Within `dtype`'s tolerance of eager, the absolute part scaled by the largest expected
    magnitude (sums of many terms round at that scale). Failing that, `truth()` (the float64
    result) decides: seqfast may be as far from it as eager is, plus the tolerance (eager rounds
    too: a LayerNorm over one element has the gradient 0, eager's is not; where the float64 run
    fails, the difference is reported as it is). Where eager itself is
    off by far more than rounding (`AMPLIFIED_ULPS`), the program amplifies rounding (a LayerNorm
    over two nearly equal features multiplies its input's gradient by 1/std): an equivalent
    program that rounds differently, even with nothing fused, lands farther off by a small
    factor, so seqfast may be `ILL_CONDITIONED` times eager's distance. A program can amplify
    rounding where eager happens not to, at a jump: `minimum`, `where(x > c)`, a clamp, whose
    choice a difference of rounding upstream flips (it then routes a gradient elsewhere); where
    eager itself moves that far when its inputs move by rounding (`sensitivity()`, the largest
    change), seqfast may be `ILL_CONDITIONED` times that far from it."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    finite = expected[expected.isfinite()]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    tol = TOLERANCES[dtype]
    atol, rtol = tol["atol"] * scale, tol["rtol"]
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
    except AssertionError as error:
        message = f"{what} differs from eager: {error}"
        if truth is None:
            raise AssertionError(message) from None
        try:
            t = truth()
        except Exception as failed:  # (a cast to float32 written in the program, say)
            first = f"{type(failed).__name__}: {failed}".splitlines()[0]
            raise AssertionError(f"{message}\nand the float64 run failed: {first}") from None
        fast_off, eager_off = (actual.double() - t).abs(), (expected.double() - t).abs()
        allowed = eager_off + atol + rtol * t.abs()
        amplified = eager_off.max() > AMPLIFIED_ULPS * torch.finfo(dtype).eps * scale
        if amplified:
            allowed = torch.maximum(allowed, ILL_CONDITIONED * eager_off.max())
        if not (fast_off <= allowed).all() and sensitivity is not None:
            moved = sensitivity()
            allowed = torch.maximum(allowed, torch.tensor(ILL_CONDITIONED * moved).double())
        if not (fast_off <= allowed).all():
            raise AssertionError(
                f"{message}\nand from the float64 result by up to {fast_off.max().item():.3g},"
                f" where eager is off by up to {eager_off.max().item():.3g}"
            ) from None


def check_values(program: Program) -> tuple[Run, Run]:
    """Eager and seqfast with dropout off: outputs and gradients (a float64 run breaks ties);
    returns both runs."""
    eager = run(program, 0.0, compiled=False)
    namespace = program.namespace(0.0)
    ws = namespace["weights"](eager.outputs) if program.project_inside else None
    fast = run(program, 0.0, compiled=True, ws=ws)
    expected = eager.outputs if ws is None else [namespace["project"](eager.outputs, ws)]
    reference = functools.cache(lambda: run(program, 0.0, compiled=False, ws=ws, double=True))
    wobbled = functools.cache(
        lambda: [run(program, 0.0, compiled=False, ws=ws, wobble=k) for k in range(WOBBLES)]
    )

    def sensitivity(pick: Callable[[Run], torch.Tensor | None], e: torch.Tensor) -> float:
        """How far eager moves when its inputs move by rounding (see `assert_close`)."""
        moved = [(pick(w).double() - e.double()).abs() for w in wobbled()]
        return max(m[m.isfinite()].max().item() if m.isfinite().any() else 0.0 for m in moved)

    assert len(fast.outputs) == len(expected)
    for i, (a, e) in enumerate(zip(fast.outputs, expected, strict=True)):
        truth = functools.partial(lambda i: reference().outputs[i], i)
        output = functools.partial(
            lambda i, e: sensitivity(lambda w: w.outputs[i] if ws is None else w.outputs[0], e),
            i,
            e,
        )
        assert_close(f"output {i}", a, e, program.tolerance, truth, output)
    assert fast.grads.keys() == eager.grads.keys()
    for name, e in eager.grads.items():
        a = fast.grads[name]
        assert (a is None) == (e is None), f"{name}: a gradient exists in one run only"
        if e is not None:
            truth = functools.partial(lambda name: reference().grads[name], name)
            grad = functools.partial(
                lambda name, e: sensitivity(lambda w: w.grads[name], e), name, e
            )
            assert_close(f"gradient of {name}", a, e, program.tolerance, truth, grad)
    return eager, fast


def check_fusion_counts(program: Program, fast: Run) -> None:
    """What docs/ promises fused: attention, norm and loss sites exactly, pointwise regions
    at least (a region may also form around ops of other blocks)."""
    for family in FAMILIES:
        promised, fused = program.promised[family], fast.counts[family]
        exact = family != "pointwise"
        if fused != promised if exact else fused < promised:
            raise AssertionError(
                f"{family}: fused {fused}, the docs promise {'' if exact else 'at least '}"
                f"{promised}; refusals: {fast.missed or 'none'}"
            )


def check_dropout(program: Program, eager: list[torch.Tensor]) -> None:
    """With p > 0 the masks are seqfast's own: shapes and finite values everywhere, and for an
    output a dropout ends, the kept elements are eager's (no dropout) scaled by 1 / (1 - p), in
    the proportion 1 - p."""
    p = program.dropout
    fast = run(program, p, compiled=True)
    for i, (a, e) in enumerate(zip(fast.outputs, eager, strict=True)):
        assert a.shape == e.shape and a.dtype == e.dtype, f"output {i} with dropout {p}"
        assert a.isfinite().all(), f"output {i} with dropout {p} is not finite"
    for name, grad in fast.grads.items():
        assert grad is None or grad.isfinite().all(), f"gradient of {name} with dropout {p}"
    for i in program.dropped_outputs:
        a, e = fast.outputs[i], eager[i]
        kept = a != 0
        assert_close(f"kept elements of output {i}", a[kept], e[kept] / (1 - p), program.tolerance)
        n = (e != 0).sum().item()
        ratio = (kept & (e != 0)).sum().item() / max(n, 1)
        bound = 5 * math.sqrt(p * (1 - p) / max(n, 1)) + 1 / max(n, 1)
        assert abs(ratio - (1 - p)) <= bound, f"output {i} keeps {ratio:.3f}, not {1 - p}"


def check(program: Program) -> Run:
    """Every check of one program; returns the seqfast run with dropout off."""
    eager, fast = check_values(program)
    check_fusion_counts(program, fast)
    if program.dropout:
        check_dropout(program, eager.outputs)
    return fast


def headline(error: BaseException) -> str:
    """The first line of the error that started it (past Dynamo's wrapper of a backend's own)."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
        error = inner
    return f"{type(error).__name__}: {error}".splitlines()[0]


def failure(program: Program, nodeid: str, error: Exception) -> str:
    """The failure's one-line summary and rerun command, then each block that fails alone and
    the script of the smallest failing program."""
    lines = [
        f"{program.summary} | rerun: python -m pytest '{nodeid}'",
        headline(error),
    ]
    shown = program
    for i in range(program.blocks if program.blocks > 1 else 0):
        alone = generate(program.seed, only=(i,))
        try:
            check(alone)
        except Exception as e:
            lines.append(f"fails alone: {alone.summary}: {headline(e)}")
            shown = alone if shown is program else shown
    return "\n".join([*lines, f"\n{type(error).__name__}: {error}\n", shown.script()])


def fuzz(request: pytest.FixtureRequest, seed: int, records: list) -> None:
    program = generate(seed)
    try:
        fast = check(program)
    except Exception as error:
        raise AssertionError(failure(program, request.node.nodeid, error)) from error
    records.append((program, fast.counts, fast.missed, fast.readings))


KINDS = [
    # masks and biases from positions (fuzz/positions.py)
    *[f"canonical {form}" for form in ("causal", "window", "prefix", "padded causal")],
    *[f"canonical {form}" for form in ("tril", "nanoGPT", "triu hides", "band")],
    *[f"canonical {form}" for form in ("nn.Transformer", "Hugging Face", "BERT")],
    *["arange int32", "arange device=", "arange sliced", "arange offset"],
    *["arange at the end of the keys", "in-place positions"],
    *[f"positions {twist}" for twist in ("cast to int8", "halved", "floor-divided")],
    *[f"positions {twist}" for twist in ("as float", "modulo", "flipped", "clamped")],
    *[f"compare {op}" for op in ("<=", "<", ">=", ">", "==", "!=")],
    *["compare swapped", "compare difference", "compare shifted", "compare constant"],
    *["causal", "window", "prefix constant", "prefix per row", "padding", "mask &", "mask |"],
    *["triangle tril", "triangle triu", "triangle band", "triangle top left"],
    *["triangle of a fill", "(1 - m) * fill"],
    *["negated ~", "negated == 0", "negated logical_not", "negated torch.logical_not"],
    *[f"cast to {t}" for t in ("bool", "int8", "float", "long", "int", "the scores' dtype")],
    *["product", "product zeroed by a cast"],
    *["fill -inf", "fill finfo.min", "fill -1e4", "fill -1e9", "fill -3.0", "fill 5.0"],
    *["fill into bool", "fill into int", "fill into float", "where(m, 0, fill)"],
    *["set in place", "triu_/tril_ in place"],
    *["relative abs", "relative clamp", "relative negate", "relative masked causal"],
    *["relative learned slopes", "relative slopes made in the graph"],
    *["relative buckets", "relative log buckets"],
    *["apply sdpa bool mask", "apply sdpa float mask", "apply sdpa where(m, 0, fill)"],
    *["apply masked_fill", "apply where", "apply added bias", "apply added bool"],
    "apply relative bias",
    # target layouts (fuzz/programs.py)
    "target contiguous",
    *[
        f"target {layout} {made}"
        for layout in ("stepped", "column", "offset", "expanded")
        for made in ("input", "made in the program")
    ],
    "target shifted made in the program",
]
"""What the newer generators draw; the default seeds draw each at least once."""


def group(kind: str) -> str:
    """The generator a kind belongs to: its first word, the in-place edits together."""
    return "in place" if "place" in kind else kind.split()[0]


def programs_drawing(seeds: Iterable[int]) -> Counter[str]:
    """How many of the seeds' programs draw each kind (drawing takes no compile)."""
    programs: Counter[str] = Counter()
    for seed in seeds:
        programs.update(set(generate(seed).kinds))
    assert not programs.keys() - set(KINDS), "a kind missing from KINDS"
    return programs


def test_default_seeds_promise_every_family_of_the_registry():
    """The fuzzer checks the families the registry's operators are made by (`FAMILIES`): its
    default seeds promise a site of each, and nothing else."""
    promised = {family for seed in DEFAULT_SEEDS for family in generate(seed).promised}
    assert promised == set(FAMILIES)


def test_default_seeds_draw_every_generator():
    """A generator no default seed reaches tests nothing. Each generator's spellings are many
    and each rare, so the default seeds draw every generator (`group`), and all the seeds
    every spelling (`test_all_seeds_draw_every_kind`)."""
    programs = programs_drawing(DEFAULT_SEEDS)
    drawn = Counter()
    for kind, n in programs.items():
        drawn[group(kind)] += n
    missing = sorted({group(kind) for kind in KINDS} - drawn.keys())
    assert not missing, f"no default seed draws {missing}"


def test_all_seeds_draw_every_kind():
    """Every spelling is drawn by some seed, the slow tier's included (drawing all takes a few
    seconds)."""
    programs = programs_drawing(ALL_SEEDS)
    missing = [kind for kind in KINDS if not programs[kind]]
    assert not missing, f"no seed draws {missing}"


@pytest.mark.rotating(2)  # the default run has a time budget (tests/rotation.py)
@pytest.mark.parametrize("seed", DEFAULT_SEEDS)
def test_program(request, seed, fusion_records):
    fuzz(request, seed, fusion_records)


@pytest.mark.slow
@pytest.mark.rotating(4)  # a quarter of the seeds per run, in turn (tests/rotation.py)
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_program_long(request, seed, fusion_records):
    fuzz(request, seed, fusion_records)
