"""Folding readings into a site: the scales, modification, biases and masks of the scores, and what
of them the kernel computes from positions (causal, a prefix, a window, documents, relative biases).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx import Node

from seqcompile.fx.nodes import tensor_val
from seqcompile.patterns.attention.claims import read_as_is
from seqcompile.patterns.attention.index_masks import (
    Diagonal,
    document_ids,
    every_row_keeps,
    narrower,
    split_diagonal,
)
from seqcompile.patterns.attention.links import ABSORBING_FILL, CAUSAL_FILL, same_batch
from seqcompile.patterns.attention.readings import (
    BatchReshape,
    Bias,
    Factor,
    Floor,
    Mask,
    Modification,
    Reading,
    Scale,
    Site,
)
from seqcompile.patterns.attention.relative_bias import read_relative
from seqcompile.patterns.engine import Reject


def apply_links(
    site: Site, links: list[Reading], scores: torch.Size, softmax: Node
) -> Site | Reject:
    """Fold the links (latest first, from the softmax up) into the site's scale, modification,
    biases and masks: a scale after a bias or a fill scales that bias or value too, and the last
    element-wise modification (`tanh`) ends what the kernel computes from the product alone, all
    below it included, the scales after it its factor. The kernel modifies, then adds the bias,
    then fills, so a finite fill must not come before a bias add, and no bias or mask before the
    modification."""
    fold = _Fold(site, scores, softmax, frame=softmax)
    for link in links:
        if link.claim is not None:
            site.claims.append(link.claim)
        refused = fold.take(link)
        if refused is not None:
            return refused
    site.scale *= fold.factor_after
    return fold.finish()


@dataclasses.dataclass
class _Fold:
    """The folding of one site's links: the factor the scales read so far apply, the fills of its
    masks (those the kernel computes apart), whether a bias was added, and the batch dimensions
    (`frame`, the scores there) the links apply in."""

    site: Site
    scores: torch.Size
    softmax: Node
    frame: Node
    factor_after: float = 1.0
    values: set[float] = dataclasses.field(default_factory=set)
    causal_fills: set[float] = dataclasses.field(default_factory=set)
    bias_seen: bool = False
    floor: float = -math.inf
    """The value a floor after the masks (`max(scores, finfo.min)`) raises their -inf to."""

    def take(self, link: Reading) -> Reject | None:
        site = self.site
        if isinstance(link, Factor):  # straight on the product: scales q or k, the kernel none
            site.factors.append(link)
            return None
        if site.modified is not None:
            if isinstance(link, Bias | Mask):
                kind = "bias" if isinstance(link, Bias) else "mask"
                what = site.modified[0].target
                return Reject(
                    "a {} before {} of the scores; the kernel modifies q @ k^T", kind, what
                )
            return None  # (below the modification: part of it)
        match link:
            case Modification(node=node):
                site.modified, self.factor_after = (node, self.factor_after), 1.0
            case BatchReshape(scores=scores):
                self.frame = scores
            case Scale(factor=factor):
                self.factor_after *= factor
            case Floor(value=value):
                self.floor = max(self.floor, value * self.factor_after)
            case Bias(node=node, sign=sign):
                if not same_batch(self.frame, self.softmax):
                    site.frames[node] = self.frame
                site.biases.append((node, sign * self.factor_after))
                self.bias_seen = True
            case Mask():
                return self._mask(link)
        return None

    def _mask(self, mask: Mask) -> Reject | None:
        if self.factor_after < 0:
            return Reject("a negative scale after a mask turns masked scores into maxima")
        value = mask.fill * self.factor_after if math.isfinite(mask.fill) else mask.fill
        value = max(value, self.floor)
        if math.isfinite(value) and value > ABSORBING_FILL and self.bias_seen:
            return Reject(
                "a bias is added after a mask filled with {}; the kernel fills last", value
            )
        diagonal, rest = self._diagonal(mask, value)
        self.site.claims += diagonal.claims
        if diagonal.causal or diagonal.window:
            rest += take_diagonal(self.site, diagonal)
            self.causal_fills.add(value)
        for factor, factor_keeps in rest:
            self.site.keep.append((factor, factor_keeps))
            self.values.add(value)
            if not same_batch(self.frame, self.softmax):
                self.site.frames[factor] = self.frame
        return None

    def _diagonal(self, mask: Mask, value: float) -> tuple[Diagonal, list[tuple[Node, bool]]]:
        """What the kernel computes of a mask filling `value`, and the factors it reads."""
        whole = Diagonal(), [(mask.node, mask.keeps)]
        if value > CAUSAL_FILL:
            return whole
        diagonal, rest = read_mask(mask.node, mask.keeps, self.scores)
        if diagonal.prefix is not None and not same_batch(self.frame, self.softmax):
            rest.append((diagonal.prefix.factor, diagonal.prefix.keeps))  # its own batch dims
            diagonal = dataclasses.replace(diagonal, causal=False, prefix=None)
        if math.isfinite(value) and not every_row_keeps(diagonal.planes(), *self.scores[-2:]):
            return whole  # see links.bias_links
        return diagonal, rest

    def finish(self) -> Site | Reject:
        finite_causal = {v for v in self.causal_fills if math.isfinite(v)}
        values = self.values
        if len(values) > 1 or (values and finite_causal and finite_causal != values):
            fills = sorted(values | self.causal_fills)
            return Reject("masks fill different values {}; the kernel fills one", fills)
        if values:
            self.site.masked_value = values.pop()
        return self.site


def read_mask(mask: Node, keeps: bool, scores: tuple) -> tuple[Diagonal, list[tuple[Node, bool]]]:
    """What the kernel computes of a boolean mask and its factors to read (`split_diagonal`); the
    whole mask where an in-place op writes what it is computed from (`m[:, :5] = True` after a
    `tril`), which its computation alone would miss."""
    if read_as_is(mask):
        return Diagonal(), [(mask, keeps)]
    return split_diagonal(mask, keeps, scores)


def take_diagonal(site: Site, diagonal: Diagonal) -> list[tuple[Node, bool]]:
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


def take_relative(site: Site) -> None:
    """Biases that depend on positions only through key - query go to the kernel per diagonal."""
    lq = tensor_val(site.q).shape[-2]
    lk = tensor_val(site.k).shape[-1 if site.k_transposed else -2]
    for bias, factor in list(site.biases):
        computed = bias not in site.frames and not read_as_is(bias)
        relative = read_relative(bias, lq, lk) if computed else None
        if relative is not None:
            site.relative.append((relative, factor))
            site.claims.append(relative.claim)
            site.biases.remove((bias, factor))


def take_documents(site: Site) -> None:
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
