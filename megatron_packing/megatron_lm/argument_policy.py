"""What the Megatron-LM entry point does with each Megatron-LM argument its loop could read.

Every argument that Megatron-LM's ``pretrain()`` / ``train()`` / ``train_step()`` /
``training_log()`` / ``evaluate()`` / ``checkpoint_and_decide_exit()`` reads is listed here,
with its fate:

* `Honoured`: the packing loop gives it its meaning, or calls the Megatron piece that reads it
  (``training_log``, ``checkpoint_and_decide_exit``, ``post_training_step_callbacks``,
  ``save_checkpoint``, ``setup_model_and_optimizer``); ``test`` names the test that runs it;
* `Refused`: set to anything but Megatron's default (or the stated requirement), it stops the
  job at start-up, before any model is built, with ``message``.

``tests/megatron_lm/test_argument_policy.py`` walks Megatron's parser and its training loop and
fails when an argument the loop reads is in neither list; ``docs/megatron_lm.md``'s table is
generated from `POLICY` (`policy_table`).

`COMBINATIONS` are arguments that each parse but that Megatron refuses together later, after
start-up: its ``validate_args``, its optimizer config or its LR scheduler assert (mostly with no
message), the scheduler only once the model is built. Each is refused at start-up instead, with
one line naming the flags, their values and what would work (`combination_table` for the docs).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class Honoured:
    """The loop honours the argument; ``how`` says where, ``test`` runs it."""

    how: str
    test: str


@dataclass(frozen=True)
class Refused:
    """Refused at start-up when ``violates(value, default)``; ``message`` says what to use."""

    message: str
    sample: tuple[str, ...]  # Megatron arguments that set it (for the refusal test)
    violates: Callable[[Any, Any], bool] | None = None  # None: any value but the default

    def applies(self, value: Any, default: Any) -> bool:
        if self.violates is not None:
            return self.violates(value, default)
        return bool(value != default)


LOOP = "the packing loop"
LOG = "Megatron's training_log, called every step with this step's counts"
LOG_CUDA = LOG + " (CUDA memory statistics: GPU runs only, not run on CPU)"
EXIT = "Megatron's checkpoint_and_decide_exit, called every step"
CALLBACKS = "Megatron's post_training_step_callbacks, called every step"
SAVE = "Megatron's save_checkpoint / load_checkpoint"
SETUP = "Megatron's setup_model_and_optimizer and its DDP"

_REAL_LOOP = "tests/megatron_lm/test_real_loop.py::"
_STOPS = "tests/megatron_lm/test_graceful_stops.py::"
_FORMATS = "tests/megatron_lm/test_checkpoint_formats.py::"
_CHECKS = "tests/megatron_lm/test_loss_checks.py::"
_PARALLEL = "tests/megatron_lm/test_parallelism.py::"
_ARGS = "tests/megatron_lm/test_arguments.py::"

_METRICS = _REAL_LOOP + "test_megatron_metric_names_reach_the_tensorboard_writer"
_RESUME = _REAL_LOOP + "test_kill_9_after_checkpoint_then_load_matches_uninterrupted"
_VALIDATION = _REAL_LOOP + "test_validation_runs_on_the_validation_loader_and_after_training"


POLICY: dict[str, Honoured | Refused] = {
    # ---- batch, schedule, data
    "global_batch_size": Honoured("B, the mean examples per step; the LR schedule is sized in "
                                  "examples", _REAL_LOOP + "test_lr_schedule_advances_by_real_examples"),
    "micro_batch_size": Refused(
        "--micro-batch-size: one micro-batch is one packed row (packed mode), or is sized by "
        "packing.max_tokens_per_microbatch / packing.micro_batch_size in the YAML (padded "
        "mode); use --micro-batch-size 1 and size rows with --seq-length / bin_capacity",
        ("--micro-batch-size", "2"),
        lambda value, _: value != 1),
    "train_iters": Refused(
        "--train-samples: the packing loop schedules by iterations (the final one repays the "
        "batch-size drift); use --train-iters", (), lambda value, _: not value),
    "train_samples": Refused(
        "--train-samples: the packing loop schedules by iterations; use --train-iters",
        ("--train-samples", "64")),
    "lr_decay_samples": Refused(
        "--lr-decay-samples: the packing loop schedules by iterations (--train-iters) and sizes "
        "the schedule in examples itself; use --lr-decay-iters", ("--lr-decay-samples", "64")),
    "lr_warmup_samples": Refused(
        "--lr-warmup-samples: the packing loop schedules by iterations (--train-iters) and sizes "
        "the schedule in examples itself; use --lr-warmup-iters or --lr-warmup-fraction",
        ("--lr-warmup-samples", "16")),
    "lr_wsd_decay_samples": Refused(
        "--lr-wsd-decay-samples: the packing loop schedules by iterations (--train-iters) and "
        "sizes the schedule in examples itself; use --lr-wsd-decay-iters",
        ("--lr-wsd-decay-samples", "16")),
    "rampup_batch_size": Refused(
        "--rampup-batch-size: the packing loop already varies the batch per step and cannot "
        "ramp it; remove the argument (warm up with --lr-warmup-iters instead)",
        ("--rampup-batch-size", "8", "8", "64")),
    "decrease_batch_size_if_needed": Refused(
        "--decrease-batch-size-if-needed: the packing plan fixes each step's examples; remove it",
        ("--decrease-batch-size-if-needed",)),
    "seq_length": Honoured("the longest packed row; bin_capacity defaults to it",
                           _ARGS + "test_a_row_longer_than_the_model_sequence_is_refused"),
    "decoder_seq_length": Refused(
        "--decoder-seq-length: the packing loop trains decoder-only GPT models; remove it",
        ("--decoder-seq-length", "128")),
    "dataloader_type": Refused(
        "--dataloader-type: the data comes from --packing-config's data: section through the "
        "packing loader; remove it (or use --dataloader-type external)",
        ("--dataloader-type", "cyclic"), lambda value, _: value not in (None, "external")),
    "sft": Refused(
        "--sft: Megatron-LM's SFT dataset and its per-micro-batch loss normalisation are "
        "replaced by --packing-config's data: section; remove it", ("--sft",)),
    "iterations_to_skip": Refused(
        "--iterations-to-skip: skipping an iteration would drop its examples from the packed "
        "stream; remove it", ("--iterations-to-skip", "3")),
    "phase_transition_iterations": Refused(
        "--phase-transition-iterations: not supported by the packing loop; stop with "
        "--exit-interval instead", ("--phase-transition-iterations", "3")),
    "skip_train": Honoured("no training steps; the final validation still runs",
                           _VALIDATION),
    "finetune": Honoured("weights only; the data and the iteration start from the beginning",
                         _REAL_LOOP + "test_load_without_loader_state_is_refused_unless_finetune"),
    "no_load_optim": Honoured(SAVE + " (which reads it)", _RESUME),
    "load": Honoured(SAVE + "; the loader state of the loaded iteration is restored", _RESUME),
    "save": Honoured(SAVE + "; each checkpoint carries every DP rank's loader state", _RESUME),
    "save_interval": Honoured(EXIT, _RESUME),
    "ckpt_format": Refused(
        "--ckpt-format: the packing loop is tested with torch_dist (the default) and torch; use "
        "one of them", ("--ckpt-format", "fsdp_dtensor"),
        lambda value, _: value not in ("torch", "torch_dist")),
    "async_save": Honoured(SAVE + "; the loop finalises saves at each step start and at the end, "
                           "as Megatron's train() (GPU only: Megatron's persistent checkpoint "
                           "worker pins a CUDA device, so it is not run on CPU)",
                           _FORMATS + "test_distributed_optimizer_trains_as_the_reference"),
    "non_persistent_save_interval": Honoured(
        EXIT, _RESUME),
    "non_persistent_ckpt_type": Refused(
        "--non-persistent-ckpt-type local: local non-persistent checkpoints need NVIDIA's "
        "resiliency extension and are not tested with the packing loop; use global",
        ("--non-persistent-ckpt-type", "local"), lambda value, _: value not in (None, "global")),
    "non_persistent_local_ckpt_dir": Refused(
        "--non-persistent-local-ckpt-dir: local non-persistent checkpoints are not supported; "
        "use --non-persistent-ckpt-type global", ("--non-persistent-local-ckpt-dir", "/tmp/x")),
    # ---- graceful stops
    "exit_signal_handler": Honoured(
        EXIT + ": the signal saves a checkpoint at the next step boundary and exits 0",
        _STOPS + "test_sigterm_to_every_rank_saves_at_the_next_step_and_resumes_exactly"),
    "exit_interval": Honoured(EXIT, _STOPS + "test_exit_interval_saves_and_resumes_exactly"),
    "exit_duration_in_mins": Honoured(
        EXIT + ", timed from the job's start",
        _STOPS + "test_exit_duration_saves_and_resumes_exactly"),
    # ---- validation
    "eval_interval": Honoured("validation every N iterations on the validation loader",
                              _VALIDATION),
    "eval_iters": Honoured("validation steps per evaluation; more than the validation set "
                           "gives is refused", _VALIDATION),
    "full_validation": Refused(
        "--full-validation: set --eval-iters to the validation set's step count instead (a "
        "larger value is refused with that count)", ("--full-validation",)),
    "multiple_validation_sets": Refused(
        "--multiple-validation-sets: the packing loop validates on data.valid_paths as one set",
        ("--multiple-validation-sets",)),
    # ---- logging
    "log_interval": Honoured(LOG, _METRICS),
    "tensorboard_dir": Honoured(LOG + "; the packing metrics go to the same writer", _METRICS),
    "tensorboard_log_interval": Honoured(LOG, _METRICS),
    "timing_log_level": Honoured(LOG, _METRICS),
    "log_timers_to_tensorboard": Honoured(LOG, _METRICS),
    "log_throughput": Honoured(LOG + " (FLOPs of this step's rows)", _METRICS),
    "log_params_norm": Honoured(LOG, _METRICS),
    "log_num_zeros_in_grad": Honoured(LOG, _METRICS),
    "log_loss_scale_to_tensorboard": Honoured(LOG, _METRICS),
    "log_world_size_to_tensorboard": Honoured(LOG, _METRICS),
    "log_validation_ppl_to_tensorboard": Honoured("the validation report", _METRICS),
    "log_memory_to_tensorboard": Honoured(LOG_CUDA, _METRICS),
    "log_memory_interval": Honoured(LOG_CUDA, _METRICS),
    "record_memory_history": Honoured(LOG_CUDA, _METRICS),
    "memory_snapshot_path": Honoured(LOG_CUDA, _METRICS),
    "log_progress": Refused(
        "--log-progress: the progress log counts rows as samples; the packing loop logs real "
        "examples (train/consumed_examples); remove it", ("--log-progress",)),
    "log_energy": Refused("--log-energy: not supported by the packing loop; remove it",
                          ("--log-energy",)),
    "log_straggler": Refused("--log-straggler: not supported by the packing loop; remove it",
                             ("--log-straggler",)),
    "disable_straggler_on_startup": Refused(
        "--disable-straggler-on-startup: straggler detection is not supported; remove it",
        ("--disable-straggler-on-startup",)),
    "straggler_ctrlr_port": Refused("--straggler-ctrlr-port: straggler detection is not "
                                    "supported; remove it", ("--straggler-ctrlr-port", "1234")),
    "straggler_minmax_count": Refused("--straggler-minmax-count: straggler detection is not "
                                      "supported; remove it", ("--straggler-minmax-count", "2")),
    "log_max_attention_logit": Refused(
        "--log-max-attention-logit: not supported by the packing loop; remove it",
        ("--log-max-attention-logit",)),
    "run_workload_inspector_server": Refused(
        "--run-workload-inspector-server: not supported by the packing loop; remove it",
        ("--run-workload-inspector-server",)),
    "profile": Refused("--profile: not supported by the packing loop yet; profile with nsys "
                       "around the whole job", ("--profile",)),
    "use_pytorch_profiler": Refused("--use-pytorch-profiler: --profile is not supported; "
                                    "remove it", ("--use-pytorch-profiler",)),
    "profile_ranks": Refused("--profile-ranks: --profile is not supported; remove it",
                             ("--profile-ranks", "1")),
    "profile_step_start": Refused("--profile-step-start: --profile is not supported; remove it",
                                  ("--profile-step-start", "3")),
    "profile_step_end": Refused("--profile-step-end: --profile is not supported; remove it",
                                ("--profile-step-end", "5")),
    # ---- per-step callbacks, memory, GC
    "manual_gc": Honoured(CALLBACKS + "; automatic collection off in the loop",
                          _REAL_LOOP + "test_manual_gc_turns_automatic_collection_off"),
    "manual_gc_interval": Honoured(CALLBACKS,
                                   _REAL_LOOP + "test_manual_gc_turns_automatic_collection_off"),
    "manual_gc_eval": Honoured(LOOP + ", around validation as Megatron's train()",
                               _REAL_LOOP + "test_manual_gc_turns_automatic_collection_off"),
    "check_weight_hash_across_dp_replicas_interval": Honoured(
        CALLBACKS + ": an assertion that the DP replicas' weights agree",
        _REAL_LOOP + "test_each_example_trained_once_and_sizes_add_up"),
    "train_sync_interval": Honoured(CALLBACKS, _METRICS),
    "adlr_autoresume": Refused("--adlr-autoresume: use --exit-signal-handler or "
                               "--exit-duration-in-mins for graceful stops",
                               ("--adlr-autoresume",)),
    "adlr_autoresume_interval": Refused("--adlr-autoresume-interval: --adlr-autoresume is not "
                                        "supported; remove it",
                                        ("--adlr-autoresume-interval", "10")),
    "empty_unused_memory_level": Refused(
        "--empty-unused-memory-level: not supported by the packing loop; remove it",
        ("--empty-unused-memory-level", "1")),
    "barrier_with_L1_time": Honoured("the optimizer timer, as Megatron's train_step", _METRICS),
    "distributed_timeout_seconds_after_init": Refused(
        "--distributed-timeout-seconds-after-init: not supported by the packing loop; set "
        "--distributed-timeout-minutes", ("--distributed-timeout-seconds-after-init", "60")),
    # ---- parallelism and DDP
    "overlap_grad_reduce": Honoured(SETUP + "; the schedule's grad-sync hooks as Megatron's "
                                    "train() sets them",
                                    _FORMATS + "test_distributed_optimizer_trains_as_the_reference"),
    "overlap_param_gather": Honoured(SETUP + "; the schedule's param-sync hook",
                                     _FORMATS + "test_distributed_optimizer_trains_as_the_reference"),
    "align_grad_reduce": Honoured(SETUP, _FORMATS + "test_distributed_optimizer_trains_as_the_reference"),
    "align_param_gather": Honoured(SETUP, _FORMATS + "test_distributed_optimizer_trains_as_the_reference"),
    "use_torch_fsdp2": Refused("--use-torch-fsdp2: not supported by the packing entry point; use "
                               "megatron-core DDP (optionally --use-distributed-optimizer)",
                               ("--use-torch-fsdp2",)),
    "use_megatron_fsdp": Refused("--use-megatron-fsdp: not supported by the packing entry point; "
                                 "use --use-distributed-optimizer", ("--use-megatron-fsdp",)),
    "fsdp_manual_registration": Refused("--fsdp-manual-registration: FSDP is not supported; "
                                        "remove it", ("--fsdp-manual-registration",)),
    "hybrid_context_parallel": Refused(
        "--hybrid-context-parallel: the packing loop plans rows for a fixed --context-parallel-"
        "size; remove it", ("--hybrid-context-parallel",)),
    "use_tp_pp_dp_mapping": Refused("--use-tp-pp-dp-mapping: the other rank order is not tested "
                                    "with the packing loop; remove it",
                                    ("--use-tp-pp-dp-mapping",)),
    "replication": Refused("--replication: checkpoint replication is not tested with the "
                           "packing loop; remove it", ("--replication",)),
    "replication_factor": Refused("--replication-factor: --replication is not supported; "
                                  "remove it", ("--replication-factor", "3")),
    "replication_jump": Refused("--replication-jump: --replication is not supported; remove it",
                                ("--replication-jump", "2")),
    # ---- model features
    "num_layers": Honoured(LOG + " (MoE metrics per layer)",
                           _CHECKS + "test_moe_trains_with_the_aux_loss_scaled_for_each_step"),
    "num_experts": Honoured("MoE GPT; the aux loss is scaled by Megatron's schedule for this "
                            "step's micro-batch count",
                            _CHECKS + "test_moe_trains_with_the_aux_loss_scaled_for_each_step"),
    "moe_router_load_balancing_type": Honoured(
        LOG + " (the MoE losses logged)",
        _CHECKS + "test_moe_trains_with_the_aux_loss_scaled_for_each_step"),
    "moe_z_loss_coeff": Honoured(LOG, _CHECKS + "test_moe_trains_with_the_aux_loss_scaled_for_each_step"),
    "moe_layer_freq": Honoured(LOG, _CHECKS + "test_moe_trains_with_the_aux_loss_scaled_for_each_step"),
    "moe_per_layer_logging": Honoured(LOG, _CHECKS + "test_moe_trains_with_the_aux_loss_scaled_for_each_step"),
    "mtp_num_layers": Refused(
        "--mtp-num-layers: multi-token prediction over packed rows is not supported; remove it",
        ("--mtp-num-layers", "1")),
    "dsa_indexer_loss_coeff": Refused("--dsa-indexer-loss-coeff: not supported by the packing "
                                      "loop; remove it", ("--dsa-indexer-loss-coeff", "0.1")),
    "is_hybrid_model": Refused("--is-hybrid-model: the packing loop builds GPT models; remove it",
                               ("--is-hybrid-model",)),
    "hybrid_override_pattern": Refused("--hybrid-override-pattern: hybrid models are not "
                                       "supported; remove it",
                                       ("--hybrid-override-pattern", "M*")),
    "fp8": Honoured("the FP8 alignment rules of each row",
                    _ARGS + "test_megatron_arguments_complete_the_packing_config"),
    "reuse_grad_buf_for_mxfp8_param_ag": Refused(
        "--reuse-grad-buf-for-mxfp8-param-ag: not supported by the packing loop; remove it",
        ("--reuse-grad-buf-for-mxfp8-param-ag",)),
    "qk_clip": Refused("--qk-clip: not supported by the packing loop; remove it", ("--qk-clip",)),
    "fine_grained_activation_offloading": Refused(
        "--fine-grained-activation-offloading: not supported by the packing loop; remove it",
        ("--fine-grained-activation-offloading",)),
    "cuda_graph_impl": Refused(
        "--cuda-graph-impl: CUDA graphs need static shapes, and packed rows change length and "
        "count every step; use --cuda-graph-impl none", ("--cuda-graph-impl", "local")),
    "cuda_graph_scope": Refused("--cuda-graph-scope: CUDA graphs are not supported; remove it",
                                ("--cuda-graph-scope", "full_iteration")),
    "cuda_graph_warmup_steps": Refused("--cuda-graph-warmup-steps: CUDA graphs are not "
                                       "supported; remove it",
                                       ("--cuda-graph-warmup-steps", "1")),
    "save_dgrads_interval": Refused("--save-dgrads-interval: not supported by the packing loop; "
                                    "remove it", ("--save-dgrads-interval", "2")),
    "save_wgrads_interval": Refused("--save-wgrads-interval: not supported by the packing loop; "
                                    "remove it", ("--save-wgrads-interval", "2")),
    "vision_pretraining": Refused("--vision-pretraining: the packing loop trains GPT models; "
                                  "remove it", ("--vision-pretraining",)),
    "vision_pretraining_type": Refused("--vision-pretraining-type: vision pretraining is not "
                                       "supported; remove it",
                                       ("--vision-pretraining-type", "dino")),
    # ---- reinforcement learning (Megatron-RL)
    "perform_rl_step": Refused("--perform-rl-step: RL training is not what the packing SFT loop "
                               "runs; use Megatron-RL's own entry point", ("--perform-rl-step",)),
    "rl_use_sequence_packing": Refused("--rl-use-sequence-packing: an RL option; remove it",
                                       ("--rl-use-sequence-packing",)),
    "rl_inference_logprobs_is_correction": Refused(
        "--rl-inference-logprobs-is-correction: an RL option; remove it",
        ("--rl-inference-logprobs-is-correction",)),
    "grpo_group_size": Refused("--grpo-group-size: an RL option; remove it",
                               ("--grpo-group-size", "4")),
    "grpo_iterations": Refused("--grpo-iterations: an RL option; remove it",
                               ("--grpo-iterations", "3")),
    "grpo_prompts_per_step": Refused("--grpo-prompts-per-step: an RL option; remove it",
                                     ("--grpo-prompts-per-step", "8")),
    "refit_method": Refused("--refit-method: an RL option; remove it", ("--refit-method", "nccl")),
    "rl_inference_tensor_model_parallel_size": Refused(
        "--rl-inference-tensor-model-parallel-size: an RL option; remove it",
        ("--rl-inference-tensor-model-parallel-size", "2")),
    "rl_inference_pipeline_model_parallel_size": Refused(
        "--rl-inference-pipeline-model-parallel-size: an RL option; remove it",
        ("--rl-inference-pipeline-model-parallel-size", "2")),
    "rl_inference_expert_model_parallel_size": Refused(
        "--rl-inference-expert-model-parallel-size: an RL option; remove it",
        ("--rl-inference-expert-model-parallel-size", "2")),
    "rl_inference_expert_tensor_model_parallel_size": Refused(
        "--rl-inference-expert-tensor-model-parallel-size: an RL option; remove it",
        ("--rl-inference-expert-tensor-model-parallel-size", "2")),
    "rl_inference_model_unified_memory_level": Refused(
        "--rl-inference-model-unified-memory-level: an RL option; remove it",
        ("--rl-inference-model-unified-memory-level", "1")),
    # ---- read by the loop's start-up rather than pretrain(): refused as before
    "calculate_per_token_loss": Refused(
        "--calculate-per-token-loss is required: the loss is a token sum divided once by the "
        "step's global loss-token count, which is what makes packing exact", (),
        lambda value, _: not value),
    "use_legacy_models": Refused("--use-legacy-models: the packing loop drives megatron-core "
                                 "models only", ("--use-legacy-models",)),
    "num_layers_per_virtual_pipeline_stage": Refused(
        "--num-layers-per-virtual-pipeline-stage: the interleaved pipeline schedule needs the "
        "micro-batch count to divide by the pipeline size on every step, which a per-step packed "
        "count does not give; use the plain 1F1B pipeline (drop the virtual pipeline arguments)",
        ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1")),
    "num_virtual_stages_per_pipeline_rank": Refused(
        "--num-virtual-stages-per-pipeline-rank: the interleaved pipeline schedule needs the "
        "micro-batch count to divide by the pipeline size on every step; use the plain 1F1B "
        "pipeline (drop the virtual pipeline arguments)",
        ("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2")),
    # ---- read by megatron-core 0.19's loop (arguments 0.16.1 does not have, or does not read)
    "tensor_model_parallel_size": Honoured(
        "each TP group shares a DP rank's plan; rows align to tp",
        _PARALLEL + "test_tp2_and_cp2_reproduce_the_single_process_run"),
    "context_parallel_size": Honoured(
        "each CP group shares a DP rank's plan; sequences align to 2 x tp x cp",
        _PARALLEL + "test_tp2_and_cp2_reproduce_the_single_process_run"),
    "cuda_graph_scope_deprecated": Refused("--cuda-graph-scope: CUDA graphs are not supported; "
                                           "remove it", ("--cuda-graph-scope", "full_iteration")),
    "cuda_graph_modules": Refused("--cuda-graph-modules: CUDA graphs are not supported; remove it",
                                  ("--cuda-graph-modules", "attn")),
    "eval_global_batch_size": Refused(
        "--eval-global-batch-size: validation steps take --global-batch-size examples from the "
        "validation loader; remove it", ("--eval-global-batch-size", "32")),
    "eval_micro_batch_size": Refused(
        "--eval-micro-batch-size: one validation micro-batch is one packed row; remove it",
        ("--eval-micro-batch-size", "2")),
    "start_eval_at_iter": Refused(
        "--start-eval-at-iter: the packing loop validates every --eval-interval iterations from "
        "the start; remove it", ("--start-eval-at-iter", "4")),
    "validation_set_names": Refused(
        "--validation-set-names: the packing loop validates on data.valid_paths as one set; "
        "remove it", ("--validation-set-names", "a")),
    "freeze_all_layers": Refused("--freeze-all-layers: not supported by the packing loop; "
                                 "remove it", ("--freeze-all-layers",)),
    "gpu_sniff_test_interval": Refused("--gpu-sniff-test-interval: the GPU sniff test is not "
                                       "run by the packing loop; remove it",
                                       ("--gpu-sniff-test-interval", "2")),
    "hybrid_layer_pattern": Refused("--hybrid-layer-pattern: hybrid (Mamba) models are not "
                                    "trained by the packing loop, which trains GPT models; "
                                    "remove it", ("--hybrid-layer-pattern", "M*")),
    "moe_expert_rank_capacity_factor": Refused(
        "--moe-expert-rank-capacity-factor: not supported by the packing loop; remove it",
        ("--moe-expert-rank-capacity-factor", "1.5")),
    "moe_routing_trace_path": Refused("--moe-routing-trace-path: MoE routing traces are not "
                                      "supported by the packing loop; remove it",
                                      ("--moe-routing-trace-path", "trace")),
    "moe_routing_trace_capture_hidden_states": Refused(
        "--moe-routing-trace-capture-hidden-states: MoE routing traces are not supported; "
        "remove it", ("--moe-routing-trace-capture-hidden-states",)),
    "moe_routing_trace_capture_logits": Refused(
        "--moe-routing-trace-capture-logits: MoE routing traces are not supported; remove it",
        ("--moe-routing-trace-capture-logits",)),
    "moe_routing_trace_dump_weights": Refused(
        "--moe-routing-trace-dump-weights: MoE routing traces are not supported; remove it",
        ("--moe-routing-trace-dump-weights",)),
    "moe_routing_trace_max_training_iters": Refused(
        "--moe-routing-trace-max-training-iters: MoE routing traces are not supported; "
        "remove it", ("--moe-routing-trace-max-training-iters", "2")),
    "nccl_ub": Refused("--use-nccl-ub: NCCL user buffers are not tested with the packing loop; "
                       "remove it", ("--use-nccl-ub",)),
    "nvtx_ranges": Refused("--nvtx-ranges: not supported by the packing loop; profile with nsys "
                           "around the whole job", ("--nvtx-ranges",)),
    "optimizer_cuda_graph": Refused("--optimizer-cuda-graph: CUDA graphs are not supported; "
                                    "remove it", ("--optimizer-cuda-graph",)),
    "pytorch_profiler_collect_callstack": Refused(
        "--pytorch-profiler-collect-callstack: --profile is not supported; remove it",
        ("--pytorch-profiler-collect-callstack",)),
    "pytorch_profiler_collect_chakra": Refused(
        "--pytorch-profiler-collect-chakra: --profile is not supported; remove it",
        ("--pytorch-profiler-collect-chakra",)),
    "pytorch_profiler_collect_shapes": Refused(
        "--pytorch-profiler-collect-shapes: --profile is not supported; remove it",
        ("--pytorch-profiler-collect-shapes",)),
    "record_shapes": Refused("--record-shapes: --profile is not supported; remove it",
                             ("--record-shapes",)),
    "rl_offload_inference_model_weights_when_idle": Refused(
        "--rl-offload-inference-model-weights-when-idle: an RL option; remove it",
        ("--rl-offload-inference-model-weights-when-idle",)),
    "rl_offload_optimizer_during_inference": Refused(
        "--rl-offload-optimizer-during-inference: an RL option; remove it",
        ("--rl-offload-optimizer-during-inference",)),
    "rl_profile": Refused("--rl-profile: an RL option; remove it", ("--rl-profile",)),
    "rl_profile_dir": Refused("--rl-profile-dir: an RL option; remove it",
                              ("--rl-profile-dir", "prof")),
    "save_activations_interval": Refused("--save-activations-interval: not supported by the "
                                         "packing loop; remove it",
                                         ("--save-activations-interval", "2")),
    "save_params_interval": Refused("--save-params-interval: not supported by the packing loop; "
                                    "remove it", ("--save-params-interval", "2")),
    "save_tokens_per_expert_interval": Refused(
        "--save-tokens-per-expert-interval: not supported by the packing loop; remove it",
        ("--save-tokens-per-expert-interval", "2")),
    "step_batch_size_schedule": Refused(
        "--step-batch-size-schedule: the packing loop already varies the batch per step and "
        "cannot follow a schedule; remove it", ("--step-batch-size-schedule", "0:16")),
}


@dataclass(frozen=True)
class Combination:
    """Arguments that each parse but that Megatron refuses together, later.

    ``holds`` is what must hold, ``where`` where Megatron fails otherwise (for the docs);
    ``refuse(args)`` returns the one line that names the flags, their values and what would
    work, or None. ``sample`` breaks the rule (added to a valid command line, with ``without``'s
    flags and their values taken out of it), for the tests that run it through Megatron's parser
    and through Megatron itself. ``training_only``: Megatron builds what fails (its optimizer
    and scheduler) only to train, so ``--skip-train`` is not refused.
    """

    flags: str
    holds: str
    where: str
    refuse: Callable[[Any], str | None]
    sample: tuple[str, ...]
    without: tuple[str, ...] = ()
    training_only: bool = False


SCHEDULER = "OptimizerParamScheduler.__init__"
VALIDATE = "validate_args"
OPTIMIZER_CONFIG = "OptimizerConfig.__post_init__"


def shown(value: Any) -> str:
    """An argument's value as a message shows it (floats short: 0.0003, 1e-05)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def decay_iterations(args: Any) -> tuple[str, int | None]:
    """The flag and the iterations over which Megatron's LR decays: ``--lr-decay-iters``, by
    default ``--train-iters``."""
    if args.lr_decay_iters is not None:
        return "--lr-decay-iters", args.lr_decay_iters
    return "--train-iters", args.train_iters


