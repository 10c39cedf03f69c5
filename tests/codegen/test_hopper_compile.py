"""Generated kernels compile for Hopper (sm_90) through Triton's real compiler, down to a cubin,
with no GPU present: this catches what the interpreter forgives (types, constexpr-specialized
scalars, unsupported ops). Runs in a child process, since this one imports Triton interpreted."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a minute of Triton's compiler: CI runs it when it runs each file

COMPILE = textwrap.dedent(
    """
    import itertools, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from seqcompile.codegen import kernel_function

    INTEGERS = {"N", "M", "G", "R", "H", "GROUP", "LQ", "LK", "stream", "window"}
    FLOATS = {"eps", "p", "scale", "masked_value"}
    FLOAT_POINTERS = {"MEAN", "RSTD", "PARTIAL", "ROW_MAX", "LOG_SUM", "DELTA", "DBIAS", "DREL"}
    CONSTEXPRS = {"HEAD_DIM", "DOT_PRECISION"}

    def signature(fn, data):
        sig = {}
        for name in fn.arg_names:
            if name.startswith("BLOCK_") or name in CONSTEXPRS:
                sig[name] = "constexpr"
            elif name in INTEGERS or name.startswith("stride_"):
                sig[name] = "i32"
            elif name in FLOATS:
                sig[name] = "fp32"
            elif name in ("SEED", "DOC_Q", "DOC_KV", "PREFIX"):
                sig[name] = "*i64"
            elif name == "MASK":
                sig[name] = "*i1"
            else:
                sig[name] = "*fp32" if name in FLOAT_POINTERS else data
        return sig

    def compile(spec, data, constexprs):
        fn = kernel_function(spec).jit
        sig = signature(fn, data)
        constexprs = {k: v for k, v in constexprs.items() if k in sig}
        for k in constexprs:
            sig[k] = "constexpr"
        source = ASTSource(fn, sig, constexprs=constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], spec
        print("ok", spec.template, spec.describe(), data, sorted(constexprs))
    """
)

NORM = textwrap.dedent(
    """
    from seqcompile.ops import norm

    for rms, on in itertools.product([False, True], [False, True]):
        flags = dict(branch_bias=on, dropout=on, weight=on, bias=on and not rms)
        compile(norm.forward_spec(residual=on, rms=rms, **flags), "*bf16", {"BLOCK_N": 1024})
        for spec in norm.backward_specs(sum_grad=on, residual_grad=on, rms=rms, **flags):
            compile(spec, "*fp16", {"BLOCK_N": 1024, "BLOCK_G": 16})
    # Triton turns integer arguments equal to 1 into constants: the first dropout stream, width 1
    flags = dict(branch_bias=False, dropout=True, rms=False, weight=True, bias=False)
    compile(norm.forward_spec(residual=True, **flags), "*fp32", {"BLOCK_N": 1, "stream": 1, "N": 1})
    """
)

ATTENTION = textwrap.dedent(
    """
    import torch
    from seqcompile.ops import attention, score_mods

    capped = score_mods.register(lambda x: 30.0 * torch.tanh(x / 30.0), "cap")
    CAP = score_mods.lookup(capped).kernel

    def tiles(head_dim, precision):
        block_d = max(16, triton.next_power_of_2(head_dim))
        return dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=64, BLOCK_N=32,
                    DOT_PRECISION=precision)

    def kernel_flags(**on):
        names = ("bias", "mask", "dropout", "causal", "window", "documents", "relative", "prefix")
        flags = {name: on.get(name, False) for name in names}
        return {**flags, "score_mod": on.get("score_mod", ())}

    variants = [
        kernel_flags(score_mod=CAP),
        kernel_flags(bias=True, mask=True, dropout=True, causal=True, window=True),
        kernel_flags(bias=True, dropout=True, score_mod=CAP, documents=True),
        kernel_flags(mask=True, causal=True, window=True, documents=True),
        kernel_flags(mask=True, causal=True, prefix=True, relative=True, score_mod=CAP),
    ]
    cases = [("*bf16", 64, "tf32"), ("*fp16", 80, "tf32"), ("*fp32", 24, "ieee")]
    for flags, (data, head_dim, precision) in zip(variants, cases + cases[:2]):
        constexprs = tiles(head_dim, precision)
        compile(attention.forward_spec(**flags), data, constexprs)
        grads = dict(bias_grad=flags["bias"], rel_grad=flags["relative"])
        for spec in attention.backward_specs(**grads, **flags):
            compile(spec, data, {**constexprs, "BLOCK_R": 16})
    # contiguous head dims, one key/value head per query head and the first dropout stream arrive
    # as the constant 1
    ones = dict(stride_qd=1, stride_kd=1, stride_vd=1, GROUP=1, stream=1)
    every = kernel_flags(bias=True, mask=True, dropout=True)
    compile(attention.forward_spec(**every), "*bf16", {**tiles(128, "tf32"), **ones})
    for spec in attention.backward_specs(bias_grad=True, **every)[1:]:
        compile(spec, "*bf16", {**tiles(128, "tf32"), **ones})
    """
)


POINTWISE = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from seqcompile.ops import pointwise
    from seqcompile.patterns.pointwise import region_of_function

    def compile_pointwise(spec, pointers):
        fn = kernel_function(spec).jit
        sig = {name: "i32" for name in fn.arg_names}
        sig.update(pointers, SEED="*i64", BLOCK="constexpr")
        sig = {k: v for k, v in sig.items() if k in fn.arg_names}
        source = ASTSource(fn, sig, constexprs={"BLOCK": 1024})
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], spec
        print("ok", spec.describe())

    def bias_gelu_dropout(x, b):
        return F.dropout(F.gelu(x + b, approximate="tanh"), 0.1)

    def gated(a, b, mask):
        return torch.where(mask, F.silu(a) * b, a.exp().clamp(max=3.0)) ** 3

    x, b = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    region = region_of_function(bias_gelu_dropout, [x, b])
    spec, _ = pointwise.forward_spec(region.key, ("flat", (False, True)), 2, 1)
    compile_pointwise(spec, {"IN0": "*bf16", "IN1": "*fp32", "OUT0": "*bf16"})
    plan_key = ((True, True), (2,), (True,))  # a gradient in two terms, one broadcast; sum written
    layouts = ("flat", (False, True), "flat", "scalar")
    spec, _ = pointwise.backward_spec(region.key, plan_key, layouts, 2)
    compile_pointwise(
        spec, {"IN0": "*bf16", "IN1": "*fp32", "GRAD0": "*bf16", "GRAD1": "*bf16", "DIN0": "*bf16",
               "DIN1": "*bf16"}
    )

    mask = torch.rand(4, 8) > 0.5
    region = region_of_function(gated, [x, x.detach().requires_grad_(), mask])
    spec, _ = pointwise.forward_spec(region.key, ("flat", "flat", "scalar"), 1, 1)
    compile_pointwise(spec, {"IN0": "*fp16", "IN1": "*fp16", "IN2": "*i1", "OUT0": "*fp16"})
    plan_key = ((True, True, False), (1,), (False,))
    spec, _ = pointwise.backward_spec(region.key, plan_key, ("flat", "flat", "flat", "flat"), 1)
    compile_pointwise(
        spec, {"IN0": "*fp32", "IN1": "*fp32", "IN2": "*i1", "GRAD0": "*fp32", "DIN0": "*fp32",
               "DIN1": "*fp32"}
    )
    """
)


