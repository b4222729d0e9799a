"""The status report (`AceController.status()`) as a small HTML page that refreshes itself.

Static HTML with inline style, no script: every value is escaped, and the admin endpoint serves it
under a content security policy that lets nothing else load or run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from html import escape
from typing import Any

REFRESH_S = 5

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d2430;background:#f7f8fa}
h1{font-size:1.4em;margin:0}h2{font-size:1.1em;margin:1.4em 0 .4em}
.muted{color:#667085}.banner{padding:.7em 1em;border-radius:6px;margin:1em 0}
.error{background:#fde8e8;border:1px solid #e05252;color:#7a1010}
table{border-collapse:collapse;background:#fff;min-width:40em}
th,td{border:1px solid #d5d9e0;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#eef1f5}dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em;margin:0}
dt{color:#667085}dd{margin:0}ul{margin:0;padding-left:1.1em}
.state-closed{color:#157f3b;font-weight:600}.state-open,.state-half_open{color:#b42318;font-weight:600}
.chosen{font-weight:600}.unmeasured{color:#667085}.warn{color:#b42318;font-weight:600}
code{font-size:.95em}
"""


def render_status(report: Mapping[str, Any]) -> str:
    """The page for one status report."""
    now = report["generated_at"]
    config = report["config"]
    tenants = report["tenants"]
    return "".join(
        (
            '<!doctype html><html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="refresh" content="{REFRESH_S}">',
            f"<title>ace-mw status</title><style>{_STYLE}</style></head><body>",
            "<h1>ace-mw status</h1>",
            f'<p class="muted">ace-mw {_text(report["ace_mw"])} · generated {_time(now, now)} · '
            f"refreshes every {REFRESH_S} s</p>",
            _banner(config, now),
            *(_watcher_banner(watcher) for watcher in config.get("watchers", ())),
            *(
                f'<div class="banner error" role="alert" data-warning="pool"><strong>Pool</strong>: {_text(w)}</div>'
                for w in report.get("warnings", ())
            ),
            '<h2>Configuration</h2><dl id="config">',
            _pair("version", config["version"]),
            _pair("loaded", _time(config["loaded_at"], now)),
            _pair("source", config["source"]),
            _pair("mode", config["mode"]),
            _pair("policy", config["policy"]),
            _pair("adapter", config["adapter"]),
            _pair("rejected attempts", config["rejections"]),
            _last_rejection(config, now),
            "</dl>",
            _watchers(config.get("watchers", ()), now),
            _pools(report.get("pools", {})),
            '<h2>State store</h2><dl id="store">',
            *(_store_pair(name, value, now) for name, value in report["store"].items()),
            "</dl>",
            "<h2>Priors (what the tenants of each model measured)</h2>",
            _priors(report.get("priors", [])),
            f"<h2>Tenants ({len(tenants)} most recently used)</h2>",
            _tenants(tenants),
            "<h2>Decisions (this process)</h2>",
            _counts(report["decisions"], report.get("failures", {})),
            "</body></html>",
        )
    )


def _banner(config: Mapping[str, Any], now: float) -> str:
    rejection = config["last_rejection"]
    if rejection is None or not rejection["after_current"]:
        return ""
    return (
        '<div class="banner error" role="alert" id="reload-error"><strong>Config reload rejected</strong> '
        f"({_text(rejection['source'])}, {_time(rejection['at'], now)}): <code>{_text(rejection['error'])}</code>. "
        f"Version {_text(config['version'])} stays in force.</div>"
    )


def _watcher_banner(watcher: Mapping[str, Any]) -> str:
    """A watcher that cannot follow its file (stuck on the file system, stopped, failing) or that
    holds a change back must not go unnoticed."""
    path = _text(watcher["path"])
    if watcher["stuck"]:
        problem = f"has been stuck reading the file for {watcher['poll_running_s']:.0f} s (a hung file system?)"
    elif not watcher["running"]:
        problem = "is not running: changes to the file are not applied"
    elif watcher["failures_in_a_row"]:
        problem = f"failed {watcher['failures_in_a_row']} polls in a row: <code>{_text(watcher['last_error'])}</code>"
    elif watcher["held"] is not None:
        held = watcher["held"]
        problem = f"holds a change back for {held['applies_in_s']:.0f} s more: {_text(held['why'])}"
    else:
        return ""
    return (
        f'<div class="banner error" role="alert" data-watcher="{path}"><strong>Config watcher</strong> for '
        f"<code>{path}</code> {problem}.</div>"
    )


