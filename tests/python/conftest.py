"""Every Python test imports the package kvpq: from python/ of this checkout (ctest sets PYTHONPATH
and KVPQ_LIB to the build's libkvpq.so), or from an installed `pip install .`."""
import os
import sys
from pathlib import Path

SRC = Path(os.environ.get("KVPQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
if os.environ.get("KVPQ_LIB") and str(SRC / "python") not in sys.path:
    sys.path.insert(0, str(SRC / "python"))

# The Python tests compare the forward pass with float32 peers (numpy, transformers) and with
# recordings of the float32-activation path: they run it (KVPQ_ACT=f32, read at model load, so the
# library in this process and the CLIs it starts). The default 8-bit activation path is tested
# against it in C (tests/test_model.c model_q8, tests/test_ggml_types.c q8_*).
os.environ["KVPQ_ACT"] = "f32"
