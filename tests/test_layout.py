"""The lesson stands apart from the harness: importing every lesson module (nanokl/*.py) pulls in
torch and nothing of nanokl.harness, nanokl.tasks or nanokl.supervised, nor the harness's
third-party packages (yaml, tokenizers, safetensors; tqdm is not on the list because
torch itself imports it). Checked in a fresh interpreter, so
nothing imported by another test can hide a violation."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LESSON = sorted(p.stem for p in (ROOT / "nanokl").glob("*.py") if p.stem != "__init__")


def test_lesson_modules_import_only_torch_and_each_other():
    assert {"kl", "kl_ctrl", "masked", "advantages", "ppo", "rollout", "workers", "batching", "dist",
            "model"} <= set(LESSON)
    code = ("import sys\n" + "".join(f"import nanokl.{m}\n" for m in LESSON) +
            "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('yaml', 'tokenizers', 'safetensors')"
            " or k.startswith(('nanokl.harness', 'nanokl.tasks', 'nanokl.supervised')))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"lesson modules import harness code: {out.stdout.strip()}"
