"""The `ace-mw` command: `demo`, `serve` (the engine's OpenAI server), `gateway` (AceSpecDec in
front of named pools), `check CONFIG`, `hash-key`, and `--version`.

Light on imports: parsing the command line needs only the standard library. Each command's own
dependencies (the engine extra for `demo` and `serve`, httpx and uvicorn for `gateway`) load once it
runs, and a missing one is one line of error, not a traceback. A wrong flag gets the subcommand's
usage, with the closest flag it knows.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections.abc import Callable, Sequence

from .errors import ConfigError, UsageError
from .usage import Parser
from .version import __version__

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
        choices=("ace", "llamacpp", "vllm"),
        default="ace",
        help="ace: the in-process engine (or --upstream); llamacpp: real llama-server pools of the bundled model "
        "(plain, prompt lookup, draft model) that the command starts (build it first: python -m "
        "ace_mw.demo.llamacpp build); vllm: real vLLM pools (plain, prompt lookup, EAGLE-3, draft model, and "
        "vLLM's own dynamic speculation) at one client and in bursts (build it first: python -m ace_mw.demo.vllm "
        "build)",
    )
    parser.add_argument(
        "--adapter",
        metavar="NAME",
        help="engine adapter for --upstream: ace, vllm, sglang, trtllm, llamacpp (the in-process engine uses ace)",
    )


# Commands whose flags are another program's own (the engine server's, the gateway's): their
# arguments are handed over whole.
PASSED_THROUGH = {
    "serve": "the in-process engine's OpenAI-compatible server (python -m ace_mw.engine.server; see its --help)",
    "gateway": "an OpenAI-compatible gateway: AceSpecDec in front of the config's pools, following its file",
}


def parser() -> argparse.ArgumentParser:
    main = Parser(prog="ace-mw", description="ace-mw: the closed-loop speculative-decoding control plane.")
    main.add_argument("--version", action="version", version=f"ace-mw {__version__}")
    commands = main.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
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
    for name, text in PASSED_THROUGH.items():
        commands.add_parser(name, help=text, add_help=False)
    check = commands.add_parser(
        "check",
        help="validate a config file; print the effective config, secrets masked",
        description="Validate a TOML or JSON config file (secret references resolved) and print the effective "
        "config as JSON, every default filled in and every secret masked. Exit 0 if valid, 2 if not.",
    )
    check.add_argument("config", metavar="CONFIG", help="a .toml or .json config file")
    hash_key = commands.add_parser(
        "hash-key",
        help="print a developer key or admin token as sha256:<hex>, for a config that holds no secret",
        description="Print sha256:<hex> of a key, for `keys` and `admin.token`. Without KEY it is read from "
        "stdin (not echoed on a terminal), so it stays out of the shell's history.",
    )
    hash_key.add_argument("key", nargs="?", metavar="KEY")
    return main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSED_THROUGH:
        return _passed_through(argv[0], argv[1:])
    top = parser()
    args, extra = top.parse_known_args(argv)
    if extra:  # the subcommand's usage, not the top level's: the flag was meant for it
        command = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
        command.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    run: dict[str, Callable[[argparse.Namespace], int]] = {"demo": _demo, "check": _check, "hash-key": _hash_key}
    return run[args.command](args)


def _passed_through(command: str, argv: list[str]) -> int:
    try:
        if command == "serve":
            from ace_mw.engine.server.app import main as serve

            serve(argv, prog="ace-mw serve")
        else:
            from ace_mw.integrations.gateway import main as gateway

            gateway(argv)
    except ImportError as exc:
        extra = "engine" if command == "serve" else "gateway"
        print(
            f"ace-mw {command}: error: {exc.name or exc} is not installed: pip install 'ace-mw[{extra}]'",
            file=sys.stderr,
        )
        return 2
    return 0


def _check(args: argparse.Namespace) -> int:
    from ace_mw.config import AceConfig
    from ace_mw.operate.effective import effective

    try:
        config = AceConfig.from_file(args.config)
    except ConfigError as exc:
        print(f"ace-mw check: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(effective(config), indent=2))
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    from ace_mw.config import hash_key

    key = args.key
    if key is None:
        key = getpass.getpass("key: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\r\n")
    if not key:
        print("ace-mw hash-key: error: an empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def _demo(args: argparse.Namespace) -> int:
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
