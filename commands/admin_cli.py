"""Operator commands over the admin API: `kvstore status`, `kvstore objects ...`, `kvstore evict`.

Each finds the daemon through its data directory (--data-dir, else data_dir in the TOML file
--config names, read as `kvstore serve --config` reads it, else the default): the URL in
admin.addr and the bearer token in admin.token. --admin-url overrides the URL.
"""

from __future__ import annotations

import argparse
import json

from kvstore.commands.config_file import load_config  # the daemon's own loader: same file, same data_dir
from kvstore.config import parse_size
from kvstore.server.admin.client import AdminClient

FILTER_FLAGS = ("model", "model_revision", "kind", "dtype", "session_id", "branch_id")


def _client(args) -> AdminClient:
    data_dir = args.data_dir
    if data_dir is None and args.config is not None:
        data_dir = load_config(args).data_dir
    return AdminClient.from_data_dir(data_dir, url=args.admin_url)


def _common(parser: argparse.ArgumentParser, json_flag: bool = True) -> None:
    parser.add_argument("--config", help="the daemon's TOML config (its data_dir is used; --data-dir wins)")
    parser.add_argument("--data-dir", help="the daemon's data directory (holds admin.addr and admin.token)")
    parser.add_argument("--admin-url", help="admin API URL (default: read from <data-dir>/admin.addr)")
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print the API's JSON answer")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def usage_bar(used: int, total: int, width: int = 20) -> str:
    filled = min(width, int(width * used / total)) if total else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _print_json(doc) -> int:
    print(json.dumps(doc, indent=2))
    return 0


def status_rows(stats: dict) -> list[str]:
    """The status table: one row per tier of each namespace, then the tier totals."""
    rows = [f"{'namespace':<16} {'tier':<5} {'objects':>8} {'used':>10} {'capacity':>10} {'':22} "
            f"{'hit rate':>8} {'evictions':>9}  pages"]

    def row(name: str, tier: str, t: dict, pages: str = "") -> str:
        lookups = t.get("num_hits", 0) + t.get("num_misses", 0)
        rate = f"{100 * t['num_hits'] / lookups:.0f}%" if lookups else "-"
        return (f"{name:<16} {tier:<5} {t['objects']:>8} {human_bytes(t['used_bytes']):>10} "
                f"{human_bytes(t['capacity_bytes']):>10} {usage_bar(t['used_bytes'], t['capacity_bytes']):22} "
                f"{rate:>8} {t.get('num_evictions', 0):>9}  {pages}").rstrip()

    shown = set()
    for name, ns in stats["namespaces"].items():
        pages = {"hugetlb": "huge (reserved)", "thp": "huge (transparent)", "off": "4 KiB"}.get(ns.get("pages"), "")
        rows += [row(name, tier, t, pages if tier == "host" else "") for tier, t in sorted(ns["tiers"].items())]
        shown |= set(ns["tiers"])
    if not stats["namespaces"]:
        rows.append("(no namespaces opened yet)")
    # Node-wide tiers (NVMe is one store for every namespace) always; the host total when
    # several namespaces share it.
    rows += [row("(all)", tier, t) for tier, t in sorted(stats["tiers"].items())
             if tier not in shown or len(stats["namespaces"]) > 1]
    return rows


def cmd_status(args) -> int:
    client = _client(args)
    stats = client.get("/v1/stats")
    if args.json:
        return _print_json(stats)
    print(f"kvstore {stats['version']}  pid {stats['pid']}  up {stats['uptime_s']:.0f} s  "
          f"{'ready' if stats['ready'] else 'NOT READY'}  clients {stats['clients']}  leases {stats['leases']}  "
          f"ops/s {stats['ops_per_s']:.1f}  socket {stats['socket']}")
    print("\n".join(status_rows(stats)))
    print(gpu_line(stats.get("gpu")))
    print(remote_line(client.get("/v1/cluster")))
    return 0


def remote_line(cluster: dict) -> str:
    """One line on the remote tier: the peers (members, down) or the shared pool."""
    pool = cluster.get("pool")
    if pool is not None:
        c = pool["counters"]
        state = "up" if pool["up"] else f"DOWN ({pool['last_error']})"
        held = pool.get("held")
        holds = (f"holds {human_bytes(held.get('allocated_bytes', 0))} of {human_bytes(held.get('capacity_bytes', 0))}"
                 f" in {held.get('keys', 0)} keys (all clients)") if held else f"holds ? ({pool.get('held_error')})"
        return (f"remote tier: {pool['backend']} pool, master {pool['master']} {state}; {holds}; this node: "
                f"{c['num_hits']} hits, {c['num_misses']} misses, {c['num_checksum_failures'] + c['num_header_failures']}"
                f" failed checks, {c['num_replicated'] + c['num_demoted_remote']} put, {c['num_put_failures']} refused")
    members = cluster.get("members")
    if members is None:
        return "remote tier: none ([cluster] enabled = false, [remote] backend = \"peers\")"
    down = [m["node_id"] for m in members if m["down"]]
    return (f"remote tier: peers, {len(members)} members" + (f", down: {', '.join(down)}" if down else ", all up")
            + f"; replicas {cluster['replicas']}, {cluster['remote_write']}")


