"""The attention family: `F.scaled_dot_product_attention` and attention written out with matmul and
softmax become one `seqfast::attention`.

The written-out form is read from the softmax outward, as independent features rather than
enumerated variants: below the softmax, casts and dropout up to the `probs @ v` matmul; above it,
the scores' chain back to `q @ k^T`, where each link is a scale (multiply or divide by a constant),
an additive float bias, a boolean mask (`masked_fill`, `where` with a constant), an element-wise
modification with constants, or a cast; straight on the product, a factor that is a tensor
constant along the keys or the queries (a learned temperature), which q or k takes instead; on
the matmul's operands, a constant scale on q or k. Masks are split into factors, and those the
kernel computes from positions (causal, a window, a prefix, from comparisons of `arange`s or
`tril`/`triu` of ones; document ids) are not read at all (`index_masks.py`); a bias by key -
query is read per diagonal (`relative_bias.py`). `bmm`, `baddbmm` and `einsum` arrive here as
`matmul` (see normalize.py). Reshapes that split or merge batch dimensions on either side of the
softmax (heads flattened into the batch for `bmm`, split back out for a (B, 1, Lq, Lk) mask) are
followed too: the fused op works in the softmax's batch dimensions, and q, k, v, the output and
each bias or mask are reshaped into them.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile import runtime
from seqcompile.fx_utils import (
    RESHAPES,
    arg,
    barrier_between,
    describe,
    erase_unused,
    insert_getitem,
    is_call,
    node_order,
    only_user,
    site_name,
    tensor_val,
)
from seqcompile.ops import attention as attention_op
from seqcompile.ops.attention_layout import Layout, broadcasts_to
from seqcompile.patterns.attention.claims import (
    REFUTED,
    Claim,
    FillClaim,
    RelativeClaim,
    read_as_is,
    refutations,
)
from seqcompile.patterns.attention.index_masks import (
    WHERE,
    Diagonal,
    HalfPlane,
    Prefix,
    document_ids,
    every_row_keeps,
    narrower,
    split_diagonal,
    whole_slice,
)
from seqcompile.patterns.attention.masks import (
    CASTS,
    constant,
    dtype_of,
    filled_triangle,
    triangle,
)
from seqcompile.patterns.attention.relative_bias import RelativeBias, per_diagonal, read_relative
from seqcompile.patterns.attention.score_mod import modified_operand, register_chain
from seqcompile.patterns.engine import FuseContext, Reject, Rewrite
from seqcompile.report import Missed

aten = torch.ops.aten
FAMILY = "attention"


@dataclasses.dataclass(frozen=True)
class Factor:
    """A tensor the product is multiplied (or divided) by before anything else, which q or k
    takes instead: one constant along the keys scales q, one constant along the queries k."""

    node: Node
    """The product (or quotient) in the graph."""
    tensor: Node
    side: str
    """"q" or "k"."""
    divides: bool


@dataclasses.dataclass
class Site:
    """One attention in the graph, read into the fused op's arguments."""

    out: Node
    """The node whose value the fused op replaces (the `probs @ v` matmul, or the SDPA call)."""
    q: Node
    k: Node
    """Keys as (..., Lk, D); for written-out attention a transpose is inserted when needed."""
    v: Node
    k_transposed: bool = False
    """`k` is the matmul's (..., D, Lk) operand and needs transposing back."""
    scale: float = 1.0
    biases: list[tuple[Node, float]] = dataclasses.field(default_factory=list)
    """Additive biases with the factor later scales apply to each (a boolean or integer tensor
    added to the scores adds its values, as type promotion does)."""
    keep: list[tuple[Node, bool]] = dataclasses.field(default_factory=list)
    """Boolean masks with whether True means keep (False: True means masked)."""
    masked_value: float | None = None
    causal: bool = False
    prefix: Prefix | None = None
    """With `causal`, a prefix LM's: every query also sees the keys before the prefix."""
    window: int = 0
    """A sliding window: query i sees keys j with i - j < window (0: none)."""
    factors: list[Factor] = dataclasses.field(default_factory=list)
    """Tensors q or k takes in place of the product (a learned temperature)."""
    modified: tuple[Node, float] | None = None
    """The last element-wise modification of the scores before the biases and masks (a `tanh`),
    with the factor the scales after it apply."""
    score_mod: str = ""
    """The registered modification the kernel applies to `q @ k^T * scale` (`ops/score_mods.py`)."""
    documents: tuple[Node, Node] | None = None
    """Query and key document ids whose equality the kernel tests (a packed batch's mask)."""
    relative: list[tuple[RelativeBias, float]] = dataclasses.field(default_factory=list)
    """Biases that depend on key - query only, with their factors: read one value per diagonal."""
    p: float = 0.0
    nodes: list[Node] = dataclasses.field(default_factory=list)
    """Written-out nodes the fused op replaces."""
    batch_of: Node | None = None
    """Where a reshape between the products and the softmax gives the batch dimensions another
    shape, the softmax: the fused op runs in its batch dimensions, on q, k, v reshaped to them."""
    frames: dict[Node, Node] = dataclasses.field(default_factory=dict)
    """Biases and masks applied to the scores where their batch dimensions are others than the
    softmax's, with the scores there."""
    claims: list[Claim] = dataclasses.field(default_factory=list)
    """What the reading concluded about masks and biases from their code, to be checked against
    it (`attention_claims.py`)."""


