"""Generated kernels compile for Hopper (sm_90) through Triton's real compiler, down to a cubin,
with no GPU present: this catches what the interpreter forgives (types, constexpr-specialized
scalars, unsupported ops).

The kernels compiled are the registry's: every entry's samples run (forward, and the backward of
those with gradients) under Triton's interpreter while `recording_launches()` keeps each launch as
Triton types it, and each distinct launch is compiled as recorded (float32), then again with the
op's own float tensors (its inputs, outputs and their gradients) in bfloat16, as a model in mixed
precision passes them. A new entry is compiled from its samples with nothing to add here. Each
step runs in a child process: the first interpreted, the second with Triton's real compiler."""

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes of Triton's compiler: CI runs it when it runs each file

ROOT = Path(__file__).resolve().parents[2]

RECORD = textwrap.dedent(
    """
    import json, pickle, sys
    import torch
    from seqcompile.codegen import recording_launches
    from seqcompile.ops import registry
    from seqcompile.ops.fused_op import Call
    from seqcompile.ops.samples import in_layout, replace_slots, tensor_slots

    def storages(tensors):
        return {t.untyped_storage().data_ptr() for t in tensors if t is not None and t.numel()}

    def narrow_outputs(entry, sample):
        # which outputs the op gives in bfloat16 when its float arguments are: on shapes alone
        def meta(slot, t):
            return t.to("meta", torch.bfloat16 if t.is_floating_point() else t.dtype)

        args = replace_slots(sample.args, meta)
        args = {k: torch.bfloat16 if v is torch.float32 else v for k, v in args.items()}
        with torch.no_grad():  # a dtype argument (`out_dtype`) follows the data's
            result = entry.forward(**args)
        outputs = list(result) if isinstance(result, tuple | list) else [result]
        return {i for i, t in enumerate(outputs) if t.dtype == torch.bfloat16}

    def run(entry, sample):
        # `sample` forward and backward; the storages of the op's own float32 tensors, those a
        # model in bfloat16 passes in bfloat16: its arguments, the outputs in their dtype, and
        # the gradients of both
        def leaf(slot, t):
            return in_layout(t, "contiguous", requires_grad=slot in sample.grads)

        args = replace_slots(sample.args, leaf)
        tensors = dict(tensor_slots(args))
        result = entry.forward(**args)
        outputs = list(result) if isinstance(result, tuple | list) else [result]
        narrow = narrow_outputs(entry, sample)
        own = [*tensors.values(), *(outputs[i] for i in narrow)]
        differentiable = [outputs[i] for i in sample.outputs if outputs[i].requires_grad]
        if sample.grads and differentiable:
            cotangents = [torch.randn_like(t) for t in differentiable]
            grads = torch.autograd.grad(
                differentiable, [tensors[s] for s in sample.grads], cotangents, allow_unused=True
            )
            own += [c for c, t in zip(cotangents, differentiable) if any(t is o for o in own)]
            own += list(grads)
        return storages(t for t in own if t is not None and t.dtype == torch.float32)

    records, launched, declares = {}, {}, {}
    for entry in registry.ENTRIES:
        launched[entry.name] = 0
        for sample in entry.samples():
            declared = entry.kernels[entry.forward](Call(entry.forward, (), sample.args))
            declares[entry.name] = declares.get(entry.name, False) or bool(declared)
            with recording_launches() as record:
                own = run(entry, sample)
            launched[entry.name] += len(record)
            for launch in record:
                data = tuple(
                    name for name, value in launch.arguments.items()
                    if isinstance(value, torch.Tensor) and storages([value]) <= own
                    and dict(launch.signature)[name] == "*fp32"
                )
                key = (launch.spec, launch.signature, launch.constexprs)
                records.setdefault(key, (*key, launch.aligned, launch.options, data))
    with open(sys.argv[1], "wb") as f:
        pickle.dump(list(records.values()), f)
    # an entry whose forward declares no kernel (its chunks run ATen ops) launches none
    print(json.dumps({name: n if declares[name] else None for name, n in launched.items()}))
    """
)

