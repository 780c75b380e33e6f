"""What erasing a user from the Avro archive costs: the forget agent's rewrite vs a plain copy.

Builds an archive of N ``ConversationTurn`` messages (the real ``Archiver``: 6 partitions over H
UTC hours, one file per partition and hour, ~600-byte turns of ``--users`` users of two tenants)
in a temporary folder, then times, median of ``--repeats`` runs each on a fresh copy of it:

- **rewrite, worst case**: erase a user who has turns in every file, so every file is read,
  the subject's records decoded and every file rewritten atomically (``streams.archive_erasure``:
  dot-file, fsync, rename, folder fsync): what ``Archiver.erase`` does under the archive's lock;
- **rewrite, typical**: erase a user whose 10 turns are in one partition over two hours (a
  conversation's worth: 2 files rewritten, the others passed over by their blocks' bytes);
- **baseline, plain copy**: every file's bytes copied to a dot-file, fsynced, renamed back over
  it and its folder fsynced: the same I/O and durability as a rewrite of every file, with no
  decoding or re-encoding.

The last line is the headline: worst-case rewrite time / plain copy time (what the rewrite costs
over the I/O floor). ``--quick``: 20,000 turns, a few seconds; default 200,000.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from schemas.codec import default_codec
from schemas.records import ConversationTurn, FinishReason
from streams.archive import Archiver
from streams.archive_erasure import archive_files, erase_from_archive
from streams.erasures import Subject
from transport.archive import ArchivedMessage

HOUR_MS = 3_600_000
T0 = 1_790_000_000_000 - 1_790_000_000_000 % HOUR_MS
TOPIC = "bench.chat.turns"
PARTITIONS = 6
WORST = ("acme", "everywhere")  # one turn in every (partition, hour) file
TYPICAL = ("acme", "afternoon")  # 10 turns in one partition over two hours: one conversation's worth


def build(root: Path, turns: int, hours: int, users: int) -> None:
    codec = default_codec()
    filler = "lorem ipsum dolor sit amet " * 10
    messages = []
    per_file = max(1, turns // (PARTITIONS * hours))
    offset = {p: 0 for p in range(PARTITIONS)}
    for hour in range(hours):
        for p in range(PARTITIONS):
            for i in range(per_file):
                if i == 0:
                    tenant, user = WORST
                elif p == 0 and hour in (3, 4) and i <= 5:
                    tenant, user = TYPICAL
                else:
                    n = (hour * PARTITIONS * per_file + p * per_file + i) % users
                    tenant, user = ("acme" if n % 2 else "globex"), f"u{n:05d}"  # no id contains another
                created = T0 + hour * HOUR_MS + i
                turn = ConversationTurn(conversation_id=f"{user}-c{i % 3}", user_id=user, tenant=tenant,
                                        request_id=f"r{hour}-{p}-{i}", turn_index=i, prompt=f"{user}: {filler}",
                                        answer=filler, model="smollm2", worker_id="w", tokens_in=120, tokens_out=60,
                                        queue_ms=1.0, total_ms=900.0, finish_reason=FinishReason.STOP,
                                        created_at=created, completed_at=created + 900)
                messages.append(ArchivedMessage(TOPIC, p, offset[p], created, turn.conversation_id.encode(),
                                                codec.encode(turn), (("traceparent", b"00-" + b"a" * 51),)))
                offset[p] += 1
    Archiver(root).write(messages)


def plain_copy(root: Path) -> None:
    for path in archive_files(root, TOPIC):
        tmp = path.with_name(f".{path.name}.tmp")
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def timed(pristine: Path, work: Path, action) -> tuple[float, object]:
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(pristine, work)
    started = time.perf_counter()
    result = action(work)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20,000 turns, a few seconds")
    parser.add_argument("--turns", type=int, default=None, help="turns in the archive (default 200,000)")
    parser.add_argument("--hours", type=int, default=24, help="UTC hours the turns span")
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    turns = args.turns or (20_000 if args.quick else 200_000)
    codec = default_codec()
    with tempfile.TemporaryDirectory(prefix="bench-erasure-") as tmp:
        pristine, work = Path(tmp) / "pristine", Path(tmp) / "work"
        started = time.perf_counter()
        build(pristine, turns, args.hours, args.users)
        files = archive_files(pristine, TOPIC)
        size = sum(p.stat().st_size for p in files)
        print(f"archive: {turns:,} turns in {len(files)} files, {size / 2**20:.1f} MiB, built in "
              f"{time.perf_counter() - started:.1f} s (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        times: dict[str, list[float]] = {"copy": [], "worst": [], "typical": []}
        for r in range(args.repeats):
            sides = [("copy", plain_copy),
                     ("worst", lambda w: erase_from_archive(w, [TOPIC], Subject(*WORST, None), 2**62, codec)),
                     ("typical", lambda w: erase_from_archive(w, [TOPIC], Subject(*TYPICAL, None), 2**62, codec))]
            if r % 2:
                sides.reverse()  # alternate who goes first: page cache and load affect both alike
            for name, action in sides:
                seconds, result = timed(pristine, work, action)
                times[name].append(seconds)
                done = "" if result is None else (f", {result.records_removed} records removed, "
                                                  f"{result.files_rewritten} of {result.files_scanned} files rewritten")
                print(f"run {r + 1} {name:7}: {seconds:.3f} s{done}")
        w, t, c = (statistics.median(times[name]) for name in ("worst", "typical", "copy"))
        print(f"median of {args.repeats}: rewrite worst case {w:.3f} s ({turns / w:,.0f} turns/s scanned), typical "
              f"user {t:.3f} s ({t / c:.2f}x the copy), plain copy {c:.3f} s ({size / 2**20 / c:.0f} MiB/s)")
        print(f"erasure rewrite (every file affected) / plain copy of the same files: {w / c:.2f}x")


if __name__ == "__main__":
    main()
