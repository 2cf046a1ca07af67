// Package jepsen is stor's Jepsen-style fault-injection harness: real
// stor-server processes on hosts of their own, real network partitions,
// process kills and pauses, slow and lossy links, disk errors, and a
// linearizability checker over the history the workload records.
//
// # Hosts
//
// Every host is a network namespace (named storj-s0, storj-c0, ...) with
// an address in 198.18.0.0/24 on a veth pair joined to a bridge
// (storjbr0, 198.18.0.1 in the root namespace, where the harness itself
// runs its control client). Each host filters its traffic with an
// nftables table of its own ("inet storj"), empty while the network is
// healthy. Everything carries the "storj" prefix, so a run first removes
// what a crashed run left behind (Cleanup); Cluster.Close removes it
// again. Processes started in a host die with the harness
// (PR_SET_PDEATHSIG).
//
// Server hosts run the stor-server binary (built with the jepsenfaults
// tag, which adds the disk-fault switch: SIGUSR1 makes the replica
// store's writes and syncs fail with EIO, SIGUSR2 heals) and a link proxy
// (RunProxy) that fronts its Raft and data ports; the server advertises
// the proxy's ports, so every Raft and replica connection crosses it.
// Every port speaks mutual TLS: a run makes a CA of its own in its data
// dir (data/tls), a certificate per server (stor://server/<id>) and one
// operator certificate (Operator) that everything else presents — the
// harness's control clients (the nemeses replace replicas, detach, expand
// and snapshot), the checkers' replica reads (an inspection, which the
// data port grants only to an operator) and the client processes (whose
// engines attach with a takeover, which a csi-node may not).
// Client hosts run a client process (RunClient): the volume engine opened
// as stor-ctl nbd serve opens it, driven over stdin/stdout with JSON
// requests, so that it can be killed with SIGKILL. The process also
// serves its engine as an NBD export (nbd.Server, as stor-ctl nbd serve
// does) over NBDConns in-process connections; a request can name one, and
// then goes over it as an NBD command (multiconn.go). Both roles are the
// test binary re-executed (TestMain dispatches on STOR_JEPSEN_ROLE).
//
// # A run
//
// Run creates a 3-replica volume, opens it on client host c0 and fills
// the rest of every register's 1 MiB stride with filler (so that a
// rebuild has some 16 MiB to copy); workers (logical clients) write
// self-identifying values (op id, block, seed and a SHA-256, see
// encodeValue) to a set of 4 KiB registers 1 MiB apart, read them back
// and flush, while a schedule drawn from the seed injects one fault at a
// time (Nemesis: Inject, hold 2-6 s, Heal, 1-3 s quiet).
// Every 2-5 s the harness snapshots the volume through the control plane
// and waits until the snapshot is ready (and clones one in three), or
// deletes an earlier one.
// Then it heals everything, flushes, kills every server and the engine
// with SIGKILL, restarts the servers, opens the volume again and reads
// every register, every snapshot still listed from every replica that
// cut it, and every clone from each of its replicas. The choices (faults, victims, blocks, operations) are
// reproducible from the seed; the timing of real processes is not.
//
// # Nemeses
//
// Single faults: partitions (halves, the leader, the client from one
// server, a ring, one way), SIGKILL and SIGSTOP of a server or the leader,
// SIGKILL of the engine, slow and lossy links (the proxy), disk errors
// (EIO) and a full disk (ENOSPC) on one server's replica store, a
// takeover by the other client host, an online expansion. Compound faults
// (Inject runs a whole scenario, bounded in time; Report.FaultHits counts
// those that landed where aimed): rebuild-target and rebuild-source wait
// for a replica to be REBUILDING and kill, cut off or stall the rebuild's target,
// or its source, mid-copy, then fault the retry again (rebuild.go);
// replace-replica replaces a healthy replica under load and faults the new
// one mid-copy; flush-storm writes and flushes over every NBD connection
// at once, several flushes in flight, and in one storm of two kills the
// engine in the middle (multiconn.go); detach-expand detaches cleanly,
// expands offline, reattaches and writes the new space; detach-snapshot
// detaches the volume under a zombie engine that keeps writing,
// snapshots and clones the detached volume, and reattaches (detach.go).
// docs/JEPSEN.md has the table.
//
// # Checkers
//
//   - linearizability per register (porcupine): a failed or timed-out
//     write is indeterminate (it may take effect at any later time, or
//     never), as in etcd's robustness tests; failed reads are dropped;
//   - integrity: no read returns a torn block or another block's or
//     another run's value;
//   - fencing: no write is acknowledged by an engine at epoch e after an
//     open at a higher epoch returned, or after a cut of the volume
//     detached from it (which fences its replicas) was done;
//   - durability: after the full restart each register holds the newest
//     write acknowledged before the last completed flush, or a later one;
//   - expansion: after an online expansion the engine serves the new space;
//   - divergence: after the full restart and the final open, every healthy
//     replica holds the same value in every register (readReplicas); right
//     after the reconcile that follows a flush-storm kill, every healthy
//     replica holds the same value in every cold register
//     (checkReconciledReplicasAgree); and once each rebuild-writes rebuild
//     is over, every healthy replica holds the last write to each cold
//     register (checkReplicasHoldLastWrite);
//   - snapshots: every replica that cut a ready snapshot serves the same
//     contents, and they are the volume at one instant between the
//     snapshot's request and the moment it was seen ready, consistent
//     with the registers' linearizations; a clone holds its snapshot
//     (checkSnapshots). Only replicas still listed CUT after the run are
//     read: a replica that left the volume took its copy with it, and the
//     control plane lists its entry LOST;
//   - snapshot losses: a snapshot acknowledged ready whose every copy went
//     with replicas that left the volume (replace-replica, the leader's
//     repair) is listed failed after the run. When the control plane
//     recorded that loss (the snapshot is failed, with LOST entries naming
//     why), it refused to hide it: that is a reported limitation, counted
//     in Report.SnapshotsLost (snapshots-lost), not an anomaly. It is an
//     anomaly only when the loss is silent: the listing still says
//     ready/CUT but a CUT copy does not read back (checkSnapshots), or an
//     acknowledged snapshot turned failed with no copy recorded LOST
//     (checkSnapshotLosses). A removal the control plane refuses because
//     the replica holds the last copy of a snapshot (FailedPrecondition)
//     is a failed "replica-remove" op of replace-replica, not a harness
//     error.
//
// A run writes report.json, summary.txt and history.jsonl to its
// directory, and porcupine's HTML visualization for every register whose
// history is not linearizable.
package jepsen