# ---------------------------------------------------------------------------------------------
# reading scaled_dot_product_attention


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
    if mask_val is not None:
        if mask_val.dtype == torch.bool:
            scores = (tensor_val(q).shape[-2], tensor_val(k).shape[-2])
            diagonal, rest = _read_mask(attn_mask, True, scores)
            site.keep += rest + _take_diagonal(site, diagonal)
            site.claims += diagonal.claims
            site.masked_value = -math.inf
        else:  # added to the scaled scores: its terms read as a written-out bias's
            lk = tensor_val(k).shape[-2]
            scores = torch.Size((*tensor_val(node).shape[:-1], lk))
            return _apply_links(site, _bias_links(attn_mask, 1.0, scores), scores, node)
    return site


# ---------------------------------------------------------------------------------------------
# reading attention written out


def _scale_factor(node: Node) -> tuple[Node, float] | None:
    """(x, c) for `x * c`, `c * x` or `x / c` with a constant c."""
    if is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        for x, c in (node.args, node.args[::-1]):
            if isinstance(x, Node) and constant(c) is not None:
                return x, constant(c)
    if is_call(node, aten.div.Tensor) and len(node.args) == 2 and not node.kwargs:
        c = constant(node.args[1])
        if isinstance(node.args[0], Node) and c:
            return node.args[0], 1.0 / c
    return None


Link = tuple
"""One step from the q @ k^T product to the softmax: ("scale", c), ("factor", Factor) for a
product by (or quotient by) a tensor that q or k can take instead, ("bias", node, sign), ("mask",
node, keeps, value), ("shift",) for a constant added to every score, ("cast",), ("batch",
scores) for a reshape of the batch dimensions of `scores`, or ("mod", node) for another
element-wise op on the scores alone (`tanh`), or ("claim", Claim) for what the reading of a bias
concluded from its code (to be checked). `_link` gives ("factor",) and ("add",) or ("sub",) for a
product or sum of two tensors, which the walk reads on, finding which one is the scores."""

CAUSAL_FILL = -1e4
"""A triangle filled with at most this value is read as causal (the kernel skips what it hides):
exp(-1e4) is 0 in float32, so hidden keys add nothing to a row's softmax either way."""
ABSORBING_FILL = -1e30
"""A bias filled with at most this value where a mask rejects (`where(mask, bias, finfo.min)`) is
read as the bias and the mask: any score plus bias below 1e13 in size plus this fill rounds to the
fill in float32, as the kernel fills. A less negative fill keeps the bias whole, since the fill
plus a large negative bias (padding's) can be what a row's softmax sees."""


def _batch_reshape(node: Node) -> bool:
    """A reshape that keeps the last two dimensions and only splits or merges the ones before."""
    if not is_call(node, *RESHAPES):
        return False
    before, after = tensor_val(node.args[0]), tensor_val(node)
    return (
        before.dim() >= 2
        and after.dim() >= 2
        and statically_known_true(before.shape[-2] == after.shape[-2])
        and statically_known_true(before.shape[-1] == after.shape[-1])
    )


