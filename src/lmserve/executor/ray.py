"""Ranks as Ray actors, possibly on several machines (`--distributed-executor-backend ray`).

Set-up is Ray's own: `ray start --head` on one machine, `ray start --address HEAD:6379` on the others, then
`lmserve serve ... --distributed-executor-backend ray` on the head. Without a running cluster the engine starts a
local Ray instance. A placement group reserves one bundle (one CPU, or one GPU on CUDA) per rank; the ranks meet
through torch.distributed at the address and a free port of rank 0's node, which rank 0's actor reports.

Each step's plan goes to every actor as an actor call; the driver rank's result is the step's output. A step with
constrained rows is sent before its grammar masks are filled: the driver rank runs it on a thread of its own and
samples when a second call, `sample_tokens`, brings the masks (vLLM's execute_model / sample_tokens split), so that the
engine fills them while the ranks compute. A failed or dead actor fails the engine (RankFailedError) with Ray's reason,
a rank whose actor died named first.
"""

from __future__ import annotations

import logging
import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from lmserve.config import EngineConfig
from lmserve.distributed.layout import RankLayout
from lmserve.executor.base import Executor, RankFailedError, batches_in_flight, reconciled_info
from lmserve.executor.step_messages import StepDecoder, StepEncoder, StepMessage
from lmserve.step import GrammarMasks, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60
POLL_S = 0.1
DEATH_SEEN_S = 1.0  # how long a failed step waits for the other ranks' results, to name a dead rank first
# How long a health check waits for every actor: a busy control store on a real cluster answers in seconds, not ms.
HEALTH_TIMEOUT_S = float(os.environ.get("LMSERVE_RAY_HEALTH_TIMEOUT_S", "60"))
# Environment that must reach the ranks on other machines (Ray starts actors with the node's, not the driver's).
FORWARDED_ENV_PREFIXES = ("LMSERVE_", "NCCL_", "GLOO_", "HF_", "TRANSFORMERS_", "TORCH_", "CUDA_", "OMP_")
# Each actor's own: Ray sets the devices a GPU bundle gives it (vLLM's WORKER_SPECIFIC_ENV_VARS leave these too).
RANK_OWN_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"})
# Names (comma-separated) a cluster's machines set each for themselves, e.g. NCCL_IB_HCA or NCCL_SOCKET_IFNAME where
# the nodes' interfaces differ: as vLLM's ray_non_carry_over_env_vars.json.
NOT_FORWARDED_ENV_SETTING = "LMSERVE_RAY_NOT_FORWARDED_ENV"


def forwarded_env(environ: dict[str, str]) -> dict[str, str]:
    """The driver's variables that the ranks need as the driver has them (lmserve's settings, NCCL's and gloo's
    interfaces, the Hugging Face cache), for the actors' runtime_env."""
    kept_local = RANK_OWN_ENV | {name.strip() for name in environ.get(NOT_FORWARDED_ENV_SETTING, "").split(",")}
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES) and k not in kept_local}


def ranks_on_cuda(device: str, cluster_gpus: float, world_size: int) -> bool:
    """Whether the ranks take GPU bundles. auto: what the cluster has, not what this (head) process sees, so that a
    CPU-only head does not hide the workers' GPUs."""
    if device == "auto" and 0 < cluster_gpus < world_size:
        logger.warning("the Ray cluster has %g GPU(s) for %d ranks: the ranks run on CPUs (--device cuda to wait "
                       "for GPUs instead)", cluster_gpus, world_size)
    return device == "cuda" or (device == "auto" and cluster_gpus >= world_size)


