"""Pipeline layouts: Megatron's layout strings (checked against megatron-core's own parser), the even split,
the rank of each chunk, and every validation error."""

from __future__ import annotations

import pytest

from lightning_moe_overlap.config.pipeline_layout import build_layout, parse_layout, suggest_layout

SEED_LAYOUT = "Et*3|(tt|)*29,m|L"  # DeepSeek-V3, 61 layers + 1 MTP layer, pp=16 vpp=2 (the seeds' example)
MEGATRON_EXAMPLES = [SEED_LAYOUT, "Ettt|(tt|)*29,m|L", "E(t|)*3tL", "Et|(t|t)*2|tL", "Et*2|t*2|t*2|t*2L", "Et||tL"]


def _megatron():
    return pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout", reason="megatron-core")


@pytest.mark.parametrize("text", MEGATRON_EXAMPLES)
def test_parse_matches_megatron(text):
    mc = _megatron()
    symbol = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    chunks = mc.PipelineParallelLayerLayout.parse_str_to_list(text)
    theirs = ["".join(symbol[t.name] for t in chunk) for chunk in chunks]
    assert parse_layout(text) == theirs


def test_seed_layout_layers_per_rank_match_megatron():
    mc = _megatron()
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType

    ours = build_layout(61, 16, None, SEED_LAYOUT, num_mtp_layers=1)
    assert (ours.vpp, ours.num_chunks, ours.num_layers) == (2, 32, 61)
    theirs = mc.PipelineParallelLayerLayout(SEED_LAYOUT, 16)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
    try:
        for chunk in ours.chunks:
            expected = theirs.get_layer_id_list(LayerType.decoder, vp_stage=chunk.virtual_stage, pp_rank=chunk.rank)
            assert list(chunk.layers) == expected, chunk
            assert chunk.index == chunk.virtual_stage * 16 + chunk.rank  # Megatron's interleaved assignment
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    assert ours.chunks[30].mtp_layers == (0,) and ours.chunks[30].rank == 14
    assert ours.chunks[31].symbols == "L" and ours.chunks[31].layers == ()


def test_nested_groups_and_whitespace():
    assert parse_layout("E ((t|)*2)*2 tL") == ["Et", "t", "t", "t", "tL"]


def test_even_split_and_ranks():
    lay = build_layout(8, 2, 2)
    assert [c.layers for c in lay.chunks] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [c.index for c in lay.chunks_of_rank(0)] == [0, 2] and [c.index for c in lay.chunks_of_rank(1)] == [1, 3]
    assert lay.chunks[0].embedding and lay.chunks[3].loss and not lay.chunks[1].embedding | lay.chunks[1].loss
    assert lay.to_str() == "Et*2|t*2|t*2|t*2L"
    assert lay.table() == "pp rank 0: chunk 0: Et*2; chunk 2: t*2\npp rank 1: chunk 1: t*2; chunk 3: t*2L"
    assert build_layout(4, 2).vpp == 1 and [c.layers for c in build_layout(4, 2).chunks] == [(0, 1), (2, 3)]


def test_v_placement_is_dualpipev_shape():
    lay = build_layout(8, 2, 2, placement="v")
    assert [(c.rank, c.virtual_stage) for c in lay.chunks] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert [c.index for c in lay.chunks_of_rank(0)] == [0, 3]  # first and last chunk on rank 0
    lay4 = build_layout(8, 4, 2, placement="v")
    assert [c.rank for c in lay4.chunks] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_layout_string_round_trips_and_empty_middle_chunk():
    lay = build_layout(4, 2, 2, "Et|tt||tL")
    assert [c.layers for c in lay.chunks] == [(0,), (1, 2), (), (3,)]
    assert build_layout(4, 2, 2, lay.to_str()) == lay
    assert lay.table() == "pp rank 0: chunk 0: Et; chunk 2: (empty)\npp rank 1: chunk 1: t*2; chunk 3: tL"


def test_explicit_indices():
    lay = build_layout(5, 2, 1, [[0, 1], [2, 3, 4]])
    assert [c.symbols for c in lay.chunks] == ["Ett", "tttL"]


def test_uneven_suggestion_builds():
    text = suggest_layout(10, 4)
    assert text == "Et*2|t*3|t*3|t*2L"
    assert build_layout(10, 2, 2, text).num_layers == 10


