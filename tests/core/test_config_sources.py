"""``BackendConfig.from_sources``: arguments > ``KVWIRE_*`` environment > TOML/JSON file > defaults."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvwire import BackendConfig, ConfigError

TOML = """\
host = "10.0.0.1"
protocol = "rdma"
metadata_server = "http://meta:8080"
device = "mlx5_0"
timeout_s = 30
verbose = true
process_settings = true

[options]
streams = 2
ratio = 0.5
name = "a"
lanes = [1, 2]
"""


def _file(tmp_path: Path, text: str, name: str = "kvwire.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_nothing_given_is_the_defaults() -> None:
    assert BackendConfig.from_sources(env={}) == BackendConfig()


def test_a_toml_file_sets_every_field_and_options_keep_their_types(tmp_path: Path) -> None:
    config = BackendConfig.from_sources(_file(tmp_path, TOML), env={})
    assert config.to_dict() == {
        "host": "10.0.0.1",
        "protocol": "rdma",
        "metadata_server": "http://meta:8080",
        "device": "mlx5_0",
        "timeout_s": 30,
        "verbose": True,
        "process_settings": True,
        "options": {"streams": 2, "ratio": 0.5, "name": "a", "lanes": [1, 2]},
    }
    assert type(config.option("streams")) is int


def test_a_json_file_is_read_the_same_way(tmp_path: Path) -> None:
    data = {"host": "10.0.0.2", "timeout_s": 2.5, "options": {"streams": 4}}
    config = BackendConfig.from_sources(str(_file(tmp_path, json.dumps(data), "kv.json")), env={})
    assert (config.host, config.timeout_s, dict(config.options)) == ("10.0.0.2", 2.5, {"streams": 4})


def test_arguments_beat_the_environment_which_beats_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path, 'host = "file"\ntimeout_s = 1\nprotocol = "rdma"\n[options]\na = 1\nb = 1\nc = 1\n')
    env = {
        "KVWIRE_HOST": "env",
        "KVWIRE_TIMEOUT_S": "5",
        "KVWIRE_OPTIONS": '{"b": 2, "c": 2}',
        "KVWIRE_OPTION_C": "3",
    }
    config = BackendConfig.from_sources(path, env=env, host="arg", options={"d": 4})
    assert (config.host, config.timeout_s, config.protocol) == ("arg", 5.0, "rdma")
    assert dict(config.options) == {"a": 1, "b": 2, "c": 3, "d": 4}  # merged key by key, in the same order
    assert BackendConfig.from_sources(path, env=env, host=None).host == "env"  # None: not given


def test_the_file_comes_from_kvwire_config_unless_a_path_is_given(tmp_path: Path) -> None:
    from_env = _file(tmp_path, 'host = "from-env-file"\n', "a.toml")
    given = _file(tmp_path, 'host = "given-file"\n', "b.toml")
    assert BackendConfig.from_sources(env={"KVWIRE_CONFIG": str(from_env)}).host == "from-env-file"
    assert BackendConfig.from_sources(given, env={"KVWIRE_CONFIG": str(from_env)}).host == "given-file"


def test_env_defaults_to_the_process_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWIRE_CONFIG", str(_file(tmp_path, "verbose = true\n")))
    monkeypatch.setenv("KVWIRE_PROTOCOL", "rdma")
    config = BackendConfig.from_sources()
    assert (config.verbose, config.protocol) == (True, "rdma")


def test_an_unknown_key_in_the_file_is_named_with_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path, "timout_s = 3\n")
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(path, env={})
    assert str(exc.value).startswith(f"config file {path}: unknown key 'timout_s' (did you mean 'timeout_s'?); known")
    assert "[options] table" in str(exc.value)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('timeout_s = "five"', "timeout_s must be a number (int or float), got str 'five'"),
        ("verbose = 1", "verbose must be a boolean (true or false), got int 1"),
        ("host = 1", "host must be a string, got int 1"),
        ("timeout_s = true", "timeout_s must be a number (int or float), got bool True"),
        ('options = "x"', "options must be a table of backend options, got str 'x'"),
    ],
)
def test_a_wrong_type_in_the_file_is_named_with_the_file(tmp_path: Path, line: str, expected: str) -> None:
    path = _file(tmp_path, line + "\n")
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(path, env={})
    assert str(exc.value) == f"config file {path}: {expected}"


def test_a_bad_value_says_which_source_set_it(tmp_path: Path) -> None:
    path = _file(tmp_path, "timeout_s = -1\n")
    with pytest.raises(ConfigError, match=rf"must be finite and > 0, got -1 \(set by config file {path}\)$"):
        BackendConfig.from_sources(path, env={})
    with pytest.raises(ConfigError, match=r"got 0.0 \(set by \$KVWIRE_TIMEOUT_S\)$"):
        BackendConfig.from_sources(path, env={"KVWIRE_TIMEOUT_S": "0"})
    with pytest.raises(ConfigError, match=r"^BackendConfig.host must not be empty \(set by argument host=\)$"):
        BackendConfig.from_sources(env={}, host="")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"KVWIRE_TIMEOUT_S": "five"}, "$KVWIRE_TIMEOUT_S='five' is not a number; write e.g. KVWIRE_TIMEOUT_S=5"),
        ({"KVWIRE_VERBOSE": "maybe"}, "$KVWIRE_VERBOSE='maybe' is not a boolean; write KVWIRE_VERBOSE=1 or"),
        ({"KVWIRE_OPTIONS": "[1]"}, "$KVWIRE_OPTIONS must be a JSON object of options, got list: '[1]'"),
        ({"KVWIRE_OPTIONS": "{bad"}, "$KVWIRE_OPTIONS is not valid JSON"),
        ({"KVWIRE_OPTION_LANES": "[1, 2"}, "$KVWIRE_OPTION_LANES looks like JSON but is not valid"),
        ({"KVWIRE_OPTION_": "1"}, "$KVWIRE_OPTION_ names no option"),
    ],
)
def test_a_bad_environment_variable_is_named(env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(env=env)
    assert str(exc.value).startswith(expected)


def test_environment_values_are_parsed_by_the_field_type() -> None:
    env = {
        "KVWIRE_VERBOSE": "yes",
        "KVWIRE_PROCESS_SETTINGS": "0",
        "KVWIRE_DEVICE": "npu:0",
        "KVWIRE_HOST": "",  # empty means unset
        "KVWIRE_OPTION_STREAMS": "2",
        "KVWIRE_OPTION_NIC": "mlx5_0",
        "KVWIRE_OPTION_QUOTED": '"7"',
        "KVWIRE_OPTION_FLAG": "true",
    }
    config = BackendConfig.from_sources(env=env)
    assert (config.verbose, config.process_settings, config.device, config.host) == (True, False, "npu:0", "127.0.0.1")
    assert dict(config.options) == {"streams": 2, "nic": "mlx5_0", "quoted": "7", "flag": True}


def test_a_near_miss_of_a_setting_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvwire"):
        config = BackendConfig.from_sources(env={"KVWIRE_TIMEOUT": "5", "KVWIRE_BACKENDS": "local", "KVWIRE_X": "1"})
    assert config.timeout_s == 10.0
    assert [r.getMessage() for r in caplog.records] == [
        "kvwire: $KVWIRE_TIMEOUT is not a kvwire setting and is ignored (did you mean $KVWIRE_TIMEOUT_S?)"
    ]


def test_an_unknown_argument_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown argument timeout=3 \(did you mean 'timeout_s'\?\); known: device"):
        BackendConfig.from_sources(env={}, timeout=3)
    with pytest.raises(ConfigError, match=r"^argument: options must be a table of backend options, got list"):
        BackendConfig.from_sources(env={}, options=[1])


def test_file_problems_name_the_file_and_where_its_path_came_from(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"config file {missing} \(\$KVWIRE_CONFIG\) cannot be read"):
        BackendConfig.from_sources(env={"KVWIRE_CONFIG": str(missing)})
    with pytest.raises(ConfigError, match=rf"config file {missing} \(path argument\) cannot be read"):
        BackendConfig.from_sources(missing, env={})
    yaml = _file(tmp_path, "host: x\n", "kv.yaml")
    with pytest.raises(ConfigError, match=r"unknown format '\.yaml'; use a \.toml or \.json file"):
        BackendConfig.from_sources(yaml, env={})
    broken = _file(tmp_path, "host = \n")
    with pytest.raises(ConfigError, match=rf"config file {broken} is not valid TOML: .*line 1"):
        BackendConfig.from_sources(broken, env={})
    array = _file(tmp_path, "[1]", "kv.json")
    with pytest.raises(ConfigError, match=r"the top level must be an object of settings, got list"):
        BackendConfig.from_sources(array, env={})


def test_a_config_path_that_is_a_fifo_a_device_or_huge_is_refused_without_blocking(tmp_path: Path) -> None:
    """The path comes from the environment: a FIFO would block open(), /dev/zero would never end."""
    import os

    fifo = tmp_path / "kvwire.toml"
    os.mkfifo(fifo)  # nobody writes: a blocking open would wait forever
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(env={"KVWIRE_CONFIG": str(fifo)})
    assert str(exc.value) == f"config file {fifo} ($KVWIRE_CONFIG) is not read: not a regular file"
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(zero, env={})
    assert str(exc.value) == f"config file {zero} (path argument) is not read: not a regular file"
    huge = _file(tmp_path, "# " + "x" * (1 << 20) + "\n", "huge.toml")
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(huge, env={})
    assert (
        str(exc.value)
        == f"config file {huge} (path argument) is not read: {(1 << 20) + 3} bytes, over the limit of 1048576"
    )
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'host = "caf\xe9"\n')
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(latin, env={})
    assert str(exc.value) == f"config file {latin} (path argument) is not UTF-8: invalid continuation byte at byte 11"


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_check_seconds_refuses_what_is_not_finite(value: float) -> None:
    from kvwire.config import check_seconds

    with pytest.raises(ConfigError) as exc:
        check_seconds(value, "poll_s")
    assert str(exc.value) == f"poll_s must be a finite number of seconds > 0, got {value!r}"
    with pytest.raises(ConfigError):
        check_seconds(value, "poll_s", zero=True)
    assert check_seconds(0, "poll_s", zero=True) == 0.0 and check_seconds(2.5, "poll_s") == 2.5