COMPILE_RECORDS = textwrap.dedent(
    """
    import pickle, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from seqcompile.codegen import kernel_function

    with open(sys.argv[1], "rb") as f:
        records = pickle.load(f)
    for spec, signature, constexprs, aligned, options, data in records:
        fn = kernel_function(spec).jit
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        for variant in ("fp32", "bf16") if data else ("fp32",):
            sig = dict(signature)
            if variant == "bf16":
                sig.update({name: "*bf16" for name in data})
            source = ASTSource(fn, sig, constexprs=dict(constexprs), attrs=attrs)
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(options))
            assert kernel.asm["cubin"], (spec, variant)
            print("ok", spec.name, variant, spec.describe(), flush=True)
    """
)


def _run_child(script: str, *args: str, interpret: bool) -> str:
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SEQFAST_INTERPRET")
    }
    if interpret:
        env.update(SEQFAST_INTERPRET="1", TRITON_INTERPRET="1")
    else:
        env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_every_registry_entrys_kernels_compile_to_hopper_cubins(tmp_path):
    """Each distinct launch the registry's samples make compiles, in float32 and in bfloat16."""
    records = tmp_path / "launches.pickle"
    launched = json.loads(_run_child(RECORD, str(records), interpret=True).splitlines()[-1])
    silent = [name for name, n in launched.items() if n == 0]
    assert not silent, f"entries whose samples launch no kernel: {silent}"
    with records.open("rb") as f:
        expected = sum(2 if record[-1] else 1 for record in pickle.load(f))
    assert _run_child(COMPILE_RECORDS, str(records), interpret=False).count("ok ") == expected


COMPILE = textwrap.dedent(
    """
    import itertools, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from seqcompile.codegen import kernel_function

    INTEGERS = {"N", "M", "G", "R", "H", "GROUP", "LQ", "LK", "stream", "window"}
    INTEGERS |= {"TH", "ROWS", "COLS"}  # the mask's block lists
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
            elif name in ("MASK_LISTS", "MASK_COUNTS", "INDICES", "COUNTS"):
                sig[name] = "*i32"
            else:
                sig[name] = "*fp32" if name in FLOAT_POINTERS else data
        return sig

    def compile(spec, data, constexprs):
        fn = kernel_function(spec).jit
        sig = signature(fn, data)
        if spec.name.endswith(":with_dq"):  # dq added in float32
            sig["DQ"] = "*fp32"
        constexprs = {k: v for k, v in constexprs.items() if k in sig}
        for k in constexprs:
            sig[k] = "constexpr"
        source = ASTSource(fn, sig, constexprs=constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], spec
        print("ok", spec.template, spec.describe(), data, sorted(constexprs))
    """
)

# Extra cases, written by hand, for variants the samples do not reach: norms and pointwise
# regions with dropout (the Philox stream), a norm's residual gradient, float16 data and a
# pointwise region with a boolean input and a broadcast scalar; attention at the GPU's tiles,
# warps and stages and head dims 80 and 128 (the interpreter runs 16 x 16 tiles); and
# cross-entropy's `forward_grad` on bfloat16 logits (linear + cross-entropy's chunks).

NORM = textwrap.dedent(
    """
    from seqcompile.ops.add_norm import kernels as norm

    for rms, on in itertools.product([False, True], [False, True]):
        flags = dict(branch_bias=on, dropout=on, weight=on, bias=on and not rms)
        compile(norm.forward_spec(residual=on, rms=rms, **flags), "*bf16", {"BLOCK_N": 1024})
        for spec in norm.backward_specs(sum_grad=on, residual_grad=on, rms=rms, **flags):
            compile(spec, "*fp16", {"BLOCK_N": 1024, "BLOCK_G": 16, "K": 3 if on else 1})
    # Triton turns integer arguments equal to 1 into constants: the first dropout stream, width 1
    flags = dict(branch_bias=False, dropout=True, rms=False, weight=True, bias=False)
    compile(norm.forward_spec(residual=True, **flags), "*fp32", {"BLOCK_N": 1, "stream": 1, "N": 1})
    """
)

