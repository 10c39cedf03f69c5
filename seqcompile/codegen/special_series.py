"""Chebyshev series of the special functions the pointwise kernels spell (the modified Bessel
functions of order 0 and 1, scaled, and the scaled complementary error function), fitted here
from torch's own float64 implementation at Chebyshev nodes. Each piece is smooth on its interval,
so its series reaches float64 precision (about 1e-14 relative) in 20 to 30 terms; the helpers
template sums them by Clenshaw's recurrence.

Each series maps its interval onto t in [-1, 1]:
- `I0E_NEAR`, `I1E_NEAR`: exp(-x) I0(x) and exp(-x) I1(x) / x for 0 <= x <= 8, t = x / 4 - 1;
- `I0E_FAR`, `I1E_FAR`: sqrt(x) exp(-x) I0(x) and sqrt(x) exp(-x) I1(x) for x >= 8,
  t = 16 / x - 1;
- `ERFCX_NEAR`: exp(x^2) erfc(x) for 0 <= x <= 4, t = x / 2 - 1;
- `ERFCX_FAR`: x exp(x^2) erfc(x) for x >= 4, t = 8 / x - 1.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch

Tensor = torch.Tensor


def chebyshev(f: Callable[[Tensor], Tensor], terms: int) -> tuple[float, ...]:
    """The first `terms` coefficients c_j of f(t) = sum_j c_j T_j(t) on [-1, 1], from f at as
    many Chebyshev nodes (float64)."""
    k = torch.arange(terms, dtype=torch.float64)
    theta = math.pi * (k + 0.5) / terms
    values = f(torch.cos(theta))
    c = (2.0 / terms) * (values[None, :] * torch.cos(k[:, None] * theta[None, :])).sum(1)
    c[0] /= 2
    return tuple(c.tolist())


def _near(fn: Callable[[Tensor], Tensor], half: float) -> Callable[[Tensor], Tensor]:
    """fn at x = half * (t + 1)."""
    return lambda t: fn(half * (t + 1))


def _far(fn: Callable[[Tensor], Tensor], start: float) -> Callable[[Tensor], Tensor]:
    """fn at x = 2 * start / (t + 1) (t = 2 * start / x - 1)."""
    return lambda t: fn(2 * start / (t + 1))


_S = torch.special
SERIES = {
    "I0E_NEAR": chebyshev(_near(_S.i0e, 4.0), 30),
    "I1E_NEAR": chebyshev(_near(lambda x: _S.i1e(x) / x, 4.0), 30),
    "I0E_FAR": chebyshev(_far(lambda x: x.sqrt() * _S.i0e(x), 8.0), 20),
    "I1E_FAR": chebyshev(_far(lambda x: x.sqrt() * _S.i1e(x), 8.0), 20),
    "ERFCX_NEAR": chebyshev(_near(_S.erfcx, 2.0), 30),
    "ERFCX_FAR": chebyshev(_far(lambda x: x * _S.erfcx(x), 4.0), 20),
}
"""The series by the name the helpers template reads them under."""


FUNCTIONS = re.compile(
    r"\b(erfc|erfcx|log_ndtr|ndtri|bessel_i0e|bessel_i1e|unscaled|polygamma|nextafter)\("
)
"""The helpers of `pointwise_special.py.jinja` a kernel's code calls by name."""


def needs_special(*code: Iterable[str]) -> bool:
    """Whether generated lines call a helper of `pointwise_special.py.jinja`: kernels that do
    not leave its series out of their text, which the interpreter would run through at every
    import."""
    return any(FUNCTIONS.search(line) for lines in code for line in lines)
