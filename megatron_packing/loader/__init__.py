"""The resumable torchdata loader and what each of its steps reports.

- `dataloader`: ``build_sft_dataloader`` (dataset + `PackingConfig` -> `StatefulDataLoader`);
- `state`: a loader state of either worker layout, read down to the sampler's position;
- `metrics`: per-step metric names and the writers (W&B, JSONL, memory).
"""
