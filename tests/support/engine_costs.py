"""A cost table for engine tests, so that what the engine drafts never depends on the machine.

Under it drafting pays once the pessimistic end of a request's running acceptance is above about
0.15-0.22: a fresh request drafts (an uninformed estimate's pessimistic end is 0.21) and one
rejected draft makes the next step plain. So on the fixtures every algorithm alternates plain and
speculative steps: the case losslessness must survive, where each step's plan depends on what
earlier steps emitted.
"""

from ace_mw.engine.planning.cost import CostCurve, EngineCosts

ALTERNATING = EngineCosts(
    verify=CostCurve({q: 10.0 + (q - 1) ** 0.8 for q in (1, 2, 4, 8, 16, 32, 64)}),
    draft_model=CostCurve({1: 0.5, 2: 0.6, 64: 2.0}),
    head_level=CostCurve({1: 1.0, 16: 1.5, 64: 4.0}),
    head_commit=CostCurve({1: 0.5, 64: 2.0}),
)
