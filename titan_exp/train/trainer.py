"""One rank's training, in torchtitan's shape: `Trainer.run` joins the process group and builds
everything once (mesh, this rank's model parts, optimizers, checkpointer, data, the step's forward
and backward, the meter and the profiler), then `train` runs `train_step` for each step, logging,
checkpointing and watching for a stop request between steps. Rank 0 leads: it measures, prints and
tracks; every rank takes part in the collectives. A validation pass belongs beside `train_step`,
run from `train` every so many steps."""

import contextlib
import functools
import gc
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from launchers.env import RankEnv, wait_for_rendezvous
from launchers.processes import stop_if_launcher_gone
from launchers.signals import StopRequested, stop_requested
from titan_exp.checkpoint.hf_export import ExportSources
from titan_exp.checkpoint.layout import step_dir
from titan_exp.checkpoint.manager import TrainCheckpointer, save_model
from titan_exp.checkpoint.model_record import TrainedAs, TrainingRecord
from titan_exp.config.job import ResolvedJob
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.data.text import prepare_tokens, tokenizer_file
from titan_exp.metrics import startup
from titan_exp.metrics.peak_flops import cpu_peak_flops, gpu_peak_flops, raise_cpu_peak
from titan_exp.models.common.moe.balance import ExpertBalance
from titan_exp.optim.optimizer import Optimizers
from titan_exp.parallel.mesh import ParallelMesh, set_collective_timeout
from titan_exp.profiling.profiler import RankProfiler
from titan_exp.tracking.writer import BackgroundTracker
from titan_exp.train.leader import Follower, Leader, RunFacts
from titan_exp.train.model_parts import ModelParts, build_model_parts, materialize
from titan_exp.train.step import ForwardBackward, StepOutcome, TrainStep, build_pipeline, global_loss
from titan_exp.train.validation import Validator


