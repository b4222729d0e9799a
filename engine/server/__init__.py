"""The engine's OpenAI-compatible streaming server (app.py): `python -m ace_mw.engine.server`."""
