"""The worker's one rule for files (storage/beneath.py): every read, write, copy, link,
rename or delete it makes under a folder a job can write goes through that module, by
descriptor, never by a path a job could swap for a link.

This test reads `worker/` with `ast` and lists every file operation by name (`open`,
`os.open`, `shutil.*`, `os.replace`, `Path.write_text`, …). Each must be on the list
below, with the reason it is not under a job's folder; anything else fails, so a new one
is either moved into storage/beneath.py or justified here."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

OS_CALLS = {"open", "replace", "rename", "link", "symlink", "unlink", "remove", "rmdir",
            "chown", "chmod", "mkdir", "makedirs", "truncate", "utime", "lchown"}  # fmt: skip
PATH_METHODS = {"open", "write_text", "write_bytes", "read_text", "read_bytes", "unlink",
                "mkdir", "rmdir", "rename", "replace", "symlink_to", "hardlink_to", "touch",
                "chmod"}  # fmt: skip
SHUTIL = {"copy", "copy2", "copyfile", "copytree", "rmtree", "move", "copyfileobj", "chown"}

_CGROUPFS = "cgroupfs (/sys/fs/cgroup): the kernel's files and the worker's own cgroup folders"
_PROC = "/proc: the kernel's files"
_HOME = "under TORCHYARD_HOME: the worker's own folder (0700), no job writes there"
_INIT = "the worker's init cache under TORCHYARD_HOME (0700), no job writes there"
_RUNS = "the runs root or a run dir itself: its parents are the worker's, no job names them"

# (file, function, operation) -> why its folder is not one a job can write.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("cgroups.py", "_pids", "Path.read_text"): _CGROUPFS,
    (
        "cgroups.py",
        "find_cgroup",
        "Path.read_text",
    ): "/proc/self/cgroup and mountinfo: the kernel's files",
    ("cgroups.py", "_read", "Path.read_text"): _CGROUPFS,
    ("cgroups.py", "_write", "os.open"): _CGROUPFS,
    ("cgroups.py", "_delegate_memory", "Path.mkdir"): _CGROUPFS,
    ("cgroups.py", "create", "Path.mkdir"): _CGROUPFS,
    ("cgroups.py", "create", "Path.rmdir"): _CGROUPFS,
    ("cgroups.py", "limit_pids", "Path.mkdir"): _CGROUPFS,
    ("cgroups.py", "limit_pids", "Path.rmdir"): _CGROUPFS,
    ("cgroups.py", "enter", "os.open"): _CGROUPFS,
    ("cgroups.py", "remove", "Path.rmdir"): _CGROUPFS,
    ("cgroups.py", "sweep_stale", "Path.rmdir"): _CGROUPFS,
    ("identity.py", "cpu_device", "Path.read_text"): "/proc/cpuinfo",
    ("inputs.py", "_private_copy", "Path.mkdir"): _INIT,
    ("inputs.py", "_private_copy", "os.utime"): _INIT,
    ("inputs.py", "_private_copy", "os.replace"): _INIT,
    ("inputs.py", "_private_copy", "Path.unlink"): _INIT,
    ("inputs.py", "_evict", "os.unlink"): _INIT,
    ("launch_local.py", "oom_kills", "Path.read_text"): "/proc/vmstat",
    ("launch_sandbox.py", "__init__", "Path.mkdir"): _HOME,
    (
        "launch_sandbox.py",
        "_slot_dir",
        "Path.mkdir",
    ): "the slot's staging folder under TORCHYARD_HOME/sandbox (0700), emptied by descriptor first",
    ("launch_sandbox.py", "_start_standby", "Path.mkdir"): _RUNS,
    ("publish.py", "_open_log", "Path.mkdir"): _RUNS,
    ("publish.py", "align_events", "Path.mkdir"): _RUNS,
    ("runfiles.py", "write_spec_file", "Path.mkdir"): _RUNS,
    ("sandbox.py", "_has_mqueue", "Path.read_text"): "/proc/filesystems",
    (
        "sandbox.py",
        "sandbox_argv",
        "Path.mkdir",
    ): "the data root: the admin's folder, read-only inside every sandbox",
    (
        "sandbox.py",
        "sandbox_argv",
        "os.chmod",
    ): "the data root: the admin's folder, read-only inside every sandbox",
    ("slurm.py", "slurm_main", "Path.mkdir"): "the Slurm log folder the admin configured",
    ("sysmetrics.py", "scan", "open"): "/proc/<pid>/stat",
    ("watchdog.py", "__init__", "Path.mkdir"): _HOME
    + " (leases; bound read-only into the sandbox)",
    ("watchdog.py", "__init__", "Path.touch"): _HOME + " (the lease file, read-only inside)",
    ("watchdog.py", "check", "os.utime"): _HOME + " (the lease file, read-only inside)",
    ("watchdog.py", "stop", "Path.unlink"): _HOME + " (the lease file, read-only inside)",
    ("watchdog.py", "stop", "Path.rmdir"): _HOME + " (the lease folder)",
    ("zygote.py", "children", "Path.read_text"): _PROC,
    ("zygote.py", "stopped", "Path.read_text"): _PROC,
    ("zygote.py", "_dead", "Path.read_text"): _PROC,
    ("zygote.py", "_inner_pid", "Path.read_text"): _PROC,
}


def _operations(path: Path) -> list[tuple[str, str, int]]:
    """(function, operation, line) of each file operation in `path`."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if isinstance(child, ast.Call):
                op = _operation(child.func)
                if op is not None:
                    found.append((name, op, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def _operation(f: ast.expr) -> str | None:
    if isinstance(f, ast.Name) and f.id == "open":
        return "open"
    if not isinstance(f, ast.Attribute):
        return None
    base = f.value
    if isinstance(base, ast.Name) and base.id == "os" and f.attr in OS_CALLS:
        return f"os.{f.attr}"
    if isinstance(base, ast.Name) and base.id == "shutil" and f.attr in SHUTIL:
        return f"shutil.{f.attr}"
    if isinstance(base, ast.Name) and base.id in ("os", "shutil", "beneath", "self", "cls"):
        return None
    if f.attr in PATH_METHODS and f.attr not in ("replace", "open"):
        return f"Path.{f.attr}"
    if f.attr == "open" and not (isinstance(base, ast.Name) and base.id[0].isupper()):
        return "Path.open"
    return None


def test_every_file_operation_of_the_worker_is_through_beneath_or_justified() -> None:
    seen: set[tuple[str, str, str]] = set()
    stray = []
    for path in sorted((REPO / "worker").glob("*.py")):
        for func, op, line in _operations(path):
            key = (path.name, func, op)
            seen.add(key)
            if key not in ALLOWED:
                stray.append(f"worker/{path.name}:{line} {func}: {op}")
    assert not stray, (
        "file operations outside storage/beneath.py (move them there, or add them to "
        "ALLOWED with the reason their folder is not a job's):\n" + "\n".join(stray)
    )
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"ALLOWED names operations that are gone: {stale}"


def test_the_rule_sees_the_operations_it_lists(tmp_path: Path) -> None:
    """The scanner itself: each kind of call is found, and beneath's own are not."""
    src = tmp_path / "m.py"
    src.write_text(
        "import os, shutil\n"
        "def f(p, d):\n"
        "    open(p)\n    os.open(p, 0)\n    shutil.copyfile(p, d)\n    os.replace(p, d)\n"
        "    p.write_text('x')\n    p.open('rb')\n    p.unlink()\n"
        "    beneath.open_file(d, 'x')\n    'a'.replace('a', 'b')\n"
    )
    ops = [op for _, op, _ in _operations(src)]
    assert ops == ["open", "os.open", "shutil.copyfile", "os.replace", "Path.write_text",
                   "Path.open", "Path.unlink"]  # fmt: skip
