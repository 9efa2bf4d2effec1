"""Read what compute-sanitizer and pytest printed into one JSON summary per tool.

bench/sanitize.sh runs ``compute-sanitizer --tool T ... python -m pytest -v ...`` with the
sanitizer's records in ``--log-file T.sanitizer.log`` and the program's output (pytest's lines,
and whatever the sanitizer says before it starts) in ``T.console.log``; then::

    python bench/sanitize_report.py --tool T --sanitizer-log T.sanitizer.log \\
        --console-log T.console.log --rc RC --seconds S --budget B --command "..." --out T.json

The summary: ``tool, command, status, errors`` (the sanitizer's ERROR SUMMARY count),
``kernel_errors`` (records about device code: an invalid access, a race, a barrier misuse),
``api_errors`` (a CUDA call that returned an error), ``racecheck`` (hazards, errors, warnings),
``kernels`` (names of the kernels with records), ``samples`` (the first records, one line each
with where), ``tests`` (pytest's counts), ``seconds``, ``timed_out``. ``status`` is one of

- ``clean``: the sanitizer ran the tests and reported nothing;
- ``errors``: device-code records (or racecheck hazards of error severity);
- ``api_errors``: only CUDA API errors (worth reading: a bad launch shows up here);
- ``tests_failed``: no sanitizer record, but tests failed or errored;
- ``timed_out``: the budget ran out (the counts are those of the tests run until then);
- ``refused``: the sanitizer did not run the program (unsupported device or driver, a tool
  that failed to initialise, no CUDA call reached): say so, and run it on a machine that allows
  it;
- ``missing``: no compute-sanitizer on the machine;
- ``no_tests``: the sanitizer ran but pytest ran no test.

The exit status is 0 for ``clean`` and 1 otherwise (2 for bad arguments).

A tool run split over processes (``SANITIZE_SHARDS``: each shard a compute-sanitizer of its
own over part of the tests) gives one summary per shard; ``--merge A.json B.json ... --out
T.json`` makes the tool's summary of them (:func:`merge`): counts summed, the worst status,
the longest shard's seconds (they ran at once), and ``shards`` with each one's status, tests
and seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

PREFIX = "========= "
#: Lines of the sanitizer that say it did not run the program under the tool
REFUSALS = (
    "device not supported", "is not supported on this", "not supported by the", "unsupported gpu",
    "tool initialization failed", "debugger interface initialization failed",
    "internal sanitizer error", "target application terminated before first instrumented",
    "no attachable process", "failed to initialize", "unable to find the cuda driver",
    "could not find the cuda", "insufficient permissions",
)
#: Headline lines that are not findings (the program's own exit status, notes)
_NOT_RECORDS = ("Target application returned an error", "LEAK SUMMARY", "Note:", "Leaked 0 bytes")
_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?", re.I)
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*"
                           r"\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)", re.I)
_API = re.compile(r"^Program hit (\S+) \(error (\d+)\) due to \"(.*?)\" on CUDA API call to "
                  r"(\S+?)\.?$")
_RACE = re.compile(r"^(Error|Warning|ERROR|WARNING): Race reported between (.*)$")
_AT = re.compile(r"^\s*at (.*)$")
_PYTEST_LINE = re.compile(r"^(\S+::\S+?)(?:\s+<-\s+\S+)?\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|"
                          r"XPASS)\b")
_PYTEST_SUMMARY = re.compile(r"^=+ (.*\d+ (?:passed|failed|skipped|errors?|deselected|"
                             r"xfailed|xpassed|warnings?).*) in [\d.]+s")


def kernel_of(where: str) -> str:
    """The kernel's name in an ``at ...`` line, however the sanitizer version spells it:
    ``0x1a30 in void k<...>(...)``, ``void k<...>(...)+0x1a30 in file.cu:12``, ``k+0x1a30``."""
    where = where.strip()
    m = re.match(r"^0x[0-9a-fA-F]+ in (.+)$", where)
    if m:
        return m.group(1).strip()
    m = re.match(r"^(.+?)\+0x[0-9a-fA-F]+(?: in .*)?$", where)
    return (m.group(1) if m else where).strip()


def short_kernel(name: str) -> str:
    """``void cuflash::fwd_sm80<__half, 64, ...>(cuflash::Params)`` -> ``cuflash::fwd_sm80``."""
    name = re.sub(r"^(void|static|__global__)\s+", "", name.strip())
    depth, out = 0, []
    for ch in name:       # drop template arguments and parameters, nested ones included
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip() or name


def parse_sanitizer(text: str) -> dict:
    """The records of a compute-sanitizer log (memcheck, racecheck, synccheck)."""
    records: list[dict] = []
    summary = race = None
    refused = None
    version = None
    for raw in text.splitlines():
        line = raw.rstrip()
        body = line[len(PREFIX):] if line.startswith(PREFIX) else None
        low = line.lower()
        if refused is None and any(r in low for r in REFUSALS):
            refused = line.strip()
        m = re.search(r"COMPUTE-SANITIZER(?:\s+version\s+(\S+))?", line)
        if m and m.group(1):
            version = m.group(1)
        m = re.search(r"Compute Sanitizer.*?Version\s+(\S+)", line, re.I)
        if m:
            version = m.group(1)
        if body is None:
            continue
        if _SUMMARY.search(body):
            summary = int(_SUMMARY.search(body).group(1))
            continue
        if _RACE_SUMMARY.search(body):
            race = tuple(int(x) for x in _RACE_SUMMARY.search(body).groups())
            continue
        if not body.strip() or body.startswith(" ") or body.startswith("COMPUTE-SANITIZER"):
            # a continuation of the last record ("    at ...", "    by thread ...")
            m = _AT.match(body)
            if m and records and records[-1]["kernel"] is None and records[-1]["kind"] != "api":
                records[-1]["kernel"] = kernel_of(m.group(1))
            continue
        m = _API.match(body)
        if m:
            records.append(dict(kind="api", severity="error", what=f"{m.group(1)} from "
                                f"{m.group(4)}: {m.group(3)}", kernel=None))
            continue
        m = _RACE.match(body)
        if m:
            # "Write access at K+0x4f20 in f.cu:402" (the second access may follow on the line)
            first = re.match(r"\S+ access at (.+?)(?: and \S+ access at .*)?$", m.group(2))
            kernel = kernel_of(first.group(1)) if first else None
            records.append(dict(kind="race", severity=m.group(1).lower(), what=body.strip(),
                                kernel=kernel))
            continue
        if body.startswith(("Error:", "ERROR:")) and refused and body.strip() in refused:
            continue
        if any(body.startswith(x) for x in _NOT_RECORDS):
            continue
        severity = "warning" if body.lower().startswith("warning") else "error"
        records.append(dict(kind="device", severity=severity, what=body.strip(), kernel=None))
    return dict(records=records, error_summary=summary, race_summary=race, refused=refused,
                version=version)


def parse_pytest(text: str) -> dict:
    """pytest -v's verdict per test, and its final counts when it got to print them."""
    seen: dict[str, str] = {}
    final = None
    for line in text.splitlines():
        m = _PYTEST_LINE.match(line.strip())
        if m:
            seen[m.group(1)] = m.group(2).lower()
        m = _PYTEST_SUMMARY.match(line.strip())
        if m:
            final = m.group(1)
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    for status in seen.values():
        key = {"xfail": "skipped", "xpass": "passed"}.get(status, status)
        counts[key] += 1
    if final:   # pytest's own counts win (a test may report setup and call separately)
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", final):
            counts["error" if word.startswith("error") else word] = int(n)
    failed = sorted(t for t, s in seen.items() if s in ("failed", "error"))
    return dict(counts, ran=len(seen) or sum(counts.values()), summary=final,
                failed_tests=failed)


