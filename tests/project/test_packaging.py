"""The wheel as a user gets it: built from this checkout, installed into a fresh venv, used from
outside the repository, so nothing can come from the source folders.

The venv sees the site-packages of the environment running the tests (torch, starlette...:
installing the dependencies again would cost minutes and test pip, not us), whether that is a
virtualenv or the system's, and the wheel goes in with --no-deps; each imported module must then
come from the venv. About 20 s on a quiet machine, mostly the isolated build."""

from __future__ import annotations

import importlib
import json
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from support.paths import ROOT

import ace_mw


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (built,) = out.glob("ace_mw-*.whl")
    return built


@pytest.fixture(scope="module")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    # The dependencies of this environment, after the venv's own site-packages (so the wheel wins).
    # A path a .pth names gets no .pth processing of its own: our editable install stays out.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(purelib) / "_test_environment.pth").write_text("".join(f"{path}\n" for path in ours))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return python


def run_outside(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -I`: no PYTHONPATH, no user site, no current folder on sys.path."""
    return subprocess.run([str(python), "-I", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_wheel_carries_the_packages_and_not_the_models(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {"ace_mw/__init__.py", "ace_mw/integrations/__init__.py", "ace_mw/engine/__init__.py"} <= set(names)
    assert "ace_mw/py.typed" in names
    assert "ace_mw/integrations/generation.proto" in names
    top = {name.split("/")[0] for name in names}
    assert top == {"ace_mw", wheel.name.split("-py3")[0] + ".dist-info"}  # no models/, tests/, examples/
    assert not [n for n in names if n.endswith((".safetensors", ".bin", ".json"))]


def test_installed_wheel_imports_from_the_venv(venv_python: Path, tmp_path: Path) -> None:
    script = (
        "import json, importlib.metadata, ace_mw, ace_mw.integrations, ace_mw.engine\n"
        "from ace_mw.integrations import AceSpecDec\n"
        "from ace_mw.engine import Engine\n"
        "print(json.dumps({'files': [m.__file__ for m in (ace_mw, ace_mw.integrations, ace_mw.engine)],\n"
        "                  'version': importlib.metadata.version('ace-mw')}))\n"
    )
    done = run_outside(venv_python, "-c", script, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    venv = venv_python.parent.parent.resolve()
    for file in found["files"]:
        assert Path(file).resolve().is_relative_to(venv), file
    assert found["version"] == ace_mw.__version__


def says_how_to_get_the_models(message: str) -> bool:
    return "not found" in message and "clone of the ace-mw repository" in message


@pytest.mark.parametrize(
    "command, status",
    [
        (("-m", "ace_mw.engine.bench", "--no-peers"), 1),  # its defaults point at the bundled models
        (("-m", "ace_mw.cli", "demo"), 2),  # `ace-mw demo` away from the clone's models/
    ],
)
def test_commands_without_the_models_say_how_to_get_them(
    venv_python: Path, tmp_path: Path, command: tuple[str, ...], status: int
) -> None:
    done = run_outside(venv_python, *command, cwd=tmp_path)
    assert done.returncode == status
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one line, no traceback
    assert says_how_to_get_the_models(lines[0])


def test_wheel_installs_the_ace_mw_command(wheel: Path, venv_python: Path, tmp_path: Path) -> None:
    entry_points = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/entry_points.txt"))
    assert "ace-mw = ace_mw.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    done = subprocess.run([str(venv_python.parent / "ace-mw"), "demo", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--upstream" in done.stdout


@pytest.mark.parametrize(
    "main, argv",
    [
        ("ace_mw.engine.server.app", ["--target", "missing/ace-tiny-chat"]),
        ("ace_mw.engine.server.app", ["--target", str(ROOT / "models" / "ace-tiny-chat"), "--eagle", "missing/head"]),
        ("ace_mw.engine.train.loop", ["--target", "missing/ace-tiny-chat", "--out", "head"]),
        (
            "ace_mw.engine.train.loop",
            ["--target", str(ROOT / "models" / "ace-tiny-chat"), "--out", "h", "--eval", "x.json"],
        ),
    ],
)
def test_model_paths_are_checked_before_loading(main: str, argv: list[str], tmp_path: Path) -> None:
    """The same check for the other commands and their other paths, in this process (no torch start-up)."""
    module = importlib.import_module(main)
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert isinstance(exit_.value.code, str) and "\n" not in exit_.value.code  # Python prints it as one line, status 1
    assert says_how_to_get_the_models(exit_.value.code)
