"""Instructions counted by valgrind's callgrind over a child's measured window only.

A benchmark child started by :func:`command` runs under callgrind with instrumentation off
(so its imports, its handshakes and its waits for the benchmark cost little), and the
window (``perf/_harness.py``'s ``Window``) turns it on at its start and dumps the count at
its end, through callgrind's client requests. The count is the instructions the process
executed in the window, every thread: it does not move with the machine's load the way CPU
seconds do, so a ratio between two arms, or against another tree, holds from one run to the
next (the scheduling of the two processes still varies a little: how many tokens one wake
finds, how many acknowledgements one datagram carries).

A client request is a special instruction sequence that valgrind recognises and a real CPU
executes as a no-op; C code gets it from ``valgrind/callgrind.h``. Python has no such
macro, so :class:`ClientRequests` writes the x86-64 sequence (the one that header expands
to) into an executable page and calls it through ctypes. Elsewhere (another CPU, no
executable pages) the window is not counted and says so.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["ENV_DIR", "ClientRequests", "command", "read_window", "run_in_tree"]

ENV_DIR = "VELOMUX_PERF_CALLGRIND_DIR"
"""Set for a child run under callgrind: the directory its dumps go to."""

TAG = "window"
"""The dump's trigger text, so the window's dump is told from the one at exit."""

_BASE = (ord("C") << 24) | (ord("T") << 16)  # VG_USERREQ_TOOL_BASE('C', 'T')
_DUMP_STATS_AT = _BASE + 3
_START_INSTRUMENTATION = _BASE + 4
_STOP_INSTRUMENTATION = _BASE + 5
_ZERO_STATS = _BASE + 1
_TOGGLE_COLLECT = _BASE + 2
_RUNNING_ON_VALGRIND = 0x1001

# rdi: the request's six words (request code, five arguments); rsi: the default result.
# The four rotations of rdi (by 3, 13, 61 and 51: 128 bits, so rdi is unchanged) and then
# ``xchg rbx, rbx`` are the sequence valgrind acts on, with the request's address in rax;
# the result comes back in rdx.
_X86_64 = bytes.fromhex(
    "4889f8"  # mov rax, rdi
    "4889f2"  # mov rdx, rsi
    "48c1c703" "48c1c70d" "48c1c73d" "48c1c733"  # rol rdi, 3 / 13 / 61 / 51
    "4887db"  # xchg rbx, rbx
    "4889d0"  # mov rax, rdx
    "c3"  # ret
)  # fmt: skip


class ClientRequests:
    """Callgrind's client requests from Python (x86-64 only; see the module docstring)."""

    def __init__(self) -> None:
        if platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError(f"callgrind's client requests are written for x86-64 only, "
                               f"not {platform.machine()}")  # fmt: skip
        self._page = mmap.mmap(
            -1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
        )
        self._page.write(_X86_64)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._page))
        prototype = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64)
        self._call = prototype(address)
        self._tag = ctypes.create_string_buffer(TAG.encode())
        # The toggle is made per window of a benchmark that counts short calls: its words
        # are built once, so what the window counts of the request itself stays small.
        self._toggle_words = (ctypes.c_uint64 * 6)(_TOGGLE_COLLECT, 0, 0, 0, 0, 0)
        self._toggle_address = ctypes.addressof(self._toggle_words)

    def _request(self, code: int, argument: int = 0) -> int:
        words = (ctypes.c_uint64 * 6)(code, argument, 0, 0, 0, 0)
        return int(self._call(ctypes.addressof(words), 0))

    def on_valgrind(self) -> bool:
        """True when this process runs under valgrind (0 on a real CPU)."""
        return self._request(_RUNNING_ON_VALGRIND) > 0

    def start(self) -> None:
        """Instrument from here on, counting from zero."""
        self._request(_START_INSTRUMENTATION)
        self._request(_ZERO_STATS)

    def stop(self) -> None:
        """Dump what was counted since :meth:`start` (tagged :data:`TAG`), then stop
        instrumenting."""
        self._request(_DUMP_STATS_AT, ctypes.addressof(self._tag))
        self._request(_STOP_INSTRUMENTATION)

    def toggle(self) -> None:
        """Stop counting, or count again, within a window: a benchmark whose measured step
        alternates with others (setting up the next one) counts that step alone, without
        instrumenting the code again at every turn as :meth:`start` and :meth:`stop` would."""
        self._call(self._toggle_address, 0)


def command(out_dir: Path) -> list[str]:
    """The prefix that runs a child under callgrind, instrumentation off until its window;
    its dumps go to ``out_dir``. RuntimeError (saying how to get it) without valgrind."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("valgrind is not installed: `make valgrind` installs it (Debian)")
    return [
        valgrind, "--tool=callgrind", "--instr-atstart=no", "--quiet",
        f"--callgrind-out-file={out_dir}/callgrind.%p",
    ]  # fmt: skip


def read_window(out_dir: Path, pid: int | None = None) -> int:
    """The instructions of this process's last window, from its tagged dump (written while
    the dump request ran, so it is there when :meth:`ClientRequests.stop` returns)."""
    pid = os.getpid() if pid is None else pid
    dumps = sorted(out_dir.glob(f"callgrind.{pid}.*"), key=lambda path: int(path.suffix[1:]))
    for dump in reversed(dumps):  # the latest window's, where a process counts several
        head: dict[str, str] = {}
        with dump.open() as lines:
            for line in lines:
                if line.startswith(("fl=", "fn=", "ob=")):
                    break
                key, _, value = line.partition(":")
                head.setdefault(key.strip(), value.strip())
                if line.startswith("desc: Trigger:"):
                    head["trigger"] = line.split("Trigger:", 1)[1].strip()
        if head.get("trigger") == f"Client Request: {TAG}":
            return int(head.get("summary") or head["totals"])
    raise RuntimeError(f"no callgrind dump of the window for process {pid} in {out_dir}")


def run_in_tree(script: str, arguments: list[str], tree: Path) -> dict[str, object]:
    """Run ``script --child arguments`` under callgrind against the checkout ``tree`` (its
    own virtual environment's Python where it has one) and return the JSON object its
    child printed last. SystemExit with the child's standard error when it fails."""
    python = tree / ".venv" / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix="callgrind-") as out:
        child = [str(python if python.exists() else sys.executable), script, "--child"]
        env = {**os.environ, ENV_DIR: out, "PYTHONPATH": str(tree)}
        shown = subprocess.run(
            [*command(Path(out)), *child, *arguments],
            env=env, cwd=tree, capture_output=True, text=True,
        )  # fmt: skip
    if shown.returncode != 0:
        raise SystemExit(shown.stderr)
    result: dict[str, object] = json.loads(shown.stdout.strip().splitlines()[-1])
    return result
