"""Block FP8 from trainer shards that split blocks (issue 29, item 3), through both real controllers
and the embedding API's workers over gloo: four trainer ranks hold fp32 masters cut FSDP2-like
(rows end inside rows of 128 x 128 blocks, one rank's share inside a single row of blocks), two
inference ranks serve the weights as block FP8 with their scales. The trainer ranks exchange their
partial block maxima over the data plane, quantize, and send FP8; each inference rank must then
hold byte for byte what the test's block-by-block loop makes of the whole masters (not reshard's
recipe). A second update with other masters must put every byte right again."""

import time

import pytest

from reshard.trainer_svc.worker import TrainerWorker

from ..unit.test_fp8_wire import ROW_CUTS, engine_fp8, fsdp_trainer, holds_what_the_loop_makes, masters
from .inprocess import deployment

pytestmark = pytest.mark.integration


def test_fp8_from_trainer_shards_that_split_blocks_through_the_services():
    src, sbufs = fsdp_trainer()
    dst = engine_fp8()
    with deployment(dst, src_world=4, run="fsdp") as (tr_w, workers):
        inferences = list(workers)
        trainers = []
        for r in range(4):
            bufs = {d.name: (d, sbufs[r][d.name]) for d in src.ranks[r]}
            trainers.append(TrainerWorker(tr_w, r, 4, src.tensors, bufs, run="fsdp").start())
        workers += trainers
        for w in workers:
            assert w.wait_connected(60)
        for step in (1, 2):
            m = masters()
            if step == 2:  # other weights: every byte must change to the new ones
                m = {n: t * -1.5 + 0.01 for n, t in m.items()}
                for r, w in enumerate(trainers):
                    for t, cuts in ROW_CUTS.items():
                        for j, (a, b) in enumerate(cuts):
                            name = f"{t.split('.')[0]}{j}"
                            if name in w.live:
                                w.live[name].copy_(m[t][a:b])
                    w.live["norm"].copy_(m["norm"])
            handles = [w.publish(step) for w in trainers]
            for h in handles:
                assert h.wait_outcome(60) is True, h.error
            t0 = time.monotonic()
            while any(w.version is None or w.version.step != step for w in inferences):
                assert time.monotonic() - t0 < 60, "inference never committed"
                time.sleep(0.05)
            holds_what_the_loop_makes([w.live for w in inferences], m, f"step {step} ")
