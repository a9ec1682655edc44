"""SmolLM2-135M-Instruct (Llama architecture) on CPU, from its GGUF file.

``weights`` reads the GGUF (config, dequantised float32 tensors), ``tokenizer`` builds
the byte-level BPE tokenizer and the ChatML template from the same file, ``model`` holds
the model's pieces as pure functions (embedding, q/k/v with RoPE, the rest of a layer,
the LM head) that the compute engines share, and ``reference`` is the monolithic oracle
engine with a local KV cache. Importing this package imports nothing heavy; the modules
import torch (and ``weights``/``tokenizer`` gguf/tokenizers).
"""
