"""`kazma --version` start time against a bare interpreter (`python -c pass`). Prints numbers; asserts nothing.

python bench/cli_start.py [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def timed(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)  # noqa: S603 - our own interpreter and module
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description="kazma --version start time")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "kazma --version": [sys.executable, "-m", "kazma.bot.cli", "--version"],
        "kazma --help": [sys.executable, "-m", "kazma.bot.cli", "--help"],
    }
    results = {name: timed(argv, args.runs) for name, argv in cases.items()}
    bare = statistics.median(results["python -c pass"])
    print(f"{'':<18}{'median s':>10}{'min s':>8}{'x bare':>8}")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:<18}{median:>10.3f}{min(values):>8.3f}{median / bare:>8.1f}")


if __name__ == "__main__":
    main()
