"""Fused ops never read a tensor's value on the host: on CUDA that would stall the host on the
GPU at every call and break CUDA-graph capture under `mode="reduce-overhead"`. Each fused op's
implementation runs a training step of the demo GPT (dropout on, so seeds travel) on the kernel
path under a dispatch mode that records every ATen op whose result depends on a tensor's data
(`torch.Tag.data_dependent_output`: `.item()`, `nonzero`, `equal`, ...)."""

import contextlib
import functools

import pytest
import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from seqcompile.demo import GPT, GPTConfig, toy_batch
from seqcompile.run import runtime

CONFIG = GPTConfig(vocab=32, max_len=8, d_model=16, n_heads=2, n_layers=1, dropout=0.1)


class HostReads(TorchDispatchMode):
    """The data-dependent ATen ops called beneath it, by the fused op that called them."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.data_dependent_output in func.tags:
            self.reads.append(f"{self.op} calls {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording_host_reads():
    """Within it, each `seqfast::` op's implementation runs under `HostReads`; yields the list
    of what they read."""
    reads: list[str] = []
    opdefs = [d for name, d in OPDEFS.items() if name.startswith("seqfast::")]
    saved = {d: dict(d._backend_fns) for d in opdefs}

    def watched(name, fn, *args, **kwargs):
        mode = HostReads(name)
        with mode:
            result = fn(*args, **kwargs)
        reads.extend(mode.reads)
        return result

    for d in opdefs:
        for device, fn in saved[d].items():
            d._backend_fns[device] = functools.partial(watched, d._name, fn)
    try:
        yield reads
    finally:
        for d, fns in saved.items():
            d._backend_fns.update(fns)


def _step():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    compiled = torch.compile(model, backend="seqfast")
    batch = toy_batch(CONFIG, 2, 8, torch.device("cpu"), torch.Generator().manual_seed(0))
    with recording_host_reads() as reads:
        compiled(*batch).backward()
    torch._dynamo.reset()
    return reads


@pytest.mark.kernels(
    "attention_fwd", "attention_bwd_dkdv:with_dq", "add_norm_fwd", "add_norm_bwd", "pointwise"
)
def test_no_fused_op_reads_a_tensor_on_the_host(interpret):
    assert _step() == []


@pytest.mark.slow  # the check of the check: a second step under the interpreter
@pytest.mark.kernels("attention_fwd", "add_norm_fwd", "pointwise")
def test_a_host_read_in_a_launcher_is_caught(interpret, monkeypatch):
    allocate = runtime.empty

    def reading(shape, dtype, device):
        torch.ones(1).item()  # what a launcher must not do
        return allocate(shape, dtype, device)

    monkeypatch.setattr(runtime, "empty", reading)
    reads = _step()
    assert reads and all(read.endswith("calls aten.item.default") for read in reads)