def _no_lr(args: Any) -> str | None:
    if args.lr is not None:
        return None
    return ("--lr is not given: Megatron's LR scheduler needs the peak learning rate (it fails on "
            "float(None) once the model is built); give --lr, for example --lr 1e-5")


def _min_lr_above_lr(args: Any) -> str | None:
    if args.lr is None or args.min_lr <= args.lr:
        return None
    return (f"--min-lr {shown(args.min_lr)} is above --lr {shown(args.lr)}: the LR decays from "
            f"--lr down to --min-lr; give --min-lr {shown(args.lr)} or less")


def _negative_min_lr(args: Any) -> str | None:
    if args.min_lr >= 0:
        return None
    return (f"--min-lr {shown(args.min_lr)}: a learning rate cannot be negative; give --min-lr 0 "
            "or more")


def _warmup_init_above_lr(args: Any) -> str | None:
    if args.lr is None or args.lr_warmup_init <= args.lr:
        return None
    return (f"--lr-warmup-init {shown(args.lr_warmup_init)} is above --lr {shown(args.lr)}: the "
            f"warm-up rises from --lr-warmup-init to --lr; give --lr-warmup-init "
            f"{shown(args.lr)} or less")


def _decay_not_positive(args: Any) -> str | None:
    if args.lr_decay_iters is None or args.lr_decay_iters > 0:
        return None
    return (f"--lr-decay-iters {args.lr_decay_iters}: the LR decays over that many iterations, "
            "at least 1; give a positive number, or leave it out (the LR then decays over "
            "--train-iters)")


