"""The deployment tests reuse the worker tests' cluster (tests/worker/worker_cluster.py) and
the fault suite's private PostgreSQL and Redis (tests/chaos/services.py)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for d in (HERE, HERE.parent / "worker", HERE.parent / "chaos"):
    sys.path.insert(0, str(d))
