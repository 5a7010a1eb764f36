"""Two hosts on one machine: network namespaces joined by a virtual link, each with its own
hostname, address, /etc/hosts and HOME, and an sshd.

Why: the multi-host paths of the pool (ranks by host, ``local_rank``, the controller bound to a
network address, connection files copied to another host's HOME, the torch.distributed
rendezvous over a non-loopback address) only run for real when the hosts differ in exactly
those ways. A process runs "on" a host through ``host.wrap``: ``nsenter`` its network
namespace (unlike ``ip netns exec`` this keeps /sys and its cgroups, which slurmd needs),
then ``unshare`` a mount and UTS namespace in which the hostname is set,
the host's own folder is bind-mounted over /root (root's HOME) and its hosts file over
/etc/hosts. Everything else (the checkout, the virtualenv, /tmp) is shared, as on a cluster
with a shared file system. Traffic stays on the veth pair between the two namespaces; the test
makes and removes it all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.77.0"  # the test hosts' own link; nothing else lives there
# $1 hostname, $2 HOME folder, $3 hosts file, $4 folders under /root to keep shared
_ENTER = """h=$1; home=$2; hosts=$3; shared=$4; shift 4
hostname "$h" || exit 1
for d in $(echo "$shared" | tr ':' ' '); do
    mkdir -p "$home/$d" && mount --bind "/root/$d" "$home/$d" || exit 1
done
mount --rbind "$home" /root && mount --bind "$hosts" /etc/hosts && exec "$@"
"""


def _shared_under_root() -> str:
    """Folders under /root that every host must keep: the Python installation, the
    virtualenv, the checkout and the temporary folder (wherever CI put them), as hosts of a
    cluster share their software and file system; only what else is in HOME differs."""
    shared = set()
    for path in (sys.executable, os.path.realpath(sys.executable), sys.prefix,
                 sys.base_prefix, str(Path(__file__).resolve().parents[2]),
                 tempfile.gettempdir()):
        if path.startswith("/root/"):
            shared.add(path.split("/")[2])
    return ":".join(sorted(shared))


@dataclass
class TestHost:
    name: str  # hostname, also the netns name
    addr: str
    root: Path  # this host's folder: home/, hosts, sshd files

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def wrap(self) -> list[str]:
        """argv prefix that runs a program on this host."""
        return ["nsenter", f"--net=/run/netns/{self.name}", "unshare", "--mount", "--uts",
                "--propagation", "private", "/bin/sh", "-c", _ENTER, "enter", self.name,
                str(self.home), str(self.root / "hosts"), _shared_under_root()]

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> str:
        done = subprocess.run([*self.wrap, *argv], capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"on {self.name}: {' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout


class TwoHosts:
    """``a`` (the notebook's host) and ``b``, each with sshd accepting one key pair that
    both HOMEs hold (a cluster user's key) and known_hosts listing both host keys."""

    def __init__(self, workdir: Path, tag: str = "") -> None:
        tag = tag or str(os.getpid() % 100000)
        self.dir = workdir
        self.a = TestHost(f"wba{tag}", f"{SUBNET}.1", workdir / "a")
        self.b = TestHost(f"wbb{tag}", f"{SUBNET}.2", workdir / "b")
        self.sshd: list[subprocess.Popen] = []

    @property
    def hosts(self) -> list[TestHost]:
        return [self.a, self.b]

    def start(self) -> TwoHosts:
        self._network()
        self._files()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        for host in self.hosts:
            self.sshd.append(subprocess.Popen(
                [*host.wrap, "/usr/sbin/sshd", "-D", "-e", "-f", str(host.root / "sshd_config")],
                stdout=subprocess.DEVNULL, stderr=open(host.root / "sshd.log", "ab")))  # noqa: SIM115
        for host in self.hosts:
            self._wait_ssh(host)
        return self

    def _network(self) -> None:
        a, b = self.a.name, self.b.name
        for cmd in (f"netns add {a}", f"netns add {b}",
                    f"link add {a}0 type veth peer name {b}0",
                    f"link set {a}0 netns {a}", f"link set {b}0 netns {b}"):
            subprocess.run(["ip", *cmd.split()], check=True)
        for host in self.hosts:
            for cmd in (f"addr add {host.addr}/24 dev {host.name}0",
                        f"link set {host.name}0 up", "link set lo up"):
                subprocess.run(["ip", "-n", host.name, *cmd.split()], check=True)

    def _files(self) -> None:
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.addr} {h.name}\n" for h in self.hosts)
        key = self.dir / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                       check=True)
        known = []
        for host in self.hosts:
            ssh = host.home / ".ssh"
            ssh.mkdir(parents=True, mode=0o700)
            host.root.chmod(0o755)
            (host.root / "hosts").write_text(hosts_file)
            hostkey = host.root / "ssh_host_ed25519_key"
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey)],
                           check=True)
            known.append(f"{host.name},{host.addr} {Path(f'{hostkey}.pub').read_text()}")
            (host.root / "sshd_config").write_text(
                f"ListenAddress {host.addr}\nHostKey {hostkey}\nPidFile {host.root}/sshd.pid\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nPermitUserEnvironment yes\n"
                "AuthorizedKeysFile .ssh/authorized_keys\nSubsystem sftp internal-sftp\n")
        for host in self.hosts:
            ssh = host.home / ".ssh"
            shutil.copy(key, ssh / "id_ed25519")
            shutil.copy(f"{key}.pub", ssh / "id_ed25519.pub")
            shutil.copy(f"{key}.pub", ssh / "authorized_keys")
            (ssh / "known_hosts").write_text("".join(known))
            (ssh / "config").write_text("Host *\n  BatchMode yes\n  StrictHostKeyChecking yes\n")
            for f in ssh.iterdir():
                f.chmod(0o600)

    def _wait_ssh(self, host: TestHost, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            done = subprocess.run([*self.a.wrap, "ssh", host.name, "hostname"],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode == 0 and done.stdout.strip() == host.name:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"ssh {host.name} from {self.a.name} failed: {done.stderr}")
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.sshd:
            proc.terminate()
        for host in self.hosts:  # whatever still runs in a namespace (engines, daemons)
            pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
        for proc in self.sshd:
            proc.wait(10)
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
