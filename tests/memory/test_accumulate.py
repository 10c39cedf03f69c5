"""Gradient accumulation into `.grad`: gradients after N micro-batches equal eager's
accumulation, a micro-batch after the first allocates no weight-shaped tensor, and what would
miss the gradients (hooks, torch.distributed) is refused with a clear error."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from seqcompile.demo import GPT, GPTConfig, toy_batch

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


def test_a_gradient_hook_is_refused_at_compile():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.blocks[0].mlp.fc.weight.register_hook(lambda g: g)
    ((idx, targets),) = micro_batches(1)
    with pytest.raises(Exception, match="cannot honour a gradient hook on a parameter"):
        compiled(model)(idx, targets)


def test_a_hook_added_after_compile_is_refused_at_backward():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    ((idx, targets),) = micro_batches(1)
    step = compiled(model)
    step(idx, targets).backward()
    model.ln_f.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(RuntimeError, match="the hook would never run"):
        step(idx, targets).backward()


@pytest.mark.parametrize(
    "backward",
    [
        lambda loss, model: torch.autograd.grad(loss, list(model.parameters())),
        lambda loss, model: loss.backward(inputs=[model.ln_f.weight]),
    ],
    ids=["autograd.grad", "backward(inputs=)"],
)
def test_a_backward_that_writes_not_every_grad_is_refused_and_leaves_grads_alone(backward):
    """Autograd would hand the caller gradients (or write only some .grad): the accumulating
    backward, which adds every gradient into .grad, refuses instead of answering wrong."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    ((idx, targets),) = micro_batches(1)
    step = compiled(model)
    step(idx, targets).backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="asks for gradients without writing .grad"):
        backward(step(idx, targets), model)
    for p, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0)


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


def test_torch_distributed_is_refused(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = GPT(CONFIG)
        ((idx, targets),) = micro_batches(1)
        with pytest.raises(Exception, match="cannot run under torch.distributed"):
            compiled(model)(idx, targets)
    finally:
        dist.destroy_process_group()