def _warmup_not_shorter(args: Any) -> str | None:
    flag, decay = decay_iterations(args)
    if not decay or decay <= 0:
        return None  # no iterations at all, or _decay_not_positive
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_fraction < 1:
            return None
        return (f"--lr-warmup-fraction {shown(args.lr_warmup_fraction)}: the warm-up would last "
                f"the whole LR decay ({flag} {decay}), and Megatron's scheduler needs it to end "
                "before the decay does; give a fraction below 1")
    if args.lr_warmup_iters < decay:
        return None
    return (f"--lr-warmup-iters {args.lr_warmup_iters} is not shorter than {flag} {decay}: "
            "Megatron's scheduler needs the warm-up to end before the LR decay does; give "
            f"--lr-warmup-iters {decay - 1} or less (or a longer {flag})")


def _fraction_and_iterations(args: Any) -> str | None:
    if args.lr_warmup_fraction is None or args.lr_warmup_iters == 0:
        return None
    return (f"--lr-warmup-fraction {shown(args.lr_warmup_fraction)} with --lr-warmup-iters "
            f"{args.lr_warmup_iters}: Megatron takes one warm-up length; give only one of them")


def _wsd_without_iterations(args: Any) -> str | None:
    if args.lr_decay_style != "WSD" or args.lr_wsd_decay_iters is not None:
        return None
    flag, decay = decay_iterations(args)
    return ("--lr-decay-style WSD needs --lr-wsd-decay-iters, the iterations of its final "
            f"decay; give it (at most {flag} {decay})")


