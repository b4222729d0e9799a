"""The `ace-mw` command, as an operator runs it: each subcommand through a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import openai
import pytest
from support.paths import ROOT
from support.servers import serve_asgi, wait_for
from support.upstream import FakeUpstream

from ace_mw import __version__
from ace_mw.config import hash_key

TOKEN = "Zq0b8WJ3u1c1kQ5bS8n2m4vX7pT6yR9eA0dF3hG5jK8"


def ace_mw(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ace_mw.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def test_version():
    done = ace_mw("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"ace-mw {__version__}"


def test_every_subcommand_has_help():
    listing = ace_mw("--help").stdout
    for command in ("demo", "serve", "gateway", "check", "hash-key"):
        assert command in listing
        done = ace_mw(command, "--help")
        assert done.returncode == 0 and f"usage: ace-mw {command}" in done.stdout


@pytest.mark.parametrize(
    "args, usage, hint",
    [
        (["demo", "--quik"], "usage: ace-mw demo", "did you mean --quick?"),
        (["chek", "x.toml"], "usage: ace-mw ", "did you mean 'check'?"),
        (["gateway", "--confg", "x.toml"], "usage: ace-mw gateway", "did you mean --config?"),
        (["serve", "--target", "x", "--eagel", "y"], "usage: ace-mw serve", "did you mean --eagle?"),
    ],
)
def test_a_wrong_flag_gets_the_subcommands_usage_and_the_closest_flag(args, usage, hint):
    done = ace_mw(*args)
    assert done.returncode == 2
    assert usage in done.stderr and hint in done.stderr


def test_check_prints_the_effective_config_with_secrets_masked(tmp_path):
    (tmp_path / "ace.toml").write_text(
        'mode = "PROD"\nadapter = "vllm"\nstate = {backend = "redis", url = "redis://user:hunter22@redis:6379/0"}\n'
        '[admin]\ntoken = {env = "ACE_ADMIN_TOKEN"}\n[keys.sk-raw-key-1]\nname = "team-a"\n'
    )
    done = ace_mw("check", str(tmp_path / "ace.toml"), env={"ACE_ADMIN_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr
    effective = json.loads(done.stdout)
    assert effective["mode"] == "prod" and effective["gate"]["alpha_floor"] == 0.55  # defaults filled in
    assert effective["admin"]["token"] == "***" and effective["state"]["url"] == "redis://user:***@redis:6379/0"
    assert (
        list(effective["keys"]) == [hash_key("sk-raw-key-1")]
        and effective["keys"][hash_key("sk-raw-key-1")]["name"] == "team-a"
    )
    for secret in (TOKEN, "hunter22", "sk-raw-key-1"):
        assert secret not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "text, message",
    [
        ('mode = "prod"\nadaptr = "vllm"\n', "adaptr: unknown field; did you mean 'adapter'?"),
        (
            '[admin]\ntoken = {env = "ACE_SURELY_UNSET"}\n',
            "admin.token: environment variable ACE_SURELY_UNSET is not set",
        ),
        ("mode = \n", "cannot read configuration"),
    ],
)
def test_check_exits_2_with_the_config_error(tmp_path, text, message):
    (tmp_path / "ace.toml").write_text(text)
    done = ace_mw("check", str(tmp_path / "ace.toml"))
    assert done.returncode == 2 and message in done.stderr and not done.stdout


def test_hash_key_reads_the_key_from_stdin_or_the_command_line():
    assert ace_mw("hash-key", stdin="sk-team-a\n").stdout.strip() == hash_key("sk-team-a")
    assert ace_mw("hash-key", "sk-team-a").stdout.strip() == hash_key("sk-team-a")
    assert ace_mw("hash-key", stdin="\n").returncode == 2


def test_serve_says_in_one_line_what_to_do_with_a_hub_id_or_an_unsupported_model(tmp_path):
    hub = ace_mw("serve", "--target", "Qwen/Qwen2.5-0.5B-Instruct")
    assert hub.returncode != 0 and "Traceback" not in hub.stderr
    assert "is a Hugging Face hub id: the engine loads local folders only" in hub.stderr
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct" in hub.stderr
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    other = ace_mw("serve", "--target", str(tmp_path / "gpt2"))
    assert other.returncode != 0 and "Traceback" not in other.stderr
    (line,) = other.stderr.strip().splitlines()
    assert "unsupported model_type 'gpt2'" in line and "ace-mw gateway" in line


def test_gateway_follows_its_config_file(tmp_path):
    first, second = FakeUpstream(name="first"), FakeUpstream(name="second")
    config = tmp_path / "ace.toml"
    with serve_asgi(first.app) as first_url, serve_asgi(second.app) as second_url:
        config.write_text(f'mode = "off"\nadapter = "vllm"\n[pools]\nbaseline = "{first_url}"\n')
        process = subprocess.Popen(
            [sys.executable, "-m", "ace_mw.cli", "gateway", "--port", "0", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            url = process.stdout.readline().split()[-1]
            client = openai.OpenAI(base_url=url + "/v1", api_key="sk-gw", max_retries=0, timeout=20)

            def upstream() -> str:
                raw = client.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
                return raw.headers["x-upstream-name"]

            assert upstream() == "first"
            time.sleep(1.1)  # a new modification time
            config.write_text(f'mode = "off"\nadapter = "vllm"\n[pools]\nbaseline = "{second_url}"\n')
            wait_for(lambda: upstream() == "second", timeout=15, what="the gateway to follow the saved config")
        finally:
            process.terminate()
            _, stderr = process.communicate(timeout=10)
    assert "config version 2 in force" in stderr  # a reload is a WARNING: uvicorn's default logging shows it


# -- the same commands in this process -----------------------------------------------------------------


def test_check_and_hash_key_in_process(tmp_path, capsys, monkeypatch):
    from ace_mw import cli

    (tmp_path / "ace.toml").write_text('mode = "shadow"\n[admin]\ntoken = "' + hash_key(TOKEN) + '"\n')
    assert cli.main(["check", str(tmp_path / "ace.toml")]) == 0
    effective = json.loads(capsys.readouterr().out)
    assert effective["mode"] == "shadow" and effective["admin"]["token"] == hash_key(TOKEN)[:19] + "..."
    (tmp_path / "bad.toml").write_text('mode = "fast"\n')
    assert cli.main(["check", str(tmp_path / "bad.toml")]) == 2
    assert "mode: unknown mode 'fast'" in capsys.readouterr().err
    assert cli.main(["hash-key", "sk-a"]) == 0 and capsys.readouterr().out.strip() == hash_key("sk-a")
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("sk-b\n"))
    assert cli.main(["hash-key"]) == 0 and capsys.readouterr().out.strip() == hash_key("sk-b")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["demo", "--quik"], "did you mean --quick?"),
        (["chek"], "did you mean 'check'?"),
        (["check"], "the following arguments are required: CONFIG"),
    ],
)
def test_usage_errors_in_process(argv, expected, capsys):
    from ace_mw import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and expected in capsys.readouterr().err