class Trainer:
    def __init__(
        self,
        job: ResolvedJob,
        env: RankEnv,
        device: torch.device,
        model: ModelParts,
        mesh: ParallelMesh,
        job_dir: Path,
        leader: Leader | Follower,
    ):
        """Everything a step needs, built once; `job_dir`: where profiling and the run's plots
        write; `leader`: rank 0's measuring, printing and tracking (a Follower elsewhere)."""
        cfg = job.config
        self.job, self.env, self.device, self.model, self.mesh, self.leader = job, env, device, model, mesh, leader
        self.job_dir = job_dir
        optimizers = Optimizers.build(model.parts, cfg.optimizer, cfg.lr_scheduler, cfg.training.steps)
        train_batches = self._batch_loader("train")
        trained_as = TrainedAs(job.tokens_per_step, cfg.training.steps, cfg.optimizer.lr, cfg.lr_scheduler)
        self.checkpointer = TrainCheckpointer(
            cfg.checkpoint, model.parts, optimizers, cfg.model, TrainingRecord(trained_as, _export_sources(job)),
            train_batches if train_batches.streamed else None,
        )  # fmt: skip
        self.resumed_step = self.checkpointer.resume()
        if self.resumed_step:
            leader.say(f"resumed from {step_dir(cfg.checkpoint.folder, self.resumed_step)}")
        pipeline = build_pipeline(job, model, mesh, device) if job.dims.pp > 1 else None
        forward_backward = ForwardBackward(job, model.parts, pipeline, mesh, train_batches, device)
        validation = cfg.validation
        self.validator = (
            Validator(validation, cfg.training.steps, forward_backward, self._batch_loader("validation"), mesh)
            if validation.enable
            else None
        )
        self.expert_balance = ExpertBalance(model.parts, cfg.model, device) if cfg.model.moe.enabled else None
        self.train_step = TrainStep(job, model, mesh, forward_backward, optimizers, self.expert_balance)
        self.profiler = RankProfiler(
            cfg.profiling, job_dir, env.rank, device, model.parts,
            optimizers.optimizers, self.resumed_step + 1,
        )  # fmt: skip
        # An engine may warn a job ahead of its time limit (or a preemption) with a signal: _stop_agreed.
        self.watch_stop = job.launcher.warns_before_stopping

    @classmethod
    def run(
        cls, job: ResolvedJob, env: RankEnv, tracker: BackgroundTracker | None = None, job_dir: Path | None = None
    ) -> dict[str, object]:
        """The rank's whole life: returns rank 0's last logged metrics (empty elsewhere).
        `tracker`: rank 0's MLflow writer, started by the caller (rank/entry.py); `job_dir`: the
        job's folder, where rank 0 reports its steps (job/events.py) and profiling writes (None: no
        events, profiling into the working directory)."""
        device = select_device(job.placement.device, env.local_rank)
        set_determinism(job.config.debug.seed, job.config.debug.deterministic)
        leader = Follower()
        if env.rank == 0:
            # On CPU, measured while nothing else runs: the other ranks wait in the rendezvous and
            # rank 0's MLflow writer is paused.
            with tracker.paused() if tracker else contextlib.nullcontext():
                leader = Leader(tracker, _peak_flops(job, device), job_dir, _raise_peak(job, device))
        startup.mark("peak_flops")
        with _process_group(env, device, job.config.comm.init_timeout_seconds):
            startup.mark("process_group")
            return cls._build_and_train(job, env, device, job_dir or Path("."), leader)

    @classmethod
    def _build_and_train(
        cls, job: ResolvedJob, env: RankEnv, device: torch.device, job_dir: Path, leader: Leader | Follower
    ) -> dict[str, object]:
        """Inside the process group: build the model, then train (or write a seed checkpoint). Its own
        function so that the model and mesh, which hold the process groups, are gone when it returns."""
        mesh = ParallelMesh(job.dims, device.type)
        model = build_model_parts(job.config, mesh, device)
        materialize(model, job.config, device)
        startup.mark("model")
        if job.config.checkpoint.create_seed_checkpoint:
            path = save_model(
                model.parts[0], job.config.checkpoint.folder, job.config.model
            )  # one rank, one part (config/check.py)
            leader.say(f"seed checkpoint written to {path}; load it with checkpoint.initial_load_path={path}")
            return {}
        return cls(job, env, device, model, mesh, job_dir, leader).train()

    def train(self) -> dict[str, object]:
        """Train from the step after the resumed one to training.steps."""
        steps, leader = self.job.config.training.steps, self.leader
        mesh, model = self.mesh, self.model
        leader.start(
            RunFacts(
                self.job, model.num_params, model.num_embedding_params, self.device,
                mesh.hosts, mesh.host_grid(), mesh.dims_across_hosts(),
            )
        )  # fmt: skip
        startup.mark("optimizer_data")
        for step in range(self.resumed_step + 1, steps + 1):
            stop_if_launcher_gone()
            with self.profiler.step(step):
                outcome = self.train_step(step)
            leader.count(step, outcome, self.profiler.take_audit_metrics())
            self._log(step, outcome)
            if self.validator and self.validator.due(step):
                start = time.perf_counter()
                loss = self.validator.loss()  # collectives: every rank takes part
                leader.log_validation(step, loss, time.perf_counter() - start)
            if step == self.resumed_step + 1:
                set_collective_timeout(self.job.config.comm.train_timeout_seconds)
                leader.report_startup(step)
            saved = self.checkpointer.maybe_save(step, steps, is_writer=leader.is_writer)
            if self.watch_stop and step < steps and self._stop_agreed():
                if self.job.config.checkpoint.enable and not saved:
                    self.checkpointer.save(step, is_writer=leader.is_writer)
                raise StopRequested(step, stop_requested() or "a peer's signal")
        self.profiler.close()
        self._log_profiling()
        if self.expert_balance and steps > self.resumed_step:
            leader.log_expert_load(self.expert_balance.load_by_layer(), (self.resumed_step + 1, steps), self.job_dir)
        return leader.last

    def _log(self, step: int, outcome: StepOutcome) -> None:
        """Every log_freq steps (and the first and last): the global loss, which takes every rank."""
        steps = self.job.config.training.steps
        if step == 1 or step % self.job.config.metrics.log_freq == 0 or step == steps:
            loss_avg, loss_max = global_loss(outcome.loss, self.mesh)  # collectives: every rank takes part
            self.leader.log(step, outcome, loss_avg, loss_max)

    def _stop_agreed(self) -> bool:
        """Whether any rank has been asked to stop (launchers/signals.py), agreed by every rank at the
        same step boundary (one tiny all-reduce), so that they save and stop together."""
        flag = torch.tensor(1 if stop_requested() else 0, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

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
        self.leader.log_artifacts(profiler.trace_dir, "profiling/traces")
        self.leader.log_artifacts(profiler.memory_dir, "profiling/memory")


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


def _raise_peak(job: ResolvedJob, device: torch.device) -> Callable[[float], float] | None:
    """A CPU's measured peak is measured again when the run beats it; a GPU's is its profile's."""
    if device.type == "cuda":
        return None
    dtype = getattr(torch, job.config.training.mixed_precision_param)
    return functools.partial(raise_cpu_peak, dtype, job.config.data.cache_dir)


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


def _export_sources(job: ResolvedJob) -> ExportSources:
    """What an export of the job's model takes beside its weights: the Hugging Face folder it came
    from (model=hf's, else the one its weights were loaded from) and the tokenizer it trains on."""
    c = job.config.checkpoint
    if not c.enable:  # nothing is saved: no need to find the tokenizer
        return ExportSources(None, None)
    folder = job.config.model.hf_path or (c.initial_load_path if c.initial_load_in_hf else None)
    return ExportSources(folder, tokenizer_file(job.config.data))
