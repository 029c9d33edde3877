"""Hostile programs through the python tool: each comes back as an error observation, the test
process goes on unharmed, and nothing leaks (no process, no file, no secret, no connection).

These run the real bubblewrap sandbox; without bwrap (or where bwrap may not create its
namespaces) they are skipped, saying why. CI installs it with scripts/setup.sh."""

from __future__ import annotations

import glob
import os
import resource
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

from mmrl.config import from_dict
from mmrl.errors import ConfigError
from mmrl.tools import sandbox as sandbox_module
from mmrl.tools.sandbox import SandboxConfig, check_sandbox, run_python
from mmrl.tools.tool import ToolCall, call_tool, make_tools

# small limits keep each hostile run to a second or two on a loaded machine
LIMITS = SandboxConfig(cpu_seconds=1, wall_seconds=4, memory_mb=256, max_processes=8, max_file_mb=1, max_output_bytes=4096)


@pytest.fixture(scope="module")
def python_tool():
    if sandbox_module.bwrap_path() is None:
        pytest.skip("bwrap is not installed (apt-get install bubblewrap; scripts/setup.sh installs it)")
    ok, detail = check_sandbox(LIMITS)
    if not ok and "bwrap:" in detail:  # bwrap itself refused (e.g. user namespaces disabled)
        pytest.skip(f"bwrap cannot create its namespaces on this machine: {detail}")
    assert ok, detail
    return make_tools(["python"], LIMITS)


def run(tools, code: str):
    return call_tool(tools, ToolCall("python", {"code": code}))


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line holds ``marker``."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(path.split("/")[2]))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def sandbox_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "mmrl-sandbox-*")))


def test_infinite_loop_hits_the_cpu_limit_and_no_child_survives(python_tool):
    marker = f"mmrl-loop-{uuid.uuid4().hex}"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)  # {marker}'], start_new_session=True)\n"
        "print('child started', flush=True)\n"
        "while True:\n    pass\n"
    )
    patient = make_tools(["python"], SandboxConfig(**{**LIMITS.__dict__, "wall_seconds": 30}))  # a loaded machine: the CPU limit comes first
    result = run(patient, code)
    assert result.error and "CPU time limit" in result.text, result.text
    assert "child started" in result.text  # the child (in a session of its own) did exist
    assert processes_with(marker) == []


def test_sleeping_program_is_killed_at_the_wall_clock_timeout_with_its_children(python_tool):
    marker = f"mmrl-sleep-{uuid.uuid4().hex}"
    code = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import os, time; os.fork(); time.sleep(300)  # {marker}'])\n"
        "time.sleep(300)\n"
    )
    start = time.monotonic()
    result = run(make_tools(["python"], SandboxConfig(**{**LIMITS.__dict__, "wall_seconds": 1.5})), code)
    assert result.error and "wall-clock timeout (1.5 s)" in result.text, result.text
    assert time.monotonic() - start < 10
    assert processes_with(marker) == []


