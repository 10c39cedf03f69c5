"""What a mask's factors are read as, by positions: a linear function of the query and key
positions, a half-plane of the scores (causal, a sliding window, any band's edge), a prefix LM's
keys seen by every query, and packed documents' ids. Plain values: the readers that make them are
in `index_arithmetic.py` (`Linear`) and `index_masks.py`, the claims that check them in
`claims.py`."""

from __future__ import annotations

import dataclasses

from torch.fx import Node


@dataclasses.dataclass(frozen=True)
class Linear:
    """`q * q_idx + kv * kv_idx + constant`, for the query and key positions of a score."""

    q: int = 0
    kv: int = 0
    constant: int = 0

    def __sub__(self, other: Linear) -> Linear:
        return Linear(self.q - other.q, self.kv - other.kv, self.constant - other.constant)

    def __add__(self, other: Linear) -> Linear:
        return Linear(self.q + other.q, self.kv + other.kv, self.constant + other.constant)


@dataclasses.dataclass(frozen=True)
class HalfPlane:
    """The scores where `kv - q <= bound` (`upper`) or `kv - q >= bound` (not `upper`)."""

    upper: bool
    bound: int

    @property
    def causal(self) -> bool:
        return self.upper and self.bound == 0

    def complement(self) -> HalfPlane:
        return HalfPlane(not self.upper, self.bound + 1 if self.upper else self.bound - 1)

    def __str__(self) -> str:
        if self.causal:
            return "causal"
        if not self.upper and self.bound <= 0:
            return f"a sliding window of {1 - self.bound} keys"
        return f"the keys with kv - q {'<=' if self.upper else '>='} {self.bound}"


@dataclasses.dataclass(frozen=True)
class Prefix:
    """Keys before `length + offset` (`length` an integer tensor constant along the positions, or
    None for 0) seen by every query, beside those the causal triangle leaves; `factor` and
    `keeps` are the mask factor it was read from."""

    length: Node | None
    offset: int
    factor: Node
    keeps: bool


@dataclasses.dataclass(frozen=True)
class Documents:
    """Query ids (..., Lq, 1) and key ids (..., 1, Lk) whose equality keeps a score: a packed
    batch's document mask, which the kernel tests from the ids."""

    q: Node
    kv: Node
