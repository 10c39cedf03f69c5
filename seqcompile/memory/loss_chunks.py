"""The chunk of the linear + loss operators (`seqfast::linear_cross_entropy`,
`seqfast::linear_row_loss`) where the `loss_chunk` option leaves it to seqcompile, on a GPU.

Each chunk runs three matmuls. A chunk too short leaves the GPU idle in the two whose output is
as tall as the chunk, too long keeps more logits live. The chunk taken is the one that splits the
rows evenly into as many chunks as can each give every matmul two waves of output tiles
(`linear_head.filling_chunk`), and no longer than the step's planned peak allows: its workspace
(one chunk of logits) may not raise the peak above what the default chunk gives (an eighth of
the rows, `linear_head.default_chunk`). Where it would, the longest chunk that keeps the peak is
taken. On a CPU, and at symbolic sizes (one chunk of every row), the default stays.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import GraphModule, Node

from seqcompile.ops import linear_head as head
from seqcompile.ops.fused_op import Call
from seqcompile.run import runtime


def choose(forward: GraphModule, peak: Callable[[], int]) -> list[str]:
    """Set the chunk of each linear + loss call of `forward` that asks for the default one;
    `peak()` is the step's planned peak in bytes as the graphs stand. One note per call."""
    notes = []
    for node in forward.graph.nodes:
        if node.op != "call_function" or node.target not in head.CHUNKED:
            continue
        note = _choose_one(node, peak)
        if note is not None:
            notes.append(f"{node.name}: {note}")
    return notes


def _choose_one(node: Node, peak: Callable[[], int]) -> str | None:
    call = Call.of(node)
    hidden = call.value("hidden")
    processors = runtime.multiprocessors(hidden.device)
    if call["chunk"] != 0 or processors is None or not isinstance(hidden.shape[0], int):
        return None
    rows, default = hidden.shape[0], head.chunk_rows(call)
    filling = head.even_chunk(rows, head.filling_chunk(call, processors))
    why = f"two waves of {head.TILE}x{head.TILE} tiles on {processors} multiprocessors"
    if filling <= default:
        _set_chunk(node, filling)
        return f"chunks of {filling} rows: {why}"
    allowed = peak()
    _set_chunk(node, filling)
    if peak() <= allowed:
        return f"chunks of {filling} rows: {why}"
    longest = _longest_within(node, default, filling, allowed, peak)
    _set_chunk(node, longest)
    return (
        f"chunks of {longest} rows: {filling} would give {why}, but raise the step's planned peak"
    )


def _longest_within(
    node: Node, shortest: int, longest: int, allowed: int, peak: Callable[[], int]
) -> int:
    """The longest chunk below `longest`, `shortest` or a multiple of `TILE` rows above it, whose
    step peak stays within `allowed` (`shortest` does: the peak was measured with it)."""
    low, high = -(-shortest // head.TILE), (longest - 1) // head.TILE  # in tiles of rows
    best = shortest
    while low <= high:
        middle = (low + high) // 2
        _set_chunk(node, max(middle * head.TILE, shortest))
        if peak() <= allowed:
            best, low = max(middle * head.TILE, shortest), middle + 1
        else:
            high = middle - 1
    return best


def _set_chunk(node: Node, chunk: int) -> None:
    node.args, node.kwargs = Call.of(node).arguments(chunk=chunk), {}
