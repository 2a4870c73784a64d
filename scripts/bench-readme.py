#!/usr/bin/env python3
"""Copies the yardstick targets of a bench report into the README.

    scripts/bench-readme.py REPORT.md README.md

`make bench` (scripts/bench.sh, full runs only) calls it after writing docs/bench/REPORT.md:
the table of the report's section "Targets ...: against the yardstick" replaces what stands
between the README's markers `<!-- bench-summary ... -->` and `<!-- /bench-summary -->`,
with the run's time and machine line above it. Exits non-zero, changing nothing, when the
report has no such table or the README no such markers.
"""

import re
import sys
from pathlib import Path


def targets_table(report):
    """The first Markdown table of the yardstick targets section, as its lines."""
    section = re.search(r"^## Targets[^\n]*against the yardstick[^\n]*\n(.*?)(?=^## |\Z)", report, re.M | re.S)
    if not section:
        sys.exit("bench-readme: the report has no section of targets against the yardstick")
    lines = section.group(1).splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        sys.exit("bench-readme: the targets section has no table")
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    return table


def run_line(report):
    """The run's time and machine, from the report's list at its top."""
    field = lambda name: (re.search(rf"^- {name}: (.*)$", report, re.M) or [None, None])[1]
    date, cpu = field("date"), field("cpu")
    if not date:
        return None
    return f"Measured by `make bench` on {date}" + (f" ({cpu})" if cpu else "") + ", ratios of steps run side by side:"


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    report_path, readme_path = Path(sys.argv[1]), Path(sys.argv[2])
    report, readme = report_path.read_text(), readme_path.read_text()
    begin = re.search(r"^<!-- bench-summary[^\n]*-->\n", readme, re.M)
    end = re.search(r"^<!-- /bench-summary -->$", readme, re.M)
    if not begin or not end or end.start() < begin.end():
        sys.exit("bench-readme: the README has no <!-- bench-summary --> ... <!-- /bench-summary --> block")
    table = targets_table(report)
    body = []
    line = run_line(report)
    if line:
        body += [line, ""]
    body += table
    text = readme[: begin.end()] + "\n".join(body) + "\n" + readme[end.start() :]
    readme_path.write_text(text)
    print(f"bench-readme: {len(table) - 2} targets written into {readme_path}")


if __name__ == "__main__":
    main()
