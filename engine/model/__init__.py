"""The target model: a Llama-architecture transformer over a static KV cache (transformer.py),
and its CUDA graphs (graphs.py)."""
