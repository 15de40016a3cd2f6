"""The data-parallel training loop: DDP gradient averaging, resume, metrics and checkpoints."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from api_schemas import JobSpec
from workers.engine import distributed
from workers.engine.batch_loader import Batches
from workers.engine.batchnorm import average_buffers, convert_sync_batchnorm
from workers.engine.checkpoint import CheckpointManager
from workers.engine.clipping import clip_grad_norm_
from workers.engine.compile import compile_model
from workers.engine.conventions import check_loss, loss_and_outputs, make_optimizer, split_batch
from workers.engine.evaluation import evaluator_for
from workers.engine.events import EventWriter, FinishedEvent, MetricsEvent, StartedEvent
from workers.engine.faults import Fault
from workers.engine.init_state import start_from_init
from workers.engine.input_pipeline import InputPipeline
from workers.engine.local_sgd import LocalSGD
from workers.engine.memory import checkpoint_activations
from workers.engine.metrics_window import MetricsWindow
from workers.engine.nonfinite import NonFiniteGuard
from workers.engine.recipes import Plan
from workers.engine.sharded_params import gather_state, optimizer_param_names, slice_state
from workers.engine.sparse import (
    SparseGradSync,
    ddp_ignore_names,
    default_sgd,
    refuse_clipping_of_local_params,
)

CHECKPOINT_FORMAT = 1


class Trainer:
    """Runs ITER from its start (0 or a checkpoint) to `steps` on every rank in lockstep."""

    def __init__(
        self,
        spec: JobSpec,
        plan: Plan,
        env: distributed.DistEnv,
        device: torch.device,
        events: EventWriter,
        checkpoints: CheckpointManager,
        *,
        local_batch_size: int,
        fault: Fault | None = None,
        backend: str | None = None,
        init_checkpoint: Path | None = None,
    ) -> None:
        self.spec, self.env, self.device = spec, env, device
        self.init_checkpoint = init_checkpoint  # init_from's file, while the job has none of its own
        self.events, self.checkpoints, self.fault, self.backend = events, checkpoints, fault, backend
        self.local_batch_size = local_batch_size  # engine.config's, at this world size
        self.plan = plan
        self.model: nn.Module = plan.model.to(device)  # the bare module: what we save and load
        # How every rank reads its batches (a sampler over a map-style dataset, or a stream).
        self.data = InputPipeline(
            spec=spec, plan=plan, env=env, device=device, local_batch_size=local_batch_size
        )
        self.sharded = list(plan.sharded)
        params = dict(self.model.named_parameters())
        missing = [n for n in self.sharded if n not in params]
        if missing:
            raise ValueError(f"plan.sharded names no parameter of the model: {', '.join(missing)}")
        self.sharded_params = [params[n] for n in self.sharded]
        # A rank's rows are its own: sharded parameters are never broadcast or allreduced.
        self.non_data_parallel = list(dict.fromkeys([*plan.non_data_parallel, *self.sharded]))
        self.checkpoint_modules = plan.checkpoint_modules
        t = spec.hyperparameters
        # Weight decay lives in the optimizer, applied to the already rank-averaged gradient, so it is
        # the same at any world size (the Caffe2 "scale the loss, not the LR" lesson).
        self.optimizer = (
            make_optimizer(plan.optimizer, self.model)
            if plan.optimizer is not None
            # Plain SGD for sparse-gradient tables (torch's refuses their weight decay): see sparse.py.
            else default_sgd(self.model, t.lr, t.momentum, t.weight_decay)
        )
        self.scheduler = plan.lr_scheduler(self.optimizer) if plan.lr_scheduler is not None else None
        self.optim_names = optimizer_param_names(self.model, self.optimizer)
        self.guard = NonFiniteGuard(optimizer=self.optimizer, env=env, device=device)
        self.iter = 0  # optimizer steps completed (Caffe2's ITER)
        self.train_model: nn.Module = self.model  # DDP wrapper once wrap() ran at world > 1
        e = spec.engine
        self.accum = e.grad_accumulation_steps
        self.clip_norm = e.grad_clip_norm
        # Autocast only: params, grads and optimizer state stay fp32. No GradScaler: bf16 has fp32's
        # exponent range, so gradients do not underflow the way fp16's do.
        self.autocast_dtype = torch.bfloat16 if e.precision == "bf16" else None
        self.grad_norm: torch.Tensor | None = None  # pre-clip total norm of the last step, if clipping
        self.averaged_buffers: list[torch.Tensor] = []  # filled by wrap() in engine.buffers "average" mode
        self.local_sgd: LocalSGD | None = None  # built by wrap() for engine.mode "local_sgd" at world > 1
        self.sparse_sync: SparseGradSync | None = None  # set by wrap() at world > 1 for sparse-grad params
        self.evaluator = evaluator_for(spec=spec, plan=plan, env=env, device=device, autocast=self._autocast)

    # ---- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Full, unsharded, weights_only-safe training state (loadable at any world size).

        With sharded parameters this is a collective: every rank must call it, and only rank 0's
        result holds the whole tensors.
        """
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        model, optimizer = gather_state(
            self.model.state_dict(),  # bare module: no "module." prefixes
            self.optimizer.state_dict(),
            sharded=self.sharded,
            optim_names=self.optim_names,
            world_size=self.env.world_size,
        )
        return {
            "format": CHECKPOINT_FORMAT,
            "model": model,
            "optimizer": optimizer,
            **({"lr_scheduler": self.scheduler.state_dict()} if self.scheduler is not None else {}),
            "iter": self.iter,
            **self.checkpoints.best_state(),
            **self.data.state_dict(),
            "world_size": self.env.world_size,
            "rng": rng,
            # Provenance: what was trained, as plain (weights_only-safe) JSON values.
            "config": self.spec.model_dump(mode="json", include={"recipe", "entrypoint", "hyperparameters"}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore model, optimizer, ITER and RNG state from `state_dict()` output (any world size)."""
        model, optimizer = slice_state(
            state["model"],
            state["optimizer"],
            sharded=self.sharded,
            optim_names=self.optim_names,
            world_size=self.env.world_size,
            rank=self.env.rank,
        )
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        if self.scheduler is not None and "lr_scheduler" in state:
            self.scheduler.load_state_dict(state["lr_scheduler"])
        self.iter = int(state["iter"])
        self.checkpoints.restore_best(state)
        self.data.load_state_dict(state)
        rng = state.get("rng", {})
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    def resume(self) -> int | None:
        """Load the newest good checkpoint on every rank; returns its step or None for a fresh start."""
        # Rank 0 alone picks the step (with fallback past corrupt files) so ranks can never disagree on
        # which file they restored; the others then read exactly that one.
        loaded = self.checkpoints.load() if self.env.is_main else None
        step = distributed.broadcast_int(self.env, loaded.step if loaded else -1, self.device)
        if step < 0:
            return None if self.init_checkpoint is None else start_from_init(self, self.init_checkpoint)
        if loaded is None:
            loaded = self.checkpoints.load(step=step)
        assert loaded is not None
        self.load_state_dict(loaded.state)
        saved_world = loaded.state.get("world_size")
        print(f"resumed from {loaded.path} (iter {self.iter}, saved at world size {saved_world})")
        return step

    def wrap(self) -> None:
        """Wrap for data parallelism; DDP construction broadcasts rank 0's parameters and buffers."""
        if self.env.world_size == 1:
            # At world 1 DDP has nothing to average or broadcast, yet its hooks and buckets cost time
            # on every step of a small model.
            self._checkpoint_activations()
            self._compile()
            return
        e = self.spec.engine
        # Sharded rows are clipped by the global norm (clipping.py); other rank-own params cannot be.
        own = [n for n in self.non_data_parallel if n not in self.sharded]
        refuse_clipping_of_local_params(self.model, own, self.clip_norm)
        # Sparse-gradient tables go around DDP (NCCL cannot allreduce sparse tensors): sparse.py syncs them.
        sparse = SparseGradSync.for_model(self.model, e.sparse, self.env.world_size, self.non_data_parallel)
        self.sparse_sync = sparse if sparse.params else None
        if self.non_data_parallel or sparse.params:
            # DDP's own mechanism: these names are neither broadcast from rank 0 nor allreduced, so
            # each rank keeps its own (Caffe2's non-data-parallel params). One call: it overwrites.
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self.model, ddp_ignore_names([*self.non_data_parallel, *sparse.names])
            )
        if e.sync_batchnorm:
            # After resume (a plain BatchNorm state_dict loads either way) and before DDP sees the modules.
            self.model = convert_sync_batchnorm(self.model, self.device)
        # After the SyncBN swap (it replaces modules) and before DDP sees the model.
        self._checkpoint_activations()
        if e.buffers == "average":
            # Floating-point buffers only (BatchNorm running_mean/var): integer ones such as
            # num_batches_tracked advance identically on every rank, and a mean of ints would truncate.
            skip = set(self.non_data_parallel)
            self.averaged_buffers = [
                b for n, b in self.model.named_buffers() if b.is_floating_point() and n not in skip
            ]
        self.train_model = DistributedDataParallel(
            self.model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=e.bucket_cap_mb,
            # Grads alias the allreduce buckets: one copy fewer per step and less memory.
            gradient_as_bucket_view=True,
            # "broadcast" is Caffe2's broadcast_computed_params: rank 0's buffers overwrite the others'
            # before every forward. "average" keeps each rank's own and averages them after the step.
            # Either way DDP broadcasts rank 0's buffers once at construction.
            forward_sync_buffers=e.buffers == "broadcast",
        )
        if self.sparse_sync is not None:
            self.sparse_sync.broadcast_from_rank0()  # ignored by DDP, so not broadcast by it
        if e.mode == "local_sgd":
            self.local_sgd = LocalSGD(
                self.model,
                period=e.local_sgd_period,
                warmup_steps=e.local_sgd_warmup_steps,
                skip=self.non_data_parallel,
            )
        self._compile()

    def _compile(self) -> None:
        """engine.compile: the model's forward, in place, so DDP calls it compiled and it saves unprefixed."""
        if self.spec.engine.compile:
            # Last: after SyncBN and checkpointing replaced modules or forwards, and inside DDP, whose
            # bucket size DDPOptimizer reads at the first forward (compile.py).
            compile_model(self.model, self.spec.engine.compile_backend)

    def _checkpoint_activations(self) -> None:
        """engine.activation_checkpointing: recompute the chosen parts' activations in backward."""
        if self.spec.engine.activation_checkpointing:
            parts = checkpoint_activations(self.model, self.checkpoint_modules)
            print(f"activation checkpointing: {', '.join(parts) or 'nothing to checkpoint'}")

    # ---- loop ----------------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _loss(self, batch: Any) -> torch.Tensor:
        with self._autocast():  # forward + loss only; backward runs in the forward's dtypes
            return check_loss(loss_and_outputs(self.plan, self.train_model, batch)[0])

    def _step(self, it: int, batch: Any = None) -> torch.Tensor:
        if batch is None:  # driven step by step (tests, benchmarks): gather in place
            sampler = self.data.sampler
            assert sampler is not None, "a stream's batches come from its loader"
            idx = sampler.local_indices(it, self.env.rank, self.local_batch_size)
            batch = self.data.dataset.batch(idx, self.device)
        # Per-rank MEAN loss; DDP divides the summed gradients by world size (data_parallel_model's
        # loss_scale = 1/devices), so the update equals the one for the global-batch mean loss at
        # any world size.
        # With accumulation each equal micro-batch's mean loss is scaled by 1/accum, so the summed
        # gradient is again the local-batch mean gradient: same math, less activation memory.
        n = self.accum
        ddp = self.train_model if isinstance(self.train_model, DistributedDataParallel) else None
        local = self.local_sgd is not None and self.local_sgd.is_local(it)
        if n == 1:
            # The default: one micro-step, so no chunking and no running sum, whose few tensor ops a
            # step would otherwise pay for nothing. Same math.
            with ddp.no_sync() if ddp is not None and local else contextlib.nullcontext():
                loss = self._loss(batch)
                loss.backward()
            local_loss = loss.detach().float()
        else:
            loss_sum = torch.zeros((), device=self.device)
            for i, micro in enumerate(split_batch(batch, n)):
                # Only the last micro-step allreduces; earlier ones just accumulate into the local grads.
                # A LocalSGD local step allreduces no gradient at all.
                sync = ddp.no_sync() if ddp is not None and (i < n - 1 or local) else contextlib.nullcontext()
                with sync:
                    loss = self._loss(micro)
                    # DDP allreduces buckets in reverse order, overlapped with the last backward.
                    (loss / n).backward()
                loss_sum += loss.detach().float()
            # Equal micro-batches: the mean of their means is the local-batch mean loss.
            local_loss = loss_sum / n
        if self.sparse_sync is not None and not local:
            self.sparse_sync.sync()  # after the last micro-step, like DDP's own allreduce
        if self.clip_norm is not None:
            # On the synchronised, rank-averaged gradient, so every rank clips identically (in a LocalSGD
            # local step: on the rank's own gradient). Sparse gradients and sharded rows are handled too.
            shard_ids = {id(p) for p in self.sharded_params}
            replicated = [p for p in self.model.parameters() if id(p) not in shard_ids]
            self.grad_norm = clip_grad_norm_(replicated, self.clip_norm, sharded=self.sharded_params)
        # No update from a non-finite loss or gradient, decided without a host sync where the optimizer
        # allows it; the job fails at the next check, naming the step and the rank (nonfinite.py).
        self.guard.step(it, local_loss)
        if self.local_sgd is not None:
            self.local_sgd.after_step(it)  # before zero_grad: torch's averager skips grad-less params
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        average_buffers(self.averaged_buffers, self.env.world_size)
        return local_loss

    def train(self) -> None:
        """Resume, sync ranks (FinalizeAfterCheckpoint), then step to `steps`, logging and checkpointing."""
        self.resume()
        self.wrap()
        # Like Caffe2's FinalizeAfterCheckpoint: params came from rank 0 via DDP; ITER comes from rank 0 too.
        self.iter = distributed.broadcast_int(self.env, self.iter, self.device)
        total = self.spec.hyperparameters.steps
        main = self.env.is_main
        if main:
            self.events.emit(
                StartedEvent(
                    world_size=self.env.world_size,
                    start_iter=self.iter,
                    total_steps=total,
                    device=self.device.type,
                    backend=self.backend or "none",
                )
            )
        # Logged steps are reported per window (one loss allreduce, one write): see metrics_window.py.
        metrics = MetricsWindow(
            env=self.env,
            device=self.device,
            events=self.events,
            global_batch_size=self.spec.hyperparameters.global_batch_size,
            log_every=self.spec.engine.log_every_steps,
            total_steps=total,
            start_step=self.iter,
        )
        batches = self.data.batches(first=self.iter, stop=total)
        try:
            self._loop(batches, metrics)
        finally:
            batches.close()  # the loader's processes end with the loop, also when a step raised
            if self.evaluator is not None:
                self.evaluator.close()
        # No rank reports success before every rank has finished its last step.
        distributed.barrier(self.env)
        if main:
            self.events.emit(FinishedEvent(step=self.iter))

    def _loop(self, batches: Batches, metrics: MetricsWindow) -> None:
        total = self.spec.hyperparameters.steps
        main = self.env.is_main
        while self.iter < total:
            if self.fault is not None:
                self.fault.maybe_fire(self.env.rank, self.iter)
            batch = batches.take()
            loss = self._step(self.iter, batch)
            # The step's work is queued (on a GPU it runs on): fetch and copy the next batch meanwhile.
            batches.prefetch()
            self.iter += 1
            last = self.iter == total
            # Functions of the step: the same on every rank, so the collectives below line up.
            save = self.checkpoints.should_save(self.iter, last)
            evaluate = self.evaluator is not None and (self.iter % self._eval_every == 0 or last)
            if metrics.logs(self.iter):
                lr = float(self.optimizer.param_groups[0]["lr"])
                metrics.record(
                    self.iter, loss=loss, lr=lr, grad_norm=self.grad_norm, data_wait=batches.take_waited()
                )
            # Flushed at the last step and before a save or an evaluation, so every metrics event
            # precedes the checkpoint or finished event after it; the decision depends on steps only, so
            # every rank issues the flush's allreduce at the same point.
            flush = metrics.due(self.iter, force=last or save or evaluate)
            if flush:
                metrics.flush(self.iter)
            if flush or save or evaluate:
                self.guard.check()  # before any save: no checkpoint follows a skipped, non-finite step
            best = self._evaluate() if evaluate else False
            # Sharded parameters are gathered to rank 0 for the save: every rank takes part then.
            if (main or self.sharded) and (save or best):
                self._save(last, best)
            if save or evaluate:
                metrics.restart_clock(self.iter)  # keep save and eval time out of step timing

    @property
    def _eval_every(self) -> int:
        return self.spec.evaluation.every_steps if self.spec.evaluation is not None else 0

    def _evaluate(self) -> bool:
        """Evaluate (a collective), report `eval/*` at this step; whether it is the best so far."""
        assert self.evaluator is not None
        figures = self.evaluator.run(self.model)
        if self.env.is_main:
            self.events.emit(MetricsEvent(step=self.iter, values=figures))
        keep = self.spec.checkpoint.keep_best
        # The figures are the allreduced ones, the same floats on every rank: the same decision everywhere.
        return keep is not None and self.checkpoints.consider_best(self.iter, figures, keep.metric)

    def _save(self, last: bool, best: bool = False) -> None:
        # The event goes out before the older checkpoints are pruned (CheckpointManager.save).
        self.checkpoints.save(self.iter, self.state_dict(), last=last, best=best, announce=self.events.emit)
