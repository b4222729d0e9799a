"""The engine benchmark against transformers' own generation, in one run (run.py):
`python -m ace_mw.engine.bench`."""
