"""Training EAGLE and EAGLE-3 heads for a target (loop.py) on packed chat data (data.py), and
shipping a trained head (package.py): `python -m ace_mw.engine.train`."""
