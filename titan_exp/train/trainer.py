"""One rank's training, in torchtitan's shape: `Trainer.run` joins the process group and builds
everything once (mesh, this rank's model parts, optimizers, checkpointer, data, the step's forward
and backward, the meter and the profiler), then `train` runs `train_step` for each step, logging,
checkpointing and watching for a stop request between steps. Rank 0 leads: it measures, prints and
tracks; every rank takes part in the collectives. A validation pass belongs beside `train_step`,
run from `train` every so many steps."""

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from launchers.env import RankEnv, wait_for_rendezvous
from launchers.signals import StopRequested, stop_requested
from titan_exp.checkpoint.hf import load_hf
from titan_exp.checkpoint.layout import step_dir
from titan_exp.checkpoint.manager import TrainCheckpointer, load_model, save_model
from titan_exp.config.job import ResolvedJob
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.data.text import prepare_tokens
from titan_exp.metrics import startup
from titan_exp.metrics.expert_load import EXPERT_LOAD_ARTIFACT, plot_expert_load
from titan_exp.metrics.peak_flops import cpu_peak_flops, gpu_peak_flops
from titan_exp.models.moe.balance import ExpertBalance
from titan_exp.models.moe.layer import uncounted
from titan_exp.optim.grad_clip import clip_grad_norm_, reduce_partial_gradients
from titan_exp.optim.lr_schedule import build_lr_scheduler
from titan_exp.optim.optimizer import build_optimizer
from titan_exp.parallel.mesh import ParallelMesh, set_collective_timeout
from titan_exp.profiling.profiler import RankProfiler
from titan_exp.quantize.float8 import after_optimizer_step
from titan_exp.tracking.writer import BackgroundTracker
from titan_exp.train.leader import Leader
from titan_exp.train.loss import cross_entropy_loss
from titan_exp.train.model_parts import ModelParts, build_model_parts
from titan_exp.train.step import ForwardBackward, StepOutcome, global_loss
from titan_exp.train.validation import Validator


class NonFiniteTraining(RuntimeError):
    """The loss or the gradients stopped being finite numbers; the weights are left as they were."""


