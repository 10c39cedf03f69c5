"""Fused attention `seqfast::attention` against torch's SDPA (the backend it picks, and cuDNN where
cuDNN takes the case), FlexAttention given the same mask, and the eager matmul-softmax spelling:
time and TFLOP/s, forward and forward + backward, and the fraction of a bf16 matmul measured in the
same run.

    python -m benchmarks.attention [--quick | --short] [--output benchmarks/results/<device>.md]

FLOP convention, the same for every executor (FlashAttention's): the forward is two matmuls,
4 * B * H * Lq * Lk * D, halved when causal (or the causal triangle is read from a mask); the
backward is five matmuls (the scores recomputed, dV, dP, dQ, dK), 2.5x the forward, so forward +
backward counts 3.5x the forward. Bias, masking, softmax and dropout count nothing.

Cases keep the tokens B * L and the hidden size H * D fixed; `--short` adds GPT-2 small's shape
(B 8, H 12, L 1024, D 64) and a LLaMA shape with grouped-query heads (B 4, H 32 over 8 key/value
heads, L 4096, D 128, causal). SDPA runs its flash backend where flash takes the case and torch's
default choice elsewhere; its rows name the backend used. FlexAttention gets the mask as a
`mask_mod` with its block mask (causal, padding by lengths, the triangle read from the mask
tensor) and a full bias as a `score_mod`; it takes no dropout. It is compiled on CUDA and runs
eager, forward only, on CPU (it has no CPU backward). Before an executor is timed it is checked
against SDPA: with dropout off, the largest max|a - b| / max|b| over the output and dq, dk, dv;
with dropout on, shapes and finiteness only. "x sdpa" is sdpa ms / ms, so above 1 is faster than
SDPA. Compile time is never timed (first calls are warm-up). On CUDA, "seqfast(one launch)" and
"seqfast(two launches)" run the backward each way (dq added by dk and dv's kernel, or from its
own), beside "seqfast", which runs the way its first call measured faster.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import seqcompile.ops.attention  # noqa: F401  (registers torch.ops.seqfast.attention)
from benchmarks.common import add_size_options, brief, emit, header, progress, table, timed_ms
from seqcompile.ops.attention import kernels as attention_kernels

Tensor = torch.Tensor
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max|a - b| / max|b| against SDPA
BACKEND_NAMES = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.MATH: "math",
}


@dataclasses.dataclass(frozen=True)
class Case:
    length: int
    head_dim: int
    batch: int
    heads: int
    causal: bool
    p: float
    bias: str  # "none"; "pad": (B, 1, 1, L), 0 or -inf per key; "full": (1, H, L, L), random;
    # "tri": the causal triangle as an (L, L) boolean mask tensor, as a model's buffer holds it
    kv_heads: int | None = None  # grouped-query attention: H // kv_heads query heads per k, v

    @property
    def groups(self) -> int:
        return self.heads // (self.kv_heads or self.heads)

    def flops(self, backward: bool) -> float:
        forward = 4 * self.batch * self.heads * self.length**2 * self.head_dim
        halved = self.causal or self.bias == "tri"
        return forward / (2 if halved else 1) * (3.5 if backward else 1.0)

    def scores_gib(self) -> float:
        """The float32 scores the eager spelling materializes."""
        return self.batch * self.heads * self.length**2 * 4 / 2**30

    def cells(self) -> list[object]:
        heads = f"{self.heads}/{self.kv_heads}" if self.groups > 1 else self.heads
        return [
            self.length, self.head_dim, f"{self.batch}x{heads}", self.causal, self.p, self.bias,
        ]  # fmt: skip


@dataclasses.dataclass
class Inputs:
    q: Tensor  # (B, H, L, D), requires grad, as k and v
    k: Tensor  # (B, H // groups, L, D), as v
    v: Tensor
    grad_out: Tensor  # (B, H, L, D)
    bias: Tensor | None  # (B, 1, 1, L) or (1, H, L, L), q's dtype
    mask: Tensor | None  # (L, L) bool, True where a query attends: the "tri" case
    seed: Tensor | None  # 0-d int64, when p > 0
    future: Tensor | None  # (L, L) bool, True above the diagonal, when causal (eager's mask)
    scale: float


@dataclasses.dataclass
class Result:
    note: str  # the check column: relative error, or why the executor was not timed
    fwd_ms: float | None = None
    both_ms: float | None = None
    failed: bool = False


SHORT_GRID = [(False, 0.0, "none"), (True, 0.0, "none"), (True, 0.1, "none"), (False, 0.0, "pad")]
"""`--short`'s (causal, p, bias): SDPA's flash backend takes the first three, not the fourth."""
GPT2 = dict(length=1024, head_dim=64, batch=8, heads=12)
"""GPT-2 small's attention at its context and a batch of 8, which `--short` adds causal with and
without dropout, and with dropout and the causal triangle read from a mask tensor (a model's
buffer): beside the causal row, that row shows what the mask's block lists cost."""
LLAMA = dict(length=4096, head_dim=128, batch=4, heads=32, kv_heads=8)
"""A LLaMA-style attention with grouped-query heads (4 query heads per key/value head), which
`--short` adds causal."""


