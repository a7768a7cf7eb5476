"""Tensor parallelism on CPU: gloo, 2 and 4 processes (the same code NCCL runs on GPUs).

Greedy tokens of TP=2 / TP=4 engines equal transformers' (and so the TP=1 engine's, which
tests/engine/test_llm.py holds to the same outputs) for the tiny Llama / Qwen2 / Qwen3, with
the KV heads replicated at TP=4 (2 KV heads), prefix caching, chunked prefill and forced
preemption in one engine; the pool is whole after a drain; shutdown (or garbage collection)
leaves no process; a killed worker makes the next call fail at once.
Each engine starts its worker processes once per module (a few seconds each on 2 cores).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from helpers.engine_clients import run_requests
from helpers.engines import ENGINE, assert_greedy_matches_transformers
from helpers.tiny_models import hf_greedy
from mini_paged_attn.distributed import ShardLayout, TPGroup
from mini_paged_attn.engine import InprocEngineClient, LLMEngine, MPEngineClient
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.llm import LLM
from mini_paged_attn.engine.sampling_params import SamplingParams
from mini_paged_attn.errors import TensorParallelError
from mini_paged_attn.models.config import ModelConfig
from mini_paged_attn.models.loader import load_model

# (arch, tensor-parallel size, config overrides): qkv bias (Qwen2), q/k norms and a head size
# that is not hidden / heads (Qwen3), tied embeddings, and 2 KV heads over 4 ranks.
CASES = [("llama", 2, {"tie_word_embeddings": True}), ("qwen2", 2, {}), ("qwen3", 4, {}),
         ("llama", 4, {})]


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.peers.processes]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-tp{c[1]}")
def tp_case(request, tiny_model_factory):
    arch, n, overrides = request.param
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=n, **ENGINE)
    yield llm, model_dir
    pids = worker_pids(llm)
    llm.shutdown()
    assert_gone(pids)


def test_greedy_matches_transformers(tp_case):
    llm, model_dir = tp_case
    assert_greedy_matches_transformers(llm, model_dir)


def test_a_killed_worker_fails_the_next_call_at_once():
    p = SamplingParams(temperature=0.0, max_tokens=4)
    prompts = ["hello", "tensor parallel"]
    expected = [o.outputs[0].token_ids
                for o in LLM("tiny", device="cpu", num_kv_blocks=32).generate(prompts, p,
                                                                               use_tqdm=False)]
    llm = LLM("tiny", device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    # The tiny model's 259 tokens leave a padding row on rank 1's vocabulary shard.
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] == expected
    (pid,) = worker_pids(llm)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1"):
        llm.generate(prompts, p, use_tqdm=False)
    with pytest.raises(TensorParallelError, match="rank 1"):     # and it stays failed
        llm.generate(prompts, p, use_tqdm=False)
    assert time.monotonic() - start < 10
    # The server's client declares the engine dead at the first failed step (/health: 503).
    client = InprocEngineClient(llm.engine)
    client.add_request("r", "hello", p)
    while client.dead_reason is None and time.monotonic() - start < 20:
        time.sleep(0.05)
    assert "rank 1" in (client.dead_reason or "")
    client.shutdown()
    llm.shutdown()
    llm.shutdown()                                                 # idempotent


def test_a_worker_killed_inside_a_step_fails_that_step_without_a_hang():
    llm = LLM("tiny", device="cpu", num_kv_blocks=1024, tensor_parallel_size=2)
    (pid,) = worker_pids(llm)
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    try:
        # Far more steps than 0.5 s holds: the kill lands while steps run back to back,
        # almost always inside one step's collectives (else the check before the next step).
        with pytest.raises(TensorParallelError, match="rank 1.*code -9"):
            llm.generate(["x"] * 8, SamplingParams(max_tokens=2000, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - start < 15
    finally:
        killer.cancel()
        llm.shutdown()


def test_the_server_engine_process_runs_tensor_parallel_and_stops_its_workers():
    # The engine process of `serve --engine-process on`: its workers are its children.
    p = SamplingParams(temperature=0.0, max_tokens=4)
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=16)
    expected = LLM("tiny", **kwargs).generate("hello", p, use_tqdm=False)[0].outputs[0].token_ids
    client = MPEngineClient("tiny", dict(kwargs, tensor_parallel_size=2), start_timeout=120)
    try:
        (out,) = run_requests(client, [("hello", p)])
        assert out.outputs[0].token_ids == expected
        core = client.process.pid
        with open(f"/proc/{core}/task/{core}/children") as f:
            workers = [int(pid) for pid in f.read().split()]
        assert len(workers) == 1
    finally:
        client.shutdown()
    assert client.process.exitcode == 0
    assert_gone(workers)


def test_garbage_collection_stops_the_workers():
    llm = LLM("tiny", device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    pids = worker_pids(llm)
    del llm
    gc.collect()
    assert_gone(pids)


class _GraphHolder:
    """Stands in for rank 0's decode graphs (CPU engines capture none)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def release(self) -> None:
        self.log.append("graphs released")


