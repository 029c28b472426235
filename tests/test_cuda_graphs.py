"""Decode CUDA graphs (engine/worker/cuda_graphs.py) without a GPU: the capture sizes, the static buffers'
padding, and the padded forward run eagerly, which must give the unpadded batch's hidden states and write
nothing for the padding rows. The capture and replay themselves are in tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from pagedserve.cluster.cli import build_parser, serve_args_from
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.layers.attention_metadata import AttentionMetadata
from pagedserve.engine.worker.cuda_graphs import (
    CUDAGraphRunner,
    DecodeGraphBuffers,
    capture_sizes,
    padded_size,
    run_padded_eager,
)

BLOCK_SIZE = 4


def decode_batch(
    seq_lens: list[int], block_ids: list[list[int]], block_size: int = BLOCK_SIZE, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode-only batch the way the model runner builds one: sequence i's new token sits at position
    seq_lens[i] - 1 in the blocks block_ids[i]."""
    n = len(seq_lens)
    width = max(len(b) for b in block_ids)
    table = torch.zeros(n, width, dtype=torch.int32)
    for i, blocks in enumerate(block_ids):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    positions = torch.tensor(seq_lens, dtype=torch.long) - 1
    slots = table[torch.arange(n), positions // block_size].long() * block_size + positions % block_size
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed))
    md = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        num_decodes=n,
        num_decode_tokens=n,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=list(seq_lens),
    )
    return ids, positions, md


# ---------------------------------------------------------------------------------------- sizes


def test_default_sizes_follow_the_vllm_ladder():
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert sizes[-1] == 256 and all(s % 8 == 0 for s in sizes[3:])
    assert sizes == sorted(set(sizes))
    assert capture_sizes(10) == [1, 2, 4, 8, 10]  # the full batch needs no padding past max_num_seqs
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(2000)[-1] == 512  # larger decode batches run eagerly


def test_configured_sizes_replace_the_ladder_clipped_to_max_num_seqs():
    assert capture_sizes(64, [32, 1, 8, 8]) == [1, 8, 32]
    assert capture_sizes(16, [4, 100, 200]) == [4, 16]
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        capture_sizes(16, [0, 4])
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_padded_size_is_the_smallest_size_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert padded_size(17, sizes) is None
    assert padded_size(1, []) is None


# ---------------------------------------------------------------------------------------- config and CLI


def test_config_validates_cuda_graph_sizes_and_defaults_to_graphs_on(tiny_llama):
    config = EngineConfig(model=str(tiny_llama))
    assert config.enforce_eager is False and config.cuda_graph_sizes is None
    assert EngineConfig(model=str(tiny_llama), cuda_graph_sizes=[8, 1, 4, 8]).cuda_graph_sizes == [1, 4, 8]
    for bad in ([0, 4], [-1], []):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig(model=str(tiny_llama), cuda_graph_sizes=bad)


def test_cli_maps_the_graph_flags(tiny_llama, capsys):
    ns = build_parser().parse_args(["serve", str(tiny_llama), "--enforce-eager", "--cuda-graph-sizes", "8", "2"])
    args = serve_args_from(ns)
    assert args.engine_kwargs()["enforce_eager"] is True
    assert args.engine_kwargs()["cuda_graph_sizes"] == [2, 8]
    assert "enforce_eager" not in serve_args_from(build_parser().parse_args(["serve", str(tiny_llama)])).engine_kwargs()
    with pytest.raises(SystemExit):
        serve_args_from(build_parser().parse_args(["serve", str(tiny_llama), "--cuda-graph-sizes", "0"]))
    assert "--cuda-graph-sizes" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- buffers


