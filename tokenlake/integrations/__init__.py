"""TokenLake inside other serving frameworks: vLLM (:mod:`tokenlake.integrations.vllm`)
and the Hugging Face export of the shipped model it loads
(:mod:`tokenlake.integrations.hf_export`)."""
