"""Reading an attention into a site: `F.scaled_dot_product_attention` from its arguments, attention
written out with matmul and softmax by walking from the softmax to both products.

The written-out form is read from the softmax outward, as independent features rather than
enumerated variants: below the softmax, casts and dropout up to the `probs @ v` matmul; above it,
the scores' chain back to `q @ k^T`, where each link is a scale (multiply or divide by a constant),
an additive float bias, a boolean mask (`masked_fill`, `where` with a constant), an element-wise
modification with constants, or a cast; straight on the product, a factor that is a tensor
constant along the keys or the queries (a learned temperature), which q or k takes instead; on
the matmul's operands, a constant scale on q or k. Masks are split into factors
(`mask_factors.py`), and those the kernel computes from positions (causal, a window, a prefix,
from comparisons of `arange`s or `tril`/`triu` of ones; document ids) are not read at all
(`index_masks.py`); a bias by key - query is read per diagonal (`relative_bias.py`). `bmm`,
`baddbmm` and `einsum` arrive here as `matmul` (see normalize.py). Reshapes that split or merge
batch dimensions on either side of the softmax (heads flattened into the batch for `bmm`, split
back out for a (B, 1, Lq, Lk) mask) are followed too: the fused op works in the softmax's batch
dimensions, and q, k, v, the output and each bias or mask are reshaped into them.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import arg, describe, is_call, only_user, tensor_val
from seqcompile.ops.attention.layout import broadcasts_to
from seqcompile.patterns.attention.fold import (
    apply_links,
    read_mask,
    take_diagonal,
    take_documents,
    take_relative,
)
from seqcompile.patterns.attention.links import (
    batch_reshape,
    bias_links,
    link,
    same_batch,
    scale_factor,
)
from seqcompile.patterns.attention.masks import CASTS
from seqcompile.patterns.attention.readings import (
    Cast,
    Factor,
    Product,
    Reading,
    Scale,
    Site,
    Sum,
)
from seqcompile.patterns.attention.score_mod import register_chain
from seqcompile.patterns.engine import Reject

aten = torch.ops.aten


def read(node: Node) -> Site | Reject | None:
    """The attention whose output `node` is (an SDPA call, or a softmax written out), read."""
    site = _read_sdpa(node)
    if site is None:
        site = _read_written_out(node)
    if site is None or isinstance(site, Reject):
        return site
    take_documents(site)
    take_relative(site)
    return site


def _read_sdpa(node: Node) -> Site | Reject | None:
    if not is_call(node, aten.scaled_dot_product_attention.default):
        return None
    q, k, v = node.args[:3]
    site = Site(out=node, q=q, k=k, v=v)
    site.p = float(arg(node, 4, "dropout_p", 0.0))
    site.causal = bool(arg(node, 5, "is_causal", False))
    scale = node.kwargs.get("scale")
    head_dim = tensor_val(q).shape[-1]
    if scale is None:
        if not isinstance(head_dim, int):
            return Reject("head dim {} is dynamic; the default scale needs it fixed", head_dim)
        scale = 1.0 / math.sqrt(head_dim)
    site.scale = float(scale)
    attn_mask = arg(node, 3, "attn_mask")
    mask_val = tensor_val(attn_mask)
    if mask_val is None:
        return site
    if mask_val.dtype == torch.bool:
        scores = (tensor_val(q).shape[-2], tensor_val(k).shape[-2])
        diagonal, rest = read_mask(attn_mask, True, scores)
        site.keep += rest + take_diagonal(site, diagonal)
        site.claims += diagonal.claims
        site.masked_value = -math.inf
        return site
    # added to the scaled scores: its terms read as a written-out bias's
    lk = tensor_val(k).shape[-2]
    scores = torch.Size((*tensor_val(node).shape[:-1], lk))
    return apply_links(site, bias_links(attn_mask, 1.0, scores), scores, node)


def _walk_scores(node: Node, links: list[Reading], nodes: list[Node]) -> Node | Reject | None:
    """From the softmax's input up to the `q @ k^T` matmul, collecting links (latest first)."""
    if is_call(node, aten.matmul.default):
        return node
    step = link(node)
    if step is None:
        operands = ", ".join(describe(a) for a in node.args) if isinstance(node, Node) else ""
        what = f"{node.target}({operands})" if isinstance(node, Node) else repr(node)
        return Reject("the scores pass through {}, which the kernel does not apply", what)
    if isinstance(step, Reject):
        return step
    reading, operands = step
    if isinstance(reading, Product):
        return _walk_factor(node, operands, links, nodes)
    if isinstance(reading, Sum):
        return _walk_sum(node, reading, operands, links, nodes)
    links.append(reading)
    nodes.append(node)
    return _walk_scores(operands[0], links, nodes)


