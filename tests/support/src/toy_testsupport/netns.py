"""Hosts made of Linux network namespaces, for the tests that run MPI across "machines"
(``from toy_testsupport.netns import hosts, hosts_fixture``).

Why: a multi-host run differs from a one-machine run in what the ranks see, each its own
address and network stack, with traffic crossing a link instead of shared memory. One
machine can show that as root: ``hosts(n)`` makes n namespaces, each with one veth interface
whose other end sits on a bridge inside a further "switch" namespace, so nothing is added
to the root namespace (no address, no route, no interface) and no packet leaves the
machine. MPICH's launcher (hydra) starts the ranks in them through its ``rsh`` launcher,
with a small agent script standing in for ssh: called as ``AGENT [options] HOST COMMAND``
it runs COMMAND inside the namespace that owns HOST's address; for an address no host has
(``unreachable_address()``) it waits ``connect_timeout`` seconds and fails as ssh does.
``Hosts.mpiexec`` names the hosts to hydra by ``-hosts`` or by a hostfile (``-f``), the two
forms a user has across real machines.

Layout: namespaces ``toy<pid>x<k>h<i>`` (hosts) and ``toy<pid>x<k>sw`` (switch), host i at
``10.A.B.(i+1)/24`` on a subnet no interface of the machine uses, loopback up everywhere.
The processes of host i also get their own host name, the namespace's name (``unshare
--uts``), so MPI's processor names and what a run records of its hosts differ per host.

Everything is torn down on leaving the ``with`` block, also when the body raises: the
processes still in the namespaces are killed (``ip netns pids``), the namespaces deleted
(which deletes their interfaces) and the agent's folder removed. Every wait is bounded.
``NetnsUnavailable`` (a skip in the fixture) when not root or without ``ip``/namespaces.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from toy_testsupport.ranks import mpiexec as find_mpiexec

#: what makes MPICH treat the namespace hosts as the separate machines they stand for: they share this
#: machine's kernel, so MPICH's UCX would otherwise move data between them by cross-memory attach (reading
#: the peer process's memory), which a real pair of hosts cannot, and which fails outright (a fatal
#: "process_vm_readv ... No such process") when the test kills the peer mid-transfer
APART = {"UCX_TLS": "tcp", "MPIR_CVAR_NOLOCAL": "1"}

_counter = itertools.count()
_IP_TIMEOUT = 20.0  # seconds any one ``ip`` command may take


class NetnsUnavailable(RuntimeError):
    """This machine or user cannot make network namespaces (the reason is the message)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT, check=check)


