"""What the attention family reads from the code between `q @ k^T` and the softmax, one frozen
value per kind of reading (with the claim that checks it), and the site they fold into.

A walk from the softmax up to the product gathers readings latest first: `Scale`, `Cast`, `Shift`,
`BatchReshape`, `Factor`, `Bias`, `Mask`, `Zeros` and `Modification`. `Product` and `Sum` are the
steps where the scores meet another tensor, which the walk reads on to find which operand they are.
What the kernel computes from positions is read by `index_masks.py` (`Diagonal`, `Prefix`,
`Documents`) and `relative_bias.py` (`RelativeBias`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch.fx import Node

from seqcompile.patterns.attention.claims import Claim, FillClaim
from seqcompile.patterns.attention.positions import Documents, Prefix
from seqcompile.patterns.attention.relative_bias import RelativeBias


class Reading:
    """One step from the `q @ k^T` product to the softmax, as read."""

    claim: Claim | None = None
    """What the reading concluded from the code, to be checked against it (`claims.py`)."""
    described: ClassVar[str] = ""
    """The reading in a refusal's words, where it stands between the product and a factor."""


@dataclasses.dataclass(frozen=True)
class Scale(Reading):
    """A product by (or quotient by) a constant."""

    factor: float


@dataclasses.dataclass(frozen=True)
class Cast(Reading):
    """A cast of the scores to another dtype."""


@dataclasses.dataclass(frozen=True)
class Shift(Reading):
    """A constant added to every score, which the softmax ignores."""

    described: ClassVar[str] = "a constant added"


@dataclasses.dataclass(frozen=True)
class BatchReshape(Reading):
    """A reshape that splits or merges the batch dimensions of `scores`."""

    scores: Node
    described: ClassVar[str] = "a reshape of the batch dims"


@dataclasses.dataclass(frozen=True)
class Factor(Reading):
    """A tensor the product is multiplied (or divided) by before anything else, which q or k
    takes instead: one constant along the keys scales q, one constant along the queries k."""

    node: Node
    """The product (or quotient) in the graph."""
    tensor: Node
    side: str
    """"q" or "k"."""
    divides: bool


@dataclasses.dataclass(frozen=True)
class Bias(Reading):
    """A float tensor added to (sign 1) or subtracted from (sign -1) the scores."""

    node: Node
    sign: float
    described: ClassVar[str] = "an added tensor"


@dataclasses.dataclass(frozen=True)
class Mask(Reading):
    """A boolean mask (True keeping where `keeps`) filling the scores it masks with `fill`; where
    it was read from a float bias, the claim that the bias is so filled."""

    node: Node
    keeps: bool
    fill: float
    claim: FillClaim | None = None
    described: ClassVar[str] = "a mask"


@dataclasses.dataclass(frozen=True)
class Floor(Reading):
    """`max(scores, c)` with c at most the lowest finite value of the scores' dtype (XGLM's
    `torch.max(scores, finfo.min)`): it changes nothing but the -inf the masks below fill, which
    then fill c."""

    value: float
    described: ClassVar[str] = "a floor at the lowest finite value"


@dataclasses.dataclass(frozen=True)
class Zeros(Reading):
    """A term of zeros added to the scores, which adds nothing."""

    claim: FillClaim
    described: ClassVar[str] = "an added tensor"


@dataclasses.dataclass(frozen=True)
class Modification(Reading):
    """Another element-wise op on the scores alone (`tanh`)."""

    node: Node
    described: ClassVar[str] = "an element-wise modification"


@dataclasses.dataclass(frozen=True)
class Product(Reading):
    """A product or quotient of two float tensors: one is the scores, the other a `Factor`."""


@dataclasses.dataclass(frozen=True)
class Sum(Reading):
    """A sum (sign 1) or difference (sign -1) of two tensors: the scores and a bias."""

    sign: float


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
    """The registered modification the kernel applies to `q @ k^T * scale`
    (`ops/attention/score_mods.py`)."""
    documents: Documents | None = None
    """Query and key document ids whose equality the kernel tests (a packed batch's mask)."""
    relative: list[tuple[RelativeBias, float]] = dataclasses.field(default_factory=list)
    """Biases that depend on key - query only, with their factors: read one value per diagonal."""
    p: float = 0.0
    sink: Node | None = None
    """A logit per row that joins the softmax (its column dropped after it): attention sinks."""
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
    it (`claims.py`)."""