def _weight_decay_bounds(args: Any) -> str:
    return " ".join(f"{flag} {shown(value)}" for flag, value in (
        ("--start-weight-decay", args.start_weight_decay),
        ("--end-weight-decay", args.end_weight_decay)) if value is not None)


def _bounds_with_constant_style(args: Any) -> str | None:
    if args.weight_decay_incr_style != "constant" or \
            (args.start_weight_decay is None and args.end_weight_decay is None):
        return None
    return (f"{_weight_decay_bounds(args)} with --weight-decay-incr-style constant (the default): "
            "a constant weight decay is --weight-decay; add --weight-decay-incr-style linear or "
            "cosine, or drop them")


def _style_without_bounds(args: Any) -> str | None:
    if args.weight_decay_incr_style == "constant" or \
            (args.start_weight_decay is not None and args.end_weight_decay is not None):
        return None
    given = _weight_decay_bounds(args)
    return (f"--weight-decay-incr-style {args.weight_decay_incr_style}"
            + (f" with only {given}" if given else "")
            + ": the weight decay rises from --start-weight-decay to --end-weight-decay; give both")


def _weight_decay_falls(args: Any) -> str | None:
    start, end = args.start_weight_decay, args.end_weight_decay
    if args.weight_decay_incr_style == "constant" or start is None or end is None or end >= start:
        return None
    return (f"--start-weight-decay {shown(start)} is above --end-weight-decay {shown(end)}: "
            f"Megatron's weight-decay schedule can only rise; give --end-weight-decay "
            f"{shown(start)} or more (or --weight-decay-incr-style constant with --weight-decay)")


