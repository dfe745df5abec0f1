"""Tensor and pipeline parallel give one rank's tokens: the same greedy (and seeded) tokens for a mixed batch of
prefill chunks, decodes, a prefix-cache hit, a preemption and a constrained request, on torch.distributed (gloo)
ranks run by the mp executor and by Ray actors on a simulated two-node cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from network_addresses import free_port_block, non_loopback_address
from rank_processes import rank_pids

from lmserve import LLM, SamplingParams
from lmserve.sampling_params import StructuredOutputsParams

SHARED = list(range(300, 332))  # two full blocks that the second call finds in the prefix cache
# Small budgets force chunked prefill beside decodes, and a pool of 14 blocks forces preemptions.
TINY = {"dtype": "float32", "quantization": "none", "max_num_batched_tokens": 48, "num_blocks": 14,
        "max_model_len": 512}


def workload(llm: LLM) -> tuple[list[list[int]], dict]:
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm.generate([SHARED + [1, 2, 3]], greedy)
    prompts = [SHARED + [7, 8, 9, 10]] + [list(range(100 + 9 * i, 140 + 13 * i)) for i in range(4)]
    params = [greedy] * 4 + [SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)]
    outputs = llm.generate(prompts, params)
    choice = SamplingParams(max_tokens=8, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    outputs += llm.generate(["Answer:"], choice)
    stats = llm.engine.stats()
    return [list(o.outputs[0].token_ids) for o in outputs], {
        "prefix_cache_hits": stats.prefix_cache_hits, "num_preemptions": stats.num_preemptions,
        "choice": outputs[-1].outputs[0].text,
    }


@pytest.fixture(scope="module")
def one_rank(tiny_llama_dir: Path) -> tuple[list[list[int]], dict]:
    with LLM(str(tiny_llama_dir), **TINY) as llm:
        tokens, stats = workload(llm)
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats  # the batch is as mixed as said
    assert stats["choice"] in ("yes", "no")
    return tokens, stats


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                    {"tensor_parallel_size": 4}], ids=["tp2", "pp2", "tp4-kv-heads-replicated"])
def test_tensor_and_pipeline_parallel_give_one_ranks_tokens(one_rank, tiny_llama_dir: Path, layout: dict) -> None:
    """tp4: four ranks over the tiny model's 2 KV heads, each KV head on two ranks (as vLLM replicates them), each
    rank reading only its rows of the checkpoint."""
    with LLM(str(tiny_llama_dir), **TINY, **layout) as llm:
        tokens, stats = workload(llm)
        sent = llm.engine.executor.communication_stats()
    assert tokens == one_rank[0]
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    assert stats["choice"] == one_rank[1]["choice"]
    if "tensor_parallel_size" in layout:
        assert all(rank["all_reduce_bytes"] > 0 and rank["all_gather_bytes"] > 0 for rank in sent), sent
    else:
        assert sent[0]["send_bytes"] > 0 and sent[1]["send_bytes"] == 0, sent  # stage 0 sends, the last does not


def test_speculative_decoding_under_tensor_parallel_gives_one_ranks_greedy_tokens(tiny_llama_dir: Path) -> None:
    """Drafted positions, rolled-back block tables and preemptions reach the ranks as per-step changes
    (executor/step_messages.py): the greedy tokens stay one rank's without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 6 + [i] for i in range(4)] + [list(range(100 + 9 * i, 160 + 13 * i)) for i in range(3)]
    with LLM(str(tiny_llama_dir), **TINY) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    with LLM(str(tiny_llama_dir), **TINY, tensor_parallel_size=2, speculative_config=spec) as llm:
        drafted = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        stats = llm.engine.stats()
    assert drafted == plain
    assert stats.spec_decode_num_accepted_tokens > 0, stats
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens, stats  # some rolled back
    assert stats.num_preemptions > 0, stats