def _link(node: Node) -> tuple[Link, list[Node]] | Reject | None:
    """What `node` does to the scores, and the operands that may continue the chain upward."""
    if is_call(node, *CASTS):
        return ("cast",), [node.args[0]]
    if _batch_reshape(node):
        return ("batch", node.args[0]), [node.args[0]]
    factor = _scale_factor(node)
    if factor is not None and factor[1] != 0:
        return ("scale", factor[1]), [factor[0]]
    if is_call(node, aten.add.Tensor, aten.sub.Tensor) and arg(node, 2, "alpha", 1) == 1:
        tensors = [a for a in node.args[:2] if isinstance(a, Node)]
        if len(tensors) == 1 and constant(node.args[1]) is not None:
            return ("shift",), tensors  # softmax ignores a constant added to every score
        if len(tensors) == 2:
            return ("add" if node.target is aten.add.Tensor else "sub",), tensors
        return None
    if is_call(node, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        value = constant(node.args[2], dtype_of(node))  # (as the scores hold it)
        if value is None:
            return Reject("masked_fill with a tensor value; the kernel fills with a constant")
        return ("mask", node.args[1], False, value), [node.args[0]]
    if is_call(node, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf):
        cond, a, b = node.args[:3]
        ca, cb = constant(a, dtype_of(node)), constant(b, dtype_of(node))
        if cb is not None and isinstance(a, Node):
            return ("mask", cond, True, cb), [a]
        if ca is not None and isinstance(b, Node):
            return ("mask", cond, False, ca), [b]
        return Reject("where() between two tensors on the scores; the kernel fills a constant")
    scores = modified_operand(node)
    if scores is not None:
        return ("mod", node), [scores]
    if is_call(node, aten.mul.Tensor, aten.div.Tensor) and all(_is_float(a) for a in node.args[:2]):
        return ("factor",), list(node.args[:2])
    return None


def _bias_links(bias: Node, sign: float, scores: torch.Size) -> list[Link]:
    """The links of a bias added to (sign 1) or subtracted from the scores, latest first. An
    added bias is split into the terms it sums, and a term that is 0 where a mask keeps and at
    most `CAUSAL_FILL` elsewhere (Hugging Face's eager masks, `where(mask, 0, finfo.min)`, and a
    triangle filled so, `triu(full(-inf), 1)`) is read as that mask filling its value, and a bias
    filled so (`masked_fill(bias, mask, finfo.min)`, `where(mask, bias, finfo.min)`) as the mask
    and the bias: in float32 a score plus finfo.min is finfo.min, and either way the key adds
    nothing to a row that keeps one. A term of zeros that broadcasts to the `scores` (T5's
    cross-attention position bias) adds nothing. The fills come first, as the kernel fills after
    it adds the biases."""
    node = bias
    while not read_as_is(node) and (is_call(node, *_SAME_VALUES) or whole_slice(node)):
        node = node.args[0]
    if read_as_is(node) or sign < 0:  # (an in-place write, a refuted reading: as it is)
        return [("bias", bias, sign)]
    if _zeros(node) and broadcasts_to(tensor_val(node).shape, scores):
        return [("claim", FillClaim(node, "zeros"))]
    if is_call(node, aten.add.Tensor) and arg(node, 2, "alpha", 1) == 1:
        terms = node.args[:2]
        if all(isinstance(t, Node) and tensor_val(t).is_floating_point() for t in terms):
            links = [link for t in terms for link in _bias_links(t, sign, scores)]
            return sorted(links, key=lambda link: link[0] != "mask")
    if is_call(node, aten.masked_fill.Scalar) and isinstance(node.args[0], Node):
        term, mask, fill = node.args[0], node.args[1], constant(node.args[2], dtype_of(node))
        if fill is not None and fill <= CAUSAL_FILL:
            reading = f"{describe(term)} filled with {fill:g}"
            claim = FillClaim(node, reading, mask, False, fill, term)
            return [("claim", claim), ("mask", mask, False, fill), *_bias_links(term, sign, scores)]
    fill = filled_triangle(node, scores) if _is_float(node) else None
    if fill is not None and fill <= CAUSAL_FILL and _keeps_a_key(node, fill, scores):
        claim = FillClaim(node, f"a triangle filled with {fill:g}", node, False, fill)
        return [("claim", claim), ("mask", node, False, fill)]  # nn.Transformer's mask
    if is_call(node, *WHERE):
        cond, kept, filled = node.args[:3]
        for keeps, (term, value) in ((True, (kept, filled)), (False, (filled, kept))):
            fill = constant(value, dtype_of(node))
            if fill is None or fill > CAUSAL_FILL:
                continue
            reading = f"a mask filling {fill:g}"
            mask = ("mask", cond, keeps, fill)
            if constant(term, dtype_of(node)) == 0.0:
                return [("claim", FillClaim(node, reading, cond, keeps, fill)), mask]
            if fill <= ABSORBING_FILL and isinstance(term, Node) and _is_float(term):
                claim = FillClaim(node, f"{describe(term)} and {reading}", cond, keeps, fill, term)
                return [("claim", claim), mask, *_bias_links(term, sign, scores)]
    return [("bias", bias, sign)]


def _keeps_a_key(triangle_of_fills: Node, fill: float, scores: torch.Size) -> bool:
    """Whether a triangle of a finite fill leaves every query a key: a query it fills on every
    key sees eager's softmax of its scores plus the fill (or a uniform average, where they round
    to it), not what a kernel skipping the triangle computes."""
    planes = triangle(triangle_of_fills, False, scores)
    if planes is None:
        return False
    return math.isinf(fill) or every_row_keeps([HalfPlane(*p) for p in planes], *scores[-2:])


_SAME_VALUES = (
    aten.expand.default,
    aten.alias.default,
    aten.contiguous.default,
    aten.clone.default,
)
_FILL_ARGUMENT = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}


