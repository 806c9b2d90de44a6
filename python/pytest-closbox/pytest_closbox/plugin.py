"""The `closbox_fabric` fixture factory: live closbox fabrics for a test, taken down after it.

Drives the `closbox` binary (up, exec, run, mpirun, status, link, down); nothing here talks
to the network itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

import pytest


class ClosboxError(RuntimeError):
    """A closbox command failed; the message carries its error output."""


def _binary(config: pytest.Config) -> str:
    b = config.getoption("closbox_bin") or os.environ.get("CLOSBOX_BIN") or shutil.which("closbox")
    if not b:
        raise pytest.UsageError(
            "pytest-closbox: no closbox binary (pass --closbox-bin PATH, set CLOSBOX_BIN, or put closbox on PATH)"
        )
    return b


def _fabric_name(binary: str, path: Path) -> str:
    """The [fabric] name of a topology file, as closbox reads it (`closbox plan --json`):
    any TOML spelling of it (literal strings, dotted keys, inline tables), and closbox's
    own error, with file:line, for a file it refuses."""
    r = subprocess.run(
        [binary, "plan", str(path), "--json"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True,
    )
    if r.returncode != 0:
        raise ClosboxError(f"closbox plan {path}: {r.stderr.strip()}")
    return json.loads(r.stdout)["name"]


# closbox's rule for fabric names (`[fabric] name`, `up --name`).
_NAME_MAX = 16


# `closbox up`'s exit status when the name is already up (or being brought up or down).
_NAME_TAKEN = 4

# How many names the fixture tries after the first is taken.
_AUTO_NAMES = 64


def _numbered(base: str, n: int) -> str:
    """`base-n`, the base cut so that the whole stays within closbox's 16 characters."""
    suffix = f"-{n}"
    return base[: _NAME_MAX - len(suffix)].rstrip("-") + suffix


def _worker_name(base: str, worker: str) -> str:
    """The name a pytest-xdist worker brings a fabric named `base` up under: `base-gw3`, the
    base cut so that the whole stays within closbox's 16 characters (a-z, 0-9, '-'), so
    that workers running tests of one file at once do not collide ("already up")."""
    suffix = "-" + "".join(c for c in worker.lower() if c.isascii() and c.isalnum())
    return base[: _NAME_MAX - len(suffix)].rstrip("-") + suffix


