"""ace-mw: a closed-loop speculative-decoding control plane for Python LLM servers."""
__version__ = "0.1.0"
