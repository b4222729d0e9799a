"""Refresh the sample demo report in the docs: one command, on a quiet machine.

    python benchmarks/demo_docs.py                # the full default demo
    python benchmarks/demo_docs.py --quick        # any `ace-mw demo` flag passes through

Runs `ace-mw demo --out docs/demo` (report.md and the charts land in docs/demo/; report.json stays
out of git), then copies the report's opening (the policy table, the answer and the conditions
line) into README.md and docs/benchmarks.md, between their `demo-report` markers.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from ace_mw.cli import main as ace_mw

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "demo"
SAMPLES = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md")
MARKERS = re.compile(r"(<!-- demo-report:begin -->\n).*?(<!-- demo-report:end -->)", re.S)


def main(argv: list[str]) -> int:
    status = ace_mw(["demo", "--out", str(OUT), *argv])
    if status != 0:
        return status
    report = (OUT / "report.md").read_text()
    opening = report.split("\n## ", 1)[0].split("\n", 2)[2].strip()  # without the title line
    for path in SAMPLES:
        text = path.read_text()
        if not MARKERS.search(text):
            print(f"no demo-report markers in {path}", file=sys.stderr)
            return 1
        path.write_text(MARKERS.sub(lambda m: m.group(1) + opening + "\n" + m.group(2), text))
    print(f"updated {', '.join(str(p.relative_to(ROOT)) for p in SAMPLES)} and {OUT.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
