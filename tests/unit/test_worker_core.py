"""The worker's core without sockets: messages in, actions out, with real readers over real files."""

import numpy as np

from tests.conftest import job_dict
from msd_common.spec import parse_job
from msd_common import protocol as P
from msd_common.doc_keys import doc_key
from worker.core import CacheEntry, Forgotten, Registered, ToCoordinator, ToRank, WorkerCore
from worker.samples import open_source


def _welcomed(dataset_dir):
    job = parse_job(job_dict(), "job.yaml", base_dir=dataset_dir)
    core = WorkerCore()
    actions = core.handle(P.Welcome(worker_id=3, heartbeat_s=0.5, job=job.worker_job().to_wire(), count=[]))
    assert actions == [Registered(3, 0.5)]
    return core, job


def test_prepare_caches_typed_entries_and_answers_lengths_and_skips(dataset_dir):
    core, job = _welcomed(dataset_dir)
    records = np.array([61, 62, 64, 0], dtype=np.uint64)  # web-1.jsonl lines 2, 3 (corrupt), 5 (bad UTF-8)
    [reply] = core.handle(P.Prepare(task_id=9, source=0, worker_id=core.worker_id or 0, records=records))
    assert isinstance(reply, ToCoordinator) and isinstance(reply.message, P.Prepared)
    lengths = reply.message.lengths
    reader = open_source(job.worker_job().sources[0])
    assert lengths.tolist() == [len(reader.read(61)), 0, 0, len(reader.read(0))]
    assert [i for i, _, _ in reply.message.skipped] == [1, 2]
    assert "corrupt JSON line" in reply.message.skipped[0][1] and reply.message.skipped[0][2] == "corrupt"
    entry = core.cache[doc_key(0, 61)]
    assert isinstance(entry, CacheEntry) and entry.copies == 1 and entry.length == lengths[0]


def test_deliver_sends_each_rank_its_pieces_then_acknowledges_and_releases(dataset_dir):
    core, job = _welcomed(dataset_dir)
    core.handle(P.Prepare(task_id=1, source=0, worker_id=core.worker_id or 0,
                          records=np.array([5, 5], dtype=np.uint64)))
    assert core.cache[doc_key(0, 5)].copies == 2  # two stream positions hold the same record
    key, n = doc_key(0, 5), core.cache[doc_key(0, 5)].length
    mapped = doc_key(1, 2)
    items = np.array([[0, 0, key, 0, 4], [1, 3, mapped, 1, 5], [0, 1, key, 4, n - 4]], dtype=np.uint64)
    actions = core.handle(P.Deliver(worker_id=core.worker_id or 0, delivery_id=7, step=2,
                                    addresses=["tcp://a", "tcp://b"], items=items,
                                    release=np.array([key], dtype=np.uint64),
                                    targets=np.array([[0, 0], [1, 1]], dtype=np.uint64)))
    to_ranks = [a for a in actions if isinstance(a, ToRank)]
    assert [(a.address, a.message.rank) for a in to_ranks] == [("tcp://a", 0), ("tcp://b", 1)]
    web = open_source(job.worker_job().sources[0]).read(5)
    assert to_ranks[0].message.tokens.tolist() == web.tolist()  # both pieces, in recipe order
    code = open_source(job.worker_job().sources[1]).read(2)
    assert to_ranks[1].message.tokens.tolist() == code[1:6].tolist()  # read from the memory map
    assert actions[-1] == ToCoordinator(P.Delivered(worker_id=3, delivery_id=7, failed=[], unserved=0))
    assert core.cache[key].copies == 1  # one copy used up, one left


