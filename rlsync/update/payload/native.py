"""The payloads' C kernels on a CPU: compiled at first use by the system's C compiler, cached per user, loaded
with ctypes, as inductor builds its CPU kernels.

`DELTA` is delta.c (the delta's compaction, one pass per chunk: kernels.compact_chunk). Its first use in a
process compiles it (once: a lock) with `$CC` (split as a shell would, no shell run), else the first of cc, gcc,
clang on PATH, for this CPU (`-march=native`; without it where the compiler refuses it), into
`$XDG_CACHE_HOME/rlsync/kernels` (else ~/.cache/rlsync/kernels), named by a hash of the source, the flags, the
compiler's version, the machine and the CPU's model and features (/proc/cpuinfo), so a home directory shared by
nodes of other CPUs, or by other compilers, never loads another's build. It compiles to a temporary name
renamed into place (`os.replace`: two processes compiling at once both load a whole file), then loads it with
`ctypes.CDLL`, whose calls release the GIL (the update's chunk threads run it in parallel). Nothing from a run's
config or model goes into the command.

Any failure (no compiler, a compile error, a load error, its self-check) leaves the kernel unavailable, its
reason in `why_not()`, and the caller runs numpy's steps: never an exception into a run. Off with
RLSYNC_NATIVE_KERNELS=0 in the environment or `native.ENABLED = False`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

ENABLED = os.environ.get("RLSYNC_NATIVE_KERNELS", "1") != "0"
FLAGS = ("-O3", "-std=c99", "-fPIC", "-shared")
NATIVE = ("-march=native",)  # this CPU's vector width: 1.3 to 1.6x faster at 1 to 5 % changed (AVX-512, measured)
COMPILERS = ("cc", "gcc", "clang")
COMPILE_TIMEOUT_S = 120
WIDTHS = (1, 2, 4, 8)  # the element widths delta.c exports, rlsync_delta_w<width>
OFF = "turned off (RLSYNC_NATIVE_KERNELS=0 or rlsync.update.payload.native.ENABLED = False)"


class Unavailable(Exception):
    """Why a kernel cannot be built or loaded here: its message is `why_not()`'s."""


def cache_dir() -> Path:
    """This user's kernel cache: $XDG_CACHE_HOME/rlsync/kernels, else ~/.cache/rlsync/kernels."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"  # XDG: a relative value is ignored
    return root / "rlsync" / "kernels"


def compiler() -> list[str]:
    """The C compiler's command: $CC (it may hold arguments, e.g. `ccache gcc`), else the first on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        words = shlex.split(cc)
        found = shutil.which(words[0])
        if found is None:
            raise Unavailable(f"no C compiler: $CC={cc!r} ({words[0]} not found)")
        return [found, *words[1:]]
    for name in COMPILERS:
        found = shutil.which(name)
        if found:
            return [found]
    raise Unavailable(f"no C compiler: none of {', '.join(COMPILERS)} on PATH and $CC unset")


def version_of(command: list[str]) -> str:
    """The compiler's `--version` text, part of the build's key (another compiler, another build)."""
    try:
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        raise Unavailable(f"{command[0]} --version failed: {err}") from err
    if done.returncode:
        raise Unavailable(f"{command[0]} --version failed (exit {done.returncode})")
    return done.stdout


