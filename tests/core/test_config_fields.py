"""AceConfig beyond the basics: candidates and the speed knobs, the state backend, secrets from the
environment or files, names, and the messages an operator can act on (unknown fields, bounds)."""

import pytest

from ace_mw import AceConfig, ConfigError, Mode, SpeculativeParams, hash_key
from ace_mw.config import key_digest

# -- candidates and the speed policy ----------------------------------------------------------------


def test_candidates_are_speculative_tables_over_the_level_speculative_table():
    config = AceConfig.from_dict(
        {
            "speculative": {"num_speculative_tokens": 4},
            "candidates": [{"algorithm": "eagle_2", "num_speculative_tokens": 6}, {"algorithm": "ngram"}],
        }
    )
    assert config.candidates == (SpeculativeParams("eagle_2", 6), SpeculativeParams("ngram", 4))
    assert config.org.arms == ("plain", "eagle_2/k6", "ngram/k4")


def test_a_plain_speculative_table_is_a_one_candidate_list():
    config = AceConfig.from_dict({"speculative": {"algorithm": "draft_model", "draft_model": "tiny"}})
    assert config.candidates is None
    assert config.org.candidates == (SpeculativeParams("draft_model", draft_model="tiny"),)
    assert config.org.arms == ("plain", "draft_model/k5/tiny")


def test_key_candidates_replace_the_orgs_and_key_speculative_fields_apply_to_inherited_ones():
    config = AceConfig.from_dict(
        {
            "candidates": [{"algorithm": "eagle_2"}, {"algorithm": "ngram"}],
            "keys": {
                "sk-own": {"candidates": [{"algorithm": "draft_model"}]},
                "sk-inherits": {"speculative": {"num_speculative_tokens": 3}},
            },
        }
    )
    assert config.key_table[key_digest("sk-own")].arms == ("plain", "draft_model/k5")
    assert config.key_table[key_digest("sk-inherits")].arms == ("plain", "eagle_2/k3", "ngram/k3")


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"candidates": []}, "candidates"),
        ({"candidates": {"algorithm": "ngram"}}, "candidates"),
        ({"candidates": [{"algorithm": "ngram"}, {"algorithm": "ngram"}]}, "candidates[1]"),
        ({"candidates": [{"algorithm": "medusa"}]}, "candidates[0].algorithm"),
        ({"candidates": [{"k": 3}]}, "candidates[0].k"),
        ({"candidates": [{"algorithm": "ngram", "num_speculative_tokens": n} for n in range(1, 11)]}, "candidates"),
        ({"keys": {"sk-a": {"candidates": []}}}, "keys.sha256:"),
        (
            {
                "keys": {"sk-a": {"speculative": {"num_speculative_tokens": 5}}},
                "candidates": [{}, {"num_speculative_tokens": 6}],
            },
            "keys.sha256:",
        ),
        ({"gate": {"policy": "fastest"}}, "gate.policy"),
        ({"gate": {"explore_fraction": 1.5}}, "gate.explore_fraction"),
        ({"gate": {"speed_half_life_s": 0}}, "gate.speed_half_life_s"),
        ({"gate": {"speed_max_misses": 0}}, "gate.speed_max_misses"),
    ],
)
def test_bad_candidates_and_speed_knobs_name_the_field(data, path):
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict(data)
    assert caught.value.path.startswith(path)


# -- state ----------------------------------------------------------------------------------------


def test_state_defaults_to_memory():
    state = AceConfig().state
    assert (state.backend, state.url, state.sync_interval_s) == ("memory", None, 1.0)


@pytest.mark.parametrize(
    "state, path",
    [
        ({"backend": "memcached"}, "state.backend"),
        ({"backend": "redis"}, "state.url"),
        ({"backend": "redis", "url": "http://user:pw@host"}, "state.url"),
        ({"url": "redis://host:6379/0"}, "state.url"),
        ({"backend": "redis", "url": "redis://h:1/0", "sync_interval_s": 0}, "state.sync_interval_s"),
        ({"backend": "redis", "url": "redis://h:1/0", "sync_interval_s": "1"}, "state.sync_interval_s"),
        ({"backend": "redis", "url": "redis://h:1/0", "timeout_s": -1}, "state.timeout_s"),
        ({"backend": "redis", "url": "redis://h:1/0", "ttl_s": 5}, "state.ttl_s"),
        ({"backend": "redis", "url": "redis://h:1/0", "prefix": ""}, "state.prefix"),
        ({"backend": "redis", "url": "redis://h:1/0", "interval": 1}, "state.interval"),
        ("redis", "state"),
    ],
)
def test_bad_state_settings_name_the_field(state, path):
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict({"state": state})
    assert caught.value.path == path
    assert "pw" not in str(caught.value)  # a URL's secret is not echoed


# -- secrets, names and messages an operator can act on --------------------------------------------

TOKEN = "Zq0b8WJ3u1c1kQ5bS8n2m4vX7pT6yR9eA0dF3hG5jK8"


def test_a_string_may_come_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ACE_TEST_TOKEN", TOKEN)
    (tmp_path / "url").write_text("redis://:pw@redis.internal:6379/0\n")  # as `echo` writes it
    config = AceConfig.from_dict(
        {
            "admin": {"token": {"env": "ACE_TEST_TOKEN"}},
            "state": {"backend": "redis", "url": {"file": str(tmp_path / "url")}},
            "pools": {"baseline": {"env": "ACE_TEST_TOKEN"}},  # any string value
        }
    )
    assert config.admin is not None and config.admin.token == TOKEN
    assert config.state.url == "redis://:pw@redis.internal:6379/0" and config.pools["baseline"] == TOKEN


