"""When drafting pays on this machine: the measured cost of a forward pass (cost.py) and the
per-step choice of what to draft, plain steps included (planner.py)."""
