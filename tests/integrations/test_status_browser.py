"""The HTML status page as a person sees it: headless Chromium (Debian's /usr/bin/chromium, driven
by Playwright), a real uvicorn server with AceSpecDec in front of the fake engine, real traffic from
two tenants (one whose acceptance collapses), a config reload that applies and one that is
refused. The test reads what the page shows and saves a screenshot (`status.png` in its tmp dir)."""

from __future__ import annotations

import os
from dataclasses import replace

import httpx
import pytest
from support.servers import serve_asgi
from support.tenants import tenant
from support.upstream import FakeUpstream, Script, figures

from ace_mw import AceConfig, AceController
from ace_mw.integrations import AceSpecDec

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):  # skipped only on a developer's machine; CI (.ci/run installs it) must have it
    if os.environ.get("CI"):
        pytest.fail("chromium is missing on CI: .ci/run installs it with apt-get", pytrace=False)
    pytest.skip("Debian's chromium is not installed here (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (test extra)")

TOKEN = "status-page-test-token-8f3k2m9x4q7w"
KEYS = {"healthy": "sk-browser-healthy-1", "collapsing": "sk-browser-collapse-2", "late": "sk-browser-late-3"}
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
CONFIG = {
    "mode": "prod",
    "adapter": "ace",
    "admin": {"token": TOKEN},
    # no probes: the request after the trip runs plain, whatever its (random) sticky bucket
    "gate": {
        "min_samples": 3,
        "speed_min_samples": 1,
        "explore_fraction_unmeasured": 0.0,
        "cooldown_s": 600,
        "probe_fraction": 0.0,
    },
    "candidates": [{"algorithm": "eagle_2"}],  # one the breaker judges: once open, it runs plain
    "keys": {KEYS["healthy"]: {"name": "team-healthy"}},  # a named key shows by its name
}


def tenant_named(name: str) -> str:
    return tenant(KEYS[name])


def chat(url: str, name: str, n: int) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "stream": True}
    for _ in range(n):
        response = httpx.post(
            url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[name]}"}, timeout=10
        )
        assert response.status_code == 200


def test_the_status_page_shows_tenants_breakers_arms_and_a_refused_reload(tmp_path):
    upstream = FakeUpstream(Script(chunks=tuple(f"t{i} " for i in range(6)), delay_s=0.002))
    controller = AceController(AceConfig.from_dict(CONFIG))
    with serve_asgi(AceSpecDec(upstream.app, controller=controller)) as url:
        upstream.script = replace(upstream.script, figures=figures(drafted=40, accepted=34, steps=8))
        chat(url, "healthy", 4)
        upstream.script = replace(upstream.script, figures=figures(drafted=40, accepted=6, steps=8))
        chat(url, "collapsing", 4)  # alpha 0.15: the breaker opens
        admin = {"authorization": f"Bearer {TOKEN}"}
        assert httpx.post(url + "/ace/config", json={**CONFIG, "canary_percent": 100}, headers=admin).status_code == 200
        refused = httpx.post(url + "/ace/config", json={**CONFIG, "gate": {"alpha_floor": 7}}, headers=admin)
        assert refused.status_code == 400

        with sync_api.sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                str(tmp_path / "profile"),  # a fresh profile
                executable_path=CHROMIUM,
                args=FLAGS,
                http_credentials={"username": "ops", "password": TOKEN},  # what a person types at the prompt
                viewport={"width": 1400, "height": 900},
            )
            try:
                page = context.new_page()
                response = page.goto(url + "/ace/status")
                assert response is not None and response.status == 200

                banner = page.locator("#reload-error")
                assert banner.is_visible()
                assert "Config reload rejected" in banner.inner_text()
                assert "gate.alpha_floor: must be in [0, 1], got 7" in banner.inner_text()
                assert "Version 2 stays in force" in banner.inner_text()
                config = page.locator("#config").inner_text()
                assert "version\n2" in config and "source\nadmin" in config

                rows = page.locator("#tenants tbody tr")
                assert rows.count() == 2
                healthy = page.locator(f'tr[data-tenant="{tenant_named("healthy")}"]').inner_text()
                collapsing = page.locator(f'tr[data-tenant="{tenant_named("collapsing")}"]').inner_text()
                assert healthy.startswith("team-healthy\n" + tenant_named("healthy"))  # the name, its hash under it
                assert not collapsing.startswith("team")  # an unnamed key: its hash alone
                assert "closed" in healthy and "0.850" in healthy
                assert "eagle_2/k5: " in healthy and "tok/s" in healthy and "ok 4" in healthy
                assert "open" in collapsing and "trips 1" in collapsing  # the rolling alpha restarts on a trip
                assert "plain" in collapsing.split("\t")[-2]  # chosen arm column: the breaker keeps it plain
                assert "breaker_open" in collapsing
                assert KEYS["healthy"] not in page.content()
                # the collapsing tenant ran EAGLE-2, then plain once its breaker opened: a prior of one tenant
                # (the arm's own, and its family's: EAGLE-2 of any draft length)
                priors = page.locator("#priors tbody tr").all_inner_texts()
                assert sorted(row.split("\t")[1] for row in priors) == ["eagle_2/*", "eagle_2/k5"]
                assert all(row.split("\t")[0] == "demo" and row.split("\t")[4] == "1" for row in priors)
                page.screenshot(path=str(tmp_path / "status.png"), full_page=True)

                chat(url, "late", 1)  # the page refreshes itself and shows the new tenant
                page.locator(f'tr[data-tenant="{tenant_named("late")}"]').wait_for(timeout=15_000)
                assert page.locator("#tenants tbody tr").count() == 3
            finally:
                context.close()
    assert (tmp_path / "status.png").stat().st_size > 10_000
