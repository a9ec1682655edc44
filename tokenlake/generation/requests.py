"""What a client hands the serving loop and gets back: :class:`GenerationRequest`,
:class:`RequestResult`, and the checks both servers make (:func:`check_request`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenlake.core.errors import PlanError, TokenLakeError
from tokenlake.core.segments import check_salt
from tokenlake.generation.sampling import GREEDY, SamplingParams


class BadRequest(TokenLakeError, ValueError):
    """A request the server cannot serve (empty, unknown token ids, too long)."""


@dataclass(frozen=True)
class GenerationRequest:
    """``prompt_ids`` to continue for at most ``max_new_tokens``, greedily unless
    ``sampling`` says otherwise; a token in ``stop_ids`` ends it (and is output).
    ``cache_salt``: its tenant namespace in the pool (at most 256 characters; ``None``:
    none): its prompt reuses, and its segments are shared with, only requests under the
    same salt (:attr:`tokenlake.core.plans.BatchRequest.cache_salt`)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 32
    stop_ids: tuple[int, ...] = (2,)
    sampling: SamplingParams = GREEDY
    cache_salt: str | None = None


@dataclass
class RequestResult:
    """What happened to one request (filled in as it runs)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0  # prompt tokens served from the pool at admission
    prefill_tokens: int = 0  # prompt tokens computed
    logits: list[torch.Tensor] = field(default_factory=list)  # last-row logits per output token
    done: bool = False
    # once done: "stop" (a stop id), "length", "abort" (cancelled) or "error" (this
    # request failed on its own: its sampling, its token or its stop check; ``error`` says how)
    finish_reason: str | None = None
    error: str | None = None  # why it failed ("SamplingError: ..."), with finish_reason "error"


def check_request(req: GenerationRequest, cfg, used_ids) -> None:
    """Raises :class:`BadRequest` unless ``req`` can run on a model of config ``cfg``
    (vocabulary, context) with an id not among ``used_ids``. Both servers call it."""
    rid = req.request_id
    if rid in used_ids:
        raise BadRequest(f"request id {rid!r} was already used")
    if not req.prompt_ids:
        raise BadRequest(f"request {rid!r}: empty prompt")
    bad = [t for t in req.prompt_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise BadRequest(f"request {rid!r}: token ids outside [0, {cfg.vocab_size}): {bad[:5]}")
    if not isinstance(req.sampling, SamplingParams):
        raise BadRequest(f"request {rid!r}: sampling must be SamplingParams")
    if req.max_new_tokens < 1:
        raise BadRequest(f"request {rid!r}: max_new_tokens must be >= 1")
    try:
        check_salt(req.cache_salt)
    except PlanError as e:
        raise BadRequest(f"request {rid!r}: {e}") from None
    total = len(req.prompt_ids) + req.max_new_tokens
    if total > cfg.max_context:
        raise BadRequest(f"request {rid!r}: {total} tokens exceed the context limit "
                         f"{cfg.max_context}")
