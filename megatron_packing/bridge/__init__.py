"""The Megatron-Bridge host: packed, DP-aligned SFT steps inside a Bridge recipe.

A user's Bridge ``ConfigContainer`` (model, optimizer, scheduler, parallelism, checkpoints,
loggers) plus a training YAML's ``packing:`` and ``data:`` sections: Bridge's ``setup()`` builds
the model, optimizer and scheduler and loads the checkpoint; the library's step loop
(`megatron_packing.megatron.step_loop`) runs Bridge's ``train_step`` at each step's planned
micro-batch count (`host`); the loader state rides in Bridge's per-DP-rank dataloader files
(`loader_state`); what the host cannot honour is refused before anything is built (`recipe`).
Entry: `megatron_packing.bridge.entry.finetune_packed`.
"""
