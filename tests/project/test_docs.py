"""The docs stay true: README's minimal example runs as printed with the install it names, every
relative link in README.md, CONTRIBUTING.md, CHANGELOG.md and docs/ resolves (files and #anchors),
and the reference pages name what the code emits."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.paths import ROOT
from support.ports import free_port

from ace_mw import AceConfig, AceController, Decision, RequestView, StateStore

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *DOCS]
PROJECT = "ace-mw"


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


# -- README's minimal example ------------------------------------------------------------------------


class MinimalExample:
    """The section as printed: the code, the install line, the uvicorn command and the curl call."""

    def __init__(self) -> None:
        section = README.read_text().split("## Minimal example", 1)[1].split("\n## ", 1)[0]
        (self.code,) = fenced(section, "python")
        commands = [line for block in fenced(section, "sh") for line in block.replace("\\\n", " ").splitlines()]
        self.install = next(shlex.split(c) for c in commands if c.startswith("pip install"))
        self.serve = next(shlex.split(c) for c in commands if c.startswith("uvicorn "))
        self.curl = next(shlex.split(c) for c in commands if c.startswith("curl "))

    def extra_requirements(self) -> list[str]:
        """What the install line adds to this project (`-e .`)."""
        args = self.install[2:]
        assert args[:2] == ["-e", "."], "the example is installed from the clone"
        return args[2:]

    def served_on(self, port: int) -> list[str]:
        args = list(self.serve[1:])
        args[args.index("--port") + 1] = str(port)
        return args

    def request(self) -> tuple[str, dict[str, str], str]:
        """(path, headers, body) of the printed curl call."""
        args, headers, body, url = self.curl[1:], {}, None, None
        while args:
            arg = args.pop(0)
            if arg == "-H":
                name, value = args.pop(0).split(":", 1)
                headers[name.strip().lower()] = value.strip()
            elif arg == "-d":
                body = args.pop(0)
            elif not arg.startswith("-"):
                url = arg
        return "/" + url.split("/", 1)[1], headers, body


EXAMPLE = MinimalExample()


def serve(command: list[str], cwd: Path, port: int, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run a server command until the test is done; yield its base URL once it answers."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(base + "/docs", timeout=1)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    pytest.fail(f"the example did not start:\n{process.communicate()[0]}")
                time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(10)


def requirement_closure(names: list[str]) -> set[str]:
    """Every distribution the named ones pull in (extras not asked for left out)."""
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in importlib.metadata.requires(name) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def not_installed_by(install: list[str]) -> set[str]:
    """Top-level modules of this environment that the printed install would not bring."""
    allowed = requirement_closure([PROJECT, *install])
    providers = importlib.metadata.packages_distributions()
    return {m for m, dists in providers.items() if not any(canonicalize_name(d) in allowed for d in dists)}


# Runs uvicorn as `uvicorn ARGS` would, in an interpreter where every module outside the named
# install raises ModuleNotFoundError, as in a fresh environment (optional imports degrade the same way).
NAMED_INSTALL_ONLY = """
import json, os, runpy, sys
blocked = set(json.loads(os.environ["ACE_MW_DOCS_BLOCKED"]))
class NamedInstallOnly:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed by the README)", name=name)
        return None
