"""The import graph of trainer/, models/ and data/: no cycles (function-level imports
included, where a cycle would otherwise hide), and trainer/'s rooms import only rooms
below them, so a newcomer can read the code from cli.py downwards."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "models", "data")
# trainer/'s rooms, top first: a room may import itself and the rooms after it. dryrun runs
# train (and plan, inference, serve) on fake GPUs; serve answers HTTP with inference's
# models. train, inference and plan sit side by side (none imports another); formats reads
# and writes every foreign format, below config, which composes a run from a model's files;
# rendezvous, host and errors are torch-free modules every room may use
# (rendezvous counts the GPUs host finds).
ROOMS = [
    "launch",
    "dryrun",
    "serve",
    {"train", "inference", "plan"},
    "checkpoint",
    "parallel",
    "cpu",
    "config",
    "formats",
    "rendezvous",
    "host",
    "errors",
    {"models", "data"},
]


def modules():
    """module name -> its file, for every module of the three packages."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(path, known):
    """(imported module, line, at module level) for each import of a known module."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from trainer.checkpoint import files` imports the module trainer.checkpoint.files
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
        else:
            continue
        out += [(t, node.lineno, id(node) in top) for t in targets if t in known]
    return out


def graph():
    known = modules()
    return {name: sorted({t for t, _, _ in imports_of(path, known) if t != name}) for name, path in known.items()}


def find_cycle(edges):
    """One cycle of the directed graph `edges` (node -> successors) as a list of nodes, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for succ in edges.get(node, ()):
            if state.get(succ) == "open":
                return stack[stack.index(succ) :] + [succ]
            if succ not in state:
                cycle = visit(succ)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def room_of(module):
    parts = module.split(".")
    return parts[1] if parts[0] == "trainer" and len(parts) > 1 else parts[0]


def level_of(room):
    return next(i for i, rooms in enumerate(ROOMS) if room == rooms or room in rooms)


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_rooms_import_only_rooms_below_them():
    wrong = []
    for module, targets in graph().items():
        if module == "trainer":
            continue
        here = room_of(module)
        for target in targets:
            there = room_of(target)
            if there != here and level_of(there) <= level_of(here):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the rooms' direction: " + ", ".join(wrong)


def test_models_and_data_never_import_the_trainer_or_torch_distributed():
    for package in ("models", "data"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
            bad = [n for n in names if n.split(".")[0] == "trainer" or n.startswith("torch.distributed")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_every_function_level_import_of_our_modules_says_why():
    """One of our modules imported inside a function is a heavy import that a torch-free
    entry point defers: the line, or the one above it, says so."""
    silent = []
    known = modules()
    for path in known.values():
        lines = path.read_text().splitlines()
        for _target, lineno, at_top in imports_of(path, known):
            line, above = lines[lineno - 1], lines[lineno - 2].strip()
            if not at_top and "#" not in line and not above.startswith("#"):
                silent.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert not silent, "function-level imports without a reason: " + ", ".join(silent)


def test_each_format_keeps_to_its_room():
    """trainer/formats/ holds a room per format (hf, fairseq, shardlm): one imports nothing of
    another, only what every format shares (the reader protocol, the safetensors file);
    registry.py alone knows them all."""
    wrong = []
    for module, targets in graph().items():
        parts = module.split(".")
        if parts[:2] != ["trainer", "formats"] or len(parts) < 4:
            continue
        for target in targets:
            there = target.split(".")
            if there[:2] == ["trainer", "formats"] and len(there) >= 4 and there[2] != parts[2]:
                wrong.append(f"{module} -> {target}")
            if target == "trainer.formats.registry":
                wrong.append(f"{module} -> {target}")
    assert not wrong, "a format importing another's room: " + ", ".join(wrong)
