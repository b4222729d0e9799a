"""What AceSpecDecInterceptor costs a unary-stream generation RPC.

    python benchmarks/grpc_overhead.py [--rounds 4] [--seconds 2] [--concurrency 4]

One grpc.server process per variant on loopback, both serving ace.example.v1.Generation whose
GenerateStream yields 100 messages (the last with acceptance figures): `plain`, and `ace` with the
interceptor in prod mode (decide from metadata and message, set the directive fields, publish the
contextvar, read figures from each message, feed the breaker). Interleaved rounds; per round the
requests/s of `--concurrency` client threads for `--seconds`, then the time to the first message of
sequential calls. Prints medians and the ratio to plain.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc

from ace_mw.integrations import AceSpecDecInterceptor, generation_pb2 as pb, generation_pb2_grpc

VARIANTS = ("plain", "ace")
MESSAGES = 100
CONFIG = {"mode": "prod", "paths": ["/ace.example.v1.Generation/GenerateStream"]}
REQUEST = pb.GenerateRequest(model="bench", prompt="Tell me about speculative decoding.", temperature=0.0)
METADATA = (("authorization", "Bearer sk-bench"),)


class Generation(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.token = pb.GenerateResponse(text=" token")
        self.last = pb.GenerateResponse(text=" end", finish_reason="stop", speculative_decoding=pb.SpeculativeDecodingStats(
            num_draft_tokens=200, num_accepted_draft_tokens=150, num_spec_steps=40, output_tokens=MESSAGES))

    def GenerateStream(self, request, context):
        for _ in range(MESSAGES - 1):
            yield self.token
        yield self.last


def serve(variant: str) -> None:
    """Child process: serve one variant and print its port."""
    interceptors = [AceSpecDecInterceptor(CONFIG)] if variant == "ace" else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=interceptors)
    generation_pb2_grpc.add_GenerationServicer_to_server(Generation(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def throughput(stub, seconds: float, concurrency: int) -> float:
    counts = [0] * concurrency
    deadline = time.perf_counter() + seconds

    def worker(i: int) -> None:
        while time.perf_counter() < deadline:
            for _ in stub.GenerateStream(REQUEST, metadata=METADATA):
                pass
            counts[i] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def first_message(stub, calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        stream = stub.GenerateStream(REQUEST, metadata=METADATA)
        next(stream)
        samples.append(time.perf_counter() - start)
        for _ in stream:
            pass
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description="AceSpecDecInterceptor overhead on a unary-stream RPC")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--calls", type=int, default=100, help="sequential calls per variant and round")
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    children = {v: subprocess.Popen([sys.executable, __file__, "--serve", v], stdout=subprocess.PIPE, text=True)
                for v in VARIANTS}
    channels = []
    try:
        stubs = {}
        for variant, child in children.items():
            channel = grpc.insecure_channel(f"127.0.0.1:{int(child.stdout.readline())}")
            channels.append(channel)
            grpc.channel_ready_future(channel).result(timeout=20)
            stubs[variant] = generation_pb2_grpc.GenerationStub(channel)
            throughput(stubs[variant], 0.3, args.concurrency)  # warm-up
        results = {v: {"rps": [], "first": []} for v in VARIANTS}
        for _ in range(args.rounds):
            for variant, stub in stubs.items():
                results[variant]["rps"].append(throughput(stub, args.seconds, args.concurrency))
                results[variant]["first"].extend(first_message(stub, args.calls))
    finally:
        for channel in channels:
            channel.close()
        for child in children.values():
            child.terminate()
            child.wait(10)
    base_rps = statistics.median(results["plain"]["rps"])
    base_first = statistics.median(results["plain"]["first"])
    print(f"\nunary-stream RPC, {MESSAGES} messages/call, sync grpc on loopback (medians)")
    print(f"{'variant':8} {'calls/s':>8} {'vs plain':>9} {'first ms':>9} {'added ms':>9}")
    for variant, data in results.items():
        rps, first = statistics.median(data["rps"]), statistics.median(data["first"])
        print(f"{variant:8} {rps:8.1f} {rps / base_rps:9.1%} {first * 1e3:9.3f} {(first - base_first) * 1e3:9.3f}")


if __name__ == "__main__":
    main()
