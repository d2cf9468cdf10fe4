"""`reshard bench --quick --json`: real rank processes on one gloo world, every method verified."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.slow  # a measurement tool's end-to-end run
def test_quick_bench_end_to_end(tmp_path):
    png = tmp_path / "bench.png"
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "bench", "--quick", "--json", "--plot", str(png)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "calibration:" in r.stderr and "first" in r.stderr  # progress while it runs
    out = json.loads(r.stdout)
    assert out["verified"] is True
    cal = out["calibration"]
    for k in ("latency_s", "pair_gbps", "aggregate_gbps", "copy_gbps", "copy_op_s", "checksum_gbps", "checksum_op_s"):
        assert cal[k] > 0
    assert cal["alone"]["copy_gbps"] > 0 and cal["alone"]["checksum_gbps"] > 0  # and again with every core busy
    ct = cal["checksum_throughput"]  # checksum throughput beside a memcpy of the same bytes
    assert ct["bytes"] > 0 and ct["memcpy_gbps"] > 0 and ct["host_gbps"] > 0 and ct["torch_gbps"] > 0
    assert "checksum throughput on" in r.stderr and "memcpy of the same bytes" in r.stderr
    shape = cal["shapes"]["2->2"]  # measured at the concurrency of the layout pair: 4 processes, 2 streams
    assert shape["aggregate_streams"] == 2
    assert shape["aggregate_gbps"] > 0 and shape["round_s"] > 0 and shape["collective_s"] > 0 and shape["start_s"] >= 0
    probes = cal["layouts"]["0"]  # taken in the layout's repeats: one pass for one repeat
    assert probes["passes"] == 1 and probes["pair_gbps"] > 0 and probes["aggregate_gbps"] > 0
    assert probes["round_s"] > 0 and probes["start_s"] >= 0
    (cfg,) = out["configs"]
    assert (cfg["model"], cfg["src_ranks"], cfg["dst_ranks"]) == ("tiny", 2, 2)
    methods = cfg["methods"]
    assert set(methods) == {"reshard", "reshard+verify", "serialized", "broadcast", "ceiling"}
    for name, m in methods.items():
        assert m["verified"] and m["bit_exact"], name
        assert m["seconds"] > 0 and m["first_seconds"] > 0 and m["bytes"] > 0 and m["gbps"] > 0
        assert set(m["peak_extra_bytes"]) == {"trainer", "inference"}
        assert m["predicted_seconds"] > 0 and m["error_pct"] is not None
        assert len(m["repeats"]) == 1  # --quick: one repeat, short runs are not repeated more
    assert methods["reshard+verify"]["checksums_ok"] is True
    assert set(out["prediction_abs_error_pct_by_method"]) == set(methods)
    # Whole tensors to every inference rank: the owner broadcast moves D x the model.
    assert methods["broadcast"]["bytes"] == 2 * cfg["payload_bytes"]
    assert methods["serialized"]["bytes"] > methods["broadcast"]["bytes"] > methods["reshard"]["bytes"]
    assert methods["ceiling"]["bytes"] == methods["reshard"]["bytes"]
    s = cfg["reshard"]
    for k in ("speedup_vs_serialized", "speedup_vs_broadcast", "fraction_of_ceiling", "verification_seconds"):
        assert s[k] is not None
    if importlib.util.find_spec("matplotlib"):
        assert png.stat().st_size > 1000


@pytest.mark.slow  # a measurement tool's end-to-end run
def test_bench_fp8_beside_bf16():
    """`--fp8`: the destination serving block FP8 beside the BF16 one, in the same run: verified bit-exact
    (the weights regenerated and quantized whole on the inference ranks), fewer bytes on the wire."""
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "bench", "--sizes", "medium", "--dst-ranks", "2", "--repeats", "1",
                        "--min-seconds", "0", "--fp8", "--json", "--plot", ""], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    (cfg,) = out["configs"]
    fp8, bf16 = cfg["methods"]["reshard-fp8"], cfg["methods"]["reshard"]
    assert fp8["verified"] and fp8["bit_exact"] and out["verified"] is True
    from reshard.common.layout.quantized import fp8_destination, whole_block_tensors
    from reshard.common.models.frameworks import build

    src, dst = build("medium", "framework=megatron,tp=2"), build("medium", "framework=vllm,tp=2")
    q = fp8_destination(dst, whole_block_tensors(src))
    n8 = [n for n, t in q.tensors.items() if t.dtype == "float8_e4m3fn"]
    assert n8  # some linear weights are FP8 (whole blocks on both sides)
    saved = sum(dst.tensors[n].nbytes - q.tensors[n].nbytes - q.tensors[n + "_scale_inv"].nbytes for n in n8)
    assert bf16["bytes"] - fp8["bytes"] >= saved * 0.95  # each FP8 element is a byte, not two (packing aside)
    s = cfg["reshard"]
    assert s["fp8_over_bf16"] > 0 and s["fp8_bytes_over_bf16"] < 1
    assert "block FP8 (quantized on the trainer ranks)" not in r.stdout  # --json: the table is not printed
