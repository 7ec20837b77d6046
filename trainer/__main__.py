"""`python -m torchyard.trainer …` / `torchrun … -m torchyard.trainer …`: see trainer/cli.py."""

import os
import sys

if sys.argv[1:] == ["--standby"]:  # the worker's warm trainer: trainer/standby.py
    from torchyard.trainer.standby import main
elif sys.argv[1:] == ["--zygote"]:  # the sandboxed slot's warm trainer: trainer/zygote.py
    from torchyard.trainer.zygote import main
else:
    from torchyard.trainer.cli import main

from torchyard.trainer import cli

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1 or not cli.ran_user_script:
    # Skip interpreter finalisation. Under DDP a gloo/c10d C++ thread destroyed during it
    # intermittently aborts the process ("terminate called without an active exception",
    # SIGABRT) after all work is done, which torchrun reports as a failed run; for one rank
    # it costs 1-2 s (torch's teardown) between the last event and the exit, which every
    # job, and each trial of a sweep, would wait for. Everything the run produced is already
    # fsynced (events are flushed line by line) and the process group destroyed by now. A
    # script job exits normally: its own code may still hold files it never closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
