"""The fused loss against eager PyTorch (the logits materialized), Inductor and, where installed,
Liger-Kernel: cross-entropy over given logits (against class indices and against probabilities),
and linear + cross-entropy and linear + cross-entropy with a z-loss from hidden states, one
forward + backward step in bf16, in time and peak memory.

    python -m benchmarks.loss [--quick | --short] [--no-inductor] [--output FILE]

Each executor's loss and gradients are checked against eager first; one that disagrees or raises
is marked FAILED, not timed, and the run exits non-zero. Peak memory is
`torch.cuda.max_memory_allocated` during the step minus what was allocated before it (the inputs
and parameters); a case that runs out of memory says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import brief, emit_checked, header, progress, standard_setup, table, timed_ms

WIDTH = 4096
"""Hidden width of linear + cross-entropy."""


def cross_entropy(logits, target):
    return F.cross_entropy(logits.float(), target, ignore_index=-100)


def soft_cross_entropy(logits, probabilities):
    return F.cross_entropy(logits.float(), probabilities)


def linear_cross_entropy(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=-100)


def linear_z_loss(hidden, weight, target):
    """Cross-entropy plus a z-loss on the log-partition: a row-wise loss the linear joins in
    chunks (`seqfast::linear_row_loss`)."""
    logits = F.linear(hidden, weight).float()
    z_loss = 1e-4 * torch.logsumexp(logits, -1).square().mean()
    return F.cross_entropy(logits, target, ignore_index=-100) + z_loss


CASES = {
    "cross-entropy": cross_entropy,
    "soft cross-entropy": soft_cross_entropy,
    "linear+cross-entropy": linear_cross_entropy,
    "linear+z-loss": linear_z_loss,
}
_LINEAR = ("linear+cross-entropy", "linear+z-loss")


def liger_executor(case):
    """Liger-Kernel's fused linear cross-entropy (or its cross-entropy), when installed."""
    try:
        from liger_kernel.transformers.functional import (
            liger_cross_entropy,
            liger_fused_linear_cross_entropy,
        )
    except ImportError:
        return None
    if case == "linear+cross-entropy":
        return lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t, ignore_index=-100)
    if case == "cross-entropy":
        return lambda logits, t: liger_cross_entropy(logits, t, ignore_index=-100)
    return None


def make_inputs(case, tokens, vocab, width, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    target = torch.randint(vocab, (tokens,), device=device, generator=g)
    target[::7] = -100
    if case not in _LINEAR:
        logits = torch.randn(tokens, vocab, device=device, dtype=dtype, generator=g)
        if case == "soft cross-entropy":
            scores = torch.randn(tokens, vocab, device=device, generator=g)
            target = torch.softmax(scores, dim=-1)
        return [logits.requires_grad_(), target]
    hidden = torch.randn(tokens, width, device=device, dtype=dtype, generator=g)
    weight = torch.randn(vocab, width, device=device, dtype=dtype, generator=g) / width**0.5
    return [hidden.requires_grad_(), weight.requires_grad_(), target]


def step(fn, inputs):
    differentiable = [t for t in inputs if t.requires_grad]
    loss = fn(*inputs)
    return loss.detach(), torch.autograd.grad(loss, differentiable)


def check(got, want):
    loss, grads = got
    torch.testing.assert_close(loss, want[0], atol=2e-2, rtol=2e-2)
    for a, b in zip(grads, want[1], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=5e-2)


def measure(fn, inputs, device):
    """(ms, peak MiB) of one forward + backward, or ("OOM", "OOM")."""
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step(fn, inputs)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        else:
            peak = ""
        return timed_ms(lambda: step(fn, inputs), device, reps=5), peak
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM", "OOM"


def bench(case, tokens, vocab, width, device, dtype, inductor):
    fn = CASES[case]
    torch._dynamo.reset()  # past `recompile_limit` compiles of `fn`, Dynamo would run it eagerly
    inputs = make_inputs(case, tokens, vocab, width, device, dtype)
    executors = {"eager": fn, "seqfast": torch.compile(fn, backend="seqfast", dynamic=False)}
    if inductor:
        executors["inductor"] = torch.compile(fn, dynamic=False)
    liger = liger_executor(case) if device.type == "cuda" else None
    if liger is not None:
        executors["liger"] = liger
    results, notes = {}, {}
    reference = None
    for name, run in executors.items():
        try:
            out = step(run, inputs)
            if reference is None:
                reference = out
                notes[name] = "the reference"
            else:
                check(out, reference)
                notes[name] = "checked"
            del out
            results[name] = measure(run, inputs, device)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            results[name] = ("OOM", "OOM")
            notes.setdefault(name, "")
        except (RuntimeError, AssertionError) as error:  # recorded, counted, not timed
            results[name] = ("-", "-")
            notes[name] = f"FAILED: {brief(error, 100)}"
    rows = []
    eager_ms, eager_mib = results["eager"]
    for name, (ms, mib) in results.items():
        speed = eager_ms / ms if isinstance(ms, float) and isinstance(eager_ms, float) else ""
        memory = mib / eager_mib if isinstance(mib, float) and isinstance(eager_mib, float) else ""
        rows.append([case, tokens, vocab, name, ms, mib, speed, memory, notes[name]])
        progress(rows[-1])
    return rows


def main() -> None:
    args, device, dtype = standard_setup(__doc__)
    width = 16 if args.quick else WIDTH
    if args.quick:
        sizes = [(64, 97)]
    elif args.short:
        sizes = [(8192, 128256)]
    else:
        sizes = [(t, v) for v in (32000, 50257, 128256, 256000) for t in (8192, 32768)]
    title = (
        "Fused loss: cross-entropy (class and probability targets), linear + cross-entropy, and"
        " linear + cross-entropy + z-loss"
    )
    lines = header(title, device, "benchmarks.loss")
    lines += [
        f"dtype {dtype}; hidden width {width}; class targets: mean over non-ignored tokens (every"
        " 7th ignored); probability targets: a softmax of random scores, mean over tokens;"
        " peak: MiB allocated above the inputs.",
        "",
    ]
    rows = []
    for case in CASES:
        for tokens, vocab in sizes:
            rows += bench(case, tokens, vocab, width, device, dtype, not args.no_inductor)
    columns = ["case", "tokens", "vocab", "executor", "ms", "peak MiB", "x eager speed",
               "peak / eager", "check"]  # fmt: skip
    lines += table(columns, rows)
    emit_checked(lines, rows, args.output, "benchmarks.loss")


if __name__ == "__main__":
    main()
