"""A gRPC generation server with the ace-mw interceptor.

    python -m examples.grpc_server [--port 50051] [--aio]

The service is `ace.example.v1.Generation` (ace_mw/integrations/generation.proto). The toy engine
below echoes the prompt word by word; it honours the speculative fields the interceptor sets on the
request and reports acceptance figures on its last message, which the interceptor feeds back into
the tenant's breaker. Try it with the stub:

    stub.Generate(GenerateRequest(model="m", prompt="hi there", temperature=0.0),
                  metadata=[("authorization", "Bearer sk-1")])
"""

from __future__ import annotations

import argparse
import asyncio
import math
from concurrent import futures

import grpc

from ace_mw.integrations import (
    AceSpecDecAioInterceptor,
    AceSpecDecInterceptor,
    current_decision,
    generation_pb2_grpc,
)
from ace_mw.integrations import (
    generation_pb2 as pb,
)

CONFIG = {
    "mode": "prod",
    "paths": ["/ace.example.v1.Generation/Generate", "/ace.example.v1.Generation/GenerateStream"],
}


def toy_generate(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """Echo the prompt one word per message; the last message carries the figures."""
    words = request.prompt.split() or ["hello"]
    responses = [pb.GenerateResponse(text=word + " ") for word in words]
    last = responses[-1]
    last.finish_reason = "stop"
    if request.use_speculative_decoding:
        k = request.num_speculative_tokens or 5
        steps = math.ceil(len(words) / 2)  # this toy engine accepts one draft token per step
        last.speculative_decoding.CopyFrom(
            pb.SpeculativeDecodingStats(
                num_draft_tokens=steps * k,
                num_accepted_draft_tokens=len(words) - steps,
                num_spec_steps=steps,
                output_tokens=len(words),
            )
        )
    decision = current_decision()
    if decision is not None:
        print(f"{decision.outcome:8} {decision.reason:14} speculate={request.use_speculative_decoding}", flush=True)
    return responses


class Generation(generation_pb2_grpc.GenerationServicer):
    def Generate(self, request, context):
        texts = toy_generate(request)
        merged = pb.GenerateResponse(text="".join(r.text for r in texts), finish_reason="stop")
        merged.speculative_decoding.CopyFrom(texts[-1].speculative_decoding)
        return merged

    def GenerateStream(self, request, context):
        yield from toy_generate(request)


class AioGeneration(Generation):
    async def Generate(self, request, context):
        return Generation.Generate(self, request, context)

    async def GenerateStream(self, request, context):
        for response in toy_generate(request):
            yield response


def serve_sync(address: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[AceSpecDecInterceptor(CONFIG)])
    generation_pb2_grpc.add_GenerationServicer_to_server(Generation(), server)
    port = server.add_insecure_port(address)
    server.start()
    print(f"listening on {address.rsplit(':', 1)[0]}:{port}", flush=True)
    server.wait_for_termination()


async def serve_aio(address: str) -> None:
    server = grpc.aio.server(interceptors=[AceSpecDecAioInterceptor(CONFIG)])
    generation_pb2_grpc.add_GenerationServicer_to_server(AioGeneration(), server)
    port = server.add_insecure_port(address)
    await server.start()
    print(f"listening on {address.rsplit(':', 1)[0]}:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description="gRPC generation server with the ace-mw interceptor")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--aio", action="store_true", help="serve with grpc.aio")
    args = parser.parse_args()
    address = f"{args.host}:{args.port}"
    if args.aio:
        asyncio.run(serve_aio(address))
    else:
        serve_sync(address)


if __name__ == "__main__":
    main()
