"""Network namespace plumbing: create/remove by name, run code or processes inside one, find what lives there.

Everything goes through setns(2) on a file descriptor of /run/netns/NAME (what `ip netns exec` does, minus the
/sys remount); nothing shells out to `ip`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from pyroute2 import netns as _netns

from dgt.errors import DgtError, PrivilegeRequired

NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")
NEEDS = "needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)"
CAPS = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}  # bit numbers in /proc/self/status CapEff (linux/capability.h)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_setns = _libc.setns
_setns.argtypes = (ctypes.c_int, ctypes.c_int)
_setns.restype = ctypes.c_int


def missing_capabilities() -> list[str]:
    """The capabilities namespaces and qdiscs need that this process's effective set lacks (root has them unless a
    container took them away; a non-root process may have been given them, e.g. by setcap)."""
    try:
        with open("/proc/self/status") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):  # no /proc: go by the user id alone
        return [] if os.geteuid() == 0 else list(CAPS)
    return [name for name, bit in CAPS.items() if not eff >> bit & 1]


def require_privilege(what: str = "network emulation") -> None:
    """Raise PrivilegeRequired (``WHAT needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)``) when this process lacks
    either capability: before anything is built, so it is never mistaken for a missing kernel feature."""
    missing = missing_capabilities()
    if missing:
        raise PrivilegeRequired(f"{what} {NEEDS}; this process lacks {' and '.join(missing)} (run it with sudo)")


def privilege_error(exc: OSError, what: str = "network emulation") -> PrivilegeRequired:
    """The PrivilegeRequired for an EPERM/EACCES the kernel gave while building (capabilities that looked present
    were not enough: a user namespace, a seccomp or LSM policy)."""
    return PrivilegeRequired(f"{what} {NEEDS}: the kernel refused it ({exc})")


def ns_path(name: str) -> str:
    return os.path.join(NETNS_DIR, name)


def setns_fd(fd: int) -> None:
    """Move the calling thread into the network namespace behind fd."""
    if _setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def list_ns(prefix: str | None = None) -> list[str]:
    """Named network namespaces, optionally those whose name starts with prefix + '-'."""
    try:
        names = sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []
    if prefix is None:
        return names
    return [n for n in names if n.startswith(prefix + "-")]


def create_ns(name: str) -> None:
    """Create a named network namespace; fail if the name is taken (stale state must be removed explicitly)."""
    if os.path.exists(ns_path(name)):
        raise DgtError(f"network namespace {name} already exists")
    _netns.create(name)


def ns_inode(name: str) -> tuple[int, int] | None:
    try:
        st = os.stat(ns_path(name))
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def pids_in_ns(name: str) -> list[int]:
    """Processes whose network namespace is the named one (like `ip netns pids`)."""
    ident = ns_inode(name)
    if ident is None:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == ident:
            pids.append(int(entry))
    return pids


def kill_ns_processes(name: str, grace: float = 1.0) -> list[int]:
    """Stop every process inside the namespace (TERM, then KILL after grace); they would keep it alive."""
    pids = pids_in_ns(name)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove_ns(name: str) -> bool:
    """Remove a named namespace (its interfaces go with it); True if it existed."""
    if not os.path.exists(ns_path(name)):
        return False
    kill_ns_processes(name)
    try:
        _netns.remove(name)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
    return True


@contextlib.contextmanager
def in_ns(name: str) -> Iterator[None]:
    """Switch the calling thread into the namespace for the block (sockets made there stay there)."""
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        fd = os.open(ns_path(name), os.O_RDONLY)
        try:
            setns_fd(fd)
        finally:
            os.close(fd)
        try:
            yield
        finally:
            setns_fd(back)
    finally:
        os.close(back)


def run_in_ns(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call fn in a short-lived thread that lives in the namespace, so the caller's own thread never moves."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            fd = os.open(ns_path(name), os.O_RDONLY)
            try:
                setns_fd(fd)
            finally:
                os.close(fd)
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=target, name=f"netns-{name}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def popen_in_ns(name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen whose child enters the namespace between fork and exec (the `ip netns exec` way)."""
    fd = os.open(ns_path(name), os.O_RDONLY)
    user_preexec = kwargs.pop("preexec_fn", None)
    pass_fds = tuple(kwargs.pop("pass_fds", ())) + (fd,)

    def preexec() -> None:
        setns_fd(fd)
        if user_preexec is not None:
            user_preexec()

    try:
        return subprocess.Popen(list(argv), preexec_fn=preexec, pass_fds=pass_fds, **kwargs)
    finally:
        os.close(fd)


def write_sysctl(name: str, key: str, value: str) -> None:
    """Set a net.* sysctl inside the namespace (/proc/sys/net follows the opening thread's namespace)."""

    def write() -> None:
        with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
            f.write(value)

    run_in_ns(name, write)
