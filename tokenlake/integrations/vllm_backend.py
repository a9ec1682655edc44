"""vLLM's CPU attention backend with the TokenLake connector's query mode
(:mod:`tokenlake.integrations.vllm_query`).

vLLM (0.32, CPU) always picks its ``CPU_ATTN`` backend and lets an out-of-tree package
replace a backend's class (``register_backend`` in
``vllm/v1/attention/backends/registry.py``); :mod:`tokenlake.integrations.vllm_plugin`
does that from a ``vllm.general_plugins`` entry point. :class:`TokenLakeAttentionImpl` is
``CPU_ATTN``'s own implementation, unchanged, unless the engine's KV-transfer config names
the TokenLake connector in query mode.
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

CONNECTOR = "TokenLakeConnector"


def query_mode_configured(vllm_config) -> bool:
    """Whether ``vllm_config`` runs the TokenLake connector in query mode."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or getattr(kv, "kv_connector", None) != CONNECTOR:
        return False
    return (kv.kv_connector_extra_config or {}).get("mode", "load") == "query"


class TokenLakeAttentionImpl(CPUAttentionBackendImpl):
    """``CPU_ATTN``'s implementation, with the pooled prefix attended through TokenLake
    when the connector runs in query mode (decoder self-attention only)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config
        from vllm.v1.attention.backend import AttentionType

        self.tokenlake_query = (query_mode_configured(get_current_vllm_config())
                                and self.attn_type == AttentionType.DECODER)
        if self.tokenlake_query:
            self._check_query_mode()

    def _check_query_mode(self) -> None:
        """The pool's query engines compute plain softmax attention with scale
        ``1/sqrt(head_dim)``; refuse a layer that needs anything else."""
        from tokenlake.core.errors import ConfigError

        unsupported = {
            "a sliding window": self.sliding_window not in (None, -1),
            "ALiBi": self.alibi_slopes is not None,
            "a logits soft cap": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            "an FP8 KV cache": self.is_fp8_kv_cache,
            f"the softmax scale {self.scale} (the pool uses 1/sqrt({self.head_size}))":
                abs(self.scale - self.head_size ** -0.5) > 1e-6 * self.scale,
        }
        bad = [what for what, yes in unsupported.items() if yes]
        if bad:
            raise ConfigError(f"the query mode cannot serve a layer with {', '.join(bad)}")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if not self.tokenlake_query or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        n = attn_metadata.num_actual_tokens
        pooled = get_kv_transfer_group().attend(layer.layer_name, query[:n], key[:n], value[:n],
                                                attn_metadata, self.scale)
        if pooled is None or not pooled[2]:
            # requests the pool does not serve this step: vLLM's own attention over its
            # blocks (right for every request whose tokens this instance computed itself)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                            output_scale, output_block_scale)
        if pooled is not None:
            rows, out, _ = pooled  # rows: a slice or an index tensor
            output[rows] = out.reshape(-1, *output.shape[1:]).to(output.dtype)
        return output


class TokenLakeAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with :class:`TokenLakeAttentionImpl` (same name, metadata, cache)."""

    @staticmethod
    def get_impl_cls() -> type[TokenLakeAttentionImpl]:
        return TokenLakeAttentionImpl

