"""System metrics per job (worker/sysmetrics.py): /proc parsing and the process tree on a
fake /proc and on real processes, the NVML sampler with `pynvml` replaced at its function
boundary (and once for real, `gpu` group), the sampling thread's once-only notes and its
stop on an error, the metric-name rules, and the supervisor writing the samples of a real
trainer process tree (ranks 0 and 1) through its fenced batch into the store."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
import torch
from sqlalchemy import select
from support.worker_factories import make_job, make_worker

from torchyard.contracts.eventmodel import EventLimits
from torchyard.scheduler.cycle import schedule
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Assignment, Attempt, Metric
from torchyard.store.paths import EVENTS_FILE, LOG_FILE, job_dir
from torchyard.worker import sysmetrics as sm
from torchyard.worker.events import EventRecorder, EventTail
from torchyard.worker.identity import Device
from torchyard.worker.launch_local import LocalTrainer
from torchyard.worker.supervisor import Claimed, Supervision, WorkerContext

MIB = 1024**2


# ---- /proc ------------------------------------------------------------------------------


def stat_line(pid: int, ppid: int, session: int, ticks: tuple[int, int, int, int] = (0, 0, 0, 0),
              start: int = 100, rss: int = 10, comm: str = "python") -> str:  # fmt: skip
    u, s, cu, cs = ticks
    rest = [
        "S", ppid, ppid, session, 0, -1, 0, 0, 0, 0, 0, u, s, cu, cs, 20, 0, 1, 0, start, 4096, rss,
    ]  # fmt: skip
    return f"{pid} ({comm}) " + " ".join(map(str, rest)) + " 0 0 0\n"


class FakeProc:
    """A /proc of made-up processes: `set` writes one's stat, `drop` removes it."""

    def __init__(self, root: Path):
        self.root = root
        (root / "self").mkdir(parents=True)  # not a pid: skipped

    def set(self, pid: int, ppid: int, session: int, **kw: Any) -> None:
        (self.root / str(pid)).mkdir(exist_ok=True)
        (self.root / str(pid) / "stat").write_text(stat_line(pid, ppid, session, **kw))

    def drop(self, pid: int) -> None:
        (self.root / str(pid) / "stat").unlink()
        (self.root / str(pid)).rmdir()


def test_parse_stat_counts_fields_after_the_last_parenthesis() -> None:
    st = sm.parse_stat(stat_line(42, 7, 42, (1, 2, 3, 4), start=99, rss=5, comm="a) (b c"))
    assert st == sm.ProcStat(pid=42, ppid=7, session=42, start=99, cpu_ticks=10, rss_pages=5)
    real = sm.parse_stat(Path("/proc/self/stat").read_text())
    assert (real.pid, real.ppid, real.session) == (os.getpid(), os.getppid(), os.getsid(0))
    with pytest.raises((ValueError, IndexError)):
        sm.parse_stat("12 (x) S 1")


