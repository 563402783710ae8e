"""Every Python test imports the package kvpq: from python/ of this checkout (ctest sets PYTHONPATH
and KVPQ_LIB to the build's libkvpq.so), or from an installed `pip install .`."""
import os
import sys
from pathlib import Path

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
if os.environ.get("KVPQ_LIB") and str(SRC / "python") not in sys.path:
    sys.path.insert(0, str(SRC / "python"))