def test_a_delivery_read_once_gives_each_rank_its_rows_grouped_by_source_and_leaves_out_bad_pieces(dataset_dir):
    """The pieces of a whole delivery are read together (source by source), then split by rank:
    each rank's message holds its rows grouped by source, in row order within a source, and a
    piece beyond its document is left out of its own rank's message only."""
    core, job = _welcomed(dataset_dir)
    core.handle(P.Prepare(task_id=1, source=0, worker_id=core.worker_id or 0,
                          records=np.array([5, 7], dtype=np.uint64)))
    web, code = (open_source(job.worker_job().sources[i]) for i in (0, 1))
    w5, w7, c2, c3 = web.read(5), web.read(7), code.read(2), code.read(3)
    items = np.array([[1, 0, doc_key(1, 3), 2, 3],            # rank 1, mapped
                      [0, 0, doc_key(0, 7), 0, 2],            # rank 0, cached
                      [0, 1, doc_key(1, 2), 0, 4],            # rank 0, mapped
                      [1, 1, doc_key(0, 5), 1, 3],            # rank 1, cached
                      [0, 2, doc_key(0, 5), 0, 1],            # rank 0, cached
                      [1, 2, doc_key(1, 2), len(c2), 1],      # rank 1, beyond its document
                      [0, 3, doc_key(1, 3), 0, 1]], dtype=np.uint64)
    actions = core.handle(P.Deliver(worker_id=core.worker_id or 0, delivery_id=4, step=0,
                                    addresses=["tcp://a", "tcp://b"], items=items, release=np.zeros(0, dtype=np.uint64),
                                    targets=np.array([[0, 0], [1, 1]], dtype=np.uint64)))
    to_ranks = {a.message.rank: a.message for a in actions if isinstance(a, ToRank)}
    assert to_ranks[0].items[:, 0].tolist() == [0, 2, 1, 3]  # source 0's rows, then source 1's
    assert to_ranks[0].tokens.tolist() == [*w7[:2], *w5[:1], *c2[:4], *c3[:1]]
    assert to_ranks[1].items[:, 0].tolist() == [1, 0]  # the piece beyond its document is not sent
    assert to_ranks[1].tokens.tolist() == [*w5[1:4], *c3[2:5]]
    assert isinstance(actions[-1].message, P.Delivered)


def test_an_unknown_piece_is_not_sent_and_a_forgotten_worker_starts_clean(dataset_dir):
    core, _ = _welcomed(dataset_dir)
    items = np.array([[0, 0, doc_key(0, 9), 0, 4]], dtype=np.uint64)  # never prepared here
    actions = core.handle(P.Deliver(worker_id=core.worker_id or 0, delivery_id=1, step=0, addresses=["tcp://a"],
                                    items=items, release=np.zeros(0, dtype=np.uint64),
                                    targets=np.array([[0, 0]], dtype=np.uint64)))
    assert not [a for a in actions if isinstance(a, ToRank)] and isinstance(actions[-1].message, P.Delivered)
    core.handle(P.Prepare(task_id=2, source=0, worker_id=core.worker_id or 0,
                          records=np.array([1], dtype=np.uint64)))
    assert core.handle(P.UnknownPeer(reason="restarted")) == [Forgotten()]
    assert core.cache == {} and core.worker_id is None
    assert core.handle(P.Prepare(task_id=3, source=0, worker_id=core.worker_id or 0,
                                 records=np.array([1], dtype=np.uint64))) == []


def test_a_record_over_max_record_bytes_is_skipped_before_it_is_decoded(dataset_dir):
    raw = job_dict()
    raw["sources"]["web"]["max_record_bytes"] = 400
    job = parse_job(raw, "job.yaml", base_dir=dataset_dir)
    core = WorkerCore()
    core.handle(P.Welcome(worker_id=1, heartbeat_s=0.5, job=job.worker_job().to_wire(), count=[]))
    reader = open_source(job.worker_job().sources[0])
    sizes = [int(reader.shards[0].offsets[i + 1] - reader.shards[0].offsets[i]) for i in range(60)]
    big = [i for i, n in enumerate(sizes) if n > 400]
    small = [i for i, n in enumerate(sizes) if n <= 400]
    assert big and small
    records = np.array(big[:2] + small[:2], dtype=np.uint64)
    [reply] = core.handle(P.Prepare(task_id=1, source=0, worker_id=core.worker_id or 0, records=records))
    skipped = reply.message.skipped
    assert [(i, kind) for i, _, kind in skipped] == [(0, "over_limit"), (1, "over_limit")]
    assert f"web-0.jsonl:{big[0] + 1}" in skipped[0][1] and "max_record_bytes (400)" in skipped[0][1]
    assert reply.message.lengths.tolist()[2:] == [len(reader.read(small[0])), len(reader.read(small[1]))]