def cpu_identity() -> str:
    """What a -march=native build is for: /proc/cpuinfo's model and feature lines (each distinct one, so a
    machine of mixed cores names them all), else what platform knows."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.processor()} {platform.machine()}"
    fields = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")
    return "\n".join(sorted({line.strip() for line in text.splitlines() if line.split(":")[0].strip() in fields}))


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


class Library:
    """One C source's shared library: built and loaded at the first `get()`, once per process."""

    def __init__(self, source: Path, check=None):
        self.source = source
        self.check = check  # a self-check of the loaded library: raises Unavailable where it is wrong
        self.lock = threading.Lock()
        self.tried = False
        self.lib: ctypes.CDLL | None = None
        self.reason: str | None = None  # why it is unavailable, once tried
        self.path: Path | None = None  # the cached build it loaded
        self.flags: tuple[str, ...] = ()  # what it was compiled with, where this process compiled it
        self.compiled = False  # this process compiled it (False: found in the cache)

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, built the first time; None where it is off or failed (`why_not()` says why)."""
        if not ENABLED:
            return None
        if not self.tried:
            with self.lock:
                if not self.tried:
                    try:
                        self.lib = self.load()
                    except Unavailable as err:
                        self.reason = str(err)
                    except Exception as err:  # noqa: BLE001 - whatever failed, the numpy path serves
                        self.reason = f"{type(err).__name__}: {first_line(str(err))}"
                    self.tried = True
        return self.lib

    def why_not(self) -> str | None:
        """Why the kernel does not run here (building it first, where not tried yet); None where it runs."""
        if not ENABLED:
            return OFF
        self.get()
        return self.reason

    def key(self, command: list[str]) -> str:
        parts = [
            self.source.read_bytes(),
            " ".join(FLAGS + NATIVE).encode(),
            " ".join(command).encode(),
            version_of(command).encode(),
            f"{platform.system()} {platform.machine()}".encode(),
            cpu_identity().encode(),
        ]
        return hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]

    def load(self) -> ctypes.CDLL:
        command = compiler()
        folder = cache_dir()
        path = folder / f"{self.source.stem}-{self.key(command)}.so"
        if not path.exists():
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise Unavailable(f"cannot create the kernel cache {folder}: {err.strerror}") from err
            self.compile(command, path)
            self.compiled = True
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as err:
            raise Unavailable(f"cannot load {path}: {first_line(str(err))}") from err
        self.path = path
        if self.check is not None:
            self.check(lib)
        return lib

    def compile(self, command: list[str], path: Path) -> None:
        """`self.source` built into `path` for this CPU (portable where the compiler refuses -march=native),
        through a temporary file renamed into place."""
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            for flags in (FLAGS + NATIVE, FLAGS):
                try:
                    done = subprocess.run(
                        [*command, *flags, "-o", tmp, str(self.source)],
                        capture_output=True,
                        text=True,
                        timeout=COMPILE_TIMEOUT_S,
                        check=False,
                    )
                except (OSError, subprocess.SubprocessError) as err:
                    raise Unavailable(f"{command[0]} could not compile {self.source.name}: {err}") from err
                if not done.returncode:
                    break
            else:
                why = first_line(done.stderr) or first_line(done.stdout)
                raise Unavailable(f"{command[0]} failed on {self.source.name} (exit {done.returncode}): {why}")
            self.flags = flags
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


POINTER, COUNT = ctypes.c_void_p, ctypes.c_int64


def bind_delta(lib: ctypes.CDLL) -> None:
    """The compaction's signature on each width's function, then a self-check of one small case (a run of 64
    words and a tail, changes in both): a build that computes otherwise is not used."""
    for width in WIDTHS:
        fn = getattr(lib, f"rlsync_delta_w{width}")
        fn.argtypes = [POINTER, POINTER, COUNT, COUNT, POINTER, POINTER]  # new, old, n, base, pos, val
        fn.restype = COUNT
    n, changed = 300, [3, 130, 255, 299]
    new = (ctypes.c_uint16 * n)(*range(n))
    old = (ctypes.c_uint16 * n)(*(0 if i in changed else i for i in range(n)))
    pos, val = (ctypes.c_int32 * n)(), (ctypes.c_uint16 * n)()
    count = lib.rlsync_delta_w2(new, old, n, 10, pos, val)
    if (list(pos[:count]), list(val[:count]), list(old)) != ([10 + i for i in changed], changed, list(new)):
        raise Unavailable(f"{lib._name}: its self-check found {count} changes, not {len(changed)} (miscompiled?)")


DELTA = Library(Path(__file__).with_name("delta.c"), check=bind_delta)


def compaction(width: int):
    """The C compaction for elements of `width` bytes, `fn(new, old, n, base, pos, val) -> count` (pointers as
    ints; pos None: count and copy only), or None where it is off, failed or has no such width."""
    lib = DELTA.get()
    if lib is None or width not in WIDTHS:
        return None
    return getattr(lib, f"rlsync_delta_w{width}")