def _watchers(watchers: Any, now: float) -> str:
    rows = []
    for w in watchers:
        seen = _time(w["last_poll_at"], now) if w["last_poll_at"] is not None else "not yet"
        state = "stuck" if w["stuck"] else "running" if w["running"] else "stopped"
        shown = state if state == "running" else f'<span class="warn">{state}</span>'
        rows.append(
            f"<tr><td><code>{_text(w['path'])}</code></td><td>{shown}</td><td>every {w['interval_s']} s</td>"
            f"<td>{seen}</td><td>{w['failures_in_a_row']}</td></tr>"
        )
    if not rows:
        return ""
    head = "<tr><th>file</th><th>watcher</th><th>polls</th><th>last look</th><th>failures in a row</th></tr>"
    table = f'<table id="watchers"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'
    return f"<h2>Config files followed</h2>{table}"


def _pools(pools: Mapping[str, Mapping[str, Any]]) -> str:
    if not pools:
        return ""
    rows = []
    for name, row in pools.items():
        if row["error"]:
            said = f'<span class="warn">{_text(row["error"])}</span>'
        elif row["facts"] is not None:
            said = ", ".join(f"{_text(k)} {_text(v)}" for k, v in row["facts"].items())
        else:
            said = '<span class="muted">not asked (the adapter has no probe)</span>'
        responses = ", ".join(f"{_text(o)} {n}" for o, n in sorted(row["responses"].items())) or "-"
        if row.get("ejected"):
            state = f'<span class="warn">ejected for {row["ejected_for_s"]:.0f} s</span>'
        else:
            state = "in" + (
                f' <span class="muted">({row["failures_in_a_row"]} failures in a row)</span>'
                if row.get("failures_in_a_row")
                else ""
            )
        state += f' <span class="muted">(ejections {row["ejections"]})</span>' if row.get("ejections") else ""
        rows.append(
            f"<tr><td>{_text(name)}</td><td><code>{_text(row['url'])}</code></td><td>{said}</td>"
            f"<td>{state}</td><td>{responses}</td></tr>"
        )
    head = "<tr><th>pool</th><th>URL</th><th>what it says it is</th><th>in the loop</th><th>responses</th></tr>"
    return f'<h2>Pools</h2><table id="pools"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _last_rejection(config: Mapping[str, Any], now: float) -> str:
    rejection = config["last_rejection"]
    if rejection is None:
        return ""
    return _pair(
        "last rejected",
        f"{_text(rejection['source'])}, {_time(rejection['at'], now)}: <code>{_text(rejection['error'])}</code>",
        raw=True,
    )


def _store_pair(name: str, value: Any, now: float) -> str:
    # A shared store says here whether it is degraded; make that impossible to miss.
    warn = "degraded" in name and bool(value)
    moment = name.endswith(("_since", "_at")) and isinstance(value, (int, float)) and not isinstance(value, bool)
    shown = _time(value, now) if moment else _text(value)
    return _pair(name, f'<span class="warn">{shown}</span>' if warn else shown, raw=True)


def _priors(priors: list[Mapping[str, Any]]) -> str:
    """The pooled prior per (model, arm): where a tenant with little evidence of its own starts."""
    if not priors:
        return '<p class="muted">No arm has been measured against plain decoding yet.</p>'
    rows = "".join(
        f"<tr><td>{_text(p['model'] or '-')}</td><td>{_text(p['arm'])}</td><td>{p['speedup']:.2f}x</td>"
        f"<td>&plusmn;{p['spread']:.2f}</td><td>{p['tenants']}</td><td>{p['samples']:.1f}</td></tr>"
        for p in priors
    )
    head = (
        "<tr><th>model</th><th>arm</th><th>speed over plain</th><th>spread (log)</th><th>tenants</th>"
        "<th>samples</th></tr>"
    )
    return f'<table id="priors"><thead>{head}</thead><tbody>{rows}</tbody></table>'