def test_fork_bomb_is_held_to_the_process_limit_and_leaves_no_process(python_tool):
    counted = run(python_tool, (
        "import os, time\nforks = 0\n"
        "for _ in range(40):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
        "    forks += 1\n"
        "raise SystemExit(f'forked {forks} children')\n"
    ))
    forks = int(counted.text.split("forked ")[1].split()[0])
    assert counted.error and 0 < forks < LIMITS.max_processes, counted.text  # the main process counts too
    marker = f"mmrl-bomb-{uuid.uuid4().hex}"
    bomb = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n# " + marker
    brief = make_tools(["python"], SandboxConfig(**{**LIMITS.__dict__, "wall_seconds": 2}))
    result = run(brief, f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', '{bomb}'])\n")
    assert result.error and ("CPU time limit" in result.text or "timeout" in result.text or "killed" in result.text), result.text
    assert processes_with(marker) == []
    assert subprocess.run(["true"]).returncode == 0  # this process can still start processes


def test_memory_bomb_fails_with_memory_error(python_tool):
    result = run(python_tool, "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n")
    assert result.error and "MemoryError" in result.text, result.text
    result = run(python_tool, "x = bytearray(1 << 40)\n")
    assert result.error and "MemoryError" in result.text, result.text


def test_writes_outside_the_working_directory_fail_and_leave_nothing(python_tool, tmp_path):
    outside = tempfile.mkdtemp(prefix="mmrl-sandbox-test-", dir="/var/tmp")
    os.chmod(outside, 0o777)  # only the sandbox, not the permissions, may stop the write
    targets = [os.path.join(outside, "escape.txt"), str(tmp_path / "escape.txt"), os.path.join(os.getcwd(), "escape.txt")]
    before = sandbox_dirs()
    try:
        code = (
            "import os, sys\nrefused = 0\n"
            f"for path in {targets!r}:\n"
            "    try:\n        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
            "        open(path, 'w').write('escaped')\n        print('wrote', path)\n"
            "    except OSError as e:\n        refused += 1\n        print('refused', path, e)\n"
            "open('inside.txt', 'w').write('fine')\n"
            "print('working directory writable')\n"
            "sys.exit(1 if refused else 0)\n"
        )
        result = run(python_tool, code)
        assert result.error and "working directory writable" in result.text, result.text
        assert result.text.count("refused") >= 2  # the host directory and the checkout: read-only
        for path in targets:  # /tmp inside is private: a write there never reaches the host's /tmp
            assert not os.path.exists(path), path
        assert sandbox_dirs() <= before  # the working directory is gone too
    finally:
        for path in targets:
            if os.path.exists(path):
                os.remove(path)
        os.rmdir(outside)


def test_file_size_limit_stops_a_huge_file(python_tool):
    result = run(python_tool, "open('big', 'wb').write(b'0' * (2 << 20))\n")
    assert result.error and "File too large" in result.text, result.text


def test_parent_environment_is_not_readable(python_tool, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("MMRL_SANDBOX_SECRET", secret)
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "for pid in [p for p in os.listdir('/proc') if p.isdigit()] + [str(os.getppid())]:\n"
        "    try:\n        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n        print(pid, e)\n"
        "print(os.environ['MMRL_SANDBOX_SECRET'])\n"
    )
    result = run(python_tool, code)
    assert result.error and "KeyError" in result.text and "PATH" in result.text, result.text
    assert secret not in result.text


def test_sockets_reach_neither_localhost_nor_the_outside(python_tool):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        local = run(python_tool, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n")
        assert local.error and "connected" not in local.text.replace("Connection", ""), local.text
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection ever arrived
        outside = run(python_tool, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')\n")
        assert outside.error and ("unreachable" in outside.text or "OSError" in outside.text), outside.text
        dns = run(python_tool, "import socket\nprint(socket.getaddrinfo('pypi.org', 443))\n")
        assert dns.error and "gaierror" in dns.text, dns.text
    finally:
        listener.close()


def test_huge_print_is_cut_and_memory_stays_bounded(python_tool):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run(python_tool, "while True:\n    print('x' * 100000)\n")
    assert result.error and "output cut at 4096 bytes" in result.text and "[output limit (4096 bytes)]" in result.text  # stopped at the cap, not the timeout
    assert len(result.text) < 4096 + 300
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024  # KiB: no unbounded buffering


def test_runs_are_isolated_from_each_other(python_tool):
    first = run(python_tool, "import os\nopen('/tmp/left-behind', 'w').write('x')\nopen('mine', 'w').write('x')\nprint(sorted(os.listdir('.')))\n")
    second = run(python_tool, "import os\nprint(os.path.exists('/tmp/left-behind'), sorted(os.listdir('.')))\n")
    assert not first.error and "mine" in first.text
    assert second.text == "False ['main.py']"


def test_result_reports_exit_status_and_output_of_a_normal_run(python_tool):
    result = run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n", LIMITS)
    assert (result.stdout, result.stderr, result.exit_code, result.ok) == ("out\n", "err\n", 3, False)
    assert run(python_tool, "print(sum(range(10)))").text == "45"


@pytest.mark.parametrize("backend", ["bwrap", "limits_only"])
def test_an_exit_status_above_128_is_an_exit_status_and_a_real_signal_is_a_signal(python_tool, backend):
    limits = SandboxConfig(**{**LIMITS.__dict__, "backend": backend})
    exited = run_python("raise SystemExit(139)\n", limits)
    assert (exited.exit_code, exited.killed_reason) == (139, None)
    crashed = run_python("import ctypes\nctypes.string_at(0)\n", limits)  # a real segmentation fault
    assert (crashed.exit_code, crashed.killed_reason) == (None, "signal SIGSEGV")
    killed = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", limits)
    assert (killed.exit_code, killed.killed_reason) == (None, "signal SIGTERM")
    assert run(make_tools(["python"], limits), "raise SystemExit(139)").text.endswith("\n[exit status 139]")


def test_without_the_bootstraps_word_bwraps_status_above_128_reads_as_a_signal():
    # what bwrap alone reports (a `command` sandbox that does not pass the status pipe on is the same)
    assert sandbox_module._ending(139, None, LIMITS, bwrap=True) == (None, "signal SIGSEGV")
    assert sandbox_module._ending(139, {"exit_code": 139}, LIMITS, bwrap=True) == (139, None)
    assert sandbox_module._ending(-11, None, LIMITS, bwrap=False) == (None, "signal SIGSEGV")
    assert sandbox_module._ending(139, None, LIMITS, bwrap=False) == (139, None)


def forking(children: int, megabytes: int) -> str:
    """Code that forks ``children`` processes each holding ``megabytes`` MB for a second, then
    prints how many it forked and how each ended."""
    return (
        "import os, time\npids = []\n"
        f"for _ in range({children}):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        f"    if pid == 0:\n        block = b'x' * ({megabytes} << 20)\n        time.sleep(1)\n        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print('forked', len(pids), 'ended', [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])\n"
    )


def test_a_calls_processes_together_are_held_to_call_memory_mb_by_a_cgroup(python_tool):
    probe = sandbox_module._MemoryCgroup.make(1 << 30)
    if probe is None:
        pytest.skip("no memory cgroup can be made here (the process limit keeps the budget: the next test)")
    probe.remove()
    cgroups = set(glob.glob("/sys/fs/cgroup/**/mmrl-sandbox-*", recursive=True))
    limits = SandboxConfig(**{**LIMITS.__dict__, "call_memory_mb": 300, "wall_seconds": 10})
    result = run_python(forking(3, 150), limits)  # 3 × 150 MB, each within memory_mb (256)
    assert result.killed_reason.startswith("memory limit of the call (call_memory_mb=300 MiB): the kernel killed"), result
    assert "forked 3" in result.stdout and "-9" in result.stdout
    assert set(glob.glob("/sys/fs/cgroup/**/mmrl-sandbox-*", recursive=True)) <= cgroups  # removed after the call
    assert run_python(forking(1, 150), limits).ok  # one child of 150 MB fits


def test_without_a_cgroup_the_process_limit_is_lowered_so_processes_times_memory_fits(python_tool, monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module._MemoryCgroup, "make", classmethod(lambda cls, limit: None))
    monkeypatch.setattr(sandbox_module, "_warned_no_cgroup", False)
    limits = SandboxConfig(**{**LIMITS.__dict__, "call_memory_mb": 512})  # 2 processes of 256 MiB
    with caplog.at_level("WARNING", logger="mmrl.tools.sandbox"):
        result = run_python(forking(4, 1), limits)
        run_python("print(1)", limits)
    forks = int(result.stdout.split("forked ")[1].split()[0])
    assert forks <= 1, result  # the main process and at most one child
    warnings = [r.getMessage() for r in caplog.records if "call_memory_mb" in r.getMessage()]
    assert warnings == ["sandbox: no memory cgroup can be made here, so the code runs at most 2 processes (not max_processes=8), "
                        "so that processes × memory_mb (256 MiB) fits call_memory_mb=512 MiB"]


def test_call_memory_mb_below_one_process_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as e:
        from_dict(SandboxConfig, {"memory_mb": 512, "call_memory_mb": 256}, "env.sandbox")
    assert str(e.value) == "env.sandbox.call_memory_mb: got 256; at least memory_mb (512), the memory of one process"


@pytest.mark.parametrize("where", ["the working directory", "/tmp"])
def test_a_flood_of_files_is_stopped_at_max_files_and_reported(python_tool, where):
    before = sandbox_dirs()
    prefix = "/tmp/" if where == "/tmp" else ""
    code = f"import os\nos.makedirs('{prefix}d', exist_ok=True)\nfor i in range(100000):\n    open(f'{prefix}d/f{{i}}', 'w').close()\nprint('wrote them all')\n"
    start = time.monotonic()
    result = run_python(code, SandboxConfig(**{**LIMITS.__dict__, "max_files": 200, "wall_seconds": 20}))
    assert time.monotonic() - start < 5
    assert (result.exit_code, result.killed_reason) == (None, "file limit (max_files=200 files and directories)"), result
    assert "wrote them all" not in result.stdout
    assert sandbox_dirs() <= before
    assert run_python("import os\nos.mkdir('d')\nfor i in range(150):\n    open(f'd/f{i}', 'w').close()\n", SandboxConfig(**{**LIMITS.__dict__, "max_files": 200})).ok


def test_numpy_imports_under_a_process_limit_below_the_number_of_cores(python_tool):
    # OpenBLAS starts a thread per core unless told otherwise, and threads count as processes
    result = run_python("import numpy\nprint(numpy.ones(3).sum())\n", SandboxConfig(**{**LIMITS.__dict__, "max_processes": 1}))
    assert result.ok and result.stdout == "3.0\n", result