sys.meta_path.insert(0, NamedInstallOnly())
sys.argv = ["uvicorn", *sys.argv[1:]]
runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def example_url(tmp_path_factory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("readme")
    (directory / "app.py").write_text(EXAMPLE.code)
    blocked = not_installed_by(EXAMPLE.extra_requirements())
    assert {"httpx", "openai", "torch"} <= blocked  # the dev environment really is narrowed down
    env = {**os.environ, "ACE_MW_DOCS_BLOCKED": json.dumps(sorted(blocked))}
    port = free_port()
    yield from serve([sys.executable, "-c", NAMED_INSTALL_ONLY, *EXAMPLE.served_on(port)], directory, port, env)


def check_decisions(base: str) -> None:
    """What the README says of the printed request and its two variations."""
    path, headers, body = EXAMPLE.request()
    printed = httpx.post(base + path, headers=headers, content=body)
    assert printed.json() == {"pool": "speculative"}
    assert printed.headers["x-ace-speculative-decoding"] == "applied"
    shadow = httpx.post(base + path, headers={**headers, "authorization": "Bearer sk-team-a"}, content=body)
    assert (shadow.json()["pool"], shadow.headers["x-ace-speculative-decoding"]) == ("baseline", "shadow")
    without_temperature = body.replace(', "temperature": 0', "")
    assert "temperature" not in without_temperature
    gated = httpx.post(base + path, headers=headers, content=without_temperature)
    assert (gated.json()["pool"], gated.headers["x-ace-speculative-decoding"]) == ("baseline", "gated")
    assert gated.headers["x-ace-speculative-decoding-reason"] == "temperature"


def test_minimal_example_serves_what_the_readme_says_with_only_the_named_install(example_url):
    check_decisions(example_url)


def index_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_minimal_example_runs_in_a_fresh_venv_with_exactly_the_printed_install(tmp_path):
    """The printed commands, run literally in a new virtual environment (needs the package index)."""
    if not index_reachable():
        pytest.skip("the package index is not reachable")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    subprocess.run(EXAMPLE.install, cwd=ROOT, env=env, check=True, capture_output=True, timeout=800)
    (tmp_path / "app.py").write_text(EXAMPLE.code)
    port = free_port()
    server = serve([str(venv / "bin" / EXAMPLE.serve[0]), *EXAMPLE.served_on(port)], tmp_path, port, env)
    check_decisions(next(server))
    server.close()


# -- links and names ------------------------------------------------------------------------------------


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", prose(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        unique, n = slug, 0
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


def relative_links(page: Path) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text()))
    return [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_inside_the_repository(page):
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.is_relative_to(ROOT) or not target.exists():
            broken.append(f"{link}: no such file in the repository")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_path_in_the_docs_points_outside_the_repository(page):
    """Links or not (a path in backticks too): every ../ path names a file of this clone."""
    paths = re.findall(r"(?<![\w/.])\.\./[\w./-]*\w", page.read_text())
    resolved = {path: (page.parent / path).resolve() for path in paths}
    assert [path for path, file in resolved.items() if not (file.is_relative_to(ROOT) and file.exists())] == []


def test_links_are_checked_at_all():
    assert "docs/configuration.md#missing-temperature" in relative_links(README)
    assert "missing-temperature" in anchors(ROOT / "docs" / "configuration.md")
    assert "plugging-in-a-custom-statestore" in anchors(ROOT / "docs" / "reference.md")


def test_readme_lists_every_docs_page():
    listed = {(README.parent / link).resolve() for link in relative_links(README)}
    assert {*DOCS, ROOT / "CONTRIBUTING.md"} <= listed


def test_reference_names_every_metric_and_span_attribute():
    source = (ROOT / "ace_mw" / "operate" / "telemetry.py").read_text()
    names = set(re.findall(r'"((?:ace|gen_ai|error)\.[a-z_.]+)"', source))
    reference = (ROOT / "docs" / "reference.md").read_text()
    assert len(names) > 20
    assert {name for name in names if f"`{name}`" not in reference} == set()


def test_api_reference_covers_the_controller_the_decision_and_the_store():
    """Every public member of AceController, field of Decision and method of the StateStore
    protocol is named in reference.md (the API moves: this says where the page fell behind)."""
    reference = (ROOT / "docs" / "reference.md").read_text()

    def public(cls: type) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("_")}

    names = {
        *public(AceController),
        *(f.name for f in dataclasses.fields(Decision) if f.repr),
        *(n for n in public(StateStore) if callable(getattr(StateStore, n))),
    }
    assert {name for name in names if f"`{name}" not in reference} == set()


def adapter_example_works(example: dict) -> bool:
    adapter = example["MyEngineAdapter"]()
    found = adapter.extract({"drafted": 10, "accepted": 7})
    return example["config"].adapter == "my-engine" and found is not None and found.alpha == pytest.approx(0.7)