CROSS_ENTROPY = textwrap.dedent(
    """
    from seqcompile.ops import cross_entropy

    for mode in ("forward", "backward", "forward_grad"):
        fn = kernel_function(cross_entropy.spec(mode)).jit
        sig = {name: "i32" if name.endswith("_stride") else "*fp32" for name in fn.arg_names}
        sig.update(LOGITS="*bf16", TARGET="*i64", V="i32", ignore_index="i64",
                   smoothing="fp32", BLOCK_V="constexpr")
        if mode == "backward":
            sig.update(GRAD="*fp32", DLOGITS="*bf16")
        source = ASTSource(fn, sig, constexprs={"BLOCK_V": 4096})
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
        print("ok", mode)
    """
)


def compile_for_hopper(body: str) -> str:
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SEQFAST_INTERPRET")
    }
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", COMPILE + body], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


KERNELS_COMPILED = {
    "attention": ATTENTION,
    "add_norm": NORM,
    "cross_entropy": CROSS_ENTROPY,
    "linear_cross_entropy": CROSS_ENTROPY,  # its kernel is cross-entropy's `forward_grad`
    "pointwise": POINTWISE,
}
"""Which compile below covers each registry entry's kernels (`tests/ops/test_registry.py` checks
that every entry has one)."""


def test_every_norm_template_variant_compiles_to_a_hopper_cubin():
    assert compile_for_hopper(NORM).count("ok ") == 11


def test_attention_template_variants_compile_to_hopper_cubins():
    assert compile_for_hopper(ATTENTION).count("ok ") == 5 * 4 + 3


def test_pointwise_kernels_compile_to_hopper_cubins():
    assert compile_for_hopper(POINTWISE).count("ok ") == 4


def test_cross_entropy_kernels_compile_to_hopper_cubins():
    assert compile_for_hopper(CROSS_ENTROPY).count("ok ") == 3
