"""Free text an admin types (display names, reasons, purge values): shown in the dashboard, printed
by the command line and kept with policy versions and tenants, so it holds no control or format
characters. A right-to-left override makes a name read as another (`Acme\u202egnp.exe`), a terminal
escape recolours or rewrites an operator's screen; both were accepted and shown as typed (found by a
review). Reasons may span lines and hold tabs; single-line values may not."""

from __future__ import annotations

import unicodedata
from functools import partial
from typing import Annotated

from pydantic import AfterValidator

_REFUSED = "must not hold control or format characters (such as bidi overrides or terminal escapes)"


def plain(value: str, *, lines: bool = False) -> str:
    """`value` if no character of it is a control (Cc: `\\n` and `\\t` allowed with `lines`) or a
    format character (Cf: bidi controls, zero-width characters); ValueError otherwise."""
    if value.isascii() and value.isprintable():
        return value  # the common case, checked in C
    for ch in value:
        category = unicodedata.category(ch)
        if category == "Cf" or (category == "Cc" and not (lines and ch in "\n\t")):
            raise ValueError(_REFUSED)
    return value


PlainLine = Annotated[str, AfterValidator(plain)]
PlainText = Annotated[str, AfterValidator(partial(plain, lines=True))]
