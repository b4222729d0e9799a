"""Mode resolution (header > key > org, every combination), header permission, tenant hashing,
sticky canary buckets."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.views import view as request_view

from ace_mw import AceConfig, InvalidOverrideHeader, Mode, RequestView, hash_key
from ace_mw.decide.policy import ANONYMOUS, OVERRIDE_NOT_PERMITTED, in_canary, resolve, sticky_bucket

HEADER = "x-ace-skill-speculative-decoding"
KEY = "sk-team-a"


def view(headers=None, key=KEY):
    return request_view({"model": "m"}, headers, key)


@pytest.mark.parametrize("org", ["off", "shadow", "prod"])
@pytest.mark.parametrize("key_mode", [None, "off", "shadow", "prod"])
@pytest.mark.parametrize("header", [None, "off", "shadow", "prod"])
def test_highest_level_that_sets_the_mode_decides_it(org, key_mode, header):
    key_settings = {} if key_mode is None else {"mode": key_mode}
    config = AceConfig.from_dict({"mode": org, "keys": {KEY: key_settings}})
    resolution = resolve(config, view({HEADER: header} if header else {}))
    expected = (header, "header") if header else (key_mode, "key") if key_mode else (org, "org")
    assert (resolution.mode.value, resolution.mode_source) == expected


@pytest.mark.parametrize("org", ["off", "shadow", "prod"])
def test_request_without_a_key_uses_the_org_mode(org):
    resolution = resolve(AceConfig.from_dict({"mode": org}), view(key=None))
    assert (resolution.mode.value, resolution.mode_source, resolution.tenant) == (org, "org", ANONYMOUS)


def test_unknown_key_uses_the_org_settings():
    config = AceConfig.from_dict({"mode": "prod", "keys": {KEY: {"mode": "off"}}})
    resolution = resolve(config, view(key="sk-other"))
    assert resolution.settings is config.org


@pytest.mark.parametrize("org_allows", [True, False])
@pytest.mark.parametrize("key_allows", [None, True, False])
def test_header_override_follows_the_key_permission_over_the_org_permission(org_allows, key_allows):
    key_settings = {} if key_allows is None else {"allow_header_override": key_allows}
    config = AceConfig.from_dict({"mode": "off", "allow_header_override": org_allows, "keys": {KEY: key_settings}})
    resolution = resolve(config, view({HEADER: "prod"}))
    permitted = org_allows if key_allows is None else key_allows
    if permitted:
        assert (resolution.mode, resolution.mode_source, resolution.notes) == (Mode.PROD, "header", ())
    else:
        assert (resolution.mode, resolution.mode_source) == (Mode.OFF, "org")
        assert resolution.notes == (OVERRIDE_NOT_PERMITTED,)


@pytest.mark.parametrize("value, mode", [("PROD", Mode.PROD), (" Shadow ", Mode.SHADOW), ("oFf", Mode.OFF)])
def test_header_value_is_case_insensitive(value, mode):
    assert resolve(AceConfig(), view({HEADER: value})).mode is mode


@pytest.mark.parametrize("value", ["", "on", "production", "prod,shadow", "1"])
def test_invalid_override_header_raises(value):
    with pytest.raises(InvalidOverrideHeader):
        resolve(AceConfig(), view({HEADER: value}))


def test_invalid_override_header_from_a_key_not_permitted_is_ignored():
    config = AceConfig.from_dict({"keys": {KEY: {"allow_header_override": False}}})
    assert resolve(config, view({HEADER: "bogus"})).notes == (OVERRIDE_NOT_PERMITTED,)


def test_invalid_override_header_is_an_openai_style_400():
    error = InvalidOverrideHeader("bogus")
    assert error.status_code == 400
    body = error.to_openai_error()["error"]
    assert (body["type"], body["param"], body["code"]) == (
        "invalid_request_error",
        "X-ACE-Skill-Speculative-Decoding",
        "invalid_speculative_decoding_mode",
    )
    assert "bogus" in body["message"]


def test_invalid_override_header_message_bounds_the_echoed_value():
    assert len(str(InvalidOverrideHeader("x" * 10_000))) < 200


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": f"Bearer {KEY}"},
        {"authorization": f"bearer  {KEY} "},
        {"x-api-key": KEY},
        {"api-key": KEY},
    ],
)
def test_api_key_is_read_from_the_usual_headers(headers):
    assert RequestView("POST", "/", headers, None).api_key == KEY


def test_tenant_is_the_hash_prefix_of_the_key_never_the_key():
    tenant = resolve(AceConfig(), view()).tenant
    assert tenant == hash_key(KEY).removeprefix("sha256:")[:16]
    assert KEY not in tenant


def test_configured_hashed_key_matches_the_raw_incoming_key():
    config = AceConfig.from_dict({"mode": "off", "keys": {hash_key(KEY): {"mode": "prod"}}})
    assert resolve(config, view()).mode is Mode.PROD


def test_sticky_bucket_is_fixed_per_tenant_and_conversation():
    assert sticky_bucket("t", "conv-1") == sticky_bucket("t", "conv-1")
    assert sticky_bucket("t", "conv-1") != sticky_bucket("u", "conv-1")


@given(st.text(), st.text())
def test_sticky_bucket_lies_in_the_unit_interval(tenant, sticky_id):
    assert 0.0 <= sticky_bucket(tenant, sticky_id) < 1.0


def test_canary_share_follows_the_percentage():
    buckets = [sticky_bucket("t", f"conversation-{i}") for i in range(20_000)]
    share = sum(in_canary(b, 5.0) for b in buckets) / len(buckets)
    assert 0.04 < share < 0.06


@pytest.mark.parametrize("percent, expected", [(0.0, False), (100.0, True)])
def test_canary_edges_include_nobody_or_everybody(percent, expected):
    assert {in_canary(sticky_bucket("t", str(i)), percent) for i in range(200)} == {expected}


def test_sticky_id_prefers_conversation_header_then_user_then_request_id():
    body = {"user": "u-1"}
    assert RequestView("POST", "/", {"x-ace-conversation-id": "c-1"}, body, request_id="r").sticky_id == "c-1"
    assert RequestView("POST", "/", {}, body, request_id="r").sticky_id == "u-1"
    assert RequestView("POST", "/", {}, {"user": 7}, request_id="r").sticky_id == "r"
