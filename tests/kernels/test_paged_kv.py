"""AttentionMetadata's helpers (server/kernels/paged_kv.py): a step's sequences taken apart, values built once a
step."""

from __future__ import annotations

import torch

from server.kernels.paged_kv import AttentionMetadata, select_sequences


def mixed_step():
    # Four sequences: a chunk of 3, a decode row, an idle one, a chunk of 2 (rows 0-2, 3, -, 4-5).
    q_lens, seq_lens = [3, 1, 0, 2], [10, 7, 4, 2]
    return AttentionMetadata(
        slot_mapping=torch.tensor([40, 41, 42, 7, 90, 91]),
        block_tables=torch.arange(16, dtype=torch.int32).view(4, 4),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 4, 4, 6], dtype=torch.int32),
        seq_lens_cpu=seq_lens, query_lens_cpu=q_lens,
        recent_rows=torch.tensor([5, 6, 7, 8], dtype=torch.int32),
    )


def test_select_sequences_gives_their_rows_and_a_step_of_them_alone_in_the_order_asked():
    meta = mixed_step()
    rows, sub = select_sequences(meta, [3, 1, 2])
    assert rows.tolist() == [4, 5, 3]
    assert sub.slot_mapping.tolist() == [90, 91, 7]
    assert sub.block_tables.tolist() == [[12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert sub.seq_lens.tolist() == [2, 7, 4] and sub.seq_lens_cpu == [2, 7, 4]
    assert sub.query_start_loc.tolist() == [0, 2, 3, 3] and sub.query_start_loc.dtype == torch.int32
    assert sub.query_lens_cpu == [2, 1, 0]
    assert sub.recent_rows.tolist() == [8, 6, 7]
    _, none = select_sequences(meta, [])
    assert none.query_lens_cpu == [] and none.query_start_loc.tolist() == [0]


def test_consecutive_sequences_give_their_rows_as_a_slice():
    # A view of q instead of a gather: a mixed step's groups (decode rows first) cost no launch a layer.
    meta = mixed_step()
    rows, sub = select_sequences(meta, [1, 2, 3])
    assert rows == slice(3, 6)
    assert sub.slot_mapping.tolist() == [7, 90, 91] and sub.query_start_loc.tolist() == [0, 1, 1, 3]
    assert sub.block_tables.tolist() == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert select_sequences(meta, [2])[0] == slice(4, 4)


def test_metadata_for_attention_alone_keeps_no_slots():
    meta = mixed_step()
    meta.slot_mapping = meta.slot_mapping[:2]  # not one a row: attention never reads them
    _, sub = select_sequences(meta, [0])
    assert sub.slot_mapping.numel() == 0 and sub.query_lens_cpu == [3]


def test_step_value_is_built_once_per_metadata():
    meta, built = mixed_step(), []
    for _ in range(3):
        assert meta.step_value("x", lambda: built.append(1) or len(built)) == 1
    assert mixed_step().step_value("x", lambda: "fresh") == "fresh"  # another step builds its own
