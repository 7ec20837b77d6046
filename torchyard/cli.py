"""`torchyard <command> …`: each command lives in the package it belongs to and is
imported only when run, so `torchyard status` never loads torch or the server."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

# command -> (module, function, one-line help). Each function takes argv (after the command).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("torchyard.up", "main", "start the API, the scheduler and N workers in one command"),
    "api": ("torchyard.api.cli", "main", "serve the REST API"),
    "scheduler": (
        "torchyard.scheduler.cli",
        "main",
        "run the scheduler (control queue consumer)",
    ),
    "worker": (
        "torchyard.worker.cli",
        "worker_main",
        "run one worker pinned to a GPU (or --device cpu)",
    ),
    "slurm": (
        "torchyard.worker.slurm",
        "slurm_main",
        "submit workers as Slurm jobs (sbatch; one GPU each, or --device cpu)",
    ),
    "db": ("torchyard.store.cli", "db_main", "database administration: `db upgrade`"),
    "data": (
        "torchyard.store.dataimport",
        "data_main",
        "data sets: `data upload DIR --name NAME` (ImageFolder, to the server over the "
        "API); on the server host: `data import NAME FILE…` (official archives), `data list`",
    ),
    "token": (
        "torchyard.client.cli",
        "main",
        "API tokens over the API: `token list`, `token create --user NAME` (admins), "
        "`token revoke ID`; the first admin's: `token create --local --user NAME --admin`",
    ),
    "user": (
        "torchyard.client.cli",
        "main",
        "users (admins): `user set NAME [--admin|--no-admin] [--code|--no-code]`, "
        "`user link NAME SUBJECT` (a single sign-on account)",
    ),
    "submit": ("torchyard.client.cli", "main", "submit a job spec (JSON or YAML)"),
    "status": ("torchyard.client.cli", "main", "show a job"),
    "list": ("torchyard.client.cli", "main", "list jobs"),
    "cancel": ("torchyard.client.cli", "main", "cancel a job"),
    "logs": ("torchyard.client.cli", "main", "show a job's log"),
    "metrics": ("torchyard.client.cli", "main", "show a job's metrics"),
    "download": ("torchyard.client.cli", "main", "download a checkpoint"),
    "artifacts": ("torchyard.client.cli", "main", "list a job's artifacts, or download one"),
    "tag": ("torchyard.client.cli", "main", "add or remove a job's tags"),
    "note": ("torchyard.client.cli", "main", "set a job's note"),
    "archive": ("torchyard.client.cli", "main", "hide a job from default lists (--undo)"),
    "delete": ("torchyard.client.cli", "main", "delete an ended job and its files"),
    "rerun": ("torchyard.client.cli", "main", "submit a job again, with --set changes"),
    "workers": ("torchyard.client.cli", "main", "list workers"),
    "sweep": (
        "torchyard.client.cli",
        "main",
        "hyperparameter sweeps: create, status, list, cancel",
    ),
    "quota": ("torchyard.client.cli", "main", "show or set a user's quota (setting: admins)"),
    "queue": ("torchyard.client.cli", "main", "queued jobs in the order they would start"),
    "project": (
        "torchyard.client.cli",
        "main",
        "projects: `project create|list|show NAME`, `project add|remove NAME USER [--role R]`",
    ),
    "audit": (
        "torchyard.client.cli",
        "main",
        "the audit trail: who changed what, when, from where (admins; project owners)",
    ),
    "webhook": (
        "torchyard.client.cli",
        "main",
        "webhooks: `webhook create URL --event E …`, `webhook list`, `webhook delete ID`, "
        "`webhook deliveries ID`",
    ),
    "ui": (
        "torchyard.client.ui_cmd",
        "main",
        "print (and open, honouring BROWSER) a URL that logs the dashboard in, once",
    ),
    "login": (
        "torchyard.client.cli",
        "main",
        "check and save a server's URL and token for every command: "
        "`login URL [--token T | --sso]`",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: torchyard <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {h}" for name, (_, _, h) in COMMANDS.items()]
    lines += ["", "`torchyard <command> --help` for a command's options; "
              "`torchyard --version` for the version."]  # fmt: skip
    return "\n".join(lines)


def version() -> str:
    """The installed package's version, from its metadata (pyproject.toml's, as installed)."""
    try:
        return importlib.metadata.version("torchyard")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, never installed
        return "unknown (not installed)"


def data_over_api(rest: list[str]) -> bool:
    """`data upload …` goes to the server over the API (client/cmd_data.py) unless
    `--local` or `--data-root` asks for this host's data root (store/dataimport.py): a
    local copy from a work folder would land in its `./.torchyard/data`, where no job looks."""
    if "--local" in rest or any(a.split("=")[0] == "--data-root" for a in rest):
        return False
    words = [a for a in rest if not a.startswith("-")]
    return bool(words) and words[0] == "upload"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("--version", "-V"):
        print(f"torchyard {version()}")
        return 0
    cmd = argv[0]
    if cmd not in COMMANDS:
        print(f"torchyard: unknown command '{cmd}'\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[cmd]
    if cmd == "token" and "--local" in argv:  # the first admin: straight into the database
        module, func, argv = (
            "torchyard.store.cli",
            "token_main",
            [a for a in argv if a != "--local"],
        )
    if cmd == "data" and data_over_api(argv[1:]):
        module, func = "torchyard.client.cli", "main"
    fn = getattr(importlib.import_module(module), func)
    # Client commands parse the command name themselves; server commands get the rest.
    rc = fn(argv) if module == "torchyard.client.cli" else fn(argv[1:])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