def _negative_weight_decay(args: Any) -> str | None:
    if args.weight_decay_incr_style == "constant":
        flag, value = "--weight-decay", args.weight_decay
    else:
        flag, value = "--start-weight-decay", args.start_weight_decay
    if value is None or value >= 0:
        return None
    return f"{flag} {shown(value)}: weight decay cannot be negative; give {flag} 0 or more"


def _override_and_checkpoint_schedule(args: Any) -> str | None:
    if not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler):
        return None
    return ("--override-opt_param-scheduler with --use-checkpoint-opt_param-scheduler: the first "
            "takes this run's LR schedule on --load, the second the checkpoint's; give one of them")


def _save_without_interval(args: Any) -> str | None:
    if args.save is None or (args.save_interval is not None and args.save_interval > 0):
        return None
    got = "no --save-interval" if args.save_interval is None else \
        f"--save-interval {args.save_interval}"
    return (f"--save {args.save} with {got}: Megatron needs a positive --save-interval with "
            "--save; give one, for example --save-interval 1000 (the run's last iteration is "
            "saved either way)")


def _retain_interval(args: Any) -> str | None:
    save_every, retain = args.save_interval, getattr(args, "save_retain_interval", None)
    if args.save is None or retain is None or not save_every or save_every <= 0 or \
            (retain > 0 and retain % save_every == 0):
        return None
    return (f"--save-retain-interval {retain} with --save-interval {save_every}: the retained "
            "checkpoints must be saved ones; give a positive multiple of --save-interval, for "
            f"example --save-retain-interval {save_every * max(1, round(retain / save_every))}")