def summarize(tool: str, sanitizer_text: str, console_text: str, *, rc: int, seconds: float,
              command: str, budget: float | None = None, timed_out: bool = False,
              missing: bool = False) -> dict:
    """The JSON summary of one tool's run (see the module docstring)."""
    # records go to --log-file; a sanitizer that cannot start may print to the console instead
    san = parse_sanitizer(sanitizer_text + "\n" + console_text)
    tests = parse_pytest(console_text)
    recs = san["records"]
    device = [r for r in recs if r["kind"] != "api" and r["severity"] == "error"]
    warnings = [r for r in recs if r["kind"] != "api" and r["severity"] == "warning"]
    api = [r for r in recs if r["kind"] == "api"]
    race = san["race_summary"]
    if missing:
        status = "missing"
    elif san["refused"] and tests["ran"] == 0:
        status = "refused"
    elif device or (race and race[1] > 0):
        status = "errors"
    elif timed_out:
        status = "timed_out"
    elif api:
        status = "api_errors"
    elif tests["failed"] or tests["error"]:
        status = "tests_failed"
    elif tests["ran"] == 0 or (tests["passed"] == 0 and not tests["failed"]
                               and tests["skipped"] == tests["ran"]):
        status = "no_tests"
    else:
        status = "clean"
    kernels = sorted({short_kernel(r["kernel"]) for r in device + warnings if r["kernel"]})
    samples = []
    for r in (device + warnings + api)[:20]:
        samples.append(r["what"] + (f" [in {short_kernel(r['kernel'])}]" if r["kernel"] else ""))
    return dict(
        tool=tool, command=command, status=status, rc=rc,
        errors=san["error_summary"], kernel_errors=len(device), api_errors=len(api),
        warnings=len(warnings),
        racecheck=None if tool != "racecheck" else dict(
            hazards=race[0] if race else len(device) + len(warnings),
            errors=race[1] if race else len(device), warnings=race[2] if race else len(warnings)),
        kernels=kernels, samples=samples, refused=san["refused"] if status == "refused" else None,
        tests=tests, seconds=round(seconds, 1), budget_s=budget, timed_out=timed_out,
        sanitizer_version=san["version"])


