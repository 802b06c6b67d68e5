"""The `[events]` table of docs/configuration.md's "Every key" says what the code does (issue
41, item 17: it gave tcp://127.0.0.1:5557 as a default endpoint, which it is not)."""

import dataclasses
import pathlib
import re
import tomllib

from kvstore.config_events import EventsConfig

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
ENDPOINT = re.compile(r"(?:ipc|tcp)://[^\s)]+")


def every_key_block() -> str:
    section = DOC.read_text().split("### Every key", 1)[1]
    return re.search(r"```toml\n(.*?)```", section, re.S).group(1)


def events_lines() -> dict[str, str]:
    """key -> its line, of the [events] table itself (not its namespaces' tables)."""
    table = every_key_block().split("\n[events]", 1)[1].split("\n[", 1)[0]
    return {line.split("=", 1)[0].strip(): line for line in table.splitlines() if "=" in line.split("#", 1)[0]}


def test_every_events_key_is_shown_with_its_default():
    shown = tomllib.loads(every_key_block())["events"]
    defaults = EventsConfig()
    keys = {f.name for f in dataclasses.fields(EventsConfig) if f.init} - {"namespaces"}
    assert set(shown) - {"namespaces"} == keys
    assert {k: shown[k] for k in keys} == {k: getattr(defaults, k) for k in keys}


def test_the_endpoints_comments_name_the_real_defaults_and_no_other_address():
    filled = EventsConfig().under("<data_dir>")
    lines = events_lines()
    for key in ("endpoint", "replay_endpoint"):
        comment = lines[key].split("#", 1)[1]
        assert ENDPOINT.findall(comment) == [getattr(filled, key)], lines[key]
