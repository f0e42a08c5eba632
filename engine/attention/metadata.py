"""Per-step model inputs and attention metadata, built in one place from a `ScheduledBatch`.

`build_step_inputs` turns the scheduler's grants into flat int32 arrays (one host-to-device copy),
reading block tables from the rows a `BlockTableRows` keeps where one is given, and
`set_forward_context` installs the step's `AttentionMetadata` for the attention layers, restoring
the previous value on exit. Nothing here knows which attention backend runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.core.scheduler import ScheduledBatch


@dataclass
class AttentionMetadata:
    """Everything the attention backends need for one step, flat. Token rows follow `seqs` order."""

    num_seqs: int
    num_tokens: int
    max_seqlen_q: int  # longest query (new tokens) of a sequence
    max_seqlen_k: int  # longest context (cached + new tokens) of a sequence
    has_context: bool  # some sequence attends to KV written before this step
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, cumulative new tokens
    cu_seqlens_k: torch.Tensor  # [B + 1] int32, cumulative context lengths
    context_lens: torch.Tensor  # [B] int32, keys per sequence (FA4's seqused_k)
    slot_mapping: torch.Tensor  # [T] int32, cache slot of each new token (-1: do not store)
    block_tables: torch.Tensor  # [B, max_blocks] int32 (FA4's page_table)
    query_lens_cpu: tuple[int, ...] = ()
    context_lens_cpu: tuple[int, ...] = ()

    @property
    def seqused_k(self) -> torch.Tensor:
        return self.context_lens

    @property
    def page_table(self) -> torch.Tensor:
        return self.block_tables

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    logits_indices: torch.Tensor  # [S] int32: rows whose next token is sampled
    temperatures: torch.Tensor  # [S] float32
    top_ks: torch.Tensor  # [S] int32 (-1: off)
    top_ps: torch.Tensor  # [S] float32
    attn: AttentionMetadata
    sampled_seq_indices: tuple[int, ...]  # which sequences of the batch the S rows belong to
    all_greedy: bool
    needs_top_k_top_p: bool


_FORWARD_CONTEXT: ContextVar[AttentionMetadata | None] = ContextVar("kvplan_attn_metadata", default=None)


@contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Install `metadata` for the attention layers for the duration of a forward pass."""
    token = _FORWARD_CONTEXT.set(metadata)
    try:
        yield metadata
    finally:
        _FORWARD_CONTEXT.reset(token)


def get_forward_context() -> AttentionMetadata:
    metadata = _FORWARD_CONTEXT.get()
    if metadata is None:
        raise RuntimeError("attention called outside set_forward_context(): no step metadata installed")
    return metadata


