"""What a call of `seqfast::attention` costs and visits: FLOPs over the scores the kernels visit,
the key blocks causal and window let them skip, the backward's workspace, and what the report
says of a call's masks."""

from __future__ import annotations

import math

import torch

from seqcompile.fx.nodes import concrete
from seqcompile.ops.attention import block_lists, configs, score_mods
from seqcompile.ops.attention.kernels import ONE_LAUNCH, backward_variants
from seqcompile.ops.fused_op import Call

Tensor = torch.Tensor


def _products(call: Call, q_dims: int, v_dims: int) -> int:
    """FLOPs of products over the scores the kernels visit, `q_dims` of them as long as q's head
    dim and `v_dims` as v's (those causal and window hide are not counted)."""
    q, k, v = (call.value(name) for name in "qkv")
    lq, lk = concrete(q.shape[-2]), concrete(k.shape[-2])
    scores = (
        concrete(q.numel())
        // concrete(q.shape[-1])
        // max(lq, 1)
        * visible_pairs(lq, lk, call["causal"], call["window"])
    )
    return 2 * scores * concrete(q_dims * q.shape[-1] + v_dims * v.shape[-1])


def visible_pairs(lq: int, lk: int, causal: bool, window: int) -> int:
    """How many (query, key) pairs `causal` and `window` leave, top-left aligned: those with
    key - query <= 0 (all, without causal) less those with key - query <= -window."""
    kept = _pairs_below(lq, lk, 0) if causal else lq * lk
    return kept - (_pairs_below(lq, lk, -window) if window > 0 else 0)


def _pairs_below(lq: int, lk: int, diagonal: int) -> int:
    """Pairs (i, j) of an Lq x Lk grid with j - i <= `diagonal`: row i has
    clamp(i + diagonal + 1, 0, Lk) of them, 0 up to row `start`, Lk from row `full` on."""
    c = diagonal + 1
    start, full = min(max(-c, 0), lq), min(max(lk - c, 0), lq)
    return (full - start) * c + (start + full - 1) * (full - start) // 2 + (lq - full) * lk


def forward_flops(call: Call) -> int:
    """q @ k^T and probs @ v."""
    return _products(call, 1, 1)


def backward_flops(call: Call) -> int:
    """q @ k^T again, grad_out @ v^T, probs^T @ grad_out, dscores @ k and dscores^T @ q."""
    return _products(call, 3, 2)


def describe(call: Call) -> str | None:
    """The masks a call computes from positions or reads, and the key blocks its forward visits
    at the traced sizes with this device's tiles (None for plain attention): those a mask read
    from a tensor hides are found on each call, so the count is what positions alone hide."""
    q, k = call.value("q"), call.value("k")
    causal = "causal" if call["prefix"] is None else "causal after a prefix (its keys seen by all)"
    kinds = ([causal] if call["causal"] else []) + (
        [f"sliding window {call['window']}"] if call["window"] else []
    )
    if call["score_mod"]:
        kinds.append(f"scores modified as {score_mods.lookup(call['score_mod']).description}")
    if call["mask"] is not None:
        kinds.append(f"reads a mask {_shape(call.value('mask'))}{_lists(call, 'mask')}")
    if call["bias"] is not None:
        kinds.append(f"reads a bias {_shape(call.value('bias'))}{_lists(call, 'bias')}")
    if call["rel_bias"] is not None:
        kinds.append(f"reads a bias by key - query position {_shape(call.value('rel_bias'))}")
    if call["sink"] is not None:
        kinds.append(f"adds a sink logit per query {_shape(call.value('sink'))} to the softmax")
    if call["doc_q"] is not None:
        kinds.append(
            "compares document ids (skipping blocks where no query shares a key's document,"
            " which depends on the ids)"
        )
    if not kinds:
        return None
    tiles = forward_tiles(call)
    lq, lk = concrete(q.shape[-2]), concrete(k.shape[-2])
    visited, total = key_blocks(lq, lk, call["causal"], call["window"], **tiles)
    tile = f"{tiles['BLOCK_M']}x{tiles['BLOCK_N']}"
    blocks = f"the forward visits {visited} of {total} {tile} blocks per head"
    if call["prefix"] is not None:
        blocks += " besides the prefix's (as many as its lengths reach past the diagonal)"
    if block_lists.skip_empty(call):
        blocks += f", less those the {'bias' if block_lists.of_bias(call) else 'mask'} hides whole"
    return f"{', '.join(kinds)}; {blocks}{_at_compile(call)}"


def forward_tiles(call: Call) -> dict[str, int]:
    """The forward kernel's default tiles for the call on this device."""
    q = call.value("q")
    space = configs.space(
        "attention_fwd", concrete(q.shape[-1]), q.dtype, q.device.type, call["p"] > 0
    )
    return dict(space[0].blocks)


LISTED = "seqfast_block_lists"
"""The key, in a call node's `meta["custom"]` (which AOTAutograd carries to the graphs it makes),
of what the forward's block lists hold at compile time (`listed_blocks`), where the tensor they
list is computed from the model's parameters and buffers alone."""