class _FailsOn:
    """A real reader that raises an unexpected error (not a RecordError) for one record, as a
    decoder, a tokenizer or the allocator may."""

    def __init__(self, reader, record: int, error: BaseException) -> None:
        self._reader, self._record, self._error = reader, record, error

    def read_prepared(self, record: int, epoch: int = 0):  # what the core calls to prepare a record
        if record == self._record:
            raise self._error
        return self._reader.read_prepared(record, epoch)

    def __getattr__(self, name):
        return getattr(self._reader, name)


def test_any_error_while_reading_one_record_is_a_skip_naming_the_record(dataset_dir):
    core, job = _welcomed(dataset_dir)
    real = open_source(job.worker_job().sources[0])
    for error in (MemoryError(), ValueError("tokenizer blew up")):
        core.cache.clear()
        core.readers[0] = _FailsOn(real, 7, error)
        [reply] = core.handle(P.Prepare(task_id=1, source=0, worker_id=core.worker_id or 0,
                                        records=np.array([6, 7, 8], dtype=np.uint64)))
        [(i, reason, kind)] = reply.message.skipped
        assert (i, kind) == (1, "error")
        assert "web-0.jsonl:8" in reason and type(error).__name__ in reason
        assert reply.message.lengths.tolist() == [len(real.read(6)), 0, len(real.read(8))]


def test_a_ranks_pieces_with_a_processors_arrays_are_split_into_messages_of_bounded_size(monkeypatch):
    """Pixel values are megabytes a sample: a rank's step of them goes as several messages, each
    valid on its own, together holding every piece once, in order."""
    import worker.core as core_module
    from msd_common import wire
    from worker.core import DeliveryPieces
    from worker.processor import ProcessedSample

    n = 7
    items = np.zeros((n, len(P.DELIVER_ITEM)), np.uint64)
    items[:, P.DELIVER_ITEM.piece] = np.arange(n)
    items[:, P.DELIVER_ITEM.doc_key] = np.arange(n) + 100
    items[:, P.DELIVER_ITEM.length] = 5
    pieces = DeliveryPieces(items, np.zeros(n, np.int64))
    pieces.servable[:] = True
    for i in range(n):
        pieces.tokens[i] = np.arange(5, dtype=np.uint16)
        pieces.masks[i] = 5
        sample = ProcessedSample(np.arange(5, dtype=np.int32), np.ones(5, np.uint8),
                                 {"mm_token_type_ids": np.zeros(5, np.int64)},
                                 {"pixel_values": np.full((4, 6), i, np.float32),
                                  "image_grid_thw": np.array([[1, 2, 2]], np.int64)}, 1, 4)
        pieces.add_extras(i, sample, 0, 5)
    monkeypatch.setattr(core_module, "MESSAGE_EXTRA_BYTES", 3 * (4 * 6 * 4 + 24 + 40))  # three samples a message
    chunks = pieces.message_rows(np.ones(n, dtype=bool))
    assert [int(c.sum()) for c in chunks] == [3, 3, 1]
    seen = []
    for selected in chunks:
        rows, tokens, counts, patches, mask, extras, extra_rows, frames = pieces.join(selected)
        header = P.make(P.Pieces, step=0, rank=0, dtype="<u2", patch_bytes=0, extras=extras)
        _, arrays = wire.decode([bytes(f) for f in wire.encode(header, rows[:, P.DELIVER_ITEM.piece:], tokens, counts,
                                                               patches.reshape(-1), mask, extra_rows, tail=frames)],
                                P.TRAINER_DATA_INBOX)
        seen += arrays["items"][:, P.PIECE_ITEM.piece].tolist()
    assert seen == list(range(n))
    monkeypatch.setattr(core_module, "MESSAGE_EXTRA_BYTES", 1 << 30)
    assert len(pieces.message_rows(np.ones(n, dtype=bool))) == 1
    # an array in another row shape (a processor's batch of one) starts a message of its own: one
    # message declares one row shape an array
    pieces.extras[3] = {**pieces.extras[3], "pixel_values": np.full((1, 4, 6), 3, np.float32)}
    chunks = pieces.message_rows(np.ones(n, dtype=bool))
    assert [np.flatnonzero(c).tolist() for c in chunks] == [[0, 1, 2], [3], [4, 5, 6]]
    rows, tokens, counts, patches, mask, extras, extra_rows, frames = pieces.join(chunks[1])
    assert dict((e[0], e[2]) for e in extras)["pixel_values"] == [4, 6]
