"""The committed protobuf modules are exactly what the .proto files generate."""

import subprocess
import sys


def test_generated_modules_are_fresh():
    r = subprocess.run([sys.executable, "-m", "reshard.proto.generate", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_no_top_level_proto_or_common_module_installed():
    import importlib.util

    assert importlib.util.find_spec("reshard.common") is not None
    for name in ("common", "proto", "trainer_svc", "inference_svc"):
        spec = importlib.util.find_spec(name)
        assert spec is None or "site-packages" not in (spec.origin or ""), name
