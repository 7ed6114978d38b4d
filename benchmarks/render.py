"""``python benchmarks/render.py`` writes BENCHMARKS.md from the results kept under
``benchmarks/results/`` and the prose under ``benchmarks/page/``; ``--check`` writes nothing and
exits 1, printing the difference, where the committed page is not what they give."""

import sys
from pathlib import Path


def main() -> int:
    # Run as a script this folder leads the path; the page's modules are the ``benchmarks``
    # package of the checkout this file is in.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.build import main as build

    return build(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
