"""Imports point one way (the table in docs/architecture.md, "The parts"). This test fails
when one runs the wrong way."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "tiers", "server", "client", "gpu", "adapters", "commands")
ALLOWED = {
    "kvstore": set(),
    "tiers": {"kvstore"},
    "client": {"kvstore"},
    "gpu": {"kvstore", "client"},
    "server": {"kvstore", "tiers"},  # the daemon never imports client or gpu
    "adapters": {"kvstore", "client"},
    # The user-facing commands are the composition root: they start a daemon and drive it
    # through the client, as any user would, and `kvstore demo` runs the reference engine.
    "commands": {"kvstore", "tiers", "server", "client", "gpu"},
}
# Inside the daemon (docs/architecture.md, "The parts"): which of its packages each may use.
# The peer protocol knows nothing of tiers; the chain of tiers knows nothing of clients,
# peers or the admin API (the remote tier joins it through a factory the daemon passes to
# server/tiering/chain.py: compose).
# The event stream for routers is a leaf the tiers report to; it knows nothing of them.
SERVER = {
    "server/peer": {"server.peer", "server.later", "server.logs"},
    "server/events": {"server.events", "server.data_dir"},  # the rule for a directory a socket is bound in
    "server/tiering": {"server.tiering", "server.later", "server.host_memory", "server.events", "server.windows",
                       "server.traffic"},
    "server/cluster": {"server.cluster", "server.peer", "server.tiering", "server.later", "server.events"},
    "server/pool": {"server.pool", "server.tiering", "server.later", "server.events"},  # a Mooncake pool
    "server/local": {"server.local", "server.tiering", "server.later", "server.traffic"},
    "server/admin": {"server.admin", "server.tiering", "server.cluster", "server.later", "server.logs"},
}
ENTRY_POINTS: dict = {}
# kvstore/ stays importable without I/O or heavy libraries at import time.
HEAVY = {"asyncio", "socket", "torch", "aiohttp", "ucxx", "rocksdict", "triton", "numpy"}


def _modules(path: pathlib.Path, top_level_only: bool = False):
    """The absolute module names `path` imports (`from a import b` gives a.b as well as a)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def _part(module: str) -> str | None:
    """Which of the project's packages `module` is in (kvstore.server.x -> server, kvstore.x
    -> kvstore), or None for a third-party module."""
    names = module.split(".")
    if names[0] != "kvstore":
        return None
    return names[1] if len(names) > 1 and names[1] in PACKAGES else "kvstore"


def _imports(path: pathlib.Path, top_level_only: bool = False):
    """The project's packages and the third-party top-level modules `path` imports."""
    for module in _modules(path, top_level_only):
        yield _part(module) or module.split(".")[0]


def test_everything_imports_the_project_as_kvstore():
    """One import namespace: the wheel installs only `kvstore` (client/, server/, ... are its
    subpackages through the links in kvstore/), so no file may import a top-level `server`,
    `client`, `tiers`, `gpu`, `adapters` or `commands`: in a checkout such a module would
    load a second time under another name."""
    old = set(PACKAGES) - {"kvstore"}
    files = [p for p in sorted(ROOT.rglob("*.py")) if _ours(p.relative_to(ROOT).parts)]
    assert len(files) > 300, "the check reads the repository's Python files"
    wrong = [f"{p.relative_to(ROOT)} imports {m}" for p in files for m in _modules(p) if m.split(".")[0] in old]
    assert not wrong, "\n".join(wrong)


def _ours(parts: tuple) -> bool:
    """A file of the repository's own (not a hidden folder's, a build's or a venv's), read once
    (not again through the links kvstore/server -> ../server and so on)."""
    hidden = any(part.startswith(".") or part in ("build", "node_modules") for part in parts[:-1])
    return not hidden and not (parts[0] == "kvstore" and len(parts) > 2 and parts[1] in PACKAGES)


