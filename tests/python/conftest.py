"""Every Python test imports the package kvpq: from python/ of this checkout (ctest sets PYTHONPATH
and KVPQ_LIB to the build's libkvpq.so), or from an installed `pip install ./python`."""
import os
import sys
from pathlib import Path

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
if os.environ.get("KVPQ_LIB") and str(SRC / "python") not in sys.path:
    sys.path.insert(0, str(SRC / "python"))


# With torch and libkvpq_model (OpenBLAS, OpenMP) both loaded, the full test_transformers.py run
# ended in a segmentation fault after pytest had printed its result (at interpreter teardown,
# 2026-12-01; cause not established: the test subsets exit cleanly). The result is final by then, so
# when torch is loaded the process exits with pytest's status without running the teardown.
def pytest_sessionfinish(session, exitstatus):
    session.config._kvpq_exitstatus = int(exitstatus)


def pytest_unconfigure(config):
    if "torch" in sys.modules and hasattr(config, "_kvpq_exitstatus"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config._kvpq_exitstatus)
