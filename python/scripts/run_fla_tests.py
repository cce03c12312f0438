"""Runs FLA's own op tests with FLA's op functions replaced by dgps_torch's (FLA's references and tolerances stay).

Usage: python run_fla_tests.py [--jobs N] [--timeout S] /path/to/flash-linear-attention [extra pytest args]
Runs tests/ops/test_{gdn,kda,delta,precond_gated_delta,precond_kda,gla,simple_gla}.py and prints pass / fail /
skip counts per file. --jobs N runs N files at a time, each in its own process on the same GPU (FLA's tests spend
most of their time compiling Triton references on the CPU); --timeout S stops a file's process after S seconds
and prints its last lines (with --jobs). The patch is installed before the test modules import
(a pytest plugin), so their `from fla.ops.x import f` binds dgps_torch's f. Needs a GPU machine with FLA importable (its naive references).
"""
import importlib
import os
import subprocess
import sys
import tempfile
import time

import pytest

FILES = ["test_gdn.py", "test_kda.py", "test_delta.py", "test_precond_gated_delta.py", "test_precond_kda.py",
         "test_gla.py", "test_simple_gla.py"]

# Tests of FLA's internal kernels, which call nothing dgps replaces (not counted): test_prepare_wy_repr_bwd_no_g
# drives FLA's WY helper directly, and did not finish within 320 s on an H100 (Triton 3.6), twice.
NOT_OPS = ["test_prepare_wy_repr_bwd_no_g"]

# (FLA module, function name); dgps_torch has a function of the same name.
PATCHES = [
    ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    ("fla.ops.kda", "chunk_kda"), ("fla.ops.kda", "fused_recurrent_kda"),
    ("fla.ops.delta_rule", "chunk_delta_rule"), ("fla.ops.delta_rule", "fused_recurrent_delta_rule"),
    ("fla.ops.precond_gated_delta_rule", "chunk_precond_gated_delta_rule"),
    ("fla.ops.precond_gated_delta_rule", "fused_recurrent_precond_gated_delta_rule"),
    ("fla.ops.precond_kda", "chunk_precond_kda"), ("fla.ops.precond_kda", "fused_recurrent_precond_kda"),
    ("fla.ops.gla", "chunk_gla"), ("fla.ops.simple_gla", "chunk_simple_gla"),
    ("fla.ops.simple_gla", "fused_recurrent_simple_gla"),
]


class Patch:
    """pytest plugin: replaces FLA's op functions before collection; NotImplementedError from dgps is a skip."""

    def pytest_configure(self, config):
        import dgps_torch
        for mod, name in PATCHES:
            try:
                m = importlib.import_module(mod)
            except ImportError:
                continue
            if hasattr(m, name):
                setattr(m, name, getattr(dgps_torch, name))
            for sub in ("chunk", "fused_recurrent"):
                try:
                    s = importlib.import_module(f"{mod}.{sub}")
                except ImportError:
                    continue
                if hasattr(s, name):
                    setattr(s, name, getattr(dgps_torch, name))

    def pytest_runtest_call(self, item):
        try:
            item.runtest()
        except NotImplementedError as e:  # an FLA argument dgps does not offer
            pytest.skip(f"dgps: {e}")
        item.runtest = lambda: None


class Count:
    def __init__(self):
        self.n = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            f = os.path.basename(report.nodeid.split("::")[0])
            self.n.setdefault(f, {"passed": 0, "failed": 0, "skipped": 0})[report.outcome] += 1


def _outcomes(lines, stopped):
    """The lines to print of a file's pytest output: the failed tests' names and, for a process that was stopped
    (-vv: each test's node id, then its outcome, live log lines between), the counts so far and the test that was
    running; then the output's last lines."""
    keep, test, counts = [], None, {"PASSED": 0, "FAILED": 0, "SKIPPED": 0}
    for line in lines:
        head = line.split(" ", 1)[0]
        if "::" in head and head.split("::", 1)[0].endswith(".py"):
            test = head
        words = line.split()
        outcome = next((w for w in words[:2] if w in counts), None) if stopped else None
        if outcome:
            counts[outcome] += 1
        if outcome == "FAILED" or (not stopped and line.startswith("FAILED")):
            keep.append(f"FAILED {test}" if stopped else line)
    if stopped:
        keep.append(f"so far: {counts['PASSED']} passed, {counts['FAILED']} failed, {counts['SKIPPED']} skipped; "
                    f"running: {test}")
    return keep + lines[-(15 if stopped else 30):]


def _parallel(jobs, fla, files, extra, timeout):
    """Runs each file in its own process, `jobs` at a time (each stopped after `timeout` s when > 0, its last
    lines printed: pytest -vv names the test that was running); returns the worst exit status."""
    pending, running, rc = list(files), [], 0
    while pending or running:
        while pending and len(running) < jobs:
            f = pending.pop(0)
            cmd = [sys.executable, os.path.abspath(__file__), fla, f, *extra] + (["-vv"] if timeout > 0 else [])
            out = tempfile.TemporaryFile(mode="w+")
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
            running.append((f, proc, out, time.monotonic()))
        time.sleep(0.5)
        for item in list(running):
            f, proc, out, t0 = item
            late = timeout > 0 and time.monotonic() - t0 > timeout
            if proc.poll() is None and not late:
                continue
            if late:
                proc.kill()
                proc.wait()
            running.remove(item)
            out.seek(0)
            lines = out.read().splitlines()
            status = f"stopped after {timeout} s" if late else f"exit {proc.returncode}"
            print(f"===== {os.path.basename(f)} ({status})\n" + "\n".join(_outcomes(lines, late)), flush=True)
            rc = max(rc, 124 if late else proc.returncode)
    return rc


def main():
    args = sys.argv[1:]
    jobs, timeout = 1, 0
    while args[:1] in (["--jobs"], ["--timeout"]):
        if args[0] == "--jobs":
            jobs = int(args[1])
        else:
            timeout = int(args[1])
        args = args[2:]
    fla = os.path.abspath(args[0])
    sys.path.insert(0, fla)
    extra = args[1:]
    named = [a for a in extra if a.endswith(".py")]
    if named:  # one file (a --jobs worker, or a user's choice)
        files, extra = named, [a for a in extra if not a.endswith(".py")]
    else:
        files = [os.path.join(fla, "tests", "ops", f) for f in FILES
                 if os.path.exists(os.path.join(fla, "tests", "ops", f))]
    if jobs > 1 and len(files) > 1:
        return _parallel(jobs, fla, files, extra, timeout)
    count = Count()
    deselect = " and ".join(f"not {name}" for name in NOT_OPS)
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-k", deselect, *files, *extra], plugins=[Patch(), count])
    for f, c in sorted(count.n.items()):
        print(f"{f}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
    return rc


if __name__ == "__main__":
    sys.exit(main())