@pytest.fixture(scope="module")
def two_node_ray_cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow  # several machines, simulated
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_tensor_parallel_under_ray_on_two_nodes(one_rank, tiny_llama_dir: Path, two_node_ray_cluster,
                                                layout: dict) -> None:
    """The constrained request's masks reach the driver rank after its step started (RankActor.sample_tokens),
    with one batch in flight (tp2) and with one per stage (pp2). Then a killed actor fails the next step with its
    rank named as the cause, before its peer's error from the collective it was left in (one engine for both: each
    of Ray's actors is a fresh interpreter, ~4 s of CPU)."""
    import ray

    from lmserve.executor.base import RankFailedError

    with LLM(str(tiny_llama_dir), **TINY, **layout, distributed_executor_backend="ray") as llm:
        assert len(set(llm.engine.executor.node_ids())) == 2  # one rank on each simulated machine
        assert llm.engine.executor.takes_grammar_masks_later
        tokens, stats = workload(llm)
        ray.kill(llm.engine.executor.actors[1], no_restart=True)
        with pytest.raises(RankFailedError) as failure:
            llm.generate(["after the death"], SamplingParams(max_tokens=4))
    assert tokens == one_rank[0]
    assert stats["choice"] == one_rank[1]["choice"]
    assert str(failure.value).startswith("rank 1's actor died"), str(failure.value)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}],
                         ids=["tp3", "pp2"])
def test_default_model_splits_and_gives_one_ranks_greedy_tokens(layout: dict) -> None:
    """9 query heads over 3 KV heads split three ways; the GGUF's own q4_1 blocks split at block boundaries. Each
    pipeline stage runs its layers as one C++ program, as one rank does (tensor-parallel ranks from Python).
    A constrained request's masks, sent after each step, reach the rank that samples (the last stage's)."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    as_json = SamplingParams(max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    settings = {"kv_cache_memory": "64MiB", "max_model_len": 256}
    with LLM(**settings) as llm:
        assert llm.engine.executor.info.layer_program.startswith("one C++ program")
        expected = [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in llm.generate(prompts, greedy)]
        expected_json = [o.outputs[0].text for o in llm.generate(prompts, as_json)]
    with LLM(**settings, **layout) as llm:
        info = llm.engine.executor.info
        assert info.num_blocks > 0
        if "pipeline_parallel_size" in layout:
            assert info.layer_program.startswith("one C++ program"), info.layer_program
        else:
            assert "tensor parallel ranks" in info.layer_program, info.layer_program
        split = [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in llm.generate(prompts, greedy)]
        split_json = [o.outputs[0].text for o in llm.generate(prompts, as_json)]
    assert [tokens for tokens, _ in split] == [tokens for tokens, _ in expected]
    assert split_json == expected_json and all(json.loads(text)["city"] for text in split_json), split_json
    if "pipeline_parallel_size" in layout:  # a stage's layers are one rank's layers: the same bits
        assert split == expected


@pytest.mark.parametrize("model", ["tiny_phi3_q8_gguf", "tiny_gemma3_dir"])
def test_phi3_and_gemma_split_across_tensor_parallel_ranks(request, model: str) -> None:
    """Phi-3's fused q/k/v and gate/up (here a file's Q8_0 blocks) split so each rank holds its heads of q, of k and
    of v and its columns of gate and of up; Gemma 3's local and global layers, q/k norms and sandwich norms split
    by heads too: two ranks give one rank's greedy tokens."""
    path = str(request.getfixturevalue(model))
    # The tiny GGUF holds no vocabulary: the directory it was written from lends its tokenizer.
    tokenizer = str(request.getfixturevalue("tiny_phi3_dir")) if model.endswith("gguf") else None
    prompts = [list(range(100 + 9 * i, 140 + 13 * i)) for i in range(3)]  # 40 to 66 positions: past Gemma's window
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = {"dtype": "float32", "max_model_len": 256, "num_blocks": 32, "tokenizer": tokenizer}
    with LLM(path, **options) as llm:
        one = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    with LLM(path, **options, tensor_parallel_size=2) as llm:
        two = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    assert two == one
    if model == "tiny_phi3_q8_gguf":  # four ranks over 2 KV heads: each rank's k and v rows of the file's blocks
        with LLM(path, **options, tensor_parallel_size=4) as llm:
            assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == one
    if model == "tiny_gemma3_dir":  # and its local layers' KV-cache groups split across pipeline stages
        with LLM(path, **options, pipeline_parallel_size=2) as llm:
            assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == one


NODE_SECRET = "a secret every node of the test shares"


