"""vLLM's ``vllm.general_plugins`` entry point of TokenLake (``pyproject.toml``): vLLM
calls :func:`register` in every process it starts. Kept free of vLLM imports at module
level: it runs early in vLLM's start-up, and the backend module loads only when vLLM
resolves its attention backend."""

from __future__ import annotations

BACKEND = "tokenlake.integrations.vllm_backend.TokenLakeAttentionBackend"


def register() -> None:
    """``CPU_ATTN`` becomes :class:`~tokenlake.integrations.vllm_backend.TokenLakeAttentionBackend`:
    the same backend, unless the TokenLake connector runs in query mode."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