@dataclass
class _Optimizers:
    """One optimizer (and schedule) per model part, so checkpoints address state by parameter name."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list

    @classmethod
    def build(cls, model: ModelParts, job: ResolvedJob) -> "_Optimizers":
        cfg = job.config
        optimizers = [build_optimizer(part.parameters(), cfg.optimizer) for part in model.parts]
        schedulers = [build_lr_scheduler(o, cfg.training.steps, cfg.lr_scheduler) for o in optimizers]
        return cls(optimizers, schedulers)

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def step(self) -> None:
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)


class Trainer:
    def __init__(
        self,
        job: ResolvedJob,
        env: RankEnv,
        device: torch.device,
        model: ModelParts,
        mesh: ParallelMesh,
        job_dir: Path,
        leader: "Leader | None",
    ):
        """Everything a step needs, built once; `job_dir`: where profiling and the run's plots
        write; `leader`: rank 0's measuring, printing and tracking."""
        cfg = job.config
        self.job, self.env, self.device, self.model, self.mesh, self.leader = job, env, device, model, mesh, leader
        self.job_dir = job_dir
        self.optimizers = _Optimizers.build(model, job)
        train_batches = self._batch_loader("train")
        self.checkpointer = TrainCheckpointer(
            cfg.checkpoint, model.parts, self.optimizers.optimizers, self.optimizers.schedulers, cfg.model,
            train_batches if train_batches.streamed else None,
        )  # fmt: skip
        self.resumed_step = self.checkpointer.resume()
        if self.resumed_step and leader:
            print(f"resumed from {step_dir(cfg.checkpoint.folder, self.resumed_step)}", flush=True)
        pipeline = self._pipeline() if job.dims.pp > 1 else None
        self.forward_backward = ForwardBackward(job, model.parts, pipeline, mesh, train_batches, device)
        validation = cfg.validation
        self.validator = (
            Validator(validation, cfg.training.steps, self.forward_backward, self._batch_loader("validation"), mesh)
            if validation.enable
            else None
        )
        self.parameters = model.parameters
        self.expert_balance = ExpertBalance(model.parts, cfg.model, device) if cfg.model.moe.enabled else None
        self.profiler = RankProfiler(
            cfg.profiling, job_dir, env.rank, device, model.parts,
            self.optimizers.optimizers, self.resumed_step + 1,
        )  # fmt: skip
        # Slurm warns a job ahead of its time limit (or preemption) with a signal: see _stop_agreed.
        self.watch_stop = job.on_slurm

    @classmethod
    def run(
        cls, job: ResolvedJob, env: RankEnv, tracker: BackgroundTracker | None = None, job_dir: Path = Path(".")
    ) -> dict[str, object]:
        """The rank's whole life: returns rank 0's last logged metrics (empty elsewhere).
        `tracker`: rank 0's MLflow writer, started by the caller (rank/entry.py); `job_dir`: where
        profiling writes."""
        device = select_device(job.placement.device, env.local_rank)
        set_determinism(job.config.debug.seed, job.config.debug.deterministic)
        leader = None
        if env.rank == 0:
            # On CPU, measured while nothing else runs: the other ranks wait in the rendezvous and
            # rank 0's MLflow writer is paused.
            with tracker.paused() if tracker else contextlib.nullcontext():
                leader = Leader(tracker, _peak_flops(job, device))
        startup.mark("peak_flops")
        with _process_group(env, device, job.config.comm.init_timeout_seconds):
            startup.mark("process_group")
            return cls._build_and_train(job, env, device, job_dir, leader)

    @classmethod
    def _build_and_train(
        cls, job: ResolvedJob, env: RankEnv, device: torch.device, job_dir: Path, leader: "Leader | None"
    ) -> dict[str, object]:
        """Inside the process group: build the model, then train (or write a seed checkpoint). Its own
        function so that the model and mesh, which hold the process groups, are gone when it returns."""
        mesh = ParallelMesh(job.dims, device.type)
        model = build_model_parts(job.config, mesh, device)
        _materialize(model, job, device)
        startup.mark("model")
        if job.config.checkpoint.create_seed_checkpoint:
            path = save_model(model.parts[0], job.config.checkpoint.folder)  # one rank, one part (config/check.py)
            if leader:
                print(f"seed checkpoint written to {path}; load it with checkpoint.initial_load_path={path}")
            return {}
        return cls(job, env, device, model, mesh, job_dir, leader).train()

    def train(self) -> dict[str, object]:
        """Train from the step after the resumed one to training.steps."""
        steps = self.job.config.training.steps
        if self.leader:
            self.leader.start(self)
        startup.mark("optimizer_data")
        for step in range(self.resumed_step + 1, steps + 1):
            with self.profiler.step(step):
                outcome = self.train_step(step)
            if self.leader:
                self.leader.count(self, step, outcome)
            self._log(step, outcome)
            if self.validator and self.validator.due(step):
                start = time.perf_counter()
                loss = self.validator.loss()  # collectives: every rank takes part
                if self.leader:
                    self.leader.log_validation(step, loss, time.perf_counter() - start)
            if step == self.resumed_step + 1:
                set_collective_timeout(self.job.config.comm.train_timeout_seconds)
                if self.leader:
                    self.leader.report_startup(step)
            saved = self.checkpointer.maybe_save(step, steps, is_writer=self.leader is not None)
            if self.watch_stop and step < steps and self._stop_agreed():
                if self.job.config.checkpoint.enable and not saved:
                    self.checkpointer.save(step, is_writer=self.leader is not None)
                raise StopRequested(step, stop_requested() or "a peer's signal")
        self.profiler.close()
        self._log_profiling()
        if self.leader and self.expert_balance and steps > self.resumed_step:
            self._log_expert_load((self.resumed_step + 1, steps))
        return self.leader.last if self.leader else {}

    def _log_expert_load(self, steps: tuple[int, int]) -> None:
        """Rank 0: the run's expert load (metrics/expert_load.py) into the run and beside the job."""
        path = self.job_dir / EXPERT_LOAD_ARTIFACT
        plot_expert_load(self.expert_balance.load_by_layer(), steps, path)
        if self.leader.tracker:
            self.leader.tracker.log_artifact(path, "")

    def train_step(self, step: int) -> "StepOutcome":
        """Forward and backward over the step's microbatches, clip, update."""
        loss, data_seconds = self.forward_backward(step)
        reduce_partial_gradients(self.parameters)
        grad_norm = clip_grad_norm_(self.parameters, self.job.config.training.max_norm, self.mesh.pp_group)
        if not torch.isfinite(grad_norm):  # the global norm: every rank stops at the same step
            raise NonFiniteTraining(
                f"step {step}: the gradient norm is {grad_norm.item()} (this rank's loss {loss.item():.4g}); "
                "stopped before the optimizer update. Lower optimizer.lr, check the model's config, "
                "or resume from the last checkpoint"
            )
        lr = self.optimizers.lr
        self.optimizers.step()
        for part in self.model.parts:
            after_optimizer_step(part, self.job.config.quantize)
        expert_load = self.expert_balance.after_step() if self.expert_balance else {}
        return StepOutcome(loss, grad_norm, lr, data_seconds, expert_load)

    def _log(self, step: int, outcome: "StepOutcome") -> None:
        """Every log_freq steps (and the first and last): the global loss, which takes every rank."""
        steps = self.job.config.training.steps
        if step == 1 or step % self.job.config.metrics.log_freq == 0 or step == steps:
            loss_avg, loss_max = global_loss(outcome.loss, self.mesh)  # collectives: every rank takes part
            if self.leader:
                self.leader.log(step, outcome, loss_avg, loss_max)

    def _stop_agreed(self) -> bool:
        """Whether any rank has been asked to stop (launchers/signals.py), agreed by every rank at the
        same step boundary (one tiny all-reduce), so that they save and stop together."""
        flag = torch.tensor(1 if stop_requested() else 0, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _pipeline(self):
        """The schedule over this rank's stages, local_batch_size / microbatch_size microbatches a step."""
        from titan_exp.parallel.pipeline import Pipeline  # ~0.5 s of import: only pipelined jobs pay it

        cfg, model = self.job.config, self.model
        n_microbatches = cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size
        return Pipeline(
            model, cfg.parallelism, self.mesh.pp_group, self.device, n_microbatches, cross_entropy_loss, uncounted
        )

    def _batch_loader(self, split: str) -> BatchLoader:
        """The batches of `split` (train, or validation: held out from the same data)."""
        cfg = self.job.config
        if self.env.local_rank == 0 and cfg.data.source == "text":
            prepare_tokens(cfg.data)  # once per node; the others wait below and read the cache
        if dist.is_initialized():
            dist.barrier()
        t = cfg.training
        plan = BatchPlan(t.local_batch_size, t.seq_len, self.job.dims.dp, self.mesh.dp_rank, self.job.accumulation)
        validation = cfg.validation
        held_out = validation.held_out_fraction if validation.enable else 0.0
        source = build_source(cfg.data, t.seq_len, cfg.debug.seed, split, held_out, validation.paths)
        return BatchLoader(source, plan)

    def _log_profiling(self) -> None:
        """Every rank's profiling files into rank 0's run, once all ranks have written theirs."""
        profiler = self.profiler
        if not profiler.enabled:
            return
        if dist.is_initialized():
            dist.barrier()
        tracker = self.leader.tracker if self.leader else None
        for folder, artifact_dir in (
            (profiler.trace_dir, "profiling/traces"),
            (profiler.memory_dir, "profiling/memory"),
        ):
            if tracker and folder.is_dir():
                tracker.log_artifacts(folder, artifact_dir)


def select_device(device: str, local_rank: int) -> torch.device:
    """`device`: cuda or cpu (resolved); one GPU per local rank (the GPU of the local rank's index
    among those visible, or the only one visible)."""
    if device != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("launcher.device=cuda but torch sees no CUDA device; use launcher.device=cpu")
    visible = torch.cuda.device_count()
    # Slurm may bind each task to a GPU of its own (one CUDA_VISIBLE_DEVICES entry): then it is cuda:0.
    index = 0 if visible == 1 else local_rank
    if index >= visible:
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own: {visible} visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _peak_flops(job: ResolvedJob, device: torch.device) -> float:
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return cpu_peak_flops(getattr(torch, job.config.training.mixed_precision_param), job.config.data.cache_dir)


@contextlib.contextmanager
def _process_group(env: RankEnv, device: torch.device, timeout_s: int) -> Iterator[None]:
    """Joined (nccl on CUDA, gloo on CPU) while inside, for a world of more than one; its
    collectives (and the rendezvous) wait `timeout_s` for the other ranks."""
    if env.world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if env.rank != 0:
            wait_for_rendezvous(timeout.total_seconds())
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    try:
        yield
        if dist.is_initialized():
            # No rank tears its process group down while another is still in a last collective
            # (seen once: a torchrun rank aborting at exit, "terminate called without an active exception").
            dist.barrier()
    finally:
        if dist.is_initialized():
            # FSDP2's modules hold the groups in reference cycles: freed now, the groups are destroyed
            # below and not during interpreter shutdown, where a gloo group can abort the process
            # (the same message; pytorch/pytorch#179291).
            gc.collect()
            dist.destroy_process_group()


def _materialize(model: ModelParts, job: ResolvedJob, device: torch.device) -> None:
    """Real tensors on `device`, initialized from the seed (layout-independent) or loaded."""
    cfg = job.config
    for part in model.parts:
        part.to_empty(device=device)
        part.init_weights(cfg.debug.seed)
        if cfg.checkpoint.initial_load_in_hf:
            load_hf(part, cfg.checkpoint.initial_load_path, cfg.model)
        elif cfg.checkpoint.initial_load_path:
            load_model(part, cfg.checkpoint.initial_load_path)
        part.train()
