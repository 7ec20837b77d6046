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

# (file, function, operation) -> why it is not under a folder a job can write.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("cgroups.py", "_read", "Path.read_text"): "/sys/fs/cgroup: the kernel's files",
    ("cgroups.py", "pids", "Path.read_text"): "/sys/fs/cgroup: the kernel's files",
    ("cgroups.py", "detect", "Path.read_text"): "/proc/self: the kernel's files",
    ("cgroups.py", "_write", "os.open"): "/sys/fs/cgroup: the kernel's files",
    ("cgroups.py", "leaf", "Path.mkdir"): "a cgroup folder the worker makes in cgroupfs",
    ("cgroups.py", "create", "Path.mkdir"): "a cgroup folder the worker makes in cgroupfs",
    ("cgroups.py", "move", "os.open"): "cgroup.procs in cgroupfs",
    ("identity.py", "_cpu_name", "Path.read_text"): "/proc/cpuinfo",
    ("launch_local.py", "oom_kills", "Path.read_text"): "/proc/vmstat",
    ("launch_sandbox.py", "__init__", "Path.mkdir"): "TORCHYARD_HOME/sandbox: the worker's",
    ("launch_sandbox.py", "_slot_dir", "Path.mkdir"): "the slot's staging folder (0700)",
    ("launch_sandbox.py", "_start_standby", "Path.mkdir"): "the runs root, above any job",
    ("inputs.py", "_private_copy", "Path.mkdir"): "TORCHYARD_HOME/cache/init: the worker's",
    ("inputs.py", "_private_copy", "os.replace"): "within the worker's init cache",
    ("inputs.py", "_private_copy", "Path.unlink"): "within the worker's init cache",
    ("inputs.py", "_evict", "os.unlink"): "within the worker's init cache",
    ("inputs.py", "_evict", "os.utime"): "within the worker's init cache",
    ("inputs.py", "_private_copy", "os.utime"): "within the worker's init cache",
    ("publish.py", "_open_log", "Path.mkdir"): "the run dir itself (its parents are the worker's)",
    (
        "publish.py",
        "align_events",
        "Path.mkdir",
    ): "the run dir itself (its parents are the worker's)",
    (
        "runfiles.py",
        "write_spec_file",
        "Path.mkdir",
    ): "the run dir itself (its parents are the worker's)",
    ("sandbox.py", "sandbox_argv", "Path.mkdir"): "the data root: the admin's, read-only inside",
    ("sandbox.py", "sandbox_argv", "os.chmod"): "the data root: the admin's, read-only inside",
    ("slurm.py", "submit", "Path.mkdir"): "the Slurm log folder under TORCHYARD_HOME",
    ("sysmetrics.py", "_proc_cpu", "open"): "/proc/<pid>/stat",
    ("watchdog.py", "__init__", "Path.mkdir"): "TORCHYARD_HOME/leases: the worker's",
    ("watchdog.py", "stop", "Path.unlink"): "the lease file under TORCHYARD_HOME",
    ("zygote.py", "children", "Path.read_text"): "/proc",
    ("zygote.py", "_zombie", "Path.read_text"): "/proc",
    ("zygote.py", "_state", "Path.read_text"): "/proc",
    ("zygote.py", "host_pid_of", "Path.read_text"): "/proc",
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
