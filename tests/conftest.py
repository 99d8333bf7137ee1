import sys
from pathlib import Path

# Test helpers live in tests/support and are imported as ``support.<module>``.
sys.path.insert(0, str(Path(__file__).parent))
