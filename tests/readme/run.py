#!/usr/bin/env python3
"""Runs the examples of README.md and docs/lab.md and compares their output with what the pages show.

Every ```console block of a page is executed, in the order of the page, in one bash session
per page started in the repository's root (so that `pay`, `$U`, `$API`, `$TENANT` set by one
block serve the next; each page starts with its own `eval "$(make lab)"`). In a block, a line starting with `$ ` is a command; it goes on over the
following lines while it ends with `\\` or bash finds it incomplete (an open quote: a
multi-line SQL string); the lines after it, up to the next command, are its expected output
(stdout and stderr together, as a terminal shows them).

A command passes when it exits 0 (a README command that shows a failure ends with
`; echo "exit $?"`), its output ends with a newline, and its output matches, line by line,
after masking what differs on every run:
  - UUIDs (also written `4717c42b-…` in a page) become <uuid>;
  - timestamps (`2026-11-30T13:08:04.204465Z`, psql's `2026-11-30 13:08:04.2+00`) <time>;
  - durations `23:59:59` <duration>;
  - runs of blanks are one blank and runs of dashes `---` (psql's column widths);
  - any other `…` in a page stands for any text within its line.

It also checks that no link of README.md or docs/ points outside the repository or to a file
that does not exist, and that the files the pages name (in backticks, and in the tree of
its Development section) exist.

The server must be running: `make readme-test` starts `make run` and runs this script against
it (scripts/readme-test.sh). Each result names its page and line; the closing line is
"readme: N passed, N failed".
"""

import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TOP = Path(__file__).resolve().parents[2]
README = TOP / "README.md"
# The pages whose console blocks run, each in a bash session of its own, in this order.
PAGES = [README, TOP / "docs" / "lab.md"]
MARK = "\x1e"
TIMEOUT_SECS = 600

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
TIME = r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d(?::\d\d)?)?"
DURATION = r"\b\d\d:\d\d:\d\d(?:\.\d+)?\b"