def test_garbage_collection_releases_rank_0_graphs_before_the_group_closes(monkeypatch):
    log: list[str] = []
    close = TPGroup.close
    monkeypatch.setattr(TPGroup, "close",
                        lambda self: (log.append(f"rank {self.rank} group closed"), close(self)))
    llm = LLM("tiny", device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    holder = _GraphHolder(log)
    llm.engine.peers.track_graphs(holder)
    pids = worker_pids(llm)
    del llm
    gc.collect()
    assert_gone(pids)
    assert log == ["graphs released", "rank 0 group closed"]


def test_failed_ranks_never_release_graphs():
    """After a failure a collective may never finish: nothing waits for the device."""
    log: list[str] = []
    llm = LLM("tiny", device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    holder = _GraphHolder(log)
    llm.engine.peers.track_graphs(holder)
    (pid,) = worker_pids(llm)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TensorParallelError, match="rank 1"):
        llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    assert log == []


_EXIT_WITHOUT_SHUTDOWN = """
from mini_paged_attn.engine.llm import LLM
from mini_paged_attn.engine.sampling_params import SamplingParams

class Graphs:
    def release(self):
        print("rank 0 graphs released", flush=True)

if __name__ == "__main__":
    llm = LLM("tiny", device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    graphs = Graphs()
    llm.engine.peers.track_graphs(graphs)
    print("workers", *[p.pid for p in llm.engine.peers.processes], flush=True)
"""


def test_interpreter_exit_stops_a_live_engine(tmp_path):
    """A script that never calls shutdown(): at exit the workers' finalizer stops them and
    releases rank 0's graphs (still alive then) before the group closes."""
    script = tmp_path / "no_shutdown.py"
    script.write_text(_EXIT_WITHOUT_SHUTDOWN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "rank 0 graphs released" in lines, done.stdout
    pids = [int(p) for p in next(l for l in lines if l.startswith("workers")).split()[1:]]
    assert_gone(pids)
    assert "did not stop" not in done.stderr


@pytest.mark.parametrize("size, match", [
    (3, "num_attention_heads=4, got 3"), (8, "num_attention_heads=4, got 8"),
    (0, "tensor_parallel_size"), ("2", "tensor_parallel_size"), (True, "tensor_parallel_size")])
def test_bad_sizes_are_refused_before_any_process_starts(tiny_model_factory, size, match):
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_factory("llama"), device="cpu", tensor_parallel_size=size)
    assert {p.pid for p in multiprocessing.active_children()} == before


def test_a_too_long_max_model_len_is_refused_before_any_process_starts(tiny_model_factory):
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_model_factory("llama"), device="cpu", tensor_parallel_size=2,
            max_model_len=10**6)
    assert {p.pid for p in multiprocessing.active_children()} == before


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_greedy_on_two_gpus_matches_transformers(tiny_model_factory, enforce_eager, caplog):
    """NCCL, the Triton kernels, decode graphs replayed in step on both ranks, and the LM
    head on padded row counts (both ranks pad alike): fp32, so parity is exact. Shutdown
    stops the worker without terminating it (NCCL's shutdown used to wait on graphs that
    captured its collectives)."""
    model_dir = tiny_model_factory("qwen3")
    prompts = [[(5 * i + 3 * j) % 250 + 3 for j in range(2 + 7 * i)] for i in range(11)]
    expected = hf_greedy(model_dir, prompts, 8)
    llm = LLM(model_dir, dtype="float32", device="cuda", tensor_parallel_size=2,
              block_size=16, num_kv_blocks=64, max_num_seqs=8, max_model_len=128,
              enforce_eager=enforce_eager)
    try:
        assert llm.engine.runner.inputs.logit_buckets is not None
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8),
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.shutdown()
    assert "did not stop" not in caplog.text


