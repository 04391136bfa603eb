"""Byte sizes on command lines (``--tier-bytes 8GiB``), read as the CLI reads them.

The Rust CLI parses ``--tier-bytes`` with the ``parse-size`` crate; the worker and the fleet take
the same spellings, so one size means one bound whichever launcher is used: a number (a fraction
allowed, rounded to the nearest byte), then an optional unit, case-insensitive, ``B`` optional:
``K`` / ``KB`` = 1000, ``Ki`` / ``KiB`` = 1024, and so on through ``E``; ``_`` and spaces group digits.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["byte_size"]

_SIZE = re.compile(r"([0-9][0-9_ ]*(?:\.[0-9_ ]*)?)\s*(?:([kmgtpe])(i)?)?b?", re.IGNORECASE)
_POWERS = "kmgtpe"


def byte_size(text: str) -> int:
    """``"8GiB"`` -> ``8 << 30``, ``"10GB"`` -> ``10**10``, ``"1024"`` -> 1024; anything else is a
    ``ValueError`` (which argparse reports as a bad value of the option)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r}: not a size (e.g. 512MiB, 8GiB, 10GB, 1048576)")
    number = Fraction(match.group(1).replace("_", "").replace(" ", ""))
    unit, binary = match.group(2), match.group(3)
    if unit is not None:
        number *= (1024 if binary else 1000) ** (_POWERS.index(unit.lower()) + 1)
    return round(number)