def store_example_works(example: dict) -> bool:
    from ace_mw.integrations import AceSpecDec

    controller, app = example["controller"], example["app"]
    store = controller.store
    store.record(("t", "m"), 0.8, probe=False, gate=controller.config.gate, now=0.0)
    wrapped = any(m.cls is AceSpecDec and m.kwargs.get("controller") is controller for m in app.user_middleware)
    return isinstance(store, example["AuditedStore"]) and store.samples == [(("t", "m"), 0.8)] and wrapped


# What each documented example must have built (keyed by a name it defines): an example that runs
# but does not do what its page says fails, and a new example without a check here fails too.
EXAMPLE_CHECKS = {
    "MyEngineAdapter": adapter_example_works,
    "AuditedStore": store_example_works,
    "exposition": lambda example: "ace_spec_decode_decisions_total" in example["exposition"],
}


@pytest.mark.usefixtures("adapter_registry")
@pytest.mark.parametrize("page", ["adapters.md", "reference.md"])
def test_documented_examples_run_and_do_what_the_page_says(page):
    examples = [c for c in fenced((ROOT / "docs" / page).read_text(), "python") if c.startswith(("from ", "import "))]
    assert examples
    for code in examples:
        example: dict = {"__name__": "docs_example"}
        exec(compile(code, page, "exec"), example)
        checks = [check for name, check in EXAMPLE_CHECKS.items() if name in example]
        assert len(checks) == 1, f"{page}: an example without exactly one check in EXAMPLE_CHECKS"
        assert checks[0](example), page


# -- architecture.md's module table ------------------------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
SOURCE_ROOTS = ("ace_mw", "integrations", "engine")
NOT_MODULES = {"__init__.py", "__main__.py", "generation_pb2.py", "generation_pb2_grpc.py"}  # generated or entry points


def module_table() -> dict[str, str]:
    """Path -> the row's text, for each row of the table whose first cell is a path."""
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", ARCHITECTURE.read_text(), flags=re.M)
    return dict(rows)


def source_modules() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for root in SOURCE_ROOTS
        for p in (ROOT / root).rglob("*.py")
        if p.name not in NOT_MODULES
    )


def test_the_module_table_names_every_module_of_the_tree():
    table = module_table()
    missing = []
    for module in source_modules():
        folder, name = module.rsplit("/", 1)
        if module not in table and f"`{name}`" not in table.get(folder + "/", ""):
            missing.append(module)
    assert not missing, f"docs/architecture.md's module table does not name {missing}"


def test_the_module_table_names_nothing_that_is_not_there():
    table = module_table()
    gone = [path for path in table if not (ROOT / path).exists()]
    named_in_folders = [
        f"{folder}{name}"
        for folder, text in table.items()
        if folder.endswith("/")
        for name in re.findall(r"`([a-z_0-9]+\.py)`", text)
        if not (ROOT / folder / name).exists()
    ]
    assert not gone + named_in_folders, (
        f"docs/architecture.md names modules that do not exist: {gone + named_in_folders}"
    )


def test_the_layers_in_architecture_md_are_the_ones_ci_checks():
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    core = next(c for c in contracts if c["containers"] == ["ace_mw"] and c["type"] == "layers")
    (diagram,) = re.findall(r"^```\n(cli > .*?)^```", ARCHITECTURE.read_text(), flags=re.S | re.M)
    assert " ".join(diagram.split()) == " > ".join(core["layers"])


# -- operations.md's alert rules -----------------------------------------------------------------------


def prometheus_names() -> set[str]:
    """What the exporter writes for each metric reference.md lists: dots to underscores, `_total`
    on counters, `_bucket`/`_count`/`_sum` on histograms (checked against a real exposition below)."""
    table = (ROOT / "docs" / "reference.md").read_text().split("### Metrics (meter `ace_mw`)", 1)[1]
    names = set()
    for name, kind in re.findall(r"^\| `(ace\.[a-z_.]+)` \| ([a-z ]+),?", table.split("\n### ", 1)[0], flags=re.M):
        base = name.replace(".", "_")
        if "histogram" in kind:
            names |= {base + "_bucket", base + "_count", base + "_sum"}
        else:
            names.add(base + "_total" if "counter" in kind else base)
    return names