def groups_across_nodes(node_of_rank: list[str], tensor_parallel_size: int) -> list[int]:
    """The tensor-parallel groups whose ranks are not all on one machine: each layer's all-reduces of those cross
    the network."""
    groups = range(len(node_of_rank) // tensor_parallel_size)
    return [g for g in groups
            if len(set(node_of_rank[g * tensor_parallel_size:(g + 1) * tensor_parallel_size])) > 1]


def ranks_by_node(node_ids: list[str], first_node: str) -> list[int]:
    """Actor indices in rank order: the driver's node first, then node by node, so that consecutive ranks (a
    tensor-parallel group) share a machine wherever the placement group put them."""
    return sorted(range(len(node_ids)), key=lambda i: (node_ids[i] != first_node, node_ids[i], i))


class RankActor:
    """The body of one rank's actor (wrapped by ray.remote in RayExecutor)."""

    def __init__(self) -> None:
        self.worker: Any = None
        # The engine's calls reach an actor in the order it made them (Ray keeps one caller's order for an actor
        # that runs one call at a time), so the decoder sees every step message once and in order, and a deferred
        # step's sample_tokens comes right after its execute_model.
        self.steps = StepDecoder()
        self._step_thread: ThreadPoolExecutor | None = None  # the driver rank's, for steps that wait for masks
        self._deferred: tuple[queue.SimpleQueue, Future] | None = None

    def node_address(self) -> tuple[str, int]:
        import ray

        from lmserve.executor.multiproc import free_local_port

        return ray.util.get_node_ip_address(), free_local_port()

    def start(self, config: EngineConfig, rank: int, init_method: str, samples: bool = False) -> Any:
        """`samples`: this is the driver rank, which draws the tokens (and so is the one rank that reads masks)."""
        from lmserve.worker.worker import Worker

        logging.basicConfig(level=os.environ.get("LMSERVE_LOG_LEVEL", "INFO"),
                            format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
        self.worker = Worker(config, rank, init_method)
        if samples:
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmserve-ray-step")
        return self.worker.info

    def execute_model(self, message: StepMessage) -> ModelRunnerOutput | None:
        """Runs the step; on the driver rank, a step whose masks come later starts on the step thread and returns
        None at once, so that this actor can take the sample_tokens call that brings them."""
        step = self.steps.decode(message)
        if self._step_thread is None or not (isinstance(step.grammar, GrammarMasks) and step.grammar.mask is None):
            return self.worker.execute_model(step)
        masks: queue.SimpleQueue = queue.SimpleQueue()
        step.grammar.receive = masks.get
        self._deferred = (masks, self._step_thread.submit(self.worker.execute_model, step))
        return None

    def sample_tokens(self, mask: Any) -> ModelRunnerOutput | None:
        """The masks of the step execute_model started: they reach its draw (a step that sampled none of its
        constrained rows never reads them), and the step's output is this call's result."""
        if self._deferred is None:
            raise RuntimeError("grammar masks came for no step: execute_model started none that waits for them")
        (masks, running), self._deferred = self._deferred, None
        masks.put(mask)
        return running.result()

    def communication_stats(self) -> dict[str, int]:
        return self.worker.communication_stats()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        if self.worker is not None:
            self.worker.shutdown()


class RayOutput(Future):
    """The driver rank's output of one step; waiting for it also watches the other ranks, so that a dead rank
    fails the step at once instead of leaving its peers in a collective until it times out. A step whose masks come
    later has its output in the driver's sample_tokens call (`sampled`), set when the masks are sent."""

    def __init__(self, refs: list[Any], driver: int) -> None:
        super().__init__()
        self._refs, self._driver = refs, driver
        self.sampled: Any = None

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        import ray

        if not self.done():
            remaining = self._refs + ([self.sampled] if self.sampled is not None else [])
            try:
                while remaining:
                    ready, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=POLL_S)
                    ray.get(ready)  # raises if that rank failed
                self.set_result(ray.get(self.sampled if self.sampled is not None else self._refs[self._driver]))
            except (ray.exceptions.RayError, ray.exceptions.RayActorError) as exc:
                raise RankFailedError(self._cause_first(exc)) from exc
        return super().result(timeout)

    def _cause_first(self, first: Exception) -> str:
        """Which ranks failed, a rank whose actor died first: its peers then fail in their collectives, and
        whichever of them Ray reports first would otherwise hide the cause (as the multiproc executor orders them)."""
        import ray

        calls = list(enumerate(self._refs)) + ([(self._driver, self.sampled)] if self.sampled is not None else [])
        refs = [ref for _, ref in calls]
        ray.wait(refs, num_returns=len(refs), timeout=DEATH_SEEN_S)  # let the others settle
        died, failed = [], []
        for rank, ref in calls:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue  # still running (in a collective with the dead rank)
            except ray.exceptions.RayActorError as exc:
                died.append(f"rank {rank}'s actor died ({type(exc).__name__})")
            except ray.exceptions.RayError as exc:
                failed.append(f"rank {rank} failed: {str(exc).strip().splitlines()[-1][:500]}")
        if not died and not failed:
            return f"a Ray rank failed: {first}"
        return "; then ".join(dict.fromkeys(died + failed))  # the driver's two calls of a deferred step fail alike


class RayExecutor(Executor):
    takes_grammar_masks_later = True

    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel = config.parallel
        self.world_size = parallel.world_size
        self.pp_size = parallel.pipeline_parallel_size
        self.driver_rank = RankLayout.driver_rank(parallel.tensor_parallel_size, self.pp_size)
        self.max_concurrent_batches = batches_in_flight(config)
        self._steps = StepEncoder()  # each step sends what changed of each request (executor/step_messages.py)
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            # Joins the cluster of `ray start` (RAY_ADDRESS or this machine's), else starts a local one.
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
        cuda = ranks_on_cuda(config.model.device, ray.cluster_resources().get("GPU", 0), self.world_size)
        bundle = {"GPU": 1} if cuda else {"CPU": 1}
        self._placement = placement_group([bundle] * self.world_size, strategy="PACK")
        self._remove_placement_group = remove_placement_group
        if not self._placement.wait(PLACEMENT_TIMEOUT_S):
            self._remove_placement_group(self._placement)
            raise RuntimeError(
                f"the Ray cluster cannot place {self.world_size} ranks of {bundle} within {PLACEMENT_TIMEOUT_S}s "
                f"(resources: {ray.cluster_resources()})"
            )
        actor_class = ray.remote(num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0)(RankActor)
        runtime_env = {"env_vars": forwarded_env(dict(os.environ))}
        actors = [
            actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._placement, placement_group_bundle_index=bundle), runtime_env=runtime_env).remote()
            for bundle in range(self.world_size)
        ]
        self.actors = actors
        try:
            nodes = ray.get([a.node_id.remote() for a in actors])
            head = ray.get_runtime_context().get_node_id()
            order = ranks_by_node(nodes, head if head in nodes else nodes[0])
            self.actors = [actors[i] for i in order]
            if spanning := groups_across_nodes([nodes[i] for i in order], parallel.tensor_parallel_size):
                logger.warning("tensor-parallel group(s) %s span machines (the placement group's bundles did not "
                               "fit one node each): their all-reduces cross the network", spanning)
            host, port = ray.get(self.actors[0].node_address.remote())
            init_method = f"tcp://{host}:{port}"
            infos = ray.get([a.start.remote(config, rank, init_method, rank == self.driver_rank)
                             for rank, a in enumerate(self.actors)])
        except Exception:
            self.shutdown()
            raise
        self.info = reconciled_info(infos, self.driver_rank)
        logger.info("%d Ray ranks ready (rendezvous %s)", self.world_size, init_method)

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        import ray

        ref = ray.put(self._steps.encode(scheduler_output))  # serialized once for every rank
        self._last = RayOutput([a.execute_model.remote(ref) for a in self.actors], self.driver_rank)
        return self._last

    def send_grammar_masks(self, mask: Any) -> None:
        """The masks of the step just submitted, to the driver rank, which waits for them to sample."""
        self._last.sampled = self.actors[self.driver_rank].sample_tokens.remote(mask)

    def check_health(self) -> None:
        import ray

        try:
            ray.get([a.node_id.remote() for a in self.actors], timeout=HEALTH_TIMEOUT_S)
        except Exception as exc:
            raise RankFailedError(f"a Ray rank is gone: {exc}") from exc

    def communication_stats(self) -> list[dict[str, int]]:
        import ray

        return ray.get([a.communication_stats.remote() for a in self.actors])

    def node_ids(self) -> list[str]:
        """The Ray node each rank runs on, by rank."""
        import ray

        return ray.get([a.node_id.remote() for a in self.actors])

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "_placement", None) is not None:
            self._remove_placement_group(self._placement)
            self._placement = None
        if self._started_ray:
            ray.shutdown()
