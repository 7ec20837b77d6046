"""A one-node Slurm cluster for tests, on this machine and nothing of its own: a private
munged (its own key and socket), slurmctld and slurmd with a generated slurm.conf (free
ports, state and spool in a temporary folder, no accounting, CPUs only), and the client
commands (sbatch, squeue, scancel) pointed at it through SLURM_CONF. Every daemon is
stopped by its own PID. Needs root (slurmd runs jobs as their user; SlurmUser=root)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel")
# What a job gets between Slurm's SIGTERM and its SIGKILL.
KILL_WAIT_S = 30


def missing() -> list[str]:
    out = [t for t in TOOLS if shutil.which(t) is None]
    if os.geteuid() != 0:
        out.append("root (slurmd, munged)")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _conf(d: Path, node: str, cpus: int) -> str:
    return f"""\
ClusterName=torchyardtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait={KILL_WAIT_S}
MailProg=/bin/true
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munged + slurmctld + slurmd under `d`; `env` is what a Slurm client command needs."""

    def __init__(self, d: Path, cpus: int = 8):
        self.dir = d
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.conf = d / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> SlurmCluster:
        d = self.dir
        for sub in ("munge", "state", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o755)  # clients reach the socket; the key stays 0400
        key = d / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}", "--bits=1024"], check=True)
        os.chmod(key, 0o400)
        m = d / "munge"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={m}/munge.socket", f"--pid-file={m}/munged.pid",
                               f"--seed-file={m}/munged.seed"])  # fmt: skip
        self._wait(lambda: (m / "munge.socket").exists(), 20, "munged's socket")
        self.conf.write_text(_conf(d, self.node, self.cpus))
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), 30, "slurmctld")
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self._ok(["sinfo", "-h", "-o", "%T"], "idle"), 60, "slurmd (node idle)")
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")  # noqa: SIM115 (owned by the child)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True)  # fmt: skip
        log.close()

    def _ok(self, argv: list[str], want: str) -> bool:
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        return out.returncode == 0 and want in out.stdout

    def _wait(self, cond: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited {p.returncode}:\n{self.logs()}")
            if callable(cond) and cond():
                return
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}:\n{self.logs()}")

    def run(self, *argv: str) -> str:
        """A Slurm client command against this cluster; its stdout (CalledProcessError)."""
        out = subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                             timeout=60, check=True)  # fmt: skip
        return out.stdout

    def jobs(self) -> dict[str, str]:
        """Every job this cluster still holds: `<id>` or `<id>_<index>` -> its state."""
        out = self.run("squeue", "-h", "-o", "%i %T")
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    def logs(self) -> str:
        parts = []
        for f in sorted((self.dir / "log").glob("*")):
            parts.append(f"--- {f.name} ---\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, give them KillWait to end, then stop the daemons by PID."""
        with contextlib.suppress(Exception):
            for job in self.jobs():
                subprocess.run(["scancel", job], env=self.env, timeout=30)
            deadline = time.monotonic() + KILL_WAIT_S + 15
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