@pytest.fixture
def two_nodes(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Node 0's engine settings, and a function that starts node 1 (`lmserve serve --headless`) as another machine
    would: the same model, flags and secret (LMSERVE_NODE_SECRET), the rendezvous on this machine's network address,
    not the loopback."""
    from lmserve.distributed.signed_frames import NODE_SECRET_ENV

    monkeypatch.setenv(NODE_SECRET_ENV, NODE_SECRET)
    host = non_loopback_address()
    port = free_port_block(host, 4)
    nodes: list[subprocess.Popen] = []

    def start_node(*layout: str) -> subprocess.Popen:
        log = (tmp_path / f"node{len(nodes) + 1}.log").open("w")
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "lmserve.cli", "serve", str(tiny_llama_dir), *layout, "--node-rank", "1",
             "--master-addr", host, "--master-port", str(port), "--headless"], stdout=log, stderr=log))
        return nodes[-1]

    yield {"nnodes": 2, "master_addr": host, "master_port": port}, start_node
    for node in nodes:
        node.kill()
        node.wait()


@pytest.mark.slow  # several machines, simulated
def test_tensor_parallel_over_two_nodes_without_ray(one_rank, tiny_llama_dir: Path, two_nodes, tmp_path) -> None:
    """vLLM's multi-node mp executor: node 0 runs the engine and rank 0, node 1 (--headless) rank 1, each on the
    CPUs its own flags give; the greedy tokens are one rank's, and the engine's shutdown ends node 1 cleanly."""
    settings, start_node = two_nodes
    cpus = sorted(os.sched_getaffinity(0))
    node0_cpu, node1_cpu = (cpus[0], cpus[1]) if len(cpus) > 1 else (cpus[0], cpus[0])
    node1 = start_node("-tp", "2", "--nnodes", "2", "--engine-cpus", str(node1_cpu))
    with LLM(str(tiny_llama_dir), **TINY, tensor_parallel_size=2, engine_cpus=str(node0_cpu), **settings) as llm:
        assert len(llm.engine.executor.procs) == 1  # rank 1 is node 1's
        tokens, stats = workload(llm)
    assert tokens == one_rank[0]
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    assert node1.wait(timeout=30) == 0
    # Node 1's rank took node 1's CPUs, not the engine's: machines differ.
    assert f"rank 1: engine compute: 1 thread(s) on CPU(s) {node1_cpu}\n" in (tmp_path / "node1.log").read_text()


@pytest.mark.slow  # several machines, simulated
def test_a_rank_that_dies_on_another_node_is_named(tiny_llama_dir: Path, two_nodes) -> None:
    from lmserve.executor.base import RankFailedError

    settings, start_node = two_nodes
    node1 = start_node("-tp", "2", "--nnodes", "2")
    with LLM(str(tiny_llama_dir), **TINY, tensor_parallel_size=2, **settings) as llm:
        llm.generate(["warm"], SamplingParams(max_tokens=2))
        (rank1,) = rank_pids(node1.pid)
        os.kill(rank1, signal.SIGKILL)
        with pytest.raises(RankFailedError) as failure:
            llm.generate(["after the death"], SamplingParams(max_tokens=4))
    assert str(failure.value).startswith(f"rank 1 (pid {rank1}) on node 1 exited with code -9"), str(failure.value)
    assert node1.wait(timeout=30) == 1


@pytest.mark.slow  # several machines, simulated
def test_a_node_started_with_another_layout_is_refused(tiny_llama_dir: Path, two_nodes) -> None:
    from lmserve.executor.base import RankFailedError

    settings, start_node = two_nodes
    start_node("-tp", "2", "-pp", "2", "--nnodes", "4")  # its rank 1 meets the engine's, with another world
    with pytest.raises(RankFailedError, match=r"rank 1 failed: ValueError: this node was started for 4 ranks over 4 "
                                              r"node\(s\), the engine runs 2 over 2: give every node the same"):
        LLM(str(tiny_llama_dir), **TINY, tensor_parallel_size=2, **settings)


@pytest.mark.slow  # several machines, simulated
def test_a_node_stops_its_ranks_when_node_0_goes_away(two_nodes) -> None:
    """Node 0 stood in for by its results socket: node 1 connects, then the socket goes (an engine killed, a machine
    lost); node 1 stops its rank and exits 1 rather than leave it waiting."""
    import zmq

    from lmserve.distributed.signed_frames import curve_server, node_secret

    settings, start_node = two_nodes
    context = zmq.Context()
    results = context.socket(zmq.PULL)
    curve_server(results, node_secret([settings["master_addr"]], "node 0"))
    results.bind(f"tcp://{settings['master_addr']}:{settings['master_port'] + 1}")
    node1 = start_node("-tp", "2", "--nnodes", "2")
    deadline = time.monotonic() + 60
    while not rank_pids(node1.pid):
        assert time.monotonic() < deadline and node1.poll() is None
        time.sleep(0.05)
    (rank1,) = rank_pids(node1.pid)
    time.sleep(1.0)  # connected
    results.close(linger=0)
    context.term()
    assert node1.wait(timeout=30) == 1
    assert not Path(f"/proc/{rank1}").exists() or "zombie" in Path(f"/proc/{rank1}/status").read_text()


@pytest.mark.slow  # several machines, simulated
def test_a_process_without_the_secret_runs_no_code_in_node_0s_engine(tiny_llama_dir: Path, two_nodes,
                                                                     tmp_path: Path) -> None:
    """Node 0's results socket (master_port + 1) and its ranks' step sockets are reachable from the network: a
    process that connects there without the deployment's secret and pushes a pickle that would run code (vLLM's
    CVE-2025-30165) runs nothing, whether it speaks plain ZMQ or CurveZMQ with a guessed key, and the engine serves
    node 1's rank as before."""
    import threading

    import zmq

    from lmserve.distributed.signed_frames import curve_client

    settings, start_node = two_nodes
    marker = tmp_path / "code-ran"
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()  # pickle protocol 0: os.system("touch ...")
    context = zmq.Context()
    host, port = settings["master_addr"], settings["master_port"]
    attackers: list[zmq.Socket] = []
    nodes: list[subprocess.Popen] = []

    def attack_then_start_node_1() -> None:
        """While node 0's engine waits for node 1's rank (the engine in this thread: a rank dies with the thread
        that started it)."""
        for curve_key in (None, b"a guessed key of 32 bytes length"):
            for offset, kind in ((1, zmq.PUSH), (2, zmq.PULL)):
                sock = context.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                if curve_key is not None:
                    curve_client(sock, curve_key)
                sock.connect(f"tcp://{host}:{port + offset}")
                attackers.append(sock)
        time.sleep(2.0)  # connected, as far as they can
        for sock in attackers:
            if sock.socket_type == zmq.PUSH:
                for frames in ([payload], [b"x" * 32, payload]):
                    try:
                        sock.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # no connection came up: nothing to send on
        time.sleep(1.0)
        nodes.append(start_node("-tp", "2", "--nnodes", "2"))

    attacker = threading.Thread(target=attack_then_start_node_1)
    attacker.start()
    try:
        with LLM(str(tiny_llama_dir), **TINY, tensor_parallel_size=2, **settings) as llm:
            (out,) = llm.generate(["still serving"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            assert len(out.outputs[0].token_ids) == 4
        attacker.join()
        assert nodes[0].wait(timeout=30) == 0
        # A rank's step socket gave the attackers' PULL sockets nothing either: the handshake never completed.
        assert not any(sock.poll(0) for sock in attackers if sock.socket_type == zmq.PULL)
        assert not marker.exists()
    finally:
        attacker.join(timeout=10)
        context.destroy(linger=0)


@pytest.mark.parametrize(("model", "layouts"), [
    ("qwen2_moe", [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}]),
    ("mixtral", [{"tensor_parallel_size": 2, "enable_expert_parallel": True}]),
    ("kquant", [{"tensor_parallel_size": 2, "enable_expert_parallel": True}]),
], ids=["qwen2-moe-tp-and-ep", "mixtral-ep", "q4_k_m-experts-ep"])
def test_mixtures_of_experts_split_by_columns_or_by_experts_give_one_ranks_tokens(
        moe_dirs, moe_kquant, model: str, layouts: list[dict]) -> None:
    """Each expert's columns on every rank (Megatron, as the dense MLP), or whole experts on ranks (expert parallel),
    a shared expert and its gate split by columns too: one rank's greedy tokens. The K-quant experts keep their
    file's blocks whole on the rank that holds them."""
    path = str(moe_kquant[1] if model == "kquant" else moe_dirs[model])
    prompts = [list(range(100 + 9 * i, 140 + 13 * i)) for i in range(3)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = {"dtype": "float32", "max_model_len": 256, "num_blocks": 32}
    with LLM(path, **options) as llm:
        one = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    for layout in layouts:
        with LLM(path, **options, **layout) as llm:
            assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == one, layout


def test_olmoe_refuses_tensor_parallel_in_words(moe_dirs) -> None:
    """OLMoE normalizes q and k over all heads: a split by heads would need a norm across ranks."""
    with pytest.raises(Exception, match="normalizes q and k across all heads"):
        LLM(str(moe_dirs["olmoe"]), dtype="float32", max_model_len=256, num_blocks=32, tensor_parallel_size=2)
