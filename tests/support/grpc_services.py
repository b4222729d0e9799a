"""Example Generation servicers for the gRPC interceptor tests (sync, aio yielding, aio write()).

Each response's text reports what the servicer saw: the speculative fields of the request message
and the decision published through `current_decision()`, so tests read it on the client side.
The last streamed message (and every unary response) carries the scripted acceptance figures.
"""

from __future__ import annotations

import json
import threading

from ace_mw.integrations import current_decision, generation_pb2_grpc
from ace_mw.integrations import generation_pb2 as pb

GENERATE = "/ace.example.v1.Generation/Generate"
GENERATE_STREAM = "/ace.example.v1.Generation/GenerateStream"
CHUNKS = ("Hel", "lo", ", ", "wor", "ld")


class Behaviour:
    """What the servicers do next; mutable between calls."""

    def __init__(self) -> None:
        self.figures: tuple[int, int, int] | None = (10, 8, 4)  # drafted, accepted, steps
        self.hold_after: int | None = None  # stream: wait for `release` after this many
        self.release = threading.Event()


def seen(request: pb.GenerateRequest) -> str:
    decision = current_decision()
    return json.dumps(
        {
            "use": request.use_speculative_decoding,
            "k": request.num_speculative_tokens,
            "algorithm": request.speculative_algorithm,
            "outcome": decision.outcome if decision else None,
            "enabled": decision.directive.enabled if decision else None,
        }
    )


def reply(behaviour: Behaviour, text: str, last: bool) -> pb.GenerateResponse:
    response = pb.GenerateResponse(text=text, finish_reason="stop" if last else "")
    if last and behaviour.figures:
        drafted, accepted, steps = behaviour.figures
        response.speculative_decoding.CopyFrom(
            pb.SpeculativeDecodingStats(
                num_draft_tokens=drafted,
                num_accepted_draft_tokens=accepted,
                num_spec_steps=steps,
                output_tokens=len(CHUNKS),
            )
        )
    return response


def stream_texts(request: pb.GenerateRequest) -> list[str]:
    return [seen(request), *CHUNKS]


class SyncGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour

    def Generate(self, request, context):
        return reply(self.behaviour, seen(request), last=True)

    def GenerateStream(self, request, context):
        texts = stream_texts(request)
        for i, text in enumerate(texts):
            if i == self.behaviour.hold_after:
                self.behaviour.release.wait(30)
            yield reply(self.behaviour, text, last=i == len(texts) - 1)


class AioGeneration(generation_pb2_grpc.GenerationServicer):
    """grpc.aio servicer whose stream is an async generator."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour

    async def Generate(self, request, context):
        return reply(self.behaviour, seen(request), last=True)

    async def GenerateStream(self, request, context):
        texts = stream_texts(request)
        for i, text in enumerate(texts):
            yield reply(self.behaviour, text, last=i == len(texts) - 1)


class AioWritingGeneration(AioGeneration):
    """grpc.aio servicer that streams with `context.write()` instead of yielding."""

    async def GenerateStream(self, request, context):
        texts = stream_texts(request)
        for i, text in enumerate(texts):
            await context.write(reply(self.behaviour, text, last=i == len(texts) - 1))
