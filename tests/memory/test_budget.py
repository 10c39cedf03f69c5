"""Rematerialization under a memory budget: the kept bytes fit the budget, the step's loss and
every gradient stay those of the unbudgeted step, cheap values are recomputed before dear ones,
an unreachable budget says so, user checkpoints stay recomputed, and torch's own budgeted
partitioner runs on the same graph for comparison."""

import logging

import pytest
import torch
from checks import TINY_GPT

from seqcompile.demo import GPT, GPTConfig, toy_batch
from seqcompile.report import CompileReport, collecting
from tests.memory.test_checkpoint import CheckpointedGPT

pytestmark = pytest.mark.slow  # each test compiles a model at several budgets

CONFIG = TINY_GPT


def step(model, config=CONFIG, batch=2, length=16, **options):
    """Loss, gradients and the graph's memory plan of one compiled step, seeded the same way."""
    torch._dynamo.reset()
    model.zero_grad()
    idx, targets = toy_batch(config, batch, length, torch.device("cpu"), torch.Generator())
    torch.manual_seed(1)
    with collecting() as report:
        loss = torch.compile(model, backend="seqfast", options=options)(idx, targets)
    loss.backward()
    (plan,) = report.memory
    return loss, [p.grad.clone() for p in model.parameters()], plan


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(CONFIG)


UNPLANNED: dict[str, tuple] = {}
"""Per executor, the step with nothing recomputed, which every budget is compared with (an
Inductor compile of the step is most of this file's time)."""


@pytest.mark.parametrize(
    "rest", ["eager", pytest.param("inductor", marks=pytest.mark.rotating(3))]
)  # Inductor compiles a step per budget: one budget per run, in turn
@pytest.mark.parametrize("budget", [1.0, 0.5, 0.25])
def test_a_budget_fits_the_kept_bytes_and_leaves_the_numerics_alone(gpt, rest, budget):
    if rest not in UNPLANNED:
        UNPLANNED[rest] = step(gpt, rest=rest, checkpoint="none")
    loss, grads, plan = UNPLANNED[rest]
    budgeted_loss, budgeted_grads, budgeted = step(gpt, rest=rest, memory_budget=budget)
    torch.testing.assert_close(budgeted_loss, loss, rtol=0, atol=0)
    for g, expected in zip(budgeted_grads, grads, strict=True):
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6)
    if budget == 1.0:  # no budget: what is cheap is recomputed, never a matmul or attention
        assert budgeted.budget.cheap_only and budgeted.budget.cost.flops == 0
        assert budgeted.step.kept_bytes == budgeted.budget.planned_bytes < plan.step.kept_bytes
        assert "no memory budget: recomputing" in str(CompileReport(memory=[budgeted]))
        return
    assert budgeted.budget.reachable
    assert budgeted.budget.baseline_bytes >= plan.step.kept_bytes
    assert budgeted.step.kept_bytes <= budget * budgeted.budget.baseline_bytes
    # the planner's model of the partition is the partition
    assert budgeted.step.kept_bytes == budgeted.budget.planned_bytes
    assert budgeted.recompute.flops > 0
    # whatever the budget stopped keeping, the backward makes again
    assert budgeted.step.kept_bytes + budgeted.step.recomputed_bytes >= plan.step.kept_bytes
    assert "the backward's recompute makes" in str(CompileReport(memory=[budgeted]))


def test_the_planner_recomputes_cheap_values_first_and_keeps_attention():
    # sizes where the roofline, not the launch, prices each node
    config = GPTConfig(vocab=512, max_len=256, d_model=256, n_heads=4, n_layers=1, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(config)
    _, _, plan = step(model, config, batch=4, length=128, memory_budget=0.6)
    chosen = plan.budget.recomputed
    assert plan.budget.reachable
    assert any(name.startswith("pointwise") for name in chosen)
    assert not any(name.startswith("attention") for name in chosen)
    first_matmul = min(i for i, name in enumerate(chosen) if name.startswith(("mm", "addmm")))
    first_pointwise = min(i for i, name in enumerate(chosen) if name.startswith("pointwise"))
    assert first_pointwise < first_matmul


def test_an_absolute_budget_is_met(gpt):
    _, _, plan = step(gpt)
    limit = plan.step.kept_bytes // 3
    _, _, budgeted = step(gpt, memory_budget=f"{limit}B")
    assert budgeted.budget.target_bytes == limit
    assert budgeted.step.kept_bytes <= limit


def test_an_unreachable_budget_is_reported_and_the_least_reachable_plan_kept(gpt, caplog):
    _, _, quarter = step(gpt, memory_budget=0.25)
    with caplog.at_level(logging.WARNING, logger="seqcompile"):
        loss, _, plan = step(gpt, memory_budget="2B")
    assert not plan.budget.reachable
    assert "not reachable" in caplog.text
    assert "NOT reachable" in str(CompileReport(memory=[plan]))
    assert plan.step.kept_bytes < quarter.step.kept_bytes
    assert torch.isfinite(loss)


def test_user_checkpoints_stay_recomputed_under_a_budget():
    torch.manual_seed(0)
    model = CheckpointedGPT(CONFIG)
    loss, grads, checkpointed = step(model)
    budgeted_loss, budgeted_grads, budgeted = step(model, memory_budget=0.5)
    assert budgeted.step.kept_bytes <= checkpointed.step.kept_bytes
    assert budgeted.step.kept_bytes <= 0.5 * budgeted.budget.baseline_bytes
    torch.testing.assert_close(budgeted_loss, loss, rtol=0, atol=0)
    for g, expected in zip(budgeted_grads, grads, strict=True):
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_torchs_budgeted_partitioner_runs_on_the_same_graph_and_keeps_dropout_masks(gpt, budget):
    loss, grads, plain_min_cut = step(gpt, partition="min_cut")
    torch_loss, torch_grads, by_torch = step(gpt, checkpoint="torch", memory_budget=budget)
    assert by_torch.partitioner == "min_cut" and by_torch.budget is None
    assert by_torch.step.kept_bytes < plain_min_cut.step.kept_bytes
    # its knapsack would recompute the dropout seed, drawing other masks: the seed is kept
    torch.testing.assert_close(torch_loss, loss, rtol=0, atol=0)
    for g, expected in zip(torch_grads, grads, strict=True):
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6)
