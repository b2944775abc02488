"""`make run`: one command that brings the whole console up on this machine, and down again.

Starts the embedded PostgreSQL/Redis when DATABASE_URL / REDIS_URL are unset, migrates,
creates the roles and (with DEBUG on) the demo tenants and users, then runs the web server,
one Celery worker and Celery beat. Ctrl-C stops every child and the servers it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from console import embedded
from console.env import BASE_DIR, CONFIG_ERROR_EXIT, DEVSERVER_STATE, VAR_DIR, ConfigError


def _say(message: str) -> None:
    try:
        print(f"[run] {message}", flush=True)
    except OSError:
        # The terminal is gone (SIGHUP; writes to it now fail with EIO): the stop that
        # follows must still run.
        pass


def _manage(*args: str) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=BASE_DIR, check=True)


def _start(name: str, argv: list[str]) -> subprocess.Popen:
    _say(f"starting {name}: {' '.join(argv)}")
    # Each child leads its own process group so a stop reaches its own children too
    # (the Celery pool, the autoreloader) and none outlives us.
    return subprocess.Popen(argv, cwd=BASE_DIR, start_new_session=True)


def _stop(children: dict[str, subprocess.Popen]) -> None:
    for proc in children.values():
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 15
    for name, proc in children.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _say(f"{name} did not stop in time; killing it")
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _worker_concurrency() -> str:
    # Checked before anything starts: Celery refuses a bad value only after the database
    # was migrated and the web server and beat were up, with its own usage text.
    raw = os.environ.get("WORKER_CONCURRENCY", "4")
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"WORKER_CONCURRENCY={raw!r} is not a whole number") from None
    if not 0 < value <= 1_000_000_000:  # the README's bounds for a count
        raise ConfigError(
            f"WORKER_CONCURRENCY={raw!r} must be a whole number above 0, at most 1000000000"
        )
    return str(value)


def _forget_port() -> None:
    # Only our own record: a second `make run` that failed (its port taken) must not take
    # away the first one's.
    try:
        if json.loads(DEVSERVER_STATE.read_text()).get("pid") == os.getpid():
            DEVSERVER_STATE.unlink()
    except (OSError, ValueError):
        pass


def main() -> int:
    port = os.environ.get("PORT", "8000")
    try:
        concurrency = _worker_concurrency()
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    started: list[str] = []
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def request_stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    # Closing the terminal or losing SSH sends SIGHUP instead of Ctrl-C's SIGINT. Its default
    # kills us before the `finally`, and the children, in sessions of their own, never get
    # it: web, worker, beat and the embedded servers would run on as orphans.
    signal.signal(signal.SIGHUP, request_stop)
    try:
        try:
            _, started = embedded.services_up()
        except embedded.EmbeddedUnavailable as exc:
            print(f"[embedded] {exc}", file=sys.stderr)
            return 3
        if started:
            _say("embedded " + ", ".join(started) + f" running under {VAR_DIR}")
        _manage("migrate", "--no-input")
        _manage("setup_roles")
        if os.environ.get("DEBUG", "").lower() in {"1", "true", "yes", "on"}:
            _manage("demo_setup")
        python = sys.executable
        children["web"] = _start(
            "web", [python, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"]
        )
        children["worker"] = _start(
            "worker",
            [python, "-m", "celery", "-A", "console", "worker", "--loglevel", "INFO",
             "--pool", "threads", "--concurrency", concurrency],
        )
        children["beat"] = _start(
            "beat", [python, "-m", "celery", "-A", "console", "beat", "--loglevel", "INFO"]
        )
        VAR_DIR.mkdir(exist_ok=True)
        DEVSERVER_STATE.write_text(json.dumps({"port": port, "pid": os.getpid()}))
        _say(f"console on http://127.0.0.1:{port}/ — Ctrl-C stops everything")
        failed = 0
        while not stopping:
            for name, proc in children.items():
                if proc.poll() is not None:
                    _say(f"{name} exited with {proc.returncode}; stopping the rest")
                    # A process that died on its own (port taken, bad config) is a failure
                    # make should report; Ctrl-C, which sets `stopping`, is not.
                    failed = proc.returncode or 1
                    stopping = True
                    break
            time.sleep(0.5)
        return failed
    except subprocess.CalledProcessError as exc:
        _say(f"setup step failed: {' '.join(map(str, exc.cmd))}")
        return exc.returncode or 1
    finally:
        _say("stopping")
        _forget_port()
        _stop(children)
        if started:
            embedded.services_down(started)
            _say("stopped embedded " + ", ".join(started))


if __name__ == "__main__":
    sys.exit(main())
