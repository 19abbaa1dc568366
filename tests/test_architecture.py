"""The allowed import directions (docs/structure.md): a module may import its own layer and the layers below it,
never one above. Lazy imports inside functions count too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "wkvm"

# lowest first
LAYERS = [
    {"atomic", "config", "progress", "outputs", "sampling_params", "tokenizer", "chat_template", "logs", "embeddings"},
    {"models"},
    {"weights"},
    {"engine"},
    {"state"},
    {"server"},
    {"cluster"},
    {"llm", "cli", "cli_chat", "cli_doctor", "cli_states", "__init__", "__main__"},
]


def layer_of(name: str) -> int:
    return next(i for i, members in enumerate(LAYERS) if name in members)


def top_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def wkvm_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "wkvm" and len(parts) > 1:
                out.add(parts[1])
            elif parts[0] == "wkvm" and isinstance(node, ast.ImportFrom):
                out.update(a.name for a in node.names)
    return out


def test_every_module_has_a_layer():
    names = {top_name(p) for p in PACKAGE.rglob("*.py")}
    unknown = {n for n in names if not any(n in members for members in LAYERS)}
    assert not unknown, f"add these to LAYERS (and docs/structure.md): {sorted(unknown)}"


def test_imports_only_go_down():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = layer_of(top_name(path))
        for imported in wkvm_imports(path):
            if imported in {m for members in LAYERS for m in members} and layer_of(imported) > here:
                upward.append(f"{path.relative_to(PACKAGE.parent)} imports wkvm.{imported}")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from wkvm.server.app import create_app\n")
    assert wkvm_imports(bad) == {"server"}


def test_single_process_serving_never_imports_ray():
    """Ray is imported only by `wkvm serve --replicas N` (wkvm/cluster/)."""
    import subprocess
    import sys

    code = ("import sys, wkvm.cli, wkvm.server.app, wkvm.server.serving; wkvm.cli.build_parser(); "
            "assert 'ray' not in sys.modules, 'ray imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)
