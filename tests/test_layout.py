"""The lesson stands apart from the harness, and reads in README's order.

Importing every lesson module (nanokl/*.py) pulls in torch and nothing of nanokl.harness,
nanokl.tasks or nanokl.supervised, nor the harness's third-party packages (yaml, tokenizers,
safetensors; tqdm is not on the list because torch itself imports it). Checked in a fresh
interpreter, so nothing imported by another test can hide a violation.

README's course table is the reading order, and the reading order is the import order: each
lesson module imports only torch, the standard library and lesson modules that come *earlier*
in the table, so a reader never meets a name from a module still ahead. Checked on the source
with `ast` (imports inside functions count too), together with: every lesson module has its
row, and the course starts near the top of README (before line 80).
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
# only when installed (nanokl/attention.py: flash-attn's varlen kernel). Never at module level.
OPTIONAL_KERNELS = {"flash_attn"}
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


def course_order():
    """The lesson modules named in the 'lesson module' column of README's course table, in order."""
    _, section = course_section()
    rows = [line for line in section if line.lstrip().startswith("|")]
    headers = [i for i, row in enumerate(rows) if "lesson module" in cells(row)]
    assert headers, "the course section has no table with a 'lesson module' column"
    first = headers[0]
    col = cells(rows[first]).index("lesson module")
    order = []
    for row in rows[first + 2:]:  # skip the header and its |---| line
        row_cells = cells(row)
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


def test_readme_course_table_names_every_lesson_module_once():
    order = course_order()
    dupes = sorted({m for m in order if order.count(m) > 1})
    assert not dupes, f"README's course table lists these modules twice: {dupes}"
    missing = [m for m in LESSON if m not in order]
    assert not missing, f"lesson modules without a row in README's course table: {missing}"
    absent = [m for m in order if m not in LESSON]
    assert not absent, f"README's course table names modules that do not exist: {absent}"


def test_lesson_modules_import_only_earlier_modules_of_the_course():
    """Course order is import order: a lesson module imports torch, the standard library and the
    lesson modules above it in README's table, nothing else."""
    order = course_order()
    rank = {m: i for i, m in enumerate(order)}
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for m in LESSON:
        if m not in rank:
            continue  # reported by the table test
        for name, line, top in imported_modules(ROOT / "nanokl" / f"{m}.py"):
            root, *rest = name.split(".")
            where = f"nanokl/{m}.py:{line} imports {name}"
            if root == "torch" or root in stdlib:
                continue
            if root == "nanokl":
                dep = rest[0] if rest else None
                if dep is None:
                    bad.append(f"{where}: import a lesson module by name, not the package")
                elif dep not in rank:
                    bad.append(f"{where}, which is not a lesson module of README's course table")
                elif rank[dep] >= rank[m]:
                    bad.append(f"{where}, which comes at or after it in README's course order "
                               f"({m} is #{rank[m] + 1}, {dep} is #{rank[dep] + 1})")
                continue
            if root in OPTIONAL_KERNELS and not top:
                continue
            bad.append(f"{where}: only torch, the standard library and earlier lesson modules")
    assert not bad, "README's course order is not the import order:\n" + "\n".join(bad)