ATTENTION = textwrap.dedent(
    """
    import torch
    from seqcompile.ops.attention import kernels as attention
    from seqcompile.ops.attention import score_mods

    capped = score_mods.register(lambda x: 30.0 * torch.tanh(x / 30.0), "cap")
    CAP = score_mods.lookup(capped).kernel

    def tiles(head_dim, precision):
        block_d = max(16, triton.next_power_of_2(head_dim))
        return dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=64, BLOCK_N=32,
                    DOT_PRECISION=precision)

    def kernel_flags(**on):
        names = ("bias", "mask", "blocks", "dropout", "causal", "window", "documents", "relative",
                 "prefix")
        flags = {name: on.get(name, False) for name in names}
        return {**flags, "score_mod": on.get("score_mod", ())}

    variants = [
        kernel_flags(score_mod=CAP),
        kernel_flags(bias=True, mask=True, dropout=True, causal=True, window=True),
        kernel_flags(bias=True, dropout=True, score_mod=CAP, documents=True),
        kernel_flags(mask=True, causal=True, window=True, documents=True),
        kernel_flags(mask=True, causal=True, prefix=True, relative=True, score_mod=CAP),
        kernel_flags(mask=True, blocks=True, dropout=True),
        kernel_flags(bias=True, mask=True, blocks=True, score_mod=CAP),
        kernel_flags(bias=True, blocks=True, causal=True),
    ]
    cases = [("*bf16", 64, "tf32"), ("*fp16", 80, "tf32"), ("*fp32", 24, "ieee")]
    for flags, (data, head_dim, precision) in zip(variants, cases + cases + cases[:2]):
        constexprs = tiles(head_dim, precision)
        compile(attention.forward_spec(**flags), data, constexprs)
        grads = dict(bias_grad=flags["bias"], rel_grad=flags["relative"])
        for spec in attention.backward_specs(**grads, **flags):
            compile(spec, data, {**constexprs, "BLOCK_R": 16})
        (with_dq,) = attention.backward_specs(**grads, one_launch=True, **flags)[1:]
        compile(with_dq, data, constexprs)
    # contiguous head dims, one key/value head per query head and the first dropout stream arrive
    # as the constant 1
    ones = dict(stride_qd=1, stride_kd=1, stride_vd=1, GROUP=1, stream=1)
    every = kernel_flags(bias=True, mask=True, dropout=True)
    compile(attention.forward_spec(**every), "*bf16", {**tiles(128, "tf32"), **ones})
    compile(attention.forward_spec(sink=True, **every), "*bf16", {**tiles(128, "tf32"), **ones})
    for one_launch in (False, True):
        for spec in attention.backward_specs(bias_grad=True, one_launch=one_launch, **every):
            compile(spec, "*bf16", {**tiles(128, "tf32"), **ones, "BLOCK_R": 64})
    # the block lists at the forward's default tiles at head dim 64, with causal, by key: of a
    # mask, and of a bias
    lists = dict(SKIP_EMPTY=True, CAUSAL=True, KEYS=True, BLOCK_R=128, BLOCK_C=64)
    compile(attention.BLOCKS, "*i1", {**lists, "BIAS": False})
    compile(attention.BLOCKS, "*bf16", {**lists, "BIAS": True})
    """
)


