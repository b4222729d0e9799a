"""AceConfig: loading from dict / TOML / JSON / code, validation naming the field, key hashing,
per-field merge of key settings, immutability."""

import dataclasses
import json
import re

import pytest
import tomllib
from support.paths import ROOT

from ace_mw import AceConfig, ConfigError, GateConfig, KeySettings, Mode, SpeculativeParams, hash_key
from ace_mw.config import key_digest

TOML = """
mode = "prod"
adapter = "vllm"
canary_percent = 5
allow_header_override = false
paths = ["/v1/chat/completions"]

[speculative]
algorithm = "eagle"
num_speculative_tokens = 4
tree_choices = [[0], [0, 0], [1]]

[gate]
temperature_threshold = 0.5
alpha_floor = 0.4
reenable_threshold = 0.6

[pools]
speculative = "http://127.0.0.1:9001"
baseline = "http://127.0.0.1:9002"

[keys."sk-team-a"]
mode = "shadow"
allow_header_override = true

[keys."sk-team-a".speculative]
num_speculative_tokens = 2
"""

AS_DICT = {
    "mode": "prod",
    "adapter": "vllm",
    "canary_percent": 5,
    "allow_header_override": False,
    "paths": ["/v1/chat/completions"],
    "speculative": {"algorithm": "eagle", "num_speculative_tokens": 4, "tree_choices": [[0], [0, 0], [1]]},
    "gate": {"temperature_threshold": 0.5, "alpha_floor": 0.4, "reenable_threshold": 0.6},
    "pools": {"speculative": "http://127.0.0.1:9001", "baseline": "http://127.0.0.1:9002"},
    "keys": {
        "sk-team-a": {"mode": "shadow", "allow_header_override": True, "speculative": {"num_speculative_tokens": 2}}
    },
}


def test_defaults_follow_the_issue():
    config = AceConfig()
    assert config.speculative == SpeculativeParams(algorithm="eagle_2", num_speculative_tokens=5)
    assert (config.gate.temperature_threshold, config.gate.alpha_floor) == (0.70, 0.55)
    assert config.gate.reenable_threshold > config.gate.alpha_floor
    assert config.gate.default_temperature == 1.0
    assert config.gate.max_tracked_tenants == 100_000


def test_toml_file_loads_like_the_dict(tmp_path):
    path = tmp_path / "ace.toml"
    path.write_text(TOML)
    assert AceConfig.from_file(path) == AceConfig.from_dict(AS_DICT)


def test_json_file_loads_like_the_dict(tmp_path):
    path = tmp_path / "ace.json"
    path.write_text(json.dumps(AS_DICT))
    assert AceConfig.from_file(path) == AceConfig.from_dict(AS_DICT)


def test_code_construction_equals_the_dict():
    built = AceConfig(
        mode=Mode.PROD,
        adapter="vllm",
        canary_percent=5,
        allow_header_override=False,
        paths=("/v1/chat/completions",),
        speculative=SpeculativeParams("eagle", 4, tree_choices=((0,), (0, 0), (1,))),
        gate=GateConfig(temperature_threshold=0.5, alpha_floor=0.4, reenable_threshold=0.6),
        pools={"speculative": "http://127.0.0.1:9001", "baseline": "http://127.0.0.1:9002"},
        keys={
            "sk-team-a": KeySettings(
                mode=Mode.SHADOW, allow_header_override=True, speculative={"num_speculative_tokens": 2}
            )
        },
    )
    assert built == AceConfig.from_dict(AS_DICT)


def test_tree_choices_are_normalised_to_tuples():
    config = AceConfig.from_dict(AS_DICT)
    assert config.speculative.tree_choices == ((0,), (0, 0), (1,))