# -- errors ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,match",
    [
        ("Et|t)L", r"'\)' at position 4 has no matching '\('.*Fix: remove it"),
        ("E(t|tL", r"'\(' at position 1 is never closed.*Fix: add the '\)'"),
        ("E()t|tL", r"the group at position 1 is empty.*Fix: remove '\(\)'"),
        ("E*2t|tL", None),  # E repeated: caught by the E rule below, not the parser
        ("*2Et|tL", r"'\*' at position 0 repeats nothing.*Fix: write e.g. 't\*4'"),
        ("Ex|tL", r"'x' at position 1 is not a layout symbol.*Fix: use those symbols only"),
        ("Et*|tL", r"'\*\|' at position 2 is not a repeat count.*integer N >= 1"),
        ("Et*0|tL", r"'\*0\|' at position 2 is not a repeat count"),
    ],
)
def test_parse_errors(text, match):
    if match is None:
        with pytest.raises(ValueError, match=r"'E' \(embedding\) appears once"):
            build_layout(2, 2, 1, text)
        return
    with pytest.raises(ValueError, match=match):
        parse_layout(text)


def test_parse_rejects_non_str():
    with pytest.raises(TypeError, match=r"pipeline_layout must be a str, got int"):
        parse_layout(3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_layers=4, pp=0), r"pp=0\. Rule: an integer >= 1"),
        (dict(num_layers=4, pp=2, vpp=True), r"vpp=True\. Rule: an integer >= 1"),
        (dict(num_layers=4, pp=2, placement="zigzag"), r"placement='zigzag' is not one of.*Fix: 'interleaved'"),
        (dict(num_layers=6, pp=2, vpp=3, placement="v"), r"placement='v' with vpp=3.*needs an even vpp"),
        (dict(num_layers=6, pp=2, vpp=2), r"num_layers=6 does not split evenly into pp \* vpp = 2 \* 2 = 4.*"
                                           r"pipeline_layout='Et\|t\*2\|t\*2\|tL'"),
        (dict(num_layers=4, pp=2, layout=[[0, 2], [1, 3]]), r"does not hold layers 0\.\.3 once each and in order"),
        (dict(num_layers=4, pp=2, layout="Et|t|tt|L|t"), r"has 5 chunks, not a multiple of pp=2.*vpp = chunks / pp"),
        (dict(num_layers=4, pp=2, vpp=2, layout="Ett|ttL"), r"has 2 chunks but pp \* vpp = 2 \* 2 = 4"),
        (dict(num_layers=4, pp=2, layout="tE|tttL"), r"'E' \(embedding\) appears once, first in chunk 0"),
        (dict(num_layers=4, pp=2, layout="|Ett|ttL|"), r"'E' \(embedding\) appears once, first in chunk 0"),
        (dict(num_layers=4, pp=2, layout="EttL|tt"), r"'L' \(norm, head, loss\) appears once, last"),
        (dict(num_layers=4, pp=2, layout="Ett|tL"), r"has 3 't' \(transformer layers\) but the model has num_layers=4"),
        (dict(num_layers=4, pp=2, layout="Ett|ttmL"), r"has 1 'm' \(MTP layers\) but the model has num_mtp_layers=0"),
        (dict(num_layers=4, pp=2, layout="Ettm|ttL", num_mtp_layers=1), r"MTP layers follow every decoder layer"),
        (dict(num_layers=4, pp=2, vpp=2, layout="Et|t|tm|tmL", num_mtp_layers=2), r"MTP layers follow every"),
        (dict(num_layers=4, pp=2, vpp=2, layout="Ett|tt|m|L", num_mtp_layers=1), None),
        (dict(num_layers=4, pp=2, vpp=2, layout="Ett|ttm||L", num_mtp_layers=1),
         r"MTP layers are in chunk 1, not the last virtual stage of its rank"),
    ],
)
def test_build_errors(kwargs, match):
    if match is None:  # the seeds' MTP placement is valid
        assert build_layout(**kwargs).chunks[2].mtp_layers == (0,)
        return
    with pytest.raises(ValueError, match=match):
        build_layout(**kwargs)


def test_chunks_of_rank_out_of_range():
    with pytest.raises(ValueError, match=r"rank=2 is outside the pp group \[0, 2\)"):
        build_layout(4, 2).chunks_of_rank(2)