#: a merged status is the first of these that any shard has (a record beats a cut budget, which
#: beats a failed test); with none of them, ``no_tests`` only when every shard ran none
_WORST_FIRST = ("errors", "refused", "missing", "timed_out", "api_errors", "tests_failed")


def merge(reports: list[dict]) -> dict:
    """One tool's summary from the summaries of its shards (run at the same time)."""
    if not reports:
        raise ValueError("merge() needs at least one shard summary, got none")
    tools = {r["tool"] for r in reports}
    if len(tools) != 1:
        raise ValueError(f"shards of different tools cannot be merged: {sorted(tools)}")
    statuses = [r["status"] for r in reports]
    status = next((s for s in _WORST_FIRST if s in statuses),
                  "no_tests" if all(s == "no_tests" for s in statuses) else "clean")
    counted = [r["errors"] for r in reports if r["errors"] is not None]
    tests = {k: sum(r["tests"][k] for r in reports)
             for k in ("passed", "failed", "skipped", "error", "ran")}
    tests["failed_tests"] = sorted(t for r in reports for t in r["tests"]["failed_tests"])
    tests["summary"] = [r["tests"]["summary"] for r in reports]
    races = [r["racecheck"] for r in reports if r["racecheck"] is not None]
    return dict(
        tool=reports[0]["tool"], command=[r["command"] for r in reports], status=status,
        rc=max(r["rc"] for r in reports),
        # None where no shard printed its ERROR SUMMARY (all cut before the end)
        errors=sum(counted) if counted else None,
        kernel_errors=sum(r["kernel_errors"] for r in reports),
        api_errors=sum(r["api_errors"] for r in reports),
        warnings=sum(r["warnings"] for r in reports),
        racecheck=None if not races else {k: sum(x[k] for x in races)
                                          for k in ("hazards", "errors", "warnings")},
        kernels=sorted({k for r in reports for k in r["kernels"]}),
        samples=[x for r in reports for x in r["samples"]][:20],
        refused=next((r["refused"] for r in reports if r["refused"]), None),
        tests=tests, seconds=max(r["seconds"] for r in reports),
        budget_s=reports[0]["budget_s"], timed_out=any(r["timed_out"] for r in reports),
        sanitizer_version=next((r["sanitizer_version"] for r in reports
                                if r["sanitizer_version"]), None),
        shards=[dict(status=r["status"], seconds=r["seconds"], ran=r["tests"]["ran"],
                     passed=r["tests"]["passed"], errors=r["errors"]) for r in reports])


def _print_line(report: dict) -> None:
    t = report["tests"]
    print(f"sanitize {report['tool']}: {report['status']}; {report['errors']} errors "
          f"({report['kernel_errors']} in kernels, {report['api_errors']} API); tests "
          f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, {t['error']} "
          f"errors; {report['seconds']} s" + (f"; kernels {', '.join(report['kernels'])}"
                                                if report["kernels"] else "")
          + (f"; {len(report['shards'])} shards" if report.get("shards") else ""))


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--merge":   # --merge A.json B.json ... --out T.json
        m = argparse.ArgumentParser(description="merge the summaries of one tool's shards")
        m.add_argument("--merge", nargs="+", required=True)
        m.add_argument("--out", required=True)
        margs = m.parse_args(argv)
        reports = []
        for path in margs.merge:
            with open(path) as f:
                reports.append(json.load(f))
        report = merge(reports)
        with open(margs.out, "w") as f:
            json.dump(report, f, indent=1)
        _print_line(report)
        return 0 if report["status"] == "clean" else 1
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tool", required=True, choices=("memcheck", "racecheck", "synccheck",
                                                     "initcheck", "none"),
                   help="none: a run without the sanitizer (the warm-up)")
    p.add_argument("--sanitizer-log", required=True)
    p.add_argument("--console-log", required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--command", required=True)
    p.add_argument("--timed-out", action="store_true")
    p.add_argument("--missing", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    def read(path):
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    report = summarize(args.tool, read(args.sanitizer_log), read(args.console_log), rc=args.rc,
                       seconds=args.seconds, command=args.command, budget=args.budget,
                       timed_out=args.timed_out, missing=args.missing)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    _print_line(report)
    return 0 if report["status"] == "clean" else 1


if __name__ == "__main__":
    sys.exit(main())
