"""AceSpecDecAioInterceptor on a real grpc.aio server and channel: coroutine, async-generator and
context.write() handlers."""

from __future__ import annotations

import asyncio
import json
from concurrent import futures

import grpc
import pytest
from support.grpc_services import (
    CHUNKS,
    GENERATE,
    GENERATE_STREAM,
    AioGeneration,
    AioWritingGeneration,
    Behaviour,
    SyncGeneration,
)
from support.servers import serve_grpc_aio
from support.tenants import tenant

from ace_mw.config import AceConfig
from ace_mw.controller import AceController
from ace_mw.integrations import AceSpecDecAioInterceptor, generation_pb2_grpc
from ace_mw.integrations import generation_pb2 as pb

CONFIG = {"mode": "prod", "paths": [GENERATE, GENERATE_STREAM]}
KEY = "sk-aio"
AUTH = (("authorization", f"Bearer {KEY}"),)
TENANT = tenant(KEY)


def request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(model="m", prompt="hi", **{"temperature": 0.0, **fields})


def with_stub(servicer_class, call, controller=None):
    """Serve one aio server with the interceptor, run `call(stub)` against it, return its result."""
    controller = controller or AceController(AceConfig.from_dict(CONFIG))

    async def main():
        interceptor = AceSpecDecAioInterceptor(controller=controller)
        async with serve_grpc_aio(servicer_class(Behaviour()), [interceptor]) as target:
            async with grpc.aio.insecure_channel(target) as channel:
                return await call(generation_pb2_grpc.GenerationStub(channel))

    return asyncio.run(main())


def test_unary_directive_is_set_and_published():
    async def call(stub):
        return json.loads((await stub.Generate(request(), metadata=AUTH)).text)

    saw = with_stub(AioGeneration, call)
    assert (saw["use"], saw["k"], saw["outcome"]) == (True, 5, "applied")


def test_async_generator_stream_yields_every_message():
    async def call(stub):
        return [r.text async for r in stub.GenerateStream(request(), metadata=AUTH)]

    texts = with_stub(AioGeneration, call)
    assert json.loads(texts[0])["outcome"] == "applied"
    assert texts[1:] == list(CHUNKS)


def test_write_stream_sends_every_message():
    async def call(stub):
        return [r.text async for r in stub.GenerateStream(request(), metadata=AUTH)]

    texts = with_stub(AioWritingGeneration, call)
    assert json.loads(texts[0])["use"] is True
    assert texts[1:] == list(CHUNKS)


@pytest.mark.parametrize("servicer_class", [AioGeneration, AioWritingGeneration], ids=["yield", "write"])
def test_streamed_figures_reach_the_breaker(servicer_class):
    controller = AceController(AceConfig.from_dict(CONFIG))

    async def call(stub):
        return [r async for r in stub.GenerateStream(request(), metadata=AUTH)]

    with_stub(servicer_class, call, controller)
    view = controller.store.view((TENANT, "m"))
    assert (view.samples, view.rolling_alpha) == (1, pytest.approx(0.8))


def test_decision_is_sent_in_trailing_metadata():
    async def call(stub):
        unary = stub.Generate(request(temperature=2.0), metadata=AUTH)
        await unary
        return dict(await unary.trailing_metadata())

    trailing = with_stub(AioGeneration, call)
    assert (trailing["x-ace-speculative-decoding"], trailing["x-ace-speculative-decoding-reason"]) == (
        "gated",
        "temperature",
    )


def test_invalid_override_metadata_is_invalid_argument():
    async def call(stub):
        try:
            await stub.Generate(request(), metadata=(("x-ace-skill-speculative-decoding", "maybe"),))
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()

    code, details = with_stub(AioGeneration, call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "maybe" in details


def test_invalid_override_on_a_write_stream_is_invalid_argument():
    async def call(stub):
        try:
            [r async for r in stub.GenerateStream(request(), metadata=(("x-ace-skill-speculative-decoding", "x"),))]
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    assert with_stub(AioWritingGeneration, call) == grpc.StatusCode.INVALID_ARGUMENT


def test_decision_does_not_leak_between_concurrent_calls():
    async def call(stub):
        calls = [stub.Generate(request(temperature=t), metadata=AUTH) for t in (0.0, 1.5) * 5]
        return [json.loads(r.text)["outcome"] for r in await asyncio.gather(*calls)]

    assert with_stub(AioGeneration, call) == ["applied", "gated"] * 5


def test_sync_handlers_on_an_aio_server_pass_through_undecided():
    async def main():
        interceptor = AceSpecDecAioInterceptor(controller=AceController(AceConfig.from_dict(CONFIG)))
        pool = futures.ThreadPoolExecutor(max_workers=2)
        async with serve_grpc_aio(SyncGeneration(Behaviour()), [interceptor], migration_thread_pool=pool) as target:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                unary = await stub.Generate(request(), metadata=AUTH)
                streamed = [r.text async for r in stub.GenerateStream(request(), metadata=AUTH)]
        pool.shutdown()
        return json.loads(unary.text), streamed

    unary, streamed = asyncio.run(main())
    assert (unary["outcome"], unary["use"]) == (None, False)
    assert streamed[1:] == list(CHUNKS)
