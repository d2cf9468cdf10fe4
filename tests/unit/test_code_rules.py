"""Rules of the library code that a reader cannot check at a glance."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY = ["common", "trainer_svc", "inference_svc"]


def library_files():
    for folder in LIBRARY:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_task_is_referenced():
    """asyncio keeps only weak references to tasks: a task whose result is dropped can be
    collected mid-flight. Every create_task/ensure_future result must be kept."""
    dropped = []
    for path in library_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                f = node.value.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in ("create_task", "ensure_future"):
                    dropped.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not dropped, f"tasks created without keeping a reference: {dropped}"


def test_the_rule_sees_a_dropped_task():
    tree = ast.parse("async def f(loop):\n    loop.create_task(g())\n")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert calls and calls[0].value.func.attr == "create_task"
