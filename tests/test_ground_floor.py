"""The package's ground floor: errors and presets import nothing of the package, no module imports another that
(directly or through others) imports it back, and parsing a command line builds nothing (the run builds its
data)."""
import ast
import sys

from conftest import ROOT, child_env, run

PACKAGE = ROOT / "litespark_megatron"


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
    for module in ("litespark_megatron.errors", "litespark_megatron.presets"):
        assert arrows[module] <= {"litespark_megatron.errors"}, (module, arrows[module])


def test_no_import_circle():
    # A package imports its own modules' parent on the way (platform.callbacks imports platform first): only arrows
    # between modules count, not into a package's __init__ from inside it.
    arrows = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in imports_of_the_package().items()}
    assert cycles(arrows) == []


def test_the_circle_test_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


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
