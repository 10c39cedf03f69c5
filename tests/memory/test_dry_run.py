"""Compiling on the meta device: the memory plan is the one a real compile gets, batches resize
along their first dimension, and Dynamo's caches are left as they were."""

import pytest
import torch
from checks import TINY_GPT, tiny_gpt_batch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

from seqcompile.demo import GPT
from seqcompile.memory import dry_run
from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # each test compiles a model for real and on meta tensors

CONFIG = TINY_GPT


def real_plans(model, batch, **options):
    torch._dynamo.reset()
    with collecting() as report:
        torch.compile(model, backend="seqfast", options=options, dynamic=False)(*batch)
    return report


@pytest.mark.parametrize("budget", [1.0, 0.25])
def test_the_meta_plan_is_the_real_compiles_plan(budget):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batch = tiny_gpt_batch(3)
    real = real_plans(model, batch, memory_budget=budget)
    with collecting() as meta_report:
        meta = dry_run.memory_plans(
            dry_run.meta_copy(model), dry_run.at_batch_size(batch, 3), {"memory_budget": budget}
        )
    assert meta_report.counts == real.counts and real.counts["attention"] == 2
    assert [p.step for p in meta] == [p.step for p in real.memory]
    assert [p.step_seconds for p in meta] == [p.step_seconds for p in real.memory]


def test_the_meta_copy_holds_no_data_and_keeps_ties():
    model = GPT(CONFIG)
    copy = dry_run.meta_copy(model)
    assert all(p.device.type == "meta" for p in copy.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert copy.head.weight is copy.tok.weight  # the demo GPT ties its embedding and head
    assert [p.requires_grad for p in copy.parameters()] == [
        p.requires_grad for p in model.parameters()
    ]


def test_batches_resize_along_the_first_dimension_only():
    ids = torch.zeros(2, 5, dtype=torch.long)
    batch = {"ids": ids, "bias": torch.zeros(7), "mask": torch.ones(2, 5), "n": 3}
    resized = dry_run.at_batch_size(batch, 8)
    assert resized["ids"].shape == (8, 5) and resized["ids"].dtype == torch.long
    assert resized["mask"].shape == (8, 5) and resized["bias"].shape == (7,)
    assert resized["ids"].device.type == "meta" and resized["n"] == 3
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        dry_run.batch_size((3, "text"))


def test_a_dry_run_leaves_dynamos_cache_as_it_was():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batch = tiny_gpt_batch()
    real_plans(model, batch)
    code = type(model).forward.__code__
    before = len(_debug_get_cache_entry_list(code))
    meta_model = dry_run.meta_copy(model)
    for size in range(1, 11):  # more sizes than Dynamo's recompile limit of 8
        (plan,) = dry_run.memory_plans(meta_model, dry_run.at_batch_size(batch, size), {})
        assert plan.step.kept_bytes > 0
    assert len(_debug_get_cache_entry_list(code)) == before == 1


class BrokenGPT(torch.nn.Module):
    """The GPT behind a graph break, which makes Dynamo compile frames of its own."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(CONFIG)

    def forward(self, idx, targets):
        return _broken_step(self.gpt, idx, targets)


def _broken_step(gpt, idx, targets):
    embedded = gpt.tok(idx)
    torch._dynamo.graph_break()
    return gpt(idx, targets) + 0 * embedded.sum()


def test_frames_a_graph_break_compiles_get_no_entries_beyond_the_limit():
    torch.manual_seed(0)
    model = BrokenGPT()
    batch = tiny_gpt_batch()
    torch.compile(model, backend="seqfast")(*batch)
    codes = [BrokenGPT.forward.__code__, _broken_step.__code__]
    assert [len(_debug_get_cache_entry_list(c)) for c in codes] == [1, 1]
    meta_model = dry_run.meta_copy(model)
    for size in range(1, 11):  # past the limit, each size still compiles both graphs
        plans = dry_run.memory_plans(meta_model, dry_run.at_batch_size(batch, size), {})
        assert len(plans) == 2
    # the frames the dry runs compiled are reset, the user's entries with them
    assert [len(_debug_get_cache_entry_list(c)) for c in codes] == [0, 0]


def test_a_model_without_trainable_parameters_is_refused():
    model = GPT(CONFIG).requires_grad_(False)
    batch = tiny_gpt_batch()
    with pytest.raises(ValueError, match="no training graph"):
        dry_run.memory_plans(dry_run.meta_copy(model), dry_run.at_batch_size(batch, 2), {})


def test_a_compute_dtype_casts_floating_weights_and_inputs_only():
    copy = dry_run.meta_copy(GPT(CONFIG), torch.bfloat16)
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in copy.buffers()} == {torch.bool}  # the causal masks
    batch = dry_run.at_batch_size(
        (torch.zeros(2, 3, dtype=torch.long), torch.ones(2)), 4, torch.bfloat16
    )
    assert [t.dtype for t in batch] == [torch.long, torch.bfloat16]