def why_unavailable() -> str | None:
    """None when namespaces can be made here; otherwise the reason."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if shutil.which("unshare") is None:
        return "the `unshare` command (util-linux) is not installed"
    try:
        r = _ip("netns", "list", check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns list` failed: {e}"
    if r.returncode != 0:
        return f"`ip netns list` failed: {r.stderr.strip()}"
    return None


def _used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of every address and route of the root namespace and of every
    namespace ``ip`` knows."""
    spaces: list[list[str]] = [[]]
    r = _ip("netns", "list", check=False)
    spaces += [["-n", line.split()[0]] for line in r.stdout.splitlines() if line.strip()]
    nets = []
    for pre in spaces:
        for what in (["-4", "-o", "addr"], ["-4", "route"]):
            out = _ip(*pre, *what, check=False).stdout
            for tok in out.split():
                if "/" in tok or tok.count(".") == 3:
                    try:
                        nets.append(ipaddress.ip_network(tok, strict=False))
                    except ValueError:
                        pass
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network) and not n.is_loopback]


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    used = _used_networks()
    for k in range(4096):
        v = (seed * 2654435761 + k * 40503) % (200 * 256)
        net = ipaddress.IPv4Network(f"10.{40 + v // 256}.{v % 256}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise NetnsUnavailable("no free 10.x.y.0/24 subnet found")


_AGENT = """#!/bin/sh
# stands in for ssh: AGENT [options] HOST COMMAND... runs COMMAND in the namespace of HOST; a host
# no namespace has fails as ssh does when nothing answers: after the connection timeout, exit 255
while [ $# -gt 0 ]; do
  case "$1" in
    -l|-p|-i|-o|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
case "$host" in
{cases}
  *) sleep {connect_timeout}
     echo "ssh: connect to host $host port 22: Connection timed out (netns agent: no such host)" >&2
     exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$ns" "$*"
"""


class Hosts:
    """n namespace hosts (see the module docstring). ``namespaces[i]`` has ``addresses[i]``."""

    def __init__(self, n: int, tag: str, subnet: ipaddress.IPv4Network, workdir: Path, connect_timeout: float = 3.0):
        self.n = n
        self.tag = tag
        self.subnet = subnet
        self.workdir = workdir
        self.namespaces = [f"{tag}h{i}" for i in range(n)]
        self.switch = f"{tag}sw"
        hosts = list(subnet.hosts())
        self.addresses = [str(hosts[i]) for i in range(n)]
        self.agent = workdir / "agent.sh"
        self.connect_timeout = connect_timeout
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[str]] = []

    # ---------------------------------------------------------------- set-up and teardown

    def _setup(self) -> None:
        for ns in [self.switch, *self.namespaces]:
            r = _ip("netns", "add", ns, check=False)
            if r.returncode != 0 and not self._made:  # the first one: no namespaces on this machine
                raise NetnsUnavailable(f"`ip netns add` failed: {r.stderr.strip()}")
            r.check_returncode()
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        sw = ["-n", self.switch]
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            # both ends are born in the switch namespace; one moves to the host: nothing passes the root namespace
            _ip(*sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip(*sw, "link", "set", f"p{i}", "master", "br0")
            _ip(*sw, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        cases = "\n".join(f"  {addr}) ns={shlex.quote(ns)} ;;" for addr, ns in zip(self.addresses, self.namespaces))
        self.agent.write_text(_AGENT.format(cases=cases, connect_timeout=f"{self.connect_timeout:g}"))
        self.agent.chmod(0o755)
        self._wait_reachable()

    def _wait_reachable(self, timeout: float = 20.0) -> None:
        """Until host 0 reaches every other host: a TCP connection to a closed port there is
        refused (the host answered) rather than left unanswered."""
        probe = (
            "import socket, sys\n"
            "for a in sys.argv[1:]:\n"
            "    s = socket.socket(); s.settimeout(1)\n"
            "    try: s.connect((a, 9))\n"
            "    except ConnectionRefusedError: pass\n"
            "    except OSError: sys.exit(1)\n"
            "    finally: s.close()\n"
        )
        cmd = ["ip", "netns", "exec", self.namespaces[0], sys.executable, "-c", probe, *self.addresses[1:]]
        deadline = time.monotonic() + timeout
        while subprocess.run(cmd, capture_output=True, timeout=30).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the namespace hosts {self.addresses[1:]} are not reachable from {self.addresses[0]}"
                )
            time.sleep(0.1)

    def pids(self, ns: str) -> list[int]:
        """The ids of the processes living in namespace ``ns``."""
        r = _ip("netns", "pids", ns, check=False)
        return [int(x) for x in r.stdout.split() if x.isdigit()]

    def _kill_all(self, timeout: float = 10.0) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        deadline = time.monotonic() + timeout
        for ns in self._made:
            while (pids := self.pids(ns)) and time.monotonic() < deadline:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def _teardown(self) -> None:
        try:
            self._kill_all()
        finally:
            for ns in reversed(self._made):
                _ip("netns", "del", ns, check=False)
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---------------------------------------------------------------- launching

    def unreachable_address(self) -> str:
        """An address of the hosts' subnet that no host has (the agent takes ``connect_timeout``
        seconds to give up on it, as ssh does on a host that does not answer)."""
        return str(self.subnet.network_address + self.n + 100)

    def mpiexec_argv(
        self,
        n_ranks: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        mpiexec: str | None = None,
        host_list: Sequence[str] | None = None,
        hostfile: bool = False,
        launcher_args: Sequence[str] = (),
    ) -> list[str]:
        """The command line that starts ``argv`` as ``n_ranks`` MPI ranks, one per host (the first
        ``n_ranks`` hosts, or ``host_list``), from host 0's namespace; the hosts are named by
        ``-hosts A,B`` or, with ``hostfile``, by a hostfile (``-f FILE``, lines ``ADDRESS:1``);
        ``launcher_args``: more mpiexec options (before ``argv``)."""
        hosts = list(host_list) if host_list is not None else self.addresses[:n_ranks]
        if not 1 <= n_ranks <= len(hosts):
            raise ValueError(f"{n_ranks} ranks on {len(hosts)} hosts (one rank per host)")
        exe = mpiexec or find_mpiexec()
        cmd = ["ip", "netns", "exec", self.namespaces[0], *_with_hostname(self.namespaces[0])]
        cmd += [exe, "-launcher", "rsh", "-launcher-exec", str(self.agent)]
        if hostfile:
            path = self.workdir / f"hostfile-{len(hosts)}"
            path.write_text("".join(f"{a}:1\n" for a in hosts))
            cmd += ["-f", str(path), "-n", str(n_ranks)]
        else:
            cmd += ["-hosts", ",".join(hosts), "-n", str(n_ranks), "-ppn", "1"]
        for k, v in {**APART, **(env or {})}.items():
            cmd += ["-genv", k, v]
        return [*cmd, *launcher_args, *argv]

    def mpiexec(
        self,
        n_ranks: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        cwd: str | os.PathLike[str] | None = None,
        popen: bool = False,
        mpiexec: str | None = None,
        host_list: Sequence[str] | None = None,
        hostfile: bool = False,
        launcher_args: Sequence[str] = (),
    ) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
        """Run ``argv`` as ``n_ranks`` ranks (one per host); the launcher and the ranks inherit this
        process's environment plus ``env``. Returns the CompletedProcess (text stdout/stderr;
        ``subprocess.TimeoutExpired`` after ``timeout`` seconds, everything killed), or with
        ``popen=True`` the running Popen (its own process group; killed at teardown if still alive)."""
        cmd = self.mpiexec_argv(
            n_ranks, argv, env=env, mpiexec=mpiexec, host_list=host_list, hostfile=hostfile, launcher_args=launcher_args
        )
        full_env = {**os.environ, **APART, **(env or {})}
        p = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._procs.append(p)
        if popen:
            return p
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_all()
            out, err = p.communicate(timeout=10)
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)

    def popen(
        self,
        i: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdout: Any = subprocess.PIPE,
        stderr: Any = subprocess.PIPE,
        stdin: Any = subprocess.DEVNULL,
    ) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``i`` (inside its namespace, with its host name), in its own
        process group, with this process's environment plus ``env``; killed at teardown if
        still alive. Text pipes by default: pass files (or DEVNULL) for long-lived servers,
        whose unread pipes would fill."""
        cmd = ["ip", "netns", "exec", self.namespaces[i], *_with_hostname(self.namespaces[i]), *argv]
        p = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        self._procs.append(p)
        return p

    def run(
        self, i: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on host ``i`` to the end (``subprocess.TimeoutExpired`` after ``timeout``
        seconds, the process group killed); text stdout and stderr."""
        p = self.popen(i, argv, env=env)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate(timeout=10)
            raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _with_hostname(name: str) -> list[str]:
    """A command prefix that runs the rest of the command with its own host name ``name`` (a new
    UTS namespace), as a process on another machine has."""
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name]