def cases(
    quick: bool,
    lengths: list[int],
    head_dims: list[int],
    itemsize: int,
    cap_gib: float,
    short: bool = False,
) -> list[Case]:
    """(causal, p, bias) for every length and head dim; bias cases are non-causal."""
    if quick:
        tokens, hidden = 64, 64
        grid = [(False, 0.0, "none"), (True, 0.0, "none"), (False, 0.1, "none")]
        grid += [(False, 0.0, "pad"), (False, 0.1, "full"), (False, 0.0, "tri")]
    elif short:
        tokens, hidden = 16384, 2048
        grid = SHORT_GRID
    else:
        tokens, hidden = 16384, 2048
        grid = [(causal, p, "none") for causal in (False, True) for p in (0.0, 0.1)]
        grid += [(False, p, bias) for bias in ("pad", "full", "tri") for p in (0.0, 0.1)]
    found = []
    for head_dim in head_dims:
        for length in lengths:
            for causal, p, bias in grid:
                heads = hidden // head_dim
                if bias == "full" and heads * length**2 * itemsize / 2**30 > cap_gib:
                    continue  # the (1, H, L, L) bias alone passes the memory cap
                found.append(Case(length, head_dim, tokens // length, heads, causal, p, bias))
    if quick:  # grouped-query heads, as `--short`'s LLaMA shape has them
        found.append(Case(64, 32, 1, 2, causal=True, p=0.0, bias="none", kv_heads=1))
    if short:
        found += [Case(**GPT2, causal=True, p=p, bias="none") for p in (0.0, 0.1)]
        found.append(Case(**GPT2, causal=False, p=0.1, bias="tri"))
        found.append(Case(**LLAMA, causal=True, p=0.0, bias="none"))
    return found


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device) -> Inputs:
    g = torch.Generator(device=device).manual_seed(0)
    shape = (case.batch, case.heads, case.length, case.head_dim)

    def randn(size: tuple[int, ...]) -> Tensor:
        return torch.randn(size, device=device, dtype=dtype, generator=g)

    q = randn(shape).requires_grad_()
    kv_shape = (case.batch, case.heads // case.groups, case.length, case.head_dim)
    k, v = (randn(kv_shape).requires_grad_() for _ in range(2))
    bias = None
    if case.bias == "pad":
        kept = torch.randint(
            case.length // 2, case.length + 1, (case.batch, 1, 1, 1), device=device, generator=g
        )
        keys = torch.arange(case.length, device=device)
        bias = torch.where(keys < kept, 0.0, -math.inf).to(dtype)
    elif case.bias == "full":
        bias = randn((1, case.heads, case.length, case.length))
    mask = None
    if case.bias == "tri":
        mask = torch.ones(case.length, case.length, dtype=torch.bool, device=device).tril()
    seed = None
    if case.p > 0:
        seed = torch.randint(0, 2**62, (), dtype=torch.int64, device=device, generator=g)
    future = None
    if case.causal:
        future = torch.ones(case.length, case.length, dtype=torch.bool, device=device).triu(1)
    return Inputs(q, k, v, randn(shape), bias, mask, seed, future, case.head_dim**-0.5)


def seqfast_attention(t: Inputs, case: Case) -> Tensor:
    out, _, _ = torch.ops.seqfast.attention(
        t.q, t.k, t.v, t.bias, t.mask, t.seed, 0, case.p, t.scale, case.causal, -math.inf
    )
    return out


def sdpa_attention(t: Inputs, case: Case, backend: SDPBackend) -> Tensor:
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(
            t.q,
            t.k,
            t.v,
            attn_mask=t.bias if t.mask is None else t.mask,
            dropout_p=case.p,
            is_causal=case.causal,
            scale=t.scale,
            enable_gqa=case.groups > 1,
        )


def flex_mods(t: Inputs, case: Case) -> tuple[Callable | None, object | None]:
    """FlexAttention's score_mod and block mask for the case: the mask as a mask_mod (causal, the
    triangle read from its tensor, padding by the lengths the bias keeps), a full bias added by a
    score_mod."""
    mask_mod = None
    if case.causal:
        mask_mod = lambda b, h, q, kv: q >= kv  # noqa: E731
    elif case.bias == "tri":
        mask = t.mask
        mask_mod = lambda b, h, q, kv: mask[q, kv]  # noqa: E731
    elif case.bias == "pad":
        lengths = (t.bias[:, 0, 0, :] == 0).sum(-1)
        mask_mod = lambda b, h, q, kv: kv < lengths[b]  # noqa: E731
    score_mod = None
    if case.bias == "full":
        bias = t.bias
        score_mod = lambda s, b, h, q, kv: s + bias[0, h, q, kv]  # noqa: E731
    block_mask = None
    if mask_mod is not None:
        batch = case.batch if case.bias == "pad" else None
        block_mask = create_block_mask(
            mask_mod, batch, None, case.length, case.length, device=t.q.device
        )
    return score_mod, block_mask


def flex_executor(t: Inputs, case: Case) -> Callable[..., Tensor] | str:
    """FlexAttention on the case (compiled on CUDA, eager elsewhere), or why it does not take it."""
    if case.p > 0:
        return "not taken: FlexAttention has no dropout"
    score_mod, block_mask = flex_mods(t, case)
    attend = _compiled_flex() if t.q.device.type == "cuda" else flex_attention

    def run(t: Inputs, case: Case) -> Tensor:
        q, k, v = t.q, t.k, t.v
        if q.device.type != "cuda":  # it refuses inputs that require grad on CPU
            q, k, v = q.detach(), k.detach(), v.detach()
        return attend(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=t.scale,
            enable_gqa=case.groups > 1,
        )  # fmt: skip

    return run


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    return torch.compile(flex_attention, dynamic=False)


def eager_attention(t: Inputs, case: Case) -> Tensor:
    k, v = t.k, t.v
    if case.groups > 1:
        k, v = (x.repeat_interleave(case.groups, dim=1) for x in (k, v))
    scores = (t.q @ k.transpose(-1, -2)).float() * t.scale
    if t.bias is not None:
        scores = scores + t.bias
    if t.future is not None:
        scores = scores.masked_fill(t.future, -math.inf)
    if t.mask is not None:
        scores = scores.masked_fill(~t.mask, -math.inf)
    prob = F.dropout(torch.softmax(scores, dim=-1), case.p)
    return prob.to(v.dtype) @ v


def sdpa_choice(t: Inputs, case: Case, backend: SDPBackend | None) -> SDPBackend | None:
    """The backend SDPA runs the case on with only `backend` enabled (None: its default choice),
    asked with q, k, v requiring grad, as the timed backward needs; None where none takes it."""
    args = (t.q, t.k, t.v, t.bias if t.mask is None else t.mask, case.p, case.causal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the backends' reasons for refusing
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            try:
                return SDPBackend(torch._fused_sdp_choice(*args, enable_gqa=case.groups > 1))
            except RuntimeError:  # "No available kernel": no enabled backend takes the case
                return None


def sdpa_backend(t: Inputs, case: Case) -> SDPBackend:
    """Flash where it takes the case, else the backend torch's default dispatch picks."""
    return sdpa_choice(t, case, SDPBackend.FLASH_ATTENTION) or sdpa_choice(t, case, None)


def forward_backward(fn: Callable[[Inputs], Tensor], t: Inputs, backward: bool) -> list[Tensor]:
    if not backward:  # FlexAttention on CPU: inputs that need no gradient, the forward only
        with torch.no_grad():
            return [fn(t)]
    out = fn(t)
    return [out.detach(), *torch.autograd.grad(out, (t.q, t.k, t.v), t.grad_out)]


def check(outputs: list[Tensor], reference: list[Tensor] | None, case: Case) -> Result:
    """The executor's output and dq, dk, dv (those it gives) against the reference (SDPA's, unless
    SDPA ran out of memory): numerics with dropout off, shapes and finiteness always."""
    shape = (case.batch, case.heads, case.length, case.head_dim)
    kv_shape = (case.batch, case.heads // case.groups, case.length, case.head_dim)
    shapes = (shape, shape, kv_shape, kv_shape)
    for got, name, want in zip(outputs, ("out", "dq", "dk", "dv"), shapes, strict=False):
        if got.shape != want or not got.isfinite().all():
            return Result(f"{name}: misshapen or not finite", failed=True)
    if reference is None:
        return Result("the reference")
    if case.p > 0:
        return Result("finite (dropout)")
    worst = max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        for a, b in zip(outputs, reference, strict=False)
    )
    failed = worst > TOLERANCE[outputs[0].dtype]
    return Result(f"{'MISMATCH ' if failed else ''}rel err {worst:.1e}", failed=failed)


def time_passes(
    fn: Callable[[Inputs], Tensor], t: Inputs, device: torch.device, backward: bool
) -> list[float | None]:
    with torch.no_grad():
        fwd = timed_ms(lambda: fn(t), device)
    if not backward:
        return [fwd, None]
    both = timed_ms(lambda: torch.autograd.grad(fn(t), (t.q, t.k, t.v), t.grad_out), device)
    return [fwd, both]


def executors_of(t: Inputs, case: Case) -> dict[str, Callable[..., Tensor] | str]:
    """The executors of the case by label, SDPA's choice first; a string where one does not take
    the case (why)."""
    backend = sdpa_backend(t, case)
    executors = {
        f"sdpa({BACKEND_NAMES.get(backend, backend.name.lower())})": functools.partial(
            sdpa_attention, backend=backend
        )
    }
    if t.q.device.type == "cuda" and backend != SDPBackend.CUDNN_ATTENTION:
        cudnn = sdpa_choice(t, case, SDPBackend.CUDNN_ATTENTION)
        executors["sdpa(cudnn)"] = (
            functools.partial(sdpa_attention, backend=cudnn) if cudnn else "cuDNN does not take it"
        )
    executors["flex"] = flex_executor(t, case)
    executors["seqfast"] = seqfast_attention
    if t.q.device.type == "cuda":  # (on CPU the op runs its reference)
        executors.update(dict.fromkeys(BACKWARDS, seqfast_attention))
    executors["eager"] = eager_attention
    return executors


BACKWARDS = {
    "seqfast(one launch)": attention_kernels.ONE_LAUNCH,
    "seqfast(two launches)": attention_kernels.TWO_LAUNCHES,
}
"""seqfast with its backward in each way (`kernels.backward_variants`); the row "seqfast" runs
the way its first call measured faster."""


@contextlib.contextmanager
def backward_forced(name: str):
    """The backward of the executor `name` run one way, where its name says one."""
    variant = BACKWARDS.get(name)
    if variant is None:
        yield
        return
    chosen = attention_kernels.backward_variants
    attention_kernels.backward_variants = lambda q: [variant]
    try:
        yield
    finally:
        attention_kernels.backward_variants = chosen


def bench_case(case: Case, dtype: torch.dtype, device: torch.device, cap_gib: float):
    """{executor label: Result}, SDPA first: every executor checked against it, then timed."""
    t = make_inputs(case, dtype, device)
    results, reference = {}, None
    for name, executor in executors_of(t, case).items():
        if isinstance(executor, str):
            results[name] = Result(executor)
            continue
        fn = functools.partial(executor, case=case)
        if name == "eager" and case.scores_gib() > cap_gib:
            results[name] = Result(f"skipped: {case.scores_gib():.0f} GiB of scores")
            continue
        backward = name != "flex" or device.type == "cuda"
        try:
            with backward_forced(name):
                outputs = forward_backward(fn, t, backward)
                result = check(outputs, reference, case)
                reference = reference or outputs
                del outputs
                if not result.failed:
                    result.fwd_ms, result.both_ms = time_passes(fn, t, device, backward)
        except torch.cuda.OutOfMemoryError:
            result = Result("OOM")
        except RuntimeError as error:  # recorded and counted as a failure, not hidden
            result = Result(f"error: {brief(error, 80)}", failed=True)
        results[name] = result
    return results


def table_rows(case: Case, results: dict[str, Result], ceiling: float) -> list[list[object]]:
    sdpa = next(r for name, r in results.items() if name.startswith("sdpa"))
    rows = []
    for name, r in results.items():
        cells: list[object] = []
        for ms, backward in ((r.fwd_ms, False), (r.both_ms, True)):
            tflops = case.flops(backward) / (ms * 1e-3) / 1e12 if ms else None
            cells += [ms, tflops, tflops / ceiling] if ms else ["-"] * 3
        ratios = [
            sdpa_ms / ms if ms and sdpa_ms else "-"
            for ms, sdpa_ms in ((r.fwd_ms, sdpa.fwd_ms), (r.both_ms, sdpa.both_ms))
        ]
        rows.append([*case.cells(), name, *cells, *ratios, r.note])
    return rows


def summary(measured: list[tuple[Case, dict[str, Result]]]) -> list[str]:
    """seqfast's forward + backward speed-up over SDPA, where SDPA runs flash and where not, and
    over FlexAttention."""
    groups: dict[str, list[float]] = {"flash": [], "other": [], "flex": []}
    for _, results in measured:
        name, sdpa = next((n, r) for n, r in results.items() if n.startswith("sdpa"))
        ours = results["seqfast"]
        if sdpa.both_ms and ours.both_ms:
            groups["flash" if name == "sdpa(flash)" else "other"].append(
                sdpa.both_ms / ours.both_ms
            )
        flex = results.get("flex")
        if flex is not None and flex.both_ms and ours.both_ms:
            groups["flex"].append(flex.both_ms / ours.both_ms)
    lines = []
    for group, target, against in (
        ("flash", ">= 0.9x", "sdpa (flash)"),
        ("other", "> 1x", "sdpa (not flash)"),
        ("flex", ">= 1x", "flex, same mask"),
    ):
        ratios = groups[group]
        if ratios:
            geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
            lines.append(
                f"- seqfast fwd+bwd vs {against}, target {target}: min {min(ratios):.2f}x, "
                f"geomean {geomean:.2f}x over {len(ratios)} cases"
            )
    return lines


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / (timed_ms(lambda: a @ b, device) * 1e-3) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_options(parser)
    parser.add_argument(
        "--no-inductor", action="store_true", help="accepted for a uniform interface (no Inductor)"
    )
    parser.add_argument("--output", help="append the markdown table to this file")
    parser.add_argument(
        "--lengths", type=int, nargs="+", help="default 512 1024 2048 4096 8192; 4096 with --short"
    )
    parser.add_argument("--head-dims", type=int, nargs="+", help="default 64 128; 128 with --short")
    parser.add_argument(
        "--eager-cap-gib", type=float, default=8.0,
        help="skip eager past this many GiB of float32 scores; also caps the (1, H, L, L) bias",
    )  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        lengths, head_dims = [64], [32]
    elif args.short:
        lengths, head_dims = args.lengths or [4096], args.head_dims or [128]
    else:
        lengths, head_dims = (
            args.lengths or [512, 1024, 2048, 4096, 8192],
            args.head_dims or [64, 128],
        )
    selected = cases(
        args.quick, lengths, head_dims, dtype.itemsize, args.eager_cap_gib, short=args.short
    )
    matmul_n = 256 if args.quick else 8192
    ceiling = matmul_tflops(device, dtype, matmul_n)

    measured = []
    for case in selected:
        measured.append((case, bench_case(case, dtype, device, args.eager_cap_gib)))
        for row in table_rows(*measured[-1], ceiling):
            progress(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lines = header("Fused attention", device, "benchmarks.attention")
    lines += [
        f"dtype {dtype}; tokens B*L and hidden H*D fixed; measured {matmul_n}^3 matmul: "
        f"{ceiling:.3g} TFLOP/s (the 'of matmul' columns). FLOPs: forward 4*B*H*L*L*D, halved "
        f"when causal (bias 'tri': the causal triangle read from a boolean mask tensor); fwd+bwd "
        f"3.5x forward. 'x sdpa' = sdpa ms / ms. Eager skipped past "
        f"{args.eager_cap_gib:g} GiB of float32 scores.",
        "",
    ]
    columns = ["L", "D", "B x H", "causal", "p", "bias", "executor"]
    for pass_ in ("fwd", "fwd+bwd"):
        columns += [f"{pass_} ms", f"{pass_} TFLOP/s", f"{pass_} of matmul"]
    columns += ["x sdpa fwd", "x sdpa fwd+bwd", "check"]
    lines += table(columns, [row for c, r in measured for row in table_rows(c, r, ceiling)])
    lines += ["", *summary(measured)]
    emit(lines, args.output)
    failed = sum(r.failed for _, results in measured for r in results.values())
    if failed:
        raise SystemExit(
            f"benchmarks.attention: {failed} executor runs failed; see the check column"
        )


if __name__ == "__main__":
    main()