def _memory_interval(args: Any) -> str | None:
    every, log_every = args.log_memory_interval, args.log_interval
    if every is None or not log_every or every % log_every == 0:
        return None
    return (f"--log-memory-interval {every} with --log-interval {log_every}: memory is logged "
            "with the log lines; give a multiple of --log-interval, for example "
            f"--log-memory-interval {log_every * max(1, every // log_every)}")


def _offload_without_precision_aware(args: Any) -> str | None:
    if not args.optimizer_cpu_offload or args.use_precision_aware_optimizer:
        return None
    return ("--optimizer-cpu-offload without --use-precision-aware-optimizer: Megatron's hybrid "
            "device optimizer runs through it; add --use-precision-aware-optimizer (with "
            "--use-distributed-optimizer), or drop --optimizer-cpu-offload")


def _precision_aware_needs(args: Any) -> str | None:
    if not args.use_precision_aware_optimizer:
        return None
    missing = ([] if args.optimizer == "adam" else [f"--optimizer adam (not {args.optimizer})"]) \
        + ([] if args.use_distributed_optimizer else ["--use-distributed-optimizer"])
    if not missing:
        return None
    return (f"--use-precision-aware-optimizer needs {' and '.join(missing)}; add "
            f"{'them' if len(missing) > 1 else 'it'}, or drop --use-precision-aware-optimizer")


