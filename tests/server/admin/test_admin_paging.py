"""GET /v1/objects paging stays exact while puts and deletes go on."""

from __future__ import annotations

import threading
import time

import pytest

from test_admin_support import admin_daemon, put_objects


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with admin_daemon(tmp_path_factory.mktemp("admin-paging"), arena_bytes="32MiB") as d:
        yield d


def page_through(api, limit: int, **query) -> list[str]:
    seen, cursor = [], None
    while True:
        page = api.get("/v1/objects", limit=limit, cursor=cursor, **query)
        assert len(page["objects"]) <= limit
        seen += [o["object_id"] for o in page["objects"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return seen


def test_pages_cover_everything_once(daemon):
    with daemon.client("pages") as client:
        ids = put_objects(client, "pages", 25)
    for limit in (1, 7, 25, 1000):
        seen = page_through(daemon.api, limit, namespace="pages")
        assert seen == sorted(i.hex for i in ids)


def test_paging_is_stable_under_concurrent_puts(daemon):
    """Every object that existed before paging began is seen, and no object twice."""
    with daemon.client("busy-a") as a, daemon.client("busy-b") as b:
        before = {i.hex for i in put_objects(a, "busy-a", 150) + put_objects(b, "busy-b", 150)}
    stop, added, errors = threading.Event(), [], []

    def writer():
        try:
            with daemon.client("busy-a") as a, daemon.client("busy-b") as b:
                while not stop.is_set():
                    added.extend(put_objects(a, "busy-a", 5) + put_objects(b, "busy-b", 5))
        except Exception as exc:  # surfaced below: a failed writer must fail the test
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        while len(added) < 20:  # paging starts once puts are flowing
            assert thread.is_alive(), errors
            time.sleep(0.005)
        added_before = len(added)
        seen = page_through(daemon.api, 9)
        added_during = len(added) - added_before
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors[0]
    assert added_during > 0, "no put ran while paging: the test proved nothing"
    assert len(seen) == len(set(seen)), "an object was listed twice"
    assert before <= set(seen), f"{len(before - set(seen))} objects that existed before paging were skipped"


def test_deleting_the_cursor_object_skips_nothing(daemon):
    with daemon.client("gaps") as client:
        ids = sorted(i.hex for i in put_objects(client, "gaps", 12))
    first = daemon.api.get("/v1/objects", namespace="gaps", limit=4)
    assert [o["object_id"] for o in first["objects"]] == ids[:4]
    for oid in ids[3:6]:  # the cursor's own object and the two after it go away
        daemon.api.delete(f"/v1/objects/{oid}")
    cursor, rest = first["next_cursor"], []
    while cursor is not None:
        page = daemon.api.get("/v1/objects", namespace="gaps", limit=4, cursor=cursor)
        rest += [o["object_id"] for o in page["objects"]]
        cursor = page["next_cursor"]
    assert rest == ids[6:]
