"""The package's layout: at most about eight modules at the top, one folder per wing, imports flowing one way
(a module imports only from its own wing or the wings below it; CONTRIBUTING.md draws the order), and
functions and modules small enough to read."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "prune_heads"
ORDER = [  # lowest first
    "errors",
    "runtime",
    "task_data",
    "model",
    "config",  # below what it configures, as peft's config imports only its utils
    "scoring",
    "recovery",
    "evaluation",
    "export",
    "budgets",
    "pruner",
    "recipes",
    "pipeline",
    "cli",
    "__init__",
]


def wing(path: Path) -> str:
    """The wing of a module: its folder under prune_heads/, or its own name at the top."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def imported(path: Path) -> set[str]:
    """The wings a module imports from (relative imports resolved against its own package)."""
    tree = ast.parse(path.read_text())
    package = path.relative_to(PACKAGE).parent.parts
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - node.level + 1])
            target = base + (node.module.split(".") if node.module else [])
            names = [target[0]] if target else [alias.name for alias in node.names]
            found.update(names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prune_heads."):
            found.add(node.module.split(".")[1])
    return found


def modules() -> list[Path]:
    skip = (PACKAGE / "shipped_recipes", PACKAGE / "data")  # recipe files; lm-eval's task code, loaded by lm-eval
    return [p for p in PACKAGE.rglob("*.py") if not any(p.is_relative_to(folder) for folder in skip)]


def test_the_top_level_holds_the_wings_and_a_few_modules():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    assert {"model", "scoring", "recovery", "evaluation", "export", "runtime"} <= {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
    }


def test_the_config_imports_none_of_the_wings_it_configures():
    """The config's choices and defaults live in it; scoring, recovery and export take them from there."""
    assert not imported(PACKAGE / "config.py") & {"scoring", "recovery", "export", "evaluation", "pruner"}


def test_imports_flow_one_way():
    rank = {name: i for i, name in enumerate(ORDER)}
    wrong = []
    for path in modules():
        own = wing(path)
        assert own in rank, f"{path}: a wing ORDER does not place"
        for other in imported(path):
            if other in rank and rank[other] > rank[own]:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {other}")
    assert not wrong, wrong


MAX_LINES, MAX_PARAMETERS, MAX_MODULE = 60, 8, 600
WIDER = {  # public entry points whose keywords are a user's options one for one, with the reason
    "load_task_data": "the recipe's data section, one keyword per field",
    "push_pruned": "huggingface_hub's upload options beside save_pruned's",
    "score_heads": "the scoring options of the public API",
    "prune_iteratively": "the scoring options of the public API and the budget",
    "evaluate_command": "a click command: one parameter per option",
}


def functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, lines, parameters other than self / cls) of every function in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs] + [p.arg for p in (a.vararg, a.kwarg) if p]
            parameters = len([n for n in names if n not in ("self", "cls")])
            found.append((node.name, node.end_lineno - node.lineno + 1, parameters))
    return found


def test_functions_and_modules_stay_small():
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE:
            too_big.append(f"{path.name}: {lines} lines")
        for name, length, parameters in functions(path):
            if length > MAX_LINES or (parameters > MAX_PARAMETERS and name not in WIDER):
                too_big.append(f"{path.name}:{name}: {length} lines, {parameters} parameters")
    assert not too_big, "split these, or give the reason in WIDER:\n" + "\n".join(too_big)
