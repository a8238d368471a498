"""Processes started from an interpreter that has already imported flowalign, for the tests that run
``python -m flowalign ...`` (or another module) as a process of its own.

A fresh interpreter spends ~8 s of CPU importing torch, diffusers, transformers and peft before a tiny run's
second of work, and the suite starts about a hundred of them. :class:`WarmStarter` keeps one server process per
test worker that has imported them once; each launch forks it. The child is a real process with its own pid,
signals, stdout pipe, environment and exit status, running ``runpy.run_module(MODULE)`` as ``python -m MODULE``
would, so a test holds it like a ``subprocess.Popen`` (:class:`WarmProcess`). What needs a fresh interpreter
(import checks, memory peaks, ``torchrun``'s own agent) still starts one.

The server: ``python -m tests.warm_start FD`` with a socket as file descriptor FD. It imports, then answers requests
``{"module", "args", "env", "cwd"}`` carrying the child's stdout as a passed file descriptor, replying
``{"pid"}``, and later ``{"pid", "status"}`` when that child ends. It is single-threaded (SIGCHLD wakes its
loop), so a fork copies no other thread's locks, and it ends when its socket closes.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
#: the environment of every run process the tests start: one thread, MKL's reproducible kernels (otherwise MKL
#: picks kernels by memory alignment and results differ between processes in the 7th digit), no hub access.
#: The server imports torch under it, so its children share it: a request may add to it, not change it.
RUN_ENV = {"OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
#: what the runs' processes import; a module the server lacks is imported by the child as usual
PRELOAD = ("flowalign.cli.main", "flowalign.train", "flowalign.trainers", "pipelines", "pipelines.sd3", "pipelines.wan",
           "pipelines.lora",
           "rewards", "rewards.vvr", "diffusers", "transformers", "peft", "accelerate", "safetensors.torch")


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


# --- the server ------------------------------------------------------------------------------------

def _run_child(request: dict[str, Any], out_fd: int, server_fds: list[int]) -> int:
    """In the forked child: run as ``python -m MODULE ARGS``; its exit code. The caller then exits through
    the interpreter's own shutdown (atexit handlers, finalisers), as a fresh process would."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # the server's wake-up pipe is not this process's
        for fd in server_fds:
            os.close(fd)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        # as ``python -u``, which torchrun runs its ranks with: every write reaches the pipe at once
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, errors="backslashreplace")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["args"]]
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as python reports an uncaught exception
        import traceback

        traceback.print_exc()
    return code