def _is_float(node: object) -> bool:
    value = tensor_val(node) if isinstance(node, Node) else None
    return value is not None and value.is_floating_point()


def _zeros(node: Node) -> bool:
    """A tensor of zeros made in the graph."""
    if is_call(node, aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default):
        return True
    if not is_call(node, *_FILL_ARGUMENT):
        return False
    return constant(node.args[_FILL_ARGUMENT[node.target]], dtype_of(node)) == 0


def _walk_scores(node: Node, links: list[Link], nodes: list[Node]) -> Node | Reject | None:
    """From the softmax's input up to the `q @ k^T` matmul, collecting links (latest first)."""
    if is_call(node, aten.matmul.default):
        return node
    step = _link(node)
    if step is None:
        operands = ", ".join(describe(a) for a in node.args) if isinstance(node, Node) else ""
        what = f"{node.target}({operands})" if isinstance(node, Node) else repr(node)
        return Reject("the scores pass through {}, which the kernel does not apply", what)
    if isinstance(step, Reject):
        return step
    link, operands = step
    if link[0] == "factor":
        return _walk_factor(node, operands, links, nodes)
    if link[0] in ("add", "sub"):
        # scores + bias, bias + scores, scores - bias
        orders = [operands, operands[::-1]] if link[0] == "add" else [operands]
        refused, depth = None, -1
        for above, bias in orders:
            found = _walk_scores(above, sub_links := [], sub_nodes := [])
            bias_val = tensor_val(bias)
            if isinstance(found, Node) and bias_val is not None and not bias_val.is_complex():
                sign = 1.0 if link[0] == "add" else -1.0
                links += [*_bias_links(bias, sign, tensor_val(found).shape), *sub_links]
                nodes += [node, *sub_nodes]
                return found
            if isinstance(found, Reject) and len(sub_nodes) > depth:
                refused, depth = found, len(sub_nodes)  # the walk that got furthest tells why
        return refused
    links.append(link)
    nodes.append(node)
    return _walk_scores(operands[0], links, nodes)


def _walk_factor(
    node: Node, operands: list[Node], links: list[Link], nodes: list[Node]
) -> Node | Reject | None:
    """`scores * t` (or `scores / t`) with t a tensor constant along the keys (a learned
    temperature per head or per query, Swin V2's logit scale) or along the queries, straight on
    the product (constant scales, casts and other such factors between): the kernel reads q * t
    (or k * t) instead."""
    divides = node.target is aten.div.Tensor
    verb = "divided" if divides else "multiplied"
    refused = None
    for above, tensor in [operands] if divides else [operands, operands[::-1]]:
        found = _walk_scores(above, sub_links := [], sub_nodes := [])
        if not isinstance(found, Node):
            refused = refused or found
            continue
        scores, shape = tensor_val(found).shape, tensor_val(tensor).shape
        side = _factor_side(shape, scores)
        between = [link[0] for link in sub_links if link[0] not in ("scale", "cast", "factor")]
        if side is None:
            what = "varies along both queries and keys" if broadcasts_to(shape, scores) else (
                f"does not broadcast to the scores {tuple(scores)}"
            )  # fmt: skip
            refused = Reject("the scores are {} by a tensor {} that {}", verb, shape, what)
        elif between:
            refused = Reject(
                "the scores are {} by a tensor {} after {}; the kernel scales q or k, so only"
                " before anything else",
                verb, shape, _LINK_NAMES[between[0]],
            )  # fmt: skip
        elif tensor_val(found).dtype == torch.float16:
            refused = Reject(
                "the float16 scores are {} by a tensor; q or k scaled by it could overflow"
                " float16 where the scores do not",
                verb,
            )
        else:
            links += [("factor", Factor(node, tensor, side, divides)), *sub_links]
            nodes += [node, *sub_nodes]
            return found
    return refused


_LINK_NAMES = {
    "bias": "an added tensor",
    "mask": "a mask",
    "mod": "an element-wise modification",
    "batch": "a reshape of the batch dims",
    "shift": "a constant added",
}


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


def _walk_probabilities(softmax: Node) -> tuple[Node, float, list[Node]] | Reject | None:
    """From the softmax down to `probs @ v`: (that matmul, dropout p, nodes passed)."""
    node, p, nodes = softmax, 0.0, [softmax]
    while True:
        users = list(node.users)
        if len(users) != 1:
            return Reject(
                "the attention probabilities are read outside the attention (returned as "
                "attention weights?); the fused kernel never forms them"
            )
        user = users[0]
        if is_call(user, aten.matmul.default) and user.args[0] is node:
            return user, p, nodes
        if is_call(user, *CASTS) or _batch_reshape(user):
            pass
        elif is_call(user, aten.dropout.default) and user.args[0] is node and p == 0:
            p = float(arg(user, 1, "p"))
        elif _reaches_values(user):
            return Reject("the probabilities pass through {} before the matmul with v", user.target)
        else:
            return None
        nodes.append(user)
        node = user


