"""The attention family's pattern: each site read (`read.py`), its claims checked against the
model's code and read again where refuted, then checked for the kernel and rewritten."""

from __future__ import annotations

from torch.fx import Node

from seqcompile.fx.nodes import site_name
from seqcompile.ops import attention as attention_op
from seqcompile.patterns.attention.check import check
from seqcompile.patterns.attention.claims import REFUTED, refutations
from seqcompile.patterns.attention.read import read
from seqcompile.patterns.attention.readings import Site
from seqcompile.patterns.attention.rewrite import rewrite
from seqcompile.patterns.engine import FuseContext, Reject, Rewrite
from seqcompile.report import Missed

FAMILY = attention_op.ENTRY.family


class AttentionPattern:
    family = FAMILY

    def find(self, node: Node, ctx: FuseContext) -> Rewrite | Reject | None:
        site = read(node)
        while isinstance(site, Site):
            refuted = refutations(site.claims, ctx.evaluator)
            if not refuted:
                break
            for claim, reason in refuted:  # read again, those nodes as the tensors they are
                claim.node.meta[REFUTED] = reason
                ctx.report.refuted.append(Missed(site_name(site.out), FAMILY, reason))
            site = read(node)
        if site is None or isinstance(site, Reject):
            return site
        return check(site) or rewrite(site)
