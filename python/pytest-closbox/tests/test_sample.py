"""A sample suite using the closbox_fabric fixture, as a collective library's tests would.

Run by closbox's `make test` (tests/libraries.rs) with Debian's pytest and torch.
"""

import os
import sys
import textwrap

import pytest

from pytest_closbox import ClosboxError
from pytest_closbox.plugin import _numbered, _worker_name

# 2 leaves x 2 GPUs under 2 spines, 1 Gbit/s links.
SMALL = """
[fabric]
name = "pyt"
[topology]
kind = "leaf-spine"
leaves = 2
spines = 2
gpus_per_leaf = 2
[links.nic]
rate = "1Gbit"
delay = "2us"
[links.leaf-spine]
rate = "1Gbit"
delay = "5us"
"""

ALLREDUCE = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    r, w = dist.get_rank(), dist.get_world_size()
    t = torch.full((100000,), float(r + 1))
    dist.all_reduce(t)
    assert torch.all(t == w * (w + 1) / 2), t[:4]
    print(f"rank {r}: sum ok")
    """
)


def own(name: str, n: int = 1) -> str:
    """The name the fixture gives the n-th fabric of a file named `name` up at once in this
    process: under pytest-xdist (`pytest -n 2`) with the worker's id."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    base = _worker_name(name, worker) if worker else name
    return base if n == 1 else _numbered(base, n)


def test_every_gpu_is_a_host(closbox_fabric):
    fabric = closbox_fabric(toml=SMALL)
    assert fabric.name == own("pyt")
    for gpu in ("gpu0", "gpu3"):
        r = fabric.exec(gpu, ["/usr/bin/python3", "-c", "import socket; print(socket.gethostname())"])
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == gpu


def test_a_command_that_overstays_is_stopped_with_what_it_started(closbox_fabric):
    fabric = closbox_fabric(toml=SMALL)
    r = fabric.exec("gpu1", ["sh", "-c", "sleep 3611 & sleep 3612; wait"], timeout=0.5)
    assert r.returncode == 124, r.stderr
    assert "timed out after 0.5 s" in r.stderr
    left = fabric.exec("gpu1", ["pgrep", "-f", "sleep 361[12]"])
    assert left.returncode == 1, left.stdout
    job = fabric.run(["sleep", "3615"], gpus="0-1", timeout=0.5)
    assert job.returncode == 124 and "timed out after 0.5 s" in job.stderr, job.stderr


