"""The [testing] table (kvstore/config_testing.py): race windows widened only where named,
and every bad value refused naming its key."""

import pytest

from kvstore.config import ServerConfig
from kvstore.config_testing import WINDOWS
from kvstore.errors import InvalidArgument


def test_nothing_is_widened_by_default_and_all_names_every_window():
    assert ServerConfig().testing.points == frozenset()
    assert ServerConfig.from_dict({"testing": {"delay_points": ["all"]}}).testing.points == frozenset(WINDOWS)
    config = ServerConfig.from_dict({"testing": {"delay_points": ["nvme_read"], "delay_min_ms": 1, "delay_max_ms": 2}})
    assert config.testing.points == {"nvme_read"}


@pytest.mark.parametrize("table, message", [
    ({"delay_points": ["nvme_wirte"]}, "testing.delay_points: unknown"),
    ({"delay_points": "all"}, "testing.delay_points must be a list of strings"),
    ({"delay_max_ms": -1}, "testing.delay_max_ms must be"),
    ({"delay_max_ms": float("inf")}, "testing.delay_max_ms must be"),
    ({"delay_min_ms": 5, "delay_max_ms": 1}, "delay_min_ms (5) is more than delay_max_ms"),
    ({"delay_seed": 1.5}, "testing.delay_seed must be an integer"),
    ({"delay_typo": 1}, "unknown config key"),
])
def test_bad_values_are_refused_naming_the_key(table, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        ServerConfig.from_dict({"testing": table})