def _reaches_values(node: Node, steps: int = 3) -> bool:
    """Whether `node` flows, through single users, into the left operand of a matmul."""
    for _ in range(steps):
        user = only_user(node)
        if user is None:
            return False
        if is_call(user, aten.matmul.default) and user.args[0] is node:
            return True
        node = user
    return False


def _operand_scale(node: Node) -> tuple[Node, float]:
    """An operand of `q @ k^T` without a constant scale that only it uses."""
    factor = _scale_factor(node)
    if factor is not None and len(node.users) == 1:
        return factor
    return node, 1.0


def _is_last_two_swap(node: Node) -> bool:
    if not is_call(node, aten.transpose.int):
        return False
    rank = tensor_val(node).dim()
    return {d % rank for d in node.args[1:3]} == {rank - 2, rank - 1}


def _read_written_out(softmax: Node) -> Site | Reject | None:
    if not is_call(softmax, aten.softmax.int, aten._softmax.default):
        return None
    below = _walk_probabilities(softmax)
    if below is None or isinstance(below, Reject):
        return below
    pv, p, prob_nodes = below
    dim, rank = softmax.args[1], tensor_val(softmax).dim()
    if dim % rank != rank - 1:
        return Reject("softmax over dim {}, not the key dimension (the last)", dim)
    links, score_nodes = [], []
    qk = _walk_scores(softmax.args[0], links, score_nodes)
    if isinstance(qk, Reject):
        return qk
    q, q_scale = _operand_scale(qk.args[0])
    k_t, k_scale = _operand_scale(qk.args[1])
    site = Site(out=pv, q=q, k=k_t, v=pv.args[1], scale=q_scale * k_scale, p=p)
    if _is_last_two_swap(k_t) and len(k_t.users) == 1:
        site.k, k_scale_inner = _operand_scale(k_t.args[0])
        site.scale *= k_scale_inner
        site.nodes.append(k_t)
    else:
        site.k_transposed = True
    site.nodes += [qk, *score_nodes, *prob_nodes]
    applied = _apply_links(site, links, tensor_val(qk).shape, softmax)
    if isinstance(applied, Site) and applied.modified is not None:
        top, after = applied.modified
        chain = score_nodes[score_nodes.index(top) :][::-1]
        key = register_chain(chain, qk, after, {f.node for f in applied.factors})
        if isinstance(key, Reject):
            return key
        applied.score_mod = key
    if isinstance(applied, Site) and (
        applied.frames or any(not _same_batch(n, softmax) for n in (qk, pv))
    ):
        applied.batch_of = softmax
    return applied


def _read_mask(mask: Node, keeps: bool, scores: tuple) -> tuple[Diagonal, list[tuple[Node, bool]]]:
    """What the kernel computes of a boolean mask and its factors to read (`split_diagonal`); the
    whole mask where an in-place op writes what it is computed from (`m[:, :5] = True` after a
    `tril`), which its computation alone would miss."""
    if read_as_is(mask):
        return Diagonal(), [(mask, keeps)]
    return split_diagonal(mask, keeps, scores)


def _take_diagonal(site: Site, diagonal: Diagonal) -> list[tuple[Node, bool]]:
    """Fold what the kernel computes of a mask (causal, a prefix, a window) into the site's; the
    mask factors it cannot combine with what the site has (a second prefix, a prefix beside a
    window) come back, to be read as masks."""
    back = []
    if diagonal.causal and diagonal.prefix is None:  # plain causal hides what a prefix adds
        site.causal, site.prefix = True, None
    elif diagonal.prefix is not None and not (site.causal and site.prefix is None):
        if site.prefix is None:
            site.causal, site.prefix = True, diagonal.prefix
        else:
            back.append((diagonal.prefix.factor, diagonal.prefix.keeps))
    site.window = narrower(site.window, diagonal.window)
    if site.window and site.prefix is not None:
        back.append((site.prefix.factor, site.prefix.keeps))
        site.causal, site.prefix = False, None
    return back


def _same_batch(a: Node, b: Node) -> bool:
    """Provably the same batch dimensions (all but the last two)."""
    x, y = tensor_val(a).shape[:-2], tensor_val(b).shape[:-2]
    return len(x) == len(y) and all(
        statically_known_true(i == j) for i, j in zip(x, y, strict=True)
    )