_STATE_DTYPES = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def _low_precision_states(args: Any) -> str | None:
    if args.use_precision_aware_optimizer:
        return None
    lowered = [f"--{dest.replace('_', '-')} {getattr(args, dest)}" for dest in _STATE_DTYPES
               if str(getattr(args, dest, "fp32")) not in ("fp32", "torch.float32")]
    if not lowered:
        return None
    return (f"{', '.join(lowered)} without --use-precision-aware-optimizer: the optimizer keeps "
            "these in fp32 otherwise; add --use-precision-aware-optimizer (with "
            "--use-distributed-optimizer), or drop them")


COMBINATIONS: tuple[Combination, ...] = (
    Combination("--lr", "given", f"{SCHEDULER}: float(max_lr)", _no_lr, (), ("--lr",),
                training_only=True),
    Combination("--min-lr, --lr", "--min-lr <= --lr", f"{VALIDATE}: min_lr <= lr",
                _min_lr_above_lr, ("--min-lr", "1.0")),
    Combination("--min-lr", ">= 0", f"{SCHEDULER}: min_lr >= 0.0", _negative_min_lr,
                ("--min-lr=-1e-4",), training_only=True),
    Combination("--lr-warmup-init, --lr", "--lr-warmup-init <= --lr",
                f"{SCHEDULER}: init_lr <= max_lr", _warmup_init_above_lr,
                ("--lr-warmup-init", "1.0"), training_only=True),
    Combination("--lr-decay-iters", "> 0", f"{SCHEDULER}: lr_decay_steps > 0",
                _decay_not_positive, ("--lr-decay-iters", "0"), training_only=True),
    Combination("--lr-warmup-iters / --lr-warmup-fraction, --lr-decay-iters / --train-iters",
                "--lr-warmup-iters < --lr-decay-iters (default --train-iters); "
                "--lr-warmup-fraction < 1", f"{SCHEDULER}: lr_warmup_steps < lr_decay_steps",
                _warmup_not_shorter, ("--lr-warmup-iters", "4"), training_only=True),
    Combination("--lr-warmup-fraction, --lr-warmup-iters", "only one of them",
                f"{VALIDATE}: lr_warmup_iters == 0 with lr_warmup_fraction",
                _fraction_and_iterations, ("--lr-warmup-fraction", "0.5")),
    Combination("--lr-decay-style WSD, --lr-wsd-decay-iters", "--lr-wsd-decay-iters given",
                f"{SCHEDULER}: wsd_decay_steps is not None", _wsd_without_iterations,
                ("--lr-decay-style", "WSD"), training_only=True),
    Combination("--start-weight-decay / --end-weight-decay, --weight-decay-incr-style",
                "only with --weight-decay-incr-style linear or cosine",
                f"{VALIDATE}: start_weight_decay is None (constant style)",
                _bounds_with_constant_style, ("--start-weight-decay", "0.0",
                                              "--end-weight-decay", "0.1")),
    Combination("--weight-decay-incr-style, --start-weight-decay, --end-weight-decay",
                "linear / cosine: both bounds given",
                f"{VALIDATE}: start_weight_decay / end_weight_decay is not None",
                _style_without_bounds, ("--weight-decay-incr-style", "linear")),
    Combination("--start-weight-decay, --end-weight-decay",
                "--start-weight-decay <= --end-weight-decay", f"{SCHEDULER}: end_wd >= start_wd",
                _weight_decay_falls, ("--weight-decay-incr-style", "linear",
                                      "--start-weight-decay", "0.1", "--end-weight-decay",
                                      "0.01"), training_only=True),
    Combination("--weight-decay / --start-weight-decay", ">= 0", f"{SCHEDULER}: start_wd >= 0.0",
                _negative_weight_decay, ("--weight-decay=-0.1",), training_only=True),
    Combination("--override-opt_param-scheduler, --use-checkpoint-opt_param-scheduler",
                "at most one", f"{SCHEDULER}: not (override and use-checkpoint)",
                _override_and_checkpoint_schedule,
                ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"),
                training_only=True),
    Combination("--save, --save-interval", "--save-interval > 0 with --save",
                f"{VALIDATE}: save_interval is not None and > 0", _save_without_interval,
                ("--save", "ckpt")),
    Combination("--save-retain-interval, --save-interval", "a positive multiple of --save-interval",
                f"{VALIDATE}: save_retain_interval % save_interval == 0", _retain_interval,
                ("--save", "ckpt", "--save-interval", "4", "--save-retain-interval", "6")),
    Combination("--log-memory-interval, --log-interval", "a multiple of --log-interval",
                f"{VALIDATE}: log_memory_interval % log_interval == 0", _memory_interval,
                ("--log-memory-interval", "3", "--log-interval", "2")),
    Combination("--optimizer-cpu-offload, --use-precision-aware-optimizer",
                "--use-precision-aware-optimizer given", f"{VALIDATE}: use_precision_aware_optimizer",
                _offload_without_precision_aware, ("--optimizer-cpu-offload",)),
    Combination("--use-precision-aware-optimizer, --optimizer, --use-distributed-optimizer",
                "--optimizer adam and --use-distributed-optimizer",
                f"{OPTIMIZER_CONFIG}: optimizer == 'adam', use_distributed_optimizer",
                _precision_aware_needs, ("--use-precision-aware-optimizer",), training_only=True),
    Combination("--main-grads-dtype / --main-params-dtype / --exp-avg-dtype / --exp-avg-sq-dtype",
                "fp32 unless --use-precision-aware-optimizer",
                f"{OPTIMIZER_CONFIG}: each dtype == torch.float32", _low_precision_states,
                ("--main-grads-dtype", "bf16"), training_only=True),
)


