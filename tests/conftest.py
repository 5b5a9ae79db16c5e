import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CANNC_VERIFY", "1")
# deterministic kernels: never pick up the user's tuning cache (tests that need
# one point CANNC_TUNING_CACHE at their own file)
if "CANNC_TUNING_CACHE" not in os.environ:
    _tuning_dir = tempfile.mkdtemp(prefix="cannc-test-tuning-")
    atexit.register(shutil.rmtree, _tuning_dir, ignore_errors=True)
    os.environ["CANNC_TUNING_CACHE"] = os.path.join(_tuning_dir, "tuning.json")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
