"""The model: SmolLM2 (Llama) pieces read from its GGUF file (:mod:`tokenlake.model.llama`)
and the stateless compute engine that runs them over the pool
(:mod:`tokenlake.model.compute`)."""
