import sys
from pathlib import Path

# --import-mode=importlib puts no test folder on sys.path: make alert_harness and the repository's
# `alerts` package importable.
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
