"""Client keys: the `auth` config (inline and keys file), presenting, lookup, `key new`."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from pulsegate.cli import main
from pulsegate.config import ConfigError, load_config, parse_config
from pulsegate.front.keys import KEY_PREFIX, KeyRing, Models, entry_yaml, new_key, presented

BACKENDS = [{"name": "a", "url": "http://127.0.0.1:9001"}]
KEY = "pg-test-key-0123456789"
HEX = hashlib.sha256(KEY.encode()).hexdigest()


def errors(auth: object, base_dir: str | None = None) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config({"backends": BACKENDS, "auth": auth}, base_dir)
    return e.value.errors


def test_inline_keys_load_with_defaults() -> None:
    """An inline key gets every model and no limits unless it says otherwise."""
    cfg = parse_config(
        {"backends": BACKENDS, "auth": {"keys": [{"name": "k", "sha256": HEX, "rpm": 5}]}}
    )
    assert cfg.auth is not None
    (k,) = cfg.auth.keys
    assert (k.name, k.sha256, k.models, k.rpm, k.tpm, k.concurrency) == (
        "k", HEX, ("*",), 5, 0, 0
    )  # fmt: skip
    assert HEX not in repr(cfg)


def test_no_auth_section_is_no_door() -> None:
    """Without `auth:` the config has no keys (the gateway stays open, as before)."""
    assert parse_config({"backends": BACKENDS}).auth is None


def test_key_env_is_hashed_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """key_env: the variable's key is hashed at load; only its digest and the name are kept."""
    monkeypatch.setenv("PG_TEST_KEY", KEY)
    cfg = parse_config(
        {"backends": BACKENDS, "auth": {"keys": [{"name": "k", "key_env": "PG_TEST_KEY"}]}}
    )
    assert cfg.auth is not None
    assert cfg.auth.keys[0].sha256 == HEX
    assert KEY not in repr(cfg)


def test_keys_file_relative_to_the_config(tmp_path: Path) -> None:
    """`auth.keys_file` is read relative to the config file's directory."""
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"keys": [{"name": "k", "sha256": HEX}]}))
    conf = tmp_path / "gw.yaml"
    conf.write_text(yaml.safe_dump({"backends": BACKENDS, "auth": {"keys_file": "keys.yaml"}}))
    cfg = load_config(conf)
    assert cfg.auth is not None and cfg.auth.keys[0].name == "k"
    assert cfg.auth.keys_file == "keys.yaml"


@pytest.mark.parametrize(
    ("auth", "want"),
    [
        ({"keys": []}, "auth.keys: must be a non-empty list of keys"),
        ({"keys": [{"sha256": HEX}]}, "auth.keys[0].name: is required"),
        ({"keys": [{"name": "k"}]}, "auth.keys[0]: needs sha256 or key_env"),
        (
            {"keys": [{"name": "k", "sha256": HEX, "key_env": "X"}]},
            "auth.keys[0].key_env: set sha256 or key_env, not both",
        ),
        (
            {"keys": [{"name": "k", "key_env": "PG_SURELY_UNSET_VAR"}]},
            "auth.keys[0].key_env: environment variable PG_SURELY_UNSET_VAR is not set",
        ),
        (
            {"keys": [{"name": "k", "sha256": HEX}, {"name": "k", "sha256": "0" * 64}]},
            "auth.keys[1].name: duplicate of auth.keys[0] (k)",
        ),
        (
            {"keys": [{"name": "a", "sha256": HEX}, {"name": "b", "sha256": HEX}]},
            "auth.keys[1].sha256: the same key as auth.keys[0] (a)",
        ),
        (
            {"keys": [{"name": "k", "sha256": HEX, "rpm": -1}]},
            "auth.keys[0].rpm: must be >= 0, got -1",
        ),
        ({"keys": [{"name": "k", "sha256": HEX, "tmp": 5}]}, "auth.keys[0].tmp: unknown key"),
        ({"keys_file": "k.yaml", "keys": []}, "auth: set keys_file or keys, not both"),
    ],
)
def test_bad_keys_name_their_path(auth: object, want: str) -> None:
    """Each broken entry is a config error naming its key path."""
    assert want in errors(auth)


def test_a_key_pasted_as_its_digest_is_not_echoed() -> None:
    """A key written where its sha256 belongs: refused without repeating the value."""
    (err,) = errors({"keys": [{"name": "k", "sha256": KEY}]})
    assert err.startswith("auth.keys[0].sha256: must be 64 lower-case hex digits")
    assert KEY not in err


