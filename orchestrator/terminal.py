"""Text that reaches a terminal: control characters from user input or from logs are shown, never obeyed.

An escape sequence in a config value, an override or a rank's log tail would otherwise be executed
by the user's terminal when an error echoes it (clear the screen, recolour, retitle the window, or
hide the rest of the message). Every entry point prints its errors through ``printable``, and refuses
arguments that hold control characters before Hydra's parser echoes them raw (``refuse_control``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# C0 controls but newline and tab, DEL, and C1 controls (0x9b is a one-byte CSI on some terminals).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """``str(text)`` with every control character written as its escape (``\\x1b``, ``\\r``)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


def one_line(text: object) -> str:
    """``printable``, with line breaks escaped too: for a message that must stay one line (an
    ``error:`` line) though it echoes a value that holds one."""
    return printable(text).replace("\n", "\\n")


def refuse_control(argv: Sequence[str]) -> str | None:
    """An error for the first argument that holds a control character, or None."""
    for position, arg in enumerate(argv[1:], start=1):
        if _CONTROL.search(arg):
            return (f"argument {position} ({printable(arg)!s}) holds control characters, which no "
                    f"config value needs and a terminal would execute when it is echoed: remove them")
    return None