def test_fill_copies_the_real_rows_and_pads_the_rest_harmlessly():
    buffers = DecodeGraphBuffers(max_size=8, max_model_len=30, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    assert buffers.max_blocks_per_seq == 8  # ceil(30 / 4)
    # A wide batch first, so the next, narrower one must clear what it left behind.
    ids, pos, md = decode_batch([29, 29, 29, 29, 29, 29], [[9] * 8] * 6)
    buffers.fill(8, ids, pos, md)
    ids, pos, md = decode_batch([6, 11, 3], [[1, 2], [3, 4, 5], [6]])
    out = buffers.fill(4, ids, pos, md)

    assert buffers.input_ids[:4].tolist() == ids.tolist() + [0]
    assert buffers.positions[:4].tolist() == [5, 10, 2, 0]
    assert buffers.slot_mapping[:4].tolist() == [2 * 4 + 1, 5 * 4 + 2, 6 * 4 + 2, -1]
    assert buffers.seq_lens[:4].tolist() == [6, 11, 3, 1]
    assert buffers.block_tables[:4].tolist() == [
        [1, 2, 0, 0, 0, 0, 0, 0], [3, 4, 5, 0, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0, 0, 0], [0] * 8,
    ]
    # The metadata is a view over the buffers with host fields that do not change between replays.
    assert out.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr() and out.slot_mapping.shape == (4,)
    assert out.block_tables.shape == (4, 8)
    assert out.query_start_loc.tolist() == [0, 1, 2, 3, 4] == out.query_start_loc_cpu
    assert (out.num_decodes, out.num_decode_tokens, out.num_prefills, out.max_query_len) == (4, 4, 0, 1)
    assert out.max_seq_len == 30 and out.seq_lens_cpu == [30] * 4

    exact = buffers.fill(4, ids, pos, md, graph_safe=False)
    assert exact.seq_lens_cpu == [6, 11, 3, 1] and exact.max_seq_len == 11
    assert buffers.slot_mapping[:4].tolist() == [9, 22, 26, -1]


def test_fill_refuses_what_a_decode_graph_cannot_hold():
    buffers = DecodeGraphBuffers(max_size=4, max_model_len=16, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    ids, pos, md = decode_batch([6, 11, 3], [[1, 2], [3, 4, 5], [6]])
    with pytest.raises(ValueError, match="padded size"):
        buffers.fill(2, ids, pos, md)
    with pytest.raises(ValueError, match="padded size"):
        buffers.fill(8, ids, pos, md)
    prefill = AttentionMetadata(**{**md.__dict__, "num_decodes": 2, "num_decode_tokens": 2, "max_query_len": 2})
    with pytest.raises(ValueError, match="decode-only"):
        buffers.fill(4, ids, pos, prefill)
    ids, pos, wide = decode_batch([3], [[1, 2, 3, 4, 5]])
    assert not buffers.fits(wide)
    with pytest.raises(ValueError, match="block table width"):
        buffers.fill(1, ids, pos, wide)


# ---------------------------------------------------------------------------------------- the runner


def test_enforce_eager_and_non_cuda_devices_turn_graphs_off(tiny_llama):
    caches = [(torch.zeros(4, BLOCK_SIZE, 2, 16), torch.zeros(4, BLOCK_SIZE, 2, 16))]
    model = torch.nn.Linear(2, 2)
    eager = EngineConfig(model=str(tiny_llama), max_model_len=64, enforce_eager=True)
    graphed = EngineConfig(model=str(tiny_llama), max_model_len=64)
    _, _, md = decode_batch([3], [[1]])
    for runner in (
        CUDAGraphRunner(model, caches, eager, torch.device("cuda")),  # nothing touches the device when off
        CUDAGraphRunner(model, caches, eager, torch.device("cpu"), replay_eagerly=True),
        CUDAGraphRunner(model, caches, graphed, torch.device("cpu")),
        CUDAGraphRunner(model, caches, graphed.model_copy(update={"kv_transfer_config": None,
                                                                  "pipeline_parallel_size": 2}),
                        torch.device("cpu"), replay_eagerly=True),
    ):
        runner.capture()
        assert not runner.enabled and runner.sizes == [] and runner.buffers is None
        assert not runner.can_run(1, md)
    on = CUDAGraphRunner(model, caches, graphed, torch.device("cpu"), replay_eagerly=True)
    assert on.enabled and not on.can_run(1, md)  # not captured yet
    on.capture()
    assert on.can_run(1, md)
    assert not on.can_run(1, md, has_kv_hooks=True) and not on.can_run(1, md, has_intermediate=True)


@pytest.fixture
def llm(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=48, block_size=BLOCK_SIZE, max_model_len=64,
              max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8], enable_prefix_caching=False)
    yield llm
    llm.shutdown()


@torch.inference_mode()
def test_padded_decode_matches_the_unpadded_batch_and_writes_only_real_slots(llm):
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    model, caches = runner.model, runner.kv_caches
    torch.manual_seed(0)
    for k, v in caches:  # random context, so a stray padding write would show
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    ids, pos, md = decode_batch([6, 11, 3], [[1, 2], [3, 4, 5], [6]])
    before = [(k.clone(), v.clone()) for k, v in caches]

    expected = model.forward(ids, pos, caches, md)
    written = [(k.clone(), v.clone()) for k, v in caches]
    for (k, v), (k0, v0) in zip(caches, before):
        k.copy_(k0)
        v.copy_(v0)
    buffers = DecodeGraphBuffers(8, 64, BLOCK_SIZE, runner.device)
    hidden = run_padded_eager(model.forward, caches, buffers, ids, pos, md, padded=4)

    assert hidden.shape == expected.shape == (3, model.spec.hidden_size)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)
    real = torch.zeros(caches[0][0].shape[0] * BLOCK_SIZE, dtype=torch.bool)
    real[md.slot_mapping] = True
    for (k, v), (k0, v0), (k1, v1) in zip(caches, before, written):
        for now, old, ref in ((k, k0, k1), (v, v0, v1)):
            now, old, ref = (t.view(real.shape[0], -1) for t in (now, old, ref))
            assert torch.equal(now[~real], old[~real])  # the padding row wrote nothing
            torch.testing.assert_close(now[real], ref[real], rtol=0, atol=1e-6)
            assert not torch.equal(now[real], old[real])  # the real rows did write


def route_through_runner_graphs(runner, graphs, monkeypatch) -> list[int]:
    """Install `graphs` as the runner's own graph runner (what execute_model consults for decode-only
    steps) and record the batch size of every step it replays."""
    routed: list[int] = []
    run = graphs.run

    def recording_run(input_ids, positions, md):
        routed.append(md.num_decodes)
        return run(input_ids, positions, md)

    monkeypatch.setattr(graphs, "run", recording_run)
    monkeypatch.setattr(runner, "graphs", graphs)
    return routed


def test_engine_decode_steps_through_the_padded_path_generate_the_same_tokens(llm, monkeypatch):
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (5, 9, 14)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    graphs = CUDAGraphRunner(runner.model, runner.kv_caches, runner.config, runner.device, replay_eagerly=True)
    graphs.capture()
    routed = route_through_runner_graphs(runner, graphs, monkeypatch)
    padded = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert padded == eager
    assert 3 in routed  # three decodes ran padded to four