@pytest.mark.parametrize(
    "data, path",
    [
        ({"mode": "turbo"}, "mode"),
        ({"mode": 1}, "mode"),
        ({"gate": {"alpha_floor": 1.5}}, "gate.alpha_floor"),
        ({"gate": {"alpha_floor": float("nan")}}, "gate.alpha_floor"),
        ({"gate": {"reenable_threshold": -0.1}}, "gate.reenable_threshold"),
        ({"gate": {"alpha_floor": 0.7, "reenable_threshold": 0.6}}, "gate.reenable_threshold"),
        ({"gate": {"temperature_threshold": -1}}, "gate.temperature_threshold"),
        ({"gate": {"ema_half_life": 0}}, "gate.ema_half_life"),
        ({"gate": {"min_samples": 0}}, "gate.min_samples"),
        ({"gate": {"min_samples": 2.5}}, "gate.min_samples"),
        ({"gate": {"cooldown_s": -1}}, "gate.cooldown_s"),
        ({"gate": {"cooldown_growth": 0.5}}, "gate.cooldown_growth"),
        ({"gate": {"cooldown_s": 60, "max_cooldown_s": 30}}, "gate.max_cooldown_s"),
        ({"gate": {"probe_fraction": 1.1}}, "gate.probe_fraction"),
        ({"gate": {"max_concurrent_probes": 0}}, "gate.max_concurrent_probes"),
        ({"gate": {"max_tracked_tenants": 0}}, "gate.max_tracked_tenants"),
        ({"gate": {"alpa_floor": 0.5}}, "gate.alpa_floor"),
        ({"speculative": {"num_speculative_tokens": -1}}, "speculative.num_speculative_tokens"),
        ({"speculative": {"num_speculative_tokens": 0}}, "speculative.num_speculative_tokens"),
        ({"speculative": {"num_speculative_tokens": True}}, "speculative.num_speculative_tokens"),
        ({"speculative": {"num_speculative_tokens": 33}}, "speculative.num_speculative_tokens"),
        ({"speculative": {"algorithm": "medusa"}}, "speculative.algorithm"),
        ({"speculative": {"draft_model": ""}}, "speculative.draft_model"),
        ({"speculative": {"tree_choices": [[]]}}, "speculative.tree_choices"),
        ({"speculative": {"tree_choices": [[0, -1]]}}, "speculative.tree_choices"),
        ({"speculative": {"tree_choices": "0,1"}}, "speculative.tree_choices"),
        ({"speculative": 5}, "speculative"),
        ({"canary_percent": 101}, "canary_percent"),
        ({"canary_percent": "5"}, "canary_percent"),
        ({"allow_header_override": "yes"}, "allow_header_override"),
        ({"response_headers": "off"}, "response_headers"),
        ({"adapter": "tgi"}, "adapter"),
        ({"pools": {"speculative": 9001}}, "pools.speculative"),
        ({"pools": {"speculativ": "http://x"}}, "pools"),  # no baseline: where would plain decoding run?
        ({"pools": {"baseline": "http://b", "bad name!": "http://x"}}, "pools.bad name!"),
        ({"pools": {"baseline": "http://b"}, "candidates": [{"pool": "nope"}]}, "candidates[0].pool"),
        ({"candidates": [{"pool": "lookup"}]}, "candidates[0].pool"),  # no [pools] table
        ({"pools": {"baseline": "http://b"}, "speculative": {"pool": "baseline"}}, "speculative.pool"),
        ({"adapter": "vllm", "candidates": [{"algorithm": "eagle_2"}, {"algorithm": "ngram"}]}, "candidates[1].pool"),
        ({"speculative": {"pool": ""}}, "speculative.pool"),
        ({"pools": ["http://x"]}, "pools"),
        ({"paths": ["v1/chat/completions"]}, "paths"),
        ({"paths": "/v1/chat/completions"}, "paths"),
        ({"keys": {"sk-a": {"mode": "fast"}}}, f"keys.sha256:{key_digest('sk-a')[:12]}.mode"),
        ({"keys": {"sk-a": {"canary_percent": -5}}}, f"keys.sha256:{key_digest('sk-a')[:12]}.canary_percent"),
        (
            {"keys": {"sk-a": {"speculative": {"num_speculative_tokens": 0}}}},
            f"keys.sha256:{key_digest('sk-a')[:12]}.speculative.num_speculative_tokens",
        ),
        ({"keys": {"sk-a": {"speculative": {"k": 3}}}}, f"keys.sha256:{key_digest('sk-a')[:12]}.speculative.k"),
        (
            {"keys": {"sk-a": {"allow_header_override": 1}}},
            f"keys.sha256:{key_digest('sk-a')[:12]}.allow_header_override",
        ),
        ({"keys": {"sk-a": "prod"}}, f"keys.sha256:{key_digest('sk-a')[:12]}"),
        ({"keys": {"sha256:abc": {}}}, "keys.sha256:abc..."),
        ({"turbo": True}, "turbo"),
    ],
)
def test_invalid_value_raises_config_error_naming_the_field(data, path):
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict(data)
    assert caught.value.path == path
    assert str(caught.value).startswith(path + ": ")


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        AceConfig.from_dict({"mode": "turbo"})


def test_raw_key_never_appears_in_a_config_error():
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict({"keys": {"sk-secret-123": {"mode": "fast"}}})
    assert "sk-secret-123" not in str(caught.value)


def test_raw_key_never_appears_in_the_config_repr():
    assert "sk-secret-123" not in repr(AceConfig.from_dict({"keys": {"sk-secret-123": {"mode": "prod"}}}))


def test_hashed_and_raw_key_entries_build_the_same_table():
    raw = AceConfig.from_dict({"keys": {"sk-a": {"mode": "prod"}}})
    hashed = AceConfig.from_dict({"keys": {hash_key("sk-a"): {"mode": "prod"}}})
    assert raw == hashed
    assert dict(raw.key_table) == dict(hashed.key_table)
    assert list(hashed.key_table) == [key_digest("sk-a")]


def test_hashed_key_accepts_upper_case_hex():
    config = AceConfig.from_dict({"keys": {"sha256:" + key_digest("sk-a").upper(): {"mode": "prod"}}})
    assert list(config.key_table) == [key_digest("sk-a")]


