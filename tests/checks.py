"""The one helper every fusion test uses: compile with seqfast and check together that the fusion
fired, that the output and every gradient match eager, and which sites were refused and why."""

from __future__ import annotations

import ast
import copy
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from conftest import assert_close
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from seqcompile.backend import seqfast
from seqcompile.checks.verify import copy_as_given
from seqcompile.demo import GPTConfig, toy_batch
from seqcompile.memory.saved import saved_bytes
from seqcompile.ops.fused_op import Call, FusedOp
from seqcompile.ops.samples import Sample
from seqcompile.report import CompileReport, collecting


def _clone(inputs: Sequence[Any]) -> list[Any]:
    """Copies laid out as given (strides, storage offsets), so each run sees the inputs' layout."""
    return [copy_as_given(t) if isinstance(t, torch.Tensor) else t for t in inputs]


def _outputs(result: Any) -> list[torch.Tensor]:
    flat = result if isinstance(result, tuple | list) else [result]
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _backward(outputs: list[torch.Tensor], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    differentiable = [t for t in outputs if t.requires_grad]
    cotangents = [
        torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.device, t.dtype)
        for t in differentiable
    ]
    torch.autograd.backward(differentiable, cotangents)


def check_fusion(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    counts: dict[str, int],
    missed: Sequence[str] = (),
    options: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    grad: bool = True,
) -> CompileReport:
    """Compile `fn` (a function or module) with seqfast, run it on `inputs`, and assert:
    - the report counts equal `counts` for every family named there;
    - each string in `missed` appears in one refusal reason, and there are no other refusals;
    - outputs, input gradients and parameter gradients match eager at `dtype`'s tolerance.
    """
    eager_fn = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    eager_inputs, fast_inputs = _clone(inputs), _clone(inputs)
    expected = _outputs(eager_fn(*eager_inputs))
    backend = functools.partial(seqfast, options=options)
    with collecting() as report:
        actual = _outputs(torch.compile(fn, backend=backend)(*fast_inputs))
    for name, n in counts.items():
        assert report.counts[name] == n, (
            f"{name}: fused {report.counts[name]}, expected {n}\n{report}"
        )
    reasons = [m.reason for m in report.missed]
    for needle in missed:
        assert any(needle in r for r in reasons), f"no refusal mentions {needle!r}: {reasons}"
    assert len(reasons) == len(missed), f"unexpected refusals: {reasons}"
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e, dtype)
    if grad and any(t.requires_grad for t in expected):
        _backward(expected, seed=1)
        _backward(actual, seed=1)
        for a, e in zip(_grads(fn, fast_inputs), _grads(eager_fn, eager_inputs), strict=True):
            assert (a is None) == (e is None), "a gradient exists in one run only"
            if e is not None:
                assert_close(a, e, dtype)
    return report


def _grads(fn: Any, inputs: Sequence[Any]) -> list[torch.Tensor | None]:
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(fn, torch.nn.Module):
        tensors += [p for p in fn.parameters() if p.requires_grad]
    return [t.grad for t in tensors]


def kept_for_backward(model, *batch):
    """Bytes of the distinct storages autograd saves during one training step (`model(*batch)`
    returns the loss), leaving out the parameters, buffers and the batch itself (they live on
    regardless)."""
    return saved_bytes(lambda: model(*batch), [*model.parameters(), *model.buffers(), *batch])


TINY_GPT = GPTConfig(vocab=64, max_len=32, d_model=32, n_heads=2, n_layers=2, dropout=0.1)
"""The demo GPT small enough for a compile in a second: the memory tests' model."""


def tiny_gpt_batch(size: int = 2, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets for `TINY_GPT`, each in a storage of its own (as a data loader gives
    them, and as a compile on the meta device sees them)."""
    batch = toy_batch(TINY_GPT, size, length, torch.device("cpu"), torch.Generator())
    return tuple(t.contiguous() for t in batch)


def dumped_fuse_stage(dump_dir: Path | str) -> str:
    """The graph after the fuse stage, as the first compile in `dump_dir` dumped it."""
    return next(Path(dump_dir).glob("*/*_fuse.py")).read_text()


def dumped_add_norms(dump_dir: Path | str) -> list[tuple[bool, float]]:
    """Per `add_norm` call in the fuse stage's dumped graph (calls print their arguments by
    name): whether it adds a residual, and its dropout p."""
    calls = [
        {kw.arg: kw.value for kw in node.keywords}
        for node in ast.walk(ast.parse(dumped_fuse_stage(dump_dir)))
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) == "torch.ops.seqfast.add_norm.default"
    ]
    return [("residual" in c, ast.literal_eval(c["p"])) for c in calls]


class AccumulatingCalls(TorchDispatchMode):
    """Counts the `seqfast::accumulate*` ops that run: the accumulating backward launches them,
    the backward that hands gradients to autograd none."""

    supports_higher_order_operators = True  # (traced kernel launches pass through)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "seqfast" and func.__name__.startswith("accumulate"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def kernel_flags(**on: bool) -> dict[str, bool]:
    """The attention forward kernel's flags (its key as `attention_flags` gives it), those named
    set."""
    flags = (
        "sink",
        "bias",
        "mask",
        "blocks",
        "dropout",
        "causal",
        "window",
        "score_mod",
        "documents",
        "relative",
        "prefix",
    )
    return {flag: on.get(flag, False) for flag in flags}


def attention_flags(spec: Any) -> dict[str, bool]:
    """An attention kernel's key with its generated score modification as whether it has one."""
    key = dict(spec.key)
    key["score_mod"] = bool(key["score_mod"])
    return key


class SeqfastCalls(TorchDispatchMode):
    """Records each call of a `seqfast` op (forward, backward, in-place twin) below autograd, to
    check that its fake implementation, which compiled graphs are planned by, gives each output
    the shape, dtype and strides the call gave it."""

    supports_higher_order_operators = True  # (traced kernel launches pass through)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func.namespace == "seqfast":
            self.calls.append((func, args, kwargs, result))
        return result

    def assert_fakes_agree(self) -> None:
        for func, args, kwargs, result in self.calls:
            with FakeTensorMode() as mode:
                fake_args, fake_kwargs = tree_map_only(
                    torch.Tensor, mode.from_tensor, (args, kwargs)
                )
                fake = func(*fake_args, **fake_kwargs)
            outputs = zip(tree_leaves(result), tree_leaves(fake), strict=True)
            for i, (real, faked) in enumerate(outputs):
                where = f"{func} output {i}"
                assert (real.shape, real.dtype) == (faked.shape, faked.dtype), where
                assert _strides(real) == _strides(faked), (
                    f"{where}: strides {real.stride()}, fake {faked.stride()}"
                )
        self.calls.clear()


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides that matter: those of dimensions of size > 1 (none when `t` is empty)."""
    if t.numel() == 0:
        return ()
    return tuple(stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1)


def forward_kernels(entry: FusedOp, sample: Sample) -> tuple[str, ...]:
    """The kernels the kernel path must launch for `sample`'s forward call: those the entry names
    for it, none where a tensor argument is empty (the op answers without a launch)."""
    if sample.is_empty():
        return ()
    specs = entry.kernels[entry.forward](Call(entry.forward, (), sample.args))
    return tuple(spec.name for spec in specs)
