"""Run untrusted Python in a sandboxed subprocess: :func:`run_python`.

The default backend is bubblewrap (``bwrap``, Debian's ``bubblewrap``, Flatpak's sandbox):
the code sees the host's filesystem read-only (``--ro-bind / /``), a private ``/tmp`` of
``tmp_mb`` (a tmpfs), a fresh temporary working directory (``/tmp/work``, bound read-write
from a host directory that is removed afterwards), its own ``/proc`` and a minimal ``/dev``,
no network (an empty network namespace: not even the host's loopback), its own pid, IPC and
UTS namespaces, and an environment of a few variables (``--clearenv``). Inside, a bootstrap
sets the resource limits (CPU seconds, address space, processes, file size, no core files)
and, when mmrl runs as root, drops to an unprivileged uid, then executes the code. The host
kills bwrap's whole process group at the wall-clock timeout; the code's processes live in
bwrap's pid namespace, which the kernel tears down with its init, so none survives.

A call's processes together hold at most ``call_memory_mb``: the host starts the sandbox in a
memory cgroup of its own where it may make one (cgroup v2 with the memory controller delegated,
or a v1 memory hierarchy); elsewhere it lowers the process limit until processes ×
``memory_mb`` fits. The host counts the files and directories of the working directory and
the private ``/tmp`` every 0.1 s and ends a run past ``max_files``.

Why the uid drop: the kernel never applies ``RLIMIT_NPROC`` to root (nor to processes with
``CAP_SYS_RESOURCE``), so as root a fork bomb would be bounded by nothing but the timeout.
As root, the code runs as a fresh uid per run (``sandbox.uid`` pins one), whose process count
is that run's alone. Not as root, bwrap puts the code in a new user namespace, where the
kernel counts processes per namespace (Linux >= 5.14).

This is process isolation on the host's kernel, not a virtual machine: a kernel exploit
escapes it, and the code can read every file the sandbox's uid may read. ``backend:
command`` runs the same bootstrap under a stronger sandbox (nsjail, firejail, a container
runtime); ``backend: limits_only`` keeps the resource limits and nothing else (docs/agents.md).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Literal

from mmrl.config import option
from mmrl.errors import ConfigError

logger = logging.getLogger(__name__)

WORKDIR = "/tmp/work"  # the working directory as the code sees it under bwrap
_FILE_CHECK_S = 0.1  # how often the files a run holds are counted
# as root, each run's code gets its own uid from this range (above systemd's container
# ranges, below 2^31): its process count, which RLIMIT_NPROC bounds, is that run's alone
_UID_BASE, _UID_SPAN = 1_900_000_000, 100_000_000
# one BLAS / OpenMP thread: threads count against RLIMIT_NPROC, and a numpy that cannot start
# one per core fails on import
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
}

# Runs inside the sandbox before the code. It forks: the child sets the limits (as root,
# RLIMIT_NPROC before the uid changes, which the kernel then enforces), drops the uid and
# executes the code; the parent waits for it and writes how it ended to the status pipe, since
# bwrap reports a death by signal n as exit status 128 + n, which `sys.exit(128 + n)` gives too.
# The parent then ends the same way (the same exit status, or the same signal).
_BOOTSTRAP = """\
import json, os, resource, signal, sys
spec = json.loads(sys.argv[1])
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
pid = os.fork()
if pid == 0:
    if spec["status_fd"] is not None:
        os.close(spec["status_fd"])
    for name, (soft, hard) in spec["limits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    os.execv(sys.executable, [sys.executable, "-E", "-s", "-u", "main.py"])
while True:
    try:
        _, status = os.waitpid(pid, 0)
        break
    except InterruptedError:
        continue
ending = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit_code": os.waitstatus_to_exitcode(status)}
if spec["status_fd"] is not None:
    os.write(spec["status_fd"], json.dumps(ending).encode())
if "signal" in ending:
    signal.signal(ending["signal"], signal.SIG_DFL)
    os.kill(os.getpid(), ending["signal"])
    os._exit(128 + ending["signal"])
os._exit(ending["exit_code"])
"""


@dataclass
class SandboxConfig:
    """Where and under which limits the ``python`` tool runs code (docs/agents.md)."""

    backend: Literal["bwrap", "limits_only", "command"] = option(
        "bwrap", "bwrap: namespaces + limits; limits_only: resource limits only (no isolation, warns); command: `command` as a stronger sandbox"
    )
    command: list[str] = option(factory=list, doc="backend command: the sandbox's command line before the interpreter, {workdir} = the host working directory")
    python: str | None = option(None, "interpreter inside the sandbox (null = the Python running mmrl)")
    cpu_seconds: int = option(5, "CPU seconds of each process (RLIMIT_CPU; SIGXCPU ends it)", ge=1)
    memory_mb: int = option(512, "address space of each process in MiB (RLIMIT_AS)", ge=64)
    call_memory_mb: int = option(2048, "memory of all the code's processes together, MiB: a memory cgroup's limit where one can be made, else max_processes is lowered so that max_processes × memory_mb fits", ge=64)
    max_processes: int = option(32, "processes the code may run at once (RLIMIT_NPROC)", ge=1)
    max_file_mb: int = option(16, "largest file the code may write, MiB (RLIMIT_FSIZE)", ge=0)
    max_files: int = option(1000, "files and directories the working directory and the private /tmp may hold together (checked every 0.1 s); more ends the run", ge=1)
    tmp_mb: int = option(64, "size of the private /tmp under bwrap (a tmpfs; the working directory is not part of it), MiB", ge=1)
    wall_seconds: float = option(10.0, "wall-clock timeout; then the whole sandbox is killed", gt=0)
    max_output_bytes: int = option(16384, "stdout and stderr kept together; more is cut with a marker and ends the run", ge=1)
    uid: int | None = option(None, "as root: the uid the code runs as (null = a fresh uid per run, so that runs' process limits are separate)", ge=1)
    bwrap_args: list[str] = option(factory=list, doc="extra bwrap arguments before the command, e.g. [--tmpfs, /home] to hide a directory")

    def validate(self, path: str) -> None:
        prefix = f"{path}." if path else ""
        if self.backend == "command" and not self.command:
            raise ConfigError(f"{prefix}command", self.command, "backend 'command' needs the sandbox's command line, e.g. [nsjail, --config, sandbox.cfg, --]")
        if self.call_memory_mb < self.memory_mb:
            raise ConfigError(f"{prefix}call_memory_mb", self.call_memory_mb, f"at least memory_mb ({self.memory_mb}), the memory of one process")


@dataclass
class SandboxResult:
    """What a run printed and how it ended."""

    stdout: str
    stderr: str
    exit_code: int | None  # the code's exit status; None when it was killed
    timed_out: bool = False
    killed_reason: str | None = None  # "wall-clock timeout (10 s)", "CPU time limit (5 s)", "output limit ...", "file limit ...", "signal SIGSEGV"
    truncated: bool = False  # output beyond max_output_bytes was dropped
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def require_backend(cfg: SandboxConfig, field: str = "sandbox.backend") -> None:
    """A ConfigError naming ``field`` if ``cfg.backend`` cannot run here (bwrap missing); the
    one warning of ``limits_only``."""
    if cfg.backend == "bwrap" and bwrap_path() is None:
        raise ConfigError(
            field, "bwrap", "bubblewrap is not installed: apt-get install bubblewrap (scripts/setup.sh installs it), "
            "or set limits_only to run code with resource limits only (no network, filesystem or environment isolation)",
        )
    if cfg.backend == "limits_only":
        _warn_limits_only()


_warned = False


def _warn_limits_only() -> None:
    global _warned
    if not _warned:
        _warned = True
        limits = (
            "CPU, memory and file-size limits (as root, no process limit: the kernel exempts root from RLIMIT_NPROC)"
            if os.geteuid() == 0 else "CPU, memory, process and file-size limits"
        )
        logger.warning(
            "sandbox.backend=limits_only: code runs with %s only; it can use the network, read and write whatever "
            "this user can, and read this process's environment through /proc", limits,
        )


def run_python(code: str, sandbox: SandboxConfig | None = None, **options) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh temporary directory inside the sandbox and
    return its output. ``options`` override fields of ``sandbox`` (``cpu_seconds=1``).

    Never raises for what the code does (loops, crashes, bombs): that is in the result. A
    ConfigError if the backend cannot run here."""
    cfg = replace(sandbox or SandboxConfig(), **options)
    require_backend(cfg)
    python = cfg.python or sys.executable
    if cfg.backend != "command" and not os.path.isabs(python):
        python = shutil.which(python) or python
    uid = _sandbox_uid(cfg)
    cgroup = _MemoryCgroup.make(cfg.call_memory_mb << 20)
    processes = cfg.max_processes if cgroup is not None else _processes_within_budget(cfg)
    workdir = tempfile.mkdtemp(prefix="mmrl-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if cfg.backend == "bwrap" and uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, "main.py"), uid, uid)
        status_read, status_write = os.pipe()  # the bootstrap writes there how the code ended
        os.set_blocking(status_read, False)
        spec = json.dumps({"limits": _limits(cfg, processes), "uid": uid, "status_fd": status_write})
        inner = [python, "-E", "-s", "-c", _BOOTSTRAP, spec]
        if cfg.backend == "bwrap":
            argv = _bwrap_argv(cfg, workdir, python, uid) + inner
        elif cfg.backend == "command":
            argv = [part.replace("{workdir}", workdir) for part in cfg.command] + inner
        else:
            argv = inner
        try:
            return _run(argv, workdir, cfg, status_read, status_write, cgroup)
        finally:
            os.close(status_read)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if cgroup is not None:
            cgroup.remove()


def _sandbox_uid(cfg: SandboxConfig) -> int | None:
    """The uid the code runs as: under bwrap as root an unprivileged one (see the module
    docstring); otherwise unchanged (None)."""
    if cfg.backend != "bwrap" or os.geteuid() != 0:
        return None
    return cfg.uid if cfg.uid is not None else _UID_BASE + secrets.randbelow(_UID_SPAN)


def _limits(cfg: SandboxConfig, processes: int) -> dict[str, tuple[int, int]]:
    mib = 1 << 20
    return {
        "RLIMIT_CPU": (cfg.cpu_seconds, cfg.cpu_seconds + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
        "RLIMIT_AS": (cfg.memory_mb * mib, cfg.memory_mb * mib),
        "RLIMIT_NPROC": (processes, processes),
        "RLIMIT_FSIZE": (cfg.max_file_mb * mib, cfg.max_file_mb * mib),
        "RLIMIT_CORE": (0, 0),
    }


def _bwrap_argv(cfg: SandboxConfig, workdir: str, python: str, uid: int | None) -> list[str]:
    argv = [
        bwrap_path() or "bwrap",
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--perms", "1777", "--size", str(cfg.tmp_mb << 20), "--tmpfs", "/tmp",
    ]
    hidden = ["/tmp"]
    if uid is not None:
        # directories the sandbox's uid cannot enter (root's 0700 home holding pyenv's
        # Python) become empty tmpfs; the interpreter's own directories are bound back below
        private = _private_ancestors(_interpreter_dirs(python))
        for path in private:
            argv += ["--tmpfs", path]
        hidden += private
    made: set[str] = set()
    for path in _interpreter_dirs(python):
        under = [h for h in hidden if path == h or path.startswith(h.rstrip("/") + "/")]
        if not under:
            continue
        # bwrap would make the directories on the way 0700, closed to the sandbox's uid
        parts = path[len(under[0]):].strip("/").split("/")
        for i in range(1, len(parts)):
            between = under[0].rstrip("/") + "/" + "/".join(parts[:i])
            if between not in made:
                made.add(between)
                argv += ["--perms", "0755", "--dir", between]
        argv += ["--ro-bind", path, path]
    argv += [
        "--bind", workdir, WORKDIR, "--chdir", WORKDIR,
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "sandbox", "--die-with-parent", "--new-session", "--clearenv",
    ]
    for key, value in {**_ENV, "HOME": WORKDIR, "TMPDIR": "/tmp"}.items():
        argv += ["--setenv", key, value]
    return argv + list(cfg.bwrap_args) + ["--"]


def _interpreter_dirs(python: str) -> list[str]:
    """The directories the interpreter runs from (its venv and its base installation), outermost
    first, none inside another."""
    real = os.path.realpath(python)
    candidates = {os.path.realpath(p) for p in (os.path.dirname(real), os.path.dirname(os.path.abspath(python)))}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        candidates |= {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    ordered = sorted(candidates, key=lambda p: (p.count("/"), p))
    kept: list[str] = []
    for path in ordered:
        if not any(path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def _private_ancestors(paths: list[str]) -> list[str]:
    """For each path, its outermost proper ancestor that others may not enter (no o+x)."""
    found: list[str] = []
    for path in paths:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            try:
                if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                    if ancestor not in found:
                        found.append(ancestor)
                    break
            except OSError:
                break
    return found


class _MemoryCgroup:
    """A memory cgroup of its own for one call, limited to ``call_memory_mb``: the code's
    processes together, its private /tmp included, cannot hold more (the kernel's OOM killer
    ends one that tries). cgroup v2 (``memory.max``) where the controller is enabled for
    mmrl's cgroup's children, else v1's memory hierarchy (``memory.limit_in_bytes``)."""

    def __init__(self, path: str, events: str):
        self.path, self.events = path, events

    @classmethod
    def make(cls, limit_bytes: int) -> _MemoryCgroup | None:
        for parent, version in _cgroup_parents():
            path = os.path.join(parent, f"mmrl-sandbox-{secrets.token_hex(6)}")
            try:
                os.mkdir(path)
            except OSError:
                continue
            try:
                if version == 2:
                    _write(os.path.join(path, "memory.max"), str(limit_bytes))
                    if os.path.exists(os.path.join(path, "memory.swap.max")):
                        _write(os.path.join(path, "memory.swap.max"), "0")
                    return cls(path, "memory.events")
                _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
                if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(limit_bytes))
                return cls(path, "memory.oom_control")
            except OSError:
                _rmdir(path)
        return None

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup: a shell moves itself in, then becomes ``argv``,
        so that every process the sandbox starts is born inside."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs"), *argv]

    def oom_kills(self) -> int:
        try:
            with open(os.path.join(self.path, self.events)) as f:
                counts = dict(line.split() for line in f if len(line.split()) == 2)
            return int(counts.get("oom_kill", 0))
        except (OSError, ValueError):
            return 0

    def remove(self) -> None:
        _rmdir(self.path)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _rmdir(path: str) -> None:
    """Remove a cgroup; its last processes may take a moment to leave it."""
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    logger.debug("could not remove the sandbox's cgroup %s", path)


def _cgroup_parents() -> list[tuple[str, int]]:
    """Directories where this process may make a memory cgroup, with the cgroup version: its
    own cgroup v2 when the memory controller is enabled for its children, and its own cgroup
    in a v1 memory hierarchy."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    found = []
    for fields in mounts:
        if "-" not in fields:
            continue
        rest = fields[fields.index("-") + 1 :]
        root, mountpoint, fstype, options = fields[3], fields[4], rest[0], rest[2].split(",") if len(rest) > 2 else []
        for hierarchy, controllers, path in own:
            if fstype == "cgroup2" and hierarchy == "0":
                parent = mountpoint + (path if root == "/" else path.removeprefix(root))
                try:
                    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                        enabled = f.read().split()
                except OSError:
                    continue
                if "memory" in enabled:
                    found.append((parent.rstrip("/") or "/", 2))
            elif fstype == "cgroup" and "memory" in options and "memory" in controllers.split(","):
                found.append(((mountpoint + (path if root == "/" else path.removeprefix(root))).rstrip("/") or "/", 1))
    return sorted(found, key=lambda found: -found[1])


_warned_no_cgroup = False


def _processes_within_budget(cfg: SandboxConfig) -> int:
    """Without a cgroup: the process limit under which max_processes × memory_mb fits
    call_memory_mb (warned once when that lowers max_processes)."""
    global _warned_no_cgroup
    fits = max(1, cfg.call_memory_mb // cfg.memory_mb)
    if fits < cfg.max_processes and not _warned_no_cgroup:
        _warned_no_cgroup = True
        logger.warning(
            "sandbox: no memory cgroup can be made here, so the code runs at most %d processes (not max_processes=%d), "
            "so that processes × memory_mb (%d MiB) fits call_memory_mb=%d MiB", fits, cfg.max_processes, cfg.memory_mb, cfg.call_memory_mb,
        )
    return min(cfg.max_processes, fits)


def _count_entries(path: str, limit: int, device: int | None = None) -> int:
    """Files and directories under ``path`` (not ``path`` itself), counted up to ``limit`` + 1;
    with ``device``, only those on that device (a walk that does not cross into mounts)."""
    count, stack = 0, [path]
    while stack and count <= limit:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    count += 1
                    if count > limit:
                        break
                    try:
                        if entry.is_dir(follow_symlinks=False) and (device is None or entry.stat(follow_symlinks=False).st_dev == device):
                            stack.append(entry.path)
                    except OSError:
                        continue
        except OSError:
            continue
    return count


class _FileCount:
    """The files and directories a run holds: its working directory on the host and, under
    bwrap, its private /tmp (seen through the sandbox's init's ``/proc/PID/root``, where this
    process may look), without descending into what is mounted there (the working directory,
    the interpreter)."""

    def __init__(self, workdir: str, limit: int):
        self.workdir, self.limit = workdir, limit
        self.init_pid: int | None = None

    def sandbox_started(self, init_pid: int | None) -> None:
        self.init_pid = init_pid

    def _tmp(self) -> tuple[str, int] | None:
        """The sandbox's /tmp and its device, once bwrap has made its root (until then the
        init's root is the host's, whose /tmp is not the run's)."""
        if self.init_pid is None:
            return None
        tmp = f"/proc/{self.init_pid}/root/tmp"
        try:
            device = os.stat(tmp).st_dev
            host = os.stat("/tmp").st_dev
        except OSError:
            return None
        return (tmp, device) if device != host else None

    def over(self) -> bool:
        count = _count_entries(self.workdir, self.limit)
        tmp = self._tmp() if count <= self.limit else None
        if tmp is not None:
            count += _count_entries(tmp[0], self.limit - count, tmp[1])
        return count > self.limit


def _run(argv: list[str], workdir: str, cfg: SandboxConfig, status_read: int, status_write: int, cgroup: _MemoryCgroup | None) -> SandboxResult:
    start = time.monotonic()
    deadline = start + cfg.wall_seconds
    info_read = info_write = None
    if cfg.backend == "bwrap":  # bwrap tells the pid of the sandbox's init through --info-fd
        info_read, info_write = os.pipe()
        argv = [argv[0], "--info-fd", str(info_write), *argv[1:]]
    if cgroup is not None:
        argv = cgroup.enter(argv)
    files = _FileCount(workdir, cfg.max_files)
    # a session of its own: killpg reaches bwrap or, with limits only, every process of the
    # code that did not start a session of its own
    proc = subprocess.Popen(
        argv, cwd=workdir, env=dict(_ENV, HOME=workdir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, pass_fds=(status_write,) if info_write is None else (status_write, info_write),
    )
    os.close(status_write)
    init = None
    try:
        if info_write is not None:
            os.close(info_write)
        out, err, info, timed_out, overflow, flood = _read_capped(proc, info_read, deadline, cfg.max_output_bytes, files)
        init = _pidfd(info)
        while not (timed_out or overflow or flood) and proc.poll() is None:  # the code closed its output and runs on
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                proc.wait(timeout=min(_FILE_CHECK_S, left))
            except subprocess.TimeoutExpired:
                flood = files.over()
        if timed_out or overflow or flood:
            _stop(proc, init)
        elif files.over():  # written faster than the last look, then the code ended
            flood = True
        if cfg.backend != "bwrap":
            _kill_group(proc.pid)  # what the code left running in its group
    finally:
        if proc.poll() is None:  # interrupted: leave nothing running
            _stop(proc, init)
        for fd in (info_read, init):
            if fd is not None:
                os.close(fd)
    wall = time.monotonic() - start
    code, reason = _ending(proc.returncode, _status(status_read), cfg, bwrap=cfg.backend == "bwrap")
    oom_kills = cgroup.oom_kills() if cgroup is not None else 0
    if oom_kills:
        reason = f"memory limit of the call (call_memory_mb={cfg.call_memory_mb} MiB): the kernel killed {oom_kills} process(es)"
    if flood:
        reason, code = f"file limit (max_files={cfg.max_files} files and directories)", None
    if overflow:
        reason, code = f"output limit ({cfg.max_output_bytes} bytes)", None
    if timed_out:
        reason, code = f"wall-clock timeout ({cfg.wall_seconds:g} s)", None
    marker = f"\n[output cut at {cfg.max_output_bytes} bytes]" if overflow else ""
    return SandboxResult(
        stdout=out.decode("utf-8", "replace") + marker,
        stderr=err.decode("utf-8", "replace"),
        exit_code=code, timed_out=timed_out, killed_reason=reason, truncated=overflow, wall_seconds=wall,
    )


def _read_capped(proc: subprocess.Popen, info_fd: int | None, deadline: float, cap: int, files: _FileCount) -> tuple[bytes, bytes, bytes, bool, bool, bool]:
    """Read stdout and stderr as they come, keeping ``cap`` bytes of both together, until both
    close, the deadline passes (timed out), the output passes ``cap`` (overflow) or the run
    holds more files than ``files`` allows (flood, looked at every 0.1 s); and bwrap's info
    (``info_fd``) on the way."""
    out, err, info = bytearray(), bytearray(), bytearray()
    buffers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    timed_out = overflow = flood = False
    next_count = time.monotonic() + _FILE_CHECK_S
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        if info_fd is not None:
            selector.register(info_fd, selectors.EVENT_READ)
        while any(key.fd in buffers for key in selector.get_map().values()) and not overflow:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if now >= next_count:
                next_count = now + _FILE_CHECK_S
                if files.over():
                    flood = True
                    break
            for key, _ in selector.select(min(deadline, next_count) - now):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                elif key.fd == info_fd:
                    info += chunk
                    files.sandbox_started(_child_pid(info))
                else:
                    room = cap - len(out) - len(err)
                    buffers[key.fd] += chunk[:room]
                    if len(chunk) > room:
                        overflow = True
                        break
    proc.stdout.close()
    proc.stderr.close()
    return bytes(out), bytes(err), bytes(info), timed_out, overflow, flood


def _child_pid(info: bytes) -> int | None:
    """The pid of the sandbox's init from bwrap's info, once all of it has come."""
    try:
        return int(json.loads(info)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _pidfd(info: bytes) -> int | None:
    """A pidfd of the sandbox's init, from bwrap's info; None without one."""
    pid = _child_pid(info)
    try:
        return None if pid is None else os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _stop(proc: subprocess.Popen, init: int | None) -> None:
    """Kill the code. Under bwrap, its pid namespace's init: the kernel kills every process in
    the namespace, and bwrap exits only once all of them are gone, so none outlives the run.
    Otherwise (or if that fails) the process group."""
    if init is not None:
        try:
            signal.pidfd_send_signal(init, signal.SIGKILL)
            proc.wait(timeout=10)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    _kill_group(proc.pid)
    proc.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _status(status_read: int) -> dict | None:
    """How the code ended as the bootstrap saw it ({"exit_code": n} or {"signal": n}); None when
    it wrote nothing (killed first, or a ``command`` sandbox that does not pass the pipe on)."""
    try:
        ending = json.loads(os.read(status_read, 4096))
    except (OSError, ValueError):
        return None
    return ending if isinstance(ending, dict) and len(ending) == 1 and ending.keys() <= {"exit_code", "signal"} else None


def _ending(returncode: int, status: dict | None, cfg: SandboxConfig, bwrap: bool) -> tuple[int | None, str | None]:
    """(exit code, killed reason). From the bootstrap's ``status`` where there is one: the
    code's own exit status or the signal that ended it. Without it, from the sandbox's exit
    status: a signal shows as a negative status, or under bwrap as 128 + the signal (which an
    exit status above 128 cannot be told from)."""
    if status is not None:
        signum = status.get("signal")
        if signum is None:
            return int(status["exit_code"]), None
    else:
        signum = -returncode if returncode < 0 else (returncode - 128 if bwrap and returncode > 128 else None)
    if signum is None:
        return returncode, None
    if signum == signal.SIGXCPU:
        return None, f"CPU time limit ({cfg.cpu_seconds} s)"
    if signum == signal.SIGKILL:
        return None, "killed (SIGKILL: past the CPU time limit's hard stop, or out of memory)"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = str(signum)
    return None, f"signal {name}"


def check_sandbox(cfg: SandboxConfig | None = None) -> tuple[bool, str]:
    """Whether the sandbox runs code here: (ok, what happened), for ``mmrl doctor`` and the
    tool env's start-up check."""
    cfg = cfg or SandboxConfig()
    try:
        result = run_python("print(6 * 7)", cfg)
    except ConfigError as e:
        return False, str(e)
    if result.ok and result.stdout.strip() == "42":
        return True, f"{cfg.backend}: code runs (in {result.wall_seconds:.2f} s)"
    detail = (result.stderr.strip() or result.stdout.strip() or result.killed_reason or f"exit status {result.exit_code}").splitlines()
    return False, f"{cfg.backend}: code does not run: {detail[-1] if detail else ''}"
