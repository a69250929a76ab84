"""`import evals` (and its benchmark modules) stays light: no Ray, SQL, Streamlit or the engine."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_evals_imports_no_heavy_or_engine_packages():
    code = (
        "import sys\n"
        "import evals, evals.metrics, evals.longbench, evals.ruler, evals.sample_io, evals.common\n"
        "bad = [m for m in ('ray', 'sqlalchemy', 'streamlit', 'sparsespec', 'cluster') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"evals imported: {out.stdout.strip()}"