def test_one_file_up_twice_under_names_of_its_own(closbox_fabric):
    a = closbox_fabric(toml=SMALL, name="pyt-a")
    # A name among `up`'s arguments is the fabric's name, as `name=` gives it.
    b = closbox_fabric(toml=SMALL, args=["--name", "pyt-b", "--detach"])
    assert (a.name, b.name) == ("pyt-a", "pyt-b")
    for fabric in (a, b):
        r = fabric.exec("gpu0", ["ping", "-c", "1", "-W", "5", "gpu3"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert fabric.status()["fabric"] == fabric.name
    with pytest.raises(ClosboxError, match="already up"):
        closbox_fabric(toml=SMALL, name="pyt-a")
    with pytest.raises(ValueError, match="two names"):
        closbox_fabric(toml=SMALL, name="pyt-c", args=["--name=pyt-d"])


def test_one_file_up_twice_without_names_gets_a_free_name(closbox_fabric):
    # The file's name is taken by the first: the second comes up under the next free one.
    a = closbox_fabric(toml=SMALL)
    b = closbox_fabric(toml=SMALL)
    sixteen = SMALL.replace('name = "pyt"', 'name = "pyt-sixteen-char"')
    c = closbox_fabric(toml=sixteen)
    d = closbox_fabric(toml=sixteen)
    assert (a.name, b.name, c.name, d.name) == (
        own("pyt"), own("pyt", 2), own("pyt-sixteen-char"), own("pyt-sixteen-char", 2))
    if "PYTEST_XDIST_WORKER" not in os.environ:
        assert (b.name, d.name) == ("pyt-2", "pyt-sixteen-ch-2")
    for fabric in (a, b, d):
        assert fabric.status()["fabric"] == fabric.name
        r = fabric.exec("gpu0", ["ping", "-c", "1", "-W", "5", "gpu3"])
        assert r.returncode == 0, r.stdout + r.stderr
    # Each bound to this process (`closbox up --owner`): a run killed mid-test leaves none.
    assert f"goes down when pid {os.getpid()} ends" in a.closbox("status").stdout
    assert a.status()["owner"] == os.getpid()
    # A bad file is still its own error, not a name to move away from.
    with pytest.raises(ClosboxError, match="leaves"):
        closbox_fabric(toml=SMALL.replace("leaves = 2", "leaves = -2"))


def test_xdist_workers_bring_one_file_up_under_names_of_their_own(closbox_fabric, monkeypatch):
    # What pytest-xdist sets in each worker; two workers' fabrics of one file side by side.
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    a = closbox_fabric(toml=SMALL)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw12")
    # A name of closbox's 16 characters at most is cut to leave room for the worker's id.
    b = closbox_fabric(toml=SMALL.replace('name = "pyt"', 'name = "pyt-sixteen-char"'))
    assert (a.name, b.name) == ("pyt-gw7", "pyt-sixteen-gw12")
    for fabric in (a, b):
        assert fabric.status()["fabric"] == fabric.name
        r = fabric.exec("gpu0", ["ping", "-c", "1", "-W", "5", "gpu3"])
        assert r.returncode == 0, r.stdout + r.stderr


def test_torch_allreduce_across_the_fabric(closbox_fabric):
    fabric = closbox_fabric(toml=SMALL)
    job = fabric.run(["/usr/bin/python3", "-c", ALLREDUCE], timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    for r in range(4):
        assert f"[{r}] rank {r}: sum ok" in job.stdout
    st = fabric.status()
    assert st["delivered"] > 100
    # 100,000 floats from each rank crossed the leaves' uplinks.
    up = sum(p["tx_bytes"] for p in st["ports"] if p["port"].startswith("leaf") and "spine" in p["port"])
    assert up > 400_000, st["ports"]


def test_a_failed_uplink_is_reported_and_routed_around(closbox_fabric):
    fabric = closbox_fabric(toml=SMALL)
    fabric.link_down("leaf0", "spine0")
    job = fabric.run(["/usr/bin/python3", "-c", ALLREDUCE], timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    st = fabric.status()
    assert [(l["link"], l["up"]) for l in st["changed_links"]] == [("leaf0-spine0 #0", False)], st["changed_links"]
    assert fabric.port("leaf0->spine1")["tx_packets"] > 0
    with pytest.raises(ClosboxError):
        fabric.link_down("leaf0", "nowhere")
    # A fabric shared by several tests is put back between them.
    fabric.reset()
    assert fabric.status()["changed_links"] == []
    assert fabric.events()[-1]["what"] == "fabric reset: 1 link up"


def test_a_scenario_runs_to_its_end_and_says_what_the_fabric_did(closbox_fabric, tmp_path):
    fabric = closbox_fabric(toml=SMALL)
    scenario = tmp_path / "spine.toml"
    scenario.write_text('[[event]]\nat = "0ms"\ndo = "switch-down"\nname = "spine0"\n'
                        '[[event]]\nat = "20ms"\ndo = "switch-up"\nname = "spine0"\n')
    run = fabric.chaos(scenario)
    assert run["end"] == "followed", run
    assert [e["what"].split(" (")[0] for e in run["events"]] == ["switch spine0 down", "switch spine0 up"], run
    assert all(e["timeline"] == run["timeline"] for e in run["events"]), run
    assert run["meanwhile"]["changed_links"] == 0, run
    scenario.write_text('[[event]]\nat = "0ms"\ndo = "switch-down"\nname = "spine9"\n')
    with pytest.raises(ClosboxError, match="spine9"):
        fabric.chaos(scenario)


def test_a_job_under_a_scenario_sees_its_faults(closbox_fabric, tmp_path):
    fabric = closbox_fabric(toml=SMALL)
    scenario = tmp_path / "cut.toml"
    scenario.write_text('[[event]]\nat = "0ms"\ndo = "partition"\ngroups = ["0-1", "2-3"]\n'
                        '[[event]]\nat = "60s"\ndo = "heal"\n')
    # Pings across the cut fail while it holds; the job's end heals it (a repair).
    job = fabric.run(["ping", "-c", "2", "-i", "0.2", "-W", "1", "gpu2"], gpus="0", chaos=scenario)
    assert job.returncode != 0, job.stdout
    chaos = [l for l in job.stderr.splitlines() if l.startswith("# chaos: ")]
    assert any(l.endswith("partition gpu0,gpu1 | gpu2,gpu3") for l in chaos), job.stderr
    assert "during the job: the fabric delivered" in chaos[-1], job.stderr
    assert "partitioned" in chaos[-1], job.stderr
    assert fabric.status()["partition"] == [], "healed when the job ended"
    assert fabric.exec("gpu0", ["ping", "-c", "1", "-W", "1", "gpu2"]).returncode == 0
    # Its time 0 at the job's first packet instead, after 0.3 s of the job's start-up.
    job = fabric.run(["sh", "-c", "sleep 0.3; ping -c 1 -W 1 gpu2"], gpus="0", chaos=scenario,
                     chaos_start="first-packet")
    assert job.returncode != 0, job.stdout
    assert any(l.endswith("started: gpu0 sent a packet") for l in job.stderr.splitlines()), \
        job.stderr


def test_cross_traffic_and_a_partition_show_in_the_counters_and_events(closbox_fabric):
    fabric = closbox_fabric(toml=SMALL)
    # 500 Mbit/s of synthetic load from leaf0 to leaf1 for 20 ms of fabric time.
    fabric.closbox("load", "leaf0", "leaf1", "--rate", "500Mbit", "--for", "20ms")
    fabric.closbox("partition", "0-1", "2-3")
    ping = fabric.exec("gpu0", ["ping", "-c", "1", "-W", "1", "gpu2"])
    assert ping.returncode != 0, "gpu0 and gpu2 are on two sides"
    assert fabric.exec("gpu0", ["ping", "-c", "1", "-W", "1", "gpu1"]).returncode == 0
    fabric.closbox("heal")
    assert fabric.exec("gpu0", ["ping", "-c", "1", "-W", "1", "gpu2"]).returncode == 0
    what = [e["what"] for e in fabric.events()]
    assert what[0].startswith("load 1 started: leaf0 -> leaf1"), what
    assert any(w.startswith("load 1 done: ") for w in what), what
    changes = [w.split()[0] for w in what if not w.startswith("load ")]
    assert changes == ["partition", "heal:"], what
    st = fabric.status()
    assert dict(st["drops"])["partitioned"] >= 1, st["drops"]
    load_tx = sum(p["load_tx_bytes"] for p in st["ports"] if p["port"].startswith("leaf0->spine"))
    assert load_tx > 1_000_000, st["ports"]
    with pytest.raises(ClosboxError, match="spine9"):
        fabric.closbox("link", "down", "leaf0", "spine9")


def test_mpi_hello_through_closbox_mpirun(closbox_fabric):
    fabric = closbox_fabric(toml=SMALL)
    r = fabric.mpirun(["/usr/bin/python3", "-m", "mpi4py.bench", "helloworld"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(4):
        assert f"process {rank} of 4 on gpu{rank}" in r.stdout


def test_a_topology_in_any_toml_spelling(closbox_fabric):
    # The fabric's name as closbox reads it: here an inline table and a literal string.
    toml = SMALL.replace('[fabric]\nname = "pyt"\n', "fabric = { name = 'pyt-inline' }\n")
    assert "pyt-inline" in toml
    fabric = closbox_fabric(toml=toml)
    assert fabric.name == own("pyt-inline")
    assert fabric.status()["gpus"] == 4


def test_a_bad_topology_names_its_line(closbox_fabric):
    with pytest.raises(ClosboxError, match=r"\.toml:6:10: `leaves` = -2"):
        closbox_fabric(toml=SMALL.replace("leaves = 2", "leaves = -2"))


def test_a_fabric_gone_raises_closbox_errors(closbox_fabric):
    fabric = closbox_fabric(toml=SMALL)
    assert fabric.port("leaf0->spine0")["port"] == "leaf0->spine0"
    with pytest.raises(ClosboxError, match="no port leaf0->nowhere"):
        fabric.port("leaf0->nowhere")
    fabric.down()
    # (`port` read closbox's empty output as JSON: a JSONDecodeError.)
    with pytest.raises(ClosboxError, match="not up"):
        fabric.port("leaf0->spine0")
    with pytest.raises(ClosboxError, match="not up"):
        fabric.status()