def serve(sock: socket.socket) -> None:
    for name in PRELOAD:
        __import__(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up byte is written
    children: set[int] = set()
    buffer = b""
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            ready = [wake_r]
        if wake_r in ready:
            os.read(wake_r, 4096)
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    _send(sock, {"pid": pid, "status": os.waitstatus_to_exitcode(status)})
        if sock in ready:
            try:
                message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
            except ConnectionResetError:
                message, fds = b"", []
            if not message:  # the test worker is gone: end, and the children with it
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
                return
            buffer += message
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request, out_fd = json.loads(line), fds.pop(0)
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    sys.exit(_run_child(request, out_fd, [wake_r, wake_w]))  # unwinds to the interpreter's exit
                os.close(out_fd)
                children.add(pid)
                _send(sock, {"pid": pid})


# --- the client ------------------------------------------------------------------------------------

def run_env(**extra: str) -> dict[str, str]:
    """This process's environment with :data:`RUN_ENV` (and ``extra``) set."""
    return {**os.environ, **RUN_ENV, **extra}


class WarmStarter:
    """The server of this test worker (:func:`starter`); :meth:`start` launches a child."""

    def __init__(self) -> None:
        env = {k: v for k, v in run_env().items() if not k.startswith("PYTEST_")}
        self.sock, theirs = socket.socketpair()
        self.log = tempfile.TemporaryFile()  # the server's own output: an import error, a crash
        self.server = subprocess.Popen([sys.executable, "-m", "tests.warm_start", str(theirs.fileno())], cwd=REPO,
                                       env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                       stdout=self.log, stderr=subprocess.STDOUT)
        theirs.close()
        self.lock = threading.Lock()
        self.statuses: dict[int, int] = {}
        self.started: int | None = None
        self.buffer = b""

    def _read(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for the server's next message and file it."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return
        data = self.sock.recv(1 << 16)
        if not data:
            self.log.seek(0)
            raise RuntimeError(f"the warm-start server ended (exit {self.server.wait()}):\n"
                               + self.log.read().decode(errors="replace")[-3000:])
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            message = json.loads(line)
            if "status" in message:
                self.statuses[message["pid"]] = message["status"]
            else:
                self.started = message["pid"]

    def start(self, module: str, args: list[str], env: dict[str, str], cwd: Path | str = REPO) -> WarmProcess:
        """``python -m MODULE ARGS`` in ``cwd`` with ``env`` (which must hold :data:`RUN_ENV`)."""
        differs = {k for k, v in RUN_ENV.items() if env.get(k) != v}
        if differs:
            raise ValueError(f"a warm-started process shares the server's {sorted(differs)}: use a fresh interpreter")
        read_end, write_end = os.pipe()
        with self.lock:
            self.started = None
            socket.send_fds(self.sock, [json.dumps({"module": module, "args": [str(a) for a in args], "env": env,
                                                    "cwd": str(cwd)}).encode() + b"\n"], [write_end])
            os.close(write_end)
            while self.started is None:
                self._read(None)
            pid = self.started
        return WarmProcess(self, pid, os.fdopen(read_end, "r", errors="replace"))

    def status(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit code (negative: the signal that ended it), waiting up to ``timeout`` (None: for
        ever); None if it still runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                self._read(0)  # what has arrived
                if pid in self.statuses:
                    return self.statuses[pid]
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._read(0.2 if left is None else min(0.2, left))


_STARTER: WarmStarter | None = None


def starter() -> WarmStarter:
    """This test worker's server, started on first use (~8 s, once)."""
    global _STARTER
    if _STARTER is None or _STARTER.server.poll() is not None:
        _STARTER = WarmStarter()
    return _STARTER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, args: list[str], nproc: int, env: dict[str, str] | None = None,
              timeout: float = 600) -> tuple[int, str]:
    """``torchrun --standalone --nproc_per_node NPROC -m MODULE ARGS`` with warm-started ranks: the rank
    variables torchrun sets, the first rank to fail stops the others (as torchrun's agent does). Returns the
    exit code (the first failure's, else 0) and every rank's output, rank 0 first."""
    env = env or run_env()
    port = str(free_port())
    procs = [starter().start(module, args, {**env, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0",
                                            "ROLE_RANK": str(r), "WORLD_SIZE": str(nproc),
                                            "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
                                            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(nproc)]
    return together(procs, timeout)


def spawn(fn: Callable[..., None], args: tuple, nprocs: int, timeout: float = 600) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with warm-started processes: ``fn(rank, *args)`` in
    each (a module-level function; ``args`` JSON values); raises with every process's output if one fails."""
    target = f"{fn.__module__}:{fn.__qualname__}"
    procs = [starter().start("tests.warm_call", [target, json.dumps([rank, *args])], run_env())
             for rank in range(nprocs)]
    code, out = together(procs, timeout)
    if code:
        raise RuntimeError(f"{target} failed (exit {code}):\n{out[-6000:]}")


def together(procs: list[WarmProcess], timeout: float) -> tuple[int, str]:
    """Wait for ``procs``, stopping all when one fails or ``timeout`` passes: (the first failure's exit code
    or 0, their outputs in order)."""
    outputs = [""] * len(procs)

    def read(i: int) -> None:
        outputs[i] = procs[i].stdout.read()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline, code = time.monotonic() + timeout, 0
    while [p.poll() for p in procs].count(None):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            code = failed[0] if failed else 124
            for p in procs:
                p.kill()
        time.sleep(0.05)
    for t in readers:
        t.join(30)
    code = code or next((p.returncode for p in procs if p.returncode != 0), 0)
    return code, "".join(outputs)


class WarmProcess:
    """A forked child, held as a :class:`subprocess.Popen` with ``stdout=PIPE, stderr=STDOUT, text=True``."""

    def __init__(self, starter: WarmStarter, pid: int, stdout: Any):
        self.starter, self.pid, self.stdout, self.returncode = starter, pid, stdout, None
        self.args = pid

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.starter.status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.starter.status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.stdout.read()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        self.stdout.close()
        self.wait(timeout)
        return out[0], None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended; its status is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.poll() is None:
            self.kill()
            self.wait()
        self.stdout.close()


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
