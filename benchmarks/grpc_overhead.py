"""What AceSpecDecInterceptor costs a unary-stream generation RPC.

    python benchmarks/grpc_overhead.py [--rounds 4] [--seconds 2] [--concurrency 4] [--sequential 100]

One grpc.server process per variant on loopback, each serving ace.example.v1.Generation whose
GenerateStream yields 100 messages (the last with acceptance figures): `plain`; `floor`, an
interceptor that only rebuilds the handler and re-yields (the least any response observer costs);
and `ace`, AceSpecDecInterceptor in prod mode (decide from metadata and message, set the directive
fields, publish the contextvar, read figures from each message, feed the breaker). Interleaved
rounds; per round the calls/s of `--concurrency` client threads for `--seconds` with the server's
CPU time per call, then the time to the first message of sequential calls, alternating between the
variants call by call. Prints medians and the ratio to plain.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from variant_servers import arguments, cpu_seconds, report, variant_servers

from ace_mw.integrations import AceSpecDecInterceptor, generation_pb2_grpc
from ace_mw.integrations import generation_pb2 as pb

VARIANTS = ("plain", "floor", "ace")
MESSAGES = 100
CONFIG = {"mode": "prod", "paths": ["/ace.example.v1.Generation/GenerateStream"]}
REQUEST = pb.GenerateRequest(model="bench", prompt="Tell me about speculative decoding.", temperature=0.0)
METADATA = (("authorization", "Bearer sk-bench"),)


class Generation(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.token = pb.GenerateResponse(text=" token")
        self.last = pb.GenerateResponse(
            text=" end",
            finish_reason="stop",
            speculative_decoding=pb.SpeculativeDecodingStats(
                num_draft_tokens=200, num_accepted_draft_tokens=150, num_spec_steps=40, output_tokens=MESSAGES
            ),
        )

    def GenerateStream(self, request, context):
        for _ in range(MESSAGES - 1):
            yield self.token
        yield self.last


class Floor(grpc.ServerInterceptor):
    """The least a response-observing interceptor costs: rebuild the handler, re-yield messages."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)

        def stream(request, context):
            yield from handler.unary_stream(request, context)

        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)


def serve(variant: str) -> None:
    """Child process: serve one variant and print its port."""
    interceptors = {"plain": [], "floor": [Floor()], "ace": [AceSpecDecInterceptor(CONFIG)]}[variant]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=interceptors)
    generation_pb2_grpc.add_GenerationServicer_to_server(Generation(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def throughput(stub, pid: int, seconds: float, concurrency: int) -> tuple[float, float]:
    """(calls/s, server CPU seconds per call) with `concurrency` client threads."""
    counts = [0] * concurrency
    deadline = time.perf_counter() + seconds

    def worker(i: int) -> None:
        while time.perf_counter() < deadline:
            for _ in stub.GenerateStream(REQUEST, metadata=METADATA):
                pass
            counts[i] += 1

    start, cpu = time.perf_counter(), cpu_seconds(pid)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    return sum(counts) / elapsed, cpu / sum(counts)


def first_message(stubs: dict, calls: int) -> dict[str, list[float]]:
    """Sequential calls, alternating between the variants call by call (load spikes hit all)."""
    samples: dict[str, list[float]] = {v: [] for v in stubs}
    for _ in range(calls):
        for variant, stub in stubs.items():
            start = time.perf_counter()
            stream = stub.GenerateStream(REQUEST, metadata=METADATA)
            next(stream)
            samples[variant].append(time.perf_counter() - start)
            for _ in stream:
                pass
    return samples


def measure(servers: dict[str, tuple[int, int]], args) -> dict[str, dict[str, list[float]]]:
    results = {v: {"rate": [], "cpu": [], "latency": []} for v in servers}
    channels = {v: grpc.insecure_channel(f"127.0.0.1:{port}") for v, (port, _) in servers.items()}
    try:
        stubs = {}
        for variant, channel in channels.items():
            grpc.channel_ready_future(channel).result(timeout=20)
            stubs[variant] = generation_pb2_grpc.GenerationStub(channel)
            throughput(stubs[variant], servers[variant][1], 0.3, args.concurrency)  # warm-up
        for _ in range(args.rounds):
            for variant, stub in stubs.items():
                rps, cpu = throughput(stub, servers[variant][1], args.seconds, args.concurrency)
                results[variant]["rate"].append(rps)
                results[variant]["cpu"].append(cpu)
            for variant, samples in first_message(stubs, args.sequential).items():
                results[variant]["latency"].extend(samples)
    finally:
        for channel in channels.values():
            channel.close()
    return results


def main() -> None:
    args = arguments("AceSpecDecInterceptor overhead on a unary-stream RPC", VARIANTS, concurrency=4)
    if args.serve:
        serve(args.serve)
        return
    with variant_servers(__file__, VARIANTS) as servers:
        report(
            f"unary-stream RPC, {MESSAGES} messages/call, sync grpc on loopback",
            measure(servers, args),
            "call",
            "first",
        )


if __name__ == "__main__":
    main()