def _module_name(parts: tuple) -> str:
    """kvstore.<...> for a file of one of PACKAGES (client/gpu.py -> kvstore.client.gpu)."""
    names = list(parts[:-1]) + ([] if parts[-1] == "__init__.py" else [parts[-1][:-3]])
    return ".".join(names if names[0] == "kvstore" else ["kvstore", *names])


def test_the_import_graph_has_no_circle():
    """No two of the project's modules import each other, directly or around a loop, lazily
    or not (a lazy import that breaks a circle hides it). `from package import module` counts
    as importing that module, not the package's __init__."""
    files = {_module_name(p.relative_to(ROOT).parts): p for p in sorted(ROOT.rglob("*.py"))
             if p.relative_to(ROOT).parts[0] in PACKAGES and _ours(p.relative_to(ROOT).parts)}
    assert len(files) > 150, "the check reads the project's modules"
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                deps |= subs or {node.module}
        graph[name] = (deps & files.keys()) - {name}
    circles, done = [], set()

    def visit(name, trail):
        if name in trail:
            circles.append(" -> ".join(trail[trail.index(name):] + [name]))
            return
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, trail + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        allowed = ALLOWED[package] | {package} | ENTRY_POINTS.get(rel, set())
        for name in _imports(path):
            if name in PACKAGES and name not in allowed:
                wrong.append(f"{rel} imports {name}")
    assert not wrong, "imports against the design's direction:\n" + "\n".join(wrong)


def _server_imports(path: pathlib.Path):
    """The server.<part> modules `path` imports (server.x for a top-level module x)."""
    for module in _modules(path):
        if module.startswith("kvstore.server."):
            yield ".".join(module.split(".")[1:3])


@pytest.mark.parametrize("part", sorted(SERVER))
def test_the_daemons_packages_import_one_way(part):
    wrong = [f"{p.relative_to(ROOT)} imports {name}" for p in sorted((ROOT / part).rglob("*.py"))
             for name in _server_imports(p) if name not in SERVER[part]]
    assert not wrong, "imports against docs/architecture.md's layout:\n" + "\n".join(wrong)


def test_kvstore_is_pure_at_import_time():
    heavy = [f"{p.relative_to(ROOT)} imports {n}" for p in (ROOT / "kvstore").rglob("*.py")
             for n in _imports(p, top_level_only=True) if n in HEAVY]
    assert not heavy, "\n".join(heavy)


def test_adapters_import_their_engine_lazily():
    """An adapter module imports without its engine (or torch) installed: the engine comes in
    only inside the classes the engine itself loads."""
    engines = {"vllm", "sglang", "lmcache", "torch"}
    eager = [f"{p.relative_to(ROOT)} imports {n}" for p in (ROOT / "adapters").rglob("*.py")
             for n in _imports(p, top_level_only=True) if n in engines]
    assert not eager, "\n".join(eager)


def test_no_module_asks_whether_a_tier_exists():
    """The chain of tiers is composed once (server/tiering/chain.py): a tier that is off is a
    null object (server/tiering/absent.py), so nobody checks for a missing neighbour, nor asks
    whether one is enabled: the null object answers (its victim_sink, its listed_as)."""
    import re
    asks = re.compile(r"\b(mover|cluster|link|below)\s+is\s+(not\s+)?None\b"
                      r"|\b(manager|mgr|self|chain|tiers)\.(mover|cluster|gpu|nvme|remote|below)\.enabled\b")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted((ROOT / "server").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if asks.search(line)]
    assert not found, "\n".join(found)


def test_no_tier_holds_the_manager():
    """The tiers are composed in server/tiering/chain.py and each is handed the tiers it talks
    to: no tier, cluster or pool role holds the tier manager."""
    import re
    holds = re.compile(r"\bself\.(manager|mgr)\b|\bdef __init__\(self, (manager|mgr)\b")
    tiers = [p for part in ("server/tiering", "server/cluster", "server/pool") for p in sorted((ROOT / part).rglob("*.py"))]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in tiers
             for i, line in enumerate(p.read_text().splitlines(), 1) if holds.search(line.split("#", 1)[0])]
    assert len(tiers) > 30, "the check reads the tiers"
    assert not found, "\n".join(found)


