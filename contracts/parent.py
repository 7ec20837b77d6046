"""Dying with the parent: Linux's parent-death signal (prctl PR_SET_PDEATHSIG), stdlib only.

The trainer asks for it itself (trainer/cli.py, TORCHYARD_DIE_WITH_PARENT=1); a process that
starts children can call it between fork and exec (`preexec_fn`), so it imports nothing but
the standard library and loads libc once, at import, not in the forked child.

The signal follows the parent *thread* that forked the child, and a parent that died before
the call is not noticed: callers compare `os.getppid()` with the parent they expect after it.
"""

from __future__ import annotations

import ctypes
import sys

PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int) -> bool:
    """Have the kernel send `sig` to this process when its parent dies. True when it is set;
    False off Linux or when prctl refuses."""
    if _libc is None:
        return False
    return _libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