def _apply_links(site: Site, links: list[Link], scores: torch.Size, softmax: Node) -> Site | Reject:
    """Fold the links (latest first, from the softmax up) into the site's scale, modification,
    biases and masks: a scale after a bias or a fill scales that bias or value too, and the last
    element-wise modification (`tanh`) ends what the kernel computes from the product alone, all
    below it included, the scales after it its factor. The kernel modifies, then adds the bias,
    then fills, so a finite fill must not come before a bias add, and no bias or mask before the
    modification."""
    factor_after = 1.0
    values, causal_fills, bias_seen = set(), set(), False
    frame = softmax
    for link in links:
        if link[0] == "claim":
            site.claims.append(link[1])
            continue
        if link[0] == "factor":  # straight on the product: scales q or k, the kernel none
            site.factors.append(link[1])
            continue
        if site.modified is not None:
            if link[0] in ("bias", "mask"):
                what = site.modified[0].target
                return Reject(
                    "a {} before {} of the scores; the kernel modifies q @ k^T", link[0], what
                )
            continue  # (below the modification: part of it)
        if link[0] == "mod":
            site.modified, factor_after = (link[1], factor_after), 1.0
        elif link[0] == "batch":
            frame = link[1]
        elif link[0] == "bias" and not _same_batch(frame, softmax):
            site.frames[link[1]] = frame
        if link[0] == "scale":
            factor_after *= link[1]
        elif link[0] == "bias":
            site.biases.append((link[1], link[2] * factor_after))
            bias_seen = True
        elif link[0] == "mask":
            _, mask, keeps, value = link
            if factor_after < 0:
                return Reject("a negative scale after a mask turns masked scores into maxima")
            value = value * factor_after if math.isfinite(value) else value
            if math.isfinite(value) and bias_seen:
                return Reject(
                    "a bias is added after a mask filled with {}; the kernel fills last", value
                )
            diagonal, rest = (
                _read_mask(mask, keeps, scores)
                if value <= CAUSAL_FILL
                else (Diagonal(), [(mask, keeps)])
            )
            if diagonal.prefix is not None and not _same_batch(frame, softmax):
                rest.append((diagonal.prefix.factor, diagonal.prefix.keeps))  # its own batch dims
                diagonal = dataclasses.replace(diagonal, causal=False, prefix=None)
            if math.isfinite(value) and not every_row_keeps(diagonal.planes(), *scores[-2:]):
                diagonal, rest = Diagonal(), [(mask, keeps)]  # see _bias_links
            site.claims += diagonal.claims
            if diagonal.causal or diagonal.window:
                rest += _take_diagonal(site, diagonal)
                causal_fills.add(value)
            for factor, factor_keeps in rest:
                site.keep.append((factor, factor_keeps))
                values.add(value)
                if not _same_batch(frame, softmax):
                    site.frames[factor] = frame
    site.scale *= factor_after
    finite_causal = {v for v in causal_fills if math.isfinite(v)}
    if len(values) > 1 or (values and finite_causal and finite_causal != values):
        fills = sorted(values | causal_fills)
        return Reject("masks fill different values {}; the kernel fills one", fills)
    if values:
        site.masked_value = values.pop()
    return site


# ---------------------------------------------------------------------------------------------
# checks and rewrite


def _check(site: Site) -> Reject | None:
    q, k, v = (tensor_val(n) for n in (site.q, site.k, site.v))
    if site.k_transposed:
        if k.dim() < 2:
            return Reject("the key operand of q @ k^T is 1-D")
        k = k.transpose(-1, -2)
    for factor in site.factors:
        shape = _factor_on_rows(tensor_val(factor.tensor).shape, factor.side)
        if not broadcasts_to(shape, (q if factor.side == "q" else k).shape):
            return Reject(
                "a factor {} of the scores would enlarge {} (its batch)", shape, factor.side
            )
    if site.batch_of is not None:
        batch = tuple(tensor_val(site.batch_of).shape[:-2])
        if not all(_same_count(t.shape[:-2], batch) for t in (q, k, v)):
            return Reject(
                "the scores' batch dimensions are reshaped to {}, and q, k, v's cannot be shown to"
                " hold as many",
                batch,
            )
        if not _same_batch(site.v, site.out):
            return Reject("the values broadcast over the probabilities' batch dimensions")
        q, k, v = (t.reshape(*batch, *t.shape[-2:]) for t in (q, k, v))
    for t in (q, k, v):
        if t.dtype not in attention_op.DTYPES:
            return Reject("dtype {} is not supported (float32, float16, bfloat16)", t.dtype)
        if not runtime.runs_fused_ops(t.device):
            return Reject("device {} has neither kernels nor a reference here", t.device)
    head_dim = q.shape[-1]
    if not isinstance(head_dim, int):
        return Reject("head dim {} is dynamic; the kernel needs it fixed", head_dim)
    if head_dim > attention_op.MAX_HEAD_DIM:
        return Reject("head dim {} > {}", head_dim, attention_op.MAX_HEAD_DIM)
    if v.shape[-1] != head_dim:
        return Reject("value head dim {} differs from the key head dim {}", v.shape[-1], head_dim)
    try:
        layout = Layout.of(q, k, v)
    except ValueError as refused:
        return Reject("{}", refused)
    scores = layout.scores_shape(q, k)
    documents = list(site.documents or ())
    lengths = [site.prefix.length] if site.prefix is not None and site.prefix.length else []
    biases = [b for b, _ in site.biases] + [r.bias for r, _ in site.relative]
    for node in biases + [m for m, _ in site.keep] + documents + lengths:
        shape = tensor_val(node).shape
        frame = site.frames.get(node)
        where = scores if frame is None else (*tensor_val(frame).shape[:-2], *scores[-2:])
        if not broadcasts_to(shape, where):
            return Reject(
                "mask or bias of shape {} does not broadcast to the scores {}", shape, scores
            )
    if site.p >= 1:
        return Reject("dropout p={} drops every probability", site.p)
    order = node_order(site.out.graph)
    if site.nodes and barrier_between(min(site.nodes, key=order.__getitem__), site.out):
        return Reject("grad mode, autocast or an in-place op changes inside the attention")
    return None


