"""Gradient accumulation into `.grad`: gradients after N micro-batches equal eager's
accumulation, a micro-batch after the first allocates no weight-shaped tensor, and a backward
whose gradients something else must see (hooks, autograd.grad, backward(inputs=), saved-tensor
hooks, an unknown torch.distributed wrapper) hands them to autograd and gets eager's answer.
DDP and FSDP2 on two processes: tests/distributed/test_accumulate_distributed.py."""

import pytest
import torch
from checks import AccumulatingCalls
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from seqcompile.demo import GPT, GPTConfig, toy_batch
from seqcompile.report import collecting

CONFIG = GPTConfig(vocab=64, max_len=32, d_model=32, n_heads=2, n_layers=2, dropout=0.0)


def micro_batches(n):
    return [
        toy_batch(CONFIG, 3, 5, torch.device("cpu"), torch.Generator().manual_seed(i))
        for i in range(n)
    ]


def accumulate(model, step, batches):
    model.zero_grad(set_to_none=True)
    for idx, targets in batches:
        (step(idx, targets) / len(batches)).backward()
    return [p.grad.clone() for p in model.parameters()]


def compiled(model, rest="eager"):
    torch._dynamo.reset()
    options = {"accumulate_grads": True, "rest": rest}
    return torch.compile(model, backend="seqfast", options=options)


@pytest.mark.slow
@pytest.mark.parametrize("rest", ["eager", "inductor"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_accumulated_gradients_equal_eagers(rest, n):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batches = micro_batches(n)
    expected = accumulate(model, model, batches)
    got = accumulate(model, compiled(model, rest), batches)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_existing_grads_are_added_to_as_autograd_would():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    ((idx, targets),) = micro_batches(1)
    model.zero_grad(set_to_none=True)
    model(idx, targets).backward()
    expected = [2 * p.grad for p in model.parameters()]
    compiled(model)(idx, targets).backward()  # onto eager's .grad
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-6)


class WeightShapedAllocations(TorchDispatchMode):
    """Counts op results shaped like a weight matrix that are new storage (not a parameter, not
    a `.grad` written in place)."""

    supports_higher_order_operators = True  # (traced kernel launches pass through)

    def __init__(self, model):
        super().__init__()
        self.shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
        self.known = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.known |= {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and tuple(t.shape) in self.shapes
                and t.untyped_storage().data_ptr() not in self.known
            ):
                self.count += 1
        return out


@pytest.mark.parametrize("accumulate_grads", [True, False])
def test_a_later_micro_batch_allocates_no_weight_shaped_gradient(accumulate_grads):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    torch._dynamo.reset()
    options = {"accumulate_grads": accumulate_grads, "rest": "eager"}
    step = torch.compile(model, backend="seqfast", options=options)
    first, second = micro_batches(2)
    step(*first).backward()
    loss = step(*second)
    with WeightShapedAllocations(model) as allocations:
        loss.backward()
    if accumulate_grads:
        assert allocations.count == 0
    else:  # the test can see them
        assert allocations.count >= 2 * CONFIG.n_layers * 4


def eager_gradients(model, batches, backward=lambda loss, model: loss.backward()):
    """The gradients eager autograd leaves in .grad after `batches`, each run by `backward`."""
    model.zero_grad(set_to_none=True)
    for idx, targets in batches:
        backward(model(idx, targets) / len(batches), model)
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def accumulating_ops(backward, *args):
    """How many accumulating ops the backward `backward(*args)` runs (called outside the forward:
    Dynamo compiles nothing under a dispatch mode)."""
    with AccumulatingCalls() as calls:
        backward(*args)
    return calls.count


def eager_then_compiled(backward=lambda loss, model: loss.backward(), rest="eager"):
    """A model with eager's gradients after two micro-batches, its `.grad`s cleared, and the
    model compiled with `accumulate_grads`."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batches = micro_batches(2)
    expected = eager_gradients(model, batches, backward)
    model.zero_grad(set_to_none=True)
    return model, batches, expected, compiled(model, rest)


def assert_gradients(model, expected):
    for p, e in zip(model.parameters(), expected, strict=True):
        if e is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-6)


def test_one_graph_serving_several_blocks_accumulates_into_each_blocks_grads():
    """Each block compiled on its own: Dynamo gives both the one graph, and each backward call
    must find the `.grad`s of the parameters its own forward call ran with."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batches = micro_batches(2)
    expected = eager_gradients(model, batches)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="seqfast", options={"accumulate_grads": True})
    with collecting() as reports:
        for idx, targets in batches:
            assert accumulating_ops((model(idx, targets) / 2).backward) > 0
    assert len(reports.graphs) == 1
    assert_gradients(model, expected)


