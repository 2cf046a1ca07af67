// Package replica is a server's on-disk store of volume replicas: the
// bottom of stor's data path. The replica data service (replica/wire)
// serves it over the network; the volume engine (replica/engine) fans
// writes out to several of them. Nothing here knows about Raft: the epoch
// and generation numbers arrive with each request.
//
// # Units
//
// Volume sizes are multiples of BlockSize (4096), at most MaxSize. Offsets
// and lengths of I/O must be multiples of SectorSize (512) and inside the
// volume; anything else is ErrInvalid. One request carries at most MaxIO
// bytes; WriteZeroes and Trim carry no payload and name at most MaxZeroes
// (1 GiB), so that what one request costs (dirty-region, history and index
// marking) stays bounded.
//
// # Layout on disk
//
// Each replica is a directory <store dir>/<replica id>/ holding:
//
//   - meta.json: volume id, replica id, size, region size, and the layer
//     chain (oldest snapshot layer first, the writable head last; a
//     snapshot layer records its id and the volume size at its cut).
//     Replaced atomically (write temp, fsync, rename, fsync dir).
//   - epoch: the highest epoch seen, with a checksum; written durably before
//     the request that raised it is answered. It also holds the highest
//     replica-set generation seen (see "Write history").
//   - one sparse data file per layer (layer-<n>.data: a block lives at its
//     volume offset) and an index of the blocks the layer holds
//     (layer-<n>.idx). A block present in a layer's index but a hole in its
//     file reads as zeroes (that is how WRITE_ZEROES and TRIM mask older
//     layers). Reads fall through the chain from the head to the oldest
//     layer; a block in no layer reads as zeroes.
//   - the dirty-region log (dirty): one bit per region (RegionSize, default
//     1 MiB), set durably before the first write to a region after it was
//     cleared, cleared lazily after flushes.
//   - the write history (history): per region, the highest replica-set
//     generation of a write there, for delta rebuilds.
//
// A Store creates a replica in .creating-<id> and renames it into place,
// and deletes one by renaming it to .deleting-<id> first; OpenStore removes
// such leftovers, and layer files that meta.json does not name. A Create
// that fails after its rename (the directory sync or the open failed:
// EMFILE, EIO) renames the directory to .deleting-<id> and removes it, so
// a failed Create leaves nothing a later Create or OpenStore would take
// for a replica; if even that rename fails, the directory (complete: all
// of it was synced before the rename) is adopted by a retried Create of
// the same replica and volume.
//
// # On-disk formats
//
// Integers are big-endian; checksums are CRC-32C (Castagnoli).
//
// Journals (the layer indexes and the write history) are a 32-byte header
// (magic "STORJNL1", kind u32, version u32, reserved, CRC of bytes 0..27)
// followed by batches, one per append: magic u32 "STBJ", seq u64 (one more
// than the previous batch), payload length u32, CRC u32 of the batch
// header's first 16 bytes and the payload, payload. Each append is synced
// before the next is written, so a crash can only tear the last one.
// Replay stops at the first bad batch: if a good batch with a higher seq
// follows somewhere, the bad one was synced and then damaged (ErrCorrupt);
// otherwise it is a torn tail, ignored and truncated. A journal that has
// grown to twice its live records (and at least 4096) is compacted: its
// whole state is written to <name>.tmp, synced and renamed over it.
//
// An index journal's payload is records of 17 bytes: kind u8 (1: the
// blocks entered the layer; the only kind), first block u64, block count
// u64. A layer's index only grows: a zeroed or trimmed block stays in it
// as a hole, so Extents reports it (allocated as a zero mask) and a
// rebuild copies its zeroes.
// A history journal's payload is validFrom u64 and then records of 24
// bytes: first region u64, region count u64, generation+1 u64 (the maximum
// is kept per region).
//
// The epoch file is two 512-byte slots, each written by one sector write
// and synced: magic "STOREPC1", seq u64, epoch u64, generation u64, CRC of
// those 32 bytes. The valid slot with the higher seq wins, so a raise torn
// by a crash leaves the previous value, which is all that was ever
// acknowledged.
//
// The dirty log is a 4096-byte header (magic "STORDRT1", region size u64,
// version u32, CRC) followed by the bitmap: bit r%8 of byte r/8 is region
// r.
//
// # Invariants
//
//  1. Fencing: every request carries an epoch. A request below the highest
//     epoch seen is refused with ErrStaleEpoch and changes nothing; a
//     request above it raises it durably first. The check and the request
//     are one step: every request holds the replica's operation lock shared
//     from its check to its last effect, and raising the epoch takes it
//     exclusively, so once a raise returns, no request of a lower epoch is
//     still applying anything.
//  2. Flush: when Flush returns, every write that completed before Flush was
//     called is durable, data and index. A write with FUA is durable when it
//     returns. A write not yet flushed may be lost by a crash; it never
//     damages blocks that were flushed (the index only names a block once
//     its data is durable, so a crash shows either the block's old contents
//     or its new ones). Concretely: a write puts its data in the head's file
//     and then enters its blocks into the in-memory index (so reads see it
//     at once); a sync takes the index changes made so far, fsyncs the data
//     file, then appends those changes to the index journal and fsyncs it.
//     A block new to the head that a crash finds unnamed by the journal
//     reads as before (from a lower layer, or zeroes); a block overwritten
//     in place reads as old or new per filesystem page (the unit a crash
//     keeps or loses), and blocks are page-aligned.
//  3. Dirty regions: every region with a write that may not be durable on
//     this replica, or that may differ from the other replicas because the
//     engine stopped uncleanly, is in DirtyRegions after a restart.
//  4. Rebuild: between BeginRebuild and EndRebuild, RebuildWrite never
//     overwrites a block that a normal write (WriteAt, WriteZeroes, Trim)
//     touched after BeginRebuild. It is tracked per sector: RebuildWrite
//     fills the sectors of a block that no normal write touched.
//  5. Snapshots: a snapshot's contents never change; deleting a snapshot
//     merges its blocks into the next layer up without changing what any
//     remaining view reads.
//
// A partial-block write (512-aligned, not 4096-aligned) to a block the head
// lacks first copies the block up from the layers below, so a block in the
// head's index is always complete.
//
// After a failed fsync the replica refuses every request with ErrIO until
// it is reopened: the kernel may have dropped the unsynced pages, so a
// later fsync that succeeds would not mean what it says.
//
// # Dirty regions
//
// Before a write is applied, every region it touches is marked: if the
// region's bit is clear, it is set and the log is fdatasynced first. A
// region is cleared at the end of a Flush only if no write to it is in
// flight and the last write to it finished before the previous completed
// Flush began (two-flush hysteresis). That is safe with concurrent writes:
// a write marks its regions before it is applied and notes them again when
// it finishes, and a region with a write in flight is never cleared; a
// write that finished before the previous Flush began is durable since
// that Flush (its data, index and history were synced by it). The extra
// flush of slack is for the other replicas: a write the engine sent to
// all of them may have finished here while another replica has not yet
// applied (and so not yet marked) it. The engine's side of the bargain:
// it does not send a replica flush k+1 until every write it sent before
// flush k has been answered by every replica in the set, or that replica
// has been failed out of it (an engine whose flush first waits for the
// writes sent before it keeps this; an error answer counts only once the
// replica is recorded faulty, so an engine that cannot record a failure
// flushes nothing more). The hysteresis also keeps
// regions under steady writing dirty instead of paying an fdatasync for
// the mark after every flush. Clearing writes the bit without a sync (a
// lost clear leaves a region dirty, which is safe).
//
// The engine reads DirtyRegions when it attaches, before serving I/O, and
// reconciles those regions; the bits are then cleared by the rule above.
// A rebuild with no engine's write order (a server's rebuild of a
// detached volume) reconciles nothing: one that resumes a checkpoint
// copies the target's dirty regions below it again, since a write an
// engine that died left on the target alone is in one
// (engine.RebuildPlan.ResumeFrom).
//
// Except the regions that were dirty when this process opened the replica
// (owed): they may hold writes the replica acknowledged and lost in a
// crash, and nothing else records them. A replica that crashed while its
// volume was attached is faulty and rejoins the volume to be rebuilt; the
// engine's flushes reach it from its rejoining on, before its rebuild
// reads its dirty regions, and used to clear them, so a delta rebuild
// (the writes since it left, by the other replicas' histories) left the
// lost writes out and the replica was recorded healthy without them. Owed
// regions therefore stay dirty until an EndRebuild with Op.FUA says they
// were copied: the engine sends it when a rebuild completes and, to the
// healthy replicas it reconciled, after its reconcile.
//
// In memory, the times a region's writes last started or finished are
// kept as runs of regions (runMap), not per region: marking a write, or a
// WriteZeroes of a million regions, costs the runs it meets.
//
// # Write history
//
// Each write notes, for every region it touches, its Op.Generation (the
// maximum is kept) in memory, as runs of regions of one generation
// (runMap: the cost of a write is the runs it meets, never its regions);
// every sync journals the changed runs. A request
// whose generation is higher than any seen first records it durably in the
// epoch file. After a crash, writes since the last sync are missing from
// the journal, but each is in a region still marked dirty and was made at
// a generation no higher than the durable maximum, so on open every dirty
// region is taken as written at that maximum: WrittenSince over-reports,
// never under-reports. A history that cannot be read is started afresh,
// valid from the generation after the highest seen; WrittenSince refuses
// older generations with ErrHistoryLost (the caller then does a full
// rebuild).
//
// # Snapshots
//
// CreateSnapshot holds the operation lock exclusively (no write is in
// flight), syncs, creates the new head's files, and renames a new
// meta.json in which the old head is the snapshot: the cut is exactly the
// writes completed before it. DeleteSnapshot copies, in chunks and under
// the same per-block lock that writes take, each block of the snapshot's
// layer that the next layer up lacks into that layer (a head write to the
// block always wins), syncs that layer, then drops the snapshot from
// meta.json and removes its files. A crash at any point leaves every view
// as it was: before meta.json changes, the copies read the same as the
// blocks they copy.
//
// Rebuild tracking lives in memory only: after a reopen the rebuilder
// calls BeginRebuild again and reads its source after that. Each tracking,
// from BeginRebuild to EndRebuild, is a session with a name of its own
// (RebuildSession); RebuildWriteSession writes only while that session is
// the one in progress, so bytes read from a source for one rebuild never
// land in the next one, whose tracking no longer knows the writes that
// the copy may be older than (a copy made by the target's server, or a
// relayed write still on its way, which its rebuilder gave up on).
// BeginRebuildSession begins and names in one step.
//
// RebuildWrite writes the head; snapshot layers are not rebuilt. That is
// the cluster's chosen rule (raftstore/snapshot.go): a snapshot is served only by the
// replicas its record names as having cut it. A replica that returns and
// is rebuilt in place (delta or full) keeps the layers it cut before, which
// never change, so it still serves those snapshots; a new replica (a
// replacement) holds no layers and serves none of the older snapshots.
//
// # Open files
//
// An open replica holds 3 files (epoch, dirty log, history) and 2 per
// layer. A server with thousands of replicas cannot keep them all open,
// so a Store keeps at most Config.MaxOpenFiles of them open (a soft
// bound: see below) and closes the least recently used idle replicas'
// files to make room. The rule, in one place:
//
//   - Closing takes the replica's operation lock exclusively, by TryLock
//     only: a replica with a request in flight (which holds it shared) or
//     a waiting exclusive operation is busy and is not closed. A replica
//     with a rebuild in progress, or pinned (Replica.Pin: the data service
//     pins every replica a client has open), is not closed either.
//   - Before its files are closed, everything the replica holds is made
//     durable by a sync (data, then index journals, then the write
//     history; the epoch file and the set bits of the dirty log are
//     always synced when written). A sync is not a Flush: the dirty log's
//     bits are not cleared by it (so the engine's flush contract is
//     untouched). A failed sync fails the replica as it always does.
//   - Files are closed, and the indexes of the snapshot layers dropped
//     (the sync made them durable in their journals: the memory of
//     thousands of idle replicas' snapshots would otherwise stay).
//     Everything else in memory stays: the head's index, the dirty
//     regions with their clearing times, the write history, the epoch,
//     a rebuild's tracking, a failure. Reopening opens the same paths
//     again and replays the snapshot layers' index journals, as the
//     first request after OpenStore does (below).
//   - Every request reopens the files (with the lock held exclusively)
//     when it finds them closed under its shared lock, and retries its
//     entry; so no request ever runs with a file closed.
//   - OpenStore opens a replica with snapshots only as far as recovery
//     needs: the epoch, the head and its index, the dirty log and the
//     write history (the head is scrubbed, orphans removed, the read
//     generation advanced), then closes them. Its snapshot layers are
//     not opened and their indexes not read until the first request
//     reopens the replica, which loads them (a layer loaded keeps its
//     index until the next idle close; the files are all open or all
//     closed). A snapshot layer's index that cannot be read then (or at
//     a reload after an idle close) fails the replica, as a failed
//     write does: it is refused from then on without another attempt,
//     and replaced by the cluster as any failed replica is, where before
//     OpenStore listed it as damaged and kept it unserved. A restart
//     thus reads no more per replica with snapshots than without
//     (docs/BENCHMARKS.md). The directory listing taken at open still
//     finds a replica missing a layer's file damaged, as before.
//
// Opening makes room first: idle replicas are closed, least recently
// used first, until the new files fit (and an eighth of the budget more,
// so that the choice is made once per many opens). If every open replica
// is busy the budget is exceeded rather than a request refused. A reopen
// that fails for want of descriptors (EMFILE, ENFILE: the process's other
// files) closes idle replicas regardless of the budget and tries once
// more, so that a request is not failed (and its replica taken for
// faulty by the engine) for a shortage the cache can relieve; so does the
// first open of a replica by OpenStore or Create (which would otherwise
// take it for damaged, or fail the create). The cache
// only ever tries a replica's lock (TryLock), so it cannot deadlock with
// a request holding its own; its own mutex is taken after a replica's.
//
// # Concurrency
//
// Replica methods are safe for concurrent use. Writes to disjoint ranges
// proceed in parallel; overlapping writes are applied in some order, as a
// disk would. Snapshot cuts and merges are serialised with writes (a cut
// with all of them, a merge with those to the blocks it copies). A read
// waits for writes to the blocks it reads (the block range lock), so a
// read racing a write to the same block returns the old or new data of
// each block, never a mix: the page cache alone does not give that (a
// pread racing a pwrite can see a page half copied; TestReadNeverSeesATornBlock).
//
// Lock order: Store.mu → Replica.snapMu → Replica.mu (the operation lock)
// → flushMu → the range lock → layer, log and history locks; the file
// cache's mutex after Replica.mu (other replicas' locks only by TryLock).
package replica
