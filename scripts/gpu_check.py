#!/usr/bin/env python3
"""Run `reshard.tools.gpu_check` from a checkout, installed or not (see tools/gpu_check.py).

pyproject maps the package's folders (`reshard` -> cli/, `reshard.common` -> common/, ...),
so a plain `sys.path` entry is not enough: when this checkout's reshard is not the one
importable, a temporary folder gets a `reshard/` package made of links to the checkout's
folders, the way setuptools' package-dir maps them, and goes first on sys.path and on
PYTHONPATH, so that the services and workers the check starts import the same code."""

import atexit
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
SUBPACKAGES = ("common", "tools", "trainer_svc", "inference_svc", "proto", "integrations")  # reshard.<name> -> <name>/


def installed_here() -> bool:
    try:
        import reshard.common
    except ImportError:
        return False
    return os.path.realpath(reshard.common.__file__).startswith(REPO + os.sep)


def link_tree() -> str:
    """A folder holding `reshard/` as links into this checkout (removed at exit)."""
    root = tempfile.mkdtemp(prefix="reshard-gpu-check-")
    atexit.register(shutil.rmtree, root, True)
    pkg = os.path.join(root, "reshard")
    os.mkdir(pkg)
    for entry in os.listdir(os.path.join(REPO, "cli")):
        if entry != "__pycache__":
            os.symlink(os.path.join(REPO, "cli", entry), os.path.join(pkg, entry))
    for name in SUBPACKAGES:
        os.symlink(os.path.join(REPO, name), os.path.join(pkg, name))
    return root


def map_packages() -> str:
    if installed_here():
        return "installed"
    for name in [m for m in sys.modules if m == "reshard" or m.startswith("reshard.")]:
        del sys.modules[name]
    root = link_tree()
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return "mapped"


if __name__ == "__main__":
    how = map_packages()
    if "--ipc-child" not in sys.argv:
        print(f"gpu-check: reshard {how} from {REPO}", file=sys.stderr)
    from reshard.tools.gpu_check import main

    sys.exit(main())