def metrics_of(expr: str) -> str:
    """A PromQL expression without its label matchers and grouping clauses: the metric names left."""
    return re.sub(r"\b(?:by|without) \([^)]*\)", "", re.sub(r"\{[^}]*\}", "", expr))


def test_the_alert_rules_parse_and_name_only_metrics_the_exporter_writes():
    import yaml
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    (rules,) = fenced((ROOT / "docs" / "operations.md").read_text(), "yaml")
    groups = yaml.safe_load(rules)["groups"]
    alerts = [rule for group in groups for rule in group["rules"]]
    assert len(alerts) >= 4 and all(
        rule["alert"] and rule["expr"] and rule["annotations"]["summary"] for rule in alerts
    )
    documented = prometheus_names()
    used = {name for rule in alerts for name in re.findall(r"\bace_[a-z_]+", metrics_of(rule["expr"]))}
    assert used and used <= documented, used - documented

    registry = CollectorRegistry()  # the derivation above, against what the exporter really writes
    reader = PrometheusMetricReader()
    registry.register(reader._collector)  # its own registry: the reader registers with the global one too
    controller = AceController(
        AceConfig.from_dict({"mode": "prod"}), meter_provider=MeterProvider(metric_readers=[reader])
    )
    controller.decide(RequestView("POST", "/v1/chat/completions", {}, {"model": "m", "temperature": 0.0}))
    written = {
        sample.name
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    shown = {name for name in written if name.startswith("ace_")}
    assert {"ace_spec_decode_breaker_state", "ace_spec_decode_decisions_total", "ace_state_healthy"} <= shown
    assert shown <= documented, shown - documented


# -- CONTRIBUTING.md names what the tree holds -------------------------------------------------------

CODE_ROOTS = ("ace_mw", "integrations", "engine", "tests", "benchmarks", "examples")


def code_files() -> list[Path]:
    return [path for root in CODE_ROOTS for path in (ROOT / root).rglob("*.py")]


def defines(paths: list[Path], name: str) -> bool:
    pattern = re.compile(rf"^\s*(?:class|def|async def)\s+{name}\b|^\s*(?:self\.)?{name}\s*[:=]", re.M)
    return any(pattern.search(path.read_text()) for path in paths)


def test_contributing_names_only_files_and_code_that_exist():
    """Every file CONTRIBUTING.md names exists, and every `module.Name` / `Class.member` it names
    is defined there (a guide that sends a contributor to `DEFAULT_K` in a file that has none
    costs them an afternoon)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    files = code_files()
    relative = {path.relative_to(ROOT).as_posix() for path in files}
    outside = {"generate.py"}  # gpt-fast's, named as a model to follow
    for named in sorted(set(re.findall(r"`([\w./-]+\.py)`", text)) - outside):  # a path, or its tail
        assert any(path == named or path.endswith("/" + named) for path in relative), named
    modules: dict[str, list[Path]] = {}
    for path in files:
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        modules.setdefault(stem, []).extend([path] if path.name != "__init__.py" else list(path.parent.glob("*.py")))
    classes = {m.group(1): path for path in files for m in re.finditer(r"^class (\w+)", path.read_text(), re.M)}
    from ace_mw.config import AceConfig

    sections = {name: kind for name, kind in typing.get_type_hints(AceConfig).items() if dataclasses.is_dataclass(kind)}
    checked = 0
    for owner, member in sorted(set(re.findall(r"`([A-Za-z_]\w*)\.([A-Za-z_]\w*)`", text))):
        if member in ("py", "md", "toml", "json", "typed"):
            continue  # a file name
        if owner in sections and member in {f.name for f in dataclasses.fields(sections[owner])}:
            pass  # a config key (`gate.policy`)
        elif owner == "ace_mw":  # a subpackage
            assert importlib.util.find_spec(f"{owner}.{member}") is not None, f"{owner}.{member}"
        elif owner in classes:
            assert defines([classes[owner]], member), f"{owner}.{member}"
        elif owner in modules:
            assert defines(modules[owner], member), f"{owner}.{member}"
        else:
            continue  # not code of ours (`F.linear`, a config key such as `gate.policy`)
        checked += 1
    assert checked >= 10  # the guide's references were found and checked
