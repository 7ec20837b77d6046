"""System metrics of one running trainer, sampled by its worker (never by the training
loop): the CPU and resident memory of the trainer's whole process tree, read from /proc, and
its own GPU's utilisation, memory, power and temperature, read through NVML (`pynvml`, from
NVIDIA's `nvidia-ml-py`). A `SystemSampler` thread takes a sample every
TORCHYARD_SYS_METRICS_INTERVAL_S; the supervisor (worker/supervisor.py) moves the samples
into its `EventRecorder`'s batch, so they reach the store through the same fenced,
idempotent metric write as the trainer's own metrics, with no round trip of their own.

Series (docs/architecture.md, README "System metrics"): `sys/cpu_percent` (100 = one core),
`sys/rss_bytes`, `sys/gpu_util_percent`, `sys/gpu_memory_bytes`, `sys/gpu_power_watts`,
`sys/gpu_temperature_c`; rank k > 0 of a DDP job writes `sys/rank{k}/<metric>`. They are
indexed by time: a sample's step is its whole Unix second (monotonic across attempts and
resumes, one per sample), its `time` the exact one.

The process tree: every descendant of the process the launcher started (the trainer,
torchrun and its ranks, a script's subprocesses; under the sandbox, bwrap and everything in
its PID namespace), and every process of its session (the launchers start it as a session
leader), so a daemonised grandchild still counts. CPU is the growth of each process's own
and reaped children's time between two samples (a child that exits inside the tree is
counted in its parent's); memory is the sum of resident set sizes (pages shared between
processes, such as a forked loader's, count once per process).

The GPU is the worker's pinned one: `Device.cuda_visible` is its UUID (`GPU-…`/`MIG-…`, looked
up by UUID) or, where nvidia-smi could not tell, an index, which NVML counts in PCI bus order
as nvidia-smi does. Without a GPU or NVML the CPU series go on and the reason is said once
(`notes`). An exception in sampling is logged once and ends sampling for the attempt: it
never reaches the supervision loop."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchyard.contracts.eventmodel import SYS_PREFIX
from torchyard.worker.events import EventRecorder

log = logging.getLogger(__name__)

CPU_PERCENT = "cpu_percent"
RSS_BYTES = "rss_bytes"
GPU_UTIL = "gpu_util_percent"
GPU_MEMORY = "gpu_memory_bytes"
GPU_POWER = "gpu_power_watts"
GPU_TEMPERATURE = "gpu_temperature_c"
METRICS = (CPU_PERCENT, RSS_BYTES, GPU_UTIL, GPU_MEMORY, GPU_POWER, GPU_TEMPERATURE)

PROC = Path("/proc")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
STOP_WAIT_S = 2.0  # how long `stop` waits for a sample under way (an NVML call can stall)


def series_name(metric: str, rank: int) -> str:
    """The stored series of `metric` for this rank: rank 0 the plain name, others by rank."""
    return f"{SYS_PREFIX}{metric}" if rank == 0 else f"{SYS_PREFIX}rank{rank}/{metric}"


# ---- the process tree (/proc) -----------------------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    """What one /proc/PID/stat line says that sampling needs."""

    pid: int
    ppid: int
    session: int
    start: int  # clock ticks after boot: with the pid, names one process (pids are reused)
    cpu_ticks: int  # utime + stime + cutime + cstime: its own and its reaped children's
    rss_pages: int


def parse_stat(text: str) -> ProcStat:
    """One /proc/PID/stat line (proc(5)); the command name may hold spaces and parentheses,
    so the fields are counted from its last ')'. ValueError/IndexError when malformed."""
    head, _, rest = text.rpartition(")")
    f = rest.split()
    # f[0] is field 3 (state): field N is f[N - 3].
    return ProcStat(
        pid=int(head.split("(", 1)[0]),
        ppid=int(f[1]),
        session=int(f[3]),
        start=int(f[19]),
        cpu_ticks=int(f[11]) + int(f[12]) + int(f[13]) + int(f[14]),
        rss_pages=max(0, int(f[21])),
    )


def scan(proc: Path = PROC) -> dict[int, ProcStat]:
    """Every process of the host (of /proc's PID namespace), by pid. A process that ends
    while it is read is left out."""
    out: dict[int, ProcStat] = {}
    with os.scandir(proc) as entries:
        for e in entries:
            if not e.name.isdigit():
                continue
            try:
                with open(os.path.join(e.path, "stat")) as f:
                    st = parse_stat(f.read())
            except (OSError, ValueError, IndexError):
                continue
            out[st.pid] = st
    return out


def tree_of(root: int, stats: dict[int, ProcStat]) -> list[ProcStat]:
    """`root` and its descendants, plus the rest of its session when it leads one."""
    children: dict[int, list[int]] = {}
    for st in stats.values():
        children.setdefault(st.ppid, []).append(st.pid)
    if root not in stats:
        return []
    found, todo = {root}, [root]
    while todo:
        for kid in children.get(todo.pop(), ()):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    if stats[root].session == root:
        found.update(pid for pid, st in stats.items() if st.session == root)
    return [stats[pid] for pid in found]


class TreeSampler:
    """CPU and resident memory of one process tree, one `sample()` at a time. CPU is over
    the time since the previous sample (the first: since this sampler was made)."""

    def __init__(
        self,
        root: int,
        proc: Path = PROC,
        clock: Callable[[], float] = time.monotonic,
        ncpu: int | None = None,
    ):
        self.root, self.proc, self.clock = root, proc, clock
        self.max_percent = 100.0 * (ncpu or os.cpu_count() or 1)
        # The baseline: CPU spent before it is not this sampler's to report.
        self._before = {p.pid: p for p in tree_of(root, scan(proc))}
        self._at = clock()

    def _cpu_ticks(self, now: dict[int, ProcStat]) -> int:
        """Ticks the tree spent since the last sample. A process new since counts whole. A
        process gone was reaped into its parent's cutime/cstime, whole: what of it was
        counted before is taken off again when the reaper (its nearest ancestor still here)
        is in the tree; one reaped elsewhere (an orphan's init) is simply gone."""
        before = self._before

        def same(pid: int) -> bool:
            return pid in now and now[pid].start == before[pid].start

        used = 0
        for pid, st in now.items():
            was = before.get(pid)
            used += st.cpu_ticks - (was.cpu_ticks if was is not None and same(pid) else 0)
        for pid, was in before.items():
            if same(pid):
                continue
            up, seen = was.ppid, {pid}
            while up in before and not same(up) and up not in seen:
                seen.add(up)
                up = before[up].ppid
            if same(up):
                used -= was.cpu_ticks
        return max(0, used)

    def sample(self) -> dict[str, float] | None:
        """`{cpu_percent, rss_bytes}`, or None once the tree is gone."""
        at = self.clock()
        now = {p.pid: p for p in tree_of(self.root, scan(self.proc))}
        if not now:
            return None
        ticks, elapsed = self._cpu_ticks(now), at - self._at
        self._before, self._at = now, at
        cpu = 100.0 * ticks / CLK_TCK / elapsed if elapsed > 0 else 0.0
        rss = sum(p.rss_pages for p in now.values()) * PAGE_BYTES
        return {CPU_PERCENT: min(cpu, self.max_percent), RSS_BYTES: float(rss)}


# ---- the GPU (NVML) ---------------------------------------------------------------------


class GpuUnavailable(Exception):
    """Why this worker records no GPU series (said once in the job's log)."""


def _not_supported(e: BaseException, nvml: Any) -> bool:
    return getattr(e, "value", None) == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)


def _pynvml() -> Any:
    """NVIDIA's binding, imported on first use (a CPU worker never loads it)."""
    try:
        import pynvml
    except ImportError:
        raise GpuUnavailable("nvidia-ml-py (pynvml) is not installed") from None
    return pynvml


class GpuSampler:
    """The pinned GPU's utilisation, used memory, power and temperature through NVML. A
    reading the device does not support (a MIG instance's utilisation, some boards' power)
    is dropped for good and named in `unsupported`; any other NVML error propagates."""

    def __init__(self, visible: str, nvml: Any = None):
        """`visible`: the trainer's CUDA_VISIBLE_DEVICES (worker/identity.py Device)."""
        if not visible:
            raise GpuUnavailable("this worker has no GPU (--device cpu)")
        nvml = nvml if nvml is not None else _pynvml()
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as e:
            raise GpuUnavailable(f"NVML is not available ({e})") from None
        try:
            self.handle = self._handle(visible)
        except BaseException:
            self.close()
            raise
        self.unsupported: list[str] = []
        self._readers: dict[str, Callable[[], float]] = {
            GPU_UTIL: lambda: float(nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu),
            GPU_MEMORY: lambda: float(nvml.nvmlDeviceGetMemoryInfo(self.handle).used),
            # NVML answers milliwatts
            GPU_POWER: lambda: nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0,
            GPU_TEMPERATURE: lambda: float(
                nvml.nvmlDeviceGetTemperature(self.handle, nvml.NVML_TEMPERATURE_GPU)
            ),
        }

    def _handle(self, visible: str) -> Any:
        nvml = self.nvml
        try:
            if visible.startswith(("GPU-", "MIG-")):
                return nvml.nvmlDeviceGetHandleByUUID(visible.encode())
            if visible.isdigit():  # NVML's index is PCI bus order, as nvidia-smi's
                return nvml.nvmlDeviceGetHandleByIndex(int(visible))
        except nvml.NVMLError as e:
            raise GpuUnavailable(f"NVML finds no GPU {visible} ({e})") from None
        raise GpuUnavailable(
            f"CUDA_VISIBLE_DEVICES={visible!r} is neither a GPU's UUID nor an index"
        )

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for metric, read in list(self._readers.items()):
            try:
                out[metric] = read()
            except self.nvml.NVMLError as e:
                if not _not_supported(e, self.nvml):
                    raise
                del self._readers[metric]
                self.unsupported.append(metric)
        return out

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception as e:  # shutting down is best effort
            log.debug("nvmlShutdown: %s", e)


# ---- the sampling thread ----------------------------------------------------------------

GpuFactory = Callable[[str], GpuSampler]


class SystemSampler:
    """Samples one trainer every `interval_s` in a thread of its own (an NVML call that
    stalls never stalls supervision). The supervisor `take()`s the rows and `take_notes()`
    the job-log lines; `stop()` at the trainer's end."""

    def __init__(
        self,
        *,
        pid: int,
        rank: int,
        gpu: str,
        interval_s: float,
        job_id: str = "",
        gpu_factory: GpuFactory = GpuSampler,
        proc: Path = PROC,
        clock: Callable[[], float] = time.time,
    ):
        self.pid, self.rank, self.gpu, self.interval_s = pid, rank, gpu, interval_s
        self.job_id, self.gpu_factory, self.proc, self.clock = job_id, gpu_factory, proc, clock
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._notes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sysmetrics-{pid}", daemon=True)
        self._last_step: int | None = None
        self.tree: TreeSampler | None = None
        self.gpu_sampler: GpuSampler | None = None
        self.failed: str | None = None  # why sampling stopped early

    def start(self) -> SystemSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STOP_WAIT_S)

    def take(self) -> list[dict[str, Any]]:
        """The rows sampled since the last call (metric rows: name, step, epoch, value, time)."""
        with self._lock:
            rows, self._rows = self._rows, []
        return rows

    def take_notes(self) -> list[str]:
        """What to say once in the job's log since the last call."""
        with self._lock:
            notes, self._notes = self._notes, []
        return notes

    def _note(self, text: str, level: int = logging.INFO) -> None:
        """Once: into the worker's log now, into the job's log at the supervisor's next look."""
        log.log(level, "job %s rank %d: system metrics: %s", self.job_id, self.rank, text)
        with self._lock:
            self._notes.append(
                f"===== torchyard: system metrics (rank {self.rank}): {text} =====\n"
            )

    def _run(self) -> None:
        try:
            self._open()
            while not self._stop.wait(self.interval_s):
                self.sample_once()
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            self._note(f"sampling stopped for this attempt ({self.failed})", logging.WARNING)
            log.debug("system metrics sampling failed", exc_info=True)
        finally:
            if self.gpu_sampler is not None:
                self.gpu_sampler.close()

    def _open(self) -> None:
        """The baseline of the tree's CPU, and the GPU (or why there is none)."""
        self.tree = TreeSampler(self.pid, self.proc)
        try:
            self.gpu_sampler = self.gpu_factory(self.gpu)
        except GpuUnavailable as e:
            self._note(f"CPU and memory only, no GPU series: {e}")

    def sample_once(self) -> int:
        """One sample of every series into the buffer; returns the rows added."""
        assert self.tree is not None
        t = self.clock()
        step = int(t)
        if self._last_step is not None and step <= self._last_step:
            return 0  # one sample per second at most (the clock stepped back, or a retry)
        values = self.tree.sample()
        if values is None:  # the trainer's tree is gone: its end is the supervisor's to see
            self._stop.set()
            return 0
        gpu = self.gpu_sampler
        if gpu is not None:
            values.update(gpu.sample())
            while gpu.unsupported:
                self._note(f"{series_name(gpu.unsupported.pop(), self.rank)}: not supported here")
        rows = [
            {"name": series_name(m, self.rank), "step": step, "epoch": None, "value": v, "time": t}
            for m, v in values.items()
        ]
        self._last_step = step
        with self._lock:
            self._rows.extend(rows)
        return len(rows)


def record_samples(rec: EventRecorder, rows: list[dict[str, Any]], refused: set[str]) -> list[str]:
    """Add sampled rows to the recorder's batch under the job's metric-name rules (the
    budget of distinct names, their length): they go to the store with its next flush.
    Returns a job-log line for each name newly refused (`refused` remembers them)."""
    lines = []
    for row in rows:
        name = row["name"]
        if name in refused:
            continue
        why = None
        if len(name) > rec.limits.metric_name_chars:
            why = f"TORCHYARD_MAX_METRIC_NAME_CHARS is {rec.limits.metric_name_chars}"
        elif name not in rec.names and len(rec.names) >= rec.limits.metric_names:
            why = f"the job has {len(rec.names)} metric names (TORCHYARD_MAX_METRIC_NAMES)"
        if why is not None:
            refused.add(name)
            lines.append(f"===== torchyard: system metrics: {name} not recorded: {why} =====\n")
            continue
        rec.names.add(name)
        rec.metrics.append(row)
    return lines
