"""torch's own distributed test base, driven the way torch's test_distributed_spawn.py drives it.

    BACKEND=shm WORLD_SIZE=3 python tests/torch_suite_driver.py [-k PATTERN | TestDistBackendWithSpawn.test_x ...]

BACKEND is "shm" (shmdist.torch) or "gloo"; WORLD_SIZE is the number of ranks;
SHMDIST_SUITE_GATES=gloo makes torch's file read BACKEND "gloo" (below).
TEMP_DIR is made here when it is not set (torch's setUp makes a fresh one per
test anyway). Every test spawns WORLD_SIZE fresh processes ("spawn" start
method); each of them imports this module again, so the declarations below
hold in the ranks as in the parent.

The only thing added to torch's file: "shm" is declared in torch's tables of
backend features (``DistTestCases``), for what it implements as gloo does:
subgroups, DDP, and "plugin" (a backend registered from Python, which
``require_backend_is_available`` accepts). No test's body or assertion is
touched; tests gated on ``BACKEND == "gloo"`` by name stay skipped on "shm"
unless SHMDIST_SUITE_GATES=gloo.

``--runnable`` lists the tests that the skip conditions evaluated at import
let run. Run as a script, it prints a line ``RESULT {name: [outcome, seconds,
detail]}`` as each test ends, and then a JSON summary line
``SUMMARY {...}`` with the names that passed, failed (with the first lines of
the error) and were skipped (with the reason); tests/test_torch_suite.py reads it.
"""
from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import os
import sys
import tempfile
import time
import unittest
from datetime import timedelta

# the backend the ranks run on; kept in its own variable, since BACKEND is
# what torch's file reads (see SHMDIST_SUITE_GATES below) and the ranks
# inherit this environment
REAL = os.environ.setdefault("SHMDIST_SUITE_BACKEND", os.environ.get("BACKEND", "shm"))
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="shmdist-torch-suite-")
    os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shmdist.torch  # noqa: E402,F401  (registers the backend "shm")
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

# what "shm" implements, declared to torch's tables (before distributed_test is
# imported: its skip decorators read them when the class body runs)
for feature in ("subgroup", "ddp", "plugin"):
    DistTestCases.backend_feature[feature].add("shm")

torch.backends.cuda.matmul.allow_tf32 = False

# SHMDIST_SUITE_GATES=gloo: torch's file names gloo in many skip conditions
# (BACKEND != "gloo", require_backend_is_available({"gloo"})) and in a few
# test bodies (``if BACKEND == "gloo": ddp_model = ...``). In this mode the
# file reads BACKEND "gloo" (its skip conditions and bodies are gloo's: it
# runs exactly the tests gloo runs, the way it runs them on gloo) while the
# ranks initialise the default group with the real backend (``_run`` below),
# so every collective of the default group and of its subgroups runs on it.
GATES = os.environ.get("SHMDIST_SUITE_GATES", REAL)
os.environ["BACKEND"] = GATES
BACKEND = REAL
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    CUSTOM_PG_TIMEOUT,
    DistributedTest,
    TestDistBackend,
    default_pg_timeout,
)


# SHMDIST_SUITE_START=forkserver: each test's ranks are forked from one server
# process that imported this module (torch, torch's test file, shmdist) once and
# made no process group, instead of 2-3 fresh interpreters per test importing
# torch again (seconds each on a loaded 2-core machine). A rank starts as clean
# as a spawned one: nothing of the test runner's process is inherited.
START = os.environ.get("SHMDIST_SUITE_START", "spawn")


class _ForkserverRank(multiprocessing.context.ForkServerProcess):
    """A rank forked from the server, with the environment of the test that
    starts it (torch's setUp makes a fresh TEMP_DIR per test; the server's
    environment is the first test's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._environ = dict(os.environ)

    def run(self):
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


def _forkserver():
    multiprocessing.set_forkserver_preload(["__main__"])
    return _ForkserverRank


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if START == "forkserver":
            self._start_processes(_forkserver())
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        """TestDistBackend._run (a rank's life), initialising with REAL rather than torch's BACKEND."""
        self = cls(test_name)
        self.rank = rank
        self.file_name = file_name
        timeout = timedelta(seconds=CUSTOM_PG_TIMEOUT.get(test_name, default_pg_timeout))
        dist.init_process_group(init_method=self.init_method, backend=REAL,
                                world_size=int(self.world_size), rank=self.rank, timeout=timeout)
        self._barrier()
        self.run_test(test_name, pipe)
        self._barrier()
        dist.destroy_process_group()
        sys.exit(0)


class _Recorder(unittest.TextTestResult):
    """Keeps each test's outcome by name, and its duration."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, list] = {}
        self._start = 0.0

    def startTest(self, test):
        self._start = time.monotonic()
        super().startTest(test)

    def _put(self, test, outcome, detail=""):
        name = test.id().split(".")[-1]
        self.outcomes[name] = [outcome, round(time.monotonic() - self._start, 2), detail]
        # as each test ends, so that a run stopped part way still says what it did
        print("RESULT " + json.dumps({name: self.outcomes[name]}), flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._put(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test)[-3000:])

    def addError(self, test, err):
        super().addError(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test)[-3000:])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._put(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._put(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._put(test, "failed", "unexpected success")


def main(argv: list[str]) -> int:
    loader = unittest.TestLoader()
    if argv[:1] == ["--runnable"]:      # the tests the skip conditions evaluated at import let run
        for name in loader.getTestCaseNames(TestDistBackendWithSpawn):
            if not getattr(getattr(TestDistBackendWithSpawn, name), "__unittest_skip__", False):
                print(name)
        return 0
    pattern = None
    if argv[:1] == ["-k"]:
        pattern, argv = argv[1], argv[2:]
    if argv:
        suite = unittest.TestSuite(loader.loadTestsFromName(name, sys.modules[__name__]) for name in argv)
    else:
        suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
        if pattern:
            suite = unittest.TestSuite(t for t in suite if pattern in t.id())
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2, stream=sys.stderr)
    result = runner.run(suite)
    print("SUMMARY " + json.dumps({"backend": REAL, "gates": GATES, "world_size": int(os.environ["WORLD_SIZE"]),
                                   "outcomes": result.outcomes}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
