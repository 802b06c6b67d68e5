"""Routes (kvstore/route.py): what an adapter hands in is checked once, kept packed, and
comes back field for field; anything a router could not use is refused by name."""

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.hints import Hints
from kvstore.route import MAX_BLOCKS, MAX_ROUTE_BYTES, PackedRoute, Route, packed_route, route_fields, route_json


def test_a_route_round_trips_packed_in_hints_and_shows_as_json():
    route = Route(np.array([5, 6]), parent_block_hash=b"\x00" * 32, token_ids=np.arange(4), block_size=2,
                  lora_name="ad", extra_keys=[["ad"], None], group_idx=3, kv_cache_spec_kind="mamba",
                  kv_cache_spec_sliding_window=128)
    hints = Hints.from_wire(Hints(route=route).to_wire())
    assert isinstance(hints.route, PackedRoute) and Route.unpack(hints.route) == route
    assert route_fields(hints.route)["block_hashes"] == [5, 6]
    assert route_json(hints.route) == {"block_hashes": [5, 6], "parent_block_hash": "00" * 32,
                                       "token_ids": [0, 1, 2, 3], "block_size": 2, "lora_name": "ad",
                                       "extra_keys": [["ad"], None], "group_idx": 3, "kv_cache_spec_kind": "mamba",
                                       "kv_cache_spec_sliding_window": 128}
    assert hints.to_json()["route"]["group_idx"] == 3 and Hints().to_json()["route"] is None
    assert hints.with_route(None).route is None and hints.with_route(hints.route) is hints


@pytest.mark.parametrize("fields, message", [
    ({"block_hashes": []}, "1..4096 hashes"),
    ({"block_hashes": [0] * (MAX_BLOCKS + 1)}, "1..4096 hashes"),
    ({"block_hashes": [True]}, "a block hash is bytes"),
    ({"block_hashes": [1 << 64]}, "64-bit integer"),
    ({"block_hashes": [b""]}, "a block hash is bytes"),
    ({"block_hashes": [b"x" * 65]}, "a block hash is bytes"),
    ({"block_hashes": "ab"}, "must be a list"),
    ({"block_hashes": [1], "parent_block_hash": 1.5}, "parent_block_hash"),
    ({"block_hashes": [1], "token_ids": [-1]}, "token_ids must be integers"),
    ({"block_hashes": [1], "block_size": 0}, "block_size must be >= 1"),
    ({"block_hashes": [1], "group_idx": -1}, "group_idx"),
    ({"block_hashes": [1], "lora_name": 7}, "lora_name"),
    ({"block_hashes": [1, 2], "extra_keys": [None]}, "one per block"),
    ({"block_hashes": [1], "extra_keys": [[[[["deep"]]]]]}, "extra_keys hold"),
    ({"block_hashes": [1], "extra_keys": [{"a": 1}]}, "extra_keys hold"),
])
def test_bad_routes_are_refused_by_name(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        Route(**fields)


def test_packed_routes_are_checked_and_bounded():
    with pytest.raises(InvalidArgument, match="over the limit"):
        Route([1], token_ids=[2**32 - 1] * (MAX_ROUTE_BYTES // 5 + 1)).pack()
    for junk, message in ((b"\xc1", "not msgpack"), (b"\x81\xa1x\x01", "with block_hashes"),
                          (b"\x91\x01", "must be a map"), (b"x" * (MAX_ROUTE_BYTES + 1), "at most")):
        with pytest.raises(InvalidArgument, match=message):
            packed_route(junk)
    with pytest.raises(InvalidArgument, match="must be a kvstore.route.Route"):
        Hints(route={"block_hashes": [1]})


def test_lookahead_tokens_are_one_list_per_block():
    route = Route([1, 2], token_ids=[5] * 4, block_size=2, lookahead_token_ids=[[6], [7]])
    assert Route.unpack(route.pack()).lookahead_token_ids == ((6,), (7,))
    with pytest.raises(InvalidArgument, match="2 block hashes"):
        Route([1, 2], lookahead_token_ids=[[6]])
    with pytest.raises(InvalidArgument, match="lookahead_token_ids must be integers"):
        Route([1], lookahead_token_ids=[[-1]])
