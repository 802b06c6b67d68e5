"""The `kvstore` command line as a user meets it: errors are one line, never a traceback."""

import subprocess
import sys

import pytest

KVSTORE = [sys.executable, "-m", "kvstore.commands.cli"]


def run(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*KVSTORE, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_smoke_against_a_small_arena_is_one_line_naming_the_arena(daemon):
    """It raised `RuntimeError: kv bf16: lookup found 0 of 16 chunks` with a traceback."""
    result = run("smoke", "--socket", daemon.socket)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()
    assert len(last) == 1 and "host.arena_bytes" in last[0] and "--chunks" in last[0], result.stderr


def test_a_reader_that_goes_away_is_no_traceback(daemon):
    """`kvstore objects ls | head` raised BrokenPipeError."""
    with daemon.client() as c:
        c.put(bytes(32), b"x" * 100)
    proc = subprocess.Popen([*KVSTORE, "status", "--data-dir", daemon.data_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    proc.stdout.close()  # the reader is gone before the command writes a line
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert err == ""


def test_serve_help_gives_the_socket_resolution_order():
    help_text = " ".join(run("serve", "--help").stdout.split())
    assert ("$KVSTORE_SOCKET if set, else $XDG_RUNTIME_DIR/kvstore/kvstore.sock if XDG_RUNTIME_DIR is set, "
            "else /tmp/kvstore-<uid>/kvstore.sock") in help_text



def test_serve_refuses_an_nvme_io_threads_out_of_range_in_one_line(tmp_path):
    """It used to pass the config (one of two NVMe configs) and fail later, in the other."""
    config = tmp_path / "kvstore.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n[nvme]\nenabled = true\nio_threads = 1000\n')
    result = run("serve", "--config", str(config), "--socket", str(tmp_path / "s.sock"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "kvstore: nvme.io_threads must be an integer in 1..256, got 1000"
    assert not (tmp_path / "data").exists()  # refused before anything was made


def test_per_node_flags_override_the_shared_config_file(tmp_path):
    """A DaemonSet's pods share one config file; each gives its node name and pod IP as flags."""
    from kvstore.commands.cli import build_parser
    from kvstore.commands.config_file import load_config
    from kvstore.errors import InvalidArgument

    config = tmp_path / "kvstore.toml"
    config.write_text('[cluster]\nenabled = true\nsecret = "0123456789abcdef"\nlisten = "0.0.0.0:8471"\n'
                      'node_id = "from-file"\n')
    args = build_parser().parse_args(["serve", "--config", str(config), "--node-id", "gpu-node-7",
                                      "--advertise", "10.1.2.3:8471"])
    cluster = load_config(args).cluster
    assert (cluster.node_id, cluster.advertise, cluster.listen) == ("gpu-node-7", "10.1.2.3:8471", "0.0.0.0:8471")

    mooncake = tmp_path / "mooncake.toml"
    mooncake.write_text('[remote]\nbackend = "mooncake"\n[remote.mooncake]\nmaster = "master:50051"\n')
    args = build_parser().parse_args(["serve", "--config", str(mooncake), "--mooncake-local-hostname", "10.1.2.4"])
    assert load_config(args).remote.mooncake.local_hostname == "10.1.2.4"

    bad = build_parser().parse_args(["serve", "--config", str(config), "--node-id", "no spaces"])
    with pytest.raises(InvalidArgument, match="cluster.node_id"):
        load_config(bad)
