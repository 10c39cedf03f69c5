"""`seqcompile.memory_timeline`: the live bytes of one training step over its forward and backward,
eager's as measured op by op and seqfast's plan as the memory model predicts it (one line per
memory budget), optionally drawn on one picture (a PNG, with matplotlib installed).

The two schedules have different lengths (eager runs ops, the plan counts graph nodes), so each
phase is drawn over its own progress: 0 to 1 the forward, 1 to 2 the backward. Parameters and the
batch are left out of both; the gradients are in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from seqcompile.memory import dry_run
from seqcompile.memory.live_bytes import measure_step
from seqcompile.memory.liveness import Timeline, combined_timeline


@dataclasses.dataclass(frozen=True)
class MemoryTimelines:
    eager: Timeline
    """Measured while eager PyTorch ran the step."""
    planned: dict[float, Timeline]
    """seqfast's predicted schedule, by memory budget."""
    title: str = "live bytes of one training step"

    def draw(self, path: str | Path) -> Path:
        """Write the picture to `path` (PNG) and return it."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            raise ImportError(
                "drawing the memory timeline needs matplotlib: pip install matplotlib"
            ) from None
        figure = Figure(figsize=(8, 4.5))
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        _plot(axes, self.eager, "eager PyTorch (measured)", "black")
        for budget, timeline in self.planned.items():
            _plot(axes, timeline, f"seqfast, memory_budget {budget:g} (planned)", None)
        axes.axvline(1.0, color="grey", linestyle=":", linewidth=1)
        axes.set_xlim(0, 2)
        axes.set_xticks([0, 0.5, 1, 1.5, 2], ["", "forward", "", "backward", ""])
        axes.set_ylabel("live MiB (activations and gradients)")
        axes.set_title(self.title)
        axes.legend(loc="upper left")
        figure.tight_layout()
        path = Path(path)
        figure.savefig(path, dpi=110)
        return path


def memory_timeline(
    model: nn.Module,
    example_batch: Any,
    *,
    path: str | Path | None = None,
    budgets: Sequence[float] = (1.0,),
    options: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> MemoryTimelines:
    """Measure eager's live bytes over one step of `model` on `example_batch` (positional
    arguments as a tuple, or keyword arguments as a dict), predict seqfast's at each of
    `budgets`, and draw both to `path` when given. The loss is `loss_fn(output)`, by default the
    output itself when it is a tensor or its `.loss`. The model's `.grad`s are left as they
    were; seqfast's plan is compiled on the meta device and does not run."""
    batch = dry_run.as_batch(example_batch)
    args, kwargs = dry_run.call_arguments(batch)
    loss_of = loss_fn or _loss
    lasting = [*model.parameters(), *model.buffers()]
    lasting += [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    try:
        eager = measure_step(lambda: loss_of(model(*args, **kwargs)), lasting)
    finally:
        for p, grad in zip(model.parameters(), grads, strict=True):
            p.grad = grad
    meta_model = dry_run.meta_copy(model)
    size = dry_run.batch_size(batch)
    planned = {
        budget: combined_timeline(
            [
                plan.step
                for plan in dry_run.memory_plans(
                    meta_model,
                    dry_run.at_batch_size(batch, size),
                    {**(options or {}), "memory_budget": budget},
                )
            ]
        )
        for budget in budgets
    }
    timelines = MemoryTimelines(
        eager, planned, f"{type(model).__name__}, batch {size}: live bytes of one training step"
    )
    if path is not None:
        timelines.draw(path)
    return timelines


def _loss(output: Any) -> torch.Tensor:
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            "the model's output is neither a one-element loss tensor nor has a .loss; pass"
            " loss_fn=... to say how to get the loss from it"
        )
    return loss


def _plot(axes: Any, timeline: Timeline, label: str, color: str | None) -> None:
    forward, backward = timeline.forward_steps, len(timeline.values) - timeline.forward_steps
    xs = [(i + 1) / max(forward, 1) for i in range(forward)]
    xs += [1 + (i + 1) / max(backward, 1) for i in range(backward)]
    mib = [v / 2**20 for v in timeline.values]
    # each value is drawn over the op (or node) that leaves it, so the last one shows too
    axes.step([0, *xs], [0, *mib], where="pre", label=label, color=color, linewidth=1.2)
