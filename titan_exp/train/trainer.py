"""What one rank process does: build the mesh, build Llama 3 on meta, parallelize, materialize,
initialize, and train, logging on rank 0."""

import contextlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from launchers import env as rank_env
from titan_exp.checkpoint.manager import TrainCheckpointer, load_model, save_model, step_dir
from titan_exp.config.schema import JobConfig
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.metrics.device import cpu_peak_flops, gpu_peak_flops
from titan_exp.metrics.flops import flops_per_token
from titan_exp.metrics.logger import ThroughputMeter, format_line, format_summary
from titan_exp.models.llama3.model import Transformer
from titan_exp.models.llama3.parallelize import parallelize_llama
from titan_exp.parallel.context import ContextParallel
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.pipeline import Pipeline, split_model
from titan_exp.parallel.stages import StagePlan
from titan_exp.quantize.float8 import after_optimizer_step, convert_linears
from titan_exp.tracking.mlflow_run import BackgroundTracker
from titan_exp.train.grad import clip_grad_norm_
from titan_exp.train.optim import build_lr_scheduler, build_optimizer


def select_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("launcher.device=cuda but torch sees no CUDA device; use launcher.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def log0(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def train(cfg: JobConfig, tracker: BackgroundTracker | None = None) -> dict[str, float]:
    """Run the job as this process's rank; returns rank 0's last logged metrics (empty elsewhere).
    `tracker`: rank 0's MLflow writer, started by the caller (see tracking.rank0)."""
    env = rank_env.current()
    device = select_device(cfg.launcher.device, env.local_rank)
    set_determinism(cfg.debug.seed, cfg.debug.deterministic)
    peak_flops = 0.0
    if env.rank == 0:
        # On CPU, measured while nothing else runs: the other ranks wait in the rendezvous and
        # rank 0's MLflow writer is paused.
        with tracker.paused() if tracker else contextlib.nullcontext():
            peak_flops = _peak_flops(cfg, device)
    return _train_distributed(cfg, env, device, peak_flops, tracker)


def _train_distributed(cfg: JobConfig, env: rank_env.RankEnv, device: torch.device, peak_flops: float, tracker: BackgroundTracker | None) -> dict[str, float]:
    """Join the process group, train, and leave it."""
    try:
        if env.world_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(minutes=10), device_id=device if device.type == "cuda" else None)
        result = _train(cfg, env, device, peak_flops, tracker)
        if dist.is_initialized():
            # No rank tears its process group down while another is still in a last collective
            # (seen once: a torchrun rank aborting at exit, "terminate called without an active exception").
            dist.barrier()
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _peak_flops(cfg: JobConfig, device: torch.device) -> float:
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return cpu_peak_flops(getattr(torch, cfg.training.mixed_precision_param), cfg.data.cache_dir)


