"""Every ``hvd-train`` command in the README and the docs is one that a test or a benchmark runs.

A documented command counts as run when one file of the tests (with
``conftest.py``, whose option lists they share), the benchmarks, the
Makefile, ``.ci/run`` or ``launch/`` names its subcommand and every one of
its ``--flags`` (values may differ: a test trains on its own small data).
A code block that cannot run here (it needs GPUs, several hosts or a real
bucket) says so in an HTML comment right above it: ``<!-- not run: why -->``.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = (
    "train", "sweep", "evaluate", "predict", "export", "pack", "bench", "plan", "lr-find", "report", "demo", "doctor",
    "models",
    "launch",
)  # fmt: skip
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->")


def documented_commands() -> list[tuple[str, int, str]]:
    """``(doc, line, command)`` of every ``hvd-train`` command in a fenced code block."""
    found = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        in_block, exempt, i = False, False, 0
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                if not in_block:
                    before = next((x for x in reversed(lines[:i]) if x.strip()), "")
                    exempt = bool(NOT_RUN.search(before))
                in_block = not in_block
                i += 1
                continue
            start = i
            while in_block and line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            text = line.split(" #", 1)[0].strip().removeprefix("$ ")
            if in_block and not exempt and not text.startswith("docker ") and re.search(r"(^|\s)hvd-train\s", text):
                found.append((doc.relative_to(ROOT).as_posix(), start + 1, text))
    return found


def parse(command: str) -> tuple[str, set[str]]:
    """The subcommand and the ``--flags`` of one documented command."""
    words = command.split()
    rest = words[words.index("hvd-train") + 1 :]
    sub = next((w for w in rest if not w.startswith("-")), "")
    return sub, {w.split("=", 1)[0] for w in rest if w.startswith("--")}


def runners() -> dict[str, str]:
    """The text of every file that runs commands: tests (each with conftest.py), benchmarks, Makefile, CI, launch/."""
    shared = (ROOT / "tests" / "conftest.py").read_text(encoding="utf-8")
    texts = {}
    for path in sorted((ROOT / "tests").rglob("*")):
        if path.is_file() and path.suffix in (".py", ".sh", ".sbatch", "") and path.name != "test_docs.py":
            texts[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8", errors="replace") + shared
    others = [
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "launch").glob("*"),
        ROOT / "Makefile",
        ROOT / ".ci" / "run",
    ]
    for path in others:
        if path.is_file():
            texts[path.relative_to(ROOT).as_posix()] = path.read_text(encoding="utf-8", errors="replace")
    return texts


def runs(text: str, sub: str, flags: set[str]) -> bool:
    names_sub = re.search(rf"""(["'\s]){re.escape(sub)}(["'\s])""", text)
    return bool(names_sub) and all(re.search(rf"""["'\s]{re.escape(flag)}(["'\s=])""", text) for flag in flags)


COMMANDS = documented_commands()


def test_the_docs_hold_commands_to_check():
    assert len(COMMANDS) >= 10, COMMANDS
    assert {parse(c)[0] for _, _, c in COMMANDS} <= set(SUBCOMMANDS), COMMANDS


@pytest.mark.parametrize("doc, line, command", COMMANDS, ids=[f"{d}:{n}" for d, n, _ in COMMANDS])
def test_every_documented_command_is_run_by_a_test_or_a_benchmark(doc, line, command):
    sub, flags = parse(command)
    texts = runners()
    if any(runs(text, sub, flags) for text in texts.values()):
        return
    with_sub = [text for text in texts.values() if runs(text, sub, set())]
    missing = sorted(f for f in flags if not any(runs(text, sub, {f}) for text in with_sub))
    pytest.fail(
        f"{doc}:{line}: `{command}` is run by no test or benchmark"
        + (f" (no file runs `{sub}` with {', '.join(missing)})" if missing else " with all of its flags together")
        + "; add a test that runs it, or put <!-- not run: REASON --> above its code block if it cannot run here."
    )