class _FakeGroup:
    """A process group the layout tests never call (no collective runs)."""


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_loads_its_shard_and_the_shards_make_the_model(tiny_model_factory, n):
    model_dir = tiny_model_factory("qwen3")
    full, config = load_model(model_dir, dtype="float32")
    ranks = [load_model(model_dir, dtype="float32",
                        tp=TPGroup(r, n, torch.device("cpu"), _FakeGroup()))[0] for r in range(n)]
    attn = [m.layers[0].self_attn for m in ranks]
    hs, q = config.head_size, config.q_size
    # Query rows: the ranks' slices in order; o_proj columns likewise.
    q_rows = torch.cat([a.qkv_proj.weight[:a.num_q_heads * hs] for a in attn])
    assert torch.equal(q_rows, full.layers[0].self_attn.qkv_proj.weight[:q])
    o_cols = torch.cat([a.o_proj.weight for a in attn], dim=1)
    assert torch.equal(o_cols, full.layers[0].self_attn.o_proj.weight)
    # 2 KV heads: at TP=4 ranks 0-1 hold KV head 0, ranks 2-3 KV head 1.
    for r, a in enumerate(attn):
        layout = ShardLayout.of(config, r, n)
        k_rows = a.qkv_proj.weight[a.num_q_heads * hs:(a.num_q_heads + a.num_kv_heads) * hs]
        start = layout.kv_head_start * hs
        assert torch.equal(k_rows, full.layers[0].self_attn.qkv_proj.weight[q + start:q + start
                                                                           + len(k_rows)])
        assert a.num_kv_heads == 1                     # 2 KV heads over 2 or 4 ranks
    embed = torch.cat([m.embed_tokens.weight for m in ranks])[:config.vocab_size]
    assert torch.equal(embed, full.embed_tokens.weight)
    sizes = [sum(p.numel() for p in m.parameters()) for m in ranks]
    assert max(sizes) < sum(p.numel() for p in full.parameters()) / n * 1.2


def test_kv_head_replication_layout():
    config = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 1,
                                    "num_attention_heads": 8, "num_key_value_heads": 2,
                                    "vocab_size": 10, "max_position_embeddings": 16})
    layouts = [ShardLayout.of(config, r, 8) for r in range(8)]
    assert [lay.kv_head_start for lay in layouts] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.q_head_start for lay in layouts] == list(range(8))
    assert [lay.vocab_valid for lay in layouts] == [2, 2, 2, 2, 2, 0, 0, 0]
    # 6 ranks can neither split 4 KV heads nor share them evenly.
    odd = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 96,
                                 "intermediate_size": 96, "num_hidden_layers": 1,
                                 "num_attention_heads": 12, "num_key_value_heads": 4,
                                 "vocab_size": 10, "max_position_embeddings": 16})
    with pytest.raises(ValueError, match="num_key_value_heads=4, got 6"):
        ShardLayout.of(odd, 0, 6)


def test_engine_config_checks_the_size():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=-1)
    assert LLMEngine.shutdown                               # TP=1 engines have it too
