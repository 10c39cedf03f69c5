"""Generated kernels compile for Hopper (sm_90) through Triton's real compiler, down to a cubin,
with no GPU present: this catches what the interpreter forgives (types, constexpr-specialized
scalars, unsupported ops). Runs in a child process, since this one imports Triton interpreted."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import itertools, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from seqcompile.codegen import kernel_function
    from seqcompile.ops import norm

    FLOAT_POINTERS = {"MEAN", "RSTD", "PARTIAL"}

    def signature(fn, data):
        sig = {}
        for name in fn.arg_names:
            if name.startswith("BLOCK_"):
                sig[name] = "constexpr"
            elif name in ("N", "M", "G", "stream"):
                sig[name] = "i32"
            elif name in ("eps", "p"):
                sig[name] = "fp32"
            elif name == "SEED":
                sig[name] = "*i64"
            else:
                sig[name] = "*fp32" if name in FLOAT_POINTERS else data
        return sig

    def compile(spec, data, constexprs):
        fn = kernel_function(spec)
        sig = signature(fn, data)
        constexprs = {k: v for k, v in constexprs.items() if k in sig}
        for k in constexprs:
            sig[k] = "constexpr"
        source = ASTSource(fn, sig, constexprs=constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert kernel.asm["cubin"], spec
        print("ok", spec.template, spec.describe(), data, sorted(constexprs))

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


def test_every_template_variant_compiles_to_a_hopper_cubin():
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SEQFAST_INTERPRET")
    }
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("ok ") == 11, result.stdout