def console_blocks(text, page):
    """(line number, [lines]) of every ```console block."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if current is None:
            if line.strip() == "```console":
                current, start = [], number + 1
        elif line.strip() == "```":
            blocks.append((start, current))
            current = None
        else:
            current.append(line)
    if current is not None:
        sys.exit(f"{page}:{start}: a ```console block is not closed")
    return blocks


def complete(command):
    """Whether bash would run `command` as it is, rather than wait for more lines."""
    if command.endswith("\\"):
        return False
    return subprocess.run(["bash", "-n", "-c", command], capture_output=True).returncode == 0


def examples(text, page):
    """[(line number, command, [expected lines])] in the order of the page."""
    found = []
    for start, lines in console_blocks(text, page):
        i = 0
        while i < len(lines):
            line = lines[i]
            if not line.startswith("$ "):
                sys.exit(f"{page}:{start + i}: output before any command in a console block")
            number, command = start + i, line[2:]
            i += 1
            while not complete(command) and i < len(lines) and not lines[i].startswith("$ "):
                command += "\n" + lines[i]
                i += 1
            if not complete(command):
                sys.exit(f"{page}:{number}: the command is incomplete: {command!r}")
            expected = []
            while i < len(lines) and not lines[i].startswith("$ "):
                expected.append(lines[i])
                i += 1
            found.append((number, command, expected))
    return found


def run_all(commands):
    """Runs the commands in one bash, stdout and stderr together; [(status, output)]."""
    script = ["cd " + sh_quote(str(TOP))]
    for n, command in enumerate(commands):
        script.append(command)
        script.append(f"printf '{MARK}%d {n}{MARK}\\n' \"$?\"")
    with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
        f.write("\n".join(script) + "\n")
        path = f.name
    # The pages' make commands run as a reader's would, not as sub-makes of make readme-test
    # (which would print "Entering directory" lines).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    try:
        done = subprocess.run(
            ["bash", "--noprofile", "--norc", path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=TIMEOUT_SECS,
        )
    finally:
        os.unlink(path)
    out = done.stdout.decode("utf-8", "replace")
    results, pos = [], 0
    for match in re.finditer(f"{MARK}(\\d+) (\\d+){MARK}\n", out):
        results.append((int(match.group(1)), out[pos : match.start()]))
        pos = match.end()
    if len(results) != len(commands):
        results += [(None, out[pos:])] + [(None, "")] * (len(commands) - len(results) - 1)
    return results


def sh_quote(s):
    return "'" + s.replace("'", "'\\''") + "'"


def mask(line, from_page):
    if from_page:
        line = re.sub(r"[0-9a-f]{8}-…", "<uuid>", line)
    line = re.sub(UUID, "<uuid>", line)
    line = re.sub(TIME, "<time>", line)
    line = re.sub(DURATION, "<duration>", line)
    line = re.sub(r"-{3,}", "---", line)
    return re.sub(r"\s+", " ", line).strip()


def matches(expected, actual):
    if len(expected) != len(actual):
        return False
    for want, got in zip(expected, actual):
        pattern = ".*".join(re.escape(part) for part in want.split("…"))
        if not re.fullmatch(pattern, got):
            return False
    return True


def outside_links():
    """Relative links of README.md and docs/*.md that leave the repository or lead nowhere."""
    bad = []
    for doc in [README, *sorted((TOP / "docs").rglob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                path = (doc.parent / target.split("#")[0]).resolve()
                where = f"{doc.relative_to(TOP)}:{number}: {target}"
                if TOP not in path.parents and path != TOP:
                    bad.append(f"{where} points outside the repository")
                elif not path.exists():
                    bad.append(f"{where} does not exist")
    return bad


def stale_names():
    """Files the pages name that the repository does not have: paths in backticks (a path
    git ignores, like `.pgdata/`, is made by a command; `migrations/V3` names the file it
    begins), and the file and folder names of the tree drawn under "## Development"."""
    tracked = subprocess.run(["git", "ls-files"], cwd=TOP, capture_output=True, text=True, check=True).stdout.split()
    folders = {str(parent) for f in tracked for parent in Path(f).parents if str(parent) != "."}
    names = {Path(f).name for f in tracked} | {Path(d).name + "/" for d in folders} | {d + "/" for d in folders}

    def exists(path):
        return (
            (TOP / path).exists()
            or path in names
            or any(f.startswith(path) for f in tracked)
            or subprocess.run(["git", "check-ignore", "-q", path], cwd=TOP, capture_output=True).returncode == 0
        )

    bad = []
    for doc in PAGES:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for path in re.findall(r"`((?:[\w.-]+/)+[\w.-]*|[\w-]+\.(?:rs|sh|sql|md|json|yml|toml))`", line):
                # docs/ pages name files from the repository's root, as the README does.
                if not exists(path):
                    bad.append(f"{doc.relative_to(TOP)}:{number}: `{path}`")
    text = README.read_text()
    tree = re.search(r"## Development\n\n```\n(.*?)```", text, re.S)
    if tree:
        # Indented names are inside the folder of the last unindented one; the names of an
        # entry that is a folder (and of its continuation lines) may also be inside it.
        first = text[: tree.start(1)].count("\n") + 1
        folder = entry = ""
        for offset, line in enumerate(tree.group(1).splitlines()):
            indent = len(line) - len(line.lstrip())
            tokens = re.findall(r"(?:^|\s)((?:[\w.-]+/)+[\w.-]*|[\w-]+\.(?:rs|sh|sql))(?=[\s,)]|$)", line)
            if indent == 0 and tokens:
                folder, entry = (tokens[0] if tokens[0].endswith("/") else ""), ""
            elif indent == 2 and tokens:
                entry = folder + tokens[0] if tokens[0].endswith("/") else ""
            for name in tokens:
                candidates = [name, folder + name] + ([entry + name] if entry else [])
                if not any((TOP / c).exists() for c in candidates):
                    bad.append(f"README.md:{first + offset}: {name} (Development)")
    return bad


def run_page(doc):
    """Runs one page's examples; (passed, failed)."""
    page = str(doc.relative_to(TOP))
    found = examples(doc.read_text(), page)
    results = run_all([command for _, command, _ in found])
    passed = failed = 0
    for (number, command, expected), (status, output) in zip(found, results):
        problems = []
        if status is None:
            problems.append("did not finish (the script stopped before it)")
        elif status != 0:
            problems.append(f"exited {status}")
        if output and not output.endswith("\n"):
            problems.append("its output does not end with a newline")
        want = [mask(line, True) for line in expected]
        got = [mask(line, False) for line in output.splitlines()]
        if not matches(want, got):
            diff = difflib.unified_diff(expected, output.splitlines(), page, "actual", lineterm="", n=2)
            problems.append("its output differs:\n    " + "\n    ".join(diff))
        first = command.splitlines()[0]
        if problems:
            failed += 1
            print(f"FAIL {page}:{number}: $ {first}")
            for problem in problems:
                print(f"  {problem}")
        else:
            passed += 1
            print(f"ok   {page}:{number}: $ {first}")
    return passed, failed


def main():
    passed = failed = 0
    for doc in PAGES:
        page_passed, page_failed = run_page(doc)
        passed += page_passed
        failed += page_failed
    for check, what, ok_text in [
        (stale_names, "a page names a file the repository lacks", "every file the pages name exists"),
        (outside_links, "link", "every link of README.md and docs/ leads to a file of the repository"),
    ]:
        found_problems = check()
        for problem in found_problems:
            print(f"FAIL {what}: {problem}")
        failed += len(found_problems)
        if not found_problems:
            passed += 1
            print(f"ok   {ok_text}")
    print(f"readme: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
