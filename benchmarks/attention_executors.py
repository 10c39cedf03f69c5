"""The executors the attention benchmark compares on a case: SDPA on the backend it picks (and
cuDNN), FlexAttention given the same mask, seqfast (its backward forced one way where a row's
name says one) and the eager matmul-softmax spelling."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import seqcompile.ops.attention  # noqa: F401  (registers torch.ops.seqfast.attention)
from benchmarks.attention_cases import Case, Inputs
from seqcompile.ops.attention import kernels as attention_kernels

Tensor = torch.Tensor
BACKEND_NAMES = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.MATH: "math",
}


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
