import sys
from pathlib import Path

# --import-mode=importlib puts no test folder on sys.path: make the harness and the repository's
# `dashboards` package importable.
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
