"""Folders are layers, no module imports another in a circle, each formula is near the step, and
README's course lists every module once, near the top.

The rooms, from the ground up (a room may import its own and any below it, never one above):

    nanokl/engine/      the engine: torch, the standard library, the engine
    nanokl/*.py         the lesson: + the engine
    nanokl/tasks/       what PPO trains on: + the lesson (no harness)
    nanokl/harness/     the harness (its config/ room imports no other harness module): + the tasks
    nanokl/supervised/  the stages before RL: + the harness
    train_ppo.py, generate.py (and bench/, tests/): anything

Checked on the source with `ast` (imports inside functions count too), and at run time in a fresh
interpreter: importing every lesson and engine module pulls in nothing of the harness, the tasks or
the supervised stages, nor the harness's third-party packages (yaml, tokenizers, safetensors; tqdm
is not on the list because torch itself imports it). No circle: the import graph of nanokl/,
train_ppo.py and generate.py has no strongly connected component of two files or more.

One name, one thing: outside nanokl/tasks/ (whose modules share the task interface by design:
examples, score, answer, ...) no public top-level name is defined in two modules; `main` is each
entry point's own.

The formula on the page: from `ppo_step`, every formula of the step is at most two calls away
(a call graph read from the source: imports resolved, `run.<part>(...)` to each function that
harness/variants.py's `choose` may bind, `run.kl_ctrl.update` to the controllers' rule), and the
penalized reward r_t = score_t - beta * KL_t is written in the step itself. Lessons and
train_ppo.py keep their lines within 100 characters.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LESSON = sorted(p.stem for p in (ROOT / "nanokl").glob("*.py") if p.stem != "__init__")
ENGINE = sorted(p.stem for p in (ROOT / "nanokl" / "engine").glob("*.py") if p.stem != "__init__")
OPTIONAL_KERNELS = {"flash_attn"}  # a lazy import, inside the function that runs it, only when installed
STDLIB = set(sys.stdlib_module_names)
# the rooms, lowest first; a module's room is the longest prefix of its dotted name listed here
ROOMS = ["nanokl.engine", "nanokl", "nanokl.tasks", "nanokl.harness.config", "nanokl.harness",
         "nanokl.supervised", "top"]
# what each room may import of nanokl's rooms (its own and those below; config/ only itself below)
MAY_IMPORT = {
    "nanokl.engine": {"nanokl.engine"},
    "nanokl": {"nanokl.engine", "nanokl"},
    "nanokl.tasks": {"nanokl.engine", "nanokl", "nanokl.tasks"},
    "nanokl.harness.config": {"nanokl.engine", "nanokl", "nanokl.tasks", "nanokl.harness.config"},
    "nanokl.harness": {"nanokl.engine", "nanokl", "nanokl.tasks", "nanokl.harness.config", "nanokl.harness"},
    "nanokl.supervised": set(ROOMS[:-1]),
    "top": set(ROOMS),
}
THIRD_PARTY_BELOW_HARNESS = {"torch"}  # the lesson and the engine need torch alone
COURSE_STARTS_BEFORE = 45
COURSE_WITHIN_LINES_OF_COMMANDS = 40
ROW_CHARS = 120
LINE_CHARS = 100


def modules() -> dict:
    """{dotted module name: path} for nanokl/ and the two entry points."""
    out = {}
    for p in sorted((ROOT / "nanokl").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    for name in ("train_ppo", "generate"):
        out[name] = ROOT / f"{name}.py"
    return out


MODULES = modules()


def room(name: str) -> str:
    if not name.startswith("nanokl"):
        return "top"
    if name == "nanokl" or (name.count(".") == 1 and name.split(".")[1] in LESSON):
        return "nanokl"
    return max((r for r in ROOMS[:-1] if name == r or name.startswith(r + ".")), key=len)


def imported_modules(name: str):
    """(imported module, line) for every import in module `name`, relative imports resolved; from
    `from pkg import a`, `pkg.a` when that is a module."""
    path = MODULES[name]
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in MODULES else base), node.lineno


def test_lesson_and_engine_import_nothing_of_the_harness_at_run_time():
    assert {"kl", "kl_ctrl", "masked", "advantages", "ppo", "rollout", "workers"} <= set(LESSON)
    assert {"attention", "model", "graphs", "fused", "batching", "dist", "shard"} <= set(ENGINE)
    code = ("import sys\n" + "".join(f"import nanokl.{m}\n" for m in LESSON) +
            "".join(f"import nanokl.engine.{m}\n" for m in ENGINE) +
            "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('yaml', 'tokenizers', 'safetensors')"
            " or k.startswith(('nanokl.harness', 'nanokl.tasks', 'nanokl.supervised')))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"lesson or engine modules import harness code: {out.stdout.strip()}"


def test_folders_are_layers():
    """Each module imports only rooms at or below its own (MAY_IMPORT); the lesson and the engine no
    third-party package but torch (and an optional kernel, lazily)."""
    bad = []
    for name in MODULES:
        mine = room(name)
        for dep, line in imported_modules(name):
            root = dep.split(".")[0]
            where = f"{MODULES[name].relative_to(ROOT)}:{line} imports {dep}"
            if root == "nanokl":
                if dep == "nanokl":
                    bad.append(f"{where}: import a module by name, not the package")
                elif room(dep) not in MAY_IMPORT[mine]:
                    bad.append(f"{where}: the {mine} room may not import the {room(dep)} room")
            elif root in ("train_ppo", "generate"):
                bad.append(f"{where}: nothing imports an entry point")
            elif mine in ("nanokl", "nanokl.engine") and root not in STDLIB | THIRD_PARTY_BELOW_HARNESS:
                if root not in OPTIONAL_KERNELS:
                    bad.append(f"{where}: the {mine} room imports only torch and the standard library")
    assert not bad, "layering:\n" + "\n".join(bad)


def circles(graph: dict) -> list:
    """The strongly connected components of two nodes or more (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other_in_a_circle():
    graph = {name: {dep for dep, _ in imported_modules(name) if dep in MODULES and dep != name}
             for name in MODULES}
    assert circles(graph) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it can see one


def test_one_name_one_thing():
    seen = {}
    for name, path in MODULES.items():
        if room(name) == "nanokl.tasks" and not name.endswith(".rows") or room(name) == "top":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
                t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            for n in names:
                if not n.startswith("_") and n != "main":
                    seen.setdefault(n, []).append(name)
    twice = {n: ms for n, ms in seen.items() if len(ms) > 1}
    assert twice == {}, f"names defined in two modules: {twice}"


# ---- the formula on the page: a call graph from ppo_step ----

def _defs():
    out = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef):
                out[f"{name}.{node.name}"] = node
            elif isinstance(node, ast.ClassDef):
                out.update({f"{name}.{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)})
    return out


DEFS = _defs()


def _namespace(name):
    """{local name: qualified name} of a module's imports and top-level definitions."""
    ns = {}
    for dep_node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(dep_node, ast.ImportFrom) and dep_node.module and not dep_node.level:
            ns.update({a.asname or a.name: f"{dep_node.module}.{a.name}" for a in dep_node.names})
        elif isinstance(dep_node, ast.Import):
            ns.update({a.asname: a.name for a in dep_node.names if a.asname})
    for node in ast.parse(MODULES[name].read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            ns[node.name] = f"{name}.{node.name}"
    return ns


def _chosen_parts():
    """What `run.<part>(...)` may call: every function harness/variants.py's `choose` names."""
    ns = _namespace("nanokl.harness.variants")
    choose = DEFS["nanokl.harness.variants.choose"]
    named = set()
    for node in ast.walk(choose):
        if isinstance(node, ast.Name) and ns.get(node.id) in DEFS:
            named.add(ns[node.id])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ns:
            if f"{ns[node.value.id]}.{node.attr}" in DEFS:
                named.add(f"{ns[node.value.id]}.{node.attr}")
    return named


def _calls(qualified, parts):
    module = max((m for m in MODULES if qualified.startswith(m + ".")), key=len)
    ns, out = _namespace(module), set()
    local = {}  # a local alias, `loss = compute_policy_loss if ... else TABLE[...]`: the names it may be
    for node in ast.walk(DEFS[qualified]):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            local[node.targets[0].id] = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    for node in ast.walk(DEFS[qualified]):
        if not isinstance(node, ast.Call):
            continue
        chain, f = [], node.func
        while isinstance(f, ast.Attribute):
            chain.insert(0, f.attr)
            f = f.value
        if not isinstance(f, ast.Name):
            continue
        chain.insert(0, f.id)
        if len(chain) == 1 and chain[0] in local and chain[0] not in ns:
            out |= {ns[n] for n in local[chain[0]] if ns.get(n) in DEFS}
        elif chain[0] == "run" and len(chain) == 2:
            out |= parts  # a part of the step: whatever choose may bind
        elif chain == ["run", "kl_ctrl", "update"]:
            out |= {q for q in DEFS if q.startswith("nanokl.kl_ctrl.") and q.endswith("Controller.update")}
        elif chain[0] in ns and ".".join([ns[chain[0]], *chain[1:]]) in DEFS:
            out.add(".".join([ns[chain[0]], *chain[1:]]))
    return out


FORMULAS = {  # each formula of the step: the function whose body computes it
    "the rollout (sampling a response)": "nanokl.rollout.generate",
    "the KL estimator": "nanokl.kl.kl_penalty",
    "beta's update (Ziegler)": "nanokl.kl_ctrl.AdaptiveKLController.update",
    "the score on the last token": "nanokl.rewards.token_level_scores",
    "pi_old's log-probs": "nanokl.forwards.compute_log_probs",
    "importance weights min(pi_old/mu, C)": "nanokl.offline.truncated_is_weights",
    "rejection (rollout_rs)": "nanokl.offline.rejection_mask",
    "the KL read offline (SNIS)": "nanokl.offline.weighted_kl",
    "the probe's corrected KL": "nanokl.kl_probe.corrected_kl",
    "GAE": "nanokl.advantages.compute_gae_advantage_return",
    "GRPO": "nanokl.advantages.compute_grpo_outcome_advantage",
    "the clipped policy loss": "nanokl.ppo.compute_policy_loss",
    "the clipped value loss": "nanokl.ppo.compute_value_loss",
}


def test_every_formula_is_within_two_calls_of_ppo_step():
    parts, depth, frontier = _chosen_parts(), {"train_ppo.ppo_step": 0}, ["train_ppo.ppo_step"]
    assert "nanokl.offline.token_weights" in parts and "nanokl.harness.variants.sample_responses" in parts
    for d in (1, 2):
        frontier = [c for q in frontier for c in _calls(q, parts) if c not in depth]
        depth.update({c: d for c in frontier})
    far = {what: fn for what, fn in FORMULAS.items() if fn not in depth}
    assert far == {}, f"more than two calls from ppo_step: {far}"
    step = ast.get_source_segment(MODULES["train_ppo"].read_text(encoding="utf-8"), DEFS["train_ppo.ppo_step"])
    assert re.search(r"rewards = scores - beta \* kl\b", step), "step 4 writes r_t = score_t - beta * KL_t out"


def test_lessons_and_the_step_keep_their_lines_short():
    long = [f"{p.relative_to(ROOT)}:{i}" for p in [ROOT / "train_ppo.py", *(ROOT / "nanokl").glob("*.py")]
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > LINE_CHARS]
    assert long == [], f"lines over {LINE_CHARS} characters: {long}"


# ---- README's course ----

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
    tables, in order: `nanokl/x.py` for a lesson, `nanokl/engine/x.py` for the engine."""
    _, section = course_section()
    rows = [line for line in section if line.lstrip().startswith("|")]
    headers = [i for i, row in enumerate(rows) if column in cells(row)]
    assert headers, f"the course section has no table with a {column!r} column"
    first = headers[0]
    col = cells(rows[first]).index(column)
    pattern = r"`nanokl/engine/(\w+)\.py`" if column == "engine module" else r"`nanokl/(\w+)\.py`"
    order = []
    for row in rows[first + 2:]:  # skip the header and its |---| line
        row_cells = cells(row)
        if row_cells and set(row_cells[0]) <= {"-", ":", " "} and row_cells[0]:
            break  # the next table's separator: this table ended
        if col < len(row_cells) and (m := re.match(pattern, row_cells[col])):
            order.append(m.group(1))
    return order


def test_readme_course_starts_near_the_top_and_its_rows_are_short():
    line, section = course_section()
    assert line < COURSE_STARTS_BEFORE, f"README's course starts at line {line}"
    lines = README.read_text(encoding="utf-8").splitlines()
    commands = next(i for i, text in enumerate(lines, 1) if re.match(r"##\s+Two commands", text))
    end = next(i for i in range(commands, len(lines)) if lines[i].startswith("## ")) + 1  # the next heading
    first_row = line + next(i for i, text in enumerate(section) if text.startswith("|"))
    assert first_row - end <= COURSE_WITHIN_LINES_OF_COMMANDS, (
        f"the course table starts {first_row - end} lines after the two commands")
    wide = [text[:40] for text in section if text.startswith("|") and len(text) > ROW_CHARS]
    assert wide == [], f"course rows over {ROW_CHARS} characters: {wide}"


def test_readme_course_names_every_module_once():
    lessons, engine = course_order("lesson module"), course_order("engine module")
    for what, order, have in (("lesson", lessons, LESSON), ("engine", engine, ENGINE)):
        dupes = sorted({m for m in order if order.count(m) > 1})
        assert not dupes, f"README's {what} table lists these more than once: {dupes}"
        assert sorted(order) == have, f"README's {what} table lists {sorted(order)}, the folder holds {have}"
