#!/usr/bin/env python3
"""The GPU tests a run cut by its time limit did not finish, one test id a line.

    python bench/tests_left.py tests.log collected.txt > left.txt
    TESTS_IDS_FILE=left.txt bash bench/gpu_run.sh tests

``tests.log``: the cut run's log with ``TESTS_VERBOSITY=-v`` (xdist prints ``PASSED <id>`` or
``FAILED <id>`` for every test that finished); ``collected.txt``: ``pytest -m gpu
--collect-only -q`` of the same tree. Prints the ids that neither passed nor failed, one a line.
"""
from __future__ import annotations

import re
import sys


def finished(log: str) -> set[str]:
    return set(re.findall(r"(?:PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR) (tests/\S+)", log))


def main(argv: list[str]) -> int:
    log, collected = (open(p).read() for p in argv[:2])
    done = finished(log)
    ids = [line.strip() for line in collected.splitlines() if line.startswith("tests/")]
    left = [i for i in ids if i not in done]
    print("\n".join(left))
    print(f"{len(ids) - len(left)} of {len(ids)} finished, {len(left)} left", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
