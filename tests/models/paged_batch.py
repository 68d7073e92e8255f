"""Test harness: run several sequences through a model with dense f32 paged KV stores.

Pages are handed out in a shuffled order, so a sequence's pages are scattered in the pool and any code
that assumes contiguity fails. One ``step`` takes a chunk of new tokens per sequence (a whole prompt, part
of one, or a single decode token) and returns float32 logits for every new token.
"""

from __future__ import annotations

import torch

from server.kernels.paged_kv import AttentionMetadata, DenseKVStore


class PagedBatch:
    def __init__(self, model, num_pages: int = 64, page_size: int = 4, seed: int = 0, kv_dtype=torch.float32):
        cfg = model.config
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.page_size = page_size
        self.stores = [
            DenseKVStore(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, self.device)
            for _ in range(cfg.num_layers)
        ]
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.pages: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def _slots(self, seq: str, n: int) -> list[int]:
        pages, start = self.pages.setdefault(seq, []), self.lens.get(seq, 0)
        slots = []
        for pos in range(start, start + n):
            if pos // self.page_size == len(pages):
                pages.append(self.free.pop())
            slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
        return slots

    @torch.inference_mode()
    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """{seq: new token ids} -> {seq: float32 logits [len(new), vocab]}."""
        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            slots += self._slots(seq, len(tokens))
            ids += tokens
            positions += range(start, start + len(tokens))
            self.lens[seq] = start + len(tokens)
            q_lens.append(len(tokens))
            seq_lens.append(self.lens[seq])
        max_pages = max(len(self.pages[s]) for s in chunks)
        tables = torch.zeros(len(chunks), max_pages, dtype=torch.int32)
        for i, seq in enumerate(chunks):
            tables[i, : len(self.pages[seq])] = torch.tensor(self.pages[seq], dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0] + q_lens).cumsum(0).to(device=dev, dtype=torch.int32),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=q_lens,
        )
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.stores, meta)
        logits = self.model.compute_logits(hidden).cpu()
        return dict(zip(chunks, logits.split(q_lens)))


def greedy(batch: PagedBatch, prompts: dict[str, list[int]], new_tokens: int, chunk: int | None = None):
    """Prefill every prompt (in chunks of ``chunk`` tokens, all sequences in the same steps), then decode all
    sequences together. Returns ({seq: generated ids}, {seq: logits of every position [len-1, vocab]})."""
    logits = {s: [] for s in prompts}
    chunk = chunk or max(len(p) for p in prompts.values())
    done = {s: 0 for s in prompts}
    last = {}
    while any(done[s] < len(p) for s, p in prompts.items()):
        step = {s: p[done[s] : done[s] + chunk] for s, p in prompts.items() if done[s] < len(p)}
        for s, out in batch.step(step).items():
            done[s] += len(step[s])
            logits[s].append(out)
            last[s] = out[-1]
    generated = {s: [] for s in prompts}
    for i in range(new_tokens):
        nxt = {s: [int(last[s].argmax())] for s in prompts}
        for s, t in nxt.items():
            generated[s] += t
        if i == new_tokens - 1:
            break
        for s, out in batch.step(nxt).items():
            logits[s].append(out)
            last[s] = out[-1]
    return generated, {s: torch.cat(v) for s, v in logits.items()}


def assert_matches_reference(ref_model, prompts: dict[str, list[int]], generated, logits, tol: float = 1e-4) -> None:
    """Our logits at every position are within ``tol`` (relative to the logit scale) of ``ref_model``'s on
    prompt + generated, and the reference's greedy choice after every prefix is our token -- so the
    reference's own greedy continuation of each prompt is exactly ours (teacher forcing)."""
    device = next(ref_model.parameters()).device
    for seq, prompt in prompts.items():
        with torch.no_grad():
            ref = ref_model(torch.tensor([prompt + generated[seq]], device=device)).logits[0, :-1].float().cpu()
        assert logits[seq].shape == ref.shape
        err, scale = (logits[seq] - ref).abs().max().item(), ref.abs().max().item()
        assert err <= tol * scale + tol, f"sequence {seq}: max |logit diff| {err:.3g} (logit scale {scale:.3g})"
        ref_greedy = ref[len(prompt) - 1 :].argmax(-1).tolist()
        assert ref_greedy == generated[seq], f"sequence {seq}: greedy tokens differ from the reference"
