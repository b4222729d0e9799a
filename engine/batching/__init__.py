"""Continuous batching for the in-process engine (``scheduler.BatchEngine``)."""

from .scheduler import BatchEngine

__all__ = ["BatchEngine"]
