"""What every CP trainer adds to a ``transformers.Trainer``: mesh, loader, loss, gradient scale, resume, logs.

:class:`CPTrainerMixin` goes before the Trainer class in the bases (``class CPTrainer(CPTrainerMixin,
Trainer)``); docs/trainers.md lists what the trainers do and refuse.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from cpdata.adapters.loss import global_target_count
from cpdata.errors import check_int, is_int, refuse_settings
from cpdata.integrations.attention import CPModelInputs, check_attention
from cpdata.integrations.metrics import PackMetrics
from cpdata.nodes.dataloader import CPDataLoader
from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.options import DataPolicy, Delivery, PlanChoice, StreamPlan, check_records
from cpdata.worker.keys import LABELS, N_TARGETS

__all__ = ["LOADER_STATE", "CPTrainerMixin", "check_training_args", "cp_loss_scale"]

LOADER_STATE = "cpdata_loader_rank{rank}.pt"
"""File name of each rank's loader state inside a Trainer checkpoint folder."""
_TRAINER_HOOKS = ("get_train_dataloader", "_get_num_items_in_batch", "_prepare_inputs", "training_step",
                  "compute_loss", "log", "_save_checkpoint", "_get_output_dir", "loss_is_scaled_for_ga")
"""What the mixin overrides or relies on in ``transformers.Trainer`` (all present in transformers 5.24, tested)."""
_DATA_DEFAULTS = DataPolicy()


def check_training_args(args: Any, owner: str, *, eval_dataset: Any = None, compute_loss_func: Any = None) -> None:
    """Refuse the Trainer settings a CP trainer cannot honour; one ``ValueError`` lists every one found."""
    refuse_settings(owner, [
        (args.max_steps is None or args.max_steps <= 0,
         f"max_steps={args.max_steps}: the CP loader packs documents as they stream and has no length; "
         "set TrainingArguments(max_steps=N)"),
        (eval_dataset is not None or args.eval_strategy != "no",
         "evaluation (eval_dataset / eval_strategy): not implemented under CP; evaluate with a plain Trainer "
         "on the saved model"),
        (args.label_smoothing_factor > 0,
         f"label_smoothing_factor={args.label_smoothing_factor}: the CP loss is the model's token "
         "cross-entropy over the pack's target count"),
        (compute_loss_func is not None,
         "compute_loss_func: the CP loss is computed by the trainer (per-rank target sum over the pack's "
         "target count); subclass and override compute_loss instead"),
        (bool(args.deepspeed or args.fsdp), "deepspeed / fsdp: the CP trainers are tested with DDP only"),
        (args.parallelism_config is not None and args.parallelism_config.cp_enabled,
         "parallelism_config with cp_size > 1: accelerate's CP hook drops the packed attention mask; cpdata "
         "shards the batches itself, leave accelerate's CP off"),
    ])  # fmt: skip


def cp_loss_scale(world_size: int, cp_size: int, average_tokens_across_devices: bool) -> int:
    """What each rank's loss is multiplied by so that DDP's mean over ``W = dp * cp`` ranks trains like cp 1:
    ``cp`` when the loss divides by the CP group's target count (``average_tokens_across_devices=False``),
    ``W`` when by every rank's (the global token mean), 1 on a single rank."""
    if world_size <= 1:
        return 1
    return world_size if average_tokens_across_devices else cp_size


