"""`seqcompile.plan_batch`: the plan fits the limit by the memory model (checked against a real
compile at the chosen size), reaches the target batch, prefers no accumulation when the batch
fits, says when nothing fits, and refuses bad arguments."""

import pytest
import torch
from checks import TINY_GPT, tiny_gpt_batch

import seqcompile
from seqcompile.demo import GPT
from seqcompile.memory.batch_plan import Curve
from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # each test plans and compiles a model several times

CONFIG = TINY_GPT
TARGET = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(CONFIG)


@pytest.fixture(scope="module")
def roomy(model):
    options = {"rest": "eager"}
    return seqcompile.plan_batch(
        model, tiny_gpt_batch(), "1GiB", TARGET, options=options, quiet=True
    )


def test_a_roomy_limit_takes_the_whole_batch_at_once_without_recompute(roomy):
    chosen = roomy.chosen
    assert (chosen.micro_batch, chosen.steps, chosen.memory_budget) == (TARGET, 1, 1.0)
    assert chosen.checked and roomy.options == {"rest": "eager"}  # the options it was given
    # the fixed part: parameters (the tied head counted once), their gradients, Adam's moments
    assert roomy.parameter_bytes == sum(p.numel() * 4 for p in GPT(CONFIG).parameters()) + sum(
        b.numel() for b in GPT(CONFIG).buffers()
    )
    assert roomy.optimizer_bytes == 2 * roomy.gradient_bytes


def test_a_tight_limit_gets_a_fitting_plan_whose_numbers_a_real_compile_repeats(
    model, roomy, capsys
):
    whole = roomy.full_batch[0].total_bytes
    limit = int(0.5 * whole)
    plan = seqcompile.plan_batch(model, tiny_gpt_batch(), limit, TARGET)
    chosen = plan.chosen
    assert chosen is not None and chosen.checked
    assert chosen.total_bytes <= limit < plan.full_batch[0].total_bytes
    assert chosen.micro_batch * chosen.steps == TARGET and chosen.steps > 1
    assert plan.options.get("accumulate_grads") is True
    # the same model compiled for real at the chosen size holds what the plan says
    torch._dynamo.reset()
    options = {"memory_budget": chosen.memory_budget}
    with collecting() as report:
        torch.compile(model, backend="seqfast", options=options, dynamic=False)(
            *tiny_gpt_batch(chosen.micro_batch)
        )
    (step,) = [p.step for p in report.memory]
    batch_bytes = sum(t.numel() * t.element_size() for t in tiny_gpt_batch(chosen.micro_batch))
    assert step.peak_bytes + batch_bytes == chosen.activation_bytes
    printed = capsys.readouterr().out
    assert f"micro-batch {chosen.micro_batch} x {chosen.steps} step(s)" in printed
    assert "chosen:" in printed and "does not fit" in printed


def test_when_nothing_fits_the_plan_says_so(model, roomy, capsys):
    plan = seqcompile.plan_batch(
        model, tiny_gpt_batch(), roomy.parameter_bytes, TARGET, budgets=(1.0,)
    )
    assert plan.chosen is None and plan.options == {} and plan.best_per_budget == ()
    assert "nothing fits" in capsys.readouterr().out


def test_sizes_between_measured_ones_lie_on_the_line_through_the_nearest():
    curve = Curve({2: (200, 2.0), 4: (400, 3.0), 64: (1000, 63.0)})
    assert curve(4) == (400, 3.0)
    assert curve(34) == (700, 33.0)
    assert curve(1) == (100, 1.5)
    assert curve(124) == (1600, 123.0)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(memory_limit="lots"), "memory_limit must be"),
        (dict(memory_limit=0), "memory_limit must be"),
        (dict(target_batch=0), "target_batch must be"),
        (dict(options={"memory_budget": 0.5}), "chooses memory_budget itself"),
        (dict(budgets=(1.0, 1.5)), "budgets must be fractions"),
        (dict(example_batch=("text",)), "no tensor with a batch dimension"),
        (dict(options={"budget": 0.5}), "unknown seqfast option"),
    ],
)
def test_bad_arguments_are_refused(model, arguments, message):
    call = dict(example_batch=tiny_gpt_batch(), memory_limit="1GiB", target_batch=TARGET)
    call.update(arguments)
    with pytest.raises(ValueError, match=message):
        seqcompile.plan_batch(model, quiet=True, **call)


def test_a_compute_dtype_narrows_the_activations_and_keeps_the_master_weights(model, roomy):
    half = seqcompile.plan_batch(
        model, tiny_gpt_batch(), "1GiB", TARGET, budgets=(1.0,), compute_dtype=torch.bfloat16
    )
    narrow, wide = half.full_batch[0], roomy.full_batch[0]
    # activations halve; the gradients in flight stay float32, as the parameters are
    assert 0.5 * wide.activation_bytes < narrow.activation_bytes < 0.75 * wide.activation_bytes
    assert (half.parameter_bytes, half.gradient_bytes) == (
        roomy.parameter_bytes,
        roomy.gradient_bytes,
    )
