"""The model: SmolLM2 (Llama) read from its GGUF file (:mod:`tokenlake.model.llama`): its
weights, tokenizer, layer math and a float reference. The compute engine that runs it over
the pool is :mod:`tokenlake.engines.compute`."""
