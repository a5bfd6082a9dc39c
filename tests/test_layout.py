"""The lesson stands apart from the harness, the engine apart from the lesson, and README lists each once.

Importing every lesson and engine module (nanokl/*.py) pulls in torch and nothing of nanokl.harness,
nanokl.tasks or nanokl.supervised, nor the harness's third-party packages (yaml, tokenizers,
safetensors; tqdm is not on the list because torch itself imports it). Checked in a fresh
interpreter, so nothing imported by another test can hide a violation.

README's course has two tables: the lessons (the RL ideas, in the order ppo_step uses them) and the
engine appendix (attention, model, graphs, fused, batching, dist, shard: speed and many processes). Reading
order is not import order; the layers are: a lesson imports torch, the standard library, lessons and
engine modules; an engine module imports torch, the standard library and engine modules only, never
a lesson. Checked on the source with `ast` (imports inside functions count too), together with: every
module has exactly one row, and the course starts near the top of README (before line 80).
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LESSON = sorted(p.stem for p in (ROOT / "nanokl").glob("*.py") if p.stem != "__init__")

# Optional GPU kernels a lesson module may import lazily, inside the function that runs them and
# only when installed (nanokl/engine/attention.py: flash-attn's varlen kernel). Never at module level.
OPTIONAL_KERNELS = {"flash_attn"}
ENGINE = {"attention", "model", "graphs", "fused", "batching", "dist", "shard"}  # README's engine appendix
COURSE_STARTS_BEFORE = 80


def test_lesson_modules_import_only_torch_and_each_other():
    assert {"kl", "kl_ctrl", "masked", "advantages", "ppo", "rollout", "workers", "batching", "dist",
            "model"} <= set(LESSON)
    code = ("import sys\n" + "".join(f"import nanokl.{m}\n" for m in LESSON) +
            "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('yaml', 'tokenizers', 'safetensors')"
            " or k.startswith(('nanokl.harness', 'nanokl.tasks', 'nanokl.supervised')))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"lesson modules import harness code: {out.stdout.strip()}"


def course_section():
    """(1-based line where README's course heading is, the lines of that section)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"##\s+The course\b", line)]
    assert len(starts) == 1, "README.md needs exactly one '## The course' section"
    start = starts[0]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return start + 1, lines[start:end]


def cells(row):
    """The cells of a Markdown table row; an escaped \\| stays inside its cell."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def course_order(column="lesson module"):
    """The modules named in the `column` column ("lesson module" or "engine module") of README's course
    tables, in order."""
    _, section = course_section()
    rows = [line for line in section if line.lstrip().startswith("|")]
    headers = [i for i, row in enumerate(rows) if column in cells(row)]
    assert headers, f"the course section has no table with a {column!r} column"
    first = headers[0]
    col = cells(rows[first]).index(column)
    order = []
    for row in rows[first + 2:]:  # skip the header and its |---| line
        if column not in cells(rows[first]) or not row.lstrip().startswith("|"):
            break
        row_cells = cells(row)
        if row_cells and set(row_cells[0]) <= {"-", ":", " "} and row_cells[0]:
            break  # the next table's separator: this table ended
        m = re.match(r"`nanokl/(\w+)\.py`", row_cells[col]) if col < len(row_cells) else None
        if m:
            order.append(m.group(1))
    return order


def imported_modules(path):
    """(module name, line, at module level?) for every import statement in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top_level
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x / from .x import y
                base = "nanokl" + (f".{base}" if base else "")
            if base == "nanokl":  # from nanokl import attention as A: the names are modules
                for alias in node.names:
                    yield f"nanokl.{alias.name}", node.lineno, id(node) in top_level
            else:
                yield base, node.lineno, id(node) in top_level


def test_readme_course_starts_near_the_top():
    line, _ = course_section()
    assert line < COURSE_STARTS_BEFORE, (
        f"README's course starts at line {line}; it must start before line {COURSE_STARTS_BEFORE}")


def test_readme_course_names_every_module_once():
    lessons, engine = course_order("lesson module"), course_order("engine module")
    order = lessons + engine
    dupes = sorted({m for m in order if order.count(m) > 1})
    assert not dupes, f"README's course tables list these modules more than once: {dupes}"
    missing = [m for m in LESSON if m not in order]
    assert not missing, f"modules of nanokl/ without a row in README's course tables: {missing}"
    absent = [m for m in order if m not in LESSON]
    assert not absent, f"README's course tables name modules that do not exist: {absent}"
    assert set(engine) == ENGINE, f"the engine appendix lists {sorted(engine)}, not {sorted(ENGINE)}"


def test_the_engine_imports_no_lesson_and_lessons_no_harness():
    """A lesson imports torch, the standard library, lessons and the engine; an engine module the same
    minus the lessons. A lesson imports no harness (the subprocess test above checks the runtime side)."""
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for m in LESSON:
        for name, line, top in imported_modules(ROOT / "nanokl" / f"{m}.py"):
            root, *rest = name.split(".")
            where = f"nanokl/{m}.py:{line} imports {name}"
            if root == "torch" or root in stdlib:
                continue
            if root == "nanokl":
                dep = rest[0] if rest else None
                if dep is None:
                    bad.append(f"{where}: import a module by name, not the package")
                elif dep not in LESSON:
                    bad.append(f"{where}, which is neither a lesson nor an engine module")
                elif m in ENGINE and dep not in ENGINE:
                    bad.append(f"{where}: the engine ({m}) imports a lesson ({dep})")
                continue
            if root in OPTIONAL_KERNELS and not top:
                continue
            bad.append(f"{where}: only torch, the standard library and nanokl's lessons and engine")
    assert not bad, "layering:\n" + "\n".join(bad)
