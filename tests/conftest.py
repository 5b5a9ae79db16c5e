import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CANNC_VERIFY", "1")
# deterministic kernels: never pick up the user's tuning cache (tests that need
# one point CANNC_TUNING_CACHE at their own file)
os.environ.setdefault("CANNC_TUNING_CACHE",
                      os.path.join(tempfile.mkdtemp(prefix="cannc-test-tuning-"), "tuning.json"))
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
