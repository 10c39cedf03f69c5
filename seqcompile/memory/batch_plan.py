"""`seqcompile.plan_batch`: the micro-batch size, gradient-accumulation steps and memory budget that
reach a target batch within a memory limit, chosen from the memory model instead of by running
into out-of-memory errors.

The model is compiled on the meta device (`memory/dry_run.py`) at two small batch sizes and at
the target batch, for each budget; the step's activation peak and its roofline time are linear in
the batch size for a fixed plan, so sizes between are read off straight lines. The candidate with
the least estimated time for the whole target batch is compiled at its own size before it is
chosen, and passed over if it does not fit after all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from seqcompile.memory import dry_run
from seqcompile.memory.estimate import tensor_bytes
from seqcompile.memory.liveness import combined_peak
from seqcompile.options import Options, size_with_unit
from seqcompile.report import format_bytes

BUDGETS = (1.0, 0.5, 0.25)
"""Memory budgets tried by default, most kept (least recompute) first."""


@dataclasses.dataclass
class Curve:
    """The step's (activation bytes, seconds) at the micro-batch sizes compiled so far; other
    sizes are read off the straight line through the two nearest (a fixed plan is linear in the
    batch size, the plan itself changes a little with it)."""

    points: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)

    def __call__(self, size: int) -> tuple[int, float]:
        if size in self.points:
            return self.points[size]
        known = sorted(self.points)
        above = [x for x in known if x > size][:1] or known[-2:-1]
        below = [x for x in known if x < size][-1:] or known[1:2]
        x0, x1 = sorted({*below, *above})
        (b0, s0), (b1, s1) = self.points[x0], self.points[x1]
        at = (size - x0) / (x1 - x0)
        return round(b0 + at * (b1 - b0)), s0 + at * (s1 - s0)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One micro-batch size at one budget, with what it holds and costs."""

    micro_batch: int
    steps: int
    memory_budget: float
    activation_bytes: int
    """The step's peak of activations, in-flight gradients and the batch itself."""
    total_bytes: int
    """With parameters, held gradients and optimizer state: what must fit the limit."""
    seconds: float
    """Roofline estimate of all `steps` micro-batches' forward and backward."""
    checked: bool = False
    """True when this size was compiled, False when read off the line between compiled sizes."""


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """What `plan_batch` found: the fixed memory, the alternatives, the choice and the options
    to compile with. `str(plan)` says why."""

    target_batch: int
    memory_limit: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    chosen: Candidate | None
    """The fastest candidate that fits; None when nothing does."""
    best_per_budget: tuple[Candidate, ...]
    """For each budget, the largest micro-batch that fits (the alternatives weighed)."""
    full_batch: tuple[Candidate, ...]
    """The whole target batch in one step at each budget."""
    compile_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The options the plan was made with, which `options` repeats."""

    @property
    def options(self) -> dict[str, Any]:
        """The `torch.compile(..., options=...)` entries this plan asks for."""
        options = dict(self.compile_options)
        if self.chosen is None:
            return options
        if self.chosen.memory_budget < 1:
            options["memory_budget"] = self.chosen.memory_budget
        if self.chosen.steps > 1:
            options["accumulate_grads"] = True
        return options

    def __str__(self) -> str:
        lines = [
            f"batch plan: target batch {self.target_batch} within"
            f" {format_bytes(self.memory_limit)}",
            f"  fixed: parameters {format_bytes(self.parameter_bytes)}, optimizer state"
            f" {format_bytes(self.optimizer_bytes)}, gradients {format_bytes(self.gradient_bytes)}"
            " (held between micro-batches)",
        ]
        for c in self.full_batch:
            verdict = "fits" if c.total_bytes <= self.memory_limit else "does not fit"
            lines.append(
                f"  the whole batch in one step at budget {c.memory_budget:g} needs"
                f" {format_bytes(c.total_bytes)}: {verdict}"
            )
        lines.append("  largest micro-batch that fits, per budget:")
        lines += [f"    {_describe(c)}" for c in self.best_per_budget] or ["    (none fits)"]
        if self.chosen is None:
            lines.append("  nothing fits: no micro-batch fits the limit at any budget tried")
            return "\n".join(lines) + "\n"
        c = self.chosen
        lines += [
            f"  chosen: {_describe(c)}",
            f"    the least estimated time for the target batch; options {self.options}",
        ]
        return "\n".join(lines) + "\n"


def _describe(c: Candidate) -> str:
    how = "compiled at this size" if c.checked else "on the line between compiled sizes"
    return (
        f"micro-batch {c.micro_batch} x {c.steps} step(s) at budget {c.memory_budget:g}:"
        f" {format_bytes(c.total_bytes)} ({format_bytes(c.activation_bytes)} of activations,"
        f" {how}), ~{c.seconds * 1e3:.3g} ms on the roofline"
    )


def plan_batch(
    model: nn.Module,
    example_batch: Any,
    memory_limit: int | float | str,
    target_batch: int,
    *,
    options: dict[str, Any] | None = None,
    optimizer_state: float = 2.0,
    compute_dtype: torch.dtype | None = None,
    budgets: Sequence[float] = BUDGETS,
    quiet: bool = False,
) -> BatchPlan:
    """Choose micro-batch size, accumulation steps and `memory_budget` so that training `model`
    on batches of `target_batch` fits `memory_limit` (bytes, or a size such as "40GiB"), and print
    why unless `quiet`.

    `example_batch` is the model's positional arguments (a tuple) or keyword arguments (a dict)
    for a small batch: every tensor whose leading size equals the first tensor's is taken to have
    the batch dimension first. Nothing runs on it; the model is compiled on the meta device.
    `optimizer_state` is the optimizer's state as a multiple of the trainable parameters' bytes
    (Adam and AdamW: 2, SGD with momentum: 1, plain SGD: 0). `options` are further seqfast
    options for the compile (not `memory_budget`, which this chooses). `compute_dtype` is the
    dtype activations have in training (`torch.bfloat16` under bf16 autocast): the compile on the
    meta device casts floating parameters and inputs to it, while parameters, gradients and
    optimizer state are counted in the dtype the model has (fp32 master weights), the gradients
    in flight too. Autocast's own copies of the weights in the compute dtype, and the ops it runs
    in float32, are not modelled.

    Micro-batch sizes are the divisors of `target_batch`. The estimate is conservative where
    gradients are concerned: with accumulation, those a micro-batch's backward makes are counted
    on top of the held `.grad`s, which `accumulate_grads` avoids. Temporaries of the optimizer's
    own step (a foreach implementation allocates about the parameters' size) are not counted.
    """
    limit = _parse_limit(memory_limit)
    if not isinstance(target_batch, int) or isinstance(target_batch, bool) or target_batch < 1:
        raise ValueError(f"target_batch must be a whole number >= 1; got {target_batch!r}")
    options = dict(options or {})
    if "memory_budget" in options:
        raise ValueError("plan_batch chooses memory_budget itself; pass budgets=(...) instead")
    Options.resolve(options)  # a bad option is refused here, before any compile
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise ValueError(f"budgets must be fractions in (0, 1]; got {budgets!r}")
    batch = dry_run.as_batch(example_batch)
    planner = _Planner(
        model,
        batch,
        options=options,
        target_batch=target_batch,
        limit=limit,
        budgets=tuple(dict.fromkeys(budgets)),
        fixed=_Fixed.of(model, optimizer_state),
        dtype=compute_dtype,
    )
    plan = planner.plan()
    if not quiet:
        print(plan, end="")
    return plan


class _Planner:
    """The search: candidates on the budgets' curves, the fastest that fits checked by a compile
    at its own size until one is both estimated and measured to fit."""

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        *,
        options: dict[str, Any],
        target_batch: int,
        limit: int,
        budgets: tuple[float, ...],
        fixed: _Fixed,
        dtype: torch.dtype | None,
    ) -> None:
        self.meta_model = dry_run.meta_copy(model, dtype)
        self.batch, self.options, self.dtype = batch, options, dtype
        self.target_batch, self.limit = target_batch, limit
        self.budgets, self.fixed = budgets, fixed
        self.curves = {budget: Curve() for budget in budgets}
        self.sizes = [m for m in range(target_batch, 0, -1) if target_batch % m == 0]
        base = dry_run.batch_size(batch)
        for budget in budgets:
            for size in sorted({base, 2 * base, target_batch}):
                self.measure(size, budget)

    def measure(self, size: int, budget: float) -> None:
        batch = dry_run.at_batch_size(self.batch, size, self.dtype)
        plans = dry_run.memory_plans(
            self.meta_model, batch, {**self.options, "memory_budget": budget}
        )
        seconds = sum(p.step_seconds for p in plans)
        steps = [plan.step for plan in plans]
        # gradients in flight at the parameters' dtype (the meta copy's may be narrower)
        gradients = max(0, self.fixed.gradients - sum(step.gradient_bytes for step in steps))
        batch_bytes = sum(
            tensor_bytes(t) for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)
        )
        self.curves[budget].points[size] = (combined_peak(steps) + gradients + batch_bytes, seconds)

    def estimate(self, size: int, budget: float) -> Candidate:
        memory, seconds = self.curves[budget](size)
        steps = self.target_batch // size
        return Candidate(
            micro_batch=size,
            steps=steps,
            memory_budget=budget,
            activation_bytes=memory,
            total_bytes=self.fixed.total(memory, steps),
            seconds=steps * seconds,
            checked=size in self.curves[budget].points,
        )

    def fitting(self) -> list[Candidate]:
        """Candidates that fit the limit, largest micro-batch first within each budget."""
        every = [self.estimate(m, b) for b in self.budgets for m in self.sizes]
        return [c for c in every if c.total_bytes <= self.limit]

    def plan(self) -> BatchPlan:
        chosen = None
        while chosen is None and (fitting := self.fitting()):
            best = min(fitting, key=lambda c: (c.seconds, -c.memory_budget))
            if best.checked:
                chosen = best
            else:
                self.measure(best.micro_batch, best.memory_budget)
        fitting = self.fitting()
        return BatchPlan(
            target_batch=self.target_batch,
            memory_limit=self.limit,
            parameter_bytes=self.fixed.parameters,
            gradient_bytes=self.fixed.gradients,
            optimizer_bytes=self.fixed.optimizer,
            chosen=chosen,
            best_per_budget=tuple(
                next(c for c in fitting if c.memory_budget == b)
                for b in self.budgets
                if any(c.memory_budget == b for c in fitting)
            ),
            full_batch=tuple(self.estimate(self.target_batch, b) for b in self.budgets),
            compile_options=self.options,
        )


@dataclasses.dataclass(frozen=True)
class _Fixed:
    """Memory that does not grow with the batch."""

    parameters: int
    gradients: int
    optimizer: int

    @classmethod
    def of(cls, model: nn.Module, optimizer_state: float) -> _Fixed:
        trainable = sum(tensor_bytes(p) for p in model.parameters() if p.requires_grad)
        return cls(
            parameters=sum(tensor_bytes(t) for t in [*model.parameters(), *model.buffers()]),
            gradients=trainable,
            optimizer=int(optimizer_state * trainable),
        )

    def total(self, activation_bytes: int, steps: int) -> int:
        """The most held at once: during a micro-batch (gradients held between micro-batches
        when there are several; with one, the peak already counts them), or at the optimizer's
        step."""
        held_gradients = self.gradients if steps > 1 else 0
        during = activation_bytes + held_gradients
        return self.parameters + self.optimizer + max(during, self.gradients)


def _parse_limit(value: int | float | str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    size = size_with_unit(value) if isinstance(value, str) else None
    if size is None or size <= 0:
        raise ValueError(
            f'memory_limit must be a number of bytes or a size such as "40GiB"; got {value!r}'
        )
    return size