class BlockTableRows:
    """The block tables of the sequences a model runner has run, as rows of one int32 array that each
    step extends by the blocks it added: a step's table is then a gather of its rows (numpy, in C)
    where building it from every sequence's list costs rows x width Python conversions (2,048-wide
    rows at 32k tokens of block 16). A row belongs to one table list (`Sequence.block_table`, which
    the block manager only appends to while the sequence holds it, and replaces when it frees it);
    rows of tables absent from a step are reused once no row is free (so it holds no more lists than
    it has rows). Entries past a table's length read 0, as `build_step_inputs` pads them without rows.
    With `track_writes`, it also keeps the entries written since `take_writes` last gave them (for a
    copy of the rows kept on the device, `DeviceTableRows`)."""

    __slots__ = ("rows", "_entries", "_free", "_step", "_filled", "_dirty", "_resync")

    def __init__(self, num_rows: int, width: int, track_writes: bool = False) -> None:
        if num_rows < 1 or width < 1:
            raise ValueError(f"BlockTableRows: num_rows and width must be >= 1, got {num_rows}, {width}")
        self.rows = np.zeros((num_rows, width), np.int32)
        # id(table list) -> [row, the list (held, so its id stays its own), entries written, last step]
        self._entries: dict[int, list] = {}
        self._free = list(range(num_rows - 1, -1, -1))
        self._step = 0
        self._filled = [0] * num_rows  # per row: the entries past which it holds only zeros
        # (row, first, end) of the entries written since take_writes, where tracked; a new shape: all
        self._dirty: list[tuple[int, int, int]] | None = [] if track_writes else None
        self._resync = False

    def gather(self, tables: list[list[int]], width: int) -> np.ndarray:
        """The step's block table: one row per list of `tables`, `width` entries, zero-padded."""
        index = self.index(tables, width)  # first: it may grow the rows
        return self.rows[index, :width]

    def index(self, tables: list[list[int]], width: int) -> list[int]:
        """The row of each list of `tables`, each written up to date (a new list gets a row)."""
        self._step = step = self._step + 1
        if width > self.rows.shape[1]:
            self.rows = np.pad(self.rows, ((0, 0), (0, width - self.rows.shape[1])))
            self._resync = True
        entries, dirty, index = self._entries, self._dirty, []
        for table in tables:
            entry = entries.get(id(table))
            if entry is None:
                entry = self._assign(table, step)
            elif len(table) > entry[2]:  # the blocks the step before added (usually one, or none)
                row, n = entry[0], len(table)
                self.rows[row, entry[2] : n] = table[entry[2] :]
                if dirty is not None:
                    dirty.append((row, entry[2], n))
                entry[2] = self._filled[row] = n
            entry[3] = step
            index.append(entry[0])
        return index

    def take_writes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(flat indices into `rows`, their values) of the entries written since the last call, or
        None where the rows changed shape since (a copy of them must take them whole)."""
        dirty, self._dirty = self._dirty, []
        if dirty is None:
            raise RuntimeError("BlockTableRows: take_writes needs track_writes=True")
        if self._resync:
            self._resync = False
            return None
        if not dirty:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        row, first, end = np.array(dirty, np.int64).T
        lengths = end - first
        # each range's flat start, less the entries before it: + arange(total) walks every range
        offsets = row * self.rows.shape[1] + first - (np.cumsum(lengths) - lengths)
        flat = (np.repeat(offsets, lengths) + np.arange(int(lengths.sum()))).astype(np.int32)
        return flat, self.rows.reshape(-1)[flat]

    def _assign(self, table: list[int], step: int) -> list:
        """A row for a table first seen now, written whole (zeros after it)."""
        if not self._free:
            self._reclaim(step)
        row = self._free.pop()
        n, filled = len(table), self._filled[row]
        self.rows[row, :n] = table
        self.rows[row, n:filled] = 0
        if self._dirty is not None and max(n, filled):
            self._dirty.append((row, 0, max(n, filled)))
        self._filled[row] = n
        entry = self._entries[id(table)] = [row, table, n, step]
        return entry

    def _reclaim(self, step: int) -> None:
        """Free the rows of tables not in this step; add rows where every one is in it."""
        stale = [key for key, entry in self._entries.items() if entry[3] != step]
        for key in stale:
            self._free.append(self._entries.pop(key)[0])
        if not self._free:
            num_rows = len(self.rows)
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
            self._free = list(range(2 * num_rows - 1, num_rows - 1, -1))
            self._filled += [0] * num_rows
            self._resync = True


class DeviceTableRows:
    """`BlockTableRows` with a copy of its rows on the model's device, updated each step by the entries
    written since the step before (a decode step: one per sequence that opened a block), so that a
    step sends the device its rows' indices and those entries, not a batch x width table, and the
    table is gathered there. The host's work per step no longer grows with the table's width (a
    step not run ahead waits for it: at 210 x 32k tokens of block 16 the table is 1.7 MB)."""

    __slots__ = ("host", "device_rows")

    def __init__(self, num_rows: int, width: int, device: torch.device) -> None:
        self.host = BlockTableRows(num_rows, width, track_writes=True)
        self.device_rows = torch.zeros(self.host.rows.shape, dtype=torch.int32, device=device)

    def parts(self, tables: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the rows of `tables`, the flat indices and values written since the last step): what the
        step's host-to-device copy carries; a new shape of rows is copied whole at once."""
        index = np.asarray(self.host.index(tables, width), np.int32)
        writes = self.host.take_writes()
        if writes is None:  # rare: more rows or a wider row than at start
            self.device_rows = torch.from_numpy(self.host.rows.copy()).to(self.device_rows.device)
            return index, np.zeros(0, np.int32), np.zeros(0, np.int32)
        return index, *writes

    def table(
        self, index: torch.Tensor, flat: torch.Tensor, values: torch.Tensor, width: int
    ) -> torch.Tensor:
        """The step's [len(index), width] table on the device, after writing `values` at `flat`."""
        if flat.numel():
            self.device_rows.view(-1).index_copy_(0, flat.long(), values)
        return self.device_rows[:, :width].index_select(0, index)


