"""`cluster.redis` and `cluster.replica_id`: parsed, checked, the password never shown."""

from __future__ import annotations

import pytest

from pulsegate.config import ConfigError, parse_config

BACKENDS = {"backends": [{"name": "a", "url": "http://127.0.0.1:9"}]}


def test_defaults_work_alone() -> None:
    """No `cluster` section: no Redis, replica id auto."""
    c = parse_config(BACKENDS).cluster
    assert c.redis is None and c.replica_id == "auto"


def test_a_url_with_a_password_is_kept_and_never_shown() -> None:
    """The URL is kept as given; the config's repr does not carry it."""
    url = "redis://:s3cret@10.0.0.5:6380/1"
    cfg = parse_config({**BACKENDS, "cluster": {"redis": url, "replica_id": "gw-a"}})
    assert cfg.cluster.redis == url and cfg.cluster.replica_id == "gw-a"
    assert "s3cret" not in repr(cfg)


@pytest.mark.parametrize(
    "url",
    ["http://:s3cret@h:6379", "redis://:s3cret@h:99999/0", "redis://:s3cret@h/zero", "redis://"],
)
def test_a_bad_url_names_the_key_not_the_password(url: str) -> None:
    """A URL redis-py could not use is an error naming cluster.redis, without the secret."""
    with pytest.raises(ConfigError) as e:
        parse_config({**BACKENDS, "cluster": {"redis": url}})
    assert any(err.startswith("cluster.redis:") for err in e.value.errors)
    assert "s3cret" not in str(e.value)


def test_unknown_keys_and_bad_ids_are_errors() -> None:
    """A misspelt key or a replica id with spaces is refused, with its key path."""
    with pytest.raises(ConfigError) as e:
        parse_config({**BACKENDS, "cluster": {"redis_url": "redis://h", "replica_id": "a b"}})
    errors = "\n".join(e.value.errors)
    assert "cluster.redis_url: unknown key" in errors and "cluster.replica_id:" in errors
