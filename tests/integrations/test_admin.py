"""The admin API of AceSpecDec, end to end: a real uvicorn server, the fake engine behind the
middleware, httpx as the client. Routes exist only with an `admin` table; every /ace/* request
needs the token; status and config reload behave as documented; nothing secret leaks."""

from __future__ import annotations

import base64
import json
import logging
import socket

import httpx
import pytest
from support.servers import serve_asgi
from support.tenants import tenant
from support.upstream import FakeUpstream, Script, figures

from ace_mw import AceConfig, AceController, ConfigError, hash_key
from ace_mw.integrations import AceSpecDec
from ace_mw.request import MAX_MODEL_CHARS

TOKEN = "adm-" + "q7R2vX9kLm3Np8Ts1Wz4Yb6Cd0Fg5Hj"  # 36 characters
RAW_KEYS = ("sk-live-team-a-5b1e9f7c", "sk-live-team-b-0d2c8a64")
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "stream": True}
JSON = {"accept": "application/json"}


def config(**overrides) -> dict:
    return {
        "mode": "prod",
        "adapter": "ace",
        "admin": {"token": TOKEN},
        "gate": {"speed_min_samples": 1, "explore_fraction_unmeasured": 0.0},
        "keys": {RAW_KEYS[0]: {"allow_header_override": False}, RAW_KEYS[1]: {"speculative": {"algorithm": "ngram"}}},
        **overrides,
    }


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def served():
    """A server with admin on; yields (url, controller)."""
    upstream = FakeUpstream(Script(chunks=("a", "b", "c", "d"), figures=figures(drafted=20, accepted=16, steps=5)))
    controller = AceController(AceConfig.from_dict(config()))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        yield url, controller


def chat(url: str, key: str, **headers: str) -> httpx.Response:
    response = httpx.post(url + CHAT, json=BODY, headers={"authorization": f"Bearer {key}", **headers}, timeout=10)
    assert response.status_code == 200
    return response


def test_without_an_admin_table_the_ace_routes_are_the_apps():
    config_without = {k: v for k, v in config().items() if k != "admin"}
    with serve_asgi(AceSpecDec(FakeUpstream().app, config=config_without)) as url:
        for method, path in (("GET", "/ace/status"), ("POST", "/ace/config")):
            response = httpx.request(method, url + path, headers=bearer(), timeout=10)
            assert response.status_code == 404
            assert response.text == "Not Found"  # the app's own answer (Starlette's router)


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer",
        "Bearer " + TOKEN[:-1],
        "Bearer " + TOKEN + "x",
        "bearer" + TOKEN,
        "Token " + TOKEN,
        "Basic " + base64.b64encode(b"admin:wrong").decode(),
        "Basic !!not-base64!!",
    ],
)
def test_a_missing_or_wrong_token_gets_401_with_a_json_error(served, authorization):
    url, controller = served
    headers = {"authorization": authorization} if authorization is not None else {}
    for method, path in (("GET", "/ace/status"), ("POST", "/ace/config"), ("GET", "/ace/anything")):
        response = httpx.request(method, url + path, headers=headers, json=config(mode="off"), timeout=10)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_admin_token"
        assert response.headers.get_list("www-authenticate") == [
            'Bearer realm="ace-mw"',
            'Basic realm="ace-mw", charset="UTF-8"',
        ]
    assert controller.config_record.version == 1  # no POST got through


