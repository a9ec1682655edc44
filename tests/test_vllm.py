"""The shipped model as a Hugging Face directory (issue #18, first part): the export
computes what the GGUF computes (same tokens, same logits within float rounding). vLLM's
greedy output on it equals the reference engine's:
tests/test_vllm_connector.py::test_vllm_serves_the_export_with_the_reference_output, on
an engine that module starts anyway."""

from __future__ import annotations

import pytest
import torch

from tokenlake.integrations.hf_export import unpermute_rope_rows


def test_unpermute_moves_interleaved_pairs_to_the_two_halves():
    heads, head_dim = 2, 8
    rows = torch.arange(heads * head_dim, dtype=torch.float32)[:, None].repeat(1, 3)
    out = unpermute_rope_rows(rows, heads)[:, 0].long().tolist()
    # per head: rows 0,2,4,6 (first of each pair) then 1,3,5,7 (second of each pair)
    assert out == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    with pytest.raises(ValueError):
        unpermute_rope_rows(torch.zeros(6, 2), 4)


def test_the_export_computes_what_the_gguf_computes(smollm2, smollm2_hf):
    transformers = pytest.importorskip("transformers")
    _, tok, ref = smollm2
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    text = "The capital of France is"
    ids = tok.encode(text)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    msgs = [{"role": "user", "content": "Say hi."}]
    assert hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                      return_dict=False) == tok.apply_chat_template(msgs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32)
    with torch.no_grad():
        got = hf(torch.tensor([ids])).logits[0, -1]
    want, _ = ref.prefill(ids)  # the last position's logits
    torch.testing.assert_close(got, want.to(got.dtype), atol=1e-3, rtol=0)
    out = ref.generate(ids, 6, stop_ids=())
    hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    assert hf_out[0, len(ids):].tolist() == out.output_ids

