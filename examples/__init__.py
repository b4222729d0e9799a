"""Runnable examples: `python -m examples.gateway`, `python -m examples.grpc_server`,
`python -m examples.otel_console` (from the repository root)."""
