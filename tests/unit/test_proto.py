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


def test_the_transfer_method_fields_keep_the_numbers_of_their_earlier_name():
    """`method` (the transfer method) was named `mode`: renamed with the same field numbers, so the
    binary wire format is unchanged (a message from either side decodes the same)."""
    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import worker_pb2 as wpb

    for msg, number in ((pb.BeginUpdateRequest, 7), (pb.UpdateRecord, 9), (wpb.Prepare, 8)):
        assert msg.DESCRIPTOR.fields_by_name["method"].number == number and "mode" not in msg.DESCRIPTOR.fields_by_name
    wire = pb.BeginUpdateRequest(update_id="u", method="serialized").SerializeToString()
    assert wire == b"\n\x01u:\nserialized"  # field 7, length-delimited: what `mode` wrote
