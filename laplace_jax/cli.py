"""What every command line of the project shares: a bad flag is one `error:` line and exit status 2."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_USAGE = 2   # a usage, config or data problem: the user fixes the command and runs it again


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line naming it and the fix (not the whole usage text)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be at least 1")
    return n