def _assigned_attributes(tree: ast.AST):
    """(line, target) of every attribute assigned in `tree` (`a.b = ...`, `a.b += ...`, in
    tuples too), and of every setattr(...) call."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            yield node.lineno, ast.unparse(node)
            continue
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets += target.elts
            elif isinstance(target, ast.Attribute):
                yield node.lineno, ast.unparse(target)


def test_the_chain_sets_no_collaborator_after_construction():
    """The chain is built top-down (docs/STYLE: nobody sets a collaborator after construction):
    server/tiering/chain.py hands each tier what it talks to in its constructor, and assigns
    attributes of no object but itself (`self.x = ...`; not `host.sink = ...`, `self.nvme.below
    = ...`, `setattr(tier, ...)`)."""
    assigned = list(_assigned_attributes(ast.parse((ROOT / "server/tiering/chain.py").read_text())))
    own = [target for _, target in assigned if target.startswith("self.") and target.count(".") == 1]
    setters = [f"server/tiering/chain.py:{line}: {target}" for line, target in assigned if target not in own]
    assert own, "the check reads the chain's own attributes"
    assert not setters, "set on another object after its construction:\n" + "\n".join(setters)


# The hubs: who holds the most. Nothing reaches a part through one (`mgr.host.namespaces`,
# `daemon.tiers.index`, `chain.gpu.handle`), whatever the part's name: each user is handed
# the parts it uses (server/local/service.py: LocalServices, server/admin/parts.py, GroupOps).
# (class, its module, the names it goes by)
HUBS = {
    "TierManager": ("server/tiering/manager.py", ("manager", "mgr")),
    "Daemon": ("server/daemon.py", ("daemon",)),
    "Chain": ("server/tiering/chain.py", ("tiers", "chain")),
}
# Who may go through a hub anyway, and why: the daemon is the composition root (it builds the
# chain, the manager and the Ledger, then starts and stops the tiers it built); the tier manager
# serves gets and puts over the chain (the GPU tier joins the chain at start, after the manager).
THROUGH = {"server/daemon.py": {"Chain", "TierManager"}, "server/tiering/manager.py": {"Chain"}}
# Parts of the chain are handed out of it where things are composed (the daemon, the manager
# made from it, a benchmark that builds its own): taking one is not a reach; going on is.
HANDS_OUT = {"Chain"}


def _held(module: str, cls: str) -> set[str]:
    """The public attributes `cls.__init__` sets on self: what an instance holds."""
    tree = ast.parse((ROOT / module).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    init = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    held = set()
    for node in ast.walk(init):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for one in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(one, ast.Attribute) and isinstance(one.value, ast.Name) and one.value.id == "self":
                    held.add(one.attr)
    return {name for name in held if not name.startswith("_")}


def test_nothing_reaches_a_part_through_a_hub():
    """No module outside a hub's own reads what the hub holds (`manager.host`, `daemon.config`),
    nor goes two steps through one (`chain.nvme.holds`), in server/, commands/ and bench/."""
    by_name = {name: cls for cls, (_, names) in HUBS.items() for name in names}
    held = {cls: _held(module, cls) for cls, (module, _) in HUBS.items()}
    assert {"host", "ledger"} <= held["TierManager"] and {"manager", "tiers", "config"} <= held["Daemon"]
    found, files = [], 0
    for part in ("server", "commands", "bench"):
        for path in sorted((ROOT / part).rglob("*.py")):
            files += 1
            rel = path.relative_to(ROOT).as_posix()
            mine = {cls for cls, (module, _) in HUBS.items() if module == rel} | THROUGH.get(rel, set())
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Attribute):
                    continue
                value = node.value
                name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else None
                cls = by_name.get(name)
                if cls is not None and cls not in mine and cls not in HANDS_OUT and node.attr in held[cls]:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (what the {cls} holds)")
                inner = value.value if isinstance(value, ast.Attribute) else None
                name = inner.id if isinstance(inner, ast.Name) else inner.attr if isinstance(inner, ast.Attribute) else None
                cls = by_name.get(name)
                if cls is not None and cls not in mine:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (through the {cls})")
    assert files > 100, "the check reads the daemon, the commands and the benchmarks"
    assert not found, "\n".join(sorted(set(found)))


# Benchmarks drive the product as a user does: daemons through `kvstore serve`
# (commands/smoke.py: start_daemon), the public client, the engines' plug-ins, the kernels.
# These time one part alone against its own baseline, and say so in their docstrings.
BENCH_INSIDE = {
    "bench/disk.py": "the NVMe tier against fio on the same file",
    "bench/housekeeping.py": "the expiry pass, a call on the daemon's loop with no client op",
    "bench/peer_service.py": "a peer service with no tiers behind it (the far end of bench/remote.py)",
    "bench/remote.py": "the peer transport against raw TCP",
    "bench/events.py": "one name: the ZMQ topic a router subscribes to (server.events.topic_of)",
    "bench/daemon_costs.py": "the daemon's Python per small object, without socket, codec or client",
}
USER_SURFACE = {"kvstore", "client", "commands", "gpu", "adapters"}


def test_benchmarks_drive_the_daemon_as_a_user_or_say_why_not():
    files = sorted((ROOT / "bench").glob("*.py"))
    assert len(files) > 15, "the check reads the benchmarks"
    wrong = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        inside = sorted({n for n in _imports(path) if n in PACKAGES and n not in USER_SURFACE})
        if inside and rel not in BENCH_INSIDE:
            wrong.append(f"{rel} imports {', '.join(inside)}: drive the daemon as a user, or list it in BENCH_INSIDE")
        if rel in BENCH_INSIDE and "Reaches inside" not in (ast.get_docstring(ast.parse(path.read_text())) or ""):
            wrong.append(f"{rel}: its docstring must say in a line why it reaches inside (\"Reaches inside: ...\")")
    assert not wrong, "\n".join(wrong)


def test_no_module_reaches_into_another_objects_privates():
    """`x._name` only on self or cls: a collaborator uses another object's public surface."""
    import re
    reach = re.compile(r"\b(?!self\b|cls\b)([a-z_][a-z0-9_]*)\._[a-z][a-z0-9_]*\b")
    found = []
    for package in ("server", "tiers", "client", "kvstore", "adapters"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                for match in reach.finditer(code):
                    if match.group(1) not in THIRD_PARTY_PRIVATES:
                        found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


# Modules whose underscore names we must use (torch's CUDA IPC, ucxx's context), not ours.
THIRD_PARTY_PRIVATES = {"torch", "cuda", "storage", "core", "sys", "os"}


LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical"}


def _log_formats(path: pathlib.Path):
    """(line, format string) of each call on a logger (`log`, `_log`, `logger`) in `path`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("log", "_log", "logger")):
            continue
        args = node.args[1:] if node.func.attr == "log" else node.args if node.func.attr in LOG_CALLS else None
        if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
            yield node.lineno, args[0].value


def test_the_daemon_logs_one_style():
    """Every log line of the daemon and its tiers is `event=<name> key=value ...` (what the
    admin API's log views and the README's grep examples rely on)."""
    other = [f"{p.relative_to(ROOT)}:{line}: {fmt!r}" for package in ("server", "tiers")
             for p in sorted((ROOT / package).rglob("*.py")) for line, fmt in _log_formats(p)
             if not fmt.startswith("event=")]
    found = sum(1 for package in ("server", "tiers") for p in (ROOT / package).rglob("*.py") for _ in _log_formats(p))
    assert found > 50, "the check finds the daemon's log calls"
    assert not other, "\n".join(other)