def _tenants(tenants: list[Mapping[str, Any]]) -> str:
    if not tenants:
        return '<p class="muted">No tenant has reached the gates yet.</p>'
    rows = "".join(_tenant_row(t) for t in tenants)
    return (
        '<table id="tenants"><thead><tr><th>tenant (name, hash)</th><th>model</th><th>breaker</th>'
        "<th>rolling alpha</th><th>arms: decode speed</th><th>chosen arm</th><th>decisions by reason</th>"
        f"</tr></thead><tbody>{rows}</tbody></table>"
    )


def _tenant_row(tenant: Mapping[str, Any]) -> str:
    breaker = tenant["breaker"]
    state = breaker["state"]
    reopens = breaker["reopens_in_s"]
    state_cell = f'<span class="state-{_text(state)}">{_text(state)}</span>'
    if state != "closed" and reopens is not None:
        state_cell += f'<br><span class="muted">half-open in {reopens:.0f} s</span>'
    state_cell += f'<br><span class="muted">trips {breaker["trips"]}</span>'
    chosen = tenant["chosen_arm"]
    speedup = tenant["speedup"]
    chosen_cell = _text(chosen) + (f' <span class="muted">({speedup:.2f}x plain)</span>' if speedup else "")
    if tenant.get("chosen_reason"):
        chosen_cell += f'<br><span class="muted">{_text(tenant["chosen_reason"])}</span>'
    decisions = ", ".join(f"{_text(reason)} {n}" for reason, n in sorted(tenant["decisions"].items())) or "-"
    if tenant.get("unread"):
        decisions += f'<br><span class="muted">{tenant["unread"]} not measured (read-rate cap)</span>'
    return (
        f'<tr data-tenant="{_text(tenant["tenant"])}"><td>{_tenant_cell(tenant)}</td>'
        f"<td>{_text(tenant['model'] or '-')}</td><td>{state_cell}</td>"
        f'<td>{_number(breaker["rolling_alpha"], 3)} <span class="muted">(n={breaker["samples"]})</span></td>'
        f"<td>{_arms(tenant['arms'], chosen)}</td><td>{chosen_cell}</td><td>{decisions}</td></tr>"
    )


def _tenant_cell(tenant: Mapping[str, Any]) -> str:
    """The key's name where it has one (its hash under it), else the hash."""
    code = f"<code>{_text(tenant['tenant'])}</code>"
    name = tenant.get("name")
    return f'<strong class="tenant-name">{_text(name)}</strong><br>{code}' if name else code


def _arms(arms: list[Mapping[str, Any]], chosen: str) -> str:
    items = []
    for arm in arms:
        classes = " ".join(
            c for c in ("chosen" if arm["arm"] == chosen else "", "" if arm["measured"] else "unmeasured") if c
        )
        rate = f"{arm['tokens_per_s']:.1f} tok/s" if arm["tokens_per_s"] is not None else "no estimate"
        if arm.get("acceptance") is not None:
            rate += f", acceptance {arm['acceptance']:.3f}"
        notes = f"{arm['samples']:.1f} samples"
        notes += "" if arm["measured"] else ", unmeasured"
        notes += "" if arm["current"] else ", not in the current config"
        items.append(f'<li class="{classes}">{_text(arm["arm"])}: {rate} <span class="muted">({notes})</span></li>')
    return f"<ul>{''.join(items)}</ul>"


def _counts(decisions: Mapping[str, Mapping[str, int]], failures: Mapping[str, int]) -> str:
    rows = [(outcome, reason, n) for outcome, reasons in decisions.items() for reason, n in sorted(reasons.items())]
    rows += [("fail-open", stage, n) for stage, n in sorted(failures.items())]
    if not rows:
        return '<p class="muted">No decision yet.</p>'
    body = "".join(f"<tr><td>{_text(o)}</td><td>{_text(r)}</td><td>{n}</td></tr>" for o, r, n in rows)
    head = "<tr><th>outcome</th><th>reason / stage</th><th>count</th></tr>"
    return f'<table id="counters"><thead>{head}</thead><tbody>{body}</tbody></table>'


def _pair(name: str, value: Any, *, raw: bool = False) -> str:
    return f"<dt>{_text(name)}</dt><dd>{value if raw else _text(value)}</dd>"


def _time(at: float, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
    return f"{stamp} ({max(0.0, now - at):.0f} s ago)"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _text(value: Any) -> str:
    return escape(str(value))