def test_a_file_config_resolves_references_too(tmp_path, monkeypatch):
    monkeypatch.setenv("ACE_TEST_TOKEN", TOKEN)
    (tmp_path / "ace.toml").write_text('mode = "prod"\n[admin]\ntoken = {env = "ACE_TEST_TOKEN"}\n')
    assert AceConfig.from_file(tmp_path / "ace.toml").admin.token == TOKEN


def test_pool_and_key_names_called_env_or_file_are_names_not_references():
    with pytest.raises(ConfigError) as caught:  # a pool named "env", not a variable: baseline is missing
        AceConfig.from_dict({"pools": {"env": "http://e"}})
    assert caught.value.path == "pools" and "baseline" in caught.value.problem
    config = AceConfig.from_dict({"keys": {"env": {"mode": "prod"}}})  # a developer key that is "env"
    assert config.key_table[key_digest("env")].mode == Mode.PROD


@pytest.mark.parametrize(
    "reference, path, problem",
    [
        (
            {"env": "ACE_SURELY_UNSET_VARIABLE"},
            "admin.token",
            "environment variable ACE_SURELY_UNSET_VARIABLE is not set",
        ),
        ({"file": "/nonexistent/ace-secret"}, "admin.token", "cannot read secret file /nonexistent/ace-secret"),
        ({"env": ""}, "admin.token", "must name a variable"),
    ],
)
def test_a_missing_secret_names_the_field_and_the_source(reference, path, problem):
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict({"admin": {"token": reference}})
    assert caught.value.path == path and problem in caught.value.problem


def test_a_secret_never_appears_in_an_error(monkeypatch):
    monkeypatch.setenv("ACE_TEST_TOKEN", "short-secret")
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict({"admin": {"token": {"env": "ACE_TEST_TOKEN"}}})
    assert caught.value.path == "admin.token" and "short-secret" not in str(caught.value)


def test_the_admin_token_may_be_its_hash_alone():
    hashed = AceConfig.from_dict({"admin": {"token": hash_key(TOKEN).upper().replace("SHA256", "sha256")}})
    plain = AceConfig.from_dict({"admin": {"token": TOKEN}})
    assert hashed.admin.digest == plain.admin.digest
    with pytest.raises(ConfigError, match="'sha256:' \\+ 64 hex digits"):
        AceConfig.from_dict({"admin": {"token": "sha256:abc"}})


def test_mode_is_read_in_any_case_like_the_header():
    config = AceConfig.from_dict({"mode": "PROD", "keys": {"sk-a": {"mode": "Shadow"}}})
    assert config.mode == Mode.PROD and config.key_table[key_digest("sk-a")].mode == Mode.SHADOW


@pytest.mark.parametrize(
    "data, path, hint",
    [
        ({"adaptr": "vllm"}, "adaptr", "did you mean 'adapter'?"),
        ({"gate": {"alpha_flor": 0.5}}, "gate.alpha_flor", "did you mean 'alpha_floor'?"),
        ({"state": {"backend": "redis", "urll": "redis://x"}}, "state.urll", "did you mean 'url'?"),
    ],
)
def test_an_unknown_field_suggests_the_closest_one(data, path, hint):
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict(data)
    assert caught.value.path == path and caught.value.problem == f"unknown field; {hint}"


def test_an_unknown_field_with_no_close_match_lists_a_few_known_ones():
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict({"zzzzzz": 1})
    assert "known:" in caught.value.problem and "in all)" in caught.value.problem


def test_redis_without_a_url_says_it_is_required():
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict({"state": {"backend": "redis"}})
    assert caught.value.path == "state.url" and caught.value.problem.startswith("required with backend = 'redis'")
    with pytest.raises(ConfigError, match="state.required: is only used with backend = 'redis'"):
        AceConfig.from_dict({"state": {"required": True}})


def test_a_key_may_have_a_name_of_bounded_form():
    config = AceConfig.from_dict({"keys": {"sk-a": {"name": "team-a", "mode": "prod"}}})
    assert config.key_table[key_digest("sk-a")].name == "team-a" and config.org.name is None
    with pytest.raises(ConfigError) as caught:
        AceConfig.from_dict({"keys": {"sk-a": {"name": "team a!"}}})
    assert caught.value.path.endswith(".name")


@pytest.mark.parametrize(
    ("bands", "problem"),
    [
        ([0.6, 0.3], "must rise strictly"),
        ([0.3, 0.3], "must rise strictly"),
        ([0.0], "must rise strictly"),
        ([-0.1], "must be >= 0"),
        (["0.5"], "must be a number"),
        (0.5, "must be a list of temperatures"),
        ("0.5", "must be a list of temperatures"),
        ([0.1 * i for i in range(1, 10)], "at most 8 bounds"),
    ],
)
def test_temperature_bands_must_be_a_short_rising_list_of_positive_temperatures(bands, problem):
    with pytest.raises(ConfigError, match=f"gate.temperature_bands: .*{problem}"):
        AceConfig.from_dict({"gate": {"temperature_bands": bands}})


def test_temperature_bands_are_kept_as_a_tuple_and_may_reach_past_the_threshold():
    gate = AceConfig.from_dict({"gate": {"temperature_bands": [0.2, 1.5]}}).gate
    assert gate.temperature_bands == (0.2, 1.5)
    assert AceConfig.from_dict({"gate": {"temperature_bands": []}}).gate.temperature_bands == ()
    assert AceConfig.from_dict({}).gate.temperature_bands == (0.5,)
