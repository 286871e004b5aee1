"""The argument parser of every command line: a usage error is one `error:` line."""

from __future__ import annotations

import argparse
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors (an unknown flag, a value of the wrong type or out of its
    choices, a missing argument) are one line naming the command and how to see its usage, exit
    status 2, instead of the usage block and the error (subcommands' parsers are of this class
    too: add_subparsers makes them of their parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")