def listed_blocks(call: Call, value: Tensor) -> dict[str, int | bool]:
    """What the forward's block lists of `value` (the call's mask, or the bias it lists; concrete,
    on the CPU) hold at the default tiles, as `attention_blocks` makes them: over the planes of
    its own batch and head dimensions, the blocks visited whole (`full`), on the causal triangle
    (`shaped`) and read (`partial`), and whether it is the causal triangle itself."""
    q, k = call.value("q"), call.value("k")
    lq, lk = concrete(q.shape[-2]), concrete(k.shape[-2])
    tiles = forward_tiles(call)
    rows, cols = tiles["BLOCK_M"], tiles["BLOCK_N"]
    leading = value.shape[:-2]
    planes = value.expand(*leading, lq, lk).reshape(math.prod(leading), lq, lk)
    if block_lists.of_bias(call):
        allowed, unchanged = planes != -math.inf, planes == 0
    else:
        allowed = unchanged = planes.bool()
    i, j = torch.arange(lq)[:, None], torch.arange(lk)
    triangle = j <= i
    seen = torch.ones(lq, lk, dtype=torch.bool)
    if call["causal"]:
        seen = seen & triangle
    if call["window"]:
        seen = seen & (i - j < call["window"])
    shape = (len(planes), -(-lq // rows), rows, -(-lk // cols), cols)

    def blocks(t: Tensor, fill: bool) -> Tensor:  # (plane, row block, rows, column block, cols)
        t = t.expand(len(planes), lq, lk)
        return torch.nn.functional.pad(t, (0, -lk % cols, 0, -lq % rows), value=fill).view(shape)

    outside = blocks(torch.zeros(lq, lk, dtype=torch.bool), True)
    whole = ~outside.any(4).any(2)
    full = whole & blocks(seen & unchanged, True).all(4).all(2)
    read = seen & allowed if block_lists.skip_empty(call) else seen
    visited = blocks(read, False).any(4).any(2) & ~full
    on_triangle = (allowed == triangle) & (unchanged == triangle)
    shaped = visited & (blocks(on_triangle, True) | outside).all(4).all(2)
    return {
        "full": int(full.sum()),
        "shaped": int(shaped.sum()),
        "partial": int((visited & ~shaped).sum()),
        "planes": len(planes),
        "triangle": bool(on_triangle.all()),
    }


def _at_compile(call: Call) -> str:
    """What the forward's block lists hold at compile time, where it is known (`LISTED`)."""
    node = call.node
    listed = node.meta.get("custom", {}).get(LISTED) if node is not None else None
    if listed is None:
        return ""
    holds = " it is the causal triangle, and" if listed["triangle"] else ""
    where = "per head" if listed["planes"] == 1 else f"over its {listed['planes']} planes"
    visited = listed["full"] + listed["shaped"] + listed["partial"]
    return (
        f"; at compile time (its value computed from the model's parameters and buffers){holds}"
        f" the forward visits {visited} blocks {where}: {listed['full']} whole,"
        f" {listed['shaped']} computing the triangle, {listed['partial']} reading it"
    )


def _lists(call: Call, name: str) -> str:
    """How the kernels read the mask or the bias (`name`) by its block lists, where they do."""
    if not block_lists.walked(call) or (name == "bias") != block_lists.of_bias(call):
        return ""
    hides, some = ("where it is -inf", "is not 0") if name == "bias" else ("it hides", "hides some")
    skipped = f"skip the blocks {hides} whole, " if block_lists.skip_empty(call) else ""
    return (
        f" by block lists made on each call (the kernels {skipped}compute the lower triangle"
        f" where it holds one and read it where it {some})"
    )


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(concrete(n) for n in t.shape)


def key_blocks(
    lq: int, lk: int, causal: bool, window: int, BLOCK_M: int, BLOCK_N: int, **_: int
) -> tuple[int, int]:
    """Key blocks the forward kernel visits over all query blocks of one head, and all there
    are, with the bounds its loops take from `causal` and `window`."""
    visited = 0
    for start_m in range(0, lq, BLOCK_M):
        end = min(lk, start_m + BLOCK_M) if causal else lk
        start = max(start_m - window + 1, 0) // BLOCK_N * BLOCK_N if window else 0
        visited += max(0, -(-(end - start) // BLOCK_N))
    return visited, -(-lq // BLOCK_M) * -(-lk // BLOCK_N)


def backward_workspace(call: Call) -> int:
    """Each query row's delta, the float32 bias gradient at the scores' full size before it is
    summed to the bias's shape (when the bias needs one), the relative bias's per (batch,
    head) (when it needs one), and dq's float32 sum where the default backward adds it in one
    launch to a q of another dtype."""
    q, k = call.value("q"), call.value("k")
    lq, lk = concrete(q.shape[-2]), concrete(k.shape[-2])
    rows = concrete(q.numel()) // concrete(q.shape[-1])
    bias = rows * lk if call["bias_grad"] else 0
    relative = rows // max(lq, 1) * (lq + lk - 1) if call["rel_grad"] else 0
    one_launch = backward_variants(q)[0] == ONE_LAUNCH and q.dtype != torch.float32
    dq_sum = concrete(q.numel()) if one_launch else 0
    return 4 * (rows + bias + relative + dq_sum)
