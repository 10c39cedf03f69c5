"""Every fused operator on every sample its registry entry declares (`FusedOp.samples`), on both
paths (the reference on CPU, the generated kernels under Triton's interpreter), through its vendor
kernels on CPU where it has them and the sample's calls allow them, and, in the GPU tier,
compiled on CUDA, forward and every gradient, against the sample's eager composition in
float64, with every kernel output poisoned (NaN) before it is written and NaN expected exactly
where eager gives NaN. Every `seqfast` op the sample calls (forward, backward, in-place twin) must
give each output the shape, dtype and strides its fake implementation promises, which compiled
graphs are planned and compiled by.

The sweep crosses each sample with each layout (`ops/samples.py`: transposed, strided, expanded,
at an offset, a window of a larger tensor) of each tensor argument. The default tier runs every
sample contiguous, and each layout on every tensor argument at once on each operator's first
sample (on the kernel path, each operator's other samples half per run, in turn); the slow tier
runs every sample with each tensor argument alone in each layout; the GPU
tier (`-m gpu`) runs every sample contiguous on CUDA, so each entry's kernels are tested compiled
without a test of their own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from checks import SeqfastCalls, forward_kernels
from conftest import TOLERANCES
from torch.utils._python_dispatch import TorchDispatchMode

from seqcompile.codegen import counting_launches
from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call, FusedOp
from seqcompile.ops.samples import LAYOUTS, Sample, applies, in_layout, replace_slots, tensor_slots

PATHS = ("reference", "kernels", "vendor", "cuda")
"""Where the op runs: the reference on CPU, the kernels under the interpreter, the vendor's
kernels on CPU (`FusedOp.vendor`), the kernels on CUDA."""


class VendorCalls(TorchDispatchMode):
    """Runs each call of `entry`'s ops that its vendor accepts through the vendor's body instead,
    and counts them by op; the other calls run as called."""

    supports_higher_order_operators = True

    def __init__(self, entry: FusedOp) -> None:
        super().__init__()
        self.entry, self.ran = entry, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        call = Call(func, args, kwargs or {}) if func in self.entry.vendor.bodies else None
        if call is None or self.entry.vendor_refusal(call) is not None:
            return func(*args, **(kwargs or {}))
        self.ran[func] = self.ran.get(func, 0) + 1
        return self.entry.vendor.bodies[func](**{name: call[name] for name in call})


def _path_applies(entry: FusedOp, sample: Sample, path: str) -> bool:
    """The vendor path runs the samples whose forward call the vendor accepts, with finite values
    (on others a vendor gives its own answer: ATen's CPU flash kernel a zero row for a query row
    of NaN, where eager softmax gives NaN)."""
    if path != "vendor":
        return True
    forward = Call(entry.forward, (), sample.args)
    finite = all(t.isfinite().all() for _, t in tensor_slots(sample.args) if t.is_floating_point())
    return entry.vendor is not None and entry.vendor_refusal(forward) is None and finite


def _params(
    entry: FusedOp, sample: Sample, layouts: dict[str, str], label: str, slow: bool, first: bool
):
    """The case on each path: the kernel path joins the kernel tier, naming its kernels (in the
    default run, beyond each operator's first sample, half of them per run, in turn); the CUDA
    path, for contiguous samples, the GPU tier."""
    for path in PATHS:
        if (path == "cuda" and layouts) or not _path_applies(entry, sample, path):
            continue
        case_id = f"{entry.name}-{sample.name}-{label}-{path}"
        marks = []
        if slow:  # each layout of each argument alone: half of them per run, in turn
            marks += [pytest.mark.slow, pytest.mark.rotating(2)]
        if path == "cuda":
            marks.append(pytest.mark.gpu)
        if path == "kernels":
            kernels = forward_kernels(entry, sample)
            marks += [pytest.mark.interpreter, pytest.mark.kernels(*kernels)]
            if not (slow or first):  # (the default run has a time budget)
                marks.append(pytest.mark.rotating(2))
        yield pytest.param(entry, sample, layouts, path, id=case_id, marks=marks)


def _cases() -> Iterator:
    for entry in registry.ENTRIES:
        samples = list(entry.samples())
        for sample in samples:
            yield from _params(
                entry, sample, {}, "contiguous", slow=False, first=sample is samples[0]
            )
        first = samples[0]
        for layout in LAYOUTS[1:]:
            every = {slot: layout for slot, t in tensor_slots(first.args) if applies(t, layout)}
            yield from _params(entry, first, every, f"all-{layout}", slow=False, first=True)
        for sample in samples:
            for slot, t in tensor_slots(sample.args):
                for layout in (layout for layout in LAYOUTS[1:] if applies(t, layout)):
                    label = f"{slot}-{layout}"
                    yield from _params(entry, sample, {slot: layout}, label, slow=True, first=False)


def gpu_cases() -> list[FusedOp]:
    """The entries the GPU tier runs on CUDA, one per case."""
    return [param.values[0] for param in _cases() if param.values[3] == "cuda"]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("entry, sample, layouts, path", list(_cases()))
def test_sample(request, monkeypatch, entry, sample, layouts, path):
    monkeypatch.setenv("SEQFAST_POISON", "1")
    if path == "kernels":
        request.getfixturevalue("interpret")
    device = "cuda" if path == "cuda" else "cpu"

    def laid_out(slot: str, t: torch.Tensor) -> torch.Tensor:
        layout = layouts.get(slot, "contiguous")
        return in_layout(t.to(device), layout, requires_grad=slot in sample.grads)

    args = replace_slots(sample.args, laid_out)
    tensors = dict(tensor_slots(args))
    wide = {slot: _wide(t, slot in sample.grads) for slot, t in tensors.items()}
    expected = list(sample.eager(**replace_slots(args, lambda slot, _: wide[slot])))
    calls = SeqfastCalls()
    vendor = VendorCalls(entry) if path == "vendor" else contextlib.nullcontext()
    with counting_launches() as launches, vendor, calls:  # (calls records the vendor's results)
        result = entry.forward(**args)
    calls.assert_fakes_agree()
    if path == "vendor":
        assert vendor.ran.get(entry.forward), "the vendor's forward never ran"
    if path in ("kernels", "cuda"):  # (first: an output the reference gives fails for this reason)
        missing = [name for name in forward_kernels(entry, sample) if not launches.of(name)]
        assert not missing, f"kernels {missing} were never launched"
    outputs = [result[i] for i in sample.outputs] if isinstance(result, tuple | list) else [result]
    for i, actual, want in zip(sample.outputs, outputs, expected, strict=True):
        _compare(actual, want, f"output {i}")

    differentiable = [(a, e) for a, e in zip(outputs, expected, strict=True) if a.requires_grad]
    if not sample.grads or not differentiable:
        return
    g = torch.Generator().manual_seed(7)
    cotangents = [torch.randn(a.shape, generator=g).to(device) for a, _ in differentiable]
    with vendor, calls:
        actual_grads = torch.autograd.grad(
            [a for a, _ in differentiable], [tensors[s] for s in sample.grads], cotangents,
            allow_unused=True,
        )  # fmt: skip
    calls.assert_fakes_agree()
    if path == "vendor":
        assert set(vendor.ran) == set(entry.vendor.bodies), "the vendor's backward never ran"
    expected_grads = torch.autograd.grad(
        [e for _, e in differentiable], [wide[s] for s in sample.grads],
        [c.double() for c in cotangents], allow_unused=True,
    )  # fmt: skip
    for slot, actual, want in zip(sample.grads, actual_grads, expected_grads, strict=True):
        if want is None:
            assert actual is None or not actual.any(), f"d{slot}: eager gives none"
            continue
        assert actual is not None, f"d{slot}: none, where eager gives {tuple(want.shape)}"
        assert actual.dtype == tensors[slot].dtype, f"d{slot}: dtype {actual.dtype}"
        _compare(actual, want, f"d{slot}")


def _compare(actual: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """float32 tolerances against float64, NaN exactly where eager has NaN."""
    assert actual.shape == want.shape, f"{name}: shape {tuple(actual.shape)}, eager {want.shape}"
    torch.testing.assert_close(
        actual.double(), want.double(), **TOLERANCES[torch.float32], equal_nan=True,
        msg=lambda m: f"{name}: {m}",
    )  # fmt: skip


def _wide(t: torch.Tensor, grad: bool) -> torch.Tensor:
    """The oracle's copy: floats in float64, a leaf requiring grad where the op's does."""
    if not t.is_floating_point():
        return t
    return t.detach().double().requires_grad_(grad)
