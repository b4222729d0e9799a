"""Shared by the overhead benchmarks: one server process per variant, and its CPU time."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterable, Iterator


@contextmanager
def variant_servers(script: str, variants: Iterable[str]) -> Iterator[dict[str, tuple[int, int]]]:
    """Run `python <script> --serve <variant>` for each variant (each prints its port first);
    yield variant -> (port, pid), and stop them all afterwards."""
    children = {v: subprocess.Popen([sys.executable, script, "--serve", v], stdout=subprocess.PIPE, text=True)
                for v in variants}
    try:
        yield {v: (int(child.stdout.readline()), child.pid) for v, child in children.items()}
    finally:
        for child in children.values():
            child.terminate()
            child.wait(10)


def cpu_seconds(pid: int) -> float:
    """CPU time of a process, all threads, at ns resolution (Linux schedstat): robust to a busy
    machine, where requests/s are not."""
    tasks = f"/proc/{pid}/task"
    return sum(int(open(f"{tasks}/{tid}/schedstat").read().split()[0]) for tid in os.listdir(tasks)) / 1e9