def test_status_as_json_shows_tenants_arms_and_verdicts(served):
    url, controller = served
    for _ in range(3):
        chat(url, RAW_KEYS[0])
        chat(url, RAW_KEYS[1])
    response = httpx.get(url + "/ace/status", headers={**bearer(), **JSON}, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["cache-control"] == "no-store"
    report = response.json()
    assert report["config"] | {"loaded_at": 0} == {
        "version": 1,
        "loaded_at": 0,
        "source": "code",
        "mode": "prod",
        "policy": "speed",
        "adapter": "ace",
        "rejections": 0,
        "last_rejection": None,
        "watchers": [],
    }
    assert report["store"] == {"backend": "memory", "tracked": 2}
    assert report["decisions"] == {"applied": {"ok": 6}}
    assert report["failures"] == {}
    rows = {row["tenant"]: row for row in report["tenants"]}
    assert set(rows) == {tenant(RAW_KEYS[0]), tenant(RAW_KEYS[1])}
    b = rows[tenant(RAW_KEYS[1])]
    assert b["model"] == "m"
    # prompt lookup is judged by its speed, not by the breaker (decide/gate.breaker_judges): its
    # acceptance shows on its arm, and the breaker has nothing to judge
    assert b["breaker"]["state"] == "closed" and b["breaker"]["rolling_alpha"] is None
    assert rows[tenant(RAW_KEYS[0])]["breaker"]["rolling_alpha"] == pytest.approx(0.8)  # EAGLE-2's
    assert [arm["arm"] for arm in b["arms"]] == ["plain", "ngram/k5"]
    ngram = b["arms"][1]
    assert ngram["measured"] and ngram["tokens_per_s"] > 0 and ngram["samples"] > 0
    assert ngram["acceptance"] == pytest.approx(0.8)
    assert b["arms"][0]["tokens_per_s"] is None  # plain never ran: nothing explores at 0 %
    assert b["chosen_arm"] == "ngram/k5" and b["speedup"] is None
    assert b["decisions"] == {"ok": 3}
    assert rows[tenant(RAW_KEYS[0])]["chosen_arm"] == "eagle_2/k5"


def test_status_for_a_browser_is_a_self_refreshing_page(served):
    url, _ = served
    chat(url, RAW_KEYS[0])
    response = httpx.get(url + "/ace/status", headers={**bearer(), "accept": "text/html,*/*;q=0.8"}, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["content-security-policy"].startswith("default-src 'none'")
    page = response.text
    assert '<meta http-equiv="refresh" content="5">' in page
    assert f'data-tenant="{tenant(RAW_KEYS[0])}"' in page
    assert "<script" not in page


def test_basic_credentials_carry_the_token_as_the_password(served):
    url, _ = served
    response = httpx.get(url + "/ace/status", auth=("anyone", TOKEN), headers=JSON, timeout=10)
    assert response.status_code == 200 and response.json()["config"]["version"] == 1


def test_a_posted_config_is_swapped_in(served):
    url, controller = served
    assert chat(url, RAW_KEYS[1]).headers["x-ace-speculative-decoding"] == "applied"
    response = httpx.post(url + "/ace/config", headers=bearer(), json=config(mode="shadow"), timeout=10)
    assert response.status_code == 200
    assert response.json() | {"loaded_at": 0} == {"version": 2, "loaded_at": 0, "source": "admin"}
    assert chat(url, RAW_KEYS[1]).headers["x-ace-speculative-decoding"] == "shadow"
    toml = f'mode = "off"\nadapter = "ace"\n[admin]\ntoken = "{TOKEN}"\n'
    response = httpx.post(
        url + "/ace/config", headers={**bearer(), "content-type": "application/toml"}, content=toml, timeout=10
    )
    assert response.status_code == 200 and response.json()["version"] == 3
    assert chat(url, RAW_KEYS[1]).headers["x-ace-speculative-decoding"] == "off"
    assert controller.config_record.source == "admin"


def test_an_invalid_posted_config_is_refused_and_the_old_one_stays(served):
    url, controller = served
    bad = config(gate={"alpha_floor": 2})
    response = httpx.post(url + "/ace/config", headers=bearer(), json=bad, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "gate.alpha_floor: must be in [0, 1], got 2",
        "type": "admin_error",
        "code": "invalid_config",
        "param": "gate.alpha_floor",
    }
    assert controller.config_record.version == 1
    assert chat(url, RAW_KEYS[1]).headers["x-ace-speculative-decoding"] == "applied"
    rejection = httpx.get(url + "/ace/status", headers={**bearer(), **JSON}, timeout=10).json()["config"]
    assert rejection["rejections"] == 1
    assert rejection["last_rejection"]["error"] == "gate.alpha_floor: must be in [0, 1], got 2"
    assert rejection["last_rejection"]["source"] == "admin" and rejection["last_rejection"]["after_current"]
    page = httpx.get(url + "/ace/status", headers=bearer(), timeout=10).text
    assert 'id="reload-error"' in page and "gate.alpha_floor: must be in [0, 1], got 2" in page


def test_a_posted_config_without_an_admin_table_keeps_the_one_in_force(served):
    url, controller = served
    without = {k: v for k, v in config(mode="shadow").items() if k != "admin"}
    response = httpx.post(url + "/ace/config", headers=bearer(), json=without, timeout=10)
    assert response.status_code == 200 and response.json()["version"] == 2
    assert controller.config.admin is not None and controller.config.mode == "shadow"
    assert chat(url, RAW_KEYS[1]).headers["x-ace-speculative-decoding"] == "shadow"
    assert httpx.get(url + "/ace/status", headers={**bearer(), **JSON}, timeout=10).status_code == 200


def test_the_admin_token_may_be_configured_as_its_hash():
    hashed = {**config(), "admin": {"token": hash_key(TOKEN)}}
    with serve_asgi(AceSpecDec(FakeUpstream().app, config=hashed)) as url:
        assert httpx.get(url + "/ace/status", headers={**bearer(), **JSON}, timeout=10).status_code == 200
        assert (
            httpx.get(url + "/ace/status", headers={**bearer(hash_key(TOKEN)), **JSON}, timeout=10).status_code == 401
        )


def test_config_bodies_of_other_types_or_too_large_are_refused(served):
    url, controller = served
    response = httpx.post(url + "/ace/config", headers=bearer(), data={"mode": "off"}, timeout=10)
    assert response.status_code == 415
    big = json.dumps(config(pools={f"p{i}": "http://x" * 20 for i in range(8000)})).encode()
    assert len(big) > 1 << 20
    response = httpx.post(
        url + "/ace/config", headers={**bearer(), "content-type": "application/json"}, content=big, timeout=10
    )
    assert response.status_code == 413  # refused by its declared length

    def chunked():
        yield big[: 1 << 19]
        yield big[1 << 19 :]

    response = httpx.post(
        url + "/ace/config", headers={**bearer(), "content-type": "application/json"}, content=chunked(), timeout=10
    )
    assert response.status_code == 413  # refused while reading, no length declared
    assert controller.config_record.version == 1
    assert chat(url, RAW_KEYS[0]).status_code == 200


def test_wrong_methods_and_unknown_admin_paths(served):
    url, _ = served
    response = httpx.post(url + "/ace/status", headers=bearer(), timeout=10)
    assert (response.status_code, response.headers["allow"]) == (405, "GET")
    response = httpx.get(url + "/ace/config", headers=bearer(), timeout=10)
    assert (response.status_code, response.headers["allow"]) == (405, "POST")
    assert httpx.get(url + "/ace/nothing", headers=bearer(), timeout=10).status_code == 404


def test_raw_keys_and_the_token_never_appear_in_status_or_logs(served, caplog):
    url, _ = served
    caplog.set_level(logging.DEBUG)
    for key in RAW_KEYS:
        chat(url, key)
    # a refused config whose key table holds raw keys: the error names the key by its hash
    bad = config(keys={RAW_KEYS[0]: {"mode": "fast"}})
    error = httpx.post(url + "/ace/config", headers=bearer(), json=bad, timeout=10).json()["error"]["message"]
    assert error == f"keys.{hash_key(RAW_KEYS[0])[:19]}.mode: unknown mode 'fast': expected 'off', 'shadow' or 'prod'"
    outputs = [
        httpx.get(url + "/ace/status", headers={**bearer(), **JSON}, timeout=10).text,
        httpx.get(url + "/ace/status", headers=bearer(), timeout=10).text,
        caplog.text,
        error,
    ]
    assert "refused the configuration" in caplog.text
    for output in outputs:
        for secret in (*RAW_KEYS, TOKEN):
            assert secret not in output
    assert TOKEN not in repr(AceConfig.from_dict(config()))


def test_a_rejected_config_is_shown_escaped(served):
    url, _ = served
    httpx.post(url + "/ace/config", headers=bearer(), json=config(mode="<script>alert(1)</script>"), timeout=10)
    page = httpx.get(url + "/ace/status", headers=bearer(), timeout=10).text
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_the_override_header_is_ignored_for_a_key_without_permission(served):
    url, _ = served
    response = chat(url, RAW_KEYS[0], **{"x-ace-skill-speculative-decoding": "off"})
    assert response.headers["x-ace-speculative-decoding"] == "applied"
    response = chat(url, RAW_KEYS[1], **{"x-ace-skill-speculative-decoding": "off"})
    assert response.headers["x-ace-speculative-decoding"] == "off"


def raw_request(url: str, head: bytes) -> bytes:
    """Send a raw HTTP/1.1 request head; what the server answered before closing (or b"")."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(head)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server may close on us mid-send
            pass
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:  # closed with our bytes still unread
            pass
        return answer


def test_header_floods_stay_bounded(served):
    url, controller = served
    # Within the server's header limit: many headers, each looked at once, and the token is still wrong.
    flood = b"".join(b"x-flood-%d: %s\r\n" % (i, b"v" * 20) for i in range(300))
    answer = raw_request(url, b"GET /ace/status HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + flood + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 401")
    # Past the limit (a 1 MB authorization header, then 5,000 headers): refused by the server
    # before any of it reaches the middleware.
    for head in (
        b"GET /ace/status HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + b"a" * (1 << 20) + b"\r\n\r\n",
        b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: x\r\n" + flood * 17 + b"\r\n",
    ):
        answer = raw_request(url, head)
        assert answer == b"" or answer.split(b" ", 2)[1] in (b"400", b"413", b"431")
    assert chat(url, RAW_KEYS[0]).status_code == 200  # and the server serves on
    assert controller.status()["decisions"] == {"applied": {"ok": 1}}


@pytest.mark.parametrize(
    ("token", "problem"),
    [
        ("short", "must be at least 32 characters"),
        ("x" * 31, "must be at least 32 characters"),
        ("y" * 40 + " z", "printable ASCII without spaces"),
        ("é" * 40, "printable ASCII without spaces"),
        (12345, "must be a string, got int"),
    ],
)
def test_weak_or_unsendable_tokens_are_config_errors(token, problem):
    with pytest.raises(ConfigError, match=problem) as raised:
        AceConfig.from_dict({"admin": {"token": token}})
    assert raised.value.path == "admin.token"
    assert str(token) not in str(raised.value) or token == 12345


def test_client_chosen_model_names_cost_a_bounded_size_in_state_and_status(served):
    """Distinct 64 KiB model names: each keys its own state, shortened to MAX_MODEL_CHARS (its
    head and a digest of the whole), and the status report stays small."""
    url, controller = served
    names = [f"model-{i}-" + "x" * (64 << 10) for i in range(24)]
    for name in names:
        httpx.post(url + CHAT, json={**BODY, "stream": False, "model": name}, headers=bearer("sk-x"), timeout=10)
    report = httpx.get(url + "/ace/status?limit=1000", headers={**bearer(), **JSON}, timeout=10)
    models = [row["model"] for row in report.json()["tenants"]]
    assert len(set(models)) == len(names)  # still told apart
    assert max(map(len, models)) == MAX_MODEL_CHARS
    assert {m.split("-x")[0] for m in models} == {name.split("-x")[0] for name in names}
    assert len(report.content) < 2048 * len(names)  # about 0.7 KiB a row; unbounded, 64 KiB each
    assert len(controller.store) == len(names)


@pytest.mark.parametrize("limit", ["%C2%B2", "-1", "1.5", "abc", "", "%00", "%EF%BC%91"])
def test_a_bad_status_limit_is_a_400_with_a_json_error(served, limit):
    url, _ = served
    response = httpx.get(url + "/ace/status?limit=" + limit, headers={**bearer(), **JSON}, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "limit"
    assert response.json()["error"]["code"] == "invalid_query_parameter"


def test_a_status_limit_is_clamped_and_zero_is_allowed(served):
    url, _ = served
    chat(url, RAW_KEYS[0])
    assert httpx.get(url + "/ace/status?limit=0", headers={**bearer(), **JSON}, timeout=10).json()["tenants"] == []
    assert (
        len(
            httpx.get(url + "/ace/status?limit=" + "9" * 400, headers={**bearer(), **JSON}, timeout=10).json()[
                "tenants"
            ]
        )
        == 1
    )
