"""Static shapes for decode, verify and head steps, replayed as CUDA graphs on a GPU.

A small model on a GPU is bound by kernel launches and Python, not by arithmetic (the fixture:
transformers ``generate`` 6.46 ms/token on an H200, verify cost flat from 1 to 128 tokens). In the
manner of gpt-fast and vLLM, every step after the prefill runs with fixed shapes so it can be
captured once and replayed:

- the query count is padded up to a bucket (1, 2, 4, ..., 128): a decode step is bucket 1, a verify
  pass over a tree of n tokens the bucket holding n + 1 (its static tree size), a head pass the
  bucket holding its pairs;
- attention reads the whole preallocated KV cache under an explicit mask instead of a slice of the
  current length;
- padded queries write their KV to slots after the real ones (free tree slots, overwritten before
  anything attends to them) and attend only to themselves, so every value stays finite.

``StaticShapes`` runs that padded step eagerly where there is no GPU (the CPU tests check that it
is lossless) and captures it as a CUDA graph per shape on ``cuda``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .step import Step

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def bucket(q: int) -> int | None:
    """The padded query count for ``q`` queries, or None when none is large enough (run eagerly)."""
    return next((b for b in BUCKETS if b >= q), None)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[Tensor]
    outputs: tuple[Tensor, ...]


class StaticShapes:
    """Runs ``fn(*inputs)`` on padded, fixed-shape inputs: eagerly, or replayed from a CUDA graph
    captured the first time each key (shape) is seen. ``fn`` must be the same for the same key."""

    def __init__(self, use_graphs: bool):
        self.use_graphs = use_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    def __call__(self, key: tuple, fn: Callable[..., tuple[Tensor, ...]], *inputs: Tensor) -> tuple[Tensor, ...]:
        if not self.use_graphs:
            return fn(*inputs)
        entry = self.graphs.get(key) or self._capture(key, fn, inputs)
        for static, value in zip(entry.inputs, inputs, strict=True):
            static.copy_(value)
        entry.graph.replay()
        return tuple(out.clone() for out in entry.outputs)  # the next replay overwrites the static outputs

    def _capture(self, key: tuple, fn: Callable[..., tuple[Tensor, ...]], inputs: tuple[Tensor, ...]) -> _Graph:
        static = [x.clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (allocator, kernel selection)
            for _ in range(2):
                fn(*static)  # writes only the cache slots this step writes anyway
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*static)
        self.graphs[key] = entry = _Graph(graph, static, outputs)
        return entry


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` [1, q, ...] with zero rows appended up to ``rows``."""
    return torch.cat([x, x.new_zeros(1, rows - x.shape[1], *x.shape[2:])], dim=1)


class StaticTarget:
    """The target with static-shape steps: the same call as ``Transformer.forward``. A prefill
    (``last_logits_only``) or a step that no bucket fits runs the model as is."""

    def __init__(self, model, use_graphs: bool):
        self.model = model
        self.runner = StaticShapes(use_graphs)

    def __getattr__(self, name):  # embed_tokens, lm_head, config, max_seq_len, compact_cache, ...
        return getattr(self.model, name)

    def __call__(
        self, input_ids: Tensor, at: Tensor | Step, last_logits_only: bool = False, taps: tuple[int, ...] = ()
    ) -> tuple[Tensor, Tensor]:
        q, size = input_ids.shape[1], bucket(input_ids.shape[1])
        if size is None or last_logits_only or not isinstance(at, Step):
            return self.model(input_ids, at, last_logits_only, taps)
        cache_len = self.model.max_seq_len

        def forward(ids, pos, slots, mask):
            return self.model(ids, Step(pos, slots, mask, cache_len), taps=taps)

        step = at.padded(size, cache_len)
        assert step.mask is not None  # a padded step always brings its full-cache mask
        logits, hidden = self.runner(
            (size, taps), forward, _pad_rows(input_ids, size), step.positions, step.slots, step.mask
        )
        return logits[:, :q], hidden[:, :q]


class StaticHeadStep:
    """A draft head's cached ``step`` with static shapes (the same call)."""

    def __init__(self, head, use_graphs: bool):
        self.head, self.use_graphs = head, use_graphs
        self.runner = StaticShapes(use_graphs)
        self.cache = head.cache

    def __call__(self, features: Tensor, input_ids: Tensor, embed_tokens, at: Step) -> Tensor:
        head = self.head
        q, size = input_ids.shape[1], bucket(input_ids.shape[1])
        if size is None:
            return head.step(features, input_ids, embed_tokens, at)
        if head.cache is not self.cache:  # setup_drafting reallocated it: graphs point at the old one
            self.runner, self.cache = StaticShapes(self.use_graphs), head.cache
        cache_len = head.cache.k.shape[2]

        def step(feats, ids, pos, slots, mask):
            return (head.step(feats, ids, embed_tokens, Step(pos, slots, mask, cache_len)),)

        padded = at.padded(size, cache_len)
        assert padded.mask is not None
        key = (size, features.shape[-1], features.dtype)
        (out,) = self.runner(
            key,
            step,
            _pad_rows(features, size),
            _pad_rows(input_ids, size),
            padded.positions,
            padded.slots,
            padded.mask,
        )
        return out[:, :q]
