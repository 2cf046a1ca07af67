// Package engine is the volume engine: the only writer of a volume. It
// runs where the volume is attached (the CSI node plugin, or stor-ctl nbd
// serve), opens every replica of the volume at the epoch its attach
// obtained from the Raft leader, and implements a block device over them.
//
// # The rules it keeps (DESIGN.md, "Data path")
//
//  1. Fencing: Open attaches the volume (a new epoch, committed in Raft) and
//     opens each replica at that epoch; every request carries it. When any
//     replica refuses the epoch, or the control plane does, a newer attach
//     exists: the engine is fenced, and every later call fails with
//     ErrFenced without touching a replica. A detach raises the epoch too,
//     so an engine that outlives its detach (a zombie on a lost node) is
//     fenced by its watch or, blind, by the replicas, which their servers
//     fence at the volume's committed epoch.
//  2. The ack rule: a write (WriteAt, WriteZeroes, Trim) returns nil only
//     after every replica in the engine's write set applied it. When one
//     fails, the engine first has the leader commit that replica as faulty
//     (SetReplicaState, fenced by the epoch) and only then returns. If the
//     leader cannot be reached the write waits (bounded by FaultTimeout);
//     it is never acknowledged on a guess. markFaulty returns nil only once
//     the replica is committed faulty (or confirmed out of the set); every
//     other answer (faultAnswers, one table of control-plane codes: the
//     last healthy replica, a timeout, a code it does not expect) fences
//     the engine or stops it: the write fails with an I/O error and the
//     engine serves nothing more, so a replica that missed a write applied
//     elsewhere is never read from again (the next open reconciles the
//     replicas). Before
//     acknowledging, the engine applies the request once more to the
//     replicas that took it, at the new generation, so their write history
//     names every region the faulty replica may lack (a delta rebuild
//     copies the regions written at or after the generation of the fault
//     that took it out of the healthy set, however many of its rebuilds
//     fail after: raftstore/replicastate.go).
//  3. Flush: Flush waits for the writes that began before it, then sends a
//     flush to every replica in the write set; each replica makes every
//     write it completed durable, and every write the engine acknowledged
//     was completed on all of them. Flushes are serialised, on every path
//     (Flush, Close, the reconcile at Open, a rebuild's flushes of its
//     target), and each waits for the writes that began before it: that
//     is what the replicas' dirty-region logs need to clear a region
//     safely (Engine.flushOrdered). The caller's cancellation
//     never interrupts a write half-way across the replicas; a replica
//     that does not answer within IOTimeout has failed, and an engine that
//     cannot record a failure within FaultTimeout stops serving.
//  4. Unclean stop: Open collects the dirty regions of every replica it
//     opened and copies them from one healthy replica (the local one when
//     there is one) to the others before it serves any I/O, so no two
//     reads can see two versions of a block.
//  5. Reads go to one healthy replica, the local one first; a replica that
//     fails a read is marked faulty and the read is retried on another. A
//     read of a block with a write in flight waits for that write, so it
//     never returns a value that is not yet on every replica. A replica of
//     a server on this host (Config.LocalReaders) is read directly from
//     its files while its server vouches for them (replica/localread;
//     localread.go): only a healthy replica, only under the read's overlap
//     span, and a read whose view went stale (an epoch, snapshot, rebuild,
//     size or server change) is discarded and sent to the server instead.
//  6. A replica's error is the replica's failure, never the request's
//     (replica.ErrInvalid included): the engine checks every request
//     against the volume's size and alignment, and splits it to the
//     replicas' limits, before any replica sees it. Only a stale epoch
//     (fenced) is not a replica's own failure.
//  7. Every replica in the write set is as large as the volume: Open grows
//     every replica to the committed size before any I/O (a volume
//     expanded while detached), a replica is grown before it joins the
//     write set, and an expansion grows the replicas before the engine.
//  8. Rebuild: a rebuilding replica is in the write set, so it receives
//     every write that takes the set after it joined. The rebuild waits
//     for the writes that took the set before (they miss the target and
//     may not yet be on any source when the copy is planned), and copies
//     each chunk while holding its range against writes: the copy of a
//     block and a write to that block never interleave. Several chunks
//     are copied at once, each under its own hold; a checkpoint names
//     only an offset below which every chunk was copied before the
//     target's flush (rebuild.go). Under the hold, the target's server
//     reads the chunk from the source's server itself (REBUILD_COPY), so
//     the bytes cross one link, not two through the engine; a chunk the
//     target cannot read from the source is read and written by the
//     engine, which blames the source only if it cannot read it either.
//
// The ordering of writes, reads and rebuild copies to overlapping ranges
// is one first-come, first-served set (overlap.go).
//
// The engine follows the control plane's changes to its volume through the
// WatchVolume stream: a higher epoch fences it, a larger size grows the
// replicas, changes to the replica set update the write set, and pending
// snapshots are cut with writes held (snapshot.go). A detached volume's
// snapshots are cut by CutDetached, which fences the volume at an epoch of
// its own, opens and reconciles its replicas as Open does, and cuts them
// at one point.
//
// # Concurrency
//
// All methods are safe for concurrent use. Writes are fanned out to the
// replicas in parallel; the write set is guarded by one mutex and copied
// per request, so a request sees one consistent set.
package engine
