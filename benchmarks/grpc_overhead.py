"""What AceSpecDecInterceptor costs a unary-stream generation RPC.

    python benchmarks/grpc_overhead.py [--rounds 4] [--processes 2] [--seconds 2] [--concurrency 4]
                                       [--sequential 100] [--variants plain ace ...]

`--processes` grpc.server processes per variant on loopback (a process's memory layout moves its
speed by several percent: see asgi_overhead.py), each serving ace.example.v1.Generation whose
GenerateStream yields 100 messages (the last with acceptance figures): `plain`; `floor`, an
interceptor that only rebuilds the handler and re-yields (the least any response observer costs);
and `ace`, AceSpecDecInterceptor in prod mode (decide from metadata and message, set the directive
fields, publish the contextvar, read figures from each message, feed the breaker). Interleaved
rounds of turns, as in asgi_overhead.py (a turn per process index, the variants in rotated order);
per process the calls/s of `--concurrency` client threads for `--seconds` with the server's CPU
time per call, then per round the time to the first message of sequential calls, alternating
between the variants call by call. Prints medians, the ratio to plain and the paired ratio (the
median of each turn's ratio, with its 95 % interval).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from variant_servers import arguments, chosen, cpu_seconds, report, rotation, variant_servers

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


def measure(servers: dict[str, list[tuple[int, int]]], args) -> dict[str, dict[str, list[float]]]:
    """Interleaved rounds, each measuring every process of every variant: a turn per process
    index, the variants in rotated order; `servers` maps variant -> [(port, pid), ...]."""
    results = {v: {"rate": [], "cpu": [], "latency": []} for v in servers}
    channels = {
        (variant, pid): grpc.insecure_channel(f"127.0.0.1:{port}")
        for variant, processes in servers.items()
        for port, pid in processes
    }
    try:
        stubs = {}
        for (variant, pid), channel in channels.items():
            grpc.channel_ready_future(channel).result(timeout=20)
            stubs[variant, pid] = generation_pb2_grpc.GenerationStub(channel)
            throughput(stubs[variant, pid], pid, 0.3, args.concurrency)  # warm-up
        for round_ in range(args.rounds):
            for index in range(args.processes):  # a turn: the index-th process of every variant
                for variant in rotation(list(servers), round_ * args.processes + index):
                    pid = servers[variant][index][1]
                    rps, cpu = throughput(stubs[variant, pid], pid, args.seconds, args.concurrency)
                    results[variant]["rate"].append(rps)
                    results[variant]["cpu"].append(cpu)
            sequential = {v: stubs[v, processes[round_ % len(processes)][1]] for v, processes in servers.items()}
            for variant, samples in first_message(sequential, args.sequential).items():
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
    with variant_servers(__file__, chosen(VARIANTS, args.variants), args.processes) as servers:
        report(
            f"unary-stream RPC, {MESSAGES} messages/call, sync grpc on loopback",
            measure(servers, args),
            "call",
            "first",
        )


if __name__ == "__main__":
    main()
