// Package replica is a server's on-disk store of volume replicas: the
// bottom of stor's data path. The replica data service (replica/wire)
// serves it over the network; the volume engine (replica/engine) fans
// writes out to several of them. Nothing here knows about Raft: the epoch
// and generation numbers arrive with each request.
//
// # Units
//
// Volume sizes are multiples of BlockSize (4096). Offsets and lengths of
// I/O must be multiples of SectorSize (512) and inside the volume; anything
// else is ErrInvalid. One request carries at most MaxIO bytes.
//
// # Layout on disk
//
// Each replica is a directory <store dir>/<replica id>/ holding:
//
//   - meta.json: volume id, replica id, size, and the layer chain (oldest
//     snapshot layer first, the writable head last). Replaced atomically
//     (write temp, fsync, rename, fsync dir).
//   - epoch: the highest epoch seen, with a checksum; written durably before
//     the request that raised it is answered.
//   - one sparse data file per layer (a block lives at its volume offset)
//     and an index of the blocks the layer holds. A block present in a
//     layer's index but a hole in its file reads as zeroes (that is how
//     WRITE_ZEROES and TRIM mask older layers). Reads fall through the
//     chain from the head to the oldest layer; a block in no layer reads as
//     zeroes.
//   - the dirty-region log: one bit per region (RegionSize, default 1 MiB),
//     set durably before the first write to a region after it was cleared,
//     cleared lazily after flushes.
//   - the write history: per region, the highest replica-set generation of
//     a write there, for delta rebuilds.
//
// # Invariants
//
//  1. Fencing: every request carries an epoch. A request below the highest
//     epoch seen is refused with ErrStaleEpoch and changes nothing; a
//     request above it raises it durably first.
//  2. Flush: when Flush returns, every write that completed before Flush was
//     called is durable, data and index. A write with FUA is durable when it
//     returns. A write not yet flushed may be lost by a crash; it never
//     damages blocks that were flushed (the index only names a block once
//     its data is durable, so a crash shows either the block's old contents
//     or its new ones).
//  3. Dirty regions: every region with a write that may not be durable on
//     this replica, or that may differ from the other replicas because the
//     engine stopped uncleanly, is in DirtyRegions after a restart.
//  4. Rebuild: between BeginRebuild and EndRebuild, RebuildWrite never
//     overwrites a block that a normal write (WriteAt, WriteZeroes, Trim)
//     touched after BeginRebuild.
//  5. Snapshots: a snapshot's contents never change; deleting a snapshot
//     merges its blocks into the next layer up without changing what any
//     remaining view reads.
//
// # Concurrency
//
// Replica methods are safe for concurrent use. Writes to disjoint ranges
// proceed in parallel; overlapping writes are applied in some order, as a
// disk would. Snapshot cuts and merges are serialised with writes.
package replica
