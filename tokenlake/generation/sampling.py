"""Choosing the next token from a row of logits: greedy, or sampled with temperature and
nucleus (top-p) truncation, reproducibly when a seed is given.

Greedy (``temperature`` below :data:`MIN_TEMPERATURE`, 0 included) is ``argmax`` -- the
same choice the reference engine makes, so greedy output through the pool is
token-identical to it. Sampling draws from ``softmax(logits / temperature)`` restricted
to the smallest set of most likely tokens whose probability reaches ``top_p`` (the
nucleus); a request's draws come from its own ``torch.Generator``, so a seed gives the
same tokens whatever else is batched with it.

Logits that make the choice undefined (NaN or +inf; probabilities that are not finite or
sum to 0) raise :class:`SamplingError`: the serving loop ends that one request with
``finish_reason == "error"`` and serves the others on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tokenlake.core.errors import TokenLakeError

#: Temperatures below this are taken as 0 (greedy), as vLLM does (its ``_SAMPLING_EPS``).
#: Below it the distribution is one-hot except between logits closer than ~1e-4, and
#: below ~1e-37 ``logits / temperature`` overflows float32, so the softmax is NaN.
MIN_TEMPERATURE = 1e-5


class SamplingError(TokenLakeError, ValueError):
    """Sampling parameters out of range, or logits no token can be chosen from."""


@dataclass(frozen=True)
class SamplingParams:
    """How a request chooses its tokens.

    ``temperature``: in [0, 100]; below :data:`MIN_TEMPERATURE` (1e-5, 0 included) the
    request is greedy (argmax, no generator), so a temperature such as 1e-40, which would
    make ``logits / temperature`` overflow, is served as greedy rather than refused.
    ``top_p``: in (0, 1], the nucleus. ``seed``: the generator's seed (None: a fresh one).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def generator(self) -> torch.Generator | None:
        """The request's random stream (None when greedy)."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else random.SystemRandom().getrandbits(63)
        return torch.Generator().manual_seed(seed % (1 << 63))


GREEDY = SamplingParams()


def next_token(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> int:
    """The token ``params`` choose from one row of ``logits`` (``[vocab]``, any float
    dtype). Raises :class:`SamplingError` when the row holds NaN or +inf, or when its
    probabilities are not finite."""
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise SamplingError("the logits hold NaN or +inf: no token can be chosen")
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        raise SamplingError(f"softmax(logits / {params.temperature}) is not a distribution")
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the more likely tokens
        sorted_p = torch.where(before < params.top_p, sorted_p, torch.zeros_like(sorted_p))
        pick = torch.multinomial(sorted_p, 1, generator=generator)
        return int(order[pick])
    return int(torch.multinomial(probs, 1, generator=generator))