class Fabric:
    """A live fabric. Use the `closbox_fabric` fixture to get one."""

    def __init__(self, binary: str, name: str, temp_config: Optional[Path] = None):
        self.binary = binary
        self.name = name
        self._temp_config = temp_config
        self._up = True

    def _closbox(self, args: Sequence[str], check: bool = False, timeout: Optional[float] = None):
        r = subprocess.run(
            [self.binary, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise ClosboxError(f"closbox {' '.join(args)}: {r.stderr.strip()}")
        return r

    def exec(self, gpu: str, cmd: Sequence[str],
             timeout: Optional[float] = None) -> subprocess.CompletedProcess:
        """Runs `cmd` in one GPU (a name or a rank) and waits for it; `timeout` (seconds):
        closbox stops it and what it started after that long, returncode 124 (not
        subprocess's own timeout, whose SIGKILL of closbox would leave them running)."""
        args = ["exec", "--fabric", self.name]
        if timeout is not None:
            args += ["--timeout", str(timeout)]
        return self._closbox([*args, str(gpu), "--", *cmd])

    def run(
        self,
        cmd: Sequence[str],
        gpus: str = "all",
        timeout: Optional[float] = None,
        fabric_clock: bool = False,
        chaos: Optional[os.PathLike | str] = None,
        chaos_start: Optional[str] = None,
    ) -> subprocess.CompletedProcess:
        """Runs `cmd` as one rank per GPU (RANK, WORLD_SIZE, MASTER_ADDR... set).

        chaos: a scenario file run with the job (its time 0 the job's start, or its GPUs'
        first packets with `start = "first-packet"` or `"every-gpu"` in the file;
        cancelled at its end); its changes and what the fabric did during the job are
        "# chaos:" lines of the result's stderr. chaos_start: "now", "first-packet" or "every-gpu" instead of
        the file's `start`."""
        args = ["run", "--fabric", self.name, "--gpus", gpus]
        if timeout is not None:
            args += ["--timeout", str(timeout)]
        if fabric_clock:
            args.append("--fabric-clock")
        if chaos is not None:
            args += ["--chaos", str(chaos)]
        if chaos_start is not None:
            args += ["--chaos-start", chaos_start]
        return self._closbox([*args, "--", *cmd])

    def mpirun(
        self,
        cmd: Sequence[str],
        gpus: str = "all",
        impl: Optional[str] = None,
        timeout: Optional[float] = None,
        chaos: Optional[os.PathLike | str] = None,
        chaos_start: Optional[str] = None,
    ) -> subprocess.CompletedProcess:
        """Runs an MPI program, one rank per GPU (Open MPI, or MPICH with impl="mpich");
        chaos, chaos_start: a scenario file run with the job, as for `run`."""
        args = ["mpirun", "--fabric", self.name, "--gpus", gpus]
        if impl:
            args += ["--impl", impl]
        if timeout is not None:
            args += ["--timeout", str(timeout)]
        if chaos is not None:
            args += ["--chaos", str(chaos)]
        if chaos_start is not None:
            args += ["--chaos-start", chaos_start]
        return self._closbox([*args, "--", *cmd])

    def _status(self, *args: str) -> dict:
        r = self._closbox(["status", self.name, "--json", *args])
        try:
            answers = json.loads(r.stdout or "[]")
        except json.JSONDecodeError:
            answers = []
        if not answers or not isinstance(answers[0], dict) or "error" in answers[0]:
            raise ClosboxError(f"status of {self.name}: {r.stdout.strip()} {r.stderr.strip()}")
        return answers[0]

    def status(self) -> dict:
        """The daemon's counters, as `closbox status --json` reports them (busy ports)."""
        return self._status()

    def port(self, port: str) -> dict:
        """One egress port's counters ("leaf0->spine1"; one of parallel links: "leaf0->spine1 #3")."""
        for p in self._status("--ports", port).get("ports", []):
            if p["port"] == port:
                return p
        raise ClosboxError(f"fabric {self.name} has no port {port}")

    def link_down(self, a: str, b: str) -> None:
        """Takes every link between switches/GPUs `a` and `b` down."""
        self._closbox(["link", "down", a, b, "--fabric", self.name], check=True)

    def link_up(self, a: str, b: str) -> None:
        self._closbox(["link", "up", a, b, "--fabric", self.name], check=True)

    def reset(self) -> None:
        """Puts the fabric back as its topology made it (`closbox reset`): scenarios and
        flaps cancelled, loads stopped, the partition healed, every link up at the
        topology's values. What runs in the GPUs is left alone."""
        self._closbox(["reset", "--fabric", self.name], check=True)

    def chaos(self, scenario: os.PathLike | str, timeout: Optional[float] = None) -> dict:
        """Runs a scenario file on the fabric (`closbox chaos FILE --json`) and waits for
        its end (a file with `start = "first-packet"` or `"every-gpu"` first waits for the
        fabric's GPUs to send: traffic from another thread or process). Returns {"events": [its own events], "timeline": N, "end": "followed" |
        "cancelled" | "interrupted", "meanwhile": {"delivered", "dropped", "drops":
        [[reason, n], ...], "ecn_marked", "changed_links"}}: what the fabric did while it
        ran. Raises ClosboxError for a bad file (naming its line) or a failed run."""
        r = self._closbox(["chaos", str(scenario), "--json", "--fabric", self.name],
                          check=True, timeout=timeout)
        lines = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
        if not lines:
            raise ClosboxError(f"closbox chaos {scenario}: no output; {r.stderr.strip()}")
        return {"events": lines[:-1], **lines[-1]}

    def closbox(self, *args: str, check: bool = True,
                timeout: Optional[float] = None) -> subprocess.CompletedProcess:
        """Any other closbox command on this fabric, as on the command line without
        `--fabric`: `fabric.closbox("partition", "0-1", "2-3")`, `fabric.closbox("load",
        "leaf0", "leaf1", "--rate", "500Mbit", "--for", "20ms")`, `fabric.closbox("chaos",
        "scenario.toml")`. Raises ClosboxError when it fails (check=False: returns it).
        Commands run in GPUs have their own methods (.exec, .run, .mpirun)."""
        if not args:
            raise ValueError("closbox(): which command?")
        instead = {"exec": ".exec()", "run": ".run()", "mpirun": ".mpirun()", "down": ".down()",
                   "up": "the closbox_fabric fixture"}
        if args[0] in instead:
            raise ValueError(f"closbox({args[0]!r}, ...): use {instead[args[0]]}")
        return self._closbox([*args, "--fabric", self.name], check=check, timeout=timeout)

    def events(self) -> list:
        """Every change since the fabric came up, oldest first (`closbox events --json`):
        dicts with `seq`, `fabric_ns`, `wall_ms` and `what`."""
        r = self._closbox(["events", self.name, "--json"], check=True)
        return json.loads(r.stdout or "[]")

    def down(self) -> None:
        """Takes the fabric down (the fixture does it after the test otherwise)."""
        if not self._up:
            return
        self._up = False
        try:
            self._closbox(["down", self.name], check=True)
        finally:
            if self._temp_config is not None:
                self._temp_config.unlink(missing_ok=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--closbox-bin",
        action="store",
        default=None,
        help="the closbox binary for the closbox_fabric fixture (default: $CLOSBOX_BIN, then PATH)",
    )


def _take_up_flags(args: Iterable[str]) -> tuple[list[str], Optional[str]]:
    """`args` without `--name NAME` / `--name=NAME` (returned: the last, as closbox takes
    it) and `--detach`."""
    kept: list[str] = []
    name = None
    it = iter(args)
    for a in it:
        if a == "--name":
            name = next(it, None)
            if name is None:
                raise ValueError("closbox_fabric: --name in args without a name after it")
        elif a.startswith("--name="):
            name = a[len("--name="):]
        elif a == "--":
            kept.append(a)
            kept.extend(it)
        elif a != "--detach":
            kept.append(a)
    return kept, name


@pytest.fixture
def closbox_fabric(request: pytest.FixtureRequest):
    """A factory: `closbox_fabric(path)` or `closbox_fabric(toml=TEXT)` brings a fabric up
    and returns a `Fabric`; every fabric it made goes down after the test. `name=` brings
    it up under that name instead of its file's (`closbox up --name`), and a name already
    up is an error. Without `name=`: the file's name (under pytest-xdist, the file's name
    and the worker's id, `pyt-gw3`), or, where that is already up (the same file up twice
    at once), the first free of `NAME-2`, `NAME-3`, …; `Fabric.name` says which. Each
    fabric is bound to this process (`closbox up --owner`): a run killed mid-test, whose
    teardown never runs, leaves none behind."""
    if os.geteuid() != 0:
        pytest.skip("closbox fabrics need root (network namespaces, TUN devices)")
    binary = _binary(request.config)
    made: list[Fabric] = []

    def make(path: Optional[os.PathLike | str] = None, *, toml: Optional[str] = None,
             name: Optional[str] = None, args: Iterable[str] = ()) -> Fabric:
        if (path is None) == (toml is None):
            raise TypeError("closbox_fabric: give a topology file path or toml=, not both")
        temp = None
        if toml is not None:
            fd, temp_name = tempfile.mkstemp(prefix="closbox-pytest-", suffix=".toml")
            with os.fdopen(fd, "w") as f:
                f.write(toml)
            temp = Path(temp_name)
            path = temp
        path = Path(path)
        # `--name` and `--detach` among `args` are the fixture's own flags: a name there is
        # the fabric's name, as `name=` gives it.
        args, named = _take_up_flags(args)
        if named is not None:
            if name is not None and name != named:
                raise ValueError(f"closbox_fabric: two names, name={name!r} and --name {named!r} in args")
            name = named
        try:
            chosen = name is not None
            worker = os.environ.get("PYTEST_XDIST_WORKER")
            if name is None and worker:
                # Workers run tests at once: each brings the file up under a name of its own.
                name = _worker_name(_fabric_name(binary, path), worker)
            renamed = [] if name is None else ["--name", name]
            if name is None:
                name = _fabric_name(binary, path)
            first = name
            args = list(args)
            # The fabric goes down with this process however it ends (a test run killed by
            # a timeout runs no teardown), unless the caller gave an owner.
            owner = [] if any(a == "--owner" or a.startswith("--owner=") for a in args) \
                else ["--owner", str(os.getpid())]
            for n in range(2, _AUTO_NAMES + 2):
                r = subprocess.run(
                    [binary, "up", str(path), "--detach", *renamed, *owner, *args],
                    stdin=subprocess.DEVNULL, capture_output=True, text=True,
                )
                if r.returncode == 0:
                    break
                # Without name=, a name already up (the same file up twice in one test,
                # or by another test at once) makes way for the next free one.
                if r.returncode != _NAME_TAKEN or chosen or n > _AUTO_NAMES:
                    raise ClosboxError(f"closbox up {path}: {r.stderr.strip()}")
                name = _numbered(first, n)
                renamed = ["--name", name]
        except BaseException:
            if temp is not None:
                temp.unlink(missing_ok=True)
            raise
        fabric = Fabric(binary, name, temp)
        made.append(fabric)
        return fabric

    yield make
    errors = []
    for f in made:
        try:
            f.down()
        except ClosboxError as e:
            errors.append(str(e))
    if errors:
        pytest.fail("; ".join(errors))
