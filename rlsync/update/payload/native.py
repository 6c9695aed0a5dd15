"""The payloads' C kernels on a CPU: compiled at first use by the system's C compiler, cached per user, loaded
with ctypes, as inductor builds its CPU kernels.

`DELTA` is delta.c (the delta's compaction, one pass per chunk: kernels.compact_chunk; its apply:
kernels.scatter_changed); `FP8` is fp8.c (FP8's block quantize and dequantize of 2-D tensors of any shape by block
rows: kernels.native_quantize, kernels.native_dequantize).
Each one's first use in a process compiles it (once: a lock) with `$CC` (split as a shell would, no shell run), else the first of cc, gcc,
clang on PATH, for this CPU (`-march=native`; without it where the compiler refuses it), into
`$XDG_CACHE_HOME/rlsync/kernels` (else ~/.cache/rlsync/kernels), named by a hash of the source, the flags, the
compiler's version, the machine and the CPU's model and features (/proc/cpuinfo), so a home directory shared by
nodes of other CPUs, or by other compilers, never loads another's build. It compiles to a temporary name
renamed into place (`os.replace`: two processes compiling at once both load a whole file), then loads it with
`ctypes.CDLL`, whose calls release the GIL (the update's chunk threads run it in parallel). Nothing from a run's
config or model goes into the command.

Any failure (no compiler, a compile error, a load error, its self-check) leaves the kernel unavailable, its
reason in `why_not()`, and the caller runs its other path (numpy's steps, torch's kernels): never an exception
into a run. Off with
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
        return [os.path.realpath(found), *words[1:]]
    for name in COMPILERS:
        found = shutil.which(name)
        if found:  # its real file: one build's name whichever link on PATH found it (/bin/cc, /usr/bin/cc)
            return [os.path.realpath(found)]
    raise Unavailable(f"no C compiler: none of {', '.join(COMPILERS)} on PATH and $CC unset")


def compiler_env(command: list[str]) -> dict[str, str]:
    """The compiler's environment: this process's, with a PATH where the compiler's own helpers (the linker,
    the assembler) are found: a process may run without PATH (gcc's collect2 then cannot find `ld`), so the
    system's default path and the compiler's own folder stand in for a missing one or follow a given one."""
    given = os.environ.get("PATH") or os.defpath
    folders = [given, os.defpath, str(Path(command[0]).parent)]
    return {**os.environ, "PATH": os.pathsep.join(dict.fromkeys(f for f in folders if f))}


def version_of(command: list[str]) -> str:
    """The compiler's `--version` text, part of the build's key (another compiler, another build)."""
    try:
        done = subprocess.run(
            [*command, "--version"], capture_output=True, text=True, timeout=30, check=False, env=compiler_env(command)
        )
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

    def describe(self, fallback: str) -> str:
        """What runs in its place on a CPU, for a run's record: its file's name, or `fallback` and why it did not."""
        why = self.why_not()
        return self.source.name if why is None else f"{fallback} ({self.source.name}: {why})"

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
                        env=compiler_env(command),
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
    """The compaction's and the apply's signatures on each width's functions, then a self-check of one small case
    (a run of 64 words and a tail, changes in both; their lines; the apply of what it found): a build that
    computes otherwise is not used."""
    for width in WIDTHS:
        fn = getattr(lib, f"rlsync_delta_w{width}")
        # new, old, n, base, pos, val, the line's log2 bytes, lines (count, first, last)
        fn.argtypes = [POINTER, POINTER, COUNT, COUNT, POINTER, POINTER, ctypes.c_int, POINTER]
        fn.restype = COUNT
    for fn in [lib.rlsync_delta_f32_bf16]:  # float32 cast to bfloat16 in the pass, then as width 2
        fn.argtypes = [POINTER, POINTER, COUNT, COUNT, POINTER, POINTER, ctypes.c_int, POINTER]
        fn.restype = COUNT
    for width in WIDTHS:
        fn = getattr(lib, f"rlsync_scatter_w{width}")
        fn.argtypes = [POINTER, POINTER, POINTER, COUNT, COUNT]  # dst, pos, val, n, origin
        fn.restype = None
    n, changed = 300, [3, 130, 131, 255, 299]
    new = (ctypes.c_uint16 * n)(*range(n))
    old = (ctypes.c_uint16 * n)(*(0 if i in changed else i for i in range(n)))
    pos, val, lines = (ctypes.c_int32 * n)(), (ctypes.c_uint16 * n)(), (ctypes.c_int64 * 3)()
    count = lib.rlsync_delta_w2(new, old, n, 10, pos, val, 6, lines)
    # positions 13, 140, 141, 265, 309: 2-byte elements in 64-byte lines 0, 4, 4, 8 and 9
    if (list(pos[:count]), list(val[:count]), list(old), list(lines)) != (
        [10 + i for i in changed],
        changed,
        list(new),
        [4, 0, 9],
    ):
        raise Unavailable(f"{lib._name}: its self-check found {count} changes, not {len(changed)} (miscompiled?)")
    target = (ctypes.c_uint16 * n)()
    lib.rlsync_scatter_w2(target, pos, val, count, 10)
    if [target[i] for i in changed] != changed or sum(target) != sum(changed):
        raise Unavailable(f"{lib._name}: its self-check's apply wrote other elements (miscompiled?)")
    # float32 -> bfloat16 in the pass: 1.0 (0x3F80), a tie rounding down to even and one rounding up, NaN (0xFFFF)
    src = (ctypes.c_uint32 * 4)(0x3F800000, 0x3F808000, 0x3F818000, 0x7FC00000)
    old = (ctypes.c_uint16 * 4)(0x3F80, 0, 0, 0)
    count = lib.rlsync_delta_f32_bf16(src, old, 4, 0, pos, val, 6, None)
    if (count, list(pos[:count]), list(old)) != (3, [1, 2, 3], [0x3F80, 0x3F80, 0x3F82, 0xFFFF]):
        raise Unavailable(f"{lib._name}: its self-check's float32 -> bfloat16 pass differs from torch's (miscompiled?)")


DELTA = Library(Path(__file__).with_name("delta.c"), check=bind_delta)


def by_width(name: str, width: int):
    """delta.c's `rlsync_<name>_w<width>`, or None where it is off, failed or has no such width."""
    lib = DELTA.get()
    if lib is None or width not in WIDTHS:
        return None
    return getattr(lib, f"rlsync_{name}_w{width}")


def compaction(width: int):
    """The C compaction for elements of `width` bytes, `fn(new, old, n, base, pos, val, shift, lines) -> count`
    (pointers as ints; pos None: count and copy only; lines None: no lines counted), or None (`by_width`)."""
    return by_width("delta", width)


def cast_compaction():
    """The C compaction of float32 elements against bfloat16 last values, each cast as torch casts it (`fn` as
    `compaction`'s), or None where it is off or failed."""
    lib = DELTA.get()
    return None if lib is None else lib.rlsync_delta_f32_bf16


def scatter(width: int):
    """The C apply for elements of `width` bytes, `fn(dst, pos, val, n, origin)`, or None (`by_width`)."""
    return by_width("scatter", width)


BLOCK_CHECK = 128  # fp8.c's block, each way
FP8_TARGETS = {"bf16": 2, "f32": 4}  # the engine dtypes fp8.c dequantizes into (rlsync_fp8_dequantize_<name>)
# The self-check: e4m3fn bytes of float32 values whose conversion takes each of c10's paths (zeros, a subnormal
# result and a tie between two subnormals, a normal one and ties rounding to even either way, a carry into the
# next power of two, 448 and what rounds or saturates to it (470: a carry into NaN's bits), infinity, NaN), as
# torch gives them.
FP8_CHECK = (
    (0.0, 0x00), (-0.0, 0x80), (0.001953125, 0x01), (0.0029296875, 0x02), (-0.005859375, 0x83), (1.0, 0x38),
    (1.0625, 0x38), (1.1875, 0x3A), (-3.75, 0xC7), (1.9375, 0x40), (448.0, 0x7E), (464.0, 0x7E), (470.0, 0x7E),
    (1e9, 0x7E), (float("inf"), 0x7E), (float("-inf"), 0xFE), (float("nan"), 0x7F),
)  # fmt: skip


def bind_fp8(lib: ctypes.CDLL) -> None:
    """The kernels' signatures, then a self-check: the conversion of `FP8_CHECK`'s values and back, and one
    block's quantize and bf16 dequantize (its scale 2: every value exact). A build that computes otherwise is not
    used."""
    lib.rlsync_fp8_quantize.argtypes = [POINTER, COUNT, COUNT, COUNT, COUNT, POINTER, POINTER]  # x, rows, cols,
    lib.rlsync_fp8_quantize.restype = None  # first and last block row + 1, q, scale
    for name in FP8_TARGETS:
        fn = getattr(lib, f"rlsync_fp8_dequantize_{name}")
        fn.argtypes = [POINTER, POINTER, COUNT, COUNT, COUNT, COUNT, POINTER]  # q, scale, rows, cols, b0, b1, out
        fn.restype = None
    for fn in (lib.rlsync_fp8_from_float, lib.rlsync_fp8_to_float):
        fn.argtypes = [POINTER, COUNT, POINTER]  # in, n, out
        fn.restype = None
    n = len(FP8_CHECK)
    values = (ctypes.c_float * n)(*(v for v, _ in FP8_CHECK))
    got = (ctypes.c_uint8 * n)()
    lib.rlsync_fp8_from_float(values, n, got)
    back = (ctypes.c_float * n)()
    lib.rlsync_fp8_to_float(got, n, back)
    if list(got) != [b for _, b in FP8_CHECK] or list(back[:4]) != [0.0, -0.0, 0.001953125, 0.00390625]:
        raise Unavailable(f"{lib._name}: its self-check's e4m3 conversions differ from torch's (miscompiled?)")
    k = BLOCK_CHECK * BLOCK_CHECK  # one block: -448 and 448 (scale 2 * 448 = 896) among values 2 * small integers
    x = (ctypes.c_float * k)(*(float(2 * ((i % 17) - 8)) for i in range(k)))
    x[5], x[k - 1] = -896.0, 896.0
    q, scale, out = (ctypes.c_uint8 * k)(), (ctypes.c_float * 1)(), (ctypes.c_uint16 * k)()
    lib.rlsync_fp8_quantize(x, BLOCK_CHECK, BLOCK_CHECK, 0, 1, q, scale)
    lib.rlsync_fp8_dequantize_bf16(q, scale, BLOCK_CHECK, BLOCK_CHECK, 0, 1, out)
    exact = [ctypes.c_uint32.from_buffer_copy(ctypes.c_float(v)).value >> 16 for v in x]  # bf16's bits
    if scale[0] != 2.0 or list(out) != exact:
        raise Unavailable(f"{lib._name}: its self-check's block quantize and dequantize differ (miscompiled?)")


FP8 = Library(Path(__file__).with_name("fp8.c"), check=bind_fp8)


def fp8_kernels():
    """fp8.c's loaded library (`rlsync_fp8_quantize`, `rlsync_fp8_dequantize_<FP8_TARGETS name>`), or None where
    it is off or failed (`FP8.why_not()` says why)."""
    return FP8.get()
