"""Library patches live in one house, litespark_megatron/platform/: no other module of the package replaces a
function or attribute of megatron (megatron-core, megatron.training), torch or Transformer Engine. When megatron-core
is upgraded, the house is what to read again; a patch elsewhere fails here. Within the house, the functions of
megatron.training's loop are wrapped by one module, platform/callbacks.py, which the listeners hear."""
import ast
import sys

import pytest

from conftest import ROOT, run

PACKAGE = ROOT / "litespark_megatron"
HOUSE = PACKAGE / "platform"
LIBRARIES = ("megatron", "torch", "transformer_engine", "apex")


def _root(node):
    """The name an expression like `a.b.c`, `a.b[0]` or `getattr(a.b, 'c')` starts from, else None."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            node = node.args[0]
        else:
            return node.id if isinstance(node, ast.Name) else None


def _targets(node):
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    flat = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        else:
            flat.append(target)
    return flat


def patches(source: str) -> list:
    """The lines of `source` that replace something of a library: an assignment to an attribute (or item) of a
    library module, or of a name bound to one of its objects (`cls = module.Class; cls.method = ...`), and
    setattr/delattr on them."""
    return sorted({line for line, _ in replaced(source)})


def replaced(source: str) -> list:
    """(line, the attribute's name where the source names it) of each replacement `patches` finds."""
    tree = ast.parse(source)
    library = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    library.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in LIBRARIES:
            library.update(alias.asname or alias.name for alias in node.names)
    aliases_changed = True
    while aliases_changed:  # names bound to library objects: `x = lib.a.b`, `x, y = lib.a, lib.b`
        aliases_changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                names = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
                for name, value in zip(names, values):
                    if isinstance(name, ast.Name) and name.id not in library and _root(value) in library and \
                            not isinstance(value, ast.Call):
                        library.add(name.id)
                        aliases_changed = True
    found = []
    for node in ast.walk(tree):
        for target in _targets(node):
            if isinstance(target, (ast.Attribute, ast.Subscript)) and _root(target) in library:
                found.append((node.lineno, target.attr if isinstance(target, ast.Attribute) else None))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("setattr", "delattr") and node.args and _root(node.args[0]) in library:
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            found.append((node.lineno, name))
    return found


def _modules(where):
    return sorted(p for p in where.rglob("*.py"))


def test_no_module_outside_the_house_patches_a_library():
    outside = {str(p.relative_to(ROOT)): patches(p.read_text()) for p in _modules(PACKAGE) if HOUSE not in p.parents}
    assert {path: lines for path, lines in outside.items() if lines} == {}


def test_the_house_holds_the_patches():
    """The scan sees the patches where they are (a scan that sees none would pass anything)."""
    seen = {p.name: patches(p.read_text()) for p in _modules(HOUSE)}
    assert all(seen[name] for name in ("__init__.py", "library_gaps.py", "helper_processes.py", "callbacks.py")), seen


def test_only_callbacks_wraps_megatron_trainings_loop():
    """The loop's functions (megatron.training.training's module globals that train() calls) are replaced by
    callbacks.py alone, which replaces them all; the listeners (telemetry, the watchdog, the checkpoint directory)
    only hear its events."""
    from litespark_megatron.platform import callbacks

    wrapped = set(callbacks.WRAPPED)
    for path in _modules(HOUSE):
        names = {name for _, name in replaced(path.read_text())}
        if path.name == "callbacks.py":
            assert None in names  # setattr(training, function.__name__, ...): every wrapper, by its own name
        else:
            assert not names & wrapped, (path.name, names & wrapped)
    code = ("from megatron.training import training\nfrom litespark_megatron.platform import callbacks\n"
            "callbacks.install()\n"
            "print(sorted(n for n in callbacks.WRAPPED if getattr(getattr(training, n), '__litespark__', False)))")
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0 and proc.stdout.split("\n")[-2] == str(sorted(wrapped)), proc.stderr[-3000:]


@pytest.mark.parametrize("source", [
    "from megatron.training import training\ntraining.evaluate = lambda *a: None\n",
    "import megatron.training.training\nmegatron.training.training.evaluate = None\n",
    "from megatron.core.optimizer import distrib_optimizer\ncls = distrib_optimizer.DistributedOptimizer\n"
    "cls.state_dict = None\n",
    "def attach():\n    from megatron.training import training as t\n    setattr(t, 'training_log', None)\n",
    "import torch\ntorch.cuda.synchronize = lambda: None\n",
    "from megatron.core.tensor_parallel import layers\nlayers.fused_weight_gradient_mlp_cuda, x = 1, 2\n",
    "from megatron.training import training\ntraining.__dict__['evaluate'] = None\n",
])
def test_a_patch_is_seen(source):
    assert patches(source), source


@pytest.mark.parametrize("source", [
    "import torch\nx = torch.zeros(1)\nx.requires_grad = True\n",  # an object the library made is the caller's
    "from megatron.training import get_args\nargs = get_args()\nargs.iteration = 3\n",
    "def f(args):\n    args.spec = None\n",
])
def test_what_is_not_a_patch(source):
    assert patches(source) == [], source
