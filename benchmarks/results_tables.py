"""The benchmark tables in README.md and docs/benchmarks.md, generated from benchmarks/results/.

A document includes a results file between ``<!-- results: NAME.md -->`` and
``<!-- /results -->``; this script copies the file there (its command and date first, then what
the benchmark printed), so no figure in the docs is typed by hand. ``--write`` rewrites the
documents; ``--check`` exits 1 naming each stale include (a test runs it).

    python benchmarks/results_tables.py --write | --check
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md")
INCLUDE = re.compile(r"(<!-- results: (?P<name>[\w.-]+\.md) -->\n)(?P<body>.*?)(<!-- /results -->)",
                     re.DOTALL)


def body(name: str) -> str:
    """What goes between the markers: the results file, its first line made a caption."""
    path = RESULTS / name
    if not path.is_file():
        raise FileNotFoundError(f"an include names {name}, which is not in {RESULTS}")
    text = path.read_text().strip("\n")
    return f"<sub>`benchmarks/results/{name}`</sub>\n\n{text}\n"


def rendered(text: str) -> str:
    """``text`` with every include filled from its results file."""
    return INCLUDE.sub(lambda m: m.group(1) + body(m.group("name")) + m.group(4), text)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = []
    for document in DOCUMENTS:
        text = document.read_text()
        new = rendered(text)
        if new != text:
            if args.write:
                document.write_text(new)
            else:
                names = [m.group("name") for m in INCLUDE.finditer(text)
                         if m.group("body") != body(m.group("name"))]
                stale.append(f"{document.relative_to(ROOT)}: {', '.join(names)}")
    if stale:
        print("stale benchmark includes (run python benchmarks/results_tables.py --write): "
              + "; ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
