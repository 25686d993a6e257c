"""``HFMoECausalLM(pretrained=...)``: the folder is checked when the module is made (before any process starts), and
the model is built in float32 whatever dtype the published config names (the files' storage), so a bf16 checkpoint
loads into float32 master weights. Oracle: transformers' own ``from_pretrained(dtype=torch.float32)``."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_overlap.hf import HFWeights

transformers = pytest.importorskip("transformers", reason="Requires: transformers>=5")


def test_a_missing_folder_or_config_is_refused_when_the_module_is_made(tmp_path):
    from lightning_moe_overlap.demo_hf import HFMoECausalLM

    with pytest.raises(ValueError, match=r"pretrained='.*nowhere' does not exist\. Rule: .* Fix: pass such a folder"):
        HFMoECausalLM(pretrained=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"has no config\.json\. Rule: `pretrained` is a folder"):
        HFMoECausalLM(pretrained=str(tmp_path))


def test_a_bf16_checkpoint_loads_into_float32_master_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from lightning_moe_overlap.demo_hf import HFMoECausalLM, build_hf_model

    build_hf_model("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path)  # config.json says bfloat16
    module = HFMoECausalLM(pretrained=str(tmp_path))
    module.configure_model()
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}
    assert isinstance(module.hf_weights, HFWeights)
    module.hf_weights.load_into(module)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    got = module.model.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()  # the files' own values, upcast exactly
    assert all(torch.equal(got[k], bf16[k].float()) for k in bf16 if bf16[k].is_floating_point())


def test_a_dtype_in_the_overrides_is_kept(tmp_path):
    from lightning_moe_overlap.demo_hf import HFMoECausalLM, build_hf_model

    build_hf_model("qwen3_moe").save_pretrained(tmp_path)
    module = HFMoECausalLM(pretrained=str(tmp_path), config_overrides={"dtype": "bfloat16"})
    module.configure_model()
    assert {p.dtype for p in module.model.parameters()} == {torch.bfloat16}


def test_under_another_strategy_the_module_reads_its_weights_itself(tmp_path):
    """A plain single-device Trainer (not ``MoEOverlapStrategy``, which loads after sharding): the weights are read
    in ``configure_model``, never left at their random init."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from lightning_moe_overlap.demo_hf import HFMoECausalLM, build_hf_model

    build_hf_model("qwen3_moe").save_pretrained(tmp_path)
    seen: dict[str, torch.Tensor] = {}

    class Before(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen.update({k: v.clone() for k, v in pl_module.model.state_dict().items()})

    torch.manual_seed(123)  # a random init that differs from the files
    module = HFMoECausalLM(pretrained=str(tmp_path))
    module.train_dataloader = lambda: DataLoader(torch.randint(0, 128, (4, 6)), batch_size=2)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[Before()])  # fmt: skip
    trainer.fit(module)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert seen.keys() == expected.keys() and all(torch.equal(seen[k], expected[k]) for k in expected)
