"""Regenerate the protobuf modules from the .proto files beside this file.

    python -m reshard.proto.generate          # write them
    python -m reshard.proto.generate --check  # exit 1 if the committed ones are stale

Generated imports are rewritten to live under `reshard.proto`, so nothing installs
a top-level module of ours."""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
PROTOS = ["reshard.proto", "worker.proto"]


def generate(out_dir: pathlib.Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + [str(HERE / p) for p in PROTOS]) != 0:
        raise SystemExit("protoc failed")
    for f in out_dir.glob("*_pb2*.py*"):
        text = f.read_text()
        text = re.sub(r"^import (\w+_pb2) as", r"from reshard.proto import \1 as", text, flags=re.M)
        f.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed modules instead of writing")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        generate(out)
        stale = []
        for f in sorted(out.iterdir()):
            target = HERE / f.name
            if a.check:
                if not target.exists() or target.read_text() != f.read_text():
                    stale.append(f.name)
            else:
                target.write_text(f.read_text())
        if stale:
            print("stale generated modules (run `make proto`): " + ", ".join(stale), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