def build_step_inputs(
    batch: ScheduledBatch,
    block_size: int,
    device: torch.device,
    staging: torch.Tensor | None = None,
    table_rows: BlockTableRows | DeviceTableRows | None = None,
) -> StepInputs:
    """Model inputs and attention metadata of one step; `staging` is an optional pinned int32 buffer
    through which the single host-to-device copy goes; `table_rows`, where given, keeps the block
    tables between steps (the same table, built faster; a `DeviceTableRows` gathers it on the device)."""
    b = batch.num_seqs
    q = np.fromiter(batch.num_scheduled_tokens, np.int32, b)
    c = np.fromiter(batch.num_computed_tokens, np.int32, b)
    ctx = q + c
    cu_q = np.zeros(b + 1, np.int32)
    np.cumsum(q, out=cu_q[1:])
    cu_k = np.zeros(b + 1, np.int32)
    np.cumsum(ctx, out=cu_k[1:])
    num_tokens = int(cu_q[-1])
    seqs = batch.seqs
    if num_tokens == b:  # every sequence computes one token (decodes and 1-token chunks)
        input_ids = np.fromiter((s.token_ids[n] for s, n in zip(seqs, c.tolist())), np.int32, b)
        positions = c
        seq_of_token = np.arange(b)
    else:
        input_ids = np.fromiter(
            chain.from_iterable(s.token_ids[i : i + n] for s, i, n in zip(seqs, c.tolist(), q.tolist())),
            np.int32,
            num_tokens,
        )
        seq_of_token = np.repeat(np.arange(b), q)
        positions = (np.arange(num_tokens, dtype=np.int32) - np.repeat(cu_q[:-1] - c, q)).astype(np.int32)
    width = max(len(s.block_table) for s in seqs)
    lists = [s.block_table for s in seqs]
    blocks, table_parts = _table_parts(lists, width, table_rows, seq_of_token, positions // block_size)
    slots = blocks * block_size + positions % block_size
    sampled = tuple(i for i, d in enumerate(batch.do_sample) if d)
    idx = np.asarray(sampled, np.int64)
    logits_indices = cu_q[1:][idx] - 1 if sampled else np.zeros(0, np.int32)
    params = [seqs[i].sampling_params for i in sampled]
    temps = np.fromiter((p.temperature for p in params), np.float32, len(params))
    top_ks = np.fromiter((p.top_k for p in params), np.int32, len(params))
    top_ps = np.fromiter((p.top_p for p in params), np.float32, len(params))
    parts = [
        input_ids,
        positions,
        slots.astype(np.int32),
        cu_q,
        cu_k,
        ctx,
        logits_indices.astype(np.int32),
        temps.view(np.int32),
        top_ks,
        top_ps.view(np.int32),
        *table_parts,
    ]
    dev = _to_device(np.concatenate(parts), device, staging)
    views = torch.split(dev, [len(p) for p in parts])
    attn = AttentionMetadata(
        num_seqs=b,
        num_tokens=num_tokens,
        max_seqlen_q=int(q.max()),
        max_seqlen_k=int(ctx.max()),
        has_context=bool(c.any()),
        cu_seqlens_q=views[3],
        cu_seqlens_k=views[4],
        context_lens=views[5],
        slot_mapping=views[2],
        block_tables=(
            table_rows.table(*views[10:], width)
            if isinstance(table_rows, DeviceTableRows)
            else views[10].view(b, width)
        ),
        query_lens_cpu=tuple(q.tolist()),
        context_lens_cpu=tuple(ctx.tolist()),
    )
    return StepInputs(
        input_ids=views[0],
        positions=views[1],
        logits_indices=views[6],
        temperatures=views[7].view(torch.float32),
        top_ks=views[8],
        top_ps=views[9].view(torch.float32),
        attn=attn,
        sampled_seq_indices=sampled,
        all_greedy=bool((temps == 0).all()),
        needs_top_k_top_p=bool(((top_ks > 0) | (top_ps < 1.0)).any()),
    )


def _table_parts(
    lists: list[list[int]],
    width: int,
    table_rows: BlockTableRows | DeviceTableRows | None,
    seq_of_token: np.ndarray,
    pages: np.ndarray,
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """(the block of each token's page, what the step's copy carries of its table): the table
    itself, flat (rebuilt from `lists`, or gathered from kept rows), or, with a `DeviceTableRows`,
    its rows' indices and the entries written since the step before."""
    if isinstance(table_rows, DeviceTableRows):
        index, flat, values = table_rows.parts(lists, width)
        return table_rows.host.rows[index[seq_of_token], pages], (index, flat, values)
    if table_rows is not None:
        tables = table_rows.gather(lists, width)
    else:
        tables = np.zeros((len(lists), width), np.int32)
        for i, table in enumerate(lists):
            tables[i, : len(table)] = table
    return tables[seq_of_token, pages], (tables.reshape(-1),)


def _to_device(packed: np.ndarray, device: torch.device, staging: torch.Tensor | None) -> torch.Tensor:
    host = torch.from_numpy(packed)
    if device.type == "cpu":
        return host
    if staging is not None and staging.numel() >= host.numel():
        staged = staging[: host.numel()]
        staged.copy_(host)
        return staged.to(device, non_blocking=True)
    return host.to(device)