def combination_refusals(args: Any) -> list[str]:
    """The line of every `Combination` that ``args`` breaks."""
    training = not getattr(args, "skip_train", False)
    found = (rule.refuse(args) for rule in COMBINATIONS if training or not rule.training_only)
    return [line for line in found if line is not None]


@cache
def _megatron_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def megatron_defaults() -> dict[str, Any]:
    """Every Megatron-LM argument's default, from Megatron's own parser."""
    return {action.dest: action.default for action in _megatron_parser()._actions}


def megatron_flags() -> dict[str, str]:
    """Each Megatron-LM argument's first option string, by destination."""
    return {action.dest: action.option_strings[0] for action in _megatron_parser()._actions
            if action.option_strings}


def refusals(args: Any) -> list[str]:
    """The messages of every `Refused` rule and every `Combination` that ``args`` breaks."""
    defaults = megatron_defaults()
    return [rule.message for dest, rule in POLICY.items()
            if isinstance(rule, Refused) and hasattr(args, dest)
            and rule.applies(getattr(args, dest), defaults.get(dest))] + combination_refusals(args)


def rule_flag(dest: str, rule: Honoured | Refused) -> str:
    """The option a rule is about: this Megatron-LM's own, or for an argument the installed
    release lacks (each supported release has a few the other has not), the one a refusal's
    message starts with, else ``--`` and the destination with dashes. The table is then the
    same whichever supported release is installed."""
    flag = megatron_flags().get(dest)
    if flag is not None:
        return flag
    if isinstance(rule, Refused) and rule.message.startswith("--"):
        return rule.message.split(":")[0].split()[0]
    return "--" + dest.replace("_", "-")


def policy_table() -> str:
    """The Markdown table of `POLICY`, as ``docs/megatron_lm.md`` carries it: one row per
    argument of either supported Megatron-LM release (0.16.1 or 0.19), whichever is installed."""
    lines = ["| argument | with the packing loop |", "|---|---|"]
    for dest in sorted(POLICY):
        rule = POLICY[dest]
        if isinstance(rule, Honoured):
            text = f"honoured: {rule.how} (`{rule.test.split('::')[-1]}`)"
        else:
            text = f"refused at start-up: {rule.message}"
        lines.append(f"| `{rule_flag(dest, rule)}` | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def combination_table() -> str:
    """The Markdown table of `COMBINATIONS`, as ``docs/megatron_lm.md`` carries it."""
    lines = ["| arguments | what must hold | where Megatron fails otherwise |", "|---|---|---|"]
    for rule in COMBINATIONS:
        cells = (f"`{rule.flags}`", rule.holds, f"`{rule.where}`"
                 + (" (not built with `--skip-train`)" if rule.training_only else ""))
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


TABLE_START, TABLE_END = "<!-- argument-policy:start -->", "<!-- argument-policy:end -->"
COMBINATIONS_START = "<!-- argument-combinations:start -->"
COMBINATIONS_END = "<!-- argument-combinations:end -->"


def write_docs_table(path: str) -> None:
    """Replace the tables between the markers in ``path`` with `policy_table` and
    `combination_table`."""
    from pathlib import Path

    doc = Path(path).read_text()
    for start, end, table in ((TABLE_START, TABLE_END, policy_table()),
                              (COMBINATIONS_START, COMBINATIONS_END, combination_table())):
        head, rest = doc.split(start)
        _, tail = rest.split(end)
        doc = f"{head}{start}\n{table}{end}{tail}"
    Path(path).write_text(doc)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write-docs"]:
        raise SystemExit("usage: python -m megatron_packing.megatron_lm.argument_policy "
                         "--write-docs  (with Megatron-LM on PYTHONPATH)")
    write_docs_table("docs/megatron_lm.md")
