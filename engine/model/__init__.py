"""The target model: a Llama-architecture transformer over static KV caches (transformer.py), the
rows of a batched step (rows.py) and its projections on packed weights (packed.py)."""
