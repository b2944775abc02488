"""`make run` (console.devserver): what it starts, and that it leaves nothing running.

devserver runs in a process of its own, as under make. Its children are stand-ins
(sleeping processes in sessions of their own, as the real ones) and the embedded servers and
setup steps are stubs that only say they ran: nothing real is started or touched.
"""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BASE_DIR = Path(__file__).resolve().parents[2]

DRIVER = r"""
import pathlib, subprocess, sys
from console import devserver, embedded

state_dir = pathlib.Path(sys.argv[1])
devserver.VAR_DIR = state_dir
devserver.DEVSERVER_STATE = state_dir / "devserver.json"

def services_up():
    print("services up", flush=True)
    return {}, []

# The worker's stand-in refuses a concurrency that is no whole number above 0 with status 2,
# as Celery does `abc` (its usage error).
SLEEP = "import sys, time; n = sys.argv[1]; time.sleep(120) if n.isdigit() and int(n) else exit(2)"

def stand_in(name, argv):
    concurrency = argv[argv.index("--concurrency") + 1] if name == "worker" else "1"
    proc = subprocess.Popen([sys.executable, "-c", SLEEP, concurrency], start_new_session=True)
    print(f"child {name} {proc.pid}", flush=True)
    return proc

embedded.services_up = services_up
devserver._manage = lambda *args: print("manage", *args, flush=True)
devserver._start = stand_in
sys.exit(devserver.main())
"""


def start_devserver(tmp_path: Path, **env_overrides: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "WORKER_CONCURRENCY"}}
    env.update(env_overrides)
    # A session of its own: the test signals its group as a terminal signals its
    # foreground group.
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path)], cwd=BASE_DIR, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def running(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"  # an orphan zombie nobody reaps is not running


def kill_all(devserver: subprocess.Popen, children: list[int]) -> None:
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if devserver.poll() is None:
        os.killpg(devserver.pid, signal.SIGKILL)
        devserver.wait()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM],
                         ids=["ctrl-c", "terminal-closed", "terminated"])
def test_it_stops_web_worker_and_beat_however_its_terminal_goes(tmp_path, signum):
    """The children lead sessions of their own, so only devserver can stop them. Closing
    the terminal or losing SSH sends SIGHUP where Ctrl-C sends SIGINT: it killed devserver
    before its `finally`, and web, worker, beat (and the embedded servers) stayed up, the
    next `make run` failing on the port while the orphaned worker and beat kept working."""
    devserver = start_devserver(tmp_path)
    children: list[int] = []
    try:
        for line in devserver.stdout:
            if line.startswith("child "):
                children.append(int(line.split()[2]))
            if "Ctrl-C stops everything" in line:
                break
        assert len(children) == 3
        time.sleep(0.5)  # in devserver's wait loop
        os.killpg(devserver.pid, signum)
        assert devserver.wait(timeout=30) == 0
        assert "[run] stopping" in devserver.stdout.read()
        time.sleep(0.2)
        assert [pid for pid in children if running(pid)] == []
        assert not (tmp_path / "devserver.json").exists()
    finally:
        kill_all(devserver, children)


@pytest.mark.parametrize("concurrency", ["abc", "0", "-4", "2.5"])
def test_it_refuses_a_bad_worker_concurrency_before_starting_anything(tmp_path, concurrency):
    """Celery refused it only after the migration, with web and beat already up (its usage
    text, exit status 2): the README's rule is one line naming the variable, status 3."""
    devserver = start_devserver(tmp_path, WORKER_CONCURRENCY=concurrency)
    children: list[int] = []
    try:
        output = ""
        for line in devserver.stdout:
            output += line
            if line.startswith("child "):
                children.append(int(line.split()[2]))
        devserver.wait(timeout=30)
    finally:
        kill_all(devserver, children)
    assert devserver.returncode == 3, output
    assert output.startswith(f"configuration error: WORKER_CONCURRENCY={concurrency!r} ")
    assert output.count("\n") == 1  # nothing started, migrated or stopped


def test_it_stops_everything_when_its_terminal_is_closed(tmp_path):
    """As a closed window or a lost SSH connection does: devserver's terminal goes away
    (SIGHUP to its foreground group, and every later write to it fails), and the stop
    must still reach every child."""
    env = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "WORKER_CONCURRENCY"}}
    pid, terminal = pty.fork()
    if pid == 0:  # the child: devserver, with the pty as its controlling terminal
        os.chdir(BASE_DIR)
        os.execve(sys.executable, [sys.executable, "-c", DRIVER, str(tmp_path)], env)
    children: list[int] = []
    try:
        output = b""
        while b"Ctrl-C stops everything" not in output:
            chunk = os.read(terminal, 4096)
            assert chunk, output
            output += chunk
        children = [int(line.split()[2]) for line in output.decode().splitlines()
                    if line.startswith("child ")]
        assert len(children) == 3
        time.sleep(0.5)  # in devserver's wait loop
        os.close(terminal)
        terminal = -1
        deadline = time.monotonic() + 30
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            assert time.monotonic() < deadline, "devserver did not end"
            time.sleep(0.1)
        time.sleep(0.2)
        assert [child for child in children if running(child)] == []
        assert not (tmp_path / "devserver.json").exists()
    finally:
        if terminal != -1:
            os.close(terminal)
        for child in children:
            try:
                os.killpg(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        except ProcessLookupError:
            pass
