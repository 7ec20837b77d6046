"""Where the client finds the server and its token, and the per-user login file.

First hit wins, URL and token each (the README's "The CLI" and every `--help` say the same):

1. `--url` / `--token` (the SDK: `Client(url, token)`)
2. `TORCHYARD_URL` / `TORCHYARD_TOKEN`
3. the login file that `torchyard login` (and `torchyard up`) write: `$TORCHYARD_CONFIG`, else
   `$XDG_CONFIG_HOME/torchyard/config.json`, else `~/.config/torchyard/config.json`
4. the files `torchyard up` writes in `$TORCHYARD_HOME` (default `./.torchyard`): `url`,
   `admin-token`
5. `http://127.0.0.1:8000`, without a token

A `TORCHYARD_TOKEN` that is set but empty is an error, never a reason to use a saved token.

A saved token (3, 4) is sent only to the URL saved with it, so a `--url` naming another server
never carries it there. Standard library only: `torchyard up` writes the file through here.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torchyard.client.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8000"
CONFIG_ENV = "TORCHYARD_CONFIG"
LOOKUP_ORDER = (
    "--url/--token, then TORCHYARD_URL/TORCHYARD_TOKEN, then the login file "
    "(torchyard login; $TORCHYARD_CONFIG, else ~/.config/torchyard/config.json), "
    "then $TORCHYARD_HOME/url and admin-token (torchyard up; default ./.torchyard), "
    f"then {DEFAULT_URL}; a saved token goes only to the URL saved with it"
)
LOGIN_HOW = "`torchyard login URL --token T`"


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV])
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base) / "torchyard" / "config.json"


def torchyard_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("TORCHYARD_HOME") or ".torchyard")


@dataclass(frozen=True)
class Saved:
    """What the login file holds: a URL, its token, and who wrote it (`login` or `up`)."""

    url: str
    token: str
    saved_by: str
    path: Path


def load(env: Mapping[str, str] | None = None) -> Saved | None:
    """The login file, or None when there is none. A file that is there but unreadable is an
    error rather than silently skipped: the client would otherwise reach another server."""
    path = config_path(env)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"cannot read the login file {path}: {e.strerror or e}") from None
    try:
        obj = json.loads(text)
        url, token = str(obj["url"]), str(obj["token"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{path} is not a torchyard login file ({type(e).__name__}: {e}); "
            f"run {LOGIN_HOW} again, or delete it"
        ) from None
    return Saved(normal_url(url), token, str(obj.get("saved_by") or "login"), path)


def save(url: str, token: str, *, saved_by: str, env: Mapping[str, str] | None = None) -> Path:
    """Write the login file atomically. mkstemp creates the temporary file with mode 0600
    before a byte of the token is in it, and the rename keeps that mode: never a moment
    when another user could read it."""
    path = config_path(env)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    body = json.dumps({"url": normal_url(url), "token": token, "saved_by": saved_by}, indent=2)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def normal_url(url: str) -> str:
    return url.strip().rstrip("/")


@dataclass(frozen=True)
class Connection:
    """The URL and token a client uses, where each came from, and what the places it looked
    at held: what the "cannot reach" and 401 messages tell the user."""

    url: str
    token: str | None
    url_from: str
    token_from: str | None
    url_looked: tuple[str, ...] = ()
    token_looked: tuple[str, ...] = ()

    def unreachable_hint(self) -> str:
        if self.url_from == "the default":
            return (
                f"no URL in {', '.join(self.url_looked)}, so the default: start "
                f"`torchyard up`, or name the server with --url, TORCHYARD_URL or {LOGIN_HOW}"
            )
        return (
            f"the URL came from {self.url_from}: is the server running there? Another one: "
            f"--url, TORCHYARD_URL or {LOGIN_HOW}"
        )

    def token_hint(self) -> str:
        if self.token_from is not None:
            return f"the token came from {self.token_from}; another one: --token or {LOGIN_HOW}"
        return (
            f"no token for {self.url} in {', '.join(self.token_looked)}; give one with "
            f"--token, TORCHYARD_TOKEN or {LOGIN_HOW}"
        )


def resolve(
    url: str | None = None,
    token: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    given: tuple[str, str] = ("--url", "--token"),
) -> Connection:
    """The URL and token by the lookup order above. `given` names the explicit values in
    messages (`--url` for the CLI, the argument for the SDK)."""
    env = os.environ if env is None else env
    if not token and "TORCHYARD_TOKEN" in env and not env["TORCHYARD_TOKEN"].strip():
        # Never fall through to a saved (perhaps an admin's) token: the user meant one.
        raise ConfigError(
            "TORCHYARD_TOKEN is set but empty: give it a token, or `unset TORCHYARD_TOKEN` "
            "to use the saved login"
        )
    explicit = (url or env.get("TORCHYARD_URL")) and (token or env.get("TORCHYARD_TOKEN"))
    # Nothing to look up: a broken login file must not stop a command that does not need it.
    saved, cfg = None if explicit else load(env), config_path(env)
    home = torchyard_home(env)
    home_url = _first_line(home / "url")
    by = f"saved by `torchyard {saved.saved_by}`" if saved else "absent"
    urls = [
        (url, given[0], given[0]),
        (env.get("TORCHYARD_URL"), "TORCHYARD_URL", "TORCHYARD_URL"),
        (saved and saved.url, f"{cfg} ({by})", f"{cfg} ({by})"),
        (home_url, f"{home / 'url'} (written by `torchyard up`)", f"{home / 'url'} (absent)"),
        (DEFAULT_URL, "the default", ""),
    ]
    n = next(i for i, (u, _, _) in enumerate(urls) if u)
    chosen, url_from = normal_url(str(urls[n][0])), urls[n][1]
    url_looked = tuple(place for _, _, place in urls[:n])
    tokens = [
        (token, given[1]),
        (env.get("TORCHYARD_TOKEN"), "TORCHYARD_TOKEN"),
        _saved_token(
            chosen, saved.url if saved else None, saved.token if saved else None, cfg
        ),
        _saved_token(chosen, home_url or DEFAULT_URL, _first_line(home / "admin-token"),
                     home / "admin-token"),
    ]  # fmt: skip
    k = next((i for i, (t, _) in enumerate(tokens) if t), None)
    return Connection(
        chosen,
        None if k is None else tokens[k][0],
        url_from,
        None if k is None else tokens[k][1],
        url_looked,
        tuple(place for _, place in tokens[: len(tokens) if k is None else k]),
    )


def _saved_token(
    url: str, saved_url: str | None, token: str | None, path: Path
) -> tuple[str | None, str]:
    """A saved token when it belongs to `url`, with its place; else None and why not."""
    if not token:
        return None, f"{path} (absent)"
    if normal_url(saved_url or "") != url:
        return None, f"{path} (its token is for {normal_url(saved_url or '')})"
    return token, str(path)


def _first_line(path: Path) -> str | None:
    try:
        lines = path.read_text().strip().splitlines()
    except OSError:
        return None
    return lines[0].strip() if lines else None
