import os

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


def started_redis():
    """A real redis-server on a free loopback port. Skipped only where the binary is missing on a
    developer's machine; CI (.ci/run installs it) must have it."""
    from support.redis_server import RedisServer, available

    if not available():
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing on CI: .ci/run installs it with apt-get")
        pytest.skip("redis-server is not installed here (apt-get install redis-server)")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[redis]')")
    return RedisServer().start()


@pytest.fixture
def redis_server():
    server = started_redis()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis_server():
    server = started_redis()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_pools():
    """Real vLLM 0.32 servers of the bundled model, started once per test run (the one module that
    drives them: module scope stops them, and frees their memory and cores, once it is done): plain,
    prompt lookup and the shipped EAGLE-3 head (name -> URL). `--enforce-eager`: a server is ready
    in about 25 s instead of the 1-3 minutes its compile takes, and these tests check what the
    servers answer, not how fast. Skipped where the venv is missing on a developer's machine; CI
    (.ci/run builds it) must have it."""
    vllm = pytest.importorskip("ace_mw.demo.vllm")
    if vllm.python() is None:
        if os.environ.get("CI"):
            pytest.fail(f"vLLM is missing on CI: .ci/run builds it ({vllm.HOW_TO_GET})")
        pytest.skip(f"vLLM is not built here: {vllm.HOW_TO_GET}")
    import dataclasses

    specs = vllm.bundled_specs(max_num_seqs=4)
    wanted = {
        name: dataclasses.replace(specs[name], extra=("--enforce-eager",)) for name in ("baseline", "ngram", "eagle3")
    }
    with vllm.pools(wanted) as servers:
        yield {name: server.url for name, server in servers.items()}
