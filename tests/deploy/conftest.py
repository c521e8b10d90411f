import sys
from pathlib import Path

# --import-mode=importlib puts no test folder on sys.path: make the repository importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
