"""The device's measured ceilings, which the kernel tables divide by: device-to-device copy
bandwidth (bytes read + bytes written) and the rate of a dense bf16 matrix product through torch
(cuBLAS), both on random data, each checked before it is timed, with the device's facts.

    python -m benchmarks.ceilings [--quick] [--output benchmarks/results/<device>.md]

The copy must equal its source bit for bit; the product must match a float64 product of a block of
rows (relative Frobenius error under 1e-2 in bf16, 1e-3 on CPU's float32). Buffers are several times
the L2 (50 MB on an H100, 60 MB on an H200); `timed_ms` is `triton.testing.do_bench`'s median.
"""

from __future__ import annotations

import torch

from benchmarks.common import device_name, emit, header, progress, standard_setup, table, timed_ms


def copy_row(mib: int, device: torch.device) -> list[object]:
    n = mib * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.full_like(src, float("nan"))
    dst.copy_(src)
    if not torch.equal(dst, src):
        raise AssertionError(f"copy of {mib} MiB: the destination differs from the source")
    ms = timed_ms(lambda: dst.copy_(src), device)
    moved = 2 * n * 4
    return ["copy (fp32 buffer)", f"{mib} MiB", ms, moved / (ms * 1e-3) / 1e9, "GB/s", "equal"]


def matmul_row(n: int, dtype: torch.dtype, device: torch.device) -> list[object]:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    c = a @ b
    rows = min(n, 256)
    reference = a[:rows].double() @ b.double()
    error = ((c[:rows].double() - reference).norm() / reference.norm()).item()
    limit = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-3
    if not error < limit:  # NaN fails too
        raise AssertionError(f"{n}^3 {dtype} matmul: relative error {error:.2e} over {limit:g}")
    ms = timed_ms(lambda: a @ b, device)
    name = f"matmul ({str(dtype).removeprefix('torch.')})"
    return [name, f"{n}^3", ms, 2 * n**3 / (ms * 1e-3) / 1e12, "TFLOP/s", f"rel err {error:.1e}"]


def facts(device: torch.device) -> str:
    if device.type != "cuda":
        return f"Device: {device_name(device)}."
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) / 2**20
    return (
        f"Device: {props.name}, compute capability {props.major}.{props.minor},"
        f" {props.multi_processor_count} multiprocessors, L2 {l2:.0f} MiB,"
        f" {props.total_memory / 2**30:.1f} GiB; CUDA {torch.version.cuda}."
    )


def main() -> None:
    args, device, dtype = standard_setup(__doc__)
    copies = [8] if args.quick else [256, 1024, 4096]
    products = [256] if args.quick else [4096, 8192]
    rows = []
    for mib in copies:
        rows.append(copy_row(mib, device))
        progress(rows[-1])
    for n in products:
        rows.append(matmul_row(n, dtype, device))
        progress(rows[-1])
    lines = header("Device ceilings: copy bandwidth and matmul rate", device, "benchmarks.ceilings")
    lines += [facts(device), ""]
    lines += table(["measure", "size", "ms", "rate", "unit", "check"], rows)
    emit(lines, args.output)


if __name__ == "__main__":
    main()
