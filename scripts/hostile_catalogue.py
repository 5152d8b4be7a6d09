"""Run the catalogue of hostile inputs (tests/faults/hostile_cases.py) and print the counts.

    python scripts/hostile_catalogue.py [--groups library cli ranks]

Prints one line per case (outcome, mechanism, name) and the counts per outcome and per
mechanism as markdown tables. ``library`` runs in this process (seconds); ``cli`` starts the
``megatron-packing`` command per case; ``ranks`` spawns two gloo ranks per case (minutes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faults.hostile_cases import run_cases, summary  # noqa: E402

OUTCOMES = ("correct", "clear", "unclear", "traceback", "silent", "lost", "hang")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", nargs="+", default=["library", "cli", "ranks"],
                        choices=["library", "cli", "ranks"])
    parser.add_argument("--verbose", action="store_true", help="print each case's detail")
    args = parser.parse_args()
    results = run_cases(tuple(args.groups))
    for case, outcome, detail in results:
        print(f"{outcome:9s} {case.mechanism:22s} {case.name}"
              + (f"\n          {detail}" if args.verbose or outcome not in ("correct", "clear")
                 else ""))
    counts, by_mechanism = summary(results)
    print(f"\n{len(results)} cases ({', '.join(args.groups)})\n")
    print("| " + " | ".join(OUTCOMES) + " |")
    print("|" + "---:|" * len(OUTCOMES))
    print("| " + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + " |")
    print("\n| mechanism | cases | correct | clear | other |")
    print("|---|---:|---:|---:|---:|")
    for mechanism, c in by_mechanism.items():
        other = sum(c.values()) - c["correct"] - c["clear"]
        print(f"| {mechanism} | {sum(c.values())} | {c['correct']} | {c['clear']} | {other} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
