"""Use the packed dataloader in your own loop (single process, plain PyTorch model).

    python examples/custom_loop.py

Shows what each step gives you: this rank's micro-batches (THD rows) and the step's global
metadata. The loss is a token sum divided once by the global loss-token count, so packing does
not change it. With several DP ranks, pass dp_rank / dp_size and SUM gradients across ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_packing import PackingConfig, build_sft_dataloader, load_sft_dataset
from megatron_packing.data.tokenize import load_tokenizer
from megatron_packing.loader.metrics import step_metrics
from megatron_packing.megatron.packed_seq import block_diagonal_causal_mask

HERE = Path(__file__).resolve().parent


class TinyLM(torch.nn.Module):
    """Embedding + one masked self-attention layer + output head."""

    def __init__(self, vocab: int, dim: int = 64, max_len: int = 512) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        self.attn = torch.nn.MultiheadAttention(dim, 4, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, positions, mask):  # mask: [T, T], True = blocked
        h = self.tok(tokens) + self.pos(positions)
        h = h + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return self.head(h)


def main() -> None:
    ds = load_sft_dataset(str(HERE / "data" / "demo_chat.jsonl"), str(HERE / "tokenizer"),
                          show_progress=False)
    config = PackingConfig(global_batch_size=16, bin_capacity=512, align_packing_bins_to_dp=True,
                           packing_batch_size_allowed_variation=0.125, oversize_policy="truncate")
    loader = build_sft_dataloader(ds, config, dp_rank=0, dp_size=1, total_steps=10)
    model = TinyLM(vocab=len(load_tokenizer(str(HERE / "tokenizer"))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in loader:
        optimizer.zero_grad()
        total = torch.zeros(())
        for mb in batch.micro_batches:  # one packed row per micro-batch
            mask = block_diagonal_causal_mask(mb.cu_seqlens_padded, mb.tokens.shape[1])[0, 0]
            logits = model(mb.tokens, mb.position_ids, mask)
            losses = F.cross_entropy(logits[0], mb.labels[0], reduction="none")
            loss = (losses * mb.loss_mask[0]).sum() / batch.meta.num_loss_tokens
            loss.backward()
            total += loss.detach()
        optimizer.step()
        m = step_metrics(batch.meta, loss=float(total))
        print(f"step {batch.meta.step}: loss {m['train/loss']:.3f}  "
              f"examples {m['train/actual_batch_size']}  rows {len(batch)}  "
              f"fill {m['train/token_fill']:.2f}")


if __name__ == "__main__":
    main()
