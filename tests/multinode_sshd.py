"""An SSH server on loopback for `ray up` tests: a throwaway user, a throwaway key, sshd on 127.0.0.1 at a
free high port, and a ProxyCommand that reaches it (Ray's SSH runner always dials port 22).

The `ray up` "remote" node is this machine seen through SSH as that user: Ray, `ray stop` (which `ray down`
runs) and everything else the launcher does there act on that user's processes only, never on the Ray
instances other tests of this machine run. Needs root (sshd switches users), /usr/sbin/sshd and rsync.
Everything is removed again by `close()`: sshd, the user's leftover processes (by pid), the user and its home.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

SSHD = "/usr/sbin/sshd"
PROXY = '''#!{python}
"""ssh ProxyCommand: relay stdin/stdout to sshd on 127.0.0.1:{port}."""
import os, socket, threading
sock = socket.create_connection(("127.0.0.1", {port}))
def up():
    while True:
        data = os.read(0, 65536)
        if not data:
            sock.shutdown(socket.SHUT_WR)
            return
        sock.sendall(data)
threading.Thread(target=up, daemon=True).start()
while True:
    data = sock.recv(65536)
    if not data:
        break
    os.write(1, data)
'''


def missing_requirements() -> str | None:
    """Why an sshd on loopback cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "sshd must run as root to log a user in"
    for tool in (SSHD, shutil.which("ssh"), shutil.which("rsync"), shutil.which("useradd")):
        if not tool or not os.path.exists(tool):
            return "needs openssh-server, openssh-client, rsync and useradd (apt-get install -y openssh-server rsync)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackSSH:
    """sshd on 127.0.0.1:<port> letting one throwaway user in with one throwaway key."""

    def __init__(self, workdir: Path, bashrc: str) -> None:
        self.workdir = workdir
        self.user = f"psrayup{uuid.uuid4().hex[:8]}"
        self.port = _free_port()
        self.key = workdir / "id_ed25519"
        self.proxy = workdir / "proxy.py"
        self.sshd: subprocess.Popen | None = None
        self.home = Path(f"/home/{self.user}")
        try:
            self._start(bashrc)
        except BaseException:
            self.close()
            raise

    def _start(self, bashrc: str) -> None:
        run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)  # noqa: E731
        run("useradd", "--create-home", "--shell", "/bin/bash", self.user)
        run("usermod", "-p", "*", self.user)  # no password, but not locked: sshd admits it by key
        (self.home / ".bashrc").write_text(bashrc)
        run("chown", f"{self.user}:", str(self.home / ".bashrc"))
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.workdir / "host_ed25519"))
        # sshd reads the user's authorized keys as that user: they live in its own ~/.ssh.
        ssh_dir = self.home / ".ssh"
        ssh_dir.mkdir(mode=0o700)
        (ssh_dir / "authorized_keys").write_text((self.workdir / "id_ed25519.pub").read_text())
        os.chmod(ssh_dir / "authorized_keys", 0o600)
        run("chown", "-R", f"{self.user}:", str(ssh_dir))
        config = self.workdir / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.workdir / 'host_ed25519'}",
            f"PidFile {self.workdir / 'sshd.pid'}", "AuthorizedKeysFile .ssh/authorized_keys", f"AllowUsers {self.user}",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin no", "UsePAM no",
            "StrictModes no", "Subsystem sftp internal-sftp", "MaxStartups 100", "MaxSessions 100", "",
        ]))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        run(SSHD, "-t", "-f", str(config))
        self.sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.workdir / "sshd.log", "w"))
        self.proxy.write_text(PROXY.format(python=sys.executable, port=self.port))
        os.chmod(self.proxy, 0o755)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
                break
            except OSError:
                if self.sshd.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not start: {(self.workdir / 'sshd.log').read_text()}")
                time.sleep(0.2)

    def user_pids(self) -> list[int]:
        done = subprocess.run(["ps", "-o", "pid=", "-u", self.user], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def close(self) -> None:
        """Stop sshd, end what the throwaway user still runs (by pid), remove the user and its home."""
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.terminate()
            try:
                self.sshd.wait(30)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
        for sig in (15, 9):
            for pid in self.user_pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if not self.user_pids():
                break
            time.sleep(3)
        subprocess.run(["userdel", "--remove", self.user], capture_output=True, timeout=60)
