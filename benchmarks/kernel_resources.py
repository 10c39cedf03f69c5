"""Static resources of the attention and norm kernels on Hopper, without a GPU: each kernel compiled
for sm_90 by Triton's own compiler, as a CUDA launch would specialize it (pointers and strides
16-byte aligned, unit strides constant), at bf16, fp16 and fp32, head dims 64, 128 and 256, norm
widths 768 to 8192, at every configuration of its launch space (`*` marks the default):
registers per thread and spilled bytes (`ptxas -v`), shared memory, the CTAs and warps that fit on
one SM, and in the main loop (the one with the most matrix products, from `nvdisasm`; among
equals the shortest, which is the loop over whole blocks where a kernel splits off its edge blocks)
the instructions per iteration, how many are wgmma or mma.sync, and (attention) the instructions all
threads issue per score, there and in the edge loop (among those equals the longest: the blocks of
the diagonal and the last keys, or those a mask read from a tensor hides in part; the blocks it
hides whole cost nothing, being skipped). A second table gives what dropout costs each attention
kernel: its main loop's instructions per score with dropout over the same case's without; a third
what the backward costs in one launch and in two.

    python -m benchmarks.kernel_resources [--quick] [--defaults] [--head-dims 64,128,256]
        [--output FILE]

`--defaults` compiles the default configurations only; `--quick` also only head dim 64 and width
768. Run it with `TRITON_INTERPRET` unset.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.common import brief, emit, header, progress, table
from seqcompile.codegen import KernelSpec, kernel_function
from seqcompile.codegen.tuning import Config
from seqcompile.ops.add_norm import kernels as norm
from seqcompile.ops.attention import configs as attention_configs
from seqcompile.ops.attention import kernels as attention

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 128, 256)
WIDTHS = (768, 1024, 2048, 4096, 8192)
FLOAT32_POINTERS = {"ROW_MAX", "LOG_SUM", "DELTA", "MEAN", "RSTD", "PARTIAL"}
UNIT = {"stride_qd", "stride_kd", "stride_vd", "stride_mask_n", "stride_bias_n", "GROUP"}
"""Integers a contiguous launch passes as 1, which Triton turns into constants."""
SCALARS = {"scale": "fp32", "eps": "fp32", "p": "fp32", "masked_value": "fp32"}
SM90 = dict(registers=65536, shared=232448, warps=64, ctas=32, reserved_shared=1024)
"""Per-SM limits of sm_90 (H100, H200)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel at one dtype, size and configuration."""

    group: str
    spec: KernelSpec
    dtype: str
    size: int
    config: Config
    default: bool
    constants: tuple[tuple[str, object], ...] = ()


@dataclasses.dataclass(frozen=True)
class Resources:
    registers: int
    spilled: int
    shared: int
    warps: int
    ctas: int
    loop: int
    edge_loop: int
    wgmma: int
    mma: int


def attention_cases(dims, defaults_only) -> Iterator[Case]:
    variants = {
        "plain": {},
        "causal": {"causal": True},
        "causal, dropout": {"causal": True, "dropout": True},
        "mask by block lists": {"mask": True, "blocks": True},
        "mask by block lists, dropout": {"mask": True, "blocks": True, "dropout": True},
        "bias": {"bias": True},
        "bias by block lists": {"bias": True, "blocks": True},
        "bias by block lists, its gradient": {"bias": True, "blocks": True, "bias_grad": True},
    }
    for variant, on in variants.items():
        names = ("bias", "mask", "blocks", "dropout", "causal", "window", "documents", "relative")
        names += ("prefix",)
        flags = {name: on.get(name, False) for name in names} | {"score_mod": ()}
        grad = on.get("bias_grad", False)
        specs = [] if grad else [attention.forward_spec(**flags)]  # (the forward takes no grad)
        for one_launch in (False, True):
            specs += attention.backward_specs(
                bias_grad=grad, rel_grad=False, one_launch=one_launch, **flags
            )
        specs = [spec for spec in specs if spec != attention.DELTA]
        for spec in specs:
            # (a bias in float32 is left out: dk and dv's kernel spills 20 bytes at head dim 64)
            for dtype in [t for t in DTYPES if t != "fp32" or not flags["bias"]]:
                for d in dims:
                    dropout = flags["dropout"]
                    space = attention_configs.space(spec.name, d, TORCH[dtype], "cuda", dropout)
                    precision = "tf32"  # what the launcher passes unless TF32 is off
                    for config in space[:1] if defaults_only else space:
                        yield Case(
                            f"attention, {variant}", spec, dtype, d, config, config == space[0],
                            (("HEAD_DIM", d), ("DOT_PRECISION", precision)),
                        )  # fmt: skip


def norm_cases(widths, defaults_only) -> Iterator[Case]:
    for rms in (False, True):
        flags = dict(branch_bias=True, dropout=True, weight=True, bias=not rms, rms=rms)
        forward = norm.forward_spec(residual=True, **flags)
        (backward, column_sum) = norm.backward_specs(sum_grad=True, residual_grad=True, **flags)
        group = "rms_norm" if rms else "layer_norm"
        for dtype in DTYPES:
            for n in widths:
                for spec, space in (
                    (forward, norm.row_configs(n, "cuda")),
                    (backward, norm.row_configs(n, "cuda")),
                    (column_sum, norm.column_configs(n, 3 - rms, "cuda")),
                ):
                    sums = (("K", 3 - rms),) if spec is column_sum else ()
                    for config in space[:1] if defaults_only else space:
                        yield Case(
                            f"{group}, residual, dropout", spec, dtype, n, config,
                            config == space[0], sums,
                        )  # fmt: skip


def signature(case: Case) -> tuple[dict[str, str], dict[str, object], dict]:
    """Triton types, constants and 16-byte alignment hints of the case's arguments."""
    fn = kernel_function(case.spec).jit
    constants = dict(case.config.blocks) | dict(case.constants)
    constants |= {name: 1 for name in UNIT if name in fn.arg_names}
    types = {}
    for name in fn.arg_names:
        if (
            name in constants
            or name.startswith("BLOCK_")
            or name.isupper()
            and name.endswith("_DIM")
        ):
            types[name] = "constexpr"
        elif name in SCALARS:
            types[name] = SCALARS[name]
        elif name.startswith("stride_") or name in ("H", "LQ", "LK", "N", "M", "G", "R", "stream"):
            types[name] = "i32"
        elif name == "SEED":
            types[name] = "*i64"
        elif name == "MASK":
            types[name] = "*i1"
        elif name in ("MASK_LISTS", "MASK_COUNTS"):
            types[name] = "*i32"
        elif name in FLOAT32_POINTERS or name == "DQ" and case.spec.name.endswith(":with_dq"):
            types[name] = "*fp32"
        else:
            types[name] = DTYPES[case.dtype]
    aligned = [
        name
        for name, kind in types.items()
        if kind.startswith("*")
        or (kind == "i32" and name not in ("H", "LQ", "LK", "M", "G", "stream"))
    ]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return types, {k: v for k, v in constants.items() if k in fn.arg_names}, attrs