POINTWISE = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from seqcompile.ops.pointwise import kernels as pointwise
    from seqcompile.patterns.pointwise_cut import region_of_function

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
    spec, _ = pointwise.forward_spec(region.key, ("flat", (False, True)), 2, 1, False)
    compile_pointwise(spec, {"IN0": "*bf16", "IN1": "*fp32", "OUT0": "*bf16"})
    plan_key = ((True, True), (2,), (True,))  # a gradient in two terms, one broadcast; sum written
    layouts = ("flat", (False, True), "flat", "scalar")
    spec, _ = pointwise.backward_spec(region.key, plan_key, layouts, 2, False)
    compile_pointwise(
        spec, {"IN0": "*bf16", "IN1": "*fp32", "GRAD0": "*bf16", "GRAD1": "*bf16", "DIN0": "*bf16",
               "DIN1": "*bf16"}
    )

    mask = torch.rand(4, 8) > 0.5
    region = region_of_function(gated, [x, x.detach().requires_grad_(), mask])
    spec, _ = pointwise.forward_spec(region.key, ("flat", "flat", "scalar"), 1, 1, False)
    compile_pointwise(spec, {"IN0": "*fp16", "IN1": "*fp16", "IN2": "*i1", "OUT0": "*fp16"})
    plan_key = ((True, True, False), (1,), (False,))
    flat = ("flat", "flat", "flat", "flat")
    spec, _ = pointwise.backward_spec(region.key, plan_key, flat, 1, False)
    compile_pointwise(
        spec, {"IN0": "*fp32", "IN1": "*fp32", "IN2": "*i1", "GRAD0": "*fp32", "DIN0": "*fp32",
               "DIN1": "*fp32"}
    )

    def special(a, b):  # the series, Hurwitz's zeta and the bit steps
        s = torch.special
        tails = torch.erfc(a) + s.erfcx(a) + s.log_ndtr(a) + torch.i0(a) + s.i1e(a)
        return tails * torch.polygamma(2, a) + torch.nextafter(a, b)

    region = region_of_function(special, [x, x.detach().requires_grad_()])
    spec, _ = pointwise.forward_spec(region.key, ("flat", "flat"), 1, 1, True)  # 64-bit indices
    compile_pointwise(spec, {"IN0": "*bf16", "IN1": "*bf16", "OUT0": "*bf16"})
    plan_key = ((True, True), (1,), (False,))
    spec, _ = pointwise.backward_spec(region.key, plan_key, ("flat", "flat", "flat"), 1, True)
    compile_pointwise(
        spec, {"IN0": "*fp32", "IN1": "*fp32", "GRAD0": "*fp32", "DIN0": "*fp32", "DIN1": "*fp32"}
    )
    """
)


CROSS_ENTROPY = textwrap.dedent(
    """
    from seqcompile.ops.cross_entropy import kernels as cross_entropy

    fn = kernel_function(cross_entropy.spec("forward_grad", 0.0)).jit
    sig = {name: "i32" if name.endswith("_stride") else "*fp32" for name in fn.arg_names}
    sig.update(LOGITS="*bf16", TARGET="*i64", V="i32", ignore_index="i64", smoothing="fp32",
               BLOCK_V="constexpr")
    source = ASTSource(fn, sig, constexprs={"BLOCK_V": 4096})
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
    print("ok forward_grad")
    """
)


def compile_for_hopper(body: str) -> str:
    return _run_child(COMPILE + body, interpret=False)


def test_every_norm_template_variant_compiles_to_a_hopper_cubin():
    assert compile_for_hopper(NORM).count("ok ") == 11


def test_attention_template_variants_compile_to_hopper_cubins():
    assert compile_for_hopper(ATTENTION).count("ok ") == 8 * 4 + 6 + 2


def test_pointwise_kernels_compile_to_hopper_cubins():
    assert compile_for_hopper(POINTWISE).count("ok ") == 6


def test_the_loss_chunks_kernel_compiles_on_bfloat16_logits_to_a_hopper_cubin():
    assert compile_for_hopper(CROSS_ENTROPY).count("ok ") == 1