@contextmanager
def hosts(n: int, *, connect_timeout: float = 3.0) -> Iterator[Hosts]:
    """``n`` namespace hosts on one bridge, torn down on exit (see the module docstring);
    ``connect_timeout``: the agent's seconds before it gives up on an address no host has."""
    why = why_unavailable()
    if why:
        raise NetnsUnavailable(why)
    k = next(_counter)
    tag = f"toy{os.getpid()}x{k}"
    workdir = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
    h = Hosts(n, tag, _free_subnet(os.getpid() * 31 + k), workdir, connect_timeout)
    try:
        h._setup()
        yield h
    finally:
        h._teardown()


def hosts_fixture(n: int, name: str | None = None, *, mpi: bool = True) -> Any:
    """A pytest fixture (function scope) named ``name`` (default ``hosts<n>``) giving ``hosts(n)``;
    skips, with the reason, where namespaces cannot be made (not root, no ``ip``). ``mpi``: the
    hosts run MPI, so a missing ``mpiexec`` fails the test (tests that start their own processes
    with ``Hosts.popen`` pass False). Assign it to a module attribute of the same name."""
    import pytest

    @pytest.fixture(name=name or f"hosts{n}")
    def _fixture() -> Iterator[Hosts]:
        why = why_unavailable()
        if why:
            pytest.skip(why)
        if mpi:
            find_mpiexec()  # requirements/dev.txt installs MPICH: a missing mpiexec is a failure, not a skip
        with ExitStack() as stack:
            try:
                h = stack.enter_context(hosts(n))
            except NetnsUnavailable as e:  # `ip netns add` refused (a container without the right)
                pytest.skip(str(e))
            yield h

    return _fixture


__all__ = ["Hosts", "NetnsUnavailable", "hosts", "hosts_fixture", "why_unavailable"]
