"""`python -m torchyard.trainer …` / `torchrun … -m torchyard.trainer …`: see trainer/cli.py."""

import os
import sys

if sys.argv[1:] == ["--standby"]:  # the worker's warm trainer: trainer/standby.py
    from torchyard.trainer.standby import main
else:
    from torchyard.trainer.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # Under DDP, skip interpreter finalisation: a gloo/c10d C++ thread destroyed during it
    # intermittently aborts the process ("terminate called without an active exception",
    # SIGABRT) after all work is done, which torchrun reports as a failed run. Everything
    # the run produced is already fsynced and the process group destroyed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
