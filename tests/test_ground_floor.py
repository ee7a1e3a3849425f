"""The package's ground floor: errors, presets and the spec choice import nothing of the package but errors, no
module imports another that (directly or through others) imports it back, the core (the trainer) imports no app
(litespark_megatron.apps), and parsing a command line builds nothing (the run builds its data).
docs/architecture.md draws these rules."""
import ast
import os
import sys

from conftest import ROOT, child_env, run

PACKAGE = ROOT / "litespark_megatron"
APPS = "litespark_megatron.apps"


def _module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of_the_package() -> dict:
    """module -> the package's modules it imports, at its top or inside a function (a lazy import is an arrow too)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    arrows = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1]) if node.level else ""
                target = ".".join(filter(None, (base, node.module)))
                for alias in node.names:
                    found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in paths else target)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        arrows[name] = {m for m in found if m in paths and m != name}
    return arrows


def cycles(arrows: dict) -> list:
    """The import circles: each a list of modules, from one back to itself."""
    found, done = [], set()

    def walk(module, path):
        if module in path:
            found.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for target in sorted(arrows.get(module, ())):
            walk(target, path + [module])
        done.add(module)

    for module in sorted(arrows):
        walk(module, [])
    return found


def test_the_ground_floor_imports_nothing_of_the_package():
    arrows = imports_of_the_package()
    for module in ("litespark_megatron.errors", "litespark_megatron.presets", "litespark_megatron.spec_choice"):
        assert arrows[module] <= {"litespark_megatron.errors"}, (module, arrows[module])


def test_no_import_circle():
    # A package imports its own modules' parent on the way (platform.callbacks imports platform first): only arrows
    # between modules count, not into a package's __init__ from inside it.
    arrows = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in imports_of_the_package().items()}
    assert cycles(arrows) == []


def test_the_circle_test_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def is_app(module: str) -> bool:
    return module == APPS or module.startswith(APPS + ".")


def core_arrows_into_apps(arrows: dict) -> dict:
    """core module -> the app modules it imports itself (at its top or in a function): each one an arrow the wrong
    way. An app reached through another core module shows as that module's arrow."""
    return {m: sorted(t for t in targets if is_app(t)) for m, targets in arrows.items()
            if not is_app(m) and any(is_app(t) for t in targets)}


def test_no_core_module_imports_an_app():
    assert core_arrows_into_apps(imports_of_the_package()) == {}


def test_the_apps_test_finds_an_arrow_into_the_apps():
    arrows = {"litespark_megatron.telemetry": {"litespark_megatron.metrics", "litespark_megatron.apps.profile"},
              "litespark_megatron.apps.benchmark": {"litespark_megatron.telemetry"},
              "litespark_megatron.data": {"litespark_megatron.errors"}}
    assert core_arrows_into_apps(arrows) == {"litespark_megatron.telemetry": ["litespark_megatron.apps.profile"]}


def apps_loaded_by_importing(modules, path=None) -> list:
    """The app modules in sys.modules after a fresh process imported `modules` (and nothing else); `path`: a
    directory of further modules."""
    code = ("import importlib, sys\n"
            f"for m in {list(modules)!r}:\n    importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m == {APPS!r} or m.startswith({APPS + '.'!r})))")
    env = child_env()
    if path:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env["PYTHONPATH"]])
    proc = run([sys.executable, "-c", code], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return eval(proc.stdout.strip().splitlines()[-1])


def test_importing_every_core_module_loads_no_app():
    """Every core module imported (`__main__` would train): not one app module is loaded on the way."""
    core = sorted(m for m in imports_of_the_package() if not is_app(m) and m != "litespark_megatron.__main__")
    assert len(core) > 30 and "litespark_megatron.pretrain" in core
    assert apps_loaded_by_importing(core) == []


def test_the_import_test_sees_a_core_module_that_imports_an_app(tmp_path):
    (tmp_path / "core_module_reaching_an_app.py").write_text("from litespark_megatron.apps import findings\n")
    loaded = apps_loaded_by_importing(["core_module_reaching_an_app"], path=tmp_path)
    assert loaded == [APPS, APPS + ".findings"]


def test_parsing_the_embedded_corpus_builds_nothing(tmp_path):
    """--embedded-corpus names the corpus in the data flags; the run builds it (pretrain.prepare), not the parser."""
    code = ("from litespark_megatron import arguments, platform\n"
            "a = arguments.resolve_quietly(['--model', 'tiny', '--embedded-corpus', 'stdlib'])\n"
            "print(a.data_path, a.tokenizer_model, a.vocab_size)")
    proc = run([sys.executable, "-c", code], env=child_env(LITESPARK_CACHE=tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    corpus = tmp_path / "cache" / "stdlib-corpus"
    assert proc.stdout.split() == [f"['{corpus}/stdlib']", f"{corpus}/stdlib_tokenizer", "4096"], proc.stdout
    assert not (tmp_path / "cache").exists()