def _walk_sum(
    node: Node, step: Sum, operands: list[Node], links: list[Reading], nodes: list[Node]
) -> Node | Reject | None:
    """`scores + bias`, `bias + scores` or `scores - bias`: the walk on from the scores."""
    orders = [operands, operands[::-1]] if step.sign > 0 else [operands]
    refused, depth = None, -1
    for above, bias in orders:
        found = _walk_scores(above, sub_links := [], sub_nodes := [])
        bias_val = tensor_val(bias)
        if isinstance(found, Node) and bias_val is not None and not bias_val.is_complex():
            links += [*bias_links(bias, step.sign, tensor_val(found).shape), *sub_links]
            nodes += [node, *sub_nodes]
            return found
        if isinstance(found, Reject) and len(sub_nodes) > depth:
            refused, depth = found, len(sub_nodes)  # the walk that got furthest tells why
    return refused


def _walk_factor(
    node: Node, operands: list[Node], links: list[Reading], nodes: list[Node]
) -> Node | Reject | None:
    """`scores * t` (or `scores / t`) with t a tensor constant along the keys (a learned
    temperature per head or per query, Swin V2's logit scale) or along the queries, straight on
    the product (constant scales, casts and other such factors between): the kernel reads q * t
    (or k * t) instead."""
    divides = node.target is aten.div.Tensor
    refused = None
    for above, tensor in [operands] if divides else [operands, operands[::-1]]:
        found = _walk_scores(above, sub_links := [], sub_nodes := [])
        if not isinstance(found, Node):
            refused = refused or found
            continue
        side = _factor_side(tensor_val(tensor).shape, tensor_val(found).shape)
        refused = _factor_refused(found, tensor, side, divides, sub_links)
        if refused is None:
            links += [Factor(node, tensor, side, divides), *sub_links]
            nodes += [node, *sub_nodes]
            return found
    return refused


def _factor_refused(
    found: Node, tensor: Node, side: str | None, divides: bool, sub_links: list[Reading]
) -> Reject | None:
    """Why q or k cannot take the tensor `found` (the product) is multiplied or divided by."""
    verb = "divided" if divides else "multiplied"
    scores, shape = tensor_val(found).shape, tensor_val(tensor).shape
    between = [x for x in sub_links if not isinstance(x, Scale | Cast | Factor)]
    if side is None:
        what = "varies along both queries and keys" if broadcasts_to(shape, scores) else (
            f"does not broadcast to the scores {tuple(scores)}"
        )  # fmt: skip
        return Reject("the scores are {} by a tensor {} that {}", verb, shape, what)
    if between:
        return Reject(
            "the scores are {} by a tensor {} after {}; the kernel scales q or k, so only"
            " before anything else",
            verb, shape, between[0].described,
        )  # fmt: skip
    if tensor_val(found).dtype == torch.float16:
        return Reject(
            "the float16 scores are {} by a tensor; q or k scaled by it could overflow"
            " float16 where the scores do not",
            verb,
        )
    return None


def _factor_side(shape: torch.Size, scores: torch.Size) -> str | None:
    """Which operand of `q @ k^T` a factor of `shape` on the `scores` can scale instead: q where
    it is constant along the keys, k where it is constant along the queries, None otherwise."""
    if not broadcasts_to(shape, scores):
        return None
    padded = (1, 1, *shape)[-2:]
    if statically_known_true(padded[-1] == 1):
        return "q"
    if statically_known_true(padded[-2] == 1):
        return "k"
    return None


_COPIES = (aten.clone.default, aten.contiguous.default, aten.alias.default)
"""Ops that pass the probabilities on unchanged (a copy the fused op need not make)."""
SOFTMAXES = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
"""The softmax spellings: `_safe_softmax` (torch's masked softmax) gives zeros for a row whose
every score is -inf, as the kernels do."""


def _walk_probabilities(
    softmax: Node, sink: bool = False
) -> tuple[Node, float, list[Node]] | Reject | None:
    """From the softmax down to `probs @ v`: (that matmul, dropout p, nodes passed); with a
    `sink` column last in the softmax, through the slice that drops it."""
    node, p, nodes = softmax, 0.0, [softmax]
    while True:
        users = list(node.users)
        if len(users) != 1:
            if not any(_is_values_product(u, node) or _reaches_values(u) for u in users):
                return None  # no product with values: a softmax of something else
            return Reject(
                "the attention probabilities are read outside the attention (returned as "
                "attention weights?); the fused kernel never forms them"
            )
        user = users[0]
        if _is_values_product(user, node):
            if sink:
                return Reject("the probabilities reach the matmul with v with the sink's column")
            return user, p, nodes
        if sink and _drops_last_column(user, node):
            sink = False
        elif is_call(user, *CASTS, *_COPIES) or batch_reshape(user) or _same_order(user):
            pass
        elif is_call(user, aten.dropout.default) and user.args[0] is node and p == 0:
            p = float(arg(user, 1, "p"))
        elif _reaches_values(user):
            return Reject("the probabilities pass through {} before the matmul with v", user.target)
        else:
            return None
        nodes.append(user)
        node = user