class CPTrainerMixin:
    """Context parallelism for a ``transformers.Trainer`` subclass: ``cp_size``, ``capacity`` (tokens per
    pack), ``layout`` and :class:`~cpdata.nodes.dataset.CPDataset`'s records, whose DP rank and size come from
    the mesh (and ``seed``, ``vocab_size``, ``labels_alignment`` from the Trainer where left at their
    defaults). A micro-batch is ``per_device_train_batch_size`` packs (one ``"thd"`` stream if several).
    """

    def __init__(
        self,
        *args: Any,
        cp_size: int = 1,
        capacity: int | None = None,
        layout: str = "balanced",
        plan: PlanChoice = StreamPlan(),
        data: DataPolicy = DataPolicy(),
        delivery: Delivery = Delivery(),
        **kwargs: Any,
    ) -> None:
        check_int("cp_size", cp_size, min=1)
        if "loader_options" in kwargs:
            raise TypeError(f"{type(self).__name__}() no longer takes loader_options=; pass the records "
                            "plan=StreamPlan(...)/SchedulePlan(...), data=DataPolicy(...), delivery=Delivery(...)")  # fmt: skip
        check_records(plan=plan, data=data, delivery=delivery)
        if (data.dp_rank, data.dp_size) != (_DATA_DEFAULTS.dp_rank, _DATA_DEFAULTS.dp_size):
            raise ValueError(f"DataPolicy(dp_rank={data.dp_rank}, dp_size={data.dp_size}): {type(self).__name__} "
                             "sets the DP rank and size from its (dp, cp) mesh; leave them out")  # fmt: skip
        self.cp_size, self.cp_capacity, self.cp_layout = cp_size, capacity, layout
        self.cp_plan, self.cp_data, self.cp_delivery = plan, data, delivery
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:  # fail before the (possibly slow) dataset preparation
            check_training_args(training_args, type(self).__name__, eval_dataset=kwargs.get("eval_dataset"),
                                compute_loss_func=kwargs.get("compute_loss_func"))  # fmt: skip
        self._cp_resume_dir: str | None = None
        self._cp_loader: CPDataLoader | None = None
        self._cp_step: tuple[Any, dict[str, Any]] | None = None  # (inputs, kwargs) inside training_step
        super().__init__(*args, **kwargs)
        from transformers import Trainer, __version__

        missing = [name for name in _TRAINER_HOOKS if not hasattr(Trainer, name)]
        if missing:  # an override that Trainer never calls would silently leave its default in place
            raise ValueError(f"transformers {__version__}'s Trainer has no {missing}, which {type(self).__name__} "
                             "overrides; install transformers>=5.24 (pip install 'cpdata[hf]')")  # fmt: skip
        args = self.args
        check_training_args(args, type(self).__name__, eval_dataset=self.eval_dataset,
                            compute_loss_func=self.compute_loss_func)  # fmt: skip
        if args.n_gpu > 1:
            raise ValueError(f"{type(self).__name__}: nn.DataParallel (several GPUs in one process) is not "
                             "supported; launch one process per GPU with torchrun")  # fmt: skip
        check_int("capacity", self.cp_capacity, min=1, fix=" (the tokens per pack)")
        step = self.cp_plan.world_step if isinstance(self.cp_plan, StreamPlan) else 1
        if step > 1 and (step != args.gradient_accumulation_steps or args.per_device_train_batch_size != 1):
            raise ValueError(f"StreamPlan(world_step={step}) balances each rank's work over {step} micro-batches of "
                             f"one pack: pass TrainingArguments(gradient_accumulation_steps={step}, "
                             f"per_device_train_batch_size=1), got {args.gradient_accumulation_steps} and "
                             f"{args.per_device_train_batch_size}")  # fmt: skip
        world = int(args.world_size)
        if world % self.cp_size:
            raise ValueError(f"cp_size={self.cp_size} must divide the world size {world} (dp = world // cp_size)")
        if not self.model_accepts_loss_kwargs:
            raise ValueError(f"{type(self.model).__name__}.forward takes no num_items_in_batch; the CP loss needs "
                             "the model's loss to divide by the pack's target count (any transformers causal "
                             "LM does)")  # fmt: skip
        config = getattr(self.model, "config", None)
        check_attention(config, self.cp_size)
        self.dp_size = world // self.cp_size
        self.cp_mesh = None
        self.dp_rank = self.cp_rank = 0
        cp_group = dp_group = None
        if world > 1:
            device_type = "cuda" if args.device.type == "cuda" else "cpu"
            self.cp_mesh = init_device_mesh(device_type, (self.dp_size, self.cp_size), mesh_dim_names=("dp", "cp"))
            self.dp_rank, self.cp_rank = self.cp_mesh["dp"].get_local_rank(), self.cp_mesh["cp"].get_local_rank()
            cp_group, dp_group = self.cp_mesh["cp"].get_group(), self.cp_mesh["dp"].get_group()
        self._cp_groups = (cp_group, dp_group)
        self._cp_loss_scale = cp_loss_scale(world, self.cp_size, bool(args.average_tokens_across_devices))
        self.loss_is_scaled_for_ga = True  # the divisor counts every micro-batch of the step
        self._cp_inputs = CPModelInputs(self.cp_mesh, args.device, getattr(config, "_attn_implementation", "sdpa"),
                                        self.model)  # fmt: skip
        self._cp_metrics = PackMetrics(dp_group, self.dp_size, args.device, cp_group=cp_group,
                                       cp_size=self.cp_size)  # fmt: skip

    def _cp_padding_token_id(self) -> int:
        for owner in (self.processing_class, getattr(self.model, "config", None)):
            for name in ("pad_token_id", "eos_token_id"):
                value = getattr(owner, name, None)
                if isinstance(value, int) and value >= 0:
                    return value
        return 0

    def _cp_dataset_options(self) -> dict[str, Any]:
        batch_size = int(self.args.per_device_train_batch_size)
        given = self.cp_data
        seed = int(self.args.data_seed if self.args.data_seed is not None else self.args.seed)
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        data = dataclasses.replace(
            given, dp_rank=self.dp_rank, dp_size=self.dp_size,
            seed=seed if given.seed == _DATA_DEFAULTS.seed else given.seed,
            vocab_size=vocab if given.vocab_size is None and isinstance(vocab, int) else given.vocab_size,
            labels_alignment=given.labels_alignment or "inputs",
        )  # fmt: skip
        return {
            "capacity": self.cp_capacity, "cp_size": self.cp_size, "layout": self.cp_layout, "batch_size": batch_size,
            "qkv_format": "thd" if batch_size > 1 else "bshd", "padding_token_id": self._cp_padding_token_id(),
            "plan": self.cp_plan, "data": data, "delivery": self.cp_delivery,
        }  # fmt: skip

    def get_train_dataloader(self) -> CPDataLoader:
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}: training requires a train_dataset")
        args = self.args
        dataset = CPDataset(self.train_dataset, cp_rank=self.cp_rank, **self._cp_dataset_options())
        workers = int(args.dataloader_num_workers)
        loader_kw: dict[str, Any] = {"num_workers": workers,
                                     "pin_memory": bool(args.dataloader_pin_memory) and args.device.type == "cuda"}
        if workers:
            loader_kw.update(persistent_workers=bool(args.dataloader_persistent_workers),
                             prefetch_factor=args.dataloader_prefetch_factor,
                             multiprocessing_context=args.dataloader_multiprocessing_context)  # fmt: skip
        loader = CPDataLoader(dataset, **loader_kw)
        if self._cp_resume_dir is not None:
            path = os.path.join(self._cp_resume_dir, LOADER_STATE.format(rank=self.args.process_index))
            if not os.path.isfile(path):
                raise ValueError(f"{path} is missing: the checkpoint {self._cp_resume_dir} was not written by a "
                                 "CP trainer with this world size; resume from one that was, or start afresh")  # fmt: skip
            loader.load_state_dict(torch.load(path, weights_only=True))
        self._cp_loader = loader
        return loader

    def _prepare_inputs(self, inputs: Any) -> Any:
        return inputs  # a ShardedBatch: the sharder moves it in compute_loss (one buffer copy)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        if not batch_samples:
            return None
        recorded = [getattr(batch, "info", {}).get(N_TARGETS) for batch in batch_samples]
        cp_group, dp_group = self._cp_groups
        if all(is_int(n) for n in recorded):  # the worker counted every CP rank's targets
            total = torch.tensor(sum(recorded), dtype=torch.int64, device=device)
        else:  # labels replaced since: count them over the CP group
            total = sum(global_target_count(b, cp_group, labels=b[LABELS].to(device)) for b in batch_samples)
        if self.dp_size > 1 and self.args.average_tokens_across_devices:
            dist.all_reduce(total, group=dp_group)
        return total

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """Trainer's step inside the batch's CP attention context, backward included: activation
        checkpointing (TRL's default) recomputes attention during backward, which must gather K/V too."""
        if num_items_in_batch is None:
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        ctx, kwargs = self._cp_inputs(inputs, num_items_in_batch)
        self._cp_step = (inputs, kwargs)
        try:
            with ctx:
                return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._cp_step = None

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:  # fmt: skip
        if self._cp_step is not None and self._cp_step[0] is inputs:  # inside training_step: its ctx is on
            outputs = model(**self._cp_step[1])
        else:
            if num_items_in_batch is None:
                num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
            ctx, kwargs = self._cp_inputs(inputs, num_items_in_batch)
            with ctx:
                outputs = model(**kwargs)
        loss = outputs.loss * self._cp_loss_scale
        if self.model.training:
            self._cp_metrics.add(inputs)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log line (every rank logs at the same steps)
            logs = {**logs, **self._cp_metrics.drain()}
        super().log(logs, start_time)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOADER_STATE.format(rank=self.args.process_index))
        torch.save(self._cp_loader.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint found in output_dir {self.args.output_dir!r} to resume from")
        self._cp_resume_dir = resume_from_checkpoint or None
        skip = self.args.ignore_data_skip
        self.args.ignore_data_skip = True  # the loader state resumes the data; Trainer must not skip batches too
        try:
            return super().train(resume_from_checkpoint or None, *args, **kwargs)
        finally:
            self.args.ignore_data_skip = skip
            self._cp_resume_dir = None
