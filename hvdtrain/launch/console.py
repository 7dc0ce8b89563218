"""The launcher's own lines: every one starts with ``hvdtrain.launch:`` so that, between the
ranks' output, it is clear who speaks."""
from __future__ import annotations

import sys

PROGRAM = "hvdtrain.launch"


def say(message: str) -> None:
    print(f"{PROGRAM}: {message}", file=sys.stderr, flush=True)


def error(message: str) -> None:
    print(f"{PROGRAM}: error: {message}", file=sys.stderr, flush=True)
