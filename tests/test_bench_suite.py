"""`make bench`, docs/benchmarks.md and bench/ agree.

- Every command the page quotes (`python -m bench.<module> <args>`, and `make crash-test`)
  is a line of the Makefile's `bench` recipe, with the same arguments, and every line of
  the recipe is quoted on the page: the page shows what `make bench` measures, and
  `make bench` reproduces every figure the page cites.
- Every module in bench/ is run by `make bench`, or a helper of those that are
  (`HELPERS`), or quoted by the page it serves when `make bench` cannot run it alone
  (`ELSEWHERE`); an experiment that is none of these leaves the tree (git keeps it).
- Every module `make bench` runs is run small by a test (tests/test_bench_smoke.py or a
  tests/test_bench_*.py of its own), so a benchmark that no longer runs fails the suite.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
HELPERS = {"__init__", "loadgen", "plots", "abuse", "soak"}
"""bench/ modules that are not benchmarks: the load generator, the plots, and the abuse
scenarios and soak loop shared with tests/test_abuse.py and tests/test_soak.py."""
ELSEWHERE = {"does_it_pay": "docs/does-it-pay.md", "store_promises": "docs/does-it-pay.md"}
"""bench/ modules `make bench` cannot run alone, and the page that quotes each:
does_it_pay computes that page's table from a measured `epistemic-kvcache does-it-pay`
run, which needs a server to fetch from; store_promises (also run by bench_lmcache when
Mooncake is installed) needs Mooncake Store."""

COMMAND = re.compile(r"python -m (bench\.\w+)((?: [^`\n]*)?)")


def recipe() -> list[str]:
    """The `bench` target's commands, as `bench.<module> <args>` or `make crash-test`."""
    text = (ROOT / "Makefile").read_text()
    body = text.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    out = []
    for line in body.splitlines()[1:]:
        line = line.strip()
        if line.startswith("$(MAKE) "):
            out.append("make " + line.removeprefix("$(MAKE) "))
        elif (m := COMMAND.search(line)) is not None:
            out.append((m.group(1) + m.group(2)).strip())
    return out


def quoted() -> set[str]:
    """The commands the page quotes, in the same form."""
    text = PAGE.read_text()
    found = {(m.group(1) + m.group(2)).strip() for m in COMMAND.finditer(text)}
    return found | set(re.findall(r"make crash-test", text))


def test_make_bench_runs_exactly_what_the_page_quotes() -> None:
    commands = recipe()
    assert len(commands) > 20, "the bench recipe was not found in the Makefile"
    assert len(set(commands)) == len(commands), "a command runs twice"
    assert set(commands) - quoted() == set(), "make bench runs these; the page does not quote them"
    assert quoted() - set(commands) == set(), "the page quotes these; make bench does not run them"


def test_every_bench_module_is_a_benchmark_or_a_helper() -> None:
    run = {c.split()[0].removeprefix("bench.") for c in recipe() if c.startswith("bench.")}
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert modules - run - HELPERS - set(ELSEWHERE) == set(), (
        "neither run by make bench, nor a helper, nor in ELSEWHERE: quote its figures and "
        "command on docs/benchmarks.md and add the command to the bench target, or (when "
        "make bench cannot run it alone) list it in ELSEWHERE with the page that quotes "
        "it, or remove the module"
    )
    assert modules >= HELPERS | set(ELSEWHERE)
    for module, page in ELSEWHERE.items():
        assert f"bench.{module}" in (ROOT / page).read_text(), f"{page} does not quote {module}"


def test_every_benchmark_has_a_test_that_runs_it() -> None:
    run = {c.split()[0].removeprefix("bench.") for c in recipe() if c.startswith("bench.")}
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    untested = {m for m in run if f"bench.{m}" not in tests and f"bench import {m}" not in tests}
    assert untested == set(), "no test runs these benchmarks (see tests/test_bench_smoke.py)"
