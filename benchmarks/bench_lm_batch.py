"""Cost per packed row of the Megatron-LM / Bridge batch formats, CP slicing and the TP broadcast.

Rows come from the real SFT length pools, packed by the SFT packer with the alignment CP needs
(every sequence padded to a multiple of 2 x cp). Part 1 times the single-process conversions;
part 2 times `broadcast_batch_across_tp` between two gloo processes on this machine, against a
per-key broadcast (one collective per tensor plus the same header). Prints tables; not a test.

    python benchmarks/bench_lm_batch.py [--rows 200] [--capacity 8192] [--cp 2]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")  # megatron-core's import-time notices about TE / Apex

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from megatron_packing.demo.launch import free_port  # noqa: E402
from megatron_packing.megatron.lm_batch import (  # noqa: E402
    batch_for_cp_rank,
    broadcast_batch_across_tp,
    cp_partition_indices,
    merge_cp_slices,
    to_bridge_packed_batch,
    to_megatron_lm_batch,
)
from megatron_packing.megatron.packed_seq import packed_seq_params  # noqa: E402
from megatron_packing.packed.collate import PackedMicroBatch  # noqa: E402
from megatron_packing.packing.factory import make_sft_sequence_packer  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402


def packed_rows(count: int, capacity: int, cp: int, seed: int) -> list[PackedMicroBatch]:
    """``count`` rows packed from the mixed real pools, each sequence aligned to 2 x cp."""
    packer = make_sft_sequence_packer(capacity, cp_size=cp, oversize_policy="truncate")
    granule = 2 * cp if cp > 1 else 1
    rng = np.random.default_rng(seed)
    rows: list[PackedMicroBatch] = []
    pools = load_pools(find_pool_dir())
    chunk = 0
    while len(rows) < count:  # every bin of each packed chunk, so rows span the fill range
        lengths = mixed_stream(pools, 512, capacity, seed=seed + chunk)
        lengths = np.minimum(lengths, packer.alignment.max_sequence_length(capacity))
        chunk += 1
        for bin_items in packer.pack(lengths):
            real = [int(lengths[i]) for i in bin_items]
            padded = [-(-n // granule) * granule for n in real]
            cu = np.concatenate([[0], np.cumsum(real)]).astype(np.int32)
            cu_padded = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
            total = int(cu_padded[-1])
            tokens = torch.from_numpy(rng.integers(1, 32000, size=(1, total)))
            rows.append(PackedMicroBatch(
                tokens=tokens, labels=tokens.roll(-1, 1), loss_mask=torch.ones(1, total),
                position_ids=torch.zeros(1, total, dtype=torch.int64),
                cu_seqlens=torch.from_numpy(cu), cu_seqlens_padded=torch.from_numpy(cu_padded),
                max_seqlen=max(padded)))
    picked = rng.choice(len(rows), size=count, replace=False)
    return [rows[i] for i in sorted(picked)]


def _stats_us(samples: list[float]) -> str:
    arr = np.asarray(samples) * 1e6
    return f"{np.median(arr):9.1f} | {np.percentile(arr, 99):9.1f}"


def _time(fn, items) -> list[float]:
    out = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - start)
    return out


def conversions(rows: list[PackedMicroBatch], cp: int) -> None:
    lm = [to_megatron_lm_batch(r) for r in rows]
    cases = [
        ("to_megatron_lm_batch", lambda r: to_megatron_lm_batch(r), rows),
        ("to_bridge_packed_batch", lambda r: to_bridge_packed_batch(r), rows),
        ("packed_seq_params(batch dict, cpu)", lambda b: packed_seq_params(b, device="cpu"), lm),
        (f"cp_partition_indices (cp={cp}, one rank)",
         lambda b: cp_partition_indices(b["cu_seqlens_padded"], cp, 0), lm),
        (f"batch_for_cp_rank (cp={cp}, one rank)", lambda b: batch_for_cp_rank(b, cp, 0), lm),
    ]
    shares = [[batch_for_cp_rank(b, cp, r)["tokens"] for r in range(cp)] for b in lm]
    print(f"| per row (us), {len(rows)} rows | median | p99 |")
    print("|---|---|---|")
    for name, fn, items in cases:
        fn(items[0])  # warm-up
        print(f"| {name} | {_stats_us(_time(fn, items))} |")
    merge = _time(lambda i: merge_cp_slices(shares[i], lm[i]["cu_seqlens_padded"]),
                  range(len(lm)))
    print(f"| merge_cp_slices (cp={cp}, tokens) | {_stats_us(merge)} |")


def _per_key_broadcast(batch, src: int, group) -> dict:
    """Baseline: the same header, then one collective per tensor."""
    is_src = dist.get_rank() == src
    header = (torch.tensor([batch["tokens"].shape[1], batch["cu_seqlens"].numel(), 0])
              if is_src else torch.empty(3, dtype=torch.int64))
    dist.broadcast(header, src, group=group)
    total, n_cu, _ = header.tolist()
    specs = {"tokens": ((1, total), torch.int64), "labels": ((1, total), torch.int64),
             "loss_mask": ((1, total), torch.float32), "position_ids": ((1, total), torch.int64),
             "cu_seqlens": ((1, n_cu), torch.int32), "cu_seqlens_padded": ((1, n_cu), torch.int32),
             "max_seqlen": ((1,), torch.int32)}
    out = {}
    for key, (shape, dtype) in specs.items():
        t = batch[key] if is_src else torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src, group=group)
        out[key] = t
    return out


def _tp_worker(rank: int, port: int, rows: list[PackedMicroBatch], queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    group = dist.new_group([0, 1])
    batches = [to_megatron_lm_batch(r) for r in rows]
    results = {}
    for name, fn in (("broadcast_batch_across_tp (header + 3)",
                      lambda b: broadcast_batch_across_tp(b, group=group, src_rank=0)),
                     ("per-key broadcast (header + 7)",
                      lambda b: _per_key_broadcast(b, 0, group))):
        samples = []
        for i, batch in enumerate(batches):
            dist.barrier(group=group)
            start = time.perf_counter()
            got = fn(batch if rank == 0 else None)
            samples.append(time.perf_counter() - start)
            if rank == 1 and i == 0:
                assert torch.equal(got["cu_seqlens_padded"], batch["cu_seqlens_padded"])
        results[name] = samples
    if rank == 1:
        queue.put(results)
    dist.destroy_process_group()


def tp_broadcast(rows: list[PackedMicroBatch]) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, port, rows, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = queue.get()
    for p in procs:
        p.join()
    mean_tokens = np.mean([r.tokens.shape[1] for r in rows])
    print(f"\n| TP=2 gloo, receiver side, {len(rows)} rows (mean {mean_tokens:.0f} tokens), us "
          "| median | p99 |")
    print("|---|---|---|")
    for name, samples in results.items():
        print(f"| {name} | {_stats_us(samples)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = packed_rows(args.rows, args.capacity, args.cp, args.seed)
    seqs = [r.cu_seqlens.numel() - 1 for r in rows]
    tokens = [r.tokens.shape[1] for r in rows]
    print(f"{len(rows)} rows, capacity {args.capacity}, sequences per row: median "
          f"{int(np.median(seqs))}, max {max(seqs)}; tokens per row: median "
          f"{int(np.median(tokens))}, min {min(tokens)}\n")
    conversions(rows, args.cp)
    tp_broadcast(rows)


if __name__ == "__main__":
    main()