def _build_model(cfg: JobConfig, dims: ParallelDims, mesh, device: torch.device) -> tuple[list[Transformer], dict[str, object], Pipeline | None]:
    """Llama 3 on meta → (cut into this rank's pipeline stages) → parallelized → materialized on
    `device` → initialized (or loaded). Returns the model parts this rank holds."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    num_params = model.num_params()
    facts = {
        "derived/num_params": num_params,
        "derived/flops_per_token": flops_per_token(cfg.model, num_params, model.tok_embeddings.weight.numel(), cfg.training.seq_len),
    }
    convert_linears(model, cfg.quantize, device)
    parts, pipeline_args = [model], None
    if dims.pp > 1:
        plan = StagePlan.from_config(cfg.parallelism, cfg.model.n_layers)
        stage_ids = plan.stage_ids(mesh["pp"].get_local_rank(), dims.pp, cfg.parallelism.pipeline_parallel_schedule)
        parts = split_model(model, plan, stage_ids)
        pipeline_args = (stage_ids, plan)
    for part in parts:
        parallelize_llama(part, dims, mesh, cfg.parallelism, cfg.training, cfg.activation_checkpoint, cfg.compile, cfg.quantize)
        part.to_empty(device=device)
        part.init_weights(cfg.debug.seed)
        if cfg.checkpoint.initial_load_path:
            load_model(part, cfg.checkpoint.initial_load_path)
        part.train()
    pipeline = None
    if pipeline_args:
        n_microbatches = cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size
        pipeline = Pipeline(parts, *pipeline_args, cfg.parallelism, mesh["pp"].get_group(), device, n_microbatches)
    return parts, facts, pipeline


def _train(cfg: JobConfig, env: rank_env.RankEnv, device: torch.device, peak_flops: float, tracker: BackgroundTracker | None) -> dict[str, float]:
    dims = ParallelDims.from_config(cfg.parallelism)
    mesh = dims.build_mesh(device.type)
    parts, facts, pipeline = _build_model(cfg, dims, mesh, device)
    params = [p for part in parts for p in part.parameters()]
    pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
    if cfg.checkpoint.create_seed_checkpoint:
        path = step_dir(cfg.checkpoint.folder, 0)
        save_model(parts[0], path)  # one rank, one part (config.check)
        log0(env.rank, f"seed checkpoint written to {path}; load it with checkpoint.initial_load_path={path}")
        return {}

    # One optimizer (and schedule) per model part, so checkpoints address state by parameter name.
    optimizers = [build_optimizer(part.parameters(), cfg.optimizer) for part in parts]
    schedulers = [build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_scheduler) for optimizer in optimizers]
    checkpointer = TrainCheckpointer(cfg.checkpoint, parts, optimizers, schedulers)
    resumed_step = checkpointer.resume()
    if resumed_step:
        log0(env.rank, f"resumed from {step_dir(cfg.checkpoint.folder, resumed_step)}")
    accumulation = cfg.training.global_batch_size // (cfg.training.local_batch_size * dims.dp)
    plan = BatchPlan(cfg.training.local_batch_size, cfg.training.seq_len, dims.dp, dims.dp_rank(mesh), accumulation)
    if env.local_rank == 0 and cfg.data.source == "text":
        from titan_exp.data.text import prepare_tokens

        prepare_tokens(cfg.data)  # once per node; the others wait below and read the cache
    if dist.is_initialized():
        dist.barrier()
    loader = BatchLoader(build_source(cfg.data, cfg.training.seq_len, cfg.debug.seed), plan)

    facts.update({
        "derived/mesh": dims.describe(),
        "derived/world_size": env.world_size,
        "derived/peak_flops_per_device": peak_flops,
        "derived/global_batch_tokens": cfg.training.global_batch_size * cfg.training.seq_len,
        "derived/gradient_accumulation_steps": accumulation,
        "derived/device": device.type,
    })
    log0(env.rank, format_summary(facts))
    if tracker:
        tracker.log_params(facts)

    cp_mesh = mesh["cp"] if dims.cp > 1 else None
    step_fn = _StepFunction(cfg, dims, parts[0], pipeline, cp_mesh, loader, accumulation, device)
    # MFU is not defined against a bf16 peak once matmuls run in lower precision (torchtitan omits it too).
    mfu_peak = None if cfg.quantize.low_precision else peak_flops
    meter = ThroughputMeter(facts["derived/flops_per_token"], mfu_peak, dims.non_data_parallel_size, device) if env.rank == 0 else None
    loss_group = dims.loss_group(mesh)
    last: dict[str, float] = {}
    for step in range(resumed_step + 1, cfg.training.steps + 1):
        step_loss, data_seconds = step_fn(step)
        grad_norm = clip_grad_norm_(params, cfg.training.max_norm, pp_group)
        lr = schedulers[0].get_last_lr()[0]
        for optimizer, scheduler in zip(optimizers, schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        for part in parts:
            after_optimizer_step(part, cfg.quantize)
        if meter:
            meter.add_step(cfg.training.local_batch_size * cfg.training.seq_len * accumulation, data_seconds)

        if step == 1 or step % cfg.metrics.log_freq == 0 or step == cfg.training.steps:
            loss_avg, loss_max = _global_loss(step_loss, pp_group, loss_group)  # collectives: every rank takes part
            if meter:
                last = {"loss/global_avg": loss_avg, "loss/global_max": loss_max, "grad_norm": grad_norm.item(), "lr": lr, **meter.collect()}
                if tracker:  # queued before printed: a step on the console is a step in the run
                    tracker.log_metrics(step, last)
                print(format_line(step, last), flush=True)
        checkpointer.maybe_save(step, cfg.training.steps, is_writer=env.rank == 0)
    return last


class _StepFunction:
    """Forward and backward over the microbatches of one step; returns (this rank's loss, data seconds).
    Under pipelining the schedule runs the microbatches and only the last stage's rank sees the loss."""

    def __init__(self, cfg: JobConfig, dims: ParallelDims, model: Transformer, pipeline: Pipeline | None, cp_mesh, loader: BatchLoader, accumulation: int, device: torch.device):
        self.model, self.pipeline, self.loader, self.accumulation, self.device = model, pipeline, loader, accumulation, device
        self.sync_gradients_last_only = dims.fsdp_enabled or dims.ddp_enabled
        self.sequence_context = ContextParallel(model, cp_mesh, cfg.training.seq_len) if cp_mesh is not None else None
        # Without FSDP/DDP (single device, TP only), the param dtype becomes an autocast dtype.
        param_dtype = getattr(torch, cfg.training.mixed_precision_param)
        self.autocast = (
            (lambda: torch.autocast(device.type, dtype=param_dtype))
            if dims.dp == 1 and param_dtype != torch.float32
            else contextlib.nullcontext
        )
        # Under TP the logits stay sharded over the vocabulary; the loss and its backward run on the shards.
        self.loss_context = loss_parallel if dims.tp > 1 else contextlib.nullcontext

    def __call__(self, step: int) -> tuple[torch.Tensor, float]:
        data_seconds = 0.0
        step_loss = torch.zeros((), device=self.device)
        for micro in range(self.accumulation):
            start = time.perf_counter()
            inputs, labels = (t.to(self.device, non_blocking=True) for t in self.loader.get(step - 1, micro))
            data_seconds += time.perf_counter() - start
            if self.pipeline:
                with self.loss_context():
                    step_loss += self.pipeline.step(inputs, labels)
                continue
            if self.sync_gradients_last_only:
                # Reduce gradients only once per step, after the last microbatch.
                self.model.set_requires_gradient_sync(micro == self.accumulation - 1)
            sequence = self.sequence_context(inputs, labels) if self.sequence_context else contextlib.nullcontext()
            with sequence:
                with self.autocast():
                    logits = self.model(inputs)
                with self.loss_context():
                    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) / self.accumulation
                    loss.backward()
            step_loss += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        return step_loss, data_seconds


def _global_loss(loss: torch.Tensor, pp_group, loss_group) -> tuple[float, float]:
    """(average, max) of the step's loss over the data-parallel (and context-parallel) ranks, known
    to every rank."""
    if pp_group is not None:
        loss = loss.clone()
        dist.all_reduce(loss, group=pp_group)  # only the last stage's rank holds a non-zero loss
    if loss_group is None:
        return loss.item(), loss.item()
    total, peak = loss.clone(), loss.clone()
    dist.all_reduce(total, group=loss_group)  # gloo has no AVG
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=loss_group)
    return total.item() / dist.get_world_size(loss_group), peak.item()
