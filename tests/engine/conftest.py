"""The engine that the batching and server tests share, and what they derive from it. Module scope:
each module loads its own. A module that needs another engine defines its own `engine`."""

import pytest
from support.batching import every_drafter, held_out_conversations, small_batch
from support.engine_server import solo_answers


@pytest.fixture(scope="module")
def engine():
    """The fixture target with the draft model and both EAGLE heads (at the module's torch threads:
    the batching modules use one, `one_torch_thread`)."""
    return every_drafter()


@pytest.fixture(scope="module")
def batch(engine):
    return small_batch(engine)


@pytest.fixture(scope="module")
def conversations():
    return held_out_conversations()


@pytest.fixture(scope="module")
def solo(engine) -> dict[str, str]:
    return solo_answers(engine)
