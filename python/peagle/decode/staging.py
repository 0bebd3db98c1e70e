"""One host staging buffer and one device buffer for every small input of a decode step.

The decode loop is host-bound for small models: building ~15 tiny tensors per step and copying
each to the device (then, on the CUDA-graph path, each into a static buffer) costs more than the
step's GPU work. :class:`StepStaging` instead keeps one byte buffer per side, sized once for
``rows`` target rows, ``reqs`` requests and block tables ``table_width`` wide, with a fixed
byte offset per field. A step writes its inputs into numpy views of the host buffer and uploads
them with ONE copy; the :class:`~peagle.decode.inputs.StepTensors` of the step are views into the
device buffer. The CUDA graphs' static input buffers are the same views (``graph_view``), so a
graph step needs no per-field copy at all.

Layout (byte offsets aligned to 64): the *target segment* (every field but the two below), then the
*drafter segment* ``drafter_seq_lens, block_table``: after verification the drafter phase rewrites
and re-uploads only that segment (one more copy).

Invariant (CUDA): the host buffer is page-locked and uploaded with ``non_blocking=True``, so the
host may rewrite it only after the previous upload has read it. :meth:`host` is the only way to get
the writable views and it first waits on the CUDA event recorded right after the last upload (in
the decode loop that event has normally completed already: the loop syncs once per step after
verification). The device buffer needs no such guard: uploads and the kernels reading it are
ordered on the current stream. Switching streams between steps is not supported.

On CPU the host buffer is ordinary memory and the upload a plain copy into the second buffer (kept
separate so that CPU tests exercise the same upload ranges as CUDA).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from peagle.decode.inputs import StepTensors

# (name, dtype, extent): extent "T" = rows, "B" = requests, "B1" = requests + 1, "BW" = table.
_TARGET_FIELDS = (
    ("positions", torch.int64, "T"),
    ("slot_mapping", torch.int64, "T"),
    ("logits_indices", torch.int64, "T"),
    ("draft_row_indices", torch.int64, "T"),
    ("draft_src", torch.int64, "T"),  # flat index into the previous step's drafts [B, K]
    ("seeds", torch.int64, "B"),
    ("offsets", torch.int64, "B"),
    ("request_keys", torch.int64, "B"),  # request ids, written only for synthetic acceptance
    ("input_ids", torch.int32, "T"),
    ("query_start_loc", torch.int32, "B1"),
    ("seq_lens", torch.int32, "B"),
    ("cu_num_draft_tokens", torch.int32, "B"),
    ("temperature", torch.float32, "B"),
    ("top_k", torch.int32, "B"),
    ("top_p", torch.float32, "B"),
    ("backup_next_token_ids", torch.int32, "B"),
    ("request_mask", torch.bool, "B"),
)
_DRAFTER_FIELDS = (
    ("drafter_seq_lens", torch.int32, "B"),
    ("block_table", torch.int32, "BW"),
)
_NP = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.bool: np.bool_,
}
_ALIGN = 64
_MAX_CACHED_VIEWS = 256


class StepStaging:
    """Pinned host buffer + device buffer with one fixed slot per step input (see module doc).

    Args:
        rows: most target rows of a step this staging serves (``T``).
        reqs: most requests of a step (``B``).
        table_width: block-table columns (the engine's ``max_blocks_per_seq``).
        device: where the step's tensors live; page-locked host memory and an upload event only
            when it is a CUDA device.
    """

    def __init__(self, rows: int, reqs: int, table_width: int, device: torch.device) -> None:
        self.rows, self.reqs, self.table_width = int(rows), int(reqs), int(table_width)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        extent = {"T": self.rows, "B": self.reqs, "B1": self.reqs + 1,
                  "BW": self.reqs * self.table_width}  # fmt: skip
        self.layout: dict[str, tuple[int, int, torch.dtype]] = {}  # name -> (offset, numel, dt)
        end = 0
        for i, (name, dt, ext) in enumerate(_TARGET_FIELDS + _DRAFTER_FIELDS):
            if i == len(_TARGET_FIELDS):
                self.drafter_offset = end
            n = extent[ext]
            self.layout[name] = (end, n, dt)
            nbytes = n * torch.empty((), dtype=dt).element_size()
            end += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = end
        self._host = torch.zeros(end, dtype=torch.uint8, pin_memory=self.cuda)
        self._dev = torch.zeros(end, dtype=torch.uint8, device=self.device)
        host_np = self._host.numpy()
        self._np = {}
        self.dev = {}
        for name, (off, n, dt) in self.layout.items():
            nb = n * torch.empty((), dtype=dt).element_size()
            self._np[name] = host_np[off : off + nb].view(_NP[dt])
            self.dev[name] = self._dev[off : off + nb].view(dt)
        self._segments = {
            "all": (self._host, self._dev),
            "drafter": (self._host[self.drafter_offset :], self._dev[self.drafter_offset :]),
        }
        self._event = torch.cuda.Event() if self.cuda else None
        self._in_flight = False
        self._views: OrderedDict = OrderedDict()

    # -- host side ------------------------------------------------------------------------------

    def host(self) -> dict[str, np.ndarray]:
        """Writable numpy views (full capacity, flat) of the host buffer. Waits until the last
        :meth:`upload` has been read by the device (CUDA; a no-op when it already has)."""
        if self._in_flight:
            self._event.synchronize()
            self._in_flight = False
        return self._np

    def upload(self, segment: str = "all") -> None:
        """ONE copy host -> device of ``"all"`` fields or only the ``"drafter"`` segment
        (``drafter_seq_lens`` and ``block_table``); non-blocking on CUDA (see the invariant)."""
        src, dst = self._segments[segment]
        dst.copy_(src, non_blocking=self.cuda)
        if self.cuda:
            self._event.record()
            self._in_flight = True

    # -- device views ---------------------------------------------------------------------------

    def step_view(
        self, num_tokens: int, num_reqs: int, width: int, num_logits: int, num_drafts: int,
        max_query_len: int, top_k: bool, top_p: bool, request_mask: bool,
    ) -> StepTensors:  # fmt: skip
        """:class:`StepTensors` over the device buffer: each field the prefix its step uses,
        ``block_table`` ``[num_reqs, width]`` contiguous (row stride ``width``). Cached per shape
        (views only: they never own memory). ``top_k`` / ``top_p`` / ``request_mask`` False give
        None for that field."""
        key = (num_tokens, num_reqs, width, num_logits, num_drafts, max_query_len, top_k, top_p,
               request_mask)  # fmt: skip
        view = self._views.get(key)
        if view is not None:
            self._views.move_to_end(key)
            return view
        if not (num_tokens <= self.rows and num_reqs <= self.reqs and width <= self.table_width):
            raise ValueError(
                f"step of {num_tokens} rows, {num_reqs} requests, table width {width} exceeds the "
                f"staging capacity ({self.rows}, {self.reqs}, {self.table_width})"
            )
        d, t, b = self.dev, num_tokens, num_reqs
        view = StepTensors(
            input_ids=d["input_ids"][:t],
            positions=d["positions"][:t],
            slot_mapping=d["slot_mapping"][:t],
            query_start_loc=d["query_start_loc"][: b + 1],
            seq_lens=d["seq_lens"][:b],
            block_table=d["block_table"][: b * width].view(b, width),
            logits_indices=d["logits_indices"][:num_logits],
            draft_row_indices=d["draft_row_indices"][:num_drafts],
            cu_num_draft_tokens=d["cu_num_draft_tokens"][:b],
            temperature=d["temperature"][:b],
            top_k=d["top_k"][:b] if top_k else None,
            top_p=d["top_p"][:b] if top_p else None,
            seeds=d["seeds"][:b],
            offsets=d["offsets"][:b],
            request_mask=d["request_mask"][:b] if request_mask else None,
            backup_next_token_ids=d["backup_next_token_ids"][:b],
            drafter_seq_lens=d["drafter_seq_lens"][:b],
            max_query_len=max_query_len,
            request_keys=d["request_keys"][:b],
        )
        self._views[key] = view
        if len(self._views) > _MAX_CACHED_VIEWS:
            self._views.popitem(last=False)
        return view

    def prefix(self, name: str, n: int) -> torch.Tensor:
        """``dev[name][:n]`` (cached like :meth:`step_view`)."""
        key = (name, n)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.dev[name][:n]
            if len(self._views) > _MAX_CACHED_VIEWS:
                self._views.popitem(last=False)
        return view