@pytest.mark.parametrize("when", ["before compile", "after the first backward"])
def test_a_gradient_hook_sees_every_gradient(when):
    """A hooked parameter's gradient must pass through autograd: that backward returns the
    gradients, and the hook sees what eager's sees."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batches = micro_batches(2)
    seen = []
    weight = model.blocks[0].mlp.fc.weight

    def hook(grad):
        seen.append(grad.clone())
        return grad * 2

    handle = weight.register_hook(hook)
    expected = eager_gradients(model, batches)
    eager_seen, seen[:] = list(seen), []
    handle.remove()
    model.zero_grad(set_to_none=True)
    step = compiled(model)
    for i, (idx, targets) in enumerate(batches):
        if i == (0 if when == "before compile" else 1):
            weight.register_hook(hook)
        calls = accumulating_ops((step(idx, targets) / 2).backward)
        assert (calls == 0) == bool(weight._backward_hooks)
    expected_seen = eager_seen if when == "before compile" else eager_seen[1:]
    for got, want in zip(seen, expected_seen, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if when == "before compile":
        assert_gradients(model, expected)


def test_a_post_accumulate_grad_hook_runs_on_the_finished_grad():
    model, batches, expected, step = eager_then_compiled()
    (step(*batches[0]) / 2).backward()
    finished = []
    model.ln_f.weight.register_post_accumulate_grad_hook(lambda p: finished.append(p.grad.clone()))
    assert accumulating_ops((step(*batches[1]) / 2).backward) == 0
    assert_gradients(model, expected)
    (ln_f_position,) = [i for i, p in enumerate(model.parameters()) if p is model.ln_f.weight]
    torch.testing.assert_close(finished[0], expected[ln_f_position], rtol=1e-5, atol=1e-6)


def _autograd_grad(loss, model):
    return torch.autograd.grad(loss, list(model.parameters()))


def _backward_some(loss, model):
    loss.backward(inputs=[model.ln_f.weight, model.head.weight])


@pytest.mark.parametrize(
    "backward, rest",
    [
        (_autograd_grad, "eager"),
        (_backward_some, "eager"),
        pytest.param(_autograd_grad, "inductor", marks=pytest.mark.slow),  # an Inductor compile
    ],
    ids=["autograd.grad", "backward(inputs=)", "autograd.grad-inductor"],
)
def test_a_backward_writing_not_every_grad_gets_eagers_answer(backward, rest):
    """Autograd hands the caller gradients (or writes only some .grad): that backward returns
    the gradients, leaving the other `.grad`s as they were."""
    answers = []

    def answering(loss, model):
        answers.append(backward(loss, model) or ())

    model, batches, expected, step = eager_then_compiled(answering, rest)
    expected_answers, answers[:] = list(answers), []
    for idx, targets in batches:
        assert accumulating_ops(answering, step(idx, targets) / 2, model) == 0
    assert_gradients(model, expected)
    for got, want in zip(answers, expected_answers, strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_saved_tensors_moved_by_hooks_accumulate_into_the_parameters_grads():
    """Under `save_on_cpu` the saved parameters come back as copies, whose `.grad` is not the
    parameter's: the backward finds the parameters through their gradient accumulators."""
    model, batches, expected, step = eager_then_compiled()
    for idx, targets in batches:
        with torch.autograd.graph.save_on_cpu():
            loss = step(idx, targets) / 2
        assert accumulating_ops(loss.backward) > 0
    assert_gradients(model, expected)


def test_backward_naming_every_parameter_accumulates():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    batches = micro_batches(2)
    expected = accumulate(model, model, batches)
    model.zero_grad(set_to_none=True)
    step = compiled(model)
    for idx, targets in batches:
        (step(idx, targets) / 2).backward(inputs=list(model.parameters()))
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-6)


def test_under_torch_distributed_without_a_known_wrapper_gradients_go_to_autograd(tmp_path, caplog):
    """Something seqfast does not know may take the gradients from autograd: it gets them."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = GPT(CONFIG)
        batches = micro_batches(2)
        expected = eager_gradients(model, batches)
        step = compiled(model)
        model.zero_grad(set_to_none=True)
        with caplog.at_level("INFO", logger="seqcompile"):
            for idx, targets in batches:
                assert accumulating_ops((step(idx, targets) / 2).backward) == 0
        got = [p.grad for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert "gradients go to autograd for this backward: torch.distributed is initialized" in (
        caplog.text
    )


class Inverse(torch.nn.Module):
    """`linalg.inv` checks its input through an effectful op: AOTAutograd threads an effect token
    into the forward's inputs ahead of the parameters."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(3, 3))
        self.b = torch.nn.Parameter(torch.eye(3) * 2 + 0.1 * torch.randn(3, 3))

    def forward(self, x):
        return ((x @ self.a) @ torch.linalg.inv(self.b)).sum()


def test_an_effect_token_does_not_shift_which_grad_each_gradient_goes_into():
    torch.manual_seed(0)
    model, x = Inverse(), torch.randn(3, 3)
    grads = []
    for step in (model, compiled(model)):
        model.zero_grad(set_to_none=True)
        step(x).backward()
        step(2 * x).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g, e in zip(*grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