def _factor_on_rows(shape: torch.Size, side: str) -> tuple:
    """A factor of the scores (constant along the keys for q, the queries for k) as a factor of
    the rows of q or k."""
    padded = (1,) * max(0, 2 - len(shape)) + tuple(shape)
    return padded if side == "q" else (*padded[:-2], padded[-1], padded[-2])


def _scaled(ctx: FuseContext, site: Site, operand: Node, side: str) -> Node:
    """`operand` (`site.q` or `site.k`) times the factors of the scores it takes, in its own
    dtype."""
    dtype = tensor_val(operand).dtype
    for factor in site.factors:
        if factor.side != side:
            continue
        tensor = factor.tensor
        for _ in range(2 - tensor_val(tensor).dim()):
            tensor = ctx.call(aten.unsqueeze.default, tensor, 0)
        if side == "k" and not site.k_transposed:  # k is (..., Lk, D), the factor (..., 1, Lk)
            tensor = ctx.call(aten.transpose.int, tensor, -2, -1)
        product = aten.div.Tensor if factor.divides else aten.mul.Tensor
        operand = ctx.call(product, operand, tensor)
        if tensor_val(operand).dtype != dtype:
            operand = ctx.call(aten.to.dtype, operand, dtype)
    return operand


def _same_count(dims: tuple, other: tuple) -> bool:
    return statically_known_true(math.prod(dims) == math.prod(other))


def _in_batch(ctx: FuseContext, node: Node, batch_of: Node, frame: Node | None = None) -> Node:
    """`node` reshaped to the batch dimensions of `batch_of`: from its own, or, for a bias or
    mask, from those of `frame`, the scores where it applies (over which it is expanded first)."""
    if frame is not None:
        rank = tensor_val(node).dim()
        rows = [1] * max(0, 2 - rank) + ctx.sizes(node, range(max(0, rank - 2), rank))
        node = ctx.call(aten.expand.default, node, [*ctx.sizes(frame, _batch_dims(frame)), *rows])
    return ctx.call(
        aten.reshape.default,
        node,
        [*ctx.sizes(batch_of, _batch_dims(batch_of)), *ctx.sizes(node, (-2, -1))],
    )


def _batch_dims(node: Node) -> range:
    return range(tensor_val(node).dim() - 2)


def _combined_bias(ctx: FuseContext, site: Site) -> Node | None:
    total = None
    for bias, factor in site.biases:
        frame = site.frames.get(bias)
        if not tensor_val(bias).is_floating_point():  # a boolean mask added as 0 and 1
            bias = ctx.call(aten.to.dtype, bias, torch.float32)
        if frame is not None:
            bias = _in_batch(ctx, bias, site.batch_of, frame)
        if factor != 1.0:
            bias = ctx.call(aten.mul.Tensor, bias, factor)
        total = bias if total is None else ctx.call(aten.add.Tensor, total, bias)
    return total


def _combined_mask(ctx: FuseContext, site: Site) -> Node | None:
    """One boolean mask, True where a query may attend."""
    total = None
    for mask, keeps in site.keep:
        if mask in site.frames:
            mask = _in_batch(ctx, mask, site.batch_of, site.frames[mask])
        if not keeps:
            inverted = is_call(mask, aten.bitwise_not.default, aten.logical_not.default)
            mask = mask.args[0] if inverted else ctx.call(aten.logical_not.default, mask)
        total = mask if total is None else ctx.call(aten.logical_and.default, total, mask)
    return total


def _take_relative(site: Site) -> None:
    """Biases that depend on positions only through key - query go to the kernel per diagonal."""
    lq = tensor_val(site.q).shape[-2]
    lk = tensor_val(site.k).shape[-1 if site.k_transposed else -2]
    for bias, factor in list(site.biases):
        computed = bias not in site.frames and not read_as_is(bias)
        relative = read_relative(bias, lq, lk) if computed else None
        if relative is not None:
            site.relative.append((relative, factor))
            site.claims.append(RelativeClaim(bias))
            site.biases.remove((bias, factor))