@pytest.mark.parametrize("prefix", ["SHA256:", "Sha256:"])
def test_hashed_key_prefix_is_matched_in_any_case(prefix):
    config = AceConfig.from_dict({"keys": {prefix + key_digest("sk-a"): {"mode": "prod"}}})
    assert config == AceConfig.from_dict({"keys": {"sk-a": {"mode": "prod"}}})


@pytest.mark.parametrize(
    "written",
    ["sha-256:{}", "sha256={}", "SHA_256:{}", "sha265:{}", "sha256 {}", "sha256{}", "{}", "sha256:{}0"],
    ids=["dash", "equals", "underscore", "digits_swapped", "space", "no_colon", "bare_digest", "65_digits"],
)
def test_mistyped_hashed_key_is_a_config_error_not_a_raw_key(written):
    given = written.format(key_digest("sk-a"))
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict({"keys": {given: {"mode": "prod"}}})
    assert caught.value.path.startswith("keys.sha256:") and "64 hex digits" in caught.value.problem


@pytest.mark.parametrize("raw", ["sk-" + "0" * 64, "shadow-team", "key:abc"])
def test_raw_keys_that_merely_contain_hex_or_sha_stay_raw(raw):
    assert list(AceConfig.from_dict({"keys": {raw: {}}}).key_table) == [key_digest(raw)]


def test_same_key_given_raw_and_hashed_is_rejected():
    with pytest.raises(ConfigError, match="listed twice"):
        AceConfig.from_dict({"keys": {"sk-a": {}, hash_key("sk-a"): {}}})


def test_key_speculative_fields_merge_over_org_fields():
    settings = AceConfig.from_dict(AS_DICT).key_table[key_digest("sk-team-a")]
    assert settings.speculative == SpeculativeParams("eagle", 2, tree_choices=((0,), (0, 0), (1,)))


def test_key_without_settings_inherits_every_org_value():
    config = AceConfig.from_dict({**AS_DICT, "keys": {"sk-b": {}}})
    assert config.key_table[key_digest("sk-b")] == config.org  # mode (and its source), parameters, directives


def test_key_mode_is_recorded_as_set_by_the_key():
    settings = AceConfig.from_dict(AS_DICT).key_table[key_digest("sk-team-a")]
    assert (settings.mode, settings.mode_source, settings.allow_header_override) == (Mode.SHADOW, "key", True)


def test_applied_directive_is_precomputed_from_the_merged_settings():
    settings = AceConfig.from_dict(AS_DICT).key_table[key_digest("sk-team-a")]
    applied = settings.directives[1, "ok", True]
    assert applied.enabled and applied.pool == "speculative" and applied.measure
    assert (applied.algorithm, applied.num_speculative_tokens) == ("eagle", 2)
    assert {settings.directives[1, r, True].reason for r in ("ok", "probe", "explore")} == {"ok", "probe", "explore"}
    unread = settings.directives[1, "ok", False]  # past gate.max_measured_per_s: the same, asking for nothing
    assert unread == dataclasses.replace(applied, measure=False)
    assert settings.arms == ("plain", "eagle/k2/tree3")


def test_config_is_immutable():
    config = AceConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = Mode.OFF
    with pytest.raises(TypeError):
        config.pools["x"] = "http://y"


def test_unsupported_file_type_is_a_config_error(tmp_path):
    path = tmp_path / "ace.yaml"
    path.write_text("mode: prod")
    with pytest.raises(ConfigError, match="use .toml or .json"):
        AceConfig.from_file(path)


def test_malformed_toml_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "ace.toml"
    path.write_text("mode = ")
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_file(path)
    assert caught.value.path == str(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        AceConfig.from_file(tmp_path / "absent.json")


def test_json_array_at_the_top_is_a_config_error(tmp_path):
    path = tmp_path / "ace.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a table/object"):
        AceConfig.from_file(path)


@pytest.mark.parametrize(
    "method, path, handled",
    [
        ("POST", "/v1/chat/completions", True),
        ("POST", "/v1/completions", True),
        ("GET", "/v1/chat/completions", False),
        ("POST", "/v1/embeddings", False),
    ],
)
def test_handles_only_posts_to_configured_paths(method, path, handled):
    assert AceConfig().handles(method, path) is handled


def _doc_blocks(language):
    """The `language` code blocks of the complete example at the end of configuration.md."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    example = text.split("## Complete example", 1)[1]
    return re.findall(rf"```{language}\n(.*?)```", example, flags=re.S)


def test_documented_toml_and_json_examples_load_to_the_same_config():
    (toml_text,), (json_text,) = _doc_blocks("toml"), _doc_blocks("json")
    from_toml = AceConfig.from_dict(tomllib.loads(toml_text))
    from_json = AceConfig.from_dict(json.loads(json_text))
    assert from_toml == from_json  # every field, the hashed keys' settings included
    assert from_toml.key_table == from_json.key_table  # and what is derived from them
