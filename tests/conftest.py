import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Engine tests on the 2 shared cores: small matmuls run faster on one thread, and far faster
    when other processes keep the second core busy. Restored after the module."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def adapter_registry(monkeypatch):
    """A copy of the global adapter registry for one test: what it registers is gone afterwards."""
    from ace_mw import adapters

    monkeypatch.setattr(adapters, "_REGISTRY", dict(adapters._REGISTRY))