def _relative_bias(ctx: FuseContext, site: Site) -> Node | None:
    total = None
    for relative, factor in site.relative:
        values = per_diagonal(ctx, relative)
        if not tensor_val(values).is_floating_point():  # integers add as float32, as promoted
            values = ctx.call(aten.to.dtype, values, torch.float32)
        if factor != 1.0:
            values = ctx.call(aten.mul.Tensor, values, factor)
        total = values if total is None else ctx.call(aten.add.Tensor, total, values)
    return total


def _prefix_length(ctx: FuseContext, site: Site, device: torch.device) -> Node | None:
    """The prefix's length as the op takes it, an integer tensor (..., 1, 1)."""
    prefix = site.prefix
    if prefix is None:
        return None
    if prefix.length is None:
        return ctx.call(aten.full.default, [1, 1], prefix.offset, dtype=torch.int64, device=device)
    if prefix.offset:
        return ctx.call(aten.add.Tensor, prefix.length, prefix.offset)
    return prefix.length


def _take_documents(site: Site) -> None:
    """A mask factor comparing query with key document ids goes to the kernel as the ids, where
    the masks fill at most `CAUSAL_FILL` (the kernel fills -inf for another document's keys)."""
    if site.masked_value is not None and site.masked_value > CAUSAL_FILL:
        return
    for factor, keeps in site.keep:
        computed = factor not in site.frames and not read_as_is(factor)
        ids = document_ids(factor, keeps) if computed else None
        if ids is not None:
            site.documents = ids
            site.keep.remove((factor, keeps))
            return


def _rewrite(site: Site, name: str) -> Rewrite:
    def apply(ctx: FuseContext) -> Node:
        graph = ctx.gm.graph
        out_val = tensor_val(site.out)
        with graph.inserting_before(site.out):
            q, k, v = _scaled(ctx, site, site.q, "q"), _scaled(ctx, site, site.k, "k"), site.v
            if site.batch_of is not None:
                q, k, v = (_in_batch(ctx, n, site.batch_of) for n in (q, k, v))
            k = ctx.call(aten.transpose.int, k, -2, -1) if site.k_transposed else k
            bias, mask = _combined_bias(ctx, site), _combined_mask(ctx, site)
            seed = ctx.seed(out_val.device) if site.p > 0 else None
            stream = ctx.next_stream() if site.p > 0 else 0
            masked_value = site.masked_value if site.masked_value is not None else -math.inf
            fused = ctx.call_fused(
                torch.ops.seqfast.attention.default,
                q=q,
                k=k,
                v=v,
                bias=bias,
                mask=mask,
                seed=seed,
                stream=stream,
                p=site.p,
                scale=site.scale,
                causal=site.causal,
                masked_value=masked_value,
                window=site.window,
                score_mod=site.score_mod,
                doc_q=site.documents[0] if site.documents else None,
                doc_kv=site.documents[1] if site.documents else None,
                rel_bias=_relative_bias(ctx, site),
                prefix=_prefix_length(ctx, site, out_val.device),
            )
            out = insert_getitem(graph, fused, 0)
            if site.batch_of is not None:  # back to the values' batch dimensions (checked equal)
                sizes = ctx.sizes(site.v, _batch_dims(site.v)) + ctx.sizes(out, (-2, -1))
                out = ctx.call(aten.reshape.default, out, sizes)
            if tensor_val(out).dtype != out_val.dtype:
                out = ctx.call(aten.to.dtype, out, out_val.dtype)
        out = ctx.in_layout_of(out, out_val)
        site.out.replace_all_uses_with(out)
        erase_unused([site.out, *site.nodes])
        return fused

    return apply


def _read(node: Node) -> Site | Reject | None:
    site = _read_sdpa(node)
    if site is None:
        site = _read_written_out(node)
    if site is None or isinstance(site, Reject):
        return site
    _take_documents(site)
    _take_relative(site)
    return site


class AttentionPattern:
    family = FAMILY

    def find(self, node: Node, ctx: FuseContext) -> Rewrite | Reject | None:
        site = _read(node)
        while isinstance(site, Site):
            refuted = refutations(site.claims, ctx.evaluator)
            if not refuted:
                break
            for claim, reason in refuted:  # read again, those nodes as the tensors they are
                claim.node.meta[REFUTED] = reason
                ctx.report.refuted.append(Missed(site_name(site.out), FAMILY, reason))
            site = _read(node)
        if site is None or isinstance(site, Reject):
            return site
        return _check(site) or _rewrite(site, site_name(site.out))