def _same_order(node: Node) -> bool:
    """Whether `node` permutes no dimension (a layout's copy made as permute, clone, permute)."""
    if not is_call(node, aten.permute.default):
        return False
    return list(node.args[1]) == list(range(len(node.args[1])))


def _drops_last_column(user: Node, node: Node) -> bool:
    """Whether `user` is `node[..., :-1]` (a slice from 0 that leaves out the last column)."""
    if not is_call(user, aten.slice.Tensor) or user.args[0] is not node:
        return False
    rank = tensor_val(node).dim()
    dim, start, step = arg(user, 1, "dim", 0), arg(user, 2, "start"), arg(user, 4, "step", 1)
    width, kept = tensor_val(node).shape[-1], tensor_val(user).shape[-1]
    return dim % rank == rank - 1 and start in (None, 0) and step == 1 and kept == width - 1


def _sink_column(node: Node) -> tuple[Node, Node | None]:
    """(the scores, the sink) where the softmax's input `node` is `cat([scores, sink], -1)`, sink
    one column (a learned logit per head or row, StreamingLLM's and GPT-OSS's attention sinks);
    (node, None) otherwise."""
    if not is_call(node, aten.cat.default) or len(node.args[0]) != 2:
        return node, None
    scores, sink = node.args[0]
    rank = tensor_val(node).dim()
    if arg(node, 1, "dim", 0) % rank != rank - 1 or tensor_val(sink).shape[-1] != 1:
        return node, None
    return scores, sink


def _reaches_values(node: Node, steps: int = 3) -> bool:
    """Whether `node` flows, through single users, into the left operand of a matmul."""
    for _ in range(steps):
        user = only_user(node)
        if user is None:
            return False
        if _is_values_product(user, node):
            return True
        node = user
    return False


def _is_values_product(user: Node, probabilities: Node) -> bool:
    """Whether `user` is a matmul with `probabilities` on the left (`probs @ v`)."""
    return is_call(user, aten.matmul.default) and user.args[0] is probabilities


def _operand_scale(node: Node) -> tuple[Node, float]:
    """An operand of `q @ k^T` without a constant scale that only it uses."""
    factor = scale_factor(node)
    if factor is not None and len(node.users) == 1:
        return factor
    return node, 1.0


def _is_last_two_swap(node: Node) -> bool:
    if not is_call(node, aten.transpose.int):
        return False
    rank = tensor_val(node).dim()
    return {d % rank for d in node.args[1:3]} == {rank - 2, rank - 1}


def _read_written_out(softmax: Node) -> Site | Reject | None:
    if not is_call(softmax, *SOFTMAXES):
        return None
    scores, sink = _sink_column(softmax.args[0])
    below = _walk_probabilities(softmax, sink is not None)
    if below is None or isinstance(below, Reject):
        return below
    pv, p, prob_nodes = below
    dim, rank = softmax.args[1], tensor_val(softmax).dim()
    if dim % rank != rank - 1:
        return Reject("softmax over dim {}, not the key dimension (the last)", dim)
    links, score_nodes = [], []
    qk = _walk_scores(scores, links, score_nodes)
    if isinstance(qk, Reject):
        return qk
    site = _products(qk, pv, p)
    site.nodes += [qk, *score_nodes, *prob_nodes, *([softmax.args[0]] if sink else [])]
    site.sink = sink
    applied = apply_links(site, links, tensor_val(qk).shape, softmax)
    if isinstance(applied, Reject):
        return applied
    if applied.modified is not None:
        top, after = applied.modified
        chain = score_nodes[score_nodes.index(top) :][::-1]
        key = register_chain(chain, qk, after, {f.node for f in applied.factors})
        if isinstance(key, Reject):
            return key
        applied.score_mod = key
    if applied.frames or any(not same_batch(n, softmax) for n in (qk, pv)):
        applied.batch_of = softmax
    return applied


def _products(qk: Node, pv: Node, p: float) -> Site:
    """The site of `qk` (`q @ k^T`) and `pv` (`probs @ v`): q, k and v without the constant
    scales only they take, k as (..., Lk, D) where a transpose made k^T."""
    q, q_scale = _operand_scale(qk.args[0])
    k_t, k_scale = _operand_scale(qk.args[1])
    site = Site(out=pv, q=q, k=k_t, v=pv.args[1], scale=q_scale * k_scale, p=p)
    if _is_last_two_swap(k_t) and len(k_t.users) == 1:
        site.k, k_scale_inner = _operand_scale(k_t.args[0])
        site.scale *= k_scale_inner
        site.nodes.append(k_t)
    else:
        site.k_transposed = True
    return site