def test_the_tree_is_the_descendants_and_the_session(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.set(1, 0, 1)
    proc.set(10, 1, 10)  # the trainer, a session leader
    proc.set(11, 10, 10)
    proc.set(12, 11, 99)  # a grandchild in a session of its own (setsid)
    proc.set(13, 1, 10)  # daemonised: reparented to init, still of the trainer's session
    proc.set(20, 1, 20)  # another job's trainer
    proc.set(21, 20, 20)
    stats = sm.scan(proc.root)
    assert sorted(p.pid for p in sm.tree_of(10, stats)) == [10, 11, 12, 13]
    assert sorted(p.pid for p in sm.tree_of(11, stats)) == [11, 12]  # no session of its own
    assert sm.tree_of(30, stats) == []


def test_cpu_is_counted_once_through_reaping_and_pid_reuse(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    hz = sm.CLK_TCK
    now = [1000.0]
    proc.set(10, 1, 10, ticks=(5 * hz, 0, 0, 0), rss=100)
    proc.set(11, 10, 10, ticks=(hz, 0, 0, 0), rss=50)
    tree = sm.TreeSampler(10, proc.root, clock=lambda: now[0], ncpu=4)
    # 1 s later: the trainer spent 1 s, its child 0.5 s more.
    now[0] += 1
    proc.set(10, 1, 10, ticks=(6 * hz, 0, 0, 0), rss=100)
    proc.set(11, 10, 10, ticks=(hz + hz // 2, 0, 0, 0), rss=50)
    got = tree.sample()
    assert got is not None and got[sm.CPU_PERCENT] == pytest.approx(150.0)
    assert got[sm.RSS_BYTES] == 150 * sm.PAGE_BYTES
    # The child ran 0.5 s more and was reaped: its whole 2 s are in the parent's cutime; the
    # 1.5 s counted before are not counted again. A new child (pid 12) counts whole.
    now[0] += 1
    proc.drop(11)
    proc.set(10, 1, 10, ticks=(6 * hz, 0, 2 * hz, 0), rss=100)
    proc.set(12, 10, 10, ticks=(0, hz // 4, 0, 0), start=500, rss=10)
    got = tree.sample()
    assert got is not None and got[sm.CPU_PERCENT] == pytest.approx(75.0)
    # Pid 12 reaped (its 0.25 s into the trainer's cutime) and reused by another process of
    # the tree: the new one's ticks are all new.
    now[0] += 2
    proc.set(10, 1, 10, ticks=(6 * hz, 0, 2 * hz + hz // 4, 0), rss=100)
    proc.set(12, 10, 10, ticks=(0, hz, 0, 0), start=900, rss=10)
    got = tree.sample()
    assert got is not None and got[sm.CPU_PERCENT] == pytest.approx(50.0)
    # Capped at the host's cores (a tick's rounding never reads as 5 cores of 4).
    now[0] += 1
    proc.set(10, 1, 10, ticks=(16 * hz, 0, 2 * hz + hz // 4, 0), rss=100)
    got = tree.sample()
    assert got is not None and got[sm.CPU_PERCENT] == 400.0
    for pid in (10, 12):
        proc.drop(pid)
    assert tree.sample() is None


def _spinner_ticks(parent: int) -> int:
    """CPU ticks (user + system) of `parent`'s child started with the argument 'spin'."""
    for kid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        if Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")[-2:-1] == [b"spin"]:
            stat = Path(f"/proc/{kid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(stat[11]) + int(stat[12])
    raise AssertionError("the spinning child is gone")


def test_a_real_tree_memory_and_cpu() -> None:
    """A parent whose two children each hold 64 MiB and one of them spins: the tree's RSS
    holds both, its CPU at least what the spinning child got, as the kernel counted it
    (about one core on an idle machine; less when the suite's other processes share the
    cores, so the floor is what the child was given, not a fixed share)."""
    child = (
        "import sys, time\n"
        "b = b'1' * (64 << 20)\n"
        "t = time.time()\n"
        "while time.time() - t < 3:\n"
        "    if sys.argv[1] == 'idle':\n"
        "        time.sleep(0.01)\n"
    )
    script = (
        "import subprocess, sys\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', {child!r}, m]) for m in ('idle', 'spin')]\n"
        "[k.wait() for k in kids]\n"
    )
    p = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        tree = sm.TreeSampler(p.pid)
        t0 = time.monotonic()
        time.sleep(1.5)
        spun = _spinner_ticks(p.pid)  # the child started after the sampler: all its CPU
        got = tree.sample()
        elapsed = time.monotonic() - t0
        assert got is not None
        assert 2 * 64 * MIB <= got[sm.RSS_BYTES] < 2 * 64 * MIB + 300 * MIB
        floor = 100.0 * spun / os.sysconf("SC_CLK_TCK") / elapsed
        assert floor > 5.0, "the spinning child got almost no CPU"
        assert floor * 0.95 <= got[sm.CPU_PERCENT] <= 100.0 * (os.cpu_count() or 1)
    finally:
        p.kill()
        p.wait()


# ---- NVML, replaced at the library's functions ------------------------------------------


class FakeNvml:
    """What the fake answers, and what pynvml was asked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, power: Any = 251_500,
                 init_error: Exception | None = None):  # fmt: skip
        self.asked: list[tuple[str, Any]] = []
        self.power = power
        handle = object()

        def init() -> None:
            if init_error is not None:
                raise init_error

        def by_uuid(uuid: bytes) -> object:
            self.asked.append(("uuid", uuid))
            if uuid != b"GPU-1111":
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
            return handle

        def by_index(i: int) -> object:
            self.asked.append(("index", i))
            return handle

        def power_usage(h: object) -> int:
            if isinstance(self.power, Exception):
                raise self.power
            return int(self.power)

        patches = {
            "nvmlInit": init,
            "nvmlShutdown": lambda: self.asked.append(("shutdown", None)),
            "nvmlDeviceGetHandleByUUID": by_uuid,
            "nvmlDeviceGetHandleByIndex": by_index,
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=87, memory=40),
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=5 * 1024**3, total=80 * 1024**3),
            "nvmlDeviceGetPowerUsage": power_usage,
            "nvmlDeviceGetTemperature": lambda h, sensor: 61 if sensor == pynvml.NVML_TEMPERATURE_GPU else -1,
        }  # fmt: skip
        for name, fn in patches.items():
            monkeypatch.setattr(pynvml, name, fn)


def test_gpu_by_uuid_in_watts(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(monkeypatch)
    gpu = sm.GpuSampler("GPU-1111")
    assert gpu.sample() == {
        sm.GPU_UTIL: 87.0,
        sm.GPU_MEMORY: float(5 * 1024**3),
        sm.GPU_POWER: 251.5,  # NVML's milliwatts
        sm.GPU_TEMPERATURE: 61.0,
    }
    gpu.close()
    assert fake.asked == [("uuid", b"GPU-1111"), ("shutdown", None)]


def test_gpu_by_index_and_the_reasons_there_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(monkeypatch)
    sm.GpuSampler("3").close()
    assert fake.asked[0] == ("index", 3)
    with pytest.raises(sm.GpuUnavailable, match="no GPU GPU-2222"):
        sm.GpuSampler("GPU-2222")
    with pytest.raises(sm.GpuUnavailable, match="neither a GPU's UUID nor an index"):
        sm.GpuSampler("cuda:0")
    with pytest.raises(sm.GpuUnavailable, match="no GPU"):
        sm.GpuSampler("")  # a CPU worker
    FakeNvml(monkeypatch, init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    with pytest.raises(sm.GpuUnavailable, match="NVML is not available"):
        sm.GpuSampler("GPU-1111")


def test_an_unsupported_reading_is_dropped_and_named_once(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(monkeypatch, power=pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED))
    sampler = sm.SystemSampler(pid=os.getpid(), rank=2, gpu="GPU-1111", interval_s=1,
                               clock=iter(range(1000, 2000)).__next__)  # fmt: skip
    sampler._open()
    assert sampler.sample_once() == 5 and sampler.sample_once() == 5  # cpu, rss, 3 GPU
    rows = sampler.take()
    assert {r["name"] for r in rows} == {
        "sys/rank2/cpu_percent", "sys/rank2/rss_bytes", "sys/rank2/gpu_util_percent",
        "sys/rank2/gpu_memory_bytes", "sys/rank2/gpu_temperature_c",
    }  # fmt: skip
    assert [n for n in sampler.take_notes() if "gpu_power_watts" in n] == [
        "===== torchyard: system metrics (rank 2): sys/rank2/gpu_power_watts: not supported "
        "here =====\n"
    ]
    # Any other NVML error ends sampling (the thread's loop notes it once).
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", _raise_gpu_lost)
    with pytest.raises(pynvml.NVMLError):
        sampler.sample_once()


def _raise_gpu_lost(*_: Any) -> int:
    raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_nvml_reads_the_pinned_gpu() -> None:
    """The GPU this process's first CUDA device is, by the UUID a worker pins it by
    (worker/identity.py), read through the real NVML while a tensor holds 256 MiB on it."""
    from torchyard.worker.identity import gpu_device

    visible = gpu_device(0, environ={}).cuda_visible
    held = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    gpu = sm.GpuSampler(visible)
    try:
        got = gpu.sample()
    finally:
        gpu.close()
    assert got[sm.GPU_MEMORY] >= 256 * MIB
    assert 0 <= got[sm.GPU_UTIL] <= 100
    assert 0 < got.get(sm.GPU_TEMPERATURE, 40) < 120
    assert 0 < got.get(sm.GPU_POWER, 100) < 2000  # watts, not milliwatts
    del held


# ---- the sampling thread ----------------------------------------------------------------


def test_the_thread_says_once_why_there_is_no_gpu_and_steps_by_second() -> None:
    clock = iter([1000.2, 1000.9, 1001.0, 1002.5, *range(1003, 1100)]).__next__
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    sampler = sm.SystemSampler(pid=p.pid, rank=0, gpu="", interval_s=0.05, clock=clock)
    try:
        sampler.start()
        deadline = time.monotonic() + 5
        rows: list[dict[str, Any]] = []
        while len({r["step"] for r in rows}) < 3 and time.monotonic() < deadline:
            rows += sampler.take()
            time.sleep(0.05)
    finally:
        sampler.stop()
        p.kill()
        p.wait()
    steps = sorted({r["step"] for r in rows})
    assert steps[:3] == [1000, 1001, 1002]  # 1000.9: the same second, skipped
    assert {r["name"] for r in rows} == {"sys/cpu_percent", "sys/rss_bytes"}
    first = [r for r in rows if r["step"] == 1002]
    assert {r["time"] for r in first} == {1002.5} and all(r["epoch"] is None for r in first)
    assert sampler.take_notes() == [
        "===== torchyard: system metrics (rank 0): CPU and memory only, no GPU series: this "
        "worker has no GPU (--device cpu) =====\n"
    ]


def test_an_error_in_sampling_stops_the_thread_and_is_noted_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def broken(self: sm.TreeSampler) -> None:
        calls.append(1)
        raise PermissionError("/proc hidden")

    monkeypatch.setattr(sm.TreeSampler, "sample", broken)
    sampler = sm.SystemSampler(pid=os.getpid(), rank=1, gpu="", interval_s=0.01)
    sampler.start()
    sampler._thread.join(5)
    assert not sampler._thread.is_alive() and calls == [1]
    assert sampler.failed == "PermissionError: /proc hidden"
    notes = sampler.take_notes()
    assert len(notes) == 2 and "sampling stopped for this attempt" in notes[1]
    assert sampler.take() == [] and sampler.take_notes() == []


def test_the_thread_ends_with_its_tree() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    sampler = sm.SystemSampler(pid=p.pid, rank=0, gpu="", interval_s=0.02).start()
    p.wait()  # reaped: its pid leaves /proc
    sampler._thread.join(5)
    assert not sampler._thread.is_alive() and sampler.failed is None


def test_record_samples_keeps_the_jobs_metric_name_rules() -> None:
    rec = EventRecorder("j", 1, 1, limits=EventLimits(metric_name_chars=20, metric_names=3))
    rec.names.update({"train/loss", "val/loss"})
    rows = [
        {"name": n, "step": 7, "epoch": None, "value": 1.0, "time": 7.5}
        for n in ("sys/cpu_percent", "sys/rss_bytes", "sys/rank12/gpu_util_percent")
    ]
    refused: set[str] = set()
    lines = sm.record_samples(rec, rows, refused)
    assert [r["name"] for r in rec.metrics] == ["sys/cpu_percent"]
    assert refused == {"sys/rss_bytes", "sys/rank12/gpu_util_percent"}
    assert len(lines) == 2 and "TORCHYARD_MAX_METRIC_NAMES" in lines[0]
    assert "TORCHYARD_MAX_METRIC_NAME_CHARS" in lines[1]
    assert sm.record_samples(rec, rows, refused) == []  # said once
    assert len(rec.metrics) == 2


def test_names_fit_the_metric_name_rules() -> None:
    from torchyard.contracts.eventmodel import EventLimits, MetricEvent, event_problem

    for m in sm.METRICS:
        for rank in (0, 1, 4095):
            name = sm.series_name(m, rank)
            assert len(name) <= EventLimits().metric_name_chars
            # A trainer's event may not write them: only the worker measures them.
            ev = MetricEvent(type="metric", name=name, step=1, value=1.0)
            assert "the worker's system metrics" in (event_problem(ev) or "")
    assert sm.series_name(sm.GPU_UTIL, 1) == "sys/rank1/gpu_util_percent"


# ---- through the supervisor into the store ----------------------------------------------

HOLDER = (
    "import subprocess, sys\n"
    "subprocess.run([sys.executable, '-c', 'b = b\"1\" * (64 << 20); import time; time.sleep(3.2)'])\n"
)  # fmt: skip


def _supervise(settings: Settings, claimed: Claimed, out: dict[int, int]) -> None:
    sup = Supervision(WorkerContext(settings, f"w{claimed.rank}", Device("cpu", None, "cpu", None),
                                    "127.0.0.1"), claimed)  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], start_new_session=True)
    sup.trainer = LocalTrainer(proc, sup.log_path, None)
    sup.tail = EventTail(sup.events_path, 0)
    out[claimed.rank] = sup.supervise()


def test_the_supervisor_writes_each_ranks_samples_to_the_store(db_url: str, tmp_path: Path) -> None:
    """Rank 0 flushes the samples with its events batch, rank 1 (no events) on the same
    cadence and once at the end; both through the fenced write, by whole seconds."""
    settings = Settings(_env_file=None, database_url=db_url, home=tmp_path,  # type: ignore[call-arg]
                        sys_metrics_interval_s=1)  # fmt: skip
    with session_scope(db_url) as s:
        make_worker(s, "w0")
        make_worker(s, "w1")
        job = make_job(s, world_size=2)
        job_id = job.id
        schedule(s, heartbeat_timeout_s=10)
        a_id = s.scalars(select(Attempt.id).where(Attempt.job_id == job_id)).one()
        assignments = s.execute(
            select(Assignment.rank, Assignment.id).where(Assignment.attempt_id == a_id)
        ).all()
    run_dir = job_dir(settings.storage, job_id)
    run_dir.mkdir(parents=True)
    (run_dir / EVENTS_FILE).touch()
    out: dict[int, int] = {}
    claims = [
        Claimed(aid, a_id, 1, job_id, rank, 2, {}, False) for rank, aid in sorted(assignments)
    ]
    other = threading.Thread(target=_supervise, args=(settings, claims[1], out))
    other.start()
    _supervise(settings, claims[0], out)
    other.join(30)
    assert out == {0: 0, 1: 0}
    with session_scope(db_url) as s:
        rows = s.execute(
            select(Metric.name, Metric.step, Metric.value, Metric.time).where(Metric.job_id == job_id)
        ).all()  # fmt: skip
    by_name: dict[str, list[Any]] = {}
    for name, step, value, when in rows:
        by_name.setdefault(name, []).append((step, value, when))
    assert set(by_name) == {"sys/cpu_percent", "sys/rss_bytes", "sys/rank1/cpu_percent",
                            "sys/rank1/rss_bytes"}  # fmt: skip
    for points in by_name.values():
        assert len(points) >= 2
        assert all(step == math.floor(when) for step, _, when in points)
        assert abs(points[-1][2] - time.time()) < 60
    for name in ("sys/rss_bytes", "sys/rank1/rss_bytes"):
        assert max(v for _, v, _ in by_name[name]) >= 64 * MIB  # the grandchild's bytes
    log = (run_dir / LOG_FILE).read_text()
    assert log.count("no GPU series: this worker has no GPU") == 2  # once per rank