def gpu_line(gpu: dict | None) -> str:
    """One line on the GPU tier: on (and its size), or off and what the probe found."""
    if gpu is None:
        return "gpu tier: (this daemon does not report it)"
    if "capacity_bytes" in gpu:
        return (f"gpu tier: on, cuda:{gpu['device']}, {human_bytes(gpu['used_bytes'])} of "
                f"{human_bytes(gpu['capacity_bytes'])} used ({gpu['reason']})")
    state = "off ([gpu] enabled = false)" if not gpu["enabled"] else "off"
    return f"gpu tier: {state}; CUDA {'present' if gpu['available'] else 'absent'}: {gpu['reason']}"


def cmd_ls(args) -> int:
    client, found, cursor = _client(args), [], args.cursor
    while True:
        page = client.get("/v1/objects", namespace=args.namespace, model=args.model, kind=args.kind,
                          tier=args.tier, limit=args.limit, cursor=cursor)
        found += page["objects"]
        cursor = page["next_cursor"]
        if not args.all or cursor is None:
            break
    if args.json:
        return _print_json({"objects": found, "next_cursor": cursor})
    print(f"{'object id':<64} {'namespace':<12} {'kind':<10} {'model':<16} {'size':>10} {'tier':<5} "
          f"{'pin':<3} {'hits':>6}")
    for o in found:
        print(f"{o['object_id']:<64} {o['namespace']:<12} {o['descriptor']['kind']:<10} "
              f"{o['descriptor']['model']:<16} {human_bytes(o['size']):>10} {o['tier']:<5} "
              f"{'yes' if o['pinned'] else 'no':<3} {o['num_hits']:>6}")
    if cursor is not None:
        print(f"(more: --cursor {cursor}, or --all)")
    return 0


def cmd_show(args) -> int:
    return _print_json(_client(args).get(f"/v1/objects/{args.id}", namespace=args.namespace))


def cmd_rm(args) -> int:
    done = _client(args).delete(f"/v1/objects/{args.id}", namespace=args.namespace)
    print(f"deleted {done['object_id']} from namespace {done['namespace']}")
    return 0


def cmd_pin(args) -> int:
    path = f"/v1/objects/{args.id}/pin"
    client = _client(args)
    if args.unpin:
        obj = client.delete(path, namespace=args.namespace)
        print(f"unpinned {obj['object_id']} in namespace {obj['namespace']}")
        return 0
    obj = client.post(path, {"ttl_s": args.ttl_s}, namespace=args.namespace)
    until = f"for {args.ttl_s:g} s" if args.ttl_s is not None else "until unpinned"
    print(f"pinned {obj['object_id']} in namespace {obj['namespace']} {until}")
    return 0


def cmd_evict(args) -> int:
    body = {"namespace": args.namespace, "tier": args.tier,
            "bytes": parse_size(args.bytes) if args.bytes is not None else None}
    flt = {name: getattr(args, name) for name in FILTER_FLAGS if getattr(args, name) is not None}
    if flt or args.all:
        body["filter"] = flt
    result = _client(args).post("/v1/evict", {k: v for k, v in body.items() if v is not None})
    if args.json:
        return _print_json(result)
    print(f"evicted {result['num_evicted']} objects, {human_bytes(result['evicted_bytes'])} "
          f"from the {result['tier']} tier")
    return 0


def register(sub) -> None:
    """Add status, objects and evict to the `kvstore` subcommands."""
    status = sub.add_parser("status", help="what the daemon holds: tiers, usage, hit rates")
    _common(status)
    status.set_defaults(func=cmd_status)

    objects = sub.add_parser("objects", help="list, show, delete or pin stored objects")
    verbs = objects.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser("ls", help="list objects (one page, or --all)")
    _common(ls)
    for flag in ("--namespace", "--model", "--kind", "--tier", "--cursor"):
        ls.add_argument(flag)
    ls.add_argument("--limit", type=int, default=100)
    ls.add_argument("--all", action="store_true", help="follow every page")
    ls.set_defaults(func=cmd_ls)
    for verb, func, text in (("show", cmd_show, "one object's metadata (JSON)"),
                             ("rm", cmd_rm, "delete an object"),
                             ("pin", cmd_pin, "pin an object resident (or --unpin); one only on NVMe is promoted first")):
        p = verbs.add_parser(verb, help=text)
        _common(p, json_flag=False)
        p.add_argument("id", help="object id (64 hex characters)")
        p.add_argument("--namespace", help="needed when the id is stored in several namespaces")
        if verb == "pin":
            p.add_argument("--ttl-s", type=float, help="pin for this many seconds (default: until unpinned)")
            p.add_argument("--unpin", action="store_true")
        p.set_defaults(func=func)

    evict = sub.add_parser("evict", help="evict objects by bytes to free and/or a filter")
    _common(evict)
    evict.add_argument("--namespace", help="namespace to free room in (needed with --bytes)")
    evict.add_argument("--tier", default="host")
    evict.add_argument("--bytes", help="how much to free, e.g. 64MiB (in policy order)")
    for name in FILTER_FLAGS:
        evict.add_argument("--" + name.replace("_", "-"), dest=name, help=f"only objects with this {name}")
    evict.add_argument("--all", action="store_true", help="with no other filter: every evictable object")
    evict.set_defaults(func=cmd_evict)
