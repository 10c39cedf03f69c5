"""Stage 2, normalize: one spelling for each idea, so patterns state their math once. Each rule
is a small named function from a node to its replacement (or None), in the module of its family
(`spellings`, `in_place`, `matmul`, `special`, `written_out`, `nll`, `loss`); `driver` applies
them all until none fires."""

from seqcompile.normalize.driver import RULES, normalize_graph

__all__ = ["RULES", "normalize_graph"]
