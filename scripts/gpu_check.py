#!/usr/bin/env python3
"""Run `reshard.gpu_check` from a checkout, installed or not (see cli/gpu_check.py).

pyproject maps the package's folders (`reshard.common` -> common/, ...), so a plain
`sys.path` entry is not enough: when this checkout's reshard is not importable, the
packages are mapped by hand, the same way setuptools' package-dir does."""

import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"reshard": "cli", "reshard.common": "common", "reshard.tools": "tools", "reshard.trainer_svc": "trainer_svc",
            "reshard.inference_svc": "inference_svc", "reshard.proto": "proto"}


def map_packages() -> str:
    try:
        import reshard.common

        if os.path.realpath(reshard.common.__file__).startswith(os.path.realpath(REPO) + os.sep):
            return "installed"
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "reshard" or m.startswith("reshard.")]:
        del sys.modules[name]
    for name, folder in PACKAGES.items():
        path = os.path.join(REPO, folder)
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"), submodule_search_locations=[path])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        if "." in name:
            setattr(sys.modules["reshard"], name.split(".", 1)[1], module)
    return "mapped"


if __name__ == "__main__":
    how = map_packages()
    if "--ipc-child" not in sys.argv:
        print(f"gpu-check: reshard {how} from {REPO}", file=sys.stderr)
    from reshard.gpu_check import main

    sys.exit(main())