@pytest.mark.parametrize(
    ("content", "want"),
    [
        ("keys: [name: k\n", "auth.keys_file: keys.yaml: not valid YAML"),
        ("- name: k\n", "auth.keys_file: keys.yaml: must be a mapping, got list"),
        ("other: 1\n", "auth.keys_file: keys.yaml: needs a top-level `keys:` list"),
        ("keys:\n  - {name: k, sha256: " + HEX + ", rpm: x}\n",
         "auth.keys_file: keys.yaml: keys[0].rpm: must be an integer, got 'x'"),
    ],
)  # fmt: skip
def test_a_broken_keys_file_names_the_file(tmp_path: Path, content: str, want: str) -> None:
    """Bad YAML, a wrong shape or a bad entry in the keys file: an error under auth.keys_file."""
    (tmp_path / "keys.yaml").write_text(content)
    assert any(e.startswith(want) for e in errors({"keys_file": "keys.yaml"}, str(tmp_path)))


def test_a_missing_keys_file_is_an_error(tmp_path: Path) -> None:
    """A keys file that cannot be read is named with the reason."""
    (err,) = errors({"keys_file": "nope.yaml"}, str(tmp_path))
    assert err == "auth.keys_file: nope.yaml: cannot read: No such file or directory"


@pytest.mark.parametrize(
    ("headers", "want"),
    [
        ({"authorization": f"Bearer {KEY}"}, KEY),
        ({"authorization": f"bearer  {KEY} "}, KEY),
        ({"x-api-key": KEY}, KEY),
        ({"authorization": f"Basic {KEY}"}, None),
        ({"authorization": "Bearer "}, None),
        ({}, None),
    ],
)
def test_presented_key(headers: dict[str, str], want: str | None) -> None:
    """Bearer (any case) or x-api-key present a key; another scheme or an empty one none."""
    assert presented(headers) == want


def test_the_ring_finds_by_digest_and_shares_quotas() -> None:
    """A known key finds its caller; an unknown one nothing; quotas split over workers."""
    cfg = parse_config(
        {"backends": BACKENDS, "auth": {"keys": [{"name": "k", "sha256": HEX, "rpm": 10}]}}
    )
    assert cfg.auth is not None
    ring = KeyRing(cfg.auth.keys, share=4)
    found = ring.find(KEY)
    assert found is not None and found.name == "k" and found.quota.rpm == 3
    assert ring.find(KEY + "x") is None


def test_model_globs() -> None:
    """fnmatch globs, case-sensitive; '*' allows all."""
    m = Models(["llama-3*", "gpt-4o"])
    assert m.allows("llama-3.1-8b") and m.allows("gpt-4o")
    assert not m.allows("gpt-4o-mini") and not m.allows("Llama-3")
    assert Models(["*"]).allows("anything")


def test_new_keys_are_fresh_and_recognisable() -> None:
    """`pg-` and 256 random bits, never the same twice."""
    a, b = new_key(), new_key()
    assert a.startswith(KEY_PREFIX) and len(a) >= 40 and a != b


def test_key_new_prints_a_key_and_an_entry_that_loads(capsys: pytest.CaptureFixture[str]) -> None:
    """`pulsegate key new`: the key once, and an entry (digest only) that loads and matches it."""
    assert main(["key", "new", "team-a", "--models", "demo-*", "--rpm", "60", "--tpm", "1000"]) == 0
    out = capsys.readouterr().out
    key = out.split("give it to the client): ", 1)[1].split()[0]
    entry = out.split("under `keys:`):\n", 1)[1]
    assert out.count(key) == 1
    cfg = parse_config({"backends": BACKENDS, "auth": {"keys": yaml.safe_load(entry)}})
    assert cfg.auth is not None
    (k,) = cfg.auth.keys
    assert (k.name, k.models, k.rpm, k.tpm) == ("team-a", ("demo-*",), 60, 1000)
    assert KeyRing(cfg.auth.keys).find(key) is not None
    assert (
        entry_yaml("x", key)
        == f"  - name: x\n    sha256: {hashlib.sha256(key.encode()).hexdigest()}"
    )


def test_key_new_refuses_a_bad_name(capsys: pytest.CaptureFixture[str]) -> None:
    """A name that could not load is refused before any key is printed."""
    assert main(["key", "new", "-bad name"]) == 2
    assert KEY_PREFIX not in capsys.readouterr().out
