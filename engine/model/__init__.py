"""The target model: a Llama-architecture transformer over static KV caches (transformer.py), in
the dtype that pays on its device (dtypes.py), the rows of a batched step (rows.py) and its
projections on packed weights (packed.py)."""
