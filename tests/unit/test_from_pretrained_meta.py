"""``from_pretrained`` in ``configure_model`` under ``MoEOverlapStrategy.model_sharded_context`` (one process, no
process group): what is built on meta and declared, what runs as written, and that the interception is scoped.

Oracle: the tensors ``save_pretrained`` wrote (``tests/helpers/hf_checkpoints.py``). The distributed runs (losses
against plain Lightning, each rank's share read) are in tests/distributed/test_from_pretrained_configure_model.py.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from lightning.pytorch import LightningModule

from lightning_moe_overlap import MoEOverlapStrategy
from lightning_moe_overlap._compat.transformers import attn_implementation
from lightning_moe_overlap.hf import HFWeights
from lightning_moe_overlap.hf.load import as_hf_weights_list
from lightning_moe_overlap.hf.pretrained import _adopt, meta_from_pretrained
from lightning_moe_overlap.parallelize.steps import apply_pretrained
from lightning_moe_overlap.parallelize.materialize import find_meta_experts, materialize_dense, materialize_experts
from lightning_moe_overlap.parallelize.materialize import meta_init_of
from tests.helpers.hf_checkpoints import saved, state_equal

transformers = pytest.importorskip("transformers", reason="Requires: transformers>=5")

LOG = "lightning.pytorch.utilities.rank_zero"


class Loads(LightningModule):
    """``configure_model`` runs ``build(self)``: the calls under test."""

    def __init__(self, build) -> None:
        super().__init__()
        self.build = build

    def configure_model(self) -> None:
        self.build(self)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for family, seed in (("qwen3_moe", 3), ("mixtral", 4)):
        model = saved(family, root / family, seed=seed)
        out[family] = (str(root / family), {k: v.clone() for k, v in model.state_dict().items()})
    return out


def _configure(build, pp: int = 1, module: LightningModule | None = None) -> LightningModule:
    strategy = MoEOverlapStrategy(pp=pp, num_microbatches=2)
    module = module if module is not None else Loads(build)
    strategy.connect(module)
    with strategy.model_sharded_context():
        module.configure_model()
    return module


@pytest.mark.parametrize("pp", [1, 2])
def test_from_pretrained_is_built_on_meta_and_its_weights_declared(folders, pp, caplog):
    path, _ = folders["qwen3_moe"]
    caplog.set_level(logging.INFO, logger=LOG)
    module = _configure(lambda m: setattr(m, "model", transformers.AutoModelForCausalLM.from_pretrained(path)), pp)
    assert all(p.is_meta for p in module.parameters()) and not module.model.training  # eval, as HF returns it
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert module.hf_weights == HFWeights(path, prefix="model.")
    assert f"`Qwen3MoeForCausalLM.from_pretrained('{path}')` -> `HFWeights('{path}', prefix='model.')`" in caplog.text
    assert "built on the meta device" in caplog.text and "ran as written" not in caplog.text
    assert transformers.PreTrainedModel.from_pretrained.__func__.__module__ == "transformers.modeling_utils"


def test_a_named_dtype_is_kept_and_config_kwargs_pass_through(folders):
    path, _ = folders["qwen3_moe"]
    cls = transformers.Qwen3MoeForCausalLM

    def build(m):
        m.model = cls.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager", router_aux_loss_coef=0.5)

    module = _configure(build)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert module.model.config.router_aux_loss_coef == 0.5 and attn_implementation(module.model.config) == "eager"
    assert module.model.model.rotary_emb.inv_freq.dtype == torch.float32  # as HF's own build keeps it


@pytest.mark.parametrize("pp", [1, 2])
def test_an_argument_the_meta_build_cannot_honour_runs_as_written(folders, pp, caplog):
    path, state = folders["qwen3_moe"]
    caplog.set_level(logging.INFO, logger=LOG)

    def build(m):
        m.model = transformers.AutoModelForCausalLM.from_pretrained(path, ignore_mismatched_sizes=True)

    module = _configure(build, pp)
    assert getattr(module, "hf_weights", None) is None
    assert not state_equal(module.model.state_dict(), state)  # HF's own load, every tensor real
    assert "(`ignore_mismatched_sizes` has no meaning for a build on the meta device)" in caplog.text
    assert "every rank reading the whole checkpoint" in caplog.text
    assert "HFWeights(folder, prefix=...)" in caplog.text and "HFMoECausalLM(pretrained=folder)" in caplog.text


def test_a_hub_id_runs_as_written(tmp_path):
    with meta_from_pretrained(torch.device("cpu")) as calls:  # (an auto class reads the config before: same error)
        with torch.device("meta"), pytest.raises(OSError):  # HF's own loader: not on the disk, not downloaded
            transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "org" / "name"), local_files_only=True)
    assert calls.fell_back and "not a local folder with a config.json" in calls.fell_back[0].reason


def test_a_model_the_module_does_not_hold_as_an_attribute_gets_its_values_as_written(folders, caplog):
    path, state = folders["qwen3_moe"]
    caplog.set_level(logging.INFO, logger=LOG)
    module = _configure(lambda m: setattr(m, "decoder", transformers.AutoModelForCausalLM.from_pretrained(path).model))
    assert getattr(module, "hf_weights", None) is None
    inner = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    assert not state_equal(module.decoder.state_dict(), inner)
    assert torch.isfinite(module.decoder.rotary_emb.inv_freq).all()  # non-persistent buffers come along
    assert "is not an attribute of the LightningModule" in caplog.text


def test_the_modules_own_declaration_is_kept(folders, caplog):
    path, _ = folders["qwen3_moe"]
    caplog.set_level(logging.INFO, logger=LOG)
    own = HFWeights(path, prefix="model.", ignore=(r"^nothing$",))
    module = Loads(lambda m: setattr(m, "model", transformers.AutoModelForCausalLM.from_pretrained(path)))
    module.hf_weights = own
    _configure(None, module=module)
    assert module.hf_weights is own and module.model.lm_head.weight.is_meta
    assert "(the module's own `hf_weights` covers it)" in caplog.text


def test_two_models_are_declared_each_under_its_prefix_and_load_into_the_meta_build(folders):
    (qwen, qwen_state), (mixtral, mixtral_state) = folders["qwen3_moe"], folders["mixtral"]

    def build(m):
        m.model = transformers.AutoModelForCausalLM.from_pretrained(qwen)
        m.draft = transformers.AutoModelForCausalLM.from_pretrained(mixtral)

    module = _configure(build)
    assert module.hf_weights == [HFWeights(qwen, prefix="model."), HFWeights(mixtral, prefix="draft.")]
    init = meta_init_of(module, torch.device("cpu"), seed=0)
    pending = find_meta_experts(module)
    materialize_dense(module, init)
    materialize_experts(pending, init)  # not expert-parallel here: whole, left empty for the load
    report = apply_pretrained(module, None)
    assert report is not None and report.family == "hub_experts+mixtral"
    assert not state_equal(module.model.state_dict(), qwen_state)
    assert not state_equal(module.draft.state_dict(), mixtral_state)
    for hf in (module.model, module.draft):  # the rotary buffers no checkpoint holds: each model's own init
        assert torch.isfinite(hf.model.rotary_emb.inv_freq).all()


def test_error_overlapping_declared_prefixes(folders):
    path, _ = folders["qwen3_moe"]
    with pytest.raises(ValueError, match=r"declares prefix='model\.' .* and prefix='model\.draft\.' .*one starts "
                                         r"with the other\. Rule: each declared checkpoint .* Fix: give each"):
        as_hf_weights_list([HFWeights(path), HFWeights(path, prefix="model.draft.")], "`M`")


def test_error_adopting_values_of_another_structure(folders):
    small = transformers.AutoModelForCausalLM.from_pretrained(folders["qwen3_moe"][0])
    other = transformers.AutoModelForCausalLM.from_pretrained(folders["mixtral"][0])
    with pytest.raises(RuntimeError, match=r"the model built from the config has module .* where the loaded one has "
                                           r".*Rule: both come from the same class and config\. Fix: .*build_on_meta"):
        _adopt(small, other)


def test_error_a_loader_the_strategy_does_not_recognise_names_the_opt_out():
    from transformers.integrations.accelerate import check_and_set_device_map

    with pytest.raises(RuntimeError, match=r"`Loads.configure_model` runs under the meta device .*a `from_pretrained` "
                                           r"the strategy does not recognise.*Fix: set `build_on_meta = False`"):
        _configure(lambda m: check_and_set_device_map(None))  # what HF's loaders run first: refuses the meta device


def test_the_interception_is_undone_on_error_and_leaves_other_threads_alone(folders):
    path, state = folders["qwen3_moe"]
    original = transformers.PreTrainedModel.__dict__["from_pretrained"]
    other: dict[str, torch.nn.Module] = {}

    def elsewhere() -> None:  # another thread, while the scope is open: HF's own loader
        other["model"] = transformers.AutoModelForCausalLM.from_pretrained(path)

    with pytest.raises(KeyError, match="configure_model failed"):
        with meta_from_pretrained(torch.device("cpu")) as calls, torch.device("meta"):
            assert transformers.PreTrainedModel.__dict__["from_pretrained"] is not original
            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join()
            raise KeyError("configure_model failed")
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is original
    assert not calls.recognised and not calls.fell_back
    assert not state_equal(other["model"].state_dict(), state)


def test_error_a_declared_entry_of_another_kind(folders):
    with pytest.raises(TypeError, match=r"`M`: `hf_weights` is a int \(3\)\. Rule: .*a list of them for several "
                                        r"models.*Fix: set `self\.hf_weights = HFWeights\(path\)`"):
        as_hf_weights_list([HFWeights(folders["qwen3_moe"][0]), 3], "`M`")
