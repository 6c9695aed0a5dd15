"""How numbers and errors read in tables and messages: seconds, bytes, shares, markdown tables, one line.

Every table and message of the package (the console, the closing tables, report.md, error lines)
formats through here, so a time reads the same wherever it is printed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

MIB = 2**20
GIB = 2**30


def fmt_path(path: Any) -> str:
    """A path as a user reads it back: relative under the working directory, `~/...` under home."""
    import os

    full = os.path.abspath(os.fspath(path))
    for base, shown in ((os.getcwd(), ""), (os.path.expanduser("~"), "~")):
        if base not in ("", os.sep) and (full == base or full.startswith(base + os.sep)):
            rest = os.path.relpath(full, base)
            return os.path.join(shown, rest) if shown else rest
    return full


def is_number(value: Any) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def time_unit(seconds: float) -> tuple[float, str, int]:
    """Scale, unit and decimals that show `seconds` with about three significant digits."""
    x = abs(seconds)
    if x >= 0.1:
        return 1.0, "s", 2 if x < 100 else 1  # "0.63 s", "152.6 s", as in the reference tables
    scale, unit = (1e3, "ms") if x >= 1e-4 else (1e6, "µs")
    magnitude = math.floor(math.log10(x * scale)) if x > 0 else 0
    return scale, unit, max(0, 2 - magnitude)


def fmt_seconds(x: Optional[float]) -> str:
    """ "0.63 s", "12.3 ms", "n/a"."""
    if x is None:
        return "n/a"
    scale, unit, decimals = time_unit(x)
    return f"{x * scale:.{decimals}f} {unit}"


def fmt_range(lo: Optional[float], hi: Optional[float]) -> str:
    """ "0.63 to 0.66 s": both ends in the unit and precision of the larger one."""
    if lo is None or hi is None:
        return "n/a"
    if lo == hi:
        return fmt_seconds(lo)
    scale, unit, decimals = time_unit(max(abs(lo), abs(hi)))
    if lo and round(lo * scale, decimals) == 0:  # "0.00 to 0.16 s" would call 2.9 ms zero: each end in its unit
        return f"{fmt_seconds(lo)} to {fmt_seconds(hi)}"
    return f"{lo * scale:.{decimals}f} to {hi * scale:.{decimals}f} {unit}"


def fmt_spread(median: Optional[float], lo: Optional[float], hi: Optional[float]) -> str:
    """ "0.64 s (0.63 to 0.66 s)": a median and the range it sits in (none when every value was the same)."""
    return fmt_seconds(median) + ("" if lo is None or hi is None or lo == hi else f" ({fmt_range(lo, hi)})")


def fmt_sig(x: Optional[float], decimals: int = 2, sig: int = 2) -> str:
    """`x` with `decimals` decimals, or as many more as show `sig` significant digits, never in
    e-notation: "0.82", "0.0034" (not "0.00"), "12.50"; "0" for zero, "n/a" for None."""
    if x is None:
        return "n/a"
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    return f"{x:.{max(decimals, sig - 1 - math.floor(math.log10(abs(x))))}f}"


def fmt_share(share: Optional[float]) -> str:
    """A share of the step in percent, with more digits the smaller it is: "12.3 %", "0.12 %",
    "0.04 %", "0.003 %": never "0.00 %" for a share that is not zero. Every printed share (the
    report's table, its console lines, its plots) goes through here so that they agree."""
    if share is None:
        return "n/a"
    pct = share * 100
    return f"{fmt_sig(pct, decimals=1 if abs(pct) >= 10 else 2, sig=1)} %"


def fmt_ratio(x: Optional[float]) -> str:
    """ "1.35x", "12.0x", "0.0030x": a ratio of two times, never rounded to zero."""
    return "n/a" if x is None else f"{fmt_sig(x, decimals=2 if abs(x) < 10 else 1)}x"


def fmt_bytes(n: Optional[float]) -> str:
    """ "512 MiB", "38.1 MiB", "1.11 GiB", "4.00 KiB": binary units, about three significant digits."""
    if n is None:
        return "n/a"
    size, unit = next(((s, u) for s, u in ((GIB, "GiB"), (MIB, "MiB"), (1024, "KiB")) if abs(n) >= s), (1, "B"))
    value = n / size
    return f"{value:.{2 if abs(value) < 10 else 1 if abs(value) < 100 else 0}f} {unit}"


def fmt_mib(nbytes: Optional[float]) -> str:
    """A number of MiB without its unit, for a column whose header names it: "296.8", "0.125"."""
    if nbytes is None:
        return "n/a"
    mib = nbytes / MIB
    return f"{mib:.1f}" if mib >= 10 else f"{mib:.3g}"


def plural(count: int, noun: str, many: Optional[str] = None) -> str:
    """ "1 run", "2 runs", "0 runs"."""
    return f"{count} {noun if count == 1 else (many or noun + 's')}"


def markdown_table(header: Iterable[Any], rows: Iterable[Iterable[Any]]) -> str:
    """A GitHub markdown table, cells as given (a "|" inside a cell escaped), no padding."""

    def line(cells: Iterable[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    header = list(header)
    return "\n".join([line(header), "|" + "---|" * len(header), *(line(row) for row in rows)])


def first_line(text: Any, default: str = "") -> str:
    """The first non-blank line of a message (an exception's, say), stripped; `default` when there is none."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else default


def error_line(err: BaseException) -> str:
    """ "ValueError: the first line of its message": an error in one line for a summary or a log."""
    name = type(err).__name__
    return f"{name}: {first_line(err)}" if first_line(err) else name