def compile_case(case: Case, folder: Path) -> Resources:
    types, constants, attrs = signature(case)
    source = ASTSource(kernel_function(case.spec).jit, types, constexprs=constants, attrs=attrs)
    options = {k: v for k, v in case.config.launch_options().items() if k.startswith("num_")}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx, cubin = folder / "kernel.ptx", folder / "kernel.cubin"
    ptx.write_text(kernel.asm["ptx"])
    cubin.write_bytes(kernel.asm["cubin"])
    verbose = _tool("ptxas", "-v", "--gpu-name", "sm_90a", "-o", os.devnull, str(ptx))
    registers = int(re.search(r"Used (\d+) registers", verbose).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", verbose).group(1))
    (loop, wgmma, mma), edge_loop = main_loops(_tool("nvdisasm", "-c", str(cubin)))
    warps = kernel.metadata.num_warps
    shared = kernel.metadata.shared
    ctas = resident_ctas(registers, warps, shared)
    return Resources(registers, spilled, shared, warps, ctas, loop, edge_loop, wgmma, mma)


def resident_ctas(registers: int, warps: int, shared: int) -> int:
    """CTAs of this kernel that fit on one sm_90 SM at once (registers are allocated per warp in
    units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90["registers"] // (per_warp * warps)
    by_shared = SM90["shared"] // (shared + SM90["reserved_shared"])
    return min(by_registers, by_shared, SM90["warps"] // warps, SM90["ctas"])


def main_loops(sass: str) -> tuple[tuple[int, int, int], int]:
    """Instructions in the loop with the most matrix products, the shortest among equals (backward
    branches of the listing, innermost taken as is), and how many of them are wgmma (HGMMA) and
    mma.sync (HMMA); and the instructions of the longest among those equals. A kernel without a
    loop counts its whole listing."""
    lines = sass.splitlines()
    labels = {
        m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\.L_x_\d+):", line))
    }
    instructions = [i for i, line in enumerate(lines) if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    loops = [(0, len(lines))]
    for i in instructions:
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", lines[i])
        if target and labels.get(target.group(1), i) < i - 1:  # not a branch to itself
            loops.append((labels[target.group(1)], i + 1))

    def counts(span):
        body = [lines[i] for i in instructions if span[0] <= i < span[1]]
        return (
            len(body),
            sum("HGMMA" in line for line in body),
            sum(" HMMA" in line for line in body),
        )

    found = [counts(span) for span in loops[1:]] or [counts(loops[0])]
    main = max(found, key=lambda c: (c[1] + c[2], -c[0]))
    edge = max(c[0] for c in found if c[1] + c[2] == main[1] + main[2])
    return main, edge


def per_score(config: Config, found: Resources, loop: int) -> float | str:
    """Instructions all threads issue per score in an iteration of an attention loop of `loop`
    instructions (a BLOCK_M x BLOCK_N tile): comparable across tiles and warps."""
    blocks = dict(config.blocks)
    if "BLOCK_M" not in blocks:
        return "-"
    return loop * found.warps * 32 / (blocks["BLOCK_M"] * blocks["BLOCK_N"])


def dropout_costs(rows: list[list[object]]) -> list[str]:
    """What dropout costs each attention kernel at its default configuration: main-loop
    instructions per score with dropout over the same case without (the rows of `main`)."""
    defaults = {
        (row[0], row[1], row[2], row[3]): row
        for row in rows
        if str(row[4]).startswith("* ") and isinstance(row[13], float)
    }
    found = []
    for (group, kernel, dtype, size), row in defaults.items():
        without = defaults.get((group.removesuffix(", dropout"), kernel, dtype, size))
        if not group.endswith(", dropout") or without is None:
            continue
        same = "" if without[4] == row[4] else f"without: {str(without[4])[2:]}"
        found.append(
            [group, kernel, dtype, size, without[13], row[13], row[13] / without[13], same]
        )
    if not found:
        return []
    columns = ["kernels", "kernel", "dtype", "size", "per score without dropout"]
    columns += ["with dropout", "with / without", "other configuration"]
    return [
        "Dropout's cost: main-loop instructions per score with dropout against the same kernels"
        " without it, at the default configurations (the last column names the one without"
        " dropout where the two differ).",
        "",
        *table(columns, found),
    ]


def backward_costs(rows: list[list[object]]) -> list[str]:
    """What the backward costs each attention case at the default configurations, in one launch
    (dk and dv's kernel adding dq) and in two (dk and dv's, then dq's): main-loop instructions
    per score (the rows of `main`)."""
    defaults = {
        (row[0], row[1], row[2], row[3]): row[13]
        for row in rows
        if str(row[4]).startswith("* ") and isinstance(row[13], float)
    }
    found = []
    for (group, kernel, dtype, size), one in defaults.items():
        dkdv = defaults.get((group, "attention_bwd_dkdv", dtype, size))
        dq = defaults.get((group, "attention_bwd_dq", dtype, size))
        if kernel != "attention_bwd_dkdv:with_dq" or dkdv is None or dq is None:
            continue
        first = attention_configs.one_launch_first(size, TORCH[dtype])
        found.append(
            [group, dtype, size, dkdv, dq, one, one / (dkdv + dq), "one" if first else "two"]
        )
    if not found:
        return []
    columns = ["kernels", "dtype", "size", "dk, dv", "dq", "one launch", "one / two"]
    columns += ["default launches"]
    return [
        "The backward's cost: main-loop instructions per score of dk and dv's kernel and dq's"
        " (two launches) and of dk and dv's adding dq (one launch), at their default"
        " configurations.",
        "",
        *table(columns, found),
    ]


def _tool(name: str, *args: str) -> str:
    done = subprocess.run([str(BIN / name), *args], capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="head dim 64 and width 768 only")
    parser.add_argument("--defaults", action="store_true", help="default configurations only")
    parser.add_argument(
        "--head-dims", default=",".join(map(str, HEAD_DIMS)), help="attention head dims, by commas"
    )
    parser.add_argument("--output", help="append the markdown table to this file")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("benchmarks.kernel_resources compiles: run it with TRITON_INTERPRET unset")
    defaults = args.defaults or args.quick
    cases = [
        *attention_cases(
            [64] if args.quick else [int(d) for d in args.head_dims.split(",")], defaults
        ),
        *norm_cases(WIDTHS[:1] if args.quick else WIDTHS, defaults),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for case in cases:
            config = ("* " if case.default else "") + case.config.describe()
            cells = [case.group, case.spec.name, case.dtype, case.size, config]
            try:
                found = compile_case(case, Path(folder))
                cells += [found.registers, found.spilled, found.shared, found.ctas]
                cells += [found.ctas * found.warps, found.loop, found.wgmma, found.mma]
                cells += [per_score(case.config, found, n) for n in (found.loop, found.edge_loop)]
            except Exception as error:  # reported in its row, the run goes on  # noqa: BLE001
                cells += [f"FAILED: {brief(error, 80)}", *["-"] * 9]
            rows.append(cells)
            progress(cells)
    lines = header(
        "Kernel resources on sm_90, compiled without a GPU",
        torch.device("cpu"),
        "benchmarks.kernel_resources",
    )
    lines += [
        "Compiled by Triton's compiler for sm_90 (ptxas from Triton's own bundle); registers and"
        " spill stores from `ptxas -v`, shared memory from Triton's metadata, CTAs and warps per SM"
        " from sm_90's limits (64 Ki registers, 227 KiB shared, 64 warps); the loop columns count"
        " SASS instructions of the main loop (`nvdisasm`). Size: head dim, or norm width.",
        "",
    ]
    columns = ["kernels", "kernel", "dtype", "size", "config", "registers", "spilled bytes"]
    columns += ["shared bytes", "CTAs / SM", "warps / SM", "loop instructions", "wgmma", "mma.sync"]
    columns += ["per score", "per score, edge blocks"]
    lines += table(columns, rows)
    lines += ["", *dropout_costs(rows), "", *backward_costs(rows)]
    emit(lines, args.output)
    failed = sum(str(row[5]).startswith("FAILED") for row in rows)
    if failed:
        raise SystemExit(f"benchmarks.kernel_resources: {failed} compiles failed")


if __name__ == "__main__":
    main()
