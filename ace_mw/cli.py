"""The `ace-mw` command.

Light on imports: parsing the command line needs only the standard library. The demo's own
dependencies (the engine extra: torch, transformers; and openai, uvicorn, rich, matplotlib) load
once it runs, and a missing one is one line of error, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import UsageError

DEMO = """\
The closed loop on a real workload: the bundled model in the in-process engine, behind one
AceSpecDec per policy (adaptive = the speed-aware gate, always-on, always-off), served with uvicorn
on loopback and driven with the openai client. Six demo tenants (an org in prod, a key in shadow,
a key on a 5 % canary, a key with two candidates, a key allowed to override by header, and a key
whose traffic turns unpredictable mid-run) send held-out prompts (code, summarization/extraction,
chat, math; temperatures 0 to 1.2; streaming and not), the same requests to every policy,
interleaved. A live view shows the run; the report (report.md, report.json, charts) goes to --out.

exit codes: 0 done, 2 bad input (one line on stderr), 130 interrupted (the report holds what was
measured so far)."""


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that runs the workload (the demo and benchmarks/closed_loop.py)."""
    parser.add_argument("--requests", type=int, metavar="N", help="workload requests, each sent to every policy")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="max_tokens of every request")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload's draws and requests (default 0)")
    parser.add_argument("--device", default="cpu", help="torch device of the in-process engine (default cpu)")
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch CPU threads (default 1 on cpu: small matmuls gain little from more threads, and lose a lot "
        "on a busy machine)",
    )
    parser.add_argument(
        "--model", metavar="DIR", help="target model folder (default: the bundled models/ace-tiny-chat)"
    )
    parser.add_argument(
        "--eagle", metavar="DIR", help="EAGLE head folder (default: the bundled head, with the bundled model only)"
    )
    parser.add_argument(
        "--draft", metavar="DIR", help="draft model folder (default: the bundled draft, with the bundled model only)"
    )
    parser.add_argument(
        "--upstream",
        metavar="URL",
        help="drive the workload through the middleware against this OpenAI-compatible engine instead of the "
        "in-process one (e.g. http://vllm:8000); needs --adapter",
    )
    parser.add_argument(
        "--engine",
        choices=("ace", "llamacpp"),
        default="ace",
        help="ace: the in-process engine (or --upstream); llamacpp: real llama-server pools of the bundled model "
        "(plain, prompt lookup, draft model) that the command starts (build it first: python -m "
        "ace_mw.demo.llamacpp build)",
    )
    parser.add_argument(
        "--adapter",
        metavar="NAME",
        help="engine adapter for --upstream: ace, vllm, sglang, trtllm, llamacpp (the in-process engine uses ace)",
    )


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(
        prog="ace-mw", description="ace-mw: the closed-loop speculative-decoding control plane."
    )
    commands = main.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="the closed loop on a real workload, with a live view and a report",
        description=DEMO,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--quick", action="store_true", help="a short workload (48 requests of 32 tokens): minutes on a 2-core CPU"
    )
    demo.add_argument(
        "--out", default="ace-demo-report", metavar="DIR", help="report folder (default ./ace-demo-report)"
    )
    add_workload_arguments(demo)
    return main


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        from ace_mw.demo.command import run_demo
    except ImportError as exc:
        print(
            f"ace-mw {args.command}: error: {exc.name or exc} is not installed; the demo needs the engine and demo "
            "extras: pip install -e '.[demo]'",
            file=sys.stderr,
        )
        return 2
    try:
        return run_demo(args)
    except UsageError as exc:
        print(f"ace-mw {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
